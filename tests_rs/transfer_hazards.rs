//! Hazards the transfer engine avoids: a mapping's CUDA registration is
//! released while the mapping and its backend still live (no use after
//! unmap), a backend refuses a plan outside its pools (no stray copy), a late
//! pending poll whose cancel fails is never fatal, and `capabilities()` never
//! waits for a remap in progress.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use lmcache_rc_core::service::{Capabilities, CheckpointService, Lease};
use lmcache_rc_core::store::shm::ShmPool;
use lmcache_rc_core::transfer::{
    CopyBackend, CopyFailure, CopyPlan, CpuBackend, Direction, LeaseAnswer, LeaseApi, LeaseCall,
    PageCopy, PageLayout, PoolShape, Registration, ReplyHandle, TransferEngine, plan,
};
use lmcache_rc_core::{Error, Manifest, Result};

use crate::service_common::{object_bytes, rank_keys, store_all};
use crate::transfer_common::*;

// ---------------------------------------------------------------------------
// Helpers

/// Whether `addr` lies inside a mapping of this process (/proc/self/maps).
fn is_mapped(addr: usize) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().any(|line| {
        let range = line.split_whitespace().next().unwrap();
        let (a, b) = range.split_once('-').unwrap();
        let a = usize::from_str_radix(a, 16).unwrap();
        let b = usize::from_str_radix(b, 16).unwrap();
        a <= addr && addr < b
    })
}

/// A registration that records, when dropped, whether the mapping it was
/// made for is still mapped (what `cuMemHostUnregister` needs).
struct Probe {
    ptr: usize,
    seen: Arc<Mutex<Vec<bool>>>,
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.seen.lock().push(is_mapped(self.ptr));
    }
}

/// A cpu backend whose `register` hands out [`Probe`]s, like the cuda
/// backend hands out host registrations.
struct Registering {
    cpu: Arc<CpuBackend>,
    seen: Arc<Mutex<Vec<bool>>>,
}

/// A registration that records, when dropped, whether its backend (whose
/// context it needs, like `HostRegistration` needs the CUDA context that the
/// backend retains) is still alive.
struct NeedsBackend {
    alive: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<bool>>>,
}

impl Drop for NeedsBackend {
    fn drop(&mut self) {
        self.seen.lock().push(self.alive.load(Ordering::SeqCst));
    }
}

/// A cpu backend that says when it was dropped.
struct Contextual {
    cpu: Arc<CpuBackend>,
    alive: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<bool>>>,
}

impl Drop for Contextual {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::SeqCst);
    }
}

impl CopyBackend for Contextual {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn layout(&self) -> &PageLayout {
        self.cpu.layout()
    }
    fn register(&self, _pool: &ShmPool) -> Result<Option<Registration>> {
        Ok(Some(Box::new(NeedsBackend {
            alive: self.alive.clone(),
            seen: self.seen.clone(),
        })))
    }
    fn accepts_events(&self) -> bool {
        false
    }
    fn copy(
        &self,
        plan: &CopyPlan,
        pool: &ShmPool,
        event: Option<u64>,
    ) -> std::result::Result<(), CopyFailure> {
        self.cpu.copy(plan, pool, event)
    }
}

impl CopyBackend for Registering {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn layout(&self) -> &PageLayout {
        self.cpu.layout()
    }
    fn register(&self, pool: &ShmPool) -> Result<Option<Registration>> {
        Ok(Some(Box::new(Probe {
            ptr: pool.as_ptr() as usize,
            seen: self.seen.clone(),
        })))
    }
    fn accepts_events(&self) -> bool {
        false
    }
    fn copy(
        &self,
        plan: &CopyPlan,
        pool: &ShmPool,
        event: Option<u64>,
    ) -> std::result::Result<(), CopyFailure> {
        self.cpu.copy(plan, pool, event)
    }
}

/// A reply that times out `delays` times, then gives `answer`.
struct After {
    answer: Result<LeaseAnswer>,
    delays: AtomicU32,
}

impl ReplyHandle for After {
    fn wait(&self, timeout: Duration) -> Result<LeaseAnswer> {
        if self
            .delays
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| d.checked_sub(1))
            .is_ok()
        {
            std::thread::sleep(timeout);
            return Err(Error::Timeout("review: no reply yet".into()));
        }
        match &self.answer {
            Ok(a) => Ok(a.clone()),
            Err(e) => Err(error_of(e.kind(), &e.to_string())),
        }
    }
}

fn after(answer: Result<LeaseAnswer>, delays: u32) -> Box<dyn ReplyHandle> {
    Box::new(After {
        answer,
        delays: AtomicU32::new(delays),
    })
}

fn pending(id: &str) -> LeaseAnswer {
    LeaseAnswer::Lease(Lease::pending(id.to_string()))
}

/// A retrieve whose lookup stays pending: begin answers pending at once,
/// poll answers pending only after one timed-out wait, cancel fails.
struct LatePendingPoll {
    svc: Arc<CheckpointService>,
}

