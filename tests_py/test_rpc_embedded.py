"""rc.Server (embedded) and rc.Client through Python: round trips through the
client's own mapping of the pool, async futures, typed errors across the
wire, the socket's permissions, restarts, and the GIL released while waiting
(docs/design/wire-protocol.md, docs/design/README.md#processes, invariant I9)."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from rpc_helpers import config, make_manifest, restore_rank, store_rank

import lmcache_rc as rc
from lmcache_rc import errors
from lmcache_rc.config import default_socket_path


@pytest.fixture
def server(tmp_path: Path) -> Iterator[rc.Server]:
    with rc.Server.start(config(tmp_path)) as srv:
        yield srv
    assert srv.stopped


@pytest.fixture
def client(server: rc.Server) -> Iterator[rc.Client]:
    with rc.Client(server.socket_path, timeout=30) as c:
        yield c
        assert_idle(c)


def assert_idle(c: rc.Client) -> None:
    s = c.status()
    assert (s["store_leases"], s["retrieve_leases"], s["pins"]) == (0, 0, 0), s


def test_store_and_restore_round_trip_through_the_clients_own_pool_mapping(
    server: rc.Server, client: rc.Client
) -> None:
    caps = client.capabilities()
    assert caps["format_version"] == 1 and caps["protocol_version"] >= 1
    assert caps["pool_size"] == 4 << 20 and caps["durable_index"] is False
    m, roots = make_manifest(list(range(40)))
    assert client.begin(m)
    assert not client.begin(m), "an identical pending generation is suppressed"
    assert store_rank(client, m, 0) is False
    assert client.find(roots.roots) is None, "not published before every rank"
    assert store_rank(client, m, 1) is True
    assert client.find(roots.roots) == m
    assert restore_rank(client, m, 0) and restore_rank(client, m, 1)
    status = server.status()
    assert status["generations"] == 1 and status["hits"] == 2
    assert status["rpc_connections"] >= 1 and status["rpc_requests"] > 10
    assert isinstance(status["misses"], dict)
    # Slot arrays are zero-copy views of the shared pool.
    lease = client.begin_retrieve(m, 0)
    assert lease.lease_id is not None
    while (ready := client.poll_retrieve(lease.lease_id)).status == "pending":
        time.sleep(0.001)
    offset, length = ready.slots[0][0] or (0, 0)
    a = client.slot_array(offset, length)
    b = client.slot_array(offset, length)
    assert a.ctypes.data == b.ctypes.data and a.base is not None
    client.finish_retrieve(ready.lease_id or "")
    with pytest.raises(errors.InvalidInput):
        client.slot_array(caps["pool_size"] - 10, 20)


def test_async_variants_return_futures(client: rc.Client) -> None:
    m, roots = make_manifest(list(range(24)), world=1)
    began = client.begin_async(m)
    assert began.result(timeout=30) is True
    assert began.done() and began.result() is True, "the result is kept"
    lease = client.prepare_store_async(m, 0).result(30)
    assert isinstance(lease, rc.Lease) and lease.status == "ready"
    for arrays in client.lease_arrays(lease):
        for arr in arrays:
            if arr is not None:
                arr[:] = 7
    finishing = client.finish_store_async(lease.lease_id or "", True)
    finding = client.find_async(roots.roots)
    assert finishing.result(30) is True
    assert finding.result(30) == m, "pipelined behind the finish"
    assert client.capabilities_async().result(30)["format_version"] == 1
    assert client.status_async().result(30)["generations"] == 1
    assert client.abort_async("unknown").result(30) is None
    with pytest.raises(errors.NotFound):
        client.poll_retrieve_async("unknown").result(30)
    assert client.cancel_retrieve_async("unknown").result(30) is None
    assert client.finish_retrieve_async("unknown").result(30) is None
    begun = client.begin_retrieve_async(m, 0).result(30)
    assert begun.status == "ready"  # every page is in L1: exposed at once
    polled = client.poll_retrieve_async(begun.lease_id or "").result(30)
    while polled.status == "pending":
        polled = client.poll_retrieve(begun.lease_id or "")
    client.finish_retrieve(begun.lease_id or "")
    # Without L2, clearing L1 drops the only copy: the generation retires.
    assert client.clear_async().result(30)["retired_generations"] == 1
    assert client.find(roots.roots) is None
    assert "Future(" in repr(finding)


def test_a_pending_future_times_out_without_losing_its_result(tmp_path: Path) -> None:
    # 64 KiB of L1: one 16-page store lease fills it, so a second store waits.
    cfg = config(tmp_path, l1_bytes=64 << 10, store_admission_timeout=20.0)
    with rc.Server.start(cfg) as srv, rc.Client(srv.socket_path) as c:
        big, _ = make_manifest(list(range(20)), world=1, pages=14)
        small, _ = make_manifest(list(range(100, 120)), world=1, pages=1)
        assert c.begin(big) and c.begin(small)
        held = c.prepare_store(big, 0)
        assert held.status == "ready", held
        waiting = c.prepare_store_async(small, 0)
        time.sleep(0.05)
        assert not waiting.done()
        with pytest.raises(errors.RpcTimeout):
            waiting.result(timeout=0.05)
        with pytest.raises(TimeoutError):
            waiting.result(timeout=0)
        assert not c.finish_store(held.lease_id or "", False)
        lease = waiting.result(timeout=15)
        assert lease.status == "ready", lease
        assert not c.finish_store(lease.lease_id or "", False)
        assert_idle(c)


def test_typed_errors_cross_the_wire(client: rc.Client) -> None:
    m, _ = make_manifest(list(range(40)))
    assert client.begin(m)
    with pytest.raises(errors.InvalidInput) as bad_rank:
        client.prepare_store(m, 2)
    assert isinstance(bad_rank.value, ValueError)
    with pytest.raises(errors.NotFound) as unknown:
        client.poll_retrieve("no-such-lease")
    assert isinstance(unknown.value, LookupError)
    lease = client.prepare_store(m, 1)
    assert lease.status == "ready"
    with pytest.raises(errors.LeasesLive):
        client.clear(force=True)
    with pytest.raises(errors.InvalidInput, match="belongs to rank 1"):
        client.finish_store(lease.lease_id or "", True, rank=0)
    assert client.finish_store(lease.lease_id or "", False, rank=1) is False
    assert client.finish_store("unknown", True) is False


def test_default_socket_gets_a_private_temporary_directory() -> None:
    cfg = rc.ServerConfig(l1_bytes=1 << 20)
    assert cfg.socket == default_socket_path()
    with rc.Server.start(cfg) as a, rc.Server.start(rc.ServerConfig(l1_bytes=1 << 20)) as b:
        assert a.socket_path != default_socket_path()
        assert a.socket_path != b.socket_path
        assert a.http_url is not None and a.http_url.startswith("http://127.0.0.1:")
        assert a.http_url != b.http_url
        with urllib.request.urlopen(a.http_url + "/status", timeout=10) as reply:
            assert json.loads(reply.read())["generations"] == 0
        metrics = urllib.request.urlopen(a.http_url + "/metrics", timeout=10).read().decode()
        assert 'lmcache_rc_tier_capacity_bytes{tier="L1"} 1048576' in metrics
        sock = Path(a.socket_path)
        assert stat.S_ISSOCK(sock.stat().st_mode)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        assert sock.parent.stat().st_uid == os.getuid()
        with rc.Client(a.socket_path) as ca, rc.Client(b.socket_path) as cb:
            pool_a = ca.capabilities()["pool_id"]
            assert pool_a != cb.capabilities()["pool_id"], "no pool collision"
            assert not list(Path("/dev/shm").glob(f"*{pool_a}*")), "the pool has no name"
        report = a.stop()
        assert report == {"drained": True, "live_leases": 0, "close_error": None}
        assert a.stop() == report, "idempotent"
        assert not sock.exists() and not sock.parent.exists(), "temporary directory removed"
        with pytest.raises(errors.Closed):
            a.status()


def test_unavailable_without_a_server_and_after_stop(tmp_path: Path) -> None:
    with pytest.raises(errors.Unavailable) as e:
        rc.Client(str(tmp_path / "nobody.sock"))
    assert isinstance(e.value, ConnectionError)
    srv = rc.Server.start(config(tmp_path))
    c = rc.Client(srv.socket_path)
    assert c.connected
    srv.stop()
    with pytest.raises(errors.Unavailable):
        c.status()
    f = c.status_async()
    with pytest.raises(errors.Unavailable):
        f.result(5)
    c.close()
    with pytest.raises(errors.Closed):
        c.status()


def test_a_client_follows_a_restarted_server(tmp_path: Path) -> None:
    first = rc.Server.start(config(tmp_path))
    c = rc.Client(first.socket_path, timeout=30)
    m, roots = make_manifest(list(range(32)), world=1)
    assert c.begin(m) and store_rank(c, m, 0)
    old_pool = c.capabilities()["pool_id"]
    first.stop()
    second = rc.Server.start(config(tmp_path))
    try:
        assert second.socket_path == first.socket_path
        caps = c.capabilities()
        assert caps["pool_id"] != old_pool
        assert c.find(roots.roots) is None, "the in-memory directory did not survive"
        # Slot arrays map the new pool by themselves.
        assert c.begin(m) and store_rank(c, m, 0)
        assert restore_rank(c, m, 0)
        assert_idle(c)
    finally:
        c.close()
        second.stop()


def test_a_second_server_on_a_live_socket_is_refused(server: rc.Server, tmp_path: Path) -> None:
    with pytest.raises(errors.StorageIOError, match="another lmcache-rc server"):
        rc.Server.start(config(tmp_path, socket=server.socket_path))
    with rc.Client(server.socket_path) as c:
        assert c.status()["generations"] == 0, "the live server is untouched"


def test_waiting_calls_release_the_gil_and_threads_share_one_client(tmp_path: Path) -> None:
    cfg = config(tmp_path, l1_bytes=64 << 10, store_admission_timeout=1.0)
    with rc.Server.start(cfg) as srv, rc.Client(srv.socket_path) as c:
        big, _ = make_manifest(list(range(20)), world=1, pages=14)
        small, _ = make_manifest(list(range(100, 120)), world=1, pages=1)
        assert c.begin(big) and c.begin(small)
        held = c.prepare_store(big, 0)
        # This call waits ~1 s for space that never frees: other Python
        # threads must run meanwhile, and share the client.
        results: list[object] = []
        waiter = threading.Thread(target=lambda: results.append(c.prepare_store(small, 0)))
        waiter.start()
        ticks = 0
        calls = 0
        errors_seen: list[BaseException] = []

        def caller() -> None:
            nonlocal calls
            try:
                while waiter.is_alive():
                    c.capabilities()
                    calls += 1
            except BaseException as e:  # pragma: no cover - reported below
                errors_seen.append(e)

        others = [threading.Thread(target=caller) for _ in range(4)]
        for t in others:
            t.start()
        while waiter.is_alive():
            ticks += 1
            time.sleep(0.001)
        for t in others:
            t.join()
        assert not errors_seen, errors_seen
        assert ticks > 50, "the main thread was starved while a call waited"
        assert calls > 20, "calls on the shared client were blocked"
        lease = results[0]
        assert isinstance(lease, rc.Lease) and lease.status == "miss", lease
        assert not c.finish_store(held.lease_id or "", False)
        assert_idle(c)


def test_a_lease_outlives_the_client_that_obtained_it(server: rc.Server) -> None:
    m, roots = make_manifest(list(range(24)), world=1)
    with rc.Client(server.socket_path) as a:
        assert a.begin(m)
        lease = a.prepare_store(m, 0)
        assert lease.status == "ready"
        for arrays in a.lease_arrays(lease):
            for arr in arrays:
                if arr is not None:
                    arr[:] = 1
    # `a` disconnected; its worker may still be copying: the lease stays.
    with rc.Client(server.socket_path) as b:
        assert b.status()["store_leases"] == 1
        assert b.finish_store(lease.lease_id or "", True, rank=0) is True
        assert b.find(roots.roots) == m
        assert_idle(b)


def test_temp_socket_chooses_where_the_server_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    explicit = config(tmp_path)
    with rc.Server.start(explicit, temp_socket=True) as srv:
        assert srv.socket_path != explicit.socket
        assert not Path(explicit.socket).exists()
        with rc.Client(srv.socket_path) as c:
            assert c.capabilities()["pool_size"] == explicit.l1_bytes
    # temp_socket=False binds the configured socket even when it is the default
    # (what `lmcache-rc serve` does); here with a private runtime directory.
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    cfg = rc.ServerConfig(l1_bytes=1 << 20)
    assert cfg.socket == default_socket_path() and cfg.socket.startswith(str(runtime))
    with rc.Server.start(cfg, temp_socket=False) as srv:
        assert srv.socket_path == cfg.socket
        assert stat.S_IMODE(Path(cfg.socket).stat().st_mode) == 0o600
        with rc.Client(cfg.socket) as c:
            assert c.capabilities()["pool_size"] == cfg.l1_bytes
    assert not Path(cfg.socket).exists()
