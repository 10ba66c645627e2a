"""What a simulated iteration says: time, bubbles, exposed communication, MFU, memory; its timeline.

* **iteration time**: the last rank's end, per traced iteration;
* **pipeline bubble**: the stages' mean idle time (waiting for a neighbour's activations or
  gradients, for a slower stage at a shared collective, or after their last op), as a fraction
  of the iteration (1F1B with equal stages: ``(p-1) / (m+p-1)``);
* **exposed communication**: per kind, the busiest rank's blocking communication time (what
  compute did not hide); ``overlapped`` is what ran behind compute;
* **TFLOP/s per GPU and MFU**: model FLOPs of the global batch (:mod:`megatron_dynapipe.config.accounting`, causal attention
  as megatron-core counts) over iteration time and world size, and over the dtype's peak; a
  planned trace's on each batch's real samples, each attending to itself alone (its padding
  and attention across samples are not model FLOPs); *hardware* FLOP/s add what recomputation
  runs again (for a planned trace in the same proportion as at the traced recompute setting);
* **memory**: each stage's traced peak (``memory.peak_bytes``) against the device's memory.

A planned trace (``trace --method dynapipe``: one traced iteration a drawn batch, data-parallel
rank 0's plans) reports each batch's step: that iteration replayed alone, plus how much longer
the slowest data-parallel rank's planned pipeline is than rank 0's (the gradient reduction waits
for it); the iteration time is their mean, and the batches' mean and 95th percentile are kept.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatron_dynapipe.chrome_trace import ChromeTrace
from megatron_dynapipe.config.accounting import step_flops
from megatron_dynapipe.hardware import Hardware
from megatron_dynapipe.simulate.replay import Replay, simulate_job
from megatron_dynapipe.simulate.traced_job import TracedJob

__all__ = ["StageReport", "SimulationReport", "planned_steps", "report", "format_report", "timeline"]


@dataclass
class StageReport:
    stage: int
    rank: int
    compute_s: float
    comm_s: float
    idle_s: float
    peak_memory_gib: float
    memory_method: str
    fits: bool


@dataclass
class SimulationReport:
    folder: str
    hardware: str
    layout: str
    world_size: int
    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    micro_batch_size: int
    num_microbatches: int
    global_batch_size: int
    seq_length: int
    dtype: str
    trace_mode: str
    compute_from: str
    iteration_s: float
    tokens_per_s: float
    bubble_fraction: float
    exposed_comm_s: dict[str, float]
    overlapped_comm_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    hardware_mfu: float
    peak_memory_gib: float
    device_memory_gib: float
    fits: bool
    stages: list[StageReport]
    planned: "dict[str, Any] | None" = None  # a planned trace's batches (module docstring)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def report(replay: Replay) -> SimulationReport:
    job, hw = replay.job, replay.hardware
    iters, replayed = job.iterations, replay.iteration_us / 1e6
    planned = planned_steps(job, hw)
    seconds = planned["mean_step_s"] if planned else replayed
    first = next(iter(job.traces.values()))
    it, layout = job.iteration, job.layout
    seq = int(it["seq_length"])
    tokens = job.global_batch_size * seq
    recompute = str(it.get("recompute_granularity") or "none")
    fixed = step_flops(job.model, tokens, seq, tp=layout.tp)
    model_flops = planned["model_flops"] if planned and planned["model_flops"] else fixed
    hardware_flops = model_flops * step_flops(job.model, tokens, seq, tp=layout.tp, recompute=recompute) / fixed
    per_gpu = 1e12 * seconds * layout.world_size
    peak = hw.peak(job.dtype)
    stages = [_stage(replay, rank, iters) for rank in sorted(replay.ranks, key=lambda r: (replay.ranks[r].stage, r))]
    exposed: dict[str, float] = {}
    for rr in replay.ranks.values():
        for kind, us in rr.comm_us.items():
            exposed[kind] = max(exposed.get(kind, 0.0), us / iters / 1e6)
    peak_gib = max(s.peak_memory_gib for s in stages)
    if seconds and hardware_flops / per_gpu > peak:
        raise ValueError(f"{job.folder}: the traced compute ({_compute_from(first)}) runs faster than {hw.name}'s "
                         f"peak ({hardware_flops / per_gpu:.0f} > {peak:g} TFLOP/s per GPU): it was measured on "
                         f"another device; simulate with that device's hardware file, or re-trace shapes-only with "
                         f"--hardware {hw.name}")
    return SimulationReport(
        folder=str(job.folder), hardware=hw.name, layout=layout.describe(), world_size=layout.world_size,
        tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, dp=layout.dp,
        micro_batch_size=int(it["micro_batch_size"]), num_microbatches=int(it["num_microbatches"]),
        global_batch_size=job.global_batch_size, seq_length=seq, dtype=job.dtype, trace_mode=first.mode,
        compute_from=_compute_from(first),
        iteration_s=seconds, tokens_per_s=tokens / seconds if seconds else 0.0,
        bubble_fraction=sum(s.idle_s for s in stages) / len(stages) / replayed if replayed else 0.0,
        exposed_comm_s=dict(sorted(exposed.items())),
        overlapped_comm_s=max(r.overlapped_us for r in replay.ranks.values()) / iters / 1e6,
        model_tflops_per_gpu=model_flops / per_gpu if seconds else 0.0,
        hardware_tflops_per_gpu=hardware_flops / per_gpu if seconds else 0.0,
        mfu=model_flops / per_gpu / peak if seconds else 0.0,
        hardware_mfu=hardware_flops / per_gpu / peak if seconds else 0.0,
        peak_memory_gib=peak_gib, device_memory_gib=hw.memory_gib, fits=all(s.fits for s in stages), stages=stages,
        planned=planned)


def planned_steps(job: TracedJob, hardware: Hardware) -> "dict[str, Any] | None":
    """A planned trace's step per batch (module docstring); None for Megatron's fixed shapes."""
    planned = job.iteration.get("planned")
    if not planned:
        return None
    traced = int(planned["traced_dp_rank"])
    steps = []
    for index, batch in enumerate(planned["batches"]):
        alone = simulate_job(job.only_iteration(index), hardware, spans=False).makespan_us / 1e6
        slower = (max(batch["pipeline_ms"]) - batch["pipeline_ms"][traced]) / 1e3
        steps.append({"step_s": alone + slower, "traced_rank_s": alone, "slowest_rank_extra_s": slower,
                      "tokens": batch["tokens"], "samples": batch["samples"], "microbatches": batch["microbatches"]})
    times = [s["step_s"] for s in steps]
    flops = [batch.get("model_flops") for batch in planned["batches"]]  # on real tokens; absent from older traces
    return {"method": planned["method"], "source": planned["source"], "batches": steps,
            "model_flops": float(np.mean(flops)) if all(flops) else None,
            "mean_step_s": float(np.mean(times)), "p95_step_s": float(np.percentile(times, 95)),
            "real_tokens_per_s": sum(s["tokens"] for s in steps) / sum(times)}


def _compute_from(trace) -> str:
    """Where the compute durations come from: a clock, or a cost model (for which hardware)."""
    if trace.clock != "cost_model":
        return trace.clock
    hardware = trace.meta.get("compute_hardware")
    return f"cost model {trace.meta.get('cost_model') or 'analytical'}" + (f" for {hardware}" if hardware else "")


def _stage(replay: Replay, rank: int, iters: int) -> StageReport:
    rr, trace = replay.ranks[rank], replay.job.traces[rank]
    peak = float(trace.memory.get("peak_bytes") or 0)
    idle = sum(rr.wait_us.values()) + replay.makespan_us - rr.end_us  # a stage that ends early idles too
    return StageReport(stage=rr.stage, rank=rank, compute_s=rr.compute_us / iters / 1e6,
                       comm_s=sum(rr.comm_us.values()) / iters / 1e6, idle_s=idle / iters / 1e6,
                       peak_memory_gib=peak / 2**30, memory_method=str(trace.memory.get("method") or "unknown"),
                       fits=peak <= replay.hardware.memory_bytes)


def format_report(rep: SimulationReport) -> str:
    fit = "fits" if rep.fits else "DOES NOT FIT"
    lines = [
        f"{Path(rep.folder).name}",
        f"  {rep.layout}, micro-batch {rep.micro_batch_size} x {rep.num_microbatches}, global batch "
        f"{rep.global_batch_size}, seq {rep.seq_length}, {rep.dtype}, on {rep.hardware} (compute from {rep.compute_from})",
        f"  iteration {rep.iteration_s * 1e3:.1f} ms, {rep.tokens_per_s:,.0f} tokens/s, pipeline bubble "
        f"{rep.bubble_fraction:.1%}",
        f"  {rep.model_tflops_per_gpu:.1f} model TFLOP/s per GPU (MFU {rep.mfu:.1%}), "
        f"{rep.hardware_tflops_per_gpu:.1f} with recompute (HFU {rep.hardware_mfu:.1%})",
        "  exposed communication: " + (", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in rep.exposed_comm_s.items()) or "none")
        + (f"; overlapped {rep.overlapped_comm_s * 1e3:.2f} ms" if rep.overlapped_comm_s else ""),
        f"  peak memory {rep.peak_memory_gib:.2f} GiB of {rep.device_memory_gib:.0f} GiB: {fit}",
    ]
    if rep.planned:
        p = rep.planned
        lines.insert(2, f"  {p['method']} on {p['source']}, {len(p['batches'])} batches: step mean "
                        f"{p['mean_step_s'] * 1e3:.1f} ms, p95 {p['p95_step_s'] * 1e3:.1f} ms (the slowest "
                        f"data-parallel rank's), {p['real_tokens_per_s']:,.0f} real tokens/s")
    lines.append("  stage  rank  compute ms  comm ms    idle ms  memory GiB")
    for s in rep.stages:
        lines.append(f"  {s.stage:>5}  {s.rank:>4}  {s.compute_s * 1e3:>10.2f}  {s.comm_s * 1e3:>7.2f}  "
                     f"{s.idle_s * 1e3:>9.2f}  {s.peak_memory_gib:>10.2f}" + ("" if s.fits else "  (too big)"))
    return "\n".join(lines)


def timeline(replay: Replay) -> ChromeTrace:
    """The simulated iteration(s) as a Chrome/Perfetto timeline: a process per representative rank,
    rows ``compute``, ``comm``, ``wait`` and ``overlap``."""
    if replay.iteration_us > 0 and not any(rr.spans for rr in replay.ranks.values()):
        raise ValueError("this replay kept no spans: simulate_job(..., spans=True) for a timeline")
    trace = ChromeTrace(folder=str(replay.job.folder), hardware=replay.hardware.name,
                        iteration_ms=replay.iteration_us / 1e3)
    for rank in sorted(replay.ranks, key=lambda r: (replay.ranks[r].stage, r)):
        rr = replay.ranks[rank]
        trace.process(rank, f"stage {rr.stage} (rank {rank})")
        for row in ("compute", "comm", "wait", "overlap"):
            for span in (s for s in rr.spans if s.row == row):
                trace.span(rank, row, span.label + ("" if span.microbatch is None else f" mb{span.microbatch}"),
                           cat=row, start_us=span.start_us, dur_us=span.dur_us,
                           args={"phase": span.phase, "microbatch": span.microbatch})
    return trace
