"""Shapes-only traces say which hardware priced their compute, and a simulation on other hardware
prices it for that hardware; compute faster than a device's peak is refused."""

import dataclasses
import subprocess
import sys

import pytest

from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.hardware import Link, load_hardware
from megatron_dynapipe.simulate.replay import simulate_job
from megatron_dynapipe.simulate.traced_job import load_job
from megatron_dynapipe.simulate.report import report
from megatron_dynapipe.simulate.variants import derive
from megatron_dynapipe.tracer.batch_config import parse_configs
from megatron_dynapipe.tracer.batch_run import run_batch

from tiny_traces import uniform

A100, H100 = load_hardware("a100"), load_hardware("h100")


def compute_per_stage(replay) -> dict[int, float]:
    return {r.stage: r.compute_us for r in replay.ranks.values()}


def test_a_trace_says_which_hardware_priced_its_compute(tiny_traces):
    job = load_job(tiny_traces["4 4 1"])
    assert {t.meta["compute_hardware"] for t in job.traces.values()} == {"A100-80GB-SXM"}
    assert "for A100-80GB-SXM" in report(simulate_job(job, A100)).compute_from


def test_simulating_on_another_hardware_prices_compute_as_tracing_for_it_would(tiny_traces, tmp_path):
    [traced_for_h100] = run_batch(parse_configs(["4 4 1 nmb=8"], model="tiny"), tmp_path, shapes_only=True,
                                  progress=False,
                                  cost_model=lambda config: H100.cost_model(config.model, config.tp, "bfloat16"))
    assert traced_for_h100.status == "ok", traced_for_h100.error
    a100_job = load_job(tiny_traces["4 4 1"])
    on_h100 = compute_per_stage(simulate_job(a100_job, H100))
    assert on_h100 == pytest.approx(compute_per_stage(simulate_job(load_job(traced_for_h100.folder), H100)))
    on_a100 = compute_per_stage(simulate_job(a100_job, A100))
    assert all(on_h100[stage] < on_a100[stage] for stage in on_a100)


def test_a_derived_full_recompute_is_priced_as_the_forward_again(tiny_traces):
    job = load_job(tiny_traces["4 4 1"])
    m = int(job.iteration["num_microbatches"])
    middle = next(t for t in job.traces.values() if t.stage == 1)  # transformer layers only
    (F,) = {op.dur_us for op in middle.compute_ops if op.kind == "forward"}
    replay = simulate_job(derive(job, recompute="full"), A100)
    steps = [s for s in replay.ranks[middle.rank].spans if s.row == "compute" and s.label == "recompute"]
    assert len(steps) == m and all(s.dur_us == pytest.approx(F) for s in steps)


def test_compute_faster_than_the_devices_peak_is_refused_in_one_line(tiny_traces):
    job = uniform(load_job(tiny_traces["4 4 1"]), 1e-6, 1e-6)  # measured on some impossibly fast device
    free_links = dataclasses.replace(A100, intra_node=Link(1e12, 0.0), inter_node=Link(1e12, 0.0),
                                     memory_bandwidth_GBps=1e12)
    with pytest.raises(ValueError, match="runs faster than A100-80GB-SXM's peak") as error:
        report(simulate_job(job, free_links))
    assert "\n" not in str(error.value) and "--hardware A100-80GB-SXM" in str(error.value)


