"""A device's compute rates read from a table of its kernels' times, as
``benchmarks/bench_kernels.py`` measures them on a GPU: the roofline's ``gemm_efficiency`` (the
median rate of the GEMMs of at least 1 TFLOP, over the peak), ``memory_efficiency`` (the fastest
device copy, over the bandwidth) and ``fused_attention`` (per phase, the line ``flops / rate +
latency`` fitted to the causal attention backend's times). ``megatron-dynapipe calibrate
--from-kernels`` writes them into a hardware file; nothing here imports torch.

A table is a JSON object: ``peak_tflops`` (bf16, of the device measured), ``rows`` (``kind``
``gemm`` with ``m``, ``n``, ``k``, ``tflops`` and ``measured_over_roofline``; ``attention`` with
``backend``, ``seq``, ``head_dim``, ``heads``, ``forward_ms``, ``backward_ms``; ``copy`` with
``GBps``), and what it was measured on (``device``, ``torch``, ``date``).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

__all__ = ["KernelTable", "KernelTableError", "attention_line", "read_kernel_table", "summary"]

#: the attention backend transformer-engine runs on Hopper (a file's ``fused_attention``), and the
#: one torch's scaled_dot_product_attention picks there for a causal bf16 core (``sdpa_attention``)
DEFAULT_BACKEND, SDPA_BACKEND = "cudnn_attention", "flash_attention"
LARGE_GEMM_FLOPS = 1e12  # a GEMM this large runs at the library's sustained rate


class KernelTableError(ValueError):
    """A kernel table that cannot be read: the message names the file and what is wrong."""


def attention_line(rows: list[dict], backend: str, phase: str) -> dict:
    """The roofline's fused-attention constants for one backend and phase: ``ms = flops / rate +
    latency`` fitted by least squares on relative error over every measured shape (forward two
    GEMMs over the causal half, backward five)."""
    mine = [r for r in rows if r.get("backend") == backend and "error" not in r]
    gemms = 2 if phase == "forward" else 5
    flops = np.array([gemms * r["seq"] ** 2 * r["head_dim"] * r["heads"] for r in mine], dtype=float)
    ms = np.array([r[f"{phase}_ms"] for r in mine])
    (per_flop, latency_ms), *_ = np.linalg.lstsq(np.stack([flops / ms, 1 / ms], axis=1), np.ones_like(ms), rcond=None)
    errors = (flops * per_flop + latency_ms) / ms - 1
    return {"tflops": 1 / per_flop / 1e9, "latency_us": latency_ms * 1e3,
            "worst_error_pct": float(np.max(np.abs(errors)) * 100), "median_error_pct": float(np.median(np.abs(errors)) * 100)}


def summary(rows: list[dict], peak_tflops: float, bandwidth: float) -> dict:
    """What the roofline's constants are read from: GEMM TFLOP/s over the peak (median of the GEMMs
    of at least 1 TFLOP) and measured over roofline time (median of all), each attention backend's
    line (:func:`attention_line`) with its rate over the peak, the fastest copy over the bandwidth."""
    big = [r["tflops"] for r in rows if r["kind"] == "gemm" and 2 * r["m"] * r["n"] * r["k"] >= LARGE_GEMM_FLOPS]
    out = {"gemm_efficiency_large": statistics.median(big) / peak_tflops if big else None,
           "gemm_measured_over_roofline": statistics.median(
               [r["measured_over_roofline"] for r in rows if r["kind"] == "gemm"] or [float("nan")])}
    for backend in sorted({r["backend"] for r in rows if r["kind"] == "attention" and "error" not in r}):
        lines = {phase: attention_line(rows, backend, phase) for phase in ("forward", "backward")}
        out[f"attention_{backend.lower()}"] = {
            **{f"{phase}_efficiency": line["tflops"] / peak_tflops for phase, line in lines.items()},
            **{f"{phase}_latency_us": line["latency_us"] for phase, line in lines.items()},
            **{f"{phase}_worst_error_pct": line["worst_error_pct"] for phase, line in lines.items()}}
    copies = [r["GBps"] for r in rows if r["kind"] == "copy"]
    out["memory_efficiency"] = max(copies) / bandwidth if copies else None
    return out


@dataclass(frozen=True)
class KernelTable:
    """A kernel table as read (:func:`read_kernel_table`)."""

    path: Path
    peak_tflops: float
    rows: list
    measured_on: str  # "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, 2026-11-26"

    def compute_section(self, section: Mapping[str, Any], bandwidth_GBps: float,
                        backend: str = DEFAULT_BACKEND) -> dict[str, Any]:
        """A hardware file's ``compute`` section with the table's rates in place of its own: GEMM
        and memory efficiency, ``backend``'s attention line and, where the table has its rows,
        torch's SDPA kernel's (its tile and SM count kept)."""
        found = summary(self.rows, self.peak_tflops, bandwidth_GBps)
        line = found.get(f"attention_{backend}")
        if found["gemm_efficiency_large"] is None or found["memory_efficiency"] is None or line is None:
            have = sorted(key[len("attention_"):] for key in found if key.startswith("attention_"))
            raise KernelTableError(f"{self.path}: needs GEMMs of at least 1 TFLOP, a copy and {backend} attention "
                                   f"rows (its attention backends: {', '.join(have) or 'none'}); measure with "
                                   "benchmarks/bench_kernels.py --json on the GPU")
        if found["memory_efficiency"] > 1 or found["gemm_efficiency_large"] > 1:
            raise KernelTableError(f"{self.path}: its kernels ran above this hardware file's peaks ({bandwidth_GBps:g} "
                                   f"GB/s, {self.peak_tflops:g} TFLOP/s): give --hardware the file of the device "
                                   "measured (an H200's bandwidth is 1.4x an H100's)")
        out = dict(section, gemm_efficiency=round(found["gemm_efficiency_large"], 4),
                   memory_efficiency=round(found["memory_efficiency"], 4), fused_attention=_rounded(line))
        out.pop("sdpa_attention", None)  # another device's, or another measurement's
        if f"attention_{SDPA_BACKEND}" in found:
            out["sdpa_attention"] = _rounded(found[f"attention_{SDPA_BACKEND}"])
        return out

    def describe(self, backend: str = DEFAULT_BACKEND) -> str:
        return (f"compute measured with benchmarks/bench_kernels.py ({len(self.rows)} kernels on {self.measured_on}; "
                f"{self.path.name}): large GEMMs' median rate, the fastest copy and {backend}'s causal attention line"
                f" ({SDPA_BACKEND}'s for torch's SDPA core where measured)")


def _rounded(line: Mapping[str, float]) -> dict[str, float]:
    """A hardware file's attention line (efficiencies to 4 places, latencies to 0.1 us)."""
    return {f"{phase}_{what}": round(line[f"{phase}_{what}"], 4 if what == "efficiency" else 1)
            for phase in ("forward", "backward") for what in ("efficiency", "latency_us")}


