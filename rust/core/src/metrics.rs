//! The sidecar's metrics: every status value as a Prometheus series, named
//! by the Prometheus conventions, and their OpenMetrics text exposition
//! (`GET /metrics`, encoded by the `prometheus-client` crate).
//!
//! What it owns: the map from a status value ([`ServiceStatus`]: the
//! service's counters and gauges, the RPC layer's, the misses by reason) to
//! a *family* — its name under the `lmcache_rc_` prefix, its type (counter
//! or gauge), its unit, its label and its help text — and the value's
//! label value in that family. Values that are one dimension of one
//! quantity share a family (`lmcache_rc_tier_used_bytes{tier="L1"|"L2"}`,
//! `lmcache_rc_misses_total{reason=...}`, `lmcache_rc_leases{kind=...}`).
//! Counters are monotonic since the sidecar started; their samples end in
//! `_total`, and byte quantities end in `_bytes`.
//!
//! Every [`Counter`] is mapped by an exhaustive match, so a new counter does
//! not compile until it has a series; the status's gauges are mapped by name
//! and a test (`tests_rs/http_admin.rs`) checks that no value of a real
//! sidecar's status (service and RPC layer) is left unmapped. A value
//! without a series (added to a status but not here) is still exported, as
//! a gauge named after it, rather than dropped.
//!
//! The exposition is built from one status snapshot per scrape: a fresh
//! registry of the crate's counters and gauges set to the snapshot's values
//! (the counts themselves live in the service, see `service/counters.rs`).
//!
//! Two formats, chosen by the request's `Accept` header ([`Format`]): the
//! crate's OpenMetrics text when the client accepts it (Prometheus does),
//! else the Prometheus text format 0.0.4, in which a counter's HELP and TYPE
//! name its `_total` sample and there are no `# UNIT` or `# EOF` lines
//! ([`prometheus_text`] rewrites the crate's output line by line; samples
//! and label escaping are the same in both).

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter as PromCounter;
use prometheus_client::metrics::family::Family as PromFamily;
use prometheus_client::metrics::gauge::Gauge as PromGauge;
use prometheus_client::registry::{Registry, Unit};

use crate::error::{Error, Result};
use crate::protocol::{MissReason, ServiceStatus};
use crate::service::Counter;

/// The prefix of every series name (`lmcache_rc_`).
pub const PREFIX: &str = "lmcache_rc";

/// The text format of one exposition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 text (what `prometheus-client` encodes).
    OpenMetrics,
    /// The Prometheus text format 0.0.4 (clients that do not ask for
    /// OpenMetrics).
    Prometheus,
}

impl Format {
    /// OpenMetrics when `accept` (an `Accept` header) lists
    /// `application/openmetrics-text` with a non-zero quality, else the
    /// Prometheus text format.
    pub fn negotiate(accept: Option<&[u8]>) -> Format {
        let Some(accept) = accept.and_then(|a| std::str::from_utf8(a).ok()) else {
            return Format::Prometheus;
        };
        let open = accept.split(',').any(|range| {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("");
            let quality = parts
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
                .map_or(1.0, |(_, q)| q.trim().parse::<f32>().unwrap_or(0.0));
            media.eq_ignore_ascii_case("application/openmetrics-text") && quality > 0.0
        });
        if open {
            Format::OpenMetrics
        } else {
            Format::Prometheus
        }
    }

    /// The `Content-Type` of an exposition in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// Whether a family only grows (a counter) or goes up and down (a gauge).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Monotonic since the sidecar started; samples end in `_total`.
    Counter,
    /// A current level.
    Gauge,
}

/// One metric family: what the exposition says about a set of values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Family {
    /// The name without the prefix, the unit and `_total`.
    pub name: &'static str,
    /// Counter or gauge.
    pub kind: Kind,
    /// Whether the values are bytes (the name then ends in `_bytes`).
    pub bytes: bool,
    /// The label that tells the family's values apart, if it has several.
    pub label: Option<&'static str>,
    /// What the series means (the HELP text, without the final period the
    /// encoder adds).
    pub help: &'static str,
}

impl Family {
    /// The family's full name as exposed (`lmcache_rc_tier_used_bytes`);
    /// a counter's samples add `_total`.
    pub fn full_name(&self) -> String {
        let unit = if self.bytes { "_bytes" } else { "" };
        format!("{PREFIX}_{}{unit}", self.name)
    }

    /// The name of the family's samples (the full name, plus `_total` for
    /// a counter).
    pub fn sample_name(&self) -> String {
        match self.kind {
            Kind::Counter => format!("{}_total", self.full_name()),
            Kind::Gauge => self.full_name(),
        }
    }
}

const fn counter(name: &'static str, help: &'static str) -> Family {
    Family {
        name,
        kind: Kind::Counter,
        bytes: false,
        label: None,
        help,
    }
}

