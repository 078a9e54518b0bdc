//! The fake driver loaded the way the product loads the real one: cudarc's
//! dynamic loading finds `libcuda.so` on `LD_LIBRARY_PATH`. cudarc keeps the
//! library it loaded for the life of the process, and `LD_LIBRARY_PATH` is
//! read when a process starts, so this test (`harness = false`) runs itself
//! again as a child with a directory holding `libcuda.so` → the fake first
//! on `LD_LIBRARY_PATH`; the child runs the cases one after another (they
//! share the fake's process-wide state).
//!
//! Covered here: the fake's own semantics through cudarc's `sys` functions
//! (queued copies run only when waited for, faults, context rules, handle
//! checks) and the cuda backend's construction paths (the probe, device
//! memory checks, every construction failure a `Device`/`InvalidInput`
//! error that releases the primary context). The copy paths run end to end
//! in `tests_py/test_cuda_fake_driver.py`.

use std::collections::BTreeSet;
use std::ffi::{CString, c_char, c_int, c_uint};
use std::path::Path;
use std::process::{Command, ExitCode};

use cudarc::driver::sys::{self, CUresult};
use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::transfer::cuda::{CudaBackend, driver_available};
use lmcache_rc_core::transfer::{CopyBackend, PoolShape};

const CHILD: &str = "LMCACHE_RC_FAKE_CUDA_LIB";
const LIB: &str = "liblmcache_rc_fake_cuda.so";

fn main() -> ExitCode {
    match std::env::var_os(CHILD) {
        None => parent(),
        Some(lib) => child(Path::new(&lib)),
    }
}

/// Finds the cdylib cargo built next to this test, links it as
/// `libcuda.so` into a fresh directory and runs this binary again with
/// that directory first on `LD_LIBRARY_PATH`.
fn parent() -> ExitCode {
    let exe = std::env::current_exe().expect("the test's own path");
    let deps = exe
        .parent()
        .expect("the test lives in target/<profile>/deps");
    let lib = [deps.join(LIB), deps.join("..").join(LIB)]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{LIB} was not built next to {}", exe.display()));
    let lib = lib.canonicalize().expect("canonical library path");
    let dir = tempfile::tempdir().expect("a directory for libcuda.so");
    std::os::unix::fs::symlink(&lib, dir.path().join("libcuda.so")).expect("link libcuda.so");
    let mut path = dir.path().as_os_str().to_owned();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        path.push(":");
        path.push(old);
    }
    let status = Command::new(&exe)
        .env("LD_LIBRARY_PATH", path)
        .env(CHILD, &lib)
        .status()
        .expect("run the child");
    if status.success() {
        ExitCode::SUCCESS
    } else {
        eprintln!("the fake-driver child failed: {status}");
        ExitCode::FAILURE
    }
}

/// The fake's test controls, looked up in the library cudarc loaded (the
/// dynamic loader hands out the same instance for the same file).
struct Controls {
    _lib: libloading::Library,
    register_device: unsafe extern "C" fn(u64, u64) -> c_int,
    unregister_device: extern "C" fn(u64) -> c_int,
    fail: unsafe extern "C" fn(*const c_char, c_uint, c_uint, c_uint) -> c_int,
    calls: unsafe extern "C" fn(*const c_char) -> i64,
    stat: unsafe extern "C" fn(*const c_char) -> i64,
    pending_fill: extern "C" fn(u64, u64, u8) -> u64,
    reset: extern "C" fn(),
}

impl Controls {
    fn load(path: &Path) -> Controls {
        // SAFETY: the fake driver has no initialisers with side effects;
        // every symbol is looked up with the type it is exported with.
        unsafe {
            let lib = libloading::Library::new(path).expect("load the fake driver");
            let register_device = *lib
                .get(b"lmcache_fake_cuda_register_device")
                .expect("symbol");
            let unregister_device = *lib
                .get(b"lmcache_fake_cuda_unregister_device")
                .expect("symbol");
            let fail = *lib.get(b"lmcache_fake_cuda_fail").expect("symbol");
            let calls = *lib.get(b"lmcache_fake_cuda_calls").expect("symbol");
            let stat = *lib.get(b"lmcache_fake_cuda_stat").expect("symbol");
            let pending_fill = *lib.get(b"lmcache_fake_cuda_pending_fill").expect("symbol");
            let reset = *lib.get(b"lmcache_fake_cuda_reset").expect("symbol");
            Controls {
                _lib: lib,
                register_device,
                unregister_device,
                fail,
                calls,
                stat,
                pending_fill,
                reset,
            }
        }
    }

