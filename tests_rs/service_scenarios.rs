//! The reference scenarios (`docs/design/leases.md#the-standard-test-manifest`) with the standard
//! manifest (world 4; 128/256/64/96-byte page groups). Each scenario is named
//! after the rule it checks and runs twice: on the service in process and
//! over the socket (see `service_common::Target`); those that evict run
//! under both eviction policies too (`every_policy!`).

use std::collections::HashSet;

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::cost::Eviction;
use lmcache_rc_core::protocol::{Checkpoints, MissReason};
use lmcache_rc_core::service::{CheckpointService, LeaseStatus};

use crate::service_common::*;

both_ways!(
    publication_waits_for_the_last_rank_and_every_rank_restores_exact_shared_bytes,
    a_failed_commit_releases_uncommitted_reservations_and_the_generation_can_be_staged_again,
    shm_roundtrip_of_all_ranks_and_groups_keeps_read_leased_pages_until_finish,
    cancelling_a_pending_lookup_drains_its_locks_without_invalidating_the_generation,
    content_addressed_pages_skip_resident_duplicate_copies,
    content_addressed_pages_coalesce_with_an_inflight_writer_that_commits,
    content_addressed_pages_coalesce_with_an_inflight_writer_that_aborts,
    a_drained_copy_failure_finishes_the_lease_and_an_undrained_one_keeps_it,
    lease_budget_never_recycles_live_copy_buffers,
    nonforced_clear_preserves_a_pending_read_lease_and_a_write_lease,
    nonforced_clear_preserves_an_exposed_read_lease_and_a_write_lease,
    a_failed_rank_prevents_publication_after_other_ranks_complete,
    a_rank_cannot_replace_the_staged_payload_layout,
    a_missing_page_invalidates_the_bundle_and_releases_other_read_locks,
    generation_namespace_and_rank_have_disjoint_payload_keys,
    filesystem_restore_after_directory_and_storage_restart,
);

// The scenarios that evict, under both eviction policies.
every_policy!(
    payload_capacity_miss_preserves_a_read_leased_checkpoint,
    checkpoint_pages_are_individually_evictable_except_leased_ones,
    sustained_stores_reclaim_capacity_without_losing_a_read,
);

fn tokens() -> Vec<u32> {
    seq(1000, 48)
}

