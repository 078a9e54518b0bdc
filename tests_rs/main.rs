//! The one integration-test binary of `lmcache-rc-core` (wired up in
//! `rust/core/Cargo.toml`). Each module tests one area through the crate's
//! public API; names follow the rule they check.

mod common;
mod identity_properties;
mod identity_vectors;
