//! The object file format (version 1): a 64-byte header, then the page bytes.
//!
//! The byte-by-byte layout is documented in the parent module; this module
//! only encodes and checks it. Nothing here touches the filesystem.

use std::fmt;

use xxhash_rust::xxh3::xxh3_64;

use crate::store::ObjectKey;

/// The first eight bytes of every object file.
pub const MAGIC: [u8; 8] = *b"LMRCPAGE";
/// The object format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Length of the header in bytes (format version 1).
pub const HEADER_BYTES: usize = 64;

/// The decoded header of an object file.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PageHeader {
    /// Length of the page bytes that follow the header.
    pub page_bytes: u64,
    /// xxh3-64 (seed 0) of the page bytes.
    pub checksum: u64,
    /// The object's key; must equal the key in the file name.
    pub key: ObjectKey,
}

/// Why a header (or the file around it) was rejected.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum HeaderDefect {
    /// The file is shorter than a header.
    Short(u64),
    /// The first eight bytes are not [`MAGIC`].
    BadMagic,
    /// A format version this build does not read (older or newer).
    Version(u32),
    /// The header-length field is not [`HEADER_BYTES`].
    HeaderLength(u32),
    /// The header names a different key than the one expected.
    KeyMismatch(ObjectKey),
    /// The file length is not header + `page_bytes`.
    FileLength {
        /// Bytes the header promises (header + page).
        expected: u64,
        /// Bytes the file has.
        actual: u64,
    },
}

impl HeaderDefect {
    /// True when the defect is a format version this build does not read
    /// (reported as `UnsupportedFormat`, not `Corrupt`).
    pub fn is_unsupported_version(&self) -> bool {
        matches!(self, HeaderDefect::Version(_))
    }
}

impl fmt::Display for HeaderDefect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeaderDefect::Short(len) => {
                write!(
                    f,
                    "file is {len} bytes, shorter than the {HEADER_BYTES}-byte header"
                )
            }
            HeaderDefect::BadMagic => write!(f, "bad magic (not an lmcache-rc page file)"),
            HeaderDefect::Version(v) => write!(
                f,
                "object format version {v}; this build reads only version {FORMAT_VERSION}"
            ),
            HeaderDefect::HeaderLength(n) => {
                write!(f, "header length field is {n}, expected {HEADER_BYTES}")
            }
            HeaderDefect::KeyMismatch(k) => {
                write!(
                    f,
                    "header names key {}, not the key of its file name",
                    k.hex()
                )
            }
            HeaderDefect::FileLength { expected, actual } => write!(
                f,
                "file is {actual} bytes but its header promises {expected} (truncated or extended)"
            ),
        }
    }
}

impl PageHeader {
    /// The header of `page` stored under `key` (computes the checksum).
    pub fn for_page(key: &ObjectKey, page: &[u8]) -> PageHeader {
        PageHeader {
            page_bytes: page.len() as u64,
            checksum: checksum(page),
            key: *key,
        }
    }

    /// The 64 header bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..8].copy_from_slice(&MAGIC);
        out[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        out[12..16].copy_from_slice(&(HEADER_BYTES as u32).to_le_bytes());
        out[16..24].copy_from_slice(&self.page_bytes.to_le_bytes());
        out[24..32].copy_from_slice(&self.checksum.to_le_bytes());
        out[32..64].copy_from_slice(&self.key.0);
        out
    }

    /// Decodes and checks a header read from a file of `file_len` bytes
    /// that should hold `expected`: magic, version, header length, key and
    /// file length. The payload checksum is checked separately.
    pub fn decode(
        bytes: &[u8; HEADER_BYTES],
        expected: &ObjectKey,
        file_len: u64,
    ) -> Result<PageHeader, HeaderDefect> {
        if bytes[0..8] != MAGIC {
            return Err(HeaderDefect::BadMagic);
        }
        let version = u32::from_le_bytes(le4(&bytes[8..12]));
        if version != FORMAT_VERSION {
            return Err(HeaderDefect::Version(version));
        }
        let header_len = u32::from_le_bytes(le4(&bytes[12..16]));
        if header_len as usize != HEADER_BYTES {
            return Err(HeaderDefect::HeaderLength(header_len));
        }
        let page_bytes = u64::from_le_bytes(le8(&bytes[16..24]));
        let checksum = u64::from_le_bytes(le8(&bytes[24..32]));
        let mut key = [0u8; 32];
        key.copy_from_slice(&bytes[32..64]);
        let key = ObjectKey(key);
        if key != *expected {
            return Err(HeaderDefect::KeyMismatch(key));
        }
        let expected_len = page_bytes.checked_add(HEADER_BYTES as u64);
        if expected_len != Some(file_len) {
            return Err(HeaderDefect::FileLength {
                expected: expected_len.unwrap_or(u64::MAX),
                actual: file_len,
            });
        }
        Ok(PageHeader {
            page_bytes,
            checksum,
            key,
        })
    }

    /// Header plus page bytes: the length of the object file.
    pub fn file_bytes(&self) -> u64 {
        object_file_bytes(self.page_bytes)
    }
}

/// The size of the object file that stores a page of `page_bytes` bytes.
pub fn object_file_bytes(page_bytes: u64) -> u64 {
    page_bytes.saturating_add(HEADER_BYTES as u64)
}

/// The page checksum: xxh3-64 with seed 0.
pub fn checksum(page: &[u8]) -> u64 {
    xxh3_64(page)
}

fn le4(b: &[u8]) -> [u8; 4] {
    let mut out = [0u8; 4];
    out.copy_from_slice(b);
    out
}

fn le8(b: &[u8]) -> [u8; 8] {
    let mut out = [0u8; 8];
    out.copy_from_slice(b);
    out
}
