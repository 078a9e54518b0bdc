"""``lmcache-rc trace``: replay multi-turn workloads against a sidecar and
compare eviction policies.

A *trace* is a list of requests, each a prompt (token ids) and the tokens the
model answered, with the session it belongs to and the second it arrived.
Replaying one starts an embedded sidecar with small L1/L2 budgets and a given
eviction policy (``--eviction lru|cost``), and plays every request in
arrival order through the public client, as an engine in front of the
sidecar would:

1. **lookup**: ``find`` the longest stored prefix of the prompt minus its last
   token (an engine must compute at least one token);
2. **restore** it (``begin_retrieve``, poll, copy out, ``finish_retrieve``),
   every byte compared with what was stored: a wrong byte stops the replay;
3. **store** the state at the end of the prompt plus its output (what the
   connector stores when a request finishes): ``begin``, ``prepare_store``,
   copy in, ``finish_store``;
4. wait for the L2 queue to drain, so the next request sees every write done
   (so a replay barely depends on time: the same trace, sizes and policy
   give the same figures to within about 1 %; what still varies is the
   order in which pages loading from L2 become ready, which orders their
   recency).

It reports per policy the requests that restored something (hit rate), the
tokens restored, the prefill compute they saved (``prefill_flops`` of the
core's cost model, ``rust/core/src/cost.rs``: a linear term per token plus
attention's quadratic term, parameters of a named model shape), and the
bytes written to L1 (pages copied in) and to L2 (files written).

**Pages.** A checkpoint of ``n`` tokens is ``ceil(n / 64)`` attention pages
(page ``p`` keyed at its own end, ``min(64 (p + 1), n)``, so every later
checkpoint of the same tokens shares the full ones) and the recurrent state,
the same number of pages whatever ``n`` (keyed at ``n``). Every page is
4 KiB in L1 and in L2 (4 032 bytes and the L2 file's 64-byte header): the
shape's bytes scaled down so that 64 tokens of KV cache are one page (384x
for the default shape, whose state is then 26 pages, the KV of about 1 600
tokens). Sizes given to a replay are the sidecar's own, in
scaled bytes; multiply by the scale for the real model.

**Trace files** are JSON lines, one request per line::

    {"t": 12.5, "session": "a17", "tokens": [1, 2, 3, ...], "output": [4, 5, ...]}

``t`` (seconds, any origin; requests replay in ``t`` order, ties in file
order), ``session`` (a string; only reported), ``tokens`` (the prompt's token
ids, integers in ``[0, 2^31)``, at least one) and ``output`` (optional, the
generated token ids: the stored checkpoint covers ``tokens + output``; empty
or missing stores the prompt's own state). A line ``{"meta": {...}}`` (the
generators write one first) is carried into the report; blank lines are
skipped. ``docs/trace.md`` describes the format and both generators.

**Generators** (seeded, deterministic): ``chat`` (ShareGPT-like turn
lengths, few branches) and ``agentic`` (long shared system prompts and tool
outputs, deep sessions, frequent retries, forks and backtracking); see
:func:`generate_chat` and :func:`generate_agentic` for every distribution.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

import lmcache_rc as rc
from lmcache_rc import _native
from lmcache_rc.config import human_size

__all__ = [
    "GENERATORS",
    "PAGE_BYTES",
    "PAGE_TOKENS",
    "PolicyResult",
    "Request",
    "SizeResult",
    "TraceError",
    "TraceReport",
    "generate",
    "generate_agentic",
    "generate_chat",
    "model_shape",
    "prefill_flops",
    "read_trace",
    "replay",
    "run",
    "write_trace",
]

SLOT = 4096
"""What a page takes in either tier: the pool's allocation unit, and the
L2 file of a page of :data:`PAGE_BYTES` on a 4 KiB filesystem."""

L2_HEADER = 64
"""Bytes of an L2 file's header (``docs/design/l2-format.md``)."""

PAGE_BYTES = SLOT - L2_HEADER
"""Bytes of every page a replay stores: with its L2 header, one 4 KiB unit
in L2 as in L1 (the pool's allocation unit), so a page takes 4 KiB in
either tier and the sizes of both compare."""

PAGE_TOKENS = 64
"""Tokens of KV cache one page holds (the scale is chosen to make it so)."""

