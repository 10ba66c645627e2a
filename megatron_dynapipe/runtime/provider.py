"""The schedule provider: DynaPipe's forward-backward function in place of Megatron's.

* :func:`get_forward_backward_func` -- drop-in for megatron-core's function of the same name:
  DynaPipe's :func:`forward_backward_dynapipe` when DynaPipe is on (``install(args)`` with
  ``--dynapipe``, ``configure(enabled=True)``, or ``dynapipe=True``), megatron-core's own schedule
  otherwise.
* :func:`install` -- Megatron-LM's ``train_step`` and ``evaluate`` call
  ``megatron.training.training.get_forward_backward_func``, a name bound when that module is
  imported; ``install`` re-binds it (and any other ``megatron.training`` module's binding of
  megatron-core's function) to :func:`get_forward_backward_func`. Without Megatron-LM (only
  megatron-core installed) it patches nothing and says so; call :func:`get_forward_backward_func`
  in your loop instead. :func:`uninstall` puts the originals back.

:func:`forward_backward_dynapipe` takes megatron-core's keyword arguments. Its data iterator
yields :class:`~megatron_dynapipe.data.batch.PlannedBatch` objects (one per call: this rank's
stage plan and micro-batches); with model chunks it may be a list of one iterator per chunk, as
megatron-core's interleaved schedule takes them: the first is read (its plans say what every chunk
runs), the others are not touched (Megatron-LM's are None under ``--dynapipe``).
An item that is not a PlannedBatch -- e.g. an evaluation iterator of plain fixed-shape batches --
is run by megatron-core's own schedule, unchanged.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional

from megatron_dynapipe.compat import core
from megatron_dynapipe.compat.patching import Patches
from megatron_dynapipe.data.batch import PlannedBatch
from megatron_dynapipe.runtime.executor import ExecutorOptions, run_plan

__all__ = [
    "InstallReport",
    "configure",
    "forward_backward_dynapipe",
    "get_forward_backward_func",
    "install",
    "is_enabled",
    "recording_timeline",
    "uninstall",
]

logger = logging.getLogger("megatron_dynapipe")

_NAME = "get_forward_backward_func"
_TRAINING_MODULE = "megatron.training.training"


@dataclass
class _State:
    enabled: bool = False
    options: ExecutorOptions = field(default_factory=ExecutorOptions)
    patches: Patches = field(default_factory=Patches)


_state = _State()


def configure(enabled: bool = True, *, comm_timeout_s: Optional[float] = None,
              validate_plans: bool = True) -> None:
    """Switch DynaPipe's schedule on or off for :func:`get_forward_backward_func` (megatron-core
    users who do not go through :func:`install`) and set the executor's options."""
    _state.enabled = bool(enabled)
    _state.options = ExecutorOptions(comm_timeout_s=comm_timeout_s, validate_plans=validate_plans)


def is_enabled() -> bool:
    return _state.enabled


@contextlib.contextmanager
def recording_timeline() -> Iterator[list]:
    """Within it, every instruction the executor runs is appended to the list it yields, as a
    :class:`~megatron_dynapipe.runtime.executor.TimedInstruction`."""
    timeline: list = []
    saved = _state.options
    _state.options = replace(saved, timeline=timeline)
    try:
        yield timeline
    finally:
        _state.options = saved


def get_forward_backward_func(pp_size: Optional[int] = None, vp_size: Optional[int] = None,
                              schedule_pg_collection=None, *, dynapipe: Optional[bool] = None) -> Callable:
    """DynaPipe's forward-backward function when DynaPipe is on (``dynapipe`` overrides the
    configured state), megatron-core's ``get_forward_backward_func(pp_size, vp_size,
    schedule_pg_collection)`` otherwise (Megatron-LM 0.19's ``train`` and ``evaluate`` pass the
    process-group collection)."""
    enabled = _state.enabled if dynapipe is None else dynapipe
    if not enabled:
        return core.core_forward_backward_func(pp_size, vp_size, schedule_pg_collection=schedule_pg_collection)
    return forward_backward_dynapipe  # any virtual pipeline size: the plans say which chunk runs when


