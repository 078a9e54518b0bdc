"""The HTTP admin API against hostile and careless clients, on a real
``lmcache-rc serve`` subprocess over raw sockets: every limit refuses early,
memory and threads stay flat, ``GET /status`` keeps answering and the process
stays alive; ``POST /clear`` needs the bearer token of the 0600 admin file."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from rpc_helpers import make_manifest, store_rank
from sidecar_helpers import cli, start_sidecar

import lmcache_rc as rc

Addr = tuple[str, int]
MiB = 1 << 20
# Generous: the limits keep growth to kilobytes; 64 MiB would still catch a
# server that buffers one 256 MiB header.
RSS_GROWTH_LIMIT = 64 * MiB


class Sidecar:
    """A running ``lmcache-rc serve`` and its HTTP admin address."""

    def __init__(self, proc: subprocess.Popen[str], lines: list[str], socket_path: str) -> None:
        self.proc = proc
        self.socket = socket_path
        url = next(line.split()[-1] for line in lines if "http admin" in line)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.url = url
        self.addr: Addr = (host, int(port))

    def proc_status(self, key: str) -> int:
        """A number from /proc/<pid>/status (VmRSS in kB, Threads)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise AssertionError(f"{key} not in /proc/{self.proc.pid}/status")

    def rss_bytes(self) -> int:
        return self.proc_status("VmRSS") * 1024

    def assert_serving(self) -> None:
        """The process is alive and GET /status answers 200 with the status."""
        assert self.proc.poll() is None, "the sidecar died"
        code, _, body = exchange(self.addr, request("GET", "/status"))
        assert code == 200, body
        assert "generations" in json.loads(body)


def start(tmp_path: Path, extra: Sequence[str] = ()) -> Sidecar:
    proc, lines = start_sidecar(tmp_path, *extra)
    return Sidecar(proc, lines, str(tmp_path / "side.sock"))


@pytest.fixture
def sidecar_factory(tmp_path: Path) -> Iterator[list[Sidecar]]:
    started: list[Sidecar] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def request(method: str, path: str, headers: Sequence[str] = (), close: bool = True) -> bytes:
    """One HTTP/1.1 request head, no body."""
    lines = [f"{method} {path} HTTP/1.1", "Host: x", *headers]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def parse(response: bytes) -> tuple[int, dict[str, str], str]:
    """(status code, headers in lower case, body) of one response."""
    head, _, body = response.partition(b"\r\n\r\n")
    status, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status.split()[1]), headers, body.decode("utf-8", "replace")