NAMESPACE = "lmcache-rc-trace"
"""The namespace of a replay's checkpoints."""

VOCAB = 1 << 17
"""Token ids the generators draw from (``1..VOCAB-1``)."""

Tokens = npt.NDArray[np.int32]


class TraceError(RuntimeError):
    """A trace cannot be read or replayed (bad file, a wrong restored byte)."""


# ============================================================================ cost model


def model_shape(name: str | None = None) -> dict[str, Any]:
    """The named model shape of the core's cost model (default: the
    sidecar's); an unknown name raises ``InvalidInput`` listing them."""
    shapes = _native.model_shapes()
    if name is None:
        return shapes[0]
    for s in shapes:
        if s["name"] == name:
            return s
    _native.prefill_flops(1, name)  # raises InvalidInput naming the shapes
    raise AssertionError("unreachable")


def prefill_flops(tokens: int, shape: str | None = None) -> float:
    """FLOPs to prefill ``tokens`` tokens (what restoring them saves), from
    the core's one cost model (``rust/core/src/cost.rs``)."""
    return _native.prefill_flops(tokens, shape)


@dataclass(frozen=True)
class PageModel:
    """How a replay turns a checkpoint of ``n`` tokens into pages."""

    shape: str
    scale: float
    """Real bytes per scaled byte (``PAGE_TOKENS`` tokens of KV = one page)."""
    state_pages: int
    """Pages of the recurrent state of one checkpoint."""

    @staticmethod
    def of(shape_name: str | None) -> PageModel:
        s = model_shape(shape_name)
        scale = PAGE_TOKENS * s["kv_bytes_per_token"] / SLOT
        state_pages = max(1, math.ceil(s["state_bytes"] / scale / SLOT))
        return PageModel(str(s["name"]), scale, state_pages)

    def pages(self, tokens: int) -> int:
        """Pages a checkpoint of ``tokens`` tokens holds."""
        return math.ceil(tokens / PAGE_TOKENS) + self.state_pages


# ============================================================================ traces


@dataclass
class Request:
    """One request of a trace: its prompt is the concatenation of
    ``segments`` (shared arrays: a generator's sessions reuse their context
    without copying it), its output the tokens the model answered."""

    t: float
    session: str
    segments: tuple[Tokens, ...]
    output: Tokens

    @property
    def prompt_len(self) -> int:
        """Tokens of the prompt."""
        return sum(len(s) for s in self.segments)

    def prompt(self) -> Tokens:
        """The prompt's token ids (one array)."""
        if len(self.segments) == 1:
            return self.segments[0]
        return np.concatenate(self.segments) if self.segments else np.zeros(0, np.int32)


@dataclass
class Trace:
    """Requests in arrival order, and what made them (``meta``)."""

    requests: list[Request]
    meta: dict[str, Any] = field(default_factory=dict)

    def prompt_tokens(self) -> int:
        """Tokens of every prompt."""
        return sum(r.prompt_len for r in self.requests)


