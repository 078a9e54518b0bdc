"""Scheduler-side pieces both modes share.

What it owns: the scheduler hooks the connector delegates to
(:class:`SchedulerSide`: every hook with its "nothing to do" answer, which
is also the side of a connector that is not bound or is disabled), the
lookup state machine (:class:`Lookup`, FIND sent, polled, timed out or
ended, in :class:`TaskBook`) and its phases (:class:`RestorePhase`),
copy tasks and their bookkeeping up to the last rank's result
(:class:`CopyTask`, :class:`TaskBook`: BEGINs, ABORTs, results counted
once, tasks sent within the ranks' copy bound, close),
layout negotiation with the worker ranks (:class:`LayoutNegotiation`: every
rank reports one address-free layout; all must agree before any lookup or
store, because the layout is part of the namespace, I3), the namespace cache
per cache salt, the canonical JSON that payloads and layouts are compared
in, and which requests may use the sidecar at all (:func:`handles`).

What it must never do: block on the sidecar (every call is an ``*_async``
future polled once per step) or touch vLLM's allocator.
"""

from __future__ import annotations

import enum
import html
import json
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import lmcache_rc as rc
from lmcache_rc import errors
from lmcache_rc.vllm.api import CheckpointEngineTask, Direction
from lmcache_rc.vllm.metadata import CheckpointConnectorMetadata, CheckpointWorkerMetadata
from lmcache_rc.vllm.restore_cost import PrefillMeter, SkipRule, TierLoad
from lmcache_rc.vllm.sidecar import NonBlockingSidecar, SidecarClient, SidecarDown, SidecarFuture

__all__ = [
    "CopyTask",
    "DisableConnector",
    "LayoutNegotiation",
    "Lookup",
    "PendingBegin",
    "RestorePhase",
    "SchedulerSide",
    "TaskBook",
    "canonical",
    "check_found_prefix",
    "check_rank",
    "handles",
    "poll_find",
    "recurrent_boundaries",
]

logger = logging.getLogger(__name__)


class RestorePhase(enum.StrEnum):
    """Where one request's restore stands (the values are what status reports)."""

    FINDING = "finding"
    """A FIND is in flight."""
    FOUND = "found"
    """Upstream: a usable checkpoint was found and offered to vLLM."""
    WAITING = "waiting-capacity"
    """Boundary: a manifest was chosen; the allocator had no room yet."""
    WAITING_STORE = "waiting-store"
    """Upstream: this engine is storing a longer checkpoint of the request's
    prefix (the previous turn's answer, say); the lookup waits until it is
    published or dropped."""
    RESTORING = "restoring"
    """A RETRIEVE task owns the destination blocks."""
    PUBLISHED = "published"
    """Boundary: the import is published for this request; admit."""
    RETRY = "retry"
    """The restore failed; the next ask looks up again (a shorter checkpoint)."""
    DONE = "done"
    """Nothing (more) to restore."""


@dataclass(eq=False)
class Lookup:
    """One request's lookup and restore, the part both modes share (each
    mode's record extends it). Identity by object, so a reused request id
    never inherits another request's lookup."""

    request_id: str
    phase: RestorePhase
    attempts: int = 0
    """FINDs sent for this request."""
    started: float = 0.0
    """When the FIND in flight was sent (the clock's seconds)."""
    future: SidecarFuture | None = None
    manifest: rc.Manifest | None = None
    """The usable FIND answer."""
    num_tokens: int = 0
    """Tokens of the checkpoint being restored."""
    task_id: str | None = None
    """The RETRIEVE task restoring it."""
    reason: str = ""
    """Why it ended (``lookup_<reason>`` is the counter)."""
    tiers: tuple[TierLoad, ...] | None = None
    """Where the found checkpoint's pages sit (a ``find_located`` answer;
    None after a plain FIND)."""
    located: bool = False
    """Whether the FIND in flight is a ``find_located``."""
    query: tuple[rc.Prefix, ...] = ()
    """The roots of the ``find_located`` in flight (sent again as a plain
    FIND by a sidecar that refuses it)."""


