//! `TransferEngine` and `TransferFuture`: the worker-side copy engine.
//!
//! Two forms of bound memory (core `transfer::layout`):
//!
//! - a 2-D page pool: the cpu backend binds a numpy array (uint8,
//!   C-contiguous, writable, `[num_blocks, page_bytes]`); the cuda backend a
//!   device address (e.g. a torch tensor's `data_ptr()`), which the caller
//!   keeps alive;
//! - region layouts (`cpu_regions` / `cuda_regions`): buffers plus named
//!   groups of `(buffer, offset, block_stride, length)` region templates.
//!   A host buffer is a numpy uint8 array or an `(owner, address, nbytes)`
//!   triple (e.g. a torch CPU tensor and its `data_ptr()`/`nbytes`); a
//!   device buffer is such a triple.
//!
//! The engine keeps a reference to every buffer object (the numpy array,
//! the triple's owner) for its life, so the memory cannot be freed under a
//! copy; when the engine turns unsafe the references are leaked on purpose
//! (a copy may still touch the memory).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lmcache_rc_core::rpc::{Client, ClientConfig};
use lmcache_rc_core::transfer::{
    CopyBackend, CpuBackend, EngineConfig, Fault, FaultQueue, Job, JobHandle, Outcome, PageLayout,
    PoolShape, RegionTemplate, TransferEngine, cuda,
};
use lmcache_rc_core::transfer::{Direction, cuda::CudaBackend};
use lmcache_rc_core::{Error, ErrorKind};
use numpy::{PyArray2, PyArrayDyn, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyDeprecationWarning;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyMapping, PyString, PyTuple};

use crate::convert::exact_u64;
use crate::errors::{IntoPyResult, invalid, invalid_type, to_pyerr};
use crate::fork::Owned;
use crate::identity::PyManifest;
use crate::protocol::ToPython;

/// Which backend an engine uses, with what the test hook needs.
enum BackendRef {
    Cpu(Arc<CpuBackend>),
    Cuda(Arc<CudaBackend>),
}

impl BackendRef {
    fn faults(&self) -> &FaultQueue {
        match self {
            BackendRef::Cpu(b) => b.faults(),
            BackendRef::Cuda(b) => b.faults(),
        }
    }
}

/// Background copies between this worker's KV memory and the sidecar's
/// shared memory (one engine per worker rank).
#[pyclass(name = "TransferEngine", module = "lmcache_rc._native", frozen)]
pub struct PyTransferEngine {
    /// Its copy and lease threads (usable only in this process: `fork`).
    engine: Owned<TransferEngine>,
    backend: BackendRef,
    layout: PageLayout,
    /// Keeps the bound buffers' Python objects alive (leaked when unsafe).
    owners: Vec<Py<PyAny>>,
}

/// One buffer argument: where it is, how large, and what keeps it alive.
struct BufferArg {
    address: u64,
    size: u64,
    owner: Py<PyAny>,
}

/// A host buffer: a numpy uint8 array (C-contiguous, writable), or an
/// `(owner, address, nbytes)` triple the caller vouches for.
fn host_buffer(index: usize, obj: &Bound<'_, PyAny>) -> PyResult<BufferArg> {
    if let Ok(array) = obj.cast::<PyArrayDyn<u8>>() {
        if !array.is_c_contiguous() {
            return Err(invalid(format!("buffer {index} must be C-contiguous")));
        }
        let writeable: bool = array.getattr("flags")?.getattr("writeable")?.extract()?;
        if !writeable {
            return Err(invalid(format!("buffer {index} must be writable")));
        }
        return Ok(BufferArg {
            address: array.data() as u64,
            size: array.len() as u64,
            owner: obj.clone().unbind(),
        });
    }
    if obj.is_instance_of::<numpy::PyUntypedArray>() {
        return Err(invalid_type(format!(
            "buffer {index} is a numpy array of another dtype: pass uint8 arrays (e.g. \
             `arr.view(np.uint8)`)"
        )));
    }
    raw_buffer(
        index,
        obj,
        "a numpy uint8 array or an (owner, address, nbytes) tuple",
    )
}

