"""Execution plans: lowering, wire format, structure checks and the deadlock check."""

from __future__ import annotations

import random
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_dynapipe.planning.plan import (
    CommMismatchError,
    DeadlockError,
    ExecutionPlan,
    Instruction,
    Op,
    build_execution_plans,
    check_deadlock_free,
    lower_to_instructions,
)
from megatron_dynapipe.planning.schedules import SCHEDULES
from megatron_dynapipe.planning.simulator import StageWork, simulate
from megatron_dynapipe.planning.types import Action, MicroBatch, RecomputeType

F, B = Action.forward, Action.backward  # F(m, chunk=0): forward of micro-batch m

NONE, SEL, FULL = RecomputeType.NONE, RecomputeType.SELECTIVE, RecomputeType.FULL


# -- order helpers (test-only) ---------------------------------------------------------------


def one_f_one_b(pp: int, n: int) -> list[list[Action]]:
    """Classic 1F1B: min(pp - s - 1, n) warm-up forwards, steady 1F1B, cool-down backwards."""
    orders = []
    for s in range(pp):
        warmup = min(pp - s - 1, n)
        order = [F(m) for m in range(warmup)]
        for m in range(warmup, n):
            order += [F(m), B(m - warmup)]
        order += [B(m) for m in range(n - warmup, n)]
        orders.append(order)
    return orders


def gpipe(pp: int, n: int) -> list[list[Action]]:
    return [[F(m) for m in range(n)] + [B(m) for m in range(n)] for _ in range(pp)]


def random_fifo_orders(pp: int, n: int, rng: random.Random) -> list[list[Action]]:
    """Random executable orders in which every stage forwards in one common order and runs the
    backwards in another: play the pipeline, each step running a random runnable op."""
    f_order = rng.sample(range(n), n)
    b_order = rng.sample(range(n), n)
    fi, bi = [0] * pp, [0] * pp  # how far each stage is in f_order / b_order
    done_f: list[set[int]] = [set() for _ in range(pp)]
    orders: list[list[Action]] = [[] for _ in range(pp)]
    for _ in range(2 * pp * n):
        runnable = []
        for s in range(pp):
            if fi[s] < n and (s == 0 or fi[s - 1] > fi[s]):
                runnable.append((s, F))
            if bi[s] < n and b_order[bi[s]] in done_f[s] and (s == pp - 1 or bi[s + 1] > bi[s]):
                runnable.append((s, B))
        s, kind = rng.choice(runnable)
        if kind is F:
            m = f_order[fi[s]]
            fi[s] += 1
            done_f[s].add(m)
        else:
            m = b_order[bi[s]]
            bi[s] += 1
        orders[s].append(kind(m))
    return orders


def microbatches(n: int, seq_len: int = 128) -> list[MicroBatch]:
    return [MicroBatch((2 * m, 2 * m + 1), seq_len) for m in range(n)]


def plans_from(instruction_lists, n: int, rc=NONE) -> list[ExecutionPlan]:
    pp = len(instruction_lists)
    return [ExecutionPlan(s, pp, "test", microbatches(n), [rc] * n, list(instrs))
            for s, instrs in enumerate(instruction_lists)]


def finish_sends_before_the_compute_op_after_next(instrs: list[Instruction]) -> list[Instruction]:
    """Move every send FINISH to the second compute op after its START (ahead of that op's
    input: its LOAD_INPUT / RECV_*_FINISH), or to the end where fewer follow."""
    out: list[Instruction] = []
    pending: list[list] = []  # [finish, compute ops passed since its START]
    moved = [i for i in instrs if i.op not in (Op.SEND_ACT_FINISH, Op.SEND_GRAD_FINISH)]
    for ins in moved:
        if ins.op.is_compute:
            k = len(out)
            while k and out[k - 1].op in (Op.LOAD_INPUT, Op.RECV_ACT_FINISH, Op.RECV_GRAD_FINISH):
                k -= 1
            out[k:k] = [finish for finish, passed in pending if passed]
            pending = [[finish, passed + 1] for finish, passed in pending if not passed]
        out.append(ins)
        if ins.op in (Op.SEND_ACT_START, Op.SEND_GRAD_START):
            pending.append([Instruction(ins.op.finish, ins.microbatch, ins.peer), 0])
    return out + [finish for finish, _ in pending]


def names(instrs) -> list[str]:
    return [str(i) for i in instrs]


# -- Instruction -----------------------------------------------------------------------------


