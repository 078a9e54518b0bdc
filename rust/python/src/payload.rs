//! `CheckpointPayload`: the typed schema-2 payload (core
//! `manifest::CheckpointPayload`), built and parsed by the core so that
//! Python and Rust write byte-identical payloads and check them with the
//! same rules.

use lmcache_rc_core::json::Value;
use lmcache_rc_core::manifest::parse_lower_hex32;
use lmcache_rc_core::{CheckpointPayload, PageGroup};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyMapping, PyString};

use crate::convert::{exact_u64, identity_value, value_to_py};
use crate::errors::{IntoPyResult, invalid, invalid_type};

/// A schema-2 checkpoint payload: `worker_layout` (an address-free dict),
/// `page_groups` (dicts with `name`, `page_bytes`, `positions`,
/// `content_keys`), and optional `draft_prefix_len` / `kind` (boundary mode,
/// together) and `num_tokens`. `build` writes the exact bytes of
/// `json.dumps(payload, sort_keys=True, separators=(",", ":"),
/// allow_nan=False).encode()`; `parse` validates bytes with the same rules.
#[pyclass(name = "CheckpointPayload", module = "lmcache_rc._native", frozen, eq)]
#[derive(PartialEq)]
pub struct PyCheckpointPayload {
    inner: CheckpointPayload,
}

/// Converts the constructor's keyword arguments to the core type
/// (validated by the caller through `validate`/`build`).
fn payload_of(
    worker_layout: &Bound<'_, PyAny>,
    page_groups: &Bound<'_, PyAny>,
    draft_prefix_len: Option<&Bound<'_, PyAny>>,
    kind: Option<String>,
    num_tokens: Option<&Bound<'_, PyAny>>,
) -> PyResult<CheckpointPayload> {
    let layout = identity_value(worker_layout)?;
    if !matches!(layout, Value::Object(_)) {
        return Err(invalid_type(format!(
            "worker_layout must be a mapping, got {}",
            worker_layout.get_type().name()?
        )));
    }
    if page_groups.is_instance_of::<PyString>() || page_groups.is_instance_of::<PyMapping>() {
        return Err(invalid_type("page_groups must be a sequence of mappings"));
    }
    let mut groups = Vec::new();
    for (index, group) in page_groups.try_iter()?.enumerate() {
        groups.push(group_of(index, &group?)?);
    }
    let optional = |v: Option<&Bound<'_, PyAny>>, what: &str| -> PyResult<Option<u64>> {
        match v {
            Some(v) if !v.is_none() => exact_u64(v, what).map(Some),
            _ => Ok(None),
        }
    };
    Ok(CheckpointPayload {
        worker_layout: layout,
        page_groups: groups,
        draft_prefix_len: optional(draft_prefix_len, "draft_prefix_len")?,
        kind,
        num_tokens: optional(num_tokens, "num_tokens")?,
    })
}

const GROUP_KEYS: [&str; 4] = ["name", "page_bytes", "positions", "content_keys"];

/// One page group from a mapping with exactly the four keys.
fn group_of(index: usize, group: &Bound<'_, PyAny>) -> PyResult<PageGroup> {
    let mapping = group.cast::<PyMapping>().map_err(|_| {
        invalid_type(format!(
            "page group #{index} must be a mapping with {}",
            GROUP_KEYS.join(", ")
        ))
    })?;
    for key in mapping.keys()?.iter() {
        let known = key
            .extract::<String>()
            .is_ok_and(|k| GROUP_KEYS.contains(&k.as_str()));
        if !known {
            return Err(invalid(format!(
                "page group #{index} has an unknown key {} (known: {})",
                key.repr()?,
                GROUP_KEYS.join(", ")
            )));
        }
    }
    let get = |key: &str| -> PyResult<Bound<'_, PyAny>> {
        mapping
            .get_item(key)
            .map_err(|_| invalid(format!("page group #{index} has no {key}")))
    };
    let name = get("name")?;
    let name = name
        .cast::<PyString>()
        .map_err(|_| invalid_type(format!("page group #{index}: name must be a str")))?
        .to_str()?
        .to_owned();
    let page_bytes = exact_u64(
        &get("page_bytes")?,
        &format!("page group #{index}: page_bytes"),
    )?;
    let mut positions = Vec::new();
    for p in get("positions")?.try_iter()? {
        positions.push(exact_u64(&p?, &format!("page group #{index}: a position"))?);
    }
    let mut content_keys = Vec::new();
    for k in get("content_keys")?.try_iter()? {
        let k = k?;
        let text = k
            .cast::<PyString>()
            .map_err(|_| invalid_type(format!("page group #{index}: content keys must be str")))?;
        content_keys.push(parse_lower_hex32(text.to_str()?).ok_or_else(|| {
            invalid(format!(
                "page group #{index}: content keys must be 64 lowercase hex characters"
            ))
        })?);
    }
    Ok(PageGroup {
        name,
        page_bytes,
        positions,
        content_keys,
    })
}

