//! Payload object keys: which storage object holds each page of a rank.
//!
//! A key is SHA-256 over a domain tag, the page's storage coordinate
//! `[namespace, rank, group index, group name]` (canonical JSON) and either
//! - schema 1: the generation id and the page position (generation-scoped:
//!   a new generation never shares objects with an old one), or
//! - schema 2: the page's content key (content-addressed: identical pages of
//!   different generations are one object, written once — I6).
//!
//! Keys differ across namespace, rank, group index and group name, so ranks
//! and storage groups never share objects, and schema-1 and schema-2 keys never
//! collide (different tags). The derivation is a disk format: changing it
//! orphans every stored object, so it carries a version in its domain tag.

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::json::Value;
use crate::manifest::{Manifest, PayloadSchema};
use crate::store::ObjectKey;

const KEY_DOMAIN: &[u8] = b"lmcache-rc-object-v1\0";

fn coordinate(namespace: &str, rank: u32, group_index: usize, group_name: &str) -> String {
    Value::List(vec![
        Value::Str(namespace.to_string()),
        Value::Int(i64::from(rank)),
        Value::Int(group_index as i64),
        Value::Str(group_name.to_string()),
    ])
    .to_canonical_utf8()
}

/// The object keys of one rank of a manifest: one list per page group, in
/// group order, each in position order.
pub fn object_keys(
    manifest: &Manifest,
    schema: &PayloadSchema,
    rank: u32,
) -> Result<Vec<Vec<ObjectKey>>> {
    if rank >= manifest.world_size() {
        return Err(Error::invalid(format!(
            "rank {rank} is outside world size {}",
            manifest.world_size()
        )));
    }
    let namespace = manifest.prefix().namespace();
    Ok(schema
        .page_groups
        .iter()
        .enumerate()
        .map(|(index, group)| {
            let coord = coordinate(namespace, rank, index, &group.name);
            let mut base = Sha256::new();
            base.update(KEY_DOMAIN);
            base.update(coord.as_bytes());
            base.update(b"\0");
            if schema.schema_version == 1 {
                group
                    .positions
                    .iter()
                    .map(|position| {
                        let mut h = base.clone();
                        h.update(b"generation\0");
                        h.update(manifest.generation().as_bytes());
                        h.update(b"\0");
                        h.update(position.to_le_bytes());
                        ObjectKey(h.finalize().into())
                    })
                    .collect()
            } else {
                group
                    .content_keys
                    .iter()
                    .map(|content| {
                        let mut h = base.clone();
                        h.update(b"content\0");
                        h.update(content);
                        ObjectKey(h.finalize().into())
                    })
                    .collect()
            }
        })
        .collect())
}
