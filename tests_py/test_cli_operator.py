"""What an operator meets at the terminal: ``lmcache-rc`` run as a
subprocess with a fresh ``HOME``: first start on a fresh machine, sizes with
units, errors that name the flag or variable (exit 2, never a traceback),
human output (sizes in binary units, no Rust debug structs), ``status``
facts, ``status --json`` keyed like HTTP ``/status``, and ``clear``."""

from __future__ import annotations

import json
import re
import signal
import stat
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import lmcache_rc as rc
from lmcache_rc.cli import human_duration, human_size
from tests_py.sidecar_helpers import cli, fresh_env, start_sidecar


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """An empty home directory (a new user on a fresh machine)."""
    return tmp_path / "home"


def _stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, the exit code checked, the rest of its output."""
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out


@pytest.fixture
def sidecar(tmp_path: Path, home: Path) -> Iterator[tuple[str, list[str], dict[str, str]]]:
    """A sidecar with an 8 MiB pool, a durable index and an L2 directory;
    yields its socket, start-up lines and the environment it runs in."""
    env = fresh_env(home)
    proc, lines = start_sidecar(tmp_path, env=env)
    try:
        yield str(tmp_path / "side.sock"), lines, env
    finally:
        if proc.poll() is None:
            _stop(proc)


def _no_traceback(out: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in out.stderr + out.stdout, out.stderr


# -- first start -------------------------------------------------------------


def test_serve_creates_the_index_directory_under_a_fresh_home_private(
    tmp_path: Path, home: Path
) -> None:
    """The README's paths under ~/.cache/lmcache-rc/ work when nothing there exists."""
    cache = home / ".cache" / "lmcache-rc"
    proc, lines = start_sidecar(
        tmp_path,
        "--checkpoint-index-path",
        str(cache / "checkpoints.sqlite"),
        "--l2-path",
        str(cache / "l2"),
        env=fresh_env(home),
    )
    try:
        assert (cache / "checkpoints.sqlite").is_file(), lines
        for folder in (home / ".cache", cache):
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    finally:
        _stop(proc)


# -- sizes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8G", 8 << 30),
        ("512MiB", 512 << 20),
        ("1.5GB", 3 << 29),
        ("4 kib", 4096),
        ("8388608", 8 << 20),
    ],
)
def test_sizes_take_binary_units_in_flags_and_config(text: str, value: int) -> None:
    assert rc.ServerConfig.parse("l1_bytes", text) == value
    assert rc.ServerConfig(l1_bytes=text).l1_bytes == value
    assert rc.ServerConfig(l2_bytes=text).l2_bytes == value


def test_a_size_in_an_environment_variable_takes_units(tmp_path: Path, home: Path) -> None:
    proc, lines = start_sidecar(tmp_path, env=fresh_env(home, LMCACHE_RC_L2_BYTES="1.5GiB"))
    _stop(proc)
    assert any("(at most 1.5 GiB)" in line for line in lines), lines


def test_a_bad_size_flag_names_the_flag_and_shows_an_example(home: Path) -> None:
    out = cli("serve", "--l1-bytes", "banana", env=fresh_env(home))
    assert out.returncode == 2
    assert "argument --l1-bytes:" in out.stderr and "'banana'" not in out.stderr
    assert '"banana"' in out.stderr and "e.g. 8GiB" in out.stderr
    assert "invalid" not in out.stderr and "_size" not in out.stderr
    _no_traceback(out)


def test_a_size_string_in_a_config_dict_names_the_setting() -> None:
    with pytest.raises(rc.errors.InvalidInput, match=r"l1_bytes: expected a size.*e\.g\. 8GiB"):
        rc.ServerConfig(l1_bytes="banana")


@pytest.mark.parametrize(
    ("var", "text"),
    [
        ("LMCACHE_RC_HTTP_PORT", "abc"),
        ("LMCACHE_RC_L1_BYTES", "banana"),
        ("LMCACHE_RC_MAX_ENTRIES", "0"),
        ("LMCACHE_RC_HTTP_PORT", "70000"),
        ("LMCACHE_RC_DRAIN_TIMEOUT", "-1"),
    ],
)
def test_a_bad_environment_variable_is_named_with_an_example(
    home: Path, var: str, text: str
) -> None:
    out = cli("serve", env=fresh_env(home, **{var: text}))
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"lmcache-rc: error: {var}: "), out.stderr
    assert "(e.g. " in out.stderr
    _no_traceback(out)


# -- usage errors: exit 2, the flag named, no traceback ----------------------


