//! The CUDA backend: page pool in GPU memory, copies by the driver's DMA.
//!
//! The driver is loaded at run time (cudarc's dynamic loading), so builds
//! need no CUDA toolkit and hosts without a GPU still import the module.
//! cudarc panics when a driver function is called without the library, so
//! [`driver_available`] probes the library and every symbol this backend
//! uses *before* the first driver call; without them constructing a
//! [`CudaBackend`] is an [`Error::Device`], never a panic.
//!
//! Per spec §9: the shared-memory mapping is page-locked once
//! (`cuMemHostRegister`) so copies are true async DMA; each plan is enqueued
//! in one burst under a mutex on a dedicated non-blocking stream that first
//! waits on the producer event, then the stream is synchronised. A failed
//! synchronisation means a DMA may still touch the memory: that is the
//! unsafe outcome. A failure before any copy was enqueued (e.g. the event
//! wait) is recoverable.

use std::ffi::c_void;
use std::sync::OnceLock;

use cudarc::driver::sys;
use parking_lot::Mutex;

use super::backend::{
    CopyBackend, CopyFailure, CopyRun, FaultQueue, Registration, check_runs, check_shape,
    contiguous_runs,
};
use super::plan::{CopyPlan, Direction, PoolShape};
use crate::error::{Error, Result};
use crate::store::shm::ShmPool;

/// Every driver symbol the backend calls (probed before the first call).
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamWaitEvent",
    "cuStreamSynchronize",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemGetAddressRange_v2",
    "cuPointerGetAttribute",
];

/// Whether the CUDA driver library and every symbol this backend uses are
/// present; the error says what is missing. Cached after the first probe.
pub fn driver_available() -> Result<()> {
    static PROBE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            let mut candidates = cudarc::get_lib_name_candidates("cuda");
            let mut seen = std::collections::HashSet::new();
            candidates.retain(|c| seen.insert(c.clone()));
            for name in &candidates {
                // SAFETY: loading the system CUDA driver library runs its
                // initialisers, which is what every CUDA program does; the
                // handle is only used to look symbols up and is then closed.
                let Ok(lib) = (unsafe { libloading::Library::new(name) }) else {
                    continue;
                };
                for symbol in SYMBOLS {
                    // SAFETY: only the presence of the symbol is checked; the
                    // pointer is never called through this handle.
                    let found = unsafe { lib.get::<*const c_void>(symbol.as_bytes()) };
                    if found.is_err() {
                        return Err(format!(
                            "the CUDA driver library {name} lacks {symbol} (driver too old?)"
                        ));
                    }
                }
                return Ok(());
            }
            Err(format!(
                "no CUDA driver library found (tried {}); install the NVIDIA driver or use the \
                 cpu backend",
                candidates.join(", ")
            ))
        })
        .clone()
        .map_err(Error::Device)
}

/// Turns a driver status into a result.
fn check(status: sys::CUresult, what: &str) -> Result<()> {
    if status == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Device(format!("{what} failed: {status:?}")))
    }
}

/// The CUDA backend over a device page pool.
pub struct CudaBackend {
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    base: sys::CUdeviceptr,
    shape: PoolShape,
    /// One enqueue burst per plan (spec §9.2 step 8).
    burst: Mutex<()>,
    faults: FaultQueue,
}

// SAFETY: the raw handles are driver objects usable from any thread once the
// context is made current (every method does so first); the enqueue burst is
// serialised by `burst`.
unsafe impl Send for CudaBackend {}
// SAFETY: see `Send`.
unsafe impl Sync for CudaBackend {}

/// A page-locked shared-memory mapping; unregistered on drop.
struct HostRegistration {
    ptr: usize,
    ctx: usize,
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // SAFETY: `ptr` was registered in `ctx` by `CudaBackend::register`;
        // the mapping is still alive (`Mapped` declares the registration
        // before the pool, so it is dropped first) and so is the context
        // (`Inner` drops its mapping before its backend).
        unsafe {
            let _ = sys::cuCtxSetCurrent(self.ctx as sys::CUcontext);
            let status = sys::cuMemHostUnregister(self.ptr as *mut c_void);
            if status != sys::CUresult::CUDA_SUCCESS {
                log::warn!("unregistering the shared-memory mapping failed: {status:?}");
            }
        }
    }
}

