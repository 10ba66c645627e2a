"""The event simulator and the schedules, checked against closed forms worked out by hand."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_dynapipe.planning.cost_model import CostModel, Link, StageCosts
from megatron_dynapipe.planning.schedules import SCHEDULES
from megatron_dynapipe.planning.simulator import (
    OrderIndex,
    ScheduleDeadlock,
    StageWork,
    WorkTable,
    makespan_bounds,
    over_limit,
    simulate,
)
from megatron_dynapipe.planning.types import Action, MicroBatch, Op

F, B = Action.forward, Action.backward  # F(m, chunk=0): forward of micro-batch m

one_f_one_b = SCHEDULES["1f1b"].orders
wait_free_cyclic = SCHEDULES["wait-free-cyclic"].orders


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
    compute = {(e.stage, e.kind, e.microbatch): (e.start, e.end) for e in result.events if e.kind.is_compute}
    assert compute[(1, Op.FORWARD, 1)] == (4.5, 5.5)
    assert compute[(0, Op.BACKWARD, 1)] == (8.0, 10.0)


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
        simulate([[B(0), F(0)], [F(0), B(0)]], work)


def test_an_op_kind_the_planner_does_not_run_fails_loudly_everywhere_an_order_is_read():
    """A weight-gradient step (W, as split-backward schedules have) is neither a forward nor a
    whole backward: a schedule that emits one, simulating such an order, indexing it and lowering
    it (checked or trusted) refuse it, where they would otherwise run it as a backward."""
    import enum

    from megatron_dynapipe.planning.plan import build_execution_plans
    from megatron_dynapipe.planning.schedules.base import FixedSchedule
    from megatron_dynapipe.planning.simulator import OrderIndex

    class SplitBackward(enum.IntEnum):
        WEIGHT = 12  # past every Op

    def split(m):
        return [F(m), Action(Op.BACKWARD, m), Action(SplitBackward.WEIGHT, m)]

    class SplitBackwardSchedule(FixedSchedule):
        name = "split-backward"

        def stage_order(self, stage, pp, n, chunks=1):
            return [a for m in range(n) for a in split(m)]

    refused = r"item #2 Action\(op=<SplitBackward.WEIGHT: 12>, microbatch=0, chunk=0\) is not an Action of Op.FORWARD"
    with pytest.raises(ValueError, match=refused):
        SplitBackwardSchedule().orders_for(1, 2)
    with pytest.raises(ValueError, match=refused):
        simulate([split(0)], uniform_work(1, 1))
    with pytest.raises(ValueError, match="W|WEIGHT|12"):
        OrderIndex.of(split(0), n=1)
    for verify in (True, False):
        with pytest.raises(ValueError, match=refused if verify else "stage 0 order"):
            build_execution_plans([split(0)], [MicroBatch((0,), 8)], "none", "1f1b", verify=verify)
    one = Action(1, 0)  # an int equal to Op.FORWARD is not an Op
    with pytest.raises(ValueError, match="is not an Action of Op.FORWARD"):
        simulate([[one, B(0)]], uniform_work(1, 1))


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


class _Scrambled(CostModel):
    """Times and memory drawn from a seeded hash of the query: monotone in nothing, not even in
    the recompute type, so a bound must not assume more recompute costs more."""

    tp, hidden_size = 1, 64

    def __init__(self, seed: int):
        self.seed = seed

    def _draw(self, key, mbs, seqlen):
        m, s = np.broadcast_arrays(np.asarray(mbs, dtype=float), np.asarray(seqlen, dtype=float))
        values = [0.1 + hash((self.seed, *key, a, b)) % 1000 / 100 for a, b in zip(m.ravel(), s.ravel())]
        return np.array(values).reshape(m.shape)

    def layer_ms(self, layer, phase, recompute, mbs, seqlen):
        return self._draw((layer, phase, int(recompute)), mbs, seqlen)

    def activation_mb(self, kind, recompute, mbs, seqlen):
        return self._draw((kind, int(recompute)), mbs, seqlen)

    def param_mb(self, layer):
        return 1.0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), pp=st.integers(1, 5), n=st.integers(1, 12), data=st.data())
def test_no_schedule_beats_the_work_table_lower_bound_whatever_recompute_is_raised_to(seed, pp, n, data):
    costs = StageCosts(_Scrambled(seed), num_layers=2 * pp, pp=pp, link=Link(bandwidth_GBps=0.05, latency_us=0.0))
    shapes = data.draw(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 64)), min_size=n, max_size=n))
    table = WorkTable(costs, [MicroBatch(tuple(range(size)), 8 * length) for size, length in shapes])
    start = np.array(data.draw(st.lists(st.integers(0, 2), min_size=pp * n, max_size=pp * n))).reshape(pp, n)
    raised = np.minimum(start + np.array(data.draw(
        st.lists(st.integers(0, 2), min_size=pp * n, max_size=pp * n))).reshape(pp, n), 2)
    bound = table.makespan_lower_bound(start)
    assert table.makespan_lower_bound(raised) >= bound  # raising recompute never lowers it
    for name in SCHEDULES:
        makespan = SCHEDULES[name].simulate(table.work(raised), 1e12).makespan
        assert makespan >= bound * (1 - 1e-12), name


def test_the_lower_bound_is_reached_by_one_stage_and_one_microbatch():
    # pp=1, n=1: the bound is the forward plus the backward, nothing else.
    costs = StageCosts(_Scrambled(7), num_layers=2, pp=1)
    table = WorkTable(costs, [MicroBatch((0,), 64)])
    work = table.work(np.zeros((1, 1), dtype=np.int64))
    floor_f = min(table.tables["forward"][:, 0, 0])
    floor_b = min(table.tables["backward"][:, 0, 0])
    assert table.makespan_lower_bound(np.zeros((1, 1), dtype=np.int64)) == pytest.approx(floor_f + floor_b)
    assert SCHEDULES["1f1b"].simulate(work, 1e12).makespan >= floor_f + floor_b


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_schedule_gives_up_only_when_its_makespan_passes_the_cutoff(name):
    # Uniform work without communication: 1F1B's textbook makespan, (n + pp - 1) * (f + b) = 33,
    # which wait-free-cyclic also reaches with room to spare.
    work = uniform_work(4, 8)
    full = SCHEDULES[name].simulate(work, 1e9)
    assert full.makespan == pytest.approx(33.0)
    assert SCHEDULES[name].simulate(work, 1e9, give_up_above_ms=33.0).makespan == full.makespan
    assert SCHEDULES[name].simulate(work, 1e9, give_up_above_ms=32.9) is None


def _random_work(data, pp, n, chunks=1):
    draw = lambda lo, hi, shape: np.array(data.draw(st.lists(  # noqa: E731
        st.floats(lo, hi), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))).reshape(shape)
    rows = pp * chunks
    return StageWork(forward=draw(0.1, 5, (rows, n)), backward=draw(0.1, 10, (rows, n)),
                     stored=draw(1, 50, (rows, n)), peak=draw(0, 10, (rows, n)), state=draw(0, 100, (rows,)),
                     comm=draw(0, 1, (n,)), chunks=chunks)


def _memory_replayed(orders, work):
    """Each op's memory in use, replayed from the orders on its own, as (rank, MB, position in the
    rank's order, the keys held, its own key): the model state of the rank's chunks, every (chunk,
    micro-batch) forwarded but not yet backwarded on that rank, and the op's transient. Micro-batch
    m of chunk c is key c * n + m, on the rank's row c * pp + s."""
    ops, pp, n = [], work.pp, work.n
    for s, order in enumerate(orders):
        state = sum(work.state[c * pp + s] for c in range(work.chunks))
        for i, op in enumerate(order):
            before = {(a.op, a.chunk, a.microbatch) for a in order[:i]}
            held = [(c, h) for k, c, h in before if k is Op.FORWARD and (Op.BACKWARD, c, h) not in before]
            transient = work.peak[op.chunk * pp + s][op.microbatch]
            used = state + sum(work.stored[c * pp + s][h] for c, h in held) + transient
            ops.append((s, used, i, {c * n + h for c, h in held}, op.chunk * n + op.microbatch))
    return ops


