"""`megatron-dynapipe trace`: trace many parallel layouts of one model with fake ranks.

    megatron-dynapipe trace --config "8192 16 8" --config "4096 16 4" --model 6.7
    megatron-dynapipe trace --configs configs.txt --output-dir traces --json
    megatron-dynapipe trace --config "8192 2 2" --print-ranks

``python -m megatron_dynapipe.tracer.cli ARGS`` is the same command without the ``trace`` word.
Exit status: 0 when every valid config traced, 1 when a config failed, could not be parsed or
none was valid (or, with ``--strict``, one was invalid), 2 for a usage error such as an
unreadable configs file or an unwritable output folder (refused before any rank starts), 130
when Ctrl-C stopped it (the folder being traced says ``"status": "interrupted"``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_dynapipe.config.accounting import total_params
from megatron_dynapipe.config.megatron_options import (
    MegatronOptions,
    add_megatron_options,
    megatron_options_from_args,
)
from megatron_dynapipe.config.model import DEFAULT_MODEL, MODELS, ModelSpec
from megatron_dynapipe.config.model_flags import (
    add_model_arguments,
    megatron_model_args,
    model_from_args,
)
from megatron_dynapipe.data.sizing import add_sizing_data_arguments, has_sizing_data, length_source_from_args
from megatron_dynapipe.files import check_output_folder
from megatron_dynapipe.hardware import hardware_names, load_hardware
from megatron_dynapipe.interrupts import exit_status
from megatron_dynapipe.planning.cost_model import load_cost_model
from megatron_dynapipe.planning.fast_mode import resolve_fast_mode_setting
from megatron_dynapipe.planning.flags import positive_int_argument
from megatron_dynapipe.tracer.batch_config import (
    TraceConfig,
    parse_configs,
    read_config_file,
    validate,
)
from megatron_dynapipe.tracer.batch_results import (
    FAILED,
    INTERRUPTED,
    INVALID,
    OK,
    ConfigResult,
    batch_summary,
    exit_code,
)
from megatron_dynapipe.tracer.batch_run import collect_batch, run_batch
from megatron_dynapipe.tracer.chakra import check_chakra, write_chakra_folder
from megatron_dynapipe.tracer.planned import PLANNED_METHODS, PlanRequest
from megatron_dynapipe.tracer.shapes_only_costs import DEFAULT_HARDWARE

__all__ = ["add_trace_parser", "add_trace_arguments", "run_trace", "main", "DEFAULT_CONFIG"]

#: what ``trace --method`` runs: Megatron's own schedule, and the planned methods (:mod:`.planned`)
TRACED_METHODS = ("megatron", *PLANNED_METHODS)

#: The config traced when none is given.
DEFAULT_CONFIG = "8192 2 2"
#: The model traced when none is given: the same as examples/update_pretrain_gpt.sh.

_HELP = "trace the representative ranks of one or more parallel layouts with fake ranks"
_EPILOG = (
    "A config is 'WORLD_SIZE PP TP [CP [EP]] [key=value ...]' (keys: cp ep etp mbs nmb gbs seq experts "
    "model); a configs file holds one a line, '#' starts a comment. Models: "
    + ", ".join(f"{n} ({m.hidden_size}/{m.num_attention_heads}/{m.num_layers})" for n, m in MODELS.items())
    + " (hidden/heads/layers); without --model or model flags, " + DEFAULT_MODEL + "B. Without --config/--configs "
    "the config is '" + DEFAULT_CONFIG + "'."
)


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the ``trace`` command, on any parser."""
    src = p.add_argument_group("configs")
    src.add_argument("--config", action="append", default=[], metavar="LINE",
                     help="a config 'WORLD_SIZE PP TP [CP [EP]] [key=value ...]' (repeatable)")
    src.add_argument("--configs", "--config-file", dest="config_files", action="append", default=[],
                     metavar="FILE", help="a file of config lines (repeatable)")
    src.add_argument("--strict", action="store_true", help="exit 1 if any config is invalid")

    add_model_arguments(p, moe=True, attention="transformer_engine")
    model = p.add_argument_group("experts, precision and batch (defaults for every config)")
    model.add_argument("--num-experts", type=int, metavar="N", help="make the model mixture-of-experts with N experts")
    model.add_argument("--expert-tensor-parallel-size", dest="expert_tp", type=int, metavar="N",
                       help="tensor parallelism of the experts (default TP; a config line's etp=)")
    precision = model.add_mutually_exclusive_group()
    precision.add_argument("--bf16", dest="dtype", action="store_const", const="bfloat16",
                           help="train in bfloat16 (default: bfloat16 shapes-only, float32 with real compute on CPU)")
    precision.add_argument("--fp16", dest="dtype", action="store_const", const="float16", help="train in float16")
    precision.add_argument("--fp32", dest="dtype", action="store_const", const="float32",
                           help="train in float32 (pretrain_gpt.py's default without --bf16/--fp16)")
    model.add_argument("--micro-batch-size", type=int, default=1, metavar="M", help="default 1")
    model.add_argument("--num-microbatches", type=int, metavar="N",
                       help="micro-batches per iteration (default: from --global-batch-size, else PP)")
    model.add_argument("--global-batch-size", type=int, metavar="G",
                       help="global batch; must be divisible by micro-batch size x DP")
    model.add_argument("--seq-length", type=positive_int_argument, metavar="S",
                       help="sequence length (default: the model's)")
    add_megatron_options(p)

    run = p.add_argument_group("tracing")
    run.add_argument("--output-dir", default="traces", metavar="DIR", help="one folder per config under DIR (default traces)")
    run.add_argument("--warmup-iters", type=int, default=1, metavar="N", help="default 1")
    run.add_argument("--trace-iters", type=int, default=1, metavar="N", help="default 1")
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--shapes-only", dest="shapes_only", action="store_const", const=True, default=None,
                      help="record op shapes without computing (default for models that do not fit in memory)")
    mode.add_argument("--real-compute", dest="shapes_only", action="store_const", const=False,
                      help="really compute every op, even when the estimate says it does not fit")
    run.add_argument("--cost-model", metavar="NAME|FILE",
                     help="profiled cost model (a JSON file or a shipped profile's name) for shapes-only op "
                          "durations (default: the --hardware's own model)")
    run.add_argument("--hardware", default=DEFAULT_HARDWARE, metavar="NAME|FILE",
                     help=f"the device shapes-only compute is priced for, by its hardware file's roofline: "
                          f"{', '.join(hardware_names())}, or a file (default {DEFAULT_HARDWARE}; `simulate` on "
                          "another hardware prices it anew)")
    run.add_argument("--isolation", choices=("process", "inline"), default="process",
                     help="run each rank in a forked process (default) or in this one")
    run.add_argument("--jobs", "-j", type=int, metavar="N",
                     help="ranks traced at once, each in its own process (default: one per core)")
    run.add_argument("--rank-timeout", type=float, metavar="SECONDS", help="fail a rank that runs longer")

    add_sizing_data_arguments(p, "on your data: trace a planned method (docs/tracing.md, \"A planned method on your "
                                 "data\")", f"{', '.join(TRACED_METHODS)} or all (default megatron; all, given data): "
                                 "a planned method traces DynaPipe's executor, a traced iteration per drawn batch")

    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    out.add_argument("--no-progress", action="store_true", help="no progress bar (none is drawn when stderr is not a terminal)")
    out.add_argument("--no-timeline", action="store_true",
                     help="do not write timeline.json (Chrome/Perfetto; hundreds of MB for a layout of many stages "
                          "and micro-batches): each rank's file is then only checked to open with a trace header")
    out.add_argument("--print-ranks", action="store_true",
                     help="list each valid config's representative ranks, one a line, and trace nothing")
    out.add_argument("--format", choices=("jsonl", "chakra"), default="jsonl",
                     help="jsonl: this project's trace files only (default); chakra: also each rank as an MLCommons "
                          "Chakra execution trace, <folder>/chakra/et.<rank>.et, as ASTRA-sim reads them "
                          "(needs mlc-chakra)")
    out.add_argument("--collect", action="store_true",
                     help="trace nothing: read the rank traces already in each config's folder (written by "
                          "`megatron-dynapipe launch pretrain_gpt.py ... --is-scaling-mode`, one run per rank) and "
                          "write its summary.json and timeline.json, as a trace run does")
    out.add_argument("--print-model-args", action="store_true",
                     help="print the Megatron-LM flags that build --model and exit")
    out.add_argument("--list-models", action="store_true", help="list the model sizes and exit")
    p.set_defaults(func=run_trace)


