//! Fault injection for the L2 tier: [`FaultyFs`] wraps [`RealFs`] and can be
//! told, at run time, to fail the next N operations of a kind with a given
//! `io::ErrorKind`, to flip a byte in what reads return, and it counts and
//! records every operation in order (so tests can check the durable order
//! `write → fsync file → rename → fsync dir`).
//!
//! Not behind `cfg(test)`: the integration tests and the Python tests use it.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use super::fs::{DirEntryInfo, Fs, ReadFile, RealFs, WriteFile};

/// A kind of filesystem operation, as counted and recorded by [`FaultyFs`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Op {
    /// [`Fs::create_dir_all`] or [`Fs::create_dir`].
    CreateDir,
    /// [`Fs::create_new`].
    CreateFile,
    /// One [`WriteFile::write_all`] call.
    Write,
    /// [`WriteFile::sync_all`] (fsync of a file).
    SyncFile,
    /// [`Fs::rename`].
    Rename,
    /// [`Fs::sync_dir`] (fsync of a directory).
    SyncDir,
    /// [`Fs::open_read`].
    OpenRead,
    /// One [`ReadFile::read_exact_at`] call.
    Read,
    /// [`Fs::remove_file`].
    Remove,
    /// [`Fs::file_len`] or [`ReadFile::len`].
    Stat,
    /// [`Fs::read_dir`].
    ReadDir,
}

/// One recorded operation.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct OpRecord {
    /// What was done.
    pub op: Op,
    /// The path it was done to (for a rename: the source).
    pub path: PathBuf,
    /// For a rename, the destination.
    pub to: Option<PathBuf>,
    /// Whether the operation failed (injected or real).
    pub failed: bool,
}

/// A fault armed for one kind of operation.
#[derive(Clone, Copy)]
struct Fault {
    /// Operations to let through before failing.
    skip: u32,
    /// Operations still to fail.
    left: u32,
    kind: io::ErrorKind,
}

#[derive(Default)]
struct State {
    faults: HashMap<Op, Fault>,
    /// (file offset, reads left) of armed byte flips.
    flips: Vec<(u64, u32)>,
    counts: HashMap<Op, u64>,
    /// Armed holds ([`FaultyFs::hold`]).
    holds: HashMap<Op, Arc<Gate>>,
    bytes_written: u64,
    bytes_read: u64,
    log: Vec<OpRecord>,
}

impl State {
    /// Counts `op`, and consumes an armed fault for it if there is one.
    fn begin(&mut self, op: Op) -> Option<io::Error> {
        *self.counts.entry(op).or_insert(0) += 1;
        let fault = self.faults.get_mut(&op)?;
        if fault.skip > 0 {
            fault.skip -= 1;
            return None;
        }
        if fault.left == 0 {
            return None;
        }
        fault.left -= 1;
        Some(io::Error::new(
            fault.kind,
            format!("injected fault: {op:?}"),
        ))
    }

    fn record(&mut self, op: Op, path: &Path, to: Option<&Path>, failed: bool) {
        self.log.push(OpRecord {
            op,
            path: path.to_path_buf(),
            to: to.map(Path::to_path_buf),
            failed,
        });
    }
}

/// Operations of one kind held until released ([`FaultyFs::hold`]): a test
/// sees the service with an L2 operation in flight (a load `Loading`, a
/// write `Writing`) for as long as it needs.
#[derive(Default)]
pub struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Default)]
struct GateState {
    open: bool,
    waiting: u32,
}

impl Gate {
    /// Waits until `n` operations are held (false after `timeout`).
    pub fn wait_for_held(&self, n: u32, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut st = self.state.lock();
        while st.waiting < n {
            if self.changed.wait_until(&mut st, deadline).timed_out() {
                return st.waiting >= n;
            }
        }
        true
    }

    /// Lets every held operation (and every later one) through.
    pub fn release(&self) {
        self.state.lock().open = true;
        self.changed.notify_all();
    }

