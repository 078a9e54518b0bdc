//! Directory lifecycle: publication, replacement, lookups over token roots,
//! capacity, stale pending generations, durability flags and listing.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use lmcache_rc_core::index::{Directory, DirectoryConfig};
use lmcache_rc_core::{ErrorKind, TokenRoots};

use crate::index_support::*;

#[test]
fn publication_needs_every_distinct_rank_and_duplicates_do_not_count() {
    let dir = memory();
    let m = fixture("g");
    assert!(dir.begin(&m).unwrap());
    for rank in [2, 2, 0, 0, 2, 1, 1] {
        let p = dir.acknowledge("g", rank).unwrap();
        assert!(!p.published && p.replaced.is_none() && p.evicted.is_empty());
    }
    assert_eq!(found(&dir, &[prefix(&[1, 2])]), None);
    assert_eq!(dir.status().unwrap().pending_generations, 1);
    assert!(dir.acknowledge("g", 3).unwrap().published);
    let s = dir.status().unwrap();
    assert_eq!((s.published_generations, s.pending_generations), (1, 0));
}

#[test]
fn rank_out_of_range_is_refused_and_keeps_the_pending_state() {
    let dir = memory();
    assert!(dir.begin(&fixture("g")).unwrap());
    for rank in 0..3 {
        dir.acknowledge("g", rank).unwrap();
    }
    for bad in [WORLD, WORLD + 1, u32::MAX] {
        assert_err(
            dir.acknowledge("g", bad),
            ErrorKind::InvalidInput,
            "checkpoint acknowledgement rank is out of range",
        );
    }
    assert!(dir.acknowledge("g", 3).unwrap().published);
}

#[test]
fn unknown_or_published_generation_acknowledgement_is_false_without_rank_check() {
    let dir = memory();
    assert!(!dir.acknowledge("never-begun", 99_999).unwrap().published);
    publish(&dir, &fixture("g"));
    assert!(!dir.acknowledge("g", 99_999).unwrap().published);
    assert!(!dir.acknowledge("g", 0).unwrap().published);
}

#[test]
fn exactly_one_of_eight_concurrent_acknowledgements_publishes_in_fifty_rounds() {
    let dir = Arc::new(memory());
    for round in 0..50u32 {
        let generation = format!("g-{round}");
        let m = manifest(
            &generation,
            prefix(&[round + 1]),
            WORLD,
            payload(&generation),
        );
        assert!(dir.begin(&m).unwrap());
        let barrier = Arc::new(Barrier::new(8));
        let handles: Vec<_> = [0u32, 1, 2, 3, 0, 1, 2, 3]
            .into_iter()
            .map(|rank| {
                let (dir, barrier, generation) =
                    (Arc::clone(&dir), Arc::clone(&barrier), generation.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    dir.acknowledge(&generation, rank).unwrap().published
                })
            })
            .collect();
        let wins = handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(|&won| won)
            .count();
        assert_eq!(wins, 1, "round {round}");
        assert_eq!(found(&dir, &[prefix(&[round + 1])]), Some(generation));
    }
    let s = dir.status().unwrap();
    assert_eq!((s.published_generations, s.pending_generations), (50, 0));
}

#[test]
fn begin_is_refused_while_pending_capacity_is_full() {
    let dir = Directory::open(None, config(100, 2)).unwrap();
    assert!(dir.begin(&fixture("a")).unwrap());
    assert!(dir.begin(&fixture("b")).unwrap());
    assert!(!dir.begin(&fixture("c")).unwrap());
    assert_eq!(dir.pending_count().unwrap(), 2);
    for rank in 0..WORLD {
        dir.acknowledge("a", rank).unwrap();
    }
    assert!(dir.begin(&fixture("c")).unwrap());
}

#[test]
fn a_removed_generation_can_be_begun_again() {
    let dir = memory();
    publish(&dir, &fixture("g"));
    assert!(!dir.begin(&fixture("g")).unwrap());
    assert!(dir.invalidate("g").unwrap());
    assert!(!dir.invalidate("g").unwrap());
    publish(&dir, &fixture("g"));
}

