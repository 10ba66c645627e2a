"""What a pipeline schedule provides to the planner (docs/schedules.md has a worked example).

A schedule turns ``n`` micro-batches on ``pp`` stages into one *order* per stage: the stage's
compute ops, each an :class:`~megatron_dynapipe.planning.types.Action` (forward or backward of a
micro-batch), in the order the stage runs them. Every part of the planner reads a schedule
through this contract alone -- the search (:mod:`..planner`), recompute adjustment
(:mod:`..recompute`), the simulator and lowering -- so a new schedule is one module and one
entry in the registry (:data:`megatron_dynapipe.planning.schedules.SCHEDULES`).

Every order must be *FIFO-consistent*: each stage runs the forwards in entry order (0 .. n-1)
and the backwards in entry order too (interleaved: on each chunk, and with activations -- and
gradients -- received on each link in the order they were sent). Sends and receives between two
stages carry no tags and pair up in the order they are posted, and lowering's deadlock proof
rests on it (:mod:`..plan.lowering`); ``build_execution_plans(..., verify=True)`` checks both.
"""

from __future__ import annotations

import abc
import functools
import math
from typing import ClassVar

from megatron_dynapipe.planning.simulator import (Order, OrderIndex, SimulationResult, StageWork, check_orders,
                                                  run_timeline)


class Schedule(abc.ABC):
    """A pipeline schedule: per-stage orders, and their simulation on a cost model's work.

    1F1B on two stages and three micro-batches, its forward taking one unit and its backward two
    (``OneFOneB().orders_for(2, 3)``: ``F0 F1 B0 F2 B1 B2`` and ``F0 B0 F1 B1 F2 B2``)::

        time      0   1   2   3   4   5   6   7   8   9  10  11
        stage 0   F0  F1  .   .   B0  B0  F2  B1  B1  .   B2  B2
        stage 1   .   F0  B0  B0  F1  B1  B1  F2  B2  B2  .   .
    """

    #: the name the planner's ``schedules``, ``--dynapipe-schedule`` and plans know it by
    name: ClassVar[str]
    #: whether the planner searches it when not told which schedules to use
    searched_by_default: ClassVar[bool] = True
    #: whether it runs several model chunks a rank (``StageWork.chunks``); the others run one
    interleaved: ClassVar[bool] = False

    @abc.abstractmethod
    def simulate(self, work: StageWork, memory_limit_mb: float, give_up_above_ms: float = math.inf,
                 strict_memory: bool = False) -> "SimulationResult | None":
        """The orders and their simulated timeline, every op that ran above ``memory_limit_mb``
        listed (``over_limit``: what recompute adjustment lightens); None as soon as the makespan
        is sure to exceed ``give_up_above_ms``. ``strict_memory``: stay within the limit where the
        schedule can choose (recompute adjustment asks once raising recompute cannot help)."""

    def orders(self, work: StageWork, memory_limit_mb: float) -> list[Order]:
        """The per-stage orders on this work."""
        result = self.simulate(work, memory_limit_mb)
        assert result is not None  # no cutoff was given
        return result.orders


class FixedSchedule(Schedule):
    """A schedule whose orders follow from ``pp`` and ``n`` alone, whatever the micro-batches
    cost. The memory its stages hold then follows from the orders without timing them, and
    raising recompute only lengthens its ops: recompute adjustment relies on both."""

    @abc.abstractmethod
    def stage_order(self, stage: int, pp: int, n: int, chunks: int = 1) -> Order:
        """Stage ``stage``'s order of ``n`` micro-batches on ``pp`` stages (ranks, each running
        ``chunks`` model chunks where the schedule is interleaved)."""

    def orders_for(self, pp: int, n: int, chunks: int = 1) -> list[Order]:
        """Every stage's order, no cost model needed."""
        return [list(order) for order in self._orders(pp, n, chunks)]

    @functools.lru_cache(maxsize=4)
    def _orders(self, pp: int, n: int, chunks: int) -> tuple[tuple, ...]:
        # made once: a search asks for the same orders candidate after candidate
        check_chunks(self, chunks)
        orders = tuple(tuple(self.stage_order(s, pp, n, chunks)) for s in range(pp))
        check_orders(orders)
        return orders

    def orders(self, work: StageWork, memory_limit_mb: float = math.inf) -> list[Order]:
        return self.orders_for(work.pp, work.n, work.chunks)

    @functools.lru_cache(maxsize=4)
    def indexes(self, pp: int, n: int, chunks: int = 1) -> list[OrderIndex]:
        """Every stage's order as arrays (what recompute adjustment reads, round after round)."""
        return [OrderIndex.of(order, n, chunks) for order in self._orders(pp, n, chunks)]

    def simulate(self, work: StageWork, memory_limit_mb: float, give_up_above_ms: float = math.inf,
                 strict_memory: bool = False) -> "SimulationResult | None":
        return run_timeline(work, orders=self.orders(work), give_up_above_ms=give_up_above_ms,
                            report_over_mb=memory_limit_mb)


def check_chunks(schedule: Schedule, chunks: int) -> None:
    """ValueError unless ``schedule`` runs ``chunks`` model chunks a rank."""
    if chunks != 1 and not schedule.interleaved:
        raise ValueError(f"schedule {schedule.name!r} runs one model chunk a rank, not {chunks}: "
                         "use an interleaved schedule (interleaved-1f1b)")
    if chunks < 1:
        raise ValueError(f"{chunks} model chunks a rank: use at least 1")
