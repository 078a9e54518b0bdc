//! The 18 reference directory tests
//! (`docs/design/manifests.md#reference-directory-scenarios`), one
//! Rust test each, named after the reference test.

use std::sync::{Arc, Barrier};

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::index::{Directory, DirectoryConfig};

use crate::index_support::*;

/// Reference test 1: A generation is visible only once every distinct rank acknowledged.
#[test]
fn only_complete_distinct_rank_set_is_visible() {
    let dir = memory();
    let m = fixture("producer-a");
    assert!(dir.begin(&m).unwrap());
    assert!(!dir.begin(&m).unwrap());
    for rank in [0, 0, 1, 2, 2] {
        assert!(!dir.acknowledge("producer-a", rank).unwrap().published);
        assert_eq!(found(&dir, &[prefix(&[1, 2])]), None);
    }
    assert_err(
        dir.acknowledge("producer-a", 4),
        ErrorKind::InvalidInput,
        "rank",
    );
    assert!(dir.acknowledge("producer-a", 3).unwrap().published);
    assert_eq!(
        found(&dir, &[prefix(&[1, 2])]).as_deref(),
        Some("producer-a")
    );
    assert!(!dir.acknowledge("producer-a", 3).unwrap().published);
}

/// Reference test 2: Identical publication is idempotent, also after a restart; different
/// content under a published id is a conflict.
#[test]
fn identical_published_manifest_is_idempotent_across_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let generation = format!("recurrent-content-v1:{}", "a".repeat(64));
    let m = manifest(&generation, prefix(&[1, 2]), WORLD, payload("x"));
    {
        let dir = file(&path, DirectoryConfig::default());
        publish(&dir, &m);
        assert!(!dir.begin(&m).unwrap());
        dir.close().unwrap();
    }
    let dir = file(&path, DirectoryConfig::default());
    assert!(!dir.begin(&m).unwrap());
    let changed = manifest(&generation, prefix(&[1, 2]), WORLD, payload("y"));
    assert_err(
        dir.begin(&changed),
        ErrorKind::GenerationConflict,
        "changed after publication",
    );
    assert_eq!(dir.find(&[prefix(&[1, 2])]).unwrap(), Some(m));
}

/// Reference test 3: A restart keeps published rows and drops pending ones.
#[test]
fn restart_keeps_complete_manifest_but_discards_pending() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let complete = fixture("complete");
    let partial = manifest("partial", prefix(&[1, 2, 3]), WORLD, payload("partial"));
    {
        let dir = file(&path, DirectoryConfig::default());
        publish(&dir, &complete);
        assert!(dir.begin(&partial).unwrap());
        assert!(!dir.acknowledge("partial", 0).unwrap().published);
        let s = dir.status().unwrap();
        assert_eq!((s.published_generations, s.pending_generations), (1, 1));
        dir.close().unwrap();
    }
    let dir = file(&path, DirectoryConfig::default());
    assert_eq!(
        found(&dir, &[prefix(&[1, 2, 3])]).as_deref(),
        Some("complete")
    );
    for rank in 0..WORLD {
        assert!(!dir.acknowledge("partial", rank).unwrap().published);
    }
    let s = dir.status().unwrap();
    assert_eq!((s.published_generations, s.pending_generations), (1, 0));
}

/// Reference test 4: Acknowledgements are counted per generation, never mixed.
#[test]
fn two_producers_cannot_mix_rank_acknowledgements() {
    let dir = memory();
    let a = fixture("producer-a");
    let b = fixture("producer-b");
    assert!(dir.begin(&a).unwrap());
    assert!(dir.begin(&b).unwrap());
    for (generation, rank) in [
        ("producer-a", 0),
        ("producer-a", 1),
        ("producer-b", 2),
        ("producer-b", 3),
    ] {
        assert!(!dir.acknowledge(generation, rank).unwrap().published);
    }
    assert_eq!(found(&dir, &[prefix(&[1, 2])]), None);
    assert!(dir.abort("producer-a").unwrap());
    assert!(!dir.acknowledge("producer-a", 2).unwrap().published);
    assert!(!dir.acknowledge("producer-b", 0).unwrap().published);
    assert!(dir.acknowledge("producer-b", 1).unwrap().published);
    assert_eq!(
        found(&dir, &[prefix(&[1, 2])]).as_deref(),
        Some("producer-b")
    );
}

