"""End to end: the real connector, worker and sidecar driven by the simulated engine.

Covers the sequences of ``docs/design/vllm-boundary-api.md`` §3 (a)-(f) for 1, 2 and 4
ranks (and ranks in separate processes), multi-turn continuation, a shared
system prompt and the write-once rule (an exact replay writes no payload bytes).
Every restore is verified byte for byte inside the ranks; every continued
generation must equal a cold run; every test ends with the idle invariant.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import lmcache_rc as rc
from lmcache_rc.testing import (
    FullAttentionSpec,
    HybridGeometry,
    MambaSpec,
    SimEngine,
    SlidingWindowSpec,
)
from lmcache_rc.testing.pytest_plugin import (  # noqa: F401  (fixtures)
    lmcache_rc_client,
    lmcache_rc_server,
    sim_engine_factory,
)

Factory = Callable[..., SimEngine]

SYSTEM = list(range(500, 532))  # 32 tokens
PROMPT = SYSTEM + list(range(10, 18))  # 40 tokens


@pytest.fixture(autouse=True)
def _idle_after(
    sim_engine_factory: Factory,  # noqa: F811
    lmcache_rc_client: rc.Client,  # noqa: F811
) -> Iterator[None]:
    yield
    status = lmcache_rc_client.status()
    assert status["store_leases"] == 0 and status["retrieve_leases"] == 0
    assert status["pins"] == 0 and status["pending"] == 0


def store(factory: Factory, prompt: list[int], n: int = 4, **kw: Any) -> list[int]:
    """Run ``prompt`` on a fresh engine (sequence (a)) and return its output."""
    eng = factory(**kw)
    r = eng.generate("producer", prompt, n)
    assert r.output_tokens == eng.model.reference_generate(prompt, n)
    assert r.stores_offered == len(r.published) >= 1
    eng.assert_idle()
    eng.close()
    return r.output_tokens


# ----------------------------------------------------------------------------- (a) + (b)


@pytest.mark.parametrize(
    ("world_size", "mode"),
    [(1, "thread"), (2, "thread"), (4, "thread"), (2, "spawn")],
    ids=["ws1", "ws2", "ws4", "ws2-processes"],
)
def test_store_then_restore_across_ranks(
    sim_engine_factory: Factory,  # noqa: F811
    lmcache_rc_client: rc.Client,  # noqa: F811
    world_size: int,
    mode: str,
) -> None:
    out = store(sim_engine_factory, PROMPT, world_size=world_size, rank_mode=mode)
    st = lmcache_rc_client.status()
    assert st["generations"] == 2  # prompt and response boundaries
    turn2 = PROMPT + out + [1, 2, 3]
    consumer = sim_engine_factory(world_size=world_size, rank_mode=mode)
    r = consumer.generate("consumer", turn2, 5)
    n = len(PROMPT) + len(out) - 1  # the response boundary
    assert r.restored_tokens == n
    assert r.recomputed_tokens == len(turn2) - n
    assert r.output_tokens == consumer.model.reference_generate(turn2, 5)
    assert consumer.stats.restores_verified == world_size
    consumer.assert_idle()


def test_world_size_mismatch_never_restores(sim_engine_factory: Factory) -> None:  # noqa: F811
    out = store(sim_engine_factory, PROMPT, world_size=2)
    consumer = sim_engine_factory(world_size=1)
    turn2 = PROMPT + out + [1]
    r = consumer.generate("c", turn2, 2)
    assert r.restored_tokens == 0
    assert r.output_tokens == consumer.model.reference_generate(turn2, 2)
    consumer.assert_idle()


def test_full_prompt_restore_is_a_saved_logits_step(sim_engine_factory: Factory) -> None:  # noqa: F811
    store(sim_engine_factory, PROMPT, world_size=2)
    consumer = sim_engine_factory(world_size=2)
    r = consumer.generate("c", PROMPT, 3)
    assert r.restored_tokens == len(PROMPT) and r.recomputed_tokens == 0
    assert consumer.stats.saved_logits_steps == 1
    assert r.output_tokens == consumer.model.reference_generate(PROMPT, 3)
    consumer.assert_idle()


def test_admission_api_allocator(sim_engine_factory: Factory) -> None:  # noqa: F811
    out = store(sim_engine_factory, PROMPT, world_size=2)
    consumer = sim_engine_factory(world_size=2, admission_api=True)
    turn2 = PROMPT + out + [9]
    r = consumer.generate("c", turn2, 3)
    assert r.restored_tokens == len(PROMPT) + len(out) - 1
    assert r.output_tokens == consumer.model.reference_generate(turn2, 3)
    consumer.assert_idle()


# ----------------------------------------------------------------------------- (c)


@pytest.mark.parametrize("ws", [1, 2, 4], ids=["ws1", "ws2", "ws4"])
@pytest.mark.parametrize("kind", ["reject", "raise", "fail"])
def test_restore_where_one_rank_fails_then_retries(
    sim_engine_factory: Factory,  # noqa: F811
    ws: int,
    kind: str,
) -> None:
    out = store(sim_engine_factory, PROMPT, world_size=ws)
    consumer = sim_engine_factory(world_size=ws)
    consumer.inject_fault(kind, rank=ws - 1, direction="RETRIEVE")  # type: ignore[arg-type]
    turn2 = PROMPT + out + [4, 5]
    r = consumer.generate("c", turn2, 3)
    # the failed attempt was discarded after both ranks reported; the retry restores
    assert r.output_tokens == consumer.model.reference_generate(turn2, 3)
    assert r.restored_tokens == len(PROMPT) + len(out) - 1
    counters = (consumer.status().connector or {}).get("counters", {})
    assert counters.get("restores_failed") == 1
    cache = consumer.manager.boundary_checkpoints
    assert cache is not None and cache.stats["discarded"] == 1
    assert consumer.status().ranks[ws - 1]["faults_injected"] == {kind: 1}
    consumer.assert_idle()


def test_restore_where_a_rank_always_fails_recomputes(sim_engine_factory: Factory) -> None:  # noqa: F811
    out = store(sim_engine_factory, PROMPT, world_size=4)
    consumer = sim_engine_factory(world_size=4)
    consumer.inject_fault("reject", rank=3, direction="RETRIEVE", count=100)
    turn2 = PROMPT + out + [4, 5]
    r = consumer.generate("c", turn2, 3)
    assert r.restored_tokens == 0
    assert r.recomputed_tokens == len(turn2)
    assert r.output_tokens == consumer.model.reference_generate(turn2, 3)
    cache = consumer.manager.boundary_checkpoints
    assert cache is not None and cache.stats["discarded"] >= 1
    consumer.assert_idle()


@pytest.mark.parametrize("ws", [1, 2, 4], ids=["ws1", "ws2", "ws4"])
def test_store_where_one_rank_fails_is_not_published(
    sim_engine_factory: Factory,  # noqa: F811
    ws: int,
    lmcache_rc_client: rc.Client,  # noqa: F811
) -> None:
    producer = sim_engine_factory(world_size=ws)
    producer.inject_fault("reject", rank=0, direction="STORE", count=100)
    r = producer.generate("p", PROMPT, 3)
    assert r.stores_offered >= 1
    producer.assert_idle()
    assert lmcache_rc_client.status()["generations"] == 0
    consumer = sim_engine_factory(world_size=ws)
    r2 = consumer.generate("c", [*PROMPT, 1], 2)
    assert r2.restored_tokens == 0
    consumer.assert_idle()


# ----------------------------------------------------------------------------- (d)


def _step_until_held(eng: SimEngine, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while eng.held_tasks() == 0:
        assert time.monotonic() < deadline, "no copy task was submitted"
        eng.step()


def _restore_held_mid_copy(
    factory: Factory, ws: int, request_id: str, held_rank: int
) -> tuple[SimEngine, list[int], list[int]]:
    """Stores PROMPT on one replica, then starts restoring its continuation on a
    second replica whose rank ``held_rank`` holds its copy in flight."""
    out = store(factory, PROMPT, world_size=ws)
    consumer = factory(world_size=ws)
    consumer.inject_fault("hold", rank=held_rank, direction="RETRIEVE")
    turn2 = PROMPT + out + [6]
    consumer.add_request(request_id, turn2, 3)
    _step_until_held(consumer)
    return consumer, out, turn2


@pytest.mark.parametrize("ws", [1, 2, 4], ids=["ws1", "ws2", "ws4"])
def test_request_cancelled_mid_copy_discards_the_import(
    sim_engine_factory: Factory,  # noqa: F811
    ws: int,
) -> None:
    consumer, _, _ = _restore_held_mid_copy(sim_engine_factory, ws, "c", 0)
    assert consumer.pending_imports()  # staged, pages pinned
    free_before = consumer.manager.block_pool.get_num_free_blocks()
    assert consumer.abort_request("c")
    for _ in range(5):
        consumer.step()
    # rank 0 has not reported: nothing may be discarded yet
    assert consumer.pending_imports()
    assert consumer.has_requests()  # pending push work keeps steps alive
    assert consumer.release_held() == 1
    consumer.run_until_idle()
    assert not consumer.pending_imports()
    cache = consumer.manager.boundary_checkpoints
    assert cache is not None and len(cache) == 0  # discarded, never published
    assert consumer.manager.block_pool.get_num_free_blocks() > free_before
    assert consumer.result("c").finish_reason == "abort"
    consumer.assert_idle()


# ----------------------------------------------------------------------------- (e)


@pytest.mark.parametrize("ws", [1, 2, 4], ids=["ws1", "ws2", "ws4"])
def test_request_id_reused_while_old_copy_pending(
    sim_engine_factory: Factory,  # noqa: F811
    ws: int,
) -> None:
    consumer, out, turn2 = _restore_held_mid_copy(sim_engine_factory, ws, "r", ws - 1)
    consumer.abort_request("r")
    y = consumer.add_request("r", turn2, 3)
    for _ in range(5):
        consumer.step()
    assert y.num_computed_tokens == 0  # parked while the old copies drain
    assert consumer.release_held() == 1
    consumer.run_until_idle()
    r = consumer.result("r")
    assert r.finish_reason == "length"
    assert r.output_tokens == consumer.model.reference_generate(turn2, 3)
    assert r.restored_tokens == len(PROMPT) + len(out) - 1  # Y restored on its own
    assert [h.finish_reason for h in consumer.history] == ["abort", "length"]
    consumer.assert_idle()


# ----------------------------------------------------------------------------- (f)


@pytest.mark.parametrize("ws", [1, 2, 4], ids=["ws1", "ws2", "ws4"])
def test_destination_evicted_before_publication(
    sim_engine_factory: Factory,  # noqa: F811
    ws: int,
) -> None:
    consumer, out, turn2 = _restore_held_mid_copy(sim_engine_factory, ws, "c", 0)
    assert consumer.evict_pending_import("c")
    consumer.release_held()
    consumer.run_until_idle()
    r = consumer.result("c")
    assert r.output_tokens == consumer.model.reference_generate(turn2, 3)
    cache = consumer.manager.boundary_checkpoints
    assert cache is not None and cache.stats["discarded"] >= 1
    # not published; the stored checkpoint is intact, so the retried lookup restores
    assert r.restored_tokens == len(PROMPT) + len(out) - 1
    counters = (consumer.status().connector or {}).get("counters", {})
    assert counters.get("restores_invalidated") == 1
    consumer.assert_idle()


# ----------------------------------------------------------------------------- scenarios


def test_multi_turn_each_turn_restores_the_previous_boundary(
    sim_engine_factory: Factory,  # noqa: F811
) -> None:
    tokens = list(PROMPT)
    prev_n = 0
    for turn in range(3):
        eng = sim_engine_factory(world_size=2)
        r = eng.generate(f"turn{turn}", tokens, 4)
        assert r.output_tokens == eng.model.reference_generate(tokens, 4)
        if turn:
            assert r.restored_tokens == prev_n
            assert r.recomputed_tokens == len(tokens) - prev_n == 3 + 1
        else:
            assert r.restored_tokens == 0
        eng.assert_idle()
        eng.close()
        prev_n = len(tokens) + len(r.output_tokens) - 1
        tokens = tokens + r.output_tokens + [turn, turn + 1, turn + 2]


def test_shared_system_prompt_restores_the_instruction_boundary(
    sim_engine_factory: Factory,  # noqa: F811
) -> None:
    a = sim_engine_factory(world_size=2)
    ra = a.generate("a", PROMPT, 2, instruction_boundary=len(SYSTEM))
    assert ("instruction", len(SYSTEM)) in ra.published
    a.assert_idle()
    b = sim_engine_factory(world_size=2)
    other = [*SYSTEM, 77, 78, 79, 80, 81]
    rb = b.generate("b", other, 3)
    assert rb.restored_tokens == len(SYSTEM)
    assert rb.recomputed_tokens == 5
    assert rb.output_tokens == b.model.reference_generate(other, 3)
    b.assert_idle()


@pytest.fixture
def lmcache_rc_server_config(tmp_path: Any) -> dict[str, Any]:
    return {"l2_path": str(tmp_path / "l2")}


def _durable_status(client: rc.Client) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        st = client.status()
        if st["l2_queue"] == 0 or time.monotonic() > deadline:
            return st
        time.sleep(0.01)


def test_exact_replay_writes_zero_bytes(
    sim_engine_factory: Factory,  # noqa: F811
    lmcache_rc_client: rc.Client,  # noqa: F811
) -> None:
    store(sim_engine_factory, PROMPT, world_size=2)
    before = _durable_status(lmcache_rc_client)
    assert before["l2_bytes_written"] > 0
    replay = sim_engine_factory(world_size=2)
    r = replay.generate("again", PROMPT, 4)
    assert r.restored_tokens == len(PROMPT)
    replay.assert_idle()
    after = _durable_status(lmcache_rc_client)
    assert after["l2_bytes_written"] == before["l2_bytes_written"]
    assert after.get("store_pages_new", 0) == before.get("store_pages_new", 0)
    assert after["generations"] == before["generations"]


@pytest.mark.parametrize(
    "geo",
    [
        HybridGeometry(
            groups=(FullAttentionSpec(8), MambaSpec(16), SlidingWindowSpec(8, sliding_window=12)),
            dcp=2,
            speculative_method="mtp",
        ),
        HybridGeometry(
            groups=(FullAttentionSpec(32), MambaSpec(8), MambaSpec(8)),
            tensor_parallel_size=2,
            page_bytes=512,
        ),
        HybridGeometry(tensor_parallel_size=2, minimal_layout=True),
    ],
    ids=["dcp2-swa-mtp", "mixed-block-sizes", "minimal-layout"],
)
def test_hybrid_geometries(
    sim_engine_factory: Factory,  # noqa: F811
    geo: HybridGeometry,
) -> None:
    out = store(sim_engine_factory, PROMPT, world_size=2, geometry=geo)
    consumer = sim_engine_factory(world_size=2, geometry=geo)
    turn2 = PROMPT + out + [3]
    r = consumer.generate("c", turn2, 3)
    assert r.restored_tokens == len(PROMPT) + len(out) - 1
    assert r.output_tokens == consumer.model.reference_generate(turn2, 3)
    consumer.assert_idle()


def test_wedged_copy_times_out_but_keeps_its_pages(sim_engine_factory: Factory) -> None:  # noqa: F811
    now = [1000.0]
    out = store(sim_engine_factory, PROMPT, world_size=2)
    consumer = sim_engine_factory(
        world_size=2, clock=lambda: now[0], extra_config={"lmcache_rc.task_timeout": 5.0}
    )
    consumer.inject_fault("hold", rank=0, direction="RETRIEVE")
    turn2 = [*PROMPT, *out, 6]
    consumer.add_request("c", turn2, 3)
    _step_until_held(consumer)
    now[0] += 10.0  # past the task timeout: the request is released to recompute
    consumer.run_until(lambda: consumer.result("c").finished)
    r = consumer.result("c")
    assert r.restored_tokens == 0
    assert r.output_tokens == consumer.model.reference_generate(turn2, 3)
    assert consumer.pending_imports()  # the wedged copy still owns its pages
    assert consumer.has_requests()
    assert consumer.release_held() == 1
    consumer.run_until_idle()
    assert not consumer.pending_imports()
    consumer.assert_idle()


def test_store_pin_blocks_reset_prefix_cache(sim_engine_factory: Factory) -> None:  # noqa: F811
    producer = sim_engine_factory(world_size=2)
    producer.inject_fault("hold", rank=1, direction="STORE", count=100)
    producer.add_request("p", PROMPT, 2)
    producer.run_until(lambda: producer.held_tasks() > 0)
    assert producer.manager.reset_prefix_cache() is False
    producer.run_until(lambda: producer.result("p").finished)
    producer.release_held()
    producer.clear_faults()
    producer.run_until_idle()
    producer.assert_idle()
    assert producer.manager.reset_prefix_cache() is True


def test_preemption_under_pool_pressure(sim_engine_factory: Factory) -> None:  # noqa: F811
    eng = sim_engine_factory(world_size=2, num_blocks=10, max_num_batched_tokens=32)
    a, b = list(PROMPT), list(range(200, 236))
    eng.add_request("a", a, 40)
    eng.add_request("b", b, 40)
    eng.run_until_idle()
    # Whether a request is preempted depends on when store copies release
    # their pins (timing); preemption itself is pinned deterministically by
    # test_sim_engine.py::test_preemption_recomputes_and_matches_reference.
    # Here, whatever happened under pressure, outputs and restores are exact.
    assert eng.result("a").output_tokens == eng.model.reference_generate(a, 40)
    assert eng.result("b").output_tokens == eng.model.reference_generate(b, 40)
    eng.assert_idle()
    # what was stored under pressure restores exactly on another replica
    consumer = sim_engine_factory(world_size=2)
    turn2 = [*a, *eng.result("a").output_tokens, 5]
    r = consumer.generate("c", turn2, 3)
    assert r.output_tokens == consumer.model.reference_generate(turn2, 3)
    consumer.assert_idle()


def test_cancel_mid_copy_with_process_ranks(sim_engine_factory: Factory) -> None:  # noqa: F811
    out = store(sim_engine_factory, PROMPT, world_size=2, rank_mode="spawn")
    consumer = sim_engine_factory(world_size=2, rank_mode="spawn")
    consumer.inject_fault("hold", rank=1, direction="RETRIEVE")
    consumer.add_request("c", [*PROMPT, *out, 6], 3)
    _step_until_held(consumer)
    consumer.abort_request("c")
    consumer.step()
    assert consumer.pending_imports()
    consumer.release_held()
    consumer.run_until_idle()
    cache = consumer.manager.boundary_checkpoints
    assert cache is not None and len(cache) == 0
    assert consumer.status()._repr_html_().count("<table>") >= 4
    consumer.assert_idle()
