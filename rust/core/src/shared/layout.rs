//! The key layout of the shared tier (`docs/design/shared-tier.md` §1).
//!
//! ```text
//! <prefix>/v1/<ns>/m/<bucket>/<tail_len:05>-<tail_hash>-<gen_hash>.manifest
//! <prefix>/v1/<ns>/p/<aa>/<object key>.page
//! ```
//!
//! - `v1`: the object format version; a new format writes under a new
//!   segment and never mixes with this one (gc of `v1` never sees it).
//! - `<ns>`: 32 hex characters (128 bits of a SHA-256) of the identity
//!   namespace. Every
//!   key carries it, so a bucket shared by models or tenants never crosses
//!   them (pages too: their object keys already derive from the namespace,
//!   the segment makes it visible to listings, gc and lifecycle rules).
//! - `<bucket>`: 32 hex characters (128 bits of a SHA-256) naming the prefix's directory bucket
//!   `(start_tokens, prefix_hash)`: one per hash chunk of a token sequence
//!   (the "chunk root"), so a query lists at most one group per root.
//! - `<tail_len>`: the manifest's tail length, zero-padded (listings sort by it).
//! - `<tail_hash>`: 16 hex characters (64 bits of a SHA-256) of the tail tokens; a
//!   query selects from a listing, without fetching, the names whose tail
//!   could equal its own (the fetched manifest is still compared exactly).
//! - `<gen_hash>`: 32 hex characters (128 bits of a SHA-256) of the
//!   generation id (ids may hold any character; the hash is a safe,
//!   fixed-length key segment).
//!
//! Keys are kept short (a manifest key is the prefix plus 135 bytes, a page
//! key the prefix plus 110): S3 allows 1024 bytes, but some S3-compatible
//! servers store keys in file names (s3s-fs, our test server, fits bucket and
//! key in about 160 bytes). Hashes are truncated only where a collision
//! costs a wasted request: every fetched manifest is compared exactly, and a
//! page key is the full 256-bit object key.
//! - `<aa>`: the first byte of the object key in hex (spreads request load
//!   over 256 key ranges).
//!
//! Everything here is pure: names in, names out, no I/O.

use sha2::{Digest, Sha256};

use crate::identity::Prefix;
use crate::store::ObjectKey;

/// The object-format segment of every key.
pub const FORMAT_SEGMENT: &str = "v1";
/// Suffix of manifest object names.
pub const MANIFEST_SUFFIX: &str = ".manifest";
/// Suffix of page object names.
pub const PAGE_SUFFIX: &str = ".page";

const NAMESPACE_DOMAIN: &[u8] = b"lmcache-rc-shared-namespace-v1\0";
const BUCKET_DOMAIN: &[u8] = b"lmcache-rc-shared-bucket-v1\0";
const TAIL_DOMAIN: &[u8] = b"lmcache-rc-shared-tail-v1\0";
const GENERATION_DOMAIN: &[u8] = b"lmcache-rc-shared-generation-v1\0";

/// Bytes of the tail hash kept in names (16 hex characters).
const TAIL_HASH_BYTES: usize = 8;
/// Bytes of the namespace, bucket and generation hashes kept in names.
const NAME_HASH_BYTES: usize = 16;
/// Hex characters of a namespace segment.
pub const NAMESPACE_SEGMENT_CHARS: usize = 2 * NAME_HASH_BYTES;

fn short_hex(digest: &[u8]) -> String {
    hex::encode(digest.get(..NAME_HASH_BYTES).unwrap_or(digest))
}

/// The key segment of a namespace: 32 hex characters.
pub fn namespace_segment(namespace: &str) -> String {
    let mut h = Sha256::new();
    h.update(NAMESPACE_DOMAIN);
    h.update(namespace.as_bytes());
    short_hex(&h.finalize())
}

/// The key segment of a prefix's bucket `(start_tokens, prefix_hash)`.
pub fn bucket_segment(prefix: &Prefix) -> String {
    let mut h = Sha256::new();
    h.update(BUCKET_DOMAIN);
    h.update(prefix.start_tokens().to_le_bytes());
    h.update((prefix.prefix_hash().len() as u64).to_le_bytes());
    h.update(prefix.prefix_hash());
    short_hex(&h.finalize())
}