/// Reference test 5: Replacement is atomic; invalidating a replaced generation cannot remove
/// its replacement.
#[test]
fn replacement_is_atomic_and_stale_invalidation_is_generation_scoped() {
    let dir = memory();
    publish(&dir, &fixture("producer-a"));
    let b = fixture("producer-b");
    assert!(dir.begin(&b).unwrap());
    for rank in 0..3 {
        assert!(!dir.acknowledge("producer-b", rank).unwrap().published);
    }
    assert_eq!(
        found(&dir, &[prefix(&[1, 2])]).as_deref(),
        Some("producer-a")
    );
    let publication = dir.acknowledge("producer-b", 3).unwrap();
    assert!(publication.published);
    assert_eq!(publication.replaced.as_deref(), Some("producer-a"));
    assert!(!dir.invalidate("producer-a").unwrap());
    assert_eq!(
        found(&dir, &[prefix(&[1, 2])]).as_deref(),
        Some("producer-b")
    );
    assert!(dir.invalidate("producer-b").unwrap());
    assert_eq!(found(&dir, &[prefix(&[1, 2])]), None);
}

/// Reference test 6: Different namespace, prefix hash, start, or a non-prefix / shorter tail
/// misses (the reference's five parametrisations).
#[test]
fn incompatible_or_shorter_prefix_misses() {
    let dir = memory();
    publish(&dir, &fixture("producer-a"));
    let misses = [
        prefix_at("weights-layout-salt-b", START, hash_a(), &[1, 2]),
        prefix_at(NS, START, vec![b'b'; 32], &[1, 2]),
        prefix_at(NS, 8192, hash_a(), &[1, 2]),
        prefix(&[1, 3]),
        prefix(&[1]),
    ];
    for query in misses {
        assert_eq!(found(&dir, std::slice::from_ref(&query)), None, "{query:?}");
    }
    assert_eq!(
        found(&dir, &[prefix(&[1, 2])]).as_deref(),
        Some("producer-a")
    );
}

/// Reference test 7: Longest match wins; a find refreshes recency, so capacity evicts the
/// least recently published or found entry.
#[test]
fn longest_matching_prefix_and_lru_capacity() {
    let dir = Directory::open(None, config(2, 128)).unwrap();
    publish(&dir, &manifest("short", prefix(&[1]), 1, payload("short")));
    publish(&dir, &manifest("long", prefix(&[1, 2]), 1, payload("long")));
    assert_eq!(found(&dir, &[prefix(&[1, 2, 3])]).as_deref(), Some("long"));
    let third = publish(&dir, &manifest("third", prefix(&[9]), 1, payload("third")));
    assert_eq!(third.evicted, strings(&["short"]));
    assert_eq!(found(&dir, &[prefix(&[1, 2, 3])]).as_deref(), Some("long"));
    assert_eq!(found(&dir, &[prefix(&[1])]), None);
    assert_eq!(dir.status().unwrap().published_generations, 2);
}

/// Reference test 8: The result is the longest match across all queries, not the match of
/// the longest query.
#[test]
fn longest_match_is_not_the_longest_query_tail() {
    let dir = memory();
    let hash_b = vec![b'b'; 32];
    publish(&dir, &manifest("4098", prefix(&[1, 2]), 1, payload("4098")));
    publish(
        &dir,
        &manifest(
            "4100",
            prefix_at(NS, 4098, hash_b.clone(), &[3, 4]),
            1,
            payload("4100"),
        ),
    );
    let queries = [
        prefix(&[1, 2, 3, 4, 5]),
        prefix_at(NS, 4098, hash_b, &[3, 4]),
    ];
    let m = dir.find(&queries).unwrap().unwrap();
    assert_eq!(m.generation(), "4100");
    assert_eq!(m.prefix().num_tokens(), 4100);
}

/// Reference test 9: Pending capacity, abort and the identity of a pending manifest.
#[test]
fn pending_capacity_abort_and_manifest_identity() {
    let dir = Directory::open(None, config(65_536, 1)).unwrap();
    let a = fixture("producer-a");
    let b = fixture("producer-b");
    assert!(dir.begin(&a).unwrap());
    assert!(!dir.begin(&b).unwrap());
    let changed = manifest("producer-a", prefix(&[1, 2]), WORLD, payload("changed"));
    assert_err(
        dir.begin(&changed),
        ErrorKind::GenerationConflict,
        "changed",
    );
    assert_err(
        dir.is_pending(&changed),
        ErrorKind::GenerationConflict,
        "changed",
    );
    assert!(dir.is_pending(&a).unwrap());
    dir.abort("producer-a").unwrap();
    assert!(!dir.is_pending(&a).unwrap());
    assert!(dir.begin(&b).unwrap());
}

