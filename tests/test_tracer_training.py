"""The training options a user trains with reach the trace as megatron-core runs them.

Shapes-only fake ranks of a Llama-style tiny GPT (SwiGLU, RMSNorm, GQA, rope, untied, no biases)
at W=8, TP=2, PP=2, DP=2; every expected byte count is worked out here from the model's shapes
and Megatron-LM's documented rules, not read from the tracer.
"""

from __future__ import annotations

import collections
import math

import pytest

from megatron_dynapipe.tracer.topology import ParallelLayout
from megatron_dynapipe.training import TrainingOptions, training_from_args

pytestmark = pytest.mark.slow

LAYOUT = dict(world_size=8, tp=2, pp=2)
DP, TP, LAYERS_PER_STAGE = 2, 2, 2
MBS, MICROBATCHES, SEQ, HIDDEN = 2, 4, 16, 64
#: bf16 activations [seq, mbs, hidden] of one micro-batch
ACT = SEQ * MBS * HIDDEN * 2
MODEL = dict(num_layers=4, hidden_size=HIDDEN, num_attention_heads=4, vocab_size=128, max_sequence_length=64,
             swiglu=True, normalization="RMSNorm", num_query_groups=2, position_embedding_type="rope",
             share_embeddings_and_output_weights=False, add_bias_linear=False)


def stage_params(stage: int) -> int:
    """One TP rank's parameters of a stage: two layers of QKV (4 query heads of 16, 2 key/value
    groups), projection, SwiGLU fc1 (2 x 256) and fc2, two RMSNorm weights; the first stage adds
    its half of the 256-row padded word table, the last the final norm and half the output layer.
    Every tensor is a multiple of 64 elements, so the distributed optimizer pads none of them."""
    h, d = HIDDEN, 16
    layer = h * (4 * d + 2 * 2 * d) // TP + 4 * d * h // TP + h * 2 * 256 // TP + 256 * h // TP + 2 * h
    table = 256 * h // TP
    return LAYERS_PER_STAGE * layer + (table if stage == 0 else h + table)


