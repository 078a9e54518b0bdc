"""A server in this process, four rank-like worker processes (spawned, as
vLLM's workers are) storing and restoring one 4-rank generation byte-exact
through their own clients and pool mappings; the generation is published only
after all four ranks committed (I1, I2, I10)."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

from rpc_helpers import child_restore, child_store, config, make_manifest

import lmcache_rc as rc


def test_four_rank_processes_store_and_restore_one_generation(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    with rc.Server.start(config(tmp_path, l1_bytes=8 << 20)) as server, ctx.Pool(4) as pool:
        socket = server.socket_path
        m, roots = make_manifest(list(range(70)), world=4)
        with rc.Client(socket) as scheduler:
            assert scheduler.begin(m)
            # Ranks 0..2 in parallel processes: none of them publishes.
            first = pool.starmap(child_store, [(socket, m, r) for r in range(3)])
            assert [published for _, published in first] == [False, False, False]
            assert all(pid != os.getpid() for pid, _ in first)
            assert scheduler.find(roots.roots) is None, "published before every rank"
            status = scheduler.status()
            assert status["generations"] == 0 and status["pending"] == 1
            # The last rank publishes.
            [(_, published)] = pool.starmap(child_store, [(socket, m, 3)])
            assert published is True
            assert scheduler.find(roots.roots) == m
            # Every rank restores its own bytes, concurrently, in other processes.
            restored = pool.starmap(child_restore, [(socket, m, r) for r in range(4)])
            assert [ok for _, ok in restored] == [True, True, True, True]
            status = scheduler.status()
            assert (status["store_leases"], status["retrieve_leases"], status["pins"]) == (0, 0, 0)
            assert status["hits"] == 4
