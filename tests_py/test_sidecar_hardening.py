"""Hardening at the level a user meets it (issue: "no crash, dead worker or
second server can corrupt, wedge or wipe the sidecar"):

* a second ``lmcache-rc serve`` on a live socket refuses to start and the
  first keeps serving the right bytes; two sidecars given the same (old,
  now ignored) ``--shm-name`` never share a pool;
* the pool is an anonymous memfd: nothing in /dev/shm, before or after a
  SIGKILL of the sidecar;
* a worker process SIGKILLed while it holds a store lease and an exposed
  retrieve lease gives them back within a second (store aborted, readers
  released), its respawned rank stores the same content, a forced clear
  succeeds; and the same at random points of store and restore, round after
  round, with 2 and 4 ranks.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rpc_helpers import config, make_manifest, restore_rank, store_rank
from sidecar_helpers import start_sidecar
from transfer_helpers import LAYOUT, hold_leases, rank_process, rank_server

import lmcache_rc as rc

#: How soon a dead worker's leases must be back (they take milliseconds).
RECLAIM_WITHIN = 1.0


def idle(status: dict[str, Any]) -> bool:
    return all(status[k] == 0 for k in ("store_leases", "retrieve_leases", "pins", "pending"))


def wait_idle(status: Any, bound: float) -> float:
    """Polls ``status()`` until the idle invariant holds; returns how long
    that took, failing after ``bound`` seconds."""
    start = time.monotonic()
    while not idle(s := status()):
        took = time.monotonic() - start
        assert took < bound, f"not idle {took:.3f} s later: {s}"
        time.sleep(0.005)
    return time.monotonic() - start


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


# ---------------------------------------------------------------------------
# Second servers


def test_a_second_sidecar_on_a_live_socket_refuses_and_the_first_keeps_serving(
    tmp_path: Path,
) -> None:
    first, _ = start_sidecar(tmp_path)
    socket = str(tmp_path / "side.sock")
    try:
        client = rc.Client(socket)
        pool = client.capabilities()["pool_id"]
        m, roots = make_manifest(list(range(64)), world=2)
        assert client.begin(m)
        assert store_rank(client, m, 0) is False and store_rank(client, m, 1) is True
        second = subprocess.run(
            [sys.executable, "-m", "lmcache_rc", "serve", "--socket", socket, "--l1-bytes", "8M"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 1, second.stdout + second.stderr
        assert "another lmcache-rc server is running" in second.stderr, second.stderr
        # The first never noticed: same pool, same generations, right bytes.
        assert client.capabilities()["pool_id"] == pool
        assert client.find(roots.roots) == m
        assert restore_rank(client, m, 0) and restore_rank(client, m, 1)
        m2, _ = make_manifest(list(range(500, 580)), world=1)
        assert client.begin(m2) and store_rank(client, m2, 0)
        assert restore_rank(client, m2, 0)
        assert idle(client.status())
        client.close()
    finally:
        stop(first)


def test_two_sidecars_given_the_same_old_shm_name_never_share_a_pool(tmp_path: Path) -> None:
    old_name = f"lmrc-hardening-{os.getpid()}-{time.monotonic_ns()}"
    a, lines_a = start_sidecar(tmp_path, "--shm-name", old_name, name="a")
    b, lines_b = start_sidecar(tmp_path, "--shm-name", old_name, name="b")
    try:
        for lines in (lines_a, lines_b):
            assert any("deprecated and ignored" in line for line in lines), lines
        assert not Path("/dev/shm", old_name).exists(), "the old name creates nothing"
        ca, cb = rc.Client(str(tmp_path / "a.sock")), rc.Client(str(tmp_path / "b.sock"))
        assert ca.capabilities()["pool_id"] != cb.capabilities()["pool_id"]
        # The same generation stored in both with its own bytes per server
        # (rank r of server b stores rank 1-r's bytes): each restores its own.
        m, _ = make_manifest(list(range(48)), world=2)
        assert ca.begin(m) and cb.begin(m)
        for rank in (0, 1):
            store_rank(ca, m, rank)
        for rank in (0, 1):
            store_rank(cb, m, rank)
        assert restore_rank(ca, m, 0) and restore_rank(ca, m, 1)
        assert restore_rank(cb, m, 0) and restore_rank(cb, m, 1)
        # A store made on one is never seen through the other's pool.
        m2, roots2 = make_manifest(list(range(900, 960)), world=1)
        assert ca.begin(m2) and store_rank(ca, m2, 0)
        assert cb.find(roots2.roots) is None
        assert restore_rank(ca, m2, 0)
        ca.close()
        cb.close()
    finally:
        stop(a)
        stop(b)


# ---------------------------------------------------------------------------
# Nothing in /dev/shm


def test_a_sigkilled_sidecar_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    old_name = f"lmrc-hardening-kill-{os.getpid()}-{time.monotonic_ns()}"
    proc, _ = start_sidecar(tmp_path, "--shm-name", old_name)
    try:
        socket = str(tmp_path / "side.sock")
        client = rc.Client(socket)
        pool = client.capabilities()["pool_id"]
        m, _ = make_manifest(list(range(40)), world=1)
        assert client.begin(m) and store_rank(client, m, 0)
        # Everything the sidecar maps or holds open: the pool is an anonymous
        # memfd, nothing is a file in /dev/shm (which outlives a SIGKILL).
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "/memfd:lmcache-rc-l1" in maps, "the pool is an anonymous memfd"
        assert "/dev/shm/" not in maps, "nothing of the sidecar is named in /dev/shm"
        fds = []
        for f in Path(f"/proc/{proc.pid}/fd").iterdir():
            try:
                fds.append(os.readlink(f))
            except FileNotFoundError:
                pass  # closed since the listing (a connection, a log write)
        assert not [f for f in fds if f.startswith("/dev/shm/")], fds
    except BaseException:
        proc.kill()  # a failed check must not leave the sidecar running
        raise
    proc.kill()
    proc.wait(timeout=60)
    assert not Path("/dev/shm", old_name).exists()
    assert not list(Path("/dev/shm").glob(f"*{pool}*"))
    # Its stale socket and lock are replaced by the next start.
    again, _ = start_sidecar(tmp_path)
    try:
        caps = client.capabilities()
        assert caps["pool_id"] != pool
        client.close()
    finally:
        stop(again)


# ---------------------------------------------------------------------------
# Dead workers


@pytest.fixture
def server(tmp_path: Path) -> Iterator[rc.Server]:
    with rc.Server.start(config(tmp_path, l1_bytes=16 << 20, http_port=-1)) as srv:
        yield srv


def test_a_sigkilled_worker_gives_back_its_store_and_retrieve_leases_within_a_second(
    server: rc.Server,
) -> None:
    socket = server.socket_path
    client = rc.Client(socket)
    storing, _ = make_manifest(list(range(2000, 2064)), world=2, layout=LAYOUT)
    restoring, _ = make_manifest(list(range(3000, 3048)), world=2, layout=LAYOUT)
    ctx = multiprocessing.get_context("spawn")
    assert client.begin(restoring)
    with ctx.Pool(2) as ranks:
        stored = ranks.starmap(rank_process, [(socket, [restoring], r, "STORE") for r in range(2)])
        assert [ok for ok, _ in stored] == [{"STORE-0": True}] * 2
    assert client.begin(storing)
    worker = ctx.Process(target=hold_leases, args=(socket, storing, restoring))
    worker.start()
    deadline = time.monotonic() + 60
    while (s := client.status())["retrieve_leases"] < 1 or s["store_leases"] < 1:
        assert worker.is_alive() and time.monotonic() < deadline, s
        time.sleep(0.01)
    assert (s["store_leases"], s["retrieve_leases"], s["pending"]) == (1, 1, 1) and s["pins"] > 0
    # As before this fix: a forced clear is refused while the worker holds them.
    with pytest.raises(rc.errors.LeasesLive):
        client.clear(force=True)
    worker.kill()
    worker.join()
    took = wait_idle(client.status, RECLAIM_WITHIN)
    print(f"reclaimed {took * 1000:.1f} ms after the kill")
    s = client.status()
    assert s["reclaimed_store_leases"] == 1 and s["reclaimed_retrieve_leases"] == 1
    # The respawned rank stores the same content (with its peer rank).
    assert client.begin(storing)
    with ctx.Pool(2) as ranks:
        stored = ranks.starmap(rank_process, [(socket, [storing], r, "STORE") for r in range(2)])
        assert [ok for ok, _ in stored] == [{"STORE-0": True}] * 2
        restored = ranks.starmap(
            rank_process, [(socket, [storing, restoring], r, "RETRIEVE") for r in range(2)]
        )
        assert restored == [({"RETRIEVE-0": True, "RETRIEVE-1": True}, True)] * 2
    client.clear(force=True)
    assert idle(client.status())
    client.close()


class Ranks:
    """Long-lived worker rank processes (``rank_server``), one respawnable."""

    def __init__(self, socket: str, world: int) -> None:
        self.socket, self.world = socket, world
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: list[Any] = [None] * world
        self.conns: list[Any] = [None] * world
        for rank in range(world):
            self.spawn(rank)

    def spawn(self, rank: int) -> None:
        ours, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(target=rank_server, args=(self.socket, rank, self.world, theirs))
        proc.start()
        assert ours.poll(60) and ours.recv() == "ready"
        self.procs[rank], self.conns[rank] = proc, ours

    def send(self, rank: int, direction: str, m: rc.Manifest, delay: float = 0.0) -> None:
        self.conns[rank].send((direction, m, delay))

    def result(self, rank: int) -> tuple[bool, bool]:
        assert self.conns[rank].poll(60), f"rank {rank} never answered"
        answer: tuple[bool, bool] = self.conns[rank].recv()
        return answer

    def run_all(self, direction: str, m: rc.Manifest) -> list[tuple[bool, bool]]:
        for rank in range(self.world):
            self.send(rank, direction, m)
        return [self.result(rank) for rank in range(self.world)]

    def kill(self, rank: int) -> None:
        self.procs[rank].kill()
        self.procs[rank].join()
        self.conns[rank].close()

    def close(self) -> None:
        for rank in range(self.world):
            if self.procs[rank].is_alive():
                self.conns[rank].send(None)
                self.procs[rank].join(60)


@pytest.mark.parametrize("world", [2, 4])
def test_kill_9_a_rank_at_random_points_of_store_and_restore_keeps_the_sidecar_whole(
    server: rc.Server, world: int
) -> None:
    rounds = 20
    seed = int(os.environ.get("LMRC_KILL_SEED", time.time_ns() % 1_000_000))
    print(f"seed {seed}")
    rng = random.Random(seed)
    client = rc.Client(server.socket_path)
    ranks = Ranks(server.socket_path, world)
    slow: list[float] = []
    held = {"STORE": 0, "RETRIEVE": 0}
    try:
        for r in range(rounds):
            tokens = list(range(10_000 * (r + 1), 10_000 * (r + 1) + rng.randrange(20, 120)))
            m, roots = make_manifest(tokens, world=world, layout=LAYOUT)
            killed_in = "STORE" if r % 2 == 0 else "RETRIEVE"
            if killed_in == "RETRIEVE":
                assert client.begin(m)
                assert ranks.run_all("STORE", m) == [(True, True)] * world
                assert client.find(roots.roots) == m
            else:
                assert client.begin(m)
            victim = rng.randrange(world)
            # Half the kills land while the victim holds its lease (its copy
            # is held up until the kill); the others at a random moment:
            # before its lease, during the copy, or after it finished.
            holding = rng.random() < 0.5
            delay = 30.0 if holding else rng.choice([0.0, rng.uniform(0.005, 0.1)])
            for rank in range(world):
                ranks.send(rank, killed_in, m, delay if rank == victim else 0.0)
            if holding:
                for rank in range(world):
                    if rank != victim:
                        ok, exact = ranks.result(rank)
                        assert exact, f"round {r}: rank {rank} bytes differ"
                        assert ok or killed_in == "STORE", f"round {r}: rank {rank}"
                lease = "store_leases" if killed_in == "STORE" else "retrieve_leases"
                deadline = time.monotonic() + 30
                while client.status()[lease] != 1:
                    assert time.monotonic() < deadline, f"round {r}: the victim never leased"
                    time.sleep(0.002)
                held[killed_in] += 1
                ranks.kill(victim)
            else:
                time.sleep(rng.uniform(0.0, 0.12))
                ranks.kill(victim)
                for rank in range(world):
                    if rank != victim:
                        ok, exact = ranks.result(rank)
                        assert exact, f"round {r}: rank {rank} {killed_in} bytes differ"
                        # A survivor's restore never depends on the victim.
                        assert ok or killed_in == "STORE", f"round {r}: rank {rank}"
            if killed_in == "STORE" and client.find(roots.roots) != m:
                client.abort(m.generation)  # the scheduler gives the generation up
            slow.append(wait_idle(client.status, RECLAIM_WITHIN))
            ranks.spawn(victim)
            # Later stores of the same content succeed; every rank restores it exactly.
            if client.find(roots.roots) != m:
                deadline = time.monotonic() + 30
                while not client.begin(m):
                    assert time.monotonic() < deadline, f"round {r}: begin refused"
                    time.sleep(0.01)
                assert ranks.run_all("STORE", m) == [(True, True)] * world, f"round {r}"
            assert client.find(roots.roots) == m
            assert ranks.run_all("RETRIEVE", m) == [(True, True)] * world, f"round {r}"
            client.clear(force=True)
            assert idle(client.status()), f"round {r}"
        s = client.status()
        print(
            f"world {world}: {rounds} rounds ({held} killed holding a lease), idle at most "
            f"{max(slow) * 1000:.1f} ms after a kill; reclaimed "
            f"{s['reclaimed_store_leases']} store and {s['reclaimed_retrieve_leases']} "
            "retrieve leases"
        )
        # Every kill that held a lease was reclaimed (random kills may add more).
        assert s["reclaimed_store_leases"] >= held["STORE"]
        assert s["reclaimed_retrieve_leases"] >= held["RETRIEVE"]
    finally:
        ranks.close()
        client.close()
