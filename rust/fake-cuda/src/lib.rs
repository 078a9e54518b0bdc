//! A fake CUDA driver library for tests (never shipped: the wheel builds only
//! `rust/python`).
//!
//! It exports, with the driver's C ABI, every function the cuda backend
//! (`lmcache_rc_core::transfer::cuda`) probes and calls, so that a process
//! whose `LD_LIBRARY_PATH` leads cudarc's loader to this file (linked as
//! `libcuda.so`) runs the backend's real code — including its failure paths —
//! without a GPU.
//!
//! # The fake machine
//!
//! - One device (ordinal 0) with one primary context (reference-counted;
//!   the current context is per thread, as in the driver).
//! - "Device memory" is host memory that a test declared with
//!   [`lmcache_fake_cuda_register_device`]: device pointers *are* host
//!   addresses. `cuPointerGetAttribute` answers `CU_MEMORYTYPE_DEVICE` (and
//!   ordinal 0) only inside those ranges, `CU_MEMORYTYPE_HOST` inside
//!   `cuMemHostRegister`ed ranges; `cuMemGetAddressRange` answers the
//!   declared range.
//! - Streams and events are opaque handles. Copies are *queued* on their
//!   stream and run (as `memcpy`) only when something waits for them:
//!   `cuEventSynchronize` of an event recorded after them,
//!   `cuStreamSynchronize`, `cuStreamWaitEvent` (the producer's work runs
//!   first), or destroying the stream. So a copy nobody waited for has not
//!   happened, and a failed wait leaves its copies "in flight" for good —
//!   what the backend must assume of a real DMA.
//! - Async copies check both sides: the device side inside one declared
//!   device range, the host side inside one `cuMemHostRegister`ed range
//!   (the backend page-locks every mapping it copies from or to).
//! - Unregistering host memory or a device range while a queued copy still
//!   touches it is counted as a *violation* (that copy is dropped instead
//!   of writing freed memory): tests assert there are none.
//!
//! # Test controls (exported `lmcache_fake_cuda_*` functions)
//!
//! Faults ([`lmcache_fake_cuda_fail`]: the next `count` calls of a symbol,
//! after `after` successful ones, return a chosen `CUresult`), holds
//! ([`lmcache_fake_cuda_hold`]: calls of a symbol block until released, and
//! [`lmcache_fake_cuda_waiting`] says how many are blocked), call counters
//! per symbol ([`lmcache_fake_cuda_calls`]), state counters
//! ([`lmcache_fake_cuda_stat`]), a pending producer write
//! ([`lmcache_fake_cuda_pending_fill`]) and [`lmcache_fake_cuda_reset`].

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::{Condvar, LazyLock, Mutex, MutexGuard, PoisonError};

use cudarc::driver::sys::{self, CUresult};

