"""Golden vectors (vectors/identity-v1.json) reproduced through the Python API.

Every case of every section is checked; the one documented deviation
(``lmcache_rc_deviations``: I4_scalars) must raise InvalidInput. Token cases run
with a list, a tuple and several numpy layouts, which must all agree.
"""

from __future__ import annotations

import ast
import math
from typing import Any

import identity_model as model
import numpy as np
import pytest
from identity_helpers import (
    HASH_UNIT,
    OUTSIDE,
    WIRE,
    assert_prefix_matches,
    case_tokens,
    load_vectors,
    sample_identity,
    token_variants,
)

import lmcache_rc as rc
from lmcache_rc.errors import CheckpointError, InvalidInput, InvalidType

V = load_vectors()
DEVIATIONS = V["lmcache_rc_deviations"]
NAMESPACE_CASES = V["namespaces"]
TOKEN_CASES = V["token_cases"]
VARIANT_NAMES = list(token_variants([1, 2, 3]))


def _ids(cases: list[dict[str, Any]], key: str) -> list[str]:
    return [f"{i}-{c[key]}" for i, c in enumerate(cases)]


# --------------------------------------------------------------------------- file shape


def test_vector_file_has_the_documented_sections_and_case_counts() -> None:
    assert V["description"].startswith("Golden vectors")
    assert len(V["namespaces"]) == 9
    assert len(V["namespace_errors"]) == 12
    assert len(V["namespace_accepts"]) == 2
    assert len(V["token_cases"]) == 15
    assert len(V["token_errors"]) == 12
    assert set(DEVIATIONS) == {"I4_scalars"}


# --------------------------------------------------------------------------- namespaces


@pytest.mark.parametrize("case", NAMESPACE_CASES, ids=_ids(NAMESPACE_CASES, "name"))
def test_namespace_vector_reproduces_byte_for_byte(case: dict[str, Any]) -> None:
    if case["name"] in DEVIATIONS:
        with pytest.raises(InvalidInput) as info:
            rc.checkpoint_namespace(case["identity"], case["cache_salt"])
        assert isinstance(info.value, ValueError)
        assert isinstance(info.value, CheckpointError)
        return
    got = rc.checkpoint_namespace(case["identity"], case["cache_salt"])
    assert got == case["namespace"]
    assert got.startswith("recurrent-sha256-v1:")
    assert len(got) == 84


@pytest.mark.parametrize("case", NAMESPACE_CASES, ids=_ids(NAMESPACE_CASES, "name"))
def test_namespace_vector_canonical_json_matches_the_python_model(case: dict[str, Any]) -> None:
    # Cross-checks the model used by the property tests against the reference output.
    doc = {"schema_version": 1, "identity": case["identity"], "cache_salt": case["cache_salt"]}
    assert model.canonical_json(doc) == case["canonical_json"]
    assert model.namespace(case["identity"], case["cache_salt"]) == case["namespace"]


def test_i4_scalars_deviation_refuses_each_float_and_the_huge_integer() -> None:
    case = next(c for c in NAMESPACE_CASES if c["name"] == "I4_scalars")
    layout = case["identity"]["layout"]
    refused = {k for k, v in layout.items() if isinstance(v, float) or abs(v or 0) >= 2**63}
    assert refused == {"scale", "big", "tiny", "one", "huge_int"}
    for key in sorted(refused):
        identity = dict(case["identity"], layout={key: layout[key]})
        with pytest.raises(InvalidInput):
            rc.checkpoint_namespace(identity, "salt")
    # The remaining scalars (bool, null, negative int) are in the accepted domain.
    kept = {k: v for k, v in layout.items() if k not in refused}
    identity = dict(case["identity"], layout=kept)
    assert rc.checkpoint_namespace(identity, "salt") == model.namespace(identity, "salt")


@pytest.mark.parametrize(
    ("case_name", "draft_revision"),
    [("empty_draft_revision_ok", ""), ("null_draft_revision_ok", None)],
)
def test_namespace_accepts_falsy_draft_revision(case_name: str, draft_revision: Any) -> None:
    case = next(c for c in V["namespace_accepts"] if c["case"] == case_name)
    identity = sample_identity()
    identity["draft_revision"] = draft_revision
    assert rc.checkpoint_namespace(identity, "tenant-a") == case["namespace"]
    assert model.namespace(identity, "tenant-a") == case["namespace"]


