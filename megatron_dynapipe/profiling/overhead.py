"""What a whole training step adds per micro-batch to the times of the parts it runs.

The profile times a transformer layer, the embedding and the head on their own.  A training step
runs them inside GPTModel (positions, the causal mask, the layer stack), through Megatron's DDP
(its gradient hooks, per parameter) and DynaPipe's executor, with the GPT forward step's loss
mask and token count: work no part's time holds.  On the tiny GPT on a 2-core CPU a micro-batch
of a 4-layer stage took 16.8 ms where its parts add up to 11.3 (32 tokens), and plans priced by
the parts alone came out 6-23% short.  Some of it comes once per stage, some once per layer
(a layer inside the model took 0.7-1.5 ms more than alone).

So the profiler times the real thing: stages of 1 and of ``min(3, layers)`` layers, built as
``bench step`` builds them (:mod:`megatron_dynapipe.runtime.stage`), each running plans of 1 and of
``MICROBATCHES`` identical micro-batches, forward only and forward-backward, all in turn, round
after round, so that the machine's drift hits all alike; in the same rounds the parts run alone
too (one layer; the embedding and the head).  The difference of the two plans' times
in a round per added micro-batch (its median over the rounds: :func:`added_ms`) leaves out what a
step pays once (finalising the gradients); the two stages' difference per added layer, less the
layer's own time, is the per-layer overhead; the rest of the 1-layer stage's time, less its
parts', the per-stage one.  Each is fitted as ``ms + ms_per_token * tokens`` per phase over the
shapes, robustly (:func:`fit_overhead`), both terms >= 0.  The parts' times come from those
rounds, not from the profile's grid, measured minutes before: the overhead is the small difference
of large times, and the machine's pace moves in between.  On the 2-core CPU, the tiny GPT at 1024
positions, one sequence of 1024 tokens: a layer added 16.4 ms forward inside a stage and took 16.1
alone in the same rounds, 14.0 in the grid ten minutes before, so the grid's time made a
per-layer overhead of 2.4 ms of what was 0.2.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.data.microbatches import gpt_microbatch
from megatron_dynapipe.planning.baselines import uniform_microbatches
from megatron_dynapipe.planning.cost_model import PHASES
from megatron_dynapipe.planning.plan import build_execution_plans
from megatron_dynapipe.planning.schedules import one_f_one_b_orders
from megatron_dynapipe.planning.types import RecomputeType
from megatron_dynapipe.profiling.measure import Step, time_once, unless_out_of_memory
from megatron_dynapipe.runtime.stage import build_training_stage, planned_step

__all__ = ["Overhead", "measure_overhead", "overhead_shapes", "overhead_seconds", "fit_overhead", "added_ms"]

MICROBATCHES = 3  # micro-batches of the longer plan; the shorter has one
MOST_LAYERS = 3  # layers of the larger stage timed (the smaller has one)
MAX_ROUNDS = 50  # of each run per shape, however short
Line = tuple[float, float]  # (ms, ms per token)
#: (seq, mbs) -> one layer's step and the embedding's and head's, each run alone (None: they do not fit)
PartSteps = Callable[[int, int], "tuple[Step, list[Step]] | None"]


@dataclass(frozen=True)
class Overhead:
    """``(ms, ms per token)`` a step adds per micro-batch in each phase, once per stage and once
    per layer of the stage; ``points`` shapes were fitted."""
    stage: dict[str, Line]  # phase -> line
    layer: dict[str, Line]
    points: int


def overhead_shapes(measured: Sequence[tuple[int, int]], lengths: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Shapes to time, among the (seq, mbs) the layers were measured at: one micro-batch of each
    length, and the largest micro-batch of the shortest and of the longest length, so that the
    fit spans the tokens a plan uses. Given the grid's own ``lengths``, only at those: lengths
    refinement added between them (the more, the noisier the machine) would cost a shape each,
    seconds on a CPU, and say nothing more about a line in tokens."""
    if lengths is not None and any(seq in lengths for seq, _ in measured):
        measured = [(seq, mbs) for seq, mbs in measured if seq in lengths]
    if not measured:
        return []
    by_seq: dict[int, list[int]] = {}
    for seq, mbs in measured:
        by_seq.setdefault(seq, []).append(mbs)
    shapes = {(seq, min(sizes)) for seq, sizes in by_seq.items()}
    shapes |= {(seq, max(by_seq[seq])) for seq in (min(by_seq), max(by_seq))}
    return sorted(shapes)


