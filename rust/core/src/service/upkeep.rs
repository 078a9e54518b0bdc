//! Upkeep: the service's background thread for what must happen later —
//! L2 writes retried with backoff, and store admission refused while the
//! disk is full, until space returns.
//!
//! # Retried writes (a generation is never lost to a transient error)
//!
//! An L2 write that fails for a reason that can pass (no space on the disk,
//! no free file descriptor, an I/O error before the file was fsynced) is
//! retried after 100 ms, doubling up to [`MAX_BACKOFF`], for as long as a
//! listed or pending generation references the object. Meanwhile the object
//! keeps its background-I/O hold, so its L1 copy is never evicted or
//! cleared: the bytes the write needs stay in the pool. A write refused by
//! a poisoned tier (a failed fsync, see `store::l2`) is not retried. At
//! close, every retry still waiting is attempted once more.
//!
//! # Refusing stores while the disk is full
//!
//! When the directory could be opened only read-only (the disk holding the
//! index is full at start), or a write failed for lack of space, `begin`
//! refuses new generations with [`Error::OutOfSpace`] saying why, while
//! everything durable stays readable. The thread checks every
//! [`SPACE_PROBE`] whether space returned: it reopens the directory for
//! writing (then performs the retirements start-up had to defer) and clears
//! the disk-full state once the tiers' filesystems have room again and no
//! write is waiting for a retry.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::Inner;
use crate::error::{Error, Result};
use crate::store::ObjectKey;

/// First retry delay of a failed L2 write.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// Longest retry delay of a failed L2 write.
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How often a store refusal checks whether space returned.
pub(super) const SPACE_PROBE: Duration = Duration::from_secs(1);
/// Free bytes a filesystem needs before stores are admitted again.
const FREE_TO_RECOVER: u64 = 256 << 10;

/// An L2 write waiting for its retry (the object keeps its I/O hold).
#[derive(Debug, Clone, Copy)]
pub(super) struct RetryWrite {
    pub key: ObjectKey,
    pub offset: u64,
    pub len: u64,
    /// Attempts so far (1 after the first failure).
    pub attempt: u32,
}

impl RetryWrite {
    /// The delay before the next attempt.
    fn backoff(&self) -> Duration {
        let shift = self.attempt.saturating_sub(1).min(16);
        FIRST_BACKOFF.saturating_mul(1 << shift).min(MAX_BACKOFF)
    }
}

#[derive(Default)]
struct UpkeepState {
    retries: BTreeMap<(Instant, u64), RetryWrite>,
    seq: u64,
    stopped: bool,
    /// Why the disk counts as full (a failed write), if it does.
    disk_full: Option<String>,
}

/// The upkeep thread and what it works on (see the [module docs](self)).
#[derive(Default)]
pub(super) struct Upkeep {
    state: Mutex<UpkeepState>,
    wake: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Where the tiers live, for the free-space check.
    paths: Mutex<Vec<PathBuf>>,
}

impl Upkeep {
    /// Starts the thread (it holds the service only while it works).
    pub(super) fn start(inner: &Arc<Inner>) -> Result<()> {
        let mut paths = Vec::new();
        if let Some(index) = &inner.config.checkpoint_index_path {
            paths.push(
                index
                    .parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .map_or_else(|| PathBuf::from("."), PathBuf::from),
            );
        }
        if let Some(l2) = &inner.config.l2_path {
            paths.push(l2.clone());
        }
        *inner.upkeep.paths.lock() = paths;
        let weak = Arc::downgrade(inner);
        let handle = std::thread::Builder::new()
            .name("lmcache-rc-upkeep".into())
            .spawn(move || run(weak))
            .map_err(|e| Error::io("start the upkeep thread", e))?;
        *inner.upkeep.thread.lock() = Some(handle);
        Ok(())
    }

    /// Schedules a retry; false when the thread stopped (closing).
    pub(super) fn schedule(&self, write: RetryWrite) -> bool {
        let mut st = self.state.lock();
        if st.stopped {
            return false;
        }
        let due = Instant::now() + write.backoff();
        st.seq += 1;
        let seq = st.seq;
        st.retries.insert((due, seq), write);
        drop(st);
        self.wake.notify_all();
        true
    }

