"""Methods as a dimension of a search: how the best traced layouts would train on the user's own
data (docs/simulate.md, "On your data").

A search given data (``--lengths FILE`` or ``--mix NAME``) draws ``batches`` global batches from
it, each of exactly ``global batch x seq-length`` tokens (what the fixed-shape step trains on),
and prices each method on them at the best traced layouts (interleaved pipelines as Megatron's
interleaved 1F1B and DynaPipe's planned one; under context parallelism every method's costs are
one rank's of the group, :class:`~megatron_dynapipe.planning.cost_model.ContextParallelCostModel`,
the ring's transfers at the link between its ranks):

* ``megatron``: Megatron's fixed shapes, its GPT data path: the samples back to back, cut into
  windows of ``seq-length`` tokens that attend across documents. The traced step, as simulated.
* ``thd``: the same windows without attention across documents (THD packing): each
  data-parallel rank's windows in rows of k, Megatron's 1F1B (interleaved where the layout is),
  the k and uniform recompute of the fastest run that fits
  (:func:`~megatron_dynapipe.planning.baselines.thd_packing_rows`).
* ``dp_balanced``: Megatron-LM's ``--sequence-packing-scheduler dp_balanced``: whole samples in
  arrival order, next-fit into THD packs of ``seq-length`` tokens, as many as a multiple of DP (x PP
  where interleaved), dealt out in turn, one pack a micro-batch, Megatron's schedule, the lightest
  uniform recompute that fits (:func:`~megatron_dynapipe.planning.baselines.megatron_dp_balanced_rows`).
* ``dynapipe`` and ``dynapipe-varlen``: the planner on each batch (padded, or packed THD
  micro-batches), every data-parallel rank planned; a step is its slowest rank's. The packed
  plan's search holds THD rows of whole samples and ``dp_balanced``'s packs as candidates, so it
  is never priced above ``dp_balanced``; against ``thd``, whose windows cut documents where they
  cross a row's end, it keeps documents whole.
* ``dynapipe-cut``: the packed planner on the pieces of ``thd``'s windows (the documents cut as
  Megatron's data path cuts them, ``TrainingSpec.documents = "cut"``): it trains what ``thd``
  trains, and its search holds ``thd``'s windows as a candidate, so it is never priced above
  ``thd`` either.

Where a method differs from the traced step is the pipeline, so a method's step is the
pipeline's makespan, simulated by the planner on the cost model the trace was priced with and
the TP group's collectives the trace records beside it (``Hardware.planner_stages``), plus what the
trace holds besides it: the traced iteration less the planner's simulation of
the traced layout's own fixed-shape schedule, 1F1B or its interleaved 1F1B (the gradient
reduction, the optimizer step, and whatever else the replay prices that the planner's stage costs
do not).
"""

from __future__ import annotations

import math
import multiprocessing
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.hardware import Hardware
from megatron_dynapipe.planning.baselines import (
    fixed_shape_run,
    megatron_dp_balanced_rows,
    megatron_thd_rows,
    uniform_microbatches,
)
from megatron_dynapipe.planning.breakdown import Breakdown, PipelineRun, explain
from megatron_dynapipe.planning.cost_model import StageCosts
from megatron_dynapipe.planning.methods import METHODS as REGISTERED, SEARCHED
from megatron_dynapipe.planning.planner import generate_execution_plan
from megatron_dynapipe.planning.samples import LengthSource
from megatron_dynapipe.planning.spec import TrainingSpec, seqlen_round_for
from megatron_dynapipe.planning.types import RecomputeType
from megatron_dynapipe.interrupts import default_signals, worker_pool
from megatron_dynapipe.progress import progress_bar
from megatron_dynapipe.simulate.reprice import priced_for
from megatron_dynapipe.simulate.search import Candidate, Outcome, SearchResult, SearchSpace, estimate
from megatron_dynapipe.simulate.variants import traced_choices
from megatron_dynapipe.tracer.batch_run import available_cores
from megatron_dynapipe.tracer.isolation import rank_start_method

if TYPE_CHECKING:
    from megatron_dynapipe.simulate.traced_job import TracedJob

__all__ = ["METHODS", "MethodStep", "MethodsResult", "parse_methods", "price_methods", "traced_layout"]

