"""Planner benchmark: planning time and plan quality, normal vs fast mode.

GPT-6.7B on A100 (profiled cost model; ``--model`` on ``--hardware`` prices a named GPT on a
device's roofline instead), PP=4, 36 000 MB, lognormal(5.3, 0.9) lengths clipped
to 2048 by default (`--mix multitask` or `long` for the other built-in mixes); for each global
batch size, medians over seeds of planning seconds and predicted makespan in both modes, plus
the packing + 1F1B baseline and the lower bound. ``--memory-limit tight`` plans each batch at the
tightest limit normal mode can plan it under, found by bisection. ``--packing varlen`` plans packed
micro-batches and measures them against THD packing (whole) (Megatron's packed sequences of
whole samples without attention between them); the compute-only ideal is a padded plan's, and is
left out there.
``--chunks V`` plans an interleaved pipeline (V model chunks a rank, ``interleaved-1f1b``); its
baseline is the faster of Megatron's interleaved 1F1B over the same chunks and its 1F1B on the
same ranks that fits; its lower bound counts a rank's chunks together.
``--cp C`` splits every micro-batch's rows over C context-parallel ranks, each running the plan on
its share (every method priced per rank of the group).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import replace

from megatron_dynapipe.hardware import MEMORY_HEADROOM, default_memory_limit_mb
from megatron_dynapipe.hardware.pricing import add_pricing_arguments, pricing_from_args
from megatron_dynapipe.planning.baselines import ideal_gain, lower_bound_ms, plan_baseline
from megatron_dynapipe.planning.methods import yardstick
from megatron_dynapipe.config.model import get_model
from megatron_dynapipe.planning.cost_model import CostModelError, StageCosts, load_cost_model, split_over_cp
from megatron_dynapipe.planning.planner import PlanningError, generate_execution_plan, rank_costs
from megatron_dynapipe.planning.samples import MIXES, check_sample_count, synthetic_lengths
from megatron_dynapipe.planning.spec import PACKINGS, TrainingSpec
from megatron_dynapipe.progress import progress_bar

DEFAULT_COST_MODEL = "gpt-6.7b-a100"  # shipped with the package
DEFAULT_MODEL = "6.7B"  # the GPT it measured
SIZES = (8, 16, 32, 64, 256, 1024, 4096)
TIGHT = "tight"
TIGHT_RESOLUTION_MB = 16  # the bisection stops within this of the tightest limit


def memory_limit(text: str) -> "float | str":
    """``--memory-limit``: MB, or "tight"."""
    if text == TIGHT:
        return TIGHT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory limit: give MB (e.g. 36000) or 'tight'")
    return value


def add_arguments(p) -> None:
    p.add_argument("--cost-model", metavar="NAME|FILE",
                   help=f"profiled cost model (default: the shipped {DEFAULT_COST_MODEL})")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), metavar="N",
                   help=f"global batch sizes, in samples (default {' '.join(map(str, SIZES))})")
    p.add_argument("--seeds", type=int, default=3, help="seeds per size (medians are reported; default 3)")
    p.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=4,
                   help="pipeline stages (default 4)")
    p.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel size (default 1)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks, each planned (default 1)")
    p.add_argument("--chunks", "--num-virtual-stages-per-pipeline-rank", dest="chunks", type=int, default=1,
                   metavar="V", help="model chunks a rank: an interleaved pipeline (default 1)")
    p.add_argument("--cp", "--context-parallel-size", dest="cp", type=int, default=1,
                   help="context-parallel ranks each micro-batch's rows are split over (default 1)")
    p.add_argument("--memory-limit", type=memory_limit, metavar="MB|tight",
                   help=f"per-GPU memory limit (default: {1 - MEMORY_HEADROOM:g} of --hardware's memory, else "
                        f"{default_memory_limit_mb(None):.0f}), or 'tight': per batch, the tightest limit "
                        f"normal mode can plan it under (bisection to {TIGHT_RESOLUTION_MB} MB)")
    p.add_argument("--mix", default="lognormal", choices=MIXES, help="built-in length mix (default lognormal)")
    p.add_argument("--pack-length", type=int, default=4096, help="baseline packing length (default 4096)")
    p.add_argument("--packing", choices=PACKINGS, default="pad",
                   help="micro-batches padded, or packed without attention between samples and measured "
                        "against THD packing (whole) (default pad)")
    add_pricing_arguments(p)
    p.add_argument("--all-cores", action="store_true", help="do not pin the process to one core")
    p.add_argument("--phases", action="store_true",
                   help="also print where planning time goes (micro-batching, scheduling, lowering) per mode")
    p.add_argument("--json", action="store_true", help="print one JSON object per row")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="progress on stderr: a bar on a terminal, else a line every 30 s (default on)")


def _profiled_costs(args, spec: TrainingSpec) -> StageCosts:
    """The stages of ``--cost-model``'s profile (default: the shipped one) for ``spec``, one row a
    virtual stage, on one rank of its context-parallel group."""
    model = load_cost_model(args.cost_model or DEFAULT_COST_MODEL, tp=args.tp)
    try:  # the shipped profile's GPT prices the attention core context parallelism repeats
        model = split_over_cp(model, spec.cp, None if args.cost_model else get_model(DEFAULT_MODEL))
    except CostModelError:
        raise ValueError(f"--cp {spec.cp}: {args.cost_model} does not record the GPT it measured, whose attention "
                         "context parallelism repeats: use a profile made by `megatron-dynapipe profile`, or --model "
                         "NAME --hardware NAME") from None
    return StageCosts(model, num_layers=spec.num_layers, pp=spec.pp * spec.chunks, dp=spec.dp)


def run(args) -> int:
    if not args.all_cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # the targets are for one core

    if args.seeds < 1:
        raise ValueError(f"--seeds {args.seeds}: give how many batches to plan per size, at least 1")
    for size in args.sizes:
        check_sample_count(size, "--sizes")
    tight = args.memory_limit == TIGHT
    priced = pricing_from_args(args, args.tp)
    default_limit = priced.memory_limit_mb if priced else default_memory_limit_mb(None)
    spec = TrainingSpec(num_layers=priced.model.num_layers if priced else TrainingSpec.num_layers, pp=args.pp,
                        tp=args.tp, dp=args.dp, memory_limit_mb=args.memory_limit if args.memory_limit not in
                        (None, TIGHT) else default_limit, packing=args.packing, chunks=args.chunks, cp=args.cp,
                        seq_length=args.pack_length)
    costs = priced.stage_costs(spec) if priced else _profiled_costs(args, spec)
    chunks = f" x {spec.chunks} chunks" if spec.chunks > 1 else ""
    args.layout = f"{costs.model.describe()}, PP={spec.pp}{chunks} DP={spec.dp}"

    def fresh_costs():  # each timed plan starts with no remembered cost-model answers
        return replace(costs)

    ranks = rank_costs(costs, spec)  # the same ranks as whole stages, for Megatron's plain 1F1B
    generate_execution_plan([64] * max(8, spec.dp), spec, costs)  # imports and first-call costs outside the timings
    rows = []
    with progress_bar(args.progress, sys.stderr) as bar:
        task = bar.add_task(f"planning {args.mix} batches", total=len(args.sizes) * args.seeds)
        for size in args.sizes:
            runs = []
            for seed in range(args.seeds):
                lengths = synthetic_lengths(size, seed, args.mix)
                limit = tightest_limit(lengths, spec, fresh_costs) if tight else spec.memory_limit_mb
                runs.append(_measure(lengths, replace(spec, memory_limit_mb=limit), fresh_costs, costs, ranks, args))
                bar.advance(task)
            rows.append(_row(size, runs))
            if args.json:
                print(json.dumps(rows[-1]), flush=True)
    if not args.json:
        print(format_table(rows, args))
        if args.phases:
            print(format_phases(rows))
    return 0


def _measure(lengths, spec: TrainingSpec, fresh_costs, costs, ranks, args) -> dict:
    """One batch planned in both modes, its packing baseline (Megatron's schedule of the layout)
    and its lower bound."""
    normal = generate_execution_plan(lengths, spec, fresh_costs(), fast_mode=False)
    fast = generate_execution_plan(lengths, spec, fresh_costs(), fast_mode=True)
    base = plan_baseline(spec.packing, lengths, costs, spec.memory_limit_mb, args.pack_length, spec.chunks, ranks)
    bound = max(lower_bound_ms(costs, c.microbatches, c.recompute, chunks=spec.chunks) for c in normal.choices)
    return {
        "limit_mb": spec.memory_limit_mb,
        "normal_s": normal.planning_seconds, "fast_s": fast.planning_seconds,
        "normal_ms": normal.makespan_ms, "fast_ms": fast.makespan_ms,
        "packing_ms": base.makespan_ms if base else float("nan"),
        "ideal": ideal_gain(lengths, costs, args.pack_length) if not spec.packed else float("nan"),
        "bound_ms": bound,
        "phases": {"normal": normal.phase_seconds, "fast": fast.phase_seconds},
    }


def tightest_limit(lengths, spec: TrainingSpec, fresh_costs) -> float:
    """The least memory limit (to TIGHT_RESOLUTION_MB) under which normal mode plans the batch:
    bisection between the model state, which no limit may be under, and a limit that plans."""
    costs = fresh_costs()
    infeasible = max(costs.model_state_mb(s) for s in range(costs.pp))  # a chunk's, with chunks: still below
    feasible = 2 * infeasible
    while not _plans(lengths, replace(spec, memory_limit_mb=feasible), fresh_costs):
        infeasible, feasible = feasible, 2 * feasible
    while feasible - infeasible > TIGHT_RESOLUTION_MB:
        middle = (infeasible + feasible) / 2
        if _plans(lengths, replace(spec, memory_limit_mb=middle), fresh_costs):
            feasible = middle
        else:
            infeasible = middle
    return feasible


def _plans(lengths, spec: TrainingSpec, fresh_costs) -> bool:
    try:
        generate_execution_plan(lengths, spec, fresh_costs(), fast_mode=False)
    except PlanningError:
        return False
    return True


def _row(size: int, runs: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "phases"}
    speedup = statistics.median(r["packing_ms"] / r["normal_ms"] for r in runs)
    ideal = med["ideal"]
    row = {
        "samples": size, "seeds": len(runs), "limit_mb": med["limit_mb"],
        "normal_plan_s": med["normal_s"], "fast_plan_s": med["fast_s"],
        "fast_planning_speedup": statistics.median(r["normal_s"] / r["fast_s"] for r in runs),
        "normal_makespan_ms": med["normal_ms"], "fast_makespan_ms": med["fast_ms"],
        "fast_over_normal_makespan": statistics.median(r["fast_ms"] / r["normal_ms"] for r in runs),
        "speedup_vs_packing": speedup, "ideal_gain": ideal, "share_of_ideal": speedup / ideal,
        "makespan_over_lower_bound": statistics.median(r["normal_ms"] / r["bound_ms"] for r in runs),
        "phases_ms": {mode: {phase: 1000 * statistics.median(r["phases"][mode][phase] for r in runs)
                             for phase in runs[0]["phases"][mode]} for mode in ("normal", "fast")},
    }
    return row


def format_table(rows: list[dict], args) -> str:
    limit = "the tightest limit per batch" if args.memory_limit == TIGHT else f"{rows[0]['limit_mb']:.0f} MB"
    head = (f"planner benchmark: {args.mix} lengths, {args.packing} micro-batches, {args.layout}, {limit}, "
            f"medians of {rows[0]['seeds'] if rows else 0} seeds, "
            f"{yardstick(args.packing).label} to {args.pack_length}"
            f"{' on interleaved 1F1B or 1F1B, the faster that fits' if args.chunks > 1 else ''}\n")
    cols = ["samples", "limit MB", "normal s", "fast s", "fast speed-up", "normal ms", "fast/normal", "vs packing",
            "ideal", "share", "/bound"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append(
            f"| {r['samples']} | {r['limit_mb']:.0f} | {r['normal_plan_s']:.3f} | {r['fast_plan_s']:.3f} "
            f"| {r['fast_planning_speedup']:.1f}x | {r['normal_makespan_ms']:.0f} "
            f"| {r['fast_over_normal_makespan']:.3f} "
            f"| {_times(r['speedup_vs_packing'])} | {_times(r['ideal_gain'])} | {_percent(r['share_of_ideal'])} "
            f"| {r['makespan_over_lower_bound']:.3f} |")
    return head + "\n".join(lines)


def _times(ratio: float) -> str:
    return "-" if math.isnan(ratio) else f"{ratio:.2f}x"  # nan: packing fits nothing, or no ideal (packed plans)


def _percent(share: float) -> str:
    return "-" if math.isnan(share) else f"{share:.0%}"


def format_phases(rows: list[dict]) -> str:
    """Median milliseconds per planning phase, normal / fast mode."""
    phases = list(rows[0]["phases_ms"]["normal"]) if rows else []
    lines = ["where planning time goes (median ms, normal / fast)",
             "| samples | " + " | ".join(phases) + " |", "|" + "---|" * (len(phases) + 1)]
    for r in rows:
        cells = [f"{r['phases_ms']['normal'][p]:.1f} / {r['phases_ms']['fast'][p]:.1f}" for p in phases]
        lines.append(f"| {r['samples']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
