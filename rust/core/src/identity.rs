//! Checkpoint identity: namespaces, token roots, exact-boundary prefixes, page
//! content keys and generation ids (`docs/design/identity.md`).
//!
//! Every function here is pure and deterministic; its outputs are wire and disk
//! formats, pinned byte-for-byte by `vectors/identity-v1.json`
//! (`docs/design/identity.md#golden-vectors`). Nothing
//! here knows about storage, time, addresses or ranks.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::json::{self, Value};

/// Output prefix of a namespace.
pub const NAMESPACE_PREFIX: &str = "recurrent-sha256-v1:";
/// Seed of the token-root chain (followed by `u32_le(chunk_tokens)`).
pub const ROOT_CHAIN_SEED: &[u8] = b"lmcache-recurrent-token-roots-v1\0";
/// Domain of prefix-object content digests.
pub const CONTENT_DOMAIN: &[u8] = b"lmcache-recurrent-content-v1\0";
/// Domain of generation digests.
pub const GENERATION_DOMAIN: &[u8] = b"lmcache-recurrent-generation-v1\0";
/// Output prefix of a generation id.
pub const GENERATION_PREFIX: &str = "recurrent-content-v1:";
/// Domain of roots-based page keys.
pub const PAGE_DOMAIN: &[u8] = b"lmcache-recurrent-page-v1\0";
/// Discriminator of the prefix digest inside generation ids.
pub const MANIFEST_DISCRIMINATOR: &str = "manifest";

/// Default tokens per hash chunk (part of the wire format).
pub const DEFAULT_CHUNK_TOKENS: u32 = 4096;
/// Largest accepted chunk size.
pub const MAX_CHUNK_TOKENS: u32 = 65_536;
/// Largest tail a prefix may carry.
pub const MAX_TAIL_TOKENS: usize = 65_536;
/// Token ids are in `[0, TOKEN_LIMIT)`.
pub const TOKEN_LIMIT: u32 = 1 << 31;
/// Namespaces have 1..=256 characters.
pub const MAX_NAMESPACE_CHARS: usize = 256;
/// Identity keys that must be present.
pub const REQUIRED_IDENTITY_KEYS: [&str; 5] = [
    "target_revision",
    "draft_revision",
    "source_revision",
    "layout",
    "parallel",
];

const MSG_NAMESPACE: &str = "checkpoint namespace must contain 1..256 characters";
const MSG_EMPTY_TAIL: &str = "checkpoint prefix requires a nonempty token tail";
const MSG_WIRE: &str = "checkpoint token tail exceeds the wire limits";
const MSG_DIGEST: &str = "a nonempty hashed prefix requires a 32-byte digest";
const MSG_HASH_UNIT: &str = "Checkpoint hash unit must be in 1..65536";
const MSG_BOUNDARY: &str = "Checkpoint boundary is outside the token sequence";
const MSG_IMMUTABLE: &str = "Checkpoint identity requires immutable weights, source and layout";

/// A SHA-256 digest.
pub type Digest32 = [u8; 32];

/// Views tokens as the little-endian `u32` bytes that are hashed.
fn token_bytes(tokens: &[u32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(tokens))
    } else {
        Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
    }
}

/// Lowercase hex of bytes.
pub fn to_hex(bytes: &[u8]) -> String {
    hex::encode(bytes)
}

/// Checks a namespace's length (1..=256 code points).
pub fn validate_namespace(namespace: &str) -> Result<()> {
    let n = namespace.chars().count();
    if n == 0 || n > MAX_NAMESPACE_CHARS {
        return Err(Error::invalid(MSG_NAMESPACE));
    }
    Ok(())
}

/// `recurrent-sha256-v1:` + hex SHA-256 of the canonical identity document.
///
/// `identity` must be an object holding the five required keys; all but
/// `draft_revision` must be truthy. `cache_salt` is hashed as given (the empty
/// string is a distinct, valid salt).
pub fn checkpoint_namespace(identity: &Value, cache_salt: &Value) -> Result<String> {
    let Value::Object(fields) = identity else {
        return Err(Error::InvalidType(
            "checkpoint identity must be a mapping with string keys".into(),
        ));
    };
    for key in REQUIRED_IDENTITY_KEYS {
        match fields.get(key) {
            None => return Err(Error::invalid(format!("{MSG_IMMUTABLE} (missing {key:?})"))),
            Some(v) if key != "draft_revision" && !v.is_truthy() => {
                return Err(Error::invalid(format!("{MSG_IMMUTABLE} (empty {key:?})")));
            }
            Some(_) => {}
        }
    }
    let mut doc = BTreeMap::new();
    doc.insert("cache_salt".to_string(), cache_salt.clone());
    doc.insert("identity".to_string(), identity.clone());
    doc.insert("schema_version".to_string(), Value::Int(1));
    let text = Value::Object(doc).to_canonical_ascii();
    Ok(format!(
        "{NAMESPACE_PREFIX}{}",
        to_hex(&Sha256::digest(text.as_bytes()))
    ))
}

