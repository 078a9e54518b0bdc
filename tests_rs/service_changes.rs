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
