//! Copy backends: who moves the bytes between a worker's KV memory and
//! shared memory.
//!
//! A backend is bound to a [`PageLayout`] (its buffers' sizes, blocks and
//! page groups) and to the buffers' addresses. It receives only
//! [`CopyPlan`]s that passed validation, and re-checks each one while
//! turning it into [`CopyRun`]s ([`copy_runs`]), so every byte it touches is
//! inside its buffers and the mapping. It
//! reports how a copy ended in a way that keeps invariant I5 checkable: a
//! [`CopyFailure::Recoverable`] promises that nothing is in flight any more
//! (the lease may be finished as failed), a [`CopyFailure::InFlight`] says a
//! copy may still touch the memory (the engine turns unsafe).

use std::any::Any;
use std::collections::VecDeque;
use std::time::Duration;

use parking_lot::Mutex;

use super::layout::{PageLayout, PoolShape, check_disjoint};
use super::plan::{CopyPlan, Direction};
use crate::error::{Error, Result};
use crate::store::shm::ShmPool;

/// How a copy failed.
#[derive(Debug)]
pub enum CopyFailure {
    /// Nothing is in flight any more: the lease can be finished as failed.
    Recoverable(Error),
    /// A copy may still be in flight: the memory must stay alive and the
    /// lease must never be finished.
    InFlight(String),
}

/// Keeps a per-mapping resource (e.g. a CUDA host registration) alive as long
/// as the mapping is used.
pub type Registration = Box<dyn Any + Send + Sync>;

/// Moves the pages of validated plans.
pub trait CopyBackend: Send + Sync {
    /// `"cpu"` or `"cuda"`.
    fn name(&self) -> &'static str;
    /// How it moves bytes, for status and benchmarks (the cpu backend: its
    /// [`StreamKernel`]); the backend's name unless it says more.
    fn copy_kernel(&self) -> &'static str {
        self.name()
    }
    /// The bound memory's page layout.
    fn layout(&self) -> &PageLayout;
    /// Prepares a freshly mapped shared-memory pool (CUDA: page-locks it once).
    fn register(&self, pool: &ShmPool) -> Result<Option<Registration>>;
    /// Whether this backend can wait on a producer event.
    fn accepts_events(&self) -> bool;
    /// Copies every page of `plan`, after `producer_event` (if any) completed,
    /// and returns only when nothing is in flight (or says otherwise).
    fn copy(
        &self,
        plan: &CopyPlan,
        pool: &ShmPool,
        producer_event: Option<u64>,
    ) -> std::result::Result<(), CopyFailure>;
}

/// A fault the test hook injects into the next copies of a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The copy fails before moving a byte (recoverable).
    Fail,
    /// The copy reports that it may still be in flight (unsafe).
    InFlight,
    /// The copy waits this long before moving bytes (holds a copy in flight).
    Delay(Duration),
}

/// Faults queued by tests, consumed one per copy.
#[derive(Debug, Default)]
pub struct FaultQueue(Mutex<VecDeque<Fault>>);

impl FaultQueue {
    /// Queues `count` copies of `fault`.
    pub fn push(&self, fault: Fault, count: usize) {
        let mut q = self.0.lock();
        q.extend(std::iter::repeat_n(fault, count));
    }

    /// Applies the next fault, if any: `Err` for Fail/InFlight, a sleep for Delay.
    pub fn apply(&self) -> std::result::Result<(), CopyFailure> {
        let next = self.0.lock().pop_front();
        match next {
            None => Ok(()),
            Some(Fault::Fail) => Err(CopyFailure::Recoverable(Error::Device(
                "injected copy failure (test hook)".into(),
            ))),
            Some(Fault::InFlight) => Err(CopyFailure::InFlight(
                "injected fault: the copy may still be in flight (test hook)".into(),
            )),
            Some(Fault::Delay(d)) => {
                std::thread::sleep(d);
                Ok(())
            }
        }
    }

    /// Drops every queued fault.
    pub fn clear(&self) {
        self.0.lock().clear();
    }
}

/// The host backend: the bound memory is ordinary memory (numpy arrays,
/// torch CPU tensors) and pages are copied with `memcpy` / streaming stores
/// on the engine's copy threads.
pub struct CpuBackend {
    bases: Vec<*mut u8>,
    layout: PageLayout,
    faults: FaultQueue,
    kernel: StreamKernel,
}

// SAFETY: `CpuBackend` only stores the base addresses of memory that its
// constructor's caller keeps alive for the backend's whole life; all access
// goes through re-checked plans on the copy threads, and concurrent plans
// never share a page (the connector pins distinct blocks per job).
unsafe impl Send for CpuBackend {}
// SAFETY: see `Send`; the backend has no interior state besides the fault
// queue, which is behind a mutex.
unsafe impl Sync for CpuBackend {}

