"""The roofline cost model: GEMMs in waves of tiles over a device's SMs, elementwise kernels at
memory bandwidth, against closed forms written out here."""

import json
import re

import pytest

from megatron_dynapipe.config.model import get_model
from megatron_dynapipe.hardware import HardwareFileError, load_hardware
from megatron_dynapipe.planning.cost_model.roofline import DeviceRoofline, RooflineCostModel

A100 = DeviceRoofline(peak_tflops=312.0, memory_bandwidth_GBps=2039.0, sms=108, gemm_tile=(256, 128),
                      gemm_efficiency=0.8, memory_efficiency=0.85)


def sm_ms(flops: float) -> float:
    """ms one SM needs for ``flops`` at 80% of a 312 TFLOP/s part split over 108 SMs."""
    return flops / (312e12 * 0.8 / 108) * 1e3


def test_a_large_gemm_runs_at_the_efficiency_times_its_last_waves_fill():
    # 8192^3: 32 x 64 = 2048 tiles, 19 waves of 108 SMs, the last one 104 / 108 full
    ms = A100.gemm_ms(8192, 8192, 8192)
    assert ms == pytest.approx(19 * sm_ms(2 * 256 * 128 * 8192))
    achieved = 2 * 8192**3 / (ms / 1e3) / 312e12
    assert achieved == pytest.approx(0.8 * 2048 / (19 * 108))


def test_a_gemm_beside_a_kernel_that_holds_sms_runs_in_the_waves_the_rest_make():
    # 8192^3's 2048 tiles: 19 waves on 108 SMs, 23 on the 92 that a 16-SM kernel leaves; each SM
    # computes at its own rate still
    beside = A100.without_sms(16)
    assert beside.sms == 92 and beside.gemm_ms(8192, 8192, 8192) == pytest.approx(23 * sm_ms(2 * 256 * 128 * 8192))
    # 216 tiles (two full waves on 108) take three waves on 92
    assert beside.gemm_ms(12 * 256, 18 * 128, 4096) / A100.gemm_ms(12 * 256, 18 * 128, 4096) == pytest.approx(1.5)


def test_an_edge_tile_computes_its_padding():
    k = 128  # too short to split
    assert A100.gemm_ms(256, 128, k) == pytest.approx(sm_ms(2 * 256 * 128 * k))
    assert A100.gemm_ms(257, 128, k) == pytest.approx(sm_ms(2 * 256 * 128 * k))  # 2 tiles, still one wave
    assert A100.gemm_ms(1, 1, k) == pytest.approx(A100.gemm_ms(256, 128, k))


def test_few_tiles_split_k_over_the_idle_sms():
    k = 1 << 16
    # 6 x 9 = 54 tiles: two SMs per tile, each half of k
    assert A100.gemm_ms(6 * 256, 9 * 128, k) == pytest.approx(sm_ms(2 * 256 * 128 * k / 2))
    # one tile split 108 ways computes fast enough that reading its operands binds
    assert A100.gemm_ms(256, 128, k) == pytest.approx(2 * (256 * k + k * 128 + 256 * 128) / (2039e9 * 0.85) * 1e3)


def test_a_gemm_that_moves_more_than_it_computes_is_bound_by_memory():
    m, n, k = 8192, 8192, 16  # an outer product: 2 x 8192^2 x 16 FLOPs, 8192^2 16-bit outputs
    nbytes = 2 * (m * k + k * n + m * n)
    assert A100.gemm_ms(m, n, k) == pytest.approx(nbytes / (2039e9 * 0.85) * 1e3)


