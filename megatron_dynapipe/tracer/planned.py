"""A planned method on fake ranks: the global batches a ``trace --method dynapipe`` (or
``dynapipe-varlen``, ``thd`` or ``dp_balanced``) run traces, planned once per layout, and what each traced rank
takes of them.

A fixed-shape trace runs Megatron's schedule on made-up micro-batches of one shape. A planned
trace draws ``count`` global batches of ``global batch x seq-length`` tokens from the user's
lengths (the run's seed; batch ``i`` depends on the seed and ``i`` alone, as ``simulate --method``
draws them), plans each for the whole job with the real planner (every data-parallel rank), and
has each representative rank run DynaPipe's executor on its stage's plan of data-parallel rank 0,
one traced iteration a batch. THD packing is planned as Megatron would run it: Megatron's
windows of the batch in rows without attention across documents, on Megatron's own schedule,
lowered to the same plans. So the trace records what that job would issue: the plan's
micro-batch shapes in every activation and gradient transfer, its order, and its recompute in
each backward (full recompute repeats the layers' forward, tensor-parallel collectives included).

Compute is priced by the cost model the planner used, per micro-batch (its shape and recompute),
so the replay and the plan agree on every op's time. A step lasts as long as its slowest
data-parallel rank: the traced rank is rank 0, and each batch's header entry keeps every rank's
planned pipeline time, which :mod:`megatron_dynapipe.simulate.report` adds where rank 0 is not
the slowest. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

from megatron_dynapipe.config.accounting import step_flops
from megatron_dynapipe.config.layout import ParallelLayout
from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.hardware import Hardware
from megatron_dynapipe.planning.baselines import ThdRows, megatron_dp_balanced_rows, megatron_plans, megatron_thd_rows
from megatron_dynapipe.planning.cost_model import StageCosts, as_stage_costs, split_over_cp
from megatron_dynapipe.planning.methods import METHODS, SEARCHED
from megatron_dynapipe.planning.planner import PlanningError, generate_execution_plan
from megatron_dynapipe.planning.samples import LengthSource
from megatron_dynapipe.planning.simulator import stage_work
from megatron_dynapipe.planning.spec import TrainingSpec, seqlen_round_for
from megatron_dynapipe.planning.types import RecomputeType, cost_shapes, recompute_at_least
from megatron_dynapipe.tracer.shapes_only_costs import ring_blocks

__all__ = ["PLANNED_METHODS", "DrawnBatch", "PlanRequest", "PlannedBatches", "PlannedCosts", "plan_batches",
           "real_model_flops"]

#: the methods a fake rank traces through DynaPipe's executor (every one a search prices but
#: Megatron's fixed shapes, which Megatron-LM's own schedule runs), and the packing of their micro-batches
PLANNED_METHODS = {name: METHODS[name].packing for name in SEARCHED if name != "megatron"}


@dataclass(frozen=True)
class PlanRequest:
    """What ``trace --method`` asks of every config: the method, where the samples come from,
    how many batches, their seed, fast mode (True, False or "auto"), and the device the plans are
    made for (its memory is their limit; its link between ranks carries the context-parallel ring)."""
    method: str
    source: LengthSource
    hardware: Hardware
    count: int = 8
    seed: int = 0
    fast_mode: "bool | str" = False

    @property
    def memory_limit_mb(self) -> float:
        return self.hardware.memory_gib * 1024

    def __post_init__(self) -> None:
        if self.method not in PLANNED_METHODS:
            raise ValueError(f"trace --method {self.method}: a planned method is one of {', '.join(PLANNED_METHODS)} "
                             "(or Megatron's own schedule, without --method)")
        if not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"--batches must be a positive integer, got {self.count!r}")


@dataclass(frozen=True)
class DrawnBatch:
    """One drawn global batch, planned: data-parallel rank 0's plan of every stage and the
    planner's time of each of its micro-batches' forward and backward on every virtual stage
    (``[pp x chunks, n]``, at the micro-batch's recompute), one block of the context-parallel
    ring's attention of each micro-batch (by ``"forward ring block"`` and ``"backward ring
    block"``, ``[n]``; empty at CP 1), and every data-parallel rank's planned pipeline time."""
    samples: int
    tokens: int
    plans: tuple  # ExecutionPlan per stage, data-parallel rank 0's
    forward_ms: np.ndarray
    backward_ms: np.ndarray
    pipeline_ms: tuple[float, ...]  # per data-parallel rank
    peak_mb: tuple[float, ...]  # per stage, over the data-parallel ranks
    fast_mode: bool
    planning_s: float
    model_flops: float  # on its real tokens (:func:`real_model_flops`)
    ring_block_ms: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """What a trace header keeps of it (every rank's file the same)."""
        return {"samples": self.samples, "tokens": self.tokens, "microbatches": len(self.plans[0].microbatches),
                "pipeline_ms": [round(ms, 4) for ms in self.pipeline_ms],
                "peak_mb": [round(mb, 1) for mb in self.peak_mb], "fast_mode": self.fast_mode,
                "planning_s": round(self.planning_s, 4), "model_flops": self.model_flops}


@dataclass(frozen=True)
class PlannedBatches:
    """A config's drawn batches, planned (:func:`plan_batches`), and the cost model that priced
    them (the trace header names it)."""
    request: PlanRequest
    batches: tuple[DrawnBatch, ...]
    cost_model: Any = None

    def to_json(self) -> dict[str, Any]:
        r = self.request
        return {"method": r.method, "source": r.source.label, "seed": r.seed, "fast_mode": r.fast_mode,
                "planned_for": r.hardware.name, "memory_limit_mb": r.memory_limit_mb, "traced_dp_rank": 0,
                "batches": [b.to_json() for b in self.batches]}

    def costs_for(self, stage: int, pp: int) -> "PlannedCosts":
        return PlannedCosts(self.batches, stage, pp)


class PlannedCosts:
    """``cost(kind, microbatch, chunk) -> ms`` of one traced rank's compute ops, for the recorder:
    the planner's time of that micro-batch's forward or backward on that chunk, in the batch
    :attr:`batch` (the iteration being run); other compute (the loss, nested in the last
    stage's forward; the optimizer step) costs nothing here, as in a fixed-shape trace."""

    def __init__(self, batches, stage: int, pp: int):
        self.batches, self.stage, self.pp = batches, stage, pp
        self.batch = 0

    def __call__(self, kind: str, microbatch: Optional[int], chunk: Optional[int]) -> float:
        if microbatch is None:
            return 0.0
        drawn = self.batches[self.batch]
        if kind in drawn.ring_block_ms:
            return float(drawn.ring_block_ms[kind][microbatch])
        if kind not in ("forward", "backward"):
            return 0.0
        table = drawn.forward_ms if kind == "forward" else drawn.backward_ms
        return float(table[(chunk or 0) * self.pp + self.stage, microbatch])


def plan_batches(request: PlanRequest, layout: ParallelLayout, model: ModelSpec, cost_model, *, seq_length: int,
                 global_batch: int, training: MegatronOptions, progress=None) -> PlannedBatches:
    """Draw ``request.count`` global batches of ``global_batch x seq_length`` tokens and plan each
    for ``layout`` (``cost_model``: anything :func:`~megatron_dynapipe.planning.cost_model.as_stage_costs`
    takes, pricing the layout's TP). Refused in one line where a batch cannot be planned.
    ``progress()`` is called after each batch."""
    if layout.is_moe:
        raise ValueError(f"{layout.describe()}: DynaPipe plans dense GPTs; trace an MoE layout without --method")
    chunks = training.virtual_size(model.num_layers, layout.pp)
    split = training.chunk_layers(model.num_layers, layout.pp)
    spec = TrainingSpec(
        num_layers=model.num_layers, pp=layout.pp, tp=layout.tp, dp=layout.dp, cp=layout.cp, chunks=chunks,
        zero_stage=1 if training.distributed_optimizer else 0, memory_limit_mb=request.memory_limit_mb,
        fast_mode=request.fast_mode, packing=PLANNED_METHODS[request.method],
        documents=METHODS[request.method].documents if METHODS[request.method].planned else "whole",
        seqlen_round=seqlen_round_for(layout.cp), seq_length=seq_length,
        stage_layers=None if len(set(split)) == 1 else tuple(split),
        recompute_types=recompute_at_least(tuple(RecomputeType), training.recompute_granularity))
    priced = _stage_costs(cost_model, model, layout, spec)
    # the planner prices the ring's transfers, the TP group's collectives and the stages' transfers
    # at the hardware's links; the trace records all three as ops, which the replay prices so
    hardware = request.hardware
    planning = hardware.planner_stages(priced, model, cp=layout.cp, sequence_parallel=training.sequence_parallel,
                                       tp_comm_overlap=training.tp_comm_overlap,
                                       async_backward=training.async_tp_backward)
    traced = dataclasses.replace(priced, model=split_over_cp(priced.model, layout.cp, model,
                                                             ring_transfers=False))  # the ring: traced ops
    if spec.packed:
        traced = traced.packed()
    drawn = request.source.batches(global_batch * seq_length, seq_length, request.count, request.seed)
    plan_one = {"thd": _thd_step, "dp_balanced": _dp_balanced_step}.get(request.method, _dynapipe_step)
    out = []
    for index, lengths in enumerate(drawn):
        started = time.perf_counter()
        try:
            step = plan_one(lengths, spec, planning, seq_length)
        except PlanningError as error:
            raise ValueError(f"{layout.describe()}: batch {index} of {request.source.label} cannot be planned by "
                             f"{request.method}: {str(error).splitlines()[0]}") from None
        work = stage_work(traced, step.microbatches, step.recompute, chunks)
        out.append(DrawnBatch(len(lengths), int(sum(lengths)), step.plans, work.forward, work.backward,
                              step.pipeline_ms, step.peak_mb, step.fast_mode, time.perf_counter() - started,
                              real_model_flops(model, lengths, layout.tp),
                              ring_blocks(traced.model, *cost_shapes(step.microbatches))))
        if progress is not None:
            progress()
    return PlannedBatches(request, tuple(out), priced.model)


class _Step(NamedTuple):
    """One batch as a method runs it: data-parallel rank 0's plan of every stage, its
    micro-batches and their recompute (``[pp x chunks, n]``), every rank's pipeline time and each
    stage's peak."""
    plans: tuple
    microbatches: list
    recompute: np.ndarray
    pipeline_ms: tuple[float, ...]
    peak_mb: tuple[float, ...]
    fast_mode: bool


def _dynapipe_step(lengths: list[int], spec: TrainingSpec, costs: StageCosts, seq_length: int) -> _Step:
    """The planner's plan of the batch for every data-parallel rank."""
    result = generate_execution_plan(lengths, spec, costs)
    choice = result.choices[0]
    return _Step(tuple(result.plans[0]), choice.microbatches, choice.recompute,
                 tuple(float(c.makespan_ms) for c in result.choices), tuple(float(mb) for mb in result.peak_memory_mb),
                 result.fast_mode)


def _thd_step(lengths: list[int], spec: TrainingSpec, costs: StageCosts, seq_length: int) -> _Step:
    """THD packing on Megatron's own schedule: the batch cut into Megatron's windows, each
    document attending to itself alone, dealt out in order, rows of k windows a micro-batch, 1F1B
    (interleaved over the model chunks), the k and uniform recompute of the fastest run that fits,
    no lighter than the traced ``--recompute-granularity`` (as ``simulate --method thd`` prices it)."""
    found = megatron_thd_rows(lengths, seq_length, costs, spec.memory_limit_mb, spec.chunks, spec.cp,
                              spec.recompute_types)
    if found is None:
        raise PlanningError("no rows of windows fit the memory limit, at any recompute")
    return _megatron_step(found, spec)


def _dp_balanced_step(lengths: list[int], spec: TrainingSpec, costs: StageCosts, seq_length: int) -> _Step:
    """Megatron-LM's ``dp_balanced`` packing on its own schedule: whole samples next-fit in
    arrival order into packs of ``seq_length`` tokens (each padded to whole ring chunks under CP),
    one pack a micro-batch, the lightest uniform recompute that fits, no lighter than the traced
    ``--recompute-granularity`` (as ``simulate --method dp_balanced`` prices it)."""
    try:
        found = megatron_dp_balanced_rows(lengths, seq_length, costs, spec.memory_limit_mb, spec.chunks, spec.cp,
                                          spec.recompute_types)
    except ValueError as error:
        raise PlanningError(str(error)) from None
    if found is None:
        raise PlanningError("its packs fit the memory limit at no recompute")
    return _megatron_step(found, spec)


def _megatron_step(found: ThdRows, spec: TrainingSpec) -> _Step:
    """One of Megatron's packings as a step: data-parallel rank 0's rows on Megatron's schedule."""
    mine = found.per_rank[0]
    recompute = np.full((spec.pp * spec.chunks, len(mine)), int(found.recompute))
    return _Step(tuple(megatron_plans(mine, found.recompute.label, spec.pp, spec.chunks)), mine, recompute,
                 found.rank_makespan_ms, found.stage_peak_mb, False)


def real_model_flops(model: ModelSpec, lengths: list[int], tp: int) -> float:
    """A batch's model FLOPs on its real tokens: each sample a causal sequence of its own length,
    as megatron-core counts one (no padding, no attention across samples)."""
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    return float(sum(step_flops(model, int(n * c), int(n), tp=tp) for n, c in zip(values, counts)))


def _stage_costs(cost_model, model: ModelSpec, layout: ParallelLayout, spec: TrainingSpec) -> StageCosts:
    stages = spec.pp * spec.chunks
    return as_stage_costs(cost_model, tp=layout.tp, num_layers=model.num_layers, pp=stages, dp=layout.dp,
                          zero_stage=spec.zero_stage, layers=spec.stage_layers, hidden_size=model.hidden_size,
                          num_heads=model.num_attention_heads, ffn_hidden_size=model.ffn_hidden_size,
                          vocab_size=model.vocab_size)

