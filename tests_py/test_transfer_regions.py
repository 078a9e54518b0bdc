"""Region page layouts through ``CheckpointWorker(page_pool=PageRegions(...))``:
per-layer host buffers (numpy; torch CPU tensors where torch is installed),
pages made of K/V halves with a block stride and of padded Mamba states
sharing a layer's buffer, moved byte-exact through an embedded sidecar;
bytes outside the pages' regions are never written; layouts and jobs that
do not fit are refused before any byte moves."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rpc_helpers import config
from transfer_helpers import collect_all

import lmcache_rc as rc
from lmcache_rc import errors
from lmcache_rc.worker import CheckpointWorker, PageRegions

NB = 32  # blocks per buffer (block 0 is the null block)
P = 512  # one layer's bytes per block: K half + V half
HALF = P // 2
STATE = 384  # one layer's Mamba state, padded to P
AUX = 96
ATTN, MAMBA, AUXG = "engine-kv-group:0", "engine-kv-group:1", "target-draft-auxiliary"
PAGE_BYTES = {ATTN: 4 * HALF, MAMBA: 2 * STATE, AUXG: AUX}
LAYOUT: dict[str, Any] = {"schema_version": 1, "layout": "hybrid-regions"}

# Attention and Mamba layer i share buffer i (vLLM's layer-outermost hybrid
# layout); the auxiliary page has its own buffer.
GROUPS: dict[str, list[tuple[int, int, int, int]]] = {
    ATTN: [(0, 0, P, HALF), (0, HALF, P, HALF), (1, 0, P, HALF), (1, HALF, P, HALF)],
    MAMBA: [(0, 0, P, STATE), (1, 0, P, STATE)],
    AUXG: [(2, 0, AUX, AUX)],
}


def buffers(fill: int = 0) -> list[np.ndarray[Any, Any]]:
    return [np.full(n, fill, np.uint8) for n in (NB * P, NB * P, NB * AUX)]


def regions(bufs: list[Any]) -> PageRegions:
    return PageRegions(buffers=bufs, groups=GROUPS, num_blocks=NB)


def manifest(start: int, kind: str = "prompt") -> rc.Manifest:
    """A world-1 manifest of 40 tokens: 3 attention pages, 1 Mamba page,
    1 auxiliary page, each group with its own page width; the payload built
    by ``rc.CheckpointPayload``."""
    ns = rc.checkpoint_namespace(
        {
            "target_revision": "t" * 40,
            "draft_revision": "",
            "source_revision": "s" * 40,
            "layout": LAYOUT,
            "parallel": {"tp": 1},
        }
    )
    tokens = list(range(start, start + 40))
    roots = rc.TokenRoots.build(ns, tokens)
    n = len(tokens)
    keys = {
        ATTN: roots.content_keys([(16, "attention:0"), (32, "attention:0"), (n, "attention:0")]),
        MAMBA: [roots.content_key(n, "recurrent:1")],
        AUXG: [roots.content_key(n, f"auxiliary:0:{kind}")],
    }
    groups = [
        {
            "name": name,
            "page_bytes": PAGE_BYTES[name],
            "positions": list(range(len(keys[name]))),
            "content_keys": keys[name],
        }
        for name in (ATTN, MAMBA, AUXG)
    ]
    payload = rc.CheckpointPayload.build(
        worker_layout=LAYOUT, page_groups=groups, draft_prefix_len=0, kind=kind
    )
    prefix = roots.prefix(n)
    return rc.Manifest(rc.checkpoint_generation(prefix, payload), prefix, 1, payload)


def ids_from(first: int) -> list[list[int]]:
    return [[first, first + 1, first + 2], [first + 3], [first + 4]]


def page_bytes(m: rc.Manifest, group: int, index: int) -> np.ndarray[Any, Any]:
    """A page's bytes: a function of its content key."""
    g = m.page_groups()[group]
    seed = int.from_bytes(hashlib.sha256(g["content_keys"][index].encode()).digest()[:8], "little")
    out: np.ndarray[Any, Any] = np.random.default_rng(seed).integers(
        0, 256, g["page_bytes"], dtype=np.uint8
    )
    return out


def views(bufs: list[Any], name: str, block: int) -> list[Any]:
    """The page's regions as writable views, in template order."""
    return [bufs[b][o + block * s : o + block * s + n] for b, o, s, n in GROUPS[name]]


