"""CheckpointSchedulerBridge against a fake vLLM allocator and a real embedded sidecar.

Covers the scheduler-bridge scenarios (docs/design/vllm-boundary-api.md §3 and §5) that need no
simulated engine: identity and layout negotiation, LoRA, rank aggregation,
BEGIN failure and timeout, lookups without a usable reply, the all-rank
publish/discard rule, cancellation, reused request ids and the fallback to the
longest remaining checkpoint. Worker ranks are played through ``rc.Client``
(real leases, no GPU). Timeouts use an injected clock: no sleeps are asserted.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import rpc_helpers

import lmcache_rc as rc
from lmcache_rc import errors
from lmcache_rc.vllm.api import CheckpointEngineTask
from lmcache_rc.vllm.boundary import CheckpointSchedulerBridge
from lmcache_rc.vllm.metadata import CheckpointConnectorMetadata, CheckpointWorkerMetadata
from lmcache_rc.vllm.restore_cost import PrefillMeter, SkipRule

PAGE = 4096
BLOCK = 4
LAYOUT = {"schema_version": 1, "page_bytes": PAGE}
IDENTITY = {
    "target_revision": "a" * 40,
    "source_revision": "b" * 40,
    "draft_revision": "",
    "runtime_config_hash": "runtime",
    "model_config_hash": "model",
    "precision_environment": {"VLLM_ATTENTION_BACKEND": None},
    "parallel": {"tp": 2, "dcp": 1, "cp_interleave": 1},
}
TOKENS = list(range(100, 112))  # 12 tokens


# --------------------------------------------------------------------------- fakes


class FullAttentionSpec:
    pass


class MambaSpec:  # the class name marks a recurrent group (vllm_api.is_recurrent_group)
    pass


@dataclass(frozen=True)
class Ckpt:
    checkpoint_id: int
    num_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    auxiliary_block_ids: tuple[int, ...]
    draft_prefix_len: int
    kind: str

    @property
    def dependencies(self) -> frozenset[int]:
        ids = {b for row in self.block_ids for b in row if b}
        return frozenset(ids | set(self.auxiliary_block_ids))


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    cache_salt: str | None = None
    lora_request: Any = None
    mm_features: Any = None
    num_computed_tokens: int = 0
    boundary_checkpoint: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass
class _Pending:
    tokens: tuple[int, ...]
    ckpt: Ckpt
    num_ranks: int
    acks: set[int] = field(default_factory=set)
    invalidated: bool = False


class FakeCache:
    """``BoundaryCheckpointCache`` subset: published entries, pins, exact-prefix find."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[tuple[int, ...], Ckpt]] = {}
        self._pending: dict[int, _Pending] = {}
        self.pins: Counter[int] = Counter()
        self._next = 1

    def next_id(self) -> int:
        self._next += 1
        return self._next - 1

    def find(self, request: Any, max_length: int) -> Ckpt | None:
        limit = min(max_length, request.num_tokens)
        tokens = tuple(request.all_token_ids)
        best: Ckpt | None = None
        for prefix, ck in self._entries.values():
            if ck.num_tokens <= limit and tokens[: ck.num_tokens] == prefix:
                if best is None or ck.num_tokens > best.num_tokens:
                    best = ck
        return best

    def acquire(self, checkpoint_id: int) -> Ckpt | None:
        entry = self._entries.get(checkpoint_id)
        if entry is None:
            return None
        for b in entry[1].dependencies:
            self.pins[b] += 1
        return entry[1]

    def release(self, checkpoint: Ckpt) -> None:
        for b in checkpoint.dependencies:
            assert self.pins[b] > 0, "release without acquire"
            self.pins[b] -= 1
            if not self.pins[b]:
                del self.pins[b]

    def is_pending(self, checkpoint_id: int) -> bool:
        return checkpoint_id in self._pending

    def __len__(self) -> int:
        return len(self._entries)


