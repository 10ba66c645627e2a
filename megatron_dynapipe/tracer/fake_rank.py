"""Pretend to be one rank of a full-size Megatron job, run its pipeline stage, trace it.

::

    layout = ParallelLayout(world_size=1024, tp=8, pp=4)
    trace = trace_fake_rank(layout, 256, "6.7B", micro_batch_size=1, num_microbatches=8,
                            seq_length=2048, warmup_iters=1, trace_iters=1, shapes_only=True)
    trace.write("traces/6.7B-w1024")          # traces/6.7B-w1024/rank_256.trace.jsonl

For each rank, in this one process (importing megatron takes seconds; a process per rank would
pay that every time): ``torch.distributed.init_process_group("fake", store=FakeStore(), rank=r,
world_size=W)``, megatron-core ``initialize_model_parallel`` at the layout's TP/PP/CP/EP (only
the groups that contain rank r are created, and the optimizer's object all-gather over the
world is answered without W tensors, :mod:`.fake_groups`: the set-up costs about as much at
W = 8192 as at W = 64), the rank's ``GPTModel`` stage with its real TP-sharded shapes
(local layer spec with ``use_cpu_initialization`` on CPU, transformer-engine spec on CUDA when it
imports), megatron DDP and optimizer, ``warmup_iters`` untraced and ``trace_iters`` traced
training steps through megatron-core's own ``get_forward_backward_func()`` (1F1B when PP > 1),
then teardown (``destroy_model_parallel`` + ``destroy_process_group``) so the next rank can start.

The fake backend's collectives return at once and receives leave garbage; the recorder fills
them with the values a job of identical peers would see (:mod:`.recorder`, ``fill=True``), so
forward passes stay finite.  Shapes decide every traced byte; values never do: MoE routes each
token by its position (:func:`~.moe_routing.balanced_routing`), so every rank routes the same counts.

Shapes-only mode
----------------
For models that do not fit this machine (``shapes_only=True``) the same code runs with every
tensor on PyTorch's ``meta`` device: a :class:`~torch.overrides.TorchFunctionMode` sends every
factory call and device move to ``meta`` (0-dim scalars, e.g. Adam's step counter, stay real on
the CPU), the recorder does not call the backend (``execute=False``: it cannot take meta
tensors), and compute durations come from a cost model (:mod:`megatron_dynapipe.planning.cost_model`,
the analytical model of this GPT unless one is given).  So megatron-core's real schedule, p2p
communicator, tensor-parallel layers, DDP buckets and optimizer still issue every op with the
real shapes, and nothing allocates: GPT-6.7B at TP=8/PP=4 traces in about a second per rank.
Where megatron reads a value back from a meta tensor (``.item()`` of a grad norm, an inf check)
the mode answers 0 (no clipping, no overflow): a real step would see numbers, but the ops it
issues do not depend on them.  Memory figures in this mode are the model state megatron allocated
(on meta) plus the activation high-water mark autograd saved, both exact sizes.

Planned methods
---------------
With ``planned`` (:mod:`.planned`: global batches of the user's data, planned for the job) a rank
runs DynaPipe's executor instead of megatron-core's schedule, through the same
``forward_backward_dynapipe`` Megatron-LM calls with ``--dynapipe``: traced iteration ``i`` is
this stage's plan of batch ``i`` (data-parallel rank 0's), shapes-only, each forward and backward
priced by the planner's cost model at its micro-batch's shape and recompute.

Representative ranks
--------------------
:func:`trace_representatives` traces the ranks :func:`~.topology.representative_ranks` picks
(dense: one per pipeline stage; MoE: one per stage x EP rank) and writes one file per rank;
:func:`trace_ranks` traces any list of ranks.  :func:`trace_initialized_rank` is the same run on
an already-initialised process group (e.g. a real gloo job): the fidelity test compares the two.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dynapipe.compat import cpu_compat
from megatron_dynapipe.compat.moe_cpu import moe_on_cpu
from megatron_dynapipe.config.layout import ParallelLayout
from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.tracer import steady_state
from megatron_dynapipe.tracer.meta_cache import MetaKernelCache
from megatron_dynapipe.tracer.meta_mode import MetaMode
from megatron_dynapipe.tracer.moe_routing import balanced_routing
from megatron_dynapipe.tracer.planned import PlannedBatches
from megatron_dynapipe.tracer.representatives import representative_ranks
from megatron_dynapipe.tracer.tensor_sizes import storage_key
from megatron_dynapipe.tracer.trace_format import RankTrace
from megatron_dynapipe.tracer.trace_run import TraceRun

__all__ = [
    "RankTrace",
    "trace_fake_rank",
    "trace_initialized_rank",
    "trace_ranks",
    "trace_representatives",
]


# ---------------------------------------------------------------------------------------------
# one rank


def _probe_recompute_units(meter, models) -> None:
    """Have ``meter`` measure what recomputation keeps and frees, on the rank's first transformer
    layer: the whole layer and its input (full recompute keeps only the input), its attention core
    and the core's query, key and value (selective recompute keeps only those)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layer = next((m for model in models for m in model.modules() if isinstance(m, TransformerLayer)), None)
    if layer is None:
        return
    meter.probe(layer, "transformer_layer", input_label="layer_input")
    core = getattr(getattr(layer, "self_attention", None), "core_attention", None)
    if core is not None:
        meter.probe(core, "core_attention", input_label="core_attention_input", inputs=3)


