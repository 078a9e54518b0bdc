//! The state lock and the tier I/O it drives.
//!
//! [`Inner::lock`] is the only way to the service state. Its guard,
//! [`Locked`], performs on release what the state queued while it was held
//! — L2 writes, deletes and loads on the I/O pool, directory retirements and
//! durable flags — and wakes stores waiting for space when a hold was
//! released. So no call site performs (or can forget) side effects by hand.
//! The raw mutex is private to this module: the side-effect pump ([`flush`])
//! and the condition variable are the only other users.
//!
//! I/O jobs run on the [`IoPool`] threads and never under the lock: a write
//! reads an immutable `Ready` slot (its `io` count keeps the slot alive); a
//! load fills a slot in state `Loading` that no lease exposes.

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::Inner;
use super::counters::Counter;
use super::state::{L1, L2, State};
use super::upkeep::RetryWrite;
use crate::error::{Error, Result};
use crate::protocol::MissReason;
use crate::store::ObjectKey;
use crate::store::l2::{L2Tier, object_file_bytes};

/// The service state behind its mutex, with the condition variable that
/// stores waiting for space sleep on.
pub(super) struct StateLock {
    state: Mutex<State>,
    changed: Condvar,
}

impl StateLock {
    /// Wraps the initial state.
    pub(super) fn new(state: State) -> StateLock {
        StateLock {
            state: Mutex::new(state),
            changed: Condvar::new(),
        }
    }
}

/// The locked service state. Releasing it performs the queued side effects
/// outside the lock and wakes waiting stores when a hold was released.
pub(super) struct Locked<'a> {
    inner: &'a Arc<Inner>,
    guard: ManuallyDrop<MutexGuard<'a, State>>,
    token: (u64, u64),
}

impl Inner {
    /// Locks the service state (see [`Locked`]).
    pub(super) fn lock(self: &Arc<Self>) -> Locked<'_> {
        let guard = self.state.state.lock();
        let token = guard.wake_token();
        Locked {
            inner: self,
            guard: ManuallyDrop::new(guard),
            token,
        }
    }
}

impl Locked<'_> {
    /// Releases the lock for at most `timeout` or until a hold is released
    /// elsewhere (a store waiting for space), then holds it again.
    pub(super) fn wait_for(&mut self, timeout: Duration) {
        self.inner.state.changed.wait_for(&mut self.guard, timeout);
    }
}

impl Deref for Locked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.guard
    }
}

impl DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let effects = self.guard.has_side_effects();
        let released = self.guard.wake_token() != self.token;
        // SAFETY: this is the guard's one drop and `self.guard` is not used
        // after it (the fields below are plain references).
        unsafe { ManuallyDrop::drop(&mut self.guard) };
        if effects {
            flush(self.inner);
        }
        if effects || released {
            self.inner.state.changed.notify_all();
        }
    }
}

/// Performs the side effects queued in the state, outside its lock: a
/// first round that may evict from L2, then rounds that write what the
/// deletes of the round before made room for (none evicts, so each needs
/// deletes of its own to ask for another: the loop ends).
pub(super) fn flush(inner: &Arc<Inner>) {
    let mut may_evict = true;
    while flush_once(inner, may_evict) {
        may_evict = false;
    }
}