impl CudaBackend {
    /// A backend over `shape` rows at device address `base` on device `ordinal`.
    ///
    /// Checks the driver first ([`driver_available`]), then that `base` is
    /// device memory covering the whole pool.
    ///
    /// # Safety
    ///
    /// The device memory must stay allocated for the backend's life (and,
    /// if the engine turns unsafe, until the process ends); rows named by a
    /// job must not be freed or reused while that job copies.
    pub unsafe fn new(ordinal: i32, base: u64, shape: PoolShape) -> Result<CudaBackend> {
        check_shape(shape)?;
        driver_available()?;
        let total = shape.num_blocks * shape.page_bytes;
        // SAFETY: `driver_available` proved the library and symbols exist;
        // every out-pointer is a live local.
        unsafe {
            check(sys::cuInit(0), "cuInit")?;
            let mut device: sys::CUdevice = 0;
            check(sys::cuDeviceGet(&mut device, ordinal), "cuDeviceGet")?;
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            check(
                sys::cuDevicePrimaryCtxRetain(&mut ctx, device),
                "cuDevicePrimaryCtxRetain",
            )?;
            let release = |e: Error| {
                let _ = sys::cuDevicePrimaryCtxRelease_v2(device);
                e
            };
            check(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent").map_err(release)?;
            let mut memtype: u32 = 0;
            check(
                sys::cuPointerGetAttribute(
                    (&mut memtype as *mut u32).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                    base,
                ),
                "cuPointerGetAttribute (is the page pool a CUDA tensor?)",
            )
            .map_err(release)?;
            if memtype != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
                return Err(release(Error::invalid(
                    "the page pool is not device memory: pass a validated CUDA raw-page pool",
                )));
            }
            let mut alloc_base: sys::CUdeviceptr = 0;
            let mut alloc_size: usize = 0;
            check(
                sys::cuMemGetAddressRange_v2(&mut alloc_base, &mut alloc_size, base),
                "cuMemGetAddressRange",
            )
            .map_err(release)?;
            if base + total > alloc_base + alloc_size as u64 {
                return Err(release(Error::invalid(format!(
                    "the page pool of {total} bytes does not fit its allocation of {alloc_size} \
                     bytes: pass a contiguous [num_blocks, page_bytes] uint8 tensor"
                ))));
            }
            let mut stream: sys::CUstream = std::ptr::null_mut();
            check(
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                ),
                "cuStreamCreate",
            )
            .map_err(release)?;
            Ok(CudaBackend {
                device,
                ctx,
                stream,
                base,
                shape,
                burst: Mutex::new(()),
                faults: FaultQueue::default(),
            })
        }
    }

    /// The test hook's fault queue.
    pub fn faults(&self) -> &FaultQueue {
        &self.faults
    }

    fn enqueue(
        &self,
        plan: &CopyPlan,
        runs: &[CopyRun],
        pool: &ShmPool,
        event: Option<u64>,
    ) -> Result<usize> {
        let shm = pool.as_ptr();
        let width = plan.page_bytes as usize;
        let mut enqueued = 0;
        // SAFETY: the context is this backend's; the event handle comes from
        // the worker (a live CUevent per the job's contract); `check_runs`
        // proved every run's device rows and SHM slots lie inside their pools,
        // and the SHM mapping outlives the copy (synchronised below, or
        // leaked by the engine when synchronisation fails).
        unsafe {
            check(sys::cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")?;
            if let Some(ev) = event {
                check(
                    sys::cuStreamWaitEvent(self.stream, ev as sys::CUevent, 0),
                    "waiting on the producer event",
                )?;
            }
            for run in runs {
                let row = self.base + run.block * self.shape.page_bytes;
                let slot = shm.add(run.shm_offset as usize);
                let len = run.pages as usize * width;
                let status = match plan.direction {
                    Direction::Store => {
                        sys::cuMemcpyDtoHAsync_v2(slot.cast(), row, len, self.stream)
                    }
                    Direction::Retrieve => {
                        sys::cuMemcpyHtoDAsync_v2(row, slot.cast_const().cast(), len, self.stream)
                    }
                };
                check(status, "enqueueing a page copy")?;
                enqueued += 1;
            }
        }
        Ok(enqueued)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // SAFETY: handles created in `new`; the engine drops the backend only
        // after every copy drained.
        unsafe {
            let _ = sys::cuCtxSetCurrent(self.ctx);
            let _ = sys::cuStreamDestroy_v2(self.stream);
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

impl CopyBackend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn shape(&self) -> PoolShape {
        self.shape
    }

    fn register(&self, pool: &ShmPool) -> Result<Option<Registration>> {
        // SAFETY: the mapping is live for `pool.size()` bytes; the
        // registration is dropped before the mapping (see `Mapped`).
        unsafe {
            check(sys::cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")?;
            check(
                sys::cuMemHostRegister_v2(
                    pool.as_ptr().cast(),
                    pool.size() as usize,
                    sys::CU_MEMHOSTREGISTER_PORTABLE,
                ),
                "page-locking the shared-memory pool (checkpoints require a registered SHM mapping)",
            )?;
        }
        Ok(Some(Box::new(HostRegistration {
            ptr: pool.as_ptr() as usize,
            ctx: self.ctx as usize,
        })))
    }

    fn accepts_events(&self) -> bool {
        true
    }

    fn copy(
        &self,
        plan: &CopyPlan,
        pool: &ShmPool,
        producer_event: Option<u64>,
    ) -> std::result::Result<(), CopyFailure> {
        self.faults.apply()?;
        let runs = contiguous_runs(plan);
        check_runs(plan, &runs, self.shape, pool)?;
        let _burst = self.burst.lock();
        let enqueued = self.enqueue(plan, &runs, pool, producer_event);
        // Always drain, even when enqueueing failed half-way (step 9).
        // SAFETY: the stream is this backend's.
        let synced = unsafe { sys::cuStreamSynchronize(self.stream) };
        if synced != sys::CUresult::CUDA_SUCCESS {
            return Err(CopyFailure::InFlight(format!(
                "cuStreamSynchronize failed ({synced:?}) after enqueueing {} copies",
                enqueued.as_ref().map_or(0, |n| *n)
            )));
        }
        enqueued.map(|_| ()).map_err(CopyFailure::Recoverable)
    }
}
