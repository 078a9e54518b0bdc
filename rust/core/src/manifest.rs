//! Manifests and their payload schema (`docs/design/manifests.md#the-envelope-manifestnew`,
//! `docs/design/manifests.md#page-groups-payloadschemaparse`).
//!
//! A [`Manifest`] is the metadata of one immutable generation. Constructing one
//! validates the envelope (generation id, world size, payload size, schema
//! version) — exactly what the directory needs. [`PayloadSchema::parse`]
//! validates the page groups, which the payload store needs before it lends
//! a single byte. [`CheckpointPayload`] is the typed schema-2 payload the
//! scheduler writes and the workers check: built as canonical JSON
//! (byte-identical to CPython's `json.dumps(..., sort_keys=True,
//! separators=(",", ":"))`) and parsed with every rule in one place.

use std::collections::HashSet;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::identity::Prefix;
use crate::json;

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
    /// Parses the payload as a schema-2 [`CheckpointPayload`].
    pub fn checkpoint_payload(&self) -> Result<CheckpointPayload> {
        CheckpointPayload::parse(&self.payload)
    }
}

/// Checks the payload envelope and returns its schema version (1 or 2).
fn schema_version(payload: &[u8]) -> Result<u8> {
    check_envelope(payload)?;
    let version: VersionProbe = serde_json::from_slice(payload).map_err(|e| {
        Error::invalid(format!(
            "checkpoint manifest payload is not valid JSON: {e}"
        ))
    })?;
    match version.schema_version {
        Some(VersionValue::Int(1)) => Ok(1),
        Some(VersionValue::Int(2)) => Ok(2),
        _ => Err(unsupported_schema()),
    }
}

/// Size bounds, and a JSON object (serde would also map a JSON array onto
/// a struct: require `{`).
fn check_envelope(payload: &[u8]) -> Result<()> {
    if payload.is_empty() || payload.len() > MAX_PAYLOAD_BYTES {
        return Err(Error::invalid(
            "checkpoint manifest must contain at most 16 MiB (and at least one byte)",
        ));
    }
    if payload.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(unsupported_schema());
    }
    Ok(())
}