#: the methods a search prices, and what each is called in reports (the registry's labels)
METHODS = {name: REGISTERED[name].label for name in SEARCHED}


def parse_methods(values: Sequence[str]) -> tuple[str, ...]:
    """``--method`` values: names of :data:`METHODS`, or ``all``."""
    if "all" in values:
        return tuple(METHODS)
    unknown = [v for v in values if v not in METHODS]
    if unknown or not values:
        raise ValueError(f"--method {','.join(unknown) or '(none)'}: choose from {', '.join(METHODS)}, or all")
    return tuple(dict.fromkeys(values))


@dataclass
class MethodStep:
    """One method at one traced layout, on every drawn batch. The planned methods and THD
    packing choose their own micro-batches and recompute (``setting``); ``candidate`` gives
    the layout's TP, PP, DP and optimizer."""
    method: str
    candidate: Candidate
    step_s: list[float] = field(default_factory=list)  # per batch; empty where it failed
    peak_memory_gib: float = 0.0
    setting: str = ""  # the last batch's
    planning_s: float = 0.0
    error: Optional[str] = None
    why: list[Breakdown] = field(default_factory=list)  # per batch, where priced here (not for a traced step alone)
    rest_ms: float = 0.0  # what the trace adds to the pipeline: gradient reduction, optimizer step, ...

    def add(self, priced: "_Priced") -> None:
        """The next batch's pricing; the first failure ends the method at this layout."""
        if self.error is not None:
            return
        if priced.error is not None:
            self.error, self.step_s = priced.error, []
            return
        self.step_s.append((priced.pipeline_ms + priced.rest_ms) / 1e3)
        self.peak_memory_gib = max(self.peak_memory_gib, priced.peak_mb / 1024)
        self.setting = priced.setting
        self.planning_s += priced.seconds
        self.rest_ms = priced.rest_ms
        if priced.why is not None:
            self.why.append(priced.why)

    def explained(self) -> Optional[dict[str, float]]:
        """The breakdown's every figure, mean over the batches (:mod:`~megatron_dynapipe.planning.breakdown`),
        with the step's share of the ideal and the rest of the step; None where not priced here."""
        if not self.ok or len(self.why) != len(self.step_s):
            return None
        mean = {key: float(np.mean([getattr(b, key) for b in self.why]))
                for key in Breakdown.__dataclass_fields__ if key != "slowest_rank"}
        mean["rest_ms"] = self.rest_ms
        # against the pipeline, which the planner's cost model prices as it prices the ideal (the rest
        # is every method's, and where the replay prices the traced pipeline below the planner, negative)
        mean["of_ideal"] = float(np.mean([b.ideal_ms / b.pipeline_ms for b in self.why]))
        return mean

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.step_s)

    @property
    def mean_s(self) -> float:
        return float(np.mean(self.step_s)) if self.ok else math.inf

    @property
    def p95_s(self) -> float:
        return float(np.percentile(self.step_s, 95)) if self.ok else math.inf

    def to_json(self, tokens: int) -> dict[str, Any]:
        c = self.candidate
        out = {"method": self.method, "tp": c.tp, "pp": c.pp, "cp": c.cp, "dp": c.dp, "virtual_stages":
               c.virtual_stages, "distributed_optimizer": c.distributed_optimizer, "layout": c.describe(),
               "setting": self.setting, "error": self.error}
        if self.ok:
            out.update(step_s=self.step_s, mean_step_s=self.mean_s, p95_step_s=self.p95_s,
                       real_tokens_per_s=tokens / self.mean_s, peak_memory_gib=self.peak_memory_gib,
                       planning_s_per_batch=self.planning_s / len(self.step_s), why=self.explained())
        return out


