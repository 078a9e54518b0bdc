"""Upstream mode, scheduler side: lmcache-rc on stock vLLM 0.33.

What it owns (:class:`UpstreamScheduler`):

* **Restores.** ``get_num_new_matched_tokens`` starts a non-blocking FIND
  for the request's tokens minus the last one (a restore never covers the
  whole prompt) and answers ``(None, False)`` until the reply is in, then
  ``(N - num_computed_tokens, True)`` for a checkpoint of ``N`` tokens
  longer than the local hit — unless loading it would take longer than
  recomputing those tokens (the skip rule,
  :mod:`lmcache_rc.vllm.restore_cost`: then ``(0, False)``, counted
  ``restores_skipped_cheaper_to_recompute``). ``update_state_after_alloc``
  turns vLLM's blocks into one RETRIEVE task: every attention page past the
  local hit, and each recurrent group's block ``cdiv(N, block_size) - 1``
  (the block vLLM's align mode reads the state of ``N`` tokens from). Every
  rank reports the request in ``finished_recving`` and, on failure, in
  ``failed_recving``; vLLM's ``KVOutputAggregator`` waits for all ranks
  before the blocks become a hit (I2), and a failure anywhere makes vLLM
  recompute (``kv_load_failure_policy="recompute"``). The failed checkpoint
  is not offered again: the next FIND asks for a shorter one.
* **Stores.** From ``boundary_state_offloads`` (Mamba align-mode states
  written by this step's forward): the last block boundary below the prompt
  length, or every one (``store_prompt``); at
  ``request_finished_all_groups``: the state at ``num_computed_tokens``
  (``store_response``), what the next turn of a conversation continues
  from. Each store pins its blocks in vLLM's pool (``touch``) until every
  rank reported its copy, sends BEGIN (an identical generation already
  listed or pending is suppressed there, so a replay writes nothing) and is
  published by the sidecar only when every rank finished (I1); a failed rank
  aborts it.

What it must never do: block the scheduler thread on the sidecar (every
RPC is an ``*_async`` future polled once per step; lookups may wait for
their answer at most ``lookup_wait`` in all per step), offer vLLM a hit it
cannot load, release a pinned block before every rank reported, or handle a
LoRA, multimodal or embedding request (I3).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lmcache_rc as rc
from lmcache_rc.vllm.api import (
    BlockPool,
    CheckpointEngineTask,
    KVCacheBlocks,
    KVCacheConfig,
    Request,
    RouterHasher,
    SchedulerOutput,
    kv_cache_spec_kind_name,
    spec_kind,
)
from lmcache_rc.vllm.common import (
    CopyTask,
    DisableConnector,
    Lookup,
    RestorePhase,
    TaskBook,
    check_found_prefix,
    handles,
    recurrent_boundaries,
)
from lmcache_rc.vllm.events import CheckpointKeys, GroupView, RouterEvents, checkpoint_keys
from lmcache_rc.vllm.layout import LAYOUT_FORMAT, group_name
from lmcache_rc.vllm.metadata import CheckpointConnectorMetadata
from lmcache_rc.vllm.options import ConnectorOptions
from lmcache_rc.vllm.restore_cost import SkipRule
from lmcache_rc.vllm.sidecar import SidecarClient, SidecarDown

__all__ = ["GroupInfo", "UpstreamScheduler", "cdiv"]

logger = logging.getLogger(__name__)


OWN_STORE_WAIT = 2.0
"""Seconds at most a lookup waits for a store of this engine to be
published (a store stuck behind a full sidecar does not hold the request
longer; it goes on with a FIND then)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


_COMPLETED = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"})
"""Request statuses whose final state is worth storing (not aborted, ignored or failed)."""


@dataclass(frozen=True)
class GroupInfo:
    """One vLLM KV-cache group as the scheduler side sees it."""

    index: int
    kind: str
    """``"attention"`` or ``"recurrent"``."""
    block_size: int

    @property
    def name(self) -> str:
        """Its manifest page-group name."""
        return group_name(self.index)

    def positions(self, num_tokens: int) -> list[int]:
        """Block-table indices a checkpoint of ``num_tokens`` holds in this group."""
        last = cdiv(num_tokens, self.block_size)
        return list(range(last)) if self.kind == "attention" else [last - 1]


