"""Trace a few micro-batches, write many: a pipeline schedule's steady state repeats.

After its warm-up, a 1F1B rank issues the same ops for every micro-batch (a forward, its
sends and receives, a backward), and the interleaved schedule the same ops for every group of
micro-batches; only the micro-batch numbers move on.  So a shapes-only trace of a pipeline with
hundreds of micro-batches need not run them all: the fake rank runs
:func:`recorded_microbatches` of them (enough for two whole steady-state blocks after its
warm-up), and :func:`extend` repeats the last steady block until the trace has the
job's count, renumbering what follows.  The result is op for op the trace a run of every
micro-batch records (tests/tracer/test_steady_state.py compares the two).  A later pipeline
stage warms up shorter and so runs fewer.

A block is found, not assumed: it runs from one pass of micro-batch ``k`` through the first
model chunk to that of ``k + period``; it is steady when it holds as many backwards as forwards,
and it is repeated only when it matches the block before it in every field but micro-batch
numbers, ``seq``, ``coalesced`` ids and start times.  A schedule whose ops do not repeat that way
raises :class:`NotPeriodic`, and the caller traces every micro-batch instead.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_dynapipe.config.megatron_options import warmup_passes
from megatron_dynapipe.tracer.trace_format import TraceOp

__all__ = ["NotPeriodic", "recorded_microbatches", "extend"]


class NotPeriodic(ValueError):
    """A trace holds no two matching steady-state blocks to repeat."""


def recorded_microbatches(num_microbatches: int, pp: int, period: int, chunks: int = 1, stage: int = 0) -> int:
    """How many micro-batches pipeline rank ``stage`` must run for :func:`extend` to reach
    ``num_microbatches``.

    ``period`` is the schedule's group of micro-batches (1 for 1F1B; the pipeline size when
    interleaving over ``chunks`` model chunks).  The rank warms up with ``pp - stage - 1``
    forwards under 1F1B, ``2(pp - stage - 1) + (chunks - 1) pp`` passes when interleaving (later
    stages less); after those come the two blocks to compare and the one after them, the whole
    count rounded so that the micro-batches added are whole periods.
    """
    # the first block wholly past the warm-up
    first_steady = -(-warmup_passes(pp, chunks, stage) // (period * chunks)) * period
    needed = first_steady + 3 * period
    if needed >= num_microbatches:
        return num_microbatches
    return needed + (num_microbatches - needed) % period


def extend(ops: list[TraceOp], num_microbatches: int, period: int) -> list[TraceOp]:
    """``ops`` of a run of fewer micro-batches, each traced iteration extended to
    ``num_microbatches`` by repeating its last steady block (module docstring)."""
    out: list[TraceOp] = []
    shift = _Shift()
    for iteration in dict.fromkeys(op.iteration for op in ops):
        mine = [op for op in ops if op.iteration == iteration]
        out += _extend_iteration(mine, num_microbatches, period, shift)
    return _renumbered(out)


#: ids that count up as a rank issues ops: a repeated block moves them on
_IDS = ("coalesced", "handle")


@dataclasses.dataclass
class _Shift:
    """What repeating blocks adds to every later op: time, coalescing ids and request handles
    (micro-batch numbers restart with each iteration)."""
    us: float = 0.0
    ids: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(_IDS, 0))

    def plus(self, other: "_Shift", times: int = 1) -> "_Shift":
        return _Shift(self.us + times * other.us, {k: self.ids[k] + times * other.ids[k] for k in _IDS})


def _extend_iteration(ops: list[TraceOp], num_microbatches: int, period: int, shift: _Shift) -> list[TraceOp]:
    starts = _block_starts(ops)
    recorded = max(starts) + 1 if starts else 0
    extra = num_microbatches - recorded
    if extra == 0:
        return [_moved(op, 0, shift) for op in ops]
    if extra < 0 or extra % period:
        raise NotPeriodic(f"{recorded} micro-batches traced cannot extend to {num_microbatches} "
                          f"in groups of {period}")
    k = _last_repeating_block(ops, starts, period)
    begin, end = starts[k], starts[k + period]
    step = _step(ops, starts[k - period], begin, end)
    copies = extra // period
    out = [_moved(op, 0, shift) for op in ops[:end]]
    for j in range(1, copies + 1):
        moved = shift.plus(step, j)
        out += [_moved(op, j * period, moved) for op in ops[begin:end]]
    after = shift.plus(step, copies)
    shift.us, shift.ids = after.us, after.ids
    out += [_moved(op, extra, shift) for op in ops[end:]]
    return out


def _block_starts(ops: list[TraceOp]) -> dict[int, int]:
    """Micro-batch -> index of its top-level forward through the first model chunk."""
    return {op.microbatch: i for i, op in enumerate(ops)
            if op.parent is None and op.cat == "compute" and op.kind == "forward" and op.chunk in (None, 0)}


def _last_repeating_block(ops: list[TraceOp], starts: dict[int, int], period: int) -> int:
    """The last steady block ``k`` that matches block ``k - period``."""
    ks = sorted(k for k in starts if k + period in starts and k - period in starts)
    for k in reversed(ks):
        earlier = (starts[k - period], starts[k])
        later = (starts[k], starts[k + period])
        if (_steady(ops, *earlier) and _steady(ops, *later)
                and _keys(ops, *earlier, k - period) == _keys(ops, *later, k)):
            return k
    raise NotPeriodic("no two consecutive steady-state blocks of the trace match")


def _steady(ops: list[TraceOp], lo: int, hi: int) -> bool:
    passes = [op.kind for op in ops[lo:hi] if op.parent is None and op.cat == "compute"]
    return passes.count("forward") > 0 and passes.count("forward") == passes.count("backward")


def _keys(ops: list[TraceOp], lo: int, hi: int, k: int) -> list[tuple]:
    """Ops ``lo:hi`` (the block of micro-batch ``k``) with micro-batch numbers, seqs, coalescing
    ids, request handles and times made relative to the block's start, and the block's length."""
    first = ops[lo]
    base = _first_ids(ops, lo, hi)
    keys = []
    for op in ops[lo:hi]:
        fields = op.to_json()
        fields.update(seq=op.seq - first.seq, start_us=round(op.start_us - first.start_us, 3),
                      microbatch=None if op.microbatch is None else op.microbatch - k,
                      parent=None if op.parent is None else op.parent - first.seq)
        fields.update({name: getattr(op, name) - (base[name] or 0) for name in _IDS if getattr(op, name) is not None})
        keys.append(tuple(sorted((name, repr(value)) for name, value in fields.items())))
    keys.append(("length", round(ops[hi].start_us - first.start_us, 3)))
    return keys


def _first_ids(ops: list[TraceOp], lo: int, hi: int) -> dict[str, Optional[int]]:
    """The least coalescing id and request handle among ops ``lo:hi`` (None: the block has none)."""
    return {name: min((getattr(op, name) for op in ops[lo:hi] if getattr(op, name) is not None), default=None)
            for name in _IDS}


def _step(ops: list[TraceOp], previous: int, begin: int, end: int) -> _Shift:
    """How far one block moves time, coalescing ids and request handles: from block
    ``previous:begin`` to the matching block ``begin:end``."""
    before, now = _first_ids(ops, previous, begin), _first_ids(ops, begin, end)
    return _Shift(us=ops[begin].start_us - ops[previous].start_us,
                  ids={name: 0 if before[name] is None or now[name] is None else now[name] - before[name]
                       for name in _IDS})


def _moved(op: TraceOp, microbatches: int, shift: _Shift) -> TraceOp:
    moved = {name: getattr(op, name) + shift.ids[name] for name in _IDS if getattr(op, name) is not None}
    return dataclasses.replace(op, microbatch=None if op.microbatch is None else op.microbatch + microbatches,
                               start_us=op.start_us + shift.us, **moved)


def _renumbered(ops: list[TraceOp]) -> list[TraceOp]:
    """``seq`` in issue order again.  A parent precedes what it issues, and a repeated block is
    contiguous, so an op's parent is the latest op issued under the parent's old ``seq``."""
    out, latest = [], {}
    for index, op in enumerate(ops):
        parent = None if op.parent is None else latest[op.parent]
        latest[op.seq] = index
        out.append(dataclasses.replace(op, seq=index, parent=parent))
    return out
