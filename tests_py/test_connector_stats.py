"""The connector's counters on vLLM's own connector-stats path
(:mod:`lmcache_rc.vllm.stats`), and one log line per sidecar outage
(:class:`lmcache_rc.vllm.sidecar.NonBlockingSidecar`).

vLLM itself is not installed here: the classes derive from the stand-ins of
:mod:`lmcache_rc.vllm.api`; ``tests_vllm/`` and the serving suite run the
same classes under vLLM's scheduler and OpenAI server.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

import lmcache_rc as rc
from lmcache_rc.connector import LMCacheRecurrentCheckpointConnector
from lmcache_rc.vllm.sidecar import NonBlockingSidecar, SidecarDown
from lmcache_rc.vllm.stats import CheckpointConnectorStats, CheckpointPromMetrics, StatsFeed


def test_the_feed_reports_only_what_changed_since_the_last_step() -> None:
    feed = StatsFeed()
    first = feed.take({"lookups": 2, "restores_done": 1}, {"pinned_blocks": 3})
    assert first is not None
    assert first.counters == {"lookups": 2, "restores_done": 1}
    assert first.gauges == {"pinned_blocks": 3.0}
    assert feed.take({"lookups": 2, "restores_done": 1}, {"pinned_blocks": 3}) is None
    second = feed.take({"lookups": 5, "restores_done": 1, "lookup_miss": 1}, {"pinned_blocks": 3})
    assert second is not None
    assert second.counters == {"lookups": 3, "lookup_miss": 1}
    # a gauge that moved alone is news too, and every gauge rides along
    third = feed.take({"lookups": 5, "restores_done": 1, "lookup_miss": 1}, {"pinned_blocks": 0})
    assert third is not None and third.counters == {} and third.gauges == {"pinned_blocks": 0.0}


def test_stats_fold_counters_by_adding_and_gauges_by_replacing() -> None:
    a = CheckpointConnectorStats({"counters": {"lookups": 2}, "gauges": {"tasks_store": 4.0}})
    b = CheckpointConnectorStats(
        {"counters": {"lookups": 1, "stores_failed": 1}, "gauges": {"tasks_store": 1.0}}
    )
    folded = a.aggregate(b)
    assert folded.counters == {"lookups": 3, "stores_failed": 1}
    assert folded.gauges == {"tasks_store": 1.0}
    assert folded.reduce() == {"lookups": 3, "stores_failed": 1, "tasks_store": 1.0}
    folded.aggregate(CheckpointConnectorStats({"counters": {"hook_start_load_kv_us": 9}}))
    assert "hook_start_load_kv_us" not in folded.reduce(), "costs go to /metrics, not the log"
    assert not folded.is_empty()
    folded.reset()
    assert folded.is_empty() and folded.reduce() == {}


def test_the_api_server_rebuilds_the_payload_it_was_sent() -> None:
    """vLLM ships ``to_dict()`` between processes and rebuilds it with the
    connector class's ``build_kv_connector_stats``."""
    sent = CheckpointConnectorStats({"counters": {"restores_done": 7}, "gauges": {"requests": 2}})
    rebuilt = LMCacheRecurrentCheckpointConnector.build_kv_connector_stats(sent.to_dict())
    assert isinstance(rebuilt, CheckpointConnectorStats)
    assert rebuilt.counters == {"restores_done": 7} and rebuilt.gauges == {"requests": 2}
    empty = LMCacheRecurrentCheckpointConnector.build_kv_connector_stats(None)
    assert empty is not None and empty.is_empty()


def _metric_types(registry: CollectorRegistry) -> dict[type[Any], type[Any]]:
    """Prometheus metric classes bound to ``registry`` (vLLM hands over its own)."""

    def bound(cls: type[Any]) -> type[Any]:
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kw: Any) -> None:
                kw.pop("multiprocess_mode", None)
                super().__init__(*args, registry=registry, **kw)

        return Bound

    return {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}


