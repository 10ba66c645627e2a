"""Megatron's 1F1B (one forward, one backward)."""

from __future__ import annotations

from megatron_dynapipe.planning.schedules.base import FixedSchedule
from megatron_dynapipe.planning.simulator import Order, actions


class OneFOneB(FixedSchedule):
    """Stage s runs pp - s - 1 warm-up forwards, then alternates a forward and a backward, then
    drains the backwards: it never holds more than pp - s micro-batches."""

    name = "1f1b"

    def stage_order(self, stage: int, pp: int, n: int, chunks: int = 1) -> Order:
        forward, backward = actions(n)
        warmup = min(pp - stage - 1, n)
        order = list(forward[:warmup])
        for m in range(n - warmup):
            order += (forward[m + warmup], backward[m])
        return order + list(backward[n - warmup:])
