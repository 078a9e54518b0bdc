"""The command line: ``python -m lmcache_rc --version`` and ``identity``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from identity_helpers import sample_identity

import lmcache_rc as rc
from lmcache_rc import cli

SCHEMA1 = b'{"schema_version":1}'


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # Run outside the checkout so `-m` imports the installed package, as users do.
    return subprocess.run(
        [sys.executable, "-m", "lmcache_rc", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )


def test_version_flag_prints_the_package_version(tmp_path: Path) -> None:
    result = _run(tmp_path, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"lmcache-rc {rc.__version__}"
    assert rc.__version__


def test_identity_json_matches_the_api(tmp_path: Path) -> None:
    result = _run(tmp_path, "identity", "--json", "--tokens", "[1,2,3]")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    namespace = rc.checkpoint_namespace(cli.SAMPLE_IDENTITY, "")
    roots = rc.TokenRoots.build(namespace, [1, 2, 3])
    assert report["namespace"] == namespace
    assert report["num_tokens"] == 3
    assert report["chunk_tokens"] == 4096
    assert report["generation"] == rc.checkpoint_generation(roots.prefix(3), SCHEMA1)
    assert report["roots"] == [
        {"start_tokens": 0, "prefix_hash": roots.initial_chain.hex(), "tail_len": 3}
    ]


def test_identity_with_explicit_identity_salt_and_chunk(
    capsys: pytest.CaptureFixture[str],
) -> None:
    identity = sample_identity()
    argv = [
        "identity",
        "--json",
        "--identity",
        json.dumps(identity),
        "--salt",
        "tenant-a",
        "--tokens",
        json.dumps(list(range(10))),
        "--chunk-tokens",
        "4",
    ]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    namespace = rc.checkpoint_namespace(identity, "tenant-a")
    roots = rc.TokenRoots.build(namespace, range(10), 4)
    assert report["namespace"] == namespace
    assert [r["start_tokens"] for r in report["roots"]] == [0, 4, 8]
    assert [r["tail_len"] for r in report["roots"]] == [4, 4, 2]
    assert [r["prefix_hash"] for r in report["roots"]] == [r.prefix_hash.hex() for r in roots.roots]
    assert report["generation"] == rc.checkpoint_generation(roots.prefix(10), SCHEMA1)


def test_identity_text_mode_tokenizes_one_token_per_utf8_byte(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["identity", "--json", "--text", "h\u00e9"]) == 0
    report = json.loads(capsys.readouterr().out)
    namespace = rc.checkpoint_namespace(cli.SAMPLE_IDENTITY, "")
    roots = rc.TokenRoots.build(namespace, list("h\u00e9".encode()))
    assert report["num_tokens"] == 3
    assert report["generation"] == rc.checkpoint_generation(roots.prefix(3), SCHEMA1)


def test_identity_human_output_names_the_namespace(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["identity", "--tokens", "[5,6,7]"]) == 0
    out = capsys.readouterr().out
    assert rc.checkpoint_namespace(cli.SAMPLE_IDENTITY, "") in out
    assert "generation" in out


def test_identity_with_no_tokens_has_no_generation(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["identity", "--json", "--tokens", "[]"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["roots"] == []
    assert report["num_tokens"] == 0
    assert "generation" not in report


@pytest.mark.parametrize(
    "args",
    [
        ["--tokens", "[1,2"],
        ["--tokens", "not json"],
        ["--identity", "{bad json"],
    ],
    ids=["truncated tokens", "tokens not json", "identity not json"],
)
def test_identity_bad_json_exits_2_with_a_message(tmp_path: Path, args: list[str]) -> None:
    result = _run(tmp_path, "identity", "--json", *args)
    assert result.returncode == 2
    assert "error" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def _identity_with(**changes: Any) -> str:
    identity = sample_identity()
    identity.update(changes)
    return json.dumps(identity)


@pytest.mark.parametrize(
    "args",
    [
        ["--identity", _identity_with(layout={"scale": 0.5})],
        ["--identity", _identity_with(layout={"one": 1.0})],
        ["--identity", _identity_with(target_revision="")],
        ["--identity", "[1, 2]"],
        ["--tokens", "[-1]"],
        ["--tokens", "[2147483648]"],
        ["--tokens", "[1.5]"],
        ["--tokens", '"text"'],
        ["--tokens", "[1]", "--chunk-tokens", "0"],
    ],
    ids=[
        "float in identity",
        "integral float in identity",
        "empty target revision",
        "identity not an object",
        "negative token",
        "token 2^31",
        "float token",
        "tokens a string",
        "chunk 0",
    ],
)
def test_identity_invalid_input_exits_2_with_a_message(tmp_path: Path, args: list[str]) -> None:
    result = _run(tmp_path, "identity", "--json", *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith("lmcache-rc: error:")
    assert "Traceback" not in result.stderr


def test_identity_invalid_input_in_process_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["identity", "--identity", _identity_with(layout={"scale": 0.5})])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "lmcache-rc: error:" in captured.err


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 0
    assert "identity" in capsys.readouterr().out