@dataclass
class MethodsResult:
    source: str
    methods: tuple[str, ...]
    tokens: int  # every batch's, every method trains the same tokens
    samples: list[int]  # per batch
    fast_mode: "bool | str"  # the setting (True, False or "auto"); each planned step's setting says how it ran
    steps: list[MethodStep]
    seconds: float = 0.0

    def best(self, method: str) -> Optional[MethodStep]:
        """The method's fastest layout, by mean step time over the batches."""
        done = [s for s in self.steps if s.method == method and s.ok]
        return min(done, key=lambda s: (s.mean_s, s.candidate)) if done else None

    def at(self, method: str, candidate: Candidate) -> Optional[MethodStep]:
        return next((s for s in self.steps if s.method == method and s.candidate == candidate), None)

    def layouts(self) -> list[Candidate]:
        return list(dict.fromkeys(s.candidate for s in self.steps))

    def to_json(self) -> dict[str, Any]:
        best = {m: (b.to_json(self.tokens) if (b := self.best(m)) else None) for m in self.methods}
        return {"source": self.source, "methods": list(self.methods), "tokens_per_batch": self.tokens,
                "samples_per_batch": self.samples, "fast_mode": self.fast_mode, "seconds": self.seconds,
                "best": best, "steps": [s.to_json(self.tokens) for s in self.steps]}


def representatives(result: SearchResult, count: int) -> list[Outcome]:
    """The fastest simulated layout that fits of each (TP, PP, model chunks, CP, DP, optimizer),
    the ``count`` fastest of them: the layouts the methods are priced at."""
    best: dict[tuple, Outcome] = {}
    for o in result.ranked():
        c = o.candidate
        best.setdefault((c.tp, c.pp, c.virtual_stages, c.cp, c.dp, c.distributed_optimizer), o)
    return list(best.values())[:count]


def price_methods(space: SearchSpace, chosen: Sequence[Outcome], source: LengthSource, methods: Sequence[str], *,
                  traced_too: Sequence[Outcome] = (), batches: int = 8, seed: int = 0, fast_mode: "bool | str" = False,
                  jobs: Optional[int] = None, progress: bool = True) -> MethodsResult:
    """Each method on ``batches`` batches drawn from ``source``, at the traced layouts ``chosen``
    (a search's :func:`representatives`); Megatron's traced step at ``traced_too`` as well. The
    batches are priced ``jobs`` at a time (default one per core), each worker remembering its
    layouts' cost-model answers."""
    started = time.perf_counter()
    tokens = space.global_batch_size * space.seq_length
    drawn = source.batches(tokens, space.seq_length, batches, seed)
    out = MethodsResult(source.label, tuple(methods), tokens, [len(b) for b in drawn], fast_mode, [])
    chosen = list(chosen)
    steps = {(o.candidate, m): MethodStep(m, o.candidate) for o in chosen for m in methods}
    if "megatron" in methods:  # elsewhere the traced step alone, without a breakdown
        for o in traced_too:
            steps.setdefault((o.candidate, "megatron"), _traced_step(o, batches))
    todo = [(i, m, b) for i in range(len(chosen)) for m in methods for b in range(batches)]  # i: into chosen
    if not todo:
        out.steps, out.seconds = list(steps.values()), time.perf_counter() - started
        return out
    workers = max(1, min(jobs or available_cores(), len(todo)))
    context = multiprocessing.get_context(rank_start_method())
    with progress_bar(progress, sys.stderr) as bar, worker_pool(
            context, workers, _start_worker, (space, chosen, drawn, fast_mode)) as pool:
        task = bar.add_task("pricing methods on your data", total=len(todo))
        for (i, method, _), answer in zip(todo, pool.imap(_price, todo)):  # in order: batch by batch
            steps[chosen[i].candidate, method].add(answer)
            bar.advance(task)
    out.steps = list(steps.values())
    out.seconds = time.perf_counter() - started
    return out