/// `docs/design/identity.md#reference-scenarios`, item 2: stored boundaries at
/// 17, 4096, 8193 and 17408 of a 20000-token sequence are found by siblings
/// sharing 18, 4096, 8960 and 18000 tokens.
#[test]
fn longest_prefix_lookup_crosses_chunk_boundaries() {
    let ns = "roots-namespace";
    let tokens: Vec<u32> = (0..20_000).collect();
    let roots = TokenRoots::build(ns, tokens.clone(), 4096).unwrap();
    assert_eq!(
        roots
            .roots()
            .iter()
            .map(|r| r.tail_tokens().len())
            .sum::<usize>(),
        20_000
    );
    let dir = memory();
    for n in [17u64, 4096, 8193, 17408] {
        let p = roots.prefix(n).unwrap();
        publish(
            &dir,
            &manifest(&format!("at-{n}"), p, 1, payload(&n.to_string())),
        );
    }
    for (shared, expected) in [
        (18usize, 17u64),
        (4096, 4096),
        (8960, 8193),
        (18_000, 17408),
    ] {
        let mut sibling = tokens[..shared].to_vec();
        sibling.extend([777_777; 3]);
        let query = TokenRoots::build(ns, sibling, 4096).unwrap();
        let m = dir.find(&query.roots()).unwrap().unwrap();
        assert_eq!(m.generation(), format!("at-{expected}"));
        assert_eq!(m.prefix(), &query.prefix(expected).unwrap());
    }
    let mut changed = tokens.clone();
    changed[0] = 5;
    let query = TokenRoots::build(ns, changed, 4096).unwrap();
    assert_eq!(dir.find(&query.roots()).unwrap(), None);
    let other = TokenRoots::build("other", tokens, 4096).unwrap();
    assert_eq!(dir.find(&other.roots()).unwrap(), None);
}

#[test]
fn equal_length_replacement_reports_and_removes_the_old_generation() {
    let dir = memory();
    publish(&dir, &fixture("old"));
    let p = publish(&dir, &fixture("new"));
    assert_eq!(p.replaced.as_deref(), Some("old"));
    assert!(p.evicted.is_empty());
    assert_eq!(dir.get("old").unwrap(), None);
    assert_eq!(dir.get("new").unwrap(), Some(fixture("new")));
    assert_eq!(found(&dir, &[prefix(&[1, 2, 3])]).as_deref(), Some("new"));
    assert_eq!(dir.status().unwrap().published_generations, 1);
}

#[test]
fn query_shorter_than_any_stored_entry_misses() {
    let dir = memory();
    publish(
        &dir,
        &manifest("long", prefix(&[1, 2, 3, 4]), 1, payload("x")),
    );
    assert_eq!(found(&dir, &[prefix(&[1, 2, 3])]), None);
    assert_eq!(found(&dir, &[prefix(&[1])]), None);
    assert_eq!(found(&dir, &[]), None);
    assert_eq!(
        found(&dir, &[prefix(&[1, 2, 3, 4, 5])]).as_deref(),
        Some("long")
    );
}

#[test]
fn lookups_cannot_mix_namespaces() {
    let dir = memory();
    publish(&dir, &fixture("g"));
    let mixed = [
        prefix(&[1, 2]),
        prefix_at("other", START, hash_a(), &[1, 2]),
    ];
    assert_err(
        dir.find(&mixed),
        ErrorKind::InvalidInput,
        "cannot mix namespaces",
    );
    assert_err(
        dir.ancestors(&mixed, 10_000),
        ErrorKind::InvalidInput,
        "cannot mix namespaces",
    );
    assert_eq!(found(&dir, &mixed[..1]).as_deref(), Some("g"));
}

