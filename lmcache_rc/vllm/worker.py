"""The worker side of the connector (one instance per worker rank), both modes.

The connector picks one side object when it is built and delegates every
worker hook to it: :class:`WorkerHooks` (each hook's "nothing to do": a
disabled connector, or the scheduler role), :class:`WorkerSide` (boundary
mode, and ``auto`` until the fork's hook decides) or
:class:`UpstreamWorkerSide`.

What it owns: binding the rank's page memory to a copy worker
(:class:`lmcache_rc.worker.CheckpointWorker`) — the fork's page pool in
boundary mode, the regions of the per-layer KV caches in upstream mode
(:mod:`lmcache_rc.vllm.layout`) —; submitting each task of the scheduler's
metadata exactly once, at the hook where its source bytes are final
(restores at ``start_load_kv``; upstream stores at ``wait_for_save``, after
the forward that wrote them); and reporting each task's result exactly once
per rank: in the worker metadata, and for upstream restores also in vLLM's
``finished_recving`` / ``failed_recving`` (vLLM counts those across ranks
before the blocks become a hit).

"Each task once" is the rank's one :class:`lmcache_rc.worker.TaskLedger`,
shared with its copy worker: a task delivered twice raises
:class:`lmcache_rc.worker.DuplicateTask`, bound or not.

What it must never do: report a task twice, let a task be lost without a
result (a refused or failed submission is reported False), or turn an
``UnsafeCopy`` into a miss (it is fatal for the worker process).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

import lmcache_rc as rc
from lmcache_rc import errors
from lmcache_rc.vllm.api import CheckpointEngineTask, KVCacheConfig
from lmcache_rc.vllm.layout import UpstreamLayout, build_upstream_layout, group_name
from lmcache_rc.vllm.metadata import CheckpointConnectorMetadata, CheckpointWorkerMetadata
from lmcache_rc.vllm.options import ConnectorOptions
from lmcache_rc.worker import CheckpointWorker, TaskLedger

__all__ = [
    "CopyWorker",
    "TransferResults",
    "UpstreamWorkerSide",
    "WorkerHooks",
    "WorkerSide",
    "default_worker_factory",
]

logger = logging.getLogger(__name__)


class CopyWorker(Protocol):
    """The part of ``lmcache_rc.worker.CheckpointWorker`` the connector uses."""

    def submit(
        self,
        task_id: str,
        manifest: rc.Manifest,
        direction: str,
        block_ids: Sequence[Sequence[int]],
        producer_event: int | None = None,
    ) -> bool:
        """Queue one task's copy (False: refused, reported at the next collect)."""
        ...

    def collect(self) -> dict[str, bool]:
        """Tasks that ended since the last call, each once."""
        ...

    def in_flight(self) -> int:
        """Copies queued or running."""
        ...

    def room(self) -> int:
        """Copies admitted now (more are refused and fail)."""
        ...

    def close(self, timeout: float | None = None) -> None:
        """Drain, then stop (``UnsafeCopy`` when copies cannot be proven stopped)."""
        ...


def default_worker_factory(socket_path: str, **kwargs: Any) -> CopyWorker:
    """A :class:`lmcache_rc.worker.CheckpointWorker` (the keyword arguments:
    rank, world_size, layout, page_pool, workers, max_copies_in_flight,
    rpc_timeout and the rank's ledger)."""
    return CheckpointWorker(socket_path, **kwargs)


@dataclass
class TransferResults:
    """What a rank reports for upstream restores this step (vLLM's
    ``KVConnectorTransferResults`` fields)."""

    finished_recving: set[str]
    failed_recving: set[str]