/// An `(owner, address, nbytes)` triple: raw memory that `owner` keeps alive.
fn raw_buffer(index: usize, obj: &Bound<'_, PyAny>, expected: &str) -> PyResult<BufferArg> {
    let tuple = obj
        .cast::<PyTuple>()
        .ok()
        .filter(|t| t.len() == 3)
        .ok_or_else(|| {
            invalid_type(format!(
                "buffer {index} must be {expected}, got {}",
                obj.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
    Ok(BufferArg {
        owner: tuple.get_item(0)?.unbind(),
        address: exact_u64(&tuple.get_item(1)?, &format!("buffer {index}'s address"))?,
        size: exact_u64(&tuple.get_item(2)?, &format!("buffer {index}'s nbytes"))?,
    })
}

/// Buffers from a sequence, each through `one`.
fn buffer_args(
    buffers: &Bound<'_, PyAny>,
    one: impl Fn(usize, &Bound<'_, PyAny>) -> PyResult<BufferArg>,
) -> PyResult<Vec<BufferArg>> {
    if buffers.is_instance_of::<PyString>() || buffers.is_instance_of::<PyMapping>() {
        return Err(invalid_type("buffers must be a sequence"));
    }
    buffers
        .try_iter()?
        .enumerate()
        .map(|(i, b)| one(i, &b?))
        .collect()
}

/// `{name: [(buffer, offset, block_stride, length), ...]}` in mapping order.
fn region_groups(groups: &Bound<'_, PyAny>) -> PyResult<Vec<(String, Vec<RegionTemplate>)>> {
    let mapping = groups.cast::<PyMapping>().map_err(|_| {
        invalid_type("groups must be a mapping {name: [(buffer, offset, block_stride, length)]}")
    })?;
    let mut out = Vec::new();
    for item in mapping.items()?.iter() {
        let (name, regions): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
        let name = name
            .cast::<PyString>()
            .map_err(|_| invalid_type("group names must be str"))?
            .to_str()?
            .to_owned();
        let mut templates = Vec::new();
        for (j, region) in regions.try_iter()?.enumerate() {
            let region = region?;
            let what = |field: &str| format!("region {j} of group {name:?}: {field}");
            let fields: Vec<Bound<'_, PyAny>> =
                region.try_iter()?.collect::<PyResult<_>>().map_err(|_| {
                    invalid_type(what("must be (buffer, offset, block_stride, length)"))
                })?;
            if fields.len() != 4 {
                return Err(invalid_type(what(
                    "must be 4 integers (buffer, offset, block_stride, length)",
                )));
            }
            let buffer = exact_u64(&fields[0], &what("buffer"))?;
            templates.push(RegionTemplate {
                buffer: usize::try_from(buffer).unwrap_or(usize::MAX),
                offset: exact_u64(&fields[1], &what("offset"))?,
                block_stride: exact_u64(&fields[2], &what("block_stride"))?,
                length: exact_u64(&fields[3], &what("length"))?,
            });
        }
        out.push((name, templates));
    }
    Ok(out)
}

fn positive_usize(value: i64, name: &str) -> PyResult<usize> {
    usize::try_from(value)
        .ok()
        .filter(|v| *v > 0)
        .ok_or_else(|| invalid(format!("{name} must be a positive integer, got {value}")))
}

/// The engine's settings as Python passes them: each None is the core's
/// default (`EngineConfig::default()`, the one written source of the
/// defaults; `TransferEngine.defaults()` shows them to Python).
/// `max_pending` is the deprecated name of `max_copies_in_flight` (accepted
/// with a `DeprecationWarning`; giving both is an error).
struct EngineArgs<'a, 'py> {
    workers: Option<i64>,
    max_copies_in_flight: Option<i64>,
    rpc_timeout: Option<f64>,
    layout: Option<&'a Bound<'py, PyAny>>,
    max_pending: Option<i64>,
}

fn engine_config(py: Python<'_>, args: EngineArgs<'_, '_>) -> PyResult<EngineConfig> {
    let defaults = EngineConfig::default();
    let in_flight = match (args.max_copies_in_flight, args.max_pending) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                "max_pending is the deprecated name of max_copies_in_flight: give only \
                 max_copies_in_flight",
            ));
        }
        (Some(v), None) => Some(v),
        (None, Some(v)) => {
            PyErr::warn(
                py,
                &py.get_type::<PyDeprecationWarning>(),
                c"TransferEngine: max_pending is deprecated, use max_copies_in_flight (the \
                  bound on copies queued or running; the sidecar's max_pending is another \
                  setting)",
                1,
            )?;
            Some(v)
        }
        (None, None) => None,
    };
    let rpc_timeout = args
        .rpc_timeout
        .unwrap_or(defaults.rpc_timeout.as_secs_f64());
    if !(rpc_timeout.is_finite() && rpc_timeout > 0.0) {
        return Err(invalid("rpc_timeout must be a positive number of seconds"));
    }
    let layout = match args.layout {
        None => None,
        Some(l) if l.is_none() => None,
        Some(l) => {
            if !l.is_instance_of::<PyDict>() {
                return Err(invalid(
                    "layout must be a dict (the worker's address-free byte layout)",
                ));
            }
            let text: String = py.import("json")?.call_method1("dumps", (l,))?.extract()?;
            Some(
                serde_json::from_str(&text)
                    .map_err(|e| invalid(format!("layout is not JSON-serialisable: {e}")))?,
            )
        }
    };
    let workers = match args.workers {
        Some(v) => positive_usize(v, "workers")?,
        None => defaults.workers,
    };
    let max_copies_in_flight = match in_flight {
        Some(v) => positive_usize(v, "max_copies_in_flight")?,
        None => defaults.max_pending,
    };
    if max_copies_in_flight < workers {
        return Err(invalid(format!(
            "max_copies_in_flight ({max_copies_in_flight}) must be at least workers ({workers})"
        )));
    }
    Ok(EngineConfig {
        workers,
        max_pending: max_copies_in_flight,
        rpc_timeout: Duration::from_secs_f64(rpc_timeout.min(1e6)),
        layout,
    })
}

fn connect(
    py: Python<'_>,
    socket_path: std::path::PathBuf,
    rpc_timeout: Duration,
) -> PyResult<Client> {
    let config = ClientConfig {
        timeout: rpc_timeout.max(Duration::from_millis(1)),
        ..ClientConfig::default()
    };
    py.detach(|| Client::connect_with(&socket_path, config))
        .py()
}

fn start(
    py: Python<'_>,
    client: Client,
    backend: Arc<dyn CopyBackend>,
    config: EngineConfig,
) -> PyResult<TransferEngine> {
    py.detach(|| TransferEngine::start(Box::new(client), backend, config))
        .py()
}

#[pymethods]
impl PyTransferEngine {
    /// A cpu-backend engine over `page_pool` (numpy uint8, C-contiguous,
    /// writable, `[num_blocks, page_bytes]`; row 0 is never touched).
    /// Connects to the sidecar at `socket_path` and maps its pool now.
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (socket_path, page_pool, *, workers = None, max_copies_in_flight = None, rpc_timeout = None, layout = None, max_pending = None))]
    fn new(
        py: Python<'_>,
        socket_path: std::path::PathBuf,
        page_pool: &Bound<'_, PyAny>,
        workers: Option<i64>,
        max_copies_in_flight: Option<i64>,
        rpc_timeout: Option<f64>,
        layout: Option<&Bound<'_, PyAny>>,
        max_pending: Option<i64>,
    ) -> PyResult<Self> {
        let config = engine_config(
            py,
            EngineArgs {
                workers,
                max_copies_in_flight,
                rpc_timeout,
                layout,
                max_pending,
            },
        )?;
        let array = page_pool.cast::<PyArray2<u8>>().map_err(|_| {
            invalid("page_pool must be a 2-D numpy uint8 array [num_blocks, page_bytes]")
        })?;
        if !array.is_c_contiguous() {
            return Err(invalid("page_pool must be C-contiguous"));
        }
        let writeable: bool = array.getattr("flags")?.getattr("writeable")?.extract()?;
        if !writeable {
            return Err(invalid("page_pool must be writable"));
        }
        let dims = array.shape();
        let shape = PoolShape {
            num_blocks: dims[0] as u64,
            page_bytes: dims[1] as u64,
        };
        // SAFETY: the array is C-contiguous with `num_blocks * page_bytes`
        // bytes at `data()`, and `self.pool` keeps it alive (and is leaked if
        // the engine turns unsafe) for as long as the backend can copy.
        let backend = Arc::new(unsafe { CpuBackend::new(array.data(), shape) }.py()?);
        let client = connect(py, socket_path, config.rpc_timeout)?;
        let engine = start(py, client, backend.clone(), config)?;
        Ok(PyTransferEngine {
            engine: Owned::new("TransferEngine", engine),
            layout: backend.layout().clone(),
            backend: BackendRef::Cpu(backend),
            owners: vec![page_pool.clone().unbind()],
        })
    }

    /// A cuda-backend engine over device memory at `device_ptr` (e.g. a
    /// contiguous uint8 CUDA tensor's `data_ptr()`) of `num_blocks` rows of
    /// `page_bytes`. Raises `DeviceError` when no CUDA driver is present.
    #[staticmethod]
    #[pyo3(signature = (socket_path, device_ptr, num_blocks, page_bytes, *, device = 0, workers = None, max_copies_in_flight = None, rpc_timeout = None, layout = None, max_pending = None))]
    #[allow(clippy::too_many_arguments)]
    fn cuda(
        py: Python<'_>,
        socket_path: std::path::PathBuf,
        device_ptr: u64,
        num_blocks: u64,
        page_bytes: u64,
        device: i32,
        workers: Option<i64>,
        max_copies_in_flight: Option<i64>,
        rpc_timeout: Option<f64>,
        layout: Option<&Bound<'_, PyAny>>,
        max_pending: Option<i64>,
    ) -> PyResult<Self> {
        let config = engine_config(
            py,
            EngineArgs {
                workers,
                max_copies_in_flight,
                rpc_timeout,
                layout,
                max_pending,
            },
        )?;
        let shape = PoolShape {
            num_blocks,
            page_bytes,
        };
        // SAFETY: the caller keeps the device allocation alive (documented).
        let backend = Arc::new(
            py.detach(|| unsafe { CudaBackend::new(device, device_ptr, shape) })
                .py()?,
        );
        let client = connect(py, socket_path, config.rpc_timeout)?;
        let engine = start(py, client, backend.clone(), config)?;
        Ok(PyTransferEngine {
            engine: Owned::new("TransferEngine", engine),
            layout: backend.layout().clone(),
            backend: BackendRef::Cuda(backend),
            owners: Vec::new(),
        })
    }

    /// A cpu-backend engine over region layouts: `buffers` (numpy uint8
    /// arrays, C-contiguous and writable, or `(owner, address, nbytes)`
    /// triples of host memory that `owner` keeps alive, e.g. a contiguous
    /// torch CPU tensor with its `data_ptr()` and `nbytes`), `groups`
    /// `{name: [(buffer, offset, block_stride, length), ...]}` (the page of
    /// group `name` at block `b` is the concatenation of
    /// `buffer[offset + b * block_stride:][:length]` over its regions), and
    /// `num_blocks` (block 0 is never touched). Buffers must not overlap.
    #[staticmethod]
    #[pyo3(signature = (socket_path, buffers, groups, num_blocks, *, workers = None, max_copies_in_flight = None, rpc_timeout = None, layout = None, max_pending = None))]
    #[allow(clippy::too_many_arguments)]
    fn cpu_regions(
        py: Python<'_>,
        socket_path: std::path::PathBuf,
        buffers: &Bound<'_, PyAny>,
        groups: &Bound<'_, PyAny>,
        num_blocks: u64,
        workers: Option<i64>,
        max_copies_in_flight: Option<i64>,
        rpc_timeout: Option<f64>,
        layout: Option<&Bound<'_, PyAny>>,
        max_pending: Option<i64>,
    ) -> PyResult<Self> {
        let config = engine_config(
            py,
            EngineArgs {
                workers,
                max_copies_in_flight,
                rpc_timeout,
                layout,
                max_pending,
            },
        )?;
        let args = buffer_args(buffers, host_buffer)?;
        let page_layout = region_layout(&args, groups, num_blocks)?;
        let bases = args
            .iter()
            .map(|b| usize::try_from(b.address).map(|a| a as *mut u8))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| invalid("a buffer address does not fit this platform's pointers"))?;
        // SAFETY: every buffer is a writable numpy array of `size` bytes at
        // `address`, or raw host memory its caller vouches for (documented)
        // and whose owner this engine keeps referenced; `owners` keeps them
        // alive for the engine's life and is leaked if the engine turns
        // unsafe, so they stay valid for as long as the backend can copy.
        let backend = Arc::new(unsafe { CpuBackend::with_layout(bases, page_layout) }.py()?);
        let client = connect(py, socket_path, config.rpc_timeout)?;
        let engine = start(py, client, backend.clone(), config)?;
        Ok(PyTransferEngine {
            engine: Owned::new("TransferEngine", engine),
            layout: backend.layout().clone(),
            backend: BackendRef::Cpu(backend),
            owners: args.into_iter().map(|b| b.owner).collect(),
        })
    }

    /// A cuda-backend engine over region layouts: `buffers` are
    /// `(owner, device_ptr, nbytes)` triples of device memory on device
    /// `device` (e.g. contiguous CUDA KV-cache tensors), `groups` and
    /// `num_blocks` as for `cpu_regions`. Raises `DeviceError` when no CUDA
    /// driver is present.
    #[staticmethod]
    #[pyo3(signature = (socket_path, buffers, groups, num_blocks, *, device = 0, workers = None, max_copies_in_flight = None, rpc_timeout = None, layout = None, max_pending = None))]
    #[allow(clippy::too_many_arguments)]
    fn cuda_regions(
        py: Python<'_>,
        socket_path: std::path::PathBuf,
        buffers: &Bound<'_, PyAny>,
        groups: &Bound<'_, PyAny>,
        num_blocks: u64,
        device: i32,
        workers: Option<i64>,
        max_copies_in_flight: Option<i64>,
        rpc_timeout: Option<f64>,
        layout: Option<&Bound<'_, PyAny>>,
        max_pending: Option<i64>,
    ) -> PyResult<Self> {
        let config = engine_config(
            py,
            EngineArgs {
                workers,
                max_copies_in_flight,
                rpc_timeout,
                layout,
                max_pending,
            },
        )?;
        let args = buffer_args(buffers, |i, b| {
            raw_buffer(i, b, "an (owner, device_ptr, nbytes) tuple")
        })?;
        let page_layout = region_layout(&args, groups, num_blocks)?;
        let bases: Vec<u64> = args.iter().map(|b| b.address).collect();
        // SAFETY: the device buffers' owners are kept referenced by this
        // engine (and leaked if it turns unsafe); the caller vouches that
        // each triple describes live device memory (the backend checks each
        // is device memory covering its size).
        let backend = Arc::new(
            py.detach(|| unsafe { CudaBackend::with_layout(device, bases, page_layout) })
                .py()?,
        );
        let client = connect(py, socket_path, config.rpc_timeout)?;
        let engine = start(py, client, backend.clone(), config)?;
        Ok(PyTransferEngine {
            engine: Owned::new("TransferEngine", engine),
            layout: backend.layout().clone(),
            backend: BackendRef::Cuda(backend),
            owners: args.into_iter().map(|b| b.owner).collect(),
        })
    }

    /// The defaults of `workers`, `max_copies_in_flight` and `rpc_timeout`
    /// (seconds): the core's `EngineConfig::default()`, their one source.
    #[staticmethod]
    fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
        let d = EngineConfig::default();
        let out = PyDict::new(py);
        out.set_item("workers", d.workers)?;
        out.set_item("max_copies_in_flight", d.max_pending)?;
        out.set_item("rpc_timeout", d.rpc_timeout.as_secs_f64())?;
        Ok(out)
    }

    /// Raises `DeviceError` saying what is missing unless the CUDA driver
    /// library (with every function the cuda backend uses) is present.
    #[staticmethod]
    fn check_cuda_driver() -> PyResult<()> {
        cuda::driver_available().py()
    }

    /// Admits a job: `direction` "STORE" or "RETRIEVE", `block_ids` the
    /// blocks per manifest page group (auxiliary group last; rows of a 2-D
    /// pool). Returns
    /// a `TransferFuture`, or None when refused (closing, unsafe, or
    /// `max_copies_in_flight` jobs in flight). Bad arguments raise `InvalidInput`.
    #[pyo3(signature = (manifest, rank, direction, block_ids, producer_event = None))]
    fn submit(
        &self,
        py: Python<'_>,
        manifest: &PyManifest,
        rank: i64,
        direction: &str,
        block_ids: &Bound<'_, PyAny>,
        producer_event: Option<u64>,
    ) -> PyResult<Option<PyTransferFuture>> {
        let direction = Direction::parse(direction).py()?;
        let rank = u32::try_from(rank)
            .map_err(|_| invalid(format!("rank must be a non-negative integer, got {rank}")))?;
        let mut groups = Vec::new();
        for group in block_ids.try_iter()? {
            let mut ids = Vec::new();
            for id in group?.try_iter()? {
                let id: i64 = id?.extract().map_err(|_| {
                    invalid("block_ids must be a sequence of sequences of integers")
                })?;
                ids.push(
                    u64::try_from(id).map_err(|_| invalid(format!("block id {id} is negative")))?,
                );
            }
            groups.push(ids);
        }
        let job = Job {
            manifest: manifest.inner.clone(),
            rank,
            direction,
            block_ids: groups,
            producer_event,
        };
        let engine = self.engine.get()?;
        // A small job's first lease call is checked and sent from here: no GIL.
        Ok(py
            .detach(|| engine.submit(job))
            .py()?
            .map(|handle| PyTransferFuture {
                handle: Owned::new("TransferFuture", handle),
            }))
    }

    /// "cpu" or "cuda".
    #[getter]
    fn backend(&self) -> PyResult<&'static str> {
        Ok(self.engine.get()?.backend_name())
    }

    /// Blocks of the bound memory (rows of a 2-D page pool).
    #[getter]
    fn num_blocks(&self) -> u64 {
        self.layout.num_blocks()
    }

    /// Bytes per row of a 2-D page pool; None for region layouts.
    #[getter]
    fn page_bytes(&self) -> Option<u64> {
        self.layout.pool_shape().map(|s| s.page_bytes)
    }

    /// `{group name: page bytes}` of a region layout; empty for a 2-D page
    /// pool (whose rows serve every group name).
    #[getter]
    fn group_page_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for g in self.layout.groups() {
            if let Some(name) = g.name() {
                out.set_item(name, g.page_bytes())?;
            }
        }
        Ok(out)
    }

    /// Whether a copy may be in flight (admission stopped for good).
    #[getter]
    fn is_unsafe(&self) -> PyResult<bool> {
        Ok(self.engine.get()?.is_unsafe())
    }

    /// Why the engine turned unsafe (None while it is safe).
    #[getter]
    fn unsafe_reason(&self) -> PyResult<Option<String>> {
        Ok(self.engine.get()?.unsafe_reason())
    }

    /// Jobs admitted and not yet ended.
    #[getter]
    fn in_flight(&self) -> PyResult<usize> {
        Ok(self.engine.get()?.in_flight())
    }

    /// How many times the sidecar's pool was mapped (1 + remaps after restarts).
    #[getter]
    fn mappings(&self) -> PyResult<u64> {
        Ok(self.engine.get()?.stats().mappings)
    }

    /// How the backend moves bytes: the cpu backend's streaming-store
    /// kernel (chosen by CPU vendor), or the cuda backend's DMA.
    #[getter]
    fn copy_kernel(&self) -> PyResult<&'static str> {
        Ok(self.engine.get()?.copy_kernel())
    }

    /// The capabilities of the mapped pool (None before the first mapping).
    fn capabilities(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let engine = self.engine.get()?;
        py.detach(|| engine.capabilities())
            .map(|c| c.to_python(py))
            .transpose()
    }

    /// Waits until no job is in flight (None = forever); False on timeout.
    #[pyo3(signature = (timeout = None))]
    fn wait_idle(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let timeout = timeout_of(timeout)?;
        let engine = self.engine.get()?;
        Ok(py.detach(|| engine.wait_idle(timeout)))
    }

    /// Stops admission and waits for admitted jobs. Raises `UnsafeCopy` if a
    /// copy may be in flight (then the page pool stays referenced for good
    /// and the process must exit) or if they did not drain within `timeout`.
    #[pyo3(signature = (timeout = None))]
    fn close(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let timeout = timeout_of(timeout)?;
        let engine = self.engine.get()?;
        let result = py.detach(|| engine.close(timeout));
        if result.is_err() {
            for owner in &self.owners {
                // Leak one reference: the memory must outlive any DMA.
                std::mem::forget(owner.clone_ref(py));
            }
        }
        result.py()
    }

    /// Test hook: the next `count` copies fail ("fail", recoverable), report
    /// a copy still in flight ("unsafe"), or wait `delay` seconds first
    /// ("delay"). "clear" drops queued faults.
    #[pyo3(signature = (kind, count = 1, delay = 0.0))]
    fn _inject_fault(&self, kind: &str, count: usize, delay: f64) -> PyResult<()> {
        if count > 1_000_000 {
            return Err(invalid("count must be at most 1000000"));
        }
        let fault = match kind {
            "fail" => Fault::Fail,
            "unsafe" => Fault::InFlight,
            "delay" if delay.is_finite() && delay >= 0.0 => {
                Fault::Delay(Duration::from_secs_f64(delay.min(3600.0)))
            }
            "clear" => {
                self.backend.faults().clear();
                return Ok(());
            }
            other => {
                return Err(invalid(format!(
                    "unknown fault {other:?} (fail, unsafe, delay, clear)"
                )));
            }
        };
        self.backend.faults().push(fault, count);
        Ok(())
    }

    fn __repr__(&self) -> String {
        let Some(engine) = self.engine.local() else {
            return "TransferEngine(a forked child's copy: unusable)".to_string();
        };
        let pages = match self.layout.pool_shape() {
            Some(shape) => format!("page_bytes={}", shape.page_bytes),
            None => format!(
                "buffers={}, groups={}",
                self.layout.buffer_sizes().len(),
                self.layout.groups().len()
            ),
        };
        format!(
            "TransferEngine(backend={}, num_blocks={}, {pages}, in_flight={}, unsafe={})",
            engine.backend_name(),
            self.layout.num_blocks(),
            engine.in_flight(),
            if engine.is_unsafe() { "True" } else { "False" }
        )
    }
}

