"""Scheduler-side pieces both modes share.

What it owns: the restore state machine's phases (:class:`RestorePhase`),
copy tasks and their bookkeeping up to the last rank's result
(:class:`CopyTask`, :class:`TaskBook`),
layout negotiation with the worker ranks (:class:`LayoutNegotiation`: every
rank reports one address-free layout; all must agree before any lookup or
store, because the layout is part of the namespace, I3), the namespace cache
per cache salt, the canonical JSON that payloads and layouts are compared
in, and which requests may use the sidecar at all (:func:`handles`).

What it must never do: talk to the sidecar or to vLLM's allocator.
"""

from __future__ import annotations

import enum
import html
import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import lmcache_rc as rc
from lmcache_rc.vllm.api import Direction
from lmcache_rc.vllm.sidecar import NonBlockingSidecar, SidecarClient, SidecarFuture

__all__ = [
    "CopyTask",
    "LayoutNegotiation",
    "PendingBegin",
    "RestorePhase",
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
    RESTORING = "restoring"
    """A RETRIEVE task owns the destination blocks."""
    PUBLISHED = "published"
    """Boundary: the import is published for this request; admit."""
    RETRY = "retry"
    """The restore failed; the next ask looks up again (a shorter checkpoint)."""
    DONE = "done"
    """Nothing (more) to restore."""


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


class TaskBook(Generic[TaskT]):
    """What both modes' scheduler sides do with copy tasks: BEGINs answered or
    timed out, ABORTs in the background, per-rank results counted exactly once
    until every rank reported. Subclasses say what a dropped store releases
    (:meth:`_drop_store`) and what a completed task means (:meth:`_complete`).
    """

    def __init__(
        self,
        client: SidecarClient,
        world_size: int,
        *,
        begin_timeout: float,
        clock: Callable[[], float],
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self._client = NonBlockingSidecar(client)
        self._world_size = world_size
        self._begin_timeout = begin_timeout
        self._clock = clock
        self._tasks: dict[str, TaskT] = {}
        self._begins: list[PendingBegin[TaskT]] = []
        self._background: list[SidecarFuture] = []
        self._counters: Counter[str] = Counter()
        self._closed = False

    def _drop_store(self, task: TaskT, counter: str) -> None:
        """A store that will not run: release what it holds, count ``counter``."""
        raise NotImplementedError

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

    def report_status(self) -> dict[str, Any]:
        """A snapshot for humans and tests."""
        raise NotImplementedError

    def _html(self, caption: str) -> str:
        rows = []
        for key, value in self.report_status().items():
            text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
            rows.append(f"<tr><th>{html.escape(key)}</th><td>{html.escape(text)}</td></tr>")
        return f"<table><caption>{html.escape(caption)}</caption>" + "".join(rows) + "</table>"


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
