"""The training ranks' side of the data pipeline: an iterator of :class:`PlannedBatch`.

Every rank of the job builds one :class:`DynaPipeDataLoader` with its (DP rank, pipeline stage,
TP rank), passed in as integers or read from megatron-core's ``parallel_state``
(:meth:`DynaPipeDataLoader.from_parallel_state`). The rank with coordinates (0, 0, 0) -- global
rank 0 in Megatron's rank order -- also hosts the pipeline (:class:`DataPipelineHost`): the
TCPStore server, the settings every process reads from it and the poller process with its
preprocessing workers (:mod:`megatron_dynapipe.data.preprocess`). Only the host needs the dataset
object and the cost model; every other rank opens the dataset from the descriptor the host
published and reads its own samples from it.

Iteration ``i`` on a rank waits for its stage's plan, its DP rank's sample ids and the iteration's
summary, reads those samples, acknowledges the iteration and yields ``PlannedBatch(i, plan,
microbatches, summary)``. The tensor-parallel ranks of a stage read the very same keys and
samples, so they get identical tensors without a broadcast among them (and without Megatron's
fixed-shape ``get_batch`` broadcast).

Batches. Iteration ``i`` trains the global batch :meth:`~.sampling.BatchSchedule.ids` gives: the
samples' stream, epoch after epoch, cut into ``global_batch_size`` samples (or Megatron's ramp-up).
The loader yields iterations ``start_iteration ... start_iteration + num_iterations - 1`` once
(``len(loader) == num_iterations``, one epoch by default). Resuming at Megatron's
``args.iteration`` with the same seed replays the same sequence.

The job's secret authenticates everything in the store (:mod:`.kv_store`): ``secret=``, else
``DYNAPIPE_KV_SECRET``, else -- when the loaders are built by every rank of ``process_group`` at
once (Megatron-LM's ranks do) -- rank 0 draws one and shares it over that group, together with
whether its store started (so no rank waits on a store that never came up).

Failure semantics (:mod:`.liveness`). Every wait is bounded: ``timeout_s`` for one iteration,
``connect_timeout_s`` to reach the store and read the settings. A worker's exception (with its
traceback), a dead or stopped worker, a stalled poller, a rank that stopped beating, a lost store
or a value not written by this job raise :class:`DataPipelineError` on every rank within seconds;
running out of time raises :class:`DataPipelineTimeout` (with the poller's progress). ``close()``
(or ``with loader:``) on every rank ends the pipeline cleanly: rank 0 waits (at most
``close_timeout_s``, less when a rank is dead) for the other ranks to close, stops the poller and
its workers, then the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from megatron_dynapipe.data.batch import PlannedBatch
from megatron_dynapipe.data.blend import BlendedDataset  # noqa: F401  (registers the blend and split kinds)
from megatron_dynapipe.data.datasets import TokenListDataset, open_descriptor
from megatron_dynapipe.data.kv_store import (
    DEFAULT_NAMESPACE,
    SECRET_ENV,
    DataPipelineError,
    KVStoreClient,
    KVStoreMetaKeys,
)
from megatron_dynapipe.data.liveness import STALL_S, PulseWatch, RankBeacon, RankWatch
from megatron_dynapipe.data.microbatches import SampleIds, decode_sample_ids, gpt_microbatch, packed_microbatch
from megatron_dynapipe.data.preprocess import PipelineSettings
from megatron_dynapipe.data.sampling import BatchSchedule
from megatron_dynapipe.hardware.pricing import Pricing
from megatron_dynapipe.planning.cost_model import CostModel, StageCosts, load_cost_model
from megatron_dynapipe.planning.fast_mode import resolve_fast_mode_setting
from megatron_dynapipe.planning.plan import ExecutionPlan
from megatron_dynapipe.planning.spec import TrainingSpec, packed_sample_multiple

__all__ = ["DataPipelineHost", "DynaPipeDataLoader", "RankLayout", "from_parallel_state", "job_secret",
           "share_host_failure"]

KV_PORT_ENV = "DYNAPIPE_KV_PORT"


@dataclass(frozen=True)
class RankLayout:
    """Where a rank sits: its data-parallel rank, pipeline stage, tensor- and context-parallel
    ranks (the TP and CP ranks of a stage read the same micro-batches)."""

    dp_rank: int
    stage: int
    tp_rank: int = 0
    cp_rank: int = 0

    def check(self, dp: int, pp: int, tp: int, cp: int = 1) -> None:
        for name, value, size in (("dp_rank", self.dp_rank, dp), ("stage", self.stage, pp),
                                  ("tp_rank", self.tp_rank, tp), ("cp_rank", self.cp_rank, cp)):
            if not 0 <= int(value) < size:
                raise ValueError(f"{name}={value} is outside the job's layout (dp={dp}, pp={pp}, tp={tp}, cp={cp})")

    @property
    def is_first(self) -> bool:
        return self.dp_rank == 0 and self.stage == 0 and self.tp_rank == 0 and self.cp_rank == 0

    def describe(self) -> str:
        return f"rank (dp {self.dp_rank}, stage {self.stage}, tp {self.tp_rank}" + (
            f", cp {self.cp_rank})" if self.cp_rank else ")")


def from_parallel_state() -> RankLayout:
    """This rank's layout from megatron-core's initialised ``parallel_state``."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError("megatron-core's parallel_state is not initialised: call initialize_model_parallel "
                           "first, or pass dp_rank/stage/tp_rank explicitly")
    return RankLayout(ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                      ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank())


