"""Per-rank workload traces: one versioned JSON-lines file per traced rank.

A trace file ``rank_<r>.trace.jsonl`` holds a header line followed by one line per operation, in
the order the rank issued them (see docs/trace_format.md for every field and for how a step-time
simulator replays a set of them)::

    {"type": "header", "format": "megatron-dynapipe-trace", "version": 1, "rank": 3, ...}
    {"seq": 0, "iteration": 0, "stage": 0, "cat": "compute", "kind": "forward", ...}
    {"seq": 1, "iteration": 0, "stage": 0, "cat": "comm", "kind": "all_reduce", ...}

:class:`RankTrace` is the in-memory form; :meth:`RankTrace.write` writes it atomically (temporary
file in the same folder, then ``os.replace``) and :meth:`RankTrace.read` checks the format name,
the version and the op count before it returns anything.  :meth:`RankTrace.chrome_trace` turns
one rank's trace into the Trace Event Format that chrome://tracing and Perfetto open.

Nothing here imports torch: traces can be read where only the planner is installed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_dynapipe.chrome_trace import ChromeTrace
from megatron_dynapipe.files import write_atomically
from megatron_dynapipe.planning.collector import cyclic_gc_paused

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "RECORDING_REVISION",
    "COMPUTE_KINDS",
    "COMM_KINDS",
    "P2P_SEND_KINDS",
    "P2P_RECV_KINDS",
    "DTYPE_BYTES",
    "TraceFormatError",
    "TraceOp",
    "RankTrace",
    "trace_path",
    "read_trace",
    "read_traces",
    "subtrees",
]

FORMAT_NAME = "megatron-dynapipe-trace"
#: Bumped whenever a field changes meaning or a required field is added; readers refuse others.
FORMAT_VERSION = 1
#: Bumped whenever the tracer records more of the same run in the same format (2: the waits on
#: point-to-point requests; 3: the context-parallel ring's blocks, ``ring_block_us``), so that a
#: kept trace of an earlier revision is traced again.
RECORDING_REVISION = 3

#: ``cat == "compute"`` kinds.
COMPUTE_KINDS = ("forward", "backward", "loss", "optimizer_step")
#: ``cat == "comm"`` kinds.
COMM_KINDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "wait",
)
P2P_SEND_KINDS = ("send", "isend")
#: bytes of one element of an op's ``dtype``
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
P2P_RECV_KINDS = ("recv", "irecv")


class TraceFormatError(ValueError):
    """A trace file is not a (complete) trace of the version this reader understands."""


# ---------------------------------------------------------------------------------------------
# files


def trace_path(directory: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank``'s trace lives in ``directory``."""
    return Path(directory) / f"rank_{rank}.trace.jsonl"


# ---------------------------------------------------------------------------------------------
# ops


def _tuple_or_none(value):
    return None if value is None else tuple(value)


