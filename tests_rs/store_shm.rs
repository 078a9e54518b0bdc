//! The shared-memory L1 pool: creation (mode 0600, exact size, reserved
//! space), shared bytes between owner and worker mappings, bounds checks,
//! replacement of a stale segment by a restarted server, and cleanup (only the
//! owner unlinks, and only its own segment).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::sync::atomic::{AtomicUsize, Ordering};

use lmcache_rc_core::store::shm::{ShmPool, shm_path};
use lmcache_rc_core::{Error, ErrorKind};

const KIB64: u64 = 64 * 1024;

/// A unique pool name for this process and test; the guard removes the
/// segment even when the test panics.
struct Name(String);

impl Name {
    fn new(tag: &str) -> Name {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        Name(format!("lmcrc_test_{}_{n}_{tag}", std::process::id()))
    }
}

impl Drop for Name {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(shm_path(&self.0));
    }
}

fn exists(name: &str) -> bool {
    shm_path(name).exists()
}

fn kind<T: std::fmt::Debug>(result: Result<T, Error>) -> ErrorKind {
    result.expect_err("expected an error").kind()
}

#[test]
fn create_makes_a_0600_segment_of_the_requested_size() {
    let name = Name::new("create");
    let pool = ShmPool::create(&name.0, KIB64).unwrap();
    let meta = std::fs::metadata(shm_path(&name.0)).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(meta.len(), KIB64);
    assert_eq!(pool.size(), KIB64);
    assert_eq!(pool.name(), name.0);
    assert!(pool.is_owner());
    assert!(pool.is_current());
    assert_eq!(pool.identity(), (meta.dev(), meta.ino()));
    assert!(!pool.as_ptr().is_null());
    // Space is reserved up front: the segment's blocks are allocated.
    assert!(meta.blocks() * 512 >= KIB64, "blocks {}", meta.blocks());
}

#[test]
fn leading_slash_is_normalised_away() {
    let name = Name::new("slash");
    let pool = ShmPool::create(&format!("/{}", name.0), 4096).unwrap();
    assert_eq!(pool.name(), name.0);
    assert!(exists(&name.0));
    let worker = ShmPool::open(&name.0, 4096).unwrap();
    assert_eq!(worker.identity(), pool.identity());
    assert_eq!(shm_path(&format!("/{}", name.0)), shm_path(&name.0));
}

#[test]
fn write_at_then_read_at_round_trips() {
    let name = Name::new("roundtrip");
    let pool = ShmPool::create(&name.0, KIB64).unwrap();
    let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    pool.write_at(4096, &data).unwrap();
    let mut out = vec![0u8; data.len()];
    pool.read_at(4096, &mut out).unwrap();
    assert_eq!(out, data);
    // The last byte of the pool is reachable; empty copies at the end are fine.
    pool.write_at(KIB64 - 1, &[7]).unwrap();
    let mut last = [0u8; 1];
    pool.read_at(KIB64 - 1, &mut last).unwrap();
    assert_eq!(last, [7]);
    pool.write_at(KIB64, &[]).unwrap();
    pool.read_at(KIB64, &mut []).unwrap();
    // Fresh pool bytes are zero.
    let mut head = [1u8; 16];
    pool.read_at(0, &mut head).unwrap();
    assert_eq!(head, [0u8; 16]);
}

#[test]
fn out_of_bounds_copies_and_views_are_refused() {
    let name = Name::new("bounds");
    let pool = ShmPool::create(&name.0, KIB64).unwrap();
    let mut buf = [0u8; 2];
    assert_eq!(
        kind(pool.write_at(KIB64 - 1, &[1, 2])),
        ErrorKind::InvalidInput
    );
    assert_eq!(
        kind(pool.read_at(KIB64 - 1, &mut buf)),
        ErrorKind::InvalidInput
    );
    assert_eq!(kind(pool.write_at(KIB64 + 1, &[])), ErrorKind::InvalidInput);
    assert_eq!(
        kind(pool.read_at(u64::MAX, &mut buf)),
        ErrorKind::InvalidInput
    );
    assert_eq!(
        kind(pool.write_at(u64::MAX - 1, &[1, 2, 3])),
        ErrorKind::InvalidInput
    );
    // SAFETY: the pool is private to this test; no other view exists.
    unsafe {
        assert_eq!(kind(pool.slice(KIB64 - 4, 5)), ErrorKind::InvalidInput);
        assert_eq!(kind(pool.slice_mut(u64::MAX, 1)), ErrorKind::InvalidInput);
    }
    // Nothing was written by the refused calls.
    let mut tail = [9u8; 4];
    pool.read_at(KIB64 - 4, &mut tail).unwrap();
    assert_eq!(tail, [0u8; 4]);
}

