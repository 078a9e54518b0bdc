"""Python-level identity benchmark: rc.TokenRoots.build on a numpy array and on
a list against hashlib.sha256 over the same bytes, in the same run."""

from __future__ import annotations

import hashlib
import statistics
import sys
import time

import numpy as np

import lmcache_rc as rc


def _median_seconds(fn: object, rounds: int = 15) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    """Run the benchmark for argv[1] tokens (default 1M) and print ratios."""
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    i = np.arange(n, dtype=np.uint64)
    tokens = ((i * 2654435761 + 12345) % (1 << 31)).astype(np.uint32)
    as_list = tokens.tolist()
    raw = tokens.astype("<u4").tobytes()
    t_raw = _median_seconds(lambda: hashlib.sha256(raw).digest())
    t_arr = _median_seconds(lambda: rc.TokenRoots.build("bench", tokens))
    t_list = _median_seconds(lambda: rc.TokenRoots.build("bench", as_list), rounds=5)
    mb = len(raw) / 1e6
    print(f"identity (Python): {n} tokens, {mb:.1f} MB")
    print(f"  hashlib.sha256 over the same bytes : {t_raw * 1e3:8.3f} ms")
    print(
        f"  TokenRoots.build(numpy uint32)     : {t_arr * 1e3:8.3f} ms  ratio {t_raw / t_arr:.3f}"
    )
    print(
        f"  TokenRoots.build(list of int)      : {t_list * 1e3:8.3f} ms  ratio {t_raw / t_list:.3f}"
    )


if __name__ == "__main__":
    main()
