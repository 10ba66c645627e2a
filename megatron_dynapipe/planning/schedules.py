"""Pipeline schedules: each turns n micro-batches on pp stages into per-stage op orders.

Micro-batches are numbered in the order they enter the pipeline; every schedule keeps that
order for forwards and the arrival order for backwards on every stage, so the sends and
receives between two stages always pair up in the order they are posted.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable

import numpy as np

from .simulator import Order, SimulationResult, StageWork, _Timeline, simulate


def one_f_one_b(work: StageWork, memory_limit_mb: float) -> list[Order]:
    """Megatron's 1F1B: pp - s - 1 warm-up forwards, then alternate, then drain backwards."""
    pp, n = work.pp, work.n
    orders = []
    for s in range(pp):
        warmup = min(pp - s - 1, n)
        order: Order = [("F", m) for m in range(warmup)]
        for m in range(n - warmup):
            order += [("F", m + warmup), ("B", m)]
        order += [("B", m) for m in range(n - warmup, n)]
        orders.append(order)
    return orders


def cyclic(work: StageWork, memory_limit_mb: float) -> list[Order]:
    """1F1B with memory-sized warm-up: stage s runs as many leading forwards as its memory holds
    (more than 1F1B's pp - s - 1 when micro-batches are small, fewer when they are large), then
    strictly alternates. Warm-ups never grow down the pipeline, which keeps the orders free of
    deadlock (a stage always has sent what the next one waits for)."""
    pp, n = work.pp, work.n
    warmups, previous = [], n
    for s in range(pp):
        warmup = 0 if s == pp - 1 else min(_memory_warmup(work, s, memory_limit_mb), previous)
        warmups.append(warmup)
        previous = warmup
    orders = []
    for s, warmup in enumerate(warmups):
        order: Order = [("F", m) for m in range(warmup)]
        for m in range(n - warmup):
            order += [("F", m + warmup), ("B", m)]
        order += [("B", m) for m in range(n - warmup, n)]
        orders.append(order)
    return orders


def _memory_warmup(work: StageWork, s: int, memory_limit_mb: float) -> int:
    """Largest warm-up w < n such that every w + 1 consecutive micro-batches fit stage s."""
    stored, peak, n = work.stored[s], work.peak[s], work.n
    prefix = np.concatenate([[0.0], np.cumsum(stored)])
    for w in range(n - 1, 0, -1):
        held = prefix[w + 1:] - prefix[:n - w]  # windows of w + 1 micro-batches
        window_peak = np.lib.stride_tricks.sliding_window_view(peak, w + 1).max(axis=1)
        if np.all(work.state[s] + held + window_peak <= memory_limit_mb):
            return w
    return 0


def wait_free_cyclic(work: StageWork, memory_limit_mb: float) -> list[Order]:
    """A stage never idles while it has a runnable op: backwards first, then the next forward
    if its activations fit the memory limit. The orders come from simulating that policy on the
    cost model (event by event, earliest stage first), so each stage admits as many
    micro-batches as its memory holds instead of 1F1B's fixed pp - s.
    """
    return _WaitFree(work, memory_limit_mb).run().orders


class _WaitFree:
    def __init__(self, work: StageWork, memory_limit_mb: float):
        self.t = _Timeline(work, record=False)
        self.work = work
        self.limit = memory_limit_mb
        self.next_forward = [0] * work.pp
        self.backlog = [deque() for _ in range(work.pp)]  # micro-batches whose gradient is due, FIFO
        self.wake: list[float | None] = [0.0] * work.pp  # when each stage next decides; None: waits
        self.heap = [(0.0, s) for s in range(work.pp)]

    def run(self) -> SimulationResult:
        done, total = 0, 2 * self.work.pp * self.work.n
        while done < total:
            if not self.heap:
                raise RuntimeError("wait-free-cyclic found no runnable op: a micro-batch fits no stage alone")
            now, s = heapq.heappop(self.heap)
            if self.wake[s] != now:
                continue  # superseded by an earlier wake-up
            self.wake[s] = None
            op = self._pick(s, now)
            if op is None:
                self._sleep(s, now)
                continue
            kind, m = op
            end = self.t.run(s, kind, m, now)
            done += 1
            self._notify(s, kind, m)
            self._schedule(s, end)
        return self.t.result()

    def _schedule(self, s: int, time: float) -> None:
        time = max(time, self.t.stage_free[s])
        if self.wake[s] is None or time < self.wake[s]:
            self.wake[s] = time
            heapq.heappush(self.heap, (time, s))

    def _due(self, s: int, kind: str, m: int, now: float) -> bool:
        ready = self.t.input_ready(s, kind, m)
        return ready is not None and ready <= now

    def _pick(self, s: int, now: float):
        t, work = self.t, self.work
        if self.backlog[s] and self._due(s, "B", self.backlog[s][0], now):
            return "B", self.backlog[s].popleft()
        m = self.next_forward[s]
        if m < work.n and self._due(s, "F", m, now):
            # Admit m only if every op until the next free still fits: m's forward, and the
            # backward of any held micro-batch, which then runs with m's activations held too.
            transient = max([t.peak_of[s][m]] + [t.peak_of[s][h] for h in t.held[s]])
            need = t.state[s] + t.held_total[s] + t.stored[s][m] + transient
            if need <= self.limit or not t.held[s]:
                self.next_forward[s] += 1
                return "F", m
        return None

    def _sleep(self, s: int, now: float) -> None:
        """Wake s when an input it knows of is due; otherwise a neighbour's op will wake it."""
        due = [self.t.input_ready(s, "B", self.backlog[s][0])] if self.backlog[s] else []
        if self.next_forward[s] < self.work.n:
            due.append(self.t.input_ready(s, "F", self.next_forward[s]))
        future = [d for d in due if d is not None and d > now]
        if future:
            self._schedule(s, min(future))

    def _notify(self, s: int, kind: str, m: int) -> None:
        """Queue what the op makes runnable and wake the stage that runs it."""
        last = self.work.pp - 1
        if kind == "F" and s < last:
            self._schedule(s + 1, self.t.act_arrival[s + 1][m])
        elif kind == "F":
            self.backlog[s].append(m)  # the last stage turns straight to its own backward
        elif s > 0:
            self.backlog[s - 1].append(m)
            self._schedule(s - 1, self.t.grad_arrival[s - 1][m])


SCHEDULES: dict[str, Callable[[StageWork, float], list[Order]]] = {
    "1f1b": one_f_one_b,
    "cyclic": cyclic,
    "wait-free-cyclic": wait_free_cyclic,
}


def simulate_schedule(name: str, work: StageWork, memory_limit_mb: float) -> SimulationResult:
    """Orders of schedule `name` and their simulated timeline."""
    if name == "wait-free-cyclic":
        return _WaitFree(work, memory_limit_mb).run()  # the greedy already simulated them
    return simulate(SCHEDULES[name](work, memory_limit_mb), work)
