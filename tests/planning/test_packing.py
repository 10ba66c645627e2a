"""Packed (varlen) micro-batches: their price, the dynamic programme that cuts them, the THD
baseline and their plans on the wire. Expected values are worked out here from the definitions."""

import itertools

import numpy as np
import pytest

from megatron_dynapipe.planning import TrainingSpec, generate_execution_plan
from megatron_dynapipe.planning.cost_model.base import CostModel
from megatron_dynapipe.planning.baselines import thd_packing_rows
from megatron_dynapipe.planning.microbatching import (
    microbatch_fits,
    microbatch_times,
    pack_fixed_length,
    partition_dp,
)
from megatron_dynapipe.planning.plan import ExecutionPlan, build_execution_plans
from megatron_dynapipe.planning.schedules import one_f_one_b_orders
from megatron_dynapipe.planning.types import MicroBatch, RecomputeType

LIMIT = 36_000.0
FULL = RecomputeType.FULL


def _round8(n):
    return -(-n // 8) * 8


def test_a_packed_microbatch_is_priced_with_its_tokens_and_its_attention_work():
    rng = np.random.default_rng(0)
    for _ in range(20):
        lengths = tuple(int(n) for n in rng.integers(1, 900, size=rng.integers(1, 9)))
        row = _round8(sum(lengths)) + 8 * int(rng.integers(0, 3))
        mbs, seq = MicroBatch(tuple(range(len(lengths))), row, lengths).cost_shape
        attention = sum(n * n for n in lengths) + (row - sum(lengths)) ** 2  # the padding is one more segment
        assert mbs * seq == pytest.approx(row) and mbs * seq * seq == pytest.approx(attention)


def test_two_equal_samples_packed_cost_what_two_rows_of_them_cost():
    assert MicroBatch((0, 1), 2048, (1024, 1024)).cost_shape == (2, 1024)
    packed, padded = MicroBatch((0, 1), 2048, (1024, 1024)), MicroBatch((0, 1), 1024)
    assert (packed.rows, packed.tokens, padded.rows, padded.tokens) == (1, 2048, 2, 2048)


def test_a_packed_microbatch_must_hold_its_samples():
    with pytest.raises(ValueError, match="lengths summing to 70 tokens, over its 64"):
        MicroBatch((0, 1), 64, (40, 30))
    with pytest.raises(ValueError, match="2 samples has 1 lengths"):
        MicroBatch((0, 1), 64, (40,))


def _packed_objective(costs, runs, sorted_lengths, rc):
    times = []
    for lo, hi in runs:
        run = sorted_lengths[lo:hi]
        row = _round8(sum(run))
        squares = sum(n * n for n in run) + (row - sum(run)) ** 2
        mbs, seq = row * row / squares, squares / row
        if not microbatch_fits(costs, mbs, seq, rc, LIMIT):
            return np.inf
        times.append(float(microbatch_times(costs, mbs, seq, rc)))
    return sum(times) + (costs.pp - 1) * max(times)


def _compositions(n):
    for cuts in itertools.product((0, 1), repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        yield list(zip(bounds, bounds[1:]))


@pytest.mark.parametrize("seed", range(3))
def test_the_packed_dynamic_programme_finds_the_brute_force_optimum(costs_pp4, seed):
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(20, 1500, size=9)]
    found, _ = partition_dp(lengths, range(9), costs_pp4, LIMIT, FULL, num_thresholds=10_000, packed=True)
    assert all(mb.packed for mb in found) and sorted(i for mb in found for i in mb.samples) == list(range(9))
    for mb in found:
        assert mb.packed_lengths == tuple(lengths[i] for i in mb.samples)
        assert mb.seq_len == _round8(sum(mb.packed_lengths))
    runs, at = [], 0
    for mb in found:
        runs.append((at, at + mb.size))
        at += mb.size
    sorted_lengths = sorted(lengths)
    best = min(_packed_objective(costs_pp4, r, sorted_lengths, FULL) for r in _compositions(9))
    assert _packed_objective(costs_pp4, runs, sorted_lengths, FULL) == pytest.approx(best)


def test_fast_mode_packs_the_best_runs_of_every_size_to_16_and_a_quarter_apart_above(costs_pp4):
    # 48 short samples: every run of them fits, so the widest run ending at sample j is all j.
    # Fast mode may cut runs of 1-16 samples, of 20, 25, 31 or 39 (each about a quarter above the
    # last), or of all the samples so far; the best such cut is found here by brute force over
    # caps T on a run's time: the least sum of times under T, plus 3 T (PP 4's fill and drain).
    lengths = [int(x) for x in np.random.default_rng(2).integers(8, 40, size=48)]
    sorted_lengths = sorted(lengths)
    n = len(lengths)

    def allowed(k, j):
        return k <= 16 or k in (20, 25, 31, 39) or k == j

    def run_time(lo, hi):  # a single run's objective is its time plus 3 times it
        return _packed_objective(costs_pp4, [(lo, hi)], sorted_lengths, FULL) / 4

    times = {(j - k, j): run_time(j - k, j) for j in range(1, n + 1) for k in range(1, j + 1) if allowed(k, j)}
    best = np.inf
    for cap in set(times.values()):
        least = [0.0] + [np.inf] * n  # least[j]: the least sum of times cutting the first j samples
        for (lo, hi), t in sorted(times.items(), key=lambda item: item[0][1]):
            if t <= cap:
                least[hi] = min(least[hi], least[lo] + t)
        best = min(best, least[n] + 3 * cap)
    found, _ = partition_dp(lengths, range(n), costs_pp4, LIMIT, FULL, num_thresholds=10_000, fast=True,
                            packed=True)
    runs, at = [], 0
    for mb in found:
        assert allowed(mb.size, at + mb.size)
        runs.append((at, at + mb.size))
        at += mb.size
    assert _packed_objective(costs_pp4, runs, sorted_lengths, FULL) == pytest.approx(best)
    # what fast mode gives up here: normal mode's best cut (30 then 18 samples) has a size it skips
    exact, _ = partition_dp(lengths, range(n), costs_pp4, LIMIT, FULL, num_thresholds=10_000, packed=True)
    ends = np.cumsum([mb.size for mb in exact]).tolist()
    exact_runs = list(zip([0] + ends[:-1], ends))
    assert _packed_objective(costs_pp4, exact_runs, sorted_lengths, FULL) < best


def test_packing_never_predicts_more_than_padding_the_same_batch(costs_pp4):
    """A run's packed shape has no more rows and no longer rows than its padded one (Cauchy-Schwarz:
    (sum l)^2 <= k sum l^2), so the best packed micro-batching is never predicted slower."""
    rng = np.random.default_rng(3)
    for _ in range(3):
        lengths = [int(x) for x in rng.integers(8, 2000, size=24)]
        objectives = []
        for packed in (False, True):
            mbs, rcs = partition_dp(lengths, range(24), costs_pp4, LIMIT, tuple(RecomputeType),
                                    num_thresholds=10_000, packed=packed)
            times = [float(microbatch_times(costs_pp4, *mb.cost_shape, rc)) for mb, rc in zip(mbs, rcs)]
            objectives.append(sum(times) + 3 * max(times))
        assert objectives[1] <= objectives[0] * (1 + 1e-9)


def test_the_planner_packs_with_packing_varlen(costs_pp4):
    lengths = [int(x) for x in np.random.default_rng(5).integers(16, 2048, size=48)]
    spec = TrainingSpec(num_layers=32, pp=4, dp=2, memory_limit_mb=LIMIT, packing="varlen")
    result = generate_execution_plan(lengths, spec, costs_pp4)
    for plans in result.plans:
        assert all(mb.packed and mb.rows == 1 for mb in plans[0].microbatches)
    placed = sorted(i for plans in result.plans for mb in plans[0].microbatches for i in mb.samples)
    assert placed == list(range(48))
    padded = generate_execution_plan(lengths, TrainingSpec(num_layers=32, pp=4, dp=2, memory_limit_mb=LIMIT),
                                     costs_pp4)
    assert not any(mb.packed for plans in padded.plans for mb in plans[0].microbatches)


def test_packing_is_checked():
    with pytest.raises(ValueError, match="unknown packing 'thd': choose from pad, varlen"):
        TrainingSpec(packing="thd")
    with pytest.raises(ValueError, match="packing varlen cuts micro-batches by dynamic programming"):
        TrainingSpec(packing="varlen", partition="uniform")


def _first_fit_decreasing(lengths, seq_len):
    """The definition: longest first, each into the first open sequence it fits, else a new one."""
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        b = next((b for b, free in enumerate(room) if lengths[i] <= free), len(bins))
        if b == len(bins):
            bins.append([])
            room.append(seq_len)
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


@pytest.mark.parametrize("seed", range(6))
def test_megatron_style_packing_is_first_fit_decreasing(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    lengths = [int(x) for x in np.clip(rng.lognormal(5, 1.2, n), 1, 1024)]
    if seed == 0:
        lengths = [512] * 7 + [1024, 1, 1023]  # exact fits and ties keep their order
    bins = pack_fixed_length(lengths, 1024)
    assert bins == _first_fit_decreasing(lengths, 1024)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 1024 for b in bins)


def test_megatron_style_packing_takes_a_batch_too_large_to_try_every_open_sequence():
    bins = pack_fixed_length([1000] * 50_000 + [24] * 50_000, 1024)  # each short one closes a long one's
    assert len(bins) == 50_000 and bins[-1] == [49_999, 99_999]


def test_the_thd_baseline_rows_hold_k_packed_sequences(costs_pp4):
    lengths = [100, 60, 50, 30, 20, 10, 90, 8, 128, 64]
    sequences = pack_fixed_length(lengths, 128)
    per_rank, recompute, makespan, _, rank_makespans = thd_packing_rows(sequences, lengths, 128, costs_pp4, LIMIT)
    assert len(per_rank) == costs_pp4.dp == 1 and makespan > 0 and recompute in RecomputeType
    assert rank_makespans == (makespan,)
    rows = per_rank[0]
    k = rows[0].seq_len // 128
    assert [mb.seq_len for mb in rows[:-1]] == [k * 128] * (len(rows) - 1)
    assert sum(mb.seq_len for mb in rows) == 128 * len(sequences)  # every sequence's 128 tokens, in rows of k
    assert sorted(i for mb in rows for i in mb.samples) == list(range(len(lengths)))
    for mb in rows:
        assert mb.packed and mb.packed_lengths == tuple(lengths[i] for i in mb.samples)


def test_a_packed_plan_travels_with_its_samples_lengths():
    mbs = [MicroBatch((3, 0, 2), 40, (10, 7, 20)), MicroBatch((1,), 16, (16,))]
    plan = build_execution_plans(one_f_one_b_orders(2, 2), mbs, "none", "1f1b", 5.0)[1]
    data = plan.to_bytes()
    back = ExecutionPlan.from_bytes(data)
    assert back == plan and back.microbatches[0].packed_lengths == (10, 7, 20)
    assert ExecutionPlan.from_bytes(bytearray(data)).microbatches[1].packed
    with pytest.raises(ValueError, match="all packed or all padded"):
        build_execution_plans(one_f_one_b_orders(2, 2), [mbs[0], MicroBatch((1,), 16)], "none", "1f1b", 5.0)[0].to_bytes()


@pytest.mark.parametrize("pp,n,size,seq_len,rc", [(4, 40, 1, 1024, "full"), (4, 57, 1, 1024, "selective"),
                                                   (4, 401, 4, 512, "none"), (8, 200, 2, 2048, "full"),
                                                   (6, 200, 3, 128, "selective")])
def test_a_long_uniform_run_extended_by_its_period_is_the_run_simulated_whole(profiled_model, monkeypatch, pp, n,
                                                                             size, seq_len, rc):
    """1F1B over many micro-batches of one shape (the last may be smaller) is simulated for a few
    dozen and extended by its steady-state period: the same makespan and peaks as the whole run."""
    from megatron_dynapipe.planning import baselines
    from megatron_dynapipe.planning.baselines import uniform_microbatches
    from megatron_dynapipe.planning.cost_model import StageCosts

    costs = StageCosts(profiled_model, num_layers=48, pp=pp)
    microbatches = uniform_microbatches(n, size, seq_len)
    rc = RecomputeType.parse(rc)
    whole = baselines._simulate_whole(microbatches, costs, rc, 80_000)
    assert whole is not None  # fits
    simulated = []
    simulate_whole = baselines._simulate_whole
    monkeypatch.setattr(baselines, "_simulate_whole",
                        lambda mbs, *args: simulated.append(len(mbs)) or simulate_whole(mbs, *args))
    extended = baselines._simulate_uniform(microbatches, costs, rc, 80_000)
    assert max(simulated) < len(microbatches)  # extended, not simulated whole
    assert extended.makespan == pytest.approx(whole.makespan, rel=1e-9)
    np.testing.assert_array_equal(extended.peak_memory, whole.peak_memory)



class _UniformLayers(CostModel):
    """Every layer 1 ms forward and 2 ms backward per sequence, nothing else costs time, and
    transfers next to free (one value a token): the setting of Narayanan et al.'s (SC'21)
    closed form."""

    tp, hidden_size = 1, 1

    def layer_ms(self, layer, phase, recompute, mbs, seqlen):
        return (1.0 if layer == "encoder" else 0.0) * (2 if phase == "backward" else 1) * mbs

    def activation_mb(self, kind, recompute, mbs, seqlen):
        return 1.0 * mbs

    def param_mb(self, layer):
        return 1.0


@pytest.mark.parametrize("pp, chunks, sequences", [(4, 2, 8), (2, 2, 6), (4, 3, 12), (2, 4, 4)])
def test_megatrons_interleaved_baseline_runs_in_the_sc21_closed_form(pp, chunks, sequences):
    """Megatron's fixed shapes on ranks of several model chunks run its interleaved 1F1B: n
    micro-batches of one layer a chunk take (n V + pp - 1)(f + b) (Narayanan et al., SC'21),
    below 1F1B's (n + pp - 1) V (f + b) on the same ranks; the baseline picks one sequence a
    micro-batch, the size with the smallest bubble."""
    from megatron_dynapipe.planning.baselines import fixed_length_baseline, fixed_shape_run
    from megatron_dynapipe.planning.cost_model import StageCosts

    layers = pp * chunks
    virtual = StageCosts(_UniformLayers(), num_layers=layers, pp=layers)  # a row a virtual stage
    best = fixed_length_baseline(sequences, 16, virtual, 1e6, chunks=chunks)
    assert best.microbatch_size == 1
    assert best.makespan_ms == pytest.approx((sequences * chunks + pp - 1) * 3.0, rel=1e-6)
    plain = fixed_shape_run(StageCosts(_UniformLayers(), num_layers=layers, pp=pp), sequences, 1, 16, RecomputeType.NONE)
    assert plain.makespan == pytest.approx((sequences + pp - 1) * chunks * 3.0, rel=1e-6)


def test_an_interleaved_plans_yardstick_drops_the_chunks_where_megatrons_interleaved_1f1b_does_not_fit():
    """Given the ranks too, a plan's baseline is the faster of Megatron's interleaved 1F1B and
    its plain 1F1B that fits: with memory for 1F1B's two micro-batches in flight on the first of
    two ranks but not the interleaved warm-up's five chunk-forwards, the plain 1F1B one, in its
    closed form (n + pp - 1) V (f + b); with room for both, the interleaved one."""
    from megatron_dynapipe.planning.baselines import fixed_length_baseline, plan_baseline
    from megatron_dynapipe.planning.cost_model import StageCosts

    pp, chunks, sequences = 2, 2, 6
    virtual = StageCosts(_UniformLayers(), num_layers=pp * chunks, pp=pp * chunks)
    ranks = StageCosts(_UniformLayers(), num_layers=pp * chunks, pp=pp)
    lengths = [16] * sequences  # one sample a sequence of 16 tokens
    plain_peak = max(fixed_length_baseline(sequences, 16, ranks, 1e6).stage_peak_mb)
    interleaved_peak = max(fixed_length_baseline(sequences, 16, virtual, 1e6, chunks).stage_peak_mb)
    assert plain_peak < interleaved_peak
    tight = plan_baseline("pad", lengths, virtual, (plain_peak + interleaved_peak) / 2, 16, chunks, ranks)
    assert tight.method == "packing + 1f1b"
    assert tight.makespan_ms == pytest.approx((sequences + pp - 1) * chunks * 3.0, rel=1e-6)
    assert plan_baseline("pad", lengths, virtual, (plain_peak + interleaved_peak) / 2, 16, chunks) is None
    roomy = plan_baseline("pad", lengths, virtual, 1e6, 16, chunks, ranks)
    assert roomy.method == "packing + interleaved-1f1b"
    assert roomy.makespan_ms == pytest.approx((sequences * chunks + pp - 1) * 3.0, rel=1e-6)


# Megatron-LM's dp_balanced, each case worked by hand from its rule: next-fit in arrival order into
# packs of `capacity` tokens, then, until the count is a multiple of DP x group, the last sample of
# the last pack holding several becomes a pack of its own at the end; the first pack is never split.
@pytest.mark.parametrize("lengths, capacity, dp, group, packs", [
    # 3+3 | 3+5 | 1+1 | 9 (over capacity: alone) | 2 -> five packs, one more for DP 2: [4, 5] gives up 5
    ([3, 3, 3, 5, 1, 1, 9, 2], 8, 2, 1, [[0, 1], [2, 3], [4], [6], [7], [5]]),
    # three packs of four, PP 2's group: four packs, the last pack's last sample moves
    ([2] * 12, 8, 2, 2, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10], [11]]),
    # already a multiple: nothing moves
    ([4, 4, 4, 4], 8, 2, 1, [[0, 1], [2, 3]]),
    # 8 (alone) | 1+1+1+1 -> two packs; DP 4 takes two more, both from the last pack's end
    ([8, 1, 1, 1, 1], 4, 4, 1, [[0], [1, 2], [4], [3]]),
])
def test_dp_balanced_packs_as_megatron_lm_packs_them(lengths, capacity, dp, group, packs):
    from megatron_dynapipe.planning.baselines import dp_balanced_packs

    assert dp_balanced_packs(lengths, capacity, dp, group) == packs


