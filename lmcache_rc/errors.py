"""Exceptions raised by lmcache-rc.

Every failure of the Rust core arrives as one of these classes (the mapping is
in ``rust/python/src/errors.rs``). Catch :class:`CheckpointError` for all of
them. Classes that describe bad input also derive from the matching built-in
(``ValueError``, ``TypeError``, ``OSError``) so generic handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "Closed",
    "CorruptData",
    "DatabaseError",
    "GenerationConflict",
    "InvalidInput",
    "InvalidType",
    "LeasesLive",
    "NotFound",
    "OutOfSpace",
    "StorageIOError",
    "UnsupportedFormat",
]


class CheckpointError(Exception):
    """Base class of every lmcache-rc error."""


class InvalidInput(CheckpointError, ValueError):
    """A value is outside what the format or API accepts; nothing was changed."""


class InvalidType(InvalidInput, TypeError):
    """A value has a type the format cannot carry (e.g. a set inside an identity)."""


class GenerationConflict(InvalidInput):
    """A generation id was reused for different content (during store or after publication)."""


class UnsupportedFormat(CheckpointError):
    """A stored file or database is in a format this build does not read.

    lmcache-rc never rewrites or empties such a file: move it aside or use a
    matching build.
    """


class Closed(CheckpointError):
    """The object was closed; no further calls are accepted."""


class DatabaseError(CheckpointError):
    """The SQLite checkpoint directory failed (the operation had no effect)."""


class StorageIOError(CheckpointError, OSError):
    """An operating-system I/O call failed."""


class CorruptData(CheckpointError):
    """Stored bytes failed verification (header, size or checksum); they were not used."""


class OutOfSpace(CheckpointError):
    """A tier could not reserve its configured space (e.g. /dev/shm or the L2 disk is full)."""


class NotFound(CheckpointError, LookupError):
    """A lease or object id is unknown (already finished, or never issued)."""


class LeasesLive(CheckpointError):
    """Refused while worker copies hold leases (forced clear, close): finish them first."""
