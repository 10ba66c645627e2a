"""What a GPT costs to train, counted once: parameters, floating-point operations, activation bytes.

Every part of the package that sizes a model asks here: the tracer deciding whether a rank can
run for real, the analytical cost model pricing a micro-batch, the simulator's MFU.  Nothing
here imports torch.

**FLOPs** are counted the way MFU is usually counted.  A multiply-accumulate is 2 FLOPs; the
backward pass costs twice the forward (so a step is 3x the forward); every matrix multiply of
the model counts, element-wise work does not.  Per token and layer the forward is the QKV and
output projections ``2 h (q + 2 kv) + 2 q h`` (``q`` query width, ``kv`` key/value width), the
attention scores and their product with the values ``2 * 2 q s`` (halved for a causal mask, as
megatron-core 0.16 counts; an unfused kernel computes the whole square), the MLP
``2 (h up + f h)`` (``up = 2 f`` with SwiGLU; ``top-k`` experts for MoE), and once per token the
output layer ``2 h V``.  *Model* FLOPs count the step once; *hardware* FLOPs add the forward that
full activation recomputation runs again.

**Activations** follow Korthikanti et al. (2022), Table 2, in 16-bit values per layer:
``s b h (10 + 24/t + 5 a s / (h t))`` without sequence parallelism, ``s b h (34/t + 5 a s / (h t))``
with it; selective recompute drops the ``5 a s / (h t)`` attention scores (a fused attention core
never keeps them), full recompute keeps only the layer's input (``2 s b h``, split by ``t`` under
sequence parallelism).
"""

from __future__ import annotations

from typing import NamedTuple

from megatron_dynapipe.config.model import ModelSpec

__all__ = [
    "LayerFlops", "layer_params", "expert_params", "norm_params", "embedding_params", "total_params",
    "stage_params", "layer_flops_per_token", "output_flops_per_token", "forward_flops_per_token", "step_flops",
    "microbatch_flops", "activation_bytes", "training_bytes", "RECOMPUTE_KINDS",
]

RECOMPUTE_KINDS = ("none", "selective", "full")
#: Bytes per parameter while training in fp32 on CPU: weight, gradient, Adam's two moments.
TRAIN_BYTES_PER_PARAM = 16
#: ... of which Adam's two fp32 moments, what the distributed optimizer shards over data parallelism.
ADAM_MOMENT_BYTES = 8
#: Bytes per activation value kept for backward when training in fp32 (on CPU).
FP32_BYTES = 4


# ---- parameters ------------------------------------------------------------------------------


def expert_params(model: ModelSpec) -> int:
    """Parameters of one MLP (one expert): ``fc1`` (doubled by SwiGLU's gate), ``fc2``, biases."""
    h, f = model.hidden_size, model.ffn_hidden_size
    up = 2 * f if model.swiglu else f
    return h * up + f * h + int(model.add_bias_linear) * (up + h)


def norm_params(model: ModelSpec) -> int:
    """The two norms of a layer: weight and bias each (LayerNorm) or weight only (RMSNorm)."""
    return 2 * model.hidden_size * (2 if model.normalization == "LayerNorm" else 1)


def layer_params(model: ModelSpec) -> int:
    """Parameters of one transformer layer (attention, MLP or every expert, two norms, biases)."""
    h, bias = model.hidden_size, int(model.add_bias_linear)
    query = model.num_attention_heads * model.head_dim
    kv = 2 * model.query_groups * model.head_dim  # key and value widths
    attention = h * (query + kv) + query * h + bias * (query + kv + h)  # QKV and output projections
    return attention + expert_params(model) * max(1, model.num_experts) + norm_params(model)


def embedding_params(model: ModelSpec) -> int:
    """Word embeddings, plus position embeddings when they are learned."""
    positions = model.max_sequence_length if model.position_embedding_type == "learned_absolute" else 0
    return (model.vocab_size + positions) * model.hidden_size


def total_params(model: ModelSpec) -> int:
    """Parameters of the whole model (output layer tied to the word embedding)."""
    return model.num_layers * layer_params(model) + embedding_params(model) + norm_params(model) // 2


