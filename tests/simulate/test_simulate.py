"""The simulator: hardware prices against nccl-tests' definitions, FLOPs against the published
formula, and replays of real fake-rank traces against the 1F1B closed form."""

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from megatron_dynapipe.config.accounting import step_flops
from megatron_dynapipe.config.model import get_model
from megatron_dynapipe.hardware import Hardware, HardwareFileError, Link, hardware_names, load_hardware
from megatron_dynapipe.simulate.replay import simulate_job
from megatron_dynapipe.simulate.traced_job import TraceMismatch, load_job
from megatron_dynapipe.simulate.report import report, timeline
from megatron_dynapipe.simulate.variants import derive
from megatron_dynapipe.tracer.trace_format import RankTrace, TraceFormatError

from tiny_traces import uniform

GB = 1e9


def link_hw(bandwidth=100.0, latency=0.0, per_node=8, inter=(25.0, 0.0), memory_bw=1e12):
    return Hardware(name="test", peak_tflops={"bfloat16": 100.0, "float32": 10.0}, memory_gib=80.0,
                    memory_bandwidth_GBps=memory_bw, gpus_per_node=per_node, intra_node=Link(bandwidth, latency),
                    inter_node=Link(*inter))


FREE = link_hw(bandwidth=1e12, latency=0.0, inter=(1e12, 0.0))  # communication costs nothing


# -- hardware -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,bus_factor", [("all_reduce", lambda n: 2 * (n - 1) / n),
                                             ("all_gather", lambda n: (n - 1) / n),
                                             ("reduce_scatter", lambda n: (n - 1) / n),
                                             ("all_to_all", lambda n: (n - 1) / n)])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_large_collectives_run_at_the_links_bus_bandwidth(kind, bus_factor, n):
    # nccl-tests: algbw = size / time, busbw = algbw * factor(n); a bandwidth-bound collective's
    # busbw is the link's bandwidth
    hw = link_hw(bandwidth=100.0, latency=0.0)
    size = 1 * GB
    seconds = hw.collective_us(kind, size, range(n)) / 1e6
    assert size / seconds * bus_factor(n) / GB == pytest.approx(100.0)


def test_small_all_reduces_take_the_tree_and_large_ones_the_ring():
    hw = link_hw(bandwidth=100.0, latency=5.0)
    assert hw.collective_us("all_reduce", 8, range(8)) == pytest.approx(2 * 3 * 5.0 + 2 * 8 / 1e5)  # 2 log2(8) steps
    big = 4 * GB
    assert hw.collective_us("all_reduce", big, range(8)) == pytest.approx(2 * 7 * 5.0 + 2 * 7 / 8 * big / 1e5)


def rails_hw(nics_per_node=8, nvlink=200.0, nic=20.0, nvlink_latency=0.0, nic_latency=0.0):
    return dataclasses.replace(link_hw(bandwidth=nvlink, latency=nvlink_latency, per_node=8, inter=(nic, nic_latency)),
                               nics_per_node=nics_per_node)


