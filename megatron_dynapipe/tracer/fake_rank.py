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
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_dynapipe.compat import cpu_compat
from megatron_dynapipe.compat.moe_cpu import moe_on_cpu
from megatron_dynapipe.config.layout import (
    ParallelLayout,
    dense_coords,
    expert_coords,
    experts_problem,
    rank_groups,
    shapes_only_problem,
)
from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.data.batch import MICROBATCH_KEYS, PlannedBatch
from megatron_dynapipe.data.microbatches import packed_microbatch
from megatron_dynapipe.gpt.build import build_gpt, transformer_config, uses_transformer_engine
from megatron_dynapipe.gpt.device import TRACE_DTYPES, torch_dtype
from megatron_dynapipe.gpt.forward_step import pretrain_gpt_forward_step
from megatron_dynapipe.tracer import steady_state
from megatron_dynapipe.tracer.fake_groups import member_groups_only, symmetric_object_gathers
from megatron_dynapipe.tracer.meta_cache import MetaKernelCache
from megatron_dynapipe.tracer.meta_mode import MetaMode
from megatron_dynapipe.tracer.moe_routing import balanced_routing
from megatron_dynapipe.tracer.planned import PlannedBatches
from megatron_dynapipe.tracer.recorder import Recorder
from megatron_dynapipe.tracer.representatives import representative_ranks
from megatron_dynapipe.tracer.shapes_only_costs import compute_cost_fn
from megatron_dynapipe.tracer.tensor_sizes import storage_key
from megatron_dynapipe.tracer.trace_format import RankTrace

__all__ = [
    "RankTrace",
    "trace_fake_rank",
    "trace_initialized_rank",
    "trace_ranks",
    "trace_representatives",
]



# ---------------------------------------------------------------------------------------------
# one rank


def _check_groups(layout: ParallelLayout, rank: int) -> dict[str, list[int]]:
    """The rank's groups from :mod:`.topology`, checked against the ones megatron built."""
    from megatron.core import parallel_state as ps

    groups = rank_groups(layout, rank)
    built = {
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "dp": ps.get_data_parallel_group(),
        "dp-cp": ps.get_data_parallel_group(with_context_parallel=True),
        "cp": ps.get_context_parallel_group(),
        "ep": ps.get_expert_model_parallel_group(),
        "expert-dp": ps.get_expert_data_parallel_group(),
    }
    for kind, group in built.items():
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        if ranks != groups[kind]:
            raise RuntimeError(
                f"rank {rank}: megatron's {kind} group {ranks} differs from the topology's "
                f"{groups[kind]} for {layout.describe()}"
            )
    return {kind: list(r) for kind, r in groups.items()}


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


