"""API behaviour of the identity classes: Prefix, TokenRoots and the namespace function."""

from __future__ import annotations

import copy
import json
import pickle
import types
from collections import OrderedDict
from typing import Any

import identity_model as model
import numpy as np
import pytest
from identity_helpers import (
    DIGEST_MSG,
    EMPTY_TAIL,
    HASH_UNIT,
    NAMESPACE_MSG,
    OUTSIDE,
    WIRE,
    sample_identity,
)

import lmcache_rc as rc
from lmcache_rc.errors import CheckpointError, InvalidInput, InvalidType

H32 = bytes(range(32))

# --------------------------------------------------------------------------- Prefix validation


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # rule 1: namespace length (wins over every later rule)
        (("", -1, b"x", []), NAMESPACE_MSG),
        (("", 0, b"", [1]), NAMESPACE_MSG),
        (("n" * 257, 0, b"", [1]), NAMESPACE_MSG),
        (("\u00e9" * 257, 0, b"", [1]), NAMESPACE_MSG),
        # rule 2: negative start or empty tail (wins over wire limits and digest)
        (("n", -1, b"", [1]), EMPTY_TAIL),
        (("n", -1, b"x", [2**31]), EMPTY_TAIL),
        (("n", 0, b"", []), EMPTY_TAIL),
        (("n", 5, b"x", ()), EMPTY_TAIL),
        # rule 3: tail longer than 65536 or a token outside [0, 2^31) (wins over digest)
        (("n", 0, b"x", [2**31]), WIRE),
        (("n", 0, b"x", [-1]), WIRE),
        (("n", 0, b"x", [True]), WIRE),
        (("n", 0, b"x", [1.0]), WIRE),
        (("n", 0, b"x" * 3, [1] * 65537), WIRE),
        (("n", 3, b"", [1, 2**32]), WIRE),
        # rule 4: digest length 0 or 32, and empty only at start 0
        (("n", 0, b"x" * 31, [1]), DIGEST_MSG),
        (("n", 0, b"x" * 33, [1]), DIGEST_MSG),
        (("n", 5, b"", [1]), DIGEST_MSG),
    ],
)
def test_prefix_constructor_applies_the_spec_rules_in_order(
    args: tuple[Any, ...], message: str
) -> None:
    with pytest.raises(InvalidInput) as info:
        rc.Prefix(*args)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "args",
    [
        ("n", 0, b"", [1]),
        ("n", 0, H32, [0]),
        ("n" * 256, 4096, H32, [2**31 - 1]),
        ("\U0001f642" * 256, 1, H32, [5, 6]),
        ("n", 0, b"", [7] * 65536),
        ("n", 0, b"", np.arange(10, dtype=np.int32)),
        ("n", 0, b"", (1, 2, 3)),
    ],
)
def test_prefix_constructor_accepts_values_at_the_limits(args: tuple[Any, ...]) -> None:
    p = rc.Prefix(*args)
    assert p.namespace == args[0]
    assert p.start_tokens == args[1]
    assert p.prefix_hash == args[2]
    assert p.tail_tokens == tuple(int(t) for t in args[3])
    assert p.num_tokens == args[1] + len(args[3])


def test_prefix_tail_string_is_refused_as_invalid_type() -> None:
    with pytest.raises(InvalidType):
        rc.Prefix("n", 0, b"", "abc")


# --------------------------------------------------------------------------- Prefix values


def test_prefix_equality_is_structural_over_all_four_fields() -> None:
    base = rc.Prefix("ns", 4096, H32, [1, 2])
    same = rc.Prefix("ns", 4096, bytes(H32), np.array([1, 2]))
    assert base == same
    assert hash(base) == hash(same)
    assert not (base != same)
    different = [
        rc.Prefix("ns2", 4096, H32, [1, 2]),
        rc.Prefix("ns", 8192, H32, [1, 2]),
        rc.Prefix("ns", 4096, bytes(32), [1, 2]),
        rc.Prefix("ns", 4096, H32, [1, 3]),
        rc.Prefix("ns", 4096, H32, [1]),
        rc.Prefix("ns", 4096, H32, [1, 2, 3]),
    ]
    for other in different:
        assert base != other
    assert len({base, same, *different}) == 1 + len(different)
    assert base != (("ns", 4096, H32, (1, 2)))
    assert base != "ns"