/// The persistent key of a checkpoint: `prefix_hash` authenticates the first
/// `start_tokens` tokens, `tail_tokens` are the literal remaining tokens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Prefix {
    namespace: String,
    start_tokens: u64,
    prefix_hash: Vec<u8>,
    tail_tokens: Vec<u32>,
}

impl Prefix {
    /// Validates and builds a prefix (`docs/design/identity.md#tokens-and-prefixes`;
    /// the first failing rule wins).
    pub fn new(
        namespace: impl Into<String>,
        start_tokens: u64,
        prefix_hash: Vec<u8>,
        tail_tokens: Vec<u32>,
    ) -> Result<Prefix> {
        let namespace = namespace.into();
        validate_namespace(&namespace)?;
        if tail_tokens.is_empty() {
            return Err(Error::invalid(MSG_EMPTY_TAIL));
        }
        validate_tail(&tail_tokens)?;
        if !(prefix_hash.is_empty() || prefix_hash.len() == 32)
            || (prefix_hash.is_empty() && start_tokens > 0)
        {
            return Err(Error::invalid(MSG_DIGEST));
        }
        if start_tokens.checked_add(tail_tokens.len() as u64).is_none()
            || start_tokens > i64::MAX as u64 - MAX_TAIL_TOKENS as u64
        {
            return Err(Error::invalid(
                "checkpoint prefix start_tokens exceeds the wire limits",
            ));
        }
        Ok(Prefix {
            namespace,
            start_tokens,
            prefix_hash,
            tail_tokens,
        })
    }

    /// The namespace this prefix lives in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
    /// Tokens authenticated by [`Prefix::prefix_hash`].
    pub fn start_tokens(&self) -> u64 {
        self.start_tokens
    }
    /// 0 or 32 bytes.
    pub fn prefix_hash(&self) -> &[u8] {
        &self.prefix_hash
    }
    /// The literal tokens after `start_tokens`.
    pub fn tail_tokens(&self) -> &[u32] {
        &self.tail_tokens
    }
    /// `start_tokens + len(tail_tokens)`.
    pub fn num_tokens(&self) -> u64 {
        self.start_tokens + self.tail_tokens.len() as u64
    }

    /// Canonical JSON of the prefix object (ASCII-escaped, sorted keys).
    fn canonical_json(&self) -> String {
        let mut out =
            String::with_capacity(64 + self.namespace.len() + 11 * self.tail_tokens.len());
        out.push_str("{\"namespace\":");
        json::write_string(&mut out, &self.namespace, true);
        out.push_str(",\"prefix_hash\":\"");
        out.push_str(&to_hex(&self.prefix_hash));
        let _ = write!(
            out,
            "\",\"start_tokens\":{},\"tail_tokens\":[",
            self.start_tokens
        );
        for (i, t) in self.tail_tokens.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let _ = write!(out, "{t}");
        }
        out.push_str("]}");
        out
    }

    /// Raw digest of the scheme-(b) content key of this prefix
    /// (`docs/design/identity.md#page-content-keys`, scheme (b)).
    pub fn content_digest(&self, discriminator: &str) -> Digest32 {
        let mut h = Sha256::new();
        h.update(CONTENT_DOMAIN);
        h.update(discriminator.as_bytes());
        h.update(b"\0");
        h.update(self.canonical_json().as_bytes());
        h.finalize().into()
    }

    /// Scheme-(b) page content key: 64 lowercase hex characters.
    pub fn content_key(&self, discriminator: &str) -> String {
        to_hex(&self.content_digest(discriminator))
    }

    /// True when `self`'s tail is a whole-token prefix of `query`'s tail in the same bucket.
    pub fn is_prefix_of(&self, query: &Prefix) -> bool {
        self.same_bucket(query) && query.tail_tokens.starts_with(&self.tail_tokens)
    }

    /// True when both prefixes share namespace, start and prefix hash.
    pub fn same_bucket(&self, other: &Prefix) -> bool {
        self.start_tokens == other.start_tokens
            && self.prefix_hash == other.prefix_hash
            && self.namespace == other.namespace
    }
}