impl CpuBackend {
    /// A backend over a contiguous pool of `num_blocks` rows of `page_bytes`
    /// at `base` (the boundary fork's page pool).
    ///
    /// # Safety
    ///
    /// `base` must point to `num_blocks * page_bytes` writable bytes that stay
    /// valid (not freed, not moved) for the whole life of the backend, and —
    /// if the engine turns unsafe — until the process ends. Rows named by a
    /// job must not be written by others while that job copies.
    pub unsafe fn new(base: *mut u8, shape: PoolShape) -> Result<CpuBackend> {
        let layout = PageLayout::pool(shape)?;
        if base.is_null() {
            return Err(Error::invalid("the page pool's address is null"));
        }
        // SAFETY: forwarded from this function's contract (one buffer of
        // `num_blocks * page_bytes` bytes at `base`).
        unsafe { CpuBackend::with_layout(vec![base], layout) }
    }

    /// A backend over buffers at `bases`, laid out by `layout` (buffer `i`
    /// has `layout.buffer_sizes()[i]` bytes at `bases[i]`). Refuses a count
    /// that differs from the layout's, a null address, and buffers whose
    /// address ranges overlap.
    ///
    /// # Safety
    ///
    /// Each `bases[i]` must point to `layout.buffer_sizes()[i]` writable
    /// bytes that stay valid (not freed, not moved) for the whole life of the
    /// backend, and — if the engine turns unsafe — until the process ends.
    /// The bytes of the blocks named by a job must not be written by others
    /// while that job copies.
    pub unsafe fn with_layout(bases: Vec<*mut u8>, layout: PageLayout) -> Result<CpuBackend> {
        check_buffers(&bases, &layout)?;
        Ok(CpuBackend {
            bases,
            layout,
            faults: FaultQueue::default(),
            kernel: StreamKernel::detected(),
        })
    }

    /// The same backend streaming large runs with `kernel` instead of the
    /// one [`StreamKernel::detected`] picks (benchmarks compare them).
    pub fn with_kernel(mut self, kernel: StreamKernel) -> CpuBackend {
        self.kernel = kernel;
        self
    }

    /// The test hook's fault queue.
    pub fn faults(&self) -> &FaultQueue {
        &self.faults
    }
}

/// Checks buffer addresses against a layout: one per buffer, none null, no
/// two overlapping (the per-job overlap rule compares offsets within each
/// buffer, which is sound only for disjoint buffers).
fn check_buffers(bases: &[*mut u8], layout: &PageLayout) -> Result<()> {
    if bases.len() != layout.buffer_sizes().len() {
        return Err(Error::invalid(format!(
            "the layout describes {} buffers but {} addresses were given",
            layout.buffer_sizes().len(),
            bases.len()
        )));
    }
    let ranges: Vec<(u64, u64)> = bases
        .iter()
        .zip(layout.buffer_sizes())
        .map(|(&b, &size)| (b as u64, size))
        .collect();
    check_disjoint(&ranges)
}

/// Copies below this size go through `memcpy`; larger ones stream.
const STREAM_MIN: usize = 16 * 1024;

/// The interleaved kernel moves blocks of [`INTERLEAVE`] pages of this
/// size, one cache line of each page in turn.
const INTERLEAVE_PAGE: usize = 4096;
/// Pages copied side by side by the interleaved kernel.
const INTERLEAVE: usize = 4;
/// Bytes the linear kernel loads before it stores them (16 SSE registers).
const LINEAR_STEP: usize = 256;

/// How a large copy walks its bytes with streaming stores, chosen once per
/// process from the CPU ([`StreamKernel::detected`]): each is the fastest
/// where it is chosen, and the others are slower there.
///
/// Measured with 256 KiB pages between a huge-page buffer and a 4 KiB-page
/// shared-memory mapping (medians of alternating rounds, store / restore):
/// on an AMD EPYC (Zen 4) VM, linear 20.6 / 21.3 GB/s against interleaved
/// 15.9 / 15.7 GB/s (and glibc's 256 MiB memcpy 14.2 GB/s; AVX-512 stores
/// ~9 % slower); on an Intel Xeon VM, interleaved ~11.3–11.8 GB/s against
/// ~8.6 GB/s for a linear stream (64 bytes per step) and ~12.7 GB/s for
/// memcpy; on a 5th-generation Intel Xeon VM (512 MiB, beyond its cache),
/// interleaved with AVX-512 stores 12.2–12.3 / 11.8–12.1 GB/s against
/// 11.8 / 11.5–11.6 with SSE2 stores and 9.9–10.0 / 9.2 linear.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKernel {
    /// [`LINEAR_STEP`] bytes loaded into SSE2 registers, then stored, front
    /// to back (AMD and Hygon CPUs).
    Linear,
    /// Blocks of [`INTERLEAVE`] × 4 KiB, one cache line of each page in
    /// turn, the next block's lines prefetched, with SSE2 stores (other CPUs
    /// without AVX-512).
    Interleaved,
    /// As [`StreamKernel::Interleaved`], each cache line moved by one
    /// AVX-512 load and store (other CPUs with AVX-512F: fewer instructions
    /// per line leave more of a shared core to the other threads; on the
    /// 5th-generation Xeon VM `lmcache-rc bench`'s one-thread stores went
    /// from 0.80–0.84 to 0.86–0.88 of memcpy). Where the CPU lacks AVX-512F
    /// it runs as `Interleaved`.
    InterleavedAvx512,
}

