"""Megatron's interleaved 1F1B: V model chunks a rank, micro-batches in groups of at least ``pp``."""

from __future__ import annotations

import itertools

from megatron_dynapipe.planning.schedules.base import FixedSchedule
from megatron_dynapipe.planning.simulator import Order
from megatron_dynapipe.planning.types import Action


class Interleaved1F1B(FixedSchedule):
    """Every rank walks one table of (micro-batch, chunk): the micro-batches in groups of ``G``
    (``pp`` where it divides ``n``; :func:`group_sizes`), each group through chunk 0, then
    chunk 1, ... Forwards follow the table; backwards follow it too, with the chunks taken last
    to first. Rank r runs ``2 (pp - r - 1) + (V - 1) G`` warm-up forwards, then alternates one
    forward and one backward, then drains the backwards (the doubled first term: an activation
    that leaves the last rank comes back round to the first). With ``pp`` micro-batches or fewer
    every forward runs first."""

    name = "interleaved-1f1b"
    interleaved = True

    def stage_order(self, stage: int, pp: int, n: int, chunks: int = 1) -> Order:
        groups = group_sizes(pp, n)
        ends = list(itertools.accumulate(groups))
        table = [(m, c) for size, end in zip(groups, ends) for c in range(chunks) for m in range(end - size, end)]
        forwards = [Action.forward(m, c) for m, c in table]
        backwards = [Action.backward(m, chunks - 1 - c) for m, c in table]
        total = len(table)
        warmup = total if n <= pp else min(total, 2 * (pp - stage - 1) + (chunks - 1) * groups[0])
        order = forwards[:warmup]
        for k in range(total - warmup):
            order += (forwards[warmup + k], backwards[k])
        return order + backwards[total - warmup:]


def group_sizes(pp: int, n: int) -> list[int]:
    """The micro-batch groups of the table: the fewest micro-batches a group, at least ``pp``,
    that leave no last group smaller than ``pp`` (Megatron-LM's ``microbatch_group_size_per_vp_stage``
    with the remainder it accepts: a smaller last group's chunks would wait on each other)."""
    if n <= pp:
        return [n] if n else []
    size = next(g for g in range(pp, n + 1) if n % g == 0 or n % g >= pp)
    return [size] * (n // size) + ([n % size] if n % size else [])
