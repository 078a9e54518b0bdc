"""``lmcache-rc bench``: the transfer engine's throughput on this machine.

Stores pages from a host page pool into an embedded sidecar's shared memory
and restores them into a second pool with the cpu backend, through the real
RPC path, with 1 and 2 copy threads, and prints each figure next to a
single-thread memcpy (numpy ``copyto``) of the same bytes measured in the same
run (targets: ratio ≥ 0.8 with one copy thread, ≥ 1.5 with two; see
docs/design/README.md#performance-targets).
Every restore is checked byte for byte. ``ci/bench.sh`` runs it, alongside the
Rust benchmarks of the other parts.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import lmcache_rc as rc

__all__ = ["BenchResult", "run_transfer_bench", "single_group_manifest"]

PAGES_PER_JOB = 64


def single_group_manifest(
    namespace: str, seq: int, pages: int, page_bytes: int, layout: dict[str, Any] | None = None
) -> rc.Manifest:
    """A one-rank schema-2 manifest of ``pages`` distinct pages in one group
    (``seq`` makes every call's generation and content keys distinct)."""
    roots = rc.TokenRoots.build(namespace, [seq, *range(pages)])
    keys = roots.content_keys([(n + 1, "attention:0") for n in range(pages)])
    body: dict[str, Any] = {
        "schema_version": 2,
        "page_groups": [
            {
                "name": "engine-kv-group:0",
                "page_bytes": page_bytes,
                "positions": list(range(pages)),
                "content_keys": keys,
            }
        ],
    }
    if layout is not None:
        body["worker_layout"] = layout
    payload = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    prefix = roots.prefix(pages)
    return rc.Manifest(rc.checkpoint_generation(prefix, payload), prefix, 1, payload)


@dataclass
class BenchResult:
    """Throughputs (MB/s) and ratios against memcpy of one benchmark run."""

    megabytes: float
    page_kib: int
    jobs: int
    rounds: int
    memcpy_mb_s: float
    store_mb_s: dict[int, float]
    restore_mb_s: dict[int, float]

    def ratios(self) -> dict[str, float]:
        """``store_<threads>`` / ``restore_<threads>`` → throughput ÷ memcpy."""
        out = {f"store_{w}": v / self.memcpy_mb_s for w, v in self.store_mb_s.items()}
        out.update({f"restore_{w}": v / self.memcpy_mb_s for w, v in self.restore_mb_s.items()})
        return out

    def report(self) -> str:
        """The human-readable table."""
        lines = [
            f"transfer: {self.jobs * PAGES_PER_JOB} pages x {self.page_kib} KiB = "
            f"{self.megabytes:.0f} MB in {self.jobs} jobs, median of {self.rounds} rounds,",
            "  sidecar over RPC in this process, cpu backend, restores checked byte for byte",
            f"  memcpy (numpy copyto, 1 thread) : {self.memcpy_mb_s:8.1f} MB/s",
        ]
        for w in sorted(self.store_mb_s):
            target = 0.8 if w == 1 else 1.5
            s, r = self.store_mb_s[w], self.restore_mb_s[w]
            lines.append(
                f"  {w} copy thread(s): store {s:8.1f} MB/s ratio {s / self.memcpy_mb_s:.3f}, "
                f"restore {r:8.1f} MB/s ratio {r / self.memcpy_mb_s:.3f}  (target >= {target})"
            )
        return "\n".join(lines)


def _run(engine: rc.TransferEngine, manifests: list[rc.Manifest], direction: str) -> float:
    start = time.perf_counter()
    futures = []
    for k, m in enumerate(manifests):
        first = 1 + k * PAGES_PER_JOB
        future = engine.submit(m, 0, direction, [list(range(first, first + PAGES_PER_JOB))])
        if future is None:
            raise RuntimeError("the transfer engine refused a job (admission bound)")
        futures.append(future)
    for f in futures:
        if f.result() is not True:
            raise RuntimeError(f"a {direction} failed: {f.error}")
    return time.perf_counter() - start


def run_transfer_bench(
    total_bytes: int = 256 << 20, page_bytes: int = 256 << 10, rounds: int = 3
) -> BenchResult:
    """Runs the benchmark (one warm-up round, then ``rounds``) and returns its figures."""
    if page_bytes <= 0 or page_bytes % 4096:
        raise ValueError("page_bytes must be a positive multiple of 4096")
    jobs = max(1, total_bytes // (page_bytes * PAGES_PER_JOB))
    rows = jobs * PAGES_PER_JOB
    total = rows * page_bytes
    layout = {"schema_version": 1, "page_bytes": page_bytes}
    src = np.zeros((rows + 1, page_bytes), np.uint8)
    src[1:] = np.random.default_rng(0).integers(0, 255, size=(rows, page_bytes), dtype=np.uint8)
    dst = np.zeros_like(src)
    memcpy: list[float] = []
    times: dict[int, tuple[list[float], list[float]]] = {1: ([], []), 2: ([], [])}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = rc.ServerConfig(
            socket=os.path.join(tmp, "bench.sock"),
            l1_bytes=total + (16 << 20),
        )
        with rc.Server.start(cfg) as server, rc.Client(server.socket_path) as client:
            engines = {
                w: tuple(
                    rc.TransferEngine(
                        server.socket_path, pool, workers=w, max_pending=jobs + w, layout=layout
                    )
                    for pool in (src, dst)
                )
                for w in (1, 2)
            }
            seq = 0
            try:
                for r in range(rounds + 1):  # round 0 warms up the mappings
                    for workers, (store, restore) in engines.items():
                        start = time.perf_counter()
                        np.copyto(dst, src)
                        if r:
                            memcpy.append(time.perf_counter() - start)
                        dst[:] = 0
                        manifests = []
                        for _ in range(jobs):
                            seq += 1
                            m = single_group_manifest(
                                "bench", seq, PAGES_PER_JOB, page_bytes, layout
                            )
                            if not client.begin(m):
                                raise RuntimeError("the sidecar refused to stage a generation")
                            manifests.append(m)
                        st = _run(store, manifests, "STORE")
                        rt = _run(restore, manifests, "RETRIEVE")
                        if not np.array_equal(dst, src):
                            raise RuntimeError("restored bytes differ from the stored ones")
                        if r:
                            times[workers][0].append(st)
                            times[workers][1].append(rt)
                        client.clear(all_tiers=True)
            finally:
                for pair in engines.values():
                    for engine in pair:
                        engine.close()
    mb = total / 1e6
    return BenchResult(
        megabytes=mb,
        page_kib=page_bytes // 1024,
        jobs=jobs,
        rounds=rounds,
        memcpy_mb_s=mb / statistics.median(memcpy),
        store_mb_s={w: mb / statistics.median(t[0]) for w, t in times.items()},
        restore_mb_s={w: mb / statistics.median(t[1]) for w, t in times.items()},
    )


def main(mib: int = 256, page_kib: int = 256, rounds: int = 3, as_json: bool = False) -> int:
    """``lmcache-rc bench``: prints the report (or one JSON object); exit 0."""
    result = run_transfer_bench(mib << 20, page_kib << 10, rounds)
    if as_json:
        print(json.dumps({**asdict(result), "ratios": result.ratios()}, sort_keys=True))
    else:
        print(result.report())
    sys.stdout.flush()
    return 0
