//! The shared-memory L1 pool: one POSIX shared-memory segment, created by the
//! server (the owner) and mapped by every worker rank.
//!
//! - The server calls [`ShmPool::create`]: the segment is created with mode
//!   0600, sized, and its space is **reserved** at creation (`fallocate`), so a
//!   full `/dev/shm` fails at start with [`Error::OutOfSpace`] instead of with
//!   `SIGBUS` on a later page fault. A stale segment of the same name (left by
//!   a crashed or restarted server) is unlinked and replaced. The owner unlinks
//!   the segment when it is dropped, but only while the name still refers to
//!   its own segment (a newer server's pool is never removed).
//! - A worker calls [`ShmPool::open`]: it opens the existing segment by name
//!   (never creates it), checks its size against the negotiated pool size and
//!   never unlinks it. [`ShmPool::is_current`] tells whether the name still
//!   refers to the mapped segment, i.e. whether the server restarted and
//!   recreated its pool, so the worker should open it again.
//!
//! The memory is shared with other processes, which may read or write any byte
//! of it at any time. The pool therefore never hands out Rust references
//! implicitly: [`ShmPool::write_at`] and [`ShmPool::read_at`] copy through raw
//! pointers with bounds checks, and the zero-copy views [`ShmPool::slice`] and
//! [`ShmPool::slice_mut`] are `unsafe`, because only the caller can know that
//! the range is owned by a live lease and has no concurrent writer (invariant
//! I4 of the design: lent bytes are never recycled while a copy may touch them).
//! The server itself only hands out offsets and lengths (invariant I10).

use std::fmt;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{FallocateFlags, Mode};
use rustix::io::Errno;
use rustix::shm;

use crate::error::{Error, Result};

/// Longest accepted pool name in bytes (without the leading `/`).
pub const MAX_NAME_BYTES: usize = 200;

/// Granularity of pool sizes and of the page-touching fallback.
const PAGE: u64 = 4096;

/// Directory where Linux exposes POSIX shared-memory segments.
const SHM_DIR: &str = "/dev/shm";

/// The file under `/dev/shm` that backs the segment called `name` (a leading
/// `/` is ignored). The name is not validated here.
pub fn shm_path(name: &str) -> PathBuf {
    PathBuf::from(SHM_DIR).join(name.strip_prefix('/').unwrap_or(name))
}

/// Validates a pool name and returns it without its leading `/`.
fn normalise_name(name: &str) -> Result<String> {
    let bare = name.strip_prefix('/').unwrap_or(name);
    if bare.is_empty() {
        return Err(Error::invalid("shared-memory pool name must not be empty"));
    }
    if bare.contains('/') {
        return Err(Error::invalid(format!(
            "shared-memory pool name {name:?} must not contain '/' (other than one leading '/')"
        )));
    }
    if bare.contains('\0') {
        return Err(Error::invalid(format!(
            "shared-memory pool name {name:?} must not contain NUL bytes"
        )));
    }
    if bare == "." || bare == ".." {
        return Err(Error::invalid(format!(
            "shared-memory pool name {name:?} is not a valid segment name"
        )));
    }
    if bare.len() > MAX_NAME_BYTES {
        return Err(Error::invalid(format!(
            "shared-memory pool name is {} bytes long; at most {MAX_NAME_BYTES} are allowed",
            bare.len()
        )));
    }
    Ok(bare.to_owned())
}

/// `(st_dev, st_ino)` of a stat result. The field types differ between
/// targets (`c_ulong` or `u64`), hence the casts.
#[allow(clippy::unnecessary_cast)]
fn dev_ino(st: &rustix::fs::Stat) -> (u64, u64) {
    (st.st_dev as u64, st.st_ino as u64)
}

/// Free bytes of the filesystem holding `fd`, or `None` when it reports no
/// limit (a tmpfs mounted with `size=0` reports zero blocks).
fn free_bytes(fd: &OwnedFd) -> Option<u64> {
    let vfs = rustix::fs::fstatvfs(fd).ok()?;
    if vfs.f_blocks == 0 {
        return None;
    }
    Some(vfs.f_bavail.saturating_mul(vfs.f_frsize))
}