def bucket_elements(params: int) -> int:
    """Megatron's distributed-optimizer bucket: padded to a multiple of lcm(DP, 128) elements."""
    step = math.lcm(DP, 128)
    return -(-params // step) * step


def trace(rank: int, **options):
    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.tracer.fake_rank import trace_fake_rank

    with cpu_compat.cpu_mode():
        return trace_fake_rank(ParallelLayout(**LAYOUT), rank, MODEL, micro_batch_size=MBS,
                               num_microbatches=MICROBATCHES, seq_length=SEQ, shapes_only=True, dtype="bfloat16",
                               training=TrainingOptions(**options))


def comm_bytes(t, group: str) -> dict:
    """Bytes by (kind, phase) on megatron's group ``group`` (not the last stage's loss report)."""
    out = collections.Counter()
    for op in t.comm_ops:
        if op.group_name == group and op.phase != "loss_report":
            out[op.kind, op.phase] += op.bytes
    return out


@pytest.fixture(scope="module")
def plain():
    return {rank: trace(rank) for rank in (0, 4)}


def test_distributed_optimizer_reduce_scatters_gradients_and_gathers_parameters(plain):
    for rank, stage in ((0, 0), (4, 1)):
        t = trace(rank, distributed_optimizer=True)
        dp = comm_bytes(t, "DATA_PARALLEL_GROUP_WITH_CP")
        bucket = bucket_elements(stage_params(stage))
        assert dp == {("reduce_scatter", "finalize_grads"): 4 * bucket,  # fp32 gradients
                      ("all_gather", "optimizer_step"): 2 * bucket}  # the updated bf16 parameters
        assert comm_bytes(plain[rank], "DATA_PARALLEL_GROUP_WITH_CP") == {
            ("all_reduce", "finalize_grads"): 4 * stage_params(stage)}
        (norm,) = [op for op in t.comm_ops if op.phase == "optimizer_step" and op.kind == "all_reduce"]
        assert norm.group == tuple(range(8)) and norm.bytes == 4  # sharded grads: the norm spans DP too
        assert t.iteration["ddp"]["use_distributed_optimizer"] and t.iteration["training"]["distributed_optimizer"]
        # Adam's fp32 main parameters, first and second moments: 12 bytes a parameter, split over DP
        sharded, whole = (x.memory["model_state_detail"]["optimizer"] for x in (t, plain[rank]))
        assert abs(sharded - 12 * bucket // DP) < 1024 and abs(whole - 12 * stage_params(stage)) < 1024


def dp_ops(t, kind: str) -> list:
    return [op for op in t.comm_ops if op.group_name == "DATA_PARALLEL_GROUP_WITH_CP" and op.kind == kind]


def test_overlapped_reduction_and_gather_run_per_bucket_inside_the_passes():
    options = dict(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
                   bucket_size=stage_params(0) // 3)
    t = trace(0, **options)
    scatters, gathers = dp_ops(t, "reduce_scatter"), dp_ops(t, "all_gather")
    assert len(scatters) >= 3 and {op.phase for op in scatters} == {"backward"}
    assert len(gathers) == len(scatters) and {op.phase for op in gathers} == {"forward"}
    assert sorted(op.bytes for op in scatters) == sorted(2 * op.bytes for op in gathers)  # fp32 grads, bf16 params
    total = sum(op.bytes for op in scatters) // 4
    assert stage_params(0) <= total < stage_params(0) + len(scatters) * 128  # each bucket padded by < 128
    # Megatron buckets only the first stage: later stages' reduction is off the critical path
    (last,) = dp_ops(trace(4, **options), "reduce_scatter")
    assert last.phase == "backward" and last.bytes == 4 * bucket_elements(stage_params(1))


@pytest.mark.parametrize("method, layers, recomputed", [("uniform", 1, 2), ("block", 1, 1)])
def test_full_recompute_repeats_the_layers_forward_collectives_in_the_backward(plain, method, layers, recomputed):
    t = trace(0, recompute_granularity="full", recompute_method=method, recompute_num_layers=layers)
    tp = comm_bytes(t, "TENSOR_MODEL_PARALLEL_GROUP")
    # per micro-batch: the embedding's all-reduce and two per layer forward; two per layer backward,
    # and two more per recomputed layer
    assert tp[("all_reduce", "forward")] == MICROBATCHES * (2 * LAYERS_PER_STAGE + 1) * ACT
    assert tp[("all_reduce", "backward")] == MICROBATCHES * 2 * (LAYERS_PER_STAGE + recomputed) * ACT
    assert comm_bytes(plain[0], "TENSOR_MODEL_PARALLEL_GROUP")[("all_reduce", "backward")] == (
        MICROBATCHES * 2 * LAYERS_PER_STAGE * ACT)
    assert t.memory["activation_peak_bytes"] < plain[0].memory["activation_peak_bytes"]
    backward = {op.dur_us for op in t.compute_ops if op.kind == "backward"}
    assert min(backward) > max(op.dur_us for op in plain[0].compute_ops if op.kind == "backward")


def test_selective_recompute_prices_the_backward_without_extra_collectives(plain):
    t = trace(0, recompute_granularity="selective")
    assert comm_bytes(t, "TENSOR_MODEL_PARALLEL_GROUP") == comm_bytes(plain[0], "TENSOR_MODEL_PARALLEL_GROUP")
    assert t.memory["activation_peak_bytes"] < plain[0].memory["activation_peak_bytes"]


def test_sequence_parallel_gathers_and_scatters_instead_of_all_reducing(plain):
    t = trace(0, sequence_parallel=True)
    tp = comm_bytes(t, "TENSOR_MODEL_PARALLEL_GROUP")
    per_layer = MICROBATCHES * 2 * LAYERS_PER_STAGE * ACT  # two TP regions a layer, each [seq, mbs, hidden]
    assert tp == {
        ("all_gather", "forward"): per_layer,  # before QKV and fc1
        ("reduce_scatter", "forward"): per_layer + MICROBATCHES * ACT,  # after projection, fc2; the embedding (rope)
        ("all_gather", "backward"): 2 * per_layer + MICROBATCHES * ACT,  # inputs again for the weight grads; grads
        ("reduce_scatter", "backward"): per_layer,  # input grads of QKV and fc1
        ("all_reduce", "finalize_grads"): 4 * 2 * LAYERS_PER_STAGE * HIDDEN,  # RMSNorm weight grads, fp32
    }
    parts = [p for op in t.comm_ops if op.parts for p in op.parts]
    assert {p["bytes"] for p in parts} == {ACT // TP}  # pipeline activations split along the sequence
    assert {p["bytes"] for op in plain[0].comm_ops if op.parts for p in op.parts} == {ACT}
    assert t.model["sequence_parallel"] is True


def test_sequence_parallel_needs_tensor_parallelism():
    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.tracer.fake_rank import trace_fake_rank

    with cpu_compat.cpu_mode(), pytest.raises(ValueError, match="--sequence-parallel needs tensor parallelism"):
        trace_fake_rank(ParallelLayout(world_size=4, tp=1, pp=2), 0, MODEL, micro_batch_size=1, num_microbatches=2,
                        seq_length=SEQ, shapes_only=True, training=TrainingOptions(sequence_parallel=True))


@pytest.mark.parametrize("options, message", [
    (dict(overlap_param_gather=True), "--overlap-param-gather needs --use-distributed-optimizer"),
    (dict(recompute_granularity="full"), "needs --recompute-method"),
    (dict(recompute_granularity="selective", recompute_num_layers=2), "go with --recompute-granularity full"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=0), "positive integer"),
    (dict(bucket_size=-5), "--ddp-bucket-size must be a positive integer"),
])
def test_options_megatron_would_refuse_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message) as info:
        TrainingOptions(**options)
    assert "\n" not in str(info.value)


def test_options_come_from_megatron_flags_and_print_back():
    import argparse

    from megatron_dynapipe.training import add_training_arguments

    parser = argparse.ArgumentParser()
    add_training_arguments(parser)
    argv = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "1000",
            "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2",
            "--sequence-parallel"]
    options = training_from_args(parser.parse_args(argv))
    assert options == TrainingOptions(distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=1000,
                                      recompute_granularity="full", recompute_method="block",
                                      recompute_num_layers=2, sequence_parallel=True)
    assert training_from_args(parser.parse_args(options.megatron_args())) == options
    assert training_from_args(parser.parse_args(["--recompute-activations"])).recompute_granularity == "selective"
    assert options.layout_problem(tp=2, layers_per_stage=1).startswith("--recompute-num-layers 2 is more than")


def test_trace_command_takes_the_training_flags(tmp_path, capsys):
    import json

    from megatron_dynapipe.tracer import cli as trace_cli
    from megatron_dynapipe.tracer.trace_format import read_traces

    code = trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "16 2 1", "--sequence-parallel",
                           "--use-distributed-optimizer", "--shapes-only", "--output-dir", str(tmp_path), "--json",
                           "--isolation", "inline", "--no-progress"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["training"]["sequence_parallel"] and summary["training"]["distributed_optimizer"]
    ok, invalid = summary["configs"]
    assert ok["status"] == "ok" and invalid["status"] == "invalid"
    assert invalid["reasons"] == ["--sequence-parallel needs tensor parallelism (TP > 1): drop it or raise TP"]
    traces = list(read_traces(ok["folder"]).values())
    assert len(traces) == 2 and all(t.iteration["training"]["sequence_parallel"] for t in traces)
    assert all(any(op.kind == "reduce_scatter" and op.group_name == "DATA_PARALLEL_GROUP_WITH_CP" for op in t.comm_ops)
               for t in traces)


def test_trace_command_refuses_training_flags_megatron_refuses(tmp_path, capsys):
    from megatron_dynapipe.tracer import cli as trace_cli

    assert trace_cli.main(["--model", "tiny", "--overlap-param-gather", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "megatron-dynapipe trace: error: --overlap-param-gather needs --use-distributed-optimizer"
    assert not list(tmp_path.iterdir())
    assert trace_cli.main(["--model", "tiny", "--print-model-args", "--sequence-parallel"]) == 0
    assert capsys.readouterr().out.split()[-1] == "--sequence-parallel"


def test_shapes_only_tracing_puts_the_autograd_engine_back(plain):
    import torch
    import torch.autograd.graph

    assert torch.autograd._engine_run_backward is torch.autograd.graph._engine_run_backward


def test_print_ranks_skips_the_configs_the_training_flags_do_not_fit(capsys):
    from megatron_dynapipe.tracer import cli as trace_cli

    trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "16 2 1", "--sequence-parallel",
                    "--print-ranks"])
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 + 2  # the header and the two stages of "16 2 2"
    assert "(16 2 1) is invalid: --sequence-parallel needs tensor parallelism" in err
