"""``GET /metrics`` of a real ``lmcache-rc serve`` subprocess, read the way
Prometheus reads it: parsed by the ``prometheus_client`` text parsers, checked
against the Prometheus naming conventions (counters end in ``_total``, byte
quantities in ``_bytes``, one ``lmcache_rc_`` prefix, HELP that says what a
series means, labels for dimensions), values moving with stores and restores,
and the Grafana dashboard in ``docs/`` querying only series the sidecar
exports."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

import lmcache_rc as rc
from tests_py.rpc_helpers import make_manifest, restore_rank, store_rank
from tests_py.sidecar_helpers import start_sidecar

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json"
L2_BYTES = 64 << 20

# Families every scrape carries: name -> (type, label that tells values apart).
EXPECTED: dict[str, tuple[str, str | None]] = {
    "lmcache_rc_generations": ("gauge", None),
    "lmcache_rc_pending_generations": ("gauge", None),
    "lmcache_rc_leases": ("gauge", "kind"),
    "lmcache_rc_pins": ("gauge", None),
    "lmcache_rc_objects": ("gauge", None),
    "lmcache_rc_tier_objects": ("gauge", "tier"),
    "lmcache_rc_tier_used_bytes": ("gauge", "tier"),
    "lmcache_rc_tier_capacity_bytes": ("gauge", "tier"),
    "lmcache_rc_l2_queued_objects": ("gauge", None),
    "lmcache_rc_l2_written_bytes": ("counter", None),
    "lmcache_rc_lookups": ("counter", "result"),
    "lmcache_rc_retrieve_hits": ("counter", None),
    "lmcache_rc_restored_pages": ("counter", None),
    "lmcache_rc_restored_tokens": ("counter", None),
    "lmcache_rc_misses": ("counter", "reason"),
    "lmcache_rc_begins_refused": ("counter", "reason"),
    "lmcache_rc_published_generations": ("counter", None),
    "lmcache_rc_store_pages": ("counter", "result"),
    "lmcache_rc_store_leased_bytes": ("counter", None),
    "lmcache_rc_store_committed_bytes": ("counter", None),
    "lmcache_rc_evicted_generations": ("counter", None),
    "lmcache_rc_evicted_objects": ("counter", "tier"),
    "lmcache_rc_l2_errors": ("counter", "kind"),
    "lmcache_rc_reclaimed_leases": ("counter", "kind"),
    "lmcache_rc_clears": ("counter", None),
    "lmcache_rc_tier_load_latency_microseconds": ("gauge", "tier"),
    "lmcache_rc_tier_load_rate": ("gauge", "tier"),
    "lmcache_rc_tier_loads_measured": ("counter", "tier"),
}


OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def get(url: str, accept: str | None = None) -> tuple[str, str]:
    """GET ``url``: (Content-Type, body)."""
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=30) as reply:
        assert reply.status == 200
        return reply.headers["Content-Type"], reply.read().decode()


def shape(families: dict[str, Metric]) -> dict[str, tuple[str, str, frozenset[tuple[str, str]]]]:
    """Each sample's (family, type, labels) by sample name and labels."""
    return {
        f"{s.name}{sorted(s.labels.items())}": (f.name, f.type, frozenset(s.labels.items()))
        for f in families.values()
        for s in f.samples
    }


