"""The numbers a user reads off a plan, as one JSON-ready dictionary."""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from megatron_dynapipe.planning.baselines import ideal_gain, lower_bound_ms, plan_baseline
from megatron_dynapipe.planning.breakdown import PipelineRun, explain
from megatron_dynapipe.planning.methods import yardstick
from megatron_dynapipe.planning.planner import PlanResult, megatron_row_length, rank_costs
from megatron_dynapipe.planning.spec import TrainingSpec
from megatron_dynapipe.planning.types import RecomputeType


def summarize(result: PlanResult, lengths: Sequence[int], spec: TrainingSpec,
              pack_length: int | None = None, with_baseline: bool = True) -> dict:
    costs = result.costs
    planned = lengths if result.pieces is None else result.pieces.length  # what the plans' samples are
    bound = max(lower_bound_ms(costs, c.microbatches, c.recompute, chunks=spec.chunks) for c in result.choices)
    summary = {
        "num_samples": len(lengths),
        "tokens": int(sum(lengths)),
        "pp": spec.pp, "chunks": spec.chunks, "dp": spec.dp, "tp": spec.tp, "cp": spec.cp, "num_layers": spec.num_layers,
        "cost_model": costs.model.describe(),
        "p2p_link": costs.p2p_link.to_json(),  # the profile's measured link, else the default
        "memory_limit_mb": spec.memory_limit_mb,
        "fast_mode": result.fast_mode,
        "fast_mode_setting": result.budget.setting,  # True, False or "auto", as asked
        "fast_mode_source": result.budget.source,  # where it was asked: call, TrainingSpec, DYNAPIPE_FAST_MODE, default
        "packing": spec.packing,
        "documents": spec.documents,
        "pieces": None if result.pieces is None else len(result.pieces),
        "planning_seconds": result.planning_seconds,
        "schedule": sorted({c.candidate.schedule for c in result.choices}),
        "makespan_ms": result.makespan_ms,
        "lower_bound_ms": bound,
        "makespan_over_lower_bound": result.makespan_ms / bound,
        "peak_memory_mb": [round(float(m), 1) for m in result.peak_memory_mb],
        "dp_ranks": [_rank_summary(c) for c in result.choices],
    }
    pack_length = pack_length or megatron_row_length(lengths, spec)
    why = explain(PipelineRun.of_plan(result), costs, planned, lengths, pack_length, spec.chunks)
    summary["why"] = why.to_json()
    if with_baseline:
        baseline = plan_baseline(spec.packing, planned, costs, spec.memory_limit_mb, pack_length, spec.chunks,
                                 rank_costs(costs, spec))
        summary["baseline"] = None if baseline is None else {
            "method": baseline.method, "schedule": baseline.schedule, "seq_len": baseline.seq_len,
            "microbatch_size": baseline.microbatch_size,
            "recompute": baseline.recompute.label, "num_sequences": baseline.num_sequences,
            "makespan_ms": baseline.makespan_ms, "of_ideal": why.ideal_ms / baseline.makespan_ms,
        }
        summary["speedup_vs_packing"] = None if baseline is None else baseline.makespan_ms / result.makespan_ms
        # the ideal is exact-length padded micro-batches against packing: no yardstick for packed ones
        summary["ideal_gain_vs_packing"] = None if spec.packed else ideal_gain(
            planned, costs, pack_length, spec.seqlen_round)
    return summary


def _rank_summary(choice) -> dict:
    counts = np.bincount(np.ravel(choice.recompute), minlength=len(RecomputeType))
    return {
        "schedule": choice.candidate.schedule,
        # which of the search's micro-batchings won: its own cuts ("mixed", "full, light start", ...),
        # a rank's Megatron rows ("rows of seq-length") or Megatron's own packing ("dp_balanced packing", ...)
        "microbatching": choice.candidate.microbatching,
        "makespan_ms": choice.makespan_ms,
        "candidates_tried": choice.candidates_tried,
        # (stage, micro-batch) pairs per recompute type
        "recompute_ops": {rc.label: int(counts[rc]) for rc in RecomputeType if counts[rc]},
        "microbatches": [{"size": mb.size, "seq_len": mb.seq_len, "samples": list(mb.samples), "packed": mb.packed}
                         for mb in choice.microbatches],
    }


def _padding_share(speedup: float, ideal: float) -> str:
    """What exact lengths alone would gain over packing (compute only), beside the plan's gain:
    the difference is what the two pay in recompute and pipeline bubbles."""
    rest = "the rest" if speedup >= ideal else "the shortfall"
    return f" (exact lengths alone, compute only: {ideal:.2f}x; {rest}: recompute and pipeline bubbles)"