def test_prefix_pickle_round_trip_preserves_value_and_hash() -> None:
    roots = rc.TokenRoots.build("ns", list(range(5000)))
    for p in (roots.prefix(1), roots.prefix(4097), rc.Prefix("n", 0, b"", [3])):
        for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
            q = pickle.loads(pickle.dumps(p, protocol=protocol))
            assert q == p
            assert hash(q) == hash(p)
            assert type(q) is rc.Prefix
        assert copy.deepcopy(p) == p
        assert copy.copy(p) == p


def test_prefix_is_immutable() -> None:
    p = rc.Prefix("n", 0, b"", [1])
    with pytest.raises(AttributeError):
        p.start_tokens = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        p.tail_tokens = (2,)  # type: ignore[misc]
    assert p.tail_tokens == (1,)


def test_prefix_repr_of_a_65536_token_tail_stays_short() -> None:
    p = rc.Prefix("n" * 256, 2**40, H32, [2**31 - 1] * 65536)
    text = repr(p)
    assert text.startswith("Prefix(")
    assert len(p.tail_tokens) == 65536
    assert "num_tokens=" in text
    assert len(text) < 1024
    roots = rc.TokenRoots.build("ns", np.arange(200_000, dtype=np.int64), 65536)
    assert len(repr(roots)) < 1024
    assert all(len(repr(r)) < 1024 for r in roots.roots)


def test_prefix_content_key_is_64_lowercase_hex_and_discriminator_sensitive() -> None:
    p = rc.Prefix("ns", 0, b"", [1, 2, 3])
    key = p.content_key("attention:0")
    assert len(key) == 64
    assert key == key.lower()
    int(key, 16)
    assert key != p.content_key("recurrent:0")
    assert key == model.prefix_content_digest("ns", 0, b"", [1, 2, 3], "attention:0").hex()


def test_checkpoint_generation_hashes_exact_payload_bytes() -> None:
    p = rc.Prefix("ns", 0, b"", [1, 2, 3])
    g = rc.checkpoint_generation(p, b'{"schema_version":1}')
    assert g == model.generation("ns", 0, b"", [1, 2, 3], b'{"schema_version":1}')
    assert g.startswith("recurrent-content-v1:")
    assert len(g) == 85
    # The function does not validate the payload (empty bytes hash fine).
    assert rc.checkpoint_generation(p, b"") == model.generation("ns", 0, b"", [1, 2, 3], b"")
    assert rc.checkpoint_generation(p, b'{"schema_version":1} ') != g


# --------------------------------------------------------------------------- TokenRoots


@pytest.mark.parametrize("namespace", ["", "ns", "n" * 300])
def test_empty_token_sequence_has_no_roots_and_no_error(namespace: str) -> None:
    for tokens in ([], (), np.array([], dtype=np.int64), iter(())):
        roots = rc.TokenRoots.build(namespace, tokens)
        assert roots.roots == ()
        assert roots.end_hashes == ()
        assert len(roots) == 0
        assert roots.num_tokens == 0
        assert roots.content_keys([]) == []
        for n in (0, 1):
            with pytest.raises(InvalidInput, match="outside the token sequence"):
                roots.prefix(n)


