//! The directory's write path (`docs/design/directory.md`):
//! publications commit without an fsync, durable marks are batched and made
//! durable by fsyncs shared between concurrent callers, and lookups read a
//! `TokenRoots` in place with the same answers as its `Prefix` roots.

use std::collections::BTreeSet;
use std::time::Duration;

use lmcache_rc_core::TokenRoots;
use lmcache_rc_core::index::{Directory, DirectoryConfig};

use crate::index_support::*;

fn names(dir: &Directory) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut all, mut durable) = (BTreeSet::new(), BTreeSet::new());
    let mut after: Option<String> = None;
    loop {
        let page = dir.list(after.as_deref(), 64).unwrap();
        for l in page.generations {
            let g = l.manifest.generation().to_owned();
            if l.durable {
                durable.insert(g.clone());
            }
            all.insert(g);
        }
        match page.next_after {
            Some(next) => after = Some(next),
            None => return (all, durable),
        }
    }
}

fn publish_n(dir: &Directory, n: u32) -> Vec<String> {
    (0..n)
        .map(|i| {
            let g = format!("d{i:03}");
            publish(dir, &manifest(&g, prefix(&[i + 1]), 2, payload2("k", 8, 1)));
            g
        })
        .collect()
}

#[test]
fn mark_durable_marks_a_batch_in_one_call_and_it_survives_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    {
        let dir = file(&path, DirectoryConfig::default());
        let all = publish_n(&dir, 10);
        assert_eq!(
            dir.status().unwrap().durability_fsyncs,
            0,
            "publication never syncs"
        );
        let batch = [
            all[1].as_str(),
            "missing",
            all[4].as_str(),
            all[1].as_str(),
            all[7].as_str(),
        ];
        assert_eq!(
            dir.mark_durable(&batch).unwrap(),
            [true, false, true, true, true]
        );
        let s = dir.status().unwrap();
        assert_eq!(s.durable_generations, 3);
        assert_eq!(s.durability_fsyncs, 1, "one batch, one fsync");
        // Already durable and no commit since: nothing to sync.
        assert_eq!(dir.mark_durable(&[all[4].as_str()]).unwrap(), [true]);
        assert_eq!(dir.status().unwrap().durability_fsyncs, 1);
        assert!(dir.mark_durable::<&str>(&[]).unwrap().is_empty());
        // A process crash right now keeps every mark: they were synced.
        std::mem::forget(dir);
    }
    let dir = file(&path, DirectoryConfig::default());
    let (all, durable) = names(&dir);
    assert_eq!(all.len(), 10);
    let expected: BTreeSet<String> = ["d001", "d004", "d007"].map(String::from).into();
    assert_eq!(durable, expected);
    assert_eq!(dir.status().unwrap().durable_generations, 3);
    // Clearing is allowed and needs no fsync.
    assert!(dir.set_durable("d004", false).unwrap());
    assert!(dir.set_durable("d005", true).unwrap());
    assert!(!dir.set_durable("missing", true).unwrap());
    assert_eq!(dir.status().unwrap().durable_generations, 3);
}

#[test]
fn concurrent_durable_marks_share_fsyncs_and_each_returns_after_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let dir = file(&path, DirectoryConfig::default());
    let all = publish_n(&dir, 64);
    std::thread::scope(|s| {
        for t in 0..8 {
            let (dir, all) = (&dir, &all);
            s.spawn(move || {
                for g in all.iter().skip(t).step_by(8) {
                    assert_eq!(dir.mark_durable(&[g.as_str()]).unwrap(), [true]);
                    // Returned: this generation's mark is committed (and synced).
                    assert!(names(dir).1.contains(g), "{g} not marked on return");
                }
            });
        }
    });
    let s = dir.status().unwrap();
    assert_eq!(s.durable_generations, 64);
    assert!(
        (1..=64).contains(&s.durability_fsyncs),
        "{} fsyncs for 64 marks",
        s.durability_fsyncs
    );
    dir.close().unwrap();
    let dir = file(&path, DirectoryConfig::default());
    assert_eq!(names(&dir).1.len(), 64);
}