@pytest.mark.parametrize("tp,rails", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_a_data_parallel_group_drives_one_rail_per_member_on_a_node(tp, rails):
    # DGX: one 20 GB/s NIC per GPU.  The DP group of one TP rank has 8 / tp members per node, and
    # the tp groups reduce at once, each on its own NICs; NCCL's ring sends 2 (n-1)/n S out of
    # every node, spread over the group's rails (capped by NVLink when it is the slower)
    hw, size = rails_hw(), 800e6
    group = range(0, 32, tp)  # 4 nodes
    n = len(group)
    bandwidth = min(200.0, rails * 20.0)
    assert hw.collective_us("all_reduce", size, group) == pytest.approx(2 * (n - 1) / n * size / (bandwidth * 1e3))
    assert hw.collective_us("all_gather", size, group) == pytest.approx((n - 1) / n * size / (bandwidth * 1e3))


def test_rails_are_capped_by_nvlink_and_shared_when_a_node_has_fewer_nics():
    size = 1e9
    fast_nics = rails_hw(nic=50.0)  # 8 x 50 GB/s of network, 200 GB/s of NVLink: NVLink limits the ring
    assert fast_nics.collective_us("reduce_scatter", size, range(16)) == pytest.approx(15 / 16 * size / 200e3)
    four_nics = rails_hw(nics_per_node=4)  # two GPUs share a NIC: a full node drives 4 of them
    assert four_nics.collective_us("reduce_scatter", size, range(16)) == pytest.approx(15 / 16 * size / 80e3)
    assert four_nics.collective_us("reduce_scatter", size, [0, 8]) == pytest.approx(1 / 2 * size / 20e3)


def test_small_all_reduces_across_nodes_take_nccls_tree():
    hw = rails_hw(nvlink_latency=1.0, nic_latency=10.0)
    group, n, nodes, k = range(64), 64, 8, 8
    tiny = 1024.0
    ring = 2 * (n - 1) * 10.0 + 2 * (n - 1) / n * tiny / 160e3
    tree = 2 * (math.log2(nodes) * 10.0 + (k - 1) * 1.0) + 2 * tiny / 160e3
    assert tree < ring
    assert hw.collective_us("all_reduce", tiny, group) == pytest.approx(tree)
    big = 8e9  # bandwidth-bound: the ring's 2 (n-1)/n beats the tree's 2
    ring = 2 * (n - 1) * 10.0 + 2 * (n - 1) / n * big / 160e3
    assert hw.collective_us("all_reduce", big, group) == pytest.approx(ring)


def test_an_all_to_all_across_nodes_sends_the_off_node_share_over_the_rails():
    hw = rails_hw(nvlink=200.0, nic=20.0)
    size, n, k = 1.6e9, 16, 8  # 2 full nodes: half of every rank's data leaves its node
    off_node = (n - k) / n * size / (8 * 20e3 / k)  # 8 NICs shared by 8 senders
    assert hw.collective_us("all_to_all", size, range(16)) == pytest.approx(off_node)


def test_p2p_crosses_the_network_only_between_nodes():
    hw = link_hw(bandwidth=200.0, latency=2.0, per_node=8, inter=(20.0, 10.0))
    assert hw.p2p_us(1e6, 6, 7) == pytest.approx(2.0 + 1e6 / 200e3)
    assert hw.p2p_us(1e6, 7, 8) == pytest.approx(10.0 + 1e6 / 20e3)


def test_the_shipped_hardware_files_load():
    assert {"a100", "h100", "a100-80gb-sxm", "h100-80gb-sxm"} <= set(hardware_names())
    h100 = load_hardware("h100")
    assert h100.peak("bfloat16") == pytest.approx(989.4) and h100.gpus_per_node == 8
    assert load_hardware("A100").memory_gib == 80


@pytest.mark.parametrize("edit,says,fix", [
    (lambda d: d.pop("inter_node"), "missing field 'inter_node'", "calibrate"),
    (lambda d: d["intra_node"].pop("bandwidth_GBps"), "missing field 'intra_node.bandwidth_GBps'", "calibrate"),
    (lambda d: d.update(memory_gib=-1), "memory_gib must be a positive number", "calibrate"),
    (lambda d: d.update(version=7), "version 7", "calibrate"),
    (lambda d: d.update(collectives={"allreduce": {"bandwidth_GBps": 1, "latency_us": 1}}), "collectives.allreduce",
     "rename or remove it"),
])
def test_a_bad_hardware_file_is_refused_in_one_line_that_names_the_field(tmp_path, edit, says, fix):
    data = load_hardware("h100").to_json()
    edit(data)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HardwareFileError) as info:
        load_hardware(path)
    message = str(info.value)
    assert says in message and "\n" not in message and fix in message


def test_an_unknown_hardware_name_lists_the_shipped_ones():
    with pytest.raises(HardwareFileError, match="h100-80gb-sxm"):
        load_hardware("tpu-v9")


def test_a_hardware_file_survives_a_round_trip(tmp_path):
    hw = dataclasses.replace(load_hardware("a100"), collectives={"all_reduce": Link(3.0, 40.0)})
    assert load_hardware(hw.write(tmp_path / "a.json")) == hw


# -- FLOPs --------------------------------------------------------------------------------------


def test_model_flops_match_narayanan_et_al():
    # Narayanan et al. (2021), eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh) with full recomputation,
    # whose no-recompute form is 72 B s l h^2 (1 + s/6h + V/12lh); non-causal attention.
    model = get_model("175B")
    B, s, l, h = 1536, 2048, model.num_layers, model.hidden_size
    V = model.padded_vocab_size(8)
    tokens = B * s
    assert step_flops(model, tokens, s, tp=8, causal=False) == pytest.approx(
        72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)))
    assert step_flops(model, tokens, s, tp=8, recompute="full", causal=False) == pytest.approx(
        96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)))


