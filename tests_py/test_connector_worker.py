"""The worker role of the connector, with a fake copy worker of the CheckpointWorker API.

Covers docs/design/transfers.md#the-connectors-task-protocol: binding the page
pool and layout, one layout report per rank, each task submitted once and reported once per rank, a
failure while creating the event or submitting marks only that task failed,
an unbound rank refuses ("bound"), an unsafe worker is fatal, and layouts
negotiated through the scheduler connector.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import rpc_helpers
from test_connector_config import extra, make_config

import lmcache_rc as rc
from lmcache_rc import errors
from lmcache_rc.vllm.api import CheckpointEngineTask, KVConnectorRole
from lmcache_rc.vllm.connector import LMCacheRecurrentCheckpointConnector
from lmcache_rc.vllm.metadata import CheckpointConnectorMetadata, CheckpointWorkerMetadata
from lmcache_rc.worker import DuplicateTask, TaskLedger

PAGE = 64
LAYOUT = {"schema_version": 1, "page_bytes": PAGE, "groups": [], "auxiliary_fields": []}


class FakeWorker:
    """The API of ``lmcache_rc.worker.CheckpointWorker``; copies finish when told."""

    def __init__(
        self,
        socket_path: str,
        *,
        rank: int,
        world_size: int,
        layout: Any,
        page_pool: np.ndarray,
        workers: int = 2,
        max_copies_in_flight: int = 16,
        rpc_timeout: float = 30.0,
        ledger: TaskLedger | None = None,
    ) -> None:
        self.args = dict(
            socket_path=socket_path,
            rank=rank,
            world_size=world_size,
            layout=layout,
            page_pool=page_pool,
            workers=workers,
            max_copies_in_flight=max_copies_in_flight,
            rpc_timeout=rpc_timeout,
            ledger=ledger,
        )
        self.rank = rank
        self.world_size = world_size
        self.layout = dict(layout)
        self.is_unsafe = False
        self.submitted: list[tuple[str, str, Sequence[Sequence[int]], int | None]] = []
        self.running: set[str] = set()
        self.finished: dict[str, bool] = {}
        self.raise_on: set[str] = set()
        self.closed = False

    def submit(
        self,
        task_id: str,
        manifest: rc.Manifest,
        direction: str,
        block_ids: Sequence[Sequence[int]],
        producer_event: int | None = None,
    ) -> bool:
        if task_id in self.raise_on:
            raise RuntimeError("submission failed")
        if any(t == task_id for t, *_ in self.submitted):
            raise ValueError(f"task {task_id} seen twice")
        self.submitted.append((task_id, direction, block_ids, producer_event))
        if self.is_unsafe:
            self.finished[task_id] = False
            return False
        self.running.add(task_id)
        return True

    def finish(self, task_id: str, ok: bool = True) -> None:
        self.running.remove(task_id)
        self.finished[task_id] = ok

    def collect(self) -> dict[str, bool]:
        if self.is_unsafe and self.running:
            raise errors.UnsafeCopy("a copy may still be in flight")
        out, self.finished = self.finished, {}
        return out

    def in_flight(self) -> int:
        return len(self.running)

    def room(self) -> int:
        return max(0, int(self.args["max_copies_in_flight"]) - len(self.running))

    def wait_idle(self, timeout: float | None = None) -> bool:
        return not self.running

    def close(self, timeout: float | None = None) -> None:
        self.close_timeout = timeout
        if self.is_unsafe:
            raise errors.UnsafeCopy("cannot prove copies stopped")
        self.closed = True


class State:
    """``BoundaryCheckpointState`` stand-in: a numpy pool and a layout."""

    def __init__(self, pool: Any = None, layout: dict[str, Any] | None = None) -> None:
        self.pool = np.zeros((16, PAGE), dtype=np.uint8) if pool is None else pool
        self.layout = dict(LAYOUT if layout is None else layout)
        self.initialized: list[dict[str, Any]] = []

    def get_external_checkpoint_page_pool(self) -> Any:
        return self.pool

    def get_external_checkpoint_layout(self) -> dict[str, Any]:
        return dict(self.layout)

    def initialize_external_checkpoint_layout(self, layout: Any) -> None:
        if layout != self.layout:
            raise ValueError("incompatible")
        self.initialized.append(dict(layout))


class Connector(LMCacheRecurrentCheckpointConnector):
    worker_factory = FakeWorker


def worker_connector(rank: int = 0, world: int = 2, **options: Any) -> Connector:
    return Connector(make_config(extra(**options), rank=rank, world=world), KVConnectorRole.WORKER)


def fake(connector: Connector) -> FakeWorker:
    worker = connector._worker
    assert isinstance(worker, FakeWorker)
    return worker


def tasks(n: int) -> list[CheckpointEngineTask]:
    manifest, _ = rpc_helpers.make_manifest(list(range(20)))
    return [
        CheckpointEngineTask(f"task{i}", manifest, "STORE", ((1 + i,), (2,), (3,)))
        for i in range(n)
    ]


def step(connector: Connector, batch: Sequence[CheckpointEngineTask]) -> Any:
    """One worker step: bind metadata, start_load_kv, collect, clear (vLLM order)."""
    connector.handle_preemptions(CheckpointConnectorMetadata(batch))
    connector.bind_connector_metadata(CheckpointConnectorMetadata(batch))
    try:
        connector.start_load_kv(SimpleNamespace())
        connector.wait_for_save()
        return connector.build_connector_worker_meta()
    finally:
        connector.clear_connector_metadata()


def test_bind_starts_the_copy_worker_with_the_rank_pool_and_options() -> None:
    connector = worker_connector(rank=1, copy_workers=3, max_copies_per_rank=5, rpc_timeout=7.5)
    state = State()
    connector.register_kv_caches({})
    connector.bind_boundary_checkpoint_state(state)
    worker = fake(connector)
    assert worker.args["rank"] == 1 and worker.args["world_size"] == 2
    assert worker.args["socket_path"] == "/tmp/lmcache-rc-test.sock"
    assert worker.args["page_pool"] is state.pool
    assert worker.args["layout"] == LAYOUT
    args = worker.args
    assert (args["workers"], args["max_copies_in_flight"], args["rpc_timeout"]) == (3, 5, 7.5)
    assert state.initialized == [LAYOUT]
    with pytest.raises(RuntimeError, match="twice"):
        connector.bind_boundary_checkpoint_state(state)


def test_the_deprecated_max_pending_option_still_bounds_the_rank_copy_engine() -> None:
    with pytest.warns(FutureWarning, match="use lmcache_rc.max_copies_per_rank"):
        connector = worker_connector(copy_workers=3, max_pending=5)
    connector.register_kv_caches({})
    connector.bind_boundary_checkpoint_state(State())
    assert (fake(connector).args["workers"], fake(connector).args["max_copies_in_flight"]) == (3, 5)


@pytest.mark.parametrize(
    ("pool", "layout", "match"),
    [
        (np.zeros((4, PAGE), dtype=np.float32), LAYOUT, "uint8"),
        (np.zeros((4, PAGE + 1), dtype=np.uint8), LAYOUT, "page_bytes"),
        (np.zeros((4, 2 * PAGE), dtype=np.uint8)[:, ::2], LAYOUT, "C-contiguous"),
        (None, {"schema_version": 1}, "page_bytes"),
        (None, {"page_bytes": True}, "page_bytes"),
    ],
)
def test_bind_refuses_a_pool_or_layout_it_cannot_serve(
    pool: Any, layout: dict[str, Any], match: str
) -> None:
    connector = worker_connector()
    with pytest.raises(ValueError, match=match):
        connector.bind_boundary_checkpoint_state(State(pool, layout))
    assert connector._worker is None


def test_rank_outside_the_world_is_refused() -> None:
    connector = worker_connector(rank=2, world=2)
    with pytest.raises(ValueError, match="outside"):
        connector.bind_boundary_checkpoint_state(State())


def test_layout_is_reported_once_and_each_result_exactly_once() -> None:
    connector = worker_connector(rank=1)
    connector.bind_boundary_checkpoint_state(State())
    meta = step(connector, [])
    assert isinstance(meta, CheckpointWorkerMetadata)
    assert meta.layouts == {1: LAYOUT} and meta.results == {}
    assert step(connector, []) is None  # nothing new
    a, b = tasks(2)
    assert step(connector, [a, b]) is None  # submitted, still running
    worker = fake(connector)
    assert [t for t, *_ in worker.submitted] == ["task0", "task1"]
    assert worker.submitted[0][2] == a.block_ids and worker.submitted[0][3] is None
    worker.finish("task1", ok=False)
    meta = step(connector, [])
    assert meta is not None and meta.results == {"task1": {1: False}} and meta.layouts == {}
    worker.finish("task0")
    meta = step(connector, [])
    assert meta is not None and meta.results == {"task0": {1: True}}
    assert step(connector, []) is None
    assert connector.get_block_ids_with_load_errors() == set()
    status = connector.report_status()
    assert status["role"] == "worker" and status["rank"] == 1 and status["in_flight"] == 0


def test_a_task_delivered_twice_is_an_error() -> None:
    connector = worker_connector()
    connector.bind_boundary_checkpoint_state(State())
    (a,) = tasks(1)
    step(connector, [a])
    with pytest.raises(DuplicateTask, match="twice"):
        step(connector, [a])
    assert len(fake(connector).submitted) == 1


def test_one_task_ledger_per_rank_refuses_each_step_of_a_task_twice() -> None:
    ledger = TaskLedger(capacity=2)
    ledger.deliver("a")
    ledger.start("a")
    ledger.report("a")
    for again in (ledger.deliver, ledger.start, ledger.report):
        with pytest.raises(DuplicateTask, match=r"twice|already"):
            again("a")
    ledger.start("b")  # a direct CheckpointWorker user submits without a delivery
    with pytest.raises(DuplicateTask, match="delivered twice"):
        ledger.deliver("b")
    ledger.deliver("c")
    assert len(ledger) == 2 and "a" not in ledger  # the oldest id is forgotten
    # one exception for every refusal, caught by either earlier handler
    assert issubclass(DuplicateTask, ValueError) and issubclass(DuplicateTask, RuntimeError)


def test_the_worker_side_shares_its_ledger_with_the_copy_worker() -> None:
    connector = worker_connector()
    connector.bind_boundary_checkpoint_state(State())
    side = connector.worker_side
    assert side is not None
    ledger = fake(connector).args["ledger"]
    assert isinstance(ledger, TaskLedger)
    (a,) = tasks(1)
    step(connector, [a])
    assert a.task_id in ledger  # the delivery was recorded in the shared ledger


@pytest.mark.parametrize("failure", ["submit", "event_create", "event_record"])
def test_submission_exception_reports_each_unsent_task(
    failure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    connector = worker_connector(rank=0)
    connector.bind_boundary_checkpoint_state(State())
    step(connector, [])  # the layout report
    worker = fake(connector)
    a, b, c = tasks(3)
    if failure == "submit":
        worker.raise_on.add(b.task_id)
    else:
        side = connector.worker_side
        assert side is not None
        original = side.producer_event

        def event(task_id: str) -> int | None:
            if task_id == b.task_id:
                raise RuntimeError(f"CUDA error during {failure}")
            return original(task_id)

        monkeypatch.setattr(side, "producer_event", event)
    meta = step(connector, [a, b, c])
    assert meta is not None and meta.results == {b.task_id: {0: False}}  # only the failed one
    assert [t for t, *_ in worker.submitted] == [a.task_id, c.task_id]  # the others still went
    worker.finish(a.task_id)
    worker.finish(c.task_id)
    meta = step(connector, [])
    assert meta is not None and meta.results == {a.task_id: {0: True}, c.task_id: {0: True}}
    assert step(connector, []) is None  # each reported once


def test_rejected_submission_is_reported_false_by_the_worker() -> None:
    connector = worker_connector()
    connector.bind_boundary_checkpoint_state(State())
    step(connector, [])
    fake(connector).is_unsafe = True  # an unsafe worker refuses new work
    (a,) = tasks(1)
    meta = step(connector, [a])
    assert meta is not None and meta.results == {a.task_id: {0: False}}


def test_worker_metadata_requires_bound_rank() -> None:
    connector = worker_connector()
    assert step(connector, []) is None  # nothing to report, nothing bound: fine
    with pytest.raises(RuntimeError, match="bound"):
        step(connector, tasks(1))


def test_unsafe_copy_is_fatal_in_metadata_and_shutdown() -> None:
    connector = worker_connector()
    connector.bind_boundary_checkpoint_state(State())
    step(connector, tasks(1))
    fake(connector).is_unsafe = True
    with pytest.raises(errors.UnsafeCopy):
        connector.build_connector_worker_meta()
    with pytest.raises(errors.UnsafeCopy):
        connector.shutdown()


def test_shutdown_drains_the_worker() -> None:
    connector = worker_connector()
    connector.bind_boundary_checkpoint_state(State())
    worker = fake(connector)
    connector.shutdown()
    assert worker.closed
    assert worker.close_timeout == 180.0  # bounded by lmcache_rc.close_timeout


def test_shutdown_drains_the_worker_when_the_exit_hand_over_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An exiting in-process engine hands its begun stores to the ranks first
    (``lmcache_rc.vllm.local``); if that fails, the copies already submitted
    must still drain before vLLM frees the pages: logged, never skipped."""
    connector = worker_connector()
    connector.bind_boundary_checkpoint_state(State())
    worker = fake(connector)

    class Failing:
        def flush(self, timeout: float) -> None:
            raise RuntimeError("hand-over broke")

    connector._local = Failing()  # type: ignore[assignment]
    connector.shutdown()
    assert worker.closed
    assert "handing the exiting engine's stores to its ranks failed" in caplog.text
    assert "hand-over broke" in caplog.text


