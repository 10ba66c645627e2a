"""Fake ranks trace what real ranks do.

A real 8-process gloo job (tiny GPT, TP=2 x PP=2 x DP=2, megatron-core 1F1B, DDP, Adam) runs with
the recorder on every rank; then every one of its 8 ranks is traced as a *fake* rank, all in this
one process.  Each fake trace must match its real counterpart op for op: kind, order, micro-batch,
phase, process group (global ranks), peer, bytes and dtype (times excluded), and the memory
figures.  The shapes-only mode (meta tensors, cost-model durations) must match too.  The same
for a Llama-style GPT, alone and trained with every training option at once (distributed
optimizer, overlapped bucketed reduction and parameter gather, sequence parallelism, full
recompute), and for interleaved 1F1B (two model chunks per pipeline rank).

The same for mixture-of-experts (TP=1 x PP=2 x EP=2 x DP=4, all-to-all token dispatcher):

* drop-and-pad routing (capacity factor 1, padded) gives every all-to-all a fixed size: fake and
  real agree on every byte, shapes-only included;
* dropless routing sizes the expert all-to-alls by how many tokens each rank routes to each
  expert; traced ranks route by token position (balanced, the same counts on every rank), so a
  fake rank knows what its peers send: fake and real agree on every byte, and every all-to-all's
  send and receive sides pair up.

The traces also satisfy the replay contract of docs/trace_format.md: the k-th collective on a
group has the same kind and size on every member, and the k-th send from a to b has the size of
the k-th receive on b from a.
"""

from __future__ import annotations

import collections
import dataclasses
import resource
import time

import pytest

from megatron_dynapipe.config.layout import ParallelLayout
from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.config.model_flags import megatron_model_args, model_from_megatron_args
from megatron_dynapipe.local_ranks import run_local_ranks
from megatron_dynapipe.tracer.trace_format import RankTrace

pytestmark = pytest.mark.slow

WORLD = 8
RUN = dict(micro_batch_size=2, num_microbatches=4, seq_length=16, warmup_iters=1, trace_iters=1,
           dtype="float32")
TINY = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128, max_sequence_length=64)
TINY_MOE = dict(TINY, num_layers=2, num_experts=4, moe_router_topk=2)
#: Llama-style: SwiGLU, RMSNorm, grouped-query attention, rotary positions, untied output layer,
#: no linear biases (the features of Megatron-LM's GPT that the CPU local spec runs)
TINY_LLAMA = dict(TINY, swiglu=True, normalization="RMSNorm", num_query_groups=2, position_embedding_type="rope",
                  share_embeddings_and_output_weights=False, add_bias_linear=False)
CASES = {
    "dense": (dict(world_size=WORLD, tp=2, pp=2), TINY),
    "llama": (dict(world_size=WORLD, tp=2, pp=2), TINY_LLAMA),
    "moe-padded": (dict(world_size=WORLD, tp=1, pp=2, ep=2),
                   dict(TINY_MOE, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)),
    "moe-dropless": (dict(world_size=WORLD, tp=1, pp=2, ep=2), TINY_MOE),
    "trained": (dict(world_size=WORLD, tp=2, pp=2), TINY_LLAMA),
    "interleaved": (dict(world_size=WORLD, tp=2, pp=2), TINY),
}
#: every training option at once: distributed optimizer with overlapped, bucketed reduction and
#: parameter gather, sequence parallelism, full recompute
TRAINING = {
    "trained": MegatronOptions(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
                               bucket_size=4000, sequence_parallel=True, recompute_granularity="full",
                               recompute_method="uniform", recompute_num_layers=1),
    # interleaved 1F1B, two one-layer chunks per stage, with overlapped gradient reduction and
    # parameter gathers (Megatron-LM then hands the schedule each chunk's sync functions)
    "interleaved": MegatronOptions(layers_per_virtual_stage=1, distributed_optimizer=True, overlap_grad_reduce=True,
                                   overlap_param_gather=True),
}
SHAPES_ONLY_CASES = ("dense", "moe-padded", "llama", "trained", "interleaved")
TIMEOUT = 400  # 8 ranks import megatron-core (~10 s each) on 2 shared cores, then 3 jobs