def test_len_is_the_number_of_tokens_and_roots_one_per_chunk() -> None:
    for n, chunk in [(1, 4), (4, 4), (5, 4), (9000, 4096), (8192, 4096), (3, 1)]:
        roots = rc.TokenRoots.build("ns", range(n), chunk)
        assert len(roots) == n == roots.num_tokens
        assert len(roots.roots) == -(-n // chunk)
        assert len(roots.end_hashes) == len(roots.roots)
        assert roots.chunk_tokens == chunk


def test_default_chunk_is_4096() -> None:
    roots = rc.TokenRoots.build("ns", range(4097))
    assert roots.chunk_tokens == 4096
    assert [r.start_tokens for r in roots.roots] == [0, 4096]
    assert roots.initial_chain == model.initial_chain(4096)


@pytest.mark.parametrize("chunk", [0, -1, -4096, 65537, 2**31, 2**32 + 4096, 2**40])
def test_chunk_tokens_outside_1_to_65536_is_refused(chunk: int) -> None:
    with pytest.raises(InvalidInput) as info:
        rc.TokenRoots.build("ns", [1, 2, 3], chunk)
    assert str(info.value) == HASH_UNIT
    # Even with no tokens (the chunk size is checked first).
    with pytest.raises(InvalidInput, match="hash unit"):
        rc.TokenRoots.build("ns", [], chunk)


@pytest.mark.parametrize("chunk", [2**63, -(2**63) - 1])
def test_chunk_tokens_beyond_64_bits_is_refused_as_invalid_input(chunk: int) -> None:
    with pytest.raises(InvalidInput, match="hash unit"):
        rc.TokenRoots.build("ns", [1, 2, 3], chunk)


@pytest.mark.parametrize("chunk", [1, 2, 4096, 65536])
def test_chunk_tokens_inside_the_range_is_accepted(chunk: int) -> None:
    roots = rc.TokenRoots.build("ns", range(5), chunk)
    assert roots.chunk_tokens == chunk
    assert roots.initial_chain == model.initial_chain(chunk)


def _root_tuples(roots: rc.TokenRoots) -> list[tuple[Any, ...]]:
    return [(r.start_tokens, r.prefix_hash, r.tail_tokens) for r in roots.roots]


def test_tokens_accepts_every_integer_sequence_and_array_layout_alike() -> None:
    tokens = [(i * 7919) % 50000 for i in range(1000)]
    expected = rc.TokenRoots.build("ns", tokens, 64)

    def gen() -> Any:
        yield from tokens

    big = np.zeros((1000, 3), dtype=np.int64)
    big[:, 1] = tokens
    fortran = np.asfortranarray(np.stack([tokens, tokens]).astype(np.int32))
    containers = {
        "tuple": tuple(tokens),
        "generator": gen(),
        "iterator": iter(tokens),
        "np.int64": np.asarray(tokens, dtype=np.int64),
        "np.int32": np.asarray(tokens, dtype=np.int32),
        "np.uint32": np.asarray(tokens, dtype=np.uint32),
        "np.uint64": np.asarray(tokens, dtype=np.uint64),
        "np.uint16": np.asarray(tokens, dtype=np.uint16),
        "column of a 2-D array": big[:, 1],
        "row of a Fortran array": fortran[0],
        "read-only array": np.asarray(tokens, dtype=np.int64).copy(),
        "list of numpy scalars": [np.int64(t) for t in tokens],
        "list of mixed numpy scalars": [
            (np.int32, np.uint32, np.int64, int)[i % 4](t) for i, t in enumerate(tokens)
        ],
    }
    containers["read-only array"].flags.writeable = False
    assert not containers["column of a 2-D array"].flags["C_CONTIGUOUS"]
    for name, container in containers.items():
        got = rc.TokenRoots.build("ns", container, 64)
        assert _root_tuples(got) == _root_tuples(expected), name
        assert got.end_hashes == expected.end_hashes, name


def test_small_integer_dtypes_hash_like_their_values() -> None:
    tokens = [0, 1, 100, 127]
    expected = _root_tuples(rc.TokenRoots.build("ns", tokens, 3))
    for dtype in (np.int8, np.uint8, np.int16, np.uint16):
        got = rc.TokenRoots.build("ns", np.asarray(tokens, dtype=dtype), 3)
        assert _root_tuples(got) == expected


@pytest.mark.parametrize(
    "array",
    [
        np.array([-1], dtype=np.int64),
        np.array([-1], dtype=np.int32),
        np.array([-1], dtype=np.int8),
        np.array([2**31], dtype=np.int64),
        np.array([2**31], dtype=np.uint32),
        np.array([2**32 + 5], dtype=np.int64),
        np.array([2**32 + 5], dtype=np.uint64),
        np.array([2**63 + 5], dtype=np.uint64),
        np.array([-(2**63)], dtype=np.int64),
    ],
    ids=lambda a: f"{a.dtype}:{a[0]}",
)
def test_array_tokens_outside_the_wire_domain_are_refused_not_wrapped(array: Any) -> None:
    with pytest.raises(InvalidInput, match="wire limits"):
        rc.TokenRoots.build("ns", array)
    with pytest.raises(InvalidInput, match="wire limits"):
        rc.TokenRoots.build("ns", array.tolist())


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((2, 2), dtype=np.int64),
        np.zeros((1, 3), dtype=np.int32),
        np.zeros((), dtype=np.int64),
        np.zeros(3, dtype=np.float64),
        np.zeros(3, dtype=np.float32),
        np.zeros(3, dtype=bool),
        np.zeros(3, dtype=object),
        np.zeros(3, dtype=np.complex64),
        np.array(["1", "2"]),
    ],
    ids=lambda a: f"{a.dtype}-{a.ndim}d",
)
def test_arrays_that_are_not_1d_integer_are_refused(array: Any) -> None:
    with pytest.raises(InvalidInput):
        rc.TokenRoots.build("ns", array)


