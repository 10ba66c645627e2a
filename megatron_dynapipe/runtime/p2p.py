"""Point-to-point transfers of an execution plan on the pipeline group.

A plan's communication instructions come in START/FINISH pairs. :class:`PipelineChannels`
turns each START into one non-blocking ``torch.distributed.isend``/``irecv`` to the peer stage's
global rank (each with its own request, so a FINISH waits for exactly its transfer, which is what
the plan's deadlock check models) and each FINISH into a wait that, when it fails or times out,
raises :class:`PipelineCommError` naming this stage, the peer, the micro-batch and the
instruction. The executor posts all STARTs that stand between two compute ops back to back,
before any FINISH.

Two groups over the same ranks
------------------------------
Activations travel on the pipeline group, gradients on a second group over the same ranks.
NCCL runs the point-to-point operations between two ranks of one group in order on one stream;
a gradient receive that a plan posts early (one compute op ahead) would then hold up every later
activation transfer between the same two stages until the gradient arrives, which can be never
(the peer needs those activations first). With one group per direction of travel, each stream
carries transfers of one kind in one direction, posted in the same order on both ends, and the
order of operations on a stream is exactly the FIFO pairing the plan is checked against. Gloo has
no such stream, but uses the same groups so that one code path is exercised everywhere.

An interleaved pipeline of two stages sends activations both ways between its two ranks (stage
1's chunk c feeds stage 0's chunk c + 1), and gradients too; there each kind gets one group per
direction (four in all), so that again a stream carries one kind in one direction.  With more
stages every pair of ranks still carries each kind one way only (the last stage's activations
go to stage 0, which no other activation transfer joins), and two groups suffice.

The extra groups are created collectively (every rank of the default group, in the same order)
the first time a pipeline group is used, and warmed up with one tiny exchange between
neighbouring stages on every group, so that connection set-up never happens inside a plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dynapipe.compat import core
from megatron_dynapipe.planning.plan import Instruction, Op

__all__ = ["PipelineCommError", "PipelineChannels", "Transfer", "adopt_twin_groups"]


class PipelineCommError(RuntimeError):
    """A pipeline send or receive failed or timed out; the message names the peer and micro-batch."""


_KIND = {
    Op.RECV_ACT_START: ("activation", "from"),
    Op.SEND_ACT_START: ("activation", "to"),
    Op.RECV_GRAD_START: ("gradient", "from"),
    Op.SEND_GRAD_START: ("gradient", "to"),
}


@dataclass(eq=False)
class Transfer:
    """One posted send or receive: the tensor stays referenced here until its FINISH."""

    start: Op  # the START op
    microbatch: int
    peer_stage: int
    peer_rank: int
    tensor: torch.Tensor
    where: str = ""  # the START instruction, for errors
    chunk: int = 0  # the model chunk whose compute op it serves
    work: object = None
    posted_at: float = 0.0

    @property
    def is_send(self) -> bool:
        return self.start.is_send

    def describe(self) -> str:
        kind, direction = _KIND[self.start]
        verb = "sending" if self.is_send else "receiving"
        chunk = f" (model chunk {self.chunk})" if self.chunk else ""
        return (f"{verb} the {kind} of micro-batch {self.microbatch}{chunk} {direction} stage "
                f"{self.peer_stage} (global rank {self.peer_rank})")


# pipeline group ranks -> (that group, the groups made over the same ranks); replaced when
# megatron re-creates its groups
_TWINS: dict[tuple[int, ...], tuple[object, list]] = {}


def _twin_groups(pp_group, count: int, timeout: Optional[timedelta]) -> tuple[list, bool]:
    """At least ``count`` more groups over ``pp_group``'s ranks, and whether any was made now."""
    ranks = tuple(dist.get_process_group_ranks(pp_group))
    cached = _TWINS.get(ranks)
    if cached is not None and cached[0] is not pp_group:  # megatron re-created its pipeline group
        for stale in cached[1]:
            try:
                dist.destroy_process_group(stale)
            except Exception:  # already gone with the old groups
                pass
        cached = None
    twins = [] if cached is None else cached[1]
    if len(twins) >= count:
        return twins, False
    # Collective over the default group: every rank learns every pipeline group, then all create
    # the twins in the same (sorted) order, as torch requires of new_group.
    world = dist.get_world_size()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, ranks)
    layouts = sorted(set(tuple(r) for r in gathered))
    covered = sorted(r for layout in layouts for r in layout)
    if covered != list(range(world)):
        raise RuntimeError(f"pipeline groups {layouts} do not partition the {world} ranks")
    kwargs = {"backend": dist.get_backend(pp_group)}
    if timeout is not None:
        kwargs["timeout"] = timeout
    for _ in range(count - len(twins)):
        for layout in layouts:
            group = dist.new_group(list(layout), **kwargs)
            if layout == ranks:
                twins = twins + [group]
    _TWINS[ranks] = (pp_group, twins)
    return twins, True


def adopt_twin_groups(pp_group, make_group) -> None:
    """Give ``pp_group`` the twin groups it sends on, each ``make_group(ranks)``, without the
    collective set-up and warm-up exchange :class:`PipelineChannels` does: for a fake rank, which
    runs alone in its process (no peer would answer)."""
    ranks = tuple(dist.get_process_group_ranks(pp_group))
    _TWINS[ranks] = (pp_group, [make_group(list(ranks)) for _ in range(3)])


