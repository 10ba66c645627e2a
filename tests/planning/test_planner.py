"""The planner end to end: properties over random batches, fast mode, clear errors."""

import dataclasses
import itertools
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatron_dynapipe.planning.baselines import lower_bound_ms
from megatron_dynapipe.planning.cost_model import AnalyticalCostModel, StageCosts
from megatron_dynapipe.planning.fast_mode import FAST, NORMAL
from megatron_dynapipe.planning.plan import ExecutionPlan, check_deadlock_free
from megatron_dynapipe.planning.planner import (
    PlanningError,
    adjust_rc_plan,
    build_candidates,
    generate_execution_plan,
    rank_costs,
)
from megatron_dynapipe.planning.samples import synthetic_lengths
from megatron_dynapipe.planning.schedules import DEFAULT_SCHEDULES
from megatron_dynapipe.planning.simulator import simulate, stage_work
from megatron_dynapipe.planning.spec import TrainingSpec
from megatron_dynapipe.planning.types import Op, RecomputeType

# A small GPT (hidden 1024, 8 layers) on a 16 GB device keeps each example fast while the
# memory limit still binds for long samples.
SMALL = AnalyticalCostModel(hidden_size=1024, num_heads=16, vocab_size=32000, device_memory_mb=16384)


def plan_and_check(lengths, spec, model=SMALL):
    result = generate_execution_plan(lengths, spec, model)
    placed = sorted(i for choice in result.choices for mb in choice.microbatches for i in mb.samples)
    assert placed == list(range(len(lengths))), "every sample is placed exactly once"
    for choice, plans in zip(result.choices, result.plans):
        assert len(plans) == spec.pp and {plan.chunks for plan in plans} == {spec.chunks}
        check_deadlock_free(plans)
        assert np.all(choice.simulation.peak_memory <= spec.memory_limit_mb + 1e-6)
        for mb in choice.microbatches:
            assert mb.seq_len >= max(lengths[i] for i in mb.samples)
        # The executed orders reproduce the predicted makespan when simulated from scratch.
        work = stage_work(result.costs, choice.microbatches, choice.recompute, spec.chunks)
        again = simulate(choice.orders, work)
        assert again.makespan == pytest.approx(choice.makespan_ms)
        bound = lower_bound_ms(result.costs, choice.microbatches, choice.recompute, chunks=spec.chunks)
        assert choice.makespan_ms >= bound * (1 - 1e-9)  # no plan beats the bound
        # every forward and backward of every micro-batch on every virtual stage, once
        ran = sorted((op.op.letter, op.chunk * spec.pp + s, op.microbatch) for s, order in enumerate(choice.orders)
                     for op in order)
        n = len(choice.microbatches)
        assert ran == sorted((phase, v, m) for phase in "BF" for v in range(spec.pp * spec.chunks) for m in range(n))
    return result


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=48),
    pp=st.integers(1, 4),
    dp=st.integers(1, 3),
    limit=st.sampled_from([6_000.0, 9_000.0, 16_000.0]),
    fast=st.booleans(),
)
def test_random_batches_plan_to_valid_deadlock_free_plans_within_memory(lengths, pp, dp, limit, fast):
    if len(lengths) < dp:
        lengths = lengths * dp
    spec = TrainingSpec(num_layers=8 - 8 % pp, pp=pp, dp=dp, memory_limit_mb=limit, fast_mode=fast)  # even stages
    plan_and_check(lengths, spec)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=48),
    pp=st.integers(2, 4),
    chunks=st.integers(2, 3),
    dp=st.integers(1, 2),
    limit=st.sampled_from([9_000.0, 16_000.0]),
    fast=st.booleans(),
)
def test_interleaved_batches_plan_to_valid_deadlock_free_plans_within_memory(lengths, pp, chunks, dp, limit, fast):
    if len(lengths) < dp:
        lengths = lengths * dp
    spec = TrainingSpec(num_layers=2 * pp * chunks, pp=pp, dp=dp, memory_limit_mb=limit, fast_mode=fast, chunks=chunks)
    assert spec.schedules == ("interleaved-1f1b",)
    plan_and_check(lengths, spec)


def test_an_interleaved_spec_is_one_megatron_lm_builds_and_its_costs_match_it():
    spec = TrainingSpec(num_layers=16, pp=4, chunks=2)
    assert spec.schedules == ("interleaved-1f1b",)  # the default schedules run one chunk a rank
    assert TrainingSpec.from_json(spec.to_json()) == spec
    for bad, message in ((dict(pp=1), "need pp >= 2"), (dict(num_layers=12), "do not split evenly into pp x chunks = 4 x 2 virtual"),
                         (dict(stage_layers=(4, 4, 4, 4)), "do not place 16 layers on 4 x 2 virtual pipeline stages"),
                         (dict(schedules=("1f1b",)), "schedule '1f1b' runs one model chunk a rank, not 2"),
                         (dict(chunks=0), "chunks must be a positive integer")):
        with pytest.raises(ValueError, match=re.escape(message)):
            TrainingSpec(**{**dict(num_layers=16, pp=4, chunks=2), **bad})
    # costs of the wrong layout are refused, not read as a plain pipeline of virtual stages
    with pytest.raises(PlanningError, match=r"price 4 pipeline stages, the spec has 4 x 2 virtual stages"):
        generate_execution_plan([100, 200], spec, StageCosts(SMALL, num_layers=16, pp=4))
    # micro-batches are sized for what a rank holds: each rank's model state is its two chunks'
    result = plan_and_check([3000, 100, 2000, 700] * 4, TrainingSpec(num_layers=16, pp=4, chunks=2,
                                                                     memory_limit_mb=16_000))
    plain = StageCosts(SMALL, num_layers=16, pp=4)
    for rank in range(4):
        assert (result.costs.model_state_mb(rank) + result.costs.model_state_mb(4 + rank)
                == pytest.approx(plain.model_state_mb(rank)))


def test_an_interleaved_batch_plans_where_its_costly_micro_batches_are_spread_and_names_fewer_chunks_where_not(
        profiled_model):
    # 256 long samples on GPT-6.7B, 4 ranks: a fifth of them 4096 tokens, each a micro-batch. Two
    # chunks a rank warm up with 11 chunk-forwards on the first rank, 5.5 ranks' worth; where the
    # costly micro-batches enter together (every order but the spread one) no recompute fits
    # 36,000 MB, so the batch plans only in the spread order
    lengths = synthetic_lengths(256, 0, "long")
    for fast in (False, True):
        plan = generate_execution_plan(lengths, TrainingSpec(num_layers=32, pp=4, chunks=2, fast_mode=fast),
                                       profiled_model)
        assert np.all(plan.peak_memory_mb <= 36_000 + 1)
    # a little less memory, and 1F1B still plans the batch where two chunks a rank cannot
    spec = TrainingSpec(num_layers=32, pp=4, memory_limit_mb=35_200)
    assert generate_execution_plan(lengths, spec, profiled_model).makespan_ms > 0
    with pytest.raises(PlanningError, match="or hold fewer than 2 model chunks a rank"):
        generate_execution_plan(lengths, dataclasses.replace(spec, chunks=2), profiled_model)