class Scrape:
    """One ``GET /metrics`` as a plain Prometheus text client makes it (no
    ``Accept``: the Prometheus text format 0.0.4), parsed by
    ``prometheus_client``'s text parser; plus one as Prometheus makes it
    (``Accept: application/openmetrics-text``), parsed by its OpenMetrics
    parser, which must describe the same families, types and series."""

    def __init__(self, url: str) -> None:
        self.content_type, self.text = get(url + "/metrics")
        self.families = {f.name: f for f in text_string_to_metric_families(self.text)}
        self.om_content_type, self.om_text = get(url + "/metrics", OPENMETRICS)
        self.om_families = {f.name: f for f in openmetrics_families(self.om_text)}
        assert shape(self.om_families) == shape(self.families)

    def samples(self) -> Iterator[Sample]:
        for family in self.families.values():
            yield from family.samples

    def value(self, sample: str, **labels: str) -> float:
        """The value of the one sample named ``sample`` with ``labels``."""
        found = [s.value for s in self.samples() if s.name == sample and s.labels == labels]
        assert len(found) == 1, (sample, labels, found)
        return found[0]


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A running sidecar with a bounded L2: (socket, HTTP URL)."""
    proc, lines = start_sidecar(tmp_path, "--l2-bytes", str(L2_BYTES))
    url = next(line.split()[-1] for line in lines if "http admin" in line)
    yield str(tmp_path / "side.sock"), url
    stop(proc)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def exercise(socket: str) -> dict[str, int]:
    """Stores two generations sharing pages and restores one, plus a lookup
    that misses and a restore of an unpublished generation; returns what was
    done (pages offered, written, reused; tokens restored, pages restored)."""
    with rc.Client(socket) as client:
        first, _ = make_manifest(list(range(48)), world=1)
        assert client.begin(first)
        assert store_rank(client, first, 0)
        # Same first 48 tokens: its first three attention pages are the
        # first generation's (stored once), the rest are new.
        second, _ = make_manifest(list(range(80)), world=1)
        assert client.begin(second)
        assert store_rank(client, second, 0)
        found = client.find([first.prefix])
        assert found is not None and found.generation == first.generation
        other, _ = make_manifest([7] * 32, world=1)
        assert client.find([other.prefix]) is None
        assert restore_rank(client, first, 0)
        assert not restore_rank(client, other, 0)
    # Pages per manifest: attention pages (one per 16 tokens) + recurrent + auxiliary.
    first_pages, second_pages = 3 + 2, 5 + 2
    return {
        "offered": first_pages + second_pages,
        "reused": 3,
        "written": first_pages + second_pages - 3,
        "restored_pages": first_pages,
        "restored_tokens": 48,
    }


def test_metrics_follow_the_prometheus_conventions(sidecar: tuple[str, str]) -> None:
    socket, url = sidecar
    exercise(socket)
    scrape = Scrape(url)
    assert scrape.content_type == "text/plain; version=0.0.4; charset=utf-8"
    assert scrape.om_content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert scrape.om_text.rstrip().endswith("# EOF")
    # The text format names a counter's HELP and TYPE after its samples.
    helps = {
        line.split()[2]: line.split(" ", 3)[3]
        for line in scrape.text.splitlines()
        if line.startswith("# HELP ")
    }
    for name, family in scrape.families.items():
        assert name.startswith("lmcache_rc_"), name
        assert family.type in ("counter", "gauge"), (name, family.type)
        help_text = helps[name + "_total" if family.type == "counter" else name]
        assert family.documentation == help_text
        assert scrape.om_families[name].documentation == help_text
        words = help_text.lower().rstrip(".").replace(" ", "_")
        assert words not in (name, name.removeprefix("lmcache_rc_")), name
        assert len(help_text.split()) >= 5, (name, help_text)
        assert not name.endswith("_total"), name
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name == name + "_total", (name, sample.name)
            else:
                assert sample.name == name, (name, sample.name)
            assert sample.value >= 0, sample
        if "bytes" in name:
            assert name.endswith("_bytes"), name
    for name, (kind, label) in EXPECTED.items():
        assert name in scrape.families, f"{name} missing"
        family = scrape.families[name]
        assert family.type == kind, (name, family.type)
        label_names = {tuple(sorted(s.labels)) for s in family.samples}
        assert label_names == {(label,) if label else ()}, (name, label_names)

    # Dimensions are labels, with every value present from the start.
    def label_values(name: str, label: str) -> set[str]:
        return {s.labels[label] for s in scrape.families[name].samples}

    assert label_values("lmcache_rc_tier_used_bytes", "tier") == {"L1", "L2"}
    assert label_values("lmcache_rc_tier_capacity_bytes", "tier") == {"L1", "L2"}
    assert label_values("lmcache_rc_tier_load_latency_microseconds", "tier") == {"L2", "shared"}
    assert label_values("lmcache_rc_leases", "kind") == {"store", "retrieve"}
    assert label_values("lmcache_rc_lookups", "result") == {"hit", "miss"}
    assert label_values("lmcache_rc_store_pages", "result") == {"written", "reused"}
    assert {"not_listed", "capacity", "busy", "lost_object"} <= label_values(
        "lmcache_rc_misses", "reason"
    )
    assert scrape.value("lmcache_rc_tier_capacity_bytes", tier="L1") == 8 << 20
    assert scrape.value("lmcache_rc_tier_capacity_bytes", tier="L2") == L2_BYTES


def test_metrics_counters_move_with_stores_and_restores(sidecar: tuple[str, str]) -> None:
    socket, url = sidecar
    before = Scrape(url)
    assert before.value("lmcache_rc_retrieve_hits_total") == 0
    assert before.value("lmcache_rc_generations") == 0
    done = exercise(socket)
    after = Scrape(url)

    def grew(sample: str, **labels: str) -> float:
        return after.value(sample, **labels) - before.value(sample, **labels)

    assert grew("lmcache_rc_published_generations_total") == 2
    assert after.value("lmcache_rc_generations") == 2
    assert grew("lmcache_rc_store_pages_total", result="written") == done["written"]
    assert grew("lmcache_rc_store_pages_total", result="reused") == done["reused"]
    assert grew("lmcache_rc_store_committed_bytes_total") == done["written"] * 4096
    assert grew("lmcache_rc_lookups_total", result="hit") == 1
    assert grew("lmcache_rc_lookups_total", result="miss") == 1
    assert grew("lmcache_rc_retrieve_hits_total") == 1
    assert grew("lmcache_rc_restored_pages_total") == done["restored_pages"]
    assert grew("lmcache_rc_restored_tokens_total") == done["restored_tokens"]
    assert grew("lmcache_rc_misses_total", reason="not_listed") == 1
    assert after.value("lmcache_rc_tier_objects", tier="L1") == done["written"]
    assert after.value("lmcache_rc_tier_used_bytes", tier="L1") == done["written"] * 4096
    assert after.value("lmcache_rc_leases", kind="store") == 0
    assert after.value("lmcache_rc_leases", kind="retrieve") == 0
    # The same numbers as the JSON status.
    with urllib.request.urlopen(url + "/status", timeout=30) as reply:
        status = json.loads(reply.read())
    assert after.value("lmcache_rc_retrieve_hits_total") == status["hits"]
    assert after.value("lmcache_rc_restored_tokens_total") == status["restored_tokens"]
    assert after.value("lmcache_rc_tier_used_bytes", tier="L1") == status["l1_bytes"]
    # Counters never go down, even across a clear that empties the tiers
    # (once the L2 writes drained: a page being written is kept).
    with rc.Client(socket) as client:
        deadline = time.monotonic() + 30
        while client.status()["l2_queue"] != 0:
            assert time.monotonic() < deadline, "L2 writes never drained"
            time.sleep(0.01)
        report = client.clear(True, True)
        assert report["kept_objects"] == 0, report
    cleared = Scrape(url)
    assert cleared.value("lmcache_rc_clears_total") == after.value("lmcache_rc_clears_total") + 1
    assert cleared.value("lmcache_rc_tier_objects", tier="L1") == 0
    for family in after.families.values():
        if family.type == "counter":
            for s in family.samples:
                assert cleared.value(s.name, **s.labels) >= s.value, s


# PromQL words that are not series names.
PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) of every target of every panel."""
    board = json.loads(DASHBOARD.read_text())
    queries = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            queries.append((panel["title"], target["expr"]))
    return queries