def test_causal_attention_halves_the_score_flops():
    model = get_model("6.7B")
    full, causal = (step_flops(model, 2048, 2048, causal=c) for c in (False, True))
    assert full - causal == pytest.approx(3 * model.num_layers * 2 * model.hidden_size * 2048 * 2048)


# -- replays of real traces ---------------------------------------------------------------------


def test_a_uniform_pipeline_takes_the_1f1b_closed_form(tiny_traces):
    p, m, F, B = 4, 8, 1000.0, 2000.0
    job = uniform(load_job(tiny_traces["4 4 1"]), F, B)
    replay = simulate_job(job, FREE)
    assert replay.iteration_us == pytest.approx((m + p - 1) * (F + B), rel=1e-6)
    result = report(replay)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-6)
    for stage in result.stages:  # every stage computes m forwards and backwards
        assert stage.compute_s == pytest.approx(m * (F + B) / 1e6, rel=1e-6)


@pytest.mark.parametrize("m", [4, 6, 8])
def test_an_interleaved_pipeline_takes_the_interleaved_closed_form(tmp_path, m):
    """Narayanan et al. (2021): with V model chunks per rank the bubble shrinks V-fold, so an
    iteration of m micro-batches over p stages takes (V m + p - 1) chunk passes of F + B each.
    The tiny GPT's 4 layers over p = 2 stages in one-layer chunks: V = 2.  The derived
    full-recompute variant keeps the form with a backward of F + B."""
    from megatron_dynapipe.config.megatron_options import MegatronOptions
    from megatron_dynapipe.tracer.batch_config import parse_configs
    from megatron_dynapipe.tracer.batch_run import run_batch

    p, v, F, B = 2, 2, 1000.0, 2000.0
    (traced,) = run_batch(parse_configs([f"4 2 1 nmb={m}"], model="tiny"), tmp_path, shapes_only=True,
                          progress=False, training=MegatronOptions(layers_per_virtual_stage=1))
    assert traced.status == "ok", traced.error
    job = uniform(load_job(traced.folder), F, B)
    replay = simulate_job(job, FREE)
    assert replay.iteration_us == pytest.approx((v * m + p - 1) * (F + B), rel=1e-6)
    assert report(replay).bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-6)
    # full recompute runs each chunk's own forward again before its backward: B' = F + B
    derived = derive(job, recompute="full")
    for trace in derived.traces.values():
        top = [op for op in trace.ops if op.parent is None and op.cat == "compute"]
        pairs = [(a.microbatch, a.chunk, b.kind, b.microbatch, b.chunk) for a, b in zip(top, top[1:])
                 if a.kind == "recompute"]
        assert len(pairs) == v * m and all(pair[:2] == pair[3:] and pair[2] == "backward" for pair in pairs)
    assert simulate_job(derived, FREE).iteration_us == pytest.approx((v * m + p - 1) * (F + F + B), rel=1e-6)


def test_a_replay_without_spans_is_the_same_iteration_and_draws_no_timeline(tiny_traces):
    job = uniform(load_job(tiny_traces["4 4 1"]), 1000.0, 2000.0)
    drawn, bare = simulate_job(job, FREE), simulate_job(job, FREE, spans=False)
    assert bare.iteration_us == drawn.iteration_us and report(bare) == report(drawn)
    assert all(not rr.spans for rr in bare.ranks.values()) and any(rr.spans for rr in drawn.ranks.values())
    with pytest.raises(ValueError, match="spans=True"):
        timeline(bare)


def test_one_compute_slot_per_node_serialises_the_pipeline(tiny_traces):
    # four ranks sharing one core (slots = 1): some rank always has work, so the iteration is
    # the total work of all stages; with a slot each, the 1F1B closed form again
    p, m, F, B = 4, 8, 1000.0, 2000.0
    job = uniform(load_job(tiny_traces["4 4 1"]), F, B)
    shared = dataclasses.replace(FREE, gpus_per_node=4, compute_slots_per_node=1)
    assert simulate_job(job, shared).iteration_us == pytest.approx(p * m * (F + B), rel=1e-6)
    own = dataclasses.replace(FREE, gpus_per_node=4, compute_slots_per_node=4)
    assert simulate_job(job, own).iteration_us == pytest.approx((m + p - 1) * (F + B), rel=1e-6)