def test_prometheus_series_carry_each_counter_and_gauge_per_engine() -> None:
    registry = CollectorRegistry()

    class Config:
        kv_transfer_config = None

    prom = LMCacheRecurrentCheckpointConnector.build_prom_metrics(
        Config(), _metric_types(registry), ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]}
    )
    assert isinstance(prom, CheckpointPromMetrics)
    prom.observe({"counters": {"restores_done": 2, "lookups": 3}, "gauges": {"tasks_store": 4}}, 0)
    prom.observe({"counters": {"restores_done": 1}, "gauges": {"tasks_store": 0}}, 0)
    prom.observe({"counters": {"lookups": 5}, "gauges": {}}, 1)
    text = generate_latest(registry).decode()
    assert (
        'vllm:lmcache_rc_events_total{engine="0",event="restores_done",model_name="m"} 3.0' in text
    )
    assert 'vllm:lmcache_rc_events_total{engine="0",event="lookups",model_name="m"} 3.0' in text
    assert 'vllm:lmcache_rc_events_total{engine="1",event="lookups",model_name="m"} 5.0' in text
    assert 'vllm:lmcache_rc_state{engine="0",model_name="m",state="tasks_store"} 0.0' in text


def test_a_worker_rank_reports_its_copies_and_the_time_vllm_spent_in_it() -> None:
    """A rank's statistics are its copies' cost (from its copy worker) and
    the time spent in the connector's hooks, added to the scheduler's by vLLM."""
    from collections import Counter

    from lmcache_rc.vllm.stats import StatsFeed
    from lmcache_rc.vllm.worker import WorkerHooks

    class Side(WorkerHooks):
        def stats(self) -> tuple[dict[str, int], dict[str, float]]:
            return {"copies_store": 2, "copy_store_copy_us": 40}, {"rank0_copies_in_flight": 1}

    connector = LMCacheRecurrentCheckpointConnector.__new__(LMCacheRecurrentCheckpointConnector)
    connector._is_scheduler = False
    connector._local = None
    connector._worker_side = Side()
    connector._stats_feed = StatsFeed()
    connector._stats_failed = False
    connector._hook_ns = Counter({"hook_wait_for_save_us": 5_000_000})
    stats = connector.get_kv_connector_stats()
    assert stats is not None
    assert stats.counters["copies_store"] == 2 and stats.counters["copy_store_copy_us"] == 40
    # the call itself is timed too
    assert stats.counters["hook_wait_for_save_us"] == 5000
    assert "hook_get_kv_connector_stats_us" in connector._hook_ns
    assert stats.gauges == {"rank0_copies_in_flight": 1.0}


class _Link:
    """A fake client whose connection can drop (``connected``)."""

    def __init__(self) -> None:
        self.connected = True
        self.back = threading.Event()

    def find_async(self, roots: object) -> object:
        return "future"

    def capabilities(self) -> dict[str, int]:
        if not self.back.wait(10):
            raise rc.errors.Unavailable("still down")
        self.connected = True
        return {}


def test_an_outage_is_logged_once_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    """While the sidecar is down every request is served without it: calls
    fail at once with :class:`SidecarDown` (callers count them quietly), and
    the log has one warning when it went and one when it came back, not a
    line per request or per reconnect attempt."""
    fake = _Link()
    link = NonBlockingSidecar(fake, retry_interval=0.0)  # type: ignore[arg-type]
    caplog.set_level(logging.DEBUG, logger="lmcache_rc")
    assert link.find_async([]) == "future" and link.available
    fake.connected = False
    for _ in range(50):
        with pytest.raises(SidecarDown):
            link.find_async([])
    assert not link.available
    fake.back.set()
    deadline = time.monotonic() + 10
    while not fake.connected:
        assert time.monotonic() < deadline, "no background reconnect"
        time.sleep(0.01)
    assert link.find_async([]) == "future"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "lost the connection to the sidecar" in warnings[0]
    assert "reachable again" in warnings[1] and "50 lookups and stores" in warnings[1]
    assert link.outages == 1


def test_the_cli_hides_the_same_cost_counters_as_vllms_log_line() -> None:
    from lmcache_rc import cli
    from lmcache_rc.vllm import stats

    assert cli.COST_PREFIXES == stats.COST_PREFIXES
