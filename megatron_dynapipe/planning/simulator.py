"""Event simulation of a pipeline schedule on a cost model.

Each stage has one compute stream; activations and gradients travel on separate per-link
communication streams, so a transfer overlaps the next computation. The simulator turns
per-stage orders of compute ops into start/end times, the makespan and per-stage peak memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from megatron_dynapipe.planning.cost_model import StageCosts
from megatron_dynapipe.planning.types import MicroBatch, RecomputeType

Order = list[tuple[str, int]]  # ("F" | "B", micro-batch) in execution order, one list per stage


@dataclass(frozen=True)
class StageWork:
    """Per-stage, per-micro-batch durations (ms) and memory (MB) the simulator consumes."""

    forward: np.ndarray  # [pp, n]
    backward: np.ndarray  # [pp, n]
    stored: np.ndarray  # [pp, n] held from the end of forward to the end of backward
    peak: np.ndarray  # [pp, n] transient on top of stored while an op runs
    state: np.ndarray  # [pp] parameters, gradients and optimizer state
    comm: np.ndarray  # [n] one activation (or gradient) transfer between neighbouring stages

    @property
    def pp(self) -> int:
        return self.forward.shape[0]

    @property
    def n(self) -> int:
        return self.forward.shape[1]


class WorkTable:
    """Durations and memory of every (recompute type, stage, micro-batch), evaluated once so
    that candidates which only reorder micro-batches or change recompute need no cost model."""

    FIELDS = ("forward", "backward", "stored", "peak")

    def __init__(self, costs: StageCosts, microbatches: Sequence[MicroBatch]):
        mbs = np.array([mb.size for mb in microbatches])
        seq = np.array([mb.seq_len for mb in microbatches])
        every = costs.by_recompute(mbs, seq, tuple(RecomputeType))
        self.tables = {name: np.array(every[name], dtype=float) for name in self.FIELDS}  # [recompute, pp, n]
        self.state = np.array([costs.model_state_mb(s) for s in range(costs.pp)])
        self.comm = np.broadcast_to(np.asarray(costs.p2p_ms(mbs, seq), dtype=float), mbs.shape).copy()
        # floors[name][rc]: the least time of any recompute type >= rc (measured tables need
        # not be monotone in the recompute type), so that a bound survives raising recompute.
        self.floors = {name: np.minimum.accumulate(self.tables[name][::-1], axis=0)[::-1]
                       for name in ("forward", "backward")}

    def reordered(self, order: Sequence[int]) -> "WorkTable":
        """The same table with micro-batches in another entry order."""
        other = object.__new__(WorkTable)
        cols = np.asarray(order, dtype=np.int64)
        other.tables = {name: table[:, :, cols] for name, table in self.tables.items()}
        other.floors = {name: table[:, :, cols] for name, table in self.floors.items()}
        other.state, other.comm = self.state, self.comm[cols]
        return other

    def makespan_lower_bound(self, recompute: np.ndarray) -> float:
        """A makespan no schedule of these micro-batches, in this entry order, can beat with
        this recompute or any raised from it.

        Every schedule runs forwards in entry order and backwards in arrival order (see
        schedules.py), so stage s starts no earlier than micro-batch 0's forwards and sends
        through stages 0..s-1, is busy for all its own ops, and after its last op (the backward
        of micro-batch n-1) that gradient still passes back through stages s-1..0.
        """
        return float(self.order_bounds(recompute, [0], [self.comm.size - 1])[0])

    def order_bounds(self, recompute: np.ndarray, firsts: Sequence[int], lasts: Sequence[int]) -> np.ndarray:
        """:meth:`makespan_lower_bound` of several entry orders of these micro-batches at once,
        each given by the micro-batch it starts and the one it ends with: only those two depend
        on the order (``recompute`` [pp, n] is per micro-batch, in this table's order)."""
        index = np.asarray(recompute, dtype=np.int64)[None]
        forward = np.take_along_axis(self.floors["forward"], index, axis=0)[0]
        backward = np.take_along_axis(self.floors["backward"], index, axis=0)[0]
        busy = forward.sum(axis=1) + backward.sum(axis=1)
        firsts, lasts = np.asarray(firsts, dtype=np.int64), np.asarray(lasts, dtype=np.int64)
        head = np.cumsum(forward[:-1, firsts] + self.comm[firsts], axis=0)  # stage s: the first reaches it
        tail = np.cumsum(backward[:-1, lasts] + self.comm[lasts], axis=0)  # ... and the last's gradient leaves it
        return np.max(busy[:, None] + np.concatenate([np.zeros((1, len(firsts))), head + tail]), axis=0)

    def work(self, recompute: np.ndarray) -> StageWork:
        """StageWork for the recompute type of every (stage, micro-batch), recompute[pp, n]."""
        index = np.asarray(recompute, dtype=np.int64)[None]
        picked = {name: np.take_along_axis(table, index, axis=0)[0] for name, table in self.tables.items()}
        return StageWork(state=self.state, comm=self.comm, **picked)


def stage_work(costs: StageCosts, microbatches: Sequence[MicroBatch], recompute: np.ndarray) -> StageWork:
    """Evaluate the cost model for every (stage, micro-batch); recompute is [pp, n]."""
    return WorkTable(costs, microbatches).work(np.asarray(recompute).reshape(costs.pp, len(microbatches)))


@dataclass(frozen=True)
class Event:
    stage: int
    kind: str  # "F", "B", "send-act" or "send-grad"
    microbatch: int
    start: float
    end: float


@dataclass
class SimulationResult:
    makespan: float
    peak_memory: np.ndarray  # [pp] MB
    orders: list[Order]
    # Micro-batches holding memory on each stage when its peak was reached (for recompute choice).
    peak_microbatches: list[tuple[int, ...]]
    events: list[Event] = field(default_factory=list)
    # start and end of every stage's compute ops, in the order of `orders` (placing send
    # FINISHes by the predicted timeline: plan.build_execution_plans)
    op_starts: list[list[float]] = field(default_factory=list)
    op_ends: list[list[float]] = field(default_factory=list)

    def fits(self, memory_limit_mb: float) -> bool:
        return bool(np.all(self.peak_memory <= memory_limit_mb + 1e-6))


class ScheduleDeadlock(RuntimeError):
    """The per-stage orders wait on each other."""


UNKNOWN = None  # an arrival time not yet known


class Timeline:
    """Shared book-keeping of both the fixed-order and the greedy simulation.

    Plain Python lists on purpose: the loop touches one scalar at a time, where numpy
    indexing costs several times more.
    """

    def __init__(self, work: StageWork, record: bool):
        pp, n = work.pp, work.n
        self.pp, self.n = pp, n
        self.forward, self.backward = work.forward.tolist(), work.backward.tolist()
        self.stored, self.peak_of = work.stored.tolist(), work.peak.tolist()
        self.state, self.comm = work.state.tolist(), work.comm.tolist()
        self.record = record
        self.events: list[Event] = []
        self.stage_free = [0.0] * pp
        self.act_arrival = [[UNKNOWN] * n for _ in range(pp)]  # activation of m available on s
        self.grad_arrival = [[UNKNOWN] * n for _ in range(pp)]  # gradient of m available on s
        self.fwd_end = [[UNKNOWN] * n for _ in range(pp)]
        self.link_down = [0.0] * pp  # stage s -> s + 1 (activations)
        self.link_up = [0.0] * pp  # stage s -> s - 1 (gradients)
        self.held: list[dict[int, float]] = [{} for _ in range(pp)]  # micro-batch -> stored MB
        self.held_total = [0.0] * pp
        self.peak = list(self.state)
        self.peak_mbs: list[tuple[int, ...]] = [() for _ in range(pp)]
        self.orders: list[Order] = [[] for _ in range(pp)]
        self.op_starts: list[list[float]] = [[] for _ in range(pp)]
        self.op_ends: list[list[float]] = [[] for _ in range(pp)]

    def run(self, s: int, kind: str, m: int, ready: float) -> float:
        """Execute op (kind, m) on stage s no earlier than `ready`; return its end time."""
        start = max(self.stage_free[s], ready)
        forward = kind == "F"
        end = start + (self.forward[s][m] if forward else self.backward[s][m])
        self.stage_free[s] = end
        in_use = self.state[s] + self.held_total[s] + self.peak_of[s][m]
        if in_use > self.peak[s]:
            self.peak[s] = in_use
            self.peak_mbs[s] = tuple(self.held[s]) + ((m,) if forward else ())
        if forward:
            self.held[s][m] = self.stored[s][m]
            self.held_total[s] += self.stored[s][m]
            self.fwd_end[s][m] = end
            if s + 1 < self.pp:
                self.act_arrival[s + 1][m] = self._send(self.link_down, s, m, end, "send-act")
        else:
            self.held_total[s] -= self.held[s].pop(m)
            if s > 0:
                self.grad_arrival[s - 1][m] = self._send(self.link_up, s, m, end, "send-grad")
        self.orders[s].append((kind, m))
        self.op_starts[s].append(start)
        self.op_ends[s].append(end)
        if self.record:
            self.events.append(Event(s, kind, m, start, end))
        return end

    def _send(self, link: list, s: int, m: int, ready: float, kind: str) -> float:
        start = max(link[s], ready)
        link[s] = start + self.comm[m]
        if self.record:
            self.events.append(Event(s, kind, m, start, link[s]))
        return link[s]

    def input_ready(self, s: int, kind: str, m: int):
        """When op (kind, m) on stage s has its input; None while unknown."""
        if kind == "F":
            return 0.0 if s == 0 else self.act_arrival[s][m]
        if s == self.pp - 1:
            return self.fwd_end[s][m]
        return self.grad_arrival[s][m]

    def result(self) -> SimulationResult:
        return SimulationResult(
            makespan=max(self.stage_free) if self.n else 0.0,
            peak_memory=np.array(self.peak),
            orders=self.orders,
            peak_microbatches=self.peak_mbs,
            events=self.events,
            op_starts=self.op_starts,
            op_ends=self.op_ends,
        )


def simulate(orders: Sequence[Order], work: StageWork, record: bool = False) -> SimulationResult:
    """Run fixed per-stage orders; raises ScheduleDeadlock if they wait on each other."""
    timeline = Timeline(work, record)
    position = [0] * work.pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s, order in enumerate(orders):
            while position[s] < len(order):
                kind, m = order[position[s]]
                ready = timeline.input_ready(s, kind, m)
                if ready is UNKNOWN:
                    break
                timeline.run(s, kind, m, ready)
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: orders[s][position[s]] for s in range(work.pp) if position[s] < len(orders[s])}
            raise ScheduleDeadlock(f"stages wait on each other at {stuck}")
    return timeline.result()
