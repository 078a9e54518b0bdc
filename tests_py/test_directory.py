"""rc.Directory through its public Python API.

The contract: docs/design/manifests.md#the-directorys-contract.

The Rust suite (tests_rs/index_*) pins the behaviour in depth; these tests prove
the binding: types in and out, errors mapped to lmcache_rc.errors, restart via a
file path, and that bad input leaves the directory usable.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

import lmcache_rc as rc
from lmcache_rc import errors

NS = "weights-layout-salt-a"


def prefix(tail: tuple[int, ...] = (1, 2), start: int = 4096, ns: str = NS) -> rc.Prefix:
    return rc.Prefix(ns, start, b"a" * 32, list(tail))


def manifest(
    generation: str = "g1", p: rc.Prefix | None = None, world: int = 4, extra: str = ""
) -> rc.Manifest:
    payload = json.dumps({"schema_version": 1, "x": extra}).encode()
    return rc.Manifest(generation, p or prefix(), world, payload)


def publish(d: rc.Directory, m: rc.Manifest) -> None:
    assert d.begin(m)
    results = [d.acknowledge(m.generation, r) for r in range(m.world_size)]
    assert results == [False] * (m.world_size - 1) + [True]


def test_only_the_complete_distinct_rank_set_publishes() -> None:
    d = rc.Directory()
    m = manifest()
    assert d.begin(m)
    assert not d.begin(m)
    for rank in (0, 0, 1, 2, 2):
        assert not d.acknowledge(m.generation, rank)
        assert d.find([prefix()]) is None
    with pytest.raises(errors.InvalidInput, match="rank"):
        d.acknowledge(m.generation, 4)
    with pytest.raises(errors.InvalidInput, match="rank"):
        d.acknowledge(m.generation, -1)
    assert d.acknowledge(m.generation, 3)
    assert d.find([prefix()]) == m
    assert not d.acknowledge(m.generation, 3)
    assert d.status()["published_generations"] == 1


def test_published_entries_survive_restart_and_pending_ones_do_not(tmp_path: Path) -> None:
    path = tmp_path / "dir.sqlite"
    d = rc.Directory(path)
    published = manifest("published")
    publish(d, published)
    partial = manifest("partial", prefix((1, 2, 3)))
    assert d.begin(partial)
    d.acknowledge("partial", 0)
    assert d.status()["pending_generations"] == 1
    d.close()
    with pytest.raises(errors.Closed):
        d.find([prefix()])

    d = rc.Directory(str(path))
    assert d.status()["published_generations"] == 1
    assert d.status()["pending_generations"] == 0
    assert not d.acknowledge("partial", 1)
    assert d.find([prefix((1, 2, 3))]) == published
    assert not d.begin(published), "identical begin after restart is suppressed"
    with pytest.raises(errors.GenerationConflict, match="changed after publication"):
        d.begin(manifest("published", extra="different"))
    d.close()


def test_longest_whole_token_match_wins_and_namespaces_cannot_mix() -> None:
    d = rc.Directory()
    publish(d, manifest("short", prefix((1,))))
    publish(d, manifest("long", prefix((1, 2, 3))))
    publish(d, manifest("decoy", prefix((1, 20))))
    found = d.find([prefix((1, 2, 3, 4))])
    assert found is not None and found.generation == "long"
    found = d.find([prefix((1, 2))])
    assert found is not None and found.generation == "short"
    assert d.find([prefix((12, 3))]) is None
    with pytest.raises(errors.InvalidInput, match="cannot mix namespaces"):
        d.find([prefix(), prefix(ns="other")])
    assert [m.generation for m in d.ancestors([prefix((1, 2, 3, 4))], 5000)] == ["short", "long"]


def test_invalidate_is_generation_scoped_and_replacement_is_atomic() -> None:
    d = rc.Directory()
    first = manifest("first")
    publish(d, first)
    second = manifest("second", extra="v2")
    assert d.begin(second)
    d.acknowledge("second", 0)
    assert d.find([prefix()]) == first, "partial replacement is invisible"
    for rank in (1, 2, 3):
        d.acknowledge("second", rank)
    assert d.find([prefix()]) == second
    assert not d.invalidate("first"), "the replaced generation is already gone"
    assert d.find([prefix()]) == second
    assert d.invalidate("second")
    assert d.find([prefix()]) is None


def test_capacities_must_be_positive_integers() -> None:
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(errors.InvalidInput, match="positive integers"):
            rc.Directory(max_entries=bad)  # type: ignore[arg-type]
        with pytest.raises(errors.InvalidInput, match="positive integers"):
            rc.Directory(max_pending=bad)  # type: ignore[arg-type]


def test_lru_capacity_evicts_the_least_recently_found() -> None:
    d = rc.Directory(max_entries=2)
    publish(d, manifest("a", prefix((1,))))
    publish(d, manifest("b", prefix((5,))))
    assert d.find([prefix((1, 9))]) is not None  # refresh "a"
    publish(d, manifest("c", prefix((7,))))
    assert d.get("b") is None
    assert d.get("a") is not None and d.get("c") is not None


def test_bad_input_is_refused_with_typed_errors_and_the_directory_stays_usable(
    tmp_path: Path,
) -> None:
    d = rc.Directory(tmp_path / "d.sqlite")
    good = manifest("good")
    publish(d, good)
    with pytest.raises(errors.InvalidType):
        d.find(["not a prefix"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        d.begin("not a manifest")  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidInput):
        rc.Manifest("g", prefix(), 0, b'{"schema_version":1}')
    with pytest.raises(errors.InvalidInput):
        rc.Manifest("g", prefix(), 1025, b'{"schema_version":1}')
    with pytest.raises(errors.InvalidInput, match="16 MiB"):
        rc.Manifest("g", prefix(), 1, b" " * (16 * 1024 * 1024 + 1))
    with pytest.raises(errors.InvalidInput):
        rc.Manifest("g", prefix(), 1, b"not json")
    with pytest.raises(errors.InvalidInput):
        d.abort_stale(-1.0)
    assert d.begin(manifest("pending"))
    with pytest.raises(errors.GenerationConflict, match="changed during store"):
        d.begin(manifest("pending", extra="other"))
    assert d.find([prefix()]) == good
    assert d.status()["published_generations"] == 1
    d.close()


def test_a_newer_or_foreign_database_is_refused_and_left_untouched(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"this is not a database" * 100)
    before = garbage.read_bytes()
    with pytest.raises(errors.UnsupportedFormat):
        rc.Directory(garbage)
    assert garbage.read_bytes() == before


def test_abort_stale_releases_old_pending_generations() -> None:
    d = rc.Directory()
    m = manifest()
    assert d.begin(m)
    assert d.abort_stale(3600.0) == []
    assert d.abort_stale(0.0) == [m.generation]
    assert d.begin(m), "an aborted generation can be begun again"


def test_durability_and_listing_are_exposed() -> None:
    d = rc.Directory()
    publish(d, manifest("a", prefix((1,))))
    listed = d.list()
    assert [entry["manifest"].generation for entry in listed] == ["a"]
    assert listed[0]["durable"] is False
    assert isinstance(d.flush_recency(), int)


def test_exactly_one_of_eight_threads_publishes() -> None:
    d = rc.Directory()
    m = manifest()
    assert d.begin(m)
    barrier = threading.Barrier(8)
    results: list[bool] = []
    lock = threading.Lock()

    def ack(rank: int) -> None:
        barrier.wait()
        r = d.acknowledge(m.generation, rank)
        with lock:
            results.append(r)

    threads = [threading.Thread(target=ack, args=(r % 4,)) for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]
    assert d.find([prefix()]) == m


def test_find_and_ancestors_take_token_roots_and_answer_as_their_prefixes() -> None:
    ns = "recurrent-sha256-v1:roots"
    d = rc.Directory()
    tokens = list(range(1, 24))
    roots = rc.TokenRoots.build(ns, tokens, 4)
    for n in (2, 4, 7, 13, 16):
        publish(d, manifest(f"p{n}", roots.prefix(n), world=1))
    for length in (1, 3, 4, 5, 9, 13, 15, 16, 17, 23):
        query = rc.TokenRoots.build(ns, tokens[:length], 4)
        assert d.find(query) == d.find(query.roots), length
        assert d.find(query) == d.find(list(query.roots)), length
        for below in (0, 5, 14, 40):
            assert d.ancestors(query, below) == d.ancestors(query.roots, below)
    hit = d.find(rc.TokenRoots.build(ns, tokens, 4))
    assert hit is not None and hit.generation == "p16"
    assert d.find(rc.TokenRoots.build(ns, [], 4)) is None
    assert d.find(iter(())) is None
    with pytest.raises(errors.InvalidType, match="TokenRoots or an iterable"):
        d.find(42)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidType):
        d.ancestors([roots], 10)  # type: ignore[list-item]


def test_mark_durable_marks_a_batch_and_reports_which_are_published(tmp_path: Path) -> None:
    path = tmp_path / "d.sqlite"
    d = rc.Directory(path)
    for g, tail in (("a", (1,)), ("b", (2,)), ("c", (3,))):
        publish(d, manifest(g, prefix(tail)))
    assert d.mark_durable(["a", "missing", "c"]) == [True, False, True]
    assert d.mark_durable([]) == []
    with pytest.raises(TypeError):
        d.mark_durable("a")  # a str is not a batch of generations
    status = d.status()
    assert status["durable_generations"] == 2
    assert status["durability_fsyncs"] == 1
    assert status["publish_transactions"] == 3
    d.close()
    d = rc.Directory(path)
    durable = {e["manifest"].generation: e["durable"] for e in d.list()}
    assert durable == {"a": True, "b": False, "c": True}
