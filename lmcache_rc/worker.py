"""Worker-rank glue between a vLLM worker (or the simulated engine) and the
transfer engine.

One :class:`CheckpointWorker` per worker rank binds the rank's KV memory and
address-free byte layout, submits the scheduler's checkpoint tasks to an
``lmcache_rc.TransferEngine`` and reports exactly one boolean per task for
the worker metadata (docs/design/transfers.md#the-connectors-task-protocol):

* a task the engine refused (closing, unsafe, queue full) or that could not be
  submitted is reported ``False`` at the next :meth:`CheckpointWorker.collect`;
* a finished task is reported with its result (``True`` = this rank's pages
  were copied and its lease finished);
* a copy that may still be in flight raises :class:`~lmcache_rc.errors.UnsafeCopy`
  from :meth:`~CheckpointWorker.collect` and :meth:`~CheckpointWorker.close`:
  that is a fatal engine error, never a miss.

"Each task once" has one ledger per rank, :class:`TaskLedger`: the rank's
copy worker records every submission and every result it hands out in it,
and the connector's worker side (:mod:`lmcache_rc.vllm.worker`) shares the
same ledger to refuse a task delivered twice (even before page memory is
bound) and to record the results of tasks that never reached the engine.
Every refusal raises :class:`DuplicateTask`.

The worker keeps each task's future (and with it the engine's reference to
the page pool) until its result was collected, so the caller can release its
block pins exactly when the result is known.

KV memory comes in two forms: the boundary fork's contiguous
``[num_blocks, page_bytes]`` page pool, or :class:`PageRegions` for stock
vLLM's per-layer KV-cache tensors, where one block of one KV-cache group is
a set of byte regions (one or more per tensor).
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import warnings
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from . import _native
from .errors import CheckpointError, InvalidInput, UnsafeCopy

__all__ = [
    "DEFAULT_COPY_WORKERS",
    "DEFAULT_MAX_COPIES_IN_FLIGHT",
    "DEFAULT_RPC_TIMEOUT",
    "REMEMBERED_TASKS",
    "CheckpointWorker",
    "DuplicateTask",
    "PageRegions",
    "Region",
    "TaskLedger",
]

log = logging.getLogger(__name__)

DIRECTIONS = ("STORE", "RETRIEVE")

_ENGINE_DEFAULTS = _native.TransferEngine.defaults()
DEFAULT_COPY_WORKERS: int = int(_ENGINE_DEFAULTS["workers"])
"""Copy threads of a transfer engine by default (the core's ``EngineConfig``)."""
DEFAULT_MAX_COPIES_IN_FLIGHT: int = int(_ENGINE_DEFAULTS["max_copies_in_flight"])
"""Copies queued or running in a transfer engine by default (the core's ``EngineConfig``)."""
DEFAULT_RPC_TIMEOUT: float = float(_ENGINE_DEFAULTS["rpc_timeout"])
"""Seconds each lease call of a transfer engine waits by default (the core's ``EngineConfig``)."""

REMEMBERED_TASKS = 1 << 16
"""Task ids a :class:`TaskLedger` remembers to refuse a second delivery or
submission (the oldest are forgotten first)."""

# Page pools of workers that turned unsafe: a copy may still write into them,
# so they stay referenced until the process exits (see
# docs/design/transfers.md#the-unsafe-state-i5).
_KEPT_UNTIL_EXIT: list[Any] = []


Region = tuple[int, int, int, int]
"""One region template: ``(buffer, offset, block_stride, length)``."""


def _exact_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return value


@dataclass(frozen=True, eq=False)
class PageRegions:
    """KV memory made of several buffers, with pages made of byte regions.

    The page of group ``name`` at block ``b`` is the concatenation, in
    template order, of ``buffers[i][offset + b * block_stride:][:length]``
    for every template ``(i, offset, block_stride, length)`` in
    ``groups[name]``; manifest page groups are matched by name. This is how
    stock vLLM lays out a block of one KV-cache group: one or more regions
    per KV-cache tensor (K and V halves with a stride; attention and Mamba
    groups sharing a tensor). Block 0 is the null block and is never touched.

    ``buffers`` are all host memory — 1-D (or any C-contiguous) writable
    numpy ``uint8`` arrays or contiguous torch CPU tensors (any dtype; their
    bytes are used) — or all contiguous CUDA tensors on one device. They must
    not overlap: pass each KV-cache allocation once and describe shared bytes
    with templates. The transfer engine checks at bind time that every
    template stays inside its buffer for every block below ``num_blocks``.
    """

    buffers: Sequence[Any]
    groups: Mapping[str, Sequence[Sequence[int]]]
    num_blocks: int

    def __post_init__(self) -> None:
        buffers, groups = self.buffers, self.groups
        if isinstance(buffers, (str, bytes)) or not isinstance(buffers, Sequence) or not buffers:
            raise ValueError("buffers must be a non-empty sequence of arrays or tensors")
        if not isinstance(groups, Mapping) or not groups:
            raise ValueError("groups must be a non-empty mapping {name: [region, ...]}")
        _exact_int(self.num_blocks, "num_blocks")
        frozen: dict[str, tuple[Region, ...]] = {}
        for name, regions in groups.items():
            if not isinstance(name, str):
                raise ValueError(f"group names must be str, got {name!r}")
            out: list[Region] = []
            for region in regions:
                if len(region) != 4:
                    raise ValueError(
                        f"a region of group {name!r} must be (buffer, offset, block_stride, "
                        f"length), got {region!r}"
                    )
                b, o, s, n = (_exact_int(v, f"a region field of group {name!r}") for v in region)
                out.append((b, o, s, n))
            frozen[name] = tuple(out)
        # Frozen: store immutable copies, so the layout cannot change after
        # an engine was bound to it.
        object.__setattr__(self, "buffers", tuple(buffers))
        object.__setattr__(self, "groups", MappingProxyType(frozen))


class DuplicateTask(InvalidInput, RuntimeError):
    """A checkpoint task id reached one rank twice (delivered or submitted).

    Every task is submitted and reported exactly once per rank; a second
    delivery is a bug in the scheduler side, never a miss. Also a
    ``ValueError`` and a ``RuntimeError``.
    """


_DELIVERED, _STARTED, _REPORTED = 0, 1, 2


class TaskLedger:
    """The task ids one rank has seen: each is delivered, submitted and
    reported once.

    :meth:`deliver` records a task the rank received (the connector's worker
    side, before it knows whether the task can run); :meth:`start` records
    its submission to the transfer engine (a task never delivered counts as
    delivered now); :meth:`report` records that its result was handed out.
    Each raises :class:`DuplicateTask` for a second time. The last
    ``capacity`` ids are remembered. Thread-safe.
    """

    def __init__(self, capacity: int = REMEMBERED_TASKS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._capacity = capacity
        self._lock = threading.Lock()
        self._ids: OrderedDict[str, int] = OrderedDict()  # id -> _DELIVERED/_STARTED/_REPORTED

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)

    def __contains__(self, task_id: object) -> bool:
        with self._lock:
            return task_id in self._ids

    def _record(self, task_id: str, state: int) -> None:
        self._ids[task_id] = state
        if len(self._ids) > self._capacity:
            self._ids.popitem(last=False)

    def deliver(self, task_id: str) -> None:
        """The rank received ``task_id``; :class:`DuplicateTask` if it was seen before."""
        with self._lock:
            if task_id in self._ids:
                raise DuplicateTask(f"checkpoint task {task_id} was delivered twice on this rank")
            self._record(task_id, _DELIVERED)

    def start(self, task_id: str) -> None:
        """``task_id`` goes to the transfer engine; :class:`DuplicateTask` if it
        was submitted (or, undelivered, seen) before."""
        with self._lock:
            if self._ids.get(task_id, _DELIVERED) != _DELIVERED:
                raise DuplicateTask(f"checkpoint task {task_id} was already submitted on this rank")
            self._record(task_id, _STARTED)

    def report(self, task_id: str) -> None:
        """``task_id``'s result is handed out; :class:`DuplicateTask` if it was before."""
        with self._lock:
            if self._ids.get(task_id) == _REPORTED:
                raise DuplicateTask(f"checkpoint task {task_id} was reported twice on this rank")
            self._record(task_id, _REPORTED)


def _is_cuda_tensor(pool: object) -> bool:
    """Whether ``pool`` is a torch tensor on a CUDA device (torch not imported)."""
    return bool(getattr(pool, "is_cuda", False)) and hasattr(pool, "data_ptr")


def _is_torch_tensor(obj: object) -> bool:
    """Whether ``obj`` is a torch tensor (checked without importing torch)."""
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _tensor_buffer(t: Any, index: int) -> tuple[Any, int, int]:
    """``(tensor, data_ptr, nbytes)`` of a contiguous torch tensor."""
    if not t.is_contiguous():
        raise ValueError(f"buffer {index} (a torch tensor) must be contiguous")
    return (t, int(t.data_ptr()), int(t.numel()) * int(t.element_size()))


def _regions_engine(
    socket_path: str,
    regions: PageRegions,
    options: dict[str, Any],
) -> _native.TransferEngine:
    """A cpu- or cuda-backend engine over ``regions`` (by the buffers' device)."""
    groups = {name: list(r) for name, r in regions.groups.items()}
    cuda = [_is_cuda_tensor(b) for b in regions.buffers]
    if all(cuda):
        devices = {int(b.device.index or 0) for b in regions.buffers}
        if len(devices) != 1:
            raise ValueError(f"CUDA buffers must all be on one device, got devices {devices}")
        buffers = [_tensor_buffer(b, i) for i, b in enumerate(regions.buffers)]
        return _native.TransferEngine.cuda_regions(
            socket_path, buffers, groups, regions.num_blocks, device=devices.pop(), **options
        )
    if any(cuda):
        raise ValueError("buffers must be all host memory or all CUDA tensors, not a mix")
    host: list[np.ndarray[Any, Any] | tuple[Any, int, int]] = []
    for i, b in enumerate(regions.buffers):
        if isinstance(b, np.ndarray):
            if b.dtype != np.uint8:
                raise ValueError(f"buffer {i} must be a uint8 numpy array, got {b.dtype}")
            host.append(b)
        elif _is_torch_tensor(b):
            if str(b.device) != "cpu":
                raise ValueError(f"buffer {i} is a torch tensor on {b.device}, not the CPU")
            host.append(_tensor_buffer(b, i))
        else:
            raise ValueError(
                f"buffer {i} must be a numpy uint8 array or a torch tensor, got {type(b).__name__}"
            )
    return _native.TransferEngine.cpu_regions(
        socket_path, host, groups, regions.num_blocks, **options
    )


def _cuda_engine(
    socket_path: str,
    pool: Any,
    options: dict[str, Any],
) -> _native.TransferEngine:
    """A cuda-backend engine over a contiguous 2-D uint8 CUDA tensor."""
    if pool.dim() != 2 or str(pool.dtype) != "torch.uint8" or not pool.is_contiguous():
        raise ValueError(
            "a CUDA page pool must be a contiguous 2-D torch.uint8 tensor [num_blocks, page_bytes]"
        )
    num_blocks, page_bytes = (int(d) for d in pool.shape)
    return _native.TransferEngine.cuda(
        socket_path,
        int(pool.data_ptr()),
        num_blocks,
        page_bytes,
        device=int(pool.device.index or 0),
        **options,
    )


class CheckpointWorker:
    """Submits one worker rank's checkpoint copies and collects their results.

    ``page_pool`` is the rank's KV memory, either

    * a page pool ``[num_blocks, page_bytes]`` of ``uint8`` whose row 0 is the
      null page: a C-contiguous, writable numpy array (the cpu backend), or a
      contiguous CUDA tensor (the cuda backend: copies run on the GPU's DMA
      engines after the task's producer event); ``layout`` must then contain
      ``page_bytes`` equal to the pool's row width; or
    * :class:`PageRegions`: buffers (host arrays/tensors → cpu backend, CUDA
      tensors → cuda backend) and per-group region templates.

    The worker keeps a reference to the pool / every buffer. ``layout`` is
    the address-free layout descriptor; a manifest whose ``worker_layout``
    differs is refused before any lease. The engine connects to the sidecar
    at ``socket_path`` and maps its shared-memory pool at once, so a wrong
    socket fails here.

    ``workers``, ``max_copies_in_flight`` (copies queued or running; more are
    refused) and ``rpc_timeout`` default to the engine's defaults
    (:data:`DEFAULT_COPY_WORKERS`, ...); ``max_pending`` is the deprecated
    name of ``max_copies_in_flight`` (a ``DeprecationWarning``). ``ledger``
    is the rank's :class:`TaskLedger` when the caller shares one (the
    connector's worker side does); else the worker keeps its own.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        rank: int,
        world_size: int,
        layout: Mapping[str, Any],
        page_pool: Any,
        workers: int = DEFAULT_COPY_WORKERS,
        max_copies_in_flight: int | None = None,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
        ledger: TaskLedger | None = None,
        max_pending: int | None = None,
    ) -> None:
        if max_pending is not None:
            if max_copies_in_flight is not None:
                raise ValueError(
                    "max_pending is the deprecated name of max_copies_in_flight: give only "
                    "max_copies_in_flight"
                )
            warnings.warn(
                "CheckpointWorker: max_pending is deprecated, use max_copies_in_flight",
                DeprecationWarning,
                stacklevel=2,
            )
            max_copies_in_flight = max_pending
        if max_copies_in_flight is None:
            max_copies_in_flight = DEFAULT_MAX_COPIES_IN_FLIGHT
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
        if not isinstance(layout, Mapping):
            raise ValueError("layout must be a mapping")
        self.rank = rank
        self.world_size = world_size
        self._max_copies = int(max_copies_in_flight)
        self.layout: dict[str, Any] = copy.deepcopy(dict(layout))
        self._pool = page_pool
        socket = os.fspath(socket_path)
        options: dict[str, Any] = {
            "workers": workers,
            "max_copies_in_flight": max_copies_in_flight,
            "rpc_timeout": rpc_timeout,
            "layout": self.layout,
        }
        if isinstance(page_pool, PageRegions):
            self._engine = _regions_engine(socket, page_pool, options)
        else:
            if "page_bytes" not in layout:
                raise ValueError("layout must be a mapping that includes page_bytes")
            cuda = _is_cuda_tensor(page_pool)
            if not cuda and (not isinstance(page_pool, np.ndarray) or page_pool.ndim != 2):
                raise ValueError(
                    "page_pool must be a 2-D uint8 numpy array or CUDA tensor "
                    "[num_blocks, page_bytes], or PageRegions"
                )
            if layout["page_bytes"] != page_pool.shape[1]:
                raise ValueError(
                    f"layout page_bytes {layout['page_bytes']!r} differs from the page pool's "
                    f"row width {page_pool.shape[1]}"
                )
            if cuda:
                self._engine = _cuda_engine(socket, page_pool, options)
            else:
                self._engine = _native.TransferEngine(socket, page_pool, **options)
        self._lock = threading.Lock()
        self.ledger = TaskLedger() if ledger is None else ledger
        """Each task id once on this rank (shared with the caller's, if given)."""
        self._running: dict[str, _native.TransferFuture] = {}
        self._directions: dict[str, str] = {}
        self._rejected: list[str] = []
        self._closed = False
        self.costs: Counter[str] = Counter()
        """Copies that ended (``copies_store``, ``copies_restore``) and the
        microseconds they spent per phase (``copy_store_lease_us``, ...;
        :attr:`_native.TransferFuture.phases`): what copies cost this rank."""

    @property
    def engine(self) -> _native.TransferEngine:
        """The underlying transfer engine (for status and test hooks)."""
        return self._engine

    @property
    def is_unsafe(self) -> bool:
        """Whether a copy may be in flight (the worker refuses all new work)."""
        return self._engine.is_unsafe

    def submit(
        self,
        task_id: str,
        manifest: _native.Manifest,
        direction: str,
        block_ids: Sequence[Sequence[int]],
        producer_event: int | None = None,
    ) -> bool:
        """Submits one task; False when it was rejected (nothing started; the
        next :meth:`collect` reports it False).

        A task id submitted before raises :class:`DuplicateTask` (a
        ``ValueError``): every task is submitted and reported exactly once
        per rank (:attr:`ledger`). An argument the engine refuses (bad
        direction, rank, block ids) rejects only this task.
        """
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be 'STORE' or 'RETRIEVE', got {direction!r}")
        with self._lock:
            if task_id in self._running:
                raise DuplicateTask(f"checkpoint task {task_id} was already submitted on this rank")
            self.ledger.start(task_id)
            if self._closed:
                self._rejected.append(task_id)
                return False
        try:
            future = self._engine.submit(
                manifest, self.rank, direction, block_ids, producer_event=producer_event
            )
        except CheckpointError as e:  # refused with a reason: one line, no traceback
            log.warning("checkpoint task %s refused (%s); it is reported False", task_id, e)
            future = None
        except Exception:
            log.exception("submitting checkpoint task %s failed; it is reported False", task_id)
            future = None
        with self._lock:
            if future is None:
                self._rejected.append(task_id)
                return False
            self._running[task_id] = future
            self._directions[task_id] = "store" if direction == "STORE" else "restore"
        return True

    def collect(self) -> dict[str, bool]:
        """Results of the tasks that ended since the last call, each exactly once.

        Raises :class:`~lmcache_rc.errors.UnsafeCopy` when a copy may still be
        in flight; the engine must then terminate this worker process.
        """
        with self._lock:
            results = {task: False for task in self._rejected}
            self._rejected.clear()
            finished = [t for t, f in self._running.items() if f.done()]
            futures = [(t, self._running.pop(t), self._directions.pop(t, "")) for t in finished]
        unsafe: UnsafeCopy | None = None
        for task, future, direction in futures:
            self._count_phases(direction, future)
            try:
                results[task] = future.result()
            except UnsafeCopy as e:
                unsafe = unsafe or e
                results[task] = False
            except Exception:
                log.exception("checkpoint task %s failed; it is reported False", task)
                results[task] = False
            if future.outcome == "failed":
                log.warning("checkpoint task %s failed: %s", task, future.error)
        for task in results:
            self.ledger.report(task)  # each result once (DuplicateTask: a bug)
        if unsafe is not None:
            self._keep_pool_forever()
            raise unsafe
        return results

    def _count_phases(self, direction: str, future: _native.TransferFuture) -> None:
        """Adds an ended copy's phases to :attr:`costs` (waits excluded:
        ``queued`` and ``handoff`` are time in a queue, not work)."""
        try:
            phases = future.phases
        except Exception:  # a statistic never fails a collect
            return
        self.costs[f"copies_{direction}"] += 1
        for phase in ("check", "map", "lease", "plan", "copy", "finish"):
            self.costs[f"copy_{direction}_{phase}_us"] += int(phases.get(phase, 0))

    def _keep_pool_forever(self) -> None:
        """After ``UnsafeCopy``: the page pool must outlive any DMA into it."""
        if not any(p is self._pool for p in _KEPT_UNTIL_EXIT):
            _KEPT_UNTIL_EXIT.append(self._pool)

    def in_flight(self) -> int:
        """Tasks submitted whose result was not collected yet (rejected included)."""
        with self._lock:
            return len(self._running) + len(self._rejected)

    def room(self) -> int:
        """Copies the engine admits now: ``max_copies_in_flight`` less those
        queued or running (a finished one counts no more, collected or not)."""
        return max(0, self._max_copies - self._engine.in_flight)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Waits until the engine has no job in flight; False on timeout."""
        return self._engine.wait_idle(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stops admission and drains admitted copies (results stay
        collectable). Raises :class:`~lmcache_rc.errors.UnsafeCopy` when a copy
        may still be in flight or did not drain within ``timeout``."""
        with self._lock:
            self._closed = True
        try:
            self._engine.close(timeout)
        except UnsafeCopy:
            self._keep_pool_forever()
            raise

    def __enter__(self) -> CheckpointWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointWorker(rank={self.rank}, world_size={self.world_size}, "
            f"in_flight={self.in_flight()}, unsafe={self.is_unsafe})"
        )
