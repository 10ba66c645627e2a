"""Lowering: each stage's compute order becomes its instruction list, deadlock-free by construction.

A schedule arrives as one *order* per pipeline stage, its :class:`Action` s, e.g. ``F0 F1 B0 ...``.
:func:`lower_to_instructions` turns one stage's order into the instructions an executor runs
with non-blocking point-to-point calls (``isend``/``irecv`` + ``wait``) on the pipeline group;
:func:`build_execution_plans` does it for every stage, wraps each list in an
:class:`ExecutionPlan` and proves the set deadlock-free with :func:`check_deadlock_free`.

Lowering (stage ``s`` of ``P``; compute ops ``F(m)``/``B(m)`` in the stage's order):

* ``F(m)``: stage 0 ``LOAD_INPUT(m)``, other stages ``RECV_ACT_START(m, s-1)`` ...
  ``RECV_ACT_FINISH(m, s-1)``; ``FORWARD(m)``; non-last stages ``SEND_ACT_START(m, s+1)`` ...
  ``SEND_ACT_FINISH(m, s+1)``.
* ``B(m)``: non-last stages ``RECV_GRAD_START(m, s+1)`` ... ``RECV_GRAD_FINISH(m, s+1)``;
  ``BACKWARD(m)``; stages > 0 ``SEND_GRAD_START(m, s-1)``; ``FREE_BUFFER(m)``; later
  ``SEND_GRAD_FINISH(m, s-1)``.
* Between two compute ops every START (non-blocking) comes before every FINISH (blocking), so a
  stage never waits while holding back a post its peers need.
* Each receive is posted one compute op ahead: the START for the stage's compute op ``i`` sits
  just before compute op ``i - 1`` (ops 0 and 1 receive from the very start).
* Each send's FINISH goes before the compute op after next, so the transfer runs beside the
  next compute op (as the planner's simulator prices it, and as Megatron's 1F1B cannot: it waits
  for a send with the receive it posts beside it), and later where it could otherwise close a
  wait cycle (see below). A FINISH moved later never adds one: every START of the stage is then
  reached under fewer waits than before. The sent buffer lives one compute op longer.

Interleaved pipelines (``chunks`` model chunks a stage): the same, read over virtual stages.
Chunk c of stage s is virtual stage ``v = c * P + s``; its op's input comes from virtual stage
``v - 1`` (stage ``s - 1``, or for ``s = 0`` stage ``P - 1``'s chunk ``c - 1``) and its output goes
to ``v + 1``; only virtual stage 0 loads inputs and only the last, ``chunks * P - 1``, runs a
backward without a gradient received. Every instruction names its chunk (``F3.1``).

Why a send's FINISH cannot always sit that early: take stage 0 running
``F0 F1 ... F6 B0 ...`` and stage 1 running ``F0 B0 F1 B1 F2 ...`` (both keep forwards and
backwards in the same micro-batch order, and the pair is executable). With every send finished
before the compute op after next, stage 1 waits before ``B1`` for stage 0 to post its gradient
receive for ``B0`` (after ``F5``) while stage 0 waits before ``F5`` for stage 1 to post the
activation receive for ``F3`` (after ``F2`` on stage 1) -- a deadlock the compute order itself
does not have.

Placement rule. A FINISH of a send whose receiver posts its START after the receiver's compute
op ``y`` may sit before the sender's compute op ``x`` only when ``end(y) <= start(x)`` in one
fixed valid timeline of the compute ops: the planner's simulated one, where the FINISH then
sits where the receive is predicted to be posted (or before the compute op after next, whichever
is later), or else as-soon-as-possible with forward 1 and
backward 2 time units (every op must take positive time). Then every wait edge of the lowered
plans (a RECV_FINISH waits for the producing op, a SEND_FINISH for such a ``y``, program order)
points forward in that timeline, so the stage whose
next compute op starts earliest can always progress: no cycle, no deadlock, for *any* set of
orders that is executable and FIFO-consistent (on each link, in each direction, activations are
received in the order they are sent, and so are gradients -- needed anyway because untagged
sends and receives pair up in posting order; with one chunk a stage: every stage forwards the
micro-batches in the same order and runs the backwards in the same order). Without the other stages' orders, the rule falls back
to what this stage's order proves alone: an activation send finishes before the first backward
of a micro-batch forwarded no earlier (at latest its own ``B(m)``; before the compute op after
next for the first two forwards, whose receives are posted at the start), a gradient send before
the end.
"""