@dataclass(slots=True)  # millions of ops in a large layout: less memory, faster to build
class TraceOp:
    """One operation a rank issued.  ``cat`` is ``"compute"`` or ``"comm"``.

    Times are microseconds from the start of the first traced iteration; ``start_us`` is when
    the op was issued and ``dur_us`` how long it took (see the header's ``clock`` for what that
    means).  ``parent`` is the ``seq`` of the compute op this op was issued from (a TP all-reduce
    inside a forward, the loss inside the last stage's forward), ``None`` at top level.
    ``chunk`` is the model chunk (virtual pipeline stage on this rank) a forward, backward or
    loss ran, and that of the comm ops issued inside it; ``None`` without interleaving.
    ``phase`` names the region of the step it belongs to (``forward``, ``backward``,
    ``finalize_grads``, ``optimizer_step``).

    Communication fields: ``group`` the sorted global ranks of the process group, ``group_name``
    megatron's description of it, ``peer`` the global rank of the other side (p2p, broadcast and
    reduce roots), ``shape``/``dtype``/``bytes`` the full-size buffer (see docs/trace_format.md
    for which buffer that is per kind), ``parts`` the sends and receives of a
    ``batch_isend_irecv``, ``splits`` the ``in``/``out`` split sizes of an uneven all-to-all,
    ``coalesced`` an id shared by the collectives launched together under one coalescing manager,
    ``handle`` the id of a point-to-point op's request, and on a ``wait`` op the request it waits
    for (the first wait on any of an op's requests; a request never waited on has no ``wait``).

    ``ring_block_us``, on a forward or backward of a shapes-only trace under context parallelism:
    one block of the ring's attention in a layer, which each of the pass's ring transfers runs
    beside (the replay exposes what a transfer takes beyond it); absent elsewhere.
    """

    seq: int
    iteration: int
    stage: int
    cat: str
    kind: str
    name: str = ""
    microbatch: Optional[int] = None
    chunk: Optional[int] = None
    phase: Optional[str] = None
    parent: Optional[int] = None
    group: Optional[tuple[int, ...]] = None
    group_name: Optional[str] = None
    peer: Optional[int] = None
    shape: Optional[tuple[int, ...]] = None
    dtype: Optional[str] = None
    bytes: int = 0
    parts: Optional[list[dict[str, Any]]] = None
    splits: Optional[dict[str, Optional[list[int]]]] = None
    coalesced: Optional[int] = None
    handle: Optional[int] = None
    ring_block_us: Optional[float] = None
    start_us: float = 0.0
    dur_us: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in _OP_FIELD_ORDER:  # dataclasses.fields() per op was a third of reading a trace
            value = getattr(self, name)
            if value is None and name not in _ALWAYS:
                continue
            if isinstance(value, tuple):
                value = list(value)
            out[name] = value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TraceOp":
        if not _OP_FIELDS.issuperset(data):  # set operations only on a bad op: readers parse millions
            raise TraceFormatError(f"unknown op field(s) {sorted(set(data) - _OP_FIELDS)}")
        if not _REQUIRED_OP_FIELDS.issubset(data):
            raise TraceFormatError(f"op is missing field(s) {sorted(_REQUIRED_OP_FIELDS - set(data))}")
        if data["cat"] not in ("compute", "comm"):
            raise TraceFormatError(f"op cat must be 'compute' or 'comm', got {data['cat']!r}")
        group, shape = data.get("group"), data.get("shape")
        if group is not None or shape is not None:
            data = dict(data, group=_tuple_or_none(group), shape=_tuple_or_none(shape))
        return cls(**data)

    def signature(self) -> tuple:
        """What two traces of the same rank must agree on: everything but times, the call site
        and the shape split of the buffer (``kind, cat, microbatch, chunk, phase, group, peer, bytes,
        dtype, parts``)."""
        parts = None
        if self.parts is not None:
            parts = tuple((p["kind"], p["peer"], p["bytes"], p["dtype"]) for p in self.parts)
        return (
            self.cat,
            self.kind,
            self.microbatch,
            self.chunk,
            self.phase,
            self.group,
            self.peer,
            self.bytes,
            self.dtype,
            parts,
        )


def _header(line: str, source: str) -> dict[str, Any]:
    """A trace file's first line as its header: format name and version checked."""
    if not line.strip():
        raise TraceFormatError(f"{source}: empty file, not a {FORMAT_NAME} trace")
    try:
        header = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{source}: header line is not JSON ({exc})") from exc
    if not isinstance(header, dict) or header.get("type") != "header":
        raise TraceFormatError(f"{source}: first line is not a trace header")
    if header.get("format") != FORMAT_NAME:
        raise TraceFormatError(f"{source}: format {header.get('format')!r} is not {FORMAT_NAME!r}")
    version = header.get("version")
    if version != FORMAT_VERSION:
        raise TraceFormatError(
            f"{source}: trace format version {version!r}, this reader understands version "
            f"{FORMAT_VERSION} only; re-trace or use a matching megatron-dynapipe"
        )
    return header


