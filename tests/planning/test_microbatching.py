"""Micro-batching: the dynamic programme against brute force, and the simple partitions."""

import itertools

import numpy as np
import pytest

from megatron_dynapipe.planning.microbatching import (
    MicroBatchingError,
    PaddedRows,
    cheapest_recompute,
    microbatch_fits,
    microbatch_times,
    pack_fixed_length,
    partition_dp,
    partition_token_based,
    partition_uniform,
    split_across_dp,
)
from megatron_dynapipe.planning.types import Action, RecomputeType

F, B = Action.forward, Action.backward  # F(m, chunk=0): forward of micro-batch m

LIMIT = 36_000.0


def compositions(n):
    """Every way to cut 0..n into consecutive non-empty runs."""
    for cuts in itertools.product((0, 1), repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        yield list(zip(bounds, bounds[1:]))


def objective(costs, runs, sorted_lengths, rc, chunks=1):
    """sum(t) + (pp - 1) / V max(t): an interleaved pipeline fills and drains with chunks of 1/V
    of a rank's work (Narayanan et al.)."""
    times = []
    for lo, hi in runs:
        seq = -(-sorted_lengths[hi - 1] // 8) * 8
        if not microbatch_fits(costs, hi - lo, seq, rc, LIMIT):
            return np.inf
        times.append(float(microbatch_times(costs, hi - lo, seq, rc)))
    return sum(times) + (costs.pp - 1) / chunks * max(times)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rc", [RecomputeType.SELECTIVE, RecomputeType.FULL])
@pytest.mark.parametrize("chunks, longest", [(1, 1000), (4, 1000), (1, 200), (4, 200)])
def test_dynamic_programme_finds_the_brute_force_optimum(costs_pp4, seed, rc, chunks, longest):
    # short samples: where the interleaved pipeline's smaller fill favours fewer micro-batches
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(20, longest, size=9)]
    found, _ = partition_dp(lengths, range(len(lengths)), costs_pp4, LIMIT, rc, num_thresholds=10_000, chunks=chunks)
    sorted_lengths = sorted(lengths)
    best = min(objective(costs_pp4, runs, sorted_lengths, rc, chunks) for runs in compositions(len(lengths)))
    times = [float(microbatch_times(costs_pp4, mb.size, mb.seq_len, rc)) for mb in found]
    assert sum(times) + 3 / chunks * max(times) == pytest.approx(best)


def test_microbatches_are_consecutive_runs_of_sorted_samples(costs_pp4):
    rng = np.random.default_rng(7)
    lengths = [int(x) for x in rng.integers(8, 2048, size=200)]
    mbs, _ = partition_dp(lengths, range(200), costs_pp4, LIMIT, RecomputeType.FULL)
    placed = [i for mb in mbs for i in mb.samples]
    assert sorted(placed) == list(range(200))
    assert [lengths[i] for i in placed] == sorted(lengths)
    for mb in mbs:
        assert mb.seq_len % 8 == 0 and mb.seq_len - 8 < max(lengths[i] for i in mb.samples) <= mb.seq_len


def test_a_sample_no_microbatch_can_hold_is_a_clear_error(costs_pp4):
    # 8192 tokens without recompute: one sample's activations exceed what 36 GB leaves.
    with pytest.raises(MicroBatchingError, match="fits no micro-batch.*raise the memory limit"):
        partition_dp([100, 8192], range(2), costs_pp4, LIMIT, RecomputeType.NONE)
    # Beyond the profiled range (8192) nothing is feasible, whatever the recompute.
    with pytest.raises(MicroBatchingError, match="9000 tokens"):
        partition_dp([9000], range(1), costs_pp4, LIMIT, RecomputeType.FULL)


def test_data_parallel_split_places_every_sample_and_balances_cost(costs_pp4):
    rng = np.random.default_rng(3)
    lengths = [int(x) for x in rng.integers(8, 2048, size=101)]
    ranks = split_across_dp(lengths, 4, costs_pp4)
    assert sorted(i for r in ranks for i in r) == list(range(101))
    cost = lambda i: float(microbatch_times(costs_pp4, 1, -(-lengths[i] // 8) * 8, RecomputeType.NONE))  # noqa: E731
    loads = [sum(cost(i) for i in r) for r in ranks]
    # Greedy longest-first: the spread is at most the largest single sample.
    assert max(loads) - min(loads) <= max(cost(i) for i in range(101)) + 1e-9


def test_too_few_samples_for_the_data_parallel_ranks(costs_pp4):
    with pytest.raises(MicroBatchingError, match="at least 4 samples"):
        split_across_dp([10, 20], 4, costs_pp4)


def test_token_based_and_uniform_partitions():
    lengths = [100, 30, 500, 260, 70, 64, 1000]
    token = partition_token_based(lengths, range(7), tokens_per_microbatch=600)
    assert sorted(i for mb in token for i in mb.samples) == list(range(7))
    assert all(mb.tokens <= 600 or mb.size == 1 for mb in token)
    uniform = partition_uniform(lengths, range(7), microbatch_size=3)
    assert [mb.size for mb in uniform] == [3, 3, 1]
    assert [mb.seq_len for mb in uniform] == [72, 504, 1000]  # sorted: 30 64 70 | 100 260 500 | 1000


def test_packing_fills_fixed_length_sequences():
    lengths = [3000, 1200, 900, 800, 4096, 100]
    bins = pack_fixed_length(lengths, 4096)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 4096 for b in bins)
    assert len(bins) == 3  # 4096 | 3000+900+100 | 1200+800
    with pytest.raises(MicroBatchingError, match="exceeds the packed length"):
        pack_fixed_length([5000], 4096)


def test_the_long_mix_reaches_its_cap_often_and_stays_within_it():
    from megatron_dynapipe.planning.samples import LONG_MAX_LENGTH, synthetic_lengths

    lengths = np.array(synthetic_lengths(4000, seed=0, mix="long"))
    assert lengths.min() >= 8 and lengths.max() == LONG_MAX_LENGTH == 4096
    assert 0.15 < np.mean(lengths == 4096) < 0.3  # a sizeable share is cut at the context length
    assert np.median(lengths) < 2048  # and the rest spreads below it


def test_the_longtail_mix_has_a_few_samples_of_4_to_8_times_its_median():
    from megatron_dynapipe.planning.samples import synthetic_lengths

    lengths = np.array(synthetic_lengths(20000, seed=0, mix="longtail"))
    median = np.median(lengths)
    assert 1000 < median < 1600 and lengths.max() <= 16384
    tail = lengths[lengths >= 4 * median]
    assert 0.06 < len(tail) / len(lengths) < 0.12  # a few
    assert np.median(tail) < 8 * median


def test_a_mix_scaled_to_a_shorter_context_keeps_its_shape():
    from megatron_dynapipe.planning.samples import LONG_MAX_LENGTH, scaled_lengths, synthetic_lengths

    full = np.array(synthetic_lengths(1000, seed=4, mix="long"))
    assert scaled_lengths(1000, 4, "long", LONG_MAX_LENGTH) == full.tolist()  # its own cap: unchanged
    quarter = np.array(scaled_lengths(1000, 4, "long", 1024))
    assert quarter.max() == 1024 and quarter.min() >= 2  # the cut ones stay at the (new) cap
    assert np.all(np.abs(quarter - np.maximum(full / 4, 2)) <= 0.5)  # each a quarter, to the token
    assert np.all(np.diff(quarter[np.argsort(full)]) >= 0)  # the order of lengths kept


def test_the_dp_reports_the_recompute_each_microbatch_was_costed_with(costs_pp4):
    rng = np.random.default_rng(11)
    lengths = [int(x) for x in rng.integers(8, 4096, size=120)]
    types = (RecomputeType.NONE, RecomputeType.SELECTIVE, RecomputeType.FULL)
    mbs, recompute = partition_dp(lengths, range(120), costs_pp4, LIMIT, types)
    assert recompute == cheapest_recompute(costs_pp4, mbs, types, LIMIT)
    assert partition_dp([], [], costs_pp4, LIMIT, types) == ([], [])


def test_fast_partition_costs_each_microbatch_with_the_lightest_recompute_that_fits(costs_pp4):
    rng = np.random.default_rng(12)
    lengths = [int(x) for x in rng.integers(8, 4096, size=120)]
    types = (RecomputeType.NONE, RecomputeType.SELECTIVE, RecomputeType.FULL)
    mbs, recompute = partition_dp(lengths, range(120), costs_pp4, LIMIT, types, fast=True)
    assert sorted(i for mb in mbs for i in mb.samples) == list(range(120))
    lightest = [next(rc for rc in types if microbatch_fits(costs_pp4, mb.size, mb.seq_len, rc, LIMIT)) for mb in mbs]
    assert recompute == lightest
    assert set(recompute) != {RecomputeType.NONE}  # the memory limit made some micro-batch recompute


@pytest.mark.parametrize("foreseen", [0, 2, 4], ids=["none-foreseen", "two-foreseen", "all-foreseen"])
@pytest.mark.parametrize("fast", [False, True])
def test_partitions_sharing_padded_rows_are_what_each_makes_alone(costs_pp4, fast, foreseen):
    """Every DP rank's partitions share one PaddedRows: narrower and wider questions of the same
    padded lengths, in either order, under one and several recompute types, with none, some or
    all of them foreseen (rows then costed as wide as the widest foreseen question)."""
    rng = np.random.default_rng(13)
    lengths = [int(x) for x in rng.integers(8, 4096, size=300)]
    ranks = [range(0, 20), range(20, 140), range(140, 300), range(0, 300)]
    rows = PaddedRows(costs_pp4, LIMIT)
    for samples in ranks[:foreseen]:
        rows.foresee([lengths[i] for i in samples], 8, fast)
    for samples in ranks + ranks[::-1]:
        for recompute in (tuple(RecomputeType), RecomputeType.FULL):
            alone = partition_dp(lengths, samples, costs_pp4, LIMIT, recompute, fast=fast)
            assert partition_dp(lengths, samples, costs_pp4, LIMIT, recompute, fast=fast, rows=rows) == alone


def test_padded_rows_of_another_memory_limit_are_refused(costs_pp4):
    with pytest.raises(ValueError, match="another cost model or memory limit"):
        partition_dp([100, 200], range(2), costs_pp4, LIMIT, rows=PaddedRows(costs_pp4, LIMIT / 2))


@pytest.mark.parametrize("seq", [64, 512, 2048, 4096, 8192])
def test_a_heavier_recompute_is_never_faster_in_the_shipped_profile(costs_pp4, seq):
    """What the fast partition's lightest-that-fits rule relies on."""
    sizes = np.arange(1, 257)
    times = [microbatch_times(costs_pp4, sizes, seq, rc) for rc in RecomputeType]
    for lighter, heavier in zip(times, times[1:]):
        finite = np.isfinite(lighter) & np.isfinite(heavier)
        assert finite.any() or seq == 8192
        assert np.all(lighter[finite] <= heavier[finite])


def test_each_microbatch_starts_at_the_lightest_recompute_under_which_it_runs_alone(costs_pp4):
    from megatron_dynapipe.planning.microbatching import lightest_fitting_alone
    from megatron_dynapipe.planning.simulator import simulate, stage_work
    from megatron_dynapipe.planning.types import MicroBatch

    def peak_alone(mb, rc):  # one micro-batch through the pipeline, as the simulator runs it
        work = stage_work(costs_pp4, [mb], np.full((4, 1), int(rc)))
        return simulate([[F(0), B(0)]] * 4, work).peak_memory.max()

    mbs = [MicroBatch(tuple(range(size)), seq) for size, seq in [(1, 512), (8, 1024), (1, 4096), (3, 2048), (1, 8192)]]
    allowed = (RecomputeType.NONE, RecomputeType.SELECTIVE, RecomputeType.FULL)
    for limit in (36_000, 34_000):
        chosen = lightest_fitting_alone(costs_pp4, mbs, allowed, limit)
        for mb, rc in zip(mbs, chosen):
            lighter = [t for t in allowed if t < rc]
            assert all(peak_alone(mb, t) > limit for t in lighter)
            assert peak_alone(mb, rc) <= limit or rc == RecomputeType.FULL  # the heaviest where none fits
        assert len(set(chosen)) > 1  # the shapes span several answers
    # only the allowed types are chosen
    assert set(lightest_fitting_alone(costs_pp4, mbs, (RecomputeType.NONE, RecomputeType.FULL), 36_000)) <= {
        RecomputeType.NONE, RecomputeType.FULL}


@pytest.mark.parametrize("at_once", [0, 1 << 20])  # bisection, and every run priced in one evaluation
def test_the_widest_fitting_packed_run_at_each_end_is_found_either_way(monkeypatch, at_once):
    from megatron_dynapipe.planning import microbatching

    monkeypatch.setattr(microbatching, "PACKED_WIDTHS_AT_ONCE", at_once)
    lengths = np.sort(np.random.default_rng(5).integers(1, 300, size=60))
    tokens = np.concatenate([[0], np.cumsum(lengths)])
    budget = 1000  # a run fits while its tokens do

    def evaluate(ends, sizes):
        return np.where(tokens[ends] - tokens[ends - sizes] <= budget, 1.0, np.inf)

    ends = np.arange(1, 61)
    most = np.minimum(ends, 25)
    expected = [max(k for k in range(1, m + 1) if tokens[e] - tokens[e - k] <= budget or k == 1)
                for e, m in zip(ends, most)]
    assert microbatching._packed_widths(evaluate, ends, most).tolist() == expected