/// Every driver function this library exports (the cuda backend's
/// `SYMBOLS`); names accepted by the test controls.
pub const SYMBOLS: &[&str] = &[
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

/// Names accepted by [`lmcache_fake_cuda_stat`].
pub const STATS: &[&str] = &[
    "live_streams",
    "live_events",
    "host_registrations",
    "device_ranges",
    "pending_ops",
    "ctx_refs",
    "violations",
    "executed_ops",
];

/// The primary context's handle (never dereferenced).
const PRIMARY_CTX: usize = 0xc0_0000;
/// The legacy default stream: the null handle.
const NULL_STREAM: usize = 0;

thread_local! {
    /// The calling thread's current context (0: none).
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

/// One queued copy or write, by address.
#[derive(Debug, Clone, Copy)]
enum Op {
    Copy { dst: usize, src: usize, len: usize },
    Fill { dst: usize, len: usize, value: u8 },
}

impl Op {
    /// Whether the op touches `[base, base + len)`.
    fn touches(&self, base: usize, len: usize) -> bool {
        let overlaps =
            |at: usize, n: usize| at < base.saturating_add(len) && base < at.saturating_add(n);
        match *self {
            Op::Copy { dst, src, len: n } => overlaps(dst, n) || overlaps(src, n),
            Op::Fill { dst, len: n, .. } => overlaps(dst, n),
        }
    }
}

#[derive(Default)]
struct Stream {
    /// Queued ops with their sequence numbers (1, 2, ...).
    queue: VecDeque<(u64, Op)>,
    /// Ops ever enqueued (the last sequence number).
    enqueued: u64,
    /// Created by a test control, not by the driver API (not counted live).
    internal: bool,
}

#[derive(Default)]
struct Event {
    /// `(stream, sequence)`: the event completes when the stream's ops up
    /// to `sequence` ran. `None`: never recorded (complete).
    recorded: Option<(usize, u64)>,
    internal: bool,
}

/// A queued failure of one symbol.
#[derive(Clone, Copy)]
struct Fault {
    after: u32,
    count: u32,
    code: CUresult,
}

impl Fault {
    fn fire(&mut self) -> Option<CUresult> {
        if self.after > 0 {
            self.after -= 1;
            None
        } else if self.count > 0 {
            self.count -= 1;
            Some(self.code)
        } else {
            None
        }
    }
}

struct State {
    initialised: bool,
    ctx_refs: u64,
    next_handle: usize,
    streams: HashMap<usize, Stream>,
    events: HashMap<usize, Event>,
    /// `cuMemHostRegister`ed ranges: base → length.
    host: BTreeMap<usize, usize>,
    /// Fake device memory: base → length.
    device: BTreeMap<usize, usize>,
    calls: HashMap<&'static str, u64>,
    faults: HashMap<&'static str, Fault>,
    held: HashSet<&'static str>,
    waiting: HashMap<&'static str, u64>,
    violations: u64,
    executed: u64,
}

impl State {
    fn new() -> State {
        let mut streams = HashMap::new();
        streams.insert(NULL_STREAM, Stream::default());
        State {
            initialised: false,
            ctx_refs: 0,
            next_handle: 0,
            streams,
            events: HashMap::new(),
            host: BTreeMap::new(),
            device: BTreeMap::new(),
            calls: HashMap::new(),
            faults: HashMap::new(),
            held: HashSet::new(),
            waiting: HashMap::new(),
            violations: 0,
            executed: 0,
        }
    }

    /// A fresh non-null handle value.
    fn handle(&mut self) -> usize {
        self.next_handle += 1;
        0x10_0000 + self.next_handle * 0x40
    }

    fn initialised(&self) -> Result<(), CUresult> {
        if self.initialised {
            Ok(())
        } else {
            Err(CUresult::CUDA_ERROR_NOT_INITIALIZED)
        }
    }

    /// The calling thread must have the (live) primary context current.
    fn context(&self) -> Result<(), CUresult> {
        self.initialised()?;
        if CURRENT.with(Cell::get) == PRIMARY_CTX && self.ctx_refs > 0 {
            Ok(())
        } else {
            Err(CUresult::CUDA_ERROR_INVALID_CONTEXT)
        }
    }

    fn stream(&mut self, handle: usize) -> Result<&mut Stream, CUresult> {
        self.streams
            .get_mut(&handle)
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
    }

    /// Runs `stream`'s queued ops up to sequence `upto`, in order.
    fn flush(&mut self, stream: usize, upto: u64) {
        let Some(s) = self.streams.get_mut(&stream) else {
            // Destroyed: its ops ran when it was destroyed.
            return;
        };
        let mut ran = 0;
        while s.queue.front().is_some_and(|(seq, _)| *seq <= upto) {
            if let Some((_, op)) = s.queue.pop_front() {
                // SAFETY: every queued op was checked when it was enqueued
                // to lie inside declared device ranges and registered host
                // ranges; unregistering a range drops the ops touching it
                // (a violation), so the memory is still valid here.
                unsafe { run(op) };
                ran += 1;
            }
        }
        self.executed += ran;
    }

    /// Runs every op `event` covers (nothing if it was never recorded).
    fn complete(&mut self, event: usize) -> Result<(), CUresult> {
        let recorded = self
            .events
            .get(&event)
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?
            .recorded;
        if let Some((stream, upto)) = recorded {
            self.flush(stream, upto);
        }
        Ok(())
    }

    /// Queues `op` on `stream`.
    fn enqueue(&mut self, stream: usize, op: Op) -> Result<(), CUresult> {
        let s = self.stream(stream)?;
        s.enqueued += 1;
        let seq = s.enqueued;
        s.queue.push_back((seq, op));
        Ok(())
    }

    /// Drops queued ops touching `[base, base + len)`; counts a violation
    /// if there were any.
    fn drop_ops_touching(&mut self, base: usize, len: usize) {
        let mut dropped = 0;
        for s in self.streams.values_mut() {
            let before = s.queue.len();
            s.queue.retain(|(_, op)| !op.touches(base, len));
            dropped += before - s.queue.len();
        }
        if dropped > 0 {
            self.violations += 1;
        }
    }

    fn stat(&self, name: &str) -> Option<u64> {
        let count = |n: usize| n as u64;
        Some(match name {
            "live_streams" => count(
                self.streams
                    .iter()
                    .filter(|(h, s)| **h != NULL_STREAM && !s.internal)
                    .count(),
            ),
            "live_events" => count(self.events.values().filter(|e| !e.internal).count()),
            "host_registrations" => count(self.host.len()),
            "device_ranges" => count(self.device.len()),
            "pending_ops" => count(self.streams.values().map(|s| s.queue.len()).sum()),
            "ctx_refs" => self.ctx_refs,
            "violations" => self.violations,
            "executed_ops" => self.executed,
            _ => return None,
        })
    }
}

/// Runs one op.
///
/// # Safety
///
/// Every byte the op reads or writes must be valid memory not otherwise
/// borrowed for the duration of the call.
unsafe fn run(op: Op) {
    match op {
        // SAFETY: forwarded from this function's contract; `copy` allows
        // overlap.
        Op::Copy { dst, src, len } => unsafe {
            std::ptr::copy(src as *const u8, dst as *mut u8, len)
        },
        // SAFETY: forwarded from this function's contract.
        Op::Fill { dst, len, value } => unsafe {
            std::ptr::write_bytes(dst as *mut u8, value, len)
        },
    }
}

/// Whether `[at, at + len)` lies inside one range of `ranges`.
fn inside(ranges: &BTreeMap<usize, usize>, at: usize, len: usize) -> bool {
    let Some(end) = at.checked_add(len) else {
        return false;
    };
    ranges
        .range(..=at)
        .next_back()
        .is_some_and(|(&base, &n)| end <= base.saturating_add(n))
}

/// The range of `ranges` containing `at`.
fn containing(ranges: &BTreeMap<usize, usize>, at: usize) -> Option<(usize, usize)> {
    ranges
        .range(..=at)
        .next_back()
        .map(|(&base, &n)| (base, n))
        .filter(|&(base, n)| at < base.saturating_add(n))
}

/// Whether `[at, at + len)` overlaps any range of `ranges`.
fn overlaps(ranges: &BTreeMap<usize, usize>, at: usize, len: usize) -> bool {
    let end = at.saturating_add(len);
    ranges
        .iter()
        .any(|(&base, &n)| at < base.saturating_add(n) && base < end)
}

struct Fake {
    state: Mutex<State>,
    /// Wakes calls blocked by a hold.
    wake: Condvar,
}

static FAKE: LazyLock<Fake> = LazyLock::new(|| Fake {
    state: Mutex::new(State::new()),
    wake: Condvar::new(),
});

fn lock() -> MutexGuard<'static, State> {
    FAKE.state.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Starts a driver call: counts it, blocks while the symbol is held, then
/// returns its injected failure or the locked state.
fn enter(name: &'static str) -> Result<MutexGuard<'static, State>, CUresult> {
    let mut st = lock();
    *st.calls.entry(name).or_default() += 1;
    if st.held.contains(name) {
        *st.waiting.entry(name).or_default() += 1;
        while st.held.contains(name) {
            st = FAKE.wake.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        if let Some(w) = st.waiting.get_mut(name) {
            *w = w.saturating_sub(1);
        }
    }
    if let Some(code) = st.faults.get_mut(name).and_then(Fault::fire) {
        return Err(code);
    }
    Ok(st)
}

/// Turns a `Result` into the status a driver function returns.
fn status(result: Result<(), CUresult>) -> CUresult {
    match result {
        Ok(()) => CUresult::CUDA_SUCCESS,
        Err(code) => code,
    }
}

/// Writes `value` through an out-pointer; a null pointer is invalid.
///
/// # Safety
///
/// `out` must be null or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> Result<(), CUresult> {
    if out.is_null() {
        return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null and, per this function's contract, valid for a write.
    unsafe { out.write(value) };
    Ok(())
}

fn stream_handle(s: sys::CUstream) -> usize {
    s.addr()
}

fn event_handle(e: sys::CUevent) -> usize {
    e.addr()
}

// ---------------------------------------------------------------------------
// The driver API (signatures as in cudarc::driver::sys, i.e. cuda.h)

/// `cuInit`: initialises the fake driver (flags must be 0).
///
/// # Safety
///
/// None beyond the driver's: callable from any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    status(enter("cuInit").and_then(|mut st| {
        if flags != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        st.initialised = true;
        Ok(())
    }))
}

