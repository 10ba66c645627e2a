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

from .simulator import Order, SimulationResult, StageWork, Timeline, simulate


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
    return _WaitFree(work, memory_limit_mb).run().orders


class _WaitFree:
    def __init__(self, work: StageWork, memory_limit_mb: float, give_up_above_ms: float = math.inf):
        self.t = Timeline(work, record=False)
        self.give_up_above_ms = give_up_above_ms
        # each stage's compute still to run: it cannot end before it is free plus that
        self.remaining = (work.forward.sum(axis=1) + work.backward.sum(axis=1)).tolist()
        self.pp, self.n = work.pp, work.n
        self.limit = memory_limit_mb
        self.next_forward = [0] * work.pp
        self.backlog = [deque() for _ in range(work.pp)]  # micro-batches whose gradient is due, FIFO
        self.wake: list[float | None] = [0.0] * work.pp  # when each stage next decides; None: waits
        self.heap = [(0.0, s) for s in range(work.pp)]

    def run(self) -> "SimulationResult | None":
        """The simulated policy's timeline; None as soon as a stage cannot end by give_up_above_ms."""
        t, heap, wake = self.t, self.heap, self.wake
        remaining, give_up = self.remaining, self.give_up_above_ms
        done, total = 0, 2 * self.pp * self.n
        while done < total:
            if not heap:
                raise RuntimeError("wait-free-cyclic found no runnable op: a micro-batch fits no stage alone")
            now, s = heapq.heappop(heap)
            if wake[s] != now:
                continue  # superseded by an earlier wake-up
            wake[s] = None
            op = self._pick(s, now)
            if op is None:
                self._sleep(s, now)
                continue
            kind, m = op
            end = t.run(s, kind, m, now)
            remaining[s] -= t.forward[s][m] if kind == "F" else t.backward[s][m]
            if end + remaining[s] > give_up:
                return None
            done += 1
            self._notify(s, kind, m)
            self._schedule(s, end)
        return t.result()

    def _schedule(self, s: int, time: float) -> None:
        free = self.t.stage_free[s]
        if time < free:
            time = free
        current = self.wake[s]
        if current is None or time < current:
            self.wake[s] = time
            heapq.heappush(self.heap, (time, s))

    def _pick(self, s: int, now: float):
        """Keep 1F1B's pp - s micro-batches in flight first (a starved pipeline idles
        downstream), then backwards, then extra forwards while memory lasts."""
        t = self.t
        m = self.next_forward[s]
        ready = t.input_ready(s, "F", m) if m < self.n else None
        forward_due = ready is not None and ready <= now
        held = t.held[s]
        if forward_due and len(held) < self.pp - s:
            self.next_forward[s] += 1
            return "F", m
        backlog = self.backlog[s]
        if backlog:
            ready = t.input_ready(s, "B", backlog[0])
            if ready is not None and ready <= now:
                return "B", backlog.popleft()
        if forward_due:
            # Admit m only if every op until the next free still fits: m's forward, and the
            # backward of any held micro-batch, which then runs with m's activations held too.
            peak = t.peak_of[s]
            transient = max(peak[m], max(peak[h] for h in held)) if held else peak[m]
            if t.state[s] + t.held_total[s] + t.stored[s][m] + transient <= self.limit:
                self.next_forward[s] += 1
                return "F", m
        return None

    def _sleep(self, s: int, now: float) -> None:
        """Wake s when an input it knows of is due; otherwise a neighbour's op will wake it."""
        t = self.t
        due = [t.input_ready(s, "B", self.backlog[s][0])] if self.backlog[s] else []
        if self.next_forward[s] < self.n:
            due.append(t.input_ready(s, "F", self.next_forward[s]))
        future = [d for d in due if d is not None and d > now]
        if future:
            self._schedule(s, min(future))

    def _notify(self, s: int, kind: str, m: int) -> None:
        """Queue what the op makes runnable and wake the stage that runs it."""
        if kind == "F" and s < self.pp - 1:
            self._schedule(s + 1, self.t.act_arrival[s + 1][m])
        elif kind == "F":
            self.backlog[s].append(m)  # the last stage turns straight to its own backward
        elif s > 0:
            self.backlog[s - 1].append(m)
            self._schedule(s - 1, self.t.grad_arrival[s - 1][m])


SCHEDULES: dict[str, Callable[[StageWork, float], list[Order]]] = {
    "1f1b": one_f_one_b,
    "wait-free-cyclic": wait_free_cyclic,
}


def simulate_schedule(name: str, work: StageWork, memory_limit_mb: float,
                      give_up_above_ms: float = math.inf) -> "SimulationResult | None":
    """Orders of schedule `name` and their simulated timeline. wait-free-cyclic returns None as
    soon as its makespan is sure to exceed `give_up_above_ms` (1F1B's fixed orders run to the end)."""
    if name == "wait-free-cyclic":
        return _WaitFree(work, memory_limit_mb, give_up_above_ms).run()  # the greedy already simulated them
    return simulate(SCHEDULES[name](work, memory_limit_mb), work)