def test_dp_balanced_refuses_a_batch_it_cannot_deal_out_as_megatron_lm_asserts():
    from megatron_dynapipe.planning.baselines import dp_balanced_packs

    # [0, 1] | [2, 3] | [4, 5] | [6] | [7]: three more packs for DP 4 x 2 would split the first
    with pytest.raises(ValueError, match="8 samples cannot make a multiple of 8 packs"):
        dp_balanced_packs([3, 3, 3, 5, 1, 1, 9, 2], 8, 4, 2)


def test_dp_balanced_deals_pack_i_dp_plus_r_to_rank_r_on_megatrons_schedule(costs_pp4):
    from megatron_dynapipe.planning.baselines import dp_balanced_rows
    from megatron_dynapipe.planning.cost_model import StageCosts

    lengths = [500, 700, 300, 900, 100, 1000, 600, 200, 400, 800]
    costs = StageCosts(costs_pp4.model, num_layers=32, pp=4, dp=2)
    found = dp_balanced_rows(lengths, 1024, costs, LIMIT, round_to=8)
    # next-fit: [500] [700, 300] [900, 100] [1000] [600, 200] [400] [800] -> 7 packs, an 8th from [600, 200]
    packs = [[0], [1, 2], [3, 4], [5], [6], [8], [9], [7]]
    assert [[mb.samples for mb in rows] for rows in found.per_rank] == [
        [tuple(p) for p in packs[0::2]], [tuple(p) for p in packs[1::2]]]
    row = found.per_rank[1][0]  # [700, 300]: one row of 1000 tokens, padded to 1000 (a multiple of 8)
    assert (row.seq_len, row.packed_lengths) == (1000, (700, 300))


