//! The shared-memory L1 pool: one anonymous shared-memory file (`memfd`),
//! created by the server (the owner) and mapped by every worker rank, which
//! receives it as a file descriptor over the RPC socket (`SCM_RIGHTS`, see
//! [`crate::rpc`]). The pool has no name: nothing in `/dev/shm` can collide
//! with it, be squatted on by another user, or outlive a killed server.
//!
//! - The server calls [`ShmPool::create`]: `memfd_create` (close-on-exec,
//!   sealable), sized, its whole size **reserved** at creation (`fallocate`,
//!   after a check against the memory available to the process: anonymous
//!   shared memory has no size limit of its own), so too little memory fails
//!   at start with [`Error::OutOfSpace`] instead of with `SIGBUS` or the OOM
//!   killer on a later page fault; then **sealed** against growing
//!   and shrinking and against further seals (`F_SEAL_GROW | F_SEAL_SHRINK |
//!   F_SEAL_SEAL`), so no process holding the descriptor can shrink it under
//!   another's mapping (a `SIGBUS` for everyone) or seal it against writes.
//!   Each pool gets a fresh random [`id`](ShmPool::id): a restarted server's
//!   pool is never taken for its predecessor's.
//! - A worker calls [`ShmPool::from_fd`] with the descriptor and the id and
//!   size the server announced: it checks the size and the seals and maps
//!   the file. The memory lives while any process maps it or holds the
//!   descriptor, and is freed by the kernel when the last one goes.
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
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{FallocateFlags, MemfdFlags, SealFlags};
use rustix::io::Errno;

use crate::error::{Error, Result};
use crate::units::human_size;

/// Granularity of pool sizes.
const PAGE: u64 = 4096;

/// The name the kernel shows for the pool's memfd (`/proc/<pid>/fd`,
/// `/proc/<pid>/maps`: `/memfd:lmcache-rc-l1 (deleted)`).
const MEMFD_NAME: &str = "lmcache-rc-l1";

/// The seals every pool carries (and a worker insists on).
fn required_seals() -> SealFlags {
    SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL
}

/// A fresh pool id: 32 hex digits from the kernel's random source (a
/// clock-and-pid hash if that fails), unique per pool and unpredictable.
pub fn new_pool_id() -> String {
    let mut bytes = [0u8; 16];
    match rustix::rand::getrandom(&mut bytes[..], rustix::rand::GetRandomFlags::empty()) {
        Ok(16) => {}
        _ => {
            use std::hash::{BuildHasher, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0),
            );
            h.write_u32(std::process::id());
            bytes[..8].copy_from_slice(&h.finish().to_le_bytes());
            h.write_u8(1);
            bytes[8..].copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    hex::encode(bytes)
}

fn out_of_space(size: u64, available: Option<u64>) -> Error {
    let available = match available {
        Some(bytes) => format!("only {} are available", human_size(bytes)),
        None => "the host or this process's memory limit (cgroup) does not allow it".to_owned(),
    };
    Error::OutOfSpace(format!(
        "cannot reserve {} of shared memory for the L1 pool: {available}; lower \
         --l1-bytes",
        human_size(size)
    ))
}

/// One mapped shared-memory file: the L1 payload pool.
///
/// See the [module documentation](self) for the ownership rules. The mapping
/// is plain memory, so the pool is `Send + Sync`; every access to its bytes
/// goes through raw pointers.
pub struct ShmPool {
    id: String,
    size: u64,
    owner: bool,
    fd: OwnedFd,
    map: MmapRaw,
}

impl fmt::Debug for ShmPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmPool")
            .field("id", &self.id)
            .field("size", &self.size)
            .field("owner", &self.owner)
            .field("ptr", &self.map.as_mut_ptr())
            .finish()
    }
}

/// Asks for transparent huge pages on a pool mapping (`MADV_HUGEPAGE`): a
/// hint the kernel follows where its shmem THP mode allows (fewer TLB misses
/// for copies across the pool); an error (no THP support) leaves 4 KiB pages.
fn advise_huge(map: &MmapRaw) {
    // SAFETY: the range is exactly this live mapping; MADV_HUGEPAGE changes
    // no contents and no access rights, only how later faults are served.
    let r = unsafe { libc::madvise(map.as_mut_ptr().cast(), map.len(), libc::MADV_HUGEPAGE) };
    if r != 0 {
        log::debug!(
            "MADV_HUGEPAGE on the shared-memory pool was refused ({}); it uses 4 KiB pages",
            std::io::Error::last_os_error()
        );
    }
}

/// The host's shmem THP mode: the bracketed word of
/// `/sys/kernel/mm/transparent_hugepage/shmem_enabled`.
fn shmem_thp_mode() -> Option<String> {
    let text = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()?;
    let open = text.find('[')?;
    let close = text[open..].find(']')? + open;
    Some(text[open + 1..close].to_string())
}

