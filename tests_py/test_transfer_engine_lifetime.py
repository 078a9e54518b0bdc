"""Lifetime rules of the transfer engine's binding: dropping an engine with
jobs in flight releases the GIL while it drains, and an unsafe worker keeps its
(CUDA) page pool referenced until the process exits."""

from __future__ import annotations

import gc
import itertools
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rpc_helpers import PAGE, config, make_manifest
from transfer_helpers import LAYOUT, block_layout, fill

import lmcache_rc as rc
import lmcache_rc.worker as worker_mod
from lmcache_rc import errors
from lmcache_rc.worker import CheckpointWorker


@pytest.fixture
def server(tmp_path: Path) -> Any:
    with rc.Server.start(config(tmp_path, l1_bytes=8 << 20)) as s:
        yield s


def test_dropping_an_engine_with_jobs_in_flight_does_not_hold_the_gil(server: Any) -> None:
    m, _ = make_manifest(list(range(0, 70)), world=1, layout=LAYOUT)
    pool = np.zeros((64, PAGE), np.uint8)
    ids = block_layout(m, 1)
    fill(pool, m, 0, ids)
    client = rc.Client(server.socket_path)
    assert client.begin(m)
    engine = rc.TransferEngine(server.socket_path, pool, layout=LAYOUT)
    engine._inject_fault("delay", delay=1.5)
    future = engine.submit(m, 0, "STORE", ids)
    assert future is not None

    ticks: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.01)

    t = threading.Thread(target=ticker)
    t.start()
    time.sleep(0.1)
    del engine  # last reference: Drop runs here, with the GIL
    time.sleep(0.1)
    stop.set()
    t.join()
    assert future.result(30) is True
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert max(gaps) < 0.5, f"other Python threads stalled for {max(gaps):.2f} s"


class FakeCudaPool:
    """Stands in for a CUDA tensor page pool (the cuda engine is replaced by
    a cpu engine below): only what CheckpointWorker looks at."""

    is_cuda = True
    shape = (64, PAGE)

    def data_ptr(self) -> int:
        return 0


def test_an_unsafe_worker_keeps_its_cuda_page_pool_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = rc.Server.start(config(tmp_path, l1_bytes=8 << 20))
    try:
        m, _ = make_manifest(list(range(0, 40)), world=1, layout=LAYOUT)
        host = np.zeros((64, PAGE), np.uint8)

        def cpu_engine(socket: str, pool: Any, *args: Any) -> Any:
            # The binding's cuda engine keeps no reference to the tensor
            # either (PyTransferEngine.pool is None for cuda).
            return rc.TransferEngine(socket, host, layout=LAYOUT)

        monkeypatch.setattr(worker_mod, "_cuda_engine", cpu_engine)
        fake = FakeCudaPool()
        alive = weakref.ref(fake)
        w = CheckpointWorker(
            server.socket_path, rank=0, world_size=1, layout=LAYOUT, page_pool=fake
        )
        del fake
        with rc.Client(server.socket_path) as c:
            assert c.begin(m)
        w.engine._inject_fault("unsafe")
        assert w.submit("t0", m, "STORE", block_layout(m, 1))
        assert w.wait_idle(30)
        with pytest.raises(errors.UnsafeCopy):
            w.collect()
        with pytest.raises(errors.UnsafeCopy):
            w.close()
        del w
        gc.collect()
        assert alive() is not None, "the page pool of an unsafe worker was released"
    finally:
        server.stop(timeout=0.1)