class WorkerHooks:
    """The worker hooks the connector delegates to, each with its "nothing to
    do" answer: the side of a disabled connector and of the scheduler role."""

    @property
    def rank(self) -> int | None:
        """This worker's rank (None: no worker side)."""
        return None

    @property
    def bound(self) -> bool:
        """Whether page memory is bound (a copy worker exists)."""
        return False

    @property
    def worker(self) -> CopyWorker | None:
        """The copy worker (after binding)."""
        return None

    def in_flight(self) -> int:
        """Copies queued or running on this rank."""
        return 0

    def is_unsafe(self) -> bool:
        """Whether the copy worker turned unsafe."""
        return False

    def register_kv_caches(self, kv_caches: Mapping[str, Any], kv_cache_config: Any) -> bool:
        """vLLM's per-layer KV caches; True when they were bound (upstream mode)."""
        return False

    def bind_boundary_state(self, state: Any) -> None:
        """The fork's ``bind_boundary_checkpoint_state`` (boundary mode binds)."""

    def take(self, meta: Any) -> None:
        """This step's tasks (``start_load_kv``)."""

    def wait_for_save(self, step: int) -> None:
        """The forward of ``step`` ended (upstream stores are submitted now)."""

    def transfer_results(self) -> TransferResults | None:
        """Upstream restores that ended: None, vLLM's empty default."""
        return None

    def worker_meta(self) -> CheckpointWorkerMetadata | None:
        """Nothing to report."""
        return None

    def inject_fault(self, kind: str, count: int = 1, delay: float = 0.0) -> None:
        """Test hook of a worker rank: RuntimeError here."""
        raise RuntimeError("inject_fault is a worker-role hook")

    def stats(self) -> tuple[dict[str, int], dict[str, float]]:
        """Cumulative counters and gauges of this rank (none without a copy worker)."""
        return {}, {}

    def close(self) -> None:
        """Nothing to drain."""


