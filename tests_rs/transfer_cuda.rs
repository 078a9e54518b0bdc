//! The CUDA backend loads its driver at run time
//! (`docs/design/transfers.md#backends`): on a host
//! without the driver, probing it and constructing a backend are
//! `Error::Device` naming the library, never a panic. CI has no GPU; where a
//! driver is present the driver-specific assertions are skipped with a note.

use lmcache_rc_core::transfer::PoolShape;
use lmcache_rc_core::transfer::cuda::{CudaBackend, driver_available};
use lmcache_rc_core::{Error, ErrorKind};

const SHAPE: PoolShape = PoolShape {
    num_blocks: 16,
    page_bytes: 256,
};

#[test]
fn the_driver_probe_names_the_missing_library() {
    match driver_available() {
        Ok(()) => eprintln!("note: a CUDA driver is present; the no-driver assertion is skipped"),
        Err(e) => {
            assert!(matches!(e, Error::Device(_)), "{e:?}");
            assert_eq!(e.kind(), ErrorKind::Device);
            let msg = e.to_string();
            assert!(msg.contains("CUDA driver library"), "{msg}");
            assert!(msg.contains("libcuda.so"), "{msg}");
            // The probe is cached: asking again gives the same answer.
            assert_eq!(driver_available().unwrap_err().to_string(), msg);
        }
    }
}

#[test]
fn a_backend_without_a_driver_is_a_device_error() {
    // SAFETY: 0x1000 is never dereferenced: without a driver construction
    // stops at the probe; with one, the driver rejects it as not device memory.
    let result = std::panic::catch_unwind(|| unsafe { CudaBackend::new(0, 0x1000, SHAPE) })
        .expect("constructing a CUDA backend must not panic");
    let e = result.err().expect("0x1000 is no CUDA page pool");
    match driver_available() {
        Ok(()) => {
            eprintln!("note: a CUDA driver is present; the Device-kind assertion is skipped ({e})")
        }
        Err(probe) => {
            assert!(matches!(e, Error::Device(_)), "{e:?}");
            assert_eq!(e.to_string(), probe.to_string());
        }
    }
}

#[test]
fn a_bad_pool_shape_is_refused_before_the_driver() {
    for shape in [
        PoolShape {
            num_blocks: 1,
            page_bytes: 256,
        },
        PoolShape {
            num_blocks: 16,
            page_bytes: 0,
        },
    ] {
        // SAFETY: the shape is refused before any address is used.
        let e = unsafe { CudaBackend::new(0, 0x1000, shape) }
            .err()
            .expect("refused");
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{shape:?}: {e}");
    }
}
