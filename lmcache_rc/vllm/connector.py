"""The vLLM connector: :class:`LMCacheRecurrentCheckpointConnector` (role and mode dispatch).

Select it with ``kv_connector="LMCacheRecurrentCheckpointConnector"``,
``kv_connector_module_path="lmcache_rc.connector"`` and ``kv_role="kv_both"``;
options come from ``kv_connector_extra_config`` under the prefix ``lmcache_rc.``
(:mod:`lmcache_rc.vllm.options`, ``docs/vllm.md``).

What it owns: the vLLM surface — every abstract method of vLLM's
``KVConnectorBase_V1`` and ``SupportsHMA`` plus the fork's boundary hooks —
and the choice of mode (``lmcache_rc.vllm_api``):

* ``upstream``: stock vLLM 0.33 (:mod:`lmcache_rc.vllm.upstream`, pages as
  regions of the per-layer KV caches);
* ``boundary``: the local-inference-lab fork's request-boundary checkpoints
  (:mod:`lmcache_rc.vllm.boundary`);
* ``auto`` (default): boundary when the installed vLLM is the fork, else
  upstream when it offers the 0.33 hooks, else the connector disables
  itself with one log line saying why.

vLLM builds one instance per worker rank (role WORKER) and one in the
scheduler (role SCHEDULER). Each instance holds two side objects and
delegates every hook to them without asking the mode again: a scheduler
side (:class:`lmcache_rc.vllm.common.SchedulerSide`; the mode's
:class:`~lmcache_rc.vllm.upstream.UpstreamScheduler` or
:class:`~lmcache_rc.vllm.boundary.CheckpointSchedulerBridge`, chosen once
when vLLM binds its cache) and a worker side
(:class:`lmcache_rc.vllm.worker.WorkerHooks`; the mode's
:class:`~lmcache_rc.vllm.worker.WorkerSide` or
:class:`~lmcache_rc.vllm.worker.UpstreamWorkerSide`, chosen when the rank's
connector is built). Until then, in the other role and when disabled, a side
is the base class, whose every hook answers "nothing to do".

What it must never do: import vLLM or torch unconditionally (both are
optional), hold logic of its own beyond choosing the sides and delegating,
or let a mode mismatch between processes pass silently (rank layouts carry
the mode's format).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict
from typing import Any, ClassVar, ParamSpec, TypeVar

from lmcache_rc import errors
from lmcache_rc.vllm.api import (
    VLLM_AVAILABLE,
    BlockPool,
    KVCacheBlocks,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    Request,
    RouterHasher,
    SchedulerOutput,
    SupportsHMA,
    UpstreamKVCacheManager,
    has_boundary_api,
    has_upstream_api,
    kv_events_enabled,
    spec_kind,
    worker_rank,
)
from lmcache_rc.vllm.boundary import CheckpointSchedulerBridge
from lmcache_rc.vllm.common import DisableConnector, SchedulerSide
from lmcache_rc.vllm.identity import checkpoint_identity
from lmcache_rc.vllm.local import LocalEngine, forget, local_engine
from lmcache_rc.vllm.metadata import CheckpointConnectorMetadata
from lmcache_rc.vllm.options import (
    OPTION_PREFIX,
    ConnectorOptions,
    InvalidConnectorConfig,
    extra_config,
    is_speculative,
    parse_options,
)
from lmcache_rc.vllm.restore_cost import SkipRule
from lmcache_rc.vllm.sidecar import SidecarClient, connect
from lmcache_rc.vllm.stats import CheckpointConnectorStats, CheckpointPromMetrics, StatsFeed
from lmcache_rc.vllm.support import refusal
from lmcache_rc.vllm.upstream import UpstreamScheduler
from lmcache_rc.vllm.worker import UpstreamWorkerSide, WorkerHooks, WorkerSide

__all__ = ["LMCacheRecurrentCheckpointConnector", "resolve_mode", "upstream_problems"]

logger = logging.getLogger(__name__)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _serialized(
    method: Callable[_P, _R],
) -> Callable[_P, _R]:
    """An entry point vLLM calls: one at a time with the other entry points of
    the same engine in this process and with its idle hand-over thread
    (:mod:`lmcache_rc.vllm.local`); a plain call when no local engine is
    joined. The time it takes is added to the connector's ``hook_<name>_us``
    counter (what the connector costs vLLM's threads)."""
    key = f"hook_{method.__name__}_us"

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        started = time.perf_counter_ns()
        try:
            local: LocalEngine | None = getattr(args[0], "_local", None)
            if local is None:
                return method(*args, **kwargs)
            with local.call():
                return method(*args, **kwargs)
        finally:
            costs: Counter[str] | None = getattr(args[0], "_hook_ns", None)
            if costs is not None:
                costs[key] += time.perf_counter_ns() - started

    return wrapper


def _is_role(role: Any, name: str) -> bool:
    return role == getattr(KVConnectorRole, name) or getattr(role, "name", None) == name


def resolve_mode(option: str) -> str | None:
    """``"boundary"``, ``"upstream"``, or None (disabled / not decidable yet).

    ``auto`` without an importable vLLM stays None until a fork hook is called
    (the simulated engine of :mod:`lmcache_rc.testing` plays the fork).
    """
    if option != "auto":
        return option
    if has_boundary_api():
        return "boundary"
    if has_upstream_api():
        return "upstream"
    return None


def upstream_problems(vllm_config: Any, kv_cache_config: Any | None) -> list[str]:
    """Every unmet prerequisite of upstream mode, each with the fix."""
    problems: list[str] = []
    kv = vllm_config.kv_transfer_config
    if getattr(kv, "kv_role", "kv_both") != "kv_both":
        problems.append(f'kv_role is {kv.kv_role!r}: set "kv_role": "kv_both"')
    policy = getattr(kv, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        problems.append(
            f'kv_load_failure_policy is {policy!r}: set "kv_load_failure_policy": '
            '"recompute" so a failed restore recomputes instead of failing the request'
        )
    cache = getattr(vllm_config, "cache_config", None)
    if cache is not None and not getattr(cache, "enable_prefix_caching", True):
        problems.append("prefix caching is off: start vLLM with --enable-prefix-caching")
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    kinds = [spec_kind(g.kv_cache_spec) for g in groups]
    for i, (kind, group) in enumerate(zip(kinds, groups, strict=True)):
        if kind is None:
            problems.append(
                f"KV-cache group {i} is {type(group.kv_cache_spec).__name__}: only full "
                "attention and recurrent (Mamba/GDN/KDA) groups can be checkpointed"
            )
    if "recurrent" in kinds:
        mode = getattr(cache, "mamba_cache_mode", "align")
        if mode != "align":
            problems.append(
                f"mamba_cache_mode is {mode!r}: start vLLM with --mamba-cache-mode align"
            )
        pc = vllm_config.parallel_config
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if int(getattr(pc, name, 1) or 1) != 1:
                problems.append(f"{name} is {getattr(pc, name)}: recurrent models need 1")
        if getattr(cache, "use_replayssm", False):
            problems.append("ReplaySSM is on: vLLM refuses it with a KV connector")
    pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    if pp != 1:
        problems.append(
            f"pipeline_parallel_size is {pp}: upstream mode supports tensor parallelism only "
            "(each pipeline stage holds other layers)"
        )
    return problems


class LMCacheRecurrentCheckpointConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """Stores and restores complete hybrid-model checkpoints through the
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
            extra_config(vllm_config), speculative=is_speculative(vllm_config)
        )
        self._world_size = int(getattr(vllm_config.parallel_config, "world_size", 1) or 1)
        self._is_scheduler = _is_role(role, "SCHEDULER")
        self._kv_config = kv_cache_config
        self._mode = resolve_mode(self._options.vllm_api)
        self._disabled = ""
        self._block_pool: Any = None
        self._client: SidecarClient | None = None
        self._local: LocalEngine | None = None
        # The two sides every hook delegates to, chosen once: the scheduler's
        # when vLLM binds its cache (bind_kv_cache_manager,
        # bind_boundary_checkpoint_cache), a rank's here. Until then, and when
        # disabled, each is the side with nothing to do.
        self._stats_feed = StatsFeed()
        self._stats_failed = False
        self._hook_ns: Counter[str] = Counter()
        self._scheduler: SchedulerSide = SchedulerSide()
        self._worker_side: WorkerHooks = WorkerHooks()
        if self._mode is None and VLLM_AVAILABLE:
            self._disable(
                "the installed vLLM offers neither the fork's boundary checkpoints nor "
                "stock vLLM 0.33's connector hooks (KVConnectorBlockState)"
            )
        refused = refusal(vllm_config) if VLLM_AVAILABLE else None
        if refused is not None:
            # one line per engine: the scheduler says it, the ranks stay quiet
            self._disable(refused, log=self._is_scheduler)
        if not self._is_scheduler and not self._disabled:
            # boundary mode, and auto until the fork's hook, bind the fork's pool
            side = UpstreamWorkerSide if self._mode == "upstream" else WorkerSide
            self._worker_side = side(
                self._options,
                rank=worker_rank(vllm_config),
                world_size=self._world_size,
                factory=type(self).worker_factory,
            )
        if self._mode == "upstream" and self._is_scheduler and not self._disabled:
            problems = upstream_problems(vllm_config, kv_cache_config)
            if problems:
                raise InvalidConnectorConfig(
                    "lmcache-rc cannot run on this vLLM configuration (upstream mode):\n  - "
                    + "\n  - ".join(problems)
                )
            sched = getattr(vllm_config, "scheduler_config", None)
            if self._options.store_response and getattr(sched, "async_scheduling", False):
                logger.warning(
                    "lmcache-rc: vLLM's async scheduling is on, so the state at the end of a "
                    "request is not stored (a forward past its end may still be running); "
                    "each turn restores up to its previous prompt instead. Start vLLM with "
                    "--no-async-scheduling to store response states."
                )

    def _disable(self, why: str, *, log: bool = True) -> None:
        if not self._disabled:
            self._disabled = why
            if log:
                logger.warning("lmcache-rc connector disabled: %s", why)

    # ------------------------------------------------------------------ configuration

    @classmethod
    def supports_request_boundary_checkpoints(cls, vllm_config: Any) -> bool:
        """Fork hook: whether this configuration can store/restore complete bundles.

        True only when ``lmcache_rc.*`` options parse and the checkpoint
        identity names immutable revisions (or ``"auto"``); any problem is
        logged and answers False, which makes the fork run without boundary
        checkpoints.
        """
        try:
            options = parse_options(
                extra_config(vllm_config), speculative=is_speculative(vllm_config)
            )
        except (ValueError, TypeError, AttributeError) as e:
            logger.warning("lmcache-rc boundary checkpoints disabled: %s", e)
            return False
        return options.vllm_api in ("auto", "boundary")

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """No requirement: upstream mode describes any layout by its strides."""
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """False: no layer-by-layer hooks run inside CUDA graphs."""
        return False

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> CheckpointConnectorStats | None:
        """The connector's counters as the API server rebuilds them from a
        step's stats payload (:mod:`lmcache_rc.vllm.stats`)."""
        return CheckpointConnectorStats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> CheckpointPromMetrics | None:
        """The connector's series in the API server's ``/metrics``
        (``vllm:lmcache_rc_events_total``, ``vllm:lmcache_rc_state``)."""
        return CheckpointPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def options(self) -> ConnectorOptions:
        """The parsed options."""
        return self._options

    @property
    def mode(self) -> str | None:
        """``"upstream"``, ``"boundary"``, or None (disabled or not decided yet)."""
        return None if self._disabled else self._mode

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """False: pages are addressed per layer."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a dropped checkpoint store is a future miss, never lost output."""
        return False

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """False: the ordinary local lookup is used unchanged."""
        return False

    @property
    def bridge(self) -> CheckpointSchedulerBridge | None:
        """The boundary-mode scheduler bridge (after the fork bound its cache)."""
        side = self._scheduler
        return side if isinstance(side, CheckpointSchedulerBridge) else None

    @property
    def upstream(self) -> UpstreamScheduler | None:
        """The upstream-mode scheduler side (after vLLM bound its cache manager)."""
        side = self._scheduler
        return side if isinstance(side, UpstreamScheduler) else None

    @property
    def worker_side(self) -> WorkerSide | None:
        """This rank's worker side (worker role, not disabled)."""
        side = self._worker_side
        return side if isinstance(side, WorkerSide) else None

    @property
    def _worker(self) -> Any:
        return self._worker_side.worker

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Upstream mode: describe this rank's pages and start its copy worker.

        Raises when the transport cannot serve (a layout it cannot describe,
        the sidecar unreachable), so a misconfiguration fails at start-up.
        """
        side = self._worker_side
        if side.register_kv_caches(kv_caches, self._kv_config) and isinstance(side, WorkerSide):
            local = local_engine(self._vllm_config, self._world_size)
            if local is not None:
                local.add_worker(side.rank, side)
                self._local = local

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        """Not used (``prefer_cross_layer_blocks`` is False)."""

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        """Not used: copies run in the lmcache-rc transfer engine."""

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Nothing to do: store sources stay pinned until every rank copied them."""

    def bind_boundary_checkpoint_state(self, state: Any) -> None:
        """Fork hook (worker): bind this rank's page pool and layout.

        Raises when the transport cannot serve (bad layout or pool, sidecar
        unreachable), as the fork requires.
        """
        if self._mode is None and not self._disabled:
            self._mode = "boundary"
        self._worker_side.bind_boundary_state(state)

    @_serialized
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Submits this step's restores (boundary mode: every task) exactly once.

        A failure creating the event or submitting marks only that task
        failed (reported False); a task id delivered twice raises
        ``lmcache_rc.worker.DuplicateTask``. Tasks before any bind are
        recorded, and the worker metadata raises.
        """
        self._worker_side.take(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """No-op: restores are asynchronous; vLLM waits for ``finished_recving``."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """No-op: whole checkpoints are stored after the forward."""

    @_serialized
    def wait_for_save(self) -> None:
        """Upstream mode: submit this step's stores (their bytes are final now)."""
        meta = self._connector_metadata
        step = meta.step if isinstance(meta, CheckpointConnectorMetadata) else 0
        self._worker_side.wait_for_save(step)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(None, None)``: results travel by :meth:`get_transfer_results` only,
        which also carries failures (a caller of this older hook alone would
        count a failed rank as a hit)."""
        return None, None

    @_serialized
    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Restores that ended on this rank: ``finished_recving``, and failures
        also in ``failed_recving`` (vLLM then recomputes)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
            KVConnectorTransferResults,
        )

        results = self._worker_side.transfer_results()
        if results is None:
            return KVConnectorTransferResults()
        return KVConnectorTransferResults(
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
        )

    def inject_fault(self, kind: str, count: int = 1, delay: float = 0.0) -> None:
        """Test hook (worker role): the next ``count`` copies of this rank ``"fail"``
        (recoverable: the task reports False), turn ``"unsafe"``, or are held
        ``delay`` seconds (``"delay"``)."""
        self._worker_side.inject_fault(kind, count, delay)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Empty: failures are reported per request (``failed_recving``)."""
        return set()

    @_serialized
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This rank's layout (once) and its results since the last step.

        Raises RuntimeError when tasks arrived but the rank was never bound,
        and ``errors.UnsafeCopy`` when a copy may still be in flight.
        """
        return self._worker_side.worker_meta()

    # ------------------------------------------------------------------ scheduler side

    def _connect(self) -> SidecarClient:
        o = self._options
        factory = type(self).client_factory or connect
        try:
            client: SidecarClient = factory(o.socket, o.rpc_timeout, o.connect_timeout)
        except errors.CheckpointError as e:
            raise errors.Unavailable(
                f"cannot reach the lmcache-rc sidecar at {o.socket} "
                f"(option {OPTION_PREFIX}socket): {e}; start it with "
                f"`lmcache-rc serve --socket {o.socket}`"
            ) from e
        self._client = client
        return client

    def bind_kv_cache_manager(self, kv_cache_manager: UpstreamKVCacheManager) -> None:
        """vLLM (scheduler): the cache manager is built; upstream mode binds its side here."""
        parent = getattr(super(), "bind_kv_cache_manager", None)
        if parent is not None:
            parent(kv_cache_manager)
        else:
            self.bind_gpu_block_pool(kv_cache_manager.block_pool)
        if getattr(kv_cache_manager, "boundary_checkpoints", None) is not None:
            if self._options.vllm_api == "auto":
                self._mode = "boundary"  # the fork: it calls bind_boundary_checkpoint_cache
            return
        if self._mode != "upstream" or self._disabled or self._scheduler.bound:
            return
        o = self._options
        kv_config = (
            self._kv_config if self._kv_config is not None else kv_cache_manager.kv_cache_config
        )
        hasher = None
        if kv_events_enabled(self._vllm_config):
            hash_block_size = getattr(kv_cache_manager.block_pool, "hash_block_size", None)
            if hash_block_size is None:
                hash_block_size = getattr(kv_config, "hash_block_size", None)
            if hash_block_size is None:
                raise InvalidConnectorConfig(
                    "KV events are on but vLLM's block pool names no hash_block_size"
                )
            hasher = RouterHasher(self._vllm_config, int(hash_block_size))
        side = UpstreamScheduler(
            self._connect(),
            kv_config,
            o,
            identity=checkpoint_identity(self._vllm_config, o),
            world_size=self._world_size,
            clock=self.clock,
            router_hasher=hasher,
            engine_id=str(getattr(self._vllm_config.kv_transfer_config, "engine_id", "") or ""),
        )
        side.bind_block_pool(kv_cache_manager.block_pool)
        self._scheduler = side
        local = local_engine(self._vllm_config, self._world_size)
        if local is not None:
            local.set_scheduler(side, o.idle_flush)
            self._local = local
        logger.info(
            "lmcache-rc connector: upstream mode, sidecar %s, %d worker ranks",
            o.socket,
            self._world_size,
        )

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """Keeps the block pool (upstream stores pin their sources in it)."""
        self._block_pool = gpu_block_pool
        self._scheduler.bind_block_pool(gpu_block_pool)

    def bind_boundary_checkpoint_cache(self, manager: Any) -> None:
        """Fork hook (scheduler): take the allocator and connect to the sidecar."""
        if self._mode is None and not self._disabled:
            self._mode = "boundary"
        if self._mode != "boundary" or self._disabled:
            return
        if self._scheduler.bound:
            raise RuntimeError("bind_boundary_checkpoint_cache was called twice")
        o = self._options
        self._scheduler = CheckpointSchedulerBridge(
            self._connect(),
            manager,
            identity=checkpoint_identity(self._vllm_config, o),
            world_size=self._world_size,
            chunk_tokens=o.chunk_tokens,
            lookup_timeout=o.lookup_timeout,
            begin_timeout=o.begin_timeout,
            max_lookup_attempts=o.max_lookup_attempts,
            max_tasks=o.max_tasks,
            max_in_flight=o.max_copies_per_rank,
            task_timeout=o.task_timeout or None,
            layout_timeout=o.layout_timeout or None,
            clock=self.clock,
            skip_rule=SkipRule.from_options(o),
        )

    def poll_boundary_checkpoint(self, request: Any) -> bool:
        """Fork hook: False parks ``request`` this step (lookup or import pending)."""
        return self._scheduler.poll(request)

    def boundary_checkpoint_external_tokens(self, request: Any) -> int:
        """Fork hook: tokens of the local hit that an import published for this request."""
        return self._scheduler.external_tokens(request)

    @_serialized
    def on_new_request(self, request: Request) -> None:
        """vLLM: a request arrived (upstream stores need its tokens later)."""
        self._scheduler.on_new_request(request)

    @_serialized
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Upstream: ``(None, False)`` while looking up, ``(n, True)`` to restore
        asynchronously. Boundary mode: ``(0, False)`` (imports are published
        into the local cache instead)."""
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @_serialized
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Upstream: a RETRIEVE task into the allocated blocks. Boundary: the
        published import was admitted."""
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def store_boundary_checkpoint(self, request: Any, checkpoint: Any) -> None:
        """Fork hook: export a committed local checkpoint (may skip silently)."""
        self._scheduler.store(request, checkpoint)

    @_serialized
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's new copy tasks, each emitted exactly once."""
        try:
            return self._scheduler.build_meta(scheduler_output)
        except DisableConnector as e:
            self._disable(str(e))
            side, self._scheduler = self._scheduler, SchedulerSide()
            side.close()
            return CheckpointConnectorMetadata()

    @_serialized
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Rank layouts and results: negotiate, publish, discard, release."""
        self._scheduler.update(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Single-group form of :meth:`request_finished_all_groups`."""
        return self.request_finished_all_groups(request, (block_ids,))

    @_serialized
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Upstream: store the response state (its blocks are pinned, so vLLM
        frees at once). Boundary: cancel the lookup. Always ``(False, None)``."""
        return self._scheduler.request_finished(request, block_ids)

    @_serialized
    def has_pending_push_work(self) -> bool:
        """True while layouts are negotiated or stores/copies are outstanding."""
        return self._scheduler.has_pending_work()

    @_serialized
    def take_events(self) -> Iterable[Any]:
        """vLLM (scheduler, every step): KV events for routers — the complete
        checkpoints this engine stored or restored that became restorable or
        stopped being (``docs/vllm.md`` §A.9). Only with vLLM's
        ``kv_events_config`` enabled; otherwise none, at no cost."""
        return self._scheduler.take_events()

    @_serialized
    def get_kv_connector_stats(self) -> CheckpointConnectorStats | None:
        """What the connector counted since the last call and its gauges, or
        None when nothing changed: the scheduler's lookups, restores and
        stores, a rank's copies and what they cost, and everywhere the time
        spent in vLLM's calls (``hook_<name>_us``). vLLM adds the ranks' and
        the scheduler's up, logs them (``KV Transfer metrics: …``) and
        exports them in ``/metrics``. Never raises into vLLM's step."""
        try:
            if self._is_scheduler:
                counters, gauges = self._scheduler.stats()
            else:
                counters, gauges = self._worker_side.stats()
            counters.update({k: v // 1000 for k, v in self._hook_ns.items()})
            return self._stats_feed.take(counters, gauges)
        except Exception:
            if not self._stats_failed:
                self._stats_failed = True
                logger.exception("lmcache-rc: connector statistics failed; none are reported")
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

    @_serialized
    def reset_cache(self) -> bool | None:
        """``reset_prefix_cache(reset_connector=True)``: checkpoints stored before
        are never restored by this engine again (a new epoch enters its
        identity). The sidecar is shared, so nothing is deleted there; clear it
        with ``lmcache-rc clear``. Changed weights still need a new
        ``target_revision``: the epoch does not survive a restart."""
        return True if self._scheduler.reset() else None

    # ------------------------------------------------------------------ both

    @_serialized
    def report_status(self) -> dict[str, Any]:
        """The connector's state: the scheduler side's report or the rank's."""
        base: dict[str, Any] = {
            "role": "scheduler" if self._is_scheduler else "worker",
            "mode": self.mode,
            "disabled": self._disabled or None,
            "socket": self._options.socket,
            "options": asdict(self._options),
        }
        if self._is_scheduler:
            base["bound"] = self._scheduler.bound
            base.update(self._scheduler.report_status())
            return base
        side = self._worker_side
        base.update(
            rank=side.rank,
            bound=side.bound,
            in_flight=side.in_flight(),
            unsafe=side.is_unsafe(),
        )
        return base

    def _repr_html_(self) -> str:
        html = self._scheduler.html()
        if html is not None:
            return html
        return f"<pre>{json.dumps(self.report_status(), indent=1, default=str)}</pre>"

    def shutdown(self) -> None:
        """Drain copies before anything is unmapped; stop the scheduler side.

        A worker whose copies cannot be proven stopped raises
        ``errors.UnsafeCopy``: the process must exit without unmapping.
        """
        local, self._local = self._local, None
        if local is not None and not self._is_scheduler:
            # the engine's forwards have ended: its begun stores go to the ranks
            # before the copies drain (vLLM shuts the workers down first)
            o = self._options
            try:
                local.flush(min(o.begin_timeout, o.close_timeout or o.begin_timeout))
            except Exception:
                # the copies already submitted must still drain below (vLLM
                # frees the pages next): lose the stores not handed over, never that
                logger.exception(
                    "lmcache-rc: handing the exiting engine's stores to its ranks failed; "
                    "those not handed over are not stored"
                )
        if local is not None and self._is_scheduler:
            with local.call():
                self._scheduler.close()
            forget(local)
        else:
            self._scheduler.close()
        if self._client is not None:
            client, self._client = self._client, None
            client.close()
        self._worker_side.close()
