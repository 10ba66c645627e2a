"""The event simulator and the schedules, checked against closed forms worked out by hand."""

import numpy as np
import pytest

from megatron_dynapipe.planning.schedules import one_f_one_b, wait_free_cyclic
from megatron_dynapipe.planning.simulator import ScheduleDeadlock, StageWork, simulate


def uniform_work(pp, n, f=1.0, b=2.0, stored=10.0, peak=1.0, state=100.0, comm=0.0):
    full = lambda v: np.full((pp, n), float(v))  # noqa: E731
    return StageWork(forward=full(f), backward=full(b), stored=full(stored), peak=full(peak),
                     state=np.full(pp, state), comm=np.full(n, comm))


@pytest.mark.parametrize("pp,n", [(1, 1), (1, 5), (2, 2), (2, 7), (4, 4), (4, 12), (8, 3)])
def test_1f1b_makespan_matches_the_textbook_formula(pp, n):
    # Uniform ops without communication: (n + pp - 1) * (f + b).
    work = uniform_work(pp, n, f=1.0, b=2.0)
    assert simulate(one_f_one_b(work, 1e9), work).makespan == pytest.approx((n + pp - 1) * 3.0)


def test_hand_worked_two_stage_timeline_with_communication():
    # pp=2, n=2, f=1, b=2, comm=0.5. Stage 0: F0 0-1, F1 1-2. Stage 1: F0 1.5-2.5, B0 2.5-4.5,
    # F1 4.5-5.5 (arrived 2.5), B1 5.5-7.5. Stage 0: B0 5-7 (grad at 4.5+0.5), B1 8-10.
    work = uniform_work(2, 2, comm=0.5)
    result = simulate(one_f_one_b(work, 1e9), work, record=True)
    assert result.makespan == pytest.approx(10.0)
    compute = {(e.stage, e.kind, e.microbatch): (e.start, e.end) for e in result.events if e.kind in "FB"}
    assert compute[(1, "F", 1)] == (4.5, 5.5)
    assert compute[(0, "B", 1)] == (8.0, 10.0)


@pytest.mark.parametrize("pp,n", [(2, 5), (4, 8), (4, 2)])
def test_1f1b_peak_memory_holds_pp_minus_stage_microbatches(pp, n):
    work = uniform_work(pp, n, stored=10.0, peak=1.0, state=100.0)
    peak = simulate(one_f_one_b(work, 1e9), work).peak_memory
    expected = [100.0 + 10.0 * min(pp - s, n) + 1.0 for s in range(pp)]
    # The last micro-batch admitted is still building its activations (peak, not stored)
    # when the stage holds min(pp - s, n) - 1 others; its backward then holds all of them.
    assert list(peak) == pytest.approx(expected)


def test_orders_that_wait_on_each_other_are_reported():
    work = uniform_work(2, 1)
    with pytest.raises(ScheduleDeadlock, match="wait on each other"):
        simulate([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]], work)


@pytest.mark.parametrize("pp,n", [(2, 6), (4, 10), (3, 1)])
def test_wait_free_cyclic_equals_1f1b_on_uniform_work_with_room(pp, n):
    work = uniform_work(pp, n)
    assert simulate(wait_free_cyclic(work, 1e9), work).makespan == pytest.approx((n + pp - 1) * 3.0)


def test_wait_free_cyclic_runs_ahead_only_while_memory_lasts():
    # A slow micro-batch 0 holds up backwards; with unlimited memory stage 0 runs ahead of
    # 1F1B's pp in flight, with room for exactly pp (state 100 + 4 x 10 + 1) it must not.
    pp, n = 4, 10
    work = uniform_work(pp, n)
    work.forward[:, 0], work.backward[:, 0] = 6.0, 12.0
    limit = 100.0 + pp * 10.0 + 1.0
    bounded = simulate(wait_free_cyclic(work, limit), work)
    assert bounded.peak_memory.max() <= limit
    unbounded = simulate(wait_free_cyclic(work, 1e9), work)
    assert unbounded.peak_memory[0] > limit  # it did run ahead when allowed to
    assert unbounded.makespan <= bounded.makespan


def test_wait_free_cyclic_fills_idle_time_with_variable_microbatches():
    # One long micro-batch among short ones: 1F1B stalls behind it, wait-free keeps admitting.
    pp, n = 4, 8
    work = uniform_work(pp, n)
    long = 6.0
    work.forward[:, 0], work.backward[:, 0] = long, 2 * long
    fixed = simulate(one_f_one_b(work, 1e9), work).makespan
    wait_free = simulate(wait_free_cyclic(work, 1e9), work).makespan
    assert wait_free < fixed
