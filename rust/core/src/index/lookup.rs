//! The in-memory lookup accelerator over published rows.
//!
//! For every published row (keyed by the `checkpoints` rowid) it keeps a
//! fingerprint of its bucket `(namespace, start_tokens, prefix_hash)`, its tail
//! length and tail hash, its payload bytes and durability. Lookups probe:
//!
//! 1. the bucket's sorted list of stored tail lengths (only lengths that exist
//!    are considered, and only those that could beat the best match so far);
//! 2. for each such length `n`, longest first, the fingerprint of
//!    `(bucket, n, tail_hash(query_tail[..n]))`, which yields the candidate
//!    rowids (normally exactly one);
//! 3. each candidate row is read by rowid from SQLite and confirmed by exact
//!    comparison of namespace, start, prefix hash and tail.
//!
//! Fingerprints only pre-select: a collision costs one extra row read and can
//! never produce a wrong answer. Nothing here is persistent; it is rebuilt from
//! `checkpoint_tails` at open and changed only after the SQLite transaction
//! that made the change has committed.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use xxhash_rust::xxh3::{Xxh3, xxh3_64};

/// A hasher for keys that are already well mixed (or small integers).
#[derive(Default)]
pub(super) struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        // splitmix64 finaliser: rowids are sequential, fingerprints random.
        let mut z = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        self.0 = z ^ (z >> 31);
    }
    fn write_i64(&mut self, n: i64) {
        self.write_u64(n as u64);
    }
}

/// A hash map keyed by integers or fingerprints.
pub(super) type Map<K, V> = HashMap<K, V, BuildHasherDefault<MixHasher>>;

/// Fingerprint of a bucket `(namespace, start_tokens, prefix_hash)`.
pub(super) fn bucket_fp(namespace: &[u8], start_tokens: u64, prefix_hash: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(&(namespace.len() as u64).to_le_bytes());
    h.update(namespace);
    h.update(&start_tokens.to_le_bytes());
    h.update(&(prefix_hash.len() as u64).to_le_bytes());
    h.update(prefix_hash);
    h.digest()
}

/// Fingerprint of one stored tail inside a bucket.
pub(super) fn entry_fp(bucket: u64, tail_len: u32, tail_hash: u64) -> u64 {
    let mut buf = [0u8; 20];
    buf[..8].copy_from_slice(&bucket.to_le_bytes());
    buf[8..12].copy_from_slice(&tail_len.to_le_bytes());
    buf[12..].copy_from_slice(&tail_hash.to_le_bytes());
    xxh3_64(&buf)
}

/// What the accelerator knows about one published row.
#[derive(Debug, Clone, Copy)]
pub(super) struct Entry {
    pub bucket: u64,
    pub fp: u64,
    pub tail_len: u32,
    pub payload_bytes: u64,
    pub durable: bool,
}

/// Rowids sharing one fingerprint (almost always one).
#[derive(Debug)]
enum Rows {
    One(i64),
    Many(Vec<i64>),
}

impl Rows {
    fn as_slice(&self) -> &[i64] {
        match self {
            Rows::One(r) => std::slice::from_ref(r),
            Rows::Many(v) => v,
        }
    }
}

/// The accelerator; see the module docs.
#[derive(Debug, Default)]
pub(super) struct Lookup {
    entries: Map<i64, Entry>,
    by_fp: Map<u64, Rows>,
    /// Per bucket: `(tail_len, rows with that length)`, sorted by length.
    buckets: Map<u64, Vec<(u32, u32)>>,
    bytes: u64,
    durable: u64,
}

impl Lookup {
    /// Number of published rows.
    pub fn len(&self) -> u64 {
        self.entries.len() as u64
    }
    /// Sum of the rows' payload bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// Number of rows marked durable.
    pub fn durable(&self) -> u64 {
        self.durable
    }
    /// The entry of a rowid.
    pub fn get(&self, rowid: i64) -> Option<&Entry> {
        self.entries.get(&rowid)
    }

