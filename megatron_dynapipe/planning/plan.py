"""Execution plans: per-stage instruction lists, their wire format, and a deadlock check.

A schedule arrives as one *order* per pipeline stage, e.g. ``[("F", 0), ("F", 1), ("B", 0), ...]``.
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
* Each send's FINISH goes as early as it provably cannot close a wait cycle: just before the
  next compute op in 1F1B and GPipe, later where the neighbour's order needs it (see below).

Why a send's FINISH cannot always sit before the next compute op: take stage 0 running
``F0 F1 F2 F3 F4 B0 ...`` and stage 1 running ``F0 B0 F1 B1 F2 ...`` (both keep forwards and
backwards in the same micro-batch order, and the pair is executable). With every send finished
before the next op, stage 1 waits after ``B0`` for stage 0 to post its gradient receive (just
before ``F4``) while stage 0 waits after ``F2`` for stage 1 to post the activation receive for
``F2`` (just before ``F1`` on stage 1) -- a deadlock the compute order itself does not have.

Placement rule. A FINISH of a send whose receiver posts its START after the receiver's compute
op ``y`` may sit before the sender's compute op ``x`` only when ``end(y) <= start(x)`` in one
fixed valid timeline of the compute ops: the planner's simulated one, where the FINISH then
sits where the receive is predicted to be posted, or else as-soon-as-possible with forward 1 and
backward 2 time units (every op must take positive time). Then every wait edge of the lowered
plans (a RECV_FINISH waits for the producing op, a SEND_FINISH for such a ``y``, program order)
points forward in that timeline, so the stage whose
next compute op starts earliest can always progress: no cycle, no deadlock, for *any* set of
orders that is executable and FIFO-consistent (every stage forwards the micro-batches in the
same order and runs the backwards in the same order -- needed anyway because untagged sends
and receives pair up in posting order). Without the other stages' orders, the rule falls back
to what this stage's order proves alone: an activation send finishes before the first backward
of a micro-batch forwarded no earlier (at latest its own ``B(m)``; right away for the first two
forwards, whose receives are posted at the start), a gradient send before the end.
"""

from __future__ import annotations

import enum
import functools
import re
import struct
import zlib
from collections import deque
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, NoReturn, Sequence, Union

import numpy as np

from megatron_dynapipe.planning.types import MicroBatch, RecomputeType

__all__ = [
    "Op",
    "Instruction",
    "Instructions",
    "ExecutionPlan",
    "DeadlockError",
    "CommMismatchError",
    "lower_to_instructions",
    "build_execution_plans",
    "check_deadlock_free",
]

ComputeOrder = Sequence[tuple[str, int]]  # ("F" | "B", micro-batch), in execution order
RecomputeSpec = Union[RecomputeType, int, str, Sequence["RecomputeType | int | str"]]

# Durations of the reference timeline used to place send FINISHes. Any positive values keep the
# plans deadlock-free; these only decide how early a FINISH may sit in unusual orders.
_FORWARD_TIME, _BACKWARD_TIME = 1.0, 2.0


class Op(enum.IntEnum):
    """Instruction kinds. The values are the wire format: never renumber, only append."""

    LOAD_INPUT = 0
    FORWARD = 1
    BACKWARD = 2
    RECV_ACT_START = 3
    RECV_ACT_FINISH = 4
    SEND_ACT_START = 5
    SEND_ACT_FINISH = 6
    RECV_GRAD_START = 7
    RECV_GRAD_FINISH = 8
    SEND_GRAD_START = 9
    SEND_GRAD_FINISH = 10
    FREE_BUFFER = 11

    @property
    def is_compute(self) -> bool:
        return self == 1 or self == 2

    @property
    def is_comm(self) -> bool:
        return 3 <= self <= 10

    @property
    def is_start(self) -> bool:
        return self in _STARTS

    @property
    def is_finish(self) -> bool:
        return self in _FINISHES

    @property
    def is_send(self) -> bool:
        return self in _SENDS

    @property
    def finish(self) -> "Op":
        """The FINISH that completes this START."""
        if not self.is_start:
            raise ValueError(f"{self.name} is not a START op")
        return Op(self + 1)

    @property
    def start(self) -> "Op":
        """The START that this FINISH completes."""
        if not self.is_finish:
            raise ValueError(f"{self.name} is not a FINISH op")
        return Op(self - 1)


_STARTS = frozenset({Op.RECV_ACT_START, Op.SEND_ACT_START, Op.RECV_GRAD_START, Op.SEND_GRAD_START})
_FINISHES = frozenset({Op.RECV_ACT_FINISH, Op.SEND_ACT_FINISH, Op.RECV_GRAD_FINISH, Op.SEND_GRAD_FINISH})
_SENDS = frozenset({Op.SEND_ACT_START, Op.SEND_ACT_FINISH, Op.SEND_GRAD_START, Op.SEND_GRAD_FINISH})
_START_OF = {op: op for op in _STARTS} | {op: Op(op - 1) for op in _FINISHES}
_COMM_NAMES = {
    Op.RECV_ACT_START: "RecvActStart",
    Op.RECV_ACT_FINISH: "RecvActFinish",
    Op.SEND_ACT_START: "SendActStart",
    Op.SEND_ACT_FINISH: "SendActFinish",
    Op.RECV_GRAD_START: "RecvGradStart",
    Op.RECV_GRAD_FINISH: "RecvGradFinish",
    Op.SEND_GRAD_START: "SendGradStart",
    Op.SEND_GRAD_FINISH: "SendGradFinish",
}

_COMM_OPS = {name: op for op, name in _COMM_NAMES.items()}
_TEXT_FORM = re.compile(r"(?:(F|B|Load|Free)(\d+)(?:\[(\w+)\])?"
                        r"|(" + "|".join(_COMM_OPS) + r")\((\d+)(->|<-)s(\d+)\))")


