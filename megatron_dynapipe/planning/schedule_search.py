"""The schedule search of one data-parallel rank: candidates (schedule x micro-batching x entry
order), simulated by branch and bound and made to fit memory by recompute adjustment, and the
chosen one lowered to per-stage execution plans. :mod:`.planner` makes the micro-batchings and
runs this search for every rank.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_dynapipe.planning.cost_model import StageCosts
from megatron_dynapipe.planning.fast_mode import NORMAL, SearchBudget
from megatron_dynapipe.planning.microbatching import fill_weight
from megatron_dynapipe.planning.plan import ExecutionPlan, build_execution_plans
from megatron_dynapipe.planning.recompute import RecomputePlan, adjust_rc_plan
from megatron_dynapipe.planning.schedules import DEFAULT_SCHEDULES, check_chunks, fast_mode_schedules, get_schedule
from megatron_dynapipe.planning.simulator import SimulationResult, WorkTable, simulate, stage_work
from megatron_dynapipe.planning.types import MicroBatch, RecomputeType

PERMUTATION_GROUPS = 3  # micro-batches are ordered as whole groups of similar cost
# Entry orders tried per micro-batching: no more than fit a budget of simulated micro-batches
# (an order matters less the more micro-batches there are), nor fewer than FEWEST_ORDERS.
ORDERS_BUDGET = 1024
FEWEST_ORDERS = 3


class PlanningError(ValueError):
    """The batch cannot be planned under the given layout and memory limit."""


@dataclass(frozen=True)
class Microbatching:
    """Micro-batches of one rank and the recompute each was sized for."""

    label: str  # the recompute types the partition assumed, e.g. "full" or "mixed"
    microbatches: tuple[MicroBatch, ...]
    recompute: tuple[RecomputeType, ...]


@dataclass(frozen=True)
class Candidate:
    """One point of the search: a schedule over micro-batches in a given order."""

    schedule: str
    microbatching: str
    order: tuple[int, ...]  # entry order, as indices into the micro-batching
    microbatches: tuple[MicroBatch, ...]  # in pipeline entry order
    recompute: tuple[RecomputeType, ...]  # per micro-batch; adjust_rc_plan raises it where needed


@dataclass
class ScheduleChoice:
    """The best candidate of one data-parallel rank after simulation and recompute adjustment."""

    candidate: Candidate
    recompute: np.ndarray  # [pp, n]
    orders: list
    simulation: SimulationResult
    candidates_tried: int

    @property
    def makespan_ms(self) -> float:
        return self.simulation.makespan

    @property
    def microbatches(self) -> tuple[MicroBatch, ...]:
        return self.candidate.microbatches

    @property
    def chunks(self) -> int:
        """Model chunks a rank (recompute has a row per virtual stage, orders one per rank)."""
        return len(self.recompute) // len(self.orders)


def predicted_iteration_ms(costs: StageCosts, microbatching: Microbatching, chunks: int = 1) -> float:
    """The micro-batching objective: sum of bottleneck times plus (pp - 1) / chunks times the
    largest (:func:`~.microbatching.partition_dp`)."""
    return predicted_iterations_ms(costs, [microbatching], chunks)[0]


def predicted_iterations_ms(costs: StageCosts, microbatchings: Sequence[Microbatching], chunks: int = 1) -> list[float]:
    """:func:`predicted_iteration_ms` of each of ``microbatchings``, their micro-batches priced in one
    query of the cost model (a query's fixed cost was half of a 4K batch's packed planning when
    32 rows-dealings of each rank were priced one by one)."""
    times = _times(costs, [mb for m in microbatchings for mb in m.microbatches],
                   [rc for m in microbatchings for rc in m.recompute])
    weight = fill_weight(costs.pp, chunks)
    ends = np.cumsum([len(m.microbatches) for m in microbatchings])[:-1]
    # no pipeline to fill (PP 1) weighs nothing, a micro-batch the cost model cannot run included (not 0 x inf)
    return [float(t.sum() + (weight * t.max() if weight else 0.0)) for t in np.split(times, ends)]


def _times(costs, microbatches, recompute) -> np.ndarray:
    """Bottleneck-stage time of each micro-batch under its own recompute type."""
    return _times_by_type(costs, microbatches)[np.array(recompute, dtype=np.int64), np.arange(len(microbatches))]


def _times_by_type(costs, microbatches) -> np.ndarray:
    """Bottleneck-stage time of each micro-batch under every recompute type, [type, micro-batch]:
    the same query as the work table's (simulator.WorkTable), answered once."""
    stages = costs.of_microbatches(microbatches, tuple(RecomputeType), costs.worst_stages())
    return np.max(stages["forward"] + stages["backward"], axis=1)