class DisableConnector(Exception):
    """Raised by a scheduler side from a hook when this vLLM cannot serve it;
    the connector disables itself with the message (and closes the side)."""


class SchedulerSide:
    """The scheduler hooks the connector delegates to, one method per vLLM
    hook (the fork's boundary hooks included), each with its "nothing to do"
    answer. This class itself is the side of a connector that is not bound
    yet, disabled, or in the worker role; :class:`TaskBook` is the base of
    the two modes' sides, each overriding what its mode does."""

    bound = False
    """Whether this side serves a bound cache (a mode's side)."""

    def bind_block_pool(self, pool: Any) -> None:
        """vLLM's block pool (upstream stores pin their sources in it)."""

    def on_new_request(self, request: Any) -> None:
        """A request arrived."""

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """``(0, False)``: nothing to restore."""
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated blocks for ``request``."""

    def poll(self, request: Any) -> bool:
        """``poll_boundary_checkpoint``: True, the request goes on."""
        return True

    def external_tokens(self, request: Any) -> int:
        """``boundary_checkpoint_external_tokens``: 0."""
        return 0

    def store(self, request: Any, checkpoint: Any) -> bool:
        """``store_boundary_checkpoint``: False, nothing stored."""
        return False

    def build_meta(self, scheduler_output: Any) -> CheckpointConnectorMetadata:
        """No tasks."""
        return CheckpointConnectorMetadata()

    def update(self, connector_output: Any) -> None:
        """Rank layouts and results: none expected."""

    def request_finished(
        self, request: Any, block_ids: Sequence[Sequence[int]] = ()
    ) -> tuple[bool, dict[str, Any] | None]:
        """``(False, None)``: vLLM frees the blocks at once."""
        return False, None

    def has_pending_work(self) -> bool:
        """False: nothing keeps the engine stepping."""
        return False

    def take_events(self) -> list[Any]:
        """``take_events``: no KV events."""
        return []

    def reset(self) -> bool:
        """``reset_cache``: False, nothing to reset."""
        return False

    def report_status(self) -> dict[str, Any]:
        """Nothing to report beyond the connector's own fields."""
        return {}

    def stats(self) -> tuple[dict[str, int], dict[str, float]]:
        """Cumulative counters and current gauges, cheap enough for every
        step (vLLM's connector-stats path, :mod:`lmcache_rc.vllm.stats`)."""
        return {}, {}

    def html(self) -> str | None:
        """An HTML table of :meth:`report_status`, or None (the connector shows JSON)."""
        return None

    def close(self) -> None:
        """Stop."""


def canonical(value: Any) -> bytes:
    """Sorted-key, compact JSON: the form manifests carry layouts in."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def recurrent_boundaries(
    num_tokens: int, group: int, positions: Sequence[int]
) -> list[tuple[int, str]]:
    """Content-key boundaries of a recurrent group's pages at ``num_tokens``.

    One position (the usual case) keeps the discriminator ``recurrent:<g>``;
    several positions each get their own, ``recurrent:<g>:<position>``: with
    one key for all of them only one page would be stored and no restore could
    place them all (the service refuses such payloads at begin).
    """
    if len(positions) == 1:
        return [(num_tokens, f"recurrent:{group}")]
    return [(num_tokens, f"recurrent:{group}:{int(p)}") for p in positions]


def check_rank(rank: Any, world_size: int) -> None:
    """ValueError unless ``rank`` is an integer in ``0..world_size-1``."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"worker rank must be an integer, got {rank!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"worker rank {rank} is outside 0..{world_size - 1}")


def handles(request: Any) -> bool:
    """Whether ``request`` may use the sidecar at all.

    LoRA requests never do (an adapter id does not authenticate adapter bytes,
    I3); multimodal requests and prompt embeddings neither (their placeholder
    tokens do not name the content).
    """
    if getattr(request, "lora_request", None) is not None:
        return False
    if getattr(request, "mm_features", None):
        return False
    return getattr(request, "prompt_embeds", None) is None