def test_pipeline_transfers_lengthen_the_iteration_within_bounds(tiny_traces):
    # a fixed cost c per p2p transfer: the first forward and the last backward each cross all
    # p - 1 stage boundaries; no more than one transfer per step and direction can be waited on
    p, m, F, B, c = 4, 8, 1000.0, 2000.0, 100.0
    job = uniform(load_job(tiny_traces["4 4 1"]), F, B)
    slow_links = dataclasses.replace(FREE, intra_node=Link(1e12, c))
    base = simulate_job(job, FREE).iteration_us
    slowed = simulate_job(job, slow_links).iteration_us
    assert slowed >= base + 2 * (p - 1) * c - 1e-6  # a forward and a backward must cross every boundary
    assert slowed <= base + 2 * (m + p - 1) * c * 2 + 1e-6  # at most one transfer per step and direction


def test_tp_and_dp_collectives_are_priced_by_the_hardware(tiny_traces):
    job = uniform(load_job(tiny_traces["16 2 2"]), 1000.0, 2000.0)
    free = simulate_job(job, FREE)
    hw = link_hw(bandwidth=1.0, latency=0.0, inter=(1.0, 0.0))  # 1 GB/s: every byte shows
    priced = report(simulate_job(job, hw))
    assert priced.iteration_s > free.iteration_us / 1e6
    # stage 0's DP all-reduce of its gradients: the traced bytes over a 4-rank ring
    rank0 = job.traces[0]
    dp = [op for op in rank0.ops if op.name.endswith("start_grad_sync")]
    assert dp and priced.exposed_comm_s["all_reduce"] >= sum(2 * 3 / 4 * op.bytes / 1e9 for op in dp)


def _overlapping_grad_reduce(job):
    """``job`` as overlap_grad_reduce traces it: the buckets launched in the last backward."""
    for trace in job.traces.values():
        last_backward = [op for op in trace.ops if op.kind == "backward"][-1]
        for op in trace.ops:
            if op.name.endswith("start_grad_sync"):
                op.parent, op.phase = last_backward.seq, "backward"
        trace.iteration["ddp"] = dict(trace.iteration["ddp"], overlap_grad_reduce=True)
    job.iteration = next(iter(job.traces.values())).iteration
    return job


def test_overlapped_gradient_reduction_hides_behind_the_backward(tiny_traces):
    job = uniform(load_job(tiny_traces["16 2 2"]), 1000.0, 20000.0)
    hw = link_hw(bandwidth=0.5, latency=0.0, inter=(0.5, 0.0))
    serial = simulate_job(job, hw).iteration_us
    overlapped = simulate_job(_overlapping_grad_reduce(job), hw)
    hidden = report(overlapped).overlapped_comm_s * 1e6
    assert hidden > 0 and overlapped.iteration_us <= serial - hidden + 1e-6


def test_the_distributed_optimizers_overlapped_reduce_scatters_are_exposed_as_reduce_scatters(tiny_traces):
    """What an overlapped reduction leaves exposed counts as the collective it is: with the
    distributed optimizer, a reduce-scatter; the all-reduces exposed are the TP group's alone."""
    hw = link_hw(bandwidth=0.5, latency=0.0, inter=(0.5, 0.0))
    serial = report(simulate_job(derive(uniform(load_job(tiny_traces["16 2 2"]), 1000.0, 2000.0),
                                        distributed_optimizer=True), hw))
    job = _overlapping_grad_reduce(uniform(load_job(tiny_traces["16 2 2"]), 1000.0, 2000.0))
    overlapped = report(simulate_job(derive(job, distributed_optimizer=True), hw))
    assert overlapped.exposed_comm_s["all_reduce"] == pytest.approx(serial.exposed_comm_s["all_reduce"])
    assert 0 < overlapped.exposed_comm_s["reduce_scatter"] < serial.exposed_comm_s["reduce_scatter"]


