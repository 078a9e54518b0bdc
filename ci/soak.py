"""Soak benchmark (not run in CI; ``ci/soak.sh`` runs it): one ``lmcache-rc
serve`` sidecar with a small L1 (16 MiB), an L2 directory small enough that L2
eviction happens (64 MiB: a 4 KiB page is charged 8 KiB there, so it holds
twice the pages of L1, and the prompts name about 12,000 distinct pages) and a
durable index, driven for M minutes by N worker processes doing a seeded mix
of store / restore / find through the public ``lmcache_rc.Client``, an
"operator" process that clears about once a minute (``force=False`` and
``force=True`` in turn), and a SIGKILL of a random worker every 20-40 s
(restarted at once; the sidecar must take the killed process's leases back).

Why: every other test runs seconds; a leak of memory, descriptors or threads,
a lease never reclaimed or a page served with the wrong bytes after hours of
eviction, clearing and killing shows only in a long mixed run.

What passes (exit 0), and what fails (exit 1):

- wrong bytes == 0: every restore compares every byte of every page with the
  bytes the store wrote (a function of the page's content key, rank and group,
  so generations sharing a page agree on its bytes);
- errors == 0: an error is any exception, or a miss whose reason no healthy
  run gives (``lost_object``, ``l2_read_error``, ``directory_error``). Expected
  and counted, not errors: a clean miss (find miss; retrieve ``not_listed`` /
  ``retrieve_timeout`` / ``capacity``; store ``capacity`` / ``conflict`` /
  ``aborted_during_store`` / ``not_pending``), ``busy`` (retried), a ``begin``
  refused because an identical generation is pending or listed (or for
  ``max_pending``), a forced clear refused with ``LeasesLive`` (retried for up
  to 10 s, so that most forced clears do run under load). Each unexpected
  error is printed once with its type and message;
- after the workers stop, no lease is left (``store_leases``,
  ``retrieve_leases`` == 0): those of killed workers came back;
- flat resources of the sidecar between the middle sample (half-time, well
  after warm-up) and the end sample (just before the workers stop), read from
  ``/proc/<pid>/status`` and ``/proc/<pid>/fd``:
  RSS(end) <= RSS(mid) * 1.10 + 16 MiB, fds(end) <= fds(mid) + 16,
  threads(end) <= threads(mid) + 8 (a connection holds a thread and a
  descriptor, and a killed worker's replacement may be connecting while a
  sample is taken: the slack covers a few of those, not a steady growth).

It prints a line every minute and the full figures at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import lmcache_rc as rc

# One manifest builder with the RPC suites (tests_py/rpc_helpers.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests_py"))
from rpc_helpers import make_manifest

PAGE = 4096
WORLD = 2
BASES = 32
"""Base token sequences; every prompt is a prefix of one (so generations share
attention pages, content-addressed)."""
MAX_TOKENS = 1024
L1 = "16M"
L2 = "64M"
ABANDONED_AFTER = "10s"
RSS_RATIO = 1.10
RSS_SLACK = 16 << 20
FD_SLACK = 16
THREAD_SLACK = 8
EXPECTED_MISSES = {
    "not_listed",
    "retrieve_timeout",
    "capacity",
    "conflict",
    "aborted_during_store",
    "not_pending",
    "lease_budget",
}
"""Miss reasons a healthy run gives under this load (clean misses)."""


# --- pages and manifests (the pattern of tests_py/rpc_helpers.py) ---------


def namespace() -> str:
    """The one checkpoint namespace of the soak (4 KiB pages, tp=WORLD)."""
    return rc.checkpoint_namespace(
        {
            "target_revision": "t" * 40,
            "draft_revision": "",
            "source_revision": "s" * 40,
            "layout": {"page_bytes": PAGE},
            "parallel": {"tp": WORLD},
        }
    )


def tokens_of(base: int, n: int) -> list[int]:
    """The first ``n`` tokens of base sequence ``base`` (the same in every process)."""
    rng = random.Random(f"soak-base-{base}")
    return [rng.randrange(50_000) for _ in range(MAX_TOKENS)][:n]


def content_keys(m: rc.Manifest) -> list[list[str]]:
    """Each page group's content keys, in slot order."""
    return [list(g["content_keys"]) for g in m.page_groups()]


