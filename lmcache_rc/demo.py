"""``lmcache-rc demo``: a self-contained tour of the sidecar with the simulated engine.

What it does, end to end, on CPU only (no vLLM, no GPU, no downloads):

1. starts an embedded sidecar in a temporary directory, with a durable
   directory (SQLite) and an L2 (filesystem) tier, on a unique SHM pool name;
2. runs a multi-turn workload: ``requests`` conversations that share a system
   prompt, ``turns`` turns each (turn k+1's prompt = turn k's prompt + its
   response + new user tokens), on ``replicas`` simulated engines of
   ``world_size`` ranks each (separate processes with ``rank_mode="spawn"``).
   Consecutive turns of a conversation land on different replicas, as behind a
   load balancer, so a turn can only reuse the previous one through the sidecar;
3. prints one row per turn with figures measured during the run: prompt tokens,
   tokens restored from the sidecar / hit in the engine's own cache /
   recomputed, pages written vs reused (deltas of the sidecar's
   ``store_pages_new`` / ``store_pages_reused``), pages read from L2
   (``l2_loads``), restore latency, and whether the output equals a cold
   recomputation (``model.reference_generate``);
4. waits for the L2 queue to drain, stops the sidecar, starts a new one on the
   same directory and L2 path (new SHM pool: RAM is empty), and replays one
   more turn of every conversation on a fresh engine: those restores come from
   disk;
5. verifies byte-exactness: every rank compares every restored page with
   recomputation (a difference raises ``RestoreMismatch``) and every output is
   compared with the reference; any mismatch exits 1.

With ``socket`` (``--socket PATH``) it runs against an already running
sidecar instead and leaves that sidecar's other data alone: every request
carries a cache salt new at every run (``lmcache-rc-demo-<random>``), so the
run's checkpoints live in a namespace of their own; step 4 replays on a fresh
engine without a restart (the sidecar is not the demo's to stop); at the end,
and on failure, the run retires its namespace (``invalidate_namespace``), so
nothing it stored stays listed and its pages leave RAM and disk. Page and
byte figures are deltas of sidecar-wide counters, so traffic from other
clients during the run shows up in them. ``--keep`` and the corruption hook
are refused with ``socket``.

``LMCACHE_RC_DEMO_CORRUPT=1`` (test hook, hidden from ``--help``) flips one
byte of every page resident in the sidecar's shared-memory pool after the first
round of turns, so the next restore must be caught by the verification.

Exit codes: 0 verified, 1 mismatch or failure (clear message on stderr).
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np

import lmcache_rc as rc

__all__ = ["CORRUPT_ENV", "DemoError", "DemoOptions", "TurnRow", "run_demo"]

CORRUPT_ENV = "LMCACHE_RC_DEMO_CORRUPT"
"""Environment variable of the test-only corruption hook."""

RankMode = Literal["thread", "spawn", "forkserver"]

_SLOT = 4096  # the sidecar's L1 allocation unit (pages are rounded up to it)


class DemoError(RuntimeError):
    """The demo found a mismatch or the sidecar/engine misbehaved (exit 1)."""


@dataclass
class DemoOptions:
    """Knobs of :func:`run_demo` (the CLI flags)."""

    turns: int = 4
    requests: int = 3
    world_size: int = 2
    rank_mode: RankMode = "spawn"
    replicas: int = 2
    system_tokens: int = 64
    user_tokens: int = 12
    new_tokens: int = 8
    seed: int = 7
    keep: str | None = None
    socket: str | None = None
    """An already running sidecar to use instead of an embedded one."""
    json: bool = False
    corrupt: bool = False
    l1_bytes: int = 32 << 20
    timeout: float = 60.0

    def validate(self) -> None:
        """Raise ValueError on nonsensical values."""
        for name in ("turns", "requests", "world_size", "replicas", "user_tokens", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.system_tokens < 1:
            raise ValueError("system_tokens must be at least 1")
        if self.rank_mode not in ("thread", "spawn", "forkserver"):
            raise ValueError(f"unknown rank mode {self.rank_mode!r}")
        if self.socket is not None and self.keep is not None:
            raise ValueError("--keep cannot be combined with --socket (the sidecar owns its files)")
        if self.socket is not None and self.corrupt:
            raise ValueError(f"{CORRUPT_ENV} cannot be combined with --socket")


@dataclass
class TurnRow:
    """One request of the workload, with every figure measured during the run."""

    phase: str
    """``run`` (first sidecar) or ``replay`` (after the restart)."""
    request: str
    conversation: int
    turn: int
    """1-based turn number within the conversation."""
    replica: int
    prompt_tokens: int
    restored_tokens: int
    local_hit_tokens: int
    recomputed_tokens: int
    pages_new: int
    pages_reused: int
    l2_loads: int
    restore_ms: float | None
    turn_ms: float
    output_matches: bool


@dataclass
class _Totals:
    pages_verified: int = 0
    restores_verified: int = 0
    outputs_checked: int = 0
    outputs_matching: int = 0


@dataclass
class _Report:
    options: dict[str, Any]
    rows: list[TurnRow] = field(default_factory=list)
    phases: dict[str, Any] = field(default_factory=dict)
    totals: _Totals = field(default_factory=_Totals)


# ============================================================================ output


class _Printer:
    """Human-readable progress (stdout, or stderr with ``--json``)."""

    COLUMNS: tuple[tuple[str, int], ...] = (
        ("phase", 6),
        ("request", 8),
        ("turn", 4),
        ("replica", 7),
        ("prompt", 6),
        ("restored", 8),
        ("local", 5),
        ("recomputed", 10),
        ("pages new", 9),
        ("reused", 6),
        ("L2 reads", 8),
        ("restore ms", 10),
        ("turn ms", 7),
        ("output", 8),
    )

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def line(self, text: str = "") -> None:
        print(text, file=self.stream, flush=True)

    def header(self) -> None:
        cells = [
            f"{name:>{w}}" if i > 1 else f"{name:<{w}}" for i, (name, w) in enumerate(self.COLUMNS)
        ]
        self.line("  " + "  ".join(cells))
        self.line("  " + "  ".join("-" * w for _, w in self.COLUMNS))

    def row(self, r: TurnRow) -> None:
        values: list[str] = [
            r.phase,
            r.request,
            str(r.turn),
            str(r.replica),
            str(r.prompt_tokens),
            str(r.restored_tokens),
            str(r.local_hit_tokens),
            str(r.recomputed_tokens),
            str(r.pages_new),
            str(r.pages_reused),
            str(r.l2_loads),
            "-" if r.restore_ms is None else f"{r.restore_ms:.1f}",
            f"{r.turn_ms:.1f}",
            "= ref" if r.output_matches else "MISMATCH",
        ]
        cells = [
            f"{v:>{w}}" if i > 1 else f"{v:<{w}}"
            for i, (v, (_, w)) in enumerate(zip(values, self.COLUMNS, strict=True))
        ]
        self.line("  " + "  ".join(cells))


# ============================================================================ helpers


def _delta(after: Mapping[str, Any], before: Mapping[str, Any], key: str) -> int:
    """Difference of a cumulative sidecar counter (absent counters are 0)."""
    return int(after.get(key, 0)) - int(before.get(key, 0))


def _wait_for(
    client: rc.Client, predicate: Callable[[dict[str, Any]], bool], timeout: float
) -> dict[str, Any]:
    """Poll the sidecar status until ``predicate`` holds; DemoError on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        status = dict(client.status())
        if predicate(status):
            return status
        if time.monotonic() > deadline:
            raise DemoError(f"sidecar did not settle in {timeout:.0f}s: {status}")
        time.sleep(0.01)


