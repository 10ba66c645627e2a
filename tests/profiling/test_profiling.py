"""`megatron-dynapipe profile`: real megatron-core layers measured on this CPU into a cost model.

Memory on the CPU is counted exactly (fp32, no dropout), so it is checked against independent
formulas: the parameter count of a layer shard, what full recompute keeps (the output, s·b·h),
what selective keeps (16·s·b·h elements: Korthikanti et al. 2022's 34·s·b·h 16-bit bytes without
the two dropout masks), and what the attention core adds without recompute (its softmax output,
a·s²·b elements per TP rank, plus the s² bytes of the causal mask).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megatron_dynapipe.compat import upstream
from megatron_dynapipe.planning.cost_model import StageCosts, cost_model_from_document, load_cost_model
from megatron_dynapipe.planning.cost_model.profile_file import FORMAT_VERSION
from megatron_dynapipe.profiling.measure import time_step

MB = 2**20
FLOAT = 4  # fp32 bytes
TINY = dict(h=128, f=512, a=8, vocab=1024, positions=256)  # config/model.py "tiny"


def profile(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "profile", "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout)


def records(doc, table, **match):
    return [r for r in doc[table] if all(r[k] == v for k, v in match.items())]


def one(doc, table, **match):
    (found,) = records(doc, table, **match)
    return found


def layer_shard_params(h, f, tp, *, kv=None, swiglu=False, rmsnorm=False):
    """One layer's parameters on one TP rank: column-parallel QKV and fc1 (weights and biases)
    and row-parallel proj and fc2 weights are split; their biases and the norms are not."""
    kv = h if kv is None else kv  # width of keys (= of values)
    up = 2 * f if swiglu else f
    split = (h + 2 * kv) * h + (h + 2 * kv) + h * h + h * up + up + f * h
    whole = h + h + (2 if rmsnorm else 4) * h
    return split // tp + whole


def test_the_profile_loads_and_plans(tiny_profile, tmp_path):
    out, doc = tiny_profile
    for tp in (1, 2):
        model = load_cost_model(out, tp=tp)
        assert model.tp == tp and model.hidden_size == TINY["h"]
    meta = doc["metadata"]
    assert meta["complete"] and meta["dtype"] == "fp32" and meta["device_type"] == "cpu"
    assert meta["model"]["hidden_size"] == TINY["h"] and meta["settings"]["tp_sizes"] == [1, 2]
    assert all(r["ms"] > 0 for r in doc["layer_time"])
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in (17, 120, 64, 33, 99, 128, 8, 70)))
    plan = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "plan", "--cost-model", str(out),
                           "--num-layers", "4", "--pp", "2", "--lengths", str(lengths), "--memory-limit", "500"],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert "predicted iteration" in plan.stdout


def overhead(doc, phase, tokens, layers, tp=1):
    """What the profile's microbatch_overhead records charge a stage of ``layers`` layers."""
    return sum((r["ms"] + r["ms_per_token"] * tokens) * (layers if r["per"] == "layer" else 1)
               for r in records(doc, "microbatch_overhead", tp=tp, phase=phase))


def test_the_embedding_is_timed_and_priced_on_the_first_stage(tiny_profile):
    out, doc = tiny_profile
    times = {(r["tp"], r["recompute"], r["layer"], r["phase"], r["seqlen"], r["mbs"]): r["ms"] for r in doc["layer_time"]}
    encoder_points = {k[:2] + k[3:] for k in times if k[2] == "encoder"}
    assert encoder_points == {k[:2] + k[3:] for k in times if k[2] == "preprocess"}  # every point, both phases
    model = load_cost_model(out, tp=1)
    stages = StageCosts(model, num_layers=4, pp=2)
    for rc in ("none", "full"):
        enc = times[(1, rc, "encoder", "backward", 128, 2)]
        embedding = times[(1, rc, "preprocess", "backward", 128, 2)]
        head = times[(1, rc, "postprocess", "backward", 128, 2)]
        assert embedding > 0 and enc > 0 and head > 0  # which is larger is a measurement: load can swap them
        extra = overhead(doc, "backward", 2 * 128, layers=2)
        assert stages.backward_ms(0, 2, 128, rc) == pytest.approx(2 * enc + embedding + extra, rel=1e-12)
        assert stages.backward_ms(1, 2, 128, rc) == pytest.approx(2 * enc + head + extra, rel=1e-12)


def test_a_whole_training_step_gets_its_per_microbatch_overhead(tiny_profile):
    """Each TP size gets its per-micro-batch overhead (a stage's wrapper, DDP's hooks, the
    executor, the loss, beyond its parts timed alone), once per stage and once per layer, both
    phases, fitted over several shapes. How large it is is a measurement, for `bench step` to
    show, not for a test: on a busy machine the fit may find none."""
    _, doc = tiny_profile
    for tp in (1, 2):
        lines = records(doc, "microbatch_overhead", tp=tp)
        assert sorted((r["per"], r["phase"]) for r in lines) == [
            ("layer", "backward"), ("layer", "forward"), ("stage", "backward"), ("stage", "forward")]
        assert all(r["ms"] >= 0 and r["ms_per_token"] >= 0 and r["points"] >= 3 for r in lines)


def test_a_profile_without_embedding_times_prices_the_embedding_at_nothing():
    a100 = load_cost_model("gpt-6.7b-a100", tp=1)  # profiled before the embedding was timed
    assert a100.layer_ms("preprocess", "forward", "none", 2, 1024) == 0.0
    assert a100.layer_ms("preprocess", "forward", "none", 10_000, 1024) == math.inf  # where the layer is


