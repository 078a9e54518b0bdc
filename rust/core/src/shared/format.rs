//! Object formats of the shared tier, version 1 (`docs/design/shared-tier.md` §2).
//!
//! Both formats start with an 8-byte magic, a `u32` version and a `u32`
//! header length, little-endian, like the L2 object files; a reader checks
//! every field and refuses what it does not understand. Nothing here does
//! I/O, and nothing here panics on any input.
//!
//! # Page object (64-byte header, then the page)
//!
//! | Offset | Size | Field      | Value                                        |
//! |-------:|-----:|------------|----------------------------------------------|
//! | 0      | 8    | magic      | ASCII `LMRCSHPG`                             |
//! | 8      | 4    | version    | `1`                                          |
//! | 12     | 4    | header_len | `64`                                         |
//! | 16     | 8    | page_bytes | length of the page                           |
//! | 24     | 8    | checksum   | xxh3-64 (seed 0) of the page bytes           |
//! | 32     | 32   | key        | the [`ObjectKey`] the object claims to hold  |
//! | 64     | n    | page       | the page bytes                               |
//!
//! A read checks magic, version, header length, the claimed key against the
//! key asked for, `page_bytes` against the size the manifest promises and the
//! object's length, and the checksum.
//!
//! # Manifest object (32-byte header, then a JSON body)
//!
//! | Offset | Size | Field      | Value                                        |
//! |-------:|-----:|------------|----------------------------------------------|
//! | 0      | 8    | magic      | ASCII `LMRCSHMF`                             |
//! | 8      | 4    | version    | `1`                                          |
//! | 12     | 4    | header_len | `32`                                         |
//! | 16     | 8    | body_len   | length of the body                           |
//! | 24     | 8    | checksum   | xxh3-64 (seed 0) of the body                 |
//! | 32     | n    | body       | UTF-8 JSON, see [`ManifestBody`]             |
//!
//! The body carries the whole manifest: namespace, start tokens, prefix hash
//! (hex), tail tokens, generation, world size and the payload (the payload's
//! JSON text as a string). A read checks the header and checksum, parses the
//! body, rebuilds the [`Manifest`] (every envelope rule), parses its payload
//! schema, and the caller compares namespace, bucket and tail with what it
//! asked for.

use xxhash_rust::xxh3::xxh3_64;

use crate::error::{Error, Result};
use crate::identity::Prefix;
use crate::manifest::Manifest;
use crate::store::ObjectKey;

/// Magic of page objects.
pub const PAGE_MAGIC: [u8; 8] = *b"LMRCSHPG";
/// Magic of manifest objects.
pub const MANIFEST_MAGIC: [u8; 8] = *b"LMRCSHMF";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Page object header length.
pub const PAGE_HEADER_BYTES: usize = 64;
/// Manifest object header length.
pub const MANIFEST_HEADER_BYTES: usize = 32;
/// Largest manifest object this build reads (a 16 MiB payload, escaped, plus
/// a 65 536-token tail fits well below).
pub const MAX_MANIFEST_OBJECT_BYTES: u64 = 64 * 1024 * 1024;

