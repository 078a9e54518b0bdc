//! The checkpoint protocol: the operation set every front end speaks, and
//! its types. One owner for the contract:
//!
//! - [`Checkpoints`] is the operation set (capabilities, find, begin, abort,
//!   the store and retrieve lease calls, status, clear, list, invalidate a
//!   namespace, the change feed, engines' reports). It is
//!   implemented by the in-process [`CheckpointService`](crate::service::CheckpointService)
//!   and by the RPC [`Client`](crate::rpc::Client); the RPC server decodes a
//!   request into one call of it ([`crate::rpc::wire::Request::apply`]); the
//!   transfer engine and the Python binding call it and never name a
//!   concrete implementation.
//! - [`CheckpointsAsync`] adds an `*_async` twin per operation returning a
//!   [`Pending`] future. Its default methods answer at once from the
//!   blocking call (what an in-process service does); the RPC client
//!   overrides them with pipelined requests.
//! - [`Decorator`] wraps an implementation and overrides only what it
//!   changes; everything else is forwarded (the RPC server's views of the
//!   service, test doubles).
//! - The values ([`Lease`], [`LeaseStatus`], [`Slot`], [`MissReason`],
//!   [`Capabilities`], [`ServiceStatus`], [`ClearReport`],
//!   [`GenerationInfo`], [`Located`], [`TierLoad`], [`EngineReport`]) and the versions ([`PROTOCOL_VERSION`],
//!   [`FORMAT_VERSION`]).
//!
//! Lease calls that name a lease by id take the caller's `rank` when it
//! wants ownership checked: a lease obtained by another rank is then refused
//! with `InvalidInput` (a rank never finishes another rank's copy).
//!
//! Adding an operation: one line of [`for_each_operation!`] (its wire tag,
//! request variant, signature and Python signature: the traits, the
//! [`Decorator`], the wire request, the server's dispatch, the client and
//! the binding's Python methods follow), its implementation in the service,
//! and its stub line in `lmcache_rc/_native.pyi` (stubtest and
//! `tests_py/test_operations.py` fail without it).
//!
//! This module never does I/O and knows no transport.

mod pending;
mod pool;
mod types;

use crate::error::Result;

pub use crate::for_each_operation;
pub use pending::{Pending, Waitable};
pub use pool::PoolSource;
pub use types::{
    CHANGE_KINDS, Capabilities, Change, ChangeBatch, ClearReport, EngineReport, GenerationInfo,
    Lease, LeaseStatus, Located, MissReason, ServiceStatus, Slot, TIERS, TierLoad,
};

/// Slot/layout format version announced in capabilities.
pub const FORMAT_VERSION: u32 = 1;
/// RPC protocol version announced in capabilities and spoken on the wire
/// (3: the status carries the server's facts, [`ServiceStatus::info`]).
pub const PROTOCOL_VERSION: u32 = 3;

/// Most changes one `changes` reply carries (`more` says when others wait).
pub const MAX_CHANGES: usize = 4096;

/// Most generations one `changes` call may watch.
pub const MAX_WATCH: usize = 4096;

/// Engines whose reports a sidecar keeps (`report_engine`): a new engine
/// beyond it replaces the one that reported least recently.
pub const MAX_ENGINES: usize = 64;

/// Most counters one engine report carries (more is `InvalidInput`).
pub const MAX_ENGINE_COUNTERS: usize = 256;

/// Longest engine id and counter name of a report, in bytes.
pub const MAX_ENGINE_NAME: usize = 128;

/// How long an engine's report is kept after it stopped reporting.
pub const ENGINE_REPORT_TTL: std::time::Duration = std::time::Duration::from_secs(600);

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