fn out_of_space(name: &str, size: u64, free: Option<u64>) -> Error {
    let free = match free {
        Some(bytes) => format!("only {bytes} bytes"),
        None => "too little space".to_owned(),
    };
    Error::OutOfSpace(format!(
        "cannot reserve {size} bytes of shared memory for pool {name}: {SHM_DIR} has {free} free; \
         lower --l1-bytes or free {SHM_DIR}"
    ))
}

/// One mapped POSIX shared-memory segment: the L1 payload pool.
///
/// See the [module documentation](self) for the ownership rules. The mapping
/// is plain memory, so the pool is `Send + Sync`; every access to its bytes
/// goes through raw pointers.
pub struct ShmPool {
    /// Normalised name, without the leading `/`.
    name: String,
    size: u64,
    owner: bool,
    identity: (u64, u64),
    map: MmapRaw,
}

impl fmt::Debug for ShmPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmPool")
            .field("name", &self.name)
            .field("size", &self.size)
            .field("owner", &self.owner)
            .field("identity", &self.identity)
            .field("ptr", &self.map.as_mut_ptr())
            .finish()
    }
}

/// Unlinks a freshly created segment unless defused (used while `create` can
/// still fail, so nothing leaks).
struct UnlinkGuard<'a> {
    segment: &'a str,
    armed: bool,
}

impl Drop for UnlinkGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = shm::unlink(self.segment) {
                log::warn!(
                    "could not remove shared-memory segment {} after a failed create: {e}",
                    self.segment
                );
            }
        }
    }
}

impl ShmPool {
    /// Creates the pool segment `name` (server side; the pool owns it).
    ///
    /// `name` may start with `/`; it must not be empty, contain another `/`
    /// or be longer than [`MAX_NAME_BYTES`]. `size` must be a positive
    /// multiple of 4096. A stale segment of the same name is unlinked first
    /// (with a warning). The whole size is reserved now: too little space in
    /// `/dev/shm` gives [`Error::OutOfSpace`]. On any failure the new segment
    /// is unlinked again.
    pub fn create(name: &str, size: u64) -> Result<ShmPool> {
        let name = normalise_name(name)?;
        if size == 0 || size % PAGE != 0 {
            return Err(Error::invalid(format!(
                "shared-memory pool size must be a positive multiple of {PAGE} bytes, got {size}"
            )));
        }
        let len = usize::try_from(size).map_err(|_| {
            Error::invalid(format!(
                "shared-memory pool size {size} does not fit this platform's address space"
            ))
        })?;
        let segment = format!("/{name}");

        match shm::unlink(segment.as_str()) {
            Ok(()) => log::warn!(
                "replaced a stale shared-memory segment {segment} (left by an earlier server)"
            ),
            Err(Errno::NOENT) => {}
            Err(e) => {
                return Err(Error::io(
                    format!("remove stale shared-memory segment {segment}"),
                    e.into(),
                ));
            }
        }

        let mode = Mode::RUSR | Mode::WUSR;
        let fd = shm::open(
            segment.as_str(),
            shm::OFlags::CREATE | shm::OFlags::EXCL | shm::OFlags::RDWR,
            mode,
        )
        .map_err(|e| Error::io(format!("create shared-memory segment {segment}"), e.into()))?;
        let mut guard = UnlinkGuard {
            segment: &segment,
            armed: true,
        };

        // shm_open applies the umask; make the mode exactly 0600.
        rustix::fs::fchmod(&fd, mode)
            .map_err(|e| Error::io(format!("chmod shared-memory segment {segment}"), e.into()))?;
        rustix::fs::ftruncate(&fd, size).map_err(|e| {
            Error::io(
                format!("size shared-memory segment {segment} to {size} bytes"),
                e.into(),
            )
        })?;

        // Refuse early (without touching memory) when the space is obviously
        // missing; fallocate below still catches a race with other users.
        let free = free_bytes(&fd);
        if free.is_some_and(|free| free < size) {
            return Err(out_of_space(&name, size, free));
        }
        let touch_pages = loop {
            match rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, size) {
                Ok(()) => break false,
                Err(Errno::INTR) => continue,
                Err(Errno::NOSPC) | Err(Errno::NOMEM) => {
                    return Err(out_of_space(&name, size, free_bytes(&fd)));
                }
                Err(Errno::OPNOTSUPP) | Err(Errno::NOSYS) => break true,
                Err(e) => {
                    return Err(Error::io(
                        format!("reserve {size} bytes for shared-memory segment {segment}"),
                        e.into(),
                    ));
                }
            }
        };

