"""The serving load generator (:mod:`lmcache_rc.serving`) against a small
OpenAI-compatible stand-in server: conversations grow by the server's own
answers, streams are read (and abandoned, then retried), every failure is a
record, and the summary adds up. ``lmcache-rc serve-bench`` is run as a user
runs it. vLLM's own server is driven by the serving suite (``tests_engine``)."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from lmcache_rc import serving


def _answer(prompt: list[int], n: int) -> list[int]:
    """The stand-in model: output tokens are a function of the prompt."""
    seed = sum(prompt) % 997
    return [10 + (seed + 31 * i) % 1000 for i in range(n)]


class FakeServer:
    """``/v1/models`` and ``/v1/completions`` (token-id prompts, streamed or
    not); ``cached_tokens`` is the longest prompt prefix seen before, as a
    prefix cache would report. ``fail_every`` answers every n-th request 500."""

    def __init__(self, fail_every: int = 0) -> None:
        self.seen: list[tuple[int, ...]] = []
        self.bodies: list[dict[str, Any]] = []
        self.fail_every = fail_every
        self.disconnects = 0
        self.loop = asyncio.new_event_loop()
        self.port = _free_port()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _cached(self, prompt: list[int]) -> int:
        best = 0
        for p in self.seen:
            n = 0
            for a, b in zip(p, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "stand-in"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return web.json_response({"error": "boom"}, status=500)
        prompt = list(body["prompt"])
        out = _answer(prompt, int(body["max_tokens"]))
        cached = self._cached(prompt)
        self.seen.append(tuple(prompt))
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(out),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if not body.get("stream"):
            return web.json_response({"choices": [{"token_ids": out}], "usage": usage})
        resp = web.StreamResponse()
        await resp.prepare(request)
        try:
            for token in out:
                chunk = {"choices": [{"token_ids": [token]}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(0.005)
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects += 1
            raise
        return resp

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        runner = web.AppRunner(app)
        self._runner = runner
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def server() -> Iterator[FakeServer]:
    srv = FakeServer()
    yield srv
    srv.close()


SMALL = serving.Workload(
    users=4,
    conversations=6,
    turns=(3, 3),
    system_prompts=2,
    system_tokens=(40, 60),
    user_tokens=(5, 10),
    max_tokens=6,
    stream=0.5,
    vocab=(10, 500),
    seed=3,
)


def test_conversations_grow_by_the_servers_answers(server: FakeServer) -> None:
    records = serving.run_load(server.url, SMALL)
    assert len(records) == 6 * 3 and all(r.ok for r in records)
    by_conv: dict[int, list[serving.TurnRecord]] = {}
    for r in records:
        by_conv.setdefault(r.conversation, []).append(r)
    assert sorted(by_conv) == list(range(6))
    for turns in by_conv.values():
        turns.sort(key=lambda r: r.turn)
        assert [t.turn for t in turns] == [1, 2, 3]
        for a, b in itertools.pairwise(turns):
            # the next prompt is the previous prompt, its answer, and new user tokens
            assert b.prompt[: len(a.prompt) + len(a.output)] == a.prompt + a.output
            assert len(b.prompt) > len(a.prompt) + len(a.output)
        for t in turns:
            assert t.output == _answer(t.prompt, 6)
    assert any(r.streamed for r in records) and any(not r.streamed for r in records)
    assert all(r.ttft is not None for r in records if r.streamed)
    assert all(r.ttft is None for r in records if not r.streamed)
    # the same workload sends the same first prompts every run
    again = serving.run_load(server.url, SMALL)
    first = sorted(tuple(r.prompt) for r in records if r.turn == 1)
    assert first == sorted(tuple(r.prompt) for r in again if r.turn == 1)


def test_an_abandoned_stream_is_recorded_and_its_turn_sent_again(server: FakeServer) -> None:
    w = serving.Workload(**{**SMALL.__dict__, "stream": 1.0, "abort": 1.0})
    records = serving.run_load(server.url, w)
    aborted = [r for r in records if r.aborted]
    served = [r for r in records if r.ok]
    assert len(served) == 6 * 3, "every turn is served once in the end"
    assert len(aborted) == len(served), "each turn was abandoned once, then sent again"
    for a in aborted:
        assert 1 <= len(a.output) <= 3 and not a.error
        retry = [r for r in served if r.conversation == a.conversation and r.turn == a.turn]
        assert len(retry) == 1 and retry[0].prompt == a.prompt
    summary = serving.summarize(records)
    assert summary["aborted"] == len(aborted) and summary["served"] == len(served)
    assert summary["errors"] == 0


def test_a_failed_request_is_a_record_and_ends_its_conversation() -> None:
    srv = FakeServer(fail_every=4)
    try:
        records = serving.run_load(srv.url, SMALL)
    finally:
        srv.close()
    failed = [r for r in records if r.error]
    assert failed and all("HTTP 500" in r.error for r in failed)
    for f in failed:
        later = [r for r in records if r.conversation == f.conversation and r.turn > f.turn]
        assert later == [], "a conversation cannot go on without its answer"
    assert serving.summarize(records)["errors"] == len(failed)


def test_the_summary_adds_up(server: FakeServer) -> None:
    records = serving.run_load(server.url, SMALL)
    s = serving.summarize(records, long_prompt=60)
    assert s["requests"] == s["served"] == 18
    assert s["first"]["requests"] == 6 and s["later"]["requests"] == 12
    total = s["all"]
    assert total["prompt_tokens"] == sum(len(r.prompt) for r in records)
    assert total["cached_tokens"] == sum(r.cached_tokens or 0 for r in records)
    assert total["prefill_tokens"] == total["prompt_tokens"] - total["cached_tokens"]
    # later turns repeat their conversation's history: the stand-in cache serves it
    assert s["later"]["hit_rate"] > 0.5
    assert s["long"]["requests"] == sum(1 for r in records if r.turn > 1 and len(r.prompt) >= 60)
    assert serving.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert serving.percentile([], 50) is None


def test_a_timed_run_stops_starting_turns(server: FakeServer) -> None:
    w = serving.Workload(**{**SMALL.__dict__, "duration": 0.5, "think": 0.05})
    records = serving.run_load(server.url, w)
    assert records and max(r.started for r in records) < 0.5 + 0.3


def test_bad_workloads_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="users"):
        serving.Workload(users=0)
    with pytest.raises(ValueError, match="turns"):
        serving.Workload(turns=(3, 2))
    with pytest.raises(ValueError, match="--turns"):
        serving.parse_range("4-x", "--turns")
    assert serving.parse_range("5", "--turns") == (5, 5)


def test_serve_bench_runs_as_a_user_runs_it(server: FakeServer) -> None:
    cmd = [
        sys.executable, "-m", "lmcache_rc", "serve-bench", "--url", server.url,
        "--conversations", "3", "--turns", "2", "--system-tokens", "30",
        "--user-tokens", "4", "--max-tokens", "4", "--vocab", "10-400",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "requests 6, served 6, errors 0" in done.stdout
    assert "first" in done.stdout and "later" in done.stdout
    assert "serve-bench:" in done.stderr
    as_json = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120)
    report = json.loads(as_json.stdout)
    assert report["served"] == 6 and report["model"] == "stand-in"


def test_serve_bench_against_no_server_is_one_line_and_exit_1() -> None:
    port = _free_port()
    cmd = [sys.executable, "-m", "lmcache_rc", "serve-bench", "--url", f"http://127.0.0.1:{port}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("lmcache-rc: error: cannot list the models of")
    assert "Traceback" not in done.stderr


def test_conversations_carried_on_from_given_histories(server: FakeServer) -> None:
    histories = [[11, 12, 13], [21, 22, 23, 24]]
    w = serving.Workload(**{**SMALL.__dict__, "turns": (2, 2)})
    records = serving.run_load(server.url, w, histories=histories, first_turn=4)
    assert sorted((r.conversation, r.turn) for r in records) == [(0, 4), (0, 5), (1, 4), (1, 5)]
    for r in records:
        assert r.system == -1
        if r.turn == 4:
            assert r.prompt[: len(histories[r.conversation])] == histories[r.conversation]