def write_pages(bufs: list[Any], m: rc.Manifest, ids: list[list[int]]) -> None:
    for g, (group, blocks) in enumerate(zip(m.page_groups(), ids, strict=True)):
        for i, block in enumerate(blocks):
            data, at = page_bytes(m, g, i), 0
            for view in views(bufs, group["name"], block):
                view[:] = data[at : at + len(view)]
                at += len(view)


def image(background: int, m: rc.Manifest, ids: list[list[int]]) -> list[np.ndarray[Any, Any]]:
    """What the buffers hold: the background with exactly ``m``'s pages at ``ids``."""
    out = buffers(background)
    write_pages(out, m, ids)
    return out


def idle(client: rc.Client) -> tuple[int, int, int]:
    s = client.status()
    return s["store_leases"], s["retrieve_leases"], s["pins"]


@pytest.fixture
def server(tmp_path: Path) -> Any:
    with rc.Server.start(config(tmp_path, l1_bytes=8 << 20)) as s:
        yield s


def test_numpy_region_buffers_roundtrip_byte_exact(server: Any) -> None:
    ms = [manifest(1000 * k) for k in range(3)]
    store_ids = [ids_from(1 + 5 * k) for k in range(3)]
    restore_ids = [ids_from(16 + 5 * k) for k in range(3)]
    client = rc.Client(server.socket_path)
    bufs = buffers(0xAA)
    for m, ids in zip(ms, store_ids, strict=True):
        assert client.begin(m)
        write_pages(bufs, m, ids)
    before = [b.copy() for b in bufs]
    with CheckpointWorker(
        server.socket_path, rank=0, world_size=1, layout=LAYOUT, page_pool=regions(bufs)
    ) as worker:
        engine = worker.engine
        assert (engine.backend, engine.num_blocks, engine.page_bytes) == ("cpu", NB, None)
        assert engine.group_page_bytes == PAGE_BYTES
        for k, (m, ids) in enumerate(zip(ms, store_ids, strict=True)):
            assert worker.submit(f"s{k}", m, "STORE", ids)
        assert collect_all(worker, 3) == {"s0": True, "s1": True, "s2": True}
        assert all(np.array_equal(a, b) for a, b in zip(bufs, before, strict=True))
        for b in bufs:
            b[:] = 0x55
        for k, (m, ids) in enumerate(zip(ms, restore_ids, strict=True)):
            assert worker.submit(f"r{k}", m, "RETRIEVE", ids)
        assert collect_all(worker, 3) == {"r0": True, "r1": True, "r2": True}
    expected = buffers(0x55)
    for m, ids in zip(ms, restore_ids, strict=True):
        write_pages(expected, m, ids)
    for got, want in zip(bufs, expected, strict=True):
        assert np.array_equal(got, want), "bytes outside the restored regions changed"
    # A Mamba page's pad bytes kept the background.
    block = restore_ids[0][1][0]
    assert (bufs[0][block * P + STATE : (block + 1) * P] == 0x55).all()
    assert idle(client) == (0, 0, 0)


# torch CPU tensors as buffers (torch is not a dependency here) run in every
# test of tests_vllm/: upstream mode binds vLLM's KV-cache storages that way.


