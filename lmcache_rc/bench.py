"""``lmcache-rc bench``: the transfer engine's throughput on this machine.

Stores pages from a host page pool into a sidecar's shared memory and
restores them into a second pool with the cpu backend, through the real RPC
path, with 1 and 2 copy threads, and prints each figure next to a raw copy
of the same bytes measured in the same run, with a verdict per target
(:data:`TARGETS`): one copy thread against a single-thread memcpy (numpy
``copyto``), ratio ≥ 0.85; two copy threads against two raw threads (numpy
``copyto`` of each half on its own thread, or one thread where that is
faster: a memory-bound machine gains nothing from a second thread), ratio ≥
0.9. Each applies to stores and to restores; see
docs/design/README.md#performance-targets and docs/operations.md,
"lmcache-rc bench". Every restore is checked byte for byte.
``ci/bench.sh`` runs it, alongside the Rust benchmarks of the other parts.

By default it starts an embedded sidecar of its own. With ``socket`` it runs
against an already running sidecar without touching its other data: the
pages go to a namespace of their own (``lmcache-rc-bench-<random>``, new at
every run), each round retires exactly that namespace
(``invalidate_namespace``), and the run refuses to start when the sidecar's
pool has less free space than one round needs (the run must never make the
sidecar evict somebody else's pages).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import lmcache_rc as rc

__all__ = [
    "TARGETS",
    "BenchError",
    "BenchResult",
    "format_bytes",
    "run_transfer_bench",
    "single_group_manifest",
]

PAGES_PER_JOB = 64

TARGETS: dict[int, float] = {1: 0.85, 2: 0.9}
"""Minimum throughput ÷ raw-copy ratio per copy-thread count (stores and
restores): the raw copy is a one-thread memcpy for one copy thread, and the
faster of two raw threads and one for two (:meth:`BenchResult.baselines`)."""


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (e.g. the sidecar's pool is too full)."""


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: KiB below 1 MiB, MiB below 1 GiB, else GiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n:.0f} B"


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
    """Throughputs (decimal MB/s, as the JSON keys say) and ratios against
    memcpy of one benchmark run."""

    megabytes: float
    total_bytes: int
    page_kib: int
    jobs: int
    rounds: int
    memcpy_mb_s: float
    """One thread: numpy ``copyto`` of the whole buffer."""
    memcpy2_mb_s: float
    """Two threads: numpy ``copyto`` of each half on its own thread."""
    store_mb_s: dict[int, float]
    restore_mb_s: dict[int, float]
    socket: str | None = None
    """The already running sidecar it used, or None (an embedded one)."""
    namespace: str = ""
    """The run's own namespace (retired after every round)."""
    copy_kernel: str = ""
    """How the cpu backend moved the bytes (``TransferEngine.copy_kernel``)."""

    def baselines(self) -> dict[int, float]:
        """The raw copy each copy-thread count is measured against: one
        memcpy thread for one, the faster of two raw threads and one for two."""
        return {1: self.memcpy_mb_s, 2: max(self.memcpy_mb_s, self.memcpy2_mb_s)}

    def ratios(self) -> dict[str, float]:
        """``store_<threads>`` / ``restore_<threads>`` → throughput ÷ its
        baseline (:meth:`baselines`)."""
        base = self.baselines()
        out = {f"store_{w}": v / base[w] for w, v in self.store_mb_s.items()}
        out.update({f"restore_{w}": v / base[w] for w, v in self.restore_mb_s.items()})
        return out

    def verdicts(self) -> dict[str, dict[str, Any]]:
        """Per target (``store_1``, ``restore_1``, ``store_2``, ``restore_2``):
        the measured ratio, the target and whether it was met."""
        out: dict[str, dict[str, Any]] = {}
        for key, ratio in self.ratios().items():
            target = TARGETS[int(key.rsplit("_", 1)[1])]
            out[key] = {"ratio": ratio, "target": target, "met": ratio >= target}
        return out

    def all_met(self) -> bool:
        """Whether every target was met."""
        return all(v["met"] for v in self.verdicts().values())

    def document(self) -> dict[str, Any]:
        """The ``--json`` object: every field, the ratios and the verdicts."""
        return {
            **asdict(self),
            "baseline_mb_s": self.baselines(),
            "size": format_bytes(self.total_bytes),
            "ratios": self.ratios(),
            "targets": self.verdicts(),
            "all_targets_met": self.all_met(),
        }

    def report(self) -> str:
        """The human-readable table, one verdict per target."""
        mib_s = 1e6 / (1 << 20)  # decimal MB/s -> MiB/s

        def verdict(key: str) -> str:
            v = self.verdicts()[key]
            return f"{'met' if v['met'] else 'NOT met'} (target >= {v['target']})"

        where = f"sidecar at {self.socket}" if self.socket else "embedded sidecar"
        lines = [
            f"transfer: {self.jobs * PAGES_PER_JOB} pages x {format_bytes(self.page_kib << 10)}"
            f" = {format_bytes(self.total_bytes)} in {self.jobs} jobs, median of "
            f"{self.rounds} rounds,",
            f"  {where} over RPC, cpu backend ({self.copy_kernel}), restores checked byte for byte",
            f"  memcpy (numpy copyto, 1 thread) : {self.memcpy_mb_s * mib_s:8.1f} MiB/s"
            "  (baseline of 1 copy thread)",
            f"  memcpy (2 threads, a half each)  : {self.memcpy2_mb_s * mib_s:8.1f} MiB/s"
            f"  (baseline of 2 copy threads: the faster of these two, "
            f"{self.baselines()[2] * mib_s:.1f} MiB/s)",
        ]
        ratios = self.ratios()
        for w in sorted(self.store_mb_s):
            s, r = self.store_mb_s[w], self.restore_mb_s[w]
            lines.append(
                f"  {w} copy thread(s): store   {s * mib_s:8.1f} MiB/s ratio "
                f"{ratios[f'store_{w}']:.3f}  {verdict(f'store_{w}')}"
            )
            lines.append(
                f"  {w} copy thread(s): restore {r * mib_s:8.1f} MiB/s ratio "
                f"{ratios[f'restore_{w}']:.3f}  {verdict(f'restore_{w}')}"
            )
        met = sum(v["met"] for v in self.verdicts().values())
        lines.append(f"  targets met: {met} of {len(self.verdicts())}")
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


