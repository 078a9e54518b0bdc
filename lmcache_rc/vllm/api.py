"""vLLM as seen by lmcache-rc — the only module that knows vLLM names.

What it owns: structural ``typing.Protocol`` descriptions of every vLLM object the
connector touches, in both modes: the fork's boundary-checkpoint API
(``docs/design/vllm-boundary-api.md``) and stock vLLM 0.33's connector API
(upstream mode, ``docs/vllm.md``); a few small concrete
types both sides share (:class:`CheckpointEngineTask`), stand-ins for the vLLM
base classes and enums used when vLLM is not importable (CPU tests, the
simulated engine in :mod:`lmcache_rc.testing`), and helpers that detect optional
allocator generations exactly as the reference connector does.

Why: the connector (``lmcache_rc.vllm``) and the simulated engine are written
against these protocols, so a vLLM rename is fixed here once, and the simulator
can prove it plays the same contract without importing vLLM. Attribute and
parameter names below are vLLM's own and must not be "improved".

What it must never do: import torch or vLLM unconditionally, or hold state.
"""

from __future__ import annotations

import enum
import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lmcache_rc._native import Manifest

__all__ = [
    "ADMISSION_METHODS",
    "CHECKPOINT_KINDS",
    "AuxiliaryGroupName",
    "BlockPool",
    "BoundaryCheckpoint",
    "BoundaryCheckpointCache",
    "BoundaryCheckpointState",
    "CheckpointEngineTask",
    "CheckpointKind",
    "Direction",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheTensor",
    "KVConnectorBase_V1",
    "KVConnectorBlockState",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorWorkerMetadata",
    "KVTransferConfig",
    "ModelConfig",
    "ParallelConfig",
    "Request",
    "RouterHasher",
    "SchedulerConfig",
    "SchedulerOutput",
    "SingleTypeManager",
    "SpeculativeConfig",
    "SupportsHMA",
    "UpstreamKVCacheManager",
    "VllmConfig",
    "engine_group_name",
    "has_boundary_api",
    "has_upstream_api",
    "is_recurrent_group",
    "kv_cache_spec_kind_name",
    "kv_event_types",
    "kv_events_enabled",
    "layer_spec",
    "spec_kind",
    "supports_admission_api",
    "worker_rank",
]

CheckpointKind = Literal["instruction", "prompt", "response", "prefill_tail"]
"""Kinds of :class:`BoundaryCheckpoint` (``prefill_tail`` only in the 4-slot version)."""

CHECKPOINT_KINDS: tuple[str, ...] = ("instruction", "prompt", "response", "prefill_tail")
"""All kinds the allocator may accept, in the order the reference defines them."""

Direction = Literal["STORE", "RETRIEVE"]
"""Direction of a :class:`CheckpointEngineTask` (GPU→SHM is STORE)."""

AuxiliaryGroupName = "target-draft-auxiliary"
"""Manifest page-group name of the auxiliary page (always last, positions ``[0]``)."""


def engine_group_name(group_index: int) -> str:
    """Manifest page-group name of vLLM KV-cache group ``group_index``.

    See docs/design/manifests.md#what-each-mode-writes.
    """
    return f"engine-kv-group:{group_index}"


# --------------------------------------------------------------------------- roles and bases

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        SupportsHMA,
    )

    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
            KVConnectorWorkerMetadata,
        )
    except ImportError:

        class KVConnectorWorkerMetadata(ABC):  # type: ignore[no-redef]
            """Stand-in: worker → scheduler metadata folded across ranks with ``aggregate``."""

            @abstractmethod
            def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
                """Fold ``other`` (a later rank) into this object and return the result."""

    VLLM_AVAILABLE = True
