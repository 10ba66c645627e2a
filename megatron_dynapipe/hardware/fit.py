"""A device's roofline fitted to a measured profile (``megatron-dynapipe calibrate --from-profile``).

The roofline (:mod:`megatron_dynapipe.planning.cost_model.roofline`) prices a layer from the shapes
of its kernels and the device's rates: the share of its peak large GEMMs reach
(``gemm_efficiency``), the share of its memory bandwidth elementwise kernels reach
(``memory_efficiency``), and a fixed time each layer's pass pays beyond its kernels' shapes
(``layer_overhead_us``: launches and host work).  A shipped hardware file's rates are measured
kernel by kernel (``benchmarks/bench_kernels.py``) and pay no overhead.  A profile measures whole
layers as the job's own software stack runs them (its attention core, fused or unfused
elementwise kernels, its launches); fitting the three terms to it gives a roofline that prices the
model's other shapes, widths and TP sizes as that stack would.

The fit minimises the squared log ratio of predicted to measured encoder-layer times (a point
counts by its relative error, as the profile's spread is relative) over the profile's points of
at least ``min_tokens`` tokens.  The rates lie in (0, 1], searched on a grid refined around its
best point; for each pair of rates the overhead, which only adds, is searched on a line.
Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.hardware import PEAK_DTYPES
from megatron_dynapipe.planning.cost_model.analytical import gpt_shape
from megatron_dynapipe.planning.cost_model.roofline import RooflineCostModel
from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["RooflineFit", "fit_roofline", "MIN_TOKENS"]

MIN_TOKENS = 2048  # per micro-batch: below it kernel launches the roofline does not price dominate
_COARSE = np.arange(0.05, 1.0001, 0.05)


@dataclass(frozen=True)
class RooflineFit:
    """Fitted rates, and how far the roofline is from the profile's points with them and before."""

    gemm_efficiency: float
    memory_efficiency: float
    layer_overhead_us: float
    points: int
    min_tokens: int  # the least tokens of a point fitted
    median_error: float  # |predicted / measured - 1|, fitted rates
    worst_error: float
    median_error_before: float  # with the hardware file's own rates
    bias: float  # median of predicted / measured - 1, fitted rates

    def describe(self, profile: str) -> str:
        return (f"roofline fitted to {profile} ({self.points} encoder-layer points of at least {self.min_tokens} "
                f"tokens): GEMMs at {self.gemm_efficiency:.3f} of peak, elementwise kernels at "
                f"{self.memory_efficiency:.3f} of the memory bandwidth, {self.layer_overhead_us:.0f} us a layer's "
                f"pass; median error {self.median_error:.1%}, worst {self.worst_error:.1%} "
                f"({self.median_error_before:.1%} with the file's own rates)")

    def compute_section(self, section: Mapping[str, Any]) -> dict[str, Any]:
        """A hardware file's ``compute`` section with the fitted terms in place of its own."""
        return dict(section, gemm_efficiency=self.gemm_efficiency, memory_efficiency=self.memory_efficiency,
                    layer_overhead_us=self.layer_overhead_us)


