"""Megatron's 1F1B (one forward, one backward)."""

from __future__ import annotations

from megatron_dynapipe.planning.schedules.base import FixedSchedule
from megatron_dynapipe.planning.simulator import Order
from megatron_dynapipe.planning.types import Action


class OneFOneB(FixedSchedule):
    """Stage s runs pp - s - 1 warm-up forwards, then alternates a forward and a backward, then
    drains the backwards: it never holds more than pp - s micro-batches."""

    name = "1f1b"

    def stage_order(self, stage: int, pp: int, n: int) -> Order:
        warmup = min(pp - stage - 1, n)
        order = [Action("F", m) for m in range(warmup)]
        for m in range(n - warmup):
            order += [Action("F", m + warmup), Action("B", m)]
        return order + [Action("B", m) for m in range(n - warmup, n)]
