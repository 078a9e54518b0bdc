//! Group commit of durability: many write transactions, one fsync.
//!
//! Every write transaction of a file-backed directory commits with
//! `synchronous=NORMAL`: SQLite appends its frames to the write-ahead log
//! (`<file>-wal`) and returns without an fsync. A process crash loses nothing
//! committed (the frames are in the kernel's page cache); a power cut can lose
//! a suffix of the commits since the last fsync of the log, never a part of
//! one (frame checksums chain across the log, so recovery stops at the first
//! frame that did not reach the disk, and it keeps whole transactions only).
//!
//! Operations whose answer promises durability ([`Directory::mark_durable`])
//! number their commit with [`Syncer::committed`] under the directory lock
//! and then, *outside* that lock, call [`Syncer::sync_through`] with the
//! number. One caller at a time runs the fsync (the leader); it first reads
//! the latest commit number, so its fsync covers every commit numbered so far,
//! whoever made it. Callers that arrive while an fsync runs wait for it and
//! return at once if it covered them; the rest elect the next leader. So
//! concurrent callers share fsyncs, and lookups and publications never wait
//! for one (they need the directory lock only, which no fsync holds).
//!
//! Why an fsync of the log file makes a commit durable even if SQLite moved
//! it: while the connection is open the log is the same file (SQLite resets
//! it in place and deletes it only when the last connection closes). A
//! checkpoint copies log frames into the database file; SQLite (at
//! `synchronous=NORMAL`) syncs the log before copying and the database file
//! after, and it overwrites log frames only once a checkpoint has copied and
//! synced them all. So a committed frame is, at any moment, in the log (our
//! fsync covers it) or in the synced database file. The log's directory entry
//! is synced once after open, as SQLite itself does on its first log sync.
//!
//! A failed fsync cannot be retried safely (the kernel may have dropped the
//! dirty pages): the syncer is poisoned and every later durable operation of
//! this directory fails until it is reopened.
//!
//! [`Directory::mark_durable`]: super::Directory::mark_durable

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};

#[derive(Debug, Default)]
struct SyncState {
    /// Every commit numbered up to this one is on disk.
    synced: u64,
    /// A leader is running an fsync now.
    running: bool,
    /// The log's directory entry has been synced since open.
    parent_synced: bool,
    /// Why the syncer is poisoned (an fsync failed).
    failed: Option<String>,
}

/// Group commit of the directory's durability; see the module docs.
#[derive(Debug)]
pub(super) struct Syncer {
    /// The database file, synced when no log exists.
    db: PathBuf,
    /// The write-ahead log file.
    wal: PathBuf,
    /// The directory holding both.
    parent: PathBuf,
    /// Number of the latest write commit.
    commits: AtomicU64,
    /// Fsyncs run (for tests and counters).
    fsyncs: AtomicU64,
    state: Mutex<SyncState>,
    done: Condvar,
}

impl Syncer {
    /// A syncer for the database file `db` (already open in WAL mode).
    pub fn new(db: &Path) -> Syncer {
        let mut wal = db.as_os_str().to_owned();
        wal.push("-wal");
        let parent = match db.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        Syncer {
            db: db.to_path_buf(),
            wal: PathBuf::from(wal),
            parent,
            commits: AtomicU64::new(0),
            fsyncs: AtomicU64::new(0),
            state: Mutex::new(SyncState::default()),
            done: Condvar::new(),
        }
    }