/// The 64-byte header of a page object for `page` stored under `key`.
pub fn page_header(key: &ObjectKey, page: &[u8]) -> [u8; PAGE_HEADER_BYTES] {
    let mut out = [0u8; PAGE_HEADER_BYTES];
    out[0..8].copy_from_slice(&PAGE_MAGIC);
    out[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    out[12..16].copy_from_slice(&(PAGE_HEADER_BYTES as u32).to_le_bytes());
    out[16..24].copy_from_slice(&(page.len() as u64).to_le_bytes());
    out[24..32].copy_from_slice(&xxh3_64(page).to_le_bytes());
    out[32..64].copy_from_slice(&key.0);
    out
}

/// Length of a page object holding `page_bytes` bytes.
pub fn page_object_bytes(page_bytes: u64) -> u64 {
    page_bytes.saturating_add(PAGE_HEADER_BYTES as u64)
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

fn corrupt(what: &str, detail: impl std::fmt::Display) -> Error {
    Error::Corrupt(format!("shared tier: {what}: {detail}"))
}

/// Checks magic, version and header length of an object.
fn check_header(object: &[u8], magic: &[u8; 8], header_len: usize, what: &str) -> Result<()> {
    if object.len() < header_len {
        return Err(corrupt(
            what,
            format!(
                "{} bytes, shorter than its {header_len}-byte header",
                object.len()
            ),
        ));
    }
    if object.get(0..8) != Some(&magic[..]) {
        return Err(corrupt(what, "bad magic"));
    }
    let version = u32_at(object, 8).unwrap_or(0);
    if version != FORMAT_VERSION {
        return Err(Error::UnsupportedFormat(format!(
            "shared tier: {what}: format version {version}; this build reads only version \
             {FORMAT_VERSION}"
        )));
    }
    let len = u32_at(object, 12).unwrap_or(0);
    if len as usize != header_len {
        return Err(corrupt(
            what,
            format!("header length field is {len}, expected {header_len}"),
        ));
    }
    Ok(())
}

/// Verifies a whole page object read for `key`, expected to hold
/// `page_bytes` bytes; returns the page's range within `object`.
pub fn verify_page(
    object: &[u8],
    key: &ObjectKey,
    page_bytes: u64,
) -> Result<std::ops::Range<usize>> {
    let what = format!("page {}", key.hex());
    check_header(object, &PAGE_MAGIC, PAGE_HEADER_BYTES, &what)?;
    let claimed = object.get(32..64).unwrap_or_default();
    if claimed != key.0 {
        return Err(corrupt(
            &what,
            format!("the object claims key {}", hex::encode(claimed)),
        ));
    }
    let stored = u64_at(object, 16).unwrap_or(u64::MAX);
    if stored != page_bytes {
        return Err(corrupt(
            &what,
            format!("holds {stored} page bytes, the manifest promises {page_bytes}"),
        ));
    }
    if object.len() as u64 != page_object_bytes(page_bytes) {
        return Err(corrupt(
            &what,
            format!(
                "object is {} bytes, its header promises {} (truncated or extended)",
                object.len(),
                page_object_bytes(page_bytes)
            ),
        ));
    }
    let page = object.get(PAGE_HEADER_BYTES..).unwrap_or_default();
    if xxh3_64(page) != u64_at(object, 24).unwrap_or(0) {
        return Err(corrupt(&what, "checksum mismatch"));
    }
    Ok(PAGE_HEADER_BYTES..object.len())
}

/// The JSON body of a manifest object.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestBody {
    /// The identity namespace.
    pub namespace: String,
    /// Tokens authenticated by the prefix hash.
    pub start_tokens: u64,
    /// Lowercase hex of the 0- or 32-byte prefix hash.
    pub prefix_hash: String,
    /// The literal tail tokens.
    pub tail_tokens: Vec<u32>,
    /// The generation id.
    pub generation: String,
    /// Ranks of the generation.
    pub world_size: u32,
    /// The payload (its JSON text).
    pub payload: String,
}

/// Encodes a manifest object.
pub fn encode_manifest(manifest: &Manifest) -> Result<Vec<u8>> {
    let prefix = manifest.prefix();
    let payload = std::str::from_utf8(manifest.payload())
        .map_err(|_| Error::invalid("shared tier: a manifest payload must be UTF-8 JSON"))?;
    let body = ManifestBody {
        namespace: prefix.namespace().to_string(),
        start_tokens: prefix.start_tokens(),
        prefix_hash: hex::encode(prefix.prefix_hash()),
        tail_tokens: prefix.tail_tokens().to_vec(),
        generation: manifest.generation().to_string(),
        world_size: manifest.world_size(),
        payload: payload.to_string(),
    };
    let body = serde_json::to_vec(&body)
        .map_err(|e| Error::Internal(format!("shared tier: manifest body: {e}")))?;
    let mut out = Vec::with_capacity(MANIFEST_HEADER_BYTES + body.len());
    out.extend_from_slice(&MANIFEST_MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(MANIFEST_HEADER_BYTES as u32).to_le_bytes());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(&xxh3_64(&body).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes and verifies a manifest object: header, checksum, body, every
/// manifest rule and the payload schema. The caller still compares the
/// manifest with the key it was read under and the query.
pub fn decode_manifest(object: &[u8]) -> Result<Manifest> {
    let what = "manifest object";
    check_header(object, &MANIFEST_MAGIC, MANIFEST_HEADER_BYTES, what)?;
    let body_len = u64_at(object, 16).unwrap_or(u64::MAX);
    let actual = (object.len() - MANIFEST_HEADER_BYTES) as u64;
    if body_len != actual {
        return Err(corrupt(
            what,
            format!("body is {actual} bytes, its header promises {body_len}"),
        ));
    }
    let body = object.get(MANIFEST_HEADER_BYTES..).unwrap_or_default();
    if xxh3_64(body) != u64_at(object, 24).unwrap_or(0) {
        return Err(corrupt(what, "checksum mismatch"));
    }
    let body: ManifestBody =
        serde_json::from_slice(body).map_err(|e| corrupt(what, format!("body: {e}")))?;
    let prefix_hash =
        hex::decode(&body.prefix_hash).map_err(|e| corrupt(what, format!("prefix hash: {e}")))?;
    let prefix = Prefix::new(
        body.namespace,
        body.start_tokens,
        prefix_hash,
        body.tail_tokens,
    )
    .map_err(|e| corrupt(what, e))?;
    let payload: Vec<u8> = body.payload.into_bytes();
    let manifest = Manifest::new(body.generation, prefix, body.world_size, payload)
        .map_err(|e| corrupt(what, e))?;
    manifest
        .payload_schema()
        .map_err(|e| corrupt(what, format!("payload schema: {e}")))?;
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Manifest {
        let prefix = Prefix::new("ns", 0, vec![], vec![1, 2, 3]).unwrap();
        let key = "ab".repeat(32);
        let payload = format!(
            r#"{{"schema_version":2,"page_groups":[{{"name":"g","page_bytes":4,"positions":[0],"content_keys":["{key}"]}}]}}"#
        );
        Manifest::new("gen-1", prefix, 2, payload.into_bytes()).unwrap()
    }

    #[test]
    fn manifests_round_trip_and_every_byte_matters() {
        let m = manifest();
        let object = encode_manifest(&m).unwrap();
        assert_eq!(decode_manifest(&object).unwrap(), m);
        for i in 0..object.len() {
            let mut bad = object.clone();
            bad[i] ^= 0x01;
            assert!(decode_manifest(&bad).is_err(), "flip at {i} accepted");
        }
        for n in 0..object.len() {
            assert!(
                decode_manifest(&object[..n]).is_err(),
                "truncation to {n} accepted"
            );
        }
        let mut longer = object.clone();
        longer.push(b' ');
        assert!(decode_manifest(&longer).is_err());
    }

    #[test]
    fn pages_verify_key_size_and_checksum() {
        let key = ObjectKey([3; 32]);
        let page = vec![9u8; 100];
        let mut object = page_header(&key, &page).to_vec();
        object.extend_from_slice(&page);
        let range = verify_page(&object, &key, 100).unwrap();
        assert_eq!(&object[range], &page[..]);
        assert!(verify_page(&object, &ObjectKey([4; 32]), 100).is_err());
        assert!(verify_page(&object, &key, 99).is_err());
        assert!(verify_page(&object[..object.len() - 1], &key, 100).is_err());
        for i in 0..object.len() {
            let mut bad = object.clone();
            bad[i] ^= 0x80;
            assert!(
                verify_page(&bad, &key, 100).is_err(),
                "flip at {i} accepted"
            );
        }
        let mut v2 = object.clone();
        v2[8] = 2;
        assert!(matches!(
            verify_page(&v2, &key, 100),
            Err(Error::UnsupportedFormat(_))
        ));
    }
}
