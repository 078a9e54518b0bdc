"""The class path users configure: ``kv_connector_module_path="lmcache_rc.connector"``.

vLLM resolves ``LMCacheRecurrentCheckpointConnector`` by name in this module;
the connector lives in :mod:`lmcache_rc.vllm.connector` (import everything
else from :mod:`lmcache_rc.vllm`'s modules directly).
"""

from __future__ import annotations

from lmcache_rc.vllm.connector import LMCacheRecurrentCheckpointConnector

__all__ = ["LMCacheRecurrentCheckpointConnector"]