/// `cuDeviceGet`: only ordinal 0 exists.
///
/// # Safety
///
/// `device` must be null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut sys::CUdevice, ordinal: c_int) -> CUresult {
    status(enter("cuDeviceGet").and_then(|st| {
        st.initialised()?;
        if ordinal != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
        }
        // SAFETY: the caller's contract.
        unsafe { put(device, 0) }
    }))
}

/// `cuDevicePrimaryCtxRetain`: one more reference to the primary context.
///
/// # Safety
///
/// `pctx` must be null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(
    pctx: *mut sys::CUcontext,
    dev: sys::CUdevice,
) -> CUresult {
    status(enter("cuDevicePrimaryCtxRetain").and_then(|mut st| {
        st.initialised()?;
        if dev != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
        }
        // SAFETY: the caller's contract.
        unsafe { put(pctx, std::ptr::without_provenance_mut(PRIMARY_CTX)) }?;
        st.ctx_refs += 1;
        Ok(())
    }))
}

/// `cuDevicePrimaryCtxRelease_v2`: one reference fewer.
///
/// # Safety
///
/// None beyond the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: sys::CUdevice) -> CUresult {
    status(enter("cuDevicePrimaryCtxRelease_v2").and_then(|mut st| {
        st.initialised()?;
        if dev != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_DEVICE);
        }
        if st.ctx_refs == 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
        st.ctx_refs -= 1;
        Ok(())
    }))
}

