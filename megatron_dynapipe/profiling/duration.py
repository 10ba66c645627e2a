"""How long a profile will take, said before it starts.

A profile of a multi-billion-parameter model on a CPU runs for hours; the user should know that
before the first point, not from a bar that barely moves. The estimate counts the FLOPs every grid
point runs (one encoder layer's forward and backward per recompute type, recomputation included,
and the output layer's, each for the warm-up and timed runs), divides them by this device's measured
matrix-multiply rate, and takes at least the minimum timing per part (``min_time_ms``). It ignores
refinement, memory measurement, packed rows and the whole-step overhead: a floor. It holds to a
small factor where FLOPs dominate (a large model, a GPU); on a CPU a small model's layer costs
several times its FLOPs (the tiny GPT with ``--attention sdpa``: "at least 15 s", then 2-3 min).

Once the layer is built, a calibration says it better (:class:`RunPace`): the layer is run once at
the grid's smallest and largest points, which fixes what a run costs beside its FLOPs, and every
part of every point still to measure is priced as the profiler times it (warm-up, then runs until
they add up to ``min_time_ms``, and a memory run where one is taken), with the whole-step overhead
(:func:`~.overhead.overhead_seconds`) at those prices: :func:`calibrated_seconds`.

So the estimate is kept honest as the profile runs (:class:`TimeLeft`): each point's seconds are
fitted to the points measured so far and summed over the grid's points still to measure (the
lengths a refinement adds among them), and that is the time left the progress bar shows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping

import numpy as np

from megatron_dynapipe.config.accounting import layer_flops_per_token, output_flops_per_token
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["RunPace", "TimeLeft", "calibrated_seconds", "describe_duration", "estimated_seconds",
           "matmul_flops_per_second", "point_flops", "run_flops"]


def estimated_seconds(spec: ModelSpec, settings, flops_per_second: float) -> float:
    """Seconds the grid of ``settings`` (a ProfileSettings) takes at ``flops_per_second``."""
    floor_s = settings.min_time_ms / 1e3
    return sum(max(flops / flops_per_second, floor_s)
               for tp in settings.tp_sizes for seq in settings.seq_lengths() for mbs in settings.micro_batch_sizes(seq)
               for flops in point_flops(spec, settings, tp, seq, mbs, settings.recompute))


def point_flops(spec: ModelSpec, settings, tp: int, seq: int, mbs: int,
                recompute: Iterable[RecomputeType]) -> list[float]:
    """FLOPs each timed part of one grid point runs, its warm-up and timed runs together: the
    output layer, the embedding (a lookup: 0) and the encoder layer once per recompute type."""
    runs = settings.warmup + settings.repeats
    return [runs * flops for flops in run_flops(spec, tp, seq, mbs, recompute)]


def run_flops(spec: ModelSpec, tp: int, seq: int, mbs: int, recompute: Iterable[RecomputeType]) -> list[float]:
    """FLOPs of one run (forward and backward) of each part :func:`point_flops` counts."""
    tokens = mbs * seq
    layer = layer_flops_per_token(spec, seq)
    forward = tokens * (layer.linear + layer.attention) / tp
    head = tokens * 3 * output_flops_per_token(spec.hidden_size, spec.padded_vocab_size(tp)) / tp
    return [head, 0.0, *(3 * forward + (forward if rc == RecomputeType.FULL else 0.0) for rc in recompute)]


@dataclass(frozen=True)
class RunPace:
    """A part's run (forward and backward) takes ``per_run_s + per_flop_s * FLOPs`` on this
    device: a small layer on a CPU costs many times its FLOPs, a large one on a GPU about them."""

    per_run_s: float
    per_flop_s: float

    @classmethod
    def through(cls, small: tuple[float, float], large: tuple[float, float]) -> "RunPace":
        """The line through two runs' (FLOPs, seconds), neither term below zero."""
        (f1, s1), (f2, s2) = sorted([small, large])
        slope = max(0.0, (s2 - s1) / (f2 - f1)) if f2 > f1 else 0.0
        if s1 < slope * f1:  # a negative cost a run: the FLOPs alone, through the larger run
            return cls(0.0, s2 / f2)
        return cls(s1 - slope * f1, slope)

    def run_s(self, flops: float) -> float:
        return self.per_run_s + self.per_flop_s * flops

    def timed_s(self, flops: float, settings) -> float:
        """Seconds :func:`~.measure.time_step` takes on a part of ``flops`` a run: ``warmup`` runs,
        then ``repeats`` and more until the timed ones add up to ``min_time_ms`` (at most
        :data:`~.measure.MAX_REPEATS`)."""
        from megatron_dynapipe.profiling.measure import MAX_REPEATS

        run = self.run_s(flops)
        wanted = math.ceil(round(settings.min_time_ms / 1e3 / run, 9)) if run > 0 else 0  # 0.1 / 0.01: 10, not 11
        return (settings.warmup + min(MAX_REPEATS, max(settings.repeats, wanted))) * run


