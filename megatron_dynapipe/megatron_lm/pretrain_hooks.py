"""The parts of Megatron-LM's ``pretrain_gpt.py`` that DynaPipe replaces.

Shared by the launcher (``megatron-dynapipe launch pretrain_gpt.py ...``, which installs them
into an unmodified checkout) and by the ``patches/`` files (which call them explicitly). Which of
them a Megatron-LM tag needs is read from its code
(:mod:`~megatron_dynapipe.compat.megatron_lm_script`). With ``--dynapipe`` off every hook hands
over to the script's own function, so a patched script trains exactly as before (with
``--dynapipe-attention sdpa``, on those layers).

Why each piece exists:

* :func:`extra_args_provider` -- Megatron parses the command line once; DynaPipe's argument
  groups (:mod:`.arguments`) and the small ``dynapipe data`` group below join the script's own
  provider (ModelOpt's, when present) through :func:`~.arguments.chain_providers`.
* :func:`parse_and_validate_args` (core_v0.18 and later, where the script parses its arguments
  before ``pretrain``) and :func:`model_provider` (before: the first hook that runs after
  Megatron's ``validate_args`` and before the model's ``TransformerConfig`` is built from the
  arguments) -- each runs :func:`setup` once: DynaPipe's validation
  (:func:`~.arguments.validate_dynapipe_args`, which turns ``variable_seq_lengths`` back on after
  Megatron forced it off), the Megatron-LM checks of :func:`~.arguments.check_data_pipeline_args`,
  ``--dataloader-type external`` (so Megatron passes DynaPipe's loaders through untouched) and
  :func:`~.provider.install` (Megatron-LM's ``train_step`` and ``evaluate`` then run the planned
  schedule). The script's provider then builds the model, with the SDPA attention core where
  ``--dynapipe-attention sdpa`` asks for it (:mod:`.attention`; honoured without ``--dynapipe``
  too, so Megatron's own schedule can run the same layers).
* :func:`configure_model` -- core_v0.19 builds the model from a ``GPTModelConfig`` instead of a
  model provider: the SDPA core goes in through its ``transformer_layer_spec``.
* :func:`datasets_provider` -- instead of fixed-length GPT datasets, every rank (all pipeline
  stages and tensor-parallel ranks, hence ``is_distributed``) gets a
  :class:`~megatron_dynapipe.data.DynaPipeDataLoader`: rank 0 hosts the planning pipeline over
  the variable-length samples of Megatron's data flags (:mod:`.datasets`: blends, per-split
  paths, ``--sft``, ``--mock-data``), each rank receives its stage's
  :class:`~megatron_dynapipe.data.PlannedBatch` per iteration; every ``--log-interval`` the log
  and Megatron's TensorBoard / W&B writers get what it trained (:mod:`.iteration_log`).
* :func:`get_batch` -- pretrain_gpt's ``get_batch`` broadcasts fixed ``(micro_batch_size,
  seq_length)`` tensors from tensor-parallel rank 0. Under DynaPipe every tensor-parallel rank
  already holds the identical micro-batch (the executor hands ``forward_step`` an iterator over
  that one dict), so it is taken as it is: no broadcast, the micro-batch's own shape, returned
  as the script's own ``get_batch`` returns a batch (its ``BATCH_KEYS`` from core_v0.18).
* :func:`scaling_mode_requested` / :func:`run_scaling_mode` -- the patched script traces one fake
  rank (``--is-scaling-mode``) before ``pretrain`` starts a real job, as the launcher does.

Micro-batch count. Megatron-LM's ``train_step`` passes ``get_num_microbatches()`` (global batch /
(micro-batch size x DP)) to the forward-backward function; the planned schedule ignores it and
scales each micro-batch's loss by the plan's own count. The other uses stay right as long as one
iteration consumes exactly the global batch Megatron counts, which the loaders guarantee, ramp-up
(``--rampup-batch-size``) included: the scheduler's sample increment and
``consumed_train_samples`` are ``get_num_microbatches() x micro_batch_size x DP``, and the
reported ``lm loss`` is summed as ``[loss sum, token count]`` pairs over however many
micro-batches there were.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import inspect
import logging
import sys
import threading
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

from megatron_dynapipe.compat.upstream import UnsupportedUpstream, check_supported
from megatron_dynapipe.config.model_flags import model_from_megatron_args, transformer_engine_layers
from megatron_dynapipe.data.datasets import LONG_SAMPLES
from megatron_dynapipe.hardware import PEAK_DTYPES, load_hardware
from megatron_dynapipe.hardware.pricing import Pricing
from megatron_dynapipe.megatron_lm.arguments import (
    DynapipeArgumentError,
    add_arguments,
    chain_providers,
    check_data_pipeline_args,
    core_takes_packed_rows,
    model_chunks,
    stage_layers,
    training_spec_from_args,
    validate_dynapipe_args,
)
from megatron_dynapipe.megatron_lm.attention import (
    check_attention_args,
    layer_attention,
    local_attention_layer_spec,
    local_context_parallel,
    replaces_local_core,
)
from megatron_dynapipe.megatron_lm.datasets import open_splits
from megatron_dynapipe.megatron_lm.iteration_log import LoggedLoader
from megatron_dynapipe.planning.cost_model import load_job_cost_model

__all__ = [
    "add_data_arguments",
    "build_data_loaders",
    "close_loaders",
    "configure_model",
    "datasets_provider",
    "enabled",
    "extra_args_provider",
    "get_batch",
    "is_hook",
    "make_get_batch",
    "model_provider",
    "parse_and_validate_args",
    "run_scaling_mode",
    "scaling_mode_requested",
    "setup",
]

logger = logging.getLogger("megatron_dynapipe")

DATA_GROUP = "dynapipe data"
VALID_NAMESPACE = "dynapipe/valid"
_MICROBATCH_TENSORS = ("tokens", "labels", "loss_mask", "position_ids")


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def add_data_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``dynapipe data`` group: how Megatron's data flags become variable-length samples."""
    g = parser.add_argument_group(title=DATA_GROUP)
    g.add_argument("--dynapipe-long-samples", choices=LONG_SAMPLES, default="split",
                   help="documents longer than --seq-length: split into windows that overlap by one token (every "
                        "token trained once, default), truncate (keep the first --seq-length tokens), or refuse")
    g.add_argument("--dynapipe-mock-samples", type=int, default=None, metavar="N",
                   help="samples of the --mock-data dataset (default: 8 global batches, at least 256)")
    return parser


