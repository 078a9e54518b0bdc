//! Python classes for the sidecar RPC: `Client` (the protocol methods of
//! `protocol.rs` over the typed RPC client), the embedded `Server`, and
//! zero-copy views of the pool as a client maps it. Every wait runs with the
//! GIL released.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use lmcache_rc_core::protocol::{Checkpoints, CheckpointsAsync};
use lmcache_rc_core::rpc::{Client, ClientConfig};
use lmcache_rc_core::sidecar::Sidecar;
use lmcache_rc_core::store::shm::ShmPool;
use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::ffi::c_int;

use crate::config::PyServerConfig;
use crate::errors::{IntoPyResult, invalid};
use crate::fork::Owned;
use crate::protocol::{PyLease, ToPython, checkpoint_pymethods};
use crate::service::fill_byte_buffer;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn duration(value: f64, name: &str) -> PyResult<Duration> {
    if !(value.is_finite() && value > 0.0 && value < 1e9) {
        return Err(invalid(format!(
            "{name} must be a positive number of seconds"
        )));
    }
    Ok(Duration::from_secs_f64(value))
}

/// A client of a sidecar socket. Thread-safe: share one between the
/// scheduler bridge and copy threads. Calls block up to `timeout` seconds
/// with the GIL released; `*_async` variants return a `Future`. After a
/// server restart calls in flight raise `Unavailable` and the next call
/// reconnects.
#[pyclass(name = "Client", module = "lmcache_rc._native", frozen)]
pub struct PyClient {
    inner: Owned<ClientParts>,
    socket: String,
}

/// What a `Client` owns: the connection (its watcher thread) and its
/// mapping of the pool.
struct ClientParts {
    client: Client,
    pool: Mutex<Option<Arc<ShmPool>>>,
}

impl PyClient {
    /// The client the protocol methods call (not in a forked child).
    fn api(&self) -> PyResult<&Client> {
        Ok(&self.inner.get()?.client)
    }

    /// The pool the server handed over at the handshake, mapped; mapped
    /// again when the server now serves another one (a restart).
    fn pool(&self, py: Python<'_>) -> PyResult<Arc<ShmPool>> {
        let parts = self.inner.get()?;
        // No lock is held while waiting without the GIL.
        let client = &parts.client;
        let current = py.detach(|| client.pool_id()).py()?;
        if let Some(p) = lock(&parts.pool).as_ref()
            && p.id() == current
        {
            return Ok(p.clone());
        }
        let pool = py
            .detach(|| {
                let (caps, fd) = client.share_pool()?;
                ShmPool::from_fd(fd, &caps.pool_id, caps.pool_size)
            })
            .py()?;
        let pool = Arc::new(pool);
        *lock(&parts.pool) = Some(pool.clone());
        Ok(pool)
    }
}

