"""Preprocessing: global batch of sample ids -> execution plans + micro-batches in the KV store.

Processes (all on rank 0's machine, started by :class:`~megatron_dynapipe.data.loader.DataPipelineHost`):

* the **poller** (``python -c "...preprocess import poller_main; poller_main()"``, see
  :func:`run_poller`) reads the pipeline's settings from the store, owns a process pool of
  preprocessing workers and keeps at most ``lookahead`` iterations produced but not yet taken by
  every rank; it deletes an iteration's keys once all ranks acknowledged it, beats a heartbeat
  counter (from a thread, so a busy loop never looks dead) and stops on the shutdown key, on the
  first error, when its parent (rank 0) is gone or when every iteration has been consumed.
* **workers** (``concurrent.futures.ProcessPoolExecutor``) are initialised by
  :func:`worker_init` *from the store*: dataset, TrainingSpec (its fast mode resolved on rank 0)
  and cost model all come from there. Each task (:func:`preprocess_iteration`)
  reads one global batch, plans it with ``generate_execution_plan`` and publishes one plan per
  (DP rank, stage) and one micro-batch blob per DP rank (:func:`build_iteration`).

Failures: a worker that raises publishes its traceback under the error key before re-raising; a
worker that dies without a word (killed, out of memory, ``os._exit``) breaks the pool and the
poller publishes that, with the worker's exit code. Every training rank raises the error key's
message as :class:`DataPipelineError` from its next wait.

Micro-batches travel in :mod:`.microbatches`' wire format.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import pickle
import sys
import threading
import time
import traceback
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from megatron_dynapipe.data.kv_store import KVStoreClient, KVStoreMetaKeys
from megatron_dynapipe.data.microbatches import encode_microbatches
from megatron_dynapipe.planning.cost_model import StageCosts
from megatron_dynapipe.planning.planner import generate_execution_plan, stage_costs
from megatron_dynapipe.planning.spec import TrainingSpec

__all__ = [
    "DecodedMicrobatches",
    "PipelineSettings",
    "build_iteration",
    "decode_microbatches",
    "encode_microbatches",
    "gpt_microbatch",
    "poller_main",
    "preprocess_iteration",
    "run_poller",
    "sample_ids",
    "worker_init",
]

WORKER_START_METHODS = ("fork", "forkserver", "spawn")


# ---------------------------------------------------------------------------------------------
# Settings and sampling
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineSettings:
    """What rank 0 publishes under :attr:`KVStoreMetaKeys.SETTINGS` (JSON)."""

    num_samples: int
    global_batch_size: int
    start_iteration: int
    num_iterations: int
    shuffle: bool
    seed: int
    pad_token_id: int
    dp: int
    pp: int
    tp: int
    lookahead: int = 2
    num_workers: int = 2
    worker_start_method: str = "fork"
    heartbeat_interval_s: float = 0.5
    store_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "dp", "pp", "tp", "lookahead", "num_workers"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.start_iteration < 0 or self.num_iterations < 0:
            raise ValueError("start_iteration and num_iterations must be >= 0")
        if self.num_samples < self.global_batch_size:
            raise ValueError(
                f"the dataset has {self.num_samples} samples, fewer than one global batch of "
                f"{self.global_batch_size}"
            )
        if self.global_batch_size < self.dp:
            raise ValueError(f"a global batch of {self.global_batch_size} samples cannot feed {self.dp} "
                             "data-parallel ranks")
        if self.worker_start_method not in WORKER_START_METHODS:
            raise ValueError(f"worker_start_method must be one of {', '.join(WORKER_START_METHODS)}, "
                             f"got {self.worker_start_method!r}")

    @property
    def num_consumers(self) -> int:
        """Ranks that take every iteration: one per (DP rank, stage, TP rank)."""
        return self.dp * self.pp * self.tp

    @property
    def iterations_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    @property
    def end_iteration(self) -> int:
        return self.start_iteration + self.num_iterations

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "PipelineSettings":
        return cls(**data)


def sample_ids(iteration: int, num_samples: int, global_batch_size: int, shuffle: bool = True,
               seed: int = 0) -> np.ndarray:
    """Dataset indices of the global batch of ``iteration``.

    Iteration ``i`` is batch ``i % E`` of epoch ``i // E`` (``E = num_samples //
    global_batch_size``). Each epoch visits the samples in one order (a fresh permutation per
    epoch seeded by ``(seed, epoch)`` when ``shuffle``, else 0, 1, 2, ...) and leaves out the
    ``num_samples % global_batch_size`` samples at the end of that order (drop-last).
    """
    per_epoch = num_samples // global_batch_size
    if per_epoch < 1:
        raise ValueError(f"{num_samples} samples make no global batch of {global_batch_size}")
    epoch, position = divmod(int(iteration), per_epoch)
    begin = position * global_batch_size
    if not shuffle:
        return np.arange(begin, begin + global_batch_size, dtype=np.int64)
    order = np.random.default_rng([int(seed), epoch]).permutation(num_samples)
    return order[begin: begin + global_batch_size].astype(np.int64)


class _Sampler:
    """sample_ids with the epoch's permutation cached."""

    def __init__(self, settings: PipelineSettings):
        self.s = settings
        self._epoch, self._order = None, None

    def __call__(self, iteration: int) -> np.ndarray:
        s = self.s
        if not s.shuffle:
            return sample_ids(iteration, s.num_samples, s.global_batch_size, False, s.seed)
        epoch, position = divmod(iteration, s.iterations_per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([int(s.seed), epoch]).permutation(s.num_samples)
        begin = position * s.global_batch_size
        return self._order[begin: begin + s.global_batch_size].astype(np.int64)


# ---------------------------------------------------------------------------------------------
# One iteration
# ---------------------------------------------------------------------------------------------


@dataclass
class IterationBlobs:
    """What one iteration publishes: plans[(dp, stage)] and microbatches[dp], as bytes."""

    plans: dict[tuple[int, int], bytes]
    microbatches: dict[int, bytes]
    planning_seconds: float


def build_iteration(dataset, spec: TrainingSpec, cost_model, iteration: int,
                    ids: Sequence[int], pad_token_id: int = 0) -> IterationBlobs:
    """Read the global batch ``ids`` of ``dataset``, plan it and serialise one plan per
    (DP rank, stage) and one micro-batch blob per DP rank. Pure: no store involved."""
    tokens = [np.asarray(dataset[int(i)]) for i in ids]
    lengths = [len(t) for t in tokens]
    result = generate_execution_plan(lengths, spec, cost_model)  # with spec.fast_mode
    plans, microbatches = {}, {}
    for dp_rank, stage_plans in enumerate(result.plans):
        for stage, plan in enumerate(stage_plans):
            plans[dp_rank, stage] = plan.to_bytes()
        mbs = stage_plans[0].microbatches
        microbatches[dp_rank] = encode_microbatches(
            iteration, dp_rank, [(mb.size, mb.seq_len) for mb in mbs],
            [tokens[i] for mb in mbs for i in mb.samples], pad_token_id)
    return IterationBlobs(plans, microbatches, result.planning_seconds)


# ---------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------


class _WorkerState:
    client: KVStoreClient
    dataset: object
    spec: TrainingSpec
    costs: StageCosts
    settings: PipelineSettings


_STATE: "_WorkerState | None" = None


def _watch_parent(parent: int, every_s: float = 1.0) -> None:
    """Exit this process once its parent is gone (orphans never outlive the pipeline)."""
    def watch() -> None:
        while True:
            time.sleep(every_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="dynapipe-parent-watch", daemon=True).start()


def worker_init(host: str, port: int, namespace: str, timeout_s: float) -> None:
    """Process-pool initializer: connect to the store and read every setting from it."""
    global _STATE
    _watch_parent(os.getppid())
    client = KVStoreClient.connect(host, port, namespace, timeout_s)
    try:
        state = _WorkerState()
        state.client = client
        state.settings = PipelineSettings.from_json(client.get_json(KVStoreMetaKeys.SETTINGS))
        state.spec = pickle.loads(client.get_meta(KVStoreMetaKeys.SPEC))
        state.dataset = pickle.loads(client.get_meta(KVStoreMetaKeys.DATASET))
        # built once per worker: a profile is read once
        state.costs = stage_costs(pickle.loads(client.get_meta(KVStoreMetaKeys.COST_MODEL)), state.spec)
    except BaseException:
        client.set_error(f"preprocessing worker (pid {os.getpid()}) failed to initialise:\n{traceback.format_exc()}")
        raise
    _STATE = state


def preprocess_iteration(iteration: int, ids: Sequence[int]) -> float:
    """Worker task: build and publish one iteration; returns its planning time in seconds."""
    state = _STATE
    if state is None:
        raise RuntimeError("preprocess_iteration runs in a worker set up by worker_init")
    try:
        blobs = build_iteration(state.dataset, state.spec, state.costs, iteration, ids,
                                state.settings.pad_token_id)
    except BaseException as error:
        shown = ", ".join(str(int(i)) for i in list(ids)[:16]) + (", ..." if len(ids) > 16 else "")
        state.client.set_error(
            f"preprocessing worker (pid {os.getpid()}) failed on iteration {iteration} "
            f"(global batch of samples [{shown}]): {type(error).__name__}: {error}\n{traceback.format_exc()}"
        )
        raise
    client = state.client
    items = {client.microbatch_key(iteration, d): blob for d, blob in blobs.microbatches.items()}
    items.update({client.plan_key(iteration, d, s): blob for (d, s), blob in blobs.plans.items()})
    client.put_many(items)
    return blobs.planning_seconds


# ---------------------------------------------------------------------------------------------
# Poller
# ---------------------------------------------------------------------------------------------


def _heartbeat(host: str, port: int, namespace: str, timeout_s: float, every_s: float,
               stop: threading.Event) -> None:
    try:
        client = KVStoreClient.connect(host, port, namespace, timeout_s)
        key = client.meta_key(KVStoreMetaKeys.HEARTBEAT)
        while not stop.is_set():
            client.add(key, 1)
            stop.wait(every_s)
    except Exception:  # the store is gone: the main loop notices and stops too
        pass


def _exit_note(processes: dict, wait_s: float = 2.0) -> str:
    deadline = time.monotonic() + wait_s
    for process in processes.values():  # the pool's own thread may be reaping them right now
        if process.exitcode is None:
            process.join(max(0.0, deadline - time.monotonic()))
    codes = {pid: p.exitcode for pid, p in processes.items() if p.exitcode not in (None, 0)}
    if not codes:
        return "its exit status is unknown"
    return "; ".join(
        f"worker pid {pid} {'was killed by signal ' + str(-code) if code < 0 else 'exited with code ' + str(code)}"
        for pid, code in codes.items()
    )


def run_poller(host: str, port: int, namespace: str, parent_pid: "int | None" = None,
               timeout_s: float = 60.0, poll_s: float = 0.01) -> int:
    """The poller's loop (module docstring). Returns 0 when every iteration was consumed or
    rank 0 asked it to stop, 1 after an error (published under the error key)."""
    client = KVStoreClient.connect(host, port, namespace, timeout_s)
    stop = threading.Event()
    poller = None
    try:
        poller = _Poller(client, PipelineSettings.from_json(client.get_json(KVStoreMetaKeys.SETTINGS)))
        poller.start_workers((host, port, namespace, timeout_s))
        threading.Thread(target=_heartbeat, name="dynapipe-heartbeat", daemon=True,
                         args=(host, port, namespace, timeout_s, poller.settings.heartbeat_interval_s,
                               stop)).start()
        if parent_pid is not None:
            _watch_parent(parent_pid)  # exits even while the loop below waits on the store
        while True:
            if parent_pid is not None and os.getppid() != parent_pid:
                return 0  # rank 0 is gone, and with it the store
            code = poller.step()
            if code is not None:
                return code
            time.sleep(poll_s)
    except BaseException:
        try:  # fails in turn when the store itself is gone: then there is nobody to tell
            client.set_error(f"the data pipeline's poller (pid {os.getpid()}) failed:\n{traceback.format_exc()}")
        except Exception:
            pass
        return 1
    finally:
        stop.set()
        if poller is not None:
            poller.close()


class _Poller:
    """Keeps ``lookahead`` iterations being prepared ahead of the slowest consumer."""

    def __init__(self, client: KVStoreClient, settings: PipelineSettings) -> None:
        self.client, self.settings = client, settings
        self.sampler = _Sampler(settings)
        self.next_submit = self.next_done = settings.start_iteration
        self.futures: dict[int, cf.Future] = {}
        self.workers: dict = {}  # every worker process seen, for the note when one dies
        self.progress: tuple | None = None
        self.pool: cf.ProcessPoolExecutor | None = None
        self.stop_keys = (client.meta_key(KVStoreMetaKeys.SHUTDOWN), client.meta_key(KVStoreMetaKeys.ERROR))

    def start_workers(self, connect_args: tuple) -> None:
        import multiprocessing

        method = self.settings.worker_start_method
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload([__name__])
        elif method == "fork":
            self._warm_up_imports()
        self.pool = cf.ProcessPoolExecutor(self.settings.num_workers, mp_context=ctx,
                                           initializer=worker_init, initargs=connect_args)
        if method == "fork":
            # fork the workers now, while this process runs a single thread (no heartbeat yet)
            self.pool.submit(int).result(timeout=connect_args[-1])

    def _warm_up_imports(self) -> None:
        # Import what the dataset and cost model need once, here, for every forked worker to
        # inherit (megatron-core alone takes seconds). The objects themselves are dropped:
        # each worker still reads its settings from the store in worker_init.
        pickle.loads(self.client.get_meta(KVStoreMetaKeys.COST_MODEL))
        warm_up = getattr(pickle.loads(self.client.get_meta(KVStoreMetaKeys.DATASET)), "warm_up", None)
        if callable(warm_up):
            warm_up()

    def step(self) -> "int | None":
        """One round: the exit code when the loop is over, None to go on."""
        if any(self.client.exists(key) for key in self.stop_keys):
            return 0
        if not self._collect_finished():
            return 1
        self._release_consumed()
        self._submit_ahead()
        self._publish_progress()
        return 0 if self.next_done >= self.settings.end_iteration else None  # all taken

    def _collect_finished(self) -> bool:
        """Reap finished iterations; False (and the error published) when one failed."""
        self.workers.update(getattr(self.pool, "_processes", None) or {})
        for it in [it for it, f in self.futures.items() if f.done()]:
            try:
                self.futures.pop(it).result()
            except BrokenProcessPool:
                self.client.set_error(
                    f"a preprocessing worker process died without reporting an error (killed, out of "
                    f"memory, or os._exit) while iteration {it} was being prepared; {_exit_note(self.workers)}. "
                    "The data pipeline cannot continue."
                )
                return False
            except BaseException as error:  # the worker published the traceback already
                self.client.set_error(f"preprocessing of iteration {it} failed: {type(error).__name__}: {error}")
                return False
        return True

    def _release_consumed(self) -> None:
        s = self.settings
        while (self.next_done < self.next_submit and self.next_done not in self.futures
               and self.client.acknowledged(self.next_done) >= s.num_consumers):
            self.client.delete_iteration(self.next_done, s.dp, s.pp)
            self.next_done += 1

    def _submit_ahead(self) -> None:
        s = self.settings
        while self.next_submit < s.end_iteration and self.next_submit - self.next_done < s.lookahead:
            ids = self.sampler(self.next_submit).tolist()
            self.futures[self.next_submit] = self.pool.submit(preprocess_iteration, self.next_submit, ids)
            self.next_submit += 1

    def _publish_progress(self) -> None:
        progress = (self.next_submit, self.next_done, len(self.futures))
        if progress != self.progress:
            self.progress = progress
            self.client.put_json(KVStoreMetaKeys.PROGRESS, {
                "submitted_up_to": self.next_submit, "consumed_up_to": self.next_done,
                "end": self.settings.end_iteration, "being_prepared": sorted(self.futures)})

    def close(self) -> None:
        if self.pool is None:
            return
        processes = list((getattr(self.pool, "_processes", None) or {}).values())
        self.pool.shutdown(wait=False, cancel_futures=True)
        for proc in processes:  # do not wait for an iteration nobody will read
            if proc.is_alive():
                proc.terminate()
        for proc in processes:
            proc.join(timeout=5)


def poller_main(argv: "Sequence[str] | None" = None) -> None:
    """Entry point of the poller process (started by DataPipelineHost)."""
    parser = argparse.ArgumentParser(description="megatron-dynapipe data pipeline poller")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    sys.exit(run_poller(args.host, args.port, args.namespace, args.parent_pid, args.timeout))


if __name__ == "__main__":  # pragma: no cover - the host starts it with -c (see DataPipelineHost)
    poller_main()
