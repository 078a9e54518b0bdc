"""The simulated engine on its own: toy model, allocator and cache semantics, local runs.

No connector and no sidecar: these pin the vLLM-side contract
(``docs/design/vllm-boundary-api.md`` §2.3, §2.4, §2.6, §4) that the connector is tested against.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lmcache_rc.testing import (
    BoundaryCheckpoint,
    FullAttentionSpec,
    HybridGeometry,
    MambaSpec,
    RankError,
    SimAdmissionKVCacheManager,
    SimEngine,
    SimKVCacheManager,
    SimRequest,
    SlidingWindowSpec,
    ToyHybridModel,
)
from lmcache_rc.testing.allocator import BlockPool, build_kv_cache_config
from lmcache_rc.testing.config import SimKVTransferConfig, get_connector_class
from lmcache_rc.vllm.api import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
    is_recurrent_group,
    supports_admission_api,
)

PROMPT = list(range(100, 140))  # 40 tokens


def geometry(**kw: Any) -> HybridGeometry:
    return HybridGeometry(**kw)


# ----------------------------------------------------------------------------- toy model


def test_toy_model_pages_are_pure_functions_of_tokens() -> None:
    a = ToyHybridModel(geometry(tensor_parallel_size=2))
    b = ToyHybridModel(geometry(tensor_parallel_size=2))
    assert np.array_equal(a.attention_page(0, 0, 1, PROMPT), b.attention_page(0, 0, 1, PROMPT))
    assert np.array_equal(a.recurrent_page(1, 1, PROMPT), b.recurrent_page(1, 1, PROMPT))
    assert np.array_equal(a.auxiliary_page(0, PROMPT), b.auxiliary_page(0, PROMPT))
    # TP shards differ per rank
    assert not np.array_equal(a.recurrent_page(0, 1, PROMPT), a.recurrent_page(1, 1, PROMPT))
    # a full page does not depend on later tokens; a partial one does
    assert np.array_equal(a.attention_page(0, 0, 0, PROMPT[:20]), a.attention_page(0, 0, 0, PROMPT))
    assert not np.array_equal(
        a.attention_page(0, 0, 2, PROMPT[:36]), a.attention_page(0, 0, 2, PROMPT)
    )
    assert a.attention_page(0, 0, 0, PROMPT).dtype == np.uint8
    assert a.attention_page(0, 0, 0, PROMPT).shape == (256,)


def test_toy_model_dcp_replication() -> None:
    m = ToyHybridModel(geometry(dcp=2, groups=(FullAttentionSpec(8), MambaSpec(16))))
    # full attention is DCP-sharded, recurrent state replicated across DCP ranks
    assert not np.array_equal(m.attention_page(0, 0, 0, PROMPT), m.attention_page(1, 0, 0, PROMPT))
    assert np.array_equal(m.recurrent_page(0, 1, PROMPT), m.recurrent_page(1, 1, PROMPT))


def test_reference_generation_is_deterministic_and_prefix_consistent() -> None:
    m = ToyHybridModel(geometry())
    out = m.reference_generate(PROMPT, 6)
    assert out == m.reference_generate(PROMPT, 6)
    assert m.reference_generate(PROMPT, 3) == out[:3]
    # continuing from prompt + first outputs gives the rest
    assert m.reference_generate(PROMPT + out[:2], 4) == out[2:]
    assert all(0 <= t < 1000 for t in out)
    with pytest.raises(ValueError):
        m.reference_generate([], 1)


def test_page_positions() -> None:
    g = geometry(
        groups=(FullAttentionSpec(16), MambaSpec(16), SlidingWindowSpec(8, sliding_window=16)),
        max_model_len=256,
    )
    assert g.page_positions(40) == ((0, 1, 2), (2,), (3, 4))
    assert g.page_positions(16) == ((0,), (0,), (0, 1))
    assert g.page_positions(1) == ((0,), (0,), (0,))
    for bad in (0, 257):
        with pytest.raises(ValueError):
            g.page_positions(bad)
    dcp = geometry(dcp=2, groups=(FullAttentionSpec(16), MambaSpec(16)))
    assert dcp.page_width(0) == 32 and dcp.page_width(1) == 16
    assert dcp.page_positions(40) == ((0, 1), (2,))
    mtp = geometry(speculative_method="mtp")
    assert mtp.draft_prefix_len(40) == 39 and geometry().draft_prefix_len(40) == 40


def test_is_recurrent_group_uses_spec_class() -> None:
    cfg = build_kv_cache_config(geometry(), 16)
    assert [is_recurrent_group(g) for g in cfg.kv_cache_groups] == [False, True]


# ----------------------------------------------------------------------------- block pool


def test_block_pool_null_block_refcounts_and_lru() -> None:
    evicted: list[int] = []
    pool = BlockPool(5, on_evict=evicted.append)
    assert pool.get_num_free_blocks() == 4
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_used_blocks == 3
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2
    pool.free_blocks([blocks[2], blocks[1], blocks[0]])
    assert blocks[0].ref_cnt == 1
    # freed blocks join the tail in free order: 4 (never used), 3, 2
    assert pool.free_block_queue.get_all_free_block_ids() == [4, 3, 2]
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [4, 3, 2]
    assert 0 not in [b.block_id for b in got]
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.blocks[1], pool.blocks[1], pool.blocks[1]])
    assert pool.null_block.block_id == 0


# ----------------------------------------------------------------------------- cache + manager


def request(rid: str = "r", tokens: list[int] | None = None, **kw: Any) -> SimRequest:
    return SimRequest(rid, list(tokens or PROMPT), **kw)


def reserve(
    mgr: SimKVCacheManager, req: SimRequest, n: int, ranks: int = 2, **kw: Any
) -> BoundaryCheckpoint | None:
    return mgr.reserve_external_boundary_checkpoint(
        req,
        n,
        mgr.boundary_checkpoint_page_positions(n),
        draft_prefix_len=n,
        kind="prompt",
        num_ranks=ranks,
        **kw,
    )


def test_reserve_stage_acknowledge_publish() -> None:
    mgr = SimKVCacheManager(geometry(), 32)
    cache = mgr.boundary_checkpoints
    assert cache is not None
    req = request()
    free0 = mgr.block_pool.get_num_free_blocks()
    ckpt = reserve(mgr, req, 40)
    assert ckpt is not None
    # 3 attention pages + 1 state page + 1 auxiliary page, pinned by the stage
    assert len(ckpt.dependencies) == 5
    assert ckpt.block_ids[0][:3] == ckpt.block_ids[0] and 0 not in ckpt.block_ids[0]
    assert ckpt.block_ids[1][:2] == (0, 0) and ckpt.block_ids[1][2] != 0
    assert mgr.block_pool.get_num_free_blocks() == free0 - 5
    assert all(mgr.block_pool.blocks[b].ref_cnt == 1 for b in ckpt.dependencies)
    assert cache.is_pending(ckpt.checkpoint_id) and ckpt.checkpoint_id in cache._pending
    # reserved ≠ visible
    assert cache.find(req, 40) is None
    assert mgr.get_computed_blocks(req)[1] == 0
    with pytest.raises(ValueError):
        mgr.acknowledge_external_boundary_checkpoint(ckpt.checkpoint_id, 2)
    assert mgr.acknowledge_external_boundary_checkpoint(ckpt.checkpoint_id, 1) is False
    assert mgr.acknowledge_external_boundary_checkpoint(ckpt.checkpoint_id, 1) is False  # a set
    assert cache.find(req, 40) is None
    assert mgr.acknowledge_external_boundary_checkpoint(ckpt.checkpoint_id, 0) is True
    assert ckpt.checkpoint_id in cache._entries and len(cache) == 1
    # stage pin released: free-but-cached
    assert mgr.block_pool.get_num_free_blocks() == free0
    assert cache.find(req, 40) == ckpt
    assert cache.find(req, 39) is None
    blocks, n, _ = mgr.get_computed_blocks(req)
    assert n == 40 and req.boundary_checkpoint == ckpt
    assert blocks.get_block_ids()[1][2] == ckpt.block_ids[1][2]
    # resolved ids: further acks are False, discard is a no-op
    assert mgr.acknowledge_external_boundary_checkpoint(ckpt.checkpoint_id, 0) is False
    mgr.discard_external_boundary_checkpoint(ckpt.checkpoint_id)
    assert len(cache) == 1


def test_find_requires_exact_prefix_and_salt() -> None:
    mgr = SimKVCacheManager(geometry(), 32)
    cache = mgr.boundary_checkpoints
    assert cache is not None
    ckpt = reserve(mgr, request(), 20, ranks=1)
    assert ckpt is not None and mgr.acknowledge_external_boundary_checkpoint(ckpt.checkpoint_id, 0)
    assert cache.find(request("x", [*PROMPT, 1, 2]), 100) == ckpt
    other = PROMPT.copy()
    other[5] += 1
    assert cache.find(request("y", other), 100) is None
    assert cache.find(request("z", cache_salt="tenant-b"), 100) is None
    assert cache.find(request("w", skip_reading_prefix_cache=True), 100) is None
    assert cache.find(request("v", PROMPT[:19]), 100) is None


def test_reserve_validation_and_capacity() -> None:
    mgr = SimKVCacheManager(geometry(), 8)
    req = request()
    pos = mgr.boundary_checkpoint_page_positions(40)
    bad_calls: list[dict[str, Any]] = [
        {"num_tokens": 41, "page_positions": mgr.boundary_checkpoint_page_positions(41)},
        {"num_tokens": 0, "page_positions": pos},
        {"num_tokens": 40, "page_positions": ((0, 1), (2,))},
        {"num_tokens": 40, "page_positions": pos, "kind": "bogus"},
        {"num_tokens": 40, "page_positions": pos, "num_ranks": 0},
        {"num_tokens": 40, "page_positions": pos, "draft_prefix_len": 41},
    ]
    for call in bad_calls:
        args = {"kind": "prompt", "num_ranks": 1, "draft_prefix_len": 0, **call}
        with pytest.raises(ValueError):
            mgr.reserve_external_boundary_checkpoint(
                req,
                args.pop("num_tokens"),
                args.pop("page_positions"),
                **args,
            )
    # 7 usable blocks: a 40-token bundle needs 5, a second one cannot fit
    first = reserve(mgr, req, 40)
    assert first is not None
    free = mgr.block_pool.get_num_free_blocks()
    assert reserve(mgr, request("b"), 40) is None
    assert mgr.block_pool.get_num_free_blocks() == free
    mgr.discard_external_boundary_checkpoint(first.checkpoint_id)
    assert mgr.block_pool.get_num_free_blocks() == 7
    assert mgr.boundary_checkpoints is not None and not mgr.boundary_checkpoints._pending
    # a restore that can never fit the pool
    tiny = SimKVCacheManager(geometry(), 4)
    with pytest.raises(ValueError):
        reserve(tiny, req, 40)


def test_stage_rejects_reused_id_and_unowned_blocks() -> None:
    mgr = SimKVCacheManager(geometry(), 16)
    cache = mgr.boundary_checkpoints
    assert cache is not None
    req = request()
    ckpt = reserve(mgr, req, 10, ranks=1)
    assert ckpt is not None
    with pytest.raises(ValueError, match="already used"):
        cache.stage(req, ckpt, 1)
    unowned = BoundaryCheckpoint(cache.next_id(), 10, ((9,), (10,)), (11,), 10, "prompt")
    with pytest.raises(ValueError, match="unowned"):
        cache.stage(req, unowned, 1)
    with pytest.raises(ValueError):
        cache.stage(
            req, BoundaryCheckpoint(cache.next_id(), 10, ((0,), (0,)), (0,), 10, "prompt"), 1
        )


def test_invalidated_before_publication_is_discarded_by_last_ack() -> None:
    mgr = SimKVCacheManager(geometry(), 16)
    cache = mgr.boundary_checkpoints
    assert cache is not None
    free0 = mgr.block_pool.get_num_free_blocks()
    ckpt = reserve(mgr, request(), 40)
    assert ckpt is not None
    mgr.evict_blocks([min(ckpt.dependencies)])
    assert cache.is_pending(ckpt.checkpoint_id)  # pages stay pinned until all ranks ack
    assert mgr.block_pool.get_num_free_blocks() == free0 - 5
    assert mgr.acknowledge_external_boundary_checkpoint(ckpt.checkpoint_id, 0) is False
    assert mgr.acknowledge_external_boundary_checkpoint(ckpt.checkpoint_id, 1) is False
    assert not cache.is_pending(ckpt.checkpoint_id) and len(cache) == 0
    assert mgr.block_pool.get_num_free_blocks() == free0
    assert not mgr.pending_external_checkpoints()


def test_lru_reuse_of_a_dependency_invalidates_the_published_bundle() -> None:
    mgr = SimKVCacheManager(geometry(), 16)
    cache = mgr.boundary_checkpoints
    assert cache is not None
    ckpt = reserve(mgr, request(), 40, ranks=1)
    assert ckpt is not None and mgr.acknowledge_external_boundary_checkpoint(ckpt.checkpoint_id, 0)
    dep = max(ckpt.dependencies)
    assert cache.contains_block(dep)
    mgr.block_pool.free_block_queue.move_to_front(dep)
    (block,) = mgr.block_pool.get_new_blocks(1)
    assert block.block_id == dep
    assert ckpt.checkpoint_id not in cache._entries
    assert cache.find(request(), 40) is None
    assert not cache.contains_block(dep)


def test_acquire_release_and_reset_prefix_cache() -> None:
    mgr = SimKVCacheManager(geometry(), 16)
    cache = mgr.boundary_checkpoints
    assert cache is not None
    ckpt = reserve(mgr, request(), 40, ranks=1)
    assert ckpt is not None
    assert cache.acquire(ckpt.checkpoint_id) is None  # not published yet
    with pytest.raises(RuntimeError):
        cache.clear()
    assert mgr.reset_prefix_cache() is False
    assert mgr.acknowledge_external_boundary_checkpoint(ckpt.checkpoint_id, 0)
    pinned = cache.acquire(ckpt.checkpoint_id)
    assert pinned == ckpt
    assert mgr.reset_prefix_cache() is False  # a store pin is held
    cache.release(pinned)
    assert mgr.reset_prefix_cache() is True
    assert len(cache) == 0


def test_identical_endpoint_is_deduplicated() -> None:
    mgr = SimKVCacheManager(geometry(), 32)
    cache = mgr.boundary_checkpoints
    assert cache is not None
    a = reserve(mgr, request("a"), 40, ranks=1)
    assert a is not None and mgr.acknowledge_external_boundary_checkpoint(a.checkpoint_id, 0)
    b = reserve(mgr, request("b"), 40, ranks=1)
    assert b is not None and mgr.acknowledge_external_boundary_checkpoint(b.checkpoint_id, 0)
    assert list(cache._entries) == [b.checkpoint_id]
    assert cache.stats["deduplicated"] == 1


def test_admission_api_detection_and_ownership() -> None:
    legacy = SimKVCacheManager(geometry(), 16)
    newer = SimAdmissionKVCacheManager(geometry(), 16)
    assert not supports_admission_api(legacy)
    assert supports_admission_api(newer)
    req = request()
    ckpt = reserve(newer, req, 40, reserve_admission=True)
    assert ckpt is not None
    assert newer.has_external_boundary_admission("r")
    assert newer.external_boundary_reserved_blocks() == 5
    assert not newer.external_boundary_admission_ready("r")
    assert newer.can_admit_external_boundary_request("r")
    newer.acknowledge_external_boundary_checkpoint(ckpt.checkpoint_id, 0)
    assert newer.acknowledge_external_boundary_checkpoint(ckpt.checkpoint_id, 1)
    # published and owned by the consumer: not evictable, reset refused
    assert newer.external_boundary_admission_ready("r")
    assert newer.reset_prefix_cache() is False
    newer.release_external_boundary_admission("r")
    newer.release_external_boundary_admission("r")  # idempotent
    assert not newer.has_pending_external_boundary_admissions()
    assert newer.external_boundary_reserved_blocks() == 0
    assert newer.block_pool.num_used_blocks == 0


def test_admission_capacity_waiters_are_fifo() -> None:
    mgr = SimAdmissionKVCacheManager(geometry(), 8)
    first = reserve(mgr, request("a"), 40, reserve_admission=True)
    assert first is not None
    assert reserve(mgr, request("b"), 40, reserve_admission=True) is None
    assert reserve(mgr, request("c"), 10, reserve_admission=True) is None  # behind "b"
    assert not mgr.can_admit_external_boundary_request("c")
    assert mgr.can_admit_external_boundary_request("b")
    mgr.discard_external_boundary_checkpoint(first.checkpoint_id)
    mgr.release_external_boundary_admission("a")
    second = reserve(mgr, request("b"), 40, reserve_admission=True)
    assert second is not None
    mgr.discard_external_boundary_checkpoint(second.checkpoint_id)
    for rid in "abc":
        mgr.release_external_boundary_admission(rid)
    assert not mgr.has_pending_external_boundary_admissions()


# ----------------------------------------------------------------------------- local engine


@pytest.mark.parametrize(
    "geo",
    [
        geometry(),
        geometry(tensor_parallel_size=2),
        geometry(
            dcp=2,
            groups=(FullAttentionSpec(8), MambaSpec(16), SlidingWindowSpec(8, sliding_window=12)),
            speculative_method="mtp",
        ),
        geometry(groups=(FullAttentionSpec(16),)),
    ],
    ids=["tp1", "tp2", "dcp2-swa-mtp", "attention-only"],
)
def test_local_engine_matches_reference_and_restores_exactly(geo: HybridGeometry) -> None:
    with SimEngine(None, connector=None, world_size=geo.world_size, geometry=geo) as eng:
        first = eng.generate("a", PROMPT, 5)
        assert first.output_tokens == eng.model.reference_generate(PROMPT, 5)
        assert first.published == [("prompt", 40), ("response", 44)]
        assert first.local_hit_tokens == 0 and first.recomputed_tokens == 40
        # next turn restores the response boundary locally and recomputes the rest
        turn2 = PROMPT + first.output_tokens + [7, 8, 9]
        second = eng.generate("b", turn2, 4)
        assert second.output_tokens == eng.model.reference_generate(turn2, 4)
        assert second.local_hit_tokens == 44 and second.recomputed_tokens == 4
        assert second.restored_tokens == 0  # local, not imported
        assert eng.stats.restores_verified == geo.world_size
        eng.assert_idle()


def test_full_prompt_hit_uses_a_saved_logits_step() -> None:
    with SimEngine(None, connector=None, world_size=2) as eng:
        eng.generate("a", PROMPT, 3)
        again = eng.generate("b", PROMPT, 3)
        assert again.local_hit_tokens == 40 and again.recomputed_tokens == 0
        assert again.output_tokens == eng.model.reference_generate(PROMPT, 3)
        assert eng.stats.saved_logits_steps == 1
        eng.assert_idle()


def test_instruction_boundary_is_published() -> None:
    with SimEngine(None, connector=None) as eng:
        r = eng.generate("a", PROMPT, 2, instruction_boundary=24)
        assert ("instruction", 24) in r.published
        other = [*PROMPT[:24], 5, 6, 7]
        r2 = eng.generate("b", other, 2)
        assert r2.local_hit_tokens == 24
        assert r2.output_tokens == eng.model.reference_generate(other, 2)
        eng.assert_idle()


def test_corrupted_restore_is_detected() -> None:
    with SimEngine(None, connector=None) as eng:
        eng.generate("a", PROMPT, 2)
        cache = eng.manager.boundary_checkpoints
        assert cache is not None
        (ckpt,) = [e.checkpoint for e in cache._entries.values() if e.checkpoint.num_tokens == 40]
        block = ckpt.block_ids[1][-1]
        eng.rank_runner(0).pool[block, 0] ^= 0xFF
        with pytest.raises(RankError, match="differs from recomputation"):
            eng.generate("b", [*PROMPT, 1, 2, 3], 2)


def test_many_requests_batched_and_aborted() -> None:
    with SimEngine(None, connector=None, world_size=2, max_num_batched_tokens=32) as eng:
        prompts = {f"r{i}": [i] * 5 + PROMPT[: 10 + 7 * i] for i in range(5)}
        for rid, p in prompts.items():
            eng.add_request(rid, p, 4)
        eng.step()
        assert eng.abort_request("r4")
        assert not eng.abort_request("nope")
        eng.run_until_idle()
        for rid, p in prompts.items():
            res = eng.result(rid)
            if rid == "r4":
                assert res.finish_reason == "abort"
            else:
                assert res.output_tokens == eng.model.reference_generate(p, 4)
        # the id may be reused once finished
        eng.generate("r4", prompts["r4"], 2)
        assert len(eng.history) == 6
        eng.assert_idle()
        assert eng.manager.block_pool.get_num_free_blocks() == eng.num_blocks - 1


def test_status_and_results_render_html() -> None:
    with SimEngine(None, connector=None) as eng:
        r = eng.generate("a", PROMPT, 2)
        assert "<table>" in r._repr_html_()
        st = eng.status()
        assert st.sidecar is None and st.connector is None
        assert "SimEngine" in st._repr_html_()
        assert st.as_dict()["stats"]["requests_finished"] == 1


def test_process_ranks_without_connector() -> None:
    with SimEngine(None, connector=None, world_size=2, rank_mode="spawn") as eng:
        r = eng.generate("a", PROMPT, 3)
        assert r.output_tokens == eng.model.reference_generate(PROMPT, 3)
        r2 = eng.generate("b", PROMPT + r.output_tokens, 2)
        assert r2.local_hit_tokens == 42
        assert eng.stats.restores_verified == 2
        page = eng.read_page(1, 1)
        assert len(page) == eng.geometry.page_bytes
        eng.assert_idle()


# ----------------------------------------------------------------------------- factory and config


class NoCheckpointConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """A connector whose class declines boundary checkpoints (the base answer)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(self, request: Any, n: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, n: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None


class NoKwConnector:
    def __init__(self, vllm_config: Any, role: Any) -> None:
        pass


class NotHMAConnector:
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        pass


def test_connector_declining_boundary_checkpoints_runs_without_the_cache() -> None:
    with SimEngine(
        "/nonexistent.sock",
        connector="NoCheckpointConnector",
        connector_module_path=__name__,
    ) as eng:
        assert eng.use_boundary is False
        assert eng.manager.boundary_checkpoints is None
        r = eng.generate("a", PROMPT, 3)
        assert r.output_tokens == eng.model.reference_generate(PROMPT, 3)
        assert r.published == []
        eng.assert_idle(sidecar=False)


def test_factory_checks() -> None:
    cfg = SimKVTransferConfig("NoKwConnector", __name__, "kv_both")
    with pytest.raises(ValueError, match="kv_cache_config"):
        get_connector_class(cfg)
    with pytest.raises(ValueError, match="kv_role"):
        SimKVTransferConfig("X", __name__)
    with pytest.raises(ValueError, match="SupportsHMA"):
        SimEngine("/x.sock", connector="NotHMAConnector", connector_module_path=__name__)
    with pytest.raises(ValueError):
        SimEngine("/x.sock", connector="Missing", connector_module_path=__name__)


def test_preemption_recomputes_and_matches_reference() -> None:
    with SimEngine(None, connector=None, num_blocks=10, max_num_batched_tokens=32) as eng:
        a, b = list(range(100, 140)), list(range(200, 236))
        eng.add_request("a", a, 30)
        eng.add_request("b", b, 30)
        eng.run_until_idle()
        assert eng.stats.preemptions >= 1
        assert eng.result("b").preemptions >= 1
        assert eng.result("a").output_tokens == eng.model.reference_generate(a, 30)
        assert eng.result("b").output_tokens == eng.model.reference_generate(b, 30)
        eng.assert_idle()
