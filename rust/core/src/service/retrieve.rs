//! The retrieve path: `find` a candidate, lease one rank's pages
//! (`begin_retrieve`), wait while pages load from L2 (`poll_retrieve`), and
//! end the lease (`finish_retrieve`, or `cancel_retrieve` before exposure).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Inner;
use super::counters::Counter;
use super::load_figures::Figures;
use super::reclaim::Holder;
use super::state::{Fetch, L1, L2, RetrieveLease, State};
use super::store::check_rank;
use crate::cost::Eviction;
use crate::error::{Error, Result};
use crate::identity::Prefix;
use crate::manifest::Manifest;
use crate::protocol::{Lease, Located, MissReason, TierLoad};
use crate::store::ObjectKey;
use crate::store::object_keys;

/// The longest listed generation whose prefix is a whole-token prefix of
/// the query. A candidate only: every rank must still retrieve it.
/// With a shared tier, a local miss (or a local hit shorter than a query
/// root) asks it too, within its lookup timeout, and imports what it finds
/// (`service::shared`).
pub(super) fn find(inner: &Arc<Inner>, roots: &[Prefix]) -> Result<Option<Manifest>> {
    let found = inner.dir.find(roots)?;
    #[cfg(feature = "shared-tier")]
    let found = super::shared::find(inner, roots, found);
    let counter = match &found {
        Some(_) => Counter::FindHits,
        None => Counter::FindMisses,
    };
    inner.lock().count(counter, 1);
    Ok(found)
}

/// [`find`], and where the found checkpoint's pages sit: per tier (L1,
/// L2, shared; only tiers holding any) its pages and bytes over every rank
/// and the service's measured load figures for that tier (`load_figures`). A page
/// being written or loaded counts as L1 (a load already started is not
/// paid again); a page with no copy anywhere is not counted (its restore
/// misses). The pages are the listed generation's objects, read under one
/// lock: nothing is hashed. A generation retired since `find` answered
/// (a race) has no tiers.
pub(super) fn find_located(inner: &Arc<Inner>, roots: &[Prefix]) -> Result<Option<Located>> {
    let Some(manifest) = find(inner, roots)? else {
        return Ok(None);
    };
    // pages and bytes per tier: L1, L2, shared
    let mut held = [(0u64, 0u64); 3];
    {
        let st = inner.lock();
        if let Some(listed) = st.listed.get(manifest.generation()) {
            for key in &listed.keys {
                let Some(obj) = st.objects.get(key) else {
                    continue;
                };
                let tier = match (obj.l1, obj.l2) {
                    (L1::Ready | L1::Loading | L1::Writing(_), _) => 0,
                    (L1::Absent, L2::Durable) => 1,
                    (L1::Absent, _) if obj.remote.is_some() => 2,
                    _ => continue,
                };
                held[tier].0 += 1;
                held[tier].1 += obj.page_bytes;
            }
        }
    }
    let threads = |n: usize| u32::try_from(n.max(1)).unwrap_or(u32::MAX);
    let fetch_threads = inner.config.shared.as_ref().map_or(1, |s| s.fetch_threads);
    let figures = [
        ("l1", Figures::default(), 1),
        (
            "l2",
            inner.meters.l2.figures(),
            threads(inner.config.l2_io_threads),
        ),
        (
            "shared",
            inner.meters.shared.figures(),
            threads(fetch_threads),
        ),
    ];
    let tiers = held
        .iter()
        .zip(figures)
        .filter(|((pages, _), _)| *pages > 0)
        .map(|(&(pages, bytes), (tier, f, parallelism))| TierLoad {
            tier: tier.to_string(),
            pages,
            bytes,
            samples: f.samples,
            latency_us: f.latency_us,
            bytes_per_s: f.bytes_per_s,
            parallelism,
        })
        .collect();
    Ok(Some(Located { manifest, tiers }))
}

