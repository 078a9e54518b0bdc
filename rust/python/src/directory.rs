//! `rc.Directory`: the durable checkpoint directory on its own
//! (`docs/design/manifests.md#the-directorys-contract`).
//! Every method runs with the GIL released (they all touch SQLite).
//!
//! The lookup path (`find`, `ancestors`) copies nothing: a `TokenRoots` is
//! read in place (its roots are never built as `Prefix` objects), and an
//! iterable of `Prefix` is borrowed from the frozen Python objects, which this
//! call keeps alive while the GIL is released. What is left of a call is the
//! argument check, one GIL release and one `Manifest` object for the answer.

use std::path::PathBuf;
use std::time::Duration;

use lmcache_rc_core::index::{Directory, DirectoryConfig};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList};

use crate::errors::{IntoPyResult, invalid};
use crate::fork::Owned;
use crate::identity::{PyManifest, PyPrefix, PyTokenRoots};

/// Reads a capacity: a positive int (bool and float refused, as the reference does).
fn capacity(value: &Bound<'_, PyAny>) -> PyResult<u64> {
    let ok = !value.is_instance_of::<PyBool>() && value.is_instance_of::<pyo3::types::PyInt>();
    match value.extract::<u64>() {
        Ok(v) if ok && v > 0 => Ok(v),
        _ => Err(invalid(
            "checkpoint directory capacities must be positive integers",
        )),
    }
}

