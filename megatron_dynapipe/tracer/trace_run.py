"""One fake rank's trace, step by step: the request checked before anything is built
(:meth:`TraceRun.checked`), the rank's stage of the job built as Megatron-LM builds it
(:meth:`TraceRun.build`: model parallelism, the GPT's model chunks, DDP, megatron's optimizer),
one training step through megatron-core's schedule or DynaPipe's executor
(:meth:`TraceRun.train_step`), and the trace file's contents (:meth:`TraceRun.rank_trace`).
:mod:`.fake_rank` runs them (its docstring says how a rank is faked)."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_dynapipe.compat import cpu_compat
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
from megatron_dynapipe.tracer.planned import PlannedBatches
from megatron_dynapipe.tracer.recorder import Recorder
from megatron_dynapipe.tracer.shapes_only_costs import compute_cost_fn
from megatron_dynapipe.tracer.trace_format import RankTrace


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


@dataclass
class RankJob:
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
class TraceRun:
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
                **fields: Any) -> "TraceRun":
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

    def build(self) -> RankJob:
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
        return RankJob(models, ddps, opt, config, ddp_config, groups)

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

    def train_step(self, job: RankJob, recorder: Recorder):
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

    def _megatron_schedule(self, job: RankJob):
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

    def _planned_schedule(self, job: RankJob, recorder: Recorder):
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

    def rank_trace(self, job: RankJob, recorder: Recorder, memory, priced_by, *,
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


def _layout_json(layout: ParallelLayout) -> dict[str, Any]:
    return {
        "world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp,
        "ep": layout.ep, "dp": layout.dp, "expert_tp": layout.expert_tp,
        "expert_dp": layout.expert_dp, "order": layout.order,
    }
