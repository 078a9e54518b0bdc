"""Stores that finish while an engine is idle or exiting (upstream mode).

Why: vLLM moves connector metadata to the worker ranks only on engine steps,
and an in-process engine (``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
steps only while it has requests: ``LLM.generate`` loops on
``LLMEngine.has_unfinished_requests()``, which asks the output processor, not
the connector's ``has_pending_push_work()``. A response checkpoint is begun in
``request_finished`` of the last step, so without help its copy task would
wait for the next ``generate()`` — or be aborted at exit — and a script or
notebook cell that ends there would never publish it. (An engine-core process
does keep stepping while ``has_pending_push_work()`` is True, shutdown
included: its busy loop exits only when ``has_work()`` is False.)

What it owns: a process-local registry (:func:`local_engine`) that joins an
engine's scheduler side and its worker ranks when they live in the same
process (vLLM's uniprocess executor, in-process or inside the engine-core
process), keyed by the ``engine_id`` of vLLM's ``KVTransferConfig``; the lock
that makes every connector entry point of that engine mutually exclusive; and
the *hand-over*: store tasks whose bytes are final go straight to the local
ranks, which copy them and finish their leases, so the sidecar publishes them
with no further engine step — never more at once than every rank's copy
queue admits (a refused copy would fail its store), the rest as copies end.
It happens (a) on a background thread once the engine has been idle for
``idle_flush`` seconds and (b) when the first local rank shuts down, before
its copies drain.

A task is final when the forward that writes its bytes has finished on every
rank: response stores at once (the request ended after its last forward),
prompt stores from boundary offers once every local rank ran
``wait_for_save`` of the step whose metadata was built with them
(:attr:`LocalEngine.saved_step`).

What it must never do: touch vLLM's block pool off the scheduler thread
(unpins found by a hand-over wait for the next scheduler call), hand over a
task whose bytes a forward may still write, run when a rank lives in another
process (the registry then never holds every rank, and nothing is handed
over), or keep the process alive (the thread is a daemon).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from lmcache_rc.vllm.api import CheckpointEngineTask

__all__ = ["LocalEngine", "LocalScheduler", "LocalWorker", "forget", "local_engine"]

logger = logging.getLogger(__name__)


class LocalScheduler(Protocol):
    """What the hand-over needs from a scheduler side."""

    def hand_over(
        self, submit: Callable[[CheckpointEngineTask], None], saved_step: int, room: int
    ) -> bool:
        """Submits at most ``room`` final, unsent store tasks through
        ``submit``; True while BEGINs are still unanswered or final tasks
        wait for room."""
        ...

    def has_unsent_work(self) -> bool:
        """Whether a hand-over could have anything to do."""
        ...


class LocalWorker(Protocol):
    """What the hand-over needs from a worker rank."""

    @property
    def saved_step(self) -> int:
        """The step of the last metadata whose stores were submitted after its forward."""
        ...

    @property
    def bound(self) -> bool:
        """Whether the rank's page memory is bound."""
        ...

    def take_now(self, task: CheckpointEngineTask) -> None:
        """Submits one task now (its bytes are final)."""
        ...

    def room(self) -> int:
        """Copies the rank admits now (more would be refused and fail)."""
        ...


