"""Tensor parallelism's collectives in the planner's costs: each part's time is its compute plus
the collectives megatron-core runs on the TP group (counted here from a trace of its layers, as
docs/cost_model.md lists them), priced by a made-up line so that every sum can be written by hand."""

import numpy as np
import pytest

from megatron_dynapipe.hardware import load_hardware
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.planning.cost_model import (
    AnalyticalCostModel,
    StageCosts,
    TensorParallelCollectives,
    split_over_cp,
    tp_collectives,
)
from megatron_dynapipe.planning.cost_model.link import Link
from megatron_dynapipe.planning.cost_model.tensor_parallel import LinearGemms, exposed_ms, label_pass
from megatron_dynapipe.planning.types import RecomputeType

H, TP = 1024, 4
LATENCY = {"all_reduce": 0.05, "all_gather": 0.02, "reduce_scatter": 0.03}  # ms a collective
PER_MB = {"all_reduce": 0.4, "all_gather": 0.2, "reduce_scatter": 0.25}  # ms a MB (2**20 bytes)


def line(kind: str, nbytes):
    return LATENCY[kind] + PER_MB[kind] * np.asarray(nbytes, dtype=float) / 2**20


def ar(nbytes):
    return line("all_reduce", nbytes)


def ag(nbytes):
    return line("all_gather", nbytes)


def rs(nbytes):
    return line("reduce_scatter", nbytes)


def compute_model(cp: int = 1) -> AnalyticalCostModel:
    model = AnalyticalCostModel(hidden_size=H, num_heads=16, ffn_hidden_size=4 * H, tp=TP, saturation_tokens=0,
                                fused_attention=True)
    return model if cp == 1 else split_over_cp(model, cp)


@pytest.mark.parametrize("mbs, seqlen", [(1, 4096), (3, 1000)])
def test_without_sequence_parallelism_each_part_waits_for_its_all_reduces(mbs, seqlen):
    inner = compute_model()
    model = TensorParallelCollectives(inner, line)
    act = mbs * seqlen * H * 2  # bf16 activations of the micro-batch, whole on every TP rank
    expected = {  # (layer, phase, recompute): the collectives a part waits for
        ("encoder", "forward", "none"): 2 * ar(act),
        ("encoder", "backward", "none"): 2 * ar(act),
        ("encoder", "backward", "selective"): 2 * ar(act),  # the core again: no collective
        ("encoder", "backward", "full"): 4 * ar(act),  # the forward's two again
        ("preprocess", "forward", "none"): ar(act),
        ("preprocess", "backward", "none"): 0.0,
        ("postprocess", "forward", "none"): 3 * ar(mbs * seqlen * 4),  # the loss: three fp32 values a token
        ("postprocess", "backward", "none"): ar(act),
    }
    for (layer, phase, rc), comm in expected.items():
        assert model.layer_ms(layer, phase, rc, mbs, seqlen) == pytest.approx(
            inner.layer_ms(layer, phase, rc, mbs, seqlen) + comm, rel=1e-12), (layer, phase, rc)


def test_with_sequence_parallelism_the_layers_gather_and_scatter_instead():
    inner = compute_model()
    model = TensorParallelCollectives(inner, line, sequence_parallel=True)
    act = 2 * 2048 * H * 2
    expected = {
        ("encoder", "forward", "none"): 2 * ag(act) + 2 * rs(act),
        ("encoder", "backward", "none"): 4 * ag(act) + 2 * rs(act),  # two inputs gathered again for the weights
        ("encoder", "backward", "full"): 6 * ag(act) + 4 * rs(act),
        ("preprocess", "forward", "none"): ar(act),
        ("preprocess", "backward", "none"): ag(act),
        ("postprocess", "forward", "none"): ag(act) + 3 * ar(2 * 2048 * 4),
        ("postprocess", "backward", "none"): ag(act) + rs(act),
    }
    for (layer, phase, rc), comm in expected.items():
        assert model.layer_ms(layer, phase, rc, 2, 2048) == pytest.approx(
            inner.layer_ms(layer, phase, rc, 2, 2048) + comm, rel=1e-12), (layer, phase, rc)


RATE = 2e10  # FLOP a ms of the made-up GEMMs: 2 m n k / RATE, no waves, no tiles
VOCAB = 32768
SLOWER = 1.25  # the made-up GEMMs beside an overlap that takes SMs


def gemm(m, n, k):
    return 2.0 * m * n * k / RATE


