"""Service benchmark: store + retrieve of 64 MiB of pages through lease slots,
copying from / to a numpy page pool, against a single-thread memcpy (numpy
copyto) of the same bytes in the same run (target: ratio >= 0.8, see
docs/design/README.md#performance-targets)."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np

import lmcache_rc as rc
from lmcache_rc.bench import single_group_manifest

PAGE = 256 * 1024


def _manifest(seq: int, pages: int) -> rc.Manifest:
    return single_group_manifest("bench", seq, pages, PAGE)


def main() -> None:
    """Print store/retrieve throughput and the ratio against memcpy."""
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20
    pages = total // PAGE
    rounds = 5
    gpu_pool = np.random.default_rng(0).integers(0, 255, size=(pages, PAGE), dtype=np.uint8)
    host_out = np.empty_like(gpu_pool)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = rc.ServerConfig(
            socket=os.path.join(tmp, "s.sock"),
            l1_bytes=total + (8 << 20),
        )
        svc = rc.CheckpointService(cfg)
        memcpy, store_t, retrieve_t = [], [], []
        for r in range(rounds):
            start = time.perf_counter()
            np.copyto(host_out, gpu_pool)
            memcpy.append(time.perf_counter() - start)

            m = _manifest(r, pages)
            assert svc.begin(m)
            start = time.perf_counter()
            lease = svc.prepare_store(m, 0)
            arrays = svc.lease_arrays(lease)[0]
            for i, arr in enumerate(arrays):
                assert arr is not None
                np.copyto(arr, gpu_pool[i])
            assert svc.finish_store(lease.lease_id or "", True)
            store_t.append(time.perf_counter() - start)

            start = time.perf_counter()
            lease = svc.begin_retrieve(m, 0)  # ready at once: every page is in L1
            while lease.status == "pending":
                lease = svc.poll_retrieve(lease.lease_id or "")
            arrays = svc.lease_arrays(lease)[0]
            for i, arr in enumerate(arrays):
                assert arr is not None
                np.copyto(host_out[i], arr)
            svc.finish_retrieve(lease.lease_id or "")
            retrieve_t.append(time.perf_counter() - start)
            assert np.array_equal(host_out, gpu_pool)
            svc.clear()
        svc.close()
    mb = total / 1e6
    base = statistics.median(memcpy)
    st, rt = statistics.median(store_t), statistics.median(retrieve_t)
    print(f"service: {pages} pages x {PAGE // 1024} KiB = {mb:.0f} MB, median of {rounds}")
    print(f"  memcpy (numpy copyto)        : {mb / base:8.1f} MB/s")
    print(f"  store through lease slots    : {mb / st:8.1f} MB/s  ratio {base / st:.3f}")
    print(f"  retrieve through lease slots : {mb / rt:8.1f} MB/s  ratio {base / rt:.3f}")
    print("  (one copy thread in Python; the transfer engine's figures: ci/bench_transfer.py)")


if __name__ == "__main__":
    main()
