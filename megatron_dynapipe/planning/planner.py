"""The planner: a global batch's samples split over the data-parallel ranks, each rank's
micro-batchings, and each rank's schedule search (:mod:`.schedule_search`).

`generate_execution_plan` is the entry point; `optimize_schedule`, `build_candidates` and
`adjust_rc_plan` are the steps it is made of, exposed for users who drive them directly.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from megatron_dynapipe.planning.baselines import ThdRows, default_pack_length, dp_balanced_rows, thd_packing_rows
from megatron_dynapipe.planning.collector import cyclic_gc_paused
from megatron_dynapipe.planning.cost_model import CostModel, StageCosts, as_stage_costs, split_over_cp
from megatron_dynapipe.planning.documents import Pieces, cut_documents
from megatron_dynapipe.planning.fast_mode import NORMAL, FastMode, SearchBudget
from megatron_dynapipe.planning.methods import METHODS
from megatron_dynapipe.planning.microbatching import (
    MicroBatchingError,
    PaddedRows,
    cheapest_recompute,
    lightest_fitting_alone,
    pack_fixed_length,
    packed_microbatch,
    partition_dp,
    partition_token_based,
    partition_uniform,
    round_up,
    split_across_dp,
)
from megatron_dynapipe.planning.plan import ExecutionPlan
from megatron_dynapipe.planning.recompute import adjust_rc_plan
from megatron_dynapipe.planning.samples import check_lengths
from megatron_dynapipe.planning.schedule_search import (
    Candidate,
    Microbatching,
    PlanningError,
    ScheduleChoice,
    build_candidates,
    execution_plans,
    optimize_schedule,
    predicted_iteration_ms,
    predicted_iterations_ms,
)
from megatron_dynapipe.planning.schedules import megatron_orders, megatron_schedule
from megatron_dynapipe.planning.simulator import simulate, stage_work
from megatron_dynapipe.planning.spec import TrainingSpec, packed_sample_multiple
from megatron_dynapipe.planning.types import MicroBatch, RecomputeType

__all__ = ["PlanResult", "PlanningError", "generate_execution_plan", "megatron_packings", "megatron_row_length",
           "rank_costs", "stage_costs", "adjust_rc_plan", "build_candidates", "optimize_schedule"]

@dataclass
class PlanResult:
    """Execution plans of one global batch: plans[dp_rank][stage]."""

    plans: list[list[ExecutionPlan]]
    choices: list[ScheduleChoice]
    budget: SearchBudget  # fast mode or not, and where that was decided
    planning_seconds: float
    costs: StageCosts = field(repr=False)
    # where planning_seconds went: "micro-batching" (DP split and partitions), "scheduling"
    # (candidates, simulation, recompute adjustment), "lowering" (instruction lists)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    #: under ``TrainingSpec.documents == "cut"``, what the plans' samples are: the plans index
    #: these pieces of the batch's samples; None where samples are planned whole
    pieces: Pieces | None = None

    @property
    def fast_mode(self) -> bool:
        return self.budget.fast

    @property
    def makespan_ms(self) -> float:
        """Predicted iteration time: the slowest data-parallel rank."""
        return max(c.makespan_ms for c in self.choices)

    @property
    def peak_memory_mb(self) -> np.ndarray:
        return np.max([c.simulation.peak_memory for c in self.choices], axis=0)


@dataclass(frozen=True)
class _Batch:
    """What every data-parallel rank's search of one global batch shares: the batch's (padded or
    rounded) lengths, ``costs`` per virtual stage (what is scheduled), ``sizing`` per rank (what
    micro-batches are sized for: :func:`rank_costs`), ``rows`` the padded cost-table rows of
    ``sizing`` (:class:`PaddedRows`), the spec, the search budget and the phase clock."""

    lengths: np.ndarray
    costs: StageCosts
    sizing: StageCosts
    rows: "PaddedRows"
    spec: TrainingSpec
    budget: SearchBudget
    clock: "PhaseClock"

    def sized_for_the_warmup(self) -> "_Batch":
        """Micro-batches sized for an interleaved pipeline's warm-up, in normal mode."""
        warmup = dataclasses.replace(self.sizing, warmup_chunks=self.spec.chunks)
        return dataclasses.replace(self, sizing=warmup, rows=PaddedRows(warmup, self.spec.memory_limit_mb),
                                   budget=NORMAL)


