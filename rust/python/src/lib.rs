//! `lmcache_rc._native`: thin PyO3 bindings over `lmcache-rc-core`.
//!
//! This crate only converts types, releases the GIL around blocking work and
//! maps errors (in `errors.rs`). Behaviour lives in the core crate.

mod config;
mod convert;
mod cost;
mod directory;
mod errors;
mod fork;
mod identity;
mod payload;
mod protocol;
mod rpc;
mod service;
mod shared;
mod transfer;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Rust `log` records go to Python logging under the `lmcache_rc` logger.
    // A second import (e.g. a reloaded module) keeps the first logger.
    let _ = pyo3_log::Logger::new(m.py(), pyo3_log::Caching::Loggers)?
        .set_prefix("lmcache_rc")
        .install();
    m.add("__version__", lmcache_rc_core::VERSION)?;
    // Every operation of the protocol (both classes have each, plus its `_async` twin).
    m.add(
        "OPERATIONS",
        pyo3::types::PyTuple::new(m.py(), lmcache_rc_core::protocol::OPERATIONS)?,
    )?;
    m.add_function(wrap_pyfunction!(identity::checkpoint_namespace, m)?)?;
    m.add_function(wrap_pyfunction!(identity::checkpoint_generation, m)?)?;
    m.add_function(wrap_pyfunction!(errors::_error_classes, m)?)?;
    m.add_function(wrap_pyfunction!(errors::_error_table, m)?)?;
    m.add_function(wrap_pyfunction!(_log_for_test, m)?)?;
    m.add_function(wrap_pyfunction!(config::default_socket_path, m)?)?;
    m.add_function(wrap_pyfunction!(config::default_l1_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(shared::shared_gc, m)?)?;
    m.add_function(wrap_pyfunction!(shared::shared_min_gc_age, m)?)?;
    m.add_function(wrap_pyfunction!(config::human_size, m)?)?;
    m.add_function(wrap_pyfunction!(config::parse_duration_seconds, m)?)?;
    m.add_function(wrap_pyfunction!(cost::model_shapes, m)?)?;
    m.add_function(wrap_pyfunction!(cost::prefill_flops, m)?)?;
    m.add_function(wrap_pyfunction!(cost::eviction_policies, m)?)?;
    m.add_class::<config::PyServerConfig>()?;
    m.add_class::<identity::PyPrefix>()?;
    m.add_class::<identity::PyTokenRoots>()?;
    m.add_class::<identity::PyManifest>()?;
    m.add_class::<payload::PyCheckpointPayload>()?;
    m.add_class::<directory::PyDirectory>()?;
    m.add_class::<service::PyCheckpointService>()?;
    m.add_class::<protocol::PyLease>()?;
    m.add_class::<service::SlotView>()?;
    m.add_class::<rpc::PyClient>()?;
    m.add_class::<protocol::PyFuture>()?;
    m.add_class::<rpc::PyServer>()?;
    m.add_class::<rpc::MappedSlotView>()?;
    m.add_class::<transfer::PyTransferEngine>()?;
    m.add_class::<transfer::PyTransferFuture>()?;
    Ok(())
}

/// Emits one Rust `log` record at `level` (tests check it reaches Python logging).
#[pyfunction]
fn _log_for_test(level: &str, message: &str) -> PyResult<()> {
    let level = match level {
        "error" => log::Level::Error,
        "warning" => log::Level::Warn,
        "info" => log::Level::Info,
        "debug" => log::Level::Debug,
        other => return Err(errors::invalid(format!("unknown log level {other:?}"))),
    };
    log::log!(target: "lmcache_rc_core::binding", level, "{message}");
    Ok(())
}
