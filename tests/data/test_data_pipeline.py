"""The data pipeline end to end: a real TCPStore on 127.0.0.1, a real poller process with real
preprocessing workers, and training ranks simulated by consumer processes (or, for the failure
tests, by loaders in this process: they wait on the store exactly like a separate rank does)."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import queue
import time

import numpy as np
import pytest
import torch

from megatron_dynapipe.data import (
    MICROBATCH_KEYS,
    DataPipelineError,
    DataPipelineHost,
    DataPipelineTimeout,
    DynaPipeDataLoader,
    IndexedTokenDataset,
    JsonlTokenDataset,
    KVStoreClient,
    KVStoreMetaKeys,
    TokenListDataset,
    TrainingSpec,
    sample_ids,
)
from megatron_dynapipe.data.kv_store import HeartbeatWatch
from megatron_dynapipe.data.microbatches import decode_microbatches, encode_microbatches, gpt_microbatch
from megatron_dynapipe.data.preprocess import build_iteration
from megatron_dynapipe.planning.cost_model import AnalyticalCostModel
from megatron_dynapipe.planning.plan import ExecutionPlan
from megatron_dynapipe.planning.planner import generate_execution_plan

COST_MODEL = AnalyticalCostModel(hidden_size=64, num_heads=4, vocab_size=128, saturation_tokens=256)
MAX_SEQ_LEN = 128
TIMEOUT_S = 60.0  # any single wait; the tests themselves finish far sooner


def _spec(pp=2, dp=2, tp=1, fast_mode=True):
    return TrainingSpec(num_layers=4, pp=pp, dp=dp, tp=tp, memory_limit_mb=5, fast_mode=fast_mode)


def _samples(n, seed=0, long_every=0):
    """Sample k is k * 1000 + 0, 1, 2, ...: its tokens say which sample and position they are."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        length = MAX_SEQ_LEN + 40 if long_every and k % long_every == 0 else int(rng.integers(5, 120))
        out.append(k * 1000 + np.arange(length))
    return out


# ---------------------------------------------------------------------------------------------
# Pure parts: GPT tensors, wire format, sampling, one iteration
# ---------------------------------------------------------------------------------------------


def test_gpt_microbatch_labels_mask_and_positions():
    arrays = gpt_microbatch([np.array([5, 6, 7]), np.array([9])], seq_len=4, pad_token_id=0)
    assert set(arrays) == set(MICROBATCH_KEYS)
    assert arrays["tokens"].tolist() == [[5, 6, 7, 0], [9, 0, 0, 0]]
    assert arrays["labels"].tolist() == [[6, 7, 0, 0], [0, 0, 0, 0]]
    # no loss on the last real token (its next token is not in the sample) nor on padding
    assert arrays["loss_mask"].tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert arrays["position_ids"].tolist() == [[0, 1, 2, 3]] * 2
    assert arrays["tokens"].dtype == np.int64 and arrays["loss_mask"].dtype == np.float32
    with pytest.raises(ValueError, match="does not fit"):
        gpt_microbatch([np.arange(5)], seq_len=4)


def test_microbatch_wire_format_roundtrip_and_corruption():
    samples = [np.array([1, 2, 3]), np.array([4]), np.array([2**40, 5])]
    blob = encode_microbatches(7, 1, [(2, 8), (1, 16)], samples, pad_token_id=3)
    decoded = decode_microbatches(blob)
    assert (decoded.iteration, decoded.dp_rank, decoded.pad_token_id) == (7, 1, 3)
    assert decoded.shapes == [(2, 8), (1, 16)]
    assert [[s.tolist() for s in mb] for mb in decoded.samples] == [[[1, 2, 3], [4]], [[2**40, 5]]]
    arrays = decoded.arrays()
    assert arrays[0]["tokens"].shape == (2, 8) and arrays[1]["tokens"][0, :3].tolist() == [2**40, 5, 3]
    small = encode_microbatches(0, 0, [(1, 4)], [np.array([1, 2])])
    assert len(small) < len(encode_microbatches(0, 0, [(1, 4)], [np.array([2**40, 2])]))  # 4-byte tokens
    broken = bytearray(blob)
    broken[-6] ^= 0xFF
    with pytest.raises(ValueError, match="checksum"):
        decode_microbatches(bytes(broken))
    with pytest.raises(ValueError, match="not a micro-batch blob"):
        decode_microbatches(b"DPEP" + blob[4:])