class FakeManager:
    """``KVCacheManager`` subset of the legacy (#709) allocator: one full-attention
    group and one Mamba group, both with block size 4."""

    def __init__(self, num_blocks: int = 64, max_model_len: int = 128) -> None:
        self.free = list(range(1, num_blocks))
        self.baseline = len(self.free)
        self.max_model_len = max_model_len
        self.boundary_checkpoints = FakeCache()
        self.kv_cache_config = SimpleNamespace(
            num_blocks=num_blocks,
            kv_cache_groups=[
                SimpleNamespace(layer_names=["attn"], kv_cache_spec=FullAttentionSpec()),
                SimpleNamespace(layer_names=["mamba"], kv_cache_spec=MambaSpec()),
            ],
        )
        self.coordinator = SimpleNamespace(
            single_type_managers=[SimpleNamespace(block_size=BLOCK)] * 2
        )
        self.reserves: list[dict[str, Any]] = []
        self.acks: list[tuple[int, int]] = []
        self.discards: list[int] = []

    # geometry -------------------------------------------------------------
    def boundary_checkpoint_page_positions(self, num_tokens: int) -> tuple[tuple[int, ...], ...]:
        if not 0 < num_tokens <= self.max_model_len:
            raise ValueError("num_tokens outside the model length")
        count = math.ceil(num_tokens / BLOCK)
        return (tuple(range(count)), (count - 1,))

    def _allocate(self, n: int, kind: str, draft: int) -> Ckpt | None:
        positions = self.boundary_checkpoint_page_positions(n)
        if len(self.free) < sum(len(p) for p in positions) + 1:
            return None
        rows = []
        for pos in positions:
            row = [0] * (pos[-1] + 1)
            for p in pos:
                row[p] = self.free.pop(0)
            rows.append(tuple(row))
        aux = (self.free.pop(0),)
        cid = self.boundary_checkpoints.next_id()
        return Ckpt(cid, n, tuple(rows), aux, draft, kind)

    def _free(self, ck: Ckpt) -> None:
        self.free.extend(sorted(ck.dependencies))

    # local publication (the producer side of a store) ----------------------
    def publish_local(self, request: Req, n: int, kind: str = "prompt") -> Ckpt:
        ck = self._allocate(n, kind, n)
        assert ck is not None
        self.boundary_checkpoints._entries[ck.checkpoint_id] = (
            tuple(request.all_token_ids[:n]),
            ck,
        )
        return ck

    def forget_local(self, ck: Ckpt) -> None:
        del self.boundary_checkpoints._entries[ck.checkpoint_id]
        self._free(ck)

    # imports ----------------------------------------------------------------
    def reserve_external_boundary_checkpoint(
        self,
        request: Any,
        num_tokens: int,
        page_positions: tuple[tuple[int, ...], ...],
        *,
        draft_prefix_len: int,
        kind: str,
        num_ranks: int,
    ) -> Ckpt | None:
        return self._reserve(request, num_tokens, page_positions, draft_prefix_len, kind, num_ranks)

    def _reserve(
        self,
        request: Any,
        num_tokens: int,
        page_positions: tuple[tuple[int, ...], ...],
        draft_prefix_len: int,
        kind: str,
        num_ranks: int,
        **extra: Any,
    ) -> Ckpt | None:
        self.reserves.append({"request_id": request.request_id, "num_tokens": num_tokens, **extra})
        if not 0 < num_tokens <= request.num_tokens:
            raise ValueError("num_tokens outside the request")
        if page_positions != self.boundary_checkpoint_page_positions(num_tokens):
            raise ValueError("does not cover every live cache page")
        if not 0 <= draft_prefix_len <= num_tokens or num_ranks < 1:
            raise ValueError("bad draft_prefix_len or num_ranks")
        ck = self._allocate(num_tokens, kind, draft_prefix_len)
        if ck is None:
            return None
        tokens = tuple(request.all_token_ids[:num_tokens])
        self.boundary_checkpoints._pending[ck.checkpoint_id] = _Pending(tokens, ck, num_ranks)
        return ck

    def acknowledge_external_boundary_checkpoint(self, checkpoint_id: int, rank: int) -> bool:
        self.acks.append((checkpoint_id, rank))
        p = self.boundary_checkpoints._pending.get(checkpoint_id)
        if p is None:
            return False
        if not 0 <= rank < p.num_ranks:
            raise ValueError("rank outside num_ranks")
        p.acks.add(rank)
        if len(p.acks) < p.num_ranks:
            return False
        del self.boundary_checkpoints._pending[checkpoint_id]
        if p.invalidated:
            self._free(p.ckpt)
            return False
        self.boundary_checkpoints._entries[checkpoint_id] = (p.tokens, p.ckpt)
        return True

    def discard_external_boundary_checkpoint(self, checkpoint_id: int) -> None:
        self.discards.append(checkpoint_id)
        p = self.boundary_checkpoints._pending.pop(checkpoint_id, None)
        if p is not None:
            self._free(p.ckpt)

    # checks ---------------------------------------------------------------------
    def pending_ids(self) -> list[int]:
        return list(self.boundary_checkpoints._pending)

    def held_pages(self) -> int:
        cache = self.boundary_checkpoints
        held = sum(len(ck.dependencies) for _, ck in cache._entries.values())
        return held + sum(len(p.ckpt.dependencies) for p in cache._pending.values())

    def assert_balanced(self) -> None:
        assert len(self.free) + self.held_pages() == self.baseline
        assert not self.boundary_checkpoints.pins, self.boundary_checkpoints.pins