/// Starts restoring one rank of a listed generation. Answers `ready` with
/// the slots when every page of the rank is resident in L1 (no poll round
/// trip: the lease is exposed, finish it after the copy), `pending` with a
/// lease id while pages load (poll it) or `miss` (unlisted, retired, no
/// budget, a page proven lost). The lease is held by `holder` (released if
/// that process dies).
pub(super) fn begin_retrieve(
    inner: &Arc<Inner>,
    holder: &Holder,
    manifest: &Manifest,
    rank: u32,
) -> Result<Lease> {
    let keys = rank_keys(inner, manifest, rank)?;
    let groups = &keys.groups;
    let listed = inner.dir.get(manifest.generation())?;
    let mut st = inner.lock();
    if listed.as_ref() != Some(manifest) || !st.listed.contains_key(manifest.generation()) {
        return Ok(st.miss(MissReason::NotListed));
    }
    if !st.accepting {
        return Ok(st.miss(MissReason::Shutdown));
    }
    if st.live_leases() >= inner.config.max_leases {
        return Ok(st.miss(MissReason::LeaseBudget));
    }
    let (lease_no, lease_id) = st.new_lease_id();
    let keys: Vec<ObjectKey> = groups.iter().flatten().copied().collect();
    let n = keys.len();
    st.retrieve_leases.insert(
        lease_no,
        RetrieveLease {
            generation: manifest.generation().to_string(),
            tokens: manifest.prefix().num_tokens(),
            keys,
            group_sizes: groups.iter().map(Vec::len).collect(),
            held: vec![false; n],
            exposed: false,
            rank,
            failed: None,
            started: Instant::now(),
            holder: holder.clone(),
        },
    );
    st.touch_generation(manifest.generation());
    advance_retrieve(&mut st, lease_no);
    settle(inner, &mut st, lease_no, &lease_id)
}

/// The object keys of recent stores and restores, per manifest and rank: a
/// rank that restores a generation it stored or restored recently (a hot
/// prefix), or asks prepare_store again after *busy*, skips the payload
/// parse and the key hashing, which cost about 0.4 µs per page — the
/// per-page work is done once per manifest and rank. Keys are a pure
/// function of the manifest and the rank, and an entry is used only for a
/// manifest equal to its own in full, so a different manifest under the
/// same generation id is never served another's keys (and still fails the
/// directory check). Bounded by entries and bytes; the oldest goes first.
#[derive(Default)]
pub(super) struct KeyCache {
    entries: VecDeque<(Manifest, u32, Arc<RankKeys>)>,
    /// Payload and key bytes held.
    bytes: usize,
}

/// Entries a [`KeyCache`] keeps.
const KEY_CACHE_ENTRIES: usize = 64;
/// Payload and key bytes a [`KeyCache`] keeps at most.
const KEY_CACHE_BYTES: usize = 32 << 20;

/// One rank's object keys per page group, and each group's page size.
pub(super) struct RankKeys {
    /// [`object_keys`] of the rank.
    pub groups: Vec<Vec<ObjectKey>>,
    /// Bytes per page of each group.
    pub page_bytes: Vec<u64>,
}

fn entry_bytes(manifest: &Manifest, keys: &RankKeys) -> usize {
    let pages: usize = keys.groups.iter().map(Vec::len).sum();
    manifest.payload().len() + pages * size_of::<ObjectKey>() + keys.page_bytes.len() * 8
}

impl KeyCache {
    fn get(&self, manifest: &Manifest, rank: u32) -> Option<Arc<RankKeys>> {
        self.entries
            .iter()
            .find(|(m, r, _)| *r == rank && m == manifest)
            .map(|(_, _, keys)| keys.clone())
    }

    fn put(&mut self, manifest: &Manifest, rank: u32, keys: Arc<RankKeys>) {
        let bytes = entry_bytes(manifest, &keys);
        if bytes > KEY_CACHE_BYTES / 4 || self.get(manifest, rank).is_some() {
            return;
        }
        while self.entries.len() >= KEY_CACHE_ENTRIES || self.bytes + bytes > KEY_CACHE_BYTES {
            let Some((m, _, k)) = self.entries.pop_front() else {
                break;
            };
            self.bytes -= entry_bytes(&m, &k);
        }
        self.bytes += bytes;
        self.entries.push_back((manifest.clone(), rank, keys));
    }
}

/// The object keys of one rank's pages per group ([`object_keys`]), from
/// the [`KeyCache`] when this rank stored or restored this manifest
/// recently. Errors (a bad payload, a rank outside the world) are never
/// cached.
pub(super) fn rank_keys(
    inner: &Arc<Inner>,
    manifest: &Manifest,
    rank: u32,
) -> Result<Arc<RankKeys>> {
    if let Some(keys) = inner.read_keys.lock().get(manifest, rank) {
        return Ok(keys);
    }
    let schema = manifest.payload_schema()?;
    let keys = Arc::new(RankKeys {
        groups: object_keys(manifest, &schema, rank)?,
        page_bytes: schema.page_groups.iter().map(|g| g.page_bytes).collect(),
    });
    inner.read_keys.lock().put(manifest, rank, keys.clone());
    Ok(keys)
}

fn unknown_lease(lease_id: &str) -> Error {
    Error::NotFound(format!("unknown retrieve lease {lease_id}"))
}