    /// Records that a write transaction committed; returns its number. Call
    /// it after the commit returned, before the directory lock is released.
    pub fn committed(&self) -> u64 {
        self.commits.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The number of the latest commit.
    pub fn latest(&self) -> u64 {
        self.commits.load(Ordering::SeqCst)
    }

    /// Fsyncs run since open.
    pub fn fsyncs(&self) -> u64 {
        self.fsyncs.load(Ordering::Relaxed)
    }

    /// Returns once every commit numbered up to `seq` is on disk, running or
    /// joining a shared fsync (see the module docs). Never call it with the
    /// directory lock held.
    pub fn sync_through(&self, seq: u64) -> Result<()> {
        let mut st = self.state.lock();
        loop {
            if let Some(why) = &st.failed {
                return Err(poisoned(why));
            }
            if st.synced >= seq {
                return Ok(());
            }
            if !st.running {
                break;
            }
            self.done.wait(&mut st);
        }
        // Leader: this fsync covers every commit numbered so far.
        st.running = true;
        let target = self.latest();
        let sync_parent = !st.parent_synced;
        drop(st);
        let result = self.fsync(sync_parent);
        let mut st = self.state.lock();
        st.running = false;
        match &result {
            Ok(()) => {
                st.synced = st.synced.max(target);
                st.parent_synced = true;
            }
            Err(e) => st.failed = Some(e.to_string()),
        }
        self.done.notify_all();
        result
    }

    /// Fsyncs the log (or the database file when there is no log) and, when
    /// asked, the directory holding them.
    fn fsync(&self, sync_parent: bool) -> Result<()> {
        self.fsyncs.fetch_add(1, Ordering::Relaxed);
        let (file, path) = match std::fs::File::open(&self.wal) {
            Ok(f) => (f, &self.wal),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (
                std::fs::File::open(&self.db)
                    .map_err(|e| Error::io(format!("open {}", self.db.display()), e))?,
                &self.db,
            ),
            Err(e) => return Err(Error::io(format!("open {}", self.wal.display()), e)),
        };
        // Announced before it runs: a write that lands during the fsync is
        // then, conservatively, one it may not cover.
        if let Some(hook) = FSYNC_HOOK.get() {
            hook(path);
        }
        file.sync_data()
            .map_err(|e| Error::io(format!("fsync {}", self.wal.display()), e))?;
        if sync_parent {
            if let Some(hook) = FSYNC_HOOK.get() {
                hook(&self.parent);
            }
            std::fs::File::open(&self.parent)
                .and_then(|d| d.sync_all())
                .map_err(|e| Error::io(format!("fsync {}", self.parent.display()), e))?;
        }
        Ok(())
    }
}

/// Test hook: called with the path of every fsync the syncer runs itself
/// (the log, or the database file, and the directory holding them), just
/// before it runs. The fsyncs SQLite runs go through its VFS instead
/// ([`super::DirectoryConfig::vfs`]). Crash-image tests record both
/// (`tests_rs/crash_images.rs`).
static FSYNC_HOOK: std::sync::OnceLock<fn(&Path)> = std::sync::OnceLock::new();

/// Installs the process-wide fsync hook (see [`FSYNC_HOOK`]); false when one
/// was installed already (it stays).
#[doc(hidden)]
pub fn set_fsync_hook(hook: fn(&Path)) -> bool {
    FSYNC_HOOK.set(hook).is_ok()
}

fn poisoned(why: &str) -> Error {
    Error::Database(format!(
        "an fsync of the checkpoint directory failed earlier ({why}); nothing more can be \
         made durable until the directory is reopened"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concurrent_callers_share_fsyncs_and_never_return_early() {
        let tmp = tempfile::tempdir().unwrap();
        let db = tmp.path().join("d.sqlite3");
        std::fs::write(&db, b"x").unwrap();
        let s = Syncer::new(&db);
        assert_eq!(s.wal, tmp.path().join("d.sqlite3-wal"));
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| {
                    for _ in 0..50 {
                        let seq = s.committed();
                        s.sync_through(seq).unwrap();
                        assert!(s.state.lock().synced >= seq);
                    }
                });
            }
        });
        assert_eq!(s.latest(), 400);
        assert!(s.fsyncs() <= 400);
        // Already covered: no new fsync.
        let before = s.fsyncs();
        s.sync_through(400).unwrap();
        assert_eq!(s.fsyncs(), before);
    }

    #[test]
    fn a_failed_fsync_poisons_the_syncer() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Syncer::new(&tmp.path().join("missing.sqlite3"));
        let seq = s.committed();
        assert!(s.sync_through(seq).is_err());
        let err = s.sync_through(0).unwrap_err().to_string();
        assert!(err.contains("failed earlier"), "{err}");
    }
}