def gemms():
    spec = ModelSpec(num_layers=2, hidden_size=H, num_attention_heads=16, vocab_size=VOCAB,
                     make_vocab_size_divisible_by=128)
    return LinearGemms.of(spec, TP, gemm, lambda m, n, k: SLOWER * gemm(m, n, k))


def gemm_flops_ms(width_in, width_out, tokens):
    """Any of a linear's three GEMMs: 2 x tokens x its two widths FLOPs."""
    return 2.0 * tokens * width_in * width_out / RATE


def timeline_exposed(how, comm, compute, tp):
    """What a collective adds beyond its GEMM, by walking chunk by chunk (an independent check of
    exposed_ms's closed forms): one link carries the chunks in order, one GEMM stream takes them."""
    if how == "beside":
        return max(comm, compute) - compute
    if how == "ring exchange":  # chunk 0 is the rank's own; chunk k arrives after k exchanges
        gemm_end, arrived = 0.0, 0.0
        for k in range(tp):
            if k:
                arrived += comm / (tp - 1)
            gemm_end = max(gemm_end, arrived) + compute / tp
        return gemm_end - compute
    n = 4  # pipelined: chunk k is reduce-scattered after its GEMM chunk
    link_end = 0.0
    for k in range(n):
        link_end = max(link_end, (k + 1) * compute / n) + comm / n
    return link_end - compute


@pytest.mark.parametrize("how", ["beside", "ring exchange", "pipelined"])
@pytest.mark.parametrize("comm, compute", [(0.1, 1.0), (1.0, 1.0), (3.0, 1.0), (0.7, 0.75), (2.0, 0.0)])
def test_what_a_collective_exposes_beside_its_gemm_matches_a_chunk_by_chunk_timeline(how, comm, compute):
    assert exposed_ms(how, comm, compute, TP) == pytest.approx(timeline_exposed(how, comm, compute, TP), abs=1e-12)
    assert exposed_ms("waited", comm, compute, TP) == comm


def test_the_linears_gemms_are_the_layers_shapes_on_one_rank():
    g, tokens = gemms(), 3000.0
    padded_vocab = VOCAB  # already a multiple of 128 x TP
    for linear, (k_in, n_out) in {"qkv": (H, 3 * H / TP), "fc1": (H, 4 * H / TP), "head": (H, padded_vocab / TP),
                                   "proj": (H / TP, H), "fc2": (4 * H / TP, H)}.items():
        for which in ("fprop", "dgrad", "wgrad"):
            assert g.ms(linear, which, tokens) == pytest.approx(gemm_flops_ms(k_in, n_out, tokens)), (linear, which)


def test_a_column_parallel_backward_waits_only_for_what_outlasts_its_gemms():
    """megatron-core's column-parallel linears (QKV, FC1, the head) launch the input's re-gather
    beside the input-gradient GEMM and the gradient's reduction beside the weight-gradient GEMM;
    the rest wait. At 4096 tokens QKV's and FC1's GEMMs (0.32 and 0.43 ms) hide the made-up line's
    8 MB collectives at a hundredth of its price, and only in part at its price (3.2-3.3 ms)."""
    inner, tokens = compute_model(), 4096
    act = tokens * H * 2
    qkv, fc1, head = (gemm_flops_ms(H, w, tokens) for w in (3 * H / TP, 4 * H / TP, VOCAB / TP))
    for scale in (0.01, 1.0):  # collectives shorter than the GEMMs, and longer
        def price(kind, nbytes, scale=scale):
            return scale * line(kind, nbytes)
        plain = TensorParallelCollectives(inner, price, gemms=gemms())
        sp = TensorParallelCollectives(inner, price, sequence_parallel=True, gemms=gemms())
        out = lambda c, g: max(c - g, 0.0)  # noqa: E731
        expected = {
            (plain, "encoder", "backward"): out(price("all_reduce", act), fc1) + out(price("all_reduce", act), qkv),
            (plain, "encoder", "forward"): 2 * price("all_reduce", act),
            (plain, "postprocess", "backward"): out(price("all_reduce", act), head),
            (sp, "encoder", "backward"): 2 * price("all_gather", act)  # the gradients into FC2 and the projection
            + out(price("all_gather", act), fc1) + out(price("reduce_scatter", act), fc1)
            + out(price("all_gather", act), qkv) + out(price("reduce_scatter", act), qkv),
            (sp, "encoder", "forward"): 2 * price("all_gather", act) + 2 * price("reduce_scatter", act),
            (sp, "postprocess", "backward"): out(price("all_gather", act), head)
            + out(price("reduce_scatter", act), head),
            (sp, "postprocess", "forward"): price("all_gather", act) + 3 * price("all_reduce", tokens * 4),
        }
        for (model, layer, phase), comm in expected.items():
            assert model.layer_ms(layer, phase, "none", 1, tokens) == pytest.approx(
                inner.layer_ms(layer, phase, "none", 1, tokens) + comm, rel=1e-12), (scale, layer, phase)
    assert line("all_reduce", act) / 100 < qkv < fc1 < line("all_reduce", act)


