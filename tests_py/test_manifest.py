"""Manifest validation, value semantics and page groups.

Design: docs/design/manifests.md#the-envelope-manifestnew (envelope) and
docs/design/manifests.md#page-groups-payloadschemaparse (payload page groups).
"""

from __future__ import annotations

import copy
import json
import pickle
from typing import Any

import pytest

import lmcache_rc as rc
from lmcache_rc.errors import InvalidInput

MIB16 = 16 * 1024 * 1024
SCHEMA1 = b'{"schema_version":1}'
KEY_A = "ab" * 32
KEY_B = "0123456789abcdef" * 4


def _prefix() -> rc.Prefix:
    return rc.Prefix("weights-layout-salt-a", 4096, b"a" * 32, (1, 2))


def _payload(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _group(name: str = "g", page_bytes: int = 128, positions: Any = (0,), **extra: Any) -> dict:
    return {"name": name, "page_bytes": page_bytes, "positions": list(positions), **extra}


def _manifest(payload: bytes, generation: str = "gen-1", world_size: int = 4) -> rc.Manifest:
    return rc.Manifest(generation, _prefix(), world_size, payload)


# --------------------------------------------------------------------------- envelope


def test_manifest_exposes_its_four_fields_and_schema_version() -> None:
    m = _manifest(SCHEMA1)
    assert m.generation == "gen-1"
    assert m.prefix == _prefix()
    assert m.world_size == 4
    assert m.payload == SCHEMA1
    assert isinstance(m.payload, bytes)
    assert m.schema_version == 1
    assert _manifest(b'{"schema_version":2}').schema_version == 2


@pytest.mark.parametrize("generation", ["", "g" * 129, "\u00e9" * 129])
def test_manifest_generation_must_have_1_to_128_characters(generation: str) -> None:
    with pytest.raises(InvalidInput) as info:
        _manifest(SCHEMA1, generation=generation)
    assert str(info.value) == "checkpoint generation must contain 1..128 characters"


@pytest.mark.parametrize("generation", ["g", "g" * 128, "\u00e9" * 128, "\U0001f642" * 128])
def test_manifest_generation_limit_counts_characters(generation: str) -> None:
    assert _manifest(SCHEMA1, generation=generation).generation == generation


@pytest.mark.parametrize("world_size", [0, -1, 1025, 2**32 + 4, 2**70, True, False, 4.0, "4"])
def test_manifest_world_size_must_be_an_int_in_1_to_1024(world_size: Any) -> None:
    with pytest.raises(InvalidInput) as info:
        _manifest(SCHEMA1, world_size=world_size)
    assert str(info.value) == "checkpoint world size must be in 1..1024"


@pytest.mark.parametrize("world_size", [1, 2, 1024])
def test_manifest_world_size_limits_are_inclusive(world_size: int) -> None:
    assert _manifest(SCHEMA1, world_size=world_size).world_size == world_size


def test_manifest_payload_size_must_be_1_byte_to_16_mib() -> None:
    with pytest.raises(InvalidInput, match="16 MiB"):
        _manifest(b"")
    head, tail = b'{"schema_version":1,"pad":"', b'"}'
    exact = head + b"x" * (MIB16 - len(head) - len(tail)) + tail
    assert len(exact) == MIB16
    assert len(_manifest(exact).payload) == MIB16
    over = head + b"x" * (MIB16 + 1 - len(head) - len(tail)) + tail
    with pytest.raises(InvalidInput, match="16 MiB"):
        _manifest(over)
    # Oversized payloads are refused before they are parsed.
    with pytest.raises(InvalidInput, match="16 MiB"):
        _manifest(b"x" * (MIB16 + 1))


@pytest.mark.parametrize(
    "payload",
    [
        b"x",
        b"{",
        b"\xff\xfe",
        b'{"schema_version":1',
        b'{"schema_version":1}x',
        b"{}",
        b"[]",
        b"[1]",
        b'[{"schema_version":1}]',
        b"1",
        b"null",
        b'"schema_version"',
        b'{"schema_version":3}',
        b'{"schema_version":0}',
        b'{"schema_version":-1}',
        b'{"schema_version":"1"}',
        b'{"schema_version":null}',
        b'{"schema_version":[1]}',
        b'{"version":1}',
    ],
)
def test_manifest_payload_must_be_a_json_object_with_schema_1_or_2(payload: bytes) -> None:
    with pytest.raises(InvalidInput) as info:
        _manifest(payload)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("payload", [b'{"schema_version":3}', b'{"schema_version":"1"}', b"[1]"])
def test_manifest_unsupported_schema_message(payload: bytes) -> None:
    with pytest.raises(InvalidInput, match="unsupported checkpoint manifest schema"):
        _manifest(payload)


def test_manifest_payload_is_kept_byte_exact() -> None:
    payload = b' {"schema_version": 2, "z": "\\u00e9"} '
    m = _manifest(payload)
    assert m.payload == payload
    assert m.schema_version == 2


def test_manifest_equality_is_over_all_four_fields() -> None:
    base = _manifest(SCHEMA1)
    assert base == _manifest(SCHEMA1)
    assert hash(base) == hash(_manifest(SCHEMA1))
    other_prefix = rc.Manifest("gen-1", rc.Prefix("ns", 0, b"", [1]), 4, SCHEMA1)
    different = [
        _manifest(SCHEMA1, generation="gen-2"),
        _manifest(SCHEMA1, world_size=2),
        _manifest(SCHEMA1 + b" "),
        other_prefix,
    ]
    for other in different:
        assert base != other
    assert len({base, *different}) == 1 + len(different)
    assert base != "gen-1"


def test_manifest_pickle_round_trip() -> None:
    roots = rc.TokenRoots.build("ns", range(5000))
    payload = _payload({"schema_version": 1, "page_groups": [_group()]})
    generation = rc.checkpoint_generation(roots.prefix(4500), payload)
    m = rc.Manifest(generation, roots.prefix(4500), 8, payload)
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        q = pickle.loads(pickle.dumps(m, protocol=protocol))
        assert q == m
        assert hash(q) == hash(m)
        assert q.prefix == m.prefix
        assert q.page_groups() == m.page_groups()
    assert copy.deepcopy(m) == m


def test_manifest_is_immutable() -> None:
    m = _manifest(SCHEMA1)
    with pytest.raises(AttributeError):
        m.world_size = 3  # type: ignore[misc]
    assert m.world_size == 4


def test_manifest_repr_is_short_for_a_large_payload() -> None:
    head, tail = b'{"schema_version":1,"pad":"', b'"}'
    m = _manifest(head + b"x" * 1_000_000 + tail)
    assert len(repr(m)) < 512


# --------------------------------------------------------------------------- page groups


def test_page_groups_of_a_schema_1_payload() -> None:
    groups = [
        _group("target.attention.0", 128, [0, 1, 2]),
        _group("target.recurrent.0", 256, [16]),
        _group("draft.context.0", 64, [7, 8]),
        _group("target-draft-auxiliary", 96, [0]),
    ]
    m = _manifest(_payload({"schema_version": 1, "page_groups": groups}))
    assert m.page_groups() == [
        {"name": g["name"], "page_bytes": g["page_bytes"], "positions": g["positions"]}
        | {"content_keys": []}
        for g in groups
    ]
    assert m.bytes_per_rank() == 128 * 3 + 256 + 64 * 2 + 96


def test_page_groups_of_a_schema_2_scheduler_payload() -> None:
    roots = rc.TokenRoots.build("ns", range(100), 16)
    attention = roots.content_keys([(min((p + 1) * 16, 100), "attention:0") for p in range(7)])
    recurrent = roots.content_keys([(100, "recurrent:1")])
    aux = roots.content_keys([(100, "auxiliary:0:prompt")])
    doc = {
        "schema_version": 2,
        "worker_layout": {"page_bytes": 4096},
        "page_groups": [
            _group("engine-kv-group:0", 4096, range(7), content_keys=attention),
            _group("engine-kv-group:1", 4096, [0], content_keys=recurrent),
            _group("target-draft-auxiliary", 4096, [0], content_keys=aux),
        ],
        "draft_prefix_len": 0,
        "kind": "prompt",
    }
    m = _manifest(_payload(doc))
    assert m.schema_version == 2
    got = m.page_groups()
    assert [g["name"] for g in got] == [
        "engine-kv-group:0",
        "engine-kv-group:1",
        "target-draft-auxiliary",
    ]
    assert got[0]["positions"] == list(range(7))
    assert got[0]["content_keys"] == attention
    assert got[1]["content_keys"] == recurrent
    assert got[2]["content_keys"] == aux
    assert m.bytes_per_rank() == 4096 * 9


def test_page_groups_accept_the_limits() -> None:
    groups = [_group("n" * 256, 2**30, [0, 2**40]), _group("\u00e9" * 256, 1, [5])]
    m = _manifest(_payload({"schema_version": 1, "page_groups": groups}))
    assert [g["name"] for g in m.page_groups()] == ["n" * 256, "\u00e9" * 256]
    assert m.bytes_per_rank() == 2 * 2**30 + 1
    many = [_group(f"g{i}", 1, [i]) for i in range(4096)]
    assert len(_manifest(_payload({"schema_version": 1, "page_groups": many})).page_groups()) == (
        4096
    )
    # Content keys may be absent, null or empty on schema 1.
    for keys in (None, []):
        doc = {"schema_version": 1, "page_groups": [_group(content_keys=keys)]}
        assert _manifest(_payload(doc)).page_groups()[0]["content_keys"] == []


INVALID_GROUPS: dict[str, dict[str, Any]] = {
    "no page_groups key": {"schema_version": 1},
    "page_groups null": {"schema_version": 1, "page_groups": None},
    "page_groups not a list": {"schema_version": 1, "page_groups": {"name": "g"}},
    "no groups": {"schema_version": 1, "page_groups": []},
    "4097 groups": {
        "schema_version": 1,
        "page_groups": [_group(f"g{i}", 1, [0]) for i in range(4097)],
    },
    "group not an object": {"schema_version": 1, "page_groups": [["g", 1, [0]]]},
    "missing name": {"schema_version": 1, "page_groups": [{"page_bytes": 1, "positions": [0]}]},
    "name not a string": {"schema_version": 1, "page_groups": [_group(name=7)]},
    "empty name": {"schema_version": 1, "page_groups": [_group(name="")]},
    "257-char name": {"schema_version": 1, "page_groups": [_group(name="n" * 257)]},
    "duplicate names": {"schema_version": 1, "page_groups": [_group("a"), _group("a", 64, [1])]},
    "missing page_bytes": {"schema_version": 1, "page_groups": [{"name": "g", "positions": [0]}]},
    "page_bytes 0": {"schema_version": 1, "page_groups": [_group(page_bytes=0)]},
    "page_bytes 2^30+1": {"schema_version": 1, "page_groups": [_group(page_bytes=2**30 + 1)]},
    "page_bytes negative": {"schema_version": 1, "page_groups": [_group(page_bytes=-1)]},
    "page_bytes string": {"schema_version": 1, "page_groups": [_group(page_bytes="128")]},
    "missing positions": {"schema_version": 1, "page_groups": [{"name": "g", "page_bytes": 1}]},
    "empty positions": {"schema_version": 1, "page_groups": [_group(positions=[])]},
    "unsorted positions": {"schema_version": 1, "page_groups": [_group(positions=[2, 1])]},
    "duplicate positions": {"schema_version": 1, "page_groups": [_group(positions=[1, 1])]},
    "negative position": {"schema_version": 1, "page_groups": [_group(positions=[-1])]},
    "fractional position": {"schema_version": 1, "page_groups": [_group(positions=[0.5])]},
    "string position": {"schema_version": 1, "page_groups": [_group(positions=["0"])]},
    "content_keys wrong count": {
        "schema_version": 2,
        "page_groups": [_group(positions=[0, 1], content_keys=[KEY_A])],
    },
    "content_keys too many": {
        "schema_version": 1,
        "page_groups": [_group(positions=[0], content_keys=[KEY_A, KEY_B])],
    },
    "content_keys uppercase hex": {
        "schema_version": 2,
        "page_groups": [_group(content_keys=[KEY_A.upper()])],
    },
    "content_keys 63 chars": {
        "schema_version": 2,
        "page_groups": [_group(content_keys=[KEY_A[:63]])],
    },
    "content_keys 65 chars": {
        "schema_version": 2,
        "page_groups": [_group(content_keys=[KEY_A + "a"])],
    },
    "content_keys not hex": {
        "schema_version": 2,
        "page_groups": [_group(content_keys=["g" * 64])],
    },
    "content_keys not a list": {"schema_version": 2, "page_groups": [_group(content_keys=KEY_A)]},
    "schema 2 without content keys": {"schema_version": 2, "page_groups": [_group()]},
    "schema 2 with empty content keys": {
        "schema_version": 2,
        "page_groups": [_group(content_keys=[])],
    },
    "schema 2 with one group lacking keys": {
        "schema_version": 2,
        "page_groups": [_group("a", content_keys=[KEY_A]), _group("b")],
    },
}


@pytest.mark.parametrize("doc", list(INVALID_GROUPS.values()), ids=list(INVALID_GROUPS))
def test_invalid_page_groups_are_refused_as_invalid_storage_groups(doc: dict[str, Any]) -> None:
    m = _manifest(_payload(doc))  # the envelope alone is valid
    with pytest.raises(InvalidInput) as info:
        m.page_groups()
    assert "invalid checkpoint storage group" in str(info.value)
    with pytest.raises(InvalidInput, match="invalid checkpoint storage group"):
        m.bytes_per_rank()


def test_bytes_per_rank_sums_page_bytes_times_positions() -> None:
    groups = [_group("a", 1000, range(10)), _group("b", 7, [3]), _group("c", 2**30, [0, 1])]
    m = _manifest(_payload({"schema_version": 1, "page_groups": groups}))
    assert m.bytes_per_rank() == 1000 * 10 + 7 + 2 * 2**30
    assert m.bytes_per_rank() == sum(g["page_bytes"] * len(g["positions"]) for g in groups)