const fn gauge(name: &'static str, help: &'static str) -> Family {
    Family {
        name,
        kind: Kind::Gauge,
        bytes: false,
        label: None,
        help,
    }
}

const fn by(family: Family, label: &'static str) -> Family {
    Family {
        label: Some(label),
        ..family
    }
}

const fn bytes(family: Family) -> Family {
    Family {
        bytes: true,
        ..family
    }
}

// --- Gauges ---------------------------------------------------------------

const GENERATIONS: Family = gauge(
    "generations",
    "Checkpoint generations listed in the directory (published by every rank, restorable)",
);
const PENDING: Family = gauge(
    "pending_generations",
    "Generations begun whose ranks have not all committed yet (kept in memory only)",
);
const LEASES: Family = by(
    gauge(
        "leases",
        "Live leases by kind: store (a worker rank copying pages into L1) or retrieve \
         (a worker rank copying pages out of L1)",
    ),
    "kind",
);
const PINS: Family = gauge(
    "pins",
    "References held on page objects by pending generations and by retrieve leases reading them",
);
const OBJECTS: Family = gauge(
    "objects",
    "Distinct page objects the sidecar tracks, in any tier",
);
const TIER_OBJECTS: Family = by(
    gauge(
        "tier_objects",
        "Page objects resident in a tier: L1 (the shared-memory pool) or L2 (the filesystem)",
    ),
    "tier",
);
const TIER_USED: Family = bytes(by(
    gauge(
        "tier_used",
        "Bytes in use in a tier: L1 slots allocated in the pool, L2 object files (headers included)",
    ),
    "tier",
));
const TIER_CAPACITY: Family = bytes(by(
    gauge(
        "tier_capacity",
        "Size of a tier: the L1 pool, the L2 byte limit (no L2 series when L2 is off or unbounded)",
    ),
    "tier",
));
const L2_QUEUED: Family = gauge(
    "l2_queued_objects",
    "Objects waiting for their L2 write (0: every listed checkpoint is durable)",
);
const PENDING_MANIFEST: Family = bytes(gauge(
    "pending_manifest",
    "Bytes of the manifests of pending generations held in memory (bounded by max_pending_bytes)",
));
const STORES_REFUSED: Family = gauge(
    "stores_refused",
    "1 while stores are refused because the disk is full (the directory is read-only, or a \
     write failed for lack of space), else 0",
);
const UPTIME: Family = gauge(
    "uptime_seconds",
    "Seconds since the sidecar's checkpoint service opened",
);
const L2_RETRIES_WAITING: Family = gauge(
    "l2_write_retries_waiting",
    "Failed L2 writes waiting for their next attempt (their pages stay pinned in L1)",
);
const RPC_MAX_CONNECTIONS: Family = gauge(
    "rpc_max_connections",
    "Most RPC connections served at once (lowered at start to what the open-file limit allows)",
);
const RPC_BUFFERED: Family = bytes(gauge(
    "rpc_buffered",
    "Bytes of unfinished request frames buffered across RPC connections \
     (bounded by rpc_max_buffered_bytes)",
));
const RPC_CONNECTIONS: Family = gauge(
    "rpc_connections",
    "Worker and client connections open on the RPC socket",
);

// --- Counters -------------------------------------------------------------