def _error_identity(case_name: str) -> dict[str, Any]:
    """Rebuilds the identity of a namespace_errors case from its name."""
    identity = sample_identity()
    if case_name.startswith("missing_"):
        del identity[case_name.removeprefix("missing_")]
    elif case_name.startswith("empty_") and case_name != "empty_layout_object":
        identity[case_name.removeprefix("empty_")] = ""
    elif case_name == "empty_layout_object":
        identity["layout"] = {}
    elif case_name == "zero_parallel":
        identity["parallel"] = 0
    elif case_name.startswith("null_"):
        identity[case_name.removeprefix("null_")] = None
    elif case_name == "nan_in_layout":
        identity["layout"] = {"x": float("nan")}
    elif case_name == "set_in_layout":
        identity["layout"] = {"x": {1}}
    else:
        raise AssertionError(f"unknown namespace error case {case_name!r}")
    return identity


@pytest.mark.parametrize(
    "case", V["namespace_errors"], ids=[c["case"] for c in V["namespace_errors"]]
)
def test_namespace_error_vector_raises_its_error_class(case: dict[str, Any]) -> None:
    identity = _error_identity(case["case"])
    assert repr(identity) == case["identity_repr"]
    error = case["error"]
    builtin = {"ValueError": ValueError, "TypeError": TypeError}[error["error_class"]]
    with pytest.raises(InvalidInput) as info:
        rc.checkpoint_namespace(identity, "tenant-a")
    exc = info.value
    assert isinstance(exc, builtin)
    assert isinstance(exc, CheckpointError)
    # lmcache-rc: every refusal is an InvalidInput (so a ValueError); TypeError cases
    # raise InvalidType, which is both.
    if builtin is TypeError:
        assert isinstance(exc, InvalidType)
    else:
        assert not isinstance(exc, TypeError)
    if "immutable" in error["message"]:
        assert "immutable" in str(exc)


def test_infinite_floats_in_identity_are_refused() -> None:
    identity = sample_identity()
    identity["layout"] = {"x": [math.inf]}
    with pytest.raises(InvalidInput):
        rc.checkpoint_namespace(identity, "")
    identity["layout"] = {"x": -math.inf}
    with pytest.raises(InvalidInput):
        rc.checkpoint_namespace(identity, "")


# --------------------------------------------------------------------------- token cases


def _check_token_case(case: dict[str, Any], tokens: Any) -> None:
    ns, chunk = case["namespace"], case["chunk_tokens"]
    roots = rc.TokenRoots.build(ns, tokens, chunk)
    assert roots.namespace == ns
    assert roots.chunk_tokens == chunk
    assert roots.num_tokens == case["num_tokens"] == len(roots)
    assert roots.initial_chain.hex() == case["initial_chain_hex"]

    got_roots = roots.roots
    assert isinstance(got_roots, tuple)
    assert len(got_roots) == len(case["roots"])
    assert len(roots.end_hashes) == len(case["roots"])
    for root, end_hash, expected in zip(got_roots, roots.end_hashes, case["roots"], strict=True):
        assert_prefix_matches(root, expected)
        assert end_hash.hex() == expected["end_hash_hex"]

    for entry in case["prefixes"]:
        n = entry["n"]
        if "error" in entry:
            assert entry["error"]["error_class"] == "ValueError"
            with pytest.raises(InvalidInput, match="outside the token sequence") as info:
                roots.prefix(n)
            assert str(info.value) == entry["error"]["message"] == OUTSIDE
            with pytest.raises(InvalidInput, match="outside the token sequence"):
                roots.token_digest(n)
            with pytest.raises(InvalidInput, match="outside the token sequence"):
                roots.content_key(n, "attention:0")
        else:
            assert_prefix_matches(roots.prefix(n), entry["prefix"])

    for entry in case["token_digests"]:
        assert roots.token_digest(entry["n"]).hex() == entry["digest_hex"]

    if "content_keys" in case:
        pairs = [(n, d) for n, d in case["content_keys"]["boundaries"]]
        expected_keys = case["content_keys"]["keys"]
        assert roots.content_keys(pairs) == expected_keys
        assert [roots.content_key(n, d) for n, d in pairs] == expected_keys

    for entry in case.get("prefix_content_keys", []):
        assert roots.prefix(entry["n"]).content_key(entry["discriminator"]) == entry["key"]

    for entry in case.get("generations", []):
        if "payload_utf8" in entry:
            payload = entry["payload_utf8"].encode("utf-8")
        else:
            payload = bytes.fromhex(entry["payload_hex"])
        got = rc.checkpoint_generation(roots.prefix(entry["n"]), payload)
        assert got == entry["generation"]
        assert len(got) == 85