class AdmissionManager(FakeManager):
    """The newest allocator: restore-admission reservations (detected by the bridge)."""

    def __init__(self, refuse: int = 0) -> None:
        super().__init__()
        self.refuse = refuse
        self.expired: set[str] = set()
        self.released: list[str] = []

    def reserve_external_boundary_checkpoint(  # type: ignore[override]
        self,
        request: Any,
        num_tokens: int,
        page_positions: tuple[tuple[int, ...], ...],
        *,
        draft_prefix_len: int,
        kind: str,
        num_ranks: int,
        reserve_admission: bool = False,
    ) -> Ckpt | None:
        if self.refuse or request.request_id in self.expired:
            self.refuse = max(0, self.refuse - 1)
            self.reserves.append({"request_id": request.request_id, "refused": True})
            return None
        return self._reserve(
            request,
            num_tokens,
            page_positions,
            draft_prefix_len,
            kind,
            num_ranks,
            reserve_admission=reserve_admission,
        )

    def can_admit_external_boundary_request(self, request_id: str) -> bool:
        return True

    def external_boundary_admission_ready(self, request_id: str) -> bool:
        return False

    def release_external_boundary_admission(self, request_id: str) -> None:
        self.released.append(request_id)

    def external_boundary_wait_expired(self, request_id: str) -> bool:
        return request_id in self.expired


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class NeverFuture:
    def done(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> Any:
        raise errors.RpcTimeout("never answered")


class FailedFuture:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        raise self.error


class DoneFuture:
    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self.value


class WrappedClient:
    """A real client whose FIND / FIND_LOCATED / BEGIN can be replaced per
    test; records aborts."""

    def __init__(self, client: rc.Client) -> None:
        self.client = client
        self.find: Callable[[Iterable[rc.Prefix]], Any] | None = None
        self.located: Callable[[Iterable[rc.Prefix]], Any] | None = None
        self.begin: Callable[[rc.Manifest], Any] | None = None
        self.aborted: list[str] = []
        self.finds = 0
        self.located_finds = 0

    def find_async(self, roots: Iterable[rc.Prefix]) -> Any:
        self.finds += 1
        return (self.find or self.client.find_async)(roots)

    def find_located_async(self, roots: Iterable[rc.Prefix]) -> Any:
        self.located_finds += 1
        return (self.located or self.client.find_located_async)(roots)

    def begin_async(self, manifest: rc.Manifest) -> Any:
        return (self.begin or self.client.begin_async)(manifest)

    def abort_async(self, generation: str) -> Any:
        self.aborted.append(generation)
        return self.client.abort_async(generation)

    @property
    def connected(self) -> bool:
        return self.client.connected

    def capabilities(self) -> dict[str, Any]:
        return self.client.capabilities()

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def server(tmp_path: Path) -> Iterable[rc.Server]:
    srv = rc.Server.start(rpc_helpers.config(tmp_path, l1_bytes=8 << 20))
    yield srv
    srv.stop()


@pytest.fixture
def client(server: rc.Server) -> Iterable[WrappedClient]:
    c = rc.Client(server.socket_path)
    yield WrappedClient(c)
    c.close()


def make_bridge(
    client: Any,
    manager: FakeManager | None = None,
    *,
    world: int = 2,
    negotiate: bool = True,
    clock: Clock | None = None,
    **kwargs: Any,
) -> tuple[CheckpointSchedulerBridge, FakeManager, Clock]:
    manager = manager or FakeManager()
    clock = clock or Clock()
    bridge = CheckpointSchedulerBridge(
        client,
        manager,
        identity=IDENTITY,
        world_size=world,
        clock=clock,
        **kwargs,
    )
    if negotiate:
        bridge.update(output(CheckpointWorkerMetadata(layouts={r: LAYOUT for r in range(world)})))
        assert bridge.ready
    return bridge, manager, clock


def output(meta: CheckpointWorkerMetadata | None) -> SimpleNamespace:
    return SimpleNamespace(kv_connector_worker_meta=meta)


def wait_tasks(
    bridge: CheckpointSchedulerBridge, limit: float = 10.0
) -> list[CheckpointEngineTask]:
    """Steps (build_meta) until a task is emitted or nothing is pending."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        tasks = list(bridge.build_meta(None).tasks)
        if tasks or not bridge.report_status()["pending_begins"]:
            return tasks
        time.sleep(0.002)
    raise AssertionError("BEGIN never answered")


def drive_poll(
    bridge: CheckpointSchedulerBridge, request: Req, limit: float = 10.0
) -> list[CheckpointEngineTask] | None:
    """Polls like the scheduler until the request is admitted (None) or a task appears."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if bridge.poll(request):
            return None
        tasks = list(bridge.build_meta(None).tasks)
        if tasks:
            return tasks
        time.sleep(0.002)
    raise AssertionError("lookup never settled")


def play_rank(client: rc.Client, task: CheckpointEngineTask, rank: int, fail: bool = False) -> bool:
    """One worker rank's copy through real leases (pages filled with a pattern)."""
    if task.direction == "STORE":
        deadline = time.monotonic() + 10
        while (lease := client.prepare_store(task.manifest, rank)).status == "busy":
            assert time.monotonic() < deadline
            time.sleep(0.001)
        if lease.status != "ready":
            return False
        assert lease.lease_id is not None
        for arrays in client.lease_arrays(lease):
            for arr in arrays:
                if arr is not None:
                    arr[:] = rank + 1
        client.finish_store(lease.lease_id, not fail)  # True only for the publishing rank
        return not fail
    lease = client.begin_retrieve(task.manifest, rank)
    if lease.status == "miss":
        return False
    assert lease.lease_id is not None
    deadline = time.monotonic() + 10
    while lease.status == "pending":  # ready at once when every page is in L1
        lease = client.poll_retrieve(lease.lease_id or "")
        assert time.monotonic() < deadline
        time.sleep(0.001)
    if lease.status != "ready":
        return False
    assert lease.lease_id is not None
    client.finish_retrieve(lease.lease_id)
    return not fail


def run_ranks(
    client: rc.Client,
    tasks: Sequence[CheckpointEngineTask],
    world: int = 2,
    fail: Iterable[int] = (),
) -> CheckpointWorkerMetadata:
    """Every rank runs every task; per-rank metadata folded in rank order like vLLM."""
    fail = set(fail)
    acc: CheckpointWorkerMetadata | None = None
    for rank in range(world):
        meta = CheckpointWorkerMetadata(
            results={t.task_id: {rank: play_rank(client, t, rank, rank in fail)} for t in tasks}
        )
        acc = meta if acc is None else acc.aggregate(meta)
    assert acc is not None
    return acc


def store_through(
    bridge: CheckpointSchedulerBridge, client: WrappedClient, manager: FakeManager, n: int
) -> Ckpt:
    """Publish an n-token checkpoint locally and export it through the bridge."""
    producer = Req(f"producer-{n}", list(TOKENS))
    ck = manager.publish_local(producer, n)
    assert bridge.store(producer, ck)
    tasks = wait_tasks(bridge)
    assert [t.direction for t in tasks] == ["STORE"]
    bridge.update(output(run_ranks(client.client, tasks)))
    assert not bridge.has_pending_work()
    manager.forget_local(ck)  # as seen from another engine (or after a restart)
    return ck


def idle(client: WrappedClient) -> dict[str, Any]:
    status = client.client.status()
    assert status["store_leases"] == 0 and status["retrieve_leases"] == 0
    assert status["pending"] == 0 and status["pins"] == 0
    return status


# --------------------------------------------------------------------------- metadata


def test_worker_acknowledgements_preserve_rank_identity() -> None:
    a = CheckpointWorkerMetadata(layouts={0: LAYOUT}, results={"t": {0: True}})
    b = CheckpointWorkerMetadata(layouts={1: LAYOUT}, results={"t": {1: False}, "u": {1: True}})
    merged = a.aggregate(b)
    assert merged.layouts == {0: LAYOUT, 1: LAYOUT}
    assert merged.results == {"t": {0: True, 1: False}, "u": {1: True}}
    assert a.results == {"t": {0: True}}  # inputs unchanged
    with pytest.raises(ValueError, match="rank 0 twice"):
        merged.aggregate(CheckpointWorkerMetadata(results={"t": {0: True}}))
    with pytest.raises(ValueError, match="layout of rank 1 twice"):
        merged.aggregate(CheckpointWorkerMetadata(layouts={1: LAYOUT}))


def test_metadata_survives_pickling(client: WrappedClient) -> None:
    import pickle

    manifest, _ = rpc_helpers.make_manifest(list(range(20)))
    meta = CheckpointConnectorMetadata(
        [CheckpointEngineTask("t1", manifest, "STORE", ((1, 2), (3,), (4,)))]
    )
    back = pickle.loads(pickle.dumps(meta))
    assert back.tasks == meta.tasks


def test_completion_rejects_unknown_tasks_and_ranks(client: WrappedClient) -> None:
    bridge, manager, _ = make_bridge(client)
    with pytest.raises(ValueError, match="unknown checkpoint task"):
        bridge.update(output(CheckpointWorkerMetadata(results={"nope": {0: True}})))
    ck = manager.publish_local(Req("p", list(TOKENS)), 8)
    assert bridge.store(Req("p", list(TOKENS)), ck)
    (task,) = wait_tasks(bridge)
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        bridge.update(output(CheckpointWorkerMetadata(results={task.task_id: {2: True}})))
    bridge.update(output(CheckpointWorkerMetadata(results={task.task_id: {0: True}})))
    with pytest.raises(ValueError, match=r"reported checkpoint task .* twice"):
        bridge.update(output(CheckpointWorkerMetadata(results={task.task_id: {0: True}})))
    # the stored pages were never written by rank 1: report failure, the store aborts
    bridge.update(output(CheckpointWorkerMetadata(results={task.task_id: {1: False}})))
    assert client.aborted == [task.manifest.generation]
    assert not bridge.has_pending_work()
    manager.assert_balanced()


# --------------------------------------------------------------------------- layout


def test_layout_negotiation_gates_lookups_and_stores(client: WrappedClient) -> None:
    bridge, manager, _ = make_bridge(client, negotiate=False)
    req = Req("r1", list(TOKENS))
    assert bridge.has_pending_work()
    assert bridge.poll(req) is False  # parked: no namespace yet
    ck = manager.publish_local(Req("p", list(TOKENS)), 8)
    assert bridge.store(Req("p", list(TOKENS)), ck) is False  # skipped, nothing pinned
    assert client.finds == 0
    bridge.update(output(CheckpointWorkerMetadata(layouts={1: LAYOUT})))
    assert not bridge.ready and bridge.has_pending_work()
    with pytest.raises(ValueError, match="layouts differ"):
        bridge.update(output(CheckpointWorkerMetadata(layouts={0: {**LAYOUT, "page_bytes": 64}})))
    with pytest.raises(ValueError, match="outside"):
        bridge.update(output(CheckpointWorkerMetadata(layouts={5: LAYOUT})))
    bridge.update(output(CheckpointWorkerMetadata(layouts={0: LAYOUT})))
    assert bridge.ready and bridge.layout == LAYOUT
    assert not bridge.has_pending_work()
    ns = bridge.namespace(None)
    assert ns == rc.checkpoint_namespace({**IDENTITY, "layout": LAYOUT}, "")
    assert bridge.namespace("tenant") != ns  # the cache salt separates tenants
    manager.assert_balanced()


def test_layout_is_compared_in_its_json_form(client: WrappedClient) -> None:
    layout = {**LAYOUT, "groups": [{"layer": "l0", "views": [{"shape": (2, 3)}]}]}
    bridge, manager, _ = make_bridge(client, negotiate=False)
    bridge.update(output(CheckpointWorkerMetadata(layouts={0: layout})))
    as_json = json.loads(json.dumps(layout))
    bridge.update(output(CheckpointWorkerMetadata(layouts={1: as_json})))
    assert bridge.layout == as_json
    with pytest.raises(ValueError, match="plain JSON"):
        bridge.update(output(CheckpointWorkerMetadata(layouts={0: {**LAYOUT, "x": {1, 2}}})))
    # a stored manifest's worker_layout (parsed JSON) matches on restore
    store_through(bridge, client, manager, 8)
    tasks = drive_poll(bridge, Req("c", list(TOKENS)))
    assert tasks is not None and tasks[0].direction == "RETRIEVE"


def test_layout_timeout_serves_without_the_directory(client: WrappedClient) -> None:
    bridge, _, clock = make_bridge(client, negotiate=False, layout_timeout=30.0)
    req = Req("r1", list(TOKENS))
    assert bridge.poll(req) is False
    clock.now += 31
    assert bridge.poll(req) is True
    assert not bridge.has_pending_work()
    assert bridge.report_status()["layout_failed"] is True
    assert client.finds == 0


# --------------------------------------------------------------------------- LoRA


def test_lora_requests_do_not_read_or_publish_the_base_weight_namespace(
    client: WrappedClient,
) -> None:
    bridge, manager, _ = make_bridge(client)
    lora = Req("lora", list(TOKENS), lora_request=SimpleNamespace(lora_name="adapter"))
    assert bridge.poll(lora) is True  # no lookup
    ck = manager.publish_local(lora, 8)
    assert bridge.store(lora, ck) is False
    assert bridge.build_meta(None).tasks == ()
    assert client.finds == 0
    assert not bridge.has_pending_work()
    assert bridge.report_status()["lookups"] == {}
    manager.assert_balanced()
    assert idle(client)["generations"] == 0


# --------------------------------------------------------------------------- store path


def test_store_pins_until_every_rank_reported_and_publishes(client: WrappedClient) -> None:
    bridge, manager, _ = make_bridge(client)
    producer = Req("p", list(TOKENS))
    ck = manager.publish_local(producer, 11)
    assert bridge.store(producer, ck)
    assert set(manager.boundary_checkpoints.pins) == set(ck.dependencies)
    (task,) = wait_tasks(bridge)
    assert bridge.build_meta(None).tasks == ()  # emitted exactly once
    # block ids: attention pages in position order, the recurrent page, the auxiliary page
    assert task.block_ids == (
        tuple(b for b in ck.block_ids[0] if b),
        (ck.block_ids[1][-1],),
        ck.auxiliary_block_ids,
    )
    payload = json.loads(task.manifest.payload)
    assert (
        task.manifest.payload == json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    )
    assert payload["worker_layout"] == LAYOUT
    assert payload["kind"] == "prompt" and payload["draft_prefix_len"] == 11
    assert [g["name"] for g in payload["page_groups"]] == [
        "engine-kv-group:0",
        "engine-kv-group:1",
        "target-draft-auxiliary",
    ]
    assert [g["positions"] for g in payload["page_groups"]] == [[0, 1, 2], [2], [0]]
    roots = rc.TokenRoots.build(bridge.namespace(None), TOKENS[:11])
    assert payload["page_groups"][0]["content_keys"] == roots.content_keys(
        [(4, "attention:0"), (8, "attention:0"), (11, "attention:0")]
    )
    assert payload["page_groups"][1]["content_keys"] == [roots.content_key(11, "recurrent:1")]
    assert payload["page_groups"][2]["content_keys"] == [
        roots.content_key(11, "auxiliary:11:prompt")
    ]
    assert task.manifest.generation == rc.checkpoint_generation(
        roots.prefix(11), task.manifest.payload
    )
    # rank 0 alone does not release the pin
    done = run_ranks(client.client, [task]).results[task.task_id]
    assert done == {0: True, 1: True}
    bridge.update(output(CheckpointWorkerMetadata(results={task.task_id: {0: True}})))
    assert manager.boundary_checkpoints.pins
    assert bridge.has_pending_work()
    bridge.update(output(CheckpointWorkerMetadata(results={task.task_id: {1: True}})))
    assert not manager.boundary_checkpoints.pins
    assert not bridge.has_pending_work()
    assert idle(client)["generations"] == 1
    assert client.client.find(roots.roots) == task.manifest
    # an identical store is suppressed by BEGIN: no task, pin released
    assert bridge.store(producer, ck)
    assert wait_tasks(bridge) == []
    assert bridge.report_status()["counters"]["store_suppressed"] == 1
    manager.assert_balanced()


def test_bridge_payloads_are_canonical_checkpoint_payloads(client: WrappedClient) -> None:
    # The Rust payload type parses what the bridge writes and rebuilds the
    # very same bytes, so switching the bridge to it keeps generation ids.
    bridge, manager, _ = make_bridge(client)
    producer = Req("p", list(TOKENS))
    ck = manager.publish_local(producer, 11)
    assert bridge.store(producer, ck)
    (task,) = wait_tasks(bridge)
    parsed = rc.CheckpointPayload.parse(task.manifest.payload)
    assert parsed.to_bytes() == task.manifest.payload
    assert parsed.worker_layout == LAYOUT
    assert (parsed.kind, parsed.draft_prefix_len, parsed.num_tokens) == ("prompt", 11, None)
    assert parsed.page_groups == task.manifest.page_groups()
    assert (
        rc.CheckpointPayload.build(
            worker_layout=LAYOUT,
            page_groups=task.manifest.page_groups(),
            draft_prefix_len=11,
            kind="prompt",
        )
        == task.manifest.payload
    )
    run_ranks(client.client, [task])
    results = {task.task_id: {0: True, 1: True}}
    bridge.update(output(CheckpointWorkerMetadata(results=results)))
    assert not bridge.has_pending_work()
    manager.assert_balanced()


class TwoStateManager(FakeManager):
    """A fork allocator whose Mamba group keeps its state in two pages."""

    def boundary_checkpoint_page_positions(self, num_tokens: int) -> tuple[tuple[int, ...], ...]:
        attention, _ = super().boundary_checkpoint_page_positions(num_tokens)
        count = math.ceil(num_tokens / BLOCK)
        return (attention, (count - 2, count - 1))


def test_a_recurrent_group_with_several_positions_gets_a_key_per_position(
    client: WrappedClient,
) -> None:
    # Issue 12, item 9: every position of a recurrent group got the key of
    # "recurrent:<g>", so one object stood for all of them and no restore of
    # the generation could ever succeed.
    bridge, manager, _ = make_bridge(client, TwoStateManager())
    producer = Req("p", list(TOKENS))
    ck = manager.publish_local(producer, 11)
    assert bridge.store(producer, ck)
    (task,) = wait_tasks(bridge)
    payload = json.loads(task.manifest.payload)
    recurrent = payload["page_groups"][1]
    assert recurrent["positions"] == [1, 2]
    roots = rc.TokenRoots.build(bridge.namespace(None), TOKENS[:11])
    assert recurrent["content_keys"] == roots.content_keys(
        [(11, "recurrent:1:1"), (11, "recurrent:1:2")]
    )
    assert len(set(recurrent["content_keys"])) == 2
    results = run_ranks(client.client, [task]).results[task.task_id]
    assert results == {0: True, 1: True}
    bridge.update(output(CheckpointWorkerMetadata(results={task.task_id: results})))
    assert client.client.find(roots.roots) == task.manifest
    # Every rank restores every page (two distinct state pages each).
    for rank in range(2):
        assert play_rank(client.client, task_retrieve(task), rank)
    idle(client)


def task_retrieve(task: CheckpointEngineTask) -> CheckpointEngineTask:
    """The same manifest as a RETRIEVE task (for play_rank)."""
    return CheckpointEngineTask(
        task_id=task.task_id,
        direction="RETRIEVE",
        manifest=task.manifest,
        block_ids=task.block_ids,
    )


def test_failed_begin_releases_source_pin_after_request_cancellation(
    client: WrappedClient,
) -> None:
    bridge, manager, _ = make_bridge(client)
    client.begin = lambda m: FailedFuture(errors.Unavailable("connection lost"))
    producer = Req("p", list(TOKENS))
    ck = manager.publish_local(producer, 8)
    assert bridge.store(producer, ck)
    assert manager.boundary_checkpoints.pins
    assert bridge.request_finished(producer) == (False, None)
    assert bridge.report_status()["cancelled_request_ids"] == ["p"]
    assert bridge.build_meta(None).tasks == ()
    assert not manager.boundary_checkpoints.pins
    assert len(client.aborted) == 1
    assert bridge.report_status()["cancelled_request_ids"] == []
    assert not bridge.has_pending_work()
    manager.assert_balanced()
    idle(client)


def test_unanswered_store_begin_is_aborted_after_the_timeout(client: WrappedClient) -> None:
    bridge, manager, clock = make_bridge(client, begin_timeout=5.0)
    sent: list[rc.Manifest] = []

    def begin_without_reply(m: rc.Manifest) -> NeverFuture:
        assert client.client.begin(m)  # the server stages it; the reply is "lost"
        sent.append(m)
        return NeverFuture()

    client.begin = begin_without_reply
    producer = Req("p", list(TOKENS))
    ck = manager.publish_local(producer, 8)
    assert bridge.store(producer, ck)
    assert bridge.build_meta(None).tasks == ()
    assert client.client.status()["pending"] == 1
    assert bridge.has_pending_work()
    clock.now += 4.9
    assert bridge.build_meta(None).tasks == ()
    assert manager.boundary_checkpoints.pins  # still waiting
    clock.now += 0.2
    assert bridge.build_meta(None).tasks == ()
    assert client.aborted == [sent[0].generation]
    assert not manager.boundary_checkpoints.pins
    assert not bridge.has_pending_work()
    deadline = time.monotonic() + 10
    while client.client.status()["pending"] and time.monotonic() < deadline:
        time.sleep(0.005)
    idle(client)
    manager.assert_balanced()


def test_failed_store_rank_aborts_and_releases(client: WrappedClient) -> None:
    bridge, manager, _ = make_bridge(client)
    producer = Req("p", list(TOKENS))
    ck = manager.publish_local(producer, 8)
    assert bridge.store(producer, ck)
    tasks = wait_tasks(bridge)
    bridge.update(output(run_ranks(client.client, tasks, fail=[1])))
    assert client.aborted == [tasks[0].manifest.generation]
    assert not manager.boundary_checkpoints.pins
    assert client.client.find(rc.TokenRoots.build(bridge.namespace(None), TOKENS).roots) is None
    manager.assert_balanced()


def test_store_task_capacity_skips_without_pinning(client: WrappedClient) -> None:
    bridge, manager, _ = make_bridge(client, max_tasks=1)
    producer = Req("p", list(TOKENS))
    a = manager.publish_local(producer, 8)
    b = manager.publish_local(producer, 11)
    assert bridge.store(producer, a)
    assert bridge.store(producer, b) is False
    assert set(manager.boundary_checkpoints.pins) == set(a.dependencies)
    tasks = wait_tasks(bridge)
    bridge.update(output(run_ranks(client.client, tasks)))
    manager.assert_balanced()


# --------------------------------------------------------------------------- restore path


@pytest.mark.parametrize("reply", ["never", "error", "miss"])
def test_lookup_without_a_usable_reply_admits_the_request(
    client: WrappedClient, reply: str
) -> None:
    bridge, manager, clock = make_bridge(client, lookup_timeout=60.0)
    if reply == "never":
        client.find = lambda roots: NeverFuture()
    elif reply == "error":
        client.find = lambda roots: FailedFuture(errors.Unavailable("sidecar restarted"))
    req = Req("r", list(TOKENS))
    if reply == "never":
        for _ in range(3):
            assert bridge.poll(req) is False
        clock.now += 59.9
        assert bridge.poll(req) is False
        clock.now += 0.2
        assert bridge.poll(req) is True
    else:
        assert drive_poll(bridge, req) is None
    assert bridge.poll(req) is True  # stays admitted; no second lookup
    assert client.finds == 1
    assert manager.reserves == []
    assert bridge.external_tokens(req) == 0
    assert not bridge.has_pending_work()
    manager.assert_balanced()


def test_restore_publishes_only_after_every_rank(client: WrappedClient) -> None:
    bridge, manager, _ = make_bridge(client)
    store_through(bridge, client, manager, 11)
    consumer = Req("c", [*TOKENS, 7, 8])
    tasks = drive_poll(bridge, consumer)
    assert tasks is not None
    (task,) = tasks
    assert task.direction == "RETRIEVE"
    assert manager.reserves[-1]["num_tokens"] == 11
    (cid,) = manager.pending_ids()
    assert bridge.poll(consumer) is False  # reserved is not visible
    assert bridge.build_meta(None).tasks == ()
    assert run_ranks(client.client, [task]).results[task.task_id] == {0: True, 1: True}
    bridge.update(output(CheckpointWorkerMetadata(results={task.task_id: {1: True}})))
    assert manager.pending_ids() == [cid] and manager.acks == []
    bridge.update(output(CheckpointWorkerMetadata(results={task.task_id: {0: True}})))
    assert manager.acks == [(cid, 0), (cid, 1)]
    assert manager.pending_ids() == []
    assert bridge.poll(consumer) is True
    found = manager.boundary_checkpoints.find(consumer, consumer.num_tokens)
    assert found is not None and found.checkpoint_id == cid and found.num_tokens == 11
    consumer.boundary_checkpoint = found
    assert bridge.external_tokens(consumer) == 11
    other = Req("other", [*TOKENS, 7, 8], boundary_checkpoint=found)
    assert bridge.external_tokens(other) == 0  # published for "c", not for "other"
    bridge.on_allocated(consumer)
    assert bridge.external_tokens(consumer) == 0
    assert bridge.poll(consumer) is True  # a preempted request is not looked up again
    assert client.finds == 1
    bridge.request_finished(consumer)
    assert not bridge.has_pending_work()
    manager.assert_balanced()
    idle(client)


def test_complete_local_hit_does_not_wait_for_the_directory(client: WrappedClient) -> None:
    bridge, manager, _ = make_bridge(client)
    consumer = Req("c", list(TOKENS))
    manager.publish_local(consumer, len(TOKENS))
    assert bridge.poll(consumer) is True
    assert client.finds == 0


def test_longer_local_checkpoint_keeps_the_selection(client: WrappedClient) -> None:
    bridge, manager, _ = make_bridge(client)
    ck = store_through(bridge, client, manager, 8)
    consumer = Req("c", [*TOKENS, 1])
    local = manager.publish_local(consumer, 11)
    assert drive_poll(bridge, consumer) is None
    assert manager.reserves == []
    assert client.finds == 1
    assert local.num_tokens > ck.num_tokens


def test_one_failing_rank_discards_and_retries_up_to_the_attempt_limit(
    client: WrappedClient,
) -> None:
    bridge, manager, _ = make_bridge(client, max_lookup_attempts=3)
    store_through(bridge, client, manager, 11)
    consumer = Req("c", [*TOKENS, 5])
    for attempt in range(3):
        tasks = drive_poll(bridge, consumer)
        assert tasks is not None, attempt
        bridge.update(output(run_ranks(client.client, tasks, fail=[1])))
        assert manager.pending_ids() == []
        assert manager.discards and manager.acks == []
    assert drive_poll(bridge, consumer) is None  # attempts exhausted: recompute
    assert client.finds == 3
    consumer.boundary_checkpoint = None
    assert bridge.external_tokens(consumer) == 0
    assert bridge.report_status()["counters"]["lookup_attempts-exhausted"] == 1
    manager.assert_balanced()
    idle(client)


def test_cancelled_mid_copy_discards_and_reused_id_waits(client: WrappedClient) -> None:
    bridge, manager, _ = make_bridge(client)
    store_through(bridge, client, manager, 11)
    old = Req("r", [*TOKENS, 1])
    tasks = drive_poll(bridge, old)
    assert tasks is not None
    assert bridge.request_finished(old) == (False, None)
    assert manager.pending_ids()  # pages stay pinned while copies run
    new = Req("r", [*TOKENS, 2, 3])
    assert bridge.poll(new) is False  # the id is still draining
    assert bridge.has_pending_work()
    bridge.update(output(run_ranks(client.client, tasks)))  # even all True: discard
    assert manager.acks == [] and manager.pending_ids() == []
    assert bridge.report_status()["cancelled_request_ids"] == []
    tasks = drive_poll(bridge, new)  # a fresh lookup of its own
    assert tasks is not None
    bridge.update(output(run_ranks(client.client, tasks)))
    assert bridge.poll(new) is True
    found = manager.boundary_checkpoints.find(new, new.num_tokens)
    assert found is not None
    new.boundary_checkpoint = found
    assert bridge.external_tokens(new) == 11
    manager.assert_balanced()
    idle(client)


def test_inflight_store_reused_request_id(client: WrappedClient) -> None:
    bridge, manager, _ = make_bridge(client)
    producer = Req("r", list(TOKENS))
    ck = manager.publish_local(producer, 8)
    assert bridge.store(producer, ck)
    tasks = wait_tasks(bridge)
    bridge.request_finished(producer)
    again = Req("r", [*TOKENS, 9])
    assert bridge.poll(again) is False
    bridge.update(output(run_ranks(client.client, tasks)))
    assert not manager.boundary_checkpoints.pins
    manager.forget_local(ck)
    tasks = drive_poll(bridge, again)
    assert tasks is not None and tasks[0].direction == "RETRIEVE"
    bridge.update(output(run_ranks(client.client, tasks)))
    assert bridge.poll(again) is True
    manager.assert_balanced()


def test_invalidated_before_publication_looks_up_again(client: WrappedClient) -> None:
    bridge, manager, _ = make_bridge(client)
    store_through(bridge, client, manager, 11)
    consumer = Req("c", [*TOKENS, 1])
    tasks = drive_poll(bridge, consumer)
    assert tasks is not None
    (cid,) = manager.pending_ids()
    manager.boundary_checkpoints._pending[cid].invalidated = True
    bridge.update(output(run_ranks(client.client, tasks)))
    assert manager.discards == []  # the allocator already discarded it
    tasks = drive_poll(bridge, consumer)
    assert tasks is not None  # the stored checkpoint is intact: restored again
    bridge.update(output(run_ranks(client.client, tasks)))
    assert bridge.poll(consumer) is True
    assert client.finds == 2
    manager.assert_balanced()


def test_legacy_capacity_refusal_admits_cold(client: WrappedClient) -> None:
    bridge, manager, _ = make_bridge(client, FakeManager(num_blocks=12))
    store_through(bridge, client, manager, 11)
    manager.free, hidden = manager.free[:2], manager.free[2:]
    consumer = Req("c", [*TOKENS, 1])
    assert drive_poll(bridge, consumer) is None
    assert manager.reserves and manager.pending_ids() == []
    manager.free += hidden
    manager.assert_balanced()


def test_admission_api_is_detected_and_capacity_waits_are_bounded(
    client: WrappedClient,
) -> None:
    manager = AdmissionManager(refuse=2)
    bridge, _, _ = make_bridge(client, manager)
    assert bridge.admission_api
    store_through(bridge, client, manager, 11)
    consumer = Req("c", [*TOKENS, 1])
    deadline = time.monotonic() + 10
    while not manager.reserves:  # FIND in flight, then the first (refused) reserve
        assert bridge.poll(consumer) is False
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert manager.reserves == [{"request_id": "c", "refused": True}]
    assert bridge.poll(consumer) is False  # a capacity waiter keeps waiting
    assert len(manager.reserves) == 2
    manager.expired.add("c")
    assert bridge.poll(consumer) is True
    assert manager.released == ["c"]
    # a second request gets its reservation with reserve_admission=True
    other = Req("d", [*TOKENS, 2])
    tasks = drive_poll(bridge, other)
    assert tasks is not None
    assert manager.reserves[-1]["reserve_admission"] is True
    bridge.update(output(run_ranks(client.client, tasks)))
    assert bridge.poll(other) is True
    bridge.request_finished(other)
    manager.assert_balanced()


def test_restore_task_timeout_releases_the_request_but_keeps_the_pages(
    client: WrappedClient,
) -> None:
    bridge, manager, clock = make_bridge(client, task_timeout=30.0)
    store_through(bridge, client, manager, 11)
    consumer = Req("c", [*TOKENS, 1])
    tasks = drive_poll(bridge, consumer)
    assert tasks is not None
    clock.now += 31
    assert bridge.poll(consumer) is True  # recompute
    assert manager.pending_ids()  # a wedged rank may still write
    assert bridge.has_pending_work()
    bridge.update(output(run_ranks(client.client, tasks)))  # late results
    assert manager.acks == [] and manager.pending_ids() == []
    manager.assert_balanced()


@pytest.mark.parametrize("lookup_sees_loss", [True, False])
def test_failed_restore_falls_back_to_the_longest_remaining_checkpoint(
    tmp_path: Path, lookup_sees_loss: bool
) -> None:
    l2 = tmp_path / "l2"
    l2.mkdir()
    srv = rc.Server.start(rpc_helpers.config(tmp_path, l1_bytes=8 << 20, l2_path=str(l2)))
    raw = rc.Client(srv.socket_path)
    try:
        client = WrappedClient(raw)
        bridge, manager, _ = make_bridge(client)

        def l2_files() -> set[Path]:
            deadline = time.monotonic() + 10
            while raw.status()["l2_queue"] and time.monotonic() < deadline:
                time.sleep(0.005)
            return {p for p in l2.rglob("*.page")}

        store_through(bridge, client, manager, 8)
        before = l2_files()
        store_through(bridge, client, manager, 11)
        unique = l2_files() - before
        assert unique  # the 11-token checkpoint's own pages (partial, recurrent, auxiliary)
        raw.clear(force=False)  # drop the RAM copies; the pages stay on disk
        for path in unique:
            path.unlink()
        consumer = Req("c", [*TOKENS, 1])
        roots = rc.TokenRoots.build(bridge.namespace(None), consumer.all_token_ids)
        listed = raw.find(roots.roots)
        assert listed is not None and listed.prefix.num_tokens == 11
        if lookup_sees_loss:
            lease = raw.begin_retrieve(listed, 0)  # someone else hits the loss first
            while lease.status == "pending":
                lease = raw.poll_retrieve(lease.lease_id or "")
            assert lease.status == "miss"
        tasks = drive_poll(bridge, consumer)
        assert tasks is not None
        if not lookup_sees_loss:
            assert tasks[0].manifest.prefix.num_tokens == 11
            bridge.update(output(run_ranks(raw, tasks)))
            assert manager.discards
            tasks = drive_poll(bridge, consumer)
            assert tasks is not None
        assert tasks[0].manifest.prefix.num_tokens == 8
        bridge.update(output(run_ranks(raw, tasks)))
        assert bridge.poll(consumer) is True
        found = manager.boundary_checkpoints.find(consumer, consumer.num_tokens)
        assert found is not None and found.num_tokens == 8
        consumer.boundary_checkpoint = found
        assert bridge.external_tokens(consumer) == 8
        assert client.finds == (1 if lookup_sees_loss else 2)
        manager.assert_balanced()
    finally:
        raw.close()
        srv.stop()


def test_report_status_is_plain_data(client: WrappedClient) -> None:
    bridge, _, _ = make_bridge(client)
    status = bridge.report_status()
    json.dumps(status)
    assert status["layout_negotiated"] is True
    assert "<table>" in bridge._repr_html_()


# --------------------------------------------------------------------------- the skip rule


def skip_rule(per_token: float = 1e-3, **kw: Any) -> SkipRule:
    return SkipRule(
        enabled=kw.pop("enabled", True),
        threshold=kw.pop("threshold", 1.0),
        meter=PrefillMeter(per_token),
    )


def slow_tier(client: WrappedClient, samples: int = 5) -> None:
    """FIND_LOCATED answers the real candidate as if its 3 pages sat in a
    shared tier measured at 50 ms per fetch."""

    def located(roots: Iterable[rc.Prefix]) -> Any:
        manifest = client.client.find(list(roots))
        if manifest is None:
            return DoneFuture(None)
        tier = {
            "tier": "shared",
            "pages": 3,
            "bytes": 3 * PAGE,
            "samples": samples,
            "latency_us": 50_000 if samples else 0,
            "bytes_per_s": 10**9 if samples else 0,
            "parallelism": 4,
        }
        return DoneFuture({"manifest": manifest, "tiers": [tier]})

    client.located = located


def test_a_restore_slower_than_recomputing_is_skipped_and_counted(
    client: WrappedClient,
) -> None:
    bridge, manager, _ = make_bridge(client, skip_rule=skip_rule())
    store_through(bridge, client, manager, 11)
    slow_tier(client)
    consumer = Req("c", [*TOKENS, 7, 8])
    assert drive_poll(bridge, consumer) is None, "admitted at once: nothing to wait for"
    assert (client.located_finds, client.finds) == (1, 0)
    assert manager.reserves == []
    counters = bridge.report_status()["counters"]
    assert counters["restores_skipped_cheaper_to_recompute"] == 1
    assert counters["tokens_recomputed_instead"] == 11
    assert "restores_started" not in counters
    (decision,) = bridge.report_status()["restore_cost"]["recent"]
    assert decision["skip"] and decision["tokens"] == 11
    assert decision["recompute_s"] == pytest.approx(0.011)
    assert bridge.poll(consumer) is True
    bridge.request_finished(consumer)
    assert not bridge.has_pending_work()
    manager.assert_balanced()
    idle(client)


@pytest.mark.parametrize(
    "case", ["no-figures", "high-threshold", "rule-off", "l1"], ids=lambda c: c
)
def test_a_restore_is_kept_without_figures_above_the_threshold_or_with_the_rule_off(
    client: WrappedClient, case: str
) -> None:
    rule = {
        "high-threshold": skip_rule(threshold=10.0),
        "rule-off": skip_rule(enabled=False),
    }.get(case, skip_rule())
    bridge, manager, _ = make_bridge(client, skip_rule=rule)
    store_through(bridge, client, manager, 11)
    if case != "l1":  # l1: the sidecar's real answer, every page in L1
        slow_tier(client, samples=0 if case == "no-figures" else 5)
    consumer = Req("c", [*TOKENS, 7, 8])
    tasks = drive_poll(bridge, consumer)
    assert tasks is not None and [t.direction for t in tasks] == ["RETRIEVE"]
    if case == "rule-off":
        assert (client.located_finds, client.finds) == (0, 1), "plain FINDs"
    else:
        assert (client.located_finds, client.finds) == (1, 0)
    bridge.update(output(run_ranks(client.client, tasks)))
    assert bridge.poll(consumer) is True
    counters = bridge.report_status()["counters"]
    assert counters["restores_published"] == 1
    assert "restores_skipped_cheaper_to_recompute" not in counters
    bridge.request_finished(consumer)
    manager.assert_balanced()
    idle(client)


def test_a_sidecar_without_find_located_gets_plain_finds(client: WrappedClient) -> None:
    bridge, manager, _ = make_bridge(client, skip_rule=skip_rule())
    store_through(bridge, client, manager, 11)
    client.located = lambda roots: FailedFuture(errors.ProtocolError("unknown variant 14"))
    consumer = Req("c", [*TOKENS, 7, 8])
    tasks = drive_poll(bridge, consumer)
    assert tasks is not None and [t.direction for t in tasks] == ["RETRIEVE"]
    assert (client.located_finds, client.finds) == (1, 1), "the same lookup, sent again"
    assert bridge.report_status()["restore_cost"]["find_located"] is False
    assert "lookup_find-error" not in bridge.report_status()["counters"]
    bridge.update(output(run_ranks(client.client, tasks)))
    assert bridge.poll(consumer) is True
    bridge.request_finished(consumer)
    other = Req("d", [*TOKENS[:6], 9, 9, 9])  # no checkpoint: a miss
    assert drive_poll(bridge, other) is None
    assert (client.located_finds, client.finds) == (1, 2), "no find_located any more"
    bridge.request_finished(other)
    manager.assert_balanced()
    idle(client)
