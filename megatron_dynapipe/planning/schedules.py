"""Pipeline schedules: each turns n micro-batches on pp stages into per-stage op orders.

Micro-batches are numbered in the order they enter the pipeline; every schedule keeps that
order for forwards and the arrival order for backwards on every stage, so the sends and
receives between two stages always pair up in the order they are posted.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Callable

import numpy as np

from megatron_dynapipe.planning.simulator import Order, SimulationResult, StageWork, simulate


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
    return _wait_free(work, memory_limit_mb).orders


def _wait_free(work: StageWork, limit: float, give_up_above_ms: float = math.inf) -> "SimulationResult | None":
    """wait_free_cyclic's timeline (event by event, earliest stage first); None as soon as a
    stage cannot end by give_up_above_ms.

    One loop over local lists on purpose: it runs once per candidate and recompute round, for
    thousands of ops, and method calls and attribute lookups were most of its time. What it
    does per op is Timeline.run's book-keeping (simulator.py), which simulate() shares.
    """
    pp, n, last = work.pp, work.n, work.pp - 1
    forward, backward = work.forward.tolist(), work.backward.tolist()
    stored, peak_of = work.stored.tolist(), work.peak.tolist()
    state, comm = work.state.tolist(), work.comm.tolist()
    remaining = (work.forward.sum(axis=1) + work.backward.sum(axis=1)).tolist()  # each stage's compute to run
    act = [[None] * n for _ in range(pp)]  # when the activation of m is on stage s
    grad = [[None] * n for _ in range(pp)]  # when the gradient of m is on stage s
    last_forward_end = [None] * n  # the last stage's backward of m needs its own forward
    free, link_down, link_up = [0.0] * pp, [0.0] * pp, [0.0] * pp
    held: list[dict[int, float]] = [{} for _ in range(pp)]  # micro-batch -> stored MB
    held_total, peak, peak_mbs = [0.0] * pp, list(state), [()] * pp
    orders: list[Order] = [[] for _ in range(pp)]
    starts: list[list[float]] = [[] for _ in range(pp)]
    ends: list[list[float]] = [[] for _ in range(pp)]
    next_forward = [0] * pp
    backlog = [deque() for _ in range(pp)]  # micro-batches whose gradient is due, FIFO
    wake: list = [0.0] * pp  # when each stage next decides; None: waits for a neighbour
    heap = [(0.0, s) for s in range(pp)]

    def wake_at(s: int, time: float) -> None:
        if time < free[s]:
            time = free[s]
        if wake[s] is None or time < wake[s]:
            wake[s] = time
            heapq.heappush(heap, (time, s))

    for _ in range(2 * pp * n):
        kind = None
        while kind is None:
            if not heap:
                raise RuntimeError("wait-free-cyclic found no runnable op: a micro-batch fits no stage alone")
            now, s = heapq.heappop(heap)
            if wake[s] != now:
                continue  # superseded by an earlier wake-up
            wake[s] = None
            kind, m = _pick(s, now, pp, n, last, act, last_forward_end, grad, held[s], backlog[s], next_forward,
                            state[s] + held_total[s], stored[s], peak_of[s], limit)
            if kind is None:  # sleep until an input it knows of is due; else a neighbour wakes it
                due = [d for d in _inputs_due(s, n, last, act, last_forward_end, grad, backlog[s], next_forward)
                       if d is not None and d > now]
                if due:
                    wake_at(s, min(due))
        start = free[s] if free[s] > now else now
        duration = forward[s][m] if kind == "F" else backward[s][m]
        end = free[s] = start + duration
        in_use = state[s] + held_total[s] + peak_of[s][m]
        if in_use > peak[s]:
            peak[s] = in_use
            peak_mbs[s] = tuple(held[s]) + ((m,) if kind == "F" else ())
        orders[s].append((kind, m))
        starts[s].append(start)
        ends[s].append(end)
        remaining[s] -= duration
        if end + remaining[s] > give_up_above_ms:
            return None
        if kind == "F":
            held[s][m] = stored[s][m]
            held_total[s] += stored[s][m]
            if s < last:
                sent = link_down[s] = (link_down[s] if link_down[s] > end else end) + comm[m]
                act[s + 1][m] = sent
                wake_at(s + 1, sent)
            else:
                last_forward_end[m] = end
                backlog[s].append(m)  # the last stage turns straight to its own backward
        else:
            held_total[s] -= held[s].pop(m)
            if s > 0:
                sent = link_up[s] = (link_up[s] if link_up[s] > end else end) + comm[m]
                grad[s - 1][m] = sent
                backlog[s - 1].append(m)
                wake_at(s - 1, sent)
        wake_at(s, end)
    return SimulationResult(makespan=max(free) if n else 0.0, peak_memory=np.array(peak), orders=orders,
                            peak_microbatches=peak_mbs, op_starts=starts, op_ends=ends)


def _pick(s, now, pp, n, last, act, last_forward_end, grad, held, backlog, next_forward, in_use, stored, peak,
          limit):
    """Keep 1F1B's pp - s micro-batches in flight first (a starved pipeline idles downstream),
    then backwards, then extra forwards while memory lasts: (kind, micro-batch) or (None, None)."""
    m = next_forward[s]
    ready = (0.0 if s == 0 else act[s][m]) if m < n else None
    forward_due = ready is not None and ready <= now
    if forward_due and len(held) < pp - s:
        next_forward[s] += 1
        return "F", m
    if backlog:
        b = backlog[0]
        ready = last_forward_end[b] if s == last else grad[s][b]
        if ready is not None and ready <= now:
            return "B", backlog.popleft()
    if forward_due:
        # Admit m only if every op until the next free still fits: m's forward, and the
        # backward of any held micro-batch, which then runs with m's activations held too.
        transient = max(peak[m], max(peak[h] for h in held)) if held else peak[m]
        if in_use + stored[m] + transient <= limit:
            next_forward[s] += 1
            return "F", m
    return None, None


def _inputs_due(s, n, last, act, last_forward_end, grad, backlog, next_forward) -> list:
    """When the inputs of stage s's next backward and next forward arrive (None: not yet known)."""
    due = [last_forward_end[backlog[0]] if s == last else grad[s][backlog[0]]] if backlog else []
    if next_forward[s] < n:
        due.append(0.0 if s == 0 else act[s][next_forward[s]])
    return due


SCHEDULES: dict[str, Callable[[StageWork, float], list[Order]]] = {
    "1f1b": one_f_one_b,
    "wait-free-cyclic": wait_free_cyclic,
}


def simulate_schedule(name: str, work: StageWork, memory_limit_mb: float,
                      give_up_above_ms: float = math.inf) -> "SimulationResult | None":
    """Orders of schedule `name` and their simulated timeline. wait-free-cyclic returns None as
    soon as its makespan is sure to exceed `give_up_above_ms` (1F1B's fixed orders run to the end)."""
    if name == "wait-free-cyclic":
        return _wait_free(work, memory_limit_mb, give_up_above_ms)  # the greedy already simulated them
    return simulate(SCHEDULES[name](work, memory_limit_mb), work)
