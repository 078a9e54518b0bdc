"""Installable stand-ins of two vLLM builds, written as packages into a folder.

The connector decides which vLLM it runs on at import time, from what the
installed ``vllm`` package offers. These stand-ins reproduce exactly the
markers each build has and nothing more, so a test that runs the connector on
them fails if detection leans on anything the real build lacks:

- ``"fork"``: the request-boundary fork (docs/design/vllm-boundary-api.md §2.1,
  §2.2). Its connector base class defines ``supports_request_boundary_checkpoints``
  (answering False), ``poll_boundary_checkpoint`` and ``has_pending_push_work``,
  and **not** ``bind_boundary_checkpoint_cache`` (a connector must define that
  hook itself); its ``VllmConfig`` has the ``use_request_boundary_checkpoints``
  property. It predates stock vLLM 0.33's transfer results and block states.
- ``"stock"``: stock vLLM 0.33 as upstream mode needs it:
  ``KVConnectorTransferResults`` in the base module and ``KVConnectorBlockState``
  in the scheduler output module, and none of the fork's markers.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

_BASE_COMMON = '''
"""Stand-in of vllm.distributed.kv_transfer.kv_connector.v1.base ({flavour})."""

import enum
from abc import ABC, abstractmethod


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata(ABC):  # noqa: B024
    pass


class SupportsHMA(ABC):
    @abstractmethod
    def request_finished_all_groups(self, request, block_ids):
        raise NotImplementedError


class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        self._vllm_config = vllm_config
        self._kv_transfer_config = vllm_config.kv_transfer_config
        self._kv_cache_config = kv_cache_config
        self._role = role
        self._connector_metadata = None

    @property
    def role(self):
        return self._role

    def bind_connector_metadata(self, connector_metadata):
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        self._connector_metadata = None

    def has_connector_metadata(self):
        return self._connector_metadata is not None

    def _get_connector_metadata(self):
        return self._connector_metadata
{extra}
'''

_FORK_BASE = """
    # the fork's deltas: these three, and not the scheduler's bind hook
    def poll_boundary_checkpoint(self, request):
        return True

    def has_pending_push_work(self):
        return False

    @classmethod
    def supports_request_boundary_checkpoints(cls, vllm_config):
        return False
"""

_STOCK_BASE = """

class KVConnectorTransferResults:
    pass
"""

_KV_CACHE_INTERFACE = '''
"""Stand-in of vllm.v1.kv_cache_interface: the simulated engine is this build's engine,
so its layer specs are this build's specs."""

from lmcache_rc.testing.toy_model import MambaSpec  # noqa: F401


def iter_layer_specs(spec):
    members = getattr(spec, "kv_cache_specs", None)
    return list(members.values()) if isinstance(members, dict) else [spec]
'''

_FORK_CONFIG = '''
"""Stand-in of vllm.config: the fork's VllmConfig marker."""


class VllmConfig:
    @property
    def use_request_boundary_checkpoints(self):
        return False
'''

_STOCK_CONFIG = '''
"""Stand-in of vllm.config: stock VllmConfig (no boundary property)."""


class VllmConfig:
    pass
'''

_STOCK_OUTPUT = '''
"""Stand-in of vllm.v1.core.sched.output."""


class KVConnectorBlockState:
    pass
'''

FLAVOURS = ("fork", "stock")


def write_fake_vllm(root: Path, flavour: str) -> Path:
    """Write a ``vllm`` package of ``flavour`` (see module doc) under ``root``; return ``root``."""
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, not {flavour!r}")
    fork = flavour == "fork"
    files = {
        "vllm/__init__.py": f'__version__ = "{"0.9.2.dev1+fork" if fork else "0.33.0"}"\n',
        "vllm/config/__init__.py": _FORK_CONFIG if fork else _STOCK_CONFIG,
        "vllm/distributed/__init__.py": "",
        "vllm/distributed/kv_transfer/__init__.py": "",
        "vllm/distributed/kv_transfer/kv_connector/__init__.py": "",
        "vllm/distributed/kv_transfer/kv_connector/v1/__init__.py": "",
        "vllm/distributed/kv_transfer/kv_connector/v1/base.py": _BASE_COMMON.format(
            flavour=flavour, extra=_FORK_BASE if fork else _STOCK_BASE
        ),
        "vllm/v1/__init__.py": "",
        "vllm/v1/core/__init__.py": "",
        "vllm/v1/core/sched/__init__.py": "",
        "vllm/v1/kv_cache_interface.py": _KV_CACHE_INTERFACE,
    }
    if not fork:
        files["vllm/v1/core/sched/output.py"] = _STOCK_OUTPUT
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root