impl LeaseApi for LatePendingPoll {
    fn share_pool(&self) -> Result<(Capabilities, OwnedFd)> {
        LeaseApi::share_pool(&self.svc)
    }
    fn pool_id(&self) -> Result<String> {
        LeaseApi::pool_id(&self.svc)
    }
    fn call(&self, call: LeaseCall) -> Box<dyn ReplyHandle> {
        match call {
            LeaseCall::BeginRetrieve { .. } => after(Ok(pending("lookup")), 0),
            LeaseCall::PollRetrieve { lease_id, .. } => after(Ok(pending(&lease_id)), 1),
            LeaseCall::CancelRetrieve { .. } => after(
                Err(Error::Unavailable("review: the cancel was lost".into())),
                0,
            ),
            other => self.svc.call(other),
        }
    }
}

/// Forwards to a service; handing out the pool is slow while `slow` is set.
struct SlowCaps {
    svc: Arc<CheckpointService>,
    slow: AtomicBool,
}

impl LeaseApi for SlowCaps {
    fn share_pool(&self) -> Result<(Capabilities, OwnedFd)> {
        if self.slow.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_secs(2));
        }
        LeaseApi::share_pool(&self.svc)
    }
    fn pool_id(&self) -> Result<String> {
        LeaseApi::pool_id(&self.svc)
    }
    fn call(&self, call: LeaseCall) -> Box<dyn ReplyHandle> {
        self.svc.call(call)
    }
}

// ---------------------------------------------------------------------------
// Findings

