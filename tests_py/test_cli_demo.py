"""``lmcache-rc demo``: runs as a subprocess, reports measured figures, fails on a mismatch.

The demo starts an embedded sidecar with a durable directory and L2, runs a
multi-turn workload on simulated engines (2 ranks in separate processes),
restarts the sidecar and replays from disk. These tests check its exit codes,
the figures it prints (restores in later turns, restores from L2 after the
restart, byte-exact verification, an idle sidecar), its ``--json`` document,
and that a corrupted page (``LMCACHE_RC_DEMO_CORRUPT=1``) exits 1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from lmcache_rc.cli import main
from lmcache_rc.demo import CORRUPT_ENV

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 180  # seconds; the demo takes a few seconds even on 2 cores


def run_demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != CORRUPT_ENV}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "lmcache_rc", "demo", *args],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


ROW = re.compile(
    r"^\s+(?P<phase>run|replay)\s+(?P<request>c\d+-t\d+)\s+(?P<turn>\d+)\s+(?P<replica>\d+)"
    r"\s+(?P<prompt>\d+)\s+(?P<restored>\d+)\s+(?P<local>\d+)\s+(?P<recomputed>\d+)"
    r"\s+(?P<new>\d+)\s+(?P<reused>\d+)\s+(?P<l2>\d+)\s+(?P<restore_ms>[\d.]+|-)"
    r"\s+(?P<turn_ms>[\d.]+)\s+(?P<output>= ref|MISMATCH)\s*$"
)


def table_rows(text: str) -> list[dict[str, str]]:
    return [m.groupdict() for line in text.splitlines() if (m := ROW.match(line))]


def pool_ids(text: str) -> list[str]:
    return re.findall(r"\bmemfd ([0-9a-f]{32})\b", text)


def assert_no_leftover_segments(text: str) -> None:
    ids = pool_ids(text)
    assert ids, "the demo should print its pool ids"
    for pool in ids:
        left = list(Path("/dev/shm").glob(f"*{pool}*"))
        assert not left, f"shared memory {left} left behind"


def test_demo_runs_verifies_and_reports_measured_figures() -> None:
    proc = run_demo()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    rows = table_rows(out)
    run = [r for r in rows if r["phase"] == "run"]
    replay = [r for r in rows if r["phase"] == "replay"]
    assert len(run) == 3 * 4 and len(replay) == 3  # 3 conversations, 4 turns, 1 replay each
    assert all(r["output"] == "= ref" for r in rows)
    for r in rows:  # restored + local + recomputed covers the prompt
        assert int(r["restored"]) + int(r["local"]) + int(r["recomputed"]) == int(r["prompt"])
    later = [r for r in run if int(r["turn"]) > 1]
    assert later and all(int(r["restored"]) > 0 for r in later)
    assert all(int(r["recomputed"]) < int(r["restored"]) for r in later)
    assert all(r["restore_ms"] != "-" for r in later)
    # after the restart every restore comes from disk
    assert all(int(r["restored"]) > 0 and int(r["l2"]) > 0 for r in replay)
    # the shared system prompt is written once: later turns reuse pages
    assert sum(int(r["reused"]) for r in run) > 0
    assert "sidecar restarted on the same directory and L2 path" in out
    assert "0 objects in RAM" in out
    assert re.search(r"verification\s+byte-exact: \d+ rank restores", out)
    assert "15/15 outputs equal the reference" in out
    assert re.search(r"sidecar idle\s+0 store leases, 0 retrieve leases, 0 pins, 0 pending", out)
    m = re.search(r"after restart\s+restored (\d+) tokens, (\d+) pages read from L2", out)
    assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0
    assert re.search(r"dedup ratio \d+\.\d\dx", out)
    assert out.rstrip().endswith("demo OK")
    assert "MISMATCH" not in out and "FAILED" not in proc.stderr
    assert_no_leftover_segments(out)


def test_demo_json_document_is_consistent(tmp_path: Path) -> None:
    keep = tmp_path / "kept"
    proc = run_demo("--json", "--rank-mode", "thread", "--keep", str(keep))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)  # stdout is exactly one JSON object
    assert doc["ok"] is True and doc["error"] is None
    assert doc["options"]["world_size"] == 2 and doc["options"]["rank_mode"] == "thread"
    turns = doc["turns"]
    run = [t for t in turns if t["phase"] == "run"]
    replay = [t for t in turns if t["phase"] == "replay"]
    assert len(run) == 12 and len(replay) == 3
    assert all(t["output_matches"] for t in turns)
    s = doc["summary"]
    assert s["byte_exact"] is True
    assert s["outputs_checked"] == s["outputs_matching"] == 15
    assert s["restores_verified"] > 0 and s["pages_verified"] > s["restores_verified"]
    assert s["later_turn_restored_tokens"] > s["later_turn_recomputed_tokens"] > 0
    assert s["replay_restored_tokens"] > 0 and s["replay_l2_loads"] > 0
    assert s["restored_tokens"] == sum(t["restored_tokens"] for t in turns)
    assert s["recomputed_tokens"] == sum(t["recomputed_tokens"] for t in turns)
    # per-turn deltas add up to the sidecar's cumulative counters before the restart
    before = doc["phases"]["before_restart"]
    assert sum(t["pages_new"] for t in run) == s["pages_new"] == before["store_pages_new"]
    assert sum(t["pages_reused"] for t in run) == s["pages_reused"]
    assert s["dedup_ratio"] == (s["pages_new"] + s["pages_reused"]) / s["pages_new"] > 1
    assert before["l2_bytes_written"] > 0 and before["l2_objects"] > 0
    after = doc["phases"]["after_restart"]
    assert after["l1_objects"] == 0 and after["l2_objects"] == before["l2_objects"]
    assert after["generations"] == before["generations"] > 0
    assert after["restart_retired"] == 0
    assert s["sidecar_final"] == {
        "store_leases": 0,
        "retrieve_leases": 0,
        "pins": 0,
        "pending": 0,
        "l2_queue": 0,
    }
    assert s["sidecar_stop"]["live_leases"] == 0
    # progress and the human summary went to stderr
    assert "byte-exact" in proc.stderr
    # --keep leaves the durable state behind
    assert (keep / "checkpoints.sqlite").is_file()
    assert any((keep / "l2").rglob("*"))


def test_corrupted_page_exits_1_with_a_mismatch_message() -> None:
    proc = run_demo(env={CORRUPT_ENV: "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{CORRUPT_ENV}: flipped one byte" in proc.stdout
    assert "lmcache-rc demo: FAILED" in proc.stderr
    assert "differs from recomputation" in proc.stderr
    assert "demo OK" not in proc.stdout
    assert_no_leftover_segments(proc.stdout)


def test_corrupted_page_json_reports_the_failure() -> None:
    proc = run_demo("--json", "--rank-mode", "thread", env={CORRUPT_ENV: "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and "differs from recomputation" in doc["error"]
    assert doc["summary"] is None


def test_bad_arguments_exit_2(capsys: Any) -> None:
    assert main(["demo", "--turns", "0"]) == 2
    assert "--turns must be at least 1" in capsys.readouterr().err
