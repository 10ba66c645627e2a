"""The training ranks' side of the data pipeline: an iterator of :class:`PlannedBatch`.

Every rank of the job builds one :class:`DynaPipeDataLoader` with its (DP rank, pipeline stage,
TP rank), passed in as integers or read from megatron-core's ``parallel_state``
(:meth:`DynaPipeDataLoader.from_parallel_state`). The rank with coordinates (0, 0, 0) -- global
rank 0 in Megatron's rank order -- also hosts the pipeline (:class:`DataPipelineHost`): the
TCPStore server, the settings every process reads from it and the poller process with its
preprocessing workers (:mod:`megatron_dynapipe.data.preprocess`). Only the host needs the dataset
and the cost model; the other ranks read the settings from the store.

Iteration ``i`` on a rank waits for its stage's plan ``<ns>/it/<i>/plan/<dp>/<stage>`` and its DP
rank's micro-batches ``<ns>/it/<i>/mb/<dp>``, rebuilds the tensors, acknowledges the iteration and
yields ``PlannedBatch(i, plan, microbatches)``. The tensor-parallel ranks of a stage read the very
same keys, so they get identical tensors without a broadcast among them (and without Megatron's
fixed-shape ``get_batch`` broadcast).

Length and epochs. The loader yields iterations ``start_iteration ... start_iteration +
num_iterations - 1`` once, as one stream (iterating again continues where it stopped);
``len(loader) == num_iterations``. Iteration ``i`` takes the global batch
``preprocess.sample_ids(i, ...)``: epochs of ``iterations_per_epoch = len(dataset) //
global_batch_size`` iterations, each a fresh shuffle (seeded by ``(seed, epoch)``) with the last
``len(dataset) % global_batch_size`` samples of that order left out; ``num_iterations`` defaults to
one epoch and may span several. Resuming at Megatron's ``args.iteration`` with the same seed
replays the same sequence.

Failure semantics. Every wait is bounded: ``timeout_s`` for one iteration, ``connect_timeout_s``
to reach the store and read the settings, ``heartbeat_timeout_s`` of silence from the poller.
A worker's exception (with its traceback), a dead worker, a dead poller or a lost store raise
:class:`DataPipelineError` on every rank from its next wait; running out of time raises
:class:`DataPipelineTimeout` (with the poller's progress). ``close()`` (or ``with loader:``) on
every rank ends the pipeline cleanly: rank 0 waits (at most ``close_timeout_s``) for the other
ranks to close, stops the poller and its workers, then the store.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass

import torch

from megatron_dynapipe.data.batch import PlannedBatch
from megatron_dynapipe.data.kv_store import (
    DEFAULT_NAMESPACE,
    DataPipelineError,
    HeartbeatWatch,
    KVStoreClient,
    KVStoreMetaKeys,
)
from megatron_dynapipe.data.microbatches import decode_microbatches
from megatron_dynapipe.data.preprocess import PipelineSettings
from megatron_dynapipe.planning.fast_mode import resolve_fast_mode_setting
from megatron_dynapipe.planning.plan import ExecutionPlan
from megatron_dynapipe.planning.spec import TrainingSpec

__all__ = ["DataPipelineHost", "DynaPipeDataLoader", "RankLayout", "from_parallel_state"]

KV_PORT_ENV = "DYNAPIPE_KV_PORT"


@dataclass(frozen=True)
class RankLayout:
    """Where a rank sits: its data-parallel rank, pipeline stage and tensor-parallel rank."""

    dp_rank: int
    stage: int
    tp_rank: int = 0

    def check(self, dp: int, pp: int, tp: int) -> None:
        for name, value, size in (("dp_rank", self.dp_rank, dp), ("stage", self.stage, pp),
                                  ("tp_rank", self.tp_rank, tp)):
            if not 0 <= int(value) < size:
                raise ValueError(f"{name}={value} is outside the job's layout (dp={dp}, pp={pp}, tp={tp})")

    @property
    def is_first(self) -> bool:
        return self.dp_rank == 0 and self.stage == 0 and self.tp_rank == 0


def from_parallel_state() -> RankLayout:
    """This rank's layout from megatron-core's initialised ``parallel_state``.

    Context parallelism is not supported: its ranks would need different slices of each sample.
    """
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("megatron-core's parallel_state is not initialised: call initialize_model_parallel "
                           "first, or pass dp_rank/stage/tp_rank explicitly")
    if ps.get_context_parallel_world_size() > 1:
        raise NotImplementedError("the DynaPipe data pipeline does not support context parallelism")
    return RankLayout(ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                      ps.get_tensor_model_parallel_rank())


def _parallel_sizes():
    from megatron.core import parallel_state as ps

    return (ps.get_data_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_tensor_model_parallel_world_size())


def _default_port() -> int:
    if KV_PORT_ENV in os.environ:
        return int(os.environ[KV_PORT_ENV])
    if "MASTER_PORT" in os.environ:
        return int(os.environ["MASTER_PORT"]) + 1
    raise ValueError(f"no port for the data pipeline's KV store: pass port=..., or set {KV_PORT_ENV} "
                     "(or MASTER_PORT, and the store uses MASTER_PORT + 1)")


def _stop_poller(proc: subprocess.Popen, wait_s: float) -> None:
    if proc.poll() is None:
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class DataPipelineHost:
    """Rank 0's part: the store server, the published settings and the poller process.

    ``port=0`` lets the OS pick a free port (read :attr:`port`). ``fast_mode`` overrides
    ``spec.fast_mode``; when both are None, ``DYNAPIPE_FAST_MODE`` in rank 0's environment
    decides (off when unset), and the result is what every worker plans with.
    ``worker_start_method``: how the poller starts its workers. "fork" (default) is safe there:
    the poller is a fresh process of ours (no CUDA, no accelerator runtime) that forks all its
    workers at start-up, before it runs any second thread, after importing what the dataset and
    cost model need; "forkserver" and "spawn" start cleaner but slower workers.
    """

    def __init__(self, dataset, spec: TrainingSpec, cost_model, global_batch_size: int, *,
                 port: int = 0, namespace: str = DEFAULT_NAMESPACE, num_iterations: "int | None" = None,
                 start_iteration: int = 0, shuffle: bool = True, seed: int = 0, pad_token_id: int = 0,
                 fast_mode=None, num_workers: int = 2, lookahead: int = 2,
                 worker_start_method: str = "fork", heartbeat_interval_s: float = 0.5,
                 store_timeout_s: float = 60.0):
        if dataset is None or spec is None or global_batch_size is None:
            raise ValueError("the hosting rank (rank 0) needs the dataset, the TrainingSpec and the global batch size")
        if not hasattr(dataset, "lengths") or getattr(dataset, "max_seq_len", None) is None:
            raise TypeError(f"{type(dataset).__name__} is not a VariableLengthDataset (needs max_seq_len, "
                            "lengths, __len__ and __getitem__); see megatron_dynapipe.data.datasets")
        per_epoch = len(dataset) // max(1, int(global_batch_size))
        self.settings = PipelineSettings(
            num_samples=len(dataset), global_batch_size=int(global_batch_size),
            start_iteration=int(start_iteration),
            num_iterations=int(per_epoch if num_iterations is None else num_iterations),
            shuffle=bool(shuffle), seed=int(seed), pad_token_id=int(pad_token_id),
            dp=spec.dp, pp=spec.pp, tp=spec.tp, lookahead=int(lookahead), num_workers=int(num_workers),
            worker_start_method=worker_start_method, heartbeat_interval_s=float(heartbeat_interval_s),
            store_timeout_s=float(store_timeout_s))
        spec = dataclasses.replace(spec, fast_mode=resolve_fast_mode_setting(
            spec.fast_mode if fast_mode is None else fast_mode))  # the one value every worker plans with
        blobs = {KVStoreMetaKeys.SPEC: pickle.dumps(spec), KVStoreMetaKeys.COST_MODEL: pickle.dumps(cost_model),
                 KVStoreMetaKeys.DATASET: pickle.dumps(dataset)}  # fail here, not in a worker
        self.namespace = namespace
        self.client = KVStoreClient.host(int(port), namespace, store_timeout_s)
        self.proc: "subprocess.Popen | None" = None
        self._closed = False
        try:
            for key, blob in blobs.items():
                self.client.put_meta(key, blob)
            self.client.put_json(KVStoreMetaKeys.SETTINGS, self.settings.to_json())  # last: "ready"
            self.proc = self._start_poller()
        except BaseException:
            self.close(wait_for_ranks=False)
            raise
        self._finalizer = weakref.finalize(self, _stop_poller, self.proc, 0)

    @property
    def port(self) -> int:
        return self.client.port

    def _start_poller(self) -> subprocess.Popen:
        env = dict(os.environ)
        # the workers unpickle the dataset and cost model: give them this process's import path
        paths = [p for p in sys.path if p] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        command = [sys.executable, "-c",
                   "from megatron_dynapipe.data.preprocess import poller_main; poller_main()",
                   "--host", "127.0.0.1", "--port", str(self.port), "--namespace", self.namespace,
                   "--parent-pid", str(os.getpid()), "--timeout", str(self.settings.store_timeout_s)]
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)

    def check_alive(self) -> None:
        """Raise (and publish for every rank) if the poller ended before its work was done."""
        if self.proc is None or self.proc.poll() is None:
            return
        self.client.raise_if_error()
        progress = self.client.get_json(KVStoreMetaKeys.PROGRESS, timeout_s=0.1) if self.client.exists(
            self.client.meta_key(KVStoreMetaKeys.PROGRESS)) else {}
        if progress.get("consumed_up_to") == self.settings.end_iteration:
            return  # finished: every iteration was taken by every rank
        if self.client.exists(self.client.meta_key(KVStoreMetaKeys.SHUTDOWN)):
            return
        code = self.proc.returncode
        self.client.set_error(
            f"the data pipeline's poller (pid {self.proc.pid}) exited early with "
            f"{'signal ' + str(-code) if code < 0 else 'code ' + str(code)} (its output went to rank 0's stderr)")
        self.client.raise_if_error()

    def close(self, timeout_s: float = 30.0, wait_for_ranks: bool = True) -> None:
        """Wait (at most ``timeout_s``) for every rank to close its loader, then stop the poller
        (and with it the workers) and the store. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        client = self.client
        try:
            if wait_for_ranks:
                deadline = time.monotonic() + timeout_s
                key = client.meta_key(KVStoreMetaKeys.CLOSED)
                while client.add(key, 0) < self.settings.num_consumers and time.monotonic() < deadline:
                    if client.get_error() is not None and (self.proc is None or self.proc.poll() is not None):
                        break  # failed pipeline: ranks that crashed will not close
                    time.sleep(0.02)
            client.put_meta(KVStoreMetaKeys.SHUTDOWN, b"1")
        except DataPipelineError:
            pass
        if self.proc is not None:
            _stop_poller(self.proc, 10.0)
        client.store = None  # drop the server: the store stops listening

    def __enter__(self) -> "DataPipelineHost":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_HOST_OPTIONS = {"num_iterations", "start_iteration", "shuffle", "seed", "pad_token_id", "fast_mode",
                 "num_workers", "lookahead", "worker_start_method", "heartbeat_interval_s"}


