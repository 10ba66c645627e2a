"""Recompute adjustment on the profiled GPT-6.7B (A100, PP 4, 36,000 MB)."""

import numpy as np
import pytest

from megatron_dynapipe.planning import fast_mode
from megatron_dynapipe.planning import recompute as recompute_module
from megatron_dynapipe.planning.fast_mode import FAST, NORMAL
from megatron_dynapipe.planning.recompute import adjust_rc_plan
from megatron_dynapipe.planning.schedules import DEFAULT_SCHEDULES
from megatron_dynapipe.planning.simulator import simulate, stage_work
from megatron_dynapipe.planning.types import Action, MicroBatch, Op, RecomputeType

F, B = Action.forward, Action.backward  # F(m, chunk=0): forward of micro-batch m

LIMIT = 36_000


def microbatches(count, size, seq_len):
    return [MicroBatch(tuple(range(size * i, size * (i + 1))), seq_len) for i in range(count)]


def none(count):
    return np.zeros((4, count), dtype=np.int64)


def check_fits_when_simulated_again(plan, mbs, costs, limit=LIMIT):
    again = simulate(plan.orders, stage_work(costs, mbs, plan.recompute))
    assert again.fits(limit) and again.makespan == pytest.approx(plan.simulation.makespan)


def test_only_stages_over_the_limit_are_raised(costs_pp4):
    mbs = microbatches(8, 1, 2048)
    plan = adjust_rc_plan(mbs, none(8), costs_pp4, "1f1b", LIMIT)
    check_fits_when_simulated_again(plan, mbs, costs_pp4)
    # The last stage holds one micro-batch in 1F1B and needs less recompute than the first.
    assert plan.recompute[3].sum() < plan.recompute[0].sum()


@pytest.mark.parametrize("schedule", DEFAULT_SCHEDULES)
def test_one_round_covers_every_op_over_the_limit(schedule, costs_pp4):
    # Twelve micro-batches of 2 x 1024 tokens: dozens of ops over the limit without recompute.
    mbs = microbatches(12, 2, 1024)
    plan = adjust_rc_plan(mbs, none(12), costs_pp4, schedule, LIMIT)
    check_fits_when_simulated_again(plan, mbs, costs_pp4)
    assert plan.rounds == 1 and (plan.recompute > 0).sum() > 12


def test_fast_mode_stops_after_its_rounds(costs_pp4, monkeypatch):
    mbs = microbatches(12, 2, 1024)
    assert adjust_rc_plan(mbs, none(12), costs_pp4, "1f1b", LIMIT, budget=FAST) is not None
    monkeypatch.setattr(fast_mode, "FAST_MODE_ROUNDS", 0)
    assert adjust_rc_plan(mbs, none(12), costs_pp4, "1f1b", LIMIT, budget=FAST) is None
    assert adjust_rc_plan(mbs, none(12), costs_pp4, "1f1b", LIMIT, budget=NORMAL) is not None


def test_recompute_is_raised_only_to_the_allowed_types(costs_pp4):
    mbs = microbatches(12, 2, 1024)
    anything = adjust_rc_plan(mbs, none(12), costs_pp4, "1f1b", LIMIT)
    assert RecomputeType.SELECTIVE in anything.recompute  # the first step up, where every type is allowed
    skipping = adjust_rc_plan(mbs, none(12), costs_pp4, "1f1b", LIMIT,
                              types=(RecomputeType.NONE, RecomputeType.FULL))
    check_fits_when_simulated_again(skipping, mbs, costs_pp4)
    assert set(np.unique(skipping.recompute)) <= {RecomputeType.NONE, RecomputeType.FULL}
    # no recompute at all: 1F1B's pp micro-batches in flight cannot fit
    assert adjust_rc_plan(mbs, none(12), costs_pp4, "1f1b", LIMIT, types=(RecomputeType.NONE,)) is None


def test_wait_free_cyclic_holds_fewer_where_recompute_cannot_lighten_enough(costs_pp4):
    # Twelve 4096-token micro-batches under 34,500 MB: the first stage (29,120 MB of model state)
    # has room for two of them in flight, fully recomputed (4,014 MB transient, 502 MB stored
    # each), not 1F1B's four (the last stage, whose loss keeps 836 MB more of each, for one);
    # wait-free-cyclic fills a stage only while memory lasts.
    mbs, limit = microbatches(12, 1, 4096), 34_500
    full = np.full((4, 12), int(RecomputeType.FULL))
    assert adjust_rc_plan(mbs, full, costs_pp4, "1f1b", limit) is None
    plan = adjust_rc_plan(mbs, none(12), costs_pp4, "wait-free-cyclic", limit)
    check_fits_when_simulated_again(plan, mbs, costs_pp4, limit)
    first_stage = plan.orders[0]
    in_flight = max(sum(1 if op.op is Op.FORWARD else -1 for op in first_stage[:i + 1]) for i in range(len(first_stage)))
    assert in_flight < 4


def test_a_plan_that_cannot_end_by_the_cutoff_is_dropped(costs_pp4):
    mbs = microbatches(12, 2, 1024)
    for schedule in DEFAULT_SCHEDULES:
        plan = adjust_rc_plan(mbs, none(12), costs_pp4, schedule, LIMIT)
        makespan = plan.simulation.makespan
        # a search's cutoff allows for rounding: its best makespan plus a billionth
        assert adjust_rc_plan(mbs, none(12), costs_pp4, schedule, LIMIT, give_up_above_ms=makespan * (1 + 1e-9))
        assert adjust_rc_plan(mbs, none(12), costs_pp4, schedule, LIMIT, give_up_above_ms=makespan * 0.999) is None


