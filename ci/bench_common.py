"""Shared pieces of the Python benchmarks."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import lmcache_rc as rc


def single_group_manifest(
    namespace: str,
    seq: int,
    pages: int,
    page_bytes: int,
    layout: Mapping[str, Any] | None = None,
) -> rc.Manifest:
    """A one-rank schema-2 manifest of ``pages`` distinct pages in one group
    (``seq`` makes every call's generation and content keys distinct)."""
    roots = rc.TokenRoots.build(namespace, [seq, *range(pages)])
    keys = roots.content_keys([(n + 1, "attention:0") for n in range(pages)])
    body: dict[str, Any] = {
        "schema_version": 2,
        "page_groups": [
            {
                "name": "engine-kv-group:0",
                "page_bytes": page_bytes,
                "positions": list(range(pages)),
                "content_keys": keys,
            }
        ],
    }
    if layout is not None:
        body["worker_layout"] = dict(layout)
    payload = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    prefix = roots.prefix(pages)
    return rc.Manifest(rc.checkpoint_generation(prefix, payload), prefix, 1, payload)