impl Drop for PyTransferEngine {
    /// Dropping the last reference drains admitted jobs with the GIL
    /// released (other Python threads keep running); if a copy may still be
    /// in flight the buffer references are leaked, as `close()` does.
    fn drop(&mut self) {
        let Some(engine) = self.engine.local() else {
            return; // a forked child's copy: its threads are the parent's
        };
        let closed = Python::attach(|py| py.detach(|| engine.close(None)));
        if let Err(e) = closed {
            log::error!("dropping a transfer engine: {e}");
            for owner in std::mem::take(&mut self.owners) {
                std::mem::forget(owner);
            }
        }
    }
}

/// The validated region layout of `args` (their sizes) and `groups`.
fn region_layout(
    args: &[BufferArg],
    groups: &Bound<'_, PyAny>,
    num_blocks: u64,
) -> PyResult<PageLayout> {
    let sizes: Vec<u64> = args.iter().map(|b| b.size).collect();
    PageLayout::regions(&sizes, num_blocks, region_groups(groups)?).py()
}

fn timeout_of(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        Some(t) if !(t.is_finite() && t >= 0.0) => {
            Err(invalid("timeout must be a non-negative number of seconds"))
        }
        Some(t) => Ok(Some(Duration::from_secs_f64(t.min(1e9)))),
        None => Ok(None),
    }
}

