//! Recency (LRU) persistence: batched writes, restart order, flush on close,
//! drop and timer, and eviction by the latest in-memory recency.

use std::time::{Duration, Instant};

use lmcache_rc_core::index::{Directory, DirectoryConfig};

use crate::index_support::*;

fn batched(max_entries: u64, updates: usize, interval: Duration) -> DirectoryConfig {
    DirectoryConfig {
        max_entries,
        recency_flush_updates: updates,
        recency_flush_interval: interval,
        ..DirectoryConfig::default()
    }
}

const HOUR: Duration = Duration::from_secs(3600);

fn publish_n(dir: &Directory, n: u32) {
    for i in 0..n {
        publish(
            dir,
            &manifest(&format!("p{i}"), prefix(&[i]), 1, payload("x")),
        );
    }
}

fn order_of(path: &std::path::Path, generation: &str) -> i64 {
    stored_access_order(path)
        .into_iter()
        .find(|(g, _)| g == generation)
        .map(|(_, o)| o)
        .unwrap()
}

#[test]
fn restart_keeps_published_entries_and_their_lru_order() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    {
        let dir = file(&path, batched(4, 1024, HOUR));
        publish_n(&dir, 4);
        // Refresh p0 then p2: LRU order is now p1, p3, p0, p2.
        assert_eq!(found(&dir, &[prefix(&[0])]).as_deref(), Some("p0"));
        assert_eq!(found(&dir, &[prefix(&[2])]).as_deref(), Some("p2"));
        dir.close().unwrap();
    }
    let dir = file(&path, batched(4, 1024, HOUR));
    assert_eq!(dir.status().unwrap().published_generations, 4);
    let evictions: Vec<Vec<String>> = (4..8u32)
        .map(|i| {
            publish(
                &dir,
                &manifest(&format!("p{i}"), prefix(&[i]), 1, payload("x")),
            )
            .evicted
        })
        .collect();
    assert_eq!(
        evictions,
        vec![
            strings(&["p1"]),
            strings(&["p3"]),
            strings(&["p0"]),
            strings(&["p2"])
        ]
    );
}

#[test]
fn recency_is_written_in_batches_not_per_lookup() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let dir = file(&path, batched(100, 5, HOUR));
    publish_n(&dir, 8);
    let before = stored_access_order(&path);
    for i in 0..4u32 {
        for _ in 0..3 {
            assert!(dir.find(&[prefix(&[i])]).unwrap().is_some());
        }
    }
    // Twelve lookups of four entries: four dirty stamps, nothing written yet.
    assert_eq!(stored_access_order(&path), before);
    assert_eq!(dir.status().unwrap().dirty_recency, 4);
    // The fifth distinct entry fills the batch: all five written at once.
    assert!(dir.find(&[prefix(&[4])]).unwrap().is_some());
    assert_eq!(dir.status().unwrap().dirty_recency, 0);
    let after = stored_access_order(&path);
    for i in 0..5 {
        assert!(
            after[i].1 > before[i].1,
            "{:?} vs {:?}",
            after[i],
            before[i]
        );
    }
    assert_eq!(after[5..], before[5..]);
    // The last refresh of p4 is the newest stamp on disk.
    assert_eq!(
        order_of(&path, "p4"),
        after.iter().map(|(_, o)| *o).max().unwrap()
    );
    // Close writes what is left.
    assert!(dir.find(&[prefix(&[7])]).unwrap().is_some());
    assert_eq!(order_of(&path, "p7"), before[7].1);
    dir.close().unwrap();
    assert!(order_of(&path, "p7") > order_of(&path, "p4"));
}

#[test]
fn drop_flushes_dirty_recency() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let dir = file(&path, batched(100, 1024, HOUR));
    publish_n(&dir, 3);
    let before = order_of(&path, "p0");
    assert!(dir.find(&[prefix(&[0])]).unwrap().is_some());
    assert_eq!(order_of(&path, "p0"), before);
    drop(dir);
    assert!(order_of(&path, "p0") > order_of(&path, "p2"));
}

#[test]
fn flush_recency_writes_every_dirty_stamp() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let dir = file(&path, batched(100, 1024, HOUR));
    publish_n(&dir, 3);
    assert!(dir.find(&[prefix(&[0])]).unwrap().is_some());
    assert!(dir.find(&[prefix(&[1])]).unwrap().is_some());
    assert_eq!(dir.flush_recency().unwrap(), 2);
    assert_eq!(dir.flush_recency().unwrap(), 0);
    assert!(order_of(&path, "p1") > order_of(&path, "p0"));
    assert!(order_of(&path, "p0") > order_of(&path, "p2"));
}

#[test]
fn due_recency_is_written_by_the_timer_without_further_calls() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let dir = file(&path, batched(100, 1024, Duration::from_millis(50)));
    publish_n(&dir, 2);
    let before = order_of(&path, "p0");
    assert!(dir.find(&[prefix(&[0])]).unwrap().is_some());
    let deadline = Instant::now() + Duration::from_secs(10);
    while order_of(&path, "p0") == before {
        assert!(Instant::now() < deadline, "recency never written");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(order_of(&path, "p0") > order_of(&path, "p1"));
}

#[test]
fn eviction_uses_the_latest_in_memory_recency() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let dir = file(&path, batched(3, 1024, HOUR));
    publish_n(&dir, 3);
    let before = stored_access_order(&path);
    assert!(dir.find(&[prefix(&[0])]).unwrap().is_some());
    assert_eq!(
        stored_access_order(&path),
        before,
        "stamp must still be in memory"
    );
    let p = publish(&dir, &manifest("p3", prefix(&[3]), 1, payload("x")));
    assert_eq!(p.evicted, strings(&["p1"]));
    assert_eq!(sorted(row_generations(&path)), strings(&["p0", "p2", "p3"]));
}

#[test]
fn a_crash_loses_at_most_the_unflushed_recency_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let dir = file(&path, batched(100, 1024, HOUR));
    publish_n(&dir, 3);
    assert!(dir.find(&[prefix(&[0])]).unwrap().is_some());
    // Simulate a crash: the process dies without running Drop.
    std::mem::forget(dir);
    let reopened = file(&path, batched(100, 1024, HOUR));
    let listed = reopened.list(None, 10).unwrap().generations;
    assert_eq!(listed.len(), 3);
    // p0's refresh was lost; publication order is what remains.
    assert!(listed[0].access_order < listed[1].access_order);
    assert!(listed[1].access_order < listed[2].access_order);
}
