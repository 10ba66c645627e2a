"""The instructions of an execution plan: what one pipeline stage runs, one step at a time.

A stage's plan is a list of :class:`Instruction`: compute (``FORWARD``, ``BACKWARD``), its
input (``LOAD_INPUT``), point-to-point communication with a neighbouring stage as non-blocking
START / blocking FINISH pairs, and ``FREE_BUFFER``, each of one micro-batch on one of the stage's
model chunks (several where the pipeline is interleaved).  :class:`Instructions` holds a list of
them as the rows of the wire format, and every instruction has a text form (``F3[selective]``,
``F3.1`` on model chunk 1, ``SendActStart(1->s2)``) that :meth:`Instruction.parse` reads back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from megatron_dynapipe.planning.types import Op, RecomputeType

__all__ = ["Op", "Instruction", "Instructions", "ROW", "as_recompute"]

#: One instruction as a row of the wire format: u8 op, u8 recompute, i16 peer, u32 micro-batch,
#: u8 model chunk.
ROW = np.dtype([("op", "u1"), ("recompute", "u1"), ("peer", "<i2"), ("microbatch", "<u4"), ("chunk", "u1")])

_START_OF = {op: op.start if op.is_finish else op for op in Op if op.is_comm}
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
_TEXT_FORM = re.compile(r"(?:(F|B|Load|Free)(\d+)(?:\.(\d+))?(?:\[(\w+)\])?"
                        r"|(" + "|".join(_COMM_OPS) + r")\((\d+)(?:\.(\d+))?(->|<-)s(\d+)\))")


@dataclass(frozen=True)
class Instruction:
    """One step of a stage's plan.

    ``peer`` is the other stage of a communication op (-1 for the rest); ``recompute`` says how
    a FORWARD stores its activations and how the matching BACKWARD rebuilds them.
    ``FREE_BUFFER(m)`` releases what the stage keeps of micro-batch ``m`` (stored activations,
    received tensors); a tensor still being sent stays owned by its send until the FINISH.
    ``chunk``: the stage's model chunk the op belongs to (a transfer: the chunk whose compute op
    it serves); 0 where a stage holds one.
    """

    op: Op
    microbatch: int
    peer: int = -1
    recompute: RecomputeType = RecomputeType.NONE
    chunk: int = 0

    def __post_init__(self) -> None:
        if type(self.op) is not Op:
            object.__setattr__(self, "op", Op(self.op))
        if type(self.recompute) is not RecomputeType:
            object.__setattr__(self, "recompute", RecomputeType.parse(self.recompute))
        if self.microbatch < 0:
            raise ValueError(f"{self.op.name}: micro-batch id must be >= 0, got {self.microbatch}")
        if self.chunk < 0:
            raise ValueError(f"{self.op.name}: model chunk must be >= 0, got {self.chunk}")

    def __str__(self) -> str:
        op, m = self.op, f"{self.microbatch}.{self.chunk}" if self.chunk else self.microbatch
        if op.is_compute:
            tag = "" if self.recompute == RecomputeType.NONE else f"[{self.recompute.label}]"
            return f"{op.letter}{m}{tag}"
        if op.is_comm:
            return f"{_COMM_NAMES[op]}({m}{'->' if op.is_send else '<-'}s{self.peer})"
        return f"{'Load' if op == Op.LOAD_INPUT else 'Free'}{m}"

    @classmethod
    def _trusted(cls, op: Op, microbatch: int, peer: int = -1,
                 recompute: RecomputeType = RecomputeType.NONE, chunk: int = 0) -> "Instruction":
        """An instruction from values the lowering already knows are valid, without __init__'s
        checks and frozen-field setters (half the cost of a plan of thousands of instructions)."""
        instruction = object.__new__(cls)
        instruction.__dict__.update(op=op, microbatch=microbatch, peer=peer, recompute=recompute, chunk=chunk)
        return instruction

    @classmethod
    def parse(cls, text: str) -> "Instruction":
        """The instruction ``str(instruction)`` printed: ``F3[selective]``, ``B3``, ``F3.1`` (model
        chunk 1), ``Load0``, ``Free2``, ``SendActStart(1->s2)``, ``RecvGradFinish(1.1<-s2)``."""
        match = _TEXT_FORM.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"{text!r} is not an instruction: write F<m>[recompute], B<m>[recompute], Load<m>, "
                             "Free<m> or e.g. SendActStart(<m>->s<peer>), RecvActFinish(<m><-s<peer>), with "
                             "<m>.<chunk> for a model chunk past the first")
        name, m, chunk, recompute, comm, comm_m, comm_chunk, arrow, peer = match.groups()
        if comm is not None:
            op = _COMM_OPS[comm]
            if (arrow == "->") != op.is_send:
                raise ValueError(f"{text!r}: a {'send' if op.is_send else 'receive'} points "
                                 f"{'->' if op.is_send else '<-'} its peer")
            return cls(op, int(comm_m), int(peer), chunk=int(comm_chunk or 0))
        op = {"F": Op.FORWARD, "B": Op.BACKWARD, "Load": Op.LOAD_INPUT, "Free": Op.FREE_BUFFER}[name]
        if recompute is not None and not op.is_compute:
            raise ValueError(f"{text!r}: only F and B carry a recompute type")
        return cls(op, int(m), recompute=RecomputeType.parse(recompute or "none"), chunk=int(chunk or 0))

    @property
    def transfer(self) -> tuple[Op, int, int, int]:
        """(START op, micro-batch, peer, chunk): what links a START to its FINISH."""
        return (_START_OF[self.op], self.microbatch, self.peer, self.chunk)


class Instructions(Sequence[Instruction]):
    """A stage's instructions, held as the rows of the wire format (op, recompute, peer,
    micro-batch, chunk): lowering and serialising thousands of them makes no object per instruction.
    Reading them (indexing, iterating) makes the :class:`Instruction` objects, once."""

    __slots__ = ("rows", "_objects")

    def __init__(self, rows: np.ndarray, objects: "list[Instruction] | None" = None):
        self.rows = rows  # structured array of ROW
        self._objects = objects

    @classmethod
    def of(cls, instructions: "Sequence[Instruction] | Instructions") -> "Instructions":
        if isinstance(instructions, Instructions):
            return instructions
        items = list(instructions)
        try:
            rows = np.array([(i.op, i.recompute, i.peer, i.microbatch, i.chunk) for i in items], dtype=ROW)
        except OverflowError:
            raise ValueError("an instruction's peer, micro-batch or chunk is outside the wire format's 16/32/8-bit "
                             "fields: use stages below 32768, micro-batch ids below 2**32 and chunks below 256"
                             ) from None
        return cls(rows, items)

    def _list(self) -> list[Instruction]:
        if self._objects is None:
            ops, rcs, make, rows = list(Op), list(RecomputeType), Instruction._trusted, self.rows
            self._objects = [make(ops[o], m, p, rcs[r], c) for o, r, p, m, c in zip(
                rows["op"].tolist(), rows["recompute"].tolist(), rows["peer"].tolist(), rows["microbatch"].tolist(),
                rows["chunk"].tolist())]
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


def as_recompute(r) -> RecomputeType:
    """A recompute choice given as a RecomputeType, its code or its name."""
    return r if type(r) is RecomputeType else RecomputeType.parse(int(r) if isinstance(r, np.integer) else r)