def test_byte_swapped_arrays_never_produce_a_different_hash() -> None:
    tokens = [1, 2, 3, 70000]
    expected = _root_tuples(rc.TokenRoots.build("ns", tokens, 2))
    for dtype in (">i4", ">u4", ">i8"):
        array = np.asarray(tokens, dtype=dtype)
        try:
            got = rc.TokenRoots.build("ns", array, 2)
        except InvalidInput:
            continue  # refusing is fine; a silently different hash is not
        assert _root_tuples(got) == expected, dtype


@pytest.mark.parametrize("tokens", ["abc", "", b"abc", b""])
def test_text_tokens_are_refused_as_invalid_type(tokens: Any) -> None:
    with pytest.raises(InvalidType) as info:
        rc.TokenRoots.build("ns", tokens)
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("tokens", [5, None, 1.5, object()])
def test_non_sequence_tokens_are_refused_as_invalid_type(tokens: Any) -> None:
    with pytest.raises(InvalidType):
        rc.TokenRoots.build("ns", tokens)


@pytest.mark.parametrize(
    "bad",
    [True, False, np.True_, 1.0, np.float64(1.0), np.float32(2.0), "1", None, 2**64, [1]],
    ids=repr,
)
def test_list_elements_that_are_not_exact_integers_hit_the_wire_limits(bad: Any) -> None:
    with pytest.raises(InvalidInput) as info:
        rc.TokenRoots.build("ns", [1, bad, 2])
    assert str(info.value) == WIRE


def test_wire_limit_error_is_raised_at_the_first_bad_chunk() -> None:
    # Chunk 0 is fine, chunk 1 carries the bad token: still refused.
    with pytest.raises(InvalidInput, match="wire limits"):
        rc.TokenRoots.build("ns", [1, 2, 3, 4, 5, 2**31], 4)
    # Namespace checked before tokens when there are tokens.
    with pytest.raises(InvalidInput) as info:
        rc.TokenRoots.build("", [2**31])
    assert str(info.value) == NAMESPACE_MSG


