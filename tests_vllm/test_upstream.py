"""Upstream mode end to end, driven by vLLM 0.33's own ``Scheduler``.

Every test builds engine replicas whose scheduler is vLLM's (the connector is
loaded by vLLM's factory from ``kv_connector_module_path``) and whose worker
ranks run the toy recurrent model over KV tensors vLLM allocated
(:mod:`tests_vllm.harness`). A restored page that is wrong makes the model
raise :class:`~tests_vllm.harness.CorruptCache` or generate other tokens, so
"identical output" below is a check of every restored byte. After every
test the engines and the sidecar must be idle (``conftest.make_engine``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import EngineFactory, Sidecar
from harness import Engine, EngineSpec, ToyModel, cdiv

import lmcache_rc as rc

BS = 16


def tokens(seed: int, n: int) -> list[int]:
    """A deterministic prompt of ``n`` tokens."""
    return [1 + (seed * 7919 + i * 104729) % 997 for i in range(n)]


def counters(engine: Engine) -> dict[str, int]:
    """The scheduler connector's counters."""
    assert engine.connector is not None and engine.connector.upstream is not None
    return engine.connector.upstream.counters


def restored(engine: Engine) -> int:
    """Tokens restored from the sidecar so far on ``engine``."""
    return counters(engine).get("tokens_restored", 0)


def durable(sidecar: Sidecar) -> dict[str, Any]:
    """Sidecar status once the L2 queue drained."""
    deadline = time.monotonic() + 30
    while True:
        status = sidecar.status()
        if status["l2_queue"] == 0 or time.monotonic() > deadline:
            return status
        time.sleep(0.01)


def test_upstream_mode_is_chosen_for_stock_vllm(make_engine: EngineFactory) -> None:
    engine = make_engine()
    assert engine.connector is not None
    assert type(engine.connector).__name__ == "LMCacheRecurrentCheckpointConnector"
    assert engine.connector.mode == "upstream"
    assert engine.connector.upstream is not None
    assert engine.ranks[0].connector.mode == "upstream"


def test_cold_store_then_restore_on_a_second_replica(make_engine: EngineFactory) -> None:
    prompt = tokens(1, 70)
    a = make_engine()
    out_a = a.generate("a", prompt, 6)
    assert out_a == ToyModel.reference(prompt, 6)
    assert restored(a) == 0
    assert counters(a).get("stores_committed_prompt") == 1  # boundary 64 <= 70
    assert counters(a).get("stores_committed_response") == 1  # 70 + 6 - 1 = 75 tokens

    b = make_engine()  # a new replica: nothing in its own prefix cache
    out_b = b.generate("b", prompt, 6)
    assert out_b == out_a
    assert restored(b) == 64  # the prompt boundary; never the whole prompt
    assert b.ranks[0].stats.states_read > 0

    # The response state continues a longer prompt from 75 tokens. B's own
    # prefix cache already holds 64 of them (request "b"), so only the pages
    # past that hit and the recurrent state at 75 are restored.
    longer = prompt + out_a + tokens(2, 9)
    out_c = b.generate("c", longer, 4)
    assert out_c == ToyModel.reference(longer, 4)
    assert restored(b) == 64 + (75 - 64)


@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_two_ranks_restore_byte_exact_in_either_kv_layout(
    make_engine: EngineFactory, layout: str
) -> None:
    prompt = tokens(3, 90)
    a = make_engine(world_size=2, layout=layout)
    assert a.generate("a", prompt, 5) == ToyModel.reference(prompt, 5)
    b = make_engine(world_size=2, layout=layout)
    assert b.generate("b", prompt, 5) == ToyModel.reference(prompt, 5)
    assert restored(b) == 80
    for rank in b.ranks:
        assert rank.stats.states_read > 0