/// `cuCtxSetCurrent`: the primary context (while retained) or none.
///
/// # Safety
///
/// None beyond the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: sys::CUcontext) -> CUresult {
    status(enter("cuCtxSetCurrent").and_then(|st| {
        st.initialised()?;
        let ctx = ctx.addr();
        if ctx != 0 && (ctx != PRIMARY_CTX || st.ctx_refs == 0) {
            return Err(CUresult::CUDA_ERROR_INVALID_CONTEXT);
        }
        CURRENT.with(|c| c.set(ctx));
        Ok(())
    }))
}

/// `cuStreamCreate`.
///
/// # Safety
///
/// `stream` must be null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut sys::CUstream, _flags: c_uint) -> CUresult {
    status(enter("cuStreamCreate").and_then(|mut st| {
        st.context()?;
        if stream.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let h = st.handle();
        st.streams.insert(h, Stream::default());
        // SAFETY: the caller's contract.
        unsafe { put(stream, std::ptr::without_provenance_mut(h)) }
    }))
}

/// `cuStreamDestroy_v2`: the stream's queued work completes, then it is gone.
///
/// # Safety
///
/// None beyond the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: sys::CUstream) -> CUresult {
    status(enter("cuStreamDestroy_v2").and_then(|mut st| {
        st.initialised()?;
        let h = stream_handle(stream);
        if h == NULL_STREAM {
            return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
        }
        st.stream(h)?;
        st.flush(h, u64::MAX);
        st.streams.remove(&h);
        Ok(())
    }))
}

/// `cuStreamWaitEvent`: later work on `stream` runs after `event`'s; the
/// fake runs the event's work now.
///
/// # Safety
///
/// None beyond the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitEvent(
    stream: sys::CUstream,
    event: sys::CUevent,
    flags: c_uint,
) -> CUresult {
    status(enter("cuStreamWaitEvent").and_then(|mut st| {
        st.initialised()?;
        st.stream(stream_handle(stream))?;
        if flags != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        st.complete(event_handle(event))
    }))
}

/// `cuStreamSynchronize`: runs every queued op of the stream.
///
/// # Safety
///
/// None beyond the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(stream: sys::CUstream) -> CUresult {
    status(enter("cuStreamSynchronize").and_then(|mut st| {
        st.initialised()?;
        let h = stream_handle(stream);
        st.stream(h)?;
        st.flush(h, u64::MAX);
        Ok(())
    }))
}

