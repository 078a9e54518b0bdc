"""A small pure-Python model of the identity scheme (docs/design/identity.md).

It follows the reference formulas literally (``hashlib``, ``struct``, CPython
``json.dumps``) and is itself checked against the golden vectors in
``test_identity_vectors.py``; the property tests then compare the Rust extension
with it on random inputs.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

NAMESPACE_PREFIX = "recurrent-sha256-v1:"
ROOT_CHAIN_SEED = b"lmcache-recurrent-token-roots-v1\0"
CONTENT_DOMAIN = b"lmcache-recurrent-content-v1\0"
GENERATION_DOMAIN = b"lmcache-recurrent-generation-v1\0"
GENERATION_PREFIX = "recurrent-content-v1:"
PAGE_DOMAIN = b"lmcache-recurrent-page-v1\0"


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def canonical_json(value: Any) -> str:
    """CPython's canonical form: sorted keys, compact, ASCII-escaped, no NaN."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )


def namespace(identity: Any, cache_salt: Any = "") -> str:
    doc = {"schema_version": 1, "identity": identity, "cache_salt": cache_salt}
    return NAMESPACE_PREFIX + hashlib.sha256(canonical_json(doc).encode("utf-8")).hexdigest()


def u32le(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def initial_chain(chunk_tokens: int) -> bytes:
    return sha256(ROOT_CHAIN_SEED + struct.pack("<I", chunk_tokens))


def roots(tokens: Sequence[int], chunk_tokens: int) -> list[tuple[int, bytes, list[int], bytes]]:
    """(start, prefix_hash, tail, end_hash) for every chunk."""
    chain = initial_chain(chunk_tokens)
    out = []
    for start in range(0, len(tokens), chunk_tokens):
        tail = list(tokens[start : start + chunk_tokens])
        end = sha256(chain + u32le(tail))
        out.append((start, chain, tail, end))
        chain = end
    return out


def prefix_fields(tokens: Sequence[int], chunk_tokens: int, n: int) -> tuple[int, bytes, list[int]]:
    """(start, prefix_hash, tail) of the exact-boundary prefix of n tokens."""
    assert 1 <= n <= len(tokens)
    k = (n - 1) // chunk_tokens
    start, chain, _, _ = roots(tokens[: (k + 1) * chunk_tokens], chunk_tokens)[k]
    return start, chain, list(tokens[start:n])


def token_digest(tokens: Sequence[int], chunk_tokens: int, n: int) -> bytes:
    _, chain, tail = prefix_fields(tokens, chunk_tokens, n)
    return sha256(chain + u32le(tail))


def page_key(ns: str, tokens: Sequence[int], chunk_tokens: int, n: int, discriminator: str) -> str:
    text = json.dumps([ns, n, discriminator], separators=(",", ":"), ensure_ascii=False)
    digest = token_digest(tokens, chunk_tokens, n)
    return hashlib.sha256(PAGE_DOMAIN + digest + b"\0" + text.encode("utf-8")).hexdigest()


def prefix_content_digest(
    ns: str, start: int, prefix_hash: bytes, tail: Sequence[int], discriminator: str
) -> bytes:
    doc = {
        "namespace": ns,
        "start_tokens": start,
        "prefix_hash": prefix_hash.hex(),
        "tail_tokens": list(tail),
    }
    return sha256(
        CONTENT_DOMAIN + discriminator.encode("utf-8") + b"\0" + canonical_json(doc).encode()
    )


def generation(ns: str, start: int, prefix_hash: bytes, tail: Sequence[int], payload: bytes) -> str:
    pd = prefix_content_digest(ns, start, prefix_hash, tail, "manifest")
    return GENERATION_PREFIX + hashlib.sha256(GENERATION_DOMAIN + pd + b"\0" + payload).hexdigest()