/// Polls a retrieve: `pending`, `ready` with slots (every page of the rank,
/// read-locked until finish) or `miss` (the lease is gone).
pub(super) fn poll_retrieve(
    inner: &Arc<Inner>,
    lease_id: &str,
    rank: Option<u32>,
) -> Result<Lease> {
    let mut st = inner.lock();
    let lease_no = st
        .lease_number(lease_id)
        .filter(|n| st.retrieve_leases.contains_key(n))
        .ok_or_else(|| unknown_lease(lease_id))?;
    if let Some(lease) = st.retrieve_leases.get(&lease_no) {
        check_rank(lease_id, lease.rank, rank)?;
    }
    advance_retrieve(&mut st, lease_no);
    let timeout = inner.config.retrieve_timeout;
    let lease = st
        .retrieve_leases
        .get_mut(&lease_no)
        .ok_or_else(|| unknown_lease(lease_id))?;
    if lease.failed.is_none() && !lease.held.iter().all(|h| *h) && lease.started.elapsed() > timeout
    {
        lease.failed = Some(MissReason::RetrieveTimeout);
    }
    settle(inner, &mut st, lease_no, lease_id)
}

/// The answer for retrieve lease `lease_no` after it advanced (what
/// begin_retrieve and every poll return): `miss` when it failed (the lease
/// is removed and its readers released), `pending` while a page is not
/// held, else `ready` with one slot per page (the first exposure counts the
/// hit).
fn settle(inner: &Arc<Inner>, st: &mut State, lease_no: u64, lease_id: &str) -> Result<Lease> {
    let lease = st
        .retrieve_leases
        .get(&lease_no)
        .ok_or_else(|| unknown_lease(lease_id))?;
    if let Some(reason) = lease.failed {
        if let Some(lease) = st.retrieve_leases.remove(&lease_no) {
            release_readers(st, &lease);
        }
        return Ok(st.miss(reason));
    }
    if !lease.held.iter().all(|h| *h) {
        return Ok(Lease::pending(lease_id.to_string()));
    }
    let mut slots = Vec::with_capacity(lease.group_sizes.len());
    let mut keys = lease.keys.iter();
    for size in &lease.group_sizes {
        let mut group = Vec::with_capacity(*size);
        for key in keys.by_ref().take(*size) {
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
        slots.push(group);
    }
    let first_exposure = !lease.exposed;
    let (pages, tokens) = (
        lease.keys.len() as u64,
        (lease.rank == 0).then_some(lease.tokens),
    );
    if let Some(lease) = st.retrieve_leases.get_mut(&lease_no) {
        lease.exposed = true;
    }
    if first_exposure {
        st.count(Counter::Hits, 1);
        st.count(Counter::RestoredPages, pages);
        if let Some(tokens) = tokens {
            st.count(Counter::RestoredTokens, tokens);
        }
    }
    Ok(Lease::ready(
        lease_id.to_string(),
        inner.pool.id().to_string(),
        slots,
    ))
}

/// Ends the retrieve leases that exposed nothing and were begun more than
/// `older_than` ago: their holder stopped polling (a live process that lost
/// track of them; a gone one's are reclaimed earlier). Their readers are
/// released, so the pages they held can be evicted and cleared again; a later
/// poll of such a lease answers "unknown lease", which a worker treats as a
/// failed restore. Exposed leases are never expired: a copy may still read
/// their slots. Returns how many ended.
pub(super) fn expire_unpolled(inner: &Arc<Inner>, older_than: Duration) -> usize {
    let mut st = inner.lock();
    let expired: Vec<u64> = st
        .retrieve_leases
        .iter()
        .filter(|(_, l)| !l.exposed && l.started.elapsed() > older_than)
        .map(|(n, _)| *n)
        .collect();
    for n in &expired {
        if let Some(lease) = st.retrieve_leases.remove(n) {
            release_readers(&mut st, &lease);
        }
    }
    if !expired.is_empty() {
        st.count(Counter::RetrievesExpired, expired.len() as u64);
    }
    expired.len()
}

/// Ends an exposed retrieve lease after the worker's copy drained.
/// Unknown ids are a no-op; a lease not yet exposed is an error.
pub(super) fn finish_retrieve(inner: &Arc<Inner>, lease_id: &str, rank: Option<u32>) -> Result<()> {
    let mut st = inner.lock();
    let Some(lease) = take_lease(&mut st, lease_id, rank, true)? else {
        return Ok(());
    };
    for key in &lease.keys {
        st.touch(key);
    }
    st.touch_generation(&lease.generation);
    release_readers(&mut st, &lease);
    Ok(())
}

/// Cancels a retrieve that exposed nothing yet; never invalidates the
/// generation. Unknown ids are a no-op; an exposed lease must be finished.
pub(super) fn cancel_retrieve(inner: &Arc<Inner>, lease_id: &str, rank: Option<u32>) -> Result<()> {
    let mut st = inner.lock();
    let Some(lease) = take_lease(&mut st, lease_id, rank, false)? else {
        return Ok(());
    };
    release_readers(&mut st, &lease);
    st.count(Counter::RetrievesCancelled, 1);
    Ok(())
}

/// Removes the retrieve lease `lease_id` for finishing (`exposed`) or
/// cancelling (`!exposed`): None when unknown; an error when another rank
/// names it or it is in the other state (finish an exposed lease, cancel
/// one that exposed nothing).
fn take_lease(
    st: &mut State,
    lease_id: &str,
    rank: Option<u32>,
    exposed: bool,
) -> Result<Option<RetrieveLease>> {
    let Some(lease_no) = st.lease_number(lease_id) else {
        return Ok(None);
    };
    let Some(lease) = st.retrieve_leases.get(&lease_no) else {
        return Ok(None);
    };
    check_rank(lease_id, lease.rank, rank)?;
    match (lease.exposed, exposed) {
        (false, true) => Err(Error::invalid(
            "retrieve lease has no exposed slots yet: poll it until ready, or cancel it",
        )),
        (true, false) => Err(Error::invalid(
            "retrieve lease already exposed its slots: finish it after the copy drained",
        )),
        _ => Ok(st.retrieve_leases.remove(&lease_no)),
    }
}

/// Drops a retrieve lease's readers (objects may become reclaimable).
pub(super) fn release_readers(st: &mut State, lease: &RetrieveLease) {
    for (key, held) in lease.keys.iter().zip(&lease.held) {
        if *held {
            st.drop_reader(key);
        }
    }
    for key in &lease.keys {
        st.maybe_reclaim(key);
    }
}

/// Every page key of a retrieve lease (none when the lease is gone).
fn lease_keys(st: &State, lease_no: u64) -> std::collections::HashSet<ObjectKey> {
    st.retrieve_leases
        .get(&lease_no)
        .map(|l| l.keys.iter().copied().collect())
        .unwrap_or_default()
}

/// Takes readers on every resident page of a retrieve and queues L2 loads
/// (or shared-tier fetches) for the rest (performed when the lock is
/// released).
///
/// Two passes: first every resident page is held (or waited for), then
/// slots are found for the pages only on disk. The order matters: finding a
/// slot may evict L1 copies, and an L1-only copy evicted takes its
/// generations with it — were one of this lease's own resident pages still
/// unheld, making room for its disk pages could retire the very generation
/// it restores, reclaim those disk pages and delete their files under the
/// load about to read them (the soak's "durable L2 page absent").
fn advance_retrieve(st: &mut State, lease_no: u64) {
    let Some(lease) = st.retrieve_leases.get(&lease_no) else {
        return;
    };
    if lease.failed.is_some() {
        return;
    }
    let pending: Vec<(usize, ObjectKey)> = lease
        .held
        .iter()
        .enumerate()
        .filter(|(_, held)| !**held)
        .map(|(i, _)| (i, lease.keys[i]))
        .collect();
    let generation = lease.generation.clone();
    // Pass 1: hold what is resident, wait for what is in flight.
    let mut to_place = Vec::new();
    for (i, key) in pending {
        match st.objects.get(&key).map(|o| o.l1) {
            Some(L1::Ready) => {
                st.add_reader(&key);
                st.touch(&key);
                if let Some(lease) = st.retrieve_leases.get_mut(&lease_no) {
                    lease.held[i] = true;
                }
            }
            // A load's end hands its waiters a reader (`end_load`); only
            // a load's: a store's finish or discard takes no waiters, so a
            // lease waiting on a page being written would stay in its
            // waiters for ever (never idle: never evicted nor reclaimed).
            // The next poll looks at it again instead.
            Some(L1::Loading) => {
                if let Some(obj) = st.objects.get_mut(&key)
                    && !obj.waiters.contains(&lease_no)
                {
                    obj.waiters.push(lease_no);
                }
            }
            Some(L1::Writing(_)) => {}
            _ => to_place.push(key),
        }
    }
    if st.eviction == Eviction::Cost {
        // Room for every load at once (one ranking instead of one per
        // page), never from this restore's own pages.
        let own: std::collections::HashSet<ObjectKey> = lease_keys(st, lease_no);
        let need: u64 = to_place
            .iter()
            .filter_map(|key| st.objects.get(key))
            .filter(|o| o.l1 == L1::Absent && (o.l2 == L2::Durable || o.remote.is_some()))
            // A page larger than the pool can never fit: no room is made
            // for it (pass 2 fails the lease).
            .filter_map(|o| st.alloc.reserved_for(o.page_bytes))
            .fold(0u64, u64::saturating_add);
        if need > 0 {
            st.make_room(need, true, &own);
        }
    }
    // Pass 2: read through, from L2 when it has the page, else from the
    // shared tier (verified against its key before it is Ready).
    for key in to_place {
        let state = st
            .objects
            .get(&key)
            .map(|o| (o.l1, o.l2, o.page_bytes, o.remote.clone()));
        match state {
            // Not expected: pass 1 handled pages that were loading, and a
            // rank names an object at most once (keys include rank and
            // group; a group's pages are distinct). Wait for the load as
            // pass 1 would.
            Some((L1::Loading, _, _, _)) => {
                if let Some(obj) = st.objects.get_mut(&key)
                    && !obj.waiters.contains(&lease_no)
                {
                    obj.waiters.push(lease_no);
                }
            }
            // Not a load: the next poll looks again (see pass 1).
            Some((L1::Writing(_), _, _, _)) => {}
            Some((L1::Absent, l2, bytes, remote)) if l2 == L2::Durable || remote.is_some() => {
                let Some(reserved) = st.alloc.reserved_for(bytes) else {
                    // Larger than the whole pool (listed before a restart
                    // with a smaller pool, or imported from a larger host):
                    // no eviction can ever make room, so the lease misses
                    // now instead of waiting out the retrieve timeout. The
                    // generation stays listed: a larger pool serves it.
                    log::warn!(
                        "a restore of {generation} misses: its page {key} has {bytes} bytes, \
                         more than the whole L1 pool ({} bytes); a sidecar with l1_bytes of at \
                         least that serves it",
                        st.alloc.capacity()
                    );
                    if let Some(lease) = st.retrieve_leases.get_mut(&lease_no) {
                        lease.failed = Some(MissReason::Capacity);
                    }
                    break;
                };
                let mut slot = st.alloc.alloc(bytes);
                if slot.is_none() && st.evict_for(reserved, true) {
                    slot = st.alloc.alloc(bytes);
                }
                let Some(slot) = slot else {
                    // Wait for space; the poll deadline bounds the wait.
                    st.count(Counter::RetrieveCapacityWaits, 1);
                    continue;
                };
                // The eviction must have left the page as it was (pass 1
                // holds this lease's resident pages); if not, give the slot
                // back and let the next poll look again, never queue a load
                // for an object that is gone (its file may be deleted).
                let unchanged = st.objects.get(&key).is_some_and(|o| {
                    o.l1 == L1::Absent && (o.l2 == L2::Durable || o.remote.is_some())
                });
                if !unchanged {
                    log::error!(
                        "internal: object {key} changed while room was made for its load; \
                         the next poll looks again"
                    );
                    if let Err(e) = st.alloc.free(slot) {
                        log::error!("freeing an L1 slot failed (accounting bug): {e}");
                    }
                    continue;
                }
                if let Some(obj) = st.objects.get_mut(&key) {
                    obj.slot = Some(slot);
                    obj.l1 = L1::Loading;
                    obj.waiters.push(lease_no);
                }
                st.start_io(&key);
                match remote.filter(|_| l2 != L2::Durable) {
                    None => {
                        st.count(Counter::L2Loads, 1);
                        st.loads.push((key, slot.offset, bytes));
                    }
                    Some(namespace) => {
                        st.count(Counter::SharedFetches, 1);
                        st.fetches.push(Fetch {
                            key,
                            offset: slot.offset,
                            len: bytes,
                            namespace,
                        });
                    }
                }
            }
            _ => {
                // No copy anywhere. Of a listed generation's page that is
                // proof of loss: the lease fails with lost_object and the
                // generation is retired. If the generation was retired
                // while this lease waited (an L2 eviction, an invalidation
                // or a clear took the page it held no reader on), nothing
                // was lost: a clean miss, as begin_retrieve would answer now.
                let listed = st.listed.contains_key(generation.as_str());
                if let Some(lease) = st.retrieve_leases.get_mut(&lease_no) {
                    lease.failed = Some(if listed {
                        MissReason::LostObject
                    } else {
                        MissReason::NotListed
                    });
                }
                if listed {
                    st.to_retire.push(Arc::from(generation.as_str()));
                    st.unlist_generation(&generation);
                }
                break;
            }
        }
    }
}
