"""Multi-turn load against an OpenAI-compatible vLLM server, and what it measured.

What it owns: the workload (:class:`Workload`: concurrent users holding
multi-turn conversations that share system prompts, some turns streamed,
some streams aborted by the client and retried), one client per user driving
``/v1/completions`` with token-id prompts (so any server works, with or
without a tokenizer), a record per request (:class:`TurnRecord`: prompt and
output tokens, the server's ``cached_tokens``, time to first token, errors,
aborts) and the figures a user judges a cache by (:func:`summarize`: time to
first token p50/p99 per turn class, prefill tokens computed, hit rate,
throughput). ``lmcache-rc serve-bench --url URL`` runs it against any server
(:func:`main`); the serving suite and the serving benchmark drive it too.

Token ids are drawn from a seeded generator, so the same :class:`Workload`
sends the same prompts to every server it is pointed at (each conversation's
later turns append the server's own answers, so they agree only as far as
the answers do).

What it must never do: hide a failed request (every error is a record), or
count an aborted stream as served.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "ServeError",
    "TurnRecord",
    "Workload",
    "main",
    "parse_range",
    "percentile",
    "render",
    "run_load",
    "server_model",
    "summarize",
]


class ServeError(ConnectionError):
    """The server could not be used (unreachable, or it lists no model)."""


@dataclass(frozen=True)
class Workload:
    """What the load sends. Every count is per run; token ids are drawn from
    ``vocab`` with ``seed``, so two runs of one workload send the same prompts."""

    users: int = 8
    """Conversations held at once (one client each)."""
    conversations: int = 16
    """Conversations in all (each user starts a new one when its last ends);
    ignored while ``duration`` is set."""
    duration: float | None = None
    """Seconds to keep starting turns (then the turns in progress end); None:
    until ``conversations`` conversations ended."""
    turns: tuple[int, int] = (4, 6)
    """Turns per conversation (inclusive range)."""
    system_prompts: int = 2
    """Distinct system prompts, shared by the conversations."""
    system_tokens: tuple[int, int] = (512, 1024)
    """Tokens of a system prompt (inclusive range)."""
    user_tokens: tuple[int, int] = (32, 128)
    """Tokens a user adds per turn (inclusive range)."""
    max_tokens: int = 32
    """Output tokens per turn (the server is asked to ignore end-of-sequence)."""
    stream: float = 0.3
    """Fraction of turns streamed (time to first token is measured on those)."""
    abort: float = 0.0
    """Fraction of streamed turns the client abandons after 1-3 chunks; the
    turn is then sent again, not streamed-and-aborted."""
    vocab: tuple[int, int] = (10, 2038)
    """Token ids are drawn from this half-open range."""
    seed: int = 0
    logprobs: int = 0
    """Top log-probabilities asked per output token (0: none); with 2 or more
    each record has the best tokens per position (:attr:`TurnRecord.top`) and
    the gap between the two best (:attr:`TurnRecord.margins`)."""
    think: float = 0.0
    """Seconds a user waits between turns."""
    timeout: float = 600.0
    """Seconds one request may take before it is an error."""

    def __post_init__(self) -> None:
        if self.users < 1:
            raise ValueError(f"users must be at least 1, got {self.users}")
        for name in ("turns", "system_tokens", "user_tokens"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be an increasing range, got {lo}..{hi}")
        if self.turns[0] < 1:
            raise ValueError("a conversation has at least one turn")
        if not 0.0 <= self.stream <= 1.0 or not 0.0 <= self.abort <= 1.0:
            raise ValueError("stream and abort are fractions between 0 and 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0 <= self.vocab[0] < self.vocab[1]:
            raise ValueError(f"vocab must be a non-empty range, got {self.vocab}")


@dataclass
class TurnRecord:
    """One request as the client saw it."""

    user: int
    conversation: int
    """The conversation's number in the run (0, 1, ...)."""
    turn: int
    """1 for a conversation's first turn."""
    system: int
    """Which system prompt the conversation began with (-1: it carried on a
    given history)."""
    prompt: list[int]
    streamed: bool
    started: float
    """Seconds since the run began."""
    sent_at: float = 0.0
    """When it was sent, on the machine's monotonic clock (``time.monotonic()``):
    to place it against events outside the run."""
    latency: float = 0.0
    """Seconds until the whole answer (or the abort, or the error)."""
    ttft: float | None = None
    """Seconds until the first output token (streamed turns only)."""
    output: list[int] = field(default_factory=list)
    cached_tokens: int | None = None
    """The server's ``usage.prompt_tokens_details.cached_tokens`` (None when
    it does not report them: start vLLM with ``--enable-prompt-tokens-details``)."""
    aborted: bool = False
    """The client abandoned the stream (the turn was sent again)."""
    error: str = ""
    top: list[dict[int, float]] = field(default_factory=list)
    """Per output token, the best ``logprobs`` tokens and their
    log-probabilities (with ``logprobs`` set)."""

    @property
    def margins(self) -> list[float]:
        """Per output token, the log-probability gap between the two best
        tokens (with ``logprobs`` ≥ 2; infinite where only one is known)."""
        out: list[float] = []
        for top in self.top:
            values = sorted(top.values(), reverse=True)
            out.append(values[0] - values[1] if len(values) > 1 else float("inf"))
        return out

    @property
    def ok(self) -> bool:
        """Served in full."""
        return not self.error and not self.aborted

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the prompt."""
        return len(self.prompt)

    def to_json(self) -> dict[str, Any]:
        """A plain dict (``prompt`` as its length, to keep reports small;
        ``top`` keyed by token id as a string, as JSON needs)."""
        out = asdict(self)
        out["prompt"] = len(self.prompt)
        out["top"] = [{str(k): v for k, v in t.items()} for t in self.top]
        return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _aiohttp() -> Any:
    try:
        import aiohttp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ServeError(
            "the serving load needs aiohttp (vLLM's environment has it): pip install aiohttp"
        ) from e
    return aiohttp


def server_model(url: str, timeout: float = 10.0) -> str:
    """The first model the server at ``url`` lists (``GET /v1/models``)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=timeout) as r:
            body = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ServeError(f"cannot list the models of {url}: {e}") from e
    try:
        return str(body["data"][0]["id"])
    except (KeyError, IndexError, TypeError) as e:
        raise ServeError(f"{url}/v1/models lists no model: {body!r}") from e


