"""Running ``lmcache-rc serve`` and the CLI as subprocesses, as users do."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path


def cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs ``python -m lmcache_rc ARGS`` to completion (``env``: the whole
    environment, e.g. :func:`fresh_env`; default: this process's)."""
    return subprocess.run(
        [sys.executable, "-m", "lmcache_rc", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=None if env is None else dict(env),
    )


def fresh_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a new user on a fresh machine: ``HOME`` an empty
    directory, no XDG directories, no ``LMCACHE_RC_*`` variables; ``extra``
    added."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LMCACHE_RC_", "XDG_")) and k != "HOME"
    }
    env["HOME"] = str(home)
    env.update(extra)
    return env


def start_sidecar(
    tmp_path: Path, *extra: str, name: str = "side", env: Mapping[str, str] | None = None
) -> tuple[subprocess.Popen[str], list[str]]:
    """Runs ``lmcache-rc serve`` on durable paths under tmp_path (socket
    ``tmp_path/<name>.sock``, HTTP on a free loopback port, ``extra`` flags
    appended, so they win) until it prints "ready"; returns the process and
    its lines."""
    socket = str(tmp_path / f"{name}.sock")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lmcache_rc",
            "serve",
            "--socket",
            socket,
            "--l1-bytes",
            "8M",
            "--checkpoint-index-path",
            str(tmp_path / f"{name}.sqlite"),
            "--l2-path",
            str(tmp_path / f"{name}-l2"),
            "--http-port",
            "0",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=None if env is None else dict(env),
    )
    lines: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if line.strip() == "ready":
            break
    assert lines and lines[-1] == "ready", lines
    return proc, lines