#[test]
fn an_in_memory_directory_marks_without_syncing() {
    let dir = memory();
    let all = publish_n(&dir, 3);
    assert_eq!(dir.mark_durable(&all).unwrap(), [true, true, true]);
    let s = dir.status().unwrap();
    assert_eq!((s.durable_generations, s.durability_fsyncs), (3, 0));
}

#[test]
fn a_closed_directory_refuses_durable_marks() {
    let dir = memory();
    let all = publish_n(&dir, 1);
    dir.close().unwrap();
    assert_err(
        dir.mark_durable(&all),
        lmcache_rc_core::ErrorKind::Closed,
        "closed",
    );
}

/// Publishes 3,000 one-page generations named `<tag><i>` (seven per first
/// token), calling `after_each` after every publication.
fn publish_many(dir: &Directory, tag: &str, mut after_each: impl FnMut()) {
    for i in 0..3_000u32 {
        let m = manifest(
            &format!("{tag}{i}"),
            prefix(&[i / 7 + 1, i % 7 + 1]),
            1,
            payload(tag),
        );
        publish(dir, &m);
        after_each();
    }
}

#[test]
fn many_publications_keep_the_write_ahead_log_bounded() {
    // The background thread checkpoints; a commit cuts the log back past
    // its bound (8,192 frames, 32 MiB). Either way the log stays bounded.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let dir = file(&path, config(100_000, 128));
    publish_many(&dir, "w", || {});
    let wal = tmp.path().join("directory.sqlite3-wal");
    let bytes = std::fs::metadata(&wal).map_or(0, |m| m.len());
    assert!(bytes <= 40 << 20, "write-ahead log of {bytes} bytes");
    dir.close().unwrap();
    assert!(!wal.exists(), "close folds the log into the database");
    let dir = file(&path, DirectoryConfig::default());
    assert_eq!(dir.status().unwrap().published_generations, 3_000);
}

#[test]
fn a_slow_disk_does_not_let_the_write_ahead_log_outgrow_its_bound() {
    // Every sync takes 20 ms longer: passive checkpoints (a copy and two
    // syncs) end behind the log's end while publications keep appending, so
    // SQLite never restarts the log on its own (before the bound, this grew
    // it to 100 MiB). A commit that leaves more than 8,192 frames (32 MiB)
    // cuts it back.
    let tmp = tempfile::tempdir().unwrap();
    let _slow = crate::crash_record::SlowSyncs::under(tmp.path(), Duration::from_millis(20));
    let path = tmp.path().join("directory.sqlite3");
    let config = DirectoryConfig {
        vfs: Some(crate::crash_record::VFS_NAME.to_string()),
        ..config(100_000, 128)
    };
    let dir = file(&path, config);
    let wal = tmp.path().join("directory.sqlite3-wal");
    let mut largest = 0;
    publish_many(&dir, "s", || {
        largest = largest.max(std::fs::metadata(&wal).map_or(0, |m| m.len()));
    });
    assert!(
        largest <= 40 << 20,
        "write-ahead log grew to {largest} bytes"
    );
    dir.close().unwrap();
    let dir = file(&path, DirectoryConfig::default());
    assert_eq!(dir.status().unwrap().published_generations, 3_000);
}

#[test]
fn token_roots_are_found_exactly_as_their_prefix_roots() {
    let ns = "recurrent-sha256-v1:roots";
    let dir = memory();
    // Chunks of 4 tokens: published prefixes end inside several roots.
    let tokens: Vec<u32> = (1..=23).collect();
    let roots = TokenRoots::build(ns, tokens.clone(), 4).unwrap();
    for n in [2u64, 4, 7, 13, 16] {
        let p = roots.prefix(n).unwrap();
        publish(&dir, &manifest(&format!("p{n}"), p, 1, payload("r")));
    }
    for len in [1usize, 3, 4, 5, 9, 13, 15, 16, 17, 23] {
        let query = TokenRoots::build(ns, tokens[..len].to_vec(), 4).unwrap();
        let by_roots = dir.find_roots(&query).unwrap();
        let by_prefixes = dir.find(&query.roots()).unwrap();
        assert_eq!(by_roots, by_prefixes, "query of {len} tokens");
        let refs: Vec<&lmcache_rc_core::Prefix> = Vec::new();
        assert_eq!(dir.find(&refs).unwrap(), None);
        for below in [0u64, 5, 14, 40] {
            assert_eq!(
                dir.ancestors_roots(&query, below).unwrap(),
                dir.ancestors(&query.roots(), below).unwrap(),
                "ancestors of {len} tokens below {below}"
            );
        }
    }
    let hit = dir
        .find_roots(&TokenRoots::build(ns, tokens.clone(), 4).unwrap())
        .unwrap();
    assert_eq!(hit.unwrap().generation(), "p16");
    let empty = TokenRoots::build(ns, Vec::new(), 4).unwrap();
    assert_eq!(dir.find_roots(&empty).unwrap(), None);
}