checkpoint_pymethods!(PyClient, api, {
    #[new]
    #[pyo3(signature = (socket_path, timeout = 60.0, connect_timeout = 10.0))]
    fn new(
        py: Python<'_>,
        socket_path: PathBuf,
        timeout: f64,
        connect_timeout: f64,
    ) -> PyResult<Self> {
        let config = ClientConfig {
            timeout: duration(timeout, "timeout")?,
            connect_timeout: duration(connect_timeout, "connect_timeout")?,
            ..ClientConfig::default()
        };
        let client = py
            .detach(|| Client::connect_with(&socket_path, config))
            .py()?;
        Ok(PyClient {
            socket: client.socket_path().display().to_string(),
            inner: Owned::new(
                "Client",
                ClientParts {
                    client,
                    pool: Mutex::new(None),
                },
            ),
        })
    }

    /// The socket this client talks to.
    #[getter]
    fn socket_path(&self) -> String {
        self.socket.clone()
    }

    /// Whether a live connection is open now.
    #[getter]
    fn connected(&self) -> PyResult<bool> {
        Ok(self.api()?.is_connected())
    }

    /// Closes the connection (later calls raise `Closed`). Leases obtained
    /// through this client stay live on the server until finished.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let parts = self.inner.get()?;
        py.detach(|| parts.client.close());
        *lock(&parts.pool) = None;
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    /// A writable zero-copy uint8 numpy array over `length` bytes of the SHM
    /// pool at `offset` (a lease slot), through this process's own mapping of
    /// the pool (the descriptor the server handed over, mapped on first use).
    /// Only touch it while the lease is live.
    fn slot_array<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        length: u64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let pool = self.pool(py)?;
        pool_array(py, pool, offset, length)
    }

    /// The slots of a lease as numpy arrays (None for pages not to copy).
    /// A lease of another pool than the server's current one (it restarted)
    /// is refused with InvalidInput ("replaced").
    fn lease_arrays<'py>(&self, py: Python<'py>, lease: &PyLease) -> PyResult<Bound<'py, PyList>> {
        let pool = self.pool(py)?;
        if let Some(other) = lease.pool().filter(|id| *id != pool.id()) {
            return Err(invalid(format!(
                "the lease's slots are in pool {other}, which was replaced by {} (the server \
                 restarted); nothing may be copied for it",
                pool.id()
            )));
        }
        let out = PyList::empty(py);
        for group in lease.slot_groups() {
            let arrays = PyList::empty(py);
            for slot in group {
                match slot {
                    Some((offset, length)) => {
                        arrays.append(pool_array(py, pool.clone(), *offset, *length)?)?
                    }
                    None => arrays.append(py.None())?,
                }
            }
            out.append(arrays)?;
        }
        Ok(out)
    }

    fn __repr__(&self) -> String {
        let connected = match self.inner.local() {
            Some(parts) if parts.client.is_connected() => "True",
            Some(_) => "False",
            None => "False (a forked child's copy)",
        };
        format!(
            "Client(socket_path={:?}, connected={connected})",
            self.socket
        )
    }
});

fn pool_array(
    py: Python<'_>,
    pool: Arc<ShmPool>,
    offset: u64,
    length: u64,
) -> PyResult<Bound<'_, PyAny>> {
    let end = offset.checked_add(length);
    if length == 0 || end.is_none_or(|e| e > pool.size()) {
        return Err(invalid(format!(
            "slot ({offset}, {length}) is outside the {}-byte pool",
            pool.size()
        )));
    }
    let view = MappedSlotView {
        pool,
        offset,
        length,
    };
    let numpy = py.import("numpy")?;
    numpy.call_method1(
        "frombuffer",
        (Bound::new(py, view)?, numpy.getattr("uint8")?),
    )
}

/// A buffer-protocol window into a client's mapping of the SHM pool; keeps
/// the mapping alive (see `Client.slot_array`).
#[pyclass(module = "lmcache_rc._native", frozen)]
pub struct MappedSlotView {
    pool: Arc<ShmPool>,
    offset: u64,
    length: u64,
}