    /// Adds a row (replacing any previous entry of the same rowid).
    pub fn insert(&mut self, rowid: i64, entry: Entry) {
        self.remove(rowid);
        self.bytes = self.bytes.saturating_add(entry.payload_bytes);
        self.durable += u64::from(entry.durable);
        match self.by_fp.get_mut(&entry.fp) {
            None => {
                self.by_fp.insert(entry.fp, Rows::One(rowid));
            }
            Some(rows) => {
                let mut v = rows.as_slice().to_vec();
                v.push(rowid);
                *rows = Rows::Many(v);
            }
        }
        let lens = self.buckets.entry(entry.bucket).or_default();
        match lens.binary_search_by_key(&entry.tail_len, |&(l, _)| l) {
            Ok(i) => lens[i].1 += 1,
            Err(i) => lens.insert(i, (entry.tail_len, 1)),
        }
        self.entries.insert(rowid, entry);
    }

    /// Removes a row; returns its entry.
    pub fn remove(&mut self, rowid: i64) -> Option<Entry> {
        let entry = self.entries.remove(&rowid)?;
        self.bytes = self.bytes.saturating_sub(entry.payload_bytes);
        self.durable -= u64::from(entry.durable);
        if let Some(rows) = self.by_fp.get_mut(&entry.fp) {
            let rest: Vec<i64> = rows
                .as_slice()
                .iter()
                .copied()
                .filter(|&r| r != rowid)
                .collect();
            match rest.as_slice() {
                [] => {
                    self.by_fp.remove(&entry.fp);
                }
                [one] => *rows = Rows::One(*one),
                _ => *rows = Rows::Many(rest),
            }
        }
        if let Some(lens) = self.buckets.get_mut(&entry.bucket) {
            if let Ok(i) = lens.binary_search_by_key(&entry.tail_len, |&(l, _)| l) {
                lens[i].1 -= 1;
                if lens[i].1 == 0 {
                    lens.remove(i);
                }
            }
            if lens.is_empty() {
                self.buckets.remove(&entry.bucket);
            }
        }
        Some(entry)
    }

    /// Marks a row durable or not; false when the row is unknown.
    pub fn set_durable(&mut self, rowid: i64, durable: bool) -> bool {
        let Some(entry) = self.entries.get_mut(&rowid) else {
            return false;
        };
        if entry.durable != durable {
            entry.durable = durable;
            if durable {
                self.durable += 1;
            } else {
                self.durable -= 1;
            }
        }
        true
    }

    /// Stored tail lengths of a bucket within `min..=max`, ascending.
    pub fn lengths(&self, bucket: u64, min: u32, max: u32) -> &[(u32, u32)] {
        let Some(lens) = self.buckets.get(&bucket) else {
            return &[];
        };
        if min > max {
            return &[];
        }
        let lo = lens.partition_point(|&(l, _)| l < min);
        let hi = lens.partition_point(|&(l, _)| l <= max);
        &lens[lo..hi]
    }

    /// Rowids whose fingerprint is `fp`.
    pub fn rows(&self, fp: u64) -> &[i64] {
        self.by_fp.get(&fp).map_or(&[], Rows::as_slice)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(bucket: u64, len: u32, hash: u64, bytes: u64) -> Entry {
        Entry {
            bucket,
            fp: entry_fp(bucket, len, hash),
            tail_len: len,
            payload_bytes: bytes,
            durable: false,
        }
    }

    #[test]
    fn insert_and_remove_keep_counts_and_lengths_consistent() {
        let mut l = Lookup::default();
        l.insert(1, entry(7, 2, 99, 10));
        l.insert(2, entry(7, 2, 99, 5)); // same fingerprint: a collision
        l.insert(3, entry(7, 5, 1, 1));
        assert_eq!(l.len(), 3);
        assert_eq!(l.bytes(), 16);
        assert_eq!(l.rows(entry_fp(7, 2, 99)), &[1, 2]);
        assert_eq!(l.lengths(7, 1, 10), &[(2, 2), (5, 1)]);
        assert_eq!(l.lengths(7, 3, 10), &[(5, 1)]);
        assert_eq!(l.lengths(7, 3, 4), &[]);
        assert!(l.set_durable(3, true));
        assert_eq!(l.durable(), 1);
        assert!(l.remove(1).is_some());
        assert_eq!(l.rows(entry_fp(7, 2, 99)), &[2]);
        assert!(l.remove(2).is_some());
        assert!(l.remove(3).is_some());
        assert_eq!((l.len(), l.bytes(), l.durable()), (0, 0, 0));
        assert!(l.buckets.is_empty() && l.by_fp.is_empty());
        assert!(l.remove(3).is_none());
    }
}