except ImportError:
    VLLM_AVAILABLE = False

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        """Stand-in for ``vllm...base.KVConnectorRole``: which process a connector serves."""

        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata(ABC):  # type: ignore[no-redef]  # noqa: B024
        """Stand-in: scheduler → worker metadata (an empty ABC in vLLM; pickled to every rank)."""

    class KVConnectorWorkerMetadata(ABC):  # type: ignore[no-redef]
        """Stand-in: worker → scheduler metadata folded across ranks with ``aggregate``."""

        @abstractmethod
        def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
            """Fold ``other`` (a later rank) into this object and return the result."""

    class KVConnectorBase_V1(ABC):  # type: ignore[no-redef]
        """Stand-in for vLLM's connector base: stores config and role.

        Only the constructor contract (docs/design/vllm-boundary-api.md §1.1) and the
        defaults §1.2-§1.3 name are reproduced; a connector overrides what it
        uses.
        """

        def __init__(
            self,
            vllm_config: Any,
            role: KVConnectorRole,
            kv_cache_config: Any | None = None,
        ) -> None:
            if getattr(vllm_config, "kv_transfer_config", None) is None:
                raise ValueError("kv_transfer_config must be set for a KV connector")
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._kv_cache_config = kv_cache_config
            self._role = role
            self._connector_metadata: KVConnectorMetadata | None = None

        @property
        def role(self) -> KVConnectorRole:
            """Which process this instance serves."""
            return self._role

        # worker side -----------------------------------------------------------------
        def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
            """Bind this step's scheduler metadata (before the forward)."""
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            """Drop this step's metadata (after the forward)."""
            self._connector_metadata = None

        def has_connector_metadata(self) -> bool:
            """Whether metadata is bound for this step."""
            return self._connector_metadata is not None

        def _get_connector_metadata(self) -> KVConnectorMetadata:
            assert self._connector_metadata is not None
            return self._connector_metadata

        def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:  # noqa: B027
            """Receive the KV tensors (no-op by default)."""

        def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:  # noqa: B027
            """React to preemptions before binding (no-op by default)."""

        def get_finished(
            self, finished_req_ids: set[str]
        ) -> tuple[set[str] | None, set[str] | None]:
            """Requests whose async send/receive finished (none by default)."""
            return None, None

        def get_block_ids_with_load_errors(self) -> set[int]:
            """Blocks whose load failed (none by default)."""
            return set()

        def get_kv_connector_stats(self) -> Any | None:
            """Transfer statistics (none by default)."""
            return None

        def get_kv_connector_kv_cache_events(self) -> Any | None:
            """KV cache events (none by default)."""
            return None

        def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
            """Worker → scheduler metadata of this step (none by default)."""
            return None

        def get_handshake_metadata(self) -> Any | None:
            """Startup handshake data (none by default)."""
            return None

        def shutdown(self) -> None:  # noqa: B027
            """Release resources at process exit (no-op by default)."""

        # scheduler side -------------------------------------------------------------
        def bind_gpu_block_pool(self, block_pool: Any) -> None:  # noqa: B027
            """Receive the scheduler's block pool (no-op by default)."""

        def on_new_request(self, request: Any) -> None:  # noqa: B027
            """A request was added (no-op by default)."""

        def update_connector_output(self, connector_output: Any) -> None:  # noqa: B027
            """Aggregated worker output of a step (no-op by default)."""

        def request_finished(
            self, request: Any, block_ids: list[int]
        ) -> tuple[bool, dict[str, Any] | None]:
            """A request finished (single-group connectors)."""
            return False, None

        def take_events(self) -> Iterable[Any]:
            """KV events produced since the last call."""
            return ()

        def reset_cache(self) -> bool | None:
            """Reset external caches (not supported by default)."""
            return None

        def get_finished_count(self) -> int | None:
            """Expected finished count per request (None = world size)."""
            return None

        def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:  # noqa: B027
            """Receive merged worker handshake metadata (no-op by default)."""

        # fork deltas [F] --------------------------------------------------------------
        def poll_boundary_checkpoint(self, request: Any) -> bool:
            """Whether the request may proceed to local lookup this step (default True)."""
            return True

        def has_pending_push_work(self) -> bool:
            """Whether connector-only steps must continue (default False)."""
            return False

        @classmethod
        def supports_request_boundary_checkpoints(cls, vllm_config: Any) -> bool:
            """Whether this connector can import/export boundary bundles (base: False)."""
            return False

        # abstract in vLLM -------------------------------------------------------------
        @abstractmethod
        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            """Submit this step's loads (every worker step)."""

        @abstractmethod
        def wait_for_layer_load(self, layer_name: str) -> None:
            """Block until ``layer_name`` is loaded."""

        @abstractmethod
        def save_kv_layer(
            self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
        ) -> None:
            """Start saving one layer."""

        @abstractmethod
        def wait_for_save(self) -> None:
            """Block until this step's saves are done."""

        @abstractmethod
        def get_num_new_matched_tokens(
            self, request: Any, num_computed_tokens: int
        ) -> tuple[int | None, bool]:
            """External tokens beyond the local hit (None = ask again later)."""

        @abstractmethod
        def update_state_after_alloc(
            self, request: Any, blocks: Any, num_external_tokens: int
        ) -> None:
            """Called after ``allocate_slots`` for a request."""

        @abstractmethod
        def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
            """Scheduler → worker metadata of this step (every ``schedule()``)."""

    class SupportsHMA(ABC):  # type: ignore[no-redef]
        """Stand-in for vLLM's hybrid-memory-allocator mix-in.

        See docs/design/vllm-boundary-api.md §1.3.
        """

        @abstractmethod
        def request_finished_all_groups(
            self, request: Any, block_ids: tuple[list[int], ...]
        ) -> tuple[bool, dict[str, Any] | None]:
            """Called once per finished request for all KV groups, before blocks are freed."""


