"""The shared tier across hosts, as users run it: two ``lmcache-rc serve``
subprocesses (separate L1, L2 and directories) with ``--shared-url`` on one
bucket of a real S3 server (s3s-fs, ``tests_py/s3_server.py``; never a mock).
Host A stores, host B restores what A stored; damage is done to the server's
backing files, outages by stopping the server, crashes by SIGKILL."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rpc_helpers import make_manifest, restore_rank, store_rank
from s3_server import S3Server
from sidecar_helpers import cli, start_sidecar

import lmcache_rc as rc
from lmcache_rc.testing import SimEngine

BUCKET = "shared"
URL = f"s3://{BUCKET}/h"


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[S3Server]:
    with S3Server(tmp_path / "s3", buckets=(BUCKET,)) as server:
        yield server


class Host:
    """One ``lmcache-rc serve`` with the shared tier on the test bucket."""

    def __init__(self, tmp_path: Path, s3: S3Server, name: str, *extra: str) -> None:
        self.tmp_path, self.s3, self.name, self.extra = tmp_path, s3, name, extra
        self.socket = str(tmp_path / f"{name}.sock")
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self.start()

    def start(self) -> None:
        env = dict(os.environ, **self.s3.env())
        self.proc, self.lines = start_sidecar(
            self.tmp_path,
            "--shared-url",
            URL,
            "--shared-lookup-timeout",
            "1",
            *self.extra,
            name=self.name,
            env=env,
        )

    def client(self) -> rc.Client:
        return rc.Client(self.socket)

    def status(self) -> dict[str, object]:
        with self.client() as c:
            return dict(c.status())

    def value(self, key: str) -> int:
        v = self.status()[key]
        assert isinstance(v, int)
        return v

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, out
        self.proc = None


@pytest.fixture
def hosts(tmp_path: Path, s3: S3Server) -> Iterator[Callable[..., Host]]:
    started: list[Host] = []

    def make(name: str, *extra: str) -> Host:
        host = Host(tmp_path, s3, name, *extra)
        started.append(host)
        return host

    yield make
    for host in started:
        if host.proc is not None:
            host.proc.kill()
            host.proc.wait(timeout=30)


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def wait_uploads(host: Host, n: int) -> None:
    """Until ``n`` uploads ended (manifest written or found) and none waits."""

    def done() -> bool:
        s = host.status()
        ended = sum(
            int(str(s[k]))
            for k in (
                "shared_manifests_written",
                "shared_manifests_present",
                "shared_uploads_skipped",
            )
        )
        return ended >= n and s["shared_upload_queue"] == 0

    wait_for(f"{n} uploads of {host.name}", done)


def objects(s3: S3Server, suffix: str) -> dict[Path, int]:
    """The bucket's objects ending in ``suffix``, with their modification times."""
    root = s3.data_dir / BUCKET
    return {p: p.stat().st_mtime_ns for p in root.rglob(f"*{suffix}") if ".tmp." not in p.name}


def test_a_conversation_stored_on_host_a_is_restored_byte_exact_on_host_b(
    hosts: Callable[..., Host], s3: S3Server
) -> None:
    a, b = hosts("a"), hosts("b")
    assert f"  shared      {URL}" in a.lines
    system = list(range(500, 532))
    with SimEngine(a.socket, world_size=2) as engine_a:
        turn1 = system + list(range(10, 18))
        out1 = engine_a.generate("t1", turn1, 4).output_tokens
        turn2 = turn1 + out1 + [7, 8, 9]
        r2 = engine_a.generate("t2", turn2, 4)
        engine_a.assert_idle()
    published_a = a.value("published")
    wait_uploads(a, published_a)
    assert a.value("shared_pages_uploaded") > 0
    assert a.value("shared_dedup_hits") > 0, "turn 2 shares turn 1's pages"
    pages_before = objects(s3, ".page")
    assert len(pages_before) == a.value("shared_pages_uploaded")

    # Host B has never seen the conversation: turn 3 restores from A's uploads.
    turn3 = turn2 + r2.output_tokens + [4, 5, 6]
    with SimEngine(b.socket, world_size=2) as engine_b:
        r3 = engine_b.generate("t3", turn3, 5)
        assert r3.restored_tokens == len(turn2) + len(r2.output_tokens) - 1
        assert r3.output_tokens == engine_b.model.reference_generate(turn3, 5)
        assert engine_b.stats.restores_verified == 2, "both ranks verified every byte"
        engine_b.assert_idle()
    assert b.value("shared_imports") == 1
    assert b.value("shared_fetches") > 0
    # B's own generations (turn 3) are uploaded; A's pages are never rewritten.
    wait_uploads(b, b.value("published") + 1)
    pages_after = objects(s3, ".page")
    for path, mtime in pages_before.items():
        assert pages_after[path] == mtime, f"{path.name} was uploaded again"
    assert len(pages_after) - len(pages_before) == b.value("shared_pages_uploaded")
    assert b.value("shared_manifests_present") >= 1, "the imported generation was not re-sent"
    a.stop()
    b.stop()


