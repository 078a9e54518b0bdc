//! The in-memory state of the checkpoint service: the object table with its
//! reference counts, the L1 LRU, leases and pending generations.
//!
//! Everything here runs under the service's one mutex and never blocks: no
//! file I/O, no SQLite, no copies. Operations that need those queue what to
//! do ([`State::l2_writes`], [`State::l2_deletes`], [`State::loads`],
//! [`State::newly_durable`], [`State::to_retire`]); the lock guard
//! (`tiers::Locked`) performs it when it is released, so no caller can
//! forget to.
//!
//! An object's four counts (`refs`, `pins`, `readers`, `io`) are private to
//! this module: they change only through the methods of [`State`], which
//! also count every release ([`State::releases`]) so that the guard knows
//! when a store waiting for space should look again.
//!
//! Eviction follows the service's policy ([`Eviction`]): `lru` takes the
//! least recently used pages; `cost` ranks the listed generations by
//! [`cost::utility`] — recency blended with the compute a generation saves
//! per byte it alone holds ([`ListedGen::exclusive`], kept up to date as
//! generations are listed and unlisted) — and takes pages in the order of
//! the best generation naming each. Both take only what [`State::evict_for`]
//! and [`State::evict_l2`] may take; the policy decides the order, never
//! what is safe to drop.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use super::counters::{Counter, Counters};
use super::feed::{Feed, Kind, Tier};
use super::reclaim::Holder;
use crate::cost::{self, Eviction, Range};
use crate::protocol::MissReason;
use crate::store::ObjectKey;
use crate::store::alloc::{Slot as AllocSlot, SlotAllocator};

/// L1 state of an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L1 {
    /// Not resident in the SHM pool.
    Absent,
    /// A store lease is copying into its slot.
    Writing(u64),
    /// An L2 read is filling its slot.
    Loading,
    /// Committed bytes, readable.
    Ready,
}

/// L2 state of an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L2 {
    /// No file.
    Absent,
    /// A durable write is queued or running.
    Queued,
    /// On disk, fsynced, verified on every read.
    Durable,
}

/// One payload object.
#[derive(Debug)]
pub struct Obj {
    /// Bytes of the page.
    pub page_bytes: u64,
    /// Its L1 slot, when resident (or being written/loaded).
    pub slot: Option<AllocSlot>,
    /// L1 state.
    pub l1: L1,
    /// L2 state.
    pub l2: L2,
    /// Listed generations naming it.
    refs: u32,
    /// Pending generations pinning it (reused or freshly written pages).
    pins: u32,
    /// Retrieve leases holding it.
    readers: u32,
    /// Background I/O jobs reading or writing its bytes.
    io: u32,
    /// LRU tick of its L1 copy (0 = not in the LRU).
    pub tick: u64,
    /// Listed generations naming it (for retirement when its last copy goes).
    pub gens: Vec<Arc<str>>,
    /// Retrieve leases waiting for its load.
    pub waiters: Vec<u64>,
    /// The namespace of its verified copy in the shared tier, when it has
    /// one (imported from there, or uploaded by this host): an L1 copy of
    /// such an object may be dropped without retiring its generations, and
    /// a restore fetches it back (`service::shared`).
    pub remote: Option<Arc<str>>,
}

impl Obj {
    /// An object known only from its verified L2 file (start-up).
    pub fn on_disk(page_bytes: u64) -> Obj {
        Obj {
            page_bytes,
            slot: None,
            l1: L1::Absent,
            l2: L2::Durable,
            refs: 0,
            pins: 0,
            readers: 0,
            io: 0,
            tick: 0,
            gens: Vec::new(),
            waiters: Vec::new(),
            remote: None,
        }
    }

    /// An object known only from the shared tier (an imported generation
    /// names it; a restore fetches it into L1).
    #[cfg_attr(not(feature = "shared-tier"), allow(dead_code))]
    pub fn remote(page_bytes: u64, namespace: Arc<str>) -> Obj {
        Obj {
            l2: L2::Absent,
            remote: Some(namespace),
            ..Obj::on_disk(page_bytes)
        }
    }

    /// A fresh object being written by `lease` into `slot`.
    pub fn writing(page_bytes: u64, slot: AllocSlot, lease: u64) -> Obj {
        Obj {
            slot: Some(slot),
            l1: L1::Writing(lease),
            l2: L2::Absent,
            ..Obj::on_disk(page_bytes)
        }
    }

    /// Listed generations naming it.
    pub fn refs(&self) -> u32 {
        self.refs
    }

    /// Nothing holds it: no retrieve reader, no pin, no background I/O and
    /// no retrieve waiting for its load.
    pub fn idle(&self) -> bool {
        self.readers == 0 && self.pins == 0 && self.io == 0 && self.waiters.is_empty()
    }

    /// No pending generation pins it and no retrieve reads it.
    pub fn idle_holds(&self) -> bool {
        self.pins == 0 && self.readers == 0
    }