#[test]
fn a_mapping_registration_is_released_while_the_mapping_is_still_mapped() {
    let svc = service("rev-reg-order");
    let pool = HostPool::new(SHAPE);
    // SAFETY: the pool outlives the engine (dropped at the end of the test,
    // after the engine, which is dropped explicitly below).
    let cpu = Arc::new(unsafe { CpuBackend::new(pool.base(), SHAPE) }.unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let backend = Arc::new(Registering {
        cpu,
        seen: seen.clone(),
    });
    let engine =
        TransferEngine::start(Box::new(svc.clone()), backend, engine_config(SLOW)).unwrap();
    // Forgetting the mapping drops it (nothing else holds it).
    engine.drop_mapping();
    drop(engine);
    assert_eq!(
        *seen.lock(),
        vec![true],
        "the registration was dropped after its mapping was unmapped"
    );
}

#[test]
fn a_late_pending_poll_whose_cancel_fails_is_never_fatal() {
    let svc = service("rev-late-pending");
    let m = tgen(31_000, 40, 1);
    store_all(&svc, &m);
    let api = LatePendingPoll { svc: svc.clone() };
    let worker = Worker::start(Box::new(api), SHAPE, engine_config(FAST)).unwrap();
    let d = worker.retrieve(&m, 0, 1);
    assert_ne!(d.kind, "unsafe", "{d:?}");
    assert!(
        !worker.engine.is_unsafe(),
        "a pending lookup exposed no bytes, yet the engine turned unsafe: {:?}",
        worker.engine.unsafe_reason()
    );
}

#[test]
fn capabilities_does_not_wait_for_a_remap_in_progress() {
    let svc = service("rev-caps-lock");
    let api = Arc::new(SlowCaps {
        svc: svc.clone(),
        slow: AtomicBool::new(false),
    });
    let worker = Worker::start(Box::new(api.clone()), SHAPE, engine_config(SLOW)).unwrap();
    let m = tgen(32_000, 40, 1);
    begin(&svc, &m);
    api.slow.store(true, Ordering::SeqCst);
    worker.engine.drop_mapping();
    let h = worker.submit(job(&m, 0, Direction::Store, &blocks(&m, 1)));
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    let _ = worker.engine.capabilities();
    let took = t.elapsed();
    api.slow.store(false, Ordering::SeqCst);
    done(&h);
    assert!(
        took < Duration::from_millis(500),
        "capabilities() waited {took:?} for a remap's RPC"
    );
}

#[test]
fn a_mapping_registration_is_released_while_its_backend_lives() {
    let svc = service("rev-reg-backend");
    let pool = HostPool::new(SHAPE);
    // SAFETY: the pool outlives the engine (dropped explicitly below).
    let cpu = Arc::new(unsafe { CpuBackend::new(pool.base(), SHAPE) }.unwrap());
    let alive = Arc::new(AtomicBool::new(true));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let backend = Arc::new(Contextual {
        cpu,
        alive,
        seen: seen.clone(),
    });
    let engine =
        TransferEngine::start(Box::new(svc.clone()), backend, engine_config(SLOW)).unwrap();
    drop(engine);
    assert_eq!(
        *seen.lock(),
        vec![true],
        "the registration was dropped after the backend it belongs to"
    );
}

#[test]
fn a_backend_refuses_a_plan_outside_its_page_pool() {
    let svc = service("rev-plan-bounds");
    // The allocation is twice the shape the backend is bound to, so the
    // out-of-shape write below stays inside memory the test owns.
    let big = PoolShape {
        num_blocks: SHAPE.num_blocks * 2,
        page_bytes: PAGE,
    };
    let pool = HostPool::new(big);
    // SAFETY: `pool` holds at least `SHAPE` rows and outlives the backend.
    let backend = unsafe { CpuBackend::new(pool.base(), SHAPE) }.unwrap();
    svc.pool().write_at(0, &[0xEE; PAGE as usize]).unwrap();
    let row = SHAPE.num_blocks + 3; // outside the backend's rows
    let plan = CopyPlan {
        direction: Direction::Retrieve,
        pages: vec![PageCopy {
            group: 0,
            block: row,
            shm_offset: 0,
            page_bytes: PAGE,
        }],
        skipped: 0,
    };
    let result = backend.copy(&plan, svc.pool(), None);
    assert!(
        pool.row(row).iter().all(|&b| b == 0),
        "row {row}, outside the backend's {} rows, was written",
        SHAPE.num_blocks
    );
    assert!(result.is_err(), "an out-of-bounds plan was accepted");
}

/// A stored generation of tokens from `base`, and a worker over a scripted
/// service whose retrieves stay pending (their begin_retrieve, ready at once
/// for pages in L1, is shown as pending) until `api.reset()`: retrieves
/// submitted meanwhile are unfinished.
fn retrieves_held_pending(
    tag: &str,
    base: u32,
) -> (Arc<CheckpointService>, Arc<Scripted>, Manifest, Worker) {
    let (svc, api) = scripted_service(tag);
    let m = tgen(base, 40, 1);
    store_all(&svc, &m);
    api.always("begin_retrieve", Step::AsPending);
    api.always("poll_retrieve", Step::Pending);
    let worker = Worker::scripted(&api, Duration::from_secs(2));
    (svc, api, m, worker)
}

/// Issue 12, item 9: two unfinished jobs of one engine never copy into the
/// same page-pool rows. A retrieve may not write rows another job reads or
/// writes, a store may not read rows a retrieve writes; disjoint rows are
/// fine, and the rows are free again once the job ended.
#[test]
fn an_engine_refuses_a_job_whose_rows_an_unfinished_job_writes() {
    let (_svc, api, m, worker) = retrieves_held_pending("rev-row-clash", 33_000);
    let rows = blocks(&m, 1);
    let first = worker.submit(job(&m, 0, Direction::Retrieve, &rows));

    let e = worker
        .engine
        .submit(job(&m, 0, Direction::Retrieve, &rows))
        .err()
        .expect("a second retrieve into the same rows is refused");
    assert_eq!(e.kind(), lmcache_rc_core::ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("being written"), "{e}");
    let e = worker
        .engine
        .submit(job(&m, 0, Direction::Store, &rows))
        .err()
        .expect("a store reading rows a retrieve writes is refused");
    assert!(e.to_string().contains("being written"), "{e}");
    // Rows of no unfinished job are fine.
    let other = worker.submit(job(&m, 0, Direction::Retrieve, &blocks(&m, 32)));

    api.reset();
    let _ = done(&first);
    let _ = done(&other);
    // Ended: the rows are free again.
    let again = worker.run(job(&m, 0, Direction::Retrieve, &rows));
    assert_eq!(again.kind, "copied", "{again:?}");
    check_rows(&worker.pool, &m, 0, &rows);
}

/// Concurrent restores of one engine that share pages the worker already
/// holds (vLLM's local prefix hit: a shared system prompt) all name block 0
/// for them. Block 0 is "already in place, not copied": no job writes it, so
/// it never clashes, while the blocks each one copies still claim their rows.
#[test]
fn concurrent_retrieves_that_skip_the_same_local_pages_are_both_admitted() {
    let (_svc, api, m, worker) = retrieves_held_pending("rev-skip-clash", 33_100);
    let with_skip = |first: u64| {
        let mut rows = blocks(&m, first);
        rows[0][0] = plan::SKIP; // the local hit's page: in place on this worker
        rows
    };
    let a_rows = with_skip(1);
    let b_rows = with_skip(32);
    let a = worker.submit(job(&m, 0, Direction::Retrieve, &a_rows));
    let b = worker.submit(job(&m, 0, Direction::Retrieve, &b_rows));
    // The rows they copy still claim: a third restore into b's rows is refused.
    let e = worker
        .engine
        .submit(job(&m, 0, Direction::Retrieve, &b_rows))
        .err()
        .expect("a retrieve into rows another one writes is refused");
    assert!(e.to_string().contains("being written"), "{e}");
    assert!(
        !e.to_string().contains("block 0 "),
        "block 0 was claimed: {e}"
    );

    api.reset();
    assert_eq!(done(&a).kind, "copied");
    assert_eq!(done(&b).kind, "copied");
    // Both wrote every page they did not skip.
    for rows in [&a_rows, &b_rows] {
        for (g, (keys, ids)) in rank_keys(&m, 0).iter().zip(rows.iter()).enumerate() {
            for (key, &id) in keys.iter().zip(ids) {
                if id != plan::SKIP {
                    assert!(
                        worker.pool.row(id) == object_bytes(key, PAGE),
                        "group {g} row {id}: bytes differ"
                    );
                }
            }
        }
    }
}