def test_the_timeline_has_a_process_per_stage_and_the_simulated_spans(tiny_traces):
    replay = simulate_job(load_job(tiny_traces["4 4 1"]), load_hardware("a100"))
    events = timeline(replay).to_json()["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"stage {s} (rank {s})" for s in range(4)}
    spans = [e for e in events if e["ph"] == "X"]
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(replay.makespan_us)
    assert {e["cat"] for e in spans} >= {"compute", "comm", "wait"}


def test_a_missing_stage_is_refused_with_the_fix(tiny_traces, tmp_path):
    folder = tmp_path / "partial"
    folder.mkdir()
    for rank in (0, 1, 3):
        RankTrace.read(tiny_traces["4 4 1"] / f"rank_{rank}.trace.jsonl").write(folder)
    with pytest.raises(TraceMismatch, match=r"stage\(s\) \[2\].*re-trace"):
        load_job(folder)


def test_a_trace_of_another_format_version_is_refused(tiny_traces, tmp_path):
    folder = tmp_path / "old"
    folder.mkdir()
    text = (tiny_traces["4 4 1"] / "rank_0.trace.jsonl").read_text().replace('"version": 1', '"version": 0', 1)
    (folder / "rank_0.trace.jsonl").write_text(text)
    with pytest.raises(TraceFormatError, match="version 0.*re-trace"):
        load_job(folder)


def test_simulate_cli_reports_every_config_folder(tiny_traces, tmp_path):
    parent = tiny_traces["4 4 1"].parent
    run = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "simulate", str(parent), "--hardware", "h100",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    reports = [json.loads(line) for line in run.stdout.splitlines()]
    assert sorted((r["pp"], r["tp"], r["dp"]) for r in reports) == [(2, 2, 4), (4, 1, 1)]
    for r in reports:
        assert r["iteration_s"] > 0 and r["fits"] and 0 < r["mfu"] < 1
        assert json.loads(open(r["timeline"]).read())["traceEvents"]
        tokens = r["global_batch_size"] * r["seq_length"]
        assert r["tokens_per_s"] == pytest.approx(tokens / r["iteration_s"])


def test_simulate_cli_refuses_a_bad_hardware_file_in_one_line(tiny_traces, tmp_path):
    bad = tmp_path / "hw.json"
    bad.write_text(json.dumps({"format": "megatron-dynapipe-hardware", "version": 1, "peak_tflops": {"bfloat16": 1}, "gpus_per_node": 8}))
    run = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "simulate", str(tiny_traces["4 4 1"]),
                          "--hardware", str(bad)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and "missing field 'memory_gib'" in run.stderr


def test_a_layout_that_does_not_fit_says_so(tiny_traces):
    small = dataclasses.replace(load_hardware("a100"), memory_gib=1e-4)
    result = report(simulate_job(load_job(tiny_traces["4 4 1"]), small))
    assert not result.fits and not all(s.fits for s in result.stages)
    assert math.isclose(result.device_memory_gib, 1e-4)


# -- calibrate ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,n", [("all_reduce", 8), ("all_gather", 4), ("all_to_all", 8), ("p2p", 2)])
def test_fit_recovers_the_latency_and_bandwidth_that_made_the_points(kind, n):
    from megatron_dynapipe.profiling.link import fit_link

    alpha_us, bandwidth = 30.0, 2.5  # GB/s
    steps, factor = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n), "p2p": (1, 1)}.get(kind, (n - 1, (n - 1) / n))
    points = [(size, (steps * alpha_us + factor * size / (bandwidth * 1e3)) / 1e6) for size in (1024, 65536, 2**22, 2**26)]
    link = fit_link(kind, points, n)
    assert link.latency_us == pytest.approx(alpha_us, rel=1e-6)
    assert link.bandwidth_GBps == pytest.approx(bandwidth, rel=1e-6)


def test_calibrate_writes_a_hardware_file_simulate_reads(tmp_path):
    out = tmp_path / "here.json"
    run = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "calibrate", "--nproc", "2", "--max-bytes",
                          "65536", "--repeats", "2", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    hw = load_hardware(out)
    assert hw.gpus_per_node == 2 and set(hw.collectives) == {"all_reduce", "all_gather", "reduce_scatter",
                                                              "all_to_all", "p2p"}
    assert hw.peak("float32") > 0 and hw.memory_gib > 0 and hw.memory_bandwidth_GBps > 0
    assert hw.collectives["all_reduce"].algorithm == "ring"
    assert "wrote" in run.stdout and "all_to_all" in run.stdout


@pytest.mark.parametrize("flags,says", [(["--nproc", "1"], "--nproc must be at least 2"),
                                        (["--backend", "nccl", "--nproc", "2"], "needs a GPU per process"),
                                        (["--min-bytes", "4096", "--max-bytes", "1024"], "--min-bytes <= --max-bytes"),
                                        (["--timeout", "0"], "--timeout 0: give the seconds to wait"),
                                        # flags of the fits, which measuring collectives would leave unread
                                        (["--hardware", "a100"], "--hardware names the file whose rates"),
                                        (["--attention-backend", "flash_attention"], "give --from-kernels FILE")])