def test_gpipe_holds_every_microbatch_and_so_recomputes_more_than_1f1b(costs_pp4):
    # Eight 1024-token micro-batches: 1F1B's first stage holds four of them and fully recomputes
    # some; GPipe's stages hold all eight, so every stage recomputes at least as much.
    mbs = microbatches(8, 1, 1024)
    one_f_one_b = adjust_rc_plan(mbs, none(8), costs_pp4, "1f1b", LIMIT)
    gpipe = adjust_rc_plan(mbs, none(8), costs_pp4, "gpipe", LIMIT)
    check_fits_when_simulated_again(gpipe, mbs, costs_pp4)
    for plan, most in ((one_f_one_b, 4), (gpipe, 8)):
        first = plan.orders[0]
        assert max(sum(1 if op.op is Op.FORWARD else -1 for op in first[:i + 1]) for i in range(len(first))) == most
    assert np.all(gpipe.recompute.sum(axis=1) >= one_f_one_b.recompute.sum(axis=1))
    assert gpipe.recompute.sum() > one_f_one_b.recompute.sum()
    # heavier recompute, same micro-batches: a longer step
    assert gpipe.simulation.makespan > one_f_one_b.simulation.makespan


def test_an_interleaved_plan_is_raised_until_every_rank_holds_its_chunks_within_the_limit(profiled_model):
    from megatron_dynapipe.planning.cost_model import StageCosts

    # 4 ranks x 2 model chunks of 4 layers (virtual stages 0-7), 8 micro-batches of 2 x 2048
    # tokens. Without recompute the first rank, which warms up with 10 chunk-forwards, would hold
    # 120,858 MB; with everything recomputed in full, 33,596 MB.
    costs = StageCosts(profiled_model, num_layers=32, pp=8)
    mbs = microbatches(8, 2, 2048)
    nothing = np.zeros((8, 8), dtype=np.int64)
    plan = adjust_rc_plan(mbs, nothing, costs, "interleaved-1f1b", LIMIT, chunks=2)
    again = simulate(plan.orders, stage_work(costs, mbs, plan.recompute, chunks=2))
    assert again.fits(LIMIT) and again.makespan == pytest.approx(plan.simulation.makespan)
    assert (plan.recompute < int(RecomputeType.FULL)).any()  # only what the limit needs
    assert {op.chunk for order in plan.orders for op in order} == {0, 1}
    # below what full recompute everywhere needs, no interleaved plan fits
    assert adjust_rc_plan(mbs, nothing, costs, "interleaved-1f1b", 33_000, chunks=2) is None


def test_an_op_is_lightened_by_the_best_saving_per_millisecond_until_it_fits_or_nothing_saves_more():
    from megatron_dynapipe.planning.recompute import _RankMemory
    from megatron_dynapipe.planning.simulator import OrderIndex

    # One rank runs F0 F1 B0 B1. At B0 it holds micro-batch 0 (its own: 10 MB stored whatever its
    # recompute, so raising it saves nothing) and 1 (10, 7, 5 MB stored as none, selective, full);
    # backward 1, 2, 4 ms; no transient memory.
    order = OrderIndex.of([F(0), F(1), B(0), B(1)], n=2)
    stored, peak = np.array([[10.0, 10.0], [10.0, 7.0], [10.0, 5.0]]), np.zeros((3, 2))
    backward = np.array([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]])

    def rank():
        return _RankMemory(order, 0.0, stored, peak, backward, np.array([0, 0]), heavier=[1, 2, -1])

    fitted = rank()
    assert fitted.lighten(2, 17.0) == (1, True) and fitted.level == [0, 1]  # 20 -> 17
    assert list(fitted.in_use) == [0.0, 10.0, 17.0, 7.0]  # every op that holds micro-batch 1 lightened
    stuck = rank()
    assert stuck.lighten(2, 12.0) == (2, False) and stuck.level == [0, 2]  # 20 -> 17 -> 15
    assert list(stuck.in_use) == [0.0, 10.0, 15.0, 5.0]
    within = rank()
    assert within.lighten(2, 20.0) == (0, True) and within.level == [0, 0]


def test_a_round_stops_once_the_plans_bound_passes_the_cutoff(costs_pp4, monkeypatch):
    """Raising recompute only adds time: once the plan's lower bound has passed the cutoff, the
    rest of the round is not run, and the candidate is dropped as it was at the round's end."""
    from megatron_dynapipe.planning.simulator import WorkTable

    mbs = microbatches(12, 2, 1024)
    lightened = []
    lighten = recompute_module._RankMemory.lighten
    monkeypatch.setattr(recompute_module._RankMemory, "lighten",
                        lambda self, *args: lightened.append(1) or lighten(self, *args))
    monkeypatch.setattr(recompute_module, "BOUND_CHECK_OPS", 1)  # asked after 1, 2, 4, ... ops
    plan = adjust_rc_plan(mbs, none(12), costs_pp4, "1f1b", LIMIT)
    assert plan.rounds == 1
    whole_round = len(lightened)
    table = WorkTable(costs_pp4, mbs)
    before, after = table.makespan_lower_bound(none(12)), table.makespan_lower_bound(plan.recompute)
    assert before < after
    lightened.clear()
    assert adjust_rc_plan(mbs, none(12), costs_pp4, "1f1b", LIMIT, give_up_above_ms=(before + after) / 2) is None
    assert 0 < len(lightened) < whole_round
