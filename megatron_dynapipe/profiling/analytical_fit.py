"""``megatron-dynapipe profile --calibrate``: the analytical cost model fitted to a few measured points.

A full profile times every point of a grid under every recompute type; a calibration times the
layer and the head without recompute at a handful of shapes (:func:`.overhead.overhead_shapes`
of the grid: one micro-batch at each length, the largest at the shortest and the longest) and
the whole step's per-micro-batch overhead at the same shapes, then fits what the analytical
model leaves open (docs/cost_model.md, "Analytical model"):

* the FLOP rate of the matmuls, as ``peak_tflops`` with ``mfu`` 1 (one rate for every matmul
  of the layer and the head, forward and backward), and the attention core's relative to it,
  ``attention_mfu`` (softmax and masking make it slower per FLOP, much slower on a CPU);
* ``overhead_ms``, paid by every layer and phase;
* ``saturation_tokens``, below which a layer costs as much as at that many tokens;

by least squares on the relative error (a short point counts as much as a long one) with every
term >= 0, the rates and the overhead for each saturation of a ladder, keeping the best.  Recompute types and memory
come from the model's formulas.  The file is the profile format's document with an
``analytical`` object instead of the measured tables; every ``--cost-model`` takes it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from pathlib import Path

import numpy as np
import torch

from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.files import write_atomically
from megatron_dynapipe.gpt.device import torch_dtype
from megatron_dynapipe.planning.cost_model import AnalyticalCostModel, gpt_shape
from megatron_dynapipe.planning.cost_model.profile_file import CALIBRATED_SHAPE, calibrated_document, to_text
from megatron_dynapipe.planning.types import RecomputeType
from megatron_dynapipe.profiling.layers import build_parts, fake_tp_rank
from megatron_dynapipe.profiling.measure import steady_cpu_allocator
from megatron_dynapipe.profiling.overhead import overhead_shapes
from megatron_dynapipe.profiling.profiler import (
    ProfileError,
    ProfileRun,
    ProfileSettings,
    Progress,
    measure_point,
    measure_step_overhead,
)

__all__ = ["calibrate_model", "fit_analytical", "SATURATION_LADDER"]

SATURATION_LADDER = (0, 128, 256, 512, 1024, 2048, 4096, 8192)  # tokens


def calibration_shapes(settings: ProfileSettings) -> list[tuple[int, int]]:
    """The handful of (seq, mbs) a calibration times."""
    return overhead_shapes([(seq, mbs) for seq in settings.seq_lengths() for mbs in settings.micro_batch_sizes(seq)])


def calibrate_model(spec: ModelSpec, output: str | os.PathLike, settings: ProfileSettings, *, device: torch.device,
                    progress: Progress | None = None) -> dict:
    """Measure, fit and write (module docstring); returns the document."""
    if device.type == "cpu":
        steady_cpu_allocator()
    settings = dataclasses.replace(settings, recompute=(RecomputeType.NONE,))
    profile = ProfileRun(spec, settings, device)
    progress = progress or (lambda what, points, **_: None)
    output = Path(output)
    for tp in settings.tp_sizes:
        with fake_tp_rank(tp, device):
            parts = build_parts(spec, tp, torch_dtype(settings.dtype), device, settings.recompute)
            for seq, mbs in calibration_shapes(settings):
                progress(f"tp {tp} seq {seq} mbs {mbs}", 1)
                measure_point(profile, parts, tp, settings.recompute, seq, mbs)
            if not profile.records.times:
                raise ProfileError(f"not even one micro-batch of {settings.min_seq_length} tokens fits on this "
                                   "device: lower --min-seq-length or use a larger device")
            measure_step_overhead(profile, parts, tp, progress)
    doc = _document(profile)
    write_atomically(output, to_text(doc))
    return doc


def fit_analytical(points: list[dict], spec: ModelSpec) -> dict:
    """``peak_tflops`` (the matmuls' rate, ``mfu`` 1), ``attention_mfu``, ``overhead_ms`` and
    ``saturation_tokens`` of the analytical model of ``spec`` closest to the measured ``points``
    (dicts of tp, layer, phase, seqlen, mbs and ms; layers "encoder" and "postprocess", no
    recompute), with the median and largest relative error of the fit in percent."""
    ms = np.array([p["ms"] for p in points])
    models = {tp: _analytical(spec, tp) for tp in {p["tp"] for p in points}}  # the FLOP counts at each TP size
    work = np.array([_flop_parts(models[p["tp"]], p) for p in points])  # [points, (matmul, attention)]
    tokens = np.array([p["seqlen"] * p["mbs"] for p in points], dtype=float)
    best = None
    for saturation in SATURATION_LADDER:
        design = np.column_stack([work * np.maximum(1.0, saturation / tokens)[:, None], np.ones_like(ms)])
        x = _nonnegative_relative_fit(design, ms)
        errors = design @ x / ms - 1
        score = float(np.sum(errors ** 2))
        if x[0] > 0 and (best is None or score < best[0]):
            best = (score, saturation, x, errors)
    if best is None:
        raise ProfileError("the measured times do not grow with the work: calibrate on a larger --max-seq-length")
    _, saturation, (ms_per_flop, ms_per_attention_flop, overhead), errors = best
    return {"peak_tflops": float(1.0 / (ms_per_flop * 1e9)), "mfu": 1.0,
            # no measurable attention cost: as fast as the matmuls (the model needs a rate > 0)
            "attention_mfu": float(ms_per_flop / ms_per_attention_flop) if ms_per_attention_flop > 0 else 1.0,
            "overhead_ms": float(overhead), "saturation_tokens": saturation,
            "median_error_pct": float(np.median(np.abs(errors)) * 100),
            "max_error_pct": float(np.max(np.abs(errors)) * 100)}


def _nonnegative_relative_fit(design: np.ndarray, ms: np.ndarray) -> np.ndarray:
    """``x >= 0`` minimising the sum of ``(design @ x / ms - 1)**2``: least squares on every
    subset of the columns, the best whose solution has no negative entry (three columns: seven
    subsets, exact where an iterative solver is not)."""
    scaled = design / ms[:, None]
    columns = range(design.shape[1])
    best, best_score = np.zeros(design.shape[1]), float(len(ms))  # all zero: every error is -1
    for size in range(1, design.shape[1] + 1):
        for subset in itertools.combinations(columns, size):
            solution, *_ = np.linalg.lstsq(scaled[:, subset], np.ones_like(ms), rcond=None)
            if np.any(solution < 0):
                continue
            x = np.zeros(design.shape[1])
            x[list(subset)] = solution
            score = float(np.sum((scaled @ x - 1) ** 2))
            if score < best_score:
                best, best_score = x, score
    return best


def _flop_parts(model: AnalyticalCostModel, point: dict) -> tuple[float, float]:
    if point["layer"] == "encoder":
        matmul, attention = model.encoder_flop_parts(point["phase"], RecomputeType.NONE, point["mbs"], point["seqlen"])
        return float(matmul), float(attention)
    return float(model.postprocess_flops(point["phase"], point["mbs"], point["seqlen"])), 0.0


def _analytical(spec: ModelSpec, tp: int) -> AnalyticalCostModel:
    return AnalyticalCostModel(**gpt_shape(spec, tp))


def _document(profile: ProfileRun) -> dict:
    measured = profile.document(complete=True)
    points = [r for r in measured["layer_time"] if r["layer"] in ("encoder", "postprocess")]
    fit = fit_analytical(points, profile.spec)
    if profile.device.type == "cuda":
        memory_mb = torch.cuda.get_device_properties(profile.device).total_memory / 2**20
    else:
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    gpt = _analytical(profile.spec, 1)
    values = dict(fit, **{key: getattr(gpt, key) for key in ("hidden_size", "num_heads", "ffn_hidden_size",
                                                             "vocab_size") + CALIBRATED_SHAPE},
                  device_memory_mb=round(memory_mb, 1))
    return calibrated_document(
        name=f"{profile.spec.label} on {measured['metadata']['device']}, calibrated",
        source=measured["source"] + ", calibrated analytical model",
        hidden_size=profile.spec.hidden_size,
        metadata=dict(measured["metadata"], calibration={
            "points": len(points), "median_error_pct": round(fit["median_error_pct"], 2),
            "max_error_pct": round(fit["max_error_pct"], 2), "measured": points}),
        settings=values, overhead=measured["microbatch_overhead"])