def _idle(status: Mapping[str, Any]) -> bool:
    return all(
        int(status.get(k, 0)) == 0 for k in ("store_leases", "retrieve_leases", "pins", "pending")
    )


def _corrupt_pool(client: rc.Client, pool_size: int) -> int:
    """Flip one byte in every occupied slot of the sidecar's SHM pool (test hook),
    through the client's own mapping of the pool it was handed.

    Returns the number of slots changed. Occupied = any non-zero byte (the toy
    model's pages are hash expansions, never all zero).
    """
    pool = client.slot_array(0, pool_size)
    slots = pool[: len(pool) - len(pool) % _SLOT].reshape(-1, _SLOT)
    occupied = np.flatnonzero(slots.any(axis=1))
    for i in occupied:
        slots[i, 0] ^= 0xFF
    del slots, pool
    return len(occupied)


def _namespace_of(engine: Any, cache_salt: str) -> str:
    """The checkpoint namespace ``engine``'s connector gives requests with
    ``cache_salt`` (from its scheduler side, boundary or upstream mode)."""
    connector = engine.connector
    side = connector.bridge if connector.bridge is not None else connector.upstream
    if side is None:
        raise DemoError("the engine's connector has no scheduler side to name its namespace")
    return str(side.namespace(cache_salt))