def add_trace_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``trace`` on the ``add_subparsers()`` object of the main parser."""
    p = subparsers.add_parser("trace", help=_HELP, description=_HELP, epilog=_EPILOG)
    add_trace_arguments(p)
    return p


# --------------------------------------------------------------------------------------------


def load_configs(args, model: ModelSpec) -> tuple[list[TraceConfig], list[str]]:
    """The configs named on the command line, in order (``--config`` lines, then files), each of
    ``model`` unless its line names another, and why each line that could not be parsed was
    skipped (one bad line never stops the others)."""
    defaults: dict[str, Any] = dict(
        model=model, num_experts=args.num_experts, expert_tp=args.expert_tp,
        micro_batch_size=args.micro_batch_size, num_microbatches=args.num_microbatches,
        global_batch_size=args.global_batch_size, seq_length=args.seq_length,
    )
    configs: list[TraceConfig] = []
    unparsable: list[str] = []
    lines = args.config or ([] if args.config_files else [DEFAULT_CONFIG])
    for n, line in enumerate(lines):
        source = f"--config #{n + 1}" if len(lines) > 1 else "--config"
        configs += parse_configs([line], source=source, start_index=len(configs), unparsable=unparsable,
                                 numbered=False, **defaults)
    for path in args.config_files:
        configs += read_config_file(path, start_index=len(configs), unparsable=unparsable, **defaults)
    if not configs:
        if unparsable:
            raise ValueError(f"no config could be parsed: {unparsable[0]}")
        where = "the configs files hold" if args.config_files else "--config holds"
        raise ValueError(f"no configs: {where} only blanks or comments; add lines like '{DEFAULT_CONFIG}'")
    return configs, unparsable


def _check_before_tracing(args, configs: Sequence[TraceConfig]) -> None:
    """What would fail every rank, refused before any rank starts (one line naming the fix)."""
    check_output_folder(args.output_dir, "--output-dir")
    load_hardware(args.hardware)  # an unknown name or a bad file, before any rank
    if args.cost_model:

        for tp in sorted({c.tp for c in configs if not validate(c)}):
            load_cost_model(args.cost_model, tp=tp)  # missing file, bad format or no profile of this TP


def _cost_model(args):
    """--cost-model, or a factory of the --hardware's model per config (its GPT and TP)."""
    if args.cost_model:
        return args.cost_model
    hardware = load_hardware(args.hardware)
    return lambda config: hardware.cost_model(config.model, config.tp, args.dtype or "bfloat16")