fn publication_waits_for_the_last_rank_and_every_rank_restores_exact_shared_bytes<T: Target>() {
    let svc = T::open(config("sc-roundtrip", None)).unwrap();
    let caps = svc.capabilities().unwrap();
    assert_eq!(caps.format_version, 1);
    assert_eq!(caps.pool_id, svc.pool().id());
    assert_eq!(caps.pool_size, 4 << 20);
    assert!(!caps.durable_index);

    let m = standard(NS, &tokens(), "prompt", 2);
    assert!(svc.begin(&m).unwrap());
    for rank in 0..4 {
        assert!(!is_listed(&svc, &m), "findable before rank {rank} finished");
        let (published, copied) = store_one(&svc, &m, rank);
        assert_eq!(published, rank == 3, "only the 4th finish publishes");
        assert_eq!(copied, 3 * 128 + 256 + 2 * 64 + 96);
    }
    assert!(is_listed(&svc, &m));
    for rank in 0..4 {
        restore(&svc, &m, rank).unwrap();
    }
    // Close refuses while a read lease is live, and stays usable.
    let lease = open_read(&svc, &m, 2);
    let err = svc.close().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::LeasesLive);
    assert!(err.to_string().contains("drain"), "{err}");
    assert_eq!(stat(&svc, "retrieve_leases"), 1);
    svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
        .unwrap();
    assert_eq!(stat(&svc, "retrieve_leases"), 0);
    assert_eq!(stat(&svc, "store_leases"), 0);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn content_addressed_pages_skip_resident_duplicate_copies<T: Target>() {
    let svc = T::open(config("sc-dedup", None)).unwrap();
    let first = standard(NS, &tokens(), "prompt", 2);
    store_all(&svc, &first);
    // A continuation: the three full attention pages (boundaries 16, 32, 48)
    // are the same content; the recurrent, draft and auxiliary pages are not.
    let second = standard(NS, &seq(1000, 60), "prompt", 2);
    assert!(svc.begin(&second).unwrap());
    for rank in 0..4 {
        let lease = prepare(&svc, &second, rank);
        assert_eq!(lease.status, LeaseStatus::Ready);
        assert_eq!(lease.slots[0], vec![None, None, None], "rank {rank}");
        for group in &lease.slots[1..] {
            assert!(group.iter().all(Option::is_some), "rank {rank}: {group:?}");
        }
        assert_eq!(fill(&svc, &second, rank, &lease), 256 + 2 * 64 + 96);
        let published = svc
            .finish_store(lease.lease_id.as_deref().unwrap(), true, None)
            .unwrap();
        assert_eq!(published, rank == 3);
    }
    for rank in 0..4 {
        let (a, b) = (rank_keys(&first, rank), rank_keys(&second, rank));
        assert_eq!(a[0], b[0], "attention keys are shared");
        for g in 1..4 {
            assert!(a[g].iter().all(|k| !b[g].contains(k)), "group {g} differs");
        }
    }
    assert!(is_listed(&svc, &first) && is_listed(&svc, &second));
    restore_all(&svc, &first);
    restore_all(&svc, &second);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn coalesce_with_inflight_writer(first_succeeds: bool) {
    let svc = CheckpointService::open(config("sc-coalesce", None)).unwrap();
    let first = standard(NS, &tokens(), "instruction", 2);
    let second = standard(NS, &seq(1000, 60), "prompt", 2);
    assert!(svc.begin(&first).unwrap());
    assert!(svc.begin(&second).unwrap());
    let writer = prepare(&svc, &first, 0);
    assert_eq!(writer.status, LeaseStatus::Ready);
    fill(&svc, &first, 0, &writer);

    // The shared attention pages are being written: busy, not miss, and the
    // second generation stays pending with no lease and no pin of its own.
    let pins_before = stat(&svc, "pins");
    let busy = svc.prepare_store(&second, 0).unwrap();
    assert_eq!(busy.status, LeaseStatus::Busy);
    assert_eq!(busy.lease_id, None);
    assert_eq!(stat(&svc, "store_leases"), 1);
    assert_eq!(stat(&svc, "pins"), pins_before);
    assert_eq!(stat(&svc, "pending"), 2);

    let id = writer.lease_id.as_deref().unwrap();
    assert!(!svc.finish_store(id, first_succeeds, None).unwrap());
    let lease = prepare(&svc, &second, 0);
    assert_eq!(lease.status, LeaseStatus::Ready);
    if first_succeeds {
        assert_eq!(
            lease.slots[0],
            vec![None, None, None],
            "no copy of committed pages"
        );
    } else {
        assert!(
            lease.slots[0].iter().all(Option::is_some),
            "pages of an aborted writer are written again: {:?}",
            lease.slots[0]
        );
    }
    fill(&svc, &second, 0, &lease);
    assert!(
        !svc.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
            .unwrap()
    );
    for rank in 1..4 {
        store_one(&svc, &second, rank);
    }
    assert!(
        is_listed(&svc, &second),
        "the second generation always publishes"
    );
    restore_all(&svc, &second);
    if first_succeeds {
        for rank in 1..4 {
            store_one(&svc, &first, rank);
        }
        assert!(is_listed(&svc, &first));
        restore_all(&svc, &first);
    } else {
        assert!(!is_listed(&svc, &first));
        assert_eq!(
            svc.prepare_store(&first, 1).unwrap().status,
            LeaseStatus::Miss
        );
    }
    assert_eq!(stat(&svc, "pending"), 0);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn content_addressed_pages_coalesce_with_an_inflight_writer_that_commits<T: Target>() {
    coalesce_with_inflight_writer(true);
}

fn content_addressed_pages_coalesce_with_an_inflight_writer_that_aborts<T: Target>() {
    coalesce_with_inflight_writer(false);
}

fn a_drained_copy_failure_finishes_the_lease_and_an_undrained_one_keeps_it<T: Target>() {
    let svc = T::open(config("sc-copyfail", None)).unwrap();
    let m = standard(NS, &tokens(), "prompt", 2);
    // Drained failure: the worker finishes the lease as failed.
    assert!(svc.begin(&m).unwrap());
    let lease = prepare(&svc, &m, 0);
    assert!(
        !svc.finish_store(lease.lease_id.as_deref().unwrap(), false, None)
            .unwrap()
    );
    assert_eq!(stat(&svc, "store_leases"), 0);
    assert!(!is_listed(&svc, &m));
    assert_eq!(
        stat(&svc, "l1_bytes"),
        0,
        "the failed lease's slots are freed"
    );
    // Undrained failure: the worker never finishes; the lease stays live.
    assert!(svc.begin(&m).unwrap());
    let lease = prepare(&svc, &m, 0);
    assert_eq!(lease.status, LeaseStatus::Ready);
    assert_eq!(stat(&svc, "store_leases"), 1);
    assert_eq!(svc.close().unwrap_err().kind(), ErrorKind::LeasesLive);
    assert!(!is_listed(&svc, &m));
    // Once the copy is proven drained the lease can be finished and close works.
    assert!(
        !svc.finish_store(lease.lease_id.as_deref().unwrap(), false, None)
            .unwrap()
    );
    assert_eq!(stat(&svc, "pending"), 0);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn lease_budget_never_recycles_live_copy_buffers<T: Target>() {
    let cfg = lmcache_rc_core::service::ServiceConfig {
        max_leases: 1,
        ..config("sc-budget", None)
    };
    let svc = T::open(cfg).unwrap();
    let published = standard(NS, &tokens(), "instruction", 2);
    store_all(&svc, &published);
    let m = standard(NS, &seq(5000, 40), "prompt", 2);
    assert!(svc.begin(&m).unwrap());
    let live = prepare(&svc, &m, 0);
    assert_eq!(live.status, LeaseStatus::Ready);
    fill(&svc, &m, 0, &live);

    // The live store blocks a retrieve and another rank's prepare.
    let retrieve = svc.begin_retrieve(&published, 0).unwrap();
    assert_eq!(retrieve.status, LeaseStatus::Miss);
    assert_eq!(retrieve.reason, Some(MissReason::LeaseBudget));
    let other = svc.prepare_store(&m, 1).unwrap();
    assert_eq!(other.status, LeaseStatus::Miss);
    assert_eq!(other.reason, Some(MissReason::LeaseBudget));
    assert_eq!(
        stat(&svc, "pending"),
        0,
        "the rejected generation is aborted"
    );
    assert_eq!(stat(&svc, "store_leases"), 1);
    // The live lease's buffer still holds what the worker wrote.
    let keys = rank_keys(&m, 0);
    for (g, slots) in live.slots.iter().enumerate() {
        for (i, slot) in slots.iter().enumerate() {
            let (offset, len) = slot.unwrap();
            let mut got = vec![0u8; len as usize];
            svc.pool().read_at(offset, &mut got).unwrap();
            assert!(
                got == object_bytes(&keys[g][i], len),
                "live buffer recycled"
            );
        }
    }
    assert!(
        !svc.finish_store(live.lease_id.as_deref().unwrap(), false, None)
            .unwrap()
    );
    // With the lease finished, a lookup is admitted again; the aborted one misses.
    restore(&svc, &published, 0).unwrap();
    assert_eq!(
        restore(&svc, &m, 0).unwrap_err(),
        "not_listed",
        "the aborted generation was never published"
    );
    assert!(is_listed(&svc, &published));
    assert_idle(&svc);
    svc.close().unwrap();
}

fn a_failed_commit_releases_uncommitted_reservations_and_the_generation_can_be_staged_again<
    T: Target,
>() {
    let svc = T::open(config("sc-commitfail", None)).unwrap();
    let m = standard(NS, &tokens(), "prompt", 2);
    assert!(svc.begin(&m).unwrap());
    store_one(&svc, &m, 0);
    let lease = prepare(&svc, &m, 1);
    assert!(stat(&svc, "l1_bytes") > 0);
    assert!(
        !svc.finish_store(lease.lease_id.as_deref().unwrap(), false, None)
            .unwrap()
    );
    assert!(!is_listed(&svc, &m));
    assert_eq!(stat(&svc, "store_leases"), 0);
    assert_eq!(stat(&svc, "pending"), 0);
    assert_eq!(
        stat(&svc, "l1_bytes"),
        0,
        "uncommitted and orphaned pages released"
    );
    assert_idle(&svc);
    // The same generation can be begun and stored again.
    store_all(&svc, &m);
    restore_all(&svc, &m);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn payload_capacity_miss_preserves_a_read_leased_checkpoint<T: Target>(eviction: Eviction) {
    let svc = T::open(with_eviction(config("sc-oversized", None), eviction)).unwrap();
    let pinned = standard(NS, &tokens(), "prompt", 2);
    store_all(&svc, &pinned);
    let lease = open_read(&svc, &pinned, 0);

    // Every rank of this generation needs 3 x 2 MiB: more than the 4 MiB pool.
    let groups = vec![GroupSpec::new(
        "target.attention.0",
        2 << 20,
        vec![0, 1, 2],
        Role::Attention(16),
    )];
    let oversized = build_manifest(NS, &seq(7000, 48), 4, &groups, 2, "prompt");
    assert!(svc.begin(&oversized).unwrap());
    let miss = svc.prepare_store(&oversized, 0).unwrap();
    assert_eq!(miss.status, LeaseStatus::Miss);
    assert_eq!(miss.reason, Some(MissReason::Capacity));
    assert!(!is_listed(&svc, &oversized));
    assert_eq!(stat(&svc, "pending"), 0);
    // The read-leased generation stays listed and its bytes intact.
    check_slots(&svc, &pinned, 0, &lease);
    assert!(
        is_listed(&svc, &pinned),
        "the existing checkpoint was retired"
    );
    svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
        .unwrap();
    restore_all(&svc, &pinned);
    // A replacement of the same prefix publishes normally.
    let replacement = standard(NS, &tokens(), "response", 2);
    store_all(&svc, &replacement);
    assert!(is_listed(&svc, &replacement));
    assert!(!is_listed(&svc, &pinned));
    restore_all(&svc, &replacement);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn shm_roundtrip_of_all_ranks_and_groups_keeps_read_leased_pages_until_finish<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let svc = T::open(config("sc-readlease", Some(dir.path()))).unwrap();
    let m = standard(NS, &tokens(), "prompt", 2);
    store_all(&svc, &m);
    settle(&svc);
    let leases: Vec<_> = (0..4).map(|rank| open_read(&svc, &m, rank)).collect();
    // The pages cannot be deleted while leased.
    let report = svc.clear(false, false).unwrap();
    assert_eq!(report.l1_objects, 0);
    assert_eq!(report.kept_objects, 28);
    assert_eq!(
        svc.clear(true, false).unwrap_err().kind(),
        ErrorKind::LeasesLive
    );
    for (rank, lease) in leases.iter().enumerate() {
        check_slots(&svc, &m, rank as u32, lease);
        svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
            .unwrap();
    }
    // After finish every page can be deleted from L1.
    let report = svc.clear(false, false).unwrap();
    assert_eq!(report.l1_objects, 28);
    assert_eq!(report.kept_objects, 0);
    assert_eq!(stat(&svc, "l1_objects"), 0);
    assert!(is_listed(&svc, &m), "L2 still backs every page");
    assert_idle(&svc);
    svc.close().unwrap();
}

fn nonforced_clear_preserves_read_and_write_leases(expose_slots: bool) {
    let svc = CheckpointService::open(config("sc-clearleases", None)).unwrap();
    let read = standard(NS, &tokens(), "prompt", 2);
    store_all(&svc, &read);
    let begun = svc.begin_retrieve(&read, 0).unwrap();
    let read_id = begun.lease_id.clone().unwrap();
    let exposed = expose_slots.then(|| {
        let l = poll_done(&svc, &read_id);
        check_slots(&svc, &read, 0, &l);
        l
    });
    let write = standard(NS, &seq(3000, 40), "prompt", 2);
    assert!(svc.begin(&write).unwrap());
    let wlease = prepare(&svc, &write, 0);
    fill(&svc, &write, 0, &wlease);

    let report = svc.clear(false, false).unwrap();
    assert_eq!(
        report.kept_objects, 14,
        "7 read-leased + 7 write-leased pages kept"
    );
    assert_eq!(
        report.l1_objects, 21,
        "ranks 1..3 of the read generation dropped"
    );
    // The read lease still (polls) ready with intact bytes.
    let ready = poll_done(&svc, &read_id);
    check_slots(&svc, &read, 0, &ready);
    if let Some(l) = exposed {
        assert_eq!(l.slots, ready.slots);
    }
    svc.finish_retrieve(&read_id, None).unwrap();
    // Finishing the write lease commits its pages; the generation needs 3 more ranks.
    assert!(
        !svc.finish_store(wlease.lease_id.as_deref().unwrap(), true, None)
            .unwrap()
    );
    for rank in 1..4 {
        store_one(&svc, &write, rank);
    }
    assert!(is_listed(&svc, &write));
    restore_all(&svc, &write);
    // Once no lease remains a second clear removes everything.
    svc.clear(false, false).unwrap();
    assert_eq!(stat(&svc, "l1_objects"), 0);
    assert_eq!(stat(&svc, "l1_bytes"), 0);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn nonforced_clear_preserves_a_pending_read_lease_and_a_write_lease<T: Target>() {
    nonforced_clear_preserves_read_and_write_leases(false);
}

fn nonforced_clear_preserves_an_exposed_read_lease_and_a_write_lease<T: Target>() {
    nonforced_clear_preserves_read_and_write_leases(true);
}

fn a_failed_rank_prevents_publication_after_other_ranks_complete<T: Target>() {
    let svc = T::open(config("sc-failedrank", None)).unwrap();
    let m = standard(NS, &tokens(), "prompt", 2);
    assert!(svc.begin(&m).unwrap());
    let leases: Vec<_> = (0..4).map(|rank| prepare(&svc, &m, rank)).collect();
    for (rank, lease) in leases.iter().enumerate() {
        fill(&svc, &m, rank as u32, lease);
        let ok = rank != 1;
        let published = svc
            .finish_store(lease.lease_id.as_deref().unwrap(), ok, None)
            .unwrap();
        assert!(!published, "rank {rank} must not publish");
    }
    assert!(!is_listed(&svc, &m));
    assert_eq!(stat(&svc, "pending"), 0);
    let again = svc.prepare_store(&m, 1).unwrap();
    assert_eq!(again.status, LeaseStatus::Miss);
    assert_eq!(
        stat(&svc, "l1_objects"),
        0,
        "no page of the failed generation remains"
    );
    assert_idle(&svc);
    svc.close().unwrap();
}

fn a_rank_cannot_replace_the_staged_payload_layout<T: Target>() {
    let svc = T::open(config("sc-layout", None)).unwrap();
    let m = standard(NS, &tokens(), "prompt", 2);
    assert!(svc.begin(&m).unwrap());
    store_one(&svc, &m, 0);
    let mut groups = standard_groups("prompt");
    groups[1].page_bytes = 512;
    let changed_payload = build_manifest(NS, &tokens(), 4, &groups, 2, "prompt");
    // The same generation id with another layout.
    let changed = lmcache_rc_core::Manifest::new(
        m.generation().to_string(),
        m.prefix().clone(),
        4,
        changed_payload.payload().to_vec(),
    )
    .unwrap();
    let err = svc.prepare_store(&changed, 1).unwrap_err();
    assert!(err.to_string().contains("changed"), "{err}");
    assert_eq!(stat(&svc, "store_leases"), 0);
    // The staged generation is unaffected.
    for rank in 1..4 {
        store_one(&svc, &m, rank);
    }
    restore_all(&svc, &m);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn a_missing_page_invalidates_the_bundle_and_releases_other_read_locks<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let svc = T::open(config("sc-missing", Some(&l2))).unwrap();
    let m = standard(NS, &tokens(), "prompt", 2);
    let other = standard(NS, &seq(9000, 40), "prompt", 2);
    store_all(&svc, &m);
    store_all(&svc, &other);
    settle(&svc);
    svc.clear(false, false).unwrap();
    assert_eq!(stat(&svc, "l1_objects"), 0);
    // Rank 2 loses its first attention page.
    std::fs::remove_file(l2_file(&l2, &rank_keys(&m, 2)[0][0])).unwrap();
    let held = open_read(&svc, &m, 1);
    assert_eq!(restore(&svc, &m, 2).unwrap_err(), "lost_object");
    assert!(!is_listed(&svc, &m), "the generation is delisted");
    check_slots(&svc, &m, 1, &held);
    svc.finish_retrieve(held.lease_id.as_deref().unwrap(), None)
        .unwrap();
    assert_eq!(restore(&svc, &m, 0).unwrap_err(), "not_listed");
    // Nothing of the retired generation remains in either tier.
    settle(&svc);
    let (files, bytes) = l2_files(&l2);
    assert_eq!((files, bytes), expected_l2([&other]));
    assert_eq!(stat(&svc, "objects"), all_keys(&other).len() as u64);
    restore_all(&svc, &other);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn cancelling_a_pending_lookup_drains_its_locks_without_invalidating_the_generation<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let svc = T::open(config("sc-cancel", Some(dir.path()))).unwrap();
    let m = standard(NS, &tokens(), "prompt", 2);
    store_all(&svc, &m);
    settle(&svc);
    for resident in [true, false] {
        if !resident {
            svc.clear(false, false).unwrap();
        }
        let begun = svc.begin_retrieve(&m, 3).unwrap();
        let id = begun.lease_id.unwrap();
        if resident {
            // Every page in L1: exposed at once, so it cannot be cancelled
            // (its copy may read the slots) and is finished instead.
            assert_eq!(begun.status, LeaseStatus::Ready);
            let err = svc.cancel_retrieve(&id, None).unwrap_err();
            assert!(err.to_string().contains("finish"), "{err}");
            svc.finish_retrieve(&id, None).unwrap();
        } else {
            assert_eq!(begun.status, LeaseStatus::Pending);
            svc.cancel_retrieve(&id, None).unwrap();
        }
        assert_eq!(stat(&svc, "retrieve_leases"), 0);
        // The lease is gone: a late poll is refused, never a hit.
        assert_eq!(
            svc.poll_retrieve(&id, None).unwrap_err().kind(),
            ErrorKind::NotFound
        );
        svc.cancel_retrieve(&id, None).unwrap();
        assert!(svc.wait_l2_idle(HANG_GUARD));
        assert!(is_listed(&svc, &m), "cancel never invalidates");
        assert_idle(&svc);
        // Every page can be deleted from L1.
        svc.clear(false, false).unwrap();
        assert_eq!(stat(&svc, "l1_objects"), 0);
    }
    restore_all(&svc, &m);
    assert_eq!(misses(&svc, "lost_object"), 0);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn generation_namespace_and_rank_have_disjoint_payload_keys<T: Target>() {
    for schema in [1u8, 2] {
        let m = standard(NS, &tokens(), "prompt", schema);
        let other_generation = standard(NS, &seq(2000, 48), "prompt", schema);
        let other_ns = standard("recurrent-sha256-v1:other", &tokens(), "prompt", schema);
        let flat = |m: &lmcache_rc_core::Manifest, rank| -> HashSet<_> {
            rank_keys(m, rank).into_iter().flatten().collect()
        };
        let sets = [
            flat(&m, 0),
            flat(&m, 1),
            flat(&other_generation, 0),
            flat(&other_ns, 0),
        ];
        for (i, a) in sets.iter().enumerate() {
            assert_eq!(a.len(), 7, "schema {schema}: 7 distinct pages per rank");
            for b in &sets[i + 1..] {
                assert!(a.is_disjoint(b), "schema {schema}: key sets {i} overlap");
            }
        }
    }
    // Schema 1 keys are scoped to the generation: the same tokens with
    // another payload share nothing; schema 2 shares identical content.
    let a1 = standard(NS, &tokens(), "prompt", 1);
    let b1 = standard(NS, &tokens(), "response", 1);
    assert!(all_keys(&a1).is_disjoint(&all_keys(&b1)));
    let a2 = standard(NS, &tokens(), "prompt", 2);
    let b2 = standard(NS, &tokens(), "response", 2);
    assert_eq!(all_keys(&a2).intersection(&all_keys(&b2)).count(), 4 * 6);
    // Group name and group index take part too.
    let mut renamed = standard_groups("prompt");
    renamed[0].name = "target.attention.1".into();
    let r = build_manifest(NS, &tokens(), 4, &renamed, 2, "prompt");
    assert!(
        rank_keys(&r, 0)[0]
            .iter()
            .all(|k| !rank_keys(&a2, 0)[0].contains(k))
    );
}

fn checkpoint_pages_are_individually_evictable_except_leased_ones<T: Target>(eviction: Eviction) {
    let dir = tempfile::tempdir().unwrap();
    let svc = T::open(with_eviction(config("sc-lru", Some(dir.path())), eviction)).unwrap();
    let m = standard(NS, &tokens(), "prompt", 2);
    store_all(&svc, &m);
    settle(&svc);
    let lease = open_read(&svc, &m, 0);
    // A store that needs almost the whole pool evicts every durable page that
    // no lease holds (each one on its own), and none of the leased ones.
    let free_pages = (4 << 20) / 4096 - 7;
    let groups = vec![GroupSpec::new(
        "big",
        4096,
        (0..free_pages).collect(),
        Role::Endpoint("big".into()),
    )];
    let big = build_manifest(NS, &seq(4000, 20), 1, &groups, 2, "prompt");
    store_all(&svc, &big);
    assert_eq!(stat(&svc, "l1_objects"), free_pages + 7);
    check_slots(&svc, &m, 0, &lease);
    svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
        .unwrap();
    assert!(
        is_listed(&svc, &m),
        "durable pages leave L1 without retiring"
    );
    settle(&svc);
    restore_all(&svc, &m);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn sustained_stores_reclaim_capacity_without_losing_a_read<T: Target>(eviction: Eviction) {
    let svc = T::open(with_eviction(config("sc-sustained", None), eviction)).unwrap();
    let groups = vec![GroupSpec::new(
        "target.attention.0",
        128 << 10,
        vec![0, 1, 2, 3],
        Role::Attention(16),
    )];
    let gens: Vec<_> = (0..16u32)
        .map(|i| build_manifest(NS, &seq(100_000 * (i + 1), 64), 1, &groups, 2, "prompt"))
        .collect();
    store_all(&svc, &gens[0]);
    let lease = open_read(&svc, &gens[0], 0);
    for m in &gens[1..] {
        store_all(&svc, m);
        assert!(is_listed(&svc, m));
        assert!(stat(&svc, "l1_bytes") <= 4 << 20);
    }
    assert_eq!(misses(&svc, "capacity"), 0);
    assert_eq!(stat(&svc, "admission_timeouts"), 0);
    check_slots(&svc, &gens[0], 0, &lease);
    svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
        .unwrap();
    restore_all(&svc, &gens[15]);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn filesystem_restore_after_directory_and_storage_restart<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let m = standard(NS, &tokens(), "prompt", 2);
    {
        let svc = T::open(durable_config("sc-restart", dir.path())).unwrap();
        assert!(svc.capabilities().unwrap().durable_index);
        store_all(&svc, &m);
        settle(&svc);
        assert_idle(&svc);
        svc.close().unwrap();
    }
    let svc = T::open(durable_config("sc-restart2", dir.path())).unwrap();
    assert_eq!(
        svc.find(std::slice::from_ref(m.prefix())).unwrap().as_ref(),
        Some(&m)
    );
    assert_eq!(stat(&svc, "l1_objects"), 0, "L1 starts empty");
    assert_eq!(stat(&svc, "generations"), 1);
    restore_all(&svc, &m);
    assert!(stat(&svc, "l2_loads") >= 28);
    assert!(
        !svc.begin(&m).unwrap(),
        "an exact replay after restart is suppressed"
    );
    assert_idle(&svc);
    svc.close().unwrap();
}
