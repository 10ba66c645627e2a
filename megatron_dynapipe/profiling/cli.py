"""``megatron-dynapipe profile``: a cost model of the user's model, measured on this device."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from megatron_dynapipe.config.model_flags import add_model_arguments, model_from_args
from megatron_dynapipe.files import check_output_file
from megatron_dynapipe.gpt.device import add_device_arguments, resolve_device
from megatron_dynapipe.planning.flags import ListAction, positive_int_argument, recompute_argument
from megatron_dynapipe.planning.types import RecomputeType
from megatron_dynapipe.progress import progress_bar

__all__ = ["add_profile_parser", "run_profile"]


def add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure a GPT's layers on this device into a cost-model file",
                       description=__doc__)
    add_model_arguments(p)
    p.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", action=ListAction, type=positive_int_argument,
                   default=[1], metavar="N",
                   help="tensor-parallel sizes to profile, e.g. 1 2 4 8 or 1,2,4,8 (default 1)")
    p.add_argument("--cp", "--context-parallel-size", dest="cp", action=ListAction, type=positive_int_argument,
                   default=[], metavar="N",
                   help="also time the layer on a real context-parallel group of N local ranks (gloo on the CPU, "
                        "NCCL on N GPUs), at TP 1, e.g. 2 or 2,4: what the ring costs beyond a profile at CP 1 "
                        "(default: none; CP is then priced from the CP 1 times)")
    p.add_argument("--recompute", action=ListAction, type=recompute_argument, default=list(RecomputeType),
                   metavar="{none,selective,full}", help="recompute types to profile (default: all three)")
    add_device_arguments(p, "measure")
    p.add_argument("--min-seq-length", type=positive_int_argument, default=32, metavar="N",
                   help="shortest sequence length profiled (default 32)")
    p.add_argument("--max-seq-length", type=positive_int_argument, metavar="N",
                   help="longest sequence length profiled (default: the model's --max-position-embeddings)")
    p.add_argument("--max-tokens", type=positive_int_argument, metavar="N",
                   help="largest micro-batch in tokens, mbs x seqlen (default 16 x --max-seq-length; a row also "
                        "stops where memory runs out)")
    p.add_argument("--repeats", type=positive_int_argument, default=3, metavar="N",
                   help="timed runs per point, of which the median is kept (default 3)")
    p.add_argument("--min-time-ms", type=float, default=100.0, metavar="MS",
                   help="more timed runs (up to 50) until a point's add up to this (default 100): short points "
                        "are timed many times, against the machine's jitter")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed runs per point first (default 1)")
    p.add_argument("--output", "-o", required=True, metavar="FILE.json", help="the cost-model file to write")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--force", action="store_true", help="overwrite an existing --output")
    again.add_argument("--resume", action="store_true", help="go on with an interrupted --output")
    p.add_argument("--allow-noisy", action="store_true",
                   help="keep points out of line with shapes beside them (a busy machine) as they are and "
                        "write the profile as complete; default: measure them again, and where they stay so, leave "
                        "the profile for --resume and say which")
    p.add_argument("--calibrate", action="store_true",
                   help="time a handful of points and fit the analytical model to them instead of profiling the "
                        "grid: a quick cost model (seconds to minutes) where a full profile is too slow")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (on a terminal) or lines (elsewhere, every 30 s)")
    p.set_defaults(func=run_profile)


def _checked(args):
    """Everything refusable before any work, one line each that names the fix."""
    from megatron_dynapipe.profiling.profiler import ProfileSettings

    spec = model_from_args(args)
    output = check_output_file(args.output, "--output", (".json",))
    if output.exists() and not (args.force or args.resume):
        raise ValueError(f"--output {output} exists: pass --resume to go on with it or --force to overwrite it")
    device = resolve_device(args.device)
    for tp in args.tp:
        for what, n in (("attention heads", spec.num_attention_heads), ("query groups", spec.query_groups),
                        ("FFN width", spec.ffn_hidden_size)):
            if n % tp:
                raise ValueError(f"--tp {tp} does not divide the model's {n} {what}: profile TP sizes that divide it")
    _check_cp(args.cp, args.tp, spec, indexed_device(device))
    max_seq = args.max_seq_length or spec.max_sequence_length
    if spec.position_embedding_type == "learned_absolute" and max_seq > spec.max_sequence_length:
        raise ValueError(f"--max-seq-length {max_seq} exceeds the model's {spec.max_sequence_length} learned positions: "
                         f"lower it or raise --max-position-embeddings")
    if args.min_seq_length > max_seq:
        raise ValueError(f"--min-seq-length {args.min_seq_length} is above --max-seq-length {max_seq}")
    settings = ProfileSettings(
        tp_sizes=tuple(dict.fromkeys(args.tp)), cp_sizes=tuple(dict.fromkeys(args.cp)),
        recompute=tuple(dict.fromkeys(args.recompute)), dtype=args.dtype,
        min_seq_length=args.min_seq_length, max_seq_length=max_seq, max_tokens=args.max_tokens or 16 * max_seq,
        warmup=max(0, args.warmup), repeats=args.repeats, min_time_ms=max(0.0, args.min_time_ms))
    return spec, output, settings, indexed_device(device)


def indexed_device(device: str):
    """``device`` as torch names it, with an index: torch.cuda.set_device refuses "cuda" without one."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)