const L2_WRITTEN: Family = bytes(counter("l2_written", "Bytes written to L2 object files"));
const LOOKUPS: Family = by(
    counter(
        "lookups",
        "Lookups (find: a scheduler asking for a checkpoint covering a prompt's prefix), by \
         result: hit (a listed generation covers a prefix of the prompt) or miss",
    ),
    "result",
);
const BEGINS_REFUSED: Family = by(
    counter(
        "begins_refused",
        "Store begins refused, by reason: draining (an aborted attempt at the generation \
         still drains), suppressed (the generation is pending or listed already, or the \
         directory has no room), pending_bytes (pending manifests hold max_pending_bytes) \
         or no_space (the disk is full)",
    ),
    "reason",
);
const ABANDONED: Family = counter(
    "abandoned_generations",
    "Pending generations aborted because they were begun longer than abandoned_after ago",
);
const STORE_PAGES: Family = by(
    counter(
        "store_pages",
        "Pages offered to store leases, by result: written (leased for a copy) or reused \
         (already resident, not copied again: deduplicated)",
    ),
    "result",
);
const STORE_LEASED: Family = bytes(counter(
    "store_leased",
    "Bytes of the pages exposed to store copies",
));
const STORE_COMMITTED: Family = bytes(counter(
    "store_committed",
    "Bytes of the pages committed by successful store finishes",
));
const ADMISSION_WAITS: Family = counter(
    "store_admission_waits",
    "Store admissions that had to wait for L1 space",
);
const ADMISSION_RETRIES: Family = counter(
    "store_admission_retries",
    "Store admission attempts repeated after a wait for L1 space",
);
const ADMISSIONS_AFTER_EVICTION: Family = counter(
    "store_admissions_after_eviction",
    "Store admissions that succeeded after waiting for evictions",
);
const ADMISSION_TIMEOUTS: Family = counter(
    "store_admission_timeouts",
    "Store admissions that gave up waiting for L1 space (each also a miss with reason capacity)",
);
const ADMISSION_BUSY: Family = counter(
    "store_admission_busy",
    "Store admissions answered busy (another lease is writing a page this store needs)",
);
const PUBLISHED: Family = counter(
    "published_generations",
    "Generations published (every rank committed its pages)",
);
const RETRIEVE_HITS: Family = counter(
    "retrieve_hits",
    "Restores served: retrieve leases whose slots were exposed to a rank's copy (one per rank)",
);
const RESTORED_PAGES: Family = counter(
    "restored_pages",
    "Pages exposed to retrieve copies (every rank's pages of the restores served)",
);
const RESTORED_TOKENS: Family = counter(
    "restored_tokens",
    "Prompt tokens covered by the restores served, counted once per restore (on rank 0's \
     exposure); tokens the engine recomputes instead are not visible to the sidecar",
);
const EVICTED_GENERATIONS: Family = counter(
    "evicted_generations",
    "Listed generations dropped for space (directory capacity, or their only copy evicted)",
);
const EVICTED_OBJECTS: Family = by(
    counter(
        "evicted_objects",
        "Page objects evicted from a tier for space: L1 copies dropped, L2 files deleted",
    ),
    "tier",
);
const L2_LOADS: Family = counter("l2_loads", "Pages loaded from L2 into L1 for a retrieve");
const RETRIEVE_CAPACITY_WAITS: Family = counter(
    "retrieve_capacity_waits",
    "Retrieve loads from L2 that had to wait for L1 space",
);
const RETRIEVES_CANCELLED: Family = counter(
    "retrieves_cancelled",
    "Retrieves cancelled by the worker before any slot was exposed",
);
const RETRIEVES_EXPIRED: Family = counter(
    "retrieves_expired",
    "Retrieve leases whose holder stopped polling before any slot was exposed, ended by the \
     sweep after twice retrieve_timeout",
);
const L2_WRITE_RETRIES: Family = counter(
    "l2_write_retries",
    "Failed L2 writes scheduled for another attempt",
);
const L2_ERRORS: Family = by(
    counter(
        "l2_errors",
        "L2 failures by kind: corrupt_or_missing (a read proved a page lost: its file is \
         missing or fails its checksum) or write (an attempt to write an object file failed)",
    ),
    "kind",
);
const L2_SKIPPED: Family = counter(
    "l2_skipped_writes",
    "L2 writes skipped because the tier was full (the objects stay in L1 only)",
);
const RECLAIMED_OBJECTS: Family = counter(
    "reclaimed_objects",
    "Page objects deleted from every tier when their last reference went",
);
const RESTART_RETIRED: Family = counter(
    "restart_retired_generations",
    "Generations retired at start-up because an object was missing or corrupt",
);
const CLEARS: Family = counter("clears", "Clears performed (CLI, HTTP or RPC)");
const INVALIDATED: Family = counter(
    "invalidated_generations",
    "Listed generations retired by invalidate_namespace (one namespace's checkpoints dropped \
     on request)",
);
const RECLAIMED_LEASES: Family = by(
    counter(
        "reclaimed_leases",
        "Leases taken back because the worker process holding them was gone, by kind: store \
         (aborted like a failed finish) or retrieve (readers released)",
    ),
    "kind",
);
const MISSES: Family = by(
    counter(
        "misses",
        "Store admissions and retrieves answered miss, by reason (the protocol's miss \
         reasons, every one exported from the start)",
    ),
    "reason",
);
const RPC_ACCEPTED: Family = counter(
    "rpc_accepted_connections",
    "Connections accepted on the RPC socket",
);
const RPC_REQUESTS: Family = counter("rpc_requests", "Requests served over the RPC socket");
const RPC_PROTOCOL_ERRORS: Family = counter(
    "rpc_protocol_errors",
    "RPC frames or messages refused as malformed (the connection is closed)",
);
const RPC_FRAMES_REFUSED: Family = by(
    counter(
        "rpc_frames_refused",
        "RPC connections closed over a request frame, by reason: timed_out (a started frame \
         did not arrive whole within rpc_frame_timeout) or over_budget (it would exceed \
         rpc_max_buffered_bytes)",
    ),
    "reason",
);

