//! Faults: failing ranks, workers that never finish, L2 write and read
//! errors injected through `FaultyFs`, and corrupted L2 files. Whatever
//! fails, a generation publishes completely or not at all (I1), a restore is
//! exact or a clean miss (I2, I8), and nothing leaks (I7).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::service::{LeaseStatus, ServiceConfig};
use lmcache_rc_core::store::l2::testing::{FaultyFs, Op};

use crate::service_common::*;

both_ways!(
    a_rank_reporting_failure_after_the_others_committed_prevents_publication,
    an_aborted_generation_is_staged_again_only_after_its_leases_drain,
    a_worker_that_never_finishes_keeps_its_lease_and_pages_until_it_does,
    abandoned_unfinished_write_pages_are_rewritten_not_reused,
    a_failed_l2_write_is_retried_while_its_object_stays_in_l1,
    a_failed_l2_fsync_poisons_the_tier_but_generations_still_publish_from_l1,
    a_corrupted_l2_file_is_a_clean_miss_that_retires_its_generation,
    a_byte_flipped_while_reading_l2_is_caught_by_the_checksum,
    an_l2_read_error_is_a_miss_that_keeps_the_generation_listed,
);

fn tokens() -> Vec<u32> {
    seq(31_000, 48)
}

fn a_rank_reporting_failure_after_the_others_committed_prevents_publication<T: Target>() {
    let svc = T::open(config("f-lastrank", None)).unwrap();
    let m = standard(NS, &tokens(), "prompt", 2);
    assert!(svc.begin(&m).unwrap());
    for rank in 0..3 {
        assert!(!store_one(&svc, &m, rank).0);
    }
    let lease = prepare(&svc, &m, 3);
    fill(&svc, &m, 3, &lease);
    assert!(
        !svc.finish_store(lease.lease_id.as_deref().unwrap(), false, None)
            .unwrap()
    );
    assert!(!is_listed(&svc, &m));
    assert_eq!(stat(&svc, "pending"), 0);
    assert_eq!(
        stat(&svc, "l1_objects"),
        0,
        "committed pages of the aborted generation freed"
    );
    assert_eq!(svc.prepare_store(&m, 3).unwrap().status, LeaseStatus::Miss);
    assert_idle(&svc);
    // It can be staged and stored again.
    store_all(&svc, &m);
    restore_all(&svc, &m);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn an_aborted_generation_is_staged_again_only_after_its_leases_drain<T: Target>() {
    let svc = T::open(config("f-restage", None)).unwrap();
    let m = standard(NS, &tokens(), "prompt", 2);
    assert!(svc.begin(&m).unwrap());
    let leases: Vec<_> = (0..4).map(|rank| prepare(&svc, &m, rank)).collect();
    assert!(
        !svc.finish_store(leases[1].lease_id.as_deref().unwrap(), false, None)
            .unwrap()
    );
    // Ranks 0, 2 and 3 are still copying into the aborted attempt.
    assert!(
        !svc.begin(&m).unwrap(),
        "staged again while its leases are live"
    );
    for rank in [0usize, 2, 3] {
        fill(&svc, &m, rank as u32, &leases[rank]);
        assert!(
            !svc.finish_store(leases[rank].lease_id.as_deref().unwrap(), true, None)
                .unwrap()
        );
        assert!(!is_listed(&svc, &m));
    }
    assert_idle(&svc);
    store_all(&svc, &m);
    restore_all(&svc, &m);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn a_worker_that_never_finishes_keeps_its_lease_and_pages_until_it_does<T: Target>() {
    let svc = T::open(config("f-hung", None)).unwrap();
    let listed = standard(NS, &seq(32_000, 40), "prompt", 2);
    store_all(&svc, &listed);
    let m = standard(NS, &tokens(), "prompt", 2);
    assert!(svc.begin(&m).unwrap());
    for rank in 1..4 {
        store_one(&svc, &m, rank);
    }
    let hung = prepare(&svc, &m, 0);
    fill(&svc, &m, 0, &hung);

    let err = svc.close().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LeasesLive);
    let err = svc.clear(true, false).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LeasesLive);
    let report = svc.clear(false, false).unwrap();
    assert!(report.kept_objects >= 7, "{report:?}");
    // The service keeps serving and the hung lease's slots keep their bytes.
    assert_eq!(stat(&svc, "store_leases"), 1);
    assert!(!is_listed(&svc, &listed), "its only copy was L1");
    let keys = rank_keys(&m, 0);
    for (g, slots) in hung.slots.iter().enumerate() {
        for (i, slot) in slots.iter().enumerate() {
            let (offset, len) = slot.unwrap();
            let mut got = vec![0u8; len as usize];
            svc.pool().read_at(offset, &mut got).unwrap();
            assert!(got == object_bytes(&keys[g][i], len), "slot recycled");
        }
    }
    // Once the worker finishes, the generation publishes and close works.
    assert!(
        svc.finish_store(hung.lease_id.as_deref().unwrap(), true, None)
            .unwrap()
    );
    restore_all(&svc, &m);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn abandoned_unfinished_write_pages_are_rewritten_not_reused<T: Target>() {
    let cfg = ServiceConfig {
        abandoned_after: Some(Duration::from_secs(1)),
        ..config("f-abandoned", None)
    };
    let svc = T::open(cfg).unwrap();
    let abandoned = standard(NS, &tokens(), "instruction", 2);
    assert!(svc.begin(&abandoned).unwrap());
    let hung = prepare(&svc, &abandoned, 0);
    // The timer aborts the stale generation; its live lease is not recycled.
    let deadline = std::time::Instant::now() + HANG_GUARD;
    while stat(&svc, "abandoned_generations") == 0 {
        assert!(std::time::Instant::now() < deadline, "never aborted");
        std::thread::sleep(Duration::from_millis(10));
    }
    let next = standard(NS, &seq(31_000, 60), "prompt", 2);
    assert!(svc.begin(&next).unwrap());
    assert_eq!(stat(&svc, "store_leases"), 1);
    assert_eq!(
        svc.prepare_store(&next, 0).unwrap().status,
        LeaseStatus::Busy,
        "pages of a live, unfinished write are never reused"
    );
    // The worker finishes late: its pages are discarded, not committed.
    fill(&svc, &abandoned, 0, &hung);
    assert!(
        !svc.finish_store(hung.lease_id.as_deref().unwrap(), true, None)
            .unwrap()
    );
    let lease = prepare(&svc, &next, 0);
    assert!(
        lease.slots.iter().flatten().all(Option::is_some),
        "every page is written again: {:?}",
        lease.slots
    );
    fill(&svc, &next, 0, &lease);
    svc.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
        .unwrap();
    for rank in 1..4 {
        store_one(&svc, &next, rank);
    }
    assert!(!is_listed(&svc, &abandoned));
    restore_all(&svc, &next);
    assert_idle(&svc);
    svc.close().unwrap();
}

/// Issue 12, failure 5: a failed L2 write is retried with backoff while the
/// object stays pinned in L1, so a transient write error never loses a
/// published generation. (Before: the write was dropped and the generation
/// stayed L1-only, lost at the next restart.)
fn a_failed_l2_write_is_retried_while_its_object_stays_in_l1<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let faulty = FaultyFs::new();
    let svc = T::open_with_fs(
        config("f-l2write", Some(&l2)),
        Arc::new(faulty.clone()),
        &mut |_| {},
    )
    .unwrap();
    faulty.fail_next(Op::Write, 10_000, io::ErrorKind::Other);
    let m = standard(NS, &tokens(), "prompt", 2);
    store_all(&svc, &m);
    assert!(is_listed(&svc, &m));
    let deadline = std::time::Instant::now() + HANG_GUARD;
    while stat(&svc, "l2_write_retries") < 28 {
        assert!(
            std::time::Instant::now() < deadline,
            "writes were not retried"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(
        stat(&svc, "l2_write_errors") >= 28,
        "every object's write failed"
    );
    assert_eq!(stat(&svc, "l2_objects"), 0);
    assert_eq!(l2_files(&l2), (0, 0), "no partial object file left behind");
    // The objects waiting for a retry keep their L1 copies: a clear keeps
    // them and the generation.
    let report = svc.clear(false, false).unwrap();
    assert_eq!(report.retired_generations, 0, "{report:?}");
    assert!(is_listed(&svc, &m));
    restore_all(&svc, &m);

    // The fault passes: the retries make the generation durable.
    faulty.clear_faults();
    settle(&svc);
    assert_eq!(stat(&svc, "l2_objects"), 28);
    assert_eq!(stat(&svc, "l2_write_retrying"), 0);
    let report = svc.clear(false, false).unwrap();
    assert_eq!(report.retired_generations, 0, "{report:?}");
    assert!(is_listed(&svc, &m));
    restore_all(&svc, &m);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn a_failed_l2_fsync_poisons_the_tier_but_generations_still_publish_from_l1<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let faulty = FaultyFs::new();
    let svc = T::open_with_fs(
        config("f-fsync", Some(&l2)),
        Arc::new(faulty.clone()),
        &mut |_| {},
    )
    .unwrap();
    faulty.fail_next(Op::SyncFile, 1, io::ErrorKind::Other);
    let a = standard(NS, &tokens(), "prompt", 2);
    let b = standard(NS, &seq(34_000, 40), "prompt", 2);
    store_all(&svc, &a);
    store_all(&svc, &b);
    settle(&svc);
    assert!(is_listed(&svc, &a) && is_listed(&svc, &b));
    let errors = stat(&svc, "l2_write_errors");
    assert!(errors >= 1, "the failed fsync is counted");
    assert_eq!(
        stat(&svc, "l2_objects") + errors,
        56,
        "each object durable or counted failed"
    );
    restore_all(&svc, &a);
    restore_all(&svc, &b);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn a_corrupted_l2_file_is_a_clean_miss_that_retires_its_generation<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let svc = T::open(config("f-corrupt", Some(&l2))).unwrap();
    let m = standard(NS, &tokens(), "prompt", 2);
    let other = standard(NS, &seq(35_000, 40), "prompt", 2);
    store_all(&svc, &m);
    store_all(&svc, &other);
    settle(&svc);
    // Flip one payload byte of rank 1's recurrent page on disk.
    let path = l2_file(&l2, &rank_keys(&m, 1)[1][0]);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[64 + 100] ^= 0x5a;
    std::fs::write(&path, &bytes).unwrap();
    svc.clear(false, false).unwrap();
    assert!(
        is_listed(&svc, &m),
        "L2 backs it; the damage is found at read time"
    );

    restore(&svc, &m, 0).unwrap();
    assert_eq!(restore(&svc, &m, 1).unwrap_err(), "lost_object");
    assert!(!is_listed(&svc, &m), "retired");
    assert_eq!(restore(&svc, &m, 2).unwrap_err(), "not_listed");
    settle(&svc);
    assert!(stat(&svc, "l2_corrupt_or_missing") >= 1);
    assert_eq!(
        l2_files(&l2),
        expected_l2([&other]),
        "its objects are gone from L2"
    );
    assert_eq!(stat(&svc, "objects"), 28);
    restore_all(&svc, &other);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn a_byte_flipped_while_reading_l2_is_caught_by_the_checksum<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let faulty = FaultyFs::new();
    let svc = T::open_with_fs(
        config("f-flip", Some(&l2)),
        Arc::new(faulty.clone()),
        &mut |_| {},
    )
    .unwrap();
    let m = standard(NS, &tokens(), "prompt", 2);
    store_all(&svc, &m);
    settle(&svc);
    svc.clear(false, false).unwrap();
    faulty.flip_byte_on_read(64 + 10, 1);
    assert_eq!(restore(&svc, &m, 0).unwrap_err(), "lost_object");
    assert!(!is_listed(&svc, &m));
    settle(&svc);
    assert_eq!(l2_files(&l2), (0, 0));
    assert_eq!(stat(&svc, "objects"), 0);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn an_l2_read_error_is_a_miss_that_keeps_the_generation_listed<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let faulty = FaultyFs::new();
    let svc = T::open_with_fs(
        config("f-readerr", Some(&l2)),
        Arc::new(faulty.clone()),
        &mut |_| {},
    )
    .unwrap();
    let m = standard(NS, &tokens(), "prompt", 2);
    store_all(&svc, &m);
    settle(&svc);
    svc.clear(false, false).unwrap();
    faulty.fail_next(Op::Read, 1, io::ErrorKind::Other);
    assert_eq!(restore(&svc, &m, 2).unwrap_err(), "l2_read_error");
    settle(&svc);
    assert!(is_listed(&svc, &m), "failed I/O is not proof of loss");
    assert_idle(&svc);
    restore_all(&svc, &m);
    assert_eq!(l2_files(&l2), expected_l2([&m]));
    assert_idle(&svc);
    svc.close().unwrap();
}
