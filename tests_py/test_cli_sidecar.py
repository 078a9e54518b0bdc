"""The sidecar CLI end to end: ``lmcache-rc serve`` in a subprocess, then
``status``, ``inspect`` and ``clear`` against it, exit codes, SIGTERM drain."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rpc_helpers import make_manifest, restore_rank, store_rank
from sidecar_helpers import cli, start_sidecar

import lmcache_rc as rc
from lmcache_rc.cli import build_parser
from lmcache_rc.config import ServerConfig


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str, list[str]]]:
    proc, lines = start_sidecar(tmp_path)
    yield proc, str(tmp_path / "side.sock"), lines
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_every_server_config_field_is_a_serve_flag() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    helps = {a.dest: a.help for a in serve._actions}
    for name, _kind, _optional, doc in ServerConfig.fields():
        assert name in helps, name
        assert helps[name] and helps[name].startswith(doc), name


def test_status_inspect_and_clear_talk_to_a_running_sidecar(
    sidecar: tuple[subprocess.Popen[str], str, list[str]],
) -> None:
    proc, socket, lines = sidecar
    assert any("http admin  http://127.0.0.1:" in line for line in lines)
    out = cli("status", "--socket", socket, "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["generations"] == 0 and isinstance(status["misses"], dict)

    client = rc.Client(socket)
    m, _ = make_manifest(list(range(48)), world=1)
    assert client.begin(m)
    assert store_rank(client, m, 0)
    out = cli("inspect", "--socket", socket, "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["generation"] for r in rows] == [m.generation]
    assert rows[0]["num_tokens"] == 48 and rows[0]["world_size"] == 1
    human = cli("inspect", "--socket", socket)
    assert m.generation[:40] in human.stdout

    m2, _ = make_manifest(list(range(64)), world=1)
    assert client.begin(m2)
    lease = client.prepare_store(m2, 0)
    assert lease.status == "ready"
    # Forced is the default (the reference's): refused while a lease is live.
    for flags in (["--force"], []):
        refused = cli("clear", "--socket", socket, *flags)
        assert refused.returncode == 4, (flags, refused.stderr)
        assert "refused" in refused.stderr
    kept = cli("clear", "--socket", socket, "--no-force", "--json")
    assert kept.returncode == 0, kept.stderr
    assert json.loads(kept.stdout)["kept_objects"] > 0
    assert client.finish_store(lease.lease_id or "", False) is False
    cleared = cli("clear", "--socket", socket, "--json")
    assert cleared.returncode == 0, cleared.stderr
    assert "l1_objects" in json.loads(cleared.stdout)
    assert "(forced) via HTTP admin http://127.0.0.1:" in cleared.stderr
    client.close()

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert proc.stdout is not None
    assert "stopped cleanly" in proc.stdout.read()


def test_unreachable_sidecar_exits_3_with_a_clear_message(tmp_path: Path) -> None:
    out = cli("status", "--socket", str(tmp_path / "nobody.sock"))
    assert out.returncode == 3
    assert "unreachable" in out.stderr and "lmcache-rc serve" in out.stderr


def test_bad_flags_exit_2() -> None:
    out = cli("serve", "--l1-bytes", "lots")
    assert out.returncode == 2


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_durable_generations_restore_after_the_sidecar_restarts(
    tmp_path: Path, how: signal.Signals
) -> None:
    proc, _ = start_sidecar(tmp_path)
    socket = str(tmp_path / "side.sock")
    client = rc.Client(socket)
    m, roots = make_manifest(list(range(80)), world=2)
    assert client.begin(m)
    assert store_rank(client, m, 0) is False
    assert store_rank(client, m, 1) is True
    deadline = time.monotonic() + 30
    while client.status()["l2_queue"] != 0:
        assert time.monotonic() < deadline, "L2 writes never drained"
        time.sleep(0.01)
    proc.send_signal(how)
    proc.wait(timeout=60)
    # A killed server's lock went with it: the next one starts on its socket.
    proc2, _ = start_sidecar(tmp_path)
    try:
        assert client.find(roots.roots) == m, "the client reconnected to the new server"
        assert restore_rank(client, m, 0) and restore_rank(client, m, 1)
        status = client.status()
        assert status["generations"] == 1 and status["l2_bytes_written"] == 0
        assert (status["store_leases"], status["retrieve_leases"], status["pins"]) == (0, 0, 0)
        client.close()
    finally:
        proc2.send_signal(signal.SIGTERM)
        assert proc2.wait(timeout=60) == 0
