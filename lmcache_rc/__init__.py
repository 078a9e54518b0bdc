"""lmcache-rc: atomic, deduplicated recurrent-model checkpoints for hybrid LLMs.

The public API is re-exported here (``import lmcache_rc as rc``):

- identity: :func:`checkpoint_namespace`, :class:`TokenRoots`, :class:`Prefix`,
  :func:`checkpoint_generation`, :class:`Manifest`, and the typed schema-2
  payload :class:`CheckpointPayload` (canonical bytes, one set of rules);
- the durable directory on its own: :class:`Directory`;
- the checkpoint service in process: :class:`CheckpointService` configured by
  :class:`ServerConfig`, answering :class:`Lease` objects;
- the sidecar over its Unix socket: :class:`Client` (same methods, plus
  ``*_async`` variants), and :class:`Server` to run one embedded;
- worker copies between a page pool and the sidecar's shared memory:
  :class:`TransferEngine` (futures: :class:`TransferFuture`), wrapped for vLLM
  workers by :class:`lmcache_rc.worker.CheckpointWorker`;
- errors: :mod:`lmcache_rc.errors`.

Everything heavy runs in the Rust extension ``lmcache_rc._native`` with the GIL
released; see ``docs/architecture.md`` for the map of the system.
"""

from __future__ import annotations

from lmcache_rc import errors
from lmcache_rc._native import (
    CheckpointPayload,
    CheckpointService,
    Client,
    Directory,
    Lease,
    Manifest,
    Prefix,
    Server,
    TokenRoots,
    TransferEngine,
    TransferFuture,
    __version__,
    checkpoint_generation,
    checkpoint_namespace,
)
from lmcache_rc.config import ServerConfig

__all__ = [
    "CheckpointPayload",
    "CheckpointService",
    "Client",
    "Directory",
    "Lease",
    "Manifest",
    "Prefix",
    "Server",
    "ServerConfig",
    "TokenRoots",
    "TransferEngine",
    "TransferFuture",
    "__version__",
    "checkpoint_generation",
    "checkpoint_namespace",
    "errors",
]