def _copy_halves(
    dst: np.ndarray[Any, np.dtype[np.uint8]], src: np.ndarray[Any, np.dtype[np.uint8]]
) -> float:
    """Seconds for two threads to ``copyto`` a half of ``src`` each (numpy
    releases the GIL while it copies)."""
    half = len(src) // 2
    parts = [(dst[:half], src[:half]), (dst[half:], src[half:])]
    workers = [threading.Thread(target=np.copyto, args=part) for part in parts]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - start


def _connect(socket: str, *, attached: bool) -> rc.Client:
    """A client of the sidecar at ``socket``; with ``attached`` (--socket) a
    sidecar that cannot be reached is a :class:`BenchError`."""
    if not attached:
        return rc.Client(socket)
    try:
        client = rc.Client(socket)
    except (OSError, rc.errors.CheckpointError) as exc:
        raise BenchError(f"cannot reach a sidecar at {socket}: {exc}") from exc
    try:
        client.capabilities()
    except (OSError, rc.errors.CheckpointError) as exc:
        client.close()
        raise BenchError(f"cannot reach a sidecar at {socket}: {exc}") from exc
    return client


def _check_room(client: rc.Client, needed: int) -> None:
    """Refuse to run on a sidecar whose pool lacks ``needed`` free bytes: the
    run's stores would otherwise evict other clients' pages."""
    status = client.status()
    free = int(status["l1_capacity"]) - int(status["l1_bytes"])
    if free < needed:
        raise BenchError(
            f"the sidecar's pool has {format_bytes(max(free, 0))} free of "
            f"{format_bytes(int(status['l1_capacity']))}; one round needs "
            f"{format_bytes(needed)} (use a smaller --mib, or no --socket)"
        )


