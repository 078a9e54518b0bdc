//! The store path: staging a generation (`begin`/`abort`), leasing slots
//! for one rank's pages (`prepare_store`, all or nothing, waiting a bounded
//! time for space) and ending the lease (`finish_store`), whose last
//! successful call publishes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Inner;
use super::counters::Counter;
use super::reclaim::Holder;
use super::state::{L1, L2, PendingGen, RankState, State, StoreLease};
use crate::error::{Error, Result};
use crate::manifest::Manifest;
use crate::protocol::{Lease, MissReason, Slot};
use crate::store::ObjectKey;

/// How long a capacity wait sleeps between retries at most.
const RETRY_WAIT: Duration = Duration::from_millis(100);

/// Stages a generation; false = identical one pending or listed, no
/// capacity, or an aborted attempt of it still draining (retry later).
pub(super) fn begin(inner: &Arc<Inner>, manifest: &Manifest) -> Result<bool> {
    // Validate the page groups before anything is staged.
    let schema = manifest.payload_schema()?;
    check_distinct_pages(&schema)?;
    if let Some(why) = store_refusal(inner) {
        inner.lock().count(Counter::BeginRefusedNoSpace, 1);
        return Err(Error::OutOfSpace(format!(
            "store of {} refused: {why}; durable generations are still served, and stores \
             resume once space returns",
            manifest.generation()
        )));
    }
    abort_stale(inner);
    // An aborted attempt of this generation may still be draining: rank
    // leases not yet finished, or acknowledgements in flight. Staging it
    // again now would let those count toward the new attempt (a stale
    // acknowledgement publishing pages the new attempt never stored), so
    // it is refused until they are gone.
    let g = manifest.generation();
    let draining = {
        let st = inner.lock();
        st.pending.contains_key(g) || st.store_leases.values().any(|l| l.generation == g)
    };
    if draining && !inner.dir.is_pending(manifest)? {
        inner.lock().count(Counter::BeginDraining, 1);
        return Ok(false);
    }
    // The manifest's memory counts against the pending budget from here.
    let bytes = manifest_bytes(manifest);
    {
        let mut st = inner.lock();
        if st.pending_bytes.saturating_add(bytes) > inner.config.max_pending_bytes {
            st.count(Counter::BeginRefusedPendingBytes, 1);
            log::info!(
                "begin of {g} refused: pending manifests hold {} bytes and this one {bytes} \
                 (max_pending_bytes is {})",
                st.pending_bytes,
                inner.config.max_pending_bytes
            );
            return Ok(false);
        }
        st.pending_bytes += bytes;
    }
    let begun = inner.dir.begin(manifest);
    if !matches!(begun, Ok(true)) {
        let mut st = inner.lock();
        st.pending_bytes = st.pending_bytes.saturating_sub(bytes);
        if matches!(begun, Ok(false)) {
            st.count(Counter::BeginSuppressed, 1);
        }
        return begun;
    }
    {
        let mut st = inner.lock();
        let epoch = st.next_epoch;
        st.next_epoch += 1;
        if st.pending.contains_key(g) {
            st.pending_bytes = st.pending_bytes.saturating_sub(bytes);
        } else {
            st.pending.insert(
                g.to_string(),
                PendingGen {
                    ranks: Default::default(),
                    pinned: Vec::new(),
                    acks_in_flight: 0,
                    abort_requested: false,
                    epoch,
                    bytes,
                    tokens: manifest.prefix().num_tokens(),
                },
            );
        }
    }
    // An abort that ran between the directory's answer and the record
    // above found nothing to drop here: drop it now.
    if !matches!(inner.dir.is_pending(manifest), Ok(true)) {
        abort_locked(&mut inner.lock(), g);
    }
    Ok(true)
}

/// Bytes a pending manifest holds in memory (payload, tail, names), as
/// counted against `max_pending_bytes`.
fn manifest_bytes(manifest: &Manifest) -> u64 {
    let prefix = manifest.prefix();
    (manifest.payload().len()
        + prefix.tail_tokens().len() * 4
        + prefix.namespace().len()
        + manifest.generation().len()
        + 128) as u64
}

/// Why stores are refused now (the disk is full), if they are.
fn store_refusal(inner: &Inner) -> Option<String> {
    if let Some(why) = inner.dir.read_only() {
        return Some(why);
    }
    inner.upkeep.disk_full()
}