def _batches(spec: ModelSpec, mbs: int, seq: int, count: int, seed: int, device):
    """``count`` micro-batches of random tokens (the same on every rank: values do not matter,
    shapes do)."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(seq, device=device).expand(mbs, seq)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, spec.vocab_size, (mbs, seq + 1), generator=g).to(device)
        out.append({
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "position_ids": positions,
            "loss_mask": torch.ones(mbs, seq, device=device),
        })
    return out


def _planned_tensors(mb, device) -> dict:
    """A planned micro-batch's tensors: its shape (rows x padded length; values do not matter),
    and for a packed one the boundaries of its samples as the data pipeline builds them
    (``cu_seqlens``, ``max_seqlen``: real values, which the attention core reads)."""
    out = {key: torch.zeros(mb.rows, mb.seq_len, dtype=torch.float32 if key == "loss_mask" else torch.int64,
                            device=device) for key in MICROBATCH_KEYS}
    if mb.packed:
        arrays = packed_microbatch([np.zeros(n, dtype=np.int64) for n in mb.packed_lengths], mb.seq_len)
        out.update((key, torch.from_numpy(arrays[key])) for key in ("cu_seqlens", "max_seqlen"))
    return out


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
    run = _TraceRun.checked(layout, ModelSpec.from_any(model_cfg), micro_batch_size=micro_batch_size,
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


def _trace(run: "_TraceRun", cost_model: Any, fill: bool) -> RankTrace:
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


@dataclass
class _Job:
    """What one traced rank built: its stage's model chunks (one, or one per virtual stage with
    interleaving; ``models``, each DDP-wrapped in ``ddps``), the optimizer, the transformer and
    DDP configs, the groups it checked."""
    models: list
    ddps: list
    optimizer: Any
    config: Any
    ddp_config: Any
    groups: dict[str, list[int]]


@dataclass
class _TraceRun:
    """One rank's trace request, checked (:meth:`checked`), and the steps that carry it out."""
    layout: ParallelLayout
    spec: ModelSpec
    micro_batch_size: int
    num_microbatches: int
    seq_length: int
    warmup_iters: int
    trace_iters: int
    shapes_only: bool
    dtype_name: str
    optimizer: str
    clip_grad: float
    training: MegatronOptions
    seed: int
    use_te: bool
    on_gpu: bool
    #: micro-batches the schedule runs: shapes-only traces run few and extend (:mod:`.steady_state`)
    recorded_microbatches: int = 0
    #: the planned batches this rank runs DynaPipe's executor on (:mod:`.planned`), else Megatron's schedule
    planned: Optional[PlannedBatches] = None

    @classmethod
    def checked(cls, layout: ParallelLayout, spec: ModelSpec, *, dtype: Optional[str], shapes_only: bool,
                **fields: Any) -> "_TraceRun":
        """Refuse, before anything is built, what cannot be traced here (one line naming the fix)."""
        for name in ("micro_batch_size", "num_microbatches", "seq_length", "trace_iters"):
            value = fields[name]
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(fields["warmup_iters"], int) or fields["warmup_iters"] < 0:
            raise ValueError(f"warmup_iters must be an int >= 0, got {fields['warmup_iters']!r}")
        if not dist.is_initialized():
            raise RuntimeError("trace_initialized_rank needs torch.distributed initialised; "
                               "use trace_fake_rank to pretend to be a rank")
        if dist.get_world_size() != layout.world_size:
            raise ValueError(f"process group has {dist.get_world_size()} ranks, layout "
                             f"{layout.describe()} needs {layout.world_size}")
        _check_model_fits(spec, layout, shapes_only)
        if fields["planned"] is not None and not shapes_only:
            raise ValueError("a planned method is traced shapes-only (its compute priced by the planner's cost model): "
                             "pass shapes_only=True (trace --shapes-only)")
        fields["training"] = fields["training"].at_tp(layout.tp)  # as Megatron-LM validates them
        problem = fields["training"].layout_problem(
            tp=layout.tp, pp=layout.pp, num_layers=spec.num_layers,
            num_microbatches=fields["num_microbatches"], moe=bool(spec.num_experts))
        if problem:
            raise ValueError(problem)
        use_te = uses_transformer_engine("cuda" if torch.cuda.is_available() else "cpu") and not shapes_only
        if layout.cp > 1 and not (use_te or shapes_only):
            raise ValueError(
                f"context parallelism (CP={layout.cp}) passes keys and values around its ring of ranks, and a "
                "fake rank runs alone: trace it with --shapes-only, or run transformer-engine on CUDA")
        if fields["planned"] and spec.attention == "local":
            # megatron's local core refuses packed micro-batches: the planned methods hold what SDPA's
            # fused kernel saves, alike
            spec = dataclasses.replace(spec, attention="sdpa")
        if fields["seq_length"] > spec.max_sequence_length:
            spec = dataclasses.replace(spec, max_sequence_length=fields["seq_length"])
        on_gpu = torch.cuda.is_available()
        dtype_name = dtype or ("bfloat16" if (shapes_only or on_gpu) else "float32")
        if dtype_name not in TRACE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(TRACE_DTYPES)}, got {dtype_name!r}")
        run = cls(layout, spec, shapes_only=shapes_only, dtype_name=dtype_name, use_te=use_te, on_gpu=on_gpu,
                  **fields)
        run.recorded_microbatches = (steady_state.recorded_microbatches(
            run.num_microbatches, layout.pp, run.period, run.chunks, run.stage) if shapes_only and not run.planned
            else run.num_microbatches)  # a planned step is its plan, which repeats nothing
        return run

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype_name)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def stage(self) -> int:
        return dense_coords(self.layout, self.rank).pp

    @property
    def vocab(self) -> int:
        return self.spec.padded_vocab_size(self.layout.tp)

    @property
    def chunks(self) -> int:
        """Model chunks on this rank: the virtual pipeline size with interleaving, else 1."""
        return self.training.virtual_size(self.spec.num_layers, self.layout.pp)

    @property
    def warmup_microbatches(self) -> int:
        """Micro-batches of an untraced step.  Shapes-only, it only has to create what megatron
        creates lazily (optimizer state, buffers), so it runs the fewest the schedule takes; a
        timed run warms up on every micro-batch (kernels, allocator) before it measures."""
        if not self.shapes_only:
            return self.num_microbatches
        return self.layout.pp if self.chunks > 1 else 1

    @property
    def period(self) -> int:
        """Micro-batches the schedule's steady state repeats in: megatron-core interleaves in
        groups of the pipeline size (its default ``microbatch_group_size_per_vp_stage``)."""
        return self.layout.pp if self.chunks > 1 else 1

    @property
    def moe_on_cpu(self) -> bool:
        return not self.on_gpu and bool(self.spec.num_experts)

    def routing_fields(self) -> dict[str, Any]:
        """MoE routes by :func:`~.moe_routing.balanced_logits` (see :func:`~.moe_routing.balanced_routing`)."""
        return {"moe_router_force_load_balancing": True} if self.spec.num_experts else {}

    def device_scope(self):
        """Where MoE on CPU builds and runs its forward/backward (see
        :func:`megatron_dynapipe.compat.moe_cpu.moe_on_cpu`)."""
        return cpu_compat.cuda_as_cpu() if self.moe_on_cpu else contextlib.nullcontext()

    def build(self) -> _Job:
        """Model parallelism, this rank's stage of the GPT, DDP and megatron's optimizer."""
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        layout, fake = self.layout, dist.get_backend() == "fake"
        # a fake rank creates only its own groups (the same ones, the same state); a real job's
        # ranks must all take part in every group megatron creates
        with member_groups_only() if fake else contextlib.nullcontext():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
                expert_tensor_parallel_size=layout.expert_tp, order=layout.order, create_gloo_process_groups=False,
                virtual_pipeline_model_parallel_size=self.chunks if self.chunks > 1 else None)
        groups = _check_groups(layout, self.rank)
        torch.manual_seed(self.seed)
        model_parallel_cuda_manual_seed(self.seed)
        config = transformer_config(
            self.spec, dtype=self.torch_dtype, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
            expert_tp=layout.expert_tp, on_gpu=self.on_gpu, use_te=self.use_te, initialize=not self.shapes_only,
            **self.training.transformer_fields(), **self.routing_fields(),
            **self.training.virtual_fields(self.spec.num_layers, layout.pp))
        models = [self._chunk(config, vp_stage) for vp_stage in self._vp_stages()]
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, **self.training.ddp_fields())
        # Megatron-LM's default --align-param-gather, which it keeps only for interleaving
        ddp_config.align_param_gather = ddp_config.overlap_param_gather and len(models) > 1
        # Megatron-LM's get_model: later chunks' reductions overlap compute anyway, so one bucket each
        ddps = [DistributedDataParallel(config, ddp_config, model, disable_bucketing=index > 0)
                for index, model in enumerate(models)]
        _set_sync_funcs(config, ddps, ddp_config)
        # megatron all-gathers each rank's parameter-group keys over the world: W copies of ours
        with symmetric_object_gathers() if fake else contextlib.nullcontext():
            opt = get_megatron_optimizer(
                OptimizerConfig(optimizer=self.optimizer, lr=1e-4, clip_grad=self.clip_grad,
                                bf16=self.torch_dtype == torch.bfloat16, fp16=self.torch_dtype == torch.float16,
                                params_dtype=self.torch_dtype,
                                use_distributed_optimizer=ddp_config.use_distributed_optimizer),
                ddps, use_gloo_process_groups=False)
        return _Job(models, ddps, opt, config, ddp_config, groups)

    def _vp_stages(self) -> list[Optional[int]]:
        return list(range(self.chunks)) if self.chunks > 1 else [None]

    def _chunk(self, config, vp_stage: Optional[int]):
        """One model chunk of this rank (the whole stage without interleaving), as Megatron-LM's
        ``get_model`` builds it: the embedding only in the first virtual stage, the head only in
        the last, 16-bit weights and norms in a ``Float16Module``."""
        from megatron.core import parallel_state

        where = dict(ignore_virtual=False, vp_stage=vp_stage)
        with self.device_scope():
            model = build_gpt(self.spec, config, tp=self.layout.tp, use_te=self.use_te, vp_stage=vp_stage,
                              pre_process=parallel_state.is_pipeline_first_stage(**where),
                              post_process=parallel_state.is_pipeline_last_stage(**where))
        if self.on_gpu and not self.shapes_only:
            model = model.cuda()
        if self.torch_dtype != torch.float32:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        model.vp_stage = vp_stage
        return model

    def compute_costs(self, cost_model):
        """(the recorder's ``cost(kind, microbatch, chunk)``, what priced it) of a shapes-only
        rank; (None, None) where compute is timed."""
        if not self.shapes_only:
            return None, None
        if self.planned:  # the planner's price of each micro-batch, batch by batch
            return self.planned.costs_for(self.stage, self.layout.pp), self.planned.cost_model
        return compute_cost_fn(cost_model, self.spec, self.layout, self.stage, self.micro_batch_size,
                               self.seq_length, self.training, dtype=self.dtype_name)

    def recorder(self, cost, fill: bool) -> Recorder:
        """Shapes-only: ops timed by the cost model, nothing executed; else real, timed ops."""
        if self.shapes_only:
            return Recorder(stage=self.stage, clock="cost_model", cost_fn=cost, fill=False, execute=False,
                            seed=self.seed + self.rank)
        return Recorder(stage=self.stage, clock="auto", fill=fill, execute=True, seed=self.seed + self.rank)

    def train_step(self, job: _Job, recorder: Recorder):
        """``step(index, record)``: one Megatron-LM ``train_step`` (module docstring), its
        forward-backward Megatron's schedule or, for a planned method, DynaPipe's executor."""
        from megatron.core import parallel_state

        finalize = job.config.finalize_model_grads_func

        def finalize_in_region(*args, **kwargs):
            with recorder.region("finalize_grads"):
                return finalize(*args, **kwargs)

        job.config.finalize_model_grads_func = finalize_in_region
        dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        forward_backward = self._planned_schedule(job, recorder) if self.planned else self._megatron_schedule(job)

        def step(index: int, record: bool) -> None:
            with recorder.iteration(index, record=record):
                for ddp in job.ddps:
                    ddp.zero_grad_buffer()
                job.optimizer.zero_grad()
                with self.device_scope():
                    losses = forward_backward(index, record)
                with recorder.compute("optimizer_step", name="optimizer.step"):
                    job.optimizer.step()
                if losses:  # last stage: Megatron-LM reduces the reported loss over DP x CP
                    with recorder.region("loss_report"):
                        report = torch.stack([d["lm loss"] for d in losses]).sum(0)
                        dist.all_reduce(report, group=dp_cp_group)

        return step

    def _megatron_schedule(self, job: _Job):
        """``forward_backward(index, record)`` through megatron-core's own schedule."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # whole sequences: the forward step takes this context-parallel rank's share, as Megatron-LM's does
        batches = _batches(self.spec, self.micro_batch_size, self.seq_length,
                           self.recorded_microbatches, self.seed, "cuda" if self.on_gpu else "cpu")
        forward_backward = get_forward_backward_func()

        def run(index: int, record: bool) -> list:
            # interleaving takes an iterator per chunk; each chunk reads the batches it needs
            iterators = [iter(batches) for _ in job.ddps] if len(job.ddps) > 1 else iter(batches)
            return forward_backward(
                forward_step_func=pretrain_gpt_forward_step, data_iterator=iterators, model=job.ddps,
                num_microbatches=self.recorded_microbatches if record else self.warmup_microbatches,
                seq_length=self.seq_length, micro_batch_size=self.micro_batch_size, forward_only=False)

        return run

    def _planned_schedule(self, job: _Job, recorder: Recorder):
        """``forward_backward(index, record)`` through DynaPipe's executor, as Megatron-LM runs it
        with ``--dynapipe``: traced iteration ``index`` runs this stage's plan of batch ``index``
        (an untraced one, batch 0's), its compute priced batch by batch."""
        from megatron.core import parallel_state

        from megatron_dynapipe.runtime.p2p import adopt_twin_groups
        from megatron_dynapipe.runtime.provider import forward_backward_dynapipe

        if dist.get_backend() == "fake":  # alone in this process: no peer would answer the set-up
            adopt_twin_groups(parallel_state.get_pipeline_model_parallel_group(), dist.new_group)
        device = "cuda" if self.on_gpu else "cpu"

        def run(index: int, record: bool) -> list:
            batch = index if record else 0
            recorder.cost_fn.batch = batch
            plan = self.planned.batches[batch].plans[self.stage]
            data = PlannedBatch(index, plan, [_planned_tensors(mb, device) for mb in plan.microbatches])
            first = plan.microbatches[0]
            # megatron's own schedules run in a CPU scope of their own (compat/cpu_compat.py); the executor, as
            # Megatron-LM runs it on the CPU, inside one
            with contextlib.nullcontext() if self.on_gpu else cpu_compat.cuda_as_cpu():
                return forward_backward_dynapipe(
                    forward_step_func=pretrain_gpt_forward_step, data_iterator=iter([data]), model=job.ddps,
                    num_microbatches=len(plan.microbatches), seq_length=first.seq_len, micro_batch_size=first.rows,
                    forward_only=False)

        return run

    def rank_trace(self, job: _Job, recorder: Recorder, memory, priced_by, *,
                   build_seconds: float, run_seconds: float) -> RankTrace:
        import megatron.core
        from megatron.core.pipeline_parallel import get_forward_backward_func

        rank = self.rank
        ops = recorder.ops
        if self.recorded_microbatches < self.num_microbatches:
            ops = steady_state.extend(ops, self.num_microbatches, self.period)
        return RankTrace(
            rank=rank, stage=self.stage, layout=_layout_json(self.layout),
            coords=dense_coords(self.layout, rank)._asdict(),
            expert_coords=expert_coords(self.layout, rank)._asdict(), groups=job.groups,
            model={**self.spec.to_json(), "padded_vocab_size": self.vocab, "dtype": self.dtype_name,
                   "layer_spec": "transformer_engine" if self.use_te else "local",
                   "sequence_parallel": bool(job.config.sequence_parallel)},
            iteration={
                "micro_batch_size": self.micro_batch_size, "num_microbatches": self.num_microbatches,
                "seq_length": self.seq_length, "warmup_iters": self.warmup_iters, "trace_iters": self.trace_iters,
                "schedule": "dynapipe" if self.planned else get_forward_backward_func().__name__,
                "optimizer": self.optimizer,
                "clip_grad": self.clip_grad, "training": self.training.to_json(),
                "ddp": {k: v for k, v in dataclasses.asdict(job.ddp_config).items()
                        if isinstance(v, (bool, int, float, str, type(None)))},
                **({"planned": self.planned.to_json()} if self.planned else {}),
            },
            mode="shapes_only" if self.shapes_only else "real", device="cuda" if self.on_gpu else "cpu",
            clock=recorder.clock, memory=memory,
            meta={"megatron_core": getattr(megatron.core, "__version__", "unknown"), "torch": torch.__version__,
                  "backend": dist.get_backend(), **_pricing(priced_by), "build_seconds": round(build_seconds, 4),
                  "run_seconds": round(run_seconds, 4), "recorded_microbatches": self.recorded_microbatches},
            ops=ops,
        )


def _pricing(cost_model) -> dict:
    """What priced a shapes-only trace's compute: the cost model's name and, when a hardware
    file built it, that hardware (``simulate`` on another hardware prices it anew)."""
    if cost_model is None:
        return {"cost_model": None}
    out = {"cost_model": getattr(cost_model, "name", "") or type(cost_model).__name__}
    if getattr(cost_model, "hardware", None):
        out["compute_hardware"] = cost_model.hardware
    return out


def _set_sync_funcs(config, ddps: list, ddp_config) -> None:
    """The schedule's hooks as Megatron-LM's ``train`` sets them: with overlapped gradient
    reduction each chunk's ``no_sync`` and (``--align-grad-reduce``, its default) its
    ``start_grad_sync``, so that later pipeline stages reduce in the bubble after their last
    backward; with aligned parameter gathers each chunk's ``start_param_sync``; a list only
    for several chunks."""
    from megatron.core.distributed import finalize_model_grads

    def per_chunk(name: str):
        funcs = [getattr(ddp, name) for ddp in ddps]
        return funcs if len(funcs) > 1 else funcs[0]

    if ddp_config.overlap_grad_reduce:
        config.no_sync_func = per_chunk("no_sync")
        config.grad_sync_func = per_chunk("start_grad_sync")
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        config.param_sync_func = per_chunk("start_param_sync")
    config.finalize_model_grads_func = finalize_model_grads


def _check_model_fits(spec: ModelSpec, layout: ParallelLayout, shapes_only: bool) -> None:
    problem = experts_problem(spec.num_experts, layout.ep)
    if problem:
        raise ValueError(problem)
    if layout.is_moe and not spec.num_experts:  # expert TP differs from TP without experts
        raise ValueError(f"layout {layout.describe()} has expert parallelism but the model has "
                         "no experts; give the model num_experts")
    problem = shapes_only and shapes_only_problem(spec)
    if problem:
        raise ValueError(problem)


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


def _layout_json(layout: ParallelLayout) -> dict[str, Any]:
    return {
        "world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp,
        "ep": layout.ep, "dp": layout.dp, "expert_tp": layout.expert_tp,
        "expert_dp": layout.expert_dp, "order": layout.order,
    }


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
