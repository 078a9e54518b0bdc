//! Python classes for identity: `Prefix`, `TokenRoots`, `Manifest` and the
//! namespace / generation functions. Thin wrappers; all rules live in the core.

use lmcache_rc_core::identity;
use lmcache_rc_core::{Manifest, Prefix, TokenRoots};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple, PyType};

use crate::convert;
use crate::errors::{IntoPyResult, invalid};

/// `recurrent-sha256-v1:<hex>` namespace of an immutable identity and a cache
/// salt. The salt is hashed exactly as given: omitted means `""`, and an
/// explicit `None` is hashed as JSON `null` (a different namespace).
#[pyfunction]
#[pyo3(signature = (identity, *args, **kwargs), text_signature = "(identity, cache_salt='')")]
pub fn checkpoint_namespace(
    identity: &Bound<'_, PyAny>,
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> PyResult<String> {
    let from_kwargs = match kwargs {
        Some(kw) => {
            if let Some(extra) = kw.keys().iter().find(|k| k.to_string() != "cache_salt") {
                return Err(crate::errors::invalid_type(format!(
                    "checkpoint_namespace() got an unexpected keyword argument {extra}"
                )));
            }
            kw.get_item("cache_salt")?
        }
        None => None,
    };
    if args.len() > 1 || (args.len() == 1 && from_kwargs.is_some()) {
        return Err(crate::errors::invalid_type(
            "checkpoint_namespace() takes an identity and one cache_salt",
        ));
    }
    let salt_obj = match args.len() {
        1 => Some(args.get_item(0)?),
        _ => from_kwargs,
    };
    let identity = convert::identity_value(identity)?;
    let salt = match salt_obj {
        Some(salt) => convert::identity_value(&salt)?,
        None => lmcache_rc_core::json::Value::Str(String::new()),
    };
    identity::checkpoint_namespace(&identity, &salt).py()
}

/// Content-derived generation id of an exact prefix and exact payload bytes.
#[pyfunction]
pub fn checkpoint_generation(prefix: &PyPrefix, payload: &[u8]) -> String {
    identity::checkpoint_generation(&prefix.inner, payload)
}

/// An exact token prefix: `prefix_hash` authenticates `start_tokens` tokens,
/// `tail_tokens` are the literal rest.
#[pyclass(name = "Prefix", module = "lmcache_rc._native", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyPrefix {
    pub inner: Prefix,
}

impl PyPrefix {
    pub fn wrap(inner: Prefix) -> Self {
        PyPrefix { inner }
    }
}

#[pymethods]
impl PyPrefix {
    #[new]
    fn new(
        namespace: &str,
        start_tokens: &Bound<'_, PyAny>,
        prefix_hash: &[u8],
        tail_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        identity::validate_namespace(namespace).py()?;
        let start = match start_tokens.extract::<i64>() {
            Ok(s) if s >= 0 && !start_tokens.is_instance_of::<pyo3::types::PyBool>() => s as u64,
            _ => {
                return Err(invalid("checkpoint prefix requires a nonempty token tail"));
            }
        };
        let tail = convert::tokens(tail_tokens)?;
        let inner = Prefix::new(namespace, start, prefix_hash.to_vec(), tail).py()?;
        Ok(PyPrefix { inner })
    }

    /// The namespace this prefix belongs to.
    #[getter]
    fn namespace(&self) -> &str {
        self.inner.namespace()
    }
    /// Tokens authenticated by `prefix_hash`.
    #[getter]
    fn start_tokens(&self) -> u64 {
        self.inner.start_tokens()
    }
    /// 0 or 32 bytes.
    #[getter]
    fn prefix_hash<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.prefix_hash())
    }
    /// The literal tail tokens.
    #[getter]
    fn tail_tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.inner.tail_tokens())
    }
    /// `start_tokens + len(tail_tokens)`.
    #[getter]
    fn num_tokens(&self) -> u64 {
        self.inner.num_tokens()
    }
    /// Scheme-(b) page content key of this prefix (not used by the scheduler).
    fn content_key(&self, discriminator: &str) -> String {
        self.inner.content_key(discriminator)
    }
    fn __repr__(&self) -> String {
        let tail = self.inner.tail_tokens();
        let shown: Vec<String> = tail.iter().take(8).map(u32::to_string).collect();
        let more = if tail.len() > 8 { ", ..." } else { "" };
        format!(
            "Prefix(namespace={:?}, start_tokens={}, num_tokens={}, tail_tokens=[{}{}])",
            self.inner.namespace(),
            self.inner.start_tokens(),
            self.inner.num_tokens(),
            shown.join(", "),
            more
        )
    }
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyType>, Bound<'py, PyTuple>)> {
        let py = slf.py();
        let me = slf.get();
        let args = (
            me.inner.namespace(),
            me.inner.start_tokens(),
            PyBytes::new(py, me.inner.prefix_hash()),
            PyTuple::new(py, me.inner.tail_tokens())?,
        );
        Ok((py.get_type::<PyPrefix>(), args.into_pyobject(py)?))
    }
}

