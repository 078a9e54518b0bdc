"""The connector's router events (``lmcache_rc.vllm.events``, ``docs/vllm.md``
§A.9) without vLLM: what the sidecar's change feed answers becomes vLLM
``BlockStored`` / ``BlockRemoved`` events (stand-ins with vLLM's fields
here), announced only once the feed shows a checkpoint listed, with set
semantics per (group, hash, medium, locality, ownership)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmcache_rc.vllm.events import (
    CheckpointKeys,
    EventBook,
    RouterBlock,
    RouterEvents,
)


def chain(n_blocks: int, tail: Sequence[int] = (), *, base: int = 0) -> CheckpointKeys:
    """A checkpoint of ``n_blocks`` attention blocks of 4 tokens (hash
    ``h<i>``) and its marker: at the last block boundary, or inside the next
    block when ``tail`` is given."""
    blocks = []
    parent = None
    for i in range(n_blocks):
        h = f"h{base + i}"
        blocks.append(RouterBlock(0, "full_attention", h, parent, (i,) * 4, 4))
        parent = h
    if tail:
        blocks.append(
            RouterBlock(
                1, "mamba", f"m{base}:{n_blocks}:{len(tail)}", parent, tuple(tail), 4, marker=True
            )
        )
        n = n_blocks * 4 + len(tail)
    else:
        before = blocks[-2].block_hash if n_blocks >= 2 else None
        blocks.append(RouterBlock(1, "mamba", parent, before, (n_blocks - 1,) * 4, 4, marker=True))
        n = n_blocks * 4
    return CheckpointKeys(n, tuple(blocks))


class Future:
    def __init__(self, value: Any = None, error: Exception | None = None) -> None:
        self.value = value
        self.error = error
        self.ready = True

    def done(self) -> bool:
        return self.ready

    def result(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class Feed:
    """A sidecar's change feed as the connector's client sees it."""

    def __init__(self) -> None:
        self.epoch = "e1"
        self.tiers: dict[str, str] = {}
        self.log: list[dict[str, Any]] = []
        self.calls: list[tuple[int, list[str]]] = []
        self.fail: Exception | None = None
        self.hold = False
        self.pending: list[Future] = []

    def change(self, generation: str, kind: str, tier: str | None = None) -> None:
        if tier is None:
            self.tiers.pop(generation, None)
        else:
            self.tiers[generation] = tier
        self.log.append(
            {"seq": len(self.log), "generation": generation, "kind": kind, "tier": tier}
        )

    def changes_async(self, since: int, watch: list[str]) -> Future:
        self.calls.append((since, list(watch)))
        if self.fail is not None:
            return Future(error=self.fail)
        head = len(self.log)
        truncated = since > head
        start = head if truncated else since
        future = Future(
            {
                "epoch": self.epoch,
                "next_seq": head,
                "truncated": truncated,
                "more": False,
                "changes": self.log[start:],
                "watched": [self.tiers.get(g) for g in watch],
            }
        )
        if self.hold:
            future.ready = False
            self.pending.append(future)
        return future


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(feed: Feed, clock: Clock | None = None, max_checkpoints: int = 100) -> RouterEvents:
    return RouterEvents(feed, interval=1.0, max_checkpoints=max_checkpoints, clock=clock or Clock())


def settle(events: RouterEvents, clock: Clock | None = None) -> list[Any]:
    """Steps until no answer is outstanding; the events published meanwhile."""
    out: list[Any] = []
    for _ in range(10):
        out.extend(events.step())
        if not events.busy():
            out.extend(events.step())
            return out
    raise AssertionError("still busy")


def started() -> tuple[Feed, Clock, RouterEvents]:
    """A feed, a clock and an event book that has learned the feed's epoch
    (its first poll settled)."""
    feed = Feed()
    clock = Clock()
    events = make(feed, clock)
    settle(events)
    return feed, clock, events


def summary(events: list[Any]) -> list[tuple[str, list[Any], Any]]:
    return [
        (
            type(e).__name__,
            list(e.block_hashes),
            getattr(e, "parent_block_hash", None),
        )
        for e in events
    ]


def test_a_checkpoint_is_announced_once_the_feed_shows_it_listed() -> None:
    feed = Feed()
    events = make(feed)
    assert settle(events) == []  # the first poll learns the epoch
    keys = chain(3)
    events.learned("g1", keys)
    assert events.busy(), "an announcement waits for the sidecar's answer"
    assert settle(events) == [], "not listed: nothing to announce"
    feed.change("g1", "listed", "l1")
    events.learned("g1", keys)
    published = settle(events)
    assert summary(published) == [
        ("_StandInBlockStored", ["h0", "h1", "h2"], None),
        ("_StandInBlockStored", ["h2"], "h1"),
    ]
    attention, marker = published
    assert (attention.medium, attention.locality) == ("CPU", "LOCAL")
    assert attention.ownership == marker.ownership == "lmcache-rc:e1"
    assert attention.group_idx == 0 and attention.kv_cache_spec_kind == "full_attention"
    assert attention.token_ids == [0] * 4 + [1] * 4 + [2] * 4
    assert marker.group_idx == 1 and marker.kv_cache_spec_kind == "mamba"
    assert marker.token_ids == [2] * 4 and marker.block_size == 4
    assert not events.busy()


def test_a_marker_inside_a_block_places_itself_by_parent_and_tail() -> None:
    feed = Feed()
    events = make(feed)
    settle(events)
    feed.change("g", "listed", "l1")
    events.learned("g", chain(2, tail=(9, 9, 9)))
    stored = settle(events)
    marker = stored[-1]
    assert marker.parent_block_hash == "h1"
    assert marker.token_ids == [9, 9, 9]  # position (1 + 1) * 4 + 3 = 11


def test_blocks_two_checkpoints_share_are_announced_once_and_removed_with_the_last() -> None:
    feed = Feed()
    events = make(feed)
    settle(events)
    feed.change("short", "listed", "l1")
    feed.change("long", "listed", "l1")
    events.learned("short", chain(2))
    events.learned("long", chain(4))
    stored = settle(events)
    hashes = [h for e in stored for h in e.block_hashes]
    assert sorted(hashes) == sorted(["h0", "h1", "h2", "h3", "h1", "h3"]), "h1, h3: markers"
    assert [e.group_idx for e in stored if e.kv_cache_spec_kind == "mamba"] == [1, 1]


def test_an_eviction_removes_only_what_no_other_checkpoint_holds() -> None:
    feed, clock, events = started()
    feed.change("short", "listed", "l1")
    feed.change("long", "listed", "l1")
    events.learned("short", chain(2))
    events.learned("long", chain(4))
    settle(events)
    feed.change("long", "unlisted")
    clock.now += 1.0  # the next poll is due
    removed = settle(events)
    assert [type(e).__name__ for e in removed] == ["_StandInBlockRemoved"] * 2
    gone = {(e.group_idx, h) for e in removed for h in e.block_hashes}
    assert gone == {(0, "h2"), (0, "h3"), (1, "h3")}, "h0, h1 stay: short holds them"


def test_a_durable_copy_moves_the_blocks_to_the_storage_medium() -> None:
    feed, clock, events = started()
    feed.change("g", "listed", "l1")
    events.learned("g", chain(1))
    settle(events)
    feed.change("g", "tier", "l2")
    clock.now += 1.0
    moved = settle(events)
    assert [(type(e).__name__, e.medium, e.locality) for e in moved] == [
        ("_StandInBlockRemoved", "CPU", "LOCAL"),
        ("_StandInBlockRemoved", "CPU", "LOCAL"),
        ("_StandInBlockStored", "STORAGE", "LOCAL"),
        ("_StandInBlockStored", "STORAGE", "LOCAL"),
    ]


def test_a_sidecar_restart_withdraws_everything_and_re_announces_what_survived() -> None:
    feed, clock, events = started()
    feed.change("kept", "listed", "l2")
    feed.change("lost", "listed", "l1")
    events.learned("kept", chain(1, base=10))
    events.learned("lost", chain(1, base=20))
    settle(events)
    survivor = feed.tiers["kept"]
    feed.__init__()  # a new sidecar: another epoch, an empty ring
    feed.epoch = "e2"
    feed.change("kept", "listed", survivor)
    clock.now += 1.0
    out = settle(events)
    removed = [e for e in out if type(e).__name__ == "_StandInBlockRemoved"]
    stored = [e for e in out if type(e).__name__ == "_StandInBlockStored"]
    assert {e.ownership for e in removed} == {"lmcache-rc:e1"}
    assert {h for e in removed for h in e.block_hashes} == {"h10", "h20"}
    assert {e.ownership for e in stored} == {"lmcache-rc:e2"}
    assert {h for e in stored for h in e.block_hashes} == {"h10"}
    assert events.counters["kv_events_sidecar_restarts"] == 1


def test_a_truncated_feed_asks_every_known_checkpoint_again() -> None:
    feed, clock, events = started()
    feed.change("g", "listed", "l1")
    events.learned("g", chain(1))
    settle(events)
    feed.tiers.pop("g")  # unlisted in changes the ring no longer has
    feed.log.clear()
    clock.now += 1.0
    settle(events)  # since is now past the head: truncated
    assert events.counters["kv_events_resyncs"] == 1
    assert feed.calls[-1][1] == ["g"], "the resync watches every known checkpoint"
    assert events.book.announced() == []


def test_reset_cache_removes_everything_announced() -> None:
    feed = Feed()
    events = make(feed)
    settle(events)
    feed.change("g", "listed", "l1")
    events.learned("g", chain(2))
    settle(events)
    events.reset()
    removed = events.step()
    assert {h for e in removed for h in e.block_hashes} == {"h0", "h1"}
    assert len(events.book) == 0


def test_a_failing_sidecar_never_keeps_the_engine_stepping() -> None:
    feed = Feed()
    feed.fail = RuntimeError("sidecar down")
    clock = Clock()
    events = make(feed, clock)
    events.learned("g", chain(1))
    events.step()
    events.step()
    assert not events.busy()
    calls = len(feed.calls)
    for _ in range(5):
        events.step()
    assert len(feed.calls) == calls, "retried only when the interval is due"
    clock.now += 1.0
    feed.fail = None
    feed.change("g", "listed", "l1")
    assert settle(events), "announced once the sidecar answers"


def test_the_oldest_checkpoint_is_withdrawn_beyond_the_bound() -> None:
    book = EventBook(max_checkpoints=1)
    book.set_ownership("lmcache-rc:e")
    book.add("a", chain(1, base=0))
    book.set_state("a", "l1", watched=True)
    book.take()
    book.add("b", chain(1, base=5))
    removed = book.take()
    assert {h for e in removed for h in e.block_hashes} == {"h0"}
    assert book.counters["kv_events_forgotten"] == 1


class FullAttentionSpec:
    """A stand-in of vLLM's spec (lmcache-rc decides kinds by class name)."""

    block_size = 16
    sliding_window = None


