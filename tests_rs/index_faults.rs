//! Database failures injected with SQLite triggers (installed through a second
//! connection): a failed publication publishes nothing, keeps the generation
//! pending with its ranks and keeps the replaced generation visible; a failed
//! invalidation removes nothing; the directory keeps working afterwards.

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::index::DirectoryConfig;

use crate::index_support::*;

fn sql(path: &std::path::Path, statements: &str) {
    rusqlite::Connection::open(path)
        .unwrap()
        .execute_batch(statements)
        .unwrap();
}

#[test]
fn a_failed_publication_publishes_nothing_and_stays_pending() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let dir = file(&path, config(2, 128));
    publish(&dir, &fixture("old"));
    publish(&dir, &manifest("other", prefix(&[8]), 1, payload("o")));
    assert_eq!(found(&dir, &[prefix(&[1, 2])]).as_deref(), Some("old"));
    sql(
        &path,
        "CREATE TRIGGER inject AFTER INSERT ON checkpoint_tails WHEN NEW.generation = 'new'
         BEGIN SELECT RAISE(ABORT, 'injected failure'); END;",
    );
    let new = fixture("new");
    assert!(dir.begin(&new).unwrap());
    for rank in 0..WORLD - 1 {
        assert!(!dir.acknowledge("new", rank).unwrap().published);
    }
    assert_err(
        dir.acknowledge("new", WORLD - 1),
        ErrorKind::Database,
        "injected failure",
    );
    // Nothing changed: the old generation (deleted as replaced inside the
    // rolled-back transaction) is still listed and found; "new" is pending.
    assert!(dir.is_pending(&new).unwrap());
    assert_eq!(found(&dir, &[prefix(&[1, 2])]).as_deref(), Some("old"));
    assert!(dir.get("new").unwrap().is_none());
    let s = dir.status().unwrap();
    assert_eq!((s.published_generations, s.pending_generations), (2, 1));
    assert_eq!(sorted(row_generations(&path)), strings(&["old", "other"]));
    assert_eq!(sorted(tail_generations(&path)), strings(&["old", "other"]));
    // Once the fault is gone, acknowledging any rank again publishes.
    sql(&path, "DROP TRIGGER inject;");
    let p = dir.acknowledge("new", 0).unwrap();
    assert!(p.published);
    assert_eq!(p.replaced.as_deref(), Some("old"));
    assert!(p.evicted.is_empty());
    assert_eq!(found(&dir, &[prefix(&[1, 2])]).as_deref(), Some("new"));
    assert_eq!(dir.pending_count().unwrap(), 0);
}

#[test]
fn a_failed_invalidation_removes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let dir = file(&path, DirectoryConfig::default());
    publish(&dir, &fixture("g"));
    publish(&dir, &manifest("h", prefix(&[5]), 1, payload("h")));
    sql(
        &path,
        "CREATE TRIGGER inject BEFORE DELETE ON checkpoint_tails WHEN OLD.generation = 'h'
         BEGIN SELECT RAISE(ABORT, 'injected failure'); END;",
    );
    assert_err(
        dir.retire(&strings(&["g", "h"])),
        ErrorKind::Database,
        "injected failure",
    );
    assert_eq!(found(&dir, &[prefix(&[1, 2])]).as_deref(), Some("g"));
    assert_eq!(found(&dir, &[prefix(&[5])]).as_deref(), Some("h"));
    assert_eq!(dir.status().unwrap().published_generations, 2);
    assert_eq!(sorted(row_generations(&path)), strings(&["g", "h"]));
    sql(&path, "DROP TRIGGER inject;");
    assert_eq!(
        dir.retire(&strings(&["g", "h"])).unwrap(),
        strings(&["g", "h"])
    );
    assert_eq!(dir.status().unwrap().published_generations, 0);
}
