"""Run one pipeline stage's :class:`~megatron_dynapipe.planning.plan.ExecutionPlan` in Megatron.

:func:`run_plan` walks the stage's instructions in order:

* ``LOAD_INPUT(m)`` / ``RECV_ACT_FINISH(m)`` -- the input of ``F(m)``: the micro-batch's data on
  the first stage, the received activation elsewhere;
* ``FORWARD(m)`` -- megatron-core's own ``forward_step`` (so the loss is scaled as Megatron
  scales it, per token with ``config.calculate_per_token_loss``) with an iterator over the one
  micro-batch dict, so a ``forward_step(data_iterator, model)`` that calls ``next`` works as is;
* ``BACKWARD(m)`` -- megatron-core's ``backward_step``;
* STARTs -- sends and receives (:mod:`.p2p`) of tensors whose shapes come from the plan
  (``plan.microbatches[m]`` and the model's hidden size, as megatron-core's ``get_tensor_shapes``
  computes them), so there is no shape hand-shake; all STARTs between two compute ops are posted
  together, before the next FINISH or compute op; FINISHes wait for their transfer;
* ``FREE_BUFFER(m)`` -- drops what the stage keeps of ``m``.

Recompute per micro-batch
-------------------------
megatron-core decides activation recompute from global settings: ``TransformerBlock.forward``
reads ``config.recompute_granularity == 'full'`` (with ``recompute_method`` /
``recompute_num_layers``) on every call, and each attention module reads its
``checkpoint_core_attention`` flag (set from ``recompute_granularity == 'selective'`` at
construction) on every call. :class:`RecomputeSwitch` sets exactly those attributes for the
duration of one FORWARD or BACKWARD and puts the originals back afterwards: ``NONE`` -- neither;
``SELECTIVE`` -- core attention checkpointed (megatron's selective recompute); ``FULL`` -- whole
layers checkpointed (``recompute_method`` of the config, else ``uniform`` with one layer per
checkpoint). The recomputation itself is megatron-core's (``tensor_parallel.checkpoint``), so
gradients are those of the plain forward; the switch checks at first use that the installed
megatron-core still reads these attributes at forward time.

Gradients and results
---------------------
As in megatron-core's 1F1B: gradient synchronisation (``config.no_sync_func``) stays off until
the stage's last backward, then ``config.finalize_model_grads_func`` runs with the number of
tokens when ``calculate_per_token_loss``. Returns the list of loss dicts on the last stage and
``[]`` elsewhere. With ``forward_only``, only activations flow (the plan's gradient transfers,
backwards and their waits are skipped on every stage together, which keeps the plans
deadlock-free: only waits are removed).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from ..compat.patching import Spot, check_spots
from ..data.batch import PlannedBatch
from ..planning.plan import ExecutionPlan, Op
from ..planning.types import RecomputeType
from .p2p import PipelineChannels, PipelineCommError, Transfer

__all__ = [
    "ExecutorOptions",
    "PipelineCommError",
    "PlanMismatchError",
    "RecomputeSwitch",
    "run_plan",
]


class PlanMismatchError(ValueError):
    """The plan, the PlannedBatch and this rank's place in the pipeline disagree."""


@dataclass
class ExecutorOptions:
    """``comm_timeout_s``: how long a pipeline FINISH may wait (None: the process group's
    timeout). ``validate_plans``: check each plan's structure before running it."""

    comm_timeout_s: Optional[float] = None
    validate_plans: bool = True


# --------------------------------------------------------------------------------------------
# Per-micro-batch recompute
# --------------------------------------------------------------------------------------------

#: megatron-core must still read these attributes at forward time, per micro-batch.
RECOMPUTE_READS = (
    Spot("megatron.core.transformer.transformer_block", "TransformerBlock.forward",
         ("self.config.recompute_granularity == 'full'",), "full recompute is read per forward"),
    Spot("megatron.core.transformer.transformer_block", "TransformerBlock._checkpointed_forward",
         ("self.config.recompute_method == 'uniform'",), "the recompute method is read per forward"),
    Spot("megatron.core.transformer.attention", "Attention.forward",
         ("if self.checkpoint_core_attention and self.training",), "selective recompute is read per forward"),
)


@functools.lru_cache(maxsize=1)
def _check_recompute_reads() -> None:
    check_spots(RECOMPUTE_READS, review="megatron_dynapipe/megatron/executor.py:RecomputeSwitch")