class LayoutNegotiation:
    """Collects one layout per rank; settles when all ``world_size`` agree, or
    fails after ``timeout`` seconds (then the engine serves without the sidecar).

    ``validate(rank, layout)`` checks one report (mode-specific); different
    reports are a ValueError (a bug or a misconfigured rank, never a miss).
    """

    def __init__(
        self,
        world_size: int,
        identity: Mapping[str, Any],
        *,
        timeout: float | None,
        clock: Callable[[], float],
        validate: Callable[[int, Mapping[str, Any]], None] | None = None,
    ) -> None:
        self.world_size = world_size
        self._identity = {k: v for k, v in identity.items() if k != "layout"}
        self._clock = clock
        self._validate = validate
        self._deadline = None if timeout is None else clock() + timeout
        self.reports: dict[int, dict[str, Any]] = {}
        self.layout: dict[str, Any] | None = None
        self.failed = False
        self._namespaces: dict[str, str] = {}

    def take(self, rank: int, layout: Mapping[str, Any]) -> None:
        """One rank's report."""
        check_rank(rank, self.world_size)
        if self._validate is not None:
            self._validate(rank, layout)
        try:  # the JSON form, as manifests carry it (tuples become lists)
            plain: dict[str, Any] = json.loads(canonical(layout))
        except (TypeError, ValueError) as e:
            raise ValueError(f"rank {rank} reported a layout that is not plain JSON: {e}") from e
        known = self.reports.get(rank)
        if known is not None and known != plain:
            raise ValueError(f"rank {rank} reported a different worker layout")
        for other, theirs in self.reports.items():
            if theirs != plain:
                raise ValueError(
                    f"worker layouts differ between rank {other} and rank {rank}: every rank "
                    "must expose the same checkpoint page layout"
                )
        self.reports[rank] = plain
        if self.layout is None and len(self.reports) == self.world_size:
            self.layout = plain
            self._namespaces.clear()
            logger.info("checkpoint worker layout negotiated with %d ranks", self.world_size)

    def settled(self) -> bool:
        """False while layouts may still arrive; True once negotiated or given up."""
        if self.layout is not None or self.failed:
            return True
        if self._deadline is not None and self._clock() >= self._deadline:
            self.failed = True
            missing = sorted(set(range(self.world_size)) - set(self.reports))
            logger.error(
                "checkpoint worker layout not reported by ranks %s in time; serving without "
                "external checkpoints",
                missing,
            )
            return True
        return False

    def new_epoch(self) -> int:
        """Puts a new ``reset_epoch`` into the identity: every checkpoint stored
        under the previous one becomes unreachable for this engine (vLLM's
        ``reset_prefix_cache(reset_connector=True)``, e.g. after weights
        changed in place). Returns the new epoch."""
        epoch = int(self._identity.get("reset_epoch", 0)) + 1
        self._identity["reset_epoch"] = epoch
        self._namespaces.clear()
        return epoch

    def namespace(self, cache_salt: str | None) -> str:
        """The checkpoint namespace of requests with ``cache_salt`` (needs the layout)."""
        if self.layout is None:
            raise RuntimeError("the worker layout is not negotiated yet")
        salt = cache_salt or ""
        ns = self._namespaces.get(salt)
        if ns is None:
            ns = rc.checkpoint_namespace({**self._identity, "layout": self.layout}, salt)
            self._namespaces[salt] = ns
        return ns


@dataclass(eq=False, kw_only=True)
class CopyTask:
    """One copy task, from creation to the last rank's result (both modes)."""

    task_id: str
    direction: Direction
    manifest: rc.Manifest
    block_ids: tuple[tuple[int, ...], ...]
    request_id: str
    sent: bool = False
    sent_at: float | None = None
    results: dict[int, bool] = field(default_factory=dict)


