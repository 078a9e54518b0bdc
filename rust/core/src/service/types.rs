//! Plain data types of the checkpoint service's public surface.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Configuration of a [`super::CheckpointService`]. Every field is a future
/// `lmcache-rc serve` flag (dashes for underscores).
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceConfig {
    /// Name of the POSIX shared-memory pool (unique per server on a host).
    pub shm_name: String,
    /// Size of the L1 pool in bytes (a multiple of 4096).
    pub l1_bytes: u64,
    /// Directory of the L2 object files; `None` = no L2 tier.
    pub l2_path: Option<PathBuf>,
    /// Byte capacity of L2; `None` = unlimited.
    pub l2_bytes: Option<u64>,
    /// SQLite directory file; `None` = in-memory directory (lost on close).
    pub checkpoint_index_path: Option<PathBuf>,
    /// Most published generations listed.
    pub max_entries: u64,
    /// Most generations pending publication at once.
    pub max_pending: u64,
    /// Most live leases (store + retrieve) at once.
    pub max_leases: usize,
    /// How long a store admission waits for L1 space before missing.
    pub store_admission_timeout: Duration,
    /// How long a retrieve waits for L1 space to load from L2 before missing.
    pub retrieve_timeout: Duration,
    /// Pending generations older than this are aborted (None = never).
    pub abandoned_after: Option<Duration>,
    /// L2 I/O threads.
    pub l2_io_threads: usize,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            shm_name: format!("lmcache-rc-{}", std::process::id()),
            l1_bytes: 1 << 30,
            l2_path: None,
            l2_bytes: None,
            checkpoint_index_path: None,
            max_entries: 65_536,
            max_pending: 128,
            max_leases: 1024,
            store_admission_timeout: Duration::from_secs(8),
            retrieve_timeout: Duration::from_secs(30),
            abandoned_after: Some(Duration::from_secs(600)),
            l2_io_threads: 2,
        }
    }
}

/// What a lease call answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// A slot: `(offset, length)` in the SHM pool, or `None` for a store page that
/// is already resident (do not copy).
pub type Slot = Option<(u64, u64)>;

/// The answer of prepare_store / begin_retrieve / poll_retrieve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// See [`LeaseStatus`].
    pub status: LeaseStatus,
    /// The lease to finish (present for ready/pending).
    pub lease_id: Option<String>,
    /// Per page group, per page (only when ready).
    pub slots: Vec<Vec<Slot>>,
    /// Why a miss happened (a stable reason name).
    pub reason: Option<&'static str>,
}

impl Lease {
    pub(crate) fn miss(reason: &'static str) -> Lease {
        Lease {
            status: LeaseStatus::Miss,
            lease_id: None,
            slots: Vec::new(),
            reason: Some(reason),
        }
    }
    pub(crate) fn busy() -> Lease {
        Lease {
            status: LeaseStatus::Busy,
            lease_id: None,
            slots: Vec::new(),
            reason: Some("busy"),
        }
    }
}

/// What the service tells a client at connection time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// Slot/layout format version (1).
    pub format_version: u32,
    /// RPC protocol version.
    pub protocol_version: u32,
    /// The SHM pool's name (without a leading '/').
    pub shm_name: String,
    /// The SHM pool's size in bytes.
    pub pool_size: u64,
    /// Whether the directory survives restarts.
    pub durable_index: bool,
}

/// Counters and gauges of the service; every value is an integer or a map of integers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceStatus {
    /// Integer gauges and counters by name.
    pub values: BTreeMap<&'static str, u64>,
    /// Misses by reason.
    pub misses: BTreeMap<String, u64>,
}

/// What a clear removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
