"""lmcache-rc through a real vLLM engine (vLLM's CPU build): model runner,
attention and recurrent kernels, real KV-cache tensors.

Every engine runs in a fresh process and exits right after its last
``generate()``, as a script does; the next one restores what it left. Each
scenario checks the restored token counts (the longest checkpoint the sidecar
lists for each request, read from its index) and that every output equals a
connector-less engine's computing the same prompt from scratch in a process
of its own (the check of record; ``scenarios.assert_identical``). Per-turn
transcripts go to ``target/engine-transcripts/``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from conftest import (
    EngineRun,
    Engines,
    Sidecar,
    Transcript,
    kill_engine,
    longest_stored,
    start_gated,
)
from scenarios import (
    IDENTITY_FAMILIES,
    MODES,
    OUT,
    assert_identical,
    block,
    log_run,
    reference,
    tokens,
)

ALL = {"store_prompt": "all"}
"""Store every boundary state vLLM keeps (shared prefixes restore across requests)."""


def wait_listed(sidecar: Sidecar, num_tokens: int, timeout: float) -> bool:
    """Whether a generation of ``num_tokens`` tokens is listed within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(g["num_tokens"] == num_tokens for g in sidecar.generations()):
            return True
        time.sleep(0.05)
    return False


def wait_durable(sidecar: Sidecar, timeout: float = 60.0) -> None:
    """Every listed generation is on disk (nothing waits in the L2 queue)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sidecar.status()["l2_queue"] == 0 and all(g["durable"] for g in sidecar.generations()):
            return
        time.sleep(0.05)
    raise AssertionError("generations did not become durable in time")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", IDENTITY_FAMILIES)
def test_multi_turn_workload_in_fresh_processes(
    family: str, mode: str, sidecar: Sidecar, engines: Engines, transcript: Transcript
) -> None:
    """Four turns, each in a fresh engine process that exits right after
    ``generate()``. Turn 1 serves a conversation, prompts shorter than a
    block, exactly a block and several blocks, and a request with a system
    prompt; turn 2 continues each of them (response checkpoints, mid-block),
    diverges from them right after a stored boundary (prompt checkpoints) and
    sends three concurrent requests sharing the system prompt; turns 3 and 4
    continue the conversation. Every request restores the longest stored
    prefix of it, and every output equals the connector-less reference."""
    bs = block(family)
    multiprocess = MODES[mode]
    # align mode has a recurrent state only where a prefill chunk ended
    # (vLLM ends split chunks on block boundaries): with one block of tokens
    # per step every chunk ends on one, whatever order the requests reach the
    # engine in (an engine-core process gets them while steps run), and the
    # retention interval keeps the state of every block, not only the last
    keep: dict[str, Any] = {"max_num_batched_tokens": bs, "prefix_cache_retention_interval": bs}
    transcript.note(f"{family}, {mode} engine, block {bs}")
    conv = tokens(1, 2 * bs + bs // 3, family)
    short, exact, many = (
        tokens(11, bs // 2, family),
        tokens(12, bs, family),
        tokens(13, 3 * bs + bs // 3, family),
    )
    system = tokens(40, 2 * bs + bs // 2, family)
    batch: list[list[int]] = [conv, short, exact, many, system + tokens(41, 20, family)]
    runs: list[tuple[str, EngineRun, list[list[int]]]] = []
    previous_response = 0
    for turn in range(1, 5):
        prefixes = sidecar.prefixes()
        want = [longest_stored(prefixes, p) for p in batch]
        run = engines.run(
            family,
            [batch],
            socket=sidecar.socket,
            multiprocess=multiprocess,
            options=ALL,
            engine=keep,
        )
        log_run(transcript, f"turn {turn}", run)
        assert [t.cached for t in run.turns] == want, f"turn {turn}: restored"
        assert run.turns[0].cached == previous_response, (
            "the conversation resumes its last response"
        )
        previous_response = len(conv) + OUT - 1
        # the process exited right after generate(): its response checkpoints are listed
        listed = {g["num_tokens"] for g in sidecar.generations()}
        assert previous_response in listed, f"turn {turn}'s response checkpoint was not published"
        runs.append((f"turn {turn}", run, batch))
        outs = [t.output for t in run.turns]
        conv = conv + outs[0] + tokens(100 + turn, 30, family)
        if turn == 1:
            stored = sidecar.prefixes()
            # every request of the exiting engine published its response checkpoint
            unpublished = [
                i
                for i, (p, t) in enumerate(zip(batch, run.turns, strict=True))
                if tuple(p + t.output[: OUT - 1]) not in stored
            ]
            assert not unpublished, (
                f"turn 1: no response checkpoint of requests {unpublished} after the "
                f"sidecar's restart; token counts listed before it: {sorted(listed)}; "
                f"the connector's status: {run.connector}; the end of the engine's "
                f"stderr:\n{run.stderr[-6000:]}"
            )
            points = sorted(
                len(p) for p in stored if tuple(many[: len(p)]) == p and len(p) < len(many)
            )
            transcript.note(f"boundary checkpoints of the {len(many)}-token prompt: {points}")
            assert points, "no boundary checkpoint of the many-block prompt was stored"
            batch = [
                conv,
                short + outs[1] + tokens(21, 10, family),
                exact + outs[2] + tokens(22, 10, family),
                many + outs[3] + tokens(23, 10, family),
                exact + tokens(30, 20, family),
                many[: points[-1]] + tokens(31, 7, family),
            ] + [system + tokens(50 + i, 25, family) for i in range(3)]
        else:
            batch = [conv]
    second = runs[1][1].turns
    assert [t.cached for t in second[1:4]] == [
        bs // 2 + OUT - 1,
        bs + OUT - 1,
        3 * bs + bs // 3 + OUT - 1,
    ], "response checkpoints of the short, exact and many-block prompts"
    assert second[4].cached > 0 and second[5].cached > 0, "prompt checkpoints"
    shared = {t.cached for t in second[6:]}
    assert len(shared) == 1 and 0 < shared.pop() <= len(system), "the system prompt's checkpoint"
    prompts = [p for _, _, b in runs for p in b]
    expected = reference(engines, family, prompts, engine=keep)
    at = 0
    for label, run, b in runs:
        assert_identical(family, run, expected[at : at + len(b)], label, transcript=transcript)
        at += len(b)
    status = sidecar.status()
    transcript.note(f"sidecar: {status['generations']} generations, {status['hits']} hits")


@pytest.mark.parametrize("family", IDENTITY_FAMILIES[:1])
def test_failures_tiny_cache_failed_load_and_a_killed_sidecar(
    family: str, sidecar: Sidecar, engines: Engines, transcript: Transcript
) -> None:
    """(1) The rank's next copy fails (the fault hook): vLLM recomputes what
    that restore covered. (2) A tiny KV cache makes vLLM preempt and resume
    requests while restores and stores run. (3) The sidecar is SIGKILLed
    between two batches of one engine, which keeps serving by recomputing; a
    sidecar restarted on the same index and L2 then serves a fresh engine.
    Every output equals the connector-less reference."""
    bs = block(family)
    # every engine of this test shares one max_model_len (it is part of the
    # checkpoint namespace), small enough for the tiny pool of (2): vLLM
    # refuses a pool that cannot hold one request of max_model_len, and three
    # blocks of tokens hold the longest request here (2 bs + 40 + 2 OUT)
    small: dict[str, Any] = {"max_model_len": 3 * bs}
    seeds = [tokens(60 + i, 2 * bs + 7 * i, family) for i in range(5)]
    first = engines.run(family, [seeds[:3]], socket=sidecar.socket, options=ALL, engine=small)
    log_run(transcript, "seed", first)
    cont = [
        p + t.output + tokens(70 + i, 12, family)
        for i, (p, t) in enumerate(zip(seeds[:3], first.turns, strict=True))
    ]
    failed = engines.run(
        family,
        [[cont[2]]],
        socket=sidecar.socket,
        fault={"kind": "fail", "count": 1},
        engine=small,
    )
    log_run(transcript, "failed load", failed)
    assert failed.connector is not None
    assert failed.connector["counters"].get("restores_failed", 0) >= 1, failed.connector

    tiny_batch = cont[:2] + seeds[3:]
    down = seeds[3] + tokens(81, 40, family)
    tiny: dict[str, Any] = {**small, "num_gpu_blocks_override": 3 * (2 * bs + 40) // bs + 2}
    engine = start_gated(
        engines,
        family,
        [tiny_batch, [down]],
        socket=sidecar.socket,
        engine=tiny,
        max_tokens=2 * OUT,
        options=ALL,
    )
    engine.wait_batch(0)
    wait_durable(sidecar)
    sidecar.kill()
    engine.go(1)
    run = engine.result()
    log_run(transcript, "tiny cache, then sidecar down", run)
    assert run.batches[0][0].cached > 0 and run.batches[0][1].cached > 0

    sidecar.start()
    after_prompt = seeds[4] + tokens(82, 30, family)
    want = longest_stored(sidecar.prefixes(), after_prompt)
    assert want > 0, "the restarted sidecar lost its durable checkpoints"
    after = engines.run(family, [[after_prompt]], socket=sidecar.socket, engine=small)
    log_run(transcript, "restarted sidecar", after)
    assert after.turns[0].cached == want

    ref = reference(
        engines,
        family,
        [cont[2], *tiny_batch, down, after_prompt],
        max_tokens=2 * OUT,
        engine=small,
    )
    assert_identical(family, failed, [_cut(ref[0], OUT)], "failed load", transcript=transcript)
    assert_identical(family, run, ref[1:6], "tiny cache / sidecar down", transcript=transcript)
    assert_identical(family, after, [_cut(ref[6], OUT)], "restarted sidecar", transcript=transcript)


def _cut(turn: Any, n: int) -> Any:
    """A reference turn shortened to its first ``n`` output tokens."""
    return type(turn)(turn.prompt, turn.output[:n], turn.cached, turn.elapsed, turn.margins[:n])


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", IDENTITY_FAMILIES[:1])
def test_idle_engine_publishes_its_response_checkpoint(
    family: str, mode: str, sidecar: Sidecar, engines: Engines, transcript: Transcript
) -> None:
    """An engine left idle after ``generate()`` (a notebook cell that ended)
    publishes its response checkpoint without another request; another
    engine restores it while the first is still alive, then killed."""
    bs = block(family)
    prompt = tokens(97, bs + 23, family)
    n = len(prompt) + OUT - 1
    run = engines.start(
        family, [[prompt]], socket=sidecar.socket, multiprocess=MODES[mode], idle=300
    )
    assert run.proc is not None
    try:
        assert wait_listed(sidecar, n, 60), (
            "the idle engine did not publish its response checkpoint"
        )
        nxt = prompt + run.turns[0].output + tokens(98, 30, family)
        after = engines.run(family, [[nxt]], socket=sidecar.socket, multiprocess=MODES[mode])
        log_run(transcript, f"{mode}: while idle", after)
        assert after.turns[0].cached == n
    finally:
        kill_engine(run.proc)


@pytest.mark.parametrize("family", IDENTITY_FAMILIES[:1])
def test_idle_in_process_engine_without_hand_over_keeps_the_store_pending(
    family: str, sidecar: Sidecar, engines: Engines
) -> None:
    """The control of the test above: with the idle hand-over off
    (``idle_flush=0``) an idle in-process engine never steps, so its response
    checkpoint stays unpublished — all vLLM alone gives a connector."""
    bs = block(family)
    prompt = tokens(99, bs + 23, family)
    run = engines.start(
        family, [[prompt]], socket=sidecar.socket, idle=300, options={"idle_flush": 0}
    )
    assert run.proc is not None
    try:
        assert not wait_listed(sidecar, len(prompt) + OUT - 1, 5)
    finally:
        kill_engine(run.proc)
