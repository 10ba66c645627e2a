"""A cost model seen from one pipeline layout: what each stage of it costs per micro-batch, the
question the planner asks."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from megatron_dynapipe.planning.cost_model.base import PHASES, CostModel, as_recompute
from megatron_dynapipe.planning.cost_model.link import DEFAULT_LINK, Link
from megatron_dynapipe.planning.types import RecomputeType, cost_shapes, extra_segments

__all__ = ["StageCosts"]

ELEMENTS_KEPT = 1 << 24  # answers remembered per kind (128 MB of float64 each), then all forgotten at once
EVERY_TYPE = tuple(RecomputeType)  # what each shape is evaluated under, once


@dataclass(frozen=True)
class StageCosts:
    """A :class:`CostModel` seen from one pipeline layout: what each stage costs.

    Layers are split as evenly as possible, earlier stages taking the remainder. Stage 0 also
    holds the embedding, the last stage the LM head (its time is ``postprocess``) and, when
    ``pp > 1``, a tied copy of the embedding. Every stage pays the model's per-micro-batch
    overhead (:meth:`CostModel.microbatch_overhead_ms`) on top of its layers: each runs its own
    executor, DDP hooks and model wrapper.
    """

    model: CostModel
    num_layers: int
    pp: int
    dp: int = 1
    zero_stage: int = 0  # 0..3; Megatron's distributed optimizer is ZeRO-1
    #: between neighbouring stages; default: the link the cost model's profile measured, else
    #: :data:`~.link.DEFAULT_LINK`
    link: Optional[Link] = None
    #: layers of each stage when not split evenly (Megatron-LM's uneven first/last stages)
    layers: Optional[tuple[int, ...]] = None
    #: model chunks each stage interleaves, where micro-batches are sized for an interleaved
    #: pipeline's warm-up (:meth:`in_flight`); 1: for 1F1B's steady state
    warmup_chunks: int = 1
    # answers by micro-batch shape, under every recompute type: one plan asks the same shapes many
    # times (recompute choice, candidate orders, work tables, and every DP rank's micro-batching
    # tables, one type or several), and evaluating the model dominated planning where they repeat.
    _answers: "_ShapeMemo" = field(default_factory=lambda: _ShapeMemo(), init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.pp < 1 or self.dp < 1:
            raise ValueError(f"pp and dp must be >= 1, got pp={self.pp} dp={self.dp}")
        if self.layers is not None:
            if len(self.layers) != self.pp or sum(self.layers) != self.num_layers or min(self.layers) < 0:
                raise ValueError(f"layers {self.layers} are not {self.num_layers} layers on {self.pp} stages")
        elif self.num_layers < self.pp:
            raise ValueError(
                f"{self.num_layers} layers cannot fill {self.pp} pipeline stages: use pp <= num_layers"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")

    def packed(self) -> "StageCosts":
        """These stages pricing packed micro-batches (:meth:`CostModel.packed`)."""
        model = self.model.packed()
        return self if model is self.model else dataclasses.replace(self, model=model)

    def layers_on(self, stage: int) -> int:
        if not 0 <= stage < self.pp:
            raise ValueError(f"stage {stage} is outside 0..{self.pp - 1}")
        if self.layers is not None:
            return self.layers[stage]
        base, extra = divmod(self.num_layers, self.pp)
        return base + (stage < extra)

    def _time(self, phase: str, stage: int, mbs, seqlen, recompute):
        ms = self.layers_on(stage) * self.model.layer_ms("encoder", phase, recompute, mbs, seqlen)
        if stage == 0:
            ms = ms + self.model.layer_ms("preprocess", phase, recompute, mbs, seqlen)
        if stage == self.pp - 1:
            ms = ms + self.model.layer_ms("postprocess", phase, recompute, mbs, seqlen)
        return ms + self.model.microbatch_overhead_ms(phase, mbs, seqlen, self.layers_on(stage))

    def forward_ms(self, stage: int, mbs, seqlen, recompute):
        """Forward of one micro-batch through the stage's layers (+ LM head on the last)."""
        return self._time("forward", stage, mbs, seqlen, recompute)

    def backward_ms(self, stage: int, mbs, seqlen, recompute):
        """Backward (including recomputation) of one micro-batch through the stage."""
        return self._time("backward", stage, mbs, seqlen, recompute)

    def stored_mb(self, stage: int, mbs, seqlen, recompute):
        """Activations one micro-batch keeps on the stage from its forward to its backward (on the
        last stage the loss's softmax too)."""
        mb = self.layers_on(stage) * self.model.activation_mb("stored", recompute, mbs, seqlen)
        return mb + self.model.logits_mb("stored", mbs, seqlen) if stage == self.pp - 1 else mb

    def peak_mb(self, stage: int, mbs, seqlen, recompute):
        """Transient memory on top of the stored activations while one of its layers (or, on the
        last stage, the LM head) runs."""
        self.layers_on(stage)  # validates the stage
        peak = self.model.activation_mb("peak", recompute, mbs, seqlen)
        if stage == self.pp - 1:
            return np.maximum(peak, self.model.logits_mb("peak", mbs, seqlen))
        return peak

    def all_stages(self, mbs, seqlen, recompute) -> dict[str, np.ndarray]:
        """forward/backward ms and stored/peak MB of every stage at once, as
        [pp, *shape] arrays, evaluating each per-layer quantity once instead of once per stage
        (the planner's hot path); a shape asked before is answered from memory."""
        return {name: array[0] for name, array in self.by_recompute(mbs, seqlen, (recompute,)).items()}

    def by_recompute(self, mbs, seqlen, types, stages: "np.ndarray | None" = None,
                     segments=None) -> dict[str, np.ndarray]:
        """:meth:`all_stages` under each recompute type of ``types`` in one evaluation, as
        [len(types), pp, *shape] arrays; only those of ``stages`` (indices) where given.
        ``segments``: the segments packed micro-batches run beyond their cost shapes' rows
        (:func:`~megatron_dynapipe.planning.types.packed_extra_segments`), each charged
        :meth:`CostModel.segment_ms` a layer."""
        mbs, seqlen = np.asarray(mbs, dtype=float), np.asarray(seqlen, dtype=float)
        types = tuple(as_recompute(rc) for rc in types)
        shape = np.broadcast_shapes(mbs.shape, seqlen.shape)
        # one complex number a shape: numpy sorts and searches them by (mbs, seqlen)
        keys = (np.broadcast_to(mbs, shape) + 1j * np.broadcast_to(seqlen, shape)).ravel()
        answers = self._answers.answers(keys, lambda new: self._by_recompute(new.real, new.imag, EVERY_TYPE), stages)
        wanted = [EVERY_TYPE.index(rc) for rc in types]
        out = {name: values[wanted].reshape((len(types),) + values.shape[1:2] + shape)
               for name, values in answers.items()}
        if segments is not None and np.any(segments):  # padded micro-batches run none
            self._charge_segments(out, types, stages, np.broadcast_to(np.asarray(segments, dtype=float), shape))
        return out

    def of_microbatches(self, microbatches, types, stages: "np.ndarray | None" = None) -> dict[str, np.ndarray]:
        """:meth:`by_recompute` of these micro-batches at their cost shapes, the segments packed
        ones run beyond them charged."""
        mbs, seqlen = cost_shapes(microbatches)
        return self.by_recompute(mbs, seqlen, types, stages, extra_segments(microbatches))

    def _charge_segments(self, out: dict, types, stages, segments: np.ndarray) -> None:
        """Add each stage's layers' cost per segment beyond the cost shapes' rows to ``out``'s times."""
        layers = np.array([self.layers_on(s) for s in (range(self.pp) if stages is None else stages)], dtype=float)
        for phase in PHASES:
            per_layer = np.array([self.model.segment_ms(phase, rc) for rc in types])
            if per_layer.any():
                charge = np.multiply.outer(np.multiply.outer(per_layer, layers), segments)
                out[phase] = out[phase] + charge

    def in_flight(self, stages: np.ndarray) -> np.ndarray:
        """How many micro-batches' stored activations each of ``stages`` holds at most, as whole
        stages' worth: 1F1B's pp - s, or an interleaved rank's 2 (pp - s - 1) + (V - 1) pp warm-up
        chunk-forwards and one more, each 1/V of its layers (``warmup_chunks`` V)."""
        stages = np.asarray(stages)
        if self.warmup_chunks == 1:
            return self.pp - stages
        v = self.warmup_chunks
        return (2 * (self.pp - stages - 1) + (v - 1) * self.pp + 1) / v

    def worst_stages(self) -> np.ndarray:
        """The earliest stage of each kind -- first, last, and the rest by their layers: stages of
        one kind cost the same per micro-batch, and under 1F1B the earliest holds the most
        micro-batches in flight, so its time and memory checks stand for its kind's."""
        kinds = {}
        for stage in range(self.pp):
            kinds.setdefault((stage == 0, stage == self.pp - 1, self.layers_on(stage)), stage)
        return np.array(sorted(kinds.values()), dtype=np.int64)

    def _by_recompute(self, mbs: np.ndarray, seqlen: np.ndarray, types: tuple) -> dict[str, np.ndarray]:
        shape = np.broadcast_shapes(mbs.shape, seqlen.shape)
        column = (1, self.pp) + (1,) * len(shape)
        layers = np.array([self.layers_on(s) for s in range(self.pp)], dtype=float).reshape(column)
        is_last = (np.arange(self.pp) == self.pp - 1).reshape(column)
        is_first = (np.arange(self.pp) == 0).reshape(column)
        costs = np.asarray(self.model.shape_costs(types, mbs, seqlen), dtype=float)[:, :, None]  # [T, 8, 1, *shape]
        encoder_fwd, encoder_bwd, head_fwd, head_bwd, embed_fwd, embed_bwd, stored, peak = (costs[:, k] for k in range(8))
        overhead = {phase: self.model.microbatch_overhead_ms(phase, mbs, seqlen, layers) for phase in PHASES}
        out = {
            "forward": layers * encoder_fwd + np.where(is_last, head_fwd, 0.0) + np.where(is_first, embed_fwd, 0.0)
            + overhead["forward"],
            "backward": layers * encoder_bwd + np.where(is_last, head_bwd, 0.0) + np.where(is_first, embed_bwd, 0.0)
            + overhead["backward"],
            "stored": layers * stored + np.where(is_last, self.model.logits_mb("stored", mbs, seqlen), 0.0),
            "peak": np.broadcast_to(np.where(is_last, np.maximum(peak, self.model.logits_mb("peak", mbs, seqlen)), peak),
                                    (len(types), self.pp) + shape),
        }
        return out

    def param_mb(self, stage: int) -> float:
        """16-bit parameter MB on one rank of the stage."""
        mb = self.layers_on(stage) * self.model.param_mb("encoder")
        embeddings = (stage == 0) + (stage == self.pp - 1 and self.pp > 1)
        return mb + embeddings * self.model.param_mb("embedding")

    def model_state_mb(self, stage: int) -> float:
        """Parameters, gradients and Adam states of one rank of the stage.

        Per parameter: 2 B 16-bit weight, 2 B gradient, 12 B fp32 master weight + two moments.
        ZeRO-1 shards the 12 B over dp, ZeRO-2 also the gradient, ZeRO-3 all 16 B.
        """
        p, dp = self.param_mb(stage), self.dp  # p MB holds 2 B per parameter
        if self.zero_stage == 0:
            return 8.0 * p
        if self.zero_stage == 1:
            return p * (2.0 + 6.0 / dp)
        if self.zero_stage == 2:
            return p * (1.0 + 7.0 / dp)
        return 8.0 * p / dp

    @functools.cached_property
    def p2p_link(self) -> Link:
        return self.link or Link.of(self.model.metadata) or DEFAULT_LINK

    def p2p_ms(self, mbs, seqlen):
        """Time to send one micro-batch's activation (or its gradient) to the next stage, in the
        dtype activations run in (its share of the tokens, under context and sequence parallelism)."""
        values = self.model.pipeline_tokens(mbs, seqlen) * self.model.hidden_size
        return self.p2p_link.p2p_ms(self.model.activation_bytes * values)


