//! The one place where core errors become Python exceptions.
//!
//! Every `lmcache_rc_core::Error` variant maps to one class of
//! `lmcache_rc.errors` (defined in Python so it carries docstrings and is
//! importable without the extension). Keep this table and `errors.py` in step.

use lmcache_rc_core::{Error, ErrorKind};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// The Python class name in `lmcache_rc.errors` for a core error kind.
pub fn class_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::InvalidInput => "InvalidInput",
        ErrorKind::InvalidType => "InvalidType",
        ErrorKind::GenerationConflict => "GenerationConflict",
        ErrorKind::UnsupportedFormat => "UnsupportedFormat",
        ErrorKind::Closed => "Closed",
        ErrorKind::Database => "DatabaseError",
        ErrorKind::Corrupt => "CorruptData",
        ErrorKind::OutOfSpace => "OutOfSpace",
        ErrorKind::NotFound => "NotFound",
        ErrorKind::LeasesLive => "LeasesLive",
        ErrorKind::Io => "StorageIOError",
        ErrorKind::Unavailable => "Unavailable",
        ErrorKind::Protocol => "ProtocolError",
        ErrorKind::Timeout => "RpcTimeout",
        ErrorKind::Internal => "InternalError",
        ErrorKind::UnsafeCopy => "UnsafeCopy",
        ErrorKind::Device => "DeviceError",
        _ => "CheckpointError",
    }
}

/// Converts a core error into an instance of its `lmcache_rc.errors` class.
pub fn to_pyerr(err: Error) -> PyErr {
    Python::attach(|py| {
        let name = class_name(err.kind());
        let message = err.to_string();
        match py
            .import("lmcache_rc.errors")
            .and_then(|m| m.getattr(name))
            .and_then(|cls| cls.call1((message.clone(),)))
        {
            Ok(instance) => PyErr::from_value(instance),
            // The errors module is part of the package; failing to import it is
            // a broken install, still reported rather than hidden.
            Err(import_error) => PyRuntimeError::new_err(format!(
                "{message} (and lmcache_rc.errors could not be loaded: {import_error})"
            )),
        }
    })
}

/// `Result` of core calls, converted at the binding boundary.
pub trait IntoPyResult<T> {
    /// Maps the error through [`to_pyerr`].
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, Error> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_pyerr)
    }
}

/// Builds an `InvalidInput` error directly from the binding.
pub fn invalid(message: impl Into<String>) -> PyErr {
    to_pyerr(Error::InvalidInput(message.into()))
}

/// Builds an `InvalidType` error directly from the binding.
pub fn invalid_type(message: impl Into<String>) -> PyErr {
    to_pyerr(Error::InvalidType(message.into()))
}

/// Exposes the mapping to tests: `(kind name, class name)` for every kind.
#[pyfunction]
pub fn _error_classes() -> Vec<(&'static str, &'static str)> {
    ErrorKind::ALL
        .into_iter()
        .map(|k| (k.as_str(), class_name(k)))
        .collect()
}