@dataclass(frozen=True)
class Instruction:
    """One step of a stage's plan.

    ``peer`` is the other stage of a communication op (-1 for the rest); ``recompute`` says how
    a FORWARD stores its activations and how the matching BACKWARD rebuilds them.
    ``FREE_BUFFER(m)`` releases what the stage keeps of micro-batch ``m`` (stored activations,
    received tensors); a tensor still being sent stays owned by its send until the FINISH.
    """

    op: Op
    microbatch: int
    peer: int = -1
    recompute: RecomputeType = RecomputeType.NONE

    def __post_init__(self) -> None:
        if type(self.op) is not Op:
            object.__setattr__(self, "op", Op(self.op))
        if type(self.recompute) is not RecomputeType:
            object.__setattr__(self, "recompute", RecomputeType.parse(self.recompute))
        if self.microbatch < 0:
            raise ValueError(f"{self.op.name}: micro-batch id must be >= 0, got {self.microbatch}")

    def __str__(self) -> str:
        op, m = self.op, self.microbatch
        if op.is_compute:
            tag = "" if self.recompute == RecomputeType.NONE else f"[{self.recompute.label}]"
            return f"{'F' if op == Op.FORWARD else 'B'}{m}{tag}"
        if op.is_comm:
            return f"{_COMM_NAMES[op]}({m}{'->' if op.is_send else '<-'}s{self.peer})"
        return f"{'Load' if op == Op.LOAD_INPUT else 'Free'}{m}"

    @classmethod
    def _trusted(cls, op: Op, microbatch: int, peer: int = -1,
                 recompute: RecomputeType = RecomputeType.NONE) -> "Instruction":
        """An instruction from values the lowering already knows are valid, without __init__'s
        checks and frozen-field setters (half the cost of a plan of thousands of instructions)."""
        instruction = object.__new__(cls)
        instruction.__dict__.update(op=op, microbatch=microbatch, peer=peer, recompute=recompute)
        return instruction

    @classmethod
    def parse(cls, text: str) -> "Instruction":
        """The instruction ``str(instruction)`` printed: ``F3[selective]``, ``B3``, ``Load0``,
        ``Free2``, ``SendActStart(1->s2)``, ``RecvGradFinish(1<-s2)``."""
        match = _TEXT_FORM.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"{text!r} is not an instruction: write F<m>[recompute], B<m>[recompute], Load<m>, "
                             "Free<m> or e.g. SendActStart(<m>->s<peer>), RecvActFinish(<m><-s<peer>)")
        name, m, recompute, comm, comm_m, arrow, peer = match.groups()
        if comm is not None:
            op = _COMM_OPS[comm]
            if (arrow == "->") != op.is_send:
                raise ValueError(f"{text!r}: a {'send' if op.is_send else 'receive'} points "
                                 f"{'->' if op.is_send else '<-'} its peer")
            return cls(op, int(comm_m), int(peer))
        op = {"F": Op.FORWARD, "B": Op.BACKWARD, "Load": Op.LOAD_INPUT, "Free": Op.FREE_BUFFER}[name]
        if recompute is not None and not op.is_compute:
            raise ValueError(f"{text!r}: only F and B carry a recompute type")
        return cls(op, int(m), recompute=RecomputeType.parse(recompute or "none"))

    @property
    def transfer(self) -> tuple[Op, int, int]:
        """(START op, micro-batch, peer): what links a START to its FINISH."""
        return (_START_OF[self.op], self.microbatch, self.peer)


class DeadlockError(ValueError):
    """The plans cannot all run to the end; ``blocked`` maps stage -> (index, instruction)."""

    def __init__(self, message: str, blocked: "dict[int, tuple[int, Instruction]] | None" = None):
        super().__init__(message)
        self.blocked = dict(blocked or {})


class CommMismatchError(DeadlockError):
    """Sends and receives between two stages pair up in posting order, and a pair disagrees."""


class _Where:
    """Lazily formatted "stage s plan, instruction #i ..." prefix of validation errors."""

    __slots__ = ("plan", "index", "instruction")

    def __init__(self, plan: str, index: int, instruction: Instruction):
        self.plan, self.index, self.instruction = plan, index, instruction

    def __format__(self, spec: str) -> str:
        return f"{self.plan}, instruction #{self.index} {self.instruction}"


# ---------------------------------------------------------------------------------------------
# ExecutionPlan and its wire format
# ---------------------------------------------------------------------------------------------

_MAGIC = b"DPEP"
# magic, version, flags, stage, num_stages, microbatches, samples, instructions, schedule bytes,
# predicted makespan
_HEADER = struct.Struct("<4sHHIIIIIHd")
_CRC = struct.Struct("<I")
_INSTR_DTYPE = np.dtype([("op", "u1"), ("recompute", "u1"), ("peer", "<i2"), ("microbatch", "<u4")])
_U32_MAX = 2**32 - 1


class Instructions(Sequence[Instruction]):
    """A stage's instructions, held as the rows of the wire format (op, recompute, peer,
    micro-batch): lowering and serialising thousands of them makes no object per instruction.
    Reading them (indexing, iterating) makes the :class:`Instruction` objects, once."""

    __slots__ = ("rows", "_objects")

    def __init__(self, rows: np.ndarray, objects: "list[Instruction] | None" = None):
        self.rows = rows  # structured array of _INSTR_DTYPE
        self._objects = objects

    @classmethod
    def of(cls, instructions: "Sequence[Instruction] | Instructions") -> "Instructions":
        if isinstance(instructions, Instructions):
            return instructions
        items = list(instructions)
        try:
            rows = np.array([(i.op, i.recompute, i.peer, i.microbatch) for i in items], dtype=_INSTR_DTYPE)
        except OverflowError:
            raise ValueError("an instruction's peer or micro-batch is outside the wire format's 16/32-bit "
                             "fields: use stages below 32768 and micro-batch ids below 2**32") from None
        return cls(rows, items)

    def _list(self) -> list[Instruction]:
        if self._objects is None:
            ops, rcs, make, rows = list(Op), list(RecomputeType), Instruction._trusted, self.rows
            self._objects = [make(ops[o], m, p, rcs[r]) for o, r, p, m in zip(
                rows["op"].tolist(), rows["recompute"].tolist(), rows["peer"].tolist(), rows["microbatch"].tolist())]
        return self._objects

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        return self._list()[index]

    def __iter__(self):
        return iter(self._list())

    def __add__(self, other) -> list[Instruction]:
        return self._list() + list(other)

    def __radd__(self, other) -> list[Instruction]:
        return list(other) + self._list()

    def __eq__(self, other) -> bool:
        if isinstance(other, Instructions):
            return len(self) == len(other) and self.rows.tobytes() == other.rows.tobytes()
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return self._list() == list(other)
        return NotImplemented

    __hash__ = None  # mutable rows

    def __repr__(self) -> str:
        return f"Instructions([{', '.join(map(str, self))}])"