/// Reference test 10: Eight threads acknowledging ranks 0..3 twice publish exactly once.
#[test]
fn concurrent_rank_acknowledgements_publish_once() {
    let dir = Arc::new(memory());
    assert!(dir.begin(&fixture("producer-a")).unwrap());
    let barrier = Arc::new(Barrier::new(8));
    let handles: Vec<_> = [0u32, 1, 2, 3, 0, 1, 2, 3]
        .into_iter()
        .map(|rank| {
            let (dir, barrier) = (Arc::clone(&dir), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                dir.acknowledge("producer-a", rank).unwrap().published
            })
        })
        .collect();
    let wins = handles
        .into_iter()
        .map(|h| h.join().unwrap())
        .filter(|&won| won)
        .count();
    assert_eq!(wins, 1);
    assert_eq!(
        found(&dir, &[prefix(&[1, 2])]).as_deref(),
        Some("producer-a")
    );
}

/// Reference test 11: Tails match whole tokens only (the reference's five parametrisations).
#[test]
fn tail_matches_whole_tokens_only() {
    let cases: [(&[u32], &[u32], bool); 5] = [
        (&[1, 2], &[1, 2], true),
        (&[1, 2], &[1, 2, 3], true),
        (&[1, 2], &[1, 20], false),
        (&[1], &[12, 3], false),
        (&[12], &[1, 2, 3], false),
    ];
    for (stored, query, hit) in cases {
        let dir = memory();
        publish(&dir, &manifest("stored", prefix(stored), 1, payload("s")));
        assert_eq!(
            found(&dir, &[prefix(query)]).is_some(),
            hit,
            "stored {stored:?} query {query:?}"
        );
    }
}

/// Reference test 12: Ancestors are whole-token prefixes shorter than the bound, shortest first.
#[test]
fn ancestors_match_whole_tokens_only() {
    let dir = memory();
    for (generation, tail) in [
        ("one", &[1u32][..]),
        ("one-two", &[1, 2]),
        ("decoy-12", &[12]),
        ("decoy-1-20", &[1, 20]),
    ] {
        publish(
            &dir,
            &manifest(generation, prefix(tail), 1, payload(generation)),
        );
    }
    let query = prefix(&[1, 2, 3]);
    let ancestors = dir
        .ancestors(std::slice::from_ref(&query), query.num_tokens())
        .unwrap();
    let names: Vec<&str> = ancestors.iter().map(|m| m.generation()).collect();
    assert_eq!(names, ["one", "one-two"]);
    assert_eq!(ancestors[1].prefix(), &prefix(&[1, 2]));
    // The bound is exclusive; the query's own length is never an ancestor.
    let below_two = dir.ancestors(&[query], START + 2).unwrap();
    assert_eq!(below_two.len(), 1);
}

/// Reference test 13: Among many tails in one bucket, the longest whole-token prefix wins and
/// decoys differing only in their last token never match.
#[test]
fn longest_match_among_many_tails_sharing_a_hash_block() {
    let dir = memory();
    let query_tail: Vec<u32> = (0..300).map(|i| 1000 + i).collect();
    for n in (1..=295).step_by(7) {
        let tail = &query_tail[..n];
        publish(
            &dir,
            &manifest(
                &format!("prefix-{n}"),
                prefix(tail),
                1,
                payload(&format!("p{n}")),
            ),
        );
        let mut decoy = tail.to_vec();
        *decoy.last_mut().unwrap() += 1_000_000;
        publish(
            &dir,
            &manifest(
                &format!("decoy-{n}"),
                prefix(&decoy),
                1,
                payload(&format!("d{n}")),
            ),
        );
    }
    assert_eq!(
        found(&dir, &[prefix(&query_tail)]).as_deref(),
        Some("prefix-295")
    );
    assert_eq!(
        found(&dir, &[prefix(&query_tail[..294])]).as_deref(),
        Some("prefix-288")
    );
}

/// Reference test 14: Capacity keeps recently found entries (file database; both tables).
#[test]
fn capacity_keeps_recently_found_entries() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let dir = file(&path, config(3, 128));
    for i in 0..3u32 {
        publish(
            &dir,
            &manifest(&format!("p{i}"), prefix(&[i]), 1, payload("x")),
        );
    }
    assert_eq!(found(&dir, &[prefix(&[0])]).as_deref(), Some("p0"));
    let p3 = publish(&dir, &manifest("p3", prefix(&[3]), 1, payload("x")));
    assert_eq!(p3.evicted, strings(&["p1"]));
    assert_eq!(dir.status().unwrap().published_generations, 3);
    let expected = strings(&["p0", "p2", "p3"]);
    assert_eq!(row_generations(&path), expected);
    assert_eq!(tail_generations(&path), expected);
}