_OP_FIELD_ORDER = tuple(f.name for f in dataclasses.fields(TraceOp))
_OP_FIELDS = frozenset(_OP_FIELD_ORDER)
_REQUIRED_OP_FIELDS = frozenset({"seq", "iteration", "stage", "cat", "kind"})
_ALWAYS = {"microbatch", "parent", "group", "peer"}


# ---------------------------------------------------------------------------------------------
# a rank's trace


@dataclass
class RankTrace:
    """Everything traced on one rank: the header (where the rank sits in the job, what ran)
    and its ops in issue order.

    ``layout`` is the parallel layout as a dict (``world_size, tp, pp, cp, ep, dp, expert_tp,
    order``), ``coords``/``expert_coords`` the rank's dense and expert coordinates, ``groups``
    its process groups (``{kind: [global ranks]}``), ``model`` the model configuration,
    ``iteration`` the run settings (``micro_batch_size, num_microbatches, seq_length,
    warmup_iters, trace_iters, schedule``), ``mode`` ``"real"`` or ``"shapes_only"``, ``clock``
    how durations were measured (``wall``, ``cuda_events`` or ``cost_model``), ``memory`` the
    peak-memory figures and how they were obtained, ``meta`` versions and timings of the tracer.
    """

    rank: int
    stage: int
    layout: dict[str, Any]
    coords: dict[str, int]
    groups: dict[str, list[int]]
    model: dict[str, Any]
    iteration: dict[str, Any]
    mode: str = "real"
    device: str = "cpu"
    clock: str = "wall"
    expert_coords: Optional[dict[str, int]] = None
    memory: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    ops: list[TraceOp] = field(default_factory=list)

    # -- queries ------------------------------------------------------------------------------
    @property
    def compute_ops(self) -> list[TraceOp]:
        return [op for op in self.ops if op.cat == "compute"]

    @property
    def comm_ops(self) -> list[TraceOp]:
        return [op for op in self.ops if op.cat == "comm"]

    def signatures(self) -> list[tuple]:
        """:meth:`TraceOp.signature` of every op, in order: what fidelity checks compare."""
        return [op.signature() for op in self.ops]

    def summary(self) -> dict[str, Any]:
        """Counts and totals per op kind (bytes for communication, microseconds for all)."""
        kinds: dict[str, dict[str, float]] = {}
        for op in self.ops:
            entry = kinds.setdefault(op.kind, {"count": 0, "bytes": 0, "dur_us": 0.0})
            entry["count"] += 1
            entry["bytes"] += op.bytes
            entry["dur_us"] += op.dur_us
        return {
            "rank": self.rank,
            "stage": self.stage,
            "ops": len(self.ops),
            "kinds": kinds,
            "peak_memory_bytes": self.memory.get("peak_bytes"),
        }

    # -- files ----------------------------------------------------------------------------------
    def header(self) -> dict[str, Any]:
        return {
            "type": "header",
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "rank": self.rank,
            "stage": self.stage,
            "layout": self.layout,
            "coords": self.coords,
            "expert_coords": self.expert_coords,
            "groups": self.groups,
            "model": self.model,
            "iteration": self.iteration,
            "mode": self.mode,
            "device": self.device,
            "clock": self.clock,
            "memory": self.memory,
            "meta": self.meta,
            "num_ops": len(self.ops),
        }

    def dumps(self) -> str:
        lines = [json.dumps(self.header(), sort_keys=True)]
        lines += [json.dumps(op.to_json(), separators=(",", ":")) for op in self.ops]
        return "\n".join(lines) + "\n"

    def write(self, directory: str | os.PathLike) -> Path:
        """Write ``<directory>/rank_<rank>.trace.jsonl`` atomically; returns the path."""
        return write_atomically(trace_path(directory, self.rank), self.dumps())

    @classmethod
    def loads(cls, text: str, source: str = "<string>") -> "RankTrace":
        lines = [line for line in text.splitlines() if line.strip()]
        header = _header(lines[0] if lines else "", source)
        try:  # one decode of every op line at once; line by line only to name a bad line
            values = json.loads("[" + ",".join(lines[1:]) + "]")
        except json.JSONDecodeError:
            values = None
        if values is not None and len(values) != len(lines) - 1:  # a line held a comma-joined pair
            values = None
        ops = []
        for number, line in enumerate(lines[1:], start=2):
            try:
                ops.append(TraceOp.from_json(json.loads(line) if values is None else values[number - 2]))
            except (json.JSONDecodeError, TypeError, AttributeError, TraceFormatError) as exc:
                raise TraceFormatError(f"{source}:{number}: bad op line ({exc})") from exc
        if header.get("num_ops") != len(ops):
            raise TraceFormatError(
                f"{source}: header announces {header.get('num_ops')} ops, file has {len(ops)}"
            )
        for expected, op in enumerate(ops):
            if op.seq != expected:
                raise TraceFormatError(f"{source}: op #{expected} has seq {op.seq}")
        kwargs = {f.name: header[f.name] for f in dataclasses.fields(cls) if f.name in header}
        kwargs.pop("ops", None)
        try:
            return cls(**kwargs, ops=ops)
        except TypeError as exc:
            raise TraceFormatError(f"{source}: incomplete header ({exc})") from exc

    @staticmethod
    def read_header(path: str | os.PathLike) -> dict[str, Any]:
        """The validated header of a trace file, without reading its ops."""
        with open(path, encoding="utf-8") as f:
            return _header(f.readline(), str(path))

    @classmethod
    def read(cls, path: str | os.PathLike) -> "RankTrace":
        """Read and validate one trace file (format name, version, op count, seq order)."""
        path = Path(path)
        with cyclic_gc_paused():
            return cls.loads(path.read_text(encoding="utf-8"), source=str(path))

    # -- Chrome / Perfetto ----------------------------------------------------------------------
    def add_to(self, trace: ChromeTrace) -> ChromeTrace:
        """This rank as one process of ``trace``: a row for compute and one per communication
        group; nested compute (the loss inside a forward) shares the compute row, where the
        viewer draws it inside its parent."""
        pid = self.rank
        trace.process(pid, f"rank {self.rank} (stage {self.stage})")
        trace.row(pid, "compute")
        for op in self.ops:
            if op.cat == "compute":
                row, label = "compute", op.kind if op.microbatch is None else f"{op.kind} {op.microbatch}"
            else:
                row, label = f"comm {op.group_name or op.group}", op.kind
            args = {k: v for k, v in op.to_json().items() if k not in ("start_us", "dur_us")}
            trace.span(pid, row, label, cat=op.cat, start_us=op.start_us, dur_us=op.dur_us, args=args)
        return trace

    def chrome_trace(self) -> ChromeTrace:
        return self.add_to(ChromeTrace(format=FORMAT_NAME, version=FORMAT_VERSION, rank=self.rank,
                                       clock=self.clock, mode=self.mode))


def read_trace(path: str | os.PathLike) -> RankTrace:
    return RankTrace.read(path)


def read_traces(directory: str | os.PathLike) -> dict[int, RankTrace]:
    """Every ``rank_<r>.trace.jsonl`` in ``directory``, by rank."""
    out = {}
    for path in sorted(Path(directory).glob("rank_*.trace.jsonl")):  # each read pauses the collector
        trace = RankTrace.read(path)
        out[trace.rank] = trace
    return out


def subtrees(ops: list[TraceOp]) -> dict[int, list[TraceOp]]:
    """Each top-level op's ``seq`` -> that op and every op issued from it (at any depth), in
    issue order.  A parent comes before what it issues, so one pass finds every op's root."""
    root_of: dict[int, int] = {}
    trees: dict[int, list[TraceOp]] = {}
    for op in ops:
        root = op.seq if op.parent is None else root_of.get(op.parent)
        if root is None:  # issued from an op that is not in the list
            continue
        root_of[op.seq] = root
        trees.setdefault(root, []).append(op)
    return trees
