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


def _with_training(job, **fields):
    return dataclasses.replace(job, iteration={**job.iteration, "training": {**job.iteration["training"], **fields}})


def _tp_collectives(job):
    """(pass kind, op) of the rank's TP collectives, in order (one rank at PP 1)."""
    [trace] = job.traces.values()
    passes = {op.seq: op.kind for op in trace.ops if op.parent is None}
    return [(passes[op.parent], op) for op in trace.ops
            if op.group_name == "TENSOR_MODEL_PARALLEL_GROUP" and op.parent in passes]


@pytest.mark.parametrize("gbps", [1.0, 1000.0])  # collectives longer than the tiny GEMMs beside them, and shorter
def test_tp_collectives_cost_a_pass_what_outlasts_the_gemm_beside_them(tmp_path, gbps):
    """TP 2 of the tiny GPT with sequence parallelism, two micro-batches on one stage, passes of the
    test's own durations. megatron-core's column-parallel backward (the head's, then FC1's and QKV's
    layer by layer) runs its input's re-gather beside the input-gradient GEMM and its gradient's
    reduce-scatter beside the weight-gradient GEMM; --tp-comm-overlap adds transformer-engine's ring
    exchange for the other gathers (into QKV and FC1 forward, out of FC2 and the projection
    backward) and its pipelined reduce-scatters (after the projection and FC2, four chunks)."""
    [result] = run_batch(parse_configs(["2 1 2 nmb=2"], model="tiny"), tmp_path, shapes_only=True, progress=False,
                         training=MegatronOptions(sequence_parallel=True, tp_comm_overlap=True))
    assert result.status == "ok", result.error
    overlapped = uniform(load_job(result.folder), 4000.0, 8000.0)
    hw = dataclasses.replace(A100, intra_node=Link(gbps, 0.0))
    roofline = hw.roofline("bfloat16")
    h, ffn, vocab, tp = 128, 512, 1024, 2
    column = {"qkv": 3 * h // tp, "fc1": ffn // tp, "head": vocab // tp}  # output widths on a rank
    row = {"proj": h // tp, "fc2": ffn // tp}  # input widths on a rank
    hidden_by_async, hidden_by_te = 0.0, 0.0
    sites = {"forward": {"layers.forward": ["qkv", "fc1"], "mappings._reduce_scatter_along_first_dim": ["proj", "fc2"]},
             "backward": {"layers.backward": ["fc1", "fc1", "qkv", "qkv"],
                          "mappings._gather_along_first_dim": ["fc2", "proj"]}}
    seen: dict = {}
    for kind, op in _tp_collectives(overlapped):
        tokens = op.bytes / (h * 2)
        comm = hw.collective_us(op.kind, op.bytes, op.group)
        order = sites[kind].get(op.name)
        if order is None:
            continue  # the embedding's, the loss's
        n = seen[kind, op.name, op.parent] = seen.get((kind, op.name, op.parent), -1) + 1
        if op.name == "layers.backward":
            n -= 2  # the head's gather and reduce-scatter come first
            if n < 0:
                gemm = roofline.gemm_ms(tokens, h, column["head"]) if op.kind == "all_gather" else \
                    roofline.gemm_ms(h, column["head"], tokens)
                hidden_by_async += comm - max(comm - 1e3 * gemm, 0.0)
                continue
        if n == 8 and op.name in ("layers.forward", "mappings._gather_along_first_dim"):
            continue  # after four layers: the head's forward gather, the embedding's backward one, waited for
        linear = order[n % len(order)]
        if op.name == "layers.backward":  # the re-gather beside dgrad, the reduce-scatter beside wgrad
            w = column[linear]
            gemm = roofline.gemm_ms(tokens, h, w) if op.kind == "all_gather" else roofline.gemm_ms(h, w, tokens)
            hidden_by_async += comm - max(comm - 1e3 * gemm, 0.0)
        elif op.name == "mappings._reduce_scatter_along_first_dim":  # pipelined after the forward GEMM
            gemm = 1e3 * roofline.gemm_ms(tokens, h, row[linear])
            hidden_by_te += comm - (comm / 4 + 0.75 * max(comm - gemm, 0.0))
        else:  # a ring exchange under the forward GEMM (column) or the gradient's GEMM (row)
            gemm = 1e3 * (roofline.gemm_ms(tokens, column[linear], h) if linear in column
                          else roofline.gemm_ms(tokens, row[linear], h))
            hidden_by_te += comm - max(comm - gemm * (tp - 1) / tp, 0.0)
    assert hidden_by_async > 0 and hidden_by_te > 0
    plain = _with_training(overlapped, tp_comm_overlap=False)
    waited = _with_training(plain, async_tp_backward=False)
    on, off, none = (simulate_job(job, hw).iteration_us for job in (overlapped, plain, waited))
    assert none - off == pytest.approx(hidden_by_async, rel=1e-9)
    assert off - on == pytest.approx(hidden_by_te, rel=1e-9)


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
