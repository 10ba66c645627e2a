"""Value types shared by every part of the planner."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np


class RecomputeType(enum.IntEnum):
    """Activation recomputation of one micro-batch, cheapest memory last."""

    NONE = 0
    SELECTIVE = 1  # recompute the attention core only (Megatron's --recompute-granularity selective)
    FULL = 2  # keep only each layer's input, recompute the whole layer in backward

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: "str | int | RecomputeType") -> "RecomputeType":
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                raise ValueError(
                    f"unknown recompute type {value!r}: use one of none, selective, full"
                ) from None
        return cls(value)


def recompute_at_least(types, granularity: "str | None") -> tuple:
    """Those of ``types`` no lighter than Megatron's ``--recompute-granularity`` (a floor:
    DynaPipe still picks recompute per micro-batch); all of them without one."""
    if granularity is None:
        return tuple(types)
    floor = RecomputeType.parse(granularity)
    return tuple(t for t in types if t >= floor)


class Op(enum.IntEnum):
    """What one step of a pipeline stage does: the kinds of a schedule's actions (``FORWARD``,
    ``BACKWARD``) and of the instructions they are lowered to. The values are the wire format
    (planning/plan/wire.py): never renumber, only append."""

    LOAD_INPUT = 0  #: roughly: the first virtual stage reads a micro-batch's tokens
    FORWARD = 1  #: roughly: a model chunk's layers run forward on one micro-batch
    BACKWARD = 2  #: roughly: their whole backward (input and weight gradients), recompute first
    RECV_ACT_START = 3  #: roughly: post the receive of a micro-batch's activations (irecv)
    RECV_ACT_FINISH = 4  #: roughly: wait for those activations
    SEND_ACT_START = 5  #: roughly: post the send of a forward's output (isend)
    SEND_ACT_FINISH = 6  #: roughly: wait until it has gone
    RECV_GRAD_START = 7  #: roughly: post the receive of the gradient of a forward's output
    RECV_GRAD_FINISH = 8  #: roughly: wait for that gradient
    SEND_GRAD_START = 9  #: roughly: post the send of a backward's input gradient
    SEND_GRAD_FINISH = 10  #: roughly: wait until it has gone
    FREE_BUFFER = 11  #: roughly: drop what the stage keeps of a micro-batch

    @property
    def is_compute(self) -> bool:
        return self == 1 or self == 2

    @property
    def letter(self) -> str:
        """A compute op in orders and plans' text: "F" or "B"."""
        if not self.is_compute:
            raise ValueError(f"{self.name} is not a compute op")
        return "F" if self == 1 else "B"

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
    def is_activation(self) -> bool:
        """A transfer of activations (forward's output); the other transfers carry gradients."""
        return self in _ACTIVATIONS

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
_ACTIVATIONS = frozenset({Op.SEND_ACT_START, Op.SEND_ACT_FINISH, Op.RECV_ACT_START, Op.RECV_ACT_FINISH})


class Action(NamedTuple):
    """One compute op of a pipeline rank's order (planning/schedules: who makes them):
    ``Action(Op.FORWARD, 3)`` prints as ``F3``, ``Action(Op.BACKWARD, 3, chunk=1)`` as ``B3.1``.
    Orders hold Actions alone (plain tuples are refused where orders are read), and today only
    forwards and whole backwards: a new kind of op is refused wherever it is not handled.

    ``chunk``: which of the rank's model chunks runs it, where a rank holds several
    (interleaved schedules): chunk c of rank r is virtual stage ``c * pp + r``, as Megatron-LM
    assigns them."""

    op: Op  # Op.FORWARD or Op.BACKWARD
    microbatch: int  # index in pipeline entry order
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.op.letter}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")

    @classmethod
    def forward(cls, microbatch: int, chunk: int = 0) -> "Action":
        return cls(Op.FORWARD, microbatch, chunk)

    @classmethod
    def backward(cls, microbatch: int, chunk: int = 0) -> "Action":
        return cls(Op.BACKWARD, microbatch, chunk)