fn unsupported_schema() -> Error {
    Error::invalid(
        "unsupported checkpoint manifest schema (the payload must be a JSON object \
         with schema_version 1 or 2)",
    )
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
    /// Parses a payload and validates every group
    /// (`docs/design/manifests.md#page-groups-payloadschemaparse`).
    pub fn parse(payload: &[u8]) -> Result<PayloadSchema> {
        match fast::parse_schema(payload) {
            Some(schema) => Ok(schema),
            None => Self::parse_tree(payload),
        }
    }

    /// [`PayloadSchema::parse`] through a JSON tree: the canonical answer.
    fn parse_tree(payload: &[u8]) -> Result<PayloadSchema> {
        let (schema_version, document) = parse_document(payload)?;
        let page_groups = parse_groups(schema_version, &document)?;
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

/// Most characters of a payload's `kind`.
pub const MAX_KIND_CHARS: usize = 256;

const MSG_PAYLOAD: &str = "invalid checkpoint payload";

/// The top-level keys of a [`CheckpointPayload`], in canonical (sorted) order.
const PAYLOAD_KEYS: [&str; 6] = [
    "draft_prefix_len",
    "kind",
    "num_tokens",
    "page_groups",
    "schema_version",
    "worker_layout",
];
/// The keys of one page group, in canonical (sorted) order.
const GROUP_KEYS: [&str; 4] = ["content_keys", "name", "page_bytes", "positions"];

/// The schema-2 checkpoint payload the scheduler writes into a manifest and
/// every worker checks before it copies
/// (`docs/design/manifests.md#the-schema-2-checkpoint-payload-checkpointpayload`):
/// one typed value, built and parsed here with every rule in one place.
///
/// [`CheckpointPayload::build`] writes canonical JSON byte-identical to
/// CPython's `json.dumps(obj, sort_keys=True, separators=(",", ":"),
/// allow_nan=False).encode()` of the same dict (keys sorted at every depth,
/// no whitespace, ASCII escaping), so generation ids — hashes over these
/// bytes — are the same whichever side builds a payload.
/// [`CheckpointPayload::parse`] accepts exactly what `build` can write:
/// schema 2, the known keys only, every group and field validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointPayload {
    /// The address-free byte layout every rank's memory must match: a JSON
    /// object of the identity domain (strings, booleans, null, integers
    /// within `i64`, lists, objects; no floats, so no byte depends on float
    /// formatting).
    pub worker_layout: json::Value,
    /// The page groups, in payload order (group index = object group id).
    /// Schema 2: every group carries one content key per position.
    pub page_groups: Vec<PageGroup>,
    /// Boundary mode: the draft model's prefix length (with `kind`).
    pub draft_prefix_len: Option<u64>,
    /// Boundary mode: the checkpoint kind, e.g. `prompt` (with
    /// `draft_prefix_len`).
    pub kind: Option<String>,
    /// Tokens this checkpoint covers, when the writer records it.
    pub num_tokens: Option<u64>,
}

impl CheckpointPayload {
    /// The schema version this type reads and writes.
    pub const SCHEMA_VERSION: u8 = 2;

    /// Checks every rule: the layout is an object; 1..=4096 groups with
    /// unique names of 1..=256 characters, pages of 1 B..=1 GiB,
    /// 1..=1 048 576 strictly increasing positions and one content key per
    /// position; `kind` (1..=256 characters) and `draft_prefix_len` present
    /// together or not at all; `num_tokens` positive and not below
    /// `draft_prefix_len`.
    pub fn validate(&self) -> Result<()> {
        if !matches!(self.worker_layout, json::Value::Object(_)) {
            return Err(Error::invalid(format!(
                "{MSG_PAYLOAD}: worker_layout must be a JSON object"
            )));
        }
        for (index, g) in self.page_groups.iter().enumerate() {
            check_group_values(index, g)?;
        }
        check_groups(Self::SCHEMA_VERSION, &self.page_groups)?;
        match (&self.kind, self.draft_prefix_len) {
            (Some(kind), Some(_)) => {
                let chars = kind.chars().count();
                if chars == 0 || chars > MAX_KIND_CHARS {
                    return Err(Error::invalid(format!(
                        "{MSG_PAYLOAD}: kind must contain 1..={MAX_KIND_CHARS} characters"
                    )));
                }
            }
            (None, None) => {}
            _ => {
                return Err(Error::invalid(format!(
                    "{MSG_PAYLOAD}: kind and draft_prefix_len come together (boundary mode) or \
                     not at all"
                )));
            }
        }
        if let Some(n) = self.num_tokens {
            if n == 0 {
                return Err(Error::invalid(format!(
                    "{MSG_PAYLOAD}: num_tokens must be positive"
                )));
            }
            if self.draft_prefix_len.is_some_and(|d| d > n) {
                return Err(Error::invalid(format!(
                    "{MSG_PAYLOAD}: draft_prefix_len exceeds num_tokens ({n})"
                )));
            }
        }
        Ok(())
    }

    /// Validates and writes the canonical payload bytes (see the type docs).
    pub fn build(&self) -> Result<Vec<u8>> {
        self.validate()?;
        let mut out = String::with_capacity(self.estimated_len());
        out.push('{');
        let mut first = true;
        if let Some(d) = self.draft_prefix_len {
            push_key(&mut out, &mut first, PAYLOAD_KEYS[0]);
            push_u64(&mut out, d);
        }
        if let Some(kind) = &self.kind {
            push_key(&mut out, &mut first, PAYLOAD_KEYS[1]);
            json::write_string(&mut out, kind, true);
        }
        if let Some(n) = self.num_tokens {
            push_key(&mut out, &mut first, PAYLOAD_KEYS[2]);
            push_u64(&mut out, n);
        }
        push_key(&mut out, &mut first, PAYLOAD_KEYS[3]);
        out.push('[');
        for (i, g) in self.page_groups.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let mut first_field = true;
            out.push('{');
            push_key(&mut out, &mut first_field, GROUP_KEYS[0]);
            out.push('[');
            for (k, key) in g.content_keys.iter().enumerate() {
                if k > 0 {
                    out.push(',');
                }
                out.push('"');
                out.push_str(&hex::encode(key));
                out.push('"');
            }
            out.push(']');
            push_key(&mut out, &mut first_field, GROUP_KEYS[1]);
            json::write_string(&mut out, &g.name, true);
            push_key(&mut out, &mut first_field, GROUP_KEYS[2]);
            push_u64(&mut out, g.page_bytes);
            push_key(&mut out, &mut first_field, GROUP_KEYS[3]);
            out.push('[');
            for (k, &p) in g.positions.iter().enumerate() {
                if k > 0 {
                    out.push(',');
                }
                push_u64(&mut out, p);
            }
            out.push_str("]}");
        }
        out.push(']');
        push_key(&mut out, &mut first, PAYLOAD_KEYS[4]);
        push_u64(&mut out, u64::from(Self::SCHEMA_VERSION));
        push_key(&mut out, &mut first, PAYLOAD_KEYS[5]);
        out.push_str(&self.worker_layout.to_canonical_ascii());
        out.push('}');
        if out.len() > MAX_PAYLOAD_BYTES {
            return Err(Error::invalid(format!(
                "{MSG_PAYLOAD}: {} bytes, a manifest payload holds at most 16 MiB",
                out.len()
            )));
        }
        Ok(out.into_bytes())
    }

    /// Parses and validates payload bytes (one JSON parse). Refuses what
    /// [`CheckpointPayload::build`] could not have written: another schema
    /// version, unknown keys, a missing or non-object `worker_layout`, floats
    /// or integers beyond `i64` in it, and every rule of
    /// [`CheckpointPayload::validate`].
    pub fn parse(payload: &[u8]) -> Result<CheckpointPayload> {
        let (version, document) = parse_document(payload)?;
        if version != Self::SCHEMA_VERSION {
            return Err(Error::invalid(format!(
                "{MSG_PAYLOAD}: schema_version {version}; this payload type reads schema 2"
            )));
        }
        if let Some(key) = document
            .keys()
            .find(|k| !PAYLOAD_KEYS.contains(&k.as_str()))
        {
            return Err(Error::invalid(format!(
                "{MSG_PAYLOAD}: unknown key {key:?} (known: {})",
                PAYLOAD_KEYS.join(", ")
            )));
        }
        let page_groups = parse_groups(version, &document)?;
        if let Some(groups) = document.get("page_groups").and_then(|g| g.as_array()) {
            for (index, group) in groups.iter().enumerate() {
                let extra = group
                    .as_object()
                    .and_then(|o| o.keys().find(|k| !GROUP_KEYS.contains(&k.as_str())));
                if let Some(key) = extra {
                    return Err(Error::invalid(format!(
                        "{MSG_GROUP} #{index}: unknown key {key:?}"
                    )));
                }
            }
        }
        let worker_layout = match document.get("worker_layout") {
            None => {
                return Err(Error::invalid(format!(
                    "{MSG_PAYLOAD}: no worker_layout (a JSON object naming the workers' byte \
                     layout)"
                )));
            }
            Some(v @ serde_json::Value::Object(_)) => json::Value::from_serde(v)
                .map_err(|e| Error::invalid(format!("{MSG_PAYLOAD}: worker_layout: {e}")))?,
            Some(_) => {
                return Err(Error::invalid(format!(
                    "{MSG_PAYLOAD}: worker_layout must be a JSON object"
                )));
            }
        };
        let payload = CheckpointPayload {
            worker_layout,
            page_groups,
            draft_prefix_len: optional_u64(&document, "draft_prefix_len")?,
            kind: match document.get("kind") {
                None => None,
                Some(serde_json::Value::String(k)) => Some(k.clone()),
                Some(_) => {
                    return Err(Error::invalid(format!(
                        "{MSG_PAYLOAD}: kind must be a string"
                    )));
                }
            },
            num_tokens: optional_u64(&document, "num_tokens")?,
        };
        payload.validate()?;
        Ok(payload)
    }

    /// The page-group view the payload store and the transfer engine use.
    pub fn schema(&self) -> PayloadSchema {
        PayloadSchema {
            schema_version: Self::SCHEMA_VERSION,
            page_groups: self.page_groups.clone(),
        }
    }

    /// [`CheckpointPayload::schema`], consuming the payload.
    pub fn into_schema(self) -> PayloadSchema {
        PayloadSchema {
            schema_version: Self::SCHEMA_VERSION,
            page_groups: self.page_groups,
        }
    }

    /// A capacity hint for [`CheckpointPayload::build`].
    fn estimated_len(&self) -> usize {
        let groups: usize = self
            .page_groups
            .iter()
            .map(|g| 96 + g.name.len() + g.positions.len() * 8 + g.content_keys.len() * 67)
            .sum();
        128 + groups
    }
}

