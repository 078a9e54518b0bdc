"""The trace benchmark (``lmcache-rc trace``, ``lmcache_rc/trace.py``):
generators are seeded, files round-trip, and a replay through a real
sidecar counts exactly what it restored, checking every byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lmcache_rc import _native, trace


def _req(t: float, session: str, tokens: list[int], output: list[int]) -> trace.Request:
    return trace.Request(t, session, (np.asarray(tokens, np.int32),), np.asarray(output, np.int32))


def test_generators_are_seeded_and_files_round_trip(tmp_path: Path) -> None:
    for name in ("chat", "agentic"):
        a = trace.generate(name, seed=3, sessions=4)
        b = trace.generate(name, seed=3, sessions=4)
        c = trace.generate(name, seed=4, sessions=4)
        assert len(a.requests) > 4
        assert [r.prompt().tolist() for r in a.requests] == [
            r.prompt().tolist() for r in b.requests
        ]
        assert [r.prompt().tolist() for r in a.requests] != [
            r.prompt().tolist() for r in c.requests
        ]
        assert all(x.t <= y.t for x, y in zip(a.requests, a.requests[1:], strict=False))
        path = tmp_path / f"{name}.jsonl"
        assert trace.write_trace(path, a) == len(a.requests)
        back = trace.read_trace(path)
        assert back.meta["generator"] == name and back.meta["seed"] == 3
        assert [r.prompt().tolist() for r in back.requests] == [
            r.prompt().tolist() for r in a.requests
        ]
        assert [r.output.tolist() for r in back.requests] == [r.output.tolist() for r in a.requests]
        assert [r.session for r in back.requests] == [r.session for r in a.requests]


def test_agentic_sessions_are_deep_with_long_shared_prompts_and_retries() -> None:
    t = trace.generate("agentic", seed=0, sessions=6)
    per_session: dict[str, int] = {}
    for r in t.requests:
        per_session[r.session] = per_session.get(r.session, 0) + 1
    main = {s: n for s, n in per_session.items() if "." not in s}
    assert len(main) == 6 and min(main.values()) >= 10, main
    assert min(r.prompt_len for r in t.requests) > 2500, "every prompt holds a system prompt"
    prompts = [r.prompt().tobytes() for r in t.requests]
    assert len(set(prompts)) < len(prompts), "some step was retried with the same prompt"


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ('{"t": 0, "session": "s", "tokens": []}', "at least 1"),
        ('{"t": 0, "session": "s", "tokens": [1, -2]}', "outside"),
        ('{"t": "soon", "session": "s", "tokens": [1]}', "number of seconds"),
        ('{"t": 0, "session": 3, "tokens": [1]}', "session"),
        ("[1, 2]", "object"),
        ("{nope", "not JSON"),
    ],
)
def test_a_malformed_trace_line_is_refused_with_its_line_number(
    tmp_path: Path, line: str, why: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"meta": {"x": 1}}\n\n' + line + "\n")
    with pytest.raises(trace.TraceError, match=f"line 3: .*{why}"):
        trace.read_trace(path)


def test_a_replay_counts_exactly_what_it_restored() -> None:
    # One conversation of three turns (each prompt continues the previous
    # prompt and output), a retry of the last turn, and a stranger.
    t1 = list(range(1, 101))
    o1 = list(range(101, 151))
    t2 = t1 + o1 + list(range(151, 181))
    o2 = list(range(181, 201))
    t3 = t2 + o2 + list(range(201, 301))
    o3 = list(range(301, 311))
    requests = [
        _req(0, "a", t1, o1),
        _req(1, "a", t2, o2),
        _req(2, "a", t3, o3),
        _req(3, "a", t3, [999]),
        _req(4, "b", list(range(5000, 5100)), []),
    ]
    tr = trace.Trace(requests, {"generator": "test"})
    for policy in ("lru", "cost"):
        r = trace.replay(tr, policy, "4M", "16M")
        assert r.requests == 5 and r.stores == 5 and r.stores_missed == 0
        # Turn 2 restores turn 1's 150 tokens, turn 3 and its retry turn
        # 2's 200; the first turn and the stranger find nothing.
        assert r.hits == 3
        assert r.restored_tokens == 150 + 200 + 200
        assert r.found_not_restored == 0
        want = sum(_native.prefill_flops(n) for n in (150, 200, 200))
        assert r.compute_saved == pytest.approx(want)
        assert r.prompt_tokens == sum(len(q.prompt()) for q in requests)
        # Pages copied in: every page once (dedup), 4032 bytes each; the
        # same pages written to L2, each file 4 KiB with its header.
        pages = trace.PageModel.of(None)
        copied = r.l1_bytes_written // trace.PAGE_BYTES
        assert r.l1_bytes_written == copied * trace.PAGE_BYTES
        assert r.l2_bytes_written == copied * trace.SLOT
        # Turn 1 (150 tokens: 3 attention pages, the state), turn 2 (200: one
        # more attention page, the last one rekeyed, and its state), turn 3
        # (310: 2 more, the last rekeyed), the retry (301: its last page and
        # state), the stranger (100: 2 and state).
        state = pages.state_pages
        assert copied == (3 + state) + (2 + state) + (2 + state) + (1 + state) + (2 + state)
        assert r.retired == 0 and r.l1_evictions == 0


def test_cost_keeps_a_long_session_that_a_stream_of_short_ones_pushes_out_under_lru() -> None:
    # A long conversation, sixty one-off short requests, then its next turn:
    # the caches hold the long checkpoint or the short ones, not both.
    long = list(range(1, 8193))
    requests = [_req(0, "long", long, [9000])]
    for k in range(60):
        base = 100_000 + 1000 * k
        requests.append(_req(1 + k, f"s{k}", list(range(base, base + 200)), [1]))
    requests.append(_req(100, "long", [*long, 9000, 9001], [2]))
    tr = trace.Trace(requests, {})
    got = {p: trace.replay(tr, p, "2M", "1M") for p in ("lru", "cost")}
    assert got["lru"].retired > 0 and got["cost"].retired > 0
    last = 8193
    # Under lru the long checkpoint was the least recently used when room
    # was needed; under cost it saves the most per byte and stays.
    assert got["cost"].restored_tokens - got["lru"].restored_tokens == last
    assert got["cost"].compute_saved > got["lru"].compute_saved


def test_the_cli_generates_and_replays_a_trace_file(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmcache_rc",
            "trace",
            "generate",
            "chat",
            "--sessions",
            "6",
            "--seed",
            "1",
            "-o",
            str(path),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert gen.returncode == 0, gen.stderr
    assert path.read_text().count("\n") > 6
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmcache_rc",
            "trace",
            "replay",
            str(path),
            "--sizes",
            "2M:4M",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    (size,) = doc["sizes"]
    assert set(size["results"]) == {"lru", "cost"}
    for r in size["results"].values():
        assert r["requests"] == doc["trace"]["requests"] > 6
        assert r["restored_tokens"] > 0 and r["l2_bytes_written"] > 0
    assert doc["shape"]["name"] == "qwen3-next-80b-a3b"
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmcache_rc",
            "trace",
            "replay",
            "chat",
            "--sessions",
            "2",
            "--shape",
            "gpt-9",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2 and "qwen3-next-80b-a3b" in bad.stderr
