"""The schedule contract (planning/schedules/base.py), checked on every registered schedule: a
schedule added to the registry is held to it by these tests without writing any."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dynapipe.planning.plan import build_execution_plans
from megatron_dynapipe.planning.planner import generate_execution_plan
from megatron_dynapipe.planning.schedules import (
    DEFAULT_SCHEDULES,
    SCHEDULES,
    FixedSchedule,
    fast_mode_schedule,
    fast_mode_schedules,
    get_schedule,
)
from megatron_dynapipe.planning.simulator import StageWork, simulate
from megatron_dynapipe.planning.spec import TrainingSpec
from megatron_dynapipe.planning.types import Action, MicroBatch, Op


def _work(data, pp, n):
    draw = lambda lo, hi, shape: np.array(data.draw(st.lists(  # noqa: E731
        st.floats(lo, hi), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))).reshape(shape)
    return StageWork(forward=draw(0.1, 5, (pp, n)), backward=draw(0.1, 10, (pp, n)), stored=draw(1, 50, (pp, n)),
                     peak=draw(0, 10, (pp, n)), state=draw(0, 100, (pp,)), comm=draw(0, 1, (n,)))


@pytest.mark.parametrize("name", list(SCHEDULES))
@settings(max_examples=30, deadline=None)
@given(pp=st.integers(1, 5), n=st.integers(1, 10), limit=st.floats(50, 1000), data=st.data())
def test_every_schedule_keeps_the_contract(name, pp, n, limit, data):
    schedule = SCHEDULES[name]
    work = _work(data, pp, n)
    result = schedule.simulate(work, limit)
    for order in result.orders:
        assert all(type(action) is Action and type(action.op) is Op for action in order)
        # FIFO-consistent: forwards and backwards each in entry order, each once
        assert [a.microbatch for a in order if a.op is Op.FORWARD] == list(range(n))
        assert [a.microbatch for a in order if a.op is Op.BACKWARD] == list(range(n))
    assert schedule.orders(work, limit) == result.orders
    if isinstance(schedule, FixedSchedule):
        assert result.orders == schedule.orders_for(pp, n)  # whatever the work costs
    # the timeline is that of the orders, and lowering proves them deadlock-free
    again = simulate(result.orders, work)
    assert again.makespan == pytest.approx(result.makespan)
    assert again.peak_memory == pytest.approx(result.peak_memory)
    microbatches = [MicroBatch((m,), 8) for m in range(n)]
    plans = build_execution_plans(result.orders, microbatches, "none", name, result.makespan, verify=True,
                                  timeline=(result.op_starts, result.op_ends))
    assert [p.schedule for p in plans] == [name] * pp


def test_the_worked_example_in_the_schedule_contract_is_what_1f1b_runs():
    from megatron_dynapipe.planning.schedules.base import Schedule

    zeros = np.zeros((2, 3))
    work = StageWork(forward=zeros + 1, backward=zeros + 2, stored=zeros, peak=zeros, state=np.zeros(2),
                     comm=np.zeros(3))
    ran = [["."] * 12 for _ in range(2)]
    for event in simulate(SCHEDULES["1f1b"].orders_for(2, 3), work, record=True).events:
        for t in range(int(event.start), int(event.end)):
            ran[event.stage][t] = f"{event.kind.letter}{event.microbatch}"
    drawn = [line.split()[2:] for line in Schedule.__doc__.splitlines() if line.strip().startswith("stage ")]
    assert drawn == ran


def test_the_registry_by_name_and_what_the_planner_searches():
    assert DEFAULT_SCHEDULES == ("1f1b", "wait-free-cyclic")  # gpipe only when asked for
    assert get_schedule("gpipe") is SCHEDULES["gpipe"] and get_schedule(SCHEDULES["1f1b"]) is SCHEDULES["1f1b"]
    with pytest.raises(ValueError, match="unknown schedule 'zb-h1': choose from 1f1b, wait-free-cyclic, gpipe, "
                                         "interleaved-1f1b$"):
        get_schedule("zb-h1")
    # fast mode searches one schedule: one that follows the timeline where allowed
    assert fast_mode_schedule(("1f1b", "wait-free-cyclic")) == "wait-free-cyclic"
    assert fast_mode_schedule(("gpipe", "1f1b")) == "gpipe"
    # ... and where the micro-batches never fill the pipeline (fewer than 2 a stage), 1F1B too
    assert fast_mode_schedules(DEFAULT_SCHEDULES, 31, 16) == ["wait-free-cyclic", "1f1b"]
    assert fast_mode_schedules(DEFAULT_SCHEDULES, 32, 16) == ["wait-free-cyclic"]
    assert fast_mode_schedules(("wait-free-cyclic",), 3, 16) == ["wait-free-cyclic"]
    assert fast_mode_schedules(("1f1b",), 3, 16) == ["1f1b"]
    assert TrainingSpec().schedules == DEFAULT_SCHEDULES


def test_only_an_interleaved_schedule_runs_several_model_chunks_a_rank():
    with pytest.raises(ValueError, match="schedule '1f1b' runs one model chunk a rank, not 2: use an interleaved"):
        SCHEDULES["1f1b"].orders_for(2, 4, chunks=2)
    ones = np.ones((4, 3))
    work = StageWork(forward=ones, backward=ones, stored=ones, peak=ones, state=np.ones(4), comm=np.ones(3), chunks=2)
    with pytest.raises(ValueError, match="wait-free-cyclic runs one model chunk a rank"):
        SCHEDULES["wait-free-cyclic"].simulate(work, 1e9)
    orders = SCHEDULES["interleaved-1f1b"].orders(work)
    mbs = [MicroBatch((m,), 8) for m in range(3)]
    for verify in (True, False):  # a schedule's own orders, trusted, are not lowered as chunk 0 either
        with pytest.raises(ValueError, match=r"stage 0 order item #3 .* runs model chunk 1: the stages hold 1 .*"
                                             r"pass chunks= for an interleaved pipeline"):
            build_execution_plans(orders, mbs, "none", "interleaved-1f1b", 1.0, verify=verify)
        plans = build_execution_plans(orders, mbs, "none", "interleaved-1f1b", 1.0, verify=verify, chunks=2)
        assert [p.chunks for p in plans] == [2, 2]


def test_the_planner_plans_with_a_schedule_asked_for_by_name(costs_pp4):
    lengths = [512, 300, 1024, 77, 900, 2048, 128, 640] * 2
    plans = {}
    for names in (("gpipe",), ("1f1b",)):
        result = generate_execution_plan(lengths, TrainingSpec(schedules=names, fast_mode=False), costs_pp4)
        assert {p.schedule for rank in result.plans for p in rank} == set(names)
        plans[names[0]] = result
    # GPipe holds every micro-batch at once: it recomputes at least as much as 1F1B to fit
    assert plans["gpipe"].choices[0].recompute.sum() >= plans["1f1b"].choices[0].recompute.sum()