/// KiB of the mapping starting at `start` that are mapped with huge pages
/// (`ShmemPmdMapped` / `FilePmdMapped` in `/proc/self/smaps`).
fn pmd_mapped_kib(start: usize) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let head = format!("{start:x}-");
    let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head)).skip(1);
    let mut total = 0;
    for line in lines.by_ref() {
        // The next mapping's header ("start-end perms ...") ends this one.
        if line
            .split_whitespace()
            .next()
            .is_some_and(|w| w.contains('-'))
        {
            break;
        }
        if let Some(rest) = line
            .strip_prefix("ShmemPmdMapped:")
            .or_else(|| line.strip_prefix("FilePmdMapped:"))
        {
            total += rest
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .unwrap_or(0);
        }
    }
    Some(total)
}

/// A pool length as `usize` (a pool beyond the address space is refused).
fn map_len(size: u64) -> Result<usize> {
    usize::try_from(size).map_err(|_| {
        Error::invalid(format!(
            "shared-memory pool size {size} does not fit this platform's address space"
        ))
    })
}

impl ShmPool {
    /// Creates a pool of `size` bytes (server side; the pool owns it).
    ///
    /// `size` must be a positive multiple of 4096. The whole size is reserved
    /// now: too little memory gives [`Error::OutOfSpace`]. Nothing is left
    /// behind on any failure (the memory has no name).
    pub fn create(size: u64) -> Result<ShmPool> {
        if size == 0 || !size.is_multiple_of(PAGE) {
            return Err(Error::invalid(format!(
                "shared-memory pool size must be a positive multiple of {PAGE} bytes, got {size}"
            )));
        }
        let len = map_len(size)?;
        // Anonymous shared memory has no size limit of its own (unlike a
        // tmpfs mount): reserving more than the memory there is would fill
        // it until the OOM killer steps in. Refuse that up front.
        if let Some(available) = mem_available().filter(|&a| a < size) {
            return Err(out_of_space(size, Some(available)));
        }
        let base = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
        // NOEXEC_SEAL (Linux 6.3) keeps the pool non-executable for good;
        // older kernels refuse the flag.
        let fd = match rustix::fs::memfd_create(MEMFD_NAME, base | MemfdFlags::NOEXEC_SEAL) {
            Err(Errno::INVAL) => rustix::fs::memfd_create(MEMFD_NAME, base),
            other => other,
        }
        .map_err(|e| Error::io("create the shared-memory pool (memfd_create)", e.into()))?;
        rustix::fs::ftruncate(&fd, size).map_err(|e| {
            Error::io(
                format!("size the shared-memory pool to {size} bytes"),
                e.into(),
            )
        })?;
        loop {
            match rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, size) {
                Ok(()) => break,
                Err(Errno::INTR) => continue,
                Err(Errno::NOSPC) | Err(Errno::NOMEM) => return Err(out_of_space(size, None)),
                Err(e) => {
                    return Err(Error::io(
                        format!("reserve {size} bytes for the shared-memory pool"),
                        e.into(),
                    ));
                }
            }
        }
        rustix::fs::fcntl_add_seals(&fd, required_seals())
            .map_err(|e| Error::io("seal the shared-memory pool", e.into()))?;
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&fd)
            .map_err(|e| Error::io("map the shared-memory pool", e))?;
        advise_huge(&map);
        Ok(ShmPool {
            id: new_pool_id(),
            size,
            owner: true,
            fd,
            map,
        })
    }

    /// Maps a pool received as `fd` (worker side), which the server
    /// announced as pool `id` of `expected_size` bytes.
    ///
    /// Refused with [`Error::InvalidInput`]: a descriptor whose size is not
    /// `expected_size`, or that is not a sealed pool (it could shrink under
    /// the mapping); an empty id.
    pub fn from_fd(fd: OwnedFd, id: &str, expected_size: u64) -> Result<ShmPool> {
        Self::from_fd_with(fd, id, expected_size, false)
    }

    /// [`from_fd`](Self::from_fd), pre-faulting the whole mapping
    /// (`MAP_POPULATE`): a worker that copies into arbitrary slots then pays
    /// the page-table cost once, at mapping time, instead of on every first
    /// touch of a slot during a copy.
    pub fn from_fd_populated(fd: OwnedFd, id: &str, expected_size: u64) -> Result<ShmPool> {
        Self::from_fd_with(fd, id, expected_size, true)
    }

    fn from_fd_with(fd: OwnedFd, id: &str, expected_size: u64, populate: bool) -> Result<ShmPool> {
        if id.is_empty() {
            return Err(Error::invalid("the shared-memory pool has no id"));
        }
        let st = rustix::fs::fstat(&fd)
            .map_err(|e| Error::io("stat the shared-memory pool", e.into()))?;
        let actual = u64::try_from(st.st_size).unwrap_or(0);
        if actual != expected_size || actual == 0 {
            return Err(Error::invalid(format!(
                "the shared-memory pool {id} is {actual} bytes but {expected_size} were announced \
                 (the pool does not match the negotiated pool size)"
            )));
        }
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| {
            Error::invalid(format!(
                "the descriptor received as shared-memory pool {id} is not a sealed pool ({e})"
            ))
        })?;
        if !seals.contains(required_seals()) {
            return Err(Error::invalid(format!(
                "the shared-memory pool {id} is not sealed against resizing (seals {seals:?}); \
                 it could shrink under this mapping"
            )));
        }
        let mut options = MmapOptions::new();
        options.len(map_len(expected_size)?);
        if populate {
            options.populate();
        }
        let map = options
            .map_raw(&fd)
            .map_err(|e| Error::io(format!("map shared-memory pool {id}"), e))?;
        advise_huge(&map);
        Ok(ShmPool {
            id: id.to_string(),
            size: expected_size,
            owner: false,
            fd,
            map,
        })
    }

    /// Which pages back this mapping, for status and benchmarks: `"2 MiB
    /// (transparent huge pages)"` when some of it is mapped with huge pages,
    /// else `"4 KiB (shmem THP <mode>)"` with the host's
    /// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` mode (`never`
    /// and `deny` allow none; `advise` only for memory touched through an
    /// advised mapping — the pool is reserved with `fallocate` at creation —
    /// or collapsed later by `khugepaged`). The fallback is always 4 KiB
    /// pages: nothing here fails.
    pub fn page_size_status(&self) -> String {
        let start = self.map.as_mut_ptr() as usize;
        if pmd_mapped_kib(start).is_some_and(|kib| kib > 0) {
            return "2 MiB (transparent huge pages)".to_string();
        }
        format!(
            "4 KiB (shmem THP {})",
            shmem_thp_mode().unwrap_or_else(|| "unknown".to_string())
        )
    }

    /// The pool id: random, fresh for every pool the server creates.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Size of the mapping in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// True for the creating (server) side.
    pub fn is_owner(&self) -> bool {
        self.owner
    }

    /// The pool's descriptor (to hand to a worker; see [`share`](Self::share)).
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A new descriptor of the pool (close-on-exec) for another mapping.
    pub fn share(&self) -> Result<OwnedFd> {
        rustix::io::fcntl_dupfd_cloexec(&self.fd, 0)
            .map_err(|e| Error::io("duplicate the shared-memory pool descriptor", e.into()))
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
                "range of {len} bytes at offset {offset} is outside the shared-memory pool of {} bytes",
                self.size
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

/// The default L1 pool size: a quarter of the memory available to this
/// process (`MemAvailable`, and the cgroup's `memory.max` when set), at most
/// 1 GiB and at least 16 MiB (64 MiB when neither can be read), rounded down
/// to 4 KiB.
pub fn default_l1_bytes() -> u64 {
    const GIB: u64 = 1 << 30;
    let available = mem_available();
    let size = match available {
        Some(bytes) if bytes > 0 => GIB.min(bytes / 4),
        _ => 64 << 20,
    };
    let size = size.max(16 << 20);
    size - size % 4096
}

/// Bytes of memory this process may still fill: the smaller of the host's
/// `MemAvailable` and its memory cgroup's limit (v2 `memory.max`, v1
/// `memory.limit_in_bytes`, the lowest along the cgroup's ancestors); None
/// when neither can be read.
pub fn mem_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines().find_map(|line| {
                let rest = line.strip_prefix("MemAvailable:")?;
                let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
                kib.checked_mul(1024)
            })
        });
    match (meminfo, cgroup_memory_limit()) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The memory limit of this process's cgroup (the lowest along its
