"""Layout search: recompute and optimizer variants of real fake-rank traces against closed forms,
estimates against the textbook memory and FLOP formulas, and the search end to end."""

import dataclasses
import json
import math

import pytest

from megatron_dynapipe.cli import main
from megatron_dynapipe.config.model import get_model
from megatron_dynapipe.hardware import Hardware, Link, load_hardware
from megatron_dynapipe.planning.cost_model import StageCosts
from megatron_dynapipe.simulate.replay import simulate_job
from megatron_dynapipe.simulate.traced_job import load_job
from megatron_dynapipe.simulate.search import (
    Candidate,
    SearchError,
    SearchResult,
    SearchSpace,
    enumerate_candidates,
    estimate,
    rule_of_thumb,
)
from megatron_dynapipe.simulate.variants import derive

from tiny_traces import uniform

FREE = Hardware(name="free", peak_tflops={"bfloat16": 100.0}, memory_gib=80.0, memory_bandwidth_GBps=1e12,
                gpus_per_node=8, intra_node=Link(1e12, 0.0), inter_node=Link(1e12, 0.0))
SLOW = dataclasses.replace(FREE, intra_node=Link(1.0, 0.0), inter_node=Link(1.0, 0.0))  # 1 GB/s: every byte shows
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# -- variants -----------------------------------------------------------------------------------


def test_full_recompute_runs_each_forward_again_before_its_backward(tiny_traces):
    p, m, F, B = 4, 8, 1000.0, 2000.0
    job = uniform(load_job(tiny_traces["4 4 1"]), F, B)
    replay = simulate_job(derive(job, recompute="full"), FREE)
    assert replay.iteration_us == pytest.approx((m + p - 1) * (F + F + B), rel=1e-6)  # 1F1B with B' = F + B


def test_selective_recompute_adds_the_attention_cores_share_of_the_forward(tiny_traces):
    p, m, F, B = 4, 8, 1000.0, 2000.0
    job = uniform(load_job(tiny_traces["4 4 1"]), F, B)
    s, h = int(job.iteration["seq_length"]), job.model.hidden_size
    # per token and layer: matmuls 2 (4 h^2 + 2 h 4h) = 24 h^2, attention core 4 h s (QK^T and AV)
    share = 4 * h * s / (24 * h * h + 4 * h * s)
    replay = simulate_job(derive(job, recompute="selective"), FREE)
    assert replay.iteration_us == pytest.approx((m + p - 1) * (F + share * F + B), rel=1e-6)


def test_full_recompute_repeats_the_forwards_tensor_parallel_all_reduces(tiny_traces):
    job = load_job(tiny_traces["16 2 2"])
    derived = derive(job, recompute="full")
    for rank, trace in job.traces.items():
        forward_tp = sum(op.kind == "all_reduce" and op.group_name == "TENSOR_MODEL_PARALLEL_GROUP"
                         and op.phase == "forward" for op in trace.ops)
        before = sum(op.group_name == "TENSOR_MODEL_PARALLEL_GROUP" for op in trace.ops)
        after = sum(op.group_name == "TENSOR_MODEL_PARALLEL_GROUP" for op in derived.traces[rank].ops)
        assert forward_tp > 0 and after == before + forward_tp


