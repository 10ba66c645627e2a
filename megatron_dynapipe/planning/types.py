"""Value types shared by every part of the planner."""

from __future__ import annotations

import enum
from dataclasses import dataclass


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


@dataclass(frozen=True)
class MicroBatch:
    """Samples trained together: indices into the global batch and the padded shape."""

    samples: tuple[int, ...]
    seq_len: int  # padded sequence length of every sample in the micro-batch

    @property
    def size(self) -> int:
        return len(self.samples)

    @property
    def tokens(self) -> int:
        return self.size * self.seq_len
