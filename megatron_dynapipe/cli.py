"""`megatron-dynapipe` command line: plan a batch, trace fake ranks, profile a model, simulate traced layouts,
search for a layout, run benchmarks."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import megatron_dynapipe
from megatron_dynapipe.bench import executor_bench, planner_bench, step_bench
from megatron_dynapipe.compat import upstream
from megatron_dynapipe.config.layout import layers_problem
from megatron_dynapipe.files import check_output_file
from megatron_dynapipe.hardware import MEMORY_HEADROOM, default_memory_limit_mb
from megatron_dynapipe.hardware.pricing import add_pricing_arguments, pricing_from_args
from megatron_dynapipe.interrupts import exit_status
from megatron_dynapipe.megatron_lm.launcher import add_launch_parser
from megatron_dynapipe.planning.baselines import default_pack_length
from megatron_dynapipe.planning.fast_mode import resolve_fast_mode
from megatron_dynapipe.planning.flags import add_planner_arguments, planner_settings
from megatron_dynapipe.planning.planner import generate_execution_plan
from megatron_dynapipe.planning.samples import MIXES, check_sample_count, read_lengths, synthetic_lengths
from megatron_dynapipe.planning.schedule_search import resimulate
from megatron_dynapipe.planning.spec import TrainingSpec
from megatron_dynapipe.planning.summary import format_summary, summarize
from megatron_dynapipe.profiling.cli import add_profile_parser
from megatron_dynapipe.progress import heartbeat
from megatron_dynapipe.simulate.cli import add_calibrate_parser, add_search_parser, add_simulate_parser
from megatron_dynapipe.tracer.cli import add_trace_parser
from megatron_dynapipe.viz import GANTT_SUFFIXES, write_chrome_trace, write_gantt


def _plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan one global batch and print the result")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--lengths", metavar="FILE", help="sample lengths: a JSON list or one length a line (- reads "
                                                         "standard input)")
    src.add_argument("--num-samples", type=int, default=64, help="size of the built-in synthetic batch (default 64)")
    p.add_argument("--mix", default="multitask", choices=MIXES,
                   help="built-in length mix (default multitask)")
    p.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=4,
                   help="pipeline stages (default 4)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel size (default 1)")
    p.add_argument("--chunks", "--num-virtual-stages-per-pipeline-rank", dest="chunks", type=int, default=1,
                   metavar="V", help="model chunks a rank: an interleaved pipeline (default 1)")
    p.add_argument("--cp", "--context-parallel-size", dest="cp", type=int, default=1,
                   help="context-parallel ranks each micro-batch's sequences are split over (default 1)")
    p.add_argument("--num-layers", type=int, help="transformer layers (default: --model's, else 32)")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3),
                   help="optimizer-state sharding over DP; 1 is Megatron's --use-distributed-optimizer (default 0)")
    p.add_argument("--use-distributed-optimizer", dest="zero_stage", action="store_const", const=1,
                   help="Megatron's distributed optimizer: --zero-stage 1")
    p.add_argument("--memory-limit", type=float, metavar="MB",
                   help=f"per-GPU memory limit (default: {1 - MEMORY_HEADROOM:g} of --hardware's memory, else "
                        f"{default_memory_limit_mb(None):.0f})")
    add_planner_arguments(p)
    add_pricing_arguments(p)
    p.add_argument("--pack-length", type=int, help="Megatron's --seq-length: the row its packings fill, the yardstick's and "
                   "(with --packing varlen) the planner's candidates (default: longest sample rounded up to a power of two)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--chrome-trace", metavar="FILE", help="write the predicted timeline as Chrome-trace JSON")
    p.add_argument("--gantt", metavar="FILE.png|.svg|.pdf", help="draw the predicted timeline of every DP rank")
    p.set_defaults(func=_run_plan)


def _check_plan_args(args) -> None:
    """Everything the plan command can refuse before it works, one line each naming the fix."""
    import math

    for flag in ("num_samples", "pp", "dp", "tp", "chunks", "cp", "num_layers"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.memory_limit is not None and not (math.isfinite(args.memory_limit) and args.memory_limit > 0):
        raise ValueError(f"--memory-limit must be a positive number of MB, got {args.memory_limit}")
    if args.chunks > 1 and args.pp < 2:
        raise ValueError(f"--chunks {args.chunks} with --pp {args.pp}: model chunks interleave a pipeline of at least "
                         "2 stages; give --pp 2 or more, or --chunks 1")
    check_sample_count(args.num_samples, "--num-samples")
    if args.documents == "cut" and args.pack_length is None:
        raise ValueError("--documents cut cuts the samples at Megatron-LM's --seq-length: give it as --pack-length N")
    if args.pack_length is not None and args.pack_length < 1:
        raise ValueError(f"--pack-length must be at least 1 token, got {args.pack_length}: "
                         "leave it out for the longest sample rounded up to a power of two")
    if args.chrome_trace:
        check_output_file(args.chrome_trace, "--chrome-trace", (".json",))
    if args.gantt:
        check_output_file(args.gantt, "--gantt", GANTT_SUFFIXES)


#: the most planning time a sample took, by fast mode, on one core of the 2-core development
#: machine: 100,000 samples of 100-4000 tokens took 41 s (normal) and 23 s (fast mode); the
#: multitask mix's 128,000 took 25 s and 8.7 s. About linear in the samples.
PLAN_SECONDS_A_SAMPLE = {False: 4.5e-4, True: 2.5e-4}


def _say_when_planning_is_long(samples: int, fast: bool, above_s: float = 30.0) -> None:
    """One line up front where planning may take more than ``above_s`` seconds, naming what is faster."""
    expected = samples * PLAN_SECONDS_A_SAMPLE[fast]
    if expected > above_s:
        faster = "" if fast else f"; --fast-mode takes up to {_about(samples * PLAN_SECONDS_A_SAMPLE[True])}"
        print(f"plan: {samples:,} samples in {'fast' if fast else 'normal'} mode take up to {_about(expected)} on a "
              f"core like the development machine's{faster}; Ctrl-C stops it", file=sys.stderr, flush=True)


def _about(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _run_plan(args) -> int:
    _check_plan_args(args)
    priced = pricing_from_args(args, args.tp)
    num_layers, memory_limit = _plan_size(args, priced)
    lengths = read_lengths(args.lengths) if args.lengths else synthetic_lengths(args.num_samples, args.seed, args.mix)
    if args.documents == "whole" and args.pack_length is not None and args.pack_length < max(lengths):
        raise ValueError(f"--pack-length {args.pack_length} is shorter than the longest sample ({max(lengths)} tokens): "
                         f"give at least {max(lengths)}, or leave it out for {default_pack_length(lengths)}")
    spec = TrainingSpec(num_layers=num_layers, pp=args.pp, tp=args.tp, dp=args.dp, zero_stage=args.zero_stage,
                        memory_limit_mb=memory_limit, chunks=args.chunks, cp=args.cp, seq_length=args.pack_length,
                        **planner_settings(args, cp=args.cp))
    cost_model = priced.stage_costs(spec) if priced else args.cost_model
    _say_when_planning_is_long(len(lengths), resolve_fast_mode(spec.fast_mode, len(lengths)))
    with heartbeat("plan", sys.stderr):
        result = generate_execution_plan(lengths, spec, cost_model)
    summary = summarize(result, lengths, spec, args.pack_length)
    if args.chrome_trace or args.gantt:

        timelines = [resimulate(choice, result.costs).events for choice in result.choices]
        if args.chrome_trace:
            summary["chrome_trace"] = str(write_chrome_trace(timelines, args.chrome_trace))
        if args.gantt:
            summary["gantt"] = str(write_gantt(timelines, args.gantt, _gantt_titles(result)))
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0


def _plan_size(args, priced) -> tuple[int, float]:
    """(layers, memory limit MB) of the plan command: the flags', else ``--model``'s layers and
    ``--hardware``'s default limit (``priced``: :func:`pricing_from_args`), else the defaults."""
    num_layers = args.num_layers or (priced.model.num_layers if priced else TrainingSpec.num_layers)
    split = layers_problem(num_layers, args.pp * args.chunks, pp_name="--pp x --chunks" if args.chunks > 1 else "--pp")
    if split:
        raise ValueError(split)
    return num_layers, args.memory_limit or (priced.memory_limit_mb if priced else default_memory_limit_mb(None))


