"""The data pipeline end to end: a real TCPStore on 127.0.0.1, a real poller process with real
preprocessing workers, and training ranks as consumer processes (or, where a test needs to reach
in, loaders in this process: they wait on the store exactly like a separate rank does).

Every wait in here is bounded by a generous deadline; a fault that is not detected shows as a
timeout whose message the test does not expect, never as a hang. No test asserts how fast."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_dynapipe.data import (
    MICROBATCH_KEYS,
    BatchSchedule,
    DataPipelineError,
    DataPipelineHost,
    DynaPipeDataLoader,
    IndexedTokenDataset,
    KVStoreClient,
    KVStoreMetaKeys,
    TokenListDataset,
    TrainingSpec,
)
from megatron_dynapipe.data.liveness import process_state
from megatron_dynapipe.data.microbatches import gpt_microbatch, packed_microbatch
from megatron_dynapipe.data.preprocess import _exit_note, worker_state
from megatron_dynapipe.config.model import ModelSpec
from megatron_dynapipe.hardware import load_hardware
from megatron_dynapipe.hardware.pricing import Pricing
from megatron_dynapipe.planning.cost_model import AnalyticalCostModel
from megatron_dynapipe.planning.plan import ExecutionPlan
from megatron_dynapipe.planning.types import RecomputeType
from megatron_dynapipe.planning.planner import generate_execution_plan
from project import free_ports

COST_MODEL = AnalyticalCostModel(hidden_size=64, num_heads=4, vocab_size=128, saturation_tokens=256)
MAX_SEQ_LEN = 128
SECRET = "test-job-secret"
WAIT_S = 120.0  # any single wait; far more than any detection takes


def _spec(pp=2, dp=2, tp=1, fast_mode=True, memory_limit_mb=5):
    return TrainingSpec(num_layers=4, pp=pp, dp=dp, tp=tp, memory_limit_mb=memory_limit_mb, fast_mode=fast_mode)


def _samples(n, seed=0, long_every=0):
    """Sample k is k * 1000 + 0, 1, 2, ...: its tokens say which sample and position they are."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        length = 2 * MAX_SEQ_LEN + 40 if long_every and k % long_every == 0 else int(rng.integers(5, 120))
        out.append(k * 1000 + np.arange(length))
    return out


def _host(dataset, spec, gbs, **options):
    options.setdefault("num_workers", 1)
    return DataPipelineHost(dataset, spec, COST_MODEL, gbs, secret=_key(), port=0, **options)


def _key():
    from megatron_dynapipe.data import job_secret

    return job_secret(SECRET)


def _loader(port, dp=0, stage=0, tp=0, cp=0, **options):
    options.setdefault("timeout_s", WAIT_S)
    return DynaPipeDataLoader(dp_rank=dp, stage=stage, tp_rank=tp, cp_rank=cp, host_pipeline=False,
                              master_addr="127.0.0.1",
                              port=port, secret=SECRET, connect_timeout_s=WAIT_S, **options)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _wait_until(predicate, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# ---------------------------------------------------------------------------------------------
# Consumer processes
# ---------------------------------------------------------------------------------------------


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["megatron_dynapipe.data.loader"])
    return ctx


def _consume(results, port, rank, limit):
    """One training rank, at ``rank`` = (dp, stage, tp[, cp]): iterate the loader (at most ``limit``
    batches), report what arrived."""
    try:
        torch.set_num_threads(1)
        got = []
        with _loader(port, *rank) as loader:
            for batch in loader:
                arrays = [{k: v.numpy().copy() for k, v in mb.items()} for mb in batch.microbatches]
                got.append((batch.iteration, batch.plan.to_bytes(), arrays, batch.summary))
                if len(got) == limit:
                    break
        results.put((rank, True, pickle.dumps(got)))
    except BaseException as error:
        results.put((rank, False, f"{type(error).__name__}: {error}"))


def _start_consumers(port, ranks, limit=None):
    ctx = _context()
    results = ctx.Queue()
    procs = {rank: ctx.Process(target=_consume, args=(results, port, rank, limit), daemon=True) for rank in ranks}
    for proc in procs.values():
        proc.start()
    return results, procs