def _tokens(value: object, what: str, line: int, minimum: int) -> Tokens:
    if not isinstance(value, list) or len(value) < minimum:
        raise TraceError(f"line {line}: {what} must be a list of at least {minimum} token ids")
    try:
        arr = np.asarray(value, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TraceError(f"line {line}: {what} must hold integer token ids ({exc})") from exc
    if arr.ndim != 1 or any(isinstance(v, bool) for v in value[:1]):
        raise TraceError(f"line {line}: {what} must be a flat list of integers")
    if len(arr) and (arr.min() < 0 or arr.max() >= 1 << 31):
        raise TraceError(f"line {line}: {what} holds a token id outside [0, 2^31)")
    return arr.astype(np.int32)


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Reads a trace file (JSON lines, see the module docs); requests come
    back in ``t`` order (ties in file order). Raises :class:`TraceError`
    naming the line of a malformed request."""
    requests: list[Request] = []
    meta: dict[str, Any] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"line {n}: not JSON ({exc})") from exc
            if not isinstance(rec, dict):
                raise TraceError(f"line {n}: expected an object")
            if "meta" in rec:
                if isinstance(rec["meta"], dict):
                    meta.update(rec["meta"])
                continue
            t = rec.get("t", 0.0)
            if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
                raise TraceError(f"line {n}: t must be a number of seconds")
            session = rec.get("session", "")
            if not isinstance(session, str):
                raise TraceError(f"line {n}: session must be a string")
            prompt = _tokens(rec.get("tokens"), "tokens", n, 1)
            output = _tokens(rec.get("output", []), "output", n, 0)
            requests.append(Request(float(t), session, (prompt,), output))
    requests.sort(key=lambda r: r.t)
    meta.setdefault("source", str(path))
    return Trace(requests, meta)


def write_trace(path: str | os.PathLike[str] | TextIO, trace: Trace) -> int:
    """Writes ``trace`` as JSON lines (a ``meta`` line first); returns the
    number of requests written."""

    def emit(f: TextIO) -> int:
        f.write(json.dumps({"meta": trace.meta}, sort_keys=True) + "\n")
        for r in trace.requests:
            rec = {
                "t": round(r.t, 3),
                "session": r.session,
                "tokens": r.prompt().tolist(),
                "output": r.output.tolist(),
            }
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        return len(trace.requests)

    if isinstance(path, str | os.PathLike):
        with open(path, "w", encoding="utf-8") as f:
            return emit(f)
    return emit(path)


# ============================================================================ generators


class _Draw:
    """The generators' randomness: one seeded numpy generator."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def tokens(self, n: int) -> Tokens:
        return self.rng.integers(1, VOCAB, size=max(1, n), dtype=np.int32)

    def lognormal(self, median: float, sigma: float, lo: int, hi: int) -> int:
        return int(min(hi, max(lo, round(median * math.exp(sigma * self.rng.standard_normal())))))

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def uniform(self, lo: float, hi: float) -> float:
        return float(self.rng.uniform(lo, hi))

    def integer(self, lo: int, hi: int) -> int:
        """An integer in ``[lo, hi]``."""
        return int(self.rng.integers(lo, hi + 1))

    def exponential(self, mean: float) -> float:
        return float(self.rng.exponential(mean))

    def choice(self, weights: Sequence[float]) -> int:
        p = np.asarray(weights, dtype=float)
        return int(self.rng.choice(len(p), p=p / p.sum()))


def generate_chat(seed: int = 0, sessions: int = 300) -> Trace:
    """A chat workload, ShareGPT-like (seeded; every draw below):

    - three system prompts (64, 180 and 420 tokens; picked with weights
      0.5 / 0.3 / 0.2), shared by the sessions that pick them;
    - sessions start as a Poisson process (one every 2 s on average);
      turns per session: 1 + a geometric count of mean 2.5 (mean 3.5 turns,
      at most 16), most sessions short, some long;
    - a user message is lognormal (median 70 tokens, sigma 1.0, 4..3000) and an
      answer lognormal (median 220, sigma 0.7, 8..2000), as ShareGPT's turn
      lengths;
    - the user thinks between turns for a lognormal time (median 20 s,
      sigma 0.8) after an answer that took 25 ms per output token;
    - few branches: a turn is regenerated (the same prompt sent again, the
      new answer kept) with probability 0.05, or the user edits the message
      of the previous turn (the conversation branches before it, the old
      branch is abandoned) with probability 0.03.

    Each request's prompt is the system prompt, every earlier message and
    answer of its branch, and the new user message; its output the answer.
    """
    d = _Draw(seed)
    systems = [d.tokens(n) for n in (64, 180, 420)]
    requests: list[Request] = []
    start = 0.0
    for s in range(sessions):
        start += d.exponential(2.0)
        name = f"c{s}"
        # numpy's geometric counts trials (>= 1): minus one is a count of mean 2.5.
        turns = min(16, 1 + int(d.rng.geometric(1 / 3.5)) - 1)
        context: list[Tokens] = [systems[d.choice([0.5, 0.3, 0.2])]]
        t = start
        before_last: list[Tokens] = list(context)
        for turn in range(turns):
            if turn > 0 and d.chance(0.03):
                # An edit of the previous user message: branch before it.
                context = list(before_last)
            before_last = list(context)
            user = d.tokens(d.lognormal(70, 1.0, 4, 3000))
            prompt = (*context, user)
            answer = d.tokens(d.lognormal(220, 0.7, 8, 2000))
            requests.append(Request(t, name, prompt, answer))
            t += 0.025 * len(answer)
            if d.chance(0.05):
                # Regenerated: the same prompt again, the new answer kept.
                t += d.lognormal(5, 0.5, 1, 60)
                answer = d.tokens(d.lognormal(220, 0.7, 8, 2000))
                requests.append(Request(t, name, prompt, answer))
                t += 0.025 * len(answer)
            context = [*prompt, answer]
            t += d.lognormal(20, 0.8, 1, 600)
    requests.sort(key=lambda r: r.t)
    meta = {"generator": "chat", "seed": seed, "sessions": sessions}
    return Trace(requests, meta)


def generate_agentic(seed: int = 0, sessions: int = 60) -> Trace:
    """An agentic workload (seeded; every draw below):

    - three agents whose system prompts (instructions and tool schemas) are
      2 500, 4 500 and 7 000 tokens, each session picking one uniformly;
    - sessions start as a Poisson process (one every 10 s on average), each
      with a task description, lognormal (median 400 tokens, sigma 0.8, 50..4000);
    - a session runs 10..40 steps (uniform). Each step is one request: the
      model answers a tool call (lognormal, median 150 tokens, sigma 0.7,
      10..1500), the tool's output (lognormal, median 700, sigma 1.0, 20..8000:
      file reads, search results, test logs) is appended, and the next step's
      prompt is the whole context so far; a step takes 25 ms per output token
      plus the tool's time (lognormal, median 3 s, sigma 0.8);
    - retries: a step's request is sent twice with probability 0.10 (the
      first answer was malformed or timed out; the second is kept);
    - forks: with probability 0.08 a step spawns 2 or 3 sub-agents from the
      current context, each running 2..6 steps of its own concurrently (a
      sub-agent does not fork again); the main line then continues from
      the fork point with their summaries (lognormal, median 300 tokens)
      appended;
    - backtracking: with probability 0.05 the agent abandons its last 1..3
      steps and continues from the context before them;
    - compaction: a context beyond 48 000 tokens is replaced by the system
      prompt, the task and a summary (1 000 tokens) and the session goes on.
    """
    d = _Draw(seed)
    systems = [d.tokens(n) for n in (2500, 4500, 7000)]
    requests: list[Request] = []
    start = 0.0

    def step_time(output: int) -> float:
        return 0.025 * output + d.lognormal(3, 0.8, 0, 120)

    def run_steps(
        name: str,
        context: list[Tokens],
        t: float,
        steps: int,
        history: list[list[Tokens]],
        sub: bool = False,
    ) -> tuple[list[Tokens], float]:
        for _ in range(steps):
            if sum(len(c) for c in context) > 48_000:
                context = [*context[:2], d.tokens(1000)]
                history.clear()
            prompt = tuple(context)
            output = d.tokens(d.lognormal(150, 0.7, 10, 1500))
            if d.chance(0.10):
                first = d.tokens(d.lognormal(150, 0.7, 10, 1500))
                requests.append(Request(t, name, prompt, first))
                t += step_time(len(first))
            requests.append(Request(t, name, prompt, output))
            tool = d.tokens(d.lognormal(700, 1.0, 20, 8000))
            history.append(list(context))
            context = [*prompt, output, tool]
            t += step_time(len(output))
            if not sub and d.chance(0.08):
                forks = d.integer(2, 3)
                fork = len(requests)
                ends = [
                    run_steps(f"{name}.f{fork}.{k}", list(context), t, d.integer(2, 6), [], True)[1]
                    for k in range(forks)
                ]
                t = max(ends)
                context = [*context, d.tokens(d.lognormal(300, 0.6, 50, 2000))]
            elif d.chance(0.05) and len(history) > 1:
                back = min(len(history) - 1, d.integer(1, 3))
                context = history[-back - 1]
                del history[-back:]
        return context, t

    for s in range(sessions):
        start += d.exponential(10.0)
        system = systems[d.integer(0, 2)]
        task = d.tokens(d.lognormal(400, 0.8, 50, 4000))
        run_steps(f"a{s}", [system, task], start, d.integer(10, 40), [])
    requests.sort(key=lambda r: r.t)
    meta = {"generator": "agentic", "seed": seed, "sessions": sessions}
    return Trace(requests, meta)


GENERATORS: dict[str, Callable[..., Trace]] = {"chat": generate_chat, "agentic": generate_agentic}
"""The synthetic workloads by name (``lmcache-rc trace generate NAME``)."""


def generate(name: str, seed: int = 0, sessions: int | None = None) -> Trace:
    """The generator ``name``'s trace (``sessions``: its default when None)."""
    try:
        gen = GENERATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown trace {name!r}; the generators are {', '.join(GENERATORS)}"
        ) from None
    return gen(seed) if sessions is None else gen(seed, sessions)