def traced_layout(job: "TracedJob", hardware: Hardware,
                  cost_model: Optional[str] = None) -> tuple[SearchSpace, Outcome]:
    """A traced job as a search would have found it: its space (the model, world size, global
    batch and sequence length on ``hardware``) and its layout's outcome, whose ``report`` the
    caller sets to the job's simulation, for :func:`price_methods`.

    The methods are priced by the cost model that priced the traced step: ``hardware``'s own for a
    shapes-only trace priced by a hardware file (``simulate`` prices its compute for ``hardware``),
    else the profile ``cost_model`` names, which must be the one the trace was priced by. Refused
    in one line otherwise."""
    trace = next(iter(job.traces.values()))
    by_profile = trace.meta.get("cost_model")
    if priced_for(job) is not None:
        if cost_model is not None:
            raise ValueError(f"--cost-model: {job.folder.name}'s compute is priced by a hardware file, as the methods "
                             f"are (for --hardware {hardware.name}); drop --cost-model, or trace with --cost-model")
    elif cost_model is None:
        what = f"the profile {by_profile!r}" if by_profile else "a measured run"
        raise ValueError(f"{job.folder.name}'s compute comes from {what}: give the profile it was priced or measured "
                         "with as --cost-model, so that the methods are priced alike")
    options = MegatronOptions(**job.training)
    recompute, distributed_optimizer = traced_choices(job)
    layout, it = job.layout, job.iteration
    space = SearchSpace(job.model, layout.world_size, job.global_batch_size, int(it["seq_length"]), hardware,
                        dtype=job.dtype, cost_model=cost_model, async_tp_backward=options.async_tp_backward,
                        tp_comm_overlap=options.tp_comm_overlap)
    if cost_model is not None and by_profile and space.cost_model_for(layout.tp).name != by_profile:
        raise ValueError(f"--cost-model {cost_model}: {job.folder.name} was priced by {by_profile!r}; give that "
                         "profile")
    candidate = Candidate(layout.tp, layout.pp, layout.cp, layout.dp, int(it["micro_batch_size"]),
                          int(it["num_microbatches"]), recompute, distributed_optimizer, options.sequence_parallel,
                          options.virtual_size(job.model.num_layers, layout.pp))
    return space, Outcome(candidate, estimate(space, candidate), "simulated")


def _traced_step(outcome: Outcome, batches: int) -> MethodStep:
    """Megatron's fixed shapes: the traced layout's simulated step, whatever the batch."""
    c, r = outcome.candidate, outcome.report
    return MethodStep("megatron", c, [r.iteration_s] * batches, r.peak_memory_gib, _traced_setting(c))


def _traced_setting(c: Candidate) -> str:
    chunks = f", {c.virtual_stages} chunks a rank" if c.virtual_stages > 1 else ""
    return (f"mbs {c.micro_batch_size} x {c.num_microbatches}, recompute {c.recompute}{chunks}"
            + (f", CP {c.cp}" if c.cp > 1 else ""))


@dataclass(frozen=True)
class _Priced:
    """One method on one batch at one layout."""
    pipeline_ms: float = math.nan
    rest_ms: float = 0.0
    peak_mb: float = 0.0
    setting: str = ""
    seconds: float = 0.0
    error: Optional[str] = None
    why: Optional[Breakdown] = None


_WORKER: dict[str, Any] = {}  # a pricing worker's search space, layouts, batches, and their _Layouts so far


def _start_worker(space: SearchSpace, chosen: list[Outcome], drawn: list[list[int]], fast_mode: "bool | str") -> None:
    default_signals()
    _WORKER.update(space=space, chosen=chosen, drawn=drawn, fast_mode=fast_mode, layouts={})


def _price(todo: tuple[int, str, int]) -> _Priced:
    i, method, b = todo
    layouts = _WORKER["layouts"]
    if i not in layouts:
        layouts[i] = _Layout(_WORKER["space"], _WORKER["chosen"][i])
    return layouts[i].price(method, _WORKER["drawn"][b], _WORKER["fast_mode"])


