"""Recompute and distributed-optimizer variants of a traced layout, derived from its trace.

The tracer records a layout as megatron-core runs it without activation recomputation and
with the plain (all-reduce) data-parallel optimizer.  A layout search weighs both choices on
every layout; tracing each combination separately would multiply its tracing time by six.
:func:`derive` instead rewrites the traces the way Megatron's schedule changes with each choice:

* **full recompute** (``--recompute-granularity full``, uniform, one layer a checkpoint) runs
  each micro-batch's forward again right before its backward: the stage's forward op and the
  tensor-parallel communication nested in it are repeated there.  Each layer keeps only its
  input (``2 s b h`` bytes).
* **selective recompute** (``--recompute-granularity selective``) recomputes the attention core
  before the backward: a compute op of the forward's time times the attention core's share of
  the layer FLOPs.  Layers no longer keep the ``5 a s / (h t)`` term (Korthikanti et al. 2022).
* **distributed optimizer** (``--use-distributed-optimizer``, ZeRO-1): each data-parallel
  gradient all-reduce becomes a reduce-scatter of the same buffer, and after the optimizer step
  every bucket's parameters are all-gathered (16-bit, so half the bytes of fp32 gradients).
  Adam's states and fp32 master weights are sharded over DP.

Activation memory is the traced peak less what recomputation frees in every layer in flight, plus
what the layer being recomputed holds again; what a layer frees is measured by the tracer (what
one layer, its input and its attention core save for backward), so the unfused local attention
core and a fused kernel each free what they really hold.  Model state follows the trace's own
breakdown.
Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses

from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.planning.cost_model import MB, AnalyticalCostModel, StageCosts, gpt_shape
from megatron_dynapipe.simulate.traced_job import TracedJob
from megatron_dynapipe.tracer.trace_format import DTYPE_BYTES, RankTrace, TraceOp, subtrees

__all__ = ["RECOMPUTE_CHOICES", "derive"]

RECOMPUTE_CHOICES = ("none", "selective", "full")


def derive(job: TracedJob, *, recompute: str = "none", distributed_optimizer: bool = False) -> TracedJob:
    """``job`` as it would run with ``recompute`` and ``distributed_optimizer``."""
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute {recompute!r}: use one of {', '.join(RECOMPUTE_CHOICES)}")
    traced = traced_choices(job)
    if traced != ("none", False):
        raise ValueError(f"{job.folder}: the trace already runs recompute={traced[0]}, distributed optimizer="
                         f"{traced[1]}; derive variants from a trace without either")
    if recompute == "none" and not distributed_optimizer:
        return job
    iteration = {**job.iteration, "recompute_granularity": None if recompute == "none" else recompute,
                 "ddp": {**(job.iteration.get("ddp") or {}), "use_distributed_optimizer": distributed_optimizer}}
    costs = _analytical(job)
    traces = {rank: _derive_trace(job, costs, trace, recompute, distributed_optimizer, iteration)
              for rank, trace in job.traces.items()}
    return dataclasses.replace(job, traces=traces, iteration=iteration)


def traced_choices(job: TracedJob) -> tuple[str, bool]:
    """The (recompute, distributed optimizer) ``job`` runs: as traced, or as a variant derived."""
    ddp = job.iteration.get("ddp") or {}
    return str(job.iteration.get("recompute_granularity") or "none"), bool(ddp.get("use_distributed_optimizer"))


def _derive_trace(job: TracedJob, costs: StageCosts, trace: RankTrace, recompute: str, distributed_optimizer: bool,
                  iteration: dict) -> RankTrace:
    ops = list(trace.ops)
    if recompute != "none":
        ops = _with_recompute(ops, recompute, costs.model.attention_core_share(_seq(job)))
    if distributed_optimizer:
        ops = _with_distributed_optimizer(ops, job.dtype)
    memory = _memory(job, costs, trace, recompute, distributed_optimizer)
    return dataclasses.replace(trace, ops=ops, memory=memory, iteration=iteration)


# -- recompute ------------------------------------------------------------------------------


def _with_recompute(ops: list[TraceOp], recompute: str, share: float) -> list[TraceOp]:
    trees = subtrees(ops)
    # a micro-batch's pass through one model chunk (one per stage without interleaving)
    forwards = {(op.iteration, op.microbatch, op.chunk): op for op in ops
                if op.parent is None and op.cat == "compute" and op.kind == "forward"}
    next_seq = max((op.seq for op in ops), default=-1) + 1
    out: list[TraceOp] = []
    for op in ops:
        forward = forwards.get((op.iteration, op.microbatch, op.chunk))
        if op.parent is None and op.cat == "compute" and op.kind == "backward" and forward is not None:
            if recompute == "full":
                clone = trees[forward.seq]
            else:
                clone = [dataclasses.replace(forward, dur_us=forward.dur_us * share)]
            renumbered = {old.seq: next_seq + i for i, old in enumerate(clone)}
            next_seq += len(clone)
            out.extend(dataclasses.replace(c, seq=renumbered[c.seq], phase="backward",
                                           kind="recompute" if c.parent is None else c.kind,
                                           parent=renumbered.get(c.parent) if c.parent is not None else None)
                       for c in clone)
        out.append(op)
    return out


# -- distributed optimizer ----------------------------------------------------------------------


def _is_grad_sync(op: TraceOp) -> bool:
    return op.kind == "all_reduce" and op.name.endswith("start_grad_sync")


def _with_distributed_optimizer(ops: list[TraceOp], dtype: str) -> list[TraceOp]:
    next_seq = max((op.seq for op in ops), default=-1) + 1
    gathers: list[TraceOp] = []
    out: list[TraceOp] = []
    for op in ops:
        if _is_grad_sync(op):
            out.append(dataclasses.replace(op, kind="reduce_scatter"))
            grad_bytes = DTYPE_BYTES.get(op.dtype or "float32", 4)
            gathers.append(dataclasses.replace(
                op, kind="all_gather", name="distributed_optimizer.start_param_sync", phase="optimizer_step",
                parent=None, microbatch=None, dtype=dtype, dur_us=0.0,
                bytes=op.bytes * DTYPE_BYTES.get(dtype, 2) // grad_bytes))
        else:
            out.append(op)
    # the parameters are gathered once the optimizer step (and what it issued) is done
    end = max((i for i, op in enumerate(out) if op.phase == "optimizer_step"), default=len(out) - 1) + 1
    gathered = [dataclasses.replace(g, seq=next_seq + i) for i, g in enumerate(gathers)]
    return out[:end] + gathered + out[end:]


# -- memory ---------------------------------------------------------------------------------------


def _analytical(job: TracedJob) -> StageCosts:
    """The analytical cost model of ``job``'s GPT at its TP, seen over its pipeline stages."""
    m = job.model
    model = AnalyticalCostModel(**gpt_shape(m, job.layout.tp))
    return StageCosts(model, num_layers=m.num_layers, pp=job.layout.pp)


