"""Tensor parallelism's collectives seen from one rank: what they add to a micro-batch's parts.

A cost model measured or computed for one TP rank prices its compute alone (a profile times the
layer on a fake process group). A Megatron layer also runs collectives on its TP group, each of
the rank's whole ``[tokens, hidden]`` activations (``tokens``: a micro-batch's rows on this rank of a
context-parallel group), as a trace of megatron-core records them:

* without sequence parallelism, two all-reduces a layer forward (after the attention's and the
  MLP's row-parallel projections) and two backward (the column-parallel inputs' gradients); the
  embedding's forward all-reduce and the LM head's backward one;
* with it, two all-gathers and two reduce-scatters a layer forward, and backward four all-gathers
  (two of them the inputs gathered again for the weights' gradients) and two reduce-scatters; the
  embedding all-reduces forward and gathers backward; the head gathers forward, and gathers and
  reduce-scatters backward;
* the vocab-parallel loss all-reduces three values a token (fp32) forward;
* full recompute runs a layer's forward collectives again in its backward; selective recompute
  runs only the attention core again, which has none.

Without ``--tp-comm-overlap`` a rank waits for each (they sit between the GEMMs), so a part's time
is its compute plus its collectives. With it, transformer-engine runs the all-gathers and
reduce-scatters beside the GEMMs next to them: a part takes the longer of its compute and those,
plus its all-reduces (as the replay prices a traced pass, :mod:`megatron_dynapipe.simulate.replay`).

The planner plans with these in; a shapes-only trace records the collectives as ops of their own,
so its compute ops are priced by the model without them. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from megatron_dynapipe.planning.cost_model.base import TIMED, CostModel, as_recompute
from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["TensorParallelCollectives", "tp_collectives"]

#: ``(layer, phase, sequence_parallel)`` -> ``{kind: count}`` of the collectives of one micro-batch's
#: activations, before recompute (module docstring)
ACTIVATION_COLLECTIVES = {
    ("encoder", "forward", False): {"all_reduce": 2},
    ("encoder", "backward", False): {"all_reduce": 2},
    ("preprocess", "forward", False): {"all_reduce": 1},
    ("preprocess", "backward", False): {},
    ("postprocess", "forward", False): {},
    ("postprocess", "backward", False): {"all_reduce": 1},
    ("encoder", "forward", True): {"all_gather": 2, "reduce_scatter": 2},
    ("encoder", "backward", True): {"all_gather": 4, "reduce_scatter": 2},
    ("preprocess", "forward", True): {"all_reduce": 1},
    ("preprocess", "backward", True): {"all_gather": 1},
    ("postprocess", "forward", True): {"all_gather": 1},
    ("postprocess", "backward", True): {"all_gather": 1, "reduce_scatter": 1},
}
#: all-reduces of the vocab-parallel loss's forward, each of one fp32 value a token
LOSS_ALL_REDUCES, LOSS_BYTES_PER_TOKEN = 3, 4.0
#: the collectives transformer-engine overlaps with GEMMs under --tp-comm-overlap
OVERLAPPED_KINDS = ("all_gather", "reduce_scatter")

#: ``collective_ms(kind, nbytes)``: ms of one collective of ``kind`` on the TP group (``nbytes`` as
#: nccl-tests counts it, an array of them elementwise)
CollectiveMs = Callable[[str, object], object]


class TensorParallelCollectives(CostModel):
    """``model``'s times with its TP group's collectives added (module docstring); everything else
    is ``model``'s."""

    def __init__(self, model: CostModel, collective_ms: CollectiveMs, *, sequence_parallel: bool = False,
                 overlap: bool = False):
        if overlap and not sequence_parallel:
            raise ValueError("--tp-comm-overlap overlaps sequence parallelism's collectives: it needs "
                             "sequence_parallel")
        self.model, self.collective_ms = model, collective_ms
        self.sequence_parallel, self.overlap = bool(sequence_parallel), bool(overlap)
        self.tp, self.hidden_size, self.cp = model.tp, model.hidden_size, model.cp
        self.name, self.metadata = model.name, model.metadata
        self.microbatch_overhead = model.microbatch_overhead
        self.prices_attention_core = model.prices_attention_core

    def describe(self) -> str:
        how = "reduce-scatters and all-gathers" if self.sequence_parallel else "all-reduces"
        return f"{self.model.describe()}, with TP {self.tp}'s {how}" + (" overlapped" if self.overlap else "")

    def __repr__(self) -> str:
        return (f"TensorParallelCollectives({self.model!r}, sequence_parallel={self.sequence_parallel}, "
                f"overlap={self.overlap})")

    # -- time ---------------------------------------------------------------------------------
    def collectives_ms(self, layer: str, phase: str, recompute, mbs, seqlen) -> tuple:
        """(what a rank waits for, what runs beside the part's compute) of one micro-batch's part:
        ms of its collectives, split by whether --tp-comm-overlap hides them."""
        rc = as_recompute(recompute)
        tokens = self.model.tokens_per_rank(mbs, seqlen)
        counts = dict(ACTIVATION_COLLECTIVES[layer, phase, self.sequence_parallel])
        if layer == "encoder" and phase == "backward" and rc == RecomputeType.FULL:
            for kind, n in ACTIVATION_COLLECTIVES["encoder", "forward", self.sequence_parallel].items():
                counts[kind] = counts.get(kind, 0) + n
        activations = tokens * (self.hidden_size * self.model.activation_bytes)
        waited, beside = 0.0, 0.0
        for kind, n in counts.items():
            ms = n * self.collective_ms(kind, activations)
            if self.overlap and kind in OVERLAPPED_KINDS:
                beside = beside + ms
            else:
                waited = waited + ms
        if layer == "postprocess" and phase == "forward":
            waited = waited + LOSS_ALL_REDUCES * self.collective_ms("all_reduce", tokens * LOSS_BYTES_PER_TOKEN)
        return waited, beside

    def _with_collectives(self, layer, phase, recompute, mbs, seqlen, compute):
        waited, beside = self.collectives_ms(layer, phase, recompute, mbs, seqlen)
        return np.maximum(compute, beside) + waited if self.overlap else compute + waited

    def layer_ms(self, layer, phase, recompute, mbs, seqlen):
        compute = self.model.layer_ms(layer, phase, recompute, mbs, seqlen)
        total = self._with_collectives(layer, phase, recompute, mbs, seqlen, compute)
        return float(total) if np.ndim(total) == 0 else np.asarray(total, dtype=float)

    def shape_costs(self, types, mbs, seqlen) -> np.ndarray:
        """The inner model's answers (one call), each part's collectives added to its times."""
        types = tuple(map(as_recompute, types))
        costs = np.array(self.model.shape_costs(types, mbs, seqlen), dtype=float)
        for row, rc in enumerate(types):
            for k, (layer, phase) in enumerate(TIMED):
                costs[row, k] = self._with_collectives(layer, phase, rc, mbs, seqlen, costs[row, k])
        return costs

    def attention_core_ms(self, phase, recompute, mbs, seqlen):
        return self.model.attention_core_ms(phase, recompute, mbs, seqlen)  # the core runs no TP collective

    def segment_ms(self, phase, recompute):
        return self.model.segment_ms(phase, recompute)

    def microbatch_overhead_ms(self, phase, mbs, seqlen, layers):
        return self.model.microbatch_overhead_ms(phase, mbs, seqlen, layers)

    def no_time_fix(self) -> str:
        return self.model.no_time_fix()

    def packed(self) -> "TensorParallelCollectives":
        inner = self.model.packed()
        if inner is self.model:
            return self
        return TensorParallelCollectives(inner, self.collective_ms, sequence_parallel=self.sequence_parallel,
                                         overlap=self.overlap)

    # -- memory: the inner model's ----------------------------------------------------------------
    def activation_mb(self, kind, recompute, mbs, seqlen):
        return self.model.activation_mb(kind, recompute, mbs, seqlen)

    def logits_mb(self, kind, mbs, seqlen):
        return self.model.logits_mb(kind, mbs, seqlen)

    def param_mb(self, layer):
        return self.model.param_mb(layer)

    def vocab_per_rank(self) -> float:
        return self.model.vocab_per_rank()

    def tokens_per_rank(self, mbs, seqlen):
        return self.model.tokens_per_rank(mbs, seqlen)

    @property
    def activation_dtype(self) -> str:
        return self.model.activation_dtype


def tp_collectives(model: CostModel, collective_ms: CollectiveMs, *, sequence_parallel: bool = False,
                   overlap: bool = False) -> CostModel:
    """``model`` with its TP group's collectives priced by ``collective_ms``; ``model`` itself at TP 1."""
    if model.tp == 1:
        return model
    return TensorParallelCollectives(model, collective_ms, sequence_parallel=sequence_parallel, overlap=overlap)
