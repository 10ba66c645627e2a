"""Cost models: expected values come from the profile file itself or from hand arithmetic."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dynapipe.config.model import get_model
from megatron_dynapipe.planning.cost_model import (
    AnalyticalCostModel,
    CostModel,
    CostModelError,
    Link,
    ProfiledCostModel,
    StageCosts,
    load_cost_model,
    profile_mismatch,
)
from megatron_dynapipe.planning.types import RecomputeType as R

from project import ROOT

PROFILE = ROOT / "megatron_dynapipe" / "planning" / "profiles" / "gpt-6.7b-a100.json"
SEQLENS = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 6144, 8192]


@pytest.fixture(scope="module")
def profile() -> Path:
    return PROFILE


@pytest.fixture(scope="module")
def raw(profile):
    """The profile as plain dictionaries, read independently of the code under test."""
    doc = json.loads(profile.read_text())
    times = {
        (r["tp"], r["recompute"], r["layer"], r["phase"], r["seqlen"], r["mbs"]): r["ms"]
        for r in doc["layer_time"]
    }
    memory = {
        (r["tp"], r["recompute"], r["kind"], r["seqlen"], r["mbs"]): r["mb"]
        for r in doc["activation_memory"]
    }
    return doc, times, memory


@pytest.fixture(scope="module")
def models(profile):
    return {tp: ProfiledCostModel.from_json(profile, tp) for tp in (1, 2, 4, 8)}


# --- profiled: exact points, interpolation, range ------------------------------------------------


def test_every_profiled_time_is_reproduced_exactly(raw, models):
    _, times, _ = raw
    for (tp, rc, layer, phase, s, m), ms in times.items():
        assert models[tp].layer_ms(layer, phase, R.parse(rc), m, s) == ms


def test_every_profiled_activation_is_reproduced_exactly(raw, models):
    _, _, memory = raw
    for (tp, rc, kind, s, m), mb in memory.items():
        assert models[tp].activation_mb(kind, R.parse(rc), m, s) == mb


def test_array_paths_reproduce_the_table(raw, models):
    _, times, _ = raw
    m = np.array([1, 2, 4, 8])
    expected = np.array([times[(1, "none", "encoder", "backward", 2048, k)] for k in m])
    got = models[1].layer_ms("encoder", "backward", R.NONE, m, 2048)
    np.testing.assert_array_equal(got, expected)
    got2 = models[1].layer_ms("encoder", "backward", R.NONE, m, np.full(4, 2048))
    np.testing.assert_array_equal(got2, expected)
    s = np.array(SEQLENS)
    expected = np.array([times[(2, "full", "postprocess", "forward", k, 1)] for k in s])
    np.testing.assert_array_equal(models[2].layer_ms("postprocess", "forward", "full", 1, s), expected)


def test_midpoint_in_mbs_is_linear(raw, models):
    _, times, _ = raw
    lo = times[(1, "none", "encoder", "forward", 2048, 2)]
    hi = times[(1, "none", "encoder", "forward", 2048, 4)]
    got = models[1].layer_ms("encoder", "forward", R.NONE, 3, 2048)
    assert min(lo, hi) < got < max(lo, hi)
    assert got == pytest.approx((lo + hi) / 2, rel=1e-12)
    # a quarter of the way from 8 to 16 at seqlen 512
    lo = times[(4, "selective", "encoder", "backward", 512, 8)]
    hi = times[(4, "selective", "encoder", "backward", 512, 16)]
    got = models[4].layer_ms("encoder", "backward", R.SELECTIVE, np.array([10]), 512)[0]
    assert got == pytest.approx(0.75 * lo + 0.25 * hi, rel=1e-12)


def test_midpoint_in_seqlen_is_linear(raw, models):
    _, times, memory = raw
    lo = times[(1, "none", "encoder", "forward", 2048, 1)]
    hi = times[(1, "none", "encoder", "forward", 4096, 1)]
    got = models[1].layer_ms("encoder", "forward", R.NONE, 1, 3072)
    assert lo < got < hi
    assert got == pytest.approx((lo + hi) / 2, rel=1e-12)
    lo = memory[(8, "full", "stored", 4096, 2)]
    hi = memory[(8, "full", "stored", 6144, 2)]
    got = models[8].activation_mb("stored", R.FULL, 2, 4608)  # 1/4 of the way
    assert got == pytest.approx(0.75 * lo + 0.25 * hi, rel=1e-12)


def test_bilinear_point_matches_hand_computation(raw, models):
    _, times, _ = raw

    def t(s, m):
        return times[(2, "selective", "encoder", "backward", s, m)]

    # seqlen 1280 is 1/4 from 1024 to 2048; mbs 3 is halfway from 2 to 4
    row_1024 = (t(1024, 2) + t(1024, 4)) / 2
    row_2048 = (t(2048, 2) + t(2048, 4)) / 2
    expected = 0.75 * row_1024 + 0.25 * row_2048
    cm = models[2]
    assert cm.layer_ms("encoder", "backward", R.SELECTIVE, 3, 1280) == pytest.approx(expected, rel=1e-12)
    vec = cm.layer_ms("encoder", "backward", R.SELECTIVE, np.array([3, 3]), np.array([1280, 1280]))
    np.testing.assert_allclose(vec, expected, rtol=1e-12)


def test_seqlen_below_profiled_costs_as_much_as_the_shortest(raw, models):
    _, times, _ = raw
    for s in (1, 8, 15, 16):
        assert models[1].layer_ms("encoder", "forward", R.NONE, 4, s) == times[
            (1, "none", "encoder", "forward", 16, 4)
        ]
    got = models[1].layer_ms("encoder", "forward", R.NONE, np.array([4, 4]), np.array([3, 16]))
    np.testing.assert_array_equal(got, times[(1, "none", "encoder", "forward", 16, 4)])


def test_out_of_range_is_infinite(raw, models):
    _, times, _ = raw
    cm = models[1]
    # longer than the longest profiled sequence
    for s in (8193, 10_000):
        assert cm.layer_ms("encoder", "forward", R.NONE, 1, s) == math.inf
        assert cm.activation_mb("stored", R.FULL, 1, s) == math.inf
    assert np.all(np.isinf(cm.layer_ms("encoder", "forward", R.NONE, np.array([1, 2]), 9000)))
    # 2048 tokens profiled up to mbs 8 without recompute, 16 with full recompute
    assert (1, "none", "encoder", "forward", 2048, 16) not in times
    assert cm.layer_ms("encoder", "forward", R.NONE, 9, 2048) == math.inf
    full_16 = times[(1, "full", "encoder", "forward", 2048, 16)]
    assert cm.layer_ms("encoder", "forward", R.FULL, 16, 2048) == full_16
    # between 2048 (mbs <= 8) and 4096 (mbs <= 4): mbs 5 is beyond what the 4096 row profiled
    assert (1, "none", "encoder", "forward", 4096, 5) not in times
    assert cm.layer_ms("encoder", "forward", R.NONE, 5, 3000) == math.inf
    assert math.isfinite(cm.layer_ms("encoder", "forward", R.NONE, 4, 3000))
    got = cm.layer_ms("encoder", "forward", R.NONE, np.arange(1, 10), 3000)
    np.testing.assert_array_equal(np.isinf(got), np.arange(1, 10) > 4)
    got = cm.layer_ms("encoder", "forward", R.NONE, np.arange(1, 10), np.full(9, 3000))
    np.testing.assert_array_equal(np.isinf(got), np.arange(1, 10) > 4)
    # but exactly at 2048 only the 2048 row counts
    assert math.isfinite(cm.layer_ms("encoder", "forward", R.NONE, 8, 2048))
    # beyond every profiled micro-batch size
    assert cm.layer_ms("encoder", "forward", R.NONE, 4096, 16) == math.inf


def test_interpolation_stays_between_neighbours(models):
    """Between consecutive profiled points the interpolant is monotone and bounded by them."""
    cm = models[4]
    for rc in R:
        for layer, phase in [("encoder", "forward"), ("encoder", "backward"), ("postprocess", "backward")]:
            for s in SEQLENS:
                m = np.linspace(1, 2048, 4000)
                v = cm.layer_ms(layer, phase, rc, m, s)
                grid = cm.layer_ms(layer, phase, rc, 2.0 ** np.arange(12), s)
                for k in range(11):
                    if not np.isfinite(grid[k + 1]):
                        break
                    seg = v[(m >= 2**k) & (m <= 2 ** (k + 1))]
                    lo, hi = sorted((grid[k], grid[k + 1]))
                    assert np.all(seg >= lo - 1e-9) and np.all(seg <= hi + 1e-9)
                    assert np.all(np.diff(seg) * np.sign(grid[k + 1] - grid[k]) >= -1e-9)
        s = np.linspace(16, 8192, 3000)
        v = cm.activation_mb("stored", rc, 1, s)
        assert np.all(np.diff(v) >= 0)


def test_monotone_along_the_grid(raw, models):
    """Stored activations grow with mbs and seqlen everywhere; time does wherever the profile
    itself is monotone (micro-batches of at least 4096 tokens; below that it is timing noise)."""
    _, times, memory = raw
    for tp, cm in models.items():
        for rc in R:
            for s in SEQLENS:
                m = 2 ** np.arange(12)
                stored = cm.activation_mb("stored", rc, m, s)
                finite = stored[np.isfinite(stored)]
                assert len(finite) >= 1 and np.all(np.diff(finite) > 0)
            for m in (1, 2, 4):
                stored = cm.activation_mb("stored", rc, m, np.array(SEQLENS))
                finite = stored[np.isfinite(stored)]
                assert np.all(np.diff(finite) > 0)
    for (tp, rc, layer, phase, s, m), ms in times.items():
        if s * m < 4096:
            continue
        cm = models[tp]
        bigger_mbs = cm.layer_ms(layer, phase, rc, 2 * m, s)
        assert bigger_mbs >= ms
        nxt = SEQLENS.index(s) + 1
        if nxt < len(SEQLENS):
            assert cm.layer_ms(layer, phase, rc, m, SEQLENS[nxt]) >= ms


@settings(max_examples=200, deadline=None)
@given(
    mbs=st.floats(min_value=0.5, max_value=3000, allow_nan=False),
    seqlen=st.floats(min_value=1, max_value=9000, allow_nan=False),
    tp=st.sampled_from([1, 2, 4, 8]),
    rc=st.sampled_from(list(R)),
)
def test_scalar_and_array_paths_agree(models, mbs, seqlen, tp, rc):
    cm = models[tp]
    scalar = cm.layer_ms("encoder", "backward", rc, mbs, seqlen)
    row = cm.layer_ms("encoder", "backward", rc, np.array([mbs]), seqlen)[0]
    both = cm.layer_ms("encoder", "backward", rc, np.array([mbs]), np.array([seqlen]))[0]
    assert isinstance(scalar, float)
    if math.isinf(scalar):
        assert math.isinf(row) and math.isinf(both)
    else:
        assert row == pytest.approx(scalar, rel=1e-12) and both == pytest.approx(scalar, rel=1e-12)


def test_param_mb_comes_from_the_file(raw, models):
    doc, _, _ = raw
    for tp, cm in models.items():
        for layer in ("embedding", "encoder"):
            values = [r["mb"] for r in doc["model_state_memory"] if r["tp"] == tp and r["layer"] == layer]
            assert cm.param_mb(layer) == max(values)


def test_hidden_size_defaults_from_parameters_and_can_be_given(profile):
    assert ProfiledCostModel.from_json(profile, 2).hidden_size == 4096
    assert ProfiledCostModel.from_json(profile, 2, hidden_size=1234).hidden_size == 1234


def test_bad_arguments_are_rejected(models):
    with pytest.raises(ValueError, match="unknown layer"):
        models[1].layer_ms("decoder", "forward", R.NONE, 1, 16)
    with pytest.raises(ValueError, match="unknown phase"):
        models[1].layer_ms("encoder", "sideways", R.NONE, 1, 16)
    with pytest.raises(ValueError, match="unknown recompute"):
        models[1].layer_ms("encoder", "forward", "partial", 1, 16)
    with pytest.raises(ValueError, match="unknown activation kind"):
        models[1].activation_mb("kept", R.NONE, 1, 16)


# --- profiled: errors ----------------------------------------------------------------------------


def test_unknown_tp_names_the_profiled_ones(profile):
    with pytest.raises(CostModelError) as e:
        ProfiledCostModel.from_json(profile, 3)
    msg = str(e.value)
    assert "tp=3" in msg and "profiled: 1, 2, 4, 8" in msg and str(profile) in msg
    assert "\n" not in msg


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(CostModelError, match="not found: pass --cost-model PATH") as e:
        ProfiledCostModel.from_json(missing, 1)
    assert str(missing) in str(e.value) and "docs/cost_model.md" in str(e.value)
    assert isinstance(e.value, ValueError)


def _record(**kw):
    base = {"tp": 1, "recompute": "none", "layer": "encoder", "phase": "forward", "seqlen": 16,
            "mbs": 1, "ms": 1.0}
    base.update(kw)
    return base


def _minimal_doc():
    times = [_record(layer=layer, phase=phase, seqlen=s, mbs=m, ms=float(s * m))
             for layer in ("encoder", "postprocess") for phase in ("forward", "backward")
             for s in (16, 32) for m in (1, 2)]
    memory = [{"tp": 1, "recompute": "none", "layer": "encoder", "kind": kind, "seqlen": s,
               "mbs": m, "mb": float(s * m)}
              for kind in ("stored", "peak") for s in (16, 32) for m in (1, 2)]
    states = [{"tp": 1, "recompute": "none", "layer": layer, "mb": 10.0}
              for layer in ("embedding", "encoder")]
    return {"name": "tiny", "layer_time": times, "activation_memory": memory,
            "model_state_memory": states}


def _write(tmp_path, doc) -> Path:
    p = tmp_path / "cm.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


def test_minimal_file_loads_and_absent_recompute_is_infeasible(tmp_path):
    cm = ProfiledCostModel.from_json(_write(tmp_path, _minimal_doc()), 1, hidden_size=64)
    assert cm.layer_ms("encoder", "forward", R.NONE, 2, 24) == pytest.approx((32 + 64) / 2)
    assert cm.layer_ms("encoder", "forward", R.FULL, 1, 16) == math.inf
    assert np.all(np.isinf(cm.activation_mb("stored", R.SELECTIVE, np.array([1, 2]), 16)))
    assert isinstance(cm, CostModel) and cm.hidden_size == 64


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda d: "{not json", "is not valid JSON"),
        (lambda d: [], "not an object"),
        (lambda d: {k: v for k, v in d.items() if k != "activation_memory"},
         "lacks the key 'activation_memory'"),
        (lambda d: {**d, "layer_time": {}}, "'layer_time' is not a list"),
        (lambda d: {**d, "layer_time": d["layer_time"] + [{"tp": 1}]}, "without 'recompute'"),
        (lambda d: {**d, "layer_time": d["layer_time"] + [_record(recompute="some")]}, "unknown recompute"),
        (lambda d: {**d, "layer_time": d["layer_time"] + [_record(phase="up")]}, "phase 'up'"),
        (lambda d: {**d, "layer_time": d["layer_time"] + [_record(ms="fast")]},
         "'ms' is not a finite number"),
        (lambda d: {**d, "layer_time": d["layer_time"] + [_record(mbs=0)]},
         "'mbs' is not a positive integer"),
        (lambda d: {**d, "layer_time": d["layer_time"] + [_record(seqlen=48, ms=0.0)]},
         "has an encoder layer_time of 0 ms (seqlen 48, mbs 1): a transformer layer takes time"),
        (lambda d: {**d, "layer_time": d["layer_time"] + [_record(ms=99.0)]}, "conflicting layer_time"),
        (lambda d: {**d, "layer_time": [r for r in d["layer_time"] if r["layer"] != "postprocess"]},
         "no postprocess forward times"),
        (lambda d: {**d, "activation_memory": [r for r in d["activation_memory"] if r["kind"] != "peak"]},
         "no peak activation memory"),
        (lambda d: {**d, "model_state_memory": d["model_state_memory"][:1]},
         "no model_state_memory of the encoder"),
        (lambda d: {**d, "microbatch_overhead": {}}, "'microbatch_overhead' is not a list"),
        (lambda d: {**d, "microbatch_overhead": [_overhead(per="batch")]}, "a per of stage, layer"),
        (lambda d: {**d, "microbatch_overhead": [_overhead(ms=-1.0)]}, "not a finite number >= 0"),
    ],
)
def test_malformed_files_give_one_line_errors(tmp_path, mutate, fragment):
    path = _write(tmp_path, mutate(_minimal_doc()))
    with pytest.raises(CostModelError) as e:
        ProfiledCostModel.from_json(path, 1)
    msg = str(e.value)
    assert fragment in msg and str(path) in msg and "docs/cost_model.md" in msg
    assert "\n" not in msg


def _overhead(**kw):
    return {"tp": 1, "per": "stage", "phase": "forward", "ms": 1.0, "ms_per_token": 0.0, **kw}


def test_the_microbatch_overhead_is_paid_once_per_stage_and_once_per_layer(tmp_path):
    lines = {("stage", "forward"): (2.0, 0.01), ("stage", "backward"): (3.0, 0.0),
             ("layer", "forward"): (0.5, 0.001), ("layer", "backward"): (0.25, 0.002)}
    records = [_overhead(per=per, phase=phase, ms=ms, ms_per_token=per_token)
               for (per, phase), (ms, per_token) in lines.items()]
    doc = dict(_minimal_doc(), microbatch_overhead=records + [_overhead(tp=2, ms=100.0)])  # tp 2's: not tp 1's
    cm = ProfiledCostModel.from_json(_write(tmp_path, doc), 1, hidden_size=64)
    bare = ProfiledCostModel.from_json(_write(tmp_path, _minimal_doc()), 1, hidden_size=64)
    with_overhead, without = StageCosts(cm, num_layers=5, pp=2), StageCosts(bare, num_layers=5, pp=2)  # 3 + 2 layers
    tokens = 2 * 32
    for stage, layers in ((0, 3), (1, 2)):
        forward = 2.0 + 0.01 * tokens + layers * (0.5 + 0.001 * tokens)
        backward = 3.0 + layers * (0.25 + 0.002 * tokens)
        assert with_overhead.forward_ms(stage, 2, 32, R.NONE) == pytest.approx(
            without.forward_ms(stage, 2, 32, R.NONE) + forward)
        assert with_overhead.backward_ms(stage, 2, 32, R.NONE) == pytest.approx(
            without.backward_ms(stage, 2, 32, R.NONE) + backward)
    every = with_overhead.all_stages(np.array([2, 1]), np.array([32, 16]), R.NONE)  # the planner's path agrees
    for stage in (0, 1):
        assert every["forward"][stage] == pytest.approx(
            [with_overhead.forward_ms(stage, 2, 32, R.NONE), with_overhead.forward_ms(stage, 1, 16, R.NONE)])
    assert math.isinf(with_overhead.forward_ms(0, 64, 32, R.NONE))  # infeasible stays infeasible
    assert bare.microbatch_overhead_ms("forward", 2, 32, 3) == 0.0  # none measured: none paid


def test_load_cost_model_picks_the_source(profile):
    assert isinstance(load_cost_model(None, 2), AnalyticalCostModel)
    assert load_cost_model(None, 2, hidden_size=1024, num_heads=16).tp == 2
    cm = load_cost_model(str(profile), 4)
    assert isinstance(cm, ProfiledCostModel) and cm.tp == 4


@pytest.mark.parametrize("name", ["gpt-6.7b-a100", "gpt-6.7b-a100.json"])
def test_a_shipped_profile_loads_by_name_from_any_directory(name, tmp_path, monkeypatch, raw):
    monkeypatch.chdir(tmp_path)  # no file of that name here: the package's own copy is used
    cm = load_cost_model(name, 2)
    doc, times, _ = raw
    assert doc["source"] and cm.name == "gpt-6.7b"
    assert cm.layer_ms("encoder", "forward", "none", 4, 2048) == times[(2, "none", "encoder", "forward", 2048, 4)]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_shipped_h100_profile_runs_compute_bound_layers_between_an_a100_and_the_h100_peak(tp):
    """GPT-6.7B's textbook layer FLOPs (24*b*s*h^2 + 4*b*s^2*h forward, twice that backward, split
    over TP) over the shipped H100 profile's times at compute-bound points: under the H100's dense
    bf16 peak of 989 TFLOP/s, and faster than the shipped A100 profile at the same points."""
    h100, a100 = load_cost_model("gpt-6.7b-h100", tp), load_cost_model("gpt-6.7b-a100", tp)
    hidden = 4096
    for mbs, seq in ((8, 2048), (16, 1024)):
        forward_flops = (24 * mbs * seq * hidden**2 + 4 * mbs * seq**2 * hidden) / tp
        for phase, flops in (("forward", forward_flops), ("backward", 2 * forward_flops)):
            ms = h100.layer_ms("encoder", phase, "none", mbs, seq)
            assert flops / (ms * 1e-3) < 989e12
            assert ms < a100.layer_ms("encoder", phase, "none", mbs, seq)


def test_the_shipped_h100_profile_is_taken_for_gpt_6_7b_in_bf16_only():
    metadata = load_cost_model("gpt-6.7b-h100", 1).metadata
    gpt = get_model("6.7").to_json()
    assert profile_mismatch(metadata, model=gpt, dtype="bf16") is None
    assert profile_mismatch(metadata, model=gpt, dtype="fp16") == "dtype bf16 (job: fp16)"
    assert profile_mismatch(metadata, model=get_model("13").to_json(), dtype="bf16").startswith("hidden_size 4096")
    # it was measured with megatron-core's unfused local attention, not a fused core
    sdpa = dict(gpt, attention="sdpa")
    assert profile_mismatch(metadata, model=sdpa, dtype="bf16") == "attention local (job: sdpa)"


def test_a_file_in_the_working_directory_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    doc = json.loads(PROFILE.read_text())
    doc["name"] = "mine"
    (tmp_path / "gpt-6.7b-a100.json").write_text(json.dumps(doc))
    assert load_cost_model("gpt-6.7b-a100.json", 1).name == "mine"


def test_an_unknown_name_lists_the_shipped_profiles(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CostModelError, match=r"not found: .*shipped profile \(gpt-0\.94b-h100-sdpa, gpt-6\.7b-a100, gpt-6\.7b-h100\)"):
        load_cost_model("gpt-1t-h100", 1)


# --- StageCosts ----------------------------------------------------------------------------------


class _Fixed(CostModel):
    """Costs chosen so that stage arithmetic can be checked by hand."""

    tp = 1
    hidden_size = 1000

    def layer_ms(self, layer, phase, recompute, mbs, seqlen):
        return {"encoder": 10.0, "postprocess": 3.0, "preprocess": 0.5}[layer] * (2 if phase == "backward" else 1) * mbs

    def activation_mb(self, kind, recompute, mbs, seqlen):
        return {"stored": 5.0, "peak": 7.0}[kind] * mbs

    def param_mb(self, layer):
        return {"embedding": 50.0, "encoder": 100.0}[layer]


@pytest.mark.parametrize(
    "num_layers, pp, split",
    [(32, 4, [8, 8, 8, 8]), (10, 4, [3, 3, 2, 2]), (5, 5, [1] * 5), (7, 1, [7]), (30, 8, [4] * 6 + [3] * 2)],
)
def test_layers_on(num_layers, pp, split):
    sc = StageCosts(_Fixed(), num_layers, pp)
    assert [sc.layers_on(i) for i in range(pp)] == split


def test_layout_errors():
    with pytest.raises(ValueError, match="cannot fill"):
        StageCosts(_Fixed(), 3, 4)
    with pytest.raises(ValueError, match="zero_stage"):
        StageCosts(_Fixed(), 8, 2, zero_stage=4)
    with pytest.raises(ValueError, match="outside"):
        StageCosts(_Fixed(), 8, 2).layers_on(2)


def test_stage_time_and_memory():
    sc = StageCosts(_Fixed(), 10, 4)  # layers 3, 3, 2, 2
    assert sc.forward_ms(0, 2, 64, R.NONE) == 3 * 10 * 2 + 0.5 * 2  # + embedding
    assert sc.forward_ms(1, 2, 64, R.NONE) == 3 * 10 * 2
    assert sc.forward_ms(3, 2, 64, R.NONE) == 2 * 10 * 2 + 3 * 2  # + LM head
    assert sc.backward_ms(3, 1, 64, R.FULL) == 2 * 20 + 6
    assert sc.backward_ms(0, 1, 64, R.FULL) == 3 * 20 + 1
    one = StageCosts(_Fixed(), 10, 1)  # the only stage holds the embedding and the head
    assert one.forward_ms(0, 1, 64, R.NONE) == 10 * 10 + 3 + 0.5
    assert sc.stored_mb(1, 4, 64, R.NONE) == 3 * 5 * 4
    assert sc.peak_mb(1, 4, 64, R.NONE) == 7 * 4  # one layer at a time


def test_stage_costs_on_the_profile(raw, models):
    _, times, memory = raw
    sc = StageCosts(models[2], num_layers=32, pp=4)
    enc = times[(2, "selective", "encoder", "forward", 1024, 4)]
    post = times[(2, "selective", "postprocess", "forward", 1024, 4)]
    assert sc.forward_ms(0, 4, 1024, R.SELECTIVE) == pytest.approx(8 * enc)
    assert sc.forward_ms(3, 4, 1024, R.SELECTIVE) == pytest.approx(8 * enc + post)
    got = sc.backward_ms(3, np.array([4, 4096]), 1024, R.SELECTIVE)
    bwd = 8 * times[(2, "selective", "encoder", "backward", 1024, 4)] + times[
        (2, "selective", "postprocess", "backward", 1024, 4)]
    assert got[0] == pytest.approx(bwd) and got[1] == math.inf
    stored = memory[(2, "selective", "stored", 1024, 4)]
    assert sc.stored_mb(2, 4, 1024, R.SELECTIVE) == pytest.approx(8 * stored)
    assert sc.peak_mb(2, 4, 1024, R.SELECTIVE) == memory[(2, "selective", "peak", 1024, 4)]


@pytest.mark.parametrize(
    "zero, dp, bytes_per_param",
    [
        (0, 1, 16), (0, 8, 16),
        (1, 1, 16), (1, 4, 2 + 2 + 12 / 4),
        (2, 4, 2 + (2 + 12) / 4),
        (3, 4, 16 / 4), (3, 1, 16),
    ],
)
def test_model_state_per_zero_stage(zero, dp, bytes_per_param):
    sc = StageCosts(_Fixed(), 10, 4, dp=dp, zero_stage=zero)  # layers 3, 3, 2, 2
    # parameter MB at 2 bytes each: stage 0 = 3 layers + embedding, last = 2 layers + tied embedding
    params_mb = {0: 3 * 100 + 50, 1: 300, 2: 200, 3: 2 * 100 + 50}
    for stage, p in params_mb.items():
        assert sc.model_state_mb(stage) == pytest.approx(p / 2 * bytes_per_param)


def test_single_stage_holds_the_embedding_once():
    sc = StageCosts(_Fixed(), 10, 1)
    assert sc.model_state_mb(0) == pytest.approx((10 * 100 + 50) * 8)


def test_p2p_time():
    sc = StageCosts(_Fixed(), 4, 2, link=Link(bandwidth_GBps=50.0, latency_us=0.0))
    # 2 bytes * 4 * 2048 * 1000 = 16.384 MB over 50 GB/s = 0.32768 ms
    assert sc.p2p_ms(4, 2048) == pytest.approx(0.32768)
    np.testing.assert_allclose(sc.p2p_ms(np.array([1, 4]), 2048), [0.08192, 0.32768])
    assert StageCosts(_Fixed(), 4, 2).p2p_ms(4, 2048) == pytest.approx(16.384e6 / 100e9 * 1e3)  # 100 GB/s


def test_p2p_time_over_the_link_a_profile_measured(tmp_path):
    # fp32 activations (4 B a value) over 0.2 ms + 2 GB/s: 1 x 64 tokens x hidden 4096 = 1 MiB
    doc = json.loads(PROFILE.read_text())
    doc["metadata"] = dict(doc.get("metadata") or {}, dtype="fp32", link={"latency_us": 200.0, "bandwidth_GBps": 2.0})
    path = tmp_path / "linked.json"
    path.write_text(json.dumps(doc))
    sc = StageCosts(load_cost_model(path, 1), 4, 2)
    assert sc.p2p_ms(1, 64) == pytest.approx(0.2 + 4 * 64 * 4096 / 2e9 * 1e3)
    assert StageCosts(load_cost_model(path, 1), 4, 2, link=Link(bandwidth_GBps=4.0, latency_us=0.0)).p2p_ms(1, 64) == pytest.approx(
        4 * 64 * 4096 / 4e9 * 1e3)  # a link given wins
    doc["metadata"]["link"] = {"latency_us": -1, "bandwidth_GBps": 2.0}
    path.write_text(json.dumps(doc))
    with pytest.raises(CostModelError, match="metadata.link must hold bandwidth_GBps > 0 and latency_us >= 0"):
        load_cost_model(path, 1)


# --- analytical ----------------------------------------------------------------------------------


def test_analytical_flops_by_hand():
    cm = AnalyticalCostModel()  # h 4096, 32 heads, ffn 16384, V 50257, tp 1, 312 TFLOPs, mfu 0.5
    b, s, h = 2, 1024, 4096
    fwd = 24 * b * s * h * h + 4 * b * s * s * h
    assert cm.encoder_flops("forward", R.NONE, b, s) == fwd
    assert cm.layer_ms("encoder", "forward", R.NONE, b, s) == pytest.approx(fwd / 156e12 * 1e3)
    head = 2 * b * s * h * 50257
    assert cm.layer_ms("postprocess", "forward", R.NONE, b, s) == pytest.approx(head / 156e12 * 1e3)
    assert cm.layer_ms("postprocess", "backward", R.FULL, b, s) == pytest.approx(2 * head / 156e12 * 1e3)
    tp4 = AnalyticalCostModel(tp=4)
    assert tp4.layer_ms("encoder", "forward", R.NONE, b, s) == pytest.approx(fwd / 4 / 156e12 * 1e3)


def test_analytical_ratios():
    cm = AnalyticalCostModel()
    f = lambda rc, phase, s: cm.layer_ms("encoder", phase, rc, 1, s)  # noqa: E731
    # attention part = F(s) - linear part; doubling s quadruples it, so F(2s) > 2 F(s)
    linear = 24 * 4096 * 4096 / 156e9
    att_1k, att_2k = f(R.NONE, "forward", 1024) - 1024 * linear, f(R.NONE, "forward", 2048) - 2048 * linear
    assert att_2k == pytest.approx(4 * att_1k) and att_2k > 2 * att_1k
    assert f(R.NONE, "forward", 2048) > 2 * f(R.NONE, "forward", 1024)
    for s in (128, 2048, 8192):
        fwd = f(R.NONE, "forward", s)
        assert f(R.FULL, "forward", s) == fwd == f(R.SELECTIVE, "forward", s)
        assert f(R.NONE, "backward", s) == pytest.approx(2 * fwd)
        assert f(R.FULL, "backward", s) == pytest.approx(3 * fwd)
        assert 2 * fwd < f(R.SELECTIVE, "backward", s) < 3 * fwd


def test_analytical_activation_by_hand():
    cm = AnalyticalCostModel()
    # s b h (10 + 24 + 5 a s / h) = 2048 * 4096 * (34 + 80) bytes = 912 MiB
    assert cm.activation_mb("stored", R.NONE, 1, 2048) == pytest.approx(2048 * 4096 * 114 / 2**20)
    assert cm.activation_mb("stored", R.NONE, 1, 2048) == pytest.approx(912.0)
    assert cm.activation_mb("stored", R.SELECTIVE, 1, 2048) == pytest.approx(272.0)
    assert cm.activation_mb("stored", R.FULL, 1, 2048) == pytest.approx(16.0)
    # tp 8: 10 + 3 + 10 = 23 per s b h
    assert AnalyticalCostModel(tp=8).activation_mb("stored", R.NONE, 1, 2048) == pytest.approx(184.0)
    # stored + peak = all of the layer's activations plus as much again in gradients
    for rc in R:
        total = cm.activation_mb("stored", rc, 3, 512) + cm.activation_mb("peak", rc, 3, 512)
        assert total == pytest.approx(2 * 3 * 512 * 4096 * (34 + 5 * 32 * 512 / 4096) / 2**20)


def test_sequence_parallelism_splits_what_lies_outside_the_tensor_parallel_regions_by_hand():
    # tp 8 with --sequence-parallel: 34 / 8 + 5 a s / (h t) = 4.25 + 10 per s b h (Korthikanti et al.)
    sp = AnalyticalCostModel(tp=8, sequence_parallel=True)
    assert sp.activation_mb("stored", R.NONE, 1, 2048) == pytest.approx(2048 * 4096 * 14.25 / 2**20)
    assert sp.activation_mb("stored", R.SELECTIVE, 1, 2048) == pytest.approx(2048 * 4096 * 4.25 / 2**20)
    assert sp.activation_mb("stored", R.FULL, 1, 2048) == pytest.approx(2 * 2048 * 4096 / 8 / 2**20)  # the input
    # its working set shrinks alike; its times do not
    assert sp.activation_mb("peak", R.FULL, 1, 2048) == pytest.approx(
        2 * 2048 * 4096 * 14.25 / 2**20 - 2 * 2048 * 4096 / 8 / 2**20)
    plain = AnalyticalCostModel(tp=8)
    assert sp.layer_ms("encoder", "backward", R.FULL, 4, 1024) == plain.layer_ms("encoder", "backward", R.FULL, 4, 1024)
    assert "sequence parallelism" in sp.describe() and "sequence" not in plain.describe()


def test_analytical_params_by_hand():
    cm = AnalyticalCostModel()
    assert cm.param_mb("encoder") == pytest.approx((12 * 4096**2 + 13 * 4096) * 2 / 2**20)
    assert cm.param_mb("embedding") == pytest.approx(50257 * 4096 * 2 / 2**20)


def test_analytical_infeasible_when_one_layer_does_not_fit():
    cm = AnalyticalCostModel()
    # one layer at s=2048 needs 2 * 912 MiB per sample + 8 * its 16-bit params (12h^2 + 13h)
    state = 8 * (12 * 4096**2 + 13 * 4096) * 2 / 2**20
    fit = int((40960 - state) // (2 * 912))
    assert fit == 20
    assert math.isfinite(cm.layer_ms("encoder", "forward", R.NONE, fit, 2048))
    assert cm.layer_ms("encoder", "forward", R.NONE, fit + 1, 2048) == math.inf
    got = cm.activation_mb("stored", R.FULL, np.array([fit, fit + 1]), 2048)
    assert np.isfinite(got[0]) and got[1] == math.inf
    small = AnalyticalCostModel(device_memory_mb=1000)  # less than one layer's model state
    assert small.layer_ms("encoder", "forward", R.NONE, 1, 16) == math.inf


def test_analytical_is_within_3x_of_the_a100_profile(raw):
    _, times, memory = raw
    cm = AnalyticalCostModel(tp=1, mfu=0.5)
    for rc in ("none", "selective", "full"):
        for layer in ("encoder", "postprocess"):
            for phase in ("forward", "backward"):
                measured = times[(1, rc, layer, phase, 2048, 1)]
                ratio = cm.layer_ms(layer, phase, rc, 1, 2048) / measured
                assert 1 / 3 < ratio < 3, (rc, layer, phase, ratio)
        ratio = cm.activation_mb("stored", rc, 1, 2048) / memory[(1, rc, "stored", 2048, 1)]
        assert 1 / 3 < ratio < 3, (rc, ratio)


def test_analytical_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible"):
        AnalyticalCostModel(num_heads=32, tp=3)
    with pytest.raises(ValueError, match="unknown layer"):
        AnalyticalCostModel().layer_ms("embedding", "forward", R.NONE, 1, 16)


def test_cost_model_imports_neither_torch_nor_megatron():
    code = (
        "import sys, megatron_dynapipe.planning.cost_model\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'scipy')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_analytical_small_microbatches_cost_as_much_as_saturating_ones():
    # Below saturation_tokens a layer takes as long as at saturation: 1x64 and 16x64 tokens both
    # cost what 1024 tokens cost; above it time grows linearly with the batch (same seqlen).
    model = AnalyticalCostModel(saturation_tokens=1024)
    t = lambda b: model.layer_ms("encoder", "forward", R.NONE, b, 64)  # noqa: E731
    assert t(1) == pytest.approx(t(16))
    assert t(32) == pytest.approx(2 * t(16))
    assert AnalyticalCostModel(saturation_tokens=0).layer_ms("encoder", "forward", R.NONE, 1, 64) \
        == pytest.approx(t(16) / 16)


def test_all_stages_agrees_with_the_per_stage_queries_and_asks_the_model_each_shape_once(models, monkeypatch):
    costs = StageCosts(models[1], num_layers=30, pp=4)
    asked = []
    shape_costs = models[1].shape_costs
    monkeypatch.setattr(models[1], "shape_costs", lambda types, m, s: asked.append(np.size(m)) or shape_costs(types, m, s))
    mbs, seq = np.array([1, 2, 3, 8]), np.array([512, 1000, 2048, 256])
    for rc in R:
        answer = costs.all_stages(mbs, seq, rc)
        for s in range(costs.pp):
            assert answer["forward"][s] == pytest.approx(costs.forward_ms(s, mbs, seq, rc))
            assert answer["backward"][s] == pytest.approx(costs.backward_ms(s, mbs, seq, rc))
            assert answer["stored"][s] == pytest.approx(costs.stored_mb(s, mbs, seq, rc))
            assert answer["peak"][s] == pytest.approx(costs.peak_mb(s, mbs, seq, rc))
        before = len(asked)
        again = costs.all_stages(mbs[::-1].copy(), seq[::-1].copy(), rc)  # the same shapes: from memory
        assert len(asked) == before
        assert all(np.array_equal(again[k], answer[k][:, ::-1]) for k in answer)
        grown = costs.all_stages(np.array([[2, 5], [5, 1]]), np.array([[1000, 64], [64, 512]]), rc)
        assert grown["forward"].shape == (4, 2, 2) and grown["forward"][:, 0, 0] == pytest.approx(answer["forward"][:, 1])
    assert costs.all_stages(mbs[:2], seq[:2], R.NONE)["forward"].shape == (4, 2)  # another query
    assert asked == [4, 1]  # each shape once, under every recompute type: the four, then 5 x 64


@pytest.mark.parametrize("which", ["profiled", "analytical"])
def test_every_recompute_type_at_once_equals_each_asked_alone(models, which):
    from megatron_dynapipe.planning.cost_model import AnalyticalCostModel
    model = models[1] if which == "profiled" else AnalyticalCostModel(tp=1, hidden_size=1024, num_heads=16)
    mbs, seq = np.array([[1, 2], [3, 8]]), np.array([[512, 1000], [2048, 256]])
    together = StageCosts(model, num_layers=30, pp=4).by_recompute(mbs, seq, (R.FULL, R.NONE))
    for t, rc in enumerate((R.FULL, R.NONE)):
        alone = StageCosts(model, num_layers=30, pp=4).all_stages(mbs, seq, rc)  # fresh: nothing remembered
        for name in ("forward", "backward", "stored", "peak"):
            assert together[name].shape == (2, 4, 2, 2)
            np.testing.assert_array_equal(together[name][t], alone[name])


def test_one_adapter_turns_whatever_the_caller_holds_into_stage_costs(tmp_path):
    from megatron_dynapipe.planning.cost_model import (
        AnalyticalCostModel,
        ProfiledCostModel,
        StageCosts,
        as_stage_costs,
    )

    layout = dict(tp=1, num_layers=32, pp=4, dp=2)
    by_name = as_stage_costs("gpt-6.7b-a100", **layout)
    assert isinstance(by_name.model, ProfiledCostModel) and by_name.pp == 4
    assert as_stage_costs(by_name, **layout) is by_name
    analytical = as_stage_costs(None, hidden_size=1024, num_heads=16, **layout)
    assert isinstance(analytical.model, AnalyticalCostModel) and analytical.model.hidden_size == 1024
    assert isinstance(as_stage_costs(analytical.model, **layout), StageCosts)
    with pytest.raises(TypeError, match="CostModel, StageCosts, path or None"):
        as_stage_costs(3.5, **layout)


@pytest.mark.parametrize("rc", list(R))
def test_shape_costs_at_once_agree_with_each_quantity_asked_alone(models, rc):
    """The grids of one recompute type share axes and are interpolated together; every value
    must equal what the scalar path answers for that quantity alone (inf where it is inf)."""
    rng = np.random.default_rng(0)
    mbs = rng.integers(1, 3000, 400).astype(float)
    seqlen = rng.integers(1, 9000, 400).astype(float)
    together = models[2].shape_costs((rc,), mbs, seqlen)[0]
    asked = [("encoder", "forward"), ("encoder", "backward"), ("postprocess", "forward"), ("postprocess", "backward"),
             ("preprocess", "forward"), ("preprocess", "backward")]
    for k, values in enumerate(together):
        for m, s, value in zip(mbs, seqlen, values):
            alone = (models[2].layer_ms(*asked[k], rc, m, s) if k < 6
                     else models[2].activation_mb(("stored", "peak")[k - 6], rc, m, s))
            assert value == pytest.approx(alone, rel=1e-12) or (math.isinf(value) and math.isinf(alone))
    assert any(np.isinf(together[0])) and any(np.isfinite(together[0]))  # both regimes were exercised


def test_remembered_answers_are_forgotten_at_once_past_their_budget(models, monkeypatch):
    from megatron_dynapipe.planning.cost_model import stage

    costs = StageCosts(models[1], num_layers=30, pp=4)
    monkeypatch.setattr(stage, "ELEMENTS_KEPT", 3 * 4 * 10)  # ten shapes, each under 3 recompute types on 4 stages
    first = costs.all_stages(np.arange(1, 9), 512, R.NONE)
    assert first["forward"].shape == (4, 8)
    more = costs.all_stages(np.arange(1, 9), 1024, R.NONE)  # 16 shapes would pass it: only these 8 are kept
    memo = costs._answers
    assert memo.size == 8 and set(memo.keys.imag) == {1024.0}
    assert more["forward"][:, 0] == pytest.approx(costs.all_stages(1, 1024, R.NONE)["forward"])
    np.testing.assert_array_equal(costs.all_stages(np.arange(1, 9), 512, R.NONE)["forward"], first["forward"])


@pytest.mark.parametrize("num_layers, pp, layers, worst", [
    (96, 16, None, [0, 1, 15]),  # first, the middle ones alike, last
    (18, 4, None, [0, 1, 2, 3]),  # 5, 5, 4, 4 layers: the middle ones differ
    (8, 1, None, [0]),
    (8, 2, None, [0, 1]),
    (126, 16, (7,) + (8,) * 14 + (7,), [0, 1, 15]),
])
def test_one_stage_of_each_kind_answers_for_the_bottleneck_and_the_memory_check(num_layers, pp, layers, worst):
    from megatron_dynapipe.planning.microbatching import _times_where_fit

    costs = StageCosts(AnalyticalCostModel(hidden_size=1024, num_heads=16, vocab_size=32000),
                       num_layers=num_layers, pp=pp, layers=layers)
    assert costs.worst_stages().tolist() == worst
    # every stage asked, as 1F1B's steady state holds pp - s micro-batches on stage s
    mbs, seq = np.repeat([1, 2, 4, 8, 16], 6), np.tile([128, 512, 1024, 2048, 4096, 8192], 5)
    types = tuple(R)
    every = costs.by_recompute(mbs, seq, types)
    state = np.array([costs.model_state_mb(s) for s in range(pp)]).reshape(1, pp, 1)
    need = state + (pp - np.arange(pp)).reshape(1, pp, 1) * every["stored"] + every["peak"]
    bound = []
    for limit in (2_000.0, 20_000.0, 60_000.0):
        expected = np.where(np.all(need <= limit, axis=1), np.max(every["forward"] + every["backward"], axis=1), np.inf)
        np.testing.assert_array_equal(_times_where_fit(costs, mbs, seq, types, limit), expected)
        bound.append(np.isinf(expected).any() and np.isfinite(expected).any())
    assert any(bound)  # some limit fits some shapes and not others