#[pymethods]
impl PyCheckpointPayload {
    /// Validates a payload (`InvalidInput` / `InvalidType` say what is wrong).
    #[new]
    #[pyo3(signature = (*, worker_layout, page_groups, draft_prefix_len = None, kind = None, num_tokens = None))]
    fn new(
        worker_layout: &Bound<'_, PyAny>,
        page_groups: &Bound<'_, PyAny>,
        draft_prefix_len: Option<&Bound<'_, PyAny>>,
        kind: Option<String>,
        num_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let inner = payload_of(
            worker_layout,
            page_groups,
            draft_prefix_len,
            kind,
            num_tokens,
        )?;
        inner.validate().py()?;
        Ok(PyCheckpointPayload { inner })
    }

    /// The canonical payload bytes of these fields (validated): what
    /// `json.dumps(..., sort_keys=True, separators=(",", ":"),
    /// allow_nan=False).encode()` writes for the same dict.
    #[staticmethod]
    #[pyo3(signature = (*, worker_layout, page_groups, draft_prefix_len = None, kind = None, num_tokens = None))]
    fn build<'py>(
        py: Python<'py>,
        worker_layout: &Bound<'py, PyAny>,
        page_groups: &Bound<'py, PyAny>,
        draft_prefix_len: Option<&Bound<'py, PyAny>>,
        kind: Option<String>,
        num_tokens: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let inner = payload_of(
            worker_layout,
            page_groups,
            draft_prefix_len,
            kind,
            num_tokens,
        )?;
        let bytes = py.detach(|| inner.build()).py()?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Parses and validates payload bytes (the GIL is released meanwhile).
    #[staticmethod]
    fn parse(py: Python<'_>, payload: &[u8]) -> PyResult<Self> {
        let inner = py.detach(|| CheckpointPayload::parse(payload)).py()?;
        Ok(PyCheckpointPayload { inner })
    }

    /// The canonical bytes of this payload.
    fn to_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = py.detach(|| self.inner.build()).py()?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Always 2.
    #[getter]
    fn schema_version(&self) -> u8 {
        CheckpointPayload::SCHEMA_VERSION
    }

    /// The workers' address-free byte layout (a new dict on every access).
    #[getter]
    fn worker_layout<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        value_to_py(py, &self.inner.worker_layout)
    }

    /// The page groups: dicts with `name`, `page_bytes`, `positions` and
    /// `content_keys` (lowercase hex), like `Manifest.page_groups()`.
    #[getter]
    fn page_groups<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for g in &self.inner.page_groups {
            let d = PyDict::new(py);
            d.set_item("name", &g.name)?;
            d.set_item("page_bytes", g.page_bytes)?;
            d.set_item("positions", &g.positions)?;
            d.set_item(
                "content_keys",
                g.content_keys
                    .iter()
                    .map(|k| lmcache_rc_core::identity::to_hex(k))
                    .collect::<Vec<_>>(),
            )?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Boundary mode: the draft prefix length (None in upstream mode).
    #[getter]
    fn draft_prefix_len(&self) -> Option<u64> {
        self.inner.draft_prefix_len
    }

    /// Boundary mode: the checkpoint kind (None in upstream mode).
    #[getter]
    fn kind(&self) -> Option<&str> {
        self.inner.kind.as_deref()
    }

    /// Tokens covered, when recorded.
    #[getter]
    fn num_tokens(&self) -> Option<u64> {
        self.inner.num_tokens
    }

    fn __repr__(&self) -> String {
        let opt = |v: Option<u64>| v.map_or_else(|| "None".to_string(), |v| v.to_string());
        format!(
            "CheckpointPayload(groups={}, pages={}, kind={}, draft_prefix_len={}, num_tokens={})",
            self.inner.page_groups.len(),
            self.inner
                .page_groups
                .iter()
                .map(|g| g.positions.len())
                .sum::<usize>(),
            self.inner
                .kind
                .as_ref()
                .map_or_else(|| "None".to_string(), |k| format!("{k:?}")),
            opt(self.inner.draft_prefix_len),
            opt(self.inner.num_tokens)
        )
    }
}
