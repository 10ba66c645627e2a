"""Traces as MLCommons Chakra execution traces, read back with Chakra's own reader."""

from __future__ import annotations

import json

import pytest

from megatron_dynapipe.tracer.chakra import write_chakra_folder

et_def = pytest.importorskip("chakra.schema.protobuf.et_def_pb2", reason="needs mlc-chakra: pip install -e \".[chakra]\"")
protolib = pytest.importorskip("chakra.src.third_party.utils.protolib")


def _read_with_chakra(path):
    """Chakra's reader: the global metadata, then nodes until the file ends."""
    with protolib.openFileRd(str(path)) as f:
        metadata = et_def.GlobalMetadata()
        assert protolib.decodeMessage(f, metadata)
        nodes = []
        while True:
            node = et_def.Node()
            if not protolib.decodeMessage(f, node):
                return metadata, nodes
            nodes.append(node)


def _attrs(node):
    return {a.name: a for a in node.attr}


def _expected(trace_path):
    """From the trace file's own lines: one node per op, a batch_isend_irecv one per part; the
    bytes of every collective and every send."""
    ops = [json.loads(line) for line in trace_path.read_text().splitlines()[1:]]
    nodes = sum(len(op["parts"]) if op["kind"] == "batch_isend_irecv" else op["kind"] != "wait" for op in ops)
    sent = sum(op["bytes"] for op in ops if op["cat"] == "comm" and op["kind"] not in
               ("recv", "irecv", "batch_isend_irecv", "wait"))
    sent += sum(p["bytes"] for op in ops if op["kind"] == "batch_isend_irecv" for p in op["parts"]
                if p["kind"] == "isend")
    return ops, nodes, sent


def _check_issue_order(ops, nodes):
    """Each node comes after every node issued before it (through its dependencies), but for a
    transfer whose wait comes later: the rank goes on while it moves."""
    parts = [(op, part) for op in ops if op["kind"] != "wait" for part in (op.get("parts") or [op])]
    assert len(parts) == len(nodes)
    wait_at = {op["handle"]: i for i, op in enumerate(ops) if op["kind"] == "wait"}
    index = {id(op): i for i, op in enumerate(ops)}
    reach: list[set[int]] = []
    for node in nodes:
        assert all(d < node.id for d in node.ctrl_deps)
        reach.append(set(node.ctrl_deps).union(*(reach[d] for d in node.ctrl_deps)))
    for j, (op_j, _) in enumerate(parts):
        for i, (op_i, _) in enumerate(parts[:j]):
            ahead = index[id(op_i)] < index[id(op_j)]
            pending = wait_at.get(op_i.get("handle"), -1) > index[id(op_j)]
            assert (i in reach[j]) == (ahead and not pending), (i, j)


@pytest.mark.parametrize("line", ["16 2 2", "4 4 1"])
def test_every_rank_becomes_a_chakra_trace_with_the_traces_nodes_and_bytes(tiny_traces, tmp_path, line):
    folder = tiny_traces[line]
    written = write_chakra_folder(folder, tmp_path)
    assert written and all(f["path"].endswith(f"et.{f['rank']}.et") for f in written)
    for f in written:
        ops, expected_nodes, expected_sent = _expected(folder / f"rank_{f['rank']}.trace.jsonl")
        metadata, nodes = _read_with_chakra(f["path"])
        assert metadata.version and len(nodes) == expected_nodes == f["nodes"]
        sizes = [_attrs(n)["comm_size"].int64_val for n in nodes
                 if n.type in (et_def.COMM_COLL_NODE, et_def.COMM_SEND_NODE)]
        assert sum(sizes) == expected_sent == f["comm_bytes"]
        assert [n.id for n in nodes] == list(range(len(nodes)))
        _check_issue_order(ops, nodes)
        computes = [op for op in ops if op["cat"] == "compute"]
        assert sum(n.type == et_def.COMP_NODE for n in nodes) == len(computes)
        tp_reduces = [n for n in nodes if n.type == et_def.COMM_COLL_NODE
                      and _attrs(n)["pg_name"].string_val == "TENSOR_MODEL_PARALLEL_GROUP"]
        for n in tp_reduces:
            assert _attrs(n)["comm_type"].int64_val == et_def.ALL_REDUCE
            assert len(_attrs(n)["involved_ranks"].int64_list.values) == int(line.split()[2])
        for n in nodes:
            if n.type in (et_def.COMM_SEND_NODE, et_def.COMM_RECV_NODE):
                a = _attrs(n)
                mine = a["comm_src"].int32_val if n.type == et_def.COMM_SEND_NODE else a["comm_dst"].int32_val
                assert mine == f["rank"] and a["comm_src"].int32_val != a["comm_dst"].int32_val


def test_trace_format_chakra_writes_them_beside_the_trace(tmp_path, capsys):
    from megatron_dynapipe.tracer import cli as trace_cli

    code = trace_cli.main(["--model", "tiny", "--config", "8 2 1", "--output-dir", str(tmp_path), "--format",
                           "chakra", "--isolation", "inline", "--no-progress", "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    (folder, files), = summary["chakra"].items()
    assert sorted(f["rank"] for f in files) == [0, 4]
    assert all(_read_with_chakra(f["path"])[1] for f in files)