class _Workload:
    """Deterministic token streams: a shared system prompt and per-turn user tokens."""

    def __init__(self, opts: DemoOptions, vocab: int) -> None:
        self.opts = opts
        self.vocab = vocab
        rng = random.Random(opts.seed)
        self.system = [rng.randrange(1, vocab) for _ in range(opts.system_tokens)]

    def user(self, conversation: int, turn: int) -> list[int]:
        rng = random.Random(f"{self.opts.seed}/{conversation}/{turn}")
        return [rng.randrange(1, self.vocab) for _ in range(self.opts.user_tokens)]


# ============================================================================ the demo


class _Demo:
    def __init__(self, opts: DemoOptions, out: _Printer) -> None:
        self.opts = opts
        self.out = out
        self.report = _Report(options=asdict(opts))
        self.engines: list[Any] = []
        self.server: rc.Server | None = None
        self.client: rc.Client | None = None
        self.started = time.perf_counter()
        # --socket: a namespace of the run's own (a fresh cache salt), retired at the end
        self.salt: str | None = (
            f"lmcache-rc-demo-{uuid.uuid4().hex}" if opts.socket is not None else None
        )
        self.namespace: str | None = None
        self.work: _Workload | None = None

    # ---------------------------------------------------------------- plumbing
    def elapsed(self) -> str:
        return f"[{time.perf_counter() - self.started:5.1f}s]"

    def start_server(self, config: rc.ServerConfig) -> rc.Client:
        self.server = rc.Server.start(config)
        self.client = rc.Client(self.server.socket_path)
        return self.client

    def stop_server(self) -> dict[str, Any]:
        report: dict[str, Any] = {}
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.server is not None:
            report = dict(self.server.stop(timeout=10.0))
            self.server = None
        return report

    def make_engine(self, socket: str) -> Any:
        from lmcache_rc.testing import SimEngine

        engine = SimEngine(socket, world_size=self.opts.world_size, rank_mode=self.opts.rank_mode)
        self.engines.append(engine)
        return engine

    def close_engines(self) -> None:
        engines, self.engines = self.engines, []
        first: BaseException | None = None
        for engine in engines:
            try:
                engine.close()
            except BaseException as e:  # closing every engine matters more
                first = first or e
        if first is not None:
            raise first

    def retire_namespace(self) -> int:
        """--socket: retires the run's namespace on the sidecar (its
        generations; their pages go once nothing holds them)."""
        if self.client is None or self.namespace is None:
            return 0
        return int(self.client.invalidate_namespace(self.namespace))

    def cleanup(self) -> None:
        """Best effort after a failure: engines, the run's namespace (with
        --socket), then the sidecar (or the connection to it)."""
        try:
            self.close_engines()
        except BaseException:
            pass
        try:
            self.retire_namespace()
        except BaseException:
            pass
        try:
            self.stop_server()
        except BaseException:
            pass

    # ---------------------------------------------------------------- one turn
    def turn(
        self,
        engine: Any,
        phase: str,
        conversation: int,
        turn: int,
        replica: int,
        prompt: list[int],
        system_len: int,
    ) -> tuple[TurnRow, list[int]]:
        assert self.client is not None
        from lmcache_rc.testing import RankError, RestoreMismatch

        rid = f"c{conversation}-t{turn + 1}"
        before = dict(self.client.status())
        verified_before = engine.stats.pages_verified, engine.stats.restores_verified
        t0 = time.perf_counter()
        try:
            engine.add_request(
                rid,
                prompt,
                self.opts.new_tokens,
                cache_salt=self.salt,
                instruction_boundary=system_len,
            )
            result = engine.result(rid)
            engine.run_until(lambda: result.admitted_step is not None, timeout=self.opts.timeout)
            t_admit = time.perf_counter()
            if self.salt is not None and self.namespace is None:
                # known once the layout is negotiated, before anything is stored
                self.namespace = _namespace_of(engine, self.salt)
            engine.run_until(lambda: result.finished, timeout=self.opts.timeout)
            t_done = time.perf_counter()
            engine.run_until_idle(timeout=self.opts.timeout)  # stores drained too
        except (RankError, RestoreMismatch) as exc:
            detail = str(getattr(exc, "message", exc)).strip()
            if isinstance(exc, RestoreMismatch) or "RestoreMismatch" in detail:
                raise DemoError(
                    f"request {rid}: restored checkpoint differs from recomputation: {detail}"
                ) from exc
            raise DemoError(f"request {rid}: a rank failed: {detail}") from exc
        problems = engine.idle_problems()
        if problems:
            raise DemoError(f"request {rid}: engine not idle afterwards: {'; '.join(problems)}")
        after = dict(self.client.status())
        expected = engine.model.reference_generate(prompt, self.opts.new_tokens)
        matches = list(result.output_tokens) == list(expected)
        totals = self.report.totals
        totals.pages_verified += engine.stats.pages_verified - verified_before[0]
        totals.restores_verified += engine.stats.restores_verified - verified_before[1]
        totals.outputs_checked += 1
        totals.outputs_matching += int(matches)
        row = TurnRow(
            phase=phase,
            request=rid,
            conversation=conversation,
            turn=turn + 1,
            replica=replica,
            prompt_tokens=len(prompt),
            restored_tokens=result.restored_tokens,
            local_hit_tokens=result.local_hit_tokens - result.restored_tokens,
            recomputed_tokens=result.recomputed_tokens,
            pages_new=_delta(after, before, "store_pages_new"),
            pages_reused=_delta(after, before, "store_pages_reused"),
            l2_loads=_delta(after, before, "l2_loads"),
            restore_ms=(t_admit - t0) * 1e3 if result.restored_tokens else None,
            turn_ms=(t_done - t0) * 1e3,
            output_matches=matches,
        )
        self.report.rows.append(row)
        self.out.row(row)
        if not matches:
            raise DemoError(
                f"request {rid}: output {result.output_tokens} differs from the cold "
                f"recomputation {expected}"
            )
        return row, list(result.output_tokens)

    # ---------------------------------------------------------------- phases
    def workload(self, socket: str, client: rc.Client, caps: Mapping[str, Any]) -> list[list[int]]:
        """Step 2: the multi-turn workload on the replicas; returns each
        conversation's history (last prompt + response)."""
        opts, out = self.opts, self.out
        out.line(
            f"{self.elapsed()} starting {opts.replicas} engine replica(s) x "
            f"{opts.world_size} rank(s) ({opts.rank_mode})"
        )
        replicas = [self.make_engine(socket) for _ in range(opts.replicas)]
        work = _Workload(opts, replicas[0].geometry.vocab_size)
        self.work = work
        system_len = len(work.system)
        out.line(
            f"{self.elapsed()} {opts.requests} conversation(s) x {opts.turns} turn(s): "
            f"shared system prompt {system_len} tokens, +{opts.user_tokens} user tokens "
            f"per turn,\n  {opts.new_tokens} new tokens per response; turn k of "
            f"conversation c runs on replica (c + k) mod {opts.replicas}"
        )
        out.line(
            "  restored = tokens restored from the sidecar; local = hit in the engine's own "
            "cache;\n  pages new/reused = checkpoint pages written / deduplicated by the sidecar; "
            "L2 reads = pages\n  loaded from disk; restore ms = request submitted -> admitted "
            "with its restored pages;\n  output = equals a cold recomputation"
        )
        out.line()
        out.header()
        history: list[list[int]] = [[] for _ in range(opts.requests)]
        for t in range(opts.turns):
            for c in range(opts.requests):
                replica = (c + t) % opts.replicas
                base = history[c] if history[c] else list(work.system)
                prompt = base + work.user(c, t)
                _, output = self.turn(replicas[replica], "run", c, t, replica, prompt, system_len)
                history[c] = prompt + output
            if t == 0 and opts.corrupt:
                n = _corrupt_pool(client, int(caps["pool_size"]))
                out.line(f"  !! {CORRUPT_ENV}: flipped one byte in each of {n} resident pages")
        out.line()
        return history

    def replay(self, socket: str, history: list[list[int]]) -> list[TurnRow]:
        """Step 4: one more turn of every conversation on a fresh engine."""
        opts, out = self.opts, self.out
        engine = self.make_engine(socket)
        out.line()
        out.header()
        rows: list[TurnRow] = []
        work = self.work
        if work is None:
            raise DemoError("replay before the workload")
        system_len = len(work.system)
        for c in range(opts.requests):
            prompt = history[c] + work.user(c, opts.turns)
            row, _ = self.turn(engine, "replay", c, opts.turns, 0, prompt, system_len)
            rows.append(row)
        out.line()
        return rows

    def first_phase(
        self, drained: Mapping[str, Any], baseline: Mapping[str, Any]
    ) -> dict[str, int]:
        """The sidecar after the workload: gauges as they are, counters as
        deltas since the run began."""
        first = {
            k: int(drained.get(k, 0))
            for k in ("generations", "l1_objects", "l2_objects", "l2_bytes")
        }
        for k in (
            "l2_bytes_written",
            "store_pages_new",
            "store_pages_reused",
            "store_bytes_committed",
        ):
            first[k] = _delta(drained, baseline, k)
        return first

    def run(self, workdir: Path, socket_dir: Path) -> dict[str, Any]:
        opts, out = self.opts, self.out
        if opts.socket is not None:
            return self.run_attached(opts.socket)
        socket = str(socket_dir / "sidecar.sock")
        index = workdir / "checkpoints.sqlite"
        l2 = workdir / "l2"

        def config() -> rc.ServerConfig:
            return rc.ServerConfig(
                socket=socket,
                l1_bytes=opts.l1_bytes,
                checkpoint_index_path=str(index),
                l2_path=str(l2),
                http_port=-1,
            )

        # 1. the sidecar
        cfg = config()
        out.line(f"{self.elapsed()} starting the sidecar")
        client = self.start_server(cfg)
        caps = client.capabilities()
        baseline = dict(client.status())
        out.line(f"  socket     {socket}")
        out.line(f"  shm pool   memfd {caps['pool_id']} ({caps['pool_size'] >> 20} MiB)")
        out.line(f"  directory  {index} (durable: {bool(caps['durable_index'])})")
        out.line(f"  l2         {l2}")
        self.report.phases["sidecar"] = {
            "socket": socket,
            "pool_id": caps["pool_id"],
            "pool_size": caps["pool_size"],
            "checkpoint_index_path": str(index),
            "l2_path": str(l2),
        }

        # 2. the workload
        history = self.workload(socket, client, caps)

        # 3. drain L2, stop, restart
        out.line(f"{self.elapsed()} waiting for the L2 queue to drain")
        drained = _wait_for(
            client, lambda s: int(s.get("l2_queue", 0)) == 0 and _idle(s), opts.timeout
        )
        first = self.first_phase(drained, baseline)
        self.report.phases["before_restart"] = first
        out.line(
            f"  {first['generations']} generations listed, {first['l2_objects']} L2 objects "
            f"({first['l2_bytes']} bytes) durable"
        )
        self.close_engines()
        stop = self.stop_server()
        out.line(
            f"{self.elapsed()} sidecar stopped (drained: {stop.get('drained')}, "
            f"live leases: {stop.get('live_leases')})"
        )
        client = self.start_server(config())
        restarted = client.status()
        new_pool = client.capabilities()["pool_id"]
        self.report.phases["after_restart"] = {
            "pool_id": new_pool,
            "generations": restarted["generations"],
            "l1_objects": restarted["l1_objects"],
            "l2_objects": restarted["l2_objects"],
            "restart_retired": restarted["restart_retired"],
        }
        out.line(
            f"{self.elapsed()} sidecar restarted on the same directory and L2 path "
            f"(new pool memfd {new_pool}): {restarted['generations']} generations "
            f"listed, {restarted['l1_objects']} objects in RAM, "
            f"{restarted['l2_objects']} on disk"
        )

        # 4. replay on a fresh engine
        out.line(f"{self.elapsed()} replaying one turn per conversation on a fresh engine")
        replay_rows = self.replay(socket, history)
        final = _wait_for(
            client, lambda s: int(s.get("l2_queue", 0)) == 0 and _idle(s), opts.timeout
        )
        self.close_engines()
        if not _idle(final):
            raise DemoError(f"sidecar not idle at the end: {final}")
        stop2 = self.stop_server()
        return self.summary(first, replay_rows, final, stop2)

    def run_attached(self, socket: str) -> dict[str, Any]:
        """--socket: the workload and a replay against a running sidecar,
        in the run's own namespace, which is retired at the end."""
        out = self.out
        out.line(f"{self.elapsed()} connecting to the sidecar at {socket}")
        try:
            client = rc.Client(socket)
            caps = client.capabilities()
        except (OSError, rc.errors.CheckpointError) as exc:
            raise DemoError(f"cannot reach a sidecar at {socket}: {exc}") from exc
        self.client = client
        baseline = dict(client.status())
        out.line(f"  shm pool   memfd {caps['pool_id']} ({caps['pool_size'] >> 20} MiB)")
        out.line(f"  directory  durable: {bool(caps['durable_index'])}")
        out.line(f"  cache salt {self.salt} (a namespace of this run's own, retired at the end)")
        self.report.phases["sidecar"] = {
            "socket": socket,
            "pool_id": caps["pool_id"],
            "pool_size": caps["pool_size"],
            "cache_salt": self.salt,
        }
        history = self.workload(socket, client, caps)
        drained = dict(client.status())
        first = self.first_phase(drained, baseline)
        self.report.phases["before_replay"] = first
        out.line(
            f"{self.elapsed()} replaying one turn per conversation on a fresh engine "
            "(same sidecar, no restart)"
        )
        replay_rows = self.replay(socket, history)
        self.close_engines()
        retired = self.retire_namespace()
        self.namespace, namespace = None, self.namespace
        final = dict(client.status())
        self.report.phases["cleanup"] = {"namespace": namespace, "retired_generations": retired}
        out.line(
            f"{self.elapsed()} retired this run's namespace: {retired} generation(s); "
            f"the sidecar's other data is untouched"
        )
        self.stop_server()
        return self.summary(first, replay_rows, final, {})

    def summary(
        self,
        first: Mapping[str, int],
        replay_rows: list[TurnRow],
        final: Mapping[str, Any],
        stop: Mapping[str, Any],
    ) -> dict[str, Any]:
        rows = self.report.rows
        run_rows = [r for r in rows if r.phase == "run"]
        later = [r for r in run_rows if r.turn > 1]
        new = first["store_pages_new"]
        reused = first["store_pages_reused"]
        totals = self.report.totals
        summary: dict[str, Any] = {
            "requests": len(rows),
            "prompt_tokens": sum(r.prompt_tokens for r in rows),
            "restored_tokens": sum(r.restored_tokens for r in rows),
            "local_hit_tokens": sum(r.local_hit_tokens for r in rows),
            "recomputed_tokens": sum(r.recomputed_tokens for r in rows),
            "later_turn_restored_tokens": sum(r.restored_tokens for r in later),
            "later_turn_recomputed_tokens": sum(r.recomputed_tokens for r in later),
            "replay_restored_tokens": sum(r.restored_tokens for r in replay_rows),
            "replay_l2_loads": sum(r.l2_loads for r in replay_rows),
            "pages_new": new,
            "pages_reused": reused,
            "dedup_ratio": (new + reused) / new if new else None,
            "store_bytes_committed": first["store_bytes_committed"],
            "l2_bytes_written": first["l2_bytes_written"],
            "l2_bytes": first["l2_bytes"],
            "pages_verified": totals.pages_verified,
            "restores_verified": totals.restores_verified,
            "outputs_checked": totals.outputs_checked,
            "outputs_matching": totals.outputs_matching,
            "byte_exact": totals.outputs_matching == totals.outputs_checked,
            "sidecar_final": {
                k: int(final.get(k, 0))
                for k in ("store_leases", "retrieve_leases", "pins", "pending", "l2_queue")
            },
            "sidecar_stop": dict(stop),
            "restarted": self.opts.socket is None,
            "cleanup": self.report.phases.get("cleanup"),
            "elapsed_s": round(time.perf_counter() - self.started, 2),
        }
        return summary


