"""``lmcache-rc bench``: runs end to end (tiny size), reports measured figures
for 1 and 2 copy threads with their ratios, refuses bad sizes. Figures are
not compared with targets here: timing belongs to ci/bench.sh, not tests."""

from __future__ import annotations

import json
import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmcache_rc", "bench", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_bench_json_reports_both_thread_counts_with_ratios() -> None:
    done = run("--mib", "16", "--rounds", "1", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["jobs"] == 1 and result["page_kib"] == 256
    assert result["megabytes"] == 16 * 1024 * 1024 / 1e6
    assert result["memcpy_mb_s"] > 0
    assert set(result["store_mb_s"]) == set(result["restore_mb_s"]) == {"1", "2"}
    assert set(result["ratios"]) == {"store_1", "store_2", "restore_1", "restore_2"}
    for key, ratio in result["ratios"].items():
        threads = key.split("_")[1]
        kind = key.split("_")[0]
        expected = result[f"{kind}_mb_s"][threads] / result["memcpy_mb_s"]
        assert abs(ratio - expected) < 1e-9


def test_bench_text_report_names_the_targets() -> None:
    done = run("--mib", "16", "--rounds", "1")
    assert done.returncode == 0, done.stderr
    assert "memcpy (numpy copyto, 1 thread)" in done.stdout
    assert "1 copy thread(s): store" in done.stdout and "(target >= 0.8)" in done.stdout
    assert "2 copy thread(s): store" in done.stdout and "(target >= 1.5)" in done.stdout


def test_bench_refuses_bad_sizes() -> None:
    for args in (("--mib", "0"), ("--page-kib", "3")):
        done = run(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "lmcache-rc: error:" in done.stderr