# --------------------------------------------------------------------------- connector statistics

try:  # pragma: no cover - exercised only where vLLM is installed
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # type: ignore[import-not-found, unused-ignore]
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
except ImportError:

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        """Stand-in for vLLM's connector statistics base: a ``data`` dict that
        travels from the engine to the API server's loggers, folded with
        ``aggregate`` and summarised with ``reduce``."""

        data: dict[str, Any] = field(default_factory=dict)

        def to_dict(self) -> dict[str, Any]:
            """The serialisable payload."""
            return self.data

    class KVConnectorPromMetrics:  # type: ignore[no-redef]
        """Stand-in for vLLM's per-connector Prometheus metrics base: keeps
        the metric classes vLLM hands over and the engines' label values."""

        def __init__(
            self,
            vllm_config: Any,
            metric_types: dict[type[Any], type[Any]],
            labelnames: list[str],
            per_engine_labelvalues: dict[int, list[object]],
        ) -> None:
            from prometheus_client import Counter, Gauge, Histogram

            self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
            self._gauge_cls = metric_types[Gauge]
            self._counter_cls = metric_types[Counter]
            self._histogram_cls = metric_types[Histogram]
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues


# --------------------------------------------------------------------------- configuration


@runtime_checkable
class KVTransferConfig(Protocol):
    """``vllm.config.KVTransferConfig`` fields the connector reads.

    See docs/design/vllm-boundary-api.md §1.1.
    """

    kv_connector: str | None
    kv_connector_module_path: str | None
    kv_role: str | None
    kv_connector_extra_config: dict[str, Any]
    engine_id: str | None
    kv_load_failure_policy: str

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        """Value of ``kv_connector_extra_config[key]`` or ``default``."""
        ...


