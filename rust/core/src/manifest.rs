//! Manifests and their payload schema (`spec/storage-and-transfer.md` §1.2–§1.3,
//! `spec/identity-and-index.md` §2.1).
//!
//! A [`Manifest`] is the metadata of one immutable generation. Constructing one
//! validates the envelope (generation id, world size, payload size, schema
//! version) — exactly what the directory needs. [`PayloadSchema::parse`]
//! validates the page groups, which the payload store needs before it lends
//! a single byte.

use std::collections::HashSet;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::identity::Prefix;

/// Generation ids have 1..=128 characters.
pub const MAX_GENERATION_CHARS: usize = 128;
/// Largest world size (ranks).
pub const MAX_WORLD_SIZE: u32 = 1024;
/// Largest payload in bytes (16 MiB).
pub const MAX_PAYLOAD_BYTES: usize = 16 * 1024 * 1024;
/// Most page groups in one payload.
pub const MAX_PAGE_GROUPS: usize = 4096;
/// Longest group name in characters.
pub const MAX_GROUP_NAME_CHARS: usize = 256;
/// Largest page in bytes (1 GiB).
pub const MAX_PAGE_BYTES: u64 = 1 << 30;
/// Most positions in one group.
pub const MAX_GROUP_POSITIONS: usize = 1 << 20;

const MSG_GROUP: &str = "invalid checkpoint storage group";

/// The metadata of one generation. Equality is over all four fields, byte-exact.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Manifest {
    generation: String,
    prefix: Prefix,
    world_size: u32,
    payload: Arc<[u8]>,
}

impl Manifest {
    /// Validates and builds a manifest.
    pub fn new(
        generation: impl Into<String>,
        prefix: Prefix,
        world_size: u32,
        payload: impl Into<Arc<[u8]>>,
    ) -> Result<Manifest> {
        let generation = generation.into();
        let payload = payload.into();
        let chars = generation.chars().count();
        if chars == 0 || chars > MAX_GENERATION_CHARS {
            return Err(Error::invalid(
                "checkpoint generation must contain 1..128 characters",
            ));
        }
        if world_size == 0 || world_size > MAX_WORLD_SIZE {
            return Err(Error::invalid("checkpoint world size must be in 1..1024"));
        }
        schema_version(&payload)?;
        Ok(Manifest {
            generation,
            prefix,
            world_size,
            payload,
        })
    }

    /// The generation id.
    pub fn generation(&self) -> &str {
        &self.generation
    }
    /// The exact prefix this generation checkpoints.
    pub fn prefix(&self) -> &Prefix {
        &self.prefix
    }
    /// Number of ranks that must commit before publication.
    pub fn world_size(&self) -> u32 {
        self.world_size
    }
    /// The exact payload bytes.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
    /// The payload's schema version (1 or 2; validated at construction).
    pub fn schema_version(&self) -> u8 {
        schema_version(&self.payload).unwrap_or(0)
    }
    /// Parses and validates the payload's page groups.
    pub fn payload_schema(&self) -> Result<PayloadSchema> {
        PayloadSchema::parse(&self.payload)
    }
}

/// Checks the payload envelope and returns its schema version (1 or 2).
fn schema_version(payload: &[u8]) -> Result<u8> {
    if payload.is_empty() || payload.len() > MAX_PAYLOAD_BYTES {
        return Err(Error::invalid(
            "checkpoint manifest must contain at most 16 MiB (and at least one byte)",
        ));
    }
    let unsupported = || {
        Error::invalid(
            "unsupported checkpoint manifest schema (the payload must be a JSON object \
             with schema_version 1 or 2)",
        )
    };
    // serde would also map a JSON array onto the struct: require an object.
    if payload.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(unsupported());
    }
    let version: VersionProbe = serde_json::from_slice(payload).map_err(|e| {
        Error::invalid(format!(
            "checkpoint manifest payload is not valid JSON: {e}"
        ))
    })?;
    match version.schema_version {
        Some(VersionValue::Int(1)) => Ok(1),
        Some(VersionValue::Int(2)) => Ok(2),
        _ => Err(unsupported()),
    }
}

/// `{"schema_version": ...}` with every other field skipped.
#[derive(serde::Deserialize)]
struct VersionProbe {
    #[serde(default)]
    schema_version: Option<VersionValue>,
}

/// A schema_version value: only integers count (no bools, floats or strings).
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum VersionValue {
    Int(u64),
    Other(serde::de::IgnoredAny),
}

/// One storage group of a payload: a byte width and ordered logical positions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageGroup {
    /// Unique name within the payload (e.g. `engine-kv-group:0`).
    pub name: String,
    /// Bytes of every page of this group.
    pub page_bytes: u64,
    /// Strictly increasing logical page positions.
    pub positions: Vec<u64>,
    /// One content key per position (schema 2), or empty (schema 1).
    pub content_keys: Vec<[u8; 32]>,
}

/// The validated page-group description of a payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayloadSchema {
    /// 1 (generation-scoped objects) or 2 (content-keyed, deduplicated objects).
    pub schema_version: u8,
    /// The groups in payload order (group index = object group id).
    pub page_groups: Vec<PageGroup>,
}

