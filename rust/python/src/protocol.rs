//! The checkpoint operation set in Python: one definition of every method
//! of `CheckpointService` and `Client` (each with an `*_async` twin), the
//! conversion of every result type, `Lease`, and the generic `Future`.
//!
//! Both classes wrap a [`Checkpoints`] implementation (the in-process
//! service, the RPC client) and get their protocol methods from
//! [`checkpoint_pymethods!`]; a method converts its arguments, calls the
//! typed operation with the GIL released, and converts the result with
//! [`ToPython`]. Nothing here builds wire requests.

use std::time::{Duration, Instant};

use lmcache_rc_core::protocol::{
    Capabilities, ClearReport, GenerationInfo, Lease, Pending, ServiceStatus, Slot,
};
use lmcache_rc_core::{Error, ErrorKind, Manifest, Prefix, Result};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyTuple, PyType};

use crate::errors::{IntoPyResult, invalid, to_pyerr};
use crate::fork::Owned;
use crate::identity::{PyManifest, PyPrefix};

/// A protocol result as a Python object.
pub(crate) trait ToPython {
    /// The Python value (a dict, a `Lease`, a `Manifest`, a bool, None...).
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>>;
}

impl ToPython for () {
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(py.None())
    }
}

impl ToPython for bool {
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(PyBool::new(py, self).to_owned().into_any().unbind())
    }
}

impl ToPython for u64 {
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(self.into_pyobject(py)?.into_any().unbind())
    }
}

impl ToPython for Capabilities {
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(capabilities_dict(py, self)?.into_any().unbind())
    }
}

impl ToPython for Option<Manifest> {
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        match self {
            Some(m) => Ok(Py::new(py, PyManifest::wrap(m))?.into_any()),
            None => Ok(py.None()),
        }
    }
}

impl ToPython for Lease {
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(Py::new(py, PyLease::from(self))?.into_any())
    }
}

impl ToPython for ServiceStatus {
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let d = PyDict::new(py);
        for (k, v) in self.values {
            d.set_item(k, v)?;
        }
        let misses = PyDict::new(py);
        for (k, v) in self.misses {
            misses.set_item(k, v)?;
        }
        d.set_item("misses", misses)?;
        for (k, v) in self.info {
            d.set_item(k, v)?;
        }
        Ok(d.into_any().unbind())
    }
}

impl ToPython for ClearReport {
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let d = PyDict::new(py);
        d.set_item("l1_objects", self.l1_objects)?;
        d.set_item("l1_bytes", self.l1_bytes)?;
        d.set_item("l2_objects", self.l2_objects)?;
        d.set_item("retired_generations", self.retired_generations)?;
        d.set_item("kept_objects", self.kept_objects)?;
        Ok(d.into_any().unbind())
    }
}

impl ToPython for Vec<GenerationInfo> {
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let out = PyList::empty(py);
        for g in self {
            let d = PyDict::new(py);
            d.set_item("generation", g.generation)?;
            d.set_item("num_tokens", g.num_tokens)?;
            d.set_item("world_size", g.world_size)?;
            d.set_item("payload_bytes", g.payload_bytes)?;
            d.set_item("durable", g.durable)?;
            d.set_item("access_order", g.access_order)?;
            out.append(d)?;
        }
        Ok(out.into_any().unbind())
    }
}

/// The capabilities dict (also the transfer engine's `capabilities()`).
pub(crate) fn capabilities_dict(py: Python<'_>, c: Capabilities) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("format_version", c.format_version)?;
    d.set_item("protocol_version", c.protocol_version)?;
    d.set_item("pool_id", c.pool_id)?;
    d.set_item("pool_size", c.pool_size)?;
    d.set_item("durable_index", c.durable_index)?;
    Ok(d)
}

/// Runs one blocking operation with the GIL released and converts its result.
pub(crate) fn call<T: ToPython + Send>(
    py: Python<'_>,
    op: impl FnOnce() -> Result<T> + Send,
) -> PyResult<Py<PyAny>> {
    py.detach(op).py()?.to_python(py)
}

/// Starts one `*_async` operation with the GIL released (sending may block
/// on a full socket) and wraps its future.
pub(crate) fn start<T: ToPython + Send + 'static>(
    py: Python<'_>,
    op: impl FnOnce() -> Pending<T> + Send,
) -> PyFuture {
    PyFuture {
        pending: Owned::new("Future", Box::new(py.detach(op))),
    }
}