/// One round of side effects. When L2 is full, the first round evicts L2
/// objects (see [`State::evict_l2`]) and a second round writes what now fits.
/// A write that finds L2 full while deletes are queued or running (their
/// bytes still charged) waits for them rather than being skipped
/// (`l2_skipped_full` counts only writes no delete can make room for).
/// Returns whether another round should write what waited for room.
fn flush_once(inner: &Arc<Inner>, may_evict: bool) -> bool {
    let mut evicted = false;
    let (writes, deletes, durable, retire, loads, fetches, uploads) = {
        let mut st = inner.state.state.lock();
        let mut writes = Vec::new();
        let mut waiting = Vec::new();
        for key in std::mem::take(&mut st.l2_writes) {
            let Some(l2) = inner.l2.as_ref() else {
                continue;
            };
            let Some(obj) = st.objects.get_mut(&key) else {
                continue;
            };
            if obj.l2 != L2::Absent || obj.l1 != L1::Ready {
                continue;
            }
            let Some(slot) = obj.slot else {
                continue;
            };
            // The space is reserved in the tier now; the write turns the
            // reservation into the object's bytes (never counted twice).
            if !l2.try_reserve(charge(inner, obj.page_bytes)) {
                waiting.push(key);
                continue;
            }
            obj.l2 = L2::Queued;
            let bytes = obj.page_bytes;
            st.start_io(&key);
            writes.push((key, slot.offset, bytes));
        }
        if !waiting.is_empty() {
            if let Some(l2) = inner.l2.as_ref().filter(|_| may_evict) {
                let need: u64 = waiting
                    .iter()
                    .filter_map(|k| st.objects.get(k))
                    .map(|o| charge(inner, o.page_bytes))
                    .sum();
                // bytes of files being deleted are still charged: they are
                // room already made, not room to evict for again
                let freeing: u64 = st
                    .deleting
                    .keys()
                    .map(|k| l2.charged_bytes_of(k).unwrap_or(0))
                    .sum();
                let free = l2.capacity().map_or(u64::MAX, |cap| {
                    cap.saturating_sub(l2.used_bytes() + l2.reserved_bytes())
                        .saturating_add(freeing)
                });
                evicted = st.evict_l2(need.saturating_sub(free), &waiting, |k| {
                    l2.charged_bytes_of(k).unwrap_or(0)
                });
            }
            if evicted || !st.deleting.is_empty() {
                // Space is being freed: this round's eviction, or deletes
                // queued or running (another round's eviction, a reclaim)
                // whose bytes are still charged. The writes wait for them
                // instead of being skipped; the round that performs the
                // deletes writes what then fits.
                st.l2_writes.extend(waiting);
            } else {
                st.count(Counter::L2SkippedFull, waiting.len() as u64);
            }
        }
        (
            writes,
            std::mem::take(&mut st.l2_deletes),
            std::mem::take(&mut st.newly_durable),
            std::mem::take(&mut st.to_retire),
            std::mem::take(&mut st.loads),
            std::mem::take(&mut st.fetches),
            std::mem::take(&mut st.to_upload),
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
        // synced directory transaction (group commit: index/durability.rs).
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
                log::warn!("deleting L2 object {key} failed: {e}");
            }
        }
    }
    let mut waiting_writes = false;
    if !deletes.is_empty() {
        let mut st = inner.state.state.lock();
        st.l2_deletes_done(&deletes);
        waiting_writes = !st.l2_writes.is_empty();
        drop(st);
        inner.state.changed.notify_all();
    }
    for (key, offset, len) in loads {
        submit_load(inner, key, offset, len);
    }
    // With L2, a generation goes to the shared tier once durable; without,
    // once published (`to_upload`).
    #[cfg(feature = "shared-tier")]
    {
        if let Some(side) = &inner.shared {
            let durable_ones = if inner.l2.is_some() {
                durable
            } else {
                Vec::new()
            };
            side.enqueue(uploads.into_iter().chain(durable_ones));
        }
        if !fetches.is_empty() {
            super::shared::submit_fetches(inner, fetches);
        }
    }
    #[cfg(not(feature = "shared-tier"))]
    let _ = (fetches, uploads);
    for (key, offset, len) in writes {
        submit_write(inner, key, offset, len, 0);
    }
    // The evicted (or reclaimed) files are deleted now: another round
    // writes what waited for space.
    evicted || waiting_writes
}

/// The bytes an object of `page_bytes` takes in L2 (see [`L2Tier::charge`]).
fn charge(inner: &Inner, page_bytes: u64) -> u64 {
    let file = object_file_bytes(page_bytes);
    inner.l2.as_ref().map_or(file, |l2| l2.charge(file))
}

