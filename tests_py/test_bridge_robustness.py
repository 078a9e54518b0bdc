"""Robustness of the connector side under conditions found by review:

- a sidecar that hangs after a restart never blocks the scheduler thread
  (calls fail at once while disconnected; one background thread reconnects;
  ABORTs are queued and sent once the connection is back);
- requests the boundary cache does not support are never looked up or parked;
- a reused request id is not parked forever behind a wedged copy: past the
  task timeout it recomputes, and the old copies' late results are discarded;
- a burst of tasks never exceeds what each rank's copy queue admits;
- the worker's memory of task ids is bounded.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import rpc_helpers
from test_scheduler_bridge import (  # noqa: F401  (fixtures)
    TOKENS,
    Req,
    WrappedClient,
    client,
    drive_poll,
    make_bridge,
    server,
    store_through,
)

import lmcache_rc as rc
from lmcache_rc.testing import SimEngine
from lmcache_rc.testing.pytest_plugin import (  # noqa: F401  (fixtures)
    lmcache_rc_client,
    lmcache_rc_server,
    sim_engine_factory,
)

# --------------------------------------------------------------------------- helpers


def _hung_listener(path: str) -> socket.socket:
    """A socket at ``path`` that accepts connections (kernel backlog) but never
    answers: a sidecar that is alive but wedged (stopped, swapping, stuck in I/O)."""
    if os.path.exists(path):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(64)
    return s


# --------------------------------------------------------------------------- findings


def test_poll_does_not_block_the_scheduler_when_the_sidecar_hangs(tmp_path: Path) -> None:
    srv = rc.Server.start(rpc_helpers.config(tmp_path, l1_bytes=8 << 20))
    path = srv.socket_path
    raw = rc.Client(path, timeout=5.0, connect_timeout=1.5)
    hung: socket.socket | None = None
    try:
        bridge, _manager, _ = make_bridge(WrappedClient(raw))
        srv.stop()  # the sidecar goes away (the client's reader sees EOF) ...
        deadline = time.monotonic() + 5
        while raw.connected and time.monotonic() < deadline:
            time.sleep(0.01)
        hung = _hung_listener(path)  # ... and comes back wedged
        req = Req("r", list(TOKENS))
        t0 = time.monotonic()
        admitted = bridge.poll(req)
        elapsed = time.monotonic() - t0
        # A scheduler hook must return in (much) less than a step; here it waited
        # for the handshake timeout on the scheduler thread.
        assert elapsed < 0.25, f"poll blocked the scheduler thread for {elapsed:.2f} s"
        assert admitted in (True, False)
    finally:
        raw.close()
        if hung is not None:
            hung.close()
        srv.stop()


# --------------------------------------------------------------------------- simulated engine

SYSTEM = list(range(500, 532))  # 32 tokens
PROMPT = SYSTEM + list(range(10, 18))  # 40 tokens


Factory = Callable[..., SimEngine]


def _store_prompt(factory: Factory, prompt: list[int], n: int = 4, **kw: object) -> list[int]:
    eng = factory(**kw)
    r = eng.generate("producer", prompt, n)
    assert r.stores_offered >= 1
    eng.assert_idle()
    eng.close()
    return r.output_tokens


def test_unsupported_request_is_not_parked_as_a_capacity_waiter(
    sim_engine_factory: Factory,  # noqa: F811
) -> None:
    out = _store_prompt(sim_engine_factory, PROMPT, world_size=2)
    consumer = sim_engine_factory(world_size=2, admission_api=True)
    turn2 = [*PROMPT, *out, 9]
    req = consumer.add_request("u", turn2, 3)
    # e.g. a resumable request (docs/design/vllm-boundary-api.md §2.4)
    req.supports_boundary = False
    consumer.add_request("n", [*PROMPT, 1, 2], 3)
    consumer.run_until(
        lambda: consumer.result("u").finished and consumer.result("n").finished, timeout=5
    )
    assert consumer.result("u").restored_tokens == 0
    consumer.run_until_idle(timeout=10)
    consumer.assert_idle()


def test_reused_id_is_not_parked_forever_behind_a_timed_out_copy(
    client: WrappedClient,  # noqa: F811
) -> None:
    bridge, manager, clock = make_bridge(client, task_timeout=30.0)
    store_through(bridge, client, manager, 11)
    old = Req("r", [*TOKENS, 1])
    tasks = drive_poll(bridge, old)
    assert tasks is not None  # RETRIEVE sent; one rank wedges and never reports
    assert bridge.request_finished(old) == (False, None)
    new = Req("r", [*TOKENS, 2])
    assert bridge.poll(new) is False  # draining, as docs/design/vllm-boundary-api.md §3 (e) asks
    clock.now += 10 * 30.0  # far past the task timeout
    admitted = any(bridge.poll(new) for _ in range(10))
    # the pages stay pinned (a rank may still write) but the new request must not hang
    assert manager.pending_ids()
    assert admitted, "the reused id is parked until a wedged rank reports"


def test_worker_does_not_remember_every_task_forever(server: rc.Server) -> None:  # noqa: F811
    import logging

    import numpy as np

    from lmcache_rc.worker import REMEMBERED_TASKS, CheckpointWorker

    # a manifest this rank refuses before any lease: each task ends at once (False)
    manifest, _ = rpc_helpers.make_manifest(
        list(range(20)), world=1, layout={"page_bytes": 4096, "other": 1}
    )
    worker = CheckpointWorker(
        server.socket_path,
        rank=0,
        world_size=1,
        layout={"page_bytes": 4096},
        page_pool=np.zeros((8, 4096), np.uint8),
    )
    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.CRITICAL)
    try:
        for i in range(REMEMBERED_TASKS + 1000):
            worker.submit(f"t{i}", manifest, "STORE", [[1], [2], [3]])
            if i % 1000 == 999:
                worker.collect()
        deadline = time.monotonic() + 10
        while worker.in_flight() and time.monotonic() < deadline:
            worker.collect()
            time.sleep(0.01)
    finally:
        logging.getLogger().setLevel(quiet)
        worker.close()
    assert worker.in_flight() == 0
    assert len(worker.ledger) <= REMEMBERED_TASKS, len(worker.ledger)


def test_a_burst_of_stores_within_max_tasks_is_not_refused_by_the_ranks(
    sim_engine_factory: Factory,  # noqa: F811
    lmcache_rc_client: rc.Client,  # noqa: F811
) -> None:
    eng = sim_engine_factory(
        world_size=1, max_num_batched_tokens=4096, max_num_seqs=48, num_blocks=1024
    )
    n = 40  # prompt stores in one step: < max_tasks (64), > max_copies_per_rank (16)
    for i in range(n):
        eng.add_request(f"r{i}", [7000 + 16 * i + k for k in range(8)], 2)
    eng.run_until_idle(timeout=30)
    counters = (eng.status().connector or {}).get("counters", {})
    eng.assert_idle()
    assert counters.get("stores_failed", 0) == 0, counters


class _FlakyClient:
    """A fake sidecar client whose connection can drop; records calls."""

    def __init__(self) -> None:
        self.connected = True
        self.aborted: list[str] = []
        self.capability_calls = 0
        self.server_back = threading.Event()

    def find_async(self, roots: object) -> object:
        raise AssertionError("not used")

    def begin_async(self, manifest: object) -> object:
        raise AssertionError("not used")

    def abort_async(self, generation: str) -> object:
        self.aborted.append(generation)
        return None

    def capabilities(self) -> dict[str, int]:
        self.capability_calls += 1
        self.server_back.wait(10)  # connecting blocks until the sidecar is back
        self.connected = True
        return {}

    def close(self) -> None:
        pass


def test_aborts_while_disconnected_are_queued_and_sent_after_reconnecting() -> None:
    from lmcache_rc.vllm.sidecar import NonBlockingSidecar

    fake = _FlakyClient()
    link = NonBlockingSidecar(fake, retry_interval=0.0)  # type: ignore[arg-type]
    fake.connected = False
    assert link.abort_async("g1") is None and link.abort_async("g2") is None
    assert fake.aborted == []
    with pytest.raises(rc.errors.Unavailable, match="reconnecting"):
        link.find_async([])
    fake.server_back.set()
    deadline = time.monotonic() + 10
    while not fake.connected:  # the background thread reconnects
        assert time.monotonic() < deadline, "no background reconnect"
        time.sleep(0.01)
    assert fake.capability_calls >= 1
    link.abort_async("g3")
    assert fake.aborted == ["g1", "g2", "g3"], "queued ABORTs lost or reordered"