def generate_execution_plan(
    lengths: Sequence[int],
    spec: TrainingSpec,
    cost_model: CostModel | StageCosts | str | None = None,
    fast_mode: FastMode = None,
) -> PlanResult:
    """Plan one global batch of samples with the given token lengths.

    fast_mode: True/False/"auto"; None takes `spec.fast_mode`, then `DYNAPIPE_FAST_MODE`.
    """
    if not isinstance(spec, TrainingSpec):
        raise PlanningError(f"spec is a {type(spec).__name__}, not a TrainingSpec: pass TrainingSpec(...) (from a dict: "
                            "TrainingSpec(**settings))")
    with cyclic_gc_paused():  # planning makes tens of thousands of objects in no cycle
        return _plan(lengths, spec, cost_model, fast_mode)


def _plan(lengths, spec: TrainingSpec, cost_model, fast_mode: FastMode) -> PlanResult:
    started = time.perf_counter()
    lengths = np.array(_check_lengths(lengths), dtype=np.int64)  # one array: every DP rank indexes it
    pieces = _cut(lengths, spec)
    if pieces is not None:
        lengths = pieces.length
    budget = SearchBudget.of(fast_mode, spec.fast_mode, len(lengths))
    costs = stage_costs(cost_model, spec)
    if spec.packed:
        costs = costs.packed()
        lengths = round_up(lengths, packed_sample_multiple(spec.cp))
    sizing = rank_costs(costs, spec)
    _check_memory(sizing, spec.memory_limit_mb)
    clock = PhaseClock()
    rows = PaddedRows(sizing, spec.memory_limit_mb)  # every rank's partitions share them
    with clock("micro-batching"):
        per_rank = split_across_dp(lengths, spec.dp, sizing, spec.seqlen_round)
        if not spec.packed:  # packed partitions cost their own runs
            for samples in per_rank:
                rows.foresee(lengths[samples], spec.seqlen_round, budget.trims_cost_tables)
    try:
        choices, failed = _schedule_ranks(_Batch(lengths, costs, sizing, rows, spec, budget, clock), per_rank), None
    except PlanningError as error:
        choices, failed = None, error
    if spec.packed:
        with clock("scheduling"):
            choices = _no_slower_than_megatron(choices, lengths, costs, spec, pieces)
    if choices is None:
        raise failed
    with clock("lowering"):
        plans = [execution_plans(choice) for choice in choices]
    return PlanResult(plans, choices, budget, time.perf_counter() - started, costs, clock.seconds, pieces)


def _cut(lengths: np.ndarray, spec: TrainingSpec) -> "Pieces | None":
    """The samples cut as Megatron's data path cuts them, where the spec says so (packed pieces
    padded as a context-parallel row needs them: :func:`~.documents.cut_documents`)."""
    if spec.documents != "cut":
        return None
    return cut_documents(lengths, spec.seq_length, packed_sample_multiple(spec.cp) if spec.packed else 1)


def _schedule_ranks(batch: _Batch, per_rank) -> "list[ScheduleChoice]":
    """Every data-parallel rank's best schedule of its samples, slowest first."""
    firsts = _first_tries(batch, per_rank)
    choices: list["ScheduleChoice | None"] = [None] * len(per_rank)
    for r in _slowest_first(firsts, batch.sizing, batch.spec.chunks):
        # A step lasts as long as its slowest DP rank: once a rank has a plan no longer than one
        # planned before it, fast mode looks no further for that rank (the step stays the same).
        slowest = (max((c.makespan_ms for c in choices if c), default=None)
                   if batch.budget.enough_at_the_slowest_rank else None)
        choices[r] = _schedule_rank(batch, per_rank[r], slowest, firsts[r])
    return choices