def test_calibrate_refuses_settings_that_cannot_work_before_starting(tmp_path, flags, says):
    run = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "calibrate", *flags, "-o",
                          str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and says in run.stderr and run.stderr.count("\n") == 1
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_uneven_stages_take_the_bottleneck_closed_form(tmp_path):
    """Megatron-LM's --decoder-first/last-pipeline-num-layers: 8 layers on PP 4 as 1, 2, 2, 3.
    Each pass costs its stage's layers times F (or B), and the last stage is the bottleneck,
    so with free communication 1F1B never starves it after the first forward reaches it:
    T = (f_0 + f_1 + f_2) + m (f_3 + b_3) + (b_0 + b_1 + b_2).  Each layer's forward issues its
    two TP all-reduces (attention and MLP), the first stage's embedding one more."""
    from megatron_dynapipe.config.layout import ParallelLayout
    from megatron_dynapipe.config.megatron_options import MegatronOptions
    from megatron_dynapipe.tracer.fake_rank import trace_representatives

    m, F, B, layers = 8, 1000.0, 2000.0, [1, 2, 2, 3]
    model = dict(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=128, max_sequence_length=32)
    traces = trace_representatives(ParallelLayout(world_size=8, tp=2, pp=4), model, out_dir=tmp_path,
                                   micro_batch_size=1, num_microbatches=m, seq_length=32, shapes_only=True,
                                   training=MegatronOptions(first_stage_layers=1, last_stage_layers=3))
    for trace in traces:
        forwards = [op for op in trace.ops if op.kind == "forward" and op.parent is None]
        tp = [op for op in trace.ops if op.kind == "all_reduce" and op.phase == "forward"
              and op.group_name == "TENSOR_MODEL_PARALLEL_GROUP" and op.microbatch == 0]
        assert len(forwards) == m and len(tp) >= 2 * layers[trace.stage] + (trace.stage == 0)
        if trace.stage in (1, 2):
            assert len(tp) == 2 * layers[trace.stage]
    job = load_job(tmp_path)
    for trace in job.traces.values():
        trace.meta.pop("compute_hardware", None)
        for op in trace.ops:
            if op.cat == "compute":
                op.dur_us = {"forward": F, "backward": B}.get(op.kind, 0.0) * layers[trace.stage]
    expected = sum(layers[:3]) * (F + B) + m * layers[3] * (F + B)
    assert simulate_job(job, FREE).iteration_us == pytest.approx(expected, rel=1e-6)


# -- overlapped pipeline communication ----------------------------------------------------------


def _two_stage_ops(rank: int, waited: bool) -> list:
    """Stage 0 computes 1 ms, posts a send to stage 1, computes 3 ms and waits for the send;
    stage 1 posts the receive, computes 0.5 ms, waits for it, computes 0.7 ms.  Without
    ``waited`` the trace records no waits: each transfer blocks at its op."""
    from megatron_dynapipe.tracer.trace_format import TraceOp

    def op(kind, **fields):
        cat = "compute" if kind in ("forward", "backward") else "comm"
        return TraceOp(seq=0, iteration=0, stage=rank, cat=cat, kind=kind, **fields)

    send = dict(peer=1 - rank, bytes=1000, handle=0)
    ops = ([op("forward", dur_us=1000.0), op("isend", **send), op("forward", dur_us=3000.0), op("wait", handle=0)]
           if rank == 0 else
           [op("irecv", **send), op("backward", dur_us=500.0), op("wait", handle=0), op("backward", dur_us=700.0)])
    ops = [o for o in ops if waited or o.kind != "wait"]
    for seq, o in enumerate(ops):
        o.seq = seq
    return ops


