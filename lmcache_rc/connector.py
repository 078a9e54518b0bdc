"""The class path users configure: ``kv_connector_module_path="lmcache_rc.connector"``.

The connector lives in :mod:`lmcache_rc.vllm` (role and mode dispatch in
:mod:`lmcache_rc.vllm.connector`); this module re-exports it and the option
helpers under their long-standing names.
"""

from __future__ import annotations

from lmcache_rc.vllm.connector import LMCacheRecurrentCheckpointConnector, resolve_mode
from lmcache_rc.vllm.identity import PRECISION_ENV_VARS, checkpoint_identity
from lmcache_rc.vllm.metadata import CheckpointConnectorMetadata, CheckpointWorkerMetadata
from lmcache_rc.vllm.options import (
    OPTION_DEFAULTS,
    OPTION_PREFIX,
    ConnectorOptions,
    InvalidConnectorConfig,
    parse_options,
)
from lmcache_rc.vllm.worker import SEEN_TASKS as _SEEN_TASKS

__all__ = [
    "OPTION_DEFAULTS",
    "OPTION_PREFIX",
    "PRECISION_ENV_VARS",
    "_SEEN_TASKS",
    "CheckpointConnectorMetadata",
    "CheckpointWorkerMetadata",
    "ConnectorOptions",
    "InvalidConnectorConfig",
    "LMCacheRecurrentCheckpointConnector",
    "checkpoint_identity",
    "parse_options",
    "resolve_mode",
]