@dataclass
class ExecutionPlan:
    """What one pipeline stage of one data-parallel rank runs for one global batch.

    Wire format (:meth:`to_bytes`, all little-endian): a 38-byte header (magic ``b"DPEP"``, u16
    version, u16 flags = 0, u32 stage, num_stages, micro-batch count, total sample count,
    instruction count, u16 schedule-name length, f64 predicted makespan), the UTF-8 schedule
    name, then per micro-batch u32 sequence length, u32 sample count and u8 recompute, the u32
    sample indices of all micro-batches in turn, 8 bytes per instruction (u8 op, u8 recompute,
    i16 peer, u32 micro-batch), and a CRC-32 of everything before it.
    """

    stage: int
    num_stages: int
    schedule: str
    microbatches: list[MicroBatch]
    recompute: list[RecomputeType]
    instructions: Instructions  # any sequence of Instruction is taken
    predicted_makespan_ms: float = 0.0
    VERSION: ClassVar[int] = 1

    def __post_init__(self) -> None:
        self.microbatches = list(self.microbatches)
        self.recompute = [_parse_recompute(r) for r in self.recompute]
        self.instructions = Instructions.of(self.instructions)
        self.predicted_makespan_ms = float(self.predicted_makespan_ms)
        if not 0 <= self.stage < self.num_stages:
            raise ValueError(f"stage {self.stage} is outside a pipeline of {self.num_stages} stages")
        if len(self.recompute) != len(self.microbatches):
            raise ValueError(
                f"{len(self.recompute)} recompute choices for {len(self.microbatches)} micro-batches"
            )

    # -- structure ---------------------------------------------------------------------------

    def validate(self) -> None:
        """Raise ValueError unless the instructions are a well-formed plan for this stage.

        Checks: micro-batch ids and peers in range; comm ops name another stage and other ops
        none; every START has exactly one later FINISH and every FINISH an earlier START; each
        micro-batch has exactly one FORWARD and one BACKWARD, with the plan's recompute choice;
        a FORWARD has its input (LOAD_INPUT or RECV_ACT_FINISH) before it; a BACKWARD has its
        FORWARD and, except on the last stage, its RECV_GRAD_FINISH before it; FREE_BUFFER at
        most once, after the BACKWARD.
        """
        n, where = len(self.microbatches), f"stage {self.stage} plan"
        forwards: dict[int, int] = {}
        backwards: dict[int, int] = {}
        inputs: set[int] = set()
        grads: set[int] = set()
        freed: set[int] = set()
        open_transfers: dict[tuple[Op, int, int], int] = {}
        closed: set[tuple[Op, int, int]] = set()
        for i, ins in enumerate(self.instructions):
            op, m = ins.op, ins.microbatch
            here = _Where(where, i, ins)
            if m >= n:
                raise ValueError(f"{here}: micro-batch {m} does not exist (the plan has {n})")
            if op.is_comm:
                if not 0 <= ins.peer < self.num_stages or ins.peer == self.stage:
                    raise ValueError(f"{here}: peer must be another stage in 0..{self.num_stages - 1}")
            elif ins.peer != -1:
                raise ValueError(f"{here}: only communication ops name a peer")
            if op.is_start:
                key = ins.transfer
                if key in open_transfers or key in closed:
                    raise ValueError(f"{here}: the same transfer is started twice")
                open_transfers[key] = i
            elif op.is_finish:
                key = ins.transfer
                if key not in open_transfers:
                    raise ValueError(f"{here}: FINISH without an earlier matching START")
                del open_transfers[key]
                closed.add(key)
                if op == Op.RECV_ACT_FINISH:
                    inputs.add(m)
                elif op == Op.RECV_GRAD_FINISH:
                    grads.add(m)
            elif op == Op.LOAD_INPUT:
                inputs.add(m)
            elif op == Op.FORWARD:
                if m in forwards:
                    raise ValueError(f"{here}: second FORWARD of micro-batch {m} (first at #{forwards[m]})")
                if m not in inputs:
                    raise ValueError(f"{here}: FORWARD before its input (LOAD_INPUT or RECV_ACT_FINISH)")
                forwards[m] = i
            elif op == Op.BACKWARD:
                if m in backwards:
                    raise ValueError(f"{here}: second BACKWARD of micro-batch {m} (first at #{backwards[m]})")
                if m not in forwards:
                    raise ValueError(f"{here}: BACKWARD before the FORWARD of micro-batch {m}")
                if self.stage != self.num_stages - 1 and m not in grads:
                    raise ValueError(f"{here}: BACKWARD before its RECV_GRAD_FINISH")
                backwards[m] = i
            elif op == Op.FREE_BUFFER:
                if m in freed or m not in backwards:
                    raise ValueError(f"{here}: FREE_BUFFER must come once, after the BACKWARD")
                freed.add(m)
            if op.is_compute and ins.recompute != self.recompute[m]:
                raise ValueError(
                    f"{here}: recompute {ins.recompute.label} differs from the plan's "
                    f"{self.recompute[m].label} for micro-batch {m}"
                )
        if open_transfers:
            key, i = min(open_transfers.items(), key=lambda kv: kv[1])
            raise ValueError(f"{where}: instruction #{i} {self.instructions[i]} is never finished")
        missing = [m for m in range(n) if m not in backwards]  # a BACKWARD implies its FORWARD
        if missing:
            raise ValueError(f"{where}: micro-batches {missing[:10]} lack a FORWARD or BACKWARD")

    # -- serialisation -----------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """Compact binary form (see the class docstring); :meth:`from_bytes` reads it back."""
        schedule = self.schedule.encode("utf-8")
        n = len(self.microbatches)
        if len(schedule) > 0xFFFF:
            raise ValueError("schedule name is longer than 65535 bytes")
        if self.num_stages > 0x7FFF:
            raise ValueError(f"{self.num_stages} stages do not fit the 16-bit peer field")
        seq_lens = np.array([mb.seq_len for mb in self.microbatches], dtype=np.int64)
        sizes = np.array([mb.size for mb in self.microbatches], dtype=np.int64)
        samples = np.fromiter((x for mb in self.microbatches for x in mb.samples), dtype=np.int64,
                              count=int(sizes.sum()))
        for name, arr in (("sequence length", seq_lens), ("sample index", samples)):
            if arr.size and (arr.min() < 0 or arr.max() > _U32_MAX):
                raise ValueError(f"a micro-batch {name} is outside 0..{_U32_MAX}")
        header = _HEADER.pack(
            _MAGIC, self.VERSION, 0, self.stage, self.num_stages, n, samples.size,
            len(self.instructions), len(schedule), self.predicted_makespan_ms,
        )
        body = b"".join([
            header,
            schedule,
            seq_lens.astype("<u4").tobytes(),
            sizes.astype("<u4").tobytes(),
            np.array([int(r) for r in self.recompute], dtype="u1").tobytes(),
            samples.astype("<u4").tobytes(),
            self.instructions.rows.tobytes(),
        ])
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: "bytes | bytearray | memoryview") -> "ExecutionPlan":
        """Parse :meth:`to_bytes` output; ValueError on anything else (wrong magic, version,
        truncated or trailing bytes, corrupted content)."""
        data = bytes(data)
        if data[:4] != _MAGIC:
            raise ValueError(f"not a serialised ExecutionPlan: expected magic {_MAGIC!r}, got {data[:4]!r}")
        if len(data) < 6:
            raise ValueError(f"truncated ExecutionPlan: {len(data)} bytes end inside the header")
        (version,) = struct.unpack_from("<H", data, 4)
        if version != cls.VERSION:
            raise ValueError(
                f"unsupported ExecutionPlan format version {version}: this build reads version {cls.VERSION}"
            )
        if len(data) < _HEADER.size:
            raise ValueError(
                f"truncated ExecutionPlan: {len(data)} bytes, the header alone needs {_HEADER.size}"
            )
        (_, _, flags, stage, num_stages, n, n_samples, n_instr, sched_len,
         makespan) = _HEADER.unpack_from(data, 0)
        if flags:
            raise ValueError(f"unsupported ExecutionPlan flags {flags:#x}")
        expected = _HEADER.size + sched_len + 9 * n + 4 * n_samples + _INSTR_DTYPE.itemsize * n_instr + _CRC.size
        if len(data) < expected:
            raise ValueError(
                f"truncated ExecutionPlan: the header announces {expected} bytes, got {len(data)}"
            )
        if len(data) > expected:
            raise ValueError(
                f"malformed ExecutionPlan: {len(data) - expected} trailing bytes after the announced {expected}"
            )
        (crc,) = _CRC.unpack_from(data, expected - _CRC.size)
        if zlib.crc32(memoryview(data)[: expected - _CRC.size]) != crc:
            raise ValueError("corrupted ExecutionPlan: checksum mismatch")

        pos = _HEADER.size

        def take(dtype: str, count: int) -> np.ndarray:
            nonlocal pos
            arr = np.frombuffer(data, dtype=dtype, count=count, offset=pos)
            pos += arr.nbytes
            return arr

        try:
            schedule = data[pos: pos + sched_len].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"corrupted ExecutionPlan: schedule name is not UTF-8 ({exc})") from None
        pos += sched_len
        seq_lens = take("<u4", n).tolist()
        sizes = take("<u4", n).tolist()
        rc_codes = take("u1", n).tolist()
        samples = take("<u4", n_samples).tolist()
        instrs = np.frombuffer(data, dtype=_INSTR_DTYPE, count=n_instr, offset=pos)
        if sum(sizes) != n_samples:
            raise ValueError(f"corrupted ExecutionPlan: micro-batch sizes sum to {sum(sizes)}, not {n_samples}")
        microbatches, at = [], 0
        for seq_len, size in zip(seq_lens, sizes):
            microbatches.append(MicroBatch(tuple(samples[at: at + size]), seq_len))
            at += size
        rc_values = {int(r) for r in RecomputeType}
        op_values = {int(o) for o in Op}
        bad_rc = set(rc_codes) - rc_values
        bad_rc |= set(np.unique(instrs["recompute"]).tolist()) - rc_values
        bad_ops = set(np.unique(instrs["op"]).tolist()) - op_values
        if bad_rc or bad_ops:
            raise ValueError(
                f"corrupted ExecutionPlan: unknown op codes {sorted(bad_ops)} / recompute codes {sorted(bad_rc)}"
            )
        rcs = list(RecomputeType)
        return cls(stage=stage, num_stages=num_stages, schedule=schedule, microbatches=microbatches,
                   recompute=[rcs[r] for r in rc_codes], instructions=Instructions(instrs),
                   predicted_makespan_ms=makespan)

    # -- display -----------------------------------------------------------------------------

    def summary(self, max_rows: "int | None" = None) -> str:
        """Header, micro-batch table and the instructions, one row per compute op (a row ends at
        the FORWARD/BACKWARD that the communication before it serves)."""
        tokens = sum(mb.tokens for mb in self.microbatches)
        lines = [
            f"ExecutionPlan stage {self.stage}/{self.num_stages} schedule={self.schedule} "
            f"micro-batches={len(self.microbatches)} tokens={tokens} instructions={len(self.instructions)} "
            f"predicted={self.predicted_makespan_ms:.3f} ms"
        ]
        for m, (mb, rc) in enumerate(zip(self.microbatches, self.recompute)):
            lines.append(f"  mb {m:>3}: {mb.size} x {mb.seq_len} ({mb.tokens} tokens) recompute={rc.label}")
        rows: list[str] = []
        row: list[str] = []
        for ins in self.instructions:
            row.append(str(ins))
            if ins.op.is_compute:
                rows.append(" ".join(row))
                row = []
        if row:
            rows.append(" ".join(row))
        shown = rows if max_rows is None else rows[:max_rows]
        lines += [f"  | {r}" for r in shown]
        if len(shown) < len(rows):
            lines.append(f"  | ... {len(rows) - len(shown)} more rows")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


