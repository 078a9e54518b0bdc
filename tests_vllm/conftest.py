"""Fixtures of the real-vLLM suite: an embedded sidecar, engines built on vLLM
0.33's own scheduler (:mod:`tests_vllm.harness`), and the idle invariant
checked after every test.

Run with the virtualenv ``ci/vllm-env.sh`` makes (``bash ci/vllm-test.sh``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from harness import Engine, EngineSpec, process_engine, write_model_dir

import lmcache_rc as rc

REVISIONS = {"target_revision": "a" * 40, "source_revision": "b" * 40}


class Sidecar:
    """An embedded ``lmcache-rc serve`` on a socket in the test's directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.socket = str(root / "sidecar.sock")
        self.server: Any = None
        self.start()

    def start(self) -> None:
        config = rc.ServerConfig(
            socket=self.socket,
            l1_bytes=64 << 20,
            checkpoint_index_path=str(self.root / "index.sqlite"),
            l2_path=str(self.root / "l2"),
        )
        self.server = rc.Server.start(config)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def status(self) -> dict[str, Any]:
        assert self.server is not None
        status: dict[str, Any] = self.server.status()
        return status

    def client(self) -> Any:
        return rc.Client(self.socket)


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    side = Sidecar(tmp_path / "sidecar")
    yield side
    side.stop()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "model")


EngineFactory = Callable[..., Engine]


@pytest.fixture
def make_engine(
    sidecar: Sidecar, model_dir: Path, request: pytest.FixtureRequest
) -> Iterator[EngineFactory]:
    """Builds engine replicas on the test's sidecar; at the end every one must be idle:
    no lookup, task or pinned block in the connector, every block back in vLLM's
    pool, and no lease, pin or pending generation in the sidecar."""
    engines: list[Engine] = []

    def factory(world_size: int = 1, *, processes: bool = False, **options: Any) -> Engine:
        extra = {
            "lmcache_rc.socket": sidecar.socket,
            "lmcache_rc.checkpoint_identity": dict(REVISIONS),
            "lmcache_rc.layout_timeout": 30.0,
        }
        spec_fields = {
            k: options.pop(k) for k in list(options) if k in EngineSpec.__dataclass_fields__
        }
        extra.update({f"lmcache_rc.{k}": v for k, v in options.items()})
        spec = EngineSpec(
            model_dir=model_dir, extra_config=extra, world_size=world_size, **spec_fields
        )
        engine = process_engine(spec) if processes else Engine(spec)
        engines.append(engine)
        return engine

    yield factory
    failed = request.node.rep_call.failed if hasattr(request.node, "rep_call") else False
    try:
        if not failed:
            for engine in engines:
                if not engine.closed:  # a test that shut its engine down checks it itself
                    assert_idle(engine)
            if sidecar.server is not None:
                assert_sidecar_idle(sidecar)
    finally:
        for engine in engines:
            engine.shutdown()


def assert_idle(engine: Engine) -> None:
    """The engine holds nothing: run it dry first (stores finish on steps)."""
    engine.run()
    connector = engine.connector
    if connector is not None and connector.upstream is not None:
        status = connector.upstream.report_status()
        assert status["tasks"] == {"STORE": 0, "RETRIEVE": 0, "unsent": 0}, status
        assert status["pending_begins"] == 0, status
        assert status["pinned_blocks"] == 0, status
        assert status["lookups"] == {}, status  # every finished request forgotten
        assert status["requests"] == 0, status
    assert engine.free_blocks() == engine.total_blocks(), (
        f"{engine.total_blocks() - engine.free_blocks()} blocks still held"
    )
    for rank in engine.ranks:
        assert rank.in_flight() == 0


def assert_sidecar_idle(sidecar: Sidecar) -> None:
    status = sidecar.status()
    for key in ("store_leases", "retrieve_leases", "pins", "pending"):
        assert status[key] == 0, (key, status)


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{rep.when}", rep)