    /// No background I/O job reads or writes its bytes.
    pub fn idle_io(&self) -> bool {
        self.io == 0
    }

    /// Whether a store may reuse it without copying (committed somewhere).
    pub fn reusable(&self) -> bool {
        self.l1 == L1::Ready || self.l2 == L2::Durable
    }

    /// Nothing references or uses it: it can be deleted from every tier.
    pub fn unreferenced(&self) -> bool {
        self.refs == 0
            && self.pins == 0
            && self.readers == 0
            && self.io == 0
            && matches!(self.l1, L1::Absent | L1::Ready)
            && self.waiters.is_empty()
    }

    /// Its L1 copy may be dropped right now (nobody uses it).
    pub fn l1_idle(&self) -> bool {
        self.l1 == L1::Ready && self.readers == 0 && self.pins == 0 && self.io == 0
    }
}

/// Rank progress inside a pending generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankState {
    /// A store lease is out.
    Leased(u64),
    /// The rank's bytes are committed (acknowledged or being acknowledged).
    Committed,
}

/// A generation between BEGIN and publication, as the service sees it.
#[derive(Debug)]
pub struct PendingGen {
    /// Per rank progress.
    pub ranks: HashMap<u32, RankState>,
    /// One pin per entry (reused and freshly written pages of prepared ranks).
    pub pinned: Vec<ObjectKey>,
    /// Directory acknowledgements running outside the lock.
    pub acks_in_flight: u32,
    /// An abort arrived while acknowledgements were in flight.
    pub abort_requested: bool,
    /// Which staging of the generation this is (a generation aborted and
    /// begun again is a new staging; leases of the old one never join it).
    pub epoch: u64,
    /// Bytes its manifest holds in memory (counted in
    /// [`State::pending_bytes`] until it leaves).
    pub bytes: u64,
    /// Tokens its prefix covers.
    pub tokens: u64,
}

/// A live store lease.
#[derive(Debug)]
pub struct StoreLease {
    /// Internal lease number (owner tag of its Writing objects).
    pub number: u64,
    /// Generation being stored.
    pub generation: String,
    /// Rank storing.
    pub rank: u32,
    /// Objects this lease is writing (its slots).
    pub written: Vec<ObjectKey>,
    /// Bytes exposed for copying.
    pub bytes: u64,
    /// The process holding it (reclaimed when that process is gone).
    pub holder: Holder,
}

/// A live retrieve lease.
#[derive(Debug)]
pub struct RetrieveLease {
    /// Generation being restored.
    pub generation: String,
    /// Tokens the generation covers (counted as restored on rank 0's exposure).
    pub tokens: u64,
    /// Keys in group order, then position order.
    pub keys: Vec<ObjectKey>,
    /// Pages per group.
    pub group_sizes: Vec<usize>,
    /// Which keys this lease holds a reader on.
    pub held: Vec<bool>,
    /// Slots were returned to the worker (finish required).
    pub exposed: bool,
    /// The rank restoring (lease calls naming another rank are refused).
    pub rank: u32,
    /// Why it failed, if it did (reported by the next poll).
    pub failed: Option<MissReason>,
    /// Started, for the capacity wait bound.
    pub started: Instant,
    /// The process holding it (released when that process is gone).
    pub holder: Holder,
}

/// A listed generation's object set.
#[derive(Debug)]
pub struct ListedGen {
    /// All objects of all ranks.
    pub keys: Vec<ObjectKey>,
    /// How many of them are not yet durable in L2.
    pub not_durable: usize,
    /// The most durable tier its complete copy reached (the change feed's).
    pub tier: Tier,
    /// Tokens its prefix covers (what a restore of it saves).
    pub tokens: u64,
    /// Its recency: the state's tick when it was listed or last restored.
    pub tick: u64,
    /// Bytes of the objects no other listed generation names (what
    /// evicting it alone frees). Kept up to date by
    /// [`State::list_generation`] and [`State::unlist_generation`].
    pub exclusive: u64,
}

/// A page to fetch from the shared tier into its `Loading` slot.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "shared-tier"), allow(dead_code))]
pub struct Fetch {
    /// The object.
    pub key: ObjectKey,
    /// Its slot's offset in the pool.
    pub offset: u64,
    /// Its length.
    pub len: u64,
    /// The namespace its shared copy lives under.
    pub namespace: Arc<str>,
}