class RecomputeSwitch:
    """Sets a megatron-core model's recompute for one micro-batch (see the module docstring).

    ``with switch(RecomputeType.FULL): ...`` -- the config attributes the transformer blocks read
    and the attention modules' ``checkpoint_core_attention`` flags are set on entry and restored
    on exit.
    """

    def __init__(self, model: "torch.nn.Module | Iterable[torch.nn.Module]"):
        from megatron.core.transformer.transformer_block import TransformerBlock

        models = [model] if isinstance(model, torch.nn.Module) else list(model)
        configs: dict[int, Any] = {}
        self.attention: list[torch.nn.Module] = []
        for m in models:
            for module in m.modules():
                if isinstance(module, TransformerBlock):
                    configs[id(module.config)] = module.config
                if hasattr(module, "checkpoint_core_attention"):
                    self.attention.append(module)
        self.configs = list(configs.values())
        # the model as built already runs without recompute: NONE then needs no switching
        self._rests_at_none = (all(c.recompute_granularity is None for c in self.configs)
                               and not any(m.checkpoint_core_attention for m in self.attention))

    def _settings(self, rc: RecomputeType) -> tuple[list[tuple[Any, str, Any]], bool]:
        attrs = []
        for config in self.configs:
            granularity = {RecomputeType.NONE: None, RecomputeType.SELECTIVE: "selective",
                           RecomputeType.FULL: "full"}[rc]
            attrs.append((config, "recompute_granularity", granularity))
            if rc == RecomputeType.FULL:
                if config.recompute_method is None:
                    attrs.append((config, "recompute_method", "uniform"))
                if config.recompute_num_layers is None:
                    attrs.append((config, "recompute_num_layers", 1))
        return attrs, rc == RecomputeType.SELECTIVE

    @contextlib.contextmanager
    def __call__(self, rc: RecomputeType):
        rc = RecomputeType(rc)
        if rc == RecomputeType.NONE and self._rests_at_none:
            yield
            return
        if rc != RecomputeType.NONE:
            _check_recompute_reads()
        attrs, core_attention = self._settings(rc)
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in attrs]
        saved_flags = [m.checkpoint_core_attention for m in self.attention]
        try:
            for obj, name, value in attrs:
                setattr(obj, name, value)
            for m in self.attention:
                m.checkpoint_core_attention = core_attention
            yield
        finally:
            for obj, name, value in reversed(saved):
                setattr(obj, name, value)
            for m, flag in zip(self.attention, saved_flags):
                m.checkpoint_core_attention = flag


# --------------------------------------------------------------------------------------------
# The executor
# --------------------------------------------------------------------------------------------

_GRADIENT_OPS = frozenset({Op.BACKWARD, Op.RECV_GRAD_START, Op.RECV_GRAD_FINISH,
                           Op.SEND_GRAD_START, Op.SEND_GRAD_FINISH})


def _pg_collection():
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgs = ProcessGroupCollection()
    pgs.tp = parallel_state.get_tensor_model_parallel_group()
    pgs.cp = parallel_state.get_context_parallel_group()
    pgs.pp = parallel_state.get_pipeline_model_parallel_group()
    pgs.embd = parallel_state.get_embedding_group(check_initialized=False)
    pgs.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pgs.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True,
                                                       partial_data_parallel=False)
    return pgs


_CHANNELS: dict = {}


def _channels(pp_group, device: torch.device, timeout: Optional[float]) -> PipelineChannels:
    """One PipelineChannels per (pipeline group, device, timeout), kept across iterations."""
    key = (id(pp_group), str(device), timeout)
    cached = _CHANNELS.get(key)
    if cached is None or cached.pp_group is not pp_group:
        cached = _CHANNELS[key] = PipelineChannels(pp_group, device=device, timeout=timeout)
    return cached


