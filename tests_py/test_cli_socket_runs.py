"""``lmcache-rc demo --socket`` and ``lmcache-rc bench --socket`` against a
sidecar that is already running (``lmcache-rc serve``, a separate process):
they store under a namespace of their own and retire it when they end, so
another tenant's generations stay listed and restore byte for byte, and
nothing of theirs stays behind (no generation, no object in RAM or on disk,
nothing pending). ``bench --socket`` refuses to run when the sidecar's pool
has less free space than one round needs, instead of evicting others' pages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lmcache_rc as rc
from lmcache_rc.bench import single_group_manifest
from lmcache_rc.demo import CORRUPT_ENV
from tests_py.sidecar_helpers import start_sidecar

PAGE_BYTES = 64 << 10
PAGES = 8
TENANT = "recurrent-sha256-v1:tenant-x"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmcache_rc", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[str]:
    """A running ``lmcache-rc serve`` with a 64 MiB pool, a durable directory and L2."""
    proc, _ = start_sidecar(tmp_path, "--l1-bytes", "64M")
    yield str(tmp_path / "side.sock")
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tenant_pages() -> np.ndarray[Any, np.dtype[np.uint8]]:
    pool = np.zeros((PAGES + 1, PAGE_BYTES), np.uint8)
    pool[1:] = np.random.default_rng(42).integers(0, 255, (PAGES, PAGE_BYTES), dtype=np.uint8)
    return pool


def tenant_manifests() -> list[rc.Manifest]:
    layout = {"schema_version": 1, "page_bytes": PAGE_BYTES}
    return [single_group_manifest(TENANT, seq, PAGES, PAGE_BYTES, layout) for seq in (1, 2)]


def transfer(socket: str, pool: np.ndarray[Any, Any], m: rc.Manifest, direction: str) -> None:
    layout = {"schema_version": 1, "page_bytes": PAGE_BYTES}
    engine = rc.TransferEngine(socket, pool, workers=1, layout=layout)
    try:
        future = engine.submit(m, 0, direction, [list(range(1, PAGES + 1))])
        assert future is not None
        assert future.result() is True, future.error
    finally:
        engine.close()


def store_tenant(socket: str, client: rc.Client) -> list[rc.Manifest]:
    manifests = tenant_manifests()
    src = tenant_pages()
    for m in manifests:
        assert client.begin(m)
        transfer(socket, src, m, "STORE")
    return manifests


def assert_tenant_restores_byte_exact(socket: str, manifests: list[rc.Manifest]) -> None:
    expected = tenant_pages()
    for m in manifests:
        dst = np.zeros_like(expected)
        transfer(socket, dst, m, "RETRIEVE")
        assert np.array_equal(dst, expected), m.generation


def settled(client: rc.Client) -> dict[str, Any]:
    """The status once the L2 queue drained and nothing is leased or pending."""
    deadline = time.monotonic() + 60
    while True:
        status = dict(client.status())
        busy = ("l2_queue", "store_leases", "retrieve_leases", "pins", "pending")
        if all(status[k] == 0 for k in busy):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.02)


FOOTPRINT = ("generations", "objects", "l1_objects", "l1_bytes", "l2_objects", "l2_bytes")


def test_demo_and_bench_on_a_running_sidecar_keep_its_data_and_leave_nothing_of_theirs(
    sidecar: str,
) -> None:
    with rc.Client(sidecar) as client:
        tenant = store_tenant(sidecar, client)
        before = settled(client)
        listed = {g["generation"] for g in client.list_generations()}
        assert {m.generation for m in tenant} == listed

        demo = cli(
            "demo", "--socket", sidecar, "--json", "--turns", "2", "--requests", "2",
            "--world-size", "1", "--rank-mode", "thread", "--replicas", "2",
        )  # fmt: skip
        assert demo.returncode == 0, demo.stderr
        doc = json.loads(demo.stdout)
        summary = doc["summary"]
        assert summary["byte_exact"] and summary["restored_tokens"] > 0
        assert summary["restarted"] is False
        demo_generations = summary["cleanup"]["retired_generations"]
        assert demo_generations > 0
        salt = doc["phases"]["sidecar"]["cache_salt"]
        assert salt.startswith("lmcache-rc-demo-")

        bench = cli(
            "bench", "--socket", sidecar, "--json", "--mib", "4", "--page-kib", "64",
            "--rounds", "1",
        )  # fmt: skip
        assert bench.returncode == 0, bench.stderr
        result = json.loads(bench.stdout)
        assert result["socket"] == sidecar
        assert result["namespace"].startswith("lmcache-rc-bench-")
        # 1 job per round, 2 thread counts, a warm-up round and 1 measured one
        bench_generations = result["jobs"] * 2 * (result["rounds"] + 1)

        after = settled(client)
        assert {g["generation"] for g in client.list_generations()} == listed
        assert {k: after[k] for k in FOOTPRINT} == {k: before[k] for k in FOOTPRINT}
        assert after["invalidated_generations"] == demo_generations + bench_generations
        assert after["published"] - before["published"] == demo_generations + bench_generations
        assert after["evictions"] == before["evictions"] == 0
        assert_tenant_restores_byte_exact(sidecar, tenant)


def test_bench_runs_use_a_fresh_namespace_each_time(sidecar: str) -> None:
    names = []
    for _ in range(2):
        done = cli("bench", "--socket", sidecar, "--json", "--mib", "1", "--page-kib", "16",
                   "--rounds", "1")  # fmt: skip
        assert done.returncode == 0, done.stderr
        names.append(json.loads(done.stdout)["namespace"])
    assert names[0] != names[1]


def test_bench_socket_refuses_a_pool_too_full_instead_of_evicting(sidecar: str) -> None:
    with rc.Client(sidecar) as client:
        tenant = store_tenant(sidecar, client)
        before = settled(client)
        done = cli("bench", "--socket", sidecar, "--mib", "128", "--rounds", "1")
        assert done.returncode == 1, (done.stdout, done.stderr)
        assert "lmcache-rc bench: the sidecar's pool has" in done.stderr
        assert "use a smaller --mib" in done.stderr
        assert done.stdout == ""
        after = settled(client)
        assert {k: after[k] for k in FOOTPRINT} == {k: before[k] for k in FOOTPRINT}
        assert after["store_pages_new"] == before["store_pages_new"]
        assert_tenant_restores_byte_exact(sidecar, tenant)


def test_demo_socket_refuses_keep_and_the_corruption_hook(sidecar: str, tmp_path: Path) -> None:
    done = cli("demo", "--socket", sidecar, "--keep", str(tmp_path / "kept"))
    assert done.returncode == 2, done.stderr
    assert "--keep cannot be combined with --socket" in done.stderr
    done = cli("demo", "--socket", sidecar, env={CORRUPT_ENV: "1"})
    assert done.returncode == 2, done.stderr
    assert f"{CORRUPT_ENV} cannot be combined with --socket" in done.stderr


def test_demo_and_bench_socket_without_a_sidecar_fail_with_a_clear_message(
    tmp_path: Path,
) -> None:
    missing = str(tmp_path / "nobody.sock")
    demo = cli("demo", "--socket", missing, "--rank-mode", "thread", "--world-size", "1")
    assert demo.returncode == 1, (demo.stdout, demo.stderr)
    assert f"lmcache-rc demo: FAILED: cannot reach a sidecar at {missing}" in demo.stderr
    bench = cli("bench", "--socket", missing, "--mib", "1", "--rounds", "1")
    assert bench.returncode == 1, (bench.stdout, bench.stderr)
    assert f"lmcache-rc bench: cannot reach a sidecar at {missing}" in bench.stderr
    assert "Traceback" not in bench.stderr