/// Writes `,"key":` (no comma before the first key).
fn push_key(out: &mut String, first: &mut bool, key: &str) {
    if !*first {
        out.push(',');
    }
    *first = false;
    json::write_string(out, key, true);
    out.push(':');
}

fn push_u64(out: &mut String, value: u64) {
    use std::fmt::Write as _;
    // Writing to a String cannot fail.
    let _ = write!(out, "{value}");
}

/// An optional non-negative integer field (absent = None; null, floats,
/// bools and negative numbers are refused).
fn optional_u64(
    document: &serde_json::Map<String, serde_json::Value>,
    key: &str,
) -> Result<Option<u64>> {
    match document.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            Error::invalid(format!(
                "{MSG_PAYLOAD}: {key} must be a non-negative integer"
            ))
        }),
    }
}

/// Parses a payload once: the envelope rules of [`schema_version`], then
/// the whole JSON object.
fn parse_document(payload: &[u8]) -> Result<(u8, serde_json::Map<String, serde_json::Value>)> {
    check_envelope(payload)?;
    let value: serde_json::Value = serde_json::from_slice(payload).map_err(|e| {
        Error::invalid(format!(
            "checkpoint manifest payload is not valid JSON: {e}"
        ))
    })?;
    let serde_json::Value::Object(document) = value else {
        return Err(unsupported_schema());
    };
    let version = match document.get("schema_version").and_then(|v| v.as_u64()) {
        Some(1) => 1,
        Some(2) => 2,
        _ => return Err(unsupported_schema()),
    };
    Ok((version, document))
}

