"""`megatron-dynapipe simulate`, `search` and `calibrate`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal

from megatron_dynapipe.config.model import DEFAULT_MODEL
from megatron_dynapipe.config.model_flags import add_model_arguments, model_from_args
from megatron_dynapipe.data.sizing import add_sizing_data_arguments, has_sizing_data, length_source_from_args
from megatron_dynapipe.files import check_output_folder, write_atomically
from megatron_dynapipe.hardware import MEMORY_HEADROOM, hardware_names, load_hardware
from megatron_dynapipe.interrupts import exit_code, interrupted
from megatron_dynapipe.planning.fast_mode import resolve_fast_mode_setting
from megatron_dynapipe.planning.flags import ListAction, positive_int_argument
from megatron_dynapipe.simulate.calibrate import add_arguments, run
from megatron_dynapipe.simulate.methods import METHODS, parse_methods, price_methods, representatives, traced_layout
from megatron_dynapipe.simulate.replay import simulate_job
from megatron_dynapipe.simulate.report import format_report, report, timeline
from megatron_dynapipe.simulate.search import SearchSpace, run_search
from megatron_dynapipe.simulate.search_report import (
    first_failure,
    format_methods,
    format_search,
    plot_methods,
    plot_search,
)
from megatron_dynapipe.simulate.traced_job import job_folders, load_job

#: what a search writes in its output folder, besides its traces
RESULTS = ("search.json", "search.png", "methods.png")

__all__ = ["add_simulate_parser", "add_search_parser", "add_calibrate_parser"]


def add_hardware_arguments(group, default_note: str) -> None:
    """``--hardware`` and ``--gpus-per-node``, read back by :func:`hardware_from_args`."""
    group.add_argument("--hardware", default="a100", metavar="NAME|FILE",
                       help=f"hardware model: {', '.join(hardware_names())}, or a file (default a100, {default_note})")
    group.add_argument("--gpus-per-node", type=positive_int_argument, metavar="N",
                       help="override the hardware file's GPUs per node")


def hardware_from_args(args: argparse.Namespace):
    """The hardware model ``--hardware`` names, with ``--gpus-per-node`` applied."""
    hardware = load_hardware(args.hardware)
    if args.gpus_per_node is None:
        return hardware
    return dataclasses.replace(hardware, gpus_per_node=args.gpus_per_node)


def add_simulate_parser(sub) -> None:
    p = sub.add_parser("simulate", help="predict a traced layout's iteration time, bubbles, MFU and memory",
                       description="Replay the representative-rank traces of one layout (or of every config "
                                   "folder under TRACE_DIR) as the whole job on a hardware model.")
    p.add_argument("trace_dir", metavar="TRACE_DIR", help="a config folder `trace` wrote, or its output folder")
    add_hardware_arguments(p, "the device shapes-only traces are timed for")
    p.add_argument("--no-timeline", action="store_true",
                   help="do not write simulated_timeline.json (Chrome/Perfetto) into each config folder")
    p.add_argument("--json", action="store_true", help="print one JSON object per config, a line each")
    data = add_data_arguments(p)
    data.add_argument("--cost-model", metavar="NAME|FILE",
                      help="the profile a trace's compute was priced or measured with: the methods are priced by it "
                           "too (not for shapes-only traces priced by a hardware file, whose methods use --hardware)")
    p.set_defaults(func=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    hardware = hardware_from_args(args)
    folders = job_folders(args.trace_dir)
    jobs = [load_job(folder) for folder in folders]  # every folder is checked before any is simulated
    on_data = [_data_for(args, job, hardware) for job in jobs]  # and so is the data, and what prices it
    for job, (source, methods, layout) in zip(jobs, on_data):
        replay = simulate_job(job, hardware, spans=not args.no_timeline)
        result = report(replay)
        out = result.to_json()
        if not args.no_timeline:
            out["timeline"] = str(timeline(replay).write(job.folder / "simulated_timeline.json"))
        text = format_report(result) + (f"\n  timeline: {out['timeline']}" if "timeline" in out else "")
        if source:
            space, traced = layout
            outcome = dataclasses.replace(traced, report=result)
            priced = price_methods(space, [outcome], source, methods,
                                   traced_too=[outcome], batches=args.batches, seed=args.seed,
                                   fast_mode=resolve_fast_mode_setting(args.fast_mode), progress=False)
            out["on_data"] = priced.to_json()
            text += "\n" + format_methods(priced)
        print(json.dumps(out) if args.json else text)
    return 0


def _data_for(args: argparse.Namespace, job, hardware):
    """(the length source, the methods, the traced layout's space and outcome but its report)
    ``job`` is priced on: checked, with what prices them, before anything is simulated."""
    source, methods = data_from_args(args, int(job.iteration["seq_length"]))
    if args.cost_model and not source:
        raise ValueError("--cost-model prices methods on your data: give --lengths FILE, --mix NAME or --data-path too")
    if not source:
        return source, methods, None
    return source, methods, traced_layout(job, hardware, args.cost_model)


def add_calibrate_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's collectives and write a hardware file",
                       description="Start N local processes on one process group (gloo on CPU, NCCL on GPUs), "
                                   "time all-reduce, all-gather, reduce-scatter, all-to-all and p2p over message "
                                   "sizes, fit latency and bandwidth per kind, and write a hardware file that "
                                   "`simulate --hardware FILE` reads.")
    add_arguments(p)
    p.set_defaults(func=run)


def add_data_arguments(p: argparse.ArgumentParser):
    """The data a job trains on and the methods priced on it (search and simulate alike); the
    group, for options of the caller's own."""
    return add_sizing_data_arguments(p, "on your data: methods as a dimension (docs/simulate.md, \"On your data\")",
                                     f"{', '.join(METHODS)} or all (default all, given data)")


def add_search_parser(sub) -> None:
    p = sub.add_parser("search", help="find the fastest parallel layout that fits: estimate, trace, simulate",
                       description="Enumerate the layouts (TP, PP, DP, micro-batch size, recompute, distributed "
                                   "optimizer) of a model on --world-size GPUs, prune those whose estimated memory "
                                   "does not fit, trace the best-estimated shapes-only with fake ranks, simulate "
                                   "every variant on the hardware model and rank them.")
    add_model_arguments(p, attention="transformer_engine")
    job = p.add_argument_group("job")
    job.add_argument("--world-size", type=positive_int_argument, required=True, metavar="W", help="GPUs of the job")
    job.add_argument("--global-batch-size", type=positive_int_argument, required=True, metavar="G",
                     help="sequences per iteration")
    job.add_argument("--seq-length", type=positive_int_argument, metavar="S",
                     help="tokens per sequence (default: the model's)")
    add_hardware_arguments(job, "its peak times the traced compute")
    precision = job.add_mutually_exclusive_group()
    precision.add_argument("--bf16", dest="dtype", action="store_const", const="bfloat16", default="bfloat16",
                           help="train in bfloat16 (the default)")
    precision.add_argument("--fp16", dest="dtype", action="store_const", const="float16", help="train in float16")
    job.add_argument("--cost-model", metavar="NAME|FILE",
                     help="a profiled cost model for compute times (default: analytical at the hardware's peak)")
    job.add_argument("--memory-headroom", type=float, default=MEMORY_HEADROOM, metavar="FRACTION",
                     help="share of each GPU's memory a layout must leave free for what traces do not count: the "
                          f"CUDA context, NCCL's buffers, allocator fragmentation (default {MEMORY_HEADROOM:g})")
    fixed = p.add_argument_group("fixed dimensions (default: all that make sense)")
    fixed.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", action=ListAction,
                       type=positive_int_argument, metavar="N", help="tensor-parallel sizes (default: powers of "
                       "two up to the GPUs of a node)")
    fixed.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", action=ListAction,
                       type=positive_int_argument, metavar="N", help="pipeline sizes (default: divisors of the layers)")
    fixed.add_argument("--cp", "--context-parallel-size", dest="cp", action=ListAction, type=positive_int_argument,
                       metavar="N", help="context-parallel sizes (default 1 2 4 8 from 8192 tokens, else 1)")
    fixed.add_argument("--micro-batch-size", action=ListAction, type=positive_int_argument, metavar="N",
                       help="micro-batch sizes (default 1 2 4 8)")
    fixed.add_argument("--recompute", action=ListAction, metavar="KIND",
                       help="none, selective, full (default all three)")
    opt = fixed.add_mutually_exclusive_group()
    opt.add_argument("--distributed-optimizer", "--use-distributed-optimizer", dest="distributed_optimizer",
                     action="store_const", const=(True,),
                     help="only layouts with the distributed optimizer")
    opt.add_argument("--no-distributed-optimizer", dest="distributed_optimizer", action="store_const", const=(False,),
                     help="only layouts without it")
    sp = fixed.add_mutually_exclusive_group()
    sp.add_argument("--sequence-parallel", dest="sequence_parallel", action="store_const", const=(True,),
                    help="only layouts with sequence parallelism (TP > 1)")
    sp.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_const", const=(False,),
                    help="only layouts without it")
    fixed.add_argument("--num-virtual-stages-per-pipeline-rank", dest="virtual_stages", action=ListAction,
                       type=positive_int_argument, metavar="V",
                       help="model chunks per pipeline rank, 1 for plain 1F1B (default 1 2 4, where they divide)")
    fixed.add_argument("--no-overlap-p2p-communication", dest="overlap_p2p_comm", action="store_false",
                       help="interleaved layouts block on each pipeline transfer, as Megatron-LM with this flag "
                            "(default: post them and wait just before they are needed); needs PP > 2")
    fixed.add_argument("--tp-comm-overlap", action="store_true",
                       help="sequence-parallel layouts hide their TP all-gathers and reduce-scatters under the GEMMs "
                            "beside them, as Megatron-LM's --tp-comm-overlap does with transformer-engine "
                            "(default: off, as Megatron-LM's)")
    fixed.add_argument("--overlap-grad-reduce", action="store_true",
                       help="the data-parallel gradient reduction runs per bucket during the backward pass, as "
                            "Megatron-LM's flag of that name (default: off, as Megatron-LM's); the distributed "
                            "optimizer's parameter all-gather still follows the step")
    data = add_data_arguments(p)
    data.add_argument("--method-layouts", type=positive_int_argument, default=4, metavar="N",
                      help="price the methods at the N fastest traced layouts, the fastest of each TP, PP, "
                           "chunks, CP, DP and optimizer (default 4)")
    run = p.add_argument_group("search")
    run.add_argument("--max-traced", type=positive_int_argument, default=16, metavar="N",
                     help="trace N (TP, PP, micro-batch) shapes: the best-estimated, the rule of thumb's among them "
                          "from N = 2 (default 16; each takes seconds to a minute)")
    run.add_argument("--output-dir", default="search", metavar="DIR",
                     help="traces, search.json and search.png go here; traces found here are reused (default search)")
    run.add_argument("--top", type=positive_int_argument, default=10, metavar="N",
                     help="layouts in the table (default 10)")
    run.add_argument("--jobs", "-j", type=positive_int_argument, metavar="N",
                     help="ranks traced, then shapes simulated, then batches priced, at once (default: one per core)")
    run.add_argument("--json", action="store_true", help="print search.json's content instead of the table")
    run.add_argument("--no-progress", action="store_true",
                     help="no progress bars (on a terminal) or lines (elsewhere, every 30 s)")
    p.set_defaults(func=run_search_cli)


