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

/// Performs the side effects queued in the state, outside its lock.
pub(super) fn flush(inner: &Arc<Inner>) {
    flush_once(inner, true);
}

/// One round of side effects. When L2 is full, the first round evicts L2
/// objects (see [`State::evict_l2`]) and a second round writes what now fits.
fn flush_once(inner: &Arc<Inner>, may_evict: bool) {
    let mut evicted = false;
    let (writes, deletes, durable, retire, loads) = {
        let mut st = inner.state.state.lock();
        let mut writes = Vec::new();
        let mut waiting = Vec::new();
        for key in std::mem::take(&mut st.l2_writes) {
            let planned = st.l2_queued_bytes;
            let fits = inner.l2.as_ref().is_some_and(|l2| {
                st.objects
                    .get(&key)
                    .is_some_and(|o| l2.would_fit(planned + object_file_bytes(o.page_bytes)))
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
                let bytes = obj.page_bytes;
                st.start_io(&key);
                writes.push((key, slot.offset, bytes));
                st.l2_queued_bytes += object_file_bytes(bytes);
            }
        }
        if !waiting.is_empty() {
            if let Some(l2) = inner.l2.as_ref().filter(|_| may_evict) {
                let need: u64 = waiting
                    .iter()
                    .filter_map(|k| st.objects.get(k))
                    .map(|o| object_file_bytes(o.page_bytes))
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
                st.count(Counter::L2SkippedFull, waiting.len() as u64);
            }
        }
        (
            writes,
            std::mem::take(&mut st.l2_deletes),
            std::mem::take(&mut st.newly_durable),
            std::mem::take(&mut st.to_retire),
            std::mem::take(&mut st.loads),
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
                log::warn!("deleting L2 object {} failed: {e}", key.hex());
            }
        }
    }
    if !deletes.is_empty() {
        inner.state.state.lock().l2_deletes_done(&deletes);
        inner.state.changed.notify_all();
    }
    for (key, offset, len) in loads {
        submit_load(inner, key, offset, len);
    }
    for (key, offset, len) in writes {
        submit_write(inner, key, offset, len);
    }
    if evicted {
        // The evicted files are deleted now: write what waited for space.
        flush_once(inner, false);
    }
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
        // SAFETY: the slot belongs to an object in state Loading; no lease
        // exposes it and nothing else writes it until this job completes.
        let result = page_len(len)
            .and_then(|len| unsafe { inner.pool.slice_mut(offset, len) })
            .and_then(|buf| l2.read(&key, buf));
        let mut st = inner.lock();
        st.end_io(&key);
        let waiters = st
            .objects
            .get_mut(&key)
            .map(|obj| std::mem::take(&mut obj.waiters))
            .unwrap_or_default();
        match result {
            Ok(()) => {
                st.set_ready(&key);
                for w in waiters {
                    let pos = st.retrieve_leases.get(&w).and_then(|l| {
                        l.keys
                            .iter()
                            .enumerate()
                            .position(|(i, k)| *k == key && !l.held[i])
                    });
                    if let Some(pos) = pos {
                        st.add_reader(&key);
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
                log::warn!("L2 read of object {} failed: {e}", key.hex());
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
                if proof {
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

/// Writes a `Ready` object's bytes to its durable L2 file.
fn submit_write(inner: &Arc<Inner>, key: ObjectKey, offset: u64, len: u64) {
    submit_l2_job(inner, move |inner, l2| {
        // SAFETY: the object is Ready (immutable) and its `io` count keeps the
        // slot from being freed or reused until this job has finished.
        let result = page_len(len)
            .and_then(|len| unsafe { inner.pool.slice(offset, len) })
            .and_then(|bytes| l2.write(&key, bytes));
        let mut st = inner.lock();
        st.l2_queued_bytes = st.l2_queued_bytes.saturating_sub(object_file_bytes(len));
        st.end_io(&key);
        match result {
            Ok(_) => st.mark_durable(&key),
            Err(e) => {
                log::warn!("L2 write of object {} failed: {e}", key.hex());
                st.count(Counter::L2WriteErrors, 1);
                if let Some(obj) = st.objects.get_mut(&key) {
                    obj.l2 = L2::Absent;
                }
            }
        }
        st.maybe_reclaim(&key);
    });
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
        if let Some(io) = self.io.lock().take() {
            io.shutdown();
        }
        flush(self);
    }
}