class _Conversation:
    """One conversation's prompt as it grows."""

    def __init__(
        self,
        rng: random.Random,
        workload: Workload,
        systems: list[list[int]],
        history: Sequence[int] | None = None,
    ) -> None:
        self.system = rng.randrange(len(systems))
        self.turns = rng.randint(*workload.turns)
        if history is not None:  # a conversation carried on from an earlier run
            self.system = -1
            self.history: list[int] = list(history)
        else:
            self.history = list(systems[self.system])
        self._rng = rng
        self._workload = workload

    def user_turn(self) -> list[int]:
        lo, hi = self._workload.vocab
        n = self._rng.randint(*self._workload.user_tokens)
        self.history += [self._rng.randrange(lo, hi) for _ in range(n)]
        return list(self.history)


def _top(logprobs: Any) -> list[dict[int, float]]:
    """Per token, the best tokens and their log-probabilities (the server
    names tokens ``token_id:<id>`` when asked ``return_tokens_as_token_ids``)."""
    out: list[dict[int, float]] = []
    for top in (logprobs or {}).get("top_logprobs") or []:
        entry: dict[int, float] = {}
        for name, value in (top or {}).items():
            _, _, digits = str(name).rpartition(":")
            if digits.lstrip("-").isdigit():
                entry[int(digits)] = float(value)
        out.append(entry)
    return out


