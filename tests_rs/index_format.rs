//! The directory's on-disk format: helper vectors, version checks, refusal of
//! foreign files, migration of reference files, and bad input that must leave
//! the directory usable.

use std::path::Path;

use lmcache_rc_core::index::{
    Directory, DirectoryConfig, FORMAT_VERSION, tail_hash, tail_prefix_hashes, tail_text,
};
use lmcache_rc_core::{ErrorKind, Manifest};

use crate::common::vectors;
use crate::index_support::*;

#[test]
fn tail_text_and_tail_hashes_match_the_vectors() {
    let helpers = &vectors()["index_helpers"];
    assert_eq!(helpers["tail_hash_base"].as_u64(), Some(1_000_003));
    assert_eq!(
        helpers["tail_hash_modulus"].as_u64(),
        Some((1u64 << 61) - 1)
    );
    let cases = helpers["tails"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for case in cases {
        let tail: Vec<u32> = case["tail"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
            .collect();
        let hashes: Vec<u64> = case["prefix_hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect();
        assert_eq!(tail_text(&tail), case["tail_blob_text"].as_str().unwrap());
        assert_eq!(tail_prefix_hashes(&tail), hashes, "{tail:?}");
        assert_eq!(tail_hash(&tail), *hashes.last().unwrap());
    }
}

fn user_version(path: &Path) -> i64 {
    let conn = rusqlite::Connection::open(path).unwrap();
    conn.query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap()
}

#[test]
fn a_file_directory_uses_wal_and_records_its_format_version() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let dir = file(&path, DirectoryConfig::default());
    publish(&dir, &fixture("g"));
    let conn = rusqlite::Connection::open(&path).unwrap();
    let mode: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
    assert_eq!(user_version(&path), FORMAT_VERSION);
    // The stored tail is the Python default JSON text, as a BLOB.
    let (tail, kind): (Vec<u8>, String) = conn
        .query_row("SELECT tail, typeof(tail) FROM checkpoints", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    assert_eq!((tail.as_slice(), kind.as_str()), (&b"[1, 2]"[..], "blob"));
    let hash: i64 = conn
        .query_row("SELECT tail_hash FROM checkpoint_tails", [], |r| r.get(0))
        .unwrap();
    assert_eq!(hash, 2_000_009);
}

#[test]
fn a_newer_format_version_is_refused_and_the_file_left_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    {
        let dir = file(&path, DirectoryConfig::default());
        publish(&dir, &fixture("g"));
        dir.close().unwrap();
    }
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch("PRAGMA journal_mode=DELETE; PRAGMA user_version = 3;")
            .unwrap();
    }
    let bytes = std::fs::read(&path).unwrap();
    let err = Directory::open(Some(&path), DirectoryConfig::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::UnsupportedFormat);
    let message = err.to_string();
    assert!(message.contains("schema 3"), "{message}");
    assert!(message.contains(&path.display().to_string()), "{message}");
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    assert_eq!(user_version(&path), 3);
}

#[test]
fn a_non_sqlite_file_is_refused_and_left_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for (i, size) in [1usize, 10, 100, 4096, 65_536].into_iter().enumerate() {
        let path = tmp.path().join(format!("garbage-{i}.sqlite3"));
        let bytes: Vec<u8> = (0..size)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 24) as u8
            })
            .collect();
        std::fs::write(&path, &bytes).unwrap();
        let err = Directory::open(Some(&path), DirectoryConfig::default()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::UnsupportedFormat, "{err}");
        assert!(err.to_string().contains("not a SQLite database"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        assert!(!tmp.path().join(format!("garbage-{i}.sqlite3-wal")).exists());
    }
}

