//! The shared tier's garbage collection for Python (`lmcache-rc shared gc`):
//! one call of [`SharedTier::gc`] on a tier opened from a URL (credentials
//! and endpoint from the standard `AWS_*` environment).

use lmcache_rc_core::shared::{SharedConfig, SharedTier};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::IntoPyResult;

/// Removes manifests older than `older_than` seconds from the shared tier at
/// `url`, then the pages older than that which no remaining manifest names;
/// returns what it did (see `lmcache_rc.results.SharedGcReport`). Refuses an
/// age below the tier's safety margin (InvalidInput). Runs without the GIL.
#[pyfunction]
pub fn shared_gc<'py>(py: Python<'py>, url: &str, older_than: f64) -> PyResult<Bound<'py, PyDict>> {
    let older_than = lmcache_rc_core::units::seconds(older_than).py()?;
    let config = SharedConfig::new(url);
    let report = py
        .detach(|| SharedTier::open(config).and_then(|tier| tier.gc(older_than)))
        .py()?;
    let out = PyDict::new(py);
    out.set_item("namespaces", report.namespaces)?;
    out.set_item("manifests_deleted", report.manifests_deleted)?;
    out.set_item("manifests_kept", report.manifests_kept)?;
    out.set_item("pages_deleted", report.pages_deleted)?;
    out.set_item("pages_referenced", report.pages_referenced)?;
    out.set_item("pages_young", report.pages_young)?;
    let skipped = PyList::empty(py);
    for (namespace, why) in report.skipped {
        skipped.append((namespace, why))?;
    }
    out.set_item("skipped", skipped)?;
    Ok(out)
}

/// The smallest age `shared_gc` accepts, in seconds (the upload bound plus
/// the refresh age plus twice the allowed clock skew).
#[pyfunction]
pub fn shared_min_gc_age() -> f64 {
    SharedConfig::new("").min_gc_age().as_secs_f64()
}