# ============================================================================ replay


@dataclass
class PolicyResult:
    """What one replay of a trace measured."""

    policy: str
    l1_bytes: int
    l2_bytes: int
    requests: int = 0
    prompt_tokens: int = 0
    hits: int = 0
    """Requests that restored a checkpoint."""
    restored_tokens: int = 0
    compute_saved: float = 0.0
    """FLOPs the restores saved (``prefill_flops`` of each restore)."""
    compute_total: float = 0.0
    """FLOPs every prompt costs prefilled from nothing."""
    found_not_restored: int = 0
    """Lookups whose generation could not be restored (evicted meanwhile)."""
    stores: int = 0
    stores_missed: int = 0
    """Stores the sidecar refused (no room, or suppressed)."""
    l1_bytes_written: int = 0
    """Bytes copied into L1 by stores (``store_bytes_committed``)."""
    l2_bytes_written: int = 0
    """Bytes written to L2 files (``l2_bytes_written``)."""
    l1_evictions: int = 0
    l2_evictions: int = 0
    retired: int = 0
    """Generations retired because their last copy was evicted (``evictions``)."""
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Share of requests that restored a checkpoint."""
        return self.hits / self.requests if self.requests else 0.0

    @property
    def token_hit_rate(self) -> float:
        """Share of prompt tokens restored."""
        return self.restored_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def saved_share(self) -> float:
        """Share of the trace's prefill compute the restores saved."""
        return self.compute_saved / self.compute_total if self.compute_total else 0.0