def _check_over_limit(result, work, limit):
    """The ops over the limit, as the simulation and over_limit list them, are those a replay of
    the orders finds; what each op holds is what OrderIndex says."""
    replayed = _memory_replayed(result.orders, work)
    expected = [op for op in replayed if op[1] > limit + 1e-6]
    for found in (result.over_limit, over_limit(result.orders, work, limit)):
        found = sorted(found, key=lambda op: op[0])  # stage by stage (the simulation lists them in time)
        assert [(s, i) for s, _, i in found] == [(s, i) for s, _, i, *_ in expected]
        assert [used for _, used, _ in found] == pytest.approx([used for _, used, *_ in expected])
    indexes = [OrderIndex.of(order, work.n, work.chunks) for order in result.orders]
    for s, _, i, held, own in replayed:
        assert set(indexes[s].held_at(i)) == held and indexes[s].key[i] == own
        firsts = [indexes[s].first[k] for k in indexes[s].held_at(i)]
        assert firsts == sorted(firsts)  # in the order their forwards ran
    return expected


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(1, 4), n=st.integers(1, 8), data=st.data())
def test_the_ops_over_the_limit_are_those_a_replay_of_the_orders_finds(pp, n, data):
    work = _random_work(data, pp, n)
    limit = data.draw(st.floats(0, 400))
    for name in SCHEDULES:
        result = SCHEDULES[name].simulate(work, limit)
        expected = _check_over_limit(result, work, limit)
        assert result.fits(limit) == (not expected)