        let map = MmapOptions::new()
            .len(len)
            .map_raw(&fd)
            .map_err(|e| Error::io(format!("map shared-memory segment {segment}"), e))?;

        if touch_pages {
            // Without fallocate, the only way to reserve is to fault every page
            // in. A page that cannot be backed would raise SIGBUS here instead
            // of an error, so the free-space check above is all that protects
            // us; the check ran (and passed) already unless the filesystem
            // reports no limit.
            log::warn!(
                "fallocate is not supported for {segment}; reserving its {size} bytes by touching every page"
            );
            let base = map.as_mut_ptr();
            let mut offset = 0usize;
            while offset < len {
                // SAFETY: `offset < len`, the length of the live mapping, so the
                // pointer is inside it. The segment was created just now with
                // O_EXCL and is all zero bytes; writing a zero byte changes no
                // content even if another process opened it meanwhile. A
                // volatile write keeps the compiler from eliding the fault.
                unsafe { base.add(offset).write_volatile(0) };
                offset += PAGE as usize;
            }
        }

        let st = rustix::fs::fstat(&fd)
            .map_err(|e| Error::io(format!("stat shared-memory segment {segment}"), e.into()))?;
        guard.armed = false;
        drop(guard);
        Ok(ShmPool {
            name,
            size,
            owner: true,
            identity: dev_ino(&st),
            map,
        })
    }

    /// Opens the existing pool segment `name` (worker side).
    ///
    /// Never creates the segment and never unlinks it. A missing segment is
    /// [`Error::NotFound`]; a segment whose size is not `expected_size` (the
    /// pool size negotiated with the server) is [`Error::InvalidInput`].
    pub fn open(name: &str, expected_size: u64) -> Result<ShmPool> {
        Self::open_with(name, expected_size, false)
    }

    /// [`open`](Self::open), optionally pre-faulting the whole mapping
    /// (`MAP_POPULATE`): a worker that copies into arbitrary slots then pays
    /// the page-table cost once, at mapping time, instead of on every first
    /// touch of a slot during a copy.
    pub fn open_populated(name: &str, expected_size: u64) -> Result<ShmPool> {
        Self::open_with(name, expected_size, true)
    }

    fn open_with(name: &str, expected_size: u64, populate: bool) -> Result<ShmPool> {
        let name = normalise_name(name)?;
        let segment = format!("/{name}");
        let fd = match shm::open(segment.as_str(), shm::OFlags::RDWR, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => {
                return Err(Error::NotFound(format!(
                    "shared-memory pool {name} does not exist (is the lmcache-rc sidecar running?)"
                )));
            }
            Err(e) => {
                return Err(Error::io(
                    format!("open shared-memory segment {segment}"),
                    e.into(),
                ));
            }
        };
        let st = rustix::fs::fstat(&fd)
            .map_err(|e| Error::io(format!("stat shared-memory segment {segment}"), e.into()))?;
        let actual = u64::try_from(st.st_size).unwrap_or(0);
        if actual != expected_size {
            return Err(Error::invalid(format!(
                "shared-memory pool {name} is {actual} bytes but {expected_size} were expected \
                 (the pool does not match the negotiated pool size)"
            )));
        }
        if actual == 0 {
            return Err(Error::invalid(format!(
                "shared-memory pool {name} is empty (0 bytes)"
            )));
        }
        let len = usize::try_from(expected_size).map_err(|_| {
            Error::invalid(format!(
                "shared-memory pool size {expected_size} does not fit this platform's address space"
            ))
        })?;
        let mut options = MmapOptions::new();
        options.len(len);
        if populate {
            options.populate();
        }
        let map = options
            .map_raw(&fd)
            .map_err(|e| Error::io(format!("map shared-memory segment {segment}"), e))?;
        Ok(ShmPool {
            name,
            size: expected_size,
            owner: false,
            identity: dev_ino(&st),
            map,
        })
    }

    /// The pool name, without the leading `/`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Size of the mapping in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// True for the creating (server) side, which unlinks the segment on drop.
    pub fn is_owner(&self) -> bool {
        self.owner
    }

    /// `(st_dev, st_ino)` of the mapped segment.
    pub fn identity(&self) -> (u64, u64) {
        self.identity
    }

    /// Whether `/dev/shm/<name>` still is the mapped segment. False when it is
    /// gone or was replaced (the server restarted and recreated its pool).
    pub fn is_current(&self) -> bool {
        match rustix::fs::stat(shm_path(&self.name)) {
            Ok(st) => dev_ino(&st) == self.identity,
            Err(_) => false,
        }
    }

    /// Base address of the mapping (valid for [`size`](Self::size) bytes while
    /// the pool lives). Other processes may change the bytes at any time.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Checks that `[offset, offset + len)` lies inside the pool and returns
    /// the start as a `usize`.
    fn check_range(&self, offset: u64, len: usize) -> Result<usize> {
        let end = u64::try_from(len)
            .ok()
            .and_then(|len| offset.checked_add(len));
        match end {
            Some(end) if end <= self.size => {
                // `offset <= size`, and `size` fits a usize (checked when mapping).
                usize::try_from(offset).map_err(|_| Error::invalid("offset overflows usize"))
            }
            _ => Err(Error::invalid(format!(
                "range of {len} bytes at offset {offset} is outside the shared-memory pool {} of {} bytes",
                self.name, self.size
            ))),
        }
    }

    /// Copies `data` into the pool at `offset`.
    ///
    /// Out-of-bounds ranges are refused with [`Error::InvalidInput`]. The
    /// caller's protocol (a write lease on the range) must keep other writers
    /// and readers away; otherwise they observe torn bytes.
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        let start = self.check_range(offset, data.len())?;
        // SAFETY: `check_range` proved `start + data.len() <= size`, so the
        // destination lies inside the live mapping, which is writable. `data`
        // is a Rust slice and cannot overlap the mapping: the pool never hands
        // out references to its bytes except through the `unsafe` views,
        // whose callers promise no concurrent use of the range. Another
        // process writing the same range concurrently can only produce
        // unspecified bytes there (the lease protocol prevents it); no Rust
        // reference to the shared bytes is created.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                self.map.as_mut_ptr().add(start),
                data.len(),
            );
        }
        Ok(())
    }

    /// Copies `out.len()` bytes from the pool at `offset` into `out`.
    ///
    /// Out-of-bounds ranges are refused with [`Error::InvalidInput`]. Bytes
    /// written concurrently by another process are unspecified; the caller's
    /// protocol (a read lease on the range) must prevent that.
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let start = self.check_range(offset, out.len())?;
        // SAFETY: `check_range` proved `start + out.len() <= size`, so the
        // source lies inside the live mapping, which is readable. `out` is an
        // exclusive Rust slice and cannot overlap the mapping (see
        // `write_at`). Concurrent foreign writes can only make the copied
        // bytes unspecified; no Rust reference to the shared bytes is created.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.as_mut_ptr().add(start),
                out.as_mut_ptr(),
                out.len(),
            );
        }
        Ok(())
    }

    /// A zero-copy shared view of `len` bytes at `offset`.
    ///
    /// An out-of-bounds range is refused with [`Error::InvalidInput`].
    ///
    /// # Safety
    ///
    /// While the returned slice lives, nobody (this process or another) may
    /// write the range: the range must be owned by a live lease of the caller
    /// (e.g. a read lease on a committed object) and no mutable view of it may
    /// exist. The slice must not outlive the lease.
    pub unsafe fn slice(&self, offset: u64, len: usize) -> Result<&[u8]> {
        let start = self.check_range(offset, len)?;
        // SAFETY: the range lies inside the live mapping (checked above) and
        // the slice borrows `self`, so it cannot outlive the mapping. The
        // caller guarantees no concurrent writer for the slice's lifetime.
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_mut_ptr().add(start), len) })
    }

    /// A zero-copy exclusive view of `len` bytes at `offset`.
    ///
    /// An out-of-bounds range is refused with [`Error::InvalidInput`].
    ///
    /// # Safety
    ///
    /// While the returned slice lives, nobody else (this process or another)
    /// may read or write the range: it must be owned by a live write lease of
    /// the caller, and no other view of an overlapping range may exist. The
    /// slice must not outlive the lease.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, offset: u64, len: usize) -> Result<&mut [u8]> {
        let start = self.check_range(offset, len)?;
        // SAFETY: the range lies inside the live, writable mapping (checked
        // above) and the slice borrows `self`, so it cannot outlive the
        // mapping. The caller guarantees exclusive access to the range for the
        // slice's lifetime, so this `&mut` aliases nothing.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(start), len) })
    }
}

