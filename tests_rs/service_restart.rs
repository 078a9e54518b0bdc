//! Restart reconciliation (`docs/design/l2-format.md#start-up-reconciliation-service`;
//! I7, I8 of `docs/design/README.md#invariants`; the "restart" row of
//! `docs/design/README.md#where-lmcache-rc-differs-from-the-reference`): at start-up the
//! directory is reconciled with the L2 files. Objects no listed generation
//! references are deleted; a generation with a missing or corrupt (wrong
//! size or header) object file is retired; payload checksum errors are found
//! when the object is read. Pending work never survives.

use std::sync::Arc;

use lmcache_rc_core::Manifest;
use lmcache_rc_core::store::ObjectKey;
use lmcache_rc_core::store::l2::{L2Tier, RealFs};

use crate::service_common::*;

both_ways!(
    unreferenced_objects_and_pending_work_are_deleted_at_start_up,
    generations_with_missing_or_corrupt_object_files_are_retired_at_start_up,
    without_a_durable_directory_payload_files_are_reclaimed_at_start_up,
);

fn generation_at(base: u32) -> Manifest {
    standard(NS, &seq(base, 48), "prompt", 2)
}

fn unreferenced_objects_and_pending_work_are_deleted_at_start_up<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let listed = generation_at(60_000);
    let pending = generation_at(61_000);
    {
        let svc = T::open(durable_config("rs-orphan", dir.path())).unwrap();
        store_all(&svc, &listed);
        assert!(svc.begin(&pending).unwrap());
        store_one(&svc, &pending, 0);
        store_one(&svc, &pending, 1);
        settle(&svc);
        assert_eq!(stat(&svc, "l2_objects"), 28 + 14);
        svc.close().unwrap();
    }
    // An object written by someone else that nothing references.
    {
        let (tier, _) = L2Tier::open(&l2, None, Arc::new(RealFs)).unwrap();
        tier.write(&ObjectKey([7; 32]), &[1u8; 500]).unwrap();
    }
    assert_eq!(l2_files(&l2).0, 28 + 14 + 1);

    let svc = T::open(durable_config("rs-orphan2", dir.path())).unwrap();
    assert_eq!(
        stat(&svc, "pending"),
        0,
        "pending work never survives a restart"
    );
    assert_eq!(stat(&svc, "generations"), 1);
    assert_eq!(l2_files(&l2), expected_l2([&listed]));
    assert_eq!(stat(&svc, "l2_objects"), 28);
    assert_eq!(stat(&svc, "objects"), 28);
    restore_all(&svc, &listed);
    assert!(
        svc.begin(&pending).unwrap(),
        "the pending generation must be stored again"
    );
    svc.abort(pending.generation()).unwrap();
    assert_idle(&svc);
    svc.close().unwrap();
}

fn generations_with_missing_or_corrupt_object_files_are_retired_at_start_up<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let missing = generation_at(62_000);
    let bad_header = generation_at(63_000);
    let truncated = generation_at(64_000);
    let intact = generation_at(65_000);
    let rotten = generation_at(66_000);
    let all = [&missing, &bad_header, &truncated, &intact, &rotten];
    {
        let svc = T::open(durable_config("rs-corrupt", dir.path())).unwrap();
        for m in all {
            store_all(&svc, m);
        }
        settle(&svc);
        svc.close().unwrap();
    }
    std::fs::remove_file(l2_file(&l2, &rank_keys(&missing, 3)[3][0])).unwrap();
    let path = l2_file(&l2, &rank_keys(&bad_header, 1)[0][2]);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[0] ^= 0xff; // magic
    std::fs::write(&path, &bytes).unwrap();
    let path = l2_file(&l2, &rank_keys(&truncated, 2)[1][0]);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
    let path = l2_file(&l2, &rank_keys(&rotten, 0)[2][1]);
    let mut bytes = std::fs::read(&path).unwrap();
    *bytes.last_mut().unwrap() ^= 0x01; // payload: the header stays valid
    std::fs::write(&path, &bytes).unwrap();

    let svc = T::open(durable_config("rs-corrupt2", dir.path())).unwrap();
    assert_eq!(stat(&svc, "restart_retired"), 3);
    assert_eq!(stat(&svc, "generations"), 2);
    for m in [&missing, &bad_header, &truncated] {
        assert!(!is_listed(&svc, m), "{} should be retired", m.generation());
        assert_eq!(restore(&svc, m, 0).unwrap_err(), "not_listed");
    }
    assert!(is_listed(&svc, &intact) && is_listed(&svc, &rotten));
    // Only the listed generations' files remain (corrupt ones reclaimed).
    assert_eq!(l2_files(&l2), expected_l2([&intact, &rotten]));
    restore_all(&svc, &intact);
    // The payload checksum error is found when the page is read.
    assert_eq!(restore(&svc, &rotten, 0).unwrap_err(), "lost_object");
    assert!(!is_listed(&svc, &rotten));
    settle(&svc);
    assert_eq!(l2_files(&l2), expected_l2([&intact]));
    assert_idle(&svc);
    svc.close().unwrap();
}

fn without_a_durable_directory_payload_files_are_reclaimed_at_start_up<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let m = generation_at(67_000);
    {
        let svc = T::open(config("rs-ram", Some(&l2))).unwrap();
        store_all(&svc, &m);
        settle(&svc);
        svc.close().unwrap();
    }
    assert_eq!(l2_files(&l2).0, 28);
    let svc = T::open(config("rs-ram2", Some(&l2))).unwrap();
    assert_eq!(stat(&svc, "generations"), 0);
    assert_eq!(l2_files(&l2), (0, 0), "unreachable without a manifest");
    assert!(svc.begin(&m).unwrap());
    svc.abort(m.generation()).unwrap();
    assert_idle(&svc);
    svc.close().unwrap();
}
