"""Recompute-plan adjustment: raise recomputation where a schedule exceeds memory."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_dynapipe.planning.cost_model import StageCosts
from megatron_dynapipe.planning.schedules import simulate_schedule
from megatron_dynapipe.planning.simulator import Order, SimulationResult, WorkTable
from megatron_dynapipe.planning.types import MicroBatch, RecomputeType

FAST_MODE_ROUNDS = 3
FAST_MODE_MICROBATCHES_PER_ROUND = 2

@dataclass
class RecomputePlan:
    recompute: np.ndarray  # [pp, n] RecomputeType values
    orders: list[Order]
    simulation: SimulationResult
    rounds: int


def adjust_rc_plan(
    microbatches: Sequence[MicroBatch],
    recompute: np.ndarray,
    costs: StageCosts,
    schedule: str,
    memory_limit_mb: float,
    fast_mode: bool = False,
    work_table: WorkTable | None = None,
    give_up_above_ms: float = math.inf,
) -> RecomputePlan | None:
    """Raise recompute (none -> selective -> full) of chosen micro-batches on the stages whose
    simulated peak exceeds the limit, re-simulating after each round, until the plan fits.

    On an over-limit stage the micro-batches held at its peak are raised, largest memory saving
    first, until the saving covers the excess. Fast mode stops after 3 rounds of at most 2
    micro-batches. Returns None when the plan cannot be made to fit, or as soon as its makespan
    cannot stay at or below `give_up_above_ms` (a search's best so far) whatever recompute is
    raised -- in fast mode also once the simulation of the current recompute cannot.
    `work_table` (of these micro-batches, in this order) saves evaluating the cost model again.
    """
    table = work_table or WorkTable(costs, microbatches)
    recompute = np.array(recompute, dtype=np.int64).reshape(costs.pp, len(microbatches))
    max_rounds = FAST_MODE_ROUNDS if fast_mode else costs.pp * len(microbatches) * len(RecomputeType)
    per_round = FAST_MODE_MICROBATCHES_PER_ROUND if fast_mode else None
    rounds = 0
    while True:
        if table.makespan_lower_bound(recompute) > give_up_above_ms:
            return None
        work = table.work(recompute)
        if not np.all(np.isfinite(work.forward + work.backward)):
            return None
        # Fast mode also stops a simulation once it cannot end by the cutoff. Not in normal mode:
        # raising recompute of a plan over the cutoff that does not fit could, rarely, end sooner.
        result = simulate_schedule(schedule, work, memory_limit_mb, give_up_above_ms if fast_mode else math.inf)
        if result is None:
            return None
        if result.fits(memory_limit_mb):
            return RecomputePlan(recompute, result.orders, result, rounds)
        if rounds == max_rounds or not _raise_recompute(recompute, table, result, memory_limit_mb, per_round):
            return None
        rounds += 1


def _raise_recompute(recompute, table: WorkTable, result, memory_limit_mb, per_round) -> bool:
    budget = per_round
    changed = False
    stored = table.tables["stored"]  # [recompute, pp, n]
    for s in np.argsort(-result.peak_memory):  # worst stage first
        excess = result.peak_memory[s] - memory_limit_mb
        if excess <= 1e-6:
            break
        held = [m for m in result.peak_microbatches[s] if recompute[s, m] < RecomputeType.FULL]
        saving = {m: stored[recompute[s, m], s, m] - stored[recompute[s, m] + 1, s, m] for m in held}
        for m in sorted(held, key=lambda m: -saving[m]):  # largest memory saving first
            if budget == 0 or excess <= 0:
                break
            excess -= saving[m]
            recompute[s, m] += 1
            changed = True
            budget = None if budget is None else budget - 1
    return changed