class MambaSpec:
    block_size = 16


class SpyClient:
    """The scheduler's sidecar client; records every call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def find_async(self, roots: Any) -> Future:
        self.calls.append("find")
        return Future(None)

    def begin_async(self, manifest: Any) -> Future:
        self.calls.append("begin")
        return Future(False)

    def abort_async(self, generation: str) -> Future:
        self.calls.append("abort")
        return Future(None)

    def changes_async(self, since: int, watch: list[str]) -> Future:
        self.calls.append("changes")
        raise AssertionError("the change feed is asked with KV events off")

    def close(self) -> None:
        self.calls.append("close")


def test_without_kv_events_no_step_asks_the_change_feed() -> None:
    from types import SimpleNamespace

    from lmcache_rc.vllm.options import parse_options
    from lmcache_rc.vllm.upstream import UpstreamScheduler

    groups = [
        SimpleNamespace(kv_cache_spec=MambaSpec()),
        SimpleNamespace(kv_cache_spec=FullAttentionSpec()),
    ]
    options = parse_options(
        {
            "lmcache_rc.checkpoint_identity": {
                "target_revision": "a" * 40,
                "source_revision": "b" * 40,
            }
        },
        speculative=False,
    )
    client = SpyClient()
    side = UpstreamScheduler(
        client,
        SimpleNamespace(kv_cache_groups=groups),  # type: ignore[arg-type]
        options,
        identity={"model": "toy"},
        world_size=1,
    )
    assert side.router_events is None
    for _ in range(100):
        assert side.take_events() == []
        assert not side.has_pending_work() or not side._negotiation.settled()
    assert "changes" not in client.calls and client.calls == []
    assert side.report_status()["kv_events"] is None
    assert not any(k.startswith("kv_events") for k in side.counters)
