"""Yardsticks for a plan: Megatron-style packing + 1F1B (leaky, or THD for packed plans), a lower
bound, the ideal gain."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from megatron_dynapipe.planning.cost_model import StageCosts
from megatron_dynapipe.planning.documents import cut_documents
from megatron_dynapipe.planning.methods import yardstick
from megatron_dynapipe.planning.microbatching import pack_fixed_length, packed_microbatch, round_up
from megatron_dynapipe.planning.plan import ExecutionPlan, build_execution_plans
from megatron_dynapipe.planning.schedules import megatron_orders, megatron_schedule
from megatron_dynapipe.planning.simulator import simulate, stage_work
from megatron_dynapipe.planning.spec import packed_sample_multiple, seqlen_round_for
from megatron_dynapipe.planning.types import MicroBatch, RecomputeType, cost_shapes

PACKING_MICROBATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class PackingBaseline:
    seq_len: int
    microbatch_size: int
    recompute: RecomputeType
    num_sequences: int
    makespan_ms: float
    packing: str = "pad"  # the packing of the plan it is the yardstick of (TrainingSpec.packing)
    chunks: int = 1  # model chunks a rank: Megatron's interleaved 1F1B where more than one
    stage_peak_mb: tuple = ()  # each stage's peak memory by the cost model (the busiest data-parallel rank's)

    @property
    def schedule(self) -> str:
        """Megatron's schedule it ran."""
        return "interleaved-1f1b" if self.chunks > 1 else "1f1b"

    @property
    def method(self) -> str:
        """The yardstick and Megatron's schedule it ran: "THD packing (whole) + interleaved-1f1b"."""
        return f"{yardstick(self.packing).label} + {self.schedule}"


class ThdRows(NamedTuple):
    """:func:`thd_packing_rows`' answer: per data-parallel rank its micro-batches, their uniform
    recompute, the slowest rank's time, each stage's peak memory (over the ranks) and each rank's
    time."""

    per_rank: list
    recompute: RecomputeType
    makespan_ms: float
    stage_peak_mb: tuple
    rank_makespan_ms: tuple


def plan_baseline(packing: str, lengths: Sequence[int], costs: StageCosts, memory_limit_mb: float,
                  seq_len: int | None = None, chunks: int = 1, ranks: StageCosts | None = None
                  ) -> PackingBaseline | None:
    """The yardstick of a plan of this packing (``TrainingSpec.packing``): Megatron's packing, its
    samples attending to each other, for a padded plan; for a packed one, whose samples attend to
    themselves alone, Megatron's packed sequences without that leakage (THD). Both on Megatron's
    schedule for the plan's layout: 1F1B, interleaved over ``chunks`` model chunks a rank (``costs``
    then pricing the virtual stages, as the plan's do); given ``ranks`` too (the same ranks priced
    as whole stages), the faster of that and plain 1F1B on them that fits, as a user whose
    interleaved pipeline is slower or runs out of memory drops the chunks."""
    baseline = thd_packing_baseline if packing == "varlen" else packing_baseline
    found = [baseline(lengths, costs, memory_limit_mb, seq_len, chunks)]
    if chunks > 1 and ranks is not None:
        found.append(baseline(lengths, ranks, memory_limit_mb, seq_len))
    return min((b for b in found if b is not None), key=lambda b: b.makespan_ms, default=None)


def default_pack_length(lengths: Sequence[int]) -> int:
    """The longest sample rounded up to a power of two, as profiled tables are laid out."""
    return int(2 ** np.ceil(np.log2(max(16, max(lengths)))))


def packing_baseline(
    lengths: Sequence[int], costs: StageCosts, memory_limit_mb: float, seq_len: int | None = None, chunks: int = 1
) -> PackingBaseline | None:
    """Pack samples into sequences of `seq_len` tokens, split them evenly over data-parallel
    ranks, run 1F1B (interleaved over ``chunks``) with the micro-batch size and uniform recompute
    that give the fastest iteration within the memory limit. None when nothing fits."""
    seq_len = seq_len or default_pack_length(lengths)
    return fixed_length_baseline(len(pack_fixed_length(lengths, seq_len)), seq_len, costs, memory_limit_mb, chunks)