def megatron_packings(lengths: np.ndarray, costs: StageCosts, spec: TrainingSpec,
                      pieces: "Pieces | None" = None) -> dict[str, ThdRows]:
    """Megatron-LM's own packings of these (packed, so already padded) samples that fit, by label,
    each on Megatron's schedule with one recompute: THD rows of whole samples (first-fit
    decreasing into rows of ``spec.seq_length``, k a micro-batch), ``dp_balanced``'s packs
    (:func:`~.baselines.dp_balanced_rows`) and, where the samples are the ``pieces`` of Megatron's
    cut (``spec.documents``), its windows in stream order (THD packing as Megatron-LM's data path
    feeds it). ``costs`` per virtual stage."""
    seq_length = megatron_row_length(lengths, spec)
    found = {}
    try:
        found[METHODS["dp_balanced"].label] = dp_balanced_rows(
            lengths, seq_length, costs, spec.memory_limit_mb, spec.chunks, spec.seqlen_round, spec.recompute_types)
    except ValueError:
        pass  # too few samples to deal out: no such plan to hold as a candidate
    if lengths.max() <= seq_length:
        found[METHODS["thd-whole"].label] = thd_packing_rows(
            pack_fixed_length(lengths.tolist(), seq_length), lengths, seq_length, costs, spec.memory_limit_mb,
            spec.chunks, spec.recompute_types)
    if pieces is not None:
        found[METHODS["thd"].label] = thd_packing_rows(pieces.windows(), lengths, seq_length, costs,
                                                       spec.memory_limit_mb, spec.chunks, spec.recompute_types)
    return {name: rows for name, rows in found.items() if rows is not None}


def _no_slower_than_megatron(choices: "list[ScheduleChoice] | None", lengths, costs: StageCosts,
                             spec: TrainingSpec, pieces: "Pieces | None") -> "list[ScheduleChoice] | None":
    """The planned ranks, or Megatron's own packing of the whole batch where it ends sooner or
    the search found nothing (:func:`megatron_packings`): those plans are candidates too, so a
    packed plan is never predicted slower than them on the same cost model, nor refused where one
    of them fits."""
    best, best_ms = choices, math.inf if choices is None else max(c.makespan_ms for c in choices)
    for name, found in megatron_packings(lengths, costs, spec, pieces).items():
        if found.makespan_ms < best_ms:
            ranks = [_uniform_choice(rows, found.recompute, costs, spec.chunks, name) for rows in found.per_rank]
            if max(c.makespan_ms for c in ranks) < best_ms:  # simulated whole, not extrapolated
                best, best_ms = ranks, max(c.makespan_ms for c in ranks)
    return best


