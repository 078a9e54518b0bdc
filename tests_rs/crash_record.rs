//! The recording layer of the crash-image tests (`crash_images.rs`): every
//! write, truncate, fsync, create, rename, unlink, mkdir and directory fsync
//! that the L2 tier (through [`RecordingFs`], an [`Fs`]) and SQLite (through
//! the test VFS [`VFS_NAME`], registered with `sqlite3_vfs_register` and
//! wrapping the default unix VFS) make under the recorded root is appended
//! to one ordered log. The directory's own fsyncs of its log (group commit,
//! `rust/core/src/index/durability.rs`) reach the log through the index's
//! fsync hook.
//!
//! One root is recorded at a time ([`Session`] holds a process-wide lock).
//! A sync is logged *before* it runs, so a write that lands while it runs is
//! logged after it and counted, conservatively, as not covered by it; every
//! other operation is logged after it succeeded.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use lmcache_rc_core::store::l2::{DirEntryInfo, Fs, ReadFile, RealFs, WriteFile};
use parking_lot::{Mutex, MutexGuard};
use rusqlite::ffi;

/// One recorded operation; files and directories are named by path.
#[derive(Clone, Debug)]
pub enum Rec {
    /// A directory was created.
    Mkdir(PathBuf),
    /// A new, empty file was created.
    Create(PathBuf),
    /// `data` was written at `offset`.
    Write(PathBuf, u64, Vec<u8>),
    /// The file was cut (or grown) to this length.
    Truncate(PathBuf, u64),
    /// The file's contents were fsynced.
    Sync(PathBuf),
    /// `from` was renamed to `to` (replacing it).
    Rename(PathBuf, PathBuf),
    /// The name was removed.
    Unlink(PathBuf),
    /// The directory (its entries) was fsynced.
    SyncDir(PathBuf),
    /// Not an operation: from here on the test let these generations go
    /// (a clear, or stores that may evict them), so a power cut after this
    /// point may take them away although their durable flag was synced.
    Release(Vec<String>),
}

#[derive(Default)]
struct Recorder {
    root: Option<PathBuf>,
    log: Vec<Rec>,
}

fn recorder() -> &'static Mutex<Recorder> {
    static R: OnceLock<Mutex<Recorder>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(Recorder::default()))
}

/// Appends `rec` if its path lies under the recorded root (the `-shm`
/// file is never recorded: a power cut loses shared memory).
fn record(path: &Path, rec: impl FnOnce() -> Rec) {
    let mut r = recorder().lock();
    let Some(root) = &r.root else { return };
    if !path.starts_with(root) || path.to_string_lossy().ends_with("-shm") {
        return;
    }
    let rec = rec();
    r.log.push(rec);
}

/// A recording in progress under one root; one at a time per process.
pub struct Session {
    _serial: MutexGuard<'static, ()>,
}

impl Session {
    /// Starts recording everything under `root` (an existing directory,
    /// taken as durable as it is).
    pub fn start(root: &Path) -> Session {
        static SERIAL: Mutex<()> = Mutex::new(());
        let serial = SERIAL.lock();
        install();
        let mut r = recorder().lock();
        r.root = Some(root.to_path_buf());
        r.log.clear();
        Session { _serial: serial }
    }

    /// Stops recording and returns the log, oldest first.
    pub fn finish(self) -> Vec<Rec> {
        let mut r = recorder().lock();
        r.root = None;
        std::mem::take(&mut r.log)
    }
}

/// Appends an empty [`Rec::Release`] to the running recording; returns its
/// place for [`fill_release`].
pub fn mark_release() -> usize {
    let mut r = recorder().lock();
    r.log.push(Rec::Release(Vec::new()));
    r.log.len() - 1
}

/// Names the generations a [`mark_release`] marker let go (known only
/// after the operation that follows the marker).
pub fn fill_release(at: usize, generations: Vec<String>) {
    let mut r = recorder().lock();
    r.log[at] = Rec::Release(generations);
}

