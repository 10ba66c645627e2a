"""Event simulation of a pipeline schedule on a cost model.

Each stage has one compute stream; activations and gradients travel on separate per-link
communication streams, so a transfer overlaps the next computation. One event loop
(:func:`run_timeline`) turns either fixed per-stage orders of compute ops (:func:`simulate`) or
wait-free-cyclic's greedy policy into start/end times, the makespan and per-stage peak memory.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from megatron_dynapipe.planning.cost_model import StageCosts
from megatron_dynapipe.planning.types import Action, MicroBatch, Op, RecomputeType, cost_shapes, extra_segments

Order = list[Action]  # one stage's compute ops in execution order
# An op that ran above the memory limit: (stage, MB in use, its position in the stage's order).
# What it held follows from the order (OrderIndex.held_at). Where ranks hold several model chunks
# the stage is the rank.
OverLimit = tuple[int, float, int]
MEMORY_TOLERANCE_MB = 1e-6  # memory sums in another order may pass an equal limit by rounding


@dataclass(frozen=True)
class StageWork:
    """Per-stage, per-micro-batch durations (ms) and memory (MB) the simulator consumes.

    With ``chunks`` > 1 each of the ``pp`` ranks runs that many model chunks (an interleaved
    pipeline): the rows are virtual stages, ``chunks * pp`` of them, chunk c of rank r being row
    ``c * pp + r``; a rank runs its chunks' ops on one compute stream and holds their memory."""

    forward: np.ndarray  # [stages, n]
    backward: np.ndarray  # [stages, n]
    stored: np.ndarray  # [stages, n] held from the end of forward to the end of backward
    peak: np.ndarray  # [stages, n] transient on top of stored while an op runs
    state: np.ndarray  # [stages] parameters, gradients and optimizer state
    comm: np.ndarray  # [n] one activation (or gradient) transfer between neighbouring stages
    chunks: int = 1  # model chunks per rank

    @property
    def stages(self) -> int:
        """Pipeline stages, virtual ones where ranks hold several chunks."""
        return self.forward.shape[0]

    @property
    def pp(self) -> int:
        """Pipeline ranks."""
        return self.forward.shape[0] // self.chunks

    @property
    def n(self) -> int:
        return self.forward.shape[1]

    @property
    def rank_state(self) -> np.ndarray:
        """[pp] each rank's model state: its chunks' together."""
        return self.state.reshape(self.chunks, -1).sum(axis=0)


def rank_rows(rank: int, pp: int, chunks: int) -> list[int]:
    """The virtual stages (rows of the work) of a rank's chunks: chunk c of rank r is c * pp + r."""
    return [c * pp + rank for c in range(chunks)]


