//! The in-process checkpoint service as a Python class, `CheckpointService`
//! (its protocol methods come from `protocol.rs`), and zero-copy views of
//! lease slots. Every call that may block (SQLite, waits for space, L2 I/O)
//! runs with the GIL released.

use std::ffi::{CStr, c_int, c_void};
use std::time::Duration;

use lmcache_rc_core::protocol::{Checkpoints, CheckpointsAsync};
use lmcache_rc_core::service::CheckpointService;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::config::PyServerConfig;
use crate::errors::{IntoPyResult, invalid};
use crate::fork::Owned;
use crate::protocol::{PyLease, checkpoint_pymethods};

/// The checkpoint service running in this process (tests, notebooks, the
/// embedded server). Same methods as `lmcache_rc.Client`.
#[pyclass(name = "CheckpointService", module = "lmcache_rc._native", frozen)]
pub struct PyCheckpointService {
    inner: Owned<CheckpointService>,
}

impl PyCheckpointService {
    /// The service the protocol methods call (not in a forked child).
    fn api(&self) -> PyResult<&CheckpointService> {
        self.inner.get()
    }
}

checkpoint_pymethods!(PyCheckpointService, api, {
    /// Opens the service with the settings of `config` (a `ServerConfig`).
    #[new]
    fn new(py: Python<'_>, config: &PyServerConfig) -> PyResult<Self> {
        for warning in config.inner.deprecations() {
            log::warn!("{warning}");
        }
        let config = config.inner.service_config().py()?;
        let inner = py.detach(|| CheckpointService::open(config)).py()?;
        Ok(PyCheckpointService {
            inner: Owned::new("CheckpointService", inner),
        })
    }

    /// Closes the service; raises LeasesLive while copies hold leases.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let service = self.api()?;
        py.detach(|| service.close()).py()
    }

    /// Waits until every queued L2 write finished (True) or the timeout passed.
    #[pyo3(signature = (timeout = 30.0))]
    fn wait_l2_idle(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let timeout = Duration::from_secs_f64(timeout.clamp(0.0, 3600.0));
        let service = self.api()?;
        Ok(py.detach(|| service.wait_l2_idle(timeout)))
    }

    /// A writable zero-copy uint8 numpy array over `length` bytes of the SHM
    /// pool at `offset` (a lease slot). Only touch it while the lease is live.
    fn slot_array<'py>(
        slf: &Bound<'py, Self>,
        offset: u64,
        length: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let pool = slf.get().api()?.pool();
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
});

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
        let pool = me
            .owner
            .get()
            .inner
            .local()
            .ok_or_else(|| PyBufferError::new_err("the service belongs to another process"))?
            .pool();
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
