"""Recompute-plan adjustment: raise recomputation where a schedule exceeds memory."""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import itemgetter
from typing import Callable, Optional, Sequence

import numpy as np

from megatron_dynapipe.planning.cost_model import StageCosts
from megatron_dynapipe.planning.fast_mode import NORMAL, SearchBudget
from megatron_dynapipe.planning.schedules import FixedSchedule, Schedule, get_schedule
from megatron_dynapipe.planning.simulator import (
    MEMORY_TOLERANCE_MB,
    Order,
    OrderIndex,
    OverLimit,
    SimulationResult,
    WorkTable,
    over_limit,
    rank_rows,
)
from megatron_dynapipe.planning.types import MicroBatch, RecomputeType

#: ops a recompute round lightens on a rank before it first asks whether the plan can still beat
#: the search's best (a lower bound: 0.4 ms at 4096 samples on 4 x 4 virtual stages, where an op
#: lightens in about 10 us)
BOUND_CHECK_OPS = 256
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
    budget: SearchBudget = NORMAL,
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
    ``budget`` bounds the rounds (:meth:`~.fast_mode.SearchBudget.recompute_rounds`). Returns None
    when the plan cannot be made to fit, or as soon as its makespan cannot stay at or below
    ``give_up_above_ms`` (a search's best so far): when its lower bound under any raised recompute passes it, or the simulation of the
    current recompute does -- for fixed orders, whose ops only lengthen as recompute rises, and in
    fast mode (a schedule that follows the timeline may end sooner with more recompute).
    ``work_table`` (of these micro-batches, in this order) saves evaluating the cost model.
    ``chunks``: model chunks a rank (``costs`` then per virtual stage, ``recompute`` too), where
    no ``work_table`` says.
    """
    table = work_table or WorkTable(costs, microbatches, chunks)
    recompute = np.array(recompute, dtype=np.int64).reshape(costs.pp, len(microbatches))
    max_rounds = budget.recompute_rounds(costs.pp, len(microbatches))
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
        result, excess = _simulate_or_find_excess(schedule, work, memory_limit_mb, give_up_above_ms, budget, strict)
        if result is not None:
            return RecomputePlan(recompute, result.orders, result, rounds)
        if excess is None:
            return None  # passed the cutoff
        if rounds == max_rounds:
            return None
        past = None if give_up_above_ms == math.inf else \
            (lambda: table.makespan_lower_bound(recompute) > give_up_above_ms)
        raised, stuck = _raise_recompute(recompute, table, *excess, memory_limit_mb, heavier, past)
        if stuck and fixed:
            return None  # fixed orders hold the same micro-batches there, however they are recomputed
        if stuck and not strict:
            strict = True  # what a stage holds cannot be lightened further: fill it only while memory lasts
        elif not raised:
            return None
        rounds += 1


def _simulate_or_find_excess(schedule, work, memory_limit_mb, give_up_above_ms, budget: SearchBudget, strict):
    """(the simulation, None) when the schedule fits, (None, (the orders, their ops above the
    limit)) when it does not, (None, None) when it is sure to end after ``give_up_above_ms``."""
    if isinstance(schedule, FixedSchedule):
        # Memory under fixed orders follows from the orders: time them only once they fit. Their
        # ops only lengthen as recompute rises, so that simulation may stop at the cutoff.
        orders = schedule.indexes(work.pp, work.n, work.chunks)
        over = over_limit(orders, work, memory_limit_mb)
        return (None, (orders, over)) if over else (schedule.simulate(work, memory_limit_mb, give_up_above_ms), None)
    # A schedule that follows the timeline may end sooner with more recompute (it then holds less
    # and runs ahead more): only fast mode stops it at the cutoff.
    cut = give_up_above_ms if budget.cuts_hopeless_simulations else math.inf
    result = schedule.simulate(work, memory_limit_mb, cut, strict_memory=strict)
    if result is None:
        return None, None
    if result.fits(memory_limit_mb):
        return (result if result.makespan <= give_up_above_ms else None), None
    return None, ([OrderIndex.of(order, work.n, work.chunks) for order in result.orders], result.over_limit)


def _next_types(types: Sequence[RecomputeType]) -> list[int | None]:
    """Per recompute code, the next heavier code among ``types`` (None past the heaviest)."""
    allowed = sorted(int(rc) for rc in types)
    return [next((a for a in allowed if a > rc), None) for rc in range(len(RecomputeType))]


def _raise_recompute(recompute, table: WorkTable, orders: Sequence[OrderIndex], over_limit: Sequence[OverLimit],
                     memory_limit_mb, heavier, past: Optional[Callable[[], bool]] = None) -> tuple[bool, bool]:
    """One round: bring every op the simulation ran above the limit under it, worst first, by
    raising the recompute of the micro-batches whose memory it counted -- those held and its own
    -- the one that saves the op the most memory per millisecond of backward it adds first. A
    micro-batch raised for one op lightens every later op it is held in. Returns whether anything
    was raised, and whether some op could not be brought under the limit. Where ranks hold
    several model chunks, a stage is a rank and its micro-batches are its chunks' (chunk c's
    micro-batch m is c * n + m), as the simulation lists them.

    Ranks raise apart, so their order changes nothing but when ``past()`` (the plan's lower bound
    has passed the search's cutoff) turns true: then the round stops, since raising more only adds
    time. The busiest rank goes first, its raises moving the bound most, and ``past`` is asked
    after BOUND_CHECK_OPS ops lightened, twice as many, four times, ...: a candidate that cannot
    beat the best so far is dropped a few hundred ops into its round, not after the thousands of
    every rank's, and a round that keeps the cutoff asks a few times a rank."""
    pp = len(recompute) // table.chunks
    ops_of: dict[int, list[tuple[float, int]]] = {}
    for s, used, position in over_limit:
        ops_of.setdefault(s, []).append((used, position))
    raised = stuck = False
    heavier = [-1 if up is None else up for up in heavier]
    busy = _rank_busy_ms(table, recompute, pp)
    for s in sorted(ops_of, key=lambda s: -busy[s]):
        rows = rank_rows(s, pp, table.chunks)

        def per_key(name):  # [recompute, key]
            values = table.tables[name][:, rows, :]
            return values.reshape(len(values), -1)

        rank = _RankMemory(orders[s], float(table.state[rows].sum()), per_key("stored"), per_key("peak"),
                           per_key("backward"), recompute[rows].reshape(-1), heavier)
        limit = memory_limit_mb + MEMORY_TOLERANCE_MB
        in_use, clearly_within = rank.in_use, limit - ROUNDING_MB
        ops = sorted(ops_of[s], key=itemgetter(0), reverse=True)  # worst first; ties in the order they ran
        lightened_ops, check_at = 0, BOUND_CHECK_OPS
        for _, position in ops:
            if in_use[position] < clearly_within:  # an earlier raise lightened it: lighten() would do nothing
                continue
            raises, lightened = rank.lighten(position, limit)
            raised |= raises > 0
            stuck |= not lightened
            lightened_ops += 1
            if past is not None and lightened_ops == check_at:
                check_at *= 2
                recompute[rows] = np.reshape(rank.level, (table.chunks, -1))
                if past():
                    return raised, stuck
        recompute[rows] = np.reshape(rank.level, (table.chunks, -1))
    return raised, stuck


def _rank_busy_ms(table: WorkTable, recompute: np.ndarray, pp: int) -> np.ndarray:
    """[rank] the least compute each rank's ops take under ``recompute`` (its chunks' together)."""
    forward, backward = table.floor_times(recompute)
    return (forward + backward).sum(axis=1).reshape(-1, pp).sum(axis=0)


class _RankMemory:
    """What one rank holds at each op of its ``order``, under recompute levels that lightening its
    ops raises: ``level`` [key] (a key is ``chunk * n + micro-batch``), and what each op has in use,
    kept up to date as levels rise (to within rounding: an op's memory is summed afresh where
    that decides anything). ``stored``, ``peak`` and ``backward`` are [recompute, key];
    ``heavier`` [code] the next recompute code up, -1 past the heaviest."""

    def __init__(self, order: OrderIndex, state: float, stored: np.ndarray, peak: np.ndarray, backward: np.ndarray,
                 level: np.ndarray, heavier: list[int]):
        keys, level = np.arange(len(level)), np.asarray(level, dtype=np.int64)
        self.state, self.order, self.heavier = state, order, heavier
        self.in_use = order.in_use(state, stored[level, keys], peak[level, keys])  # [op]
        # what raising a key one type saves any op that holds it, per millisecond of backward added
        # (as _rate works it out, for every key at once)
        up = np.asarray(heavier)[level]
        top, up = up < 0, np.where(up < 0, level, up)
        saving = stored[level, keys] - stored[up, keys]
        added = np.maximum(backward[up, keys] - backward[level, keys], 1e-9)
        self.held_rate = np.where(top | ~(saving > 0), 0.0, saving / added).tolist()
        # plain lists from here: the loops below read and write scalars
        self.level, self.stored, self.peak, self.backward = level.tolist(), stored.tolist(), peak.tolist(), \
            backward.tolist()
        self.ops = order.lists

    def lighten(self, position: int, limit_mb: float) -> tuple[int, bool]:
        """Raise recompute until the op at ``position`` is within ``limit_mb``, each time of the
        micro-batch whose next recompute type saves it the most memory per millisecond of
        backward it adds (the first so in held order, then its own). Returns how many raises it
        made, and whether the op is within the limit (False: nothing left saves it any).

        Raising one micro-batch changes only its own saving and rate, so the others' are worked
        out once."""
        if self._within(position, limit_mb):
            return 0, True
        own, held = self.ops.key[position], self.order.held_at(position)
        rates = [self.held_rate[k] for k in held]
        if self.ops.forward[position]:  # its own micro-batch is not held yet
            candidates = held + [own]
            rates.append(self._rate(own, False, True))
        else:
            candidates = held
            rates[held.index(own)] = self._rate(own, True, True)
        n_held = len(held)
        raises = 0
        while True:
            top = max(rates)
            if top <= 0.0:
                return raises, False
            best = rates.index(top)  # the first so
            m = candidates[best]
            self._raise(m)
            raises += 1
            rates[best] = self._rate(m, best < n_held, m == own)
            if self._within(position, limit_mb):
                return raises, True

    def _within(self, position: int, limit_mb: float) -> bool:
        """Whether the op at ``position`` is within ``limit_mb``: summed afresh where a float's
        rounding in keeping it up to date could sway that."""
        in_use = float(self.in_use[position])
        if abs(in_use - limit_mb) > ROUNDING_MB:
            return in_use < limit_mb
        own, level, stored = self.ops.key[position], self.level, self.stored
        summed = sum(stored[level[h]][h] for h in self.order.held_at(position))
        return self.state + summed + self.peak[level[own]][own] <= limit_mb

    def _rate(self, key: int, held: bool, own: bool) -> float:
        """MB an op saves per millisecond of backward added by raising ``key``'s recompute one
        type (what it stores, if the op holds it, and its transient, if it is the op's own); 0
        where that saves nothing or it is at the heaviest."""
        now = self.level[key]
        up = self.heavier[now]
        if up < 0:
            return 0.0
        saving = self.stored[now][key] - self.stored[up][key] if held else 0.0
        saving += self.peak[now][key] - self.peak[up][key] if own else 0.0
        return saving / max(self.backward[up][key] - self.backward[now][key], 1e-9) if saving > 0 else 0.0

    def _raise(self, key: int) -> None:
        """Raise ``key``'s recompute one type: every op that holds it, or is its own, lightens."""
        now = self.level[key]
        up = self.heavier[now]
        first, last = self.ops.first[key], self.ops.last[key]
        self.in_use[first + 1:last + 1] -= self.stored[now][key] - self.stored[up][key]
        transient = self.peak[now][key] - self.peak[up][key]
        self.in_use[first] -= transient
        self.in_use[last] -= transient
        self.level[key] = up
        self.held_rate[key] = self._rate(key, True, False)