def test_efficiency_rises_with_the_models_width():
    def achieved(hidden):
        model = RooflineCostModel(A100, hidden_size=hidden, num_heads=hidden // 128, vocab_size=51200)
        flops = model.encoder_flops("forward", "none", 1, 2048)
        return flops / (model.layer_ms("encoder", "forward", "none", 1, 2048) / 1e3) / 312e12
    widths = [1024, 2304, 4096, 8192, 12288]
    shares = [achieved(h) for h in widths]
    assert shares == sorted(shares) and shares[-1] < 0.8 and shares[0] < 0.6 * shares[-1]


def test_a_layers_forward_is_its_six_gemms_and_its_elementwise_bytes():
    h, a, f, s, b, t = 4096, 32, 16384, 2048, 2, 2
    model = RooflineCostModel(A100, hidden_size=h, num_heads=a, ffn_hidden_size=f, vocab_size=51200, tp=t)
    T, heads, d = b * s, a // t, h // a
    g = A100.gemm_ms
    gemms = (g(T, 3 * h // t, h) + g(T, h, h // t) + g(T, f // t, h) + g(T, h, f // t)
             + g(s, s, d, b * heads) + g(s, d, s, b * heads))
    # per token: layer norms 2 x (h in, h out), bias-dropout-adds 2 x (2h in, h out, h one-byte mask),
    # bias-GeLU f/t in and out; per score: softmax in and out, dropout in, out and a one-byte mask
    elements = T * (2 * 2 * h + 2 * 3.5 * h + 2 * f / t) + b * heads * s * s * 4.5
    assert model.layer_ms("encoder", "forward", "none", b, s) == pytest.approx(
        gemms + 2 * elements / (2039e9 * 0.85) * 1e3)


def test_backward_runs_two_gemms_per_forward_gemm_and_recompute_adds_forwards():
    model = RooflineCostModel(A100, hidden_size=4096, num_heads=32, vocab_size=51200)
    fwd = model.layer_ms("encoder", "forward", "none", 1, 2048)
    none = model.layer_ms("encoder", "backward", "none", 1, 2048)
    assert 1.8 * fwd < none < 2.2 * fwd  # square-ish GEMMs: both backward GEMMs cost about the forward's
    assert model.layer_ms("encoder", "backward", "full", 1, 2048) == pytest.approx(none + fwd)
    selective = model.layer_ms("encoder", "backward", "selective", 1, 2048)
    assert none < selective < none + fwd


def test_the_shipped_hardware_prices_compute_by_shape_and_names_itself():
    a100 = load_hardware("a100")
    model = a100.cost_model(get_model("6.7"), tp=1, dtype="bfloat16")
    assert isinstance(model, RooflineCostModel) and model.hardware == "A100-80GB-SXM"
    h100 = load_hardware("h100").cost_model(get_model("6.7"), tp=1, dtype="bfloat16")
    ratio = model.layer_ms("encoder", "forward", "none", 1, 2048) / h100.layer_ms("encoder", "forward", "none", 1, 2048)
    assert 1.5 < ratio < 989.4 / 312  # faster, but less than the peaks' ratio: memory-bound kernels gain less


def test_every_matmul_of_a_gqa_swiglu_layer_is_priced_at_its_width():
    """Llama-style: 8 key/value groups of 128 narrow K and V to 1024 each, SwiGLU's gate doubles
    the first MLP matmul, its activation reads two values and writes one."""
    h, a, groups, f, s, b, t = 8192, 64, 8, 28672, 4096, 1, 4
    model = RooflineCostModel(A100, hidden_size=h, num_heads=a, ffn_hidden_size=f, vocab_size=128256, tp=t,
                              num_query_groups=groups, swiglu=True)
    T, heads, d = b * s, a // t, 128
    g = A100.gemm_ms
    gemms = (g(T, (a + 2 * groups) * d // t, h) + g(T, h, h // t) + g(T, 2 * f // t, h) + g(T, h, f // t)
             + g(s, s, d, b * heads) + g(s, d, s, b * heads))
    elements = T * (2 * 2 * h + 2 * 3.5 * h + 3 * f / t) + b * heads * s * s * 4.5
    assert model.layer_ms("encoder", "forward", "none", b, s) == pytest.approx(
        gemms + 2 * elements / (2039e9 * 0.85) * 1e3)
    plain = RooflineCostModel(A100, hidden_size=h, num_heads=a, ffn_hidden_size=f, vocab_size=128256, tp=t)
    # parameters: QKV (h x (a + 2g) d) + output h^2 + gated MLP 3 h f, biases, two norms
    weights = h * (a + 2 * groups) * 128 + h * h + 3 * h * f
    assert model.param_mb("encoder") == pytest.approx(2 * (weights + (a + 2 * groups) * 128 + 2 * f) / t / 2**20
                                                      + 2 * (4 * h + 2 * h) / 2**20)
    assert model.param_mb("encoder") > plain.param_mb("encoder")


H100_ATTENTION = DeviceRoofline(peak_tflops=989.4, memory_bandwidth_GBps=3350.0, sms=132, gemm_efficiency=0.7,
                                attention_efficiency=(0.6, 0.5), attention_latency_us=(50.0, 200.0))


def test_a_fused_attention_core_computes_the_causal_half_at_its_measured_line():
    """Forward: two GEMMs over the causal half, 2 b a s^2 d FLOPs at 0.6 of peak plus 50 us; backward
    2.5 times those FLOPs at 0.5 plus 200 us; no softmax or dropout pass over the scores."""
    h, a, s, b, t = 4096, 32, 8192, 1, 2
    fused = RooflineCostModel(H100_ATTENTION, hidden_size=h, num_heads=a, vocab_size=51200, tp=t,
                              fused_attention=True)
    unfused = RooflineCostModel(H100_ATTENTION, hidden_size=h, num_heads=a, vocab_size=51200, tp=t)
    flops = 2 * b * (a // t) * s * s * 128
    core = {"forward": flops / (989.4e12 * 0.6) * 1e3 + 0.05, "backward": 2.5 * flops / (989.4e12 * 0.5) * 1e3 + 0.2}
    for phase in ("forward", "backward"):
        linear = unfused._linear_ms(phase, b, s)
        assert fused.layer_ms("encoder", phase, "none", b, s) == pytest.approx(linear + core[phase])
        assert fused.layer_ms("encoder", phase, "none", b, s) < unfused.layer_ms("encoder", phase, "none", b, s)
    assert fused.layer_ms("encoder", "backward", "selective", b, s) == pytest.approx(
        unfused._linear_ms("backward", b, s) + core["backward"] + core["forward"])
    # a fused core keeps no s x s scores: no recompute keeps what selective keeps of the unfused one
    assert fused.activation_mb("stored", "none", b, s) == pytest.approx(unfused.activation_mb("stored", "selective", b, s))
    assert fused.activation_mb("stored", "none", b, s) < 0.5 * unfused.activation_mb("stored", "none", b, s)


def test_the_h100_file_carries_its_measured_attention_and_the_job_says_which_core_runs():
    """A job whose attention is fused is priced by the H100's measured line of the kernel it runs:
    transformer-engine's layers by cuDNN's, torch's SDPA core by its flash kernel's (about half
    the rate); the local (unfused) one by its GEMMs and softmax passes; the constants are those
    the kernel benchmark fitted (benchmarks/results/h100-kernels.json)."""
    import dataclasses
    import subprocess
    import sys

    h100 = load_hardware("h100")
    assert h100.roofline("bfloat16").attention_efficiency == (0.621, 0.518)
    assert h100.roofline("bfloat16", "transformer_engine").attention_efficiency == (0.621, 0.518)
    assert h100.roofline("bfloat16", "sdpa").attention_efficiency == (0.3144, 0.2964)
    spec = get_model("6.7")
    te, sdpa = (h100.cost_model(dataclasses.replace(spec, attention=core), tp=1, dtype="bfloat16")
                for core in ("transformer_engine", "sdpa"))
    local = h100.cost_model(spec, tp=1, dtype="bfloat16")
    assert te.fused_attention and sdpa.fused_attention and not local.fused_attention
    forward = {name: model.layer_ms("encoder", "forward", "none", 1, 8192) for name, model in
               (("te", te), ("sdpa", sdpa), ("local", local))}
    assert forward["te"] < forward["sdpa"] < 0.85 * forward["local"]
    assert te.attention_core_ms("forward", "none", 1, 8192) == pytest.approx(
        2 * 32 * 8192**2 * 128 / (989.4e9 * 0.621) + 0.0586)  # the causal half at cuDNN's line
    assert sdpa.attention_core_ms("forward", "none", 1, 8192) == pytest.approx(
        2 * 32 * 8192**2 * 128 / (989.4e9 * 0.3144) + 0.0852)  # at torch's flash kernel's
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    fitted = subprocess.run([sys.executable, str(root / "benchmarks/bench_kernels.py"), "--summarize",
                             str(root / "benchmarks/results/h100-kernels.json")], capture_output=True, text=True,
                            timeout=120)
    lines = json.loads(fitted.stdout)
    line = lines["attention_cudnn_attention"]
    assert (round(line["forward_efficiency"], 3), round(line["backward_efficiency"], 3)) == (0.621, 0.518)
    flash = lines["attention_flash_attention"]
    assert (round(flash["forward_efficiency"], 4), round(flash["backward_efficiency"], 4)) == (0.3144, 0.2964)
    assert h100.roofline("bfloat16").attention_latency_us == pytest.approx(
        (line["forward_latency_us"], line["backward_latency_us"]), abs=0.1)


@pytest.mark.parametrize("compute,says", [({"gemm_tile": [256, 128]}, "needs 'sms'"),
                                          ({"sms": 108, "fused_attention": {"forward_efficiency": 0.5}},
                                           "forward_efficiency, backward_efficiency"),
                                          ({"sms": 108, "gemm_efficiency": 1.5}, "efficiencies in (0, 1]"),
                                          ({"sms": 108, "tiles": 4}, "may have gemm_tile")])
def test_a_bad_compute_section_is_refused_in_one_line(tmp_path, compute, says):
    doc = load_hardware("a100").to_json()
    doc["compute"] = compute
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(HardwareFileError, match=re.escape(says)) as error:
        load_hardware(path)
    assert "\n" not in str(error.value)


def test_a_dtype_the_file_does_not_price_is_refused_naming_the_ones_it_does():
    """Megatron-LM's flags say bf16; the file's keys are torch's dtype names."""
    with pytest.raises(HardwareFileError, match=re.escape("'bf16': name one it has (bfloat16, float16, float32)")):
        load_hardware("h100").cost_model(get_model("6.7"), 1, "bf16")



@pytest.mark.parametrize("name,tp,fused", [("175", 8, True), ("6.7", 1, False), ("tiny", 1, True)])
def test_one_pass_over_a_shapes_kernels_answers_what_asking_each_layer_and_recompute_type_does(name, tp, fused):
    """shape_costs prices each kernel once and composes the recompute types from them; the
    planner must see exactly what layer_ms and activation_mb give one question at a time,
    including the shapes that do not fit the device (inf)."""
    import dataclasses

    import numpy as np

    from megatron_dynapipe.planning.cost_model.base import CostModel
    from megatron_dynapipe.planning.types import RecomputeType

    model = dataclasses.replace(get_model(name), attention="sdpa" if fused else "local")
    cm = load_hardware("h100").cost_model(model, tp, "bfloat16", sequence_parallel=tp > 1)
    types = tuple(RecomputeType)
    mbs, seq = np.array([1, 2, 3, 8, 64, 1]), np.array([48, 512, 2048, 4096, 8192, 1 << 24])
    one_pass = cm.shape_costs(types, mbs, seq)
    assert np.isinf(one_pass[:, :, -1]).all() and np.isfinite(one_pass[:, :, 0]).all()
    np.testing.assert_array_equal(one_pass, CostModel.shape_costs(cm, types, mbs, seq))
    np.testing.assert_array_equal(cm.shape_costs(types[1:], 2, 1024), CostModel.shape_costs(cm, types[1:], 2, 1024))
