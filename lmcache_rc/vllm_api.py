"""The vLLM Protocols under their long-standing module name (see :mod:`lmcache_rc.vllm.api`)."""

from __future__ import annotations

from lmcache_rc.vllm.api import *  # noqa: F403
from lmcache_rc.vllm.api import __all__ as __all__
