"""The cpu transfer backend end to end through a real sidecar: four worker
ranks in separate (spawned) processes store many generations — several
sharing a prefix, so later stores reuse resident pages — and restore them
byte-exact into fresh page pools; every task is reported exactly once per
rank and the sidecar is idle afterwards (I1, I2, I4, I6, I7)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from rpc_helpers import config, make_manifest
from transfer_helpers import LAYOUT, rank_process

import lmcache_rc as rc

WORLD = 4


def test_four_rank_processes_store_and_restore_many_generations(tmp_path: Path) -> None:
    base = list(range(1000, 1200))
    # A conversation (each turn extends the last) plus unrelated prompts.
    tokens = [base[: 40 + 24 * t] for t in range(6)] + [
        list(range(5000 * k, 5000 * k + 30 + 7 * k)) for k in range(1, 7)
    ]
    built = [make_manifest(t, world=WORLD, layout=LAYOUT) for t in tokens]
    manifests = [m for m, _ in built]
    all_roots = [roots for _, roots in built]
    ctx = multiprocessing.get_context("spawn")
    with (
        rc.Server.start(config(tmp_path, l1_bytes=16 << 20)) as server,
        ctx.Pool(WORLD) as pool,
        rc.Client(server.socket_path) as scheduler,
    ):
        socket = server.socket_path
        for m in manifests:
            assert scheduler.begin(m)
        stored = pool.starmap(rank_process, [(socket, manifests, r, "STORE") for r in range(WORLD)])
        for results, untouched in stored:
            assert results == {f"STORE-{k}": True for k in range(len(manifests))}
            assert untouched, "a store changed the page pool"
        for m, roots in zip(manifests, all_roots, strict=True):
            assert scheduler.find(roots.roots) == m
        status = scheduler.status()
        assert status["generations"] == len(manifests) and status["pending"] == 0
        written_once = status["l1_objects"]
        # Shared attention pages of the conversation were stored once.
        total_pages = sum(len(g["positions"]) for m in manifests for g in m.page_groups()) * WORLD
        assert written_once < total_pages

        restored = pool.starmap(
            rank_process, [(socket, manifests, r, "RETRIEVE") for r in range(WORLD)]
        )
        for results, exact in restored:
            assert results == {f"RETRIEVE-{k}": True for k in range(len(manifests))}
            assert exact, "a restored page differs from what its rank stored"
        status = scheduler.status()
        assert (status["store_leases"], status["retrieve_leases"], status["pins"]) == (0, 0, 0)
        assert status["hits"] == len(manifests) * WORLD
