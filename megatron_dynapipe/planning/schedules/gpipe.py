"""GPipe: every forward, then every backward."""

from __future__ import annotations

from megatron_dynapipe.planning.schedules.base import FixedSchedule
from megatron_dynapipe.planning.simulator import Order, actions


class GPipe(FixedSchedule):
    """Each stage runs all n forwards, then all n backwards, so it holds every micro-batch at
    once: on the same micro-batches it takes as long as 1F1B where they cost alike, and n / (pp - s)
    times its memory. Searched only when asked for (``--dynapipe-schedule gpipe``)."""

    name = "gpipe"
    searched_by_default = False

    def stage_order(self, stage: int, pp: int, n: int, chunks: int = 1) -> Order:
        forward, backward = actions(n)
        return list(forward) + list(backward)