def _parallel_sizes():
    from megatron.core import parallel_state as ps

    return (ps.get_data_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size())


def _default_port() -> int:
    if KV_PORT_ENV in os.environ:
        return int(os.environ[KV_PORT_ENV])
    if "MASTER_PORT" in os.environ:
        return int(os.environ["MASTER_PORT"]) + 1
    raise ValueError(f"no port for the data pipeline's KV store: pass port=..., or set {KV_PORT_ENV} "
                     "(or MASTER_PORT, and the store uses MASTER_PORT + 1)")


def job_secret(secret: "bytes | str | None" = None) -> "bytes | None":
    """The job's 32-byte key: the SHA-256 of ``secret`` as given (text as UTF-8), else of
    ``DYNAPIPE_KV_SECRET``, else None (rank 0 draws one and shares it)."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if secret is None:
        return None
    return hashlib.sha256(secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)).digest()


def _stop_poller(proc: subprocess.Popen, wait_s: float) -> None:
    """The poller ends (killed after ``wait_s``), and then whatever is left of its process group: a
    worker that was stopped (SIGSTOP, a debugger) would otherwise outlive the job, stopped."""
    if proc.poll() is None:
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing left of it
        pass


def _cost_model_document(cost_model, tp: int) -> "dict | None":
    """The cost model as its file and the tensor-parallel size it answers for (how it travels to
    the workers), a job's pricing as its recipe, or None (the spec's analytical model)."""
    if cost_model is None:
        return None
    if isinstance(cost_model, Pricing):
        return {"pricing": cost_model.to_json()}
    if isinstance(cost_model, StageCosts):
        cost_model = cost_model.model
    if isinstance(cost_model, (str, os.PathLike)):
        cost_model = load_cost_model(cost_model, tp)
    if not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a CostModel, a profile's path or name, or None, got {cost_model!r}")
    return {"document": cost_model.to_document(), "tp": cost_model.tp}


class DataPipelineHost:
    """Rank 0's part: the store server, the published settings and the poller process.

    ``bind_host``: the address the store listens on (and the poller connects to); ``port=0``
    lets the OS pick a free port (read :attr:`port`). ``fast_mode`` overrides ``spec.fast_mode``;
    when both are None, ``DYNAPIPE_FAST_MODE`` in rank 0's environment decides (off when unset),
    and the result is what every worker plans with. ``rampup`` and ``divisor``: Megatron's batch
    size ramp-up (:class:`~.sampling.BatchSchedule`). An in-memory dataset is saved to a
    directory of this machine for the other processes to open (on several machines, save it
    yourself where every one sees it: :meth:`TokenListDataset.save`).
    ``worker_start_method``: how the poller starts its workers. "fork" (default) is safe there:
    the poller is a fresh process of ours (no CUDA) that forks all its workers at start-up, before
    it runs any second thread; "forkserver" and "spawn" start cleaner but slower workers.
    """

    def __init__(self, dataset, spec: TrainingSpec, cost_model, global_batch_size: int, *, secret: bytes,
                 bind_host: str = "127.0.0.1", port: int = 0, namespace: str = DEFAULT_NAMESPACE,
                 num_iterations: "int | None" = None, start_iteration: int = 0, shuffle: bool = True, seed: int = 0,
                 pad_token_id: int = 0, fast_mode=None, num_workers: int = 2, lookahead: int = 2,
                 worker_start_method: str = "fork", store_timeout_s: float = 60.0,
                 rampup: "tuple[int, int, int] | None" = None, divisor: int = 1):
        if dataset is None or spec is None or global_batch_size is None:
            raise ValueError("the hosting rank (rank 0) needs the dataset, the TrainingSpec and the global batch size")
        if not hasattr(dataset, "lengths") or getattr(dataset, "max_seq_len", None) is None:
            raise TypeError(f"{type(dataset).__name__} is not a VariableLengthDataset (needs max_seq_len, "
                            "lengths, __len__, __getitem__ and descriptor); see megatron_dynapipe.data.datasets")
        self._saved_dir = None
        if isinstance(dataset, TokenListDataset):
            self._saved_dir = tempfile.mkdtemp(prefix="dynapipe-dataset-")
            dataset = dataset.save(os.path.join(self._saved_dir, "samples"))
        schedule = BatchSchedule(len(dataset), int(global_batch_size), shuffle=bool(shuffle), seed=int(seed),
                                 rampup=rampup, divisor=int(divisor))
        self.settings = PipelineSettings(
            dataset=dataset.descriptor(), schedule=schedule, start_iteration=int(start_iteration),
            num_iterations=int(schedule.iterations_per_epoch if num_iterations is None else num_iterations),
            pad_token_id=int(pad_token_id), dp=spec.dp, pp=spec.pp, tp=spec.tp, cp=spec.cp, lookahead=int(lookahead),
            num_workers=int(num_workers), worker_start_method=worker_start_method,
            store_timeout_s=float(store_timeout_s))
        spec = dataclasses.replace(spec, fast_mode=resolve_fast_mode_setting(
            spec.fast_mode if fast_mode is None else fast_mode))  # the one value every worker plans with
        planner = {"spec": spec.to_json(), "cost_model": _cost_model_document(cost_model, spec.tp)}
        self.namespace, self.bind_host, self.secret = namespace, bind_host, bytes(secret)
        self.proc: "subprocess.Popen | None" = None
        self._closed = False
        self.client = KVStoreClient.host(bind_host, int(port), self.secret, namespace, store_timeout_s)
        try:
            self.client.reset_counters([self.client.beat_key(c) for c in range(self.settings.num_consumers)])
            self.client.put_json(KVStoreMetaKeys.PLANNER, planner)
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
        env = dict(os.environ, **{SECRET_ENV: self.secret.hex()})  # never on the command line
        # the workers import what the dataset and cost model need: give them this process's path
        paths = [p for p in sys.path if p] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        command = [sys.executable, "-c",
                   "from megatron_dynapipe.data.preprocess import poller_main; poller_main()",
                   "--host", self.bind_host, "--port", str(self.port), "--namespace", self.namespace,
                   "--parent-pid", str(os.getpid()), "--timeout", str(self.settings.store_timeout_s)]
        # a process group of its own: stopping it ends its workers too, stopped ones included
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)

    def check_alive(self) -> None:
        """Raise (and publish for every rank) if the poller ended before its work was done."""
        if self.proc is None or self.proc.poll() is None:
            return
        self.client.raise_if_error()
        progress_key = self.client.meta_key(KVStoreMetaKeys.PROGRESS)
        progress = self.client.get_json(progress_key, timeout_s=0.1) if self.client.exists(progress_key) else {}
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
        """Wait (at most ``timeout_s``, and no longer once the pipeline failed or the ranks still
        open stopped beating) for every rank to close its loader, then stop the poller (and with
        it the workers) and the store. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        client = self.client
        try:
            if wait_for_ranks:
                self._wait_for_ranks(timeout_s)
            client.put(client.meta_key(KVStoreMetaKeys.SHUTDOWN), b"1")
        except DataPipelineError:
            pass
        if self.proc is not None:
            _stop_poller(self.proc, 10.0)
        client.close()  # the store stops listening
        if self._saved_dir is not None:
            shutil.rmtree(self._saved_dir, ignore_errors=True)

    def _wait_for_ranks(self, timeout_s: float) -> None:
        client, settings = self.client, self.settings
        deadline = time.monotonic() + timeout_s
        watch = RankWatch(client, settings.num_consumers, settings.describe_consumer)
        key = client.meta_key(KVStoreMetaKeys.CLOSED)
        while client.add(key, 0) < settings.num_consumers and time.monotonic() < deadline:
            if client.get_error() is not None or watch.silent():
                return  # failed pipeline, or a rank that died: it will not close
            time.sleep(0.05)

    def __enter__(self) -> "DataPipelineHost":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_HOST_OPTIONS = {"num_iterations", "start_iteration", "shuffle", "seed", "pad_token_id", "fast_mode",
                 "num_workers", "lookahead", "worker_start_method", "rampup", "divisor"}