/// `cuEventCreate`.
///
/// # Safety
///
/// `event` must be null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(event: *mut sys::CUevent, _flags: c_uint) -> CUresult {
    status(enter("cuEventCreate").and_then(|mut st| {
        st.context()?;
        if event.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let h = st.handle();
        st.events.insert(h, Event::default());
        // SAFETY: the caller's contract.
        unsafe { put(event, std::ptr::without_provenance_mut(h)) }
    }))
}

/// `cuEventDestroy_v2`.
///
/// # Safety
///
/// None beyond the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(event: sys::CUevent) -> CUresult {
    status(enter("cuEventDestroy_v2").and_then(|mut st| {
        st.initialised()?;
        st.events
            .remove(&event_handle(event))
            .map(|_| ())
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
    }))
}

/// `cuEventRecord`: the event covers the stream's work queued so far.
///
/// # Safety
///
/// None beyond the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(event: sys::CUevent, stream: sys::CUstream) -> CUresult {
    status(enter("cuEventRecord").and_then(|mut st| {
        st.initialised()?;
        let s = stream_handle(stream);
        let upto = st.stream(s)?.enqueued;
        let e = st
            .events
            .get_mut(&event_handle(event))
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
        e.recorded = Some((s, upto));
        Ok(())
    }))
}

/// `cuEventSynchronize`: runs the work the event covers.
///
/// # Safety
///
/// None beyond the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(event: sys::CUevent) -> CUresult {
    status(enter("cuEventSynchronize").and_then(|mut st| {
        st.initialised()?;
        st.complete(event_handle(event))
    }))
}

/// `cuMemHostRegister_v2`: records the range (nothing is pinned).
///
/// # Safety
///
/// `p` must point to `bytesize` bytes that stay valid until unregistered
/// (queued copies read and write them).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostRegister_v2(
    p: *mut c_void,
    bytesize: usize,
    _flags: c_uint,
) -> CUresult {
    status(enter("cuMemHostRegister_v2").and_then(|mut st| {
        st.context()?;
        let at = p.addr();
        if at == 0 || bytesize == 0 || at.checked_add(bytesize).is_none() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        if overlaps(&st.host, at, bytesize) {
            return Err(CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
        }
        st.host.insert(at, bytesize);
        Ok(())
    }))
}

/// `cuMemHostUnregister`: `p` must be a registered base.
///
/// # Safety
///
/// None beyond the driver's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    status(enter("cuMemHostUnregister").and_then(|mut st| {
        st.context()?;
        let at = p.addr();
        let len = st
            .host
            .remove(&at)
            .ok_or(CUresult::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)?;
        st.drop_ops_touching(at, len);
        Ok(())
    }))
}

/// Checks and queues one async copy.
fn memcpy_async(
    name: &'static str,
    dst: usize,
    src: usize,
    len: usize,
    stream: sys::CUstream,
    to_device: bool,
) -> CUresult {
    status(enter(name).and_then(|mut st| {
        st.context()?;
        st.stream(stream_handle(stream))?;
        if len == 0 {
            return Ok(());
        }
        let (device, host) = if to_device { (dst, src) } else { (src, dst) };
        if !inside(&st.device, device, len) || !inside(&st.host, host, len) {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        st.enqueue(stream_handle(stream), Op::Copy { dst, src, len })
    }))
}

/// `cuMemcpyHtoDAsync_v2`: queued until waited for.
///
/// # Safety
///
/// None beyond the driver's (the ranges are checked against registrations).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: sys::CUdeviceptr,
    src: *const c_void,
    byte_count: usize,
    stream: sys::CUstream,
) -> CUresult {
    let Ok(dst) = usize::try_from(dst) else {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    };
    memcpy_async(
        "cuMemcpyHtoDAsync_v2",
        dst,
        src.addr(),
        byte_count,
        stream,
        true,
    )
}

/// `cuMemcpyDtoHAsync_v2`: queued until waited for.
///
/// # Safety
///
/// None beyond the driver's (the ranges are checked against registrations).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: sys::CUdeviceptr,
    byte_count: usize,
    stream: sys::CUstream,
) -> CUresult {
    let Ok(src) = usize::try_from(src) else {
        return CUresult::CUDA_ERROR_INVALID_VALUE;
    };
    memcpy_async(
        "cuMemcpyDtoHAsync_v2",
        dst.addr(),
        src,
        byte_count,
        stream,
        false,
    )
}