def test_close_timeout_zero_waits_for_copies_forever() -> None:
    connector = worker_connector(close_timeout=0)
    connector.bind_boundary_checkpoint_state(State())
    worker = fake(connector)
    connector.shutdown()
    assert worker.closed and worker.close_timeout is None


def test_scheduler_role_ignores_worker_hooks() -> None:
    connector = Connector(make_config(extra()), KVConnectorRole.SCHEDULER)
    connector.bind_connector_metadata(CheckpointConnectorMetadata(tasks(1)))
    connector.start_load_kv(SimpleNamespace())  # never bound as a worker: recorded, not sent
    connector.wait_for_layer_load("layer.0")
    connector.save_kv_layer("layer.0", object(), object())
    connector.clear_connector_metadata()


class _Manager:
    def __init__(self) -> None:
        self.boundary_checkpoints = SimpleNamespace(find=lambda request, n: None)
        self.kv_cache_config = SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(layer_names=["a"], kv_cache_spec=object())]
        )
        self.coordinator = SimpleNamespace(single_type_managers=[SimpleNamespace(block_size=4)])


def test_layouts_negotiate_through_the_scheduler_connector(tmp_path: Path) -> None:
    srv = rc.Server.start(rpc_helpers.config(tmp_path))
    try:
        values = {"socket": srv.socket_path}
        ranks = [worker_connector(rank=r, world=2, **values) for r in range(2)]
        for r in ranks:
            r.bind_boundary_checkpoint_state(State())
        sched = Connector(make_config(extra(**values)), KVConnectorRole.SCHEDULER)
        sched.bind_boundary_checkpoint_cache(_Manager())
        assert sched.has_pending_push_work()
        meta = sched.build_connector_meta(SimpleNamespace())
        acc = None
        for r in ranks:
            one = step(r, list(meta.tasks))
            acc = one if acc is None else acc.aggregate(one)
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=acc))
        assert not sched.has_pending_push_work()
        status = sched.report_status()
        assert status["layout_negotiated"] is True and status["layout_ranks"] == [0, 1]
        bridge = sched.bridge
        assert bridge is not None and bridge.layout == LAYOUT
        sched.shutdown()
        for r in ranks:
            r.shutdown()
    finally:
        srv.stop()