def _store(host: Host, manifest: rc.Manifest) -> None:
    with host.client() as c:
        assert c.begin(manifest)
        published = [store_rank(c, manifest, r) for r in range(manifest.world_size)]
        assert published[-1]


def _restores(host: Host, manifest: rc.Manifest) -> bool:
    """Every rank restores byte-exact (False when any misses)."""
    with host.client() as c:
        return all(restore_rank(c, manifest, r) for r in range(manifest.world_size))


def _find(host: Host, roots: rc.TokenRoots) -> rc.Manifest | None:
    with host.client() as c:
        return c.find(list(roots.roots))


def test_corrupt_or_deleted_remote_objects_are_clean_misses_on_host_b(
    hosts: Callable[..., Host], s3: S3Server
) -> None:
    a, b = hosts("a"), hosts("b")
    made = [make_manifest(list(range(base, base + 64))) for base in (1000, 2000, 3000, 4000)]
    owned: list[tuple[set[Path], set[Path]]] = []
    for i, (m, _) in enumerate(made):
        pages, manifests = set(objects(s3, ".page")), set(objects(s3, ".manifest"))
        _store(a, m)
        wait_uploads(a, i + 1)
        owned.append((set(objects(s3, ".page")) - pages, set(objects(s3, ".manifest")) - manifests))
    (good, good_roots), (corrupt, c_roots), (deleted, d_roots), (_bad_manifest, m_roots) = made
    for path in owned[1][0]:  # every page of one generation: flip its last byte
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    for path in owned[2][0]:
        path.unlink()
    for path in owned[3][1]:
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x01
        path.write_bytes(bytes(data))

    assert _find(b, m_roots) is None, "a corrupt manifest is never imported"
    assert b.value("shared_misses_corrupt") == 1
    for m, roots in ((corrupt, c_roots), (deleted, d_roots)):
        assert _find(b, roots) == m  # the manifest verifies: imported
        assert not _restores(b, m), "a bad page is a miss, never wrong bytes"
        with b.client() as c:
            assert m.generation not in {g["generation"] for g in c.list_generations()}
        assert _find(b, roots) is None, "the retired import is not imported again"
    assert b.value("shared_fetch_corrupt") >= 1
    assert b.value("shared_fetch_missing") >= 1
    assert b.status()["misses"] == {"shared_fetch_error": 2}  # type: ignore[comparison-overlap]
    assert _find(b, good_roots) == good
    assert _restores(b, good)
    a.stop()
    b.stop()


def test_with_the_bucket_down_host_b_serves_local_data_and_finds_answer(
    hosts: Callable[..., Host], s3: S3Server
) -> None:
    b = hosts("b")
    local, local_roots = make_manifest(list(range(5000, 5064)))
    _store(b, local)
    wait_uploads(b, 1)
    s3.stop()
    longer = rc.TokenRoots.build(local_roots.namespace, list(range(5000, 5080)))
    assert _find(b, longer) == local, "the local hit, after the shared lookup failed"
    assert _restores(b, local)
    unknown = rc.TokenRoots.build(local_roots.namespace, list(range(6000, 6064)))
    assert _find(b, unknown) is None
    s = b.status()
    failed = int(str(s["shared_misses_error"])) + int(str(s["shared_misses_timeout"]))
    assert failed == 2
    # Stores go on; their uploads wait for the bucket and resume with it.
    later, _ = make_manifest(list(range(7000, 7064)))
    _store(b, later)
    assert _restores(b, later)
    wait_for("a failed upload", lambda: b.value("shared_upload_failures") >= 1)
    s3.restart()
    wait_uploads(b, 2)
    assert b.value("shared_manifests_written") == 2
    b.stop()


