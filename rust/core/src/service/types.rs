//! The checkpoint service's configuration.

use std::path::PathBuf;
use std::time::Duration;

/// Configuration of a [`super::CheckpointService`]. A sidecar builds it from
/// its [`SidecarConfig`](crate::config::SidecarConfig), whose defaults for
/// these fields are the ones below.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceConfig {
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
    /// Most bytes the manifests of pending generations hold at once.
    pub max_pending_bytes: u64,
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
    /// The shared tier across hosts; `None` = none (see
    /// `docs/design/shared-tier.md`).
    pub shared: Option<SharedSettings>,
    /// Entries the change feed keeps (`changes`); older ones are dropped
    /// and a reader that missed them is told (`truncated`).
    pub change_feed_capacity: usize,
    /// How L1 pages and L2 objects are chosen for eviction (`lru` or
    /// `cost`: see [`crate::cost`]).
    pub eviction: crate::cost::Eviction,
    /// Test hook: the SQLite VFS the directory's connections open the index
    /// through (see `DirectoryConfig::vfs`); `None` = the default.
    #[doc(hidden)]
    pub index_vfs: Option<String>,
}

/// The service's use of a shared tier (an object store or a shared
/// filesystem that several hosts' sidecars read and write).
#[derive(Debug, Clone, PartialEq)]
pub struct SharedSettings {
    /// `s3://bucket[/prefix]` (credentials and endpoint from the standard
    /// `AWS_*` environment) or `file:///path`.
    pub url: String,
    /// `object_store` S3 settings applied over the environment (e.g.
    /// `("aws_endpoint", "http://...")`); the sidecar passes none.
    pub options: Vec<(String, String)>,
    /// How long a `find` waits for the shared tier's answer before it
    /// answers with what the host has.
    pub lookup_timeout: Duration,
    /// Most generations waiting for their upload; when full, the oldest
    /// waiting one is dropped (and counted).
    pub upload_queue: usize,
    /// Threads fetching pages from the shared tier into L1 for restores.
    pub fetch_threads: usize,
    /// Testing only: every request to the shared tier waits this long first
    /// (see `SharedConfig::inject_latency`); zero adds nothing.
    pub inject_latency: Duration,
}

impl SharedSettings {
    /// Defaults for `url`.
    pub fn new(url: impl Into<String>) -> SharedSettings {
        SharedSettings {
            url: url.into(),
            options: Vec::new(),
            lookup_timeout: Duration::from_millis(200),
            upload_queue: 1024,
            fetch_threads: 4,
            inject_latency: Duration::ZERO,
        }
    }
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            l1_bytes: crate::store::shm::default_l1_bytes(),
            l2_path: None,
            l2_bytes: None,
            checkpoint_index_path: None,
            max_entries: 65_536,
            max_pending: 128,
            max_pending_bytes: 256 << 20,
            max_leases: 1024,
            store_admission_timeout: Duration::from_secs(8),
            retrieve_timeout: Duration::from_secs(30),
            abandoned_after: Some(Duration::from_secs(600)),
            l2_io_threads: 2,
            shared: None,
            change_feed_capacity: 65_536,
            eviction: crate::cost::Eviction::Lru,
            index_vfs: None,
        }
    }
}
