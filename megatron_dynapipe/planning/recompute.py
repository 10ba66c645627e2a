"""Recompute-plan adjustment: raise recomputation where a schedule exceeds memory."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_dynapipe.planning.cost_model import StageCosts
from megatron_dynapipe.planning.schedules import FixedSchedule, Schedule, get_schedule
from megatron_dynapipe.planning.simulator import (
    MEMORY_TOLERANCE_MB,
    Order,
    OverLimit,
    SimulationResult,
    WorkTable,
    over_limit,
    rank_rows,
)
from megatron_dynapipe.planning.types import MicroBatch, RecomputeType

FAST_MODE_ROUNDS = 3
#: far above what summing an op's memory in another order can change it by
ROUNDING_MB = 1e-6


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
    schedule: "str | Schedule",
    memory_limit_mb: float,
    fast_mode: bool = False,
    work_table: WorkTable | None = None,
    give_up_above_ms: float = math.inf,
    types: Sequence[RecomputeType] = tuple(RecomputeType),
    chunks: int = 1,
) -> RecomputePlan | None:
    """Raise recompute (each step to the next of ``types``) of the micro-batches whose memory the
    ops above the limit count, re-simulating after each round, until the schedule fits.

    A round brings every op above the limit under it, worst first (:func:`_raise_recompute`).
    Where what a stage holds can be lightened no further, a schedule that follows the timeline
    (wait-free-cyclic) stops filling stages past the limit instead (``strict_memory``); fixed
    orders (:class:`~.schedules.FixedSchedule`: 1F1B, GPipe) cannot, and such a plan cannot fit.
    Fast mode stops after FAST_MODE_ROUNDS rounds. Returns None when the plan cannot be made to
    fit, or as soon as its makespan cannot stay at or below ``give_up_above_ms`` (a search's best
    so far): when its lower bound under any raised recompute passes it, or the simulation of the
    current recompute does -- for fixed orders, whose ops only lengthen as recompute rises, and in
    fast mode (a schedule that follows the timeline may end sooner with more recompute).
    ``work_table`` (of these micro-batches, in this order) saves evaluating the cost model.
    ``chunks``: model chunks a rank (``costs`` then per virtual stage, ``recompute`` too), where
    no ``work_table`` says.
    """
    table = work_table or WorkTable(costs, microbatches, chunks)
    recompute = np.array(recompute, dtype=np.int64).reshape(costs.pp, len(microbatches))
    max_rounds = FAST_MODE_ROUNDS if fast_mode else costs.pp * len(microbatches) * len(RecomputeType)
    heavier = _next_types(types)
    schedule = get_schedule(schedule)
    fixed = isinstance(schedule, FixedSchedule)
    rounds, strict = 0, False
    while True:
        if table.makespan_lower_bound(recompute) > give_up_above_ms:
            return None
        work = table.work(recompute)
        if not np.all(np.isfinite(work.forward + work.backward)):
            return None
        result, over = _simulate_or_find_excess(schedule, work, memory_limit_mb, give_up_above_ms, fast_mode, strict)
        if result is not None:
            return RecomputePlan(recompute, result.orders, result, rounds)
        if not over:
            return None  # passed the cutoff
        if rounds == max_rounds:
            return None
        raised, stuck = _raise_recompute(recompute, table, over, memory_limit_mb, heavier)
        if stuck and fixed:
            return None  # fixed orders hold the same micro-batches there, however they are recomputed
        if stuck and not strict:
            strict = True  # what a stage holds cannot be lightened further: fill it only while memory lasts
        elif not raised:
            return None
        rounds += 1


def _simulate_or_find_excess(schedule, work, memory_limit_mb, give_up_above_ms, fast_mode, strict):
    """(the simulation, []) when the schedule fits, (None, the ops above the limit) when it does
    not, (None, []) when it is sure to end after ``give_up_above_ms``."""
    if isinstance(schedule, FixedSchedule):
        # Memory under fixed orders follows from the orders: time them only once they fit. Their
        # ops only lengthen as recompute rises, so that simulation may stop at the cutoff.
        over = over_limit(schedule.orders(work), work, memory_limit_mb)
        return (None, over) if over else (schedule.simulate(work, memory_limit_mb, give_up_above_ms), [])
    # A schedule that follows the timeline may end sooner with more recompute (it then holds less
    # and runs ahead more): only fast mode stops it at the cutoff.
    cut = give_up_above_ms if fast_mode else math.inf
    result = schedule.simulate(work, memory_limit_mb, cut, strict_memory=strict)
    if result is None:
        return None, []
    if result.fits(memory_limit_mb):
        return (result if result.makespan <= give_up_above_ms else None), []
    return None, result.over_limit


def _next_types(types: Sequence[RecomputeType]) -> list[int | None]:
    """Per recompute code, the next heavier code among ``types`` (None past the heaviest)."""
    allowed = sorted(int(rc) for rc in types)
    return [next((a for a in allowed if a > rc), None) for rc in range(len(RecomputeType))]


def _raise_recompute(recompute, table: WorkTable, over_limit: Sequence[OverLimit], memory_limit_mb, heavier
                     ) -> tuple[bool, bool]:
    """One round: bring every op the simulation ran above the limit under it, worst first, by
    raising the recompute of the micro-batches whose memory it counted -- those held and its own
    -- the one that saves the op the most memory per millisecond of backward it adds first. A
    micro-batch raised for one op lightens every later op it is held in. Returns whether anything
    was raised, and whether some op could not be brought under the limit. Where ranks hold
    several model chunks, a stage is a rank and its micro-batches are its chunks' (chunk c's
    micro-batch m is c * n + m), as the simulation lists them."""
    stages = sorted({s for s, *_ in over_limit})
    pp = len(recompute) // table.chunks
    rows = {s: rank_rows(s, pp, table.chunks) for s in stages}

    def flat(name, s):  # [recompute][chunk * n + micro-batch], plain lists: the loops below read scalars
        values = table.tables[name][:, rows[s], :]
        return values.reshape(len(values), -1).tolist()

    stored = {s: flat("stored", s) for s in stages}
    peak = {s: flat("peak", s) for s in stages}
    backward = {s: flat("backward", s) for s in stages}
    level = {s: recompute[rows[s]].reshape(-1).tolist() for s in stages}
    raised = stuck = False
    for s, _, held, m in sorted(over_limit, key=lambda op: -op[1]):
        op = _OpMemory(float(table.state[rows[s]].sum()), stored[s], peak[s], level[s], held, m)
        raises, lightened = op.lighten(memory_limit_mb + MEMORY_TOLERANCE_MB, backward[s], heavier)
        raised |= raises > 0
        stuck |= not lightened
    for s in stages:
        recompute[rows[s]] = np.reshape(level[s], (table.chunks, -1))
    return raised, stuck


@dataclass
class _OpMemory:
    """One op's memory in use under the current recompute levels (which it reads, not copies)."""

    state: float
    stored: list  # [recompute][micro-batch]
    peak: list
    level: list  # [micro-batch] recompute code
    held: tuple[int, ...]
    own: int

    def in_use(self) -> float:
        return (self.state + sum(self.stored[self.level[h]][h] for h in self.held)
                + self.peak[self.level[self.own]][self.own])

    def saving(self, m: int, up: int) -> float:
        """MB this op saves when micro-batch m's recompute rises to ``up``."""
        rc = self.level[m]
        saved = self.stored[rc][m] - self.stored[up][m] if m in self.held else 0.0
        return saved + (self.peak[rc][m] - self.peak[up][m] if m == self.own else 0.0)

    def lighten(self, limit_mb: float, backward, heavier) -> tuple[int, bool]:
        """Raise recompute until this op is within ``limit_mb``, each time of the micro-batch whose
        next recompute type saves it the most memory per millisecond of backward it adds (the
        first so in held order, then its own). Returns how many raises it made, and whether the
        op is within the limit (False: nothing left saves it any).

        Raising one micro-batch changes only its own saving and rate, so the others' are worked
        out once; what is in use falls by each saving, and is summed afresh before any decision
        that a float's rounding could sway."""
        in_use, raises = self.in_use(), 0
        if in_use <= limit_mb:
            return 0, True
        candidates = list(dict.fromkeys((*self.held, self.own)))
        rates = [self._rate(m, backward, heavier) for m in candidates]
        while True:
            best = max(range(len(candidates)), key=rates.__getitem__)
            if rates[best] <= 0.0:
                return raises, False
            m = candidates[best]
            up = heavier[self.level[m]]
            in_use -= self.saving(m, up)
            self.level[m] = up
            raises += 1
            rates[best] = self._rate(m, backward, heavier)
            if in_use <= limit_mb + ROUNDING_MB:
                in_use = self.in_use()
                if in_use <= limit_mb:
                    return raises, True

    def _rate(self, m: int, backward, heavier) -> float:
        """MB this op saves per millisecond of backward added by raising m's recompute one type;
        0 where that saves nothing or m is at the heaviest."""
        up = heavier[self.level[m]]
        if up is None:
            return 0.0
        saving = self.saving(m, up)
        return saving / max(backward[up][m] - backward[self.level[m]][m], 1e-9) if saving > 0 else 0.0