class ParallelConfig(Protocol):
    """``vllm.config.ParallelConfig`` subset (geometry enters the checkpoint identity)."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    decode_context_parallel_size: int
    cp_kv_cache_interleave_size: int
    world_size: int
    rank: int


class SpeculativeConfig(Protocol):
    """``vllm.config.SpeculativeConfig`` subset: ``method`` ("mtp", "dflash", ...)."""

    method: str | None
    num_speculative_tokens: int | None


class ModelConfig(Protocol):
    """``vllm.config.ModelConfig`` subset used for identity and geometry."""

    max_model_len: int
    dtype: Any

    def compute_hash(self) -> str:
        """Hash of every graph-affecting model setting."""
        ...

    def get_hidden_size(self) -> int:
        """Model hidden size."""
        ...


class SchedulerConfig(Protocol):
    """``vllm.config.SchedulerConfig`` subset."""

    disable_hybrid_kv_cache_manager: bool


class VllmConfig(Protocol):
    """``vllm.config.VllmConfig`` subset (docs/design/vllm-boundary-api.md §1.1, §2.1, §4)."""

    kv_transfer_config: KVTransferConfig | None
    parallel_config: ParallelConfig
    speculative_config: SpeculativeConfig | None
    model_config: ModelConfig
    scheduler_config: SchedulerConfig

    def compute_hash(self) -> str:
        """Hash of the whole configuration."""
        ...

    @property
    def use_request_boundary_checkpoints(self) -> bool:
        """Whether boundary checkpoints are on (consults the connector class).

        See docs/design/vllm-boundary-api.md §2.1.
        """
        ...


def worker_rank(vllm_config: Any) -> int:
    """The rank of the calling worker process in ``[0, parallel_config.world_size)``.

    vLLM sets ``parallel_config.rank`` in each worker before the connector is
    built; the simulated engine does the same per rank.
    """
    return int(getattr(vllm_config.parallel_config, "rank", 0))


# --------------------------------------------------------------------------- scheduler side


class Request(Protocol):
    """``vllm.v1.request.Request`` fields the connector reads.

    See docs/design/vllm-boundary-api.md §2.3.
    """

    request_id: str
    lora_request: Any | None
    cache_salt: str | None
    mm_features: Any
    num_computed_tokens: int
    boundary_checkpoint: BoundaryCheckpoint | None

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length (upstream mode: prompt checkpoints stop here)."""
        ...

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt plus generated tokens."""
        ...

    @property
    def num_tokens(self) -> int:
        """``len(all_token_ids)``."""
        ...


class BoundaryCheckpoint(Protocol):
    """``vllm.v1.core.boundary_checkpoint.BoundaryCheckpoint`` (frozen dataclass).

    See docs/design/vllm-boundary-api.md §2.4.
    """

    @property
    def checkpoint_id(self) -> int:
        """Allocator-local id, increasing from 1."""
        ...

    @property
    def num_tokens(self) -> int:
        """Exact committed prefix length."""
        ...

    @property
    def block_ids(self) -> tuple[tuple[int, ...], ...]:
        """Per KV group, indexed by logical page position; 0 where not part of the bundle."""
        ...

    @property
    def auxiliary_block_ids(self) -> tuple[int, ...]:
        """Exactly one auxiliary page."""
        ...

    @property
    def draft_prefix_len(self) -> int:
        """Draft KV coverage."""
        ...

    @property
    def kind(self) -> str:
        """One of :data:`CHECKPOINT_KINDS`."""
        ...

    @property
    def dependencies(self) -> frozenset[int]:
        """Every non-zero id in ``block_ids`` and ``auxiliary_block_ids``."""
        ...


class BoundaryCheckpointCache(Protocol):
    """``manager.boundary_checkpoints`` (docs/design/vllm-boundary-api.md §2.4)."""

    def supports_request(self, request: Any) -> bool:
        """Whether boundary checkpoints apply to ``request`` at all.

        False e.g. for prompt embeddings or resumable requests
        (docs/design/vllm-boundary-api.md §2.4).
        """
        ...

    def find(self, request: Any, max_length: int) -> BoundaryCheckpoint | None:
        """Longest published checkpoint that is an exact prefix of ``request``."""
        ...

    def acquire(self, checkpoint_id: int) -> BoundaryCheckpoint | None:
        """Pin every dependency of a published checkpoint; None if not published."""
        ...

    def release(self, checkpoint: BoundaryCheckpoint) -> None:
        """Undo one :meth:`acquire`."""
        ...

    def stage(self, request: Any, checkpoint: BoundaryCheckpoint, num_ranks: int) -> None:
        """Record a pending bundle, pinning its dependencies."""
        ...

    def acknowledge(self, checkpoint_id: int, rank: int) -> bool:
        """Record ``rank``; True only on the call that publishes."""
        ...

    def discard(self, checkpoint_id: int) -> None:
        """Release a pending bundle."""
        ...

    def is_pending(self, checkpoint_id: int) -> bool:
        """Whether ``checkpoint_id`` is staged and unresolved."""
        ...

    def contains_block(self, block_id: int) -> bool:
        """Whether a published bundle depends on ``block_id``."""
        ...

    def invalidate_block(self, block_id: int) -> None:
        """Eviction hook: drop published bundles / mark pending ones using ``block_id``."""
        ...

    def invalidate(self, checkpoint_id: int) -> None:
        """Drop one published bundle."""
        ...

    def clear(self) -> None:
        """Drop every published bundle (RuntimeError if anything is pending)."""
        ...

    def next_id(self) -> int:
        """A fresh checkpoint id."""
        ...

    def __len__(self) -> int:
        """Number of published entries."""
        ...


class KVCacheBlocks(Protocol):
    """``vllm.v1.core.kv_cache_manager.KVCacheBlocks`` subset."""

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per KV group."""
        ...