/// Roots under which every SQLite sync through the test VFS first sleeps
/// (a slow disk), with the sleep.
fn slow_roots() -> &'static Mutex<Vec<(PathBuf, Duration)>> {
    static S: OnceLock<Mutex<Vec<(PathBuf, Duration)>>> = OnceLock::new();
    S.get_or_init(|| Mutex::new(Vec::new()))
}

/// While alive, SQLite's syncs of files under a root (through the test VFS
/// [`VFS_NAME`]) each take `delay` longer, as on a slow disk. Nothing is
/// recorded unless a [`Session`] runs too.
pub struct SlowSyncs {
    root: PathBuf,
}

impl SlowSyncs {
    /// Slows the syncs under `root` (installing the test VFS if needed).
    pub fn under(root: &Path, delay: Duration) -> SlowSyncs {
        install();
        slow_roots().lock().push((root.to_path_buf(), delay));
        SlowSyncs {
            root: root.to_path_buf(),
        }
    }
}

impl Drop for SlowSyncs {
    fn drop(&mut self) {
        slow_roots().lock().retain(|(r, _)| r != &self.root);
    }
}

fn sync_delay(path: &Path) -> Option<Duration> {
    let roots = slow_roots().lock();
    roots
        .iter()
        .find(|(r, _)| path.starts_with(r))
        .map(|(_, d)| *d)
}

fn on_index_fsync(path: &Path) {
    if path.is_dir() {
        record(path, || Rec::SyncDir(path.to_path_buf()));
    } else {
        record(path, || Rec::Sync(path.to_path_buf()));
    }
}

/// Registers the VFS and the fsync hook (once per process).
fn install() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        assert!(
            lmcache_rc_core::index::set_fsync_hook(on_index_fsync),
            "the index fsync hook was installed elsewhere"
        );
        register_vfs();
    });
}

// ---------------------------------------------------------------- L2: Fs

/// The real filesystem, every change recorded.
#[derive(Clone, Default)]
pub struct RecordingFs {
    inner: RealFs,
}

struct RecordingWriteFile {
    inner: Box<dyn WriteFile>,
    path: PathBuf,
    offset: u64,
}

impl WriteFile for RecordingWriteFile {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.inner.write_all(buf)?;
        let at = self.offset;
        self.offset += buf.len() as u64;
        record(&self.path, || {
            Rec::Write(self.path.clone(), at, buf.to_vec())
        });
        Ok(())
    }

    fn sync_all(&mut self) -> io::Result<()> {
        record(&self.path, || Rec::Sync(self.path.clone()));
        self.inner.sync_all()
    }
}