def _real_job(rank, world_size):
    """Every case on this gloo rank, with the recorder; traces as text (they pickle cheaply)."""
    from megatron_dynapipe.tracer.fake_rank import trace_initialized_rank

    out = {}
    for name, (layout, model) in CASES.items():
        trace = trace_initialized_rank(ParallelLayout(**layout), model, training=TRAINING.get(name), **RUN)
        out[name] = trace.dumps()
    return out


@pytest.fixture(scope="module")
def real():
    start = time.perf_counter()
    results = run_local_ranks(_real_job, WORLD, timeout=TIMEOUT)
    print(f"real {WORLD}-rank gloo job, {len(CASES)} cases: {time.perf_counter() - start:.1f} s")
    return {
        name: {rank: RankTrace.loads(result[name]) for rank, result in enumerate(results)}
        for name in CASES
    }


@pytest.fixture(scope="module")
def fake():
    """Every rank of every case, fake, in this process; and shapes-only where it applies."""
    import torch

    from megatron_dynapipe.tracer.fake_rank import trace_ranks

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on shared cores: threads only contend
    out, seconds = {}, {}
    try:
        _trace_all_cases(trace_ranks, out, seconds)
    finally:
        torch.set_num_threads(threads)
    print("fake-rank seconds per rank:", {k: round(v, 2) for k, v in seconds.items()},
          "shapes-only:", {k: round(t.meta["trace_seconds"], 2) for k, t in out["dense/shapes"].items()})
    return out


def _trace_all_cases(trace_ranks, out, seconds):
    for name, (layout, model) in CASES.items():
        start = time.perf_counter()
        training = TRAINING.get(name)
        out[name] = {t.rank: t for t in trace_ranks(ParallelLayout(**layout), range(WORLD), model, training=training,
                                                    **RUN)}
        seconds[name] = (time.perf_counter() - start) / WORLD
        if name in SHAPES_ONLY_CASES:
            shapes = trace_ranks(ParallelLayout(**layout), range(WORLD), model, shapes_only=True, training=training,
                                 **RUN)
            out[name + "/shapes"] = {t.rank: t for t in shapes}


def _diff(fake_trace: RankTrace, real_trace: RankTrace) -> str:
    """The first op where the two traces part, for the assertion message."""
    a, b = fake_trace.ops, real_trace.ops
    for i, (x, y) in enumerate(zip(a, b)):
        if x.signature() != y.signature() or x.name != y.name:
            return f"op {i}: fake {x.to_json()}\n      real {y.to_json()}"
    return f"lengths differ: fake {len(a)} ops, real {len(b)} ops"


def _assert_same_ops(fake_trace: RankTrace, real_trace: RankTrace) -> None:
    assert fake_trace.signatures() == real_trace.signatures(), _diff(fake_trace, real_trace)
    assert [op.name for op in fake_trace.ops] == [op.name for op in real_trace.ops]
    assert [op.parent for op in fake_trace.ops] == [op.parent for op in real_trace.ops]


# --------------------------------------------------------------------------------------------
# dense: TP=2 x PP=2 x DP=2


def test_dense_fake_ranks_match_the_real_job(real, fake):
    for rank in range(WORLD):
        r, f = real["dense"][rank], fake["dense"][rank]
        _assert_same_ops(f, r)
        assert (f.rank, f.stage, f.coords, f.groups) == (r.rank, r.stage, r.coords, r.groups)
        assert f.meta["backend"] == "fake" and r.meta["backend"] == "gloo"
        for key in ("model_state_bytes", "activation_peak_bytes", "peak_in_flight_microbatches", "peak_bytes"):
            assert f.memory[key] == r.memory[key], key


def test_dense_shapes_only_matches_the_real_job(real, fake):
    for rank in range(WORLD):
        r, s = real["dense"][rank], fake["dense/shapes"][rank]
        assert s.mode == "shapes_only" and s.clock == "cost_model"
        _assert_same_ops(s, r)
        for key in ("model_state_bytes", "activation_peak_bytes", "peak_bytes"):
            assert s.memory[key] == r.memory[key], key