def test_two_ranks_as_separate_processes(make_engine: EngineFactory) -> None:
    prompt = tokens(4, 50)
    a = make_engine(world_size=2, processes=True)
    assert a.generate("a", prompt, 4) == ToyModel.reference(prompt, 4)
    b = make_engine(world_size=2, processes=True)
    assert b.generate("b", prompt, 4) == ToyModel.reference(prompt, 4)
    assert restored(b) == 48


def test_multi_turn_chat_restores_each_previous_response(
    make_engine: EngineFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    replicas = [make_engine(), make_engine()]
    history: list[int] = tokens(5, 40)
    lines = []
    previous_end = 0
    for turn in range(1, 5):
        engine = replicas[turn % 2]  # alternate replicas: the local cache cannot serve it
        before = restored(engine)
        out = engine.generate(f"turn{turn}", history, 6)
        assert out == ToyModel.reference(history, 6)
        got = restored(engine) - before
        cached = engine.prompt_from_cache(f"turn{turn}")
        # the previous response state serves the prompt up to where it ended:
        # from this replica's own prefix cache where it has the pages, the rest
        # (always including the recurrent state) restored from the sidecar
        assert cached == previous_end
        assert (got > 0) == (turn > 1)
        lines.append(
            f"turn {turn}: prompt {len(history)} tokens, restored {got}, "
            f"local {cached - got}, recomputed {len(history) - cached}"
        )
        previous_end = len(history) + len(out) - 1  # the response state's tokens
        history = history + out + tokens(100 + turn, 12)
    with capsys.disabled():
        print("\n" + "\n".join(lines))


def test_shared_system_prompt_restores_across_requests(make_engine: EngineFactory) -> None:
    # vLLM offers the Mamba states it retains: with a retention interval of one
    # block (--prefix-cache-retention-interval 16) and chunks of 48 tokens, one
    # exists at the end of the shared system prompt, and store_prompt="all"
    # stores every offered boundary.
    system = tokens(6, 48)
    first = system + tokens(7, 20)
    second = system + tokens(8, 25)
    config = {"store_prompt": "all", "retention_interval": 16, "max_num_batched_tokens": 48}
    a = make_engine(**config)
    assert a.generate("a", first, 3) == ToyModel.reference(first, 3)
    b = make_engine(**config)  # vLLM's config hash is part of the identity
    assert b.generate("b", second, 3) == ToyModel.reference(second, 3)
    assert restored(b) == 48  # the last block boundary inside the shared system prompt


def test_exact_replay_writes_zero_payload_bytes(
    make_engine: EngineFactory, sidecar: Sidecar
) -> None:
    prompt = tokens(9, 60)
    make_engine().generate("a", prompt, 5)
    before = durable(sidecar)
    assert before["l2_bytes_written"] > 0
    b = make_engine()
    assert b.generate("b", prompt, 5) == ToyModel.reference(prompt, 5)
    assert restored(b) == 48
    after = durable(sidecar)
    assert after["l2_bytes_written"] == before["l2_bytes_written"]
    assert after["generations"] == before["generations"]
    assert counters(b).get("store_suppressed") == 2  # the prompt and response checkpoints


def test_a_failed_rank_restore_recomputes_with_identical_output(
    make_engine: EngineFactory,
) -> None:
    prompt = tokens(10, 70)
    make_engine(world_size=2).generate("a", prompt, 5)
    b = make_engine(world_size=2)
    b.ranks[1].inject_fault("fail", 1)  # rank 1's next copy fails
    assert b.generate("b", prompt, 5) == ToyModel.reference(prompt, 5)
    assert counters(b).get("restores_failed") == 1
    assert restored(b) == 0  # vLLM recomputed; the failed checkpoint was not offered again


def test_a_failed_rank_store_publishes_nothing(
    make_engine: EngineFactory, sidecar: Sidecar
) -> None:
    prompt = tokens(11, 40)
    a = make_engine(world_size=2)
    a.ranks[1].inject_fault("fail", 10)
    assert a.generate("a", prompt, 3) == ToyModel.reference(prompt, 3)
    assert counters(a).get("stores_failed") == 2
    assert durable(sidecar)["generations"] == 0
    b = make_engine(world_size=2)
    assert b.generate("b", prompt, 3) == ToyModel.reference(prompt, 3)
    assert restored(b) == 0


def test_abort_during_async_load_frees_blocks_only_after_copies_drain(
    make_engine: EngineFactory,
) -> None:
    prompt = tokens(12, 100)
    make_engine().generate("a", prompt, 2)
    b = make_engine()
    b.ranks[0].inject_fault("delay", 1, 1.0)  # the restore copy takes a second
    b.add("b", prompt, 2)
    request = b.scheduler.requests["b"]
    b.step_until(lambda: request.status.name == "WAITING_FOR_REMOTE_KVS")
    held = b.total_blocks() - b.free_blocks()
    assert held >= cdiv(96, BS)
    b.abort(["b"])
    assert b.total_blocks() - b.free_blocks() == held  # still held: the copy runs
    b.run()
    assert b.free_blocks() == b.total_blocks()
    assert "b" not in b.finished or b.finished["b"].output == []


def test_preempted_restored_request_resumes_with_identical_output(
    make_engine: EngineFactory,
) -> None:
    # (A request loading its pages is never preempted in vLLM 0.33: preemption
    # takes running requests only, and a loading one waits outside `running`.)
    prompts = [tokens(20 + i, 60) for i in range(3)]
    a = make_engine(max_model_len=128)  # the same config hash as b: its stores serve b
    for i, p in enumerate(prompts):
        a.generate(f"a{i}", p, 2)
    b = make_engine(num_blocks=16, max_model_len=128)
    reqs = [b.add(f"b{i}", p, 40) for i, p in enumerate(prompts)]
    b.run()
    for i, p in enumerate(prompts):
        assert b.finished[f"b{i}"].output == ToyModel.reference(p, 40)
    assert sum(r.num_preemptions for r in reqs) > 0, "the pool was large enough: no preemption"
    assert counters(b).get("lookup_miss", 0) == 0  # every first lookup found a's checkpoint
    assert restored(b) >= 3 * 48


def test_abort_with_two_ranks_waits_for_the_slow_rank(make_engine: EngineFactory) -> None:
    prompt = tokens(16, 100)
    make_engine(world_size=2).generate("a", prompt, 2)
    b = make_engine(world_size=2)
    b.ranks[1].inject_fault("delay", 1, 1.0)  # rank 0 finishes at once, rank 1 a second later
    b.add("b", prompt, 2)
    request = b.scheduler.requests["b"]
    b.step_until(lambda: request.status.name == "WAITING_FOR_REMOTE_KVS")
    held = b.total_blocks() - b.free_blocks()
    b.abort(["b"])
    for _ in range(20):  # rank 0 reported; vLLM still holds the blocks for rank 1
        b.step()
    assert b.total_blocks() - b.free_blocks() == held
    b.run()
    assert b.free_blocks() == b.total_blocks()


def test_sidecar_killed_during_a_restore_recomputes(
    make_engine: EngineFactory, tmp_path: Path
) -> None:
    socket = str(tmp_path / "serve.sock")
    server = subprocess.Popen(
        [sys.executable, "-m", "lmcache_rc", "serve", "--socket", socket, "--l1-bytes", "64M"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(socket):
            assert time.monotonic() < deadline and server.poll() is None, "serve did not start"
            time.sleep(0.05)
        prompt = tokens(17, 80)
        make_engine(socket=socket).generate("a", prompt, 3)
        b = make_engine(socket=socket)
        b.ranks[0].inject_fault("delay", 1, 1.0)
        b.add("b", prompt, 3)
        request = b.scheduler.requests["b"]
        b.step_until(lambda: request.status.name == "WAITING_FOR_REMOTE_KVS")
        server.kill()  # SIGKILL mid-copy: the lease dies with the sidecar
        server.wait()
        b.run(timeout=60)
        assert b.finished["b"].output == ToyModel.reference(prompt, 3)
        assert counters(b).get("restores_failed") == 1
    finally:
        server.kill()
        server.wait()


def test_sidecar_stopped_mid_run_recomputes_then_reconnects(
    make_engine: EngineFactory, sidecar: Sidecar
) -> None:
    prompt = tokens(13, 70)
    make_engine().generate("a", prompt, 3)
    durable(sidecar)
    b = make_engine()
    sidecar.stop()
    started = time.monotonic()
    assert b.generate("b1", prompt, 3) == ToyModel.reference(prompt, 3)
    assert time.monotonic() - started < 30  # no hang on the dead sidecar
    assert restored(b) == 0
    sidecar.start()  # same index and L2 path: the generations are durable
    deadline = time.monotonic() + 30
    i = 0
    while restored(b) == 0 and time.monotonic() < deadline:
        i += 1
        assert b.scheduler.reset_prefix_cache()  # so only the sidecar can serve it
        assert b.generate(f"b{i + 1}", prompt, 3) == ToyModel.reference(prompt, 3)
        time.sleep(0.2)
    assert restored(b) == 64  # the same engine reconnected in the background


def test_cache_salt_separates_tenants(make_engine: EngineFactory) -> None:
    prompt = tokens(14, 50)
    a = make_engine()
    a.add("a", prompt, 3, cache_salt="tenant-a")
    a.run()
    b = make_engine()
    b.add("b", prompt, 3, cache_salt="tenant-b")
    b.run()
    assert restored(b) == 0
    b.add("c", prompt, 3, cache_salt="tenant-a")
    b.run()
    assert restored(b) == 48


def test_the_sidecar_client_lists_upstream_generations(
    make_engine: EngineFactory, sidecar: Sidecar
) -> None:
    prompt = tokens(15, 33)
    make_engine().generate("a", prompt, 2)
    status = durable(sidecar)
    assert status["generations"] == 2  # boundary 32 and the response at 34 tokens
    client = rc.Client(sidecar.socket)
    try:
        assert client.status()["store_leases"] == 0
    finally:
        client.close()


def test_the_installed_wheel_is_under_test() -> None:
    # ci/vllm-test.sh installs the wheel into target/vllm-site, not the source tree
    assert "vllm-site" in (rc.__file__ or ""), rc.__file__


def test_a_block_aligned_prompt_stores_the_boundary_below_its_last_token(
    make_engine: EngineFactory,
) -> None:
    prompt = tokens(18, 64)  # vLLM keeps the state at 48: a replay recomputes token 64
    a = make_engine()
    a.generate("a", prompt, 2)
    assert counters(a).get("stores_committed_prompt") == 1
    b = make_engine()
    assert b.generate("b", prompt, 2) == ToyModel.reference(prompt, 2)
    assert restored(b) == 48


def test_restores_beyond_the_copy_queue_wait_instead_of_failing(
    make_engine: EngineFactory,
) -> None:
    prompts = [tokens(30 + i, 70) for i in range(4)]
    a = make_engine(copy_workers=1, max_copies_per_rank=1)
    for i, p in enumerate(prompts):
        a.generate(f"a{i}", p, 2)
    b = make_engine(copy_workers=1, max_copies_per_rank=1)
    for i, p in enumerate(prompts):
        b.add(f"b{i}", p, 2)  # four restores at once against a queue of one
    b.run()
    for i, p in enumerate(prompts):
        assert b.finished[f"b{i}"].output == ToyModel.reference(p, 2)
    assert counters(b).get("restores_failed", 0) == 0
    assert restored(b) == 4 * 64
    assert counters(b).get("tasks_deferred", 0) > 0


def test_kernel_blocks_smaller_than_a_block_restore_byte_exact(make_engine: EngineFactory) -> None:
    prompt = tokens(19, 90)
    make_engine(kernel_block_size=8).generate("a", prompt, 3)
    b = make_engine(kernel_block_size=8)
    assert b.generate("b", prompt, 3) == ToyModel.reference(prompt, 3)
    assert restored(b) == 80


def test_async_scheduling_skips_response_states_and_still_restores_prompts(
    make_engine: EngineFactory,
) -> None:
    # vLLM's default loop: when a request stops on a token the scheduler could
    # not foresee (EOS, a stop token), a forward past its end may still be
    # running, so its final state is not stored; each turn restores up to the
    # previous prompt's boundary instead, with identical output.
    replicas = [make_engine(async_scheduling=True), make_engine(async_scheduling=True)]
    history = tokens(40, 40)
    previous_prompt = 0
    for turn in range(1, 4):
        engine = replicas[turn % 2]
        before = restored(engine)
        reference = ToyModel.reference(history, 20)
        out = engine.generate(f"t{turn}", history, 20, stop_token_ids=[reference[4]])
        assert out == reference[:5]
        cached = engine.prompt_from_cache(f"t{turn}")
        last_boundary = (previous_prompt - 1) // BS * BS if previous_prompt else 0
        assert cached >= last_boundary
        assert (restored(engine) - before > 0) == (turn > 1)
        previous_prompt = len(history)
        history = history + out + tokens(200 + turn, 12)
    skipped = sum(counters(e).get("store_skipped_in_flight", 0) for e in replicas)
    assert skipped == 3


def test_a_stop_token_ends_a_request_whose_response_state_is_stored(
    make_engine: EngineFactory,
) -> None:
    prompt = tokens(41, 40)
    reference = ToyModel.reference(prompt, 20)
    a = make_engine()
    out = a.generate("a", prompt, 20, stop_token_ids=[reference[4]])
    assert out == reference[:5]
    assert counters(a).get("stores_committed_response") == 1
    b = make_engine()
    follow = prompt + out + tokens(42, 9)
    assert b.generate("b", follow, 3) == ToyModel.reference(follow, 3)
    assert restored(b) == len(prompt) + len(out) - 1


def test_reset_cache_makes_earlier_checkpoints_unreachable(make_engine: EngineFactory) -> None:
    prompt, other = tokens(50, 70), tokens(51, 70)
    a = make_engine()
    a.generate("a1", prompt, 2)
    a.generate("a2", other, 2)
    b = make_engine()
    assert b.generate("b1", other, 2) == ToyModel.reference(other, 2)
    assert restored(b) == 64  # before the reset: restored
    assert b.scheduler.reset_prefix_cache(reset_connector=True)
    assert b.generate("b2", prompt, 2) == ToyModel.reference(prompt, 2)
    assert restored(b) == 64  # after: the earlier checkpoint is not offered
    assert counters(b).get("resets") == 1


def _listed(sidecar: Sidecar, num_tokens: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(g["num_tokens"] == num_tokens for g in sidecar.client().list_generations()):
            return True
        time.sleep(0.01)
    return False


def test_idle_engine_publishes_its_response_store_without_another_step(
    make_engine: EngineFactory, sidecar: Sidecar
) -> None:
    """An in-process engine stops stepping when its requests are done (what
    ``LLM.generate`` does): the response store begun in the last step still
    reaches the rank and is published, with no further step."""
    prompt = tokens(41, 70)
    a = make_engine()
    a.add("r", prompt, 6)
    a.step_until(lambda: "r" in a.finished)
    assert _listed(sidecar, 70 + 6 - 1, 30), "the idle engine's response store was not published"
    assert counters(a).get("tasks_handed_over", 0) >= 1
    a.run()  # the next steps collect the results and release the pins

    b = make_engine()
    longer = prompt + a.finished["r"].output + tokens(42, 9)
    assert b.generate("b", longer, 4) == ToyModel.reference(longer, 4)
    assert restored(b) == 75


def test_idle_hand_over_off_leaves_the_store_to_the_next_step(
    make_engine: EngineFactory, sidecar: Sidecar
) -> None:
    """The control: with ``idle_flush=0`` nothing moves between steps."""
    a = make_engine(idle_flush=0)
    a.add("r", tokens(43, 70), 6)
    a.step_until(lambda: "r" in a.finished)
    assert not _listed(sidecar, 75, 1.0)
    a.run()
    assert _listed(sidecar, 75, 30)


def test_shutdown_right_after_the_last_step_publishes_the_response_store(
    make_engine: EngineFactory, sidecar: Sidecar
) -> None:
    """A process that shuts its engine down right after the request finished
    (the end of a script) leaves the response checkpoint published."""
    a = make_engine(idle_flush=0)  # only the shutdown path may publish it
    a.add("r", tokens(44, 70), 6)
    a.step_until(lambda: "r" in a.finished)
    a.shutdown()
    assert _listed(sidecar, 75, 30)
    status = sidecar.status()
    assert status["pending"] == 0 and status["store_leases"] == 0, status


def test_a_slow_shared_tier_restores_long_prefixes_and_recomputes_short_ones(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The skip rule under vLLM's scheduler (``docs/vllm.md``, "Restore only
    when it beats recomputing"): host A stores to a shared tier on a local
    directory; host B reaches it with 50 ms injected per request and its
    engine's recompute cost is configured (0.35 ms per token). B restores a
    long prefix first (nothing measured yet), then skips the short one (one
    block of 128 tokens: at least one 50 ms fetch against 45 ms of
    recompute), then restores the other long one (5 rounds of 4 fetches,
    about 250 ms, against 0.7 s of recompute). Decisions only, never
    timings, are asserted."""
    block = 128
    shared = tmp_path / "shared"

    def server(name: str, latency: float) -> Any:
        return rc.Server.start(
            rc.ServerConfig(
                socket=str(tmp_path / f"{name}.sock"),
                l1_bytes=64 << 20,
                http_port=-1,
                shared_url=f"file://{shared}",
                shared_lookup_timeout=30.0,
                shared_inject_latency=latency,
            )
        )

    def engine(srv: Any, **options: Any) -> Engine:
        extra = {
            "lmcache_rc.socket": srv.socket_path,
            "lmcache_rc.checkpoint_identity": {
                "target_revision": "a" * 40,
                "source_revision": "b" * 40,
            },
            "lmcache_rc.layout_timeout": 30.0,
            **{f"lmcache_rc.{k}": v for k, v in options.items()},
        }
        return Engine(
            EngineSpec(
                model_dir=model_dir,
                extra_config=extra,
                block_size=block,
                num_blocks=256,
                max_model_len=4096,
            )
        )

    prompts = {
        "long-1": tokens(61, 2048 + 10),
        "short": tokens(62, 140),
        "long-2": tokens(63, 2048 + 10),
    }
    extension = tokens(64, 6)
    host_a, host_b = server("a", 0.0), server("b", 0.05)
    engines: list[Engine] = []
    try:
        a = engine(host_a)
        engines.append(a)
        for name, prompt in prompts.items():
            assert a.generate(f"a-{name}", prompt, 2) == ToyModel.reference(prompt, 2)
        a.run()
        deadline = time.monotonic() + 60
        while True:
            st = host_a.status()
            uploaded = st["shared_manifests_written"] + st["shared_manifests_present"]
            if uploaded >= st["generations"] and st["shared_upload_queue"] == 0:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.02)

        b = engine(host_b, prefill_seconds_per_token=0.00035)
        engines.append(b)
        rows = []
        for name, prompt in prompts.items():
            before = restored(b)
            longer = prompt + extension
            assert b.generate(f"b-{name}", longer, 2) == ToyModel.reference(longer, 2)
            assert b.connector is not None and b.connector.upstream is not None
            decision = b.connector.upstream.report_status()["restore_cost"]["recent"][-1]
            assert decision["request_id"] == f"b-{name}"
            rows.append((name, decision, restored(b) - before))
        with capsys.disabled():
            print()
            for name, d, got in rows:
                est = "-" if d["restore_s"] is None else f"{d['restore_s'] * 1000:.1f} ms"
                print(
                    f"{name:<7} checkpoint {d['tokens']:>5} tokens, {d['pages']:>3} pages "
                    f"{sorted(d['tiers'])}: restore {est:>9} vs recompute "
                    f"{d['recompute_s'] * 1000:7.1f} ms -> "
                    f"{'recompute' if d['skip'] else 'restore'} ({got} tokens restored)"
                )
            c = counters(b)
            print(
                "restores_skipped_cheaper_to_recompute="
                f"{c.get('restores_skipped_cheaper_to_recompute', 0)} "
                f"restores_done={c.get('restores_done', 0)} "
                f"tokens_restored={c.get('tokens_restored', 0)}"
            )
        (_, d1, got1), (_, d2, got2), (_, d3, got3) = rows
        assert not d1["skip"] and d1["restore_s"] is None and got1 == 2048, rows
        assert d2["skip"] and d2["tokens"] == block and got2 == 0, rows
        assert not d3["skip"] and d3["restore_s"] is not None and got3 == 2048, rows
        assert counters(b)["restores_skipped_cheaper_to_recompute"] == 1
        assert counters(b)["restores_done"] == 2
        assert host_b.status()["shared_load_latency_us"] >= 50_000
    finally:
        for e in engines:
            e.shutdown()
        host_a.stop()
        host_b.stop()


def test_a_next_turn_sent_before_the_answer_is_published_restores_that_answer(
    make_engine: EngineFactory, sidecar: Sidecar
) -> None:
    """A client sends the next turn the moment the answer is out, while the
    answer's checkpoint is still being stored (its BEGIN in flight, its copy
    not yet run). The lookup waits for that store of this engine and restores
    the answer's state, never an older checkpoint that a FIND sent before the
    publication would find."""
    prompt = tokens(45, 70)
    a = make_engine(idle_flush=0)  # nothing moves between steps: the race is certain
    a.add("t1", prompt, 6)
    a.step_until(lambda: "t1" in a.finished)
    assert not _listed(sidecar, 75, 0.2), "the answer is published before the next step"
    turn2 = prompt + a.finished["t1"].output + tokens(46, 9)
    a.add("t2", turn2, 4)
    a.run()
    assert a.finished["t2"].output == ToyModel.reference(turn2, 4)
    c = counters(a)
    assert c.get("lookup_waits_own_store") == 1, c
    assert c.get("lookup_found_own_store") == 1, c
    # the answer's state (75 tokens) served the prompt: 64 from vLLM's own
    # cache (whole blocks), the rest, with the recurrent state, restored
    assert a.prompt_from_cache("t2") == 70 + 6 - 1
    assert restored(a) == 75 - 64


def test_the_connectors_counters_reach_vllms_statistics(make_engine: EngineFactory) -> None:
    """With vLLM's statistics on, every step's ``SchedulerStats`` carries what
    the connector counted in that step (vLLM's connector-stats path, which the
    API server logs and exports); rebuilt by the connector class as the API
    server does and added up, they equal the connector's own counters."""
    from lmcache_rc.connector import LMCacheRecurrentCheckpointConnector as Connector

    a = make_engine(log_stats=True)
    prompt = tokens(47, 70)
    out = a.generate("t1", prompt, 6)
    b = make_engine(log_stats=True)
    b.generate("t2", prompt + out + tokens(48, 5), 3)
    for engine in (a, b):
        engine.run()
        payloads = [s.kv_connector_stats for s in engine.scheduler_stats if s.kv_connector_stats]
        assert payloads, "no step carried the connector's statistics"
        total = Connector.build_kv_connector_stats(dict(payloads[0]))
        for payload in payloads[1:]:
            total = total.aggregate(Connector.build_kv_connector_stats(dict(payload)))
        # the scheduler's counters, the rank's copies and every hook's time
        mine = {k: v for k, v in counters(engine).items() if v}
        assert {k: total.counters.get(k) for k in mine} == mine
        copies = total.counters.get("copies_store", 0) + total.counters.get("copies_restore", 0)
        assert copies == counters(engine).get("tasks_sent", 0), total.counters
        assert total.counters.get("copy_store_lease_us", 0) > 0
        assert "hook_build_connector_meta_us" in total.counters
        assert "hook_start_load_kv_us" in total.counters  # a rank's hook
        assert total.gauges["sidecar_connected"] == 1.0
        assert total.gauges["pinned_blocks"] == 0.0 and total.gauges["tasks_store"] == 0.0
    assert counters(b)["restores_done"] == 1


@pytest.mark.parametrize("wait", [0.5, 0.0])
def test_a_lookup_answered_within_lookup_wait_restores_a_step_sooner(
    make_engine: EngineFactory, wait: float
) -> None:
    """A FIND the sidecar answers within the step's ``lookup_wait`` is
    offered to vLLM in the same ``schedule()``: the restore starts a step
    sooner. With ``lookup_wait`` 0 the answer is taken at the next step
    (same result, one step later)."""
    prompt = tokens(49, 70)
    a = make_engine()
    out = a.generate("a", prompt, 6)
    b = make_engine(lookup_wait=wait)
    b.add("b", prompt, 6)
    # the first step negotiates the ranks' layouts; the lookup goes out in the next
    b.step_until(lambda: counters(b).get("lookups", 0) == 1)
    c = counters(b)
    if wait:
        assert c.get("lookups_answered_in_step") == 1, c
        assert c.get("restores_started") == 1, "offered and allocated in the same step"
    else:
        assert c.get("restores_started", 0) == 0, c
    b.run()
    assert b.finished["b"].output == out
    assert restored(b) == 64


def test_the_sidecar_shows_every_attached_engines_counters(
    make_engine: EngineFactory, sidecar: Sidecar
) -> None:
    """Each engine reports its counters to the sidecar (every few seconds, and
    when it shuts down): ``engines()`` — ``lmcache-rc status`` and ``GET
    /status`` — shows every engine's lookups, restores and stores beside the
    sidecar's own figures."""
    prompt = tokens(50, 70)
    a = make_engine()
    out = a.generate("a", prompt, 6)
    b = make_engine()
    b.generate("b", prompt + out + tokens(51, 5), 3)
    finals = {}
    for engine in (a, b):
        engine.run()
        assert engine.connector is not None and engine.connector.upstream is not None
        status = engine.connector.upstream.report_status()
        finals[status["engine_id"]] = counters(engine)
        engine.shutdown()  # the final report
    # the final report is answered before an engine's connection closes;
    # read until both show, in case another connection's frame comes later
    deadline = time.monotonic() + 30
    while True:
        reports = {r["engine"]: r for r in sidecar.client().engines()}
        shown_all = all(
            {k: reports.get(e, {"counters": {}})["counters"].get(k, 0) for k in final} == final
            for e, final in finals.items()
        )
        if shown_all or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert set(finals) <= set(reports), (set(finals), set(reports))
    for engine_id, final in finals.items():
        shown = reports[engine_id]["counters"]
        assert {k: shown.get(k, 0) for k in final} == final, engine_id
        assert reports[engine_id]["age_ms"] < 60_000
    (b_id,) = [e for e, c in finals.items() if c.get("restores_done")]
    assert reports[b_id]["counters"]["restores_done"] == 1