/// Refuses a payload in which two pages of one group would be the same
/// storage object: only one of them could ever be stored, and no restore
/// could place both (a recurrent group with several positions needs one
/// content key per position, e.g. discriminators `recurrent:<g>:<position>`).
fn check_distinct_pages(schema: &crate::manifest::PayloadSchema) -> Result<()> {
    for group in &schema.page_groups {
        if group.content_keys.len() < 2 {
            continue;
        }
        let mut seen = std::collections::HashMap::with_capacity(group.content_keys.len());
        for (i, key) in group.content_keys.iter().enumerate() {
            if let Some(first) = seen.insert(key, i) {
                return Err(Error::invalid(format!(
                    "page group {:?} gives positions {} and {} the same content key: every \
                     position of a group needs its own key (a recurrent group with several \
                     positions must give each position its own discriminator, e.g. \
                     \"recurrent:<group>:<position>\")",
                    group.name, group.positions[first], group.positions[i]
                )));
            }
        }
    }
    Ok(())
}

/// Aborts a pending generation (no-op for unknown or listed ones).
pub(super) fn abort(inner: &Arc<Inner>, generation: &str) -> Result<()> {
    inner.dir.abort(generation)?;
    abort_locked(&mut inner.lock(), generation);
    Ok(())
}

/// Aborts pending generations begun more than `abandoned_after` ago (at
/// every `begin`, and on the reclaim sweep's timer).
pub(super) fn abort_stale(inner: &Arc<Inner>) {
    let Some(age) = inner.config.abandoned_after else {
        return;
    };
    let stale = inner.dir.abort_stale(age).unwrap_or_else(|e| {
        log::warn!("aborting abandoned generations failed: {e}");
        Vec::new()
    });
    if !stale.is_empty() {
        let mut st = inner.lock();
        for g in &stale {
            abort_locked(&mut st, g);
        }
        st.count(Counter::AbandonedGenerations, stale.len() as u64);
    }
}

/// Leases slots for one rank's pages of a pending generation.
///
/// All or nothing: `ready` with a slot per new page and `None` per page
/// already resident (do not copy); `busy` when another lease is writing a
/// page this one needs (retry; the generation stays pending); `miss` when
/// the generation is not pending or space did not free up in time (the
/// generation is aborted).
/// The lease is held by `holder` (reclaimed if that process dies).
pub(super) fn prepare_store(
    inner: &Arc<Inner>,
    holder: &Holder,
    manifest: &Manifest,
    rank: u32,
) -> Result<Lease> {
    prepare_store_if(inner, holder, manifest, rank, true)?
        .ok_or_else(|| Error::Internal("a waiting store admission gave no answer".into()))
}

/// [`prepare_store`] that never waits for L1 space: `None` when the
/// rank's new pages do not fit now (nothing was changed; `prepare_store`
/// waits for evictions). What the RPC server answers on a connection's own
/// thread, saving a thread hand-off when the space is there.
pub(super) fn try_prepare_store(
    inner: &Arc<Inner>,
    holder: &Holder,
    manifest: &Manifest,
    rank: u32,
) -> Result<Option<Lease>> {
    prepare_store_if(inner, holder, manifest, rank, false)
}

