//! The checkpoint protocol: the operation set every front end speaks, and
//! its types. One owner for the contract:
//!
//! - [`Checkpoints`] is the operation set (capabilities, find, begin, abort,
//!   the store and retrieve lease calls, status, clear, list, invalidate a
//!   namespace). It is
//!   implemented by the in-process [`CheckpointService`](crate::service::CheckpointService)
//!   and by the RPC [`Client`](crate::rpc::Client); the RPC server decodes a
//!   request into one call of it ([`crate::rpc::wire::Request::apply`]); the
//!   transfer engine and the Python binding call it and never name a
//!   concrete implementation.
//! - [`CheckpointsAsync`] adds an `*_async` twin per operation returning a
//!   [`Pending`] future. Its default methods answer at once from the
//!   blocking call (what an in-process service does); the RPC client
//!   overrides them with pipelined requests.
//! - The values ([`Lease`], [`LeaseStatus`], [`Slot`], [`MissReason`],
//!   [`Capabilities`], [`ServiceStatus`], [`ClearReport`],
//!   [`GenerationInfo`]) and the versions ([`PROTOCOL_VERSION`],
//!   [`FORMAT_VERSION`]).
//!
//! Lease calls that name a lease by id take the caller's `rank` when it
//! wants ownership checked: a lease obtained by another rank is then refused
//! with `InvalidInput` (a rank never finishes another rank's copy).
//!
//! Adding an operation: declare it in the table below (both traits follow),
//! implement it in the service, give it a wire request
//! ([`crate::rpc::wire::Request`] and its `apply` arm) and a line in the
//! client's table (`rpc/client.rs`), then expose it in the binding
//! (`rust/python/src/protocol.rs`) and `lmcache_rc/_native.pyi`.
//!
//! This module never does I/O and knows no transport.

mod pending;
mod types;

use crate::error::Result;
use crate::identity::Prefix;
use crate::manifest::Manifest;

pub use pending::{Pending, Waitable};
pub use types::{
    Capabilities, ClearReport, GenerationInfo, Lease, LeaseStatus, MissReason, ServiceStatus, Slot,
};

/// Slot/layout format version announced in capabilities.
pub const FORMAT_VERSION: u32 = 1;
/// RPC protocol version announced in capabilities and spoken on the wire
/// (3: the status carries the server's facts, [`ServiceStatus::info`]).
pub const PROTOCOL_VERSION: u32 = 3;

/// What `clear` does when its caller omits `force`: forced, as in the
/// reference implementation (a forced clear is still refused with
/// `LeasesLive` while any lease is live, so the default never drops pages a
/// copy is using). Every front end that lets `force` be omitted — HTTP
/// `POST /clear`, the Python `clear()` / `clear_async()`, `lmcache-rc clear`
/// — resolves it through [`clear_force`]; the wire and [`Checkpoints::clear`]
/// always carry an explicit value.
pub const CLEAR_FORCE_DEFAULT: bool = true;

/// `force` as given, or [`CLEAR_FORCE_DEFAULT`] when omitted.
pub fn clear_force(force: Option<bool>) -> bool {
    force.unwrap_or(CLEAR_FORCE_DEFAULT)
}

