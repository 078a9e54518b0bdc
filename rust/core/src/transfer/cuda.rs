//! The CUDA backend: KV memory in GPU memory (a 2-D page pool or per-layer
//! tensors), copies by the driver's DMA.
//!
//! The driver is loaded at run time (cudarc's dynamic loading), so builds
//! need no CUDA toolkit and hosts without a GPU still import the module.
//! cudarc panics when a driver function is called without the library, so
//! [`driver_available`] probes the library and every symbol this backend
//! uses *before* the first driver call; without them constructing a
//! [`CudaBackend`] is an [`Error::Device`], never a panic.
//!
//! The shared-memory mapping is page-locked once per mapping
//! (`cuMemHostRegister`) so copies are true async DMA. Each copy runs on a
//! *lane* of its own: a non-blocking stream and an event, taken from a
//! small pool (one lane per copy running at once, so at most the engine's
//! copy threads). The copy makes its lane's stream wait on the producer
//! event, enqueues every run, records the lane's event and waits for that
//! event — holding no lock, so several copies of one rank overlap on the
//! device's copy engines instead of queueing behind one stream and one
//! mutex. The event is created with `CU_EVENT_BLOCKING_SYNC`, so the
//! waiting copy thread sleeps instead of spinning whatever scheduling flags
//! the inference engine gave the primary context.
//!
//! A failed wait (or, when recording the event failed, a failed stream
//! synchronisation) means a DMA may still touch the memory: that is the
//! unsafe outcome, and the lane is leaked, never reused or destroyed. A
//! failure before anything was enqueued, or an enqueue failure after which
//! the lane drained, is recoverable.

use std::ffi::c_void;
use std::sync::OnceLock;

use cudarc::driver::sys;
use parking_lot::Mutex;

use super::backend::{CopyBackend, CopyFailure, CopyRun, FaultQueue, Registration, copy_runs};
use super::layout::{PageLayout, PoolShape, check_disjoint};
use super::plan::{CopyPlan, Direction};
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
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventSynchronize",
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

/// A stream and an event that one copy uses alone (see the module docs).
struct Lane {
    stream: sys::CUstream,
    event: sys::CUevent,
}

/// The CUDA backend over device buffers (a 2-D page pool or per-layer
/// KV-cache tensors).
pub struct CudaBackend {
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    bases: Vec<sys::CUdeviceptr>,
    layout: PageLayout,
    /// Idle lanes. Held only to take or return one, never across a copy.
    lanes: Mutex<Vec<Lane>>,
    faults: FaultQueue,
}