def test_sigkill_of_host_a_during_uploads_never_exposes_incomplete_generations(
    hosts: Callable[..., Host], s3: S3Server
) -> None:
    b = hosts("b")
    a = hosts("a")
    rng = random.Random(1234)
    stored: list[tuple[rc.Manifest, rc.TokenRoots]] = []
    restored: set[str] = set()
    rounds = 20
    for i in range(rounds):
        m, roots = make_manifest(list(range(10_000 + 100 * i, 10_064 + 100 * i)), pages=24)
        _store(a, m)
        stored.append((m, roots))
        # Killed at a random point: before the L2 write, during the upload's
        # pages, before its manifest, or after (a whole upload takes a few
        # hundred ms here; the restarted A's start-up pass races the next kill).
        time.sleep(rng.uniform(0.0, 0.4))
        a.kill()
        # B restores whatever it finds, byte-exact, or finds nothing.
        for m_j, roots_j in stored:
            found = _find(b, roots_j)
            if found is not None:
                assert found == m_j
                assert _restores(b, m_j), f"round {i}: {m_j.generation} found but incomplete"
                restored.add(m_j.generation)
        a.start()
    # The last start of A redoes what the kills interrupted: every generation
    # it kept becomes restorable on B.
    with a.client() as c:
        kept = {g["generation"] for g in c.list_generations() if g["durable"]}
    wait_uploads(a, len(kept))
    for m_j, roots_j in stored:
        if m_j.generation in kept and m_j.generation not in restored:
            assert _find(b, roots_j) == m_j
            assert _restores(b, m_j)
            restored.add(m_j.generation)
    assert kept <= restored
    assert b.value("shared_fetch_errors") == 0
    a.stop()
    b.stop()


def test_namespaces_are_isolated_between_hosts(hosts: Callable[..., Host]) -> None:
    a, b = hosts("a"), hosts("b")
    tokens = list(range(8000, 8064))
    m, roots = make_manifest(tokens)
    _store(a, m)
    wait_uploads(a, 1)
    identity = {
        "target_revision": "t" * 40,
        "draft_revision": "",
        "source_revision": "s" * 40,
        "layout": {"page_bytes": 4096},
        "parallel": {"tp": 2},
    }
    assert rc.checkpoint_namespace(identity) == roots.namespace
    # The same model under another cache salt: another namespace (tenant).
    other = rc.TokenRoots.build(rc.checkpoint_namespace(identity, "tenant-b"), tokens)
    assert _find(b, other) is None
    assert b.value("shared_imports") == 0
    assert _find(b, roots) == m
    a.stop()
    b.stop()


def _age(paths: set[Path], seconds: float) -> None:
    old = time.time() - seconds
    for p in paths:
        os.utime(p, (old, old))


def test_shared_gc_removes_old_manifests_and_keeps_referenced_pages(
    hosts: Callable[..., Host], s3: S3Server
) -> None:
    a = hosts("a")
    old, _ = make_manifest(list(range(20_000, 20_064)))
    young, young_roots = make_manifest(list(range(30_000, 30_064)))
    _store(a, old)
    wait_uploads(a, 1)
    old_pages, old_manifests = set(objects(s3, ".page")), set(objects(s3, ".manifest"))
    _store(a, young)
    wait_uploads(a, 2)
    young_pages = set(objects(s3, ".page")) - old_pages
    a.stop()
    three_days = 3 * 86400.0
    # Everything but the young manifest is old: its pages are kept because
    # it names them, the old generation's go with its manifest.
    _age(old_pages | old_manifests | young_pages, three_days)
    env = dict(os.environ, **s3.env())
    refused = subprocess.run(
        [*_cli(), "shared", "gc", "--shared-url", URL, "--older-than", "10m"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert refused.returncode == 2, refused.stderr
    assert "at least" in refused.stderr
    done = subprocess.run(
        [*_cli(), "shared", "gc", "--shared-url", URL, "--older-than", "2d", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["manifests_deleted"] == 1
    assert report["manifests_kept"] == 1
    assert report["pages_deleted"] == len(old_pages)
    assert report["pages_referenced"] == len(young_pages)
    assert report["skipped"] == []
    assert set(objects(s3, ".page")) == young_pages
    # A fresh host still restores the kept generation.
    b = hosts("b")
    assert _find(b, young_roots) == young
    assert _restores(b, young)
    b.stop()


def _cli() -> list[str]:
    import sys

    return [sys.executable, "-m", "lmcache_rc"]


def test_shared_gc_needs_a_url() -> None:
    out = cli("shared", "gc", "--older-than", "3d")
    assert out.returncode == 2
    assert "--shared-url" in out.stderr