@settings(max_examples=50, deadline=None)
@given(costs=st.lists(st.floats(0, 100), min_size=0, max_size=30))
def test_the_spread_order_takes_the_costliest_and_the_cheapest_in_turn(costs):
    from megatron_dynapipe.planning.schedule_search import spread_order

    by_time = np.argsort(costs, kind="stable")
    order = spread_order(by_time)
    assert sorted(order) == list(range(len(costs)))
    costly, cheap = [costs[i] for i in order[0::2]], [costs[i] for i in order[1::2]]
    assert costly == sorted(costly, reverse=True) and cheap == sorted(cheap)
    assert not costly or not cheap or min(costly) >= max(cheap)
    # no run of consecutive micro-batches holds more than half of them (rounded up) from the costlier half
    costlier = set(by_time[::-1][:(len(costs) + 1) // 2].tolist())
    for width in range(1, len(costs) + 1):
        for start in range(len(costs) - width + 1):
            assert sum(i in costlier for i in order[start:start + width]) <= (width + 1) // 2


def test_micro_batches_sized_for_1f1b_are_offered_where_they_plan_faster_than_those_of_the_interleaved_fill(
        profiled_model):
    # 4096 multitask samples on GPT-6.7B, 4 ranks x 2 chunks, 36,000 MB: sized for the interleaved
    # pipeline's smaller fill, the micro-batches are larger, and the warm-up holds more of them:
    # they fit, but with more recompute than those sized as for 1F1B (as fast mode sizes packed plans)
    from megatron_dynapipe.planning.planner import _microbatchings, optimize_schedule

    lengths = synthetic_lengths(4096, 1, "multitask")
    spec = TrainingSpec(num_layers=32, pp=4, chunks=2)
    costs = StageCosts(profiled_model, num_layers=32, pp=8)
    offered = _microbatchings(lengths, range(len(lengths)), rank_costs(costs, spec), spec, NORMAL)
    interleaved_fill = [m for m in offered if "1F1B's fill" not in m.label]
    alone = optimize_schedule(interleaved_fill, costs, 36_000, schedules=spec.schedules, chunks=2)
    plan = generate_execution_plan(lengths, spec, profiled_model)
    assert {c.candidate.microbatching.split(", light start")[0] for c in plan.choices} == {"mixed, 1F1B's fill"}
    assert plan.makespan_ms < alone.makespan_ms and np.all(plan.peak_memory_mb <= 36_000 + 1)
    # fast mode offers padded plans both sizings too (SearchBudget.every_partition), and takes the same
    fast = generate_execution_plan(lengths, dataclasses.replace(spec, fast_mode=True), profiled_model)
    assert {c.candidate.microbatching.split(", light start")[0] for c in fast.choices} == {"mixed, 1F1B's fill"}


@pytest.mark.parametrize("fast", [False, True])
def test_same_input_and_seed_give_the_same_plan(fast):
    lengths = synthetic_lengths(40, seed=5)
    spec = TrainingSpec(num_layers=8, pp=4, dp=2, memory_limit_mb=9_000, fast_mode=fast, seed=3)
    first = generate_execution_plan(lengths, spec, SMALL)
    second = generate_execution_plan(lengths, spec, SMALL)
    for a, b in zip(first.plans, second.plans):
        assert [p.to_bytes() for p in a] == [p.to_bytes() for p in b]


def test_plans_round_trip_through_bytes(costs_pp4):
    result = plan_and_check(synthetic_lengths(32, seed=1), TrainingSpec(), costs_pp4)
    for plan in result.plans[0]:
        again = ExecutionPlan.from_bytes(plan.to_bytes())
        assert again.instructions == plan.instructions and again.microbatches == plan.microbatches


def test_profiled_plan_beats_packing_and_respects_the_limit(costs_pp4):
    from megatron_dynapipe.planning.baselines import packing_baseline

    lengths = synthetic_lengths(64, seed=0, mix="lognormal")
    result = plan_and_check(lengths, TrainingSpec(), costs_pp4)
    baseline = packing_baseline(lengths, costs_pp4, 36_000, 4096)
    assert result.makespan_ms < baseline.makespan_ms


def test_fast_mode_searches_wait_free_cyclic_over_each_partitions_light_start(costs_pp4):
    from megatron_dynapipe.planning.planner import _microbatchings
    from megatron_dynapipe.planning.schedule_search import microbatch_orders

    lengths = synthetic_lengths(64, 0, "lognormal")
    spec = TrainingSpec()
    normal = build_candidates(_microbatchings(lengths, range(64), costs_pp4, spec, NORMAL), costs_pp4, NORMAL)
    fast_options = _microbatchings(lengths, range(64), costs_pp4, spec, FAST)
    fast = build_candidates(fast_options, costs_pp4, FAST)
    assert {c.schedule for c in fast} == {"wait-free-cyclic"}
    assert {c.schedule for c in normal} == {"1f1b", "wait-free-cyclic"}
    # every partition (the mixed one and each uniform recompute's that fits: SearchBudget.every_partition),
    # each from the lightest recompute that fits alone, not also as sized
    assert {c.microbatching for c in fast} == {"mixed, light start", "selective, light start", "full, light start"}
    assert {c.microbatching for c in normal} >= {"mixed", "selective", "full"} | {c.microbatching for c in fast}
    for option in fast_options:
        # the orders normal mode would try
        tried = [c.order for c in fast if c.microbatching == option.label]
        assert tried == microbatch_orders(option, costs_pp4, 0, min(8, max(3, 1024 // len(option.microbatches))))
    assert len(fast) * 3 <= len(normal)


def test_orders_that_put_the_same_shapes_in_the_same_places_are_one_candidate(costs_pp4):
    """Equal samples have one order however they are permuted, and two kinds of micro-batch as many
    as there are distinct sequences of them to try: a candidate is priced once, not once a permutation."""
    from megatron_dynapipe.planning.schedule_search import Microbatching, microbatch_orders
    from megatron_dynapipe.planning.types import MicroBatch

    none = RecomputeType.NONE
    equal = Microbatching("equal", tuple(MicroBatch((i,), 512) for i in range(16)), (none,) * 16)
    assert len(microbatch_orders(equal, costs_pp4, 0, 8)) == 1
    assert len(build_candidates([equal], costs_pp4, FAST)) == 1
    two = Microbatching("two kinds", tuple(MicroBatch((i,), 512 * (1 + i % 2)) for i in range(16)), (none,) * 16)
    orders = microbatch_orders(two, costs_pp4, 0, 8)
    sequences = {tuple(two.microbatches[i].seq_len for i in order) for order in orders}
    assert len(orders) == len(sequences) == 8 and all(sorted(order) == list(range(16)) for order in orders)


def test_orders_tried_shrink_to_three_as_microbatches_multiply():
    from megatron_dynapipe.planning.schedule_search import orders_to_try

    # 8 orders while 8 simulations stay within 1024 micro-batches, never fewer than 3
    assert [orders_to_try(n, 8) for n in (1, 128, 129, 256, 341, 342, 100_000)] == [8, 8, 7, 4, 3, 3, 3]
    assert orders_to_try(10, 2) == 2  # a user's smaller cap wins


def test_fast_mode_from_the_environment(monkeypatch, costs_pp4):
    lengths = synthetic_lengths(24, seed=2)
    monkeypatch.setenv("DYNAPIPE_FAST_MODE", "TRUE")
    assert generate_execution_plan(lengths, TrainingSpec(), costs_pp4).fast_mode is True
    monkeypatch.setenv("DYNAPIPE_FAST_MODE", "false")
    assert generate_execution_plan(lengths, TrainingSpec(), costs_pp4).fast_mode is False
    # An explicit argument wins over the environment; "auto" is fast above 16 samples.
    assert generate_execution_plan(lengths, TrainingSpec(), costs_pp4, fast_mode=True).fast_mode is True
    assert generate_execution_plan(lengths, TrainingSpec(fast_mode="auto"), costs_pp4).fast_mode is True
    assert generate_execution_plan(lengths[:16], TrainingSpec(fast_mode="auto"), costs_pp4).fast_mode is False
    # and the plan says what was asked, where: the call, then the spec, then the environment
    budgets = [generate_execution_plan(lengths, spec, costs_pp4, fast_mode=call).budget for spec, call in (
        (TrainingSpec(fast_mode=True), False), (TrainingSpec(fast_mode="auto"), None), (TrainingSpec(), None))]
    assert [(b.fast, b.setting, b.source) for b in budgets] == [
        (False, False, "call"), (True, "auto", "TrainingSpec"), (False, False, "DYNAPIPE_FAST_MODE")]
    monkeypatch.delenv("DYNAPIPE_FAST_MODE")
    assert generate_execution_plan(lengths, TrainingSpec(), costs_pp4).budget.source == "default"
    monkeypatch.setenv("DYNAPIPE_FAST_MODE", "maybe")
    with pytest.raises(ValueError, match="DYNAPIPE_FAST_MODE='maybe'.*true, false or auto"):
        generate_execution_plan(lengths, TrainingSpec(), costs_pp4)


@pytest.mark.parametrize("fields, message", [
    (dict(num_layers=30, pp=4), "30 layers do not split evenly into pp = 4 pipeline stages"),
    (dict(num_layers=32.5), "num_layers must be a positive integer, got 32.5"),
    (dict(pp=True), "pp must be a positive integer, got True"),
    (dict(pp=4.0), "pp must be a positive integer, got 4.0"),
    (dict(dp="2"), "dp must be a positive integer, got '2'"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(fast_mode="yes"), 'fast_mode must be True, False, "auto" or None'),
    (dict(fast_mode=1), 'fast_mode must be True, False, "auto" or None'),
    (dict(memory_limit_mb="36000"), "memory_limit_mb must be a positive number of MB"),
    (dict(zero_stage=True), "zero_stage must be 0, 1, 2 or 3"),
    (dict(seed=-1), "seed must be an integer >= 0"),  # numpy's generators refuse it mid-search
])
def test_the_api_refuses_what_the_command_line_refuses(fields, message):
    """TrainingSpec takes integers where Megatron-LM's flags are integers (not bools, floats or
    strings, which would plan something else or fail later), and layers the stages split evenly."""
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainingSpec(**fields)
    assert TrainingSpec(num_layers=np.int64(32), pp=np.int64(4)).pp == 4  # numpy integers are integers
    assert TrainingSpec(schedules="gpipe").schedules == ("gpipe",)  # one schedule named alone, not its letters


def test_clear_errors(costs_pp4):
    with pytest.raises(PlanningError, match="holds no sample lengths"):
        generate_execution_plan([], TrainingSpec(), costs_pp4)
    # lengths are taken as `plan --lengths` takes them: whole numbers of tokens, not truncated floats or bools
    for bad in (2.5, 2.0, True, 0, -3, "7"):
        with pytest.raises(PlanningError, match=rf"not a list of integer lengths \(found {re.escape(repr(bad))}\): give "
                                                r"each sample's length as a whole number of tokens >= 1"):
            generate_execution_plan([100, bad], TrainingSpec(), costs_pp4)
    # a batch that is not a sequence of lengths: bytes read from a file, a string, a mapping, a number
    for bad in (b"\x64\x00", "100", {100: 1}, 100):
        with pytest.raises(PlanningError, match=f"is of type {type(bad).__name__}, not a list of lengths"):
            generate_execution_plan(bad, TrainingSpec(), costs_pp4)
    with pytest.raises(PlanningError, match="has a sample of 1,000,000,000,000,000,000,000,000,000,000 tokens, over "
                                            "the 2,147,483,647 a sample may hold"):
        generate_execution_plan([100, 10**30], TrainingSpec(), costs_pp4)  # once an OverflowError
    with pytest.raises(PlanningError, match=r"spec is a dict, not a TrainingSpec: pass TrainingSpec\(...\)"):
        generate_execution_plan([100], {"pp": 4}, costs_pp4)
    with pytest.raises(PlanningError, match="holds 1,048,577 samples: a global batch holds at most 1,048,576"):
        generate_execution_plan([100] * (2**20 + 1), TrainingSpec(), costs_pp4)  # refused before planning
    numpy_ints = generate_execution_plan(np.array([100, 300], dtype=np.int64), TrainingSpec(pp=4), costs_pp4)
    assert numpy_ints.makespan_ms == generate_execution_plan([100, 300], TrainingSpec(pp=4), costs_pp4).makespan_ms
    # the reference profile stops at 8192 tokens; at 8192 one sample needs more than 40 GB
    with pytest.raises(PlanningError, match="no times for a sample of 9000 tokens .* profile longer sequences"):
        generate_execution_plan([100, 9000], TrainingSpec(), costs_pp4)
    with pytest.raises(PlanningError, match="8192 tokens fits no micro-batch .* raise the memory limit"):
        generate_execution_plan([100, 8192], TrainingSpec(memory_limit_mb=40_000), costs_pp4)
    with pytest.raises(PlanningError, match="model state alone needs .* raise the memory limit"):
        generate_execution_plan([100], TrainingSpec(memory_limit_mb=20_000), costs_pp4)
    # an analytical model prices every length: where it has no time, the sample outgrows the device
    with pytest.raises(PlanningError, match="131072 tokens .* one layer's activations alone exceed the device's 16 "
                                            "GiB: add tensor or context parallelism, a fused attention core"):
        generate_execution_plan([100, 131072], TrainingSpec(memory_limit_mb=1e6), StageCosts(SMALL, num_layers=32, pp=4))


def test_a_sample_that_fits_alone_but_not_as_the_first_stages_micro_batches_in_flight_says_so():
    costs = StageCosts(SMALL, num_layers=32, pp=4)
    stages = np.arange(4)
    need = costs.by_recompute(np.array([1.0]), np.array([4096.0]), (RecomputeType.NONE,), stages)
    stored, peak = need["stored"].ravel(), need["peak"].ravel()
    state = np.array([costs.model_state_mb(s) for s in stages])
    limit = float(np.max(state + stored + peak)) + 1.0  # room for one on every stage
    assert state[0] + 4 * stored[0] + peak[0] > limit  # not for 1F1B's four on the first
    with pytest.raises(PlanningError, match=f"4096 tokens fits under {limit:.0f} MB alone, but not as the 4 "
                                            "micro-batches 1F1B's first stage holds at once with recompute none: "
                                            "split each micro-batch's activations"):
        generate_execution_plan([4096], TrainingSpec(pp=4, memory_limit_mb=limit, recompute_types=("none",)), costs)
    with pytest.raises(ValueError, match="unknown schedule"):
        TrainingSpec(schedules=("chimera",))
    with pytest.raises(ValueError, match="layers cannot fill"):
        TrainingSpec(num_layers=2, pp=4)


def test_uniform_and_token_based_partitions_plan(costs_pp4):
    lengths = synthetic_lengths(32, seed=4)
    plan_and_check(lengths, TrainingSpec(partition="uniform", microbatch_size=2), costs_pp4)
    plan_and_check(lengths, TrainingSpec(partition="token_based", tokens_per_microbatch=4096), costs_pp4)
    # Eight 2048-token samples per micro-batch cannot fit, whatever is recomputed.
    with pytest.raises(PlanningError, match="even with full recompute"):
        generate_execution_plan([2048] * 32, TrainingSpec(partition="uniform", microbatch_size=8), costs_pp4)


def _exhaustive(microbatchings, costs, limit, fast, schedules=DEFAULT_SCHEDULES, chunks=1):
    """The search without pruning: adjust and simulate every candidate in candidate order and
    keep the first of the lowest makespan."""
    best, budget = None, FAST if fast else NORMAL
    for candidate in build_candidates(microbatchings, costs, budget, schedules, chunks=chunks):
        recompute = np.tile(np.array(candidate.recompute, dtype=np.int64), (costs.pp, 1))
        fitted = adjust_rc_plan(candidate.microbatches, recompute, costs, candidate.schedule, limit, budget,
                                chunks=chunks)
        if fitted and (best is None or fitted.simulation.makespan < best[1].simulation.makespan):
            best = (candidate, fitted)
    return best


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1000), size=st.sampled_from([6, 24, 80]),
       mix=st.sampled_from(["multitask", "long"]), pp=st.sampled_from([2, 4]),
       limit=st.sampled_from([7_000.0, 9_000.0, 16_000.0]))
def test_pruned_search_chooses_what_simulating_every_candidate_chooses(seed, size, mix, pp, limit):
    from megatron_dynapipe.planning.planner import _microbatchings, optimize_schedule

    lengths = [min(n, 2048) for n in synthetic_lengths(size, seed, mix)]
    spec = TrainingSpec(num_layers=8, pp=pp, memory_limit_mb=limit)
    costs = StageCosts(SMALL, num_layers=8, pp=pp)
    microbatchings = _microbatchings(lengths, range(size), costs, spec, NORMAL)
    reference = _exhaustive(microbatchings, costs, limit, fast=False)
    choice = optimize_schedule(microbatchings, costs, limit)
    candidate, fitted = reference
    assert choice.candidate == candidate
    assert choice.makespan_ms == fitted.simulation.makespan
    assert np.array_equal(choice.recompute, fitted.recompute) and choice.orders == fitted.orders


@pytest.mark.parametrize("mix,size", [("lognormal", 64), ("long", 64), ("long", 256)])
def test_fast_mode_is_within_its_gap_of_its_own_exhaustive_search(mix, size, costs_pp4):
    from megatron_dynapipe.planning.planner import _microbatchings, optimize_schedule
    from megatron_dynapipe.planning.fast_mode import FAST_MODE_GAP

    lengths = synthetic_lengths(size, 0, mix)
    microbatchings = _microbatchings(lengths, range(size), costs_pp4, TrainingSpec(), FAST)
    _, fitted = _exhaustive(microbatchings, costs_pp4, 36_000, fast=True)
    choice = optimize_schedule(microbatchings, costs_pp4, 36_000, budget=FAST)
    # A candidate is skipped only when its lower bound exceeds (1 - gap) x the best found.
    assert fitted.simulation.makespan <= choice.makespan_ms <= fitted.simulation.makespan / (1 - FAST_MODE_GAP)


# Batches where the winner is not the candidate of the lowest bound (found by simulating all;
# in the first two it has no slack at all over its bound), so that pruning has to get its order
# and its ties right; and larger ones.
@pytest.mark.parametrize("profiled,limit,mix,size,seed", [
    (False, 7_000, "multitask", 6, 1), (True, 30_000, "lognormal", 6, 2), (True, 36_000, "multitask", 24, 1),
    (True, 36_000, "long", 80, 1), (True, 36_000, "long", 256, 0)])
def test_pruned_search_chooses_what_simulating_every_candidate_chooses_on_chosen_batches(
        profiled, limit, mix, size, seed, costs_pp4):
    from megatron_dynapipe.planning.planner import _microbatchings, optimize_schedule

    costs = costs_pp4 if profiled else StageCosts(SMALL, num_layers=8, pp=4)
    lengths = synthetic_lengths(size, seed, mix)
    spec = TrainingSpec(num_layers=costs.num_layers, memory_limit_mb=limit)
    microbatchings = _microbatchings(lengths, range(size), costs, spec, NORMAL)
    candidate, fitted = _exhaustive(microbatchings, costs, limit, fast=False)
    choice = optimize_schedule(microbatchings, costs, limit)
    assert (choice.candidate, choice.makespan_ms) == (candidate, fitted.simulation.makespan)


def test_a_jobs_fast_mode_setting_is_resolved_once_where_its_settings_are_read(monkeypatch):
    from megatron_dynapipe.planning.fast_mode import resolve_fast_mode_setting

    monkeypatch.delenv("DYNAPIPE_FAST_MODE", raising=False)
    assert resolve_fast_mode_setting(None) is False
    monkeypatch.setenv("DYNAPIPE_FAST_MODE", "true")
    assert resolve_fast_mode_setting(None) is True
    assert resolve_fast_mode_setting(False) is False  # an explicit setting wins over the environment
    assert resolve_fast_mode_setting("AUTO") == "auto" and resolve_fast_mode_setting("True") is True
    for word in ("sometimes", "yes", "1", "on"):  # only the words the flags show
        with pytest.raises(ValueError, match=f"'{word}' is not a fast mode: use true, false or auto"):
            resolve_fast_mode_setting(word)


def test_planning_says_where_its_time_went_and_leaves_the_collector_as_it_found_it(costs_pp4):
    import gc

    lengths = synthetic_lengths(64, 0, "long")
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            result = generate_execution_plan(lengths, TrainingSpec(), costs_pp4)
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
        assert set(result.phase_seconds) == {"micro-batching", "scheduling", "lowering"}
        assert all(t > 0 for t in result.phase_seconds.values())
        assert sum(result.phase_seconds.values()) <= result.planning_seconds


def test_fast_mode_runs_normal_modes_search_where_its_own_finds_nothing(costs_pp4, monkeypatch):
    from megatron_dynapipe.planning import fast_mode
    from megatron_dynapipe.planning.microbatching import PaddedRows
    from megatron_dynapipe.planning.planner import PhaseClock, _Batch, _search

    lengths = synthetic_lengths(64, 0, "lognormal")
    normal = generate_execution_plan(lengths, TrainingSpec(), costs_pp4, fast_mode=False)
    monkeypatch.setattr(fast_mode, "FAST_MODE_ROUNDS", 0)  # fast mode may raise no recompute at all
    with pytest.raises(PlanningError, match="even with full recompute"):
        rows = PaddedRows(costs_pp4, TrainingSpec().memory_limit_mb)
        _search(_Batch(np.asarray(lengths), costs_pp4, costs_pp4, rows, TrainingSpec(), FAST, PhaseClock()), range(64))
    fast = plan_and_check(lengths, TrainingSpec(fast_mode=True), costs_pp4)
    assert fast.fast_mode and fast.makespan_ms == normal.makespan_ms


def test_fast_mode_stops_a_dp_rank_at_a_plan_that_ends_by_an_earlier_ranks(costs_pp4):
    from megatron_dynapipe.planning.microbatching import split_across_dp
    from megatron_dynapipe.planning.planner import _microbatchings, optimize_schedule

    lengths = synthetic_lengths(128, 3, "multitask")  # 16 samples a rank: the order matters
    spec = TrainingSpec(dp=8, fast_mode=True)
    result = plan_and_check(lengths, spec, costs_pp4)
    ranks = split_across_dp(lengths, spec.dp, costs_pp4, spec.seqlen_round)
    searched = [optimize_schedule(_microbatchings(lengths, samples, costs_pp4, spec, FAST), costs_pp4,
                                  spec.memory_limit_mb, budget=FAST).makespan_ms for samples in ranks]
    # The step lasts as long as its slowest rank: stopping early never lengthens it.
    assert result.makespan_ms <= max(searched)
    chosen = [choice.makespan_ms for choice in result.choices]
    for rank, (took, best) in enumerate(zip(chosen, searched)):  # ranks are planned slowest predicted first
        assert took == best or took <= max(chosen[:rank] + chosen[rank + 1:])
    assert chosen != searched  # some rank stopped at a plan slower than its best


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=64),
       limit=st.sampled_from([5_000.0, 6_000.0, 7_000.0, 9_000.0]))
def test_fast_mode_plans_every_batch_normal_mode_plans(lengths, limit):
    spec = TrainingSpec(num_layers=8, pp=4, memory_limit_mb=limit)
    try:
        generate_execution_plan(lengths, spec, SMALL, fast_mode=False)
    except PlanningError:
        return
    plan_and_check(lengths, TrainingSpec(num_layers=8, pp=4, memory_limit_mb=limit, fast_mode=True))


def test_no_cliff_at_the_tightest_memory_limit(costs_pp4):
    # 1024 long samples: the tightest limit a plan exists for, found by bisection here, plans
    # within 5% of a limit 1,000 MB looser (1.8% here; a search that gave up adjusting early was 37% longer).
    lengths = synthetic_lengths(1024, 0, "long")

    def makespan(limit):
        try:
            return generate_execution_plan(lengths, TrainingSpec(memory_limit_mb=limit), costs_pp4).makespan_ms
        except PlanningError:
            return None

    infeasible, feasible = 30_000.0, 36_000.0
    assert makespan(infeasible) is None and makespan(feasible) is not None
    while feasible - infeasible > 20:
        middle = (infeasible + feasible) / 2
        infeasible, feasible = (infeasible, middle) if makespan(middle) else (middle, feasible)
    assert makespan(feasible) <= 1.05 * makespan(feasible + 1_000)


@pytest.mark.parametrize("num_sequences, seq_len, limit", [(64, 4096, 36_000), (37, 2048, 60_000), (300, 512, 40_000),
                                                           (300, 512, 80_000), (300, 2048, 40_000), (64, 4096, 1_000)])
def test_the_packing_baseline_is_the_fastest_size_and_recompute_that_fits(costs_pp4, num_sequences, seq_len, limit):
    """Its bounds skip simulations; its answer is still the best of simulating every choice."""
    from megatron_dynapipe.planning.baselines import fixed_length_baseline
    from megatron_dynapipe.planning.schedules import one_f_one_b_orders
    from megatron_dynapipe.planning.simulator import simulate, stage_work
    from megatron_dynapipe.planning.types import MicroBatch, RecomputeType

    found = []
    for mbs in (1, 2, 4, 8, 16, 32):
        if mbs > num_sequences and mbs > 1:
            break
        microbatches = [MicroBatch(tuple(range(i, min(i + mbs, num_sequences))), seq_len)
                        for i in range(0, num_sequences, mbs)]
        for rc in RecomputeType:
            work = stage_work(costs_pp4, microbatches, np.full((4, len(microbatches)), int(rc)))
            if not np.isfinite(work.forward + work.backward + work.peak).all():
                continue
            result = simulate(one_f_one_b_orders(4, len(microbatches)), work)
            if result.fits(limit):
                found.append((result.makespan, mbs, rc))
    baseline = fixed_length_baseline(num_sequences, seq_len, costs_pp4, limit)
    if not found:
        assert limit == 1_000 and baseline is None
        return
    makespan, mbs, rc = min(found)
    assert (baseline.microbatch_size, baseline.recompute) == (mbs, rc)
    assert baseline.makespan_ms == pytest.approx(makespan, rel=1e-12)  # long runs extended by their period


def test_uneven_stages_are_planned_with_the_layers_each_holds():
    lengths = synthetic_lengths(48, seed=1)
    even = plan_and_check(lengths, TrainingSpec(num_layers=8, pp=2, memory_limit_mb=16_000))
    uneven = plan_and_check(lengths, TrainingSpec(num_layers=8, pp=2, memory_limit_mb=16_000, stage_layers=(2, 6)))
    assert [uneven.costs.layers_on(s) for s in range(2)] == [2, 6]
    # stage 1 runs two layers more than an even split's, and stage 0 two fewer, per micro-batch
    size, seq = len(uneven.choices[0].microbatches[0].samples), uneven.choices[0].microbatches[0].seq_len
    layer = SMALL.layer_ms("encoder", "forward", "none", size, seq)
    for stage, more in ((0, -2), (1, 2)):
        assert (uneven.costs.forward_ms(stage, size, seq, "none")
                - even.costs.forward_ms(stage, size, seq, "none")) == pytest.approx(more * layer)
    for bad in ((4, 4, 0), (3, 4), (9, -1)):
        with pytest.raises(ValueError, match=r"do not place 8 layers on 2 pipeline stages"):
            TrainingSpec(num_layers=8, pp=2, stage_layers=bad)


def test_uneven_interleaved_stages_are_planned_with_the_layers_each_chunk_holds():
    # PP 2 x 2 chunks of 1, 3 (rank 0, rank 1: chunk 0) and 1, 3 (chunk 1): rank 1 holds 6 of 8 layers
    lengths = synthetic_lengths(48, seed=1)
    spec = TrainingSpec(num_layers=8, pp=2, chunks=2, memory_limit_mb=16_000, stage_layers=(1, 3, 1, 3))
    uneven = plan_and_check(lengths, spec)
    even = plan_and_check(lengths, dataclasses.replace(spec, stage_layers=None))
    assert [uneven.costs.layers_on(s) for s in range(4)] == [1, 3, 1, 3]
    assert [rank_costs(uneven.costs, spec).layers_on(s) for s in range(2)] == [2, 6]
    size, seq = len(uneven.choices[0].microbatches[0].samples), uneven.choices[0].microbatches[0].seq_len
    layer = SMALL.layer_ms("encoder", "forward", "none", size, seq)
    for stage, more in ((0, -1), (1, 1), (2, -1), (3, 1)):
        assert (uneven.costs.forward_ms(stage, size, seq, "none")
                - even.costs.forward_ms(stage, size, seq, "none")) == pytest.approx(more * layer)
    with pytest.raises(ValueError, match=r"do not place 8 layers on 2 x 2 virtual pipeline stages"):
        TrainingSpec(num_layers=8, pp=2, chunks=2, stage_layers=(2, 6))


@pytest.mark.parametrize("pp, chunks", [(2, 2), (4, 2), (4, 4), (3, 3)])
def test_a_warm_up_sizing_counts_what_an_interleaved_rank_holds(pp, chunks):
    """StageCosts.in_flight with warmup_chunks V: the most chunk-forwards each rank of the
    interleaved-1f1b order holds at once, counted in whole ranks (V chunk-forwards a rank)."""
    from megatron_dynapipe.planning.schedules import SCHEDULES

    orders = SCHEDULES["interleaved-1f1b"].orders_for(pp, 4 * pp, chunks)
    held = [max(itertools.accumulate(1 if op.op is Op.FORWARD else -1 for op in order)) for order in orders]
    sizing = StageCosts(SMALL, num_layers=4 * pp, pp=pp, warmup_chunks=chunks)
    np.testing.assert_allclose(sizing.in_flight(np.arange(pp)), np.array(held) / chunks)
    plain = StageCosts(SMALL, num_layers=4 * pp, pp=pp)  # 1F1B: pp - s
    one_chunk = SCHEDULES["1f1b"].orders_for(pp, 4 * pp)
    assert plain.in_flight(np.arange(pp)).tolist() == [
        max(itertools.accumulate(1 if op.op is Op.FORWARD else -1 for op in order)) for order in one_chunk]


def test_interleaved_micro_batches_are_sized_for_the_warm_up_where_those_sized_for_1f1b_fit_no_schedule():
    """The tiny GPT of the Megatron-LM test at PP 2 x 2 chunks of 1 and 2 layers, 3.75 MB: micro-batches
    sized for 1F1B's two in flight fit no interleaved schedule (its first rank's warm-up holds 2.5 ranks'
    worth); sized for the warm-up, they plan within the limit."""
    from megatron_dynapipe.planning.planner import _microbatchings, optimize_schedule, stage_costs

    tiny = AnalyticalCostModel(hidden_size=64, num_heads=4, vocab_size=128)
    lengths = np.random.default_rng(0).integers(8, 65, 16).tolist()
    spec = TrainingSpec(num_layers=6, pp=2, chunks=2, stage_layers=(1, 2, 1, 2), memory_limit_mb=3.75)
    costs = stage_costs(tiny, spec)
    for fast in (True, False):
        budget = FAST if fast else NORMAL
        as_for_1f1b = _microbatchings(np.array(lengths), list(range(16)), rank_costs(costs, spec), spec, budget)
        with pytest.raises(PlanningError, match="hold fewer than 2 model chunks a rank"):
            optimize_schedule(as_for_1f1b, costs, spec.memory_limit_mb, budget, spec.schedules, chunks=2)
        result = plan_and_check(lengths, dataclasses.replace(spec, fast_mode=fast), tiny)
        assert len(result.choices[0].microbatches) > len(as_for_1f1b[0].microbatches)  # smaller ones


def test_the_search_plans_an_interleaved_pipeline_within_the_limit(profiled_model):
    from megatron_dynapipe.planning.planner import _microbatchings, optimize_schedule

    # 4 ranks x 2 model chunks of the profiled GPT-6.7B: 8 virtual stages of 4 layers each
    costs = StageCosts(profiled_model, num_layers=32, pp=8)
    lengths = synthetic_lengths(64, 0, "multitask")
    spec = TrainingSpec(num_layers=32, pp=8)
    microbatchings = _microbatchings(lengths, range(64), costs, spec, NORMAL)
    with pytest.raises(ValueError, match="schedule '1f1b' runs one model chunk a rank, not 2"):
        optimize_schedule(microbatchings, costs, 36_000, chunks=2)
    choice = optimize_schedule(microbatchings, costs, 36_000, schedules=("interleaved-1f1b",), chunks=2)
    work = stage_work(costs, choice.microbatches, choice.recompute, chunks=2)
    again = simulate(choice.orders, work)
    assert again.fits(36_000) and again.makespan == pytest.approx(choice.makespan_ms)
    assert len(choice.orders) == 4 and {op.chunk for order in choice.orders for op in order} == {0, 1}
    # branch and bound, its bounds counting a rank's chunks, picks what simulating every candidate picks
    candidate, fitted = _exhaustive(microbatchings, costs, 36_000, False, ("interleaved-1f1b",), chunks=2)
    assert (choice.candidate, choice.makespan_ms) == (candidate, fitted.simulation.makespan)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(mix="long", samples=8, seq_length=1024, pp=4, chunks=2, dp=3, cp=2, limit=16_000.0, fast=True, seed=64526,
         documents="cut")  # THD's own windows are faster than any cut of the planner's here
@example(mix="lognormal", samples=95, seq_length=1024, pp=4, chunks=2, dp=3, cp=2, limit=9_000.0, fast=False,
         seed=22634, documents="cut")
@given(
    mix=st.sampled_from(["multitask", "lognormal", "long", "longtail"]),
    samples=st.integers(8, 96),
    seq_length=st.sampled_from([1024, 2048, 4096]),
    pp=st.integers(1, 4),
    chunks=st.integers(1, 2),
    dp=st.integers(1, 4),
    cp=st.integers(1, 2),
    limit=st.sampled_from([9_000.0, 16_000.0]),
    fast=st.booleans(),
    seed=st.integers(0, 2**16),
    documents=st.sampled_from(["whole", "cut"]),
)
def test_a_packed_plan_is_never_predicted_slower_than_megatrons_own_packings(mix, samples, seq_length, pp, chunks,
                                                                             dp, cp, limit, fast, seed, documents):
    """Megatron-LM's packings of the same samples are candidates of the planner, so its plan is
    never priced above them, nor refused where they fit: of whole samples, dp_balanced and THD
    rows; of the documents cut as Megatron's data path cuts them (found here token by token),
    THD packing's windows."""
    from megatron_dynapipe.planning.baselines import dp_balanced_rows, thd_packing_rows
    from megatron_dynapipe.planning.cost_model import split_over_cp
    from megatron_dynapipe.planning.microbatching import pack_fixed_length, round_up
    from megatron_dynapipe.planning.samples import scaled_lengths
    from project import stream_windows

    chunks = chunks if pp > 1 else 1
    multiple = 2 * cp if cp > 1 else 1
    lengths = scaled_lengths(samples, seed, mix, seq_length * (2 if documents == "cut" else 1))
    spec = TrainingSpec(num_layers=2 * pp * chunks, pp=pp, dp=dp, chunks=chunks, cp=cp, seqlen_round=8,
                        memory_limit_mb=limit, fast_mode=fast, packing="varlen", seq_length=seq_length,
                        documents=documents)
    costs = StageCosts(SMALL, num_layers=spec.num_layers, pp=pp * chunks, dp=dp)
    try:
        result = generate_execution_plan(lengths, spec, costs)
    except PlanningError:
        result = None
    # Megatron's packings priced here on the planner's own stage costs (one rank of the CP group)
    priced = result.costs if result else dataclasses.replace(costs, model=split_over_cp(SMALL, cp)).packed()
    theirs = []
    if documents == "cut":  # each window's pieces, each padded to whole ring chunks
        windows = stream_windows(lengths, seq_length)
        pieces = [-(-n // multiple) * multiple for window in windows for _, n in window]
        firsts = np.cumsum([0] + [len(w) for w in windows]).tolist()
        theirs.append(thd_packing_rows([list(range(a, b)) for a, b in zip(firsts[:-1], firsts[1:])], pieces,
                                       seq_length, priced, limit, chunks))
        if result is not None:  # and those pieces are what it planned
            planned = [n for choice in result.choices for mb in choice.microbatches for n in mb.packed_lengths]
            assert sorted(planned) == sorted(pieces)
    else:
        padded = round_up(lengths, multiple).tolist()
        try:
            theirs.append(dp_balanced_rows(padded, seq_length, priced, limit, chunks, 8))
        except ValueError:
            pass  # too few samples for Megatron-LM's dp_balanced too
        if max(padded) <= seq_length:
            theirs.append(thd_packing_rows(pack_fixed_length(padded, seq_length), padded, seq_length, priced, limit,
                                           chunks))
    fitting = [t.makespan_ms for t in theirs if t is not None]
    if result is None:
        assert not fitting, f"refused a batch Megatron's packing runs in {min(fitting):.1f} ms"
        return
    assert all(result.makespan_ms <= ms * (1 + 1e-9) for ms in fitting), (result.makespan_ms, fitting)


def test_packed_rows_balanced_by_cost_share_out_the_long_samples(monkeypatch):
    """Two long samples among many short ones: runs of the length-sorted samples (the dynamic
    programme's rows) put the two long ones in one row or leave one row with neither; dealt longest
    first in snake order, each of two rows takes one long sample and half the short ones, and no
    row of k holds more than one long sample's tokens beyond another's."""
    from megatron_dynapipe.planning import planner

    lengths = [1024, 1024] + [32] * 62
    spec = TrainingSpec(num_layers=8, pp=2, chunks=2, memory_limit_mb=60000, packing="varlen", seq_length=2048)
    costs = StageCosts(SMALL, num_layers=8, pp=4).packed()
    assert len(planner.balanced_rows(lengths, np.arange(64), costs, spec)) == planner.BALANCED_OFFERED
    monkeypatch.setattr(planner, "BALANCED_OFFERED", 99)  # every k, up to four rows a virtual stage
    offered = dict(planner.balanced_rows(lengths, np.arange(64), costs, spec))
    assert sorted(int(label.split()[0]) for label in offered) == list(range(1, 17))
    for label, rows in offered.items():
        assert len(rows) == int(label.split()[0]) and sorted(s for row in rows for s in row.samples) == list(range(64))
        tokens = [sum(row.packed_lengths) for row in rows]
        assert max(tokens) - min(tokens) <= 1024
    two = offered["2 rows balanced by cost"]
    assert [row.packed_lengths.count(1024) for row in two] == [1, 1] and [len(row.samples) for row in two] == [32, 32]


def test_rows_balanced_by_cost_make_a_packed_plan_no_slower_and_here_faster(monkeypatch):
    """The same batch planned with and without the balanced rows among the candidates: never
    slower with them (the search keeps the best it prices), and faster on a long-tail batch,
    whose long samples the dynamic programme's runs of sorted samples keep together."""
    from megatron_dynapipe.planning import planner
    from megatron_dynapipe.planning.samples import scaled_lengths

    lengths = scaled_lengths(64, 0, "longtail", 2048)
    spec = TrainingSpec(num_layers=8, pp=2, chunks=2, memory_limit_mb=16000, packing="varlen", seq_length=2048)
    costs = StageCosts(SMALL, num_layers=8, pp=4)
    with_them = generate_execution_plan(lengths, spec, costs).makespan_ms
    monkeypatch.setattr(planner, "balanced_rows", lambda *args: [])
    without = generate_execution_plan(lengths, spec, costs).makespan_ms
    assert with_them < without


def _one_row_profile(tmp_path):
    """A profile of one row of 64 or 128 tokens (1 ms forward and 2 backward a row of 64 in every
    layer): nothing measured beyond one row of 128 tokens."""
    from megatron_dynapipe.planning.cost_model import load_cost_model
    from megatron_dynapipe.planning.cost_model.profile_file import ProfileRecords, to_text

    records = ProfileRecords()
    for s in (64, 128):
        for layer in ("encoder", "postprocess", "preprocess"):
            for phase, ms in (("forward", 1.0), ("backward", 2.0)):
                records.times[(1, "none", layer, phase, s, 1)] = ms * s / 64
        for kind in ("stored", "peak"):
            records.memory[(1, "none", kind, s, 1)] = 1.0
    records.params.update({(1, "none", "encoder"): 2.0, (1, "none", "embedding"): 8.0})
    (tmp_path / "p.json").write_text(to_text({"name": "test", "hidden_size": 64, **records.records()}))
    return load_cost_model(tmp_path / "p.json", tp=1)


def test_a_batch_the_cost_model_cannot_price_is_refused_for_that_not_for_memory(tmp_path):
    """A sample of 125 tokens padded to a row of 128 is priced padded, but packed it is a row of
    1.05 equal segments (125 tokens and 3 of padding), between one row and two, and the profile
    has no two rows of 128: every micro-batching holds it, and the refusal says what to profile,
    where it said no schedule fits the memory."""
    model = _one_row_profile(tmp_path)
    spec = TrainingSpec(num_layers=2, pp=1, packing="varlen", memory_limit_mb=1000, recompute_types=("none",))
    with pytest.raises(ValueError, match=r"^the cost model has no times for micro-batches such as a packed row of "
                                         r"128 tokens holding 1 sample\(s\), under any recompute: profile larger "
                                         r"shapes \(megatron-dynapipe profile --max-tokens, --max-seq-length\)$"):
        generate_execution_plan([125], spec, model)
    assert generate_execution_plan([125], dataclasses.replace(spec, packing="pad"), model).makespan_ms > 0


def test_a_micro_batching_the_cost_model_cannot_run_is_priced_inf_without_a_pipeline_to_fill(tmp_path):
    """At PP 1 the fill term weighs nothing, also where a micro-batch is longer than the profile
    measured: 0 x inf was nan, which sorts anywhere (bench step at DP 2 then said no schedule fits)."""
    from megatron_dynapipe.planning.schedule_search import Microbatching, predicted_iterations_ms
    from megatron_dynapipe.planning.types import MicroBatch

    costs = StageCosts(_one_row_profile(tmp_path), num_layers=2, pp=1)
    none = RecomputeType.NONE
    fits, too_long = (Microbatching("fits", (MicroBatch((0,), 128),), (none,)),
                      Microbatching("too long", (MicroBatch((0,), 128), MicroBatch((1,), 512)), (none, none)))
    priced = predicted_iterations_ms(costs, [fits, too_long])
    # two layers of 2 + 4 ms, the embedding's and the head's 2 + 4 each, no fill at PP 1
    assert priced[0] == pytest.approx(4 * 6.0) and priced[1] == float("inf")


@pytest.mark.parametrize("chunks", [1, 2])
def test_micro_batchings_priced_in_one_query_each_cost_their_own_objective(chunks):
    """``predicted_iterations_ms`` prices several micro-batchings at once (the balanced rows' many
    dealings); each still gets its own objective: its micro-batches' bottleneck-stage forward +
    backward under each one's recompute, summed, plus (virtual stages - 1) / chunks times the
    largest, from the cost model's answers one by one."""
    from megatron_dynapipe.planning.schedule_search import Microbatching, predicted_iterations_ms
    from megatron_dynapipe.planning.types import MicroBatch

    costs = StageCosts(SMALL, num_layers=16, pp=4)
    none, full = RecomputeType.NONE, RecomputeType.FULL
    options = [Microbatching("a", (MicroBatch((0, 1), 512), MicroBatch((2,), 1024)), (none, full)),
               Microbatching("b", (MicroBatch((3,), 64),), (none,)),
               Microbatching("c", (MicroBatch((4, 5, 6), 256), MicroBatch((7,), 2048), MicroBatch((8,), 96)),
                             (full, none, none))]

    def alone(m):
        times = [max(float(costs.forward_ms(s, mb.size, mb.seq_len, rc) + costs.backward_ms(s, mb.size, mb.seq_len, rc))
                     for s in range(costs.pp)) for mb, rc in zip(m.microbatches, m.recompute)]
        return sum(times) + (costs.pp - 1) / chunks * max(times)

    assert predicted_iterations_ms(costs, options, chunks) == pytest.approx([alone(m) for m in options], rel=1e-9)
