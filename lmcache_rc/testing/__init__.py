"""Test support for lmcache-rc: a CPU simulated hybrid vLLM engine and pytest fixtures.

:class:`SimEngine` plays the vLLM side of ``docs/design/vllm-boundary-api.md`` (allocator,
boundary-checkpoint cache, the per-step hook order, N worker ranks with numpy page
pools, in threads or processes) around the real
:class:`lmcache_rc.connector.LMCacheRecurrentCheckpointConnector`, with a
deterministic toy hybrid model (:class:`ToyHybridModel`) so every restore is
verified byte for byte. The pytest plugin (:mod:`lmcache_rc.testing.pytest_plugin`)
provides the ``lmcache_rc_server``, ``lmcache_rc_client`` and ``sim_engine_factory``
fixtures. See ``docs/testing.md``.

Nothing here is imported by the production modules.
"""

from __future__ import annotations

from lmcache_rc.testing.allocator import (
    BlockPool,
    BoundaryCheckpoint,
    BoundaryCheckpointCache,
    SimAdmissionKVCacheManager,
    SimKVCacheManager,
    SimRequest,
)
from lmcache_rc.testing.ranks import FaultRule, RankError, RestoreMismatch
from lmcache_rc.testing.sim_engine import (
    DEFAULT_IDENTITY,
    EngineStats,
    EngineStatus,
    RequestResult,
    SimEngine,
)
from lmcache_rc.testing.toy_model import (
    FullAttentionSpec,
    HybridGeometry,
    MambaSpec,
    SlidingWindowSpec,
    ToyHybridModel,
)

__all__ = [
    "DEFAULT_IDENTITY",
    "BlockPool",
    "BoundaryCheckpoint",
    "BoundaryCheckpointCache",
    "EngineStats",
    "EngineStatus",
    "FaultRule",
    "FullAttentionSpec",
    "HybridGeometry",
    "MambaSpec",
    "RankError",
    "RequestResult",
    "RestoreMismatch",
    "SimAdmissionKVCacheManager",
    "SimEngine",
    "SimKVCacheManager",
    "SimRequest",
    "SlidingWindowSpec",
    "ToyHybridModel",
]
