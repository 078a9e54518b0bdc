"""``rc.CheckpointPayload``: the schema-2 payload as one typed value.

``build`` must write exactly the bytes of CPython's ``json.dumps(payload,
sort_keys=True, separators=(",", ":"), allow_nan=False).encode()`` — the
bytes the scheduler bridge hashes into boundary-mode generation ids — for
every payload the type accepts; ``parse`` accepts exactly what ``build``
writes (any JSON spelling of it) and refuses everything else with a reason.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lmcache_rc as rc
from lmcache_rc import errors
from lmcache_rc.vllm.common import canonical as _canonical  # the bridge's own payload writer

KEY = "ab" * 32


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def boundary_payload(
    layout: dict[str, Any], positions: list[list[int]], page_bytes: int, kind: str, draft: int
) -> dict[str, Any]:
    """A payload shaped as ``CheckpointSchedulerBridge._build_store`` writes it."""
    groups: list[dict[str, Any]] = [
        {
            "name": f"engine-kv-group:{g}",
            "page_bytes": page_bytes,
            "positions": list(pos),
            "content_keys": [f"{g:02x}{p:062x}" for p in pos],
        }
        for g, pos in enumerate(positions)
    ]
    groups.append(
        {
            "name": "target-draft-auxiliary",
            "page_bytes": page_bytes,
            "positions": [0],
            "content_keys": ["ff" * 32],
        }
    )
    return {
        "schema_version": 2,
        "worker_layout": layout,
        "page_groups": groups,
        "draft_prefix_len": draft,
        "kind": kind,
    }


def build(payload: dict[str, Any]) -> bytes:
    fields = {k: v for k, v in payload.items() if k != "schema_version"}
    return rc.CheckpointPayload.build(**fields)


@pytest.mark.parametrize(
    ("layout", "positions", "page_bytes", "kind", "draft"),
    [
        ({"schema_version": 1, "page_bytes": 4096}, [[0, 1, 2], [2]], 4096, "prompt", 11),
        ({"page_bytes": 65536, "other": 1}, [[0], [0]], 65536, "response", 0),
        (
            {"page_bytes": 1 << 20, "dtype": "bfloat16", "groups": [[1, 2], {"b": None}]},
            [list(range(300)), [299]],
            1 << 20,
            "instruction",
            4000,
        ),
        ({"tp": 2, "name": 'quote " and \\ é 🙂 \x7f'}, [[5, 9]], 512, "prompt", 3),
    ],
)
def test_build_reproduces_the_bridges_payload_bytes(
    layout: dict[str, Any], positions: list[list[int]], page_bytes: int, kind: str, draft: int
) -> None:
    payload = boundary_payload(layout, positions, page_bytes, kind, draft)
    expected = _canonical(payload)
    assert expected == canonical(payload)
    assert build(payload) == expected
    parsed = rc.CheckpointPayload.parse(expected)
    assert parsed.to_bytes() == expected
    assert parsed.worker_layout == layout
    assert parsed.page_groups == payload["page_groups"]
    assert (parsed.kind, parsed.draft_prefix_len, parsed.num_tokens) == (kind, draft, None)
    assert parsed.schema_version == 2
    # Same bytes, same generation id.
    roots = rc.TokenRoots.build("recurrent-sha256-v1:payload-test", list(range(40)))
    prefix = roots.prefix(40)
    assert rc.checkpoint_generation(prefix, build(payload)) == rc.checkpoint_generation(
        prefix, expected
    )


_json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.text(max_size=12)
)
_layouts = st.dictionaries(
    st.text(max_size=8),
    st.recursive(
        _json_scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
        max_leaves=12,
    ),
    max_size=6,
)


@st.composite
def _groups(draw: st.DrawFn) -> list[dict[str, Any]]:
    names = draw(st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=4, unique=True))
    out = []
    for name in names:
        positions = sorted(
            draw(st.sets(st.integers(min_value=0, max_value=2**64 - 1), min_size=1, max_size=6))
        )
        keys = [draw(st.binary(min_size=32, max_size=32)).hex() for _ in positions]
        out.append(
            {
                "name": name,
                "page_bytes": draw(st.integers(min_value=1, max_value=1 << 30)),
                "positions": positions,
                "content_keys": keys,
            }
        )
    return out


@settings(max_examples=200, deadline=None)
@given(
    layout=_layouts,
    groups=_groups(),
    boundary=st.one_of(
        st.none(),
        st.tuples(st.integers(min_value=0, max_value=10**6), st.text(min_size=1, max_size=16)),
    ),
    num_tokens=st.one_of(st.none(), st.integers(min_value=10**6, max_value=2**64 - 1)),
)
def test_build_equals_json_dumps_for_every_accepted_payload(
    layout: dict[str, Any],
    groups: list[dict[str, Any]],
    boundary: tuple[int, str] | None,
    num_tokens: int | None,
) -> None:
    payload: dict[str, Any] = {"schema_version": 2, "worker_layout": layout, "page_groups": groups}
    if boundary is not None:
        payload["draft_prefix_len"], payload["kind"] = boundary
    if num_tokens is not None:
        payload["num_tokens"] = num_tokens
    expected = canonical(payload)
    assert build(payload) == expected
    parsed = rc.CheckpointPayload.parse(expected)
    assert parsed == rc.CheckpointPayload(
        **{k: v for k, v in payload.items() if k != "schema_version"}
    )
    assert parsed.to_bytes() == expected
    # Any JSON spelling of the same payload parses to the same value.
    assert rc.CheckpointPayload.parse(json.dumps(payload, indent=1).encode()) == parsed


def test_parse_refuses_what_build_could_not_have_written() -> None:
    good = boundary_payload({"page_bytes": 8}, [[0]], 8, "prompt", 0)
    rc.CheckpointPayload.parse(canonical(good))
    cases: list[tuple[dict[str, Any], str]] = [
        ({**good, "schema_version": 1}, "schema 2"),
        ({**good, "extra": 1}, "unknown key"),
        ({k: v for k, v in good.items() if k != "worker_layout"}, "no worker_layout"),
        ({**good, "worker_layout": [1]}, "must be a JSON object"),
        ({**good, "worker_layout": {"scale": 0.5}}, "only integers"),
        ({**good, "worker_layout": {"big": 2**63}}, "only integers"),
        ({k: v for k, v in good.items() if k != "kind"}, "come together"),
        ({**good, "draft_prefix_len": -1}, "non-negative integer"),
        ({**good, "draft_prefix_len": True}, "non-negative integer"),
        ({**good, "kind": 3}, "kind must be a string"),
        ({**good, "kind": ""}, "kind must contain"),
        ({**good, "num_tokens": 0}, "num_tokens must be positive"),
        ({**good, "num_tokens": 5, "draft_prefix_len": 6}, "exceeds num_tokens"),
        ({**good, "page_groups": []}, "1..4096 groups"),
        ({**good, "page_groups": [{**good["page_groups"][0], "x": 1}]}, "unknown key"),
        ({**good, "page_groups": good["page_groups"] * 2}, "duplicate group name"),
        (
            {**good, "page_groups": [{**good["page_groups"][0], "content_keys": []}]},
            "requires content_keys",
        ),
        (
            {**good, "page_groups": [{**good["page_groups"][0], "positions": [1, 1]}]},
            "strictly increasing",
        ),
    ]
    for payload, needle in cases:
        with pytest.raises(errors.InvalidInput, match=needle):
            rc.CheckpointPayload.parse(canonical(payload))
    for raw in (b"", b"[]", b"{", b'{"schema_version":2', b"\xff"):
        with pytest.raises(errors.InvalidInput):
            rc.CheckpointPayload.parse(raw)


def test_build_refuses_values_json_could_write_but_the_type_cannot() -> None:
    group = {"name": "g", "page_bytes": 8, "positions": [0], "content_keys": [KEY]}
    ok = rc.CheckpointPayload(worker_layout={}, page_groups=[group])
    assert (ok.kind, ok.draft_prefix_len, ok.num_tokens) == (None, None, None)
    assert ok.to_bytes() == canonical(
        {"page_groups": [group], "schema_version": 2, "worker_layout": {}}
    )
    with pytest.raises(errors.InvalidInput, match="only integers"):
        rc.CheckpointPayload.build(worker_layout={"x": 1.5}, page_groups=[group])  # type: ignore[dict-item]
    with pytest.raises(errors.InvalidType, match="keys must be strings"):
        rc.CheckpointPayload.build(worker_layout={1: 2}, page_groups=[group])  # type: ignore[dict-item]
    with pytest.raises(errors.InvalidType, match="page_bytes must be an int"):
        rc.CheckpointPayload.build(worker_layout={}, page_groups=[{**group, "page_bytes": True}])
    with pytest.raises(errors.InvalidInput, match="unknown key"):
        rc.CheckpointPayload.build(worker_layout={}, page_groups=[{**group, "extra": 1}])
    with pytest.raises(errors.InvalidInput, match="64 lowercase hex"):
        rc.CheckpointPayload.build(
            worker_layout={}, page_groups=[{**group, "content_keys": [KEY.upper()]}]
        )
    with pytest.raises(errors.InvalidInput, match="come together"):
        rc.CheckpointPayload.build(worker_layout={}, page_groups=[group], kind="prompt")
    with pytest.raises(errors.InvalidInput, match="page_bytes"):
        rc.CheckpointPayload.build(worker_layout={}, page_groups=[{**group, "page_bytes": 0}])
    with pytest.raises(errors.InvalidType, match="mapping"):
        rc.CheckpointPayload.build(worker_layout=[], page_groups=[group])  # type: ignore[arg-type]


def test_a_manifest_payload_built_by_the_type_is_accepted_by_manifests() -> None:
    group = {"name": "g", "page_bytes": 8, "positions": [0, 4], "content_keys": [KEY, KEY]}
    payload = rc.CheckpointPayload.build(
        worker_layout={"page_bytes": 8}, page_groups=[group], num_tokens=40
    )
    roots = rc.TokenRoots.build("recurrent-sha256-v1:payload-test", list(range(40)))
    prefix = roots.prefix(40)
    m = rc.Manifest(rc.checkpoint_generation(prefix, payload), prefix, 1, payload)
    assert m.schema_version == 2
    assert m.page_groups() == [group]
    assert m.bytes_per_rank() == 16
    assert rc.CheckpointPayload.parse(m.payload).num_tokens == 40