/// Everything under the service mutex.
#[derive(Debug)]
pub struct State {
    pub objects: HashMap<ObjectKey, Obj>,
    /// L1-resident objects by LRU tick (oldest first).
    pub lru: BTreeMap<u64, ObjectKey>,
    pub tick: u64,
    pub alloc: SlotAllocator,
    pub store_leases: HashMap<u64, StoreLease>,
    pub store_ranks: HashSet<(String, u32)>,
    pub retrieve_leases: HashMap<u64, RetrieveLease>,
    pub pending: HashMap<String, PendingGen>,
    /// Manifest bytes of the pending generations (and of begins between
    /// their check and their record), bounded by `max_pending_bytes`.
    pub pending_bytes: u64,
    pub listed: HashMap<Arc<str>, ListedGen>,
    /// Event and miss counts.
    pub counters: Counters,
    /// Holds released so far (pins, readers, I/O, slots, stagings): the
    /// lock guard wakes stores waiting for space when it moved.
    pub releases: u64,
    pub next_lease: u64,
    /// Epoch of the next staged generation.
    pub next_epoch: u64,
    /// Keys the lease-id tags (drawn at start; see [`State::new_lease_id`]).
    pub lease_secret: [u8; 32],
    pub accepting: bool,
    /// L2 files to delete (unreferenced objects), drained by the caller.
    pub l2_deletes: Vec<ObjectKey>,
    /// Keys whose L2 delete is queued or running (a count per key). A store
    /// must not recreate such a key until the delete is done: it would find
    /// the old file, skip its write and lose its only disk copy.
    pub deleting: HashMap<ObjectKey, u32>,
    /// Objects whose L2 write must be queued, drained by the caller.
    pub l2_writes: Vec<ObjectKey>,
    /// Generations whose last object became durable, drained by the caller.
    pub newly_durable: Vec<Arc<str>>,
    /// Generations to retire in the directory, drained by the caller.
    pub to_retire: Vec<Arc<str>>,
    /// L2 loads to start (key, slot offset, length), drained by the caller.
    pub loads: Vec<(ObjectKey, u64, u64)>,
    /// Shared-tier fetches to start, drained by the caller.
    pub fetches: Vec<Fetch>,
    /// Generations to upload to the shared tier, drained by the caller
    /// (published ones when there is no L2; with L2 the durable ones go).
    pub to_upload: Vec<Arc<str>>,
    /// The change feed: every listing, tier reached and unlisting, in order.
    pub feed: Feed,
    /// The eviction policy.
    pub eviction: Eviction,
}

impl State {
    pub fn new(
        alloc: SlotAllocator,
        lease_secret: [u8; 32],
        feed: Feed,
        eviction: Eviction,
    ) -> State {
        State {
            objects: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            alloc,
            store_leases: HashMap::new(),
            store_ranks: HashSet::new(),
            retrieve_leases: HashMap::new(),
            pending: HashMap::new(),
            pending_bytes: 0,
            listed: HashMap::new(),
            counters: Counters::default(),
            releases: 0,
            next_lease: 1,
            next_epoch: 1,
            lease_secret,
            accepting: true,
            l2_deletes: Vec::new(),
            deleting: HashMap::new(),
            l2_writes: Vec::new(),
            newly_durable: Vec::new(),
            to_retire: Vec::new(),
            loads: Vec::new(),
            fetches: Vec::new(),
            to_upload: Vec::new(),
            feed,
            eviction,
        }
    }

    /// Adds `by` to an event counter.
    pub fn count(&mut self, counter: Counter, by: u64) {
        self.counters.add(counter, by);
    }

    /// Counts a miss and returns the lease that reports it.
    pub fn miss(&mut self, reason: MissReason) -> crate::protocol::Lease {
        self.counters.miss(reason);
        crate::protocol::Lease::miss(reason)
    }

    /// Whether side effects wait to be performed outside the lock.
    pub fn has_side_effects(&self) -> bool {
        !(self.l2_writes.is_empty()
            && self.l2_deletes.is_empty()
            && self.newly_durable.is_empty()
            && self.to_retire.is_empty()
            && self.loads.is_empty()
            && self.fetches.is_empty()
            && self.to_upload.is_empty())
    }

    /// What tells a waiting store that space may have come free: the
    /// allocator's changes and the holds released.
    pub fn wake_token(&self) -> (u64, u64) {
        (self.alloc.change_generation(), self.releases)
    }

    /// Pins an object for a pending generation (a reused or written page).
    pub fn pin(&mut self, key: &ObjectKey) {
        if let Some(obj) = self.objects.get_mut(key) {
            obj.pins += 1;
        }
    }

    /// Drops one pin (the object is not reclaimed here: see [`State::maybe_reclaim`]).
    pub fn unpin(&mut self, key: &ObjectKey) {
        if let Some(obj) = self.objects.get_mut(key) {
            obj.pins = obj.pins.saturating_sub(1);
            self.releases += 1;
        }
    }

    /// Adds a retrieve reader to an object.
    pub fn add_reader(&mut self, key: &ObjectKey) {
        if let Some(obj) = self.objects.get_mut(key) {
            obj.readers += 1;
        }
    }

    /// Drops a retrieve reader (the object is not reclaimed here).
    pub fn drop_reader(&mut self, key: &ObjectKey) {
        if let Some(obj) = self.objects.get_mut(key) {
            obj.readers = obj.readers.saturating_sub(1);
            self.releases += 1;
        }
    }