@pytest.mark.parametrize(
    ("flag", "text", "says"),
    [
        ("--max-entries", "0", "must be at least 1, got 0"),
        ("--max-leases", "-1", "expected a non-negative integer"),
        ("--max-pending", "0", "must be at least 1"),
        ("--l1-bytes", "1000", "positive multiple of 4096"),
        ("--l1-bytes", "0", "positive multiple of 4096"),
        ("--http-port", "70000", "-1 (off)"),
        ("--drain-timeout", "soon", "a duration: a number of seconds"),
        ("--drain-timeout", "1h30m", "e.g. 30, 2.5, 30s, 5m, 36h, 1.5d"),
        ("--rpc-frame-timeout", "0", "must be a positive number of seconds"),
        ("--rpc-max-buffered-bytes", "1M", "at least the 64.0 MiB frame limit, got 1.0 MiB"),
        ("--max-pending-bytes", "0", "must be positive"),
    ],
)
def test_out_of_range_flags_exit_2_naming_the_flag(
    home: Path, flag: str, text: str, says: str
) -> None:
    out = cli("serve", flag, text, env=fresh_env(home))
    assert out.returncode == 2, out.stderr
    assert f"argument {flag}: " in out.stderr and says in out.stderr, out.stderr
    assert "(e.g. " in out.stderr
    _no_traceback(out)


def test_identity_token_ids_must_be_integers(home: Path) -> None:
    out = cli("identity", "--tokens", "[1,2.5]", env=fresh_env(home))
    assert out.returncode == 2
    assert "token ids must be integers, got 2.5 at index 1" in out.stderr
    _no_traceback(out)


@pytest.mark.parametrize("text", ["abc", '{"a": 1}', "7", ""])
def test_identity_tokens_must_be_a_json_list_with_an_example(home: Path, text: str) -> None:
    out = cli("identity", "--tokens", text, env=fresh_env(home))
    assert out.returncode == 2
    assert "--tokens must be a JSON list of token ids (integers)" in out.stderr
    assert "e.g. --tokens '[1, 2, 3]'" in out.stderr
    _no_traceback(out)


def test_a_socket_path_over_the_limit_states_the_limit_and_its_length(
    tmp_path: Path, home: Path
) -> None:
    socket = str(tmp_path / ("s" * 120 + ".sock"))
    for command in ("serve", "status"):
        out = cli(command, "--socket", socket, env=fresh_env(home))
        assert out.returncode == 2, (command, out.stderr)
        assert f"is {len(socket)} bytes long" in out.stderr, out.stderr
        assert "107 bytes" in out.stderr
        assert ".lmrc" not in out.stderr and ".tmp" not in out.stderr
        _no_traceback(out)


def test_status_into_a_closed_pipe_exits_quietly(sidecar: tuple[str, list[str], object]) -> None:
    """``lmcache-rc status | head -3``: the reader is gone before the output."""
    socket, _, env = sidecar
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache_rc", "status", "--socket", socket],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,  # type: ignore[arg-type]
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141
    assert err == ""


def test_status_piped_into_head_shows_no_error(sidecar: tuple[str, list[str], object]) -> None:
    socket, _, env = sidecar
    command = f"{sys.executable} -m lmcache_rc status --socket {socket} | head -3"
    out = subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,  # type: ignore[arg-type]
    )
    assert out.returncode == 0
    assert len(out.stdout.splitlines()) == 3
    assert out.stderr == ""


# -- output ------------------------------------------------------------------


def test_human_units() -> None:
    assert human_size(8 << 30) == "8.0 GiB"
    assert human_size(512 << 20) == "512.0 MiB"
    assert human_size(100) == "100 bytes"
    assert human_size(3 << 39) == "1.5 TiB"
    assert human_duration(5) == "5s"
    assert human_duration(125) == "2m 05s"
    assert human_duration(3 * 3600 + 60) == "3h 01m"


def test_serve_output_is_for_people(tmp_path: Path, home: Path) -> None:
    proc, lines = start_sidecar(tmp_path, env=fresh_env(home))
    rest = _stop(proc)
    text = "\n".join(lines) + rest
    assert "lmcache-rc: lmcache-rc" not in text
    assert f"lmcache-rc: RPC server listening on {tmp_path / 'side.sock'}" in text
    assert "  shm pool    8.0 MiB (memfd " in text
    assert str(8 << 20) not in text, "a size printed in raw bytes"
    assert "ShutdownReport" not in text and "{" not in rest
    assert "stopped: every lease finished, service closed cleanly" in rest
    assert "lmcache-rc: stopped cleanly (every lease finished)" in rest


