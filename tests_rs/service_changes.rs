//! The change feed (`changes`, `docs/design/change-feed.md`): every listing,
//! tier reached and unlisting of a generation, in the order it happened,
//! in a bounded ring that says when a reader missed entries; the watched
//! generations' tiers as of the same instant; a new epoch per service open.

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::protocol::{ChangeBatch, MAX_WATCH};
use lmcache_rc_core::service::ServiceConfig;

use crate::service_common::*;

both_ways!(
    the_feed_reports_a_listing_its_durable_tier_and_its_clear_in_order,
    watched_generations_answer_their_tier_as_of_the_reply,
    a_directory_eviction_is_an_unlisting,
    a_full_ring_drops_its_oldest_changes_and_says_so,
    a_reopened_service_has_another_epoch_and_lists_what_survived,
    too_many_watched_generations_are_refused,
);

/// `(generation, kind, tier)` of each change.
fn entries(batch: &ChangeBatch) -> Vec<(String, String, Option<String>)> {
    batch
        .changes
        .iter()
        .map(|c| (c.generation.clone(), c.kind.clone(), c.tier.clone()))
        .collect()
}

fn tier(name: &str) -> Option<String> {
    Some(name.to_string())
}

fn the_feed_reports_a_listing_its_durable_tier_and_its_clear_in_order<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let svc = T::open(config("feed-order", Some(dir.path()))).unwrap();
    let start = svc.changes(u64::MAX, &[]).unwrap();
    assert!(start.truncated && start.changes.is_empty() && !start.more);
    let a = standard(NS, &seq(60_000, 48), "prompt", 2);
    let g = a.generation().to_string();
    store_all(&svc, &a);
    settle(&svc);
    svc.clear(false, true).unwrap();
    let batch = svc.changes(start.next_seq, &[]).unwrap();
    assert_eq!(batch.epoch, start.epoch);
    assert!(!batch.truncated && !batch.more);
    assert_eq!(
        entries(&batch),
        vec![
            (g.clone(), "listed".into(), tier("l1")),
            (g.clone(), "tier".into(), tier("l2")),
            (g, "unlisted".into(), None),
        ]
    );
    let seqs: Vec<u64> = batch.changes.iter().map(|c| c.seq).collect();
    assert_eq!(
        seqs,
        vec![start.next_seq, start.next_seq + 1, start.next_seq + 2]
    );
    assert_eq!(batch.next_seq, start.next_seq + 3);
    let again = svc.changes(batch.next_seq, &[]).unwrap();
    assert!(again.changes.is_empty() && !again.truncated);
    svc.close().unwrap();
}

fn watched_generations_answer_their_tier_as_of_the_reply<T: Target>() {
    let svc = T::open(config("feed-watch", None)).unwrap();
    let a = standard(NS, &seq(61_000, 48), "prompt", 2);
    let b = standard(NS, &seq(62_000, 48), "prompt", 2);
    store_all(&svc, &a);
    store_all(&svc, &b);
    assert_eq!(svc.invalidate_namespace(NS).unwrap(), 2);
    let c = standard(NS, &seq(63_000, 48), "prompt", 2);
    store_all(&svc, &c);
    let watch = vec![
        a.generation().to_string(),
        c.generation().to_string(),
        "recurrent-content-v1:never".to_string(),
    ];
    let batch = svc.changes(0, &watch).unwrap();
    assert_eq!(batch.watched, vec![None, tier("l1"), None]);
    let (ga, gb, gc) = (a.generation(), b.generation(), c.generation());
    let kinds: Vec<(String, String)> = entries(&batch)
        .into_iter()
        .map(|(g, k, _)| (g, k))
        .collect();
    let pair = |g: &str, k: &str| (g.to_string(), k.to_string());
    assert_eq!(kinds[..2], [pair(ga, "listed"), pair(gb, "listed")]);
    let mut unlisted = kinds[2..4].to_vec();
    unlisted.sort();
    let mut want = vec![pair(ga, "unlisted"), pair(gb, "unlisted")];
    want.sort();
    assert_eq!(unlisted, want, "the invalidation unlists both");
    assert_eq!(kinds[4..], [pair(gc, "listed")]);
    svc.close().unwrap();
}