def extra_args_provider(other: "Optional[Callable]" = None) -> Callable:
    """The ``extra_args_provider`` for ``pretrain``: ``other`` (the script's own, may be None),
    then DynaPipe's argument groups and the ``dynapipe data`` group."""
    provider = chain_providers(other, add_arguments, add_data_arguments)
    provider.__dynapipe_hook__ = True  # type: ignore[attr-defined]
    return provider


def is_hook(obj: Any) -> bool:
    """Whether ``obj`` is one of this module's wrappers (a script already patched to use them)."""
    return bool(getattr(obj, "__dynapipe_hook__", False))


def _get_args():
    from megatron.training import get_args

    return get_args()


# --------------------------------------------------------------------------------------------
# Setup: validation, Megatron-LM checks, install
# --------------------------------------------------------------------------------------------

_setup_lock = threading.Lock()
_setup_done: dict[int, Any] = {}  # id(args) -> InstallReport


def enabled() -> bool:
    """Whether DynaPipe's schedule is installed and on (after :func:`setup` with ``--dynapipe``)."""
    from megatron_dynapipe.runtime.provider import is_enabled

    return is_enabled()


def setup(args: Optional[argparse.Namespace] = None):
    """Validate DynaPipe's arguments and install its schedule, once per ``args`` (idempotent).

    Runs after Megatron's ``validate_args`` (``args``: Megatron's global arguments by default).
    With ``--dynapipe``: :func:`~.arguments.validate_dynapipe_args`, :func:`~.arguments.check_data_pipeline_args`,
    ``args.dataloader_type = "external"``, then :func:`~.provider.install`. Without it, installs
    nothing (Megatron's own schedule and data path stay). Returns the install report.
    """
    from megatron_dynapipe.runtime.provider import install

    if args is None:
        args = _get_args()
    with _setup_lock:
        if id(args) in _setup_done:
            return _setup_done[id(args)]
        if getattr(args, "dynapipe", False):
            with _refusals_exit():
                check_supported()
                _every_refusal(args, validate_dynapipe_args, check_data_pipeline_args)
            if getattr(args, "dataloader_type", None) not in (None, "single", "external"):
                warnings.warn(f"--dataloader-type {args.dataloader_type} is replaced by DynaPipe's loaders", stacklevel=2)
            args.dataloader_type = "external"  # Megatron passes the loaders through as they are
        report = install(args)
        if getattr(args, "rank", 0) == 0:
            print(f"> megatron-dynapipe: {report.message}", flush=True)
            print(f"> megatron-dynapipe: {_attention_core(args)}", flush=True)
            layers = stage_layers(args) if report.enabled else None
            if layers:
                stages = "virtual pipeline stages" if model_chunks(args) > 1 else "pipeline stages"
                print(f"> megatron-dynapipe: {stages} of {' + '.join(map(str, layers))} transformer layers "
                      "(Megatron-LM's pipeline split), as the plans price them", flush=True)
            if report.enabled and _priced_by(args):
                hardware = getattr(args, "dynapipe_hardware", None)
                device = (f"the roofline of {load_hardware(hardware).name}" if hardware
                          else "the analytical model of a GPT on an A100")
                print(f"> megatron-dynapipe: no --dynapipe-cost-model: plans are priced by {device}, so predicted "
                      "times (and what fits --dynapipe-memory-limit) are that device's; profile this model here "
                      "(megatron-dynapipe profile <model flags>) and pass --dynapipe-cost-model", flush=True)
            if report.enabled and core_takes_packed_rows(args) and getattr(args, "dynapipe_packing", "pad") == "pad":
                print("> megatron-dynapipe: micro-batches are padded (--dynapipe-packing pad), though this job's "
                      "attention core takes packed rows: --dynapipe-packing varlen packs them (with --dynapipe-documents "
                      "cut among THD packing's own plans, never predicted slower than it)", flush=True)
            if report.enabled and args.tensor_model_parallel_size > 1 and not getattr(args, "dynapipe_hardware", None):
                print(f"> megatron-dynapipe: no --dynapipe-hardware: plans leave out the TP group's collectives (TP "
                      f"{args.tensor_model_parallel_size}), so they under-price every micro-batch's layers; pass "
                      "--dynapipe-hardware h100 (or a file megatron-dynapipe calibrate wrote)", flush=True)
        _setup_done[id(args)] = report
        return report