/// The `page_groups` of a parsed payload, every group validated.
fn parse_groups(
    schema_version: u8,
    document: &serde_json::Map<String, serde_json::Value>,
) -> Result<Vec<PageGroup>> {
    let groups = document
        .get("page_groups")
        .and_then(serde_json::Value::as_array)
        .ok_or_else(|| Error::invalid(format!("{MSG_GROUP}: page_groups must be a list")))?;
    let page_groups = groups
        .iter()
        .enumerate()
        .map(|(index, group)| parse_group(index, group))
        .collect::<Result<Vec<_>>>()?;
    check_groups(schema_version, &page_groups)?;
    Ok(page_groups)
}

/// The rules over a payload's whole group list: 1..=4096 groups, unique
/// names, content keys on every schema-2 group.
fn check_groups(schema_version: u8, groups: &[PageGroup]) -> Result<()> {
    if groups.is_empty() || groups.len() > MAX_PAGE_GROUPS {
        return Err(Error::invalid(format!(
            "{MSG_GROUP}: page_groups must hold 1..{MAX_PAGE_GROUPS} groups, got {}",
            groups.len()
        )));
    }
    let mut names = HashSet::new();
    for g in groups {
        if !names.insert(g.name.as_str()) {
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
    }
    Ok(())
}

/// The value rules of one group (what [`parse_group`] checks while
/// parsing), for groups built in code.
fn check_group_values(index: usize, g: &PageGroup) -> Result<()> {
    let bad = |what: &str| Error::invalid(format!("{MSG_GROUP} #{index}: {what}"));
    let name_chars = g.name.chars().count();
    if name_chars == 0 || name_chars > MAX_GROUP_NAME_CHARS {
        return Err(bad(ERR_NAME_CHARS));
    }
    if !(1..=MAX_PAGE_BYTES).contains(&g.page_bytes) {
        return Err(bad(ERR_PAGE_BYTES));
    }
    if g.positions.is_empty() || g.positions.len() > MAX_GROUP_POSITIONS {
        return Err(bad(ERR_POSITIONS_COUNT));
    }
    if g.positions.windows(2).any(|w| w[1] <= w[0]) {
        return Err(bad(ERR_POSITIONS_ORDER));
    }
    if !g.content_keys.is_empty() && g.content_keys.len() != g.positions.len() {
        return Err(bad(ERR_KEYS_COUNT));
    }
    Ok(())
}

const ERR_NAME_CHARS: &str = "name must contain 1..256 characters";
const ERR_PAGE_BYTES: &str = "page_bytes must be an integer in 1..1073741824";
const ERR_POSITIONS_COUNT: &str = "positions must hold 1..1048576 entries";
const ERR_POSITIONS_ORDER: &str = "positions must be strictly increasing";
const ERR_KEYS_COUNT: &str = "content_keys must hold one key per position";

fn parse_group(index: usize, group: &serde_json::Value) -> Result<PageGroup> {
    let bad = |what: &str| Error::invalid(format!("{MSG_GROUP} #{index}: {what}"));
    let obj = group.as_object().ok_or_else(|| bad("must be an object"))?;
    let name = obj
        .get("name")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| bad("name must be a string"))?;
    let name_chars = name.chars().count();
    if name_chars == 0 || name_chars > MAX_GROUP_NAME_CHARS {
        return Err(bad(ERR_NAME_CHARS));
    }
    let page_bytes = obj
        .get("page_bytes")
        .and_then(serde_json::Value::as_u64)
        .filter(|b| (1..=MAX_PAGE_BYTES).contains(b))
        .ok_or_else(|| bad(ERR_PAGE_BYTES))?;
    let raw_positions = obj
        .get("positions")
        .and_then(serde_json::Value::as_array)
        .ok_or_else(|| bad("positions must be a list"))?;
    if raw_positions.is_empty() || raw_positions.len() > MAX_GROUP_POSITIONS {
        return Err(bad(ERR_POSITIONS_COUNT));
    }
    let mut positions = Vec::with_capacity(raw_positions.len());
    for p in raw_positions {
        let p = p
            .as_u64()
            .ok_or_else(|| bad("positions must be non-negative integers"))?;
        if positions.last().is_some_and(|&last| p <= last) {
            return Err(bad(ERR_POSITIONS_ORDER));
        }
        positions.push(p);
    }
    let content_keys = match obj.get("content_keys") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(keys)) if keys.is_empty() => Vec::new(),
        Some(serde_json::Value::Array(keys)) => {
            if keys.len() != positions.len() {
                return Err(bad(ERR_KEYS_COUNT));
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

/// [`PayloadSchema::parse`] without a JSON tree: the payload read straight
/// into typed values (strings borrowed where they have no escapes), then
/// held to the same rules ([`check_group_values`], [`check_groups`]). It
/// answers only a payload that is valid on the tree path too, with the same
/// schema; anything else — a broken rule, a value of another type, a
/// duplicate key, a group that is not an object — is `None`, and the tree
/// parse gives the one canonical answer (and error message). About four
/// times faster per page (the breakdown's `check` phase, the service's key
/// derivation).
mod fast {
    use std::borrow::Cow;

    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};

    use super::{PageGroup, PayloadSchema, check_envelope, check_group_values, check_groups};

    #[derive(serde::Deserialize)]
    struct Document<'a> {
        schema_version: u64,
        #[serde(borrow)]
        page_groups: Vec<Group<'a>>,
    }

    /// One group: a JSON object only (a derived struct would also take an
    /// array); every key at most once; unknown keys skipped, as on the tree
    /// path.
    struct Group<'a> {
        name: Cow<'a, str>,
        page_bytes: u64,
        positions: Vec<u64>,
        content_keys: Option<Vec<Cow<'a, str>>>,
    }

    impl<'de: 'a, 'a> serde::Deserialize<'de> for Group<'a> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_map(GroupVisitor(std::marker::PhantomData))
        }
    }

    struct GroupVisitor<'a>(std::marker::PhantomData<&'a ()>);

    impl<'de: 'a, 'a> Visitor<'de> for GroupVisitor<'a> {
        type Value = Group<'a>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a page group object")
        }

        fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Group<'a>, M::Error> {
            use serde::de::Error;
            let mut name: Option<Cow<'a, str>> = None;
            let mut page_bytes = None;
            let mut positions = None;
            let mut content_keys: Option<Option<Vec<Cow<'a, str>>>> = None;
            fn once<T, E: Error>(
                slot: &mut Option<T>,
                value: T,
                key: &'static str,
            ) -> Result<(), E> {
                if slot.replace(value).is_some() {
                    return Err(E::duplicate_field(key));
                }
                Ok(())
            }
            while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                match key.as_ref() {
                    "name" => once(&mut name, map.next_value::<Cow<'de, str>>()?, "name")?,
                    "page_bytes" => once(&mut page_bytes, map.next_value()?, "page_bytes")?,
                    "positions" => once(&mut positions, map.next_value()?, "positions")?,
                    "content_keys" => {
                        let keys: Option<Vec<Cow<'de, str>>> = map.next_value()?;
                        once(&mut content_keys, keys, "content_keys")?;
                    }
                    _ => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            Ok(Group {
                name: name.ok_or_else(|| M::Error::missing_field("name"))?,
                page_bytes: page_bytes.ok_or_else(|| M::Error::missing_field("page_bytes"))?,
                positions: positions.ok_or_else(|| M::Error::missing_field("positions"))?,
                content_keys: content_keys.flatten(),
            })
        }
    }

    pub(super) fn parse_schema(payload: &[u8]) -> Option<PayloadSchema> {
        check_envelope(payload).ok()?;
        let doc: Document<'_> = serde_json::from_slice(payload).ok()?;
        let schema_version = match doc.schema_version {
            1 => 1,
            2 => 2,
            _ => return None,
        };
        let mut page_groups = Vec::with_capacity(doc.page_groups.len());
        for (index, g) in doc.page_groups.into_iter().enumerate() {
            let content_keys = match g.content_keys {
                None => Vec::new(),
                Some(keys) => keys
                    .iter()
                    .map(|k| super::parse_lower_hex32(k))
                    .collect::<Option<Vec<_>>>()?,
            };
            let group = PageGroup {
                name: g.name.into_owned(),
                page_bytes: g.page_bytes,
                positions: g.positions,
                content_keys,
            };
            check_group_values(index, &group).ok()?;
            page_groups.push(group);
        }
        check_groups(schema_version, &page_groups).ok()?;
        Some(PayloadSchema {
            schema_version,
            page_groups,
        })
    }
}

