"""Restore only when it beats recomputing (``lmcache_rc.vllm.restore_cost``).

The decision function is fed deterministic figures (no clock, no sidecar):
the restore estimate per tier, the per-token cost (configured, or fitted
from steps given here), the rule's "never skip without figures" and its
threshold. The end-to-end test runs the connector's public path (the
simulated engine, boundary mode, two sidecars sharing a ``file://`` tier,
the reading one with 50 ms injected latency per request) and asserts only
decisions, never timings: the gap is made wide enough (one fetch latency
against a third of it in recompute; a few latencies against seconds).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import pytest

from lmcache_rc.restore_skip import run_restore_skip
from lmcache_rc.vllm.options import OPTION_DEFAULTS, InvalidConnectorConfig, parse_options
from lmcache_rc.vllm.restore_cost import PrefillMeter, SkipRule, TierLoad, restore_seconds

IDENTITY = {"target_revision": "a" * 40, "source_revision": "b" * 40}


def shared(pages: int, page_bytes: int = 1 << 20, **kw: Any) -> TierLoad:
    figures: dict[str, Any] = dict(samples=10, latency_s=0.05, bytes_per_s=1e9, parallelism=4)
    figures.update(kw)
    return TierLoad("shared", pages, pages * page_bytes, **figures)


# --------------------------------------------------------------------------- the estimate


def test_a_tier_loads_in_rounds_of_its_parallelism() -> None:
    # 10 pages, 4 at a time: 3 rounds of (50 ms + 1 MiB at 1 GB/s)
    per_page = 0.05 + (1 << 20) / 1e9
    assert restore_seconds([shared(10)]) == pytest.approx(3 * per_page)
    assert restore_seconds([shared(4)]) == pytest.approx(per_page)
    assert restore_seconds([shared(1, parallelism=1)]) == pytest.approx(per_page)


def test_tiers_add_up_and_l1_pages_cost_nothing_to_load() -> None:
    l2 = TierLoad("l2", 2, 2 << 20, samples=3, latency_s=0.001, bytes_per_s=2e9, parallelism=2)
    l1 = TierLoad("l1", 100, 100 << 20)
    both = restore_seconds([l1, l2, shared(4)])
    assert both == pytest.approx((0.001 + (1 << 20) / 2e9) + (0.05 + (1 << 20) / 1e9))
    assert restore_seconds([l1]) == 0.0


@pytest.mark.parametrize(
    "tier",
    [
        shared(3, samples=0),  # nothing measured yet
        shared(3, bytes_per_s=0),
        TierLoad("tape", 3, 3 << 20, samples=5, latency_s=1.0, bytes_per_s=1e6),  # unknown tier
    ],
    ids=["no-samples", "no-rate", "unknown-tier"],
)
def test_a_tier_without_figures_gives_no_estimate(tier: TierLoad) -> None:
    assert restore_seconds([TierLoad("l1", 1, 1), tier]) is None


def test_the_sidecars_figures_are_read_from_its_reply() -> None:
    t = TierLoad.from_reply(
        {
            "tier": "shared",
            "pages": 3,
            "bytes": 3 << 20,
            "samples": 7,
            "latency_us": 50_000,
            "bytes_per_s": 10**9,
            "parallelism": 0,
        }
    )
    assert (t.tier, t.pages, t.bytes, t.samples) == ("shared", 3, 3 << 20, 7)
    assert t.latency_s == pytest.approx(0.05) and t.bytes_per_s == 1e9
    assert t.parallelism == 1, "never fewer than one load at a time"


# --------------------------------------------------------------------------- the per-token cost


def test_a_configured_cost_is_used_as_it_is_and_steps_are_not_timed() -> None:
    m = PrefillMeter(0.002)
    assert m.seconds_per_token() == 0.002 and m.source == "configured"
    m.scheduled(0.0, 100)
    m.finished(1.0)
    assert m.steps == 0


def test_no_cost_is_known_before_enough_steps() -> None:
    m = PrefillMeter()
    for _ in range(PrefillMeter.MIN_STEPS - 1):
        m.observe(100, 0.01)
    assert m.seconds_per_token() is None and m.source is None
    m.observe(100, 0.01)
    assert m.source == "measured"
    assert m.seconds_per_token() == pytest.approx(1e-4), "alike steps: the average per token"


def test_the_cost_of_one_more_token_is_the_slope_of_the_steps() -> None:
    # steps cost 20 ms of overhead plus 50 us per token: decode-like and prefill-like steps
    m = PrefillMeter()
    for i in range(40):
        tokens = 16 if i % 2 else 2048
        m.observe(tokens, 0.02 + 50e-6 * tokens)
    assert m.seconds_per_token() == pytest.approx(50e-6, rel=1e-6)
    assert m.report()["prefill_cost_source"] == "measured"


def test_noisy_steps_fall_back_to_the_average_which_errs_towards_restoring() -> None:
    m = PrefillMeter()
    # token counts vary but step times do not follow them
    for i, (tokens, seconds) in enumerate([(16, 0.05), (2048, 0.01)] * 10):
        m.observe(tokens, seconds + i * 1e-6)
    mean_tokens, mean_seconds = (16 + 2048) / 2, 0.03
    got = m.seconds_per_token()
    assert got is not None
    assert got == pytest.approx(mean_seconds / mean_tokens, rel=0.1)


def test_steps_are_timed_from_their_metadata_to_their_output_oldest_first() -> None:
    m = PrefillMeter()
    m.scheduled(0.0, 10)
    m.scheduled(0.5, 20)  # async scheduling: the next step is built before the output
    m.finished(1.0)  # the step of 10 tokens: 1.0 s
    m.finished(1.5)  # the step of 20 tokens: 1.0 s
    m.scheduled(2.0, 0)  # no tokens: queued, not timed
    m.scheduled(2.1, 30)
    m.finished(2.5)  # the empty step's output
    m.finished(3.1)  # the step of 30 tokens: 1.0 s, not 0.4 s
    m.finished(3.2)  # nothing pending
    m.scheduled(4.0, 5)
    m.finished(4.0)  # a clock that did not move measures nothing
    m.scheduled(5.0, None)  # a scheduler output without a token count
    m.finished(6.0)
    assert m.steps == 3
    m2 = PrefillMeter()
    for _ in range(PrefillMeter.MIN_STEPS):
        m2.scheduled(0.0, 10)
        m2.finished(1.0)
    assert m2.seconds_per_token() == pytest.approx(0.1)


# --------------------------------------------------------------------------- the rule


def rule(per_token: float = 1e-3, *, enabled: bool = True, threshold: float = 1.0) -> SkipRule:
    return SkipRule(enabled=enabled, threshold=threshold, meter=PrefillMeter(per_token))


def test_a_short_prefix_on_a_slow_tier_is_recomputed_a_long_one_restored() -> None:
    r = rule()
    short = r.decide("short", 16, [shared(3)])  # >= 50 ms to load, 16 ms to recompute
    assert short.skip and short.restore_s is not None and short.recompute_s == pytest.approx(0.016)
    long = r.decide("long", 2048, [shared(10)])  # 3 rounds, ~150 ms, against 2 s
    assert not long.skip
    assert [d.request_id for d in r.recent] == ["short", "long"]
    assert short.tiers == {"shared": 3 << 20} and short.pages == 3


def test_never_skip_without_figures_or_a_cost() -> None:
    assert not rule().decide("a", 16, [shared(3, samples=0)]).skip
    unknown = SkipRule(enabled=True, threshold=1.0, meter=PrefillMeter())
    d = unknown.decide("b", 16, [shared(3)])
    assert not d.skip and d.recompute_s is None


def test_l1_checkpoints_are_always_restored() -> None:
    assert not rule(1e-9).decide("a", 1, [TierLoad("l1", 3, 3 << 20)]).skip


def test_the_threshold_and_the_off_switch() -> None:
    # 16 tokens at 1 ms against one round of 50 ms + 1 ms
    assert rule(threshold=1.0).decide("a", 16, [shared(3)]).skip
    assert not rule(threshold=4.0).decide("a", 16, [shared(3)]).skip
    assert rule(threshold=0.5).decide("a", 40, [shared(3)]).skip
    off = rule(enabled=False).decide("a", 16, [shared(3)])
    assert not off.skip and off.restore_s is not None, "figures are still reported"
    with pytest.raises(ValueError, match="positive"):
        rule(threshold=0.0)


def test_the_options_and_their_defaults() -> None:
    assert OPTION_DEFAULTS["skip_cheaper_recompute"] is True
    assert OPTION_DEFAULTS["recompute_threshold"] == 1.0
    assert OPTION_DEFAULTS["prefill_seconds_per_token"] == 0.0
    o = parse_options(
        {
            "lmcache_rc.checkpoint_identity": IDENTITY,
            "lmcache_rc.skip_cheaper_recompute": False,
            "lmcache_rc.recompute_threshold": 2,
            "lmcache_rc.prefill_seconds_per_token": "2ms",
        },
        speculative=False,
    )
    r = SkipRule.from_options(o)
    assert (r.enabled, r.threshold) == (False, 2.0)
    assert r.meter.seconds_per_token() == pytest.approx(0.002)
    for value in (0, -1, math.inf, "1", True):
        with pytest.raises(InvalidConnectorConfig, match="recompute_threshold"):
            parse_options(
                {
                    "lmcache_rc.checkpoint_identity": IDENTITY,
                    "lmcache_rc.recompute_threshold": value,
                },
                speculative=False,
            )


# --------------------------------------------------------------------------- end to end


def test_on_a_slow_shared_tier_short_prefixes_are_recomputed_and_long_ones_restored() -> None:
    report = run_restore_skip(check=False)
    rows = {row.name: row for row in report.rows}
    first, short, second = rows["long-1"], rows["short"], rows["long-2"]
    # Nothing was measured before the first restore: it restores (and measures).
    assert first.decision == "restore" and first.restore_s is None
    assert first.restored_tokens == first.checkpoint_tokens == 2048
    # The short prefix: at least one fetch latency to load, 16 ms to recompute.
    assert short.decision == "recompute"
    assert short.tier_bytes.keys() == {"shared"} and short.checkpoint_tokens == 16
    assert short.restored_tokens == 0 and short.recomputed_tokens == short.prompt_tokens
    # The other long one: a few fetch latencies against 2 s of recompute.
    assert second.decision == "restore" and second.restore_s is not None
    assert second.restored_tokens == 2048
    assert report.counters["restores_skipped_cheaper_to_recompute"] == 1
    assert report.counters["tokens_recomputed_instead"] == 16
    assert report.counters["restores_published"] == 2
    assert report.shared_figures["shared_load_samples"] > 0
    assert report.shared_figures["shared_load_latency_us"] >= 50_000, "the injected latency"


def test_with_the_rule_off_every_request_restores() -> None:
    report = run_restore_skip(skip=False, check=False)
    assert [row.decision for row in report.rows] == ["restore"] * 3
    assert [row.restored_tokens for row in report.rows] == [2048, 16, 2048]
    assert "restores_skipped_cheaper_to_recompute" not in report.counters
    assert report.counters["restores_published"] == 3


def test_the_cli_prints_the_decisions_and_the_counts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lmcache_rc", "restore-skip", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [row["decision"] for row in report["rows"]] == ["restore", "recompute", "restore"]
    assert report["counters"]["restores_skipped_cheaper_to_recompute"] == 1