from __future__ import annotations

import enum
import functools
from typing import NamedTuple, NoReturn, Sequence, Union

import numpy as np

from megatron_dynapipe.planning.plan.deadlock import check_deadlock_free
from megatron_dynapipe.planning.plan.execution_plan import ExecutionPlan
from megatron_dynapipe.planning.plan.instructions import ROW, Instructions, Op, as_recompute
from megatron_dynapipe.planning.simulator import check_order, rank_rows
from megatron_dynapipe.planning.types import Action, MicroBatch, RecomputeType

__all__ = ["ComputeOrder", "lower_to_instructions", "build_execution_plans"]

ComputeOrder = Sequence[Action]  # in execution order
RecomputeSpec = Union[RecomputeType, int, str, Sequence["RecomputeType | int | str"]]

# Durations of the reference timeline used to place send FINISHes. Any positive values keep the
# plans deadlock-free; these only decide how early a FINISH may sit in unusual orders.
_FORWARD_TIME, _BACKWARD_TIME = 1.0, 2.0




class _Order(NamedTuple):
    """One stage's compute order as arrays: which ops are forwards, of which micro-batch, on
    which of the stage's model chunks."""

    forward: np.ndarray  # bool, per compute op
    microbatch: np.ndarray  # int64, per compute op
    chunk: np.ndarray  # int64, per compute op


def _parse_order(order: ComputeOrder, stage: int, check: bool = True, chunks: int = 1) -> _Order:
    """The order as arrays, or ValueError naming the first item that breaks it (``check=False``:
    an order a schedule made, trusted to be well formed)."""
    if check:
        check_order(order, stage)
    try:
        kinds, ids, chunk = (np.array(column, dtype=np.int64) for column in zip(*order)) if len(order) else [
            np.zeros(0, dtype=np.int64)] * 3
    except (TypeError, ValueError, OverflowError):
        _explain_bad_order(order, stage, chunks)
    forward, backward, microbatch = kinds == _FORWARD, kinds == _BACKWARD, ids
    if not np.all(forward | backward):  # trusted or not: an op lowering has no rule for is named
        _explain_bad_order(order, stage, chunks)
    if chunk.size and (chunk.min() < 0 or chunk.max() >= chunks):
        _explain_bad_order(order, stage, chunks)  # trusted or not: a chunk the stage lacks is named
    if not check or _well_formed(forward, backward, microbatch, chunk):
        return _Order(forward, microbatch, chunk)
    _explain_bad_order(order, stage, chunks)


def _well_formed(forward: np.ndarray, backward: np.ndarray, microbatch: np.ndarray, chunk: np.ndarray) -> bool:
    """Every item (each F or B: _parse_order checked) of a micro-batch >= 0, each once per chunk,
    and each B after its F."""
    if microbatch.size and microbatch.min() < 0:
        return False
    key = chunk * (int(microbatch.max()) + 1 if microbatch.size else 1) + microbatch
    positions = np.arange(len(key))
    f_order, b_order = np.argsort(key[forward], kind="stable"), np.argsort(key[backward], kind="stable")
    f_ids, b_ids = key[forward][f_order], key[backward][b_order]
    return (np.array_equal(f_ids, b_ids) and bool(np.all(np.diff(f_ids) > 0))
            and bool(np.all(positions[backward][b_order] > positions[forward][f_order])))


