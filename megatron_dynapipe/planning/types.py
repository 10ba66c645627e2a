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


class Action(NamedTuple):
    """One compute op of a pipeline rank's order (planning/schedules: who makes them). It is a
    tuple: a plain ``("F", m)`` pair stands for ``Action("F", m)`` wherever orders are read.

    ``chunk``: which of the rank's model chunks runs it, where a rank holds several
    (interleaved schedules): chunk c of rank r is virtual stage ``c * pp + r``, as Megatron-LM
    assigns them."""

    phase: str  # "F": forward, "B": backward
    microbatch: int  # index in pipeline entry order
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.phase}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


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


def packed_cost_shape(row_tokens, sample_tokens, sample_squares):
    """:attr:`MicroBatch.cost_shape` of packed micro-batches (scalars or arrays): rows of
    ``row_tokens`` holding samples of ``sample_tokens`` tokens in all, their squared lengths
    summing to ``sample_squares``; the padding after them is one more segment."""
    padding = row_tokens - sample_tokens
    squares = sample_squares + padding * padding
    return row_tokens * row_tokens / squares, squares / row_tokens