#[test]
fn max_entries_evicts_the_least_recently_used_and_reports_it() {
    let dir = Directory::open(None, config(3, 128)).unwrap();
    for i in 0..3u32 {
        publish(
            &dir,
            &manifest(&format!("p{i}"), prefix(&[i]), 1, payload("x")),
        );
    }
    // get does not refresh recency; find does.
    assert!(dir.get("p0").unwrap().is_some());
    assert_eq!(found(&dir, &[prefix(&[1])]).as_deref(), Some("p1"));
    let p = publish(&dir, &manifest("p3", prefix(&[3]), 1, payload("x")));
    assert_eq!(p.evicted, strings(&["p0"]));
    let p = publish(&dir, &manifest("p4", prefix(&[4]), 1, payload("x")));
    assert_eq!(p.evicted, strings(&["p2"]));
    let s = dir.status().unwrap();
    assert_eq!((s.published_generations, s.evictions), (3, 2));
    assert_eq!(found(&dir, &[prefix(&[1])]).as_deref(), Some("p1"));
}

#[test]
fn max_bytes_evicts_by_payload_bytes_in_lru_order() {
    let dir = Directory::open(
        None,
        DirectoryConfig {
            max_bytes: Some(1000),
            ..DirectoryConfig::default()
        },
    )
    .unwrap();
    // world 2 × 2 pages × 100 bytes = 400 bytes each.
    let sized = |i: u32| {
        manifest(
            &format!("b{i}"),
            prefix(&[i]),
            2,
            payload2(&format!("b{i}"), 100, 2),
        )
    };
    assert!(publish(&dir, &sized(0)).evicted.is_empty());
    assert!(publish(&dir, &sized(1)).evicted.is_empty());
    assert_eq!(dir.status().unwrap().published_bytes, 800);
    assert_eq!(found(&dir, &[prefix(&[0])]).as_deref(), Some("b0"));
    assert_eq!(publish(&dir, &sized(2)).evicted, strings(&["b1"]));
    let s = dir.status().unwrap();
    assert_eq!((s.published_generations, s.published_bytes), (2, 800));
    // One generation larger than the whole bound evicts everything else but stays.
    let huge = manifest("huge", prefix(&[9]), 1, payload2("huge", 2000, 1));
    assert_eq!(sorted(publish(&dir, &huge).evicted), strings(&["b0", "b2"]));
    let s = dir.status().unwrap();
    assert_eq!((s.published_generations, s.published_bytes), (1, 2000));
    assert_eq!(found(&dir, &[prefix(&[9])]).as_deref(), Some("huge"));
}

#[test]
fn lowering_max_entries_on_reopen_takes_effect_at_next_publication() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    {
        let dir = file(&path, config(10, 128));
        for i in 0..6u32 {
            publish(
                &dir,
                &manifest(&format!("p{i}"), prefix(&[i]), 1, payload("x")),
            );
        }
        assert_eq!(found(&dir, &[prefix(&[0])]).as_deref(), Some("p0"));
        dir.close().unwrap();
    }
    let dir = file(&path, config(3, 128));
    assert_eq!(dir.status().unwrap().published_generations, 6);
    let p = publish(&dir, &manifest("p6", prefix(&[6]), 1, payload("x")));
    // Oldest first: p1..p4 (p0 was found after p5 was published).
    assert_eq!(p.evicted, strings(&["p1", "p2", "p3", "p4"]));
    assert_eq!(sorted(row_generations(&path)), strings(&["p0", "p5", "p6"]));
}

#[test]
fn abort_stale_releases_old_pending_generations_in_admission_order() {
    let dir = memory();
    assert!(dir.begin(&fixture("old-1")).unwrap());
    assert!(dir.begin(&fixture("old-2")).unwrap());
    std::thread::sleep(Duration::from_millis(60));
    assert!(dir.begin(&fixture("young")).unwrap());
    assert!(
        dir.abort_stale(Duration::from_secs(3600))
            .unwrap()
            .is_empty()
    );
    let stale = dir.abort_stale(Duration::from_millis(30)).unwrap();
    assert_eq!(stale, strings(&["old-1", "old-2"]));
    assert_eq!(dir.pending_count().unwrap(), 1);
    assert!(!dir.acknowledge("old-1", 0).unwrap().published);
    // Released generations can be begun (and published) again.
    publish(&dir, &fixture("old-1"));
    assert!(dir.is_pending(&fixture("young")).unwrap());
}