fn prepare_store_if(
    inner: &Arc<Inner>,
    holder: &Holder,
    manifest: &Manifest,
    rank: u32,
    may_wait: bool,
) -> Result<Option<Lease>> {
    let keys = super::retrieve::rank_keys(inner, manifest, rank)?;
    let (groups, page_bytes) = (&keys.groups, &keys.page_bytes);
    let generation = manifest.generation().to_string();
    let epoch = staged_epoch(&inner.lock(), &generation);
    if !inner.dir.is_pending(manifest)? {
        return Ok(Some(inner.lock().miss(MissReason::NotPending)));
    }
    let mut st = inner.lock();
    if !st.accepting {
        return Ok(Some(st.miss(MissReason::Shutdown)));
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
        return Ok(Some(st.miss(MissReason::NotPending)));
    };
    if let Some(pg) = st.pending.get(&generation)
        && pg.ranks.get(&rank) == Some(&RankState::Committed)
    {
        return Err(Error::invalid(format!(
            "rank {rank} already committed {generation}"
        )));
    }
    if st.live_leases() >= inner.config.max_leases {
        let miss = st.miss(MissReason::LeaseBudget);
        drop(st);
        abort(inner, &generation)?;
        return Ok(Some(miss));
    }
    st.store_ranks.insert((generation.clone(), rank));
    let (lease_no, lease_id) = st.new_lease_id();
    let deadline = Instant::now() + inner.config.store_admission_timeout;
    let mut waited = false;
    loop {
        if staged_epoch(&st, &generation) != Some(epoch) {
            st.store_ranks.remove(&(generation.clone(), rank));
            return Ok(Some(st.miss(MissReason::Conflict)));
        }
        let generation_before = st.alloc.change_generation();
        match attempt_store(&mut st, groups, page_bytes, lease_no) {
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
                st.count(Counter::StorePagesReused, reused.len() as u64);
                st.count(Counter::StorePagesNew, written.len() as u64);
                st.count(Counter::StoreBytesLeased, bytes);
                st.store_leases.insert(
                    lease_no,
                    StoreLease {
                        number: lease_no,
                        generation: generation.clone(),
                        rank,
                        written,
                        bytes,
                        holder: holder.clone(),
                    },
                );
                if waited {
                    st.count(Counter::AdmissionSuccessAfterEviction, 1);
                }
                return Ok(Some(Lease::ready(
                    lease_id,
                    inner.pool.id().to_string(),
                    slots,
                )));
            }
            Attempt::Busy => {
                st.store_ranks.remove(&(generation.clone(), rank));
                st.count(Counter::AdmissionBusy, 1);
                return Ok(Some(Lease::busy()));
            }
            Attempt::Capacity if !may_wait => {
                st.store_ranks.remove(&(generation.clone(), rank));
                return Ok(None);
            }
            Attempt::Capacity => {
                let now = Instant::now();
                if now >= deadline {
                    st.store_ranks.remove(&(generation.clone(), rank));
                    let miss = st.miss(MissReason::Capacity);
                    st.count(Counter::AdmissionTimeouts, 1);
                    drop(st);
                    abort(inner, &generation)?;
                    return Ok(Some(miss));
                }
                if !waited {
                    st.count(Counter::AdmissionWaits, 1);
                }
                waited = true;
                let wait = (deadline - now).min(RETRY_WAIT);
                if st.alloc.change_generation() == generation_before {
                    st.wait_for(wait);
                }
                st.count(Counter::AdmissionRetries, 1);
            }
        }
    }
}

/// Ends a store lease after the worker's copy drained. `success = true`
/// commits this rank; the call that completes the last rank publishes
/// (returns true). `success = false` discards the pages and aborts the
/// generation, so no other rank can publish it. With `rank`, a lease of
/// another rank is refused.
pub(super) fn finish_store(
    inner: &Arc<Inner>,
    lease_id: &str,
    success: bool,
    rank: Option<u32>,
) -> Result<bool> {
    let lease = {
        let mut st = inner.lock();
        let Some(lease_no) = st.lease_number(lease_id) else {
            return Ok(false);
        };
        let Some(owner) = st.store_leases.get(&lease_no).map(|l| l.rank) else {
            return Ok(false);
        };
        check_rank(lease_id, owner, rank)?;
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
                st.miss(MissReason::AbortedDuringStore);
            }
            drop(st);
            abort(inner, &lease.generation)?;
            return Ok(false);
        }
        for key in &lease.written {
            st.set_ready(key);
            if inner.l2.is_some() {
                st.l2_writes.push(*key);
            }
        }
        if let Some(pg) = st.pending.get_mut(&lease.generation) {
            pg.ranks.insert(lease.rank, RankState::Committed);
            pg.acks_in_flight += 1;
        }
        st.count(Counter::StoreBytesCommitted, lease.bytes);
        lease
    };

    let ack = inner.dir.acknowledge(&lease.generation, lease.rank);
    let mut st = inner.lock();
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
            if is_disk_full(&e) {
                inner
                    .upkeep
                    .note_disk_full(format!("publishing {} failed: {e}", lease.generation));
            }
            st.miss(MissReason::DirectoryError);
            drop(st);
            abort(inner, &lease.generation)?;
            return Err(e);
        }
    };
    if publication.published {
        if let Some(pg) = st.remove_pending(&lease.generation) {
            st.list_generation(&lease.generation, pg.pinned.clone(), pg.tokens);
            if inner.l2.is_none() {
                // Without L2 a generation goes to the shared tier (if
                // any) once published; with L2, once durable.
                st.to_upload.push(Arc::from(lease.generation.as_str()));
            }
            for key in &pg.pinned {
                st.unpin(key);
            }
        }
        st.unlist_displaced(&publication);
        st.count(Counter::Published, 1);
    } else if abort_requested {
        st.release_pending(&lease.generation);
    }
    Ok(publication.published)
}