def test_instruction_str_is_compact():
    assert str(Instruction(Op.FORWARD, 3, recompute=FULL)) == "F3[full]"
    assert str(Instruction(Op.BACKWARD, 3, recompute=SEL)) == "B3[selective]"
    assert str(Instruction(Op.FORWARD, 0)) == "F0"
    assert str(Instruction(Op.SEND_ACT_START, 3, 2)) == "SendActStart(3->s2)"
    assert str(Instruction(Op.RECV_GRAD_FINISH, 1, 4)) == "RecvGradFinish(1<-s4)"
    assert str(Instruction(Op.LOAD_INPUT, 7)) == "Load7"
    assert str(Instruction(Op.FREE_BUFFER, 7)) == "Free7"
    assert Op.SEND_ACT_START.finish == Op.SEND_ACT_FINISH and Op.RECV_GRAD_FINISH.start == Op.RECV_GRAD_START


def test_plan_module_imports_neither_torch_nor_megatron():
    code = ("import sys, megatron_dynapipe.planning.plan; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- lowering --------------------------------------------------------------------------------


def test_lowering_two_stage_1f1b_by_hand():
    orders = one_f_one_b(2, 2)
    assert orders == [[F(0), F(1), B(0), B(1)], [F(0), B(0), F(1), B(1)]]
    plans = build_execution_plans(orders, microbatches(2), [FULL, NONE], "1f1b")
    assert names(plans[0].instructions) == [
        "Load0", "F0[full]",
        "SendActStart(0->s1)", "RecvGradStart(0<-s1)",  # receive for B0 posted one op ahead, before F1
        "Load1", "F1",  # the send runs beside the next compute op ...
        "SendActStart(1->s1)", "RecvGradStart(1<-s1)",
        "SendActFinish(0->s1)",  # ... and finishes before the one after
        "RecvGradFinish(0<-s1)", "B0[full]",
        "Free0",
        "SendActFinish(1->s1)", "RecvGradFinish(1<-s1)", "B1",
        "Free1",
    ]
    assert names(plans[1].instructions) == [
        "RecvActStart(0<-s0)", "RecvActFinish(0<-s0)", "F0[full]",
        "RecvActStart(1<-s0)",  # one op ahead of F1, i.e. before B0
        "B0[full]", "SendGradStart(0->s0)", "Free0",
        "RecvActFinish(1<-s0)", "F1",
        "SendGradFinish(0->s0)", "B1", "SendGradStart(1->s0)", "Free1",
        "SendGradFinish(1->s0)",  # nothing follows: finished at the end
    ]
    for s in range(2):
        assert lower_to_instructions(orders[s], s, 2, [FULL, NONE], orders=orders) == plans[s].instructions


def lowered_by(passes, orders) -> list[str]:
    """Each stage's instructions from the compute ops of ``orders`` (one chunk a stage, no
    recompute) made by ``passes`` of lowering alone, as text joined by spaces."""
    from megatron_dynapipe.planning.plan import lowering

    parsed = [lowering._parse_order(order, s) for s, order in enumerate(orders)]
    codes = np.zeros((1, len(orders[0]) // 2), dtype=np.int64)
    made = lowering._Lowering([(s, order, codes) for s, order in enumerate(parsed)], len(orders),
                              lowering._Reference(parsed))
    return [" ".join(names(i)) for i in made.instruction_lists([rows for p in passes for rows in p(made)])]


# Each pass of lowering alone, on 1F1B over two stages and three micro-batches, written out by
# hand from the module docstring's rules (the computes pass alone puts the ops in their orders).
ORDERS_2X3 = [[F(0), F(1), B(0), F(2), B(1), B(2)], [F(0), B(0), F(1), B(1), F(2), B(2)]]


def test_the_computes_pass_alone_runs_each_order():
    from megatron_dynapipe.planning.plan.lowering import _computes

    assert lowered_by([_computes], ORDERS_2X3) == ["F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"]


def test_the_loads_and_frees_pass_loads_on_the_first_stage_alone_and_frees_after_each_backward():
    from megatron_dynapipe.planning.plan.lowering import _computes, _loads_and_frees

    assert lowered_by([_computes, _loads_and_frees], ORDERS_2X3) == [
        "Load0 F0 Load1 F1 B0 Free0 Load2 F2 B1 Free1 B2 Free2", "F0 B0 Free0 F1 B1 Free1 F2 B2 Free2"]
    assert lowered_by([_loads_and_frees], ORDERS_2X3) == ["Load0 Load1 Free0 Load2 Free1 Free2", "Free0 Free1 Free2"]


def test_the_receives_pass_posts_each_receive_two_ops_ahead_and_waits_right_before_its_op():
    from megatron_dynapipe.planning.plan.lowering import _computes, _receives

    assert lowered_by([_computes, _receives], ORDERS_2X3) == [
        "F0 RecvGradStart(0<-s1) F1 RecvGradFinish(0<-s1) B0 RecvGradStart(1<-s1) F2 RecvGradStart(2<-s1) "
        "RecvGradFinish(1<-s1) B1 RecvGradFinish(2<-s1) B2",
        "RecvActStart(0<-s0) RecvActFinish(0<-s0) F0 RecvActStart(1<-s0) B0 RecvActFinish(1<-s0) F1 "
        "RecvActStart(2<-s0) B1 RecvActFinish(2<-s0) F2 B2"]


def test_the_sends_pass_starts_each_send_after_its_op_and_finishes_it_after_the_next_in_1f1b():
    from megatron_dynapipe.planning.plan.lowering import _computes, _sends

    assert lowered_by([_computes, _sends], ORDERS_2X3) == [
        "F0 SendActStart(0->s1) F1 SendActStart(1->s1) SendActFinish(0->s1) B0 SendActFinish(1->s1) "
        "F2 SendActStart(2->s1) B1 SendActFinish(2->s1) B2",
        "F0 B0 SendGradStart(0->s0) F1 SendGradFinish(0->s0) B1 SendGradStart(1->s0) F2 SendGradFinish(1->s0) "
        "B2 SendGradStart(2->s0) SendGradFinish(2->s0)"]


def test_lowering_single_stage_has_no_communication():
    instrs = lower_to_instructions([F(0), F(1), B(1), B(0)], 0, 1, SEL)
    assert names(instrs) == ["Load0", "F0[selective]", "Load1", "F1[selective]",
                             "B1[selective]", "Free1", "B0[selective]", "Free0"]
    plans = build_execution_plans([[F(0), B(0)]], microbatches(1), NONE, "1f1b")
    assert names(plans[0].instructions) == ["Load0", "F0", "B0", "Free0"]


@pytest.mark.parametrize("make", [one_f_one_b, gpipe])
def test_send_finishes_sit_before_the_compute_op_after_next_in_1f1b_and_gpipe(make):
    for pp in (2, 3, 4, 8):
        for n in (1, 2, 5, 13):
            orders = make(pp, n)
            for s in range(pp):
                lowered = lower_to_instructions(orders[s], s, pp, NONE, orders=orders)
                assert lowered == finish_sends_before_the_compute_op_after_next(lowered), (pp, n, s)


def test_every_start_has_one_finish_and_receives_are_posted_one_op_ahead():
    orders = one_f_one_b(4, 6)
    for s in range(4):
        instrs = lower_to_instructions(orders[s], s, 4, NONE, orders=orders)
        starts = [i.transfer for i in instrs if i.op.is_start]
        finishes = [i.transfer for i in instrs if i.op.is_finish]
        assert sorted(starts) == sorted(finishes) and len(set(starts)) == len(starts)
        compute_seen = 0
        for ins in instrs:
            if ins.op.is_compute:
                compute_seen += 1
            elif ins.op in (Op.RECV_ACT_START, Op.RECV_GRAD_START):
                target = orders[s].index((F if ins.op == Op.RECV_ACT_START else B)(ins.microbatch))
                assert compute_seen == max(0, target - 1)


def test_per_stage_recompute_and_numpy_inputs():
    np = pytest.importorskip("numpy")
    rc = np.array([[0, 2, 1], [1, 1, 2]])
    plans = build_execution_plans(one_f_one_b(2, 3), microbatches(3), rc, "1f1b", np.float64(12.5))
    assert plans[0].recompute == [NONE, FULL, SEL] and plans[1].recompute == [SEL, SEL, FULL]
    fwd = {i.microbatch: i.recompute for i in plans[1].instructions if i.op == Op.FORWARD}
    assert fwd == {0: SEL, 1: SEL, 2: FULL}
    assert plans[0].predicted_makespan_ms == 12.5


def test_malformed_orders_are_rejected():
    with pytest.raises(ValueError, match="B0 before F0"):
        lower_to_instructions([B(0), F(0)], 0, 1, NONE)
    with pytest.raises(ValueError, match="twice"):
        lower_to_instructions([F(0), F(0), B(0)], 0, 1, NONE)
    with pytest.raises(ValueError, match="no backward"):
        lower_to_instructions([F(0)], 0, 1, NONE)
    with pytest.raises(ValueError, match=r"item #0 \('X', 0\) is not an Action of Op.FORWARD or Op.BACKWARD"):
        lower_to_instructions([("X", 0)], 0, 1, NONE)
    with pytest.raises(ValueError, match=r"item #1 \('B', 0\) is not an Action"):  # plain tuples are refused
        lower_to_instructions([F(0), ("B", 0)], 0, 1, NONE)
    with pytest.raises(ValueError, match="0..2"):
        build_execution_plans([[F(0), B(0)]], microbatches(3), NONE, "x")
    with pytest.raises(ValueError, match="outside"):
        lower_to_instructions([], 2, 2, NONE)


# -- deadlock check --------------------------------------------------------------------------


def test_1f1b_is_deadlock_free_for_many_sizes():
    for pp in range(1, 9):
        for n in (1, 2, 3, pp - 1, pp, pp + 1, 2 * pp + 3, 24):
            if n < 1:
                continue
            plans = build_execution_plans(one_f_one_b(pp, n), microbatches(n), NONE, "1f1b")
            check_deadlock_free(plans)
            # this stage's order alone also gives a deadlock-free (later-finishing) placement
            local = [lower_to_instructions(o, s, pp, NONE) for s, o in enumerate(one_f_one_b(pp, n))]
            check_deadlock_free(plans_from(local, n))


def test_gpipe_is_deadlock_free():
    for pp in (1, 2, 4, 7):
        for n in (1, 3, 8, 20):
            check_deadlock_free(build_execution_plans(gpipe(pp, n), microbatches(n), FULL, "gpipe"))


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(1, 8), n=st.integers(1, 24), seed=st.integers(0, 2**32 - 1))
def test_any_executable_fifo_orders_lower_to_deadlock_free_plans(pp, n, seed):
    orders = random_fifo_orders(pp, n, random.Random(seed))
    plans = build_execution_plans(orders, microbatches(n), NONE, "random")  # runs the check too
    check_deadlock_free(plans)
    local = [lower_to_instructions(o, s, pp, NONE) for s, o in enumerate(orders)]
    check_deadlock_free(plans_from(local, n))


def test_finishing_every_send_after_the_next_op_can_deadlock_and_the_lowering_avoids_it():
    # Stage 0 forwards everything first, stage 1 runs each backward right after its forward.
    n = 7
    orders = [gpipe(1, n)[0], [op for m in range(n) for op in (F(m), B(m))]]
    plans = build_execution_plans(orders, microbatches(n), NONE, "mixed")
    eager = [finish_sends_before_the_compute_op_after_next(p.instructions) for p in plans]
    with pytest.raises(DeadlockError) as err:
        check_deadlock_free(plans_from(eager, n))
    # stage 0 waits before F5 for stage 1 to post F3's receive (after its F2); stage 1 waits
    # before B1 for stage 0 to post B0's (after its F5)
    assert set(err.value.blocked) == {0, 1}
    assert err.value.blocked[0][1] == Instruction(Op.SEND_ACT_FINISH, 3, 1)
    assert err.value.blocked[1][1] == Instruction(Op.SEND_GRAD_FINISH, 0, 0)
    # the lowering keeps SendActFinish(3) until stage 1 has surely posted that receive
    s0 = names(plans[0].instructions)
    assert s0.index("SendActFinish(3->s1)") > s0.index("F6")


def test_cyclic_wait_raises_deadlock_error_naming_stages_and_instructions():
    # stage 0 waits for the gradient of micro-batch 0 before sending the activation behind it
    stage0 = [
        Instruction(Op.LOAD_INPUT, 0), Instruction(Op.FORWARD, 0),
        Instruction(Op.RECV_GRAD_START, 0, 1), Instruction(Op.RECV_GRAD_FINISH, 0, 1),
        Instruction(Op.SEND_ACT_START, 0, 1), Instruction(Op.SEND_ACT_FINISH, 0, 1),
        Instruction(Op.BACKWARD, 0), Instruction(Op.FREE_BUFFER, 0),
    ]
    stage1 = [
        Instruction(Op.RECV_ACT_START, 0, 0), Instruction(Op.RECV_ACT_FINISH, 0, 0),
        Instruction(Op.FORWARD, 0), Instruction(Op.BACKWARD, 0),
        Instruction(Op.SEND_GRAD_START, 0, 0), Instruction(Op.SEND_GRAD_FINISH, 0, 0),
        Instruction(Op.FREE_BUFFER, 0),
    ]
    with pytest.raises(DeadlockError) as err:
        check_deadlock_free(plans_from([stage0, stage1], 1))
    msg = str(err.value)
    assert "stage 0 blocked at #3 RecvGradFinish(0<-s1)" in msg
    assert "stage 1 blocked at #1 RecvActFinish(0<-s0)" in msg
    assert err.value.blocked == {0: (3, stage0[3]), 1: (1, stage1[1])}
    assert not isinstance(err.value, CommMismatchError) and isinstance(err.value, ValueError)


def test_cyclic_orders_are_refused_when_building():
    # stage 0 wants B0 before F1, stage 1 wants F1 before B0
    orders = [[F(0), B(0), F(1), B(1)], [F(0), F(1), B(0), B(1)]]
    with pytest.raises(DeadlockError, match="cannot progress"):
        build_execution_plans(orders, microbatches(2), NONE, "bad")


def test_peer_finishing_without_posting_is_reported():
    stage0 = [Instruction(Op.LOAD_INPUT, 0), Instruction(Op.FORWARD, 0),
              Instruction(Op.SEND_ACT_START, 0, 1), Instruction(Op.SEND_ACT_FINISH, 0, 1),
              Instruction(Op.BACKWARD, 0)]
    stage1 = [Instruction(Op.RECV_ACT_START, 0, 0), Instruction(Op.RECV_ACT_FINISH, 0, 0),
              Instruction(Op.FORWARD, 0), Instruction(Op.BACKWARD, 0)]
    with pytest.raises(ValueError, match="RECV_GRAD_FINISH"):  # stage 0's B0 needs a gradient
        check_deadlock_free(plans_from([stage0, stage1], 1))
    stage0_ok = stage0[:4] + [Instruction(Op.RECV_GRAD_START, 0, 1), Instruction(Op.RECV_GRAD_FINISH, 0, 1),
                              Instruction(Op.BACKWARD, 0)]
    with pytest.raises(DeadlockError, match="finished its plan without posting it"):
        check_deadlock_free(plans_from([stage0_ok, stage1], 1))


def test_mismatched_send_and_receive_order_raises_naming_both_microbatches():
    orders = [[F(0), F(1), B(0), B(1)], [F(1), F(0), B(0), B(1)]]
    with pytest.raises(CommMismatchError) as err:
        build_execution_plans(orders, microbatches(2), NONE, "bad")
    msg = str(err.value)
    assert "from stage 0 to stage 1" in msg and "1st transfer" in msg
    assert "micro-batch 0 on stage 0" in msg and "micro-batch 1 on stage 1" in msg
    assert isinstance(err.value, DeadlockError)
    # backward order differing between stages is caught on the gradient channel
    orders = [[F(0), F(1), B(1), B(0)], [F(0), F(1), B(0), B(1)]]
    with pytest.raises(CommMismatchError, match="gradient of micro-batch 0 on stage 1"):
        build_execution_plans(orders, microbatches(2), NONE, "bad")


def test_an_interleaved_pipeline_is_lowered_by_hand():
    # 2 stages x 2 chunks, one micro-batch: virtual stages 0 (stage 0), 1 (stage 1), 2 (stage 0's
    # chunk 1), 3 (stage 1's chunk 1). Activations go 0 -> 1 -> 2 -> 3 and gradients back: stage
    # 0's chunk 1 receives from and sends to stage 1 both ways; only virtual stage 0 loads its
    # input and only virtual stage 3 starts its backward without a gradient received.
    orders = [[F(0), F(0, 1), B(0, 1), B(0)]] * 2
    plans = build_execution_plans(orders, microbatches(1), NONE, "interleaved-1f1b", chunks=2)
    assert [str(i) for i in plans[0].instructions] == (
        "RecvActStart(0.1<-s1) Load0 F0 SendActStart(0->s1) RecvGradStart(0.1<-s1) "
        "RecvActFinish(0.1<-s1) F0.1 SendActStart(0.1->s1) RecvGradStart(0<-s1) SendActFinish(0->s1) "
        "RecvGradFinish(0.1<-s1) B0.1 SendGradStart(0.1->s1) Free0.1 SendActFinish(0.1->s1) "
        "RecvGradFinish(0<-s1) B0 Free0 SendGradFinish(0.1->s1)").split()
    assert [str(i) for i in plans[1].instructions] == (
        "RecvActStart(0<-s0) RecvActStart(0.1<-s0) RecvActFinish(0<-s0) F0 SendActStart(0->s0) "
        "RecvActFinish(0.1<-s0) F0.1 RecvGradStart(0<-s0) SendActFinish(0->s0) B0.1 SendGradStart(0.1->s0) Free0.1 "
        "RecvGradFinish(0<-s0) B0 SendGradStart(0->s0) Free0 SendGradFinish(0.1->s0) SendGradFinish(0->s0)").split()
    assert [p.chunks for p in plans] == [2, 2]
    back = ExecutionPlan.from_bytes(plans[0].to_bytes())
    assert back == plans[0] and back.recompute_of(0, 1) == NONE


@pytest.mark.parametrize("pp", [2, 3, 5])
@pytest.mark.parametrize("chunks", [2, 3])
def test_interleaved_plans_of_every_batch_size_are_deadlock_free(pp, chunks):
    rng = np.random.default_rng(pp * 10 + chunks)
    for n in range(1, 13):
        orders = SCHEDULES["interleaved-1f1b"].orders_for(pp, n, chunks)
        recompute = rng.integers(0, 3, size=(pp * chunks, n))  # one row per virtual stage
        plans = build_execution_plans(orders, microbatches(n), recompute, "interleaved-1f1b", chunks=chunks)
        for s, plan in enumerate(plans):  # chunk c of stage s is virtual stage c * pp + s
            assert [plan.recompute_of(m, c) for c in range(chunks) for m in range(n)] == [
                RecomputeType(int(recompute[c * pp + s, m])) for c in range(chunks) for m in range(n)]
            loads = {(i.microbatch, i.chunk) for i in plan.instructions if i.op == Op.LOAD_INPUT}
            assert loads == ({(m, 0) for m in range(n)} if s == 0 else set())


def test_interleaved_orders_that_pair_transfers_differently_are_refused():
    # stage 1 runs micro-batch 0's second chunk before micro-batch 1's first: it receives chunk 1's
    # input second on the link from stage 0, which sends micro-batch 1's first-chunk output second
    orders = SCHEDULES["interleaved-1f1b"].orders_for(2, 2, 2)
    stage1 = [F(0), F(0, 1), F(1), F(1, 1)] + [a for a in orders[1] if a.op is Op.BACKWARD]
    with pytest.raises(CommMismatchError, match="2nd transfer is the activation of micro-batch 1 on stage 0 but the "
                                                "activation of micro-batch 0 of model chunk 1 on stage 1"):
        build_execution_plans([orders[0], stage1], microbatches(2), NONE, "bad", chunks=2)
    with pytest.raises(ValueError, match=r"stage 1 order has no backward for micro-batches 0.1, 1$"):
        build_execution_plans([orders[0], [a for a in orders[1] if a not in (B(1, 0), B(0, 1))]],
                              microbatches(2), NONE, "bad", chunks=2)
    with pytest.raises(ValueError, match="interleaved pipeline needs at least 2 stages"):
        build_execution_plans([orders[0]], microbatches(2), NONE, "bad", chunks=2)
    with pytest.raises(ValueError, match="needs every stage's order: pass orders="):
        lower_to_instructions(orders[0], 0, 2, NONE, chunks=2)


def test_structural_errors_are_reported():
    good = build_execution_plans(one_f_one_b(2, 2), microbatches(2), NONE, "1f1b")[1]

    def broken(instrs):
        return ExecutionPlan(1, 2, "x", microbatches(2), [NONE, NONE], instrs)

    i = good.instructions
    with pytest.raises(ValueError, match="never finished"):
        broken([x for x in i if x.op != Op.SEND_GRAD_FINISH]).validate()
    with pytest.raises(ValueError, match="FORWARD before its input"):
        broken([x for x in i if x.op != Op.RECV_ACT_FINISH or x.microbatch != 1]).validate()
    with pytest.raises(ValueError, match="lack a FORWARD or BACKWARD"):
        broken([x for x in i if x.microbatch != 1]).validate()
    with pytest.raises(ValueError, match="second FORWARD"):
        broken(i + [Instruction(Op.FORWARD, 0)]).validate()
    with pytest.raises(ValueError, match="does not exist"):
        broken(i + [Instruction(Op.FREE_BUFFER, 5)]).validate()
    with pytest.raises(ValueError, match="peer"):
        broken(i + [Instruction(Op.SEND_GRAD_START, 0, 1)]).validate()
    with pytest.raises(ValueError, match="recompute full differs"):
        broken([Instruction(x.op, x.microbatch, x.peer, FULL) if x.op.is_compute else x for x in i]).validate()
    with pytest.raises(ValueError, match=r"plans\[0\] is stage 1 of 2: expected stage 0"):
        check_deadlock_free([good, good])


# -- wire format -----------------------------------------------------------------------------


@st.composite
def random_plans(draw) -> ExecutionPlan:
    kind = draw(st.sampled_from(["1f1b", "gpipe", "random", "interleaved"]))
    pp = draw(st.integers(2 if kind == "interleaved" else 1, 8))
    n = draw(st.integers(1, 40))
    chunks = draw(st.integers(2, 3)) if kind == "interleaved" else 1
    orders = {"1f1b": lambda: one_f_one_b(pp, n), "gpipe": lambda: gpipe(pp, n),
              "random": lambda: random_fifo_orders(pp, n, random.Random(draw(st.integers(0, 2**32 - 1)))),
              "interleaved": lambda: SCHEDULES["interleaved-1f1b"].orders_for(pp, n, chunks)}[kind]()
    mbs = [MicroBatch(tuple(draw(st.lists(st.integers(0, 2**32 - 1), max_size=6))), draw(st.integers(1, 65536)))
           for _ in range(n)]
    rc = draw(st.lists(st.sampled_from(list(RecomputeType)), min_size=n, max_size=n))
    stage = draw(st.integers(0, pp - 1))
    schedule = draw(st.text(max_size=20))
    makespan = draw(st.floats(allow_nan=False))
    return ExecutionPlan(stage, pp, schedule, mbs, rc * chunks,
                         lower_to_instructions(orders[stage], stage, pp, rc, orders=orders, chunks=chunks), makespan,
                         chunks)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=random_plans())
def test_instruction_text_parses_back(plan):
    assert [Instruction.parse(str(i)) for i in plan.instructions] == plan.instructions


def test_instruction_text_by_hand_and_its_errors():
    written = "Load0 F0[full] SendActStart(0->s1) RecvGradFinish(0<-s1) B0[full] Free0"
    assert [Instruction.parse(t) for t in written.split()] == [
        Instruction(Op.LOAD_INPUT, 0), Instruction(Op.FORWARD, 0, recompute=FULL),
        Instruction(Op.SEND_ACT_START, 0, 1), Instruction(Op.RECV_GRAD_FINISH, 0, 1),
        Instruction(Op.BACKWARD, 0, recompute=FULL), Instruction(Op.FREE_BUFFER, 0)]
    for bad, message in (("F0[fast]", "unknown recompute type 'fast'"), ("Load0[full]", "only F and B"),
                         ("SendActStart(0<-s1)", "a send points ->"), ("SendActStart(0->s1", "is not an instruction"),
                         ("G0", "is not an instruction")):
        with pytest.raises(ValueError, match=re.escape(message)):
            Instruction.parse(bad)


# Header 38 bytes + CRC 4; per micro-batch u32 seq_len + u32 size + u8 recompute; u32 per sample;
# 8 bytes per instruction (u8 op, u8 recompute, i16 peer, u32 micro-batch).
def size_bound(plan: ExecutionPlan) -> int:
    """Header 40 and CRC 4, the schedule's name, per micro-batch 8 bytes and a recompute byte per
    chunk, 4 per sample, 9 per instruction."""
    samples = sum(mb.size for mb in plan.microbatches)
    return (44 + len(plan.schedule.encode()) + (8 + plan.chunks) * len(plan.microbatches) + 4 * samples
            + 9 * len(plan.instructions))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=random_plans())