class DynaPipeDataLoader:
    """Iterator of :class:`PlannedBatch` for one rank (module docstring: semantics).

    Arguments (keyword-only after the first four):

    * ``dataset``, ``spec``, ``cost_model``, ``global_batch_size``: used on the hosting rank
      (the others may pass None; a given ``spec`` is checked against the host's layout).
    * ``dp_rank``, ``stage``, ``tp_rank``: this rank's coordinates.
    * ``host_pipeline``: host the pipeline here; default: when this rank is (0, 0, 0).
    * ``master_addr`` / ``port``: where the store is (defaults: ``MASTER_ADDR`` or 127.0.0.1;
      ``DYNAPIPE_KV_PORT``, else ``MASTER_PORT + 1``; a hosting rank may use ``port=0``).
    * ``timeout_s``: longest wait for one iteration; ``connect_timeout_s``: to reach the store
      and its settings; ``heartbeat_timeout_s``: poller silence that counts as dead (before its
      first beat, while it starts, the larger of it and ``connect_timeout_s``);
      ``close_timeout_s``: how long the host's ``close`` waits for the other ranks.
    * everything else (``num_iterations``, ``start_iteration``, ``shuffle``, ``seed``,
      ``pad_token_id``, ``fast_mode``, ``num_workers``, ``lookahead``, ``worker_start_method``,
      ``namespace``) goes to :class:`DataPipelineHost`; ``namespace`` must match on all ranks.
      Other ranks read these settings from the store, so the same call works on every rank;
      an option given there that contradicts rank 0's raises ValueError.
    """

    def __init__(self, dataset=None, spec: "TrainingSpec | None" = None, cost_model=None,
                 global_batch_size: "int | None" = None, *, dp_rank: int, stage: int, tp_rank: int = 0,
                 host_pipeline: "bool | None" = None, master_addr: "str | None" = None,
                 port: "int | None" = None, namespace: str = DEFAULT_NAMESPACE, timeout_s: float = 600.0,
                 connect_timeout_s: float = 300.0, heartbeat_timeout_s: float = 60.0,
                 close_timeout_s: float = 30.0, **host_options):
        self.layout = RankLayout(int(dp_rank), int(stage), int(tp_rank))
        self.timeout_s = float(timeout_s)
        self.close_timeout_s = float(close_timeout_s)
        self.host: "DataPipelineHost | None" = None
        self._closed = False
        if host_pipeline is None:
            host_pipeline = self.layout.is_first
        if host_pipeline:
            self.host = DataPipelineHost(dataset, spec, cost_model, global_batch_size,
                                         port=_default_port() if port is None else port,
                                         namespace=namespace, store_timeout_s=connect_timeout_s, **host_options)
            self.client = KVStoreClient.connect("127.0.0.1", self.host.port, namespace, connect_timeout_s)
        else:
            unknown = set(host_options) - _HOST_OPTIONS
            if unknown:
                raise TypeError(f"unexpected keyword argument(s) {', '.join(sorted(unknown))}")
            addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
            self.client = KVStoreClient.connect(addr, _default_port() if port is None else port, namespace,
                                                connect_timeout_s)
        try:
            self._heartbeat = HeartbeatWatch(self.client, heartbeat_timeout_s,
                                             startup_timeout_s=max(heartbeat_timeout_s, connect_timeout_s))
            self.settings = PipelineSettings.from_json(
                self.client.get_json(KVStoreMetaKeys.SETTINGS, timeout_s=connect_timeout_s))
            s = self.settings
            if spec is not None and (spec.dp, spec.pp, spec.tp) != (s.dp, s.pp, s.tp):
                raise ValueError(f"this rank's spec (dp={spec.dp}, pp={spec.pp}, tp={spec.tp}) differs from the "
                                 f"pipeline host's (dp={s.dp}, pp={s.pp}, tp={s.tp})")
            self.layout.check(s.dp, s.pp, s.tp)
            if self.host is None:  # the host's settings rule; a rank that says otherwise is misconfigured
                settings = s.to_json()
                given = dict(host_options, global_batch_size=global_batch_size)
                differ = {k: (v, settings[k]) for k, v in given.items()
                          if k in settings and v is not None and v != settings[k]}
                if differ:
                    raise ValueError("this rank's data pipeline options differ from the host's: " + ", ".join(
                        f"{k}={mine!r} here, {theirs!r} on rank 0" for k, (mine, theirs) in sorted(differ.items())))
        except BaseException:
            if self.host is not None:
                self.host.client.set_error(f"rank (dp {dp_rank}, stage {stage}, tp {tp_rank}) could not join "
                                           "the data pipeline")
                self.host.close(wait_for_ranks=False)
            raise
        self._next = s.start_iteration

    @classmethod
    def from_parallel_state(cls, dataset=None, spec: "TrainingSpec | None" = None, cost_model=None,
                            global_batch_size: "int | None" = None, **options) -> "DynaPipeDataLoader":
        """Build with this rank's coordinates from megatron-core's ``parallel_state`` (which must
        agree with ``spec``'s dp/pp/tp when one is given)."""
        layout = from_parallel_state()
        if spec is not None and (spec.dp, spec.pp, spec.tp) != _parallel_sizes():
            dp, pp, tp = _parallel_sizes()
            raise ValueError(f"spec (dp={spec.dp}, pp={spec.pp}, tp={spec.tp}) differs from megatron's "
                             f"parallel state (dp={dp}, pp={pp}, tp={tp})")
        return cls(dataset, spec, cost_model, global_batch_size, dp_rank=layout.dp_rank, stage=layout.stage,
                   tp_rank=layout.tp_rank, **options)

    # -- iteration --------------------------------------------------------------------------

    @property
    def num_iterations(self) -> int:
        return self.settings.num_iterations

    @property
    def iterations_per_epoch(self) -> int:
        return self.settings.iterations_per_epoch

    def __len__(self) -> int:
        return self.settings.num_iterations

    def __iter__(self) -> "DynaPipeDataLoader":
        return self

    def _liveness(self) -> None:
        self._heartbeat()
        if self.host is not None:
            self.host.check_alive()

    def __next__(self) -> PlannedBatch:
        if self._closed:
            raise RuntimeError("the loader is closed")
        it = self._next
        if it >= self.settings.end_iteration:
            raise StopIteration
        dp, stage = self.layout.dp_rank, self.layout.stage
        keys = [self.client.plan_key(it, dp, stage), self.client.microbatch_key(it, dp)]
        self.client.wait(keys, self.timeout_s, what=f"iteration {it} (dp {dp}, stage {stage})",
                         liveness=self._liveness)
        plan_blob, mb_blob = self.client.get_many(keys)
        self.client.acknowledge(it)
        self._next = it + 1
        plan = ExecutionPlan.from_bytes(plan_blob)
        decoded = decode_microbatches(mb_blob)
        shapes = [(mb.size, mb.seq_len) for mb in plan.microbatches]
        if plan.stage != stage or decoded.iteration != it or decoded.dp_rank != dp or decoded.shapes != shapes:
            raise DataPipelineError(
                f"iteration {it}: inconsistent data for dp {dp}, stage {stage} (plan of stage {plan.stage} with "
                f"shapes {shapes}; micro-batches of iteration {decoded.iteration}, dp {decoded.dp_rank}, "
                f"shapes {decoded.shapes})")
        microbatches = [{k: torch.from_numpy(v) for k, v in arrays.items()} for arrays in decoded.arrays()]
        return PlannedBatch(iteration=it, plan=plan, microbatches=microbatches)

    # -- shutdown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the pipeline: count this rank as closed; on the host, wait for the others and
        stop the poller, its workers and the store. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self.client.add(self.client.meta_key(KVStoreMetaKeys.CLOSED), 1)
        except DataPipelineError:
            pass  # the store is gone already
        if self.host is not None:
            self.host.close(self.close_timeout_s)

    def __enter__(self) -> "DynaPipeDataLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