class DynaPipeDataLoader:
    """Iterator of :class:`PlannedBatch` for one rank (module docstring: semantics).

    Arguments (keyword-only after the first four):

    * ``dataset``, ``spec``, ``cost_model``, ``global_batch_size``: used on the hosting rank
      (the others may pass None; a given ``spec`` is checked against the host's layout).
    * ``dp_rank``, ``stage``, ``tp_rank``, ``cp_rank``: this rank's coordinates.
    * ``host_pipeline``: host the pipeline here; default: when this rank is (0, 0, 0).
    * ``master_addr`` / ``port``: where the store is; rank 0 binds it to that address (defaults:
      ``MASTER_ADDR`` or 127.0.0.1; ``DYNAPIPE_KV_PORT``, else ``MASTER_PORT + 1``). ``port=0``
      lets rank 0's OS pick a free port; with ``process_group`` the others learn it from rank 0.
    * ``secret``, ``process_group``: the job's secret (module docstring).
    * ``timeout_s``: longest wait for one iteration; ``connect_timeout_s``: to reach the store
      and its settings; ``close_timeout_s``: how long the host's ``close`` waits for the others.
    * everything else (``num_iterations``, ``start_iteration``, ``shuffle``, ``seed``,
      ``pad_token_id``, ``fast_mode``, ``num_workers``, ``lookahead``, ``worker_start_method``,
      ``rampup``, ``divisor``, ``namespace``) goes to :class:`DataPipelineHost`; ``namespace``
      must match on all ranks. Other ranks read these settings from the store, so the same call
      works on every rank; an option given there that contradicts rank 0's raises ValueError.
    """

    def __init__(self, dataset=None, spec: "TrainingSpec | None" = None, cost_model=None,
                 global_batch_size: "int | None" = None, *, dp_rank: int, stage: int, tp_rank: int = 0,
                 cp_rank: int = 0, host_pipeline: "bool | None" = None, master_addr: "str | None" = None,
                 port: "int | None" = None, secret: "bytes | str | None" = None, process_group=None,
                 namespace: str = DEFAULT_NAMESPACE, timeout_s: float = 600.0, connect_timeout_s: float = 300.0,
                 close_timeout_s: float = 30.0, **host_options):
        self.layout = RankLayout(int(dp_rank), int(stage), int(tp_rank), int(cp_rank))
        self.timeout_s, self.close_timeout_s = float(timeout_s), float(close_timeout_s)
        self.host: "DataPipelineHost | None" = None
        self.beacon: "RankBeacon | None" = None
        self._dataset = None
        self._closed = False
        unknown = set(host_options) - _HOST_OPTIONS
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {', '.join(sorted(unknown))}")
        hosting = self.layout.is_first if host_pipeline is None else bool(host_pipeline)
        addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = _default_port() if port is None else int(port)
        if port == 0 and not hosting and process_group is None:
            raise ValueError("port=0 (any free port) needs process_group=, over which rank 0 tells the others "
                             "the port it got: pass the store's port instead")
        secret, port = self._start(hosting, secret, process_group, dataset, spec, cost_model, global_batch_size,
                                   addr, port, namespace, connect_timeout_s, host_options)
        try:
            self.client = KVStoreClient.connect(addr, port, secret, namespace, connect_timeout_s)
            self.settings = PipelineSettings.from_json(self.client.get_json(KVStoreMetaKeys.SETTINGS,
                                                                            timeout_s=connect_timeout_s))
            self._check_settings(spec, global_batch_size, host_options)
            self._pulse = PulseWatch(self.client, startup_s=max(STALL_S, connect_timeout_s))
            consumer = self.settings.consumer(*dataclasses.astuple(self.layout))
            self.beacon = RankBeacon(addr, self.client.port, secret, namespace, consumer, connect_timeout_s)
        except BaseException:
            if self.host is not None:
                self.host.client.set_error(f"{self.layout.describe()} could not join the data pipeline")
                self.host.close(wait_for_ranks=False)
            raise
        self._next = self.settings.start_iteration

    def _start(self, hosting, secret, process_group, dataset, spec, cost_model, global_batch_size, addr, port,
               namespace, connect_timeout_s, host_options) -> tuple[bytes, int]:
        """Start the host here if this rank hosts; settle the job's secret and the store's port
        (the one the host bound: with ``port=0`` the OS picks it). Returns (secret, port)."""
        secret = job_secret(secret)
        failure = None
        if hosting:
            if secret is None:
                single = spec is not None and spec.dp * spec.pp * spec.tp * spec.cp == 1
                if process_group is None and not single:
                    raise ValueError(f"the data pipeline needs the job's secret on every rank: set {SECRET_ENV} "
                                     "(e.g. to the output of `openssl rand -hex 32`) or pass secret=, or build the "
                                     "loaders on every rank of a process_group")
                secret = os.urandom(32)
            try:
                self.host = DataPipelineHost(dataset, spec, cost_model, global_batch_size, secret=secret,
                                             bind_host=addr, port=port, namespace=namespace,
                                             store_timeout_s=connect_timeout_s, **host_options)
            except DataPipelineError as error:
                failure = str(error)
                if process_group is None:
                    raise
        if self.host is not None:
            port = self.host.port
        if process_group is not None:
            secret, failure, port = _share_over(process_group, hosting, secret, failure, port)
        if failure is not None:
            raise DataPipelineError(failure if hosting else f"rank 0 could not start the data pipeline: {failure}")
        if secret is None:
            raise ValueError(f"the data pipeline needs the job's secret: set {SECRET_ENV} on every rank (as on rank 0) "
                             "or pass secret=")
        return secret, port

    def _check_settings(self, spec, global_batch_size, host_options) -> None:
        s = self.settings
        if spec is not None and (spec.dp, spec.pp, spec.tp, spec.cp) != (s.dp, s.pp, s.tp, s.cp):
            raise ValueError(f"this rank's spec (dp={spec.dp}, pp={spec.pp}, tp={spec.tp}, cp={spec.cp}) differs "
                             f"from the pipeline host's (dp={s.dp}, pp={s.pp}, tp={s.tp}, cp={s.cp})")
        self.layout.check(s.dp, s.pp, s.tp, s.cp)
        if self.host is None:  # the host's settings rule; a rank that says otherwise is misconfigured
            theirs = dict(s.schedule.to_json(), start_iteration=s.start_iteration, num_iterations=s.num_iterations,
                          pad_token_id=s.pad_token_id, lookahead=s.lookahead, num_workers=s.num_workers,
                          worker_start_method=s.worker_start_method)
            theirs["rampup"] = tuple(theirs["rampup"]) if theirs["rampup"] else None
            given = dict(host_options, global_batch_size=global_batch_size)
            differ = {k: (v, theirs[k]) for k, v in given.items() if k in theirs and v is not None and v != theirs[k]}
            if differ:
                raise ValueError("this rank's data pipeline options differ from the host's: " + ", ".join(
                    f"{k}={mine!r} here, {theirs!r} on rank 0" for k, (mine, theirs) in sorted(differ.items())))

    @classmethod
    def from_parallel_state(cls, dataset=None, spec: "TrainingSpec | None" = None, cost_model=None,
                            global_batch_size: "int | None" = None, **options) -> "DynaPipeDataLoader":
        """Build with this rank's coordinates from megatron-core's ``parallel_state`` (which must
        agree with ``spec``'s dp/pp/tp when one is given), on every rank of the job at once: the
        secret and the store's start-up are shared over the world group unless given."""
        layout = from_parallel_state()
        if spec is not None and (spec.dp, spec.pp, spec.tp, spec.cp) != _parallel_sizes():
            dp, pp, tp, cp = _parallel_sizes()
            raise ValueError(f"spec (dp={spec.dp}, pp={spec.pp}, tp={spec.tp}, cp={spec.cp}) differs from megatron's "
                             f"parallel state (dp={dp}, pp={pp}, tp={tp}, cp={cp})")
        options.setdefault("process_group", torch.distributed.group.WORLD)
        return cls(dataset, spec, cost_model, global_batch_size, dp_rank=layout.dp_rank, stage=layout.stage,
                   tp_rank=layout.tp_rank, cp_rank=layout.cp_rank, **options)

    # -- iteration --------------------------------------------------------------------------

    @property
    def num_iterations(self) -> int:
        return self.settings.num_iterations

    @property
    def iterations_per_epoch(self) -> int:
        return self.settings.schedule.iterations_per_epoch

    def __len__(self) -> int:
        return self.settings.num_iterations

    def __iter__(self) -> "DynaPipeDataLoader":
        return self

    def _liveness(self) -> None:
        self._pulse()
        if self.host is not None:
            self.host.check_alive()

    def __next__(self) -> PlannedBatch:
        if self._closed:
            raise RuntimeError("the loader is closed")
        it = self._next
        if it >= self.settings.end_iteration:
            raise StopIteration
        dp, stage = self.layout.dp_rank, self.layout.stage
        keys = [self.client.plan_key(it, dp, stage), self.client.ids_key(it, dp), self.client.summary_key(it)]
        self.client.wait(keys, self.timeout_s, what=f"iteration {it} (dp {dp}, stage {stage})",
                         liveness=self._liveness)
        plan_blob, ids_blob, summary = self.client.get_many(keys)
        plan = ExecutionPlan.from_bytes(plan_blob)
        ids = decode_sample_ids(ids_blob)
        shapes = [(mb.size, mb.seq_len) for mb in plan.microbatches]
        if plan.stage != stage or ids.iteration != it or ids.dp_rank != dp or ids.shapes != shapes:
            raise DataPipelineError(
                f"iteration {it}: inconsistent data for dp {dp}, stage {stage} (plan of stage {plan.stage} with "
                f"shapes {shapes}; sample ids of iteration {ids.iteration}, dp {ids.dp_rank}, shapes {ids.shapes})")
        microbatches = [{k: torch.from_numpy(v) for k, v in arrays.items()} for arrays in self._read(ids, plan)]
        self.client.acknowledge(it)
        self._next = it + 1
        return PlannedBatch(iteration=it, plan=plan, microbatches=microbatches, summary=json.loads(summary))

    def _read(self, ids: SampleIds, plan: ExecutionPlan) -> list[dict[str, np.ndarray]]:
        """This rank's micro-batches, read from its own copy of the dataset, padded or packed as
        its plan says."""
        dataset = self.dataset
        out = []
        for m, (mb, mb_ids, lengths) in enumerate(zip(plan.microbatches, ids.ids, ids.lengths)):  # shapes equal
            # whole samples, or the pieces of them rank 0 planned (each a slice from its first token)
            where = [slice(0, None)] * len(mb_ids) if ids.starts is None else \
                [slice(a, a + n) for a, n in zip(ids.starts[m].tolist(), lengths.tolist())]
            samples = [dataset[int(i)][part] for i, part in zip(mb_ids, where)]
            if [len(s) for s in samples] != lengths.tolist():
                self._fail(f"sample(s) of iteration {ids.iteration} have other lengths here than rank 0 planned "
                           "with: this rank reads another copy of the dataset; every rank must read the same files")
            targets = [None if mask is None else mask[part]
                       for mask, part in zip((dataset.target_mask(int(i)) for i in mb_ids), where)]
            if mb.packed:
                out.append(packed_microbatch(samples, mb.seq_len, self.settings.pad_token_id, targets,
                                             sample_multiple=packed_sample_multiple(self.settings.cp)))
            else:
                out.append(gpt_microbatch(samples, mb.seq_len, self.settings.pad_token_id, targets))
        return out

    @property
    def dataset(self):
        """The dataset as this rank opened it from rank 0's descriptor (on first use)."""
        if self._dataset is None:
            try:
                self._dataset = open_descriptor(self.settings.dataset)
            except (OSError, ValueError) as error:
                self._fail(f"cannot open the dataset: {error}")
        return self._dataset

    def _fail(self, message: str) -> None:
        message = f"{self.layout.describe()} {message}"
        try:
            self.client.set_error(message)
        except DataPipelineError:
            pass
        raise DataPipelineError(message)

    # -- shutdown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the pipeline: say goodbye; on the host, wait for the others and stop the
        poller, its workers and the store. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.beacon is not None:
            self.beacon.close()
        try:
            self.client.add(self.client.meta_key(KVStoreMetaKeys.CLOSED), 1)
        except DataPipelineError:
            pass  # the store is gone already
        self.client.close()
        if self.host is not None:
            self.host.close(self.close_timeout_s)

    def __enter__(self) -> "DynaPipeDataLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_SHARED_MESSAGE = 512