# ---------------------------------------------------------------------------------------------
# Lowering
# ---------------------------------------------------------------------------------------------


class _Order(NamedTuple):
    """One stage's compute order as arrays: which ops are forwards, and of which micro-batch."""

    forward: np.ndarray  # bool, per compute op
    microbatch: np.ndarray  # int64, per compute op


def _parse_order(order: ComputeOrder, stage: int, check: bool = True) -> _Order:
    """The order as arrays, or ValueError naming the first item that breaks it (``check=False``:
    an order a schedule made, trusted to be well formed)."""
    try:
        if check and any(len(item) != 2 for item in order):
            raise ValueError  # zip would drop a longer item's extras
        kinds, ids = zip(*order) if len(order) else ((), ())
        microbatch = np.array(ids, dtype=np.int64)
        kinds = np.array(kinds, dtype=object)
    except (TypeError, ValueError, OverflowError):
        _explain_bad_order(order, stage)
    forward, backward = kinds == "F", kinds == "B"
    if not check or _well_formed(forward, backward, microbatch):
        return _Order(forward, microbatch)
    _explain_bad_order(order, stage)


def _well_formed(forward: np.ndarray, backward: np.ndarray, microbatch: np.ndarray) -> bool:
    """Every item F or B of a micro-batch >= 0, each once, and each B after its F."""
    if not np.all(forward | backward) or (microbatch.size and microbatch.min() < 0):
        return False
    positions = np.arange(len(microbatch))
    f_order, b_order = np.argsort(microbatch[forward], kind="stable"), np.argsort(microbatch[backward], kind="stable")
    f_ids, b_ids = microbatch[forward][f_order], microbatch[backward][b_order]
    return (np.array_equal(f_ids, b_ids) and bool(np.all(np.diff(f_ids) > 0))
            and bool(np.all(positions[backward][b_order] > positions[forward][f_order])))