def _explain_bad_order(order: ComputeOrder, stage: int, chunks: int) -> NoReturn:
    check_order(order, stage)
    seen: dict[tuple[Op, int, int], int] = {}
    for i, item in enumerate(order):
        try:
            kind, m, chunk = item.op, int(item.microbatch), int(item.chunk)
        except (TypeError, ValueError):
            raise ValueError(f"stage {stage} order item #{i} {item!r}: its micro-batch and chunk must be "
                             "integers") from None
        if m < 0:
            raise ValueError(f"stage {stage} order item #{i} {item!r}: micro-batch must be >= 0")
        if not 0 <= chunk < chunks:
            raise ValueError(f"stage {stage} order item #{i} {item!r} runs model chunk {chunk}: the stages hold "
                             f"{chunks} (chunks 0..{chunks - 1}); pass chunks= for an interleaved pipeline")
        name = str(Action(kind, m, chunk))
        if (kind, m, chunk) in seen:
            raise ValueError(f"stage {stage} order has {name} twice (#{seen[kind, m, chunk]} and #{i})")
        if kind is Op.BACKWARD and (Op.FORWARD, m, chunk) not in seen:
            raise ValueError(f"stage {stage} order runs {name} before F{name[1:]}")
        seen[kind, m, chunk] = i
    unmatched = sorted((m, c) for kind, m, c in seen if kind is Op.FORWARD and (Op.BACKWARD, m, c) not in seen)
    names = ", ".join(f"{m}" + (f".{c}" if c else "") for m, c in unmatched[:10])
    raise ValueError(f"stage {stage} order has no backward for micro-batches {names}")


def _recompute_codes(recompute: RecomputeSpec, order: _Order, chunks: int) -> np.ndarray:
    """[chunk, micro-batch id] recompute codes of the micro-batches the order runs (one choice
    per micro-batch is that micro-batch's on every chunk)."""
    size = int(order.microbatch.max()) + 1 if order.microbatch.size else 0
    if isinstance(recompute, _ONE_CHOICE):
        return np.full((chunks, size), int(as_recompute(recompute)), dtype=np.int64)
    if size > len(recompute):
        raise ValueError(f"no recompute choice for micro-batch {size - 1} (got {len(recompute)})")
    return np.tile(_codes(recompute[:size]), (chunks, 1))


_ONE_CHOICE = (RecomputeType, int, str, np.integer)  # a recompute spec that is one choice, not one per micro-batch


def _timeline(orders: Sequence[_Order], chunks: int = 1) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """As-soon-as-possible start/end of every compute op (forward 1, backward 2): F(m) waits for
    F(m) on the virtual stage before, B(m) for B(m) on the virtual stage after (chunk c of stage
    s is virtual stage ``c * pp + s``). Ops that never become runnable (the orders wait on each
    other) get +inf."""
    pp = len(orders)
    last = pp * chunks - 1
    inf = float("inf")
    ops = [list(zip(o.forward.tolist(), o.microbatch.tolist(), (o.chunk * pp + s).tolist()))
           for s, o in enumerate(orders)]
    start = [[inf] * len(o) for o in ops]
    end = [[inf] * len(o) for o in ops]
    done: list[dict[bool, dict[int, float]]] = [{True: {}, False: {}} for _ in range(last + 1)]  # per virtual stage
    pc = [0] * pp
    free = [0.0] * pp
    progressed = True
    while progressed:
        progressed = False
        for s in range(pp):
            order, i, t = ops[s], pc[s], free[s]
            while i < len(order):
                forward, m, v = order[i]
                if forward:
                    ready = 0.0 if v == 0 else done[v - 1][True].get(m)
                else:
                    ready = 0.0 if v == last else done[v + 1][False].get(m)
                if ready is None:
                    break
                t0 = t if t > ready else ready
                t = t0 + (_FORWARD_TIME if forward else _BACKWARD_TIME)
                start[s][i], end[s][i] = t0, t
                done[v][forward][m] = t
                i += 1
            if i > pc[s]:
                pc[s], free[s], progressed = i, t, True
    return [np.array(x) for x in start], [np.array(x) for x in end]


