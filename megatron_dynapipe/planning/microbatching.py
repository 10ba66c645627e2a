"""Cutting a global batch into micro-batches.

`split_across_dp` balances samples over data-parallel ranks by predicted cost; each rank's
samples are then cut into consecutive runs of the length-sorted order, either by dynamic
programming that minimises the predicted pipeline iteration time (`partition_dp`) or by the
simple `token_based` / `uniform` rules. `pack_fixed_length` is the Megatron-style baseline:
concatenate samples into sequences of one fixed length.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from megatron_dynapipe.planning.cost_model import StageCosts
from megatron_dynapipe.planning.types import (MicroBatch, RecomputeType, cost_shapes, extra_segments,
                                              packed_cost_shape, packed_extra_segments)

DP_THRESHOLDS = 32  # candidate caps on the largest micro-batch time tried by partition_dp


class MicroBatchingError(ValueError):
    """The samples cannot be cut into micro-batches that fit."""


def fill_weight(pp: int, chunks: int = 1) -> float:
    """How many times its largest micro-batch a pipeline of ``pp`` ranks, ``chunks`` model chunks
    each, spends filling and draining: (pp - 1) / chunks."""
    return (pp - 1) / chunks


def round_up(value, multiple: int):
    return -(-np.asarray(value) // multiple) * multiple


def microbatch_times(costs: StageCosts, mbs, seqlen, recompute: RecomputeType) -> np.ndarray:
    """Bottleneck-stage forward + backward time (ms) of micro-batches; inf when infeasible."""
    stages = costs.by_recompute(mbs, seqlen, (recompute,), costs.worst_stages())
    return np.max(stages["forward"][0] + stages["backward"][0], axis=0)


def microbatch_fits(costs: StageCosts, mbs, seqlen, recompute: RecomputeType, memory_limit_mb: float) -> np.ndarray:
    """Whether stage s can hold the (pp - s) micro-batches of 1F1B's steady state of this shape
    (:meth:`StageCosts.in_flight`)."""
    return _times_where_fit(costs, mbs, seqlen, (recompute,), memory_limit_mb)[0] < np.inf


def _times_where_fit(costs: StageCosts, mbs, seqlen, types, memory_limit_mb: float, segments=None) -> np.ndarray:
    """[len(types), *shape]: the bottleneck time under each recompute type where every stage
    fits its 1F1B steady state (or interleaved warm-up: :meth:`StageCosts.in_flight`), inf
    elsewhere (asked of one stage of each kind,
    :meth:`StageCosts.worst_stages`: a middle stage of a deep pipeline is asked once)."""
    worst = costs.worst_stages()
    stages = costs.by_recompute(mbs, seqlen, types, worst, segments)
    column = (1, len(worst)) + (1,) * (stages["stored"].ndim - 2)
    in_flight = costs.in_flight(worst).reshape(column)
    state = np.array([costs.model_state_mb(s) for s in worst]).reshape(column)
    need = state + in_flight * stages["stored"] + stages["peak"]
    times = np.max(stages["forward"] + stages["backward"], axis=1)
    return np.where(np.all(need <= memory_limit_mb, axis=1), times, np.inf)


def split_across_dp(lengths: Sequence[int], dp: int, costs: StageCosts, round_to: int = 8) -> list[list[int]]:
    """Sample indices per data-parallel rank, balanced by predicted cost (longest first, greedy)."""
    if dp == 1:
        return [list(range(len(lengths)))]
    if len(lengths) < dp:
        raise MicroBatchingError(
            f"a global batch of {len(lengths)} samples cannot feed {dp} data-parallel ranks: "
            f"use a global batch of at least {dp} samples"
        )
    padded = round_up(np.asarray(lengths), round_to)
    per_sample = microbatch_times(costs, 1, padded, RecomputeType.NONE)
    per_sample = np.where(np.isfinite(per_sample), per_sample, padded)  # order only; fit is checked later
    ranks: list[list[int]] = [[] for _ in range(dp)]
    # the least loaded rank next; among equally loaded ones the fewest samples (so that none is
    # left empty), then the first
    heap = [(0.0, 0, r) for r in range(dp)]
    for index in np.argsort(-per_sample, kind="stable").tolist():
        load, count, target = heapq.heappop(heap)
        ranks[target].append(index)
        heapq.heappush(heap, (load + float(per_sample[index]), count + 1, target))
    return [sorted(r) for r in ranks]


def _sorted_samples(lengths: Sequence[int], indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    indices = np.asarray(indices, dtype=np.int64)
    order = np.argsort(np.asarray(lengths)[indices], kind="stable")
    return indices[order], np.asarray(lengths)[indices[order]]


def _feasible_widths(costs, seqs, max_mbs, recompute, memory_limit_mb) -> np.ndarray:
    """Per sequence length of ``seqs``, a size no micro-batch of that length fits at or above,
    at most ``max_mbs`` (one bound for all, or one per length) -- 0 when one sample does not fit.
    Feasibility shrinks as the size grows, so powers of two find it."""
    most = int(np.max(max_mbs))
    powers = np.unique(np.minimum(2 ** np.arange(int(np.log2(most)) + 2), most + 1))
    feasible = _evaluate(costs, powers[None, :], seqs[:, None], recompute, memory_limit_mb) < np.inf
    first_bad = np.where(feasible.all(axis=1), most + 1, powers[np.argmin(feasible, axis=1)])
    return np.minimum(first_bad - 1, max_mbs)


def _cost_table(costs, seqs, width, recompute, memory_limit_mb, lightest: bool):
    """Cost (ms) of a micro-batch of k = 1..width samples padded to each of ``seqs`` (inf past
    a length's width or where it does not fit), and which of the recompute types that is (an
    index into them): the cheapest that fits, or with ``lightest`` the first that fits."""
    table = np.full((len(seqs), max(1, int(width.max()))), np.inf)
    chosen = np.zeros(table.shape, dtype=np.int64)
    rows = np.repeat(np.arange(len(seqs)), width)
    ks = np.concatenate([np.arange(1, w + 1) for w in width]) if rows.size else np.zeros(0, int)
    choose = _lightest_times if lightest else _cheapest_times
    table[rows, ks - 1], chosen[rows, ks - 1] = choose(costs, ks, seqs[rows], _types(recompute), memory_limit_mb)
    return table, chosen


def _cheapest_times(costs, mbs, seqlen, types, memory_limit_mb, segments=None) -> tuple[np.ndarray, np.ndarray]:
    """Per micro-batch, the time under the fastest of ``types`` that fits (inf where none
    does), and that type's index."""
    times = _times_where_fit(costs, mbs, seqlen, types, memory_limit_mb, segments)
    return np.min(times, axis=0), np.argmin(times, axis=0)


