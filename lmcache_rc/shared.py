"""The shared tier from Python: garbage collection of a bucket.

A sidecar started with ``--shared-url s3://bucket/prefix`` (or
``file:///path``) uploads its durable generations there and imports what
other hosts uploaded (see ``docs/design/shared-tier.md``). Nothing in the
sidecar deletes from the bucket: :func:`gc` (``lmcache-rc shared gc``) removes
manifests older than an age, then the pages no remaining manifest names, and
bucket lifecycle rules can do the same (``docs/operations.md``).
Credentials, region and endpoint come from the standard ``AWS_*`` environment.
"""

from __future__ import annotations

import re
from typing import cast

from lmcache_rc import _native
from lmcache_rc.results import SharedGcReport

__all__ = ["gc", "min_gc_age", "parse_duration"]

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``3600``, ``90m``, ``36h``, ``7d`` or ``2w``
    (a number with an optional unit s, m, h, d, w); ValueError otherwise."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(
            f"expected a duration such as 90m, 36h, 7d or a number of seconds, got {text!r}"
        )
    return float(match.group(1)) * _UNITS[match.group(2).lower()]


def min_gc_age() -> float:
    """The smallest age :func:`gc` accepts, in seconds: the longest an upload
    may take, plus the age after which a reused page is rewritten, plus twice
    the allowed clock skew (so gc never deletes a page an upload in progress
    relies on)."""
    return _native.shared_min_gc_age()


def gc(url: str, older_than: float) -> SharedGcReport:
    """Removes manifests older than ``older_than`` seconds from the shared tier
    at ``url``, then the pages older than that which no remaining manifest
    names. Pages a remaining manifest names are never removed.

    Raises :class:`~lmcache_rc.errors.InvalidInput` for an age below
    :func:`min_gc_age` or a bad URL, and
    :class:`~lmcache_rc.errors.Unavailable` when the store cannot be reached.
    """
    return cast(SharedGcReport, _native.shared_gc(url, older_than))
