//! The shared-memory L1 pool: an anonymous memfd of the exact size, its
//! memory reserved at creation and sealed against resizing; a worker maps
//! the descriptor it is handed (and refuses one of the wrong size or without
//! the seals); shared bytes between owner and worker mappings; bounds
//! checks; nothing of it in /dev/shm.

use std::os::fd::AsFd;

use lmcache_rc_core::store::shm::{ShmPool, mem_available};
use lmcache_rc_core::{Error, ErrorKind};
use rustix::fs::SealFlags;

const KIB64: u64 = 64 * 1024;

fn kind<T: std::fmt::Debug>(result: Result<T, Error>) -> ErrorKind {
    result.expect_err("expected an error").kind()
}

/// What `/proc/self/fd/<fd>` links to.
fn fd_target(fd: impl AsFd) -> String {
    use std::os::fd::AsRawFd;
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_fd().as_raw_fd()))
        .unwrap()
        .display()
        .to_string()
}

#[test]
fn a_pool_is_an_anonymous_sealed_memfd_with_a_fresh_id() {
    let before: Vec<_> = std::fs::read_dir("/dev/shm").map_or(Vec::new(), |d| {
        d.filter_map(|e| e.ok().map(|e| e.file_name())).collect()
    });
    let pool = ShmPool::create(KIB64).unwrap();
    assert!(pool.is_owner());
    assert_eq!(pool.size(), KIB64);
    assert_eq!(pool.id().len(), 32);
    assert_ne!(
        pool.id(),
        ShmPool::create(4096).unwrap().id(),
        "ids are fresh"
    );
    let target = fd_target(pool.as_fd());
    assert!(target.starts_with("/memfd:lmcache-rc-l1"), "{target}");
    let st = rustix::fs::fstat(pool.as_fd()).unwrap();
    assert_eq!(st.st_size as u64, KIB64);
    // Reserved: every block is allocated, not a sparse file.
    assert!(
        st.st_blocks as u64 * 512 >= KIB64,
        "{} blocks",
        st.st_blocks
    );
    let seals = rustix::fs::fcntl_get_seals(pool.as_fd()).unwrap();
    assert!(
        seals.contains(SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL),
        "{seals:?}"
    );
    // Nobody holding a descriptor can resize it or seal it further.
    let shared = pool.share().unwrap();
    assert!(rustix::fs::ftruncate(&shared, 4096).is_err());
    assert!(rustix::fs::ftruncate(&shared, 2 * KIB64).is_err());
    assert!(rustix::fs::fcntl_add_seals(&shared, SealFlags::FUTURE_WRITE).is_err());
    // Nothing of it has a name in /dev/shm.
    if let Ok(dir) = std::fs::read_dir("/dev/shm") {
        for entry in dir.flatten() {
            let name = entry.file_name();
            assert!(
                before.contains(&name) || !name.to_string_lossy().contains("lmcache-rc"),
                "{name:?} appeared in /dev/shm"
            );
        }
    }
}

#[test]
fn a_worker_maps_the_descriptor_it_is_handed_and_shares_the_bytes() {
    let owner = ShmPool::create(KIB64).unwrap();
    let worker = ShmPool::from_fd(owner.share().unwrap(), owner.id(), KIB64).unwrap();
    assert!(!worker.is_owner());
    assert_eq!(worker.id(), owner.id());
    owner.write_at(100, b"from the owner").unwrap();
    let mut got = [0u8; 14];
    worker.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"from the owner");
    worker.write_at(8192, b"from a worker").unwrap();
    let mut back = [0u8; 13];
    owner.read_at(8192, &mut back).unwrap();
    assert_eq!(&back, b"from a worker");
    // The memory outlives the owner while a worker maps it.
    drop(owner);
    let populated = ShmPool::from_fd_populated(worker.share().unwrap(), worker.id(), KIB64);
    let populated = populated.unwrap();
    populated.read_at(8192, &mut back).unwrap();
    assert_eq!(&back, b"from a worker");
}

#[test]
fn a_worker_refuses_a_descriptor_of_the_wrong_size_or_without_seals() {
    let owner = ShmPool::create(KIB64).unwrap();
    let err = ShmPool::from_fd(owner.share().unwrap(), owner.id(), 2 * KIB64).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    let message = err.to_string();
    assert!(message.contains(&KIB64.to_string()), "{message}");
    assert!(message.contains(&(2 * KIB64).to_string()), "{message}");
    assert_eq!(
        kind(ShmPool::from_fd(owner.share().unwrap(), owner.id(), 0)),
        ErrorKind::InvalidInput
    );
    assert_eq!(
        kind(ShmPool::from_fd(owner.share().unwrap(), "", KIB64)),
        ErrorKind::InvalidInput,
        "a pool has an id"
    );
    // A memfd that could still shrink, and a plain file, are refused.
    let open = rustix::fs::memfd_create("unsealed", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
    rustix::fs::ftruncate(&open, KIB64).unwrap();
    let err = ShmPool::from_fd(open, "x", KIB64).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.to_string().contains("not sealed"), "{err}");
    let file = tempfile::tempfile().unwrap();
    file.set_len(KIB64).unwrap();
    let err = ShmPool::from_fd(file.into(), "x", KIB64).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
}

#[test]
fn a_pool_larger_than_the_available_memory_fails_at_creation() {
    let Some(available) = mem_available() else {
        eprintln!("no MemAvailable or cgroup limit readable; skipping");
        return;
    };
    let size = (available + (4 << 30)).next_multiple_of(4096);
    let err = ShmPool::create(size).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutOfSpace, "{err}");
    let message = err.to_string();
    // Sizes for people: "cannot reserve 20.0 GiB ...: only 16.0 GiB are available".
    let wanted = lmcache_rc_core::units::human_size(size);
    assert!(message.contains(&format!("reserve {wanted} ")), "{message}");
    assert!(!message.contains(&size.to_string()), "raw bytes: {message}");
    assert!(message.contains("lower --l1-bytes"), "{message}");
}

#[test]
fn pool_sizes_must_be_positive_multiples_of_4096() {
    for bad in [0, 1, 4095, 4097, KIB64 + 512] {
        assert_eq!(kind(ShmPool::create(bad)), ErrorKind::InvalidInput, "{bad}");
    }
}

#[test]
fn write_at_then_read_at_round_trips() {
    let pool = ShmPool::create(KIB64).unwrap();
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
    let pool = ShmPool::create(KIB64).unwrap();
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
    let pool = ShmPool::create(KIB64).unwrap();
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
fn pool_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ShmPool>();
    let pool = ShmPool::create(KIB64).unwrap();
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