impl PayloadSchema {
    /// Parses a payload and validates every group (`spec/storage-and-transfer.md` §1.3).
    pub fn parse(payload: &[u8]) -> Result<PayloadSchema> {
        let schema_version = schema_version(payload)?;
        let value: serde_json::Value = serde_json::from_slice(payload)
            .map_err(|e| Error::invalid(format!("{MSG_GROUP}: {e}")))?;
        let groups = value
            .get("page_groups")
            .and_then(serde_json::Value::as_array)
            .ok_or_else(|| Error::invalid(format!("{MSG_GROUP}: page_groups must be a list")))?;
        if groups.is_empty() || groups.len() > MAX_PAGE_GROUPS {
            return Err(Error::invalid(format!(
                "{MSG_GROUP}: page_groups must hold 1..{MAX_PAGE_GROUPS} groups, got {}",
                groups.len()
            )));
        }
        let mut names = HashSet::new();
        let mut page_groups = Vec::with_capacity(groups.len());
        for (index, group) in groups.iter().enumerate() {
            let g = parse_group(index, group)?;
            if !names.insert(g.name.clone()) {
                return Err(Error::invalid(format!(
                    "{MSG_GROUP}: duplicate group name {:?}",
                    g.name
                )));
            }
            if schema_version == 2 && g.content_keys.is_empty() {
                return Err(Error::invalid(format!(
                    "{MSG_GROUP}: schema 2 requires content_keys on group {:?}",
                    g.name
                )));
            }
            page_groups.push(g);
        }
        Ok(PayloadSchema {
            schema_version,
            page_groups,
        })
    }

    /// Payload bytes one rank stores for this generation.
    pub fn bytes_per_rank(&self) -> u64 {
        self.page_groups
            .iter()
            .map(|g| g.page_bytes.saturating_mul(g.positions.len() as u64))
            .fold(0u64, u64::saturating_add)
    }

    /// Number of pages one rank stores.
    pub fn pages_per_rank(&self) -> usize {
        self.page_groups.iter().map(|g| g.positions.len()).sum()
    }
}

fn parse_group(index: usize, group: &serde_json::Value) -> Result<PageGroup> {
    let bad = |what: &str| Error::invalid(format!("{MSG_GROUP} #{index}: {what}"));
    let obj = group.as_object().ok_or_else(|| bad("must be an object"))?;
    let name = obj
        .get("name")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| bad("name must be a string"))?;
    let name_chars = name.chars().count();
    if name_chars == 0 || name_chars > MAX_GROUP_NAME_CHARS {
        return Err(bad("name must contain 1..256 characters"));
    }
    let page_bytes = obj
        .get("page_bytes")
        .and_then(serde_json::Value::as_u64)
        .filter(|b| (1..=MAX_PAGE_BYTES).contains(b))
        .ok_or_else(|| bad("page_bytes must be an integer in 1..1073741824"))?;
    let raw_positions = obj
        .get("positions")
        .and_then(serde_json::Value::as_array)
        .ok_or_else(|| bad("positions must be a list"))?;
    if raw_positions.is_empty() || raw_positions.len() > MAX_GROUP_POSITIONS {
        return Err(bad("positions must hold 1..1048576 entries"));
    }
    let mut positions = Vec::with_capacity(raw_positions.len());
    for p in raw_positions {
        let p = p
            .as_u64()
            .ok_or_else(|| bad("positions must be non-negative integers"))?;
        if positions.last().is_some_and(|&last| p <= last) {
            return Err(bad("positions must be strictly increasing"));
        }
        positions.push(p);
    }
    let content_keys = match obj.get("content_keys") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(keys)) if keys.is_empty() => Vec::new(),
        Some(serde_json::Value::Array(keys)) => {
            if keys.len() != positions.len() {
                return Err(bad("content_keys must hold one key per position"));
            }
            keys.iter()
                .map(|k| {
                    k.as_str()
                        .and_then(parse_lower_hex32)
                        .ok_or_else(|| bad("content keys must be 64 lowercase hex characters"))
                })
                .collect::<Result<_>>()?
        }
        Some(_) => return Err(bad("content_keys must be a list")),
    };
    Ok(PageGroup {
        name: name.to_string(),
        page_bytes,
        positions,
        content_keys,
    })
}

/// Parses exactly 64 lowercase hex characters.
pub fn parse_lower_hex32(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64
        || !text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    let mut out = [0u8; 32];
    hex::decode_to_slice(text, &mut out).ok()?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefix() -> Prefix {
        Prefix::new("ns", 0, vec![], vec![1, 2]).unwrap()
    }

    #[test]
    fn schema_version_must_be_integer_one_or_two() {
        for bad in [
            &b"{}"[..],
            b"[]",
            b"{\"schema_version\":3}",
            b"{\"schema_version\":\"1\"}",
            b"x",
        ] {
            assert!(
                Manifest::new("g", prefix(), 1, bad.to_vec()).is_err(),
                "{bad:?}"
            );
        }
        assert!(Manifest::new("g", prefix(), 1, b"{\"schema_version\":2}".to_vec()).is_ok());
    }

    #[test]
    fn schema_two_groups_need_content_keys() {
        let payload =
            br#"{"schema_version":2,"page_groups":[{"name":"a","page_bytes":4,"positions":[0]}]}"#;
        assert!(PayloadSchema::parse(payload).is_err());
        let key = "ab".repeat(32);
        let payload = format!(
            r#"{{"schema_version":2,"page_groups":[{{"name":"a","page_bytes":4,"positions":[0,3],"content_keys":["{key}","{key}"]}}]}}"#
        );
        let schema = PayloadSchema::parse(payload.as_bytes()).unwrap();
        assert_eq!(schema.bytes_per_rank(), 8);
    }
}