/// `cuMemGetAddressRange_v2`: the declared device range containing `dptr`.
///
/// # Safety
///
/// `pbase` and `psize` must each be null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    pbase: *mut sys::CUdeviceptr,
    psize: *mut usize,
    dptr: sys::CUdeviceptr,
) -> CUresult {
    status(enter("cuMemGetAddressRange_v2").and_then(|st| {
        st.context()?;
        let at = usize::try_from(dptr).map_err(|_| CUresult::CUDA_ERROR_NOT_FOUND)?;
        let (base, len) = containing(&st.device, at).ok_or(CUresult::CUDA_ERROR_NOT_FOUND)?;
        // SAFETY: the caller's contract; either may be null (not wanted).
        unsafe {
            if !pbase.is_null() {
                pbase.write(base as sys::CUdeviceptr);
            }
            if !psize.is_null() {
                psize.write(len);
            }
        }
        Ok(())
    }))
}

/// `cuPointerGetAttribute` for `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` (an
/// `unsigned int`) and `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` (an `int`);
/// other attributes are `CUDA_ERROR_INVALID_VALUE`. The attribute is taken
/// as its `unsigned int` value (the enum's C ABI), so an unknown value is
/// an error, not undefined behaviour.
///
/// # Safety
///
/// `data` must be null or valid for a write of the attribute's type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: c_uint,
    ptr: sys::CUdeviceptr,
) -> CUresult {
    status(enter("cuPointerGetAttribute").and_then(|st| {
        st.initialised()?;
        let at = usize::try_from(ptr).map_err(|_| CUresult::CUDA_ERROR_INVALID_VALUE)?;
        let memtype = if containing(&st.device, at).is_some() {
            sys::CUmemorytype::CU_MEMORYTYPE_DEVICE
        } else if containing(&st.host, at).is_some() {
            sys::CUmemorytype::CU_MEMORYTYPE_HOST
        } else {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        };
        if attribute == sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE as c_uint {
            // SAFETY: the caller's contract (an unsigned int).
            unsafe { put(data.cast::<c_uint>(), memtype as c_uint) }
        } else if attribute
            == sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL as c_uint
        {
            // SAFETY: the caller's contract (an int).
            unsafe { put(data.cast::<c_int>(), 0) }
        } else {
            Err(CUresult::CUDA_ERROR_INVALID_VALUE)
        }
    }))
}

// The exported functions have exactly the driver's types as cudarc declares
// them (cudarc's own `_F` aliases are private; these spell the same).
const _: unsafe extern "C" fn(c_uint) -> CUresult = cuInit;
const _: unsafe extern "C" fn(*mut sys::CUdevice, c_int) -> CUresult = cuDeviceGet;
const _: unsafe extern "C" fn(*mut sys::CUcontext, sys::CUdevice) -> CUresult =
    cuDevicePrimaryCtxRetain;
const _: unsafe extern "C" fn(sys::CUdevice) -> CUresult = cuDevicePrimaryCtxRelease_v2;
const _: unsafe extern "C" fn(sys::CUcontext) -> CUresult = cuCtxSetCurrent;
const _: unsafe extern "C" fn(*mut sys::CUstream, c_uint) -> CUresult = cuStreamCreate;
const _: unsafe extern "C" fn(sys::CUstream) -> CUresult = cuStreamDestroy_v2;
const _: unsafe extern "C" fn(sys::CUstream, sys::CUevent, c_uint) -> CUresult = cuStreamWaitEvent;
const _: unsafe extern "C" fn(sys::CUstream) -> CUresult = cuStreamSynchronize;
const _: unsafe extern "C" fn(*mut sys::CUevent, c_uint) -> CUresult = cuEventCreate;
const _: unsafe extern "C" fn(sys::CUevent) -> CUresult = cuEventDestroy_v2;
const _: unsafe extern "C" fn(sys::CUevent, sys::CUstream) -> CUresult = cuEventRecord;
const _: unsafe extern "C" fn(sys::CUevent) -> CUresult = cuEventSynchronize;
const _: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult = cuMemHostRegister_v2;
const _: unsafe extern "C" fn(*mut c_void) -> CUresult = cuMemHostUnregister;
const _: unsafe extern "C" fn(sys::CUdeviceptr, *const c_void, usize, sys::CUstream) -> CUresult =
    cuMemcpyHtoDAsync_v2;
const _: unsafe extern "C" fn(*mut c_void, sys::CUdeviceptr, usize, sys::CUstream) -> CUresult =
    cuMemcpyDtoHAsync_v2;