impl StreamKernel {
    /// The kernels this CPU can run (benchmarks compare them).
    pub fn available() -> Vec<StreamKernel> {
        let mut all = vec![StreamKernel::Linear, StreamKernel::Interleaved];
        if has_avx512f() {
            all.push(StreamKernel::InterleavedAvx512);
        }
        all
    }

    /// The kernel this CPU uses (detected once).
    pub fn detected() -> StreamKernel {
        static KERNEL: std::sync::OnceLock<StreamKernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| match cpu_vendor() {
            Some(v) if v == *b"AuthenticAMD" || v == *b"HygonGenuine" => StreamKernel::Linear,
            _ if has_avx512f() => StreamKernel::InterleavedAvx512,
            _ => StreamKernel::Interleaved,
        })
    }

    /// For status and benchmarks: `"streaming stores, linear (256 B
    /// steps)"`, `"streaming stores, interleaved (4 x 4 KiB)"` or
    /// `"streaming stores, interleaved (4 x 4 KiB, AVX-512)"`.
    pub fn describe(self) -> &'static str {
        match self {
            StreamKernel::Linear => "streaming stores, linear (256 B steps)",
            StreamKernel::Interleaved => "streaming stores, interleaved (4 x 4 KiB)",
            StreamKernel::InterleavedAvx512 => "streaming stores, interleaved (4 x 4 KiB, AVX-512)",
        }
    }
}

