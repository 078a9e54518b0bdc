"""Helpers for the transfer-engine suites: page pools filled with each rank's
expected bytes, block-id layouts, and worker-rank process bodies. Module-level
functions, so ``multiprocessing`` (spawn) children can run them."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np
from rpc_helpers import PAGE

import lmcache_rc as rc
from lmcache_rc.worker import CheckpointWorker

LAYOUT: dict[str, Any] = {"schema_version": 1, "page_bytes": PAGE}


def page(m: rc.Manifest, rank: int, group: int, index: int) -> np.ndarray[Any, Any]:
    """Rank ``rank``'s bytes of one page: a function of the page's content key
    (pages with equal keys hold equal bytes, so deduplication is exact)."""
    key = m.page_groups()[group]["content_keys"][index]
    digest = hashlib.sha256(f"{key}/{rank}".encode()).digest()
    seed = int.from_bytes(digest[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8)


def pages_per_rank(m: rc.Manifest) -> int:
    """Pages of one rank of ``m`` (every group counts its positions)."""
    return sum(len(g["positions"]) for g in m.page_groups())


def block_layout(m: rc.Manifest, first: int) -> list[list[int]]:
    """Consecutive page-pool rows from ``first`` for every page of ``m``, in
    manifest group order (auxiliary group last, as the connector builds them)."""
    ids: list[list[int]] = []
    row = first
    for g in m.page_groups():
        n = len(g["positions"])
        ids.append(list(range(row, row + n)))
        row += n
    return ids


def fill(pool: np.ndarray[Any, Any], m: rc.Manifest, rank: int, ids: list[list[int]]) -> None:
    """Writes rank ``rank``'s expected bytes of ``m`` into the rows ``ids``."""
    for g, rows in enumerate(ids):
        for i, row in enumerate(rows):
            pool[row] = page(m, rank, g, i)


def matches(pool: np.ndarray[Any, Any], m: rc.Manifest, rank: int, ids: list[list[int]]) -> bool:
    """Whether the rows ``ids`` hold exactly rank ``rank``'s bytes of ``m``."""
    return all(
        np.array_equal(pool[row], page(m, rank, g, i))
        for g, rows in enumerate(ids)
        for i, row in enumerate(rows)
    )


def collect_all(worker: CheckpointWorker, expected: int, timeout: float = 60.0) -> dict[str, bool]:
    """Collects until ``expected`` task results arrived; a task reported twice fails."""
    results: dict[str, bool] = {}
    deadline = time.monotonic() + timeout
    while len(results) < expected:
        for task, ok in worker.collect().items():
            assert task not in results, f"task {task} reported twice"
            results[task] = ok
        assert time.monotonic() < deadline, f"only {len(results)} of {expected} results"
        time.sleep(0.002)
    assert worker.collect() == {}, "a result was reported after all were collected"
    return results


def rank_process(
    socket: str, manifests: list[rc.Manifest], rank: int, direction: str
) -> tuple[dict[str, bool], bool]:
    """One worker rank in its own process: stores its bytes of every manifest
    (or restores them into a fresh pool), returns (results, bytes exact)."""
    per = max(pages_per_rank(m) for m in manifests)
    pool = np.zeros((1 + per * len(manifests), PAGE), np.uint8)
    layouts = [block_layout(m, 1 + k * per) for k, m in enumerate(manifests)]
    if direction == "STORE":
        for m, ids in zip(manifests, layouts, strict=True):
            fill(pool, m, rank, ids)
    before = pool.copy()
    with CheckpointWorker(
        socket,
        rank=rank,
        world_size=manifests[0].world_size,
        layout=LAYOUT,
        page_pool=pool,
        max_copies_in_flight=len(manifests) + 2,
    ) as worker:
        for k, (m, ids) in enumerate(zip(manifests, layouts, strict=True)):
            assert worker.submit(f"{direction}-{k}", m, direction, ids)
        results = collect_all(worker, len(manifests))
    if direction == "STORE":
        exact = np.array_equal(pool, before)
    else:
        exact = all(matches(pool, m, rank, ids) for m, ids in zip(manifests, layouts, strict=True))
    return results, exact


def hold_leases(socket: str, store: rc.Manifest, restore: rc.Manifest) -> None:
    """A worker rank (rank 0) that takes a store lease of ``store`` and an
    exposed retrieve lease of ``restore``, then hangs inside both copies (an
    injected 10-minute delay) until it is killed."""
    pool = np.zeros((1 + pages_per_rank(store) + pages_per_rank(restore), PAGE), np.uint8)
    store_ids = block_layout(store, 1)
    restore_ids = block_layout(restore, 1 + pages_per_rank(store))
    fill(pool, store, 0, store_ids)
    worker = CheckpointWorker(
        socket, rank=0, world_size=store.world_size, layout=LAYOUT, page_pool=pool
    )
    worker.engine._inject_fault("delay", 2, 600.0)
    assert worker.submit("store", store, "STORE", store_ids)
    assert worker.submit("restore", restore, "RETRIEVE", restore_ids)
    time.sleep(3600)


def rank_server(socket: str, rank: int, world: int, conn: Any) -> None:
    """A long-lived worker rank: for each ``(direction, manifest, delay)``
    received on ``conn`` it runs one task (the copy first waits ``delay``
    seconds, so a kill can land while it holds its lease) and answers
    ``(succeeded, bytes exact)``; ``None`` ends it. Bytes exact: a restore
    reproduced exactly what the rank stored, a store left its pool alone."""
    rows = 64
    pool = np.zeros((1 + rows, PAGE), np.uint8)
    with CheckpointWorker(
        socket, rank=rank, world_size=world, layout=LAYOUT, page_pool=pool
    ) as worker:
        conn.send("ready")
        n = 0
        while (msg := conn.recv()) is not None:
            direction, m, delay = msg
            ids = block_layout(m, 1)
            assert ids[-1][-1] <= rows, "the manifest has more pages than the pool rows"
            pool[:] = 0
            if direction == "STORE":
                fill(pool, m, rank, ids)
            before = pool.copy()
            if delay > 0:
                worker.engine._inject_fault("delay", 1, delay)
            n += 1
            assert worker.submit(f"{direction}-{n}", m, direction, ids)
            ok = collect_all(worker, 1)[f"{direction}-{n}"]
            if direction == "STORE":
                exact = np.array_equal(pool, before)
            else:
                exact = ok and matches(pool, m, rank, ids)
            conn.send((ok, exact))
