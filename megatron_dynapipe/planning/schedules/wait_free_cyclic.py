"""wait-free-cyclic: a stage never idles while it has a runnable op."""

from __future__ import annotations

import math

from megatron_dynapipe.planning.schedules.base import Schedule
from megatron_dynapipe.planning.simulator import SimulationResult, StageWork, run_timeline


class WaitFreeCyclic(Schedule):
    """A stage fills up to 1F1B's pp - s micro-batches in flight (recompute adjustment makes
    those fit, which beats idling), otherwise runs a due backward, otherwise admits one more
    forward if its activations fit the memory limit. Its orders come from simulating that policy
    on the cost model (event by event, earliest stage first), so a stage runs ahead of 1F1B
    whenever a slow micro-batch holds up backwards; ``strict_memory`` keeps it within the limit
    while it fills a stage too (the policy: simulator._wait_free_pick)."""

    name = "wait-free-cyclic"

    def simulate(self, work: StageWork, memory_limit_mb: float, give_up_above_ms: float = math.inf,
                 strict_memory: bool = False) -> "SimulationResult | None":
        return run_timeline(work, memory_limit_mb=memory_limit_mb, give_up_above_ms=give_up_above_ms,
                            report_over_mb=memory_limit_mb, strict_memory=strict_memory)