@dataclass
class SizeResult:
    """Every policy replayed at one cache size."""

    l1_bytes: int
    l2_bytes: int
    results: dict[str, PolicyResult]

    def ratio(self, key: str = "compute_saved") -> float | None:
        """cost ÷ lru of ``key`` (None without both policies or with a zero)."""
        lru, cost = self.results.get("lru"), self.results.get("cost")
        if lru is None or cost is None:
            return None
        a, b = getattr(cost, key), getattr(lru, key)
        return a / b if b else None


@dataclass
class TraceReport:
    """A trace replayed at some sizes under some policies."""

    trace: dict[str, Any]
    shape: dict[str, Any]
    scale: float
    sizes: list[SizeResult]

    def document(self) -> dict[str, Any]:
        """The ``--json`` object."""
        out: dict[str, Any] = {"trace": self.trace, "shape": self.shape, "scale": self.scale}
        out["sizes"] = [
            {
                "l1_bytes": s.l1_bytes,
                "l2_bytes": s.l2_bytes,
                "cost_over_lru": {
                    k: s.ratio(k)
                    for k in ("compute_saved", "restored_tokens", "hits", "l2_bytes_written")
                },
                "results": {
                    p: {
                        **asdict(r),
                        "hit_rate": r.hit_rate,
                        "token_hit_rate": r.token_hit_rate,
                        "saved_share": r.saved_share,
                    }
                    for p, r in s.results.items()
                },
            }
            for s in self.sizes
        ]
        return out

    def report(self) -> str:
        """The human-readable table."""
        t = self.trace
        lines = [
            f"trace {t.get('name', '?')}: {t['requests']} requests, {t['sessions']} sessions, "
            f"{t['prompt_tokens']:,} prompt tokens; model shape {self.shape['name']} "
            f"(pages scaled 1/{self.scale:g}: sizes are the sidecar's, "
            f"x{self.scale:g} at full size)",
            "  prefill compute saved = sum of prefill_flops(restored tokens), "
            "rust/core/src/cost.rs; % of the trace's total prefill compute",
            f"  {'L1 + L2':<17} {'policy':<6} {'hit rate':>8} {'tokens restored':>17} "
            f"{'compute saved':>18} {'L1 written':>11} {'L2 written':>11} {'retired':>7}",
        ]
        for s in self.sizes:
            size = f"{human_size(s.l1_bytes)} + {human_size(s.l2_bytes)}"
            for i, (p, r) in enumerate(s.results.items()):
                lines.append(
                    f"  {size if i == 0 else '':<17} {p:<6} {r.hit_rate:>7.1%} "
                    f"{r.restored_tokens:>10,} ({r.token_hit_rate:>4.0%}) "
                    f"{r.compute_saved / 1e15:>9.1f} PF ({r.saved_share:>4.0%}) "
                    f"{human_size(r.l1_bytes_written):>11} {human_size(r.l2_bytes_written):>11} "
                    f"{r.retired:>7}"
                )
            ratio = s.ratio()
            if ratio is not None:
                tokens = s.ratio("restored_tokens") or 0.0
                written = s.ratio("l2_bytes_written") or 0.0
                lines.append(
                    f"  {'':<17} cost/lru: compute saved {ratio:.2f}x, tokens restored "
                    f"{tokens:.2f}x, L2 bytes written {written:.2f}x"
                )
        return "\n".join(lines)


