//! The values the operations of [`super::Checkpoints`] take and answer.
//!
//! Each result type is defined once, here: its serde derive is its wire
//! form (postcard, field order = declaration order: never reorder, only a
//! protocol version may; `tests_rs/rpc_golden.rs` pins the bytes).

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::manifest::Manifest;

/// What a lease call answered (on the wire: the variant index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaseStatus {
    /// Slots are exposed: copy, then finish the lease.
    Ready,
    /// Another lease is writing a page this store needs: retry shortly.
    Busy,
    /// Nothing was leased (see the reason); nothing to finish.
    Miss,
    /// A retrieve is loading pages: poll again.
    Pending,
}

impl LeaseStatus {
    /// The wire / Python name.
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseStatus::Ready => "ready",
            LeaseStatus::Busy => "busy",
            LeaseStatus::Miss => "miss",
            LeaseStatus::Pending => "pending",
        }
    }
}

named_enum! {
    /// Why a lease call answered `miss` (or `busy`): a closed set of
    /// stable names, counted per reason in status and metrics.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
    pub enum MissReason {
        /// The generation is not pending (never begun, aborted or published).
        NotPending = "not_pending",
        /// The server is shutting down and admits no new work.
        Shutdown = "shutdown",
        /// Too many live leases (`max_leases`).
        LeaseBudget = "lease_budget",
        /// The staging this call belongs to was aborted (and maybe begun again).
        Conflict = "conflict",
        /// L1 space did not free up within the admission timeout, or a
        /// page to restore is larger than the whole pool.
        Capacity = "capacity",
        /// The generation was aborted while this rank copied.
        AbortedDuringStore = "aborted_during_store",
        /// The directory failed to record an acknowledgement.
        DirectoryError = "directory_error",
        /// The generation is not listed (never published, replaced or retired).
        NotListed = "not_listed",
        /// A page has no copy left (proof of loss: the generation is retired).
        LostObject = "lost_object",
        /// Reading a page from L2 failed (not proof of loss).
        L2ReadError = "l2_read_error",
        /// A retrieve stayed pending longer than `retrieve_timeout`.
        RetrieveTimeout = "retrieve_timeout",
        /// Fetching a page from the shared tier failed (missing, corrupt,
        /// or the store failed): the generation is retired here.
        SharedFetchError = "shared_fetch_error",
        /// Another lease is writing a page this store needs (status `busy`).
        Busy = "busy",
        /// A reason this build does not know (sent by a newer server).
        Other = "other",
    }
}

impl MissReason {
    /// The reason named `name`; a name this build does not know (a newer
    /// server's) is [`MissReason::Other`].
    pub fn from_name(name: &str) -> MissReason {
        MissReason::ALL
            .iter()
            .copied()
            .find(|r| r.as_str() == name)
            .unwrap_or(MissReason::Other)
    }
}

/// On the wire a reason is its name, so that a newer peer's reason decodes
/// (as [`MissReason::Other`]).
impl Serialize for MissReason {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for MissReason {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let name = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Ok(MissReason::from_name(&name))
    }
}

impl std::fmt::Display for MissReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A slot: `(offset, length)` in the SHM pool, or `None` for a store page that
/// is already resident (do not copy).
pub type Slot = Option<(u64, u64)>;

/// The answer of prepare_store / begin_retrieve / poll_retrieve.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// See [`LeaseStatus`].
    pub status: LeaseStatus,
    /// The lease to finish (present for ready/pending).
    pub lease_id: Option<String>,
    /// Per page group, per page (only when ready).
    pub slots: Vec<Vec<Slot>>,
    /// Why a miss (or busy) happened.
    pub reason: Option<MissReason>,
    /// The pool the slots are offsets into (a ready lease names it; a
    /// worker refuses slots of a pool it has not mapped: "replaced").
    pub pool_id: Option<String>,
}

