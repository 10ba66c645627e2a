"""Why a method's pipeline takes the time it takes: its step read off its slowest data-parallel
rank, beside the physical limit of the batch.

Every method here (Megatron's fixed shapes, THD packing, ``dp_balanced``, DynaPipe's plans) ends
as per data-parallel rank a list of micro-batches, a recompute type per (stage, micro-batch) and
a simulated pipeline time; :class:`PipelineRun` is that, and :func:`explain` reads it:

* the slowest rank, and its time's share above the ranks' mean (the DP split's imbalance);
* on that rank's busiest pipeline stage: its compute (forward, backward, recompute), of which the
  forward passes run again (``recompute_ms``) and the padding (the padded tokens' share of the
  tokens computed, of the compute without recompute);
* the bubble: the pipeline time less that busiest stage's compute (fill, drain, waiting on a
  neighbour or a transfer);
* the ideal (:func:`ideal_ms`): the batch's real tokens computed with nothing wasted, spread evenly
  over every rank.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple, Sequence

import numpy as np

from megatron_dynapipe.planning.baselines import PACKING_MICROBATCH_SIZES
from megatron_dynapipe.planning.cost_model import StageCosts
from megatron_dynapipe.planning.simulator import WorkTable
from megatron_dynapipe.planning.types import MicroBatch, RecomputeType, packed_cost_shape

__all__ = ["Breakdown", "PipelineRun", "explain", "ideal_ms"]


class PipelineRun(NamedTuple):
    """A method's pipeline on one batch: per data-parallel rank its micro-batches in entry order,
    their recompute [virtual stages, n] and its simulated time; the fullest stage's peak memory."""

    per_rank: Sequence[Sequence[MicroBatch]]
    recompute: Sequence[np.ndarray]
    rank_ms: Sequence[float]
    peak_mb: float

    @classmethod
    def of_plan(cls, plan) -> "PipelineRun":
        """A :class:`~megatron_dynapipe.planning.planner.PlanResult`'s ranks."""
        return cls([c.microbatches for c in plan.choices], [c.recompute for c in plan.choices],
                   [c.makespan_ms for c in plan.choices], float(np.max(plan.peak_memory_mb)))

    @classmethod
    def uniform(cls, per_rank, recompute: RecomputeType, rank_ms, peak_mb, stages: int) -> "PipelineRun":
        """Megatron's way: one recompute throughout."""
        return cls(per_rank, [np.full((stages, len(rows)), int(recompute)) for rows in per_rank], rank_ms, peak_mb)


@dataclass(frozen=True)
class Breakdown:
    """:func:`explain`'s answer (ms unless named otherwise)."""

    pipeline_ms: float  # the slowest data-parallel rank's
    slowest_rank: int
    above_mean: float  # its time over the ranks' mean, less one
    microbatches: int  # on the slowest rank
    busy_ms: float  # the slowest rank's busiest pipeline stage's compute
    bubble_ms: float  # pipeline_ms - busy_ms
    recompute_ms: float  # of busy_ms: forward passes run again
    padding_ms: float  # of busy_ms: compute on padding (padding_share of the compute without recompute)
    padding_share: float  # padded tokens over the tokens the slowest rank computes
    peak_memory_mb: float
    ideal_ms: float  # :func:`ideal_ms`

    def to_json(self) -> dict:
        return asdict(self)


def explain(run: PipelineRun, costs: StageCosts, sample_lengths: Sequence[int], documents: Sequence[int],
            row_tokens: int, chunks: int = 1) -> Breakdown:
    """``run`` read as the module says. ``sample_lengths``: the tokens of each sample the
    micro-batches index (a packed micro-batch carries its own); ``documents``: the batch's real
    samples, for :func:`ideal_ms` with rows of ``row_tokens``; ``costs`` per virtual stage where
    ranks hold ``chunks`` model chunks."""
    rank_ms = np.asarray(run.rank_ms, dtype=float)
    slowest = int(np.argmax(rank_ms))
    rows, recompute = list(run.per_rank[slowest]), np.asarray(run.recompute[slowest])
    busy, again, padding, share = 0.0, 0.0, 0.0, 0.0
    if rows:
        priced = costs.packed() if any(mb.packed for mb in rows) else costs
        table = WorkTable(priced, rows, chunks)
        work, plain = table.work(recompute), table.work(np.zeros_like(recompute))
        def rank_compute(w):  # [pp ranks]: a rank's chunks (virtual stage c * pp + r) run on one stream
            return (w.forward + w.backward).sum(axis=1).reshape(chunks, -1).sum(axis=0)

        with_rc, without = rank_compute(work), rank_compute(plain)
        busiest = int(np.argmax(with_rc))
        busy, again = float(with_rc[busiest]), float(with_rc[busiest] - without[busiest])
        computed = sum(mb.tokens for mb in rows)
        real = sum(sum(mb.packed_lengths) if mb.packed else sum(sample_lengths[i] for i in mb.samples) for mb in rows)
        share = max(0.0, 1.0 - real / computed)
        padding = share * float(without[busiest])
    return Breakdown(pipeline_ms=float(rank_ms[slowest]), slowest_rank=slowest,
                     above_mean=float(rank_ms[slowest] / rank_ms.mean() - 1.0) if rank_ms.mean() > 0 else 0.0,
                     microbatches=len(rows), busy_ms=busy, bubble_ms=max(0.0, float(rank_ms[slowest]) - busy),
                     recompute_ms=again, padding_ms=padding, padding_share=share, peak_memory_mb=float(run.peak_mb),
                     ideal_ms=ideal_ms(costs, documents, row_tokens, chunks))


def ideal_ms(costs: StageCosts, documents: Sequence[int], row_tokens: int, chunks: int = 1) -> float:
    """The physical limit of a batch on this layout: its real tokens, each document attending
    to itself alone, with no padding and no recompute, every pipeline rank of every data-parallel
    rank busy all the time: the forward and backward of every stage of every row, over the
    pipeline ranks and the data-parallel ranks. Rows alike (the batch's tokens T and squared
    lengths Q shared out evenly: each of its share of Q, :func:`packed_cost_shape`), of k x
    ``row_tokens`` tokens for the k that costs least of those THD packing may run
    (:data:`~.baselines.PACKING_MICROBATCH_SIZES`). No split, order or recompute choice beats it
    on this cost model."""
    lengths = np.asarray(documents, dtype=float)
    tokens, squares = float(lengths.sum()), float((lengths * lengths).sum())
    if tokens <= 0:
        return 0.0
    counts = np.array(sorted({max(1, math.ceil(tokens / (k * row_tokens))) for k in PACKING_MICROBATCH_SIZES}),
                      dtype=float)
    row = tokens / counts
    mbs, seq = packed_cost_shape(row, row, squares / counts)
    every = costs.packed().by_recompute(mbs, seq, (RecomputeType.NONE,))
    total = counts * (every["forward"][0] + every["backward"][0]).sum(axis=0)  # every stage of every row
    return float(np.min(total[np.isfinite(total)], initial=math.inf)) / (costs.pp // chunks) / costs.dp