class _Reference:
    """What placing send FINISHes against the other stages needs: every stage's order and one
    valid timeline of their compute ops (start/end per stage, in order). Any timeline in which
    each op starts after its inputs' producers end and after the op before it on its stage,
    with every op of positive duration, keeps the plans deadlock-free (module docstring)."""

    def __init__(self, orders: Sequence[_Order], timeline: "tuple[Sequence, Sequence] | None" = None,
                 chunks: int = 1):
        self.orders, self.chunks = orders, chunks
        if timeline is not None:
            start, end = ([np.asarray(t, dtype=float) for t in times] for times in timeline)
            if len(start) != len(orders) or len(end) != len(orders) or any(
                    len(a) != len(o.microbatch) or len(b) != len(o.microbatch) for a, b, o in zip(start, end, orders)):
                raise ValueError("the timeline must give a start and an end for every compute op of every stage")
            # a zero-length op could tie two waits into a cycle: use the unit-duration timeline then
            if all(np.all(b > a) for a, b in zip(start, end)):
                self.start, self.end = start, end
                return
        self.start, self.end = _timeline(orders, chunks)

    @functools.cached_property
    def end_flat(self) -> np.ndarray:
        return np.concatenate(self.end) if self.end else np.zeros(0)

    @functools.cached_property
    def offset(self) -> np.ndarray:
        """Where each stage's ops begin in the stages' orders laid end to end."""
        return np.concatenate([[0], np.cumsum([len(o.microbatch) for o in self.orders])]).astype(np.int64)

    @functools.cached_property
    def _lookup(self) -> tuple[np.ndarray, np.ndarray, int]:
        """Sorted keys (stage, chunk, kind, micro-batch) of every op and their positions in their stage."""
        width = 1 + max((int(o.microbatch.max()) for o in self.orders if o.microbatch.size), default=0)
        keys = np.concatenate([self._key(s, o.forward, o.microbatch, o.chunk, width) for s, o in enumerate(self.orders)])
        positions = np.concatenate([np.arange(len(o.microbatch)) for o in self.orders])
        by_key = np.argsort(keys, kind="stable")
        return keys[by_key], positions[by_key], width

    def _key(self, stage, forward, microbatch, chunk, width):
        return ((stage * self.chunks + chunk) * 2 + ~forward) * width + microbatch

    def position(self, stage: np.ndarray, forward: np.ndarray, microbatch: np.ndarray, chunk: np.ndarray
                 ) -> np.ndarray:
        """Where F (forward) or B of each micro-batch on that chunk sits in that stage's order; -1 where not."""
        keys, positions, width = self._lookup
        query = self._key(stage, forward, microbatch, chunk, width)
        found = np.minimum(np.searchsorted(keys, query), max(len(keys) - 1, 0))
        hit = (microbatch < width) & (keys[found] == query) if len(keys) else np.zeros(len(query), bool)
        return np.where(hit, positions[found] if len(keys) else -1, -1)


def _send_finish_slots(ops: "_Ops", sends: np.ndarray, ref: _Reference) -> np.ndarray:
    """For the compute ops ``sends`` (row indices into ``ops``, ops that send), the position in
    their stage's order of the compute op each send's FINISH goes before (``len(order)``: the
    end of the plan)."""
    stage, forward, ids = ops.stage[sends], ops.forward[sends], ops.microbatch[sends]
    peer, peer_chunk = _neighbour(ops, sends, np.where(forward, 1, -1))
    c = ref.position(peer, forward, ids, peer_chunk)
    if np.any(c < 0):
        bad = int(np.argmax(c < 0))
        raise ValueError(f"stage {peer[bad]} order has no {'F' if forward[bad] else 'B'}{ids[bad]}"
                         + (f".{peer_chunk[bad]}" if peer_chunk[bad] else "") + f" to receive stage {stage[bad]}'s send")
    # the receive is posted after the peer's compute op c - 2 (ops 0 and 1: from the start)
    posted = np.where(c <= 1, -np.inf, ref.end_flat[ref.offset[peer] + np.maximum(c - 2, 0)])
    slots = _beside_next_op(ops.position[sends], ref.offset[stage + 1] - ref.offset[stage])
    for s in np.unique(stage).tolist():  # start times rise along a stage's order: a search finds the op
        mine = stage == s
        slots[mine] = np.maximum(slots[mine], np.searchsorted(ref.start[s], posted[mine], side="left"))
    return slots


