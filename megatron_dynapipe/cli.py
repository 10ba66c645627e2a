"""`megatron-dynapipe` command line: plan a batch, trace fake ranks, run benchmarks."""

from __future__ import annotations

import argparse
import json
import sys

from .planning.samples import MIXES
from .planning.spec import PARTITION_METHODS, SCHEDULES, fast_mode_argument


def _plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan one global batch and print the result")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", metavar="FILE", help="sample lengths: a JSON list or one length a line")
    src.add_argument("--num-samples", type=int, default=64, help="size of the built-in synthetic batch (default 64)")
    p.add_argument("--mix", default="multitask", choices=MIXES,
                   help="built-in length mix (default multitask)")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--memory-limit", type=float, default=36_000.0, metavar="MB", help="per-GPU memory limit (default 36000)")
    p.add_argument("--cost-model", metavar="NAME|FILE",
                   help="profiled cost model: a JSON file or a shipped profile's name, e.g. gpt-6.7b-a100 "
                        "(default: analytical GPT-6.7B on A100)")
    p.add_argument("--fast-mode", nargs="?", const=True, type=fast_mode_argument, metavar="{true,false,auto}",
                   help="trim the search for faster planning; bare --fast-mode means true, auto is fast above "
                        "16 samples (default: DYNAPIPE_FAST_MODE, else false)")
    p.add_argument("--schedule", action="append", choices=SCHEDULES, help="restrict to these schedules (repeatable)")
    p.add_argument("--partition", default="dp", choices=PARTITION_METHODS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pack-length", type=int, help="baseline packing length (default: longest sample rounded up to a power of two)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--chrome-trace", metavar="FILE", help="write the predicted timeline as Chrome-trace JSON")
    p.add_argument("--gantt", metavar="FILE.png", help="draw the predicted timeline")
    p.set_defaults(func=_run_plan)


def _run_plan(args) -> int:
    from .planning.planner import generate_execution_plan, resimulate
    from .planning.report import format_summary, summarize
    from .planning.samples import read_lengths, synthetic_lengths
    from .planning.spec import TrainingSpec

    lengths = read_lengths(args.lengths) if args.lengths else synthetic_lengths(args.num_samples, args.seed, args.mix)
    spec = TrainingSpec(num_layers=args.num_layers, pp=args.pp, tp=args.tp, dp=args.dp, zero_stage=args.zero_stage,
                        memory_limit_mb=args.memory_limit, fast_mode=args.fast_mode,
                        schedules=tuple(args.schedule or SCHEDULES), partition=args.partition, seed=args.seed)
    result = generate_execution_plan(lengths, spec, args.cost_model)
    summary = summarize(result, lengths, spec, args.pack_length)
    if args.chrome_trace or args.gantt:
        from .viz import write_chrome_trace, write_gantt

        events = resimulate(result.choices[0], result.costs).events
        if args.chrome_trace:
            write_chrome_trace(events, args.chrome_trace)
            summary["chrome_trace"] = args.chrome_trace
        if args.gantt:
            write_gantt(events, args.gantt, f"{result.choices[0].candidate.schedule}, dp rank 0")
            summary["gantt"] = args.gantt
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark")
    which = p.add_subparsers(dest="benchmark", required=True)
    planner = which.add_parser("planner", help="planning time and quality, normal vs fast mode")
    from .bench import planner as planner_bench

    planner_bench.add_arguments(planner)
    planner.set_defaults(func=planner_bench.run)
    executor = which.add_parser("executor", help="planned-schedule executor vs megatron-core 1F1B (CPU, PP=2)")
    from .bench import executor as executor_bench

    executor_bench.add_arguments(executor)
    executor.set_defaults(func=executor_bench.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-dynapipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _plan_parser(sub)
    from .tracer.cli import add_trace_parser

    add_trace_parser(sub)
    from .megatron.launcher import add_launch_parser

    add_launch_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as error:  # our errors are one line that names the fix
        print(f"megatron-dynapipe: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
