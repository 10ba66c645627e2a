"""Whether the plans of every stage run to the end together: a replay of their posts and waits
under the point-to-point model of NCCL and gloo (untagged sends and receives pair up in posting
order), with activations and gradients on separate channels as the runtime sends them
(:mod:`megatron_dynapipe.runtime.p2p`)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Sequence

from megatron_dynapipe.planning.plan.instructions import Instruction

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


def _check_one_pipeline(plans: Sequence[ExecutionPlan]) -> None:
    """ValueError unless each plan is valid and they are the stages 0..pp-1 of one pipeline."""
    pp = len(plans)
    for s, plan in enumerate(plans):
        if plan.stage != s or plan.num_stages != pp:
            raise ValueError(f"plans[{s}] is stage {plan.stage} of {plan.num_stages}: expected stage {s} of {pp}")
        if plan.chunks != plans[0].chunks:
            raise ValueError(f"stage {s}'s plan runs {plan.chunks} model chunks, stage 0's {plans[0].chunks}")
        plan.validate()


def check_deadlock_free(plans: Sequence[ExecutionPlan]) -> None:
    """Prove that the plans of all stages run to the end together, or raise.

    Model of point-to-point communication (NCCL / gloo ``isend``/``irecv`` without tags):
    STARTs are non-blocking posts; a FINISH blocks until the peer has posted the matching START;
    between two stages, in one direction, the i-th activation (gradient) sent pairs with the
    i-th activation (gradient) receive posted. Compute ops never block (their inputs are checked
    by :meth:`ExecutionPlan.validate`). The stages are advanced until all are done or none can
    move.

    Raises ValueError if a plan is malformed or the plans do not form one pipeline,
    :class:`CommMismatchError` if a send and a receive pair up for different micro-batches (or
    virtual stages that are not neighbours), and :class:`DeadlockError` naming every stuck
    stage's blocking instruction and what it waits for.
    """
    pp = len(plans)
    if pp == 0:
        return
    _check_one_pipeline(plans)
    # channel (src, dst, activations?) -> posted sends / receives, as (micro-batch, chunk)
    sends: dict[tuple[int, int, bool], list[tuple[int, int]]] = {}
    recvs: dict[tuple[int, int, bool], list[tuple[int, int]]] = {}
    index: list[dict[tuple, int]] = [{} for _ in range(pp)]  # transfer -> position
    waiting: dict[tuple[str, tuple[int, int, bool], int], int] = {}  # (side, channel, k) -> stage
    pc = [0] * pp
    ready = deque(range(pp))
    queued = [True] * pp

    def post(s: int, ins: Instruction) -> None:
        channel = _channel(s, ins)
        mine, theirs, side = (sends, recvs, "send") if ins.op.is_send else (recvs, sends, "recv")
        posted = mine.setdefault(channel, [])
        k = len(posted)
        posted.append((ins.microbatch, ins.chunk))
        index[s][ins.transfer] = k
        other = theirs.get(channel, [])
        if k < len(other):
            _check_pair(channel, k, sends[channel][k], recvs[channel][k], pp)
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
                channel = _channel(s, ins)
                other_side, other = ("recv", recvs) if ins.op.is_send else ("send", sends)
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
        what = "activation" if ins.op.is_activation else "gradient"
        verb, towards = ("receive", "from") if ins.op.is_send else ("send", "to")
        state = (f"stage {peer} is itself blocked at #{blocked[peer][0]} {blocked[peer][1]}"
                 if peer in blocked else f"stage {peer} finished its plan without posting it")
        lines.append(
            f"  stage {s} blocked at #{i} {ins}: waits for stage {peer} to post the matching "
            f"{what} {verb} of {_microbatch(ins.microbatch, ins.chunk)} (its {_ordinal(k + 1)} {what} {verb} "
            f"{towards} stage {s}); {state}"
        )
    raise DeadlockError("\n".join(lines), blocked)


def _channel(stage: int, ins: Instruction) -> tuple[int, int, bool]:
    """(sender, receiver, carries activations) of a transfer instruction run on ``stage``."""
    activation = ins.op.is_activation
    return (stage, ins.peer, activation) if ins.op.is_send else (ins.peer, stage, activation)


def _microbatch(m: int, chunk: int) -> str:
    return f"micro-batch {m}" + (f" of model chunk {chunk}" if chunk else "")


def _check_pair(channel: tuple[int, int, bool], k: int, send: tuple[int, int], recv: tuple[int, int],
                pp: int) -> None:
    """A send and the receive it pairs with move one micro-batch from a virtual stage (chunk c
    of stage s is ``c * pp + s``) to the next (activations) or the one before (gradients)."""
    src, dst, activation = channel
    (send_mb, send_chunk), (recv_mb, recv_chunk) = send, recv
    step = 1 if activation else -1
    if send_mb == recv_mb and recv_chunk * pp + dst == send_chunk * pp + src + step:
        return
    what = "activation" if activation else "gradient"
    raise CommMismatchError(
        f"send/receive mismatch from stage {src} to stage {dst}: the {_ordinal(k + 1)} transfer is the {what} "
        f"of {_microbatch(send_mb, send_chunk)} on stage {src} but the {what} of {_microbatch(recv_mb, recv_chunk)} "
        f"on stage {dst} (untagged point-to-point pairs in posting order)"
    )
