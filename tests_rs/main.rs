//! The one integration-test binary of `lmcache-rc-core` (wired up in
//! `rust/core/Cargo.toml`). Each module tests one area through the crate's
//! public API; names follow the rule they check. Service scenarios run both
//! in process and over the socket (`service_common::Target`).
// Tests report failures by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod common;
mod crash_images;
mod crash_record;
mod http_admin;
mod identity_properties;
mod identity_vectors;
mod index_crash;
mod index_durability;
mod index_faults;
mod index_format;
mod index_model;
mod index_publication;
mod index_recency;
mod index_reference;
mod index_support;
mod rpc_client;
mod rpc_common;
mod rpc_golden;
mod rpc_restart;
mod rpc_server;
mod rpc_stress;
mod rpc_wire;
#[cfg(feature = "shared-tier")]
mod s3_server;
mod service_basic;
mod service_capacity;
mod service_changes;
mod service_clear;
mod service_common;
mod service_crash;
mod service_eviction;
mod service_faults;
mod service_invalidate_namespace;
mod service_lease_rules;
mod service_limits;
mod service_overlapping_stores;
mod service_races;
mod service_reclaim;
mod service_restart;
mod service_scenarios;
#[cfg(feature = "shared-tier")]
mod service_shared;
mod service_write_once;
#[cfg(feature = "shared-tier")]
mod shared_tier;
mod sidecar;
mod store_alloc;
mod store_l2;
mod store_shm;
mod transfer_common;
mod transfer_cuda;
mod transfer_early;
mod transfer_faults;
mod transfer_hazards;
mod transfer_regions;
mod transfer_remap;
mod transfer_roundtrip;
mod transfer_skip;
mod transfer_validation;