impl Lease {
    /// A miss for `reason`: nothing leased, nothing to finish.
    pub fn miss(reason: MissReason) -> Lease {
        Lease {
            status: LeaseStatus::Miss,
            lease_id: None,
            slots: Vec::new(),
            reason: Some(reason),
            pool_id: None,
        }
    }

    /// A busy answer: retry the store shortly.
    pub fn busy() -> Lease {
        Lease {
            status: LeaseStatus::Busy,
            lease_id: None,
            slots: Vec::new(),
            reason: Some(MissReason::Busy),
            pool_id: None,
        }
    }

    /// A lease whose slots are not ready yet (a retrieve loading pages).
    pub fn pending(lease_id: String) -> Lease {
        Lease {
            status: LeaseStatus::Pending,
            lease_id: Some(lease_id),
            slots: Vec::new(),
            reason: None,
            pool_id: None,
        }
    }

    /// A lease exposing `slots` of pool `pool_id`: copy, then finish it.
    pub fn ready(lease_id: String, pool_id: String, slots: Vec<Vec<Slot>>) -> Lease {
        Lease {
            status: LeaseStatus::Ready,
            lease_id: Some(lease_id),
            slots,
            reason: None,
            pool_id: Some(pool_id),
        }
    }
}

/// What the service tells a client at connection time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// Slot/layout format version ([`super::FORMAT_VERSION`]).
    pub format_version: u32,
    /// RPC protocol version ([`super::PROTOCOL_VERSION`]).
    pub protocol_version: u32,
    /// The SHM pool's id: random, new for every pool (so for every server
    /// start). The pool itself travels as a descriptor at the handshake.
    pub pool_id: String,
    /// The SHM pool's size in bytes.
    pub pool_size: u64,
    /// Whether the directory survives restarts.
    pub durable_index: bool,
}

/// Counters and gauges of the service; every value is an integer or a map of
/// integers. Keys are names, not enums, because a status crosses the wire and
/// a newer server may report values this build does not know.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceStatus {
    /// Integer gauges and counters by name.
    pub values: BTreeMap<String, u64>,
    /// Misses by reason name ([`MissReason::as_str`]).
    pub misses: BTreeMap<String, u64>,
    /// Facts about the server as text, None where absent: `version` (of
    /// the server's build), `socket` (None in process),
    /// `checkpoint_index_path` (None: in memory), `l2_path` (None: no L2).
    pub info: BTreeMap<String, Option<String>>,
}

/// What a clear removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClearReport {
    /// L1 objects dropped.
    pub l1_objects: u64,
    /// L1 bytes freed.
    pub l1_bytes: u64,
    /// L2 objects deleted.
    pub l2_objects: u64,
    /// Generations retired because their only copy was dropped.
    pub retired_generations: u64,
    /// Objects kept because a lease or pin held them.
    pub kept_objects: u64,
}

/// Where the pages of a found checkpoint sit in one tier, and what the
/// sidecar measured loading pages from that tier (`find_located`). The
/// figures are the service's own moving averages of its page loads
/// (`service::load_figures`); `samples` 0 means nothing was measured yet (then
/// `latency_us` and `bytes_per_s` are 0 and mean "unknown", never "free").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierLoad {
    /// `l1` (the shared-memory pool: a worker's copy, nothing to load),
    /// `l2` (loaded from disk into L1) or `shared` (fetched from the shared
    /// tier into L1). A client must ignore a tier it does not know.
    pub tier: String,
    /// Pages of the checkpoint (every rank) in this tier.
    pub pages: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Page loads from this tier measured so far (0: no figures yet).
    pub samples: u64,
    /// Moving average of one page load's fixed cost in microseconds: the
    /// time until its bytes start to arrive (an L2 file opened and its
    /// header read; a shared-tier GET answered).
    pub latency_us: u64,
    /// Moving average of the rate at which one page load moves its bytes
    /// once they arrive (read, verified, copied into L1), bytes per second.
    pub bytes_per_s: u64,
    /// Page loads this tier runs at once (the L2 I/O threads, the shared
    /// tier's fetch threads; 1 for L1).
    pub parallelism: u32,
}

