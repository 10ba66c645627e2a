"""Context parallelism in the planner: one rank's share of a micro-batch, against the whole
sequence's work split c ways and the ring's transfers written out here; plans at CP layouts."""

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dynapipe.config.model import get_model
from megatron_dynapipe.hardware import load_hardware
from megatron_dynapipe.planning.cost_model import (
    AnalyticalCostModel,
    ContextParallelCostModel,
    CostModelError,
    StageCosts,
    load_cost_model,
    split_over_cp,
)
from megatron_dynapipe.planning.planner import PlanningError, generate_execution_plan
from megatron_dynapipe.planning.spec import TrainingSpec
from megatron_dynapipe.planning.types import RecomputeType

from megatron_dynapipe.planning.cost_model.profile_file import to_text
from test_planner import plan_and_check  # tests/planning is on the path, as pytest collects it
from test_profile_file import _records, _with_attention_core, _with_packed_rows

RATE = 312.0 * 1e9 * 0.5  # FLOP per ms of the analytical model's defaults
H, HEADS, FFN = 1024, 16, 4096


def flops(phase: str, rc: RecomputeType, s: float, causal: bool) -> float:
    """One layer's FLOPs on one sequence of ``s`` tokens (tp 1): the linear layers' 2 FLOPs a
    weight a token (QKV, projection, two MLP matmuls), the scores and their product with the
    values 2 s^2 h each (half of them causal); backward twice the forward, and what ``rc`` runs
    again."""
    linear = 2 * s * (4 * H * H + 2 * H * FFN)
    attention = 4 * s * s * H * (0.5 if causal else 1.0)
    forward = linear + attention
    if phase == "forward":
        return forward
    again = {RecomputeType.NONE: 0.0, RecomputeType.SELECTIVE: attention, RecomputeType.FULL: forward}[rc]
    return 2 * forward + again


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("cp", [2, 4])
def test_a_rank_of_a_cp_group_does_a_cth_of_the_whole_sequences_layer_work(cp, fused):
    model = AnalyticalCostModel(hidden_size=H, num_heads=HEADS, ffn_hidden_size=FFN, saturation_tokens=0,
                                fused_attention=fused)
    split = ContextParallelCostModel(model, cp)
    s = 8192
    for rc in RecomputeType:
        for phase in ("forward", "backward"):
            assert split.layer_ms("encoder", phase, rc, 1, s) == pytest.approx(
                flops(phase, rc, s, causal=fused) / cp / RATE, rel=1e-9), (rc, phase)
    # the head and the embedding see the rank's s / c tokens
    assert split.layer_ms("postprocess", "forward", "none", 2, s) == model.layer_ms("postprocess", "forward", "none",
                                                                                     2, s // cp)


def test_a_rank_holds_the_activations_logits_and_messages_of_its_share_and_every_weight():
    model = AnalyticalCostModel(hidden_size=H, num_heads=HEADS, ffn_hidden_size=FFN)
    split = ContextParallelCostModel(model, 4)
    for kind in ("stored", "peak"):
        for rc in RecomputeType:
            assert split.activation_mb(kind, rc, 2, 8192) == model.activation_mb(kind, rc, 2, 2048)
        assert split.logits_mb(kind, 2, 8192) == model.logits_mb(kind, 2, 2048)
    assert split.param_mb("encoder") == model.param_mb("encoder")
    costs, whole = StageCosts(split, num_layers=8, pp=2), StageCosts(model, num_layers=8, pp=2)
    assert costs.p2p_ms(2, 8192) == pytest.approx(2 * 2 * 2048 * H / (100.0 * 1e6))  # 16-bit, 100 GB/s
    assert costs.model_state_mb(0) == whole.model_state_mb(0)
    # asked through the stage costs' memo and one by one, the same answers
    many = costs.all_stages(np.array([1.0, 2.0]), np.array([4096.0, 8192.0]), "selective")
    assert many["backward"][1, 1] == pytest.approx(costs.backward_ms(1, 2, 8192, "selective"))
    assert many["stored"][0, 0] == pytest.approx(costs.stored_mb(0, 1, 4096, "selective"))


@pytest.mark.parametrize("cp", [2, 4])
def test_the_rings_transfers_show_where_they_outlast_its_blocks(cp):
    # GQA: 4 key/value heads of 64 channels (width 256) at tp 2: one step moves K and V of the
    # rank's s / c tokens, 2 x 2 B x 128 channels each a token
    model = AnalyticalCostModel(hidden_size=H, num_heads=HEADS, ffn_hidden_size=FFN, num_query_groups=4, tp=2,
                                saturation_tokens=0, fused_attention=True)
    b, s = 2, 8192
    local = s // cp
    kv_ms = lambda gbps: 2 * 2 * b * local * 128 / (gbps * 1e6)  # noqa: E731
    block = {phase: model.attention_core_ms(phase, "none", b, local) for phase in ("forward", "backward")}
    hidden = ContextParallelCostModel(model, cp)
    for gbps in (1.0, 1e6):
        ring = ContextParallelCostModel(model, cp, ring_gbps=gbps)
        kv = kv_ms(gbps)
        forward = (cp - 1) * max(0.0, kv - block["forward"])
        backward = 2 * max(0.0, kv - block["backward"]) + (cp - 2) * max(0.0, 2 * kv - block["backward"])
        for rc, expect in ((RecomputeType.NONE, {"forward": forward, "backward": backward}),
                           (RecomputeType.FULL, {"forward": forward, "backward": backward + forward})):
            for phase in ("forward", "backward"):
                exposed = ring.layer_ms("encoder", phase, rc, b, s) - hidden.layer_ms("encoder", phase, rc, b, s)
                assert exposed == pytest.approx(expect[phase], rel=1e-9, abs=1e-12), (gbps, rc, phase)
        if gbps == 1.0:
            assert forward > 0  # a slow link shows
        else:
            assert forward == backward == 0.0


def test_the_rooflines_attention_core_is_what_selective_recompute_runs_again():
    roofline = load_hardware("h100").cost_model(get_model("13B"), 2, "bfloat16")
    for s in (1024, 4096):
        again = (roofline.layer_ms("encoder", "backward", "selective", 1, s)
                 - roofline.layer_ms("encoder", "backward", "none", 1, s))
        assert roofline.attention_core_ms("forward", "none", 1, s) == pytest.approx(again)
        assert (roofline.attention_core_ms("backward", "selective", 1, s)
                - roofline.attention_core_ms("backward", "none", 1, s)) == pytest.approx(again)
    split = split_over_cp(roofline, 2)
    assert split.attention is roofline  # priced by the roofline's own attention kernels


def test_a_profile_takes_the_attention_share_of_its_models_shape():
    profile = load_cost_model("gpt-6.7b-a100", 1)
    spec = get_model("6.7B")
    with pytest.raises(CostModelError, match="does not price the attention core apart"):
        split_over_cp(profile, 2)
    split = split_over_cp(profile, 2, spec)
    shape = AnalyticalCostModel(hidden_size=4096, num_heads=32, ffn_hidden_size=16384,
                                vocab_size=spec.padded_vocab_size(1))
    b, s = 1, 4096
    share = (shape.attention_core_ms("forward", "none", b, s // 2) / shape.layer_ms("encoder", "forward", "none", b,
                                                                                     s // 2))
    local = profile.layer_ms("encoder", "forward", "none", b, s // 2)
    assert split.layer_ms("encoder", "forward", "none", b, s) == pytest.approx(local * (1 + share))
    assert split_over_cp(profile, 1) is profile


def test_a_profile_that_measured_the_attention_core_prices_the_rings_blocks_by_it(tmp_path):
    # the core without a mask: a fifth of the layer's forward, a quarter of its backward
    records = _with_attention_core(_records())
    path = tmp_path / "p.json"
    path.write_text(to_text({"name": "test", "hidden_size": 64, **records.records()}))
    profile = load_cost_model(path, 1)
    split = split_over_cp(profile, 4, get_model("tiny"))  # a shape given, and still the measured core
    # rank holds 64 of 256 tokens a row; the ring adds 3 x 64 x 64 / 2 query-key pairs a row,
    # unmasked: 3 halves of the unmasked core at 64
    for phase, core in (("forward", 0.2), ("backward", 0.25)):
        local = profile.layer_ms("encoder", phase, "none", 2, 64)
        assert split.layer_ms("encoder", phase, "none", 2, 256) == pytest.approx(local * (1 + 3 * core / 2))
    # full recompute runs the ring's forward blocks again in backward
    forward, backward = (profile.layer_ms("encoder", phase, "none", 2, 64) for phase in ("forward", "backward"))
    assert (split.layer_ms("encoder", "backward", "full", 2, 256)
            - profile.layer_ms("encoder", "backward", "full", 2, 64)) == pytest.approx(
        3 * (0.25 * backward + 0.2 * forward) / 2)
    # the ring's transfers take their width from the GPT's shape: the tiny GPT's 8 groups of 16 channels
    slow = split_over_cp(profile, 4, get_model("tiny"), ring_gbps=0.01)
    kv = 2 * 2 * 64 * (2 * 8 * 16) / (0.01 * 1e6)  # 16-bit K and V of 2 rows of 64 tokens
    exposed = 3 * (kv - 0.2 * forward / 2)
    assert (slow.layer_ms("encoder", "forward", "none", 2, 256) - split.layer_ms("encoder", "forward", "none", 2, 256)
            == pytest.approx(exposed))
    with pytest.raises(CostModelError, match="has no width of keys and values for the ring's transfers"):
        ContextParallelCostModel(profile, 4, ring_gbps=1.0)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_packages_own_ring_pays_every_transfer_over_the_link_its_profile_measured(tmp_path, cp):
    # a profile of megatron-core's local layers in fp32: the ring gathers K and V before its core
    # (cp - 1 steps) and passes their gradients back after it (cp - 1 more), no block beside them
    records = _with_attention_core(_records())
    link = {"latency_us": 300.0, "bandwidth_GBps": 0.5}
    meta = {"dtype": "fp32", "layer_spec": "local", "model": get_model("tiny").to_json()}
    path = tmp_path / "p.json"
    path.write_text(to_text({"name": "test", "hidden_size": 64, "metadata": meta, **records.records()}))
    (tmp_path / "linked.json").write_text(to_text({"name": "test", "hidden_size": 64,
                                                    "metadata": dict(meta, link=link), **records.records()}))
    unlinked = split_over_cp(load_cost_model(path, 1), cp)
    linked = split_over_cp(load_cost_model(tmp_path / "linked.json", 1), cp)
    b, s = 2, 64 * cp
    step = 0.3 + 4 * b * 64 * (2 * 8 * 16) / (0.5 * 1e9) * 1e3  # fp32 K and V of the tiny GPT's 8 groups of 16
    for rc, steps in ((RecomputeType.NONE, {"forward": cp - 1, "backward": cp - 1}),
                      (RecomputeType.FULL, {"forward": cp - 1, "backward": 2 * (cp - 1)})):
        for phase in ("forward", "backward"):
            added = linked.layer_ms("encoder", phase, rc, b, s) - unlinked.layer_ms("encoder", phase, rc, b, s)
            assert added == pytest.approx(steps[phase] * step), (rc, phase)
    # the pipeline's transfers cross the same link: fp32 hidden states of the rank's tokens
    assert StageCosts(linked, num_layers=4, pp=2).p2p_ms(b, s) == pytest.approx(0.3 + 4 * b * 64 * 64 / 0.5e6)


def test_a_profile_that_timed_a_real_cp_group_corrects_the_rings_price_by_it(tmp_path):
    """Measured on a CP 2 group: whole rows of 128 tokens, forward at 1 and 2 rows, backward at 1,
    recompute none; packed rows at 1.  Each measured point prices as measured; elsewhere the ring's
    price is scaled by the measured / priced ratios, interpolated between points and held past them."""
    records = _with_packed_rows(_with_attention_core(_records()), factor=1.25)
    plain_path, path = tmp_path / "plain.json", tmp_path / "measured.json"
    plain_path.write_text(to_text({"name": "test", "hidden_size": 64, **records.records()}))
    measured = {("padded", "forward", 1): 2.0, ("padded", "forward", 2): 3.0, ("padded", "backward", 1): 5.0,
                ("thd", "forward", 1): 10.0, ("thd", "backward", 1): 20.0}
    for (layout, phase, mbs), ms in measured.items():
        records.cp_times[(1, 2, "none", layout, phase, 128, mbs)] = ms
    path.write_text(to_text({"name": "test", "hidden_size": 64, **records.records()}))
    tiny = get_model("tiny")
    plain, split = (split_over_cp(load_cost_model(p, 1), 2, tiny) for p in (plain_path, path))

    def ms(model, phase, mbs, seq, rc="none"):
        return model.layer_ms("encoder", phase, rc, mbs, seq)

    assert [ms(split, "forward", 1, 128), ms(split, "forward", 2, 128), ms(split, "backward", 1, 128)] == \
        pytest.approx([2.0, 3.0, 5.0])
    ratios = {m: measured["padded", "forward", m] / ms(plain, "forward", m, 128) for m in (1, 2)}
    assert ms(split, "forward", 1.5, 128) == pytest.approx(ms(plain, "forward", 1.5, 128) * (ratios[1] + ratios[2]) / 2)
    assert ms(split, "forward", 2, 256) == pytest.approx(ms(plain, "forward", 2, 256) * ratios[2])  # past the longest
    assert ms(split, "backward", 2, 128) == pytest.approx(ms(plain, "backward", 2, 128) * 5.0 / ms(plain, "backward",
                                                                                                   1, 128))
    assert ms(split, "forward", 2, 128, "full") == ms(plain, "forward", 2, 128, "full")  # not measured
    assert ms(split.packed(), "forward", 1, 128) == pytest.approx(10.0)
    assert ms(split.packed(), "backward", 1, 128) == pytest.approx(20.0)
    assert "corrected by a CP 2 group's times" in split.describe() and "corrected" not in plain.describe()
    # the arrays the planner asks for, as the scalars
    mbs, seqs = np.array([1.0, 1.5, 2.0]), np.array([128.0, 128.0, 256.0])
    costs = split.shape_costs([RecomputeType.NONE], mbs, seqs)[0]
    for k, phase in enumerate(("forward", "backward")):  # the encoder's columns come first
        assert costs[k] == pytest.approx([ms(split, phase, m, q) for m, q in zip(mbs, seqs)])
    # a trace records the ring's transfers itself, and a cluster's link is not the one measured
    # here: those models are left as priced
    for other in (dict(ring_transfers=False), dict(ring_gbps=100.0)):
        assert ms(split_over_cp(load_cost_model(path, 1), 2, tiny, **other), "forward", 1, 128) == ms(
            split_over_cp(load_cost_model(plain_path, 1), 2, tiny, **other), "forward", 1, 128)


def test_a_profile_that_measured_a_cp_groups_memory_corrects_the_activations_by_it(tmp_path):
    """A CP 2 group stored 1.3 and 1.5 times what the CP 1 layer stores at half the tokens (rows
    of 128 tokens, one and two rows) and peaked at 2 times: the split model's activations are those
    at the measured points, the ratios interpolated between them and held past them, whatever link
    prices the ring; the stage costs the planner reads carry them."""
    records = _records()
    plain_path, path = tmp_path / "plain.json", tmp_path / "measured.json"
    plain_path.write_text(to_text({"name": "test", "hidden_size": 64, **records.records()}))
    for mbs, stored in ((1, 1.3), (2, 1.5)):
        for kind, ratio in (("stored", stored), ("peak", 2.0)):
            records.cp_memory[(1, 2, "none", "padded", kind, 128, mbs)] = ratio * records.memory[(1, "none", kind, 64,
                                                                                                 mbs)]
    path.write_text(to_text({"name": "test", "hidden_size": 64, **records.records()}))
    tiny = get_model("tiny")
    plain, split = (split_over_cp(load_cost_model(p, 1), 2, tiny) for p in (plain_path, path))
    inner = load_cost_model(plain_path, 1)
    none = RecomputeType.NONE

    # _records: stored 3 MB and peak 1 MB a row of 64 tokens, in proportion to the tokens
    assert split.activation_mb("stored", none, 1, 128) == pytest.approx(1.3 * 3.0)
    assert split.activation_mb("stored", none, 2, 128) == pytest.approx(1.5 * 6.0)
    assert split.activation_mb("stored", none, 1.5, 128) == pytest.approx(1.4 * 4.5)  # between the rows
    assert split.activation_mb("stored", none, 2, 256) == pytest.approx(1.5 * 12.0)  # past the longest
    # before the shortest: 32 tokens a rank, which the profile prices as its shortest row, 64
    assert split.activation_mb("peak", none, 1, 64) == pytest.approx(2.0 * 1.0)
    assert plain.activation_mb("stored", none, 1, 128) == inner.activation_mb("stored", none, 1, 64) == 3.0
    assert split.activation_mb("stored", RecomputeType.FULL, 1, 128) == plain.activation_mb(
        "stored", RecomputeType.FULL, 1, 128)  # not measured
    assert "corrected by a CP 2 group's memory" in split.describe()
    linked = split_over_cp(load_cost_model(path, 1), 2, tiny, ring_gbps=100.0)
    assert linked.activation_mb("stored", none, 1, 128) == pytest.approx(1.3 * 3.0)
    costs = StageCosts(split, num_layers=4, pp=1)
    assert costs.stored_mb(0, 2, 128, "none") - StageCosts(plain, num_layers=4, pp=1).stored_mb(0, 2, 128, "none") \
        == pytest.approx(4 * 0.5 * 6.0)  # four layers, each half again


def test_bad_context_parallel_settings_are_refused_in_one_line():
    model = AnalyticalCostModel(hidden_size=H, num_heads=HEADS)
    for make, says in [(lambda: ContextParallelCostModel(model, 1), "cp >= 2"),
                       (lambda: ContextParallelCostModel(ContextParallelCostModel(model, 2), 2), "wrap the inner"),
                       (lambda: ContextParallelCostModel(model, 2, ring_gbps=0.0), "ring_gbps must be > 0"),
                       (lambda: TrainingSpec(num_layers=8, pp=2, cp=8), "make seqlen_round a multiple of 16")]:
        with pytest.raises(ValueError, match=re.escape(says)):
            make()
    spec = TrainingSpec(num_layers=8, pp=2, cp=4)
    with pytest.raises(PlanningError, match="cannot price CP 4 .* not of CP 4"):
        generate_execution_plan([100, 200], spec, StageCosts(ContextParallelCostModel(model, 2), num_layers=8, pp=2))


def test_samples_too_long_for_one_rank_plan_split_over_a_cp_group_and_run_faster():
    model = AnalyticalCostModel(hidden_size=H, num_heads=HEADS, vocab_size=32000, device_memory_mb=16384)
    lengths = [16384, 12000, 3000, 800, 200, 64]
    with pytest.raises(PlanningError):
        generate_execution_plan(lengths, TrainingSpec(num_layers=8, pp=2, memory_limit_mb=6_000.0), model)
    spec = TrainingSpec(num_layers=8, pp=2, memory_limit_mb=6_000.0, cp=4)
    result = plan_and_check(lengths, spec, model)
    assert result.costs.model.cp == 4
    assert all(mb.seq_len % 8 == 0 for choice in result.choices for mb in choice.microbatches)
    # on four times the GPUs a batch both layouts plan is faster split than alone
    short = [4000, 3000, 800, 200, 64, 64]
    alone = generate_execution_plan(short, TrainingSpec(num_layers=8, pp=2, memory_limit_mb=6_000.0), model)
    split = generate_execution_plan(short, spec, model)
    assert split.makespan_ms < alone.makespan_ms


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_samples_under_cp_take_the_room_their_2cp_chunks_need(cp):
    """Each packed sample is padded to a multiple of 2 x CP tokens before it is split: the planner
    packs rows with that room, so the data pipeline's padded samples fit them."""
    model = AnalyticalCostModel(hidden_size=H, num_heads=HEADS, vocab_size=32000, device_memory_mb=16384)
    lengths = [int(n) for n in np.random.default_rng(cp).integers(1, 900, size=60)]
    spec = TrainingSpec(num_layers=8, pp=2, memory_limit_mb=6_000.0, cp=cp, packing="varlen")
    result = generate_execution_plan(lengths, spec, model)
    packed = [mb for choice in result.choices for mb in choice.microbatches]
    assert sorted(i for mb in packed for i in mb.samples) == list(range(60))
    for mb in packed:
        room = [-(-lengths[i] // (2 * cp)) * (2 * cp) for i in mb.samples]
        assert mb.packed and list(mb.packed_lengths) == room and sum(room) <= mb.seq_len


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=40),
    cp=st.sampled_from([2, 4]),
    pp=st.integers(1, 3),
    chunks=st.integers(1, 2),
    limit=st.sampled_from([6_000.0, 16_000.0]),
    fast=st.booleans(),
)
def test_cp_batches_plan_to_valid_deadlock_free_plans_within_memory(lengths, cp, pp, chunks, limit, fast):
    # samples up to cp x 4096 tokens: on each rank as long as the plain property test's
    if pp == 1:
        chunks = 1
    lengths = [n * cp for n in lengths]
    spec = TrainingSpec(num_layers=2 * pp * chunks, pp=pp, memory_limit_mb=limit, fast_mode=fast, chunks=chunks,
                        cp=cp)
    model = AnalyticalCostModel(hidden_size=H, num_heads=HEADS, vocab_size=32000, device_memory_mb=16384)
    assert plan_and_check(lengths, spec, model).costs.model.cp == cp