def test_a_template_outside_its_buffer_is_refused_when_bound(server: Any) -> None:
    short = buffers()
    short[1] = short[1][:-1]
    with pytest.raises(errors.InvalidInput, match="leaves buffer 1"):
        CheckpointWorker(
            server.socket_path, rank=0, world_size=1, layout=LAYOUT, page_pool=regions(short)
        )
    with pytest.raises(errors.InvalidInput, match="names buffer 3"):
        bad = dict(GROUPS, extra=[(3, 0, 8, 8)])
        CheckpointWorker(
            server.socket_path,
            rank=0,
            world_size=1,
            layout=LAYOUT,
            page_pool=PageRegions(buffers=buffers(), groups=bad, num_blocks=NB),
        )
    # Two views of one array overlap in memory.
    base = np.zeros(NB * P * 2, np.uint8)
    with pytest.raises(errors.InvalidInput, match="overlap in memory"):
        CheckpointWorker(
            server.socket_path,
            rank=0,
            world_size=1,
            layout=LAYOUT,
            page_pool=regions([base[: NB * P], base[8 : NB * P + 8], buffers()[2]]),
        )
    with pytest.raises(ValueError, match="uint8"):
        CheckpointWorker(
            server.socket_path,
            rank=0,
            world_size=1,
            layout=LAYOUT,
            page_pool=regions([np.zeros(NB * P // 4, np.float32), *buffers()[1:]]),
        )
    with pytest.raises(ValueError, match="region"):
        PageRegions(buffers=buffers(), groups={ATTN: [(0, 0, P)]}, num_blocks=NB)
    with pytest.raises(ValueError, match="num_blocks"):
        PageRegions(buffers=buffers(), groups=GROUPS, num_blocks=-1)
    assert idle(rc.Client(server.socket_path)) == (0, 0, 0)


def test_jobs_that_do_not_fit_the_regions_are_refused_before_leasing(server: Any) -> None:
    m = manifest(7000)
    client = rc.Client(server.socket_path)
    assert client.begin(m)
    bufs = buffers(0x33)
    write_pages(bufs, m, ids_from(1))
    with CheckpointWorker(
        server.socket_path, rank=0, world_size=1, layout=LAYOUT, page_pool=regions(bufs)
    ) as worker:
        before = [b.copy() for b in bufs]
        cases = {
            "null": [[0, 2, 3], [4], [5]],
            "range": [[1, 2, 3], [NB], [5]],
            "twice": [[1, 2, 3], [3], [5]],
        }
        # One at a time: an engine refuses a job whose blocks an unfinished
        # job writes (issue 12), and these cases share blocks.
        for task, ids in cases.items():
            assert worker.submit(task, m, "RETRIEVE", ids)
            assert collect_all(worker, 1) == {task: False}
        assert all(np.array_equal(a, b) for a, b in zip(bufs, before, strict=True))
        assert idle(client) == (0, 0, 0)
        # The generation still stores and restores.
        assert worker.submit("ok", m, "STORE", ids_from(1))
        assert collect_all(worker, 1) == {"ok": True}
    # A group the layout does not name, and a page width that differs from
    # the group's regions: each job fails with the reason, nothing moves.
    renamed = dict(GROUPS)
    renamed["engine-kv-group:7"] = renamed.pop(MAMBA)
    narrow = dict(GROUPS)
    narrow[MAMBA] = [(0, 0, P, STATE - 8), (1, 0, P, STATE)]
    for groups, needle in (
        (renamed, "not in this worker's page layout"),
        (narrow, "bytes wide"),
    ):
        engine = rc.TransferEngine.cpu_regions(server.socket_path, bufs, groups, NB, layout=LAYOUT)
        f = engine.submit(m, 0, "RETRIEVE", ids_from(10))
        assert f is not None and f.result(30) is False
        assert f.error_kind == "InvalidInput" and needle in (f.error or ""), f.error
        engine.close()
    assert all(np.array_equal(a, b) for a, b in zip(bufs, before, strict=True))
    assert idle(client) == (0, 0, 0)


def test_the_fault_hook_works_on_region_engines(server: Any) -> None:
    m = manifest(9000)
    client = rc.Client(server.socket_path)
    assert client.begin(m)
    bufs = buffers()
    write_pages(bufs, m, ids_from(1))
    worker = CheckpointWorker(
        server.socket_path, rank=0, world_size=1, layout=LAYOUT, page_pool=regions(bufs)
    )
    worker.engine._inject_fault("fail")
    assert worker.submit("f", m, "STORE", ids_from(1))
    assert collect_all(worker, 1) == {"f": False}
    assert client.begin(m)
    assert worker.submit("s", m, "STORE", ids_from(1))
    assert collect_all(worker, 1) == {"s": True}
    worker.close()
    assert idle(client) == (0, 0, 0)


def test_cuda_regions_without_a_driver_is_a_device_error(server: Any) -> None:
    try:
        rc.TransferEngine.check_cuda_driver()
    except errors.DeviceError:
        pass
    else:
        pytest.skip("a CUDA driver is present; ci/gpu-check.sh covers the cuda backend")
    owner = object()
    with pytest.raises(errors.DeviceError, match="CUDA driver"):
        rc.TransferEngine.cuda_regions(
            server.socket_path, [(owner, 0x7F0000000000, NB * P)], {ATTN: [(0, 0, P, P)]}, NB
        )
