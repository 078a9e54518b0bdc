//! The checkpoint service: leases, the store path, the retrieve path,
//! publication, clear, durability and restart (`docs/architecture.md`).
//!
//! One [`CheckpointService`] owns the SHM pool (L1), the optional L2 file tier
//! and the SQLite directory, and implements the operation set
//! [`Checkpoints`] in process. Worker ranks lease slots of the pool, copy
//! bytes in or out, and finish their lease; the service never copies page
//! bytes except between L1 and L2 on its I/O threads.
//!
//! The module is split along its seams:
//! - `open`: opening the tiers and the start-up reconciliation (I8);
//! - `store`: staging, store leases, publication;
//! - `retrieve`: lookups and retrieve leases;
//! - `tiers`: the state lock, whose release performs the queued side
//!   effects (L2 writes, deletes and loads, directory retirements and
//!   durable flags), and the L2 I/O jobs;
//! - `admin`: capabilities, status, clear, list, the change feed's reads, close;
//! - `load_figures`: what page loads from L2 and the shared tier cost, measured
//!   where they run (the figures `find_located` answers with);
//! - `feed`: the change feed (a bounded ring of listings, tiers reached and
//!   unlistings, written under the state lock);
//! - `reclaim`: who holds each lease (a process, or nobody watchable), the
//!   reclaim of a gone process's leases, and the sweep that also aborts
//!   abandoned pending generations;
//! - `upkeep`: the background thread retrying failed L2 writes and
//!   watching for space to return while stores are refused;
//! - `state`: the object table and reference counts (changed only through
//!   its methods), leases and pending generations; `counters`: event and
//!   miss counts.
//!
//! Locking: one mutex over the object table, leases and pending generations
//! (`state::State`). It is never held across an L2 read/write or a copy. The
//! directory has its own lock; the service calls it without its mutex except
//! to retire generations whose last copy is being dropped (rare, and the
//! directory never calls back), so the order is always service → directory.
//!
//! Object lifecycle and reference counts (I7): an object is referenced by each
//! listed generation naming it (`refs`), pinned by each pending generation
//! that will name it (`pins`, from prepare_store until publication or abort),
//! held by retrieve leases (`readers`) and by background I/O (`io`). At zero it
//! is deleted from L1 and L2 at once — nothing waits for LRU.

mod admin;
mod counters;
mod engines;
mod feed;
mod load_figures;
mod open;
mod reclaim;
mod retrieve;
#[cfg(feature = "shared-tier")]
mod shared;
mod state;
mod store;
mod tiers;
mod types;
mod upkeep;

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::Result;
use crate::identity::Prefix;
use crate::index::Directory;
use crate::manifest::Manifest;
use crate::protocol::{Checkpoints, CheckpointsAsync, PoolSource};
use crate::store::l2::{IoPool, L2Tier};
use crate::store::shm::ShmPool;

pub use counters::Counter;
pub use reclaim::{Holder, Reclaimed, SWEEP_EVERY};
pub use state::{L1, L2};
pub use types::{ServiceConfig, SharedSettings};

// The protocol's values, also reachable here (they were born in this module).
pub use crate::protocol::{
    Capabilities, ChangeBatch, ClearReport, EngineReport, FORMAT_VERSION, GenerationInfo, Lease,
    LeaseStatus, Located, MissReason, PROTOCOL_VERSION, ServiceStatus, Slot, TierLoad,
};

/// Everything the service owns, shared with its I/O jobs.
struct Inner {
    config: ServiceConfig,
    pool: ShmPool,
    dir: Directory,
    l2: Option<Arc<L2Tier>>,
    io: Mutex<Option<IoPool>>,
    state: tiers::StateLock,
    /// Retried L2 writes and the disk-full state (`upkeep`).
    upkeep: upkeep::Upkeep,
    /// Generations start-up found incomplete but could not retire (the
    /// directory was read-only); retired once it is writable.
    deferred_retire: Mutex<Vec<String>>,
    /// The shared tier across hosts, when configured (`shared`).
    #[cfg(feature = "shared-tier")]
    shared: Option<shared::SharedSide>,
    /// When the service opened (its status reports the uptime).
    opened: std::time::Instant,
    /// The object keys of recent restores (`retrieve::KeyCache`).
    read_keys: Mutex<retrieve::KeyCache>,
    /// What page loads from L2 and the shared tier cost (`load_figures`).
    meters: load_figures::Meters,
    /// What attached engines last reported of themselves (`engines`).
    engines: engines::EngineBook,
}