const SHARED_ENABLED: Family = gauge(
    "shared_enabled",
    "1 when a shared tier across hosts is configured (shared_url), else 0",
);
const SHARED_UPLOAD_QUEUE: Family = gauge(
    "shared_upload_queue",
    "Generations waiting for their upload to the shared tier, plus the one uploading",
);
const SHARED_UPLOADS: Family = by(
    counter(
        "shared_uploads",
        "Generation uploads to the shared tier by event: queued, dropped (the queue was full), \
         retried, given_up, skipped (retired or gone before its turn), done (the manifest is \
         there), written (this host wrote the manifest), present (it was there already), \
         failed (an attempt failed)",
    ),
    "event",
);
const SHARED_PAGES: Family = by(
    counter(
        "shared_pages",
        "Shared-tier page objects by event: uploaded, dedup (already there), refreshed \
         (rewritten to stay young), fetched (verified), fetch_corrupt, fetch_missing",
    ),
    "event",
);
const SHARED_TRANSFERRED: Family = by(
    bytes(counter(
        "shared_transferred",
        "Bytes of shared-tier objects by direction: uploaded or fetched",
    )),
    "direction",
);
const SHARED_LOOKUPS: Family = by(
    counter(
        "shared_lookups",
        "Shared-tier lookups by result: hit, none (no match), corrupt (candidates failed \
         verification), timeout (shared_lookup_timeout), error (the store failed)",
    ),
    "result",
);
const SHARED_MANIFESTS_REJECTED: Family = counter(
    "shared_manifests_rejected",
    "Candidate manifests of the shared tier that failed verification",
);
const SHARED_IMPORTS: Family = by(
    counter(
        "shared_imports",
        "Generations found in the shared tier by outcome: imported (published here) or \
         refused (the directory refused them)",
    ),
    "outcome",
);
const SHARED_FETCHES: Family = by(
    counter(
        "shared_fetches",
        "Page fetches restores started from the shared tier, by outcome: started or failed \
         (the generation was retired here)",
    ),
    "outcome",
);
const SHARED_REQUESTS: Family = by(
    counter(
        "shared_requests",
        "Requests to the shared tier's store by outcome: sent or failed",
    ),
    "outcome",
);

const LOAD_LATENCY: Family = by(
    gauge(
        "tier_load_latency_microseconds",
        "Moving average of one page load's time until its bytes arrive, by tier: L2 (file \
         opened, header read) or shared (the store answered the GET); 0 until a load was \
         measured. What a restore from that tier costs (the connector's skip rule)",
    ),
    "tier",
);
const LOAD_RATE: Family = by(
    gauge(
        "tier_load_rate",
        "Moving average of the rate, in bytes per second, at which one page load moves its \
         bytes once they arrive (read, verified, copied into L1), by tier: L2 or shared; 0 \
         until a load was measured",
    ),
    "tier",
);
const LOADS_MEASURED: Family = by(
    counter(
        "tier_loads_measured",
        "Page loads timed for the load figures, by tier: L2 or shared",
    ),
    "tier",
);

/// Every family in exposition order.
pub const FAMILIES: &[Family] = &[
    GENERATIONS,
    PENDING,
    LEASES,
    PINS,
    OBJECTS,
    TIER_OBJECTS,
    TIER_USED,
    TIER_CAPACITY,
    L2_QUEUED,
    L2_RETRIES_WAITING,
    PENDING_MANIFEST,
    STORES_REFUSED,
    UPTIME,
    L2_WRITTEN,
    LOOKUPS,
    RETRIEVE_HITS,
    RESTORED_PAGES,
    RESTORED_TOKENS,
    MISSES,
    BEGINS_REFUSED,
    ABANDONED,
    PUBLISHED,
    STORE_PAGES,
    STORE_LEASED,
    STORE_COMMITTED,
    ADMISSION_WAITS,
    ADMISSION_RETRIES,
    ADMISSIONS_AFTER_EVICTION,
    ADMISSION_TIMEOUTS,
    ADMISSION_BUSY,
    EVICTED_GENERATIONS,
    EVICTED_OBJECTS,
    L2_LOADS,
    RETRIEVE_CAPACITY_WAITS,
    RETRIEVES_CANCELLED,
    RETRIEVES_EXPIRED,
    L2_ERRORS,
    L2_WRITE_RETRIES,
    L2_SKIPPED,
    RECLAIMED_OBJECTS,
    RESTART_RETIRED,
    CLEARS,
    INVALIDATED,
    RECLAIMED_LEASES,
    RPC_CONNECTIONS,
    RPC_MAX_CONNECTIONS,
    RPC_BUFFERED,
    RPC_ACCEPTED,
    RPC_REQUESTS,
    RPC_PROTOCOL_ERRORS,
    RPC_FRAMES_REFUSED,
    SHARED_ENABLED,
    SHARED_UPLOAD_QUEUE,
    SHARED_UPLOADS,
    SHARED_PAGES,
    SHARED_TRANSFERRED,
    SHARED_LOOKUPS,
    SHARED_MANIFESTS_REJECTED,
    SHARED_IMPORTS,
    SHARED_FETCHES,
    SHARED_REQUESTS,
    LOAD_LATENCY,
    LOAD_RATE,
    LOADS_MEASURED,
];