def _gantt_titles(result) -> list[str]:
    slowest = max(range(len(result.choices)), key=lambda r: result.choices[r].makespan_ms)
    return [f"dp rank {r}: {c.candidate.schedule}, {c.makespan_ms:.1f} ms"
            + (" (slowest: sets the iteration time)" if r == slowest and len(result.choices) > 1 else "")
            for r, c in enumerate(result.choices)]


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark")
    which = p.add_subparsers(dest="benchmark", required=True)
    planner = which.add_parser("planner", help="planning time and quality, normal vs fast mode")

    planner_bench.add_arguments(planner)
    planner.set_defaults(func=planner_bench.run)
    executor = which.add_parser("executor", help="planned-schedule executor vs megatron-core 1F1B (CPU, PP=2)")

    executor_bench.add_arguments(executor)
    executor.set_defaults(func=executor_bench.run)
    step = which.add_parser("step", help="real training steps of one batch: DynaPipe (normal, fast, varlen) vs "
                                         "pad-to-max, packing, THD packing (whole) and dp_balanced; real tokens/s "
                                         "and predicted vs measured time",
                            description=step_bench.__doc__.split("\n\nThe packed ways")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter)

    step_bench.add_arguments(step)
    step.set_defaults(func=step_bench.run)
    for command in (executor, step):
        command.set_defaults(megatron_core=True)