/// Parses exactly 64 lowercase hex characters.
pub fn parse_lower_hex32(text: &str) -> Option<[u8; 32]> {
    /// Each byte's value as a lowercase hex digit, or 0xFF.
    const NIBBLE: [u8; 256] = {
        let mut t = [0xFF_u8; 256];
        let mut c = 0;
        while c < 10 {
            t[b'0' as usize + c] = c as u8;
            c += 1;
        }
        let mut c = 0;
        while c < 6 {
            t[b'a' as usize + c] = 10 + c as u8;
            c += 1;
        }
        t
    };
    let bytes: &[u8; 64] = text.as_bytes().try_into().ok()?;
    let mut out = [0u8; 32];
    let mut bad = 0u8;
    for (o, pair) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        let (hi, lo) = (NIBBLE[pair[0] as usize], NIBBLE[pair[1] as usize]);
        bad |= hi | lo;
        *o = (hi << 4) | (lo & 0x0F);
    }
    // A non-digit's 0xFF sets the high bits no digit (0..=15) has.
    (bad & 0xF0 == 0).then_some(out)
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

    fn payload(kind: Option<&str>) -> CheckpointPayload {
        let mut layout = std::collections::BTreeMap::new();
        layout.insert("page_bytes".to_string(), json::Value::Int(4096));
        layout.insert("név".to_string(), json::Value::Str("q\"🙂".into()));
        CheckpointPayload {
            worker_layout: json::Value::Object(layout),
            page_groups: vec![
                PageGroup {
                    name: "engine-kv-group:0".into(),
                    page_bytes: 4096,
                    positions: vec![0, 1, u64::MAX],
                    content_keys: vec![[0xab; 32], [0x01; 32], [0xff; 32]],
                },
                PageGroup {
                    name: "target-draft-auxiliary".into(),
                    page_bytes: 4096,
                    positions: vec![0],
                    content_keys: vec![[0x12; 32]],
                },
            ],
            draft_prefix_len: kind.map(|_| 11),
            kind: kind.map(str::to_string),
            num_tokens: None,
        }
    }

    #[test]
    fn a_payload_is_written_as_cpython_writes_it() {
        // The text CPython's json.dumps(sort_keys=True, separators=(",", ":"))
        // writes for the same dict (checked against CPython in
        // tests_py/test_checkpoint_payload.py for many more payloads).
        let (ab, one, ff, x12) = (
            "ab".repeat(32),
            "01".repeat(32),
            "ff".repeat(32),
            "12".repeat(32),
        );
        let expected = format!(
            r#"{{"draft_prefix_len":11,"kind":"prompt","page_groups":[{{"content_keys":["{ab}","{one}","{ff}"],"name":"engine-kv-group:0","page_bytes":4096,"positions":[0,1,18446744073709551615]}},{{"content_keys":["{x12}"],"name":"target-draft-auxiliary","page_bytes":4096,"positions":[0]}}],"schema_version":2,"worker_layout":{{"n\u00e9v":"q\"\ud83d\ude42","page_bytes":4096}}}}"#
        );
        let p = payload(Some("prompt"));
        let bytes = p.build().unwrap();
        assert_eq!(String::from_utf8(bytes.clone()).unwrap(), expected);
        assert_eq!(CheckpointPayload::parse(&bytes).unwrap(), p);
        assert_eq!(
            PayloadSchema::parse(&bytes).unwrap(),
            p.schema(),
            "both parsers read the same groups"
        );
        // Upstream mode: no kind, no draft length.
        let upstream = payload(None);
        let text = String::from_utf8(upstream.build().unwrap()).unwrap();
        assert!(text.starts_with(r#"{"page_groups":"#), "{text}");
        assert_eq!(CheckpointPayload::parse(text.as_bytes()).unwrap(), upstream);
    }

    #[test]
    fn a_payload_refuses_what_it_could_not_write() {
        let mut p = payload(Some("prompt"));
        p.kind = None;
        assert!(p.build().is_err(), "draft_prefix_len without kind");
        let mut p = payload(Some("prompt"));
        p.num_tokens = Some(5);
        assert!(p.build().is_err(), "draft_prefix_len beyond num_tokens");
        let mut p = payload(None);
        p.page_groups[1].content_keys.clear();
        assert!(p.build().is_err(), "schema 2 needs content keys");
        let mut p = payload(None);
        p.worker_layout = json::Value::List(vec![]);
        assert!(p.build().is_err(), "the layout must be an object");
        let good = String::from_utf8(payload(None).build().unwrap()).unwrap();
        for (bad, needle) in [
            (
                good.replace("\"schema_version\":2", "\"schema_version\":1"),
                "schema 2",
            ),
            (good.replacen('{', r#"{"extra":1,"#, 1), "unknown key"),
            (good.replace("4096}}", "4096.5}}"), "worker_layout"),
            (
                good.replace(r#","worker_layout""#, r#","x""#),
                "unknown key",
            ),
        ] {
            let e = CheckpointPayload::parse(bad.as_bytes()).unwrap_err();
            assert!(e.to_string().contains(needle), "{needle}: {e}");
        }
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

    /// The typed fast path answers exactly what the tree parse answers, or
    /// leaves the payload to it.
    fn same_as_tree(payload: &str) -> bool {
        let tree = PayloadSchema::parse_tree(payload.as_bytes());
        match fast::parse_schema(payload.as_bytes()) {
            Some(schema) => {
                assert_eq!(tree.as_ref().ok(), Some(&schema), "{payload}");
                true
            }
            None => {
                assert_eq!(
                    PayloadSchema::parse(payload.as_bytes()).map_err(|e| e.to_string()),
                    tree.map_err(|e| e.to_string()),
                    "{payload}"
                );
                false
            }
        }
    }

    #[test]
    fn the_fast_payload_parse_agrees_with_the_tree_parse() {
        let key = "ab".repeat(32);
        let ok = [
            format!(r#"{{"schema_version":2,"page_groups":[{{"name":"g","page_bytes":4096,"positions":[0,3],"content_keys":["{key}","{key}"]}}]}}"#),
            format!(r#"{{"page_groups":[{{"content_keys":["{key}"],"positions":[7],"page_bytes":1,"name":"a\u00e9b","extra":{{"x":[1,2]}}}}],"kind":"prompt","schema_version":2}}"#),
            r#"{"schema_version":1,"page_groups":[{"name":"x","page_bytes":8,"positions":[1]},{"name":"y","page_bytes":8,"positions":[1],"content_keys":null}]}"#.to_string(),
            r#" {"schema_version":1,"page_groups":[{"name":"x","page_bytes":8,"positions":[1],"content_keys":[]}]}"#.to_string(),
        ];
        for p in &ok {
            assert!(same_as_tree(p), "the fast path should read {p}");
        }
        let left_to_the_tree = [
            // Duplicate keys (the tree keeps the last one).
            r#"{"schema_version":1,"page_groups":[{"name":"x","name":"y","page_bytes":8,"positions":[1]}]}"#.to_string(),
            r#"{"schema_version":1,"schema_version":1,"page_groups":[{"name":"x","page_bytes":8,"positions":[1]}]}"#.to_string(),
            // A group written as an array, not an object.
            r#"{"schema_version":1,"page_groups":[["x",8,[1],null]]}"#.to_string(),
            // Wrong types, ranges, orders, counts, keys.
            r#"{"schema_version":2.0,"page_groups":[{"name":"x","page_bytes":8,"positions":[1]}]}"#.to_string(),
            r#"{"schema_version":3,"page_groups":[{"name":"x","page_bytes":8,"positions":[1]}]}"#.to_string(),
            r#"{"schema_version":1,"page_groups":[{"name":"x","page_bytes":8.0,"positions":[1]}]}"#.to_string(),
            r#"{"schema_version":1,"page_groups":[{"name":"x","page_bytes":0,"positions":[1]}]}"#.to_string(),
            r#"{"schema_version":1,"page_groups":[{"name":"","page_bytes":8,"positions":[1]}]}"#.to_string(),
            r#"{"schema_version":1,"page_groups":[{"name":"x","page_bytes":8,"positions":[2,2]}]}"#.to_string(),
            r#"{"schema_version":1,"page_groups":[{"name":"x","page_bytes":8,"positions":[-1]}]}"#.to_string(),
            r#"{"schema_version":1,"page_groups":[{"name":"x","page_bytes":8,"positions":[]}]}"#.to_string(),
            r#"{"schema_version":1,"page_groups":[{"name":"x","page_bytes":8,"positions":[1],"content_keys":"k"}]}"#.to_string(),
            format!(r#"{{"schema_version":2,"page_groups":[{{"name":"x","page_bytes":8,"positions":[1,2],"content_keys":["{key}"]}}]}}"#),
            format!(r#"{{"schema_version":2,"page_groups":[{{"name":"x","page_bytes":8,"positions":[1],"content_keys":["{}"]}}]}}"#, "AB".repeat(32)),
            r#"{"schema_version":2,"page_groups":[{"name":"x","page_bytes":8,"positions":[1]}]}"#.to_string(),
            r#"{"schema_version":1,"page_groups":[{"name":"x","page_bytes":8,"positions":[1]},{"name":"x","page_bytes":8,"positions":[1]}]}"#.to_string(),
            r#"{"schema_version":1,"page_groups":[]}"#.to_string(),
            r#"{"schema_version":1,"page_groups":{}}"#.to_string(),
            r#"{"schema_version":1}"#.to_string(),
            r#"{"schema_version":1,"page_groups":[{"name":"x","page_bytes":8,"positions":[1]}]} x"#.to_string(),
            r#"[{"schema_version":1}]"#.to_string(),
        ];
        for p in &left_to_the_tree {
            assert!(
                !same_as_tree(p),
                "the fast path should leave {p} to the tree"
            );
        }
    }

    fn group_json(
        (name, bytes, positions, keys, extra, dup, as_array): (
            usize,
            usize,
            Vec<u8>,
            usize,
            bool,
            bool,
            bool,
        ),
    ) -> String {
        let name = ["\"x\"", "\"\"", "\"a\\\"b\"", "\"\\u00e9\"", "7"][name];
        let bytes = ["0", "1", "8", "4096", "2147483648", "8.0"][bytes];
        let pos: Vec<String> = positions.iter().map(u8::to_string).collect();
        let good = format!("\"{}\"", "0f".repeat(32));
        let keys = match keys {
            0 => None,
            1 => Some("null".to_string()),
            2 => Some("[]".to_string()),
            3 => Some(format!(
                "[{}]",
                vec![good.clone(); positions.len()].join(",")
            )),
            4 => Some(format!(
                "[{}]",
                vec![good.clone(); positions.len() + 1].join(",")
            )),
            5 => Some(format!(
                "[{}]",
                vec!["\"zz\"".to_string(); positions.len()].join(",")
            )),
            _ => Some("\"k\"".to_string()),
        };
        if as_array {
            return format!(
                "[{name},{bytes},[{}],{}]",
                pos.join(","),
                keys.unwrap_or("null".into())
            );
        }
        let mut fields = vec![
            format!("\"name\":{name}"),
            format!("\"page_bytes\":{bytes}"),
            format!("\"positions\":[{}]", pos.join(",")),
        ];
        if let Some(k) = keys {
            fields.push(format!("\"content_keys\":{k}"));
        }
        if extra {
            fields.push("\"other\":{\"a\":[1,{\"b\":null}]}".to_string());
        }
        if dup {
            fields.push("\"name\":\"y\"".to_string());
        }
        format!("{{{}}}", fields.join(","))
    }

    proptest::proptest! {
        #[test]
        fn the_fast_payload_parse_always_gives_the_tree_parses_answer(
            version in 0usize..5,
            groups in proptest::collection::vec(
                (0usize..5, 0usize..6, proptest::collection::vec(0u8..6, 0..4), 0usize..7,
                 proptest::bool::ANY, proptest::bool::weighted(0.1), proptest::bool::weighted(0.1)),
                0..4,
            ),
            missing in proptest::bool::weighted(0.1),
        ) {
            let version = ["1", "2", "\"2\"", "2.0", "3"][version];
            let groups: Vec<String> = groups.into_iter().map(group_json).collect();
            let payload = if missing {
                format!("{{\"schema_version\":{version}}}")
            } else {
                format!("{{\"schema_version\":{version},\"page_groups\":[{}]}}", groups.join(","))
            };
            let tree = PayloadSchema::parse_tree(payload.as_bytes());
            let fast = fast::parse_schema(payload.as_bytes());
            if let Some(schema) = &fast {
                proptest::prop_assert_eq!(tree.as_ref().ok(), Some(schema), "{}", payload);
            }
            proptest::prop_assert_eq!(
                PayloadSchema::parse(payload.as_bytes()).map_err(|e| e.to_string()),
                tree.map_err(|e| e.to_string()),
                "{}", payload
            );
        }
    }

    #[test]
    fn lower_hex_keys_parse_exactly() {
        for seed in 0u8..=255 {
            let bytes: [u8; 32] =
                std::array::from_fn(|i| seed.wrapping_mul(31).wrapping_add(i as u8 * 7));
            assert_eq!(parse_lower_hex32(&hex::encode(bytes)), Some(bytes));
        }
        let good = "0123456789abcdef".repeat(4);
        assert!(parse_lower_hex32(&good).is_some());
        for bad in [
            good.to_uppercase(),
            good[..63].to_string(),
            format!("{good}0"),
            format!("{}g", &good[..63]),
            format!("{} ", &good[..63]),
            format!("{}é", &good[..62]),
            String::new(),
        ] {
            assert_eq!(parse_lower_hex32(&bad), None, "{bad:?}");
        }
    }
}