@settings(max_examples=40, deadline=None)
@given(pp=st.integers(1, 4), n=st.integers(1, 8), data=st.data())
def test_wait_free_cyclic_with_strict_memory_never_passes_a_limit_every_microbatch_fits_alone(pp, n, data):
    work = _random_work(data, pp, n)
    alone = np.max(work.state[:, None] + work.stored + work.peak)  # the most any one micro-batch needs
    limit = alone + data.draw(st.floats(0, 200))
    strict = SCHEDULES["wait-free-cyclic"].simulate(work, limit, strict_memory=True)
    assert max(used for _, used, *_ in _memory_replayed(strict.orders, work)) <= limit + 1e-6
    assert strict.fits(limit) and not strict.over_limit


@pytest.mark.parametrize("pp", [2, 4, 16])
def test_a_big_microbatch_beside_a_tiny_one_is_bounded_by_its_round_trip(pp):
    # A tiny micro-batch (e each way) and a big one (F forward, B backward on every stage), no
    # transfer time, in either order. Nothing overlaps the big one's trip through every stage and
    # back, and stage 0 still runs the tiny one's forward before it or its backward after it:
    # e + pp (F + B), which 1F1B and wait-free-cyclic both take.
    e, F, B = 0.01, 3.0, 5.0
    for order in ([0, 1], [1, 0]):
        forward = np.tile([e, F], (pp, 1))[:, order]
        backward = np.tile([e, B], (pp, 1))[:, order]
        (bound,) = makespan_bounds(forward, backward, np.zeros(2), [[0, 1]])
        assert bound == pytest.approx(e + pp * (F + B))
        work = StageWork(forward=forward, backward=backward, stored=np.ones((pp, 2)), peak=np.zeros((pp, 2)),
                         state=np.zeros(pp), comm=np.zeros(2))
        for name in ("1f1b", "wait-free-cyclic"):
            assert SCHEDULES[name].simulate(work, 1e9).makespan == pytest.approx(bound)


def test_an_op_that_does_not_fit_bounds_every_order_at_inf_without_a_warning():
    """An op priced inf (a micro-batch that does not fit) makes every order's bound inf, in
    every position: a running sum less the op itself made it nan (and numpy warned), and a nan
    bound prunes nothing."""
    import warnings

    for where in range(3):
        forward = np.ones((2, 3))
        forward[1, where] = np.inf
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            bounds = makespan_bounds(forward, 2 * np.ones((2, 3)), np.zeros(3), [[0, 1, 2], [2, 1, 0], [1, 0, 2]])
        assert np.all(bounds == np.inf), where


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(1, 6), n=st.integers(1, 8), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_no_schedule_beats_the_bound_of_its_entry_order(pp, n, seed, data):
    work = _random_work(data, pp, n)
    order = np.random.default_rng(seed).permutation(n)
    reordered = StageWork(forward=work.forward[:, order], backward=work.backward[:, order], stored=work.stored[:, order],
                          peak=work.peak[:, order], state=work.state, comm=work.comm[order])
    (bound,) = makespan_bounds(work.forward, work.backward, work.comm, [order])
    for name in SCHEDULES:
        assert SCHEDULES[name].simulate(reordered, 1e12).makespan >= bound * (1 - 1e-12), name


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), pp=st.integers(1, 16), n=st.integers(1, 6))
def test_the_summary_bound_holds_for_any_order_and_is_the_longest_round_trip_on_deep_pipelines(seed, pp, n):
    from megatron_dynapipe.planning.baselines import lower_bound_ms

    costs = StageCosts(_Scrambled(seed), num_layers=2 * pp, pp=pp, link=Link(bandwidth_GBps=0.05, latency_us=0.0))
    microbatches = [MicroBatch(tuple(range(size)), 8 * size) for size in range(1, n + 1)]
    recompute = np.zeros((pp, n), dtype=np.int64)
    bound = lower_bound_ms(costs, microbatches, recompute)
    work = WorkTable(costs, microbatches).work(recompute)
    for order in (range(n), range(n - 1, -1, -1)):
        cols = list(order)
        reordered = StageWork(forward=work.forward[:, cols], backward=work.backward[:, cols],
                              stored=work.stored[:, cols], peak=work.peak[:, cols], state=work.state,
                              comm=work.comm[cols])
        for name in SCHEDULES:
            assert SCHEDULES[name].simulate(reordered, 1e12).makespan >= bound * (1 - 1e-12)
    # micro-batch j forward through every stage, a transfer between each pair, and back
    trips = [sum(work.forward[s, j] + work.backward[s, j] for s in range(pp)) + 2 * (pp - 1) * work.comm[j]
             for j in range(n)]
    assert bound >= max(trips) * (1 - 1e-12)
    if n == 1:  # one micro-batch: its round trip is the whole makespan, and the bound
        assert bound == pytest.approx(trips[0])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), pp=st.integers(1, 8), counts=st.lists(st.integers(1, 40), min_size=1, max_size=3))
