"""The question every cost model answers, in the units every one speaks.

A :class:`CostModel` prices one GPT layer (and the embedding and LM head) for one micro-batch
shape at one tensor-parallel size: time per phase, activation memory, parameter memory.  Every
query is vectorised: ``mbs`` and ``seqlen`` may be scalars or broadcastable arrays, and
``np.inf`` marks a micro-batch shape that cannot run at all.  Scalar queries take a pure-Python
path because the planner issues many of them.
"""

from __future__ import annotations

import abc
import math
from typing import Mapping, Sequence

import numpy as np

from megatron_dynapipe.planning.types import RecomputeType

__all__ = ["CostModel", "CostModelError", "MB", "LAYERS", "PHASES", "KINDS", "PARAM_LAYERS"]

MB = 2**20  # bytes in the "MB" every cost model speaks (the unit of the profile files)
LAYERS = ("encoder", "postprocess", "preprocess")
PHASES = ("forward", "backward")
KINDS = ("stored", "peak")
PARAM_LAYERS = ("embedding", "encoder")
# The (layer, phase) times CostModel.shape_costs returns, in order, before the activation KINDS.
TIMED = (("encoder", "forward"), ("encoder", "backward"), ("postprocess", "forward"), ("postprocess", "backward"),
         ("preprocess", "forward"), ("preprocess", "backward"))

INF = math.inf
LOGIT_STORED_BYTES = 4.0  # fp32 softmax per logit, whatever the model's dtype
SCALARS = (int, float, np.integer, np.floating)


class CostModelError(ValueError):
    """A cost model file cannot be used; the message says what to fix."""


def as_recompute(value) -> RecomputeType:
    return value if isinstance(value, RecomputeType) else RecomputeType.parse(value)


def is_scalar(x) -> bool:
    return isinstance(x, SCALARS) or (isinstance(x, np.ndarray) and x.ndim == 0)


def check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}: use one of {', '.join(choices)}")


def full_inf(mbs, seqlen):
    if is_scalar(mbs) and is_scalar(seqlen):
        return INF
    return np.full(np.broadcast_shapes(np.shape(mbs), np.shape(seqlen)), INF)