def _explain_bad_order(order: ComputeOrder, stage: int) -> NoReturn:
    seen: dict[tuple[str, int], int] = {}
    for i, item in enumerate(order):
        try:
            kind, m = item
            kind, m = str(kind), int(m)
        except (TypeError, ValueError):
            raise ValueError(f"stage {stage} order item #{i} {item!r} is not a (\"F\"|\"B\", micro-batch) pair") from None
        if kind not in ("F", "B"):
            raise ValueError(f"stage {stage} order item #{i} {item!r}: kind must be \"F\" or \"B\"")
        if m < 0:
            raise ValueError(f"stage {stage} order item #{i} {item!r}: micro-batch must be >= 0")
        if (kind, m) in seen:
            raise ValueError(f"stage {stage} order has {kind}{m} twice (#{seen[kind, m]} and #{i})")
        if kind == "B" and ("F", m) not in seen:
            raise ValueError(f"stage {stage} order runs B{m} before F{m}")
        seen[kind, m] = i
    unmatched = sorted(m for kind, m in seen if kind == "F" and ("B", m) not in seen)
    raise ValueError(f"stage {stage} order has no backward for micro-batches {unmatched[:10]}")


def _recompute_codes(recompute: RecomputeSpec, order: _Order) -> np.ndarray:
    """The recompute code of every micro-batch the order forwards, indexed by micro-batch id."""
    size = int(order.microbatch.max()) + 1 if order.microbatch.size else 0
    if isinstance(recompute, _ONE_CHOICE):
        return np.full(size, int(_parse_recompute(recompute)), dtype=np.int64)
    if size > len(recompute):
        raise ValueError(f"no recompute choice for micro-batch {size - 1} (got {len(recompute)})")
    return _codes(recompute[:size])


_ONE_CHOICE = (RecomputeType, int, str, np.integer)  # a recompute spec that is one choice, not one per micro-batch


def _parse_recompute(r) -> RecomputeType:
    return r if type(r) is RecomputeType else RecomputeType.parse(int(r) if isinstance(r, np.integer) else r)