#[test]
fn a_corrupt_sqlite_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    {
        let dir = file(&path, DirectoryConfig::default());
        for i in 0..50u32 {
            publish(
                &dir,
                &manifest(&format!("g{i}"), prefix(&[i]), 1, payload("x")),
            );
        }
        dir.close().unwrap();
    }
    // Keep the SQLite header, overwrite every later page with garbage.
    let mut bytes = std::fs::read(&path).unwrap();
    assert!(bytes.len() > 4096);
    for (i, b) in bytes[4096..].iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    std::fs::write(&path, &bytes).unwrap();
    let err = Directory::open(Some(&path), DirectoryConfig::default()).unwrap_err();
    assert!(
        matches!(
            err.kind(),
            ErrorKind::UnsupportedFormat | ErrorKind::Database
        ),
        "{err}"
    );
}

/// A file written by a reference build that knew only `checkpoints`
/// (user_version 0): tail rows and lmcache-rc columns are back-filled.
#[test]
fn a_reference_file_without_lookup_rows_is_backfilled() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let m = manifest("legacy", prefix(&[1, 2]), 2, payload2("legacy", 64, 3));
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "CREATE TABLE checkpoints (namespace TEXT NOT NULL, start_tokens INTEGER NOT NULL,
                prefix_hash BLOB NOT NULL, tail BLOB NOT NULL, num_tokens INTEGER NOT NULL,
                generation TEXT UNIQUE NOT NULL, world_size INTEGER NOT NULL,
                payload BLOB NOT NULL, access_order INTEGER NOT NULL,
                PRIMARY KEY (namespace, start_tokens, prefix_hash, tail));",
        )
        .unwrap();
        conn.execute(
            "INSERT INTO checkpoints VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 41)",
            rusqlite::params![
                NS,
                START as i64,
                hash_a(),
                b"[1, 2]".to_vec(),
                (START + 2) as i64,
                "legacy",
                2,
                m.payload()
            ],
        )
        .unwrap();
    }
    let dir = file(&path, DirectoryConfig::default());
    assert_eq!(user_version(&path), FORMAT_VERSION);
    assert_eq!(dir.find(&[prefix(&[1, 2, 9])]).unwrap(), Some(m.clone()));
    let s = dir.status().unwrap();
    assert_eq!(
        (s.published_generations, s.published_bytes),
        (1, 2 * 3 * 64)
    );
    assert_eq!(tail_generations(&path), strings(&["legacy"]));
    // The recency counter continues after the stored maximum.
    let p = publish(&dir, &manifest("next", prefix(&[7]), 1, payload("n")));
    assert!(p.published);
    let listed = dir.list(None, 10).unwrap().generations;
    let next = listed
        .iter()
        .find(|l| l.manifest.generation() == "next")
        .unwrap();
    assert!(next.access_order > 42);
}

#[test]
fn a_corrupt_stored_row_is_skipped_and_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let dir = file(&path, DirectoryConfig::default());
    publish(&dir, &manifest("short", prefix(&[1]), 1, payload("s")));
    publish(&dir, &manifest("long", prefix(&[1, 2]), 1, payload("l")));
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute(
            "UPDATE checkpoints SET payload = x'7b7d' WHERE generation = 'long'",
            [],
        )
        .unwrap();
    }
    // The corrupt longer row is a clean miss; the shorter one is found.
    assert_eq!(found(&dir, &[prefix(&[1, 2, 3])]).as_deref(), Some("short"));
    assert_eq!(dir.get("long").unwrap(), None);
    let listed = dir.list(None, 10).unwrap().generations;
    assert_eq!(listed.len(), 1);
    let s = dir.status().unwrap();
    assert_eq!(s.invalid_rows, 3);
    assert_eq!(s.published_generations, 2);
    assert!(dir.invalidate("long").unwrap());
}

#[test]
fn the_directory_stays_usable_after_refused_calls() {
    let dir = memory();
    let m = fixture("g");
    assert!(dir.begin(&m).unwrap());
    let changed = manifest("g", prefix(&[1, 2]), WORLD, payload("other"));
    assert_err(
        dir.begin(&changed),
        ErrorKind::GenerationConflict,
        "during store",
    );
    assert_err(dir.acknowledge("g", 77), ErrorKind::InvalidInput, "rank");
    let mixed = [prefix(&[1]), prefix_at("ns-2", 0, vec![], &[1])];
    assert_err(dir.find(&mixed), ErrorKind::InvalidInput, "mix");
    for rank in 0..WORLD {
        dir.acknowledge("g", rank).unwrap();
    }
    assert_err(
        dir.begin(&changed),
        ErrorKind::GenerationConflict,
        "after publication",
    );
    assert_eq!(found(&dir, &[prefix(&[1, 2])]).as_deref(), Some("g"));
    publish(&dir, &manifest("h", prefix(&[5]), 1, payload("h")));
    let s = dir.status().unwrap();
    assert_eq!((s.published_generations, s.pending_generations), (2, 0));
}

