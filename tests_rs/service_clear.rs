//! Clear semantics (`docs/design/leases.md#clear`): clear drops L1 copies; a listed generation
//! whose only copy of an object was L1 is retired in the same step;
//! `all_tiers` also deletes L2 objects and retires what they backed;
//! `force = false` keeps leased and pinned objects (and the pending
//! generations that need them); `force = true` is refused while any lease is
//! live and otherwise drops everything.

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::service::LeaseStatus;

use crate::service_common::*;

both_ways!(
    nonforced_clear_keeps_leased_and_pinned_objects_and_retires_l1_only_generations,
    forced_clear_is_refused_while_any_lease_is_live_and_otherwise_drops_everything,
    nonforced_clear_keeps_l2_backed_generations_and_retrieve_reloads_them,
    clear_all_tiers_deletes_l2_objects_and_retires_what_they_backed,
);

fn nonforced_clear_keeps_leased_and_pinned_objects_and_retires_l1_only_generations<T: Target>() {
    let svc = T::open(config("clr-l1", None)).unwrap();
    let read = standard(NS, &seq(50_000, 48), "prompt", 2);
    let unleased = standard(NS, &seq(51_000, 48), "prompt", 2);
    let pending = standard(NS, &seq(52_000, 48), "prompt", 2);
    store_all(&svc, &read);
    store_all(&svc, &unleased);
    let lease = open_read(&svc, &read, 0);
    assert!(svc.begin(&pending).unwrap());
    store_one(&svc, &pending, 0);
    let writing = prepare(&svc, &pending, 1);
    fill(&svc, &pending, 1, &writing);

    let report = svc.clear(false, false).unwrap();
    assert_eq!(
        report.kept_objects,
        7 * 3,
        "read-leased, committed-pending, writing: {report:?}"
    );
    assert_eq!(report.l1_objects, 21 + 28, "{report:?}");
    assert_eq!(report.retired_generations, 2, "{report:?}");
    assert_eq!(report.l2_objects, 0);
    assert!(
        !is_listed(&svc, &read),
        "ranks 1..3 had their only copy in L1"
    );
    assert!(!is_listed(&svc, &unleased));
    assert_eq!(stat(&svc, "pending"), 1);
    // The read lease keeps exact bytes until it finishes.
    check_slots(&svc, &read, 0, &lease);
    svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
        .unwrap();
    // The pending generation kept what it needs and publishes.
    assert!(
        !svc.finish_store(writing.lease_id.as_deref().unwrap(), true, None)
            .unwrap()
    );
    for rank in 2..4 {
        store_one(&svc, &pending, rank);
    }
    assert!(is_listed(&svc, &pending));
    restore_all(&svc, &pending);
    assert_eq!(stat(&svc, "l1_objects"), 28);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn nonforced_clear_keeps_l2_backed_generations_and_retrieve_reloads_them<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let svc = T::open(config("clr-l2", Some(dir.path()))).unwrap();
    let m = standard(NS, &seq(53_000, 48), "prompt", 2);
    store_all(&svc, &m);
    settle(&svc);
    let report = svc.clear(false, false).unwrap();
    assert_eq!(report.l1_objects, 28);
    assert_eq!(report.retired_generations, 0);
    assert_eq!(report.l2_objects, 0);
    assert_eq!(stat(&svc, "l1_objects"), 0);
    assert_eq!(stat(&svc, "l2_objects"), 28);
    assert!(is_listed(&svc, &m));
    let loads = stat(&svc, "l2_loads");
    restore_all(&svc, &m);
    assert_eq!(
        stat(&svc, "l2_loads") - loads,
        28,
        "every page reloaded from L2"
    );
    assert_idle(&svc);
    svc.close().unwrap();
}

fn clear_all_tiers_deletes_l2_objects_and_retires_what_they_backed<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let svc = T::open(config("clr-all", Some(&l2))).unwrap();
    let a = standard(NS, &seq(54_000, 48), "prompt", 2);
    let b = standard(NS, &seq(55_000, 48), "prompt", 2);
    store_all(&svc, &a);
    store_all(&svc, &b);
    settle(&svc);
    svc.clear(false, false).unwrap();
    let lease = open_read(&svc, &b, 0);

    let report = svc.clear(false, true).unwrap();
    assert_eq!(report.retired_generations, 2, "{report:?}");
    assert_eq!(report.kept_objects, 7, "b's read-leased rank 0: {report:?}");
    assert_eq!(report.l2_objects, 28 + 21, "{report:?}");
    assert!(!is_listed(&svc, &a) && !is_listed(&svc, &b));
    check_slots(&svc, &b, 0, &lease);
    svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
        .unwrap();
    settle(&svc);
    assert_eq!(l2_files(&l2), (0, 0));
    assert_eq!(stat(&svc, "l2_objects"), 0);
    assert_eq!(stat(&svc, "objects"), 0);
    assert_eq!(stat(&svc, "generations"), 0);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn forced_clear_is_refused_while_any_lease_is_live_and_otherwise_drops_everything<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let svc = T::open(config("clr-force", Some(&l2))).unwrap();
    let durable = standard(NS, &seq(56_000, 48), "prompt", 2);
    store_all(&svc, &durable);
    settle(&svc);
    let pending = standard(NS, &seq(57_000, 48), "prompt", 2);
    assert!(svc.begin(&pending).unwrap());
    store_one(&svc, &pending, 0);

    // A store lease blocks it.
    let writing = prepare(&svc, &pending, 1);
    let err = svc.clear(true, false).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LeasesLive);
    assert!(err.to_string().contains("1 store"), "{err}");
    assert!(
        !svc.finish_store(writing.lease_id.as_deref().unwrap(), true, None)
            .unwrap()
    );
    // So does a retrieve lease, exposed or not.
    let exposed = open_read(&svc, &durable, 0);
    assert_eq!(
        svc.clear(true, true).unwrap_err().kind(),
        ErrorKind::LeasesLive
    );
    svc.finish_retrieve(exposed.lease_id.as_deref().unwrap(), None)
        .unwrap();
    svc.clear(false, false).unwrap();
    let lookup = svc.begin_retrieve(&durable, 1).unwrap();
    assert_eq!(lookup.status, LeaseStatus::Pending);
    assert_eq!(
        svc.clear(true, false).unwrap_err().kind(),
        ErrorKind::LeasesLive
    );
    svc.cancel_retrieve(lookup.lease_id.as_deref().unwrap(), None)
        .unwrap();
    settle(&svc);
    // A refused clear changed nothing.
    assert_eq!(stat(&svc, "pending"), 1);
    assert!(is_listed(&svc, &durable));

    // No lease: everything in L1 goes, pending generations are aborted, and
    // the L2-backed generation stays listed.
    restore(&svc, &durable, 2).unwrap();
    svc.clear(true, false).unwrap();
    assert_eq!(stat(&svc, "l1_objects"), 0);
    assert_eq!(stat(&svc, "l1_bytes"), 0);
    assert_eq!(stat(&svc, "pending"), 0);
    assert!(is_listed(&svc, &durable));
    assert_eq!(l2_files(&l2), expected_l2([&durable]));
    assert_idle(&svc);
    // The aborted generation can be staged again from scratch.
    store_all(&svc, &pending);
    settle(&svc);
    // Forced and all tiers: nothing is left anywhere.
    svc.clear(true, true).unwrap();
    settle(&svc);
    assert_eq!(stat(&svc, "generations"), 0);
    assert_eq!(stat(&svc, "objects"), 0);
    assert_eq!(l2_files(&l2), (0, 0));
    assert_idle(&svc);
    svc.close().unwrap();
}