def overhead_seconds(parts_ms: Callable[[str, int, int], tuple[float, float]], shapes: Sequence[tuple[int, int]],
                     num_layers: int, repeats: int = 3, min_time_ms: float = 100.0) -> list[float]:
    """Seconds :func:`measure_overhead` takes at each of ``shapes``, from the parts' profiled times
    (``parts_ms(phase, seq, mbs)``: one layer's, and the embedding's and head's together): its eight
    runs priced as their layers, embedding and head alone (the overhead it measures beside them is a
    few percent of a run) and its two runs of the parts alone, the warm-up round and the rounds
    :func:`_more_rounds` asks for those times."""
    out = []
    for seq, mbs in shapes:
        (layer_f, ends_f), (layer_b, ends_b) = (parts_ms(phase, seq, mbs) for phase in PHASES)
        runs = [count * (layers * layer_f + ends_f + (0.0 if forward_only else layers * layer_b + ends_b))
                for count in (1, MICROBATCHES) for layers in _layer_counts(num_layers)
                for forward_only in (True, False)] + [layer_f + layer_b, ends_f + ends_b]
        times: dict = {k: [] for k in range(len(runs))}
        while _more_rounds(times, repeats, min_time_ms):
            for k, ms in enumerate(runs):
                times[k].append(ms)
        out.append((len(times[0]) + 1) * sum(runs) / 1e3)
    return out


def _layer_counts(num_layers: int) -> list[int]:
    """Layers of the stages timed: one and ``MOST_LAYERS`` (or all the model has)."""
    return sorted({1, min(MOST_LAYERS, num_layers)})


def fit_overhead(tokens: Sequence[float], ms: Sequence[float]) -> tuple[float, float]:
    """``(a, b)`` >= 0 of the line ``a + b * tokens`` through ``ms``, fitted robustly (Theil-Sen:
    ``b`` the median of the slopes between every two shapes, ``a`` the median of what is left).

    Least squares let the largest shape decide: at 16 sequences of 1024 tokens, where a 3-layer
    stage faults in gigabytes that one layer alone does not, one point's +726 ms made a slope
    that priced every shorter micro-batch's layer forwards 80-140% high (and the stage line's
    -728 ms at the same shape, which cancelled it, was cut to zero)."""
    t, y = np.asarray(tokens, dtype=float), np.asarray(ms, dtype=float)
    first, second = np.triu_indices(len(t), 1)
    apart = t[first] != t[second]
    if apart.any():
        b = float(np.median((y[second] - y[first])[apart] / (t[second] - t[first])[apart]))
        a = float(np.median(y - b * t))
        if a >= 0 and b >= 0:
            return a, b
        if b < 0:  # no growth with tokens: a constant
            return max(0.0, float(np.median(y))), 0.0
    positive = t > 0  # through the origin
    return 0.0, max(0.0, float(np.median(y[positive] / t[positive]))) if positive.any() else 0.0


def measure_overhead(spec: ModelSpec, *, tp: int, dtype, device: torch.device, recompute: RecomputeType,
                     parts: PartSteps, shapes: Sequence[tuple[int, int]], repeats: int = 3, min_time_ms: float = 100.0,
                     before_shape: Callable[[int], None] = lambda k: None) -> Overhead | None:
    """The per-micro-batch overhead of ``spec`` at these ``shapes`` (module docstring), inside
    :func:`~.layers.fake_tp_rank`; ``parts(seq, mbs)`` gives the steps of one layer and of the
    embedding and head there, timed alone in the same rounds; ``before_shape(k)`` is called before
    shape ``k`` is timed. None when no shape fits on the device."""
    counts = _layer_counts(spec.num_layers)
    stages = {n: build_training_stage(spec, dtype=dtype, device=device, tp=tp, num_layers=n) for n in counts}
    tokens: list[int] = []
    lines: dict[tuple[str, str], list[float]] = {(per, phase): [] for per in ("stage", "layer") for phase in PHASES}
    for k, (seq, mbs) in enumerate(shapes):
        before_shape(k)
        per_microbatch = unless_out_of_memory(device, lambda: _per_microbatch_ms(
            stages, spec, recompute, parts, seq, mbs, device, repeats, min_time_ms))
        if per_microbatch is None:
            continue
        per_microbatch, parts_ms = per_microbatch
        tokens.append(seq * mbs)
        for phase in PHASES:
            layer_ms, ends_ms = parts_ms[phase]
            one = per_microbatch[1][phase]
            added = (per_microbatch[counts[-1]][phase] - one) / (counts[-1] - 1) if len(counts) > 1 else layer_ms
            lines["layer", phase].append(added - layer_ms)
            lines["stage", phase].append(one - added - ends_ms)
    if not tokens:
        return None
    fitted = {key: fit_overhead(tokens, values) for key, values in lines.items()}
    return Overhead(stage={phase: fitted["stage", phase] for phase in PHASES},
                    layer={phase: fitted["layer", phase] for phase in PHASES}, points=len(tokens))


