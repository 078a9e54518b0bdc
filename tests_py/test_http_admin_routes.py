"""The HTTP admin API answers what ``docs/operations.md`` ("The HTTP admin API")
says: the routes it lists are exactly the server's, each answers its method
(and 405 to another), ``/status`` and ``/metrics`` carry the service's values,
and ``POST /clear`` reads its query parameters as documented, after the token."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import lmcache_rc as rc
from lmcache_rc import admin
from tests_py.rpc_helpers import make_manifest

DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"


@pytest.fixture
def server() -> Iterator[rc.Server]:
    with rc.Server.start(rc.ServerConfig(l1_bytes=16 << 20)) as running:
        yield running


def call(
    url: str, method: str = "GET", token: str | None = None, scheme: str = "Bearer"
) -> tuple[int, str, str]:
    """(status code, content type, body) of one request, no proxy."""
    headers = {} if token is None else {"Authorization": f"{scheme} {token}"}
    data = b"" if method == "POST" else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=30) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def documented_routes() -> set[str]:
    """``METHOD /path`` of every row of the route table in docs/operations.md."""
    section = DOC.read_text(encoding="utf-8").split("## The HTTP admin API", 1)[1]
    return set(re.findall(r"^\| `((?:GET|POST|PUT|DELETE) /\w+)`", section, re.MULTILINE))


def token_of(server: rc.Server) -> str:
    endpoint = admin.read_admin_file(server.socket_path)
    assert endpoint is not None and endpoint.url == server.http_url
    return endpoint.token


def test_the_documented_routes_are_exactly_the_servers_routes(server: rc.Server) -> None:
    code, _, body = call(f"{server.http_url}/nowhere")
    assert code == 404
    named = set(re.findall(r"(?:GET|POST|PUT|DELETE) /\w+", json.loads(body)["message"]))
    assert named == documented_routes() == {"GET /status", "GET /metrics", "POST /clear"}
    token = token_of(server)
    for route in sorted(named):
        method, path = route.split()
        code, _, body = call(f"{server.http_url}{path}", method, token)
        assert code == 200, (route, body)
        other = "POST" if method == "GET" else "GET"
        code, content_type, body = call(f"{server.http_url}{path}", other, token)
        assert code == 405 and content_type == "application/json", (route, body)
        assert set(json.loads(body)) == {"error", "message"}


def test_status_over_http_has_the_keys_of_the_socket_status(server: rc.Server) -> None:
    code, content_type, body = call(f"{server.http_url}/status")
    assert (code, content_type) == (200, "application/json")
    over_http = json.loads(body)
    over_socket = rc.Client(server.socket_path).status()
    rpc_values = {k for k in over_socket if k.startswith("rpc_")}
    documented = DOC.read_text(encoding="utf-8").split("| `GET /status` |", 1)[1].split("\n")[0]
    assert rpc_values and all(f"`{k}`" in documented for k in rpc_values), rpc_values
    assert set(over_http) == set(over_socket) | {"engines"}
    assert over_http["engines"] == rc.Client(server.socket_path).engines() == []
    for fact in ("version", "socket", "checkpoint_index_path", "l2_path"):
        assert f"`{fact}`" in documented, fact
        assert over_http[fact] == over_socket[fact], fact  # type: ignore[literal-required]
    assert over_http["socket"] == server.socket_path
    assert over_http["misses"] == {}, "only reasons that occurred are listed"


def documented_series() -> dict[str, tuple[str, str]]:
    """``/status`` key -> (series, type) from the table of docs/operations.md
    ("Metrics"): its last column names the status keys each series carries."""
    section = DOC.read_text(encoding="utf-8").split("## Metrics (`GET /metrics`)", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = re.findall(
        r"^\| `(lmcache_rc_\w+)` \| (counter|gauge) \|.*\| ([^|]*) \|$", section, re.M
    )
    return {
        key: (series, kind) for series, kind, keys in rows for key in re.findall(r"`(\w+)`", keys)
    }


def test_metrics_has_the_documented_series_for_every_status_value(server: rc.Server) -> None:
    code, content_type, body = call(f"{server.http_url}/metrics")
    assert (code, content_type) == (200, "text/plain; version=0.0.4; charset=utf-8")
    status = json.loads(call(f"{server.http_url}/status")[2])
    documented = documented_series()
    for name, value in status.items():
        if isinstance(value, str) or value is None:
            continue  # the text facts (version, socket, paths) are not series
        if name == "engines":
            continue  # the engines' reports: their counters are vLLM's series (its /metrics)
        assert name in documented, f"{name} has no row in the metrics table"
        series, kind = documented[name]
        assert f"# TYPE {series} {kind}" in body, (name, series, kind)
        assert re.search(rf"^{series}(\{{.*\}})? \d+$", body, re.M), (name, series)
    # Every miss reason is a series from the start.
    assert 'lmcache_rc_misses_total{reason="not_pending"} 0' in body
    # A store lease for a generation that was never begun misses: not_pending.
    manifest, _ = make_manifest(list(range(48)), world=1)
    lease = rc.Client(server.socket_path).prepare_store(manifest, 0)
    assert lease.status == "miss"
    assert json.loads(call(f"{server.http_url}/status")[2])["misses"] == {"not_pending": 1}
    body = call(f"{server.http_url}/metrics")[2]
    assert 'lmcache_rc_misses_total{reason="not_pending"} 1' in body


def test_clear_reads_force_and_all_tiers_as_documented(server: rc.Server) -> None:
    token = token_of(server)
    url = f"{server.http_url}/clear"

    def cleared(query: str, scheme: str = "Bearer") -> dict[str, object]:
        code, content_type, body = call(f"{url}{query}", "POST", token, scheme)
        assert (code, content_type) == (200, "application/json"), body
        reply: dict[str, object] = json.loads(body)
        assert reply["status"] == "ok"
        fields = reply["cleared"]
        assert isinstance(fields, dict) and set(fields) == {
            "l1_objects",
            "l1_bytes",
            "l2_objects",
            "retired_generations",
            "kept_objects",
        }
        return reply

    omitted = cleared("")
    assert (omitted["force"], omitted["all_tiers"]) == (True, False)
    bare = cleared("?force=false&all_tiers")
    assert (bare["force"], bare["all_tiers"]) == (False, True)
    numbers = cleared("?force=0&all_tiers=1&all_tiers=0")  # the last value wins
    assert (numbers["force"], numbers["all_tiers"]) == (False, False)
    assert cleared("?force=1", scheme="bearer")["force"] is True  # scheme in any case

    for query, message in (
        ("?force=maybe", 'force must be true or false, got "maybe"'),
        ("?forse=true", 'unknown clear parameter "forse"'),
    ):
        code, _, body = call(f"{url}{query}", "POST", token)
        assert code == 400 and message in json.loads(body)["message"], body
        # The token is checked before the query.
        code, _, body = call(f"{url}{query}", "POST")
        assert code == 401 and json.loads(body)["error"] == "Unauthorized", body