def _model_state(models, ddp_models, optimizer) -> dict[str, int]:
    """Bytes of parameters, DDP gradient/parameter buffers and optimizer state (distinct
    storages; works on meta tensors)."""
    seen: dict[int, object] = {}  # storage id -> storage: kept alive so that no id is reused

    def total(tensors) -> int:
        n = 0
        for t in tensors:
            if isinstance(t, torch.Tensor):
                key, storage = storage_key(t)
                if key not in seen:
                    seen[key] = storage
                    n += t.untyped_storage().nbytes()
        return n

    out = {"params": total(p for m in models for p in m.parameters())}
    buffers = []
    for m in ddp_models:
        for buf in list(getattr(m, "buffers", [])) + list(getattr(m, "expert_parallel_buffers", [])):
            buffers += [buf.grad_data, getattr(buf, "param_data", None)]
    out["grad_buffers"] = total(buffers)
    state = []
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            state += group["params"]
        for values in opt.state.values():
            state += [v for v in values.values() if isinstance(v, torch.Tensor)]
    out["optimizer"] = total(state)
    return out


def _torch_optimizers(optimizer) -> list:
    if hasattr(optimizer, "chained_optimizers"):
        return [o for c in optimizer.chained_optimizers for o in _torch_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if inner is not None else []


def trace_initialized_rank(
    layout: ParallelLayout,
    model_cfg: Any,
    *,
    micro_batch_size: int,
    num_microbatches: int,
    seq_length: int,
    warmup_iters: int = 1,
    trace_iters: int = 1,
    shapes_only: bool = False,
    cost_model: Any = None,
    dtype: Optional[str] = None,
    optimizer: str = "adam",
    clip_grad: float = 1.0,
    training: Optional[MegatronOptions] = None,
    fill: bool = False,
    seed: int = 1234,
    repeat_steady_state: bool = True,
    planned: Optional[PlannedBatches] = None,
) -> RankTrace:
    """Build this process's stage of the job on the already-initialised default process group
    (world size ``layout.world_size``; gloo, NCCL or fake), run ``warmup_iters`` + ``trace_iters``
    training steps with the recorder installed and return the trace of the traced ones.

    One step is what Megatron-LM's ``train_step`` does: zero the gradient buffers, megatron-core's
    ``get_forward_backward_func()`` (its ``finalize_model_grads`` reduces gradients over DP,
    the tied embedding over the embedding group), ``optimizer.step()`` (grad-norm all-reduce with
    ``clip_grad > 0``), and on the last stage the all-reduce of the reported loss over DP x CP.
    ``training`` (:class:`~megatron_dynapipe.config.megatron_options.MegatronOptions`: distributed optimizer,
    overlap, recompute, sequence parallelism) is Megatron-LM's defaults when None.
    ``fill`` makes collectives deliver symmetric values (for fake process groups).
    A shapes-only trace runs only a few micro-batches and repeats the schedule's steady state
    up to ``num_microbatches`` (:mod:`.steady_state`) unless ``repeat_steady_state`` is False.
    ``planned`` (:mod:`.planned`) runs DynaPipe's executor on this stage's plan of each planned
    batch instead, one traced iteration a batch (``trace_iters`` is their number), its compute
    priced by the planner's cost model.
    """
    run = TraceRun.checked(layout, ModelSpec.from_any(model_cfg), micro_batch_size=micro_batch_size,
                            num_microbatches=num_microbatches, seq_length=seq_length, warmup_iters=warmup_iters,
                            trace_iters=len(planned.batches) if planned else trace_iters, shapes_only=shapes_only,
                            dtype=dtype, optimizer=optimizer, clip_grad=clip_grad,
                            training=training or MegatronOptions(), seed=seed, planned=planned)
    if repeat_steady_state and run.recorded_microbatches < num_microbatches:
        try:
            return _trace(run, cost_model, fill)
        except steady_state.NotPeriodic as exc:  # a schedule that does not repeat: run every micro-batch
            print(f"rank {run.rank}: {exc}; tracing all {num_microbatches} micro-batches", flush=True)
    return _trace(dataclasses.replace(run, recorded_microbatches=num_microbatches), cost_model, fill)


def _trace(run: "TraceRun", cost_model: Any, fill: bool) -> RankTrace:
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if not run.on_gpu:
            stack.enter_context(cpu_compat.cpu_mode())  # leaves CPU mode as it found it
        if run.moe_on_cpu:
            stack.enter_context(moe_on_cpu())
        if run.spec.num_experts:
            stack.enter_context(balanced_routing())
        if run.shapes_only:
            stack.enter_context(MetaMode())
            stack.enter_context(MetaKernelCache())
        stack.callback(_teardown_megatron)
        job = run.build()
        built = time.perf_counter()
        cost, priced_by = run.compute_costs(cost_model)
        recorder = stack.enter_context(run.recorder(cost, fill))
        step = run.train_step(job, recorder)
        for i in range(run.warmup_iters):
            step(i, record=False)
        recorder.meter.reset()
        _probe_recompute_units(recorder.meter, job.models)
        static = _model_state(job.models, job.ddps, job.optimizer)
        recorder.meter.set_static(p for m in job.models for p in m.parameters())
        recorder.meter.set_static(_static_tensors(job.ddps, job.optimizer))
        if run.on_gpu and not run.shapes_only:
            torch.cuda.reset_peak_memory_stats()
        for i in range(run.trace_iters):
            step(i, record=True)
        memory = recorder.memory(sum(static.values()), static)
        finished = time.perf_counter()
        return run.rank_trace(job, recorder, memory, priced_by, build_seconds=built - started,
                              run_seconds=finished - built)


def _static_tensors(ddp_models, optimizer):
    for m in ddp_models:
        for buf in list(getattr(m, "buffers", [])) + list(getattr(m, "expert_parallel_buffers", [])):
            yield buf.grad_data
            if getattr(buf, "param_data", None) is not None:
                yield buf.param_data
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            yield from group["params"]
        for values in opt.state.values():
            yield from (v for v in values.values() if isinstance(v, torch.Tensor))


def _teardown_megatron() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    # MoE keeps per-layer aux-loss logs and the aux-loss backward scale in module/class state
    # that would leak into the next rank traced in this process (a meta scale into a real run).
    from megatron.core.transformer.moe import moe_utils

    moe_utils.clear_aux_losses_tracker()
    moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None


# ---------------------------------------------------------------------------------------------
# fake ranks


def trace_fake_rank(
    layout: ParallelLayout,
    rank: int,
    model_cfg: Any,
    *,
    micro_batch_size: int,
    num_microbatches: int,
    seq_length: int,
    warmup_iters: int = 1,
    trace_iters: int = 1,
    shapes_only: bool = False,
    cost_model: Any = None,
    **options: Any,
) -> RankTrace:
    """Pretend to be global rank ``rank`` of ``layout`` in this process and trace it.

    Initialises torch's fake process group (``FakeStore``, backend ``"fake"``) as that rank of
    ``layout.world_size``, runs :func:`trace_initialized_rank` with symmetric collective values,
    and destroys the process group again, so the next call can be another rank.  ``model_cfg``
    is anything :meth:`ModelSpec.from_any` takes; ``options`` go to
    :func:`trace_initialized_rank` (``dtype``, ``optimizer``, ``clip_grad``, ``training``,
    ``seed``).  ``shapes_only`` runs on the meta device with ``cost_model`` durations (module
    docstring).  Returns the :class:`RankTrace`; ``trace.write(folder)`` stores it.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; "
                           "trace_fake_rank initialises its own fake process group")
    if not isinstance(rank, int) or not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank!r} is outside 0..{layout.world_size - 1}")
    started = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        trace = trace_initialized_rank(
            layout, model_cfg, micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
            seq_length=seq_length, warmup_iters=warmup_iters, trace_iters=trace_iters,
            shapes_only=shapes_only, cost_model=cost_model, fill=not shapes_only, **options,
        )
    finally:
        dist.destroy_process_group()
    trace.meta["trace_seconds"] = round(time.perf_counter() - started, 4)
    return trace


def trace_ranks(
    layout: ParallelLayout,
    ranks: Sequence[int],
    model_cfg: Any,
    *,
    out_dir: Optional[str | os.PathLike] = None,
    **kwargs: Any,
) -> list[RankTrace]:
    """:func:`trace_fake_rank` for each rank in turn (one process); writes each trace into
    ``out_dir`` as soon as it is done when given."""
    traces = []
    # CPU mode stays on across the ranks (switching it costs a scan of megatron's modules)
    with cpu_compat.cpu_mode() if not torch.cuda.is_available() else contextlib.nullcontext():
        for rank in ranks:
            trace = trace_fake_rank(layout, rank, model_cfg, **kwargs)
            if out_dir is not None:
                trace.write(out_dir)
            traces.append(trace)
    return traces


def trace_representatives(
    layout: ParallelLayout,
    model_cfg: Any,
    *,
    out_dir: Optional[str | os.PathLike] = None,
    **kwargs: Any,
) -> list[RankTrace]:
    """Trace the representative ranks of ``layout`` (MoE when the model has experts)."""
    spec = ModelSpec.from_any(model_cfg)
    reps = representative_ranks(layout, moe=bool(spec.num_experts) and layout.is_moe)
    return trace_ranks(layout, reps.global_ranks, spec, out_dir=out_dir, **kwargs)
