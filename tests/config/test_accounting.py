"""Parameters, FLOPs and activation bytes against published counts and the papers' closed forms,
each written out here rather than taken from the code under test."""

import dataclasses
import math

import pytest

from megatron_dynapipe.config.accounting import (
    activation_bytes,
    layer_params,
    microbatch_flops,
    stage_params,
    step_flops,
    total_params,
    training_bytes,
)
from megatron_dynapipe.config.model import ModelSpec, get_model

GPT3 = get_model("175")  # h 12288, 96 layers, 96 heads, vocabulary 51200
LLAMA2_70B = ModelSpec(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                       ffn_hidden_size=28672, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
                       position_embedding_type="rope", vocab_size=32000, share_embeddings_and_output_weights=False)


def test_a_gpt_layer_holds_12_h_squared_plus_13_h_parameters():
    h = GPT3.hidden_size  # QKV 3h^2 + 3h, projection h^2 + h, MLP 8h^2 + 5h, two LayerNorms 4h
    assert layer_params(GPT3) == 12 * h * h + 13 * h


def test_llama_2_70b_layers_hold_its_published_parameter_count():
    # Meta's 68,976,648,192 parameters, less its two untied 32000 x 8192 embedding tables and the
    # final RMSNorm's 8192 weights: GQA (8 key/value heads of 128), SwiGLU, no biases.
    assert LLAMA2_70B.num_layers * layer_params(LLAMA2_70B) == 68_976_648_192 - 2 * 32000 * 8192 - 8192


def test_a_single_stage_holds_everything_but_the_final_norm():
    h = GPT3.hidden_size
    assert total_params(GPT3) - stage_params(GPT3, pp=1) == 2 * h  # the final LayerNorm's weight and bias
    assert stage_params(GPT3, pp=8, tp=8, stage=3) == 12 * layer_params(GPT3) // 8  # a middle stage: layers only


def _narayanan(batch, seq, model, vocab, attention_fraction, passes):
    """Narayanan et al. (SC'21), eq. 3, per iteration: passes/3 x 72 B s l h^2 (1 + s/(6h) + V/(12 l h)),
    with the attention-score term scaled by ``attention_fraction`` (1/2 with a causal mask) and the
    output layer always run three times."""
    b, s, l, h, v = batch, seq, model.num_layers, model.hidden_size, vocab
    layers = passes * 24 * b * s * l * h * h * (1 + attention_fraction * s / (6 * h))
    return layers + 6 * b * s * h * v


@pytest.mark.parametrize("causal, fraction", [(False, 1.0), (True, 0.5)])
def test_step_flops_are_narayanans_count(causal, fraction):
    vocab = GPT3.padded_vocab_size(1)
    expected = _narayanan(1536, 2048, GPT3, vocab, fraction, passes=3)
    assert math.isclose(step_flops(GPT3, 1536 * 2048, 2048, causal=causal), expected, rel_tol=1e-12)


def test_full_recompute_adds_one_forward_of_the_layers():
    vocab = GPT3.padded_vocab_size(8)  # padded for TP 8, as the simulator counts it
    expected = _narayanan(1536, 2048, GPT3, vocab, 0.5, passes=4)  # eq. 4's 96 B s l h^2 (...)
    assert math.isclose(step_flops(GPT3, 1536 * 2048, 2048, tp=8, recompute="full"), expected, rel_tol=1e-12)


def test_a_micro_batch_on_one_stage_is_a_step_of_its_tokens():
    one = microbatch_flops(GPT3, pp=1, micro_batch_size=2, seq_length=2048)
    assert math.isclose(one, step_flops(GPT3, 2 * 2048, 2048), rel_tol=1e-12)
    recomputed = microbatch_flops(GPT3, pp=1, micro_batch_size=2, seq_length=2048, recomputed_layers=96)
    assert math.isclose(recomputed, step_flops(GPT3, 2 * 2048, 2048, recompute="full"), rel_tol=1e-12)
    # MoE: a token visits top-k experts, so k MLPs' worth, not the model's E
    moe = dataclasses.replace(get_model("6.7"), num_experts=8, moe_router_topk=2)
    dense = get_model("6.7")
    h, f = dense.hidden_size, dense.ffn_hidden_size
    extra_mlp = 3 * 2 * 2 * h * f * 2048 * dense.num_layers  # one more MLP per token and layer, three passes
    assert math.isclose(microbatch_flops(moe, 1, seq_length=2048) - microbatch_flops(dense, 1, seq_length=2048),
                        extra_mlp, rel_tol=1e-12)


S, B, H, A, T = 2048, 1, 12288, 96, 8


@pytest.mark.parametrize("recompute, sequence_parallel, per_sbh", [
    ("none", False, 10 + 24 / T + 5 * A * S / (H * T)),  # Korthikanti et al. (2022), Table 2
    ("selective", False, 10 + 24 / T),
    ("none", True, 34 / T + 5 * A * S / (H * T)),
    ("selective", True, 34 / T),
    ("full", False, 2),
    ("full", True, 2 / T),
])
def test_activation_bytes_are_korthikantis_table(recompute, sequence_parallel, per_sbh):
    got = activation_bytes(S, B, H, A, T, recompute=recompute, sequence_parallel=sequence_parallel)
    assert math.isclose(got, S * B * H * per_sbh, rel_tol=1e-12)
    fp32 = activation_bytes(S, B, H, A, T, recompute=recompute, sequence_parallel=sequence_parallel, value_bytes=4)
    assert math.isclose(fp32, 2 * got, rel_tol=1e-12)


def test_what_the_training_options_save():
    model, kw = get_model("6.7"), dict(micro_batch_size=1, seq_length=2048)
    base = training_bytes(model, 4, 2, **kw)
    params = max(stage_params(model, 4, 2, stage=0), stage_params(model, 4, 2, stage=3))
    # the distributed optimizer shards Adam's two fp32 moments (8 of the 16 bytes) over DP
    assert base - training_bytes(model, 4, 2, **kw, optimizer_shards=8) == pytest.approx(8 * params * (1 - 1 / 8), abs=1)
    # selective recompute drops the attention scores of every layer of every micro-batch in flight
    scores = 5 * model.num_attention_heads * 2048 * 2048 / 2 * 2  # 5 a s^2 b / t 16-bit values, in fp32
    dropped = base - training_bytes(model, 4, 2, **kw, selective_recompute=True)
    assert dropped == pytest.approx(model.stage_layers(4) * 4 * scores, rel=1e-9)
    # sequence parallelism splits the 10 s b h values outside the tensor-parallel regions too
    assert training_bytes(model, 4, 2, **kw, sequence_parallel=True) < base


def test_an_unknown_recompute_is_refused():
    with pytest.raises(ValueError, match="use none, selective or full"):
        step_flops(GPT3, 1, 1, recompute="partial")


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_fused_attention_core_keeps_no_scores(sequence_parallel):
    """Korthikanti's 5 a s / (h t) score term is what an unfused core adds without recompute; a fused
    core never keeps it: s b h (10 + 24/t), or 34/t with sequence parallelism, at 16 bits."""
    s, b, h, a, t = 4096, 2, 8192, 64, 8
    outside = 34 / t if sequence_parallel else 10 + 24 / t
    for recompute in ("none", "selective"):
        assert activation_bytes(s, b, h, a, t, recompute=recompute, sequence_parallel=sequence_parallel,
                                fused_attention=True) == pytest.approx(s * b * h * outside)
    unfused = activation_bytes(s, b, h, a, t, sequence_parallel=sequence_parallel)
    assert unfused == pytest.approx(s * b * h * (outside + 5 * a * s / (h * t)))