def run_search_cli(args: argparse.Namespace) -> int:
    import sys

    hardware = hardware_from_args(args)
    if not 0 <= args.memory_headroom < 1:
        raise ValueError(f"--memory-headroom {args.memory_headroom:g}: give the share of memory to leave free, "
                         f"from 0 up to below 1 (default {MEMORY_HEADROOM:g})")
    # layouts must fit what is left: the estimate's pruning and the traced peaks alike
    hardware = dataclasses.replace(hardware, memory_gib=hardware.memory_gib * (1 - args.memory_headroom))
    model = model_from_args(args, default=DEFAULT_MODEL)
    source, methods = data_from_args(args, args.seq_length or model.max_sequence_length)
    space = SearchSpace(model=model, world_size=args.world_size, global_batch_size=args.global_batch_size,
                        seq_length=args.seq_length or model.max_sequence_length, hardware=hardware, dtype=args.dtype,
                        tp=args.tp, pp=args.pp, cp=args.cp, micro_batch_sizes=args.micro_batch_size,
                        recompute=args.recompute, distributed_optimizer=args.distributed_optimizer,
                        sequence_parallel=args.sequence_parallel, virtual_stages=args.virtual_stages,
                        cost_model=args.cost_model, overlap_p2p_comm=args.overlap_p2p_comm,
                        tp_comm_overlap=args.tp_comm_overlap, overlap_grad_reduce=args.overlap_grad_reduce)
    out = check_output_folder(args.output_dir, "--output-dir")
    for previous in RESULTS:  # a run that fails or is stopped must not leave the last run's answer looking current
        (out / previous).unlink(missing_ok=True)
    try:
        result = run_search(space, out, max_traced=args.max_traced, jobs=args.jobs,
                            progress=not args.no_progress, say=lambda line: print(line, file=sys.stderr))
        on_data = source and price_methods(space, representatives(result, args.method_layouts), source, methods,
                                           traced_too=result.ranked()[:1], batches=args.batches, seed=args.seed,
                                           jobs=args.jobs,
                                           fast_mode=resolve_fast_mode_setting(args.fast_mode),
                                           progress=not args.no_progress)
    except KeyboardInterrupt:
        result = None
    if result is None or interrupted() is not None:  # no ranking of what was traced so far: it would read as the answer
        print(f"megatron-dynapipe search: interrupted, no ranking written; the shapes traced in full are kept in "
              f"{out / 'traces'} and the same command again reuses them", file=sys.stderr)
        return exit_code(interrupted() or signal.SIGINT)
    document = result.to_json()
    document.update(memory_headroom=args.memory_headroom, usable_memory_gib=hardware.memory_gib)
    document["plot"] = str(plot_search(result, out / "search.png"))
    text = format_search(result, args.top)
    if on_data:
        document["on_data"] = on_data.to_json()
        document["on_data"]["plot"] = str(plot_methods(on_data, out / "methods.png"))
        text += "\n\n" + format_methods(on_data) + f"\n  real tokens/s by method: {document['on_data']['plot']}"
    document["json"] = str(out / "search.json")
    write_atomically(out / "search.json", json.dumps(document, indent=1) + "\n")
    print(json.dumps(document) if args.json else text
          + f"\n\nall candidates: {document['json']}\ntime against memory: {document['plot']}")
    if not result.ranked() and result.counts()["failed"]:  # nothing fits is an answer; nothing read is not
        print(f"megatron-dynapipe search: no layout could be simulated ({first_failure(result)}); where a kept "
              f"trace is broken, delete it from {out / 'traces'} and run again to trace it anew", file=sys.stderr)
        return 1
    return 0


def data_from_args(args: argparse.Namespace, seq_length: int):
    """(the length source, the methods) of ``--lengths``/``--mix``/``--data-path`` and ``--method``;
    (None, ()) without data. Checked before any work."""
    if not has_sizing_data(args):
        if args.method:
            raise ValueError("--method prices methods on your data: give --lengths FILE, --mix NAME or --data-path too")
        return None, ()
    return length_source_from_args(args, seq_length), parse_methods(args.method or ["all"])