/// Eight threads publish into one directory under entry and byte capacity,
/// with exact prefixes shared across threads (so replacements cross threads)
/// while the directory batches concurrent publications into shared
/// transactions: every rule still holds as if each had its own.
#[test]
fn concurrent_publications_keep_every_rule_when_they_share_transactions() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let config = DirectoryConfig {
        max_entries: 40,
        max_bytes: Some(35 * 16),
        max_pending: 1024,
        ..DirectoryConfig::default()
    };
    let dir = file(&path, config.clone());
    let results: Vec<(String, lmcache_rc_core::index::Publication)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8u32)
            .map(|t| {
                let dir = &dir;
                s.spawn(move || {
                    let mut out = Vec::new();
                    for i in 0..60u32 {
                        let g = format!("t{t}-{i:02}");
                        let tail = [i % 10 + 1, t % 2 + 1];
                        let m = manifest(&g, prefix(&tail), 2, payload2("k", 8, 1));
                        assert!(dir.begin(&m).unwrap());
                        for rank in [1, 0] {
                            let p = dir.acknowledge(&g, rank).unwrap();
                            out.push((g.clone(), p));
                        }
                        // A later acknowledgement of a published generation.
                        assert!(!dir.acknowledge(&g, 0).unwrap().published);
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let published: BTreeSet<String> = results
        .iter()
        .filter(|(_, p)| p.published)
        .map(|(g, _)| g.clone())
        .collect();
    assert_eq!(
        results.iter().filter(|(_, p)| p.published).count(),
        480,
        "exactly one publishing acknowledgement per generation"
    );
    assert_eq!(published.len(), 480);
    // Every generation that left was reported exactly once, by the
    // publication that replaced or evicted it.
    let mut gone = BTreeSet::new();
    let mut evicted = 0u64;
    for (_, p) in &results {
        for g in p.replaced.iter().chain(&p.evicted) {
            assert!(
                published.contains(g),
                "{g} reported gone but never published"
            );
            assert!(gone.insert(g.clone()), "{g} reported gone twice");
        }
        assert!(p.published || (p.replaced.is_none() && p.evicted.is_empty()));
        evicted += p.evicted.len() as u64;
    }
    let listed: BTreeSet<String> = published.difference(&gone).cloned().collect();
    assert_eq!(names(&dir).0, listed);
    let s = dir.status().unwrap();
    assert_eq!(s.published_generations, listed.len() as u64);
    assert!(s.published_generations <= 35, "byte capacity holds");
    assert_eq!(s.published_bytes, 16 * listed.len() as u64);
    assert_eq!((s.pending_generations, s.evictions), (0, evicted));
    assert!((1..=480).contains(&s.publish_transactions));
    eprintln!(
        "480 concurrent publications in {} transactions",
        s.publish_transactions
    );
    for g in &listed {
        let m = dir.get(g).unwrap().unwrap();
        assert_eq!(dir.find(std::slice::from_ref(m.prefix())).unwrap(), Some(m));
    }
    dir.close().unwrap();
    let dir = file(&path, config);
    assert_eq!(names(&dir).0, listed);
    assert_eq!(
        sorted(row_generations(&path)),
        sorted(listed.iter().cloned().collect())
    );
    assert_eq!(
        sorted(tail_generations(&path)),
        sorted(listed.into_iter().collect())
    );
}