def _check_cp(cps, tps, spec, device) -> None:
    """``--cp`` sizes that can be timed here, or one line that names the fix."""
    from megatron_dynapipe.gpt.build import uses_transformer_engine
    from megatron_dynapipe.profiling.link import link_backend

    for cp in cps:
        if cp < 2:
            raise ValueError(f"--cp {cp}: a context-parallel group has 2 ranks or more (CP 1 is the profile itself)")
        if 1 not in tps:
            raise ValueError(f"--cp {cp} times the layer at TP 1, which --tp {' '.join(map(str, tps))} leaves out: "
                             "add 1 to --tp")
        if link_backend(device, cp) is None:
            raise ValueError(f"--cp {cp} needs {cp} GPUs here, one a rank ({_gpus()} visible): drop --cp, or "
                             "profile where they are")
        if spec.attention_dropout and not uses_transformer_engine(device.type):
            raise ValueError(f"--cp {cp}: context parallelism without transformer-engine draws no attention "
                             "dropout: set --attention-dropout 0")


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def run_profile(args: argparse.Namespace) -> int:
    import torch

    from megatron_dynapipe.profiling.analytical_fit import calibrate_model, calibration_shapes
    from megatron_dynapipe.profiling.profiler import profile_model

    spec, output, settings, device = _checked(args)
    if args.calibrate and args.resume:
        raise ValueError("--calibrate writes its file in one go: drop --resume (or --calibrate to resume a profile)")
    if args.calibrate and args.cp:
        raise ValueError("--calibrate fits the analytical model, which prices context parallelism from the GPT's "
                         "shape: drop --cp (or --calibrate to time the layer on a CP group)")
    expected = ((len(calibration_shapes(settings)) + 1) * len(settings.tp_sizes) if args.calibrate
                else settings.grid_points())
    print(f"{'calibrating' if args.calibrate else 'profiling'} {spec.label} ({spec.num_layers} layers, hidden "
          f"{spec.hidden_size}) on {device.type}, {settings.dtype}, tp {', '.join(map(str, settings.tp_sizes))}"
          f"{''.join(f', cp {cp}' for cp in settings.cp_sizes)}: "
          f"about {expected} points{'' if args.calibrate else _duration(spec, settings, device)}", file=sys.stderr)
    stream = sys.stderr
    if args.resume and not output.exists():  # a retried job may pass --resume every time: go on, but say so
        print(f"note: --resume: {output} does not exist yet, so this profile starts from the beginning", file=stream)
    if not args.calibrate and (note := short_rows_note(settings)) is not None:  # the analytical fit extrapolates
        print(note, file=stream)
    _warn_if_busy(device, "before profiling")
    with progress_bar(args.progress, stream) as bar:
        task = bar.add_task("profile", total=expected)

        progress = GridProgress(bar, task, expected)

        try:
            if args.calibrate:
                doc = calibrate_model(spec, output, settings, device=device, progress=progress)
                return _report_calibration(doc, output)
            doc = profile_model(spec, output, settings, device=device, resume=args.resume, progress=progress,
                                allow_noisy=args.allow_noisy)
            progress.finish()
        except KeyboardInterrupt:
            print(f"interrupted: {output} holds what was measured; run again with --resume to go on",
                  file=sys.stderr)
            return 130
    _warn_if_busy(device, "while profiling", own=torch.get_num_threads())
    points = len({(r["tp"], r["recompute"], r["seqlen"], r["mbs"]) for r in doc["layer_time"]})
    print(f"wrote {Path(output)}: {points} points, {len(doc['infeasible'])} out of memory; "
          f"plan with --cost-model {output}")
    return 0