    /// Notes a background I/O job on an object's bytes (its slot stays).
    pub fn start_io(&mut self, key: &ObjectKey) {
        if let Some(obj) = self.objects.get_mut(key) {
            obj.io += 1;
        }
    }

    /// Notes the end of a background I/O job on an object.
    pub fn end_io(&mut self, key: &ObjectKey) {
        if let Some(obj) = self.objects.get_mut(key) {
            obj.io = obj.io.saturating_sub(1);
            self.releases += 1;
        }
    }

    /// Ends a load into `key`'s slot (from L2 or the shared tier) and takes
    /// the retrieve leases waiting for it, to be handed the page or failed.
    pub fn end_load(&mut self, key: &ObjectKey) -> Vec<u64> {
        self.end_io(key);
        self.objects
            .get_mut(key)
            .map(|obj| std::mem::take(&mut obj.waiters))
            .unwrap_or_default()
    }

    /// Unlists what a publication displaced: the generation it replaced and
    /// those the directory evicted for room (counted as evictions).
    pub fn unlist_displaced(&mut self, publication: &crate::index::Publication) {
        if let Some(old) = &publication.replaced {
            self.unlist_generation(old);
        }
        for evicted in &publication.evicted {
            self.unlist_generation(evicted);
            self.count(Counter::Evictions, 1);
        }
    }

    /// Records an object a store lease writes into `slot`, pinned once for
    /// its pending generation (a record without bytes is rewritten).
    pub fn insert_writing(&mut self, key: ObjectKey, page_bytes: u64, slot: AllocSlot, lease: u64) {
        match self.objects.get_mut(&key) {
            Some(obj) => {
                obj.slot = Some(slot);
                obj.l1 = L1::Writing(lease);
                obj.page_bytes = page_bytes;
                obj.pins += 1;
            }
            None => {
                let mut obj = Obj::writing(page_bytes, slot, lease);
                obj.pins = 1;
                self.objects.insert(key, obj);
            }
        }
    }

    /// A new lease number and its public id: 32 hex characters, the number
    /// and a tag only this service can compute (a keyed hash of the number
    /// under a secret drawn at start). The id is the lease's capability: it
    /// cannot be guessed from other ids, so a call that names no rank still
    /// comes from whoever was handed the lease.
    pub fn new_lease_id(&mut self) -> (u64, String) {
        let n = self.next_lease;
        self.next_lease += 1;
        (n, format!("{n:016x}{:016x}", self.lease_tag(n)))
    }

    /// Parses a public lease id back to its number (None = not ours: a
    /// wrong tag, an id of an earlier run, or not an id).
    pub fn lease_number(&self, id: &str) -> Option<u64> {
        if id.len() != 32 || !id.is_ascii() {
            return None;
        }
        let n = u64::from_str_radix(&id[..16], 16).ok()?;
        let tag = u64::from_str_radix(&id[16..], 16).ok()?;
        (tag == self.lease_tag(n)).then_some(n)
    }

    /// The tag of lease number `n` (SHA-256 of the secret and `n`).
    fn lease_tag(&self, n: u64) -> u64 {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(self.lease_secret);
        h.update(n.to_le_bytes());
        let digest = h.finalize();
        let mut tag = [0u8; 8];
        tag.copy_from_slice(&digest[..8]);
        u64::from_le_bytes(tag)
    }

    pub fn live_leases(&self) -> usize {
        self.store_ranks.len() + self.retrieve_leases.len()
    }

    /// Makes an object's L1 copy readable (written or loaded), most recently used.
    pub fn set_ready(&mut self, key: &ObjectKey) {
        if let Some(obj) = self.objects.get_mut(key) {
            obj.l1 = L1::Ready;
            self.releases += 1;
        }
        self.touch(key);
    }

