"""The methods ``bench step`` runs (its docstring names them): for each, every data-parallel
rank's per-stage plans and the tensors of its micro-batches, built from the same samples' tokens,
and what the cost model predicts for it."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_dynapipe.data.microbatches import gpt_microbatch, packed_microbatch
from megatron_dynapipe.planning.baselines import (fixed_length_baseline, megatron_dp_balanced_rows, megatron_plans,
                                                  megatron_thd_rows, thd_packing_rows, uniform_microbatches)
from megatron_dynapipe.planning.cost_model import StageCosts
from megatron_dynapipe.planning.documents import cut_documents
from megatron_dynapipe.planning.microbatching import pack_fixed_length, round_up
from megatron_dynapipe.planning.methods import METHODS as REGISTRY, fast_label
from megatron_dynapipe.planning.planner import generate_execution_plan
from megatron_dynapipe.planning.spec import TrainingSpec, packed_sample_multiple

#: the methods this benchmark runs, by the registry's names (the cut ones with --cut-documents)
RUNS = ("dynapipe", "dynapipe-varlen", "pad-to-max", "packing", "thd-whole", "dp_balanced", "thd", "dynapipe-cut")
# their labels, the rows of its report; DynaPipe also runs in fast mode
DYNAPIPE, VARLEN, PAD, PACK, THD_WHOLE, DP_BALANCED, THD, CUT = (REGISTRY[name].label for name in RUNS)
FAST = fast_label("dynapipe")
#: methods whose samples attend to each other: their losses differ by design
LEAKY = tuple(REGISTRY[name].label for name in RUNS if REGISTRY[name].leaky)
#: methods that train the documents cut: their losses agree with each other's
CUT_PIECES = tuple(REGISTRY[name].label for name in RUNS if REGISTRY[name].documents == "cut")


@dataclass(frozen=True)
class StepJob:
    """What ``bench step`` runs, checked before any work (``step_bench._checked``): the model,
    where and how it runs, the layout, and the cost model that plans and prices the methods."""

    model: Any  # ModelSpec
    device: str  # "cpu" or "cuda"
    packs: bool  # the attention core runs packed micro-batches: the packed methods run too
    dtype: str  # "fp32", "bf16" or "fp16"
    max_seq_length: int
    memory_limit_mb: float
    cost_model: Any  # priced on one rank of the context-parallel group
    pp: int
    chunks: int
    dp: int
    cp: int
    split: Any  # PipelineSplit: the first or last stage's own layers
    seed: int
    cost_model_name: str
    predicts: bool  # a cost model was given: its times are predictions for this device
    timeline: bool  # --chrome-trace: one more step of each method, every instruction timed
    cut: bool  # --cut-documents
    profile: Any = None  # the CP 1 cost model ``cost_model`` is split from
    pace: Any = None  # (points, timing) of the profile's layer the ranks time beside the steps (bench.pace), or None

    @property
    def layout(self) -> dict:
        """The layout as the report's settings give it."""
        return dict(pp=self.pp, chunks=self.chunks, dp=self.dp, cp=self.cp,
                    first_stage_layers=self.split.first_stage_layers, last_stage_layers=self.split.last_stage_layers)


@dataclass
class Method:
    """One way to run the global batch: per data-parallel rank its per-stage plans and its
    micro-batch tensors (numpy, pickled to the ranks), the cost model's predicted step time (the
    slowest data-parallel rank) and, for DynaPipe, the planning time."""
    plans: list  # [dp rank][stage] ExecutionPlan
    microbatches: list  # [dp rank] dict of numpy arrays per micro-batch
    predicted_ms: float
    #: the cost model's peak of activations (what a step adds to weights and gradients), fullest stage
    predicted_activations_mb: float
    planning_s: float | None = None