def test_prefix_boundaries_outside_1_to_len_are_refused() -> None:
    roots = rc.TokenRoots.build("ns", range(10), 4)
    for n in (0, -1, 11, 2**40, 2**70, -(2**70)):
        for call in (roots.prefix, roots.token_digest, lambda m: roots.content_key(m, "d")):
            with pytest.raises(InvalidInput) as info:
                call(n)
            assert str(info.value) == OUTSIDE
        with pytest.raises(InvalidInput, match="outside the token sequence"):
            roots.content_keys([(1, "a"), (n, "b")])


@pytest.mark.parametrize("n", [True, 1.0, "1", None])
def test_prefix_boundary_that_is_not_an_int_is_refused(n: Any) -> None:
    roots = rc.TokenRoots.build("ns", range(10), 4)
    with pytest.raises(InvalidInput):
        roots.prefix(n)


def test_chunk_aligned_boundary_keeps_a_full_tail() -> None:
    roots = rc.TokenRoots.build("ns", range(12), 4)
    p = roots.prefix(8)
    assert p.start_tokens == 4
    assert p.tail_tokens == (4, 5, 6, 7)
    assert p == roots.roots[1]
    q = roots.prefix(9)
    assert q.start_tokens == 8
    assert q.tail_tokens == (8,)
    assert roots.token_digest(8) == roots.end_hashes[1]
    assert roots.token_digest(12) == roots.end_hashes[2]


def test_root_prefix_hashes_chain_through_end_hashes() -> None:
    roots = rc.TokenRoots.build("ns", range(10), 3)
    hashes = [r.prefix_hash for r in roots.roots]
    assert hashes[0] == roots.initial_chain
    assert hashes[1:] == list(roots.end_hashes[:-1])
    assert all(len(h) == 32 for h in (*hashes, *roots.end_hashes))


def test_content_keys_pairs_must_be_tuples_of_int_and_str() -> None:
    roots = rc.TokenRoots.build("ns", range(10), 4)
    assert roots.content_keys([(3, "a"), (3, "a"), (10, "b")]) == [
        roots.content_key(3, "a"),
        roots.content_key(3, "a"),
        roots.content_key(10, "b"),
    ]
    assert roots.content_keys(iter([(5, "x")])) == [roots.content_key(5, "x")]
    for bad in ([(1, "a", "b")], [(1,)], [("1", "a")], [(1, 2)], [(True, "a")]):
        with pytest.raises(InvalidInput):
            roots.content_keys(bad)


def test_token_roots_are_immutable_and_reusable() -> None:
    tokens = np.arange(10, dtype=np.int64)
    roots = rc.TokenRoots.build("ns", tokens, 4)
    before = _root_tuples(roots)
    tokens[:] = 0  # the caller's array may change afterwards
    assert _root_tuples(roots) == before
    with pytest.raises(AttributeError):
        roots.chunk_tokens = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- namespace API


def test_namespace_default_salt_is_the_empty_string() -> None:
    identity = sample_identity()
    assert rc.checkpoint_namespace(identity) == rc.checkpoint_namespace(identity, "")
    assert rc.checkpoint_namespace(identity) == model.namespace(identity, "")


def test_namespace_of_the_vector_null_salt_differs_from_the_empty_salt() -> None:
    identity = sample_identity()
    assert rc.checkpoint_namespace(identity, None) == model.namespace(identity, None)
    assert rc.checkpoint_namespace(identity, None) != rc.checkpoint_namespace(identity, "")


@pytest.mark.parametrize(
    "salt", ["", "tenant-a", "\u79df\u6237", 0, 7, True, False, [1, "a"], {"k": "v"}], ids=repr
)
def test_namespace_hashes_any_json_salt_as_given(salt: Any) -> None:
    identity = sample_identity()
    assert rc.checkpoint_namespace(identity, salt) == model.namespace(identity, salt)


