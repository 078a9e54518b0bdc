//! The checkpoint service: leases, the store path, the retrieve path,
//! publication, clear, durability and restart (`spec/storage-and-transfer.md`
//! §5, §8, §10 with DESIGN §5 and §7).
//!
//! One [`CheckpointService`] owns the SHM pool (L1), the optional L2 file tier
//! and the SQLite directory. Worker ranks lease slots of the pool, copy bytes
//! in or out, and finish their lease; the service never copies page bytes
//! except between L1 and L2 on its I/O threads.
//!
//! Locking: one mutex over the object table, leases and pending generations
//! ([`state::State`]). It is never held across an L2 read/write or a copy. The
//! directory has its own lock; the service calls it without its mutex except
//! to retire generations whose last copy is being dropped (rare, and the
//! directory never calls back), so the order is always service → directory.
//!
//! Object lifecycle and reference counts (I7): an object is referenced by each
//! listed generation naming it (`refs`), pinned by each pending generation
//! that will name it (`pins`, from prepare_store until publication or abort),
//! held by retrieve leases (`readers`) and by background I/O (`io`). At zero it
//! is deleted from L1 and L2 at once — nothing waits for LRU.

mod inspect;
mod keys;
mod state;
mod types;

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};
use crate::identity::Prefix;
use crate::index::{Directory, DirectoryConfig};
use crate::manifest::Manifest;
use crate::store::ObjectKey;
use crate::store::alloc::SlotAllocator;
use crate::store::l2::{Fs, IoPool, L2Tier, RealFs};
use crate::store::shm::ShmPool;

pub use inspect::GenerationInfo;
pub use keys::object_keys;
pub use state::{L1, L2};
pub use types::{
    Capabilities, ClearReport, Lease, LeaseStatus, ServiceConfig, ServiceStatus, Slot,
};

use state::{Obj, PendingGen, RankState, RetrieveLease, State, StoreLease};

/// Slot/layout format version announced in capabilities.
pub const FORMAT_VERSION: u32 = 1;
/// RPC protocol version announced in capabilities.
pub const PROTOCOL_VERSION: u32 = 1;

/// How long a capacity wait sleeps between retries at most.
const RETRY_WAIT: Duration = Duration::from_millis(100);

struct Inner {
    config: ServiceConfig,
    pool: ShmPool,
    dir: Directory,
    l2: Option<Arc<L2Tier>>,
    io: Mutex<Option<IoPool>>,
    state: Mutex<State>,
    changed: Condvar,
}

/// The checkpoint service (in process). Thread-safe; share it by reference.
pub struct CheckpointService {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CheckpointService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointService")
            .field("shm_name", &self.inner.pool.name())
            .field("l1_bytes", &self.inner.pool.size())
            .finish()
    }
}

fn lease_salt() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

impl CheckpointService {
    /// Opens the service: creates the SHM pool, opens the directory and the L2
    /// tier, and reconciles them (`progress` is called with the number of L2
    /// files scanned so far, for long start-ups).
    ///
    /// Progress of a long start-up scan of L2 is logged every 10,000 files.
    pub fn open(config: ServiceConfig) -> Result<CheckpointService> {
        let mut next_report = 10_000;
        Self::open_with_progress(config, &mut |scanned| {
            if scanned >= next_report {
                log::info!("start-up: scanned {scanned} L2 object files");
                next_report = scanned + 10_000;
            }
        })
    }

    /// [`CheckpointService::open`] with a progress callback.
    pub fn open_with_progress(
        config: ServiceConfig,
        progress: &mut dyn FnMut(usize),
    ) -> Result<CheckpointService> {
        Self::open_with_fs(config, Arc::new(RealFs), progress)
    }

    /// [`CheckpointService::open`] with the filesystem L2 uses (tests inject
    /// faults through `store::l2::testing::FaultyFs`).
    pub fn open_with_fs(
        config: ServiceConfig,
        fs: Arc<dyn Fs>,
        progress: &mut dyn FnMut(usize),
    ) -> Result<CheckpointService> {
        if config.max_leases == 0 {
            return Err(Error::invalid("max_leases must be a positive integer"));
        }
        let alloc = SlotAllocator::new(config.l1_bytes)?;
        let dir = Directory::open(
            config.checkpoint_index_path.as_deref(),
            DirectoryConfig {
                max_entries: config.max_entries,
                max_pending: config.max_pending,
                ..DirectoryConfig::default()
            },
        )?;
        let (l2, inventory) = match &config.l2_path {
            Some(path) => {
                let (tier, inventory) =
                    L2Tier::open_with_progress(path, config.l2_bytes, fs, progress)?;
                (Some(Arc::new(tier)), Some(inventory))
            }
            None => (None, None),
        };
        let io = match &l2 {
            Some(_) => Some(IoPool::new(
                config.l2_io_threads.max(1),
                4096,
                "lmcache-rc-l2",
            )?),
            None => None,
        };
        let pool = ShmPool::create(&config.shm_name, config.l1_bytes)?;
        let inner = Arc::new(Inner {
            config,
            pool,
            dir,
            l2,
            io: Mutex::new(io),
            state: Mutex::new(State::new(alloc, lease_salt())),
            changed: Condvar::new(),
        });
        let service = CheckpointService { inner };
        service.reconcile(inventory)?;
        Ok(service)
    }