def test_a_bound_of_counted_micro_batches_is_the_bound_of_the_run_written_out(seed, pp, counts):
    """What the packing baseline bounds its long uniform runs with: each distinct micro-batch and
    how often it runs, in place of tens of thousands of copies."""
    from megatron_dynapipe.planning.baselines import lower_bound_ms

    costs = StageCosts(_Scrambled(seed), num_layers=2 * pp, pp=pp, link=Link(bandwidth_GBps=0.05, latency_us=0.0))
    distinct = [MicroBatch(tuple(range(size)), 8 * size) for size in range(1, len(counts) + 1)]
    written_out = [mb for mb, count in zip(distinct, counts) for _ in range(count)]
    counted = lower_bound_ms(costs, distinct, np.zeros((pp, len(distinct)), dtype=np.int64), counts)
    whole = lower_bound_ms(costs, written_out, np.zeros((pp, len(written_out)), dtype=np.int64))
    assert counted == pytest.approx(whole, rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), pp=st.integers(1, 12), n=st.integers(0, 9), k=st.integers(0, 5))
def test_the_bounds_of_several_orders_at_once_are_each_orders_bound_alone(seed, pp, n, k):
    rng = np.random.default_rng(seed)
    forward, backward, comm = rng.uniform(0.1, 5, (pp, n)), rng.uniform(0.1, 9, (pp, n)), rng.uniform(0, 1, n)
    orders = [tuple(rng.permutation(n).tolist()) for _ in range(k)] + [range(n)]
    together = makespan_bounds(forward, backward, comm, orders)
    assert together.shape == (k + 1,)
    for order, bound in zip(orders, together):
        assert bound == makespan_bounds(forward, backward, comm, [order])[0]
    assert makespan_bounds(forward, backward, comm, []).shape == (0,)


# Interleaved pipelines: each rank runs `chunks` model chunks; chunk c of rank r is virtual stage c * pp + r.
interleaved = SCHEDULES["interleaved-1f1b"].orders


def chunked_work(pp, chunks, n, f=1.0, b=2.0, stored=10.0, peak=1.0, state=100.0, comm=0.0):
    """Uniform work of `chunks` model chunks a rank, each op of a chunk f / b ms; a rank's model
    state `state` in all."""
    full = lambda v: np.full((pp * chunks, n), float(v))  # noqa: E731
    return StageWork(forward=full(f), backward=full(b), stored=full(stored), peak=full(peak),
                     state=np.full(pp * chunks, state / chunks), comm=np.full(n, comm), chunks=chunks)


@pytest.mark.parametrize("pp,chunks,n",
                         [(2, 2, 2), (2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 12), (4, 4, 16), (8, 2, 16)])
def test_interleaved_1f1b_makespan_matches_the_papers_formula(pp, chunks, n):
    # Narayanan et al. (SC'21), uniform chunks without communication, pp dividing n: the bubble
    # is 1F1B's (pp - 1)(f + b) with f and b a chunk's ops, so (n V + pp - 1)(f + b) in all.
    work = chunked_work(pp, chunks, n, f=1.0, b=2.0)
    assert simulate(interleaved(work, 1e9), work).makespan == pytest.approx((n * chunks + pp - 1) * 3.0)