def _collect(results, procs, deadline_s=WAIT_S * 2):
    out = {}
    deadline = time.monotonic() + deadline_s
    try:
        while len(out) < len(procs) and time.monotonic() < deadline:
            try:
                rank, ok, body = results.get(timeout=0.2)
            except queue.Empty:
                if all(not p.is_alive() for r, p in procs.items() if r not in out):
                    break  # the rest died without a word
                continue
            out[rank] = (ok, pickle.loads(body) if ok else body)
    finally:
        for proc in procs.values():
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    return out


# ---------------------------------------------------------------------------------------------
# Delivery
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_pp2_dp2_tp2_ranks_get_their_stage_plan_and_read_their_own_samples(tmp_path):
    """Eight consumer processes (DP=2 x PP=2 x TP=2) take three iterations over a Megatron
    .bin/.idx dataset whose long documents are split into windows; each rank reads its samples."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for sample in _samples(26, long_every=5):
        builder.add_item(torch.from_numpy(sample))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    dataset = IndexedTokenDataset(prefix, MAX_SEQ_LEN)
    assert dataset.num_split == 6 and len(dataset) == 20 + 6 * 3  # 296-token documents: 3 windows each
    spec = _spec(pp=2, dp=2, tp=2)
    gbs, iterations, seed = 8, 3, 11
    ranks = [(d, s, t) for d in range(2) for s in range(2) for t in range(2)]
    with _host(dataset, spec, gbs, num_iterations=iterations, seed=seed, num_workers=2) as host:
        out = _collect(*_start_consumers(host.port, ranks))
        failures = {rank: body for rank, (ok, body) in out.items() if not ok}
        assert not failures and len(out) == 8, failures
        _wait_until(lambda: not [k for k in host.client.keys() if "/it/" in k], "consumed keys to be deleted")
    schedule = BatchSchedule(len(dataset), gbs, seed=seed)
    for it in range(iterations):
        ids = schedule.ids(it)
        expected = generate_execution_plan(dataset.lengths[ids].tolist(), spec, COST_MODEL, fast_mode=True)
        placed = []
        for d in range(2):
            per_rank = [out[d, s, t][1][it] for s in range(2) for t in range(2)]
            for s, (iteration, plan_blob, arrays, summary) in zip((0, 0, 1, 1), per_rank):
                assert iteration == it and plan_blob == expected.plans[d][s].to_bytes()
                assert summary["samples"] == gbs and summary["real_tokens"] == int(dataset.lengths[ids].sum())
                for a, b in zip(arrays, per_rank[0][2]):  # every stage and TP rank: the same tensors
                    assert all(np.array_equal(a[k], b[k]) for k in MICROBATCH_KEYS)
            plan = ExecutionPlan.from_bytes(per_rank[0][1])
            for mb, arrays in zip(plan.microbatches, per_rank[0][2]):
                reference = gpt_microbatch([dataset[int(ids[i])] for i in mb.samples], mb.seq_len)
                assert all(np.array_equal(arrays[k], reference[k]) for k in MICROBATCH_KEYS)
                placed += [int(ids[i]) for i in mb.samples]
        assert sorted(placed) == sorted(ids.tolist())  # the global batch, each sample on one DP rank


@pytest.mark.slow
def test_packed_plans_deliver_packed_rows(tmp_path):
    """With packing varlen (the setting travels with the spec) both stages of a PP=2 job get
    packed plans and build each micro-batch as one THD row of its samples, as computed locally."""
    import dataclasses

    dataset = TokenListDataset(_samples(24, seed=3), MAX_SEQ_LEN)
    spec = dataclasses.replace(_spec(pp=2, dp=1), packing="varlen")
    gbs, seed = 12, 5
    with _host(dataset, spec, gbs, num_iterations=1, seed=seed) as host:
        out = _collect(*_start_consumers(host.port, [(0, 0, 0), (0, 1, 0)]))
        failures = {rank: body for rank, (ok, body) in out.items() if not ok}
        assert not failures and len(out) == 2, failures
    ids = BatchSchedule(len(dataset), gbs, seed=seed).ids(0)
    expected = generate_execution_plan(dataset.lengths[ids].tolist(), spec, COST_MODEL, fast_mode=True)
    for stage in range(2):
        _, plan_blob, arrays, _ = out[0, stage, 0][1][0]
        assert plan_blob == expected.plans[0][stage].to_bytes()
        plan = ExecutionPlan.from_bytes(plan_blob)
        assert all(mb.packed for mb in plan.microbatches)
        for mb, got in zip(plan.microbatches, arrays):
            reference = packed_microbatch([dataset[int(ids[i])] for i in mb.samples], mb.seq_len)
            assert got.keys() == reference.keys() and all(np.array_equal(got[k], reference[k]) for k in got)


@pytest.mark.slow
def test_context_parallel_ranks_read_their_stage_packed_rows_with_samples_padded_to_whole_chunks():
    """CP 2 (and PP 2): all four ranks take every iteration (the host waits for each); a stage's two
    CP ranks get the same plan and rows, each sample padded to a multiple of 2 x CP = 4 tokens."""
    import dataclasses

    dataset = TokenListDataset(_samples(24, seed=3), MAX_SEQ_LEN)
    spec = dataclasses.replace(_spec(pp=2, dp=1), packing="varlen", cp=2)
    gbs, seed = 12, 5
    ranks = [(0, stage, 0, cp) for stage in range(2) for cp in range(2)]
    with _host(dataset, spec, gbs, num_iterations=2, seed=seed) as host:
        out = _collect(*_start_consumers(host.port, ranks))
        failures = {rank: body for rank, (ok, body) in out.items() if not ok}
        assert not failures and len(out) == 4, failures
    ids = BatchSchedule(len(dataset), gbs, seed=seed).ids(0)
    expected = generate_execution_plan(dataset.lengths[ids].tolist(), spec, COST_MODEL, fast_mode=True)
    for stage in range(2):
        (_, plan_blob, arrays, _), _second = out[0, stage, 0, 0][1]
        assert out[0, stage, 0, 1][1][0][1] == plan_blob == expected.plans[0][stage].to_bytes()
        for mb, got, twin in zip(ExecutionPlan.from_bytes(plan_blob).microbatches, arrays, out[0, stage, 0, 1][1][0][2]):
            reference = packed_microbatch([dataset[int(ids[i])] for i in mb.samples], mb.seq_len, sample_multiple=4)
            assert all(np.array_equal(got[k], reference[k]) and np.array_equal(twin[k], got[k]) for k in got)
            assert np.all(np.diff(got["cu_seqlens"]) % 4 == 0)


@pytest.mark.slow
def test_cut_documents_reach_the_rank_as_the_pieces_of_megatrons_windows():
    """documents "cut": the rank reads each planned piece as a slice of its sample, so its rows
    hold every token of the global batch once, no segment crossing a window of seq_length tokens of
    the batch's stream, and equal to rows built here from the plan's pieces."""
    import dataclasses

    dataset = TokenListDataset(_samples(16, seed=4), MAX_SEQ_LEN)
    spec = dataclasses.replace(_spec(pp=1, dp=1, memory_limit_mb=50), packing="varlen", seq_length=64,
                               documents="cut")
    gbs, seed = 8, 2
    with _host(dataset, spec, gbs, num_iterations=1, seed=seed) as host, _loader(host.port) as loader:
        (batch,) = list(loader)
    ids = BatchSchedule(len(dataset), gbs, seed=seed).ids(0)
    expected = generate_execution_plan(dataset.lengths[ids].tolist(), spec, COST_MODEL, fast_mode=True)
    pieces = expected.pieces
    seen = {}
    for mb, got in zip(batch.plan.microbatches, batch.microbatches):
        parts = [dataset[int(ids[pieces.sample[i]])][pieces.start[i]:pieces.start[i] + pieces.length[i]]
                 for i in mb.samples]
        reference = packed_microbatch(parts, mb.seq_len)
        assert all(np.array_equal(got[k].numpy(), reference[k]) for k in reference)
        bounds = got["cu_seqlens"].tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            tokens = got["tokens"][0, a:b].tolist()
            if b > sum(len(p) for p in parts):
                continue  # the row's padding
            sample, first = divmod(tokens[0], 1000)
            assert tokens == [sample * 1000 + first + j for j in range(len(tokens))]  # one run of one sample
            seen.setdefault(sample, []).append((first, len(tokens)))
    # every sample of the batch, whole, out of its pieces; pieces end where the stream's windows do
    stream = np.cumsum([0] + dataset.lengths[ids].tolist())
    for at, k in enumerate(ids.tolist()):
        runs = sorted(seen[k])
        assert [first for first, _ in runs] == np.cumsum([0] + [n for _, n in runs[:-1]]).tolist()
        assert sum(n for _, n in runs) == dataset.lengths[k]
        for first, n in runs:
            start = stream[at] + first
            assert start // 64 == (start + n - 1) // 64, (k, first, n)
    assert len(pieces) > gbs  # some sample was cut


@pytest.mark.slow
def test_big_datasets_and_big_batches_travel_as_ids(tmp_path):
    """A 100,000-sample in-memory dataset, and a global batch of 4,096 samples of 4,096 tokens
    (64 MiB of tokens: the store carries only plans and sample ids)."""
    many = TokenListDataset([np.full(5 + k % 50, k % 1000) for k in range(100_000)], MAX_SEQ_LEN)
    with _host(many, _spec(pp=1, dp=1), 64, num_iterations=2) as host, _loader(host.port) as loader:
        batches = list(loader)
    assert [b.iteration for b in batches] == [0, 1] and all(b.summary["samples"] == 64 for b in batches)

    big = TokenListDataset([np.full(4096, k) for k in range(4096)], 4096)
    spec = TrainingSpec(num_layers=4, pp=1, dp=2, memory_limit_mb=40_000, fast_mode=True)
    with _host(big, spec, 4096, num_iterations=1) as host:
        out = _collect(*_start_consumers(host.port, [(0, 0, 0), (1, 0, 0)]))
    assert all(ok for ok, _ in out.values()), out
    seen = []
    for d in range(2):
        (_, _, arrays, summary), = out[d, 0, 0][1]
        assert summary["real_tokens"] == 4096 * 4096
        for mb in arrays:
            assert mb["tokens"].shape[1] == 4096 and np.all(mb["tokens"] == mb["tokens"][:, :1])
            seen += mb["tokens"][:, 0].tolist()
    assert sorted(seen) == list(range(4096))


def test_the_store_carries_nothing_that_runs_when_read(tmp_path):
    """A peer that knows host and port replaces what the workers read with a pickle that would
    run code: the reader fails with one line naming the cause, and nothing runs."""
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with _host(TokenListDataset(_samples(16), MAX_SEQ_LEN), _spec(pp=1, dp=1), 4, num_iterations=1) as host:
        key = host.client.plan_key(0, 0, 0)
        _wait_until(lambda: host.client.exists(key), "iteration 0")  # the workers have started
        intruder = dist.TCPStore("127.0.0.1", host.port, None, False, timedelta(seconds=10))
        intruder.set(host.client.meta_key(KVStoreMetaKeys.PLANNER), pickle.dumps(Payload()))
        client = KVStoreClient.connect("127.0.0.1", host.port, _key(), timeout_s=10)
        with pytest.raises(DataPipelineError) as info:
            worker_state(client)  # what every worker does when it starts
        intruder.set(key, pickle.dumps(Payload()))  # and what a rank reads
        with _loader(host.port) as loader, pytest.raises(DataPipelineError) as rank_info:
            next(loader)
    for error in (info.value, rank_info.value):
        assert "was not written by this job" in str(error) and "\n" not in str(error)
    assert not marker.exists()


def test_the_workers_plan_with_the_layout_pricing_of_the_jobs_hardware():
    """A job run with --dynapipe-hardware ships its layout's pricing (Pricing), not a model
    file: every worker plans with what the hosting rank built, the TP group's collectives in each
    layer and, under sequence parallelism, a stage sending its TP rank's shard of the sequence."""
    h100 = load_hardware("h100")
    model = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128, max_sequence_length=128)
    pricing = Pricing(h100, model, "bfloat16", tp=2, sequence_parallel=True)
    spec = _spec(pp=2, dp=1, tp=2)
    host = DataPipelineHost(TokenListDataset(_samples(16), MAX_SEQ_LEN), spec, pricing, 4, secret=_key(), port=0,
                            num_workers=1, num_iterations=1)
    try:
        costs = worker_state(KVStoreClient.connect("127.0.0.1", host.port, _key(), timeout_s=WAIT_S)).costs
    finally:
        host.close(wait_for_ranks=False)  # no training rank joins this pipeline
    shipped = costs.model
    assert costs.p2p_link == h100.pipeline_link(2, 1, 1)  # stages 2 GPUs apart: NVLink, as search prices it
    built, layers_alone = pricing.stage_costs(spec).model, h100.cost_model(model, 2, "bfloat16", sequence_parallel=True)
    assert shipped.pipeline_tokens(2, 64) == 2 * 64 / 2  # two rows of 64 tokens, split over the TP pair
    for phase in ("forward", "backward"):
        priced = shipped.layer_ms("encoder", phase, RecomputeType.NONE, 2, 64)
        assert priced == pytest.approx(built.layer_ms("encoder", phase, RecomputeType.NONE, 2, 64), rel=1e-12)
        assert priced > layers_alone.layer_ms("encoder", phase, RecomputeType.NONE, 2, 64)