impl Drop for ShmPool {
    fn drop(&mut self) {
        // The mapping itself is unmapped when `self.map` drops.
        if !self.owner {
            return;
        }
        // Unlink only our own segment: a newer server may have replaced it
        // under the same name, and its pool must survive us.
        if !self.is_current() {
            log::info!(
                "shared-memory segment /{} was replaced or removed; not unlinking it",
                self.name
            );
            return;
        }
        let segment = format!("/{}", self.name);
        if let Err(e) = shm::unlink(segment.as_str()) {
            log::warn!("could not remove shared-memory segment {segment}: {e}");
        }
    }
}

/// The default L1 pool size: a quarter of the free space of `/dev/shm`, at
/// most 1 GiB and at least 16 MiB (64 MiB when `/dev/shm` cannot be read),
/// rounded down to 4 KiB.
pub fn default_l1_bytes() -> u64 {
    const GIB: u64 = 1 << 30;
    let free = rustix::fs::statvfs("/dev/shm")
        .map(|st| st.f_bavail.saturating_mul(st.f_frsize))
        .unwrap_or(0);
    let size = if free > 0 {
        GIB.min(free / 4)
    } else {
        64 << 20
    };
    let size = size.max(16 << 20);
    size - size % 4096
}

/// The pool name derived from a server's socket path, unique per socket:
/// `lmcache-rc-` + the first 16 hex digits of SHA-256 of the absolute path
/// (made absolute and normalised lexically, like Python's `os.path.abspath`).
pub fn shm_name_for(socket: &std::path::Path) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(absolute_lexical(socket));
    format!("lmcache-rc-{}", &hex::encode(digest)[..16])
}

