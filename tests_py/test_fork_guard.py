"""A child after fork() gets ForkedProcess, not a deadlock (the fork guard).

Objects that run native threads (reader, accept, I/O and copy threads) or take
locks those threads hold are usable only in the process that made them. In a
forked child every use raises :class:`lmcache_rc.errors.ForkedProcess`, and
dropping them leaks instead of joining threads that stayed in the parent. New
objects made in the child work.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import lmcache_rc as rc
from lmcache_rc import errors

# A hang in the child is the failure this guards against; bound the wait so
# that it fails the test instead of the run.
CHILD_BOUND_S = 60.0


def _in_child(body: Callable[[], None]) -> int:
    """Runs `body` in a forked child; its exit status (0 = passed)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            body()
            code = 0
        except BaseException as exc:  # report anything, then exit without cleanup
            print(f"child failed: {type(exc).__name__}: {exc}", flush=True)
        finally:
            os._exit(code)
    deadline = time.monotonic() + CHILD_BOUND_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")


def _forked(call: Callable[[], object]) -> None:
    """Asserts that `call` raises ForkedProcess naming fork()."""
    with pytest.raises(errors.ForkedProcess, match="fork"):
        call()


def test_objects_from_the_parent_raise_in_a_forked_child(
    lmcache_rc_server: rc.Server, tmp_path: Path
) -> None:
    client = rc.Client(lmcache_rc_server.socket_path)
    assert client.status()["generations"] == 0  # its reader thread runs
    future = client.status_async()
    directory = rc.Directory(str(tmp_path / "index.sqlite"))
    server = lmcache_rc_server
    socket = server.socket_path
    # Referenced only by this list, so the child can drop them.
    doomed: list[object] = [rc.Client(socket), rc.Client(socket).status_async()]

    def child() -> None:
        _forked(client.status)
        _forked(client.status_async)
        _forked(lambda: future.result(timeout=1))
        _forked(directory.status)
        _forked(server.status)
        assert issubclass(errors.ForkedProcess, RuntimeError)
        assert "forked child" in repr(client) and "forked child" in repr(server)
        # Objects made here work: a fresh client talks to the parent's server.
        with rc.Client(socket) as fresh:
            assert fresh.capabilities()["pool_size"] > 0
        # Dropping the parent's objects leaks them instead of hanging.
        doomed.clear()
        gc.collect()

    assert _in_child(child) == 0
    # The parent's objects are untouched.
    assert future.result(timeout=30)["generations"] == 0
    assert client.status()["generations"] == 0
    doomed.clear()
    directory.close()
    client.close()


def test_a_service_in_a_forked_child_raises_and_the_parent_keeps_it(tmp_path: Path) -> None:
    config = rc.ServerConfig(
        socket=str(tmp_path / "s.sock"),
        l1_bytes=2 << 20,
        l2_path=str(tmp_path / "l2"),
    )
    service = rc.CheckpointService(config)

    def child() -> None:
        _forked(service.capabilities)
        _forked(lambda: service.slot_array(0, 4096))
        _forked(service.close)

    assert _in_child(child) == 0
    assert service.capabilities()["pool_size"] == 2 << 20
    service.close()