def _check_batch(batch: PlannedBatch, channels: PipelineChannels) -> ExecutionPlan:
    plan = batch.plan
    where = f"pipeline stage {channels.stage} (global rank {channels.rank})"
    if plan.num_stages != channels.num_stages or plan.stage != channels.stage:
        raise PlanMismatchError(
            f"{where} received the plan of stage {plan.stage} of {plan.num_stages}: the pipeline has "
            f"{channels.num_stages} stages; the data pipeline must hand each rank its own stage's plan"
        )
    n = len(plan.microbatches)
    if len(batch.microbatches) != n:
        raise PlanMismatchError(
            f"{where}: the PlannedBatch holds {len(batch.microbatches)} micro-batches, its plan {n}"
        )
    for m, (shape, data) in enumerate(zip(plan.microbatches, batch.microbatches)):
        expected = (shape.size, shape.seq_len)
        for key, tensor in data.items():
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tuple(tensor.shape) != expected:
                raise PlanMismatchError(
                    f"{where}: micro-batch {m} {key!r} has shape {tuple(tensor.shape)}, its plan says "
                    f"{expected} (size x padded sequence length)"
                )
    return plan


def run_plan(
    *,
    forward_step_func: Callable,
    batch: PlannedBatch,
    model: "torch.nn.Module | list[torch.nn.Module]",
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step: Optional[bool] = None,
    adjust_tensor_shapes_fn: Optional[Callable] = None,
    force_all_reduce: bool = False,
    options: Optional[ExecutorOptions] = None,
    pg_collection=None,
) -> list:
    """Run this rank's stage of ``batch.plan`` on ``model`` (one chunk, possibly DDP-wrapped).

    The arguments mean what they mean for megatron-core's ``forward_backward_*`` functions.
    Returns the list of loss dicts (or, with ``collect_non_loss_data``, of the loss function's
    data) on the last stage and ``[]`` elsewhere; the loss is divided by the plan's number of
    micro-batches where megatron-core divides by ``num_microbatches``.
    """
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_model_config, get_model_type

    options = options or ExecutorOptions()
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError(f"DynaPipe runs one model chunk per stage, got {len(model)} (no virtual pipeline)")
        model = model[0]
    config = get_model_config(model)
    if pg_collection is None:
        pg_collection = _pg_collection()
    params = next(model.parameters(), None)
    device = params.device if params is not None else torch.device("cpu")
    channels = _channels(pg_collection.pp, device, options.comm_timeout_s)
    plan = _check_batch(batch, channels)
    if options.validate_plans:
        plan.validate()
    stage, last_stage = channels.stage, channels.num_stages - 1
    is_last = stage == last_stage
    n = len(plan.microbatches)
    dtype = config.pipeline_dtype or (params.dtype if params is not None else torch.float32)

    def shape_of(m: int) -> tuple[int, ...]:
        mb = plan.microbatches[m]
        shapes = schedules.get_tensor_shapes(
            seq_length=mb.seq_len, micro_batch_size=mb.size, decoder_seq_length=None, config=config,
            tp_group=pg_collection.tp, cp_group=pg_collection.cp)
        if adjust_tensor_shapes_fn is not None:
            shapes, send = adjust_tensor_shapes_fn(shapes, list(shapes))
            if len(shapes) != 1 or list(send) != list(shapes):
                raise NotImplementedError("DynaPipe exchanges one tensor of one shape per micro-batch")
        return tuple(shapes[0])

    model_type = get_model_type(model)
    switch = RecomputeSwitch(model)
    embedding_module = None
    if config.finalize_model_grads_func is not None and not forward_only:
        embedding_module = schedules.clear_embedding_activation_buffer(config, model, is_last)
    if config.timers is not None:
        config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)

    no_sync_func = config.no_sync_func or contextlib.nullcontext
    no_sync = None
    if not forward_only:
        no_sync = no_sync_func()
        no_sync.__enter__()
    last_backward = max((i for i, ins in enumerate(plan.instructions) if ins.op == Op.BACKWARD), default=-1)

    inputs: dict[int, Optional[torch.Tensor]] = {}
    outputs: dict[int, torch.Tensor] = {}
    output_grads: dict[int, torch.Tensor] = {}
    input_grads: dict[int, Optional[torch.Tensor]] = {}
    transfers: dict[tuple, Transfer] = {}
    pending: list[Transfer] = []
    finished_early: set[tuple] = set()
    forward_data_store: list = []
    total_num_tokens = torch.zeros([], dtype=torch.int, device=device)
    first_forward = True
    cp_size = pg_collection.cp.size()

    def finish(key: tuple, i: int, ins) -> torch.Tensor:
        return channels.finish(transfers.pop(key), where=f"plan instruction #{i} {ins}")

    for i, ins in enumerate(plan.instructions):
        op, m = ins.op, ins.microbatch
        if forward_only and op in _GRADIENT_OPS:
            continue
        if op.is_start:
            if op == Op.RECV_ACT_START or op == Op.RECV_GRAD_START:
                tensor = torch.empty(shape_of(m), requires_grad=True, device=device, dtype=dtype)
            elif op == Op.SEND_ACT_START:
                tensor = outputs[m]
                expected = shape_of(m)
                if tuple(tensor.shape) != expected or tensor.dtype != dtype:
                    raise PlanMismatchError(
                        f"pipeline stage {stage}: micro-batch {m}'s output is {tuple(tensor.shape)} "
                        f"{tensor.dtype}, the plan's activation is {expected} {dtype} (sequence x batch x "
                        "hidden): the micro-batch's tensors do not have the plan's shape"
                    )
            else:  # SEND_GRAD_START
                tensor = input_grads[m]
                if tensor is None:
                    raise RuntimeError(f"pipeline stage {stage}: micro-batch {m}'s input received no gradient")
            if not tensor.is_contiguous():
                tensor = tensor.contiguous()
            transfer = channels.transfer(ins, tensor)
            transfers[ins.transfer] = transfer
            pending.append(transfer)
            continue
        if pending:  # every START since the last compute op, together
            channels.post(pending)
            pending = []
        if op.is_finish:
            key = ins.transfer
            if key in finished_early:
                finished_early.discard(key)
                continue
            tensor = finish(key, i, ins)
            if op == Op.RECV_ACT_FINISH:
                inputs[m] = tensor
            elif op == Op.RECV_GRAD_FINISH:
                output_grads[m] = tensor
            elif op == Op.SEND_ACT_FINISH:
                if forward_only:
                    outputs.pop(m, None)
                else:
                    schedules.deallocate_output_tensor(outputs[m], config.deallocate_pipeline_outputs)
        elif op == Op.LOAD_INPUT:
            inputs[m] = None
        elif op == Op.FORWARD:
            with switch(ins.recompute):
                output, num_tokens = schedules.forward_step(
                    forward_step_func,
                    iter([batch.microbatches[m]]),
                    model,
                    n,
                    inputs[m],
                    forward_data_store,
                    config,
                    cp_size,
                    collect_non_loss_data=collect_non_loss_data,
                    is_first_microbatch=schedules.check_first_val_step(first_val_step, forward_only, first_forward),
                    current_microbatch=m,
                    is_last_stage=is_last,
                )
            first_forward = False
            total_num_tokens += num_tokens
            if forward_only:
                inputs.pop(m)
                if not is_last:
                    outputs[m] = output
            else:
                outputs[m] = output
        elif op == Op.BACKWARD:
            key = (Op.SEND_ACT_START, m, stage + 1)
            if key in transfers:  # a plan that finishes the send later: the backward needs it done
                finish(key, i, ins)
                finished_early.add(key)
                schedules.deallocate_output_tensor(outputs[m], config.deallocate_pipeline_outputs)
            if i == last_backward and no_sync is not None:
                if config.grad_sync_func is None or stage == 0:
                    no_sync.__exit__(None, None, None)
                    no_sync = None
            with switch(ins.recompute):
                input_grads[m] = schedules.backward_step(
                    inputs.pop(m), outputs.pop(m), output_grads.pop(m, None), model_type, config)
        elif op == Op.FREE_BUFFER:
            input_grads.pop(m, None)
            inputs.pop(m, None)
            output_grads.pop(m, None)
    if pending:
        channels.post(pending)
    if transfers:  # cannot happen for a validated plan: every START has its FINISH
        leftover = ", ".join(t.describe() for t in transfers.values())
        raise RuntimeError(f"pipeline stage {stage}: the plan ended with transfers still open: {leftover}")

    if not forward_only:
        if no_sync is not None:
            no_sync.__exit__(None, None, None)
            if config.grad_sync_func is not None:
                config.grad_sync_func(model.parameters())
        if config.finalize_model_grads_func is not None:
            schedules.finish_embedding_wgrad_compute(config, embedding_module, is_last, pg_collection.tp)
            config.finalize_model_grads_func(
                [model],
                total_num_tokens if config.calculate_per_token_loss else None,
                pg_collection=pg_collection,
                force_all_reduce=force_all_reduce,
            )
        if getattr(config, "fine_grained_activation_offloading", False):
            schedules.off_interface.reset()
    if config.timers is not None:
        config.timers("forward-backward").stop()
    return forward_data_store
