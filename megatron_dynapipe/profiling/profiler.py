"""Profile a GPT's layers on this device into a cost-model file (docs/cost_model.md).

For each tensor-parallel size, each recompute type, and each point of a grid of sequence
lengths and micro-batch sizes: the forward and backward time of one transformer layer and of the
last stage's head (final norm, LM head and loss) and of the first stage's embedding, the layer's
stored and peak activation memory, the forward and backward time of the layer's attention core
alone without a mask (the blocks context parallelism's ring adds, at any recompute type),
and the 16-bit parameter memory of a layer and of the embeddings; then, for each context-parallel
size asked for (``cp_sizes``), the layer on a real group of that many local ranks at the TP 1 points
whose rows it splits (:mod:`.context_parallel`); last, the link between two local ranks of the
device (:mod:`.link`), which the pipeline's transfers cross.  Where the attention core runs
packed micro-batches (``--attention sdpa``, transformer-engine), the layer is measured on packed
rows too, ``mbs`` samples of ``seqlen`` tokens back to back at each point, so that the planner
prices packed micro-batches from packed measurements.

The grid is geometric: sequence lengths double from ``min_seq_length`` to ``max_seq_length``,
micro-batch sizes double from 1 while ``mbs * seqlen <= max_tokens``; a row stops growing at the
first out-of-memory (an infeasible point, which the cost model then prices ``inf``).  Where the
time per token still bends between two profiled lengths, the length between them is profiled
too (``refine_tolerance``), since the cost model interpolates linearly in between.

The file is rewritten atomically after every sequence length with ``"complete": false`` in its
metadata; a profile that stopped (Ctrl-C, a crash) resumes from it where it stopped.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.config.model_flags import megatron_model_args
from megatron_dynapipe.files import write_atomically
from megatron_dynapipe.gpt.build import uses_transformer_engine
from megatron_dynapipe.gpt.device import torch_dtype
from megatron_dynapipe.planning.cost_model import MB
from megatron_dynapipe.planning.cost_model.profile_file import FORMAT_VERSION, ProfileRecords, read_document, to_text
from megatron_dynapipe.planning.types import RecomputeType
from megatron_dynapipe.profiling.consistency import noisy_points
from megatron_dynapipe.profiling.context_parallel import cp_points, cp_seconds, measure_cp_layers
from megatron_dynapipe.profiling.duration import (
    RunPace,
    TimeLeft,
    calibrated_seconds,
    describe_duration,
    point_flops,
    run_flops,
)
from megatron_dynapipe.profiling.layers import Parts, build_parts, fake_tp_rank
from megatron_dynapipe.profiling.link import link_backend, measure_link
from megatron_dynapipe.profiling.measure import (
    measure_memory,
    steady_cpu_allocator,
    time_once,
    time_step,
    unless_out_of_memory,
)
from megatron_dynapipe.profiling.overhead import Overhead, measure_overhead, overhead_seconds, overhead_shapes

__all__ = ["ProfileSettings", "ProfileError", "profile_model"]


class ProfileError(ValueError):
    """A profile cannot be made as asked; the message is one line that names the fix."""


@dataclass(frozen=True)
class ProfileSettings:
    tp_sizes: tuple[int, ...] = (1,)
    cp_sizes: tuple[int, ...] = ()  # context-parallel groups the layer is timed on (at tp 1), beyond CP 1
    recompute: tuple[RecomputeType, ...] = tuple(RecomputeType)
    dtype: str = "fp32"
    min_seq_length: int = 32
    max_seq_length: int = 2048
    max_tokens: int = 16384
    warmup: int = 1
    repeats: int = 3
    min_time_ms: float = 100.0  # a point is timed until its runs add up to this (measure.time_step)
    refine_tolerance: float = 0.1  # interpolation error that earns a length between two profiled ones
    max_refinements: int = 2

    def seq_lengths(self) -> list[int]:
        seqs, seq = [], self.min_seq_length
        while seq < self.max_seq_length:
            seqs.append(seq)
            seq *= 2
        return seqs + [self.max_seq_length]

    def grid_points(self) -> int:
        """Points of the geometric grid (rows may stop earlier; refinement may add some), one
        whole-step measurement per TP size, one more per context-parallel group, and the link."""
        per_tp = sum(len(list(self.micro_batch_sizes(seq))) for seq in self.seq_lengths())
        return (per_tp * len(self.recompute) + 1) * len(self.tp_sizes) + len(self.cp_sizes) + 1

    def micro_batch_sizes(self, seq: int) -> Iterable[int]:
        mbs = 1
        while mbs * seq <= max(self.max_tokens, seq):
            yield mbs
            mbs *= 2


@dataclass
class ProfileRun:
    """The file being written: its records (keyed so that a resumed profile skips what it has) and
    what it was made of."""

    spec: ModelSpec
    settings: ProfileSettings
    device: torch.device
    records: ProfileRecords = field(default_factory=ProfileRecords)
    link: "dict | None" = None  # metadata.link: measured between two local ranks (None: not yet, or not here)
    time_left: TimeLeft = field(default_factory=lambda: TimeLeft({}))  # the grid's points still to measure

    def start_clock(self) -> None:
        """Count the grid's points this run still measures (not those a resumed file has)."""
        self.time_left = TimeLeft({})
        for tp in self.settings.tp_sizes:
            for seq in self.settings.seq_lengths():
                self.count_row(tp, seq)

    def count_row(self, tp: int, seq: int) -> None:
        """Add one length's points still to measure to the time left (a refinement adds lengths)."""
        s = self.settings
        for mbs in s.micro_batch_sizes(seq):
            todo = [rc for rc in s.recompute if not self.has(tp, rc, seq, mbs, packed=False)]
            if todo:
                self.time_left.add((tp, seq, mbs), point_flops(self.spec, s, tp, seq, mbs, todo))

    def has(self, tp: int, rc: RecomputeType, seq: int, mbs: int, packed: bool) -> bool:
        key = (tp, rc.label, "encoder", "forward", seq, mbs)
        if (tp, rc.label, seq, mbs) in self.records.infeasible:
            return True
        return key in self.records.times and (not packed or key in self.records.packed_times)

    def document(self, complete: bool) -> dict[str, Any]:
        return {
            "name": f"{self.spec.label} on {device_name(self.device)}",
            "source": f"megatron-dynapipe profile, {device_name(self.device)}, {self.settings.dtype}",
            "hidden_size": self.spec.hidden_size,
            "metadata": self.metadata(complete),
            **self.records.records(),
        }

    def metadata(self, complete: bool) -> dict[str, Any]:
        s = self.settings
        return {
            "format_version": FORMAT_VERSION,
            "complete": complete,
            "device": device_name(self.device),
            "device_type": self.device.type,
            "cpu_threads": torch.get_num_threads() if self.device.type == "cpu" else None,
            "dtype": s.dtype,
            "layer_spec": "transformer_engine" if uses_transformer_engine(self.device.type) else "local",
            "versions": _versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": self.spec.to_json(),
            "megatron_args": megatron_model_args(self.spec),
            "settings": {"tp_sizes": list(s.tp_sizes), "cp_sizes": list(s.cp_sizes),
                         "recompute": [r.label for r in s.recompute],
                         "min_seq_length": s.min_seq_length, "max_seq_length": s.max_seq_length,
                         "max_tokens": s.max_tokens, "warmup": s.warmup, "repeats": s.repeats,
                         "min_time_ms": s.min_time_ms,
                         "refine_tolerance": s.refine_tolerance},
            **({"link": self.link} if self.link else {}),
        }

    def set_overhead(self, tp: int, overhead: Overhead) -> None:
        self.records.overhead[tp] = {(per, phase): line for per, lines in (("stage", overhead.stage),
                                                                           ("layer", overhead.layer))
                                     for phase, line in lines.items()}
        self.records.overhead_points[tp] = overhead.points

    @classmethod
    def resumed(cls, path: Path, spec: ModelSpec, settings: ProfileSettings, device: torch.device) -> "ProfileRun":
        """The interrupted profile in ``path``, if it was made of the same model, dtype and device."""
        doc = read_document(path)
        meta = doc.get("metadata") or {}
        mismatch = [what for what, mine, theirs in (
            ("model", spec.to_json(), meta.get("model")), ("dtype", settings.dtype, meta.get("dtype")),
            ("device", device_name(device), meta.get("device"))) if mine != theirs]
        if mismatch:
            raise ProfileError(f"cannot resume: the existing profile has another {', '.join(mismatch)}; "
                               "pass --force to start over or another --output")
        return cls(spec, settings, device, ProfileRecords.from_document(doc, str(path)), link=meta.get("link"))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def _versions() -> dict[str, str]:
    from importlib import metadata

    versions = {"torch": torch.__version__}
    for name in ("megatron-core", "megatron-dynapipe", "transformer-engine"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


# before each measurement: what it measures, how many grid points, and (keyword ``left``, where this
# run's points so far tell) the seconds the grid's points after it take (duration.TimeLeft)
Progress = Callable[..., None]


def profile_model(spec: ModelSpec, output: str | os.PathLike, settings: ProfileSettings, *,
                  device: torch.device, resume: bool = False, progress: Progress | None = None,
                  allow_noisy: bool = False) -> dict:
    """Profile ``spec`` on ``device`` into ``output`` (module docstring); returns the document.
    Both points of a pair where the smaller shape measured well above the larger are measured again
    (:mod:`.consistency`); where some stay so, the file is left incomplete (a --resume measures
    them again) and ProfileError names them. ``allow_noisy``: keep what was measured as it is,
    and write it complete."""
    output = Path(output)
    if device.type == "cpu":
        steady_cpu_allocator()
    progress = progress or (lambda what, points, **_: None)
    profile = ProfileRun(spec, settings, device)
    if resume and output.exists():
        profile = ProfileRun.resumed(output, spec, settings, device)
    profile.start_clock()
    for tp in settings.tp_sizes:
        with fake_tp_rank(tp, device):
            _profile_tp(profile, tp, output, progress, allow_noisy)
    for cp in settings.cp_sizes:  # again where a profile of format 3 measured the group's times alone
        if not all(any(key[1] == cp for key in group) for group in (profile.records.cp_times,
                                                                   profile.records.cp_memory)):
            _profile_cp(profile, cp, output, progress)
    backend = link_backend(device)
    if profile.link is None and backend:
        progress(f"link between two local ranks ({backend})", 1)
        profile.link = _measured_link(backend)
    noisy = noisy_points(profile.records)
    doc = profile.document(complete=allow_noisy or not noisy)
    if noisy:
        doc["metadata"]["inconsistent"] = list(dict.fromkeys(why for _, why in noisy))  # a pair's two points, once
    write_atomically(output, to_text(doc))
    if noisy and not allow_noisy:
        raise ProfileError(f"{len(noisy)} point(s) of {output} stay out of line with shapes beside them after "
                           f"measuring them again ({noisy[0][1]}): was the machine busy? run the same command with "
                           "--resume on an idle machine to measure them again, or pass --allow-noisy to keep them")
    return doc


def _profile_cp(profile: ProfileRun, cp: int, output: Path, progress: Progress) -> None:
    """The layer on a context-parallel group of ``cp`` local ranks (:mod:`.context_parallel`); where
    the group does not run, said in one line, and the profile goes on without it."""
    from megatron_dynapipe.local_ranks import LocalRanksError

    points = cp_points(profile.records.times, 1, cp)
    backend = link_backend(profile.device, cp)
    progress(f"tp 1 cp {cp}: the layer on {cp} local ranks ({backend}), {len(points)} points", 1,
             left=cp_seconds(profile.records, points, profile.settings), milestone=True)
    try:
        timings = measure_cp_layers(profile.spec, profile.settings, cp, points, backend)
    except LocalRanksError as error:
        print(f"warning: the layer could not be timed on {cp} local ranks ({_first_line(error)}); the profile "
              f"prices CP {cp} from its CP 1 times: run profile --resume to measure it again", file=sys.stderr)
        return
    r = profile.records
    for (rc, layout, seq, mbs), (timing, memory) in timings.items():
        _record_timing(r.cp_times, r.cp_spread, (1, cp, rc, layout), seq, mbs, timing)
        _record_memory(r.cp_memory, (1, cp, rc, layout), seq, mbs, memory)
    write_atomically(output, to_text(profile.document(complete=False)))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _measured_link(backend: str) -> "dict | None":
    """The link's record, or None (said once) where two local ranks could not be run: a profile of
    hours is not lost to it, and its transfers are priced at the default."""
    from megatron_dynapipe.local_ranks import LocalRanksError

    try:
        return measure_link(backend)
    except LocalRanksError as error:
        print(f"warning: the link between two local ranks could not be measured ({_first_line(error)}); the profile "
              "prices transfers at the default 100 GB/s: run profile --resume to measure it again", file=sys.stderr)
        return None


def _profile_tp(profile: ProfileRun, tp: int, output: Path, progress: Progress, allow_noisy: bool = False) -> None:
    s = profile.settings
    parts = build_parts(profile.spec, tp, torch_dtype(s.dtype), profile.device, s.recompute)
    for rc in s.recompute:  # the same shards whatever the recompute type; the format wants each
        profile.records.params[(tp, rc.label, "encoder")] = parts.encoder_params * 2 / MB  # 16-bit, as the format says
        profile.records.params[(tp, rc.label, "embedding")] = parts.embedding_params * 2 / MB
    _warm_up(profile, parts)
    _say_how_long(profile, parts, tp)
    seqs = s.seq_lengths()
    for seq in seqs:
        _profile_row(profile, parts, tp, seq, output, progress)
    if tp not in profile.records.overhead:  # measured right after the refinement: a resume does not probe again
        _refine(profile, parts, tp, seqs, output, progress)
    if not allow_noisy:
        _measure_noisy_again(profile, parts, tp, progress)
    if tp not in profile.records.overhead:
        measure_step_overhead(profile, parts, tp, progress)
    write_atomically(output, to_text(profile.document(complete=False)))


#: rounds of measuring a TP size's suspect points again (:mod:`.consistency`)
REMEASURE_ROUNDS = 2


def _measure_noisy_again(profile: ProfileRun, parts: Parts, tp: int, progress: Progress) -> None:
    """Measure again, up to :data:`REMEASURE_ROUNDS` times, each point of this TP size measured
    out of line with a shape beside it (one of a pair, :mod:`.consistency`): what a busy moment slowed once is
    seldom slowed again, and a time too fast is seldom repeated."""
    for _ in range(REMEASURE_ROUNDS):
        noisy = {key for key, _ in noisy_points(profile.records) if key[0] == tp}
        for _, rc, seq, mbs in sorted(noisy):
            progress(f"tp {tp} {rc} seq {seq} mbs {mbs} again (out of line with a shape beside it)", 1)
            measure_point(profile, parts, tp, [RecomputeType.parse(rc)], seq, mbs)
        if not noisy:
            return


def measure_step_overhead(profile: ProfileRun, parts: Parts, tp: int, progress: Progress) -> None:
    """What a whole training step adds per micro-batch (:mod:`.overhead`), measured with the
    first recompute type profiled at the points its layers were measured, beside ``parts`` alone."""
    s, rc = profile.settings, profile.settings.recompute[0]

    def part_steps(seq: int, mbs: int):
        inputs = _inputs(profile, seq, mbs)
        if inputs is None:
            return None
        x, labels = inputs
        encoder = parts.encoders[rc]
        return (lambda: encoder(x)), [lambda: parts.preprocess(labels), lambda: parts.postprocess(x, labels)]

    def ms(layer: str, phase: str, seq: int, mbs: int) -> float:
        return profile.records.times[(tp, rc.label, layer, phase, seq, mbs)]

    def parts_ms(phase: str, seq: int, mbs: int) -> tuple[float, float]:
        return ms("encoder", phase, seq, mbs), ms("preprocess", phase, seq, mbs) + ms("postprocess", phase, seq, mbs)

    measured = [(k[4], k[5]) for k in profile.records.times if k[:4] == (tp, rc.label, "encoder", "forward")]
    shapes = overhead_shapes(measured, s.seq_lengths())
    seconds = overhead_seconds(parts_ms, shapes, profile.spec.num_layers, s.repeats, s.min_time_ms)

    def before_shape(k: int) -> None:  # one grid point in all, the time left from the parts' own times
        seq, mbs = shapes[k]
        progress(f"tp {tp} whole-step overhead ({mbs} x {seq} tokens, {k + 1} of {len(shapes)})", int(k == 0),
                 left=sum(seconds[k:]), milestone=k == 0)

    if not shapes:
        progress(f"tp {tp} whole-step overhead", 1)
    found = measure_overhead(profile.spec, tp=tp, dtype=torch_dtype(s.dtype), device=profile.device, recompute=rc,
                             parts=part_steps, shapes=shapes, repeats=s.repeats, min_time_ms=s.min_time_ms,
                             before_shape=before_shape)
    if found is not None:
        profile.set_overhead(tp, found)


def _warm_up(profile: ProfileRun, parts: Parts) -> None:
    """Run every part once, untimed, at the grid's largest micro-batch (where it fits): the
    process's first runs (thread pools, kernel selection, the allocator growing its pools; see
    :func:`~.measure.steady_cpu_allocator` for the CPU's) are slower than any later one and would
    inflate the first points measured."""
    seq = profile.settings.max_seq_length
    inputs = _inputs(profile, seq, max(profile.settings.micro_batch_sizes(seq)))
    if inputs is None:
        return
    x, labels = inputs
    for step in [lambda: parts.postprocess(x, labels), lambda: parts.preprocess(labels),
                 *(lambda e=e: e(x) for e in parts.encoders.values())]:
        unless_out_of_memory(profile.device, lambda: time_step(step, profile.device, warmup=0, repeats=1))


def _say_how_long(profile: ProfileRun, parts: Parts, tp: int) -> None:
    """Say how long this TP size's points still to measure and its whole-step overhead take at the
    pace of its layer, run once (after the warm-up) at the grid's smallest and largest points
    (duration.calibrated_seconds); nothing where neither is left or those points do not fit."""
    s, rc = profile.settings, profile.settings.recompute[0]
    todo = {point: flops for point, flops in profile.time_left.todo.items() if point[0] == tp}
    if not todo and tp in profile.records.overhead:
        return
    ends = [(s.min_seq_length, 1), (s.max_seq_length, max(s.micro_batch_sizes(s.max_seq_length)))]
    runs = []
    for seq, mbs in ends:
        inputs = _inputs(profile, seq, mbs)
        ms = inputs and unless_out_of_memory(profile.device, lambda: min(
            sum(time_once(lambda: parts.encoders[rc](inputs[0]), profile.device)) for _ in range(2)))
        if not ms:
            return
        _, _, layer_flops = run_flops(profile.spec, tp, seq, mbs, [rc])
        runs.append((layer_flops, ms / 1e3))
    pace = RunPace.through(*runs)
    grid = calibrated_seconds(pace, profile.spec, s, todo, packed=bool(parts.packed_encoders),
                              core=parts.attention_core is not None)

    def parts_ms(phase: str, seq: int, mbs: int) -> tuple[float, float]:  # a third of a run forward
        head, embedding, layer = (pace.run_s(f) * 1e3 for f in run_flops(profile.spec, tp, seq, mbs, [rc]))
        share = 1 / 3 if phase == "forward" else 2 / 3
        return share * layer, share * (head + embedding)

    shapes = overhead_shapes([(seq, mbs) for seq in s.seq_lengths() for mbs in s.micro_batch_sizes(seq)],
                             s.seq_lengths())
    overhead = 0.0 if tp in profile.records.overhead else sum(
        overhead_seconds(parts_ms, shapes, profile.spec.num_layers, s.repeats, s.min_time_ms))
    (seq_a, mbs_a), (seq_b, mbs_b) = ends
    print(f"tp {tp}: about {describe_duration(grid + overhead)} to measure (the grid {describe_duration(grid)}, the "
          f"whole-step overhead {describe_duration(overhead)}; lengths a refinement adds and the link come on top), "
          f"at the pace of its layer run once at {mbs_a} x {seq_a} and {mbs_b} x {seq_b} tokens", file=sys.stderr)


def _profile_row(profile: ProfileRun, parts: Parts, tp: int, seq: int, output: Path, progress: Progress) -> None:
    """Every micro-batch size of one sequence length, each recompute type until it runs out."""
    open_rows = list(profile.settings.recompute)
    for mbs in profile.settings.micro_batch_sizes(seq):
        done = [rc for rc in open_rows if profile.has(tp, rc, seq, mbs, bool(parts.packed_encoders))]  # before a resume
        open_rows = [rc for rc in open_rows if (tp, rc.label, seq, mbs) not in profile.records.infeasible]
        todo = [rc for rc in open_rows if rc not in done]
        if todo:
            progress(f"tp {tp} {'/'.join(rc.label for rc in todo)} seq {seq} mbs {mbs}", len(todo),
                     left=profile.time_left.seconds())
            started = time.perf_counter()
            fits = measure_point(profile, parts, tp, todo, seq, mbs)
            profile.time_left.measured((tp, seq, mbs), time.perf_counter() - started)
            open_rows = [rc for rc in open_rows if rc not in todo or rc in fits]
        if not open_rows:
            profile.time_left.forget((tp, seq, m) for m in profile.settings.micro_batch_sizes(seq) if m > mbs)
            break
    write_atomically(output, to_text(profile.document(complete=False)))


def measure_point(profile: ProfileRun, parts: Parts, tp: int, recompute: Sequence[RecomputeType], seq: int,
                   mbs: int) -> list[RecomputeType]:
    """Measure one point for each recompute type into ``profile`` (the head and the embedding
    once, for all of them); returns the types that fit in memory there."""
    s, device = profile.settings, profile.device

    def timed(step):  # its Timing, or None where the device runs out of memory
        return unless_out_of_memory(device, lambda: time_step(step, device, **_timing(s)))

    inputs = _inputs(profile, seq, mbs)
    x, labels = inputs or (None, None)
    head = inputs and timed(lambda: parts.postprocess(x, labels))
    embedding = head and timed(lambda: parts.preprocess(labels))
    fits = []
    for rc in recompute:
        encoder = parts.encoders[rc]
        timing = embedding and timed(lambda: encoder(x))
        measured = timing and unless_out_of_memory(device, lambda: (timing, measure_memory(lambda: encoder(x), device)))
        if not measured:
            profile.records.infeasible.add((tp, rc.label, seq, mbs))
            continue
        r = profile.records
        for layer, t in (("encoder", measured[0]), ("postprocess", head), ("preprocess", embedding)):
            _record_timing(r.times, r.spread, (tp, rc.label, layer), seq, mbs, t)
        _record_memory(r.memory, (tp, rc.label), seq, mbs, measured[1])
        if rc in parts.packed_encoders:
            _measure_packed(profile, parts.packed_encoders[rc], tp, rc, seq, mbs)
        fits.append(rc)
    if fits and parts.attention_core and (tp, "forward", seq, mbs) not in profile.records.core_times:
        _measure_core(profile, parts, tp, seq, mbs)
    return fits


def _measure_core(profile: ProfileRun, parts: Parts, tp: int, seq: int, mbs: int) -> None:
    """The attention core alone, without a mask, at one point (nothing recorded where it runs out of
    memory, which the layer around it did not). A core that cannot run alone is said once and left
    out of the profile, whose CP blocks are then priced by the core's FLOP share: the layers' times
    are what count."""
    s, device = profile.settings, profile.device
    heads, groups, head_dim = parts.core_widths

    def inputs():
        return [torch.randn(seq, mbs, n, head_dim, device=device, dtype=torch_dtype(s.dtype), requires_grad=True)
                for n in (heads, groups, groups)]

    try:
        qkv = unless_out_of_memory(device, inputs)
        timing = qkv and unless_out_of_memory(device, lambda: time_step(lambda: parts.attention_core(*qkv), device,
                                                                         **_timing(s)))
    except Exception as error:  # noqa: BLE001 -- a profile of hours is not lost to the core's own call
        parts.attention_core = None
        print(f"warning: the attention core does not run alone here ({type(error).__name__}: {error}); the profile "
              "leaves it out, and context parallelism's blocks are priced by the core's FLOP share", file=sys.stderr)
        return
    if timing:
        for phase, ms in (("forward", timing.forward_ms), ("backward", timing.backward_ms)):
            profile.records.core_times[(tp, phase, seq, mbs)] = ms


def _measure_packed(profile: ProfileRun, packed_encoder, tp: int, rc: RecomputeType, seq: int, mbs: int) -> None:
    """The layer on one packed row of ``mbs`` samples of ``seq`` tokens; nothing recorded where it
    runs out of memory (the cost model then prices no packed micro-batch that large)."""
    s, device = profile.settings, profile.device
    row = unless_out_of_memory(device, lambda: torch.randn(
        seq * mbs, 1, profile.spec.hidden_size, device=device, dtype=torch_dtype(s.dtype), requires_grad=True))
    if row is None:
        return
    step = lambda: packed_encoder(row, seq)  # noqa: E731
    timing = unless_out_of_memory(device, lambda: time_step(step, device, **_timing(s)))
    memory = timing and unless_out_of_memory(device, lambda: measure_memory(step, device))
    if memory:
        r = profile.records
        _record_timing(r.packed_times, r.packed_spread, (tp, rc.label, "encoder"), seq, mbs, timing)
        _record_memory(r.packed_memory, (tp, rc.label), seq, mbs, memory)


def _record_timing(times: dict, spread: dict, key: tuple, seq: int, mbs: int, t) -> None:
    for phase, ms, spread_ms in (("forward", t.forward_ms, t.forward_spread_ms),
                                 ("backward", t.backward_ms, t.backward_spread_ms)):
        times[(*key, phase, seq, mbs)] = ms
        spread[(*key, phase, seq, mbs)] = spread_ms


def _record_memory(memory: dict, key: tuple, seq: int, mbs: int, measured) -> None:
    memory[(*key, "stored", seq, mbs)] = measured.stored_bytes / MB
    memory[(*key, "peak", seq, mbs)] = measured.peak_bytes / MB


def _inputs(profile: ProfileRun, seq: int, mbs: int) -> "tuple[torch.Tensor, torch.Tensor] | None":
    """Hidden states ``[seq, mbs, hidden]`` and token ids ``[mbs, seq]`` of one point, or None
    when they do not fit on the device."""
    s, device = profile.settings, profile.device
    return unless_out_of_memory(profile.device, lambda: (
        torch.randn(seq, mbs, profile.spec.hidden_size, device=device, dtype=torch_dtype(s.dtype), requires_grad=True),
        torch.randint(0, profile.spec.vocab_size, (mbs, seq), device=device)))


def _timing(s: ProfileSettings) -> dict:
    return dict(warmup=s.warmup, repeats=s.repeats, min_time_ms=s.min_time_ms)


#: rounds of timing a length and the two around it in turn, to tell a bend from a slow moment
BEND_ROUNDS = 3


def _refine(profile: ProfileRun, parts: Parts, tp: int, seqs: Sequence[int], output: Path, progress: Progress) -> None:
    """Profile a length between two profiled ones wherever the linear interpolation the cost
    model does between them misses a probe there by more than the tolerance."""
    seqs = sorted(seqs)
    for _ in range(profile.settings.max_refinements):
        between = [m for a, b in zip(seqs, seqs[1:]) if (m := _midpoint(a, b)) and _bends(profile, parts, tp, a, m, b)]
        if not between:
            return
        for seq in between:
            profile.count_row(tp, seq)
        for seq in between:
            _profile_row(profile, parts, tp, seq, output, progress)
        seqs = sorted(seqs + between)


def _midpoint(short: int, long: int) -> int | None:
    """A multiple of 8 strictly between (the planner pads lengths to multiples of 8), if any."""
    middle = (short + long) // 16 * 8
    return middle if short < middle < long else None


def _bends(profile: ProfileRun, parts: Parts, tp: int, short: int, middle: int, long: int) -> bool:
    """Whether one layer's forward at ``middle`` tokens (``mbs=1``, the first recompute type) is
    off the straight line between ``short`` and ``long`` by more than the tolerance, all three
    timed in the same moment: :data:`BEND_ROUNDS` rounds of the three in turn, each length's
    median.  A layer of a few milliseconds on a CPU is timed 10-25% apart run to run, so a probe
    set against the grid's ends, measured a minute before, saw a bend wherever one of those ends
    had been measured in a slow moment, and a row of points was measured for nothing."""
    rc = profile.settings.recompute[0]
    if any((tp, rc.label, "encoder", "forward", seq, 1) not in profile.records.times for seq in (short, long)):
        return False  # a row that does not reach mbs=1 there is not interpolated either
    inputs = {seq: torch.randn(seq, 1, profile.spec.hidden_size, device=profile.device,
                               dtype=torch_dtype(profile.settings.dtype), requires_grad=True)
              for seq in (short, middle, long)}
    runs: dict[int, list[float]] = {seq: [] for seq in inputs}
    for _ in range(BEND_ROUNDS):
        for seq, x in inputs.items():
            probe = time_step(lambda: parts.encoders[rc](x), profile.device, **dict(_timing(profile.settings), warmup=1))
            runs[seq].append(probe.forward_ms)
    a, m, b = (statistics.median(runs[seq]) for seq in (short, middle, long))
    line = a + (b - a) * (middle - short) / (long - short)
    return abs(m - line) > profile.settings.refine_tolerance * m
