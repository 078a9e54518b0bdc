//! The checkpoint operation set in Python: one definition of every method
//! of `CheckpointService` and `Client` (each with an `*_async` twin), the
//! conversion of every result type, `Lease`, and the generic `Future`.
//!
//! Both classes wrap a [`Checkpoints`] implementation (the in-process
//! service, the RPC client) and get their protocol methods from
//! [`checkpoint_pymethods!`], which generates them from the core's operation
//! table; a method converts its arguments ([`PyArg`]), calls the typed
//! operation with the GIL released, and converts the result with
//! [`ToPython`]. Nothing here builds wire requests.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use lmcache_rc_core::protocol::{
    Capabilities, ChangeBatch, ClearReport, EngineReport, GenerationInfo, Lease, Located, Pending,
    ServiceStatus, Slot,
};
use lmcache_rc_core::{Error, ErrorKind, Manifest, Prefix, Result};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyTuple, PyType};

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

/// A result that crosses as plain Python values: its serde form (a struct
/// is a dict of its fields in declaration order, through pythonize), so
/// each field is written once, on the protocol type.
fn plain<T: serde::Serialize>(py: Python<'_>, value: &T) -> PyResult<Py<PyAny>> {
    Ok(pythonize::pythonize(py, value)?.unbind())
}

impl ToPython for Capabilities {
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        plain(py, &self)
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

/// `{"manifest": Manifest, "tiers": [{tier, pages, bytes, ...}]}`, or None.
impl ToPython for Option<Located> {
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let Some(located) = self else {
            return Ok(py.None());
        };
        let d = PyDict::new(py);
        d.set_item("manifest", Py::new(py, PyManifest::wrap(located.manifest))?)?;
        d.set_item("tiers", plain(py, &located.tiers)?)?;
        Ok(d.into_any().unbind())
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
        plain(py, &self)
    }
}

impl ToPython for ChangeBatch {
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        plain(py, &self)
    }
}

impl ToPython for Vec<GenerationInfo> {
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        plain(py, &self)
    }
}

impl ToPython for Vec<EngineReport> {
    fn to_python(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        plain(py, &self)
    }
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

/// How an argument of an operation arrives from Python: the parameter pyo3
/// extracts, the value held for the call, and the core argument borrowed
/// from it. Implemented for the function-pointer type `fn(T)` of each
/// argument type `T` of the core's operation table (as the wire's
/// `WireArg` is), so the generated methods can name `<fn(&[Prefix]) as
/// PyArg>::Param<'py>`.
pub(crate) trait PyArg {
    /// What the Python method takes (pyo3 extracts it: a wrong type raises
    /// `TypeError` naming the argument).
    type Param<'py>;
    /// What the call holds while the GIL is released.
    type Held<'py>;
    /// The core argument.
    type Arg<'a>;
    /// Converts the parameter (raises what the conversion raises).
    fn hold<'py>(param: Self::Param<'py>) -> PyResult<Self::Held<'py>>;
    /// The core argument borrowed from the held value.
    fn arg<'a, 'py>(held: &'a Self::Held<'py>) -> Self::Arg<'a>;
}

/// Arguments Python passes as they are.
macro_rules! plain_py_arg {
    ($($t:ty),*) => {$(
        impl PyArg for fn($t) {
            type Param<'py> = $t;
            type Held<'py> = $t;
            type Arg<'a> = $t;
            fn hold<'py>(param: Self::Param<'py>) -> PyResult<Self::Held<'py>> {
                Ok(param)
            }
            fn arg<'a, 'py>(held: &'a Self::Held<'py>) -> Self::Arg<'a> {
                *held
            }
        }
    )*};
}
plain_py_arg!(bool, u32, u64, Option<u32>);

/// Generation ids: any list of strings, or None for none.
impl PyArg for fn(&[String]) {
    type Param<'py> = Option<Vec<String>>;
    type Held<'py> = Vec<String>;
    type Arg<'a> = &'a [String];
    fn hold<'py>(param: Self::Param<'py>) -> PyResult<Self::Held<'py>> {
        Ok(param.unwrap_or_default())
    }
    fn arg<'a, 'py>(held: &'a Self::Held<'py>) -> Self::Arg<'a> {
        held
    }
}

/// An engine's counters: a mapping of names to non-negative integers (a
/// negative or non-integer count raises, as pyo3's extraction does).
impl PyArg for fn(&[(String, u64)]) {
    type Param<'py> = BTreeMap<String, u64>;
    type Held<'py> = Vec<(String, u64)>;
    type Arg<'a> = &'a [(String, u64)];
    fn hold<'py>(param: Self::Param<'py>) -> PyResult<Self::Held<'py>> {
        Ok(param.into_iter().collect())
    }
    fn arg<'a, 'py>(held: &'a Self::Held<'py>) -> Self::Arg<'a> {
        held
    }
}

impl PyArg for fn(&str) {
    type Param<'py> = String;
    type Held<'py> = String;
    type Arg<'a> = &'a str;
    fn hold<'py>(param: Self::Param<'py>) -> PyResult<Self::Held<'py>> {
        Ok(param)
    }
    fn arg<'a, 'py>(held: &'a Self::Held<'py>) -> Self::Arg<'a> {
        held
    }
}

