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
no such stream, but uses the same two groups so that one code path is exercised everywhere.

The gradient groups are created collectively (every rank of the default group, in the same order)
the first time a pipeline group is used, and warmed up with one tiny exchange between
neighbouring stages on both groups, so that connection set-up never happens inside a plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_dynapipe.planning.plan import Instruction, Op

__all__ = ["PipelineCommError", "PipelineChannels", "Transfer"]


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
    work: object = None
    posted_at: float = 0.0

    @property
    def is_send(self) -> bool:
        return self.start.is_send

    def describe(self) -> str:
        kind, direction = _KIND[self.start]
        verb = "sending" if self.is_send else "receiving"
        return (f"{verb} the {kind} of micro-batch {self.microbatch} {direction} stage "
                f"{self.peer_stage} (global rank {self.peer_rank})")


# pipeline group -> (that group, its gradient twin); replaced when megatron re-creates its groups
_TWINS: dict[tuple[int, ...], tuple[object, object]] = {}


def _gradient_group(pp_group, timeout: Optional[timedelta]):
    ranks = tuple(dist.get_process_group_ranks(pp_group))
    cached = _TWINS.get(ranks)
    if cached is not None and cached[0] is pp_group:
        return cached[1]
    # Collective over the default group: every rank learns every pipeline group, then all create
    # the twins in the same (sorted) order, as torch requires of new_group.
    world = dist.get_world_size()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, ranks)
    layouts = sorted(set(tuple(r) for r in gathered))
    covered = sorted(r for layout in layouts for r in layout)
    if covered != list(range(world)):
        raise RuntimeError(f"pipeline groups {layouts} do not partition the {world} ranks")
    backend = dist.get_backend(pp_group)
    twin = None
    for layout in layouts:
        kwargs = {"backend": backend}
        if timeout is not None:
            kwargs["timeout"] = timeout
        group = dist.new_group(list(layout), **kwargs)
        if layout == ranks:
            twin = group
    if cached is not None:  # megatron re-created its pipeline group: drop the stale twin
        try:
            dist.destroy_process_group(cached[1])
        except Exception:  # already gone with the old groups
            pass
    _TWINS[ranks] = (pp_group, twin)
    return twin


class PipelineChannels:
    """This rank's view of its pipeline: stage, peers' global ranks, and the two groups.

    ``device``/``dtype`` are those of the tensors exchanged; ``timeout`` (seconds, or None for
    the process group's own) bounds each FINISH.
    """

    def __init__(self, pp_group=None, *, device: torch.device, timeout: Optional[float] = None):
        if pp_group is None:
            from megatron.core import parallel_state

            pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_group = pp_group
        self.ranks = tuple(dist.get_process_group_ranks(pp_group))
        self.stage = dist.get_rank(pp_group)
        self.num_stages = len(self.ranks)
        self.rank = self.ranks[self.stage]
        self.device = torch.device(device)
        self.timeout = None if timeout is None else timedelta(seconds=float(timeout))
        self.activation_group = pp_group
        self.gradient_group = None
        if self.num_stages > 1:
            fresh = _TWINS.get(self.ranks, (None,))[0] is not pp_group
            self.gradient_group = _gradient_group(pp_group, self.timeout)
            if fresh:
                self._warm_up()

    def peer_rank(self, stage: int) -> int:
        return self.ranks[stage]

    def _group(self, op: Op):
        return self.activation_group if op.is_activation else self.gradient_group

    def _warm_up(self) -> None:
        """One element each way between neighbouring stages on both groups: connections (NCCL
        communicators) are set up here, together, rather than by the first transfer of a plan."""
        neighbours = [s for s in (self.stage - 1, self.stage + 1) if 0 <= s < self.num_stages]
        started = time.monotonic()
        for group in (self.activation_group, self.gradient_group):  # a batch holds one group's ops
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
        return Transfer(ins.op, ins.microbatch, ins.peer, self.ranks[ins.peer], tensor, where)

    def post(self, transfers: Sequence[Transfer]) -> None:
        """Issue the transfers in order, each as its own non-blocking request.  A peer that is
        already gone can fail the posting itself (gloo on a closed connection)."""
        now = time.monotonic()
        for t in transfers:
            fn = dist.isend if t.is_send else dist.irecv
            t.posted_at = now
            try:
                t.work = fn(t.tensor, t.peer_rank, group=self._group(t.start))
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