/// A tail hasher that yields the hash of every requested leading length in
/// one pass (lengths ascending).
pub struct TailHasher<'a> {
    tokens: &'a [u32],
    hasher: Sha256,
    fed: usize,
}

impl<'a> TailHasher<'a> {
    /// A hasher over `tokens`.
    pub fn new(tokens: &'a [u32]) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(TAIL_DOMAIN);
        TailHasher {
            tokens,
            hasher,
            fed: 0,
        }
    }

    /// The name hash of `tokens[..len]`; `None` when `len` is beyond the
    /// tokens or below a length already asked for.
    pub fn hash_of(&mut self, len: usize) -> Option<String> {
        if len > self.tokens.len() || len < self.fed {
            return None;
        }
        for t in self.tokens.get(self.fed..len)? {
            self.hasher.update(t.to_le_bytes());
        }
        self.fed = len;
        let digest = self.hasher.clone().finalize();
        Some(hex::encode(digest.get(..TAIL_HASH_BYTES)?))
    }
}

/// The name hash of a whole tail.
pub fn tail_hash(tail: &[u32]) -> String {
    TailHasher::new(tail)
        .hash_of(tail.len())
        .unwrap_or_default()
}

/// The key segment of a generation id: 32 hex characters.
pub fn generation_segment(generation: &str) -> String {
    let mut h = Sha256::new();
    h.update(GENERATION_DOMAIN);
    h.update(generation.as_bytes());
    short_hex(&h.finalize())
}

/// The keys of one tier root (`<prefix>` of the layout, possibly empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    root: String,
}

/// What a manifest object's name says (checked against its body on read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestName {
    /// The tail length.
    pub tail_len: usize,
    /// 16 hex characters.
    pub tail_hash: String,
    /// 32 hex characters.
    pub generation_hash: String,
}

impl Layout {
    /// The layout under `root` (a `/`-separated object path without leading
    /// or trailing `/`; empty for the store's root).
    pub fn new(root: &str) -> Layout {
        let root = root.trim_matches('/');
        let root = if root.is_empty() {
            FORMAT_SEGMENT.to_string()
        } else {
            format!("{root}/{FORMAT_SEGMENT}")
        };
        Layout { root }
    }

    /// `<prefix>/v1`: everything this tier owns lies under it.
    pub fn root(&self) -> &str {
        &self.root
    }

    /// `<prefix>/v1/<ns>`.
    pub fn namespace_dir(&self, namespace: &str) -> String {
        format!("{}/{}", self.root, namespace_segment(namespace))
    }

    /// `<prefix>/v1/<ns>/m`: every manifest of a namespace.
    pub fn manifests_dir_of_segment(&self, ns_segment: &str) -> String {
        format!("{}/{ns_segment}/m", self.root)
    }

    /// `<prefix>/v1/<ns>/p`: every page of a namespace.
    pub fn pages_dir_of_segment(&self, ns_segment: &str) -> String {
        format!("{}/{ns_segment}/p", self.root)
    }

    /// `<prefix>/v1/<ns>/m/<bucket>`: the manifests of one chunk root.
    pub fn bucket_dir(&self, prefix: &Prefix) -> String {
        format!(
            "{}/m/{}",
            self.namespace_dir(prefix.namespace()),
            bucket_segment(prefix)
        )
    }

    /// The object key of a manifest of `generation` at `prefix`.
    pub fn manifest_key(&self, prefix: &Prefix, generation: &str) -> String {
        format!(
            "{}/{:05}-{}-{}{MANIFEST_SUFFIX}",
            self.bucket_dir(prefix),
            prefix.tail_tokens().len(),
            tail_hash(prefix.tail_tokens()),
            generation_segment(generation)
        )
    }

    /// The object key of a page of `namespace`.
    pub fn page_key(&self, namespace: &str, key: &ObjectKey) -> String {
        self.page_key_of_segment(&namespace_segment(namespace), key)
    }

    /// [`Layout::page_key`] with the namespace segment already computed.
    pub fn page_key_of_segment(&self, ns_segment: &str, key: &ObjectKey) -> String {
        let hex = key.hex();
        let fan = hex.get(..2).unwrap_or("00");
        format!("{}/{ns_segment}/p/{fan}/{hex}{PAGE_SUFFIX}", self.root)
    }
}

