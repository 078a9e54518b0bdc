//! Python classes for the in-process checkpoint service: `CheckpointService`,
//! `Lease` and zero-copy views of lease slots. Every call that may block
//! (SQLite, waits for space, L2 I/O) runs with the GIL released.

use std::ffi::{CStr, c_int, c_void};
use std::path::PathBuf;
use std::time::Duration;

use lmcache_rc_core::service::{self, CheckpointService, ServiceConfig};
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::errors::{IntoPyResult, invalid};
use crate::identity::{PyManifest, PyPrefix};

/// Reads an optional attribute of the config object.
pub(crate) fn attr<'py>(
    config: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    match config.getattr(name) {
        Ok(v) if v.is_none() => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(_) => Ok(None),
    }
}

pub(crate) fn seconds(value: &Bound<'_, PyAny>, name: &str) -> PyResult<Duration> {
    let s: f64 = value.extract()?;
    if !(s.is_finite() && s >= 0.0) {
        return Err(invalid(format!(
            "{name} must be a non-negative number of seconds"
        )));
    }
    Ok(Duration::from_secs_f64(s))
}

/// Builds the core config from any object with `ServerConfig`'s attributes.
pub fn service_config(config: &Bound<'_, PyAny>) -> PyResult<ServiceConfig> {
    let mut out = ServiceConfig::default();
    if let Some(v) = attr(config, "shm_name")? {
        out.shm_name = v.extract()?;
    }
    if let Some(v) = attr(config, "l1_bytes")? {
        out.l1_bytes = v.extract()?;
    }
    out.l2_path = attr(config, "l2_path")?
        .map(|v| v.extract::<PathBuf>())
        .transpose()?;
    out.l2_bytes = attr(config, "l2_bytes")?.map(|v| v.extract()).transpose()?;
    out.checkpoint_index_path = attr(config, "checkpoint_index_path")?
        .map(|v| v.extract::<PathBuf>())
        .transpose()?;
    if let Some(v) = attr(config, "max_entries")? {
        out.max_entries = v.extract()?;
    }
    if let Some(v) = attr(config, "max_pending")? {
        out.max_pending = v.extract()?;
    }
    if let Some(v) = attr(config, "max_leases")? {
        out.max_leases = v.extract()?;
    }
    if let Some(v) = attr(config, "store_admission_timeout")? {
        out.store_admission_timeout = seconds(&v, "store_admission_timeout")?;
    }
    if let Some(v) = attr(config, "retrieve_timeout")? {
        out.retrieve_timeout = seconds(&v, "retrieve_timeout")?;
    }
    out.abandoned_after = attr(config, "abandoned_after")?
        .map(|v| seconds(&v, "abandoned_after"))
        .transpose()?;
    if let Some(v) = attr(config, "l2_io_threads")? {
        out.l2_io_threads = v.extract()?;
    }
    Ok(out)
}

/// The answer of a lease call.
#[pyclass(name = "Lease", module = "lmcache_rc._native", frozen)]
pub struct PyLease {
    /// "ready" | "busy" | "miss" | "pending".
    #[pyo3(get)]
    status: &'static str,
    /// The lease to finish (None for busy/miss).
    #[pyo3(get)]
    lease_id: Option<String>,
    /// Why a miss happened (None otherwise).
    #[pyo3(get)]
    reason: Option<&'static str>,
    slots: Vec<Vec<Option<(u64, u64)>>>,
}

#[pymethods]
impl PyLease {
    /// Per page group, per page: `(offset, length)` in the SHM pool, or None
    /// for a store page that is already resident (do not copy).
    #[getter]
    fn slots<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let groups = self
            .slots
            .iter()
            .map(|g| PyTuple::new(py, g.iter().copied()))
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, groups)
    }
    fn __repr__(&self) -> String {
        let pages: usize = self.slots.iter().map(Vec::len).sum();
        let quoted = |v: Option<&str>| v.map_or_else(|| "None".to_string(), |s| format!("'{s}'"));
        format!(
            "Lease(status='{}', lease_id={}, pages={pages}, reason={})",
            self.status,
            quoted(self.lease_id.as_deref()),
            quoted(self.reason)
        )
    }
}

impl PyLease {
    /// The slots per page group (shared with `Client.lease_arrays`).
    pub(crate) fn slot_groups(&self) -> &[Vec<Option<(u64, u64)>>] {
        &self.slots
    }
}

impl From<service::Lease> for PyLease {
    fn from(lease: service::Lease) -> Self {
        PyLease {
            status: lease.status.as_str(),
            lease_id: lease.lease_id,
            reason: lease.reason,
            slots: lease.slots,
        }
    }
}

/// The capabilities dict (shared with `Client`).
pub(crate) fn capabilities_dict(
    py: Python<'_>,
    c: service::Capabilities,
) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("format_version", c.format_version)?;
    d.set_item("protocol_version", c.protocol_version)?;
    d.set_item("shm_name", c.shm_name)?;
    d.set_item("pool_size", c.pool_size)?;
    d.set_item("durable_index", c.durable_index)?;
    Ok(d)
}