# ---------------------------------------------------------------------------------------------
# Faults: every rank stops with one line that names what failed
# ---------------------------------------------------------------------------------------------


def _one_rank_pipeline(**options):
    return _host(TokenListDataset(_samples(40), MAX_SEQ_LEN), _spec(pp=2, dp=1), 4, lookahead=1, **options)


@pytest.mark.slow
@pytest.mark.parametrize("fault,expected", [
    (signal.SIGSTOP, r"preprocessing worker pid \d+ on rank 0's machine is stopped \(SIGSTOP or a debugger\)"),
    (signal.SIGKILL, r"worker pid \d+ was killed by signal 9.*restart the job"),
])
def test_a_stopped_or_killed_worker_stops_every_rank(fault, expected):
    with _one_rank_pipeline() as host:
        results, procs = _start_consumers(host.port, [(0, 1, 0)])
        with _loader(host.port, stage=0) as loader:
            next(loader)  # iteration 0; the worker now waits for both stages to take it
            _wait_until(lambda: _children(host.proc.pid), "the worker process")
            worker = _children(host.proc.pid)[0]
            os.kill(worker, fault)
            with pytest.raises(DataPipelineError, match=expected):
                for _ in range(10):
                    next(loader)
        out = _collect(results, procs)
    ok, body = out[0, 1, 0]
    assert not ok and body.startswith("DataPipelineError") and len(body.splitlines()) == 1
    # the job's end takes the worker with it, stopped or not (a zombie only until init reaps it)
    _wait_until(lambda: process_state(worker) in (None, "Z"), "the worker to be gone")