impl PyArg for fn(&Manifest) {
    type Param<'py> = PyRef<'py, PyManifest>;
    type Held<'py> = PyRef<'py, PyManifest>;
    type Arg<'a> = &'a Manifest;
    fn hold<'py>(param: Self::Param<'py>) -> PyResult<Self::Held<'py>> {
        Ok(param)
    }
    fn arg<'a, 'py>(held: &'a Self::Held<'py>) -> Self::Arg<'a> {
        &held.inner
    }
}

/// The roots: any iterable of `Prefix` objects.
impl PyArg for fn(&[Prefix]) {
    type Param<'py> = Bound<'py, PyAny>;
    type Held<'py> = Vec<Prefix>;
    type Arg<'a> = &'a [Prefix];
    fn hold<'py>(param: Self::Param<'py>) -> PyResult<Self::Held<'py>> {
        roots_of(&param)
    }
    fn arg<'a, 'py>(held: &'a Self::Held<'py>) -> Self::Arg<'a> {
        held
    }
}

/// Defines the protocol methods of a Python class wrapping a
/// `Checkpoints + CheckpointsAsync` implementation returned by `self.$api()`
/// (a `PyResult`: it raises `ForkedProcess` in a forked child), followed by
/// the class's own methods (one `#[pymethods]` block per class). Callers
/// import `Checkpoints` and `CheckpointsAsync`.
///
/// Every operation of the core's table (`lmcache_rc_core::for_each_operation!`)
/// gets a blocking method and its `*_async` twin, with the table's Python
/// signature; the arguments are converted by [`PyArg`], the GIL is released
/// around the call, the result is converted by [`ToPython`]. Operations the
/// table marks `py by_hand` are written out here (`clear`).
macro_rules! checkpoint_pymethods {
    // The operation table, handed back by the core's macro.
    ([@table $class:ty, $api:ident, { $($own:tt)* }] $({
        $(#[$doc:meta])*
        $tag:literal $variant:ident
        fn $name:ident / $name_async:ident ( $($arg:ident : $ty:ty),* ) -> $out:ty; py $py:tt
    })*) => {
        $crate::protocol::checkpoint_pymethods!(@munch [$class, $api] { $($own)* } []
            $([$py ($(#[$doc])*) $name $name_async ($($arg : $ty),*)])*);
    };
    // All operations done: the class's one `#[pymethods]` block.
    (@munch [$class:ty, $api:ident] { $($own:tt)* } [$($methods:tt)*]) => {
        #[pymethods]
        impl $class {
            $($methods)*

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
                $crate::protocol::call(py, || Checkpoints::clear(api, force, all_tiers))
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
                Ok($crate::protocol::start(py, || CheckpointsAsync::clear_async(api, force, all_tiers)))
            }

            $($own)*
        }
    };
    // An operation whose methods are written out above.
    (@munch $class:tt $own:tt [$($methods:tt)*] [by_hand $($skip:tt)*] $($rest:tt)*) => {
        $crate::protocol::checkpoint_pymethods!(@munch $class $own [$($methods)*] $($rest)*);
    };
    // An operation with a Python signature: its two methods.
    (@munch [$class:ty, $api:ident] $own:tt [$($methods:tt)*]
        [($($sig:tt)*) ($(#[$doc:meta])*) $name:ident $name_async:ident ($($arg:ident : $ty:ty),*)]
        $($rest:tt)*
    ) => {
        $crate::protocol::checkpoint_pymethods!(@munch [$class, $api] $own [
            $($methods)*

            $(#[$doc])*
            #[pyo3(signature = ($($sig)*))]
            fn $name<'py>(
                &self,
                py: Python<'py>,
                $($arg: <fn($ty) as $crate::protocol::PyArg>::Param<'py>),*
            ) -> PyResult<Py<PyAny>> {
                $(let $arg = <fn($ty) as $crate::protocol::PyArg>::hold($arg)?;)*
                $(let $arg = <fn($ty) as $crate::protocol::PyArg>::arg(&$arg);)*
                let api = self.$api()?;
                $crate::protocol::call(py, || Checkpoints::$name(api, $($arg),*))
            }
            #[doc = concat!("`", stringify!($name), "` without waiting.")]
            #[pyo3(signature = ($($sig)*))]
            fn $name_async<'py>(
                &self,
                py: Python<'py>,
                $($arg: <fn($ty) as $crate::protocol::PyArg>::Param<'py>),*
            ) -> PyResult<$crate::protocol::PyFuture> {
                $(let $arg = <fn($ty) as $crate::protocol::PyArg>::hold($arg)?;)*
                $(let $arg = <fn($ty) as $crate::protocol::PyArg>::arg(&$arg);)*
                let api = self.$api()?;
                Ok($crate::protocol::start(py, || CheckpointsAsync::$name_async(api, $($arg),*)))
            }
        ] $($rest)*);
    };
    // The entry point: `checkpoint_pymethods!(Class, api, { own methods })`.
    ($class:ty, $api:ident, { $($own:tt)* }) => {
        lmcache_rc_core::for_each_operation!(checkpoint_pymethods, @table $class, $api, { $($own)* });
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
    /// Resolved by whichever thread reads the connection: a waiter, `done()`,
    /// or the client's watcher thread (usable only in this process).
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
