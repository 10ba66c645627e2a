"""A method's step taken apart (planning/breakdown.py), against closed forms worked out here."""

import numpy as np
import pytest

from megatron_dynapipe.planning.baselines import fixed_shape_run, uniform_microbatches
from megatron_dynapipe.planning.breakdown import PipelineRun, explain, ideal_ms
from megatron_dynapipe.planning.cost_model import CostModel, StageCosts
from megatron_dynapipe.planning.types import MicroBatch, RecomputeType

ALPHA, GAMMA = 0.01, 1e-4  # ms a token, ms a squared token, of a layer's forward


class _TokensAndSquares(CostModel):
    """A layer's forward: ALPHA a token plus GAMMA a squared length (each row's attention to
    itself); backward twice that, plus the forward again under full recompute; nothing else costs
    time or memory worth counting."""

    tp, hidden_size = 1, 1

    def layer_ms(self, layer, phase, recompute, mbs, seqlen):
        forward = (ALPHA * mbs * seqlen + GAMMA * mbs * seqlen * seqlen) * (layer == "encoder")
        if phase == "forward":
            return forward
        return 2 * forward + forward * (recompute == RecomputeType.FULL)

    def activation_mb(self, kind, recompute, mbs, seqlen):
        return 1e-3 * mbs

    def param_mb(self, layer):
        return 1.0


def _costs(pp: int, dp: int = 1) -> StageCosts:
    return StageCosts(_TokensAndSquares(), num_layers=pp, pp=pp, dp=dp)  # one layer a stage


@pytest.mark.parametrize("recompute", [RecomputeType.NONE, RecomputeType.FULL])
def test_a_1f1b_run_of_equal_microbatches_splits_into_its_closed_form_compute_and_bubble(recompute):
    """n equal micro-batches on p stages of one layer, forward f and backward b: 1F1B takes
    (n + p - 1)(f + b); a stage computes n (f + b), its bubble (p - 1)(f + b); full recompute's
    share is n f of it. Samples of 12 tokens padded to 16 waste a quarter of the tokens."""
    pp, n, seq = 4, 8, 16
    costs = _costs(pp)
    f = ALPHA * seq + GAMMA * seq * seq
    b = 2 * f + f * (recompute == RecomputeType.FULL)
    rows = uniform_microbatches(n, 1, seq)
    run = fixed_shape_run(costs, n, 1, seq, recompute)
    assert run.makespan == pytest.approx((n + pp - 1) * (f + b))
    why = explain(PipelineRun.uniform([rows], recompute, [run.makespan], 0.0, pp), costs, [12] * n, [12] * n, seq)
    assert why.busy_ms == pytest.approx(n * (f + b))
    assert why.bubble_ms == pytest.approx((pp - 1) * (f + b), abs=1e-5 * run.makespan)  # transfers: next to free
    assert why.recompute_ms == pytest.approx(n * f if recompute == RecomputeType.FULL else 0.0)
    assert why.padding_share == pytest.approx(0.25)
    assert why.padding_ms == pytest.approx(0.25 * n * 3 * f)
    assert (why.microbatches, why.slowest_rank, why.above_mean) == (n, 0, 0.0)


def test_the_slowest_data_parallel_rank_is_the_one_read_and_its_share_above_the_mean_said():
    costs = _costs(2, dp=3)
    rows = [[MicroBatch((0,), 16)], [MicroBatch((1,), 16), MicroBatch((2,), 16)], [MicroBatch((3,), 16)]]
    why = explain(PipelineRun.uniform(rows, RecomputeType.NONE, [10.0, 30.0, 20.0], 5.0, 2), costs,
                  [16] * 4, [16] * 4, 16)
    assert (why.slowest_rank, why.microbatches, why.pipeline_ms) == (1, 2, 30.0)
    assert why.above_mean == pytest.approx(30 / 20 - 1)
    assert why.peak_memory_mb == 5.0


def test_packed_rows_pad_only_after_their_samples():
    costs = _costs(2)
    row = MicroBatch((0, 1, 2), 64, (20, 20, 8))
    why = explain(PipelineRun.uniform([[row]], RecomputeType.NONE, [1.0], 0.0, 2), costs, [], [20, 20, 8], 64)
    assert why.padding_share == pytest.approx(1 - 48 / 64)


@pytest.mark.parametrize("pp, dp, documents, row", [(4, 1, [100, 28, 300, 7, 1000], 256), (2, 8, [4096] * 3, 1024),
                                                    (3, 2, [5], 4096)])
def test_the_ideal_is_the_real_tokens_linear_work_and_each_documents_own_attention_spread_over_every_rank(
        pp, dp, documents, row):
    """Whatever rows it takes, the tokens T's linear work and each document's attention to itself
    (its length squared, Q in all), forward and backward (3x), on every stage, over pp x dp ranks."""
    tokens, squares = sum(documents), sum(n * n for n in documents)
    expected = 3 * (ALPHA * tokens + GAMMA * squares) * pp / (pp * dp)
    assert ideal_ms(_costs(pp, dp), documents, row) == pytest.approx(expected, rel=1e-9)


def test_no_method_beats_the_ideal_and_a_1f1b_step_is_ideal_only_less_its_bubble_and_padding():
    """Documents of exactly one window, one a micro-batch: nothing is padded or recomputed, so the
    step is the ideal spread over the stages plus the bubble."""
    pp, n, seq = 4, 16, 32
    costs = _costs(pp)
    rows = uniform_microbatches(n, 1, seq)
    run = fixed_shape_run(costs, n, 1, seq, RecomputeType.NONE)
    why = explain(PipelineRun.uniform([rows], RecomputeType.NONE, [run.makespan], 0.0, pp), costs, [seq] * n,
                  [seq] * n, seq)
    assert why.ideal_ms == pytest.approx(why.busy_ms)  # one layer a stage: every stage is the busiest
    assert why.ideal_ms + why.bubble_ms == pytest.approx(why.pipeline_ms)
    assert why.padding_ms == 0.0 and why.recompute_ms == 0.0
    np.testing.assert_array_less(why.ideal_ms, why.pipeline_ms)