def test_tp_comm_overlap_rings_and_pipelines_the_other_gathers_and_scatters_under_their_gemms():
    """Transformer-engine's userbuffers: ring exchanges under the GEMMs the gathers feed, the
    forward's reduce-scatters pipelined after theirs, the column-parallel backward's as bulk
    overlaps. A bulk or pipelined overlap holds SMs, so its GEMM runs SLOWER on the rest: the
    collective hides under that longer GEMM, and the difference adds too."""
    inner, tokens = compute_model(), 2048
    act = tokens * H * 2
    ring = lambda c, g: max(c - g * (TP - 1) / TP, 0.0)  # noqa: E731
    pipelined = lambda c, g: c / 4 + 0.75 * max(c - g, 0.0) + (SLOWER - 1) * g / SLOWER  # noqa: E731
    bulk = lambda c, g: max(c - g, 0.0) + (SLOWER - 1) * g / SLOWER  # noqa: E731
    qkv, proj, fc1, fc2 = (gemm_flops_ms(a, b, tokens) for a, b in (
        (H, 3 * H / TP), (H / TP, H), (H, 4 * H / TP), (4 * H / TP, H)))
    model = TensorParallelCollectives(inner, line, sequence_parallel=True, overlap=True, gemms=gemms())
    ag, rs = line("all_gather", act), line("reduce_scatter", act)
    # each pipelined or bulk one beside its GEMM as slowed (its time alone x SLOWER)
    forward = ring(ag, qkv) + pipelined(rs, SLOWER * proj) + ring(ag, fc1) + pipelined(rs, SLOWER * fc2)
    backward = (ring(ag, fc2) + bulk(ag, SLOWER * fc1) + bulk(rs, SLOWER * fc1)
                + ring(ag, proj) + bulk(ag, SLOWER * qkv) + bulk(rs, SLOWER * qkv))
    for phase, rc, comm in (("forward", "none", forward), ("backward", "none", backward),
                            ("backward", "full", forward + backward)):
        assert model.layer_ms("encoder", phase, rc, 1, tokens) == pytest.approx(
            inner.layer_ms("encoder", phase, rc, 1, tokens) + comm, rel=1e-12), (phase, rc)
    # the head is megatron-core's own linear: its forward gather waits
    assert model.layer_ms("postprocess", "forward", "none", 1, tokens) == pytest.approx(
        inner.layer_ms("postprocess", "forward", "none", 1, tokens) + ag + 3 * line("all_reduce", tokens * 4))
    with pytest.raises(ValueError, match="sequence_parallel"):
        TensorParallelCollectives(inner, line, overlap=True)
    waited = TensorParallelCollectives(inner, line, sequence_parallel=True, gemms=gemms(), async_backward=False)
    assert waited.layer_ms("encoder", "backward", "none", 1, tokens) == pytest.approx(
        inner.layer_ms("encoder", "backward", "none", 1, tokens) + 4 * ag + 2 * rs)


def test_a_traced_pass_is_labelled_layer_by_layer_per_call_site():
    """The call sites of a megatron-core trace: a backward with full recompute holds each layer's
    forward again; the head's come first in a backward, the embedding's last."""
    col_f, col_b = "layers.forward", "layers.backward"
    gather, scatter, reduce = ("mappings._gather_along_first_dim", "mappings._reduce_scatter_along_first_dim",
                               "mappings._reduce")
    layer_fwd = [("all_gather", col_f), ("reduce_scatter", scatter), ("all_gather", col_f), ("reduce_scatter", scatter)]
    layer_bwd = [("all_gather", gather), ("all_gather", col_b), ("reduce_scatter", col_b),
                 ("all_gather", gather), ("all_gather", col_b), ("reduce_scatter", col_b)]
    calls = [("all_gather", col_b), ("reduce_scatter", col_b)] + (layer_fwd + layer_bwd) * 2 + [("all_gather", gather)]
    labels = [(linear, which) if label else None for label in label_pass(calls, True)
              for linear, which in [label[1:] if label else (None, None)]]
    fwd = [("qkv", "fprop"), ("proj", "fprop"), ("fc1", "fprop"), ("fc2", "fprop")]
    bwd = [("fc2", "dgrad"), ("fc1", "dgrad"), ("fc1", "wgrad"), ("proj", "dgrad"), ("qkv", "dgrad"), ("qkv", "wgrad")]
    assert labels == [("head", "dgrad"), ("head", "wgrad")] + (fwd + bwd) * 2 + [("embedding", None)]
    # a forward without sequence parallelism: the embedding's all-reduce, then the projections'; the
    # loss's are no layer's
    forward = [("all_reduce", reduce)] * 5 + [("all_reduce", "cross_entropy.forward")]
    assert [label and label[1] for label in label_pass(forward, False)] == [
        "embedding", "proj", "fc2", "proj", "fc2", None]
    # a count no dense layer gives is left unlabelled (waited for)
    assert label_pass([("all_reduce", col_b)] * 2 + [("all_gather", col_b)], False) == [
        ("all_reduce", "fc1", "wgrad"), ("all_reduce", "qkv", "wgrad"), None]