def _timeline(orders: Sequence[_Order]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """As-soon-as-possible start/end of every compute op (forward 1, backward 2): F(m) waits for
    F(m) on the stage before, B(m) for B(m) on the stage after. Ops that never become runnable
    (the orders wait on each other) get +inf."""
    pp = len(orders)
    inf = float("inf")
    ops = [list(zip(o.forward.tolist(), o.microbatch.tolist())) for o in orders]
    start = [[inf] * len(o) for o in ops]
    end = [[inf] * len(o) for o in ops]
    done: list[dict[bool, dict[int, float]]] = [{True: {}, False: {}} for _ in range(pp)]
    pc = [0] * pp
    free = [0.0] * pp
    progressed = True
    while progressed:
        progressed = False
        for s in range(pp):
            order, i, t = ops[s], pc[s], free[s]
            before = done[s - 1][True] if s > 0 else None
            after = done[s + 1][False] if s + 1 < pp else None
            mine = done[s]
            while i < len(order):
                forward, m = order[i]
                deps = before if forward else after
                ready = 0.0 if deps is None else deps.get(m)
                if ready is None:
                    break
                t0 = t if t > ready else ready
                t = t0 + (_FORWARD_TIME if forward else _BACKWARD_TIME)
                start[s][i], end[s][i] = t0, t
                mine[forward][m] = t
                i += 1
            if i > pc[s]:
                pc[s], free[s], progressed = i, t, True
    return [np.array(x) for x in start], [np.array(x) for x in end]


class _Reference:
    """What placing send FINISHes against the other stages needs: every stage's order and one
    valid timeline of their compute ops (start/end per stage, in order). Any timeline in which
    each op starts after its inputs' producers end and after the op before it on its stage,
    with every op of positive duration, keeps the plans deadlock-free (module docstring)."""

    def __init__(self, orders: Sequence[_Order], timeline: "tuple[Sequence, Sequence] | None" = None):
        self.orders = orders
        if timeline is not None:
            start, end = ([np.asarray(t, dtype=float) for t in times] for times in timeline)
            if len(start) != len(orders) or len(end) != len(orders) or any(
                    len(a) != len(o.microbatch) or len(b) != len(o.microbatch) for a, b, o in zip(start, end, orders)):
                raise ValueError("the timeline must give a start and an end for every compute op of every stage")
            # a zero-length op could tie two waits into a cycle: use the unit-duration timeline then
            if all(np.all(b > a) for a, b in zip(start, end)):
                self.start, self.end = start, end
                return
        self.start, self.end = _timeline(orders)

    @functools.cached_property
    def end_flat(self) -> np.ndarray:
        return np.concatenate(self.end) if self.end else np.zeros(0)

    @functools.cached_property
    def offset(self) -> np.ndarray:
        """Where each stage's ops begin in the stages' orders laid end to end."""
        return np.concatenate([[0], np.cumsum([len(o.microbatch) for o in self.orders])]).astype(np.int64)

    @functools.cached_property
    def _lookup(self) -> tuple[np.ndarray, np.ndarray, int]:
        """Sorted keys (stage, kind, micro-batch) of every op and their positions in their stage."""
        width = 1 + max((int(o.microbatch.max()) for o in self.orders if o.microbatch.size), default=0)
        keys = np.concatenate([(2 * s + ~o.forward) * width + o.microbatch for s, o in enumerate(self.orders)])
        positions = np.concatenate([np.arange(len(o.microbatch)) for o in self.orders])
        by_key = np.argsort(keys, kind="stable")
        return keys[by_key], positions[by_key], width

    def position(self, stage: np.ndarray, forward: np.ndarray, microbatch: np.ndarray) -> np.ndarray:
        """Where F (forward) or B of each micro-batch sits in that stage's order; -1 where not."""
        keys, positions, width = self._lookup
        query = (2 * stage + ~forward) * width + microbatch
        found = np.minimum(np.searchsorted(keys, query), max(len(keys) - 1, 0))
        hit = (microbatch < width) & (keys[found] == query) if len(keys) else np.zeros(len(query), bool)
        return np.where(hit, positions[found] if len(keys) else -1, -1)


def _send_finish_slots(ops: "_Ops", sends: np.ndarray, ref: _Reference) -> np.ndarray:
    """For the compute ops ``sends`` (row indices into ``ops``, ops that send), the position in
    their stage's order of the compute op each send's FINISH goes before (``len(order)``: the
    end of the plan)."""
    stage, forward, ids = ops.stage[sends], ops.forward[sends], ops.microbatch[sends]
    peer = np.where(forward, stage + 1, stage - 1)
    c = ref.position(peer, forward, ids)
    if np.any(c < 0):
        bad = int(np.argmax(c < 0))
        raise ValueError(f"stage {peer[bad]} order has no {'F' if forward[bad] else 'B'}{ids[bad]} "
                         f"to receive stage {stage[bad]}'s send")
    # the receive is posted after the peer's compute op c - 2 (ops 0 and 1: from the start)
    posted = np.where(c <= 1, -np.inf, ref.end_flat[ref.offset[peer] + np.maximum(c - 2, 0)])
    slots = ops.position[sends] + 1
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
    return slots


def lower_to_instructions(
    order: ComputeOrder,
    stage: int,
    num_stages: int,
    recompute: RecomputeSpec,
    *,
    orders: "Sequence[ComputeOrder] | None" = None,
) -> "Instructions":
    """Lower one stage's compute order to its instructions (see the module docstring).

    ``recompute``: one choice for every micro-batch, or a sequence indexed by micro-batch id.
    ``orders``: every stage's order (``orders[stage]`` must be ``order``). With it, each send's
    FINISH sits as early as the neighbour's order allows (before the very next compute op in
    1F1B and GPipe); without it, where this stage's order alone proves it safe, which can keep
    send buffers longer. Both are deadlock-free for executable FIFO-consistent orders.
    """
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside a pipeline of {num_stages} stages")
    parsed = _parse_order(order, stage)
    ref = None
    if orders is not None:
        if len(orders) != num_stages:
            raise ValueError(f"{len(orders)} orders for {num_stages} stages")
        all_parsed = [parsed if s == stage else _parse_order(o, s) for s, o in enumerate(orders)]
        mine = _parse_order(orders[stage], stage)
        if not (np.array_equal(mine.forward, parsed.forward) and np.array_equal(mine.microbatch, parsed.microbatch)):
            raise ValueError(f"orders[{stage}] differs from the order being lowered")
        ref = _Reference(all_parsed)
    return _lower([(stage, parsed, _recompute_codes(recompute, parsed))], num_stages, ref)[0]


_FORWARD, _BACKWARD, _LOAD_INPUT, _FREE_BUFFER = int(Op.FORWARD), int(Op.BACKWARD), int(Op.LOAD_INPUT), int(Op.FREE_BUFFER)
_RECV_ACT, _RECV_GRAD = int(Op.RECV_ACT_START), int(Op.RECV_GRAD_START)
_SEND_ACT, _SEND_GRAD = int(Op.SEND_ACT_START), int(Op.SEND_GRAD_START)
# Where an instruction sits within the block of compute op i (see _lower).
_SEND_FINISHES, _RECV_FINISH, _LOAD, _COMPUTE, _SEND_START, _FREE, _NEXT_RECV_STARTS = range(7)


class _Ops(NamedTuple):
    """The compute ops of the stages being lowered, laid end to end, one row each."""

    stage: np.ndarray
    forward: np.ndarray
    microbatch: np.ndarray
    position: np.ndarray  # in its stage's order
    recompute: np.ndarray  # code of its micro-batch's recompute on its stage

    @classmethod
    def of(cls, stages: Sequence[tuple[int, _Order, np.ndarray]]) -> "_Ops":
        """From (stage, order, recompute codes by micro-batch id) of each stage to lower."""
        return cls(np.concatenate([np.full(len(o.microbatch), s, dtype=np.int64) for s, o, _ in stages]),
                   np.concatenate([o.forward for _, o, _ in stages]),
                   np.concatenate([o.microbatch for _, o, _ in stages]),
                   np.concatenate([np.arange(len(o.microbatch)) for _, o, _ in stages]),
                   np.concatenate([codes[o.microbatch] for _, o, codes in stages]))


def _lower(stages: Sequence[tuple[int, _Order, np.ndarray]], num_stages: int,
           ref: "_Reference | None") -> list["Instructions"]:
    """Every instruction gets a sort key (stage, block, place, tie): block i of a stage holds, in
    this order, the send FINISHes placed before compute op i (by the op that sent), op i's
    receive FINISH, its LOAD_INPUT, the op itself, its send START, its FREE_BUFFER, and the
    receive START of op i + 2 (block -1 posts the receives of ops 0 and 1; block len(order) the
    last FINISHes). One sort of the keys, over all stages at once, is every instruction list."""
    ops = _Ops.of(stages)
    stage, forward, position = ops.stage, ops.forward, ops.position
    first, last = stage == 0, stage == num_stages - 1
    rows = np.arange(len(stage))
    longest = 1 + max((len(o.microbatch) for _, o, _ in stages), default=0)
    parts = []  # (op, micro-batch, peer, recompute, sort key) arrays

    def add(where, op, peer=-1, rc=0, block=None, place=0, tie=0):
        block = position[where] if block is None else block
        key = ((stage[where] * (longest + 1) + block + 1) * 7 + place) * longest + tie
        parts.append([c if isinstance(c, np.ndarray) else np.full(len(where), c, dtype=np.int64)
                      for c in (op, ops.microbatch[where], peer, rc, key)])

    add(rows, np.where(forward, _FORWARD, _BACKWARD), rc=ops.recompute, place=_COMPUTE)
    add(rows[forward & first], _LOAD_INPUT, place=_LOAD)
    add(rows[~forward], _FREE_BUFFER, place=_FREE)
    receives = rows[np.where(forward, ~first, ~last)]
    start = np.where(forward[receives], _RECV_ACT, _RECV_GRAD)
    peer = np.where(forward[receives], stage[receives] - 1, stage[receives] + 1)
    add(receives, start, peer, block=np.maximum(position[receives] - 2, -1), place=_NEXT_RECV_STARTS,
        tie=position[receives])
    add(receives, start + 1, peer, place=_RECV_FINISH)
    sends = rows[np.where(forward, ~last, ~first)]
    start = np.where(forward[sends], _SEND_ACT, _SEND_GRAD)
    peer = np.where(forward[sends], stage[sends] + 1, stage[sends] - 1)
    add(sends, start, peer, place=_SEND_START)
    if ref is not None:
        slots = _send_finish_slots(ops, sends, ref)
    else:  # each stage on its own
        slots = np.empty(len(sends), dtype=np.int64)
        for s, order, _ in stages:
            mine = stage[sends] == s
            if mine.any():
                slots[mine] = _send_finish_slots_alone(order, position[sends[mine]])
    add(sends, start + 1, peer, block=slots, place=_SEND_FINISHES, tie=position[sends])
    op, microbatch, peer, rc, key = (np.concatenate([part[k] for part in parts]) for k in range(5))
    sort = np.argsort(key, kind="stable")
    table = np.empty(len(sort), dtype=_INSTR_DTYPE)
    table["op"], table["microbatch"], table["peer"], table["recompute"] = op[sort], microbatch[sort], peer[sort], rc[sort]
    stage_of_key = key // (7 * longest * (longest + 1))
    bounds = np.concatenate([[0], np.cumsum(np.bincount(stage_of_key, minlength=num_stages))])
    return [Instructions(table[bounds[s]:bounds[s + 1]]) for s, _, _ in stages]


def build_execution_plans(
    orders: Sequence[ComputeOrder],
    microbatches: Sequence[MicroBatch],
    recompute: "RecomputeSpec | Sequence[Sequence[RecomputeType | int | str]]",
    schedule: str,
    predicted_makespan_ms: float = 0.0,
    verify: bool = True,
    timeline: "tuple[Sequence[Sequence[float]], Sequence[Sequence[float]]] | None" = None,
) -> list[ExecutionPlan]:
    """One validated :class:`ExecutionPlan` per stage, proven deadlock-free.

    ``verify=False`` skips the validation and the deadlock check, which cost many times the
    lowering itself; the planner does so for orders its schedules produce (FIFO-consistent by
    construction, and checked by the test suite).

    ``recompute``: one choice for all, one per micro-batch, or one list per stage (``[s][m]``,
    e.g. a ``(P, n)`` numpy array). ``timeline``: start and end times of every stage's compute
    ops in order, from a simulation of these orders (every op of positive duration); send
    FINISHes are then placed where that timeline says the receive is posted, instead of by a
    timeline of unit durations. Raises ValueError for malformed orders (every stage must run
    F and B of exactly the micro-batches ``0..n-1``) and :class:`DeadlockError` when the orders
    cannot run together (they wait on each other, or pair sends and receives differently).
    """
    num_stages = len(orders)
    if num_stages < 1:
        raise ValueError("need at least one stage order")
    n = len(microbatches)
    codes = _per_stage_recompute(recompute, num_stages, n)
    parsed = [_parse_order(o, s, check=verify) for s, o in enumerate(orders)]
    for s, order in enumerate(parsed):
        ids = np.sort(order.microbatch[order.forward])
        if not np.array_equal(ids, np.arange(n)):
            raise ValueError(f"stage {s} order must run micro-batches 0..{n - 1} once each, got {ids[:12].tolist()}")
    ref = _Reference(parsed, timeline)
    rcs = list(RecomputeType)
    lowered = _lower([(s, order, codes[s]) for s, order in enumerate(parsed)], num_stages, ref)
    plans = [ExecutionPlan(stage=s, num_stages=num_stages, schedule=schedule, microbatches=list(microbatches),
                           recompute=[rcs[c] for c in codes[s].tolist()], instructions=instructions,
                           predicted_makespan_ms=predicted_makespan_ms)
             for s, instructions in enumerate(lowered)]
    if verify:
        check_deadlock_free(plans)
    return plans


def _per_stage_recompute(recompute, num_stages: int, n: int) -> np.ndarray:
    """[num_stages, n] recompute codes."""
    if isinstance(recompute, _ONE_CHOICE):
        return np.full((num_stages, n), int(_parse_recompute(recompute)), dtype=np.int64)
    rows = recompute if isinstance(recompute, np.ndarray) else list(recompute)
    nested = len(rows) > 0 and not isinstance(rows[0], _ONE_CHOICE)
    if not nested:
        if len(rows) != n:
            raise ValueError(f"{len(rows)} recompute choices for {n} micro-batches")
        return np.tile(_codes(rows), (num_stages, 1))
    if len(rows) != num_stages or any(len(row) != n for row in rows):
        raise ValueError(f"per-stage recompute must be {num_stages} rows of {n} choices")
    return np.stack([_codes(row) for row in rows]) if num_stages else np.zeros((0, n), dtype=np.int64)


def _codes(choices) -> np.ndarray:
    """Recompute codes of a sequence of choices (names, codes or RecomputeType)."""
    if isinstance(choices, np.ndarray) and choices.dtype.kind in "iu":
        unknown = choices[(choices < 0) | (choices > max(RecomputeType))]
        if unknown.size:
            raise ValueError(f"unknown recompute code {unknown[0]}: use 0 (none), 1 (selective) or 2 (full)")
        return choices.astype(np.int64)
    return np.array([int(_parse_recompute(r)) for r in choices], dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Deadlock check
# ---------------------------------------------------------------------------------------------


def _ordinal(i: int) -> str:
    suffix = "th" if 10 <= i % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(i % 10, "th")
    return f"{i}{suffix}"


def check_deadlock_free(plans: Sequence[ExecutionPlan]) -> None:
    """Prove that the plans of all stages run to the end together, or raise.

    Model of point-to-point communication (NCCL / gloo ``isend``/``irecv`` without tags):
    STARTs are non-blocking posts; a FINISH blocks until the peer has posted the matching START;
    between two stages, in one direction, the i-th send posted pairs with the i-th receive
    posted. Compute ops never block (their inputs are checked by :meth:`ExecutionPlan.validate`).
    The stages are advanced until all are done or none can move.

    Raises ValueError if a plan is malformed or the plans do not form one pipeline,
    :class:`CommMismatchError` if a send and a receive pair up for different micro-batches (or
    an activation with a gradient), and :class:`DeadlockError` naming every stuck stage's
    blocking instruction and what it waits for.
    """
    pp = len(plans)
    if pp == 0:
        return
    for s, plan in enumerate(plans):
        if plan.stage != s or plan.num_stages != pp:
            raise ValueError(
                f"plans[{s}] is stage {plan.stage} of {plan.num_stages}: expected stage {s} of {pp}"
            )
        plan.validate()

    # channel (src, dst) -> posted sends / receives, as (op, micro-batch)
    sends: dict[tuple[int, int], list[tuple[Op, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[Op, int]]] = {}
    index: list[dict[tuple[Op, int, int], int]] = [{} for _ in range(pp)]  # transfer -> position
    waiting: dict[tuple[str, tuple[int, int], int], int] = {}  # (side, channel, k) -> stage
    pc = [0] * pp
    ready = deque(range(pp))
    queued = [True] * pp

    def post(s: int, ins: Instruction) -> None:
        if ins.op.is_send:
            channel, mine, theirs, side = (s, ins.peer), sends, recvs, "send"
        else:
            channel, mine, theirs, side = (ins.peer, s), recvs, sends, "recv"
        posted = mine.setdefault(channel, [])
        k = len(posted)
        posted.append((ins.op, ins.microbatch))
        index[s][ins.transfer] = k
        other = theirs.get(channel, [])
        if k < len(other):
            _check_pair(channel, k, sends[channel][k], recvs[channel][k])
        waiter = waiting.pop((side, channel, k), None)
        if waiter is not None and not queued[waiter]:
            queued[waiter] = True
            ready.append(waiter)

    while ready:
        s = ready.popleft()
        queued[s] = False
        instrs = plans[s].instructions
        while pc[s] < len(instrs):
            ins = instrs[pc[s]]
            if ins.op.is_start:
                post(s, ins)
            elif ins.op.is_finish:
                k = index[s][ins.transfer]
                if ins.op.is_send:
                    channel, other_side, other = (s, ins.peer), "recv", recvs
                else:
                    channel, other_side, other = (ins.peer, s), "send", sends
                if len(other.get(channel, ())) <= k:
                    waiting[other_side, channel, k] = s
                    break
            pc[s] += 1

    stuck = [s for s in range(pp) if pc[s] < len(plans[s].instructions)]
    if not stuck:
        return
    blocked = {s: (pc[s], plans[s].instructions[pc[s]]) for s in stuck}
    lines = [f"deadlock: {len(stuck)} of {pp} stages cannot progress"]
    for s in stuck:
        i, ins = blocked[s]
        k = index[s][ins.transfer]
        peer = ins.peer
        what = "activation" if ins.op in (Op.SEND_ACT_FINISH, Op.RECV_ACT_FINISH) else "gradient"
        verb, towards = ("receive", "from") if ins.op.is_send else ("send", "to")
        state = (f"stage {peer} is itself blocked at #{blocked[peer][0]} {blocked[peer][1]}"
                 if peer in blocked else f"stage {peer} finished its plan without posting it")
        lines.append(
            f"  stage {s} blocked at #{i} {ins}: waits for stage {peer} to post the matching "
            f"{what} {verb} of micro-batch {ins.microbatch} (its {_ordinal(k + 1)} {verb} "
            f"{towards} stage {s}); {state}"
        )
    raise DeadlockError("\n".join(lines), blocked)


def _check_pair(channel: tuple[int, int], k: int, send: tuple[Op, int], recv: tuple[Op, int]) -> None:
    (send_op, send_mb), (recv_op, recv_mb) = send, recv
    same_kind = (send_op == Op.SEND_ACT_START) == (recv_op == Op.RECV_ACT_START)
    if same_kind and send_mb == recv_mb:
        return
    src, dst = channel
    send_what = "activation" if send_op == Op.SEND_ACT_START else "gradient"
    recv_what = "activation" if recv_op == Op.RECV_ACT_START else "gradient"
    raise CommMismatchError(
        f"send/receive mismatch from stage {src} to stage {dst}: the {_ordinal(k + 1)} transfer is "
        f"the {send_what} of micro-batch {send_mb} on stage {src} but the {recv_what} of "
        f"micro-batch {recv_mb} on stage {dst} (untagged point-to-point pairs in posting order)"
    )
