"""pytest fixtures for lmcache-rc: an embedded sidecar, a client, and simulated engines.

Enable with the ``pytest11`` entry point (installed with the package) or, in a
test module or root ``conftest.py``,
``from lmcache_rc.testing.pytest_plugin import *``.

Fixtures:

- ``lmcache_rc_server_config`` — a dict of :class:`lmcache_rc.ServerConfig`
  overrides (override this fixture to change pool size, add an L2 path, ...);
- ``lmcache_rc_server`` — an embedded sidecar (``rc.Server``) on a socket in a
  fresh temporary directory, with a unique shared-memory name; stopped after
  the test;
- ``lmcache_rc_client`` — an ``rc.Client`` connected to that server;
- ``sim_engine_factory`` — ``make(**kwargs) -> SimEngine`` bound to that server
  (keyword arguments go to :class:`~lmcache_rc.testing.SimEngine`); every engine
  it made is closed after the test.

What it must never do: leave a server, socket or shared-memory segment behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import lmcache_rc as rc
from lmcache_rc.testing.sim_engine import SimEngine

__all__ = [
    "lmcache_rc_client",
    "lmcache_rc_server",
    "lmcache_rc_server_config",
    "sim_engine_factory",
]

SimEngineFactory = Callable[..., SimEngine]


@pytest.fixture
def lmcache_rc_server_config() -> dict[str, Any]:
    """Overrides for the embedded sidecar's :class:`lmcache_rc.ServerConfig` (default none)."""
    return {}


@pytest.fixture
def lmcache_rc_server(lmcache_rc_server_config: dict[str, Any]) -> Iterator[rc.Server]:
    """An embedded sidecar in a private temporary directory, stopped after the test."""
    # Unix socket paths are limited to ~100 bytes: keep the directory short.
    directory = tempfile.mkdtemp(prefix="lmrc-")
    values: dict[str, Any] = {
        "socket": os.path.join(directory, "sidecar.sock"),
        "l1_bytes": 32 << 20,
        "store_admission_timeout": 2.0,
    }
    values.update(lmcache_rc_server_config)
    server = rc.Server.start(rc.ServerConfig(**values))
    try:
        yield server
    finally:
        try:
            server.stop()
        finally:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def lmcache_rc_client(lmcache_rc_server: rc.Server) -> Iterator[rc.Client]:
    """A client of :func:`lmcache_rc_server`, closed after the test."""
    client = rc.Client(lmcache_rc_server.socket_path)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def sim_engine_factory(lmcache_rc_server: rc.Server) -> Iterator[SimEngineFactory]:
    """``make(**kwargs)`` builds a :class:`SimEngine` on the test's sidecar; all are closed after.

    ``socket_path`` defaults to the server's socket; pass ``connector=None`` for
    an engine without a KV connector.
    """
    engines: list[SimEngine] = []

    def make(**kwargs: Any) -> SimEngine:
        kwargs.setdefault("socket_path", lmcache_rc_server.socket_path)
        socket_path = kwargs.pop("socket_path")
        engine = SimEngine(socket_path, **kwargs)
        engines.append(engine)
        return engine

    try:
        yield make
    finally:
        first: BaseException | None = None
        for engine in reversed(engines):
            try:
                engine.close()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first
