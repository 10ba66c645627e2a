"""The training options a user trains with reach the trace as megatron-core runs them.

Shapes-only fake ranks of a Llama-style tiny GPT (SwiGLU, RMSNorm, GQA, rope, untied, no biases)
at W=8, TP=2, PP=2, DP=2; every expected byte count is worked out here from the model's shapes
and Megatron-LM's documented rules, not read from the tracer.
"""

from __future__ import annotations

import collections
import math

import pytest

from megatron_dynapipe.config.layout import ParallelLayout
from megatron_dynapipe.config.megatron_options import MegatronOptions, megatron_options_from_args

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
                               training=MegatronOptions(**options))


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
    # Megatron buckets only the first stage: later stages' reduction is off the critical path;
    # Megatron-LM's --align-grad-reduce launches it once their last backward is done
    (last,) = dp_ops(trace(4, **options), "reduce_scatter")
    assert last.phase is None and last.parent is None and last.name.endswith("start_grad_sync")
    assert last.bytes == 4 * bucket_elements(stage_params(1))


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


@pytest.mark.parametrize("options, message", [
    (dict(overlap_param_gather=True), "--overlap-param-gather needs --use-distributed-optimizer"),
    (dict(recompute_granularity="full"), "needs --recompute-method"),
    (dict(recompute_granularity="selective", recompute_num_layers=2), "go with --recompute-granularity full"),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=0), "positive integer"),
    (dict(bucket_size=-5), "--ddp-bucket-size must be a positive integer"),
])
def test_options_megatron_would_refuse_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message) as info:
        MegatronOptions(**options)
    assert "\n" not in str(info.value)


def test_options_come_from_megatron_flags_and_print_back():
    import argparse

    from megatron_dynapipe.config.megatron_options import add_megatron_options

    parser = argparse.ArgumentParser()
    add_megatron_options(parser)
    argv = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "1000",
            "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2",
            "--sequence-parallel"]
    options = megatron_options_from_args(parser.parse_args(argv))
    assert options == MegatronOptions(distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=1000,
                                      recompute_granularity="full", recompute_method="block",
                                      recompute_num_layers=2, sequence_parallel=True)
    assert megatron_options_from_args(parser.parse_args(options.megatron_args())) == options
    assert megatron_options_from_args(parser.parse_args(["--recompute-activations"])).recompute_granularity == "selective"
    assert options.layout_problem(tp=2, num_layers=1).startswith("--recompute-num-layers 2 is more than")


def test_trace_command_takes_the_training_flags(tmp_path, capsys):
    import json

    from megatron_dynapipe.tracer import cli as trace_cli
    from megatron_dynapipe.tracer.trace_format import read_traces

    code = trace_cli.main(["--model", "tiny", "--config", "16 2 2", "--config", "16 2 1", "--sequence-parallel",
                           "--use-distributed-optimizer", "--shapes-only", "--output-dir", str(tmp_path), "--json",
                           "--isolation", "inline", "--no-progress"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["training"]["sequence_parallel"] and summary["training"]["distributed_optimizer"]
    tp2, tp1 = summary["configs"]
    assert tp2["status"] == tp1["status"] == "ok"
    traces = list(read_traces(tp2["folder"]).values())
    assert len(traces) == 2 and all(t.iteration["training"]["sequence_parallel"] for t in traces)
    assert all(any(op.kind == "reduce_scatter" and op.group_name == "DATA_PARALLEL_GROUP_WITH_CP" for op in t.comm_ops)
               for t in traces)
    # at TP 1 Megatron-LM's argument validation turns --sequence-parallel off, and so does the tracer
    assert not any(t.iteration["training"]["sequence_parallel"] for t in read_traces(tp1["folder"]).values())


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
                    "--tp-comm-overlap", "--print-ranks"])
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 + 2  # the header and the two stages of "16 2 2"
    assert ("(16 2 1) is invalid: --tp-comm-overlap needs sequence parallelism, which Megatron-LM turns off at "
            "TP 1: drop --tp-comm-overlap or raise TP") in err


# --------------------------------------------------------------------------------------------
# interleaved 1F1B


def test_interleaving_flags_come_from_megatron_flags_and_print_back():
    import argparse

    from megatron_dynapipe.config.megatron_options import add_megatron_options

    parser = argparse.ArgumentParser()
    add_megatron_options(parser)
    for argv, options in (
            (["--num-layers-per-virtual-pipeline-stage", "2"], MegatronOptions(layers_per_virtual_stage=2)),
            (["--num-virtual-stages-per-pipeline-rank", "3", "--no-overlap-p2p-communication"],
             MegatronOptions(virtual_stages=3, overlap_p2p_comm=False))):
        assert megatron_options_from_args(parser.parse_args(argv)) == options
        assert options.megatron_args() == argv
    assert megatron_options_from_args(parser.parse_args([])).overlap_p2p_comm  # Megatron-LM's default
    # without interleaving Megatron-LM turns the overlap off: the flag means nothing there
    assert megatron_options_from_args(parser.parse_args(["--no-overlap-p2p-communication"])) == MegatronOptions()