class _OneLineErrors(argparse.ArgumentParser):
    """A mistake on the command line is one line naming where help is, not the usage first
    (17-40 lines for the bigger commands). Subcommands inherit the class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        """A command (a parser without subcommands) names its own unknown flags, so the error
        points at that command's help, not the top level's."""
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


class _Version(argparse._VersionAction):
    """``--version``: this package's, Python's and torch's, and the megatron-core and Megatron-LM
    it would run, each saying whether it is supported (read without importing megatron)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            torch = f"torch {version('torch')}"
        except PackageNotFoundError:
            torch = "torch not installed"
        lines = [f"{parser.prog} {megatron_dynapipe.__version__} (Python {platform.python_version()}, {torch})",
                 *upstream.describe()]
        print("\n".join(lines))
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(prog="megatron-dynapipe", description=__doc__)
    parser.add_argument("--version", action=_Version,
                        help="print the versions of this package, torch, megatron-core and Megatron-LM, and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    _plan_parser(sub)

    add_trace_parser(sub)

    add_launch_parser(sub)

    add_profile_parser(sub)

    add_simulate_parser(sub)
    add_search_parser(sub)
    add_calibrate_parser(sub)
    _bench_parser(sub)
    for command in ("trace", "profile"):  # they build megatron-core models (launch checks its checkout's)
        sub.choices[command].set_defaults(megatron_core=True)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "leaves_signals_alone", False):
        return _run(args)
    return exit_status(lambda: _run(args))


def _run(args) -> int:
    upstream.silence_upstream_notices()
    try:
        if getattr(args, "megatron_core", False):
            upstream.check_supported()  # before any work
        return args.func(args)
    except BrokenPipeError:  # the reader went away (`... --json | head`): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush is quiet too
        return 0
    except (ValueError, OSError, upstream.UnsupportedUpstream) as error:  # one line that names the fix
        print(f"megatron-dynapipe: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
