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
    "DeviceError",
    "GenerationConflict",
    "InternalError",
    "InvalidInput",
    "InvalidType",
    "LeasesLive",
    "NotFound",
    "OutOfSpace",
    "ProtocolError",
    "RpcTimeout",
    "StorageIOError",
    "Unavailable",
    "UnsafeCopy",
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


class Unavailable(CheckpointError, ConnectionError):
    """The sidecar cannot be reached: no server at the socket, the connection
    was lost (e.g. the server restarted during the call; its outcome is then
    unknown) or the server is shutting down. The next call reconnects."""


class ProtocolError(CheckpointError):
    """A peer broke the wire protocol: a malformed, oversize or unexpected
    frame, or an unsupported protocol version (upgrade the older side)."""


class RpcTimeout(CheckpointError, TimeoutError):
    """An RPC got no reply in time. The server may still carry the call out."""


class InternalError(CheckpointError):
    """A bug: the server failed while handling a request (it keeps serving)."""


class UnsafeCopy(CheckpointError):
    """A worker copy may still be in flight, or a lease's ownership could not be
    reconciled with the sidecar (invariant I5).

    The transfer engine refuses all new work and its ``close()`` raises this:
    the page pool and the shared-memory mapping must stay alive until the
    worker process ends, and the engine must terminate that process. It is a
    fatal engine error, never a cache miss.
    """


class DeviceError(CheckpointError):
    """The accelerator or its driver is missing or failed (e.g. no CUDA driver
    library on this host). The CPU backend stays usable."""