fn a_directory_eviction_is_an_unlisting<T: Target>() {
    let svc = T::open(ServiceConfig {
        max_entries: 2,
        ..config("feed-lru", None)
    })
    .unwrap();
    let gens: Vec<_> = (0..3)
        .map(|i| standard(NS, &seq(64_000 + 1_000 * i, 48), "prompt", 2))
        .collect();
    for m in &gens {
        store_all(&svc, m);
    }
    let batch = svc.changes(0, &[]).unwrap();
    let first = gens[0].generation().to_string();
    assert_eq!(
        entries(&batch).last().cloned(),
        Some((first, "unlisted".to_string(), None)),
        "the least recently used generation left when the third was published"
    );
    assert!(!is_listed(&svc, &gens[0]));
    svc.close().unwrap();
}

fn a_full_ring_drops_its_oldest_changes_and_says_so<T: Target>() {
    let svc = T::open(ServiceConfig {
        change_feed_capacity: 4,
        ..config("feed-ring", None)
    })
    .unwrap();
    for i in 0..3 {
        store_all(
            &svc,
            &standard(NS, &seq(67_000 + 1_000 * i, 48), "prompt", 2),
        );
    }
    svc.clear(true, true).unwrap(); // 3 unlistings: 6 changes in a ring of 4
    let batch = svc.changes(0, &[]).unwrap();
    assert!(batch.truncated, "seq 0 and 1 were dropped");
    let seqs: Vec<u64> = batch.changes.iter().map(|c| c.seq).collect();
    assert_eq!(seqs, vec![2, 3, 4, 5]);
    assert_eq!(batch.next_seq, 6);
    let kept = svc.changes(4, &[]).unwrap();
    assert!(!kept.truncated);
    assert_eq!(kept.changes.len(), 2);
    let beyond = svc.changes(7, &[]).unwrap();
    assert!(
        beyond.truncated && beyond.changes.is_empty() && beyond.next_seq == 6,
        "a position this epoch never had is not trusted"
    );
    svc.close().unwrap();
}

fn a_reopened_service_has_another_epoch_and_lists_what_survived<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let m = standard(NS, &seq(70_000, 48), "prompt", 2);
    let before = {
        let svc = T::open(durable_config("feed-epoch", dir.path())).unwrap();
        store_all(&svc, &m);
        settle(&svc);
        let batch = svc.changes(0, &[]).unwrap();
        svc.close().unwrap();
        batch
    };
    let svc = T::open(durable_config("feed-epoch", dir.path())).unwrap();
    let after = svc
        .changes(before.next_seq, &[m.generation().to_string()])
        .unwrap();
    assert_ne!(after.epoch, before.epoch, "a new epoch per open");
    assert_eq!(after.watched, vec![tier("l2")], "durable: it survived");
    let fresh = svc.changes(0, &[]).unwrap();
    assert_eq!(
        entries(&fresh),
        vec![(m.generation().to_string(), "listed".into(), tier("l2"))],
        "start-up lists what it reconciled, from seq 0"
    );
    svc.close().unwrap();
}

fn too_many_watched_generations_are_refused<T: Target>() {
    let svc = T::open(config("feed-watch-max", None)).unwrap();
    let watch = vec!["g".to_string(); MAX_WATCH + 1];
    let err = svc.changes(0, &watch).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    svc.close().unwrap();
}

/// The moves to the shared tier (feature `shared-tier`): an upload is a
/// `tier` change to `shared`, after `l2` on a host with L2 and straight from
/// `l1` without; an import is listed `shared` and never moves down; a
/// reopened host lists what survived as `l2` and moves it to `shared` when
/// its start-up pass finds it uploaded. Every shared tier here is a `file://`
/// directory.
#[cfg(feature = "shared-tier")]
mod shared {
    use std::time::{Duration, Instant};