#[test]
fn unsafe_views_see_the_pool_bytes() {
    let name = Name::new("views");
    let pool = ShmPool::create(&name.0, KIB64).unwrap();
    // SAFETY: the pool is private to this test and each view is the only one
    // of its range while it lives.
    unsafe {
        pool.slice_mut(8192, 3).unwrap().copy_from_slice(b"abc");
        assert_eq!(pool.slice(8192, 3).unwrap(), b"abc");
    }
    let mut out = [0u8; 3];
    pool.read_at(8192, &mut out).unwrap();
    assert_eq!(&out, b"abc");
}

#[test]
fn worker_open_shares_the_owner_bytes_and_never_unlinks() {
    let name = Name::new("shared");
    let owner = ShmPool::create(&name.0, KIB64).unwrap();
    owner.write_at(100, b"from the server").unwrap();
    let worker = ShmPool::open(&name.0, KIB64).unwrap();
    assert!(!worker.is_owner());
    assert!(worker.is_current());
    assert_eq!(worker.identity(), owner.identity());
    assert_ne!(worker.as_ptr(), owner.as_ptr());
    let mut out = [0u8; 15];
    worker.read_at(100, &mut out).unwrap();
    assert_eq!(&out, b"from the server");
    worker.write_at(5000, b"from a worker").unwrap();
    let mut back = [0u8; 13];
    owner.read_at(5000, &mut back).unwrap();
    assert_eq!(&back, b"from a worker");

    drop(worker);
    assert!(exists(&name.0), "dropping a worker mapping must not unlink");
    assert!(owner.is_current());
    // A second worker still attaches.
    let again = ShmPool::open(&name.0, KIB64).unwrap();
    let mut out = [0u8; 15];
    again.read_at(100, &mut out).unwrap();
    assert_eq!(&out, b"from the server");
}

#[test]
fn dropping_the_owner_unlinks_the_segment() {
    let name = Name::new("ownerdrop");
    let owner = ShmPool::create(&name.0, KIB64).unwrap();
    let worker = ShmPool::open(&name.0, KIB64).unwrap();
    drop(owner);
    assert!(!exists(&name.0));
    // The worker's mapping stays usable but is no longer current.
    assert!(!worker.is_current());
    worker.write_at(0, b"x").unwrap();
    assert_eq!(kind(ShmPool::open(&name.0, KIB64)), ErrorKind::NotFound);
}

#[test]
fn create_replaces_a_stale_segment_and_old_mappings_become_stale() {
    let name = Name::new("restart");
    let first = ShmPool::create(&name.0, KIB64).unwrap();
    first.write_at(0, b"old").unwrap();
    let worker = ShmPool::open(&name.0, KIB64).unwrap();
    assert!(worker.is_current());

    // A restarted server recreates the pool under the same name.
    let second = ShmPool::create(&name.0, 2 * KIB64).unwrap();
    assert_ne!(second.identity(), first.identity());
    assert!(second.is_current());
    assert!(!first.is_current());
    assert!(!worker.is_current());
    // Old mappings keep working on the old memory.
    let mut out = [0u8; 3];
    first.read_at(0, &mut out).unwrap();
    assert_eq!(&out, b"old");
    worker.read_at(0, &mut out).unwrap();
    assert_eq!(&out, b"old");
    // A fresh worker sees the new, empty pool.
    let fresh = ShmPool::open(&name.0, 2 * KIB64).unwrap();
    fresh.read_at(0, &mut out).unwrap();
    assert_eq!(out, [0u8; 3]);
    assert_eq!(kind(ShmPool::open(&name.0, KIB64)), ErrorKind::InvalidInput);

    // The replaced owner must not unlink its successor's segment.
    drop(first);
    assert!(exists(&name.0));
    assert!(second.is_current());
    drop(second);
    assert!(!exists(&name.0));
}