/// Checks tail length and token range.
fn validate_tail(tail: &[u32]) -> Result<()> {
    // OR-fold instead of `any` so the scan vectorises (no early exit needed:
    // valid input is the common case and must stay cheap next to SHA-256).
    let high_bits = tail.iter().fold(0u32, |acc, &t| acc | t);
    if tail.len() > MAX_TAIL_TOKENS || high_bits >= TOKEN_LIMIT {
        return Err(Error::invalid(MSG_WIRE));
    }
    Ok(())
}

/// Generation id of a manifest: content-derived from the exact prefix and the
/// exact payload bytes (`docs/design/identity.md#generation-ids`). 85 characters.
pub fn checkpoint_generation(prefix: &Prefix, payload: &[u8]) -> String {
    let prefix_digest = prefix.content_digest(MANIFEST_DISCRIMINATOR);
    let mut h = Sha256::new();
    h.update(GENERATION_DOMAIN);
    h.update(prefix_digest);
    h.update(b"\0");
    h.update(payload);
    format!("{GENERATION_PREFIX}{}", to_hex(&h.finalize()))
}

/// One query root per hash chunk of a token sequence (`docs/design/identity.md#token-roots`).
///
/// Holds the tokens once and the chain digests; roots and prefixes are cut
/// from them on demand, so a million-token sequence costs one copy plus
/// 32 bytes per chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRoots {
    namespace: String,
    chunk_tokens: u32,
    tokens: Vec<u32>,
    /// `chains[k]` authenticates the first `k * chunk_tokens` tokens;
    /// `chains[k + 1]` is root k's end hash. Length = roots + 1.
    chains: Vec<Digest32>,
}

impl TokenRoots {
    /// Hashes `tokens` into chained roots. Errors are raised at the first
    /// offending chunk; an empty sequence has no roots (and no namespace check).
    pub fn build(
        namespace: impl Into<String>,
        tokens: Vec<u32>,
        chunk_tokens: u32,
    ) -> Result<Self> {
        let namespace = namespace.into();
        if chunk_tokens == 0 || chunk_tokens > MAX_CHUNK_TOKENS {
            return Err(Error::invalid(MSG_HASH_UNIT));
        }
        let mut seed = Sha256::new();
        seed.update(ROOT_CHAIN_SEED);
        seed.update(chunk_tokens.to_le_bytes());
        let mut chain: Digest32 = seed.finalize().into();
        let chunk = chunk_tokens as usize;
        let mut chains = Vec::with_capacity(tokens.len().div_ceil(chunk) + 1);
        chains.push(chain);
        if !tokens.is_empty() {
            validate_namespace(&namespace)?;
        }
        for tail in tokens.chunks(chunk) {
            validate_tail(tail)?;
            let mut h = Sha256::new();
            h.update(chain);
            h.update(&*token_bytes(tail));
            chain = h.finalize().into();
            chains.push(chain);
        }
        Ok(TokenRoots {
            namespace,
            chunk_tokens,
            tokens,
            chains,
        })
    }

    /// The namespace of every root.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
    /// Tokens per hash chunk.
    pub fn chunk_tokens(&self) -> u32 {
        self.chunk_tokens
    }
    /// The whole token sequence.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    /// True when there are no tokens (and so no roots).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    /// Number of roots (chunks).
    pub fn num_roots(&self) -> usize {
        self.chains.len() - 1
    }
    /// The 32-byte seed of the chain (prefix hash of root 0).
    pub fn initial_chain(&self) -> &Digest32 {
        &self.chains[0]
    }
    /// End hash of each root: authenticates the first `min((k+1)*C, len)` tokens.
    pub fn end_hashes(&self) -> &[Digest32] {
        &self.chains[1..]
    }

    fn root_span(&self, k: usize) -> (usize, usize) {
        let c = self.chunk_tokens as usize;
        (k * c, ((k + 1) * c).min(self.tokens.len()))
    }

    fn root_with_tail(&self, k: usize, end: usize) -> Prefix {
        let (start, _) = self.root_span(k);
        // Every part was validated by `build`, so construct directly.
        Prefix {
            namespace: self.namespace.clone(),
            start_tokens: start as u64,
            prefix_hash: self.chains[k].to_vec(),
            tail_tokens: self.tokens[start..end].to_vec(),
        }
    }

    /// Root `k`: the chunk's whole tail.
    pub fn root(&self, k: usize) -> Option<Prefix> {
        (k < self.num_roots()).then(|| self.root_with_tail(k, self.root_span(k).1))
    }

