"""Which samples each iteration trains.

The dataset's samples form one stream, epoch after epoch: each epoch a fresh permutation seeded
by ``(seed, epoch)`` (or ``0 .. N-1`` without shuffling). Iteration ``i`` takes the next global
batch of that stream. A global batch is ``global_batch_size`` samples, or, with Megatron's
``--rampup-batch-size START INCREMENT SAMPLES``, what megatron-core's ramp-up calculator gives for
the samples consumed so far: ``START + INCREMENT * floor(consumed / (SAMPLES / steps))`` until
``SAMPLES`` are consumed, then ``global_batch_size`` (``steps = (global - START) / INCREMENT``),
rounded down to a multiple of ``divisor`` (micro-batch size x data-parallel size: Megatron counts
the samples an iteration consumed in whole micro-batches per data-parallel rank). A batch may
straddle two epochs, as Megatron's do. Numpy only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

__all__ = ["BatchSchedule"]


@dataclass(frozen=True)
class BatchSchedule:
    """The global batches of a run (module docstring)."""

    num_samples: int
    global_batch_size: int
    shuffle: bool = True
    seed: int = 0
    rampup: Optional[tuple[int, int, int]] = None  # (start batch size, increment, ramp-up samples)
    divisor: int = 1

    def __post_init__(self) -> None:
        if self.num_samples < 1 or self.global_batch_size < 1 or self.divisor < 1:
            raise ValueError("a batch schedule needs samples, a positive global batch size and divisor")
        if self.rampup is not None:
            start, increment, samples = (int(v) for v in self.rampup)
            object.__setattr__(self, "rampup", (start, increment, samples))
            if not (0 < start <= self.global_batch_size and increment > 0 and samples >= 0):
                raise ValueError(f"--rampup-batch-size {start} {increment} {samples}: need 0 < start <= the global "
                                 f"batch size {self.global_batch_size}, a positive increment and samples >= 0")
            if (self.global_batch_size - start) % increment:
                raise ValueError(f"--rampup-batch-size: the global batch size {self.global_batch_size} minus the start "
                                 f"{start} is not a multiple of the increment {increment}")
        object.__setattr__(self, "_offsets", [0])  # samples consumed before iteration i, grown on demand
        object.__setattr__(self, "_order", (None, None))  # the last epoch's permutation

    def batch_size(self, consumed: int) -> int:
        """The global batch size once ``consumed`` samples have been trained."""
        size = self.global_batch_size
        if self.rampup is not None:
            start, increment, samples = self.rampup
            steps = (self.global_batch_size - start) // increment
            if steps and consumed <= samples:
                size = start + int(consumed / (samples / steps)) * increment
        return max(self.divisor, size // self.divisor * self.divisor)

    def offset(self, iteration: int) -> int:
        """Samples consumed before ``iteration``."""
        if self.rampup is None:
            return int(iteration) * self.batch_size(0)
        offsets = self._offsets
        while len(offsets) <= iteration:
            offsets.append(offsets[-1] + self.batch_size(offsets[-1]))
        return offsets[iteration]

    def iteration_at(self, consumed: int) -> int:
        """The iteration that starts after ``consumed`` samples (a resumed run's first one)."""
        iteration = 0
        while self.offset(iteration) < consumed:
            iteration += 1
        if self.offset(iteration) != consumed:
            raise ValueError(f"{consumed} consumed samples do not end an iteration of this batch schedule")
        return iteration

    def ids(self, iteration: int) -> np.ndarray:
        """Dataset indices of iteration ``iteration``'s global batch."""
        begin = self.offset(iteration)
        positions = np.arange(begin, begin + self.batch_size(begin), dtype=np.int64)
        epochs, within = np.divmod(positions, self.num_samples)
        if not self.shuffle:
            return within
        out = np.empty_like(within)
        for epoch in np.unique(epochs).tolist():
            mask = epochs == epoch
            out[mask] = self._permutation(epoch)[within[mask]]
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        cached_epoch, order = self._order
        if cached_epoch != epoch:
            order = np.random.default_rng([int(self.seed), int(epoch)]).permutation(self.num_samples)
            object.__setattr__(self, "_order", (epoch, order))
        return order

    @property
    def iterations_per_epoch(self) -> int:
        return max(1, self.num_samples // self.global_batch_size)

    def to_json(self) -> dict:
        values = {k: v for k, v in asdict(self).items()}
        values["rampup"] = list(self.rampup) if self.rampup else None
        return values

    @classmethod
    def from_json(cls, values: dict) -> "BatchSchedule":
        values = dict(values)
        values["rampup"] = tuple(values["rampup"]) if values.get("rampup") else None
        return cls(**values)