    /// Declares `buf` fake device memory.
    fn register(&self, buf: &mut [u8]) -> u64 {
        let at = buf.as_mut_ptr() as u64;
        // SAFETY: every buffer registered here outlives its registration
        // (the cases unregister it, or leak it, before it is freed).
        assert_eq!(unsafe { (self.register_device)(at, buf.len() as u64) }, 0);
        at
    }

    fn fail(&self, name: &str, code: CUresult, count: u32, after: u32) {
        let name = CString::new(name).expect("no NUL");
        // SAFETY: a NUL-terminated string.
        let r = unsafe { (self.fail)(name.as_ptr(), code as c_uint, count, after) };
        assert_eq!(r, 0, "fault {name:?}");
    }

    fn calls(&self, name: &str) -> i64 {
        let name = CString::new(name).expect("no NUL");
        // SAFETY: a NUL-terminated string.
        unsafe { (self.calls)(name.as_ptr()) }
    }

    fn stat(&self, name: &str) -> i64 {
        let name = CString::new(name).expect("no NUL");
        // SAFETY: a NUL-terminated string.
        unsafe { (self.stat)(name.as_ptr()) }
    }
}

/// One case: its name and body.
type Case = (&'static str, fn(&Controls));

fn child(lib: &Path) -> ExitCode {
    let fake = Controls::load(lib);
    let cases: &[Case] = &[
        (
            "the_backend_probes_every_symbol_it_calls_and_the_fake_exports_them",
            symbol_lists,
        ),
        ("the_probe_finds_every_symbol_in_the_fake", probe),
        ("copies_run_only_when_waited_for", queued_copies),
        ("driver_calls_check_contexts_handles_and_ranges", checks),
        ("backend_construction_checks_device_memory", construction),
        (
            "every_backend_construction_failure_is_an_error_that_releases_the_context",
            construction_failures,
        ),
    ];
    for (name, case) in cases {
        (fake.reset)();
        case(&fake);
        println!("test {name} ... ok");
    }
    ExitCode::SUCCESS
}

/// The cuda backend's source: every `sys::cu*` function it calls is in its
/// probed `SYMBOLS` (else cudarc panics on a driver that lacks one), and the
/// fake exports exactly that list.
fn symbol_lists(_: &Controls) {
    let source = include_str!("../../core/src/transfer/cuda.rs");
    let called: BTreeSet<&str> = source
        .match_indices("sys::cu")
        .map(|(at, _)| {
            let name = &source[at + "sys::".len()..];
            let end = name
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(name.len());
            &name[..end]
        })
        .collect();
    let start = source
        .find("const SYMBOLS: &[&str] = &[")
        .expect("cuda.rs declares SYMBOLS");
    let list = &source[start..];
    let list = &list[..list.find("];").expect("the end of SYMBOLS")];
    let probed: BTreeSet<&str> = list.split('"').skip(1).step_by(2).collect();
    assert!(called.len() >= 10, "found the calls: {called:?}");
    let unprobed: Vec<_> = called.difference(&probed).collect();
    assert!(unprobed.is_empty(), "called but not probed: {unprobed:?}");
    let exported: BTreeSet<&str> = lmcache_rc_fake_cuda::SYMBOLS.iter().copied().collect();
    assert_eq!(
        probed, exported,
        "the fake must export what the backend probes"
    );
}

fn probe(fake: &Controls) {
    driver_available().expect("the fake exports every symbol the backend uses");
    // The probe only looks symbols up; the fake saw no call yet.
    assert_eq!(fake.calls("cuInit"), 0);
    // SAFETY: the library is the fake (it answered the probe).
    assert_eq!(unsafe { sys::cuInit(0) }, CUresult::CUDA_SUCCESS);
    assert_eq!(
        fake.calls("cuInit"),
        1,
        "cudarc and this test reach one instance of the fake"
    );
    assert_eq!(fake.stat("no such stat"), -1);
    assert_eq!(fake.calls("cuNoSuchFunction"), -1);
}

/// Makes the primary context current on this thread (keeps one reference).
fn retain() -> sys::CUcontext {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the fake driver; out-pointers are live locals.
    unsafe {
        assert_eq!(sys::cuInit(0), CUresult::CUDA_SUCCESS);
        assert_eq!(
            sys::cuDevicePrimaryCtxRetain(&mut ctx, 0),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(sys::cuCtxSetCurrent(ctx), CUresult::CUDA_SUCCESS);
    }
    ctx
}

fn release() {
    // SAFETY: the fake driver; one reference taken by `retain`.
    unsafe {
        assert_eq!(
            sys::cuCtxSetCurrent(std::ptr::null_mut()),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(sys::cuDevicePrimaryCtxRelease_v2(0), CUresult::CUDA_SUCCESS);
    }
}

fn queued_copies(fake: &Controls) {
    retain();
    let mut device = vec![0u8; 4096];
    let mut host = vec![7u8; 4096];
    let dptr = fake.register(&mut device);
    // SAFETY: the fake driver; `host` outlives its registration, and no
    // copy is left queued when the buffers are freed (checked below).
    unsafe {
        let hptr = host.as_mut_ptr().cast();
        assert_eq!(
            sys::cuMemHostRegister_v2(hptr, host.len(), 0),
            CUresult::CUDA_SUCCESS
        );
        let mut stream: sys::CUstream = std::ptr::null_mut();
        let mut event: sys::CUevent = std::ptr::null_mut();
        assert_eq!(sys::cuStreamCreate(&mut stream, 1), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuEventCreate(&mut event, 0), CUresult::CUDA_SUCCESS);
        assert_eq!(
            sys::cuMemcpyHtoDAsync_v2(dptr + 100, hptr.cast_const(), 50, stream),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(fake.stat("pending_ops"), 1);
        assert!(device.iter().all(|b| *b == 0), "a queued copy already ran");
        assert_eq!(sys::cuEventRecord(event, stream), CUresult::CUDA_SUCCESS);
        // Queued after the record: not covered by the event.
        assert_eq!(
            sys::cuMemcpyHtoDAsync_v2(dptr + 1000, hptr.cast_const(), 10, stream),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(sys::cuEventSynchronize(event), CUresult::CUDA_SUCCESS);
        assert!(device[100..150].iter().all(|b| *b == 7));
        assert!(device[1000..1010].iter().all(|b| *b == 0));
        assert_eq!(fake.stat("pending_ops"), 1);
        // A failed wait leaves the copy queued ("in flight").
        fake.fail(
            "cuStreamSynchronize",
            CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
            1,
            0,
        );
        assert_eq!(
            sys::cuStreamSynchronize(stream),
            CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
        );
        assert_eq!(fake.stat("pending_ops"), 1);
        assert_eq!(sys::cuStreamSynchronize(stream), CUresult::CUDA_SUCCESS);
        assert!(device[1000..1010].iter().all(|b| *b == 7));
        // A producer's pending write runs when a stream waits for its event.
        let producer = (fake.pending_fill)(dptr, 16, 9);
        assert_ne!(producer, 0);
        assert_eq!(device[0], 0);
        assert_eq!(
            sys::cuStreamWaitEvent(
                stream,
                std::ptr::without_provenance_mut(producer as usize),
                0
            ),
            CUresult::CUDA_SUCCESS
        );
        assert!(device[..16].iter().all(|b| *b == 9));
        // Device to host, then destroying the stream completes its work.
        assert_eq!(
            sys::cuMemcpyDtoHAsync_v2(hptr, dptr, 16, stream),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(host[0], 7);
        assert_eq!(sys::cuStreamDestroy_v2(stream), CUresult::CUDA_SUCCESS);
        assert!(host[..16].iter().all(|b| *b == 9));
        assert_eq!(sys::cuEventDestroy_v2(event), CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuMemHostUnregister(hptr), CUresult::CUDA_SUCCESS);
    }
    assert_eq!((fake.unregister_device)(dptr), 0);
    for (stat, want) in [
        ("pending_ops", 0),
        ("live_streams", 0),
        ("live_events", 0),
        ("host_registrations", 0),
        ("device_ranges", 0),
        ("violations", 0),
    ] {
        assert_eq!(fake.stat(stat), want, "{stat}");
    }
    release();
}

fn checks(fake: &Controls) {
    let mut device = vec![0u8; 256];
    let mut host = vec![0u8; 256];
    let dptr = fake.register(&mut device);
    // SAFETY: the fake driver; every call below is refused before it would
    // touch memory, or registers/unregisters `host`, which outlives it.
    unsafe {
        let mut stream: sys::CUstream = std::ptr::null_mut();
        let ctx = retain();
        release();
        // No current context.
        assert_eq!(
            sys::cuStreamCreate(&mut stream, 0),
            CUresult::CUDA_ERROR_INVALID_CONTEXT
        );
        // A released context cannot be made current.
        assert_eq!(
            sys::cuCtxSetCurrent(ctx),
            CUresult::CUDA_ERROR_INVALID_CONTEXT
        );
        assert_eq!(fake.stat("ctx_refs"), 0);
        let mut dev = -1;
        assert_eq!(
            sys::cuDeviceGet(&mut dev, 1),
            CUresult::CUDA_ERROR_INVALID_DEVICE
        );
        retain();
        // Unknown handles.
        assert_eq!(
            sys::cuEventSynchronize(std::ptr::without_provenance_mut(0xdead0)),
            CUresult::CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(
            sys::cuStreamSynchronize(std::ptr::without_provenance_mut(0xdead0)),
            CUresult::CUDA_ERROR_INVALID_HANDLE
        );
        // Copies outside registered memory are refused.
        assert_eq!(sys::cuStreamCreate(&mut stream, 0), CUresult::CUDA_SUCCESS);
        let hptr = host.as_mut_ptr().cast();
        assert_eq!(
            sys::cuMemcpyDtoHAsync_v2(hptr, dptr, 16, stream),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "unregistered host memory"
        );
        assert_eq!(
            sys::cuMemHostRegister_v2(hptr, host.len(), 0),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(
            sys::cuMemHostRegister_v2(hptr, 8, 0),
            CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        );
        assert_eq!(
            sys::cuMemcpyDtoHAsync_v2(hptr, dptr + 250, 16, stream),
            CUresult::CUDA_ERROR_INVALID_VALUE,
            "past the device range"
        );
        // Pointer attributes and address ranges.
        let mut memtype: u32 = 0;
        assert_eq!(
            sys::cuPointerGetAttribute(
                (&mut memtype as *mut u32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                dptr + 10,
            ),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(memtype, sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32);
        assert_eq!(
            sys::cuPointerGetAttribute(
                (&mut memtype as *mut u32).cast(),
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                hptr as u64,
            ),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(memtype, sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32);
        let (mut base, mut size) = (0u64, 0usize);
        assert_eq!(
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, dptr + 10),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!((base, size), (dptr, 256));
        // Unregistering memory under a queued copy is a violation.
        assert_eq!(
            sys::cuMemcpyDtoHAsync_v2(hptr, dptr, 16, stream),
            CUresult::CUDA_SUCCESS
        );
        assert_eq!(sys::cuMemHostUnregister(hptr), CUresult::CUDA_SUCCESS);
        assert_eq!(fake.stat("violations"), 1);
        assert_eq!(fake.stat("pending_ops"), 0, "the unsafe copy was dropped");
        assert_eq!(sys::cuStreamDestroy_v2(stream), CUresult::CUDA_SUCCESS);
    }
    assert_eq!((fake.unregister_device)(dptr), 0);
    release();
}

const SHAPE: PoolShape = PoolShape {
    num_blocks: 16,
    page_bytes: 256,
};

fn construction(fake: &Controls) {
    let mut pool = vec![0u8; 16 * 256];
    let host = pool.as_mut_ptr();
    // Ordinary host memory: the driver knows nothing about it.
    // SAFETY: refused: the memory is not declared device memory.
    let e = unsafe { CudaBackend::new(0, host as u64, SHAPE) }
        .err()
        .expect("host memory is refused");
    assert_eq!(e.kind(), ErrorKind::Device, "{e}");
    assert!(
        e.to_string().contains("is the page pool a CUDA tensor"),
        "{e}"
    );
    assert_eq!(fake.stat("ctx_refs"), 0, "released after the refusal");
    // Page-locked host memory: known to the driver, but not device memory.
    retain();
    // SAFETY: the fake driver; `pool` outlives its registration.
    unsafe {
        assert_eq!(
            sys::cuMemHostRegister_v2(host.cast(), pool.len(), 0),
            CUresult::CUDA_SUCCESS
        );
    }
    // SAFETY: refused: registered host memory is not device memory.
    let e = unsafe { CudaBackend::new(0, host as u64, SHAPE) }
        .err()
        .expect("pinned host memory is refused");
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("not device memory"), "{e}");
    // SAFETY: registered above; the context is still current and retained.
    unsafe {
        assert_eq!(
            sys::cuMemHostUnregister(host.cast()),
            CUresult::CUDA_SUCCESS
        );
    }
    release();
    assert_eq!(fake.stat("ctx_refs"), 0, "released after the refusal");

    let dptr = fake.register(&mut pool[..8 * 256]);
    // SAFETY: refused: the declared range is half the pool.
    let e = unsafe { CudaBackend::new(0, dptr, SHAPE) }
        .err()
        .expect("a short allocation is refused");
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("does not fit its allocation"), "{e}");
    assert_eq!((fake.unregister_device)(dptr), 0);

    let dptr = fake.register(&mut pool);
    // SAFETY: device 1 does not exist: refused by cuDeviceGet.
    let e = unsafe { CudaBackend::new(1, dptr, SHAPE) }
        .err()
        .expect("there is no device 1");
    assert_eq!(e.kind(), ErrorKind::Device, "{e}");
    assert!(e.to_string().contains("cuDeviceGet"), "{e}");
    {
        // SAFETY: `pool` is declared device memory covering the shape and
        // outlives the backend (dropped at the end of this block).
        let backend = unsafe { CudaBackend::new(0, dptr, SHAPE) }.expect("a valid pool");
        assert_eq!(fake.stat("ctx_refs"), 1);
        assert_eq!(
            backend.copy_kernel(),
            "cuMemcpyAsync (DMA)",
            "status names the DMA"
        );
        drop(backend);
    }
    assert_eq!(fake.stat("ctx_refs"), 0, "the backend released its context");
    assert_eq!((fake.unregister_device)(dptr), 0);
}

fn construction_failures(fake: &Controls) {
    let mut pool = vec![0u8; 16 * 256];
    let dptr = fake.register(&mut pool);
    for symbol in [
        "cuInit",
        "cuDeviceGet",
        "cuDevicePrimaryCtxRetain",
        "cuCtxSetCurrent",
        "cuPointerGetAttribute",
        "cuMemGetAddressRange_v2",
    ] {
        fake.fail(symbol, CUresult::CUDA_ERROR_UNKNOWN, 1, 0);
        // SAFETY: `pool` is declared device memory; construction fails.
        let result = std::panic::catch_unwind(|| unsafe { CudaBackend::new(0, dptr, SHAPE) })
            .unwrap_or_else(|_| panic!("{symbol} failing made construction panic"));
        let e = result.err().unwrap_or_else(|| panic!("{symbol} failed"));
        assert_eq!(e.kind(), ErrorKind::Device, "{symbol}: {e}");
        assert!(
            e.to_string().contains("CUDA_ERROR_UNKNOWN"),
            "{symbol}: {e}"
        );
        assert_eq!(fake.stat("ctx_refs"), 0, "{symbol}: the context leaked");
    }
    // The second attribute query (device ordinal) failing.
    fake.fail("cuPointerGetAttribute", CUresult::CUDA_ERROR_UNKNOWN, 1, 1);
    // SAFETY: as above.
    let e = unsafe { CudaBackend::new(0, dptr, SHAPE) }
        .err()
        .expect("the ordinal query failed");
    assert!(e.to_string().contains("device ordinal"), "{e}");
    assert_eq!(fake.stat("ctx_refs"), 0);
    assert_eq!((fake.unregister_device)(dptr), 0);
}
