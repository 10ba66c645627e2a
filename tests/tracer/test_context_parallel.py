"""Context parallelism in shapes-only traces: transformer-engine's KV ring (p2p) as the tracer
records it, against the ring's closed form, and as the simulator overlaps it with the pass."""

import dataclasses

import pytest

from megatron_dynapipe.hardware import Hardware, Link
from megatron_dynapipe.simulate.replay import simulate_job
from megatron_dynapipe.simulate.traced_job import load_job
from megatron_dynapipe.tracer.batch_config import parse_configs
from megatron_dynapipe.tracer.batch_run import run_batch

from tiny_traces import uniform

SEQ, HIDDEN, HEADS, LAYERS = 256, 128, 8, 4  # the tiny GPT
FREE = Hardware(name="free", peak_tflops={"bfloat16": 100.0}, memory_gib=80.0, memory_bandwidth_GBps=1e12,
                gpus_per_node=8, intra_node=Link(1e12, 0.0), inter_node=Link(1e12, 0.0))


def trace(tmp_path, line):
    (result,) = run_batch(parse_configs([line], model="tiny"), tmp_path, shapes_only=True, progress=False)
    assert result.status == "ok", result.error
    return load_job(result.folder)


def ring_ops(trace_, phase):
    return [op for op in trace_.ops if op.group_name == "CONTEXT_PARALLEL_GROUP" and op.phase == phase]