def _parse_size(text: str | int) -> int:
    """A size in the sidecar's grammar (``8M``, ``512KiB``) or an int."""
    if isinstance(text, int):
        return text
    value = rc.ServerConfig.parse("l2_bytes", text)
    if not isinstance(value, int):
        raise ValueError(f"expected a size, got {text!r}")
    return value


def _page_content(key: str) -> npt.NDArray[np.uint8]:
    """A page's bytes: a function of its content key only, so a page shared
    by several checkpoints holds the same bytes in each."""
    return np.resize(np.frombuffer(bytes.fromhex(key), np.uint8), PAGE_BYTES)


class _Replayer:
    """One sidecar, one namespace, one trace: the loop of the module docs."""

    def __init__(self, client: rc.Client, pages: PageModel, namespace: str) -> None:
        self.client = client
        self.pages = pages
        self.ns = namespace

    def manifest(self, tokens: Tokens) -> rc.Manifest:
        n = len(tokens)
        roots = rc.TokenRoots.build(self.ns, tokens)
        attention = [
            (min((p + 1) * PAGE_TOKENS, n), "attention:0")
            for p in range(math.ceil(n / PAGE_TOKENS))
        ]
        state = [(n, f"recurrent:1:{i}") for i in range(self.pages.state_pages)]
        body = {
            "schema_version": 2,
            "kind": "response",
            "page_groups": [
                {
                    "name": "attention",
                    "page_bytes": PAGE_BYTES,
                    "positions": list(range(len(attention))),
                    "content_keys": roots.content_keys(attention),
                },
                {
                    "name": "recurrent",
                    "page_bytes": PAGE_BYTES,
                    "positions": list(range(len(state))),
                    "content_keys": roots.content_keys(state),
                },
            ],
        }
        payload = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        prefix = roots.prefix(n)
        return rc.Manifest(rc.checkpoint_generation(prefix, payload), prefix, 1, payload)

    def restore(self, m: rc.Manifest) -> bool:
        """Restores ``m`` byte for byte; False on a miss."""
        lease = self.client.begin_retrieve(m, 0)
        deadline = time.monotonic() + 60
        while lease.status == "pending":
            if time.monotonic() > deadline:
                raise TraceError("a restore stayed pending for 60 s")
            time.sleep(0.0002)
            lease = self.client.poll_retrieve(lease.lease_id or "")
        if lease.status != "ready":
            return False
        assert lease.lease_id is not None
        groups = m.page_groups()
        try:
            for g, arrays in enumerate(self.client.lease_arrays(lease)):
                keys = groups[g]["content_keys"]
                for i, arr in enumerate(arrays):
                    if arr is None or not np.array_equal(arr, _page_content(keys[i])):
                        raise TraceError(
                            f"restored page {i} of group {groups[g]['name']} of "
                            f"{m.generation} differs from the stored bytes"
                        )
        finally:
            self.client.finish_retrieve(lease.lease_id)
        return True

    def store(self, m: rc.Manifest) -> bool:
        """Stores ``m``; False when the sidecar refused it."""
        if not self.client.begin(m):
            return False
        deadline = time.monotonic() + 60
        while (lease := self.client.prepare_store(m, 0)).status == "busy":
            if time.monotonic() > deadline:
                self.client.abort(m.generation)
                raise TraceError("a store stayed busy for 60 s")
            time.sleep(0.0005)
        if lease.status != "ready":
            return False
        assert lease.lease_id is not None
        groups = m.page_groups()
        for g, arrays in enumerate(self.client.lease_arrays(lease)):
            keys = groups[g]["content_keys"]
            for i, arr in enumerate(arrays):
                if arr is not None:
                    arr[:] = _page_content(keys[i])
        return self.client.finish_store(lease.lease_id, True)

    def settle(self) -> None:
        """Waits until every L2 write is done."""
        deadline = time.monotonic() + 60
        while self.client.status()["l2_queue"]:
            if time.monotonic() > deadline:
                raise TraceError("the L2 queue did not drain in 60 s")
            time.sleep(0.0002)