def _uniform_choice(rows: Sequence[MicroBatch], recompute: RecomputeType, costs: StageCosts, chunks: int,
                    label: str) -> "ScheduleChoice":
    """One rank's rows on Megatron's schedule under one recompute, as a choice of the search."""
    n, schedule = len(rows), megatron_schedule(chunks)
    orders = megatron_orders(costs.pp // chunks, n, chunks)
    table = np.full((costs.pp, n), int(recompute))
    candidate = Candidate(schedule, label, tuple(range(n)), tuple(rows), (recompute,) * n)
    return ScheduleChoice(candidate, table, orders, simulate(orders, stage_work(costs, rows, table, chunks)), 1)


def _first_tries(batch: _Batch, per_rank) -> "list[list[Microbatching] | None]":
    """Per rank, fast mode's first try where it has one: its mixed micro-batching alone (a packed
    plan's full rows too: :func:`megatron_rows`), which often
    has a plan that ends by the slowest rank's, and the others are then never made (partitioning a
    rank's samples costs about what scheduling them does). Made for every rank before any is
    scheduled; None where there is none or it fails (the rank's whole search then says why)."""
    spec = batch.spec
    if not (batch.budget.first_tries and spec.partition == "dp" and len(spec.recompute_types) > 1):
        return [None] * len(per_rank)
    firsts = []
    with batch.clock("micro-batching"):
        for samples in per_rank:
            try:
                firsts.append(_microbatchings(batch.lengths, samples, batch.sizing, spec, batch.budget, True,
                                              batch.rows))
            except PlanningError:
                firsts.append(None)
    return firsts


def _slowest_first(firsts, sizing: StageCosts, chunks: int) -> list[int]:
    """The order to plan ranks in: by their first tries' predicted iteration times, slowest first,
    so that fast mode sets the step's length with the first rank planned and stops the others'
    searches at the first plan within it. Ranks without a first try come first, in rank order."""
    predicted = [math.inf if first is None else predicted_iteration_ms(sizing, first[0], chunks) for first in firsts]
    return sorted(range(len(firsts)), key=lambda r: -predicted[r])


def _schedule_rank(batch: _Batch, samples, enough_ms: "float | None" = None,
                   first: "list[Microbatching] | None" = None) -> "ScheduleChoice":
    """One data-parallel rank's best schedule (in fast mode, the first found no longer than
    ``enough_ms``, trying ``first`` first where given). Where fast mode's trimmed search finds
    none that fits, normal mode's search runs: fast mode never refuses a batch normal mode can plan.
    Where no interleaved schedule of micro-batches sized for 1F1B's steady state fits, they are
    sized again for the interleaved warm-up, which holds more of them (smaller ones: slower where
    the first fits, so tried only then)."""
    try:
        return _search(batch, samples, enough_ms, first)
    except PlanningError as error:
        failed = error  # what the usual sizing runs into says most
    if batch.budget.fast:
        try:
            return _search(dataclasses.replace(batch, budget=NORMAL), samples)
        except PlanningError as error:
            failed = error
    if batch.spec.chunks > 1:
        try:
            return _search(batch.sized_for_the_warmup(), samples)
        except PlanningError:
            pass
    raise failed


def _search(batch: _Batch, samples, enough_ms: "float | None" = None,
            first: "list[Microbatching] | None" = None) -> "ScheduleChoice":
    """One rank's search of its ``samples``; ``first`` the micro-batchings to try alone before
    the rest (:func:`_first_tries`)."""
    spec = batch.spec

    def search(microbatchings: list[Microbatching]) -> ScheduleChoice:
        with batch.clock("scheduling"):
            return optimize_schedule(microbatchings, batch.costs, spec.memory_limit_mb, budget=batch.budget,
                                     schedules=spec.schedules, seed=spec.seed, max_permutations=spec.max_permutations,
                                     recompute_types=spec.recompute_types, enough_ms=enough_ms, chunks=spec.chunks)

    if enough_ms is not None and first is not None:
        try:
            choice = search(first)
            if choice.makespan_ms <= enough_ms:
                return choice
        except PlanningError:
            pass  # the whole search below says why, if it fails too
    with batch.clock("micro-batching"):
        microbatchings = _microbatchings(batch.lengths, samples, batch.sizing, spec, batch.budget, rows=batch.rows)
    return search(microbatchings)


class PhaseClock:
    """Seconds spent per named phase, summed over every ``with clock(name):`` block."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    """The lengths as ``plan --lengths`` takes them (:func:`~.samples.check_lengths`)."""
    try:
        return check_lengths(lengths)
    except ValueError as error:
        raise PlanningError(str(error)) from None


def pipeline_costs(cost_model, spec: TrainingSpec) -> StageCosts:
    """``cost_model`` (anything :func:`~.cost_model.as_stage_costs` takes) for ``spec``'s
    pipeline, one stage per virtual stage (``spec.pp * spec.chunks``), its model as given (a model
    of one rank of CP 1 stays one)."""
    stages = spec.pp * spec.chunks
    costs = as_stage_costs(cost_model, tp=spec.tp, num_layers=spec.num_layers, pp=stages, dp=spec.dp,
                           zero_stage=spec.zero_stage, layers=spec.stage_layers)
    if costs.pp != stages:
        raise PlanningError(f"the stage costs given price {costs.pp} pipeline stages, the spec has {spec.pp} x "
                            f"{spec.chunks} virtual stages: give a cost model, or StageCosts of pp={stages}")
    return costs


def stage_costs(cost_model, spec: TrainingSpec) -> StageCosts:
    """:func:`pipeline_costs` on one rank of ``spec``'s context-parallel group."""
    costs = pipeline_costs(cost_model, spec)
    if costs.model.cp != spec.cp:
        try:
            costs = dataclasses.replace(costs, model=split_over_cp(costs.model, spec.cp))
        except ValueError as error:
            raise PlanningError(f"cannot price CP {spec.cp} with the cost model given: {error}") from None
    return costs


def rank_costs(costs: StageCosts, spec: TrainingSpec) -> StageCosts:
    """The pipeline's ranks as its stages, each holding all its chunks' layers and model state:
    what micro-batches are sized for, as for 1F1B on the same ranks. An interleaved rank warms
    up with more chunk-forwards than 1F1B holds micro-batches; recompute adjustment raises
    recompute where the simulated schedule holds more than the limit, and where it cannot,
    :func:`_schedule_rank` sizes them for the warm-up."""
    if spec.chunks == 1:
        return costs
    layers = costs.layers and tuple(sum(costs.layers[s::spec.pp]) for s in range(spec.pp))
    return dataclasses.replace(costs, pp=spec.pp, layers=layers)


def _check_memory(costs: StageCosts, memory_limit_mb: float) -> None:
    state = max(costs.model_state_mb(s) for s in range(costs.pp))
    if state >= memory_limit_mb:
        raise PlanningError(
            f"the model state alone needs {state:.1f} MB per GPU, above the {memory_limit_mb:.1f} MB "
            f"limit: raise the memory limit, add pipeline/tensor parallelism or a higher ZeRO stage"
        )


def _microbatchings(lengths, samples, costs, spec, budget: SearchBudget, first_try: bool = False,
                    rows: "PaddedRows | None" = None) -> list[Microbatching]:
    """Micro-batchings to schedule, best predicted first: a partition per uniform recompute type
    and a "mixed" one where each micro-batch takes the cheapest recompute that fits (fast mode:
    from fewer partition thresholds; packed, the mixed one and the heaviest uniform one alone:
    :meth:`~.fast_mode.SearchBudget.every_partition`).

    A partition sizes each micro-batch to fit with PP copies of itself in flight, as 1F1B's first
    stage holds them; later stages, and wait-free-cyclic, mostly hold fewer. So each partition is
    also offered starting from the lightest recompute under which each micro-batch fits alone
    ("<label>, light start"; fast mode offers only that), which recompute adjustment raises only
    where the simulated schedule runs over the limit. Both are ranked by the partition's predicted
    iteration time, the light start first: its own prediction ignores what will be raised.
    A packed plan's search also holds the rank's samples in Megatron's full rows (:func:`megatron_rows`)
    and in rows balanced by cost (:func:`balanced_rows`).
    ``first_try``: the mixed one (and those rows) alone. ``rows``: padded cost-table rows shared with
    other ranks."""
    limit = spec.memory_limit_mb
    if spec.partition in ("token_based", "uniform"):
        mbs = (partition_token_based(lengths, samples, spec.tokens_per_microbatch, spec.seqlen_round)
               if spec.partition == "token_based"
               else partition_uniform(lengths, samples, spec.microbatch_size, spec.seqlen_round))
        return [Microbatching(spec.partition, tuple(mbs),
                              tuple(cheapest_recompute(costs, mbs, spec.recompute_types, limit)))]
    options = [(rc.label, (rc,)) for rc in spec.recompute_types]
    if len(spec.recompute_types) > 1:
        # fast mode (packed): the mixed one and the heaviest uniform one (the largest micro-batches)
        options = [("mixed", spec.recompute_types)] + ([] if first_try else options
                                                        if budget.every_partition(spec.packed) else options[-1:])
    found, errors = [], []  # (prediction of the partition, light start first, micro-batching)
    # An interleaved pipeline's smaller fill favours larger micro-batches, but its warm-up holds
    # more of them than the 1F1B steady state they are sized to fit: they are also offered sized
    # as for 1F1B, whichever then fits or runs faster; fast mode's packed plans are sized as for
    # 1F1B alone (those of the smaller fill can cost rounds of recompute adjustment that end in
    # nothing). fills: (the V the objective divides the fill by, the label's suffix)
    fills = ([(spec.chunks, ""), (1, ", 1F1B's fill")] if spec.chunks > 1 and budget.every_partition(spec.packed)
             else [(1, "")])
    for (label, types), (fill, named) in itertools.product(options, fills):
        try:
            mbs, recompute = partition_dp(
                lengths, samples, costs, limit, types, spec.seqlen_round,
                budget.dp_thresholds, fast=budget.trims_cost_tables,
                packed=spec.packed, chunks=fill, rows=rows)
        except MicroBatchingError as error:
            errors.append(error)
            continue
        partition = Microbatching(label + named, tuple(mbs), tuple(recompute))
        if named and any(other.label == label and other.microbatches == partition.microbatches
                         for *_, other in found):
            continue  # sized alike either way (normal mode: the first sizing is always among those found)
        rank = predicted_iteration_ms(costs, partition, spec.chunks)
        light = tuple(lightest_fitting_alone(costs, mbs, spec.recompute_types, limit))
        if light != partition.recompute:
            found.append((rank, 0, Microbatching(f"{partition.label}, light start", partition.microbatches, light)))
        if light == partition.recompute or budget.every_microbatching:
            found.append((rank, 1, partition))
    if spec.packed:
        full = megatron_rows(lengths, samples, spec)
        megatrons = [("rows of seq-length", full)] if full is not None else []
        for label, mbs in megatrons + balanced_rows(lengths, samples, costs, spec):
            light = Microbatching(label, mbs, tuple(lightest_fitting_alone(costs, mbs, spec.recompute_types, limit)))
            found.append((predicted_iteration_ms(costs, light, spec.chunks), 0, light))
    if not found:
        raise PlanningError(str(errors[-1]))
    return [m for _, _, m in sorted(found, key=lambda f: f[:2])]


def megatron_rows(lengths, samples, spec: TrainingSpec) -> "tuple[MicroBatch, ...] | None":
    """A rank's samples as Megatron packs them, whole: first-fit decreasing into THD rows of at
    most :func:`megatron_row_length` tokens (each row one micro-batch, rounded to ``seqlen_round``),
    as a micro-batching of the search: with the planner's split over data-parallel ranks, by cost,
    Megatron's full rows often beat the planner's own cuts. None where a sample is longer."""
    mine = np.asarray(lengths)[samples]
    seq_length = megatron_row_length(lengths, spec)
    if mine.max() > seq_length:
        return None
    order = np.asarray(samples)
    return tuple(packed_microbatch(order[row], mine[row], spec.seqlen_round)
                 for row in pack_fixed_length(mine.tolist(), seq_length))


#: cost-balanced packings offered a rank: the best by the micro-batching objective, of up to
#: MOST_BALANCED_PER_STAGE rows a virtual stage
BALANCED_OFFERED = 2
MOST_BALANCED_PER_STAGE = 4


def balanced_rows(lengths, samples, costs: StageCosts,
                  spec: TrainingSpec) -> "list[tuple[str, tuple[MicroBatch, ...]]]":
    """A rank's samples dealt into ``k`` packed rows, longest first in snake order (rows 0 to
    k - 1, then k - 1 to 0, ...), so that each row takes its share of the long samples and of the
    short: the :data:`BALANCED_OFFERED` values of ``k`` (up to :data:`MOST_BALANCED_PER_STAGE`
    rows a virtual stage) that the micro-batching objective prices best. A packed row holds any
    mix of samples, but the dynamic programme cuts runs of the length-sorted samples, so its rows
    put the longest samples together, and one row of them sets the largest micro-batch and with it
    the pipeline's fill."""
    lengths = np.asarray(lengths)
    order = np.asarray(samples)[np.argsort(-lengths[samples], kind="stable")]
    dealings = []
    for k in range(1, min(len(order), MOST_BALANCED_PER_STAGE * spec.pp * spec.chunks) + 1):
        place = np.arange(len(order)) % (2 * k)
        slot = np.where(place < k, place, 2 * k - 1 - place)  # the row each sample is dealt to
        dealt = np.split(order[np.argsort(slot, kind="stable")], np.cumsum(np.bincount(slot, minlength=k))[:-1])
        mbs = tuple(packed_microbatch(row, lengths[row], spec.seqlen_round) for row in dealt)
        dealings.append(Microbatching(f"{k} rows balanced by cost", mbs, (spec.recompute_types[0],) * k))
    priced = predicted_iterations_ms(costs, dealings, spec.chunks)
    best = sorted(range(len(dealings)), key=lambda i: (priced[i], i))[:BALANCED_OFFERED]
    return [(dealings[i].label, dealings[i].microbatches) for i in best]


def megatron_row_length(lengths, spec: TrainingSpec) -> int:
    """The row Megatron's packings fill: ``spec.seq_length``, else the global batch's longest
    sample rounded up to a power of two (as the ``plan`` yardstick packs)."""
    return spec.seq_length or default_pack_length(lengths)
