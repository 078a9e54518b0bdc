"""Boundary mode's scheduler bridge under its long-standing module name.

The code lives in :mod:`lmcache_rc.vllm.boundary` (the bridge),
:mod:`lmcache_rc.vllm.metadata` and :mod:`lmcache_rc.vllm.sidecar`.
"""

from __future__ import annotations

from lmcache_rc.vllm.boundary import CheckpointSchedulerBridge
from lmcache_rc.vllm.metadata import CheckpointConnectorMetadata, CheckpointWorkerMetadata
from lmcache_rc.vllm.sidecar import NonBlockingSidecar as _NonBlockingSidecar
from lmcache_rc.vllm.sidecar import SidecarClient, SidecarFuture

__all__ = [
    "CheckpointConnectorMetadata",
    "CheckpointSchedulerBridge",
    "CheckpointWorkerMetadata",
    "SidecarClient",
    "SidecarFuture",
    "_NonBlockingSidecar",
]