#[test]
fn refused_opens_leave_an_existing_directory_intact() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    {
        let dir = file(&path, DirectoryConfig::default());
        publish(&dir, &fixture("g"));
        dir.close().unwrap();
    }
    let bad = DirectoryConfig {
        max_entries: 0,
        ..DirectoryConfig::default()
    };
    assert_err(
        Directory::open(Some(&path), bad),
        ErrorKind::InvalidInput,
        "positive",
    );
    let dir = file(&path, DirectoryConfig::default());
    let got: Option<Manifest> = dir.get("g").unwrap();
    assert_eq!(got, Some(fixture("g")));
}

/// Issue 12, failure 7: a foreign SQLite file (`user_version` 0, unrelated
/// tables) was adopted and rewritten. It is refused and left untouched, and
/// so is a `checkpoints` table that is not ours.
#[test]
fn a_sqlite_file_that_is_not_a_checkpoint_directory_is_refused_untouched() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, sql, why) in [
        (
            "app.sqlite",
            "CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT); \
             INSERT INTO users VALUES (1, 'ann');",
            "tables lmcache-rc does not know: users",
        ),
        (
            "other-checkpoints.sqlite",
            "CREATE TABLE checkpoints (step INTEGER, path TEXT);",
            "lacks the columns",
        ),
    ] {
        let path = tmp.path().join(name);
        {
            let conn = rusqlite::Connection::open(&path).unwrap();
            conn.execute_batch(sql).unwrap();
        }
        let bytes = std::fs::read(&path).unwrap();
        let err = Directory::open(Some(&path), DirectoryConfig::default()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::UnsupportedFormat, "{err}");
        let text = err.to_string();
        assert!(text.contains("not a checkpoint directory"), "{text}");
        assert!(text.contains(why), "{text}");
        assert!(text.contains("--checkpoint-index-path"), "{text}");
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "left untouched");
        assert_eq!(user_version(&path), 0);
        assert!(!tmp.path().join(format!("{name}-wal")).exists());
    }
}

/// Issue 12, failure 7: the index and its WAL and shared-memory files were
/// created with the umask's mode (0644: other users read prompt token ids).
#[test]
fn the_index_and_its_wal_files_are_private_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("index.sqlite");
    // The usual umask (0644 files); the process-wide umask is restored at once.
    let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o022));
    let dir = Directory::open(Some(&path), DirectoryConfig::default());
    rustix::process::umask(old);
    let dir = dir.unwrap();
    publish(&dir, &fixture("g"));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    for suffix in ["", "-wal", "-shm"] {
        let p = tmp.path().join(format!("index.sqlite{suffix}"));
        assert!(p.exists(), "{}", p.display());
        assert_eq!(mode(&p), 0o600, "{}", p.display());
    }
    dir.close().unwrap();
    // An existing file of ours with a wider mode is narrowed at open.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let dir = Directory::open(Some(&path), DirectoryConfig::default()).unwrap();
    assert_eq!(mode(&path), 0o600);
    dir.close().unwrap();
}

/// Issue 12, failure 7: an index reached through a symbolic link is refused
/// (another user could point it at a file of their choice).
#[test]
fn an_index_reached_through_a_symlink_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let real = tmp.path().join("real.sqlite");
    let link = tmp.path().join("link.sqlite");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let err = Directory::open(Some(&link), DirectoryConfig::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("symbolic link"), "{err}");
    assert!(!real.exists(), "nothing created through the link");
}