def _send_finish_slots_alone(order: _Order, sends: np.ndarray) -> np.ndarray:
    """Only this stage's order is known: use what it proves about the neighbours on its own.
    An activation send of the first two forwards is received from the start (ops 0 and 1 of
    the next stage); a later one finishes before the first backward of a micro-batch forwarded
    no earlier (B(k) there needs F(k), hence F(m), there); a gradient send at the end."""
    count, forward, ids = len(order.microbatch), order.forward[sends], order.microbatch[sends]
    f_rank = np.empty(int(order.microbatch.max()) + 1, dtype=np.int64)
    f_rank[order.microbatch[order.forward]] = np.arange(int(order.forward.sum()))
    backwards = np.flatnonzero(~order.forward)
    b_rank = f_rank[order.microbatch[backwards]]
    slots = np.full(len(sends), count, dtype=np.int64)
    for j in np.flatnonzero(forward):
        p, rank = sends[j], f_rank[ids[j]]
        if rank <= 1:
            slots[j] = p + 1
        else:
            later = (backwards > p) & (b_rank >= rank)
            slots[j] = backwards[np.argmax(later)]  # B(m) itself is one
    return np.maximum(slots, _beside_next_op(sends, count))


def _beside_next_op(positions: np.ndarray, count: "int | np.ndarray") -> np.ndarray:
    """The earliest a send's FINISH sits: before the compute op after next (the end of a plan of
    ``count`` ops at the latest), so the transfer runs beside the next one."""
    return np.minimum(positions + 2, count)


def lower_to_instructions(
    order: ComputeOrder,
    stage: int,
    num_stages: int,
    recompute: RecomputeSpec,
    *,
    orders: "Sequence[ComputeOrder] | None" = None,
    chunks: int = 1,
) -> "Instructions":
    """Lower one stage's compute order to its instructions (see the module docstring).

    ``recompute``: one choice for every micro-batch, or a sequence indexed by micro-batch id.
    ``orders``: every stage's order (``orders[stage]`` must be ``order``). With it, each send's
    FINISH sits as early as the neighbour's order allows, but not before the compute op after next
    (which is where it sits in 1F1B and GPipe); without it, where this stage's order alone proves it safe, which can keep
    send buffers longer. Both are deadlock-free for executable FIFO-consistent orders.
    ``chunks``: model chunks a stage holds (interleaved orders); more than one needs ``orders``.
    """
    _check_layout(num_stages, chunks)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside a pipeline of {num_stages} stages")
    parsed = _parse_order(order, stage, chunks=chunks)
    ref = None
    if orders is not None:
        if len(orders) != num_stages:
            raise ValueError(f"{len(orders)} orders for {num_stages} stages")
        all_parsed = [parsed if s == stage else _parse_order(o, s, chunks=chunks) for s, o in enumerate(orders)]
        mine = _parse_order(orders[stage], stage, chunks=chunks)
        if not all(np.array_equal(a, b) for a, b in zip(mine, parsed)):
            raise ValueError(f"orders[{stage}] differs from the order being lowered")
        ref = _Reference(all_parsed, chunks=chunks)
    elif chunks > 1:
        raise ValueError("lowering one stage of an interleaved pipeline needs every stage's order: pass orders=")
    return _lower([(stage, parsed, _recompute_codes(recompute, parsed, chunks))], num_stages, ref, chunks)[0]


def _check_layout(num_stages: int, chunks: int) -> None:
    if num_stages < 1:
        raise ValueError("need at least one stage order")
    if chunks < 1 or (chunks > 1 and num_stages < 2):
        raise ValueError(f"{chunks} model chunks a stage on {num_stages} stage(s): an interleaved pipeline needs "
                         "at least 2 stages, and every stage at least one chunk")


_FORWARD, _BACKWARD, _LOAD_INPUT, _FREE_BUFFER = int(Op.FORWARD), int(Op.BACKWARD), int(Op.LOAD_INPUT), int(Op.FREE_BUFFER)
_RECV_ACT, _RECV_GRAD = int(Op.RECV_ACT_START), int(Op.RECV_GRAD_START)
_SEND_ACT, _SEND_GRAD = int(Op.SEND_ACT_START), int(Op.SEND_GRAD_START)


class _Place(enum.IntEnum):
    """Where an instruction sits within the block of compute op i (see :class:`_Lowering`)."""

    SEND_FINISHES = 0  # of sends made by earlier ops, placed before op i
    RECV_FINISH = 1  # op i's input
    LOAD = 2
    COMPUTE = 3  # op i itself
    SEND_START = 4  # op i's output
    FREE = 5
    NEXT_RECV_STARTS = 6  # the receive of op i + 2


