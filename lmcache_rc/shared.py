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

from typing import cast

from lmcache_rc import _native
from lmcache_rc.results import SharedGcReport

__all__ = ["gc", "min_gc_age", "parse_duration"]


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``3600``, ``90m``, ``36h``, ``7d`` or ``2w``:
    the one duration grammar of every setting (``docs/configuration.md``),
    parsed by the core. :class:`~lmcache_rc.errors.InvalidInput` (a
    ``ValueError``) otherwise."""
    return _native.parse_duration(text)


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