def fixed_length_baseline(
    num_sequences: int, seq_len: int, costs: StageCosts, memory_limit_mb: float, chunks: int = 1
) -> PackingBaseline | None:
    """Megatron's way with `num_sequences` sequences of `seq_len` tokens (packed samples, or
    samples padded to the longest): split evenly over data-parallel ranks, 1F1B (interleaved over
    ``chunks`` model chunks a rank, ``costs`` then pricing virtual stages), the micro-batch size
    and uniform recompute of the fastest simulated iteration within the memory limit."""
    per_rank = -(-num_sequences // costs.dp)  # the busiest rank sets the iteration time
    sizes = [mbs for mbs in PACKING_MICROBATCH_SIZES if mbs <= per_rank or mbs == 1]
    candidates = []  # (a bound its simulation cannot beat, the size's rank, recompute, size)
    for order, mbs in enumerate(sizes):
        distinct, counts = zip(*_fixed_shapes(per_rank, mbs, seq_len))
        for rc in RecomputeType:
            uniform = np.full((costs.pp, len(distinct)), int(rc))
            candidates.append((lower_bound_ms(costs, distinct, uniform, counts, chunks), order, rc, mbs))
    # The fastest (size, recompute) that fits wins; ties go to the smaller size, then the cheaper
    # recompute. Tried likeliest first, and none simulated whose bound cannot beat the best found:
    # a simulation of a large batch takes seconds.
    best, best_key = None, None
    for bound, order, rc, mbs in sorted(candidates, key=lambda c: c[:3]):
        if best_key is not None and (bound, order, rc) > best_key:
            continue
        result = fixed_shape_run(costs, per_rank, mbs, seq_len, rc, memory_limit_mb, chunks)
        if result is not None and (best_key is None or (result.makespan, order, rc) < best_key):
            best_key = (result.makespan, order, rc)
            best = PackingBaseline(seq_len, mbs, rc, num_sequences, result.makespan, "pad", chunks,
                                   tuple(map(float, result.peak_memory)))
    return best


def thd_packing_baseline(
    lengths: Sequence[int], costs: StageCosts, memory_limit_mb: float, seq_len: int | None = None, chunks: int = 1
) -> PackingBaseline | None:
    """:func:`thd_packing_rows` of the samples packed into sequences of ``seq_len`` tokens as
    :func:`packing_baseline` packs them, as a :class:`PackingBaseline` (its micro-batch size: the
    sequences in one row). None when nothing fits."""
    seq_len = seq_len or default_pack_length(lengths)
    sequences = pack_fixed_length(lengths, seq_len)
    found = thd_packing_rows(sequences, lengths, seq_len, costs, memory_limit_mb, chunks)
    if found is None:
        return None
    return PackingBaseline(seq_len, found.per_rank[0][0].seq_len // seq_len, found.recompute, len(sequences),
                           found.makespan_ms, "varlen", chunks, found.stage_peak_mb)


def thd_packing_rows(
    sequences: Sequence[Sequence[int]], lengths: Sequence[int], seq_len: int, costs: StageCosts, memory_limit_mb: float,
    chunks: int = 1, recompute_types: Sequence[RecomputeType] = tuple(RecomputeType)
) -> ThdRows | None:
    """Megatron's packed sequences without attention across samples (THD): ``sequences`` (sample
    indices packed into ``seq_len`` tokens each, as :func:`pack_fixed_length` packs them) dealt
    out in order to the data-parallel ranks as evenly as they go; each micro-batch is one row of
    k of them (a fixed budget of k x ``seq_len`` tokens), run 1F1B with the k and uniform
    recompute of the fastest simulated iteration within the memory limit (of ``recompute_types``:
    Megatron's ``--recompute-granularity`` leaves the heavier ones); None when nothing fits.
    ``chunks``: as for :func:`fixed_length_baseline`."""
    costs = costs.packed()  # once: uniform_rows_run then finds it packed
    shares = np.array_split(np.arange(len(sequences)), costs.dp)  # sizes differ by one at most
    best = None
    for k in PACKING_MICROBATCH_SIZES:
        if k > max(map(len, shares)) and k > 1:
            break
        per_rank = [[_thd_row([sequences[i] for i in mine[at:at + k]], lengths, seq_len)
                     for at in range(0, len(mine), k)] for mine in shares]
        found = uniform_rows_run(per_rank, costs, memory_limit_mb, chunks, recompute_types)
        if found is not None and (best is None or found.makespan_ms < best.makespan_ms):
            best = found
    return best


def uniform_rows_run(per_rank: Sequence[Sequence[MicroBatch]], costs: StageCosts, memory_limit_mb: float,
                     chunks: int = 1, recompute_types: Sequence[RecomputeType] = tuple(RecomputeType)
                     ) -> ThdRows | None:
    """Packed rows as Megatron runs them: each data-parallel rank's micro-batches (``per_rank``)
    on its schedule (1F1B, interleaved over ``chunks``), one recompute for all, the lightest of
    ``recompute_types`` under which every rank fits; None where none does."""
    costs = costs.packed()
    # every rank's rows priced in one evaluation, which each rank's simulations find remembered:
    # packed rows rarely share a shape, so rank by rank the cost model would run per handful
    costs.by_recompute(*cost_shapes([row for rows in per_rank for row in rows]), tuple(RecomputeType))
    for rc in sorted(recompute_types):  # cheapest first: the first that fits is the fastest
        results = [_simulate_uniform(list(rows), costs, rc, memory_limit_mb, chunks) for rows in per_rank]
        if all(r is not None for r in results):
            peaks = np.max([r.peak_memory for r in results], axis=0)
            return ThdRows([list(rows) for rows in per_rank], rc, max(r.makespan for r in results),
                           tuple(map(float, peaks)), tuple(float(r.makespan) for r in results))
    return None


def dp_balanced_packs(lengths: Sequence[int], capacity: int, dp: int, group: int = 1) -> list[list[int]]:
    """Megatron-LM's ``--sequence-packing-scheduler dp_balanced`` (``DpBalancedScheduler``): the
    global batch's samples in arrival order, next-fit into packs of at most ``capacity`` tokens
    (``--max-seqlen-per-dp-cp-rank`` x CP); then, while the count of packs is not a multiple of
    ``dp`` x ``group`` (the micro-batch group of an interleaved pipeline, Megatron's
    ``--microbatch-group-size-per-virtual-pipeline-stage``, by default PP), the last sample of
    the last pack that holds several moves to a pack of its own, at the end. Pack ``i x dp + r``
    is micro-batch ``i`` of data-parallel rank ``r``. A sample longer than ``capacity`` is a pack
    alone, as upstream's loop leaves it. ValueError where no pack but the first is left to split,
    as upstream asserts."""
    packs, room = [], 0
    for i, n in enumerate(lengths):
        if not packs or n > room:
            packs.append([])
            room = capacity
        packs[-1].append(i)
        room -= n
    multiple = dp * group
    at = len(packs) - 1
    for _ in range(-len(packs) % multiple):
        while at > 0 and len(packs[at]) == 1:
            at -= 1
        if at == 0:  # upstream never splits the first pack
            raise ValueError(f"dp_balanced: {len(lengths)} samples cannot make a multiple of {multiple} packs "
                             f"(DP {dp} x {group}): the global batch needs more samples")
        packs.append([packs[at].pop()])
    return packs


def dp_balanced_rows(lengths: Sequence[int], capacity: int, costs: StageCosts, memory_limit_mb: float,
                     chunks: int = 1, round_to: int = 1,
                     recompute_types: Sequence[RecomputeType] = tuple(RecomputeType)) -> ThdRows | None:
    """``dp_balanced`` (:func:`dp_balanced_packs`) as Megatron-LM runs it: each pack one THD row
    of its samples (each ``lengths`` already padded as the layout needs, the row to a multiple of
    ``round_to``), on Megatron's schedule with one recompute (:func:`uniform_rows_run`); the
    micro-batch group is PP where ranks hold several chunks. None where nothing fits; ValueError
    where the batch cannot be dealt out (:func:`dp_balanced_packs`)."""
    ranks = costs.pp // chunks
    packs = dp_balanced_packs(lengths, capacity, costs.dp, ranks if chunks > 1 else 1)
    rows = [packed_microbatch(pack, [lengths[i] for i in pack], round_to) for pack in packs]
    return uniform_rows_run([rows[r::costs.dp] for r in range(costs.dp)], costs, memory_limit_mb, chunks,
                            recompute_types)


def megatron_dp_balanced_rows(lengths: Sequence[int], seq_length: int, costs: StageCosts, memory_limit_mb: float,
                              chunks: int = 1, cp: int = 1,
                              recompute_types: Sequence[RecomputeType] = tuple(RecomputeType)) -> ThdRows | None:
    """``dp_balanced`` of a drawn batch as Megatron-LM's data path feeds it: each sample padded to
    whole chunks of a row split over ``cp`` ranks, packs of ``seq_length`` tokens
    (:func:`dp_balanced_rows`, rows rounded as a layout of that CP rounds them)."""
    padded = round_up(lengths, packed_sample_multiple(cp)).tolist()
    return dp_balanced_rows(padded, seq_length, costs, memory_limit_mb, chunks, seqlen_round_for(cp), recompute_types)


def megatron_windows(lengths: Sequence[int], seq_length: int, multiple: int = 1) -> tuple[list[int], list[list[int]]]:
    """The samples cut into Megatron's windows of ``seq_length`` tokens, each piece then padded to
    a ``multiple`` (:func:`~.documents.cut_documents`): (the pieces' lengths, each window's piece
    indices)."""
    if seq_length % multiple:
        raise ValueError(f"--seq-length {seq_length} is not a multiple of {multiple} (2 x the context-parallel size), "
                         "as Megatron-LM requires")
    pieces = cut_documents(lengths, seq_length, multiple)
    return pieces.length.tolist(), pieces.windows()


def megatron_thd_rows(lengths: Sequence[int], seq_length: int, costs: StageCosts, memory_limit_mb: float,
                      chunks: int = 1, cp: int = 1,
                      recompute_types: Sequence[RecomputeType] = tuple(RecomputeType)) -> ThdRows | None:
    """THD packing of a batch as Megatron-LM's data path feeds it: the samples cut into its
    windows (:func:`megatron_windows`, each sample padded to whole chunks of a row split over
    ``cp`` ranks), in rows of k windows (:func:`thd_packing_rows`)."""
    pieces, windows = megatron_windows(lengths, seq_length, packed_sample_multiple(cp))
    return thd_packing_rows(windows, pieces, seq_length, costs, memory_limit_mb, chunks, recompute_types)


def megatron_plans(microbatches: Sequence[MicroBatch], recompute: str, pp: int, chunks: int = 1) -> list[ExecutionPlan]:
    """Per stage, the plan of Megatron's own schedule over ``microbatches`` with one recompute
    throughout: 1F1B, or its interleaved 1F1B over ``chunks`` model chunks a rank."""
    return build_execution_plans(megatron_orders(pp, len(microbatches), chunks), list(microbatches), recompute,
                                 megatron_schedule(chunks), chunks=chunks)


def _thd_row(sequences: Sequence[Sequence[int]], lengths: Sequence[int], seq_len: int) -> MicroBatch:
    """One row of these packed sequences: their samples back to back, then all their padding (a
    window whose pieces were padded for context parallelism holds a little more than ``seq_len``)."""
    samples = tuple(int(i) for sequence in sequences for i in sequence)
    packed = tuple(int(lengths[i]) for i in samples)
    return MicroBatch(samples, max(len(sequences) * seq_len, sum(packed)), packed)


def fixed_shape_run(costs: StageCosts, num_sequences: int, microbatch_size: int, seq_len: int,
                    recompute: RecomputeType, memory_limit_mb: float = math.inf, chunks: int = 1) -> "UniformRun | None":
    """Megatron's step at one setting: ``num_sequences`` sequences of ``seq_len`` tokens on the
    busiest data-parallel rank, ``microbatch_size`` a micro-batch, 1F1B (interleaved over
    ``chunks``), ``recompute`` throughout."""
    shapes = _fixed_shapes(num_sequences, microbatch_size, seq_len)
    if not shapes:
        return _simulate_whole([], costs, recompute, memory_limit_mb, chunks)
    (first, count), tail = shapes[0], [mb for mb, _ in shapes[1:]]
    return _simulate_copies(first, count, tail, costs, recompute, memory_limit_mb, chunks)


def _fixed_shapes(num_sequences: int, microbatch_size: int, seq_len: int) -> list[tuple[MicroBatch, int]]:
    """Those micro-batches as (micro-batch, how many in a row): the full ones, then any smaller
    last one (:func:`uniform_microbatches` without making each)."""
    full, rest = divmod(num_sequences, microbatch_size)
    return [(MicroBatch(tuple(range(size)), seq_len), count)
            for size, count in ((microbatch_size, full), (rest, 1)) if size and count]


def uniform_microbatches(num_sequences: int, microbatch_size: int, seq_len: int) -> list[MicroBatch]:
    """Sequences 0..n-1 in order, `microbatch_size` at a time (the last micro-batch may be smaller)."""
    return [MicroBatch(tuple(range(i, min(i + microbatch_size, num_sequences))), seq_len)
            for i in range(0, num_sequences, microbatch_size)]


class UniformRun(NamedTuple):
    """What a baseline needs of a simulated 1F1B run: its makespan and each stage's peak memory."""

    makespan: float
    peak_memory: np.ndarray


#: a run of identical micro-batches longer than this many times PP, plus a few, is simulated that
#: long and extended by its steady-state period (:func:`_simulate_copies`)
STEADY_AFTER_STAGES = 4


def _simulate_uniform(microbatches, costs, rc, memory_limit_mb, chunks: int = 1) -> UniformRun | None:
    """Megatron's schedule over ``microbatches`` under uniform recompute ``rc``; None where a
    micro-batch cannot run or the run does not fit. A run of one shape (but perhaps its last) is
    :func:`_simulate_copies`'s."""
    tail = [mb for mb in microbatches[-1:] if mb.cost_shape != microbatches[0].cost_shape]
    body = len(microbatches) - len(tail)
    if body and all(mb.cost_shape == microbatches[0].cost_shape for mb in microbatches[1:body]):
        return _simulate_copies(microbatches[0], body, tail, costs, rc, memory_limit_mb, chunks)
    return _simulate_whole(microbatches, costs, rc, memory_limit_mb, chunks)


def _simulate_copies(first: MicroBatch, count: int, tail: list, costs, rc, memory_limit_mb,
                     chunks: int = 1) -> UniformRun | None:
    """Megatron's schedule over ``count`` micro-batches of ``first``'s shape, then ``tail``.

    A long run of one micro-batch shape (a packing baseline's: a few dozen stages, tens of
    thousands of micro-batches) is periodic once its pipeline has filled: each more micro-batch
    adds the same period, and the drain and every stage's peak stay as they are. So such a run is
    simulated with ``k``, ``k + 1`` and ``k + 2`` micro-batches of that shape (then the tail), and,
    where both increments agree, extended by the period to its length; otherwise, and for short
    runs, simulated whole. So are interleaved runs: their micro-batch groups, and so their table,
    change with the count."""
    k = STEADY_AFTER_STAGES * costs.pp + 4
    if count > k + 2 and chunks == 1:
        runs = [_simulate_whole([first] * j + tail, costs, rc, memory_limit_mb) for j in (k, k + 1, k + 2)]
        if None in runs:
            return None
        first_step, second_step = runs[1].makespan - runs[0].makespan, runs[2].makespan - runs[1].makespan
        if math.isclose(first_step, second_step, rel_tol=1e-9, abs_tol=1e-9) and np.array_equal(
                runs[1].peak_memory, runs[2].peak_memory):
            return UniformRun(runs[2].makespan + (count - k - 2) * second_step, runs[2].peak_memory)
    return _simulate_whole([first] * count + tail, costs, rc, memory_limit_mb, chunks)


def _simulate_whole(microbatches, costs, rc, memory_limit_mb, chunks: int = 1) -> UniformRun | None:
    work = stage_work(costs, microbatches, np.full((costs.pp, len(microbatches)), int(rc)), chunks)
    if not np.all(np.isfinite(work.forward + work.backward + work.stored + work.peak)):
        return None
    result = simulate(megatron_orders(work.pp, work.n, chunks), work)
    return UniformRun(result.makespan, result.peak_memory) if result.fits(memory_limit_mb) else None


def lower_bound_ms(costs: StageCosts, microbatches: Sequence[MicroBatch], recompute: np.ndarray,
                   counts: "Sequence[int] | None" = None, chunks: int = 1) -> float:
    """No schedule of these micro-batches, in any order, is faster: for each stage, its total
    work plus the cheapest forward pass through the stages before it (fill) and the cheapest
    backward pass back through them (drain); nor than any one micro-batch's round trip, forward
    through every stage and back (what sets the pace where few micro-batches fill many stages).
    ``counts``: how many times each micro-batch runs (default once), for long uniform runs.
    ``chunks``: model chunks a rank (``costs`` then prices ``pp * chunks`` virtual stages): a rank
    runs all its chunks' work on one stream, after the fill to its first virtual stage and before
    the drain back from it."""
    work = stage_work(costs, microbatches, recompute)
    fill = np.concatenate([[0.0], np.cumsum(work.forward, axis=0)[:-1].min(axis=1)])
    drain = np.concatenate([[0.0], np.cumsum(work.backward, axis=0)[:-1].min(axis=1)])
    busy = (work.forward + work.backward) @ (np.ones(work.n) if counts is None else np.asarray(counts, dtype=float))
    ranks = costs.pp // chunks
    rank_busy = busy.reshape(chunks, ranks).sum(axis=0)  # virtual stage c * ranks + r is on rank r
    round_trip = (work.forward + work.backward).sum(axis=0) + 2 * (costs.pp - 1) * work.comm
    return float(max(np.max(busy + fill + drain), np.max(rank_busy + fill[:ranks] + drain[:ranks]),
                     np.max(round_trip, initial=0.0)))


def ideal_gain(lengths: Sequence[int], costs: StageCosts, seq_len: int, round_to: int = 8) -> float:
    """Compute-only speed-up of exact-length micro-batches over packing to `seq_len`:
    sum(tokens) x per-token cost at seq_len / sum(padded length x per-token cost at that length),
    each per-token cost taken at its best micro-batch size."""
    padded = round_up(np.asarray(lengths), round_to)
    packed = float(np.sum(lengths)) * _per_token_ms(costs, seq_len)
    exact = sum(count * n * _per_token_ms(costs, n)
                for n, count in zip(*np.unique(padded, return_counts=True)))
    return packed / exact


def _per_token_ms(costs: StageCosts, seq_len: int) -> float:
    mbs = np.arange(1, 2049)
    time = costs.model.layer_ms("encoder", "forward", RecomputeType.NONE, mbs, seq_len) + \
        costs.model.layer_ms("encoder", "backward", RecomputeType.NONE, mbs, seq_len)
    return float(np.min(time / (mbs * seq_len)))