@dataclass(frozen=True)
class MicroBatch:
    """Samples trained together: indices into the global batch and the tensor shape.

    A padded micro-batch is ``size`` rows, every sample padded to ``seq_len``. A packed one
    (``packed_lengths`` given: each sample's tokens, in the row's order) is one row of ``seq_len``
    tokens, its samples back to back and padding after them, each sample attending to itself
    alone (THD)."""

    samples: tuple[int, ...]
    seq_len: int  # padded: every row's length; packed: the one row's length
    packed_lengths: tuple[int, ...] = ()
    #: the (micro-batch size, sequence length) a cost model prices it at. A padded one is its shape.
    #: A packed one of T tokens whose segments (its samples and the padding after them) have
    #: squared lengths summing to Q does the linear work of T tokens and the attention work of Q:
    #: the shape of T^2 / Q rows of Q / T tokens does both (its tokens m s = T, its attention
    #: m s^2 = Q). Made once: the planner prices the same micro-batches for every candidate order.
    cost_shape: tuple[float, float] = field(init=False, repr=False, compare=False)
    #: the segments a packed one runs beyond the cost shape's rows (:func:`extra_segments`); 0 padded
    extra_segments: float = field(init=False, repr=False, compare=False, default=0.0)

    def __post_init__(self) -> None:
        if not self.packed_lengths:
            object.__setattr__(self, "cost_shape", (len(self.samples), self.seq_len))
            return
        tokens = sum(self.packed_lengths)
        if len(self.packed_lengths) != len(self.samples) or tokens > self.seq_len:
            raise ValueError(f"a packed micro-batch of {len(self.samples)} samples has {len(self.packed_lengths)} "
                             f"lengths summing to {tokens} tokens, over its {self.seq_len}")
        squares = sum(n * n for n in self.packed_lengths)
        object.__setattr__(self, "cost_shape", packed_cost_shape(self.seq_len, tokens, squares))
        object.__setattr__(self, "extra_segments",
                           float(packed_extra_segments(self.seq_len, tokens, len(self.samples), self.cost_shape[0])))

    @property
    def packed(self) -> bool:
        return bool(self.packed_lengths)

    @property
    def size(self) -> int:
        """Samples in it."""
        return len(self.samples)

    @property
    def rows(self) -> int:
        """The tensors' batch dimension (Megatron's micro-batch size)."""
        return 1 if self.packed else self.size

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len

    @property
    def label(self) -> str:
        """Its shape in a few characters: "4x128", or "3in1024" for three samples packed in 1024."""
        return f"{self.size}in{self.seq_len}" if self.packed else f"{self.size}x{self.seq_len}"


def cost_shapes(microbatches: "Sequence[MicroBatch]") -> tuple[np.ndarray, np.ndarray]:
    """The micro-batch sizes and sequence lengths a cost model prices ``microbatches`` at
    (:attr:`MicroBatch.cost_shape`), as two arrays."""
    shapes = np.array([mb.cost_shape for mb in microbatches], dtype=float).reshape(-1, 2)
    return shapes[:, 0], shapes[:, 1]


def extra_segments(microbatches: "Sequence[MicroBatch]") -> np.ndarray:
    """Per micro-batch, :attr:`MicroBatch.extra_segments`, as an array."""
    return np.array([mb.extra_segments for mb in microbatches], dtype=float)


def packed_extra_segments(row_tokens, sample_tokens, samples, cost_rows):
    """The segments a packed row runs (its ``samples``, and the padding after them where there is
    some) beyond the ``cost_rows`` of its cost shape (scalars or arrays): the equal-segment shape
    does the row's linear and attention work exactly, but an attention core that runs the segments
    one by one (the SDPA core on the CPU) pays for each (``CostModel.segment_ms``)."""
    return samples + (row_tokens > sample_tokens) - cost_rows


def packed_cost_shape(row_tokens, sample_tokens, sample_squares):
    """:attr:`MicroBatch.cost_shape` of packed micro-batches (scalars or arrays): rows of
    ``row_tokens`` holding samples of ``sample_tokens`` tokens in all, their squared lengths
    summing to ``sample_squares``; the padding after them is one more segment."""
    padding = row_tokens - sample_tokens
    squares = sample_squares + padding * padding
    return row_tokens * row_tokens / squares, squares / row_tokens
