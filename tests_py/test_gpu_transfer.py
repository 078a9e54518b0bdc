"""The cuda backend on a real GPU (marked ``gpu``; ``ci/gpu-check.sh`` runs
these on a machine with a GPU and torch, CI deselects them): pages survive
GPU -> SHM -> GPU byte-exactly, a copy waits for the producer event, a failed
copy reports False and leaves the engine usable, and the copy bandwidth is
printed against torch's own pinned-memory copies of the same bytes."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from rpc_helpers import PAGE, config, make_manifest
from transfer_helpers import LAYOUT, block_layout

import lmcache_rc as rc

pytestmark = pytest.mark.gpu

torch: Any
try:
    import torch
except ImportError:  # CI deselects the gpu marker; gpu-check.sh needs torch
    torch = None


def _require_gpu() -> None:
    if torch is None or not torch.cuda.is_available():
        raise RuntimeError("the gpu tests need torch with a CUDA device (run ci/gpu-check.sh)")


@pytest.fixture
def server() -> Iterator[Any]:
    _require_gpu()
    with (
        tempfile.TemporaryDirectory() as tmp,
        rc.Server.start(config(Path(tmp), l1_bytes=1100 << 20, store_admission_timeout=5.0)) as s,
    ):
        yield s


def _pool(rows: int) -> Any:
    return torch.randint(0, 256, (rows, PAGE), dtype=torch.uint8, device="cuda")


def _engine(server: Any, pool: Any) -> rc.TransferEngine:
    return rc.TransferEngine.cuda(
        server.socket_path,
        pool.data_ptr(),
        pool.shape[0],
        pool.shape[1],
        device=pool.device.index or 0,
        layout=LAYOUT,
    )


def test_gpu_pages_round_trip_through_shared_memory_byte_exact(server: Any) -> None:
    manifests = [
        make_manifest(list(range(k * 1000, k * 1000 + 400)), 1, layout=LAYOUT)[0] for k in range(8)
    ]
    per = max(sum(len(g["positions"]) for g in m.page_groups()) for m in manifests)
    src = _pool(1 + per * len(manifests))
    dst = torch.zeros_like(src)
    store, restore = _engine(server, src), _engine(server, dst)
    with rc.Client(server.socket_path) as client:
        futures = []
        for k, m in enumerate(manifests):
            assert client.begin(m)
            futures.append(store.submit(m, 0, "STORE", block_layout(m, 1 + k * per)))
        assert all(f is not None and f.result(60) for f in futures)
        futures = [
            restore.submit(m, 0, "RETRIEVE", block_layout(m, 1 + k * per))
            for k, m in enumerate(manifests)
        ]
        assert all(f is not None and f.result(60) for f in futures)
    torch.cuda.synchronize()
    used = [row for k, m in enumerate(manifests) for g in block_layout(m, 1 + k * per) for row in g]
    assert torch.equal(src[used], dst[used])
    assert not dst[0].any()
    store.close()
    restore.close()


def test_a_store_waits_for_its_producer_event(server: Any) -> None:
    m, _ = make_manifest(list(range(200)), 1, layout=LAYOUT)
    pool = torch.zeros((64, PAGE), dtype=torch.uint8, device="cuda")
    ids = block_layout(m, 1)
    rows = [r for g in ids for r in g]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the write
        pool[rows] = 7
        event = torch.cuda.Event()
        event.record(side)
    engine = _engine(server, pool)
    with rc.Client(server.socket_path) as client:
        assert client.begin(m)
        f = engine.submit(m, 0, "STORE", ids, producer_event=event.cuda_event)
        assert f is not None and f.result(60) is True
        lease = client.begin_retrieve(m, 0)
        while lease.status == "pending":
            lease = client.poll_retrieve(lease.lease_id or "")
        arrays = client.lease_arrays(lease)
        assert all(a is not None and (a == 7).all() for group in arrays for a in group), (
            "the copy ran before the producer event"
        )
        client.finish_retrieve(lease.lease_id or "")
    engine.close()


def test_a_failed_copy_is_false_and_the_engine_stays_usable(server: Any) -> None:
    m, _ = make_manifest(list(range(100)), 1, layout=LAYOUT)
    pool = _pool(64)
    engine = _engine(server, pool)
    with rc.Client(server.socket_path) as client:
        assert client.begin(m)
        engine._inject_fault("fail")
        f = engine.submit(m, 0, "STORE", block_layout(m, 1))
        assert f is not None and f.result(60) is False and not engine.is_unsafe
        # a failed store aborted its generation: the scheduler begins it again
        assert client.begin(m)
        f = engine.submit(m, 0, "STORE", block_layout(m, 1))
        assert f is not None and f.result(60) is True
        assert client.status()["store_leases"] == 0
    engine.close()


BIG = 1 << 20
BIG_LAYOUT = {"schema_version": 1, "page_bytes": BIG}


def _big_manifest(seq: int, pages: int) -> rc.Manifest:
    roots = rc.TokenRoots.build("gpu-bench", [seq, *range(pages)])
    payload = json.dumps(
        {
            "schema_version": 2,
            "worker_layout": BIG_LAYOUT,
            "page_groups": [
                {
                    "name": "engine-kv-group:0",
                    "page_bytes": BIG,
                    "positions": list(range(pages)),
                    "content_keys": roots.content_keys([(n + 1, "state:0") for n in range(pages)]),
                }
            ],
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()
    prefix = roots.prefix(pages)
    return rc.Manifest(rc.checkpoint_generation(prefix, payload), prefix, 1, payload)


def test_copy_bandwidth_against_torch_pinned_copies(server: Any) -> None:
    per_job, jobs = 256, 4  # 1 GiB of 1 MiB pages in 4 jobs
    rows = per_job * jobs
    src = torch.randint(0, 256, (1 + rows, BIG), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    pinned = torch.empty((rows, BIG), dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    pinned.copy_(src[1:], non_blocking=True)
    torch.cuda.synchronize()
    d2h = time.perf_counter() - t
    t = time.perf_counter()
    dst[1:].copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    h2d = time.perf_counter() - t
    dst.zero_()
    kwargs = {"layout": BIG_LAYOUT, "max_copies_in_flight": jobs + 2}
    store = rc.TransferEngine.cuda(server.socket_path, src.data_ptr(), 1 + rows, BIG, **kwargs)
    restore = rc.TransferEngine.cuda(server.socket_path, dst.data_ptr(), 1 + rows, BIG, **kwargs)
    manifests = [_big_manifest(k, per_job) for k in range(jobs)]
    ids = [[list(range(1 + k * per_job, 1 + (k + 1) * per_job))] for k in range(jobs)]
    with rc.Client(server.socket_path) as client:
        for m in manifests:
            assert client.begin(m)
        t = time.perf_counter()
        futures = [store.submit(m, 0, "STORE", i) for m, i in zip(manifests, ids, strict=True)]
        assert all(f is not None and f.result(120) for f in futures)
        stored = time.perf_counter() - t
        t = time.perf_counter()
        futures = [restore.submit(m, 0, "RETRIEVE", i) for m, i in zip(manifests, ids, strict=True)]
        assert all(f is not None and f.result(120) for f in futures)
        restored = time.perf_counter() - t
    torch.cuda.synchronize()
    assert torch.equal(src[1:], dst[1:])
    mb = rows * BIG / 1e6
    print(
        f"\ngpu bandwidth ({mb:.0f} MB): torch pinned D2H {mb / d2h:.0f} MB/s, "
        f"H2D {mb / h2d:.0f} MB/s; engine store (GPU->SHM) {mb / stored:.0f} MB/s "
        f"ratio {d2h / stored:.2f}, restore (SHM->GPU) {mb / restored:.0f} MB/s "
        f"ratio {h2d / restored:.2f}"
    )
    store.close()
    restore.close()


REGION_LAYOUT = {"schema_version": 1, "layout": "gpu-regions"}


def _region_manifest(seq: int, pages: dict[str, tuple[int, int]]) -> rc.Manifest:
    """One rank's manifest with one group per ``name: (page_bytes, pages)``."""
    roots = rc.TokenRoots.build("gpu-regions", [seq, *range(64)])
    groups = [
        {
            "name": name,
            "page_bytes": page_bytes,
            "positions": list(range(n)),
            "content_keys": roots.content_keys([(k + 1, f"{name}:{k}") for k in range(n)]),
        }
        for name, (page_bytes, n) in pages.items()
    ]
    payload = rc.CheckpointPayload.build(worker_layout=REGION_LAYOUT, page_groups=groups)
    prefix = roots.prefix(64)
    return rc.Manifest(rc.checkpoint_generation(prefix, payload), prefix, 1, payload)