class _Load:
    def __init__(
        self,
        url: str,
        model: str,
        workload: Workload,
        stop: threading.Event | None,
        on_record: Callable[[TurnRecord], None] | None,
        histories: Sequence[Sequence[int]] | None = None,
        first_turn: int = 1,
    ) -> None:
        self.histories = None if histories is None else [list(h) for h in histories]
        self.first_turn = first_turn
        self.url = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.w = workload
        self.stop = stop
        self.on_record = on_record
        self.records: list[TurnRecord] = []
        self.next_conversation = 0
        rng = random.Random(workload.seed)
        lo, hi = workload.vocab
        self.systems = [
            [rng.randrange(lo, hi) for _ in range(rng.randint(*workload.system_tokens))]
            for _ in range(workload.system_prompts or 1)
        ]
        self.t0 = 0.0

    def _expired(self) -> bool:
        """Stopped, or past the duration: no new turn starts."""
        if self.stop is not None and self.stop.is_set():
            return True
        return self.w.duration is not None and time.monotonic() - self.t0 >= self.w.duration

    def _more(self) -> bool:
        """Whether a user starts another conversation."""
        if self._expired():
            return False
        if self.histories is not None:
            return self.next_conversation < len(self.histories)
        return self.w.duration is not None or self.next_conversation < self.w.conversations

    def _record(self, rec: TurnRecord) -> None:
        self.records.append(rec)
        if self.on_record is not None:
            self.on_record(rec)

    async def run(self) -> list[TurnRecord]:
        aiohttp = _aiohttp()
        self.t0 = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=self.w.timeout)
        connector = aiohttp.TCPConnector(limit=self.w.users * 2, force_close=False)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            await asyncio.gather(*(self._user(session, u) for u in range(self.w.users)))
        return self.records

    async def _user(self, session: Any, user: int) -> None:
        while self._more():
            number = self.next_conversation
            self.next_conversation += 1
            rng = random.Random(f"{self.w.seed}/{number}")
            history = None if self.histories is None else self.histories[number]
            conv = _Conversation(rng, self.w, self.systems, history)
            for turn in range(self.first_turn, self.first_turn + conv.turns):
                if turn > self.first_turn and self._expired():
                    break  # a counted conversation runs to its end; a timed run stops
                prompt = conv.user_turn()
                streamed = rng.random() < self.w.stream
                abort_after = (
                    rng.randint(1, 3) if streamed and rng.random() < self.w.abort else None
                )
                rec = await self._send(
                    session, user, number, turn, conv.system, prompt, streamed, abort_after
                )
                if rec.aborted:
                    # the user asks again (not abandoned this time)
                    rec = await self._send(
                        session, user, number, turn, conv.system, prompt, streamed, None
                    )
                if not rec.ok:
                    break  # the conversation cannot continue without its answer
                conv.history += rec.output
                if self.w.think:
                    await asyncio.sleep(self.w.think)

    async def _send(
        self,
        session: Any,
        user: int,
        conversation: int,
        turn: int,
        system: int,
        prompt: list[int],
        streamed: bool,
        abort_after: int | None,
    ) -> TurnRecord:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.w.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": streamed,
        }
        if self.w.logprobs:
            body["logprobs"] = self.w.logprobs
            body["return_tokens_as_token_ids"] = True
        if streamed:
            body["stream_options"] = {"include_usage": True}
        start = time.monotonic()
        rec = TurnRecord(
            user, conversation, turn, system, prompt, streamed, start - self.t0, sent_at=start
        )
        try:
            async with session.post(self.url, json=body) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    rec.error = f"HTTP {resp.status}: {text[:300]}"
                elif streamed:
                    await self._read_stream(resp, rec, start, abort_after)
                else:
                    self._read_whole(await resp.json(), rec)
        except TimeoutError:
            rec.error = f"no answer within {self.w.timeout:.0f} s"
        except Exception as e:  # every failure is a record, never a crash of the load
            rec.error = f"{type(e).__name__}: {e}"
        rec.latency = time.monotonic() - start
        if not rec.error and not rec.aborted and len(rec.output) != self.w.max_tokens:
            rec.error = f"{len(rec.output)} output tokens, {self.w.max_tokens} asked"
        self._record(rec)
        return rec

    def _read_whole(self, body: dict[str, Any], rec: TurnRecord) -> None:
        choice = body["choices"][0]
        rec.output = [int(t) for t in choice.get("token_ids") or []]
        rec.top = _top(choice.get("logprobs"))
        rec.cached_tokens = _cached(body.get("usage"))

    async def _read_stream(
        self, resp: Any, rec: TurnRecord, start: float, abort_after: int | None
    ) -> None:
        chunks = 0
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                rec.error = f"stream error: {json.dumps(event['error'])[:300]}"
                return
            for choice in event.get("choices") or []:
                ids = [int(t) for t in choice.get("token_ids") or []]
                if ids and rec.ttft is None:
                    rec.ttft = time.monotonic() - start
                rec.output += ids
                rec.top += _top(choice.get("logprobs"))
                if ids:
                    chunks += 1
            if event.get("usage"):
                rec.cached_tokens = _cached(event["usage"])
            if abort_after is not None and chunks >= abort_after:
                rec.aborted = True
                resp.close()  # the client goes away mid-stream
                return