def test_a_dead_workers_signal_is_named_even_when_the_pools_thread_reaped_it_first():
    """The pool's own thread reaps its workers: between its waitpid and its recording the code,
    the process has no status left to read. The note waits for the recording, not for a time."""
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
    worker.start()
    os.kill(worker.pid, signal.SIGKILL)
    _, status = os.waitpid(worker.pid, 0)  # the pool's thread reaps it ...
    recorder = threading.Timer(0.5, setattr, (worker._popen, "returncode", os.waitstatus_to_exitcode(status)))
    recorder.start()  # ... and records the code a moment later
    note = _exit_note({worker.pid: worker})
    recorder.join()
    assert note == f"worker pid {worker.pid} was killed by signal 9"


@pytest.mark.slow
def test_a_dead_rank_stops_every_other_rank_and_rank_0_does_not_wait_for_it():
    with _one_rank_pipeline() as host:
        results, procs = _start_consumers(host.port, [(0, 1, 0)])
        with _loader(host.port, stage=0) as loader:
            next(loader)
            # the poller deletes iteration 0's keys, its ack counter among them, once both ranks took it
            _wait_until(lambda: not host.client.exists(host.client.plan_key(0, 0, 1)), "stage 1 to take iteration 0")
            procs[0, 1, 0].kill()  # stage 1 dies inside its loop: it never closes its loader
            with pytest.raises(DataPipelineError, match=r"training rank\(s\) \(dp 0, stage 1, tp 0\) stopped beating "
                                                        r".*they died, were stopped or hang"):
                for _ in range(10):
                    next(loader)
        procs[0, 1, 0].join()


