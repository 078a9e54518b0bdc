"""KV events for routers: the complete checkpoints this engine stored or
restored, while the sidecar holds them (``docs/vllm.md`` §A.9).

What it owns:

* :class:`RouterBlock` / :class:`CheckpointKeys`: a checkpoint of ``N``
  tokens as a router sees it — vLLM's own block hashes of the full
  attention blocks below ``N`` (one chain per full-attention group) and one
  *recurrent boundary marker* on the first recurrent group, whose parent
  and token ids place it at exactly ``N`` (:func:`checkpoint_keys`).
* :class:`EventBook`: which checkpoints this engine announced, at which
  tier, and the vLLM ``BlockStored`` / ``BlockRemoved`` events that move a
  router from what it was told to what holds now. Blocks are reference
  counted per (group, hash, medium, locality, ownership), so a block shared
  by several checkpoints (a conversation's earlier turns) is announced once
  and removed when the last of them goes: a router sees set semantics.
* :class:`RouterEvents`: the sidecar's change feed (the ``changes``
  operation), polled from the scheduler's steps at most once per
  ``kv_events_poll_interval`` (never blocking: an ``*_async`` future polled
  on later steps), resynchronised by watching every known checkpoint after
  a sidecar restart (another epoch) or a ring overflow (``truncated``).

What it must never do: exist or cost anything when vLLM's KV events are off
(the connector builds none), block the scheduler thread, or announce a
checkpoint the sidecar's feed has not shown listed.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmcache_rc.vllm.api import RouterHasher, kv_event_types
from lmcache_rc.vllm.sidecar import SidecarFuture

__all__ = [
    "MAX_WATCH",
    "OWNERSHIP_PREFIX",
    "TIER_MEDIUM",
    "CheckpointKeys",
    "EventBook",
    "GroupView",
    "RouterBlock",
    "RouterEvents",
    "checkpoint_keys",
]

logger = logging.getLogger(__name__)

TIER_MEDIUM: dict[str, tuple[str, str]] = {
    "l1": ("CPU", "LOCAL"),
    "l2": ("STORAGE", "LOCAL"),
    "shared": ("STORAGE", "REMOTE"),
}
"""The sidecar tier a checkpoint's complete copy reached → the event's
``(medium, locality)``: vLLM's own medium names (``MEDIUM_CPU``,
``MEDIUM_STORAGE``)."""

OWNERSHIP_PREFIX = "lmcache-rc:"
"""Every event's ``ownership`` is this prefix and the sidecar's epoch: one
value per running sidecar, the same for every engine attached to it."""

MAX_WATCH = 4096
"""Generations one ``changes`` call watches (the sidecar's ``MAX_WATCH``)."""

_FAR = (1 << 64) - 1
"""``since`` that starts the feed at its end (``u64::MAX``)."""


@dataclass(frozen=True)
class RouterBlock:
    """One block of a checkpoint as a router sees it (a ``BlockStored`` entry)."""

    group: int
    """vLLM's KV-cache group index (``group_idx``)."""
    spec_kind: str | None
    """``kv_cache_spec_kind``: ``full_attention`` or ``mamba`` (the marker)."""
    block_hash: Any
    """vLLM's block hash in event form (bytes, or int with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    parent: Any | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: Any = None
    marker: bool = False
    """The recurrent boundary marker (always its own ``BlockStored``)."""


@dataclass(frozen=True)
class CheckpointKeys:
    """A checkpoint of ``num_tokens`` tokens: its attention chains, then its marker."""

    num_tokens: int
    blocks: tuple[RouterBlock, ...]


@dataclass(frozen=True)
class GroupView:
    """What :func:`checkpoint_keys` needs of one vLLM KV-cache group."""

    index: int
    kind: str
    """``attention`` or ``recurrent`` (lmcache-rc's :func:`~lmcache_rc.vllm.api.spec_kind`)."""
    block_size: int
    spec_kind: str | None
    """vLLM's ``kv_cache_spec_kind`` of the group."""


def checkpoint_keys(
    request: Any, num_tokens: int, groups: Sequence[GroupView], hasher: RouterHasher
) -> CheckpointKeys:
    """The router view of ``request``'s checkpoint of ``num_tokens`` tokens.

    Every full-attention group contributes its full blocks below
    ``num_tokens`` (vLLM's hashes, parents and token ids, as its own GPU
    events carry them). The first recurrent group contributes the marker:
    at a block boundary it is vLLM's hash of the block ending at
    ``num_tokens``; inside a block it is ``hash_block_tokens`` of the partial
    block (its parent is the last full block's hash, its token ids the
    tokens past it). Either way ``(index of parent + 1) * block_size +
    len(token_ids) == num_tokens``.
    """
    tokens = list(request.all_token_ids)
    n = int(num_tokens)
    blocks: list[RouterBlock] = []
    for g in groups:
        if g.kind != "attention":
            continue
        hashes = hasher.block_hashes(request, g.block_size)
        parent: Any | None = None
        for i in range(n // g.block_size):
            start, end = i * g.block_size, (i + 1) * g.block_size
            h = hasher.external(hashes[i])
            blocks.append(
                RouterBlock(
                    g.index,
                    g.spec_kind,
                    h,
                    parent,
                    tuple(tokens[start:end]),
                    g.block_size,
                    hasher.event_extra_keys(hasher.extra_keys(request, start, end)),
                )
            )
            parent = h
    recurrent = [g for g in groups if g.kind == "recurrent"]
    if recurrent and n > 0:
        g = recurrent[0]
        bs = g.block_size
        hashes = hasher.block_hashes(request, bs)
        full, tail = divmod(n, bs)
        if tail == 0:
            start = n - bs
            raw = hashes[full - 1]
            raw_parent = hashes[full - 2] if full >= 2 else None
            keys = hasher.extra_keys(request, start, n)
        else:
            start = full * bs
            raw_parent = hashes[full - 1] if full >= 1 else None
            keys = hasher.extra_keys(request, start, n)
            raw = hasher.partial_hash(raw_parent, tokens[start:n], keys)
        blocks.append(
            RouterBlock(
                g.index,
                g.spec_kind,
                hasher.external(raw),
                None if raw_parent is None else hasher.external(raw_parent),
                tuple(tokens[start:n]),
                bs,
                hasher.event_extra_keys(keys),
                marker=True,
            )
        )
    return CheckpointKeys(n, tuple(blocks))


_Key = tuple[int, Any, str, str, str]
"""(group, hash, medium, locality, ownership): one announced block."""


@dataclass
class _Record:
    keys: CheckpointKeys
    tier: str | None = None
    """The tier announced for it (None: not announced)."""
    watch: bool = True
    """Its current state must be asked (new, or after a resync)."""


class EventBook:
    """Checkpoints known to this engine and what routers were told (pure:
    no I/O; :class:`RouterEvents` feeds it the sidecar's answers).

    ``set_state(generation, tier)`` records where a known checkpoint is now
    (None: not restorable); :meth:`take` returns the vLLM events that bring a
    router from what it was told to that state. At most ``max_checkpoints``
    are remembered: the least recently added one is forgotten (and removed
    for routers, which then only under-estimate).
    """

    def __init__(self, max_checkpoints: int) -> None:
        self._max = max(1, int(max_checkpoints))
        self._records: OrderedDict[str, _Record] = OrderedDict()
        self._refs: Counter[_Key] = Counter()
        self._meta: dict[_Key, RouterBlock] = {}
        self._announced: set[_Key] = set()
        self._dirty: dict[_Key, None] = {}
        self.ownership = ""
        """The sidecar's ``ownership`` value (set from its epoch)."""
        self.counters: Counter[str] = Counter()

    # ------------------------------------------------------------------ knowledge

    def __len__(self) -> int:
        return len(self._records)

    def known(self, generation: str) -> bool:
        """Whether ``generation`` is remembered."""
        return generation in self._records

    def add(self, generation: str, keys: CheckpointKeys) -> None:
        """A checkpoint this engine stored, restored or found stored: its state
        is asked at the next poll (nothing is announced before)."""
        record = self._records.get(generation)
        if record is not None:
            self._records.move_to_end(generation)
            record.watch = True
            return
        self._records[generation] = _Record(keys)
        while len(self._records) > self._max:
            _, rec = self._records.popitem(last=False)
            self._apply(rec, None)
            self.counters["kv_events_forgotten"] += 1

    def to_watch(self, limit: int = MAX_WATCH) -> list[str]:
        """Generations whose current state must be asked (oldest first)."""
        return [g for g, r in self._records.items() if r.watch][:limit]

    def resync(self) -> None:
        """Every known checkpoint's state is unknown (sidecar restarted, or
        the feed dropped changes): ask them all again."""
        for record in self._records.values():
            record.watch = True

    def set_state(self, generation: str, tier: str | None, *, watched: bool = False) -> None:
        """``generation`` is listed at ``tier`` now (None: not restorable).
        ``watched``: this answers its watch."""
        record = self._records.get(generation)
        if record is None:
            return
        if watched:
            record.watch = False
        self._apply(record, tier if tier in TIER_MEDIUM else None)

    def set_ownership(self, ownership: str) -> None:
        """Another sidecar (a restart): everything announced under the old
        identity is withdrawn; each checkpoint is announced again under the
        new one once the new sidecar says it holds it (after a watch)."""
        if ownership == self.ownership:
            return
        for record in self._records.values():
            self._apply(record, None)
            record.watch = True
        self.ownership = ownership

    def forget_all(self) -> None:
        """``reset_cache``: nothing stored before is restored by this engine
        again; every announced checkpoint is removed."""
        for record in self._records.values():
            self._apply(record, None)
        self._records.clear()

    def _apply(self, record: _Record, tier: str | None) -> None:
        if tier == record.tier:
            return
        if record.tier is not None:
            for key in self._keys(record.keys, record.tier):
                self._refs[key] -= 1
                if self._refs[key] <= 0:
                    del self._refs[key]
                self._dirty[key] = None
        record.tier = tier
        if tier is not None:
            for block, key in zip(record.keys.blocks, self._keys(record.keys, tier), strict=True):
                self._refs[key] += 1
                self._meta.setdefault(key, block)
                self._dirty[key] = None

    def _keys(self, keys: CheckpointKeys, tier: str) -> list[_Key]:
        medium, locality = TIER_MEDIUM[tier]
        return [(b.group, b.block_hash, medium, locality, self.ownership) for b in keys.blocks]

    # ------------------------------------------------------------------ events

    def take(self) -> list[Any]:
        """The events since the last call: ``BlockRemoved`` for blocks no
        known checkpoint holds any more, then ``BlockStored`` for blocks newly
        held (runs of a chain in one event, parent first)."""
        if not self._dirty:
            return []
        stored_cls, removed_cls = kv_event_types()
        removed: dict[tuple[int, str, str, str], list[Any]] = {}
        stored: list[_Key] = []
        for key in self._dirty:
            held = self._refs.get(key, 0) > 0
            if held and key not in self._announced:
                stored.append(key)
                self._announced.add(key)
            elif not held and key in self._announced:
                self._announced.discard(key)
                removed.setdefault((key[0], key[2], key[3], key[4]), []).append(key[1])
            if not held:
                self._meta.pop(key, None)
        self._dirty.clear()
        events: list[Any] = []
        for (group, medium, locality, ownership), hashes in removed.items():
            events.append(
                removed_cls(
                    block_hashes=hashes,
                    medium=medium,
                    group_idx=group,
                    locality=locality,
                    ownership=ownership,
                )
            )
            self.counters["kv_events_blocks_removed"] += len(hashes)
        run: list[RouterBlock] = []
        run_key: _Key | None = None
        for key in stored:
            block = self._meta[key]
            if (
                run
                and not block.marker
                and not run[-1].marker
                and run_key is not None
                and run_key[0] == key[0]
                and run_key[2:] == key[2:]
                and block.parent == run[-1].block_hash
                and block.block_size == run[-1].block_size
                and block.spec_kind == run[-1].spec_kind
            ):
                run.append(block)
                continue
            if run and run_key is not None:
                events.append(self._stored(stored_cls, run, run_key))
            run, run_key = [block], key
        if run and run_key is not None:
            events.append(self._stored(stored_cls, run, run_key))
        return events

    def _stored(self, cls: type, run: list[RouterBlock], key: _Key) -> Any:
        self.counters["kv_events_blocks_stored"] += len(run)
        first = run[0]
        extra = [b.extra_keys for b in run]
        return cls(
            block_hashes=[b.block_hash for b in run],
            parent_block_hash=first.parent,
            token_ids=[t for b in run for t in b.token_ids],
            block_size=first.block_size,
            lora_id=None,
            medium=key[2],
            lora_name=None,
            extra_keys=extra if any(e is not None for e in extra) else None,
            group_idx=first.group,
            kv_cache_spec_kind=first.spec_kind,
            locality=key[3],
            ownership=key[4],
        )

    def announced(self) -> list[tuple[str, str]]:
        """``(generation, tier)`` of every checkpoint announced now."""
        return [(g, r.tier) for g, r in self._records.items() if r.tier is not None]


@dataclass
class _Poll:
    future: SidecarFuture
    sent: float
    watch: list[str] = field(default_factory=list)


class RouterEvents:
    """The change feed as seen from one engine's scheduler (see the module docs).

    ``client`` offers ``changes_async(since, watch)``; ``step()`` runs from
    ``take_events`` on every engine step and returns the events to publish;
    ``busy()`` keeps the engine stepping while an answer it needs is
    outstanding (bounded by ``poll_timeout``).
    """

    def __init__(
        self,
        client: Any,
        *,
        interval: float,
        max_checkpoints: int,
        clock: Callable[[], float],
        poll_timeout: float = 5.0,
    ) -> None:
        self._client = client
        self._interval = interval
        self._clock = clock
        self._poll_timeout = poll_timeout
        self.book = EventBook(max_checkpoints)
        self._poll: _Poll | None = None
        self._since = _FAR
        self._epoch: str | None = None
        self._last_sent = float("-inf")
        self._more = False
        self._failing = False
        self._disabled = ""

    @property
    def counters(self) -> Counter[str]:
        """Polls, resyncs, blocks stored and removed, failures."""
        return self.book.counters

    def learned(self, generation: str, keys: CheckpointKeys | None) -> None:
        """This engine stored or restored ``generation`` (or found it stored)."""
        if keys is not None and not self._disabled:
            self.book.add(generation, keys)

    def reset(self) -> None:
        """``reset_cache``: remove every announced checkpoint."""
        self.book.forget_all()

    def busy(self) -> bool:
        """Whether an answer this engine's events wait for is outstanding."""
        if self._disabled:
            return False
        if self._poll is not None:
            return self._clock() - self._poll.sent < self._poll_timeout
        if self._failing:
            return False  # retried when due, without keeping the engine stepping
        return bool(self.book.to_watch(1)) or self._more

    def step(self) -> list[Any]:
        """One engine step: take a poll's answer if it is in, send the next
        one when due, and return the events to publish."""
        if self._disabled:
            return self.book.take()
        now = self._clock()
        poll = self._poll
        if poll is not None:
            if poll.future.done():
                self._poll = None
                self._answer(poll)
            elif now - poll.sent >= self._poll_timeout:
                self._poll = None
                self.counters["kv_events_poll_timeouts"] += 1
                self.book.resync()  # its answer is lost: ask everything again
        if self._poll is None and not self._disabled:
            due = now - self._last_sent >= self._interval
            wanted = (self._more or bool(self.book.to_watch(1))) and not self._failing
            if wanted or due:
                self._send(now)
        return self.book.take()

    def _send(self, now: float) -> None:
        watch = self.book.to_watch()
        try:
            future = self._client.changes_async(self._since, watch)
        except Exception as e:  # the sidecar is down: try again when due
            self.counters["kv_events_poll_errors"] += 1
            logger.debug("changes poll not sent: %s", e)
            self._last_sent = now
            self._failing = True
            return
        self._poll = _Poll(future, now, watch)
        self._last_sent = now
        self.counters["kv_events_polls"] += 1

    def _answer(self, poll: _Poll) -> None:
        try:
            batch = poll.future.result(0)
        except Exception as e:  # retried when due; every state is asked again
            self.counters["kv_events_poll_errors"] += 1
            if not self._failing:
                logger.warning("lmcache-rc KV events: the change feed poll failed: %s", e)
            self._failing = True
            self.book.resync()
            return
        self._failing = False
        epoch = str(batch["epoch"])
        if epoch != self._epoch:
            if self._epoch is not None:
                self.counters["kv_events_sidecar_restarts"] += 1
            self._epoch = epoch
            self.book.set_ownership(OWNERSHIP_PREFIX + epoch)
            self.book.resync()  # the watched answers below are this epoch's
        elif batch["truncated"]:
            self.counters["kv_events_resyncs"] += 1
            self.book.resync()
        for change in batch["changes"]:
            generation = change["generation"]
            if not self.book.known(generation):
                continue
            tier = change["tier"] if change["kind"] in ("listed", "tier") else None
            self.book.set_state(generation, tier)
        self._since = int(batch["next_seq"])
        self._more = bool(batch["more"])
        if not self._more:
            for generation, tier in zip(poll.watch, batch["watched"], strict=False):
                self.book.set_state(generation, tier, watched=True)

    def status(self) -> dict[str, Any]:
        """A snapshot for ``report_status``."""
        return {
            "checkpoints": len(self.book),
            "announced": len(self.book.announced()),
            "epoch": self._epoch,
            "next_seq": None if self._since == _FAR else self._since,
            "disabled": self._disabled or None,
        }


def announced_generations(events: RouterEvents) -> Iterable[tuple[str, str]]:
    """``(generation, tier)`` of every checkpoint ``events`` announced (tests)."""
    return events.book.announced()