class CostModel(abc.ABC):
    """Per-layer costs of one model at one tensor-parallel size.

    ``layer_ms`` and ``activation_mb`` return a ``float`` when both ``mbs`` and ``seqlen`` are
    scalars and a float ``np.ndarray`` of their broadcast shape otherwise.
    """

    tp: int
    hidden_size: int  # activation width: p2p messages are mbs * seqlen * hidden_size elements
    name: str = ""

    @abc.abstractmethod
    def layer_ms(self, layer: str, phase: str, recompute: RecomputeType, mbs, seqlen):
        """Milliseconds of one ``layer`` ("encoder", "postprocess": final norm, LM head and loss, or
        "preprocess": the embedding) in ``phase`` ("forward" | "backward") for one micro-batch;
        backward includes recomputation."""

    @abc.abstractmethod
    def activation_mb(self, kind: str, recompute: RecomputeType, mbs, seqlen):
        """MB of one encoder layer: ``kind`` "stored" is kept from its forward until its
        backward, "peak" is the transient extra while the layer runs."""

    @abc.abstractmethod
    def param_mb(self, layer: str) -> float:
        """MB of 16-bit parameters of one "embedding" or one "encoder" layer on one TP rank."""

    def packed(self) -> "CostModel":
        """The costs of packed micro-batches (samples back to back in one row, each attending to
        itself alone), queried at their :func:`~megatron_dynapipe.planning.types.packed_cost_shape`:
        this model itself unless it measured packed rows apart."""
        return self

    def segment_ms(self, phase: str, recompute: RecomputeType) -> float:
        """Milliseconds one encoder layer adds in ``phase`` under ``recompute`` per segment a packed
        row runs beyond the rows of its cost shape
        (:func:`~megatron_dynapipe.planning.types.packed_extra_segments`): what an attention core
        that runs a row's samples one by one pays each; 0 unless packed rows were measured."""
        return 0.0

    def context_parallel_encoder(self, cp: int) -> Mapping[tuple[str, RecomputeType], Mapping[tuple[int, int], float]]:
        """The encoder layer measured on one rank of a real context-parallel group of ``cp`` ranks,
        rows of whole ``seqlen`` tokens split over it: (phase, recompute) -> {(seqlen, mbs): ms}
        and (activation kind, recompute) -> {(seqlen, mbs): MB}, of the rows this model prices
        (padded, or packed in :meth:`packed`'s copy); none unless a profile measured them."""
        return {}

    def no_time_fix(self) -> str:
        """What to do where this model has no time for a micro-batch of one sample (the planner's
        refusal names it): a profile measured only so long a sequence."""
        return "profile longer sequences (megatron-dynapipe profile --max-seq-length) or truncate long samples"

    def describe(self) -> str:
        """What the plan was priced with, in a few words (the plan summary prints it)."""
        return f"{type(self).__name__} {self.name or ''}".strip() + f", hidden {self.hidden_size}, tp {self.tp}"

    def to_document(self) -> dict:
        """The cost-model file (docs/cost_model.md) that rebuilds this model, for
        :func:`~.loading.cost_model_from_document`: how a model travels between processes."""
        raise CostModelError(f"{type(self).__name__} has no cost-model file form: pass a profile's path or an "
                             "AnalyticalCostModel")

    #: the context-parallel ranks a micro-batch's rows are split over, of which the model prices one
    cp: int = 1
    #: whether activations outside the TP regions are split over TP (Megatron's sequence parallelism)
    sequence_parallel: bool = False
    #: whether :meth:`attention_core_ms` (phase, recompute, mbs, seqlen) prices the attention core
    #: apart, the unit of context parallelism's extra blocks
    prices_attention_core: bool = False

    def tokens_per_rank(self, mbs, seqlen):
        """Tokens one rank holds of a micro-batch of ``mbs`` rows of ``seqlen``."""
        return as_float(mbs) * as_float(seqlen) / self.cp

    def pipeline_tokens(self, mbs, seqlen):
        """Tokens of a micro-batch's activation one rank sends the next stage: its share, and under
        sequence parallelism its TP rank's share of that (Megatron sends the sequence shard)."""
        tokens = self.tokens_per_rank(mbs, seqlen)
        return tokens / self.tp if self.sequence_parallel else tokens

    def microbatch_overhead_ms(self, phase: str, mbs, seqlen, layers):
        """Milliseconds a training step adds per micro-batch, in ``phase``, to the own times of
        the parts of a stage of ``layers`` layers (GPTModel around them, the loss, DDP's gradient
        hooks, the executor): once per stage and once per layer, each ``ms + ms_per_token *
        mbs * seqlen`` as :attr:`microbatch_overhead` holds them (docs/cost_model.md)."""
        check_choice("phase", phase, PHASES)
        tokens = as_float(mbs) * as_float(seqlen)
        stage_ms, stage_per_token = self.microbatch_overhead.get(("stage", phase), (0.0, 0.0))
        layer_ms, layer_per_token = self.microbatch_overhead.get(("layer", phase), (0.0, 0.0))
        return stage_ms + stage_per_token * tokens + as_float(layers) * (layer_ms + layer_per_token * tokens)

    #: ("stage" | "layer", phase) -> (ms, ms per token) of :meth:`microbatch_overhead_ms`; none
    #: unless measured
    microbatch_overhead: Mapping[tuple[str, str], tuple[float, float]] = {}
    #: what the model was measured or calibrated with (``dtype``, ``model``: ModelSpec fields)
    metadata: Mapping = {}

    def logits_mb(self, kind: str, mbs, seqlen):
        """MB the loss holds of one micro-batch's logits on the last stage, on top of its layers'.
        Megatron's vocab-parallel cross-entropy computes in fp32 and keeps its softmax from the
        loss's forward to its backward (``kind`` "stored": 4 B a logit); while the head runs, the
        16-bit logits (forward) or their gradient (backward) sit beside it ("peak": 2 B a logit;
        none in fp32, where they are that same tensor)."""
        check_choice("activation kind", kind, KINDS)
        per_logit = LOGIT_STORED_BYTES if kind == "stored" else (0.0 if self.activation_dtype == "fp32" else 2.0)
        return as_float(mbs) * as_float(seqlen) * (self.vocab_per_rank() * per_logit / MB)

    @property
    def activation_dtype(self) -> str:
        """The dtype activations run in: the measured one, else 16-bit as on a GPU."""
        return self.metadata.get("dtype") or "bf16"

    @property
    def activation_bytes(self) -> float:
        """Bytes of one activation value in :attr:`activation_dtype`."""
        return 4.0 if self.activation_dtype == "fp32" else 2.0

    def vocab_per_rank(self) -> float:
        """Logits per token on one tensor-parallel rank (the padded vocabulary over TP), here read off
        the embedding's 16-bit parameters, which hold learned positions too where the model has them
        (a little high, then); a model that knows its vocabulary says so."""
        return self.param_mb("embedding") * MB / (2.0 * self.hidden_size)

    def shape_costs(self, types: "Sequence[RecomputeType]", mbs, seqlen) -> np.ndarray:
        """Everything a pipeline stage needs of one micro-batch shape under each recompute type
        in ``types``, in one call: a [len(types), 8, *shape] array of encoder, LM-head and
        embedding forward and backward ms, then stored and peak activation MB.
        A model may share work between them; this one asks each in turn."""
        shape = np.broadcast_shapes(np.shape(mbs), np.shape(seqlen))
        rows = [[self.layer_ms(layer, phase, rc, mbs, seqlen) for layer, phase in TIMED]
                + [self.activation_mb(kind, rc, mbs, seqlen) for kind in KINDS] for rc in types]
        return np.array([[np.broadcast_to(np.asarray(v, dtype=float), shape) for v in row] for row in rows])


def as_float(x):
    return float(x) if is_scalar(x) else np.asarray(x, dtype=float)