/// The query of `find` / `ancestors`: a `TokenRoots` (read in place) or the
/// `Prefix` objects of an iterable (held, and borrowed without copying).
enum Roots<'py> {
    Tokens(Bound<'py, PyTokenRoots>),
    Prefixes(Vec<Bound<'py, PyPrefix>>),
}

impl<'py> Roots<'py> {
    fn extract(roots: &Bound<'py, PyAny>, method: &str) -> PyResult<Self> {
        if let Ok(tokens) = roots.cast::<PyTokenRoots>() {
            return Ok(Roots::Tokens(tokens.clone()));
        }
        let wrong = || {
            crate::errors::invalid_type(format!(
                "{method} takes lmcache_rc.TokenRoots or an iterable of lmcache_rc.Prefix"
            ))
        };
        let items = roots.try_iter().map_err(|_| wrong())?;
        let mut prefixes = Vec::with_capacity(roots.len().unwrap_or(0));
        for item in items {
            prefixes.push(item?.cast_into::<PyPrefix>().map_err(|_| wrong())?);
        }
        Ok(Roots::Prefixes(prefixes))
    }
}

/// The directory of published generations (path None = in memory).
#[pyclass(name = "Directory", module = "lmcache_rc._native", frozen)]
pub struct PyDirectory {
    inner: Owned<Directory>,
}

#[pymethods]
impl PyDirectory {
    #[new]
    #[pyo3(signature = (path = None, *, max_entries = None, max_pending = None, max_bytes = None))]
    fn new(
        py: Python<'_>,
        path: Option<PathBuf>,
        max_entries: Option<&Bound<'_, PyAny>>,
        max_pending: Option<&Bound<'_, PyAny>>,
        max_bytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let mut config = DirectoryConfig::default();
        if let Some(v) = max_entries {
            config.max_entries = capacity(v)?;
        }
        if let Some(v) = max_pending {
            config.max_pending = capacity(v)?;
        }
        if let Some(v) = max_bytes {
            config.max_bytes = Some(capacity(v)?);
        }
        let inner = py
            .detach(|| Directory::open(path.as_deref(), config))
            .py()?;
        Ok(PyDirectory {
            inner: Owned::new("Directory", inner),
        })
    }

    /// Stages a manifest; False = identical one pending/published or no capacity.
    fn begin(&self, py: Python<'_>, manifest: &PyManifest) -> PyResult<bool> {
        let dir = self.inner.get()?;
        py.detach(|| dir.begin(&manifest.inner)).py()
    }

    /// Records that `rank` committed; True only for the call that published.
    fn acknowledge(&self, py: Python<'_>, generation: &str, rank: i64) -> PyResult<bool> {
        let dir = self.inner.get()?;
        let rank = u32::try_from(rank)
            .map_err(|_| invalid("checkpoint acknowledgement rank is out of range"))?;
        py.detach(|| dir.acknowledge(generation, rank))
            .py()
            .map(|p| p.published)
    }

    /// Drops a pending generation (unknown ids are ignored).
    fn abort(&self, py: Python<'_>, generation: &str) -> PyResult<()> {
        let dir = self.inner.get()?;
        py.detach(|| dir.abort(generation)).py().map(|_| ())
    }

    /// Drops pending generations older than `seconds`; returns them.
    fn abort_stale(&self, py: Python<'_>, seconds: f64) -> PyResult<Vec<String>> {
        let dir = self.inner.get()?;
        if !(seconds.is_finite() && seconds >= 0.0) {
            return Err(invalid(
                "abort_stale takes a non-negative number of seconds",
            ));
        }
        py.detach(|| dir.abort_stale(Duration::from_secs_f64(seconds)))
            .py()
    }

    /// True iff this identical manifest is pending.
    fn is_pending(&self, py: Python<'_>, manifest: &PyManifest) -> PyResult<bool> {
        let dir = self.inner.get()?;
        py.detach(|| dir.is_pending(&manifest.inner)).py()
    }

    /// The longest published generation matching the roots, or None.
    fn find(&self, py: Python<'_>, roots: &Bound<'_, PyAny>) -> PyResult<Option<PyManifest>> {
        let dir = self.inner.get()?;
        let found = match Roots::extract(roots, "find")? {
            Roots::Tokens(tokens) => {
                // Frozen: the roots are immutable and `tokens` keeps them alive.
                let tokens = &tokens.get().inner;
                py.detach(|| dir.find_roots(tokens))
            }
            Roots::Prefixes(held) => {
                let queries: Vec<&lmcache_rc_core::Prefix> =
                    held.iter().map(|p| &p.get().inner).collect();
                py.detach(|| dir.find(&queries))
            }
        };
        found.py().map(|m| m.map(PyManifest::wrap))
    }

    /// Published manifest of a generation, or None (no recency refresh).
    fn get(&self, py: Python<'_>, generation: &str) -> PyResult<Option<PyManifest>> {
        let dir = self.inner.get()?;
        py.detach(|| dir.get(generation))
            .py()
            .map(|m| m.map(PyManifest::wrap))
    }

    /// Published proper prefixes of the query sequence, shortest first.
    fn ancestors(
        &self,
        py: Python<'_>,
        roots: &Bound<'_, PyAny>,
        below_tokens: u64,
    ) -> PyResult<Vec<PyManifest>> {
        let dir = self.inner.get()?;
        let found = match Roots::extract(roots, "ancestors")? {
            Roots::Tokens(tokens) => {
                let tokens = &tokens.get().inner;
                py.detach(|| dir.ancestors_roots(tokens, below_tokens))
            }
            Roots::Prefixes(held) => {
                let queries: Vec<&lmcache_rc_core::Prefix> =
                    held.iter().map(|p| &p.get().inner).collect();
                py.detach(|| dir.ancestors(&queries, below_tokens))
            }
        };
        found
            .py()
            .map(|ms| ms.into_iter().map(PyManifest::wrap).collect())
    }

    /// Delists one generation (never its replacement); False if unknown.
    fn invalidate(&self, py: Python<'_>, generation: &str) -> PyResult<bool> {
        let dir = self.inner.get()?;
        py.detach(|| dir.invalidate(generation)).py()
    }

    /// Marks published generations durable (their payload objects are on
    /// disk) in one synced transaction shared with concurrent callers;
    /// per input, whether it is published.
    fn mark_durable(&self, py: Python<'_>, generations: Vec<String>) -> PyResult<Vec<bool>> {
        let dir = self.inner.get()?;
        py.detach(|| dir.mark_durable(&generations)).py()
    }

    /// Published generations with durability and bytes, ordered by id.
    #[pyo3(signature = (after = None, limit = 1000))]
    fn list<'py>(
        &self,
        py: Python<'py>,
        after: Option<String>,
        limit: usize,
    ) -> PyResult<Bound<'py, PyList>> {
        let dir = self.inner.get()?;
        let page = py.detach(|| dir.list(after.as_deref(), limit)).py()?;
        let out = PyList::empty(py);
        for g in page.generations {
            let d = PyDict::new(py);
            d.set_item("manifest", PyManifest::wrap(g.manifest))?;
            d.set_item("durable", g.durable)?;
            d.set_item("payload_bytes", g.payload_bytes)?;
            d.set_item("access_order", g.access_order)?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Writes recency stamps kept in memory; returns how many.
    fn flush_recency(&self, py: Python<'_>) -> PyResult<usize> {
        let dir = self.inner.get()?;
        py.detach(|| dir.flush_recency()).py()
    }

    /// Counts: published_generations, pending_generations, published_bytes, ...
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let dir = self.inner.get()?;
        let s = py.detach(|| dir.status()).py()?;
        let d = PyDict::new(py);
        d.set_item("published_generations", s.published_generations)?;
        d.set_item("pending_generations", s.pending_generations)?;
        d.set_item("published_bytes", s.published_bytes)?;
        d.set_item("durable_generations", s.durable_generations)?;
        d.set_item("dirty_recency", s.dirty_recency)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("invalid_rows", s.invalid_rows)?;
        d.set_item("durability_fsyncs", s.durability_fsyncs)?;
        d.set_item("publish_transactions", s.publish_transactions)?;
        Ok(d)
    }

    /// Flushes recency, drops pending generations, closes the database.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let dir = self.inner.get()?;
        py.detach(|| dir.close()).py()
    }
}