    /// All roots, one per chunk.
    pub fn roots(&self) -> Vec<Prefix> {
        (0..self.num_roots()).filter_map(|k| self.root(k)).collect()
    }

    /// Chunk index and validated boundary for `n` in `1..=len`.
    fn boundary(&self, n: u64) -> Result<(usize, usize)> {
        if n == 0 || n > self.tokens.len() as u64 {
            return Err(Error::invalid(MSG_BOUNDARY));
        }
        let n = n as usize;
        Ok(((n - 1) / self.chunk_tokens as usize, n))
    }

    /// The exact-boundary prefix of the first `n` tokens
    /// (`docs/design/identity.md#prefixn-the-key-of-a-checkpoint-of-n-tokens`).
    pub fn prefix(&self, n: u64) -> Result<Prefix> {
        let (k, n) = self.boundary(n)?;
        Ok(self.root_with_tail(k, n))
    }

    /// Digest authenticating exactly the first `n` tokens (used by page keys).
    pub fn token_digest(&self, n: u64) -> Result<Digest32> {
        let (k, n) = self.boundary(n)?;
        let (start, end) = self.root_span(k);
        if n == end {
            return Ok(self.chains[k + 1]);
        }
        let mut h = Sha256::new();
        h.update(self.chains[k]);
        h.update(&*token_bytes(&self.tokens[start..n]));
        Ok(h.finalize().into())
    }

    /// Roots-based page content key at boundary `n` (`docs/design/identity.md#page-content-keys`,
    /// scheme (a)).
    pub fn content_key(&self, n: u64, discriminator: &str) -> Result<String> {
        let digest = self.token_digest(n)?;
        Ok(self.page_key(&digest, n, discriminator))
    }

    /// Page keys for `(boundary, discriminator)` pairs, in order; digests are
    /// computed once per distinct boundary.
    pub fn content_keys<S: AsRef<str>>(&self, boundaries: &[(u64, S)]) -> Result<Vec<String>> {
        let mut cache: BTreeMap<u64, Digest32> = BTreeMap::new();
        boundaries
            .iter()
            .map(|(n, d)| {
                let digest = match cache.get(n) {
                    Some(d) => *d,
                    None => {
                        let d = self.token_digest(*n)?;
                        cache.insert(*n, d);
                        d
                    }
                };
                Ok(self.page_key(&digest, *n, d.as_ref()))
            })
            .collect()
    }

    fn page_key(&self, digest: &Digest32, n: u64, discriminator: &str) -> String {
        let mut text = String::with_capacity(self.namespace.len() + discriminator.len() + 32);
        text.push('[');
        json::write_string(&mut text, &self.namespace, false);
        let _ = write!(text, ",{n},");
        json::write_string(&mut text, discriminator, false);
        text.push(']');
        let mut h = Sha256::new();
        h.update(PAGE_DOMAIN);
        h.update(digest);
        h.update(b"\0");
        h.update(text.as_bytes());
        to_hex(&h.finalize())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_aligned_boundary_keeps_a_full_tail() {
        let roots = TokenRoots::build("ns", (0..8).collect(), 4).unwrap();
        let p = roots.prefix(4).unwrap();
        assert_eq!(p.start_tokens(), 0);
        assert_eq!(p.tail_tokens(), &[0, 1, 2, 3]);
        let p = roots.prefix(5).unwrap();
        assert_eq!(p.start_tokens(), 4);
        assert_eq!(p.tail_tokens(), &[4]);
    }

    #[test]
    fn token_digest_at_chunk_end_equals_end_hash() {
        let roots = TokenRoots::build("ns", (0..10).collect(), 4).unwrap();
        assert_eq!(roots.token_digest(4).unwrap(), roots.end_hashes()[0]);
        assert_eq!(roots.token_digest(10).unwrap(), roots.end_hashes()[2]);
    }

    #[test]
    fn prefix_rules_apply_in_order() {
        let e = Prefix::new("", 0, vec![], vec![]).unwrap_err();
        assert!(e.to_string().contains("namespace"));
        let e = Prefix::new("n", 0, vec![], vec![]).unwrap_err();
        assert!(e.to_string().contains("nonempty token tail"));
        let e = Prefix::new("n", 0, vec![1; 3], vec![TOKEN_LIMIT]).unwrap_err();
        assert!(e.to_string().contains("wire limits"));
        let e = Prefix::new("n", 3, vec![], vec![1]).unwrap_err();
        assert!(e.to_string().contains("32-byte"));
    }
}