/// One query root per hash chunk of a token sequence.
#[pyclass(name = "TokenRoots", module = "lmcache_rc._native", frozen)]
pub struct PyTokenRoots {
    pub inner: TokenRoots,
}

#[pymethods]
impl PyTokenRoots {
    /// The default hash unit, `identity::DEFAULT_CHUNK_TOKENS` (its one
    /// written source; Python's defaults read it here).
    #[classattr]
    const DEFAULT_CHUNK_TOKENS: u32 = identity::DEFAULT_CHUNK_TOKENS;

    /// Hashes `tokens` (a sequence of int or a 1-D numpy integer array) into
    /// chained roots of `chunk_tokens` tokens each (None:
    /// `DEFAULT_CHUNK_TOKENS`). Runs without the GIL.
    #[staticmethod]
    #[pyo3(signature = (namespace, tokens, chunk_tokens = None))]
    fn build(
        py: Python<'_>,
        namespace: String,
        tokens: &Bound<'_, PyAny>,
        chunk_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let tokens = convert::tokens(tokens)?;
        // Anything outside 1..=65536 (including huge ints) reaches the core's
        // "hash unit" error.
        let chunk = match chunk_tokens {
            None => identity::DEFAULT_CHUNK_TOKENS,
            Some(c) => u32::try_from(convert::boundary(c)?).unwrap_or(0),
        };
        let inner = py
            .detach(|| TokenRoots::build(namespace, tokens, chunk))
            .py()?;
        Ok(PyTokenRoots { inner })
    }

    /// The namespace of every root.
    #[getter]
    fn namespace(&self) -> &str {
        self.inner.namespace()
    }
    /// Tokens per hash chunk.
    #[getter]
    fn chunk_tokens(&self) -> u32 {
        self.inner.chunk_tokens()
    }
    /// Number of tokens hashed.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.inner.len()
    }
    fn __len__(&self) -> usize {
        self.inner.len()
    }
    /// One `Prefix` per chunk, each carrying the chunk's whole tail.
    #[getter]
    fn roots<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let roots: Vec<PyPrefix> = self.inner.roots().into_iter().map(PyPrefix::wrap).collect();
        PyTuple::new(py, roots)
    }
    /// Chain digest after each chunk (32 bytes each).
    #[getter]
    fn end_hashes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(
            py,
            self.inner.end_hashes().iter().map(|h| PyBytes::new(py, h)),
        )
    }
    /// The 32-byte chain seed (prefix hash of the first root).
    #[getter]
    fn initial_chain<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.initial_chain())
    }
    /// The exact-boundary prefix of the first `n` tokens.
    fn prefix(&self, n: &Bound<'_, PyAny>) -> PyResult<PyPrefix> {
        let n = convert::boundary(n)?;
        self.inner.prefix(n).py().map(PyPrefix::wrap)
    }
    /// The 32-byte digest authenticating exactly the first `n` tokens.
    fn token_digest<'py>(
        &self,
        py: Python<'py>,
        n: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let n = convert::boundary(n)?;
        let digest = self.inner.token_digest(n).py()?;
        Ok(PyBytes::new(py, &digest))
    }
    /// Roots-based page key of the page ending at token `n` with a discriminator.
    fn content_key(&self, n: &Bound<'_, PyAny>, discriminator: &str) -> PyResult<String> {
        let n = convert::boundary(n)?;
        self.inner.content_key(n, discriminator).py()
    }
    /// Page keys for `(boundary, discriminator)` pairs, in order. Runs without the GIL.
    fn content_keys(&self, py: Python<'_>, boundaries: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        let mut pairs: Vec<(u64, String)> = Vec::new();
        for item in boundaries.try_iter()? {
            let item = item?;
            let (n, d): (Bound<'_, PyAny>, String) = item.extract().map_err(|_| {
                crate::errors::invalid_type("content_keys takes (boundary, discriminator) pairs")
            })?;
            pairs.push((convert::boundary(&n)?, d));
        }
        py.detach(|| self.inner.content_keys(&pairs)).py()
    }
    fn __repr__(&self) -> String {
        format!(
            "TokenRoots(namespace={:?}, num_tokens={}, chunk_tokens={}, roots={})",
            self.inner.namespace(),
            self.inner.len(),
            self.inner.chunk_tokens(),
            self.inner.num_roots()
        )
    }
}