def stage_params(model: ModelSpec, pp: int, tp: int = 1, ep: int = 1, *, stage: int = 0,
                 layers: int | None = None) -> int:
    """Parameters one rank of ``stage`` holds: its ``layers`` (default: the busiest rank's of an
    even split over ``pp``).

    The first stage holds the embeddings, the last the (untied) output layer; tensor
    parallelism divides everything but the layer norms, expert parallelism the experts.
    """
    per_layer = layer_params(model)
    if model.num_experts:
        expert = expert_params(model)
        per_layer += expert * (-(-model.num_experts // ep) - model.num_experts)
    params = (model.stage_layers(pp) if layers is None else layers) * per_layer // tp
    if stage == 0 or stage == pp - 1:
        params += model.vocab_size * model.hidden_size // tp
    if stage == 0:
        params += embedding_params(model) - model.vocab_size * model.hidden_size
    return params


# ---- floating-point operations -------------------------------------------------------------


class LayerFlops(NamedTuple):
    """Forward FLOPs of one token through one transformer layer (the whole layer, every TP rank):
    the linear layers' and the attention core's (scores and their product with the values)."""

    linear: float
    attention: float


def layer_flops_per_token(model: ModelSpec, seq_length, *, causal: bool = True) -> LayerFlops:
    """:class:`LayerFlops` of a token of a ``seq_length``-token sequence (a number or an array)."""
    h, q, kv = model.hidden_size, model.num_attention_heads * model.head_dim, model.query_groups * model.head_dim
    projections = 2 * h * (q + 2 * kv) + 2 * q * h
    if model.num_experts:
        f, visits = model.moe_ffn_hidden_size or model.ffn_hidden_size, min(model.moe_router_topk, model.num_experts)
    else:
        f, visits = model.ffn_hidden_size, 1
    up = 2 * f if model.swiglu else f
    mlp = 2 * (h * up + f * h) * visits
    return LayerFlops(float(projections + mlp), 2 * 2 * q * seq_length * (0.5 if causal else 1.0))


def output_flops_per_token(hidden_size: int, vocab_size: float) -> float:
    """Forward FLOPs of one token through the output layer of ``vocab_size`` entries."""
    return 2.0 * hidden_size * vocab_size


def forward_flops_per_token(model: ModelSpec, seq_length: int, *, tp: int = 1, causal: bool = True
                            ) -> tuple[float, float]:
    """(every transformer layer, output layer) forward FLOPs of one token of a ``seq_length``
    sequence, the output layer over the vocabulary as padded at ``tp``."""
    layer = layer_flops_per_token(model, seq_length, causal=causal)
    return (float(model.num_layers * (layer.linear + layer.attention)),
            output_flops_per_token(model.hidden_size, model.padded_vocab_size(tp)))


def step_flops(model: ModelSpec, tokens: int, seq_length: int, *, tp: int = 1, recompute: str = "none",
               causal: bool = True) -> float:
    """FLOPs of one training step over ``tokens`` tokens of ``seq_length``-token sequences.

    ``recompute="full"`` adds the layers' forward once more (hardware FLOPs); ``"none"`` and
    ``"selective"`` (which recomputes only the attention core) count the step as it is modelled.
    """
    _check_recompute(recompute)
    layers, output = forward_flops_per_token(model, seq_length, tp=tp, causal=causal)
    passes = 4 if recompute == "full" else 3
    return tokens * (passes * layers + 3 * output)


def microbatch_flops(model: ModelSpec, pp: int, tp: int = 1, *, micro_batch_size: int = 1,
                     seq_length: int | None = None, cp: int = 1, recomputed_layers: int = 0,
                     stage_layers: int | None = None) -> float:
    """FLOPs of one micro-batch's forward and backward on the busiest rank: its ``stage_layers``
    (default: an even split's; a recomputed one runs its forward twice) and the output layer,
    which the last stage holds."""
    seq = model.rank_seq_length(seq_length, cp)
    tokens = micro_batch_size * seq
    layers = model.stage_layers(pp) if stage_layers is None else stage_layers
    layer = layer_flops_per_token(model, seq)
    per_layer = tokens * (layer.linear + layer.attention) / tp
    output = tokens * output_flops_per_token(model.hidden_size, model.padded_vocab_size(tp)) / tp
    return (3 * layers + min(recomputed_layers, layers)) * per_layer + 3 * output


# ---- activation memory -------------------------------------------------------------------------


def activation_bytes(seq_length, micro_batch_size, hidden_size: int, num_heads: int, tp: int = 1, *,
                     recompute: str = "none", sequence_parallel: bool = False, value_bytes: int = 2,
                     fused_attention: bool = False):
    """Bytes one transformer layer keeps from its forward to its backward (module docstring), for
    ``value_bytes`` per value (2: 16-bit training; 4: fp32); numbers or numpy arrays. A fused
    attention core (flash, cuDNN, SDPA) keeps no scores, whatever the recompute."""
    _check_recompute(recompute)
    sbh = seq_length * micro_batch_size * hidden_size
    if recompute == "full":
        kept = 2.0 * sbh / (tp if sequence_parallel else 1)
    else:
        outside = 34.0 / tp if sequence_parallel else 10.0 + 24.0 / tp  # values outside the attention core
        keeps_scores = recompute == "none" and not fused_attention
        scores = 5.0 * num_heads * seq_length / (hidden_size * tp) if keeps_scores else 0.0
        kept = sbh * (outside + scores)
    return kept * (value_bytes / 2)


def training_bytes(model: ModelSpec, pp: int, tp: int = 1, ep: int = 1, *, micro_batch_size: int = 1,
                   seq_length: int | None = None, in_flight: float | None = None, cp: int = 1,
                   recomputed_layers: int = 0, selective_recompute: bool = False, sequence_parallel: bool = False,
                   optimizer_shards: int = 1, stage_layers: int | None = None) -> int:
    """Estimated bytes the busiest rank needs to really run a training step on CPU (fp32).

    Weights, gradients and Adam state (16 bytes per parameter; the 8 of Adam's moments split over
    ``optimizer_shards`` ranks by the distributed optimizer) of the larger of the first and last
    stage, each with ``stage_layers`` (default: an even split's busiest), plus the activations of
    ``in_flight`` micro-batches (default ``pp``, what 1F1B keeps on the first stage; a fraction
    under interleaving) and the logits of one micro-batch.  A
    layer whose forward is recomputed (``recomputed_layers`` of the stage's) keeps only its input,
    and one layer's activations come back at a time.  An order-of-magnitude figure for deciding
    whether a model can run for real on this machine, not a profile.
    """
    seq = model.rank_seq_length(seq_length, cp)
    in_flight = pp if in_flight is None else in_flight
    layers = model.stage_layers(pp) if stage_layers is None else stage_layers
    params = max(stage_params(model, pp, tp, ep, stage=0, layers=layers),
                 stage_params(model, pp, tp, ep, stage=pp - 1, layers=layers))
    recomputed_layers = min(recomputed_layers, layers)

    def layer(recompute: str) -> float:
        return activation_bytes(seq, micro_batch_size, model.hidden_size, model.num_attention_heads, tp,
                                recompute=recompute, sequence_parallel=sequence_parallel, value_bytes=FP32_BYTES)

    whole = layer("selective" if selective_recompute else "none")
    kept = (layers - recomputed_layers) * whole + recomputed_layers * layer("full")
    rematerialised = whole if recomputed_layers else 0
    logits = micro_batch_size * seq * model.vocab_size // tp * FP32_BYTES * 3  # logits, softmax, its gradient
    state = TRAIN_BYTES_PER_PARAM - ADAM_MOMENT_BYTES + ADAM_MOMENT_BYTES / optimizer_shards
    return int(params * state) + int(kept * in_flight + rematerialised) + logits


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE_KINDS:
        raise ValueError(f"recompute {recompute!r}: use none, selective or full")