@pytest.mark.slow
def test_a_killed_poller_stops_every_rank():
    with _one_rank_pipeline() as host:
        other = _loader(host.port, stage=1)
        with other:
            assert next(other).iteration == 0
            host.proc.kill()
            with pytest.raises(DataPipelineError, match="poller on rank 0's machine made no progress"):
                for _ in range(10):
                    next(other)
            with pytest.raises(DataPipelineError, match=r"poller \(pid \d+\) exited early with signal 9"):
                host.check_alive()


@pytest.mark.slow
def test_a_batch_that_cannot_be_planned_reports_the_workers_error_to_every_rank():
    # one sample needs more than a 0.5 MB memory limit allows, whatever is recomputed
    dataset = TokenListDataset([np.arange(120)] * 8, MAX_SEQ_LEN)
    with _host(dataset, _spec(pp=1, dp=1, memory_limit_mb=0.5), 4) as host, _loader(host.port) as loader:
        with pytest.raises(DataPipelineError, match=r"failed on iteration 0 .*PlanningError") as info:
            next(loader)
    assert "Traceback" in str(info.value)  # the worker's own traceback comes along


@pytest.mark.slow
def test_a_rank_that_cannot_read_the_dataset_stops_every_rank(tmp_path):
    saved = TokenListDataset(_samples(16), MAX_SEQ_LEN).save(tmp_path / "data")
    with _host(saved, _spec(pp=2, dp=1), 4, lookahead=1) as host:
        _wait_until(lambda: host.client.exists(host.client.plan_key(0, 0, 0)), "iteration 0")
        os.rename(tmp_path / "data", tmp_path / "moved")  # not on this rank's machine, say
        first, second = _loader(host.port, stage=0), _loader(host.port, stage=1)
        with first, second:
            with pytest.raises(DataPipelineError, match=r"rank \(dp 0, stage 0, tp 0\) cannot open the dataset: "
                                                        r".*every rank must see the dataset's files"):
                next(first)
            with pytest.raises(DataPipelineError, match="cannot open the dataset"):
                next(second)


