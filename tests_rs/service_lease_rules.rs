//! Lease rules of the service: a rejected admission aborts only the new
//! generation, non-success paths never leave a phantom lease or pin,
//! finishing twice or an unknown lease is answered plainly, a read lease
//! survives the replacement of its generation, and close waits for exposed
//! leases only.

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::protocol::MissReason;
use lmcache_rc_core::service::{LeaseStatus, ServiceConfig};

use crate::service_common::*;

both_ways!(
    rejected_lease_admission_aborts_only_the_new_generation,
    non_success_prepare_paths_leave_no_phantom_lease_or_pin,
    finishing_twice_is_harmless_and_unknown_leases_are_answered_plainly,
    close_waits_for_exposed_leases_only_and_stops_admission,
    a_read_lease_survives_the_replacement_of_its_generation,
    a_lease_finished_without_a_rank_needs_its_exact_unguessable_id,
);

/// Issue 12, item 9: `finish_store` without a rank skipped the lease-owner
/// check, and lease ids were a shared salt plus a counter, so any caller
/// could finish (publish or discard) another rank's lease by counting. Now
/// a lease id carries a tag only the service can compute: a neighbour's id
/// derived from one's own is not a lease, and a wrong rank is refused.
fn a_lease_finished_without_a_rank_needs_its_exact_unguessable_id<T: Target>() {
    let svc = T::open(config("acc-forge", None)).unwrap();
    let m = standard(NS, &seq(83_500, 48), "prompt", 2);
    assert!(svc.begin(&m).unwrap());
    let mine = prepare(&svc, &m, 0);
    let theirs = prepare(&svc, &m, 1);
    let mine_id = mine.lease_id.clone().unwrap();
    let theirs_id = theirs.lease_id.clone().unwrap();
    // Guess rank 1's id from rank 0's: same tag, neighbouring number.
    let n = u64::from_str_radix(&mine_id[..16], 16).unwrap();
    for guess in [
        format!("{:016x}{}", n + 1, &mine_id[16..]),
        format!("{}{}", &mine_id[..16], &theirs_id[16..]),
        format!("{:016x}{:016x}", n + 1, 0u64),
    ] {
        assert_ne!(guess, theirs_id);
        assert!(
            !svc.finish_store(&guess, false, None).unwrap(),
            "{guess} is not a lease"
        );
    }
    assert_eq!(stat(&svc, "store_leases"), 2, "no lease was ended");
    // Naming a rank: another rank's lease is refused.
    let e = svc.finish_store(&theirs_id, false, Some(0)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    fill(&svc, &m, 0, &mine);
    fill(&svc, &m, 1, &theirs);
    svc.finish_store(&mine_id, true, Some(0)).unwrap();
    svc.finish_store(&theirs_id, true, None).unwrap();
    for rank in 2..4 {
        store_one(&svc, &m, rank);
    }
    assert!(is_listed(&svc, &m));
    assert_idle(&svc);
    svc.close().unwrap();
}

fn rejected_lease_admission_aborts_only_the_new_generation<T: Target>() {
    let cfg = ServiceConfig {
        max_leases: 1,
        ..config("acc-budget", None)
    };
    let svc = T::open(cfg).unwrap();
    let first = standard(NS, &seq(80_000, 48), "prompt", 2);
    let second = standard(NS, &seq(81_000, 48), "prompt", 2);
    assert!(svc.begin(&first).unwrap());
    assert!(svc.begin(&second).unwrap());
    let live = prepare(&svc, &first, 0);
    let rejected = svc.prepare_store(&second, 0).unwrap();
    assert_eq!(rejected.reason, Some(MissReason::LeaseBudget));
    assert_eq!(
        stat(&svc, "pending"),
        1,
        "only the rejected generation is aborted"
    );
    fill(&svc, &first, 0, &live);
    svc.finish_store(live.lease_id.as_deref().unwrap(), true, None)
        .unwrap();
    for rank in 1..4 {
        store_one(&svc, &first, rank);
    }
    assert!(is_listed(&svc, &first));
    assert!(!is_listed(&svc, &second));
    restore_all(&svc, &first);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn non_success_prepare_paths_leave_no_phantom_lease_or_pin<T: Target>() {
    let cfg = ServiceConfig {
        max_leases: 2,
        ..config("acc-phantom", None)
    };
    let svc = T::open(cfg).unwrap();
    let m = standard(NS, &seq(82_000, 48), "prompt", 2);
    let cont = standard(NS, &seq(82_000, 60), "prompt", 2);
    let counts = |svc: &T| (stat(svc, "store_leases"), stat(svc, "pins"));

    // Not pending: a miss with no side effect.
    let before = counts(&svc);
    assert_eq!(
        svc.prepare_store(&m, 0).unwrap().reason,
        Some(MissReason::NotPending)
    );
    assert_eq!(counts(&svc), before);

    assert!(svc.begin(&m).unwrap());
    assert!(svc.begin(&cont).unwrap());
    let live = prepare(&svc, &m, 0);
    let before = counts(&svc);
    // Busy: the shared pages are being written.
    assert_eq!(
        svc.prepare_store(&cont, 0).unwrap().status,
        LeaseStatus::Busy
    );
    assert_eq!(counts(&svc), before);
    // Errors: a rank outside the world, a second lease for the same rank.
    assert_eq!(
        svc.prepare_store(&m, 4).unwrap_err().kind(),
        ErrorKind::InvalidInput
    );
    let err = svc.prepare_store(&m, 0).unwrap_err();
    assert!(
        err.to_string().contains("already has a store lease"),
        "{err}"
    );
    assert_eq!(counts(&svc), before);
    // A rank that already committed may not prepare again.
    fill(&svc, &m, 0, &live);
    svc.finish_store(live.lease_id.as_deref().unwrap(), true, None)
        .unwrap();
    let before = counts(&svc);
    let err = svc.prepare_store(&m, 0).unwrap_err();
    assert!(err.to_string().contains("already committed"), "{err}");
    assert_eq!(counts(&svc), before);
    // Lease budget: two live leases, a third prepare misses and aborts its
    // own generation only.
    let a = prepare(&svc, &m, 1);
    let b = prepare(&svc, &m, 2);
    assert_eq!(
        svc.prepare_store(&cont, 1).unwrap().reason,
        Some(MissReason::LeaseBudget)
    );
    assert_eq!(stat(&svc, "store_leases"), 2);
    for (rank, lease) in [(1, &a), (2, &b)] {
        fill(&svc, &m, rank, lease);
        svc.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
            .unwrap();
    }
    assert!(store_one(&svc, &m, 3).0);
    assert_eq!(stat(&svc, "pending"), 0);
    restore_all(&svc, &m);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn finishing_twice_is_harmless_and_unknown_leases_are_answered_plainly<T: Target>() {
    let svc = T::open(config("acc-twice", None)).unwrap();
    let m = standard(NS, &seq(83_000, 48), "prompt", 2);
    assert!(svc.begin(&m).unwrap());
    for rank in 0..3 {
        store_one(&svc, &m, rank);
    }
    let last = prepare(&svc, &m, 3);
    fill(&svc, &m, 3, &last);
    let id = last.lease_id.clone().unwrap();
    assert!(
        svc.finish_store(&id, true, None).unwrap(),
        "the publishing call"
    );
    assert!(
        !svc.finish_store(&id, true, None).unwrap(),
        "a second finish is False"
    );
    assert!(!svc.finish_store(&id, false, None).unwrap());
    assert!(
        is_listed(&svc, &m),
        "a late failure report cannot unpublish"
    );

    let read = open_read(&svc, &m, 1);
    let rid = read.lease_id.clone().unwrap();
    assert_eq!(
        svc.poll_retrieve(&rid, None).unwrap().slots,
        read.slots,
        "same slots again"
    );
    let err = svc.cancel_retrieve(&rid, None).unwrap_err();
    assert!(
        err.to_string().contains("finish"),
        "exposed slots are finished: {err}"
    );
    svc.finish_retrieve(&rid, None).unwrap();
    svc.finish_retrieve(&rid, None).unwrap();
    assert_eq!(
        svc.poll_retrieve(&rid, None).unwrap_err().kind(),
        ErrorKind::NotFound
    );

    let unknown = "0123456789abcdef0123456789abcdef";
    assert!(!svc.finish_store(unknown, true, None).unwrap());
    assert!(!svc.finish_store("not-a-lease", true, None).unwrap());
    svc.finish_retrieve(unknown, None).unwrap();
    svc.cancel_retrieve(unknown, None).unwrap();
    assert_eq!(
        svc.poll_retrieve(unknown, None).unwrap_err().kind(),
        ErrorKind::NotFound
    );
    // A lookup that is still pending must be cancelled, not finished.
    let dir = tempfile::tempdir().unwrap();
    let svc2 = T::open(config("acc-pending", Some(dir.path()))).unwrap();
    store_all(&svc2, &m);
    settle(&svc2);
    svc2.clear(false, false).unwrap();
    let lookup = svc2.begin_retrieve(&m, 0).unwrap();
    let lid = lookup.lease_id.unwrap();
    let err = svc2.finish_retrieve(&lid, None).unwrap_err();
    assert!(err.to_string().contains("cancel"), "{err}");
    svc2.cancel_retrieve(&lid, None).unwrap();
    settle(&svc2);
    assert_idle(&svc2);
    svc2.close().unwrap();
    assert_idle(&svc);
    svc.close().unwrap();
}

fn close_waits_for_exposed_leases_only_and_stops_admission<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let svc = T::open(config("acc-close", Some(dir.path()))).unwrap();
    let m = standard(NS, &seq(84_000, 48), "prompt", 2);
    store_all(&svc, &m);
    settle(&svc);
    let exposed = open_read(&svc, &m, 0);
    assert_eq!(svc.close().unwrap_err().kind(), ErrorKind::LeasesLive);
    // A failed close leaves the service usable.
    restore(&svc, &m, 1).unwrap();
    svc.finish_retrieve(exposed.lease_id.as_deref().unwrap(), None)
        .unwrap();
    // A lookup that exposed nothing does not block close.
    svc.clear(false, false).unwrap();
    assert_idle(&svc);
    let pending = svc.begin_retrieve(&m, 2).unwrap();
    assert_eq!(pending.status, LeaseStatus::Pending);
    svc.close().unwrap();
    assert_eq!(svc.begin(&m).unwrap_err().kind(), ErrorKind::Closed);
}

fn a_read_lease_survives_the_replacement_of_its_generation<T: Target>() {
    let svc = T::open(config("acc-replace", None)).unwrap();
    let tokens = seq(85_000, 48);
    let old = standard(NS, &tokens, "prompt", 2);
    store_all(&svc, &old);
    let lease = open_read(&svc, &old, 2);
    let new = standard(NS, &tokens, "response", 2);
    store_all(&svc, &new);
    assert!(is_listed(&svc, &new) && !is_listed(&svc, &old), "replaced");
    assert_eq!(restore(&svc, &old, 0).unwrap_err(), "not_listed");
    // The exposed slots keep their bytes until the worker finishes.
    check_slots(&svc, &old, 2, &lease);
    svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
        .unwrap();
    // Then the replaced generation's own pages (its auxiliary page) are gone.
    assert_eq!(stat(&svc, "objects"), all_keys(&new).len() as u64);
    restore_all(&svc, &new);
    assert_idle(&svc);
    svc.close().unwrap();
}