@pytest.mark.parametrize("variant", VARIANT_NAMES)
@pytest.mark.parametrize("case", TOKEN_CASES, ids=_ids(TOKEN_CASES, "case"))
def test_token_case_vector_reproduces_for_every_token_container(
    case: dict[str, Any], variant: str
) -> None:
    tokens = token_variants(case_tokens(case))[variant]
    _check_token_case(case, tokens)


@pytest.mark.parametrize("case", TOKEN_CASES, ids=_ids(TOKEN_CASES, "case"))
def test_token_case_vector_prefixes_equal_explicitly_constructed_prefix(
    case: dict[str, Any],
) -> None:
    tokens = case_tokens(case)
    roots = rc.TokenRoots.build(case["namespace"], tokens, case["chunk_tokens"])
    for entry in case["prefixes"]:
        if "error" in entry:
            continue
        p = entry["prefix"]
        start = p["start_tokens"]
        built = rc.Prefix(
            p["namespace"], start, bytes.fromhex(p["prefix_hash_hex"]), tokens[start : entry["n"]]
        )
        assert built == roots.prefix(entry["n"])
        assert hash(built) == hash(roots.prefix(entry["n"]))


@pytest.mark.parametrize("case", TOKEN_CASES, ids=_ids(TOKEN_CASES, "case"))
def test_token_case_vector_matches_the_python_model(case: dict[str, Any]) -> None:
    # Validates identity_model (used as the oracle of the property tests).
    tokens, chunk, ns = case_tokens(case), case["chunk_tokens"], case["namespace"]
    assert model.initial_chain(chunk).hex() == case["initial_chain_hex"]
    model_roots = model.roots(tokens, chunk)
    assert [(s, h.hex(), e.hex()) for s, h, _, e in model_roots] == [
        (r["start_tokens"], r["prefix_hash_hex"], r["end_hash_hex"]) for r in case["roots"]
    ]
    for entry in case["token_digests"]:
        assert model.token_digest(tokens, chunk, entry["n"]).hex() == entry["digest_hex"]
    if "content_keys" in case:
        keys = [
            model.page_key(ns, tokens, chunk, n, d) for n, d in case["content_keys"]["boundaries"]
        ]
        assert keys == case["content_keys"]["keys"]
    for entry in case.get("prefix_content_keys", []):
        start, chain, tail = model.prefix_fields(tokens, chunk, entry["n"])
        digest = model.prefix_content_digest(ns, start, chain, tail, entry["discriminator"])
        assert digest.hex() == entry["key"]
    for entry in case.get("generations", []):
        if "payload_utf8" in entry:
            payload = entry["payload_utf8"].encode("utf-8")
        else:
            payload = bytes.fromhex(entry["payload_hex"])
        start, chain, tail = model.prefix_fields(tokens, chunk, entry["n"])
        assert model.generation(ns, start, chain, tail, payload) == entry["generation"]


# --------------------------------------------------------------------------- token errors

TOKEN_ERRORS = V["token_errors"]


@pytest.mark.parametrize("case", TOKEN_ERRORS, ids=[c["case"] for c in TOKEN_ERRORS])
def test_token_error_vector_raises_the_exact_message(case: dict[str, Any]) -> None:
    tokens = ast.literal_eval(case["tokens_repr"])
    namespace = case.get("namespace", "authenticated")
    error = case["error"]
    if error is None:
        roots = rc.TokenRoots.build(namespace, tokens, case["chunk_tokens"])
        assert roots.roots == ()
        assert len(roots) == 0
        return
    assert error["error_class"] == "ValueError"
    with pytest.raises(InvalidInput) as info:
        rc.TokenRoots.build(namespace, tokens, case["chunk_tokens"])
    assert str(info.value) == error["message"]
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "case",
    [c for c in TOKEN_ERRORS if "bool" not in c["case"] and "float" not in c["case"]],
    ids=[c["case"] for c in TOKEN_ERRORS if "bool" not in c["case"] and "float" not in c["case"]],
)
def test_token_error_vector_raises_the_same_error_for_int64_arrays(case: dict[str, Any]) -> None:
    tokens = np.asarray(ast.literal_eval(case["tokens_repr"]), dtype=np.int64)
    namespace = case.get("namespace", "authenticated")
    if case["error"] is None:
        assert rc.TokenRoots.build(namespace, tokens, case["chunk_tokens"]).roots == ()
        return
    with pytest.raises(InvalidInput) as info:
        rc.TokenRoots.build(namespace, tokens, case["chunk_tokens"])
    assert str(info.value) == case["error"]["message"]


def test_token_error_messages_are_the_spec_constants() -> None:
    messages = {c["error"]["message"] for c in TOKEN_ERRORS if c["error"]}
    assert WIRE in messages
    assert HASH_UNIT in messages