@pytest.mark.parametrize("options, layout, message", [
    (dict(layers_per_virtual_stage=1, virtual_stages=2), dict(pp=4, num_layers=8),
     "give one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank"),
    (dict(layers_per_virtual_stage=0), dict(pp=4, num_layers=8), "must be a positive integer, got 0"),
    (dict(layers_per_virtual_stage=2), dict(pp=4, num_layers=12), "does not divide the 3 layers"),
    (dict(virtual_stages=2), dict(pp=4, num_layers=12),
     "the 3 layers of pipeline stage 0 do not split into 2 model chunks"),
    (dict(layers_per_virtual_stage=1), dict(pp=1, num_layers=4), "needs PP > 1"),
    (dict(layers_per_virtual_stage=1, overlap_p2p_comm=False), dict(pp=2, num_layers=8),
     "PP > 2 with --no-overlap-p2p-communication"),
    (dict(layers_per_virtual_stage=1), dict(pp=4, num_layers=8, num_microbatches=6),
     "use a multiple of 4 micro-batches, not 6"),
    (dict(layers_per_virtual_stage=1), dict(pp=4, num_layers=8, num_microbatches=2),
     "use a multiple of 4 micro-batches, not 2"),
])
def test_interleaving_megatron_refuses_is_refused_in_one_line(options, layout, message):
    def problem():
        return MegatronOptions(**options).layout_problem(tp=1, **layout)

    try:
        found = problem()
    except ValueError as exc:  # the options alone are wrong
        found = str(exc)
    assert found is not None and message in found and "\n" not in found


def test_interleaving_that_megatron_accepts_passes():
    # one chunk per rank is plain 1F1B for Megatron-LM, whatever PP and the number of micro-batches
    assert MegatronOptions(layers_per_virtual_stage=2).layout_problem(tp=1, pp=1, num_layers=2,
                                                                      num_microbatches=3) is None
    assert MegatronOptions(virtual_stages=2).layout_problem(tp=1, pp=2, num_layers=8, num_microbatches=8) is None
    assert MegatronOptions(layers_per_virtual_stage=1, overlap_p2p_comm=False).layout_problem(
        tp=1, pp=3, num_layers=6, num_microbatches=3) is None


def test_block_recompute_counts_its_layers_in_every_chunk():
    """--recompute-method block recomputes the first N layers of each transformer block, and under
    interleaving every model chunk is a block: 4 layers a stage in two chunks of 2, N = 1 -> 2."""
    block = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)

    def recomputed(options: MegatronOptions) -> int:  # on the first of 2 stages of 8 layers
        return sum(options.recomputed_layers(layers) for layers in options.rank_chunk_layers(8, 2, 0))

    assert recomputed(MegatronOptions(**block)) == 1
    assert recomputed(MegatronOptions(**block, layers_per_virtual_stage=2)) == 2
    assert recomputed(MegatronOptions(**dict(block, recompute_num_layers=3), virtual_stages=2)) == 4


def test_interleaved_chunks_price_their_own_layers(plain):
    """Shapes-only durations: with one layer a chunk, the LM head runs in the last stage's last
    chunk only, stage 0's first chunk adds the embedding lookup (the A100 roofline streams its
    16-bit b x s x h output once forward, twice backward), and a stage's chunks add up to its
    1F1B forward and backward (the model adds nothing per call)."""
    for rank in (0, 4):
        t = trace(rank, layers_per_virtual_stage=1)
        tokens = t.iteration["micro_batch_size"] * t.iteration["seq_length"]
        for kind in ("forward", "backward"):
            per_chunk = {op.chunk: op.dur_us for op in t.compute_ops if op.kind == kind}
            (whole,) = {op.dur_us for op in plain[rank].compute_ops if op.kind == kind}
            assert sum(per_chunk.values()) == pytest.approx(whole, rel=1e-9)
            if rank == 0:
                passes = 1 if kind == "forward" else 2
                lookup_us = passes * 2 * tokens * t.model["hidden_size"] / (2039e9 * 0.85) * 1e6
                assert per_chunk[0] - per_chunk[1] == pytest.approx(lookup_us, rel=1e-6)
            else:
                assert per_chunk[1] > per_chunk[0]