class WorkerSide(WorkerHooks):
    """One rank's copy worker and the bookkeeping that makes every task end
    once; boundary mode's hooks (the fork's page pool, every task submitted
    at ``start_load_kv``)."""

    stores_later = False
    """Whether stores wait for :meth:`wait_for_save` (upstream mode)."""

    def __init__(
        self,
        options: ConnectorOptions,
        *,
        rank: int,
        world_size: int,
        factory: Callable[..., Any] | None = None,
    ) -> None:
        self._options = options
        self._rank = rank
        self._world_size = world_size
        self._factory = factory or default_worker_factory
        self._worker: CopyWorker | None = None
        self._layout: dict[str, Any] | None = None
        self._layout_reported = False
        self._cuda = False
        self._ledger = TaskLedger()
        self._unsent: dict[str, bool] = {}
        self._unbound: list[str] = []
        self._events: dict[str, Any] = {}
        self._loads: dict[str, str] = {}  # task id -> request id (upstream restores)
        self._stores: list[CheckpointEngineTask] = []  # submitted at wait_for_save
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        # results taken by transfer_results() that the worker metadata still owes
        self._pending_results: dict[str, bool] = {}
        self._saved_step = 0
        self.upstream: UpstreamLayout | None = None

    # ------------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        """This worker's rank."""
        return self._rank

    @property
    def bound(self) -> bool:
        """Whether page memory is bound (a copy worker exists)."""
        return self._worker is not None

    @property
    def worker(self) -> CopyWorker | None:
        """The copy worker (after binding)."""
        return self._worker

    @property
    def layout(self) -> dict[str, Any] | None:
        """The bound, address-free layout."""
        return self._layout

    def in_flight(self) -> int:
        """Copies queued or running on this rank."""
        return 0 if self._worker is None else self._worker.in_flight()

    def room(self) -> int:
        """Copies this rank admits now (0 while unbound): what a hand-over
        may give it (:mod:`lmcache_rc.vllm.local`)."""
        return 0 if self._worker is None else self._worker.room()

    @property
    def saved_step(self) -> int:
        """Upstream mode: the step of the newest metadata whose forward ended here
        (its stores were submitted at ``wait_for_save``)."""
        return self._saved_step

    def is_unsafe(self) -> bool:
        """Whether the copy worker turned unsafe."""
        return bool(getattr(self._worker, "is_unsafe", False))

    def stats(self) -> tuple[dict[str, int], dict[str, float]]:
        """This rank's copies that ended and their cost per phase
        (:attr:`lmcache_rc.worker.CheckpointWorker.costs`), and the copies
        in flight."""
        costs = getattr(self._worker, "costs", None)
        counters = dict(costs) if costs is not None else {}
        return counters, {f"rank{self._rank}_copies_in_flight": float(self.in_flight())}

    # ------------------------------------------------------------------ binding

    def _start(self, layout: Mapping[str, Any], page_pool: Any) -> None:
        self._check_rank()
        if self._worker is not None:
            raise RuntimeError("this worker rank's page memory is already bound")
        self._worker = self._factory(
            self._options.socket,
            rank=self._rank,
            world_size=self._world_size,
            layout=dict(layout),
            page_pool=page_pool,
            workers=self._options.copy_workers,
            max_copies_in_flight=self._options.max_copies_per_rank,
            rpc_timeout=self._options.rpc_timeout,
            ledger=self._ledger,
        )
        self._layout = dict(layout)
        self._layout_reported = False

    def _check_rank(self) -> None:
        if not 0 <= self._rank < self._world_size:
            raise ValueError(f"worker rank {self._rank} is outside 0..{self._world_size - 1}")

    def bind_boundary_state(self, state: Any) -> None:
        """The fork's ``bind_boundary_checkpoint_state``: this rank's page pool
        and layout. Raises when the transport cannot serve (bad layout or
        pool, sidecar unreachable), as the fork requires."""
        self._check_rank()
        if self.bound:
            raise RuntimeError("bind_boundary_checkpoint_state was called twice")
        layout = dict(state.get_external_checkpoint_layout())
        page_bytes = layout.get("page_bytes")
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
            raise ValueError("the checkpoint layout must name a positive integer page_bytes")
        initialize = getattr(state, "initialize_external_checkpoint_layout", None)
        if initialize is not None:
            initialize(layout)  # binds hidden-state views before the first forward
        self.bind_boundary_pool(layout, state.get_external_checkpoint_page_pool())

    def bind_boundary_pool(self, layout: Mapping[str, Any], pool: Any) -> None:
        """Boundary mode: the fork's ``[num_blocks, page_bytes]`` page pool."""
        page_bytes = layout.get("page_bytes")
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
            raise ValueError("the checkpoint layout must name a positive integer page_bytes")
        self._start(layout, self._page_pool(pool, page_bytes))

    def bind_kv_caches(self, kv_caches: Mapping[str, Any], kv_cache_config: KVCacheConfig) -> None:
        """Upstream mode: the per-layer KV caches of ``register_kv_caches``."""
        from lmcache_rc.worker import PageRegions

        upstream = build_upstream_layout(kv_caches, kv_cache_config)
        self._cuda = any(bool(getattr(b, "is_cuda", False)) for b in upstream.buffers)
        regions = PageRegions(
            buffers=list(upstream.buffers),
            groups={group_name(g.index): list(g.regions) for g in upstream.groups},
            num_blocks=upstream.num_blocks,
        )
        self._start(upstream.layout, regions)
        self.upstream = upstream

    def _page_pool(self, pool: Any, page_bytes: int) -> Any:
        """A host pool as a numpy array; a CUDA tensor is passed on as is."""
        if getattr(pool, "is_cuda", False):
            self._cuda = True
            return pool
        arr = pool if isinstance(pool, np.ndarray) else np.asarray(pool)
        if arr.dtype != np.uint8 or arr.ndim != 2 or not arr.flags.c_contiguous:
            raise ValueError(
                "the checkpoint page pool must be a C-contiguous uint8 [num_blocks, page_bytes] "
                f"array, got {arr.dtype} with shape {arr.shape}"
            )
        if arr.shape[1] != page_bytes:
            raise ValueError(
                f"the checkpoint page pool rows have {arr.shape[1]} bytes, the layout "
                f"says page_bytes={page_bytes}"
            )
        return arr

    # ------------------------------------------------------------------ tasks

    def producer_event(self, task_id: str) -> int | None:
        """Records an event on the current stream so the copy follows queued GPU
        work; None for host memory (nothing is queued)."""
        if not self._cuda:
            return None
        torch = importlib.import_module("torch")
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        self._events[task_id] = event  # alive until the rank's result
        return int(event.cuda_event)

    def take(self, meta: Any) -> None:
        """Accept this step's tasks: restores (and, unless :attr:`stores_later`,
        stores) are submitted now; upstream stores wait for :meth:`wait_for_save`.
        A task id delivered twice raises :class:`lmcache_rc.worker.DuplicateTask`."""
        if not isinstance(meta, CheckpointConnectorMetadata) or not meta.tasks:
            return
        for task in meta.tasks:
            self._see(task)
            if task.request_id and task.direction == "RETRIEVE":
                self._loads[task.task_id] = task.request_id
            if self.stores_later and task.direction == "STORE" and not task.final:
                self._stores.append(task)  # written by this step's forward
                continue
            self._submit(task)

    def _see(self, task: CheckpointEngineTask) -> None:
        self._ledger.deliver(task.task_id)  # DuplicateTask on a second delivery

    def take_now(self, task: CheckpointEngineTask) -> None:
        """A store handed over by an idle or exiting engine (its bytes are final):
        submitted at once; its result is reported like any other."""
        self._see(task)
        self._submit(task)

    def submit_stores(self, step: int = 0) -> None:
        """Upstream mode, after the forward of ``step``: submit the stores taken this step."""
        stores, self._stores = self._stores, []
        for task in stores:
            self._submit(task)
        self._saved_step = max(self._saved_step, step)

    def _submit(self, task: CheckpointEngineTask) -> None:
        if self._worker is None:
            self._unbound.append(task.task_id)
            self._unsent[task.task_id] = False
            return
        if task.error:
            logger.warning(
                "checkpoint task %s not run on rank %s: %s", task.task_id, self._rank, task.error
            )
            self._unsent[task.task_id] = False
            return
        try:
            event = self.producer_event(task.task_id)
            self._worker.submit(task.task_id, task.manifest, task.direction, task.block_ids, event)
        except errors.UnsafeCopy:
            raise  # fatal: the engine must stop, not miss
        except Exception as e:
            logger.warning(
                "checkpoint task %s not submitted on rank %s: %s", task.task_id, self._rank, e
            )
            self._events.pop(task.task_id, None)
            self._unsent[task.task_id] = False

    def collect(self) -> dict[str, bool]:
        """Every task that ended since the last call, exactly once, with its result."""
        results = dict(self._unsent)
        self._unsent.clear()
        for task_id in results:  # never reached the engine: reported here, once
            self._ledger.report(task_id)
        if self._worker is not None:
            for task_id, ok in self._worker.collect().items():
                results[task_id] = bool(ok)
                self._events.pop(task_id, None)
        for task_id, ok in results.items():
            rid = self._loads.pop(task_id, None)
            if rid is not None:
                self._recv_done.add(rid)
                if not ok:
                    self._recv_failed.add(rid)
        return results

    def worker_meta(self) -> CheckpointWorkerMetadata | None:
        """This rank's layout (once) and its task results since the last call.

        Raises RuntimeError when tasks arrived but no page memory was ever bound.
        """
        results = dict(self._pending_results)
        self._pending_results.clear()
        results.update(self.collect())
        if self._worker is None and self._unbound:
            raise RuntimeError(
                "checkpoint tasks arrived but this worker's page memory was never bound "
                "(neither register_kv_caches nor bind_boundary_checkpoint_state gave it)"
            )
        layouts: dict[int, dict[str, Any]] = {}
        if not self._layout_reported and self._layout is not None:
            layouts[self._rank] = self._layout
            self._layout_reported = True
        if not layouts and not results:
            return None
        return CheckpointWorkerMetadata(
            layouts, {task_id: {self._rank: ok} for task_id, ok in results.items()}
        )

    def inject_fault(self, kind: str, count: int = 1, delay: float = 0.0) -> None:
        """Test hook: the next ``count`` copies on this rank ``"fail"`` (recoverable,
        reported False), turn ``"unsafe"``, or are held ``"delay"`` seconds."""
        if self._worker is None:
            raise RuntimeError("inject_fault needs bound page memory")
        engine = getattr(self._worker, "engine", None)
        if engine is None:
            raise RuntimeError("this copy worker has no fault hook")
        engine._inject_fault(kind, count, delay)

    def close(self) -> None:
        """Drain copies before anything is unmapped; raises ``UnsafeCopy`` when
        they cannot be proven stopped (the process must exit without unmapping)."""
        if self._worker is not None:
            self._worker.close(timeout=self._options.close_timeout or None)
            self._events.clear()