/// A status value's place: its family and its label value (None for a
/// family without a label).
pub type Placement = (Family, Option<&'static str>);

/// Where a service counter goes (exhaustive: a new counter needs a line).
pub fn counter_series(counter: Counter) -> Placement {
    match counter {
        Counter::FindHits => (LOOKUPS, Some("hit")),
        Counter::FindMisses => (LOOKUPS, Some("miss")),
        Counter::BeginDraining => (BEGINS_REFUSED, Some("draining")),
        Counter::BeginSuppressed => (BEGINS_REFUSED, Some("suppressed")),
        Counter::BeginRefusedPendingBytes => (BEGINS_REFUSED, Some("pending_bytes")),
        Counter::BeginRefusedNoSpace => (BEGINS_REFUSED, Some("no_space")),
        Counter::AbandonedGenerations => (ABANDONED, None),
        Counter::StorePagesReused => (STORE_PAGES, Some("reused")),
        Counter::StorePagesNew => (STORE_PAGES, Some("written")),
        Counter::StoreBytesLeased => (STORE_LEASED, None),
        Counter::StoreBytesCommitted => (STORE_COMMITTED, None),
        Counter::AdmissionWaits => (ADMISSION_WAITS, None),
        Counter::AdmissionRetries => (ADMISSION_RETRIES, None),
        Counter::AdmissionSuccessAfterEviction => (ADMISSIONS_AFTER_EVICTION, None),
        Counter::AdmissionTimeouts => (ADMISSION_TIMEOUTS, None),
        Counter::AdmissionBusy => (ADMISSION_BUSY, None),
        Counter::Published => (PUBLISHED, None),
        Counter::Hits => (RETRIEVE_HITS, None),
        Counter::RestoredPages => (RESTORED_PAGES, None),
        Counter::RestoredTokens => (RESTORED_TOKENS, None),
        Counter::Evictions => (EVICTED_GENERATIONS, None),
        Counter::L1Evictions => (EVICTED_OBJECTS, Some("L1")),
        Counter::L2Evictions => (EVICTED_OBJECTS, Some("L2")),
        Counter::L2Loads => (L2_LOADS, None),
        Counter::RetrieveCapacityWaits => (RETRIEVE_CAPACITY_WAITS, None),
        Counter::RetrievesCancelled => (RETRIEVES_CANCELLED, None),
        Counter::RetrievesExpired => (RETRIEVES_EXPIRED, None),
        Counter::L2CorruptOrMissing => (L2_ERRORS, Some("corrupt_or_missing")),
        Counter::L2WriteErrors => (L2_ERRORS, Some("write")),
        Counter::L2WriteRetries => (L2_WRITE_RETRIES, None),
        Counter::L2SkippedFull => (L2_SKIPPED, None),
        Counter::ReclaimedObjects => (RECLAIMED_OBJECTS, None),
        Counter::RestartRetired => (RESTART_RETIRED, None),
        Counter::Clears => (CLEARS, None),
        Counter::InvalidatedGenerations => (INVALIDATED, None),
        Counter::ReclaimedStoreLeases => (RECLAIMED_LEASES, Some("store")),
        Counter::ReclaimedRetrieveLeases => (RECLAIMED_LEASES, Some("retrieve")),
        Counter::SharedImports => (SHARED_IMPORTS, Some("imported")),
        Counter::SharedImportsRefused => (SHARED_IMPORTS, Some("refused")),
        Counter::SharedFetches => (SHARED_FETCHES, Some("started")),
        Counter::SharedFetchErrors => (SHARED_FETCHES, Some("failed")),
    }
}

/// Where the status value `key` goes; None for a name this build does not
/// know.
pub fn series_of(key: &str) -> Option<Placement> {
    if let Some(&c) = Counter::ALL.iter().find(|c| c.as_str() == key) {
        return Some(counter_series(c));
    }
    Some(match key {
        "generations" => (GENERATIONS, None),
        "pending" => (PENDING, None),
        "store_leases" => (LEASES, Some("store")),
        "retrieve_leases" => (LEASES, Some("retrieve")),
        "pins" => (PINS, None),
        "objects" => (OBJECTS, None),
        "l1_objects" => (TIER_OBJECTS, Some("L1")),
        "l2_objects" => (TIER_OBJECTS, Some("L2")),
        "l1_bytes" => (TIER_USED, Some("L1")),
        "l2_bytes" => (TIER_USED, Some("L2")),
        "l1_capacity" => (TIER_CAPACITY, Some("L1")),
        "l2_capacity" => (TIER_CAPACITY, Some("L2")),
        "l2_queue" => (L2_QUEUED, None),
        "l2_write_retrying" => (L2_RETRIES_WAITING, None),
        "pending_bytes" => (PENDING_MANIFEST, None),
        "stores_refused" => (STORES_REFUSED, None),
        "uptime_seconds" => (UPTIME, None),
        "l2_bytes_written" => (L2_WRITTEN, None),
        "rpc_connections" => (RPC_CONNECTIONS, None),
        "rpc_connections_total" => (RPC_ACCEPTED, None),
        "rpc_requests" => (RPC_REQUESTS, None),
        "rpc_protocol_errors" => (RPC_PROTOCOL_ERRORS, None),
        "rpc_max_connections" => (RPC_MAX_CONNECTIONS, None),
        "rpc_buffered_bytes" => (RPC_BUFFERED, None),
        "rpc_frames_timed_out" => (RPC_FRAMES_REFUSED, Some("timed_out")),
        "rpc_frames_over_budget" => (RPC_FRAMES_REFUSED, Some("over_budget")),
        "shared_enabled" => (SHARED_ENABLED, None),
        "shared_upload_queue" => (SHARED_UPLOAD_QUEUE, None),
        "shared_uploads_queued" => (SHARED_UPLOADS, Some("queued")),
        "shared_uploads_dropped" => (SHARED_UPLOADS, Some("dropped")),
        "shared_upload_retries" => (SHARED_UPLOADS, Some("retried")),
        "shared_uploads_given_up" => (SHARED_UPLOADS, Some("given_up")),
        "shared_uploads_skipped" => (SHARED_UPLOADS, Some("skipped")),
        "shared_uploads" => (SHARED_UPLOADS, Some("done")),
        "shared_manifests_written" => (SHARED_UPLOADS, Some("written")),
        "shared_manifests_present" => (SHARED_UPLOADS, Some("present")),
        "shared_upload_failures" => (SHARED_UPLOADS, Some("failed")),
        "shared_pages_uploaded" => (SHARED_PAGES, Some("uploaded")),
        "shared_dedup_hits" => (SHARED_PAGES, Some("dedup")),
        "shared_pages_refreshed" => (SHARED_PAGES, Some("refreshed")),
        "shared_pages_fetched" => (SHARED_PAGES, Some("fetched")),
        "shared_fetch_corrupt" => (SHARED_PAGES, Some("fetch_corrupt")),
        "shared_fetch_missing" => (SHARED_PAGES, Some("fetch_missing")),
        "shared_bytes_uploaded" => (SHARED_TRANSFERRED, Some("uploaded")),
        "shared_bytes_fetched" => (SHARED_TRANSFERRED, Some("fetched")),
        "shared_lookup_hits" => (SHARED_LOOKUPS, Some("hit")),
        "shared_misses_none" => (SHARED_LOOKUPS, Some("none")),
        "shared_misses_corrupt" => (SHARED_LOOKUPS, Some("corrupt")),
        "shared_misses_timeout" => (SHARED_LOOKUPS, Some("timeout")),
        "shared_misses_error" => (SHARED_LOOKUPS, Some("error")),
        "shared_manifests_rejected" => (SHARED_MANIFESTS_REJECTED, None),
        "shared_requests" => (SHARED_REQUESTS, Some("sent")),
        "shared_errors" => (SHARED_REQUESTS, Some("failed")),
        "l2_load_latency_us" => (LOAD_LATENCY, Some("L2")),
        "shared_load_latency_us" => (LOAD_LATENCY, Some("shared")),
        "l2_load_bytes_per_s" => (LOAD_RATE, Some("L2")),
        "shared_load_bytes_per_s" => (LOAD_RATE, Some("shared")),
        "l2_load_samples" => (LOADS_MEASURED, Some("L2")),
        "shared_load_samples" => (LOADS_MEASURED, Some("shared")),
        _ => return None,
    })
}

/// Whether a value is left out of the exposition: an L2 capacity of 0
/// means no limit (or no L2), which is no size.
fn omitted(key: &str, value: u64) -> bool {
    key == "l2_capacity" && value == 0
}

type Labels = Vec<(&'static str, &'static str)>;

/// The text exposition of `status` in `format` (served with
/// [`Format::content_type`]). Every miss reason is exported, zeros
/// included, so a rate over it exists from the first scrape.
pub fn exposition(status: &ServiceStatus, format: Format) -> Result<String> {
    let mut samples: HashMap<&'static str, Vec<(Option<&'static str>, u64)>> = HashMap::new();
    let mut unknown: Vec<(&str, u64)> = Vec::new();
    for (key, &value) in &status.values {
        match series_of(key) {
            Some(_) if omitted(key, value) => {}
            Some((family, label)) => samples.entry(family.name).or_default().push((label, value)),
            None => unknown.push((key, value)),
        }
    }
    let misses = samples.entry(MISSES.name).or_default();
    for reason in MissReason::ALL {
        let count = status.misses.get(reason.as_str()).copied().unwrap_or(0);
        misses.push((Some(reason.as_str()), count));
    }
    let mut registry = Registry::with_prefix(PREFIX);
    for family in FAMILIES {
        let Some(values) = samples.remove(family.name) else {
            continue;
        };
        register(&mut registry, family, &values);
    }
    for (key, value) in unknown {
        let gauge = PromGauge::<u64, AtomicU64>::default();
        gauge.set(value);
        registry.register(
            key,
            format!("The status value {key} (this build has no description of it)"),
            gauge,
        );
    }
    let mut out = String::new();
    encode(&mut out, &registry)
        .map_err(|_| Error::invalid("encoding the metrics exposition failed"))?;
    Ok(match format {
        Format::OpenMetrics => out,
        Format::Prometheus => prometheus_text(&out),
    })
}