def test_namespace_accepts_any_mapping_and_tuples_as_lists() -> None:
    identity = sample_identity()
    expected = rc.checkpoint_namespace(identity, "s")
    assert rc.checkpoint_namespace(OrderedDict(reversed(identity.items())), "s") == expected
    assert rc.checkpoint_namespace(types.MappingProxyType(identity), "s") == expected
    assert rc.checkpoint_namespace(json.loads(json.dumps(identity)), "s") == expected
    with_list = dict(identity, layout={"groups": [1, [2, 3]]})
    with_tuple = dict(identity, layout={"groups": (1, (2, 3))})
    assert rc.checkpoint_namespace(with_list, "s") == rc.checkpoint_namespace(with_tuple, "s")
    assert rc.checkpoint_namespace(with_list, "s") == model.namespace(with_list, "s")


@pytest.mark.parametrize("falsy", ["", 0, False, None, {}, []], ids=repr)
@pytest.mark.parametrize("key", ["target_revision", "source_revision", "layout", "parallel"])
def test_namespace_refuses_falsy_required_fields_as_not_immutable(key: str, falsy: Any) -> None:
    identity = sample_identity()
    identity[key] = falsy
    with pytest.raises(InvalidInput, match="immutable"):
        rc.checkpoint_namespace(identity, "")


@pytest.mark.parametrize("falsy", ["", 0, False, None, {}, []], ids=repr)
def test_namespace_accepts_any_falsy_draft_revision_and_hashes_it(falsy: Any) -> None:
    identity = sample_identity()
    identity["draft_revision"] = falsy
    assert rc.checkpoint_namespace(identity, "") == model.namespace(identity, "")


def test_namespace_integers_are_limited_to_signed_64_bits() -> None:
    identity = sample_identity()
    for ok in (2**63 - 1, -(2**63), 0, -1):
        identity["layout"] = {"n": ok}
        assert rc.checkpoint_namespace(identity, "") == model.namespace(identity, "")
    for bad in (2**63, -(2**63) - 1, 2**70):
        identity["layout"] = {"n": bad}
        with pytest.raises(InvalidInput):
            rc.checkpoint_namespace(identity, "")
        with pytest.raises(InvalidInput):
            rc.checkpoint_namespace(sample_identity(), bad)


@pytest.mark.parametrize(
    "value",
    [{1: "a"}, {"a": 1, 2: "b"}, {None: 1}, {1.5: 1}, {(1, 2): 1}],
    ids=repr,
)
def test_namespace_refuses_non_string_keys_as_invalid_type(value: Any) -> None:
    identity = sample_identity()
    identity["layout"] = value
    with pytest.raises(InvalidType) as info:
        rc.checkpoint_namespace(identity, "")
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    "value", [{1, 2}, frozenset(), b"bytes", bytearray(b"x"), object(), 1j, range(3)], ids=repr
)
def test_namespace_refuses_non_json_values_as_invalid_type(value: Any) -> None:
    identity = sample_identity()
    identity["layout"] = {"x": value}
    with pytest.raises(InvalidType):
        rc.checkpoint_namespace(identity, "")


@pytest.mark.parametrize("identity", [[1, 2], "identity", 5, None], ids=repr)
def test_namespace_refuses_an_identity_that_is_not_a_mapping(identity: Any) -> None:
    with pytest.raises(CheckpointError) as info:
        rc.checkpoint_namespace(identity, "")
    assert isinstance(info.value, InvalidInput)


def test_namespace_refuses_absurdly_deep_nesting_without_crashing() -> None:
    identity = sample_identity()
    deep: Any = 1
    for _ in range(10_000):
        deep = [deep]
    identity["layout"] = {"deep": deep}
    with pytest.raises(InvalidInput):
        rc.checkpoint_namespace(identity, "")
    shallow: Any = 1
    for _ in range(30):
        shallow = {"k": shallow}
    identity["layout"] = shallow
    assert rc.checkpoint_namespace(identity, "") == model.namespace(identity, "")