    /// Start-up reconciliation: every listed generation must have all of its
    /// objects verified on disk (I8); others are retired. Objects no listed
    /// generation references are deleted; unreadable files are reclaimed.
    fn reconcile(&self, inventory: Option<crate::store::l2::Inventory>) -> Result<()> {
        let inner = &self.inner;
        let mut on_disk = std::collections::HashMap::new();
        if let Some(inv) = &inventory {
            for entry in &inv.objects {
                on_disk.insert(entry.key, entry.page_bytes);
            }
            if let Some(l2) = &inner.l2 {
                if !inv.unreadable.is_empty() {
                    let n = l2.reclaim_unreadable(&inv.unreadable)?;
                    log::warn!("reclaimed {n} unreadable or old-format L2 files");
                }
            }
        }
        let mut listed = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let page = inner.dir.list(after.as_deref(), 1024)?;
            listed.extend(page.generations);
            match page.next_after {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        let mut retire = Vec::new();
        let mut st = inner.state.lock();
        for entry in listed {
            let manifest = entry.manifest;
            let keys = match all_rank_keys(&manifest) {
                Ok(k) => k,
                Err(e) => {
                    log::warn!("retiring {}: payload invalid: {e}", manifest.generation());
                    retire.push(manifest.generation().to_string());
                    continue;
                }
            };
            let complete = keys
                .iter()
                .all(|(key, bytes)| on_disk.get(key).is_some_and(|b| b == bytes));
            if !complete {
                retire.push(manifest.generation().to_string());
                continue;
            }
            for (key, bytes) in &keys {
                st.objects
                    .entry(*key)
                    .or_insert_with(|| Obj::on_disk(*bytes));
            }
            st.list_generation(
                manifest.generation(),
                keys.into_iter().map(|(k, _)| k).collect(),
            );
        }
        // Files that no listed generation references are garbage (I7).
        for key in on_disk.keys() {
            if !st.objects.contains_key(key) {
                st.l2_deletes.push(*key);
            }
        }
        st.count("restart_retired", retire.len() as u64);
        st.newly_durable.clear();
        let deletes = std::mem::take(&mut st.l2_deletes);
        drop(st);
        if !retire.is_empty() {
            log::warn!(
                "start-up: retired {} generation(s) whose objects are missing or corrupt",
                retire.len()
            );
            inner.dir.retire(&retire)?;
        }
        if let Some(l2) = &inner.l2 {
            for key in deletes {
                l2.remove(&key)?;
            }
        }
        Ok(())
    }

    /// What a client needs to map the pool.
    pub fn capabilities(&self) -> Capabilities {
        Capabilities {
            format_version: FORMAT_VERSION,
            protocol_version: PROTOCOL_VERSION,
            shm_name: self.inner.pool.name().to_string(),
            pool_size: self.inner.pool.size(),
            durable_index: self.inner.config.checkpoint_index_path.is_some(),
        }
    }

    /// The directory (read-only views use it).
    pub(crate) fn directory(&self) -> &Directory {
        &self.inner.dir
    }

    /// The SHM pool (in-process workers and tests copy through it).
    pub fn pool(&self) -> &ShmPool {
        &self.inner.pool
    }

    /// The longest listed generation whose prefix is a whole-token prefix of
    /// the query. A candidate only: every rank must still retrieve it.
    pub fn find(&self, roots: &[Prefix]) -> Result<Option<Manifest>> {
        let found = self.inner.dir.find(roots)?;
        let mut st = self.inner.state.lock();
        match &found {
            Some(_) => st.count("find_hits", 1),
            None => st.count("find_misses", 1),
        }
        Ok(found)
    }

    /// Stages a generation; false = identical one pending or listed, no
    /// capacity, or an aborted attempt of it still draining (retry later).
    pub fn begin(&self, manifest: &Manifest) -> Result<bool> {
        // Validate the page groups before anything is staged.
        manifest.payload_schema()?;
        self.maybe_abort_stale();
        // An aborted attempt of this generation may still be draining: rank
        // leases not yet finished, or acknowledgements in flight. Staging it
        // again now would let those count toward the new attempt (a stale
        // acknowledgement publishing pages the new attempt never stored), so
        // it is refused until they are gone.
        let draining = {
            let st = self.inner.state.lock();
            let g = manifest.generation();
            st.pending.contains_key(g) || st.store_leases.values().any(|l| l.generation == g)
        };
        if draining && !self.inner.dir.is_pending(manifest)? {
            self.inner.state.lock().count("begin_draining", 1);
            return Ok(false);
        }
        let staged = self.inner.dir.begin(manifest)?;
        if !staged {
            self.inner.state.lock().count("begin_suppressed", 1);
            return Ok(false);
        }
        let g = manifest.generation();
        {
            let mut st = self.inner.state.lock();
            let epoch = st.next_epoch;
            st.next_epoch += 1;
            st.pending
                .entry(g.to_string())
                .or_insert_with(|| PendingGen {
                    ranks: Default::default(),
                    pinned: Vec::new(),
                    acks_in_flight: 0,
                    abort_requested: false,
                    epoch,
                });
        }
        // An abort that ran between the directory's answer and the record
        // above found nothing to drop here: drop it now.
        if !matches!(self.inner.dir.is_pending(manifest), Ok(true)) {
            abort_locked(&mut self.inner.state.lock(), g);
        }
        Ok(true)
    }

    /// Aborts a pending generation (no-op for unknown or listed ones).
    pub fn abort(&self, generation: &str) -> Result<()> {
        self.inner.dir.abort(generation)?;
        let mut st = self.inner.state.lock();
        abort_locked(&mut st, generation);
        drop(st);
        self.after_change();
        Ok(())
    }

    fn maybe_abort_stale(&self) {
        if let Some(age) = self.inner.config.abandoned_after {
            let stale = match self.inner.dir.abort_stale(age) {
                Ok(stale) => stale,
                Err(e) => {
                    log::warn!("aborting abandoned generations failed: {e}");
                    Vec::new()
                }
            };
            if !stale.is_empty() {
                let mut st = self.inner.state.lock();
                for g in &stale {
                    abort_locked(&mut st, g);
                }
                st.count("abandoned_generations", stale.len() as u64);
            }
        }
    }

    /// Leases slots for one rank's pages of a pending generation.
    ///
    /// All or nothing: `ready` with a slot per new page and `None` per page
    /// already resident (do not copy); `busy` when another lease is writing a
    /// page this one needs (retry; the generation stays pending); `miss` when
    /// the generation is not pending or space did not free up in time (the
    /// generation is aborted).
    pub fn prepare_store(&self, manifest: &Manifest, rank: u32) -> Result<Lease> {
        let schema = manifest.payload_schema()?;
        let groups = object_keys(manifest, &schema, rank)?;
        let page_bytes: Vec<u64> = schema.page_groups.iter().map(|g| g.page_bytes).collect();
        let epoch = staged_epoch(&self.inner.state.lock(), manifest.generation());
        if !self.inner.dir.is_pending(manifest)? {
            self.inner.state.lock().miss("not_pending");
            return Ok(Lease::miss("not_pending"));
        }
        let generation = manifest.generation().to_string();
        let inner = &self.inner;
        let mut st = inner.state.lock();
        if !st.accepting {
            st.miss("shutdown");
            return Ok(Lease::miss("shutdown"));
        }
        if st.store_ranks.contains(&(generation.clone(), rank)) {
            return Err(Error::invalid(format!(
                "rank {rank} already has a store lease for {generation}"
            )));
        }
        // The directory answered "pending" without this lock: the generation
        // may have been aborted (and even begun again) since. Only begin()
        // creates the service's record of a staging, so a missing or newer
        // one means this call belongs to an aborted staging.
        let Some(epoch) = epoch.filter(|e| staged_epoch(&st, &generation) == Some(*e)) else {
            st.miss("not_pending");
            return Ok(Lease::miss("not_pending"));
        };
        if let Some(pg) = st.pending.get(&generation) {
            if pg.ranks.get(&rank) == Some(&RankState::Committed) {
                return Err(Error::invalid(format!(
                    "rank {rank} already committed {generation}"
                )));
            }
        }
        if st.live_leases() >= inner.config.max_leases {
            st.miss("lease_budget");
            drop(st);
            self.abort(&generation)?;
            return Ok(Lease::miss("lease_budget"));
        }
        st.store_ranks.insert((generation.clone(), rank));
        let (lease_no, lease_id) = st.new_lease_id();
        let deadline = Instant::now() + inner.config.store_admission_timeout;
        let mut waited = false;
        loop {
            if staged_epoch(&st, &generation) != Some(epoch) {
                st.store_ranks.remove(&(generation.clone(), rank));
                st.miss("conflict");
                return Ok(Lease::miss("conflict"));
            }
            let generation_before = st.alloc.change_generation();
            match attempt_store(&mut st, &groups, &page_bytes, lease_no) {
                Attempt::Ready {
                    slots,
                    written,
                    reused,
                } => {
                    let bytes = slots
                        .iter()
                        .flatten()
                        .map(|s| s.map_or(0, |(_, len)| len))
                        .sum();
                    if let Some(pg) = st.pending.get_mut(&generation) {
                        pg.pinned.extend(written.iter().copied());
                        pg.pinned.extend(reused.iter().copied());
                        pg.ranks.insert(rank, RankState::Leased(lease_no));
                    }
                    st.count("store_pages_reused", reused.len() as u64);
                    st.count("store_pages_new", written.len() as u64);
                    st.count("store_bytes_leased", bytes);
                    st.store_leases.insert(
                        lease_no,
                        StoreLease {
                            number: lease_no,
                            generation: generation.clone(),
                            rank,
                            written,
                            bytes,
                        },
                    );
                    if waited {
                        st.count("admission_success_after_eviction", 1);
                    }
                    drop(st);
                    self.flush_side_effects();
                    return Ok(Lease {
                        status: LeaseStatus::Ready,
                        lease_id: Some(lease_id),
                        slots,
                        reason: None,
                    });
                }
                Attempt::Busy => {
                    st.store_ranks.remove(&(generation.clone(), rank));
                    st.count("admission_busy", 1);
                    drop(st);
                    self.flush_side_effects();
                    return Ok(Lease::busy());
                }
                Attempt::Capacity => {
                    let now = Instant::now();
                    if now >= deadline {
                        st.store_ranks.remove(&(generation.clone(), rank));
                        st.miss("capacity");
                        st.count("admission_timeouts", 1);
                        drop(st);
                        self.flush_side_effects();
                        self.abort(&generation)?;
                        return Ok(Lease::miss("capacity"));
                    }
                    if !waited {
                        st.count("admission_waits", 1);
                    }
                    waited = true;
                    let wait = (deadline - now).min(RETRY_WAIT);
                    if st.alloc.change_generation() == generation_before {
                        inner.changed.wait_for(&mut st, wait);
                    }
                    st.count("admission_retries", 1);
                }
            }
        }
    }

    /// Ends a store lease after the worker's copy drained. `success = true`
    /// commits this rank; the call that completes the last rank publishes
    /// (returns true). `success = false` discards the pages and aborts the
    /// generation, so no other rank can publish it.
    pub fn finish_store(&self, lease_id: &str, success: bool) -> Result<bool> {
        let inner = &self.inner;
        let mut st = inner.state.lock();
        let Some(lease_no) = st.lease_number(lease_id) else {
            return Ok(false);
        };
        let Some(lease) = st.store_leases.remove(&lease_no) else {
            return Ok(false);
        };
        st.store_ranks
            .remove(&(lease.generation.clone(), lease.rank));
        let still_pending = st
            .pending
            .get(&lease.generation)
            .is_some_and(|pg| !pg.abort_requested);
        if !success || !still_pending {
            discard_written(&mut st, &lease);
            if success {
                st.miss("aborted_during_store");
            }
            drop(st);
            self.abort(&lease.generation)?;
            return Ok(false);
        }
        for key in &lease.written {
            if let Some(obj) = st.objects.get_mut(key) {
                obj.l1 = L1::Ready;
            }
            st.touch(key);
            if inner.l2.is_some() {
                st.l2_writes.push(*key);
            }
        }
        if let Some(pg) = st.pending.get_mut(&lease.generation) {
            pg.ranks.insert(lease.rank, RankState::Committed);
            pg.acks_in_flight += 1;
        }
        st.count("store_bytes_committed", lease.bytes);
        drop(st);
        self.flush_side_effects();

        let ack = inner.dir.acknowledge(&lease.generation, lease.rank);
        let mut st = inner.state.lock();
        let abort_requested = match st.pending.get_mut(&lease.generation) {
            Some(pg) => {
                pg.acks_in_flight -= 1;
                pg.abort_requested && pg.acks_in_flight == 0
            }
            None => false,
        };
        let publication = match ack {
            Ok(p) => p,
            Err(e) => {
                st.miss("directory_error");
                drop(st);
                self.abort(&lease.generation)?;
                return Err(e);
            }
        };
        if publication.published {
            let pg = st.pending.remove(&lease.generation);
            if let Some(pg) = pg {
                let keys = pg.pinned.clone();
                st.list_generation(&lease.generation, keys);
                for key in &pg.pinned {
                    if let Some(obj) = st.objects.get_mut(key) {
                        obj.pins = obj.pins.saturating_sub(1);
                    }
                }
            }
            if let Some(old) = &publication.replaced {
                st.unlist_generation(old);
            }
            for evicted in &publication.evicted {
                st.unlist_generation(evicted);
                st.count("evictions", 1);
            }
            st.count("published", 1);
        } else if abort_requested {
            st.release_pending(&lease.generation);
        }
        drop(st);
        self.after_change();
        Ok(publication.published)
    }

    /// Starts restoring one rank of a listed generation. Answers `pending`
    /// with a lease id (poll it) or `miss` (unlisted, retired, no budget).
    pub fn begin_retrieve(&self, manifest: &Manifest, rank: u32) -> Result<Lease> {
        let schema = manifest.payload_schema()?;
        let groups = object_keys(manifest, &schema, rank)?;
        let listed = self.inner.dir.get(manifest.generation())?;
        let mut st = self.inner.state.lock();
        if listed.as_ref() != Some(manifest) || !st.listed.contains_key(manifest.generation()) {
            st.miss("not_listed");
            return Ok(Lease::miss("not_listed"));
        }
        if !st.accepting {
            st.miss("shutdown");
            return Ok(Lease::miss("shutdown"));
        }
        if st.live_leases() >= self.inner.config.max_leases {
            st.miss("lease_budget");
            return Ok(Lease::miss("lease_budget"));
        }
        let (lease_no, lease_id) = st.new_lease_id();
        let keys: Vec<ObjectKey> = groups.iter().flatten().copied().collect();
        let n = keys.len();
        st.retrieve_leases.insert(
            lease_no,
            RetrieveLease {
                generation: manifest.generation().to_string(),
                keys,
                group_sizes: groups.iter().map(Vec::len).collect(),
                held: vec![false; n],
                exposed: false,
                failed: None,
                started: Instant::now(),
            },
        );
        let loads = advance_retrieve(&mut st, lease_no);
        drop(st);
        self.start_loads(loads);
        self.flush_side_effects();
        Ok(Lease {
            status: LeaseStatus::Pending,
            lease_id: Some(lease_id),
            slots: Vec::new(),
            reason: None,
        })
    }

    /// Polls a retrieve: `pending`, `ready` with slots (every page of the rank,
    /// read-locked until finish) or `miss` (the lease is gone).
    pub fn poll_retrieve(&self, lease_id: &str) -> Result<Lease> {
        let inner = &self.inner;
        let mut st = inner.state.lock();
        let lease_no = st
            .lease_number(lease_id)
            .filter(|n| st.retrieve_leases.contains_key(n))
            .ok_or_else(|| Error::NotFound(format!("unknown retrieve lease {lease_id}")))?;
        let loads = advance_retrieve(&mut st, lease_no);
        let timeout = inner.config.retrieve_timeout;
        let Some(lease) = st.retrieve_leases.get_mut(&lease_no) else {
            return Err(Error::NotFound(format!(
                "unknown retrieve lease {lease_id}"
            )));
        };
        if lease.failed.is_none()
            && !lease.held.iter().all(|h| *h)
            && lease.started.elapsed() > timeout
        {
            lease.failed = Some("retrieve_timeout");
        }
        if let Some(reason) = lease.failed {
            let lease = st.retrieve_leases.remove(&lease_no);
            if let Some(lease) = lease {
                release_readers(&mut st, &lease);
            }
            st.miss(reason);
            drop(st);
            self.start_loads(loads);
            self.after_change();
            return Ok(Lease::miss(reason));
        }
        let lease = st
            .retrieve_leases
            .get(&lease_no)
            .ok_or_else(|| Error::NotFound(format!("unknown retrieve lease {lease_id}")))?;
        if !lease.held.iter().all(|h| *h) {
            drop(st);
            self.start_loads(loads);
            return Ok(Lease {
                status: LeaseStatus::Pending,
                lease_id: Some(lease_id.to_string()),
                slots: Vec::new(),
                reason: None,
            });
        }
        let mut slots = Vec::with_capacity(lease.group_sizes.len());
        let mut i = 0;
        for size in &lease.group_sizes {
            let mut group = Vec::with_capacity(*size);
            for key in &lease.keys[i..i + size] {
                let obj = st.objects.get(key);
                match obj.and_then(|o| o.slot.map(|s| (s.offset, o.page_bytes))) {
                    Some(slot) => group.push(Some(slot)),
                    None => {
                        return Err(Error::invalid(
                            "internal: a held retrieve object has no L1 slot",
                        ));
                    }
                }
            }
            i += size;
            slots.push(group);
        }
        let first_exposure = !lease.exposed;
        if let Some(lease) = st.retrieve_leases.get_mut(&lease_no) {
            lease.exposed = true;
        }
        if first_exposure {
            st.count("hits", 1);
        }
        drop(st);
        self.start_loads(loads);
        Ok(Lease {
            status: LeaseStatus::Ready,
            lease_id: Some(lease_id.to_string()),
            slots,
            reason: None,
        })
    }

    /// Ends an exposed retrieve lease after the worker's copy drained.
    /// Unknown ids are a no-op; a lease not yet exposed is an error.
    pub fn finish_retrieve(&self, lease_id: &str) -> Result<()> {
        let mut st = self.inner.state.lock();
        let Some(lease_no) = st.lease_number(lease_id) else {
            return Ok(());
        };
        match st.retrieve_leases.get(&lease_no) {
            None => return Ok(()),
            Some(l) if !l.exposed => {
                return Err(Error::invalid(
                    "retrieve lease has no exposed slots yet: poll it until ready, or cancel it",
                ));
            }
            Some(_) => {}
        }
        if let Some(lease) = st.retrieve_leases.remove(&lease_no) {
            for key in &lease.keys {
                st.touch(key);
            }
            release_readers(&mut st, &lease);
        }
        drop(st);
        self.after_change();
        Ok(())
    }

    /// Cancels a retrieve that exposed nothing yet; never invalidates the
    /// generation. Unknown ids are a no-op; an exposed lease must be finished.
    pub fn cancel_retrieve(&self, lease_id: &str) -> Result<()> {
        let mut st = self.inner.state.lock();
        let Some(lease_no) = st.lease_number(lease_id) else {
            return Ok(());
        };
        match st.retrieve_leases.get(&lease_no) {
            None => return Ok(()),
            Some(l) if l.exposed => {
                return Err(Error::invalid(
                    "retrieve lease already exposed its slots: finish it after the copy drained",
                ));
            }
            Some(_) => {}
        }
        if let Some(lease) = st.retrieve_leases.remove(&lease_no) {
            release_readers(&mut st, &lease);
            st.count("retrieves_cancelled", 1);
        }
        drop(st);
        self.after_change();
        Ok(())
    }

    /// Objects that no listed generation references and nothing holds: always
    /// 0 once work is idle (I7), because such objects are deleted at once.
    pub fn unreferenced_objects(&self) -> usize {
        let st = self.inner.state.lock();
        st.objects
            .values()
            .filter(|o| o.refs == 0 && o.pins == 0 && o.readers == 0)
            .count()
    }

    /// Counters and gauges (DESIGN §6 keys).
    pub fn status(&self) -> Result<ServiceStatus> {
        let dir = self.inner.dir.status()?;
        let st = self.inner.state.lock();
        let mut values = std::collections::BTreeMap::new();
        values.insert("generations", dir.published_generations);
        values.insert("pending", dir.pending_generations);
        values.insert("store_leases", st.store_ranks.len() as u64);
        values.insert("retrieve_leases", st.retrieve_leases.len() as u64);
        values.insert("pins", st.pins_total());
        let l1_objects = st.objects.values().filter(|o| o.slot.is_some()).count();
        values.insert("l1_objects", l1_objects as u64);
        values.insert("l1_bytes", st.alloc.used());
        values.insert("l1_capacity", st.alloc.capacity());
        values.insert("objects", st.objects.len() as u64);
        let queued = st.objects.values().filter(|o| o.l2 == L2::Queued).count() as u64;
        let (l2_objects, l2_bytes, written) = match &self.inner.l2 {
            Some(l2) => (
                l2.object_count() as u64,
                l2.used_bytes(),
                l2.bytes_written(),
            ),
            None => (0, 0, 0),
        };
        let io_queue = self
            .inner
            .io
            .lock()
            .as_ref()
            .map_or(0, |io| io.queued() as u64);
        values.insert("l2_objects", l2_objects);
        values.insert("l2_bytes", l2_bytes);
        values.insert("l2_bytes_written", written);
        values.insert("l2_queue", queued.max(io_queue));
        values.insert("hits", st.counters.get("hits").copied().unwrap_or(0));
        values.insert(
            "evictions",
            st.counters.get("evictions").copied().unwrap_or(0),
        );
        for (name, value) in &st.counters {
            values.entry(name).or_insert(*value);
        }
        Ok(ServiceStatus {
            values,
            misses: st.misses.clone(),
        })
    }

    /// Drops L1 copies (and with `all_tiers` L2 files too). `force = false`
    /// keeps leased and pinned objects; `force = true` is refused while any
    /// lease is live and otherwise drops everything (pending generations are
    /// aborted). A listed generation whose only copy goes is retired.
    pub fn clear(&self, force: bool, all_tiers: bool) -> Result<ClearReport> {
        let mut report = ClearReport::default();
        let mut st = self.inner.state.lock();
        if force {
            if st.live_leases() > 0 {
                return Err(Error::LeasesLive(format!(
                    "forced clear refused: {} store and {} retrieve lease(s) are live; \
                     finish them or clear without force",
                    st.store_ranks.len(),
                    st.retrieve_leases.len()
                )));
            }
            let pending: Vec<String> = st.pending.keys().cloned().collect();
            for g in &pending {
                st.release_pending(g);
            }
            drop(st);
            for g in &pending {
                self.inner.dir.abort(g)?;
            }
            st = self.inner.state.lock();
        }
        // Counted by comparing before and after: retiring a generation
        // reclaims its other unreferenced objects in the same step, before
        // the loop reaches them.
        let before: Vec<(ObjectKey, bool, bool, u64)> = st
            .objects
            .iter()
            .map(|(k, o)| (*k, o.slot.is_some(), o.l2 == L2::Durable, o.page_bytes))
            .collect();
        for &(key, _, _, _) in &before {
            let Some(obj) = st.objects.get(&key) else {
                continue;
            };
            let in_l1 = obj.slot.is_some();
            let idle = obj.readers == 0 && obj.pins == 0 && obj.io == 0 && obj.waiters.is_empty();
            let l1_only = obj.l2 != L2::Durable;
            if !idle || !matches!(obj.l1, L1::Ready | L1::Absent) {
                report.kept_objects += 1;
                continue;
            }
            let drops_last_copy = (in_l1 && l1_only) || (all_tiers && obj.l2 == L2::Durable);
            if !in_l1 && !all_tiers {
                continue;
            }
            if drops_last_copy {
                report.retired_generations += st.retire_generations_of(&key) as u64;
            }
            if st.objects.contains_key(&key) {
                st.drop_l1(&key);
                if all_tiers {
                    if let Some(obj) = st.objects.get_mut(&key) {
                        if obj.l2 == L2::Durable {
                            obj.l2 = L2::Absent;
                            st.queue_l2_delete(key);
                        }
                    }
                }
                st.maybe_reclaim(&key);
            }
        }
        for (key, was_in_l1, was_durable, page_bytes) in before {
            let now = st.objects.get(&key);
            if was_in_l1 && now.is_none_or(|o| o.slot.is_none()) {
                report.l1_objects += 1;
                report.l1_bytes += page_bytes;
            }
            if was_durable && now.is_none_or(|o| o.l2 != L2::Durable) {
                report.l2_objects += 1;
            }
        }
        st.count("clears", 1);
        drop(st);
        self.after_change();
        Ok(report)
    }

    /// Closes the service: refuses (and stays usable) while store leases or
    /// exposed retrieve leases exist; otherwise cancels pending lookups, drains
    /// the L2 queue, closes the directory and unlinks the pool (on drop).
    pub fn close(&self) -> Result<()> {
        let mut st = self.inner.state.lock();
        let exposed = st.retrieve_leases.values().filter(|l| l.exposed).count();
        if !st.store_ranks.is_empty() || exposed > 0 {
            return Err(Error::LeasesLive(format!(
                "checkpoint worker copy leases must drain before close ({} store, {} retrieve)",
                st.store_ranks.len(),
                exposed
            )));
        }
        st.accepting = false;
        let pending: Vec<u64> = st.retrieve_leases.keys().copied().collect();
        for n in pending {
            if let Some(lease) = st.retrieve_leases.remove(&n) {
                release_readers(&mut st, &lease);
            }
        }
        drop(st);
        self.flush_side_effects();
        if let Some(io) = self.inner.io.lock().take() {
            io.shutdown();
        }
        self.flush_side_effects();
        self.inner.dir.close()
    }

    /// Test helper: waits until the L2 queue is empty (every listed generation durable).
    pub fn wait_l2_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let idle = {
                let st = self.inner.state.lock();
                !st.objects.values().any(|o| o.l2 == L2::Queued || o.io > 0)
            };
            let io_idle = self
                .inner
                .io
                .lock()
                .as_ref()
                .is_none_or(|io| io.queued() == 0);
            if idle && io_idle {
                self.flush_side_effects();
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Notifies capacity waiters and performs queued side effects.
    fn after_change(&self) {
        self.flush_side_effects();
        self.inner.changed.notify_all();
    }

    /// Performs what the state queued for outside the lock: L2 writes and
    /// deletes, directory retirements and durable flags.
    fn flush_side_effects(&self) {
        flush(&self.inner);
    }

    fn start_loads(&self, loads: Vec<(ObjectKey, u64, u64)>) {
        for (key, offset, len) in loads {
            submit_load(&self.inner, key, offset, len);
        }
    }
}

impl Drop for CheckpointService {
    fn drop(&mut self) {
        // Drain background I/O while this handle still owns the service, so
        // no I/O thread ever drops the last reference (it would join itself).
        if let Some(io) = self.inner.io.lock().take() {
            io.shutdown();
        }
        flush(&self.inner);
    }
}

/// All objects of all ranks of a manifest with their page sizes.
fn all_rank_keys(manifest: &Manifest) -> Result<Vec<(ObjectKey, u64)>> {
    let schema = manifest.payload_schema()?;
    let mut out = Vec::new();
    for rank in 0..manifest.world_size() {
        for (group, keys) in schema
            .page_groups
            .iter()
            .zip(object_keys(manifest, &schema, rank)?)
        {
            out.extend(keys.into_iter().map(|k| (k, group.page_bytes)));
        }
    }
    Ok(out)
}

enum Attempt {
    Ready {
        slots: Vec<Vec<Slot>>,
        written: Vec<ObjectKey>,
        reused: Vec<ObjectKey>,
    },
    Busy,
    Capacity,
}

/// One all-or-nothing admission attempt for a rank's pages.
fn attempt_store(
    st: &mut State,
    groups: &[Vec<ObjectKey>],
    page_bytes: &[u64],
    lease: u64,
) -> Attempt {
    let mut slots = Vec::with_capacity(groups.len());
    let mut written: Vec<ObjectKey> = Vec::new();
    let mut reused: Vec<ObjectKey> = Vec::new();
    // The pages that need a new slot must fit the pool even after every
    // evictable copy is gone; otherwise report capacity before evicting
    // anything (an oversized store must not retire generations for nothing).
    let mut seen = std::collections::HashSet::new();
    let mut needed: u64 = 0;
    for (keys, &bytes) in groups.iter().zip(page_bytes) {
        for key in keys {
            let placed = st
                .objects
                .get(key)
                .is_some_and(|o| o.reusable() || matches!(o.l1, L1::Writing(_) | L1::Loading));
            if !placed && seen.insert(*key) {
                let reserved = st.alloc.reserved_for(bytes).unwrap_or(u64::MAX);
                needed = needed.saturating_add(reserved);
            }
        }
    }
    if needed > st.alloc.available()
        && needed
            > st.alloc
                .available()
                .saturating_add(st.evictable_bytes(true))
    {
        return Attempt::Capacity;
    }
    let mut outcome = None;
    'groups: for (keys, &bytes) in groups.iter().zip(page_bytes) {
        let mut group = Vec::with_capacity(keys.len());
        for key in keys {
            match st.objects.get(key).map(|o| (o.l1, o.reusable())) {
                Some((L1::Writing(owner), _)) if owner == lease => group.push(None),
                Some((_, true)) => {
                    if let Some(obj) = st.objects.get_mut(key) {
                        obj.pins += 1;
                    }
                    reused.push(*key);
                    group.push(None);
                }
                Some((L1::Writing(_) | L1::Loading, false)) => {
                    outcome = Some(Attempt::Busy);
                    break 'groups;
                }
                // Its old L2 file is being deleted: wait until it is gone.
                _ if st.deleting.contains_key(key) => {
                    outcome = Some(Attempt::Busy);
                    break 'groups;
                }
                _ => {
                    let slot = match st.alloc.alloc(bytes) {
                        Some(slot) => Some(slot),
                        None => {
                            let reserved = st.alloc.reserved_for(bytes).unwrap_or(u64::MAX);
                            if st.evict_for(reserved, true) {
                                st.alloc.alloc(bytes)
                            } else {
                                None
                            }
                        }
                    };
                    let Some(slot) = slot else {
                        outcome = Some(Attempt::Capacity);
                        break 'groups;
                    };
                    match st.objects.get_mut(key) {
                        // A record without bytes (lost copy): rewrite it.
                        Some(obj) => {
                            obj.slot = Some(slot);
                            obj.l1 = L1::Writing(lease);
                            obj.page_bytes = bytes;
                            obj.pins += 1;
                        }
                        None => {
                            let mut obj = Obj::writing(bytes, slot, lease);
                            obj.pins = 1;
                            st.objects.insert(*key, obj);
                        }
                    }
                    written.push(*key);
                    group.push(Some((slot.offset, bytes)));
                }
            }
        }
        slots.push(group);
    }
    match outcome {
        None => Attempt::Ready {
            slots,
            written,
            reused,
        },
        Some(failure) => {
            // Roll back this attempt completely.
            for key in &written {
                if let Some(obj) = st.objects.get_mut(key) {
                    obj.pins = obj.pins.saturating_sub(1);
                }
                st.drop_l1(key);
                st.maybe_reclaim(key);
            }
            for key in &reused {
                if let Some(obj) = st.objects.get_mut(key) {
                    obj.pins = obj.pins.saturating_sub(1);
                }
                st.maybe_reclaim(key);
            }
            failure
        }
    }
}

/// Removes the pages a failed or orphaned store lease was writing.
fn discard_written(st: &mut State, lease: &StoreLease) {
    for key in &lease.written {
        if st
            .objects
            .get(key)
            .is_some_and(|o| o.l1 == L1::Writing(lease.number))
        {
            st.drop_l1(key);
        }
        st.maybe_reclaim(key);
    }
    if let Some(pg) = st.pending.get_mut(&lease.generation) {
        pg.ranks.remove(&lease.rank);
    }
}

/// The epoch of a generation's staging, if it is staged (begun, not
/// aborted, not yet published).
fn staged_epoch(st: &State, generation: &str) -> Option<u64> {
    st.pending
        .get(generation)
        .filter(|pg| !pg.abort_requested)
        .map(|pg| pg.epoch)
}

/// Aborts a pending generation in the service state (the directory was told).
fn abort_locked(st: &mut State, generation: &str) {
    let Some(pg) = st.pending.get_mut(generation) else {
        return;
    };
    if pg.acks_in_flight > 0 {
        pg.abort_requested = true;
        return;
    }
    st.release_pending(generation);
}

/// Drops a retrieve lease's readers (objects may become reclaimable).
fn release_readers(st: &mut State, lease: &RetrieveLease) {
    for (key, held) in lease.keys.iter().zip(&lease.held) {
        if let Some(obj) = st.objects.get_mut(key) {
            if *held {
                obj.readers = obj.readers.saturating_sub(1);
            }
        }
    }
    for key in &lease.keys {
        st.maybe_reclaim(key);
    }
}

/// Takes readers on every resident page of a retrieve and starts L2 loads for
/// the rest. Returns the loads to submit (key, slot offset, length).
fn advance_retrieve(st: &mut State, lease_no: u64) -> Vec<(ObjectKey, u64, u64)> {
    let mut loads = Vec::new();
    let Some(lease) = st.retrieve_leases.get(&lease_no) else {
        return loads;
    };
    if lease.failed.is_some() {
        return loads;
    }
    let pending: Vec<(usize, ObjectKey)> = lease
        .held
        .iter()
        .enumerate()
        .filter(|(_, held)| !**held)
        .map(|(i, _)| (i, lease.keys[i]))
        .collect();
    let generation = lease.generation.clone();
    for (i, key) in pending {
        let state = st.objects.get(&key).map(|o| (o.l1, o.l2, o.page_bytes));
        match state {
            Some((L1::Ready, _, _)) => {
                if let Some(obj) = st.objects.get_mut(&key) {
                    obj.readers += 1;
                }
                st.touch(&key);
                if let Some(lease) = st.retrieve_leases.get_mut(&lease_no) {
                    lease.held[i] = true;
                }
            }
            Some((L1::Loading | L1::Writing(_), _, _)) => {
                if let Some(obj) = st.objects.get_mut(&key) {
                    if !obj.waiters.contains(&lease_no) {
                        obj.waiters.push(lease_no);
                    }
                }
            }
            Some((L1::Absent, L2::Durable, bytes)) => {
                let mut slot = st.alloc.alloc(bytes);
                if slot.is_none() {
                    let reserved = st.alloc.reserved_for(bytes).unwrap_or(u64::MAX);
                    if st.evict_for(reserved, true) {
                        slot = st.alloc.alloc(bytes);
                    }
                }
                match slot {
                    Some(slot) => {
                        if let Some(obj) = st.objects.get_mut(&key) {
                            obj.slot = Some(slot);
                            obj.l1 = L1::Loading;
                            obj.io += 1;
                            obj.waiters.push(lease_no);
                        }
                        st.count("l2_loads", 1);
                        loads.push((key, slot.offset, bytes));
                    }
                    None => {
                        // Wait for space; the poll deadline bounds the wait.
                        st.count("retrieve_capacity_waits", 1);
                    }
                }
            }
            _ => {
                // No copy anywhere: proof of loss, the generation is retired.
                if let Some(lease) = st.retrieve_leases.get_mut(&lease_no) {
                    lease.failed = Some("lost_object");
                }
                if st.listed.contains_key(generation.as_str()) {
                    st.to_retire.push(Arc::from(generation.as_str()));
                    st.unlist_generation(&generation);
                }
                break;
            }
        }
    }
    loads
}

/// Runs `work` on an L2 I/O thread with the service and its tier, unless
/// the service is gone by the time it runs.
fn submit_l2_job(inner: &Arc<Inner>, work: impl FnOnce(&Arc<Inner>, &L2Tier) + Send + 'static) {
    let weak: Weak<Inner> = Arc::downgrade(inner);
    submit_io(
        inner,
        Box::new(move || {
            let Some(inner) = weak.upgrade() else {
                return;
            };
            let Some(l2) = inner.l2.clone() else {
                return;
            };
            work(&inner, &l2);
        }),
    );
}

/// A page length as `usize` (pages beyond the address space are refused).
fn page_len(len: u64) -> Result<usize> {
    usize::try_from(len).map_err(|_| Error::invalid("page too large for this platform"))
}

fn submit_load(inner: &Arc<Inner>, key: ObjectKey, offset: u64, len: u64) {
    submit_l2_job(inner, move |inner, l2| {
        // SAFETY: the slot belongs to an object in state Loading; no lease
        // exposes it and nothing else writes it until this job completes.
        let result = page_len(len)
            .and_then(|len| unsafe { inner.pool.slice_mut(offset, len) })
            .and_then(|buf| l2.read(&key, buf));
        let mut st = inner.state.lock();
        let waiters = match st.objects.get_mut(&key) {
            Some(obj) => {
                obj.io = obj.io.saturating_sub(1);
                std::mem::take(&mut obj.waiters)
            }
            None => Vec::new(),
        };
        match result {
            Ok(()) => {
                if let Some(obj) = st.objects.get_mut(&key) {
                    obj.l1 = L1::Ready;
                }
                st.touch(&key);
                for w in waiters {
                    let pos = st.retrieve_leases.get(&w).and_then(|l| {
                        l.keys
                            .iter()
                            .enumerate()
                            .position(|(i, k)| *k == key && !l.held[i])
                    });
                    if let Some(pos) = pos {
                        if let Some(obj) = st.objects.get_mut(&key) {
                            obj.readers += 1;
                        }
                        if let Some(lease) = st.retrieve_leases.get_mut(&w) {
                            lease.held[pos] = true;
                        }
                    }
                }
                // Its generations may have been retired (or its readers
                // cancelled) while it loaded: then nothing references it.
                st.maybe_reclaim(&key);
            }
            Err(e) => {
                let proof = matches!(
                    e,
                    Error::NotFound(_) | Error::Corrupt(_) | Error::UnsupportedFormat(_)
                );
                log::warn!("L2 read of {key:?} failed: {e}");
                st.drop_l1(&key);
                let reason = if proof {
                    "lost_object"
                } else {
                    "l2_read_error"
                };
                for w in &waiters {
                    if let Some(lease) = st.retrieve_leases.get_mut(w) {
                        lease.failed = Some(reason);
                    }
                }
                if proof {
                    st.count("l2_corrupt_or_missing", 1);
                    if let Some(obj) = st.objects.get_mut(&key) {
                        obj.l2 = L2::Absent;
                    }
                    st.queue_l2_delete(key);
                    st.retire_generations_of(&key);
                }
                st.maybe_reclaim(&key);
            }
        }
        drop(st);
        flush(inner);
        inner.changed.notify_all();
    });
}

fn submit_io(inner: &Arc<Inner>, job: Box<dyn FnOnce() + Send>) {
    let io = inner.io.lock();
    match io.as_ref() {
        Some(pool) => {
            if let Err(job) = pool.try_submit(job) {
                // Queue full: run it on this thread rather than drop it.
                drop(io);
                job();
            }
        }
        None => {
            drop(io);
            job();
        }
    }
}

fn submit_write(inner: &Arc<Inner>, key: ObjectKey, offset: u64, len: u64) {
    submit_l2_job(inner, move |inner, l2| {
        // SAFETY: the object is Ready (immutable) and its `io` count keeps the
        // slot from being freed or reused until this job has finished.
        let result = page_len(len)
            .and_then(|len| unsafe { inner.pool.slice(offset, len) })
            .and_then(|bytes| l2.write(&key, bytes));
        let mut st = inner.state.lock();
        st.l2_queued_bytes = st
            .l2_queued_bytes
            .saturating_sub(crate::store::l2::object_file_bytes(len));
        if let Some(obj) = st.objects.get_mut(&key) {
            obj.io = obj.io.saturating_sub(1);
        }
        match result {
            Ok(_) => st.mark_durable(&key),
            Err(e) => {
                log::warn!("L2 write of {key:?} failed: {e}");
                st.count("l2_write_errors", 1);
                if let Some(obj) = st.objects.get_mut(&key) {
                    obj.l2 = L2::Absent;
                }
            }
        }
        st.maybe_reclaim(&key);
        drop(st);
        flush(inner);
        inner.changed.notify_all();
    });
}

/// Performs the side effects queued in the state, outside its lock.
fn flush(inner: &Arc<Inner>) {
    flush_once(inner, true);
}

/// One round of side effects. When L2 is full, the first round evicts L2
/// objects (see [`State::evict_l2`]) and a second round writes what now fits.
fn flush_once(inner: &Arc<Inner>, may_evict: bool) {
    let mut evicted = false;
    let (writes, deletes, durable, retire) = {
        let mut st = inner.state.lock();
        let mut writes = Vec::new();
        let mut waiting = Vec::new();
        for key in std::mem::take(&mut st.l2_writes) {
            let planned = st.l2_queued_bytes;
            let fits = inner.l2.as_ref().is_some_and(|l2| {
                st.objects.get(&key).is_some_and(|o| {
                    l2.would_fit(planned + crate::store::l2::object_file_bytes(o.page_bytes))
                })
            });
            let Some(obj) = st.objects.get_mut(&key) else {
                continue;
            };
            if obj.l2 != L2::Absent || obj.l1 != L1::Ready {
                continue;
            }
            if !fits {
                waiting.push(key);
                continue;
            }
            if let Some(slot) = obj.slot {
                obj.l2 = L2::Queued;
                obj.io += 1;
                let bytes = obj.page_bytes;
                writes.push((key, slot.offset, bytes));
                st.l2_queued_bytes += crate::store::l2::object_file_bytes(bytes);
            }
        }
        if !waiting.is_empty() {
            if let Some(l2) = inner.l2.as_ref().filter(|_| may_evict) {
                let need: u64 = waiting
                    .iter()
                    .filter_map(|k| st.objects.get(k))
                    .map(|o| crate::store::l2::object_file_bytes(o.page_bytes))
                    .sum();
                let free = l2.capacity().map_or(u64::MAX, |cap| {
                    cap.saturating_sub(l2.used_bytes() + st.l2_queued_bytes)
                });
                evicted = st.evict_l2(need.saturating_sub(free), &waiting, |k| {
                    l2.file_bytes_of(k).unwrap_or(0)
                });
            }
            if evicted {
                st.l2_writes.extend(waiting);
            } else {
                st.count("l2_skipped_full", waiting.len() as u64);
            }
        }
        (
            writes,
            std::mem::take(&mut st.l2_deletes),
            std::mem::take(&mut st.newly_durable),
            std::mem::take(&mut st.to_retire),
        )
    };
    if !retire.is_empty() {
        let names: Vec<String> = retire.iter().map(|g| g.to_string()).collect();
        if let Err(e) = inner.dir.retire(&names) {
            log::error!("retiring {} generation(s) failed: {e}", names.len());
        }
    }
    if !durable.is_empty() {
        // Every generation that became durable since the last round, in one
        // synced directory transaction (group commit, see index/durability.rs).
        if let Err(e) = inner.dir.mark_durable(&durable) {
            log::warn!(
                "marking {} generation(s) durable failed: {e}",
                durable.len()
            );
        }
    }
    if let Some(l2) = &inner.l2 {
        for key in &deletes {
            if let Err(e) = l2.remove(key) {
                log::warn!("deleting L2 object {key:?} failed: {e}");
            }
        }
    }
    if !deletes.is_empty() {
        inner.state.lock().l2_deletes_done(&deletes);
        inner.changed.notify_all();
    }
    for (key, offset, len) in writes {
        submit_write(inner, key, offset, len);
    }
    if evicted {
        // The evicted files are deleted now: write what waited for space.
        flush_once(inner, false);
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<CheckpointService>();
}
