"""The cuda backend end to end on the fake CUDA driver (``rust/fake-cuda``):
``CheckpointWorker`` and ``TransferEngine.cuda``/``cuda_regions`` over numpy
memory declared fake device memory, through an embedded sidecar.

Not collected by the suite itself: ``test_cuda_fake_driver.py`` runs each
case in a child process whose ``LD_LIBRARY_PATH`` makes cudarc load the fake
as ``libcuda.so`` (the product's own loading path). The fake queues async
copies and runs them only when something waits for them, so a copy the
backend did not wait for has not happened, and a failed wait leaves its
copies in flight for good.

Observed per case: byte-exact round trips (2-D pool and region pages), the
producer event waited for, enqueue / producer-event / lane-creation
failures reported False with a Device error and the lease finished as failed
(the next task succeeds, the sidecar is idle, no lane leaked), a failed event
record recovered by synchronising the stream, a failed wait making the engine
unsafe with the lease left live at the sidecar and the copies still queued,
several copies of one rank in flight at once on lanes of their own, and a
restarted sidecar's pool page-locked again with the old mapping released."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_cuda import ENV, FakeCudaTensor, FakeDriver
from rpc_helpers import PAGE, config, make_manifest
from transfer_helpers import LAYOUT, block_layout, collect_all, fill, matches

import lmcache_rc as rc
from lmcache_rc import errors
from lmcache_rc.worker import CheckpointWorker, PageRegions

HANG_GUARD = 30.0  # seconds a wait may take before the case fails (not a timing assertion)


@pytest.fixture
def fake() -> FakeDriver:
    path = os.environ.get(ENV)
    if not path:
        pytest.fail(f"run through tests_py/test_cuda_fake_driver.py ({ENV} is not set)")
    rc.TransferEngine.check_cuda_driver()  # the fake answers the backend's probe
    driver = FakeDriver(path)
    driver.reset()
    return driver


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Any]:
    with rc.Server.start(config(tmp_path, l1_bytes=8 << 20)) as s:
        yield s


def manifest(start: int, n: int = 70) -> rc.Manifest:
    """A world-1 manifest: 5 attention pages, 1 recurrent, 1 auxiliary."""
    return make_manifest(list(range(start, start + n)), world=1, layout=LAYOUT)[0]


def spaced(m: rc.Manifest, first: int) -> list[list[int]]:
    """Every other row from ``first``: no two pages adjacent, so each page is
    a copy run of its own (an enqueue can fail half-way)."""
    ids, row = [], first
    for g in m.page_groups():
        n = len(g["positions"])
        ids.append(list(range(row, row + 2 * n, 2)))
        row += 2 * n
    return ids


def idle(client: rc.Client) -> tuple[int, int, int]:
    s = client.status()
    return s["store_leases"], s["retrieve_leases"], s["pins"]


def cuda_pool(fake: FakeDriver, rows: int = 64) -> FakeCudaTensor:
    return FakeCudaTensor(fake, np.zeros((rows, PAGE), np.uint8))


def cuda_worker(server: Any, pool: FakeCudaTensor, **kwargs: Any) -> CheckpointWorker:
    worker = CheckpointWorker(
        server.socket_path, rank=0, world_size=1, layout=LAYOUT, page_pool=pool, **kwargs
    )
    assert worker.engine.backend == "cuda"
    return worker


def wait_for(what: str, predicate: Any) -> None:
    deadline = time.monotonic() + HANG_GUARD
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


def assert_released(fake: FakeDriver, baseline: dict[str, int]) -> None:
    """Everything the engines took from the driver was given back: lanes
    destroyed, mappings unregistered, the primary context released, no copy
    left queued, and no memory unregistered under a queued copy."""
    gc.collect()
    assert fake.stats() == baseline


def submit_one(
    engine: rc.TransferEngine, m: rc.Manifest, direction: str, ids: Any, **kw: Any
) -> Any:
    future = engine.submit(m, 0, direction, ids, **kw)
    assert future is not None
    future.result(HANG_GUARD)
    return future


def test_pages_round_trip_byte_exact_over_several_generations(
    fake: FakeDriver, server: Any
) -> None:
    baseline = fake.stats()
    ms = [manifest(1000 * k) for k in range(4)]
    per = 8
    src, dst = cuda_pool(fake), cuda_pool(fake)
    for k, m in enumerate(ms):
        fill(src.array, m, 0, block_layout(m, 1 + per * k))
    src.array[0] = 0xEE
    before = src.array.copy()
    client = rc.Client(server.socket_path)
    for m in ms:
        assert client.begin(m)
    store = cuda_worker(server, src)
    assert fake.calls("cuInit") >= 1, "the engine did not load the fake driver"
    for k, m in enumerate(ms):
        assert store.submit(f"s{k}", m, "STORE", block_layout(m, 1 + per * k))
    assert collect_all(store, 4) == {f"s{k}": True for k in range(4)}
    assert np.array_equal(src.array, before), "a store wrote into device memory"
    for m in ms:
        assert client.find([m.prefix]) == m
    restore = cuda_worker(server, dst)
    # Restored to other rows than they were stored from.
    for k, m in enumerate(ms):
        assert restore.submit(f"r{k}", m, "RETRIEVE", block_layout(m, 33 - per * k - 7))
    assert collect_all(restore, 4) == {f"r{k}": True for k in range(4)}
    for k, m in enumerate(ms):
        assert matches(dst.array, m, 0, block_layout(m, 33 - per * k - 7))
    assert not dst.array[0].any(), "row 0 (the null page) was touched"
    assert fake.calls("cuMemcpyDtoHAsync_v2") >= 4
    assert fake.calls("cuMemcpyHtoDAsync_v2") >= 4
    assert fake.calls("cuEventSynchronize") >= 8, "a copy was not waited for by event"
    assert fake.calls("cuStreamSynchronize") == 0
    store.close()
    restore.close()
    assert idle(client) == (0, 0, 0)
    del store, restore
    assert_released(fake, baseline)


def test_region_pages_round_trip_byte_exact(fake: FakeDriver, server: Any) -> None:
    import test_transfer_regions as tr

    baseline = fake.stats()
    ms = [tr.manifest(1000 * k) for k in range(3)]
    store_ids = [tr.ids_from(1 + 5 * k) for k in range(3)]
    restore_ids = [tr.ids_from(16 + 5 * k) for k in range(3)]
    client = rc.Client(server.socket_path)
    arrays = tr.buffers(0xAA)
    for m, ids in zip(ms, store_ids, strict=True):
        assert client.begin(m)
        tr.write_pages(arrays, m, ids)
    tensors = [FakeCudaTensor(fake, a) for a in arrays]
    worker = CheckpointWorker(
        server.socket_path,
        rank=0,
        world_size=1,
        layout=tr.LAYOUT,
        page_pool=PageRegions(buffers=tensors, groups=tr.GROUPS, num_blocks=tr.NB),
    )
    engine = worker.engine
    assert (engine.backend, engine.num_blocks, engine.page_bytes) == ("cuda", tr.NB, None)
    for k, (m, ids) in enumerate(zip(ms, store_ids, strict=True)):
        assert worker.submit(f"s{k}", m, "STORE", ids)
    assert collect_all(worker, 3) == {"s0": True, "s1": True, "s2": True}
    for a in arrays:
        a[:] = 0x55
    for k, (m, ids) in enumerate(zip(ms, restore_ids, strict=True)):
        assert worker.submit(f"r{k}", m, "RETRIEVE", ids)
    assert collect_all(worker, 3) == {"r0": True, "r1": True, "r2": True}
    expected = tr.buffers(0x55)
    for m, ids in zip(ms, restore_ids, strict=True):
        tr.write_pages(expected, m, ids)
    for got, want in zip(arrays, expected, strict=True):
        assert np.array_equal(got, want), "bytes outside the restored regions changed"
    worker.close()
    assert idle(client) == (0, 0, 0)
    del worker, engine
    assert_released(fake, baseline)


@pytest.mark.parametrize(
    "symbol, direction, after",
    [
        ("cuMemcpyDtoHAsync_v2", "STORE", 0),
        ("cuMemcpyDtoHAsync_v2", "STORE", 3),
        ("cuMemcpyHtoDAsync_v2", "RETRIEVE", 0),
        ("cuMemcpyHtoDAsync_v2", "RETRIEVE", 3),
    ],
)
def test_a_failed_enqueue_reports_false_and_the_engine_stays_usable(
    fake: FakeDriver, server: Any, symbol: str, direction: str, after: int, caplog: Any
) -> None:
    baseline = fake.stats()
    m = manifest(0)
    ids = spaced(m, 1)
    client = rc.Client(server.socket_path)
    assert client.begin(m)
    pool = cuda_pool(fake)
    fill(pool.array, m, 0, ids)
    worker = cuda_worker(server, pool)
    engine = worker.engine
    if direction == "RETRIEVE":
        assert worker.submit("stored", m, "STORE", ids)
        assert collect_all(worker, 1) == {"stored": True}
        pool.array[:] = 0

    # Through the worker: that rank reports False, the reason is logged.
    fake.fail(symbol, after=after)
    assert worker.submit("t1", m, direction, ids)
    assert collect_all(worker, 1) == {"t1": False}
    assert "enqueueing a page copy failed: CUDA_ERROR_ILLEGAL_ADDRESS" in caplog.text
    assert fake.calls(symbol) >= after + 1
    if direction == "STORE":
        # A failed store aborted its generation: the scheduler begins it again.
        assert client.begin(m)
    # Through the engine: a failed outcome of kind Device.
    fake.fail(symbol, after=after, code=719)
    f = submit_one(engine, m, direction, ids)
    assert (f.result(), f.outcome, f.error_kind) == (False, "failed", "Device")
    assert "CUDA_ERROR_LAUNCH_FAILED" in f.error
    assert f"after enqueueing {after} of" not in f.error  # drained: not in flight
    # The lease was finished as failed: nothing held, nothing published.
    assert idle(client) == (0, 0, 0)
    if direction == "STORE":
        assert client.find([m.prefix]) is None
    assert fake.stat("pending_ops") == baseline["pending_ops"], "the lane did not drain"
    # One copy at a time: the engine never needed a second lane.
    assert fake.stat("live_streams") == baseline["live_streams"] + 1, "a lane leaked"
    assert not engine.is_unsafe

    # The engine stays usable: the same task again succeeds, byte-exact.
    if direction == "STORE":
        assert client.begin(m)
    assert worker.submit("t2", m, direction, ids)
    assert collect_all(worker, 1) == {"t2": True}
    if direction == "STORE":
        assert client.find([m.prefix]) == m
    else:
        assert matches(pool.array, m, 0, ids)
    worker.close()
    assert idle(client) == (0, 0, 0)
    del worker, engine
    assert_released(fake, baseline)


@pytest.mark.parametrize("symbol", ["cuCtxSetCurrent", "cuStreamCreate", "cuEventCreate"])
def test_a_copy_that_cannot_start_reports_false(fake: FakeDriver, server: Any, symbol: str) -> None:
    baseline = fake.stats()
    m = manifest(0)
    ids = block_layout(m, 1)
    client = rc.Client(server.socket_path)
    assert client.begin(m)
    pool = cuda_pool(fake)
    fill(pool.array, m, 0, ids)
    worker = cuda_worker(server, pool)
    fake.fail(symbol, code=2)
    f = submit_one(worker.engine, m, "STORE", ids)
    assert (f.outcome, f.error_kind) == ("failed", "Device")
    assert symbol in f.error and "CUDA_ERROR_OUT_OF_MEMORY" in f.error
    assert fake.stat("live_streams") == baseline["live_streams"], "a half-made lane leaked"
    assert fake.stat("live_events") == baseline["live_events"]
    assert idle(client) == (0, 0, 0)
    assert client.begin(m)
    assert worker.submit("again", m, "STORE", ids)
    assert collect_all(worker, 1) == {"again": True}
    assert client.find([m.prefix]) == m
    worker.close()
    del worker
    assert_released(fake, baseline)


def test_a_store_waits_for_its_producer_event(fake: FakeDriver, server: Any) -> None:
    baseline = fake.stats()
    m = manifest(0)
    ids = block_layout(m, 1)
    rows = [r for g in ids for r in g]
    assert rows == list(range(1, 1 + len(rows)))
    client = rc.Client(server.socket_path)
    assert client.begin(m)
    pool = cuda_pool(fake)
    worker = cuda_worker(server, pool)
    # The producer (a forward pass) writes 0x5A into the rows; its write runs
    # only when someone waits for its event.
    event = fake.pending_fill(pool.data_ptr() + PAGE, PAGE * len(rows), 0x5A)
    assert not pool.array[rows].any(), "the producer's write ran early"
    assert worker.submit("s", m, "STORE", ids, producer_event=event)
    assert collect_all(worker, 1) == {"s": True}
    assert fake.calls("cuStreamWaitEvent") == 1
    assert (pool.array[rows] == 0x5A).all()
    dst = cuda_pool(fake)
    restore = cuda_worker(server, dst)
    assert restore.submit("r", m, "RETRIEVE", ids)
    assert collect_all(restore, 1) == {"r": True}
    assert (dst.array[rows] == 0x5A).all(), "the store copied before the producer's write"
    worker.close()
    restore.close()
    assert idle(client) == (0, 0, 0)
    del worker, restore
    assert_released(fake, baseline)


def test_a_producer_event_failure_reports_false_and_the_engine_stays_usable(
    fake: FakeDriver, server: Any
) -> None:
    baseline = fake.stats()
    m = manifest(0)
    ids = block_layout(m, 1)
    rows = [r for g in ids for r in g]
    client = rc.Client(server.socket_path)
    assert client.begin(m)
    pool = cuda_pool(fake)
    worker = cuda_worker(server, pool)
    engine = worker.engine
    event = fake.pending_fill(pool.data_ptr() + PAGE, PAGE * len(rows), 0x5A)

    # cuStreamWaitEvent fails: nothing was enqueued, the lease is released.
    fake.fail("cuStreamWaitEvent")
    f = submit_one(engine, m, "STORE", ids, producer_event=event)
    assert (f.result(), f.outcome, f.error_kind) == (False, "failed", "Device")
    assert "waiting on the producer event failed: CUDA_ERROR_ILLEGAL_ADDRESS" in f.error
    assert fake.calls("cuMemcpyDtoHAsync_v2") == 0, "copied without the producer's event"
    assert idle(client) == (0, 0, 0)
    assert client.find([m.prefix]) is None
    # A handle the driver does not know: the driver's own refusal.
    assert client.begin(m)
    f = submit_one(engine, m, "STORE", ids, producer_event=0xDEAD0)
    assert (f.result(), f.outcome, f.error_kind) == (False, "failed", "Device")
    assert "CUDA_ERROR_INVALID_HANDLE" in f.error
    assert idle(client) == (0, 0, 0)
    # Through the worker: that rank reports False.
    assert client.begin(m)
    fake.fail("cuStreamWaitEvent")
    assert worker.submit("t1", m, "STORE", ids, producer_event=event)
    assert collect_all(worker, 1) == {"t1": False}

    # Usable: the next task with the event stores the producer's bytes.
    assert client.begin(m)
    assert worker.submit("t2", m, "STORE", ids, producer_event=event)
    assert collect_all(worker, 1) == {"t2": True}
    assert client.find([m.prefix]) == m
    assert not engine.is_unsafe
    worker.close()
    assert idle(client) == (0, 0, 0)
    del worker, engine
    assert_released(fake, baseline)


def test_a_failed_event_record_is_recovered_by_synchronising_the_stream(
    fake: FakeDriver, server: Any
) -> None:
    """Recording the lane's event failed, but synchronising its stream
    succeeded: every copy completed, so the task succeeds (the documented
    fallback, not a failure)."""
    baseline = fake.stats()
    m = manifest(0)
    ids = spaced(m, 1)
    client = rc.Client(server.socket_path)
    assert client.begin(m)
    pool = cuda_pool(fake)
    fill(pool.array, m, 0, ids)
    worker = cuda_worker(server, pool)
    fake.fail("cuEventRecord")
    assert worker.submit("s", m, "STORE", ids)
    assert collect_all(worker, 1) == {"s": True}
    assert fake.calls("cuStreamSynchronize") == 1
    assert client.find([m.prefix]) == m
    fake.fail("cuEventRecord")
    dst = cuda_pool(fake)
    restore = cuda_worker(server, dst)
    assert restore.submit("r", m, "RETRIEVE", ids)
    assert collect_all(restore, 1) == {"r": True}
    assert matches(dst.array, m, 0, ids)
    assert fake.calls("cuStreamSynchronize") == 2
    worker.close()
    restore.close()
    assert idle(client) == (0, 0, 0)
    del worker, restore
    assert_released(fake, baseline)


@pytest.mark.parametrize("direction", ["STORE", "RETRIEVE"])
@pytest.mark.parametrize(
    "failing",
    [("cuEventSynchronize",), ("cuEventRecord", "cuStreamSynchronize")],
    ids=["event-sync", "record-then-stream-sync"],
)
def test_a_failed_wait_makes_the_engine_unsafe_and_leaves_the_lease_live(
    fake: FakeDriver, tmp_path: Path, direction: str, failing: tuple[str, ...]
) -> None:
    server = rc.Server.start(config(tmp_path, l1_bytes=8 << 20))
    try:
        m = manifest(0)
        ids = spaced(m, 1)
        client = rc.Client(server.socket_path)
        assert client.begin(m)
        pool = cuda_pool(fake)
        fill(pool.array, m, 0, ids)
        worker = cuda_worker(server, pool)
        if direction == "RETRIEVE":
            assert worker.submit("stored", m, "STORE", ids)
            assert collect_all(worker, 1) == {"stored": True}
            pool.array[:] = 0
        queued = fake.stat("pending_ops")
        lanes = fake.stat("live_streams")
        for symbol in failing:
            fake.fail(symbol)
        engine = worker.engine
        assert worker.submit("t", m, direction, ids)
        assert engine.wait_idle(HANG_GUARD), "the copy never ended"
        with pytest.raises(errors.UnsafeCopy, match="DMA could not drain"):
            worker.collect()
        assert worker.is_unsafe and worker.engine.unsafe_reason is not None
        assert failing[-1] in worker.engine.unsafe_reason
        # The copies were never waited for: still queued ("in flight").
        assert fake.stat("pending_ops") > queued
        # Nothing new starts; close refuses.
        assert not worker.submit("after", m, direction, ids)
        assert worker.collect() == {"after": False}
        with pytest.raises(errors.UnsafeCopy):
            worker.close()
        # The lease was never finished: the sidecar still holds it.
        status = client.status()
        if direction == "STORE":
            assert (status["store_leases"], status["retrieve_leases"]) == (1, 0)
            assert client.find([m.prefix]) is None
        else:
            assert (status["store_leases"], status["retrieve_leases"]) == (0, 1)
            assert not pool.array.any(), "a copy that was never waited for wrote"
        # The lane and the mapping's registration are kept (leaked), and no
        # memory was unregistered under the queued copies.
        del worker, engine
        gc.collect()
        assert fake.stat("live_streams") >= lanes
        assert fake.stat("host_registrations") >= 1
        assert fake.stat("pending_ops") > queued
        assert fake.stat("violations") == 0
    finally:
        server.stop(timeout=0.1)


def test_several_copies_of_one_rank_are_in_flight_at_once(fake: FakeDriver, server: Any) -> None:
    baseline = fake.stats()
    ms = [manifest(1000 * k) for k in range(6)]
    per = 8
    layouts = [block_layout(m, 1 + per * k) for k, m in enumerate(ms)]
    client = rc.Client(server.socket_path)
    for m in ms:
        assert client.begin(m)
    pool = cuda_pool(fake)
    for m, ids in zip(ms, layouts, strict=True):
        fill(pool.array, m, 0, ids)
    worker = cuda_worker(server, pool, workers=3, max_copies_in_flight=3)
    # Every copy blocks in its wait: three copies get there at once.
    fake.hold("cuEventSynchronize")
    for k in range(3):
        assert worker.submit(f"s{k}", ms[k], "STORE", layouts[k])
    wait_for("three copies waiting", lambda: fake.waiting("cuEventSynchronize") == 3)
    assert fake.stat("live_streams") == baseline["live_streams"] + 3, "not one lane per copy"
    assert fake.stat("pending_ops") >= baseline["pending_ops"] + 3
    fake.hold("cuEventSynchronize", False)
    assert collect_all(worker, 3) == {f"s{k}": True for k in range(3)}
    # The lanes are reused, not multiplied.
    for k in range(3, 6):
        assert worker.submit(f"s{k}", ms[k], "STORE", layouts[k])
    assert collect_all(worker, 3) == {f"s{k}": True for k in range(3, 6)}
    assert fake.stat("live_streams") == baseline["live_streams"] + 3
    # Byte-exact: restore all six, three at a time.
    dst = cuda_pool(fake)
    restore = cuda_worker(server, dst, workers=3, max_copies_in_flight=6)
    for k, m in enumerate(ms):
        assert restore.submit(f"r{k}", m, "RETRIEVE", layouts[k])
    assert collect_all(restore, 6) == {f"r{k}": True for k in range(6)}
    for m, ids in zip(ms, layouts, strict=True):
        assert matches(dst.array, m, 0, ids)
    worker.close()
    restore.close()
    assert idle(client) == (0, 0, 0)
    del worker, restore
    assert_released(fake, baseline)


def test_construction_failures_are_errors_that_give_everything_back(
    fake: FakeDriver, server: Any
) -> None:
    baseline = fake.stats()
    host = np.zeros((16, PAGE), np.uint8)
    with pytest.raises(errors.DeviceError, match="is the page pool a CUDA tensor"):
        rc.TransferEngine.cuda(server.socket_path, host.ctypes.data, 16, PAGE, layout=LAYOUT)
    small = FakeCudaTensor(fake, np.zeros((8, PAGE), np.uint8))
    with pytest.raises(errors.InvalidInput, match="does not fit its allocation"):
        rc.TransferEngine.cuda(server.socket_path, small.data_ptr(), 16, PAGE, layout=LAYOUT)
    pool = cuda_pool(fake, rows=16)
    with pytest.raises(errors.DeviceError, match="cuDeviceGet"):
        rc.TransferEngine.cuda(
            server.socket_path, pool.data_ptr(), 16, PAGE, device=1, layout=LAYOUT
        )
    fake.fail("cuMemHostRegister_v2", code=2)
    with pytest.raises(errors.DeviceError, match="page-locking the shared-memory pool"):
        cuda_worker(server, pool)
    buffers = [(pool, pool.data_ptr(), 8 * PAGE), (pool, pool.data_ptr() + 8 * PAGE, 8 * PAGE)]
    groups = {"g": [(0, 0, 256, 256), (1, 0, 256, 256)]}
    fake.fail("cuMemGetAddressRange_v2")
    with pytest.raises(errors.DeviceError, match="cuMemGetAddressRange"):
        rc.TransferEngine.cuda_regions(server.socket_path, buffers, groups, 32)
    gc.collect()
    assert fake.stats() == baseline, "a failed construction kept a driver resource"
    # The same pool binds once nothing fails.
    engine = rc.TransferEngine.cuda_regions(server.socket_path, buffers, groups, 32)
    assert engine.backend == "cuda" and engine.mappings == 1
    assert fake.stat("ctx_refs") == baseline["ctx_refs"] + 1
    assert fake.stat("host_registrations") == baseline["host_registrations"] + 1
    engine.close()
    del engine
    assert_released(fake, baseline)


def test_a_restarted_sidecar_is_page_locked_again_and_the_old_mapping_released(
    fake: FakeDriver, tmp_path: Path
) -> None:
    baseline = fake.stats()
    cfg = config(tmp_path, l1_bytes=8 << 20)
    m1, m2 = manifest(0), manifest(5000)
    pool = cuda_pool(fake)
    fill(pool.array, m1, 0, block_layout(m1, 1))
    fill(pool.array, m2, 0, block_layout(m2, 20))
    with rc.Server.start(cfg) as first:
        engine = rc.TransferEngine.cuda(first.socket_path, pool.data_ptr(), 64, PAGE, layout=LAYOUT)
        with rc.Client(first.socket_path) as c:
            assert c.begin(m1)
        f = submit_one(engine, m1, "STORE", block_layout(m1, 1))
        assert f.result() is True
        assert engine.mappings == 1
        assert fake.stat("host_registrations") == baseline["host_registrations"] + 1
    with rc.Server.start(cfg) as second:
        with rc.Client(second.socket_path) as c:
            assert c.begin(m2)
            f = submit_one(engine, m2, "STORE", block_layout(m2, 20))
            assert f.result() is True, f.error
            assert engine.mappings == 2, "the recreated pool was not mapped again"
            assert c.find([m2.prefix]) == m2
            assert idle(c) == (0, 0, 0)
        # The old mapping's registration was released (from whichever thread
        # dropped it, with the context made current there), the new one holds.
        assert fake.stat("host_registrations") == baseline["host_registrations"] + 1
        assert fake.calls("cuMemHostUnregister") == 1
        assert fake.stat("violations") == 0
        engine.close()
    del engine
    assert_released(fake, baseline)


def test_the_gpu_restore_measurement_runs_on_the_fake_driver(fake: FakeDriver) -> None:
    # ci/gpu-check.sh's measurement (tests_py/gpu_restore.py) at a small
    # size: four ranks store and restore through cuda engines, the bytes are
    # checked, and the raw cuMemcpyHtoDAsync baseline runs on the same
    # driver (it fills the restored buffers with its host bytes, 1s). The
    # figures are structure only here, never speed.
    import gpu_restore

    baseline = fake.stats()
    made: list[FakeCudaTensor] = []

    def alloc(rows: int, page_bytes: int, random: bool) -> FakeCudaTensor:
        array = np.zeros((rows, page_bytes), np.uint8)
        if random:
            array[1:] = np.random.default_rng(len(made)).integers(0, 256, array[1:].shape)
        made.append(FakeCudaTensor(fake, array))
        return made[-1]

    def same(a: Any, b: Any) -> bool:
        return bool(np.array_equal(a.array[1:], b.array[1:]))

    copies_before = fake.calls("cuMemcpyHtoDAsync_v2")
    result = gpu_restore.measure(alloc, same, pages=6, page_bytes=PAGE, rounds=2)
    assert result["bytes"] == gpu_restore.RANKS * 6 * PAGE
    assert result["restore_s"] > 0 and result["raw_h2d_s"] > 0 and result["ratio"] > 0
    assert result["target"] == 0.8
    restored = made[gpu_restore.RANKS :]
    assert all((t.array[1:] == 1).all() for t in restored), "the raw copies did not run"
    assert all(not t.array[0].any() for t in restored), "row 0 (the null page) was written"
    # Restores (3 rounds x 4 ranks, at least a copy each) and raw copies
    # (3 rounds x 4 ranks) went through the driver's H2D copy.
    assert fake.calls("cuMemcpyHtoDAsync_v2") - copies_before >= 24
    line = gpu_restore.report(result)
    assert "raw cuMemcpyHtoDAsync" in line and "target >= 0.8" in line
    assert fake.stat("violations") == 0
    assert_released(fake, baseline)