def test_dense_trace_covers_every_kind_of_traffic(real):
    """What the job does, seen in the real traces: per stage and micro-batch, forward and
    backward; TP all-reduces inside them; p2p activations/gradients; one DP bucket; the tied
    embedding's all-reduce; the grad-norm all-reduce; the loss report on the last stage."""
    layout = ParallelLayout(**CASES["dense"][0])
    for rank, trace in real["dense"].items():
        last = trace.stage == layout.pp - 1
        compute = collections.Counter(op.kind for op in trace.compute_ops)
        assert compute == {"forward": 4, "backward": 4, "optimizer_step": 1, **({"loss": 4} if last else {})}
        assert [op.microbatch for op in trace.ops if op.kind == "forward"] == [0, 1, 2, 3]
        assert sorted(op.microbatch for op in trace.ops if op.kind == "backward") == [0, 1, 2, 3]
        by_group = collections.defaultdict(list)
        for op in trace.comm_ops:
            by_group[op.group_name].append(op)
        tp = by_group["TENSOR_MODEL_PARALLEL_GROUP"]
        assert tp and all(op.group == tuple(trace.groups["tp"]) and op.parent is not None for op in tp)
        assert {op.phase for op in tp} == {"forward", "backward"}
        p2p = by_group["PIPELINE_MODEL_PARALLEL_GROUP"]
        peer = trace.groups["pp"][1 - trace.stage]
        parts = [p for op in p2p for p in op.parts]
        assert {p["peer"] for p in parts} == {peer}
        assert all(p["bytes"] == 16 * 2 * 64 * 4 for p in parts)  # [seq, mbs, hidden] fp32
        assert sum(p["kind"] == "isend" for p in parts) == 4 and sum(p["kind"] == "irecv" for p in parts) == 4
        (dp,) = by_group["DATA_PARALLEL_GROUP_WITH_CP"][:1]
        assert dp.phase == "finalize_grads" and dp.group == tuple(trace.groups["dp-cp"])
        assert dp.bytes == trace.memory["model_state_detail"]["grad_buffers"]
        (embedding,) = by_group["EMBEDDING_GROUP"]
        assert embedding.group == tuple(trace.groups["embedding"]) and embedding.phase == "finalize_grads"
        assert embedding.bytes == 128 * 64 * 4  # this TP rank's half of the padded 256-word table
        (norm,) = [op for op in trace.comm_ops if op.phase == "optimizer_step"]
        assert norm.group_name == "MODEL_PARALLEL_GROUP" and norm.bytes == 4
        reports = [op for op in trace.comm_ops if op.phase == "loss_report"]
        assert len(reports) == (1 if last else 0)