#[test]
fn create_replaces_a_segment_left_by_a_crashed_server() {
    let name = Name::new("crashed");
    std::fs::write(shm_path(&name.0), b"leftover of another size").unwrap();
    let pool = ShmPool::create(&name.0, KIB64).unwrap();
    assert_eq!(std::fs::metadata(shm_path(&name.0)).unwrap().len(), KIB64);
    let mut head = [1u8; 8];
    pool.read_at(0, &mut head).unwrap();
    assert_eq!(head, [0u8; 8]);
}

#[test]
fn open_of_a_missing_pool_is_not_found() {
    let name = Name::new("missing");
    let err = ShmPool::open(&name.0, KIB64).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound);
    let message = err.to_string();
    assert!(message.contains(&name.0), "{message}");
    assert!(message.contains("sidecar running"), "{message}");
    assert!(!exists(&name.0), "open must never create");
}

#[test]
fn open_with_the_wrong_size_is_invalid_input() {
    let name = Name::new("wrongsize");
    let _owner = ShmPool::create(&name.0, KIB64).unwrap();
    let err = ShmPool::open(&name.0, 2 * KIB64).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    let message = err.to_string();
    assert!(message.contains(&KIB64.to_string()), "{message}");
    assert!(message.contains(&(2 * KIB64).to_string()), "{message}");
    assert_eq!(kind(ShmPool::open(&name.0, 0)), ErrorKind::InvalidInput);
    assert!(exists(&name.0), "a failed open must not unlink");
}

#[test]
fn creating_more_than_free_shm_is_out_of_space_and_leaves_nothing() {
    let vfs = rustix::fs::statvfs("/dev/shm").unwrap();
    if vfs.f_blocks == 0 {
        eprintln!("/dev/shm reports no size limit; skipping");
        return;
    }
    let free = vfs.f_bavail * vfs.f_frsize;
    let size = (free + (4 << 30)).next_multiple_of(4096);
    let name = Name::new("toolarge");
    let err = ShmPool::create(&name.0, size).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfSpace, "{err}");
    let message = err.to_string();
    assert!(message.contains(&size.to_string()), "{message}");
    assert!(message.contains("lower --l1-bytes"), "{message}");
    assert!(!exists(&name.0), "a failed create must not leave a segment");
}

#[test]
fn pool_names_are_validated() {
    for bad in ["", "/", "a/b", "//a", "/a/", "nul\0byte", ".", ".."] {
        assert_eq!(
            kind(ShmPool::create(bad, 4096)),
            ErrorKind::InvalidInput,
            "{bad:?}"
        );
        assert_eq!(
            kind(ShmPool::open(bad, 4096)),
            ErrorKind::InvalidInput,
            "{bad:?}"
        );
    }
    let long = format!("{}_{}", Name::new("long").0, "x".repeat(200));
    assert_eq!(kind(ShmPool::create(&long, 4096)), ErrorKind::InvalidInput);
    assert!(!exists(&long));

    // Exactly 200 bytes is accepted.
    let base = Name::new("max");
    let max = Name(format!("{}{}", base.0, "y".repeat(200 - base.0.len())));
    assert_eq!(max.0.len(), 200);
    let pool = ShmPool::create(&max.0, 4096).unwrap();
    assert_eq!(pool.name(), max.0);
}

#[test]
fn pool_sizes_must_be_positive_multiples_of_4096() {
    let name = Name::new("badsize");
    for bad in [0, 1, 4095, 4097, KIB64 + 512] {
        assert_eq!(
            kind(ShmPool::create(&name.0, bad)),
            ErrorKind::InvalidInput,
            "{bad}"
        );
        assert!(!exists(&name.0), "size {bad} left a segment");
    }
}

#[test]
fn pool_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ShmPool>();
    let name = Name::new("threads");
    let pool = ShmPool::create(&name.0, KIB64).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u8 {
            let pool = &pool;
            s.spawn(move || pool.write_at(u64::from(t) * 4096, &[t + 1; 4096]).unwrap());
        }
    });
    for t in 0..4u8 {
        let mut page = vec![0u8; 4096];
        pool.read_at(u64::from(t) * 4096, &mut page).unwrap();
        assert!(page.iter().all(|&b| b == t + 1));
    }
}