def build_methods(lengths: list[int], job: StepJob, args) -> dict[str, Method]:
    """Every method the job runs on ``lengths`` (``job``: bench step's checked settings), by label."""
    # built once, as a training job's data pipeline does: planning time is the planner's alone
    costs = stage_costs(job)
    spec = TrainingSpec(num_layers=costs.num_layers, pp=job.pp, dp=job.dp, chunks=job.chunks, cp=job.cp,
                        stage_layers=costs.layers, memory_limit_mb=job.memory_limit_mb, seed=args.seed,
                        seq_length=job.max_seq_length)
    tokens = _sample_tokens(lengths, job.model.vocab_size, args.seed)
    methods = {}
    planned = [(DYNAPIPE, False, "pad"), (FAST, True, "pad")] + ([(VARLEN, False, "varlen")] if job.packs else [])
    for name, fast, packing in planned:
        result = generate_execution_plan(lengths, dataclasses.replace(spec, packing=packing), costs, fast_mode=fast)
        microbatches = [[_tensors(tokens, mb, spec.cp) for mb in plans[0].microbatches] for plans in result.plans]
        methods[name] = Method(result.plans, microbatches, result.makespan_ms,
                               _activations_mb(result.peak_memory_mb, costs), result.planning_seconds)
    seq = job.max_seq_length
    # under CP a packed sample takes whole chunks of its row: the baselines pack with that room too
    sequences = pack_fixed_length(round_up(lengths, packed_sample_multiple(spec.cp)).tolist(), seq)
    methods[PAD] = _fixed_length_method([[i] for i in range(len(lengths))], tokens, seq, costs, spec)
    methods[PACK] = _fixed_length_method(sequences, tokens, seq, costs, spec)
    if job.packs:
        methods[THD_WHOLE] = _rows_method(thd_packing_rows(sequences, lengths, seq, costs, spec.memory_limit_mb,
                                                           spec.chunks), tokens, seq, costs, spec)
        try:
            balanced = megatron_dp_balanced_rows(lengths, seq, costs, spec.memory_limit_mb, spec.chunks, spec.cp)
        except ValueError as error:  # a batch Megatron-LM refuses to deal out too
            print(f"bench step: {DP_BALANCED} left out: {error}", file=sys.stderr)
        else:
            methods[DP_BALANCED] = _rows_method(balanced, tokens, seq, costs, spec)
    if job.packs and job.cut:
        methods.update(_cut_methods(lengths, tokens, spec, costs))
    return methods


def _cut_methods(lengths: list[int], tokens: list[np.ndarray], spec: TrainingSpec, costs: StageCosts) -> dict:
    """THD packing (of Megatron's windows) and DynaPipe varlen on their pieces: the documents cut as
    Megatron-LM's GPT data path cuts them, each piece a slice of its sample's tokens."""
    seq = spec.seq_length
    pieces = cut_documents(lengths, seq, packed_sample_multiple(spec.cp))
    piece_tokens = [tokens[s][a:a + n] for s, a, n in zip(pieces.sample.tolist(), pieces.start.tolist(),
                                                           pieces.tokens.tolist())]
    result = generate_execution_plan(lengths, dataclasses.replace(spec, packing="varlen", documents="cut"), costs,
                                     fast_mode=False)
    planned = Method(result.plans, [[_tensors(piece_tokens, mb, spec.cp) for mb in plans[0].microbatches]
                                    for plans in result.plans],
                     result.makespan_ms, _activations_mb(result.peak_memory_mb, costs), result.planning_seconds)
    windows = megatron_thd_rows(lengths, seq, costs, spec.memory_limit_mb, spec.chunks, spec.cp)
    return {THD: _rows_method(windows, piece_tokens, seq, costs, spec), CUT: planned}


def stage_costs(job: StepJob) -> StageCosts:
    """The job's cost model per pipeline stage: one row a virtual stage, priced on one rank of the
    context-parallel group; where stages are uneven, each with its layers as megatron-core builds
    them."""
    layers = job.model.num_layers
    stage_layers = tuple(job.split.chunk_layers(layers, job.pp, job.chunks)) if job.split.uneven else None
    return StageCosts(job.cost_model, num_layers=layers, pp=job.pp * job.chunks, dp=job.dp,
                      layers=stage_layers)