/// The Prometheus text format 0.0.4 of an OpenMetrics text exposition: a
/// counter family's `# HELP` and `# TYPE` lines name its `_total` samples,
/// `# UNIT` and `# EOF` lines go (the unit is already part of the name).
/// Sample lines are the same in both formats.
pub fn prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let comment = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match comment {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let total = if counters.contains(name) {
                    "_total"
                } else {
                    ""
                };
                out.push_str(&format!("{prefix}{name}{total} {tail}"));
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Registers `family` with its `values` (label value, value).
fn register(registry: &mut Registry, family: &Family, values: &[(Option<&'static str>, u64)]) {
    let labels = |value_label: Option<&'static str>| -> Labels {
        vec![(family.label.unwrap_or(""), value_label.unwrap_or(""))]
    };
    let total: u64 = values.iter().map(|(_, v)| v).sum();
    match (family.kind, family.label) {
        (Kind::Counter, None) => {
            let c = PromCounter::<u64>::default();
            c.inc_by(total);
            put(registry, family, c);
        }
        (Kind::Gauge, None) => {
            let g = PromGauge::<u64, AtomicU64>::default();
            g.set(total);
            put(registry, family, g);
        }
        (Kind::Counter, Some(_)) => {
            let f = PromFamily::<Labels, PromCounter<u64>>::default();
            for &(value_label, v) in values {
                f.get_or_create(&labels(value_label)).inc_by(v);
            }
            put(registry, family, f);
        }
        (Kind::Gauge, Some(_)) => {
            let f = PromFamily::<Labels, PromGauge<u64, AtomicU64>>::default();
            for &(value_label, v) in values {
                f.get_or_create(&labels(value_label)).set(v);
            }
            put(registry, family, f);
        }
    }
}

/// Registers one metric under `family`'s name, help and unit.
fn put(registry: &mut Registry, family: &Family, metric: impl prometheus_client::registry::Metric) {
    if family.bytes {
        registry.register_with_unit(family.name, family.help, Unit::Bytes, metric);
    } else {
        registry.register(family.name, family.help, metric);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, HashSet};

    #[test]
    fn every_family_has_a_unique_name_and_a_help_that_is_not_its_name() {
        let mut names = HashSet::new();
        for f in FAMILIES {
            assert!(names.insert(f.full_name()), "{} twice", f.name);
            assert!(f.help.len() > f.name.len() + 10, "{}: {}", f.name, f.help);
            assert_ne!(f.help.replace(' ', "_"), f.name);
            assert!(
                !f.help.ends_with('.'),
                "the encoder adds the period: {}",
                f.name
            );
            if f.kind == Kind::Counter {
                assert!(!f.name.ends_with("_total"), "{}", f.name);
            }
        }
        // No counter's sample collides with another family's name.
        let samples: HashSet<String> = FAMILIES.iter().map(Family::sample_name).collect();
        assert_eq!(samples.len(), FAMILIES.len());
        for f in FAMILIES {
            assert!(!names.contains(&f.sample_name()) || f.kind == Kind::Gauge);
        }
    }

    #[test]
    fn every_counter_maps_to_a_listed_counter_family() {
        for &c in Counter::ALL {
            let (family, label) = counter_series(c);
            assert_eq!(family.kind, Kind::Counter, "{}", c.as_str());
            assert!(FAMILIES.contains(&family), "{}", c.as_str());
            assert_eq!(family.label.is_some(), label.is_some(), "{}", c.as_str());
            assert_eq!(series_of(c.as_str()), Some((family, label)));
        }
        // No two values land on the same series.
        let keys = Counter::ALL.iter().map(|c| c.as_str()).chain([
            "generations",
            "pending",
            "store_leases",
            "retrieve_leases",
            "pins",
            "objects",
            "l1_objects",
            "l2_objects",
            "l1_bytes",
            "l2_bytes",
            "l1_capacity",
            "l2_capacity",
            "l2_queue",
            "l2_write_retrying",
            "pending_bytes",
            "stores_refused",
            "uptime_seconds",
            "l2_bytes_written",
            "rpc_connections",
            "rpc_connections_total",
            "rpc_requests",
            "rpc_protocol_errors",
            "rpc_max_connections",
            "rpc_buffered_bytes",
            "rpc_frames_timed_out",
            "rpc_frames_over_budget",
        ]);
        let mut seen = HashSet::new();
        for key in keys {
            let (family, label) = series_of(key).unwrap();
            assert!(seen.insert((family.name, label)), "{key}");
        }
    }

    fn status(values: &[(&str, u64)], misses: &[(&str, u64)]) -> ServiceStatus {
        let own = |v: &[(&str, u64)]| -> BTreeMap<String, u64> {
            v.iter().map(|(k, n)| (k.to_string(), *n)).collect()
        };
        ServiceStatus {
            values: own(values),
            misses: own(misses),
            ..ServiceStatus::default()
        }
    }

    #[test]
    fn the_exposition_types_counters_labels_dimensions_and_names_units() {
        let text = exposition(
            &status(
                &[
                    ("hits", 3),
                    ("find_hits", 4),
                    ("find_misses", 1),
                    ("l1_bytes", 4096),
                    ("l2_bytes", 0),
                    ("l1_capacity", 1 << 20),
                    ("l2_capacity", 0),
                    ("l2_bytes_written", 8192),
                    ("store_leases", 2),
                    ("from_a_newer_server", 7),
                ],
                &[("capacity", 2)],
            ),
            Format::OpenMetrics,
        )
        .unwrap();
        for line in [
            "# TYPE lmcache_rc_retrieve_hits counter",
            "lmcache_rc_retrieve_hits_total 3",
            "lmcache_rc_lookups_total{result=\"hit\"} 4",
            "lmcache_rc_lookups_total{result=\"miss\"} 1",
            "# TYPE lmcache_rc_tier_used_bytes gauge",
            "# UNIT lmcache_rc_tier_used_bytes bytes",
            "lmcache_rc_tier_used_bytes{tier=\"L1\"} 4096",
            "lmcache_rc_tier_used_bytes{tier=\"L2\"} 0",
            "lmcache_rc_tier_capacity_bytes{tier=\"L1\"} 1048576",
            "lmcache_rc_l2_written_bytes_total 8192",
            "lmcache_rc_leases{kind=\"store\"} 2",
            "lmcache_rc_misses_total{reason=\"capacity\"} 2",
            "lmcache_rc_misses_total{reason=\"not_listed\"} 0",
            "# TYPE lmcache_rc_from_a_newer_server gauge",
            "lmcache_rc_from_a_newer_server 7",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
        // An unbounded L2 has no size.
        assert!(!text.contains("tier=\"L2\"} 0\nlmcache_rc_tier_capacity"));
        assert!(
            !text
                .lines()
                .any(|l| l.starts_with("lmcache_rc_tier_capacity_bytes{tier=\"L2\"}")),
            "{text}"
        );
        assert!(text.trim_end().ends_with("# EOF"));

        let plain = prometheus_text(&text);
        for line in [
            "# HELP lmcache_rc_retrieve_hits_total Restores served: retrieve leases whose slots \
             were exposed to a rank's copy (one per rank).",
            "# TYPE lmcache_rc_retrieve_hits_total counter",
            "lmcache_rc_retrieve_hits_total 3",
            "# TYPE lmcache_rc_l2_written_bytes_total counter",
            "# TYPE lmcache_rc_tier_used_bytes gauge",
            "lmcache_rc_tier_used_bytes{tier=\"L1\"} 4096",
        ] {
            assert!(
                plain.lines().any(|l| l == line),
                "{line} missing from\n{plain}"
            );
        }
        assert!(
            !plain.contains("# UNIT") && !plain.contains("# EOF"),
            "{plain}"
        );
        assert_eq!(
            plain
                .lines()
                .filter(|l| !l.starts_with('#'))
                .collect::<Vec<_>>(),
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn openmetrics_is_served_only_to_clients_that_accept_it() {
        let prometheus = "application/openmetrics-text;version=1.0.0;q=0.5,\
                          application/openmetrics-text;version=0.0.1;q=0.4,\
                          text/plain;version=0.0.4;q=0.3,*/*;q=0.2";
        for (accept, format) in [
            (None, Format::Prometheus),
            (Some("*/*"), Format::Prometheus),
            (Some("text/plain"), Format::Prometheus),
            (Some(prometheus), Format::OpenMetrics),
            (Some("Application/OpenMetrics-Text"), Format::OpenMetrics),
            (
                Some("application/openmetrics-text; q=0"),
                Format::Prometheus,
            ),
            (
                Some("application/openmetrics-text; q=nope"),
                Format::Prometheus,
            ),
        ] {
            assert_eq!(
                Format::negotiate(accept.map(str::as_bytes)),
                format,
                "{accept:?}"
            );
        }
    }

    #[test]
    fn help_texts_need_no_escaping_in_either_format() {
        for f in FAMILIES {
            assert!(!f.help.contains(['\\', '\n', '"']), "{}", f.name);
        }
    }
}