def _cached(usage: Any) -> int | None:
    details = (usage or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return None if value is None else int(value)


def run_load(
    url: str,
    workload: Workload,
    *,
    model: str | None = None,
    stop: threading.Event | None = None,
    on_record: Callable[[TurnRecord], None] | None = None,
    histories: Sequence[Sequence[int]] | None = None,
    first_turn: int = 1,
) -> list[TurnRecord]:
    """Runs ``workload`` against the server at ``url`` (its first listed model
    unless ``model``) and returns a record per request, in completion order.
    ``stop`` ends it early (turns in progress finish); ``on_record`` sees each
    record as it completes (from the load's thread). ``histories`` carries
    on conversations of an earlier run instead (one per history, numbered in
    order, their turns numbered from ``first_turn``: after an engine restart,
    say)."""
    name = model or server_model(url)
    load = _Load(url, name, workload, stop, on_record, histories, first_turn)
    return asyncio.run(load.run())


def summarize(records: Sequence[TurnRecord], *, long_prompt: int = 2048) -> dict[str, Any]:
    """What a user judges a cache by: per class of turn (``first``: a
    conversation's first turn, ``later``: turns 2 and on, ``long``: later
    turns of at least ``long_prompt`` tokens) the time to first token p50/p99
    (streamed turns), latency p50, prompt tokens, cached tokens and prefill
    tokens computed; and over the run requests, errors, aborts, hit rate and
    throughput."""

    def figures(rs: Sequence[TurnRecord]) -> dict[str, Any]:
        ttft = [r.ttft for r in rs if r.ttft is not None]
        lat = [r.latency for r in rs]
        prompt = sum(r.prompt_tokens for r in rs)
        cached = sum(r.cached_tokens or 0 for r in rs)
        return {
            "requests": len(rs),
            "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99),
            "ttft_mean": statistics.fmean(ttft) if ttft else None,
            "latency_p50": percentile(lat, 50),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "prefill_tokens": prompt - cached,
            "hit_rate": cached / prompt if prompt else 0.0,
        }

    served = [r for r in records if r.ok]
    span = (
        max(r.started + r.latency for r in records) - min(r.started for r in records)
        if records
        else 0.0
    )
    later = [r for r in served if r.turn > 1]
    return {
        "requests": len(records),
        "served": len(served),
        "errors": sum(1 for r in records if r.error),
        "aborted": sum(1 for r in records if r.aborted),
        "seconds": span,
        "requests_per_s": len(served) / span if span else 0.0,
        "output_tokens_per_s": sum(len(r.output) for r in served) / span if span else 0.0,
        "all": figures(served),
        "first": figures([r for r in served if r.turn == 1]),
        "later": figures(later),
        "long": figures([r for r in later if r.prompt_tokens >= long_prompt]),
    }


def parse_range(text: str, name: str) -> tuple[int, int]:
    """``"4-6"`` or ``"5"`` as an inclusive range; ValueError naming ``name``."""
    lo, sep, hi = text.partition("-")
    try:
        low = int(lo)
        high = int(hi) if sep else low
    except ValueError:
        raise ValueError(f"{name} must be N or LOW-HIGH (e.g. 4-6), got {text!r}") from None
    if not 0 <= low <= high:
        raise ValueError(f"{name} must be an increasing range of non-negative integers: {text!r}")
    return low, high


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def render(summary: dict[str, Any]) -> str:
    """The summary of :func:`summarize` as a small table."""
    lines = [
        f"requests {summary['requests']}, served {summary['served']}, errors "
        f"{summary['errors']}, aborted {summary['aborted']} in {summary['seconds']:.1f} s "
        f"({summary['requests_per_s']:.2f} requests/s, "
        f"{summary['output_tokens_per_s']:.0f} output tokens/s)",
        f"{'turns':<14}{'n':>6}{'TTFT p50':>11}{'TTFT p99':>11}{'latency p50':>13}"
        f"{'prompt':>10}{'cached':>10}{'prefill':>10}{'hit rate':>10}",
    ]
    labels = {"first": "first", "later": "later", "long": "later, long"}
    for key, label in labels.items():
        f = summary[key]
        lines.append(
            f"{label:<14}{f['requests']:>6}{_seconds(f['ttft_p50']):>11}"
            f"{_seconds(f['ttft_p99']):>11}{_seconds(f['latency_p50']):>13}"
            f"{f['prompt_tokens']:>10}{f['cached_tokens']:>10}{f['prefill_tokens']:>10}"
            f"{f['hit_rate'] * 100:>9.1f}%"
        )
    return "\n".join(lines)


def main(
    url: str,
    workload: Workload,
    *,
    model: str | None,
    as_json: bool,
    records: str | None,
    long_prompt: int,
) -> int:
    """``lmcache-rc serve-bench``: runs ``workload`` against ``url``, with a
    progress line on stderr every few seconds, then prints the summary (or
    one JSON object); ``records`` also writes one JSON line per request."""
    import sys

    name = model or server_model(url)
    what = (
        f"{workload.duration:g} s"
        if workload.duration is not None
        else f"{workload.conversations} conversations"
    )
    print(
        f"serve-bench: {url} ({name}), {workload.users} users, {what} of "
        f"{workload.turns[0]}-{workload.turns[1]} turns",
        file=sys.stderr,
    )
    done = {"n": 0, "errors": 0, "last": time.monotonic()}

    def progress(rec: TurnRecord) -> None:
        done["n"] += 1
        done["errors"] += 1 if rec.error else 0
        now = time.monotonic()
        if now - done["last"] >= 5.0:
            done["last"] = now
            print(f"  {done['n']} requests, {done['errors']} errors", file=sys.stderr)

    got = run_load(url, workload, model=name, on_record=progress)
    summary = summarize(got, long_prompt=long_prompt)
    if records:
        with open(records, "w") as f:
            for rec in got:
                f.write(json.dumps(rec.to_json()) + "\n")
    if as_json:
        print(json.dumps({"url": url, "model": name, "workload": asdict(workload), **summary}))
    else:
        print(render(summary))
    return 0 if summary["errors"] == 0 else 1