def test_short_points_are_timed_until_they_add_up_to_the_minimum_time():
    calls = []

    def step():
        calls.append(1)
        time.sleep(0.004)
        return torch.ones(1, requires_grad=True) * 2

    timing = time_step(step, torch.device("cpu"), warmup=1, repeats=3, min_time_ms=100)
    calls.pop()  # the warm-up run
    # at least `repeats`, more while short (a busy machine stretches the sleeps: fewer runs); at
    # least 4 ms each, so the 25th run passes 100 ms at the latest
    assert 3 <= len(calls) <= 25
    assert timing.forward_ms >= 4
    calls.clear()
    time_step(step, torch.device("cpu"), warmup=0, repeats=3, min_time_ms=1000, max_repeats=6)
    assert len(calls) == 6
    calls.clear()
    time_step(step, torch.device("cpu"), warmup=0, repeats=3)
    assert len(calls) == 3


def test_model_state_is_the_shard_of_megatron_cores_layer(tiny_profile):
    _, doc = tiny_profile
    h, f = TINY["h"], TINY["f"]
    for tp in (1, 2):
        encoder = one(doc, "model_state_memory", tp=tp, recompute="none", layer="encoder")["mb"]
        assert encoder == pytest.approx(layer_shard_params(h, f, tp) * 2 / MB, abs=1e-4)
        embedding = one(doc, "model_state_memory", tp=tp, recompute="none", layer="embedding")["mb"]
        assert embedding == pytest.approx((TINY["vocab"] // tp + TINY["positions"]) * h * 2 / MB, abs=1e-4)


@pytest.mark.parametrize("tp", [1, 2])
def test_stored_activations_follow_the_formulas(tiny_profile, tp):
    _, doc = tiny_profile
    h, a = TINY["h"], TINY["a"]

    def stored(rc, s, b):
        return one(doc, "activation_memory", tp=tp, recompute=rc, kind="stored", seqlen=s, mbs=b)["mb"] * MB

    for s, b in ((32, 1), (64, 2), (128, 2)):
        assert stored("full", s, b) == pytest.approx(s * b * h * FLOAT, rel=0.01)  # the layer's output
        attention_core = a * s * s * b // tp * FLOAT + s * s  # softmax output + causal mask (bool)
        assert stored("none", s, b) - stored("selective", s, b) == pytest.approx(attention_core, rel=0.03)
        assert stored("none", s, 2 * b if s * 2 * b <= 256 else b) >= stored("none", s, b)
    if tp == 1:
        assert stored("selective", 128, 2) == pytest.approx(16 * 128 * 2 * h * FLOAT, rel=0.01)
    assert stored("none", 64, 2) == pytest.approx(2 * stored("none", 64, 1), rel=0.01)  # linear in mbs


def test_rows_grow_geometrically_up_to_the_token_limit(tiny_profile):
    _, doc = tiny_profile
    none = records(doc, "layer_time", tp=1, recompute="none", layer="encoder", phase="forward")
    assert {r["mbs"] for r in none if r["seqlen"] == 32} == {1, 2, 4, 8}
    assert {r["mbs"] for r in none if r["seqlen"] == 128} == {1, 2}
    assert all(r["mbs"] * r["seqlen"] <= 256 for r in none)
    assert {32, 64, 128} <= {r["seqlen"] for r in none}


@pytest.mark.slow
def test_an_architecture_given_by_megatron_flags(tmp_path):
    out = tmp_path / "gqa.json"
    run = profile("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
                  "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--vocab-size", "256",
                  "--max-position-embeddings", "64", "--tp", "1", "2", "--recompute", "none",
                  "--max-tokens", "64", "--repeats", "1", "--warmup", "0", "--min-time-ms", "0", "--allow-noisy",
                  "--resume", "-o", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    # a retried job may pass --resume every time: nothing to resume starts a profile, and says so
    assert f"note: --resume: {out} does not exist yet, so this profile starts from the beginning" in run.stderr
    # --max-tokens 64 holds one row of the longest length, 64, and two of 32 (the grid's only other length)
    assert "micro-batches of two samples or more above 32 tokens" in run.stderr
    # each TP size's time, said once its layer has run at the grid's ends
    assert all(f"tp {tp}: about " in run.stderr for tp in (1, 2))
    # megatron-core's notices (local layers, TP's env, absl): silenced
    assert not any(notice in run.stderr for notice in upstream.UPSTREAM_NOTICES), run.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["metadata"]["model"]["swiglu"] and "--swiglu" in doc["metadata"]["megatron_args"]
    for tp in (1, 2):
        encoder = one(doc, "model_state_memory", tp=tp, layer="encoder")["mb"]
        expected = layer_shard_params(64, 256, tp, kv=32, swiglu=True, rmsnorm=True)
        assert encoder == pytest.approx(expected * 2 / MB, abs=1e-4)
        embedding = one(doc, "model_state_memory", tp=tp, layer="embedding")["mb"]
        assert embedding == pytest.approx(256 // tp * 64 * 2 / MB, abs=1e-4)  # rope: no position table
    assert load_cost_model(out, tp=2).tp == 2


def test_an_interrupted_profile_resumes_where_it_stopped(tiny_profile, tmp_path):
    out, full = tiny_profile
    partial = dict(full, metadata=dict(full["metadata"], complete=False))
    for table in ("layer_time", "activation_memory"):  # as if it stopped before seqlen 128 at tp 2
        partial[table] = [r for r in full[table] if not (r["tp"] == 2 and r["seqlen"] == 128)]
    again = tmp_path / "again.json"
    again.write_text(json.dumps(partial))
    run = profile("--model", "tiny", "--tp", "1", "2", "--max-seq-length", "128", "--max-tokens", "256",
                  "--repeats", "1", "--warmup", "0", "--min-time-ms", "0", "--hidden-dropout", "0",
                  "--attention-dropout", "0", "--allow-noisy", "-o", str(again), "--resume")  # nothing measured twice, however busy the machine
    assert run.returncode == 0, run.stderr[-2000:]
    resumed = json.loads(again.read_text())
    assert resumed["metadata"]["complete"]
    kept = {json.dumps(r, sort_keys=True) for r in partial["layer_time"]}
    assert kept <= {json.dumps(r, sort_keys=True) for r in resumed["layer_time"]}  # not measured again
    # The lost rows are measured again, once each. (How many lengths refinement adds between grid
    # points depends on the timings, so the row counts of two runs may differ.)
    def point(r):
        return r["tp"], r["recompute"], r["layer"], r["phase"], r["seqlen"], r["mbs"]
    lost = {point(r) for r in full["layer_time"] if r["tp"] == 2 and r["seqlen"] == 128}
    points = [point(r) for r in resumed["layer_time"]]
    assert lost and lost <= set(points) and len(points) == len(set(points))


@pytest.mark.slow
def test_sigterm_keeps_what_was_measured_for_resume_and_exits_143(tmp_path):
    """SIGTERM to the command alone once the first points are on disk: the file stays a profile that
    says it is incomplete, the message names --resume, the exit is 143."""
    import signal

    from project import interrupt_when

    out = tmp_path / "tiny.json"
    command = ["megatron_dynapipe.cli", "profile", "--no-progress", "--model", "tiny", "--tp", "1", "2",
               "--max-seq-length", "128", "--max-tokens", "256", "--repeats", "1", "--warmup", "0", "-o", str(out)]
    proc, (_, err) = interrupt_when(command, out.exists, signal.SIGTERM)
    assert proc.returncode == 143, err[-3000:]
    assert f"interrupted: {out} holds what was measured; run again with --resume to go on" in err
    doc = json.loads(out.read_text())
    assert doc["metadata"]["complete"] is False and doc["layer_time"] and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--tp", "3"], "--tp 3 does not divide the model's 8 attention heads"),
    (["--max-seq-length", "512"], "exceeds the model's 256 learned positions"),
    (["--device", "cuda"], "--device cuda: this torch sees no CUDA device"),
    (["--cp", "1"], "--cp 1: a context-parallel group has 2 ranks or more"),
    (["--tp", "2", "--cp", "2"], "--cp 2 times the layer at TP 1, which --tp 2 leaves out: add 1 to --tp"),
    (["--cp", "2", "--attention-dropout", "0.1"], "--cp 2: context parallelism without transformer-engine draws no "
                                                  "attention dropout: set --attention-dropout 0"),
    (["--cp", "2", "--attention-dropout", "0", "--calibrate"], "drop --cp (or --calibrate"),
])
def test_bad_input_is_refused_before_any_work(tmp_path, args, message):
    out = tmp_path / "p.json"
    run = profile("--model", "tiny", *args, "-o", str(out), timeout=60)
    assert run.returncode == 2 and message in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("max_seq, max_tokens, min_seq, unpriced", [
    (2048, 4096, 32, None),  # two rows of every length
    (2048, 3000, 32, "above 1024 tokens"),  # lengths 32, 64, ..., 1024, 2048: 2 x 1024 fits, 2 x 2048 does not
    (2048, 2048, 32, "above 1024 tokens"),
    (1500, 2000, 32, "above 512 tokens"),  # 32 ... 512, 1024, 1500: 2 x 1024 > 2000
    (100, 100, 64, "at any length"),  # lengths 64 and 100: 2 x 64 > 100
])
def test_a_token_limit_below_two_of_the_longest_rows_says_what_will_have_no_price(max_seq, max_tokens, min_seq,
                                                                                 unpriced):
    from megatron_dynapipe.profiling.cli import short_rows_note
    from megatron_dynapipe.profiling.profiler import ProfileSettings

    note = short_rows_note(ProfileSettings(min_seq_length=min_seq, max_seq_length=max_seq, max_tokens=max_tokens))
    if unpriced is None:
        assert note is None
    else:
        assert f"two samples or more {unpriced}" in note and f"--max-tokens {2 * max_seq} or more" in note


def test_no_model_and_an_existing_output_are_refused(tmp_path):
    run = profile("-o", str(tmp_path / "p.json"), timeout=60)
    assert run.returncode == 2 and "pass --model NAME" in run.stderr and "--num-layers" in run.stderr
    existing = tmp_path / "old.json"
    existing.write_text("keep me")
    run = profile("--model", "tiny", "-o", str(existing), timeout=60)
    assert run.returncode == 2 and "--resume" in run.stderr and "--force" in run.stderr
    assert existing.read_text() == "keep me"


def test_live_bytes_counts_what_operations_create_while_it_lives():
    from megatron_dynapipe.profiling.measure import LiveBytes

    x = torch.ones(1000)  # made before: not counted
    with LiveBytes() as live:
        y = x * 2  # 4000 bytes
        z = y.view(10, 100)  # a view: no new storage
        w = torch.cat([y, y])  # 8000 bytes
        assert live.now == 12000 and z.shape == (10, 100)
        del w
        assert live.now == 4000 and live.peak == 12000


def test_a_profile_of_another_model_or_dtype_is_told_apart(tiny_profile):
    from megatron_dynapipe.config.model import get_model
    from megatron_dynapipe.planning.cost_model import profile_mismatch

    out, _ = tiny_profile
    meta = load_cost_model(out, tp=1).metadata
    with_dropout = get_model("tiny").to_json()
    tiny = dict(with_dropout, hidden_dropout=0.0, attention_dropout=0.0)  # as the fixture profiled it
    assert profile_mismatch(meta, model=tiny, dtype="fp32") is None
    # drawing and applying dropout masks is work of its own: a profile without it prices a job with it wrong
    assert profile_mismatch(meta, model=with_dropout, dtype="fp32") == (
        "hidden_dropout 0.0 (job: 0.1); attention_dropout 0.0 (job: 0.1)")
    assert profile_mismatch(meta, model=dict(tiny, num_layers=40), dtype="fp32") is None  # a profile is per layer
    assert profile_mismatch(meta, model=dict(tiny, hidden_size=256), dtype="fp32") == "hidden_size 128 (job: 256)"
    assert profile_mismatch(meta, model=dict(tiny, swiglu=True), dtype="bf16") == (
        "swiglu False (job: True); dtype fp32 (job: bf16)")
    assert profile_mismatch(load_cost_model("gpt-6.7b-a100", tp=1).metadata, model=tiny, dtype="bf16") is None


@pytest.mark.parametrize("tokens, ms, line", [
    ([32, 64, 256], [1.0 + 0.01 * t for t in (32, 64, 256)], (1.0, 0.01)),  # a line is found again
    ([32, 64, 256], [3.0, 2.0, 1.0], (2.0, 0.0)),  # falling with tokens: their median, constant
    # a line below zero at no tokens: through the origin, the median of ms per token
    ([100, 200, 300], [0.0, 1.0, 2.0], (0.0, 1.0 / 200)),
    ([64], [5.0], (0.0, 5.0 / 64)),  # one shape: through the origin
    ([64, 64], [5.0, 7.0], (0.0, 6.0 / 64)),  # one length twice: no slope between them
])
def test_the_overhead_line_has_both_terms_at_least_zero(tokens, ms, line):
    from megatron_dynapipe.profiling.overhead import fit_overhead

    assert fit_overhead(tokens, ms) == pytest.approx(line)


def test_one_wild_shape_does_not_set_the_overhead_slope():
    """As measured at 1024 positions on the CPU: twelve shapes on a line, and the largest one's
    memory faults adding 726 ms there. Least squares would take a slope of 0.04 ms a token from it."""
    from megatron_dynapipe.profiling.overhead import fit_overhead

    tokens = [32, 48, 64, 80, 96, 112, 128, 192, 256, 512, 768, 1024]
    tokens, ms = tokens + [16384], [0.4 + 0.0005 * t for t in tokens] + [0.4 + 0.0005 * 16384 + 726]
    a, b = fit_overhead(tokens, ms)
    assert a == pytest.approx(0.4, abs=0.05) and b == pytest.approx(0.0005, rel=0.2)
    assert np.polyfit(tokens, ms, 1)[0] > 0.04  # the least-squares slope


def test_what_a_micro_batch_adds_is_read_round_by_round():
    """Two plans run in the same rounds: round 2 ran slow as a whole (+10 ms each), round 3's longer
    plan alone hit a spike. Each round's difference is 6, 6 and 26 ms: 3 ms a micro-batch for 2
    more. The two medians (10 and 26 ms) come from different rounds and would give 8."""
    from megatron_dynapipe.profiling.overhead import added_ms

    one, more = [10.0, 20.0, 10.0], [16.0, 26.0, 36.0]
    assert added_ms(more, one, 2) == pytest.approx(3.0)
    assert (np.median(more) - np.median(one)) / 2 == pytest.approx(8.0)


def test_the_overhead_takes_the_parts_times_from_its_own_rounds():
    """The overhead is the whole step less its parts, so the parts are timed alone in the same
    rounds as the stages (the grid's times, taken minutes before, carry the machine's pace then):
    each part runs once a round and once to warm up, and the times handed on are its own medians
    (here a layer that sleeps 30 ms forward and an embedding and head that sleep 5 ms each: a
    lower bound a slow machine cannot break)."""
    from megatron_dynapipe.config.model import get_model
    from megatron_dynapipe.profiling.layers import fake_tp_rank
    from megatron_dynapipe.planning.types import RecomputeType
    from megatron_dynapipe.profiling.overhead import _layer_counts, _per_microbatch_ms
    from megatron_dynapipe.runtime.stage import build_training_stage

    calls = {"layer": 0, "ends": 0}

    def sleeping(name: str, ms: float):
        weight = torch.ones(4, requires_grad=True)

        def step():
            calls[name] += 1
            time.sleep(ms / 1e3)
            return weight * 2
        return step

    def parts(seq, mbs):
        return sleeping("layer", 30.0), [sleeping("ends", 5.0), sleeping("ends", 5.0)]

    spec, cpu = get_model("tiny"), torch.device("cpu")
    with fake_tp_rank(1, cpu):
        stages = {n: build_training_stage(spec, dtype=torch.float32, device=cpu, tp=1, num_layers=n)
                  for n in _layer_counts(spec.num_layers)}
        per_stage, parts_ms = _per_microbatch_ms(stages, spec, RecomputeType.NONE, parts, 32, 1, cpu, repeats=3,
                                                 min_time_ms=0.0)
    assert calls == {"layer": 1 + 3, "ends": 2 * (1 + 3)}
    assert parts_ms["forward"][0] >= 30.0 and parts_ms["forward"][1] >= 10.0
    assert sorted(per_stage) == [1, 3] and all(set(v) == {"forward", "backward"} for v in per_stage.values())
    assert _per_microbatch_ms(stages, spec, RecomputeType.NONE, lambda seq, mbs: None, 32, 1, cpu, 3, 0.0) is None


def test_every_run_is_timed_until_its_own_times_add_up():
    from megatron_dynapipe.profiling import overhead

    def rounds(ms_per_run, repeats=3, min_time_ms=100.0):
        times = {key: [] for key in ms_per_run}
        while overhead._more_rounds(times, repeats, min_time_ms):
            for key, ms in ms_per_run.items():
                times[key].append(ms)
        return len(times["short"])

    # eight runs a round of 5-40 ms: the 5 ms one needs 20 rounds for its own 100 ms
    assert rounds({"short": 5.0, **{i: 40.0 for i in range(7)}}) == 20
    assert rounds({"short": 500.0}) == 3  # at least `repeats`
    assert rounds({"short": 0.01}) == overhead.MAX_ROUNDS  # at most MAX_ROUNDS


def test_overhead_is_timed_at_each_length_and_at_the_corners():
    from megatron_dynapipe.profiling.overhead import overhead_shapes

    measured = [(32, 1), (32, 2), (32, 4), (64, 1), (64, 2), (128, 1), (128, 2)]
    assert overhead_shapes(measured) == [(32, 1), (32, 4), (64, 1), (128, 1), (128, 2)]
    assert overhead_shapes([]) == []
    # a length refinement added (48, between the grid's 32 and 64) costs no shape of its own
    refined = measured + [(48, 1), (48, 2)]
    assert overhead_shapes(refined, lengths=[32, 64, 128]) == overhead_shapes(measured)
    assert overhead_shapes(refined) == [(32, 1), (32, 4), (48, 1), (64, 1), (128, 1), (128, 2)]


def test_the_overheads_time_is_said_from_the_parts_profiled_times():
    from megatron_dynapipe.profiling.overhead import overhead_seconds

    # a layer 1 ms forward and 2 backward, the embedding and head 0.5 and 1, at every shape
    parts = {"forward": (1.0, 0.5), "backward": (2.0, 1.0)}
    seconds = lambda *args, **kw: overhead_seconds(lambda phase, seq, mbs: parts[phase], *args, **kw)  # noqa: E731
    # stages of 1 and 3 layers, forward alone (1.5 and 3.5 ms) and with the backward (4.5 and 10.5),
    # one micro-batch and three: 20 ms + 60 ms a round; and the parts alone, the layer's 3 ms and
    # the embedding's and head's 1.5: 84.5 ms a round
    assert seconds([(32, 1)], 4, repeats=3, min_time_ms=0.0) == pytest.approx([(3 + 1) * 0.0845])
    assert seconds([(32, 1)], 4, repeats=3, min_time_ms=30.0) == pytest.approx([(20 + 1) * 0.0845])  # 30 / 1.5
    assert seconds([(32, 1), (64, 1)], 4, repeats=3, min_time_ms=100.0) == pytest.approx([(50 + 1) * 0.0845] * 2)
    # a one-layer model times one stage: 1.5 + 4.5 ms a round, three times that, and the parts
    assert seconds([(32, 1)], 1, repeats=3, min_time_ms=0.0) == pytest.approx([(3 + 1) * 0.0285])
    assert seconds([], 4) == []


# --------------------------------------------------------------------------------------------
# --calibrate: the analytical model fitted to a handful of points


def test_a_calibration_finds_the_rates_overhead_and_saturation_that_made_the_times():
    from megatron_dynapipe.config.model import get_model
    from megatron_dynapipe.planning.cost_model import AnalyticalCostModel
    from megatron_dynapipe.profiling.analytical_fit import fit_analytical

    spec = get_model("tiny")
    truth = AnalyticalCostModel(hidden_size=128, num_heads=8, ffn_hidden_size=512, vocab_size=spec.padded_vocab_size(1),
                                peak_tflops=0.2, mfu=1.0, attention_mfu=0.25, overhead_ms=0.4, saturation_tokens=256)
    points = [dict(tp=1, layer=layer, phase=phase, seqlen=s, mbs=m,
                   ms=truth.layer_ms(layer, phase, "none", m, s))
              for layer in ("encoder", "postprocess") for phase in ("forward", "backward")
              for s, m in ((32, 1), (32, 64), (64, 1), (128, 1), (256, 1), (256, 8))]
    fit = fit_analytical(points, spec)
    assert fit["peak_tflops"] == pytest.approx(0.2) and fit["attention_mfu"] == pytest.approx(0.25)
    assert fit["overhead_ms"] == pytest.approx(0.4) and fit["saturation_tokens"] == 256
    assert fit["max_error_pct"] < 1e-6


@pytest.mark.slow
def test_a_calibrated_model_plans_and_pays_its_measured_overhead(tmp_path):
    from megatron_dynapipe.planning.cost_model import AnalyticalCostModel

    out = tmp_path / "calibrated.json"
    run = profile("--model", "tiny", "--calibrate", "--max-seq-length", "128", "--max-tokens", "256", "--repeats", "1",
                  "--min-time-ms", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "-o", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "TFLOP/s" in run.stdout and "plan with --cost-model" in run.stdout
    doc = json.loads(out.read_text())
    model = load_cost_model(out, tp=1)
    assert isinstance(model, AnalyticalCostModel) and model.metadata["dtype"] == "fp32"
    calibration = doc["metadata"]["calibration"]
    assert calibration["points"] == len(calibration["measured"]) >= 12  # 6 shapes x layer and head x 2 phases
    errors = [abs(model.layer_ms(p["layer"], p["phase"], "none", p["mbs"], p["seqlen"]) / p["ms"] - 1) * 100
              for p in calibration["measured"]]
    assert max(errors) == pytest.approx(calibration["max_error_pct"], abs=0.01)  # the file holds what was fitted
    stages = StageCosts(model, num_layers=4, pp=1)
    bare = StageCosts(AnalyticalCostModel(**{k: getattr(model, k) for k in (
        "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size", "peak_tflops", "mfu", "attention_mfu",
        "overhead_ms", "saturation_tokens", "device_memory_mb")}), num_layers=4, pp=1)
    assert stages.forward_ms(0, 2, 64, "none") == pytest.approx(
        bare.forward_ms(0, 2, 64, "none") + overhead(doc, "forward", 128, layers=4))
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(["17", "120", "64", "33", "99", "128", "8", "70"]))
    plan = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "plan", "--cost-model", str(out),
                           "--num-layers", "4", "--pp", "2", "--lengths", str(lengths), "--memory-limit", "500"],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0 and "predicted iteration" in plan.stdout, plan.stderr


def test_a_calibration_cannot_resume_and_a_broken_one_is_named(tmp_path):
    out = tmp_path / "c.json"
    out.write_text("{}")
    run = profile("--model", "tiny", "--calibrate", "--resume", "-o", str(out), timeout=60)
    assert run.returncode == 2 and "drop --resume" in run.stderr
    from megatron_dynapipe.planning.cost_model import CALIBRATED, CostModelError

    settings = dict.fromkeys(CALIBRATED, 1.0)
    for broken, fragment in (({"peak_tflops": 1.0}, "without 'hidden_size'"),
                             ({**settings, "hidden_size": 64, "num_heads": 3}, "no model can be built from")):
        out.write_text(json.dumps({"analytical": broken}))
        with pytest.raises(CostModelError, match=fragment) as error:
            load_cost_model(out, tp=1)
        assert "\n" not in str(error.value) and "docs/cost_model.md" in str(error.value)


def test_a_busy_machine_is_named_when_cpu_times_are_taken():
    from megatron_dynapipe.profiling.cli import busy_machine_warning

    assert busy_machine_warning(0.4, 2, "before profiling") is None
    assert busy_machine_warning(1.0, 2, "before profiling") is None  # half the cores: still fair
    line = busy_machine_warning(4.2, 2, "while profiling")
    assert line.startswith("warning: this machine was busy while profiling (load average 4.2 on 2 cores)")
    assert "\n" not in line
    # a 1-thread profile on 2 cores loads one of them itself: that is no other work
    assert busy_machine_warning(1.04, 2, "while profiling", own=1) is None
    line = busy_machine_warning(3.1, 2, "while profiling", own=1)
    assert "(load average 3.1 on 2 cores, 1 of it the profile's own threads)" in line


def test_the_profile_bar_grows_its_total_and_its_clock_runs_until_the_end():
    """With rich's own Progress: past the grid's estimate the bar neither runs past its total nor
    counts as finished (rich would stop its clock), until the profile ends."""
    import io

    from megatron_dynapipe.profiling.cli import GridProgress
    from megatron_dynapipe.progress import progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    with progress_bar(True, Terminal()) as bar:
        task = bar.add_task("profile", total=4)
        progress = GridProgress(bar, task, expected=4)
        states = []
        for points in (2, 2, 1, 1):  # refinement measured two points the grid did not count
            progress("a point", points)
            t = bar.tasks[task]
            states.append((t.completed, t.total, t.finished))
        assert states == [(2, 4, False), (4, 5, False), (5, 6, False), (6, 7, False)]
        progress.finish()
        assert bar.tasks[task].finished and bar.tasks[task].completed == bar.tasks[task].total == 6


def test_a_profile_says_up_front_how_long_it_will_take_at_least():
    """Hours for a multi-billion model on a CPU-like rate, seconds for the tiny one; the FLOPs
    part doubles with the runs per point and halves with twice the rate."""
    import dataclasses

    from megatron_dynapipe.config.model import get_model
    from megatron_dynapipe.profiling.duration import describe_duration, estimated_seconds
    from megatron_dynapipe.profiling.profiler import ProfileSettings

    cpu_rate = 100e9  # FLOP/s: a few cores
    big = estimated_seconds(get_model("6.7"), ProfileSettings(tp_sizes=(1, 2, 4, 8)), cpu_rate)
    assert big > 3 * 3600 and describe_duration(big).endswith(" h")
    small = ProfileSettings(tp_sizes=(1,), max_seq_length=128, max_tokens=256, repeats=1, warmup=0)
    assert estimated_seconds(get_model("tiny"), small, cpu_rate) < 60
    flops_only = dataclasses.replace(small, min_time_ms=0.0)
    once = estimated_seconds(get_model("13"), flops_only, cpu_rate)
    assert estimated_seconds(get_model("13"), dataclasses.replace(flops_only, repeats=2), cpu_rate) == \
        pytest.approx(2 * once)
    assert estimated_seconds(get_model("13"), flops_only, 2 * cpu_rate) == pytest.approx(once / 2)
    # the floor: every part of every point is timed for at least min_time_ms
    floor_only = estimated_seconds(get_model("tiny"), dataclasses.replace(small, min_time_ms=1000.0), 1e30)
    points = sum(len(list(small.micro_batch_sizes(s))) for s in small.seq_lengths())
    assert floor_only == pytest.approx(points * (2 + len(small.recompute)) * 1.0)


def test_a_run_pace_is_the_line_through_two_runs_and_never_a_negative_cost():
    from megatron_dynapipe.profiling.duration import RunPace

    pace = RunPace.through((1e9, 0.003), (5e9, 0.011))  # 1 ms a run and 2 ms a GFLOP
    assert (pace.per_run_s, pace.per_flop_s) == (pytest.approx(0.001), pytest.approx(2e-12))
    assert RunPace.through((5e9, 0.011), (1e9, 0.003)) == pace  # in either order
    assert RunPace.through((1e9, 0.010), (5e9, 0.004)) == RunPace(0.010, 0.0)  # the larger ran faster: a run's cost
    steep = RunPace.through((1e9, 0.001), (2e9, 0.006))  # through both: -4 ms a run; the larger run's FLOPs alone
    assert (steep.per_run_s, steep.per_flop_s) == (0.0, pytest.approx(3e-12))


def test_a_calibrated_estimate_prices_every_part_as_the_profiler_times_it():
    """Hand sums for two points at a pace of 10 ms a run and nothing a FLOP: a part timed is the
    warm-up run and enough runs to add up to min_time_ms (but at least repeats, at most 50); each
    recompute type's layer adds a memory run, all of it twice where rows are also packed."""
    from megatron_dynapipe.config.model import get_model
    from megatron_dynapipe.planning.types import RecomputeType
    from megatron_dynapipe.profiling.duration import RunPace, calibrated_seconds, point_flops
    from megatron_dynapipe.profiling.profiler import ProfileSettings

    spec, pace = get_model("tiny"), RunPace(0.010, 0.0)
    settings = ProfileSettings(warmup=1, repeats=3, min_time_ms=100.0)  # 1 + 10 runs a part: 0.11 s
    rcs = list(RecomputeType)
    todo = {(1, 32, 1): point_flops(spec, settings, 1, 32, 1, rcs), (1, 64, 2): point_flops(spec, settings, 1, 64, 2,
                                                                                           rcs[:1])}
    timed, memory = 0.11, 0.01
    assert calibrated_seconds(pace, spec, settings, todo, packed=False, core=False) == pytest.approx(
        2 * 2 * timed + 4 * (timed + memory))  # head and embedding at both points; 3 + 1 layers
    assert calibrated_seconds(pace, spec, settings, todo, packed=True, core=True) == pytest.approx(
        2 * 2 * timed + 2 * 4 * (timed + memory) + 2 * timed)
    slow = RunPace(0.200, 0.0)  # runs above min_time_ms: warm-up and repeats alone
    assert calibrated_seconds(slow, spec, settings, {(1, 32, 1): todo[1, 32, 1]}, packed=False, core=False) == \
        pytest.approx(2 * 4 * 0.2 + 3 * (4 * 0.2 + 0.2))
    fast = RunPace(1e-4, 0.0)  # 1000 runs would add up to 100 ms: at most 50
    assert fast.timed_s(0.0, settings) == pytest.approx(51 * 1e-4)


def test_the_time_left_is_read_off_the_points_measured_so_far():
    """A point's seconds fitted as a cost a part timed plus a cost a FLOP over the points measured,
    summed over those left: exact where the times lie on such a line, unknown before two sizes,
    and never a negative cost."""
    from megatron_dynapipe.profiling.duration import TimeLeft

    parts = {"a": [1e9, 0.0, 3e9], "b": [2e9, 0.0, 6e9, 8e9], "c": [4e9, 0.0, 12e9], "d": [8e9, 0.0, 24e9, 32e9]}

    def seconds(point):  # 0.05 s a part and 10 GFLOP/s
        return 0.05 * len(parts[point]) + sum(parts[point]) / 1e10

    left = TimeLeft(parts)
    assert left.seconds() is None
    left.measured("a", seconds("a"))
    assert left.seconds() is None  # one size: a cost a part, or a rate?
    left.measured("b", seconds("b"))
    assert left.seconds() == pytest.approx(seconds("c") + seconds("d"))
    left.measured("c", seconds("c"))
    assert left.seconds() == pytest.approx(seconds("d"))
    left.forget(["d"])  # its row ran out of memory before it
    assert left.seconds() == 0.0
    # the larger point measured faster (a busy moment at the first): no negative rate, the cost a
    # part alone, (3 x 2 + 4 x 1) / (3^2 + 4^2) = 0.4 s, over the 3 + 4 parts left
    falling = TimeLeft(parts)
    falling.measured("a", 2.0)
    falling.measured("b", 1.0)
    assert falling.seconds() == pytest.approx(0.4 * 7)


HEAD_MEMORY = """
import json, sys, torch
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.planning.types import RecomputeType
from megatron_dynapipe.profiling.layers import build_parts, fake_tp_rank
from megatron_dynapipe.profiling.measure import measure_memory

dtype, spec = getattr(torch, sys.argv[1]), ModelSpec(**json.loads(sys.argv[2]))
with fake_tp_rank(1, torch.device("cpu")):
    parts = build_parts(spec, 1, dtype, torch.device("cpu"), [RecomputeType.NONE])
    x = torch.randn(1024, 2, spec.hidden_size, dtype=dtype, requires_grad=True)  # [seq, mbs, hidden]
    labels = torch.randint(0, spec.vocab_size, (2, 1024))
    memory = measure_memory(lambda: parts.postprocess(x, labels), torch.device("cpu"))
print(memory.stored_bytes, memory.peak_bytes)
"""


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.slow
def test_the_loss_memory_the_planner_counts_is_what_megatrons_loss_holds(dtype):
    """The last stage's LM head and loss measured on the CPU, tensor by tensor (megatron-core's own
    head, a vocabulary wide enough that the logits are nearly all of it), against what the planner
    adds to that stage: its fp32 softmax kept to the backward, the 16-bit logits beside it."""
    from megatron_dynapipe.planning.cost_model import AnalyticalCostModel

    spec = dict(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=16384, max_sequence_length=1024,
                hidden_dropout=0.0, attention_dropout=0.0)
    out = subprocess.run([sys.executable, "-c", HEAD_MEMORY, {"fp32": "float32", "bf16": "bfloat16"}[dtype],
                          json.dumps(spec)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    stored, peak = (int(v) / 2**20 for v in out.stdout.split())
    planner = AnalyticalCostModel(hidden_size=64, num_heads=4, vocab_size=16384, metadata={"dtype": dtype})
    planned_stored, planned_peak = (planner.logits_mb(kind, 2, 1024) for kind in ("stored", "peak"))
    assert planned_stored == pytest.approx(stored, rel=0.05)
    assert planned_stored + planned_peak == pytest.approx(stored + peak, rel=0.05)


def test_a_profiles_logits_are_megatrons_padded_vocabulary_over_tp(tiny_profile):
    """50257 tokens padded to a multiple of 128 x TP, as Megatron-LM pads them: 50304 at TP 1,
    50432 (25216 a rank) at TP 2."""
    doc = json.loads(json.dumps(tiny_profile[1]))
    doc["metadata"]["model"]["vocab_size"] = 50257
    for tp, per_rank in ((1, 50304), (2, 25216)):
        model = cost_model_from_document(doc, tp, source="tiny")
        assert model.vocab_per_rank() == per_rank
        assert model.logits_mb("stored", 2, 100) == pytest.approx(2 * 100 * per_rank * 4 / 2**20)


def test_the_sdpa_layer_is_measured_on_packed_rows_at_every_point_and_the_local_one_is_not(tiny_sdpa_profile,
                                                                                          tiny_profile):
    """A packed row of mbs samples of seqlen tokens is measured beside each padded point; it keeps
    the same tensors from forward to backward (the same tokens, and SDPA keeps no s x s scores),
    so its stored memory is the padded point's. megatron-core's local core runs no packed rows."""
    _, doc = tiny_sdpa_profile

    def points(table, layout):
        return {(r["recompute"], r.get("phase", r.get("kind")), r["seqlen"], r["mbs"]): r.get("ms", r.get("mb"))
                for r in doc[table] if r["layer"] == "encoder" and r.get("layout", "padded") == layout}

    assert points("layer_time", "thd").keys() == points("layer_time", "padded").keys()
    padded, packed = points("activation_memory", "padded"), points("activation_memory", "thd")
    assert packed.keys() == padded.keys() and doc["metadata"]["format_version"] == FORMAT_VERSION == 4
    for (rc, kind, s, m), mb in packed.items():
        if kind == "stored":
            assert mb == pytest.approx(padded[rc, kind, s, m], rel=0.01, abs=1e-3)
    assert not [r for r in tiny_profile[1]["layer_time"] if r.get("layout") == "thd"]


def test_packed_plans_and_thd_packing_are_priced_from_packed_rows(tiny_sdpa_profile):
    """With the packed rows' times tripled in the file, a varlen plan and the THD baseline price
    their micro-batches three times as slow in the layers; a padded plan is priced as before."""
    from megatron_dynapipe.planning import TrainingSpec, generate_execution_plan
    from megatron_dynapipe.planning.baselines import thd_packing_baseline

    doc = json.loads(json.dumps(tiny_sdpa_profile[1]))
    for r in doc["layer_time"]:
        if r.get("layout") == "thd":
            r["ms"] *= 3
    model = cost_model_from_document(doc, 1, source="tripled")
    measured = cost_model_from_document(tiny_sdpa_profile[1], 1, source="as measured")
    lengths = [40, 100, 17, 64, 128, 90, 33, 75]
    for packing, expected in (("varlen", lambda *q: 3 * measured.packed().layer_ms(*q)), ("pad", measured.layer_ms)):
        spec = TrainingSpec(num_layers=2, pp=2, memory_limit_mb=4000, packing=packing)
        costs = generate_execution_plan(lengths, spec, model).costs
        for phase in ("forward", "backward"):
            query = ("encoder", phase, "none", 2, 64)
            assert costs.model.layer_ms(*query) == pytest.approx(expected(*query))
    tripled = thd_packing_baseline(lengths, StageCosts(model, 2, pp=2), 4000, 128)
    as_measured = thd_packing_baseline(lengths, StageCosts(measured, 2, pp=2), 4000, 128)
    # Only the packed rows changed: the baseline reads them if it comes out slower at all (by how
    # much depends on the layers' share of this CPU's measured step, not a fixed ratio).
    assert tripled.makespan_ms > as_measured.makespan_ms