/// Whether the CPU runs AVX-512F instructions (detected once by the
/// standard library); false off x86-64.
fn has_avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The CPU's vendor string (CPUID leaf 0), None off x86-64.
fn cpu_vendor() -> Option<[u8; 12]> {
    #[cfg(target_arch = "x86_64")]
    {
        // CPUID is part of the x86-64 baseline; leaf 0 always exists.
        let r = std::arch::x86_64::__cpuid(0);
        let mut v = [0u8; 12];
        v[..4].copy_from_slice(&r.ebx.to_le_bytes());
        v[4..8].copy_from_slice(&r.edx.to_le_bytes());
        v[8..].copy_from_slice(&r.ecx.to_le_bytes());
        Some(v)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// Copies `len` bytes from `src` to `dst` (non-overlapping).
///
/// Large copies use non-temporal (streaming) stores on x86-64, walked as
/// `kernel` says (the backend's, [`StreamKernel::detected`] unless a
/// benchmark chose another): page copies are written once and read
/// by someone else (the sidecar, the GPU or a later step), so caching them
/// only costs read-for-ownership traffic. On an earlier CI VM (AMD EPYC),
/// `memcpy` moved 256 KiB pages out of shared memory at only 3–5 GB/s (it
/// picks `rep movsb` at that size); on the Zen 4 VM of [`StreamKernel`]'s
/// figures it ran at 13.6–13.9 GB/s against 20.6–21.3 streaming.
///
/// # Safety
///
/// `src` must be readable and `dst` writable for `len` bytes, and the ranges
/// must not overlap.
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
unsafe fn copy_bytes(dst: *mut u8, src: *const u8, len: usize, kernel: StreamKernel) {
    #[cfg(target_arch = "x86_64")]
    if len >= STREAM_MIN {
        // SAFETY: forwarded from this function's contract.
        unsafe { stream_copy(dst, src, len, kernel) };
        return;
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Streaming copy: aligns `dst` to a cache line, then copies with
/// non-temporal stores in `kernel`'s order (the interleaved kernel's tail
/// linearly, with SSE2), then a store fence. SSE2 is part of the x86-64
/// baseline, so only the AVX-512 blocks need the CPU checked: AVX2 stores
/// measured no faster anywhere, AVX-512 ones faster on the Intel VMs and
/// ~9 % slower on the AMD one ([`StreamKernel`]).
///
/// # Safety
///
/// As [`copy_bytes`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(dst: *mut u8, src: *const u8, len: usize, kernel: StreamKernel) {
    use std::arch::x86_64::_mm_sfence;
    // Bytes until `dst` is 64-byte aligned (full-line streaming stores).
    let head = dst.align_offset(64).min(len);
    // SAFETY: `head <= len`, so both ranges are inside the caller's buffers.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    // SAFETY: `head <= len`: both pointers stay inside (or one past) the
    // caller's buffers.
    let (d, s, n) = unsafe { (dst.add(head), src.add(head), len - head) };
    let done = match kernel {
        StreamKernel::Linear => 0,
        StreamKernel::Interleaved | StreamKernel::InterleavedAvx512 => {
            let block = INTERLEAVE * INTERLEAVE_PAGE;
            let blocks = n / block;
            if kernel == StreamKernel::InterleavedAvx512 && has_avx512f() {
                // SAFETY: `blocks * block <= n` bytes from `s` / `d` lie
                // inside the caller's buffers; `d` is 64-byte aligned; the
                // CPU runs AVX-512F (just checked).
                unsafe { stream_blocks_avx512(d, s, blocks) };
            } else {
                // SAFETY: as above (SSE2 is part of the x86-64 baseline).
                unsafe { stream_blocks_sse2(d, s, blocks) };
            }
            blocks * block
        }
    };
    // SAFETY: `done <= n`; the rest lies inside the caller's buffers and
    // `d + done` is 64-byte aligned (0 or a multiple of the block size past
    // `d`).
    unsafe { stream_linear_sse2(d.add(done), s.add(done), n - done) };
    // Streaming stores are weakly ordered: make them visible before the
    // lease is finished (which tells another process to read them).
    // SAFETY: SSE is part of the x86-64 baseline.
    unsafe { _mm_sfence() };
}

/// The interleaved walk over `$blocks` blocks at `$dst` / `$src`: 64 bytes
/// (one cache line) of each of the block's pages in turn, the line one
/// block ahead prefetched, each line copied by `$line` (inside the walk's
/// `unsafe` block) with the line's addresses bound to `$d` / `$s`. A macro
/// rather than a function taking the line copy, so the copy is inlined
/// into each caller with that caller's target features.
#[cfg(target_arch = "x86_64")]
macro_rules! interleaved_blocks {
    ($dst:expr, $src:expr, $blocks:expr, |$d:ident, $s:ident| $line:block) => {{
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let (dst, src): (*mut u8, *const u8) = ($dst, $src);
        let block = INTERLEAVE * INTERLEAVE_PAGE;
        for b in 0..$blocks {
            for line in (0..INTERLEAVE_PAGE).step_by(64) {
                for page in 0..INTERLEAVE {
                    let off = b * block + page * INTERLEAVE_PAGE + line;
                    // SAFETY: `off + 64 <= blocks * block`, inside both
                    // buffers (the caller's contract); `dst + off` is as
                    // aligned as `dst` (`off` is a multiple of 64), which
                    // the caller's line copy relies on. A prefetch never
                    // faults, and its address is computed with wrapping
                    // arithmetic (it may point past the buffer).
                    unsafe {
                        _mm_prefetch::<_MM_HINT_T0>(src.wrapping_add(off + block) as *const i8);
                        let ($d, $s) = (dst.add(off), src.add(off));
                        $line
                    }
                }
            }
        }
    }};
}

/// `blocks` interleaved blocks ([`interleaved_blocks`]), each line by four
/// SSE2 (the x86-64 baseline) loads and non-temporal stores.
///
/// # Safety
///
/// `blocks * INTERLEAVE * INTERLEAVE_PAGE` bytes readable at `src` and
/// writable at `dst` (16-byte aligned, as `_mm_stream_si128` requires),
/// not overlapping.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_blocks_sse2(dst: *mut u8, src: *const u8, blocks: usize) {
    // Each line: 64 bytes inside both buffers, `d` 16-byte aligned (the
    // macro's SAFETY comment and this function's contract).
    interleaved_blocks!(dst, src, blocks, |d, s| { stream_sse2::<4>(d, s) });
}

/// `blocks` interleaved blocks ([`interleaved_blocks`]), each line by one
/// AVX-512 load and one non-temporal store.
///
/// # Safety
///
/// `blocks * INTERLEAVE * INTERLEAVE_PAGE` bytes readable at `src` and
/// writable at `dst` (64-byte aligned, as `_mm512_stream_si512` requires),
/// not overlapping; the CPU must run AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn stream_blocks_avx512(dst: *mut u8, src: *const u8, blocks: usize) {
    use std::arch::x86_64::{__m512i, _mm512_loadu_si512, _mm512_stream_si512};
    // Each line: 64 bytes inside both buffers, `d` 64-byte aligned (the
    // macro's SAFETY comment and this function's contract); the load takes
    // any alignment; this function runs only where AVX-512F does.
    interleaved_blocks!(dst, src, blocks, |d, s| {
        let line = _mm512_loadu_si512(s as *const __m512i);
        _mm512_stream_si512(d as *mut __m512i, line);
    });
}

/// `N` × 16 bytes: all `N` unaligned loads first, then the non-temporal
/// stores (`N` ≤ 16: one SSE register each, so nothing spills).
///
/// # Safety
///
/// `N * 16` bytes readable at `src` and writable at `dst` (16-byte
/// aligned), not overlapping. SSE2 is part of the x86-64 baseline.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn stream_sse2<const N: usize>(dst: *mut u8, src: *const u8) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_setzero_si128, _mm_stream_si128};
    let s = src as *const __m128i;
    let d = dst as *mut __m128i;
    // SAFETY: the caller's contract: `N * 16` bytes at both pointers, `dst`
    // 16-byte aligned as `_mm_stream_si128` requires; loads take any
    // alignment.
    unsafe {
        let mut x = [_mm_setzero_si128(); N];
        for (i, r) in x.iter_mut().enumerate() {
            *r = _mm_loadu_si128(s.add(i));
        }
        for (i, r) in x.iter().enumerate() {
            _mm_stream_si128(d.add(i), *r);
        }
    }
}