    /// Moves an L1-resident object to the MRU end.
    pub fn touch(&mut self, key: &ObjectKey) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(obj) = self.objects.get_mut(key) {
            if obj.tick != 0 {
                self.lru.remove(&obj.tick);
            }
            obj.tick = tick;
            self.lru.insert(tick, *key);
        }
    }

    /// Frees an object's L1 slot (keeping the record).
    pub fn drop_l1(&mut self, key: &ObjectKey) -> u64 {
        let Some(obj) = self.objects.get_mut(key) else {
            return 0;
        };
        if obj.tick != 0 {
            self.lru.remove(&obj.tick);
            obj.tick = 0;
        }
        obj.l1 = L1::Absent;
        match obj.slot.take() {
            Some(slot) => {
                let reserved = slot.reserved;
                if let Err(e) = self.alloc.free(slot) {
                    log::error!("freeing an L1 slot failed (accounting bug): {e}");
                }
                reserved
            }
            None => 0,
        }
    }

    /// Queues the deletion of an object's L2 file (fenced until done).
    pub fn queue_l2_delete(&mut self, key: ObjectKey) {
        *self.deleting.entry(key).or_insert(0) += 1;
        self.l2_deletes.push(key);
    }

    /// Records that queued L2 deletes were performed.
    pub fn l2_deletes_done(&mut self, keys: &[ObjectKey]) {
        for key in keys {
            if let Some(n) = self.deleting.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    self.deleting.remove(key);
                }
            }
        }
    }

    /// Deletes an object from every tier if nothing references it.
    pub fn maybe_reclaim(&mut self, key: &ObjectKey) -> bool {
        let unreferenced = self.objects.get(key).is_some_and(Obj::unreferenced);
        if !unreferenced {
            return false;
        }
        self.drop_l1(key);
        if let Some(obj) = self.objects.remove(key) {
            if obj.l2 != L2::Absent {
                self.queue_l2_delete(*key);
            }
            self.count(Counter::ReclaimedObjects, 1);
        }
        true
    }

    /// Registers a newly listed generation of `tokens` tokens: its pins
    /// become references; it is the most recently used generation.
    pub fn list_generation(&mut self, generation: &str, keys: Vec<ObjectKey>, tokens: u64) {
        let name: Arc<str> = Arc::from(generation);
        let mut not_durable = 0;
        let mut exclusive = 0;
        for key in &keys {
            if let Some(obj) = self.objects.get_mut(key) {
                if obj.refs == 1 {
                    // Its one generation shares it from now on.
                    if let Some(info) = obj.gens.first().and_then(|g| self.listed.get_mut(g)) {
                        info.exclusive = info.exclusive.saturating_sub(obj.page_bytes);
                    }
                }
                obj.refs += 1;
                obj.gens.push(name.clone());
                if obj.refs == 1 {
                    exclusive += obj.page_bytes;
                }
                if obj.l2 != L2::Durable {
                    not_durable += 1;
                }
            }
        }
        if not_durable == 0 && !keys.is_empty() {
            self.newly_durable.push(name.clone());
        }
        let shared = !keys.is_empty()
            && keys
                .iter()
                .all(|k| self.objects.get(k).is_some_and(|o| o.remote.is_some()));
        let tier = if shared {
            Tier::Shared
        } else if not_durable == 0 && !keys.is_empty() {
            Tier::L2
        } else {
            Tier::L1
        };
        self.feed.record(&name, Kind::Listed(tier));
        self.tick += 1;
        let info = ListedGen {
            keys,
            not_durable,
            tier,
            tokens,
            tick: self.tick,
            exclusive,
        };
        self.listed.insert(name, info);
    }

    /// A listed generation's complete copy reached `tier`: recorded in the
    /// change feed when it is more durable than the one it had.
    pub fn set_tier(&mut self, generation: &str, tier: Tier) {
        let Some((name, info)) = self.listed.get_key_value(generation) else {
            return;
        };
        if tier <= info.tier {
            return;
        }
        let name = name.clone();
        if let Some(info) = self.listed.get_mut(generation) {
            info.tier = tier;
        }
        self.feed.record(&name, Kind::Tier(tier));
    }

    /// The tier of a listed generation (None: not listed).
    pub fn tier_of(&self, generation: &str) -> Option<Tier> {
        self.listed.get(generation).map(|g| g.tier)
    }

    /// Makes a listed generation the most recently used (a restore of it).
    pub fn touch_generation(&mut self, generation: &str) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(info) = self.listed.get_mut(generation) {
            info.tick = tick;
        }
    }

    /// Drops a listed generation's references; reclaims what becomes unreferenced.
    pub fn unlist_generation(&mut self, generation: &str) -> bool {
        let Some((name, gen_info)) = self.listed.remove_entry(generation) else {
            return false;
        };
        self.feed.record(&name, Kind::Unlisted);
        for key in &gen_info.keys {
            if let Some(obj) = self.objects.get_mut(key) {
                obj.refs = obj.refs.saturating_sub(1);
                self.releases += 1;
                if let Some(pos) = obj
                    .gens
                    .iter()
                    .position(|g| Arc::ptr_eq(g, &name) || **g == *name)
                {
                    obj.gens.swap_remove(pos);
                }
                if obj.refs == 1 {
                    // Its one remaining generation holds it alone now.
                    if let Some(info) = obj.gens.first().and_then(|g| self.listed.get_mut(g)) {
                        info.exclusive += obj.page_bytes;
                    }
                }
            }
        }
        for key in &gen_info.keys {
            self.maybe_reclaim(key);
        }
        true
    }

    /// Forgets a pending generation (its pins are the caller's), returning
    /// its manifest bytes to the pending budget.
    pub fn remove_pending(&mut self, generation: &str) -> Option<PendingGen> {
        let pg = self.pending.remove(generation)?;
        self.pending_bytes = self.pending_bytes.saturating_sub(pg.bytes);
        Some(pg)
    }

    /// Releases every pin of a pending generation and forgets it.
    pub fn release_pending(&mut self, generation: &str) {
        let Some(pg) = self.remove_pending(generation) else {
            return;
        };
        self.releases += 1;
        for key in &pg.pinned {
            self.unpin(key);
        }
        for key in &pg.pinned {
            self.maybe_reclaim(key);
        }
    }

    /// Marks an object durable and updates its generations.
    pub fn mark_durable(&mut self, key: &ObjectKey) {
        let Some(obj) = self.objects.get_mut(key) else {
            return;
        };
        if obj.l2 == L2::Durable {
            return;
        }
        obj.l2 = L2::Durable;
        self.releases += 1;
        let gens = obj.gens.clone();
        for g in gens {
            if let Some(info) = self.listed.get_mut(&g) {
                info.not_durable = info.not_durable.saturating_sub(1);
                if info.not_durable == 0 {
                    self.newly_durable.push(g.clone());
                    self.set_tier(&g, Tier::L2);
                }
            }
        }
    }

    /// Retires every listed generation naming `key` (its last copy is going).
    pub fn retire_generations_of(&mut self, key: &ObjectKey) -> usize {
        let gens = self
            .objects
            .get(key)
            .map(|o| o.gens.clone())
            .unwrap_or_default();
        for g in &gens {
            self.to_retire.push(g.clone());
            self.unlist_generation(g);
        }
        gens.len()
    }

    /// Whether [`State::evict_for`] may take this object's L1 copy.
    fn evictable(obj: &Obj, retire_ok: bool) -> bool {
        obj.l1_idle()
            && obj.waiters.is_empty()
            && (obj.refs == 0
                || obj.l2 == L2::Durable
                || obj.remote.is_some()
                || (retire_ok && obj.l2 == L2::Absent))
    }

    /// Records an object an imported generation names: a new one is known
    /// only from the shared tier; one already here learns it has a shared
    /// copy too. Pinned once until the import lists (or drops) it.
    #[cfg_attr(not(feature = "shared-tier"), allow(dead_code))]
    pub fn insert_remote(&mut self, key: ObjectKey, page_bytes: u64, namespace: &Arc<str>) {
        let obj = self
            .objects
            .entry(key)
            .or_insert_with(|| Obj::remote(page_bytes, namespace.clone()));
        if obj.remote.is_none() {
            obj.remote = Some(namespace.clone());
        }
        obj.pins += 1;
    }

    /// Bytes of the pool [`State::evict_for_sparing`] could free at most
    /// without the objects in `spare`.
    pub fn evictable_bytes_sparing(&self, retire_ok: bool, spare: &HashSet<ObjectKey>) -> u64 {
        self.lru
            .values()
            .filter(|key| !spare.contains(*key))
            .filter_map(|key| self.objects.get(key))
            .filter(|obj| Self::evictable(obj, retire_ok))
            .filter_map(|obj| obj.slot.map(|s| s.reserved))
            .sum()
    }

    /// Evicts L1 copies until `needed` bytes can be allocated: oldest first
    /// (`lru`), or in [`State::cost_order`] (`cost`).
    ///
    /// Takes only idle objects: durable ones lose their L1 copy; unreferenced
    /// ones are deleted; when `retire_ok`, an object whose only copy is L1
    /// takes its generations with it (they are retired in the same step).
    pub fn evict_for(&mut self, needed: u64, retire_ok: bool) -> bool {
        self.evict_for_sparing(needed, retire_ok, &HashSet::new())
    }

    /// [`State::evict_for`] that never takes the objects in `spare` (a
    /// store's pages whose only copy is L1: room taken from one of them
    /// would have to be given back to it).
    pub fn evict_for_sparing(
        &mut self,
        needed: u64,
        retire_ok: bool,
        spare: &HashSet<ObjectKey>,
    ) -> bool {
        if self.alloc.largest_free() >= needed {
            return true;
        }
        let candidates: Vec<ObjectKey> = match self.eviction {
            Eviction::Lru => self.lru.values().copied().collect(),
            Eviction::Cost => self.cost_order(retire_ok),
        };
        for key in candidates {
            if self.alloc.largest_free() >= needed {
                break;
            }
            if !spare.contains(&key) {
                self.evict_one(&key, retire_ok);
            }
        }
        self.alloc.largest_free() >= needed
    }

    /// Under `cost`, evicts L1 copies ([`State::cost_order`]) until
    /// `needed` bytes are free in all, sparing the objects in `spare` (the
    /// caller's own pages): a whole store's or load's pages at once, one
    /// ranking instead of one per page. Under `lru` nothing (its pages
    /// evict one by one, through [`State::evict_for`]).
    pub fn make_room(&mut self, needed: u64, retire_ok: bool, spare: &HashSet<ObjectKey>) {
        if self.eviction != Eviction::Cost || self.alloc.available() >= needed {
            return;
        }
        for key in self.cost_order(retire_ok) {
            if self.alloc.available() >= needed {
                break;
            }
            if !spare.contains(&key) {
                self.evict_one(&key, retire_ok);
            }
        }
    }

    /// Evicts one object's L1 copy if it may go (see [`State::evict_for`]).
    fn evict_one(&mut self, key: &ObjectKey, retire_ok: bool) {
        let Some(obj) = self.objects.get(key) else {
            return;
        };
        if !Self::evictable(obj, retire_ok) {
            return;
        }
        if obj.refs == 0 {
            self.maybe_reclaim(key);
            self.count(Counter::L1Evictions, 1);
        } else if obj.l2 == L2::Durable || obj.remote.is_some() {
            self.drop_l1(key);
            self.count(Counter::L1Evictions, 1);
        } else if retire_ok && obj.l2 == L2::Absent {
            self.retire_generations_of(key);
            self.count(Counter::L1Evictions, 1);
            self.count(Counter::Evictions, 1);
        }
    }

    /// The utility of every listed generation ([`cost::utility`]: recency
    /// and compute saved per byte it alone holds, each normalised over the
    /// listed generations).
    fn utilities(&self) -> HashMap<&str, f64> {
        let effs: Vec<(&str, f64, f64)> = self
            .listed
            .iter()
            .map(|(g, info)| {
                let eff = cost::log_efficiency(info.tokens, info.exclusive);
                (&**g, info.tick as f64, eff)
            })
            .collect();
        let recencies = Range::of(effs.iter().map(|e| e.1));
        let efficiencies = Range::of(effs.iter().map(|e| e.2));
        effs.into_iter()
            .map(|(g, tick, eff)| (g, cost::utility(tick, eff, &recencies, &efficiencies)))
            .collect()
    }

    /// An object's rank under `cost`: the best utility among the
    /// generations naming it (−∞ when none does), so that a page stays as
    /// long as its most useful generation.
    fn object_utility(obj: &Obj, utilities: &HashMap<&str, f64>) -> f64 {
        obj.gens
            .iter()
            .filter_map(|g| utilities.get(&**g).copied())
            .fold(f64::NEG_INFINITY, f64::max)
    }

    /// The L1 copies [`State::evict_for`] may take, in the order `cost`
    /// takes them: unreferenced objects first, then copies whose bytes stay
    /// in L2 or the shared tier, then the only copies (which retire their
    /// generations); within each, lowest [`State::object_utility`] first,
    /// then those fewer generations name (a generation's own pages before
    /// the ones it shares), least recently used among equals.
    pub fn cost_order(&self, retire_ok: bool) -> Vec<ObjectKey> {
        let utilities = self.utilities();
        let mut ranked: Vec<(u8, f64, u32, u64, ObjectKey)> = self
            .lru
            .values()
            .filter_map(|key| self.objects.get(key).map(|obj| (key, obj)))
            .filter(|(_, obj)| Self::evictable(obj, retire_ok))
            .map(|(key, obj)| {
                let class = if obj.refs == 0 {
                    0
                } else if obj.l2 == L2::Durable || obj.remote.is_some() {
                    1
                } else {
                    2
                };
                let utility = Self::object_utility(obj, &utilities);
                (class, utility, obj.refs, obj.tick, *key)
            })
            .collect();
        ranked.sort_by(|a, b| {
            a.0.cmp(&b.0)
                .then(a.1.total_cmp(&b.1))
                .then(a.2.cmp(&b.2))
                .then(a.3.cmp(&b.3))
        });
        ranked.into_iter().map(|r| r.4).collect()
    }

    /// Frees at least `needed` bytes of L2 for the objects in `waiting`:
    /// under `lru`, idle durable objects go first if they have no RAM copy,
    /// then in L1 LRU order; under `cost`, lowest [`State::object_utility`]
    /// first (unreferenced objects before all), a generation's own pages
    /// before the ones it shares, then in L1 LRU order. A
    /// victim's generations are retired with it (their only durable copy
    /// goes), and whatever becomes unreferenced is deleted from both tiers.
    /// Returns whether anything was evicted. O(objects), and runs only when
    /// L2 is full.
    pub fn evict_l2(
        &mut self,
        needed: u64,
        waiting: &[ObjectKey],
        file_bytes: impl Fn(&ObjectKey) -> u64,
    ) -> bool {
        if needed == 0 {
            return true;
        }
        // Never evict a generation to make room for its own objects.
        let protected: Vec<Arc<str>> = waiting
            .iter()
            .filter_map(|k| self.objects.get(k))
            .flat_map(|o| o.gens.iter().cloned())
            .collect();
        let utilities = match self.eviction {
            Eviction::Lru => HashMap::new(),
            Eviction::Cost => self.utilities(),
        };
        let mut victims: Vec<(f64, u32, u64, ObjectKey)> = self
            .objects
            .iter()
            .filter(|(_, o)| !o.gens.iter().any(|g| protected.contains(g)))
            .filter(|(k, o)| {
                o.l2 == L2::Durable
                    && o.idle()
                    && matches!(o.l1, L1::Absent | L1::Ready)
                    && !waiting.contains(k)
            })
            .map(|(k, o)| match self.eviction {
                // Oldest first (a page without an L1 copy has tick 0).
                Eviction::Lru => (0.0, 0, o.tick, *k),
                // Least useful first; a generation's own pages before the
                // ones it shares.
                Eviction::Cost => (Self::object_utility(o, &utilities), o.refs, o.tick, *k),
            })
            .collect();
        victims.sort_unstable_by(|a, b| {
            a.0.total_cmp(&b.0)
                .then(a.1.cmp(&b.1))
                .then(a.2.cmp(&b.2))
                .then(a.3.cmp(&b.3))
        });
        let mut freed = 0;
        let mut any = false;
        for (_, _, _, key) in victims {
            if freed >= needed {
                break;
            }
            if !self.objects.contains_key(&key) {
                continue; // reclaimed with an earlier victim's generation
            }
            let before = self.l2_deletes.len();
            if self.objects.get(&key).is_some_and(|o| o.refs > 0) {
                self.retire_generations_of(&key);
                self.count(Counter::Evictions, 1);
            }
            self.maybe_reclaim(&key);
            let gone: u64 = self.l2_deletes[before..].iter().map(&file_bytes).sum();
            if gone > 0 {
                any = true;
                freed += gone;
                self.count(Counter::L2Evictions, 1);
            }
        }
        any
    }

    /// Pins plus readers over every object (status `pins`).
    pub fn pins_total(&self) -> u64 {
        self.objects
            .values()
            .map(|o| u64::from(o.pins) + u64::from(o.readers))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> ObjectKey {
        ObjectKey([n; 32])
    }

    /// A state over a 64-page pool with `pages` ready, unreferenced objects.
    fn state(eviction: Eviction, pages: &[u8]) -> State {
        let mut st = State::new(
            SlotAllocator::new(64 * 4096).unwrap(),
            [0; 32],
            Feed::new("test".into(), 16),
            eviction,
        );
        for &n in pages {
            let slot = st.alloc.alloc(4096).unwrap();
            st.insert_writing(key(n), 4096, slot, 1);
            st.unpin(&key(n));
            st.set_ready(&key(n));
        }
        st
    }

    #[test]
    fn exclusive_bytes_follow_listing_and_unlisting() {
        let mut st = state(Eviction::Cost, &[1, 2, 3, 4]);
        st.list_generation("a", vec![key(1), key(2)], 128);
        assert_eq!(st.listed["a"].exclusive, 2 * 4096);
        // b shares page 2 with a: neither holds it alone.
        st.list_generation("b", vec![key(2), key(3), key(4)], 192);
        assert_eq!(st.listed["a"].exclusive, 4096);
        assert_eq!(st.listed["b"].exclusive, 2 * 4096);
        // With a gone, b holds page 2 alone again.
        st.unlist_generation("a");
        assert_eq!(st.listed["b"].exclusive, 3 * 4096);
        assert!(
            !st.objects.contains_key(&key(1)),
            "a's own page was reclaimed"
        );
    }

    #[test]
    fn cost_takes_the_least_useful_generations_own_pages_first_and_shared_ones_last() {
        let mut st = state(Eviction::Cost, &[1, 2, 3, 4, 5, 6]);
        // old: 64 tokens on two pages, one (2) shared with long; long: 4096
        // tokens; newest: 64 tokens; 6 unreferenced.
        st.list_generation("old", vec![key(1), key(2)], 64);
        st.list_generation("long", vec![key(2), key(3), key(4)], 4096);
        st.list_generation("newest", vec![key(5)], 64);
        let order = st.cost_order(true);
        assert_eq!(order[0], key(6), "unreferenced first");
        let pos = |n: u8| order.iter().position(|k| *k == key(n)).unwrap();
        assert!(pos(1) < pos(5), "old before the newest of the same worth");
        assert!(
            pos(5) < pos(3) && pos(5) < pos(4),
            "the long one is worth more"
        );
        assert!(
            pos(2) >= pos(3).min(pos(4)),
            "a shared page ranks as its best generation"
        );
        // LRU takes the oldest page first, whatever names it.
        st.eviction = Eviction::Lru;
        assert!(st.evict_for(64 * 4096 - 4096, true));
        assert!(st.listed.is_empty(), "lru emptied the pool");
    }

    #[test]
    fn make_room_spares_the_callers_pages_and_never_runs_under_lru() {
        let mut st = state(Eviction::Lru, &[1, 2]);
        st.list_generation("a", vec![key(1)], 64);
        st.list_generation("b", vec![key(2)], 64);
        let spare: HashSet<ObjectKey> = [key(1)].into_iter().collect();
        let need = st.alloc.capacity();
        st.make_room(need, true, &spare);
        assert_eq!(st.listed.len(), 2, "lru evicts page by page, not here");
        st.eviction = Eviction::Cost;
        st.make_room(need, true, &spare);
        assert!(st.listed.contains_key("a") && !st.listed.contains_key("b"));
    }
}