def format_summary(summary: dict) -> str:
    lines = [
        f"global batch: {summary['num_samples']} samples"
        f"{'' if summary.get('pieces') is None else ' cut into ' + str(summary['pieces']) + ' pieces'}, "
        f"{summary['tokens']} tokens; "
        f"PP={summary['pp']}{_times(summary.get('chunks', 1), 'chunks')} DP={summary['dp']} TP={summary['tp']}"
        f"{'' if summary.get('cp', 1) == 1 else ' CP=' + str(summary['cp'])}, limit {summary['memory_limit_mb']:.0f} MB",
        f"fast mode: {'on' if summary['fast_mode'] else 'off'}{_fast_mode_why(summary)}; "
        f"planning took {summary['planning_seconds']:.3f} s",
        f"model: {summary['num_layers']} layers priced by {summary['cost_model']}",
    ]
    for r, rank in enumerate(summary["dp_ranks"]):
        packed = any(m["packed"] for m in rank["microbatches"])
        shapes = _runs(f"{m['size']}{'in' if packed else 'x'}{m['seq_len']}" for m in rank["microbatches"])
        lines += [
            f"dp rank {r}: {rank['schedule']}, {len(rank['microbatches'])} micro-batches "
            f"({'samples in packed length' if packed else 'size x padded length'}, in pipeline order): {shapes}",
            "  recompute per (stage, micro-batch): "
            + ", ".join(f"{k} {v}" for k, v in sorted(rank["recompute_ops"].items())),
            f"  predicted {rank['makespan_ms']:.1f} ms after {rank['candidates_tried']} candidates "
            f"(micro-batching: {rank['microbatching']})",
        ]
    lines.append(f"predicted iteration: {summary['makespan_ms']:.1f} ms "
                 f"(lower bound {summary['lower_bound_ms']:.1f} ms, ratio {summary['makespan_over_lower_bound']:.3f})")
    lines.append("peak memory per stage (MB): " + ", ".join(f"{m:.0f}" for m in summary["peak_memory_mb"]))
    lines += _why_lines(summary["why"], len(summary["dp_ranks"]))
    base, against = summary.get("baseline"), yardstick(summary["packing"]).label
    if base:
        ideal, speedup = summary["ideal_gain_vs_packing"], summary["speedup_vs_packing"]
        schedule = {"1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B"}[base["schedule"]]
        lines.append(f"{against} to {base['seq_len']} + {schedule} (micro-batch "
                     f"{base['microbatch_size']}, recompute {base['recompute']}): {base['makespan_ms']:.1f} ms "
                     f"-> speed-up {speedup:.2f}x" + ("" if ideal is None else _padding_share(speedup, ideal))
                     + f"; {base['of_ideal']:.2f} of the ideal")
        if summary["speedup_vs_packing"] < 1 and ideal is not None:
            lines.append("  the plan is slower than packing here: packing concatenates several samples into one "
                         "sequence, which a plan (one sample per sequence row, padded) cannot represent, so the "
                         "search cannot fall back on it; train with packing for this batch if it matters")
    elif "baseline" in summary:
        lines.append(f"{against} + 1F1B: no micro-batch size fits the memory limit")
    for key, what in (("chrome_trace", "Chrome trace"), ("gantt", "Gantt chart")):
        if key in summary:
            lines.append(f"wrote {what} to {summary[key]}")
    return "\n".join(lines)


def _why_lines(why: dict, ranks: int) -> list[str]:
    """The plan's iteration taken apart (:mod:`~megatron_dynapipe.planning.breakdown`)."""
    slowest = (f"dp rank {why['slowest_rank']}, {why['above_mean']:+.1%} over the ranks' mean; "
               if ranks > 1 else "")
    return [f"why: {slowest}its busiest stage computes {why['busy_ms']:.1f} ms (recompute {why['recompute_ms']:.1f}, "
            f"padding {why['padding_ms']:.1f}: {why['padding_share']:.0%} of the tokens), bubble "
            f"{why['bubble_ms']:.1f} ms",
            f"ideal (the real tokens' compute spread evenly over every rank): {why['ideal_ms']:.1f} ms; the plan "
            f"reaches {why['ideal_ms'] / why['pipeline_ms']:.2f} of it"]


def _runs(shapes) -> str:
    """Shapes in order, a run of one shape written once with its count (``1x1024 (x512)``): a plan
    of 65,536 micro-batches is a few lines, not a line of half a megabyte."""
    runs = ((shape, sum(1 for _ in run)) for shape, run in itertools.groupby(shapes))
    return ", ".join(shape if count == 1 else f"{shape} (x{count})" for shape, count in runs)


def _times(count: int, what: str) -> str:
    return "" if count == 1 else f" x {count} {what}"


def _fast_mode_why(summary: dict) -> str:
    """" (auto: 4096 samples)" or " (DYNAPIPE_FAST_MODE)" where the setting was not given outright."""
    setting, source = summary.get("fast_mode_setting"), summary.get("fast_mode_source")
    if setting == "auto":
        return f" (auto: {summary['num_samples']} samples)"
    return f" ({source})" if source in ("DYNAPIPE_FAST_MODE", "default") else ""