def test_round_trip_is_exact_and_compact(plan):
    data = plan.to_bytes()
    back = ExecutionPlan.from_bytes(data)
    assert back == plan
    assert back.to_bytes() == data
    assert len(data) <= size_bound(plan)
    assert ExecutionPlan.from_bytes(bytearray(data)) == plan


def test_bytes_per_instruction_on_a_realistic_plan():
    n = 32
    mbs = [MicroBatch(tuple(range(4 * m, 4 * m + 4)), 2048) for m in range(n)]
    plans = build_execution_plans(one_f_one_b(8, n), mbs, NONE, "1f1b", 1234.5)
    middle = plans[3]
    data = middle.to_bytes()
    assert len(middle.instructions) == 11 * n  # recv/fwd/send and recv/bwd/send/free per micro-batch
    assert len(data) == size_bound(middle) == 44 + 4 + n * (9 + 4 * 4) + 9 * 11 * n
    # 9 bytes per instruction, plus 25 bytes per micro-batch of 4 samples spread over 11 instructions
    assert len(data) / len(middle.instructions) < 11.5


def _plan() -> ExecutionPlan:
    return build_execution_plans(one_f_one_b(3, 4), microbatches(4), SEL, "1f1b", 3.25)[1]


def test_bad_magic_raises():
    data = _plan().to_bytes()
    with pytest.raises(ValueError, match="expected magic b'DPEP', got b'XPEP'"):
        ExecutionPlan.from_bytes(b"X" + data[1:])
    with pytest.raises(ValueError, match="magic"):
        ExecutionPlan.from_bytes(b"")


