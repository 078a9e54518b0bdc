//! A small job's first lease call sent from `submit`
//! (`docs/design/transfers.md#pipeline`): through a lease API that only
//! sends (the RPC client), a job of at most 16 pages that a waiting transfer
//! thread would lease at once is checked in `submit`, which sends its
//! prepare_store / begin_retrieve; the thread then waits for that reply. The
//! reply is reconciled exactly as one the thread sent itself: the sidecar
//! failing or vanishing between the two halves fails the job, a lost prepare
//! reply makes the engine unsafe, a late one is released unused, a lost
//! begin_retrieve is a miss; a job that fails its check sends nothing; an
//! engine that turned unsafe meanwhile gives the lease back unused; close
//! right after such a submit drains the job.

use std::time::Duration;

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::transfer::{Direction, Fault};

use crate::service_common::{HANG_GUARD, assert_idle, is_listed, stat, store_all};
use crate::transfer_common::*;

/// A worker whose engine sends small jobs' first lease calls from
/// `submit`, with its transfer threads started and waiting.
fn early_worker(api: &std::sync::Arc<Scripted>, rpc_timeout: Duration) -> Worker {
    api.send_early(true);
    let worker = Worker::scripted(api, rpc_timeout);
    // The engine starts a job early only while a transfer thread waits.
    std::thread::sleep(Duration::from_millis(50));
    worker
}

#[test]
fn a_small_job_sends_its_first_lease_call_from_submit_and_copies() {
    let (svc, api) = scripted_service("early-copies");
    let worker = early_worker(&api, SLOW);
    let m = tgen(1_000, 40, 1);
    begin(&svc, &m);
    let b = blocks(&m, 1);
    fill_rows(&worker.pool, &m, 0, &b);
    let h = worker.submit(job(&m, 0, Direction::Store, &b));
    assert_eq!(api.sent_by_submit("prepare_store"), 1, "{:?}", api.calls());
    assert_eq!(done(&h).kind, "copied");
    // The finish is always the transfer thread's.
    assert_eq!(api.sent_by_submit("finish_store"), 0);
    assert!(is_listed(&svc, &m));
    worker.pool.fill(0);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
    assert_eq!(api.sent_by_submit("begin_retrieve"), 1);
    check_rows(&worker.pool, &m, 0, &b);
    assert_idle(&svc);
}

#[test]
fn without_an_only_sending_lease_api_every_call_is_a_transfer_threads() {
    let (svc, api) = scripted_service("early-off");
    let worker = Worker::scripted(&api, SLOW);
    std::thread::sleep(Duration::from_millis(50));
    let m = tgen(2_000, 40, 1);
    begin(&svc, &m);
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
    assert_eq!(api.count("prepare_store"), 1);
    assert_eq!(api.sent_by_submit("prepare_store"), 0);
    assert_eq!(api.sent_by_submit("begin_retrieve"), 0);
    assert_idle(&svc);
}

#[test]
fn a_sidecar_that_fails_between_the_two_halves_fails_the_job_and_keeps_the_engine_safe() {
    let (svc, api) = scripted_service("early-unavailable");
    let worker = early_worker(&api, FAST);
    let m = tgen(3_000, 40, 1);
    begin(&svc, &m);
    // The call went out from submit; the connection is lost before the
    // reply (what the RPC client reports when the sidecar dies meanwhile).
    api.then("prepare_store", Step::Fail(ErrorKind::Unavailable), 1);
    let d = worker.store(&m, 0, 1);
    assert_eq!(d.kind, "failed", "{d:?}");
    assert_eq!(d.error, Some(ErrorKind::Unavailable));
    assert_eq!(api.sent_by_submit("prepare_store"), 1);
    assert!(
        api.store_finishes().is_empty(),
        "no lease, nothing to finish"
    );
    assert!(!worker.engine.is_unsafe());
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    assert_idle(&svc);

    // The same for a restore's begin_retrieve.
    api.then("begin_retrieve", Step::Fail(ErrorKind::Unavailable), 1);
    let d = worker.retrieve(&m, 0, 1);
    assert_eq!(d.kind, "failed", "{d:?}");
    assert_eq!(d.error, Some(ErrorKind::Unavailable));
    assert_eq!(api.count("finish_retrieve"), 0);
    assert!(!worker.engine.is_unsafe());
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
    assert_idle(&svc);
}

#[test]
fn an_early_prepare_reply_that_never_arrives_makes_the_engine_unsafe() {
    let (svc, api) = scripted_service("early-lost-prepare");
    let worker = early_worker(&api, FAST);
    let m = tgen(4_000, 40, 1);
    begin(&svc, &m);
    api.always("prepare_store", Step::NoReply);
    let shm = shm_bytes(&svc);
    worker
        .store(&m, 0, 1)
        .expect("unsafe", "lease ownership could not drain");
    assert_eq!(api.sent_by_submit("prepare_store"), 1);
    assert_unsafe_after_a_lost_prepare(&svc, &api, &worker, &shm);
}