def test_status_shows_the_facts_and_sizes_in_units(
    tmp_path: Path, sidecar: tuple[str, list[str], dict[str, str]]
) -> None:
    socket, _, env = sidecar
    out = cli("status", "--socket", socket, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    fields = {line.split("  ", 1)[0].strip(): line.split("  ", 1)[-1].strip() for line in lines}
    assert fields["version"] == rc.__version__
    assert re.fullmatch(r"\d+s|\d+m \d\ds", fields["uptime"]), fields["uptime"]
    assert fields["socket"] == socket
    assert fields["pool size"] == "8.0 MiB"
    assert fields["index"] == str(tmp_path / "side.sqlite")
    assert fields["l2 path"] == str(tmp_path / "side-l2")
    assert fields["misses"] == "none"
    for key, value in fields.items():
        if key.endswith("_bytes") or key.endswith("_bytes_written"):
            assert value.endswith(("bytes", "KiB", "MiB", "GiB", "TiB")), (key, value)
    assert not any(line.strip() == "misses" for line in lines)


def test_status_json_has_the_keys_of_http_status(
    tmp_path: Path, sidecar: tuple[str, list[str], dict[str, str]]
) -> None:
    socket, _, env = sidecar
    out = cli("status", "--socket", socket, "--json", env=env)
    assert out.returncode == 0, out.stderr
    over_rpc = json.loads(out.stdout)
    admin = json.loads(Path(socket + ".admin.json").read_text())
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(admin["url"] + "/status", timeout=30) as response:
        over_http = json.load(response)
    assert set(over_rpc) == set(over_http)
    for key in ("version", "socket", "checkpoint_index_path", "l2_path", "l1_capacity"):
        assert over_rpc[key] == over_http[key], key
    assert over_rpc["version"] == rc.__version__
    assert over_rpc["socket"] == socket
    assert over_rpc["checkpoint_index_path"] == str(tmp_path / "side.sqlite")
    assert isinstance(over_rpc["uptime_seconds"], int)
    assert isinstance(over_rpc["rpc_requests"], int)


def test_clear_of_an_unreachable_sidecar_says_only_that(tmp_path: Path, home: Path) -> None:
    out = cli("clear", "--socket", str(tmp_path / "nobody.sock"), env=fresh_env(home))
    assert out.returncode == 3
    assert "clearing" not in out.stderr
    assert "unreachable" in out.stderr
    _no_traceback(out)


def test_clear_mentions_disk_only_when_there_is_an_l2(tmp_path: Path, home: Path) -> None:
    env = fresh_env(home)
    proc, _ = start_sidecar(tmp_path, "--l2-path", "none", env=env)
    socket = str(tmp_path / "side.sock")
    try:
        out = cli("clear", "--socket", socket, "--all-tiers", env=env)
        assert out.returncode == 0, out.stderr
        assert "and disk (L2)" not in out.stderr and "no disk tier (L2)" in out.stderr
        assert "disk (L2):" not in out.stdout
        assert "RAM (L1): 0 object(s), 0 bytes freed" in out.stdout
        plain = cli("clear", "--socket", socket, env=env)
        assert "L2" not in plain.stderr + plain.stdout
    finally:
        _stop(proc)
    proc, _ = start_sidecar(tmp_path, env=env)
    try:
        out = cli("clear", "--socket", socket, "--all-tiers", env=env)
        assert out.returncode == 0, out.stderr
        assert "RAM (L1) and disk (L2)" in out.stderr
        assert "disk (L2): 0 file(s) deleted" in out.stdout
    finally:
        _stop(proc)


def test_exit_codes_are_documented() -> None:
    text = (Path(__file__).parents[1] / "docs" / "operations.md").read_text()
    for code in ("| 0 ", "| 1 ", "| 2 ", "| 3 ", "| 4 ", "| 130 ", "| 141 "):
        assert code in text, code
    assert "LMCACHE_RC_DEBUG" in text


def test_status_shows_each_reporting_engine(
    tmp_path: Path, sidecar: tuple[str, list[str], dict[str, str]]
) -> None:
    socket, _, env = sidecar
    client = rc.Client(socket)
    client.report_engine(
        "engine-x", {"lookups": 9, "restores_done": 3, "lookup_miss": 0, "hook_start_load_kv_us": 7}
    )
    out = cli("status", "--socket", socket, env=env)
    assert out.returncode == 0, out.stderr
    tail = out.stdout.split("\nengines", 1)[1]
    assert tail.split("\n")[0].split() == ["1", "reporting"]
    assert "engine-x (reported" in tail
    assert "lookups 9, restores_done 3" in tail
    assert "lookup_miss" not in tail and "hook_" not in tail, "zeros and costs only in --json"
    as_json = json.loads(cli("status", "--socket", socket, "--json", env=env).stdout)
    (engine,) = as_json["engines"]
    assert engine["engine"] == "engine-x" and engine["counters"]["hook_start_load_kv_us"] == 7


def test_a_bad_engine_report_is_refused_and_keeps_nothing(
    sidecar: tuple[str, list[str], dict[str, str]],
) -> None:
    socket, _, _ = sidecar
    client = rc.Client(socket)
    with pytest.raises(rc.errors.InvalidInput, match="engine id"):
        client.report_engine("", {"lookups": 1})
    with pytest.raises(rc.errors.InvalidInput, match="at most 256 counters"):
        client.report_engine("e", {f"c{i}": 1 for i in range(300)})
    with pytest.raises(OverflowError):
        client.report_engine("e", {"lookups": -1})
    assert client.engines() == []
