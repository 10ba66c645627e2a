"""Search the parallel layouts of one model on one cluster for the fastest that fits.

A search runs in four steps (docs/simulate.md, "Searching for a layout"):

1. **enumerate** every layout megatron-core accepts: TP (up to the GPUs of a node), PP, CP,
   DP, micro-batch size, sequence parallelism (where TP > 1), interleaving (1, 2 or 4 model
   chunks a rank), recompute (none, selective, full) and the distributed optimizer, for the
   world size and global batch asked for;
2. **prune and rank by estimate**: each stage's memory (model state, the activations 1F1B keeps
   in flight, one layer's working set) and a closed-form 1F1B iteration time, both from the
   analytical cost model (:mod:`megatron_dynapipe.planning.cost_model`) and the hardware model;
   layouts that do not fit are pruned;
3. **trace** the representative ranks of the best-estimated layouts, shapes-only, once per
   (TP, PP, CP, micro-batch size, SP, chunks): recompute and optimizer variants are derived from that trace
   (:mod:`.variants`), and a trace already in the output folder is reused;
4. **simulate** every variant of the traced layouts (:mod:`.replay`) and rank them by
   predicted iteration time among those whose traced memory fits.

The layout the common rules of thumb pick (:func:`rule_of_thumb`) is always traced and
simulated, so the search can say how much slower it is.  Nothing here imports torch until
step 3 starts the tracer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import multiprocessing
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from megatron_dynapipe.config.accounting import activation_bytes, total_params
from megatron_dynapipe.config.layout import MAX_GLOBAL_BATCH, MAX_WORLD_SIZE, model_problems
from megatron_dynapipe.config.megatron_options import MegatronOptions, warmup_passes
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.hardware import Hardware
from megatron_dynapipe.interrupts import worker_pool
from megatron_dynapipe.planning.cost_model import (
    MB,
    CostModel,
    StageCosts,
    load_cost_model,
    resolve_cost_model_path,
    split_over_cp,
)
from megatron_dynapipe.progress import progress_bar
from megatron_dynapipe.simulate.replay import simulate_job
from megatron_dynapipe.simulate.traced_job import load_job
from megatron_dynapipe.simulate.report import report
from megatron_dynapipe.simulate.variants import RECOMPUTE_CHOICES, derive
from megatron_dynapipe.tracer.batch_config import TraceConfig, validate
from megatron_dynapipe.tracer.batch_results import INTERRUPTED
from megatron_dynapipe.tracer.batch_run import available_cores, run_batch
from megatron_dynapipe.tracer.isolation import rank_start_method
from megatron_dynapipe.tracer.trace_format import RECORDING_REVISION

__all__ = ["SearchError", "SearchSpace", "Candidate", "Estimate", "Outcome", "SearchResult",
           "enumerate_candidates", "estimate", "rule_of_thumb", "run_search"]

#: parameters per model-parallel (TP x PP) rank the rule of thumb aims at, for dense models
RULE_PARAMS_PER_RANK = 4e9
#: sequences at least this long get context parallelism 2 by the rule of thumb
RULE_CP_FROM_TOKENS = 8192


class SearchError(ValueError):
    """The search cannot start or finds nothing; the message names the fix."""


@dataclass(frozen=True)
class SearchSpace:
    """What to search: a model on ``world_size`` GPUs of ``hardware`` with a global batch of
    ``global_batch_size`` sequences of ``seq_length`` tokens.  Each of ``tp``, ``pp``, ``cp``,
    ``micro_batch_sizes``, ``sequence_parallel``, ``virtual_stages`` (model chunks a pipeline
    rank; 1 is plain 1F1B), ``recompute`` and ``distributed_optimizer`` fixes that dimension to
    the values given (``None``: all that make sense).  ``cost_model`` is a profile's path or
    name for compute times (``None``: the hardware's own model, :meth:`Hardware.cost_model`).
    ``overlap_p2p_comm``: interleaved layouts post their pipeline transfers and wait for them
    later, as Megatron-LM does by default (False: they block, and need PP > 2).
    ``async_tp_backward``: a column-parallel linear's backward runs its TP collectives beside its
    GEMMs, as megatron-core does (False: the Megatron-LM of 2021, which waited for them).
    ``tp_comm_overlap`` and ``overlap_grad_reduce``: Megatron-LM's flags of those names, the
    first on the sequence-parallel layouts alone (as Megatron-LM allows it)."""
    model: ModelSpec
    world_size: int
    global_batch_size: int
    seq_length: int
    hardware: Hardware
    dtype: str = "bfloat16"
    tp: Optional[tuple[int, ...]] = None
    pp: Optional[tuple[int, ...]] = None
    cp: Optional[tuple[int, ...]] = None
    micro_batch_sizes: Optional[tuple[int, ...]] = None
    recompute: Optional[tuple[str, ...]] = None
    distributed_optimizer: Optional[tuple[bool, ...]] = None
    sequence_parallel: Optional[tuple[bool, ...]] = None
    virtual_stages: Optional[tuple[int, ...]] = None
    max_tp: Optional[int] = None
    cost_model: Optional[str] = None
    overlap_p2p_comm: bool = True
    async_tp_backward: bool = True
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "global_batch_size", "seq_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SearchError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name, most in (("world_size", MAX_WORLD_SIZE), ("global_batch_size", MAX_GLOBAL_BATCH)):
            if getattr(self, name) > most:
                raise SearchError(f"--{name.replace('_', '-')} {getattr(self, name):,} is over the {most:,} a job may "
                                  "have: give the job's real size")
        if self.model.num_experts:
            raise SearchError(f"model {self.model.label} is mixture-of-experts; search covers dense GPTs: trace MoE "
                              "layouts with `megatron-dynapipe trace` and compare them with `simulate`")
        if self.seq_length > self.model.max_sequence_length:
            raise SearchError(f"--seq-length {self.seq_length} exceeds the model's {self.model.max_sequence_length} "
                              "positions: raise --max-position-embeddings or shorten --seq-length")
        for cp in self.cp or ():
            if self.seq_length % (2 * cp) or self.world_size % cp:
                raise SearchError(f"--cp {cp}: context parallelism splits each sequence into 2 x CP chunks and "
                                  f"needs CP to divide --world-size; use a CP that divides both --seq-length "
                                  f"{self.seq_length} / 2 and --world-size {self.world_size}")
        for tp in self.tp or ():
            self._check_tp(tp)
        for pp in self.pp or ():  # a fixed PP that cannot be one is the user's to fix, not a batch problem
            if self.world_size % pp or self.model.num_layers % pp:
                fitting = [p for p in range(1, self.model.num_layers + 1)
                           if self.model.num_layers % p == 0 and self.world_size % p == 0]
                raise SearchError(f"--pp {pp}: pipeline stages must divide --world-size {self.world_size} and the "
                                  f"model's {self.model.num_layers} layers; use one of {', '.join(map(str, fitting))}")
        for value in self.recompute or ():
            if value not in RECOMPUTE_CHOICES:
                raise SearchError(f"--recompute {value!r}: use {', '.join(RECOMPUTE_CHOICES)}")
        if self.tp_comm_overlap and self.sequence_parallel == (False,):
            raise SearchError("--tp-comm-overlap overlaps sequence parallelism's collectives: drop "
                              "--no-sequence-parallel or --tp-comm-overlap")
        self.hardware.peak(self.dtype)  # a hardware file without this dtype's peak is refused here

    def _check_tp(self, tp: int) -> None:
        """A fixed --tp value that no layout can use is the user's to fix, not a batch problem."""
        node = self.hardware.gpus_per_node
        if tp > node:
            raise SearchError(f"--tp {tp} spans {tp // node if tp % node == 0 else 'more than one'} nodes of "
                              f"{node} GPUs ({self.hardware.name}): tensor parallelism stays inside a node (its "
                              f"per-layer all-reduces would cross the network); use --tp {node} or less")
        problem = next(iter(model_problems(self.model, tp=tp, names={"tp": "--tp"})), None)
        if problem or self.world_size % tp:
            raise SearchError(f"--tp {tp}: {problem or f'does not divide --world-size {self.world_size}'}; "
                              "use a TP size that divides both")

    @property
    def tp_limit(self) -> int:
        return self.max_tp or self.hardware.gpus_per_node

    def tp_values(self) -> list[int]:
        if self.tp:
            return sorted(set(self.tp))
        return [t for t in _powers_of_two(self.tp_limit) if self.world_size % t == 0]

    def pp_values(self) -> list[int]:
        if self.pp:
            return sorted(set(self.pp))
        return [p for p in range(1, self.model.num_layers + 1) if self.model.num_layers % p == 0
                and self.world_size % p == 0]

    def cp_values(self) -> list[int]:
        """Context parallelism pays off on long sequences: 1, 2, 4 and 8 from
        :data:`RULE_CP_FROM_TOKENS` tokens, else none."""
        if self.cp:
            return sorted(set(self.cp))
        if self.seq_length < RULE_CP_FROM_TOKENS:
            return [1]
        return [c for c in (1, 2, 4, 8) if self.seq_length % (2 * c) == 0 and self.world_size % c == 0]

    def mbs_values(self) -> list[int]:
        return sorted(set(self.micro_batch_sizes or (1, 2, 4, 8)))

    def training_values(self, tp: int, pp: int, num_microbatches: int) -> list[MegatronOptions]:
        """The sequence-parallel and interleaving choices megatron-core accepts at this layout."""
        out = []
        for sp in sorted(set(self.sequence_parallel or (False, True))):
            if sp and tp == 1:  # Megatron-LM turns it off at TP 1: the candidate without it
                continue
            for v in sorted(set(self.virtual_stages or (1, 2, 4))):
                options = self.training_options(sp, v)
                if not options.layout_problem(tp=tp, pp=pp, num_layers=self.model.num_layers,
                                              num_microbatches=num_microbatches):
                    out.append(options)
        return out

    def training_options(self, sequence_parallel: bool, chunks: int) -> MegatronOptions:
        """The Megatron-LM options a layout is traced with: its sequence parallelism and model
        chunks a rank (a ``trace_key``'s last two), and this space's communication overlaps."""
        return MegatronOptions(sequence_parallel=sequence_parallel, virtual_stages=chunks if chunks > 1 else None,
                               overlap_p2p_comm=self.overlap_p2p_comm, async_tp_backward=self.async_tp_backward,
                               tp_comm_overlap=self.tp_comm_overlap and sequence_parallel,
                               overlap_grad_reduce=self.overlap_grad_reduce)

    def cost_model_for(self, tp: int, sequence_parallel: bool = False) -> CostModel:
        """The layers' costs at ``tp``: the hardware's roofline, its activations with or without
        ``sequence_parallel``; or the ``cost_model`` profile, as measured (without sequence
        parallelism: :attr:`prices_sequence_parallel`)."""
        if self.cost_model is not None:
            return load_cost_model(self.cost_model, tp, hidden_size=self.model.hidden_size)
        return self.hardware.cost_model(self.model, tp, self.dtype, sequence_parallel=sequence_parallel)

    @property
    def prices_sequence_parallel(self) -> bool:
        """Whether :meth:`cost_model_for` counts sequence parallelism's smaller activations."""
        return self.cost_model is None

    @property
    def compute_label(self) -> str:
        """Names the compute times the traces carry (traces of another label are not reused): a
        cost model's name (``gpt-6.7b-a100``: dots are part of it) and a digest of its file's
        bytes, so another file of the same name, or the same file changed, is traced anew."""
        if self.cost_model is not None:
            path = resolve_cost_model_path(self.cost_model)
            name = path.name[:-len(".json")] if path.name.endswith(".json") else path.name
            return f"{name}-{hashlib.sha256(path.read_bytes()).hexdigest()[:10]}"
        hardware = json.dumps(self.hardware.to_json(), sort_keys=True).encode()
        return f"{self.hardware.name}-{hashlib.sha256(hardware).hexdigest()[:10]}"


def _powers_of_two(limit: int) -> list[int]:
    return [2 ** i for i in range(int(math.log2(max(1, limit))) + 1)]


@dataclass(frozen=True, order=True)
class Candidate:
    """One layout: how the job is split, and how each micro-batch runs."""
    tp: int
    pp: int
    cp: int
    dp: int
    micro_batch_size: int
    num_microbatches: int
    recompute: str
    distributed_optimizer: bool
    sequence_parallel: bool = False
    virtual_stages: int = 1

    @property
    def trace_key(self) -> tuple[int, int, int, int, bool, int]:
        """Layouts that share a trace: recompute and the optimizer are derived from it."""
        return self.tp, self.pp, self.cp, self.micro_batch_size, self.sequence_parallel, self.virtual_stages

    def describe(self) -> str:
        chunks = f" VPP{self.virtual_stages}" if self.virtual_stages > 1 else ""
        return (f"TP{self.tp}{' SP' if self.sequence_parallel else ''} PP{self.pp}{chunks} CP{self.cp} DP{self.dp} "
                f"mbs {self.micro_batch_size}x{self.num_microbatches} "
                f"recompute {self.recompute}, {'dist-opt' if self.distributed_optimizer else 'all-reduce opt'}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def enumerate_candidates(space: SearchSpace) -> list[Candidate]:
    """Every layout megatron-core accepts in ``space``, in a fixed order."""
    out = []
    for tp in space.tp_values():
        for pp in space.pp_values():
            for cp in space.cp_values():
                for mbs in space.mbs_values():
                    config = trace_config(space, tp, pp, cp, mbs)
                    if validate(config):
                        continue
                    for options in space.training_values(tp, pp, config.microbatches):
                        for recompute in space.recompute or RECOMPUTE_CHOICES:
                            for dist_opt in space.distributed_optimizer or (False, True):
                                out.append(Candidate(tp, pp, cp, config.dp, mbs, config.microbatches, recompute,
                                                     dist_opt, options.sequence_parallel,
                                                     options.virtual_size(space.model.num_layers, pp)))
    return out


def trace_config(space: SearchSpace, tp: int, pp: int, cp: int, mbs: int, *_: Any) -> TraceConfig:
    """The trace of a ``trace_key``'s layout (its training options: :meth:`SearchSpace.training_options`)."""
    return TraceConfig(world_size=space.world_size, pp=pp, tp=tp, cp=cp, model=space.model, micro_batch_size=mbs,
                       global_batch_size=space.global_batch_size, seq_length=space.seq_length,
                       source="search")


# -- estimates ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """A layout's closed-form 1F1B iteration time and its busiest stage's memory."""
    iteration_s: float
    memory_bytes: float

    def fits(self, hardware: Hardware) -> bool:
        return self.memory_bytes <= hardware.memory_bytes


def estimate(space: SearchSpace, c: Candidate, cost_models: Optional[dict[tuple, CostModel]] = None) -> Estimate:
    """Memory: per stage, model state (16 B a parameter, Adam's 12 B sharded over DP with the
    distributed optimizer) plus the activations of the ``min(pp - stage, micro-batches)``
    micro-batches 1F1B holds (with V model chunks, megatron-core's warm-up of
    ``2(p - 1) + (V - 1)p + 1`` chunk passes of 1/V of the stage each) and one layer's working
    set; sequence parallelism shrinks the activations as Korthikanti et al. count them.  Time:
    ``(m + (p - 1)/V)`` times the slowest stage's forward, backward (with recomputation),
    tensor-parallel all-reduces and pipeline sends (V a micro-batch) per micro-batch, plus the
    data-parallel gradient reduction (not overlapped) and the optimizer step.  Context parallelism
    prices one rank of the group (:class:`~megatron_dynapipe.planning.cost_model.ContextParallelCostModel`:
    its share of the tokens, the ring's other ``c - 1`` attention blocks); the ring's communication,
    overlapped with them, is left to the trace."""
    model = (cost_models or {}).get((c.tp, c.sequence_parallel)) or space.cost_model_for(c.tp, c.sequence_parallel)
    costs = StageCosts(split_over_cp(model, c.cp, space.model, ring_transfers=False),  # one rank of a CP group
                       num_layers=space.model.num_layers, pp=c.pp, dp=c.dp, zero_stage=1 if c.distributed_optimizer else 0)
    hw, seq = space.hardware, space.seq_length // c.cp  # a CP rank's tokens of a sequence
    b, h = c.micro_batch_size, space.model.hidden_size
    activation = 2.0 * b * seq * h  # bytes of one 16-bit activation tensor
    tp_group, dp_group = range(c.tp), range(0, c.tp * c.cp * c.dp, c.tp * c.cp)
    allreduce_us = hw.collective_us("all_reduce", activation, tp_group)
    p2p_us = hw.p2p_us(activation, 0, c.tp * c.cp * c.dp) if c.pp > 1 else 0.0
    tp_per_layer = 4 + (2 if c.recompute == "full" else 0)  # forward 2, backward 2, recomputed forward 2
    v = c.virtual_stages
    # a profile is measured without sequence parallelism: its stored activations scaled as counted
    stored_share = _sequence_parallel_share(space, c) if c.sequence_parallel and not space.prices_sequence_parallel \
        else 1.0
    slowest, memory, tail_us = 0.0, 0.0, 0.0
    for stage in range(c.pp):
        layers = costs.layers_on(stage)
        per_mb_us = 1e3 * (costs.forward_ms(stage, b, space.seq_length, "none")
                           + costs.backward_ms(stage, b, space.seq_length, c.recompute))
        per_mb_us += layers * tp_per_layer * allreduce_us + 2 * v * p2p_us
        slowest = max(slowest, per_mb_us)
        in_flight = (min(c.pp - stage, c.num_microbatches) if v == 1
                     else min(warmup_passes(c.pp, v) + 1, c.num_microbatches * v) / v)
        state = costs.model_state_mb(stage) * MB
        # one layer's working set: with recomputation, the layer recomputed before its backward
        memory = max(memory, state + MB * (in_flight * stored_share
                                           * costs.stored_mb(stage, b, space.seq_length, c.recompute)
                                           + costs.peak_mb(stage, b, space.seq_length, "none")))
        grads = 2 * costs.param_mb(stage) * MB  # fp32 gradients: twice the 16-bit parameters
        if c.distributed_optimizer:
            reduce_us = (hw.collective_us("reduce_scatter", grads, dp_group)
                         + hw.collective_us("all_gather", grads / 2, dp_group))
        else:
            reduce_us = hw.collective_us("all_reduce", grads, dp_group)
        tail_us = max(tail_us, reduce_us + 2 * hw.memory_bound_us(state))
    iteration_us = (c.num_microbatches + (c.pp - 1) / v) * slowest + tail_us
    return Estimate(iteration_us / 1e6, memory)


def _sequence_parallel_share(space: SearchSpace, c: Candidate) -> float:
    """What sequence parallelism leaves of a layer's stored activations."""
    args = (space.seq_length // c.cp, c.micro_batch_size, space.model.hidden_size, space.model.num_attention_heads,
            c.tp)
    fused = space.model.fused_attention
    return (activation_bytes(*args, recompute=c.recompute, sequence_parallel=True, fused_attention=fused)
            / activation_bytes(*args, recompute=c.recompute, fused_attention=fused))


# -- the rule of thumb ----------------------------------------------------------------------


def rule_of_thumb(space: SearchSpace) -> Optional[Candidate]:
    """The layout common practice picks: TP within a node, about 4 B parameters per TP x PP
    rank, PP below the number of micro-batches, CP 2 from 8192 tokens, micro-batch 1, selective
    recompute (full if selective does not fit) and the distributed optimizer.  ``None`` when the
    rules lead to no valid layout."""
    model_parallel = max(1, math.ceil(total_params(space.model) / RULE_PARAMS_PER_RANK))
    cp = 2 if space.seq_length >= RULE_CP_FROM_TOKENS else 1
    tps = [t for t in space.tp_values() if t <= max(1, 2 ** math.ceil(math.log2(model_parallel)))]
    for tp in sorted(tps, reverse=True):
        for pp in space.pp_values():
            if tp * pp < model_parallel:
                continue
            config = trace_config(space, tp, pp, cp, 1)
            if validate(config) or (pp > 1 and pp >= config.microbatches):
                continue
            for recompute in ("selective", "full"):
                c = Candidate(tp, pp, cp, config.dp, 1, config.microbatches, recompute, True)
                if recompute == "full" or estimate(space, c).fits(space.hardware):
                    return c
    return None


# -- the search ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What the search learnt of one candidate: ``status`` is ``pruned`` (its estimated memory
    does not fit), ``estimated`` (not among the traced), ``simulated`` or ``failed``."""
    candidate: Candidate
    estimate: Estimate
    status: str
    report: Any = None  # a SimulationReport when simulated
    error: Optional[str] = None

    @property
    def fits(self) -> bool:
        return self.report.fits if self.report is not None else False

    @property
    def iteration_s(self) -> float:
        return self.report.iteration_s if self.report is not None else self.estimate.iteration_s

    def to_json(self) -> dict[str, Any]:
        out = {**self.candidate.to_json(), "status": self.status,
               "estimated_iteration_s": self.estimate.iteration_s,
               "estimated_memory_gib": self.estimate.memory_bytes / 2**30, "error": self.error}
        if self.report is not None:
            r = self.report
            out.update(iteration_s=r.iteration_s, mfu=r.mfu, hardware_mfu=r.hardware_mfu,
                       model_tflops_per_gpu=r.model_tflops_per_gpu, bubble_fraction=r.bubble_fraction,
                       peak_memory_gib=r.peak_memory_gib, fits=r.fits, exposed_comm_s=r.exposed_comm_s)
        return out


@dataclass
class SearchResult:
    space: SearchSpace
    outcomes: list[Outcome]
    rule: Optional[Candidate]
    traced: int = 0
    reused: int = 0
    trace_seconds: float = 0.0
    simulate_seconds: float = 0.0

    def ranked(self) -> list[Outcome]:
        """Simulated candidates whose traced memory fits, fastest first."""
        done = [o for o in self.outcomes if o.status == "simulated" and o.fits]
        return sorted(done, key=lambda o: (o.report.iteration_s, o.candidate))

    def outcome_of(self, candidate: Optional[Candidate]) -> Optional[Outcome]:
        return next((o for o in self.outcomes if o.candidate == candidate), None)

    def counts(self) -> dict[str, int]:
        counts = {"enumerated": len(self.outcomes)}
        for status in ("pruned", "estimated", "simulated", "failed"):
            counts[status] = sum(o.status == status for o in self.outcomes)
        counts["simulated_fit"] = len(self.ranked())
        return counts

    def to_json(self) -> dict[str, Any]:
        s, ranked = self.space, self.ranked()
        best = ranked[0] if ranked else None
        rule = self.outcome_of(self.rule)
        return {
            "model": s.model.label, "world_size": s.world_size, "global_batch_size": s.global_batch_size,
            "seq_length": s.seq_length, "hardware": s.hardware.name, "dtype": s.dtype, "compute": s.compute_label,
            "overlap_p2p_comm": s.overlap_p2p_comm,
            "async_tp_backward": s.async_tp_backward, "tp_comm_overlap": s.tp_comm_overlap,
            "overlap_grad_reduce": s.overlap_grad_reduce, "counts": self.counts(), "traced_layouts": self.traced,
            "reused_traces": self.reused,
            "trace_seconds": self.trace_seconds, "simulate_seconds": self.simulate_seconds,
            "best": best.to_json() if best else None,
            "rule_of_thumb": rule.to_json() if rule else None,
            "rule_of_thumb_slowdown": (rule.iteration_s / best.iteration_s
                                       if rule and rule.status == "simulated" and best else None),
            "candidates": [o.to_json() for o in sorted(self.outcomes, key=lambda o: o.iteration_s)],
        }


def run_search(space: SearchSpace, output_dir: "str | Path", *, max_traced: int = 12, jobs: Optional[int] = None,
               progress: bool = True, say: Callable[[str], None] = lambda line: None) -> SearchResult:
    """Enumerate, prune and rank by estimate, trace ``max_traced`` (TP, PP, CP, micro-batch)
    shapes -- the best-estimated, the rule of thumb's among them (in place of the last) from two
    up -- and simulate their variants."""
    if max_traced < 1:
        raise SearchError(f"--max-traced must be at least 1, got {max_traced}")
    candidates = enumerate_candidates(space)
    if not candidates:
        raise SearchError(f"no layout of {space.model.label} on {space.world_size} GPUs splits a global batch of "
                          f"{space.global_batch_size}: check the fixed --tp/--pp/--cp/--micro-batch-size values and "
                          "that the global batch is a multiple of the data-parallel size")
    rule = rule_of_thumb(space)
    # the rule's micro-batch size 1 may be outside the searched ones, and with it its TP
    tps = {c.tp for c in candidates} | ({rule.tp} if rule else set())
    cost_models = {(tp, sp): space.cost_model_for(tp, sp) for tp in tps for sp in (False, True)}
    outcomes = []
    for c in candidates:
        e = estimate(space, c, cost_models)
        outcomes.append(Outcome(c, e, "estimated" if e.fits(space.hardware) and math.isfinite(e.iteration_s)
                                else "pruned"))
    kept = sorted((o for o in outcomes if o.status == "estimated"), key=lambda o: (o.estimate.iteration_s, o.candidate))
    if not kept:
        smallest = min(outcomes, key=lambda o: o.estimate.memory_bytes)
        raise SearchError(f"no layout fits {space.hardware.memory_gib:g} GiB per GPU: the smallest, "
                          f"{smallest.candidate.describe()}, needs {smallest.estimate.memory_bytes / 2**30:.1f} GiB; "
                          "use more GPUs, a shorter --seq-length or hardware with more memory")
    keys = _shapes_to_trace([o.candidate for o in kept], max_traced)
    if rule is not None and rule.trace_key not in keys and max_traced > 1:
        keys[max_traced - 1:] = [rule.trace_key]
    say(f"{len(candidates)} layouts: {len(candidates) - len(kept)} pruned by estimated memory; tracing the "
        f"{len(keys)} best-estimated shapes (TP, PP, micro-batch)")
    result = SearchResult(space, outcomes, rule)
    folders = _trace(space, keys, Path(output_dir) / "traces" / space.compute_label, cost_models, jobs, progress,
                     result)
    _simulate(space, result, folders, rule, progress, jobs)
    return result


def _shapes_to_trace(candidates: list[Candidate], count: int) -> list[tuple]:
    """The trace keys of the first ``count`` shapes of ``candidates`` (best-estimated first)."""
    return list(dict.fromkeys(c.trace_key for c in candidates))[:count]


def _trace(space: SearchSpace, keys: Iterable[tuple], folder: Path, cost_models: dict[tuple, CostModel], jobs,
           progress: bool, result: SearchResult) -> dict[tuple, Any]:
    """Trace each shape once (reusing a complete trace of the same config in ``folder``);
    returns key -> config folder, or key -> error line for a shape that failed."""
    out, todo = {}, {}
    for key in keys:
        config, training = trace_config(space, *key), space.training_options(*key[4:])
        existing = folder / config.folder_name(training)
        if _complete(existing, config):
            out[key] = existing
            result.reused += 1
        else:
            todo.setdefault(training, []).append((key, config))
    started = time.perf_counter()
    for training, shapes in todo.items():  # a batch per set of training options
        priced = {tp: model for (tp, sp), model in cost_models.items() if sp == training.sequence_parallel}
        results = run_batch([c for _, c in shapes], folder, shapes_only=True, dtype=space.dtype, training=training,
                            cost_model=lambda config: priced[config.tp], jobs=jobs, progress=progress,
                            timeline=False)  # nobody views the timelines of shapes a search tries
        if any(r.status == INTERRUPTED for r in results):  # a ranking of the shapes traced so far would mislead
            raise KeyboardInterrupt
        for (key, _), r in zip(shapes, results):
            out[key] = r.folder if r.status == "ok" else (r.error or "; ".join(r.reasons) or r.status)
    result.traced = sum(len(shapes) for shapes in todo.values())
    result.trace_seconds = time.perf_counter() - started
    return out


def _complete(folder: Path, config: TraceConfig) -> bool:
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    same = {k: summary.get(k) for k in ("world_size", "pp", "tp", "cp", "ep", "micro_batch_size",
                                        "num_microbatches", "global_batch_size", "seq_length", "model")}
    wanted = {k: v for k, v in config.to_dict().items() if k in same}
    return (summary.get("complete") is True and summary.get("status") == "ok" and same == wanted
            and summary.get("recording_revision") == RECORDING_REVISION)  # an older tracer recorded less


def _simulate(space: SearchSpace, result: SearchResult, folders: dict, rule: Optional[Candidate],
              progress: bool, jobs: Optional[int]) -> None:
    """Simulate every estimated variant of the traced shapes: one process per shape at a time
    (``jobs``, default one per core), which loads its traces once and derives each variant."""
    todo = [o for o in result.outcomes if o.candidate.trace_key in folders
            and (o.status == "estimated" or o.candidate == rule)]
    shapes: dict[tuple, list[Outcome]] = {}
    for o in todo:
        shapes.setdefault(o.candidate.trace_key, []).append(o)
    started = time.perf_counter()
    workers = max(1, min(jobs or available_cores(), len(shapes)))
    context = multiprocessing.get_context(rank_start_method())
    groups = list(shapes.values())
    calls = [(i, folders[key], [(o.candidate.recompute, o.candidate.distributed_optimizer) for o in outcomes],
              space.hardware) for i, (key, outcomes) in enumerate(shapes.items())]
    # a Pool, not a ProcessPoolExecutor: leaving it on an interrupt terminates the workers at once
    # instead of waiting for the shapes they are on
    with progress_bar(progress, sys.stderr) as bar, worker_pool(context, workers) as pool:
        task = bar.add_task("simulating layouts", total=len(todo))
        for i, simulated_variants in pool.imap_unordered(_simulate_numbered, calls):
            for o, (simulated, error) in zip(groups[i], simulated_variants):
                o.report, o.status, o.error = simulated, "simulated" if simulated is not None else "failed", error
            bar.advance(task, len(groups[i]))
    result.simulate_seconds = time.perf_counter() - started


def _simulate_numbered(call: tuple) -> tuple[int, list[tuple]]:
    number, *arguments = call
    return number, _simulate_shape(*arguments)


def _simulate_shape(folder, variants: list[tuple[str, bool]], hardware: Hardware) -> list[tuple]:
    """(report, None) or (None, the error's first line) of each (recompute, distributed
    optimizer) variant of the traces in ``folder`` (a path, or why tracing failed)."""
    if not isinstance(folder, Path):
        return [(None, f"tracing failed: {folder}")] * len(variants)
    try:
        job = load_job(folder)
    except (ValueError, RuntimeError, OSError) as error:
        return [(None, str(error).splitlines()[0])] * len(variants)
    out = []
    for recompute, distributed_optimizer in variants:
        try:
            derived = derive(job, recompute=recompute, distributed_optimizer=distributed_optimizer)
            out.append((report(simulate_job(derived, hardware, spans=False)), None))
        except (ValueError, RuntimeError, OSError) as error:
            out.append((None, str(error).splitlines()[0]))
    return out
