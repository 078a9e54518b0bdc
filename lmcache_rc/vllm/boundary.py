"""Boundary mode, scheduler side: :class:`CheckpointSchedulerBridge`.

This is the mode for the local-inference-lab fork of vLLM, whose allocator
commits request-boundary checkpoints (``docs/design/vllm-boundary-api.md``).

What it owns (docs/design/transfers.md#the-connectors-task-protocol, and
``docs/design/vllm-boundary-api.md`` §2-§3 and §5): the checkpoint identity of
this engine (namespace per cache salt), layout negotiation with every worker
rank, directory lookups for waiting requests with a timeout and up to
``max_lookup_attempts`` attempts, reservation of private destination bundles
through vLLM's allocator, pinning and manifest building for stores, the copy
tasks sent to the workers (each exactly once), all-rank completion (publish or
discard), cancellation and reused request ids.

What it must never do: block the scheduler on the sidecar (every RPC is an
``*_async`` future polled once per step), publish or discard an import before
every rank reported (I1, I2), release a page a worker may still copy (I4), or
touch a LoRA request (I3). Bytes never pass through here; only manifests and
block ids do.

The worker side of the protocol (:class:`CheckpointWorkerMetadata`) and the
scheduler → worker metadata (:class:`CheckpointConnectorMetadata`) are defined
here as well, because this module is where both are interpreted.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lmcache_rc as rc
from lmcache_rc.vllm.api import (
    CHECKPOINT_KINDS,
    AuxiliaryGroupName,
    BoundaryCheckpoint,
    CheckpointEngineTask,
    engine_group_name,
    is_recurrent_group,
    supports_admission_api,
)
from lmcache_rc.vllm.common import (
    CopyTask,
    Lookup,
    RestorePhase,
    TaskBook,
    check_found_prefix,
    handles,
    recurrent_boundaries,
)
from lmcache_rc.vllm.metadata import CheckpointConnectorMetadata
from lmcache_rc.vllm.options import OPTION_DEFAULTS
from lmcache_rc.vllm.restore_cost import SkipRule
from lmcache_rc.vllm.sidecar import SidecarClient, SidecarDown

__all__ = ["CheckpointSchedulerBridge"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- state records

_FINDING = RestorePhase.FINDING
_WAITING = RestorePhase.WAITING
_RESTORING = RestorePhase.RESTORING
_PUBLISHED = RestorePhase.PUBLISHED
_RETRY = RestorePhase.RETRY
_DONE = RestorePhase.DONE


@dataclass(eq=False)
class _Lookup(Lookup):
    """The restore state of one request in boundary mode: what to reserve,
    the reserved bundle, and whether it holds an admission record."""

    meta: _Found | None = None
    checkpoint_id: int | None = None
    admission: bool = False


@dataclass(frozen=True)
class _Found:
    """A validated FIND answer: what to reserve."""

    num_tokens: int
    positions: tuple[tuple[int, ...], ...]
    draft_prefix_len: int
    kind: str


@dataclass(eq=False, kw_only=True)
class _Task(CopyTask):
    """A copy task of boundary mode: the bundle it pins or fills."""

    checkpoint: BoundaryCheckpoint
    lookup: _Lookup | None = None

    def engine_task(self) -> CheckpointEngineTask:
        return CheckpointEngineTask(
            task_id=self.task_id,
            manifest=self.manifest,
            direction=self.direction,
            block_ids=self.block_ids,
        )


def _check_page_bytes(rank: int, layout: Mapping[str, Any]) -> None:
    page_bytes = layout.get("page_bytes")
    if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
        raise ValueError(f"rank {rank} reported a layout without a valid page_bytes")


# --------------------------------------------------------------------------- the bridge


class CheckpointSchedulerBridge(TaskBook[_Task]):
    """Decides what to store and restore, and tracks every copy to its end.

    One instance lives in the scheduler process, owned by the connector (role
    SCHEDULER), created once vLLM hands over its allocator
    (``bind_boundary_checkpoint_cache``). Every method is called from the
    scheduler thread; none blocks on the sidecar.

    ``identity`` is the namespace identity without ``layout`` (revisions,
    config hashes, precision environment, parallel geometry); the negotiated
    worker layout is added once every rank reported the same one.
    ``clock`` (monotonic seconds) is injectable so timeouts are testable
    without sleeping.
    """

    def __init__(
        self,
        client: SidecarClient,
        manager: Any,
        *,
        identity: Mapping[str, Any],
        world_size: int,
        chunk_tokens: int = OPTION_DEFAULTS["chunk_tokens"],
        lookup_timeout: float = OPTION_DEFAULTS["lookup_timeout"],
        begin_timeout: float | None = None,
        max_lookup_attempts: int = OPTION_DEFAULTS["max_lookup_attempts"],
        max_tasks: int = OPTION_DEFAULTS["max_tasks"],
        max_in_flight: int | None = None,
        task_timeout: float | None = None,
        layout_timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        skip_rule: SkipRule | None = None,
    ) -> None:
        if manager.boundary_checkpoints is None:
            raise ValueError("the KV cache manager has no boundary-checkpoint cache")
        super().__init__(
            client,
            world_size,
            # layout negotiation: every rank reports one layout before any lookup
            identity={k: v for k, v in identity.items() if k != "layout"},
            begin_timeout=lookup_timeout if begin_timeout is None else begin_timeout,
            lookup_timeout=lookup_timeout,
            max_lookup_attempts=max_lookup_attempts,
            layout_timeout=layout_timeout,
            validate=_check_page_bytes,
            clock=clock,
            skip_rule=skip_rule,
        )
        self._manager = manager
        self._cache = manager.boundary_checkpoints
        self._chunk_tokens = chunk_tokens
        self._max_tasks = max_tasks
        # Tasks sent to the ranks and not yet reported by all of them: never
        # more than each rank's copy queue admits (lmcache_rc.max_copies_per_rank),
        # or the surplus would be refused there and reported as failed.
        self._max_in_flight = max_tasks if max_in_flight is None else max_in_flight
        if self._max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self._task_timeout = task_timeout
        self._admission = supports_admission_api(manager)
        groups = list(manager.kv_cache_config.kv_cache_groups)
        self._recurrent: tuple[bool, ...] = tuple(is_recurrent_group(g) for g in groups)
        managers = manager.coordinator.single_type_managers
        self._block_sizes: tuple[int, ...] = tuple(
            int(managers[g].block_size) for g in range(len(groups))
        )
        # requests, tasks
        self._lookups: dict[str, _Lookup] = {}
        self._cancelled: dict[str, set[str]] = {}

    # ------------------------------------------------------------------ properties

    @property
    def _layout(self) -> dict[str, Any] | None:
        return self._negotiation.layout

    @property
    def admission_api(self) -> bool:
        """Whether the allocator offers restore-admission reservations."""
        return self._admission

    @property
    def ready(self) -> bool:
        """Whether lookups and stores can happen (layout negotiated, not closed)."""
        return self._layout is not None and not self._closed

    # ------------------------------------------------------------------ identity

    def _roots(self, request: Any, num_tokens: int | None = None) -> rc.TokenRoots:
        tokens = list(request.all_token_ids)
        if num_tokens is not None:
            tokens = tokens[:num_tokens]
        return rc.TokenRoots.build(
            self.namespace(request.cache_salt), tokens, chunk_tokens=self._chunk_tokens
        )

    def handles(self, request: Any) -> bool:
        """Whether ``request`` may use the external directory at all.

        Not LoRA, multimodal or embedding requests (:func:`handles`), nor
        requests the boundary-checkpoint cache does not support
        (``supports_request``: e.g. resumable requests), for which the
        allocator's reserve answers None for a reason other than capacity.
        """
        if not handles(request):
            return False
        supports = getattr(self._cache, "supports_request", None)
        return supports is None or bool(supports(request))

    # ------------------------------------------------------------------ restore path

    def poll(self, request: Any) -> bool:
        """``poll_boundary_checkpoint``: False parks the request for this step.

        True means "go on with the ordinary local lookup": no import is
        pending (none found, lookup failed or timed out, or the import is
        published and the local lookup will find it).
        """
        rid = request.request_id
        if self._closed or not self.handles(request):
            return True
        if not self._negotiation_settled():
            return False  # layouts still arriving: a lookup must wait for the namespace
        if self._layout is None:
            return True  # negotiation failed: serve without the directory
        if rid in self._cancelled:
            # An earlier request with this id still has copies in flight: wait
            # for them, unless they are all past the task timeout (a wedged
            # rank). Then this request recomputes; the old id stays cancelled,
            # so the late results are still discarded, never published.
            if not self._cancelled_copies_timed_out(rid):
                return False
            lookup = self._lookups.get(rid)
            if lookup is None:
                lookup = _Lookup(request_id=rid, phase=_DONE)
                self._lookups[rid] = lookup
                self._end(lookup, "reused-id-timeout")
            return lookup.phase == _DONE
        lookup = self._lookups.get(rid)
        if lookup is None:
            return self._start_lookup(request)
        if lookup.phase == _FINDING:
            return self._advance_find(request, lookup)
        if lookup.phase == _WAITING:
            return self._try_reserve(request, lookup)
        if lookup.phase == _RESTORING:
            return self._check_restore_timeout(lookup)
        if lookup.phase == _RETRY:
            return self._find(request, lookup)
        return True

    def _cancelled_copies_timed_out(self, rid: str) -> bool:
        """Whether every copy a cancelled request ``rid`` left is past the task timeout."""
        if self._task_timeout is None:
            return False
        now = self._clock()
        for task_id in self._cancelled.get(rid, ()):
            task = self._tasks.get(task_id)
            if task is None or task.sent_at is None:
                return False  # still at BEGIN (bounded by its own deadline) or unsent
            if now - task.sent_at < self._task_timeout:
                return False
        return True

    def _start_lookup(self, request: Any) -> bool:
        rid = request.request_id
        lookup = _Lookup(request_id=rid, phase=_DONE)
        self._lookups[rid] = lookup
        enabled = getattr(self._manager, "prefix_cache_lookup_enabled", None)
        if enabled is not None and not enabled(request):
            lookup.reason = "prefix-cache-off"
            return True
        local = self._local_tokens(request)
        if local >= request.num_tokens:
            lookup.reason = "local-hit"
            self._counters["lookup_local_complete"] += 1
            return True
        return self._find(request, lookup)

    def _find(self, request: Any, lookup: _Lookup) -> bool:
        """Sends a FIND (False: parked while it runs)."""
        lookup.meta = None
        return not self._send_find(lookup, lambda: self._roots(request).roots)

    def _advance_find(self, request: Any, lookup: _Lookup) -> bool:
        answered, found = self._poll_find(lookup)
        if not answered:
            return False
        if found is None:
            return True  # the lookup ended: recompute
        meta = self._validate_found(request, found)
        if meta is None:
            return self._end(lookup, "incompatible")
        local = self._local_tokens(request)
        if local >= meta.num_tokens:
            return self._end(lookup, "local-at-least-as-long")
        if self._skip_restore(lookup, meta.num_tokens - local):
            return True  # cheaper to recompute: the lookup ended, admit the request
        lookup.manifest = found
        lookup.meta = meta
        lookup.phase = _WAITING
        return self._try_reserve(request, lookup)

    def _local_tokens(self, request: Any) -> int:
        try:
            local = self._cache.find(request, request.num_tokens)
        except Exception:  # a cache that refuses the request: no local hit
            return 0
        return 0 if local is None else int(local.num_tokens)

    def _validate_found(self, request: Any, manifest: rc.Manifest) -> _Found | None:
        """Checks a FIND answer against this engine.

        See docs/design/manifests.md#checking-a-find-answer.
        """
        rid = request.request_id
        try:
            n = check_found_prefix(
                manifest, self._world_size, request.num_tokens, self._roots(request).prefix
            )
            payload = json.loads(manifest.payload)
            if payload.get("schema_version") != 2:
                raise ValueError("payload schema is not 2")
            if payload.get("worker_layout") != self._layout:
                raise ValueError("worker layout differs")
            assert self._layout is not None
            page_bytes = self._layout["page_bytes"]
            groups = payload["page_groups"]
            positions = tuple(
                tuple(int(p) for p in g)
                for g in self._manager.boundary_checkpoint_page_positions(n)
            )
            names = [engine_group_name(i) for i in range(len(positions))] + [AuxiliaryGroupName]
            if [g.get("name") for g in groups] != names:
                raise ValueError("page groups differ from this engine's KV groups")
            for g, group in enumerate(groups):
                if group.get("page_bytes") != page_bytes:
                    raise ValueError(f"page group {g} has a different page size")
                want = list(positions[g]) if g < len(positions) else [0]
                if group.get("positions") != want:
                    raise ValueError(f"page group {g} covers other positions")
            draft = payload["draft_prefix_len"]
            kind = payload["kind"]
            if not isinstance(draft, int) or isinstance(draft, bool) or not 0 <= draft <= n:
                raise ValueError("bad draft_prefix_len")
            if kind not in CHECKPOINT_KINDS:
                raise ValueError(f"unknown kind {kind!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("checkpoint for %s not usable here: %s", rid, e)
            return None
        return _Found(num_tokens=n, positions=positions, draft_prefix_len=draft, kind=kind)

    def _try_reserve(self, request: Any, lookup: _Lookup) -> bool:
        meta, manifest = lookup.meta, lookup.manifest
        assert meta is not None and manifest is not None
        if self._task_count() >= self._max_tasks:
            return self._end(lookup, "task-capacity")
        kwargs: dict[str, Any] = {
            "draft_prefix_len": meta.draft_prefix_len,
            "kind": meta.kind,
            "num_ranks": self._world_size,
        }
        if self._admission:
            kwargs["reserve_admission"] = True
        try:
            ckpt = self._manager.reserve_external_boundary_checkpoint(
                request, meta.num_tokens, meta.positions, **kwargs
            )
        except ValueError as e:
            logger.warning("checkpoint reservation for %s refused: %s", lookup.request_id, e)
            return self._end(lookup, "reserve-refused")
        if ckpt is None:
            if self._admission:
                lookup.admission = True  # a capacity waiter holds an admission record
                expired = getattr(self._manager, "external_boundary_wait_expired", None)
                if expired is not None and expired(lookup.request_id):
                    return self._end(lookup, "capacity-timeout")
                self._counters["capacity_waits"] += 1
                return False
            return self._end(lookup, "capacity")
        lookup.admission = self._admission
        try:
            block_ids = self._task_block_ids(ckpt, meta.positions)
        except ValueError as e:  # the allocator answered a bundle we cannot name
            logger.error("reserved bundle for %s is malformed: %s", lookup.request_id, e)
            self._manager.discard_external_boundary_checkpoint(ckpt.checkpoint_id)
            return self._end(lookup, "reserve-malformed")
        task = _Task(
            task_id=uuid.uuid4().hex,
            direction="RETRIEVE",
            manifest=manifest,
            block_ids=block_ids,
            request_id=lookup.request_id,
            checkpoint=ckpt,
            lookup=lookup,
        )
        self._tasks[task.task_id] = task
        lookup.phase = _RESTORING
        lookup.task_id = task.task_id
        lookup.checkpoint_id = ckpt.checkpoint_id
        lookup.num_tokens = meta.num_tokens
        self._counters["restores_started"] += 1
        return False

    def _check_restore_timeout(self, lookup: _Lookup) -> bool:
        if self._task_timeout is None or lookup.task_id is None:
            return False
        task = self._tasks.get(lookup.task_id)
        if task is None or task.sent_at is None:
            return False
        if self._clock() - task.sent_at < self._task_timeout:
            return False
        logger.warning(
            "restore for %s has not completed on every rank within %.1f s; recomputing "
            "(its pages stay reserved until every rank reports)",
            lookup.request_id,
            self._task_timeout,
        )
        lookup.task_id = None
        return self._end(lookup, "task-timeout")

    def _end(self, lookup: _Lookup, reason: str) -> bool:
        """Ends a lookup without an import: True, the request is admitted to recompute."""
        self._finish_lookup(lookup, reason)
        return True

    def _lookup_ended(self, lookup: Lookup) -> None:
        assert isinstance(lookup, _Lookup)
        self._release_admission(lookup)

    def _release_admission(self, lookup: _Lookup) -> None:
        if lookup.admission:
            lookup.admission = False
            release = getattr(self._manager, "release_external_boundary_admission", None)
            if release is not None:
                release(lookup.request_id)

    def external_tokens(self, request: Any) -> int:
        """``boundary_checkpoint_external_tokens``: tokens of the local hit that
        came from an import published for this very request, else 0."""
        lookup = self._lookups.get(request.request_id)
        ckpt = getattr(request, "boundary_checkpoint", None)
        if lookup is None or ckpt is None or lookup.phase != _PUBLISHED:
            return 0
        if ckpt.checkpoint_id != lookup.checkpoint_id:
            return 0
        return int(ckpt.num_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """``update_state_after_alloc``: see :meth:`on_allocated`."""
        self.on_allocated(request)

    def on_allocated(self, request: Any) -> None:
        """``update_state_after_alloc``: a published import was admitted; the
        lookup is over (a preempted request is not looked up again)."""
        lookup = self._lookups.get(request.request_id)
        if lookup is not None and lookup.phase == _PUBLISHED:
            lookup.phase = _DONE
            lookup.reason = "admitted"
            lookup.admission = False  # ownership passed to the running request

    # ------------------------------------------------------------------ store path

    def store(self, request: Any, checkpoint: BoundaryCheckpoint) -> bool:
        """``store_boundary_checkpoint``: export a published local checkpoint.

        Pins it, builds the schema-2 manifest and sends BEGIN. Returns whether
        a store was started; it may skip silently (not handled, no layout,
        task capacity, no longer published).
        """
        if self._closed or not self.handles(request) or self._layout is None:
            self._counters["store_skipped"] += 1
            return False
        if self._task_count() >= self._max_tasks:
            self._counters["store_skipped_capacity"] += 1
            return False
        pinned = self._cache.acquire(checkpoint.checkpoint_id)
        if pinned is None:
            self._counters["store_skipped_unpublished"] += 1
            return False
        try:
            manifest, block_ids = self._build_store(request, pinned)
            future = self._client.begin_async(manifest)
        except SidecarDown:  # the outage is logged once, not per request
            self._cache.release(pinned)
            self._counters["store_skipped_sidecar_down"] += 1
            return False
        except Exception as e:
            logger.warning("checkpoint store for %s not started: %s", request.request_id, e)
            self._cache.release(pinned)
            self._counters["store_build_failed"] += 1
            return False
        task = _Task(
            task_id=uuid.uuid4().hex,
            direction="STORE",
            manifest=manifest,
            block_ids=block_ids,
            request_id=request.request_id,
            checkpoint=pinned,
        )
        self._begin(task, future)
        self._counters["stores_begun"] += 1
        return True

    def _build_store(
        self, request: Any, ckpt: BoundaryCheckpoint
    ) -> tuple[rc.Manifest, tuple[tuple[int, ...], ...]]:
        n = int(ckpt.num_tokens)
        if ckpt.kind not in CHECKPOINT_KINDS:
            raise ValueError(f"unknown checkpoint kind {ckpt.kind!r}")
        positions = tuple(
            tuple(int(p) for p in g) for g in self._manager.boundary_checkpoint_page_positions(n)
        )
        if len(positions) != len(self._block_sizes):
            raise ValueError("page positions do not match the KV groups")
        block_ids = self._task_block_ids(ckpt, positions)
        roots = self._roots(request, n)
        boundaries: list[tuple[int, str]] = []
        for g, pos in enumerate(positions):
            if self._recurrent[g]:
                boundaries.extend(recurrent_boundaries(n, g, pos))
            else:
                size = self._block_sizes[g]
                boundaries.extend((min((p + 1) * size, n), f"attention:{g}") for p in pos)
        boundaries.append((n, f"auxiliary:{ckpt.draft_prefix_len}:{ckpt.kind}"))
        keys = roots.content_keys(boundaries)
        assert self._layout is not None
        page_bytes = self._layout["page_bytes"]
        groups: list[dict[str, Any]] = []
        at = 0
        for g, pos in enumerate(positions):
            groups.append(
                {
                    "name": engine_group_name(g),
                    "page_bytes": page_bytes,
                    "positions": list(pos),
                    "content_keys": keys[at : at + len(pos)],
                }
            )
            at += len(pos)
        groups.append(
            {
                "name": AuxiliaryGroupName,
                "page_bytes": page_bytes,
                "positions": [0],
                "content_keys": keys[at:],
            }
        )
        payload = rc.CheckpointPayload.build(
            worker_layout=self._layout,
            page_groups=groups,
            draft_prefix_len=int(ckpt.draft_prefix_len),
            kind=ckpt.kind,
        )
        prefix = roots.prefix(n)
        generation = rc.checkpoint_generation(prefix, payload)
        return rc.Manifest(generation, prefix, self._world_size, payload), block_ids

    @staticmethod
    def _task_block_ids(
        ckpt: BoundaryCheckpoint, positions: tuple[tuple[int, ...], ...]
    ) -> tuple[tuple[int, ...], ...]:
        """Physical ids per manifest group in position order, auxiliary last."""
        if len(ckpt.block_ids) != len(positions):
            raise ValueError("the bundle has a different number of KV groups")
        out: list[tuple[int, ...]] = []
        for g, pos in enumerate(positions):
            row = ckpt.block_ids[g]
            ids = tuple(int(row[p]) if p < len(row) else 0 for p in pos)
            live = tuple(int(b) for b in row if b)
            if any(b == 0 for b in ids) or ids != live:
                raise ValueError(f"group {g} pages do not match positions {list(pos)}")
            out.append(ids)
        aux = tuple(int(b) for b in ckpt.auxiliary_block_ids)
        if len(aux) != 1 or aux[0] == 0:
            raise ValueError("a bundle needs exactly one auxiliary page")
        out.append(aux)
        return tuple(out)

    def _release_store(self, task: _Task) -> None:
        self._cache.release(task.checkpoint)

    def _cancel_unsent_restore(self, task: _Task) -> None:
        del self._tasks[task.task_id]
        self._manager.discard_external_boundary_checkpoint(task.checkpoint.checkpoint_id)

    # ------------------------------------------------------------------ per step

    def build_meta(self, scheduler_output: Any = None) -> CheckpointConnectorMetadata:
        """``build_connector_meta``: the tasks admitted since the last call, each once."""
        self._step_scheduled(scheduler_output)
        self._negotiation_settled()
        self._pump_begins()
        self._report_engine()
        return CheckpointConnectorMetadata(self._send_tasks(self._max_in_flight))

    def _engine_task(self, task: _Task) -> CheckpointEngineTask:
        return task.engine_task()

    def _negotiation_settled(self) -> bool:
        """False while layouts may still arrive; True once negotiated or given up."""
        return self._negotiation.settled()

    def _complete(self, task: _Task) -> None:
        """Every rank reported ``task``: publish, discard or release, exactly once."""
        ok = all(task.results.values())
        if task.direction == "STORE":
            if ok:
                self._counters["stores_committed"] += 1
            else:
                self._counters["stores_failed"] += 1
                self._abort(task.manifest.generation)
            self._cache.release(task.checkpoint)
        else:
            self._complete_restore(task, ok)
        self._task_resolved(task)

    def _complete_restore(self, task: _Task, ok: bool) -> None:
        lookup = task.lookup
        cid = task.checkpoint.checkpoint_id
        current = (
            lookup is not None
            and self._lookups.get(task.request_id) is lookup
            and lookup.phase == _RESTORING
            and lookup.task_id == task.task_id
        )
        if not current or lookup is None:
            self._manager.discard_external_boundary_checkpoint(cid)
            self._counters["restores_discarded"] += 1
            return
        if ok:
            published = False
            for rank in range(self._world_size):
                published = bool(self._manager.acknowledge_external_boundary_checkpoint(cid, rank))
            if published:
                lookup.phase = _PUBLISHED
                lookup.task_id = None
                self._counters["restores_published"] += 1
                return
            logger.info(
                "restore for %s was invalidated before publication; looking up again",
                task.request_id,
            )
            self._counters["restores_invalidated"] += 1
        else:
            self._manager.discard_external_boundary_checkpoint(cid)
            self._counters["restores_failed"] += 1
        lookup.task_id = None
        lookup.checkpoint_id = None
        self._release_admission(lookup)
        # The next poll looks up again: the sidecar retired a generation it
        # could not serve, so the next FIND may answer a shorter checkpoint.
        lookup.phase = _RETRY

    # ------------------------------------------------------------------ cancellation

    def request_finished(
        self, request: Any, block_ids: Sequence[Sequence[int]] = ()
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished(_all_groups)``: forget the lookup, keep copies.

        Pages referenced by an admitted copy stay pinned until every rank
        reported; the request id is remembered as cancelled until then, so
        a new request reusing the id waits for a clean start.
        """
        rid = request.request_id
        lookup = self._lookups.pop(rid, None)
        if lookup is not None:
            self._release_admission(lookup)
            lookup.phase = _DONE
            lookup.future = None
        outstanding = {t.task_id for t in self._tasks.values() if t.request_id == rid}
        outstanding |= {pb.task.task_id for pb in self._begins if pb.task.request_id == rid}
        if outstanding:
            self._cancelled.setdefault(rid, set()).update(outstanding)
        return False, None

    def _task_resolved(self, task: _Task) -> None:
        waiting = self._cancelled.get(task.request_id)
        if waiting is None:
            return
        waiting.discard(task.task_id)
        if not waiting:
            del self._cancelled[task.request_id]
            release = getattr(self._manager, "release_external_boundary_admission", None)
            if self._admission and release is not None:
                release(task.request_id)  # harmless: a reused id cannot have reserved yet

    # ------------------------------------------------------------------ status

    def _task_count(self) -> int:
        return len(self._tasks) + len(self._begins)

    def report_status(self) -> dict[str, Any]:
        """A snapshot for humans and tests: layout, requests, tasks, counters."""
        return {
            **self._status(self._lookups.values()),
            "admission_api": self._admission,
            "cancelled_request_ids": sorted(self._cancelled),
        }

    def html(self) -> str:
        """:meth:`report_status` as an HTML table."""
        return self._html("CheckpointSchedulerBridge")

    def _repr_html_(self) -> str:
        return self.html()

    def close(self) -> None:
        """Stop lookups and stores. Pending BEGINs are aborted and their pins
        released; tasks already sent keep their pins (workers may copy)."""
        if not self._closed:
            for lookup in self._lookups.values():
                self._release_admission(lookup)
        super().close()