class _ShapeMemo:
    """A cost model's answers by micro-batch shape (``mbs + 1j * seqlen``): the shapes sorted for
    search, each with the slot of its answers in stores that grow by doubling. A query evaluates
    only the shapes never asked before, all at once."""

    def __init__(self):
        self.keys = np.empty(0, dtype=complex)  # sorted
        self.slots = np.empty(0, dtype=np.int64)  # of each key, in the stores
        self.stores: dict[str, np.ndarray] = {}  # name -> [types, pp, capacity]
        self.size = 0

    def answers(self, keys: np.ndarray, evaluate, stages: "np.ndarray | None" = None) -> dict[str, np.ndarray]:
        """Each answer of ``evaluate`` (of a 1-D array of shapes: name -> [types, pp, shapes]) at
        ``keys``, [types, pp, len(keys)], or [types, len(stages), len(keys)] for those ``stages``."""
        where = np.searchsorted(self.keys, keys)
        known = self._known(keys, where)
        if not self.stores or not known.all():
            new = np.unique(keys[~known])
            per_shape = max((store[..., 0].size for store in self.stores.values()), default=0)
            if (self.size + len(new)) * per_shape > ELEMENTS_KEPT:
                self.__init__()
                new = np.unique(keys)
            self._add(new, evaluate(new))
            where = np.searchsorted(self.keys, keys)
        picked = self.slots[where]
        if stages is None:
            return {name: store[..., picked] for name, store in self.stores.items()}
        return {name: store[:, stages[:, None], picked] for name, store in self.stores.items()}

    def _known(self, keys: np.ndarray, where: np.ndarray) -> np.ndarray:
        known = where < len(self.keys)
        known[known] = self.keys[where[known]] == keys[known]
        return known

    def _add(self, new: np.ndarray, values: dict) -> None:
        end = self.size + len(new)
        for name, value in values.items():
            store = self.stores.get(name)
            if store is None or store.shape[-1] < end:
                grown = np.empty(np.shape(value)[:-1] + (max(end, 2 * (0 if store is None else store.shape[-1]), 64),))
                if store is not None:
                    grown[..., :self.size] = store[..., :self.size]
                self.stores[name] = store = grown
            store[..., self.size:end] = value
        keys = np.concatenate([self.keys, new])
        order = np.argsort(keys, kind="stable")
        self.keys = keys[order]
        self.slots = np.concatenate([self.slots, np.arange(self.size, end)])[order]
        self.size = end