@dataclass(eq=False)
class _Restore(Lookup):
    """One request's restore in upstream mode: the longest checkpoint it may
    use, and the tokens the restore adds."""

    limit: int = 0
    """Checkpoints of at most this many tokens are looked up."""
    restored: int = 0
    awaited: _Task | None = None
    """While waiting for a store of this engine: that store."""


@dataclass(eq=False, kw_only=True)
class _Task(CopyTask):
    """A copy task of upstream mode: what it pins in vLLM's pool, and why."""

    kind: str
    """``prompt``, ``response`` (stores) or ``restore``."""
    pins: tuple[int, ...] = ()
    error: str = ""
    ready_step: int = 0
    """The step whose forward writes the task's bytes (0: written already); a
    hand-over to local ranks waits until every rank finished that forward."""
    keys: CheckpointKeys | None = None
    """The checkpoint as routers see it (only with KV events on)."""
    committed: bool | None = None
    """A store's outcome once it ended: published (True) or dropped (False)."""

    def engine_task(self) -> CheckpointEngineTask:
        return CheckpointEngineTask(
            task_id=self.task_id,
            manifest=self.manifest,
            direction=self.direction,
            block_ids=self.block_ids,
            request_id=self.request_id if self.direction == "RETRIEVE" else "",
            error=self.error,
            # a finished request's state: no forward writes its pinned blocks
            final=self.direction == "STORE" and self.kind == "response",
        )