/// A linear SSE2 streaming copy of `len` bytes: [`LINEAR_STEP`] bytes at a
/// time, then 64-byte lines, the last `len % 64` bytes through `memcpy`. No
/// fence (the caller's).
///
/// # Safety
///
/// As [`copy_bytes`], with `dst` 16-byte aligned.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_linear_sse2(dst: *mut u8, src: *const u8, len: usize) {
    let mut off = 0;
    // SAFETY: each iteration reads and writes `LINEAR_STEP` (then 64) bytes
    // at `off` with `off + step <= len`, inside both buffers; `dst + off` is
    // 16-byte aligned (`dst` is, `off` a multiple of 64), as
    // `_mm_stream_si128` requires; `_mm_loadu_si128` accepts any alignment.
    // SSE2 is part of the x86-64 baseline, so the intrinsics are always
    // available.
    unsafe {
        while off + LINEAR_STEP <= len {
            stream_sse2::<{ LINEAR_STEP / 16 }>(dst.add(off), src.add(off));
            off += LINEAR_STEP;
        }
        while off + 64 <= len {
            stream_sse2::<4>(dst.add(off), src.add(off));
            off += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(off), dst.add(off), len - off);
    }
}

/// One contiguous copy: `len` bytes at `offset` of buffer `buffer` and at
/// `shm_offset` of the shared memory. A run is one region of one page, or
/// several joined because they follow each other on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRun {
    /// Index of the buffer in the layout.
    pub buffer: usize,
    /// Byte offset in the buffer.
    pub offset: u64,
    /// Byte offset in the shared memory.
    pub shm_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Turns a plan into copies, re-checking it against the bound layout and
/// the shared memory's size: plans are public values, so a backend never
/// trusts that one came from [`crate::transfer::plan::plan_copy`]. A page
/// whose group is unknown, whose width differs from its group's, whose
/// block is 0 or past the layout, or whose slot leaves the shared memory is
/// a recoverable error, never an out-of-bounds copy. (Every region of a
/// block below `num_blocks` lies inside its buffer: [`PageLayout`] proved
/// that when it was built.)
///
/// Each page's regions go, in template order, to consecutive bytes of its
/// slot. Runs adjacent on both sides are joined: a large copy moves bytes
/// much faster than many small ones (the C library switches to its
/// streaming path), and consecutive slots and blocks are common (a lease's
/// slots are allocated together; a fresh request's blocks often are too),
/// so a 2-D pool copies runs of whole pages as before.
pub fn copy_runs(
    plan: &CopyPlan,
    layout: &PageLayout,
    shm_size: u64,
) -> std::result::Result<Vec<CopyRun>, CopyFailure> {
    let refuse = |why: String| Err(CopyFailure::Recoverable(Error::invalid(why)));
    let mut runs: Vec<CopyRun> = Vec::new();
    for page in &plan.pages {
        let Some(group) = layout.group(page.group) else {
            return refuse(format!(
                "a copy plan names layout group {}, which this backend does not have",
                page.group
            ));
        };
        let slot_end = page.shm_offset.checked_add(page.page_bytes);
        if page.page_bytes != group.page_bytes()
            || page.block == 0
            || page.block >= layout.num_blocks()
            || slot_end.is_none_or(|end| end > shm_size)
        {
            return refuse(format!(
                "a copy plan names block {} ({} bytes, group width {}) or slot bytes at {} outside \
                 the bound memory ({} blocks) or the shared memory ({shm_size} bytes)",
                page.block,
                page.page_bytes,
                group.page_bytes(),
                page.shm_offset,
                layout.num_blocks(),
            ));
        }
        let mut at = page.shm_offset;
        for (buffer, offset, len) in group.regions_at(page.block) {
            match runs.last_mut() {
                Some(last)
                    if last.buffer == buffer
                        && last.offset + last.len == offset
                        && last.shm_offset + last.len == at =>
                {
                    last.len += len;
                }
                _ => runs.push(CopyRun {
                    buffer,
                    offset,
                    shm_offset: at,
                    len,
                }),
            }
            at += len;
        }
    }
    Ok(runs)
}

