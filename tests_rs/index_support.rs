//! Fixtures shared by the `index_*` test modules (the reference test fixture of
//! `docs/design/manifests.md#reference-directory-scenarios`: namespace
//! "weights-layout-salt-a", start 4096, prefix hash 32 × 'a', tail (1, 2),
//! world 4, schema-1 payload).
#![allow(dead_code)]

use std::path::Path;

use lmcache_rc_core::index::{Directory, DirectoryConfig, Publication};
use lmcache_rc_core::{ErrorKind, Manifest, Prefix};

pub const NS: &str = "weights-layout-salt-a";
pub const START: u64 = 4096;
pub const WORLD: u32 = 4;

pub fn hash_a() -> Vec<u8> {
    vec![b'a'; 32]
}

/// A prefix in the fixture bucket with the given tail.
pub fn prefix(tail: &[u32]) -> Prefix {
    Prefix::new(NS, START, hash_a(), tail.to_vec()).unwrap()
}

/// A prefix anywhere.
pub fn prefix_at(namespace: &str, start: u64, hash: Vec<u8>, tail: &[u32]) -> Prefix {
    Prefix::new(namespace, start, hash, tail.to_vec()).unwrap()
}

/// A schema-1 payload naming its producer (distinct tags, distinct bytes).
pub fn payload(tag: &str) -> Vec<u8> {
    format!(r#"{{"producer":"{tag}","schema_version":1}}"#).into_bytes()
}

/// A schema-2 payload of one group: `pages` pages of `page_bytes` bytes each.
pub fn payload2(tag: &str, page_bytes: u64, pages: usize) -> Vec<u8> {
    let positions: Vec<String> = (0..pages).map(|p| p.to_string()).collect();
    let keys: Vec<String> = (0..pages)
        .map(|p| format!("\"{:064x}\"", p as u128 + 1))
        .collect();
    format!(
        r#"{{"kind":"{tag}","page_groups":[{{"content_keys":[{}],"name":"g","page_bytes":{page_bytes},"positions":[{}]}}],"schema_version":2}}"#,
        keys.join(","),
        positions.join(",")
    )
    .into_bytes()
}

pub fn manifest(generation: &str, prefix: Prefix, world: u32, payload: Vec<u8>) -> Manifest {
    Manifest::new(generation, prefix, world, payload).unwrap()
}

/// The fixture manifest: tail (1, 2), world 4.
pub fn fixture(generation: &str) -> Manifest {
    manifest(generation, prefix(&[1, 2]), WORLD, payload(generation))
}

pub fn config(max_entries: u64, max_pending: u64) -> DirectoryConfig {
    DirectoryConfig {
        max_entries,
        max_pending,
        ..DirectoryConfig::default()
    }
}

pub fn memory() -> Directory {
    Directory::open(None, DirectoryConfig::default()).unwrap()
}

pub fn file(path: &Path, config: DirectoryConfig) -> Directory {
    Directory::open(Some(path), config).unwrap()
}

/// Begins and acknowledges every rank; returns the publishing acknowledgement.
pub fn publish(dir: &Directory, m: &Manifest) -> Publication {
    assert!(dir.begin(m).unwrap(), "begin {}", m.generation());
    let mut last = Publication::default();
    for rank in 0..m.world_size() {
        last = dir.acknowledge(m.generation(), rank).unwrap();
        assert_eq!(
            last.published,
            rank + 1 == m.world_size(),
            "ack {rank} of {}",
            m.generation()
        );
    }
    last
}

/// Generation found for the queries (None when nothing matches).
pub fn found(dir: &Directory, queries: &[Prefix]) -> Option<String> {
    dir.find(queries)
        .unwrap()
        .map(|m| m.generation().to_owned())
}

/// Asserts an error of a kind whose message contains `fragment`.
pub fn assert_err<T: std::fmt::Debug>(
    result: lmcache_rc_core::Result<T>,
    kind: ErrorKind,
    fragment: &str,
) {
    match result {
        Ok(v) => panic!("expected {kind} error containing {fragment:?}, got Ok({v:?})"),
        Err(e) => {
            assert_eq!(e.kind(), kind, "{e}");
            assert!(e.to_string().contains(fragment), "{e:?} lacks {fragment:?}");
        }
    }
}

/// Generations in `checkpoint_tails` of a file database, sorted.
pub fn tail_generations(path: &Path) -> Vec<String> {
    let conn = rusqlite::Connection::open(path).unwrap();
    let mut stmt = conn
        .prepare("SELECT generation FROM checkpoint_tails ORDER BY generation")
        .unwrap();
    stmt.query_map([], |r| r.get(0))
        .unwrap()
        .map(|r| r.unwrap())
        .collect()
}

/// Generations in `checkpoints` of a file database, sorted.
pub fn row_generations(path: &Path) -> Vec<String> {
    let conn = rusqlite::Connection::open(path).unwrap();
    let mut stmt = conn
        .prepare("SELECT generation FROM checkpoints ORDER BY generation")
        .unwrap();
    stmt.query_map([], |r| r.get(0))
        .unwrap()
        .map(|r| r.unwrap())
        .collect()
}

/// `generation → access_order` as stored on disk (read by a second connection).
pub fn stored_access_order(path: &Path) -> Vec<(String, i64)> {
    let conn = rusqlite::Connection::open(path).unwrap();
    let mut stmt = conn
        .prepare("SELECT generation, access_order FROM checkpoints ORDER BY generation")
        .unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(|r| r.unwrap())
        .collect()
}

pub fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

pub fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}