def llama_stage_params(stage: int, tp: int = 2) -> int:
    """One TP rank's parameters of a TINY_LLAMA stage (two layers), counted from the shapes:
    hidden 64, 4 heads of 16 in 2 key/value groups, SwiGLU over ffn 256, RMSNorm (weight only),
    no biases, vocabulary 128 padded to a multiple of 128 x TP, untied output layer, rotary
    positions (no position table)."""
    h, heads, groups, d, f, vocab = 64, 4, 2, 16, 256, 128 * tp
    qkv = h * (heads * d + 2 * groups * d) // tp
    proj = heads * d * h // tp
    fc1, fc2 = h * 2 * f // tp, f * h // tp
    norms = 2 * h
    layers = 2 * (qkv + proj + fc1 + fc2 + norms)
    return layers + (vocab * h // tp if stage == 0 else h + vocab * h // tp)  # embedding | final norm + head


def test_llama_features_trace_as_the_real_job_runs_them(real, fake):
    for rank in range(WORLD):
        r = real["llama"][rank]
        _assert_same_ops(fake["llama"][rank], r)
        _assert_same_ops(fake["llama/shapes"][rank], r)
        assert r.model["swiglu"] and r.model["normalization"] == "RMSNorm" and r.model["num_query_groups"] == 2


def test_llama_gradient_and_pipeline_bytes_match_the_shapes(real):
    for rank, trace in real["llama"].items():
        (dp,) = [op for op in trace.comm_ops if op.name.endswith("start_grad_sync")]
        assert dp.bytes == 4 * llama_stage_params(trace.stage), rank  # fp32 gradients, one bucket
        assert not [op for op in trace.comm_ops if op.group_name == "EMBEDDING_GROUP"]  # untied: nothing to sync
        parts = [p for op in trace.comm_ops if op.parts for p in op.parts]
        assert {p["bytes"] for p in parts} == {16 * 2 * 64 * 4}  # [seq, mbs, hidden] fp32


def test_training_options_trace_as_the_real_job_runs_them(real, fake):
    """Distributed optimizer, overlap, sequence parallelism and full recompute together: fake
    and shapes-only ranks issue the real job's ops, and its memory figures."""
    for rank in range(WORLD):
        r = real["trained"][rank]
        for f in (fake["trained"][rank], fake["trained/shapes"][rank]):
            _assert_same_ops(f, r)
            for key in ("model_state_bytes", "activation_peak_bytes", "peak_bytes"):
                assert f.memory[key] == r.memory[key], key
        kinds = {(op.kind, op.group_name, op.phase) for op in r.comm_ops}
        # Megatron-LM's --align-grad-reduce: the first stage reduces during its last backward,
        # later stages once their backward passes are done (in the pipeline's drain bubble)
        grad_sync = "backward" if r.stage == 0 else None
        assert {("reduce_scatter", "DATA_PARALLEL_GROUP_WITH_CP", grad_sync),
                ("all_gather", "DATA_PARALLEL_GROUP_WITH_CP", "forward"),
                ("all_gather", "TENSOR_MODEL_PARALLEL_GROUP", "forward"),
                ("reduce_scatter", "TENSOR_MODEL_PARALLEL_GROUP", "backward")} <= kinds
        assert r.iteration["training"] == dataclasses.asdict(TRAINING["trained"])


# --------------------------------------------------------------------------------------------
# interleaved 1F1B: TP=2 x PP=2 x DP=2, two chunks of one layer per pipeline rank


def test_interleaved_fake_ranks_match_the_real_job(real, fake):
    for rank in range(WORLD):
        r = real["interleaved"][rank]
        assert r.iteration["schedule"] == "forward_backward_pipelining_with_interleaving"
        for f in (fake["interleaved"][rank], fake["interleaved/shapes"][rank]):
            _assert_same_ops(f, r)
            for key in ("model_state_bytes", "activation_peak_bytes", "peak_bytes"):
                assert f.memory[key] == r.memory[key], key


def test_interleaved_pipeline_traffic_follows_the_chunks(real):
    """Every micro-batch runs forward and backward once per chunk (the loss only in the last
    stage's last chunk); it crosses the pipeline V = 2 times, so a stage s of P = 2 sends each
    micro-batch's activations V - [s = P-1] times and its gradients V - [s = 0] times, and receives
    them as often as its neighbours send.  Each transfer is one [seq, mbs, hidden] fp32 tensor."""
    v, pp, m = 2, 2, RUN["num_microbatches"]
    transfer = RUN["seq_length"] * RUN["micro_batch_size"] * TINY["hidden_size"] * 4
    for rank, trace in real["interleaved"].items():
        s = trace.stage
        passes = collections.Counter((op.kind, op.chunk) for op in trace.ops if op.cat == "compute")
        expected = {("forward", c): m for c in range(v)} | {("backward", c): m for c in range(v)}
        if s == pp - 1:
            expected[("loss", v - 1)] = m
        assert {k: n for k, n in passes.items() if k[0] != "optimizer_step"} == expected
        p2p = [op for op in trace.comm_ops if op.kind in ("isend", "irecv")]
        sends = m * ((v - (s == pp - 1)) + (v - (s == 0)))
        assert collections.Counter(op.kind for op in p2p) == {"isend": sends, "irecv": sends}
        assert {op.bytes for op in p2p} == {transfer}
        assert trace.iteration["training"]["layers_per_virtual_stage"] == 1


# --------------------------------------------------------------------------------------------
# MoE: TP=1 x PP=2 x EP=2 x DP=4


def test_moe_drop_and_pad_fake_ranks_match_the_real_job(real, fake):
    for rank in range(WORLD):
        r = real["moe-padded"][rank]
        for f in (fake["moe-padded"][rank], fake["moe-padded/shapes"][rank]):
            _assert_same_ops(f, r)
            assert f.groups == r.groups and f.expert_coords == r.expert_coords
            assert f.memory["model_state_bytes"] == r.memory["model_state_bytes"]
            # which tokens a full expert drops is data; so are the sizes of a few index tensors
            # the router saves for backward (a few hundred bytes here)
            assert f.memory["activation_peak_bytes"] == pytest.approx(r.memory["activation_peak_bytes"], rel=0.05)
        a2a = [op for op in r.ops if op.kind == "all_to_all"]
        assert a2a and all(op.group == tuple(r.groups["ep"]) and op.splits is None for op in a2a)


def test_moe_dropless_fake_ranks_match_the_real_job(real, fake):
    for rank in range(WORLD):
        r, f = real["moe-dropless"][rank], fake["moe-dropless"][rank]
        _assert_same_ops(f, r)
        assert f.memory["model_state_bytes"] == r.memory["model_state_bytes"]


def test_moe_dropless_all_to_alls_pair_up_between_senders_and_receivers(real, fake):
    """Each token picks its top-2 of 4 experts by position, so each EP rank (2 experts) receives
    tokens x 2 / 2 rows from every peer: 2 x 16 x 2 / 2 = 32; and what rank a sends to b in its
    k-th all-to-all is what b receives from a in its k-th, on the fake ranks as on the real job."""
    for traces in (real["moe-dropless"], fake["moe-dropless"]):
        routed = {rank: [op for op in t.ops if op.kind == "all_to_all" and op.splits] for rank, t in traces.items()}
        assert routed[0] and len({len(ops) for ops in routed.values()}) == 1
        pairs = 0
        for a, ops in routed.items():
            for k, op in enumerate(ops):
                assert op.splits["in"] == op.splits["out"] == [32, 32]
                for i, b in enumerate(op.group):
                    peer = routed[b][k]
                    assert op.splits["in"][i] == peer.splits["out"][peer.group.index(a)]
                    pairs += 1
        assert pairs == 8 * len(routed[0]) * 2


def test_shapes_only_refuses_dropless_moe():
    from megatron_dynapipe.tracer.fake_rank import trace_fake_rank

    with pytest.raises(ValueError, match="drop-and-pad"):
        trace_fake_rank(ParallelLayout(**CASES["moe-dropless"][0]), 0, TINY_MOE, shapes_only=True, **RUN)


# --------------------------------------------------------------------------------------------
# the replay contract


def _collectives_by_group(traces):
    seen = collections.defaultdict(dict)
    for rank, trace in traces.items():
        per_group = collections.defaultdict(list)
        for op in trace.comm_ops:
            if op.kind not in ("batch_isend_irecv", "wait") and op.peer is None:
                per_group[op.group].append((op.kind, op.bytes, op.dtype))
        for group, ops in per_group.items():
            seen[group][rank] = ops
    return seen


def _p2p_streams(traces):
    sends, recvs = collections.defaultdict(list), collections.defaultdict(list)
    for rank, trace in traces.items():
        for op in trace.comm_ops:
            parts = op.parts if op.parts is not None else [
                {"kind": op.kind, "peer": op.peer, "bytes": op.bytes}] if op.kind in ("isend", "irecv", "send", "recv") else []
            for p in parts:
                if p["kind"] in ("isend", "send"):
                    sends[(rank, p["peer"])].append(p["bytes"])
                else:
                    recvs[(p["peer"], rank)].append(p["bytes"])
    return sends, recvs


@pytest.mark.parametrize("case", ["dense", "moe-padded", "interleaved"])
@pytest.mark.parametrize("source", ["real", "fake"])
def test_traces_satisfy_the_replay_contract(real, fake, source, case):
    traces = (real if source == "real" else fake)[case]
    groups = _collectives_by_group(traces)
    assert groups
    for group, per_rank in groups.items():
        assert set(per_rank) == set(group), f"group {group} seen on {sorted(per_rank)}"
        sequences = list(per_rank.values())
        assert all(s == sequences[0] for s in sequences), f"group {group} members disagree"
    sends, recvs = _p2p_streams(traces)
    assert sends and sends == recvs
    _check_waits(traces)


def _check_waits(traces):
    """Rule 4: a wait names the request of one point-to-point op issued before it, once."""
    waits = 0
    for trace in traces.values():
        posted = {}
        for op in trace.ops:
            if op.kind in ("isend", "irecv", "batch_isend_irecv"):
                assert op.handle is not None and op.handle not in posted
                posted[op.handle] = op
            elif op.kind == "wait":
                assert posted.pop(op.handle, None) is not None, f"rank {trace.rank}: wait {op.seq} names no request"
                waits += 1
            else:
                assert op.handle is None
    assert waits  # every case pipelines: its ranks wait on transfers


# --------------------------------------------------------------------------------------------
# GPT-6.7B in shapes-only mode


def test_gpt_6_7b_traces_in_shapes_only_mode(tmp_path):
    """Last stage of GPT-6.7B at W=1024, TP=8, PP=4 (DP=32): bf16 on the meta device, durations
    from the A100 profile; a couple of seconds and no real weights."""
    from megatron_dynapipe.planning.cost_model import ProfiledCostModel, StageCosts
    from megatron_dynapipe.tracer.fake_rank import trace_fake_rank
    from megatron_dynapipe.tracer.representatives import representative_ranks

    from project import GPT_6_7B_A100

    layout = ParallelLayout(1024, tp=8, pp=4)
    rank = representative_ranks(layout)[-1].global_rank
    model = ProfiledCostModel.from_json(GPT_6_7B_A100, tp=8)
    start = time.perf_counter()
    trace = trace_fake_rank(layout, rank, "6.7B", micro_batch_size=1, num_microbatches=8,
                            seq_length=2048, warmup_iters=1, trace_iters=1, shapes_only=True,
                            cost_model=model)
    seconds = time.perf_counter() - start
    print(f"GPT-6.7B shapes-only, rank {rank}: {seconds:.1f} s, {len(trace.ops)} ops")  # timed in bench_tracer
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 4 * 2**20  # KiB: < 4 GiB
    assert (trace.rank, trace.stage, trace.mode, trace.model["dtype"]) == (768, 3, "shapes_only", "bfloat16")
    costs = StageCosts(model, num_layers=32, pp=4, dp=32)
    forwards = [op for op in trace.ops if op.kind == "forward"]
    assert len(forwards) == 8
    assert forwards[0].dur_us == pytest.approx(costs.forward_ms(3, 1, 2048, "none") * 1e3)
    tp_bytes = {op.bytes for op in trace.comm_ops if op.group_name == "TENSOR_MODEL_PARALLEL_GROUP"
                and op.kind == "all_reduce" and op.parent is not None and op.shape[-1] == 4096}
    assert tp_bytes == {2048 * 1 * 4096 * 2}  # [seq, mbs, hidden] bf16
    parts = [p for op in trace.comm_ops if op.parts for p in op.parts]
    assert {p["bytes"] for p in parts} == {2048 * 4096 * 2} and {p["peer"] for p in parts} == {512}
    (grads,) = [op for op in trace.comm_ops if op.name.endswith("start_grad_sync")]
    assert grads.group == tuple(trace.groups["dp-cp"]) and len(grads.group) == 32
    assert grads.dtype == "float32" and grads.bytes == trace.memory["model_state_detail"]["grad_buffers"]
    # 8 layers of 6.7B / TP=8 plus this TP rank's share of the 51200-word output layer, in bf16
    params = trace.memory["model_state_detail"]["params"] / 2
    assert 8 * 201e6 / 8 < params < 8 * 202e6 / 8 + 51200 * 4096 / 8 + 1e6
    path = trace.write(tmp_path)
    assert RankTrace.read(path).signatures() == trace.signatures()


# --------------------------------------------------------------------------------------------
# representatives and model descriptions


def test_representatives_are_written_one_file_per_stage(fake, tmp_path):
    from megatron_dynapipe.tracer.fake_rank import trace_representatives
    from megatron_dynapipe.tracer.trace_format import read_traces

    layout = ParallelLayout(**CASES["dense"][0])
    traces = trace_representatives(layout, TINY, out_dir=tmp_path, shapes_only=True, **RUN)
    assert [t.rank for t in traces] == [0, 4]  # stage 0 and 1 with tp = dp = 0
    on_disk = read_traces(tmp_path)
    assert sorted(on_disk) == [0, 4]
    for rank in (0, 4):
        assert on_disk[rank].signatures() == fake["dense/shapes"][rank].signatures()


def test_model_descriptions():
    import argparse

    from megatron_dynapipe.config.model import ModelSpec, get_model

    by_name = ModelSpec.from_any("6.7B")
    assert by_name is get_model("gpt-6.7b")
    assert (by_name.num_layers, by_name.hidden_size, by_name.num_attention_heads,
            by_name.ffn_hidden_size) == (32, 4096, 32, 16384)
    assert ModelSpec.from_any(get_model("tiny").with_experts(4)).num_experts == 4
    assert ModelSpec.from_any(TINY) == ModelSpec(**TINY)
    with pytest.raises(TypeError, match="cannot describe a model"):
        ModelSpec.from_any(3.5)
    assert get_model("6.7").padded_vocab_size(8) == 51200 and ModelSpec(**TINY).padded_vocab_size(2) == 256
    # Megatron's flags and the spec are one description: the flags it prints build it again
    parser = argparse.ArgumentParser()
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--seq-length",
                 "--max-position-embeddings", "--vocab-size", "--num-experts"):
        parser.add_argument(flag, type=int)
    parser.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    # the rest as Megatron-LM's arguments.py declares them (names, dests, defaults)
    parser.add_argument("--kv-channels", type=int, default=None)
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    parser.add_argument("--group-query-attention", action="store_true")
    parser.add_argument("--num-query-groups", type=int, default=1)
    parser.add_argument("--swiglu", action="store_true")
    parser.add_argument("--normalization", default="LayerNorm")
    parser.add_argument("--position-embedding-type", default="learned_absolute")
    parser.add_argument("--hidden-dropout", type=float, default=0.1)
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    parser.add_argument("--moe-router-topk", type=int, default=2)
    parser.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    parser.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    parser.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    parser.add_argument("--transformer-impl", default="transformer_engine")
    parser.add_argument("--dynapipe-attention", default="local")  # this package's, which the hooks add
    untied = ModelSpec(num_layers=6, hidden_size=96, num_attention_heads=6, ffn_hidden_size=200, vocab_size=1000,
                       max_sequence_length=512, num_experts=4, share_embeddings_and_output_weights=False,
                       moe_router_topk=1, moe_ffn_hidden_size=48, moe_expert_capacity_factor=1.25,
                       moe_pad_expert_input_to_capacity=True)
    llama = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
                      swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                      hidden_dropout=0.0, attention_dropout=0.05, make_vocab_size_divisible_by=64)
    for spec in (untied, llama, get_model("175B"), *(dataclasses.replace(llama, attention=core)
                                                     for core in ("sdpa", "transformer_engine"))):
        args = parser.parse_args(megatron_model_args(spec, seq_length=128))
        assert args.seq_length == 128
        assert model_from_megatron_args(args) == dataclasses.replace(spec, name="")


