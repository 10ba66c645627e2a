"""Liveness of the data pipeline: every rank fails within seconds of a dead or stopped part.

Each part is watched by what can be observed of it:

* **Preprocessing workers** (on rank 0's machine): a worker that exits breaks the process pool,
  which the poller reports at once; a stopped one (SIGSTOP, a debugger: :func:`process_state`
  ``T`` or ``t``) is reported once it has stayed stopped for :data:`STOPPED_S`.
* **The poller** advances the ``pulse`` counter from its loop, only after checking its workers;
  a rank waiting for data raises when the pulse has not moved for :data:`STALL_S`
  (:class:`PulseWatch`): the poller died, was stopped or hangs.
* **Training ranks** beat their own counter from a thread while their loader is open
  (:class:`RankBeacon`); the poller, and rank 0 while it closes, declare a rank whose beat has not
  moved for :data:`STALL_S` dead unless it said goodbye (:class:`RankWatch`).

Counting beats (not timestamps) keeps every watch independent of the machines' clocks.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

from megatron_dynapipe.data.kv_store import DataPipelineError, KVStoreClient, KVStoreMetaKeys

__all__ = ["BEAT_S", "STALL_S", "STOPPED_S", "PulseWatch", "RankBeacon", "RankWatch", "process_state"]

BEAT_S = 1.0  # a rank's beat, the poller's pulse
STALL_S = 6.0  # silence that counts as dead or stopped
STOPPED_S = 1.0  # how long a worker may sit stopped (a debugger's breakpoint) before it counts


def process_state(pid: int) -> "str | None":
    """The state letter Linux shows for ``pid`` (R, S, D, T stopped, t traced, Z zombie, ...), or
    None where there is no /proc or no such process."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:][:1] or None


class PulseWatch:
    """Raises when the poller's pulse has not moved for ``stall_s`` seconds, or has not started
    within ``startup_s`` (the poller imports what the dataset needs and forks its workers first).
    Call it often: it reads the counter at most every ``check_every_s`` seconds."""

    def __init__(self, client: KVStoreClient, stall_s: float = STALL_S, startup_s: float = 300.0,
                 check_every_s: float = 0.25):
        self.client, self.stall_s, self.startup_s, self.check_every_s = client, stall_s, startup_s, check_every_s
        self._key = client.meta_key(KVStoreMetaKeys.PULSE)
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
        limit = self.stall_s if value else self.startup_s
        if now - self._changed > limit:
            self.client.raise_if_error()  # the poller may have said why it stopped
            state = (f"did not start within {limit:g}s" if not value else
                     f"made no progress for {now - self._changed:.0f}s")
            raise DataPipelineError(
                f"the data pipeline's poller on rank 0's machine {state}: it died, was stopped or hangs "
                "(see rank 0's log); restart the job")


class RankBeacon:
    """This rank's beat: a thread with its own store connection adds 1 to its counter every
    :data:`BEAT_S` while the loader is open; :meth:`close` stops it and says goodbye."""

    def __init__(self, host: str, port: int, secret: bytes, namespace: str, consumer: int, timeout_s: float):
        self.client = KVStoreClient.connect(host, port, secret, namespace, timeout_s)
        self.consumer = consumer
        self._stop = threading.Event()
        self.client.add(self.client.beat_key(consumer), 1)
        self._thread = threading.Thread(target=self._run, name=f"dynapipe-beacon-{consumer}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        key = self.client.beat_key(self.consumer)
        while not self._stop.wait(BEAT_S):
            try:
                self.client.add(key, 1)
            except DataPipelineError:
                return  # the store is gone: the rank's own waits say so

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * BEAT_S)
        try:
            self.client.put(self.client.closed_key(self.consumer), b"1")
        except DataPipelineError:
            pass
        self.client.close()


class RankWatch:
    """Which training ranks have stopped beating (``describe(c)`` names consumer ``c``)."""

    def __init__(self, client: KVStoreClient, num_consumers: int, describe, stall_s: float = STALL_S):
        self.client, self.stall_s, self.describe = client, stall_s, describe
        self._keys = [client.beat_key(c) for c in range(num_consumers)]
        self._last: list = [None] * num_consumers  # (value, when it last changed)

    def silent(self) -> list[int]:
        """Consumers that beat once and then fell silent for ``stall_s`` without closing."""
        now = time.monotonic()
        out = []
        for c, value in enumerate(self.client.counters(self._keys)):
            last = self._last[c]
            if last is None or value != last[0]:
                self._last[c] = (value, now)
            elif value and now - last[1] > self.stall_s and not self.client.exists(self.client.closed_key(c)):
                out.append(c)
        return out

    def message(self, silent: Sequence[int]) -> str:
        names = ", ".join(self.describe(c) for c in silent[:4]) + (f" and {len(silent) - 4} more" if len(silent) > 4
                                                                     else "")
        return (f"training rank(s) {names} stopped beating at the data pipeline's store {self.stall_s:g}s ago: "
                "they died, were stopped or hang (see their logs); the job cannot go on without them")
