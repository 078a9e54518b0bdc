"""Python ``Directory.find`` against the Rust ``find`` of the same directory.

``directory_bench --keep DIR`` leaves each size's directory file and a query
file (prompts of 2k..20k tokens, one to five roots). For each size this script
alternates rounds of the Rust ``find`` (``directory_bench --find``, a
subprocess over the same file and queries) and the Python ``find`` in this
process, and prints the median p50/p99 of each with their ratio (target: Python
p50 <= 2 x Rust p50; docs/design/README.md#performance-targets). Roots are built
before timing, as a scheduler holds them.

Usage: ``python ci/bench_directory.py DIR BENCH_BINARY``
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import lmcache_rc as rc

NS = "recurrent-sha256-v1:benchmark-namespace"
ROUNDS = 3


def read_queries(path: Path) -> list[np.ndarray]:
    """Queries as written by directory_bench: u32 count, then the tokens (LE)."""
    words = np.fromfile(path, dtype="<u4")
    out = []
    i = 0
    while i < len(words):
        n = int(words[i])
        out.append(words[i + 1 : i + 1 + n])
        i += 1 + n
    return out


def percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 in microseconds (nearest rank, like the Rust bench)."""
    s = sorted(samples)

    def pick(p: float) -> float:
        return s[min(len(s) - 1, round((len(s) - 1) * p))]

    return pick(0.5) * 1e6, pick(0.99) * 1e6


Lookup = Callable[[rc.Directory, int], "rc.Manifest | None"]


def time_python(path: Path, n: int, call: Lookup) -> tuple[float, float]:
    """Opens the directory, warms up, and times ``call(d, i)`` for each query i."""
    d = rc.Directory(path)
    try:
        for i in range(n):
            call(d, i)
        lat = []
        clock = time.perf_counter
        for i in range(n):
            t = clock()
            m = call(d, i)
            lat.append(clock() - t)
            assert m is not None, "every query hits"
        return percentiles(lat)
    finally:
        d.close()


def time_rust(binary: str, path: Path, queries: Path) -> tuple[float, float]:
    """The Rust find of the same file and queries (p50, p99 in microseconds)."""
    done = subprocess.run(
        [binary, "--find", str(path), str(queries)],
        capture_output=True,
        text=True,
        check=True,
    )
    p50, p99 = done.stdout.split()
    return float(p50), float(p99)


def bench_size(db: Path, binary: str) -> None:
    """Prints Rust and Python find p50/p99 for one kept directory."""
    qpath = db.with_suffix(".queries")
    tokens = read_queries(qpath)
    roots = [rc.TokenRoots.build(NS, t) for t in tokens]
    tuples = [r.roots for r in roots]
    n_roots = sum(len(t) for t in tuples) / len(tuples)
    forms: list[tuple[str, Lookup]] = [
        ("find(TokenRoots)", lambda d, i: d.find(roots[i])),
        ("find(roots.roots), tuple prebuilt", lambda d, i: d.find(tuples[i])),
        ("find(roots.roots)", lambda d, i: d.find(roots[i].roots)),
    ]
    rust: list[tuple[float, float]] = []
    python: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in forms}
    for _ in range(ROUNDS):
        rust.append(time_rust(binary, db, qpath))
        for name, call in forms:
            python[name].append(time_python(db, len(roots), call))
    r50 = statistics.median(p for p, _ in rust)
    r99 = statistics.median(p for _, p in rust)
    print(
        f"-- {db.stem[1:]} published generations: {len(tokens)} prompts of 2k..20k "
        f"tokens ({n_roots:.1f} roots each), median of {ROUNDS} rounds"
    )
    rust_name = "Rust find(&[Prefix])"
    print(f"  {rust_name:<41}: p50 {r50:7.2f} us  p99 {r99:7.2f} us")
    for name, _ in forms:
        p50 = statistics.median(p for p, _ in python[name])
        p99 = statistics.median(p for _, p in python[name])
        print(
            f"  Python {name:<34}: p50 {p50:7.2f} us  p99 {p99:7.2f} us  "
            f"(p50 x Rust {p50 / r50:.2f}, target <= 2)"
        )


def main() -> None:
    """Run every size left in argv[1] against the Rust binary argv[2]."""
    keep, binary = Path(sys.argv[1]), sys.argv[2]
    for db in sorted(keep.glob("n*.sqlite3"), key=lambda p: int(p.stem[1:])):
        bench_size(db, binary)


if __name__ == "__main__":
    main()