// SAFETY: the raw handles are driver objects usable from any thread once the
// context is made current (every method does so first). A lane is used by
// one copy at a time: it is popped from `lanes` under the mutex and pushed
// back only when its copy drained.
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
    /// A backend over `shape` rows at device address `base` on device
    /// `ordinal` (the boundary fork's page pool).
    ///
    /// Checks the shape, then the driver ([`driver_available`]), then that
    /// `base` is device memory of that device covering the whole pool.
    ///
    /// # Safety
    ///
    /// The device memory must stay allocated for the backend's life (and,
    /// if the engine turns unsafe, until the process ends); rows named by a
    /// job must not be freed or reused while that job copies.
    pub unsafe fn new(ordinal: i32, base: u64, shape: PoolShape) -> Result<CudaBackend> {
        let layout = PageLayout::pool(shape)?;
        // SAFETY: forwarded from this function's contract.
        unsafe { CudaBackend::with_layout(ordinal, vec![base], layout) }
    }

    /// A backend over device buffers at `bases` on device `ordinal`, laid
    /// out by `layout` (buffer `i` has `layout.buffer_sizes()[i]` bytes).
    ///
    /// Checks the addresses (one per buffer, none null, no two overlapping),
    /// then the driver ([`driver_available`]), then that every buffer is
    /// device memory of device `ordinal` inside one allocation that covers
    /// its whole size.
    ///
    /// # Safety
    ///
    /// Every buffer's device memory must stay allocated for the backend's
    /// life (and, if the engine turns unsafe, until the process ends); the
    /// blocks named by a job must not be freed or reused while that job
    /// copies.
    pub unsafe fn with_layout(
        ordinal: i32,
        bases: Vec<u64>,
        layout: PageLayout,
    ) -> Result<CudaBackend> {
        if bases.len() != layout.buffer_sizes().len() {
            return Err(Error::invalid(format!(
                "the layout describes {} buffers but {} device addresses were given",
                layout.buffer_sizes().len(),
                bases.len()
            )));
        }
        let ranges: Vec<(u64, u64)> = bases
            .iter()
            .copied()
            .zip(layout.buffer_sizes().iter().copied())
            .collect();
        check_disjoint(&ranges)?;
        driver_available()?;
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
            for (i, &(base, size)) in ranges.iter().enumerate() {
                check_device_buffer(i, base, size, ordinal).map_err(release)?;
            }
            Ok(CudaBackend {
                device,
                ctx,
                bases,
                layout,
                lanes: Mutex::new(Vec::new()),
                faults: FaultQueue::default(),
            })
        }
    }

    /// The test hook's fault queue.
    pub fn faults(&self) -> &FaultQueue {
        &self.faults
    }

    /// An idle lane, or a new one. The context must be current.
    fn take_lane(&self) -> Result<Lane> {
        if let Some(lane) = self.lanes.lock().pop() {
            return Ok(lane);
        }
        // SAFETY: the context is current (the caller made it so); both
        // out-pointers are live locals; a stream created here is destroyed
        // if its event cannot be created.
        unsafe {
            let mut stream: sys::CUstream = std::ptr::null_mut();
            check(
                sys::cuStreamCreate(
                    &mut stream,
                    sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                ),
                "cuStreamCreate",
            )?;
            let mut event: sys::CUevent = std::ptr::null_mut();
            let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
                | sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
            if let Err(e) = check(sys::cuEventCreate(&mut event, flags), "cuEventCreate") {
                let _ = sys::cuStreamDestroy_v2(stream);
                return Err(e);
            }
            Ok(Lane { stream, event })
        }
    }

    /// Enqueues `runs` on `lane` after `event`; the number enqueued, or the
    /// first failure with how many were enqueued before it.
    ///
    /// # Safety
    ///
    /// The context must be current; every run must lie inside its buffer
    /// and the mapping `shm` (`copy_runs` proved it); the mapping must stay
    /// alive until the lane drained (or for good, if draining fails).
    unsafe fn enqueue(
        &self,
        lane: &Lane,
        direction: Direction,
        runs: &[CopyRun],
        shm: *mut u8,
        event: Option<u64>,
    ) -> std::result::Result<usize, (usize, Error)> {
        if let Some(ev) = event {
            // SAFETY: the event handle comes from the worker (a live CUevent of
            // this context per the job's contract); the stream is this lane's.
            let status = unsafe { sys::cuStreamWaitEvent(lane.stream, ev as sys::CUevent, 0) };
            check(status, "waiting on the producer event").map_err(|e| (0, e))?;
        }
        for (n, run) in runs.iter().enumerate() {
            let device = self.bases[run.buffer] + run.offset;
            // SAFETY: per this function's contract `shm_offset + len` is
            // inside the mapping and `offset + len` inside buffer
            // `run.buffer` (an index below `bases.len()`, which equals the
            // layout's buffer count); both stay alive until the lane drains.
            let status = unsafe {
                let slot = shm.add(run.shm_offset as usize);
                let len = run.len as usize;
                match direction {
                    Direction::Store => {
                        sys::cuMemcpyDtoHAsync_v2(slot.cast(), device, len, lane.stream)
                    }
                    Direction::Retrieve => sys::cuMemcpyHtoDAsync_v2(
                        device,
                        slot.cast_const().cast(),
                        len,
                        lane.stream,
                    ),
                }
            };
            check(status, "enqueueing a page copy").map_err(|e| (n, e))?;
        }
        Ok(runs.len())
    }

    /// Waits until everything enqueued on `lane` completed, holding no
    /// lock: records the lane's event and waits for it (or, if recording
    /// fails, synchronises the lane's own stream). `Err` = it may still run.
    fn drain(&self, lane: &Lane) -> std::result::Result<(), String> {
        // SAFETY: the stream and event are this lane's, used by this copy
        // alone; the context is current.
        unsafe {
            let recorded = sys::cuEventRecord(lane.event, lane.stream);
            if recorded == sys::CUresult::CUDA_SUCCESS {
                let waited = sys::cuEventSynchronize(lane.event);
                if waited == sys::CUresult::CUDA_SUCCESS {
                    return Ok(());
                }
                return Err(format!("cuEventSynchronize failed ({waited:?})"));
            }
            let synced = sys::cuStreamSynchronize(lane.stream);
            if synced == sys::CUresult::CUDA_SUCCESS {
                return Ok(());
            }
            Err(format!(
                "cuEventRecord failed ({recorded:?}), then cuStreamSynchronize failed ({synced:?})"
            ))
        }
    }
}