def forward_backward_dynapipe(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length: Optional[int] = None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: Optional[bool] = False,
):
    """megatron-core's forward-backward signature, running the planned schedule.

    Takes one item from ``data_iterator``: a PlannedBatch runs its plan (``num_microbatches``,
    ``seq_length`` and ``micro_batch_size`` are then ignored: the plan has the micro-batches and
    their shapes); anything else goes, with the rest of the iterator, to megatron-core's schedule.
    Returns the list of loss dicts on the last pipeline stage and ``[]`` elsewhere.
    """
    wrapped = isinstance(data_iterator, list)
    iterators = data_iterator if wrapped else [data_iterator]
    if wrapped:  # one iterator per model chunk, as megatron-core's interleaved schedule takes them
        chunks = len(model) if isinstance(model, list) else 1
        if len(iterators) != chunks:
            raise ValueError(f"DynaPipe: {len(iterators)} data iterators for {chunks} model chunk(s): "
                             "pass one per chunk, or one iterator")
        data_iterator = iterators[0]
    if data_iterator is None:
        raise ValueError(
            f"DynaPipe: global rank {_global_rank()} (pipeline stage "
            f"{core.pipeline_rank()}) got data_iterator=None; every rank needs "
            "an iterator of PlannedBatch (its stage's plan), also middle stages and tensor-parallel ranks > 0"
        )
    item = next(data_iterator)
    if not isinstance(item, PlannedBatch):
        rest = itertools.chain([item], data_iterator)
        passed = [rest if it is data_iterator else it for it in iterators] if wrapped else rest
        kwargs: dict[str, Any] = dict(
            forward_step_func=forward_step_func, data_iterator=passed, model=model,
            num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length, forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
            adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, force_all_reduce=force_all_reduce)
        if p2p_communicator is not None:
            kwargs["p2p_communicator"] = p2p_communicator
        if pg_collection is not None:
            kwargs["pg_collection"] = pg_collection
        return core.core_forward_backward_func()(**kwargs)
    return run_plan(
        forward_step_func=forward_step_func, batch=item, model=model, forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, force_all_reduce=bool(force_all_reduce),
        options=_state.options, pg_collection=pg_collection,
    )


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


# --------------------------------------------------------------------------------------------
# install / uninstall
# --------------------------------------------------------------------------------------------


@dataclass
class InstallReport:
    """What :func:`install` did: ``enabled``, the ``module.attribute`` bindings it replaced, and
    a one-paragraph ``message`` (also logged)."""
    enabled: bool
    patched: list[str]
    message: str

    def __str__(self) -> str:
        return self.message


def install(args: Any = None) -> InstallReport:
    """Make Megatron-LM's ``train_step`` and ``evaluate`` run DynaPipe's schedule.

    ``args``: Megatron's (validated) arguments; DynaPipe is on with ``args.dynapipe`` (``None``:
    on). Re-binds ``megatron.training.training.get_forward_backward_func`` and every other loaded
    ``megatron.training`` module's binding of megatron-core's function to
    :func:`get_forward_backward_func` (idempotent). When ``megatron.training`` cannot be imported
    (megatron-core only), patches nothing, warns, and says so in the report.
    """
    enabled = True if args is None else bool(getattr(args, "dynapipe", False))
    timeout = None if args is None else getattr(args, "dynapipe_comm_timeout", None)
    configure(enabled, comm_timeout_s=timeout)
    if not enabled:
        return _report(False, [], "DynaPipe is off (no --dynapipe): Megatron's own schedule stays in place; "
                                  "nothing patched")
    try:
        import importlib

        training = importlib.import_module(_TRAINING_MODULE)
    except ImportError as exc:
        message = (f"DynaPipe is on, but {_TRAINING_MODULE} cannot be imported ({exc}): nothing patched. "
                   "With megatron-core alone, call megatron_dynapipe.megatron.get_forward_backward_func() "
                   "where your training loop calls megatron-core's")
        warnings.warn(message, stacklevel=2)
        return _report(True, [], message)
    if not hasattr(training, _NAME):
        raise RuntimeError(
            f"{_TRAINING_MODULE} has no {_NAME}: this Megatron-LM binds its schedule differently; "
            "call megatron_dynapipe.megatron.get_forward_backward_func() from its train_step instead"
        )
    originals = {core.original_get_forward_backward_func(), getattr(training, _NAME)} - {get_forward_backward_func}
    _state.patches.rebind({original: get_forward_backward_func for original in originals}, where=_in_training)
    patched = sorted(f"{name}.{_NAME}" for name, module in list(sys.modules.items())
                     if module is not None and _in_training(name)
                     and vars(module).get(_NAME) is get_forward_backward_func)
    message = (f"DynaPipe is on: {', '.join(patched)} now run{'s' if len(patched) == 1 else ''} the planned "
               "schedule in train_step and evaluate (batches that are not PlannedBatch still run "
               "megatron-core's schedule)")
    return _report(True, patched, message)


def uninstall() -> None:
    """Put back every binding :func:`install` replaced and switch DynaPipe off."""
    _state.patches.undo()
    configure(False)


def _in_training(module_name: str) -> bool:
    return module_name == "megatron.training" or module_name.startswith("megatron.training.")


def _report(enabled: bool, patched: list[str], message: str) -> InstallReport:
    logger.info(message)
    return InstallReport(enabled, patched, message)
