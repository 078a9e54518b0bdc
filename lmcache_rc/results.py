"""Shapes of the dict results of the native API, as ``TypedDict``\\ s.

The extension (``lmcache_rc._native``) returns plain dicts; these classes name
their keys and value types so that callers are type-checked (``_native.pyi``
uses them). They exist at run time too, so annotations may name them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

if TYPE_CHECKING:
    from lmcache_rc._native import Manifest

__all__ = [
    "Capabilities",
    "Change",
    "ChangeBatch",
    "ClearReport",
    "DirectoryStatus",
    "EngineReport",
    "GenerationInfo",
    "ListedGeneration",
    "Located",
    "PageGroup",
    "RpcStatus",
    "ServiceStatus",
    "StopReport",
    "TierLoad",
]


class Capabilities(TypedDict):
    """What a client needs to map the sidecar's pool (``capabilities()``): the
    pool itself is the descriptor handed over at the connection's handshake;
    ``pool_id`` changes at every sidecar start."""

    format_version: int
    protocol_version: int
    pool_id: str
    pool_size: int
    durable_index: bool


class ServiceStatus(TypedDict):
    """Counters and gauges of the checkpoint service (``status()``).

    Every counter and gauge is an integer, ``misses`` maps a miss reason to
    its count, and the facts (``version``, ``socket``,
    ``checkpoint_index_path``, ``l2_path``) are strings or None. HTTP
    ``GET /status`` answers the same keys. A newer server may add keys;
    these are the ones this build reports.
    """

    generations: int
    pending: int
    store_leases: int
    retrieve_leases: int
    pins: int
    l1_objects: int
    l1_bytes: int
    l1_capacity: int
    objects: int
    l2_objects: int
    l2_bytes: int
    l2_capacity: int
    l2_bytes_written: int
    l2_queue: int
    l2_write_retrying: int
    """L2 writes waiting for a retry (their pages stay pinned in RAM)."""
    pending_bytes: int
    """Manifest bytes of the pending generations (bounded by ``max_pending_bytes``)."""
    stores_refused: int
    """1 while ``begin`` is refused because the disk is full, else 0."""
    find_hits: int
    find_misses: int
    begin_draining: int
    begin_suppressed: int
    begin_refused_pending_bytes: int
    begin_refused_no_space: int
    abandoned_generations: int
    store_pages_reused: int
    store_pages_new: int
    store_bytes_leased: int
    store_bytes_committed: int
    admission_waits: int
    admission_retries: int
    admission_success_after_eviction: int
    admission_timeouts: int
    admission_busy: int
    published: int
    hits: int
    restored_pages: int
    restored_tokens: int
    evictions: int
    l1_evictions: int
    l2_evictions: int
    l2_loads: int
    retrieve_capacity_waits: int
    retrieves_cancelled: int
    retrieves_expired: int
    l2_corrupt_or_missing: int
    l2_write_errors: int
    l2_write_retries: int
    l2_skipped_full: int
    reclaimed_objects: int
    restart_retired: int
    clears: int
    invalidated_generations: int
    reclaimed_store_leases: int
    reclaimed_retrieve_leases: int
    shared_imports: int
    """Generations a ``find`` found in the shared tier and published here."""
    shared_imports_refused: int
    shared_fetches: int
    """Pages restores fetched from the shared tier into L1."""
    shared_fetch_errors: int
    """Shared-tier fetches that failed (their generations were retired here)."""
    shared_enabled: int
    """1 when a shared tier is configured (``shared_url``), else 0 (and every
    ``shared_*`` value is 0)."""
    shared_upload_queue: int
    """Generations waiting for their upload, plus the one uploading."""
    shared_uploads_queued: int
    shared_uploads_dropped: int
    """Waiting uploads dropped because the queue was full (``shared_upload_queue``)."""
    shared_upload_retries: int
    shared_uploads_given_up: int
    shared_uploads_skipped: int
    """Uploads not made: the generation was retired or its pages left this host first."""
    shared_uploads: int
    shared_manifests_written: int
    shared_manifests_present: int
    shared_upload_failures: int
    shared_pages_uploaded: int
    shared_bytes_uploaded: int
    shared_dedup_hits: int
    shared_pages_refreshed: int
    shared_lookup_hits: int
    shared_misses_none: int
    shared_misses_corrupt: int
    shared_misses_timeout: int
    shared_misses_error: int
    shared_manifests_rejected: int
    shared_pages_fetched: int
    shared_bytes_fetched: int
    shared_fetch_corrupt: int
    shared_fetch_missing: int
    shared_errors: int
    shared_requests: int
    l2_load_latency_us: int
    """Moving average of one L2 page load's time until its bytes arrive
    (file opened, header read), microseconds; 0 until ``l2_load_samples``."""
    l2_load_bytes_per_s: int
    """Moving average of the rate an L2 page load moves its bytes (read,
    verified), bytes per second; 0 until ``l2_load_samples``."""
    l2_load_samples: int
    """L2 page loads measured."""
    shared_load_latency_us: int
    """Moving average of one shared-tier page fetch's time until the store
    answered its GET, microseconds; 0 until ``shared_load_samples``."""
    shared_load_bytes_per_s: int
    """Moving average of the rate a shared-tier fetch moves its bytes (read,
    verified, copied into L1), bytes per second."""
    shared_load_samples: int
    """Shared-tier page fetches measured."""
    uptime_seconds: int
    """Whole seconds since the service opened."""
    misses: dict[str, int]
    version: str
    """The version of the server's build."""
    socket: str | None
    """The RPC server's socket (None for a service in process)."""
    checkpoint_index_path: str | None
    """The durable directory's SQLite file (None: in memory)."""
    l2_path: str | None
    """The L2 directory (None: no L2)."""