def read_kernel_table(path: "str | Path") -> KernelTable:
    """A kernel table from ``path``, or KernelTableError naming what is missing."""
    path = Path(path)
    if not path.is_file():
        raise KernelTableError(f"{path}: no such kernel table; give the JSON benchmarks/bench_kernels.py --json wrote")
    try:
        doc = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise KernelTableError(f"{path} is not JSON ({error}): give the file benchmarks/bench_kernels.py --json "
                               "wrote") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) or not _positive(doc.get("peak_tflops")):
        raise KernelTableError(f"{path}: a kernel table is an object with 'rows' (a list) and 'peak_tflops' (a positive "
                               "number), as benchmarks/bench_kernels.py --json writes")
    bad = next((i for i, row in enumerate(doc["rows"]) if not _row_ok(row)), None)
    if bad is not None:
        raise KernelTableError(f"{path}: row {bad} is not a gemm, attention or copy measurement with its fields "
                               f"({str(doc['rows'][bad])[:120]})")
    measured_on = ", ".join(str(doc[k]) for k in ("device", "torch", "date") if doc.get(k)) or "an unnamed device"
    return KernelTable(path, float(doc["peak_tflops"]), doc["rows"], measured_on)


_FIELDS = {"gemm": ("m", "n", "k", "tflops", "measured_over_roofline"),
           "attention": ("seq", "head_dim", "heads", "forward_ms", "backward_ms"),
           "copy": ("GBps",)}


def _row_ok(row) -> bool:
    if not isinstance(row, dict) or row.get("kind") not in _FIELDS:
        return False
    if row["kind"] == "attention" and ("error" in row or not isinstance(row.get("backend"), str)):
        return "error" in row  # a backend that failed on a shape is noted, not measured
    return all(_positive(row.get(field)) for field in _FIELDS[row["kind"]])


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