    fn pass(&self) {
        let mut st = self.state.lock();
        st.waiting += 1;
        self.changed.notify_all();
        while !st.open {
            self.changed.wait(&mut st);
        }
        st.waiting -= 1;
    }
}

/// An armed hold ([`FaultyFs::hold`]); dropping it releases the gate, so a
/// test that fails while operations are held does not hang the service's
/// close.
pub struct Hold(Arc<Gate>);

impl std::ops::Deref for Hold {
    type Target = Gate;
    fn deref(&self) -> &Gate {
        &self.0
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// A [`RealFs`] with faults that can be armed at run time, operation counts
/// and an operation log. Clones share the same state.
#[derive(Clone, Default)]
pub struct FaultyFs {
    inner: RealFs,
    state: Arc<Mutex<State>>,
}

impl FaultyFs {
    /// A fault-free wrapper around the real filesystem.
    pub fn new() -> FaultyFs {
        FaultyFs::default()
    }

    /// Makes the next `n` operations of kind `op` fail with `kind` (replaces
    /// any fault armed for `op`). A failing [`Op::Write`] first writes half
    /// of its buffer, as a disk that fills up mid-write would.
    pub fn fail_next(&self, op: Op, n: u32, kind: io::ErrorKind) {
        self.fail_after(op, 0, n, kind);
    }

    /// Lets the next `skip` operations of kind `op` through, then fails `n`
    /// with `kind` (replaces any fault armed for `op`).
    pub fn fail_after(&self, op: Op, skip: u32, n: u32, kind: io::ErrorKind) {
        let fault = Fault {
            skip,
            left: n,
            kind,
        };
        self.state.lock().faults.insert(op, fault);
    }

    /// Holds every later operation of kind `op` (of those that go through
    /// the filesystem itself: opens, renames, removals, directory and
    /// metadata operations) until the returned gate is released; replaces
    /// any hold armed for `op`.
    pub fn hold(&self, op: Op) -> Hold {
        let gate = Arc::new(Gate::default());
        self.state.lock().holds.insert(op, Arc::clone(&gate));
        Hold(gate)
    }

    /// Disarms every fault and byte flip.
    pub fn clear_faults(&self) {
        let mut s = self.state.lock();
        s.faults.clear();
        s.flips.clear();
    }

    /// Flips (xor 0xff) the byte at `file_offset` in the next `n` reads
    /// whose range covers that offset, in any file.
    pub fn flip_byte_on_read(&self, file_offset: u64, n: u32) {
        self.state.lock().flips.push((file_offset, n));
    }

    /// How many operations of kind `op` were attempted (failed ones included).
    pub fn count(&self, op: Op) -> u64 {
        self.state.lock().counts.get(&op).copied().unwrap_or(0)
    }

    /// Bytes successfully written through [`WriteFile::write_all`].
    pub fn bytes_written(&self) -> u64 {
        self.state.lock().bytes_written
    }

    /// Bytes successfully read through [`ReadFile::read_exact_at`].
    pub fn bytes_read(&self) -> u64 {
        self.state.lock().bytes_read
    }

    /// A copy of the operation log, oldest first.
    pub fn log(&self) -> Vec<OpRecord> {
        self.state.lock().log.clone()
    }

    /// Returns the operation log and empties it.
    pub fn take_log(&self) -> Vec<OpRecord> {
        std::mem::take(&mut self.state.lock().log)
    }

    /// Runs `f` unless a fault is armed for `op`; counts and records it.
    fn run<T>(
        &self,
        op: Op,
        path: &Path,
        to: Option<&Path>,
        f: impl FnOnce() -> io::Result<T>,
    ) -> io::Result<T> {
        let hold = self.state.lock().holds.get(&op).cloned();
        if let Some(gate) = hold {
            gate.pass();
        }
        let fault = self.state.lock().begin(op);
        let result = match fault {
            Some(e) => Err(e),
            None => f(),
        };
        self.state.lock().record(op, path, to, result.is_err());
        result
    }
}

struct FaultyWriteFile {
    inner: Box<dyn WriteFile>,
    state: Arc<Mutex<State>>,
    path: PathBuf,
}

impl WriteFile for FaultyWriteFile {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        let fault = self.state.lock().begin(Op::Write);
        let result = match fault {
            Some(e) => {
                let half = &buf[..buf.len() / 2];
                if self.inner.write_all(half).is_ok() {
                    self.state.lock().bytes_written += half.len() as u64;
                }
                Err(e)
            }
            None => {
                let r = self.inner.write_all(buf);
                if r.is_ok() {
                    self.state.lock().bytes_written += buf.len() as u64;
                }
                r
            }
        };
        self.state
            .lock()
            .record(Op::Write, &self.path, None, result.is_err());
        result
    }

    fn sync_all(&mut self) -> io::Result<()> {
        let fault = self.state.lock().begin(Op::SyncFile);
        let result = match fault {
            Some(e) => Err(e),
            None => self.inner.sync_all(),
        };
        self.state
            .lock()
            .record(Op::SyncFile, &self.path, None, result.is_err());
        result
    }
}

struct FaultyReadFile {
    inner: Box<dyn ReadFile>,
    state: Arc<Mutex<State>>,
    path: PathBuf,
}

impl ReadFile for FaultyReadFile {
    fn len(&self) -> io::Result<u64> {
        let fault = self.state.lock().begin(Op::Stat);
        let result = match fault {
            Some(e) => Err(e),
            None => self.inner.len(),
        };
        self.state
            .lock()
            .record(Op::Stat, &self.path, None, result.is_err());
        result
    }

