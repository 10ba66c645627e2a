"""A shapes-only trace that runs a few micro-batches and repeats the steady state is, op for op,
the trace of a run of every micro-batch: megatron-core's 1F1B, its interleaved schedule and no
pipelining, with overlapped reduction, sequence parallelism and several traced iterations."""

from __future__ import annotations

import pytest

from megatron_dynapipe.config.layout import ParallelLayout
from megatron_dynapipe.config.megatron_options import MegatronOptions
from megatron_dynapipe.tracer import steady_state
from megatron_dynapipe.tracer.trace_format import TraceOp

MODEL = dict(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=128, max_sequence_length=32)


def trace(pp: int, stage: int, num_microbatches: int, repeat: bool, **options):
    from megatron_dynapipe.compat import cpu_compat
    from megatron_dynapipe.tracer.fake_rank import trace_fake_rank

    layout = ParallelLayout(world_size=4 * pp, tp=2, pp=pp)
    with cpu_compat.cpu_mode():
        return trace_fake_rank(layout, stage * 4, MODEL, micro_batch_size=1, num_microbatches=num_microbatches,
                               seq_length=32, shapes_only=True, trace_iters=2, training=MegatronOptions(**options),
                               repeat_steady_state=repeat)


def comparable(op: TraceOp) -> dict:
    fields = op.to_json()
    fields["start_us"] = round(fields["start_us"], 6)  # the repeated blocks' times are sums in another order
    return fields


@pytest.mark.slow
@pytest.mark.parametrize("pp, stage, microbatches, options", [
    (4, 0, 16, {}),  # the longest warm-up
    (4, 3, 16, {}),  # no warm-up, the loss in every forward
    (1, 0, 9, {}),  # no pipelining
    (4, 1, 14, dict(distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)),
    (4, 2, 16, dict(sequence_parallel=True, tp_comm_overlap=True)),
    (4, 0, 24, dict(layers_per_virtual_stage=1)),  # interleaved: groups of 4 over 2 chunks
    (4, 3, 24, dict(layers_per_virtual_stage=1)),  # ... its last stage, which warms up shortest
    (2, 1, 20, dict(layers_per_virtual_stage=2, overlap_grad_reduce=True)),
])
def test_a_repeated_steady_state_is_the_trace_of_every_microbatch(pp, stage, microbatches, options):
    repeated = trace(pp, stage, microbatches, True, **options)
    every = trace(pp, stage, microbatches, False, **options)
    assert repeated.meta["recorded_microbatches"] < microbatches == every.meta["recorded_microbatches"]
    assert repeated.iteration["num_microbatches"] == microbatches
    assert [comparable(op) for op in repeated.ops] == [comparable(op) for op in every.ops]
    assert repeated.memory["peak_bytes"] == every.memory["peak_bytes"]


@pytest.mark.parametrize("microbatches, pp, period, chunks, expected", [
    (100, 4, 1, 1, 6),  # 1F1B: 3 warm-up forwards, two steady blocks to compare, one after
    (100, 1, 1, 1, 3),
    (5, 4, 1, 1, 5),  # too few to gain anything
    # interleaved, 4 stages x 2 chunks: 2*3 + 4 = 10 warm-up passes, 8 passes a group -> 2 groups
    (96, 4, 4, 2, 20),
    (98, 4, 4, 2, 22),  # the added micro-batches are whole groups
])
def test_recorded_microbatches_cover_the_warmup_and_two_steady_blocks(microbatches, pp, period, chunks, expected):
    assert steady_state.recorded_microbatches(microbatches, pp, period, chunks) == expected


@pytest.mark.parametrize("pp, stage, period, chunks, expected", [
    (4, 3, 1, 1, 3),  # 1F1B's last stage: no warm-up, just the three blocks
    (4, 1, 1, 1, 5),  # 2 warm-up forwards
    # interleaved, 4 stages x 2 chunks, stage 3: 0 + 4 warm-up passes, 8 passes a group -> 1 group
    (4, 3, 4, 2, 16),
])
def test_later_stages_warm_up_shorter_and_record_fewer(pp, stage, period, chunks, expected):
    assert steady_state.recorded_microbatches(96, pp, period, chunks, stage) == expected


def pass_(seq: int, kind: str, microbatch: int, nbytes: int = 0) -> list[TraceOp]:
    """A forward or backward and the TP all-reduce it issues."""
    return [TraceOp(seq, 0, 0, "compute", kind, microbatch=microbatch, start_us=10.0 * seq, dur_us=10.0),
            TraceOp(seq + 1, 0, 0, "comm", "all_reduce", microbatch=microbatch, parent=seq, group=(0, 1),
                    bytes=nbytes or 64, start_us=10.0 * seq + 5)]


def no_pipeline(sizes: list[int]) -> list[TraceOp]:
    ops: list[TraceOp] = []
    for m, nbytes in enumerate(sizes):
        ops += pass_(len(ops), "forward", m, nbytes) + pass_(len(ops) + 2, "backward", m, nbytes)
    return ops


def test_extend_renumbers_seqs_parents_and_microbatches_and_moves_times_on():
    ops = steady_state.extend(no_pipeline([64, 64, 64]), 5, 1)
    assert [(op.seq, op.kind, op.microbatch, op.parent) for op in ops][8:12] == [
        (8, "forward", 2, None), (9, "all_reduce", 2, 8), (10, "backward", 2, None), (11, "all_reduce", 2, 10)]
    assert [op.microbatch for op in ops if op.parent is None] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert [op.start_us for op in ops] == [10.0 * (i // 2 * 2) + 5 * (i % 2) for i in range(20)]


def test_a_trace_whose_blocks_differ_is_not_extended():
    with pytest.raises(steady_state.NotPeriodic, match="no two consecutive steady-state blocks"):
        steady_state.extend(no_pipeline([64, 128, 256]), 6, 1)