class UpstreamWorkerSide(WorkerSide):
    """Upstream mode's worker hooks: the per-layer KV caches of
    ``register_kv_caches``, stores submitted at ``wait_for_save`` (after the
    forward that wrote them), restores reported to vLLM as well."""

    stores_later = True

    def __init__(
        self,
        options: ConnectorOptions,
        *,
        rank: int,
        world_size: int,
        factory: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__(options, rank=rank, world_size=world_size, factory=factory)
        self._check_rank()

    def register_kv_caches(self, kv_caches: Mapping[str, Any], kv_cache_config: Any) -> bool:
        """Describe this rank's pages and start its copy worker; True."""
        if kv_cache_config is None:
            raise ValueError("upstream mode needs the KVCacheConfig vLLM passes to the connector")
        self.bind_kv_caches(kv_caches, kv_cache_config)
        return True

    def bind_boundary_state(self, state: Any) -> None:
        """Not the fork's mode: nothing to bind."""

    def wait_for_save(self, step: int) -> None:
        """The forward of ``step`` ended: submit the stores taken this step."""
        self.submit_stores(step)

    def transfer_results(self) -> TransferResults:
        """Upstream restores that ended (``finished_recving``; failures also in
        ``failed_recving``), each reported once; drained by the call."""
        self._pending_results.update(self.collect())
        done, failed = self._recv_done, self._recv_failed
        self._recv_done, self._recv_failed = set(), set()
        return TransferResults(done, failed)