/// The operation table: every operation once, with its wire tag and
/// request variant, its Rust signature and its Python signature. Each
/// consumer is a `macro_rules!` callback handed to this macro (the
/// "x-macro" pattern), so one line here generates [`Checkpoints`],
/// [`CheckpointsAsync`], [`Decorator`], [`OPERATIONS`], the wire
/// [`Request`](crate::rpc::wire::Request) and the server's dispatch, the RPC
/// client, and the binding's Python methods of `CheckpointService` and
/// `Client`.
///
/// `for_each_operation!(callback)` or `for_each_operation!(callback, extra
/// tokens)` expands to `callback! { [extra tokens] {op} {op} ... }`, each
/// `{op}` being
///
/// ```text
/// #[doc] ... TAG Variant fn name / name_async (arg: Type, ...) -> Output; py SIGNATURE
/// ```
///
/// - `TAG`: the request's wire tag — append only, never renumbered (a new
///   operation takes the next number; `tests_rs/rpc_golden.rs` pins them).
/// - `Variant`: the name of its [`Request`](crate::rpc::wire::Request) variant.
/// - argument types are converted on the wire by
///   [`WireArg`](crate::rpc::wire::WireArg) and in Python by the binding's
///   `PyArg`; the output by [`ReplyValue`](crate::rpc::wire::ReplyValue) and
///   the binding's `ToPython` (a new argument or result type needs one impl
///   of each).
/// - `py (...)`: the Python signature (pyo3 syntax), or `py by_hand` when
///   the binding writes the Python method itself (`clear`: its `force` may
///   be omitted, which the Rust call never allows).
#[macro_export]
macro_rules! for_each_operation {
    ($callback:ident $(, $($extra:tt)*)?) => {
        $callback! {
            [$($($extra)*)?]
            {
                /// Pool id and size, format and protocol versions, durability: what a
                /// client needs to map the pool it received at the handshake.
                0 Capabilities fn capabilities / capabilities_async ()
                    -> $crate::protocol::Capabilities; py ()
            }
            {
                /// The longest listed generation whose prefix is a whole-token prefix of
                /// the query (all roots of one token sequence). A candidate only: every
                /// rank must still retrieve it.
                1 Find fn find / find_async (roots: &[$crate::identity::Prefix])
                    -> Option<$crate::manifest::Manifest>; py (roots)
            }
            {
                /// Stages a generation; false = an identical one is pending or listed,
                /// no pending capacity, an aborted attempt still draining, or the server
                /// is shutting down (retry later).
                2 Begin fn begin / begin_async (manifest: &$crate::manifest::Manifest)
                    -> bool; py (manifest)
            }
            {
                /// Aborts a pending generation (no-op for unknown or listed ones).
                3 Abort fn abort / abort_async (generation: &str) -> (); py (generation)
            }
            {
                /// Leases slots for one rank's pages of a pending generation, all or
                /// nothing: `ready` (a slot per new page, `None` per page already
                /// resident), `busy` (another lease is writing a page: retry) or `miss`.
                4 PrepareStore fn prepare_store / prepare_store_async
                    (manifest: &$crate::manifest::Manifest, rank: u32)
                    -> $crate::protocol::Lease; py (manifest, rank)
            }
            {
                /// Ends a store lease after the copy drained. `success = true` commits
                /// the rank and answers true only for the call that published;
                /// `false` discards the pages and aborts the generation.
                5 FinishStore fn finish_store / finish_store_async
                    (lease_id: &str, success: bool, rank: Option<u32>)
                    -> bool; py (lease_id, success, *, rank = None)
            }
            {
                /// Starts restoring one rank of a listed generation: `ready` with the
                /// slots when every page of the rank is resident in L1 (exposed at
                /// once: copy, then finish it; no poll needed), `pending` while pages
                /// load (poll it) or `miss`; never raises for an unlisted or retired
                /// generation. Callers must accept any of the three.
                6 BeginRetrieve fn begin_retrieve / begin_retrieve_async
                    (manifest: &$crate::manifest::Manifest, rank: u32)
                    -> $crate::protocol::Lease; py (manifest, rank)
            }
            {
                /// Polls a retrieve: `pending`, `ready` (every page of the rank,
                /// read-locked until finished) or `miss` (the lease is gone).
                7 PollRetrieve fn poll_retrieve / poll_retrieve_async
                    (lease_id: &str, rank: Option<u32>)
                    -> $crate::protocol::Lease; py (lease_id, *, rank = None)
            }
            {
                /// Ends an exposed retrieve lease after the copy drained (unknown ids:
                /// no-op).
                8 FinishRetrieve fn finish_retrieve / finish_retrieve_async
                    (lease_id: &str, rank: Option<u32>) -> (); py (lease_id, *, rank = None)
            }
            {
                /// Cancels a retrieve that exposed nothing yet; never invalidates the
                /// generation (unknown ids: no-op).
                9 CancelRetrieve fn cancel_retrieve / cancel_retrieve_async
                    (lease_id: &str, rank: Option<u32>) -> (); py (lease_id, *, rank = None)
            }
            {
                /// Counters and gauges (over RPC: plus the RPC layer's).
                10 Status fn status / status_async () -> $crate::protocol::ServiceStatus; py ()
            }
            {
                /// Drops L1 copies (and with `all_tiers` L2 files). `force` is refused
                /// with `LeasesLive` while any lease is live. Front ends that let callers
                /// omit `force` resolve it with [`clear_force`](crate::protocol::clear_force)
                /// (forced by default).
                11 Clear fn clear / clear_async (force: bool, all_tiers: bool)
                    -> $crate::protocol::ClearReport; py by_hand
            }
            {
                /// Every listed generation, ordered by id (operators' `inspect`).
                12 ListGenerations fn list_generations / list_generations_async ()
                    -> Vec<$crate::protocol::GenerationInfo>; py ()
            }
            {
                /// Retires every listed generation of one namespace (other namespaces
                /// are untouched) and answers how many; their pages leave L1 and L2
                /// once no lease holds them. Pending generations are not touched.
                /// A namespace outside 1..256 characters is refused (`InvalidInput`).
                13 InvalidateNamespace fn invalidate_namespace / invalidate_namespace_async
                    (namespace: &str) -> u64; py (namespace)
            }
            {
                /// The change feed: what became restorable, moved tier or stopped being
                /// restorable since sequence number `since` (a bounded ring; at most
                /// [`MAX_CHANGES`](crate::protocol::MAX_CHANGES) per reply), and the
                /// current tier of each generation in `watch` (at most
                /// [`MAX_WATCH`](crate::protocol::MAX_WATCH); more is `InvalidInput`), as
                /// of the same instant. `since = u64::MAX` starts at the end (no changes,
                /// `truncated`). See `docs/design/change-feed.md`.
                14 Changes fn changes / changes_async (since: u64, watch: &[String])
                    -> $crate::protocol::ChangeBatch; py (since, watch = None)
            }
            {
                /// [`find`](Checkpoints::find), and where the found checkpoint's pages
                /// sit: per tier its pages and bytes (every rank) with the service's
                /// measured load figures ([`TierLoad`]), so a caller can tell whether
                /// restoring it beats recomputing it. `None` on a miss.
                15 FindLocated fn find_located / find_located_async
                    (roots: &[$crate::identity::Prefix])
                    -> Option<$crate::protocol::Located>; py (roots)
            }
            {
                /// An attached engine's counters (cumulative), kept until it reports
                /// again, for [`ENGINE_REPORT_TTL`](crate::protocol::ENGINE_REPORT_TTL)
                /// after its last report, or until [`MAX_ENGINES`](crate::protocol::MAX_ENGINES)
                /// others reported since. An empty or over-long id or name, or more than
                /// [`MAX_ENGINE_COUNTERS`](crate::protocol::MAX_ENGINE_COUNTERS)
                /// counters, is `InvalidInput`.
                16 ReportEngine fn report_engine / report_engine_async
                    (engine: &str, counters: &[(String, u64)]) -> (); py (engine, counters)
            }
            {
                /// Every engine's last report ([`EngineReport`]), most recent first.
                17 Engines fn engines / engines_async ()
                    -> Vec<$crate::protocol::EngineReport>; py ()
            }
        }
    };
}