/// Reference test 15: Capacities must be positive (the Rust types already exclude negative,
/// fractional and boolean values; zero is refused for each capacity).
#[test]
fn capacities_must_be_positive_integers() {
    let zero_entries = DirectoryConfig {
        max_entries: 0,
        ..DirectoryConfig::default()
    };
    let zero_pending = DirectoryConfig {
        max_pending: 0,
        ..DirectoryConfig::default()
    };
    let zero_bytes = DirectoryConfig {
        max_bytes: Some(0),
        ..DirectoryConfig::default()
    };
    for config in [zero_entries, zero_pending, zero_bytes] {
        assert_err(
            Directory::open(None, config),
            ErrorKind::InvalidInput,
            "checkpoint directory capacities must be positive integers",
        );
    }
    let zero_updates = DirectoryConfig {
        recency_flush_updates: 0,
        ..DirectoryConfig::default()
    };
    assert_err(
        Directory::open(None, zero_updates),
        ErrorKind::InvalidInput,
        "positive",
    );
}

/// Reference test 16: Replaced and invalidated generations leave no lookup rows.
#[test]
fn replaced_and_invalidated_generations_leave_no_lookup_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let dir = file(&path, DirectoryConfig::default());
    publish(&dir, &fixture("producer-a"));
    publish(&dir, &fixture("producer-b"));
    assert_eq!(tail_generations(&path), strings(&["producer-b"]));
    assert_eq!(row_generations(&path), strings(&["producer-b"]));
    assert!(dir.invalidate("producer-b").unwrap());
    assert!(tail_generations(&path).is_empty());
    assert!(row_generations(&path).is_empty());
}

/// Reference test 17: Tail-hash candidates are confirmed against the stored tail (all tail
/// hashes forced equal through the test hook).
#[test]
fn hash_candidates_are_confirmed_against_the_stored_tail() {
    let dir = Directory::open(
        None,
        DirectoryConfig {
            tail_hash_hook: Some(|_| 7),
            ..DirectoryConfig::default()
        },
    )
    .unwrap();
    publish(&dir, &manifest("one-two", prefix(&[1, 2]), 1, payload("a")));
    publish(
        &dir,
        &manifest("decoy-1-20", prefix(&[1, 20]), 1, payload("b")),
    );
    publish(&dir, &manifest("decoy-12", prefix(&[12]), 1, payload("c")));
    assert_eq!(
        found(&dir, &[prefix(&[1, 2, 3])]).as_deref(),
        Some("one-two")
    );
    assert_eq!(found(&dir, &[prefix(&[1, 3])]), None);
    assert_eq!(
        found(&dir, &[prefix(&[12, 5])]).as_deref(),
        Some("decoy-12")
    );
}

/// Reference test 18: A directory written by an older build (no recency index, no tails
/// table, a dangling tail row) is reconciled at open.
#[test]
fn existing_directory_gains_recency_index() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    {
        let dir = file(&path, DirectoryConfig::default());
        publish(&dir, &fixture("producer-a"));
        dir.close().unwrap();
    }
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "DROP INDEX checkpoints_access_order;
             DROP TABLE checkpoint_tails;
             CREATE TABLE checkpoint_tails (generation TEXT PRIMARY KEY, namespace TEXT NOT NULL,
                 start_tokens INTEGER NOT NULL, prefix_hash BLOB NOT NULL,
                 tail_hash INTEGER NOT NULL);
             INSERT INTO checkpoint_tails VALUES ('gone', 'x', 0, x'', 1);
             PRAGMA user_version = 1;",
        )
        .unwrap();
    }
    let dir = file(&path, DirectoryConfig::default());
    assert_eq!(
        found(&dir, &[prefix(&[1, 2, 3])]).as_deref(),
        Some("producer-a")
    );
    assert_eq!(tail_generations(&path), strings(&["producer-a"]));
    let conn = rusqlite::Connection::open(&path).unwrap();
    let indexes: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'index' AND name NOT LIKE 'sqlite_%' ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(
        indexes,
        strings(&["checkpoint_tails_lookup", "checkpoints_access_order"])
    );
}