def series_in(expr: str) -> tuple[set[str], set[tuple[str, str, str]]]:
    """The series names an expression reads, and its equality matchers
    (series, label, value)."""
    matchers = {
        (name, label, value)
        for name, body in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}", expr)
        for label, value in re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"]*)"', body)
    }
    bare = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # range selectors
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    bare = re.sub(r'"[^"]*"', "", bare)
    names = {
        word
        for word in re.findall(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", bare)
        if word.lower() not in PROMQL_WORDS
    }
    return names, matchers


def test_the_grafana_dashboard_queries_only_series_the_sidecar_exports(
    sidecar: tuple[str, str],
) -> None:
    socket, url = sidecar
    exercise(socket)
    scrape = Scrape(url)
    exported = {s.name for s in scrape.samples()}
    board = json.loads(DASHBOARD.read_text())
    variables = board["templating"]["list"]
    datasource = [v for v in variables if v["type"] == "datasource"]
    assert len(datasource) == 1 and datasource[0]["query"] == "prometheus", datasource
    uid = "${" + datasource[0]["name"] + "}"
    titles = {panel["title"] for panel in board["panels"]}
    for wanted in ("Restore hit rate", "L1 / L2 fill", "Write dedup ratio", "Leases", "Evictions"):
        assert any(wanted.lower() in t.lower() for t in titles), (wanted, titles)
    queries = dashboard_queries()
    assert len(queries) >= 8
    used: set[str] = set()
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        assert panel.get("description"), panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == uid, panel["title"]
    for title, expr in queries:
        names, matchers = series_in(expr)
        assert names, (title, expr)
        for name in names:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in exported or base in exported, f"{title}: {name} is not exported"
        for name, label, value in matchers:
            assert any(s.name == name and s.labels.get(label) == value for s in scrape.samples()), (
                f"{title}: no {name}{{{label}={value!r}}}"
            )
        used |= names
    # The panels the task names are fed by the series that carry them.
    for name in (
        "lmcache_rc_lookups_total",
        "lmcache_rc_restored_tokens_total",
        "lmcache_rc_tier_used_bytes",
        "lmcache_rc_tier_capacity_bytes",
        "lmcache_rc_store_pages_total",
        "lmcache_rc_leases",
        "lmcache_rc_evicted_objects_total",
    ):
        assert name in used, name


def test_the_dashboard_checker_sees_every_series_and_matcher() -> None:
    names, matchers = series_in(
        'sum by (tier) (rate(lmcache_rc_evicted_objects_total{tier="L1"}[$__rate_interval]))'
        " / on () group_left lmcache_rc_tier_capacity_bytes"
        ' + histogram_quantile(0.9, rate(x_bucket{le="1"}[5m])) or vector(0)'
    )
    assert names == {
        "lmcache_rc_evicted_objects_total",
        "lmcache_rc_tier_capacity_bytes",
        "x_bucket",
    }
    assert matchers == {("lmcache_rc_evicted_objects_total", "tier", "L1"), ("x_bucket", "le", "1")}
