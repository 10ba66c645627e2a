"""The op recorder and the trace files.

* on a real 2-process gloo group the recorder sees a known all_reduce, all_gather, isend/irecv
  and batch_isend_irecv with the right kind, group (global ranks), peer, shape, dtype and bytes,
  records nothing outside a traced iteration, and puts every patched function back;
* with a fake process group, ``fill`` makes collectives deliver what identical peers would, and
  ``execute=False`` records meta-tensor collectives without calling the backend;
* the activation meter counts what autograd saves, minus registered model state;
* trace files round-trip, are written atomically, and readers refuse other versions.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_dynapipe.local_ranks import run_local_ranks
from megatron_dynapipe.tracer import trace_format
from megatron_dynapipe.tracer.trace_format import (
    FORMAT_VERSION,
    RankTrace,
    TraceFormatError,
    TraceOp,
    read_traces,
    trace_path,
)

# --------------------------------------------------------------------------------------------
# real gloo group
# --------------------------------------------------------------------------------------------


def _record_known_ops(rank, world_size):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from megatron_dynapipe.tracer.recorder import Recorder

    originals = {name: getattr(dist, name) for name in ("all_reduce", "isend", "batch_isend_irecv")}
    pair = dist.new_group([0, 1], group_desc="PAIR_GROUP")
    peer = 1 - rank
    recorder = Recorder(hook_schedules=False, clock="wall")
    with recorder:
        patched = dist.all_reduce is not originals["all_reduce"] and c10d.isend is dist.isend
        dist.all_reduce(torch.ones(3, 5))  # not in a traced iteration: not recorded
        with recorder.iteration(0):
            x = torch.full((4, 8), float(rank + 1))
            dist.all_reduce(x)  # default group
            gathered = torch.empty(2 * 6, dtype=torch.float64)
            dist.all_gather_into_tensor(gathered, torch.full((6,), float(rank), dtype=torch.float64), group=pair)
            if rank == 0:
                dist.isend(torch.arange(10, dtype=torch.int32), dst=1).wait()
            else:
                buf = torch.empty(10, dtype=torch.int32)
                dist.irecv(buf, src=0).wait()
                assert buf.tolist() == list(range(10))
            send = torch.full((2, 3), float(rank))
            recv = torch.empty(2, 3)
            ops = [dist.P2POp(dist.isend, send, peer, pair), dist.P2POp(dist.irecv, recv, peer, pair)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            assert recv.eq(float(peer)).all()
    restored = all(getattr(dist, name) is fn for name, fn in originals.items())
    restored = restored and c10d.isend is originals["isend"]
    return {
        "patched": patched,
        "restored": restored,
        "sum": x[0, 0].item(),
        "gathered": gathered.tolist(),
        "ops": [op.to_json() for op in recorder.ops],
    }


@pytest.mark.slow
def test_recorder_captures_collectives_and_p2p_on_gloo():
    results = run_local_ranks(_record_known_ops, 2, timeout=90)
    for rank, result in enumerate(results):
        assert result["patched"] and result["restored"]
        assert result["sum"] == 3.0  # the real collective still ran
        assert result["gathered"] == [0.0] * 6 + [1.0] * 6
        ops = [TraceOp.from_json(op) for op in result["ops"]]
        assert [op.kind for op in ops] == [
            "all_reduce",
            "all_gather",
            "isend" if rank == 0 else "irecv",
            "wait",
            "batch_isend_irecv",
            "wait",  # the batch's first request waited on; its second adds nothing
        ]
        assert [op.seq for op in ops] == list(range(6))
        reduce, gather, p2p, p2p_wait, batch, batch_wait = ops
        # each request's wait carries the handle of the op that posted it
        assert (p2p.handle, p2p_wait.handle, batch.handle, batch_wait.handle) == (0, 0, 1, 1)
        assert reduce.handle is None and gather.handle is None
        ops = [reduce, gather, p2p, batch]
        assert all(op.cat == "comm" and op.iteration == 0 and op.parent is None for op in ops)
        assert reduce.group == (0, 1) and reduce.shape == (4, 8)
        assert reduce.dtype == "float32" and reduce.bytes == 4 * 8 * 4
        assert gather.group == (0, 1) and gather.group_name == "PAIR_GROUP"
        assert gather.shape == (12,) and gather.dtype == "float64" and gather.bytes == 12 * 8
        assert p2p.peer == 1 - rank and p2p.bytes == 10 * 4 and p2p.dtype == "int32"
        assert batch.group_name == "PAIR_GROUP" and batch.bytes == 2 * 2 * 3 * 4
        assert batch.parts == [
            {"kind": "isend", "peer": 1 - rank, "shape": [2, 3], "dtype": "float32", "bytes": 24},
            {"kind": "irecv", "peer": 1 - rank, "shape": [2, 3], "dtype": "float32", "bytes": 24},
        ]
        assert all(op.name.startswith("test_recorder.") for op in ops)
        assert all(op.dur_us >= 0 and op.start_us >= 0 for op in ops)


# --------------------------------------------------------------------------------------------
# fake process group: filled values, dry runs
# --------------------------------------------------------------------------------------------


@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_fill_delivers_what_identical_peers_would(fake_group):
    dist = fake_group
    from megatron_dynapipe.tracer.recorder import Recorder

    recorder = Recorder(hook_schedules=False, fill=True, seed=3)
    with recorder, recorder.iteration(0):
        x = torch.tensor([1.0, 2.0])
        dist.all_reduce(x)
        assert x.tolist() == [4.0, 8.0]  # SUM over 4 identical ranks
        m = torch.tensor([5.0])
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        assert m.tolist() == [5.0]
        out = torch.empty(8)
        dist.all_gather_into_tensor(out, torch.tensor([1.0, 2.0]))
        assert out.tolist() == [1.0, 2.0] * 4
        shard = torch.empty(2)
        dist.reduce_scatter_tensor(shard, torch.arange(8.0))
        assert shard.tolist() == [8.0, 12.0]  # rank 1's chunk [2, 3] summed over 4 ranks
        counts = torch.empty(5, 3)
        dist.all_to_all_single(counts, torch.arange(6.0).view(2, 3), [2, 1, 1, 1], [1, 1, 0, 0])
        assert counts[:, 0].tolist() == [0.0, 3.0, 0.0, 3.0, 0.0]  # local rows, cycled
        recv = torch.full((3, 4), float("nan"))
        dist.irecv(recv, src=0).wait()
        assert torch.isfinite(recv).all() and recv.std() > 0
    kinds = [(op.kind, op.bytes) for op in recorder.ops]
    assert kinds == [
        ("all_reduce", 8), ("all_reduce", 4), ("all_gather", 32), ("reduce_scatter", 32),
        ("all_to_all", 24), ("irecv", 48), ("wait", 0),
    ]
    assert recorder.ops[4].splits == {"in": [1, 1, 0, 0], "out": [2, 1, 1, 1]}
    assert recorder.ops[5].peer == 0 and recorder.ops[0].group == (0, 1, 2, 3)


def test_dry_run_records_meta_collectives_without_the_backend(fake_group):
    dist = fake_group
    from torch.distributed import _coalescing_manager

    from megatron_dynapipe.tracer.recorder import Recorder

    recorder = Recorder(hook_schedules=False, execute=False, clock="cost_model",
                        cost_fn=lambda kind, mb, chunk: 1.0)
    with recorder, recorder.iteration(0):
        group = dist.new_group([0, 1, 2, 3])
        with _coalescing_manager(group, async_ops=True) as cm:
            work = dist.all_reduce(torch.empty(1000, device="meta", dtype=torch.bfloat16), async_op=True)
            dist.all_reduce(torch.empty(10, device="meta"), group=group, async_op=True)
        cm.wait()
        assert work.wait()
        a, b = torch.empty(4, 2, device="meta"), torch.empty(4, 2, device="meta")
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, 2), dist.P2POp(dist.irecv, b, 0)])
        assert all(r.wait() for r in reqs)
        with recorder.compute("forward", microbatch=0):
            dist.all_reduce(torch.empty(3, device="meta"))
    first, second, batch, wait, fwd, inner = recorder.ops
    assert first.bytes == 2000 and first.dtype == "bfloat16" and first.coalesced == second.coalesced
    assert batch.parts[0]["peer"] == 2 and batch.parts[1]["peer"] == 0 and batch.bytes == 64
    assert wait.kind == "wait" and wait.handle == batch.handle == 0 and wait.dur_us == 0.0
    assert fwd.cat == "compute" and fwd.dur_us == 1000.0 and inner.parent == fwd.seq
    assert inner.microbatch == 0 and inner.phase == "forward" and inner.coalesced is None


def test_recorder_rejects_a_cost_clock_without_costs():
    from megatron_dynapipe.tracer.recorder import Recorder

    with pytest.raises(ValueError, match="cost_fn"):
        Recorder(clock="cost_model")
    with pytest.raises(ValueError, match="clock"):
        Recorder(clock="sundial")


def test_activation_meter_counts_saved_tensors_but_not_model_state():
    from megatron_dynapipe.tracer.activation_meter import ActivationMeter

    meter = ActivationMeter()
    weight = torch.randn(16, 32, requires_grad=True)
    meter.set_static([weight])
    outputs = []
    for mb in range(3):
        x = torch.randn(8, 16, requires_grad=True)
        with meter.forward(mb):
            h = x @ weight  # saves x (8x16 floats) and weight (static)
            y = torch.tanh(h)  # saves its output (8x32 floats)
        outputs.append(y)
    per_mb = 8 * 16 * 4 + 8 * 32 * 4
    assert meter.per_microbatch == {0: per_mb, 1: per_mb, 2: per_mb}
    assert meter.peak_bytes == 3 * per_mb and meter.peak_in_flight == 3
    outputs[0].sum().backward()
    meter.backward_done(0)
    assert meter.live == 2 * per_mb and meter.peak_bytes == 3 * per_mb


def test_activation_meter_skips_a_graph_dropped_inside_the_forward():
    # megatron-core's recomputed layer runs under no_grad, but its bias-dropout-add under
    # enable_grad: the dropout mask is saved for a graph that is gone when the forward ends
    from megatron_dynapipe.tracer.activation_meter import ActivationMeter

    meter = ActivationMeter()
    x = torch.randn(8, 16, requires_grad=True)
    with meter.forward("dropped"):
        with torch.no_grad(), torch.enable_grad():
            out = torch.nn.functional.dropout(x * 2, 0.5, True).detach()
    with meter.forward("kept"):
        kept = torch.tanh(x)  # saves its output: 8 x 16 floats
    assert out.shape == kept.shape
    assert meter.per_microbatch == {"dropped": 0, "kept": 8 * 16 * 4}


def test_activation_meter_probes_what_a_module_saves_and_its_inputs():
    from megatron_dynapipe.tracer.activation_meter import ActivationMeter

    class Layer(torch.nn.Module):
        def forward(self, hidden, other):
            return torch.tanh(hidden * other)  # saves hidden, other (the product's) and the output

    meter, layer = ActivationMeter(), Layer()
    meter.probe(layer, "layer", input_label="inputs", inputs=2)
    hidden, other = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    with meter.forward(0):
        first = torch.sigmoid(hidden)  # saved before the layer: not the layer's
        out = layer(first, other=other)
    floats = 4 * 8 * 4
    assert meter.probes == {"layer": 2 * floats, "inputs": 2 * floats}  # other and the output; both inputs
    assert meter.per_microbatch[0] == 3 * floats and out.requires_grad


# --------------------------------------------------------------------------------------------
# trace files
# --------------------------------------------------------------------------------------------


def _example_trace(rank: int = 3) -> RankTrace:
    ops = [
        TraceOp(0, 0, 1, "compute", "forward", "schedules.forward_step", microbatch=0,
                phase="forward", start_us=0.0, dur_us=120.5),
        TraceOp(1, 0, 1, "comm", "all_reduce", "mappings._reduce", microbatch=0, phase="forward",
                parent=0, group=(2, 3), group_name="TENSOR_MODEL_PARALLEL_GROUP",
                shape=(16, 2, 64), dtype="bfloat16", bytes=4096, start_us=10.0, dur_us=3.0),
        TraceOp(2, 0, 1, "comm", "batch_isend_irecv", "p2p_communication._batched_p2p_ops",
                group=(1, 3), bytes=8192,
                parts=[{"kind": "isend", "peer": 1, "shape": [16, 2, 64], "dtype": "bfloat16",
                        "bytes": 4096},
                       {"kind": "irecv", "peer": 1, "shape": [16, 2, 64], "dtype": "bfloat16",
                        "bytes": 4096}],
                start_us=121.0, dur_us=1.0),
        TraceOp(3, 0, 1, "comm", "all_to_all", "token_dispatcher.token_dispatch", group=(1, 3),
                shape=(5, 8), dtype="float32", bytes=160, splits={"in": [2, 3], "out": [4, 1]},
                coalesced=7, start_us=122.0, dur_us=0.5),
    ]
    return RankTrace(
        rank=rank, stage=1,
        layout={"world_size": 4, "tp": 2, "pp": 2, "cp": 1, "ep": 1, "dp": 1},
        coords={"tp": 1, "cp": 0, "dp": 0, "pp": 1},
        groups={"tp": [2, 3], "pp": [1, 3]},
        model={"num_layers": 4, "hidden_size": 64},
        iteration={"micro_batch_size": 2, "num_microbatches": 4, "seq_length": 16},
        memory={"peak_bytes": 123, "method": "model_state+saved_activations"},
        ops=ops,
    )


def test_trace_file_round_trip(tmp_path):
    trace = _example_trace()
    path = trace.write(tmp_path / "job")
    assert path == trace_path(tmp_path / "job", 3) and path.name == "rank_3.trace.jsonl"
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["format"] == "megatron-dynapipe-trace" and header["version"] == FORMAT_VERSION
    assert header["num_ops"] == 4 and len(lines) == 5
    back = RankTrace.read(path)
    assert back == trace
    assert back.signatures() == trace.signatures()
    assert read_traces(tmp_path / "job") == {3: trace}
    assert trace.summary()["kinds"]["all_reduce"] == {"count": 1, "bytes": 4096, "dur_us": 3.0}


def test_chrome_trace_export(tmp_path):
    trace = _example_trace()
    path = trace.chrome_trace().write(tmp_path / "rank_3.json")
    doc = json.loads(path.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["forward 0", "all_reduce", "batch_isend_irecv", "all_to_all"]
    assert spans[0]["ts"] == 0.0 and spans[0]["dur"] == 120.5
    threads = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"compute", "comm TENSOR_MODEL_PARALLEL_GROUP", "comm (1, 3)"}
    assert {e["pid"] for e in doc["traceEvents"]} == {3}


def test_write_is_atomic(tmp_path, monkeypatch):
    old = _example_trace()
    path = old.write(tmp_path)
    new = _example_trace()
    new.ops = new.ops[:1]

    def crash(src, dst):
        raise OSError("disk vanished")

    monkeypatch.setattr(trace_format.os, "replace", crash)
    with pytest.raises(OSError, match="disk vanished"):
        new.write(tmp_path)
    monkeypatch.undo()
    assert RankTrace.read(path) == old  # the old file is untouched
    assert os.listdir(tmp_path) == [path.name]  # and no temporary file is left behind
    new.write(tmp_path)
    assert RankTrace.read(path) == new


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda h, ops: (dict(h, version=FORMAT_VERSION + 1), ops), "version 2, this reader understands version 1"),
        (lambda h, ops: (dict(h, format="other-trace"), ops), "is not 'megatron-dynapipe-trace'"),
        (lambda h, ops: (h, ops[:-1]), "announces 4 ops, file has 3"),
        (lambda h, ops: ({k: v for k, v in h.items() if k != "type"}, ops), "not a trace header"),
        (lambda h, ops: (h, ops[:1] + [dict(ops[1], colour="red")] + ops[2:]), "unknown op field"),
        (lambda h, ops: (h, [ops[1], ops[0]] + ops[2:]), "op #0 has seq 1"),
    ],
    ids=["version", "format", "truncated", "header", "field", "order"],
)
def test_reader_validates(tmp_path, edit, message):
    lines = _example_trace().dumps().splitlines()
    header, ops = edit(json.loads(lines[0]), [json.loads(line) for line in lines[1:]])
    path = tmp_path / "rank_3.trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [header, *ops]) + "\n")
    with pytest.raises(TraceFormatError, match=message):
        RankTrace.read(path)


def test_reader_rejects_empty_and_non_json(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(TraceFormatError, match="empty file"):
        RankTrace.read(empty)
    junk = tmp_path / "junk.jsonl"
    junk.write_text("not json\n")
    with pytest.raises(TraceFormatError, match="not JSON"):
        RankTrace.read(junk)


@pytest.mark.parametrize("bad", ["{not json", '{"seq": 1}, {"seq": 2}', "[1, 2]"])
def test_a_bad_op_line_is_named_by_its_number(tmp_path, bad):
    lines = _example_trace().dumps().splitlines()
    lines[2] = bad  # the second op, line 3
    path = tmp_path / "rank_3.trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match=r"rank_3.trace.jsonl:3: bad op line"):
        RankTrace.read(path)


def test_activation_meter_counts_storages_at_addresses_that_freed_ones_had():
    """A saved tensor whose graph is dropped within the forward frees its storage, and the next
    one of the same size usually lands at the same address: the one still held counts once."""
    from megatron_dynapipe.tracer.activation_meter import ActivationMeter

    meter = ActivationMeter()
    weight = torch.ones(1024, requires_grad=True)
    meter.set_static([weight])
    with meter.forward("mb0"):
        for _ in range(20):
            x = torch.ones(1024)
            y = x * weight  # saves x for the weight's gradient
            del x, y  # the graph, and with it x, is gone
        kept = torch.ones(1024) * weight
    assert meter.per_microbatch["mb0"] == 1024 * 4 and kept.requires_grad