def _unpriced(microbatchings: Sequence[Microbatching], costs: StageCosts) -> "MicroBatch | None":
    """A micro-batch the cost model prices under no recompute type, where every micro-batching
    holds one (then what failed is the pricing, not the memory)."""
    found = None
    for m in microbatchings:
        unpriced = np.isinf(_times_by_type(costs, m.microbatches)).all(axis=0)
        if not unpriced.any():
            return None
        found = found or m.microbatches[int(np.argmax(unpriced))]
    return found


def build_candidates(
    microbatchings: Sequence[Microbatching],
    costs: StageCosts,
    budget: SearchBudget = NORMAL,
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
    seed: int = 0,
    max_permutations: int = 8,
    chunks: int = 1,
) -> list[Candidate]:
    """Schedule x micro-batching x order (:func:`orders_to_try` of them). Fast mode schedules
    :func:`~.schedules.fast_mode_schedules`: wait-free-cyclic when it is allowed, and 1F1B too
    where a micro-batching does not fill the pipeline. With ``chunks`` model chunks a rank
    (``costs`` per virtual stage), every schedule must be an interleaved one."""
    for name in schedules:
        check_chunks(get_schedule(name), chunks)
    out = []
    for option in microbatchings:
        names = (fast_mode_schedules(tuple(schedules), len(option.microbatches), costs.pp // chunks)
                 if budget.narrows_schedules else schedules)
        count = orders_to_try(len(option.microbatches), max_permutations)
        for order in microbatch_orders(option, costs, seed, count, spread=chunks > 1):
            out += [Candidate(name, option.label, order, tuple(option.microbatches[i] for i in order),
                              tuple(option.recompute[i] for i in order)) for name in names]
    return out


def orders_to_try(microbatches: int, max_permutations: int) -> int:
    """Entry orders to schedule a micro-batching of ``microbatches`` in: ``max_permutations``
    while their simulations stay within ORDERS_BUDGET micro-batches, down to FEWEST_ORDERS. On
    the built-in mixes (1024-16384 samples) the orders past the third never gave a shorter plan;
    on 8-16 samples they gave up to 3%."""
    return min(max_permutations, max(FEWEST_ORDERS, ORDERS_BUDGET // max(microbatches, 1)))


def microbatch_orders(option: Microbatching, costs: StageCosts, seed: int, max_permutations: int,
                      spread: bool = False) -> list[tuple[int, ...]]:
    """Bounded, deterministic set of entry orders (as index tuples into the micro-batching).

    First the "mountain" order (cost rising to the middle, then falling); then micro-batches are
    split by predicted time into up to three groups of consecutive cost and every order of the
    groups is a candidate (cheapest-first, most-expensive-first, ...); when more orders are
    allowed than that, seeded shuffles fill up. With ``spread``, one more: the costliest and the
    cheapest in turn (:func:`spread_order`). Orders that put micro-batches of the same shapes and
    recompute in the same places are one plan to the search, priced once: the first is kept (65,536
    equal samples made six candidates of one, and six recompute adjustments of 1.5 s).
    """
    by_time = np.argsort(_times(costs, option.microbatches, option.recompute), kind="stable")
    groups = [g for g in np.array_split(by_time, PERMUTATION_GROUPS) if len(g)]
    kind_ids: dict[tuple, int] = {}
    kinds = np.array([kind_ids.setdefault((mb.size, mb.seq_len, mb.packed_lengths, rc), len(kind_ids))
                      for mb, rc in zip(option.microbatches, option.recompute)], dtype=np.int64)
    orders: list[tuple[int, ...]] = []
    seen: set[bytes] = set()

    def offer(order, room: float = max_permutations) -> None:
        order = np.asarray(order, dtype=np.int64)
        shapes = kinds[order].tobytes()
        if len(orders) < room and shapes not in seen:
            seen.add(shapes)
            orders.append(tuple(order.tolist()))

    # Mountain first: cheap micro-batches at both ends shorten the pipeline's fill and drain.
    offer(np.concatenate([by_time[::2], by_time[1::2][::-1]]))
    for perm in itertools.permutations(range(len(groups))):
        offer([i for g in perm for i in groups[g]])
    rng = np.random.default_rng(seed)
    for _ in range(2 * max(0, max_permutations - len(orders))):
        if len(orders) >= max_permutations:
            break
        offer(rng.permutation(by_time))
    if spread:
        offer(spread_order(by_time), room=math.inf)
    return orders


def spread_order(by_time: np.ndarray) -> tuple[int, ...]:
    """The costliest, the cheapest, the next costliest, the next cheapest, ...: no run of
    consecutive micro-batches holds more than half (rounded up) from the costlier half. An
    interleaved rank holds a long run at once (2 (pp - s - 1) + (V - 1) pp chunk-forwards, and
    one more), and the other orders gather the costly ones in one run, which may fit under no
    recompute (256 samples of the `long` mix on GPT-6.7B at PP 4 x 2 chunks did not)."""
    costly, cheap = by_time[::-1][:(len(by_time) + 1) // 2], by_time[:len(by_time) // 2]
    order = np.empty(len(by_time), dtype=np.int64)
    order[0::2], order[1::2] = costly, cheap
    return tuple(order.tolist())


def optimize_schedule(
    microbatchings: Sequence[Microbatching],
    costs: StageCosts,
    memory_limit_mb: float,
    budget: SearchBudget = NORMAL,
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
    seed: int = 0,
    max_permutations: int = 8,
    recompute_types: Sequence[RecomputeType] = tuple(RecomputeType),
    enough_ms: "float | None" = None,
    chunks: int = 1,
) -> ScheduleChoice:
    """Simulate every candidate, make it fit memory with adjust_rc_plan, keep the fastest
    (the first in candidate order among equals).

    Branch and bound: candidates are tried by ascending makespan lower bound, and one whose
    bound exceeds the best makespan found is never simulated (nor are those after it), nor
    is a recompute adjustment carried on once its bound does. The bound holds for any
    recompute the adjustment may raise to, so the choice equals that of simulating them all.
    Fast mode also skips candidates that could improve on the best by at most its
    ``candidate_gap``, so its choice is within that fraction of its exhaustive search's. With
    ``enough_ms`` (what another DP rank's plan takes: the step lasts as long as the slowest), the search stops at the
    first plan that ends by then, which no other could shorten the step below. With ``chunks``
    model chunks a rank, ``costs`` are per virtual stage and the interleaved schedules searched.
    """
    candidates = build_candidates(microbatchings, costs, budget, schedules, seed, max_permutations, chunks)
    tables = {m.label: WorkTable(costs, m.microbatches, chunks) for m in microbatchings
              if any(c.microbatching == m.label for c in candidates)}
    bounds = np.empty(len(candidates))
    for m in microbatchings:
        mine = [i for i, c in enumerate(candidates) if c.microbatching == m.label]
        if mine:
            recompute = np.tile(np.array(m.recompute, dtype=np.int64), (costs.pp, 1))
            bounds[mine] = tables[m.label].order_bounds(recompute, [candidates[i].order for i in mine])
    bounds = bounds.tolist()
    gap = budget.candidate_gap
    best: tuple[float, int, RecomputePlan] | None = None  # (makespan, candidate index, plan)
    for i in sorted(range(len(candidates)), key=bounds.__getitem__):
        if best is not None and enough_ms is not None and best[0] <= enough_ms:
            break
        cutoff = math.inf if best is None else best[0] * (1 - gap)
        if bounds[i] > cutoff:
            break  # so are all later bounds
        candidate = candidates[i]
        table = tables[candidate.microbatching].reordered(candidate.order)
        recompute = np.tile(np.array(candidate.recompute, dtype=np.int64), (costs.pp, 1))
        fitted = adjust_rc_plan(candidate.microbatches, recompute, costs, candidate.schedule, memory_limit_mb,
                                budget, table, give_up_above_ms=cutoff, types=recompute_types)
        if fitted and (best is None or (fitted.simulation.makespan, i) < best[:2]):
            best = (fitted.simulation.makespan, i, fitted)
    if best is None:
        unpriced = _unpriced(microbatchings, costs)
        if unpriced is not None:
            shape = (f"a packed row of {unpriced.seq_len} tokens holding {unpriced.size} sample(s)"
                     if unpriced.packed_lengths else f"{unpriced.size} row(s) of {unpriced.seq_len} tokens")
            raise PlanningError(f"the cost model has no times for micro-batches such as {shape}, under any recompute: "
                                "profile larger shapes (megatron-dynapipe profile --max-tokens, --max-seq-length)")
        raise PlanningError(
            f"no schedule of the {len(microbatchings[0].microbatches)} micro-batches fits {memory_limit_mb:.0f} MB "
            f"even with {max(recompute_types).label} recompute: raise the memory limit or add pipeline/tensor "
            "parallelism" + (f", or hold fewer than {chunks} model chunks a rank (its warm-up holds more micro-batches)"
                             if chunks > 1 else "")
        )
    _, i, fitted = best
    return ScheduleChoice(candidates[i], fitted.recompute, fitted.orders, fitted.simulation, len(candidates))


def execution_plans(choice: ScheduleChoice) -> list[ExecutionPlan]:
    """One ExecutionPlan per stage for the chosen schedule, send FINISHes placed by its simulated
    timeline (orders are FIFO-consistent by construction, so the deadlock proof is left to
    `check_deadlock_free` and the tests)."""
    simulation = choice.simulation
    return build_execution_plans(choice.orders, list(choice.microbatches), choice.recompute,
                                 choice.candidate.schedule, choice.makespan_ms, verify=False,
                                 timeline=(simulation.op_starts, simulation.op_ends),
                                 chunks=choice.chunks)


def resimulate(choice: ScheduleChoice, costs: StageCosts) -> SimulationResult:
    """The chosen plan's timeline with every event recorded (for traces and pictures)."""
    return simulate(choice.orders, stage_work(costs, choice.microbatches, choice.recompute, choice.chunks), record=True)