    use lmcache_rc_core::protocol::Checkpoints;
    use lmcache_rc_core::service::ServiceConfig;

    use super::{entries, tier};
    use crate::service_common::*;
    use crate::service_shared::{file_host, file_shared, query, turn, wait_uploads};

    both_ways!(
        an_upload_moves_a_durable_generation_from_l2_to_shared_in_order,
        without_l2_an_upload_moves_a_generation_from_l1_to_shared,
        an_imported_generation_is_listed_shared_and_its_l2_copy_does_not_move_it_down,
        a_reopened_host_lists_its_generation_l2_then_moves_it_to_shared,
    );

    /// Where a tier stands in `l1 < l2 < shared`.
    fn rank(t: &Option<String>) -> usize {
        match t.as_deref() {
            Some("l1") => 1,
            Some("l2") => 2,
            Some("shared") => 3,
            other => panic!("not a listed tier: {other:?}"),
        }
    }

    /// Polls the feed from `since` while the generation `g` becomes durable
    /// and is uploaded, until its watched tier is `shared` (hang guard).
    /// Each reply's watched tier must be where the changes read so far leave
    /// it (the convergence guarantee), and the watched tiers never go down.
    /// Returns every change read and the next position.
    fn follow_until_shared(
        svc: &impl AsTarget,
        epoch: &str,
        mut since: u64,
        g: &str,
    ) -> (Vec<(String, String, Option<String>)>, u64) {
        let svc = svc.target();
        let watch = [g.to_string()];
        let deadline = Instant::now() + HANG_GUARD;
        let mut seen = Vec::new();
        let mut last_rank = 0;
        loop {
            let batch = svc.changes(since, &watch).unwrap();
            assert_eq!(batch.epoch, epoch);
            assert!(!batch.truncated && !batch.more);
            seen.extend(entries(&batch));
            since = batch.next_seq;
            let so_far = seen.last().and_then(|(_, _, t)| t.clone());
            assert_eq!(
                batch.watched,
                vec![so_far],
                "the watched tier is the one the changes so far end at: {seen:?}"
            );
            let now = rank(&batch.watched[0]);
            assert!(now >= last_rank, "a tier never moves down: {seen:?}");
            last_rank = now;
            if batch.watched[0] == tier("shared") {
                return (seen, since);
            }
            assert!(
                Instant::now() < deadline,
                "never reported shared: {seen:?}, {:?}",
                svc.status().unwrap().values
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn an_upload_moves_a_durable_generation_from_l2_to_shared_in_order<T: Target>() {
        let (dir, shared) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        // Every shared-tier request waits 20 ms: the upload usually ends
        // well after the L2 write, so the polls see the `l2` step (the
        // assertions do not rely on it).
        let latency = Duration::from_millis(20);
        let svc = T::open(file_host(dir.path(), shared.path(), latency)).unwrap();
        let start = svc.changes(u64::MAX, &[]).unwrap();
        let m = turn(NS, 72_000, 48);
        let g = m.generation().to_string();
        store_all(&svc, &m);
        let (seen, next) = follow_until_shared(&svc, &start.epoch, start.next_seq, &g);
        assert_eq!(
            seen,
            vec![
                (g.clone(), "listed".into(), tier("l1")),
                (g.clone(), "tier".into(), tier("l2")),
                (g.clone(), "tier".into(), tier("shared")),
            ],
            "listed, durable in L2, then uploaded: in that order"
        );
        assert_eq!(next, start.next_seq + 3);
        settle(&svc);
        wait_uploads(&svc, 1);
        assert_eq!(stat(&svc, "shared_manifests_written"), 1);
        let after = svc.changes(next, &[g]).unwrap();
        assert!(after.changes.is_empty(), "nothing after shared");
        assert_eq!(after.watched, vec![tier("shared")]);
        svc.close().unwrap();
    }

    fn without_l2_an_upload_moves_a_generation_from_l1_to_shared<T: Target>() {
        let shared = tempfile::tempdir().unwrap();
        let svc = T::open(ServiceConfig {
            shared: Some(file_shared(shared.path(), Duration::ZERO)),
            ..config("feed-shared-no-l2", None)
        })
        .unwrap();
        let start = svc.changes(u64::MAX, &[]).unwrap();
        let m = turn(NS, 73_000, 48);
        let g = m.generation().to_string();
        store_all(&svc, &m);
        let (seen, _) = follow_until_shared(&svc, &start.epoch, start.next_seq, &g);
        assert_eq!(
            seen,
            vec![
                (g.clone(), "listed".into(), tier("l1")),
                (g, "tier".into(), tier("shared")),
            ],
            "uploaded once published: no l2 step"
        );
        wait_uploads(&svc, 1);
        svc.close().unwrap();
    }

    fn an_imported_generation_is_listed_shared_and_its_l2_copy_does_not_move_it_down<T: Target>() {
        let (dir_a, dir_b, shared) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let a = T::open(file_host(dir_a.path(), shared.path(), Duration::ZERO)).unwrap();
        let b = T::open(file_host(dir_b.path(), shared.path(), Duration::ZERO)).unwrap();
        let m = turn(NS, 74_000, 48);
        let g = m.generation().to_string();
        store_all(&a, &m);
        settle(&a);
        wait_uploads(&a, 1);
        let start = b.changes(u64::MAX, &[]).unwrap();
        assert_eq!(b.find(&query(NS, 74_000, 60)).unwrap().as_ref(), Some(&m));
        let imported = b.changes(start.next_seq, std::slice::from_ref(&g)).unwrap();
        assert_eq!(
            entries(&imported),
            vec![(g.clone(), "listed".into(), tier("shared"))],
            "an import is listed in the tier it came from"
        );
        assert_eq!(imported.watched, vec![tier("shared")]);
        // Fetched, written to B's L2 and found present by B's upload: durable
        // here too, and still `shared` (the most durable tier it reached).
        restore_all(&b, &m);
        settle(&b);
        wait_uploads(&b, 1);
        let rows = b.list_generations().unwrap();
        assert!(rows.len() == 1 && rows[0].durable, "durable on B: {rows:?}");
        let after = b.changes(imported.next_seq, &[g]).unwrap();
        assert!(
            after.changes.is_empty(),
            "no change down to l2: {:?}",
            entries(&after)
        );
        assert_eq!(after.watched, vec![tier("shared")]);
        a.close().unwrap();
        b.close().unwrap();
    }

    fn a_reopened_host_lists_its_generation_l2_then_moves_it_to_shared<T: Target>() {
        let (dir, shared) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let m = turn(NS, 75_000, 48);
        let g = m.generation().to_string();
        {
            let svc = T::open(file_host(dir.path(), shared.path(), Duration::ZERO)).unwrap();
            store_all(&svc, &m);
            settle(&svc);
            wait_uploads(&svc, 1);
            svc.close().unwrap();
        }
        // The reopened host knows its L2 copy only; its start-up pass finds
        // the upload present (a HEAD) and moves the generation to `shared`.
        let svc = T::open(file_host(dir.path(), shared.path(), Duration::ZERO)).unwrap();
        let epoch = svc.changes(u64::MAX, &[]).unwrap().epoch;
        let (seen, _) = follow_until_shared(&svc, &epoch, 0, &g);
        assert_eq!(
            seen,
            vec![
                (g.clone(), "listed".into(), tier("l2")),
                (g, "tier".into(), tier("shared")),
            ]
        );
        wait_uploads(&svc, 1);
        assert_eq!(stat(&svc, "shared_manifests_present"), 1);
        assert_eq!(stat(&svc, "shared_manifests_written"), 0);
        svc.close().unwrap();
    }
}
