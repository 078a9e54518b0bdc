//! lmcache-rc core: everything that is not Python glue.
//!
//! Modules own one concern each (see `docs/architecture.md`):
//! - [`config`]: every setting of a sidecar, declared once;
//! - [`cost`]: the compute a restored prefix saves (model shapes) and the eviction policies;
//! - [`http`]: the sidecar's HTTP admin API (status, metrics, clear);
//! - [`identity`]: namespaces, token roots, prefixes, page keys, generation ids;
//! - [`manifest`]: manifests and payload page-group validation;
//! - [`index`]: the durable SQLite directory of published generations;
//! - [`json`]: CPython-compatible canonical JSON for identity hashing;
//! - [`limits`]: process resource floors (open-file limit, descriptor reserve);
//! - [`private`]: ownership, link and mode checks of the paths a sidecar keeps;
//! - [`protocol`]: the checkpoint operation set and its types (one owner);
//! - [`service`]: the checkpoint service (leases, publication, tiers, restart);
//! - [`sidecar`]: a whole sidecar (service, RPC server, HTTP admin) started and stopped in order;
//! - [`store`]: the SHM pool, its slot allocator and the L2 file tier;
//! - [`rpc`]: the sidecar's wire format, RPC server and client;
//! - [`peer`]: the local processes behind connections, and whether they live;
//! - `shared` (feature `shared-tier`): the tier shared across hosts on an object store;
//! - [`transfer`]: worker copies between a page pool and shared memory;
//! - [`units`]: how sizes and durations are written and printed;
//! - [`error`]: the crate's one error enum.
#![deny(missing_docs)]

#[macro_use]
mod macros;

pub mod config;
pub mod cost;
pub mod error;
pub mod http;
pub mod identity;
pub mod index;
pub mod json;
pub mod limits;
pub mod manifest;
pub mod metrics;
pub mod peer;
pub mod private;
pub mod protocol;
pub mod rpc;
pub mod service;
#[cfg(feature = "shared-tier")]
pub mod shared;
pub mod sidecar;
pub mod store;
pub mod transfer;
pub mod units;

pub use error::{Error, ErrorKind, Result};
pub use identity::{Prefix, TokenRoots, checkpoint_generation, checkpoint_namespace};
pub use manifest::{CheckpointPayload, Manifest, PageGroup, PayloadSchema};

/// Version of this crate (the package version).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
