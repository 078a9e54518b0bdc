"""The dict results of the native API have exactly the keys their TypedDicts
(``lmcache_rc.results``) name, so the stubs' types describe what comes back."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from rpc_helpers import make_manifest

import lmcache_rc as rc
from lmcache_rc import results


def keys_of(shape: type) -> set[str]:
    """The keys a TypedDict declares, inherited ones included."""
    declared: frozenset[str] = shape.__required_keys__ | shape.__optional_keys__  # type: ignore[attr-defined]
    return set(declared)


def assert_shape(value: Mapping[str, object], shape: type) -> None:
    """Every declared key present, no other key."""
    assert set(value) == keys_of(shape), (sorted(set(value) ^ keys_of(shape)), shape.__name__)


def config(tmp_path: Path) -> rc.ServerConfig:
    return rc.ServerConfig(
        socket=str(tmp_path / "s.sock"),
        l1_bytes=4 << 20,
        http_port=-1,
    )


def test_service_and_server_results_match_their_typed_dicts(tmp_path: Path) -> None:
    with rc.Server.start(config(tmp_path), temp_socket=True) as server:
        with rc.Client(server.socket_path) as client:
            assert_shape(client.capabilities(), results.Capabilities)
            status = client.status()
            assert_shape(status, results.RpcStatus)
            facts = {"misses", "version", "socket", "checkpoint_index_path", "l2_path"}
            assert all(isinstance(v, int) for k, v in status.items() if k not in facts)
            assert status["socket"] == server.socket_path and status["l2_path"] is None
            assert_shape(server.status(), results.RpcStatus)
            m, token_roots = make_manifest(list(range(32)), world=1)
            assert client.begin(m)
            lease = client.prepare_store(m, 0)
            for arrays in client.lease_arrays(lease):
                for arr in arrays:
                    if arr is not None:
                        arr[:] = 7
            assert client.finish_store(lease.lease_id or "", True)
            rows = client.list_generations()
            assert len(rows) == 1
            assert_shape(rows[0], results.GenerationInfo)
            batch = client.changes(0, [m.generation])
            assert_shape(batch, results.ChangeBatch)
            assert_shape(batch["changes"][0], results.Change)
            assert batch["watched"] == ["l1"]
            located = client.find_located(token_roots.roots)
            assert located is not None and set(located) == {"manifest", "tiers"}
            assert located["manifest"] == m
            (tier,) = located["tiers"]
            assert_shape(tier, results.TierLoad)
            assert (tier["tier"], tier["samples"], tier["parallelism"]) == ("l1", 0, 1)
            assert tier["bytes"] == sum(
                g["page_bytes"] * len(g["positions"]) for g in m.page_groups()
            )
            other = rc.TokenRoots.build(m.prefix.namespace, [7, 7, 7]).roots
            assert client.find_located_async(other).result(timeout=30) is None
            client.report_engine("engine-a", {"lookups": 3, "restores_done": 1})
            (report,) = client.engines()
            assert_shape(report, results.EngineReport)
            assert report["counters"] == {"lookups": 3, "restores_done": 1}
            assert client.engines_async().result(timeout=30)[0]["engine"] == "engine-a"
            assert_shape(client.clear(), results.ClearReport)
            assert_shape(client.status_async().result(timeout=30), results.RpcStatus)
            assert_shape(m.page_groups()[0], results.PageGroup)
        assert_shape(server.stop(), results.StopReport)
    service = rc.CheckpointService(config(tmp_path))
    assert_shape(service.status(), results.ServiceStatus)
    service.close()


def test_directory_results_match_their_typed_dicts() -> None:
    directory = rc.Directory()
    m, _ = make_manifest(list(range(16)), world=1)
    assert directory.begin(m) and directory.acknowledge(m.generation, 0)
    assert_shape(directory.status(), results.DirectoryStatus)
    assert_shape(directory.list()[0], results.ListedGeneration)
    directory.close()