def _gloo_rank(rank, port, kv_port, results):
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        loader = DynaPipeDataLoader(TokenListDataset(_samples(16), MAX_SEQ_LEN) if rank == 0 else None,
                                    _spec(pp=2, dp=1), COST_MODEL, 4, dp_rank=0, stage=rank, master_addr="127.0.0.1",
                                    port=kv_port, process_group=dist.group.WORLD, connect_timeout_s=WAIT_S,
                                    timeout_s=WAIT_S, num_workers=1)
        with loader:
            results.put((rank, f"ok {next(loader).iteration}"))
    except BaseException as error:
        results.put((rank, f"{type(error).__name__}: {error}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _gloo_job(kv_port):
    ctx = _context()
    results = ctx.Queue()
    port = free_ports(1)[0]
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, kv_port, results), daemon=True) for r in range(2)]
    for proc in procs:
        proc.start()
    out = dict(results.get(timeout=WAIT_S * 2) for _ in procs)
    for proc in procs:
        proc.join(timeout=WAIT_S)
    return out


@pytest.mark.slow
def test_ranks_of_one_process_group_share_the_secret_the_port_and_a_taken_port():
    kv_port = free_ports(1)[0]
    assert _gloo_job(kv_port) == {0: "ok 0", 1: "ok 0"}  # no secret given: rank 0 drew one and shared it
    assert _gloo_job(0) == {0: "ok 0", 1: "ok 0"}  # any free port: rank 1 learnt rank 0's from it
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        out = _gloo_job(taken.getsockname()[1])
    assert out[0].startswith("DataPipelineError") and "the port is taken" in out[0]
    assert out[1].startswith("DataPipelineError: rank 0 could not start the data pipeline:")
    assert "pass another --dynapipe-kv-port" in out[1] and "\n" not in out[1]


@pytest.mark.slow
def test_settings_are_versioned_json_every_rank_checks():
    with _one_rank_pipeline() as host:
        settings = host.client.get_json(KVStoreMetaKeys.SETTINGS)
        assert settings["version"] == 1 and settings["dataset"]["kind"] == "token_file"
        assert json.loads(json.dumps(host.client.get_json(KVStoreMetaKeys.PLANNER)))["spec"]["fast_mode"] is True
        with pytest.raises(ValueError, match="global_batch_size=8 here, 4 on rank 0, seed=5 here, 0 on rank 0"):
            DynaPipeDataLoader(None, None, None, 8, dp_rank=0, stage=1, port=host.port, secret=SECRET, seed=5,
                               connect_timeout_s=WAIT_S)
        with pytest.raises(ValueError, match="differs from the pipeline host's"):
            DynaPipeDataLoader(dp_rank=0, stage=1, spec=_spec(pp=4, dp=1), port=host.port, secret=SECRET,
                               connect_timeout_s=WAIT_S)
        host.close(wait_for_ranks=False)  # every rank was refused: none will close its loader
    with pytest.raises(ValueError, match=r"port=0 \(any free port\) needs process_group="):
        DynaPipeDataLoader(dp_rank=0, stage=1, port=0, secret=SECRET)
    with pytest.raises(ValueError, match="needs the job's secret on every rank: set DYNAPIPE_KV_SECRET"):
        DynaPipeDataLoader(TokenListDataset(_samples(8), MAX_SEQ_LEN), _spec(pp=2, dp=1), COST_MODEL, 4,
                           dp_rank=0, stage=0, port=0)