def test_sample_ids_epochs_shuffle_and_drop_last():
    n, gbs = 10, 4  # 2 iterations an epoch, 2 samples left out of each epoch
    epoch0 = np.concatenate([sample_ids(i, n, gbs, shuffle=True, seed=3) for i in range(2)])
    epoch1 = np.concatenate([sample_ids(i, n, gbs, shuffle=True, seed=3) for i in range(2, 4)])
    for epoch in (epoch0, epoch1):
        assert len(set(epoch.tolist())) == 8 and set(epoch.tolist()) <= set(range(n))
    assert epoch0.tolist() != epoch1.tolist()  # a fresh shuffle per epoch
    assert sample_ids(5, n, gbs, seed=3).tolist() == sample_ids(5, n, gbs, seed=3).tolist()
    assert sample_ids(1, n, gbs, shuffle=False).tolist() == [4, 5, 6, 7]
    assert sample_ids(2, n, gbs, shuffle=False).tolist() == [0, 1, 2, 3]


def test_build_iteration_gives_every_dp_rank_its_own_samples():
    ds = TokenListDataset(_samples(16), MAX_SEQ_LEN)
    ids = list(range(3, 11))
    spec = _spec()
    blobs = build_iteration(ds, spec, COST_MODEL, 4, ids)
    assert sorted(blobs.plans) == [(d, s) for d in range(2) for s in range(2)] and sorted(blobs.microbatches) == [0, 1]
    seen = []
    for d in range(2):
        plan = ExecutionPlan.from_bytes(blobs.plans[d, 0])
        decoded = decode_microbatches(blobs.microbatches[d])
        assert decoded.shapes == [(mb.size, mb.seq_len) for mb in plan.microbatches]
        for mb, tokens in zip(plan.microbatches, decoded.samples):
            for i, t in zip(mb.samples, tokens):
                np.testing.assert_array_equal(t, ds[ids[i]])
                seen.append(ids[i])
    assert sorted(seen) == ids


# ---------------------------------------------------------------------------------------------
# The KV store client
# ---------------------------------------------------------------------------------------------


def test_kv_client_keys_errors_waits_and_cleanup():
    server = KVStoreClient.host(0, namespace="t/ns", timeout_s=5)
    client = KVStoreClient.connect("127.0.0.1", server.port, namespace="t/ns", timeout_s=5)
    assert client.plan_key(3, 1, 0) == "t/ns/it/3/plan/1/0"
    assert client.microbatch_key(3, 1) == "t/ns/it/3/mb/1"
    assert client.meta_key(KVStoreMetaKeys.SPEC) == "t/ns/meta/spec"
    client.put(client.plan_key(0, 0, 0), b"\x00\xffplan")
    assert server.get(client.plan_key(0, 0, 0)) == b"\x00\xffplan"
    started = time.monotonic()
    with pytest.raises(DataPipelineTimeout, match="waited 0.2s for key t/ns/it/9"):
        client.get(client.plan_key(9, 0, 0), timeout_s=0.2)
    assert time.monotonic() - started < 3
    assert client.acknowledge(0) == 1 and server.acknowledge(0) == 2 and client.acknowledged(0) == 2
    client.delete_iteration(0, dp=1, pp=1)
    assert client.keys() == []
    assert client.set_error("first") and not server.set_error("second")
    with pytest.raises(DataPipelineError, match="^first$"):
        client.wait([client.plan_key(1, 0, 0)], 5)
    # a poller that never beats is declared dead after the heartbeat timeout
    watch = HeartbeatWatch(client, timeout_s=0.3, check_every_s=0.0)
    other = KVStoreClient.connect("127.0.0.1", server.port, namespace="t/other", timeout_s=5)
    other_watch = HeartbeatWatch(other, timeout_s=0.3, check_every_s=0.0)
    with pytest.raises(DataPipelineError, match="never started"):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            other_watch()
            time.sleep(0.05)
    watch()
    del server  # rank 0 is gone: store calls fail fast and clearly
    with pytest.raises(DataPipelineError, match="lost the data pipeline's KV store"):
        client.exists("x")


# ---------------------------------------------------------------------------------------------
# Real processes
# ---------------------------------------------------------------------------------------------


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["megatron_dynapipe.data.loader"])
    return ctx


