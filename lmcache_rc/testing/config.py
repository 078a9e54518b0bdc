"""Simulated vLLM configuration objects and the connector factory.

See docs/design/vllm-boundary-api.md §1.1, §2.1 and §4.

What it owns: picklable stand-ins for ``VllmConfig`` and its sub-configs with the
fields the connector reads (``kv_transfer_config.get_from_extra_config``,
``parallel_config``, ``speculative_config``, ``model_config.compute_hash()``, ...),
the ``use_request_boundary_checkpoints`` property that consults the connector
class exactly like the fork, and the factory that imports a connector by module
path and enforces the ``kv_cache_config`` keyword and ``SupportsHMA`` checks.

Why: the simulated engine must build and select the connector the way vLLM does,
so configuration mistakes surface in CPU tests.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from lmcache_rc.vllm.api import KVConnectorRole, SupportsHMA

__all__ = [
    "SimCacheConfig",
    "SimKVTransferConfig",
    "SimModelConfig",
    "SimParallelConfig",
    "SimSchedulerConfig",
    "SimSpeculativeConfig",
    "SimVllmConfig",
    "create_connector",
    "get_connector_class",
]


def _hash(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class SimKVTransferConfig:
    """``KVTransferConfig`` stand-in; ``kv_role`` is required with a connector.

    See docs/design/vllm-boundary-api.md §1.1.
    """

    kv_connector: str | None = None
    kv_connector_module_path: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_load_failure_policy: str = "fail"

    def __post_init__(self) -> None:
        if self.kv_connector is not None and self.kv_role is None:
            raise ValueError("kv_role must be set when kv_connector is set")
        if self.kv_connector_module_path == "":
            raise ValueError("kv_connector_module_path must not be empty")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        """``kv_connector_extra_config.get(key, default)``."""
        return self.kv_connector_extra_config.get(key, default)

    @property
    def is_kv_transfer_instance(self) -> bool:
        """Whether a connector is configured."""
        return self.kv_connector is not None

    @property
    def is_kv_producer(self) -> bool:
        """Role includes producing."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        """Role includes consuming."""
        return self.kv_role in ("kv_consumer", "kv_both")

    def compute_hash(self) -> str:
        """Contributes nothing to the graph hash (as in vLLM)."""
        return _hash([])


@dataclass
class SimParallelConfig:
    """``ParallelConfig`` stand-in; ``rank`` is set per worker."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    rank: int = 0

    @property
    def world_size(self) -> int:
        """TP x PP x DCP ranks of this engine."""
        return (
            self.tensor_parallel_size
            * self.pipeline_parallel_size
            * self.decode_context_parallel_size
        )


@dataclass
class SimSpeculativeConfig:
    """``SpeculativeConfig`` stand-in (static method only)."""

    method: str | None = "mtp"
    num_speculative_tokens: int | None = 1


@dataclass
class SimModelConfig:
    """``ModelConfig`` stand-in."""

    model: str = "toy-hybrid"
    max_model_len: int = 4096
    dtype: str = "bfloat16"
    hidden_size: int = 64
    hf_config: dict[str, Any] = field(default_factory=dict)

    def compute_hash(self) -> str:
        """Hash of every field."""
        return _hash(asdict(self))

    def get_hidden_size(self) -> int:
        """Model hidden size."""
        return self.hidden_size


@dataclass
class SimSchedulerConfig:
    """``SchedulerConfig`` stand-in."""

    max_num_batched_tokens: int = 64
    max_num_seqs: int = 16
    disable_hybrid_kv_cache_manager: bool = False


@dataclass
class SimCacheConfig:
    """``CacheConfig`` stand-in."""

    enable_prefix_caching: bool = True
    mamba_cache_mode: str = "align"
    recurrent_checkpoint_policy: str = "request_boundaries"


@dataclass
class SimVllmConfig:
    """``VllmConfig`` stand-in (docs/design/vllm-boundary-api.md §4, its first bullet).

    ``boundary_checkpoints_requested`` plays the fork's gating conditions other
    than the connector (policy, prefix caching, model type, ...).
    """

    model_config: SimModelConfig = field(default_factory=SimModelConfig)
    parallel_config: SimParallelConfig = field(default_factory=SimParallelConfig)
    scheduler_config: SimSchedulerConfig = field(default_factory=SimSchedulerConfig)
    cache_config: SimCacheConfig = field(default_factory=SimCacheConfig)
    speculative_config: SimSpeculativeConfig | None = None
    kv_transfer_config: SimKVTransferConfig | None = None
    lora_config: Any = None
    boundary_checkpoints_requested: bool = True

    def compute_hash(self) -> str:
        """Hash of the graph-affecting settings (kv transfer and rank excluded)."""
        pc = asdict(self.parallel_config)
        pc.pop("rank", None)
        return _hash(
            {
                "model": self.model_config.compute_hash(),
                "parallel": pc,
                "speculative": asdict(self.speculative_config) if self.speculative_config else None,
            }
        )

    @property
    def external_boundary_checkpoint_adapter_available(self) -> bool:
        """True without a connector; else ``cls.supports_request_boundary_checkpoints(self)``."""
        if self.kv_transfer_config is None or not self.kv_transfer_config.is_kv_transfer_instance:
            return True
        cls = get_connector_class(self.kv_transfer_config)
        fn = getattr(cls, "supports_request_boundary_checkpoints", None)
        return bool(fn(self)) if fn is not None else False

    @property
    def use_request_boundary_checkpoints(self) -> bool:
        """Re-evaluated on each access, like the fork (docs/design/vllm-boundary-api.md §2.1)."""
        if not self.boundary_checkpoints_requested or self.lora_config is not None:
            return False
        if not self.cache_config.enable_prefix_caching:
            return False
        if self.cache_config.recurrent_checkpoint_policy not in ("auto", "request_boundaries"):
            return False
        return self.external_boundary_checkpoint_adapter_available

    def for_rank(self, rank: int) -> SimVllmConfig:
        """A copy whose ``parallel_config.rank`` is ``rank`` (what each worker sees)."""
        return replace(self, parallel_config=replace(self.parallel_config, rank=rank))


def get_connector_class(kv_transfer_config: SimKVTransferConfig) -> type[Any]:
    """Import ``kv_connector`` from ``kv_connector_module_path``.

    The factory rules of docs/design/vllm-boundary-api.md §1.1.
    """
    name = kv_transfer_config.kv_connector
    path = kv_transfer_config.kv_connector_module_path
    if not name:
        raise ValueError("kv_connector is not set")
    if not path:
        raise ValueError(f"unknown KV connector {name!r} (the simulator has no registry)")
    module = importlib.import_module(path)
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{path} has no connector class {name!r}")
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    if "kv_cache_config" not in params:
        raise ValueError(f"connector {name} must accept a kv_cache_config keyword")
    return cls


def create_connector(
    config: SimVllmConfig,
    role: KVConnectorRole,
    kv_cache_config: Any,
    cls: type[Any] | None = None,
) -> Any:
    """Build one connector instance; hybrid configs require ``SupportsHMA``."""
    assert config.kv_transfer_config is not None
    if cls is None:
        cls = get_connector_class(config.kv_transfer_config)
    if not config.scheduler_config.disable_hybrid_kv_cache_manager and not issubclass(
        cls, SupportsHMA
    ):
        raise ValueError(f"connector {cls.__name__} must subclass SupportsHMA for hybrid models")
    return cls(config, role, kv_cache_config=kv_cache_config)
