"""Transfer-engine benchmark (cpu backend): store + restore of 256 MiB of
pages through a real sidecar (RPC leases, shared memory) with 1 and 2 copy
threads, against a single-thread memcpy (numpy copyto) of the same bytes in
the same run. DESIGN §9 targets: ratio >= 0.8 with 1 thread, >= 1.5 with 2."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np

import lmcache_rc as rc

sys.path.insert(0, os.path.dirname(__file__))
from bench_common import single_group_manifest

PAGE = 256 * 1024
PAGES_PER_GENERATION = 64
LAYOUT = {"schema_version": 1, "page_bytes": PAGE}


def _manifest(seq: int, pages: int) -> rc.Manifest:
    return single_group_manifest("bench-transfer", seq, pages, PAGE, LAYOUT)


def _run(
    engine: rc.TransferEngine,
    client: rc.Client,
    manifests: list[rc.Manifest],
    direction: str,
) -> float:
    start = time.perf_counter()
    futures = []
    for k, m in enumerate(manifests):
        first = 1 + k * PAGES_PER_GENERATION
        ids = [list(range(first, first + PAGES_PER_GENERATION))]
        future = engine.submit(m, 0, direction, ids)
        assert future is not None, "admission refused"
        futures.append(future)
    for f in futures:
        assert f.result() is True, f.error
    return time.perf_counter() - start


def main() -> None:
    """Print store/restore throughput per thread count and the ratios."""
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 256 << 20
    generations = max(1, total // (PAGE * PAGES_PER_GENERATION))
    pages = generations * PAGES_PER_GENERATION
    total = pages * PAGE
    rounds = 3
    src = np.zeros((pages + 1, PAGE), np.uint8)
    src[1:] = np.random.default_rng(0).integers(0, 255, size=(pages, PAGE), dtype=np.uint8)
    dst = np.zeros_like(src)
    memcpy: list[float] = []
    figures: dict[int, tuple[list[float], list[float]]] = {1: ([], []), 2: ([], [])}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = rc.ServerConfig(
            socket=os.path.join(tmp, "s.sock"),
            shm_name=f"lmrc-bench-xfer-{os.getpid()}",
            l1_bytes=total + (16 << 20),
        )
        with rc.Server.start(cfg) as server, rc.Client(server.socket_path) as client:
            # One engine pair per thread count, alive for the whole run as a
            # worker's engine is: round 0 warms up their mappings of the pool.
            engines = {
                w: tuple(
                    rc.TransferEngine(
                        server.socket_path,
                        pool,
                        workers=w,
                        max_pending=generations + w,
                        layout=LAYOUT,
                    )
                    for pool in (src, dst)
                )
                for w in (1, 2)
            }
            seq = 0
            for r in range(rounds + 1):
                for workers, (store, restore) in engines.items():
                    start = time.perf_counter()
                    np.copyto(dst, src)
                    if r:
                        memcpy.append(time.perf_counter() - start)
                    dst[:] = 0
                    manifests = []
                    for _ in range(generations):
                        seq += 1
                        m = _manifest(seq, PAGES_PER_GENERATION)
                        assert client.begin(m)
                        manifests.append(m)
                    st = _run(store, client, manifests, "STORE")
                    rt = _run(restore, client, manifests, "RETRIEVE")
                    assert np.array_equal(dst, src), "restored bytes differ"
                    if r:
                        figures[workers][0].append(st)
                        figures[workers][1].append(rt)
                    client.clear(all_tiers=True)
            for pair in engines.values():
                for engine in pair:
                    engine.close()
    mb = total / 1e6
    base = statistics.median(memcpy)
    print(f"transfer: {pages} pages x {PAGE // 1024} KiB = {mb:.0f} MB in {generations} jobs,")
    print(f"  median of {rounds} rounds; sidecar over RPC in this process")
    print(f"  memcpy (numpy copyto, 1 thread) : {mb / base:8.1f} MB/s")
    for workers, (st, rt) in figures.items():
        s, r = statistics.median(st), statistics.median(rt)
        target = 0.8 if workers == 1 else 1.5
        print(
            f"  {workers} copy thread(s): store {mb / s:8.1f} MB/s ratio {base / s:.3f}, "
            f"restore {mb / r:8.1f} MB/s ratio {base / r:.3f}  (target >= {target})"
        )


if __name__ == "__main__":
    main()