def test_layout_from_megatron_parallel_state(monkeypatch):
    from megatron.core import parallel_state as ps

    from megatron_dynapipe.data import RankLayout, from_parallel_state

    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="not initialised"):
        from_parallel_state()
    for name, value in [("model_parallel_is_initialized", True), ("get_context_parallel_world_size", 1),
                        ("get_data_parallel_rank", 1), ("get_pipeline_model_parallel_rank", 3),
                        ("get_tensor_model_parallel_rank", 1), ("get_context_parallel_rank", 0),
                        ("get_data_parallel_world_size", 2),
                        ("get_pipeline_model_parallel_world_size", 4),
                        ("get_tensor_model_parallel_world_size", 2)]:
        monkeypatch.setattr(ps, name, lambda value=value: value)
    layout = from_parallel_state()
    assert layout == RankLayout(dp_rank=1, stage=3, tp_rank=1) and not layout.is_first
    with pytest.raises(ValueError, match="differs from megatron's parallel state"):
        DynaPipeDataLoader.from_parallel_state(None, _spec(pp=2, dp=2, tp=2), port=1)
    with pytest.raises(ValueError, match="stage=3 is outside"):
        layout.check(dp=2, pp=2, tp=2)
    # context parallelism: a CP rank reads its stage's micro-batches like a TP rank; rank 0 of all four hosts
    monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda: 2)
    monkeypatch.setattr(ps, "get_context_parallel_rank", lambda: 1)
    assert from_parallel_state() == RankLayout(dp_rank=1, stage=3, tp_rank=1, cp_rank=1)
    assert RankLayout(0, 0, 0, 0).is_first and not RankLayout(0, 0, 0, 1).is_first
    with pytest.raises(ValueError, match=r"cp=1\) differs from megatron's parallel state \(.*cp=2\)"):
        DynaPipeDataLoader.from_parallel_state(None, _spec(pp=4, dp=2, tp=2), port=1)


def test_every_rank_of_a_context_parallel_job_is_one_consumer_of_its_own():
    """The host frees an iteration once every rank has taken it: each CP rank counts, under its own name."""
    from megatron_dynapipe.data.preprocess import PipelineSettings
    from megatron_dynapipe.data.sampling import BatchSchedule

    settings = PipelineSettings(dataset={}, schedule=BatchSchedule(64, 16), start_iteration=0, num_iterations=1,
                                pad_token_id=0, dp=2, pp=3, tp=2, cp=2)
    ranks = [(dp, stage, tp, cp) for dp in range(2) for stage in range(3) for tp in range(2) for cp in range(2)]
    consumers = [settings.consumer(*rank) for rank in ranks]
    assert settings.num_consumers == 24 and sorted(consumers) == list(range(24))
    assert [settings.describe_consumer(c) for c in consumers] == [
        f"(dp {dp}, stage {stage}, tp {tp}, cp {cp})" for dp, stage, tp, cp in ranks]
    assert settings.describe_consumer(0) == "(dp 0, stage 0, tp 0, cp 0)"


def test_under_cp_each_packed_sample_is_padded_to_whole_chunks():
    """sample_multiple=4 (CP 2): a sample of 5 tokens takes 8, one of 8 takes 8, one of 3 takes 4;
    each keeps its own arrays, and the padding after it is masked out of the loss."""
    samples = [np.arange(1, 6), np.arange(10, 18), np.arange(20, 23)]
    row = packed_microbatch(samples, 24, pad_token_id=0, sample_multiple=4)
    assert row["cu_seqlens"].tolist() == [0, 8, 16, 20, 24] and row["max_seqlen"].tolist() == [8]
    assert row["tokens"][0].tolist() == [1, 2, 3, 4, 5, 0, 0, 0, *range(10, 18), 20, 21, 22, 0, 0, 0, 0, 0]
    assert row["position_ids"][0].tolist() == [*range(8), *range(8), *range(4), *range(4)]
    assert row["loss_mask"][0].tolist() == [1] * 4 + [0] * 4 + [1] * 7 + [0] + [1, 1, 0, 0] + [0] * 4
    with pytest.raises(ValueError, match="do not fit"):
        packed_microbatch(samples, 16, sample_multiple=4)  # 16 real tokens, 20 once padded
