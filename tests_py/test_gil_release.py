"""Hashing runs without the GIL: other Python threads progress during a build."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

import lmcache_rc as rc

TOKENS = np.arange(2_000_000, dtype=np.int64) % (2**31 - 1)


def test_token_roots_build_releases_the_gil() -> None:
    # With a long switch interval the main thread never loses the GIL while it
    # runs Python code, so the counter thread can observe `phase == "build"`
    # only while the main thread is inside `build` with the GIL released.
    phase = ["idle"]
    counter = [0]
    started = threading.Event()
    ran_during_build = threading.Event()
    stop = threading.Event()

    def count() -> None:
        started.set()
        while not stop.is_set():
            counter[0] += 1
            if phase[0] == "build":
                ran_during_build.set()
            time.sleep(0.0001)  # hands the GIL back voluntarily

    old_interval = sys.getswitchinterval()
    thread = threading.Thread(target=count, daemon=True)
    # Set before the thread starts: a thread already waiting for the GIL keeps
    # the interval it started waiting with.
    sys.setswitchinterval(5.0)
    try:
        thread.start()
        assert started.wait(30)
        for _ in range(20):
            phase[0] = "build"
            roots = rc.TokenRoots.build("ns", TOKENS)
            phase[0] = "idle"
            assert len(roots) == len(TOKENS)
            if ran_during_build.is_set():
                break
    finally:
        phase[0] = "idle"
        sys.setswitchinterval(old_interval)
        stop.set()
        thread.join(30)
    assert counter[0] > 0
    assert ran_during_build.is_set(), "no other thread ran while TokenRoots.build hashed"
    assert len(roots.roots) == -(-len(TOKENS) // 4096)