@pytest.mark.parametrize("waited", [True, False])
def test_a_posted_transfer_blocks_only_at_its_wait(tiny_traces, waited):
    """A 2 ms transfer from stage 0 to 1, posted by stage 0 at 1 ms (stage 1 posted at 0): it
    arrives at 3 ms.  Waited on after their next compute, stage 0 ends at max(1 + 3, 3) = 4 ms and
    stage 1 at max(0.5, 3) + 0.7 = 3.7 ms, with the 2 ms hidden behind stage 0's compute.
    Blocking at the ops instead: stage 0 ends at 1 + 2 + 3 = 6 ms, stage 1 at 3 + 0.5 + 0.7."""
    job = load_job(tiny_traces["4 4 1"])
    for rank, trace in job.traces.items():
        trace.meta.pop("compute_hardware", None)
        trace.ops = _two_stage_ops(rank, waited) if rank < 2 else []
    replay = simulate_job(job, dataclasses.replace(FREE, intra_node=Link(1e12, 2000.0)))
    ends = [replay.ranks[rank].end_us for rank in (0, 1)]
    assert ends == (pytest.approx([4000.0, 3700.0]) if waited else pytest.approx([6000.0, 4200.0]))
    assert replay.ranks[0].overlapped_us == pytest.approx(2000.0 if waited else 0.0)
    # stage 1 waits for stage 0 to post (0.5 -> 1 ms) or from its start, then for the transfer
    assert replay.ranks[1].wait_us["pipeline"] == pytest.approx(500.0 if waited else 1000.0)
    assert replay.ranks[1].comm_us["p2p"] == pytest.approx(2000.0)


def test_transfers_between_two_ranks_match_within_their_process_group(tiny_traces):
    """Stage 0 posts an activation (pipeline group) at 0 and, after 5 ms of compute, a gradient
    (a second group over the same ranks) to stage 1, which posts the gradient's receive first and
    waits on it: torch.distributed matches each send with the receive in its own group, so the
    gradient leaves at 5 ms and arrives at 5 + 2 = 7 ms (matched by order alone, stage 1's first
    receive would take the activation posted at 0 and end at 2 ms)."""
    from megatron_dynapipe.tracer.trace_format import TraceOp

    def op(rank, kind, **fields):
        cat = "compute" if kind in ("forward", "backward") else "comm"
        return TraceOp(seq=0, iteration=0, stage=rank, cat=cat, kind=kind, **fields)

    activation = dict(bytes=1000, group_name="PIPELINE_MODEL_PARALLEL_GROUP")
    gradient = dict(bytes=1000, group_name=None)
    ops = {0: [op(0, "isend", peer=1, handle=0, **activation), op(0, "forward", dur_us=5000.0),
               op(0, "isend", peer=1, handle=1, **gradient), op(0, "wait", handle=0), op(0, "wait", handle=1)],
           1: [op(1, "irecv", peer=0, handle=0, **gradient), op(1, "irecv", peer=0, handle=1, **activation),
               op(1, "wait", handle=0), op(1, "backward", dur_us=100.0), op(1, "wait", handle=1)]}
    job = load_job(tiny_traces["4 4 1"])
    for rank, trace in job.traces.items():
        trace.meta.pop("compute_hardware", None)
        trace.ops = ops.get(rank, [])
        for seq, o in enumerate(trace.ops):
            o.seq = seq
    replay = simulate_job(job, dataclasses.replace(FREE, intra_node=Link(1e12, 2000.0)))
    assert replay.ranks[1].end_us == pytest.approx(7100.0)
    assert replay.ranks[0].end_us == pytest.approx(7000.0)


def test_megatrons_overlapped_interleaved_communication_hides_behind_compute(tmp_path):
    """Megatron's interleaved schedule posts each chunk's transfers and waits for them just
    before they are needed: with transfers shorter than a pass, the replay of its trace is
    faster than the same ops blocking at each transfer (the trace's waits dropped), and no faster
    than with free links."""
    from megatron_dynapipe.config.megatron_options import MegatronOptions
    from megatron_dynapipe.tracer.batch_config import parse_configs
    from megatron_dynapipe.tracer.batch_run import run_batch

    (traced,) = run_batch(parse_configs(["4 2 1 nmb=4"], model="tiny"), tmp_path, shapes_only=True,
                          progress=False, training=MegatronOptions(layers_per_virtual_stage=1))
    assert traced.status == "ok", traced.error
    job = uniform(load_job(traced.folder), 1000.0, 2000.0)
    assert all(any(op.kind == "wait" for op in trace.ops) for trace in job.traces.values())
    slow = dataclasses.replace(FREE, intra_node=Link(1e12, 400.0))
    overlapped = simulate_job(job, slow)
    for trace in job.traces.values():
        trace.ops = [op for op in trace.ops if op.kind != "wait"]
    blocking = simulate_job(job, slow)
    assert simulate_job(job, FREE).iteration_us <= overlapped.iteration_us < blocking.iteration_us
    assert report(overlapped).overlapped_comm_s > 0 == report(blocking).overlapped_comm_s