class RpcStatus(ServiceStatus):
    """:class:`ServiceStatus` plus the RPC layer's counters (a sidecar's status)."""

    rpc_connections: int
    rpc_connections_total: int
    rpc_requests: int
    rpc_protocol_errors: int
    rpc_max_connections: int
    """Connections served at once (``max_connections``, lowered to fit the open-file limit)."""
    rpc_buffered_bytes: int
    """Bytes of unfinished request frames buffered now (bounded by ``rpc_max_buffered_bytes``)."""
    rpc_frames_timed_out: int
    rpc_frames_over_budget: int


class SharedGcReport(TypedDict):
    """What ``lmcache-rc shared gc`` did (:func:`lmcache_rc.shared.gc`)."""

    namespaces: int
    manifests_deleted: int
    manifests_kept: int
    pages_deleted: int
    pages_referenced: int
    """Pages kept because a remaining manifest names them."""
    pages_young: int
    """Unreferenced pages kept because they are younger than the age."""
    skipped: list[tuple[str, str]]
    """Namespaces whose pages were not swept, and why (run gc again)."""


class ClearReport(TypedDict):
    """What a ``clear()`` removed."""

    l1_objects: int
    l1_bytes: int
    l2_objects: int
    retired_generations: int
    kept_objects: int


class GenerationInfo(TypedDict):
    """One published generation as ``list_generations()`` reports it."""

    generation: str
    num_tokens: int
    world_size: int
    payload_bytes: int
    durable: bool
    access_order: int


class Change(TypedDict):
    """One entry of the sidecar's change feed (``changes()``,
    ``docs/design/change-feed.md``)."""

    seq: int
    generation: str
    kind: str
    """``listed``, ``tier`` or ``unlisted``."""
    tier: str | None
    """``l1``, ``l2`` or ``shared`` (None for ``unlisted``)."""


class ChangeBatch(TypedDict):
    """What ``changes(since, watch)`` answers."""

    epoch: str
    """Random per sidecar start: another one means the sidecar restarted."""
    next_seq: int
    truncated: bool
    """Changes since ``since`` were dropped (or ``since`` is not of this epoch)."""
    more: bool
    changes: list[Change]
    watched: list[str | None]
    """The tier of each watched generation now, None where not listed."""


class TierLoad(TypedDict):
    """Where pages of a found checkpoint sit in one tier, and what the
    sidecar measured loading from that tier (an entry of
    :class:`Located` ``["tiers"]``). ``samples`` 0: no figures yet
    (``latency_us`` and ``bytes_per_s`` are then 0 and mean unknown)."""

    tier: str
    """``l1``, ``l2`` or ``shared`` (ignore a tier you do not know)."""
    pages: int
    bytes: int
    samples: int
    latency_us: int
    """Moving average of one page load's time until its bytes arrive."""
    bytes_per_s: int
    """Moving average of one page load's rate once its bytes arrive."""
    parallelism: int
    """Page loads the tier runs at once."""


class EngineReport(TypedDict):
    """An attached engine's last report, as ``engines()`` answers it: its id
    (vLLM's ``engine_id``), milliseconds since it reported, and its
    cumulative counters by name."""

    engine: str
    age_ms: int
    counters: dict[str, int]


class Located(TypedDict):
    """A ``find_located()`` answer: the candidate ``find()`` would answer,
    and per tier holding pages of it (in the order l1, l2, shared) what
    restoring from there costs."""

    manifest: Manifest
    tiers: list[TierLoad]


class StopReport(TypedDict):
    """What ``Server.stop()`` did."""

    drained: bool
    live_leases: int
    close_error: str | None


class PageGroup(TypedDict):
    """One page group of a manifest payload (``Manifest.page_groups()``)."""

    name: str
    page_bytes: int
    positions: list[int]
    content_keys: list[str]


class DirectoryStatus(TypedDict):
    """Counts of a :class:`lmcache_rc.Directory` (``Directory.status()``)."""

    published_generations: int
    pending_generations: int
    published_bytes: int
    durable_generations: int
    dirty_recency: int
    evictions: int
    invalid_rows: int
    durability_fsyncs: int
    """Synced log commits that made durable flags durable (group commits)."""
    publish_transactions: int
    """Transactions that published generations (shared by concurrent publishers)."""


class ListedGeneration(TypedDict):
    """One row of ``Directory.list()``."""

    manifest: Manifest
    durable: bool
    payload_bytes: int
    access_order: int