def test_under_context_parallelism_the_collectives_carry_a_ranks_share_of_the_tokens():
    inner = compute_model(cp=2)
    model = TensorParallelCollectives(inner, line)
    assert model.layer_ms("encoder", "forward", "none", 1, 8192) == pytest.approx(
        inner.layer_ms("encoder", "forward", "none", 1, 8192) + 2 * ar(4096 * H * 2))


def test_the_planners_arrays_and_memory_match_the_scalar_answers():
    inner = compute_model()
    model = TensorParallelCollectives(inner, line, sequence_parallel=True)
    mbs, seqlen = np.array([1.0, 2.0, 4.0]), np.array([4096.0, 1500.0, 333.0])
    types = list(RecomputeType)
    costs = model.shape_costs(types, mbs, seqlen)
    bare = inner.shape_costs(types, mbs, seqlen)
    for row, rc in enumerate(types):
        for k, (layer, phase) in enumerate([("encoder", "forward"), ("encoder", "backward"),
                                            ("postprocess", "forward"), ("postprocess", "backward"),
                                            ("preprocess", "forward"), ("preprocess", "backward")]):
            assert costs[row, k] == pytest.approx(model.layer_ms(layer, phase, rc, mbs, seqlen)), (rc, layer, phase)
        np.testing.assert_array_equal(costs[row, 6:], bare[row, 6:])  # activations: the inner model's
    assert StageCosts(model, num_layers=8, pp=2).model is model


def test_tp_1_has_no_collectives_and_the_hardware_prices_the_group_it_names():
    one = AnalyticalCostModel(hidden_size=H, num_heads=16, tp=1)
    assert tp_collectives(one, line) is one
    h100 = load_hardware("h100")
    group = h100.tp_collective_ms(TP)
    sizes = np.array([1e6, 4e7])
    np.testing.assert_allclose(group("all_reduce", sizes),
                               [h100.collective_us("all_reduce", n, range(TP)) / 1e3 for n in sizes])
    # NVLink within the node: 2 (n - 1) / n of the bytes at its bus bandwidth, 2 (n - 1) latency steps
    link = h100.link("all_reduce", False)
    ring = 2 * (TP - 1) * link.latency_us + 2 * (TP - 1) / TP * 4e7 / (link.bandwidth_GBps * 1e3)
    assert group("all_reduce", 4e7) <= ring / 1e3 + 1e-12


def test_under_sequence_parallelism_a_stage_sends_its_tp_ranks_sequence_shard():
    """Megatron's pipeline sends each TP rank's [tokens / TP, hidden] shard under sequence
    parallelism, the whole [tokens, hidden] without it (each TP rank its own copy)."""
    link = Link(bandwidth_GBps=40.0, latency_us=8.0)
    act = 4096 * H * 2
    for sequence_parallel, nbytes in ((False, act), (True, act / TP)):
        model = TensorParallelCollectives(compute_model(), line, sequence_parallel=sequence_parallel)
        costs = StageCosts(model, num_layers=8, pp=2, link=link)
        assert costs.p2p_ms(1, 4096) == pytest.approx((8.0 + nbytes / 40e3) / 1e3)
    under_cp = StageCosts(TensorParallelCollectives(compute_model(cp=2), line, sequence_parallel=True), num_layers=8,
                          pp=2, link=link)
    assert under_cp.p2p_ms(1, 4096) == pytest.approx((8.0 + act / 2 / TP / 40e3) / 1e3)