# --------------------------------------------------------------------------------------------
# trace files and the package


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_trace_files_get_the_mode_of_any_new_file(tmp_path, umask, mode):
    """Not mkstemp's private 0600: other users read traces, summaries and timelines."""
    import os
    import stat

    from megatron_dynapipe.files import write_atomically
    from megatron_dynapipe.tracer.trace_format import trace_path

    trace = RankTrace(rank=3, stage=0, layout={}, coords={}, groups={}, model={}, iteration={})
    old = os.umask(umask)
    try:
        paths = [trace.write(tmp_path), trace.chrome_trace().write(tmp_path / "timeline.json"),
                 write_atomically(tmp_path / "sub" / "summary.json", "{}\n")]
        paths.append(trace.write(tmp_path))  # replacing a file gives the new file the same mode
    finally:
        os.umask(old)
    assert paths[0] == trace_path(tmp_path, 3) == paths[-1]
    for path in paths:
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    assert RankTrace.read(paths[0]).rank == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_3.trace.jsonl", "sub", "timeline.json"]


def test_tracer_package_reexports_lazily():
    """``from megatron_dynapipe.tracer import RankTrace, trace_fake_rank``, and importing the
    package (or RankTrace) imports neither torch nor megatron."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import megatron_dynapipe.tracer as tracer\n"
        "from megatron_dynapipe.tracer import RankTrace\n"
        "from megatron_dynapipe.tracer.trace_format import RankTrace as direct\n"
        "assert RankTrace is direct\n"
        "assert not {'torch', 'megatron'} & set(sys.modules), 'imported too early'\n"
        "from megatron_dynapipe.tracer import trace_fake_rank\n"
        "from megatron_dynapipe.tracer.fake_rank import trace_fake_rank as direct\n"
        "assert trace_fake_rank is direct and 'torch' in sys.modules\n"
        "assert {'RankTrace', 'trace_fake_rank'} <= set(dir(tracer)) and set(tracer.__all__) == {'RankTrace', 'trace_fake_rank'}\n"
        "try:\n"
        "    tracer.no_such_name\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
