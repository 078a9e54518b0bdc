"""Running ``lmcache-rc serve`` and the CLI as subprocesses, as users do."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Runs ``python -m lmcache_rc ARGS`` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "lmcache_rc", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def start_sidecar(
    tmp_path: Path, *extra: str, name: str = "side", env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], list[str]]:
    """Runs ``lmcache-rc serve`` on durable paths under tmp_path (socket
    ``tmp_path/<name>.sock``, HTTP on a free loopback port, ``extra`` flags
    appended, ``env`` as its environment when given) until it prints
    "ready"; returns the process and its lines."""
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
        env=env,
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