def short_rows_note(settings) -> "str | None":
    """A line saying what a grid whose ``max_tokens`` holds fewer than two rows of its longest
    length leaves unpriced, or None. The cost model interpolates between measured lengths and goes
    no further than either measured, so a micro-batch of two rows or more (padded, or a packed row
    past one segment's worth) at a length above the longest whose grid row reaches two has no price,
    and plan refuses it."""
    longest = settings.max_seq_length
    reach = max((s for s in settings.seq_lengths() if 2 in settings.micro_batch_sizes(s)), default=None)
    if reach == longest:
        return None
    where = f"above {reach} tokens" if reach is not None else "at any length"
    return (f"note: --max-tokens {settings.max_tokens} is below two rows of {longest} tokens: micro-batches of two "
            f"samples or more {where} (padded, or packed past one sample's worth) will have no price; give "
            f"--max-tokens {2 * longest} or more to plan them")


def _duration(spec, settings, device) -> str:
    """", at least N h at this device's measured matmul rate" (module profiling/duration.py)."""
    from megatron_dynapipe.gpt.device import torch_dtype
    from megatron_dynapipe.profiling.duration import describe_duration, estimated_seconds, matmul_flops_per_second

    rate = matmul_flops_per_second(device, torch_dtype(settings.dtype))
    seconds = estimated_seconds(spec, settings, rate)
    return f", at least {describe_duration(seconds)} at this {device.type.upper()}'s {rate / 1e9:,.0f} GFLOP/s"


class GridProgress:
    """The profile's bar, in grid points. The grid's size is an estimate (rows stop where memory
    runs out, refinement adds points), so the total stays ahead of the points measured until the
    run ends: rich stops a task's clock for good once it reaches its total (the bar ran past it,
    81/79, and its clock stood still for the rest of the run)."""

    def __init__(self, bar, task, expected: int):
        self.bar, self.task, self.expected, self.done = bar, task, expected, 0

    def __call__(self, what: str, points: int, left: "float | None" = None, milestone: bool = False) -> None:
        """``left``: the seconds this run's own points say the grid still takes (duration.TimeLeft),
        shown as the time left where given; elsewhere the bar's pace is. ``milestone``: a phase
        of its own starts (a context-parallel group), said at once where progress is plain lines."""
        self.done += points
        self.bar.update(self.task, description=what, completed=self.done, total=max(self.expected, self.done + 1),
                        left=left, milestone=milestone)

    def finish(self) -> None:
        self.bar.update(self.task, completed=self.done, total=self.done)


def busy_machine_warning(load: float, cores: int, when: str, own: float = 0.0) -> "str | None":
    """A CPU timed while other work runs is slower by the share it lost (2-14x has been seen):
    say so when the load average over the last minute, less ``own`` (the profile's own threads,
    which load the machine while it runs), passes half the cores."""
    if load - own <= cores / 2:
        return None
    mine = f", {own:g} of it the profile's own threads" if own else ""
    return (f"warning: this machine was busy {when} (load average {load:.1f} on {cores} cores{mine}): CPU times "
            "measured now can be several times slower than on an idle machine; profile again when it is idle")


def _warn_if_busy(device, when: str, own: float = 0.0) -> None:
    if device.type != "cpu" or not hasattr(os, "getloadavg"):
        return
    message = busy_machine_warning(os.getloadavg()[0], os.cpu_count() or 1, when, own)
    if message:
        print(message, file=sys.stderr)


def _report_calibration(doc: dict, output) -> int:
    fit, calibration = doc["analytical"], doc["metadata"]["calibration"]
    print(f"wrote {Path(output)}: the analytical model at {fit['peak_tflops']:.3g} TFLOP/s (attention at "
          f"{fit['attention_mfu']:.2g} of that), {fit['overhead_ms']:.3g} ms a layer and phase, saturating at "
          f"{fit['saturation_tokens']} tokens; off the {calibration['points']} "
          f"measured times by {calibration['median_error_pct']:.1f}% (median), {calibration['max_error_pct']:.1f}% "
          f"at most; plan with --cost-model {output}")
    return 0