/// The status dict: every value an integer, `misses` a map reason -> count.
pub(crate) fn status_dict(
    py: Python<'_>,
    status: service::ServiceStatus,
) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in status.values {
        d.set_item(k, v)?;
    }
    let misses = PyDict::new(py);
    for (k, v) in status.misses {
        misses.set_item(k, v)?;
    }
    d.set_item("misses", misses)?;
    Ok(d)
}

/// The clear report dict.
pub(crate) fn clear_dict(py: Python<'_>, r: service::ClearReport) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("l1_objects", r.l1_objects)?;
    d.set_item("l1_bytes", r.l1_bytes)?;
    d.set_item("l2_objects", r.l2_objects)?;
    d.set_item("retired_generations", r.retired_generations)?;
    d.set_item("kept_objects", r.kept_objects)?;
    Ok(d)
}

/// The checkpoint service running in this process (tests, notebooks, the
/// embedded server). Same methods as `lmcache_rc.Client`.
#[pyclass(name = "CheckpointService", module = "lmcache_rc._native", frozen)]
pub struct PyCheckpointService {
    inner: CheckpointService,
}

pub(crate) fn roots_of(roots: &Bound<'_, PyAny>) -> PyResult<Vec<lmcache_rc_core::Prefix>> {
    roots
        .try_iter()?
        .map(|r| Ok(r?.cast::<PyPrefix>()?.get().inner.clone()))
        .collect()
}

#[pymethods]
impl PyCheckpointService {
    #[new]
    fn new(py: Python<'_>, config: &Bound<'_, PyAny>) -> PyResult<Self> {
        let config = service_config(config)?;
        let inner = py.detach(|| CheckpointService::open(config)).py()?;
        Ok(PyCheckpointService { inner })
    }

    /// format_version, protocol_version, shm_name, pool_size, durable_index.
    fn capabilities<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        capabilities_dict(py, self.inner.capabilities())
    }

    /// The longest listed generation matching the roots (a candidate).
    fn find(&self, py: Python<'_>, roots: &Bound<'_, PyAny>) -> PyResult<Option<PyManifest>> {
        let roots = roots_of(roots)?;
        let found = py.detach(|| self.inner.find(&roots)).py()?;
        Ok(found.map(PyManifest::wrap))
    }

    /// Stages a generation; False = duplicate or no pending capacity.
    fn begin(&self, py: Python<'_>, manifest: &PyManifest) -> PyResult<bool> {
        py.detach(|| self.inner.begin(&manifest.inner)).py()
    }

    /// Aborts a pending generation.
    fn abort(&self, py: Python<'_>, generation: &str) -> PyResult<()> {
        py.detach(|| self.inner.abort(generation)).py()
    }

    /// Leases slots for one rank's pages: status ready | busy | miss.
    fn prepare_store(&self, py: Python<'_>, manifest: &PyManifest, rank: u32) -> PyResult<PyLease> {
        py.detach(|| self.inner.prepare_store(&manifest.inner, rank))
            .py()
            .map(PyLease::from)
    }

    /// Ends a store lease; True only for the call that published.
    fn finish_store(&self, py: Python<'_>, lease_id: &str, success: bool) -> PyResult<bool> {
        py.detach(|| self.inner.finish_store(lease_id, success))
            .py()
    }

    /// Starts a retrieve: status pending | miss.
    fn begin_retrieve(
        &self,
        py: Python<'_>,
        manifest: &PyManifest,
        rank: u32,
    ) -> PyResult<PyLease> {
        py.detach(|| self.inner.begin_retrieve(&manifest.inner, rank))
            .py()
            .map(PyLease::from)
    }

    /// Polls a retrieve: pending | ready | miss.
    fn poll_retrieve(&self, py: Python<'_>, lease_id: &str) -> PyResult<PyLease> {
        py.detach(|| self.inner.poll_retrieve(lease_id))
            .py()
            .map(PyLease::from)
    }

    /// Ends an exposed retrieve lease after the copy drained.
    fn finish_retrieve(&self, py: Python<'_>, lease_id: &str) -> PyResult<()> {
        py.detach(|| self.inner.finish_retrieve(lease_id)).py()
    }

    /// Cancels a retrieve that exposed nothing; never invalidates.
    fn cancel_retrieve(&self, py: Python<'_>, lease_id: &str) -> PyResult<()> {
        py.detach(|| self.inner.cancel_retrieve(lease_id)).py()
    }

    /// Counters and gauges; `misses` maps reason -> count.
    fn status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let status = py.detach(|| self.inner.status()).py()?;
        status_dict(py, status)
    }

    /// Drops L1 copies (and L2 files with all_tiers); see DESIGN §7.
    #[pyo3(signature = (force = false, all_tiers = false))]
    fn clear<'py>(
        &self,
        py: Python<'py>,
        force: bool,
        all_tiers: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let r = py.detach(|| self.inner.clear(force, all_tiers)).py()?;
        clear_dict(py, r)
    }

    /// Every listed generation: generation, num_tokens, world_size,
    /// payload_bytes, durable, access_order.
    fn list_generations<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let generations = py.detach(|| self.inner.list_generations()).py()?;
        generations_list(py, generations)
    }

    /// Closes the service; raises LeasesLive while copies hold leases.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.close()).py()
    }

    /// Waits until every queued L2 write finished (True) or the timeout passed.
    #[pyo3(signature = (timeout = 30.0))]
    fn wait_l2_idle(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let timeout = Duration::from_secs_f64(timeout.clamp(0.0, 3600.0));
        Ok(py.detach(|| self.inner.wait_l2_idle(timeout)))
    }

    /// A writable zero-copy uint8 numpy array over `length` bytes of the SHM
    /// pool at `offset` (a lease slot). Only touch it while the lease is live.
    fn slot_array<'py>(
        slf: &Bound<'py, Self>,
        offset: u64,
        length: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let pool = slf.get().inner.pool();
        let end = offset.checked_add(length);
        if length == 0 || end.is_none_or(|e| e > pool.size()) {
            return Err(invalid(format!(
                "slot ({offset}, {length}) is outside the {}-byte pool",
                pool.size()
            )));
        }
        let view = SlotView {
            owner: slf.clone().unbind(),
            offset,
            length,
        };
        let numpy = py.import("numpy")?;
        numpy.call_method1(
            "frombuffer",
            (Bound::new(py, view)?, numpy.getattr("uint8")?),
        )
    }

    /// The slots of a lease as numpy arrays (None for pages not to copy).
    fn lease_arrays<'py>(slf: &Bound<'py, Self>, lease: &PyLease) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let out = PyList::empty(py);
        for group in lease.slot_groups() {
            let arrays = PyList::empty(py);
            for slot in group {
                match slot {
                    Some((offset, length)) => {
                        arrays.append(Self::slot_array(slf, *offset, *length)?)?
                    }
                    None => arrays.append(py.None())?,
                }
            }
            out.append(arrays)?;
        }
        Ok(out)
    }
}

