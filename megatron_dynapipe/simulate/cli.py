"""`megatron-dynapipe simulate` and `megatron-dynapipe calibrate`."""

from __future__ import annotations

import argparse
import dataclasses
import json

from .hardware import hardware_names

__all__ = ["add_simulate_parser", "add_calibrate_parser"]


def add_simulate_parser(sub) -> None:
    p = sub.add_parser("simulate", help="predict a traced layout's iteration time, bubbles, MFU and memory",
                       description="Replay the representative-rank traces of one layout (or of every config "
                                   "folder under TRACE_DIR) as the whole job on a hardware model.")
    p.add_argument("trace_dir", metavar="TRACE_DIR", help="a config folder `trace` wrote, or its output folder")
    p.add_argument("--hardware", default="a100", metavar="NAME|FILE",
                   help=f"hardware model: {', '.join(hardware_names())}, or a file (default a100, the device "
                        "shapes-only traces are timed for)")
    p.add_argument("--gpus-per-node", type=int, metavar="N", help="override the hardware file's GPUs per node")
    p.add_argument("--no-timeline", action="store_true",
                   help="do not write simulated_timeline.json (Chrome/Perfetto) into each config folder")
    p.add_argument("--json", action="store_true", help="print one JSON object per config, a line each")
    p.set_defaults(func=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    from .hardware import load_hardware
    from .replay import job_folders, load_job, simulate_job
    from .report import format_report, report, timeline

    hardware = load_hardware(args.hardware)
    if args.gpus_per_node is not None:
        if args.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be at least 1, got {args.gpus_per_node}")
        hardware = dataclasses.replace(hardware, gpus_per_node=args.gpus_per_node)
    folders = job_folders(args.trace_dir)
    jobs = [load_job(folder) for folder in folders]  # every folder is checked before any is simulated
    for job in jobs:
        replay = simulate_job(job, hardware)
        result = report(replay)
        out = result.to_json()
        if not args.no_timeline:
            out["timeline"] = str(timeline(replay).write(job.folder / "simulated_timeline.json"))
        print(json.dumps(out) if args.json else format_report(result)
              + (f"\n  timeline: {out['timeline']}" if "timeline" in out else ""))
    return 0


def add_calibrate_parser(sub) -> None:
    from .calibrate import add_arguments, run

    p = sub.add_parser("calibrate", help="measure this machine's collectives and write a hardware file",
                       description="Start N local processes on one process group (gloo on CPU, NCCL on GPUs), "
                                   "time all-reduce, all-gather, reduce-scatter, all-to-all and p2p over message "
                                   "sizes, fit latency and bandwidth per kind, and write a hardware file that "
                                   "`simulate --hardware FILE` reads.")
    add_arguments(p)
    p.set_defaults(func=run)
