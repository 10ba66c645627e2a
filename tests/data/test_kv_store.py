"""The data pipeline's store client: authenticated values, values of any size, where it listens,
and one-line errors, against a real TCPStore on this machine."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron_dynapipe.data.kv_store import (
    PART_BYTES,
    DataPipelineError,
    DataPipelineTimeout,
    KVStoreClient,
    KVStoreMetaKeys,
)

SECRET = b"s" * 32


@pytest.fixture
def server():
    server = KVStoreClient.host("127.0.0.1", 0, SECRET, namespace="t/ns", timeout_s=5)
    yield server
    server.close()


def _client(server, secret=SECRET):
    return KVStoreClient.connect("127.0.0.1", server.port, secret, namespace="t/ns", timeout_s=5)


def test_keys_values_waits_acks_and_cleanup(server):
    client = _client(server)
    assert client.plan_key(3, 1, 0) == "t/ns/it/3/plan/1/0" and client.ids_key(3, 1) == "t/ns/it/3/ids/1"
    assert client.meta_key(KVStoreMetaKeys.SETTINGS) == "t/ns/meta/settings"
    client.put(client.plan_key(0, 0, 0), b"\x00\xffplan")
    assert server.get(client.plan_key(0, 0, 0)) == b"\x00\xffplan"
    with pytest.raises(DataPipelineTimeout, match="waited 0.2s for key t/ns/it/9"):
        client.get(client.plan_key(9, 0, 0), timeout_s=0.2)
    assert client.acknowledge(0) == 1 and server.acknowledge(0) == 2 and client.acknowledged(0) == 2
    client.delete_iteration(0, dp=1, pp=1)
    assert client.keys() == []
    assert client.set_error("first") and not server.set_error("second")
    with pytest.raises(DataPipelineError, match="^first$"):
        client.wait([client.plan_key(1, 0, 0)], 5)


def test_values_of_any_size_travel_in_parts_under_the_request_limit(server):
    client = _client(server)
    big = bytes(range(256)) * (20 * 2**20 // 256 + 3)  # 20 MiB: TCPStore refuses requests over 8 MiB
    small = b"x" * 100
    client.put_many({client.ids_key(4, 0): big, client.ids_key(4, 1): small})
    assert server.get_many([client.ids_key(4, 0), client.ids_key(4, 1)]) == [big, small]
    parts = [k for k in client.keys() if "#" in k]
    assert len(parts) == -(-len(big) // PART_BYTES)
    client.delete_iteration(4, dp=2, pp=1)
    assert client.keys() == []


def test_a_process_without_the_secret_cannot_feed_the_job(server):
    client = _client(server)
    key = client.plan_key(0, 0, 0)
    client.put(key, b"a real plan")
    # a peer that knows host and port, not the secret: it replaces the value with its own
    intruder = dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=5))
    intruder.set(key, b"\x80\x04payload that would run code if unpickled")
    intruder.get(key)  # TCPStore's set does not wait for the server; a read on its connection does
    with pytest.raises(DataPipelineError, match=r"t/ns/it/0/plan/0/0 .* was not written by this job .*"
                                                r"another process writes to the store"):
        client.get(key)
    # a value sealed with another secret is refused the same way
    other = _client(server, secret=b"o" * 32)
    other.put(key, b"sealed elsewhere")
    other.store.get(key)
    with pytest.raises(DataPipelineError, match="not written by this job"):
        client.get(key)
    # a forged error fails the job too, saying so
    intruder.set(client.meta_key(KVStoreMetaKeys.ERROR), b"please run rm -rf")
    intruder.get(client.meta_key(KVStoreMetaKeys.ERROR))
    assert "was not written by this job" in client.get_error()


def test_the_store_listens_only_where_it_is_told():
    server = KVStoreClient.host("127.0.0.2", 0, SECRET, namespace="t/ns", timeout_s=5)  # another loopback address
    try:
        key = server.plan_key(0, 0, 0)
        KVStoreClient.connect("127.0.0.2", server.port, SECRET, namespace="t/ns", timeout_s=5).put(key, b"here")
        assert server.get(key) == b"here"
        # At 127.0.0.1 that port is refused, or on a shared machine another program's: never this
        # store (a connection there finds no key of it).
        with pytest.raises(RuntimeError):  # torch's DistNetworkError / DistStoreError
            dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=2)).get(key)
    finally:
        server.close()


def test_a_taken_port_or_a_foreign_address_is_one_line_naming_the_fix():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(DataPipelineError, match=rf"cannot listen on 127.0.0.1:{port}: the port is taken .* "
                                                    r"pass another --dynapipe-kv-port") as info:
            KVStoreClient.host("127.0.0.1", port, SECRET)
        assert "\n" not in str(info.value)
    with pytest.raises(DataPipelineError, match=r"pass --dynapipe-kv-host .* an address of this machine"):
        KVStoreClient.host("192.0.2.1", 0, SECRET)  # TEST-NET-1: never this machine's


def test_a_lost_store_is_a_clear_error():
    server = KVStoreClient.host("127.0.0.1", 0, SECRET, timeout_s=5)
    client = KVStoreClient.connect("127.0.0.1", server.port, SECRET, timeout_s=5)
    server.close()  # rank 0 is gone
    deadline = time.monotonic() + 30
    with pytest.raises(DataPipelineError, match="lost the data pipeline's KV store"):
        while time.monotonic() < deadline:  # the server's thread stops in the background
            client.exists("x")
            time.sleep(0.05)