class _Layout:
    """One traced layout seen by the planner: its stage costs, memory limit and the non-pipeline
    time its trace holds."""

    def __init__(self, space: SearchSpace, outcome: Outcome):
        c = outcome.candidate
        self.space, self.candidate, self.chunks, self.outcome = space, c, c.virtual_stages, outcome
        # one row a virtual stage (chunk v of rank r is row v * pp + r), on one rank of a CP group
        layers = StageCosts(space.cost_model_for(c.tp, c.sequence_parallel), num_layers=space.model.num_layers,
                            pp=c.pp * self.chunks, dp=c.dp, zero_stage=1 if c.distributed_optimizer else 0)
        traced = space.training_options(c.sequence_parallel, self.chunks)  # its TP collectives run as traced
        self.costs = space.hardware.planner_stages(layers, space.model, cp=c.cp, sequence_parallel=c.sequence_parallel,
                                                   tp_comm_overlap=traced.tp_comm_overlap,
                                                   async_backward=traced.async_tp_backward)
        self.memory_limit_mb = space.hardware.memory_gib * 1024
        self.fixed = fixed_shape_run(self.costs, c.micro_batch_size * c.num_microbatches, c.micro_batch_size,
                                     space.seq_length, RecomputeType.parse(c.recompute), chunks=self.chunks)
        # None where the cost model prices the traced micro-batch as not fitting the device at all
        self.rest_ms = None if self.fixed is None else 1e3 * outcome.report.iteration_s - self.fixed.makespan

    def price(self, method: str, lengths: list[int], fast_mode: "bool | str") -> _Priced:
        """One batch's pipeline time by ``method``, what the trace adds to it, its peak, and why."""
        if self.rest_ms is None:
            return _Priced(error="the cost model gives the traced micro-batch no time (its layer does not fit the "
                                 "device): nothing to set the other methods against")
        started = time.perf_counter()
        try:
            found = {"megatron": self._megatron, "thd": self._thd, "dp_balanced": self._dp_balanced}.get(
                method, self._planned)(method, lengths, fast_mode)
        except ValueError as error:  # nothing fits, a batch dp_balanced cannot deal out, or a planning error
            return _Priced(error=str(error).splitlines()[0])
        run, setting, sample_lengths = found
        why = explain(run, self.costs, sample_lengths, lengths, self.space.seq_length, self.chunks)
        return _Priced(why.pipeline_ms, self.rest_ms, run.peak_mb, setting, time.perf_counter() - started, why=why)

    def _megatron(self, method, lengths, fast_mode):
        """The traced fixed shapes: windows of seq-length back to back (every token real), as the
        planner's simulation prices them (so pipeline and rest add up to the traced step)."""
        c, seq = self.candidate, self.space.seq_length
        rows = uniform_microbatches(c.micro_batch_size * c.num_microbatches, c.micro_batch_size, seq)
        run = PipelineRun.uniform([rows] * c.dp, RecomputeType.parse(c.recompute), [self.fixed.makespan] * c.dp,
                                  1024 * self.outcome.report.peak_memory_gib, self.costs.pp)
        return run, _traced_setting(c), [seq] * (c.micro_batch_size * c.num_microbatches)

    def _thd(self, method, lengths, fast_mode):
        found = megatron_thd_rows(lengths, self.space.seq_length, self.costs, self.memory_limit_mb, self.chunks,
                                  self.candidate.cp)
        if found is None:
            raise ValueError("does not fit at any rows of windows and recompute")
        k = found.per_rank[0][0].seq_len // self.space.seq_length
        return (self._uniform(found), f"rows of {k} window{'s' * (k > 1)}, recompute {found.recompute.label}",
                lengths)

    def _dp_balanced(self, method, lengths, fast_mode):
        found = megatron_dp_balanced_rows(lengths, self.space.seq_length, self.costs, self.memory_limit_mb,
                                          self.chunks, self.candidate.cp)
        if found is None:
            raise ValueError("does not fit at any recompute")
        return (self._uniform(found), f"{sum(map(len, found.per_rank))} packs, recompute {found.recompute.label}",
                lengths)

    def _uniform(self, found) -> PipelineRun:
        return PipelineRun.uniform(found.per_rank, found.recompute, found.rank_makespan_ms,
                                   max(found.stage_peak_mb), self.costs.pp)

    def _planned(self, method, lengths, fast_mode):
        spec = TrainingSpec(num_layers=self.space.model.num_layers, pp=self.candidate.pp, tp=self.candidate.tp,
                            dp=self.candidate.dp, chunks=self.chunks, cp=self.candidate.cp,
                            seqlen_round=seqlen_round_for(self.candidate.cp),
                            zero_stage=self.costs.zero_stage, memory_limit_mb=self.memory_limit_mb, fast_mode=fast_mode,
                            packing=REGISTERED[method].packing, seq_length=self.space.seq_length,
                            documents=REGISTERED[method].documents)
        plan = generate_execution_plan(lengths, spec, self.costs)  # a PlanningError is a ValueError
        setting = "planned" + (", documents cut" if plan.pieces is not None else "") + (
            ", fast mode" if plan.fast_mode else "")
        return PipelineRun.of_plan(plan), setting, lengths if plan.pieces is None else plan.pieces.length
