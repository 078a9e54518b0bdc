"""The reference identity tests (docs/design/identity.md#reference-scenarios, items 1-6).

Scenario 2 needs a directory in the reference; here it checks the roots/prefix
relations that make the directory lookup work
(docs/design/identity.md#finding-a-stored-checkpoint), with the whole-token
bucket match written out in Python.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from identity_helpers import REQUIRED_KEYS, sample_identity

import lmcache_rc as rc
from lmcache_rc.errors import InvalidInput

# --------------------------------------------------------------------------- 1


def test_namespace_separates_every_execution_discriminator() -> None:
    identity = sample_identity()
    ns = rc.checkpoint_namespace(identity, "tenant-a")
    assert rc.checkpoint_namespace(sample_identity(), "tenant-a") == ns
    assert rc.checkpoint_namespace(json.loads(json.dumps(identity)), "tenant-a") == ns
    assert rc.checkpoint_namespace(identity, "tenant-b") != ns
    assert rc.checkpoint_namespace(identity, "") != ns

    changed_values: dict[str, Any] = {
        "target_revision": "other-target",
        "draft_revision": "other-draft",
        "source_revision": "other-source",
        "layout": {"dtype": "bf16", "page_bytes": 1024},
        "parallel": {"tp": 8, "dcp": 4},
    }
    seen = {ns}
    for key, value in changed_values.items():
        changed = sample_identity()
        changed[key] = value
        other = rc.checkpoint_namespace(changed, "tenant-a")
        assert other not in seen, key
        seen.add(other)

    for key in REQUIRED_KEYS:
        missing = sample_identity()
        del missing[key]
        with pytest.raises(InvalidInput, match="immutable"):
            rc.checkpoint_namespace(missing, "tenant-a")
        with pytest.raises(ValueError, match="immutable"):
            rc.checkpoint_namespace(missing, "tenant-a")


# --------------------------------------------------------------------------- 2


def _matches(stored: rc.Prefix, root: rc.Prefix) -> bool:
    """Index rule: same bucket and the stored tail is a whole-token prefix.

    See docs/design/identity.md#finding-a-stored-checkpoint.
    """
    return (
        stored.namespace == root.namespace
        and stored.start_tokens == root.start_tokens
        and stored.prefix_hash == root.prefix_hash
        and root.tail_tokens[: len(stored.tail_tokens)] == stored.tail_tokens
    )


def _find(stored: list[rc.Prefix], roots: rc.TokenRoots) -> rc.Prefix | None:
    hits = [s for s in stored if any(_matches(s, r) for r in roots.roots)]
    return max(hits, key=lambda p: p.num_tokens, default=None)


STORED = (17, 4096, 8193, 17408)
SHARED = (18, 4096, 8960, 18000)


def test_token_roots_match_arbitrary_boundaries_without_quadratic_tails() -> None:
    ns = "authenticated"
    tokens = list(range(20000))
    roots = rc.TokenRoots.build(ns, tokens)
    assert sum(len(r.tail_tokens) for r in roots.roots) == 20000
    assert max(len(r.tail_tokens) for r in roots.roots) == 4096
    stored = [roots.prefix(n) for n in STORED]
    assert [p.num_tokens for p in stored] == list(STORED)

    for n, shared in zip(STORED, SHARED, strict=True):
        sibling = rc.TokenRoots.build(ns, tokens[:shared] + [777777] * 3)
        assert sibling.prefix(n) == roots.prefix(n)
        bucket = (n - 1) // 4096
        root = sibling.roots[bucket]
        p = roots.prefix(n)
        assert root.start_tokens == p.start_tokens
        assert root.prefix_hash == p.prefix_hash
        assert root.tail_tokens[: len(p.tail_tokens)] == p.tail_tokens
        assert _matches(p, root)
        assert _find(stored, sibling) == p

    # Changing token 0 changes every chain digest after the seed (and root 0's tail).
    changed = rc.TokenRoots.build(ns, [1, *tokens[1:]])
    for k, (a, b) in enumerate(zip(roots.roots, changed.roots, strict=True)):
        if k == 0:
            assert a.prefix_hash == b.prefix_hash == roots.initial_chain
            assert a.tail_tokens != b.tail_tokens
        else:
            assert a.prefix_hash != b.prefix_hash
        assert a.start_tokens == b.start_tokens
        assert a != b
    assert set(roots.end_hashes).isdisjoint(changed.end_hashes)
    assert _find(stored, changed) is None

    # The same tokens in another namespace find nothing.
    other = rc.TokenRoots.build("other", tokens)
    assert _find(stored, other) is None


# --------------------------------------------------------------------------- 3


@pytest.mark.parametrize("tokens", [[-1], [2**31], [True], [1.5]], ids=repr)
def test_token_root_rejects_non_token_wire_values(tokens: list[Any]) -> None:
    with pytest.raises(InvalidInput, match="wire limits"):
        rc.TokenRoots.build("authenticated", tokens)
    with pytest.raises(ValueError, match="wire limits"):
        rc.Prefix("authenticated", 0, b"", tokens)


# --------------------------------------------------------------------------- 4


def test_generation_is_content_stable_and_manifest_sensitive() -> None:
    roots = rc.TokenRoots.build("authenticated", range(5000))
    prefix = roots.prefix(4500)
    payload = b'{"schema_version":1,"layout":"a"}'
    generation = rc.checkpoint_generation(prefix, payload)
    assert generation == rc.checkpoint_generation(roots.prefix(4500), bytes(payload))
    assert generation == rc.checkpoint_generation(
        rc.TokenRoots.build("authenticated", list(range(5000))).prefix(4500), payload
    )
    assert rc.checkpoint_generation(prefix, payload + b" ") != generation
    shorter = rc.Prefix(
        prefix.namespace, prefix.start_tokens, prefix.prefix_hash, prefix.tail_tokens[:-1]
    )
    assert rc.checkpoint_generation(shorter, payload) != generation
    assert len(generation) <= 128
    # A manifest accepts it as its generation id.
    manifest = rc.Manifest(generation, prefix, 1, payload)
    assert manifest.generation == generation


# --------------------------------------------------------------------------- 5


def test_page_content_key_is_prefix_stable_and_role_separated() -> None:
    roots = rc.TokenRoots.build("authenticated", range(9000))
    key = roots.prefix(8192).content_key("attention:0")
    assert key == roots.prefix(8192).content_key("attention:0")
    assert key != roots.prefix(8193).content_key("attention:0")
    assert key != roots.prefix(8192).content_key("recurrent:0")
    assert len(key) == 64
    assert all(c in "0123456789abcdef" for c in key)


# --------------------------------------------------------------------------- 6


def test_token_roots_content_key_is_stable_at_full_and_partial_chunks() -> None:
    tokens = list(range(9000))
    roots = rc.TokenRoots.build("authenticated", tokens)
    again = rc.TokenRoots.build("authenticated", tokens)
    for n in (4096, 4097, 8192, 9000):
        key = roots.content_key(n, "attention:0")
        assert key == again.content_key(n, "attention:0")
        assert key != roots.content_key(n, "recurrent:0")
        assert len(key) == 64
        assert all(c in "0123456789abcdef" for c in key)

    changed = rc.TokenRoots.build("authenticated", [*tokens[:-1], 42])
    assert changed.content_key(8192, "attention:0") == roots.content_key(8192, "attention:0")
    assert changed.content_key(9000, "attention:0") != roots.content_key(9000, "attention:0")

    pairs = [(4097, "attention:0"), (9000, "recurrent:1")]
    assert roots.content_keys(pairs) == [roots.content_key(n, d) for n, d in pairs]

    # Depends on the namespace and on the chunk size.
    assert rc.TokenRoots.build("other", tokens).content_key(4096, "a") != roots.content_key(
        4096, "a"
    )
    assert rc.TokenRoots.build("authenticated", tokens, 1024).content_key(
        4096, "a"
    ) != roots.content_key(4096, "a")
