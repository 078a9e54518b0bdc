"""On-disk formats of earlier releases keep loading: every fixture under
``tests_py/fixtures/format/`` (an index database, an L2 directory and a
shared tier on a filesystem, written by ``fixtures/make_format_fixture.py``
with the code of its day) is opened by today's sidecar and every generation
in it restored byte-exact, from L2 and from the shared tier. A format change
must add a fixture of the new format (checked below) and keep reading the old
ones, or refuse them with an error naming their version."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest
from rpc_helpers import make_manifest, restore_rank
from sidecar_helpers import start_sidecar

import lmcache_rc as rc

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "format"
ALL = sorted(p for p in FIXTURES.iterdir() if (p / "fixture.json").is_file())


def meta(fixture: Path) -> dict[str, object]:
    data = json.loads((fixture / "fixture.json").read_text())
    assert isinstance(data, dict)
    return data


def private_copy(src: Path, dst: Path) -> None:
    """A checkout's copy with the modes the sidecar requires (git keeps none)."""
    if src.is_dir():
        shutil.copytree(src, dst)
        for d, _, files in os.walk(dst):
            os.chmod(d, 0o700)
            for f in files:
                os.chmod(Path(d) / f, 0o600)
    else:
        shutil.copy(src, dst)
        os.chmod(dst, 0o600)


def stop(proc: subprocess.Popen[str], lines: list[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "\n".join([*lines, out])


def manifests(fixture: Path) -> list[tuple[rc.Manifest, rc.TokenRoots]]:
    m = meta(fixture)
    tokens = m["tokens"]
    assert isinstance(tokens, list) and tokens
    world = m["world_size"]
    assert isinstance(world, int)
    return [make_manifest(t, world=world) for t in tokens]


def test_there_are_fixtures() -> None:
    assert ALL, f"no format fixtures under {FIXTURES}"


@pytest.mark.parametrize("fixture", ALL, ids=[p.name for p in ALL])
def test_a_fixture_index_and_l2_restore_byte_exact(fixture: Path, tmp_path: Path) -> None:
    private_copy(fixture / "index.sqlite", tmp_path / "fx.sqlite")
    private_copy(fixture / "l2", tmp_path / "fx-l2")
    proc, lines = start_sidecar(tmp_path, name="fx")
    try:
        with rc.Client(str(tmp_path / "fx.sock")) as c:
            listed = c.list_generations()
            expected = manifests(fixture)
            assert len(listed) == len(expected) == meta(fixture)["generations"], listed
            assert all(g["durable"] for g in listed), listed
            for m, roots in expected:
                assert c.find(roots.roots) == m
                for rank in range(m.world_size):
                    assert restore_rank(c, m, rank), (m.generation, rank)
    finally:
        stop(proc, lines)


@pytest.mark.parametrize("fixture", ALL, ids=[p.name for p in ALL])
def test_a_fixture_shared_tier_restores_byte_exact(fixture: Path, tmp_path: Path) -> None:
    # A host with an empty index and L2 finds and imports every generation
    # from the fixture's shared tier.
    private_copy(fixture / "shared", tmp_path / "shared")
    proc, lines = start_sidecar(
        tmp_path, "--shared-url", f"file://{tmp_path / 'shared'}", name="host"
    )
    try:
        with rc.Client(str(tmp_path / "host.sock")) as c:
            assert c.list_generations() == []
            for m, roots in manifests(fixture):
                assert c.find(roots.roots) == m, m.generation
                for rank in range(m.world_size):
                    assert restore_rank(c, m, rank), (m.generation, rank)
    finally:
        stop(proc, lines)


def test_todays_formats_have_a_fixture(tmp_path: Path) -> None:
    # What today's code writes: the index schema version, the payload format
    # version, the L2 binding's format and the shared tier's layout version.
    proc, lines = start_sidecar(tmp_path, "--shared-url", f"file://{tmp_path}/shared", name="now")
    try:
        with rc.Client(str(tmp_path / "now.sock")) as c:
            format_version = c.capabilities()["format_version"]
    finally:
        stop(proc, lines)
    user_version = sqlite3.connect(tmp_path / "now.sqlite").execute("PRAGMA user_version")
    now = {
        "index_user_version": user_version.fetchone()[0],
        "format_version": format_version,
        "l2": json.loads((tmp_path / "now-l2" / "binding.json").read_text())["format"],
    }
    have = [
        {
            "index_user_version": meta(f)["index_user_version"],
            "format_version": meta(f)["format_version"],
            "l2": json.loads((f / "l2" / "binding.json").read_text())["format"],
        }
        for f in ALL
    ]
    assert now in have, (
        f"today's formats {now} have no fixture (have {have}): write one with "
        "tests_py/fixtures/make_format_fixture.py tests_py/fixtures/format/<new name>"
    )
    shared_layouts = {p.name for f in ALL for p in (f / "shared").iterdir()}
    today = {p.name for p in (tmp_path / "shared").iterdir()} or shared_layouts
    assert today <= shared_layouts, (today, shared_layouts)
