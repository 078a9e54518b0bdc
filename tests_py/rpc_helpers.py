"""Helpers for the RPC suites: manifests, page patterns, and a worker rank
played through ``rc.Client`` and its own mapping of the pool. Module-level
functions, so ``multiprocessing`` (spawn) children can run them."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

import lmcache_rc as rc

PAGE = 4096


def config(tmp_path: Path, **overrides: object) -> rc.ServerConfig:
    """A small embedded-server config with its socket under ``tmp_path``."""
    values: dict[str, object] = {
        "socket": str(tmp_path / "rpc.sock"),
        "l1_bytes": 4 << 20,
        "store_admission_timeout": 0.3,
    }
    values.update(overrides)
    return rc.ServerConfig(**values)  # type: ignore[arg-type]


def make_manifest(
    tokens: list[int],
    world: int = 2,
    pages: int | None = None,
    layout: dict[str, object] | None = None,
    namespace: str | None = None,
) -> tuple[rc.Manifest, rc.TokenRoots]:
    """A schema-2 manifest: attention pages every 16 tokens (or ``pages``
    state pages), one recurrent page, one auxiliary page; 4 KiB pages.
    ``layout`` becomes the payload's ``worker_layout`` (as the scheduler
    bridge writes it). ``namespace``: the one to use (default: one fixed
    identity per world size; ``ci/soak.py`` gives each worker its own)."""
    ns = namespace or rc.checkpoint_namespace(
        {
            "target_revision": "t" * 40,
            "draft_revision": "",
            "source_revision": "s" * 40,
            "layout": {"page_bytes": PAGE},
            "parallel": {"tp": world},
        }
    )
    roots = rc.TokenRoots.build(ns, tokens)
    n = len(tokens)
    if pages is None:
        blocks = [(min((p + 1) * 16, n), "attention:0") for p in range((n + 15) // 16)]
    else:
        blocks = [(n, f"state:{p}") for p in range(pages)]
    groups = [
        {
            "name": "engine-kv-group:0",
            "page_bytes": PAGE,
            "positions": list(range(len(blocks))),
            "content_keys": roots.content_keys(blocks),
        },
        {
            "name": "engine-kv-group:1",
            "page_bytes": PAGE,
            "positions": [0],
            "content_keys": [roots.content_key(n, "recurrent:1")],
        },
        {
            "name": "target-draft-auxiliary",
            "page_bytes": PAGE,
            "positions": [0],
            "content_keys": [roots.content_key(n, "auxiliary:0:prompt")],
        },
    ]
    body: dict[str, object] = {
        "schema_version": 2,
        "page_groups": groups,
        "kind": "prompt",
        "draft_prefix_len": 0,
    }
    if layout is not None:
        body["worker_layout"] = layout
    payload = json.dumps(
        body,
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    prefix = roots.prefix(n)
    return rc.Manifest(rc.checkpoint_generation(prefix, payload), prefix, world, payload), roots


def page(m: rc.Manifest, rank: int, group: int, index: int) -> np.ndarray:
    """The exact bytes rank ``rank`` stores for one page (varies per byte;
    the same in every process)."""
    digest = hashlib.sha256(f"{m.generation}/{rank}/{group}/{index}".encode()).digest()
    seed = int.from_bytes(digest[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8)


def store_rank(client: rc.Client, m: rc.Manifest, rank: int) -> bool:
    """prepare (retrying busy), copy into the lease's slots, finish."""
    deadline = time.monotonic() + 30
    while (lease := client.prepare_store(m, rank)).status == "busy":
        assert time.monotonic() < deadline, "store stayed busy"
        time.sleep(0.001)
    assert lease.status == "ready", lease
    assert lease.lease_id is not None
    for g, arrays in enumerate(client.lease_arrays(lease)):
        for i, arr in enumerate(arrays):
            if arr is not None:
                arr[:] = page(m, rank, g, i)
    return client.finish_store(lease.lease_id, True)


def restore_rank(client: rc.Client, m: rc.Manifest, rank: int) -> bool:
    """begin, poll to ready, compare every byte, finish; False on a miss."""
    lease = client.begin_retrieve(m, rank)
    if lease.status == "miss":
        return False
    assert lease.lease_id is not None
    deadline = time.monotonic() + 30
    while lease.status == "pending":  # ready at once when every page is in L1
        lease = client.poll_retrieve(lease.lease_id or "")
        assert time.monotonic() < deadline, "retrieve stayed pending"
        time.sleep(0.001)
    if lease.status == "miss":
        return False
    assert lease.lease_id is not None
    for g, arrays in enumerate(client.lease_arrays(lease)):
        for i, arr in enumerate(arrays):
            assert arr is not None and arr.dtype == np.uint8 and arr.shape == (PAGE,)
            assert np.array_equal(arr, page(m, rank, g, i)), (rank, g, i)
    client.finish_retrieve(lease.lease_id)
    return True


def child_store(socket: str, m: rc.Manifest, rank: int) -> tuple[int, bool]:
    """A rank process storing its pages: (pid, published)."""
    with rc.Client(socket) as client:
        return os.getpid(), store_rank(client, m, rank)


def child_restore(socket: str, m: rc.Manifest, rank: int) -> tuple[int, bool]:
    """A rank process restoring its pages byte-exact: (pid, restored)."""
    with rc.Client(socket) as client:
        return os.getpid(), restore_rank(client, m, rank)
