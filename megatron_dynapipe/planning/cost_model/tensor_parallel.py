"""Tensor parallelism's collectives seen from one rank: what they add to a micro-batch's parts.

A cost model measured or computed for one TP rank prices its compute alone (a profile times the
layer on a fake process group). A Megatron layer also runs collectives on its TP group, each of
the rank's whole ``[tokens, hidden]`` activations (``tokens``: a micro-batch's rows on this rank of a
context-parallel group), as a trace of megatron-core records them (:data:`ACTIVATION_COLLECTIVES`):

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

Some of them run beside a GEMM of the same layer (:func:`exposed_ms`; docs/cost_model.md, "Beside
which GEMM"), and a part waits only for what outlasts it:

* a column-parallel linear's backward (QKV, FC1, the head) launches the input's re-gather beside
  the input-gradient GEMM and the input gradient's all-reduce or reduce-scatter beside the
  weight-gradient GEMM, asynchronously (megatron-core's and transformer-engine's linears alike;
  ``async_backward``);
* with ``--tp-comm-overlap`` transformer-engine's userbuffers also split the layer's other
  all-gathers into a ring exchange under the GEMM they feed (the forward's QKV and FC1 inputs, the
  backward's gradients into the attention projection and FC2) and pipeline the forward's
  reduce-scatters in :data:`PIPELINE_SPLITS` chunks after the GEMM that makes them; the QKV's and
  FC1's backward collectives become its bulk overlaps. A bulk or pipelined overlap takes
  :data:`UB_SMS` SMs, and the GEMM beside it runs on the others (the ring exchange moves its chunks
  with the copy engines); the head is megatron-core's own linear, and its forward gather waits;
* everything else waits: the all-reduces of the row-parallel outputs, the embedding's, the loss's.

Pricing a GEMM needs the device's kernels (:class:`LinearGemms`, from a hardware file's roofline);
without them every collective waits. The planner plans with these in; a shapes-only trace records
the collectives as ops of their own, and the replay prices each by the same function,
:func:`collective_exposed_ms` (:func:`label_pass` tells which linear's it is). Nothing here imports torch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from megatron_dynapipe.planning.cost_model.base import TIMED, CostModel, as_recompute
from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["TensorParallelCollectives", "LinearGemms", "tp_collectives", "exposed_ms", "collective_exposed_ms",
           "label_pass"]

#: how a collective runs beside its GEMM (:func:`exposed_ms`)
WAITED, BESIDE, BULK, RING_EXCHANGE, PIPELINED = "waited", "beside", "bulk", "ring exchange", "pipelined"
#: chunks of transformer-engine's pipelined reduce-scatter (its default for the row-parallel forward)
PIPELINE_SPLITS = 4
#: SMs transformer-engine's default userbuffers configuration gives a bulk or pipelined overlap
#: (``num_sm``), which the GEMM beside it leaves free (``set_sm_margin``: it runs on the device's
#: SMs less these); a ring exchange takes one and leaves the GEMM all of them
UB_SMS = 16
TAKE_SMS = (BULK, PIPELINED)
#: linears split by their output's columns (a backward re-gathers the input and reduces its gradient),
#: by their input's rows, and the ones transformer-engine builds with --tp-comm-overlap
COLUMN_LINEARS, ROW_LINEARS, TE_LINEARS = ("qkv", "fc1", "head"), ("proj", "fc2"), ("qkv", "proj", "fc1", "fc2")

#: ``(layer, phase, sequence_parallel)`` -> one micro-batch's collectives of its activations in
#: issue order, before recompute (module docstring): ``(kind, linear, GEMM)``, where ``linear`` is the
#: one that issues it (or ``embedding``) and ``GEMM`` the pass of it the collective can run beside
#: (``fprop``, ``dgrad``: the input's gradient, ``wgrad``: the weight's; None: none)
ACTIVATION_COLLECTIVES = {
    ("encoder", "forward", False): (("all_reduce", "proj", None), ("all_reduce", "fc2", None)),
    ("encoder", "backward", False): (("all_reduce", "fc1", "wgrad"), ("all_reduce", "qkv", "wgrad")),
    ("preprocess", "forward", False): (("all_reduce", "embedding", None),),
    ("preprocess", "backward", False): (),
    ("postprocess", "forward", False): (),
    ("postprocess", "backward", False): (("all_reduce", "head", "wgrad"),),
    ("encoder", "forward", True): (("all_gather", "qkv", "fprop"), ("reduce_scatter", "proj", "fprop"),
                                   ("all_gather", "fc1", "fprop"), ("reduce_scatter", "fc2", "fprop")),
    ("encoder", "backward", True): (("all_gather", "fc2", "dgrad"), ("all_gather", "fc1", "dgrad"),
                                    ("reduce_scatter", "fc1", "wgrad"), ("all_gather", "proj", "dgrad"),
                                    ("all_gather", "qkv", "dgrad"), ("reduce_scatter", "qkv", "wgrad")),
    ("preprocess", "forward", True): (("all_reduce", "embedding", None),),
    ("preprocess", "backward", True): (("all_gather", "embedding", None),),
    ("postprocess", "forward", True): (("all_gather", "head", "fprop"),),
    ("postprocess", "backward", True): (("all_gather", "head", "dgrad"), ("reduce_scatter", "head", "wgrad")),
}
#: all-reduces of the vocab-parallel loss's forward, each of one fp32 value a token
LOSS_ALL_REDUCES, LOSS_BYTES_PER_TOKEN = 3, 4.0

#: ``collective_ms(kind, nbytes)``: ms of one collective of ``kind`` on the TP group (``nbytes`` as
#: nccl-tests counts it, an array of them elementwise)
CollectiveMs = Callable[[str, object], object]


def exposed_ms(how: str, comm, gemm, tp: int):
    """What a collective of ``comm`` ms adds to its pass when it runs ``how`` beside a GEMM of
    ``gemm`` ms, the GEMM's time beside it (arrays broadcast; what the SMs a collective takes from
    the GEMM add, :func:`collective_exposed_ms` adds):

    * ``waited``: all of it;
    * ``beside`` (launched asynchronously with the GEMM) and ``bulk`` (userbuffers' overlap of one
      whole collective with the GEMM): what outlasts the GEMM;
    * ``ring exchange`` (an all-gather in ``tp`` chunks, each GEMM chunk on the one received before,
      the first on the rank's own): ``tp - 1`` steps of ``comm / (tp - 1)`` under GEMM chunks of
      ``gemm / tp``, so what outlasts ``(tp - 1) / tp`` of the GEMM;
    * ``pipelined`` (a reduce-scatter of each of ``PIPELINE_SPLITS`` chunks after its GEMM chunk):
      the last chunk's, and each other's excess over the next GEMM chunk."""
    if how == WAITED:
        return comm
    if how in (BESIDE, BULK):
        return np.maximum(comm - gemm, 0.0)
    if how == RING_EXCHANGE:
        return np.maximum(comm - gemm * (tp - 1) / tp, 0.0)
    if how == PIPELINED:
        n = PIPELINE_SPLITS
        return comm / n + (n - 1) / n * np.maximum(comm - gemm, 0.0)
    raise ValueError(f"unknown overlap {how!r}")


def overlap_of(linear: str, gemm: Optional[str], *, tp_comm_overlap: bool, async_backward: bool = True) -> str:
    """How the collective ``linear`` issues beside its ``gemm`` runs (module docstring)."""
    if gemm is None:
        return WAITED
    if linear in COLUMN_LINEARS and gemm in ("dgrad", "wgrad"):
        if tp_comm_overlap and linear in TE_LINEARS:
            return BULK
        return BESIDE if async_backward else WAITED
    if tp_comm_overlap and linear in TE_LINEARS:
        return PIPELINED if linear in ROW_LINEARS and gemm == "fprop" else RING_EXCHANGE
    return WAITED


def collective_exposed_ms(comm, entry: tuple, tokens, gemms: "Optional[LinearGemms]", tp: int, *,
                          tp_comm_overlap: bool, async_backward: bool = True):
    """What one collective of ``comm`` ms adds to its pass: ``entry`` is its item of
    :data:`ACTIVATION_COLLECTIVES`, ``tokens`` the rows of its GEMM, which ``gemms`` prices (None:
    the device's kernels are unknown, and it is waited for); where the overlap takes SMs, the GEMM
    runs longer on the rest, and that adds too. The planner and the replay both ask."""
    _, linear, gemm = entry
    how = overlap_of(linear, gemm, tp_comm_overlap=tp_comm_overlap, async_backward=async_backward)
    if how == WAITED or gemms is None:
        return comm
    alone = gemms.ms(linear, gemm, tokens)
    if how not in TAKE_SMS:
        return exposed_ms(how, comm, alone, tp)
    beside = gemms.ms(linear, gemm, tokens, sms_taken=True)
    return exposed_ms(how, comm, beside, tp) + (beside - alone)


@dataclass(frozen=True)
class LinearGemms:
    """The GEMMs of a GPT layer's TP-split linears on one rank: ``gemm_ms(m, n, k)`` is a device's
    (``DeviceRoofline.gemm_ms``, arrays broadcast), ``beside_ub_ms`` the same on the SMs a bulk
    or pipelined userbuffers overlap leaves (:data:`UB_SMS`), ``widths`` each linear's share of its
    split dimension on this rank (a column-parallel linear's output, a row-parallel one's input)."""

    gemm_ms: Callable
    beside_ub_ms: Callable
    hidden: int
    widths: Mapping[str, float]

    @classmethod
    def of(cls, spec, tp: int, gemm_ms: Callable, beside_ub_ms: Callable) -> "LinearGemms":
        """Those of GPT ``spec`` (a ModelSpec) at ``tp``."""
        q, kv = spec.num_attention_heads * spec.head_dim, spec.query_groups * spec.head_dim
        up = 2 * spec.ffn_hidden_size if spec.swiglu else spec.ffn_hidden_size
        widths = {"qkv": (q + 2 * kv) / tp, "proj": q / tp, "fc1": up / tp, "fc2": spec.ffn_hidden_size / tp,
                  "head": spec.padded_vocab_size(tp) / tp}
        return cls(gemm_ms, beside_ub_ms, spec.hidden_size, widths)

    @classmethod
    def on(cls, spec, tp: int, roofline) -> "LinearGemms":
        """Those of GPT ``spec`` at ``tp`` on a device's roofline (a ``DeviceRoofline``)."""
        return cls.of(spec, tp, roofline.gemm_ms, roofline.without_sms(UB_SMS).gemm_ms)

    def ms(self, linear: str, gemm: str, tokens, sms_taken: bool = False):
        """ms of ``linear``'s ``gemm`` over ``tokens`` rows (beside an overlap that takes
        :data:`UB_SMS` SMs where ``sms_taken``): the forward ``(m x k) @ (k x n)``, the input's
        gradient ``(m x n) @ (n x k)``, the weight's ``(k x m) @ (m x n)``."""
        width = self.widths[linear]
        m, n, k = (tokens, width, self.hidden) if linear in COLUMN_LINEARS else (tokens, self.hidden, width)
        gemm_ms = self.beside_ub_ms if sms_taken else self.gemm_ms
        return gemm_ms(*{"fprop": (m, n, k), "dgrad": (m, k, n), "wgrad": (k, n, m)}[gemm])


#: megatron-core's call sites of the TP collectives as a trace names them: (the direction of the pass
#: that issues them, whether a column-parallel linear does)
CALL_SITES = {"layers.forward": ("forward", True), "layers.backward": ("backward", True),
              "mappings._reduce": ("forward", False), "mappings._reduce_scatter_along_first_dim": ("forward", False),
              "mappings._gather_along_first_dim": ("backward", False)}


def label_pass(calls: Sequence[tuple[str, str]], sequence_parallel: bool) -> list:
    """Which of :data:`ACTIVATION_COLLECTIVES` each of a traced pass's TP collectives is: ``calls``
    are their ``(kind, call site)`` in issue order. Per call site and kind they come in layers (a
    backward pass's recomputed forward too) with the embedding's or head's first or last; an item is
    None where the call site is not a dense layer's or the count does not fit."""
    streams: dict[tuple, list[int]] = defaultdict(list)
    for index, (kind, site) in enumerate(calls):
        if site in CALL_SITES:
            streams[(*CALL_SITES[site], kind)].append(index)
    labels: list = [None] * len(calls)
    for (direction, column, kind), indices in streams.items():
        for index, entry in zip(indices, _stream(direction, column, kind, sequence_parallel, len(indices))):
            labels[index] = entry
    return labels


def _stream(direction: str, column: bool, kind: str, sequence_parallel: bool, count: int) -> list:
    """The ``count`` collectives of one call site and kind in a pass: whole layers' (the encoder's
    entries of that site and kind, in order), the embedding's or head's before (a forward's
    embedding, a backward's head) or after them; [] where ``count`` fits no such sequence."""
    def mine(layer):
        return [e for e in ACTIVATION_COLLECTIVES[layer, direction, sequence_parallel]
                if e[0] == kind and (e[1] in COLUMN_LINEARS) == column]
    first, last = ("preprocess", "postprocess") if direction == "forward" else ("postprocess", "preprocess")
    cycle, before, after = mine("encoder"), mine(first), mine(last)
    for head, tail in ((before, after), (before, []), ([], after), ([], [])):
        layers = count - len(head) - len(tail)
        if layers == 0 or (cycle and layers > 0 and layers % len(cycle) == 0):
            return head + cycle * (layers // len(cycle) if cycle else 0) + tail
    return []


class TensorParallelCollectives(CostModel):
    """``model``'s times with its TP group's collectives added, each what it exposes beside its
    GEMM where ``gemms`` prices them (module docstring); everything else is ``model``'s."""

    def __init__(self, model: CostModel, collective_ms: CollectiveMs, *, sequence_parallel: bool = False,
                 overlap: bool = False, gemms: Optional[LinearGemms] = None, async_backward: bool = True):
        if overlap and not sequence_parallel:
            raise ValueError("--tp-comm-overlap overlaps sequence parallelism's collectives: it needs "
                             "sequence_parallel")
        self.model, self.collective_ms, self.gemms = model, collective_ms, gemms
        self.sequence_parallel, self.overlap = bool(sequence_parallel), bool(overlap)
        self.async_backward = bool(async_backward)
        self.tp, self.hidden_size, self.cp = model.tp, model.hidden_size, model.cp
        self.name, self.metadata = model.name, model.metadata
        self.microbatch_overhead = model.microbatch_overhead
        self.prices_attention_core = model.prices_attention_core

    def describe(self) -> str:
        how = "reduce-scatters and all-gathers" if self.sequence_parallel else "all-reduces"
        overlap = " and --tp-comm-overlap's" if self.overlap else ""
        beside = f" (what outlasts the GEMMs beside them: megatron-core's{overlap})" if self.gemms else ""
        return f"{self.model.describe()}, with TP {self.tp}'s {how}{beside}"

    def __repr__(self) -> str:
        return (f"TensorParallelCollectives({self.model!r}, sequence_parallel={self.sequence_parallel}, "
                f"overlap={self.overlap}, gemms={self.gemms is not None}, async_backward={self.async_backward})")

    # -- time ---------------------------------------------------------------------------------
    def exposed(self, entry: tuple, tokens):
        """ms one collective (an item of :data:`ACTIVATION_COLLECTIVES`) of ``tokens`` rows adds to its pass."""
        comm = self.collective_ms(entry[0], tokens * (self.hidden_size * self.model.activation_bytes))
        return collective_exposed_ms(comm, entry, tokens, self.gemms, self.tp, tp_comm_overlap=self.overlap,
                                     async_backward=self.async_backward)

    def collectives_ms(self, layer: str, phase: str, recompute, mbs, seqlen):
        """ms one micro-batch's part waits for its collectives."""
        tokens = self.model.tokens_per_rank(mbs, seqlen)
        entries = ACTIVATION_COLLECTIVES[layer, phase, self.sequence_parallel]
        if layer == "encoder" and phase == "backward" and as_recompute(recompute) == RecomputeType.FULL:
            entries = ACTIVATION_COLLECTIVES["encoder", "forward", self.sequence_parallel] + entries
        total = sum((self.exposed(entry, tokens) for entry in entries), 0.0)
        if layer == "postprocess" and phase == "forward":
            total = total + LOSS_ALL_REDUCES * self.collective_ms("all_reduce", tokens * LOSS_BYTES_PER_TOKEN)
        return total

    def layer_ms(self, layer, phase, recompute, mbs, seqlen):
        total = self.model.layer_ms(layer, phase, recompute, mbs, seqlen) + self.collectives_ms(
            layer, phase, recompute, mbs, seqlen)
        return float(total) if np.ndim(total) == 0 else np.asarray(total, dtype=float)

    def shape_costs(self, types, mbs, seqlen) -> np.ndarray:
        """The inner model's answers (one call), each part's collectives added to its times."""
        types = tuple(map(as_recompute, types))
        costs = np.array(self.model.shape_costs(types, mbs, seqlen), dtype=float)
        for row, rc in enumerate(types):
            for k, (layer, phase) in enumerate(TIMED):
                costs[row, k] = costs[row, k] + self.collectives_ms(layer, phase, rc, mbs, seqlen)
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
                                         overlap=self.overlap, gemms=self.gemms, async_backward=self.async_backward)

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
                   overlap: bool = False, gemms: Optional[LinearGemms] = None,
                   async_backward: bool = True) -> CostModel:
    """``model`` with its TP group's collectives priced by ``collective_ms`` (beside the GEMMs
    ``gemms`` prices); ``model`` itself at TP 1."""
    if model.tp == 1:
        return model
    return TensorParallelCollectives(model, collective_ms, sequence_parallel=sequence_parallel, overlap=overlap,
                                     gemms=gemms, async_backward=async_backward)