    fn read_exact_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let fault = self.state.lock().begin(Op::Read);
        let result = match fault {
            Some(e) => Err(e),
            None => self.inner.read_exact_at(buf, offset),
        };
        let mut s = self.state.lock();
        if result.is_ok() {
            s.bytes_read += buf.len() as u64;
            let end = offset.saturating_add(buf.len() as u64);
            for (at, left) in s.flips.iter_mut() {
                if *left > 0
                    && *at >= offset
                    && *at < end
                    && let Some(byte) = usize::try_from(*at - offset)
                        .ok()
                        .and_then(|i| buf.get_mut(i))
                {
                    *byte ^= 0xff;
                    *left -= 1;
                }
            }
        }
        s.record(Op::Read, &self.path, None, result.is_err());
        result
    }
}

impl Fs for FaultyFs {
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        self.run(Op::CreateDir, path, None, || {
            self.inner.create_dir_all(path)
        })
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        self.run(Op::CreateDir, path, None, || self.inner.create_dir(path))
    }

    fn create_new(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        let inner = self.run(Op::CreateFile, path, None, || self.inner.create_new(path))?;
        Ok(Box::new(FaultyWriteFile {
            inner,
            state: Arc::clone(&self.state),
            path: path.to_path_buf(),
        }))
    }

    fn open_read(&self, path: &Path) -> io::Result<Box<dyn ReadFile>> {
        let inner = self.run(Op::OpenRead, path, None, || self.inner.open_read(path))?;
        Ok(Box::new(FaultyReadFile {
            inner,
            state: Arc::clone(&self.state),
            path: path.to_path_buf(),
        }))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.run(Op::Rename, from, Some(to), || self.inner.rename(from, to))
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        self.run(Op::SyncDir, path, None, || self.inner.sync_dir(path))
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.run(Op::Remove, path, None, || self.inner.remove_file(path))
    }

    fn file_len(&self, path: &Path) -> io::Result<u64> {
        self.run(Op::Stat, path, None, || self.inner.file_len(path))
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<DirEntryInfo>> {
        self.run(Op::ReadDir, path, None, || self.inner.read_dir(path))
    }
}