def _l2_parent() -> str | None:
    """Where L2 files go: memory (/dev/shm) when it can be written, so a
    replay measures the policy, not the disk (the figures do not depend
    on time)."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


Progress = Callable[[str], None]


def replay(
    trace: Trace,
    policy: str,
    l1_bytes: int | str,
    l2_bytes: int | str,
    shape: str | None = None,
    progress: Progress | None = None,
) -> PolicyResult:
    """Replays ``trace`` against a fresh embedded sidecar with ``l1_bytes``
    of L1, ``l2_bytes`` of L2 and the eviction ``policy``; returns what it
    measured. ``progress`` gets a line about every 2 seconds."""
    if policy not in _native.eviction_policies():
        raise ValueError(f"unknown policy {policy!r}; the policies are lru and cost")
    l1, l2 = _parse_size(l1_bytes), _parse_size(l2_bytes)
    pages = PageModel.of(shape)
    largest = max((r.prompt_len + len(r.output) for r in trace.requests), default=0)
    need = 2 * pages.pages(largest) * SLOT
    if l1 < need:
        raise ValueError(
            f"--l1 {human_size(l1)} is too small for this trace: its longest checkpoint "
            f"({largest:,} tokens) takes {human_size(need // 2)}, and L1 must hold a "
            f"restore and a store of that size at once (at least {human_size(need)})"
        )
    result = PolicyResult(policy, l1, l2)
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="lmcache-rc-trace-") as tmp,
        tempfile.TemporaryDirectory(prefix="lmcache-rc-trace-l2-", dir=_l2_parent()) as l2_dir,
    ):
        config = rc.ServerConfig(
            socket=os.path.join(tmp, "trace.sock"),
            l1_bytes=l1,
            l2_path=l2_dir,
            l2_bytes=l2,
            eviction=policy,
            http_port=-1,
            store_admission_timeout=1.0,
        )
        server = rc.Server.start(config)
        try:
            with rc.Client(server.socket_path) as client:
                # One namespace for every replay (each has a sidecar of its
                # own): object keys, and so the order of ties, are the same
                # at every run.
                r = _Replayer(client, pages, NAMESPACE)
                last = time.monotonic()
                for k, req in enumerate(trace.requests):
                    _one(r, req, result, pages.shape)
                    if progress is not None and time.monotonic() - last > 2.0:
                        last = time.monotonic()
                        progress(
                            f"{k + 1}/{len(trace.requests)} requests, "
                            f"{result.token_hit_rate:.0%} of prompt tokens restored"
                        )
                status = client.status()
                result.l1_bytes_written = int(status["store_bytes_committed"])
                result.l2_bytes_written = int(status["l2_bytes_written"])
                result.l1_evictions = int(status["l1_evictions"])
                result.l2_evictions = int(status["l2_evictions"])
                result.retired = int(status["evictions"])
        finally:
            server.stop(timeout=10.0)
    result.seconds = time.monotonic() - started
    return result


def _one(r: _Replayer, req: Request, result: PolicyResult, shape: str) -> None:
    prompt = req.prompt()
    result.requests += 1
    result.prompt_tokens += len(prompt)
    result.compute_total += prefill_flops(len(prompt), shape)
    if len(prompt) >= 2:
        found = r.client.find(rc.TokenRoots.build(r.ns, prompt[:-1]).roots)
        if found is not None:
            if r.restore(found):
                n = found.prefix.num_tokens
                result.hits += 1
                result.restored_tokens += n
                result.compute_saved += prefill_flops(n, shape)
            else:
                result.found_not_restored += 1
    full = np.concatenate((prompt, req.output)) if len(req.output) else prompt
    result.stores += 1
    if not r.store(r.manifest(full)):
        result.stores_missed += 1
    r.settle()


def _sessions(trace: Trace) -> int:
    return len({r.session.split(".")[0] for r in trace.requests})


def run(
    trace: Trace,
    sizes: Iterable[tuple[int | str, int | str]],
    policies: Sequence[str] = ("lru", "cost"),
    shape: str | None = None,
    name: str | None = None,
    progress: TextIO | None = None,
) -> TraceReport:
    """Replays ``trace`` at every ``(l1, l2)`` size under every policy."""
    pages = PageModel.of(shape)
    label = name or str(trace.meta.get("generator") or trace.meta.get("source") or "trace")
    out: list[SizeResult] = []
    for l1, l2 in sizes:
        results: dict[str, PolicyResult] = {}
        for policy in policies:
            tag = f"[{label} {policy} {human_size(_parse_size(l1))}+{human_size(_parse_size(l2))}]"

            def say(line: str, tag: str = tag) -> None:
                if progress is not None:
                    print(f"{tag} {line}", file=progress, flush=True)

            res = replay(trace, policy, l1, l2, shape, say)
            say(f"done in {res.seconds:.1f} s: {res.restored_tokens:,} tokens restored")
            results[policy] = res
        out.append(SizeResult(_parse_size(l1), _parse_size(l2), results))
    info = {
        "name": label,
        "requests": len(trace.requests),
        "sessions": _sessions(trace),
        "prompt_tokens": trace.prompt_tokens(),
        "meta": trace.meta,
    }
    return TraceReport(info, model_shape(pages.shape), pages.scale, out)


def parse_sizes(text: str) -> list[tuple[str, str]]:
    """``L1:L2[,L1:L2...]`` (``4M:16M,8M:32M``) → pairs of sizes."""
    pairs = []
    for part in text.split(","):
        l1, sep, l2 = part.strip().partition(":")
        if not sep or not l1 or not l2:
            raise ValueError(f"--sizes takes L1:L2 pairs separated by commas, got {part!r}")
        _parse_size(l1)
        _parse_size(l2)
        pairs.append((l1, l2))
    return pairs


def load(source: str, seed: int = 0, sessions: int | None = None) -> Trace:
    """A generator's trace by name (``chat``, ``agentic``) or a trace file."""
    if source in GENERATORS:
        return generate(source, seed, sessions)
    if not Path(source).exists():
        raise ValueError(
            f"{source!r} is neither a trace file nor a generator ({', '.join(GENERATORS)})"
        )
    return read_trace(source)


def main_generate(name: str, seed: int, sessions: int | None, out: str | None) -> int:
    """``lmcache-rc trace generate``: writes the trace (stdout without ``-o``)."""
    trace = generate(name, seed, sessions)
    if out is None or out == "-":
        write_trace(sys.stdout, trace)
    else:
        n = write_trace(out, trace)
        print(
            f"wrote {n} requests ({trace.prompt_tokens():,} prompt tokens, "
            f"{_sessions(trace)} sessions) to {out}",
            file=sys.stderr,
        )
    return 0


def main_replay(
    source: str,
    policy: str,
    sizes: list[tuple[str, str]],
    shape: str | None,
    seed: int,
    sessions: int | None,
    as_json: bool,
) -> int:
    """``lmcache-rc trace replay``: prints the table (or one JSON object)."""
    policies = ["lru", "cost"] if policy == "both" else [policy]
    model_shape(shape)  # an unknown shape fails before anything runs
    trace = load(source, seed, sessions)
    if not trace.requests:
        raise ValueError("the trace has no requests")
    report = run(
        trace, sizes, policies, shape, source if source in GENERATORS else None, sys.stderr
    )
    if as_json:
        print(json.dumps(report.document(), sort_keys=True))
    else:
        print(report.report())
    return 0
