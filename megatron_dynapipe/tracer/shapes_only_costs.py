"""How long a shapes-only rank's compute ops take: its stage's forward and backward under the
traced recompute, priced by a cost model (the default hardware's, :data:`DEFAULT_HARDWARE`,
unless one is given), per model chunk under interleaving."""

from __future__ import annotations

import math
from typing import Optional

from megatron_dynapipe.config.layout import ParallelLayout
from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.planning.cost_model import StageCosts, as_stage_costs, split_over_cp

__all__ = ["DEFAULT_HARDWARE", "compute_cost_fn", "backward_ms", "ring_blocks"]

#: the device shapes-only traces are priced for when neither a cost model nor a hardware is given
DEFAULT_HARDWARE = "a100"


def compute_cost_fn(cost_model, spec: ModelSpec, layout: ParallelLayout, stage: int, mbs: int, seq: int,
                    training: MegatronOptions, *, dtype: str = "bfloat16"):
    """``(cost(kind, microbatch, chunk) -> ms, the cost model)`` of this rank's compute ops.
    With interleaving a chunk is one of ``pp x chunks`` virtual stages (chunk c of stage s is
    virtual stage ``c pp + s``: the embedding in the very first, the head in the very last).
    ``recompute`` is what the traced recompute adds to a backward (a derived variant's
    recompute op); ``forward ring block`` and ``backward ring block`` one block of the
    context-parallel ring's attention in a layer (none at CP 1)."""
    if cost_model is None:
        from megatron_dynapipe.hardware import load_hardware
        cost_model = load_hardware(DEFAULT_HARDWARE).cost_model(spec, layout.tp, dtype)
    chunk_layers = training.chunk_layers(spec.num_layers, layout.pp)  # per virtual stage
    chunks = len(chunk_layers) // layout.pp
    model = as_stage_costs(cost_model, tp=layout.tp, num_layers=spec.num_layers, pp=layout.pp, dp=layout.dp,
                           hidden_size=spec.hidden_size, num_heads=spec.num_attention_heads,
                           ffn_hidden_size=spec.ffn_hidden_size, vocab_size=spec.vocab_size).model
    # the ring's transfers are traced ops, priced by the replay: the cost model prices its attention alone
    costs = StageCosts(split_over_cp(model, layout.cp, spec, ring_transfers=False), num_layers=spec.num_layers,
                       pp=layout.pp * chunks, dp=layout.dp, layers=tuple(chunk_layers))
    table = {}
    for chunk in range(chunks):
        virtual = chunk * layout.pp + stage
        backward = backward_ms(costs, virtual, mbs, seq, training, chunk_layers[virtual])
        table[chunk] = {
            "forward": float(costs.forward_ms(virtual, mbs, seq, "none")),
            "backward": backward,
            "recompute": backward - float(costs.backward_ms(virtual, mbs, seq, "none")),
            **{kind: float(ms) for kind, ms in ring_blocks(costs.model, mbs, seq).items()},
        }
        for kind, ms in table[chunk].items():
            if not math.isfinite(ms):
                raise ValueError(
                    f"cost model {getattr(costs.model, 'name', costs.model)!r} has no finite {kind} "
                    f"time for micro-batch {mbs} x {seq} tokens on stage {stage} (it does not "
                    "fit the profiled device); pass a smaller micro_batch_size/seq_length or another "
                    "cost model"
                )

    def cost(kind: str, microbatch: Optional[int], chunk: Optional[int]) -> float:
        return table[chunk or 0].get(kind, 0.0)

    return cost, model


def ring_blocks(model, mbs, seq) -> dict:
    """``{"forward ring block": ms, "backward ring block": ms}`` of a model split over a
    context-parallel group (:meth:`~megatron_dynapipe.planning.cost_model.ContextParallelCostModel.ring_block_ms`),
    none where it is not; ``mbs`` and ``seq`` scalars or arrays."""
    if not hasattr(model, "ring_block_ms"):
        return {}
    return {f"{phase} ring block": model.ring_block_ms(phase, mbs, seq) for phase in ("forward", "backward")}


def backward_ms(costs, stage: int, mbs: int, seq: int, training: MegatronOptions, chunk_layers: int) -> float:
    """A micro-batch's backward through one model chunk of ``chunk_layers`` layers (the whole
    stage without interleaving) with the recompute asked for: the cost model's selective or full
    price, and for full recompute of some of the chunk's layers (``block``) that share of the
    difference between full and none."""
    if training.recompute_granularity == "selective":
        return float(costs.backward_ms(stage, mbs, seq, "selective"))
    none = float(costs.backward_ms(stage, mbs, seq, "none"))
    recomputed = training.recomputed_layers(chunk_layers)
    if not recomputed:
        return none
    return none + (float(costs.backward_ms(stage, mbs, seq, "full")) - none) * recomputed / chunk_layers