def test_the_distributed_optimizer_reduce_scatters_gradients_and_gathers_16_bit_parameters(tiny_traces):
    job = load_job(tiny_traces["16 2 2"])
    derived = derive(job, distributed_optimizer=True)
    for rank, trace in job.traces.items():
        syncs = [op for op in trace.ops if op.name.endswith("start_grad_sync")]
        ops = derived.traces[rank].ops
        scatters = [op for op in ops if op.name.endswith("start_grad_sync")]
        gathers = [op for op in ops if op.kind == "all_gather"]
        assert syncs and [op.kind for op in scatters] == ["reduce_scatter"] * len(syncs)
        assert [op.bytes for op in scatters] == [op.bytes for op in syncs]
        assert [g.bytes for g in gathers] == [op.bytes * BYTES[job.dtype] // BYTES[op.dtype] for op in syncs]
        last_optimizer = max(i for i, op in enumerate(ops) if op.phase == "optimizer_step" and op.kind != "all_gather")
        assert all(ops.index(g) > last_optimizer for g in gathers)  # after the step, as Megatron gathers


def test_the_distributed_optimizer_moves_fewer_gradient_bytes_on_a_ring(tiny_traces):
    # ring all-reduce: 2 (n-1)/n S; reduce-scatter S plus all-gather S/2: (n-1)/n (S + S/2)
    job = load_job(tiny_traces["16 2 2"])
    plain = simulate_job(job, SLOW).ranks[0].comm_us  # stage 0's blocking communication, by kind
    sharded = simulate_job(derive(job, distributed_optimizer=True), SLOW).ranks[0].comm_us
    n = job.layout.dp
    grads = sum(op.bytes for op in job.traces[0].ops if op.name.endswith("start_grad_sync")) / 1e3  # us at 1 GB/s
    assert sharded["reduce_scatter"] == pytest.approx((n - 1) / n * grads, rel=1e-6)
    assert sharded["all_gather"] == pytest.approx((n - 1) / n * grads * BYTES[job.dtype] / 4, rel=1e-6)
    assert plain["all_reduce"] - sharded["all_reduce"] == pytest.approx(2 * (n - 1) / n * grads, rel=1e-6)


def test_derived_memory_shards_adam_over_dp_and_recompute_keeps_less(tiny_traces):
    job = load_job(tiny_traces["16 2 2"])
    rank, trace = next(iter(job.traces.items()))
    optimizer = trace.memory["model_state_detail"]["optimizer"]
    sharded = derive(job, distributed_optimizer=True).traces[rank].memory
    assert sharded["peak_bytes"] == trace.memory["peak_bytes"] - optimizer + math.ceil(optimizer / job.layout.dp)
    peaks = [derive(job, recompute=r).traces[rank].memory["activation_peak_bytes"] for r in ("none", "selective", "full")]
    assert peaks[0] > peaks[1] > peaks[2]


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_derived_recompute_memory_is_a_direct_trace_of_it_plus_the_layer_recomputed(tiny_traces, tmp_path, recompute):
    from megatron_dynapipe.config.megatron_options import MegatronOptions
    from megatron_dynapipe.tracer.batch_config import parse_configs
    from megatron_dynapipe.tracer.batch_run import run_batch

    job = load_job(tiny_traces["16 2 2"])
    flags = {"recompute_method": "uniform", "recompute_num_layers": 1} if recompute == "full" else {}
    result, = run_batch(parse_configs(["16 2 2"], model="tiny"), tmp_path, shapes_only=True, progress=False,
                        training=MegatronOptions(recompute_granularity=recompute, **flags))
    assert result.status == "ok", result.error
    direct, derived = load_job(result.folder), derive(job, recompute=recompute)
    s, b, h, tp = int(job.iteration["seq_length"]), int(job.iteration["micro_batch_size"]), 128, job.layout.tp
    for rank, trace in job.traces.items():
        probes = trace.memory["activation_probe_bytes"]
        # bf16 inputs: the layer's hidden states, the core's query, key and value on this TP rank
        assert probes["layer_input"] == 2 * s * b * h and probes["core_attention_input"] == 2 * 3 * s * b * h // tp
        # while one layer's backward runs, what recomputation had freed in it is held again
        again = (probes["transformer_layer"] - probes["layer_input"] if recompute == "full"
                 else probes["core_attention"] - probes["core_attention_input"])
        traced = direct.traces[rank].memory["activation_peak_bytes"]
        assert derived.traces[rank].memory["activation_peak_bytes"] == pytest.approx(traced + again, rel=1e-5)


def test_a_trace_that_already_recomputes_is_not_derived_again(tiny_traces):
    job = derive(load_job(tiny_traces["16 2 2"]), recompute="full")
    with pytest.raises(ValueError, match="derive variants from a trace without either"):
        derive(job, distributed_optimizer=True)


# -- estimates ------------------------------------------------------------------------------------


def space(model="tiny", world=8, gbs=16, seq=None, hardware=FREE, **fixed):
    model = get_model(model)
    return SearchSpace(model, world, gbs, seq or model.max_sequence_length, hardware, **fixed)


def test_enumeration_matches_megatrons_divisibility_rules():
    s = space(world=8, gbs=16)
    m = s.model
    expected = set()
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4):
            for mbs in (1, 2, 4, 8):
                dp = 8 // (tp * pp) if 8 % (tp * pp) == 0 else 0
                if not (dp and m.num_layers % pp == 0 and m.num_attention_heads % tp == 0 and 16 % (mbs * dp) == 0):
                    continue
                microbatches = 16 // (mbs * dp)
                # sequence parallelism needs TP; V chunks need PP > 1, V | layers a stage, PP | micro-batches
                chunks = [v for v in (1, 2, 4) if v == 1 or (
                    pp > 1 and (m.num_layers // pp) % v == 0 and microbatches % pp == 0)]
                for sp in ((False, True) if tp > 1 else (False,)):
                    for v in chunks:
                        for recompute in ("none", "selective", "full"):
                            for dist_opt in (False, True):
                                expected.add(Candidate(tp, pp, 1, dp, mbs, microbatches, recompute, dist_opt, sp, v))
    found = enumerate_candidates(s)
    assert len(found) == len(set(found)) and set(found) == expected


def test_blocking_pipeline_communication_interleaves_only_from_pp_3_and_traces_with_megatrons_flag():
    # Megatron-LM batches the transfers it does not overlap, and refuses interleaving at PP 2 then
    blocking = space(world=8, gbs=16, overlap_p2p_comm=False)
    assert {c.virtual_stages for c in enumerate_candidates(blocking) if c.pp == 2} == {1}
    assert {c.virtual_stages for c in enumerate_candidates(space(world=8, gbs=16)) if c.pp == 2} == {1, 2}
    deeper = space("6.7", world=8, gbs=16, overlap_p2p_comm=False)  # 8 layers a stage at PP 4
    chunked = [c for c in enumerate_candidates(deeper) if c.pp == 4]
    assert {c.virtual_stages for c in chunked} == {1, 2, 4}
    options = deeper.training_options(False, 2)
    assert "--no-overlap-p2p-communication" in options.megatron_args()
    assert SearchResult(deeper, [], None).to_json()["overlap_p2p_comm"] is False  # search.json says how it was run


def test_estimated_memory_is_the_textbook_formula_on_the_first_stage():
    # 6.7B, TP 2, PP 4, DP 8, 8 micro-batches of 1 x 2048, no recompute, Adam sharded over DP
    s = space("6.7", world=64, gbs=64, hardware=load_hardware("a100"))
    c = Candidate(2, 4, 1, 8, 1, 8, "none", True)
    h, a, L, V, t, p, seq = 4096, 32, 32, 51200, 2, 4, 2048
    params = L // p * ((12 * h * h + 7 * h) / t + 6 * h) + V * h / t  # layers, then the word embedding
    state = params * (4 + 12 / 8)  # 16-bit weight and gradient, 12 B of Adam over 8 DP ranks
    per_layer = seq * h * (10 + 24 / t + 5 * a * seq / (h * t))  # Korthikanti et al. 2022, 16-bit
    activations = p * (L // p) * per_layer + per_layer  # 4 micro-batches in flight, plus one layer's work
    assert estimate(s, c).memory_bytes == pytest.approx(state + activations, rel=1e-9)


def test_sequence_parallelism_divides_the_activations_outside_the_attention_core():
    # as above with --sequence-parallel: Korthikanti et al.'s 34/t in place of 10 + 24/t, in what
    # the micro-batches keep and in a layer's working set
    s = space("6.7", world=64, gbs=64, hardware=load_hardware("a100"))
    c = Candidate(2, 4, 1, 8, 1, 8, "none", True, sequence_parallel=True)
    h, a, L, V, t, p, seq = 4096, 32, 32, 51200, 2, 4, 2048
    params = L // p * ((12 * h * h + 7 * h) / t + 6 * h) + V * h / t
    state = params * (4 + 12 / 8)
    per_layer_sp = seq * h * (34 / t + 5 * a * seq / (h * t))
    activations = p * (L // p) * per_layer_sp + per_layer_sp
    assert estimate(s, c).memory_bytes == pytest.approx(state + activations, rel=1e-9)


def test_a_profile_measured_without_sequence_parallelism_has_its_kept_activations_scaled():
    s = dataclasses.replace(space("6.7", world=64, gbs=64, hardware=load_hardware("a100")), cost_model="gpt-6.7b-a100")
    plain, sp = (Candidate(2, 4, 1, 8, 1, 8, "none", True, sequence_parallel=on) for on in (False, True))
    costs = StageCosts(s.cost_model_for(2), num_layers=32, pp=4, dp=8, zero_stage=1)
    kept = 4 * costs.stored_mb(0, 1, 2048, "none") * 2**20  # 4 micro-batches in flight on the first stage
    h, a, t, seq = 4096, 32, 2, 2048
    share = (34 / t + 5 * a * seq / (h * t)) / (10 + 24 / t + 5 * a * seq / (h * t))
    assert estimate(s, plain).memory_bytes - estimate(s, sp).memory_bytes == pytest.approx(kept * (1 - share),
                                                                                           rel=1e-9)


def test_interleaving_divides_the_estimated_bubble_by_the_chunks():
    # (m + (p - 1) / V) passes of the slowest stage: the gain over V = 1 is (p - 1)(1 - 1/V) of
    # them, so V = 2 gains 2/3 of what V = 4 does; free communication keeps the stage's time
    s = space("6.7", world=8, gbs=16, tp=(1,), pp=(4,))
    one, two, four = (estimate(s, Candidate(1, 4, 1, 2, 1, 8, "none", False, virtual_stages=v)).iteration_s
                      for v in (1, 2, 4))
    assert (one - two) / (one - four) == pytest.approx((1 - 1 / 2) / (1 - 1 / 4), rel=1e-6)


def test_estimated_time_on_one_gpu_is_flops_over_throughput_plus_the_optimizer():
    hw = dataclasses.replace(load_hardware("a100"), compute={})  # no roofline: a flat 50% of peak
    s = space("6.7", world=1, gbs=4, hardware=hw)
    c = Candidate(1, 1, 1, 1, 1, 4, "none", False)
    h, L, V, seq, m = 4096, 32, 51200, 2048, 4
    layer = 24 * h * h * seq + 4 * h * seq * seq  # forward FLOPs of one layer (attention not causal-halved)
    step = m * 3 * (L * layer + 2 * h * V * seq)
    flops_per_s = hw.peak("bfloat16") * 1e12 * 0.5  # the analytical model's 50% of peak
    state = 16 * (L * (12 * h * h + 13 * h) + V * h)
    expected = step / flops_per_s + 2 * state / (hw.memory_bandwidth_GBps * 1e9)
    assert estimate(s, c).iteration_s == pytest.approx(expected, rel=1e-9)


def test_the_rule_of_thumb_fills_a_node_with_tp_and_puts_about_4b_parameters_on_a_rank():
    a100 = load_hardware("a100")
    big = rule_of_thumb(space("175", world=8192, gbs=1536, hardware=a100))
    # 175 B / 4 B = 44 model-parallel ranks: TP 8, then the smallest PP >= 5.5 that splits 96
    # layers and 8192 GPUs is 8
    assert (big.tp, big.pp, big.micro_batch_size, big.distributed_optimizer) == (8, 8, 1, True)
    assert big.recompute == "selective" and big.pp < big.num_microbatches
    small = rule_of_thumb(space("6.7", world=64, gbs=128, hardware=a100))
    assert (small.tp, small.pp) == (2, 1)  # 6.7 B / 4 B = 2 ranks


@pytest.mark.parametrize("kwargs,says", [
    (dict(model="tiny", world=16, gbs=3, tp=(1,), pp=(1,)), "global batch is a multiple of the data-parallel size"),
    (dict(model="175", world=8, gbs=8), "no layout fits 80 GiB per GPU"),
])
def test_a_search_that_cannot_find_a_layout_says_what_to_change(tmp_path, kwargs, says):
    from megatron_dynapipe.simulate.search import run_search

    model, world, gbs = kwargs.pop("model"), kwargs.pop("world"), kwargs.pop("gbs")
    with pytest.raises(SearchError, match=says) as error:
        run_search(space(model, world=world, gbs=gbs, hardware=load_hardware("a100"), **kwargs), tmp_path,
                   progress=False)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "traces").exists()  # refused before tracing


@pytest.mark.parametrize("kwargs,says", [
    (dict(cp=(3,)), "use a CP that divides both --seq-length"),
    (dict(recompute=("some",)), "use none, selective, full"),
    (dict(seq=4096), "raise --max-position-embeddings"),
    (dict(world=10**9), "--world-size 1,000,000,000 is over the 1,048,576 a job may have"),
    (dict(pp=(7,)), "--pp 7: pipeline stages must divide --world-size 8 and the model's 4 layers; use one of 1, 2, 4"),
    (dict(gbs=10**9), "--global-batch-size 1,000,000,000 is over the 16,777,216 a job may have"),
    (dict(tp_comm_overlap=True, sequence_parallel=(False,)), "drop --no-sequence-parallel or --tp-comm-overlap"),
])
def test_bad_search_settings_are_refused_in_one_line(kwargs, says):
    with pytest.raises(SearchError, match=says) as error:
        space(**kwargs)
    assert "\n" not in str(error.value)


def test_tp_comm_overlap_is_traced_on_the_sequence_parallel_layouts_alone():
    """Megatron-LM refuses --tp-comm-overlap without --sequence-parallel, and turns sequence
    parallelism off at TP 1: a search asked for the overlap still weighs the layouts without it."""
    s = space(tp_comm_overlap=True, virtual_stages=(1,))
    assert {(o.sequence_parallel, o.tp_comm_overlap) for o in s.training_values(2, 1, 16)} == {(False, False),
                                                                                               (True, True)}
    assert {(o.sequence_parallel, o.tp_comm_overlap) for o in s.training_values(1, 1, 16)} == {(False, False)}


def test_a_mixture_of_experts_model_is_refused_with_what_to_do_instead():
    with pytest.raises(SearchError, match="trace MoE layouts"):
        SearchSpace(get_model("tiny").with_experts(4), 8, 16, 256, FREE)


# -- end to end -----------------------------------------------------------------------------------


def test_context_parallel_layouts_are_searched_on_long_sequences_and_traced(tmp_path, capsys):
    long = space(seq=8192, model=dataclasses.replace(get_model("tiny"), max_sequence_length=8192))
    assert long.cp_values() == [1, 2, 4, 8] and space().cp_values() == [1]  # tiny's 256 tokens: none
    assert {c.cp * c.dp * c.tp * c.pp for c in enumerate_candidates(long)} == {8}
    argv = ["search", "--model", "tiny", "--world-size", "4", "--global-batch-size", "4", "--cp", "2", "--tp", "1",
            "--pp", "1", "--micro-batch-size", "1", "--recompute", "none", "--no-distributed-optimizer",
            "--output-dir", str(tmp_path), "--no-progress", "--json"]
    assert main(argv) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert (best["cp"], best["dp"], best["status"]) == (2, 2, "simulated")


def test_search_ranks_simulated_layouts_and_reuses_its_traces(tmp_path, capsys):
    argv = ["search", "--model", "tiny", "--world-size", "8", "--global-batch-size", "16", "--max-traced", "2",
            "--micro-batch-size", "1,2", "--output-dir", str(tmp_path), "--no-progress", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert first == json.loads((tmp_path / "search.json").read_text())
    assert (tmp_path / "search.png").stat().st_size > 0
    counts = first["counts"]
    assert counts["enumerated"] == counts["pruned"] + counts["estimated"] + counts["simulated"] + counts["failed"]
    assert counts["failed"] == 0 and counts["simulated"] >= 2 * 6  # two shapes, six variants each
    simulated = [c for c in first["candidates"] if c["status"] == "simulated"]
    fitting = sorted((c for c in simulated if c["fits"]), key=lambda c: c["iteration_s"])
    assert first["best"]["iteration_s"] == fitting[0]["iteration_s"]
    # the estimate prunes conservatively: it never needs more memory than the trace found
    assert all(c["estimated_memory_gib"] <= c["peak_memory_gib"] for c in simulated)
    shapes = {(c["tp"], c["pp"], c["micro_batch_size"]) for c in simulated}
    assert first["traced_layouts"] == len(shapes) == 2 and first["reused_traces"] == 0  # --max-traced, exactly
    rule = first["rule_of_thumb"]
    assert rule["status"] == "simulated"
    assert first["rule_of_thumb_slowdown"] == pytest.approx(rule["iteration_s"] / first["best"]["iteration_s"])
    assert first["rule_of_thumb_slowdown"] >= 1.0  # the best is at least as fast as any simulated layout

    assert main(argv) == 0  # again: every trace is found in the output folder
    second = json.loads(capsys.readouterr().out)
    assert second["traced_layouts"] == 0 and second["reused_traces"] == first["traced_layouts"]
    assert second["best"] == first["best"]

    # a trace an earlier tracer recorded (less: no waits) is traced again, not reused
    (stale, *_) = sorted((tmp_path / "traces").rglob("summary.json"))
    summary = json.loads(stale.read_text())
    stale.write_text(json.dumps({k: v for k, v in summary.items() if k != "recording_revision"}))
    assert main(argv) == 0
    third = json.loads(capsys.readouterr().out)
    assert third["traced_layouts"] == 1 and third["reused_traces"] == first["traced_layouts"] - 1
    assert third["best"] == first["best"]

    # kept traces that cannot be read (a disk filled, a hand edit): not "no layout fits" with exit 0,
    # but exit 1, naming the failure and what to delete
    for trace in (tmp_path / "traces").rglob("rank_*.trace.jsonl"):
        trace.write_text(trace.read_text()[:100])
    assert main(argv) == 1
    captured = capsys.readouterr()
    broken = json.loads(captured.out)
    assert broken["best"] is None and broken["counts"]["failed"] == first["counts"]["simulated"]
    (line,) = [x for x in captured.err.splitlines() if x.startswith("megatron-dynapipe search: ")]
    assert "no layout could be simulated" in line and f"delete it from {tmp_path / 'traces'}" in line


def test_search_prints_the_top_layouts_and_the_rule_of_thumb(tmp_path, capsys):
    argv = ["search", "--model", "tiny", "--world-size", "4", "--global-batch-size", "8", "--max-traced", "1",
            "--tp", "1,2", "--recompute", "none", "--no-distributed-optimizer", "--output-dir", str(tmp_path),
            "--no-progress", "--top", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "   #   TP SP   PP VPP  CP    DP" in out and "\n   1 " in out and "rule of thumb" in out
    assert "time against memory: " + str(tmp_path / "search.png") in out
    # the core priced, and the flag that chooses it: Megatron-LM's default layers, as a job's command line
    assert "attention: transformer-engine's fused core (--transformer-impl transformer_engine)" in out
    assert main([*argv, "--transformer-impl", "local"]) == 0
    assert "attention: megatron-core's unfused local core (--transformer-impl local)" in capsys.readouterr().out


def test_overlap_grad_reduce_is_traced_and_hides_the_reduction_for_both_optimizers(tmp_path, capsys):
    """On a slow link the data-parallel reduction is most of the step; traced with Megatron-LM's
    --overlap-grad-reduce (another trace, not the one without it), the buckets run during the
    backward pass, for the all-reduce and the distributed optimizer's reduce-scatter alike."""
    hardware = load_hardware("h100").to_json()
    hardware["intra_node"] = {"bandwidth_GBps": 5.0, "latency_us": 0.0}
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(hardware))
    argv = ["search", "--model", "tiny", "--world-size", "4", "--global-batch-size", "4", "--tp", "1", "--pp", "1",
            "--micro-batch-size", "1", "--recompute", "none", "--hardware", str(path),
            "--output-dir", str(tmp_path / "out"), "--no-progress", "--json"]
    steps = {}
    for overlap in (False, True):
        assert main([*argv, *(["--overlap-grad-reduce"] if overlap else [])]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["overlap_grad_reduce"] is overlap and document["traced_layouts"] == 1
        steps[overlap] = {c["distributed_optimizer"]: c["iteration_s"] for c in document["candidates"]
                          if c["status"] == "simulated"}
    for optimizer in (False, True):
        assert steps[True][optimizer] < 0.9 * steps[False][optimizer], steps


def test_traces_made_with_one_cost_model_are_never_reused_for_another(tmp_path):
    """The trace cache is keyed by the cost model: its whole name (shipped names have dots) and
    its bytes (another file of that name, or the same file edited, is another model)."""
    labels = {name: space(model="6.7", cost_model=name).compute_label for name in ("gpt-6.7b-a100", "gpt-6.7b-h100")}
    assert labels["gpt-6.7b-a100"] != labels["gpt-6.7b-h100"]
    assert all(label.startswith(name + "-") for name, label in labels.items())
    from megatron_dynapipe.planning.cost_model.loading import shipped_profiles

    mine = tmp_path / "gpt-6.7b-a100.json"
    mine.write_bytes(shipped_profiles()["gpt-6.7b-a100"].read_bytes())
    assert space(model="6.7", cost_model=str(mine)).compute_label == labels["gpt-6.7b-a100"]  # same bytes
    mine.write_bytes(mine.read_bytes() + b"\n")
    assert space(model="6.7", cost_model=str(mine)).compute_label != labels["gpt-6.7b-a100"]


@pytest.mark.parametrize("tp, message", [
    (16, r"--tp 16 spans 2 nodes of 8 GPUs \(free\): tensor parallelism stays inside a node"),
    (3, r"--tp 3: 32 attention heads of model 6.7B are not divisible by --tp = 3"),
])
def test_a_fixed_tp_no_layout_can_use_is_refused_before_the_search(tp, message):
    with pytest.raises(SearchError, match=message):
        space(model="6.7", world=64, gbs=64, tp=(tp,))


def test_layouts_must_leave_the_memory_headroom_free(tmp_path, capsys):
    argv = ["search", "--model", "tiny", "--world-size", "4", "--global-batch-size", "8", "--max-traced", "1",
            "--tp", "1", "--recompute", "none", "--no-distributed-optimizer", "--output-dir", str(tmp_path),
            "--no-progress", "--json"]
    assert main(argv) == 0  # the default: 10% of the A100's 80 GiB left free
    doc = json.loads(capsys.readouterr().out)
    assert doc["memory_headroom"] == 0.1 and doc["usable_memory_gib"] == pytest.approx(72.0)
    # the tiny GPT's model state alone is over 0.01 GiB a GPU: leaving all but 0.004 GiB free fits no layout
    assert main([*argv, "--memory-headroom", "0.99995"]) == 2
    assert "no layout fits 0.004 GiB per GPU" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("signum, to_group", [("SIGINT", True), ("SIGTERM", False)], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_search_writes_no_ranking_and_exits_as_the_signal_says(tmp_path, signum, to_group):
    """Ctrl-C as a terminal sends it (SIGINT to the whole process group), or SIGTERM as a scheduler or
    ``kill`` sends it (to the command alone), while shapes are traced: 130 or 143, no ranking."""
    import os
    import signal
    import subprocess
    import sys

    signum = getattr(signal, signum)

    command = [sys.executable, "-m", "megatron_dynapipe.cli", "search", "--model", "175", "--world-size", "1024",
               "--global-batch-size", "512", "--max-traced", "4", "--output-dir", str(tmp_path), "--no-progress"]
    (tmp_path / "search.json").write_text('{"best": "from an earlier run"}')  # not left looking current
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        said = []
        for line in proc.stderr:  # the search says when tracing starts
            said.append(line)
            if "best-estimated shapes" in line:
                break
        (os.killpg if to_group else os.kill)(proc.pid, signum)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = "".join(said) + err
    assert proc.returncode == 128 + signum, err[-3000:]
    assert f"interrupted, no ranking written; the shapes traced in full are kept in {tmp_path / 'traces'}" in err
    assert not (tmp_path / "search.json").exists() and "best" not in out


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_an_interrupt_swallowed_where_it_landed_still_counts(signum):
    """As when the KeyboardInterrupt lands in a hook run at fork, which ignores it, and the work goes on."""
    import signal

    from megatron_dynapipe import interrupts

    signum = getattr(signal, signum)
    before = {s: signal.getsignal(s) for s in interrupts.INTERRUPTS}
    with interrupts.noted_interrupts():
        try:
            signal.raise_signal(signum)
        except KeyboardInterrupt:
            pass  # swallowed
        assert interrupts.interrupted() == signum and interrupts.exit_code(signum) == 128 + signum
    assert {s: signal.getsignal(s) for s in interrupts.INTERRUPTS} == before  # put back
    assert interrupts.interrupted() is None  # and nothing stays noted for what runs later in this process
