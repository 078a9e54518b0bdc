"""KV events for routers (``docs/vllm.md`` §A.9), end to end under vLLM 0.33's
own scheduler and its own ZMQ publisher.

A small router (:class:`Router`) subscribes to every replica's KV-event
stream on loopback, decodes it with vLLM's msgspec classes
(``KVEventBatch``, ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``)
and scores a prompt exactly as the docs say: the deepest recurrent boundary
marker whose parent and token ids match the prompt's own vLLM block hashes.
It is fed nothing but those events; its prediction for each request is
compared with what the connector then restores.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from conftest import EngineFactory
from harness import Engine, ToyModel
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens, maybe_convert_block_hash

import lmcache_rc as rc

BS = 16
POLL = 0.01
"""``kv_events_poll_interval`` of the test's engines (seconds)."""


def tokens(seed: int, n: int) -> list[int]:
    """A deterministic prompt of ``n`` tokens."""
    return [1 + (seed * 7919 + i * 104729) % 997 for i in range(n)]


@dataclass(frozen=True)
class Marker:
    """A recurrent boundary marker as the router keeps it."""

    parent: Any
    token_ids: tuple[int, ...]
    block_size: int


class Router:
    """A hybrid-aware router model: vLLM's ZMQ events in, a score out.

    Per ``ownership`` (one per running sidecar, shared by its engines) it
    keeps the blocks lmcache-rc holds, last writer wins: a store from any
    replica adds a block, a removal from any replica drops it. vLLM's own GPU
    events (``medium == "GPU"``) and ``AllBlocksCleared`` (the GPU pool's
    reset) never touch them.
    """

    def __init__(self, hash_algo: str) -> None:
        self.ctx = zmq.Context.instance()
        self.subs: list[zmq.Socket] = []
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.blocks: dict[str, set[tuple[int, Any, str, str]]] = {}
        self.markers: dict[str, dict[tuple[Any, str, str], Marker]] = {}
        self.hash_fn = get_hash_fn_by_name(hash_algo)
        self.batches = 0
        self.stored = 0
        self.removed = 0
        self.gpu_cleared = 0

    def endpoint(self) -> tuple[int, str]:
        """A SUB socket bound on loopback; vLLM's publisher connects to it."""
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        self.subs.append(sub)
        return len(self.subs) - 1, f"tcp://127.0.0.1:{port}"

    def close(self) -> None:
        for sub in self.subs:
            sub.close(linger=0)

    def _apply(self, batch: KVEventBatch) -> None:
        self.batches += 1
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.gpu_cleared += 1  # vLLM's GPU pool: lmcache-rc blocks stay
                continue
            own = event.ownership or ""
            if event.medium == "GPU" or not own.startswith("lmcache-rc:"):
                continue
            blocks = self.blocks.setdefault(own, set())
            markers = self.markers.setdefault(own, {})
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    blocks.add((event.group_idx, h, event.medium, event.locality))
                    self.stored += 1
                if event.kv_cache_spec_kind == "mamba":
                    assert len(event.block_hashes) == 1, "a marker is its own event"
                    markers[(event.block_hashes[0], event.medium, event.locality)] = Marker(
                        event.parent_block_hash, tuple(event.token_ids), event.block_size
                    )
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    blocks.discard((event.group_idx, h, event.medium, event.locality))
                    markers.pop((h, event.medium, event.locality), None)
                    self.removed += 1

    def drain(self, index: int, engine: Engine) -> None:
        """Everything ``engine`` published so far: an empty batch (which the
        scheduler never sends) is published behind it and read back."""
        sub = self.subs[index]
        publisher = engine.scheduler.kv_event_publisher
        deadline = time.monotonic() + 60
        while True:
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))
            while sub.poll(200):
                _topic, _seq, payload = sub.recv_multipart()
                batch = self.decoder.decode(payload)
                if not batch.events:
                    return
                self._apply(batch)
            assert time.monotonic() < deadline, "the publisher never connected"

    def prompt_hashes(self, prompt: Sequence[int]) -> list[Any]:
        """The prompt's full-block hashes, computed the vLLM way."""
        out: list[Any] = []
        parent = None
        for i in range(len(prompt) // BS):
            parent = hash_block_tokens(self.hash_fn, parent, prompt[i * BS : (i + 1) * BS], None)
            out.append(maybe_convert_block_hash(parent))
        return out

    def predict(self, prompt: Sequence[int]) -> int:
        """The deepest resumable position for ``prompt`` (docs/vllm.md §A.9):
        the deepest held marker whose parent is one of the prompt's blocks (or
        none) and whose token ids continue the prompt there, short of its last
        token."""
        index = {h: i for i, h in enumerate(self.prompt_hashes(prompt))}
        best = 0
        for markers in self.markers.values():
            for marker in markers.values():
                if marker.parent is None:
                    k = 0
                elif marker.parent in index:
                    k = index[marker.parent] + 1
                else:
                    continue
                start = k * marker.block_size
                pos = start + len(marker.token_ids)
                if pos <= len(prompt) - 1 and tuple(prompt[start:pos]) == marker.token_ids:
                    best = max(best, pos)
        return best

    def held_markers(self) -> list[tuple[Any, str, str]]:
        return [k for m in self.markers.values() for k in m]


def tick(engine: Engine) -> None:
    """One step of an idle replica (a busy fleet steps all the time): its
    next change-feed poll is due, and it steps until the answer is in."""
    time.sleep(POLL)
    engine.step()
    engine.run()


def restored(engine: Engine) -> int:
    assert engine.connector is not None and engine.connector.upstream is not None
    return engine.connector.upstream.counters.get("tokens_restored", 0)


@pytest.fixture
def small_sidecar(tmp_path: Path) -> Any:
    """A sidecar whose directory lists at most 6 checkpoints (LRU evicts)."""
    root = tmp_path / "small"
    root.mkdir()
    config = rc.ServerConfig(
        socket=str(root / "sidecar.sock"),
        l1_bytes=64 << 20,
        checkpoint_index_path=str(root / "index.sqlite"),
        l2_path=str(root / "l2"),
        max_entries=6,
    )
    server = rc.Server.start(config)
    yield server
    server.stop()


def test_a_router_fed_only_kv_events_predicts_every_restore(
    make_engine: EngineFactory, small_sidecar: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    router = Router("sha256")
    try:
        replicas: list[tuple[int, Engine]] = []
        for _ in range(2):
            index, endpoint = router.endpoint()
            engine = make_engine(
                socket=small_sidecar.socket_path,
                kv_events_endpoint=endpoint,
                kv_events_poll_interval=POLL,
            )
            assert engine.config.cache_config.prefix_caching_hash_algo == "sha256"
            replicas.append((index, engine))
        for index, engine in replicas:
            router.drain(index, engine)  # connected before anything happens

        histories = {c: tokens(10 + c, 20 + 7 * c) for c in range(3)}
        # three conversations in rounds; the third sits out rounds 2 and 3, so
        # the others' checkpoints push all of its own out of the directory
        # (at most 6 listed); the sidecar is cleared before request 16
        schedule = [(r, c) for r in range(8) for c in range(3) if not (c == 2 and r in (2, 3))]
        rows: list[tuple[int, int, int, int, int]] = []
        cleared_at = 16
        evicted_before: int | None = None
        for request, (turn, conv) in enumerate(schedule):
            if request == cleared_at:
                with rc.Client(small_sidecar.socket_path) as client:
                    client.clear(force=True, all_tiers=True)
            if conv == 2 and turn == 4:
                evicted_before = request
            index, engine = replicas[request % 2]
            for other in replicas:
                tick(other[1])
            # the replica's own prefix cache must not serve: every resumed
            # token then comes from lmcache-rc (vLLM announces the reset
            # with AllBlocksCleared, which lmcache-rc blocks ignore)
            assert engine.scheduler.reset_prefix_cache()
            engine.step()
            for i, e in replicas:
                router.drain(i, e)
            prompt = histories[conv]
            predicted = router.predict(prompt)
            before = restored(engine)
            out = engine.generate(f"c{conv}t{turn}", prompt, 5)
            assert out == ToyModel.reference(prompt, 5)
            got = restored(engine) - before
            assert engine.prompt_from_cache(f"c{conv}t{turn}") == got
            rows.append((request, conv, len(prompt), predicted, got))
            assert predicted == got, rows
            histories[conv] = prompt + out + tokens(100 + request, 9)

        # the workload had every case: cross-replica restores, evictions, the clear
        status = small_sidecar.status()
        assert status["evictions"] > 0, status
        assert len(rows) >= 20
        assert sum(p > 0 for _, _, _, p, _ in rows[:cleared_at]) >= 6, rows
        assert evicted_before is not None and rows[evicted_before][3] == 0, (
            "the third conversation's checkpoints were evicted while it sat out"
        )
        assert rows[cleared_at][3] == 0, "after the clear nothing is restorable"
        assert any(p > 0 for _, _, _, p, _ in rows[cleared_at + 1 :])

        # what the router holds is what the sidecar lists: one marker per
        # listed checkpoint, each at the durable tier once L2 wrote them
        for _, engine in replicas:
            engine.run()
        deadline = time.monotonic() + 30
        while small_sidecar.status()["l2_queue"] and time.monotonic() < deadline:
            time.sleep(0.01)
        for i, engine in replicas:
            tick(engine)
            router.drain(i, engine)
        with rc.Client(small_sidecar.socket_path) as client:
            listed = client.list_generations()
        markers = router.held_markers()
        assert len(markers) == len(listed), (markers, listed)
        assert all(g["durable"] for g in listed)
        assert {(medium, locality) for _, medium, locality in markers} == {("STORAGE", "LOCAL")}
        assert router.removed > 0 and router.gpu_cleared > 0
        with capsys.disabled():
            print()
            for r, conv, n, p, g in rows:
                print(
                    f"request {r:2d} conv {conv} prompt {n:3d}: predicted {p:3d}, restored {g:3d}"
                )
            print(
                f"{router.batches} batches, {router.stored} block stores, "
                f"{router.removed} removals, sidecar evictions {status['evictions']}"
            )
    finally:
        router.close()


def test_without_kv_events_the_change_feed_is_never_asked(make_engine: EngineFactory) -> None:
    engine = make_engine()
    assert engine.config.kv_events_config is None
    side = engine.connector.upstream
    assert side is not None and side.router_events is None
    prompt = tokens(3, 40)
    engine.generate("a", prompt, 4)
    engine.generate("b", prompt + tokens(4, 20), 4)
    assert list(engine.connector.take_events()) == []
    assert not any(k.startswith("kv_events") for k in side.counters)
    assert side.report_status()["kv_events"] is None


def test_the_sidecar_identity_is_each_events_ownership(
    make_engine: EngineFactory, sidecar: Any
) -> None:
    router = Router("sha256")
    try:
        index, endpoint = router.endpoint()
        engine = make_engine(kv_events_endpoint=endpoint, kv_events_poll_interval=POLL)
        router.drain(index, engine)
        prompt = tokens(5, 50)
        engine.generate("a", prompt, 4)
        router.drain(index, engine)
        with rc.Client(sidecar.socket) as client:
            epoch = client.changes(2**64 - 1)["epoch"]
        assert set(router.markers) == {f"lmcache-rc:{epoch}"}
        # the prompt checkpoint (48) and the response one (53) are both held
        longer = prompt + ToyModel.reference(prompt, 4) + tokens(6, 5)
        assert router.predict(longer) == 50 + 4 - 1
        assert router.predict(prompt + tokens(7, 3)) == 48
    finally:
        router.close()