def _fixed_length_method(sequences: list[list[int]], tokens: list[np.ndarray], seq_len: int, costs, spec) -> Method:
    """Sequences of ``seq_len`` tokens (each the samples it lists, packed), dealt out in order to
    the data-parallel ranks as evenly as they go, each rank's run 1F1B (interleaved over the
    spec's chunks) with the micro-batch size and recompute the cost model finds fastest."""
    _check_feeds(sequences, seq_len, spec)
    best = fixed_length_baseline(len(sequences), seq_len, costs, spec.memory_limit_mb, spec.chunks)
    if best is None:
        raise _unfit(seq_len, spec)
    plans, tensors = [], []
    for mine in np.array_split(np.arange(len(sequences)), spec.dp):  # sizes differ by one at most
        micro = uniform_microbatches(len(mine), best.microbatch_size, seq_len)
        plans.append(megatron_plans(micro, best.recompute.label, spec.pp, spec.chunks))
        tensors.append([_packed([[tokens[i] for i in sequences[mine[s]]] for s in mb.samples], seq_len)
                        for mb in micro])
    return Method(plans, tensors, best.makespan_ms, _activations_mb(best.stage_peak_mb, costs))


def _rows_method(best, tokens: list[np.ndarray], seq_len: int, costs, spec) -> Method:
    """Megatron's packed rows (each sample attending to itself alone) as a baseline found them
    (``best``, a :class:`~megatron_dynapipe.planning.baselines.ThdRows`: THD packing's rows of k
    ``sequences``, or ``dp_balanced``'s packs), 1F1B (interleaved over the spec's chunks) with one
    recompute (packing's sequences fed every rank, checked before)."""
    if best is None:
        raise _unfit(seq_len, spec)
    plans = [megatron_plans(micro, best.recompute.label, spec.pp, spec.chunks) for micro in best.per_rank]
    return Method(plans, [[_tensors(tokens, mb, spec.cp) for mb in micro] for micro in best.per_rank],
                  best.makespan_ms, _activations_mb(best.stage_peak_mb, costs))


def _activations_mb(stage_peak_mb, costs: StageCosts) -> float:
    """The fullest stage's predicted peak less its model state: what a step allocates on top of the
    weights and gradients, as :func:`_memory_mb` measures it (a step benchmark makes no optimizer)."""
    return max(peak - costs.model_state_mb(stage) for stage, peak in enumerate(stage_peak_mb))


def _check_feeds(sequences: list, seq_len: int, spec) -> None:
    if len(sequences) < spec.dp:
        raise ValueError(f"{len(sequences)} sequences of {seq_len} tokens cannot feed --dp {spec.dp} ranks: "
                         "give more samples or lower --max-seq-length")


def _unfit(seq_len: int, spec) -> ValueError:
    return ValueError(f"not even one sequence of {seq_len} tokens fits --memory-limit {spec.memory_limit_mb:.0f} "
                      "MB by the cost model: raise the limit or lower --max-seq-length")


def _sample_tokens(lengths: list[int], vocab_size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, 1])
    return [rng.integers(0, vocab_size, n, dtype=np.int64) for n in lengths]


def _tensors(tokens: list[np.ndarray], mb, cp: int) -> dict[str, np.ndarray]:
    """The arrays of a planned micro-batch: its samples packed in one row (each in whole chunks of
    its ``cp`` ranks' split), or padded."""
    samples = [tokens[i] for i in mb.samples]
    if mb.packed:
        return packed_microbatch(samples, mb.seq_len, sample_multiple=packed_sample_multiple(cp))
    return gpt_microbatch(samples, mb.seq_len)


def _packed(rows: list[list[np.ndarray]], seq_len: int) -> dict[str, np.ndarray]:
    """GPT tensors of packed rows: each row's samples back to back, then padding; positions run
    through the row (Megatron's default), labels and loss mask are each sample's own."""
    out = gpt_microbatch([np.concatenate(row) for row in rows], seq_len)
    for r, row in enumerate(rows):
        own = packed_microbatch(row, seq_len)  # each sample's own labels and loss mask
        for key in ("labels", "loss_mask"):
            out[key][r] = own[key][0]
    return out