def _consume(results, port, dp, stage, tp, timeout_s):
    """One training rank: iterate the loader, report what arrived (or the error)."""
    rank = (dp, stage, tp)
    try:
        torch.set_num_threads(1)
        loader = DynaPipeDataLoader(dp_rank=dp, stage=stage, tp_rank=tp, host_pipeline=False,
                                    master_addr="127.0.0.1", port=port, timeout_s=timeout_s,
                                    connect_timeout_s=timeout_s, heartbeat_timeout_s=timeout_s)
        got = []
        with loader:
            assert len(loader) == loader.num_iterations
            for batch in loader:
                arrays = [{k: v.numpy().copy() for k, v in mb.items()} for mb in batch.microbatches]
                got.append((batch.iteration, batch.plan.to_bytes(), arrays, batch.num_tokens))
        results.put((rank, True, pickle.dumps(got)))
    except BaseException as error:
        results.put((rank, False, f"{type(error).__name__}: {error}"))


def _run_consumers(port, ranks, deadline_s, timeout_s=TIMEOUT_S):
    """Start one process per (dp, stage, tp) rank; collect {rank: (ok, payload)}; never hang."""
    ctx = _context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_consume, args=(results, port, *rank, timeout_s), daemon=True) for rank in ranks]
    out = {}
    deadline = time.monotonic() + deadline_s
    try:
        for proc in procs:
            proc.start()
        while len(out) < len(ranks) and time.monotonic() < deadline:
            try:
                rank, ok, body = results.get(timeout=0.2)
            except queue.Empty:
                continue
            out[rank] = (ok, pickle.loads(body) if ok else body)
    finally:
        for proc in procs:
            if proc.pid is None:
                continue  # never started
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    missing = sorted(set(ranks) - set(out))
    assert not missing, f"consumers {missing} did not report within {deadline_s}s"
    return out


