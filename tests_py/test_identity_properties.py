"""Property tests of the identity layer (mirrors tests_rs/identity_properties.rs).

The extension is also compared with ``identity_model`` (a literal Python
transcription of docs/design/identity.md, itself checked against the golden
vectors).
"""

from __future__ import annotations

import json
import random
from typing import Any

import identity_model as model
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from identity_helpers import REQUIRED_KEYS

import lmcache_rc as rc
from lmcache_rc.errors import InvalidInput

PROPS = settings(max_examples=100, deadline=None)

token = st.one_of(st.integers(0, 7), st.integers(0, 2**31 - 1))
token_lists = st.lists(token, max_size=200)
nonempty_token_lists = st.lists(token, min_size=1, max_size=200)
chunks = st.integers(1, 40)
# Text without lone surrogates (they cannot be UTF-8 encoded).
text = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)
namespaces = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=256)

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), text)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(text, children, max_size=4)
    ),
    max_leaves=12,
)
truthy_values = json_values.filter(bool)
# A top-level None salt is covered by the vector I1_salt_null (test_identity_vectors.py).
salts = json_values.filter(lambda v: v is not None)
identities = st.fixed_dictionaries(
    {
        "target_revision": truthy_values,
        "draft_revision": json_values,
        "source_revision": truthy_values,
        "layout": truthy_values,
        "parallel": truthy_values,
    },
    optional={"extra": json_values, "\u00e9-key": json_values},
)


def _roots(roots: rc.TokenRoots) -> list[tuple[int, bytes, tuple[int, ...]]]:
    return [(r.start_tokens, r.prefix_hash, r.tail_tokens) for r in roots.roots]


# --------------------------------------------------------------------------- roots


@PROPS
@given(tokens=token_lists, chunk=chunks)
def test_roots_cover_the_sequence_exactly(tokens: list[int], chunk: int) -> None:
    roots = rc.TokenRoots.build("ns", tokens, chunk)
    joined = [t for r in roots.roots for t in r.tail_tokens]
    assert joined == tokens
    for k, r in enumerate(roots.roots):
        assert r.start_tokens == k * chunk
        assert 1 <= len(r.tail_tokens) <= chunk
        assert r.num_tokens == min((k + 1) * chunk, len(tokens))
        assert r.namespace == "ns"
        assert len(r.prefix_hash) == 32
    assert len(roots) == len(tokens)


@PROPS
@given(tokens=token_lists, chunk=chunks)
def test_roots_equal_the_spec_formula(tokens: list[int], chunk: int) -> None:
    roots = rc.TokenRoots.build("ns", tokens, chunk)
    expected = model.roots(tokens, chunk)
    assert _roots(roots) == [(s, h, tuple(t)) for s, h, t, _ in expected]
    assert list(roots.end_hashes) == [e for _, _, _, e in expected]
    assert roots.initial_chain == model.initial_chain(chunk)


@PROPS
@given(tokens=nonempty_token_lists, chunk=chunks, data=st.data())
def test_prefix_n_agrees_with_roots_of_the_first_n_tokens(
    tokens: list[int], chunk: int, data: st.DataObject
) -> None:
    n = data.draw(st.integers(1, len(tokens)), label="n")
    full = rc.TokenRoots.build("ns", tokens, chunk)
    short = rc.TokenRoots.build("ns", tokens[:n], chunk)
    last = short.roots[-1]
    assert full.prefix(n) == last
    assert short.prefix(n) == last
    assert full.token_digest(n) == short.end_hashes[-1]
    assert full.token_digest(n) == model.token_digest(tokens, chunk, n)
    assert full.prefix(n).num_tokens == n


@PROPS
@given(tokens=nonempty_token_lists, chunk=chunks)
def test_every_prefix_is_keyed_by_its_own_tokens_only(tokens: list[int], chunk: int) -> None:
    roots = rc.TokenRoots.build("ns", tokens, chunk)
    prefixes = [roots.prefix(n) for n in range(1, len(tokens) + 1)]
    assert len(set(prefixes)) == len(prefixes)
    for n, p in enumerate(prefixes, start=1):
        start, chain, tail = model.prefix_fields(tokens, chunk, n)
        assert (p.start_tokens, p.prefix_hash, list(p.tail_tokens)) == (start, chain, tail)


@PROPS
@given(tokens=nonempty_token_lists, chunk=chunks, data=st.data())
def test_numpy_layouts_hash_like_lists(tokens: list[int], chunk: int, data: st.DataObject) -> None:
    expected = _roots(rc.TokenRoots.build("ns", tokens, chunk))
    dtype = data.draw(st.sampled_from(["int64", "uint32", "uint64"]), label="dtype")
    step = data.draw(st.integers(1, 4), label="step")
    big = np.zeros(len(tokens) * step, dtype=dtype)
    big[::step] = tokens
    view = big[::step]
    assert _roots(rc.TokenRoots.build("ns", view, chunk)) == expected
    backwards = np.asarray(tokens[::-1], dtype=dtype)[::-1]
    assert len(tokens) == 1 or backwards.strides[0] < 0
    assert _roots(rc.TokenRoots.build("ns", backwards, chunk)) == expected