def test_unsupported_version_raises():
    data = bytearray(_plan().to_bytes())
    struct.pack_into("<H", data, 4, 7)
    with pytest.raises(ValueError, match="unsupported ExecutionPlan format version 7.*reads version 2"):
        ExecutionPlan.from_bytes(bytes(data))


def test_truncation_and_corruption_raise():
    data = _plan().to_bytes()
    for cut in (5, 20, len(data) // 2, len(data) - 1):
        with pytest.raises(ValueError, match="truncated ExecutionPlan"):
            ExecutionPlan.from_bytes(data[:cut])
    with pytest.raises(ValueError, match="trailing bytes"):
        ExecutionPlan.from_bytes(data + b"\0")
    flipped = bytearray(data)
    flipped[60] ^= 0x01
    with pytest.raises(ValueError, match="checksum"):
        ExecutionPlan.from_bytes(bytes(flipped))


def test_summary_lists_header_microbatches_and_instructions():
    plan = _plan()
    text = str(plan)
    assert text == plan.summary()
    first = text.splitlines()[0]
    assert "stage 1/3" in first and "schedule=1f1b" in first and "predicted=3.250 ms" in first
    assert "mb   2: 2 x 128 (256 tokens) recompute=selective" in text
    assert "RecvActFinish(0<-s0) F0[selective]" in text
    assert "more rows" in plan.summary(max_rows=2)


# -- placing send FINISHes by a simulated timeline -----------------------------------------------

def simulated_timeline(orders, n: int, rng: random.Random, zero_at=None):
    """Start/end of every compute op when the orders run with random positive durations (and
    random transfer times) on the planner's simulator: one valid timeline of these orders."""
    pp = len(orders)
    durations = [[rng.uniform(0.1, 5.0) for _ in range(n)] for _ in range(pp)]
    if zero_at is not None:
        durations[zero_at[0]][zero_at[1]] = 0.0
    zeros = np.zeros((pp, n))
    work = StageWork(forward=np.array(durations), backward=2 * np.array(durations), stored=zeros, peak=zeros,
                     state=np.zeros(pp), comm=np.array([rng.uniform(0.0, 1.0) for _ in range(n)]))
    result = simulate(orders, work)
    return result.op_starts, result.op_ends


@settings(max_examples=60, deadline=None)
@given(pp=st.integers(1, 6), n=st.integers(1, 16), seed=st.integers(0, 2**32 - 1))
def test_plans_placed_by_any_simulated_timeline_are_deadlock_free(pp, n, seed):
    rng = random.Random(seed)
    orders = random_fifo_orders(pp, n, rng)
    timeline = simulated_timeline(orders, n, rng)
    build_execution_plans(orders, microbatches(n), NONE, "random", timeline=timeline)  # runs the check


def test_a_timeline_moves_a_send_finish_to_where_the_receive_is_posted():
    # Stage 1 runs F0 B0 F1 B1 ... with backwards 100x its forwards; stage 0 forwards all first.
    n = 5
    orders = [gpipe(1, n)[0], [op for m in range(n) for op in (F(m), B(m))]]
    starts = [[0, 1, 2, 3, 4, 102, 203, 304, 405, 506], [1, 2, 102, 103, 203, 204, 304, 305, 405, 406]]
    ends = [[1, 2, 3, 4, 5, 104, 205, 306, 407, 508], [2, 102, 103, 203, 204, 304, 305, 405, 406, 506]]
    slow = names(build_execution_plans(orders, microbatches(n), NONE, "mixed", timeline=(starts, ends))[0].instructions)
    # Stage 1 posts the receive of F2 (its op 4) after its op 2, F1. That ends at 103 here, and
    # stage 0's first op to start no earlier is B1 (203): the FINISH of F2's send sits before it.
    assert s0_between(slow, "SendActFinish(2->s1)", "B0", "B1")
    # With unit durations F1 on stage 1 ends at 5 (F0 1-2, B0 2-4, F1 4-5) and stage 0's B0
    # starts at 5 (after F4 ends): the FINISH sits before B0.
    unit = names(build_execution_plans(orders, microbatches(n), NONE, "mixed")[0].instructions)
    assert s0_between(unit, "SendActFinish(2->s1)", "F4", "B0")


def s0_between(names_, item: str, after: str, before: str) -> bool:
    return names_.index(after) < names_.index(item) < names_.index(before) and \
        all(not n.startswith(("F", "B")) for n in names_[names_.index(item):names_.index(before)])


def test_a_timeline_with_a_zero_length_op_is_not_trusted_and_a_wrong_one_is_refused():
    rng = random.Random(3)
    orders = random_fifo_orders(3, 4, rng)
    unit = build_execution_plans(orders, microbatches(4), NONE, "random")
    zero = simulated_timeline(orders, 4, rng, zero_at=(1, 2))
    again = build_execution_plans(orders, microbatches(4), NONE, "random", timeline=zero)
    assert [p.instructions for p in again] == [p.instructions for p in unit]
    starts, ends = simulated_timeline(orders, 4, rng)
    with pytest.raises(ValueError, match="every compute op of every stage"):
        build_execution_plans(orders, microbatches(4), NONE, "random", timeline=(starts, ends[:2]))


def test_an_action_whose_micro_batch_or_chunk_is_no_integer_is_refused():
    with pytest.raises(ValueError, match=r"item #1 Action\(op=<Op.BACKWARD: 2>, microbatch=0, chunk='x'\): its micro-batch "
                                         "and chunk must be integers"):
        lower_to_instructions([F(0), B(0, "x")], 0, 1, NONE)


def test_an_unknown_numpy_recompute_code_is_named():
    with pytest.raises(ValueError, match="unknown recompute code -1"):
        build_execution_plans(one_f_one_b(2, 2), microbatches(2), np.array([[1, -1], [0, 0]]), "1f1b")
