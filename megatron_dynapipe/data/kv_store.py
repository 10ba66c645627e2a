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
``<ns>/it/<i>/ids/<dp>``                  the sample ids of data-parallel rank ``dp``'s
                                          micro-batches (:mod:`.microbatches`); each rank reads
                                          its samples from the dataset itself
``<ns>/it/<i>/summary``                   JSON: what iteration ``i`` trains (tokens, padding,
                                          micro-batches, schedules, recompute, prediction)
``<ns>/it/<i>/acks``                      counter: ranks that have taken iteration ``i``
``<ns>/rank/<c>/beat``, ``.../closed``    consumer ``c``'s liveness counter and its goodbye
========================================  ======================================================

Once every rank has acknowledged an iteration, the poller deletes its keys, so the store holds
at most the poller's look-ahead.

Trust. Rank 0 binds the store to the address it is given, not to every interface. Nothing read
from the store is ever unpickled: settings, spec and cost model are JSON, the dataset a JSON
descriptor each side opens itself, plans and sample ids binary formats with their own checks.
Every value is authenticated with the job's secret (``DYNAPIPE_KV_SECRET``, or one rank 0 draws
and shares over the job's process group): it is stored as an HMAC-SHA256 tag over its key and
bytes, then the bytes; a value whose tag does not match fails the reading rank with one line. A
process that knows host and port but not the secret can make the job fail, never run code in it
or change what it trains on. Counters (acknowledgements, liveness) carry no tag: a forged count
can only make the job fail too (a timeout, or a rank declared dead).

Size. TCPStore refuses requests over 8 MiB. A value over :data:`PART_BYTES` is stored as a
manifest under its key and parts under ``<key>#<n>``, each authenticated; writes go in requests
of at most :data:`REQUEST_BYTES`.

