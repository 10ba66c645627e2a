"""The data pipeline's watches: process states, the poller's pulse, the ranks' beats.

The watches count changes over time; the tests drive their clock by hand, so that what they
check does not depend on how fast this machine is."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from megatron_dynapipe.data import liveness
from megatron_dynapipe.data.kv_store import DataPipelineError, KVStoreClient, KVStoreMetaKeys
from megatron_dynapipe.data.liveness import PulseWatch, RankBeacon, RankWatch, process_state

SECRET = b"k" * 32


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(liveness, "time", fake)
    return fake


@pytest.fixture
def server():
    server = KVStoreClient.host("127.0.0.1", 0, SECRET, timeout_s=5)
    yield server
    server.close()


def test_a_stopped_process_shows_as_stopped():
    child = subprocess.Popen(["sleep", "60"])
    try:
        deadline = time.monotonic() + 30
        state = process_state(child.pid)
        while state not in ("S", "R", "D") and time.monotonic() < deadline:  # alive, not stopped
            time.sleep(0.01)  # (D: waiting on the disk, e.g. paging its binary in on a busy machine)
            state = process_state(child.pid)
        assert state in ("S", "R", "D")
        child.send_signal(signal.SIGSTOP)
        while state != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
            state = process_state(child.pid)
        assert state == "T"
        child.send_signal(signal.SIGCONT)
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) is None  # reaped: no such process


def test_the_pulse_watch_raises_once_the_poller_stops_or_never_starts(server, clock):
    watch = PulseWatch(server, stall_s=6, startup_s=30, check_every_s=0)
    key = server.meta_key(KVStoreMetaKeys.PULSE)
    for _ in range(5):  # the poller's loop moves the pulse: all is well, however long
        server.add(key, 1)
        clock.now += 5
        watch()
    clock.now += 7  # then it falls silent
    with pytest.raises(DataPipelineError, match="poller on rank 0's machine made no progress for 7s"):
        watch()
    other = KVStoreClient.connect("127.0.0.1", server.port, SECRET, namespace="other", timeout_s=5)
    never = PulseWatch(other, stall_s=6, startup_s=30, check_every_s=0)
    never()
    clock.now += 29
    never()  # still starting: imports and forking take a while
    clock.now += 2
    with pytest.raises(DataPipelineError, match="did not start within 30s"):
        never()
    server.set_error("the poller's own words")
    with pytest.raises(DataPipelineError, match="the poller's own words"):
        watch()  # the published error, when there is one, says it better


def test_a_rank_that_stops_beating_is_named_unless_it_said_goodbye(server, clock):
    server.reset_counters([server.beat_key(c) for c in range(3)])
    watch = RankWatch(server, 3, describe=lambda c: f"(consumer {c})", stall_s=6)
    dying = RankBeacon("127.0.0.1", server.port, SECRET, server.namespace, 0, timeout_s=5)
    leaving = RankBeacon("127.0.0.1", server.port, SECRET, server.namespace, 1, timeout_s=5)
    assert watch.silent() == []
    dying._stop.set()  # the rank dies: its beat stops, it never says goodbye
    dying._thread.join()
    leaving.close()  # a rank that finished says goodbye
    watch.silent()
    clock.now += 7
    silent = watch.silent()
    assert silent == [0]  # consumer 2 never beat (not started yet): not declared dead
    assert watch.message(silent).startswith("training rank(s) (consumer 0) stopped beating")