def _lightest_times(costs, mbs, seqlen, types, memory_limit_mb, segments=None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_cheapest_times` taking the first of ``types`` that fits instead of comparing all:
    a heavier recompute runs more, so it is slower wherever a lighter one fits."""
    times = _times_where_fit(costs, mbs, seqlen, types, memory_limit_mb, segments)
    which = np.argmax(times < np.inf, axis=0)  # 0, at inf, where none fits
    return times[which, np.arange(len(mbs))], which


def _evaluate(costs, mbs, seqlen, recompute, memory_limit_mb):
    """Micro-batch time where it fits the memory limit, inf elsewhere; with several recompute
    types, the time of the cheapest that fits."""
    return np.min(_times_where_fit(costs, mbs, seqlen, _types(recompute), memory_limit_mb), axis=0)


def _types(recompute) -> tuple[RecomputeType, ...]:
    return (recompute,) if isinstance(recompute, RecomputeType) else tuple(recompute)


def cheapest_recompute(costs: StageCosts, microbatches: Sequence[MicroBatch], allowed,
                       memory_limit_mb: float) -> list[RecomputeType]:
    """Per micro-batch, the fastest allowed recompute whose 1F1B steady state fits memory
    (the most memory-saving allowed one when none fits)."""
    mbs, seq = cost_shapes(microbatches)
    types = _types(allowed)
    times = _times_where_fit(costs, mbs, seq, types, memory_limit_mb, extra_segments(microbatches))
    best = np.argmin(times, axis=0)
    fallback = types.index(max(types))
    return [types[b] if np.isfinite(times[b, i]) else types[fallback] for i, b in enumerate(best)]


def lightest_fitting_alone(costs: StageCosts, microbatches: Sequence[MicroBatch], allowed,
                           memory_limit_mb: float) -> list[RecomputeType]:
    """Per micro-batch, the lightest allowed recompute under which it fits every stage alone
    (model state, its stored activations and its transient peak; the heaviest allowed where none
    does)."""
    types = tuple(sorted(_types(allowed)))
    fits = _fitting_alone(costs, microbatches, types, memory_limit_mb)
    first = np.where(fits.any(axis=0), np.argmax(fits, axis=0), len(types) - 1)
    return [types[i] for i in first.tolist()]


def _fitting_alone(costs: StageCosts, microbatches: Sequence[MicroBatch], types, memory_limit_mb: float) -> np.ndarray:
    """[type, micro-batch]: whether the micro-batch fits every stage under that recompute with no
    other in flight (model state, its stored activations and its transient peak)."""
    mbs, seq = cost_shapes(microbatches)
    worst = costs.worst_stages()  # alone, every stage of a kind needs the same
    stages = costs.by_recompute(mbs, seq, tuple(types), worst)
    state = np.array([costs.model_state_mb(s) for s in worst]).reshape(1, len(worst), 1)
    return np.all(state + stages["stored"] + stages["peak"] <= memory_limit_mb, axis=1)


def partition_dp(
    lengths: Sequence[int],
    indices: Sequence[int],
    costs: StageCosts,
    memory_limit_mb: float,
    recompute: RecomputeType | Sequence[RecomputeType] = RecomputeType.NONE,
    round_to: int = 8,
    num_thresholds: int = DP_THRESHOLDS,
    fast: bool = False,
    packed: bool = False,
    chunks: int = 1,
    rows: "PaddedRows | None" = None,
) -> tuple[list[MicroBatch], list[RecomputeType]]:
    """Consecutive runs of the length-sorted samples minimising sum(t) + (pp - 1) / V * max(t),
    and the recompute type each was costed with: with several, the cheapest that fits (as
    `cheapest_recompute` would choose).

    t is a micro-batch's bottleneck-stage time; the second term is the pipeline's fill and drain,
    which an interleaved pipeline of ``chunks`` = V model chunks a rank (``costs`` pricing its
    ranks) cuts V-fold, its chunks each 1/V of a rank's work (Narayanan et al.).
    The max term is handled by trying caps T on t: for each T the best sum is a 1-D dynamic
    programme, and all caps are solved together as rows of one numpy array.

    A padded micro-batch costs what its size and longest sample make it, so runs are costed per
    padded length; a ``packed`` one (its samples in one row, :class:`MicroBatch`) costs what its
    tokens and their squares make it, so each run is costed by itself
    (:func:`_packed_cost_table`).

    ``fast`` (fast mode) costs only micro-batches that can occur -- at most as many samples as
    there are of that padded length or shorter -- each under the first of the recompute types
    (listed lightest first) that fits rather than the cheapest, and draws the caps from those
    alone; otherwise every size up to the whole batch is costed, and caps span them all. Packed,
    fast mode costs long runs at fewer sizes (:func:`_fast_run_sizes`).

    ``rows``: padded cost-table rows to share with other partitions of the same ``costs`` and
    memory limit (every DP rank of a batch: :class:`PaddedRows`).
    """
    order, sorted_lengths = _sorted_samples(lengths, indices)
    n = len(order)
    if n == 0:
        return [], []
    if packed:
        table, chosen = _packed_cost_table(costs, sorted_lengths, recompute, memory_limit_mb, round_to, fast)
        end_row = list(range(n))  # the costs of the runs ending at sample j are row j - 1
    else:
        table, chosen, end_row = _padded_cost_table(costs, sorted_lengths, recompute, memory_limit_mb, round_to, fast,
                                                     rows)
    caps = _candidate_caps(table, float(table[end_row[-1], 0]), num_thresholds)
    capped = _capped_costs(table, end_row, caps)
    # before[:, n - j] is the best sum over the first j samples; stored back to front so that the
    # bests of the `width` prefixes a micro-batch ending at j can extend are one contiguous slice.
    before = np.full((len(caps), n + 1), np.inf)
    before[:, n] = 0.0
    choice = np.zeros((len(caps), n + 1), dtype=np.int64)  # the size of the last micro-batch, less one
    rows, table_row = np.arange(len(caps)), None
    for j in range(1, n + 1):  # one numpy step a sample: as few calls as it takes (it is most of the time)
        if end_row[j - 1] != table_row:  # sorted samples: the ends sharing a table row are consecutive
            table_row = end_row[j - 1]
            costs_here = capped(table_row)
        width = min(j, costs_here.shape[1])
        # total[:, k]: the prefix of j - k - 1 samples plus a micro-batch of the k + 1 samples ending at j
        total = before[:, n - j + 1:n - j + 1 + width] + costs_here[:, :width]
        k = total.argmin(1)
        choice[:, j] = k
        before[:, n - j] = total[rows, k]
    objective = before[:, 0] + fill_weight(costs.pp, chunks) * caps
    row = int(np.argmin(objective))
    if not np.isfinite(objective[row]):
        raise MicroBatchingError(f"no micro-batching fits {memory_limit_mb:.0f} MB: raise the memory limit")
    bounds = []
    j = n
    while j > 0:
        k = int(choice[row, j]) + 1
        bounds.append((j - k, j))
        j -= k
    bounds.reverse()
    types = _types(recompute)
    make = _packed_microbatch if packed else _microbatch
    return ([make(order, sorted_lengths, lo, hi, round_to) for lo, hi in bounds],
            [types[chosen[end_row[hi - 1], hi - lo - 1]] for lo, hi in bounds])


def _padded_cost_table(costs, sorted_lengths, recompute, memory_limit_mb, round_to: int, fast: bool,
                       rows: "PaddedRows | None"):
    """:func:`_cost_table` of the padded lengths the sorted samples end at (its rows from ``rows``
    where given), and the row of each sample's padded length."""
    padded, seqs, most = _padded_questions(sorted_lengths, round_to, fast)
    if rows is None:
        rows = PaddedRows(costs, memory_limit_mb)
    elif rows.costs is not costs or rows.memory_limit_mb != memory_limit_mb:
        raise ValueError("the padded rows given are of another cost model or memory limit")
    table, chosen = rows.table(seqs, most, _types(recompute), lightest=fast)
    if not np.isfinite(table[-1, 0]):
        raise _unfit(costs, int(sorted_lengths[-1]), int(padded[-1]), _types(recompute), memory_limit_mb)
    return table, chosen, np.searchsorted(seqs, padded).tolist()


def _padded_questions(sorted_lengths: np.ndarray, round_to: int, fast: bool):
    """The padded lengths of sorted samples, the distinct ones, and per distinct length the
    largest micro-batch a partition of them costs (fast mode: as many samples as are that long
    or shorter; else all)."""
    padded = round_up(sorted_lengths, round_to)
    seqs = np.unique(padded)
    most = np.searchsorted(padded, seqs, side="right") if fast else np.full(len(seqs), len(padded))
    return padded, seqs, most


class PaddedRows:
    """The rows of padded cost tables (:func:`_cost_table`) under one memory limit, each padded
    length's costed once however many partitions ask for it: an entry depends on its length and
    size alone, so every data-parallel rank of a batch (and each partition of a rank) shares
    them, and a rank's table is its lengths' rows, cut to its widths. Where the partitions to
    come are told first (:meth:`foresee`), each row is costed once, as wide as the widest of
    them asks, rather than widened rank by rank."""

    def __init__(self, costs: StageCosts, memory_limit_mb: float):
        self.costs, self.memory_limit_mb = costs, memory_limit_mb
        self._foreseen: dict[int, int] = {}  # length -> the largest size a partition to come asks
        # types -> length -> (its width found up to some size, whether a size above it does not fit)
        self._reach: dict[tuple, dict[int, tuple[int, bool]]] = {}
        self._rows: dict[tuple, dict[int, tuple[np.ndarray, np.ndarray]]] = {}  # (types, lightest) -> length -> row

    def foresee(self, lengths: Sequence[int], round_to: int, fast: bool) -> None:
        """Note what a partition of ``lengths`` (one DP rank's samples) will ask."""
        _, seqs, most = _padded_questions(np.sort(np.asarray(lengths)), round_to, fast)
        for seq, m in zip(seqs.tolist(), most.tolist()):
            if m > self._foreseen.get(seq, 0):
                self._foreseen[seq] = m

    def table(self, seqs: np.ndarray, most: np.ndarray, types: tuple, lightest: bool):
        """The cost table of sizes 1..``most`` (per length) of ``seqs`` and each entry's recompute
        (:func:`_cost_table`)."""
        rows = self._rows.setdefault((types, lightest), {})
        if not rows and self._foreseen:  # the first question of these types: every foreseen row at once
            ahead = np.array(sorted(self._foreseen))
            self._cost(ahead, np.array([self._foreseen[seq] for seq in ahead.tolist()]), types, rows, lightest)
        widths = self._cost(seqs, most, types, rows, lightest)
        table = np.full((len(seqs), max(1, int(widths.max()))), np.inf)
        chosen = np.zeros(table.shape, dtype=np.int64)
        for i, (seq, width) in enumerate(zip(seqs.tolist(), widths.tolist())):
            if width:
                table[i, :width], chosen[i, :width] = rows[seq][0][:width], rows[seq][1][:width]
        return table, chosen

    def _cost(self, seqs: np.ndarray, most: np.ndarray, types: tuple, rows: dict, lightest: bool) -> np.ndarray:
        """Cost the rows of ``seqs`` not yet as wide as ``most`` asks -- as wide as they fit, up
        to the widest question asked or foreseen -- and return the widths asked."""
        widths = self._widths(seqs, most, types)
        short = np.array([len(rows[seq][0]) < width if seq in rows else width > 0
                          for seq, width in zip(seqs.tolist(), widths.tolist())], dtype=bool)
        if short.any():
            wide = np.array([self._reach[types][seq][0] for seq in seqs[short].tolist()])
            times, chosen = _cost_table(self.costs, seqs[short], wide, types, self.memory_limit_mb, lightest)
            for i, (seq, width) in enumerate(zip(seqs[short].tolist(), wide.tolist())):
                rows[seq] = times[i, :width], chosen[i, :width]
        return widths

    def _widths(self, seqs: np.ndarray, most: np.ndarray, types: tuple) -> np.ndarray:
        """:func:`_feasible_widths` of ``seqs`` up to ``most``, from earlier answers where they
        settle it: a size that does not fit bounds every larger question, and sizes that all fit
        up to some bound answer the smaller ones."""
        reach = self._reach.setdefault(types, {})
        ask = np.array([seq not in reach or (reach[seq][0] < m and not reach[seq][1])
                        for seq, m in zip(seqs.tolist(), most.tolist())], dtype=bool)
        if ask.any():
            asked = np.maximum(most[ask], [self._foreseen.get(seq, 0) for seq in seqs[ask].tolist()])
            found = _feasible_widths(self.costs, seqs[ask], asked, types, self.memory_limit_mb)
            for seq, width, m in zip(seqs[ask].tolist(), found.tolist(), asked.tolist()):
                reach[seq] = width, width < m
        return np.minimum([reach[seq][0] for seq in seqs.tolist()], most)


#: at most this many packed micro-batches are costed (a run's end times its size), so that a
#: batch of thousands of short samples is planned in seconds: longer runs are not tried
PACKED_TABLE_ENTRIES = 2_000_000

#: fast mode costs packed runs of every size up to this many samples, and longer ones a quarter
#: apart: a run of 40 samples costs little more than one of 37, and long runs are most of the
#: runs of a large batch of short samples
FAST_EVERY_RUN_SIZE = 16


def _packed_cost_table(costs, sorted_lengths, recompute, memory_limit_mb, round_to: int, fast: bool):
    """[run end j - 1, run size k - 1]: the cost of packing the k sorted samples ending at j into
    one row (their tokens rounded up to ``round_to``) and which recompute type that is, as
    :func:`_cost_table` chooses; inf where the run is longer than j or does not fit, and in fast
    mode at the sizes :func:`_fast_run_sizes` leaves out."""
    n = len(sorted_lengths)
    lengths = np.asarray(sorted_lengths, dtype=np.int64)
    tokens = np.concatenate([[0], np.cumsum(lengths)])
    squares = np.concatenate([[0.0], np.cumsum(lengths.astype(float) ** 2)])

    def priced(ends, sizes, choose, types):  # the runs' (mbs, seqlen) cost shapes and extra segments, priced
        used = tokens[ends] - tokens[ends - sizes]
        row = round_up(used, round_to)
        mbs, seq = packed_cost_shape(row, used, squares[ends] - squares[ends - sizes])
        return choose(costs, mbs, seq, types, memory_limit_mb, packed_extra_segments(row, used, sizes, mbs))

    def evaluate(ends, sizes):
        return priced(ends, sizes, _cheapest_times, _types(recompute))[0]

    if not np.isfinite(evaluate(np.array([n]), np.array([1]))[0]):
        raise _unfit(costs, int(lengths[-1]), int(round_up(lengths[-1], round_to)), _types(recompute), memory_limit_mb)
    ends_all = np.arange(1, n + 1)
    sizes_at = _packed_widths(evaluate, ends_all, np.minimum(ends_all, max(1, PACKED_TABLE_ENTRIES // n)))
    width = int(sizes_at.max())
    ends, sizes = _costed_runs(sizes_at, _fast_run_sizes(width) if fast else np.arange(1, width + 1))
    table = np.full((n, width), np.inf)
    chosen = np.zeros(table.shape, dtype=np.int64)
    choose = _lightest_times if fast else _cheapest_times
    table[ends - 1, sizes - 1], chosen[ends - 1, sizes - 1] = priced(ends, sizes, choose, _types(recompute))
    return table, chosen


def _costed_runs(widths: np.ndarray, ladder: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ends, sizes) of the runs to cost: at each end j, the sizes of ``ladder`` below its widest
    fitting run ``widths[j - 1]``, then that widest."""
    counts = np.searchsorted(ladder, widths) + 1
    ends = np.repeat(np.arange(1, len(widths) + 1), counts)
    at = np.arange(len(ends)) - np.repeat(np.cumsum(counts) - counts, counts)  # index among its end's sizes
    widest = at == np.repeat(counts - 1, counts)
    return ends, np.where(widest, np.repeat(widths, counts), ladder[np.minimum(at, len(ladder) - 1)])


def _fast_run_sizes(width: int) -> np.ndarray:
    """The run sizes up to ``width`` that fast mode costs (besides each run end's widest)."""
    sizes = list(range(1, FAST_EVERY_RUN_SIZE + 1))
    while sizes[-1] < width:
        sizes.append(round(sizes[-1] * 1.25))
    return np.array([k for k in sizes if k <= width], dtype=np.int64)


def _unfit(costs, length: int, padded: int, types, memory_limit_mb: float) -> MicroBatchingError:
    """Why a sample of ``length`` tokens (``padded``) fits no micro-batch, and the fix."""
    if not any(np.isfinite(costs.forward_ms(0, 1, padded, rc)) for rc in types):
        return MicroBatchingError(
            f"the cost model has no times for a sample of {length} tokens (padded to {padded}): "
            f"{costs.model.no_time_fix()}")
    heaviest = (max(types),)  # it keeps the least
    if _fitting_alone(costs, [MicroBatch((0,), padded)], heaviest, memory_limit_mb).all():
        return MicroBatchingError(
            f"a sample of {length} tokens fits under {memory_limit_mb:.0f} MB alone, but not as the "
            f"{int(costs.in_flight(costs.worst_stages()).max())} micro-batches 1F1B's first stage holds at once with "
            f"recompute {'/'.join(rc.label for rc in types)}: split each micro-batch's activations (sequence "
            "parallelism, more tensor or context parallelism), use fewer pipeline stages, or raise the memory limit")
    return MicroBatchingError(
        f"a sample of {length} tokens fits no micro-batch with recompute {'/'.join(rc.label for rc in types)} "
        f"under {memory_limit_mb:.0f} MB: raise the memory limit, use more tensor/pipeline parallelism, "
        "or truncate long samples")


#: runs up to this many are all priced at once to find the widest fitting ones; more are bisected
PACKED_WIDTHS_AT_ONCE = 4096


def _packed_widths(evaluate, ends: np.ndarray, most: np.ndarray) -> np.ndarray:
    """Per run end, the largest run size up to ``most`` that fits (``evaluate(ends, sizes)`` is
    finite): a longer run ending there holds more tokens and more attention, so fitting only
    shrinks with its size, and the fitting sizes are counted where there are few runs, else
    found by bisection on all ends at once. A run of one fits everywhere (the longest sample
    alone was checked)."""
    if int(most.sum()) <= PACKED_WIDTHS_AT_ONCE:  # few runs (a rank of a large DP): all in one evaluation
        starts = np.cumsum(most) - most
        sizes = 1 + np.arange(int(most.sum())) - np.repeat(starts, most)
        fits = evaluate(np.repeat(ends, most), sizes) < np.inf
        return np.maximum(1, np.add.reduceat(fits.astype(np.int64), starts))
    lo, hi = np.ones_like(most), most.copy()
    todo = np.flatnonzero(lo < hi)
    while todo.size:  # only the ends not settled yet are evaluated again
        mid = (lo[todo] + hi[todo] + 1) // 2
        fits = evaluate(ends[todo], mid) < np.inf
        lo[todo], hi[todo] = np.where(fits, mid, lo[todo]), np.where(fits, hi[todo], mid - 1)
        todo = todo[lo[todo] < hi[todo]]
    return lo


def _capped_costs(table: np.ndarray, end_row: list[int], caps: np.ndarray):
    """A function of a table row (the costs of the runs ending at some j; sorted samples make each
    row one run of ends) giving its costs with those above each cap made inf: [caps, k], as wide
    as its last finite cost or its last j allows -- wider never wins."""
    finite = np.isfinite(table)
    reach = np.where(finite.any(axis=1), table.shape[1] - np.argmax(finite[:, ::-1], axis=1), 1)
    last_j = {row: j for j, row in enumerate(end_row, start=1)}

    def capped(row: int) -> np.ndarray:
        cost = table[row, :min(int(reach[row]), last_j[row])][None, :]
        return np.where(cost <= caps[:, None], cost, np.inf)

    return capped


def _candidate_caps(table: np.ndarray, smallest_cap: float, count: int) -> np.ndarray:
    """Caps between the unavoidable and the largest feasible time of a micro-batch in the cost
    table (each of its rows is a padded length some sample ends at): every distinct time when
    there are at most `count`, else `count` geometrically spaced ones."""
    finite = table[np.isfinite(table) & (table >= smallest_cap)]
    distinct = np.unique(np.append(finite, smallest_cap))
    if len(distinct) <= count:  # few enough to try every one: the result is exactly optimal
        return distinct
    return np.geomspace(smallest_cap, distinct[-1], count)


def _microbatch(order, sorted_lengths, lo, hi, round_to: int) -> MicroBatch:
    return MicroBatch(samples=tuple(int(i) for i in order[lo:hi]),
                      seq_len=int(round_up(sorted_lengths[hi - 1], round_to)))


def _packed_microbatch(order, sorted_lengths, lo, hi, round_to: int) -> MicroBatch:
    return packed_microbatch(order[lo:hi], sorted_lengths[lo:hi], round_to)


def packed_microbatch(samples: Sequence[int], lengths: Sequence[int], round_to: int) -> MicroBatch:
    """One THD row: ``samples`` (of these ``lengths``) back to back, padded to a multiple of ``round_to``."""
    run = tuple(lengths.tolist() if isinstance(lengths, np.ndarray) else map(int, lengths))
    ids = tuple(samples.tolist() if isinstance(samples, np.ndarray) else map(int, samples))
    return MicroBatch(ids, -(-sum(run) // round_to) * round_to, run)  # hundreds of thousands a plan: no numpy


def partition_token_based(lengths, indices, tokens_per_microbatch: int, round_to: int = 8) -> list[MicroBatch]:
    """Greedy runs of the sorted samples with at most `tokens_per_microbatch` padded tokens."""
    order, sorted_lengths = _sorted_samples(lengths, indices)
    padded = round_up(sorted_lengths, round_to)
    out, lo = [], 0
    for hi in range(1, len(order) + 1):
        if hi < len(order) and (hi + 1 - lo) * padded[hi] > tokens_per_microbatch:
            out.append(_microbatch(order, sorted_lengths, lo, hi, round_to))
            lo = hi
    if lo < len(order):
        out.append(_microbatch(order, sorted_lengths, lo, len(order), round_to))
    return out


def partition_uniform(lengths, indices, microbatch_size: int, round_to: int = 8) -> list[MicroBatch]:
    """Runs of `microbatch_size` sorted samples (the last may be shorter)."""
    order, sorted_lengths = _sorted_samples(lengths, indices)
    return [_microbatch(order, sorted_lengths, lo, min(lo + microbatch_size, len(order)), round_to)
            for lo in range(0, len(order), microbatch_size)]


def pack_fixed_length(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Megatron-style packing: first-fit decreasing of samples into sequences of `seq_len` tokens.

    Each sample goes into the first open sequence with room for it, found in O(log sequences)
    (:class:`_FirstFit`), so packing a batch takes O(n log n), not the O(n x sequences) of
    trying every open sequence in turn."""
    too_long = [n for n in lengths if n > seq_len]
    if too_long:
        raise MicroBatchingError(f"a sample of {max(too_long)} tokens exceeds the packed length {seq_len}")
    bins: list[list[int]] = []
    first_fit = _FirstFit(len(lengths))
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = first_fit.first_with_room(lengths[index])
        if b is None:  # a new sequence, its room set once
            b = len(bins)
            bins.append([])
            first_fit.set_room(b, seq_len - lengths[index])
        else:
            first_fit.set_room(b, first_fit.room(b) - lengths[index])
        bins[b].append(index)
    return bins


class _FirstFit:
    """The free room of up to ``capacity`` bins opened in order, as a max-tree: the first bin
    with room for a sample is found by walking down from the root, always left where the left
    subtree has room."""

    def __init__(self, capacity: int):
        self._leaves = 1 << max(0, capacity - 1).bit_length()
        self._max = [-1] * (2 * self._leaves)  # -1: a bin not opened yet, with room for nothing

    def room(self, b: int) -> int:
        return self._max[self._leaves + b]

    def set_room(self, b: int, room: int) -> None:
        node = self._leaves + b
        self._max[node] = room
        while node > 1:
            node //= 2
            highest = max(self._max[2 * node], self._max[2 * node + 1])
            if self._max[node] == highest:  # nor will any node above change
                return
            self._max[node] = highest

    def first_with_room(self, need: int) -> "int | None":
        if self._max[1] < need:
            return None
        node = 1
        while node < self._leaves:
            node = 2 * node if self._max[2 * node] >= need else 2 * node + 1
        return node - self._leaves