#[test]
fn a_late_early_prepare_reply_is_released_unused() {
    let (svc, api) = scripted_service("early-late-prepare");
    let worker = early_worker(&api, FAST);
    let m = tgen(5_000, 40, 1);
    begin(&svc, &m);
    let shm = shm_bytes(&svc);
    api.then("prepare_store", Step::Late(1), 1);
    let d = worker.store(&m, 0, 1);
    d.expect("failed", "released unused");
    assert_eq!(d.error, Some(ErrorKind::Timeout));
    assert_eq!(api.sent_by_submit("prepare_store"), 1);
    assert_eq!(api.store_finishes(), vec![false], "{:?}", api.calls());
    assert!(shm_bytes(&svc) == shm, "nothing was copied");
    assert!(!is_listed(&svc, &m));
    assert_idle(&svc);
    assert!(!worker.engine.is_unsafe());
}

#[test]
fn an_early_begin_retrieve_that_never_answers_is_a_miss() {
    let (svc, api) = scripted_service("early-lost-begin");
    let worker = early_worker(&api, FAST);
    let m = tgen(6_000, 40, 1);
    store_all(&svc, &m);
    api.then("begin_retrieve", Step::NoReply, 1);
    worker.pool.fill(0x5A);
    let rows = worker.pool.snapshot();
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "miss");
    assert_eq!(api.sent_by_submit("begin_retrieve"), 1);
    assert!(worker.pool.snapshot() == rows);
    assert!(!worker.engine.is_unsafe());
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
    assert_idle(&svc);
}

#[test]
fn after_an_early_call_busy_and_pending_are_retried_by_the_transfer_thread() {
    let (svc, api) = scripted_service("early-retries");
    let worker = early_worker(&api, SLOW);
    let m = tgen(7_000, 40, 1);
    begin(&svc, &m);
    api.then("prepare_store", Step::Busy, 2);
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    assert_eq!(api.count("prepare_store"), 3);
    assert_eq!(api.sent_by_submit("prepare_store"), 1, "only the first");
    api.then("begin_retrieve", Step::AsPending, 1);
    worker.pool.fill(0);
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
    assert!(api.count("poll_retrieve") >= 1);
    assert_eq!(api.sent_by_submit("poll_retrieve"), 0);
    check_rows(&worker.pool, &m, 0, &blocks(&m, 1));
    assert_idle(&svc);
}

#[test]
fn a_job_that_fails_its_check_sends_nothing() {
    let (svc, api) = scripted_service("early-check");
    let worker = early_worker(&api, SLOW);
    let m = tgen(8_000, 40, 1);
    begin(&svc, &m);
    // One block id short: refused by the check, before any lease.
    let mut b = blocks(&m, 1);
    b[0].pop();
    let d = worker.run(job(&m, 0, Direction::Store, &b));
    assert_eq!(d.kind, "failed", "{d:?}");
    assert_eq!(d.error, Some(ErrorKind::InvalidInput));
    assert_eq!(api.count("prepare_store"), 0, "{:?}", api.calls());
    assert!(!worker.engine.is_unsafe());
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    assert_idle(&svc);
}

#[test]
fn an_engine_turned_unsafe_while_an_early_call_is_out_gives_its_lease_back() {
    let (svc, api) = scripted_service("early-unsafe");
    let worker = early_worker(&api, SLOW);
    let late = tgen(9_000, 40, 1);
    let first = tgen(9_500, 40, 1);
    begin(&svc, &late);
    begin(&svc, &first);
    // `late`'s prepare_store is granted, but its thread sees the grant
    // only after `first`'s copy made the engine unsafe.
    api.then("prepare_store", Step::Slow(Duration::from_millis(500)), 1);
    let late_rows = blocks(&late, 1);
    let h_late = worker.submit(job(&late, 0, Direction::Store, &late_rows));
    assert_eq!(api.sent_by_submit("prepare_store"), 1);
    worker.backend.faults().push(Fault::InFlight, 1);
    worker
        .store(&first, 0, 20)
        .expect("unsafe", "DMA could not drain");
    let d = done(&h_late);
    assert_eq!(d.kind, "failed", "{d:?}");
    assert_eq!(d.error, Some(ErrorKind::UnsafeCopy));
    assert!(d.reason.contains("not started"), "{d:?}");
    // Only `late`'s lease was finished (as failed); `first`'s, whose copy
    // may be in flight, never is.
    assert_eq!(api.store_finishes(), vec![false], "{:?}", api.calls());
    assert_eq!(stat(&svc, "store_leases"), 1);
    assert!(!is_listed(&svc, &late));
    assert_eq!(
        worker.engine.close(Some(HANG_GUARD)).unwrap_err().kind(),
        ErrorKind::UnsafeCopy
    );
}

#[test]
fn close_right_after_an_early_submit_drains_the_job() {
    for round in 0..20u32 {
        let (svc, api) = scripted_service(&format!("early-close-{round}"));
        let worker = early_worker(&api, SLOW);
        let m = tgen(10_000 + round * 100, 40, 1);
        begin(&svc, &m);
        let b = blocks(&m, 1);
        fill_rows(&worker.pool, &m, 0, &b);
        let h = worker.submit(job(&m, 0, Direction::Store, &b));
        worker.engine.close(Some(HANG_GUARD)).unwrap();
        assert_eq!(done(&h).kind, "copied");
        assert!(is_listed(&svc, &m));
        assert_idle(&svc);
    }
}