/// Checks that `size` bytes at `base` are device memory of device `ordinal`
/// inside one allocation.
///
/// # Safety
///
/// The driver must be loaded ([`driver_available`]) and a context current.
unsafe fn check_device_buffer(index: usize, base: u64, size: u64, ordinal: i32) -> Result<()> {
    // SAFETY: the out-pointers are live locals; the driver only reads
    // `base` as an address to look up.
    unsafe {
        let mut memtype: u32 = 0;
        check(
            sys::cuPointerGetAttribute(
                (&mut memtype as *mut u32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                base,
            ),
            "cuPointerGetAttribute (is the page pool a CUDA tensor?)",
        )?;
        if memtype != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(Error::invalid(format!(
                "buffer {index} is not device memory: pass a validated CUDA raw-page pool or \
                 CUDA KV-cache tensors"
            )));
        }
        let mut on: i32 = -1;
        check(
            sys::cuPointerGetAttribute(
                (&mut on as *mut i32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                base,
            ),
            "cuPointerGetAttribute (device ordinal)",
        )?;
        if on != ordinal {
            return Err(Error::invalid(format!(
                "buffer {index} lives on CUDA device {on}, the backend is bound to device \
                 {ordinal}: every buffer must be on one device"
            )));
        }
        let mut alloc_base: sys::CUdeviceptr = 0;
        let mut alloc_size: usize = 0;
        check(
            sys::cuMemGetAddressRange_v2(&mut alloc_base, &mut alloc_size, base),
            "cuMemGetAddressRange",
        )?;
        let end = base.checked_add(size);
        let alloc_end = alloc_base.checked_add(alloc_size as u64);
        if end.is_none() || alloc_end.is_none() || end > alloc_end {
            return Err(Error::invalid(format!(
                "buffer {index} of {size} bytes does not fit its allocation of {alloc_size} \
                 bytes: pass contiguous uint8 tensors (or their whole storage)"
            )));
        }
    }
    Ok(())
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // SAFETY: handles created by this backend; the engine drops the
        // backend only after every copy drained, and a lane whose copy may
        // still run was never returned to `lanes` (it is leaked).
        unsafe {
            let _ = sys::cuCtxSetCurrent(self.ctx);
            for lane in self.lanes.get_mut().drain(..) {
                let _ = sys::cuEventDestroy_v2(lane.event);
                let _ = sys::cuStreamDestroy_v2(lane.stream);
            }
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

impl CopyBackend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn copy_kernel(&self) -> &'static str {
        "cuMemcpyAsync (DMA)"
    }

    fn layout(&self) -> &PageLayout {
        &self.layout
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
        let runs = copy_runs(plan, &self.layout, pool.size())?;
        if runs.is_empty() {
            // Every page was deduplicated: nothing to wait for or copy.
            return Ok(());
        }
        // SAFETY: the context is this backend's (retained in `with_layout`).
        let current = unsafe { sys::cuCtxSetCurrent(self.ctx) };
        check(current, "cuCtxSetCurrent").map_err(CopyFailure::Recoverable)?;
        // Nothing is enqueued yet: failing to get a lane is recoverable.
        let lane = self.take_lane().map_err(CopyFailure::Recoverable)?;
        // SAFETY: the context is current; `copy_runs` proved every run lies
        // inside its buffer and the mapping; `pool` keeps the mapping alive
        // until `drain` below returns, and when draining fails the lane is
        // leaked and the engine leaks the mapping (InFlight).
        let enqueued =
            unsafe { self.enqueue(&lane, plan.direction, &runs, pool.as_ptr(), producer_event) };
        // Always drain, even when enqueueing failed half-way
        // (docs/design/transfers.md#backends: cuda "always drains").
        if let Err(why) = self.drain(&lane) {
            // The lane's stream may still run a DMA: it is not returned to
            // `lanes`, so it is never reused or destroyed (its handles leak).
            let done = match &enqueued {
                Ok(n) | Err((n, _)) => *n,
            };
            return Err(CopyFailure::InFlight(format!(
                "{why} after enqueueing {done} of {} copies",
                runs.len()
            )));
        }
        self.lanes.lock().push(lane);
        enqueued
            .map(|_| ())
            .map_err(|(_, e)| CopyFailure::Recoverable(e))
    }
}