/// The prefixes of an iterable of `Prefix` objects.
pub(crate) fn roots_of(roots: &Bound<'_, PyAny>) -> PyResult<Vec<Prefix>> {
    roots
        .try_iter()?
        .map(|r| Ok(r?.cast::<PyPrefix>()?.get().inner.clone()))
        .collect()
}

/// Defines the protocol methods of a Python class wrapping a
/// `Checkpoints + CheckpointsAsync` implementation returned by `self.$api()`
/// (a `PyResult`: it raises `ForkedProcess` in a forked child), followed by
/// the class's own methods (one `#[pymethods]` block per class). Callers
/// import `Checkpoints` and `CheckpointsAsync`.
///
/// Operations are listed by the shape of their arguments; each line gives
/// the blocking method and its `*_async` twin.
macro_rules! checkpoint_pymethods {
    ($class:ty, $api:ident, { $($own:tt)* }) => {
        $crate::protocol::checkpoint_pymethods!(@methods $class, $api,
            no_args: [
                /// format_version, protocol_version, pool_id, pool_size, durable_index.
                capabilities / capabilities_async;
                /// Counters and gauges (over RPC: plus the RPC layer's); every
                /// value an integer, `misses` a map reason -> count.
                status / status_async;
                /// Every listed generation: generation, num_tokens, world_size,
                /// payload_bytes, durable, access_order.
                list_generations / list_generations_async;
            ],
            manifest_rank: [
                /// Leases slots for one rank's pages: status ready | busy | miss.
                prepare_store / prepare_store_async;
                /// Starts a retrieve: status pending | miss.
                begin_retrieve / begin_retrieve_async;
            ],
            lease_rank: [
                /// Polls a retrieve: pending | ready | miss. With `rank`, a
                /// lease another rank obtained is refused.
                poll_retrieve / poll_retrieve_async;
                /// Ends an exposed retrieve lease after the copy drained.
                finish_retrieve / finish_retrieve_async;
                /// Cancels a retrieve that exposed nothing; never invalidates.
                cancel_retrieve / cancel_retrieve_async;
            ],
            own: { $($own)* }
        );
    };
    (@methods $class:ty, $api:ident,
        no_args: [$( $(#[$d0:meta])* $n0:ident / $a0:ident; )*],
        manifest_rank: [$( $(#[$d1:meta])* $n1:ident / $a1:ident; )*],
        lease_rank: [$( $(#[$d2:meta])* $n2:ident / $a2:ident; )*],
        own: { $($own:tt)* }
    ) => {
        #[pymethods]
        impl $class {
            $(
                $(#[$d0])*
                fn $n0(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
                    let api = self.$api()?;
                    $crate::protocol::call(py, || Checkpoints::$n0(api))
                }
                #[doc = concat!("`", stringify!($n0), "` without waiting.")]
                fn $a0(&self, py: Python<'_>) -> PyResult<$crate::protocol::PyFuture> {
                    let api = self.$api()?;
                    Ok($crate::protocol::start(py, || CheckpointsAsync::$a0(api)))
                }
            )*
            $(
                $(#[$d1])*
                fn $n1(&self, py: Python<'_>, manifest: &PyManifest, rank: u32) -> PyResult<Py<PyAny>> {
                    let api = self.$api()?;
                    $crate::protocol::call(py, || api.$n1(&manifest.inner, rank))
                }
                #[doc = concat!("`", stringify!($n1), "` without waiting.")]
                fn $a1(
                    &self,
                    py: Python<'_>,
                    manifest: &PyManifest,
                    rank: u32,
                ) -> PyResult<$crate::protocol::PyFuture> {
                    let api = self.$api()?;
                    Ok($crate::protocol::start(py, || api.$a1(&manifest.inner, rank)))
                }
            )*
            $(
                $(#[$d2])*
                #[pyo3(signature = (lease_id, *, rank = None))]
                fn $n2(&self, py: Python<'_>, lease_id: &str, rank: Option<u32>) -> PyResult<Py<PyAny>> {
                    let api = self.$api()?;
                    $crate::protocol::call(py, || api.$n2(lease_id, rank))
                }
                #[doc = concat!("`", stringify!($n2), "` without waiting.")]
                #[pyo3(signature = (lease_id, *, rank = None))]
                fn $a2(
                    &self,
                    py: Python<'_>,
                    lease_id: &str,
                    rank: Option<u32>,
                ) -> PyResult<$crate::protocol::PyFuture> {
                    let api = self.$api()?;
                    Ok($crate::protocol::start(py, || api.$a2(lease_id, rank)))
                }
            )*

            /// The longest listed generation matching the roots (a candidate).
            fn find(&self, py: Python<'_>, roots: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
                let roots = $crate::protocol::roots_of(roots)?;
                let api = self.$api()?;
                $crate::protocol::call(py, || api.find(&roots))
            }
            /// `find` without waiting.
            fn find_async(
                &self,
                py: Python<'_>,
                roots: &Bound<'_, PyAny>,
            ) -> PyResult<$crate::protocol::PyFuture> {
                let roots = $crate::protocol::roots_of(roots)?;
                let api = self.$api()?;
                Ok($crate::protocol::start(py, || api.find_async(&roots)))
            }

            /// Stages a generation; False = duplicate, no pending capacity,
            /// or the server is shutting down.
            fn begin(&self, py: Python<'_>, manifest: &PyManifest) -> PyResult<Py<PyAny>> {
                let api = self.$api()?;
                $crate::protocol::call(py, || api.begin(&manifest.inner))
            }
            /// `begin` without waiting.
            fn begin_async(&self, py: Python<'_>, manifest: &PyManifest) -> PyResult<$crate::protocol::PyFuture> {
                let api = self.$api()?;
                Ok($crate::protocol::start(py, || api.begin_async(&manifest.inner)))
            }

            /// Aborts a pending generation.
            fn abort(&self, py: Python<'_>, generation: &str) -> PyResult<Py<PyAny>> {
                let api = self.$api()?;
                $crate::protocol::call(py, || api.abort(generation))
            }
            /// `abort` without waiting.
            fn abort_async(&self, py: Python<'_>, generation: &str) -> PyResult<$crate::protocol::PyFuture> {
                let api = self.$api()?;
                Ok($crate::protocol::start(py, || api.abort_async(generation)))
            }

            /// Ends a store lease; True only for the call that published.
            /// With `rank`, a lease another rank obtained is refused.
            #[pyo3(signature = (lease_id, success, *, rank = None))]
            fn finish_store(
                &self,
                py: Python<'_>,
                lease_id: &str,
                success: bool,
                rank: Option<u32>,
            ) -> PyResult<Py<PyAny>> {
                let api = self.$api()?;
                $crate::protocol::call(py, || api.finish_store(lease_id, success, rank))
            }
            /// `finish_store` without waiting.
            #[pyo3(signature = (lease_id, success, *, rank = None))]
            fn finish_store_async(
                &self,
                py: Python<'_>,
                lease_id: &str,
                success: bool,
                rank: Option<u32>,
            ) -> PyResult<$crate::protocol::PyFuture> {
                let api = self.$api()?;
                Ok($crate::protocol::start(py, || api.finish_store_async(lease_id, success, rank)))
            }

            /// Drops L1 copies (and L2 files with all_tiers). `force`
            /// omitted (None) means forced, the reference's default
            /// (`protocol::CLEAR_FORCE_DEFAULT`); a forced clear is refused
            /// with LeasesLive while leases are live.
            #[pyo3(signature = (force = None, all_tiers = false))]
            fn clear(
                &self,
                py: Python<'_>,
                force: Option<bool>,
                all_tiers: bool,
            ) -> PyResult<Py<PyAny>> {
                let api = self.$api()?;
                let force = lmcache_rc_core::protocol::clear_force(force);
                $crate::protocol::call(py, || api.clear(force, all_tiers))
            }
            /// `clear` without waiting.
            #[pyo3(signature = (force = None, all_tiers = false))]
            fn clear_async(
                &self,
                py: Python<'_>,
                force: Option<bool>,
                all_tiers: bool,
            ) -> PyResult<$crate::protocol::PyFuture> {
                let api = self.$api()?;
                let force = lmcache_rc_core::protocol::clear_force(force);
                Ok($crate::protocol::start(py, || api.clear_async(force, all_tiers)))
            }

            /// Retires every listed generation of one namespace and
            /// returns how many (other namespaces are untouched; pending
            /// generations too). Their pages leave RAM and disk once no
            /// lease holds them.
            fn invalidate_namespace(&self, py: Python<'_>, namespace: &str) -> PyResult<Py<PyAny>> {
                let api = self.$api()?;
                $crate::protocol::call(py, || api.invalidate_namespace(namespace))
            }
            /// `invalidate_namespace` without waiting.
            fn invalidate_namespace_async(
                &self,
                py: Python<'_>,
                namespace: &str,
            ) -> PyResult<$crate::protocol::PyFuture> {
                let api = self.$api()?;
                Ok($crate::protocol::start(py, || api.invalidate_namespace_async(namespace)))
            }

            $($own)*
        }
    };
}
pub(crate) use checkpoint_pymethods;

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
    /// The pool whose bytes the slots are (a ready lease; None otherwise).
    #[pyo3(get)]
    pool_id: Option<String>,
    slots: Vec<Vec<Slot>>,
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
    /// The slots per page group (the classes' `lease_arrays`).
    pub(crate) fn slot_groups(&self) -> &[Vec<Slot>] {
        &self.slots
    }

    /// The pool the slots are in, when the lease names one.
    pub(crate) fn pool(&self) -> Option<&str> {
        self.pool_id.as_deref()
    }
}

impl From<Lease> for PyLease {
    fn from(lease: Lease) -> Self {
        PyLease {
            status: lease.status.as_str(),
            lease_id: lease.lease_id,
            reason: lease.reason.map(|r| r.as_str()),
            pool_id: lease.pool_id,
            slots: lease.slots,
        }
    }
}

/// A pending protocol result of any type, converted to Python when waited for.
trait AnyPending: Send + Sync {
    fn operation(&self) -> &'static str;
    fn is_done(&self) -> bool;
    /// Waits up to `slice` with the GIL released; the result converted with it.
    fn wait_py(&self, py: Python<'_>, slice: Duration) -> Result<PyResult<Py<PyAny>>>;
}

impl<T: ToPython + Send + 'static> AnyPending for Pending<T> {
    fn operation(&self) -> &'static str {
        Pending::operation(self)
    }
    fn is_done(&self) -> bool {
        Pending::is_done(self)
    }
    fn wait_py(&self, py: Python<'_>, slice: Duration) -> Result<PyResult<Py<PyAny>>> {
        let value = py.detach(|| self.wait(Some(slice)))?;
        Ok(value.to_python(py))
    }
}

/// The pending result of an `*_async` call (`Future[T]` in the stubs).
#[pyclass(name = "Future", module = "lmcache_rc._native", frozen)]
pub struct PyFuture {
    /// Resolved by the client's reader thread (usable only in this process).
    pending: Owned<Box<dyn AnyPending>>,
}

#[pymethods]
impl PyFuture {
    /// `Future[T]` in annotations evaluated at run time is `Future` itself.
    #[classmethod]
    fn __class_getitem__(cls: &Bound<'_, PyType>, _item: &Bound<'_, PyAny>) -> Py<PyType> {
        cls.clone().unbind()
    }

    /// Whether the reply (or the failure) is in.
    fn done(&self) -> PyResult<bool> {
        Ok(self.pending.get()?.is_done())
    }

    /// Waits up to `timeout` seconds (None = until done) and returns the
    /// call's result or raises its error; raises `RpcTimeout` (and stays
    /// pending) if the reply did not come in time. Ctrl-C interrupts a wait.
    #[pyo3(signature = (timeout = None))]
    fn result(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let pending = self.pending.get()?;
        let deadline = match timeout {
            Some(t) if !(t.is_finite() && t >= 0.0) => {
                return Err(invalid("timeout must be a non-negative number of seconds"));
            }
            Some(t) => Some(Instant::now() + Duration::from_secs_f64(t.min(1e9))),
            None => None,
        };
        loop {
            let slice = deadline.map_or(Duration::from_millis(100), |d| {
                d.saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(100))
            });
            match pending.wait_py(py, slice) {
                Ok(converted) => return converted,
                Err(e) if e.kind() == ErrorKind::Timeout && !pending.is_done() => {
                    py.check_signals()?;
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(to_pyerr(Error::Timeout(format!(
                            "no reply to {} within {} s",
                            pending.operation(),
                            timeout.unwrap_or_default()
                        ))));
                    }
                }
                Err(e) => return Err(to_pyerr(e)),
            }
        }
    }

    fn __repr__(&self) -> String {
        match self.pending.local() {
            Some(p) => format!(
                "Future({}, done={})",
                p.operation(),
                if p.is_done() { "True" } else { "False" }
            ),
            None => "Future(a forked child's copy: unusable)".to_string(),
        }
    }
}