#[pymethods]
impl MappedSlotView {
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
        let len =
            isize::try_from(me.length).map_err(|_| PyBufferError::new_err("slot too large"))?;
        let offset =
            usize::try_from(me.offset).map_err(|_| PyBufferError::new_err("slot too large"))?;
        // SAFETY: pool_array checked `offset + length <= size`; the mapping
        // lives as long as `me.pool`, which this object (the buffer's `obj`)
        // keeps alive.
        let buf = unsafe { me.pool.as_ptr().add(offset) };
        // SAFETY: `view` is non-null and valid per the buffer protocol; `buf`
        // points at `len` bytes that live as long as `slf` (see above).
        unsafe { fill_byte_buffer(view, slf.into_any(), buf, len, flags) };
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// The sidecar running in this process (tests, notebooks, `lmcache-rc
/// demo`, `lmcache-rc serve`): the core's `Sidecar` — the same RPC server
/// over a Unix socket and the HTTP admin API, on background threads.
#[pyclass(name = "Server", module = "lmcache_rc._native", frozen)]
pub struct PyServer {
    inner: Owned<Sidecar>,
    socket: String,
    http_url: Option<String>,
    admin_file: Option<String>,
}

impl Drop for PyServer {
    fn drop(&mut self) {
        // A server never stopped stops now, without draining (the
        // sidecar's drop). Its threads may log (which needs the GIL), so
        // wait for them without it. In a forked child there is nothing to
        // stop (see `fork`).
        if let Some(sidecar) = self.inner.local()
            && !sidecar.is_stopped()
        {
            Python::attach(|py| py.detach(|| sidecar.stop(Some(Duration::ZERO)).map(drop)))
                .unwrap_or_else(|e| log::warn!("stopping the lmcache-rc server: {e}"));
        }
    }
}

#[pymethods]
impl PyServer {
    /// Starts a server for `config` (a `ServerConfig`).
    ///
    /// `temp_socket` chooses where it listens: None (the default, embedded
    /// use) = in a fresh private temporary directory when the config's socket
    /// is the default one, else on the config's socket; False = always on the
    /// config's socket (`lmcache-rc serve`); True = always in a fresh
    /// temporary directory, so embedded servers never collide with a sidecar
    /// or with each other.
    #[staticmethod]
    #[pyo3(signature = (config, *, temp_socket = None))]
    fn start(
        py: Python<'_>,
        config: &PyServerConfig,
        temp_socket: Option<bool>,
    ) -> PyResult<PyServer> {
        let config = &config.inner;
        let sidecar = py.detach(|| Sidecar::start(config, temp_socket)).py()?;
        Ok(PyServer {
            socket: sidecar.socket_path().display().to_string(),
            http_url: sidecar.http_url().map(str::to_string),
            admin_file: sidecar.admin_file().map(|p| p.display().to_string()),
            inner: Owned::new("Server", sidecar),
        })
    }

    /// The socket clients connect to.
    #[getter]
    fn socket_path(&self) -> String {
        self.socket.clone()
    }

    /// The HTTP admin URL (`http://host:port`), or None when disabled.
    #[getter]
    fn http_url(&self) -> Option<String> {
        self.http_url.clone()
    }

    /// The HTTP admin file (`<socket>.admin.json`, mode 0600: the URL and
    /// the bearer token `POST /clear` needs), or None when HTTP is off.
    /// Removed by `stop`.
    #[getter]
    fn admin_file(&self) -> Option<String> {
        self.admin_file.clone()
    }

    /// Where a sidecar listening on `socket` writes its HTTP admin file.
    #[staticmethod]
    fn admin_file_for(socket: std::path::PathBuf) -> String {
        lmcache_rc_core::http::admin_file_for(&socket)
            .display()
            .to_string()
    }

    /// The service's status plus the RPC counters (rpc_connections, ...).
    fn status(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let sidecar = self.inner.get()?;
        let status = py.detach(|| sidecar.status()).py()?;
        status.to_python(py)
    }

    /// Graceful shutdown: stops admitting work, lets live leases finish for
    /// up to `timeout` seconds (default: the config's `drain_timeout`, else
    /// 30), closes every connection and the service (L2 queue drained,
    /// directory closed) and removes the socket. Returns a report dict
    /// (`drained`, `live_leases`, `close_error`). Idempotent.
    #[pyo3(signature = (timeout = None))]
    fn stop<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        let drain = match timeout {
            Some(t) if !(t.is_finite() && t >= 0.0) => {
                return Err(invalid("timeout must be a non-negative number of seconds"));
            }
            Some(t) => Some(Duration::from_secs_f64(t.min(1e9))),
            None => None,
        };
        let sidecar = self.inner.get()?;
        let report = py.detach(|| sidecar.stop(drain)).py()?;
        let d = PyDict::new(py);
        d.set_item("drained", report.drained)?;
        d.set_item("live_leases", report.live_leases)?;
        d.set_item("close_error", report.close_error)?;
        Ok(d)
    }

    /// Whether `stop` ran.
    #[getter]
    fn stopped(&self) -> PyResult<bool> {
        Ok(self.inner.get()?.is_stopped())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.stop(py, None)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let stopped = match self.inner.local() {
            Some(sidecar) if sidecar.is_stopped() => "True",
            Some(_) => "False",
            None => "False (a forked child's copy)",
        };
        format!("Server(socket_path={:?}, stopped={stopped})", self.socket)
    }
}
