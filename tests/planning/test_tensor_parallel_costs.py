"""Tensor parallelism's collectives in the planner's costs: each part's time is its compute plus
the collectives megatron-core runs on the TP group (counted here from a trace of its layers, as
docs/cost_model.md lists them), priced by a made-up line so that every sum can be written by hand."""

import numpy as np
import pytest

from megatron_dynapipe.hardware import load_hardware
from megatron_dynapipe.planning.cost_model import (
    AnalyticalCostModel,
    StageCosts,
    TensorParallelCollectives,
    split_over_cp,
    tp_collectives,
)
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


def test_overlapped_gathers_and_scatters_show_only_beyond_the_compute():
    """--tp-comm-overlap: a part takes the longer of its compute and its all-gathers and
    reduce-scatters; its all-reduces still wait."""
    inner = compute_model()
    def scaled(ms_per_mb):  # ms a MB, no latency: 0.0001 hides under the layer's 0.22 ms, 1 does not
        return lambda kind, nbytes: ms_per_mb * np.asarray(nbytes, dtype=float) / 2**20

    act = 4096 * H * 2
    for price, hidden in ((scaled(1e-4), True), (scaled(1.0), False)):
        model = TensorParallelCollectives(inner, price, sequence_parallel=True, overlap=True)
        compute = inner.layer_ms("encoder", "forward", "none", 1, 4096)
        beside = 2 * price("all_gather", act) + 2 * price("reduce_scatter", act)
        assert (beside < compute) == hidden
        assert model.layer_ms("encoder", "forward", "none", 1, 4096) == pytest.approx(max(compute, beside))
        embedding = inner.layer_ms("preprocess", "forward", "none", 1, 4096)
        assert model.layer_ms("preprocess", "forward", "none", 1, 4096) == pytest.approx(
            embedding + price("all_reduce", act))  # an all-reduce is not overlapped
    with pytest.raises(ValueError, match="sequence_parallel"):
        TensorParallelCollectives(inner, line, overlap=True)


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