def test_a_packed_row_runs_a_segment_a_sample_and_one_of_padding_beyond_its_cost_rows():
    # 3 + 5 tokens and 8 of padding in a row of 16: 3 segments, priced as 16^2 / (9 + 25 + 64) rows
    assert MicroBatch((0, 1), 16, (3, 5)).extra_segments == pytest.approx(3 - 256 / 98)
    assert MicroBatch((0, 1), 16, (8, 8)).extra_segments == pytest.approx(0.0)  # two rows of 8, no padding
    assert MicroBatch((0, 1), 16).extra_segments == 0.0  # padded rows run no segments


class _PerSegment(_UniformLayers):
    """_UniformLayers whose packed rows pay 0.5 ms forward and 0.25 ms backward a layer for every
    segment beyond their cost shape's rows."""

    def segment_ms(self, phase, recompute):
        return 0.5 if phase == "forward" else 0.25


def test_each_stage_pays_its_layers_cost_a_segment_and_the_simulator_counts_it():
    from megatron_dynapipe.planning.cost_model import StageCosts
    from megatron_dynapipe.planning.simulator import stage_work

    costs = StageCosts(_PerSegment(), num_layers=5, pp=2)  # 3 layers, then 2
    row = MicroBatch((0, 1, 2), 64, (30, 10, 10))  # 3 segments and 14 tokens of padding: 4 segments
    rows = 64 * 64 / (900 + 100 + 100 + 196)
    work = stage_work(costs, [row], np.zeros((2, 1), dtype=int))
    for stage, layers in enumerate((3, 2)):  # a layer: 1 ms forward, 2 backward, a row; the segments beyond
        assert work.forward[stage, 0] == pytest.approx(layers * (rows + 0.5 * (4 - rows)))
        assert work.backward[stage, 0] == pytest.approx(layers * (2 * rows + 0.25 * (4 - rows)))
    padded = stage_work(costs, [MicroBatch((0, 1), 32)], np.zeros((2, 1), dtype=int))
    assert padded.forward[:, 0].tolist() == [3 * 2, 2 * 2]  # no segments to pay


def test_a_profile_reads_a_segments_cost_from_its_packed_and_padded_rows():
    from megatron_dynapipe.planning.cost_model.profiled import packed_segment_costs

    key = ("encoder", "forward", RecomputeType.NONE)
    padded = {(32, 1): 1.0, (32, 2): 1.8, (32, 4): 3.4, (64, 2): 3.0}
    packed = {(32, 1): 1.0, (32, 2): 2.1, (32, 4): 4.3, (64, 2): 3.3}  # 0.3 ms a segment past the first
    assert packed_segment_costs({key: padded}, {key: packed}) == {("forward", RecomputeType.NONE): pytest.approx(0.3)}
    faster = {point: ms - 0.1 * (point[1] - 1) for point, ms in padded.items()}
    assert packed_segment_costs({key: padded}, {key: faster}) == {("forward", RecomputeType.NONE): 0.0}  # never < 0
    assert packed_segment_costs({key: padded}, {}) == {}