class PipelineChannels:
    """This rank's view of its pipeline: stage, peers' global ranks, and the groups it sends on.

    ``device``/``dtype`` are those of the tensors exchanged; ``timeout`` (seconds, or None for
    the process group's own) bounds each FINISH; ``chunks``: the model chunks a stage holds (two
    stages of several chunks take a group per kind and direction).
    """

    def __init__(self, pp_group=None, *, device: torch.device, timeout: Optional[float] = None,
                 chunks: int = 1):
        if pp_group is None:
            pp_group = core.pipeline_group()
        self.pp_group = pp_group
        self.ranks = tuple(dist.get_process_group_ranks(pp_group))
        self.stage = dist.get_rank(pp_group)
        self.num_stages = len(self.ranks)
        self.rank = self.ranks[self.stage]
        self.device = torch.device(device)
        self.timeout = None if timeout is None else timedelta(seconds=float(timeout))
        self.chunks = chunks
        self.by_direction = self.num_stages == 2 and chunks > 1
        # [activations, gradients] or, by direction, [up, up, down, down]
        self.groups = [pp_group]
        if self.num_stages > 1:
            twins, fresh = _twin_groups(pp_group, 3 if self.by_direction else 1, self.timeout)
            self.groups += twins[:3 if self.by_direction else 1]
            if fresh:
                self._warm_up()

    def peer_rank(self, stage: int) -> int:
        return self.ranks[stage]

    def _group(self, op: Op, peer_stage: int):
        upward = (self.stage < peer_stage) == op.is_send  # from the lower stage to the higher
        return self.groups[(0 if op.is_activation else 1) + (2 if self.by_direction and not upward else 0)]

    def _warm_up(self) -> None:
        """One element each way between neighbouring stages on every group: connections (NCCL
        communicators) are set up here, together, rather than by the first transfer of a plan."""
        candidates = [self.stage - 1, self.stage + 1]
        if self.chunks > 1:  # interleaved: the last stage feeds the first
            candidates = [s % self.num_stages for s in candidates]
        neighbours = sorted({s for s in candidates if 0 <= s < self.num_stages} - {self.stage})
        started = time.monotonic()
        for group in self.groups:  # a batch holds one group's ops
            ops, buffers = [], []
            for s in neighbours:
                send = torch.full((1,), float(self.stage), device=self.device)
                recv = torch.empty(1, device=self.device)
                buffers.append((s, recv))
                ops.append(dist.P2POp(dist.isend, send, self.ranks[s], group))
                ops.append(dist.P2POp(dist.irecv, recv, self.ranks[s], group))
            try:
                for work in dist.batch_isend_irecv(ops):
                    self._wait_work(work)
            except Exception as exc:
                raise PipelineCommError(
                    f"pipeline stage {self.stage} (global rank {self.rank}) could not reach its neighbour "
                    f"stages {neighbours} (global ranks {[self.ranks[s] for s in neighbours]}) after "
                    f"{time.monotonic() - started:.1f} s: {_first_line(exc)}"
                ) from exc
            for s, recv in buffers:
                if int(recv.item()) != s:
                    raise PipelineCommError(f"pipeline warm-up: stage {self.stage} heard {recv.item()} from stage {s}")

    def _wait_work(self, work) -> None:
        if work is None:
            return
        if self.timeout is None:
            work.wait()
        else:
            work.wait(self.timeout)

    def transfer(self, ins: Instruction, tensor: torch.Tensor, where: str = "") -> Transfer:
        """A START instruction and its tensor (the data to send, or the buffer to receive into);
        ``where`` (the instruction) goes into errors."""
        return Transfer(ins.op, ins.microbatch, ins.peer, self.ranks[ins.peer], tensor, where, ins.chunk)

    def post(self, transfers: Sequence[Transfer]) -> None:
        """Issue the transfers in order, each as its own non-blocking request.  A peer that is
        already gone can fail the posting itself (gloo on a closed connection)."""
        now = time.monotonic()
        for t in transfers:
            fn = dist.isend if t.is_send else dist.irecv
            t.posted_at = now
            try:
                t.work = fn(t.tensor, t.peer_rank, group=self._group(t.start, t.peer_stage))
            except Exception as exc:
                raise self._failed(t, t.where, exc) from exc

    def finish(self, t: Transfer, where: str = "") -> torch.Tensor:
        """Wait for ``t``; return its tensor. ``where`` (e.g. the instruction) goes into errors."""
        try:
            self._wait_work(t.work)
        except Exception as exc:
            raise self._failed(t, where, exc) from exc
        t.work = None
        return t.tensor

    def _failed(self, t: Transfer, where: str, exc: BaseException) -> PipelineCommError:
        return PipelineCommError(
            f"pipeline stage {self.stage} (global rank {self.rank}) failed {t.describe()}"
            f"{f' [{where}]' if where else ''}, {time.monotonic() - t.posted_at:.1f} s after posting it: "
            f"{_first_line(exc)} -- stage {t.peer_stage} has probably died or stalled; check its log")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