/// The checkpoint service (in process). Thread-safe; share it by reference.
pub struct CheckpointService {
    inner: Arc<Inner>,
    /// Sweeps for gone lease holders and abandoned generations; stopped by
    /// a successful close and on drop.
    reaper: Mutex<Option<reclaim::Reaper>>,
}

impl std::fmt::Debug for CheckpointService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointService")
            .field("pool_id", &self.inner.pool.id())
            .field("l1_bytes", &self.inner.pool.size())
            .finish()
    }
}

impl CheckpointService {
    /// What a client needs to map the pool. In process this cannot fail
    /// (the [`Checkpoints`] form answers the same inside `Ok`).
    pub fn capabilities(&self) -> Capabilities {
        admin::capabilities(&self.inner)
    }

    /// The SHM pool (in-process workers and tests copy through it).
    pub fn pool(&self) -> &ShmPool {
        &self.inner.pool
    }

    /// Objects that no listed generation references and nothing holds: always
    /// 0 once work is idle (I7), because such objects are deleted at once.
    pub fn unreferenced_objects(&self) -> usize {
        admin::unreferenced_objects(&self.inner)
    }

    /// Closes the service: refuses (and stays usable) while store leases or
    /// exposed retrieve leases exist; otherwise cancels pending lookups, drains
    /// the L2 queue and closes the directory (the pool's memory is freed when
    /// the last process that maps it lets go).
    pub fn close(&self) -> Result<()> {
        admin::close(&self.inner)?;
        if let Some(mut reaper) = self.reaper.lock().take() {
            reaper.stop();
        }
        Ok(())
    }

    /// [`Checkpoints::prepare_store`] for a lease held by `holder`: when
    /// that process is gone, the lease is aborted (see `service::reclaim`).
    /// The in-process call holds its leases [`Holder::Untracked`].
    pub fn prepare_store_for(
        &self,
        holder: &Holder,
        manifest: &Manifest,
        rank: u32,
    ) -> Result<Lease> {
        store::prepare_store(&self.inner, holder, manifest, rank)
    }

    /// [`CheckpointService::prepare_store_for`] that never waits for L1
    /// space: `Ok(None)` when the rank's new pages do not fit now, with
    /// nothing changed (then `prepare_store_for` waits for evictions, up to
    /// the admission timeout). Any other answer is the one
    /// `prepare_store_for` would have given.
    pub fn try_prepare_store_for(
        &self,
        holder: &Holder,
        manifest: &Manifest,
        rank: u32,
    ) -> Result<Option<Lease>> {
        store::try_prepare_store(&self.inner, holder, manifest, rank)
    }

    /// [`Checkpoints::begin_retrieve`] for a lease held by `holder`: when
    /// that process is gone, the lease is released.
    pub fn begin_retrieve_for(
        &self,
        holder: &Holder,
        manifest: &Manifest,
        rank: u32,
    ) -> Result<Lease> {
        retrieve::begin_retrieve(&self.inner, holder, manifest, rank)
    }

    /// A connection of `peer` closed: when the process is gone, or goes
    /// within `grace` (it closes its sockets just before it is reported
    /// gone), its leases are reclaimed now; a live process keeps them.
    pub fn peer_disconnected(&self, peer: &crate::peer::Peer, grace: Duration) -> Reclaimed {
        reclaim::peer_disconnected(&self.inner, peer, grace)
    }

    /// Reclaims now the leases of every holder that is gone (what the
    /// background sweep does every [`SWEEP_EVERY`]).
    pub fn reclaim_gone(&self) -> Reclaimed {
        reclaim::sweep(&self.inner)
    }

