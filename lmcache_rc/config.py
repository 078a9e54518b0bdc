"""Configuration of the checkpoint sidecar: :class:`ServerConfig`.

Every field is a ``lmcache-rc serve`` flag (underscores become dashes) and can
also come from an environment variable ``LMCACHE_RC_<FIELD>`` (upper case).
Defaults need no flags: the socket and the SQLite directory live under the
user's runtime and cache directories, the shared-memory pool takes at most a
quarter of the free space of ``/dev/shm`` (up to 1 GiB), and the pool name is
derived from the socket path so two servers on one host never collide.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ServerConfig", "default_l1_bytes", "default_socket_path"]

_PAGE = 4096
_GIB = 1 << 30


def _runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and Path(base).is_dir():
        return Path(base) / "lmcache-rc"
    return Path("/tmp") / f"lmcache-rc-{os.getuid()}"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lmcache-rc"


def default_socket_path() -> str:
    """The sidecar socket used when none is configured."""
    return str(_runtime_dir() / "sidecar.sock")


def default_l1_bytes() -> int:
    """A quarter of the free space of /dev/shm, at most 1 GiB, at least 16 MiB."""
    try:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    size = min(_GIB, free // 4) if free else 64 << 20
    size = max(size, 16 << 20)
    return size - size % _PAGE


def shm_name_for(socket: str) -> str:
    """The SHM pool name derived from a socket path (unique per server)."""
    digest = hashlib.sha256(os.path.abspath(socket).encode()).hexdigest()[:16]
    return f"lmcache-rc-{digest}"


@dataclass
class ServerConfig:
    """Settings of a checkpoint service / sidecar (see ``docs/configuration.md``)."""

    socket: str = field(default_factory=default_socket_path)
    """Unix socket the sidecar listens on (created with mode 0600)."""
    shm_name: str | None = None
    """POSIX shared-memory pool name; None derives it from ``socket``."""
    l1_bytes: int = field(default_factory=default_l1_bytes)
    """Size of the shared-memory (L1) pool in bytes, a multiple of 4096."""
    checkpoint_index_path: str | None = None
    """SQLite file of the durable directory; None keeps the directory in memory."""
    l2_path: str | None = None
    """Directory of the filesystem (L2) tier; None disables L2."""
    l2_bytes: int | None = None
    """Capacity of L2 in bytes; None is unlimited."""
    http_host: str = "127.0.0.1"
    """Address of the HTTP admin API (loopback by default)."""
    http_port: int = 0
    """Port of the HTTP admin API; 0 picks a free port."""
    max_entries: int = 65536
    """Most published generations listed (LRU beyond)."""
    max_pending: int = 128
    """Most generations pending publication at once."""
    max_leases: int = 1024
    """Most live worker leases (store + retrieve)."""
    store_admission_timeout: float = 8.0
    """Seconds a store waits for L1 space before missing."""
    retrieve_timeout: float = 30.0
    """Seconds a retrieve may stay pending before missing."""
    abandoned_after: float | None = 600.0
    """Seconds after which a pending generation with no progress is aborted."""
    l2_io_threads: int = 2
    """Threads writing and reading L2 files."""

    def __post_init__(self) -> None:
        if self.shm_name is None:
            self.shm_name = shm_name_for(self.socket)
        if self.l1_bytes <= 0 or self.l1_bytes % _PAGE:
            raise ValueError(
                f"l1_bytes must be a positive multiple of {_PAGE}, got {self.l1_bytes}"
            )

    @classmethod
    def from_env(cls, **overrides: Any) -> ServerConfig:
        """Defaults, then ``LMCACHE_RC_*`` environment variables, then ``overrides``."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = os.environ.get(f"LMCACHE_RC_{f.name.upper()}")
            if raw is not None:
                values[f.name] = _parse(f.type, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @staticmethod
    def default_index_path() -> str:
        """A durable directory location under the user's cache directory."""
        return str(_cache_dir() / "checkpoints.sqlite")


def _parse(kind: Any, raw: str) -> Any:
    text = str(kind)
    if "int" in text and "float" not in text:
        return int(raw)
    if "float" in text:
        return None if raw.lower() in ("", "none") else float(raw)
    return None if raw == "" and "None" in text else raw