Every wait here is finite. :meth:`KVStoreClient.wait` polls (``check``) rather than blocking in
``TCPStore.wait`` so that it notices the pipeline's error key, a stalled pipeline (through a
liveness callback) and its own deadline while it waits. A store operation that takes longer than
``op_timeout_s`` (rank 0 stopped) and a lost connection (rank 0 gone) become
:class:`DataPipelineError` as well.
"""

from __future__ import annotations

import enum
import errno
import hashlib
import hmac
import json
import socket
import struct
import time
from datetime import timedelta
from typing import Callable, Iterable, Sequence

import torch.distributed as dist

__all__ = [
    "DEFAULT_NAMESPACE",
    "PART_BYTES",
    "SECRET_ENV",
    "DataPipelineError",
    "DataPipelineTimeout",
    "KVStoreClient",
    "KVStoreMetaKeys",
]

DEFAULT_NAMESPACE = "dynapipe/train"
SECRET_ENV = "DYNAPIPE_KV_SECRET"
PART_BYTES = 2 << 20  # values above this travel in parts
REQUEST_BYTES = 6 << 20  # TCPStore refuses requests over 8 MiB
OP_TIMEOUT_S = 8.0  # one store operation; waits for keys poll and have their own deadlines
_TAG = 32
_WHOLE, _MANIFEST = b"V", b"P"
_MANIFEST_FORMAT = struct.Struct("<IQ")  # parts, total bytes
_POLL_MIN_S = 0.001
_POLL_MAX_S = 0.02


class DataPipelineError(RuntimeError):
    """The data pipeline failed: a preprocessing worker raised or died, the poller stopped, a
    rank died, or the store is gone or holds values that are not this job's. The message carries
    the original error (with the worker's traceback)."""


class DataPipelineTimeout(DataPipelineError, TimeoutError):
    """Nothing arrived within the timeout (and no error was reported)."""


class KVStoreMetaKeys(str, enum.Enum):
    """The fixed keys of one pipeline namespace (``<ns>/meta/<value>``)."""

    #: JSON: what every rank reads (preprocess.PipelineSettings): layout, batch schedule, the
    #: dataset's descriptor, look-ahead and worker settings
    SETTINGS = "settings"
    #: JSON: what the workers plan with: the TrainingSpec (its fast mode resolved on rank 0, so
    #: that one environment decides it for the whole job) and the cost model as its file
    PLANNER = "planner"
    #: text: the first error of the pipeline (first writer wins); its presence fails every rank
    ERROR = "error"
    #: set by rank 0 to stop the poller and its workers
    SHUTDOWN = "shutdown"
    #: counter the poller's loop advances while every worker is running (ranks watch it move)
    PULSE = "pulse"
    #: JSON: the poller's progress (next iteration to submit, first one not yet consumed)
    PROGRESS = "progress"
    #: counter: ranks that have closed their loader (rank 0 waits for them before it stops
    #: hosting the store)
    CLOSED = "closed"


class KVStoreClient:
    """A client over a TCPStore: authenticated bytes in and out, finite timeouts, namespaced keys."""

    def __init__(self, store: dist.TCPStore, secret: bytes, namespace: str = DEFAULT_NAMESPACE,
                 timeout_s: float = 60.0, address: "str | None" = None):
        if not namespace or namespace.endswith("/"):
            raise ValueError(f"namespace must be non-empty and not end with '/', got {namespace!r}")
        if not secret:
            raise ValueError(f"the data pipeline needs the job's secret: set {SECRET_ENV} on every rank")
        self.store = store
        self.secret = bytes(secret)
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        self.address = address or f"{getattr(store, 'host', '?')}:{getattr(store, 'port', '?')}"

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def host(cls, bind_host: str, port: int, secret: bytes, namespace: str = DEFAULT_NAMESPACE,
             timeout_s: float = 60.0) -> "KVStoreClient":
        """Start the store server in this process (rank 0), listening on ``bind_host`` only.
        ``port=0``: the OS picks a free port (read it back from :attr:`port`). The server lives as
        long as the returned client."""
        listener = _listen(bind_host, int(port))
        try:
            store = dist.TCPStore(bind_host, listener.getsockname()[1], None, True, timedelta(seconds=timeout_s),
                                  wait_for_workers=False, master_listen_fd=listener.fileno())
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the server owns the socket now, and closes it when it stops
        store.set_timeout(timedelta(seconds=OP_TIMEOUT_S))
        return cls(store, secret, namespace, timeout_s, address=f"{bind_host}:{store.port}")

    @classmethod
    def connect(cls, host: str, port: int, secret: bytes, namespace: str = DEFAULT_NAMESPACE,
                timeout_s: float = 60.0) -> "KVStoreClient":
        """Connect to the store of rank 0, retrying until ``timeout_s``."""
        try:
            store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=timeout_s))
        except (dist.DistError, RuntimeError) as error:
            raise DataPipelineTimeout(
                f"could not reach the data pipeline's KV store at {host}:{port} within {timeout_s:g}s "
                f"(is rank 0 up, and are host and port right?): {str(error).splitlines()[0]}"
            ) from None
        store.set_timeout(timedelta(seconds=OP_TIMEOUT_S))
        return cls(store, secret, namespace, timeout_s, address=f"{host}:{port}")

    @property
    def port(self) -> int:
        return int(self.store.port)

    def close(self) -> None:
        """Drop the connection (on rank 0: stop the server)."""
        self.store = None

    # -- key names --------------------------------------------------------------------------

    def meta_key(self, key: KVStoreMetaKeys) -> str:
        return f"{self.namespace}/meta/{KVStoreMetaKeys(key).value}"

    def plan_key(self, iteration: int, dp_rank: int, stage: int) -> str:
        return f"{self.namespace}/it/{int(iteration)}/plan/{int(dp_rank)}/{int(stage)}"

    def ids_key(self, iteration: int, dp_rank: int) -> str:
        return f"{self.namespace}/it/{int(iteration)}/ids/{int(dp_rank)}"

    def summary_key(self, iteration: int) -> str:
        return f"{self.namespace}/it/{int(iteration)}/summary"

    def ack_key(self, iteration: int) -> str:
        return f"{self.namespace}/it/{int(iteration)}/acks"

    def beat_key(self, consumer: int) -> str:
        return f"{self.namespace}/rank/{int(consumer)}/beat"

    def closed_key(self, consumer: int) -> str:
        return f"{self.namespace}/rank/{int(consumer)}/closed"

    def iteration_keys(self, iteration: int, dp: int, pp: int) -> list[str]:
        """Every value key iteration ``iteration`` may have written (not its ack counter)."""
        keys = [self.plan_key(iteration, d, s) for d in range(dp) for s in range(pp)]
        return keys + [self.ids_key(iteration, d) for d in range(dp)] + [self.summary_key(iteration)]

    # -- raw operations (every store error becomes a DataPipelineError) ---------------------

    def _call(self, what: str, fn: Callable, *args):
        if self.store is None:
            raise DataPipelineError(f"the data pipeline's KV store client for {self.address} is closed")
        try:
            return fn(*args)
        except dist.DistNetworkError as error:
            raise DataPipelineError(
                f"lost the data pipeline's KV store at {self.address} while {what} (rank 0 hosts it: did it "
                f"exit or crash?): {_first_line(error)}") from None
        except (dist.DistStoreError, dist.DistError) as error:
            raise DataPipelineTimeout(
                f"the data pipeline's KV store at {self.address} did not answer within {OP_TIMEOUT_S:g}s while "
                f"{what} (rank 0, which hosts it, is stopped or overloaded): {_first_line(error)}") from None

    # -- authenticated values ---------------------------------------------------------------

    def _seal(self, key: str, payload: bytes) -> bytes:
        return hmac.new(self.secret, key.encode() + b"\0" + payload, hashlib.sha256).digest() + payload

    def _unseal(self, key: str, value: bytes) -> bytes:
        payload = bytes(value[_TAG:])
        tag = hmac.new(self.secret, key.encode() + b"\0" + payload, hashlib.sha256).digest()
        if len(value) < _TAG or not hmac.compare_digest(tag, bytes(value[:_TAG])):
            raise DataPipelineError(
                f"{key} in the data pipeline's KV store at {self.address} was not written by this job (its "
                f"authentication tag does not match): another process writes to the store, or a rank has "
                f"another {SECRET_ENV}; stop it and restart the job")
        return payload

    def _records(self, key: str, value: bytes) -> list[tuple[str, bytes]]:
        """(key, sealed value) pairs that store ``value`` under ``key`` (in parts when large)."""
        value = bytes(value)
        if len(value) <= PART_BYTES:
            return [(key, self._seal(key, _WHOLE + value))]
        parts = [value[i:i + PART_BYTES] for i in range(0, len(value), PART_BYTES)]
        records = [(f"{key}#{n}", self._seal(f"{key}#{n}", part)) for n, part in enumerate(parts)]
        return records + [(key, self._seal(key, _MANIFEST + _MANIFEST_FORMAT.pack(len(parts), len(value))))]

    def put(self, key: str, value: "bytes | str") -> None:
        self.put_many({key: value.encode() if isinstance(value, str) else value})

    def put_many(self, items: "dict[str, bytes]") -> None:
        """Write several values, parts before their manifest, in requests under TCPStore's limit."""
        batch, size = [], 0
        for key, value in items.items():
            for record in self._records(key, value):
                if batch and size + len(record[1]) > REQUEST_BYTES:
                    self._write(batch)
                    batch, size = [], 0
                batch.append(record)
                size += len(record[1])
        self._write(batch)

    def _write(self, records: list[tuple[str, bytes]]) -> None:
        if records:
            self._call(f"writing {records[-1][0]}", self.store.multi_set, [k for k, _ in records],
                       [v for _, v in records])

    def exists(self, *keys: str) -> bool:
        return bool(self._call(f"checking {keys[0] if keys else ''}", self.store.check, list(keys)))

    def get(self, key: str, timeout_s: "float | None" = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout_s`` (default: the client's) for it."""
        self.wait([key], self.timeout_s if timeout_s is None else timeout_s, what=f"key {key}",
                  watch_error=False)
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        """Values of keys known to exist, authenticated, parts joined."""
        raw = self._call(f"reading {keys[0] if keys else ''}", self.store.multi_get, list(keys)) if keys else []
        return [self._assemble(key, self._unseal(key, value)) for key, value in zip(keys, raw)]

    def _assemble(self, key: str, payload: bytes) -> bytes:
        kind, body = payload[:1], payload[1:]
        if kind == _WHOLE:
            return body
        if kind != _MANIFEST or len(body) != _MANIFEST_FORMAT.size:
            raise DataPipelineError(f"{key} in the data pipeline's KV store is malformed (kind {kind!r})")
        count, total = _MANIFEST_FORMAT.unpack(body)
        names = [f"{key}#{n}" for n in range(count)]
        raw = self._call(f"reading the parts of {key}", self.store.multi_get, names)
        value = b"".join(self._unseal(name, part) for name, part in zip(names, raw))
        if len(value) != total:
            raise DataPipelineError(f"{key} in the data pipeline's KV store is incomplete ({len(value)} of {total} "
                                    "bytes)")
        return value

    def add(self, key: str, amount: int = 1) -> int:
        """Atomically add to a counter (created at 0); ``add(key, 0)`` reads it."""
        return int(self._call(f"updating {key}", self.store.add, key, int(amount)))

    def reset_counters(self, keys: Sequence[str]) -> None:
        """Create (or zero) counters in as few requests as fit."""
        keys = list(keys)
        step = max(1, REQUEST_BYTES // (64 + max((len(k) for k in keys), default=0)))
        for begin in range(0, len(keys), step):
            chunk = keys[begin:begin + step]
            self._call("creating counters", self.store.multi_set, chunk, [b"0"] * len(chunk))

    def counters(self, keys: Sequence[str]) -> list[int]:
        """Several counters at once, in one request (each must exist: ``add(key, 0)`` makes it)."""
        return [int(v) for v in self._call("reading counters", self.store.multi_get, list(keys))] if keys else []

    def delete(self, keys: Iterable[str]) -> None:
        """Delete values (with their parts) and counters."""
        for key in keys:
            if self.exists(f"{key}#0"):  # stored in parts: the manifest says how many
                raw = self._call(f"reading {key}", self.store.get, key)
                count, _ = _MANIFEST_FORMAT.unpack(self._unseal(key, raw)[1:])
                for n in range(count):
                    self._call(f"deleting {key}#{n}", self.store.delete_key, f"{key}#{n}")
            self._call(f"deleting {key}", self.store.delete_key, key)

    def keys(self) -> list[str]:
        """Every key of this namespace now in the store (for diagnostics and tests)."""
        prefix = self.namespace + "/"
        return sorted(k for k in self._call("listing keys", self.store.list_keys) if k.startswith(prefix))

    # -- meta keys --------------------------------------------------------------------------

    def put_json(self, key: "KVStoreMetaKeys | str", value) -> None:
        self.put(self._name(key), json.dumps(value, sort_keys=True))

    def get_json(self, key: "KVStoreMetaKeys | str", timeout_s: "float | None" = None):
        return json.loads(self.get(self._name(key), timeout_s).decode("utf-8"))

    def _name(self, key: "KVStoreMetaKeys | str") -> str:
        return self.meta_key(key) if isinstance(key, KVStoreMetaKeys) else key

    def set_error(self, message: str) -> bool:
        """Publish the pipeline's error; the first one wins. True if this one was stored."""
        key = self.meta_key(KVStoreMetaKeys.ERROR)
        sealed = self._seal(key, (message or "unknown data pipeline error").encode("utf-8"))
        stored = self._call("publishing an error", self.store.compare_set, key, "", sealed)
        return bytes(stored) == sealed

    def get_error(self) -> "str | None":
        key = self.meta_key(KVStoreMetaKeys.ERROR)
        if not self.exists(key):
            return None
        raw = self._call("reading the error", self.store.get, key)
        try:
            return self._unseal(key, raw).decode("utf-8", "replace")
        except DataPipelineError as forged:
            return str(forged)

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
        self.delete([*self.iteration_keys(iteration, dp, pp), self.ack_key(iteration)])

    # -- waiting ----------------------------------------------------------------------------

    def wait(self, keys: Sequence[str], timeout_s: float, *, what: str = "",
             watch_error: bool = True, liveness: "Callable[[], None] | None" = None) -> None:
        """Return once all ``keys`` exist. Raises :class:`DataPipelineError` with the pipeline's
        error as soon as one is published (``watch_error``), whatever ``liveness()`` raises
        (called every poll: e.g. "the poller has stalled"), and :class:`DataPipelineTimeout` after
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
                return f"; poller progress: {self.get_many([key])[0].decode('utf-8')}"
        except Exception:  # a diagnostic only
            pass
        return ""


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__


def _listen(bind_host: str, port: int) -> socket.socket:
    """A listening socket on ``bind_host:port`` for the store's server, or one line naming the fix."""
    try:
        infos = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise DataPipelineError(f"the data pipeline's KV store host {bind_host!r} does not resolve ({error}): pass "
                                "--dynapipe-kv-host (or master_addr=) with this machine's address") from None
    family, _, _, _, address = infos[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
        listener.listen(1024)
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRINUSE:
            raise DataPipelineError(
                f"the data pipeline's KV store cannot listen on {bind_host}:{port}: the port is taken (another job, "
                "or a previous run still exiting): pass another --dynapipe-kv-port (or port=, or set "
                "DYNAPIPE_KV_PORT)") from None
        raise DataPipelineError(
            f"the data pipeline's KV store cannot listen on {bind_host}:{port} ({error.strerror}): pass "
            "--dynapipe-kv-host (or master_addr=) with an address of this machine") from None
    return listener