impl CopyBackend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn copy_kernel(&self) -> &'static str {
        if cfg!(target_arch = "x86_64") {
            self.kernel.describe()
        } else {
            "memcpy"
        }
    }

    fn layout(&self) -> &PageLayout {
        &self.layout
    }

    fn register(&self, pool: &ShmPool) -> Result<Option<Registration>> {
        // The copies below assume page memory and shared memory are separate.
        let mut ranges: Vec<(u64, u64)> = self
            .bases
            .iter()
            .zip(self.layout.buffer_sizes())
            .map(|(&b, &size)| (b as u64, size))
            .collect();
        ranges.push((pool.as_ptr() as u64, pool.size()));
        check_disjoint(&ranges).map_err(|e| {
            Error::invalid(format!(
                "the bound page memory overlaps the sidecar's shared memory: {e}"
            ))
        })?;
        Ok(None)
    }

    fn accepts_events(&self) -> bool {
        false
    }

    fn copy(
        &self,
        plan: &CopyPlan,
        pool: &ShmPool,
        _producer_event: Option<u64>,
    ) -> std::result::Result<(), CopyFailure> {
        self.faults.apply()?;
        let runs = copy_runs(plan, &self.layout, pool.size())?;
        let shm = pool.as_ptr();
        for run in runs {
            let base = self.bases[run.buffer];
            // SAFETY: `copy_runs` proved `0 < block < num_blocks`, the page's
            // width equals its group's and `shm_offset + len <= pool.size()`;
            // the layout proved (when built) that every region of such a block
            // lies inside its buffer, and a run only joins regions adjacent
            // on both sides. So `base + offset .. + len` lies inside a live
            // buffer (kept alive per the constructor's contract; `run.buffer`
            // indexes `bases`, whose length equals the layout's buffer count)
            // and `shm + shm_offset .. + len` inside the mapping (kept alive
            // by `pool`). `register` proved the buffers and the mapping are
            // disjoint, so source and destination never overlap. The lease
            // gives this job exclusive use of the slots and the connector's
            // pins give it the blocks; no Rust references to either range
            // exist.
            unsafe {
                let page = base.add(run.offset as usize);
                let slot = shm.add(run.shm_offset as usize);
                let len = run.len as usize;
                match plan.direction {
                    Direction::Store => copy_bytes(slot, page, len, self.kernel),
                    Direction::Retrieve => copy_bytes(page, slot, len, self.kernel),
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transfer::layout::RegionTemplate;
    use crate::transfer::plan::PageCopy;

    fn pool_layout() -> PageLayout {
        PageLayout::pool(PoolShape {
            num_blocks: 16,
            page_bytes: 100,
        })
        .unwrap()
    }

    fn plan(pages: &[(u64, u64)]) -> CopyPlan {
        CopyPlan {
            direction: Direction::Store,
            pages: pages
                .iter()
                .map(|&(block, shm_offset)| PageCopy {
                    group: 0,
                    block,
                    shm_offset,
                    page_bytes: 100,
                })
                .collect(),
            skipped: 0,
        }
    }

    fn runs(plan: &CopyPlan, layout: &PageLayout) -> Vec<(usize, u64, u64, u64)> {
        copy_runs(plan, layout, 1 << 20)
            .unwrap()
            .iter()
            .map(|r| (r.buffer, r.offset, r.shm_offset, r.len))
            .collect()
    }

    #[test]
    fn copy_bytes_is_exact_for_every_alignment_and_length() {
        // SAFETY: forwarded from `exact_for_every_alignment_and_length`'s
        // calls (in-bounds, distinct ranges).
        exact_for_every_alignment_and_length(|d, s, n| unsafe {
            copy_bytes(d, s, n, StreamKernel::detected())
        });
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_streaming_kernel_is_exact_for_every_alignment_and_length() {
        for kernel in StreamKernel::available() {
            // SAFETY: as above (the streaming copy takes any length).
            exact_for_every_alignment_and_length(|d, s, n| unsafe { stream_copy(d, s, n, kernel) });
        }
    }

    /// Copies at many offsets and lengths (below, at and past the streaming
    /// minimum, whole and partial blocks and steps) and checks the bytes
    /// copied and that nothing around them changed.
    fn exact_for_every_alignment_and_length(copy: impl Fn(*mut u8, *const u8, usize)) {
        let src: Vec<u8> = (0..70_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for (src_off, dst_off, len) in [
            (0, 0, 0),
            (0, 0, 63),
            (1, 3, STREAM_MIN),
            (5, 0, STREAM_MIN + 65),
            (0, 9, 65_536),
            (17, 33, 69_000),
            (0, 0, 4 * 16_384),
            (3, 64, 3 * 16_384 + 4_097),
            (64, 1, 16_384 + 63),
            (2, 7, STREAM_MIN + LINEAR_STEP + 64 + 5),
            (0, 0, STREAM_MIN + LINEAR_STEP - 1),
        ] {
            let mut dst = vec![0xAAu8; 70_100];
            // Both ranges lie inside their vectors, which are distinct: the
            // callers' safety rests on this.
            copy(
                dst.as_mut_ptr().wrapping_add(dst_off),
                src.as_ptr().wrapping_add(src_off),
                len,
            );
            assert_eq!(&dst[dst_off..dst_off + len], &src[src_off..src_off + len]);
            assert!(
                dst[..dst_off].iter().all(|&b| b == 0xAA),
                "wrote before the range"
            );
            assert!(
                dst[dst_off + len..].iter().all(|&b| b == 0xAA),
                "wrote past the range"
            );
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_streaming_kernel_follows_the_cpu() {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").expect("cpuinfo");
        let vendor = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("vendor_id"))
            .map(|v| v.trim_start_matches([' ', '\t', ':']).trim())
            .expect("vendor_id");
        let avx512f = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("flags"))
            .is_some_and(|flags| flags.split_whitespace().any(|f| f == "avx512f"));
        let expected = match vendor {
            "AuthenticAMD" | "HygonGenuine" => StreamKernel::Linear,
            _ if avx512f => StreamKernel::InterleavedAvx512,
            _ => StreamKernel::Interleaved,
        };
        assert_eq!(
            StreamKernel::available().contains(&StreamKernel::InterleavedAvx512),
            avx512f,
            "the AVX-512 kernel is offered exactly where the CPU runs it"
        );
        assert_eq!(StreamKernel::detected(), expected, "vendor {vendor}");
        let mut pool = vec![0u8; 4 * 4096];
        let shape = PoolShape {
            num_blocks: 4,
            page_bytes: 4096,
        };
        // SAFETY: `pool` outlives the backend and holds `num_blocks` pages.
        let backend = unsafe { CpuBackend::new(pool.as_mut_ptr(), shape) }.expect("backend");
        assert_eq!(
            backend.copy_kernel(),
            expected.describe(),
            "the cpu backend reports the kernel it runs"
        );
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn a_backend_copies_pages_exactly_with_every_kernel() {
        const PAGE: u64 = 3 * STREAM_MIN as u64 + 192;
        let shape = PoolShape {
            num_blocks: 4,
            page_bytes: PAGE,
        };
        let pool = ShmPool::create((3 * PAGE).next_multiple_of(4096)).expect("shared memory");
        for kernel in StreamKernel::available() {
            let mut src: Vec<u8> = (0..4 * PAGE).map(|i| (i * 31 % 251) as u8).collect();
            let mut dst = vec![0u8; (4 * PAGE) as usize];
            let copy = |base: &mut Vec<u8>, direction, blocks: [u64; 3]| {
                // SAFETY: `base` outlives the backend (dropped in this call)
                // and holds `num_blocks` pages.
                let backend = unsafe { CpuBackend::new(base.as_mut_ptr(), shape) }
                    .expect("backend")
                    .with_kernel(kernel);
                assert_eq!(backend.copy_kernel(), kernel.describe());
                let plan = CopyPlan {
                    direction,
                    pages: blocks
                        .iter()
                        .enumerate()
                        .map(|(i, &block)| PageCopy {
                            group: 0,
                            block,
                            shm_offset: i as u64 * PAGE,
                            page_bytes: PAGE,
                        })
                        .collect(),
                    skipped: 0,
                };
                assert!(backend.copy(&plan, &pool, None).is_ok(), "{kernel:?}");
            };
            // Blocks 1, 2 join into one run; 3 lands after them in the
            // shared memory but is restored to block 1 of the other pool.
            copy(&mut src, Direction::Store, [1, 2, 3]);
            copy(&mut dst, Direction::Retrieve, [2, 3, 1]);
            let page =
                |v: &[u8], b: u64| v[(b * PAGE) as usize..((b + 1) * PAGE) as usize].to_vec();
            assert_eq!(page(&dst, 2), page(&src, 1), "{kernel:?}");
            assert_eq!(page(&dst, 3), page(&src, 2), "{kernel:?}");
            assert_eq!(page(&dst, 1), page(&src, 3), "{kernel:?}");
            assert!(page(&dst, 0).iter().all(|&b| b == 0), "{kernel:?}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_sse2_block_kernel_is_exact() {
        let block = INTERLEAVE * INTERLEAVE_PAGE;
        let src: Vec<u8> = (0..3 * block + 64).map(|i| (i * 13 % 251) as u8).collect();
        let mut dst = vec![0u8; 3 * block + 128];
        let at = dst.as_ptr().align_offset(64);
        // SAFETY: 3 blocks from `src` and from the aligned start of `dst`
        // lie inside both vectors; they are distinct.
        unsafe { stream_blocks_sse2(dst.as_mut_ptr().add(at), src.as_ptr(), 3) };
        assert_eq!(&dst[at..at + 3 * block], &src[..3 * block]);
        assert!(dst[..at].iter().all(|&b| b == 0));
        assert!(dst[at + 3 * block..].iter().all(|&b| b == 0));
    }

    #[test]
    fn runs_join_only_pages_adjacent_on_both_sides() {
        // rows 1,2,3 with slots 0,100,200 join; row 5 follows the slot but
        // not the row; row 6 follows row 5 but its slot does not follow.
        let l = pool_layout();
        let got = runs(&plan(&[(1, 0), (2, 100), (3, 200), (5, 300), (6, 500)]), &l);
        assert_eq!(
            got,
            vec![(0, 100, 0, 300), (0, 500, 300, 100), (0, 600, 500, 100)]
        );
        assert!(runs(&plan(&[]), &l).is_empty());
        // Descending rows never join.
        assert_eq!(runs(&plan(&[(4, 0), (3, 100)]), &l).len(), 2);
    }

    #[test]
    fn a_page_of_regions_fills_its_slot_in_template_order() {
        // K and V halves of a 2-block-stride buffer, then a state region in
        // a second buffer: one page is 3 runs into consecutive slot bytes.
        let t = |buffer, offset, block_stride, length| RegionTemplate {
            buffer,
            offset,
            block_stride,
            length,
        };
        let l = PageLayout::regions(
            &[800, 400],
            4,
            vec![(
                "g".to_string(),
                vec![t(0, 0, 200, 100), t(0, 100, 200, 100), t(1, 0, 100, 50)],
            )],
        )
        .unwrap();
        let p = CopyPlan {
            direction: Direction::Retrieve,
            pages: vec![PageCopy {
                group: 0,
                block: 2,
                shm_offset: 1000,
                page_bytes: 250,
            }],
            skipped: 0,
        };
        // K and V of one block are adjacent in the buffer and in the slot.
        assert_eq!(runs(&p, &l), vec![(0, 400, 1000, 200), (1, 200, 1200, 50)]);
    }

    #[test]
    fn plans_outside_the_layout_or_the_shared_memory_are_refused() {
        let l = pool_layout();
        let bad = |p: PageCopy| {
            let plan = CopyPlan {
                direction: Direction::Store,
                pages: vec![p],
                skipped: 0,
            };
            matches!(copy_runs(&plan, &l, 1000), Err(CopyFailure::Recoverable(_)))
        };
        let ok = PageCopy {
            group: 0,
            block: 1,
            shm_offset: 900,
            page_bytes: 100,
        };
        assert!(!bad(ok));
        assert!(bad(PageCopy { group: 1, ..ok }));
        assert!(bad(PageCopy { block: 0, ..ok }));
        assert!(bad(PageCopy { block: 16, ..ok }));
        assert!(bad(PageCopy {
            page_bytes: 50,
            ..ok
        }));
        assert!(bad(PageCopy {
            shm_offset: 901,
            ..ok
        }));
        assert!(bad(PageCopy {
            shm_offset: u64::MAX - 10,
            ..ok
        }));
    }
}