class BlockPool(Protocol):
    """``vllm.v1.core.block_pool.BlockPool`` subset the connector (and tests) use."""

    blocks: Sequence[Any]
    """``KVCacheBlock`` objects indexed by block id."""

    def get_num_free_blocks(self) -> int:
        """Free blocks, including free-but-cached ones."""
        ...

    def touch(self, blocks: Sequence[Any]) -> None:
        """Take one reference on each block (upstream mode pins store sources)."""
        ...

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        """Drop one reference on each block."""
        ...


class KVCacheGroupSpec(Protocol):
    """``kv_cache_config.kv_cache_groups[g]``: ``layer_names`` and ``kv_cache_spec``."""

    layer_names: list[str]
    kv_cache_spec: Any


class KVCacheTensor(Protocol):
    """``vllm.v1.kv_cache_interface.KVCacheTensor``: placement of same-shaped layers."""

    size: int
    layers: list[str]


class KVCacheConfig(Protocol):
    """``vllm.v1.kv_cache_interface.KVCacheConfig`` subset."""

    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]
    kv_cache_tensors: list[KVCacheTensor]


_RECURRENT_SPECS = ("MambaSpec",)
_ATTENTION_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


def layer_spec(group: KVCacheGroupSpec, layer: str) -> Any:
    """The spec of ``layer`` in ``group`` (a ``UniformTypeKVCacheSpecs`` holds one per layer)."""
    members = getattr(group.kv_cache_spec, "kv_cache_specs", None)
    if isinstance(members, Mapping) and layer in members:
        return members[layer]
    return group.kv_cache_spec


def spec_kind(spec: Any) -> str | None:
    """``"recurrent"`` (Mamba/GDN/KDA state), ``"attention"`` (full attention),
    or None for kinds lmcache-rc cannot checkpoint (sliding window, chunked
    local, cross attention, ...). Decided by class name so no vLLM import is
    needed; a grouped spec counts when all its members agree."""
    members = getattr(spec, "kv_cache_specs", None)
    if isinstance(members, Mapping) and members:
        kinds = {spec_kind(s) for s in members.values()}
        return kinds.pop() if len(kinds) == 1 else None
    name = type(spec).__name__
    if name in _RECURRENT_SPECS:
        return "recurrent"
    if name in _ATTENTION_SPECS and getattr(spec, "sliding_window", None) is None:
        return "attention"
    return None


class SingleTypeManager(Protocol):
    """``manager.coordinator.single_type_managers[g]``: its scheduler-side page width."""

    block_size: int


def is_recurrent_group(group: KVCacheGroupSpec) -> bool:
    """Whether KV group ``group`` is recurrent: *all* its layer specs are ``MambaSpec``.

    With vLLM installed this uses ``iter_layer_specs`` and ``MambaSpec`` as the
    reference does; otherwise a spec is recurrent when its class is named
    ``MambaSpec`` (the simulated engine's stand-in), or, for a grouped spec,
    when every member of ``kv_cache_specs`` is.
    """
    spec = group.kv_cache_spec
    if VLLM_AVAILABLE:  # pragma: no cover - vLLM not installed in CI
        from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found, unused-ignore]
            MambaSpec,
            iter_layer_specs,
        )

        specs = list(iter_layer_specs(spec))
        return bool(specs) and all(isinstance(s, MambaSpec) for s in specs)
    members = getattr(spec, "kv_cache_specs", None)
    if isinstance(members, Mapping) and members:
        return all(type(s).__name__ == "MambaSpec" for s in members.values())
    return type(spec).__name__ == "MambaSpec"


