"""Whether the plans of every stage run to the end together: a replay of their posts and waits
under the point-to-point model of NCCL and gloo (untagged sends and receives pair up in posting
order)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Sequence

from megatron_dynapipe.planning.plan.instructions import Instruction, Op

if TYPE_CHECKING:  # plans are only read here; lowering builds them and imports this module
    from megatron_dynapipe.planning.plan.execution_plan import ExecutionPlan

__all__ = ["DeadlockError", "CommMismatchError", "check_deadlock_free"]


class DeadlockError(ValueError):
    """The plans cannot all run to the end; ``blocked`` maps stage -> (index, instruction)."""

    def __init__(self, message: str, blocked: "dict[int, tuple[int, Instruction]] | None" = None):
        super().__init__(message)
        self.blocked = dict(blocked or {})


class CommMismatchError(DeadlockError):
    """Sends and receives between two stages pair up in posting order, and a pair disagrees."""




def _ordinal(i: int) -> str:
    suffix = "th" if 10 <= i % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(i % 10, "th")
    return f"{i}{suffix}"


def check_deadlock_free(plans: Sequence[ExecutionPlan]) -> None:
    """Prove that the plans of all stages run to the end together, or raise.

    Model of point-to-point communication (NCCL / gloo ``isend``/``irecv`` without tags):
    STARTs are non-blocking posts; a FINISH blocks until the peer has posted the matching START;
    between two stages, in one direction, the i-th send posted pairs with the i-th receive
    posted. Compute ops never block (their inputs are checked by :meth:`ExecutionPlan.validate`).
    The stages are advanced until all are done or none can move.

    Raises ValueError if a plan is malformed or the plans do not form one pipeline,
    :class:`CommMismatchError` if a send and a receive pair up for different micro-batches (or
    an activation with a gradient), and :class:`DeadlockError` naming every stuck stage's
    blocking instruction and what it waits for.
    """
    pp = len(plans)
    if pp == 0:
        return
    for s, plan in enumerate(plans):
        if plan.stage != s or plan.num_stages != pp:
            raise ValueError(
                f"plans[{s}] is stage {plan.stage} of {plan.num_stages}: expected stage {s} of {pp}"
            )
        plan.validate()

    # channel (src, dst) -> posted sends / receives, as (op, micro-batch)
    sends: dict[tuple[int, int], list[tuple[Op, int]]] = {}
    recvs: dict[tuple[int, int], list[tuple[Op, int]]] = {}
    index: list[dict[tuple[Op, int, int], int]] = [{} for _ in range(pp)]  # transfer -> position
    waiting: dict[tuple[str, tuple[int, int], int], int] = {}  # (side, channel, k) -> stage
    pc = [0] * pp
    ready = deque(range(pp))
    queued = [True] * pp

    def post(s: int, ins: Instruction) -> None:
        if ins.op.is_send:
            channel, mine, theirs, side = (s, ins.peer), sends, recvs, "send"
        else:
            channel, mine, theirs, side = (ins.peer, s), recvs, sends, "recv"
        posted = mine.setdefault(channel, [])
        k = len(posted)
        posted.append((ins.op, ins.microbatch))
        index[s][ins.transfer] = k
        other = theirs.get(channel, [])
        if k < len(other):
            _check_pair(channel, k, sends[channel][k], recvs[channel][k])
        waiter = waiting.pop((side, channel, k), None)
        if waiter is not None and not queued[waiter]:
            queued[waiter] = True
            ready.append(waiter)

    while ready:
        s = ready.popleft()
        queued[s] = False
        instrs = plans[s].instructions
        while pc[s] < len(instrs):
            ins = instrs[pc[s]]
            if ins.op.is_start:
                post(s, ins)
            elif ins.op.is_finish:
                k = index[s][ins.transfer]
                if ins.op.is_send:
                    channel, other_side, other = (s, ins.peer), "recv", recvs
                else:
                    channel, other_side, other = (ins.peer, s), "send", sends
                if len(other.get(channel, ())) <= k:
                    waiting[other_side, channel, k] = s
                    break
            pc[s] += 1

    stuck = [s for s in range(pp) if pc[s] < len(plans[s].instructions)]
    if not stuck:
        return
    blocked = {s: (pc[s], plans[s].instructions[pc[s]]) for s in stuck}
    lines = [f"deadlock: {len(stuck)} of {pp} stages cannot progress"]
    for s in stuck:
        i, ins = blocked[s]
        k = index[s][ins.transfer]
        peer = ins.peer
        what = "activation" if ins.op in (Op.SEND_ACT_FINISH, Op.RECV_ACT_FINISH) else "gradient"
        verb, towards = ("receive", "from") if ins.op.is_send else ("send", "to")
        state = (f"stage {peer} is itself blocked at #{blocked[peer][0]} {blocked[peer][1]}"
                 if peer in blocked else f"stage {peer} finished its plan without posting it")
        lines.append(
            f"  stage {s} blocked at #{i} {ins}: waits for stage {peer} to post the matching "
            f"{what} {verb} of micro-batch {ins.microbatch} (its {_ordinal(k + 1)} {verb} "
            f"{towards} stage {s}); {state}"
        )
    raise DeadlockError("\n".join(lines), blocked)


def _check_pair(channel: tuple[int, int], k: int, send: tuple[Op, int], recv: tuple[Op, int]) -> None:
    (send_op, send_mb), (recv_op, recv_mb) = send, recv
    same_kind = (send_op == Op.SEND_ACT_START) == (recv_op == Op.RECV_ACT_START)
    if same_kind and send_mb == recv_mb:
        return
    src, dst = channel
    send_what = "activation" if send_op == Op.SEND_ACT_START else "gradient"
    recv_what = "activation" if recv_op == Op.RECV_ACT_START else "gradient"
    raise CommMismatchError(
        f"send/receive mismatch from stage {src} to stage {dst}: the {_ordinal(k + 1)} transfer is "
        f"the {send_what} of micro-batch {send_mb} on stage {src} but the {recv_what} of "
        f"micro-batch {recv_mb} on stage {dst} (untagged point-to-point pairs in posting order)"
    )
