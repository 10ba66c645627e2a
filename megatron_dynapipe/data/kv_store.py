"""The key-value store between the planning side and the training ranks.

The store is a plain ``torch.distributed.TCPStore`` (no extra server): the job's rank 0 hosts it
(:meth:`KVStoreClient.host`), everybody else connects (:meth:`KVStoreClient.connect`). Several
pipelines (say training and validation) share one store under different namespaces.

Keys (``<ns>`` is the namespace, ``dynapipe/train`` by default):

========================================  ======================================================
``<ns>/meta/<name>``                      the fixed keys of :class:`KVStoreMetaKeys`
``<ns>/it/<i>/plan/<dp>/<stage>``         ``ExecutionPlan.to_bytes()`` of iteration ``i`` for one
                                          (data-parallel rank, pipeline stage); every
                                          tensor-parallel rank of that stage reads this same key
``<ns>/it/<i>/mb/<dp>``                   the micro-batch blob of iteration ``i`` for data-parallel
                                          rank ``dp`` (all stages of a DP rank share micro-batches,
                                          so it is stored once, not once per stage)
``<ns>/it/<i>/acks``                      counter: ranks that have taken iteration ``i``
========================================  ======================================================

Once every rank has acknowledged an iteration, the poller deletes its keys
(:meth:`KVStoreClient.delete_iteration`), so the store holds at most the poller's look-ahead.

Every wait here is finite. :meth:`KVStoreClient.wait` polls (``check``) rather than blocking in
``TCPStore.wait`` so that it notices the pipeline's error key, a stopped poller (through a
liveness callback) and its own deadline while it waits. A lost connection to the store (rank 0
gone) becomes a :class:`DataPipelineError` as well.

The store is trusted like any ``torch.distributed`` rendezvous store: some values (the dataset,
the cost model, the spec) are pickles. Bind it to the cluster's private network.
"""

from __future__ import annotations

import enum
import json
import time
from datetime import timedelta
from typing import Callable, Iterable, Sequence

import torch.distributed as dist

__all__ = [
    "DEFAULT_NAMESPACE",
    "DataPipelineError",
    "DataPipelineTimeout",
    "KVStoreClient",
    "KVStoreMetaKeys",
]

DEFAULT_NAMESPACE = "dynapipe/train"
_POLL_MIN_S = 0.001
_POLL_MAX_S = 0.02


class DataPipelineError(RuntimeError):
    """The data pipeline failed: a preprocessing worker raised or died, the poller stopped, or
    the store is gone. The message carries the original error (with the worker's traceback)."""


class DataPipelineTimeout(DataPipelineError, TimeoutError):
    """Nothing arrived within the timeout (and no error was reported)."""


class KVStoreMetaKeys(str, enum.Enum):
    """The fixed keys of one pipeline namespace (``<ns>/meta/<value>``)."""

    #: pickled TrainingSpec, its fast_mode resolved on rank 0 (True/False/"auto"), so that one
    #: environment decides it for the whole job and every worker plans with it
    SPEC = "spec"
    #: pickled cost model (a CostModel, a StageCosts, a profile path or None)
    COST_MODEL = "cost_model"
    #: pickled VariableLengthDataset (datasets pickle as their paths and options)
    DATASET = "dataset"
    #: JSON: sampler, layout, look-ahead and worker settings (preprocess.PipelineSettings)
    SETTINGS = "settings"
    #: text: the first error of the pipeline (first writer wins); its presence fails every rank
    ERROR = "error"
    #: set by rank 0 to stop the poller and its workers
    SHUTDOWN = "shutdown"
    #: counter the poller's heartbeat thread increments; ranks watch it change
    HEARTBEAT = "heartbeat"
    #: JSON: the poller's progress (next iteration to submit, first one not yet consumed)
    PROGRESS = "progress"
    #: counter: ranks that have closed their loader (rank 0 waits for them before it stops
    #: hosting the store)
    CLOSED = "closed"