def _print_summary(out: _Printer, s: Mapping[str, Any]) -> None:
    total = s["prompt_tokens"]

    def pct(n: int) -> str:
        return f"{100 * n / total:.0f}%" if total else "-"

    ratio = "n/a" if s["dedup_ratio"] is None else f"{s['dedup_ratio']:.2f}x"
    fin = s["sidecar_final"]
    out.line("summary")
    out.line(
        f"  prompt tokens      {total} over {s['requests']} requests: restored "
        f"{s['restored_tokens']} ({pct(s['restored_tokens'])}), local cache "
        f"{s['local_hit_tokens']} ({pct(s['local_hit_tokens'])}), recomputed "
        f"{s['recomputed_tokens']} ({pct(s['recomputed_tokens'])})"
    )
    out.line(
        f"  later turns        restored {s['later_turn_restored_tokens']} tokens, "
        f"recomputed {s['later_turn_recomputed_tokens']}"
    )
    replay = "after restart     " if s["restarted"] else "replay (no restart)"
    out.line(
        f"  {replay} restored {s['replay_restored_tokens']} tokens, "
        f"{s['replay_l2_loads']} pages read from L2"
    )
    out.line(
        f"  pages              {s['pages_new'] + s['pages_reused']} stored by checkpoints, "
        f"{s['pages_new']} written, {s['pages_reused']} reused: dedup ratio {ratio}"
    )
    out.line(
        f"  bytes              {s['store_bytes_committed']} committed to RAM, "
        f"{s['l2_bytes_written']} written to L2 ({s['l2_bytes']} on disk)"
    )
    out.line(
        f"  verification       byte-exact: {s['restores_verified']} rank restores "
        "(sidecar and local), "
        f"{s['pages_verified']} restored pages compared with recomputation; "
        f"{s['outputs_matching']}/{s['outputs_checked']} outputs equal the reference"
    )
    out.line(
        f"  sidecar idle       {fin['store_leases']} store leases, {fin['retrieve_leases']} "
        f"retrieve leases, {fin['pins']} pins, {fin['pending']} pending, "
        f"L2 queue {fin['l2_queue']}"
    )
    if s["cleanup"] is not None:
        out.line(
            f"  cleanup            namespace {s['cleanup']['namespace']}: "
            f"{s['cleanup']['retired_generations']} generations retired"
        )
    out.line(f"  elapsed            {s['elapsed_s']:.1f}s")