class UpstreamScheduler(TaskBook[_Task]):
    """The scheduler side of upstream mode (one per engine, owned by the connector).

    Every method runs on the scheduler thread and none blocks on the sidecar.
    ``identity`` is the namespace identity without ``layout``; the layout is
    negotiated with the ranks (each reports the layout its KV caches give,
    :mod:`lmcache_rc.vllm.layout`).
    """

    def __init__(
        self,
        client: SidecarClient,
        kv_cache_config: KVCacheConfig,
        options: ConnectorOptions,
        *,
        identity: Mapping[str, Any],
        world_size: int,
        clock: Callable[[], float] = time.monotonic,
        router_hasher: RouterHasher | None = None,
        engine_id: str = "",
    ) -> None:
        super().__init__(
            client,
            world_size,
            identity=identity,
            begin_timeout=options.begin_timeout,
            lookup_timeout=options.lookup_timeout,
            max_lookup_attempts=options.max_lookup_attempts,
            layout_timeout=options.layout_timeout or None,
            validate=self._check_layout,
            clock=clock,
            skip_rule=SkipRule.from_options(options),
            engine_id=engine_id,
        )
        self._options = options
        self._groups: tuple[GroupInfo, ...] = tuple(
            GroupInfo(
                i, spec_kind(g.kv_cache_spec) or "unsupported", int(g.kv_cache_spec.block_size)
            )
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
        )
        unsupported = [g.index for g in self._groups if g.kind == "unsupported"]
        if unsupported:
            raise ValueError(f"KV-cache groups {unsupported} cannot be checkpointed")
        self._recurrent = tuple(g for g in self._groups if g.kind == "recurrent")
        # speculative blocks: vLLM keeps a running state ahead of its canonical block
        self._speculative = any(
            int(getattr(g.kv_cache_spec, "num_speculative_blocks", 0) or 0) > 0
            for g in kv_cache_config.kv_cache_groups
        )
        self._pool: BlockPool | None = None
        self._requests: dict[str, Request] = {}
        self._restores: dict[str, _Restore] = {}
        self._step = 0
        """Steps whose metadata this side built (stamped on each metadata)."""
        self._off_thread = False
        """True during a hand-over: vLLM's block pool must not be touched."""
        self._deferred_unpins: list[int] = []
        self._wait_left = options.lookup_wait
        """Seconds this step's lookups may still wait for answers (``lookup_wait``)."""
        # KV events for routers (docs/vllm.md §A.9): only when vLLM publishes them.
        self._hasher = router_hasher
        self._events: RouterEvents | None = None
        self._views: tuple[GroupView, ...] = ()
        if router_hasher is not None:
            self._views = tuple(
                GroupView(
                    info.index,
                    info.kind,
                    info.block_size,
                    kv_cache_spec_kind_name(g.kv_cache_spec),
                )
                for info, g in zip(self._groups, kv_cache_config.kv_cache_groups, strict=True)
            )
            self._events = RouterEvents(
                self._client,
                interval=options.kv_events_poll_interval,
                max_checkpoints=options.kv_events_max_checkpoints,
                clock=clock,
                poll_timeout=max(1.0, min(options.rpc_timeout, 10.0)),
            )

    # ------------------------------------------------------------------ properties

    @property
    def groups(self) -> tuple[GroupInfo, ...]:
        """The KV-cache groups, in vLLM's order."""
        return self._groups

    @property
    def counters(self) -> dict[str, int]:
        """Cumulative counters (restored/recomputed tokens, stores, failures;
        with KV events, ``kv_events_*``)."""
        out = dict(self._counters)
        if self._events is not None:
            out.update(self._events.counters)
        return out

    @property
    def router_events(self) -> RouterEvents | None:
        """The KV events this engine publishes for routers (None: KV events off)."""
        return self._events

    def _router_keys(self, request: Request, num_tokens: int) -> CheckpointKeys | None:
        """The checkpoint's router view (KV events on), or None."""
        if self._hasher is None:
            return None
        try:
            return checkpoint_keys(request, num_tokens, self._views, self._hasher)
        except Exception as e:  # never fail a store or restore over an event
            logger.warning("KV event keys of %s not built: %s", request.request_id, e)
            self._counters["kv_events_keys_failed"] += 1
            return None

    def take_events(self) -> list[Any]:
        """``take_events``: the router events of this step (KV events on)."""
        if self._events is None or self._closed:
            return []
        return self._events.step()

    def bind_block_pool(self, pool: BlockPool) -> None:
        """vLLM's block pool: store sources are pinned in it."""
        self._pool = pool

    def _check_layout(self, rank: int, layout: Mapping[str, Any]) -> None:
        if layout.get("format") != LAYOUT_FORMAT:
            raise ValueError(
                f"rank {rank} reported a {layout.get('format')!r} layout; upstream mode needs "
                f"{LAYOUT_FORMAT!r} (every rank must run the same connector mode)"
            )
        groups = layout.get("groups")
        if not isinstance(groups, list) or len(groups) != len(self._groups):
            raise ValueError(f"rank {rank} reported a layout for another set of KV-cache groups")
        for info, described in zip(self._groups, groups, strict=True):
            if (
                not isinstance(described, Mapping)
                or described.get("name") != info.name
                or described.get("kind") != info.kind
                or described.get("block_size") != info.block_size
            ):
                raise ValueError(f"rank {rank} describes KV-cache group {info.index} differently")

    def _page_bytes(self, group: GroupInfo) -> int:
        assert self._negotiation.layout is not None
        return int(self._negotiation.layout["groups"][group.index]["page_bytes"])

    # ------------------------------------------------------------------ identity

    def _roots(self, request: Request, num_tokens: int) -> rc.TokenRoots:
        tokens = list(request.all_token_ids)[:num_tokens]
        return rc.TokenRoots.build(
            self._negotiation.namespace(request.cache_salt),
            tokens,
            chunk_tokens=self._options.chunk_tokens,
        )

    # ------------------------------------------------------------------ restores

    def on_new_request(self, request: Request) -> None:
        """Remember the request (stores of its boundaries need its tokens)."""
        self._requests[request.request_id] = request

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """``(None, False)`` while the lookup runs; ``(n, True)`` to restore ``n``
        tokens past ``num_computed_tokens`` asynchronously; else ``(0, False)``."""
        rid = request.request_id
        self._requests.setdefault(rid, request)
        if self._closed or not handles(request):
            return 0, False
        if not self._negotiation.settled():
            return None, False  # layouts still arriving: the namespace is not known yet
        if self._negotiation.layout is None:
            return 0, False
        restore = self._restores.get(rid)
        if restore is None:
            restore = _Restore(rid, RestorePhase.DONE, limit=int(request.num_tokens) - 1)
            self._restores[rid] = restore
            awaited = self._own_store_ahead(request, restore.limit, num_computed_tokens)
            if awaited is not None:
                # the previous turn's answer is being stored right now: a FIND
                # sent before its publication would restore an older checkpoint
                restore.phase = RestorePhase.WAITING_STORE
                restore.awaited = awaited
                restore.started = self._clock()
                self._counters["lookup_waits_own_store"] += 1
                return None, False
            return self._find(request, restore, num_computed_tokens)
        if restore.phase is RestorePhase.WAITING_STORE:
            return self._await_store(request, restore, num_computed_tokens)
        if restore.phase is RestorePhase.FINDING:
            return self._advance_find(request, restore, num_computed_tokens)
        if restore.phase is RestorePhase.FOUND:
            return self._offer(restore, num_computed_tokens)
        if restore.phase is RestorePhase.RETRY:
            return self._find(request, restore, num_computed_tokens)
        return 0, False

    def _own_store_ahead(self, request: Request, limit: int, num_computed: int) -> _Task | None:
        """The longest store of this engine not published yet that holds a
        checkpoint of ``request``'s exact prefix of at most ``limit`` tokens,
        beyond its local hit, or None: a FIND now would miss it (the next
        turn of a conversation arrives as soon as the previous answer is out,
        while that answer's checkpoint is still being copied)."""
        pending = [pb.task for pb in self._begins]
        pending += [t for t in self._tasks.values() if t.direction == "STORE"]
        if not pending:
            return None
        best: _Task | None = None
        try:
            namespace = self._negotiation.namespace(request.cache_salt)
            tokens: Sequence[int] | None = None
            for task in pending:
                prefix = task.manifest.prefix
                n = int(prefix.num_tokens)
                if not num_computed < n <= limit or prefix.namespace != namespace:
                    continue
                if best is not None and n <= best.manifest.prefix.num_tokens:
                    continue
                if tokens is None:
                    tokens = list(request.all_token_ids)
                if tuple(tokens[prefix.start_tokens : n]) != prefix.tail_tokens:
                    continue  # cheap: most candidates part in their last chunk
                if self._roots(request, n).prefix(n) == prefix:
                    best = task
        except Exception as e:  # a request that cannot be keyed waits for nothing
            logger.debug("own-store check of %s failed: %s", request.request_id, e)
            return None
        return best

    def _await_store(
        self, request: Request, restore: _Restore, num_computed: int
    ) -> tuple[int | None, bool]:
        """``WAITING_STORE``: once the awaited store is published its
        manifest is offered at once (it is what a FIND would answer, without
        the round trip); dropped, or waited on past ``lookup_timeout``, the
        lookup goes on with a FIND."""
        task = restore.awaited
        assert task is not None
        waited = self._clock() - restore.started
        if task.committed is None:
            if waited < min(self._lookup_timeout, OWN_STORE_WAIT):
                return None, False
            self._counters["lookup_own_store_timeout"] += 1
        restore.awaited = None
        self._counters["lookup_own_store_wait_ms"] += round(waited * 1000)
        if task.committed and self._usable(request, task.manifest, restore.limit):
            restore.manifest = task.manifest
            restore.num_tokens = int(task.manifest.prefix.num_tokens)
            restore.tiers = None  # just published from L1: never slower than recomputing
            restore.phase = RestorePhase.FOUND
            self._counters["lookup_found_own_store"] += 1
            return self._offer(restore, num_computed)
        return self._find(request, restore, num_computed)

    def _finish(self, restore: _Restore, reason: str) -> tuple[int, bool]:
        """Ends a lookup without a restore: ``(0, False)``."""
        self._finish_lookup(restore, reason)
        return 0, False

    def _find(
        self, request: Request, restore: _Restore, num_computed: int
    ) -> tuple[int | None, bool]:
        """Sends a FIND for checkpoints of at most ``restore.limit`` tokens;
        an answer that comes within what is left of this step's
        ``lookup_wait`` is taken at once (the request is not put off a step)."""
        if restore.limit <= num_computed:
            return self._finish(restore, "local-hit")
        if self._send_find(restore, lambda: self._roots(request, restore.limit).roots):
            if self._wait_briefly(restore):
                return self._advance_find(request, restore, num_computed)
            return None, False
        return 0, False

    def _wait_briefly(self, restore: _Restore) -> bool:
        """Waits for the FIND in flight up to the step's remaining
        ``lookup_wait`` (the GIL released); whether it is answered. The
        budget is per step, so a burst of new requests or a sidecar that does
        not answer costs the scheduler at most ``lookup_wait`` a step."""
        future = restore.future
        if future is None or self._wait_left <= 0:
            return future is not None and future.done()
        started = time.monotonic()
        try:
            future.result(self._wait_left)
        except Exception:  # a timeout stays pending; an error is taken by the poll
            pass
        self._wait_left -= time.monotonic() - started
        answered = future.done()
        self._counters["lookups_answered_in_step" if answered else "lookups_answered_later"] += 1
        return answered

    def _advance_find(
        self, request: Request, restore: _Restore, num_computed: int
    ) -> tuple[int | None, bool]:
        answered, found = self._poll_find(restore)
        if not answered:
            return None, False
        if found is None:
            return 0, False  # the lookup ended: recompute
        if not self._usable(request, found, restore.limit):
            return self._finish(restore, "incompatible")
        restore.manifest = found
        restore.num_tokens = found.prefix.num_tokens
        if restore.num_tokens > num_computed and self._skip_restore(
            restore, restore.num_tokens - num_computed
        ):
            return 0, False  # cheaper to recompute: the lookup ended
        restore.phase = RestorePhase.FOUND
        return self._offer(restore, num_computed)

    def _offer(self, restore: _Restore, num_computed: int) -> tuple[int, bool]:
        if restore.num_tokens <= num_computed:
            return self._finish(restore, "local-at-least-as-long")
        return restore.num_tokens - num_computed, True

    def _usable(self, request: Request, manifest: rc.Manifest, limit: int) -> bool:
        """Checks a FIND answer against this engine before offering it to vLLM."""
        try:
            n = check_found_prefix(
                manifest, self._world_size, limit, lambda k: self._roots(request, k).prefix(k)
            )
            payload = rc.CheckpointPayload.parse(manifest.payload)
            if payload.worker_layout != self._negotiation.layout:
                raise ValueError("worker layout differs")
            if payload.num_tokens != n or payload.kind is not None:
                raise ValueError("not an upstream-mode checkpoint of its prefix")
            groups = payload.page_groups
            if [g.get("name") for g in groups] != [g.name for g in self._groups]:
                raise ValueError("page groups differ from this engine's KV-cache groups")
            for info, group in zip(self._groups, groups, strict=True):
                if group.get("page_bytes") != self._page_bytes(info):
                    raise ValueError(f"page group {info.name} has a different page size")
                if group.get("positions") != info.positions(n):
                    raise ValueError(f"page group {info.name} covers other positions")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("checkpoint for %s not usable here: %s", request.request_id, e)
            return False
        return True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Turns vLLM's allocation for an accepted hit into one RETRIEVE task."""
        restore = self._restores.get(request.request_id)
        if restore is None or restore.phase is not RestorePhase.FOUND:
            return  # not ours, or the second call after a finished load
        if num_external_tokens <= 0:
            self._finish(restore, "not-loaded")
            return
        assert restore.manifest is not None
        n = restore.num_tokens
        local = n - num_external_tokens
        table = blocks.get_block_ids()
        block_ids: list[tuple[int, ...]] = []
        error = ""
        for info in self._groups:
            ids = list(table[info.index]) if info.index < len(table) else []
            row: list[int] = []
            for p in info.positions(n):
                if info.kind == "attention" and (p + 1) * info.block_size <= local:
                    row.append(0)  # a page of the local hit: already in place
                    continue
                block = ids[p] if p < len(ids) else 0
                if block == 0 and not error:
                    error = f"vLLM allocated no block for page {p} of group {info.name}"
                row.append(block)
            block_ids.append(tuple(row))
        task = _Task(
            task_id=uuid.uuid4().hex,
            direction="RETRIEVE",
            manifest=restore.manifest,
            block_ids=tuple(block_ids),
            request_id=request.request_id,
            kind="restore",
            error=error,
            keys=self._router_keys(request, n),
        )
        self._tasks[task.task_id] = task
        restore.phase = RestorePhase.RESTORING
        restore.task_id = task.task_id
        restore.restored = num_external_tokens
        self._counters["restores_started"] += 1

    # ------------------------------------------------------------------ stores

    def _store(
        self,
        request: Request,
        num_tokens: int,
        table: Sequence[Sequence[int]],
        recurrent: Mapping[int, int],
        kind: str,
    ) -> bool:
        """Pins the blocks of a checkpoint of ``num_tokens`` and sends BEGIN."""
        if self._pool is None or self._negotiation.layout is None:
            self._counters["store_skipped"] += 1
            return False
        if len(self._tasks) + len(self._begins) >= self._options.max_tasks:
            self._counters["store_skipped_capacity"] += 1
            return False
        block_ids: list[tuple[int, ...]] = []
        for info in self._groups:
            row: tuple[int, ...]
            if info.kind == "recurrent":
                row = (int(recurrent.get(info.index, 0)),)
            else:
                ids = list(table[info.index]) if info.index < len(table) else []
                row = tuple(int(ids[p]) if p < len(ids) else 0 for p in info.positions(num_tokens))
            if any(b == 0 for b in row):
                self._counters["store_skipped_blocks"] += 1
                return False
            block_ids.append(row)
        try:
            manifest = self._manifest(request, num_tokens, kind)
        except Exception as e:
            logger.warning("checkpoint store for %s not built: %s", request.request_id, e)
            self._counters["store_build_failed"] += 1
            return False
        pins = tuple(dict.fromkeys(b for row in block_ids for b in row))
        self._pool.touch([self._pool.blocks[b] for b in pins])
        task = _Task(
            task_id=uuid.uuid4().hex,
            direction="STORE",
            manifest=manifest,
            block_ids=tuple(block_ids),
            request_id=request.request_id,
            kind=kind,
            pins=pins,
            ready_step=self._step if kind == "prompt" else 0,
            keys=self._router_keys(request, num_tokens),
        )
        try:
            future = self._client.begin_async(manifest)
        except SidecarDown:  # the outage is logged once, not per request
            self._drop_store(task, "store_skipped_sidecar_down")
            return False
        except Exception as e:
            logger.warning("checkpoint store for %s not started: %s", request.request_id, e)
            self._drop_store(task, "store_begin_failed")
            return False
        self._begin(task, future)
        self._counters[f"stores_begun_{kind}"] += 1
        return True

    def _manifest(self, request: Request, n: int, kind: str) -> rc.Manifest:
        roots = self._roots(request, n)
        boundaries: list[tuple[int, str]] = []
        for info in self._groups:
            if info.kind == "recurrent":
                boundaries.extend(recurrent_boundaries(n, info.index, info.positions(n)))
            else:
                boundaries.extend(
                    (min((p + 1) * info.block_size, n), f"attention:{info.index}")
                    for p in info.positions(n)
                )
        keys = roots.content_keys(boundaries)
        groups: list[dict[str, Any]] = []
        at = 0
        for info in self._groups:
            positions = info.positions(n)
            groups.append(
                {
                    "name": info.name,
                    "page_bytes": self._page_bytes(info),
                    "positions": positions,
                    "content_keys": keys[at : at + len(positions)],
                }
            )
            at += len(positions)
        assert self._negotiation.layout is not None
        payload = rc.CheckpointPayload.build(
            worker_layout=self._negotiation.layout, page_groups=groups, num_tokens=n
        )
        prefix = roots.prefix(n)
        generation = rc.checkpoint_generation(prefix, payload)
        return rc.Manifest(generation, prefix, self._world_size, payload)

    def _offers(self, scheduler_output: SchedulerOutput) -> None:
        """Stores from this step's boundary-state offers (the store policy)."""
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        if state is None or not state.boundary_state_offloads or not self._recurrent:
            return
        policy = self._options.store_prompt
        if policy == "none":
            return
        wanted = {g.index for g in self._recurrent}
        step = min(g.block_size for g in self._recurrent)
        for rid, entries in state.boundary_state_offloads.items():
            request = self._requests.get(rid)
            if request is None or not handles(request) or self._closed:
                continue
            by_boundary: dict[int, dict[int, int]] = {}
            for group, block, boundary in entries:
                if group in wanted and block:
                    by_boundary.setdefault(int(boundary), {})[int(group)] = int(block)
            prompt = int(request.num_prompt_tokens)
            for boundary, blocks in sorted(by_boundary.items()):
                if boundary > prompt or set(blocks) != wanted:
                    continue
                if policy == "last" and boundary + step <= prompt - 1:
                    # vLLM retains the state below the last prompt token (a
                    # replay recomputes that token), so a later boundary comes
                    continue
                table = state.get_block_ids(rid)
                if table is None:
                    self._counters["store_skipped_blocks"] += 1
                    continue
                self._store(request, boundary, table, blocks, "prompt")

    def request_finished(
        self, request: Request, block_ids: Sequence[Sequence[int]] = ()
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished_all_groups``: store the response state, forget the
        request. Never delays vLLM's free (store sources are pinned instead)."""
        self._release_deferred()
        rid = request.request_id
        self._requests.pop(rid, None)
        restore = self._restores.pop(rid, None)
        if restore is not None and restore.phase is RestorePhase.RESTORING:
            return False, None  # the load drains; vLLM frees its blocks after finished_recving
        status = str(getattr(getattr(request, "status", None), "name", "FINISHED_STOPPED"))
        if (
            self._options.store_response
            and not self._closed
            and handles(request)
            and status in _COMPLETED
        ):
            n = int(request.num_computed_tokens)
            in_flight = int(getattr(request, "num_in_flight_tokens", 0) or 0)
            if self._speculative:
                # the state of n tokens may not be in its canonical block yet
                # (vLLM moves accepted drafts' states at the next step)
                self._counters["store_skipped_speculative"] += 1
            elif in_flight:
                # async scheduling: a forward past the end may be writing the
                # tail block; the previous prompt's checkpoint still serves
                self._counters["store_skipped_in_flight"] += 1
            elif n > 0:
                recurrent: dict[int, int] = {}
                for info in self._recurrent:
                    ids = list(block_ids[info.index]) if info.index < len(block_ids) else []
                    idx = cdiv(n, info.block_size) - 1
                    recurrent[info.index] = int(ids[idx]) if idx < len(ids) else 0
                self._store(request, n, block_ids, recurrent, "response")
        return False, None

    def _release_store(self, task: _Task) -> None:
        self._unpin(task)

    def _drop_store(self, task: _Task, counter: str) -> None:
        task.committed = False
        if counter == "store_suppressed" and self._events is not None:
            # an identical checkpoint is listed (or pending): routers may learn it
            self._events.learned(task.manifest.generation, task.keys)
        super()._drop_store(task, counter)

    def _unpin(self, task: _Task) -> None:
        if task.pins and self._pool is not None:
            if self._off_thread:  # vLLM's pool belongs to the scheduler thread
                self._deferred_unpins.extend(reversed(task.pins))
            else:
                self._pool.free_blocks([self._pool.blocks[b] for b in reversed(task.pins)])
        task.pins = ()

    def _release_deferred(self) -> None:
        """Frees the pins a hand-over released (on the scheduler thread)."""
        if self._deferred_unpins and self._pool is not None:
            pins, self._deferred_unpins = self._deferred_unpins, []
            self._pool.free_blocks([self._pool.blocks[b] for b in pins])

    # ------------------------------------------------------------------ hand-over

    def has_unsent_work(self) -> bool:
        """Whether BEGINs are unanswered or store tasks wait for a step to be sent."""
        if self._closed:
            return False
        return bool(self._begins) or any(
            not t.sent and t.direction == "STORE" for t in self._tasks.values()
        )

    def hand_over(
        self, submit: Callable[[CheckpointEngineTask], None], saved_step: int, room: int
    ) -> bool:
        """Idle or exiting engine (:mod:`lmcache_rc.vllm.local`): answered BEGINs
        become tasks, and unsent store tasks whose bytes are final (their
        step's forward ended on every rank: ``ready_step <= saved_step``) go
        to the local ranks through ``submit`` now, instead of in the next
        step's metadata — at most ``room`` of them (what every rank's copy
        queue admits now: a refused copy would fail its store). Never touches
        vLLM's block pool. Returns True while BEGINs are still unanswered or
        final tasks wait for room."""
        if self._closed:
            return False
        self._off_thread = True
        waiting = False
        try:
            self._pump_begins()
            for task in list(self._tasks.values()):
                if task.sent or task.direction != "STORE" or task.ready_step > saved_step:
                    continue
                if room <= 0:
                    waiting = True
                    break
                task.sent = True
                submit(task.engine_task())
                room -= 1
                self._counters["tasks_handed_over"] += 1
        finally:
            self._off_thread = False
        return bool(self._begins) or waiting

    # ------------------------------------------------------------------ per step

    def build_meta(self, scheduler_output: SchedulerOutput) -> CheckpointConnectorMetadata:
        """``build_connector_meta``: this step's stores and restores, each task once.

        Raises :class:`DisableConnector` when this vLLM does not pass boundary
        states to connectors (no ``kv_connector_block_state``)."""
        if not hasattr(scheduler_output, "kv_connector_block_state"):
            raise DisableConnector(
                "the scheduler output has no kv_connector_block_state: this vLLM does not "
                "offer boundary states to connectors (vLLM 0.33 or later is needed)"
            )
        self._release_deferred()
        self._step += 1
        self._wait_left = self._options.lookup_wait  # the next step's lookups may wait again
        self._step_scheduled(scheduler_output)
        self._negotiation.settled()
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            restore = self._restores.get(rid)
            if restore is not None and restore.phase is not RestorePhase.RESTORING:
                del self._restores[rid]  # a resumed request looks up afresh
        self._offers(scheduler_output)
        self._pump_begins()
        self._report_engine()
        # Never more at the ranks than their copy queues admit (a refused
        # restore would fail and recompute); restores first: a request is
        # parked on each, stores only hold blocks. A deferred restore's
        # request simply stays in WAITING_FOR_REMOTE_KVS a step longer.
        out = self._send_tasks(self._options.max_copies_per_rank, restores_first=True)
        return CheckpointConnectorMetadata(out, step=self._step)

    def _engine_task(self, task: _Task) -> CheckpointEngineTask:
        return task.engine_task()

    def update(self, connector_output: Any) -> None:
        """``update_connector_output``: frees deferred pins, then takes layouts
        and rank results (:meth:`TaskBook.update`)."""
        self._release_deferred()
        super().update(connector_output)

    def _complete(self, task: _Task) -> None:
        ok = all(task.results.values())
        if ok and self._events is not None:
            self._events.learned(task.manifest.generation, task.keys)
        if task.direction == "STORE":
            task.committed = ok
            if ok:
                self._counters[f"stores_committed_{task.kind}"] += 1
            else:
                self._counters["stores_failed"] += 1
                self._abort(task.manifest.generation)
            self._unpin(task)
            return
        restore = self._restores.get(task.request_id)
        current = restore is not None and restore.task_id == task.task_id
        if ok:
            self._counters["restores_done"] += 1
            if current and restore is not None:
                self._counters["tokens_restored"] += restore.restored
                restore.phase = RestorePhase.DONE
                restore.reason = "restored"
            return
        self._counters["restores_failed"] += 1
        if current and restore is not None:
            # vLLM recomputes and asks again: look for a strictly shorter checkpoint
            restore.phase = RestorePhase.RETRY
            restore.limit = restore.num_tokens - 1
            restore.task_id = None

    def reset(self) -> bool:
        """``reset_cache``: this engine stops restoring anything stored before
        (a new epoch enters its identity); lookups in progress start over."""
        for rid, restore in list(self._restores.items()):
            if restore.phase is not RestorePhase.RESTORING:
                del self._restores[rid]
        if self._events is not None:
            self._events.reset()
            # what is still in flight belongs to the old epoch: never announced
            for task in self._tasks.values():
                task.keys = None
            for pb in self._begins:
                pb.task.keys = None
        return super().reset()

    def has_pending_work(self) -> bool:
        """``has_pending_push_work``: stores and copies outstanding, or (KV
        events on) a change-feed answer an announcement waits for."""
        if super().has_pending_work():
            return True
        return self._events is not None and not self._closed and self._events.busy()

    # ------------------------------------------------------------------ status

    def report_status(self) -> dict[str, Any]:
        """A snapshot for humans and tests."""
        status = {
            "mode": "upstream",
            **self._status(self._restores.values()),
            "requests": len(self._requests),
            "pinned_blocks": sum(len(t.pins) for t in self._tasks.values())
            + sum(len(pb.task.pins) for pb in self._begins),
            "kv_events": None if self._events is None else self._events.status(),
        }
        if self._events is not None:
            status["counters"] = dict(
                sorted({**status["counters"], **self._events.counters}.items())
            )
        return status

    def stats(self) -> tuple[dict[str, int], dict[str, float]]:
        """:meth:`TaskBook.stats`, with the KV-event counters, blocks pinned
        in vLLM's pool, lookups in flight and requests known."""
        counters, gauges = super().stats()
        if self._events is not None:
            counters.update(self._events.counters)
        gauges["pinned_blocks"] = float(
            sum(len(t.pins) for t in self._tasks.values())
            + sum(len(pb.task.pins) for pb in self._begins)
        )
        gauges["lookups_pending"] = float(
            sum(1 for r in self._restores.values() if r.phase is RestorePhase.FINDING)
        )
        gauges["requests"] = float(len(self._requests))
        return counters, gauges

    def html(self) -> str:
        """:meth:`report_status` as an HTML table."""
        return self._html("lmcache-rc (upstream mode)")

    def _repr_html_(self) -> str:
        return self.html()
