"""Shapes-only traces priced for the hardware they are simulated on.

A shapes-only trace computes nothing: its compute durations are a cost model's answers, and when
a hardware file built that model the trace header says which (``meta.compute_hardware``).  Such
a trace says as much about an H100 as about an A100, so :func:`reprice` asks the simulated
hardware's own model (:meth:`Hardware.cost_model`) for every top-level compute op: forward and
backward of each model chunk, and the recompute op a derived variant (:mod:`.variants`) added.
Traces timed on a device (``wall``, ``cuda_events``) or priced by a profile keep their durations:
they are a measurement of one device (``simulate`` refuses one that beats the hardware's peak).
Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.hardware import Hardware
from megatron_dynapipe.tracer.shapes_only_costs import compute_cost_fn

if TYPE_CHECKING:
    from megatron_dynapipe.simulate.traced_job import TracedJob

__all__ = ["priced_for", "reprice"]


def priced_for(job: "TracedJob") -> Optional[str]:
    """The hardware a shapes-only job's compute was priced for (None: timed, or a profile's)."""
    trace = next(iter(job.traces.values()))
    return trace.meta.get("compute_hardware") if trace.mode == "shapes_only" else None


def reprice(job: "TracedJob", hardware: Hardware) -> "TracedJob":
    """``job`` with its hardware-priced compute priced for ``hardware`` (unchanged otherwise).
    A planned trace's plans were made for the hardware it was priced for: refused on another."""
    traced_for = priced_for(job)
    if job.iteration.get("planned"):
        if traced_for not in (None, hardware.name):
            raise ValueError(f"{job.folder.name} was planned for {traced_for}, whose costs shaped its plans: simulate "
                             f"it with that --hardware, or trace it again with --hardware {hardware.name}")
        return job
    if traced_for is None:
        return job
    it = job.iteration
    traced = MegatronOptions(**job.training)
    derived = _with_recompute(traced, it.get("recompute_granularity"))
    mbs, seq = int(it["micro_batch_size"]), int(it["seq_length"])
    model = hardware.cost_model(job.model, job.layout.tp, job.dtype, memory_limited=False)
    traces = {}
    for rank, trace in job.traces.items():
        as_traced = compute_cost_fn(model, job.model, job.layout, trace.stage, mbs, seq, traced)[0]
        as_derived = (as_traced if derived == traced
                      else compute_cost_fn(model, job.model, job.layout, trace.stage, mbs, seq, derived)[0])
        ops = [dataclasses.replace(op, dur_us=1e3 * (as_derived if op.kind == "recompute" else as_traced)(
                   op.kind, op.microbatch, op.chunk))
               if op.parent is None and op.cat == "compute" and op.kind in ("forward", "backward", "recompute") else op
               for op in trace.ops]
        traces[rank] = dataclasses.replace(trace, ops=ops, meta={**trace.meta, "compute_hardware": hardware.name})
    return dataclasses.replace(job, traces=traces)


def _with_recompute(traced: MegatronOptions, derived: Optional[str]) -> MegatronOptions:
    """The options of a variant :func:`~.variants.derive` made (``derived``: its recompute)."""
    if derived in (None, "none"):
        return traced
    if derived == "selective":
        return dataclasses.replace(traced, recompute_granularity="selective", recompute_method=None,
                                   recompute_num_layers=None)
    return dataclasses.replace(traced, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
