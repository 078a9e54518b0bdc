//! Capacity: store admission waits within its bound for L1 space and then
//! misses with reason "capacity", never evicting a leased page (I4); a
//! restore from L2 that finds no RAM misses without delisting the intact
//! generation. Every scenario runs under both eviction policies (`lru`,
//! `cost`): the policy orders victims, never makes a held page one.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use lmcache_rc_core::Manifest;
use lmcache_rc_core::cost::Eviction;
use lmcache_rc_core::protocol::{Checkpoints, MissReason};
use lmcache_rc_core::service::{Lease, LeaseStatus, ServiceConfig};
use lmcache_rc_core::store::l2::testing::{FaultyFs, Op};

use crate::service_common::*;

every_policy!(
    store_admission_waits_within_its_bound_then_misses_for_capacity_without_evicting_leased_pages,
    a_restore_that_finds_no_ram_misses_and_keeps_the_intact_generation_listed,
    a_full_l2_evicts_the_least_recently_used_generation_and_never_exceeds_capacity,
    store_admission_succeeds_once_a_lease_releases_space_during_its_wait,
    a_generation_larger_than_l2_publishes_from_l1_and_is_never_durable,
    making_room_for_a_restore_never_retires_the_generation_it_restores,
    a_restore_waiting_for_room_whose_generation_is_retired_misses_not_listed,
    a_restore_that_waited_for_a_page_being_written_leaves_no_hold_on_it,
    a_store_that_cannot_fit_never_retires_the_generation_whose_pages_it_reuses,
    a_restore_of_a_page_larger_than_the_pool_evicts_nothing,
    a_store_waits_for_a_page_loading_from_l2_and_writes_it_when_the_load_proves_it_lost,
);

/// A 4-rank generation of one 1 MiB page per rank: the whole 4 MiB pool.
fn pool_filler(base: u32) -> Manifest {
    let groups = vec![GroupSpec::new(
        "engine-kv-group:0",
        1 << 20,
        vec![0],
        Role::Endpoint("state".into()),
    )];
    build_manifest(NS, &seq(base, 16), 4, &groups, 2, "prompt")
}

/// A generation of namespace `ns` whose pages are only on disk (stored,
/// written to L2, dropped from L1), behind a pool full of `pool_filler`
/// pages leased by all four ranks: a restore of it must wait for room.
/// Returns the generation and the filler's leases.
fn on_disk_behind_a_full_pool(svc: &impl AsTarget, ns: &str, base: u32) -> (Manifest, Vec<Lease>) {
    let m = mib_pages(ns, &seq(base, 16));
    store_all(svc, &m);
    settle(svc);
    svc.target().clear(false, false).unwrap();
    let filler = pool_filler(base + 1_000);
    store_all(svc, &filler);
    let leases = (0..4).map(|rank| open_read(svc, &filler, rank)).collect();
    (m, leases)
}

fn small(base: u32) -> Manifest {
    let groups = vec![GroupSpec::new(
        "engine-kv-group:0",
        4096,
        vec![0, 1],
        Role::Attention(16),
    )];
    build_manifest(NS, &seq(base, 32), 1, &groups, 2, "prompt")
}

fn store_admission_waits_within_its_bound_then_misses_for_capacity_without_evicting_leased_pages<
    T: Target,
>(
    eviction: Eviction,
) {
    let svc = T::open(with_eviction(config("cap-full", None), eviction)).unwrap();
    let filler = pool_filler(40_000);
    store_all(&svc, &filler);
    let leases: Vec<_> = (0..4).map(|rank| open_read(&svc, &filler, rank)).collect();
    assert_eq!(
        stat(&svc, "l1_bytes"),
        4 << 20,
        "the pool is full of leased pages"
    );

    let m = small(41_000);
    assert!(svc.begin(&m).unwrap());
    let miss = svc.prepare_store(&m, 0).unwrap();
    assert_eq!(miss.status, LeaseStatus::Miss);
    assert_eq!(miss.reason, Some(MissReason::Capacity));
    assert_eq!(misses(&svc, "capacity"), 1);
    assert_eq!(stat(&svc, "admission_waits"), 1);
    assert_eq!(stat(&svc, "admission_timeouts"), 1);
    assert_eq!(stat(&svc, "pending"), 0, "the generation is aborted");
    assert_eq!(stat(&svc, "store_leases"), 0);
    // No leased page was evicted or overwritten.
    for (rank, lease) in leases.iter().enumerate() {
        check_slots(&svc, &filler, rank as u32, lease);
    }
    assert!(is_listed(&svc, &filler));
    for lease in &leases {
        svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
            .unwrap();
    }
    assert_idle(&svc);
    // With the leases gone the same store fits (evicting, and so retiring,
    // the filler: its only copy was L1).
    store_all(&svc, &m);
    restore_all(&svc, &m);
    assert!(!is_listed(&svc, &filler));
    assert_idle(&svc);
    svc.close().unwrap();
}

