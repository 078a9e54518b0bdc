//! `ServerConfig`: the Python face of the core's `SidecarConfig`.
//!
//! The settings, their kinds, defaults and documentation are declared once in
//! `rust/core/src/config.rs`; this class only converts values. It is strict:
//! an unknown setting or a value of the wrong type raises `InvalidType` (a
//! `TypeError`), a value out of range `InvalidInput` (a `ValueError`); `bool`
//! is never taken for an integer. Instances are immutable.

use std::path::PathBuf;

use lmcache_rc_core::config::{FieldKind, FieldSpec, FieldValue, SidecarConfig, parse_field};
use lmcache_rc_core::units::{DURATION_GRAMMAR, SIZE_GRAMMAR, parse_duration, parse_size, seconds};
use pyo3::exceptions::PyAttributeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString, PyTuple, PyType};

use crate::errors::{IntoPyResult, invalid, invalid_type};

/// Settings of a checkpoint service / sidecar: every `lmcache-rc serve` flag
/// (see `ServerConfig.fields()` and `docs/configuration.md`).
#[pyclass(name = "ServerConfig", module = "lmcache_rc._native", frozen, eq)]
#[derive(PartialEq)]
pub struct PyServerConfig {
    pub(crate) inner: SidecarConfig,
}

fn spec(name: &str) -> PyResult<&'static FieldSpec> {
    SidecarConfig::FIELDS
        .iter()
        .find(|f| f.name == name)
        .ok_or_else(|| {
            let known: Vec<&str> = SidecarConfig::FIELDS.iter().map(|f| f.name).collect();
            invalid_type(format!(
                "ServerConfig has no setting {name:?}; the settings are {}",
                known.join(", ")
            ))
        })
}

/// A Python value as a setting of `field`'s kind (strict).
fn value_of(field: &FieldSpec, value: &Bound<'_, PyAny>) -> PyResult<Option<FieldValue>> {
    let name = field.name;
    if value.is_none() {
        return if field.optional {
            Ok(None)
        } else {
            Err(invalid_type(format!("{name} may not be None")))
        };
    }
    let wrong = |what: &str| {
        invalid_type(format!(
            "{name} must be {what}{}, not {}",
            if field.optional { " or None" } else { "" },
            value
                .get_type()
                .name()
                .map_or_else(|_| "?".to_string(), |n| n.to_string())
        ))
    };
    let is_int = value.is_instance_of::<PyInt>() && !value.is_instance_of::<PyBool>();
    Ok(Some(match field.kind {
        FieldKind::Path => {
            if !(value.is_instance_of::<PyString>() || value.hasattr("__fspath__")?) {
                return Err(wrong("a path (str or os.PathLike)"));
            }
            FieldValue::Path(value.extract::<PathBuf>()?)
        }
        FieldKind::Text => {
            if !value.is_instance_of::<PyString>() {
                return Err(wrong("a str"));
            }
            FieldValue::Text(value.extract()?)
        }
        FieldKind::Bytes if value.is_instance_of::<PyString>() => {
            // A size as text, as flags and variables take it ("8G", "512MiB").
            let text: String = value.extract()?;
            FieldValue::Unsigned(parse_size(&text).ok_or_else(|| {
                invalid(format!(
                    "{name}: expected {}, got {text:?} (e.g. 8GiB)",
                    SIZE_GRAMMAR
                ))
            })?)
        }
        FieldKind::Bytes => {
            if !is_int {
                return Err(wrong("an int or a size string such as '8GiB'"));
            }
            let n: i128 = value.extract()?;
            FieldValue::Unsigned(u64::try_from(n).map_err(|_| {
                invalid(format!(
                    "{name} must be a non-negative 64-bit integer, got {n}"
                ))
            })?)
        }
        FieldKind::Count => {
            if !is_int {
                return Err(wrong("an int"));
            }
            let n: i128 = value.extract()?;
            FieldValue::Unsigned(u64::try_from(n).map_err(|_| {
                invalid(format!(
                    "{name} must be a non-negative 64-bit integer, got {n}"
                ))
            })?)
        }
        FieldKind::Signed => {
            if !is_int {
                return Err(wrong("an int"));
            }
            FieldValue::Signed(
                value
                    .extract()
                    .map_err(|_| invalid(format!("{name} must be a 64-bit integer")))?,
            )
        }
        FieldKind::Seconds if value.is_instance_of::<PyString>() => {
            // A duration as text, as flags and variables take it ("30s", "5m").
            let text: String = value.extract()?;
            FieldValue::Seconds(parse_duration(&text).ok_or_else(|| {
                invalid(format!("{name}: expected {DURATION_GRAMMAR}, got {text:?}"))
            })?)
        }
        FieldKind::Seconds => {
            if !(is_int || value.is_instance_of::<PyFloat>()) {
                return Err(wrong(
                    "a number of seconds or a duration string such as '30s'",
                ));
            }
            let s: f64 = value.extract()?;
            FieldValue::Seconds(seconds(s).map_err(|e| invalid(format!("{name}: {e}")))?)
        }
    }))
}

/// A setting's value as Python sees it (paths as str, durations as float).
fn to_python(py: Python<'_>, value: Option<FieldValue>) -> PyResult<Py<PyAny>> {
    Ok(match value {
        None => py.None(),
        Some(FieldValue::Path(p)) => p.as_os_str().into_pyobject(py)?.into_any().unbind(),
        Some(FieldValue::Text(t)) => t.into_pyobject(py)?.into_any().unbind(),
        Some(FieldValue::Unsigned(n)) => n.into_pyobject(py)?.into_any().unbind(),
        Some(FieldValue::Signed(n)) => n.into_pyobject(py)?.into_any().unbind(),
        Some(FieldValue::Seconds(d)) => d.as_secs_f64().into_pyobject(py)?.into_any().unbind(),
    })
}