/// A `find_located` answer: the candidate `find` would answer, and where
/// its pages sit (one [`TierLoad`] per tier holding any, in the order L1,
/// L2, shared). On the wire its manifest travels as a `WireManifest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    /// The candidate (every rank must still retrieve it).
    pub manifest: Manifest,
    /// Per tier holding pages of it: pages, bytes and load figures.
    pub tiers: Vec<TierLoad>,
}

/// One published generation as an operator sees it (`lmcache-rc inspect`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GenerationInfo {
    /// The generation id.
    pub generation: String,
    /// Tokens the checkpoint covers.
    pub num_tokens: u64,
    /// Ranks that stored it.
    pub world_size: u32,
    /// Payload bytes of all ranks.
    pub payload_bytes: u64,
    /// Whether every object is durable in L2.
    pub durable: bool,
    /// Recency stamp (larger = more recently published or found).
    pub access_order: i64,
}

/// What an attached engine last reported of itself (`report_engine`), as
/// `engines` answers it: its counters (the vLLM connector's lookups,
/// restores, stores, skips and failures, cumulative) and how long ago it
/// reported them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineReport {
    /// The engine's id (vLLM's `engine_id`), as it reported it.
    pub engine: String,
    /// Milliseconds since its last report.
    pub age_ms: u64,
    /// Its counters by name.
    pub counters: BTreeMap<String, u64>,
}

/// One entry of the change feed (`changes`): a generation became
/// restorable here (`listed`), its copy reached a more durable tier
/// (`tier`), or it stopped being restorable (`unlisted`: evicted from every
/// tier, invalidated, cleared, replaced or lost). Kinds and tiers are names,
/// not enums, so a newer server's values decode (see
/// `docs/design/change-feed.md`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// Its sequence number: consecutive, starting at 0 for each service epoch.
    pub seq: u64,
    /// The generation id.
    pub generation: String,
    /// `listed`, `tier` or `unlisted` ([`CHANGE_KINDS`]).
    pub kind: String,
    /// For `listed` and `tier`: the most durable tier a complete copy
    /// reached, `l1`, `l2` or `shared` ([`TIERS`]); None for `unlisted`.
    pub tier: Option<String>,
}

/// The kinds of [`Change`], in no particular order.
pub const CHANGE_KINDS: &[&str] = &["listed", "tier", "unlisted"];

/// The tiers a [`Change`] names, least durable first: `l1` (the RAM pool
/// only), `l2` (every page durable on this host's disk), `shared` (every
/// page in the shared tier).
pub const TIERS: &[&str] = &["l1", "l2", "shared"];

/// What `changes` answers: the feed since a sequence number, and the
/// current state of the generations the caller asked about, both as of
/// the same instant (one lock).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangeBatch {
    /// The service's epoch: random, drawn when the service opened. Another
    /// epoch than before means the sidecar restarted (sequence numbers
    /// start over and changes in between are unknown).
    pub epoch: String,
    /// The sequence number to ask from next time.
    pub next_seq: u64,
    /// Changes the caller asked for were dropped from the bounded ring (or
    /// its `since` is not a position of this epoch): resynchronise with
    /// `watch`.
    pub truncated: bool,
    /// More changes wait past `next_seq` (the reply is capped): ask again.
    pub more: bool,
    /// The changes from `since` (or from the oldest kept) up to `next_seq`.
    pub changes: Vec<Change>,
    /// One entry per watched generation, in order: its tier when listed
    /// now, None when not.
    pub watched: Vec<Option<String>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_miss_reason_round_trips_by_name() {
        for &reason in MissReason::ALL {
            assert_eq!(MissReason::from_name(reason.as_str()), reason);
        }
        assert_eq!(
            MissReason::from_name("from_a_newer_server"),
            MissReason::Other
        );
    }
}