def _plan_requests(args, model: ModelSpec) -> list[Optional[PlanRequest]]:
    """What each traced method asks of every config (None: Megatron's own schedule), checked
    before any rank starts."""
    if not (args.method or has_sizing_data(args)):
        return [None]
    names = list(TRACED_METHODS) if "all" in (args.method or ["all"]) else list(dict.fromkeys(args.method))
    unknown = [name for name in names if name not in TRACED_METHODS]
    if unknown:
        raise ValueError(f"trace --method {unknown[0]}: trace runs {', '.join(TRACED_METHODS)} or all")
    if args.collect and names != ["megatron"]:
        raise ValueError("--collect reads Megatron-LM's own traces: drop --method")
    planned = [name for name in names if name != "megatron"]
    if planned and not has_sizing_data(args):
        raise ValueError(f"--method {','.join(planned)} plans batches of your data: give --lengths FILE, --mix NAME or "
                         "--data-path too")
    source = length_source_from_args(args, args.seq_length or model.max_sequence_length) if planned else None
    hardware = load_hardware(args.hardware)
    fast_mode = resolve_fast_mode_setting(args.fast_mode)
    return [None if name == "megatron" else PlanRequest(name, source, hardware, args.batches, args.seed, fast_mode)
            for name in names]


def run_trace(args) -> int:
    if args.list_models:
        for name, m in MODELS.items():
            print(f"{name:>5}  hidden {m.hidden_size:>5}  heads {m.num_attention_heads:>3}  layers {m.num_layers:>3}  "
                  f"{total_params(m) / 1e9:9.3f} B parameters")
        return 0
    model = model_from_args(args, default=DEFAULT_MODEL)
    if args.print_model_args:
        shape = model.with_experts(args.num_experts) if args.num_experts else model
        print(" ".join(_megatron_args(shape, args.seq_length, megatron_options_from_args(args), args.dtype)))
        return 0
    for name in ("warmup_iters", "trace_iters"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if args.trace_iters < 1:
        raise ValueError("--trace-iters must be >= 1")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    if args.jobs not in (None, 1) and args.isolation == "inline":
        raise ValueError("--jobs runs ranks in parallel processes: drop --isolation inline, or use --jobs 1")
    training = megatron_options_from_args(args)
    configs, unparsable = load_configs(args, model)
    for reason in unparsable:
        print(f"skipping a config that cannot be parsed: {reason}", file=sys.stderr)
    if args.print_ranks:
        return max(_print_ranks(configs, training, args), 1 if unparsable else 0)
    _check_before_tracing(args, configs)
    if args.format == "chakra":
        check_chakra()  # before any rank is traced

    plans = _plan_requests(args, model)
    if args.shapes_only is None and any(plans):  # every method priced alike: by the cost model
        args.shapes_only = True
    try:
        results = collect_batch(configs, args.output_dir, training=training) if args.collect else [
            result for plan in plans for result in run_batch(
                configs, args.output_dir,
                warmup_iters=args.warmup_iters, trace_iters=args.trace_iters, shapes_only=args.shapes_only,
                cost_model=_cost_model(args), dtype=args.dtype, training=training,
                isolation=args.isolation, jobs=args.jobs, rank_timeout=args.rank_timeout,
                progress=not args.no_progress, timeline=not args.no_timeline, plan=plan)]
    except KeyboardInterrupt:  # between ranks, where no folder is open
        print("megatron-dynapipe trace: interrupted", file=sys.stderr)
        return 130
    code = exit_code(results, strict=args.strict)
    if unparsable and code == 0:
        code = 1
    exported = {str(r.folder): write_chakra_folder(r.folder) for r in results
                if args.format == "chakra" and r.status == OK}
    if args.json:
        summary = batch_summary(results, model=model.label, output_dir=args.output_dir)
        summary["training"] = training.to_json()
        summary["unparsable"] = unparsable
        summary["exit_code"] = code
        summary["chakra"] = exported
        print(json.dumps(summary))
    else:
        print_summary(results)
        for folder, files in exported.items():
            print(f"chakra: {len(files)} execution traces, {sum(f['nodes'] for f in files)} nodes, in "
                  f"{Path(files[0]['path']).parent}")
    if any(r.status == INTERRUPTED for r in results):
        stopped = next(r for r in results if r.status == INTERRUPTED)
        print(f"megatron-dynapipe trace: interrupted; {stopped.folder} holds the ranks traced so far "
              f"(summary.json says \"status\": \"interrupted\")", file=sys.stderr)
    return code


# --------------------------------------------------------------------------------------------
# printing

_RANK_COLUMNS = ("config", "world_size", "pp", "tp", "cp", "ep", "dp", "micro_batch_size",
                 "num_microbatches", "global_batch_size", "seq_length", "rank", "stage", "ep_rank", "model",
                 "experts", "expert_tp", "folder", "megatron_args")
_PRECISION_FLAGS = {"bfloat16": "--bf16", "float16": "--fp16"}


def _megatron_args(model, seq_length: Optional[int], training: MegatronOptions, dtype: Optional[str]) -> list[str]:
    """The ``pretrain_gpt.py`` flags that describe the model and how it trains."""
    precision = [_PRECISION_FLAGS[dtype]] if dtype in _PRECISION_FLAGS else []
    return megatron_model_args(model, seq_length) + training.megatron_args() + precision


def _print_ranks(configs: Sequence[TraceConfig], training: MegatronOptions, args) -> int:
    """One line per representative rank (columns: :data:`_RANK_COLUMNS`, the last one the rest of
    the line: the ``pretrain_gpt.py`` flags of the config's model and training), ``#`` header first."""
    results, rows = [], []
    for config in configs:
        reasons = validate(config, training)
        if reasons:
            print(f"config {config.index} ({config.line}) is invalid: {'; '.join(reasons)}", file=sys.stderr)
            results.append(ConfigResult(config, INVALID, reasons=reasons))
            continue
        reps = config.representatives()
        results.append(ConfigResult(config, OK, ranks_traced=len(reps)))
        for rep in reps:
            rows.append({
                "config": config.index, "world_size": config.world_size, "pp": config.pp, "tp": config.tp,
                "cp": config.cp, "ep": config.ep, "dp": config.dp,
                "micro_batch_size": config.micro_batch_size, "num_microbatches": config.microbatches,
                "global_batch_size": config.global_batch, "seq_length": config.seq,
                "rank": rep.global_rank, "stage": rep.stage, "ep_rank": rep.ep_rank,
                "model": config.model.label, "experts": config.model.num_experts,
                "expert_tp": config.expert_tp_size, "folder": config.folder_name(training),
                "megatron_args": _megatron_args(config.model, config.seq, training, args.dtype),
            })
    if args.json:
        print(json.dumps({"ranks": rows, "invalid": [r.to_dict() for r in results if r.status == INVALID]}))
    else:
        print("# " + " ".join(_RANK_COLUMNS))
        for row in rows:
            print(" ".join(" ".join(row[c]) if c == "megatron_args" else str(row[c]) for c in _RANK_COLUMNS))
    return exit_code(results, strict=args.strict)


def _fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}%"