def exchange(addr: Addr, data: bytes, timeout: float = 30) -> tuple[int, dict[str, str], str]:
    """Sends ``data`` and reads until the server closes the connection (a
    server that does not close fails the test at ``timeout``)."""
    with socket.create_connection(addr, timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return parse(b"".join(chunks))


def closed_by_peer(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (EOF or reset), without waiting."""
    s.setblocking(False)
    try:
        return s.recv(4096) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        s.setblocking(True)


def wait_closed(socks: Sequence[socket.socket], deadline_s: float = 60) -> list[bool]:
    """Waits (at most deadline_s, a liveness bound, not a timing claim)
    until the server closed every socket in ``socks``; which ones it did."""
    closed = [False] * len(socks)
    end = time.monotonic() + deadline_s
    while not all(closed) and time.monotonic() < end:
        open_ = [s for s, c in zip(socks, closed, strict=True) if not c]
        readable, _, _ = select.select(open_, [], [], 0.5)
        for s in readable:
            i = next(i for i, t in enumerate(socks) if t is s)
            closed[i] = closed_by_peer(s)
    return closed


def test_a_huge_content_length_is_refused_with_413_before_any_body_is_read(
    tmp_path: Path, sidecar_factory: list[Sidecar]
) -> None:
    side = start(tmp_path)
    sidecar_factory.append(side)
    rss_before = side.rss_bytes()
    for method, path in (("GET", "/status"), ("POST", "/clear"), ("GET", "/metrics")):
        code, headers, body = exchange(
            side.addr, request(method, path, ["Content-Length: 99999999999"], close=False)
        )
        # The reply arrived and the server closed the connection without
        # waiting for (or allocating) the 93 GiB it announced.
        assert code == 413, body
        assert headers.get("connection") == "close"
        assert "take no body" in json.loads(body)["message"]
        side.assert_serving()
    growth = side.rss_bytes() - rss_before
    print(f"RSS before {rss_before / MiB:.1f} MiB, growth {growth / MiB:.2f} MiB")
    assert growth < RSS_GROWTH_LIMIT


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        # u64::MAX: above hyper's largest body length (2^64 - 3), which its
        # parser refuses as a too-large head (431).
        ("18446744073709551615", 431),
        ("18446744073709551616", 400),  # does not fit in 64 bits
        ("18446744073709551613", 413),  # the largest length HTTP/1 allows here
        ("-1", 400),
        ("1, 2", 400),  # conflicting lengths
    ],
)
def test_a_content_length_beyond_range_is_refused_not_a_panic(
    tmp_path: Path, sidecar_factory: list[Sidecar], length: str, expected: int
) -> None:
    side = start(tmp_path)
    sidecar_factory.append(side)
    for method, path in (("GET", "/status"), ("POST", "/clear")):
        code, _, body = exchange(
            side.addr, request(method, path, [f"Content-Length: {length}"], close=False)
        )
        assert code == expected, (method, length, body)
        side.assert_serving()


def test_oversized_headers_are_refused_early_and_rss_stays_flat(
    tmp_path: Path, sidecar_factory: list[Sidecar]
) -> None:
    side = start(tmp_path)
    sidecar_factory.append(side)
    # A head just over the 16 KiB limit, sent whole: 431, then closed.
    code, headers, _ = exchange(side.addr, request("GET", "/status", ["X-Big: " + "a" * 20_000]))
    assert code == 431 and headers.get("connection") == "close"
    # 100 small headers (more than the 64 allowed): 431 too.
    code, _, _ = exchange(side.addr, request("GET", "/status", [f"X-{i}: v" for i in range(100)]))
    assert code == 431
    side.assert_serving()

    # 4 connections, each sending 256 MiB of headers as 1 MiB header lines
    # (the seed's server buffered them all: RSS grew to 1 GiB, never returned).
    rss_before = side.rss_bytes()
    line = b"X-Big: " + b"a" * (MiB - 9) + b"\r\n"
    header_bytes = 256 * MiB
    accepted = []
    for _ in range(4):
        with socket.create_connection(side.addr, timeout=30) as s:
            s.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n")
            sent = 0
            try:
                while sent < header_bytes:
                    s.sendall(line)
                    sent += len(line)
            except (BrokenPipeError, ConnectionResetError):
                pass
        # The server stopped reading at its limit and closed: the client could
        # only fill the kernel's socket buffers, never the whole 256 MiB.
        assert sent < header_bytes, "the server kept reading a 256 MiB header"
        accepted.append(sent)
        side.assert_serving()
    growth = side.rss_bytes() - rss_before
    print(
        f"MiB sent before the server closed: {[a // MiB for a in accepted]}; "
        f"RSS before {rss_before / MiB:.1f} MiB, growth {growth / MiB:.2f} MiB"
    )
    assert growth < RSS_GROWTH_LIMIT


def test_idle_connections_beyond_the_cap_never_stop_status_answering(
    tmp_path: Path, sidecar_factory: list[Sidecar]
) -> None:
    cap = 8
    side = start(tmp_path, ["--http-max-connections", str(cap), "--http-idle-timeout", "300"])
    sidecar_factory.append(side)
    side.assert_serving()  # the server's own threads exist from here on
    threads_before = side.proc_status("Threads")
    idle = [socket.create_connection(side.addr, timeout=30) for _ in range(40)]
    partial = []
    for _ in range(10):
        s = socket.create_connection(side.addr, timeout=30)
        s.sendall(b"GET /status HTTP/1.1\r\nHost")  # a head never finished
        partial.append(s)
    held = idle + partial
    try:
        for _ in range(3):
            side.assert_serving()
        threads_after = side.proc_status("Threads")
        # The oldest connections were displaced (closed by the server), at
        # most `cap` stay open, and no thread was made per connection.
        closed = wait_closed(held[: len(held) - cap])
        still_open = [not closed_by_peer(s) for s in held[len(held) - cap + 1 :]]
        print(
            f"threads {threads_before} -> {threads_after}; displaced "
            f"{sum(closed)} of the {len(held) - cap} oldest; newest open {sum(still_open)}"
        )
        assert all(closed)
        assert all(still_open)
        assert threads_after - threads_before < 4
    finally:
        for s in held:
            s.close()
    side.assert_serving()


def test_a_slowloris_connection_is_dropped_after_the_idle_timeout(
    tmp_path: Path, sidecar_factory: list[Sidecar]
) -> None:
    side = start(tmp_path, ["--http-idle-timeout", "1"])
    sidecar_factory.append(side)
    silent = socket.create_connection(side.addr, timeout=30)
    # A keep-alive client that got its answer and then says nothing.
    kept = socket.create_connection(side.addr, timeout=30)
    kept.sendall(request("GET", "/status", close=False))
    assert kept.recv(65536).startswith(b"HTTP/1.1 200")
    slow = socket.create_connection(side.addr, timeout=30)
    slow.sendall(b"GET /status HTTP/1.1\r\n")
    started = time.monotonic()
    dropped_after = None
    try:
        # One header line every 0.25 s, forever: the whole head must arrive
        # within the idle timeout, so the server drops it regardless.
        while time.monotonic() - started < 60:
            try:
                slow.sendall(b"X-Slow: 1\r\n")
            except (BrokenPipeError, ConnectionResetError):
                dropped_after = time.monotonic() - started
                break
            if closed_by_peer(slow):
                dropped_after = time.monotonic() - started
                break
            time.sleep(0.25)
        assert dropped_after is not None, "the slow-loris connection was never dropped"
        assert wait_closed([silent, kept]) == [True, True]
        print(f"slow-loris dropped after {dropped_after:.1f} s (idle timeout 1 s)")
    finally:
        for s in (silent, kept, slow):
            s.close()
    side.assert_serving()


def test_clear_needs_the_bearer_token_of_the_0600_admin_file_beside_the_socket(
    tmp_path: Path, sidecar_factory: list[Sidecar]
) -> None:
    side = start(tmp_path)
    sidecar_factory.append(side)
    admin_file = Path(side.socket + ".admin.json")
    assert str(admin_file) == rc.Server.admin_file_for(side.socket)
    info = admin_file.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
    held = json.loads(admin_file.read_text())
    assert held["url"] == side.url and len(held["token"]) == 64

    client = rc.Client(side.socket)
    m, _ = make_manifest(list(range(48)), world=1)
    assert client.begin(m)
    assert store_rank(client, m, 0)
    deadline = time.monotonic() + 30
    while client.status()["l2_queue"] != 0:
        assert time.monotonic() < deadline, "L2 writes never drained"
        time.sleep(0.01)
    before = client.status()
    assert before["l1_objects"] > 0 and before["l2_objects"] > 0

    clear_all = "/clear?force=true&all_tiers=true"
    for headers in ([], ["Authorization: Bearer " + "0" * 64], [f"Authorization: {held['token']}"]):
        code, reply_headers, body = exchange(side.addr, request("POST", clear_all, headers))
        assert code == 401, body
        assert reply_headers.get("www-authenticate", "").startswith("Bearer")
        error = json.loads(body)
        assert error["error"] == "Unauthorized" and "Authorization: Bearer" in error["message"]
    after = client.status()
    assert (after["l1_objects"], after["l2_objects"], after["generations"]) == (
        before["l1_objects"],
        before["l2_objects"],
        before["generations"],
    ), "nothing cleared"
    # Read-only routes stay open (Prometheus scrapes without a token).
    for path in ("/status", "/metrics"):
        code, _, _ = exchange(side.addr, request("GET", path))
        assert code == 200

    out = cli("clear", "--socket", side.socket, "--json")
    assert out.returncode == 0, out.stderr
    assert f"via HTTP admin {side.url}" in out.stderr
    assert json.loads(out.stdout)["l1_objects"] == before["l1_objects"]
    assert client.status()["l1_objects"] == 0
    client.close()

    side.proc.send_signal(signal.SIGTERM)
    assert side.proc.wait(timeout=60) == 0
    assert not admin_file.exists(), "a clean stop removes the admin file"


def test_without_http_clear_goes_over_the_socket_and_a_stale_admin_file_is_removed(
    tmp_path: Path, sidecar_factory: list[Sidecar]
) -> None:
    admin_file = tmp_path / "side.sock.admin.json"
    admin_file.write_text('{"url": "http://127.0.0.1:1", "token": "stale"}')
    proc, _ = start_sidecar(tmp_path, "--http-port", "-1")
    try:
        assert not admin_file.exists(), "a killed server's admin file is removed at start"
        out = cli("clear", "--socket", str(tmp_path / "side.sock"), "--json")
        assert out.returncode == 0, out.stderr
        assert "via socket" in out.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
