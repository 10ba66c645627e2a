"""Traces as MLCommons Chakra execution traces (the input of ASTRA-sim and other simulators).

Each traced rank becomes one ``<prefix>.<rank>.et`` file: Chakra's ``GlobalMetadata``, then one
``Node`` per op in issue order, each a length-delimited protobuf message (Chakra's own
``et_def.proto``, written with the ``mlc-chakra`` package's generated classes and encoder):

* a compute op (forward, backward, loss, optimizer step) is a ``COMP_NODE`` of its traced
  duration;
* a collective is a ``COMM_COLL_NODE`` with ``comm_type`` (Chakra's ``CollectiveCommType``),
  ``comm_size`` (the buffer's bytes, as docs/trace_format.md defines them per kind) and the
  process group (``pg_name``, and ``involved_ranks``: its global ranks);
* a send or receive (``send``, ``isend``, ``recv``, ``irecv``) is a ``COMM_SEND_NODE`` or
  ``COMM_RECV_NODE`` with ``comm_src``, ``comm_dst`` and ``comm_size``; a ``batch_isend_irecv``
  becomes one such node per part, its bytes split as its parts are.

Dependencies follow the trace's replay rule: each node depends (``ctrl_deps``) on the node issued
before it on the rank, so the rank's issue order is kept, but for a transfer the rank waits on
later (a ``wait`` op: Megatron's overlapped pipeline communication): what follows it does not wait
for it, and the node after its wait depends on it. Byte and node counts equal the trace's: one
node per op, ``batch_isend_irecv`` counted by its parts, ``wait`` none.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_dynapipe.files import atomic_path
from megatron_dynapipe.tracer.trace_format import RankTrace, TraceOp

__all__ = ["CHAKRA_INSTALL_HINT", "check_chakra", "write_chakra", "write_chakra_folder"]

CHAKRA_INSTALL_HINT = "pip install mlc-chakra (MLCommons Chakra: its schema and encoder write the .et files)"
SCHEMA_VERSION = "0.0.4"
_COLLECTIVES = {"all_reduce": "ALL_REDUCE", "reduce": "REDUCE", "all_gather": "ALL_GATHER",
                "broadcast": "BROADCAST", "all_to_all": "ALL_TO_ALL", "reduce_scatter": "REDUCE_SCATTER",
                "barrier": "BARRIER"}
_SENDS, _RECEIVES = ("send", "isend"), ("recv", "irecv")


def check_chakra() -> None:
    """Raise ValueError (one line naming the fix) unless mlc-chakra can be imported."""
    _chakra()


def _chakra():
    try:
        from chakra.schema.protobuf import et_def_pb2
        from chakra.src.third_party.utils.protolib import encodeMessage
    except ImportError:
        raise ValueError(f"Chakra export needs the mlc-chakra package: {CHAKRA_INSTALL_HINT}") from None
    return et_def_pb2, encodeMessage


def _attr(pb, name: str, **value):
    return pb.AttributeProto(name=name, **value)


def _nodes(trace: RankTrace, pb):
    """The rank's ops as Chakra nodes, in issue order (module docstring)."""
    waited = {op.handle for op in trace.ops if op.kind == "wait"}
    next_id = 0
    after: list[int] = []  # what the next node depends on
    posted: dict[int, list[int]] = {}  # a request's nodes, until it is waited on

    def node(op: TraceOp, node_type, name: str, *attrs):
        nonlocal next_id, after
        made = pb.Node(id=next_id, name=name, type=node_type, start_time_micros=int(op.start_us),
                       duration_micros=int(round(op.dur_us)),
                       attr=[_attr(pb, "is_cpu_op", bool_val=False), *attrs])
        made.ctrl_deps.extend(after)
        if op.handle in waited:
            posted.setdefault(op.handle, []).append(next_id)
        else:
            after = [next_id]
        next_id += 1
        return made

    for op in trace.ops:
        label = f"{op.kind}:{op.name}" if op.name else op.kind
        if op.kind == "wait":
            after = after + posted.pop(op.handle, [])
        elif op.cat == "compute":
            yield node(op, pb.COMP_NODE, label)
        elif op.kind in _COLLECTIVES:
            yield node(op, pb.COMM_COLL_NODE, label,
                       _attr(pb, "comm_type", int64_val=pb.CollectiveCommType.Value(_COLLECTIVES[op.kind])),
                       _attr(pb, "comm_size", int64_val=int(op.bytes)),
                       _attr(pb, "pg_name", string_val=op.group_name or ""),
                       _attr(pb, "involved_ranks", int64_list=pb.Int64List(values=list(op.group or ()))))
        elif op.kind in _SENDS + _RECEIVES:
            yield _p2p(node, pb, op, label, op.kind, op.peer, op.bytes, trace.rank)
        elif op.kind == "batch_isend_irecv":
            for part in op.parts or ():
                yield _p2p(node, pb, op, label, part["kind"], part["peer"], part["bytes"], trace.rank)
        else:
            raise ValueError(f"rank {trace.rank} op {op.seq}: no Chakra node for a {op.kind!r} op")


def _p2p(node, pb, op: TraceOp, label: str, kind: str, peer: int, size: int, rank: int):
    sending = kind in _SENDS
    src, dst = (rank, peer) if sending else (peer, rank)
    return node(op, pb.COMM_SEND_NODE if sending else pb.COMM_RECV_NODE, label,
                _attr(pb, "comm_src", int32_val=int(src)), _attr(pb, "comm_dst", int32_val=int(dst)),
                _attr(pb, "comm_size", int64_val=int(size)), _attr(pb, "comm_tag", int32_val=0))


def write_chakra(trace: RankTrace, path: "str | os.PathLike") -> dict:
    """Write ``trace`` as one Chakra execution trace at ``path`` (atomically); returns its node
    count and its bytes communicated (collectives and sends, receives not counted twice)."""
    pb, encode = _chakra()
    nodes = sent = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        encode(f, pb.GlobalMetadata(version=SCHEMA_VERSION, attr=[
            _attr(pb, "source", string_val="megatron-dynapipe trace"),
            _attr(pb, "rank", int64_val=trace.rank), _attr(pb, "clock", string_val=str(trace.clock))]))
        for made in _nodes(trace, pb):
            encode(f, made)
            nodes += 1
            if made.type in (pb.COMM_COLL_NODE, pb.COMM_SEND_NODE):
                sent += next(a.int64_val for a in made.attr if a.name == "comm_size")
    return {"path": str(path), "nodes": nodes, "comm_bytes": sent}


def write_chakra_folder(folder: "str | os.PathLike", output: "str | os.PathLike | None" = None,
                        prefix: str = "et") -> list[dict]:
    """Every ``rank_<r>.trace.jsonl`` of a trace folder as ``<output>/<prefix>.<r>.et`` (default
    output: ``<folder>/chakra``), the file naming Chakra's tools and ASTRA-sim expect."""
    from megatron_dynapipe.tracer.trace_format import read_traces

    traces = read_traces(folder)
    if not traces:
        raise ValueError(f"{folder} holds no rank_<r>.trace.jsonl: trace a layout into it first")
    out = Path(output) if output is not None else Path(folder) / "chakra"
    out.mkdir(parents=True, exist_ok=True)
    return [dict(write_chakra(trace, out / f"{prefix}.{rank}.et"), rank=rank) for rank, trace in traces.items()]