/// The metadata of one immutable generation.
#[pyclass(name = "Manifest", module = "lmcache_rc._native", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyManifest {
    pub inner: Manifest,
}

impl PyManifest {
    pub fn wrap(inner: Manifest) -> Self {
        PyManifest { inner }
    }
}

#[pymethods]
impl PyManifest {
    #[new]
    fn new(
        generation: String,
        prefix: &PyPrefix,
        world_size: &Bound<'_, PyAny>,
        payload: &[u8],
    ) -> PyResult<Self> {
        let world = match world_size.extract::<i64>() {
            Ok(w) if !world_size.is_instance_of::<pyo3::types::PyBool>() => {
                u32::try_from(w).unwrap_or(0)
            }
            _ => 0,
        };
        Manifest::new(generation, prefix.inner.clone(), world, payload.to_vec())
            .py()
            .map(PyManifest::wrap)
    }
    /// The generation id.
    #[getter]
    fn generation(&self) -> &str {
        self.inner.generation()
    }
    /// The exact prefix.
    #[getter]
    fn prefix(&self) -> PyPrefix {
        PyPrefix::wrap(self.inner.prefix().clone())
    }
    /// Ranks that must commit before publication.
    #[getter]
    fn world_size(&self) -> u32 {
        self.inner.world_size()
    }
    /// The exact payload bytes.
    #[getter]
    fn payload<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.payload())
    }
    /// 1 or 2.
    #[getter]
    fn schema_version(&self) -> u8 {
        self.inner.schema_version()
    }
    /// Validated page groups: a list of dicts with `name`, `page_bytes`,
    /// `positions` and `content_keys` (hex strings; empty for schema 1).
    fn page_groups<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let schema = self.inner.payload_schema().py()?;
        let out = PyList::empty(py);
        for g in schema.page_groups {
            let d = PyDict::new(py);
            d.set_item("name", g.name)?;
            d.set_item("page_bytes", g.page_bytes)?;
            d.set_item("positions", g.positions)?;
            d.set_item(
                "content_keys",
                g.content_keys.iter().map(hex_of).collect::<Vec<_>>(),
            )?;
            out.append(d)?;
        }
        Ok(out)
    }
    /// Bytes one rank stores for this generation (validates the page groups).
    fn bytes_per_rank(&self) -> PyResult<u64> {
        Ok(self.inner.payload_schema().py()?.bytes_per_rank())
    }
    fn __repr__(&self) -> String {
        format!(
            "Manifest(generation={:?}, num_tokens={}, world_size={}, payload_bytes={})",
            self.inner.generation(),
            self.inner.prefix().num_tokens(),
            self.inner.world_size(),
            self.inner.payload().len()
        )
    }
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyType>, Bound<'py, PyTuple>)> {
        let py = slf.py();
        let me = slf.get();
        let args = (
            me.inner.generation(),
            PyPrefix::wrap(me.inner.prefix().clone()),
            me.inner.world_size(),
            PyBytes::new(py, me.inner.payload()),
        );
        Ok((py.get_type::<PyManifest>(), args.into_pyobject(py)?))
    }
}

fn hex_of(key: &[u8; 32]) -> String {
    identity::to_hex(key)
}