class WorkTable:
    """Durations and memory of every (recompute type, stage, micro-batch), evaluated once so
    that candidates which only reorder micro-batches or change recompute need no cost model."""

    FIELDS = ("forward", "backward", "stored", "peak")

    def __init__(self, costs: StageCosts, microbatches: Sequence[MicroBatch], chunks: int = 1):
        """``costs`` per stage: per virtual stage where each rank runs ``chunks`` model chunks."""
        self.chunks = chunks
        mbs, seq = cost_shapes(microbatches)
        every = costs.by_recompute(mbs, seq, tuple(RecomputeType), segments=extra_segments(microbatches))
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
        other.chunks = self.chunks
        cols = np.asarray(order, dtype=np.int64)
        other.tables = {name: table[:, :, cols] for name, table in self.tables.items()}
        other.floors = {name: table[:, :, cols] for name, table in self.floors.items()}
        other.state, other.comm = self.state, self.comm[cols]
        return other

    def makespan_lower_bound(self, recompute: np.ndarray) -> float:
        """A makespan no schedule of these micro-batches, in this entry order, can beat with
        this recompute or any raised from it (:meth:`order_bounds`)."""
        return float(self.order_bounds(recompute, [range(self.comm.size)])[0])

    def order_bounds(self, recompute: np.ndarray, orders: Sequence[Sequence[int]]) -> np.ndarray:
        """:meth:`makespan_lower_bound` of several entry orders of these micro-batches (each a
        permutation of their indices; ``recompute`` [pp, n] is per micro-batch, in this table's
        order): :func:`makespan_bounds` with every op at its least time under any recompute from
        the given one."""
        return makespan_bounds(*self.floor_times(recompute), self.comm, orders, self.chunks)

    def floor_times(self, recompute: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[pp, n] forward and backward ms of every op at its least under any recompute from
        ``recompute`` [pp, n] on."""
        index = np.asarray(recompute, dtype=np.int64)[None]
        return tuple(np.take_along_axis(self.floors[phase], index, axis=0)[0] for phase in ("forward", "backward"))

    def work(self, recompute: np.ndarray) -> StageWork:
        """StageWork for the recompute type of every (stage, micro-batch), recompute[pp, n]."""
        index = np.asarray(recompute, dtype=np.int64)[None]
        picked = {name: np.take_along_axis(table, index, axis=0)[0] for name, table in self.tables.items()}
        return StageWork(state=self.state, comm=self.comm, chunks=self.chunks, **picked)


def makespan_bounds(forward: np.ndarray, backward: np.ndarray, comm: np.ndarray,
                    orders: Sequence[Sequence[int]], chunks: int = 1) -> np.ndarray:
    """Per entry order (a permutation of the micro-batches), a makespan no schedule can beat
    whose ops take ``forward``/``backward`` [pp, n] ms and whose transfers ``comm`` [n] ms.

    Every schedule runs forwards and backwards in entry order (schedules/base.py), so two bounds
    hold on every stage s. Its work: it starts no earlier than micro-batch 0's forwards and sends
    through stages 0..s-1, is busy for all its own ops, and after its last op (the backward of the
    last micro-batch) that gradient still passes back through stages s-1..0. And each micro-batch
    j's path: from that same start, s runs the forwards of the micro-batches ahead of j, then j
    goes forward through stages s..pp-1 and back (a transfer each way between neighbours), then s
    runs the backwards of those behind j, and the last gradient passes back. The second dominates
    where few micro-batches of unequal cost fill many stages: the pipeline never reaches a
    steady state, and the longest round trip sets the pace.

    With ``chunks`` model chunks a rank the rows are virtual stages, and each holds as though it
    had a rank to itself; a rank's first virtual stage also counts the whole rank's work: its
    first op waits for micro-batch 0 to reach it, and its last is that stage's last backward.
    """
    pp, n = forward.shape
    cols = np.asarray([list(order) for order in orders], dtype=np.int64).reshape(len(orders), n)  # [k, n]
    if not cols.size:
        return np.zeros(len(orders))
    busy = (forward.sum(axis=1) + backward.sum(axis=1))[:, None]  # [s, 1]: the same in any order
    if chunks > 1:
        busy[:pp // chunks] = busy.reshape(chunks, pp // chunks, 1).sum(axis=0)  # a rank's, on its first chunk
    hops = 2.0 * np.arange(pp - 1, -1, -1)[:, None, None]  # transfers of a round trip from stage s
    f, b, c = forward[:, cols], backward[:, cols], comm[cols]  # [s, k, j] in each order k; c [k, j]
    zero = np.zeros((1, len(cols)))
    head = np.concatenate([zero, np.cumsum(f[:-1, :, 0] + c[:, 0], axis=0)])  # [s, k]: micro-batch 0 reaches s
    tail = np.concatenate([zero, np.cumsum(b[:-1, :, -1] + c[:, -1], axis=0)])  # [s, k]: the last gradient leaves s
    trip = np.cumsum((f + b)[::-1], axis=0)[::-1] + hops * c  # [s, k, j]: j from s to the end and back
    ahead = _sums_before(f)  # forwards of those ahead of j
    behind = _sums_before(b[:, :, ::-1])[:, :, ::-1]  # backwards of those behind j
    path = (ahead + trip + behind).max(axis=2)  # [s, k]
    return np.max(head + tail + np.maximum(busy, path), axis=0)


def _sums_before(x: np.ndarray) -> np.ndarray:
    """Along the last axis, the sum of the entries before each one (0 for the first): a running sum
    less the entry itself would turn an op priced inf (one that does not fit) into nan."""
    out = np.zeros_like(x)
    np.cumsum(x[..., :-1], axis=-1, out=out[..., 1:])  # in place: a copy of 65,536 ops a bound costs 1 ms
    return out


def stage_work(costs: StageCosts, microbatches: Sequence[MicroBatch], recompute: np.ndarray,
               chunks: int = 1) -> StageWork:
    """Evaluate the cost model for every (stage, micro-batch); recompute is [pp, n] (``costs``
    and ``recompute`` per virtual stage where each rank runs ``chunks`` model chunks)."""
    return WorkTable(costs, microbatches, chunks).work(np.asarray(recompute).reshape(costs.pp, len(microbatches)))


@dataclass(frozen=True)
class Event:
    stage: int  # the rank
    kind: Op  # FORWARD, BACKWARD, or the transfer of a forward's output (SEND_ACT_START) or
    # of a backward's input gradient (SEND_GRAD_START), from its start to its arrival
    microbatch: int
    start: float
    end: float
    chunk: int = 0  # the rank's model chunk that ran or sent it


@dataclass
class SimulationResult:
    makespan: float
    peak_memory: np.ndarray  # [pp] MB
    orders: list[Order]
    events: list[Event] = field(default_factory=list)
    over_limit: list[OverLimit] = field(default_factory=list)  # every op above ``report_over_mb``
    # start and end of every stage's compute ops, in the order of `orders` (placing send
    # FINISHes by the predicted timeline: plan.build_execution_plans)
    op_starts: list[list[float]] = field(default_factory=list)
    op_ends: list[list[float]] = field(default_factory=list)

    def fits(self, memory_limit_mb: float) -> bool:
        return bool(np.all(self.peak_memory <= memory_limit_mb + MEMORY_TOLERANCE_MB))


class ScheduleDeadlock(RuntimeError):
    """The per-stage orders wait on each other."""


def simulate(orders: Sequence[Order], work: StageWork, record: bool = False) -> SimulationResult:
    """Run fixed per-stage orders; raises ScheduleDeadlock if they wait on each other."""
    check_orders(orders)
    return run_timeline(work, orders=orders, record=record)


def check_orders(orders: Sequence[Order]) -> None:
    """Orders hold Actions of forwards and whole backwards alone: a plain tuple, or another op (a
    weight-gradient step) would otherwise be read as a backward without a word."""
    for s, order in enumerate(orders):
        check_order(order, s)


def check_order(order: Order, stage: "int | None" = None) -> None:
    """:func:`check_orders` of one order (of stage ``stage``, where known)."""
    where = "order" if stage is None else f"stage {stage} order"
    for i, action in enumerate(order):
        if type(action) is not Action or type(action.op) is not Op or not action.op.is_compute:
            raise ValueError(f"{where} item #{i} {action!r} is not an Action of Op.FORWARD or "
                             "Op.BACKWARD (Action.forward(m), Action.backward(m)): the planner simulates "
                             "forwards and whole backwards only")


_FORWARD, _BACKWARD, _SEND_ACT, _SEND_GRAD = Op.FORWARD, Op.BACKWARD, Op.SEND_ACT_START, Op.SEND_GRAD_START


def run_timeline(work: StageWork, *, orders: "Sequence[Order] | None" = None, memory_limit_mb: float = math.inf,
                 give_up_above_ms: float = math.inf, record: bool = False,
                 report_over_mb: float = math.inf, strict_memory: bool = False) -> "SimulationResult | None":
    """The one event loop every schedule is simulated with.

    Stages decide in time order (earliest first, ties by stage).  With ``orders`` each stage
    runs its own order, an op as soon as the stage is free and its input has arrived.  Without,
    each stage follows wait-free-cyclic's greedy policy (:func:`_wait_free_pick`) under
    ``memory_limit_mb``, and the orders are what it ran. Either returns None as soon as a stage
    cannot end by ``give_up_above_ms`` (its end, its remaining compute and the last gradient's way
    back pass it).
    Every op that runs with more than ``report_over_mb`` in use is listed in ``over_limit`` (what
    recompute adjustment may lighten).
    ``strict_memory`` keeps the greedy policy within the limit even while it fills a stage (see
    :func:`_wait_free_pick`).
    Where ranks hold several model chunks (``work.chunks``), ``orders`` are per rank, each op's
    ``chunk`` saying which; its input comes from the virtual stage before (the previous rank, or
    for chunk c > 0 on the first rank, the last rank's chunk c - 1), and its rank's compute stream,
    memory and links are shared by its chunks.

    One loop over local lists on purpose: it runs once per candidate and recompute round, for
    thousands of ops, and method calls and attribute lookups were most of its time.
    """
    pp, n, chunks, last = work.pp, work.n, work.chunks, work.stages - 1  # last: the last virtual stage
    forward, backward = work.forward.tolist(), work.backward.tolist()  # [virtual stage][micro-batch]
    stored, peak_of = work.stored.tolist(), work.peak.tolist()
    state, comm = work.rank_state.tolist(), work.comm.tolist()
    greedy = orders is None
    if greedy and chunks > 1:
        raise ValueError("wait-free-cyclic runs one model chunk a rank: give interleaved orders")
    # A rank's compute still to run, plus -- after its last op, the backward of the last
    # micro-batch on its first chunk (every schedule runs backwards in entry order) -- that
    # gradient's way back through the stages before it: the least time from its next op to the end.
    remaining = (work.forward.sum(axis=1) + work.backward.sum(axis=1)).reshape(chunks, pp).sum(axis=0)
    if n:
        drain = np.concatenate([[0.0], np.cumsum(work.backward[:pp - 1, -1] + work.comm[-1])])
        remaining = remaining + drain
    remaining = remaining.tolist()
    total = 2 * pp * n if greedy else sum(len(o) for o in orders)
    act = [[None] * n for _ in range(last + 1)]  # when the activation of m is on virtual stage v
    grad = [[None] * n for _ in range(last + 1)]  # when the gradient of m is on virtual stage v
    last_forward_end = [None] * n  # the last stage's backward of m needs its own forward
    free, link_down, link_up = [0.0] * pp, [0.0] * pp, [0.0] * pp  # per rank: its compute, its outgoing links
    # per rank: stored MB held, by micro-batch (chunk * n + micro-batch where ranks hold several)
    held: list[dict[int, float]] = [{} for _ in range(pp)]
    held_total, peak = [0.0] * pp, list(state)
    ran: list[Order] = [[] for _ in range(pp)]
    forwards, backwards = actions(n)
    starts: list[list[float]] = [[] for _ in range(pp)]
    ends: list[list[float]] = [[] for _ in range(pp)]
    events: list[Event] = []
    over: list[OverLimit] = []
    position = [0] * pp  # fixed orders: the next op of each stage
    next_forward = [0] * pp  # greedy: the next micro-batch to enter each stage
    backlog = [deque() for _ in range(pp)]  # greedy: micro-batches whose gradient is due, FIFO
    wake: list = [0.0] * pp  # when each stage next decides; None: waits for a neighbour
    heap = [(0.0, s) for s in range(pp)]
    v = c = 0  # the op's virtual stage and chunk (one chunk a rank: v is the rank)

    def wake_at(s: int, time: float) -> None:
        if time < free[s]:
            time = free[s]
        if wake[s] is None or time < wake[s]:
            wake[s] = time
            heapq.heappush(heap, (time, s))

    for _ in range(total):
        kind = None
        while kind is None:
            if not heap:
                raise _stuck(orders, position, pp)
            now, s = heapq.heappop(heap)
            if wake[s] != now:
                continue  # superseded by an earlier wake-up
            wake[s] = None
            if greedy:
                kind, m = _wait_free_pick(s, now, pp, n, last, act, last_forward_end, grad, held[s], backlog[s],
                                          next_forward, state[s] + held_total[s], stored[s], peak_of[s],
                                          memory_limit_mb, strict_memory)
                v = s
                due = ([] if kind is not None
                       else _inputs_due(s, n, last, act, last_forward_end, grad, backlog[s], next_forward))
            elif position[s] < len(orders[s]):
                op = orders[s][position[s]]
                kind, m = op.op, op.microbatch
                if chunks > 1:
                    c = op.chunk
                    v = c * pp + s
                else:
                    v = s
                if kind is _FORWARD:
                    ready = 0.0 if v == 0 else act[v][m]
                else:
                    ready = last_forward_end[m] if v == last else grad[v][m]
                if ready is None or ready > now:
                    kind, due = None, [ready]
                else:
                    position[s] += 1
            else:
                due = []
            if kind is None:  # sleep until an input it knows of is due; else a neighbour wakes it
                due = [d for d in due if d is not None and d > now]
                if due:
                    wake_at(s, min(due))
        start = free[s] if free[s] > now else now
        duration = forward[v][m] if kind is _FORWARD else backward[v][m]
        end = free[s] = start + duration
        key = c * n + m if chunks > 1 else m
        in_use = state[s] + held_total[s] + peak_of[v][m]
        if in_use > peak[s]:
            peak[s] = in_use
        if in_use > report_over_mb + MEMORY_TOLERANCE_MB:
            over.append((s, in_use, len(ran[s])))
        if chunks > 1:
            ran[s].append(Action(kind, m, c))
        else:
            ran[s].append(forwards[m] if kind is _FORWARD else backwards[m])
        starts[s].append(start)
        ends[s].append(end)
        if record:
            events.append(Event(s, kind, m, start, end, c))
        remaining[s] -= duration
        if end + remaining[s] > give_up_above_ms:
            return None
        if kind is _FORWARD:
            held[s][key] = stored[v][m]
            held_total[s] += stored[v][m]
            if v < last:
                begin = link_down[s] if link_down[s] > end else end
                sent = link_down[s] = begin + comm[m]
                if record:
                    events.append(Event(s, _SEND_ACT, m, begin, sent, c))
                act[v + 1][m] = sent
                wake_at((s + 1) % pp, sent)
            else:
                last_forward_end[m] = end
                backlog[s].append(m)  # the last stage turns straight to its own backward
        else:
            held_total[s] -= held[s].pop(key)
            if v > 0:
                begin = link_up[s] if link_up[s] > end else end
                sent = link_up[s] = begin + comm[m]
                if record:
                    events.append(Event(s, _SEND_GRAD, m, begin, sent, c))
                grad[v - 1][m] = sent
                if greedy:
                    backlog[s - 1].append(m)
                wake_at((s - 1) % pp, sent)
        wake_at(s, end)
    return SimulationResult(makespan=max(free) if n else 0.0, peak_memory=np.array(peak), orders=ran, events=events,
                            op_starts=starts, op_ends=ends, over_limit=over)


@functools.lru_cache(maxsize=8)
def actions(n: int) -> tuple[tuple[Action, ...], tuple[Action, ...]]:
    """Every forward and every backward of n micro-batches, made once: the orders of every
    candidate and recompute round of a batch share them (an Action costs several times a
    plain tuple to make)."""
    return tuple(Action.forward(m) for m in range(n)), tuple(Action.backward(m) for m in range(n))


def over_limit(orders: "Sequence[Order | OrderIndex]", work: StageWork, limit_mb: float) -> list[OverLimit]:
    """Every op of fixed per-stage orders that runs above ``limit_mb``, as run_timeline's
    ``over_limit`` lists them (stage by stage), without timing anything: a stage's memory changes
    only with its own ops, so under fixed orders it follows from the orders alone."""
    over = []
    for s, order in enumerate(orders):
        index = order if isinstance(order, OrderIndex) else OrderIndex.of(order, work.n, work.chunks)
        rows = rank_rows(s, work.pp, work.chunks)
        used = index.in_use(float(work.rank_state[s]), work.stored[rows].reshape(-1), work.peak[rows].reshape(-1))
        over += [(s, float(used[i]), int(i)) for i in np.flatnonzero(used > limit_mb + MEMORY_TOLERANCE_MB)]
    return over


class OrderLists(NamedTuple):
    """:class:`OrderIndex`'s arrays as plain lists."""

    forward: list[bool]
    key: list[int]
    first: list[int]
    last: list[int]


@dataclass(frozen=True)
class OrderIndex:
    """One rank's order as arrays, for what it holds at each op. A key is an op's micro-batch, or
    ``chunk * n + micro-batch`` where the rank runs several model chunks (as run_timeline counts
    them); every key's forward and backward run once."""

    forward: np.ndarray  # [ops] whether the op is a forward
    key: np.ndarray  # [ops]
    first: np.ndarray  # [keys] position of the key's forward
    last: np.ndarray  # [keys] position of its backward

    @classmethod
    def of(cls, order: Order, n: int, chunks: int = 1) -> "OrderIndex":
        ops = np.fromiter((action.op for action in order), dtype=np.int64, count=len(order))
        forward = ops == _FORWARD
        if not np.all(forward | (ops == _BACKWARD)):
            check_order(order)  # names the first op that is neither
        keys = (a.chunk * n + a.microbatch for a in order) if chunks > 1 else (a.microbatch for a in order)
        key = np.fromiter(keys, dtype=np.int64, count=len(order))
        first, last = np.zeros(n * chunks, dtype=np.int64), np.zeros(n * chunks, dtype=np.int64)
        positions = np.arange(len(order))
        first[key[forward]], last[key[~forward]] = positions[forward], positions[~forward]
        return cls(forward, key, first, last)

    def in_use(self, state: float, stored: np.ndarray, peak: np.ndarray) -> np.ndarray:
        """[ops] MB in use while each op runs: ``state``, the ``stored`` [keys] of every key whose
        forward ran before it and whose backward has not (its own backward included), and its own
        ``peak`` [keys] on top. Summed in the order the ops run, as run_timeline does."""
        change = np.where(self.forward, stored[self.key], -stored[self.key])
        held = np.concatenate([[0.0], np.cumsum(change[:-1])])
        return state + held + peak[self.key]

    def held_at(self, position: int) -> list[int]:
        """The keys held while the op at ``position`` runs, in the order their forwards ran."""
        keys, firsts, reach = self._by_forward
        ran = bisect.bisect_left(firsts, position)  # forwards before it
        oldest = bisect.bisect_left(reach, position)  # no key before this one is still held
        last = self.lists.last
        return [k for k in keys[oldest:ran] if last[k] >= position]

    @functools.cached_property
    def lists(self) -> "OrderLists":
        """The same index as plain lists, for loops that read one element at a time (made once:
        a fixed schedule's index serves every round of recompute adjustment)."""
        return OrderLists(self.forward.tolist(), self.key.tolist(), self.first.tolist(), self.last.tolist())

    @functools.cached_property
    def _by_forward(self) -> tuple[list[int], list[int], list[int]]:
        # the keys in the order their forwards ran, where each ran, and the latest backward among
        # the keys up to each; plain lists: held_at runs per op lightened
        keys = np.argsort(self.first, kind="stable")
        return keys.tolist(), self.first[keys].tolist(), np.maximum.accumulate(self.last[keys]).tolist()


def _stuck(orders, position, pp) -> Exception:
    """Why no stage can run its next op."""
    if orders is None:
        return RuntimeError("wait-free-cyclic found no runnable op: a micro-batch fits no stage alone")
    stuck = ", ".join(f"stage {s} at {orders[s][position[s]]}" for s in range(pp) if position[s] < len(orders[s]))
    return ScheduleDeadlock(f"stages wait on each other: {stuck}")


def _wait_free_pick(s, now, pp, n, last, act, last_forward_end, grad, held, backlog, next_forward, in_use, stored,
                    peak, limit, strict):
    """wait-free-cyclic's choice for stage s at ``now``: keep 1F1B's pp - s micro-batches in flight
    first (a starved pipeline idles downstream), then backwards, then extra forwards while memory
    lasts: (Op, micro-batch) or (None, None).  Filling the stage ignores memory (recompute
    adjustment makes those micro-batches fit, which beats idling) unless ``strict``: then a forward
    that would not fit waits for a backward to free memory, as any extra one does."""
    m = next_forward[s]
    ready = (0.0 if s == 0 else act[s][m]) if m < n else None
    forward_due = ready is not None and ready <= now
    filling = forward_due and len(held) < pp - s
    if filling and not (strict and held and not _fits(m, held, in_use, stored, peak, limit)):
        next_forward[s] += 1
        return _FORWARD, m
    if backlog:
        b = backlog[0]
        ready = last_forward_end[b] if s == last else grad[s][b]
        if ready is not None and ready <= now:
            return _BACKWARD, backlog.popleft()
    if forward_due and _fits(m, held, in_use, stored, peak, limit):
        next_forward[s] += 1
        return _FORWARD, m
    return None, None


def _fits(m, held, in_use, stored, peak, limit) -> bool:
    """Whether admitting m keeps every op until the next free within the limit: m's forward, and
    the backward of any held micro-batch, which then runs with m's activations held too."""
    transient = max(peak[m], max(map(peak.__getitem__, held))) if held else peak[m]
    return in_use + stored[m] + transient <= limit


def _inputs_due(s, n, last, act, last_forward_end, grad, backlog, next_forward) -> list:
    """When the inputs of stage s's next backward and next forward arrive (None: not yet known)."""
    due = [last_forward_end[backlog[0]] if s == last else grad[s][backlog[0]]] if backlog else []
    if next_forward[s] < n:
        due.append(0.0 if s == 0 else act[s][next_forward[s]])
    return due