def _key_error(what: str, error: BaseException, address: str) -> DataPipelineError:
    return DataPipelineError(
        f"lost the data pipeline's KV store at {address} while {what} (rank 0 hosts it: did it "
        f"exit or crash?): {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    )


class KVStoreClient:
    """A small client over a TCPStore: bytes in, bytes out, finite timeouts, namespaced keys."""

    def __init__(self, store: dist.TCPStore, namespace: str = DEFAULT_NAMESPACE,
                 timeout_s: float = 60.0, address: "str | None" = None):
        if not namespace or namespace.endswith("/"):
            raise ValueError(f"namespace must be non-empty and not end with '/', got {namespace!r}")
        self.store = store
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        self.address = address or f"{getattr(store, 'host', '?')}:{getattr(store, 'port', '?')}"

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def host(cls, port: int = 0, namespace: str = DEFAULT_NAMESPACE, timeout_s: float = 60.0,
             host: str = "0.0.0.0") -> "KVStoreClient":
        """Start the store server in this process (rank 0). ``port=0``: the OS picks a free port
        (read it back from :attr:`port`). The server lives as long as the returned client."""
        store = dist.TCPStore(host, int(port), None, True, timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        return cls(store, namespace, timeout_s, address=f"{host}:{store.port}")

    @classmethod
    def connect(cls, host: str, port: int, namespace: str = DEFAULT_NAMESPACE,
                timeout_s: float = 60.0) -> "KVStoreClient":
        """Connect to the store of rank 0, retrying until ``timeout_s``."""
        try:
            store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=timeout_s))
        except (dist.DistError, RuntimeError) as error:
            raise DataPipelineTimeout(
                f"could not reach the data pipeline's KV store at {host}:{port} within {timeout_s:g}s "
                f"(is rank 0 up, and are host and port right?): {str(error).splitlines()[0]}"
            ) from None
        return cls(store, namespace, timeout_s, address=f"{host}:{port}")

    @property
    def port(self) -> int:
        return int(self.store.port)

    # -- key names --------------------------------------------------------------------------

    def meta_key(self, key: KVStoreMetaKeys) -> str:
        return f"{self.namespace}/meta/{KVStoreMetaKeys(key).value}"

    def plan_key(self, iteration: int, dp_rank: int, stage: int) -> str:
        return f"{self.namespace}/it/{int(iteration)}/plan/{int(dp_rank)}/{int(stage)}"

    def microbatch_key(self, iteration: int, dp_rank: int) -> str:
        return f"{self.namespace}/it/{int(iteration)}/mb/{int(dp_rank)}"

    def ack_key(self, iteration: int) -> str:
        return f"{self.namespace}/it/{int(iteration)}/acks"

    def iteration_keys(self, iteration: int, dp: int, pp: int) -> list[str]:
        """Every key iteration ``iteration`` may have written."""
        keys = [self.plan_key(iteration, d, s) for d in range(dp) for s in range(pp)]
        keys += [self.microbatch_key(iteration, d) for d in range(dp)]
        return keys + [self.ack_key(iteration)]

    # -- raw operations (every store error becomes a DataPipelineError) ---------------------

    def _call(self, what: str, fn: Callable, *args):
        try:
            return fn(*args)
        except dist.DistNetworkError as error:
            raise _key_error(what, error, self.address) from None
        except dist.DistStoreError as error:
            raise DataPipelineTimeout(
                f"KV store at {self.address}: {what} timed out: {str(error).splitlines()[0]}"
            ) from None

    def put(self, key: str, value: "bytes | str") -> None:
        self._call(f"writing {key}", self.store.set, key, value)

    def put_many(self, items: "dict[str, bytes]") -> None:
        """Write several keys in one request."""
        if items:
            self._call(f"writing {len(items)} keys", self.store.multi_set, list(items), list(items.values()))

    def exists(self, *keys: str) -> bool:
        return bool(self._call(f"checking {keys[0] if keys else ''}", self.store.check, list(keys)))

    def get(self, key: str, timeout_s: "float | None" = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout_s`` (default: the client's) for it."""
        self.wait([key], self.timeout_s if timeout_s is None else timeout_s, what=f"key {key}",
                  watch_error=False)
        return self._call(f"reading {key}", self.store.get, key)

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """Values of keys known to exist, in one request."""
        return list(self._call(f"reading {len(keys)} keys", self.store.multi_get, list(keys)))

    def add(self, key: str, amount: int = 1) -> int:
        """Atomically add to a counter (created at 0); ``add(key, 0)`` reads it."""
        return int(self._call(f"updating {key}", self.store.add, key, int(amount)))

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._call(f"deleting {key}", self.store.delete_key, key)

    def keys(self) -> list[str]:
        """Every key of this namespace now in the store (for diagnostics and tests)."""
        prefix = self.namespace + "/"
        return sorted(k for k in self._call("listing keys", self.store.list_keys) if k.startswith(prefix))

    # -- meta keys --------------------------------------------------------------------------

    def put_meta(self, key: KVStoreMetaKeys, value: "bytes | str") -> None:
        self.put(self.meta_key(key), value)

    def get_meta(self, key: KVStoreMetaKeys, timeout_s: "float | None" = None) -> bytes:
        return self.get(self.meta_key(key), timeout_s)

    def put_json(self, key: KVStoreMetaKeys, value) -> None:
        self.put_meta(key, json.dumps(value, sort_keys=True))

    def get_json(self, key: KVStoreMetaKeys, timeout_s: "float | None" = None):
        return json.loads(self.get_meta(key, timeout_s).decode("utf-8"))

    def set_error(self, message: str) -> bool:
        """Publish the pipeline's error; the first one wins. True if this one was stored."""
        message = message or "unknown data pipeline error"
        key = self.meta_key(KVStoreMetaKeys.ERROR)
        stored = self._call("publishing an error", self.store.compare_set, key, "", message)
        return bytes(stored) == message.encode("utf-8")

    def get_error(self) -> "str | None":
        key = self.meta_key(KVStoreMetaKeys.ERROR)
        if not self.exists(key):
            return None
        return self._call("reading the error", self.store.get, key).decode("utf-8", "replace")

    def raise_if_error(self) -> None:
        error = self.get_error()
        if error is not None:
            raise DataPipelineError(error)

    # -- per-iteration data -----------------------------------------------------------------

    def acknowledge(self, iteration: int) -> int:
        """Count this rank as done with ``iteration``; returns how many ranks are."""
        return self.add(self.ack_key(iteration), 1)

    def acknowledged(self, iteration: int) -> int:
        return self.add(self.ack_key(iteration), 0)

    def delete_iteration(self, iteration: int, dp: int, pp: int) -> None:
        self.delete(self.iteration_keys(iteration, dp, pp))

    # -- waiting ----------------------------------------------------------------------------

    def wait(self, keys: Sequence[str], timeout_s: float, *, what: str = "",
             watch_error: bool = True, liveness: "Callable[[], None] | None" = None) -> None:
        """Return once all ``keys`` exist. Raises :class:`DataPipelineError` with the pipeline's
        error as soon as one is published (``watch_error``), whatever ``liveness()`` raises
        (called every poll: e.g. "the poller has died"), and :class:`DataPipelineTimeout` after
        ``timeout_s`` seconds."""
        keys = list(keys)
        deadline = time.monotonic() + float(timeout_s)
        error_key = self.meta_key(KVStoreMetaKeys.ERROR)
        pause = _POLL_MIN_S
        while True:
            if self.exists(*keys):
                return
            if watch_error and self.exists(error_key):
                self.raise_if_error()
            if liveness is not None:
                liveness()
            now = time.monotonic()
            if now >= deadline:
                raise DataPipelineTimeout(
                    f"waited {timeout_s:g}s for {what or ', '.join(keys)} in the KV store at "
                    f"{self.address} without an answer{self._progress_note()}"
                )
            time.sleep(min(pause, max(0.0, deadline - now)))
            pause = min(_POLL_MAX_S, pause * 2)

    def _progress_note(self) -> str:
        try:
            key = self.meta_key(KVStoreMetaKeys.PROGRESS)
            if self.exists(key):
                return f"; poller progress: {self.store.get(key).decode('utf-8')}"
        except Exception:  # a diagnostic only
            pass
        return ""


class HeartbeatWatch:
    """Raises when the poller's heartbeat counter has not moved for ``timeout_s`` seconds, or
    has not started within ``startup_timeout_s`` (default: ``timeout_s``; the poller imports
    what the dataset needs and starts its workers before it beats).

    Call it often (it reads the counter at most every ``check_every_s`` seconds). Counting (not
    timestamps) keeps it independent of the hosts' clocks.
    """

    def __init__(self, client: KVStoreClient, timeout_s: float, check_every_s: float = 0.25,
                 startup_timeout_s: "float | None" = None):
        self.client = client
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = self.timeout_s if startup_timeout_s is None else float(startup_timeout_s)
        self.check_every_s = float(check_every_s)
        self._key = client.meta_key(KVStoreMetaKeys.HEARTBEAT)
        self._value: "int | None" = None
        self._changed = self._checked = time.monotonic()

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.check_every_s:
            return
        self._checked = now
        value = self.client.add(self._key, 0)
        if value != self._value:
            self._value, self._changed = value, now
            return
        limit = self.timeout_s if value else self.startup_timeout_s
        if now - self._changed > limit:
            self.client.raise_if_error()  # the poller may have reported why it stopped
            state = (f"never started (no heartbeat within {limit:g}s)" if not value else
                     f"stopped beating (last heartbeat {now - self._changed:.1f}s ago, "
                     f"heartbeat timeout {limit:g}s)")
            raise DataPipelineError(
                f"the data pipeline's poller on rank 0 {state}: it was killed, failed to start, "
                "or rank 0 is stalled"
            )