# --------------------------------------------------------------------------- page keys


@PROPS
@given(
    tokens=st.lists(token, min_size=2, max_size=200),
    extra=st.lists(token, min_size=1, max_size=50),
    chunk=chunks,
    block=st.integers(1, 20),
)
def test_full_attention_page_keys_are_stable_and_endpoint_keys_are_not(
    tokens: list[int], extra: list[int], chunk: int, block: int
) -> None:
    n = len(tokens)
    a = rc.TokenRoots.build("ns", tokens, chunk)
    b = rc.TokenRoots.build("ns", tokens + extra, chunk)
    ends = list(range(block, n + 1, block))
    pairs = [(end, "attention:0") for end in ends]
    assert a.content_keys(pairs) == b.content_keys(pairs)
    for end in ends:
        assert a.content_key(end, "attention:0") == b.content_key(end, "attention:0")
    m = len(b)
    assert a.content_key(n, "recurrent:1") != b.content_key(m, "recurrent:1")
    assert a.content_key(n, "auxiliary:0:prompt") != b.content_key(m, "auxiliary:0:prompt")
    assert a.content_key(n, "recurrent:1") != a.content_key(n - 1, "recurrent:1")
    assert a.content_key(n, "attention:0") != a.content_key(n, "recurrent:0")


@PROPS
@given(tokens=nonempty_token_lists, chunk=chunks, ns=namespaces, disc=text, data=st.data())
def test_page_keys_equal_the_spec_formula_for_any_text(
    tokens: list[int], chunk: int, ns: str, disc: str, data: st.DataObject
) -> None:
    n = data.draw(st.integers(1, len(tokens)), label="n")
    roots = rc.TokenRoots.build(ns, tokens, chunk)
    expected = model.page_key(ns, tokens, chunk, n, disc)
    assert roots.content_key(n, disc) == expected
    assert roots.content_keys([(n, disc), (n, disc)]) == [expected, expected]
    p = roots.prefix(n)
    start, chain, tail = model.prefix_fields(tokens, chunk, n)
    assert p.content_key(disc) == model.prefix_content_digest(ns, start, chain, tail, disc).hex()


@PROPS
@given(tokens=nonempty_token_lists, chunk=chunks, payload=st.binary(max_size=64), data=st.data())
def test_generation_equals_the_spec_formula(
    tokens: list[int], chunk: int, payload: bytes, data: st.DataObject
) -> None:
    n = data.draw(st.integers(1, len(tokens)), label="n")
    p = rc.TokenRoots.build("ns", tokens, chunk).prefix(n)
    start, chain, tail = model.prefix_fields(tokens, chunk, n)
    assert rc.checkpoint_generation(p, payload) == model.generation(
        "ns", start, chain, tail, payload
    )


# --------------------------------------------------------------------------- namespace


def _shuffled(value: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys in a random insertion order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


@PROPS
@given(identity=identities, salt=salts, seed=st.integers(0, 2**32 - 1))
def test_namespace_is_independent_of_key_order(
    identity: dict[str, Any], salt: Any, seed: int
) -> None:
    ns = rc.checkpoint_namespace(identity, salt)
    rng = random.Random(seed)
    assert rc.checkpoint_namespace(_shuffled(identity, rng), _shuffled(salt, rng)) == ns
    assert rc.checkpoint_namespace(json.loads(json.dumps(identity)), salt) == ns
    assert ns == model.namespace(identity, salt)
    assert len(ns) == 84


@PROPS
@given(identity=identities, salt=text, key=st.sampled_from(REQUIRED_KEYS), new=truthy_values)
def test_namespace_is_sensitive_to_every_required_field(
    identity: dict[str, Any], salt: str, key: str, new: Any
) -> None:
    ns = rc.checkpoint_namespace(identity, salt)
    changed = dict(identity)
    changed[key] = new
    if model.canonical_json(new) == model.canonical_json(identity[key]):
        assert rc.checkpoint_namespace(changed, salt) == ns
    else:
        assert rc.checkpoint_namespace(changed, salt) != ns
    missing = dict(identity)
    del missing[key]
    try:
        rc.checkpoint_namespace(missing, salt)
    except InvalidInput as exc:
        assert "immutable" in str(exc)
    else:
        raise AssertionError(f"identity without {key!r} was accepted")


@PROPS
@given(identity=identities, salt=salts, other=salts)
def test_namespace_is_sensitive_to_the_salt(
    identity: dict[str, Any], salt: Any, other: Any
) -> None:
    same = model.canonical_json(salt) == model.canonical_json(other)
    a = rc.checkpoint_namespace(identity, salt)
    b = rc.checkpoint_namespace(identity, other)
    assert (a == b) == same


@PROPS
@given(identity=identities, value=json_values)
def test_namespace_hashes_extra_keys(identity: dict[str, Any], value: Any) -> None:
    with_extra = dict(identity)
    with_extra["zz_extra"] = value
    assert rc.checkpoint_namespace(with_extra, "") != rc.checkpoint_namespace(identity, "")
    assert rc.checkpoint_namespace(with_extra, "") == model.namespace(with_extra, "")