impl Fs for RecordingFs {
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let missing: Vec<PathBuf> = path
            .ancestors()
            .take_while(|p| !p.exists())
            .map(Path::to_path_buf)
            .collect();
        self.inner.create_dir_all(path)?;
        for dir in missing.into_iter().rev() {
            record(&dir, || Rec::Mkdir(dir.clone()));
        }
        Ok(())
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        self.inner.create_dir(path)?;
        record(path, || Rec::Mkdir(path.to_path_buf()));
        Ok(())
    }

    fn create_new(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        let inner = self.inner.create_new(path)?;
        record(path, || Rec::Create(path.to_path_buf()));
        Ok(Box::new(RecordingWriteFile {
            inner,
            path: path.to_path_buf(),
            offset: 0,
        }))
    }

    fn open_read(&self, path: &Path) -> io::Result<Box<dyn ReadFile>> {
        self.inner.open_read(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.inner.rename(from, to)?;
        record(to, || Rec::Rename(from.to_path_buf(), to.to_path_buf()));
        Ok(())
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        record(path, || Rec::SyncDir(path.to_path_buf()));
        self.inner.sync_dir(path)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.inner.remove_file(path)?;
        record(path, || Rec::Unlink(path.to_path_buf()));
        Ok(())
    }

    fn file_len(&self, path: &Path) -> io::Result<u64> {
        self.inner.file_len(path)
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<DirEntryInfo>> {
        self.inner.read_dir(path)
    }
}

/// A shared [`RecordingFs`] for `CheckpointService::open_with_fs`.
pub fn recording_fs() -> Arc<dyn Fs> {
    Arc::new(RecordingFs::default())
}

// ------------------------------------------------------------ SQLite: VFS

/// The name the recording VFS is registered under.
pub const VFS_NAME: &str = "lmrc-crash-record";
const VFS_NAME_C: &CStr = c"lmrc-crash-record";

/// The file object SQLite allocates for us (`szOsFile` bytes): our methods,
/// then the real file (allocated separately) and its path.
#[repr(C)]
struct RecFile {
    base: ffi::sqlite3_file,
    real: *mut ffi::sqlite3_file,
    real_size: usize,
    path: *mut Option<PathBuf>,
    /// Fsync the parent directory after the first sync, as the unix VFS
    /// does for a log it opened with `SQLITE_OPEN_CREATE`.
    dirsync: bool,
}

fn inner_vfs(vfs: *mut ffi::sqlite3_vfs) -> *mut ffi::sqlite3_vfs {
    // SAFETY: our VFS's pAppData is the default VFS, set at registration.
    unsafe { (*vfs).pAppData.cast() }
}

/// The file's path (None for temporary files SQLite names itself).
///
/// # Safety
/// `f` is a `RecFile` opened by `x_open`.
unsafe fn path_of<'a>(f: *mut ffi::sqlite3_file) -> Option<&'a Path> {
    // SAFETY: per the contract, f is a RecFile whose path box lives until xClose.
    unsafe { (*(*f.cast::<RecFile>()).path).as_deref() }
}

/// The real file behind `f`.
///
/// # Safety
/// `f` is a `RecFile` opened by `x_open`.
unsafe fn real(f: *mut ffi::sqlite3_file) -> *mut ffi::sqlite3_file {
    // SAFETY: per the contract.
    unsafe { (*f.cast::<RecFile>()).real }
}

macro_rules! forward {
    ($f:expr, $method:ident $(, $arg:expr)*) => {{
        // SAFETY: the real file was opened by the default VFS, whose methods
        // are set; the arguments are SQLite's own.
        unsafe {
            let r = real($f);
            match (*(*r).pMethods).$method {
                Some(m) => m(r $(, $arg)*),
                None => ffi::SQLITE_IOERR,
            }
        }
    }};
}

unsafe extern "C" fn x_close(f: *mut ffi::sqlite3_file) -> c_int {
    let rc = forward!(f, xClose);
    // SAFETY: f is a RecFile; its real file and path were allocated in x_open.
    unsafe {
        let rf = f.cast::<RecFile>();
        let layout = std::alloc::Layout::from_size_align((*rf).real_size, 16).expect("layout");
        std::alloc::dealloc((*rf).real.cast(), layout);
        drop(Box::from_raw((*rf).path));
        (*rf).base.pMethods = std::ptr::null();
    }
    rc
}

unsafe extern "C" fn x_read(
    f: *mut ffi::sqlite3_file,
    buf: *mut c_void,
    amt: c_int,
    off: ffi::sqlite3_int64,
) -> c_int {
    forward!(f, xRead, buf, amt, off)
}

unsafe extern "C" fn x_write(
    f: *mut ffi::sqlite3_file,
    buf: *const c_void,
    amt: c_int,
    off: ffi::sqlite3_int64,
) -> c_int {
    let rc = forward!(f, xWrite, buf, amt, off);
    // SAFETY: f is a RecFile; buf holds amt bytes (SQLite's contract).
    unsafe {
        if rc == ffi::SQLITE_OK
            && let Some(p) = path_of(f)
        {
            let data = std::slice::from_raw_parts(buf.cast::<u8>(), amt as usize);
            record(p, || Rec::Write(p.to_path_buf(), off as u64, data.to_vec()));
        }
    }
    rc
}

unsafe extern "C" fn x_truncate(f: *mut ffi::sqlite3_file, size: ffi::sqlite3_int64) -> c_int {
    let rc = forward!(f, xTruncate, size);
    // SAFETY: f is a RecFile opened by x_open.
    let path = unsafe { path_of(f) };
    if rc == ffi::SQLITE_OK
        && let Some(p) = path
    {
        record(p, || Rec::Truncate(p.to_path_buf(), size as u64));
    }
    rc
}

unsafe extern "C" fn x_sync(f: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    // SAFETY: f is a RecFile.
    let path = unsafe { path_of(f) };
    if let Some(p) = path {
        record(p, || Rec::Sync(p.to_path_buf()));
        if let Some(delay) = sync_delay(p) {
            std::thread::sleep(delay);
        }
    }
    let rc = forward!(f, xSync, flags);
    // SAFETY: f is a RecFile.
    unsafe {
        let rf = f.cast::<RecFile>();
        if rc == ffi::SQLITE_OK && (*rf).dirsync {
            (*rf).dirsync = false;
            if let Some(parent) = path.and_then(Path::parent) {
                record(parent, || Rec::SyncDir(parent.to_path_buf()));
            }
        }
    }
    rc
}

unsafe extern "C" fn x_file_size(
    f: *mut ffi::sqlite3_file,
    size: *mut ffi::sqlite3_int64,
) -> c_int {
    forward!(f, xFileSize, size)
}

unsafe extern "C" fn x_lock(f: *mut ffi::sqlite3_file, l: c_int) -> c_int {
    forward!(f, xLock, l)
}

unsafe extern "C" fn x_unlock(f: *mut ffi::sqlite3_file, l: c_int) -> c_int {
    forward!(f, xUnlock, l)
}

unsafe extern "C" fn x_check_reserved_lock(f: *mut ffi::sqlite3_file, out: *mut c_int) -> c_int {
    forward!(f, xCheckReservedLock, out)
}

unsafe extern "C" fn x_file_control(
    f: *mut ffi::sqlite3_file,
    op: c_int,
    arg: *mut c_void,
) -> c_int {
    forward!(f, xFileControl, op, arg)
}

unsafe extern "C" fn x_sector_size(f: *mut ffi::sqlite3_file) -> c_int {
    forward!(f, xSectorSize)
}

unsafe extern "C" fn x_device_characteristics(f: *mut ffi::sqlite3_file) -> c_int {
    forward!(f, xDeviceCharacteristics)
}

unsafe extern "C" fn x_shm_map(
    f: *mut ffi::sqlite3_file,
    pg: c_int,
    sz: c_int,
    extend: c_int,
    out: *mut *mut c_void,
) -> c_int {
    forward!(f, xShmMap, pg, sz, extend, out)
}

unsafe extern "C" fn x_shm_lock(
    f: *mut ffi::sqlite3_file,
    off: c_int,
    n: c_int,
    flags: c_int,
) -> c_int {
    forward!(f, xShmLock, off, n, flags)
}

unsafe extern "C" fn x_shm_barrier(f: *mut ffi::sqlite3_file) {
    // SAFETY: as in `forward!`.
    unsafe {
        let r = real(f);
        if let Some(m) = (*(*r).pMethods).xShmBarrier {
            m(r);
        }
    }
}

unsafe extern "C" fn x_shm_unmap(f: *mut ffi::sqlite3_file, delete: c_int) -> c_int {
    forward!(f, xShmUnmap, delete)
}

unsafe extern "C" fn x_fetch(
    f: *mut ffi::sqlite3_file,
    off: ffi::sqlite3_int64,
    amt: c_int,
    out: *mut *mut c_void,
) -> c_int {
    forward!(f, xFetch, off, amt, out)
}

unsafe extern "C" fn x_unfetch(
    f: *mut ffi::sqlite3_file,
    off: ffi::sqlite3_int64,
    p: *mut c_void,
) -> c_int {
    forward!(f, xUnfetch, off, p)
}

static METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 3,
    xClose: Some(x_close),
    xRead: Some(x_read),
    xWrite: Some(x_write),
    xTruncate: Some(x_truncate),
    xSync: Some(x_sync),
    xFileSize: Some(x_file_size),
    xLock: Some(x_lock),
    xUnlock: Some(x_unlock),
    xCheckReservedLock: Some(x_check_reserved_lock),
    xFileControl: Some(x_file_control),
    xSectorSize: Some(x_sector_size),
    xDeviceCharacteristics: Some(x_device_characteristics),
    xShmMap: Some(x_shm_map),
    xShmLock: Some(x_shm_lock),
    xShmBarrier: Some(x_shm_barrier),
    xShmUnmap: Some(x_shm_unmap),
    xFetch: Some(x_fetch),
    xUnfetch: Some(x_unfetch),
};

