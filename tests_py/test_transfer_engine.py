"""The transfer engine and the worker glue through an embedded sidecar:
argument and lease validation before any byte moves, busy stores retried,
misses, admission bounds, a sidecar restart remapped, the unsafe path (I5),
and the cuda backend's clear error without a driver."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rpc_helpers import PAGE, config, make_manifest
from transfer_helpers import LAYOUT, block_layout, collect_all, fill, matches, page

import lmcache_rc as rc
from lmcache_rc import errors
from lmcache_rc.worker import CheckpointWorker


def pool_for(*manifests: rc.Manifest, rows: int = 64) -> np.ndarray[Any, Any]:
    return np.zeros((rows, PAGE), np.uint8)


def manifest(n: int, start: int = 0, world: int = 1) -> tuple[rc.Manifest, rc.TokenRoots]:
    return make_manifest(list(range(start, start + n)), world=world, layout=LAYOUT)


@pytest.fixture
def server(tmp_path: Path) -> Any:
    with rc.Server.start(config(tmp_path, l1_bytes=8 << 20)) as s:
        yield s


def idle(client: rc.Client) -> tuple[int, int, int]:
    s = client.status()
    return s["store_leases"], s["retrieve_leases"], s["pins"]


def test_store_then_retrieve_through_the_engine_is_byte_exact(server: Any) -> None:
    m, roots = manifest(70)
    src = pool_for(m)
    ids = block_layout(m, 1)
    fill(src, m, 0, ids)
    client = rc.Client(server.socket_path)
    assert client.begin(m)
    engine = rc.TransferEngine(server.socket_path, src, layout=LAYOUT)
    assert (engine.backend, engine.num_blocks, engine.page_bytes) == ("cpu", 64, PAGE)
    caps = engine.capabilities()
    assert caps is not None and caps["pool_size"] == 8 << 20
    future = engine.submit(m, 0, "STORE", ids)
    assert future is not None and future.result(30) is True
    assert (future.outcome, future.error, future.error_kind) == ("copied", None, None)
    assert client.find(roots.roots) == m

    dst = pool_for(m)
    other = [[row + 20 for row in group] for group in ids]
    engine2 = rc.TransferEngine(server.socket_path, dst, layout=LAYOUT)
    future = engine2.submit(m, 0, "RETRIEVE", other)
    assert future is not None and future.result(30) is True
    assert matches(dst, m, 0, other)
    assert not dst[0].any(), "row 0 (the null page) was touched"
    engine.close()
    engine2.close()
    assert idle(client) == (0, 0, 0)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: np.zeros((8, PAGE), np.uint16), "uint8"),
        (lambda: np.zeros(8 * PAGE, np.uint8), "2-D"),
        (lambda: np.zeros((PAGE, 8), np.uint8).T, "C-contiguous"),
        (lambda: np.zeros((1, PAGE), np.uint8), "at least 2 rows"),
        (lambda: np.broadcast_to(np.zeros(PAGE, np.uint8), (8, PAGE)), "C-contiguous|writable"),
        (lambda: [[0] * 4] * 4, "numpy"),
    ],
)
def test_a_page_pool_that_is_not_a_writable_uint8_matrix_is_refused(
    server: Any, make: Any, message: str
) -> None:
    with pytest.raises(errors.InvalidInput, match=message):
        rc.TransferEngine(server.socket_path, make())


def test_engine_defaults_come_from_the_core() -> None:
    assert rc.TransferEngine.defaults() == {
        "workers": 2,
        "max_copies_in_flight": 16,
        "rpc_timeout": 30.0,
    }
    from lmcache_rc.worker import (
        DEFAULT_COPY_WORKERS,
        DEFAULT_MAX_COPIES_IN_FLIGHT,
        DEFAULT_RPC_TIMEOUT,
    )

    assert (DEFAULT_COPY_WORKERS, DEFAULT_MAX_COPIES_IN_FLIGHT, DEFAULT_RPC_TIMEOUT) == (
        2,
        16,
        30.0,
    )


def test_the_engine_keyword_max_pending_is_deprecated_but_still_bounds_copies(
    server: Any,
) -> None:
    pool = pool_for()
    with pytest.warns(DeprecationWarning, match="max_pending is deprecated"):
        engine = rc.TransferEngine(
            server.socket_path, pool, workers=1, max_pending=2, layout=LAYOUT
        )
    engine.close()
    # the old name keeps its meaning: below workers it is refused, under the new name
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(errors.InvalidInput, match="max_copies_in_flight"),
    ):
        rc.TransferEngine(server.socket_path, pool, workers=4, max_pending=2)
    with pytest.raises(errors.InvalidInput, match="give only max_copies_in_flight"):
        rc.TransferEngine(server.socket_path, pool, max_pending=4, max_copies_in_flight=4)
    with pytest.warns(DeprecationWarning, match="max_pending is deprecated"):
        worker = CheckpointWorker(
            server.socket_path,
            rank=0,
            world_size=1,
            layout=LAYOUT,
            page_pool=pool,
            workers=1,
            max_pending=1,
        )
    worker.close()


def test_bad_engine_settings_are_refused(server: Any) -> None:
    pool = pool_for()
    with pytest.raises(errors.InvalidInput, match="max_copies_in_flight"):
        rc.TransferEngine(server.socket_path, pool, workers=4, max_copies_in_flight=2)
    with pytest.raises(errors.InvalidInput, match="rpc_timeout"):
        rc.TransferEngine(server.socket_path, pool, rpc_timeout=0)
    with pytest.raises(errors.InvalidInput, match="workers"):
        rc.TransferEngine(server.socket_path, pool, workers=0)
    with pytest.raises(errors.Unavailable):
        rc.TransferEngine(server.socket_path + ".missing", pool)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda ids: [[0, *ids[0][1:]], *ids[1:]], "null page"),
        (lambda ids: [[63 + 5, *ids[0][1:]], *ids[1:]], "outside"),
        (lambda ids: [ids[0], [ids[0][0]], ids[2]], "distinct"),
        (lambda ids: ids[:2], "page groups"),
        (lambda ids: [ids[0][:-1], *ids[1:]], "positions"),
    ],
)
def test_bad_block_ids_fail_before_any_lease_and_touch_nothing(
    server: Any, mutate: Any, message: str
) -> None:
    m, roots = manifest(70)
    pool = pool_for(m)
    fill(pool, m, 0, block_layout(m, 1))
    snapshot = pool.copy()
    client = rc.Client(server.socket_path)
    assert client.begin(m)
    engine = rc.TransferEngine(server.socket_path, pool, layout=LAYOUT)
    # a retrieve may name block 0 for a page it already holds (skip): only stores refuse it
    directions = ("STORE",) if message == "null page" else ("STORE", "RETRIEVE")
    for direction in directions:
        future = engine.submit(m, 0, direction, mutate(block_layout(m, 1)))
        assert future is not None and future.result(30) is False
        assert future.outcome == "failed" and future.error_kind == "InvalidInput"
        assert future.error is not None and message in future.error
    assert np.array_equal(pool, snapshot)
    assert idle(client) == (0, 0, 0)
    assert client.find(roots.roots) is None
    engine.close()


def test_a_retrieve_leaves_pages_named_block_zero_untouched(server: Any) -> None:
    m, _ = manifest(71)
    pool = pool_for(m)
    ids = block_layout(m, 1)
    fill(pool, m, 0, ids)
    client = rc.Client(server.socket_path)
    assert client.begin(m)
    engine = rc.TransferEngine(server.socket_path, pool, layout=LAYOUT)
    stored = engine.submit(m, 0, "STORE", ids)
    assert stored is not None and stored.result(30) is True
    pool[:] = 0xA5
    skipping = [[0, *ids[0][1:]], *ids[1:]]
    future = engine.submit(m, 0, "RETRIEVE", skipping)
    assert future is not None and future.result(30) is True
    assert (pool[ids[0][0]] == 0xA5).all()  # the skipped page: not written
    expected = pool_for(m)
    fill(expected, m, 0, ids)
    for group in skipping:
        for row in group:
            if row:
                assert np.array_equal(pool[row], expected[row])
    engine.close()
    assert idle(client) == (0, 0, 0)


def test_a_manifest_for_another_worker_layout_is_refused(server: Any) -> None:
    m, _ = make_manifest(list(range(40)), world=1, layout={"schema_version": 1, "page_bytes": 1})
    pool = pool_for(m)
    engine = rc.TransferEngine(server.socket_path, pool, layout=LAYOUT)
    future = engine.submit(m, 0, "STORE", block_layout(m, 1))
    assert future is not None and future.result(30) is False
    assert future.error is not None and "layout does not match" in future.error
    assert not pool.any()
    engine.close()


def test_bad_submit_arguments_raise(server: Any) -> None:
    m, _ = manifest(40, world=2)
    engine = rc.TransferEngine(server.socket_path, pool_for(m))
    with pytest.raises(errors.InvalidInput, match="rank"):
        engine.submit(m, 2, "STORE", block_layout(m, 1))
    with pytest.raises(errors.InvalidInput, match="direction"):
        engine.submit(m, 0, "COPY", block_layout(m, 1))
    with pytest.raises(errors.InvalidInput, match="producer event"):
        engine.submit(m, 0, "STORE", block_layout(m, 1), producer_event=7)
    with pytest.raises(errors.InvalidInput, match="negative"):
        engine.submit(m, 0, "STORE", [[-1]])
    engine.close()


def test_retrieving_an_unknown_generation_is_a_miss(server: Any) -> None:
    m, _ = manifest(40)
    pool = pool_for(m)
    engine = rc.TransferEngine(server.socket_path, pool, layout=LAYOUT)
    future = engine.submit(m, 0, "RETRIEVE", block_layout(m, 1))
    assert future is not None and future.result(30) is False
    assert future.outcome == "miss"
    assert not pool.any()
    engine.close()


def test_a_busy_store_is_retried_until_the_other_writer_finishes(server: Any) -> None:
    # B extends A: their first attention pages have the same content keys.
    a, _ = manifest(40)
    b, b_roots = manifest(72)
    client = rc.Client(server.socket_path)
    assert client.begin(a) and client.begin(b)
    held = client.prepare_store(a, 0)
    assert held.status == "ready" and held.lease_id is not None

    def finish_a_later() -> None:
        time.sleep(0.2)
        for g, arrays in enumerate(client.lease_arrays(held)):
            for i, arr in enumerate(arrays):
                assert arr is not None
                arr[:] = page(a, 0, g, i)
        client.finish_store(held.lease_id or "", True)

    pool = pool_for(b)
    fill(pool, b, 0, block_layout(b, 1))
    engine = rc.TransferEngine(server.socket_path, pool, layout=LAYOUT)
    finisher = threading.Thread(target=finish_a_later)
    finisher.start()
    future = engine.submit(b, 0, "STORE", block_layout(b, 1))
    assert future is not None and future.result(30) is True
    finisher.join()
    assert client.find(b_roots.roots) == b
    # Restoring B gives B's bytes, including the pages A wrote.
    dst = pool_for(b)
    engine.close()
    engine2 = rc.TransferEngine(server.socket_path, dst, layout=LAYOUT)
    future = engine2.submit(b, 0, "RETRIEVE", block_layout(b, 1))
    assert future is not None and future.result(30) is True
    assert matches(dst, b, 0, block_layout(b, 1))
    engine2.close()
    assert idle(client) == (0, 0, 0)


def test_admission_is_bounded_and_refused_after_close(server: Any) -> None:
    manifests = [manifest(40, start=1000 * k)[0] for k in range(4)]
    client = rc.Client(server.socket_path)
    pool = np.zeros((1 + 8 * 4, PAGE), np.uint8)
    engine = rc.TransferEngine(
        server.socket_path, pool, workers=1, max_copies_in_flight=2, layout=LAYOUT
    )
    engine._inject_fault("delay", count=2, delay=0.3)
    futures = []
    for k, m in enumerate(manifests):
        assert client.begin(m)
        futures.append(engine.submit(m, 0, "STORE", block_layout(m, 1 + 8 * k)))
    assert futures[0] is not None and futures[1] is not None
    assert futures[2] is None and futures[3] is None, "admitted past max_copies_in_flight"
    assert engine.in_flight == 2
    assert all(f is not None and f.result(30) for f in futures[:2])
    assert engine.wait_idle(30) and engine.in_flight == 0
    engine.close()
    assert engine.submit(manifests[2], 0, "STORE", block_layout(manifests[2], 17)) is None
    for m in manifests[2:]:
        client.abort(m.generation)
    assert idle(client) == (0, 0, 0)


def test_a_sidecar_restart_between_leases_is_remapped(tmp_path: Path) -> None:
    cfg = config(tmp_path, l1_bytes=8 << 20)
    m1, r1 = manifest(40)
    m2, r2 = manifest(40, start=500)
    pool = pool_for()
    fill(pool, m1, 0, block_layout(m1, 1))
    fill(pool, m2, 0, block_layout(m2, 20))
    with rc.Server.start(cfg) as first:
        engine = rc.TransferEngine(first.socket_path, pool, layout=LAYOUT)
        with rc.Client(first.socket_path) as c:
            assert c.begin(m1)
        f = engine.submit(m1, 0, "STORE", block_layout(m1, 1))
        assert f is not None and f.result(30)
        assert engine.mappings == 1
    with rc.Server.start(cfg) as second:
        with rc.Client(second.socket_path) as c:
            assert c.begin(m2)
            f = engine.submit(m2, 0, "STORE", block_layout(m2, 20))
            assert f is not None and f.result(30) is True, f.error if f else None
            assert engine.mappings == 2, "the recreated pool was not mapped again"
            assert c.find(r2.roots) == m2
            assert c.find(r1.roots) is None  # the in-memory directory restarted empty
            assert idle(c) == (0, 0, 0)
        engine.close()


def test_a_copy_that_may_be_in_flight_makes_the_engine_unsafe(tmp_path: Path) -> None:
    server = rc.Server.start(config(tmp_path, l1_bytes=8 << 20))
    try:
        m, roots = manifest(40)
        client = rc.Client(server.socket_path)
        assert client.begin(m)
        pool = pool_for(m)
        engine = rc.TransferEngine(server.socket_path, pool, layout=LAYOUT)
        engine._inject_fault("unsafe")
        future = engine.submit(m, 0, "STORE", block_layout(m, 1))
        assert future is not None
        with pytest.raises(errors.UnsafeCopy, match="in flight"):
            future.result(30)
        assert future.outcome == "unsafe" and future.error_kind == "UnsafeCopy"
        assert engine.is_unsafe and engine.unsafe_reason is not None
        assert engine.submit(m, 0, "STORE", block_layout(m, 1)) is None
        with pytest.raises(errors.UnsafeCopy):
            engine.close()
        # The lease was never finished: the sidecar still holds it.
        assert client.status()["store_leases"] == 1
        assert client.find(roots.roots) is None
    finally:
        server.stop(timeout=0.1)


def test_the_cuda_backend_without_a_driver_is_a_clear_error(server: Any) -> None:
    try:
        rc.TransferEngine.check_cuda_driver()
    except errors.DeviceError as e:
        assert "libcuda" in str(e)
        with pytest.raises(errors.DeviceError, match="CUDA driver"):
            rc.TransferEngine.cuda(server.socket_path, 0x7F0000000000, 64, PAGE)
    else:
        pytest.skip("a CUDA driver is present; ci/gpu-check.sh covers the cuda backend")
    # The cpu backend is unaffected.
    m, _ = manifest(40)
    engine = rc.TransferEngine(server.socket_path, pool_for(m), layout=LAYOUT)
    with rc.Client(server.socket_path) as c:
        assert c.begin(m)
    f = engine.submit(m, 0, "STORE", block_layout(m, 1))
    assert f is not None and f.result(30) is True
    engine.close()


def test_the_worker_reports_every_task_exactly_once(server: Any) -> None:
    manifests = [manifest(40, start=1000 * k)[0] for k in range(3)]
    pool = np.zeros((1 + 8 * 3, PAGE), np.uint8)
    client = rc.Client(server.socket_path)
    worker = CheckpointWorker(
        server.socket_path,
        rank=0,
        world_size=1,
        layout=LAYOUT,
        page_pool=pool,
        workers=1,
        max_copies_in_flight=1,
    )
    worker.engine._inject_fault("delay", delay=0.3)
    for m in manifests:
        assert client.begin(m)
    accepted = worker.submit("t0", manifests[0], "STORE", block_layout(manifests[0], 1))
    rejected = worker.submit("t1", manifests[1], "STORE", block_layout(manifests[1], 9))
    assert accepted and not rejected
    with pytest.raises(ValueError, match="already submitted"):
        worker.submit("t0", manifests[0], "STORE", block_layout(manifests[0], 1))
    with pytest.raises(ValueError, match="direction"):
        worker.submit("t9", manifests[0], "SIDEWAYS", [])
    assert worker.in_flight() == 2
    results = collect_all(worker, 2)
    assert results == {"t0": True, "t1": False}
    worker.close()
    assert not worker.submit("t2", manifests[2], "STORE", block_layout(manifests[2], 17))
    assert worker.collect() == {"t2": False}
    client.abort(manifests[1].generation)
    client.abort(manifests[2].generation)
    assert idle(client) == (0, 0, 0)


def test_the_worker_refuses_a_layout_that_does_not_fit_its_pool(server: Any) -> None:
    pool = pool_for()
    with pytest.raises(ValueError, match="row width"):
        CheckpointWorker(
            server.socket_path,
            rank=0,
            world_size=1,
            layout={"page_bytes": 128},
            page_pool=pool,
        )
    with pytest.raises(ValueError, match="rank"):
        CheckpointWorker(server.socket_path, rank=1, world_size=1, layout=LAYOUT, page_pool=pool)


def test_a_copys_phases_are_timed_and_the_worker_adds_them_up(server: Any) -> None:
    """``TransferFuture.phases`` says where a copy's time went; the worker adds
    the ended copies' phases up per direction (the connector reports them to
    vLLM as what copies cost a rank)."""
    m, _ = manifest(70)
    pool = pool_for(m)
    ids = block_layout(m, 1)
    fill(pool, m, 0, ids)
    client = rc.Client(server.socket_path)
    assert client.begin(m)
    worker = CheckpointWorker(
        server.socket_path, rank=0, world_size=1, layout=LAYOUT, page_pool=pool
    )
    assert worker.submit("s", m, "STORE", ids)
    assert collect_all(worker, 1) == {"s": True}
    other = [[row + 20 for row in group] for group in ids]
    assert worker.submit("r", m, "RETRIEVE", other)
    assert collect_all(worker, 1) == {"r": True}
    worker.close()
    assert worker.costs["copies_store"] == 1 and worker.costs["copies_restore"] == 1
    for direction in ("store", "restore"):
        assert worker.costs[f"copy_{direction}_lease_us"] > 0, worker.costs
        assert f"copy_{direction}_copy_us" in worker.costs
    engine = rc.TransferEngine(server.socket_path, pool_for(m), layout=LAYOUT)
    future = engine.submit(m, 0, "RETRIEVE", other)
    assert future is not None and future.result(30) is True
    phases = future.phases
    assert set(phases) == {
        "queued", "check", "map", "lease", "plan", "handoff", "copy", "finish", "total",
    }  # fmt: skip
    assert phases["total"] >= phases["lease"] + phases["copy"]
    engine.close()
    assert idle(client) == (0, 0, 0)