fn store_admission_succeeds_once_a_lease_releases_space_during_its_wait<T: Target>(
    eviction: Eviction,
) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ServiceConfig {
        store_admission_timeout: HANG_GUARD,
        ..config("cap-wait", Some(dir.path()))
    };
    let svc = T::open(with_eviction(cfg, eviction)).unwrap();
    let filler = pool_filler(42_000);
    store_all(&svc, &filler);
    settle(&svc);
    let leases: Vec<_> = (0..4).map(|rank| open_read(&svc, &filler, rank)).collect();
    let m = small(43_000);
    assert!(svc.begin(&m).unwrap());
    std::thread::scope(|s| {
        s.spawn(|| {
            // Release the leases once the store is waiting for space.
            while stat(&svc, "admission_waits") == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            for lease in &leases {
                svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
                    .unwrap();
            }
        });
        let (published, _) = store_one(&svc, &m, 0);
        assert!(published);
    });
    assert_eq!(stat(&svc, "admission_success_after_eviction"), 1);
    assert_eq!(misses(&svc, "capacity"), 0);
    assert!(
        is_listed(&svc, &filler),
        "durable pages leave L1 without retiring"
    );
    restore_all(&svc, &m);
    settle(&svc);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn a_restore_that_finds_no_ram_misses_and_keeps_the_intact_generation_listed<T: Target>(
    eviction: Eviction,
) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ServiceConfig {
        retrieve_timeout: Duration::from_millis(300),
        ..config("cap-restore", Some(dir.path()))
    };
    let svc = T::open(with_eviction(cfg, eviction)).unwrap();
    let on_disk = small(44_000);
    store_all(&svc, &on_disk);
    settle(&svc);
    svc.clear(false, false).unwrap();
    let filler = pool_filler(45_000);
    store_all(&svc, &filler);
    let leases: Vec<_> = (0..4).map(|rank| open_read(&svc, &filler, rank)).collect();

    assert_eq!(restore(&svc, &on_disk, 0).unwrap_err(), "retrieve_timeout");
    assert!(is_listed(&svc, &on_disk), "no RAM is not proof of loss");
    for (rank, lease) in leases.iter().enumerate() {
        check_slots(&svc, &filler, rank as u32, lease);
        svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
            .unwrap();
    }
    settle(&svc);
    restore_all(&svc, &on_disk);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn a_full_l2_evicts_the_least_recently_used_generation_and_never_exceeds_capacity<T: Target>(
    eviction: Eviction,
) {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let a = standard(NS, &seq(46_000, 48), "prompt", 2);
    let b = standard(NS, &seq(47_000, 48), "prompt", 2);
    let (_, one_generation) = charged_l2([&a], dir.path());
    let capacity = one_generation + 700;
    let cfg = ServiceConfig {
        l2_bytes: Some(capacity),
        checkpoint_index_path: Some(dir.path().join("index.sqlite")),
        ..config("cap-l2", Some(&l2))
    };
    let svc = T::open(with_eviction(cfg.clone(), eviction)).unwrap();
    store_all(&svc, &a);
    settle(&svc);
    assert_eq!(l2_files(&l2), expected_l2([&a]));
    store_all(&svc, &b);
    settle(&svc);
    // Writing b needed a's disk space: a (older, idle) was evicted with its
    // generation, so no listed generation points at a missing file.
    assert!(!is_listed(&svc, &a) && is_listed(&svc, &b));
    assert!(stat(&svc, "l2_bytes") <= capacity);
    assert!(stat(&svc, "l2_evictions") > 0);
    assert_eq!(stat(&svc, "l2_skipped_full"), 0);
    assert_eq!(l2_files(&l2), expected_l2([&b]));
    // b is durable: after dropping RAM it restores from disk.
    svc.clear(false, false).unwrap();
    assert!(is_listed(&svc, &b));
    restore_all(&svc, &b);
    assert_idle(&svc);
    svc.close().unwrap();
    drop(svc);
    let svc = T::open(with_eviction(cfg, eviction)).unwrap();
    restore_all(&svc, &b);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn a_generation_larger_than_l2_publishes_from_l1_and_is_never_durable<T: Target>(
    eviction: Eviction,
) {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let a = standard(NS, &seq(48_000, 48), "prompt", 2);
    let (_, one_generation) = charged_l2([&a], dir.path());
    let cfg = ServiceConfig {
        l2_bytes: Some(one_generation / 2),
        ..config("cap-l2-small", Some(&l2))
    };
    let svc = T::open(with_eviction(cfg, eviction)).unwrap();
    store_all(&svc, &a);
    settle(&svc);
    assert!(is_listed(&svc, &a), "published from RAM");
    assert!(stat(&svc, "l2_bytes") <= one_generation / 2);
    assert!(stat(&svc, "l2_skipped_full") > 0);
    restore_all(&svc, &a);
    // Dropping RAM retires it: its only complete copy was in RAM.
    let report = svc.clear(false, false).unwrap();
    assert_eq!(report.retired_generations, 1);
    assert!(!is_listed(&svc, &a));
    assert_idle(&svc);
    svc.close().unwrap();
}

/// One rank of 1 MiB attention pages, one page per 16 tokens (a prefix of
/// `tokens` shares its full pages).
fn mib_pages(ns: &str, tokens: &[u32]) -> Manifest {
    let pages = (tokens.len() as u64).div_ceil(16);
    let groups = vec![GroupSpec::new(
        "engine-kv-group:0",
        1 << 20,
        (0..pages).collect(),
        Role::Attention(16),
    )];
    build_manifest(ns, tokens, 1, &groups, 2, "prompt")
}

/// A service under `eviction` whose L2 at `l2` goes through a [`FaultyFs`]
/// (returned, to arm faults and holds).
fn open_faulty<T: Target>(tag: &str, l2: &std::path::Path, eviction: Eviction) -> (T, FaultyFs) {
    let faulty = FaultyFs::new();
    let svc = T::open_with_fs(
        with_eviction(config(tag, Some(l2)), eviction),
        Arc::new(faulty.clone()),
        &mut |_| {},
    )
    .unwrap();
    (svc, faulty)
}

/// The soak's "durable L2 page found absent" (issue 23): a restore whose
/// first page is only on disk needs a slot; the pool is full, and the oldest
/// evictable copy was the restored generation's own L1-only page, not yet
/// held by the lease. Evicting it retired that generation, which reclaimed
/// the disk page and queued its file's delete — and the load was queued
/// anyway, for an object that was gone, into a slot nothing owned: the
/// delete ran first, the load found the file absent (`l2_corrupt_or_missing`)
/// and the restore missed with `lost_object`. The lease now holds its
/// resident pages before it makes room for the others.
fn making_room_for_a_restore_never_retires_the_generation_it_restores<T: Target>(
    eviction: Eviction,
) {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let (svc, faulty) = open_faulty::<T>("room-own", &l2, eviction);
    let ns = "recurrent-sha256-v1:room-own";
    let tokens = seq(50_000, 32);
    let first = mib_pages(ns, &tokens[..16]);
    let m = mib_pages(ns, &tokens);
    let shared = rank_keys(&m, 0)[0][0];
    assert_eq!(rank_keys(&first, 0)[0][0], shared);
    store_all(&svc, &first);
    settle(&svc);
    svc.clear(false, false).unwrap();
    // m reuses first's page (on disk only) and writes its second page, whose
    // L2 write fails (an fsync: the tier is poisoned), so it stays L1-only.
    assert!(svc.begin(&m).unwrap());
    let lease = prepare(&svc, &m, 0);
    assert_eq!(lease.status, LeaseStatus::Ready);
    // first goes; its page stays, pinned by m's staging.
    assert_eq!(svc.invalidate_namespace(ns).unwrap(), 1);
    faulty.fail_next(Op::SyncFile, 1, io::ErrorKind::Other);
    fill(&svc, &m, 0, &lease);
    assert!(
        svc.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
            .unwrap()
    );
    settle(&svc);
    assert_eq!(
        stat(&svc, "l2_objects"),
        1,
        "only the shared page is durable"
    );
    // A newer L1-only generation fills the rest of the pool.
    let filler = mib_pages("recurrent-sha256-v1:room-filler", &seq(51_000, 48));
    store_all(&svc, &filler);
    settle(&svc);
    assert_eq!(stat(&svc, "l1_bytes"), 4 << 20, "the pool is full");

    // Room for the disk page comes from the filler (retired with its only
    // copies), never from m itself.
    restore_all(&svc, &m);
    assert!(is_listed(&svc, &m));
    assert!(!is_listed(&svc, &filler));
    settle(&svc);
    assert_eq!(stat(&svc, "l2_corrupt_or_missing"), 0);
    assert_eq!(misses(&svc, "lost_object"), 0);
    assert!(l2_file(&l2, &shared).exists(), "its file was not deleted");
    assert_idle(&svc);
    restore_all(&svc, &m);
    assert_idle(&svc);
    svc.close().unwrap();
}

/// A restore waiting for L1 room holds no reader on its disk-only pages, so
/// they can go meanwhile with their generation (here an invalidation; in the
/// soak an L2 eviction). The next poll finds the page gone: the generation
/// is no longer listed, so that is a clean `not_listed` miss — what
/// `begin_retrieve` answers now — not a `lost_object` (nothing was lost).
fn a_restore_waiting_for_room_whose_generation_is_retired_misses_not_listed<T: Target>(
    eviction: Eviction,
) {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let svc = T::open(with_eviction(config("room-retired", Some(&l2)), eviction)).unwrap();
    let ns = "recurrent-sha256-v1:room-retired";
    let (m, leases) = on_disk_behind_a_full_pool(&svc, ns, 52_000);
    assert_eq!(
        stat(&svc, "l1_bytes"),
        4 << 20,
        "the pool is full of leased pages"
    );

    let begun = svc.begin_retrieve(&m, 0).unwrap();
    assert_eq!(begun.status, LeaseStatus::Pending, "{begun:?}");
    assert!(stat(&svc, "retrieve_capacity_waits") >= 1);
    assert_eq!(svc.invalidate_namespace(ns).unwrap(), 1);
    let answer = poll_done(&svc, begun.lease_id.as_deref().unwrap());
    assert_eq!(answer.status, LeaseStatus::Miss, "{answer:?}");
    assert_eq!(answer.reason, Some(MissReason::NotListed), "{answer:?}");
    assert_eq!(misses(&svc, "lost_object"), 0);
    assert_eq!(stat(&svc, "retrieve_leases"), 4, "the lease is gone");

    for lease in &leases {
        svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
            .unwrap();
    }
    assert_idle(&svc);
    svc.close().unwrap();
}

/// A retrieve lease waits for a page another lease is writing (`Writing`:
/// pass 1 of `advance_retrieve`). Only an L2 load's end takes the leases
/// waiting on an object (`end_load`); a store's finish or discard never
/// does. So the lease's number stayed in the object's `waiters` after the
/// write committed and the lease was finished: the object was never idle
/// again — its L1 copy never evictable, and once nothing referenced it,
/// never reclaimed (slot, L2 file and record leaked until restart; even a
/// forced clear of every tier kept it).
///
/// The page gets into `Writing` under a waiting lease like this: a restore
/// waits for room (the pool is full of leased pages), its generation is
/// invalidated (its disk page goes), and the same checkpoint is stored again
/// (with a shared tier, simply: an imported generation's page known only
/// from the shared tier, stored locally by another generation).
fn a_restore_that_waited_for_a_page_being_written_leaves_no_hold_on_it<T: Target>(
    eviction: Eviction,
) {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let svc = T::open(with_eviction(config("wait-written", Some(&l2)), eviction)).unwrap();
    let ns = "recurrent-sha256-v1:wait-written";
    let (m, leases) = on_disk_behind_a_full_pool(&svc, ns, 54_000);
    let begun = svc.begin_retrieve(&m, 0).unwrap();
    assert_eq!(begun.status, LeaseStatus::Pending, "{begun:?}");
    let id = begun.lease_id.clone().unwrap();
    // m goes (its page with it); the same checkpoint is stored again.
    assert_eq!(svc.invalidate_namespace(ns).unwrap(), 1);
    settle(&svc);
    for lease in &leases {
        svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
            .unwrap();
    }
    assert!(svc.begin(&m).unwrap());
    let store = prepare(&svc, &m, 0);
    assert_eq!(store.status, LeaseStatus::Ready, "{store:?}");
    // The waiting lease now finds its page being written: it waits.
    let waiting = svc.poll_retrieve(&id, Some(0)).unwrap();
    assert_eq!(waiting.status, LeaseStatus::Pending, "{waiting:?}");
    fill(&svc, &m, 0, &store);
    assert!(
        svc.finish_store(store.lease_id.as_deref().unwrap(), true, None)
            .unwrap()
    );
    let ready = svc.poll_retrieve(&id, Some(0)).unwrap();
    assert_eq!(ready.status, LeaseStatus::Ready, "{ready:?}");
    check_slots(&svc, &m, 0, &ready);
    svc.finish_retrieve(&id, None).unwrap();
    settle(&svc);
    assert_idle(&svc);

    // Everything goes: nothing may keep the page.
    assert_eq!(svc.invalidate_namespace(ns).unwrap(), 1);
    settle(&svc);
    assert_eq!(
        svc.unreferenced_objects(),
        0,
        "the page nothing references was reclaimed"
    );
    let report = svc.clear(true, true).unwrap();
    assert_eq!(report.kept_objects, 0, "{report:?}");
    assert_eq!(stat(&svc, "objects"), 0);
    assert_eq!(stat(&svc, "l1_bytes"), 0);
    assert_eq!(l2_files(&l2), (0, 0));
    assert_idle(&svc);
    svc.close().unwrap();
}

/// One rank of two attention groups of 1 MiB pages, one page per 16 tokens
/// each (a prefix of `tokens` shares its full pages in both groups).
fn two_group_mib_pages(ns: &str, tokens: &[u32]) -> Manifest {
    let pages = (tokens.len() as u64).div_ceil(16);
    let groups: Vec<GroupSpec> = (0..2)
        .map(|g| {
            GroupSpec::new(
                &format!("engine-kv-group:{g}"),
                1 << 20,
                (0..pages).collect(),
                Role::Attention(16),
            )
        })
        .collect();
    build_manifest(ns, tokens, 1, &groups, 2, "prompt")
}

/// A store that reuses an earlier turn's L1-only pages and needs room for
/// its new ones, when the only evictable copies are those reused pages: it
/// cannot fit (room made from a page it reuses must be given back to that
/// page), so it must miss `capacity` without evicting anything — "an
/// oversized store must not retire generations for nothing". The capacity
/// check counts the reused pages as evictable, so the attempt goes on; the
/// first group's new page takes the second group's reused page (not yet
/// pinned) from L1, which retires the earlier turn, and the second group
/// then finds no room for that very page: the store misses anyway, and the
/// earlier turn is gone for nothing.
fn a_store_that_cannot_fit_never_retires_the_generation_whose_pages_it_reuses<T: Target>(
    eviction: Eviction,
) {
    let svc = T::open(with_eviction(config("reuse-room", None), eviction)).unwrap();
    let ns = "recurrent-sha256-v1:reuse-room";
    let tokens = seq(56_000, 32);
    let turn1 = two_group_mib_pages(ns, &tokens[..16]);
    let turn2 = two_group_mib_pages(ns, &tokens);
    store_all(&svc, &turn1);
    // Two read-leased 1 MiB pages fill the rest of the pool.
    let groups = vec![GroupSpec::new(
        "engine-kv-group:0",
        1 << 20,
        vec![0],
        Role::Endpoint("state".into()),
    )];
    let held = build_manifest(NS, &seq(57_000, 16), 2, &groups, 2, "prompt");
    store_all(&svc, &held);
    let leases: Vec<_> = (0..2).map(|rank| open_read(&svc, &held, rank)).collect();
    assert_eq!(stat(&svc, "l1_bytes"), 4 << 20, "the pool is full");

    assert!(svc.begin(&turn2).unwrap());
    let miss = svc.prepare_store(&turn2, 0).unwrap();
    assert_eq!(miss.status, LeaseStatus::Miss, "{miss:?}");
    assert_eq!(miss.reason, Some(MissReason::Capacity), "{miss:?}");
    assert!(
        is_listed(&svc, &turn1),
        "the turn whose pages the store reuses was retired for a store that did not fit"
    );
    assert_eq!(stat(&svc, "evictions"), 0);
    restore_all(&svc, &turn1);
    for lease in &leases {
        svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
            .unwrap();
    }
    assert_idle(&svc);
    svc.close().unwrap();
}

/// A listed generation can name a page larger than the whole pool: its
/// pages were stored under a larger `l1_bytes` (here: before a restart with
/// a smaller pool; likewise one imported from a host with a larger pool).
/// No eviction can ever make room for it, so a restore of it must evict
/// nothing and miss `capacity` at once (it used to ask for `u64::MAX` bytes:
/// every idle L1 copy was evicted, an L1-only one retiring its generation,
/// at every poll, for a restore that then waited out its `retrieve_timeout`).
/// The generation stays listed: nothing of it is lost.
fn a_restore_of_a_page_larger_than_the_pool_evicts_nothing<T: Target>(eviction: Eviction) {
    let dir = tempfile::tempdir().unwrap();
    let groups = vec![GroupSpec::new(
        "engine-kv-group:0",
        6 << 20,
        vec![0],
        Role::Endpoint("state".into()),
    )];
    let big = build_manifest(NS, &seq(58_000, 16), 1, &groups, 2, "prompt");
    {
        let cfg = ServiceConfig {
            l1_bytes: 8 << 20,
            ..durable_config("page-over-pool", dir.path())
        };
        let svc = T::open(with_eviction(cfg, eviction)).unwrap();
        store_all(&svc, &big);
        settle(&svc);
        svc.close().unwrap();
    }
    let svc = T::open(with_eviction(
        durable_config("page-over-pool", dir.path()),
        eviction,
    ))
    .unwrap();
    assert!(is_listed(&svc, &big));
    let small = mib_pages("recurrent-sha256-v1:page-over-pool", &seq(59_000, 16));
    store_all(&svc, &small);
    settle(&svc);
    assert_eq!(stat(&svc, "l1_objects"), 1);

    let begun = svc.begin_retrieve(&big, 0).unwrap();
    assert_eq!(
        (begun.status, begun.reason),
        (LeaseStatus::Miss, Some(MissReason::Capacity)),
        "a miss at once, not after the retrieve timeout: {begun:?}"
    );
    assert_eq!(stat(&svc, "l1_evictions"), 0, "nothing can make room");
    assert_eq!(stat(&svc, "l1_objects"), 1);
    assert!(is_listed(&svc, &big), "not lost: a larger pool serves it");
    restore_all(&svc, &small);
    assert_idle(&svc);
    svc.close().unwrap();
}

/// A store that needs a page while a restore loads it from L2 waits for the
/// load (busy) instead of reusing it: the load may prove the file lost (a
/// corrupt copy), and a store that had reused the page would publish a
/// generation naming a page nothing holds, listed (and announced by the
/// change feed) until a restore misses `lost_object`. Once the load failed,
/// the retried store writes the page itself and its generation restores.
fn a_store_waits_for_a_page_loading_from_l2_and_writes_it_when_the_load_proves_it_lost<
    T: Target,
>(
    eviction: Eviction,
) {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let (svc, faulty) = open_faulty::<T>("loading-reuse", &l2, eviction);
    let ns = "recurrent-sha256-v1:loading-reuse";
    let tokens = seq(59_000, 32);
    let turn1 = two_group_mib_pages(ns, &tokens[..16]);
    let turn2 = two_group_mib_pages(ns, &tokens);
    store_all(&svc, &turn1);
    settle(&svc);
    svc.clear(false, false).unwrap();
    // The restore's loads stop at their open, so its pages stay `Loading`;
    // the first read of each file then finds a flipped byte.
    let gate = faulty.hold(Op::OpenRead);
    faulty.flip_byte_on_read(64 + 10, 2);
    let read = svc.begin_retrieve(&turn1, 0).unwrap();
    assert_eq!(read.status, LeaseStatus::Pending, "{read:?}");
    assert!(
        gate.wait_for_held(1, Duration::from_secs(10)),
        "no load started"
    );

    assert!(svc.begin(&turn2).unwrap());
    let busy = svc.prepare_store(&turn2, 0).unwrap();
    assert_eq!(
        busy.status,
        LeaseStatus::Busy,
        "a page loading from L2 was reused: {busy:?}"
    );
    gate.release();
    let id = read.lease_id.as_deref().unwrap();
    let missed = poll_done(&svc, id);
    assert_eq!(missed.reason, Some(MissReason::LostObject), "{missed:?}");
    assert!(!is_listed(&svc, &turn1), "the lost copy retired its turn");

    // The retried store writes the pages the load proved lost.
    let lease = prepare(&svc, &turn2, 0);
    assert_eq!(lease.status, LeaseStatus::Ready, "{lease:?}");
    assert!(
        lease.slots.iter().flatten().all(Option::is_some),
        "every page of the shorter turn is written again: {lease:?}"
    );
    fill(&svc, &turn2, 0, &lease);
    svc.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
        .unwrap();
    assert!(is_listed(&svc, &turn2));
    restore_all(&svc, &turn2);
    settle(&svc);
    assert_idle(&svc);
    svc.close().unwrap();
}

/// A store's L2 writes that find the tier full while another round's
/// eviction is still deleting the evicted files (their bytes still charged)
/// wait for those deletes and are written once they are done, instead of
/// being skipped (`l2_skipped_full`) and leaving the generation without a
/// disk copy. Under load the two rounds race (one thread evicts and deletes,
/// another flushes the writes); here the deletes are held at the file
/// system so the other round certainly comes in between. In process only:
/// the second round is another caller's call while the first is blocked.
#[test]
fn l2_writes_wait_for_deletes_in_flight_instead_of_being_skipped() {
    for eviction in [Eviction::Lru, Eviction::Cost] {
        let dir = tempfile::tempdir().unwrap();
        let l2 = dir.path().join("l2");
        let a = standard(NS, &seq(46_500, 48), "prompt", 2);
        let b = standard(NS, &seq(47_500, 48), "prompt", 2);
        let c = standard(NS, &seq(48_500, 16), "prompt", 1);
        let (_, one_generation) = charged_l2([&a], dir.path());
        let faulty = FaultyFs::new();
        let cfg = ServiceConfig {
            l2_bytes: Some(one_generation + 700),
            ..config("cap-l2-wait", Some(&l2))
        };
        let svc = lmcache_rc_core::service::CheckpointService::open_with_fs(
            with_eviction(cfg, eviction),
            Arc::new(faulty.clone()),
            &mut |_| {},
        )
        .unwrap();
        store_all(&svc, &a);
        settle(&svc);
        let gate = faulty.hold(Op::Remove);
        std::thread::scope(|scope| {
            // b's writes need a's space: the round that evicts a stops at
            // the delete of a's files
            let storing = scope.spawn(|| store_all(&svc, &b));
            assert!(
                gate.wait_for_held(1, Duration::from_secs(30)),
                "{eviction:?}: no delete started"
            );
            // another caller's round flushes b's writes meanwhile
            assert!(svc.begin(&c).unwrap());
            svc.abort(c.generation()).unwrap();
            gate.release();
            storing.join().unwrap();
        });
        settle(&svc);
        assert_eq!(stat(&svc, "l2_skipped_full"), 0, "{eviction:?}");
        assert!(!is_listed(&svc, &a) && is_listed(&svc, &b), "{eviction:?}");
        assert_eq!(
            l2_files(&l2),
            expected_l2([&b]),
            "{eviction:?}: b is on disk"
        );
        svc.clear(false, false).unwrap();
        restore_all(&svc, &b);
        assert_idle(&svc);
        svc.close().unwrap();
    }
}