def calibrated_seconds(pace: RunPace, spec: ModelSpec, settings, todo: Mapping[tuple[int, int, int], list[float]],
                       packed: bool, core: bool) -> float:
    """Seconds the grid's points ``todo`` ((tp, seq, mbs) -> :func:`point_flops`) take at ``pace``:
    the head and the embedding timed, each recompute type's layer timed and run once for its memory
    (and so again on a packed row where ``packed``), and where ``core``, the attention core timed."""
    runs = settings.warmup + settings.repeats
    total = 0.0
    for (tp, seq, mbs), parts in todo.items():
        head, embedding, *encoders = (flops / runs for flops in parts)
        layer = sum(pace.timed_s(f, settings) + pace.run_s(f) for f in encoders)
        total += pace.timed_s(head, settings) + pace.timed_s(embedding, settings) + layer * (2 if packed else 1)
        if core:
            attention = 3 * mbs * seq * layer_flops_per_token(spec, seq).attention / tp
            total += pace.timed_s(attention, settings)
    return total


class TimeLeft:
    """The seconds a profile's points still to measure will take, read off the points measured so
    far: a point's seconds fitted as ``a`` a part timed plus ``b`` a FLOP (least squares, neither
    below zero), so a CPU's fixed cost a part and its rate both come from this run. Unknown (None)
    until two points of different size are measured. What a point measures beside its parts (its
    memory, its packed rows) rides on the fit; a refinement's lengths count from when it adds
    them (:meth:`add`). The whole-step overhead at the end is not counted here: its time is said when
    it starts, from the parts' profiled times (:func:`~.overhead.overhead_seconds`)."""

    def __init__(self, todo: "dict[Hashable, list[float]]"):
        self.todo = dict(todo)  # point -> FLOPs of each part (point_flops)
        self.done: list[tuple[int, float, float]] = []  # (parts, FLOPs, seconds) of the points measured

    def measured(self, point: Hashable, seconds: float) -> None:
        parts = self.todo.pop(point, None)
        if parts is not None:
            self.done.append((len(parts), sum(parts), seconds))

    def add(self, point: Hashable, parts: list[float]) -> None:
        self.todo[point] = parts

    def forget(self, points: Iterable[Hashable]) -> None:
        """Points that will not be measured (a row that ran out of memory before them)."""
        for point in points:
            self.todo.pop(point, None)

    def seconds(self) -> "float | None":
        per_part, per_flop = self._fit()
        if per_part is None:
            return None
        return sum(per_part * len(parts) + per_flop * sum(parts) for parts in self.todo.values())

    def _fit(self) -> "tuple[float | None, float]":
        if len({(parts, flops) for parts, flops, _ in self.done}) < 2:
            return None, 0.0
        x = np.array([(parts, flops) for parts, flops, _ in self.done], dtype=float)
        y = np.array([seconds for _, _, seconds in self.done])
        scale = np.maximum(np.abs(x).max(axis=0), 1e-30)  # parts count units, FLOPs billions: fit them alike
        both = np.linalg.lstsq(x / scale, y, rcond=None)[0] / scale
        if (both >= 0).all():
            return float(both[0]), float(both[1])
        # one term alone, whichever leaves the smaller residual: a negative cost is no cost
        fits = []
        for k, column in enumerate(x.T):
            c = max(float(column @ y) / float(column @ column), 0.0) if column.any() else 0.0
            fits.append((float(np.sum((y - c * column) ** 2)), k, c))
        _, k, c = min(fits)
        return (c, 0.0) if k == 0 else (0.0, c)


def matmul_flops_per_second(device, dtype, size: int = 1024, repeats: int = 3) -> float:
    """This device's rate on a square matrix product of ``size`` (the best of ``repeats``)."""
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def describe_duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