    /// Whether a shared tier is configured (then `find` may wait for it up
    /// to its lookup timeout).
    pub fn has_shared_tier(&self) -> bool {
        #[cfg(feature = "shared-tier")]
        return self.inner.shared.is_some();
        #[cfg(not(feature = "shared-tier"))]
        return false;
    }

    /// Test helper: waits until the L2 queue is empty (every listed generation durable).
    pub fn wait_l2_idle(&self, timeout: Duration) -> bool {
        self.inner.wait_l2_idle(timeout)
    }
}

/// The operation set in process: each operation is one function of the
/// seam that owns it.
impl Checkpoints for CheckpointService {
    fn capabilities(&self) -> Result<Capabilities> {
        Ok(admin::capabilities(&self.inner))
    }
    fn find(&self, roots: &[Prefix]) -> Result<Option<Manifest>> {
        retrieve::find(&self.inner, roots)
    }
    fn begin(&self, manifest: &Manifest) -> Result<bool> {
        store::begin(&self.inner, manifest)
    }
    fn abort(&self, generation: &str) -> Result<()> {
        store::abort(&self.inner, generation)
    }
    fn prepare_store(&self, manifest: &Manifest, rank: u32) -> Result<Lease> {
        store::prepare_store(&self.inner, &Holder::Untracked, manifest, rank)
    }
    fn finish_store(&self, lease_id: &str, success: bool, rank: Option<u32>) -> Result<bool> {
        store::finish_store(&self.inner, lease_id, success, rank)
    }
    fn begin_retrieve(&self, manifest: &Manifest, rank: u32) -> Result<Lease> {
        retrieve::begin_retrieve(&self.inner, &Holder::Untracked, manifest, rank)
    }
    fn poll_retrieve(&self, lease_id: &str, rank: Option<u32>) -> Result<Lease> {
        retrieve::poll_retrieve(&self.inner, lease_id, rank)
    }
    fn finish_retrieve(&self, lease_id: &str, rank: Option<u32>) -> Result<()> {
        retrieve::finish_retrieve(&self.inner, lease_id, rank)
    }
    fn cancel_retrieve(&self, lease_id: &str, rank: Option<u32>) -> Result<()> {
        retrieve::cancel_retrieve(&self.inner, lease_id, rank)
    }
    fn status(&self) -> Result<ServiceStatus> {
        admin::status(&self.inner)
    }
    fn clear(&self, force: bool, all_tiers: bool) -> Result<ClearReport> {
        admin::clear(&self.inner, force, all_tiers)
    }
    fn invalidate_namespace(&self, namespace: &str) -> Result<u64> {
        admin::invalidate_namespace(&self.inner, namespace)
    }
    fn list_generations(&self) -> Result<Vec<GenerationInfo>> {
        admin::list_generations(&self.inner)
    }
    fn changes(&self, since: u64, watch: &[String]) -> Result<ChangeBatch> {
        admin::changes(&self.inner, since, watch)
    }

    fn find_located(&self, roots: &[Prefix]) -> Result<Option<Located>> {
        retrieve::find_located(&self.inner, roots)
    }
    fn report_engine(&self, engine: &str, counters: &[(String, u64)]) -> Result<()> {
        self.inner.engines.report(engine, counters)
    }
    fn engines(&self) -> Result<Vec<EngineReport>> {
        Ok(self.inner.engines.list())
    }
}

/// In process every `*_async` call answers at once.
impl CheckpointsAsync for CheckpointService {}

impl Drop for CheckpointService {
    fn drop(&mut self) {
        // Stop the sweeper first: it never holds the last reference.
        if let Some(mut reaper) = self.reaper.lock().take() {
            reaper.stop();
        }
        // Drain background I/O while this handle still owns the service, so
        // no I/O thread ever drops the last reference (it would join itself).
        self.inner.drain_io();
    }
}

/// The in-process service hands out its own pool.
impl PoolSource for CheckpointService {
    fn share_pool(&self) -> Result<(Capabilities, OwnedFd)> {
        Ok((
            CheckpointService::capabilities(self),
            CheckpointService::pool(self).share()?,
        ))
    }
    fn pool_id(&self) -> Result<String> {
        Ok(CheckpointService::pool(self).id().to_string())
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<CheckpointService>();
}