@pytest.mark.parametrize("line,cp", [("16 2 1 cp=2 nmb=2", 2), ("16 2 1 cp=4 nmb=2", 4)])
def test_the_kv_ring_passes_key_and_value_forward_and_their_gradients_back(tmp_path, line, cp):
    job = trace(tmp_path, line)
    m, layers = 2, LAYERS // job.layout.pp
    # K and V of this rank's s / c tokens, every head, 16-bit
    kv = 2 * (SEQ // cp) * 1 * HEADS * (HIDDEN // HEADS) * 2
    for rank, t in job.traces.items():
        ring = [r for r in range(rank, rank + cp)]  # CP is the fastest-varying dimension after TP (1 here)
        me = ring.index(rank)
        forward, backward = ring_ops(t, "forward"), ring_ops(t, "backward")
        # forward: c - 1 steps a layer and micro-batch, each sending K and V on and receiving the previous rank's
        assert len(forward) == layers * m * (cp - 1)
        for op in forward:
            assert [(p["kind"], p["peer"], p["bytes"]) for p in op.parts] == [
                ("isend", ring[(me + 1) % cp], kv), ("irecv", ring[(me - 1) % cp], kv)]
        # backward: c steps, K and V, then K, V and their gradients, last the gradients alone
        sent = [next(p["bytes"] for p in op.parts if p["kind"] == "isend") for op in backward]
        assert sent == ([kv] + [2 * kv] * (cp - 2) + [kv]) * layers * m
        assert sum(sent) == layers * m * 2 * (cp - 1) * kv


def test_each_ring_step_runs_beside_one_block_of_attention_and_shows_what_outlasts_it(tmp_path):
    # PP 1, TP 1, CP 2: the ring is the only communication in a pass; F, B and the blocks are the test's own
    job = uniform(trace(tmp_path, "8 1 1 cp=2 nmb=2"), 1000.0, 2000.0)
    m, c, F, B = 2, 2, 1000.0, 2000.0
    passes = [op for op in job.traces[0].ops if op.kind in ("forward", "backward") and op.cat == "compute"]
    assert passes and all(op.ring_block_us > 0 for op in passes)  # the shapes-only trace priced them
    for op in passes:
        op.ring_block_us = {"forward": 400.0, "backward": 700.0}[op.kind]
    kv = 2 * (SEQ // c) * HEADS * (HIDDEN // HEADS) * 2
    fast, slow = 1e6, kv / 1e3 / 1000.0  # GB/s: a step in a nanosecond, or in 1000 us
    hidden = simulate_job(job, dataclasses.replace(FREE, collectives={"p2p": Link(fast, 0.0)}))
    assert hidden.iteration_us == pytest.approx(m * (F + B), rel=1e-4)
    exposed = simulate_job(job, dataclasses.replace(FREE, collectives={"p2p": Link(slow, 0.0)}))
    # a layer's ring: c - 1 steps forward, c backward, each of one K and V here (CP 2), each
    # transformer-engine's way: beside one block, the next waiting for both
    assert len(ring_ops(job.traces[0], "forward")) == m * LAYERS * (c - 1)
    pass_f, pass_b = F + LAYERS * (c - 1) * (1000.0 - 400.0), B + LAYERS * c * (1000.0 - 700.0)
    assert exposed.iteration_us == pytest.approx(m * (pass_f + pass_b), rel=1e-6)


def test_without_its_blocks_the_ring_runs_beside_the_whole_pass(tmp_path):
    # a trace that does not give the blocks (a timed one): the ring overlaps the pass's compute
    job = uniform(trace(tmp_path, "8 1 1 cp=2 nmb=2"), 1000.0, 2000.0)
    for op in job.traces[0].ops:
        op.ring_block_us = None
    m, c, F, B = 2, 2, 1000.0, 2000.0
    kv = 2 * (SEQ // c) * HEADS * (HIDDEN // HEADS) * 2
    exposed = simulate_job(job, dataclasses.replace(FREE, collectives={"p2p": Link(kv / 1e3 / 1000.0, 0.0)}))
    # the ring starts with its first step, after the first of the pass's n + 1 compute segments
    # (n: the communication ops nested in it, the ring's and the loss's all-reduces over TP; the
    # ring's waits are not communication of their own)
    nested = {kind: sum(op.parent is not None and op.cat == "comm" and op.microbatch == 0 and op.phase == kind
                        and op.kind != "wait" for op in job.traces[0].ops) for kind in ("forward", "backward")}
    ring_f, ring_b = LAYERS * (c - 1) * 1000.0, LAYERS * 2 * (c - 1) * 1000.0
    pass_f, pass_b = F / (nested["forward"] + 1) + ring_f, B / (nested["backward"] + 1) + ring_b
    assert exposed.iteration_us == pytest.approx(m * (pass_f + pass_b), rel=1e-6)


def test_a_rope_model_traces_with_context_parallelism_on_the_cpu(tmp_path):
    """megatron-core picks a CP rank's rotary positions with an index made in pinned memory, which
    needs CUDA; CPU mode makes it in plain memory, and the ring is traced as without rope."""
    from megatron_dynapipe.config.model import get_model

    rope = dataclasses.replace(get_model("tiny"), position_embedding_type="rope", name="")
    (result,) = run_batch(parse_configs(["8 1 1 cp=2 nmb=2"], model=rope), tmp_path, shapes_only=True, progress=False)
    assert result.status == "ok", result.error
    job = load_job(result.folder)
    assert job.model.position_embedding_type == "rope"
    assert len(ring_ops(job.traces[0], "forward")) == 2 * LAYERS * (2 - 1)


def test_a_shapes_only_trace_of_a_fused_attention_core_keeps_no_scores(tmp_path):
    """On meta tensors torch's SDPA would take its math kernel and keep the s x s probabilities;
    a fused kernel keeps q, k, v, its output and one log-sum-exp a row, and so does the trace:
    at 256 tokens and 8 heads of 16, 4 s h values in bf16 (the trace's dtype) and s a in fp32."""
    from megatron_dynapipe.config.model import get_model

    fused = dataclasses.replace(get_model("tiny"), attention="sdpa", name="")
    (result,) = run_batch(parse_configs(["2 2 1 nmb=2"], model=fused), tmp_path, shapes_only=True, progress=False)
    assert result.status == "ok", result.error
    probes = load_job(result.folder).traces[0].memory["activation_probe_bytes"]
    assert probes["core_attention"] == 4 * SEQ * HIDDEN * 2 + SEQ * HEADS * 4
    assert probes["core_attention"] < SEQ * SEQ * HEADS * 2  # far below the scores alone