/// `path` joined to the working directory and normalised without touching
/// the filesystem: `.` and empty components dropped, `..` removing the
/// component before it (never above the root), POSIX's `//` prefix kept.
fn absolute_lexical(path: &std::path::Path) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .unwrap_or_else(|_| PathBuf::from("/"))
            .join(path)
    };
    let bytes = joined.as_os_str().as_bytes();
    let leading = bytes.iter().take_while(|b| **b == b'/').count();
    let mut parts: Vec<&[u8]> = Vec::new();
    for part in bytes.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => {
                parts.pop();
            }
            other => parts.push(other),
        }
    }
    let mut out = if leading == 2 {
        b"//".to_vec()
    } else {
        b"/".to_vec()
    };
    out.extend(parts.join(&b'/'));
    out
}

#[cfg(test)]
mod naming_tests {
    use super::*;

    #[test]
    fn the_derived_pool_name_normalises_the_socket_path() {
        let a = shm_name_for(std::path::Path::new("/run/user/1/lmcache-rc/sidecar.sock"));
        let b = shm_name_for(std::path::Path::new(
            "/run//user/1/./x/../lmcache-rc/sidecar.sock",
        ));
        assert_eq!(a, b);
        // Python's sha256(os.path.abspath(p).encode()), the name earlier
        // releases derived, so a restarted sidecar still replaces its segment.
        assert_eq!(a, "lmcache-rc-da89d37b665bf122");
        assert!(a.starts_with("lmcache-rc-") && a.len() == "lmcache-rc-".len() + 16);
        assert_ne!(a, shm_name_for(std::path::Path::new("/tmp/other.sock")));
        assert_eq!(
            absolute_lexical(std::path::Path::new("/a/b/../../../c")),
            b"/c".to_vec()
        );
    }

    #[test]
    fn the_default_pool_size_is_page_aligned_and_bounded() {
        let size = default_l1_bytes();
        assert_eq!(size % 4096, 0);
        assert!((16 << 20..=1 << 30).contains(&size), "{size}");
    }
}