class LocalEngine:
    """One engine's scheduler side and worker ranks in this process."""

    def __init__(self, engine_id: str, world_size: int) -> None:
        self.engine_id = engine_id
        self.world_size = world_size
        self.lock = threading.RLock()
        self._wake = threading.Condition(self.lock)
        self.scheduler: LocalScheduler | None = None
        self.workers: dict[int, LocalWorker] = {}
        self.idle_after = 0.0
        self.handed_over = 0
        self._last_call = time.monotonic()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._parked = False
        """The idle thread waits for a call that leaves work behind."""

    # ------------------------------------------------------------------ membership

    def all_local(self) -> bool:
        """Whether every rank of the engine is bound in this process."""
        return len(self.workers) == self.world_size and all(w.bound for w in self.workers.values())

    @property
    def saved_step(self) -> int:
        """The newest step whose forward finished on every local rank."""
        return min((w.saved_step for w in self.workers.values()), default=0)

    def set_scheduler(self, scheduler: LocalScheduler, idle_after: float) -> None:
        """Joins the scheduler side; ``idle_after`` > 0 starts the idle thread."""
        with self.lock:
            self.scheduler = scheduler
            self.idle_after = idle_after
            if idle_after > 0 and self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"lmcache-rc-idle-{self.engine_id[:8]}", daemon=True
                )
                self._thread.start()

    def add_worker(self, rank: int, worker: LocalWorker) -> None:
        """Joins a worker rank bound in this process."""
        with self.lock:
            self.workers[rank] = worker

    # ------------------------------------------------------------------ calls

    @contextmanager
    def call(self) -> Iterator[None]:
        """Around every connector entry point: one at a time, and the idle clock restarts."""
        with self.lock:
            try:
                yield
            finally:
                self._last_call = time.monotonic()
                if self._parked and self.scheduler is not None and self.scheduler.has_unsent_work():
                    self._parked = False
                    self._wake.notify_all()

    def hand_over(self) -> bool:
        """Hands final store tasks to the local ranks (caller holds the lock).
        True while some work could still be handed over later."""
        scheduler = self.scheduler
        if scheduler is None or self._stopped or not self.all_local():
            return False
        workers = [self.workers[r] for r in sorted(self.workers)]

        def submit(task: CheckpointEngineTask) -> None:
            self.handed_over += 1
            for worker in workers:
                worker.take_now(task)

        # never more than every rank's copy queue admits now (a refused copy
        # fails its store); the rest go once copies end
        room = min(w.room() for w in workers)
        return scheduler.hand_over(submit, self.saved_step, room)

    def flush(self, timeout: float) -> None:
        """At a rank's shutdown: hand everything over, waiting up to ``timeout``
        seconds for BEGIN replies (every forward has ended by then)."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self.lock:
            try:
                while self.hand_over() and time.monotonic() < deadline:
                    self._wake.wait(0.005)
            finally:  # also when a hand-over raised: no more of them
                self._stopped = True
                self._wake.notify_all()

    def stop(self) -> None:
        """The scheduler side closed: no more hand-overs, the thread ends."""
        with self.lock:
            self._stopped = True
            self.scheduler = None
            self._wake.notify_all()

    # ------------------------------------------------------------------ idle thread

    def _run(self) -> None:
        with self.lock:
            while not self._stopped:
                scheduler = self.scheduler
                if scheduler is None or not scheduler.has_unsent_work():
                    self._parked = True
                    self._wake.wait()
                    continue
                idle = time.monotonic() - self._last_call
                if idle < self.idle_after:
                    self._wake.wait(self.idle_after - idle)
                    continue
                try:
                    more = self.hand_over()
                except Exception:  # never kill the engine from this thread
                    logger.exception("lmcache-rc: handing idle stores to the local ranks failed")
                    more = False
                # BEGIN replies still due: look again shortly; else sleep until a call
                if more:
                    self._wake.wait(self.idle_after)
                else:
                    self._parked = True
                    self._wake.wait()


_ENGINES: dict[str, LocalEngine] = {}
_REGISTRY_LOCK = threading.Lock()


def local_engine(vllm_config: Any, world_size: int) -> LocalEngine | None:
    """The registry entry of the engine ``vllm_config`` belongs to, created on
    first use; None when vLLM gave it no ``engine_id``."""
    kv = getattr(vllm_config, "kv_transfer_config", None)
    engine_id = getattr(kv, "engine_id", None)
    if not isinstance(engine_id, str) or not engine_id:
        return None
    with _REGISTRY_LOCK:
        entry = _ENGINES.get(engine_id)
        if entry is None or entry.world_size != world_size:
            entry = LocalEngine(engine_id, world_size)
            _ENGINES[engine_id] = entry
        return entry


def forget(entry: LocalEngine) -> None:
    """Drops a stopped engine from the registry."""
    entry.stop()
    with _REGISTRY_LOCK:
        if _ENGINES.get(entry.engine_id) is entry:
            del _ENGINES[entry.engine_id]