def run_demo(opts: DemoOptions, stdout: TextIO | None = None) -> int:
    """Run the demo; returns the process exit code (0 verified, 1 mismatch/failure)."""
    opts.validate()
    stdout = stdout or sys.stdout
    out = _Printer(sys.stderr if opts.json else stdout)
    demo = _Demo(opts, out)
    socket_dir = Path(tempfile.mkdtemp(prefix="lmrc-demo-"))  # short: socket path limit
    if opts.keep:
        workdir = Path(opts.keep).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = socket_dir
    if opts.socket is not None:
        out.line(f"lmcache-rc {rc.__version__} demo (sidecar at {opts.socket})")
    else:
        out.line(f"lmcache-rc {rc.__version__} demo (work directory {workdir})")
    if opts.socket is None and (workdir / "checkpoints.sqlite").exists():
        out.line("  note: the directory already holds checkpoints; they are reused")
    code = 0
    try:
        summary = demo.run(workdir, socket_dir)
    except DemoError as exc:
        demo.cleanup()
        message = f"lmcache-rc demo: FAILED: {exc}"
        print(message, file=sys.stderr, flush=True)
        if opts.json:
            document = _document(demo.report, None, ok=False, error=str(exc))
            print(json.dumps(document, sort_keys=True), file=stdout, flush=True)
        code = 1
    except BaseException:
        demo.cleanup()
        raise
    else:
        _print_summary(out, summary)
        if opts.json:
            document = _document(demo.report, summary, ok=True, error=None)
            print(json.dumps(document, sort_keys=True), file=stdout, flush=True)
        else:
            out.line("demo OK")
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
        if opts.keep:
            out.line(f"kept {workdir} (checkpoints.sqlite, l2/)")
    return code


def _document(
    report: _Report, summary: Mapping[str, Any] | None, *, ok: bool, error: str | None
) -> dict[str, Any]:
    return {
        "ok": ok,
        "error": error,
        "options": report.options,
        "turns": [asdict(r) for r in report.rows],
        "phases": report.phases,
        "summary": dict(summary) if summary is not None else None,
    }
