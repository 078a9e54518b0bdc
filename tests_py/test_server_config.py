"""ServerConfig is declared once (rust/core/src/config.rs) and strict."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lmcache_rc as rc
from lmcache_rc import errors
from lmcache_rc.cli import _config_from, build_parser


def test_unknown_settings_raise_and_name_the_known_ones() -> None:
    with pytest.raises(errors.InvalidType, match=r"no setting .l1_byte."):
        rc.ServerConfig(l1_byte=1 << 20)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="l1_bytes"):
        rc.ServerConfig(bogus=1)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("l1_bytes", b"8388608"),
        ("l1_bytes", True),
        ("l1_bytes", 4096.0),
        ("max_leases", None),
        ("socket", 3),
        ("http_host", b"127.0.0.1"),
        ("store_admission_timeout", b"1"),
        ("store_admission_timeout", False),
    ],
)
def test_values_of_the_wrong_type_raise_type_errors(name: str, value: object) -> None:
    with pytest.raises(TypeError, match=name):
        rc.ServerConfig(**{name: value})


@pytest.mark.parametrize(
    ("name", "value"),
    [("l1_bytes", 1000), ("l1_bytes", -4096), ("retrieve_timeout", -1.0), ("max_entries", -1)],
)
def test_values_out_of_range_raise_value_errors(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        rc.ServerConfig(**{name: value})


def test_settings_read_back_with_their_python_types(tmp_path: object) -> None:
    c = rc.ServerConfig(
        socket="/tmp/x/side.sock",
        l2_path="/var/tmp/l2",
        l2_bytes=1 << 30,
        store_admission_timeout=2,
        abandoned_after=None,
        http_port=-1,
    )
    assert c.socket == "/tmp/x/side.sock" and c.l2_path == "/var/tmp/l2"
    assert c.l2_bytes == 1 << 30 and c.checkpoint_index_path is None
    assert c.store_admission_timeout == 2.0 and isinstance(c.store_admission_timeout, float)
    assert c.abandoned_after is None and c.http_port == -1
    assert c.shm_name is None, "no pool name: the pool is an anonymous memfd"
    assert c.as_dict()["l2_bytes"] == 1 << 30
    with pytest.raises(AttributeError):
        c.l1_bytes = 4096  # type: ignore[misc]
    with pytest.raises(AttributeError):
        _ = c.no_such_setting  # type: ignore[attr-defined]


def test_copies_compare_equal_and_pickle() -> None:
    c = rc.ServerConfig(l1_bytes=8 << 20, http_port=-1)
    assert pickle.loads(pickle.dumps(c)) == c
    d = c.replace(l1_bytes=16 << 20)
    assert d != c and d.l1_bytes == 16 << 20 and d.http_port == -1
    assert "l1_bytes=16777216" in repr(d)


def test_environment_variables_are_parsed_by_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_RC_L2_BYTES", "2G")
    monkeypatch.setenv("LMCACHE_RC_ABANDONED_AFTER", "none")
    monkeypatch.setenv("LMCACHE_RC_HTTP_PORT", "-1")
    c = rc.ServerConfig.from_env(max_pending=9, l2_path=None)
    assert (c.l2_bytes, c.abandoned_after, c.http_port, c.max_pending) == (2 << 30, None, -1, 9)
    monkeypatch.setenv("LMCACHE_RC_MAX_LEASES", "many")
    with pytest.raises(ValueError, match="LMCACHE_RC_MAX_LEASES"):
        rc.ServerConfig.from_env()


def test_every_duration_setting_reads_one_grammar(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python keywords, environment variables, serve flags and
    ``parse_duration`` read the same durations; plain numbers stay seconds."""
    from lmcache_rc.config import parse_duration

    for text, seconds in [
        ("30", 30.0),
        ("2.5", 2.5),
        ("30s", 30.0),
        ("250ms", 0.25),
        ("5m", 300.0),
        ("36h", 129600.0),
        ("1.5d", 129600.0),
        ("2w", 1209600.0),
    ]:
        assert parse_duration(text) == seconds, text
        assert rc.ServerConfig(drain_timeout=text).drain_timeout == seconds, text
    assert rc.ServerConfig(abandoned_after="1h").abandoned_after == 3600.0
    assert rc.ServerConfig(retrieve_timeout=7).retrieve_timeout == 7.0, "numbers still seconds"
    monkeypatch.setenv("LMCACHE_RC_RETRIEVE_TIMEOUT", "2m")
    monkeypatch.setenv("LMCACHE_RC_ABANDONED_AFTER", "90")
    c = rc.ServerConfig.from_env()
    assert (c.retrieve_timeout, c.abandoned_after) == (120.0, 90.0)
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    args = serve.parse_args(["--drain-timeout", "1.5m", "--shared-lookup-timeout", "200ms"])
    config = _config_from(args)
    assert (config.drain_timeout, config.shared_lookup_timeout) == (90.0, 0.2)
    for bad in ["soon", "-1s", "1h30m", "nan", ""]:
        with pytest.raises(errors.InvalidInput, match="a duration"):
            parse_duration(bad)
        with pytest.raises(ValueError, match="drain_timeout: expected a duration"):
            rc.ServerConfig(drain_timeout=bad)


def test_cli_flags_and_help_come_from_the_settings() -> None:
    names = [name for name, _, _, _ in rc.ServerConfig.fields()]
    assert names[:3] == ["socket", "shm_name", "l1_bytes"]
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    args = serve.parse_args(["--l1-bytes", "64M", "--abandoned-after", "none", "--http-port", "-1"])
    config = _config_from(args)
    assert (config.l1_bytes, config.abandoned_after, config.http_port) == (64 << 20, None, -1)
    assert config.retrieve_timeout == rc.ServerConfig().retrieve_timeout, "not given: default"
    out = subprocess.run(
        [sys.executable, "-m", "lmcache_rc", "serve", "--l1-bytes", "lots"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2 and "--l1-bytes" in out.stderr


def test_every_setting_is_documented_in_the_configuration_guide() -> None:
    guide = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    for name, _, _, _ in rc.ServerConfig.fields():
        flag = "--" + name.replace("_", "-")
        assert f"`{name}` / `{flag}`" in guide, name


def test_checkpoint_service_takes_a_server_config_and_honours_every_setting(
    tmp_path: Path,
) -> None:
    # Issue 12, item 9: rc.CheckpointService({"l1_bytes": 1 << 20}) silently
    # opened a 1 GiB pool with defaults (any getattr error fell back to the
    # default). The ServerConfig refactor made the config strict; this pins it.
    with pytest.raises(TypeError):
        rc.CheckpointService({"l1_bytes": 1 << 20})  # type: ignore[arg-type]
    # A size as text is a size, as in flags and variables (docs/configuration.md);
    # anything else that is not an int is still a TypeError.
    assert rc.ServerConfig(l1_bytes="1M").l1_bytes == 1 << 20
    with pytest.raises(TypeError):
        rc.ServerConfig(l1_bytes=b"1M")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="l1_byte"):
        rc.ServerConfig(l1_byte=1 << 20)  # type: ignore[call-arg]
    config = rc.ServerConfig(
        socket=str(tmp_path / "s.sock"),
        shm_name=f"lmrc-cfg-{os.getpid()}-{time.monotonic_ns()}",
        l1_bytes=1 << 20,
        max_pending=3,
    )
    svc = rc.CheckpointService(config)
    try:
        assert svc.capabilities()["pool_size"] == 1 << 20
    finally:
        svc.close()
