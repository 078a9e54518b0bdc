//! The one place where core errors become Python exceptions.
//!
//! Every `lmcache_rc_core::ErrorKind` has one class in `lmcache_rc.errors`,
//! named by the core's error table (`ErrorKind::exception`); that module is
//! generated from the same table (`ci/gen_errors.py`), so the kinds, the
//! names and the class hierarchy have one owner. The classes are imported
//! once per interpreter and cached, not on every error.

use lmcache_rc_core::{Error, ErrorKind};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The exception class of every kind, in `ErrorKind::ALL` order.
static CLASSES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

/// The cached classes of `lmcache_rc.errors` (imported on first use).
fn classes(py: Python<'_>) -> PyResult<&Vec<Py<PyType>>> {
    CLASSES.get_or_try_init(py, || {
        let module = py.import("lmcache_rc.errors")?;
        ErrorKind::ALL
            .iter()
            .map(|kind| {
                let class = module.getattr(kind.exception().name)?;
                Ok(class.cast_into::<PyType>()?.unbind())
            })
            .collect()
    })
}

/// Converts a core error into an instance of its `lmcache_rc.errors` class.
pub fn to_pyerr(err: Error) -> PyErr {
    Python::attach(|py| {
        let kind = err.kind();
        let message = err.to_string();
        let class = classes(py).and_then(|classes| {
            ErrorKind::ALL
                .iter()
                .position(|k| *k == kind)
                .and_then(|i| classes.get(i))
                .map(|c| c.bind(py).clone())
                .ok_or_else(|| PyRuntimeError::new_err(format!("no class for error kind {kind}")))
        });
        match class {
            Ok(class) => PyErr::from_type(class, (message,)),
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

/// `(kind name, class name)` for every kind (tests check the classes exist).
#[pyfunction]
pub fn _error_classes() -> Vec<(&'static str, &'static str)> {
    ErrorKind::ALL
        .iter()
        .map(|k| (k.as_str(), k.exception().name))
        .collect()
}

/// The whole error table, `(kind, class name, bases, doc)` per kind, in
/// order: what `ci/gen_errors.py` writes `lmcache_rc/errors.py` from.
#[pyfunction]
pub fn _error_table() -> Vec<(&'static str, &'static str, Vec<&'static str>, &'static str)> {
    ErrorKind::ALL
        .iter()
        .map(|k| {
            let e = k.exception();
            (k.as_str(), e.name, e.bases.to_vec(), e.doc)
        })
        .collect()
}