def _attention_core(args) -> str:
    """Which attention core the job's layers compute with."""
    if transformer_engine_layers(args):
        return "attention: transformer-engine's core (--transformer-impl transformer_engine)"
    ring = (", keys and values passed round the context-parallel ring (--context-parallel-size "
            f"{args.context_parallel_size})") if local_context_parallel(args) else ""
    if getattr(args, "dynapipe_attention", None) == "sdpa":
        return ("attention: the SDPA core (torch's scaled_dot_product_attention) on megatron-core's local layers "
                f"(--dynapipe-attention sdpa){ring}")
    return ("attention: megatron-core's unfused local core (--transformer-impl local; --dynapipe-attention sdpa "
            f"for the fused one){ring}")


def _every_refusal(args, *checks: Callable) -> None:
    """Run every check; what they refuse is raised together, in one line."""
    problems = []
    for check in checks:
        try:
            check(args)
        except DynapipeArgumentError as error:
            problems.append(str(error))
    if problems:
        raise DynapipeArgumentError("; ".join(problems))


@contextlib.contextmanager
def _refusals_exit():
    """Inside a job, a flag DynaPipe refuses ends the process with its one line (and status 2),
    not a traceback: the hooks are where the script hands over to this package."""
    try:
        yield
    except (DynapipeArgumentError, UnsupportedUpstream) as error:
        print(f"megatron-dynapipe: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def model_provider(original: Callable) -> Callable:
    """Wrap the script's model provider so that :func:`setup` runs first (after Megatron's
    argument validation, before the model's config is built from the arguments) and the model
    is built with ``--dynapipe-attention``'s core (:mod:`.attention`)."""
    def dynapipe_model_provider(*args, **kwargs):
        setup()
        with _refusals_exit(), layer_attention(_get_args()):
            return original(*args, **kwargs)

    dynapipe_model_provider.__wrapped__ = original  # type: ignore[attr-defined]
    dynapipe_model_provider.__dynapipe_hook__ = True  # type: ignore[attr-defined]
    return dynapipe_model_provider


def parse_and_validate_args(original: Callable) -> Callable:
    """Wrap Megatron-LM's ``parse_and_validate_args`` (core_v0.18 and later: the script parses its
    arguments before ``pretrain``): DynaPipe's flags join the parse (:func:`extra_args_provider`)
    and :func:`setup` runs on the validated arguments, before the script builds its config from
    them (``variable_seq_lengths`` is then on in the model's config)."""
    signature = inspect.signature(original)

    def dynapipe_parse_and_validate_args(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        provider = bound.arguments.get("extra_args_provider")
        if not is_hook(provider):
            bound.arguments["extra_args_provider"] = extra_args_provider(provider)
        parsed = original(*bound.args, **bound.kwargs)
        setup(parsed)
        return parsed

    dynapipe_parse_and_validate_args.__wrapped__ = original  # type: ignore[attr-defined]
    dynapipe_parse_and_validate_args.__dynapipe_hook__ = True  # type: ignore[attr-defined]
    return dynapipe_parse_and_validate_args


def configure_model(model_config: Any, args: Optional[argparse.Namespace] = None) -> Any:
    """Choose a core_v0.19 ``GPTModelConfig``'s layers as ``--dynapipe-attention`` and
    ``--context-parallel-size`` ask: with ``sdpa``, or CP on local layers, its
    ``transformer_layer_spec`` (the supported seam) builds Megatron-LM's default layers with that
    core (:mod:`.attention`); otherwise nothing changes. Returns the config."""
    args = _get_args() if args is None else args
    with _refusals_exit():
        check_attention_args(args)
    if replaces_local_core(args):
        model_config.transformer_layer_spec = local_attention_layer_spec(args)
    return model_config


def scaling_mode_requested(argv: "Optional[list[str]]" = None) -> bool:
    """Whether the script's command line asks for ``--is-scaling-mode``."""
    import sys

    from megatron_dynapipe.megatron_lm.scaling_mode import requested

    return requested(sys.argv[1:] if argv is None else argv)


def run_scaling_mode(argv: "Optional[list[str]]" = None) -> int:
    """Trace the fake rank the script's command line describes (no process group, no GPU);
    0, or 2 after printing the one-line error of a bad flag."""
    import sys

    from megatron_dynapipe.megatron_lm.scaling_mode import run_from_argv

    try:
        run_from_argv(sys.argv[1:] if argv is None else argv)
    except DynapipeArgumentError as error:
        print(f"megatron-dynapipe: error: {error}", file=sys.stderr)
        return 2
    return 0


# --------------------------------------------------------------------------------------------
# get_batch
# --------------------------------------------------------------------------------------------


def get_batch(data_iterator, vp_stage: Optional[int] = None, batch_keys: "Optional[Sequence[str]]" = None):
    """pretrain_gpt's ``get_batch`` under DynaPipe, for the one micro-batch dict ``data_iterator``
    yields: ``(tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params)``, or,
    for a script whose ``get_batch`` returns the values of its ``BATCH_KEYS`` (core_v0.18 and
    later), those values in that order (the keys a micro-batch has no value for are None).

    The tensors are ``[micro-batch size, padded length]`` as the plan says; padding sits at the
    right of each sample with ``loss_mask`` 0, so causal attention needs no mask
    (``attention_mask`` is None). A packed micro-batch (``--dynapipe-packing varlen``) is one row
    with its THD ``packed_seq_params`` (for ``BATCH_KEYS``: its ``cu_seqlens`` and ``max_seqlen``,
    from which the script builds them). No tensor-parallel broadcast: every TP rank has the same dict;
    a context-parallel rank keeps its two chunks of every sequence (``cu_seqlens`` stay the whole
    samples', as transformer-engine takes them).
    """
    if data_iterator is None:
        raise ValueError("DynaPipe's get_batch got data_iterator=None: every rank needs its PlannedBatch "
                         "micro-batches (is the planned schedule installed? see megatron_dynapipe.megatron.install)")
    microbatch = next(data_iterator)
    if not isinstance(microbatch, Mapping) or any(k not in microbatch for k in _MICROBATCH_TENSORS):
        got = sorted(microbatch) if isinstance(microbatch, Mapping) else type(microbatch).__name__
        raise TypeError(f"DynaPipe's get_batch expects one micro-batch dict with {', '.join(_MICROBATCH_TENSORS)}, "
                        f"got {got}: the data iterator must be DynaPipe's loader run by the planned schedule")
    import torch

    from megatron_dynapipe.gpt.context_parallel import batch_on_this_cp_rank
    from megatron_dynapipe.gpt.forward_step import packed_seq_params

    microbatch = batch_on_this_cp_rank(microbatch)
    on_gpu = torch.cuda.is_available()
    tensors = [microbatch[k] for k in _MICROBATCH_TENSORS]
    if on_gpu:
        tensors = [t.cuda(non_blocking=True) for t in tensors]
    tokens, labels, loss_mask, position_ids = tensors
    packed = {k: microbatch[k].to(tokens.device) for k in ("cu_seqlens", "max_seqlen") if k in microbatch}
    if batch_keys is None:
        return tokens, labels, loss_mask, None, position_ids, packed_seq_params(packed)
    values = dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids, **packed)
    return [values.get(key) for key in batch_keys]


def make_get_batch(original: Callable, batch_keys: "Optional[Sequence[str]]" = None) -> Callable:
    """``get_batch`` that is DynaPipe's while the planned schedule is on (returning what the
    script's own returns: ``batch_keys``, see :func:`get_batch`), ``original`` otherwise."""
    def dynapipe_get_batch(data_iterator, vp_stage: Optional[int] = None):
        if enabled():
            return get_batch(data_iterator, vp_stage, batch_keys)
        return original(data_iterator, vp_stage)

    dynapipe_get_batch.__wrapped__ = original  # type: ignore[attr-defined]
    dynapipe_get_batch.__dynapipe_hook__ = True  # type: ignore[attr-defined]
    return dynapipe_get_batch


# --------------------------------------------------------------------------------------------
# Datasets and loaders
# --------------------------------------------------------------------------------------------


def _priced_by(args) -> "str | None":
    """What the logged predictions are priced with, where it is not this machine: without
    ``--dynapipe-cost-model`` the roofline of ``--dynapipe-hardware``, else the analytical model of
    an A100."""
    if getattr(args, "dynapipe_cost_model", None):
        return None
    hardware = getattr(args, "dynapipe_hardware", None)
    return f"{load_hardware(hardware).name}'s roofline, not a profile" if hardware else \
        "the analytical A100 model, not this machine"


def _cost_model(args):
    """What the job plans with: its profile, else the analytical model of an A100; with
    ``--dynapipe-hardware``, its layout as ``search`` prices it (:class:`Pricing`)."""
    dtype = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"
    spec, tp = model_from_megatron_args(args), args.tensor_model_parallel_size
    profile, hardware = getattr(args, "dynapipe_cost_model", None), getattr(args, "dynapipe_hardware", None)
    model = None
    if hardware is None or profile is not None:
        model = load_job_cost_model(profile, spec.to_json(), tp=tp, dtype=dtype, flag="--dynapipe-cost-model")
    if hardware is None:
        return model
    pricing = Pricing(load_hardware(hardware), spec, PEAK_DTYPES[dtype], tp,
                      sequence_parallel=bool(getattr(args, "sequence_parallel", False)) and tp > 1,
                      tp_comm_overlap=bool(getattr(args, "tp_comm_overlap", False)), profile=model)
    pricing.stage_costs(training_spec_from_args(args))  # what cannot price the layout fails here, not in a worker
    return pricing


def _writers():
    """Megatron's TensorBoard and W&B writers (set on the rank that logs, else None)."""
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    return get_tensorboard_writer(), get_wandb_writer()


_LOADERS: list = []
_atexit_registered = False


def close_loaders() -> None:
    """Close every loader :func:`build_data_loaders` made in this process (rank 0 also stops the
    planning pipeline, after the other ranks closed theirs). Safe to call twice; runs at exit."""
    while _LOADERS:
        loader = _LOADERS.pop()
        try:
            loader.close()
        except Exception as exc:  # shutting down: report, do not mask the run's own outcome
            logger.warning("closing a DynaPipe loader failed: %s", exc)


def build_data_loaders(args: Optional[argparse.Namespace] = None, train_val_test_num_samples=None, *,
                       is_host: Optional[bool] = None):
    """``(train, valid, None)``: this rank's :class:`~megatron_dynapipe.data.DynaPipeDataLoader`
    for training (iterations ``args.iteration .. args.train_iters - 1``, ``--global-batch-size``
    samples each, or Megatron's ramp-up) and, with ``--eval-iters`` > 0, for validation (on the
    valid split; its own KV store on a port rank 0's OS picks). The test split is not evaluated.

    Every rank calls this at once (Megatron builds the data on every rank under DynaPipe): the
    hosting rank (global rank 0: DP 0, stage 0, TP 0) opens the data (:func:`~.datasets.open_splits`),
    binds the store to ``--dynapipe-kv-host`` and plans; it shares the job's secret (unless
    ``DYNAPIPE_KV_SECRET`` is set) and whether its store started with every rank over the job's
    process group; the others connect and read their samples themselves. Every loader is closed at
    exit (:func:`close_loaders`).
    """
    from megatron_dynapipe.data import DynaPipeDataLoader, from_parallel_state  # torch: only when loaders are built

    global _atexit_registered
    if args is None:
        args = _get_args()
    layout = from_parallel_state()
    host = layout.is_first if is_host is None else is_host
    spec = training_spec_from_args(args)
    gbs = int(args.global_batch_size)
    eval_iters = int(getattr(args, "eval_iters", 0) or 0)
    train_ds = valid_ds = cost_model = None
    if host:
        train_ds, valid_ds, cost_model = _open_on_host(args, train_val_test_num_samples, gbs, eval_iters)
    common = dict(dp_rank=layout.dp_rank, stage=layout.stage, tp_rank=layout.tp_rank, host_pipeline=host,
                  master_addr=args.dynapipe_kv_host, pad_token_id=0, seed=int(args.seed),
                  num_workers=int(getattr(args, "dynapipe_preprocess_workers", 2) or 2),
                  process_group=_world())
    if not _atexit_registered:
        atexit.register(close_loaders)
        _atexit_registered = True

    start = int(getattr(args, "iteration", 0) or 0)
    train = DynaPipeDataLoader(train_ds, spec, cost_model, gbs, port=int(args.dynapipe_kv_port),
                               start_iteration=start, num_iterations=max(0, int(args.train_iters) - start),
                               **_rampup(args), **common)
    _LOADERS.append(train)
    train = LoggedLoader(train, int(getattr(args, "log_interval", 1) or 1), "train", verbose=host, writers=_writers(),
                         priced_by=_priced_by(args), plan_line=layout.dp_rank == 0 and layout.tp_rank == 0)
    valid = None
    if eval_iters > 0:
        if getattr(args, "skip_train", False):
            total = eval_iters
        else:
            total = (int(args.train_iters) // int(args.eval_interval) + 1) * eval_iters
        valid_start = int(getattr(args, "consumed_valid_samples", 0) or 0) // gbs
        # Any free port, sent to the others over the job's group: a fixed one (--dynapipe-kv-port
        # + 1) could be taken meanwhile by one of the job's own connections.
        valid = DynaPipeDataLoader(valid_ds, spec, cost_model, gbs, port=0,
                                   namespace=VALID_NAMESPACE, start_iteration=valid_start,
                                   num_iterations=max(0, total - valid_start), **common)
        _LOADERS.append(valid)
        valid = LoggedLoader(valid, 1, "valid", verbose=False)
    return train, valid, None


def _open_on_host(args, num_samples, gbs: int, eval_iters: int):
    """The hosting rank's datasets and cost model. What goes wrong here reaches every other rank
    (waiting for the store) as the same one line, instead of a lost peer."""
    from megatron_dynapipe.data.loader import share_host_failure

    try:
        train_ds, valid_ds, _test = open_splits(args, num_samples)
        if eval_iters > 0 and (valid_ds is None or len(valid_ds) < gbs):
            raise DynapipeArgumentError(
                f"--eval-iters {eval_iters} needs a validation split of at least one global batch ({gbs} samples); "
                f"the data leaves {0 if valid_ds is None else len(valid_ds)}: raise --split's valid share, give "
                "--valid-data-path, or pass --eval-iters 0")
        return train_ds, valid_ds, _cost_model(args)
    except Exception as error:
        if _world() is not None:
            share_host_failure(_world(), f"{type(error).__name__}: {error}")
        raise


def _world():
    import torch.distributed as dist

    return dist.group.WORLD if dist.is_initialized() else None


def _rampup(args) -> dict:
    """Megatron's ``--rampup-batch-size START INCREMENT SAMPLES``: the loader feeds the ramp's
    batch sizes, rounded as Megatron counts consumed samples (micro-batch size x DP)."""
    rampup = getattr(args, "rampup_batch_size", None)
    if not rampup:
        return {}
    divisor = int(args.micro_batch_size) * int(args.data_parallel_size) if getattr(
        args, "decrease_batch_size_if_needed", False) else 1
    return {"rampup": tuple(int(v) for v in rampup), "divisor": divisor}


class _DatasetsProvider:
    """See :func:`datasets_provider`."""
    __dynapipe_hook__ = True

    def __init__(self, original: Optional[Callable]):
        self.original = original
        self.__wrapped__ = original
        self._takes_vp_stage = original is not None and "vp_stage" in inspect.signature(original).parameters

    @property
    def is_distributed(self) -> bool:
        """Megatron builds the data on every rank when this is true (else on TP rank 0 only):
        always under DynaPipe (each rank has its loader), else as the script's provider says."""
        try:
            on = bool(getattr(_get_args(), "dynapipe", False))
        except Exception:  # arguments not parsed yet
            on = False
        return on or bool(getattr(self.original, "is_distributed", False))

    def __call__(self, train_val_test_num_samples, vp_stage=None):
        args = _get_args()
        if getattr(args, "dynapipe", False):
            if vp_stage not in (None, 0):  # one loader a rank: its plans say what every model chunk runs
                return None, None, None
            setup(args)
            return build_data_loaders(args, train_val_test_num_samples)
        if self.original is None:
            raise RuntimeError("no datasets provider to fall back to without --dynapipe")
        if self._takes_vp_stage:
            return self.original(train_val_test_num_samples, vp_stage=vp_stage)
        return self.original(train_val_test_num_samples)


def datasets_provider(original: Optional[Callable] = None) -> Callable:
    """Wrap the script's ``train_valid_test_datasets_provider``: with ``--dynapipe`` it returns
    DynaPipe's loaders (:func:`build_data_loaders`, which Megatron passes through as
    ``--dataloader-type external``) on every rank; without, it is ``original``."""
    return _DatasetsProvider(original)
