"""Floating-point operations of a GPT training step, counted the way MFU is usually counted.

A multiply-accumulate is 2 FLOPs; the backward pass costs twice the forward (so a step is 3x
the forward); every matrix multiply of the model counts, element-wise work does not.  Per token
and layer the forward is the QKV and output projections ``2 h (q + 2 kv) + 2 q h`` (``q`` query
width, ``kv`` key/value width), the attention scores and their product with the values
``2 * 2 q s`` (halved for a causal mask, as megatron-core 0.16 counts), the MLP
``2 (h up + f h)`` (``up = 2 f`` with SwiGLU; ``top-k`` experts for MoE), and once per token the
output layer ``2 h V`` on the padded vocabulary.  *Model* FLOPs count the step once; *hardware*
FLOPs add the forward that full activation recomputation runs again.
"""

from __future__ import annotations

from megatron_dynapipe.models import ModelSpec

__all__ = ["forward_flops_per_token", "step_flops"]


def forward_flops_per_token(model: ModelSpec, seq_length: int, *, tp: int = 1, causal: bool = True) -> tuple[float, float]:
    """(transformer layers, output layer) forward FLOPs of one token of a ``seq_length`` sequence."""
    h, q, kv = model.hidden_size, model.num_attention_heads * model.head_dim, model.query_groups * model.head_dim
    projections = 2 * h * (q + 2 * kv) + 2 * q * h
    scores = 2 * 2 * q * seq_length * (0.5 if causal else 1.0)
    if model.num_experts:
        f, visits = model.moe_ffn_hidden_size or model.ffn_hidden_size, min(model.moe_router_topk, model.num_experts)
    else:
        f, visits = model.ffn_hidden_size, 1
    up = 2 * f if model.swiglu else f
    mlp = 2 * (h * up + f * h) * visits
    layers = model.num_layers * (projections + scores + mlp)
    return float(layers), float(2 * h * model.padded_vocab_size(tp))


def step_flops(model: ModelSpec, tokens: int, seq_length: int, *, tp: int = 1, recompute: str = "none",
               causal: bool = True) -> float:
    """FLOPs of one training step over ``tokens`` tokens of ``seq_length``-token sequences.

    ``recompute="full"`` adds the layers' forward once more (hardware FLOPs); ``"none"`` and
    ``"selective"`` (which recomputes only the attention core) count the step as it is modelled.
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute {recompute!r}: use none, selective or full")
    layers, output = forward_flops_per_token(model, seq_length, tp=tp, causal=causal)
    passes = 4 if recompute == "full" else 3
    return tokens * (passes * layers + 3 * output)