def _per_microbatch_ms(stages: dict, spec: ModelSpec, recompute: RecomputeType, parts: PartSteps, seq: int,
                       mbs: int, device: torch.device, repeats: int, min_time_ms: float) -> "tuple[dict, dict] | None":
    """Per stage (by its layer count), the forward and backward ms one more micro-batch of
    (seq, mbs) adds to a step: plans of 1 and of MICROBATCHES micro-batches, forward only and
    forward-backward, run in turn until each has ``repeats`` runs and all add up to
    ``min_time_ms``; the medians' differences.  And per phase, the medians of one layer alone and
    of the embedding and head together, run in the same rounds.  None where the parts do not fit."""
    steps = parts(seq, mbs)
    if steps is None:
        return None
    layer, ends = steps
    rng = np.random.default_rng(seq * 1000 + mbs)
    runs = {}
    for count in (1, MICROBATCHES):
        micro = uniform_microbatches(count * mbs, mbs, seq)
        plan = build_execution_plans(one_f_one_b_orders(1, count), micro, recompute.label, "1f1b")[0]
        tensors = [gpt_microbatch(list(rng.integers(0, spec.vocab_size, (mbs, seq))), seq) for _ in micro]
        for layers, ddp in stages.items():
            for forward_only in (True, False):
                runs[layers, count, forward_only] = ddp, planned_step(ddp, plan, tensors, device,
                                                                      forward_only=forward_only)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    alone = {"layer": [layer], "ends": ends}
    times: dict = {key: [] for key in (*runs, *alone)}
    for ddp, run in runs.values():  # warm-up
        ddp.zero_grad_buffer()
        run()
    for step in (layer, *ends):
        time_once(step, device)
    while _more_rounds(times, repeats, min_time_ms):
        for key, (ddp, run) in runs.items():
            ddp.zero_grad_buffer()
            sync()
            start = time.perf_counter()
            run()
            sync()
            times[key].append((time.perf_counter() - start) * 1e3)
        for key, part in alone.items():  # (forward, backward) ms, summed over the part's steps
            times[key].append(tuple(map(sum, zip(*(time_once(step, device) for step in part)))))
    out = {}
    for layers in stages:
        forward, step = (added_ms(times[layers, MICROBATCHES, only], times[layers, 1, only], MICROBATCHES - 1)
                         for only in (True, False))
        out[layers] = {"forward": forward, "backward": step - forward}
    parts_ms = {phase: tuple(statistics.median(run[k] for run in times[key]) for key in alone)
                for k, phase in enumerate(PHASES)}
    return out, parts_ms


def _more_rounds(times: dict, repeats: int, min_time_ms: float) -> bool:
    """Whether every run goes once more: until each has ``repeats`` runs and its own add up to
    ``min_time_ms``, at most MAX_ROUNDS.  (Runs of 5 ms get 20 rounds at 100 ms: the small shapes,
    which one-layer chunks pay most for, are the noisiest.)"""
    rounds = min(map(len, times.values()))
    return rounds < MAX_ROUNDS and (rounds < repeats or min(map(_total_ms, times.values())) < min_time_ms)


def _total_ms(runs: Sequence) -> float:
    """A run's times so far: each a time in ms, or a (forward, backward) pair of them."""
    return sum(sum(run) if isinstance(run, tuple) else run for run in runs)


def added_ms(more: Sequence[float], one: Sequence[float], added: int) -> float:
    """What each of ``added`` more micro-batches adds, from a plan's runs (``more``) and the
    one-micro-batch plan's (``one``) in the same rounds: the median of each round's difference, so
    that a round slowed as a whole (the machine's drift) cancels and a lone slow run is outvoted.
    The two plans' medians may come from different rounds: with them, two profiles of the same
    model on a 2-core CPU three hours apart fitted 0.9 and 2.1 ms a micro-batch and chunk."""
    return statistics.median(a - b for a, b in zip(more, one)) / added