/// Declares the operation set once: the blocking trait, its async twin with
/// a ready-answer default per operation, and the list of operation names.
macro_rules! operations {
    ($(
        $(#[$doc:meta])*
        fn $name:ident / $name_async:ident ( $($arg:ident : $ty:ty),* ) -> $out:ty;
    )*) => {
        /// The checkpoint operation set (see the [module docs](self)).
        pub trait Checkpoints: Send + Sync {
            $(
                $(#[$doc])*
                fn $name(&self, $($arg: $ty),*) -> Result<$out>;
            )*
        }

        /// The `*_async` twin of every [`Checkpoints`] operation. The
        /// defaults answer at once from the blocking call (an in-process
        /// service); the RPC client overrides them with pipelined requests
        /// whose replies arrive later.
        pub trait CheckpointsAsync: Checkpoints {
            $(
                #[doc = concat!("[`Checkpoints::", stringify!($name), "`] without waiting.")]
                fn $name_async(&self, $($arg: $ty),*) -> Pending<$out> {
                    Pending::ready(stringify!($name), self.$name($($arg),*))
                }
            )*
        }

        /// The name of every operation, in declaration order.
        pub const OPERATIONS: &[&str] = &[$(stringify!($name)),*];
    };
}

operations! {
    /// Pool id and size, format and protocol versions, durability: what a
    /// client needs to map the pool it received at the handshake.
    fn capabilities / capabilities_async () -> Capabilities;
    /// The longest listed generation whose prefix is a whole-token prefix of
    /// the query (all roots of one token sequence). A candidate only: every
    /// rank must still retrieve it.
    fn find / find_async (roots: &[Prefix]) -> Option<Manifest>;
    /// Stages a generation; false = an identical one is pending or listed,
    /// no pending capacity, an aborted attempt still draining, or the server
    /// is shutting down (retry later).
    fn begin / begin_async (manifest: &Manifest) -> bool;
    /// Aborts a pending generation (no-op for unknown or listed ones).
    fn abort / abort_async (generation: &str) -> ();
    /// Leases slots for one rank's pages of a pending generation, all or
    /// nothing: `ready` (a slot per new page, `None` per page already
    /// resident), `busy` (another lease is writing a page: retry) or `miss`.
    fn prepare_store / prepare_store_async (manifest: &Manifest, rank: u32) -> Lease;
    /// Ends a store lease after the copy drained. `success = true` commits
    /// the rank and answers true only for the call that published;
    /// `false` discards the pages and aborts the generation.
    fn finish_store / finish_store_async (lease_id: &str, success: bool, rank: Option<u32>) -> bool;
    /// Starts restoring one rank of a listed generation: `ready` with the
    /// slots when every page of the rank is resident in L1 (exposed at once:
    /// copy, then finish it; no poll needed), `pending` while pages load
    /// (poll it) or `miss`; never raises for an unlisted or retired
    /// generation. Callers must accept any of the three.
    fn begin_retrieve / begin_retrieve_async (manifest: &Manifest, rank: u32) -> Lease;
    /// Polls a retrieve: `pending`, `ready` (every page of the rank,
    /// read-locked until finished) or `miss` (the lease is gone).
    fn poll_retrieve / poll_retrieve_async (lease_id: &str, rank: Option<u32>) -> Lease;
    /// Ends an exposed retrieve lease after the copy drained (unknown ids:
    /// no-op).
    fn finish_retrieve / finish_retrieve_async (lease_id: &str, rank: Option<u32>) -> ();
    /// Cancels a retrieve that exposed nothing yet; never invalidates the
    /// generation (unknown ids: no-op).
    fn cancel_retrieve / cancel_retrieve_async (lease_id: &str, rank: Option<u32>) -> ();
    /// Counters and gauges (over RPC: plus the RPC layer's).
    fn status / status_async () -> ServiceStatus;
    /// Drops L1 copies (and with `all_tiers` L2 files). `force` is refused
    /// with `LeasesLive` while any lease is live. Front ends that let callers
    /// omit `force` resolve it with [`clear_force`] (forced by default).
    fn clear / clear_async (force: bool, all_tiers: bool) -> ClearReport;
    /// Every listed generation, ordered by id (operators' `inspect`).
    fn list_generations / list_generations_async () -> Vec<GenerationInfo>;
    /// Retires every listed generation of one namespace (other namespaces
    /// are untouched) and answers how many; their pages leave L1 and L2
    /// once no lease holds them. Pending generations are not touched.
    /// A namespace outside 1..256 characters is refused (`InvalidInput`).
    fn invalidate_namespace / invalidate_namespace_async (namespace: &str) -> u64;
}
