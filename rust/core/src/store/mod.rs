//! Payload storage: the shared-memory L1 pool and its slot allocator, and the
//! filesystem L2 tier, and which object holds each page (`keys`). The object
//! table and reference counts live in `service/`; this module owns bytes,
//! space and object names only.

use std::fmt;

pub mod alloc;
pub mod keys;
pub mod l2;
pub mod shm;

pub use keys::object_keys;

/// The storage key of one payload page: 32 bytes derived ([`object_keys`]) from
/// the namespace, rank, storage group and either the generation (schema 1) or
/// the page's content key (schema 2). Rendered as 64 lowercase hex characters
/// in file names.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey(pub [u8; 32]);

impl ObjectKey {
    /// 64 lowercase hex characters.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses 64 lowercase hex characters.
    pub fn from_hex(text: &str) -> Option<ObjectKey> {
        crate::manifest::parse_lower_hex32(text).map(ObjectKey)
    }
}

/// The 64 hex characters (the L2 file's name), for log lines and messages.
impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

impl fmt::Debug for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ObjectKey({})", &self.hex()[..16])
    }
}