class KVCacheManager(Protocol):
    """``vllm.v1.core.kv_cache_manager.KVCacheManager`` boundary subset.

    See docs/design/vllm-boundary-api.md §2.3; its introduction explains the
    "legacy #709" allocator.

    The newer restore-admission methods are listed in :data:`ADMISSION_METHODS`;
    detect them with :func:`supports_admission_api`.
    """

    boundary_checkpoints: BoundaryCheckpointCache | None
    block_pool: BlockPool
    coordinator: Any  # .single_type_managers[g].block_size
    kv_cache_config: KVCacheConfig
    max_model_len: int

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        """Caching is on and ``request`` does not skip prefix-cache reads."""
        ...

    def boundary_checkpoint_page_positions(self, num_tokens: int) -> tuple[tuple[int, ...], ...]:
        """Logical page indices per KV group for a checkpoint of ``num_tokens``."""
        ...

    def reserve_external_boundary_checkpoint(
        self,
        request: Any,
        num_tokens: int,
        page_positions: tuple[tuple[int, ...], ...],
        *,
        draft_prefix_len: int,
        kind: str,
        num_ranks: int,
    ) -> BoundaryCheckpoint | None:
        """Allocate and stage a private import for ``request`` (None = no capacity).

        The newest allocator also accepts ``reserve_admission: bool = False``.
        """
        ...

    def acknowledge_external_boundary_checkpoint(self, checkpoint_id: int, rank: int) -> bool:
        """Record one rank's finished copy; True only on the publishing call."""
        ...

    def discard_external_boundary_checkpoint(self, checkpoint_id: int) -> None:
        """Release an unpublished import (every rank must have reported first)."""
        ...


class UpstreamKVCacheManager(Protocol):
    """``vllm.v1.core.kv_cache_manager.KVCacheManager`` as stock vLLM 0.33 binds it
    (``bind_kv_cache_manager``); the fork's manager also has ``boundary_checkpoints``."""

    block_pool: BlockPool
    kv_cache_config: KVCacheConfig


ADMISSION_METHODS: tuple[str, ...] = (
    "can_admit_external_boundary_request",
    "external_boundary_admission_ready",
    "release_external_boundary_admission",
)
"""Newest-allocator methods whose presence (callable) marks the admission API [T]."""


def supports_admission_api(manager: Any) -> bool:
    """Whether ``manager`` has the restore-admission reservation API.

    See docs/design/vllm-boundary-api.md §2.3.

    Mirrors the reference detection: the three methods of
    :data:`ADMISSION_METHODS` are callable and
    ``reserve_external_boundary_checkpoint`` accepts ``reserve_admission``.
    """
    if not all(callable(getattr(manager, name, None)) for name in ADMISSION_METHODS):
        return False
    reserve = getattr(manager, "reserve_external_boundary_checkpoint", None)
    if reserve is None:
        return False
    try:
        return "reserve_admission" in inspect.signature(reserve).parameters
    except (TypeError, ValueError):
        return False


class KVConnectorBlockState(Protocol):
    """``vllm.v1.core.sched.output.KVConnectorBlockState`` (stock vLLM 0.33)."""

    boundary_state_offloads: dict[str, list[tuple[int, int, int]]]
    """``{request: [(group, block_id, boundary_tokens)]}`` written by this step's forward."""

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...] | None:
        """The request's current block table per group (None: not offered this step)."""
        ...


class SchedulerOutput(Protocol):
    """``vllm.v1.core.sched.output.SchedulerOutput`` subset."""

    finished_req_ids: set[str]
    preempted_req_ids: set[str] | None
    total_num_scheduled_tokens: int
    num_scheduled_tokens: dict[str, int]
    kv_connector_metadata: Any | None
    kv_connector_block_state: KVConnectorBlockState | None