const _: unsafe extern "C" fn(*mut sys::CUdeviceptr, *mut usize, sys::CUdeviceptr) -> CUresult =
    cuMemGetAddressRange_v2;
// cudarc passes the attribute as `CUpointer_attribute`, a `#[repr(u32)]`
// enum: the same C ABI as the `c_uint` taken here.
const _: () = assert!(
    std::mem::size_of::<sys::CUpointer_attribute>() == std::mem::size_of::<c_uint>()
        && std::mem::align_of::<sys::CUpointer_attribute>() == std::mem::align_of::<c_uint>()
);
const _: unsafe extern "C" fn(*mut c_void, c_uint, sys::CUdeviceptr) -> CUresult =
    cuPointerGetAttribute;

// ---------------------------------------------------------------------------
// Test controls

/// A symbol name from a C string (`None`: null, not UTF-8 or not exported).
///
/// # Safety
///
/// `name` must be null or a NUL-terminated string.
unsafe fn symbol(name: *const c_char) -> Option<&'static str> {
    if name.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated per this function's contract.
    let name = unsafe { CStr::from_ptr(name) }.to_str().ok()?;
    SYMBOLS.iter().copied().find(|s| *s == name)
}

/// The `CUresult`s a fault may inject (their numeric values).
fn fault_code(code: c_uint) -> Option<CUresult> {
    Some(match code {
        1 => CUresult::CUDA_ERROR_INVALID_VALUE,
        2 => CUresult::CUDA_ERROR_OUT_OF_MEMORY,
        3 => CUresult::CUDA_ERROR_NOT_INITIALIZED,
        4 => CUresult::CUDA_ERROR_DEINITIALIZED,
        100 => CUresult::CUDA_ERROR_NO_DEVICE,
        101 => CUresult::CUDA_ERROR_INVALID_DEVICE,
        201 => CUresult::CUDA_ERROR_INVALID_CONTEXT,
        400 => CUresult::CUDA_ERROR_INVALID_HANDLE,
        500 => CUresult::CUDA_ERROR_NOT_FOUND,
        700 => CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
        719 => CUresult::CUDA_ERROR_LAUNCH_FAILED,
        999 => CUresult::CUDA_ERROR_UNKNOWN,
        _ => return None,
    })
}

/// Declares `[ptr, ptr + len)` fake device memory of device 0. Returns 0,
/// or -1 for a null/empty/overflowing range or one overlapping another.
///
/// # Safety
///
/// The bytes must stay valid, and not be otherwise accessed while a copy
/// that touches them is queued, until the range is unregistered (or the
/// process ends): queued copies read and write them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lmcache_fake_cuda_register_device(ptr: u64, len: u64) -> c_int {
    let (Ok(at), Ok(len)) = (usize::try_from(ptr), usize::try_from(len)) else {
        return -1;
    };
    let mut st = lock();
    if at == 0 || len == 0 || at.checked_add(len).is_none() || overlaps(&st.device, at, len) {
        return -1;
    }
    st.device.insert(at, len);
    0
}

/// Forgets the device range based at `ptr` (queued copies touching it are
/// dropped and counted as a violation). Returns 0, or -1 if there is none.
#[unsafe(no_mangle)]
pub extern "C" fn lmcache_fake_cuda_unregister_device(ptr: u64) -> c_int {
    let mut st = lock();
    let Some(len) = usize::try_from(ptr)
        .ok()
        .and_then(|at| st.device.remove(&at))
    else {
        return -1;
    };
    st.drop_ops_touching(ptr as usize, len);
    0
}

/// Makes the next `count` calls of symbol `name`, after `after` more
/// successful ones, return `code` (a `CUresult` value: 1, 2, 3, 4, 100,
/// 101, 201, 400, 500, 700, 719 or 999) without doing anything. Replaces
/// an earlier fault of that symbol; `count` 0 clears it. Returns 0, -1 for
/// an unknown symbol, -2 for an unsupported code.
///
/// # Safety
///
/// `name` must be null or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lmcache_fake_cuda_fail(
    name: *const c_char,
    code: c_uint,
    count: c_uint,
    after: c_uint,
) -> c_int {
    // SAFETY: forwarded from this function's contract.
    let Some(name) = (unsafe { symbol(name) }) else {
        return -1;
    };
    let Some(code) = fault_code(code) else {
        return -2;
    };
    lock().faults.insert(name, Fault { after, count, code });
    0
}