#[test]
fn abort_drops_only_pending_state() {
    let dir = memory();
    publish(&dir, &fixture("g"));
    assert!(!dir.abort("g").unwrap());
    assert!(!dir.abort("unknown").unwrap());
    assert_eq!(found(&dir, &[prefix(&[1, 2])]).as_deref(), Some("g"));
}

#[test]
fn retire_removes_several_generations_at_once() {
    let dir = memory();
    for i in 0..4u32 {
        publish(
            &dir,
            &manifest(&format!("r{i}"), prefix(&[i]), 1, payload("x")),
        );
    }
    let removed = dir
        .retire(&strings(&["r1", "missing", "r3", "r1"]))
        .unwrap();
    assert_eq!(removed, strings(&["r1", "r3"]));
    assert_eq!(dir.status().unwrap().published_generations, 2);
    assert_eq!(found(&dir, &[prefix(&[1])]), None);
    assert_eq!(found(&dir, &[prefix(&[2])]).as_deref(), Some("r2"));
    assert!(dir.retire(&[]).unwrap().is_empty());
}

#[test]
fn durable_flags_and_listing_page_through_every_generation() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    {
        let dir = file(&path, DirectoryConfig::default());
        for i in 0..7u32 {
            let m = manifest(&format!("l{i}"), prefix(&[i]), 1, payload2("k", 10, 1));
            publish(&dir, &m);
        }
        assert!(dir.set_durable("l2", true).unwrap());
        assert!(dir.set_durable("l5", true).unwrap());
        assert!(!dir.set_durable("missing", true).unwrap());
        assert_eq!(dir.status().unwrap().durable_generations, 2);
        dir.close().unwrap();
    }
    let dir = file(&path, DirectoryConfig::default());
    let s = dir.status().unwrap();
    assert_eq!((s.durable_generations, s.published_bytes), (2, 70));
    assert!(dir.set_durable("l5", false).unwrap());
    let mut all = Vec::new();
    let mut after: Option<String> = None;
    let mut pages = 0;
    loop {
        let page = dir.list(after.as_deref(), 3).unwrap();
        pages += 1;
        all.extend(page.generations);
        match page.next_after {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    let names: Vec<&str> = all.iter().map(|l| l.manifest.generation()).collect();
    assert_eq!(names, ["l0", "l1", "l2", "l3", "l4", "l5", "l6"]);
    let durable: Vec<&str> = all
        .iter()
        .filter(|l| l.durable)
        .map(|l| l.manifest.generation())
        .collect();
    assert_eq!(durable, ["l2"]);
    assert!(all.iter().all(|l| l.payload_bytes == 10));
    // Stamps follow publication order.
    assert!(
        all.windows(2)
            .all(|w| w[0].access_order < w[1].access_order)
    );
    assert_err(dir.list(None, 0), ErrorKind::InvalidInput, "limit");
}

#[test]
fn a_closed_directory_refuses_every_call() {
    let dir = memory();
    publish(&dir, &fixture("g"));
    assert!(dir.begin(&fixture("pending")).unwrap());
    dir.close().unwrap();
    dir.close().unwrap();
    assert_err(
        dir.find(&[prefix(&[1, 2])]),
        ErrorKind::Closed,
        "checkpoint directory is closed",
    );
    assert_err(dir.begin(&fixture("x")), ErrorKind::Closed, "closed");
    assert_err(dir.acknowledge("pending", 0), ErrorKind::Closed, "closed");
    assert_err(dir.get("g"), ErrorKind::Closed, "closed");
    assert_err(dir.status(), ErrorKind::Closed, "closed");
    assert_err(dir.invalidate("g"), ErrorKind::Closed, "closed");
    assert_err(dir.list(None, 1), ErrorKind::Closed, "closed");
    assert_err(dir.pending_count(), ErrorKind::Closed, "closed");
    assert_err(dir.flush_recency(), ErrorKind::Closed, "closed");
}