def _wait_until(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pp2_dp2_tp2_ranks_get_their_stage_plan_and_dp_samples(tmp_path):
    """Eight consumer processes (DP=2 x PP=2 x TP=2) read three iterations from the store, out of
    a Megatron .bin/.idx dataset. Long samples are truncated on request (truncate=True) and
    arrive as their first MAX_SEQ_LEN tokens."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for sample in _samples(26, long_every=5):
        builder.add_item(torch.from_numpy(sample))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    dataset = IndexedTokenDataset(prefix, MAX_SEQ_LEN, truncate=True)
    assert dataset.num_truncated == 6
    spec = _spec(pp=2, dp=2, tp=2)
    gbs, iterations, seed = 8, 3, 11
    ranks = [(d, s, t) for d in range(2) for s in range(2) for t in range(2)]
    started = time.monotonic()
    with DataPipelineHost(dataset, spec, COST_MODEL, gbs, port=0, num_iterations=iterations, seed=seed,
                          lookahead=2, num_workers=2) as host:
        assert pickle.loads(host.client.get_meta(KVStoreMetaKeys.SPEC)).fast_mode is True
        out = _run_consumers(host.port, ranks, deadline_s=150)
        failures = {rank: body for rank, (ok, body) in out.items() if not ok}
        assert not failures, failures
        # every rank has acknowledged every iteration: the poller deletes their keys
        _wait_until(lambda: not [k for k in host.client.keys() if "/it/" in k], 20, "consumed keys to be deleted")
        elapsed = time.monotonic() - started

    for it in range(iterations):
        ids = sample_ids(it, len(dataset), gbs, shuffle=True, seed=seed)
        expected = generate_execution_plan(dataset.lengths[ids].tolist(), spec, COST_MODEL, fast_mode=True)
        dp_samples = []
        for d in range(2):
            stage_arrays = []
            for s in range(2):
                per_tp = []
                for t in range(2):
                    iteration, plan_blob, arrays, num_tokens = out[d, s, t][1][it]
                    assert iteration == it
                    plan = ExecutionPlan.from_bytes(plan_blob)
                    assert (plan.stage, plan.num_stages) == (s, 2)
                    assert plan.schedule == "wait-free-cyclic"  # fast mode, read from the store
                    assert plan_blob == expected.plans[d][s].to_bytes()
                    per_tp.append(arrays)
                    assert num_tokens == sum(int(ids_len) - 1 for ids_len in dataset.lengths[
                        [ids[i] for mb in plan.microbatches for i in mb.samples]])
                for a, b in zip(per_tp[0], per_tp[1]):  # TP ranks: identical tensors
                    for key in MICROBATCH_KEYS:
                        np.testing.assert_array_equal(a[key], b[key])
                stage_arrays.append(per_tp[0])
            for a, b in zip(*stage_arrays):  # both stages of a DP rank see the same micro-batches
                for key in MICROBATCH_KEYS:
                    np.testing.assert_array_equal(a[key], b[key])
            plan = expected.plans[d][0]
            assert len(stage_arrays[0]) == len(plan.microbatches)
            for mb, arrays in zip(plan.microbatches, stage_arrays[0]):
                assert arrays["tokens"].shape == (mb.size, mb.seq_len)
                for row, i in enumerate(mb.samples):
                    sample = dataset[int(ids[i])]
                    assert len(sample) <= MAX_SEQ_LEN
                    if ids[i] % 5 == 0:  # a truncated one: its head arrived
                        assert len(sample) == MAX_SEQ_LEN and sample[0] == ids[i] * 1000
                    n = len(sample)
                    ref = gpt_microbatch([sample], mb.seq_len)
                    for key in MICROBATCH_KEYS:
                        np.testing.assert_array_equal(arrays[key][row], ref[key][0])
                    assert arrays["tokens"][row, 0] // 1000 == ids[i]
                    assert arrays["loss_mask"][row].sum() == n - 1
                    dp_samples.append((d, int(ids[i])))
        # exactly the global batch, each sample on exactly one DP rank
        assert sorted(i for _, i in dp_samples) == sorted(ids.tolist())
    print(f"\n3 iterations to 8 consumer processes in {elapsed:.1f}s")


class _RaisingDataset(JsonlTokenDataset):
    def __init__(self, path, samples, bad):
        path.write_text("".join(json.dumps(s.tolist()) + "\n" for s in samples))
        super().__init__(path, MAX_SEQ_LEN)
        self.bad = bad

    def __getitem__(self, index):
        if int(index) == self.bad:
            raise ValueError(f"corrupt record {index} in shard 7")
        return super().__getitem__(index)


class _DyingDataset(TokenListDataset):
    def __init__(self, samples, bad):
        super().__init__(samples, MAX_SEQ_LEN)
        self.bad = bad

    def __getitem__(self, index):
        if int(index) == self.bad:
            os._exit(7)
        return super().__getitem__(index)


class _BrokenOnUnpickle(TokenListDataset):
    def __setstate__(self, state):
        raise RuntimeError("shard directory /data/shard-7 is not mounted here")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_settings_that_cannot_be_loaded_fail_every_rank():
    with DataPipelineHost(_BrokenOnUnpickle(_samples(8), MAX_SEQ_LEN), _spec(pp=1, dp=1), COST_MODEL, 4, port=0,
                          num_workers=1) as host:
        loader = DynaPipeDataLoader(dp_rank=0, stage=0, host_pipeline=False, port=host.port, timeout_s=TIMEOUT_S)
        with loader, pytest.raises(DataPipelineError, match="shard directory /data/shard-7 is not mounted here"):
            next(loader)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_worker_exception_surfaces_on_every_rank_with_its_message(tmp_path):
    gbs = 4
    bad = int(sample_ids(1, 16, gbs, shuffle=True, seed=0)[2])  # in iteration 1's batch
    dataset = _RaisingDataset(tmp_path / "data.jsonl", _samples(16), bad)
    spec = _spec(pp=2, dp=1)
    with DataPipelineHost(dataset, spec, COST_MODEL, gbs, port=0, num_iterations=4, num_workers=1) as host:
        out = _run_consumers(host.port, [(0, 0, 0), (0, 1, 0)], deadline_s=120)
        error = host.client.get_error()
    assert error is not None and f"ValueError: corrupt record {bad} in shard 7" in error
    assert "iteration 1" in error and "Traceback" in error  # the worker's own traceback
    for rank, (ok, body) in out.items():
        assert not ok, f"rank {rank} finished without seeing the worker's error"
        assert body.startswith("DataPipelineError") and f"corrupt record {bad} in shard 7" in body


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_killed_worker_surfaces_as_a_clear_error(monkeypatch):
    monkeypatch.setenv("DYNAPIPE_FAST_MODE", "auto")
    gbs = 4
    bad = int(sample_ids(0, 12, gbs, shuffle=True, seed=0)[1])
    dataset = _DyingDataset(_samples(12), bad)
    spec = _spec(pp=1, dp=1, fast_mode=None)
    with DataPipelineHost(dataset, spec, COST_MODEL, gbs, port=0, num_iterations=3, num_workers=1) as host:
        # rank 0's environment decides, once, and the shipped spec carries it
        assert pickle.loads(host.client.get_meta(KVStoreMetaKeys.SPEC)).fast_mode == "auto"
        loader = DynaPipeDataLoader(dp_rank=0, stage=0, host_pipeline=False, port=host.port, timeout_s=TIMEOUT_S,
                                    heartbeat_timeout_s=TIMEOUT_S)
        started = time.monotonic()
        with loader, pytest.raises(DataPipelineError) as info:
            next(loader)
        waited = time.monotonic() - started
    message = str(info.value)
    assert "preprocessing worker process died without reporting an error" in message
    assert "exited with code 7" in message and "iteration 0" in message
    assert waited < TIMEOUT_S / 2


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_waits_time_out_and_a_dead_poller_is_noticed_by_every_rank():
    spec = _spec(pp=2, dp=1)
    dataset = TokenListDataset(_samples(40), MAX_SEQ_LEN)
    host_loader = DynaPipeDataLoader(dataset, spec, COST_MODEL, 4, dp_rank=0, stage=0, port=0,
                                     timeout_s=TIMEOUT_S, heartbeat_timeout_s=TIMEOUT_S, close_timeout_s=5,
                                     lookahead=1, num_workers=1)
    try:
        assert host_loader.host is not None and len(host_loader) == 10
        # the same call on every rank: the other ranks check their options against rank 0's
        other = DynaPipeDataLoader(dataset, spec, COST_MODEL, 4, dp_rank=0, stage=1, port=host_loader.host.port,
                                   timeout_s=TIMEOUT_S, heartbeat_timeout_s=3, lookahead=1, num_workers=1)
        with pytest.raises(ValueError, match="global_batch_size=8 here, 4 on rank 0, seed=5 here, 0 on rank 0"):
            DynaPipeDataLoader(None, spec, None, 8, dp_rank=0, stage=1, port=host_loader.host.port, seed=5)
        with pytest.raises(ValueError, match="differs from the pipeline host's"):
            DynaPipeDataLoader(dp_rank=0, stage=1, spec=_spec(pp=4, dp=1), port=host_loader.host.port)
        assert next(host_loader).iteration == 0
        # look-ahead 1: iteration 1 waits until stage 1 has taken iteration 0; a wait never hangs
        host_loader.timeout_s = 1.0
        with pytest.raises(DataPipelineTimeout, match=r"waited 1s for iteration 1 .*consumed_up_to\": 0"):
            next(host_loader)
        host_loader.timeout_s = TIMEOUT_S
        assert next(other).iteration == 0
        assert next(host_loader).iteration == 1 and next(other).iteration == 1
        host_loader.host.proc.kill()
        started = time.monotonic()
        with pytest.raises(DataPipelineError, match="poller on rank 0 stopped beating"):
            for _ in range(3):  # at most the look-ahead was prepared before the kill
                next(other)
        assert time.monotonic() - started < 20
        with pytest.raises(DataPipelineError, match=r"poller \(pid \d+\) exited early with signal 9"):
            for _ in range(3):
                next(host_loader)
        other.close()
    finally:
        host_loader.close()
    assert host_loader.host.proc.poll() is not None


def test_layout_from_megatron_parallel_state(monkeypatch):
    from megatron.core import parallel_state as ps

    from megatron_dynapipe.data import RankLayout, from_parallel_state

    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="not initialised"):
        from_parallel_state()
    for name, value in [("model_parallel_is_initialized", True), ("get_context_parallel_world_size", 1),
                        ("get_data_parallel_rank", 1), ("get_pipeline_model_parallel_rank", 3),
                        ("get_tensor_model_parallel_rank", 1), ("get_data_parallel_world_size", 2),
                        ("get_pipeline_model_parallel_world_size", 4),
                        ("get_tensor_model_parallel_world_size", 2)]:
        monkeypatch.setattr(ps, name, lambda value=value: value)
    layout = from_parallel_state()
    assert layout == RankLayout(dp_rank=1, stage=3, tp_rank=1) and not layout.is_first
    with pytest.raises(ValueError, match="differs from megatron's parallel state"):
        DynaPipeDataLoader.from_parallel_state(None, _spec(pp=2, dp=2, tp=2), port=1)
    with pytest.raises(ValueError, match="stage=3 is outside"):
        layout.check(dp=2, pp=2, tp=2)
    monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda: 2)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        from_parallel_state()
