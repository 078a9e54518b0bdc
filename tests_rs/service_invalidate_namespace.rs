//! `invalidate_namespace`: retires exactly the listed generations of one
//! namespace (other namespaces keep every generation, page and file), their
//! pages leave L1 and L2 once nothing holds them (a read lease keeps its
//! bytes until it finishes), pending generations are not touched, and a
//! namespace outside 1..256 characters is refused.

use lmcache_rc_core::ErrorKind;

use crate::service_common::*;

const OTHER: &str = "recurrent-sha256-v1:another-tenant";

both_ways!(
    invalidate_namespace_retires_only_its_generations_and_deletes_their_pages_from_both_tiers,
    invalidate_namespace_keeps_read_leased_pages_until_finished_and_leaves_pending_alone,
    invalidate_namespace_refuses_an_invalid_namespace,
);

fn invalidate_namespace_retires_only_its_generations_and_deletes_their_pages_from_both_tiers<
    T: Target,
>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let svc = T::open(config("inv-ns", Some(&l2))).unwrap();
    let a = standard(NS, &seq(60_000, 48), "prompt", 2);
    let a2 = standard(NS, &seq(61_000, 48), "prompt", 2);
    let kept = standard(OTHER, &seq(60_000, 48), "prompt", 2);
    store_all(&svc, &a);
    store_all(&svc, &a2);
    store_all(&svc, &kept);
    settle(&svc);
    assert_eq!(l2_files(&l2), expected_l2([&a, &a2, &kept]));

    assert_eq!(svc.invalidate_namespace(NS).unwrap(), 2);
    assert!(!is_listed(&svc, &a) && !is_listed(&svc, &a2));
    assert!(is_listed(&svc, &kept));
    settle(&svc);
    assert_eq!(
        l2_files(&l2),
        expected_l2([&kept]),
        "only the other namespace's files remain"
    );
    assert_eq!(stat(&svc, "generations"), 1);
    assert_eq!(stat(&svc, "objects"), all_keys(&kept).len() as u64);
    assert_eq!(stat(&svc, "l1_objects"), all_keys(&kept).len() as u64);
    assert_eq!(stat(&svc, "invalidated_generations"), 2);
    restore_all(&svc, &kept);
    // Nothing left to retire: a second call answers 0.
    assert_eq!(svc.invalidate_namespace(NS).unwrap(), 0);
    assert_eq!(svc.invalidate_namespace(OTHER).unwrap(), 1);
    settle(&svc);
    assert_eq!(l2_files(&l2), (0, 0));
    assert_eq!(stat(&svc, "objects"), 0);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn invalidate_namespace_keeps_read_leased_pages_until_finished_and_leaves_pending_alone<
    T: Target,
>() {
    let svc = T::open(config("inv-lease", None)).unwrap();
    let read = standard(NS, &seq(62_000, 48), "prompt", 2);
    let pending = standard(NS, &seq(63_000, 48), "prompt", 2);
    store_all(&svc, &read);
    let lease = open_read(&svc, &read, 0);
    assert!(svc.begin(&pending).unwrap());
    store_one(&svc, &pending, 0);

    assert_eq!(svc.invalidate_namespace(NS).unwrap(), 1);
    assert!(!is_listed(&svc, &read));
    assert_eq!(
        stat(&svc, "pending"),
        1,
        "pending generations are not touched"
    );
    // The read lease still sees exact bytes; its pages go when it finishes.
    check_slots(&svc, &read, 0, &lease);
    svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
        .unwrap();
    for rank in 1..pending.world_size() {
        store_one(&svc, &pending, rank);
    }
    assert!(is_listed(&svc, &pending));
    restore_all(&svc, &pending);
    assert_eq!(stat(&svc, "objects"), all_keys(&pending).len() as u64);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn invalidate_namespace_refuses_an_invalid_namespace<T: Target>() {
    let svc = T::open(config("inv-bad", None)).unwrap();
    let m = standard(NS, &seq(64_000, 48), "prompt", 2);
    store_all(&svc, &m);
    for bad in [String::new(), "n".repeat(257)] {
        let err = svc.invalidate_namespace(&bad).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    }
    assert!(is_listed(&svc, &m));
    svc.close().unwrap();
}