def page(key: str, rank: int, group: int) -> np.ndarray:
    """The bytes of one page: a function of its content key, rank and group
    (what makes the object), so every generation naming it expects the same."""
    digest = hashlib.sha256(f"{key}/{rank}/{group}".encode()).digest()
    seed = int.from_bytes(digest[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, PAGE, dtype=np.uint8)


# --- a worker --------------------------------------------------------------


class Tally:
    """A worker's counts, written to its own JSON file (atomically) about once
    a second and at once after an error or wrong bytes, so a SIGKILL loses at
    most a second of operation counts and never an error."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.counts: dict[str, int] = {}
        self.errors: dict[str, str] = {}
        self.last = 0.0

    def add(self, key: str, n: int = 1) -> None:
        """Count ``n`` of ``key``."""
        self.counts[key] = self.counts.get(key, 0) + n

    def error(self, where: str, exc: BaseException | str) -> None:
        """Count an unexpected error and keep its first message."""
        if isinstance(exc, BaseException):
            text = f"{where}: {type(exc).__name__}: {exc}"
        else:
            text = f"{where}: {exc}"
        self.add("errors")
        self.errors.setdefault(text, text)
        self.flush(force=True)

    def flush(self, force: bool = False) -> None:
        """Write the counts if a second passed (or ``force``)."""
        now = time.monotonic()
        if not force and now - self.last < 1.0:
            return
        self.last = now
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"counts": self.counts, "errors": sorted(self.errors)}))
        os.replace(tmp, self.path)


def miss(t: Tally, op: str, reason: str | None) -> None:
    """Count a miss by reason; an unexpected reason is an error."""
    t.add(f"{op}_miss:{reason}")
    if reason not in EXPECTED_MISSES:
        t.error(op, f"miss with reason {reason!r}")


def do_store(c: rc.Client, t: Tally, m: rc.Manifest) -> None:
    """begin, then each rank: prepare (retrying busy), copy, finish; an
    exception aborts the generation (as an engine would) before it counts."""
    if not c.begin(m):
        t.add("store_begin_refused")
        return
    try:
        store_ranks(c, t, m)
    except Exception:
        with contextlib.suppress(Exception):
            c.abort(m.generation)
        raise


def store_ranks(c: rc.Client, t: Tally, m: rc.Manifest) -> None:
    """Each rank of a begun generation: prepare (retrying busy), copy, finish."""
    keys = content_keys(m)
    for rank in range(WORLD):
        deadline = time.monotonic() + 30
        while (lease := c.prepare_store(m, rank)).status == "busy":
            t.add("store_busy")
            if time.monotonic() > deadline:
                t.error("store", "prepare_store stayed busy for 30 s")
                c.abort(m.generation)
                return
            time.sleep(0.002)
        if lease.status == "miss":
            miss(t, "store", lease.reason)
            return
        if lease.status != "ready" or lease.lease_id is None:
            t.error("store", f"prepare_store answered {lease.status} ({lease.reason})")
            return
        for g, arrays in enumerate(c.lease_arrays(lease)):
            for i, arr in enumerate(arrays):
                if arr is not None:
                    arr[:] = page(keys[g][i], rank, g)
        published = c.finish_store(lease.lease_id, True)
        if rank == WORLD - 1:
            t.add("store_published" if published else "store_finished_unpublished")
    t.add("store_done")


def do_restore(c: rc.Client, t: Tally, roots: rc.TokenRoots) -> None:
    """find, then each rank: begin, poll to ready, compare every byte, finish."""
    m = c.find(roots.roots)
    if m is None:
        t.add("restore_find_miss")
        return
    keys = content_keys(m)
    for rank in range(WORLD):
        lease = c.begin_retrieve(m, rank)
        deadline = time.monotonic() + 60
        while lease.status == "pending" and lease.lease_id is not None:
            if time.monotonic() > deadline:
                t.error("restore", "retrieve stayed pending for 60 s")
                c.cancel_retrieve(lease.lease_id)
                return
            time.sleep(0.002)
            lease = c.poll_retrieve(lease.lease_id)
        if lease.status == "miss":
            miss(t, "restore", lease.reason)
            return
        if lease.status != "ready" or lease.lease_id is None:
            t.error("restore", f"retrieve answered {lease.status} ({lease.reason})")
            return
        wrong = 0
        for g, arrays in enumerate(c.lease_arrays(lease)):
            for i, arr in enumerate(arrays):
                if (
                    arr is None
                    or arr.shape != (PAGE,)
                    or not np.array_equal(arr, page(keys[g][i], rank, g))
                ):
                    wrong += 1
        c.finish_retrieve(lease.lease_id)
        t.add("restore_pages", sum(len(k) for k in keys))
        if wrong:
            t.add("wrong_bytes", wrong)
            t.error("restore", f"{wrong} page(s) of {m.generation} rank {rank} had wrong bytes")
            return
    t.add("restore_hit")


def worker(socket: str, seed: int, out: Path, ops_file: Path) -> None:
    """Run the op mix until ``ops_file`` disappears (the stop signal)."""
    t = Tally(out)
    rng = random.Random(seed)
    ns = namespace()
    cache: dict[tuple[int, int], tuple[rc.Manifest, rc.TokenRoots]] = {}
    with rc.Client(socket) as c:
        while ops_file.exists():
            base = rng.randrange(BASES)
            n = rng.randrange(1, MAX_TOKENS // 16 + 1) * 16 - rng.choice([0, 0, 0, 5])
            if (base, n) not in cache:
                if len(cache) > 4096:
                    cache.clear()
                cache[(base, n)] = make_manifest(tokens_of(base, n), world=WORLD, namespace=ns)
            m, roots = cache[(base, n)]
            r = rng.random()
            op = "store" if r < 0.4 else "restore" if r < 0.85 else "find"
            t.add(f"op_{op}")
            try:
                if op == "store":
                    do_store(c, t, m)
                elif op == "restore":
                    do_restore(c, t, roots)
                else:
                    t.add("find_hit" if c.find(roots.roots) is not None else "find_miss")
            except Exception as exc:
                t.error(op, exc)
            t.flush()
    t.flush(force=True)


def operator(socket: str, seed: int, out: Path, ops_file: Path, period: float) -> None:
    """Clear about every ``period`` seconds, force=False and force=True in
    turn. A forced clear refused with ``LeasesLive`` (the workers nearly
    always hold a lease) is retried every 5 ms for up to 10 s, so that forced
    clears do happen in the middle of stores and restores."""
    t = Tally(out)
    rng = random.Random(seed)
    force = False
    next_at = time.monotonic() + rng.uniform(0.5, 1.5) * period
    with rc.Client(socket) as c:
        while ops_file.exists():
            time.sleep(0.2)
            if time.monotonic() < next_at:
                continue
            next_at = time.monotonic() + rng.uniform(0.5, 1.5) * period
            t.add("op_clear")
            give_up = time.monotonic() + 10
            while True:
                try:
                    report = c.clear(force=force)
                    t.add(f"clear_force_{force}")
                    t.add("clear_retired", report["retired_generations"])
                    t.add("clear_l1_objects", report["l1_objects"])
                    break
                except rc.errors.LeasesLive:
                    t.add("clear_refused_leases_live")
                    if time.monotonic() > give_up:
                        t.add("clear_forced_gave_up")
                        break
                    time.sleep(0.005)
                except Exception as exc:
                    t.error("clear", exc)
                    break
            force = not force
            t.flush(force=True)
    t.flush(force=True)


# --- the driver ------------------------------------------------------------


def proc_sample(pid: int) -> dict[str, int]:
    """RSS (bytes), open descriptors and threads of a process, from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return {
        "rss": int(fields["VmRSS"].split()[0]) * 1024,
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
    }


STATUS_KEYS = (
    "generations",
    "pending",
    "store_leases",
    "retrieve_leases",
    "pins",
    "l1_bytes",
    "l1_capacity",
    "l2_objects",
    "l2_bytes",
    "l2_capacity",
    "published",
    "hits",
    "evictions",
    "l1_evictions",
    "l2_evictions",
    "l2_loads",
    "l2_queue",
    "l2_bytes_written",
    "l2_skipped_full",
    "admission_timeouts",
    "clears",
    "abandoned_generations",
    "reclaimed_store_leases",
    "reclaimed_retrieve_leases",
    "l2_corrupt_or_missing",
    "l2_write_errors",
    "rpc_connections",
    "rpc_connections_total",
    "rpc_requests",
)


def merge(run: Path) -> tuple[dict[str, int], list[str]]:
    """The counts of every worker incarnation so far, and their distinct errors."""
    total: dict[str, int] = {}
    errors: set[str] = set()
    for f in sorted(run.glob("tally-*.json")):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for k, v in data["counts"].items():
            total[k] = total.get(k, 0) + v
        errors.update(data["errors"])
    return total, sorted(errors)


def summary(counts: dict[str, int]) -> str:
    """One line: operations by kind, restores hit/miss, errors, wrong bytes."""
    ops = " ".join(f"{k[3:]}={v}" for k, v in sorted(counts.items()) if k.startswith("op_"))
    rmiss = sum(v for k, v in counts.items() if k.startswith("restore_miss:")) + counts.get(
        "restore_find_miss", 0
    )
    return (
        f"ops[{ops}] restores hit={counts.get('restore_hit', 0)} miss={rmiss} "
        f"errors={counts.get('errors', 0)} wrong_bytes={counts.get('wrong_bytes', 0)}"
    )


def fmt_sample(s: dict[str, int]) -> str:
    """RSS in MiB, fds, threads."""
    return f"rss={s['rss'] / (1 << 20):.1f}MiB fds={s['fds']} threads={s['threads']}"


def main() -> int:
    """Start the sidecar, the workers, the operator and the killer; print and judge."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="a 1-minute smoke (kills every 5-10 s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the run directory")
    ap.add_argument("--role", choices=["worker", "operator"], help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--ops-file", help=argparse.SUPPRESS)
    ap.add_argument("--period", type=float, default=60.0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role == "worker":
        worker(a.socket, a.seed, Path(a.out), Path(a.ops_file))
        return 0
    if a.role == "operator":
        operator(a.socket, a.seed, Path(a.out), Path(a.ops_file), a.period)
        return 0

    minutes = 1.0 if a.quick else a.minutes
    kill_range = (5.0, 10.0) if a.quick else (20.0, 40.0)
    clear_period = 15.0 if a.quick else 60.0
    report_every = 15.0 if a.quick else 60.0
    rng = random.Random(a.seed)
    run = Path(tempfile.mkdtemp(prefix="lmcache-rc-soak-"))
    sock = str(run / "sidecar.sock")
    ops_file = run / "running"
    ops_file.touch()
    log = (run / "sidecar.log").open("w")
    print(
        f"soak: {a.workers} workers x {minutes:g} min, seed {a.seed}, L1 {L1}, L2 {L2}, "
        f"kill every {kill_range[0]:g}-{kill_range[1]:g} s, clear every ~{clear_period:g} s, "
        f"run dir {run}",
        flush=True,
    )
    sidecar = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lmcache_rc",
            "serve",
            "--socket",
            sock,
            "--l1-bytes",
            L1,
            "--l2-path",
            str(run / "l2"),
            "--l2-bytes",
            L2,
            "--checkpoint-index-path",
            str(run / "index.db"),
            "--abandoned-after",
            ABANDONED_AFTER,
            "--http-port",
            "-1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    incarnation = 0

    def spawn(role: str, slot: int) -> subprocess.Popen[bytes]:
        nonlocal incarnation
        incarnation += 1
        return subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--role",
                role,
                "--socket",
                sock,
                "--seed",
                str(a.seed * 1_000_003 + incarnation),
                "--out",
                str(run / f"tally-{role}{slot}-{incarnation}.json"),
                "--ops-file",
                str(ops_file),
                "--period",
                str(clear_period),
            ]
        )

    failures: list[str] = []
    try:
        deadline = time.monotonic() + 30
        client: rc.Client | None = None
        while client is None:
            if sidecar.poll() is not None:
                raise SystemExit(f"sidecar exited {sidecar.returncode}; log: {run / 'sidecar.log'}")
            try:
                client = rc.Client(sock, timeout=60)
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        samples: dict[str, dict[str, int]] = {"start": proc_sample(sidecar.pid)}
        statuses: dict[str, dict[str, Any]] = {}
        workers = [spawn("worker", i) for i in range(a.workers)]
        op = spawn("operator", 0)
        kills = 0
        t0 = time.monotonic()
        end = t0 + minutes * 60
        mid = t0 + minutes * 30
        next_kill = t0 + rng.uniform(*kill_range)
        next_report = t0 + report_every
        while (now := time.monotonic()) < end:
            time.sleep(0.2)
            if sidecar.poll() is not None:
                failures.append(f"sidecar exited {sidecar.returncode} during the run")
                break
            for i, w in enumerate(workers):
                if w.poll() is not None:
                    failures.append(f"worker {i} exited {w.returncode} (not killed)")
                    workers[i] = spawn("worker", i)
            if now >= next_kill and workers:
                i = rng.randrange(len(workers))
                workers[i].send_signal(signal.SIGKILL)
                workers[i].wait()
                kills += 1
                workers[i] = spawn("worker", i)
                next_kill = now + rng.uniform(*kill_range)
            if "mid" not in samples and now >= mid:
                samples["mid"] = proc_sample(sidecar.pid)
                statuses["mid"] = dict(client.status())
            if now >= next_report:
                next_report += report_every
                counts, _ = merge(run)
                st = client.status()
                print(
                    f"[{(now - t0) / 60:5.1f} min] {summary(counts)} kills={kills} "
                    f"{fmt_sample(proc_sample(sidecar.pid))} gens={st['generations']} "
                    f"l1={st['l1_bytes'] >> 20}MiB l2={st['l2_bytes'] >> 20}MiB "
                    f"evictions l1={st['l1_evictions']} l2={st['l2_evictions']}",
                    flush=True,
                )
        samples["end"] = proc_sample(sidecar.pid)
        statuses["end"] = dict(client.status())
        # Stop: the workers finish their operation and exit.
        ops_file.unlink()
        for i, w in enumerate([*workers, op]):
            try:
                rc_ = w.wait(timeout=60)
            except subprocess.TimeoutExpired:
                w.kill()
                failures.append(f"process {i} did not stop within 60 s")
                continue
            if rc_ != 0:
                failures.append(f"process {i} exited {rc_} at the stop")
        # Every lease must come back, the killed workers' ones included.
        settle = time.monotonic() + 15
        while True:
            st = client.status()
            if st["store_leases"] == 0 and st["retrieve_leases"] == 0:
                break
            if time.monotonic() > settle:
                failures.append(
                    f"leases left after the stop: store {st['store_leases']}, "
                    f"retrieve {st['retrieve_leases']}"
                )
                break
            time.sleep(0.5)
        statuses["stopped"] = dict(st)
        client.close()
        counts, errors = merge(run)

        print("\n== soak figures")
        print(f"duration: {minutes:g} min, workers: {a.workers}, seed: {a.seed}, kills: {kills}")
        print(
            "operations:",
            ", ".join(f"{k[3:]} {v}" for k, v in sorted(counts.items()) if k.startswith("op_")),
        )
        print("outcomes:")
        for k, v in sorted(counts.items()):
            if not k.startswith("op_"):
                print(f"  {k}: {v}")
        print(f"errors: {counts.get('errors', 0)}   wrong bytes: {counts.get('wrong_bytes', 0)}")
        for e in errors:
            print(f"  error: {e}")
        print("sidecar resources (RSS, open fds, threads):")
        for name in ("start", "mid", "end"):
            if name in samples:
                print(f"  {name:5}: {fmt_sample(samples[name])}")
        print("sidecar status (mid / end / after the stop):")
        for k in STATUS_KEYS:
            vals = [
                str(statuses[s].get(k, "-")) if s in statuses else "-"
                for s in ("mid", "end", "stopped")
            ]
            print(f"  {k}: {' / '.join(vals)}")
        if counts.get("errors", 0):
            failures.append(f"{counts['errors']} errors")
        if counts.get("wrong_bytes", 0):
            failures.append(f"{counts['wrong_bytes']} wrong pages")
        if "mid" in samples:
            m_, e_ = samples["mid"], samples["end"]
            if e_["rss"] > m_["rss"] * RSS_RATIO + RSS_SLACK:
                failures.append(f"RSS grew from {m_['rss']} to {e_['rss']} bytes")
            if e_["fds"] > m_["fds"] + FD_SLACK:
                failures.append(f"fds grew from {m_['fds']} to {e_['fds']}")
            if e_["threads"] > m_["threads"] + THREAD_SLACK:
                failures.append(f"threads grew from {m_['threads']} to {e_['threads']}")
    finally:
        with contextlib.suppress(FileNotFoundError):
            ops_file.unlink()
        sidecar.send_signal(signal.SIGTERM)
        try:
            code = sidecar.wait(timeout=60)
        except subprocess.TimeoutExpired:
            sidecar.kill()
            code = sidecar.wait()
        log.close()
    if code != 0:
        failures.append(f"sidecar exited {code} on SIGTERM (log: {run / 'sidecar.log'})")
    print("result:", "PASS" if not failures else "FAIL: " + "; ".join(failures))
    if failures or a.keep:
        print(f"run directory kept: {run}")
    else:
        shutil.rmtree(run, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
