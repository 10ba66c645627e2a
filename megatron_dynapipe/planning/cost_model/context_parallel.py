"""Context parallelism seen from one rank: what a micro-batch costs each of the ``cp`` ranks
its sequences are split over.

Megatron-LM splits every sequence of ``s`` tokens into ``2 cp`` chunks and gives rank ``i``
chunks ``i`` and ``2 cp - 1 - i``, so that each rank's share of the causal attention is equal.
Each rank then runs its layers on ``s / cp`` tokens, and its attention core attends to all ``s``
keys by passing key and value around the group's ring (transformer-engine's
``AttnFuncWithCPAndKVP2P``): ``cp`` steps, each a block of attention as much work as the local,
causal one at ``s / cp`` tokens, so ``cp - 1`` blocks more than the local layer does. A step's
transfer of the next key and value runs while the block computes; only what outlasts the block
shows (``ring_gbps``, or the link a profile measured; without either the transfers are left to
whoever prices communication, as a trace's replay does). Where the profile measured megatron-core's
local layers (``layer_spec`` ``local``), the ring is this package's own
(:mod:`megatron_dynapipe.gpt.context_parallel`): it gathers the keys and values before its core and
passes their gradients back after it, ``cp - 1`` steps each way that no block hides. Recompute
runs the ring again with the core it recomputes.

So a rank's encoder layer costs the inner model's layer at ``s / cp`` tokens plus ``cp - 1``
times its attention core there, its activations and logits are those of ``s / cp`` tokens, and
its parameters are the whole layer's (context parallelism shares no weights out). The attention
core's part of a layer comes from a model that prices it apart (an
:class:`~.analytical.AnalyticalCostModel`, the hardware roofline, or a profile that measured the
core alone): the inner model itself where it does, else one of the same GPT's shape, by its share.

Where the profile also timed the layer on a real context-parallel group of ``cp`` ranks
(:meth:`~.base.CostModel.context_parallel_encoder`: ``profile --cp``), that price is corrected by
what the group measured: at each measured point the ratio of the measured time to the price, the
ratios interpolated between points and held at the grid's edges (longer rows, larger
micro-batches), so the ring's work a profile at CP 1 cannot see -- its per-sample steps in packed
rows, its ranks' waits on each other -- is priced where it was measured and in proportion beyond.
Only a model that prices the ring's transfers over the profile's own link is corrected (the
measured times include them, over that link): not a trace's, which records them itself, nor one
given another link (``ring_gbps``: ``search`` pricing a cluster's). The group also measured what a
rank stores and peaks at, and the activations are corrected the same way, whatever the link: the
ring a rank runs may keep more than its share of tokens (this package's keeps the whole sequence's
keys and values for its backward, about 1.3 times the CP 1 layer's stored at ``s / cp`` on the
tiny GPT at CP 2), which the CP 1 profile cannot see.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.planning.cost_model.analytical import AnalyticalCostModel, gpt_shape
from megatron_dynapipe.planning.cost_model.base import (KINDS, PHASES, TIMED, CostModel, CostModelError, as_float,
                                                      as_recompute)
from megatron_dynapipe.planning.cost_model.grid import Grid
from megatron_dynapipe.planning.cost_model.link import Link
from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["ContextParallelCostModel", "split_over_cp"]


class ContextParallelCostModel(CostModel):
    """``model``'s costs on one rank of a context-parallel group of ``cp`` ranks: every question
    about a micro-batch of ``seqlen`` tokens a row is asked of ``model`` at ``seqlen / cp``, the
    encoder layer's time with the ring's extra attention added.

    ``shape``: the analytical model of the GPT's shape: where ``model`` does not price the
    attention core apart (``prices_attention_core``), the core's share of ``shape``'s layer time is
    taken of ``model``'s; its keys' and values' width sizes the ring's transfers (default: ``model``
    itself, where it is analytical).
    ``ring_gbps``: GB/s of the ring's links (default: the link ``model``'s profile measured, if
    any); with a link, each step's transfer of keys and values (and in backward their gradients)
    is added too: what outlasts the step's attention, or all of it where the ring runs no block
    beside it (module docstring).  ``ring_transfers=False``: none priced, whatever the profile
    measured (a trace records them as ops of their own)."""

    def __init__(self, model: CostModel, cp: int, *, shape: Optional[AnalyticalCostModel] = None,
                 ring_gbps: Optional[float] = None, ring_transfers: bool = True):
        if isinstance(cp, bool) or not isinstance(cp, (int, np.integer)) or cp < 2:
            raise ValueError(f"context parallelism needs cp >= 2 ranks, got {cp!r}: use the model itself at cp 1")
        if isinstance(model, ContextParallelCostModel):
            raise ValueError("the model is already split over a context-parallel group: wrap the inner model once")
        shape = shape if shape is not None else model if isinstance(model, AnalyticalCostModel) else None
        attention = model if model.prices_attention_core else shape
        if ring_gbps is not None and not ring_gbps > 0:
            raise ValueError(f"ring_gbps must be > 0 GB/s, got {ring_gbps!r}")
        ring = None if not ring_transfers else Link(ring_gbps, 0.0) if ring_gbps is not None \
            else Link.of(model.metadata)
        if attention is None or (ring is not None and shape is None):
            why = "does not price the attention core apart, which context parallelism repeats" if attention is None \
                else "has no width of keys and values for the ring's transfers"
            raise CostModelError(f"{model.describe()} {why}: give the GPT's shape, split_over_cp(model, cp, spec)")
        if shape is not None and shape.tp != model.tp:
            raise ValueError(f"the GPT's shape is at tp {shape.tp}, the cost model at tp {model.tp}")
        self.model, self.cp, self.shape, self.attention, self.ring_gbps = model, int(cp), shape, attention, ring_gbps
        self.ring, self.ring_transfers = ring, ring_transfers
        self.ring_hides_transfers = model.metadata.get("layer_spec") != "local"
        self.tp, self.hidden_size, self.sequence_parallel = model.tp, model.hidden_size, model.sequence_parallel
        self.name, self.metadata = model.name, model.metadata
        self.microbatch_overhead = model.microbatch_overhead
        # the group's times include the ring's transfers over the profile's own link; its memory
        # is the same whatever the link
        self.measured = {key: ratio for key, ratio in self._measured_ratios().items()
                         if key[0] in KINDS or (ring_transfers and ring_gbps is None)}

    def describe(self) -> str:
        what = [name for name, kinds in (("times", PHASES), ("memory", KINDS))
                if any(key[0] in kinds for key in self.measured)]
        measured = f" (its layer corrected by a CP {self.cp} group's {' and '.join(what)})" if what else ""
        return f"{self.model.describe()}, split over CP {self.cp}{measured}"

    def __repr__(self) -> str:
        return f"ContextParallelCostModel({self.model!r}, cp={self.cp}, ring_gbps={self.ring_gbps})"

    def local(self, seqlen):
        """Tokens of a row of ``seqlen`` on one rank of the group."""
        return as_float(seqlen) / self.cp

    # -- time ---------------------------------------------------------------------------------
    def layer_ms(self, layer, phase, recompute, mbs, seqlen):
        local = self.local(seqlen)
        ms = self.model.layer_ms(layer, phase, recompute, mbs, local)
        if layer != "encoder":
            return ms
        rc = as_recompute(recompute)
        return self._corrected(phase, rc, mbs, seqlen, ms + self.ring_ms(phase, rc, mbs, local, ms))

    def _measured_ratios(self) -> dict:
        """(phase or activation kind, recompute) -> a grid of measured / priced, held beyond its
        edges (module docstring)."""
        ratios = {}
        for (what, rc), points in self.model.context_parallel_encoder(self.cp).items():
            ratio = {}
            for (seq, mbs), measured in points.items():
                priced = self._uncorrected(what, rc, mbs, self.local(seq))
                if 0.0 < priced < math.inf:
                    ratio[seq, mbs] = measured / priced
            if ratio:
                ratios[what, rc] = Grid(_held(ratio))
        return ratios

    def _uncorrected(self, what, rc, mbs, local) -> float:
        """The encoder's ms in phase ``what`` (the inner model's layer and the ring), or its MB of
        activation kind ``what`` (the inner model's at ``local`` tokens), before any correction."""
        if what in KINDS:
            return float(self.model.activation_mb(what, rc, mbs, local))
        inner = float(self.model.layer_ms("encoder", what, rc, mbs, local))
        return inner + float(self.ring_ms(what, rc, mbs, local, inner))

    def _corrected(self, what, rc, mbs, seqlen, priced):
        """The encoder's ``priced`` time in phase ``what``, or its MB of activation kind ``what``,
        times what the group measured over what was priced there."""
        ratio = self.measured.get((what, rc))
        if ratio is None:
            return priced
        return priced * ratio(np.minimum(as_float(mbs), ratio.M[-1]), np.minimum(as_float(seqlen), ratio.S[-1]))

    def ring_block_ms(self, phase: str, mbs, seqlen):
        """One block of the ring's attention in a layer (``phase`` without recompute) at rows of
        ``seqlen`` tokens: what each of the ring's transfers runs beside, and all it can hide behind
        (transformer-engine's ring steps run inside the attention core, not beside the layer's GEMMs)."""
        return self._attention_ms(phase, RecomputeType.NONE, mbs, self.local(seqlen))

    def ring_ms(self, phase: str, rc: RecomputeType, mbs, local, encoder_ms):
        """What the ring adds to one encoder layer of ``encoder_ms`` at ``local`` tokens a row:
        ``cp - 1`` blocks of its attention core, and the transfers they do not hide."""
        extra = (self.cp - 1) * self._attention_ms(phase, rc, mbs, local, encoder_ms)
        return extra if self.ring is None else extra + self._exposed_ms(phase, rc, mbs, local)

    def _attention_ms(self, phase, rc, mbs, local, encoder_ms=None):
        """The attention core's part of ``encoder_ms`` (default: the inner model's encoder layer):
        its share of the attention model's layer."""
        core = self.attention.attention_core_ms(phase, rc, mbs, local)
        if self.attention is self.model:
            return core
        if encoder_ms is None:
            encoder_ms = self.model.layer_ms("encoder", phase, rc, mbs, local)
        return encoder_ms * (core / self.attention.layer_ms("encoder", phase, rc, mbs, local))

    def _exposed_ms(self, phase, rc, mbs, local):
        """Transfers that outlast the block of attention computed beside them: forward, ``cp - 1``
        steps of keys and values; backward, ``cp`` steps (keys and values, then with their
        gradients, the gradients alone last), after the forward ring of a recomputed core.  The
        package's own ring computes no block beside a transfer: ``cp - 1`` whole steps of keys and
        values forward, of their gradients backward."""
        kv = self._kv_ms(mbs, local, 1)
        if self.ring_hides_transfers:
            def exposed(transfer, block_phase):
                return np.maximum(0.0, transfer - self._attention_ms(block_phase, RecomputeType.NONE, mbs, local))

            forward = (self.cp - 1) * exposed(kv, "forward")
            backward = 2.0 * exposed(kv, "backward") + (self.cp - 2) * exposed(self._kv_ms(mbs, local, 2), "backward")
        else:
            forward = backward = (self.cp - 1) * kv
        if phase == "forward":
            return forward
        return backward + (0.0 if rc == RecomputeType.NONE else forward)

    def _kv_ms(self, mbs, local, copies):
        """One ring step of ``copies`` times one rank's keys and values, over the ring's link."""
        layer = self.shape.layer
        width = 2.0 * layer.query_groups * layer.head_dim / self.tp  # keys and values
        return self.ring.p2p_ms(copies * self.activation_bytes * as_float(mbs) * local * width)

    def no_time_fix(self) -> str:
        return self.model.no_time_fix()

    def microbatch_overhead_ms(self, phase, mbs, seqlen, layers):
        return self.model.microbatch_overhead_ms(phase, mbs, self.local(seqlen), layers)

    def segment_ms(self, phase, recompute):
        return self.model.segment_ms(phase, recompute)  # every rank of the ring runs every segment

    # -- memory -------------------------------------------------------------------------------
    def activation_mb(self, kind, recompute, mbs, seqlen):
        rc = as_recompute(recompute)
        return self._corrected(kind, rc, mbs, seqlen, self.model.activation_mb(kind, rc, mbs, self.local(seqlen)))

    def logits_mb(self, kind, mbs, seqlen):
        return self.model.logits_mb(kind, mbs, self.local(seqlen))

    def param_mb(self, layer):
        return self.model.param_mb(layer)

    def vocab_per_rank(self) -> float:
        return self.model.vocab_per_rank()

    @property
    def activation_dtype(self) -> str:
        return self.model.activation_dtype

    def packed(self) -> "ContextParallelCostModel":
        inner = self.model.packed()
        if inner is self.model:
            return self
        return ContextParallelCostModel(inner, self.cp, shape=self.shape, ring_gbps=self.ring_gbps,
                                        ring_transfers=self.ring_transfers)

    def shape_costs(self, types, mbs, seqlen) -> np.ndarray:
        """:meth:`CostModel.shape_costs` of the inner model at the local shape (one call, as it
        shares work between its answers), the ring added to the encoder's times, and the encoder's
        times and memory corrected where a group measured them."""
        types = tuple(map(as_recompute, types))
        local = self.local(seqlen)
        costs = np.array(self.model.shape_costs(types, mbs, local), dtype=float)
        encoder = {phase: TIMED.index(("encoder", phase)) for phase in PHASES}
        for row, rc in enumerate(types):
            for phase, k in encoder.items():
                costs[row, k] = self._corrected(phase, rc, mbs, seqlen,
                                                costs[row, k] + self.ring_ms(phase, rc, mbs, local, costs[row, k]))
            for k, kind in enumerate(KINDS, start=len(TIMED)):
                costs[row, k] = self._corrected(kind, rc, mbs, seqlen, costs[row, k])
        return costs


def _held(points: dict) -> dict:
    """Grid points with each row carried to the grid's largest micro-batch at its last value, so
    that a grid of ratios answers past a row's end as at it."""
    columns = sorted({m for _, m in points})
    held = dict(points)
    for seq in {s for s, _ in points}:
        last = max(m for s, m in points if s == seq)
        held.update({(seq, m): points[seq, last] for m in columns if m > last})
    return held


def split_over_cp(model: CostModel, cp: int, spec: Optional[ModelSpec] = None, *,
                  ring_gbps: Optional[float] = None, ring_transfers: bool = True) -> CostModel:
    """``model`` on one rank of a context-parallel group of ``cp`` ranks (itself at cp 1), its
    attention core priced by ``spec``'s analytical model where ``model`` does not price it apart."""
    if cp == model.cp:
        return model
    if model.cp != 1:
        raise ValueError(f"the cost model prices one rank of CP {model.cp}, not of CP {cp}")
    if spec is None and model.metadata.get("model"):
        spec = ModelSpec.from_any(model.metadata["model"])  # a profile records the model it measured
    shape = None
    if spec is not None and not isinstance(model, AnalyticalCostModel):  # its shares and widths: every shape fits
        shape = AnalyticalCostModel(**gpt_shape(spec, model.tp), device_memory_mb=math.inf)
    return ContextParallelCostModel(model, cp, shape=shape, ring_gbps=ring_gbps, ring_transfers=ring_transfers)
