"""The vLLM connector: :class:`LMCacheRecurrentCheckpointConnector`.

Select it with ``kv_connector="LMCacheRecurrentCheckpointConnector"``,
``kv_connector_module_path="lmcache_rc.connector"`` and ``kv_role="kv_both"``;
options come from ``kv_connector_extra_config`` under the prefix ``lmcache_rc.``
(see :data:`OPTION_DEFAULTS` and ``docs/vllm.md``).

What it owns: the vLLM surface (``spec/vllm-boundary-api.md`` §1-§2): every
abstract method of vLLM's ``KVConnectorBase_V1`` and ``SupportsHMA`` and the
boundary-checkpoint hooks of the local-inference-lab fork. vLLM builds one
instance per worker rank (role WORKER) and one in the scheduler (role
SCHEDULER). The scheduler instance delegates to
:class:`lmcache_rc.scheduler.CheckpointSchedulerBridge`; a worker instance
binds the rank's page pool and layout and runs copies through
``lmcache_rc.worker.CheckpointWorker``.

What it must never do: import vLLM or torch unconditionally (both are
optional), claim ordinary chunk loads (``get_num_new_matched_tokens`` is
always ``(0, False)``), submit a task twice, or report a task twice per rank.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

import lmcache_rc as rc
from lmcache_rc import errors
from lmcache_rc.config import default_socket_path
from lmcache_rc.scheduler import (
    CheckpointConnectorMetadata,
    CheckpointSchedulerBridge,
    CheckpointWorkerMetadata,
    SidecarClient,
)
from lmcache_rc.vllm_api import (
    CheckpointEngineTask,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    worker_rank,
)

__all__ = [
    "OPTION_DEFAULTS",
    "OPTION_PREFIX",
    "PRECISION_ENV_VARS",
    "CheckpointConnectorMetadata",
    "CheckpointWorkerMetadata",
    "ConnectorOptions",
    "InvalidConnectorConfig",
    "LMCacheRecurrentCheckpointConnector",
    "checkpoint_identity",
    "parse_options",
]

logger = logging.getLogger(__name__)

OPTION_PREFIX = "lmcache_rc."
"""Prefix of every option of this connector in ``kv_connector_extra_config``."""

OPTION_DEFAULTS: Mapping[str, Any] = {
    "socket": None,  # None: lmcache_rc.config.default_socket_path()
    "checkpoint_identity": None,  # required
    "lookup_timeout": 60.0,
    "begin_timeout": 60.0,
    "rpc_timeout": 30.0,
    "connect_timeout": 10.0,
    "max_lookup_attempts": 4,
    "copy_workers": 2,
    "max_pending": 16,
    "chunk_tokens": 4096,
    "max_tasks": 64,
    "task_timeout": 300.0,
    "layout_timeout": 300.0,
    "close_timeout": 180.0,
}
"""Every option (without the ``lmcache_rc.`` prefix) and its default."""

PRECISION_ENV_VARS: tuple[str, ...] = (
    "VLLM_ATTENTION_BACKEND",
    "VLLM_BATCH_INVARIANT",
    "VLLM_USE_DEEP_GEMM",
    "VLLM_USE_FLASHINFER_SAMPLER",
    "VLLM_USE_FLASHINFER_MOE_FP4",
    "VLLM_USE_FLASHINFER_MOE_FP8",
    "VLLM_FLASHINFER_MOE_BACKEND",
    "VLLM_MXFP4_USE_MARLIN",
    "VLLM_USE_TRTLLM_ATTENTION",
    "VLLM_GLM53_VISION_MXFP8",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
)
"""Environment variables that change numerics; their values (unset: null) are
part of the checkpoint identity, so engines that compute differently never
share checkpoints."""

_REVISION = re.compile(r"(?:[0-9a-f]{40}|[0-9a-f]{64})")
_IDENTITY_KEYS = ("target_revision", "source_revision", "draft_revision")


class InvalidConnectorConfig(errors.InvalidInput):
    """An option in ``kv_connector_extra_config`` is missing, malformed or unknown.

    The message names the option (``lmcache_rc.<name>``). Also a ValueError.
    """


@dataclass(frozen=True)
class ConnectorOptions:
    """The parsed ``lmcache_rc.*`` options (defaults in :data:`OPTION_DEFAULTS`)."""

    socket: str
    target_revision: str
    source_revision: str
    draft_revision: str
    """Empty without speculative decoding."""
    lookup_timeout: float = 60.0
    begin_timeout: float = 60.0
    rpc_timeout: float = 30.0
    connect_timeout: float = 10.0
    max_lookup_attempts: int = 4
    copy_workers: int = 2
    max_pending: int = 16
    chunk_tokens: int = 4096
    max_tasks: int = 64
    task_timeout: float = 300.0
    """0 disables the restore task timeout."""
    layout_timeout: float = 300.0
    """0 waits for the worker layouts forever."""
    close_timeout: float = 180.0
    """How long a worker's shutdown waits for its copies to drain before it
    raises ``UnsafeCopy`` (the process must then exit); 0 waits forever."""


def _bad(name: str, why: str) -> InvalidConnectorConfig:
    return InvalidConnectorConfig(f"kv_connector_extra_config option {OPTION_PREFIX}{name} {why}")


def _number(name: str, value: Any, *, zero_ok: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, f"must be a number of seconds, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
        raise _bad(name, f"must be a positive number of seconds, got {value!r}")
    return v


def _integer(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise _bad(name, f"must be in {low}..{high}, got {value}")
    return value


def _identity(value: Any, speculative: bool) -> tuple[str, str, str]:
    name = "checkpoint_identity"
    if value is None:
        raise _bad(
            name,
            "is required: a mapping with the immutable target_revision and source_revision "
            "(and draft_revision with speculative decoding), each 40 or 64 lowercase hex digits",
        )
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _bad(name, f"is not valid JSON: {e}") from e
    if not isinstance(value, Mapping):
        raise _bad(name, f"must be a mapping, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in _IDENTITY_KEYS)
    if unknown:
        raise _bad(name, f"has unknown keys {unknown} (allowed: {list(_IDENTITY_KEYS)})")
    revisions: dict[str, str] = {}
    for key in _IDENTITY_KEYS:
        rev = value.get(key)
        if rev in (None, ""):
            if key == "draft_revision" and not speculative:
                revisions[key] = ""
                continue
            why = " (speculative decoding is configured)" if key == "draft_revision" else ""
            raise _bad(f"{name}.{key}", f"is required{why}")
        if not isinstance(rev, str) or not _REVISION.fullmatch(rev):
            raise _bad(
                f"{name}.{key}",
                f"must be an immutable revision (40 or 64 lowercase hex digits), got {rev!r}; "
                "branch or tag names such as 'main' can change content",
            )
        revisions[key] = rev
    # Without speculation the draft has no state in a bundle: it is not identity.
    draft = revisions["draft_revision"] if speculative else ""
    return revisions["target_revision"], revisions["source_revision"], draft


def parse_options(extra_config: Mapping[str, Any] | None, *, speculative: bool) -> ConnectorOptions:
    """Validates the ``lmcache_rc.*`` entries of ``kv_connector_extra_config``.

    Keys without the prefix belong to other connectors and are ignored;
    unknown ``lmcache_rc.*`` keys are refused (a typo must not silently fall
    back to a default). Raises :class:`InvalidConnectorConfig` naming the
    option.
    """
    extra = dict(extra_config or {})
    values: dict[str, Any] = {}
    for key, value in extra.items():
        if not isinstance(key, str) or not key.startswith(OPTION_PREFIX):
            continue
        name = key[len(OPTION_PREFIX) :]
        if name not in OPTION_DEFAULTS:
            raise InvalidConnectorConfig(
                f"unknown kv_connector_extra_config option {key!r} "
                f"(known: {', '.join(OPTION_PREFIX + k for k in OPTION_DEFAULTS)})"
            )
        values[name] = value
    socket = values.get("socket")
    if socket is None:
        socket = default_socket_path()
    elif not isinstance(socket, str | os.PathLike) or not str(socket):
        raise _bad("socket", f"must be a non-empty path, got {socket!r}")
    target, source, draft = _identity(values.get("checkpoint_identity"), speculative)

    def get(name: str) -> Any:
        return values.get(name, OPTION_DEFAULTS[name])

    opts = ConnectorOptions(
        socket=os.fspath(socket),
        target_revision=target,
        source_revision=source,
        draft_revision=draft,
        lookup_timeout=_number("lookup_timeout", get("lookup_timeout")),
        begin_timeout=_number("begin_timeout", get("begin_timeout")),
        rpc_timeout=_number("rpc_timeout", get("rpc_timeout")),
        connect_timeout=_number("connect_timeout", get("connect_timeout")),
        max_lookup_attempts=_integer("max_lookup_attempts", get("max_lookup_attempts"), 1, 64),
        copy_workers=_integer("copy_workers", get("copy_workers"), 1, 64),
        max_pending=_integer("max_pending", get("max_pending"), 1, 4096),
        chunk_tokens=_integer("chunk_tokens", get("chunk_tokens"), 1, 65536),
        max_tasks=_integer("max_tasks", get("max_tasks"), 1, 65536),
        task_timeout=_number("task_timeout", get("task_timeout"), zero_ok=True),
        layout_timeout=_number("layout_timeout", get("layout_timeout"), zero_ok=True),
        close_timeout=_number("close_timeout", get("close_timeout"), zero_ok=True),
    )
    if opts.max_pending < opts.copy_workers:
        raise _bad(
            "max_pending",
            f"({opts.max_pending}) must be at least lmcache_rc.copy_workers ({opts.copy_workers})",
        )
    return opts


def _is_speculative(vllm_config: Any) -> bool:
    return getattr(vllm_config, "speculative_config", None) is not None


def _extra_config(vllm_config: Any) -> Mapping[str, Any]:
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None:
        raise ValueError("kv_transfer_config must be set for LMCacheRecurrentCheckpointConnector")
    extra = getattr(kv, "kv_connector_extra_config", None) or {}
    if not isinstance(extra, Mapping):
        raise InvalidConnectorConfig("kv_connector_extra_config must be a mapping")
    return extra


def checkpoint_identity(vllm_config: Any, options: ConnectorOptions) -> dict[str, Any]:
    """The namespace identity of this engine, without the worker layout.

    Revisions, runtime and model config hashes, the precision environment and
    the parallel geometry (identity-and-index §1.3); the scheduler bridge adds
    ``layout`` once every rank reported the same one, and the request's cache
    salt goes into :func:`lmcache_rc.checkpoint_namespace` separately.
    """
    pc = vllm_config.parallel_config
    return {
        "target_revision": options.target_revision,
        "source_revision": options.source_revision,
        "draft_revision": options.draft_revision,
        "runtime_config_hash": str(vllm_config.compute_hash()),
        "model_config_hash": str(vllm_config.model_config.compute_hash()),
        "precision_environment": {name: os.environ.get(name) for name in PRECISION_ENV_VARS},
        "parallel": {
            "tp": int(getattr(pc, "tensor_parallel_size", 1)),
            "dcp": int(getattr(pc, "decode_context_parallel_size", 1) or 1),
            "cp_interleave": int(getattr(pc, "cp_kv_cache_interleave_size", 1) or 1),
        },
    }


def _is_role(role: Any, name: str) -> bool:
    return role == getattr(KVConnectorRole, name) or getattr(role, "name", None) == name


class _CopyWorker(Protocol):
    """The part of ``lmcache_rc.worker.CheckpointWorker`` the connector uses."""

    def submit(
        self,
        task_id: str,
        manifest: rc.Manifest,
        direction: str,
        block_ids: Sequence[Sequence[int]],
        producer_event: int | None = None,
    ) -> bool: ...

    def collect(self) -> dict[str, bool]: ...

    def in_flight(self) -> int: ...

    def close(self, timeout: float | None = None) -> None: ...


def _default_worker_factory(socket_path: str, **kwargs: Any) -> _CopyWorker:
    # Imported here: the worker module (and its copy backends) are needed only
    # in worker processes that actually bind a page pool.
    module = importlib.import_module("lmcache_rc.worker")
    worker: _CopyWorker = module.CheckpointWorker(socket_path, **kwargs)
    return worker


def _default_client_factory(socket_path: str, rpc_timeout: float, connect_timeout: float) -> Any:
    return rc.Client(socket_path, timeout=rpc_timeout, connect_timeout=connect_timeout)


_SEEN_TASKS = 1 << 16


class LMCacheRecurrentCheckpointConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Stores and restores boundary checkpoints of hybrid models through the
    lmcache-rc sidecar (one instance per worker rank plus one in the scheduler).

    Test seams (class or instance attributes, set before the bind hooks):
    ``client_factory(socket, rpc_timeout, connect_timeout)`` builds the
    scheduler's sidecar client, ``worker_factory(socket, **kwargs)`` a rank's
    copy worker, and ``clock`` is the monotonic clock of every timeout.
    """

    client_factory: ClassVar[Callable[[str, float, float], Any] | None] = None
    worker_factory: ClassVar[Callable[..., Any] | None] = None
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._options = parse_options(
            _extra_config(vllm_config), speculative=_is_speculative(vllm_config)
        )
        self._world_size = int(getattr(vllm_config.parallel_config, "world_size", 1) or 1)
        self._is_scheduler = _is_role(role, "SCHEDULER")
        # scheduler side
        self._block_pool: Any = None
        self._bridge: CheckpointSchedulerBridge | None = None
        self._client: SidecarClient | None = None
        # worker side
        self._rank: int | None = None
        self._worker: _CopyWorker | None = None
        self._layout: dict[str, Any] | None = None
        self._layout_reported = False
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._unsent: dict[str, bool] = {}
        self._unbound_tasks: list[str] = []
        self._events: dict[str, Any] = {}
        self._cuda_pool = False

    # ------------------------------------------------------------------ configuration

    @classmethod
    def supports_request_boundary_checkpoints(cls, vllm_config: Any) -> bool:
        """Whether this configuration can store/restore complete bundles.

        A pure function of the config: True only when ``lmcache_rc.*`` options
        parse and the checkpoint identity names immutable revisions (40 or 64
        lowercase hex; ``draft_revision`` too with speculative decoding). Any
        problem is logged and answers False, which makes vLLM run without
        boundary checkpoints.
        """
        try:
            parse_options(_extra_config(vllm_config), speculative=_is_speculative(vllm_config))
        except (ValueError, TypeError, AttributeError) as e:
            logger.warning("lmcache-rc boundary checkpoints disabled: %s", e)
            return False
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """No requirement (the fork's own checks demand block-outermost storage)."""
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """False: no layer-by-layer hooks run inside CUDA graphs."""
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any | None:
        """No vLLM-side transfer statistics (see :meth:`report_status`)."""
        return None

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any | None:
        """None: the sidecar exports the metrics (``GET /metrics``)."""
        return None

    @property
    def options(self) -> ConnectorOptions:
        """The parsed options."""
        return self._options

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """False: pages are addressed through the fork's page pool."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a dropped checkpoint export is a future miss, never lost output."""
        return False

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """False: the ordinary local lookup is used unchanged."""
        return False

    @property
    def bridge(self) -> CheckpointSchedulerBridge | None:
        """The scheduler bridge (scheduler role, after the cache was bound)."""
        return self._bridge

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Nothing to register: pages are reached through the boundary page pool."""

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        """Not used (``prefer_cross_layer_blocks`` is False)."""

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        """Not used: copies run in the lmcache-rc transfer engine."""

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Nothing to do: copies only touch pinned, immutable bundles."""

    def bind_boundary_checkpoint_state(self, state: Any) -> None:
        """Fork hook (worker): bind this rank's page pool and layout, start the copy worker.

        Raises when the transport cannot serve (bad layout or pool, sidecar
        unreachable), as the fork requires.
        """
        if self._worker is not None:
            raise RuntimeError("bind_boundary_checkpoint_state was called twice")
        rank = worker_rank(self._vllm_config)
        if not 0 <= rank < self._world_size:
            raise ValueError(f"worker rank {rank} is outside 0..{self._world_size - 1}")
        layout = dict(state.get_external_checkpoint_layout())
        page_bytes = layout.get("page_bytes")
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
            raise ValueError("the checkpoint layout must name a positive integer page_bytes")
        initialize = getattr(state, "initialize_external_checkpoint_layout", None)
        if initialize is not None:
            initialize(layout)  # binds hidden-state views before the first forward
        pool = self._page_pool(state.get_external_checkpoint_page_pool(), page_bytes)
        factory = type(self).worker_factory or _default_worker_factory
        self._worker = factory(
            self._options.socket,
            rank=rank,
            world_size=self._world_size,
            layout=layout,
            page_pool=pool,
            workers=self._options.copy_workers,
            max_pending=self._options.max_pending,
            rpc_timeout=self._options.rpc_timeout,
        )
        self._rank = rank
        self._layout = layout
        self._layout_reported = False

    def _page_pool(self, pool: Any, page_bytes: int) -> Any:
        """A host pool as a numpy array; a CUDA tensor is passed to the worker as is."""
        if getattr(pool, "is_cuda", False):
            self._cuda_pool = True
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

    def _producer_event(self, task: CheckpointEngineTask) -> int | None:
        """Records an event on the current stream so the copy follows queued GPU
        work; None for host pools (nothing is queued)."""
        if not self._cuda_pool:
            return None
        torch = importlib.import_module("torch")
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        self._events[task.task_id] = event  # alive until the rank's result
        return int(event.cuda_event)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Submits this step's tasks to the rank's copy worker, each exactly once.

        A failure creating the event or submitting marks only that task failed
        (reported False); the other tasks are still submitted. A task id seen
        twice is a RuntimeError.
        """
        meta = self._connector_metadata
        if not isinstance(meta, CheckpointConnectorMetadata) or not meta.tasks:
            return
        for task in meta.tasks:
            if task.task_id in self._seen:
                raise RuntimeError(f"checkpoint task {task.task_id} was delivered twice")
            self._seen[task.task_id] = None
            if len(self._seen) > _SEEN_TASKS:
                self._seen.popitem(last=False)
            if self._worker is None:
                self._unbound_tasks.append(task.task_id)
                continue
            try:
                event = self._producer_event(task)
                self._worker.submit(
                    task.task_id, task.manifest, task.direction, task.block_ids, event
                )
            except errors.UnsafeCopy:
                raise  # fatal: the engine must stop, not miss
            except Exception as e:
                self._task_not_sent(task, e)

    def _task_not_sent(self, task: CheckpointEngineTask, error: BaseException) -> None:
        logger.warning(
            "checkpoint task %s not submitted on rank %s: %s", task.task_id, self._rank, error
        )
        self._events.pop(task.task_id, None)
        self._unsent[task.task_id] = False

    def wait_for_layer_load(self, layer_name: str) -> None:
        """No-op: imports land in private pages no live request reads."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """No-op: only committed bundles are exported."""

    def wait_for_save(self) -> None:
        """No-op: exports read pinned pages after a producer event."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(None, None)``: request blocks never wait for this connector."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Empty: a failed import is discarded whole, never partially loaded."""
        return set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This rank's layout (once) and its results since the last step.

        Raises RuntimeError ("bound") when tasks arrived but the rank was never
        bound, and ``errors.UnsafeCopy`` when a copy may still be in flight.
        """
        if self._worker is None or self._rank is None:
            if self._unbound_tasks:
                raise RuntimeError(
                    "checkpoint tasks arrived but this worker's rank was never bound "
                    "(bind_boundary_checkpoint_state did not run)"
                )
            return None
        rank = self._rank
        results: dict[str, dict[int, bool]] = {t: {rank: ok} for t, ok in self._unsent.items()}
        self._unsent.clear()
        for task_id, ok in self._worker.collect().items():
            results[task_id] = {rank: bool(ok)}
            self._events.pop(task_id, None)
        layouts: dict[int, dict[str, Any]] = {}
        if not self._layout_reported and self._layout is not None:
            layouts[rank] = self._layout
            self._layout_reported = True
        if not layouts and not results:
            return None
        return CheckpointWorkerMetadata(layouts, results)

    # ------------------------------------------------------------------ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Keeps the block pool (for status only)."""
        self._block_pool = gpu_block_pool

    def bind_boundary_checkpoint_cache(self, manager: Any) -> None:
        """Fork hook (scheduler): take the allocator and connect to the sidecar."""
        if self._bridge is not None:
            raise RuntimeError("bind_boundary_checkpoint_cache was called twice")
        o = self._options
        factory = type(self).client_factory or _default_client_factory
        try:
            client = factory(o.socket, o.rpc_timeout, o.connect_timeout)
        except errors.CheckpointError as e:
            raise errors.Unavailable(
                f"cannot reach the lmcache-rc sidecar at {o.socket} "
                f"(option {OPTION_PREFIX}socket): {e}; start it with "
                f"`lmcache-rc serve --socket {o.socket}`"
            ) from e
        self._client = client
        self._bridge = CheckpointSchedulerBridge(
            client,
            manager,
            identity=checkpoint_identity(self._vllm_config, o),
            world_size=self._world_size,
            chunk_tokens=o.chunk_tokens,
            lookup_timeout=o.lookup_timeout,
            begin_timeout=o.begin_timeout,
            max_lookup_attempts=o.max_lookup_attempts,
            max_tasks=o.max_tasks,
            max_in_flight=o.max_pending,
            task_timeout=o.task_timeout or None,
            layout_timeout=o.layout_timeout or None,
            clock=self.clock,
        )

    def poll_boundary_checkpoint(self, request: Any) -> bool:
        """False parks ``request`` this step (lookup or import pending)."""
        return True if self._bridge is None else self._bridge.poll(request)

    def boundary_checkpoint_external_tokens(self, request: Any) -> int:
        """Tokens of the local hit that an import published for this request."""
        return 0 if self._bridge is None else self._bridge.external_tokens(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """``(0, False)``: imports are published into the local cache instead."""
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Marks a published import as admitted (nothing is loaded here)."""
        if self._bridge is not None:
            self._bridge.on_allocated(request)

    def store_boundary_checkpoint(self, request: Any, checkpoint: Any) -> None:
        """Fork hook: export a committed local checkpoint (may skip silently)."""
        if self._bridge is not None:
            self._bridge.store(request, checkpoint)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's new copy tasks, each emitted exactly once."""
        if self._bridge is None:
            return CheckpointConnectorMetadata()
        return self._bridge.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Rank layouts and results: negotiate, publish, discard, release."""
        if self._bridge is not None:
            self._bridge.update(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Single-group form of :meth:`request_finished_all_groups`."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Cancel the request's lookup; copies keep their own pins. ``(False, None)``."""
        if self._bridge is None:
            return False, None
        return self._bridge.request_finished(request)

    def has_pending_push_work(self) -> bool:
        """True while layouts are negotiated or copy tasks are outstanding."""
        return self._bridge is not None and self._bridge.has_pending_work()

    def take_events(self) -> Iterable[Any]:
        """No KV events."""
        return ()

    def get_kv_connector_stats(self) -> Any | None:
        """No vLLM stats object (see :meth:`report_status`)."""
        return None

    def get_kv_connector_kv_cache_events(self) -> Any | None:
        """No KV cache events."""
        return None

    def get_handshake_metadata(self) -> Any | None:
        """No handshake."""
        return None

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """No handshake."""

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """No handshake."""

    def get_finished_count(self) -> int | None:
        """None: the default (world size)."""
        return None

    def reset_cache(self) -> bool | None:
        """None: the sidecar is shared; clear it with ``lmcache-rc clear``."""
        return None

    # ------------------------------------------------------------------ both

    def report_status(self) -> dict[str, Any]:
        """The connector's state: the bridge's report (scheduler) or the rank's."""
        base: dict[str, Any] = {
            "role": "scheduler" if self._is_scheduler else "worker",
            "socket": self._options.socket,
            "options": asdict(self._options),
        }
        if self._is_scheduler:
            base["bound"] = self._bridge is not None
            if self._bridge is not None:
                base.update(self._bridge.report_status())
            return base
        base.update(
            rank=self._rank,
            bound=self._worker is not None,
            in_flight=0 if self._worker is None else self._worker.in_flight(),
            unsafe=bool(getattr(self._worker, "is_unsafe", False)),
        )
        return base

    def _repr_html_(self) -> str:
        if self._bridge is not None:
            return self._bridge._repr_html_()
        return f"<pre>{json.dumps(self.report_status(), indent=1, default=str)}</pre>"

    def shutdown(self) -> None:
        """Drain copies before anything is unmapped; stop the bridge.

        A worker whose copies cannot be proven stopped raises
        ``errors.UnsafeCopy``: the process must exit without unmapping.
        """
        if self._bridge is not None:
            self._bridge.close()
        if self._client is not None:
            client, self._client = self._client, None
            client.close()
        if self._worker is not None:
            worker = self._worker
            worker.close(timeout=self._options.close_timeout or None)
            self._events.clear()