/// Declares, from the table, the blocking trait, its async twin with a
/// ready-answer default per operation, the forwarding [`Decorator`] and the
/// list of operation names.
macro_rules! declare_operations {
    ([] $({
        $(#[$doc:meta])*
        $tag:literal $variant:ident
        fn $name:ident / $name_async:ident ( $($arg:ident : $ty:ty),* ) -> $out:ty; py $py:tt
    })*) => {
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

        /// An implementation that wraps another one and changes only some
        /// operations (the RPC server's per-connection view, its admin view,
        /// test doubles): every operation it does not override goes to
        /// [`Decorator::inner`]. Implementing it implements [`Checkpoints`].
        pub trait Decorator: Send + Sync {
            /// The wrapped implementation.
            type Inner: Checkpoints + ?Sized;
            /// Where the operations not overridden go.
            fn inner(&self) -> &Self::Inner;
            $(
                #[doc = concat!("[`Checkpoints::", stringify!($name), "`]; forwarded unless overridden.")]
                fn $name(&self, $($arg: $ty),*) -> Result<$out> {
                    self.inner().$name($($arg),*)
                }
            )*
        }

        impl<D: Decorator> Checkpoints for D {
            $(
                fn $name(&self, $($arg: $ty),*) -> Result<$out> {
                    Decorator::$name(self, $($arg),*)
                }
            )*
        }

        /// The name of every operation, in table (and wire tag) order.
        pub const OPERATIONS: &[&str] = &[$(stringify!($name)),*];

        // The tags are the operations' positions: the table is append only.
        const _: () = {
            let tags: &[u32] = &[$($tag),*];
            let mut i = 0;
            while i < tags.len() {
                assert!(tags[i] as usize == i, "wire tags must be 0, 1, 2, ... in table order");
                i += 1;
            }
        };
    };
}

for_each_operation!(declare_operations);
