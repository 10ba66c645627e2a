"""Megatron's interleaved 1F1B: V model chunks a rank, micro-batches in groups of ``pp``."""

from __future__ import annotations

from megatron_dynapipe.planning.schedules.base import FixedSchedule
from megatron_dynapipe.planning.simulator import Order
from megatron_dynapipe.planning.types import Action


class Interleaved1F1B(FixedSchedule):
    """Every rank walks one table of (micro-batch, chunk): the micro-batches in groups of ``pp``,
    each group through chunk 0, then chunk 1, ... (the last group is what is left). Forwards
    follow the table; backwards follow it too, with the chunks taken last to first. Rank r runs
    ``2 (pp - r - 1) + (V - 1) pp`` warm-up forwards, then alternates one forward and one
    backward, then drains the backwards (the doubled first term: an activation that leaves the
    last rank comes back round to the first). With ``pp`` micro-batches or fewer every forward
    runs first."""

    name = "interleaved-1f1b"
    interleaved = True

    def stage_order(self, stage: int, pp: int, n: int, chunks: int = 1) -> Order:
        table = [(m, c) for group in range(0, n, pp) for c in range(chunks)
                 for m in range(group, min(group + pp, n))]
        forwards = [Action("F", m, c) for m, c in table]
        backwards = [Action("B", m, chunks - 1 - c) for m, c in table]
        total = len(table)
        warmup = total if n <= pp else min(total, 2 * (pp - stage - 1) + (chunks - 1) * pp)
        order = forwards[:warmup]
        for k in range(total - warmup):
            order += (forwards[warmup + k], backwards[k])
        return order + backwards[total - warmup:]