def summary_rows(results: Sequence[ConfigResult]) -> list[list[str]]:
    """One row per config: the cells of :data:`_HEADERS` (the folder by its name only)."""
    rows = []
    for r in results:
        c = r.config
        if r.status == INVALID:
            where = "skipped: " + "; ".join(r.reasons)
        else:
            where = r.folder.name if r.folder else "-"
            if r.error:
                where += f"  ({r.error})"
        rows.append([
            str(c.index), c.line, c.model.label, str(c.world_size), str(r.ranks_traced or "-"),
            _fmt_pct(r.reduction_pct), r.status, f"{r.seconds:.1f}s" if r.status != INVALID else "-", where,
        ])
    return rows


_HEADERS = ["#", "config", "model", "ranks", "traced", "reduction", "status", "time", "folder"]
_RIGHT = {"#", "ranks", "traced", "reduction", "time"}


def _footer(results: Sequence[ConfigResult]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in (OK, FAILED, INVALID, INTERRUPTED)}
    text = f"{counts[OK]} traced, {counts[FAILED]} failed, {counts[INVALID]} invalid"
    if counts[INTERRUPTED]:
        text += ", 1 interrupted"
    parents = {str(r.folder.parent) for r in results if r.folder is not None}
    if len(parents) == 1:
        text += f"; folders in {parents.pop()}"
    return text