class _Ops(NamedTuple):
    """The compute ops of the stages being lowered, laid end to end, one row each."""

    stage: np.ndarray
    forward: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray  # the stage's model chunk that runs it
    virtual: np.ndarray  # its virtual stage, chunk * num_stages + stage
    position: np.ndarray  # in its stage's order
    recompute: np.ndarray  # code of its micro-batch's recompute on its virtual stage
    num_stages: int

    @classmethod
    def of(cls, stages: Sequence[tuple[int, _Order, np.ndarray]], num_stages: int) -> "_Ops":
        """From (stage, order, [chunk, micro-batch] recompute codes) of each stage to lower."""
        stage = np.concatenate([np.full(len(o.microbatch), s, dtype=np.int64) for s, o, _ in stages])
        chunk = np.concatenate([o.chunk for _, o, _ in stages])
        return cls(stage, np.concatenate([o.forward for _, o, _ in stages]),
                   np.concatenate([o.microbatch for _, o, _ in stages]), chunk, chunk * num_stages + stage,
                   np.concatenate([np.arange(len(o.microbatch)) for _, o, _ in stages]),
                   np.concatenate([codes[o.chunk, o.microbatch] for _, o, codes in stages]), num_stages)


def _neighbour(ops: _Ops, rows: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Stage and chunk of the virtual stage ``step`` (+1: next, -1: before) from each op's."""
    virtual = ops.virtual[rows] + step
    return virtual % ops.num_stages, virtual // ops.num_stages


class _Lowering:
    """The compute ops being lowered, and instructions for them as rows with a sort key (stage,
    block, place, tie): block i of a stage holds its instructions in :class:`_Place` order (block
    -1 posts the receives of ops 0 and 1; block len(order) the last FINISHes). Each pass
    (:data:`_PASSES`) makes one kind of instruction; one sort of the keys, over all stages at
    once, is then every instruction list."""

    def __init__(self, stages: Sequence[tuple[int, _Order, np.ndarray]], num_stages: int, ref: "_Reference | None",
                 chunks: int = 1):
        self.stages, self.num_stages, self.ref = stages, num_stages, ref
        self.ops = ops = _Ops.of(stages, num_stages)
        self.every_op = np.arange(len(ops.stage))
        self.first, self.last = ops.virtual == 0, ops.virtual == chunks * num_stages - 1  # virtual stages
        self.longest = 1 + max((len(o.microbatch) for _, o, _ in stages), default=0)

    def rows(self, where, op, peer=-1, rc=0, *, place: _Place, block=None, tie=0) -> "_Rows":
        """Instructions ``op`` for the compute ops ``where`` (rows), in ``block`` (default: the
        op's own) at ``place`` within it, ordered there by ``tie``."""
        ops, longest = self.ops, self.longest
        block = ops.position[where] if block is None else block
        key = ((ops.stage[where] * (longest + 1) + block + 1) * len(_Place) + place) * longest + tie
        return _Rows(*(c if isinstance(c, np.ndarray) else np.full(len(where), c, dtype=np.int64)
                       for c in (op, ops.microbatch[where], peer, rc, ops.chunk[where], key)))

    def instruction_lists(self, parts: "Sequence[_Rows]") -> list["Instructions"]:
        """Every stage's instructions: ``parts`` sorted by their keys."""
        op, microbatch, peer, rc, chunk, key = (np.concatenate(column) for column in zip(*parts))
        sort = np.argsort(key, kind="stable")
        table = np.empty(len(sort), dtype=ROW)
        table["op"], table["microbatch"], table["peer"], table["recompute"] = op[sort], microbatch[sort], peer[sort], rc[sort]
        table["chunk"] = chunk[sort]
        stage_of_key = key // (len(_Place) * self.longest * (self.longest + 1))
        bounds = np.concatenate([[0], np.cumsum(np.bincount(stage_of_key, minlength=self.num_stages))])
        return [Instructions(table[bounds[s]:bounds[s + 1]]) for s, _, _ in self.stages]


class _Rows(NamedTuple):
    """Instructions a pass made, as columns: op, micro-batch, peer, recompute, chunk, sort key."""

    op: np.ndarray
    microbatch: np.ndarray
    peer: np.ndarray
    recompute: np.ndarray
    chunk: np.ndarray
    key: np.ndarray


def _computes(lowering: _Lowering) -> list[_Rows]:
    """Every FORWARD and BACKWARD, with its micro-batch's recompute."""
    ops = lowering.ops
    return [lowering.rows(lowering.every_op, np.where(ops.forward, _FORWARD, _BACKWARD), rc=ops.recompute,
                          place=_Place.COMPUTE)]


def _loads_and_frees(lowering: _Lowering) -> list[_Rows]:
    """The first stage loads each forward's input; every backward frees its buffers."""
    every, forward = lowering.every_op, lowering.ops.forward
    return [lowering.rows(every[forward & lowering.first], _LOAD_INPUT, place=_Place.LOAD),
            lowering.rows(every[~forward], _FREE_BUFFER, place=_Place.FREE)]


def _receives(lowering: _Lowering) -> list[_Rows]:
    """A forward's activation (not on the first stage) and a backward's gradient (not on the
    last) are received: the START two compute ops ahead, the FINISH right before the op."""
    ops = lowering.ops
    receives = lowering.every_op[np.where(ops.forward, ~lowering.first, ~lowering.last)]
    forward, position = ops.forward[receives], ops.position[receives]
    start = np.where(forward, _RECV_ACT, _RECV_GRAD)
    peer, _ = _neighbour(ops, receives, np.where(forward, -1, 1))
    return [lowering.rows(receives, start, peer, block=np.maximum(position - 2, -1), place=_Place.NEXT_RECV_STARTS,
                          tie=position),
            lowering.rows(receives, start + 1, peer, place=_Place.RECV_FINISH)]


def _sends(lowering: _Lowering) -> list[_Rows]:
    """A forward's activation (not on the last stage) and a backward's gradient (not on the
    first) are sent: the START right after the op, the FINISH as early as provably safe
    (module docstring: placement rule)."""
    ops = lowering.ops
    sends = lowering.every_op[np.where(ops.forward, ~lowering.last, ~lowering.first)]
    forward, stage = ops.forward[sends], ops.stage[sends]
    start = np.where(forward, _SEND_ACT, _SEND_GRAD)
    peer, _ = _neighbour(ops, sends, np.where(forward, 1, -1))
    if lowering.ref is not None:
        slots = _send_finish_slots(ops, sends, lowering.ref)
    else:  # each stage on its own
        slots = np.empty(len(sends), dtype=np.int64)
        for s, order, _ in lowering.stages:
            mine = stage == s
            if mine.any():
                slots[mine] = _send_finish_slots_alone(order, ops.position[sends[mine]])
    return [lowering.rows(sends, start, peer, place=_Place.SEND_START),
            lowering.rows(sends, start + 1, peer, block=slots, place=_Place.SEND_FINISHES, tie=ops.position[sends])]


# Lowering, pass by pass, each making its instructions from the compute ops alone; the deadlock
# proof (check_deadlock_free, build_execution_plans) is the last step, and checks what they made.
_PASSES = (_computes, _loads_and_frees, _receives, _sends)


def _lower(stages: Sequence[tuple[int, _Order, np.ndarray]], num_stages: int,
           ref: "_Reference | None", chunks: int = 1) -> list["Instructions"]:
    """The instruction lists of ``stages`` ((stage, order, [chunk, micro-batch] recompute codes)
    each), from every pass of :data:`_PASSES`."""
    lowering = _Lowering(stages, num_stages, ref, chunks)
    return lowering.instruction_lists([rows for lowering_pass in _PASSES for rows in lowering_pass(lowering)])


def build_execution_plans(
    orders: Sequence[ComputeOrder],
    microbatches: Sequence[MicroBatch],
    recompute: "RecomputeSpec | Sequence[Sequence[RecomputeType | int | str]]",
    schedule: str,
    predicted_makespan_ms: float = 0.0,
    verify: bool = True,
    timeline: "tuple[Sequence[Sequence[float]], Sequence[Sequence[float]]] | None" = None,
    chunks: int = 1,
) -> list[ExecutionPlan]:
    """One validated :class:`ExecutionPlan` per stage, proven deadlock-free.

    ``verify=False`` skips the validation and the deadlock check, which cost many times the
    lowering itself; the planner does so for orders its schedules produce (FIFO-consistent by
    construction, and checked by the test suite).

    ``chunks``: model chunks a stage holds (an interleaved pipeline; chunk c of stage s is
    virtual stage ``c * P + s`` and its order items say their chunk, as
    :class:`~megatron_dynapipe.planning.types.Action` does).
    ``recompute``: one choice for all, one per micro-batch, or one list per virtual stage
    (``[v][m]``, e.g. a ``(P * chunks, n)`` numpy array). ``timeline``: start and end times of
    every stage's compute ops in order, from a simulation of these orders (every op of positive
    duration); send FINISHes are then placed where that timeline says the receive is posted,
    instead of by a timeline of unit durations. Raises ValueError for malformed orders (every
    stage must run F and B of exactly the micro-batches ``0..n-1`` on each chunk) and
    :class:`DeadlockError` when the orders cannot run together (they wait on each other, or pair
    sends and receives differently).
    """
    num_stages = len(orders)
    _check_layout(num_stages, chunks)
    n = len(microbatches)
    codes = _per_stage_recompute(recompute, num_stages * chunks, n)  # [virtual stage, micro-batch]
    parsed = [_parse_order(o, s, check=verify, chunks=chunks) for s, o in enumerate(orders)]
    for s, order in enumerate(parsed):
        forward = order.forward
        ids = np.sort(order.chunk[forward] * max(n, 1) + order.microbatch[forward])
        if not np.array_equal(ids, np.arange(n * chunks)):
            per_chunk = " on each model chunk" if chunks > 1 else ""
            raise ValueError(f"stage {s} order must run micro-batches 0..{n - 1} once each{per_chunk}, got "
                             f"{order.microbatch[forward][:12].tolist()}")
    ref = _Reference(parsed, timeline, chunks)
    by_stage = [codes[rank_rows(s, num_stages, chunks)] for s in range(num_stages)]  # [chunk, micro-batch] each
    rcs = list(RecomputeType)
    lowered = _lower([(s, order, by_stage[s]) for s, order in enumerate(parsed)], num_stages, ref, chunks)
    plans = [ExecutionPlan(stage=s, num_stages=num_stages, schedule=schedule, microbatches=list(microbatches),
                           recompute=[rcs[c] for c in by_stage[s].reshape(-1).tolist()], instructions=instructions,
                           predicted_makespan_ms=predicted_makespan_ms, chunks=chunks)
             for s, instructions in enumerate(lowered)]
    if verify:
        check_deadlock_free(plans)
    return plans


def _per_stage_recompute(recompute, num_stages: int, n: int) -> np.ndarray:
    """[num_stages, n] recompute codes (virtual stages, where stages hold several chunks)."""
    if isinstance(recompute, _ONE_CHOICE):
        return np.full((num_stages, n), int(as_recompute(recompute)), dtype=np.int64)
    rows = recompute if isinstance(recompute, np.ndarray) else list(recompute)
    nested = len(rows) > 0 and not isinstance(rows[0], _ONE_CHOICE)
    if not nested:
        if len(rows) != n:
            raise ValueError(f"{len(rows)} recompute choices for {n} micro-batches")
        return np.tile(_codes(rows), (num_stages, 1))
    if len(rows) != num_stages or any(len(row) != n for row in rows):
        raise ValueError(f"per-stage recompute must be {num_stages} rows of {n} choices (one per virtual stage)")
    return np.stack([_codes(row) for row in rows]) if num_stages else np.zeros((0, n), dtype=np.int64)


def _codes(choices) -> np.ndarray:
    """Recompute codes of a sequence of choices (names, codes or RecomputeType)."""
    if isinstance(choices, np.ndarray) and choices.dtype.kind in "iu":
        unknown = choices[(choices < 0) | (choices > max(RecomputeType))]
        if unknown.size:
            raise ValueError(f"unknown recompute code {unknown[0]}: use 0 (none), 1 (selective) or 2 (full)")
        return choices.astype(np.int64)
    return np.array([int(as_recompute(r)) for r in choices], dtype=np.int64)