/// Runs `job` on an L2 I/O thread, or on this thread when the queue is
/// full or the pool is gone (never dropped).
fn submit_io(inner: &Arc<Inner>, job: Box<dyn FnOnce() + Send>) {
    let io = inner.io.lock();
    match io.as_ref() {
        Some(pool) => {
            if let Err(job) = pool.try_submit(job) {
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

/// Reads an object's L2 file into its `Loading` slot, then hands a reader
/// to every retrieve lease waiting for it — or, when the file is missing or
/// corrupt (proof of loss), retires the generations naming it.
fn submit_load(inner: &Arc<Inner>, key: ObjectKey, offset: u64, len: u64) {
    submit_l2_job(inner, move |inner, l2| {
        let started = Instant::now();
        // SAFETY: the slot belongs to an object in state Loading; no lease
        // exposes it and nothing else writes it until this job completes.
        let result = page_len(len)
            .and_then(|len| unsafe { inner.pool.slice_mut(offset, len) })
            .and_then(|buf| l2.read_timed(&key, buf));
        let result = result.map(|first_byte| {
            inner.meters.l2.observe(first_byte, started.elapsed(), len);
        });
        let mut st = inner.lock();
        let waiters = st.end_load(&key);
        match result {
            Ok(()) => {
                hand_to_waiters(&mut st, &key, &waiters);
                // Its generations may have been retired (or its readers
                // cancelled) while it loaded: then nothing references it.
                st.maybe_reclaim(&key);
            }
            Err(e) => {
                let proof = matches!(
                    e,
                    Error::NotFound(_) | Error::Corrupt(_) | Error::UnsupportedFormat(_)
                );
                log::warn!("L2 read of object {key} failed: {e}");
                st.drop_l1(&key);
                let reason = if proof {
                    MissReason::LostObject
                } else {
                    MissReason::L2ReadError
                };
                for w in &waiters {
                    if let Some(lease) = st.retrieve_leases.get_mut(w) {
                        lease.failed = Some(reason);
                    }
                }
                // The load's I/O hold kept the object; were it gone, its
                // key could name a new object by now whose file is not
                // this one's to delete.
                if proof && st.objects.contains_key(&key) {
                    st.count(Counter::L2CorruptOrMissing, 1);
                    if let Some(obj) = st.objects.get_mut(&key) {
                        obj.l2 = L2::Absent;
                    }
                    st.queue_l2_delete(key);
                    st.retire_generations_of(&key);
                }
                st.maybe_reclaim(&key);
            }
        }
    });
}

/// Makes a loaded (or fetched) object Ready and hands a reader to every
/// retrieve lease that waited for it.
pub(super) fn hand_to_waiters(st: &mut State, key: &ObjectKey, waiters: &[u64]) {
    st.set_ready(key);
    for w in waiters {
        let pos = st.retrieve_leases.get(w).and_then(|l| {
            l.keys
                .iter()
                .enumerate()
                .position(|(i, k)| k == key && !l.held[i])
        });
        if let Some(pos) = pos {
            st.add_reader(key);
            if let Some(lease) = st.retrieve_leases.get_mut(w) {
                lease.held[pos] = true;
            }
        }
    }
}

/// Writes a `Ready` object's bytes to its durable L2 file (`attempt` 0 for
/// the first try). The object's I/O hold, taken when the write was queued,
/// keeps its slot until the write succeeds or is given up (see
/// [`super::upkeep`] for retries).
fn submit_write(inner: &Arc<Inner>, key: ObjectKey, offset: u64, len: u64, attempt: u32) {
    submit_l2_job(inner, move |inner, l2| {
        // SAFETY: the object is Ready (immutable) and its `io` count keeps the
        // slot from being freed or reused until this job has finished.
        let result = page_len(len)
            .and_then(|len| unsafe { inner.pool.slice(offset, len) })
            .and_then(|bytes| l2.write_reserved(&key, bytes));
        let failure = match result {
            Ok(_) => {
                if attempt > 0 {
                    log::info!("L2 write of object {key} succeeded after {attempt} retries");
                }
                inner.upkeep.clear_disk_full();
                let mut st = inner.lock();
                st.end_io(&key);
                st.mark_durable(&key);
                st.maybe_reclaim(&key);
                return;
            }
            Err(e) => e,
        };
        // The failed write gave its reservation back.
        let charged = l2.charge(object_file_bytes(len));
        let capacity_full = matches!(failure, Error::OutOfSpace(_)) && !l2.would_fit(charged);
        let mut st = inner.lock();
        st.count(Counter::L2WriteErrors, 1);
        let wanted = st
            .objects
            .get(&key)
            .is_some_and(|o| o.refs() > 0 || !o.idle_holds());
        let retry = wanted && !capacity_full && !l2.is_poisoned();
        if retry {
            if matches!(failure, Error::OutOfSpace(_)) {
                inner.upkeep.note_disk_full(failure.to_string());
            }
            let next = RetryWrite {
                key,
                offset,
                len,
                attempt: attempt + 1,
            };
            if inner.upkeep.schedule(next) {
                log::warn!(
                    "L2 write of object {key} failed (attempt {}): {failure}; retrying while its \
                     L1 copy stays pinned",
                    attempt + 1
                );
                st.count(Counter::L2WriteRetries, 1);
                return;
            }
        }
        if wanted {
            log::error!(
                "L2 write of object {key} failed and is not retried: {failure}; its generations \
                 stay in L1 only (not durable)"
            );
        }
        st.end_io(&key);
        if let Some(obj) = st.objects.get_mut(&key) {
            obj.l2 = L2::Absent;
        }
        if capacity_full && wanted {
            // L2 filled up meanwhile: back through the queue, which evicts.
            st.l2_writes.push(key);
        }
        st.maybe_reclaim(&key);
    });
}

/// Runs a write whose retry came due (on the upkeep thread): writes again
/// if a generation still needs the object, else releases its hold.
pub(super) fn retry_write(inner: &Arc<Inner>, write: RetryWrite) {
    let wanted = {
        let st = inner.lock();
        st.objects
            .get(&write.key)
            .is_some_and(|o| o.refs() > 0 || !o.idle_holds())
    };
    if !wanted {
        give_up_write(inner, &write);
        return;
    }
    let reserved = inner
        .l2
        .as_ref()
        .is_some_and(|l2| l2.try_reserve(charge(inner, write.len)));
    if reserved {
        submit_write(inner, write.key, write.offset, write.len, write.attempt);
    } else {
        // L2 filled up meanwhile: back through the queue, which evicts.
        give_up_write(inner, &write);
        inner.lock().l2_writes.push(write.key);
    }
}

/// Releases a waiting retry's hold without writing.
fn give_up_write(inner: &Arc<Inner>, write: &RetryWrite) {
    let mut st = inner.lock();
    st.end_io(&write.key);
    if let Some(obj) = st.objects.get_mut(&write.key) {
        obj.l2 = L2::Absent;
    }
    st.maybe_reclaim(&write.key);
}

impl Inner {
    /// Waits until no L2 write is queued or running (every listed
    /// generation durable), up to `timeout`.
    pub(super) fn wait_l2_idle(self: &Arc<Self>, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let idle = {
                let st = self.state.state.lock();
                !st.objects
                    .values()
                    .any(|o| o.l2 == L2::Queued || !o.idle_io())
            };
            let io_idle = self.io.lock().as_ref().is_none_or(|io| io.queued() == 0);
            if idle && io_idle {
                flush(self);
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Stops the I/O pool after its queued jobs ran, then performs what
    /// they queued. Runs on the thread that owns the service, so that no
    /// I/O thread ever drops the last reference (it would join itself).
    pub(super) fn drain_io(self: &Arc<Self>) {
        // The shared tier first: its uploads read pages this drain releases.
        #[cfg(feature = "shared-tier")]
        if let Some(side) = &self.shared {
            side.stop();
        }
        // Retries first: one last attempt each, on the pool (still running).
        let waiting = self.upkeep.stop();
        if !waiting.is_empty() {
            log::info!(
                "closing: {} L2 write(s) waiting for a retry are attempted once more",
                waiting.len()
            );
        }
        for write in waiting {
            let wanted = {
                let st = self.lock();
                st.objects
                    .get(&write.key)
                    .is_some_and(|o| o.refs() > 0 || !o.idle_holds())
            };
            let reserved = wanted
                && self
                    .l2
                    .as_ref()
                    .is_some_and(|l2| l2.try_reserve(charge(self, write.len)));
            if reserved {
                // The upkeep is stopped: a failure now is given up.
                submit_write(self, write.key, write.offset, write.len, write.attempt);
            } else {
                give_up_write(self, &write);
            }
        }
        if let Some(io) = self.io.lock().take() {
            io.shutdown();
        }
        flush(self);
    }
}
