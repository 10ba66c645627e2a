"""Pipeline schedules: each turns n micro-batches on pp stages into per-stage op orders.

Micro-batches are numbered in the order they enter the pipeline; every schedule keeps that
order for forwards and the arrival order for backwards on every stage, so the sends and
receives between two stages always pair up in the order they are posted.
"""

from __future__ import annotations

import math
from typing import Callable

from megatron_dynapipe.planning.simulator import Order, SimulationResult, StageWork, run_timeline


def one_f_one_b(work: StageWork, memory_limit_mb: float) -> list[Order]:
    """Megatron's 1F1B: pp - s - 1 warm-up forwards, then alternate, then drain backwards."""
    return one_f_one_b_orders(work.pp, work.n)


def one_f_one_b_orders(pp: int, n: int) -> list[Order]:
    """1F1B's per-stage orders of ``n`` micro-batches on ``pp`` stages (no cost model needed)."""
    orders = []
    for s in range(pp):
        warmup = min(pp - s - 1, n)
        order: Order = [("F", m) for m in range(warmup)]
        for m in range(n - warmup):
            order += [("F", m + warmup), ("B", m)]
        order += [("B", m) for m in range(n - warmup, n)]
        orders.append(order)
    return orders


def wait_free_cyclic(work: StageWork, memory_limit_mb: float) -> list[Order]:
    """A stage never idles while it has a runnable op. It fills up to 1F1B's pp - s micro-batches
    in flight (adjust_rc_plan makes those fit by recompute, which beats idling), otherwise runs a
    due backward, otherwise admits one more forward if its activations fit the memory limit.
    The orders come from simulating that policy on the cost model (event by event, earliest
    stage first), so a stage runs ahead of 1F1B whenever a slow micro-batch holds up backwards.
    """
    return run_timeline(work, memory_limit_mb=memory_limit_mb).orders


SCHEDULES: dict[str, Callable[[StageWork, float], list[Order]]] = {
    "1f1b": one_f_one_b,
    "wait-free-cyclic": wait_free_cyclic,
}


def simulate_schedule(name: str, work: StageWork, memory_limit_mb: float,
                      give_up_above_ms: float = math.inf, strict_memory: bool = False) -> "SimulationResult | None":
    """Orders of schedule `name` and their simulated timeline, every op that ran above the memory
    limit listed (``over_limit``); None as soon as the makespan is sure to exceed
    `give_up_above_ms`. wait-free-cyclic with ``strict_memory`` stays within the limit while it
    fills a stage."""
    if name == "wait-free-cyclic":
        return run_timeline(work, memory_limit_mb=memory_limit_mb, give_up_above_ms=give_up_above_ms,
                            report_over_mb=memory_limit_mb, strict_memory=strict_memory)
    return run_timeline(work, orders=SCHEDULES[name](work, memory_limit_mb), give_up_above_ms=give_up_above_ms,
                        report_over_mb=memory_limit_mb)