def run_transfer_bench(
    total_bytes: int = 256 << 20,
    page_bytes: int = 256 << 10,
    rounds: int = 3,
    socket: str | None = None,
) -> BenchResult:
    """Runs the benchmark (one warm-up round, then ``rounds``) and returns its figures.

    ``socket``: an already running sidecar to use (see the module docs);
    None starts an embedded one.
    """
    if page_bytes <= 0 or page_bytes % 4096:
        raise ValueError("page_bytes must be a positive multiple of 4096")
    jobs = max(1, total_bytes // (page_bytes * PAGES_PER_JOB))
    rows = jobs * PAGES_PER_JOB
    total = rows * page_bytes
    namespace = f"lmcache-rc-bench-{uuid.uuid4().hex}"
    layout = {"schema_version": 1, "page_bytes": page_bytes}
    src = np.zeros((rows + 1, page_bytes), np.uint8)
    src[1:] = np.random.default_rng(0).integers(0, 255, size=(rows, page_bytes), dtype=np.uint8)
    dst = np.zeros_like(src)
    memcpy: list[float] = []
    memcpy2: list[float] = []
    times: dict[int, tuple[list[float], list[float]]] = {1: ([], []), 2: ([], [])}
    kernel = ""
    with tempfile.TemporaryDirectory() as tmp:
        server: rc.Server | None = None
        if socket is None:
            cfg = rc.ServerConfig(
                socket=os.path.join(tmp, "bench.sock"),
                l1_bytes=total + (16 << 20),
            )
            server = rc.Server.start(cfg)
            socket_path = server.socket_path
        else:
            socket_path = socket
        try:
            with _connect(socket_path, attached=server is None) as client:
                if server is None:
                    _check_room(client, total)
                kernel = _bench_rounds(
                    client,
                    socket_path,
                    namespace,
                    src,
                    dst,
                    layout,
                    jobs,
                    rounds,
                    (memcpy, memcpy2),
                    times,
                )
        finally:
            if server is not None:
                server.stop(timeout=10.0)
    mb = total / 1e6
    return BenchResult(
        megabytes=mb,
        total_bytes=total,
        page_kib=page_bytes // 1024,
        jobs=jobs,
        rounds=rounds,
        memcpy_mb_s=mb / statistics.median(memcpy),
        memcpy2_mb_s=mb / statistics.median(memcpy2),
        store_mb_s={w: mb / statistics.median(t[0]) for w, t in times.items()},
        restore_mb_s={w: mb / statistics.median(t[1]) for w, t in times.items()},
        socket=socket,
        namespace=namespace,
        copy_kernel=kernel,
    )


def _bench_rounds(
    client: rc.Client,
    socket_path: str,
    namespace: str,
    src: np.ndarray[Any, np.dtype[np.uint8]],
    dst: np.ndarray[Any, np.dtype[np.uint8]],
    layout: dict[str, Any],
    jobs: int,
    rounds: int,
    memcpy: tuple[list[float], list[float]],
    times: dict[int, tuple[list[float], list[float]]],
) -> str:
    """The warm-up round and the measured ones; every round's generations
    (all in ``namespace``) are retired when it ends, also on failure.
    Returns the engines' copy kernel."""
    page_bytes = int(layout["page_bytes"])
    engines = {
        w: tuple(
            rc.TransferEngine(
                socket_path, pool, workers=w, max_copies_in_flight=jobs + w, layout=layout
            )
            for pool in (src, dst)
        )
        for w in (1, 2)
    }
    kernel = engines[1][0].copy_kernel
    seq = 0
    staged: list[rc.Manifest] = []
    try:
        for r in range(rounds + 1):  # round 0 warms up the mappings
            for workers, (store, restore) in engines.items():
                start = time.perf_counter()
                np.copyto(dst, src)
                one = time.perf_counter() - start
                dst[:] = 0
                two = _copy_halves(dst, src)
                if r:
                    memcpy[0].append(one)
                    memcpy[1].append(two)
                dst[:] = 0
                staged = []
                for _ in range(jobs):
                    seq += 1
                    m = single_group_manifest(namespace, seq, PAGES_PER_JOB, page_bytes, layout)
                    if not client.begin(m):
                        raise RuntimeError("the sidecar refused to stage a generation")
                    staged.append(m)
                st = _run(store, staged, "STORE")
                rt = _run(restore, staged, "RETRIEVE")
                if not np.array_equal(dst, src):
                    raise RuntimeError("restored bytes differ from the stored ones")
                if r:
                    times[workers][0].append(st)
                    times[workers][1].append(rt)
                staged = []
                client.invalidate_namespace(namespace)
    finally:
        for pair in engines.values():
            for engine in pair:
                engine.close()
        for m in staged:  # a failed round: nothing of it stays pending
            client.abort(m.generation)
        client.invalidate_namespace(namespace)
    return kernel


def main(
    mib: int = 256,
    page_kib: int = 256,
    rounds: int = 3,
    as_json: bool = False,
    socket: str | None = None,
) -> int:
    """``lmcache-rc bench``: prints the report (or one JSON object) with a
    verdict per target; exit 0 (missed targets are reported, not failures),
    1 when the run cannot happen (e.g. the sidecar's pool is too full)."""
    try:
        result = run_transfer_bench(mib << 20, page_kib << 10, rounds, socket)
    except BenchError as exc:
        print(f"lmcache-rc bench: {exc}", file=sys.stderr, flush=True)
        return 1
    if as_json:
        print(json.dumps(result.document(), sort_keys=True))
    else:
        print(result.report())
    sys.stdout.flush()
    return 0