TaskT = TypeVar("TaskT", bound=CopyTask)


@dataclass(eq=False)
class PendingBegin(Generic[TaskT]):
    """A store whose BEGIN reply has not been seen yet."""

    task: TaskT
    future: SidecarFuture
    deadline: float


class TaskBook(SchedulerSide, Generic[TaskT]):
    """What both modes' scheduler sides do: layout negotiation, the lookup
    state machine (:meth:`_send_find`, :meth:`_poll_find`,
    :meth:`_finish_lookup`), BEGINs answered or timed out, ABORTs in the
    background, tasks sent within the ranks' copy bound, per-rank results
    counted exactly once until every rank reported, and close. Subclasses
    say what a dropped store releases (:meth:`_release_store`), what a
    completed task means (:meth:`_complete`), and what ends with a lookup
    (:meth:`_lookup_ended`).
    """

    bound = True

    def __init__(
        self,
        client: SidecarClient,
        world_size: int,
        *,
        identity: Mapping[str, Any],
        begin_timeout: float,
        lookup_timeout: float,
        max_lookup_attempts: int,
        layout_timeout: float | None,
        validate: Callable[[int, Mapping[str, Any]], None] | None,
        clock: Callable[[], float],
        skip_rule: SkipRule | None = None,
        engine_id: str = "",
        report_interval: float = 5.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if max_lookup_attempts < 1:
            raise ValueError("max_lookup_attempts must be at least 1")
        self._client = NonBlockingSidecar(client)
        self._world_size = world_size
        self._begin_timeout = begin_timeout
        self._lookup_timeout = lookup_timeout
        self._max_attempts = max_lookup_attempts
        self._clock = clock
        self._negotiation = LayoutNegotiation(
            world_size, identity, timeout=layout_timeout, clock=clock, validate=validate
        )
        self._tasks: dict[str, TaskT] = {}
        self._begins: list[PendingBegin[TaskT]] = []
        self._background: list[SidecarFuture] = []
        self._counters: Counter[str] = Counter()
        self._closed = False
        self._skip = skip_rule or SkipRule(enabled=False, threshold=1.0, meter=PrefillMeter())
        # Lookups ask where pages sit only for the skip rule, and only while
        # the sidecar answers it (an older one refuses find_located).
        self._located = self._skip.enabled and self._client.supports_located
        self._engine_id = engine_id or uuid.uuid4().hex
        self._report_interval = report_interval
        self._reported_at = float("-inf")
        self._report: SidecarFuture | None = None
        self._reports = report_interval > 0
        """Whether this engine's counters go to the sidecar (``report_engine``:
        shown by ``lmcache-rc status``); off once a sidecar refuses them."""

    # ------------------------------------------------------------------ layout

    @property
    def world_size(self) -> int:
        """Number of worker ranks every task must hear from."""
        return self._world_size

    @property
    def layout(self) -> dict[str, Any] | None:
        """The negotiated worker layout, or None while negotiation is open."""
        layout = self._negotiation.layout
        return None if layout is None else dict(layout)

    def namespace(self, cache_salt: str | None) -> str:
        """The checkpoint namespace of requests with ``cache_salt`` (needs the layout)."""
        return self._negotiation.namespace(cache_salt)

    # ------------------------------------------------------------------ lookups

    def _send_find(self, lookup: Lookup, roots: Callable[[], Iterable[rc.Prefix]]) -> bool:
        """Sends a FIND for ``roots()``: True while it is in flight; False when
        the lookup ended instead (attempts exhausted, FIND not sent)."""
        if lookup.attempts >= self._max_attempts:
            self._finish_lookup(lookup, "attempts-exhausted")
            return False
        lookup.attempts += 1
        lookup.started = self._clock()
        lookup.manifest = None
        lookup.tiers = None
        lookup.located = self._located
        try:
            if lookup.located:
                # kept until answered: sent again as a plain FIND if refused
                lookup.query = tuple(roots())
                lookup.future = self._client.find_located_async(lookup.query)
            else:
                lookup.future = self._client.find_async(roots())
        except SidecarDown:  # the outage is logged once, not per request
            self._finish_lookup(lookup, "sidecar-down")
            return False
        except Exception as e:  # the request cannot be keyed
            logger.warning("checkpoint lookup for %s failed to start: %s", lookup.request_id, e)
            self._finish_lookup(lookup, "find-error")
            return False
        lookup.phase = RestorePhase.FINDING
        self._counters["lookups"] += 1
        return True

    def _poll_find(self, lookup: Lookup) -> tuple[bool, rc.Manifest | None]:
        """Where the FIND in flight stands: ``(False, None)`` while pending;
        ``(True, manifest)`` answered; ``(True, None)`` when it gave nothing
        (miss, timeout, error: the lookup ended)."""
        future: SidecarFuture | None = lookup.future
        assert future is not None
        if lookup.located and future.done():
            try:
                future = _Answered(future.result(0))
            except errors.ProtocolError as e:
                # A sidecar without find_located: plain FINDs from now on (this
                # one again at once, not counted as another attempt).
                logger.warning(
                    "the lmcache-rc sidecar does not answer find_located (%s): restores are "
                    "not weighed against recomputing; upgrade the sidecar for "
                    "lmcache_rc.skip_cheaper_recompute",
                    e,
                )
                self._located = False
                lookup.located = False
                query, lookup.query = lookup.query, ()
                try:
                    lookup.future = self._client.find_async(query)
                except Exception as e2:
                    logger.warning("checkpoint lookup for %s failed: %s", lookup.request_id, e2)
                    self._finish_lookup(lookup, "find-error")
                    return True, None
                return False, None
            except Exception as e:
                future = _Answered(error=e)
        outcome, found = poll_find(
            future, lookup.started, self._lookup_timeout, self._clock(), lookup.request_id
        )
        if outcome == "pending":
            return False, None
        lookup.future = None
        lookup.query = ()
        if isinstance(found, Mapping):  # a find_located answer
            lookup.tiers = tuple(TierLoad.from_reply(t) for t in found.get("tiers", ()))
            found = found["manifest"]
        if found is None:
            self._finish_lookup(lookup, outcome)
        return True, found

    def _skip_restore(self, lookup: Lookup, tokens: int) -> bool:
        """The skip rule: True (and the lookup ended, counted as
        ``restores_skipped_cheaper_to_recompute``) when restoring ``tokens``
        tokens from where the found checkpoint sits is estimated to take
        longer than recomputing them."""
        if lookup.tiers is None or not self._skip.enabled:
            return False
        decision = self._skip.decide(lookup.request_id, tokens, lookup.tiers)
        if not decision.skip:
            return False
        logger.debug(
            "restore for %s skipped: %d tokens, load %.4f s > %g x recompute %.4f s",
            lookup.request_id,
            tokens,
            decision.restore_s,
            self._skip.threshold,
            decision.recompute_s,
        )
        self._counters["tokens_recomputed_instead"] += tokens
        self._finish_lookup(
            lookup, "cheaper-to-recompute", counter="restores_skipped_cheaper_to_recompute"
        )
        return True

    def _finish_lookup(self, lookup: Lookup, reason: str, counter: str | None = None) -> None:
        """Ends a lookup without a restore (counted as ``counter``, by
        default ``lookup_<reason>``)."""
        lookup.phase = RestorePhase.DONE
        lookup.reason = reason
        lookup.future = None
        self._counters[counter or f"lookup_{reason}"] += 1
        self._lookup_ended(lookup)

    def _lookup_ended(self, lookup: Lookup) -> None:
        """What a mode releases when a lookup ends without a restore."""

    def _release_store(self, task: TaskT) -> None:
        """What a store that ended (or will not run) releases."""
        raise NotImplementedError

    def _drop_store(self, task: TaskT, counter: str) -> None:
        """A store that will not run: release what it holds, count ``counter``."""
        self._release_store(task)
        self._counters[counter] += 1
        self._task_resolved(task)

    def _task_resolved(self, task: TaskT) -> None:
        """``task`` ended (completed or dropped)."""

    def _cancel_unsent_restore(self, task: TaskT) -> None:
        """At close: a restore never sent to the ranks (kept by default)."""

    def _complete(self, task: TaskT) -> None:
        """Every rank reported ``task``."""
        raise NotImplementedError

    def _begin(self, task: TaskT, future: SidecarFuture) -> None:
        self._begins.append(PendingBegin(task, future, self._clock() + self._begin_timeout))

    def _pump_begins(self) -> None:
        """Turns answered BEGINs into tasks; aborts failed or unanswered ones."""
        now = self._clock()
        still: list[PendingBegin[TaskT]] = []
        for pb in self._begins:
            task = pb.task
            if not pb.future.done():
                if now < pb.deadline:
                    still.append(pb)
                    continue
                logger.warning(
                    "no BEGIN reply for checkpoint %s within %.1f s; aborting the store",
                    task.manifest.generation,
                    self._begin_timeout,
                )
                self._abort(task.manifest.generation)
                self._drop_store(task, "store_begin_timeout")
                continue
            try:
                accepted = bool(pb.future.result(0))
            except errors.Unavailable as e:  # the connection went: the outage is logged once
                logger.debug("BEGIN of %s failed: %s", task.manifest.generation, e)
                self._abort(task.manifest.generation)
                self._drop_store(task, "store_skipped_sidecar_down")
                continue
            except Exception as e:
                logger.warning("BEGIN of %s failed: %s", task.manifest.generation, e)
                self._abort(task.manifest.generation)
                self._drop_store(task, "store_begin_failed")
                continue
            if not accepted:  # identical generation pending/listed, or no room: nothing to do
                self._drop_store(task, "store_suppressed")
                continue
            self._tasks[task.task_id] = task
        self._begins = still
        self._background = [f for f in self._background if not f.done()]

    def _abort(self, generation: str) -> None:
        try:
            future = self._client.abort_async(generation)
            if future is not None:
                self._background.append(future)
        except Exception as e:  # the server cleans up abandoned pending generations itself
            logger.warning("ABORT of %s could not be sent: %s", generation, e)

    def _take_results(self, results: Mapping[str, Mapping[int, bool]]) -> None:
        """Per-rank results of one step; a task completes when every rank reported.

        Raises ValueError for an unknown task, a rank outside the world or a
        rank reporting one task twice (bugs or misconfiguration, not misses).
        """
        for task_id, ranks in results.items():
            task = self._tasks.get(task_id)
            if task is None:
                raise ValueError(f"worker result for unknown checkpoint task {task_id}")
            for rank, ok in ranks.items():
                check_rank(rank, self._world_size)
                if rank in task.results:
                    raise ValueError(f"rank {rank} reported checkpoint task {task_id} twice")
                task.results[rank] = ok
            if len(task.results) == self._world_size:
                del self._tasks[task.task_id]
                self._complete(task)

    # ------------------------------------------------------------------ per step

    def _send_tasks(self, room: int, *, restores_first: bool = False) -> list[CheckpointEngineTask]:
        """The unsent tasks that fit ``room`` more at the ranks (oldest first,
        restores before stores if ``restores_first``), marked sent, each once;
        the rest wait a step (``tasks_deferred``)."""
        now = self._clock()
        unsent = [t for t in self._tasks.values() if not t.sent]
        if restores_first:
            unsent.sort(key=lambda t: t.direction != "RETRIEVE")
        room = max(0, room - sum(1 for t in self._tasks.values() if t.sent))
        out: list[CheckpointEngineTask] = []
        for task in unsent[:room]:
            task.sent = True
            task.sent_at = now
            out.append(self._engine_task(task))
        if len(unsent) > room:
            self._counters["tasks_deferred"] += len(unsent) - room  # sent in a later step
        self._counters["tasks_sent"] += len(out)
        return out

    def _engine_task(self, task: TaskT) -> CheckpointEngineTask:
        """The task as the worker ranks receive it."""
        raise NotImplementedError

    def _step_scheduled(self, scheduler_output: Any) -> None:
        """``build_connector_meta``: a step starts; the prefill meter times
        it until its output comes back (:meth:`update`)."""
        tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        if isinstance(tokens, int) and not isinstance(tokens, bool):
            self._skip.meter.scheduled(self._clock(), tokens)

    def update(self, connector_output: Any) -> None:
        """``update_connector_output``: take layouts and rank results.

        Raises ValueError on a protocol violation (different layouts, a rank
        outside ``0..world_size-1``, a rank reporting one task twice, an
        unknown task id): those are bugs or misconfiguration, not misses.
        """
        self._skip.meter.finished(self._clock())
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if meta is None:
            return
        if not isinstance(meta, CheckpointWorkerMetadata):
            raise ValueError(f"unexpected worker metadata {type(meta).__name__}")
        for rank, layout in sorted(meta.layouts.items()):
            self._negotiation.take(rank, layout)
        self._take_results(meta.results)

    def reset(self) -> bool:
        """``reset_cache``: this engine stops restoring anything stored before
        (a new epoch enters its identity). True."""
        epoch = self._negotiation.new_epoch()
        self._counters["resets"] += 1
        logger.info("lmcache-rc: connector cache reset; identity epoch %d", epoch)
        return True

    def has_pending_work(self) -> bool:
        """``has_pending_push_work``: True while layouts are negotiated or
        BEGINs and tasks are outstanding (results only arrive on engine steps)."""
        if self._closed:
            return False
        if not self._negotiation.settled():
            return True
        return bool(self._tasks or self._begins)

    def stats(self) -> tuple[dict[str, int], dict[str, float]]:
        """Cumulative counters, and gauges: copy tasks outstanding by
        direction, BEGINs unanswered, whether the sidecar is reachable."""
        stores = sum(1 for t in self._tasks.values() if t.direction == "STORE")
        gauges = {
            "tasks_store": float(stores),
            "tasks_restore": float(len(self._tasks) - stores),
            "begins_pending": float(len(self._begins)),
            "sidecar_connected": 1.0 if self._client.available else 0.0,
        }
        return dict(self._counters), gauges

    def _report_engine(self, force: bool = False) -> None:
        """Every ``report_interval`` seconds (or now, ``force``): this
        engine's counters to the sidecar, which shows them in its status
        beside its own. Never blocks: the previous report's answer is only
        looked at; a sidecar that does not know the call (older than this
        build) is not asked again."""
        if not self._reports or self._closed:
            return
        if self._report is not None and self._report.done():
            try:
                self._report.result(0)
            except errors.ProtocolError as e:
                logger.info("lmcache-rc: the sidecar keeps no engine reports (%s)", e)
                self._reports = False
                return
            except Exception:  # the sidecar went away: the next report tries again
                pass
            self._report = None
        now = self._clock()
        if self._report is not None or (
            not force and now - self._reported_at < self._report_interval
        ):
            return
        self._reported_at = now
        counters, _ = self.stats()
        try:
            self._report = self._client.report_engine_async(self._engine_id, counters)
        except Exception as e:  # a report never fails a step
            logger.debug("engine report not sent: %s", e)

    FINAL_REPORT_WAIT = 1.0
    """Seconds the final engine report (at close) may wait for the one in
    flight and for its own answer: bounded, so a shutdown never hangs on it."""

    def _final_report(self) -> None:
        """The engine's last counters, sent when it closes and answered
        before the connection goes (a report still in flight is waited for
        first), each wait at most :data:`FINAL_REPORT_WAIT`."""
        if not self._reports:
            return
        for attempt in range(2):
            if self._report is not None:
                try:
                    self._report.result(self.FINAL_REPORT_WAIT)
                except Exception:  # timed out or failed: the last report is best effort
                    pass
            if attempt == 0:
                self._report_engine(force=True)

    def _status(self, lookups: Iterable[Lookup]) -> dict[str, Any]:
        """The part of a status both modes report."""
        phases = Counter(str(lookup.phase) for lookup in lookups)
        directions = Counter(t.direction for t in self._tasks.values())
        return {
            "world_size": self._world_size,
            "layout_negotiated": self._negotiation.layout is not None,
            "layout_failed": self._negotiation.failed,
            "layout_ranks": sorted(self._negotiation.reports),
            "lookups": dict(phases),
            "tasks": {
                "STORE": directions.get("STORE", 0),
                "RETRIEVE": directions.get("RETRIEVE", 0),
                "unsent": sum(1 for t in self._tasks.values() if not t.sent),
            },
            "pending_begins": len(self._begins),
            "engine_id": self._engine_id,
            "counters": dict(sorted(self._counters.items())),
            "restore_cost": {**self._skip.report(), "find_located": self._located},
        }

    def close(self) -> None:
        """Stop lookups and stores. Pending BEGINs are aborted and what they
        hold released; unsent stores too; tasks already sent keep theirs
        (workers may copy)."""
        if self._closed:
            return
        self._final_report()
        self._closed = True
        for pb in self._begins:
            self._abort(pb.task.manifest.generation)
            self._release_store(pb.task)
        self._begins = []
        for task in list(self._tasks.values()):
            if task.sent:
                continue
            if task.direction == "STORE":
                del self._tasks[task.task_id]
                self._abort(task.manifest.generation)
                self._release_store(task)
            else:
                self._cancel_unsent_restore(task)

    def _html(self, caption: str) -> str:
        rows = []
        for key, value in self.report_status().items():
            text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
            rows.append(f"<tr><th>{html.escape(key)}</th><td>{html.escape(text)}</td></tr>")
        return f"<table><caption>{html.escape(caption)}</caption>" + "".join(rows) + "</table>"


class _Answered:
    """A finished future's outcome, read once (a ``find_located`` reply is
    inspected before :func:`poll_find` sees it)."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value = value
        self._error = error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


def poll_find(
    future: SidecarFuture, started: float, timeout: float, now: float, request_id: str
) -> tuple[str, rc.Manifest | None]:
    """Where a FIND stands: ``("pending", None)``, ``("found", manifest)``, or a
    reason it gave nothing (``"miss"``, ``"find-timeout"``, ``"find-error"``)."""
    if not future.done():
        if now - started < timeout:
            return "pending", None
        logger.warning(
            "no checkpoint lookup reply for %s within %.1f s; recomputing", request_id, timeout
        )
        return "find-timeout", None
    try:
        found = future.result(0)
    except errors.Unavailable as e:  # the connection went: the outage is logged once
        logger.debug("checkpoint lookup for %s failed: %s", request_id, e)
        return "sidecar-down", None
    except Exception as e:
        logger.warning("checkpoint lookup for %s failed: %s", request_id, e)
        return "find-error", None
    return ("miss", None) if found is None else ("found", found)


def check_found_prefix(
    manifest: rc.Manifest, world_size: int, limit: int, exact: Callable[[int], rc.Prefix]
) -> int:
    """The token count of a FIND answer, after checking it was stored by this
    many ranks, fits ``limit`` tokens and is ``exact(n)`` (the request's own
    prefix); ValueError otherwise."""
    n = int(manifest.prefix.num_tokens)
    if manifest.world_size != world_size:
        raise ValueError(f"world size {manifest.world_size} != {world_size}")
    if not 0 < n <= limit:
        raise ValueError(f"{n} tokens do not fit a limit of {limit}")
    if manifest.prefix != exact(n):
        raise ValueError("prefix is not this request's exact token prefix")
    return n