_SHARED_HEAD = 2 + 2 + 32  # flags, port, secret


def share_host_failure(process_group, message: str) -> None:
    """From the hosting rank, before it builds its loaders: tell every rank of ``process_group``
    (waiting in :class:`DynaPipeDataLoader`) that the pipeline cannot start, and why; they raise
    :class:`DataPipelineError` with ``message`` instead of waiting for a store that never comes."""
    _share_over(process_group, True, None, message)


def _share_over(group, hosting: bool, secret: "bytes | None", failure: "str | None",
                port: int = 0) -> tuple[bytes, "str | None", int]:
    """Rank 0 of ``group`` (the host) sends every rank the job's secret, the port its store
    listens on, and whether the store started (with its error), in one broadcast over the job's
    own process group. Returns (secret, failure, port)."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    buffer = torch.zeros(_SHARED_HEAD + _SHARED_MESSAGE, dtype=torch.uint8, device=device)
    if hosting:
        text = (failure or "").encode("utf-8")[:_SHARED_MESSAGE]
        payload = (bytes([1 if failure else 0, 1 if secret else 0]) + int(port).to_bytes(2, "big")
                   + (secret or bytes(32)) + text)
        buffer[:len(payload)] = torch.tensor(list(payload), dtype=torch.uint8)
    dist.broadcast(buffer, src=dist.get_global_rank(group, 0), group=group)
    data = bytes(buffer.cpu().tolist())
    message = data[_SHARED_HEAD:].rstrip(b"\0").decode("utf-8", "replace") if data[0] else None
    shared = data[4:_SHARED_HEAD] if data[1] else None
    return secret or shared, message, int.from_bytes(data[2:4], "big")