    /// L2 writes waiting for a retry.
    pub(super) fn retries_waiting(&self) -> usize {
        self.state.lock().retries.len()
    }

    /// Records that a write failed for lack of space.
    pub(super) fn note_disk_full(&self, why: String) {
        let mut st = self.state.lock();
        if st.disk_full.is_none() {
            log::warn!("stores are refused until space returns: {why}");
        }
        st.disk_full = Some(why);
        drop(st);
        self.wake.notify_all();
    }

    /// Why the disk counts as full, if it does.
    pub(super) fn disk_full(&self) -> Option<String> {
        self.state.lock().disk_full.clone()
    }

    /// Clears the disk-full state (a write succeeded, or space returned).
    pub(super) fn clear_disk_full(&self) {
        if self.state.lock().disk_full.take().is_some() {
            log::info!("space returned: stores are admitted again");
        }
    }

    /// Stops the thread and returns the retries it had not run yet.
    pub(super) fn stop(&self) -> Vec<RetryWrite> {
        let pending = {
            let mut st = self.state.lock();
            st.stopped = true;
            std::mem::take(&mut st.retries)
        };
        self.wake.notify_all();
        if let Some(handle) = self.thread.lock().take()
            && handle.thread().id() != std::thread::current().id()
            && handle.join().is_err()
        {
            log::error!("the upkeep thread panicked");
        }
        pending.into_values().collect()
    }

    /// Whether every tier's filesystem has room for stores again.
    fn space_returned(&self) -> bool {
        self.paths
            .lock()
            .iter()
            .all(|p| free_bytes(p) >= FREE_TO_RECOVER)
    }
}

/// Free bytes of the filesystem holding `path` (for unprivileged users);
/// u64::MAX when it cannot be told.
pub(super) fn free_bytes(path: &std::path::Path) -> u64 {
    match rustix::fs::statvfs(path) {
        Ok(v) => v.f_bavail.saturating_mul(v.f_frsize.max(1)),
        Err(_) => u64::MAX,
    }
}

/// The thread: runs due retries, probes for space while stores are refused.
/// It holds the service between steps; the service's close stops it (and
/// joins it) before the service is dropped.
fn run(weak: Weak<Inner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let refusing = inner.upkeep.disk_full().is_some() || inner.dir.read_only().is_some();
        let due = {
            let mut st = inner.upkeep.state.lock();
            if st.stopped {
                return;
            }
            let now = Instant::now();
            let next = st.retries.keys().next().map(|(at, _)| *at);
            let mut until = next.unwrap_or(now + Duration::from_secs(3600));
            if refusing {
                until = until.min(now + SPACE_PROBE);
            }
            if until > now {
                let _ = inner.upkeep.wake.wait_until(&mut st, until);
            }
            if st.stopped {
                return;
            }
            let now = Instant::now();
            let mut due = Vec::new();
            while let Some(entry) = st.retries.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                due.push(entry.remove());
            }
            due
        };
        for write in due {
            super::tiers::retry_write(&inner, write);
        }
        if refusing {
            probe_space(&inner);
        }
    }
}

/// While stores are refused: reopen the directory for writing, clear the
/// disk-full state once there is room again.
fn probe_space(inner: &Arc<Inner>) {
    if inner.dir.read_only().is_some() {
        match inner.dir.reopen_writable() {
            Ok(true) => {
                log::info!("the checkpoint directory is writable again");
                super::open::retire_deferred(inner);
            }
            Ok(false) => {}
            Err(e) => log::debug!("the checkpoint directory is still read-only: {e}"),
        }
    }
    if inner.upkeep.disk_full().is_some()
        && inner.upkeep.retries_waiting() == 0
        && inner.upkeep.space_returned()
    {
        inner.upkeep.clear_disk_full();
        super::open::retire_deferred(inner);
    }
}