# -- the roofline fitted to a profile -----------------------------------------------------------


def _profile_of(hardware, model, **rates):
    """A profile document whose encoder-layer times are ``hardware``'s roofline with ``rates``
    (TP 1 and 2, forward and backward, shapes of 2048 to 32768 tokens)."""
    from megatron_dynapipe.planning.cost_model.analytical import gpt_shape
    from megatron_dynapipe.planning.cost_model.roofline import RooflineCostModel

    roofline = dataclasses.replace(hardware.roofline("bfloat16"), **rates)
    rows = []
    for tp in (1, 2):
        priced = RooflineCostModel(roofline, **gpt_shape(model, tp), device_memory_mb=math.inf)
        for mbs, seq in [(1, 2048), (4, 512), (16, 128), (2, 2048), (8, 1024), (16, 2048), (64, 512)]:
            for phase in ("forward", "backward"):
                rows.append({"tp": tp, "recompute": "none", "layer": "encoder", "phase": phase, "seqlen": seq,
                             "mbs": mbs, "ms": float(priced.layer_ms("encoder", phase, "none", mbs, seq))})
    fields = {f: getattr(model, f) for f in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                                             "max_sequence_length", "ffn_hidden_size")}
    return {"metadata": {"dtype": "bf16", "model": fields}, "layer_time": rows}


def test_the_roofline_fit_recovers_the_rates_and_overhead_that_made_a_profile():
    from megatron_dynapipe.hardware.fit import fit_roofline

    h100, model = load_hardware("h100"), get_model("6.7")
    fit = fit_roofline(h100, _profile_of(h100, model, gemm_efficiency=0.62, memory_efficiency=0.74,
                                         layer_overhead_us=300.0))
    assert (fit.gemm_efficiency, fit.memory_efficiency) == pytest.approx((0.62, 0.74), abs=1e-9)
    assert fit.layer_overhead_us == pytest.approx(300.0, abs=0.5)
    assert fit.points == 2 * 7 * 2 and fit.median_error < 1e-3
    assert fit.median_error_before > 0.05  # the file's own rates (0.70, 0.885, no overhead) miss it


def test_a_layers_overhead_is_paid_by_each_pass_and_again_by_full_recompute():
    hw = load_hardware("h100")
    plain = hw.cost_model(get_model("6.7"), 1, "bfloat16")
    compute = dict(hw.compute, layer_overhead_us=250.0)
    paying = dataclasses.replace(hw, compute=compute).cost_model(get_model("6.7"), 1, "bfloat16")
    extra = {(phase, rc): float(paying.layer_ms("encoder", phase, rc, 2, 1024) - plain.layer_ms("encoder", phase, rc,
                                                                                                 2, 1024))
             for phase in ("forward", "backward") for rc in ("none", "selective", "full")}
    assert extra == pytest.approx({("forward", "none"): 0.25, ("forward", "selective"): 0.25,
                                   ("forward", "full"): 0.25, ("backward", "none"): 0.25,
                                   ("backward", "selective"): 0.25, ("backward", "full"): 0.5})


def test_calibrate_from_a_profile_writes_the_fitted_rates_into_a_hardware_file(tmp_path):
    h100 = load_hardware("h100")
    profile = tmp_path / "made.json"
    profile.write_text(json.dumps(_profile_of(h100, get_model("6.7"), gemm_efficiency=0.5, memory_efficiency=0.6,
                                              layer_overhead_us=100.0)))
    out = tmp_path / "fitted.json"
    run = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "calibrate", "--from-profile", str(profile),
                          "--hardware", "h100", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    fitted = load_hardware(out)
    assert fitted.compute["gemm_efficiency"] == pytest.approx(0.5) and fitted.compute["memory_efficiency"] == 0.6
    assert fitted.compute["layer_overhead_us"] == pytest.approx(100.0, abs=0.5)
    assert fitted.compute["fused_attention"] == h100.compute["fused_attention"]  # what the fit leaves alone
    assert "fitted to made" in fitted.source and fitted.source.startswith(h100.source)
    assert fitted.peak_tflops == h100.peak_tflops and fitted.inter_node == h100.inter_node
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"layer_time": []}))
    run = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "calibrate", "--from-profile", str(bare),
                          "-o", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no model metadata" in run.stderr and run.stderr.count("\n") == 1
