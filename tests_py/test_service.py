"""rc.CheckpointService through Python: the worker side played with numpy
views of lease slots (docs/design/leases.md)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import lmcache_rc as rc
from lmcache_rc import errors

STATUS_KEYS = {
    "generations",
    "pending",
    "store_leases",
    "retrieve_leases",
    "pins",
    "l1_objects",
    "l1_bytes",
    "l2_objects",
    "l2_bytes",
    "l2_bytes_written",
    "l2_queue",
    "hits",
    "misses",
    "evictions",
}
PAGE = 4096


def config(tmp_path: Path, **overrides: object) -> rc.ServerConfig:
    values: dict[str, object] = {
        "socket": str(tmp_path / "s.sock"),
        "l1_bytes": 2 << 20,
        "store_admission_timeout": 0.2,
    }
    values.update(overrides)
    return rc.ServerConfig(**values)  # type: ignore[arg-type]


@pytest.fixture
def service(tmp_path: Path) -> Iterator[rc.CheckpointService]:
    svc = rc.CheckpointService(config(tmp_path))
    yield svc
    assert_idle(svc)
    svc.close()


def assert_idle(svc: rc.CheckpointService) -> None:
    s = svc.status()
    assert (s["store_leases"], s["retrieve_leases"], s["pins"]) == (0, 0, 0), s


def make_manifest(tokens: list[int], world: int = 2) -> tuple[rc.Manifest, rc.TokenRoots]:
    ns = rc.checkpoint_namespace(
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
    blocks = [(min((p + 1) * 16, n), "attention:0") for p in range((n + 15) // 16)]
    groups = [
        {
            "name": "engine-kv-group:0",
            "page_bytes": PAGE,
            "positions": list(range(len(blocks))),
            "content_keys": roots.content_keys(blocks),
        },
        {
            "name": "target-draft-auxiliary",
            "page_bytes": PAGE,
            "positions": [0],
            "content_keys": [roots.content_key(n, "auxiliary:0:prompt")],
        },
    ]
    payload = json.dumps(
        {"schema_version": 2, "page_groups": groups, "kind": "prompt", "draft_prefix_len": 0},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    prefix = roots.prefix(n)
    return rc.Manifest(rc.checkpoint_generation(prefix, payload), prefix, world, payload), roots


def fill(rank: int, group: int, index: int) -> int:
    return (rank * 16 + group * 4 + index) % 251


def store(svc: rc.CheckpointService, m: rc.Manifest, rank: int) -> tuple[bool, int]:
    lease = svc.prepare_store(m, rank)
    assert lease.status == "ready", lease
    assert lease.lease_id is not None
    copied = 0
    for g, arrays in enumerate(svc.lease_arrays(lease)):
        for i, arr in enumerate(arrays):
            if arr is not None:
                arr[:] = fill(rank, g, i)
                copied += 1
    return svc.finish_store(lease.lease_id, True), copied


def retrieve(svc: rc.CheckpointService, m: rc.Manifest, rank: int) -> bool:
    lease = svc.begin_retrieve(m, rank)
    if lease.status == "miss":
        return False
    # Ready at once when every page is in L1, else pending: poll.
    assert lease.status in ("pending", "ready") and lease.lease_id is not None
    deadline = time.monotonic() + 10
    while lease.status == "pending":
        lease = svc.poll_retrieve(lease.lease_id or "")
        assert time.monotonic() < deadline
        time.sleep(0.001)
    if lease.status == "miss":
        return False
    assert lease.lease_id is not None
    for g, arrays in enumerate(svc.lease_arrays(lease)):
        for i, arr in enumerate(arrays):
            assert arr is not None
            assert arr.dtype == np.uint8 and arr.shape == (PAGE,)
            assert np.all(arr == fill(rank, g, i)), (rank, g, i)
    svc.finish_retrieve(lease.lease_id)
    return True


def test_server_config_defaults_need_no_flags() -> None:
    c = rc.ServerConfig()
    assert c.shm_name is None, "the pool has no name (an anonymous memfd)"
    assert c.l1_bytes > 0 and c.l1_bytes % 4096 == 0
    assert c.checkpoint_index_path is None and c.l2_path is None
    with pytest.raises(ValueError):
        rc.ServerConfig(l1_bytes=1000)


def test_server_config_reads_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_RC_L1_BYTES", str(8 << 20))
    monkeypatch.setenv("LMCACHE_RC_L2_PATH", "/var/tmp/l2")
    monkeypatch.setenv("LMCACHE_RC_STORE_ADMISSION_TIMEOUT", "1.5")
    c = rc.ServerConfig.from_env(max_leases=7)
    assert (c.l1_bytes, c.l2_path, c.store_admission_timeout, c.max_leases) == (
        8 << 20,
        "/var/tmp/l2",
        1.5,
        7,
    )


def test_capabilities_describe_the_pool(service: rc.CheckpointService) -> None:
    caps = service.capabilities()
    assert caps["format_version"] == 1
    assert caps["pool_size"] == 2 << 20
    assert caps["durable_index"] is False
    assert len(caps["pool_id"]) == 32 and int(caps["pool_id"], 16) >= 0
    assert "shm_name" not in caps, "the pool has no name to open"


def test_store_publishes_after_all_ranks_and_restores_through_numpy_views(
    service: rc.CheckpointService,
) -> None:
    m, roots = make_manifest(list(range(40)))
    assert service.begin(m)
    assert store(service, m, 0) == (False, 4)
    assert service.find(roots.roots) is None
    assert store(service, m, 1) == (True, 4)
    assert service.find(roots.roots) == m
    assert retrieve(service, m, 0) and retrieve(service, m, 1)
    status = service.status()
    assert STATUS_KEYS <= set(status)
    facts = {"version", "socket", "checkpoint_index_path", "l2_path"}
    for key, value in status.items():
        if key in facts:
            assert value is None or isinstance(value, str), key
            continue
        assert isinstance(value, int) or all(isinstance(v, int) for v in value.values()), key
    assert status["version"] == rc.__version__ and status["socket"] is None
    assert status["hits"] == 2


def test_resident_pages_come_back_as_none_and_are_not_copied(
    service: rc.CheckpointService,
) -> None:
    first, _ = make_manifest(list(range(32)), world=1)
    assert service.begin(first)
    store(service, first, 0)
    longer, _ = make_manifest(list(range(40)), world=1)
    assert service.begin(longer)
    lease = service.prepare_store(longer, 0)
    assert lease.slots[0][:2] == (None, None), "the two full attention pages are shared"
    assert all(s is not None for s in lease.slots[0][2:])
    assert lease.lease_id is not None
    service.finish_store(lease.lease_id, False)
    assert service.find(rc.TokenRoots.build(longer.prefix.namespace, range(40)).roots) == first


def test_close_refuses_while_a_copy_holds_a_lease(tmp_path: Path) -> None:
    svc = rc.CheckpointService(config(tmp_path))
    m, _ = make_manifest(list(range(20)), world=1)
    assert svc.begin(m)
    lease = svc.prepare_store(m, 0)
    with pytest.raises(errors.LeasesLive):
        svc.close()
    with pytest.raises(errors.LeasesLive):
        svc.clear(force=True)
    assert lease.lease_id is not None
    assert svc.finish_store(lease.lease_id, True)
    svc.close()


def test_unknown_leases_and_unlisted_generations(service: rc.CheckpointService) -> None:
    m, _ = make_manifest(list(range(20)), world=1)
    assert service.begin_retrieve(m, 0).status == "miss"
    with pytest.raises(errors.NotFound):
        service.poll_retrieve("0" * 32)
    service.finish_retrieve("0" * 32)
    service.cancel_retrieve("0" * 32)
    assert service.finish_store("0" * 32, True) is False
    assert service.prepare_store(m, 0).status == "miss", "not begun: nothing to store"
    with pytest.raises(errors.InvalidInput):
        service.prepare_store(m, 5)
    with pytest.raises(errors.InvalidInput):
        service.slot_array(2 << 20, 10)
    assert service.status()["misses"]["not_listed"] == 1


def test_l2_restart_restores_byte_exact_from_disk(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        l2_path=str(tmp_path / "l2"),
        checkpoint_index_path=str(tmp_path / "dir.sqlite"),
    )
    svc = rc.CheckpointService(cfg)
    m, roots = make_manifest(list(range(50)))
    assert svc.begin(m)
    store(svc, m, 0)
    store(svc, m, 1)
    assert svc.wait_l2_idle(30)
    written = svc.status()["l2_bytes_written"]
    assert written > 0
    assert not svc.begin(m), "exact replay writes nothing"
    svc.close()
    del svc

    svc = rc.CheckpointService(
        config(tmp_path, l2_path=cfg.l2_path, checkpoint_index_path=cfg.checkpoint_index_path)
    )
    status = svc.status()
    assert status["generations"] == 1 and status["l1_objects"] == 0
    assert svc.find(roots.roots) == m
    assert retrieve(svc, m, 0) and retrieve(svc, m, 1)
    assert svc.status()["l2_bytes_written"] == 0
    assert_idle(svc)
    svc.close()


def test_nonforced_clear_keeps_read_leased_pages(service: rc.CheckpointService) -> None:
    m, _ = make_manifest(list(range(20)), world=1)
    assert service.begin(m)
    store(service, m, 0)
    lease = service.begin_retrieve(m, 0)
    assert lease.lease_id is not None
    ready = service.poll_retrieve(lease.lease_id)
    assert ready.status == "ready"
    with pytest.raises(rc.errors.LeasesLive):
        service.clear()  # force omitted is forced: refused while a lease is live
    report = service.clear(force=False)
    assert report["kept_objects"] >= 2
    for g, arrays in enumerate(service.lease_arrays(ready)):
        for i, arr in enumerate(arrays):
            assert arr is not None and np.all(arr == fill(0, g, i))
    service.finish_retrieve(lease.lease_id)
    report = service.clear()
    assert report["retired_generations"] == 1, "no L2: its only copy was in RAM"
    assert service.begin_retrieve(m, 0).status == "miss"