class KVConnectorOutput(Protocol):
    """``vllm.v1.outputs.KVConnectorOutput``, aggregated across ranks.

    See docs/design/vllm-boundary-api.md §1.4 step 3.
    """

    finished_sending: set[str] | None
    finished_recving: set[str] | None
    kv_connector_stats: Any | None
    kv_cache_events: Any | None
    kv_connector_worker_meta: KVConnectorWorkerMetadata | None
    invalid_block_ids: set[int]
    expected_finished_count: int
    failed_recving: set[str]


BOUNDARY_BASE_MARKER = "supports_request_boundary_checkpoints"
"""Defined on the fork's connector base class (answering False); absent from stock vLLM."""

BOUNDARY_CONFIG_MARKER = "use_request_boundary_checkpoints"
"""The fork's ``VllmConfig`` property that turns boundary checkpoints on."""


def has_boundary_api() -> bool:
    """Whether the installed vLLM is the fork with request-boundary checkpoints.

    Decided by the fork's documented markers (docs/design/vllm-boundary-api.md
    §2.1, §2.2): its connector base class defines
    ``supports_request_boundary_checkpoints``, or its ``VllmConfig`` has the
    ``use_request_boundary_checkpoints`` property. The scheduler hook
    ``bind_boundary_checkpoint_cache`` is *not* a marker: the fork's base class
    does not define it (a connector must), so testing for it refused the fork.
    """
    if not VLLM_AVAILABLE:
        return False
    if hasattr(KVConnectorBase_V1, BOUNDARY_BASE_MARKER):
        return True
    try:  # pragma: no cover - depends on the installed vLLM
        from vllm.config import (  # type: ignore[import-not-found, unused-ignore]
            VllmConfig,
        )
    except Exception:
        return False
    return hasattr(VllmConfig, BOUNDARY_CONFIG_MARKER)


def has_upstream_api() -> bool:
    """Whether the installed vLLM offers what upstream mode needs: boundary-state
    offers in the scheduler output and per-request load failures (vLLM 0.33)."""
    if not VLLM_AVAILABLE:
        return False
    try:  # pragma: no cover - depends on the installed vLLM
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
            KVConnectorTransferResults,
        )
        from vllm.v1.core.sched.output import (  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
            KVConnectorBlockState,
        )
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------- worker side


class BoundaryCheckpointState(Protocol):
    """``vllm.v1.worker.gpu.boundary_checkpoint.BoundaryCheckpointState`` connector view.

    See docs/design/vllm-boundary-api.md §2.5.
    """

    def get_external_checkpoint_page_pool(self) -> Any:
        """uint8 ``[num_blocks, page_bytes]`` contiguous pool; row 0 is the null block."""
        ...

    def get_external_checkpoint_layout(self) -> dict[str, Any]:
        """Address-free, capacity-free layout descriptor (must include ``page_bytes``)."""
        ...

    def initialize_external_checkpoint_layout(self, layout: Mapping[str, Any]) -> None:
        """ValueError unless ``layout`` equals :meth:`get_external_checkpoint_layout`."""
        ...


# --------------------------------------------------------------------------- shared types


@dataclass(frozen=True)
class CheckpointEngineTask:
    """One copy task, scheduler → every worker rank, emitted exactly once.

    See docs/design/transfers.md#the-connectors-task-protocol.

    ``block_ids``: physical page ids per manifest group, in position order
    (boundary mode: the auxiliary page group last). In upstream mode a
    RETRIEVE may name block 0 for a page the engine already holds (its local
    prefix hit): that page is not copied. Block ids never enter a manifest.
    """

    task_id: str
    manifest: Manifest
    direction: Direction
    block_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    request_id: str = ""
    """Upstream-mode loads: the request whose blocks receive the pages (ranks
    report it in ``finished_recving``, and in ``failed_recving`` on failure)."""
    error: str = ""
    """Non-empty: the scheduler already knows this task cannot run (e.g. vLLM
    allocated a null block for a restored page); ranks report it failed
    without copying."""
    final: bool = False
    """Upstream-mode stores: the source bytes were final before this step (a
    finished request's response state, pinned so nothing writes its blocks):
    ranks copy at once instead of after the step's forward."""

    def __post_init__(self) -> None:
        if self.direction not in ("STORE", "RETRIEVE"):
            raise ValueError(f"invalid task direction {self.direction!r}")


