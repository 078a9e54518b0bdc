//! The one integration-test binary of `lmcache-rc-core` (wired up in
//! `rust/core/Cargo.toml`). Each module tests one area through the crate's
//! public API; names follow the rule they check.

mod common;
mod identity_properties;
mod identity_vectors;
mod index_crash;
mod index_faults;
mod index_format;
mod index_model;
mod index_publication;
mod index_recency;
mod index_reference;
mod index_support;