unsafe extern "C" fn x_open(
    vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let inner = inner_vfs(vfs);
    // SAFETY: name is null or a NUL-terminated path (SQLite's contract);
    // inner is the default VFS; file has room for a RecFile (szOsFile).
    unsafe {
        let path = if name.is_null() {
            None
        } else {
            let s = CStr::from_ptr(name).to_string_lossy().into_owned();
            Some(PathBuf::from(s))
        };
        let existed = path.as_deref().is_some_and(Path::exists);
        let real_size = (*inner).szOsFile as usize;
        let layout = std::alloc::Layout::from_size_align(real_size.max(1), 16).expect("layout");
        let real = std::alloc::alloc_zeroed(layout).cast::<ffi::sqlite3_file>();
        let Some(open) = (*inner).xOpen else {
            return ffi::SQLITE_ERROR;
        };
        let rc = open(inner, name, real, flags, out_flags);
        if rc != ffi::SQLITE_OK {
            std::alloc::dealloc(real.cast(), layout);
            (*file).pMethods = std::ptr::null();
            return rc;
        }
        if !existed && let Some(p) = &path {
            record(p, || Rec::Create(p.clone()));
        }
        let dirsync = flags & ffi::SQLITE_OPEN_CREATE != 0
            && flags & (ffi::SQLITE_OPEN_WAL | ffi::SQLITE_OPEN_MAIN_JOURNAL) != 0;
        std::ptr::write(
            file.cast::<RecFile>(),
            RecFile {
                base: ffi::sqlite3_file { pMethods: &METHODS },
                real,
                real_size: real_size.max(1),
                path: Box::into_raw(Box::new(path)),
                dirsync,
            },
        );
        ffi::SQLITE_OK
    }
}