# --------------------------------------------------------------------------- KV events


@dataclass(eq=False)
class _StandInBlockStored:
    """Stand-in for ``vllm.distributed.kv_events.BlockStored`` (same fields)."""

    block_hashes: list[Any]
    parent_block_hash: Any | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


@dataclass(eq=False)
class _StandInBlockRemoved:
    """Stand-in for ``vllm.distributed.kv_events.BlockRemoved`` (same fields)."""

    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


def kv_event_types() -> tuple[type, type]:
    """vLLM's ``BlockStored`` and ``BlockRemoved`` event classes, or
    stand-ins with the same fields where vLLM is not importable."""
    try:
        from vllm.distributed.kv_events import (  # type: ignore[import-not-found, unused-ignore]
            BlockRemoved,
            BlockStored,
        )
    except ImportError:
        return _StandInBlockStored, _StandInBlockRemoved
    return BlockStored, BlockRemoved


def kv_events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (``kv_events_config`` with
    ``enable_kv_cache_events``), exactly as vLLM's scheduler decides it."""
    config = getattr(vllm_config, "kv_events_config", None)
    return config is not None and bool(getattr(config, "enable_kv_cache_events", False))


def kv_cache_spec_kind_name(spec: Any) -> str | None:
    """vLLM's ``get_kv_cache_spec_kind(spec).value`` (``"full_attention"``,
    ``"mamba"``, ...), or the same decided by :func:`spec_kind` without vLLM."""
    try:
        from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found, unused-ignore]
            get_kv_cache_spec_kind,
        )
    except ImportError:
        kind = spec_kind(spec)
        return {"attention": "full_attention", "recurrent": "mamba"}.get(kind or "")
    return str(get_kv_cache_spec_kind(spec).value)


class RouterHasher:
    """vLLM's prefix-cache block hashing, as a router sees it in KV events:
    a request's block hashes at a group's block size
    (``resolve_block_hashes``), the event form of a hash
    (``maybe_convert_block_hash``), the per-block extra keys of events
    (``generate_block_hash_extra_keys`` then ``to_event_extra_keys``) and
    ``hash_block_tokens`` for a partial block, with the engine's hash function
    (``prefix_caching_hash_algo``). Only built where vLLM is installed (KV
    events exist only there)."""

    def __init__(self, vllm_config: Any, hash_block_size: int) -> None:
        from vllm.utils.hashing import (  # type: ignore[import-not-found, unused-ignore]
            get_hash_fn_by_name,
        )

        self._hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        self.hash_block_size = int(hash_block_size)

    def block_hashes(self, request: Any, block_size: int) -> Sequence[Any]:
        """``request.block_hashes`` viewed at ``block_size``."""
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found, unused-ignore]
            resolve_block_hashes,
        )

        return resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)  # type: ignore[no-any-return]

    def extra_keys(self, request: Any, start: int, end: int) -> tuple[Any, ...] | None:
        """The hash extra keys of tokens ``start:end`` (cache salt on the first block)."""
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found, unused-ignore]
            generate_block_hash_extra_keys,
        )

        keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
        return keys  # type: ignore[no-any-return]

    @staticmethod
    def event_extra_keys(keys: tuple[Any, ...] | None) -> Any:
        """One block's extra keys as events publish them (untagged)."""
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found, unused-ignore]
            to_event_extra_keys,
        )

        converted = to_event_extra_keys([keys])
        return None if converted is None else converted[0]

    def partial_hash(
        self, parent: Any | None, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None
    ) -> Any:
        """``hash_block_tokens`` of a block holding only ``tokens`` (fewer than a block)."""
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found, unused-ignore]
            hash_block_tokens,
        )

        return hash_block_tokens(self._hash_fn, parent, list(tokens), extra_keys)

    @staticmethod
    def external(block_hash: Any) -> Any:
        """The hash as events carry it (``maybe_convert_block_hash``)."""
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found, unused-ignore]
            maybe_convert_block_hash,
        )

        return maybe_convert_block_hash(block_hash)