/// Whether a directory error says the disk is full (the directory maps
/// SQLite's `SQLITE_FULL` to [`Error::OutOfSpace`]).
fn is_disk_full(e: &Error) -> bool {
    matches!(e, Error::OutOfSpace(_))
}

/// Refuses a lease call that names another rank than the lease's.
pub(super) fn check_rank(lease_id: &str, owner: u32, rank: Option<u32>) -> Result<()> {
    match rank {
        Some(rank) if rank != owner => Err(Error::invalid(format!(
            "lease {lease_id} belongs to rank {owner}, not rank {rank}"
        ))),
        _ => Ok(()),
    }
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
    // Whether the attempt will answer busy (so nothing is evicted for it).
    let mut busy = false;
    for (keys, &bytes) in groups.iter().zip(page_bytes) {
        for key in keys {
            let obj = st.objects.get(key);
            // As the loop below decides it.
            busy |= match obj {
                Some(o) if o.l1 == L1::Writing(lease) => false,
                Some(o) if matches!(o.l1, L1::Writing(_) | L1::Loading) => true,
                Some(o) if o.reusable() => false,
                _ => st.deleting.contains_key(key),
            };
            let placed =
                obj.is_some_and(|o| o.reusable() || matches!(o.l1, L1::Writing(_) | L1::Loading));
            if !placed && seen.insert(*key) {
                let reserved = st.alloc.reserved_for(bytes).unwrap_or(u64::MAX);
                needed = needed.saturating_add(reserved);
            }
        }
    }
    // The pages this store reuses whose only copy is L1 are never room for
    // its others: evicting one would retire its generations and then need
    // a slot of its own (nothing gained, a generation lost for nothing).
    let keep: std::collections::HashSet<ObjectKey> = groups
        .iter()
        .flatten()
        .filter(|key| {
            st.objects
                .get(*key)
                .is_some_and(|o| o.l1 == L1::Ready && o.l2 != L2::Durable && o.remote.is_none())
        })
        .copied()
        .collect();
    if needed > st.alloc.available()
        && needed
            > st.alloc
                .available()
                .saturating_add(st.evictable_bytes_sparing(true, &keep))
    {
        return Attempt::Capacity;
    }
    if !busy {
        // `cost` ranks the candidates once for all the pages, sparing the
        // pages this store reuses (a no-op under `lru`, which evicts page
        // by page below).
        let own: std::collections::HashSet<ObjectKey> = groups.iter().flatten().copied().collect();
        st.make_room(needed, true, &own);
    }
    let mut outcome = None;
    'groups: for (keys, &bytes) in groups.iter().zip(page_bytes) {
        let mut group = Vec::with_capacity(keys.len());
        for key in keys {
            match st.objects.get(key).map(|o| (o.l1, o.reusable())) {
                Some((L1::Writing(owner), _)) if owner == lease => group.push(None),
                // A page loading from L2 is durable there, but the load may
                // prove the file lost (corrupt or gone): reused now, the
                // store would publish a generation naming a page nothing
                // holds. Wait for the load; the retry reuses the page once
                // it is `Ready`, or writes it if the load lost it.
                Some((L1::Loading, _)) => {
                    outcome = Some(Attempt::Busy);
                    break 'groups;
                }
                Some((_, true)) => {
                    st.pin(key);
                    reused.push(*key);
                    group.push(None);
                }
                Some((L1::Writing(_), false)) => {
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
                            if st.evict_for_sparing(reserved, true, &keep) {
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
                    st.insert_writing(*key, bytes, slot, lease);
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
                st.unpin(key);
                st.drop_l1(key);
                st.maybe_reclaim(key);
            }
            for key in &reused {
                st.unpin(key);
                st.maybe_reclaim(key);
            }
            failure
        }
    }
}

/// Removes the pages a failed or orphaned store lease was writing.
pub(super) fn discard_written(st: &mut State, lease: &StoreLease) {
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
pub(super) fn abort_locked(st: &mut State, generation: &str) {
    let Some(pg) = st.pending.get_mut(generation) else {
        return;
    };
    if pg.acks_in_flight > 0 {
        pg.abort_requested = true;
        st.releases += 1;
        return;
    }
    st.release_pending(generation);
}