def test_hand_worked_interleaved_orders_and_memory_on_two_ranks():
    # pp 2, 2 chunks, 4 micro-batches. The table: group {0, 1} through chunk 0 then chunk 1, then
    # group {2, 3}. Rank 0 warms up with 2 (pp - 1) + (chunks - 1) pp = 4 forwards, rank 1 with 2;
    # backwards take each group's chunks last to first.
    work = chunked_work(2, 2, 4, stored=10.0, peak=1.0, state=100.0)
    orders = [[str(op) for op in order] for order in interleaved(work, 1e9)]
    assert orders[0] == ["F0", "F1", "F0.1", "F1.1", "F2", "B0.1", "F3", "B1.1", "F2.1", "B0", "F3.1", "B1",
                         "B2.1", "B3.1", "B2", "B3"]
    assert orders[1] == ["F0", "F1", "F0.1", "B0.1", "F1.1", "B1.1", "F2", "B0", "F3", "B1", "F2.1", "B2.1",
                         "F3.1", "B3.1", "B2", "B3"]
    # a rank holds its warm-up forwards and one more when its first backward runs
    assert list(simulate(interleaved(work, 1e9), work).peak_memory) == [100 + 5 * 10 + 1, 100 + 3 * 10 + 1]


def test_a_chunk_needs_the_last_rank_s_previous_chunk():
    # One micro-batch on two ranks, two chunks: F.0 on ranks 0, 1, then F.1 on ranks 0, 1 (rank 0's
    # second chunk waits for rank 1's first), then the backwards the other way round: 8 ops in a row.
    work = chunked_work(2, 2, 1, f=1.0, b=2.0, comm=0.5)
    result = simulate(interleaved(work, 1e9), work, record=True)
    assert result.makespan == pytest.approx(4 * 1.0 + 4 * 2.0 + 6 * 0.5)  # three hops each way
    compute = {(e.stage, e.kind, e.chunk): (e.start, e.end) for e in result.events if e.kind.is_compute}
    assert compute[(0, Op.FORWARD, 1)] == pytest.approx((3.0, 4.0))  # rank 1's F.0 ended at 2.5, sent by 3.0
    assert compute[(1, Op.BACKWARD, 1)] == pytest.approx((5.5, 7.5))  # its own forward ended at 5.5


def test_interleaved_1f1b_runs_any_number_of_micro_batches_without_its_chunks_waiting_on_each_other():
    # Megatron-LM refuses a last group of fewer than pp micro-batches: with groups of pp, four
    # ranks and three chunks could not run 5 micro-batches. The groups grow instead.
    from megatron_dynapipe.planning.schedules.interleaved import group_sizes

    # the fewest a group, at least pp, that leave no last group below pp
    assert (group_sizes(4, 8), group_sizes(4, 5), group_sizes(2, 7), group_sizes(4, 9)) == ([4, 4], [5], [4, 3], [5, 4])
    for pp in range(1, 7):
        for chunks in range(1, 5):
            for n in range(1, 25):
                groups = group_sizes(pp, n)
                assert sum(groups) == n and (n <= pp or min(groups) >= pp), (pp, n, groups)
                work = chunked_work(pp, chunks, n)
                simulate(interleaved(work, 1e9), work)  # raises ScheduleDeadlock if they wait on each other


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(1, 4), chunks=st.integers(1, 3), n=st.integers(1, 9), data=st.data())
def test_interleaved_orders_run_each_chunk_once_in_entry_order_and_memory_replays(pp, chunks, n, data):
    work = _random_work(data, pp, n, chunks)
    limit = data.draw(st.floats(0, 600))
    result = SCHEDULES["interleaved-1f1b"].simulate(work, limit)  # no deadlock: it ran
    for order in result.orders:
        for c in range(chunks):
            for kind in (Op.FORWARD, Op.BACKWARD):
                assert [op.microbatch for op in order if (op.op, op.chunk) == (kind, c)] == list(range(n))
    # what a rank holds is what its order says, whatever the timing
    _check_over_limit(result, work, limit)
    assert list(result.peak_memory) == pytest.approx(
        [max(used for s, used, *_ in _memory_replayed(result.orders, work) if s == rank) for rank in range(pp)])
    # no schedule beats the bound, the chunks of a rank sharing its compute stream
    (bound,) = makespan_bounds(work.forward, work.backward, work.comm, [range(n)], chunks)
    assert result.makespan >= bound * (1 - 1e-12)
    busy = (work.forward + work.backward).reshape(chunks, pp, n).sum(axis=(0, 2))
    assert result.makespan >= busy.max() * (1 - 1e-12) and bound >= busy.max() * (1 - 1e-12)
