"""The idle/exit hand-over of upstream mode (``lmcache_rc.vllm.local``): stores
begun by an engine that stops stepping reach its ranks without another step,
only when every rank is in this process, and only once their bytes are final.

The real-engine suite (``tests_engine/test_real_engine.py``) proves the same
at the user's level through vLLM's CPU build; these pin the rules."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from lmcache_rc.vllm.api import CheckpointEngineTask
from lmcache_rc.vllm.local import LocalEngine, forget, local_engine


@dataclass
class FakeTask:
    task_id: str
    ready_step: int
    sent: bool = False


@dataclass
class FakeScheduler:
    """Stands in for ``UpstreamScheduler``'s hand-over surface."""

    tasks: list[FakeTask] = field(default_factory=list)
    begins: int = 0
    handed: list[str] = field(default_factory=list)
    calls: int = 0

    def has_unsent_work(self) -> bool:
        return self.begins > 0 or any(not t.sent for t in self.tasks)

    def hand_over(
        self, submit: Callable[[CheckpointEngineTask], None], saved_step: int, room: int
    ) -> bool:
        self.calls += 1
        if self.begins:
            self.begins -= 1  # one BEGIN answered per look
        waiting = False
        for t in self.tasks:
            if not t.sent and t.ready_step <= saved_step:
                if room <= 0:
                    waiting = True
                    break
                t.sent = True
                room -= 1
                self.handed.append(t.task_id)
                submit(SimpleNamespace(task_id=t.task_id))  # type: ignore[arg-type]
        return self.begins > 0 or waiting


@dataclass
class FakeWorker:
    saved_step: int = 0
    bound: bool = True
    taken: list[str] = field(default_factory=list)
    event: threading.Event = field(default_factory=threading.Event)
    capacity: int = 16
    """Copies admitted at once."""
    copying: int = 0
    most: int = 0
    """The most copies it held at once."""

    def take_now(self, task: Any) -> None:
        self.copying += 1
        assert self.copying <= self.capacity, "a copy beyond the queue's bound is refused"
        self.most = max(self.most, self.copying)
        self.taken.append(task.task_id)
        self.event.set()

    def room(self) -> int:
        if self.copying:
            self.copying -= 1  # one copy ends between two looks
        return self.capacity - self.copying


def engine(world_size: int = 1) -> LocalEngine:
    return LocalEngine("e" * 32, world_size)


def test_hand_over_needs_every_rank_in_this_process() -> None:
    local = engine(world_size=2)
    sched = FakeScheduler([FakeTask("t", 0)])
    local.set_scheduler(sched, 0.0)
    local.add_worker(0, FakeWorker())
    with local.lock:
        assert local.hand_over() is False
    assert sched.calls == 0, "a rank in another process cannot be reached: nothing handed over"
    w1 = FakeWorker()
    local.add_worker(1, w1)
    with local.lock:
        local.hand_over()
    assert sched.handed == ["t"] and w1.taken == ["t"]
    assert local.workers[0].taken == ["t"]  # type: ignore[attr-defined]


def test_unbound_rank_is_not_local_yet() -> None:
    local = engine()
    sched = FakeScheduler([FakeTask("t", 0)])
    local.set_scheduler(sched, 0.0)
    local.add_worker(0, FakeWorker(bound=False))
    with local.lock:
        local.hand_over()
    assert sched.handed == []


def test_a_store_waits_until_every_rank_finished_its_forward() -> None:
    local = engine(world_size=2)
    sched = FakeScheduler([FakeTask("prompt", 5), FakeTask("response", 0)])
    local.set_scheduler(sched, 0.0)
    local.add_worker(0, FakeWorker(saved_step=5))
    local.add_worker(1, FakeWorker(saved_step=4))
    with local.lock:
        local.hand_over()
    assert sched.handed == ["response"], "step 5's forward has not ended on rank 1"
    local.workers[1].saved_step = 5  # type: ignore[misc]
    with local.lock:
        local.hand_over()
    assert sched.handed == ["response", "prompt"]


def test_flush_waits_for_begin_replies_then_stops() -> None:
    local = engine()
    sched = FakeScheduler([FakeTask("t", 0)], begins=3)
    local.set_scheduler(sched, 0.0)
    worker = FakeWorker()
    local.add_worker(0, worker)
    local.flush(timeout=30)
    assert sched.begins == 0 and worker.taken == ["t"]
    sched.tasks.append(FakeTask("late", 0))
    with local.lock:
        assert local.hand_over() is False
    assert "late" not in worker.taken, "after shutdown nothing more is handed over"


def test_flush_never_gives_a_rank_more_copies_than_it_admits() -> None:
    """An exiting engine with more final stores than a rank's copy queue
    admits hands them over as copies end: a copy beyond the bound would be
    refused and its store fail (lost at exit)."""
    local = engine()
    sched = FakeScheduler([FakeTask(f"t{i}", 0) for i in range(7)])
    local.set_scheduler(sched, 0.0)
    worker = FakeWorker(capacity=2)
    local.add_worker(0, worker)
    local.flush(timeout=30)
    assert worker.taken == [f"t{i}" for i in range(7)], "every store handed over"
    assert worker.most == 2


def test_a_failing_flush_still_stops_the_hand_overs() -> None:
    local = engine()

    class Broken(FakeScheduler):
        def hand_over(self, submit: Any, saved_step: int, room: int) -> bool:
            raise RuntimeError("boom")

    local.set_scheduler(Broken([FakeTask("t", 0)]), 0.0)
    local.add_worker(0, FakeWorker())
    with pytest.raises(RuntimeError, match="boom"):
        local.flush(timeout=30)
    with local.lock:
        assert local.hand_over() is False, "after shutdown nothing more is handed over"


def test_idle_thread_hands_over_without_another_call() -> None:
    local = engine()
    sched = FakeScheduler()
    worker = FakeWorker()
    local.add_worker(0, worker)
    local.set_scheduler(sched, 0.01)
    with local.call():  # the step that begun the store
        sched.tasks.append(FakeTask("response", 0))
    assert worker.event.wait(30), "the idle engine's store never reached the rank"
    assert worker.taken == ["response"]
    forget(local)


def test_idle_thread_survives_a_failing_hand_over(caplog: pytest.LogCaptureFixture) -> None:
    local = engine()

    class Broken(FakeScheduler):
        def hand_over(self, submit: Any, saved_step: int, room: int) -> bool:
            super().hand_over(submit, saved_step, room)
            raise RuntimeError("boom")

    sched = Broken()
    worker = FakeWorker()
    local.add_worker(0, worker)
    local.set_scheduler(sched, 0.01)
    with local.call():
        sched.tasks.append(FakeTask("a", 0))
    assert worker.event.wait(30)
    worker.event.clear()
    with local.call():
        sched.tasks.append(FakeTask("b", 0))
    assert worker.event.wait(30), "the thread died with the first failure"
    assert "handing idle stores" in caplog.text
    forget(local)


def test_registry_joins_one_engine_by_engine_id() -> None:
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id="abc"))
    a = local_engine(config, 1)
    b = local_engine(config, 1)
    assert a is b and a is not None
    other = local_engine(SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id="xyz")), 1)
    assert other is not a
    assert local_engine(SimpleNamespace(kv_transfer_config=None), 1) is None
    forget(a)
    assert local_engine(config, 1) is not a