/// The result of one submitted transfer.
#[pyclass(name = "TransferFuture", module = "lmcache_rc._native", frozen)]
pub struct PyTransferFuture {
    /// Resolved by the engine's threads (usable only in this process).
    handle: Owned<JobHandle>,
}

#[pymethods]
impl PyTransferFuture {
    /// Whether the transfer ended.
    fn done(&self) -> PyResult<bool> {
        Ok(self.handle.get()?.is_done())
    }

    /// Waits up to `timeout` seconds (None = until done). True = every page
    /// copied and the lease finished; False = miss, busy past its bound,
    /// cancelled or a recoverable failure (see `error`). Raises `UnsafeCopy`
    /// when a copy may still be in flight, `RpcTimeout` if not done in time.
    #[pyo3(signature = (timeout = None))]
    fn result(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let handle = self.handle.get()?;
        let deadline = timeout_of(timeout)?.map(|t| Instant::now() + t);
        loop {
            let slice = deadline.map_or(Duration::from_millis(100), |d| {
                d.saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(100))
            });
            if py.detach(|| handle.wait(Some(slice))) {
                break;
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(to_pyerr(Error::Timeout(format!(
                    "the transfer did not end within {} s",
                    timeout.unwrap_or_default()
                ))));
            }
        }
        match handle.with_outcome(|o| match o {
            Outcome::Unsafe(r) => Err(Error::UnsafeCopy(r.clone())),
            o => Ok(o.succeeded()),
        }) {
            Some(r) => r.py(),
            None => Err(to_pyerr(Error::Internal(
                "transfer ended without outcome".into(),
            ))),
        }
    }

    /// "copied", "miss", "failed" or "unsafe"; None while running.
    #[getter]
    fn outcome(&self) -> PyResult<Option<&'static str>> {
        Ok(self.handle.get()?.with_outcome(Outcome::kind))
    }

    /// Why the transfer did not copy (None while running or when it copied).
    #[getter]
    fn error(&self) -> PyResult<Option<String>> {
        Ok(self.handle.get()?.with_outcome(Outcome::reason).flatten())
    }

    /// The error kind of a failed transfer (e.g. "InvalidInput"), else None.
    #[getter]
    fn error_kind(&self) -> PyResult<Option<&'static str>> {
        Ok(self
            .handle
            .get()?
            .with_outcome(|o| match o {
                Outcome::Failed(e) => Some(e.kind().as_str()),
                Outcome::Unsafe(_) => Some(ErrorKind::UnsafeCopy.as_str()),
                _ => None,
            })
            .flatten())
    }

    /// Where the job's time went, in microseconds per phase (`queued`,
    /// `check`, `map`, `lease`, `plan`, `handoff`, `copy`, `finish`, `total`;
    /// complete once the job ended): what a copy costs, for statistics.
    #[getter]
    fn phases(&self) -> PyResult<BTreeMap<&'static str, u64>> {
        let p = self.handle.get()?.phases();
        let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        Ok(BTreeMap::from([
            ("queued", us(p.queued)),
            ("check", us(p.check)),
            ("map", us(p.map)),
            ("lease", us(p.lease)),
            ("plan", us(p.plan)),
            ("handoff", us(p.handoff)),
            ("copy", us(p.copy)),
            ("finish", us(p.finish)),
            ("total", us(p.total)),
        ]))
    }

    fn __repr__(&self) -> String {
        let Some(handle) = self.handle.local() else {
            return "TransferFuture(a forked child's copy: unusable)".to_string();
        };
        match handle.with_outcome(Outcome::kind) {
            Some(kind) => format!("TransferFuture({kind})"),
            None => "TransferFuture(running)".to_string(),
        }
    }
}