/// Holds (`on` != 0) or releases calls of symbol `name`: while held, a call
/// blocks before doing anything. Returns 0, or -1 for an unknown symbol.
///
/// # Safety
///
/// `name` must be null or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lmcache_fake_cuda_hold(name: *const c_char, on: c_int) -> c_int {
    // SAFETY: forwarded from this function's contract.
    let Some(name) = (unsafe { symbol(name) }) else {
        return -1;
    };
    let mut st = lock();
    if on != 0 {
        st.held.insert(name);
    } else {
        st.held.remove(name);
        FAKE.wake.notify_all();
    }
    0
}

/// Calls of symbol `name` blocked by a hold right now; -1 for an unknown
/// symbol.
///
/// # Safety
///
/// `name` must be null or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lmcache_fake_cuda_waiting(name: *const c_char) -> i64 {
    // SAFETY: forwarded from this function's contract.
    let Some(name) = (unsafe { symbol(name) }) else {
        return -1;
    };
    let n = lock().waiting.get(name).copied().unwrap_or(0);
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Calls of symbol `name` since the last reset (failed and held ones
/// included); -1 for an unknown symbol.
///
/// # Safety
///
/// `name` must be null or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lmcache_fake_cuda_calls(name: *const c_char) -> i64 {
    // SAFETY: forwarded from this function's contract.
    let Some(name) = (unsafe { symbol(name) }) else {
        return -1;
    };
    let n = lock().calls.get(name).copied().unwrap_or(0);
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// A state counter (see [`STATS`]): `live_streams` and `live_events`
/// (created through the driver API and not destroyed), `host_registrations`,
/// `device_ranges`, `pending_ops` (queued copies not yet run), `ctx_refs`
/// (primary-context references), `violations`, `executed_ops`. -1 for an
/// unknown name.
///
/// # Safety
///
/// `name` must be null or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn lmcache_fake_cuda_stat(name: *const c_char) -> i64 {
    if name.is_null() {
        return -1;
    }
    // SAFETY: non-null and NUL-terminated per this function's contract.
    let Ok(name) = (unsafe { CStr::from_ptr(name) }).to_str() else {
        return -1;
    };
    match lock().stat(name) {
        Some(n) => i64::try_from(n).unwrap_or(i64::MAX),
        None => -1,
    }
}

/// A producer's pending write: queues "fill `[dptr, dptr + len)` with
/// `value`" on a stream of its own and returns an event recorded after it
/// (a `CUevent` handle for `cuStreamWaitEvent`), or 0 if the range is not
/// inside one device range. The bytes change only when someone waits for
/// the event (or resets the fake).
#[unsafe(no_mangle)]
pub extern "C" fn lmcache_fake_cuda_pending_fill(dptr: u64, len: u64, value: u8) -> u64 {
    let (Ok(at), Ok(n)) = (usize::try_from(dptr), usize::try_from(len)) else {
        return 0;
    };
    let mut st = lock();
    if n == 0 || !inside(&st.device, at, n) {
        return 0;
    }
    let stream = st.handle();
    st.streams.insert(
        stream,
        Stream {
            internal: true,
            ..Stream::default()
        },
    );
    if st
        .enqueue(
            stream,
            Op::Fill {
                dst: at,
                len: n,
                value,
            },
        )
        .is_err()
    {
        return 0;
    }
    let event = st.handle();
    st.events.insert(
        event,
        Event {
            recorded: Some((stream, 1)),
            internal: true,
        },
    );
    event as u64
}

/// Clears faults, holds (waking held calls), call counters and the
/// violation count; runs the pending producer writes. Handles,
/// registrations and queued driver copies are kept.
#[unsafe(no_mangle)]
pub extern "C" fn lmcache_fake_cuda_reset() {
    let mut st = lock();
    st.faults.clear();
    st.held.clear();
    st.calls.clear();
    st.violations = 0;
    let internal: Vec<usize> = st
        .streams
        .iter()
        .filter(|(_, s)| s.internal)
        .map(|(h, _)| *h)
        .collect();
    for h in internal {
        st.flush(h, u64::MAX);
        st.streams.remove(&h);
    }
    st.events.retain(|_, e| !e.internal);
    FAKE.wake.notify_all();
}
