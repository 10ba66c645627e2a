"""Replay a traced layout's representative ranks as the whole job, on a hardware model.

Each representative rank's trace becomes a list of :class:`Step` s in issue order
(docs/trace_format.md, "Replaying a set of traces"):

* a top-level compute op is its own time (a shapes-only trace's priced for the simulated
  hardware, :mod:`.reprice`) less the communication nested in it, cut into
  segments around that communication (where the trace's clock says it happened; evenly when
  the clock is a cost model that times no communication);
* every communication op is priced by the hardware model (:mod:`.hardware`), never by its traced
  duration: a fake rank's collectives return at once and a CPU's are not a GPU cluster's;
* a collective whose group holds several representatives (the embedding all-reduce between the
  first and last stage, the gradient-norm all-reduce over TP x PP, expert all-to-alls) starts
  when the last of them arrives; a group inside one representative's stage stands for peers
  that run the same ops at the same time, so it only costs time;
* point-to-point transfers match by order per (sender, receiver) pair and process group (by its
  name: the pipeline's activations and its gradients travel on two groups of the same ranks,
  which torch.distributed matches apart); a batch of them ends when
  its slowest part has arrived, a part starts when both sides have posted it; a rank blocks on
  a transfer at its recorded ``wait`` (Megatron's overlapped pipeline communication posts the
  next chunk's receive and waits for it only before that chunk's pass, so the transfer hides
  behind the compute between), and at the op itself where the trace records no wait;
* with ``overlap_grad_reduce`` the data-parallel bucket reductions a backward launches (or, on
  later pipeline stages, the schedule launches right after the last backward) run on a separate
  stream, and the first step after the last backward waits for them;
* context parallelism's KV ring (point-to-point steps between a representative and the peers
  it stands for) runs on its own stream beside the pass's compute, as transformer-engine
  overlaps each ring step with attention, and the pass ends when both are done; where the trace
  gives the pass's block of ring attention (``ring_block_us``, shapes-only traces), each step
  runs beside that one block only and the pass waits for what it takes beyond it, as in
  transformer-engine, whose ring steps run inside the attention core;
* a dense layer's tensor-parallel collective that runs beside a GEMM (a column-parallel linear's
  backward ones always, the rest of sequence parallelism's under ``tp_comm_overlap``) costs the
  pass what outlasts that GEMM, priced by the hardware's roofline (:func:`~megatron_dynapipe.
  planning.cost_model.tensor_parallel.collective_exposed_ms`, which the planner prices by too);
  without a roofline, and for other layers, a rank waits for it;
* with ``overlap_param_gather`` the distributed optimizer's parameter all-gathers inside a
  forward (one a bucket, in the first micro-batch's) run on their own stream beside its compute,
  but the first, which the forward waits for before any layer can run; the pass ends when both
  are done (megatron-core dispatches each bucket's gather as the one before it is waited on);
* an optimizer step the trace did not time (shapes-only) streams the rank's model state through
  device memory once to read and once to write.

:func:`simulate_job` runs the ranks side by side (an event loop that advances every rank as
far as its dependencies allow) and returns a :class:`Replay`: every rank's timeline and where
its time went.  Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_dynapipe.hardware import Hardware
from megatron_dynapipe.planning.collector import cyclic_gc_paused
from megatron_dynapipe.planning.cost_model.tensor_parallel import LinearGemms, collective_exposed_ms, label_pass
from megatron_dynapipe.simulate.reprice import reprice
from megatron_dynapipe.simulate.traced_job import RETRACE, TracedJob, TraceMismatch
from megatron_dynapipe.tracer.trace_format import (
    DTYPE_BYTES,
    P2P_RECV_KINDS,
    P2P_SEND_KINDS,
    RankTrace,
    TraceOp,
    subtrees,
)

__all__ = ["Step", "Span", "RankReplay", "Replay", "simulate_job"]

GRAD_STREAM, CP_STREAM = "gradient reduction", "context parallel"  # overlap streams
PARAM_STREAM = "parameter gather"
TP_GROUP = "TENSOR_MODEL_PARALLEL_GROUP"
POSTED = "posted"  # the key of a p2p step that waits for transfers posted earlier
_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "barrier")














# -- steps --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Step:
    """One thing a rank does, in issue order.

    ``what`` is ``compute``, ``collective`` (blocking; ``key`` = (group, index), ``members`` the
    representatives taking part), ``p2p`` (blocking; ``transfers`` of (sender, receiver, (group name, index),
    cost); ``key`` ``POSTED`` where it waits for transfers a ``post`` began), ``post`` (posts
    ``transfers`` and goes on), ``async`` (a collective on the overlap ``stream``) or ``drain``
    (wait for that stream; what it exposes counts as ``key``'s communication).
    """

    what: str
    label: str
    dur_us: float = 0.0
    phase: Optional[str] = None
    microbatch: Optional[int] = None
    key: Any = None
    members: frozenset = frozenset()
    transfers: tuple = ()
    bytes: int = 0
    stream: str = ""

    @property
    def match_keys(self) -> list:
        """What this blocking step waits on: its collective instance, or each transfer."""
        return [self.key] if self.what == "collective" else [t[:3] for t in self.transfers]


class _StepBuilder:
    """Turns one rank's trace into steps (keeps the per-group and per-pair counters)."""

    def __init__(self, job: TracedJob, trace: RankTrace, hardware: Hardware) -> None:
        self.job, self.trace, self.hw = job, trace, hardware
        self.timed_comm = trace.clock != "cost_model"
        self.group_count: Counter = Counter()
        self.pair_count: Counter = Counter()
        self.collective_costs: dict[tuple, float] = {}
        self.overlap = job.overlap_grad_reduce
        #: what the overlapped reductions' wait counts as: all-reduces, or the distributed optimizer's reduce-scatters
        self.grad_sync_kind = next((op.kind for op in trace.ops if op.name.endswith("start_grad_sync")), "all_reduce")
        self.steps: list[Step] = []
        top = [op for op in trace.ops if op.parent is None]
        #: request handles waited on between passes, and the transfers posted under each
        self.waited = {op.handle for op in top if op.kind == "wait"}
        self.requests: dict[int, Step] = {}
        #: the GEMMs a dense layer's TP collectives run beside (None: every one waits), and the
        #: label of each such collective of the pass being built, by op
        roofline = hardware.roofline(job.dtype)
        dense = job.layout.tp > 1 and not job.model.num_experts and roofline is not None
        self.tp_gemms = LinearGemms.on(job.model, job.layout.tp, roofline) if dense else None
        self.tp_labels: dict[int, tuple] = {}

    def build(self) -> list[Step]:
        trees = subtrees(self.trace.ops)
        drained = False
        for op in self.trace.ops:
            if op.parent is not None:
                continue
            if op.kind == "wait":
                self._wait(op)
                continue
            if self.overlap and not drained and op.phase in ("finalize_grads", "optimizer_step"):
                self.steps.append(Step("drain", "exposed overlapped gradient reduction", phase=op.phase,
                                       key=self.grad_sync_kind, stream=GRAD_STREAM))
                drained = True
            if op.cat == "compute":
                # a wait inside a pass (the context-parallel ring's) is priced with the pass
                nested = [child for child in trees[op.seq][1:] if child.cat == "comm" and child.kind != "wait"]
                self._compute(op, nested)
            else:
                self.steps.append(self._comm(op))
        return self.steps

    def _wait(self, op: TraceOp) -> None:
        """The rank blocks until the transfers of request ``op.handle`` have arrived."""
        posted = self.requests.pop(op.handle, None)
        if posted is not None:
            self.steps.append(dataclasses.replace(posted, what="p2p", phase=op.phase, key=POSTED))

    def _launches_overlapped_reduction(self, op: TraceOp) -> bool:
        """A DP bucket reduction DDP starts asynchronously: from a backward pass, or right after
        the last one (later pipeline stages under Megatron-LM's --align-grad-reduce)."""
        return self.overlap and op.name.endswith("start_grad_sync")

    def _compute_us(self, op: TraceOp, nested: list[TraceOp]) -> float:
        if op.kind == "optimizer_step" and op.dur_us == 0:
            state = self.trace.memory.get("model_state_bytes") or 0
            return 2 * self.hw.memory_bound_us(state)  # read and write every byte of model state once
        own = op.dur_us - (sum(c.dur_us for c in nested) if self.timed_comm else 0.0)
        return max(own, 0.0)

    def _compute(self, op: TraceOp, nested: list[TraceOp]) -> None:
        total = self._compute_us(op, nested)
        segments = self._segments(op, nested, total)
        self._label_tp(nested)
        gathers = [c for c in nested if self._param_gather(c)]
        for index, segment in enumerate(segments):
            self.steps.append(Step("compute", op.kind, segment, op.phase, op.microbatch))
            if index < len(nested):
                # the first bucket's gather is waited for before any layer runs
                self.steps.append(self._comm(nested[index], overlapped=nested[index] in gathers[1:]))
                if op.ring_block_us is not None and self.steps[-1].stream == CP_STREAM:
                    self._ring_step_beside_its_block(op)
        if len(gathers) > 1:
            self.steps.append(Step("drain", "exposed overlapped parameter gather", phase=op.phase,
                                   microbatch=op.microbatch, key="all_gather", stream=PARAM_STREAM))
        if any(self._within_my_stage(c) for c in nested):
            self.steps.append(Step("drain", "exposed context-parallel ring", phase=op.phase,
                                   microbatch=op.microbatch, key="cp_ring", stream=CP_STREAM))

    def _ring_step_beside_its_block(self, op: TraceOp) -> None:
        """A ring transfer as transformer-engine runs it: beside one block of the layer's attention
        (``op.ring_block_us``), which the next step waits for; what it takes beyond that block
        shows in the pass (the pass's compute already holds the blocks)."""
        ring = self.steps[-1]
        ring.dur_us = max(0.0, ring.dur_us - op.ring_block_us)
        self.steps.append(Step("drain", "exposed context-parallel ring", phase=op.phase, microbatch=op.microbatch,
                               key="cp_ring", stream=CP_STREAM))

    def _param_gather(self, op: TraceOp) -> bool:
        """A bucket's parameter all-gather the distributed optimizer overlaps with the forward."""
        return self.job.overlap_param_gather and op.kind == "all_gather" and op.name.endswith("start_param_sync")

    def _label_tp(self, nested: list[TraceOp]) -> None:
        """Which linear's each of a pass's TP collectives is (:func:`label_pass`), kept by op."""
        if self.tp_gemms is None:
            return
        tp = [c for c in nested if c.group_name == TP_GROUP and c.kind in _COLLECTIVES]
        labels = label_pass([(c.kind, c.name) for c in tp], self.job.sequence_parallel)
        self.tp_labels.update((c.seq, label) for c, label in zip(tp, labels) if label is not None)

    def _tp_exposed_us(self, op: TraceOp, comm_us: float) -> float:
        """What TP collective ``op`` (of :meth:`_label_tp`) adds to its pass beside its GEMM."""
        tokens = op.bytes / (self.job.model.hidden_size * DTYPE_BYTES.get(op.dtype, 2))
        return 1e3 * float(collective_exposed_ms(comm_us / 1e3, self.tp_labels.pop(op.seq), tokens, self.tp_gemms,
                                                 self.job.layout.tp, tp_comm_overlap=self.job.tp_comm_overlap,
                                                 async_backward=self.job.async_tp_backward))

    def _segments(self, op: TraceOp, nested: list[TraceOp], total: float) -> list[float]:
        if not nested:
            return [total]
        starts = [c.start_us - op.start_us for c in nested]
        if not self.timed_comm or not any(s > 0 for s in starts):
            return [total / (len(nested) + 1)] * (len(nested) + 1)
        segments, cursor = [], op.start_us
        for comm in nested:
            segments.append(max(comm.start_us - cursor, 0.0))
            cursor = comm.start_us + comm.dur_us
        segments = [min(s, total) for s in segments]
        used = sum(segments)
        if used > total:  # clock jitter: keep the proportions, fit the total
            segments = [s * total / used for s in segments]
            used = total
        return segments + [total - used]

    def _comm(self, op: TraceOp, overlapped: bool = False) -> Step:
        """The step of communication op ``op``; ``overlapped``: a parameter gather beside the pass."""
        if op.kind in _COLLECTIVES:
            group = tuple(op.group or (self.trace.rank,))
            index = self.group_count[group]
            self.group_count[group] += 1
            members = self.job.representatives_of(group)
            stream = (GRAD_STREAM if self._launches_overlapped_reduction(op) else PARAM_STREAM if overlapped else "")
            cost = self._collective_us(op.kind, op.bytes, group)
            if op.seq in self.tp_labels:
                cost = self._tp_exposed_us(op, cost)
            return Step("async" if stream else "collective", op.kind, cost, op.phase, op.microbatch,
                        key=(group, index), members=members, bytes=op.bytes, stream=stream)
        parts = _parts(op)
        if self._within_my_stage(op):
            # peers this rank stands for run the same ring step at once: each part moves at the
            # same time as the others, beside the pass's compute
            cost = max((self.hw.p2p_us(part["bytes"], self.trace.rank, part["peer"]) for part in parts), default=0.0)
            return Step("async", "cp_ring", cost, op.phase, op.microbatch, bytes=op.bytes, stream=CP_STREAM)
        transfers = tuple(self._transfer(part, op.group_name) for part in parts)
        step = Step("p2p", op.kind, max((t[3] for t in transfers), default=0.0), op.phase, op.microbatch,
                    transfers=transfers, bytes=op.bytes)
        if op.handle in self.waited and op.parent is None:
            step.what = "post"
            self.requests[op.handle] = step
        return step

    def _collective_us(self, kind: str, nbytes: int, group: tuple) -> float:
        """The hardware's price, asked once per distinct collective (a rank repeats each per layer
        and micro-batch)."""
        key = (kind, nbytes, group)
        cost = self.collective_costs.get(key)
        if cost is None:
            cost = self.collective_costs[key] = self.hw.collective_us(kind, nbytes, group)
        return cost

    def _within_my_stage(self, op: TraceOp) -> bool:
        """A point-to-point op in a group whose members this rank all stands for: context
        parallelism's KV ring (transformer-engine overlaps each step with attention)."""
        if op.cat != "comm" or op.kind in _COLLECTIVES or not op.group:
            return False
        return self.job.representatives_of(op.group) == {self.trace.rank}

    def _transfer(self, part: dict, group_name: Optional[str]) -> tuple:
        """(sender, receiver, (group name, index), cost): the index-th transfer from sender to
        receiver in that group."""
        me, peer = self.trace.rank, part["peer"]
        if peer not in self.job.traces:
            raise TraceMismatch(f"{self.job.folder}: rank {me} exchanges with rank {peer}, which was not traced; {RETRACE}")
        if part["kind"] in P2P_SEND_KINDS:
            sender, receiver = me, peer
        elif part["kind"] in P2P_RECV_KINDS:
            sender, receiver = peer, me
        else:
            raise TraceMismatch(f"{self.job.folder}: rank {me} has a p2p part of kind {part['kind']!r}; {RETRACE}")
        channel = (group_name, sender, receiver)
        index = self.pair_count[channel]
        self.pair_count[channel] += 1
        return (sender, receiver, (group_name, index), self.hw.p2p_us(part["bytes"], sender, receiver))


def _parts(op: TraceOp) -> list[dict]:
    return op.parts if op.kind == "batch_isend_irecv" else [{"kind": op.kind, "peer": op.peer, "bytes": op.bytes}]


# -- the event loop -----------------------------------------------------------------------------


@dataclass(slots=True)
class Span:
    """Something a rank spent time on: ``row`` is ``compute``, ``comm``, ``wait`` or ``overlap``."""

    row: str
    label: str
    start_us: float
    dur_us: float
    phase: Optional[str] = None
    microbatch: Optional[int] = None


@dataclass
class RankReplay:
    """One representative rank's simulated iteration(s)."""

    rank: int
    stage: int
    end_us: float = 0.0
    compute_us: float = 0.0
    comm_us: Counter = field(default_factory=Counter)  # blocking communication by kind
    wait_us: Counter = field(default_factory=Counter)  # idle: waiting for peers, by what was awaited
    overlapped_us: float = 0.0  # communication hidden behind compute
    spans: list[Span] = field(default_factory=list)


@dataclass
class Replay:
    job: TracedJob
    hardware: Hardware
    ranks: dict[int, RankReplay]

    @property
    def makespan_us(self) -> float:
        return max(r.end_us for r in self.ranks.values())

    @property
    def iteration_us(self) -> float:
        return self.makespan_us / self.job.iterations


class _Loop:
    """Advances every rank in global time order.

    Compute on a node is shared: when the ranks computing on a node at once outnumber its
    ``compute_slots_per_node``, each computes at ``slots / busy`` of its traced speed (CPU
    processes sharing cores; GPUs have a slot each, so nothing changes there).  A representative
    counts for every rank it stands for on its node.
    """

    def __init__(self, job: TracedJob, steps: dict[int, list[Step]], hardware: Hardware, spans: bool = True) -> None:
        self.job, self.steps, self.hw, self.spans = job, steps, hardware, spans
        self.now = 0.0
        self.clock = dict.fromkeys(steps, 0.0)
        self.next = dict.fromkeys(steps, 0)
        self.overlap_free: dict[int, Counter] = {rank: Counter() for rank in steps}  # stream -> free at
        self.arrivals: dict[Any, dict[int, float]] = defaultdict(dict)
        self.posted: dict[tuple, dict[str, float]] = defaultdict(dict)
        self.out = {rank: RankReplay(rank, job.traces[rank].stage) for rank in steps}
        self.ready: list[tuple[float, int, int]] = []
        self.pushed = 0
        self.computing: dict[int, list] = {}  # rank -> [remaining us at full speed, started us, step]
        self.waiting: dict[int, Step] = {}
        self.watchers: dict[Any, set[int]] = defaultdict(set)
        self.weight = self._weights()

    def _weights(self) -> dict[int, int]:
        if self.hw.compute_slots_per_node >= self.hw.gpus_per_node:
            return {}
        weight: Counter = Counter()
        for rank in range(self.job.layout.world_size):
            rep = self.job.representative_of(rank)
            if self.hw.node_of(rank) == self.hw.node_of(rep):
                weight[rep] += 1
        return weight

    def _rate(self, rank: int) -> float:
        if not self.weight:
            return 1.0
        node = self.hw.node_of(rank)
        busy = sum(self.weight[r] for r in self.computing if self.hw.node_of(r) == node)
        return min(1.0, self.hw.compute_slots_per_node / busy)

    def _push(self, at: float, rank: int) -> None:
        heapq.heappush(self.ready, (at, self.pushed, rank))
        self.pushed += 1

    def run(self) -> dict[int, RankReplay]:
        for rank in self.steps:
            self._push(0.0, rank)
        while self.ready or self.computing:
            rates = {rank: self._rate(rank) for rank in self.computing}
            finisher = min(self.computing, key=lambda r: self.computing[r][0] / rates[r], default=None)
            finish_at = self.now + self.computing[finisher][0] / rates[finisher] if finisher is not None else math.inf
            if self.ready and self.ready[0][0] < finish_at:
                self._advance(self.ready[0][0], rates)
                self._start(heapq.heappop(self.ready)[2])
            else:
                self._advance(finish_at, rates)
                self._finish_compute(finisher)
        if self.waiting:
            raise TraceMismatch(f"{self.job.folder}: the traces wait on each other forever ({self._blocked()}); "
                                f"they do not come from one run: {RETRACE}")
        for rank, out in self.out.items():
            out.end_us = max(self.clock[rank], *self.overlap_free[rank].values(), 0.0)
        return self.out

    def _advance(self, to: float, rates: dict[int, float]) -> None:
        for rank, job in self.computing.items():
            job[0] -= rates[rank] * (to - self.now)
        self.now = to

    def _finish_compute(self, rank: int) -> None:
        _, started, step = self.computing.pop(rank)
        self._span(rank, step, "compute", started, self.now - started)
        self.out[rank].compute_us += self.now - started
        self.clock[rank] = self.now
        self._push(self.now, rank)

    def _blocked(self) -> str:
        waiting = [f"rank {r} at its {step.label} #{self.next[r]}" for r, step in self.waiting.items()]
        return ", ".join(waiting[:4])

    def _span(self, rank: int, step: Step, row: str, start: float, dur: float, label: str | None = None) -> None:
        if dur > 0 and self.spans:
            self.out[rank].spans.append(Span(row, label or step.label, start, dur, step.phase, step.microbatch))

    def _start(self, rank: int) -> None:
        """Issue ``rank``'s next steps at ``now`` until one takes time or has to wait."""
        steps, out = self.steps[rank], self.out[rank]
        self.clock[rank] = self.now
        while self.next[rank] < len(steps):
            step = steps[self.next[rank]]
            self.next[rank] += 1
            if step.what == "compute":
                if step.dur_us > 0 and not self.weight:  # a GPU of its own: done after its duration
                    self._span(rank, step, "compute", self.now, step.dur_us)
                    out.compute_us += step.dur_us
                    self._push(self.now + step.dur_us, rank)
                    return
                if step.dur_us > 0:
                    self.computing[rank] = [step.dur_us, self.now, step]
                    return
            elif step.what == "async":
                start = max(self.now, self.overlap_free[rank][step.stream])
                self._span(rank, step, "overlap", start, step.dur_us)
                self.overlap_free[rank][step.stream] = start + step.dur_us
                out.overlapped_us += step.dur_us
            elif step.what == "drain":
                exposed = max(self.overlap_free[rank][step.stream] - self.now, 0.0)
                if exposed > 0:
                    self._span(rank, step, "comm", self.now, exposed)
                    out.comm_us[step.key] += exposed
                    out.overlapped_us -= exposed
                    self.clock[rank] = self.now + exposed
                    self._push(self.now + exposed, rank)
                    return
            elif step.what == "post":
                for sender, receiver, index, _ in step.transfers:
                    self.posted[(sender, receiver, index)].setdefault("send" if sender == rank else "recv", self.now)
                self._wake_peers(rank, step.match_keys)
            else:
                self._communicate(rank, step)
                return

    def _communicate(self, rank: int, step: Step) -> None:
        if not self._try_complete(rank, step):
            self.waiting[rank] = step
            for key in step.match_keys:
                self.watchers[key].add(rank)
        self._wake_peers(rank, step.match_keys)

    def _wake_peers(self, rank: int, keys: list) -> None:
        """Complete the steps of peers waiting on ``keys``: this rank's arrival (or posting) may be
        what they lacked."""
        for key in keys:
            for peer in list(self.watchers.get(key, ())):
                if peer != rank and self._try_complete(peer, self.waiting[peer]):
                    self._stop_waiting(peer)

    def _stop_waiting(self, rank: int) -> None:
        for key in self.waiting.pop(rank).match_keys:
            self.watchers[key].discard(rank)
            if not self.watchers[key]:
                del self.watchers[key]

    def _try_complete(self, rank: int, step: Step) -> bool:
        now = self.clock[rank]  # when the rank arrived
        ready = self._collective_start(rank, step, now) if step.what == "collective" else self._p2p_start(rank, step, now)
        if ready is None:
            return False
        start, end = ready
        out = self.out[rank]
        waited = "pipeline" if step.what == "p2p" else step.label
        self._span(rank, step, "wait", now, start - now, f"wait: {waited}")
        self._span(rank, step, "comm", start, end - start)
        out.wait_us[waited] += start - now
        out.comm_us[step.label if step.what == "collective" else "p2p"] += end - start
        if step.key == POSTED:  # what moved before the rank came to wait was hidden
            out.overlapped_us += max(step.dur_us - (end - start), 0.0)
        self.clock[rank] = end
        self._push(end, rank)
        return True

    def _collective_start(self, rank: int, step: Step, now: float) -> Optional[tuple[float, float]]:
        if len(step.members) == 1:  # a group inside this rank's stage: its peers arrive with it
            return now, now + step.dur_us
        arrived = self.arrivals[step.key]
        arrived.setdefault(rank, now)
        if not step.members <= arrived.keys():
            return None
        start = max(arrived[m] for m in step.members)
        return start, start + step.dur_us

    def _p2p_start(self, rank: int, step: Step, now: float) -> Optional[tuple[float, float]]:
        ends = []
        for sender, receiver, index, cost in step.transfers:
            posted = self.posted[(sender, receiver, index)]
            posted.setdefault("send" if sender == rank else "recv", now)
            ends.append((posted, cost))
        if any(len(posted) < 2 for posted, _ in ends):
            return None
        # a transfer posted earlier may have arrived before the rank came to wait for it
        end = max(now, max(max(posted.values()) + cost for posted, cost in ends))
        return max(end - step.dur_us, now), end


def simulate_job(job: TracedJob, hardware: Hardware, *, spans: bool = True) -> Replay:
    """Replay ``job`` on ``hardware``: every representative rank side by side, shapes-only
    compute priced for ``hardware`` (:mod:`.reprice`).  ``spans=False`` keeps no per-step spans
    (what only a timeline draws: a million of them for a large layout)."""
    with cyclic_gc_paused():  # a million steps, none in a cycle: the collector's passes only cost time
        job = reprice(job, hardware)
        steps = {rank: _StepBuilder(job, trace, hardware).build() for rank, trace in sorted(job.traces.items())}
        return Replay(job, hardware, _Loop(job, steps, hardware, spans).run())