unsafe extern "C" fn x_delete(
    vfs: *mut ffi::sqlite3_vfs,
    name: *const c_char,
    sync_dir: c_int,
) -> c_int {
    let inner = inner_vfs(vfs);
    // SAFETY: name is a NUL-terminated path; inner is the default VFS.
    unsafe {
        let Some(delete) = (*inner).xDelete else {
            return ffi::SQLITE_ERROR;
        };
        let rc = delete(inner, name, sync_dir);
        if rc == ffi::SQLITE_OK {
            let p = PathBuf::from(CStr::from_ptr(name).to_string_lossy().into_owned());
            record(&p, || Rec::Unlink(p.clone()));
            if sync_dir != 0
                && let Some(parent) = p.parent()
            {
                record(parent, || Rec::SyncDir(parent.to_path_buf()));
            }
        }
        rc
    }
}

fn register_vfs() {
    // SAFETY: sqlite3_vfs_find(NULL) initialises SQLite and returns the
    // default VFS, which lives for the process. Our VFS copies it (every
    // method but xOpen and xDelete is the default's, called with our VFS,
    // which the unix methods do not look into), is leaked (SQLite keeps the
    // pointer) and registered once, not as the default.
    unsafe {
        let default = ffi::sqlite3_vfs_find(std::ptr::null());
        assert!(!default.is_null(), "no default SQLite VFS");
        let mut vfs: ffi::sqlite3_vfs = std::ptr::read(default);
        vfs.pNext = std::ptr::null_mut();
        vfs.zName = VFS_NAME_C.as_ptr();
        vfs.szOsFile = std::mem::size_of::<RecFile>() as c_int;
        vfs.pAppData = default.cast();
        vfs.xOpen = Some(x_open);
        vfs.xDelete = Some(x_delete);
        let vfs = Box::leak(Box::new(vfs));
        assert_eq!(ffi::sqlite3_vfs_register(vfs, 0), ffi::SQLITE_OK);
    }
}