/// A buffer-protocol window into the SHM pool that keeps the service alive.
#[pyclass(module = "lmcache_rc._native", frozen)]
pub struct SlotView {
    owner: Py<PyCheckpointService>,
    offset: u64,
    length: u64,
}

#[pymethods]
impl SlotView {
    /// Exposes the bytes as a writable 1-D unsigned-byte buffer.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("null Py_buffer"));
        }
        let me = slf.get();
        let pool = me.owner.get().inner.pool();
        let len =
            isize::try_from(me.length).map_err(|_| PyBufferError::new_err("slot too large"))?;
        // SAFETY: bounds were checked in slot_array; the pool mapping lives as
        // long as `owner`, which this object (the buffer's `obj`) keeps alive.
        let buf = unsafe { pool.as_ptr().add(me.offset as usize) };
        // SAFETY: `view` is non-null and valid per the buffer protocol; `buf`
        // points at `len` bytes that live as long as `slf` (see above).
        unsafe { fill_byte_buffer(view, slf.into_any(), buf, len, flags) };
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// Fills `view` as a writable 1-D unsigned-byte buffer of `len` bytes at
/// `buf`, owned by `owner` (shared by every buffer class of the binding).
///
/// # Safety
///
/// `view` must be a valid, non-null `Py_buffer` to fill (buffer protocol),
/// and `buf` must point at `len` writable bytes that stay valid as long as
/// `owner` lives (the buffer keeps a reference to it).
pub(crate) unsafe fn fill_byte_buffer(
    view: *mut ffi::Py_buffer,
    owner: Bound<'_, PyAny>,
    buf: *mut u8,
    len: isize,
    flags: c_int,
) {
    static FORMAT: &CStr = c"B";
    // SAFETY: the caller guarantees `view` is a valid Py_buffer to fill.
    unsafe {
        (*view).obj = owner.into_ptr();
        (*view).buf = buf.cast::<c_void>();
        (*view).len = len;
        (*view).readonly = 0;
        (*view).itemsize = 1;
        (*view).format = if flags & ffi::PyBUF_FORMAT != 0 {
            FORMAT.as_ptr().cast_mut()
        } else {
            std::ptr::null_mut()
        };
        (*view).ndim = 1;
        (*view).shape = if flags & ffi::PyBUF_ND != 0 {
            &raw mut (*view).len
        } else {
            std::ptr::null_mut()
        };
        (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
            &raw mut (*view).itemsize
        } else {
            std::ptr::null_mut()
        };
        (*view).suboffsets = std::ptr::null_mut();
        (*view).internal = std::ptr::null_mut();
    }
}

/// Listed generations as a list of dicts (`lmcache-rc inspect`).
pub(crate) fn generations_list<'py>(
    py: Python<'py>,
    generations: Vec<lmcache_rc_core::service::GenerationInfo>,
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for g in generations {
        let d = PyDict::new(py);
        d.set_item("generation", g.generation)?;
        d.set_item("num_tokens", g.num_tokens)?;
        d.set_item("world_size", g.world_size)?;
        d.set_item("payload_bytes", g.payload_bytes)?;
        d.set_item("durable", g.durable)?;
        d.set_item("access_order", g.access_order)?;
        out.append(d)?;
    }
    Ok(out)
}