def fit_roofline(hardware, profile: Mapping[str, Any], *, min_tokens: int = MIN_TOKENS) -> RooflineFit:
    """The ``gemm_efficiency``, ``memory_efficiency`` and ``layer_overhead_us`` of ``hardware``'s
    roofline (a :class:`~megatron_dynapipe.hardware.Hardware` with a ``compute`` section) that fit
    a profile document's encoder-layer times of at least ``min_tokens`` tokens best (module
    docstring)."""
    metadata = profile.get("metadata") or {}
    fields = {k: v for k, v in (metadata.get("model") or {}).items() if k in ModelSpec.__dataclass_fields__}
    if not fields or not profile.get("layer_time"):
        raise ValueError("the profile has no model metadata or no measured layer times: give a profile "
                         "`megatron-dynapipe profile` wrote (not a --calibrate'd one)")
    model = ModelSpec(**fields)
    dtype = PEAK_DTYPES.get(metadata.get("dtype"), metadata.get("dtype") or "bfloat16")
    base = hardware.roofline(dtype, model.attention)
    if base is None:
        raise ValueError(f"hardware {hardware.name!r} has no compute section to fit: add its SMs "
                         "(docs/simulate.md, \"Hardware files\")")
    groups = _points(profile, min_tokens)
    if not groups:
        raise ValueError(f"the profile has no encoder-layer point of at least {min_tokens} tokens to fit")
    gpt = {tp: dict(gpt_shape(model, tp), device_memory_mb=np.inf) for tp in {key[0] for key in groups}}

    measured = np.concatenate([ms for _, _, ms in groups.values()])

    def predicted(gemm: float, memory: float, overhead_us: float = 0.0) -> np.ndarray:
        roofline = dataclasses.replace(base, gemm_efficiency=gemm, memory_efficiency=memory,
                                       layer_overhead_us=overhead_us)
        return np.concatenate([RooflineCostModel(roofline, **gpt[tp]).layer_ms("encoder", phase, recompute, mbs, seq)
                               for (tp, phase, recompute), (mbs, seq, _) in groups.items()])

    overheads: dict[tuple[float, float], float] = {}

    def loss(gemm: float, memory: float) -> float:
        overhead, least = _best_overhead(predicted(gemm, memory), measured)
        overheads[gemm, memory] = overhead
        return least

    gemm, memory = _grid_minimum(loss)
    overhead_us = round(overheads[gemm, memory] * 1e3, 1)
    fitted = predicted(gemm, memory, overhead_us) / measured - 1
    before = predicted(base.gemm_efficiency, base.memory_efficiency, base.layer_overhead_us) / measured - 1
    return RooflineFit(gemm_efficiency=gemm, memory_efficiency=memory, layer_overhead_us=overhead_us,
                       points=fitted.size, min_tokens=min_tokens, median_error=float(np.median(np.abs(fitted))),
                       worst_error=float(np.max(np.abs(fitted))), median_error_before=float(np.median(np.abs(before))),
                       bias=float(np.median(fitted)))


def _best_overhead(kernels_ms: np.ndarray, measured_ms: np.ndarray) -> tuple[float, float]:
    """The fixed ms added to every point that fits ``measured_ms`` best, and its loss: a line
    search from 0 to the longest point, refined around its best value."""
    def loss(overhead: float) -> float:
        return float(np.sum(np.log((kernels_ms + overhead) / measured_ms) ** 2))

    grid = np.linspace(0.0, float(measured_ms.max()), 41)
    for _ in range(4):
        best = min(grid, key=loss)
        step = grid[1] - grid[0]
        grid = np.linspace(max(best - step, 0.0), best + step, 21)
    best = float(min(grid, key=loss))
    return best, loss(best)


def _points(profile: Mapping[str, Any], min_tokens: int) -> dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(tp, phase, recompute) -> micro-batch sizes, lengths and measured ms of its points."""
    grouped: dict[tuple, list[tuple[float, float, float]]] = {}
    for row in profile["layer_time"]:
        if row.get("layer") == "encoder" and row["mbs"] * row["seqlen"] >= min_tokens and row["ms"] > 0:
            key = (int(row["tp"]), row["phase"], RecomputeType.parse(row["recompute"]))
            grouped.setdefault(key, []).append((row["mbs"], row["seqlen"], row["ms"]))
    return {key: tuple(np.array(column, dtype=float) for column in zip(*rows)) for key, rows in grouped.items()}


def _grid_minimum(loss, rounds: int = 2) -> tuple[float, float]:
    """The (gemm, memory) efficiencies in (0, 1], to three decimals, where ``loss`` is least: a
    grid of 0.05 steps, then finer grids around the best point found."""
    best = min(((round(float(g), 3), round(float(m), 3)) for g in _COARSE for m in _COARSE), key=lambda p: loss(*p))
    step = 0.05
    for _ in range(rounds):
        step /= 5
        around = [np.unique(np.round(np.clip(best[i] + step * np.arange(-5, 6), 0.001, 1.0), 3)) for i in (0, 1)]
        best = min(((float(g), float(m)) for g in around[0] for m in around[1]), key=lambda p: loss(*p))
    return best