def _seq(job: TracedJob) -> int:
    """Tokens of a sequence on one context-parallel rank."""
    return int(job.iteration["seq_length"]) // job.layout.cp


def _memory(job: TracedJob, costs: StageCosts, trace: RankTrace, recompute: str, distributed_optimizer: bool) -> dict:
    memory = dict(trace.memory)
    detail = dict(memory.get("model_state_detail") or {})
    state = int(memory.get("model_state_bytes") or 0)
    if distributed_optimizer and "optimizer" in detail:
        sharded = -(-int(detail["optimizer"]) // job.layout.dp)
        state += sharded - int(detail["optimizer"])
        detail["optimizer"] = sharded
    activation = float(memory.get("activation_peak_bytes") or 0)
    if recompute != "none":
        activation = _recomputed_activation(job, costs, trace, activation, recompute)
    memory.update(model_state_bytes=state, model_state_detail=detail, activation_peak_bytes=int(activation),
                  peak_bytes=int(state + activation), method=f"{memory.get('method', 'traced')}, derived: "
                  f"recompute {recompute}, distributed optimizer {'on' if distributed_optimizer else 'off'}")
    return memory


def _recomputed_activation(job: TracedJob, costs: StageCosts, trace: RankTrace, activation: float,
                           recompute: str) -> float:
    """The traced activations less what recomputation frees in the layers of the micro-batches in
    flight, plus what the layer being recomputed holds again during its backward (the embedding and
    the LM head keep what they traced)."""
    layer, layer_input, core, core_input = _layer_activation_bytes(job, costs, trace)
    freed = layer - layer_input if recompute == "full" else core - core_input
    training = MegatronOptions(**job.training)
    chunks = training.rank_chunk_layers(job.model.num_layers, job.layout.pp, trace.stage)
    # the meter counts passes through a chunk, each holding a chunk's layers
    passes = int(trace.memory.get("peak_in_flight_microbatches") or 1)
    layers_in_flight = passes * sum(chunks) / len(chunks)
    return max(activation - layers_in_flight * freed, 0.0) + freed


def _layer_activation_bytes(job: TracedJob, costs: StageCosts, trace: RankTrace) -> tuple[float, ...]:
    """What one transformer layer saves for backward in a micro-batch and its input, what its
    attention core saves and the core's query, key and value: as the tracer measured them
    (``activation_probe_bytes``), else by the analytical model's per-layer formulas (Korthikanti
    et al. 2022, which count no core input apart), for traces without them."""
    probes = trace.memory.get("activation_probe_bytes") or {}
    names = ("transformer_layer", "layer_input", "core_attention", "core_attention_input")
    if set(names) <= probes.keys():
        return tuple(float(probes[name]) for name in names)
    seq, mbs = _seq(job), int(job.iteration["micro_batch_size"])
    stored = {rc: costs.model.activation_mb("stored", rc, mbs, seq) * MB for rc in RECOMPUTE_CHOICES}
    return stored["none"], stored["full"], stored["none"] - stored["selective"], 0.0
