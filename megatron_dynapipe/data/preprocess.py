"""Preprocessing: global batch of sample ids -> execution plans and sample ids in the KV store.

Processes (all on rank 0's machine, started by :class:`~megatron_dynapipe.data.loader.DataPipelineHost`):

* the **poller** (``python -c "...preprocess import poller_main; poller_main()"``, see
  :func:`run_poller`) reads the pipeline's settings from the store, owns a process pool of
  preprocessing workers and keeps at most ``lookahead`` iterations produced but not yet taken by
  every rank; it deletes an iteration's keys once all ranks acknowledged it, and it watches
  (:mod:`.liveness`): its workers (dead or stopped), the training ranks' beats, and its own loop's
  pulse, which it advances only while all is well. It stops on the shutdown key, on the first
  error, when its parent (rank 0) is gone or when every iteration has been consumed.
* **workers** (``concurrent.futures.ProcessPoolExecutor``) plan. Their state -- the dataset
  opened from its descriptor, the TrainingSpec (its fast mode resolved on rank 0), the cost model
  rebuilt from its file form -- comes from the store (:func:`worker_state`); forked workers
  inherit the poller's copy. Each task (:func:`preprocess_iteration`) plans one global batch from
  the samples' lengths and publishes one plan per (DP rank, stage), one sample-id blob per DP
  rank and the iteration's summary (:func:`build_iteration`).

Failures: a worker that raises publishes its traceback under the error key before re-raising; a
worker that dies without a word (killed, out of memory, ``os._exit``) breaks the pool and the
poller publishes that, with the worker's exit code; a stopped worker or a silent rank is reported
by the poller's watch. Every training rank raises the error key's message as
:class:`~.kv_store.DataPipelineError` from its next wait.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from megatron_dynapipe.data.blend import BlendedDataset  # noqa: F401  (registers the blend and split kinds)
from megatron_dynapipe.data.datasets import open_descriptor
from megatron_dynapipe.data.kv_store import SECRET_ENV, KVStoreClient, KVStoreMetaKeys
from megatron_dynapipe.data.liveness import BEAT_S, STOPPED_S, RankWatch, process_state
from megatron_dynapipe.data.microbatches import encode_sample_ids
from megatron_dynapipe.data.sampling import BatchSchedule
from megatron_dynapipe.hardware.pricing import Pricing
from megatron_dynapipe.planning.cost_model import StageCosts, cost_model_from_document
from megatron_dynapipe.planning.planner import PlanResult, generate_execution_plan, stage_costs
from megatron_dynapipe.planning.spec import TrainingSpec

__all__ = [
    "PipelineSettings",
    "build_iteration",
    "iteration_summary",
    "poller_main",
    "preprocess_iteration",
    "run_poller",
    "worker_state",
]

WORKER_START_METHODS = ("fork", "forkserver", "spawn")
SETTINGS_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineSettings:
    """What rank 0 publishes under :attr:`KVStoreMetaKeys.SETTINGS` (versioned JSON): what every
    rank reads. The planner's spec and cost model go under :attr:`KVStoreMetaKeys.PLANNER`."""

    dataset: dict  # the dataset's descriptor (datasets.open_descriptor)
    schedule: BatchSchedule
    start_iteration: int
    num_iterations: int
    pad_token_id: int
    dp: int
    pp: int
    tp: int
    cp: int = 1  # context-parallel ranks: each reads the whole micro-batches and keeps its share
    lookahead: int = 2
    num_workers: int = 2
    worker_start_method: str = "fork"
    store_timeout_s: float = 60.0
    version: int = field(default=SETTINGS_VERSION)

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "cp", "lookahead", "num_workers"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.start_iteration < 0 or self.num_iterations < 0:
            raise ValueError("start_iteration and num_iterations must be >= 0")
        if self.schedule.num_samples < self.schedule.global_batch_size:
            raise ValueError(f"the dataset has {self.schedule.num_samples} samples, fewer than one global batch of "
                             f"{self.schedule.global_batch_size}")
        if self.schedule.batch_size(0) < self.dp:
            raise ValueError(f"a global batch of {self.schedule.batch_size(0)} samples cannot feed {self.dp} "
                             "data-parallel ranks")
        if self.worker_start_method not in WORKER_START_METHODS:
            raise ValueError(f"worker_start_method must be one of {', '.join(WORKER_START_METHODS)}, "
                             f"got {self.worker_start_method!r}")

    @property
    def num_consumers(self) -> int:
        """Ranks that take every iteration: one per (DP rank, stage, TP rank, CP rank)."""
        return self.dp * self.pp * self.tp * self.cp

    def consumer(self, dp_rank: int, stage: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((dp_rank * self.pp + stage) * self.tp + tp_rank) * self.cp + cp_rank

    def describe_consumer(self, consumer: int) -> str:
        rest, cp_rank = divmod(consumer, self.cp)
        rest, tp_rank = divmod(rest, self.tp)
        dp_rank, stage = divmod(rest, self.pp)
        return f"(dp {dp_rank}, stage {stage}, tp {tp_rank}" + (f", cp {cp_rank})" if self.cp > 1 else ")")

    @property
    def end_iteration(self) -> int:
        return self.start_iteration + self.num_iterations

    def to_json(self) -> dict:
        values = asdict(self)
        values["schedule"] = self.schedule.to_json()
        return values

    @classmethod
    def from_json(cls, data: dict) -> "PipelineSettings":
        if not isinstance(data, dict) or data.get("version") != SETTINGS_VERSION:
            version = data.get("version") if isinstance(data, dict) else "?"
            raise ValueError(f"the data pipeline's settings are version {version}, "
                             f"this megatron-dynapipe reads version {SETTINGS_VERSION}: run one version on every rank")
        data = dict(data)
        data["schedule"] = BatchSchedule.from_json(data["schedule"])
        return cls(**data)


# ---------------------------------------------------------------------------------------------
# One iteration
# ---------------------------------------------------------------------------------------------


@dataclass
class IterationBlobs:
    """What one iteration publishes: plans[(dp, stage)], ids[dp] as bytes, and its summary."""

    plans: dict[tuple[int, int], bytes]
    ids: dict[int, bytes]
    summary: dict


def build_iteration(lengths: np.ndarray, spec: TrainingSpec, cost_model, iteration: int,
                    ids: Sequence[int]) -> IterationBlobs:
    """Plan the global batch ``ids`` (of samples with ``lengths``) and serialise one plan per
    (DP rank, stage) and one sample-id blob per DP rank. Pure: no store involved."""
    ids = np.asarray(ids, dtype=np.int64)
    batch_lengths = np.asarray(lengths)[ids]
    result = generate_execution_plan(batch_lengths.tolist(), spec, cost_model)  # with spec.fast_mode
    plans, id_blobs = {}, {}
    pieces = result.pieces  # the plans index pieces of the samples where it cut them
    for dp_rank, stage_plans in enumerate(result.plans):
        for stage, plan in enumerate(stage_plans):
            plans[dp_rank, stage] = plan.to_bytes()
        mbs = stage_plans[0].microbatches
        order = np.array([i for mb in mbs for i in mb.samples], dtype=np.int64)
        shapes = [(mb.size, mb.seq_len) for mb in mbs]
        if pieces is None:
            id_blobs[dp_rank] = encode_sample_ids(iteration, dp_rank, shapes, ids[order], batch_lengths[order])
        else:
            id_blobs[dp_rank] = encode_sample_ids(iteration, dp_rank, shapes, ids[pieces.sample[order]],
                                                  pieces.tokens[order], pieces.start[order])
    return IterationBlobs(plans, id_blobs, iteration_summary(iteration, batch_lengths, result))


def iteration_summary(iteration: int, lengths: np.ndarray, result: PlanResult) -> dict:
    """What one iteration trains, for the logs: its samples, real and padded tokens,
    micro-batches and schedule per DP rank, recompute choices, predicted time."""
    first_stages = [plans[0] for plans in result.plans]
    padded = sum(mb.tokens for plan in first_stages for mb in plan.microbatches)
    recompute: dict[str, int] = {}
    for choice in result.choices:
        for code in np.asarray(choice.recompute).ravel().tolist():
            label = ("none", "selective", "full")[code]
            recompute[label] = recompute.get(label, 0) + 1
    return {"iteration": int(iteration), "samples": int(len(lengths)), "real_tokens": int(np.sum(lengths)),
            "padded_tokens": int(padded), "microbatches": [len(plan.microbatches) for plan in first_stages],
            "schedules": [plan.schedule for plan in first_stages], "recompute": recompute,
            "predicted_ms": round(float(result.makespan_ms), 3), "planning_s": round(result.planning_seconds, 4)}


# ---------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------


@dataclass
class _WorkerState:
    settings: PipelineSettings
    lengths: np.ndarray
    spec: TrainingSpec
    costs: StageCosts
    client: "KVStoreClient | None" = None


_STATE: "_WorkerState | None" = None


def worker_state(client: KVStoreClient) -> _WorkerState:
    """Everything a worker plans with, read from the store: settings, the dataset's lengths
    (opened from its descriptor), the spec and the cost model (rebuilt from its file form)."""
    settings = PipelineSettings.from_json(client.get_json(KVStoreMetaKeys.SETTINGS))
    planner = client.get_json(KVStoreMetaKeys.PLANNER)
    spec = TrainingSpec.from_json(planner["spec"])
    lengths = np.asarray(open_descriptor(settings.dataset).lengths)
    return _WorkerState(settings, lengths, spec, _shipped_stage_costs(planner["cost_model"], spec))


def _shipped_stage_costs(shipped: "dict | None", spec: TrainingSpec) -> StageCosts:
    """The stage costs of the cost model the hosting rank shipped (loader._cost_model_document;
    None: the spec's analytical model), or of its job's pricing, whose stages send at the
    device's link as ``search`` prices them."""
    if shipped is None or "pricing" not in shipped:
        return stage_costs(None if shipped is None else cost_model_from_document(
            shipped["document"], shipped["tp"], source="the job's cost model"), spec)
    return Pricing.from_json(shipped["pricing"]).stage_costs(spec)


def _watch_parent(parent: int, every_s: float = 1.0) -> None:
    """Exit this process once its parent is gone (orphans never outlive the pipeline)."""
    def watch() -> None:
        while True:
            time.sleep(every_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="dynapipe-parent-watch", daemon=True).start()


def _end_with_parent(parent: int) -> None:
    """Have the kernel end this process when its parent ends (Linux's ``PR_SET_PDEATHSIG``), and
    end it now if that happened already. The watch thread (:func:`_watch_parent`) can start only
    once the workers are forked, and reaching the store or starting them can wait for minutes: an
    orphan poller waiting there held the job's output open long after the job had failed."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the watch thread alone, once it runs
    if os.getppid() != parent:
        os._exit(0)


def worker_init(host: str, port: int, namespace: str, timeout_s: float) -> None:
    """Process-pool initializer: connect to the store; read the state from it unless inherited."""
    global _STATE
    _watch_parent(os.getppid())
    client = KVStoreClient.connect(host, port, bytes.fromhex(os.environ[SECRET_ENV]), namespace, timeout_s)
    try:
        state = _STATE or worker_state(client)  # a forked worker inherits the poller's
    except BaseException:
        client.set_error(f"preprocessing worker (pid {os.getpid()}) failed to initialise:\n{traceback.format_exc()}")
        raise
    state.client = client
    _STATE = state


def preprocess_iteration(iteration: int, ids: Sequence[int]) -> float:
    """Worker task: build and publish one iteration; returns its planning time in seconds."""
    state = _STATE
    if state is None or state.client is None:
        raise RuntimeError("preprocess_iteration runs in a worker set up by worker_init")
    client = state.client
    try:
        blobs = build_iteration(state.lengths, state.spec, state.costs, iteration, ids)
    except BaseException as error:
        shown = ", ".join(str(int(i)) for i in list(ids)[:16]) + (", ..." if len(ids) > 16 else "")
        client.set_error(
            f"preprocessing worker (pid {os.getpid()}) failed on iteration {iteration} "
            f"(global batch of samples [{shown}]): {type(error).__name__}: {error}\n{traceback.format_exc()}")
        raise
    items = {client.ids_key(iteration, d): blob for d, blob in blobs.ids.items()}
    items.update({client.plan_key(iteration, d, s): blob for (d, s), blob in blobs.plans.items()})
    items[client.summary_key(iteration)] = json.dumps(blobs.summary).encode()
    client.put_many(items)
    return blobs.summary["planning_s"]


# ---------------------------------------------------------------------------------------------
# Poller
# ---------------------------------------------------------------------------------------------


def _exit_code(process) -> "int | None":
    """The exit code of a worker whose sentinel says it has ended. The pool's own thread reaps its
    workers too, and a reaper racing it sees no status: whichever thread reaps one records its
    code on the process, so wait for that to appear (the process is gone; only the recording is
    pending), not for a time that a loaded machine could outlast."""
    for _ in range(100_000):  # about a minute; only a process nobody reaps outlasts it
        code = process.exitcode
        if code is not None:
            return code
        time.sleep(0.0005)
    return None


def _exit_note(processes: dict) -> str:
    from multiprocessing.connection import wait

    ended = set(wait([p.sentinel for p in processes.values()], timeout=0))
    codes = {pid: _exit_code(p) for pid, p in processes.items() if p.sentinel in ended}
    codes = {pid: code for pid, code in codes.items() if code not in (None, 0)}
    if not codes:
        return "its exit status is unknown"
    return "; ".join(
        f"worker pid {pid} {'was killed by signal ' + str(-code) if code < 0 else 'exited with code ' + str(code)}"
        for pid, code in codes.items())


def _dead_worker(processes: dict, when: str) -> str:
    return (f"a preprocessing worker process died without reporting an error (killed, out of memory, or os._exit) "
            f"{when}; {_exit_note(processes)}. The data pipeline cannot continue: restart the job.")


def run_poller(host: str, port: int, namespace: str, parent_pid: "int | None" = None,
               timeout_s: float = 60.0, poll_s: float = 0.01) -> int:
    """The poller's loop (module docstring). Returns 0 when every iteration was consumed or
    rank 0 asked it to stop, 1 after an error (published under the error key)."""
    if parent_pid is not None:
        _end_with_parent(parent_pid)
    client = KVStoreClient.connect(host, port, bytes.fromhex(os.environ[SECRET_ENV]), namespace, timeout_s)
    poller = None
    try:
        poller = _Poller(client)
        poller.start_workers((host, port, namespace, timeout_s))  # forks while this process runs one thread
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
        if poller is not None:
            poller.close()


class _Poller:
    """Keeps ``lookahead`` iterations being prepared ahead of the slowest consumer, and watches."""

    def __init__(self, client: KVStoreClient) -> None:
        global _STATE
        self.client = client
        _STATE = worker_state(client)  # opened once here; forked workers inherit it
        self.settings = s = _STATE.settings
        self.next_submit = self.next_done = s.start_iteration
        self.futures: dict[int, cf.Future] = {}
        self.workers: dict = {}  # every worker process seen, for the note when one dies
        self.stopped_since: dict[int, float] = {}
        self.progress: tuple | None = None
        self.pool: cf.ProcessPoolExecutor | None = None
        self.ranks = RankWatch(client, s.num_consumers, s.describe_consumer)
        self.stop_keys = (client.meta_key(KVStoreMetaKeys.SHUTDOWN), client.meta_key(KVStoreMetaKeys.ERROR))
        self.pulse_key = client.meta_key(KVStoreMetaKeys.PULSE)
        self.next_watch = 0.0

    def start_workers(self, connect_args: tuple) -> None:
        import multiprocessing

        method = self.settings.worker_start_method
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload([__name__])
        self.pool = cf.ProcessPoolExecutor(self.settings.num_workers, mp_context=ctx,
                                           initializer=worker_init, initargs=connect_args)
        self.pool.submit(int).result(timeout=connect_args[-1])  # every worker started and set up

    def step(self) -> "int | None":
        """One round: the exit code when the loop is over, None to go on."""
        if any(self.client.exists(key) for key in self.stop_keys):
            return 0
        if not self._collect_finished() or not self._watch():
            return 1
        self._release_consumed()
        try:
            self._submit_ahead()
        except BrokenProcessPool:  # a worker died since the last watch
            self.client.set_error(_dead_worker(self.workers, "while it waited for work"))
            return 1
        self._publish_progress()
        return 0 if self.next_done >= self.settings.end_iteration else None  # all taken

    def _watch(self) -> bool:
        """Every BEAT_S / 4: check the workers and the ranks, then advance the pulse. False (and
        the error published) when a worker is stopped or a rank fell silent."""
        now = time.monotonic()
        if now < self.next_watch:
            return True
        self.next_watch = now + BEAT_S / 4
        self.workers.update(getattr(self.pool, "_processes", None) or {})
        if any(p.exitcode is not None for p in self.workers.values()):
            self.client.set_error(_dead_worker(self.workers, "while it waited for work"))
            return False
        for pid in list((getattr(self.pool, "_processes", None) or {})):
            if process_state(pid) in ("T", "t"):
                since = self.stopped_since.setdefault(pid, now)
                if now - since > STOPPED_S:
                    self.client.set_error(
                        f"preprocessing worker pid {pid} on rank 0's machine is stopped (SIGSTOP or a debugger) and "
                        "plans nothing: resume it (kill -CONT) or restart the job")
                    return False
            else:
                self.stopped_since.pop(pid, None)
        silent = self.ranks.silent()
        if silent:
            self.client.set_error(self.ranks.message(silent))
            return False
        self.client.add(self.pulse_key, 1)
        return True

    def _collect_finished(self) -> bool:
        """Reap finished iterations; False (and the error published) when one failed."""
        self.workers.update(getattr(self.pool, "_processes", None) or {})
        for it in [it for it, f in self.futures.items() if f.done()]:
            try:
                self.futures.pop(it).result()
            except BrokenProcessPool:
                self.client.set_error(_dead_worker(self.workers, f"while iteration {it} was being prepared"))
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
            ids = s.schedule.ids(self.next_submit).tolist()
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
            if proc.is_alive():  # stopped (SIGTERM waits for a SIGCONT), or deaf to it
                proc.kill()
                proc.join(timeout=5)


def poller_main(argv: "Sequence[str] | None" = None) -> None:
    """Entry point of the poller process (started by DataPipelineHost; the job's secret comes
    in its environment, never on its command line)."""
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