def print_summary(results: Sequence[ConfigResult], file=None) -> None:
    """The batch as a table: rich when ``file`` (stdout) is a terminal, plain text otherwise.

    "config" is ``W PP TP[ CP EP]``, "ranks" is the size of the job, "traced" how many ranks stand for it, "reduction" how many
    fewer that is (``1 - traced / ranks``).
    """
    file = sys.stdout if file is None else file
    rows = summary_rows(results)
    footer = _footer(results)
    isatty = getattr(file, "isatty", None)
    if callable(isatty) and isatty():
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        table = Table(title="fake-rank traces", caption=footer, caption_justify="left")
        for h in _HEADERS:
            table.add_column(h, overflow="fold", justify="right" if h in _RIGHT else "left",
                             no_wrap=h in _RIGHT or h in ("status", "config", "model"))
        colour = {OK: "green", FAILED: "bold red", INVALID: "yellow", INTERRUPTED: "bold yellow"}
        for row in rows:
            cells = [escape(v) for v in row]
            cells[6] = f"[{colour.get(row[6], 'default')}]{cells[6]}[/]"
            table.add_row(*cells)
        Console(file=file).print(table)
        return
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(_HEADERS[:-1])]
    just = [str.rjust if h in _RIGHT else str.ljust for h in _HEADERS]
    print("  ".join(j(h, w) for j, h, w in zip(just, _HEADERS, widths)) + "  " + _HEADERS[-1], file=file)
    for row in rows:
        print("  ".join(j(v, w) for j, v, w in zip(just, row, widths)) + "  " + row[-1], file=file)
    print(footer, file=file)


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_dynapipe.tracer.cli", description=_HELP,
                                     epilog=_EPILOG)
    add_trace_arguments(parser)
    return parser


def main(argv=None) -> int:
    """``megatron-dynapipe trace`` as a module of its own (the examples call it this way)."""
    args = build_parser().parse_args(argv)
    return exit_status(lambda: _run(args))


def _run(args) -> int:
    try:
        return args.func(args)
    except (ValueError, OSError) as error:
        print(f"megatron-dynapipe trace: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
