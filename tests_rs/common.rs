//! Helpers shared by the integration tests.

use std::path::PathBuf;

/// Repository root (two levels above the core crate).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The golden identity vectors shipped with the repository.
pub fn vectors() -> serde_json::Value {
    let path = repo_root().join("vectors/identity-v1.json");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).expect("vectors are JSON")
}