/// ancestors), if any is set and readable.
fn cgroup_memory_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut lowest: Option<u64> = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (root, file) = if id == "0" && controllers.is_empty() {
            ("/sys/fs/cgroup", "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")
        } else {
            continue;
        };
        let mut dir = std::path::PathBuf::from(root).join(path.trim_start_matches('/'));
        loop {
            let limit = std::fs::read_to_string(dir.join(file))
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
                // v1 reports "no limit" as a huge page-rounded number.
                .filter(|&l| l < (1 << 62));
            if let Some(l) = limit {
                lowest = Some(lowest.map_or(l, |x| x.min(l)));
            }
            if dir.as_os_str().len() <= root.len() || !dir.pop() {
                break;
            }
        }
    }
    lowest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_pool_size_is_page_aligned_and_bounded() {
        let size = default_l1_bytes();
        assert_eq!(size % 4096, 0);
        assert!((16 << 20..=1 << 30).contains(&size), "{size}");
    }

    #[test]
    fn the_page_size_status_names_what_backs_the_pool() {
        let pool = ShmPool::create(4 << 20).unwrap();
        let status = pool.page_size_status();
        assert!(
            status.starts_with("2 MiB") || status.starts_with("4 KiB (shmem THP "),
            "{status}"
        );
    }

    #[test]
    fn pool_ids_are_fresh_hex() {
        let a = new_pool_id();
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(a, new_pool_id());
    }
}