/// The last `/`-separated segment of a key.
pub fn file_name(key: &str) -> &str {
    key.rsplit('/').next().unwrap_or(key)
}

fn is_lower_hex(text: &str, len: usize) -> bool {
    text.len() == len && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Parses a manifest object's file name (`None` for anything else).
pub fn parse_manifest_name(name: &str) -> Option<ManifestName> {
    let stem = name.strip_suffix(MANIFEST_SUFFIX)?;
    let mut parts = stem.split('-');
    let len = parts.next()?;
    let tail_hash = parts.next()?;
    let generation_hash = parts.next()?;
    if parts.next().is_some()
        || len.len() != 5
        || !len.bytes().all(|b| b.is_ascii_digit())
        || !is_lower_hex(tail_hash, 2 * TAIL_HASH_BYTES)
        || !is_lower_hex(generation_hash, 2 * NAME_HASH_BYTES)
    {
        return None;
    }
    Some(ManifestName {
        tail_len: len.parse().ok()?,
        tail_hash: tail_hash.to_string(),
        generation_hash: generation_hash.to_string(),
    })
}

/// Parses a page object's file name into its object key.
pub fn parse_page_name(name: &str) -> Option<ObjectKey> {
    ObjectKey::from_hex(name.strip_suffix(PAGE_SUFFIX)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefix(ns: &str, start: u64, tail: Vec<u32>) -> Prefix {
        let hash = if start == 0 { vec![] } else { vec![7u8; 32] };
        Prefix::new(ns, start, hash, tail).unwrap()
    }

    #[test]
    fn manifest_keys_round_trip_their_names() {
        let l = Layout::new("/team/cache/");
        let p = prefix("ns-a", 4096, vec![1, 2, 3]);
        let key = l.manifest_key(&p, "gen/with:odd chars");
        assert!(key.starts_with("team/cache/v1/"), "{key}");
        let name = parse_manifest_name(file_name(&key)).unwrap();
        assert_eq!(name.tail_len, 3);
        assert_eq!(name.tail_hash, tail_hash(&[1, 2, 3]));
        assert_eq!(
            name.generation_hash,
            generation_segment("gen/with:odd chars")
        );
        assert!(key.starts_with(&l.bucket_dir(&p)));
        assert!(parse_manifest_name("00003-zz-yy.manifest").is_none());
        assert!(parse_manifest_name("x.page").is_none());
    }

    #[test]
    fn namespaces_and_buckets_separate_keys() {
        let l = Layout::new("");
        let a = prefix("ns-a", 0, vec![1]);
        let b = prefix("ns-b", 0, vec![1]);
        assert_ne!(l.manifest_key(&a, "g"), l.manifest_key(&b, "g"));
        let k = ObjectKey([0xab; 32]);
        assert_ne!(l.page_key("ns-a", &k), l.page_key("ns-b", &k));
        assert!(l.page_key("ns-a", &k).contains("/p/ab/"));
        assert_eq!(parse_page_name(file_name(&l.page_key("ns-a", &k))), Some(k));
        let c = prefix("ns-a", 4096, vec![1]);
        assert_ne!(bucket_segment(&a), bucket_segment(&c));
    }

    #[test]
    fn keys_stay_short() {
        let l = Layout::new("");
        let p = prefix("ns", 4096, vec![1; 4096]);
        assert_eq!(l.manifest_key(&p, "g").len(), 135);
        assert_eq!(l.page_key("ns", &ObjectKey([1; 32])).len(), 110);
        assert_eq!(namespace_segment("ns").len(), NAMESPACE_SEGMENT_CHARS);
    }

    #[test]
    fn tail_hasher_matches_whole_hashes() {
        let tokens: Vec<u32> = (0..100).collect();
        let mut h = TailHasher::new(&tokens);
        for len in [1, 5, 50, 100] {
            assert_eq!(h.hash_of(len).unwrap(), tail_hash(&tokens[..len]));
        }
        assert!(h.hash_of(10).is_none());
        assert!(h.hash_of(101).is_none());
    }
}