def test_gpu_region_pages_round_trip_byte_exact(server: Any) -> None:
    # Two layer tensors; attention pages are the K and V halves of a block
    # in both layers, Mamba pages the first `state` bytes of the same blocks
    # (vLLM's layer-outermost hybrid layout). Six jobs copy at once (four
    # copy threads: each copy has its own stream and completes by event).
    from lmcache_rc.worker import CheckpointWorker, PageRegions

    nb, p, state = 64, 4096, 3072
    half = p // 2
    groups = {
        "attn": [(0, 0, p, half), (0, half, p, half), (1, 0, p, half), (1, half, p, half)],
        "ssm": [(0, 0, p, state), (1, 0, p, state)],
    }
    src = [torch.randint(0, 256, (nb * p,), dtype=torch.uint8, device="cuda") for _ in range(2)]
    dst = [torch.zeros_like(t) for t in src]
    jobs = 6
    manifests = [
        _region_manifest(k, {"attn": (4 * half, 4), "ssm": (2 * state, 1)}) for k in range(jobs)
    ]
    ids = [[[1 + 5 * k + i for i in range(4)], [5 + 5 * k]] for k in range(jobs)]
    options: dict[str, Any] = {"workers": 4, "max_copies_in_flight": jobs + 4}
    with rc.Client(server.socket_path) as client:
        for m in manifests:
            assert client.begin(m)
        for direction, bufs in (("STORE", src), ("RETRIEVE", dst)):
            pool = PageRegions(buffers=bufs, groups=groups, num_blocks=nb)
            with CheckpointWorker(
                server.socket_path,
                rank=0,
                world_size=1,
                layout=REGION_LAYOUT,
                page_pool=pool,
                **options,
            ) as worker:
                assert worker.engine.backend == "cuda"
                for k, m in enumerate(manifests):
                    assert worker.submit(f"{direction}{k}", m, direction, ids[k])
                deadline = time.monotonic() + 120
                results: dict[str, bool] = {}
                while len(results) < jobs and time.monotonic() < deadline:
                    results.update(worker.collect())
                    time.sleep(0.005)
                assert results == {f"{direction}{k}": True for k in range(jobs)}
        assert client.status()["store_leases"] == 0
    torch.cuda.synchronize()
    expected = [torch.zeros_like(t) for t in src]
    for job_ids in ids:
        for name, blocks in zip(("attn", "ssm"), job_ids, strict=True):
            for block in blocks:
                for b, off, stride, n in groups[name]:
                    at = off + block * stride
                    expected[b][at : at + n] = src[b][at : at + n]
    assert all(torch.equal(d, e) for d, e in zip(dst, expected, strict=True))


if __name__ == "__main__":  # run without pytest: ci/gpu-check.sh on a bare machine
    _require_gpu()
    failures = 0
    for name, fn in list(globals().items()):
        if name.startswith("test_") and callable(fn):
            with (
                tempfile.TemporaryDirectory() as tmp,
                rc.Server.start(
                    config(Path(tmp), l1_bytes=1100 << 20, store_admission_timeout=5.0)
                ) as s,
            ):
                try:
                    fn(s)
                    print(f"PASS {name}")
                except Exception as e:  # report every failure, then exit non-zero
                    failures += 1
                    print(f"FAIL {name}: {type(e).__name__}: {e}")
    os._exit(1 if failures else 0)