/// `name=value` pairs of a kwargs dict, converted; None values are kept.
fn values_of(values: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(String, Option<FieldValue>)>> {
    let mut out = Vec::new();
    if let Some(values) = values {
        for (key, value) in values.iter() {
            let name: String = key.extract()?;
            out.push((name.clone(), value_of(spec(&name)?, &value)?));
        }
    }
    Ok(out)
}

#[pymethods]
impl PyServerConfig {
    /// The defaults with the given settings (keyword arguments).
    #[new]
    #[pyo3(signature = (**values))]
    fn new(values: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let inner = SidecarConfig::from_values(values_of(values)?).py()?;
        Ok(PyServerConfig { inner })
    }

    /// Defaults, then `LMCACHE_RC_<SETTING>` environment variables, then
    /// `overrides` (None values are skipped: the flag was not given).
    #[classmethod]
    #[pyo3(signature = (**overrides))]
    fn from_env(_cls: &Bound<'_, PyType>, overrides: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let given = values_of(overrides)?
            .into_iter()
            .filter(|(_, v)| v.is_some());
        let inner = SidecarConfig::from_env(given).py()?;
        Ok(PyServerConfig { inner })
    }

    /// Every setting: `(name, kind, optional, doc)`, kind one of path,
    /// text, bytes, count, signed, seconds.
    #[staticmethod]
    fn fields() -> Vec<(&'static str, &'static str, bool, String)> {
        SidecarConfig::FIELDS
            .iter()
            .map(|f| {
                let doc = f.doc.split_whitespace().collect::<Vec<_>>().join(" ");
                (f.name, f.kind.as_str(), f.optional, doc)
            })
            .collect()
    }

    /// Parses the text of a flag or environment variable for setting `name`
    /// ("8GiB" for bytes; "none" for an optional setting) and checks its
    /// range. The error (`InvalidInput`) does not name the setting: the
    /// caller names its flag or variable.
    #[staticmethod]
    fn parse(py: Python<'_>, name: &str, text: &str) -> PyResult<Py<PyAny>> {
        let field = spec(name)?;
        to_python(py, parse_field(field, text).py()?)
    }

    fn __getattr__(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        match self.inner.get(name) {
            Ok(value) => to_python(py, value),
            Err(_) => Err(PyAttributeError::new_err(format!(
                "'ServerConfig' object has no attribute {name:?}"
            ))),
        }
    }

    fn __dir__(slf: &Bound<'_, Self>) -> PyResult<Vec<String>> {
        let mut names: Vec<String> = SidecarConfig::FIELDS
            .iter()
            .map(|f| f.name.to_string())
            .collect();
        for name in slf.get_type().dir()?.iter() {
            names.push(name.extract()?);
        }
        Ok(names)
    }

    /// Every setting by name.
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for f in SidecarConfig::FIELDS {
            d.set_item(f.name, to_python(py, self.inner.get(f.name).py()?)?)?;
        }
        Ok(d)
    }

    /// A copy with the given settings changed.
    #[pyo3(signature = (**changes))]
    fn replace(&self, changes: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let mut values = Vec::new();
        for f in SidecarConfig::FIELDS {
            values.push((f.name.to_string(), self.inner.get(f.name).py()?));
        }
        values.extend(values_of(changes)?);
        let inner = SidecarConfig::from_values(values).py()?;
        Ok(PyServerConfig { inner })
    }

    /// Pickles as `functools.partial(ServerConfig, **settings)()`.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let settings = slf.get().as_dict(py)?;
        let rebuild =
            py.import("functools")?
                .call_method("partial", (slf.get_type(),), Some(&settings))?;
        PyTuple::new(py, [rebuild, PyTuple::empty(py).into_any()])
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let mut parts = Vec::new();
        for f in SidecarConfig::FIELDS {
            let value = to_python(py, self.inner.get(f.name).py()?)?;
            parts.push(format!("{}={}", f.name, value.bind(py).repr()?));
        }
        Ok(format!("ServerConfig({})", parts.join(", ")))
    }
}

/// The socket a sidecar listens on when none is configured.
#[pyfunction]
pub fn default_socket_path() -> std::ffi::OsString {
    lmcache_rc_core::rpc::default_socket_path().into_os_string()
}

/// A size for people in binary units (`8.0 GiB`, `100 bytes`): how the core's
/// messages and the CLI print sizes.
#[pyfunction]
pub fn human_size(bytes: u64) -> String {
    lmcache_rc_core::units::human_size(bytes)
}

/// Seconds in a duration: a number of seconds, or a number with a unit ms,
/// s, m, h, d or w (`30`, `2.5`, `30s`, `5m`, `36h`, `1.5d`); the one duration
/// grammar of every setting. `InvalidInput` (a `ValueError`) otherwise.
#[pyfunction(name = "parse_duration")]
pub fn parse_duration_seconds(text: &str) -> PyResult<f64> {
    parse_duration(text)
        .map(|d| d.as_secs_f64())
        .ok_or_else(|| invalid(format!("expected {DURATION_GRAMMAR}, got {text:?}")))
}

/// The default L1 pool size (a quarter of the available memory, ≤ 1 GiB).
#[pyfunction]
pub fn default_l1_bytes() -> u64 {
    lmcache_rc_core::store::shm::default_l1_bytes()
}