def test_trace_refuses_an_unknown_hardware_before_tracing(tmp_path):
    run = subprocess.run([sys.executable, "-m", "megatron_dynapipe.cli", "trace", "--config", "4 4 1",
                          "--model", "tiny", "--hardware", "b200", "--output-dir", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "neither a shipped model" in run.stderr
    assert not (tmp_path / "out").exists()


def test_tp_comm_overlap_hides_sequence_parallel_collectives_behind_their_pass(tmp_path):
    training = MegatronOptions(sequence_parallel=True, tp_comm_overlap=True)
    [result] = run_batch(parse_configs(["2 1 2 nmb=2"], model="tiny"), tmp_path, shapes_only=True, progress=False,
                         training=training)
    assert result.status == "ok", result.error
    overlapped = uniform(load_job(result.folder), 4000.0, 8000.0)
    blocking = dataclasses.replace(overlapped, iteration={**overlapped.iteration, "training": {
        **overlapped.iteration["training"], "tp_comm_overlap": False}})
    hw = dataclasses.replace(A100, intra_node=Link(1.0, 0.0))  # 1 GB/s: a few us per collective
    trace = next(iter(overlapped.traces.values()))
    tp = [op for op in trace.ops if op.group_name == "TENSOR_MODEL_PARALLEL_GROUP"
          and op.kind in ("all_gather", "reduce_scatter")]
    assert tp and all(op.parent is not None for op in tp)  # nested in forward and backward passes
    hidden_us = sum(hw.collective_us(op.kind, op.bytes, op.group) for op in tp)
    slowest_us = max(hw.collective_us(op.kind, op.bytes, op.group) for op in tp)
    passes = [op for op in trace.ops if op.parent is None and op.kind in ("forward", "backward")]
    most_nested = max(sum(c.parent == p.seq for c in tp) for p in passes)
    assert slowest_us < 4000.0 / (most_nested + 1)  # each fits in the compute beside it: all hidden
    on, off = simulate_job(overlapped, hw), simulate_job(blocking, hw)
    assert off.iteration_us - on.iteration_us == pytest.approx(hidden_us, rel=1e-6)
    assert sum(r.comm_us["tp_overlap"] for r in on.ranks.values()) == 0


def test_overlap_param_gather_runs_all_but_the_first_buckets_gather_beside_the_forward(tmp_path):
    """The distributed optimizer's bucket all-gathers inside the first micro-batch's forward: the
    first is waited for, every later one runs beside the rest of the pass, which ends when both
    are done. PP 2, DP 2 of the tiny GPT (two buckets a stage), 1F1B over two micro-batches, whose
    critical path holds each stage's first forward; the passes' durations the test's own."""
    training = MegatronOptions(distributed_optimizer=True, overlap_param_gather=True)
    [result] = run_batch(parse_configs(["4 2 1 nmb=2"], model="tiny"), tmp_path, shapes_only=True, progress=False,
                         training=training)
    assert result.status == "ok", result.error
    F, B = 4000.0, 8000.0
    overlapped = uniform(load_job(result.folder), F, B)
    blocking = dataclasses.replace(overlapped, iteration={**overlapped.iteration, "ddp": {
        **overlapped.iteration["ddp"], "overlap_param_gather": False}})
    for gbps in (1000.0, 0.05):  # gathers far shorter than the compute beside them, and far longer
        hw = dataclasses.replace(A100, intra_node=Link(gbps, 0.0))
        saved = 0.0
        for trace in overlapped.traces.values():
            gathers = [op for op in trace.ops if op.kind == "all_gather" and op.name.endswith("start_param_sync")]
            (forward,) = {op.parent for op in gathers}
            nested = [op for op in trace.ops if op.parent == forward and op.cat == "comm"]
            assert len(gathers) >= 2 and nested[:len(gathers)] == gathers  # the gathers come first
            cost = [hw.collective_us(op.kind, op.bytes, op.group) for op in nested]
            segment = F / (len(nested) + 1)  # the pass is cut evenly around its nested communication
            # overlapped: the first gather after its segment; the other gathers launched one per
            # segment, each after the one before on their own stream; the rest blocking as before;
            # the pass ending with both
            stream_end, clock = 0.0, segment + cost[0]
            for op, c in zip(nested[1:], cost[1:]):
                clock += segment
                if op in gathers:
                    stream_end = max(stream_end, clock) + c
                else:
                    clock += c
            saved += F + sum(cost) - max(clock + segment, stream_end)  # against every gather blocking
        on, off = simulate_job(overlapped, hw), simulate_job(blocking, hw)
        assert off.iteration_us - on.iteration_us == pytest.approx(saved, rel=1e-6)
        assert saved > 0
