//! The binding of an L2 directory to the checkpoint directory (index) whose
//! generations its objects belong to: `<root>/binding.json`.
//!
//! ```json
//! {"format": 1, "index_id": "<32 hex>", "durable": true, "index_path": "/var/lib/x.sqlite"}
//! ```
//!
//! `index_id` is the id stored in the durable index (or a random id per
//! start for an in-memory index, `durable: false`); `index_path` is where
//! that index was opened last, for messages only. The service decides from
//! it whether the objects may be reconciled (and unreferenced ones deleted)
//! against the index it opened: see `service::open`. The file is written
//! durably (temp file, fsync, rename, directory fsync) with mode 0600.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::fs::Fs;
use crate::error::{Error, Result};

/// The binding file's name under the L2 root.
pub const BINDING_FILE: &str = "binding.json";
/// The binding format this build writes.
const BINDING_FORMAT: u32 = 1;
/// A binding file larger than this is not one.
const MAX_BINDING_BYTES: u64 = 64 << 10;

/// What `binding.json` says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    /// Format of the file (1).
    pub format: u32,
    /// The id of the index the objects belong to.
    pub index_id: String,
    /// Whether that index is durable (a SQLite file); objects of an
    /// in-memory index are garbage once it is gone.
    pub durable: bool,
    /// Where that index was opened last (messages only).
    #[serde(default)]
    pub index_path: Option<String>,
}

impl Binding {
    /// A binding of this build's format.
    pub fn new(index_id: String, durable: bool, index_path: Option<&Path>) -> Binding {
        Binding {
            format: BINDING_FORMAT,
            index_id,
            durable,
            index_path: index_path.map(|p| p.display().to_string()),
        }
    }
}

/// Reads `<root>/binding.json`; None when the directory or the file does
/// not exist. A file that is not a binding is an error naming it.
pub fn read_binding(fs: &dyn Fs, root: &Path) -> Result<Option<Binding>> {
    let path = root.join(BINDING_FILE);
    let mut file = match fs.open_read(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(format!("open {}", path.display()), e)),
    };
    let len = file
        .len()
        .map_err(|e| Error::io(format!("stat {}", path.display()), e))?;
    if len > MAX_BINDING_BYTES {
        return Err(Error::Corrupt(format!(
            "{} is not an L2 binding ({len} bytes); remove it if this L2 directory holds no \
             objects of a durable index",
            path.display()
        )));
    }
    let mut bytes = vec![0u8; len as usize];
    file.read_exact_at(&mut bytes, 0)
        .map_err(|e| Error::io(format!("read {}", path.display()), e))?;
    let binding: Binding = serde_json::from_slice(&bytes).map_err(|e| {
        Error::Corrupt(format!(
            "{} is not an L2 binding ({e}); remove it if this L2 directory holds no objects of \
             a durable index",
            path.display()
        ))
    })?;
    if binding.format != BINDING_FORMAT {
        return Err(Error::UnsupportedFormat(format!(
            "{}: binding format {} (this build reads {BINDING_FORMAT}); the L2 directory was \
             written by another lmcache-rc version",
            path.display(),
            binding.format
        )));
    }
    Ok(Some(binding))
}

/// Writes `<root>/binding.json` durably (see the module docs).
pub fn write_binding(fs: &dyn Fs, root: &Path, binding: &Binding) -> Result<()> {
    let path = root.join(BINDING_FILE);
    let tmp = root.join(format!(".{BINDING_FILE}.{}.tmp", std::process::id()));
    let bytes = serde_json::to_vec(binding)
        .map_err(|e| Error::invalid(format!("encode the L2 binding: {e}")))?;
    let _ = fs.remove_file(&tmp);
    let written = (|| -> std::io::Result<()> {
        let mut file = fs.create_new(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        fs.rename(&tmp, &path)?;
        fs.sync_dir(root)
    })();
    written.map_err(|e| {
        let _ = fs.remove_file(&tmp);
        Error::io(format!("write {}", path.display()), e)
    })
}
