//! Lease replies and copies that go wrong
//! (`docs/design/transfers.md#outcomes-and-failure-classes`,
//! `docs/design/transfers.md#rpc-timeout-reconciliation`): busy retries are
//! bounded; a pending restore is cancelled once; a copy that may still be in
//! flight, an unreconciled finish and an unreconciled lease reply make the
//! engine unsafe (lease kept, admission stopped, close fails); a late lease
//! reply is released unused (a drained timeout, recoverable); ordinary errors
//! fail the job and leave the engine usable.

use std::io::Write;
use std::time::Duration;

use lmcache_rc_core::transfer::{Direction, Fault, JobHandle, LeaseCall};
use lmcache_rc_core::{ErrorKind, Manifest};

use crate::service_common::{HANG_GUARD, assert_idle, is_listed, stat, store_all};
use crate::transfer_common::*;

// ---------------------------------------------------------------------------
// Busy and pending

#[test]
fn a_store_busy_n_times_then_ready_copies() {
    let (svc, api) = scripted_service("flt-busy-n");
    let worker = Worker::scripted(&api, SLOW);
    let m = tgen(1_000, 40, 1);
    begin(&svc, &m);
    api.then("prepare_store", Step::Busy, 3);
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    assert_eq!(api.count("prepare_store"), 4);
    assert_eq!(api.store_finishes(), vec![true]);
    assert!(is_listed(&svc, &m));
    worker.pool.fill(0);
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
    check_rows(&worker.pool, &m, 0, &blocks(&m, 1));
    assert_idle(&svc);
}

#[test]
fn a_store_busy_forever_misses_after_the_rpc_timeout() {
    let (svc, api) = scripted_service("flt-busy-forever");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(2_000, 40, 1);
    begin(&svc, &m);
    api.always("prepare_store", Step::Busy);
    worker.store(&m, 0, 1).expect("miss", "busy");
    assert!(api.count("prepare_store") >= 2, "{:?}", api.calls());
    assert!(api.store_finishes().is_empty());
    assert!(!worker.engine.is_unsafe());
    assert_eq!(stat(&svc, "store_leases"), 0);
    assert_idle(&svc);
}

#[test]
fn close_ends_busy_retries() {
    let (svc, api) = scripted_service("flt-busy-close");
    let worker = Worker::scripted(&api, SLOW);
    let m = tgen(3_000, 40, 1);
    begin(&svc, &m);
    api.always("prepare_store", Step::Busy);
    let b = blocks(&m, 1);
    let h = worker.submit(job(&m, 0, Direction::Store, &b));
    eventually("the store retries busy", || api.count("prepare_store") >= 2);
    worker.engine.close(Some(HANG_GUARD)).unwrap();
    done(&h).expect("miss", "busy");
    assert!(api.store_finishes().is_empty());
}

/// A transfer thread asleep while `close` began wakes up to end when the
/// last queued job is taken by another one. Two copy slots (four threads):
/// two stores lease slowly, a third waits in the queue and two threads
/// sleep; `close` starts; the first lease to end wakes one sleeper, which
/// takes the queued store, and nothing else ever woke the other: close
/// drained every job, then waited for ever to join it (an in-process vLLM
/// engine hung on its way out this way).
#[test]
fn close_joins_a_thread_that_slept_while_the_last_queued_job_was_taken() {
    let (svc, api) = scripted_service("flt-close-sleeper");
    let worker = Worker::scripted(&api, SLOW);
    let ms: Vec<Manifest> = (0..3).map(|i| tgen(6_000 + 100 * i, 40, 1)).collect();
    for m in &ms {
        begin(&svc, m);
    }
    api.then("prepare_store", Step::Slow(Duration::from_millis(300)), 1);
    api.then("prepare_store", Step::Slow(Duration::from_millis(1_500)), 1);
    let handles: Vec<JobHandle> = ms
        .iter()
        .zip([1, 1 + PAGES, 1 + 2 * PAGES])
        .map(|(m, first)| {
            let b = blocks(m, first);
            fill_rows(&worker.pool, m, 0, &b);
            worker.submit(job(m, 0, Direction::Store, &b))
        })
        .collect();
    eventually("two stores lease", || api.count("prepare_store") >= 2);
    // Both leases are slow: `close` begins while the third store is queued.
    std::thread::sleep(Duration::from_millis(100));
    let engine = &worker.engine;
    let closed = std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        s.spawn(move || {
            let _ = tx.send(engine.close(Some(HANG_GUARD)));
        });
        let got = rx.recv_timeout(HANG_GUARD + Duration::from_secs(10));
        if got.is_err() {
            // The scope would join the hung close for ever: fail the binary.
            let _ = writeln!(
                std::io::stderr(),
                "close did not return: a transfer thread was never woken to end"
            );
            std::process::exit(101);
        }
        got.unwrap()
    });
    closed.unwrap();
    for h in &handles {
        assert_eq!(done(h).kind, "copied");
    }
    assert_eq!(api.store_finishes(), vec![true; 3]);
    assert!(ms.iter().all(|m| is_listed(&svc, m)));
}

#[test]
fn a_retrieve_pending_forever_misses_and_is_cancelled_once() {
    let (svc, api) = scripted_service("flt-pending");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(4_000, 40, 1);
    store_all(&svc, &m);
    // The sidecar answers pending (as while pages load from L2): the engine polls.
    api.always("begin_retrieve", Step::AsPending);
    api.always("poll_retrieve", Step::Pending);
    worker.pool.fill(0x5A);
    let rows = worker.pool.snapshot();
    worker.retrieve(&m, 0, 1).expect("miss", "recomputes");
    assert_eq!(api.count("begin_retrieve"), 1);
    assert!(api.count("poll_retrieve") >= 1);
    assert_eq!(api.count("cancel_retrieve"), 1, "{:?}", api.calls());
    assert_eq!(api.count("finish_retrieve"), 0);
    // The service released the lookup's pages: nothing held, still listed.
    assert_eq!(stat(&svc, "retrieve_leases"), 0);
    assert_idle(&svc);
    assert!(is_listed(&svc, &m));
    assert!(worker.pool.snapshot() == rows);
    assert!(!worker.engine.is_unsafe());
    // Once the sidecar answers again, the restore works.
    api.reset();
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
    check_rows(&worker.pool, &m, 0, &blocks(&m, 1));
}

#[test]
fn close_cancels_a_pending_retrieve() {
    let (svc, api) = scripted_service("flt-pending-close");
    let worker = Worker::scripted(&api, SLOW);
    let m = tgen(5_000, 40, 1);
    store_all(&svc, &m);
    // The sidecar answers pending (as while pages load from L2): the engine polls.
    api.always("begin_retrieve", Step::AsPending);
    api.always("poll_retrieve", Step::Pending);
    let h = worker.submit(job(&m, 0, Direction::Retrieve, &blocks(&m, 1)));
    eventually("the retrieve polls", || api.count("poll_retrieve") >= 1);
    worker.engine.close(Some(HANG_GUARD)).unwrap();
    assert_eq!(done(&h).kind, "miss");
    assert_eq!(api.count("cancel_retrieve"), 1);
    assert_idle(&svc);
}

// ---------------------------------------------------------------------------
// Backend faults

#[test]
fn a_copy_that_may_be_in_flight_makes_the_engine_unsafe() {
    let (svc, api) = scripted_service("flt-inflight");
    let worker = Worker::scripted(&api, SLOW);
    let m = tgen(6_000, 40, 1);
    begin(&svc, &m);
    worker.backend.faults().push(Fault::InFlight, 1);
    worker
        .store(&m, 0, 1)
        .expect("unsafe", "DMA could not drain");
    assert!(worker.engine.is_unsafe());
    assert!(worker.engine.stats().is_unsafe);
    assert!(
        worker
            .engine
            .unsafe_reason()
            .is_some_and(|r| r.contains("DMA could not drain"))
    );
    // The lease is never finished: the sidecar still holds it.
    assert!(api.store_finishes().is_empty(), "{:?}", api.calls());
    assert_eq!(stat(&svc, "store_leases"), 1);
    assert!(!is_listed(&svc, &m));
    // Admission stopped for good; close fails.
    let other = tgen(6_500, 40, 1);
    let refused = worker
        .engine
        .submit(job(&other, 0, Direction::Store, &blocks(&other, 10)))
        .unwrap();
    assert!(refused.is_none());
    let e = worker.engine.close(Some(HANG_GUARD)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnsafeCopy, "{e}");
    assert!(e.to_string().contains("unsafe"), "{e}");
    // Closing again still fails: the state never clears.
    assert_eq!(
        worker.engine.close(Some(HANG_GUARD)).unwrap_err().kind(),
        ErrorKind::UnsafeCopy
    );
}

#[test]
fn a_retrieve_copy_that_may_be_in_flight_keeps_its_read_lease() {
    let (svc, api) = scripted_service("flt-inflight-r");
    let worker = Worker::scripted(&api, SLOW);
    let m = tgen(7_000, 40, 1);
    store_all(&svc, &m);
    worker.backend.faults().push(Fault::InFlight, 1);
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "unsafe");
    assert_eq!(api.count("finish_retrieve"), 0);
    assert_eq!(api.count("cancel_retrieve"), 0);
    assert_eq!(stat(&svc, "retrieve_leases"), 1);
    assert!(worker.engine.is_unsafe());
    assert_eq!(
        worker.engine.close(Some(HANG_GUARD)).unwrap_err().kind(),
        ErrorKind::UnsafeCopy
    );
}

#[test]
fn a_failed_copy_finishes_the_store_lease_as_failed() {
    let (svc, api) = scripted_service("flt-fail");
    let worker = Worker::scripted(&api, SLOW);
    let m = tgen(8_000, 40, 1);
    begin(&svc, &m);
    worker.backend.faults().push(Fault::Fail, 1);
    let d = worker.store(&m, 0, 1);
    d.expect("failed", "injected");
    assert_eq!(d.error, Some(ErrorKind::Device));
    assert_eq!(api.store_finishes(), vec![false]);
    assert!(!is_listed(&svc, &m));
    assert_idle(&svc);
    assert!(!worker.engine.is_unsafe());
    // Recoverable: the generation, staged again, stores.
    begin(&svc, &m);
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    assert_eq!(api.store_finishes(), vec![false, true]);
    worker.engine.close(Some(HANG_GUARD)).unwrap();
}

#[test]
fn a_failed_retrieve_copy_releases_the_lease_once() {
    let (svc, api) = scripted_service("flt-fail-r");
    let worker = Worker::scripted(&api, SLOW);
    let m = tgen(9_000, 40, 1);
    store_all(&svc, &m);
    worker.backend.faults().push(Fault::Fail, 1);
    let d = worker.retrieve(&m, 0, 1);
    assert_eq!(d.kind, "failed");
    assert_eq!(d.error, Some(ErrorKind::Device));
    assert_eq!(api.count("finish_retrieve"), 1);
    assert_idle(&svc);
    assert!(is_listed(&svc, &m));
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
    check_rows(&worker.pool, &m, 0, &blocks(&m, 1));
}

#[test]
fn close_with_a_held_copy_fails_for_a_short_timeout() {
    let (svc, api) = scripted_service("flt-close-delay");
    let worker = Worker::scripted(&api, SLOW);
    let m = tgen(10_000, 40, 1);
    begin(&svc, &m);
    worker
        .backend
        .faults()
        .push(Fault::Delay(Duration::from_millis(1_500)), 1);
    let b = blocks(&m, 1);
    fill_rows(&worker.pool, &m, 0, &b);
    let h = worker.submit(job(&m, 0, Direction::Store, &b));
    eventually("the copy holds", || api.count("prepare_store") == 1);
    let e = worker
        .engine
        .close(Some(Duration::from_millis(20)))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::UnsafeCopy, "{e}");
    assert!(e.to_string().contains("did not drain"), "{e}");
    // The copy still completes and its lease is finished; admission stays closed.
    assert_eq!(done(&h).kind, "copied");
    assert!(
        worker
            .engine
            .submit(job(&m, 0, Direction::Retrieve, &b))
            .unwrap()
            .is_none()
    );
    worker.engine.close(Some(HANG_GUARD)).unwrap();
    assert_eq!(api.store_finishes(), vec![true]);
    assert!(is_listed(&svc, &m));
    assert_idle(&svc);
}

// ---------------------------------------------------------------------------
// Lease replies: late, lost, failing

#[test]
fn a_late_prepare_reply_is_released_unused() {
    let (svc, api) = scripted_service("flt-late-prepare");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(11_000, 40, 1);
    begin(&svc, &m);
    let b = blocks(&m, 1);
    fill_rows(&worker.pool, &m, 0, &b);
    let shm = shm_bytes(&svc);
    api.then("prepare_store", Step::Late(1), 1);
    let d = worker.run(job(&m, 0, Direction::Store, &b));
    d.expect("failed", "released unused");
    assert_eq!(d.error, Some(ErrorKind::Timeout));
    assert_eq!(api.count("prepare_store"), 1);
    assert_eq!(api.store_finishes(), vec![false], "{:?}", api.calls());
    assert!(shm_bytes(&svc) == shm, "nothing was copied");
    assert!(!is_listed(&svc, &m));
    assert_idle(&svc);
    assert!(!worker.engine.is_unsafe());
    worker.engine.close(Some(HANG_GUARD)).unwrap();
}

#[test]
fn a_late_poll_reply_is_released_unused() {
    let (svc, api) = scripted_service("flt-late-poll");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(12_000, 40, 1);
    store_all(&svc, &m);
    // The sidecar answers pending (as while pages load from L2): the engine polls.
    api.always("begin_retrieve", Step::AsPending);
    worker.pool.fill(0x5A);
    let rows = worker.pool.snapshot();
    api.then("poll_retrieve", Step::Late(1), 1);
    let d = worker.retrieve(&m, 0, 1);
    assert_eq!(d.kind, "failed", "{d:?}");
    assert_eq!(d.error, Some(ErrorKind::Timeout));
    // The late lease (ready: the pages were resident) was released once.
    assert_eq!(api.count("finish_retrieve"), 1, "{:?}", api.calls());
    assert!(worker.pool.snapshot() == rows);
    assert_eq!(stat(&svc, "retrieve_leases"), 0);
    assert_idle(&svc);
    assert!(is_listed(&svc, &m));
    assert!(!worker.engine.is_unsafe());
}

#[test]
fn a_late_finish_reply_is_used() {
    let (svc, api) = scripted_service("flt-late-finish");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(13_000, 40, 1);
    begin(&svc, &m);
    api.then("finish_store", Step::Late(1), 1);
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    assert_eq!(api.store_finishes(), vec![true], "never a second finish");
    assert!(is_listed(&svc, &m));
    assert_idle(&svc);
    assert!(!worker.engine.is_unsafe());
}

#[test]
fn a_finish_reply_that_never_arrives_makes_the_engine_unsafe() {
    let (svc, api) = scripted_service("flt-lost-finish");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(14_000, 40, 1);
    begin(&svc, &m);
    api.always("finish_store", Step::NoReply);
    worker
        .store(&m, 0, 1)
        .expect("unsafe", "completion ownership could not drain");
    assert_eq!(api.store_finishes(), vec![true], "exactly one finish sent");
    assert!(worker.engine.is_unsafe());
    let other = tgen(14_500, 40, 1);
    assert!(
        worker
            .engine
            .submit(job(&other, 0, Direction::Store, &blocks(&other, 10)))
            .unwrap()
            .is_none()
    );
    assert_eq!(
        worker.engine.close(Some(HANG_GUARD)).unwrap_err().kind(),
        ErrorKind::UnsafeCopy
    );
}

#[test]
fn a_retrieve_finish_reply_that_never_arrives_makes_the_engine_unsafe() {
    let (svc, api) = scripted_service("flt-lost-finish-r");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(15_000, 40, 1);
    store_all(&svc, &m);
    api.always("finish_retrieve", Step::NoReply);
    worker
        .retrieve(&m, 0, 1)
        .expect("unsafe", "completion ownership could not drain");
    assert_eq!(api.count("finish_retrieve"), 1);
    assert!(worker.engine.is_unsafe());
}

#[test]
fn a_prepare_reply_that_never_arrives_makes_the_engine_unsafe() {
    let (svc, api) = scripted_service("flt-lost-prepare");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(16_000, 40, 1);
    begin(&svc, &m);
    api.always("prepare_store", Step::NoReply);
    let b = blocks(&m, 1);
    fill_rows(&worker.pool, &m, 0, &b);
    let shm = shm_bytes(&svc);
    worker
        .run(job(&m, 0, Direction::Store, &b))
        .expect("unsafe", "lease ownership could not drain");
    assert_unsafe_after_a_lost_prepare(&svc, &api, &worker, &shm);
}

#[test]
fn a_poll_reply_that_never_arrives_makes_the_engine_unsafe() {
    let (svc, api) = scripted_service("flt-lost-poll");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(17_000, 40, 1);
    store_all(&svc, &m);
    // The sidecar answers pending (as while pages load from L2): the engine polls.
    api.always("begin_retrieve", Step::AsPending);
    api.always("poll_retrieve", Step::NoReply);
    worker
        .retrieve(&m, 0, 1)
        .expect("unsafe", "lease ownership could not drain");
    assert_eq!(api.count("poll_retrieve"), 1);
    assert_eq!(api.count("finish_retrieve"), 0);
    assert!(worker.engine.is_unsafe());
}

#[test]
fn a_begin_retrieve_reply_that_never_arrives_is_a_miss() {
    // A pending lookup exposes no bytes: losing it is never fatal
    // (docs/design/transfers.md#rpc-timeout-reconciliation, the begin_retrieve row).
    let (svc, api) = scripted_service("flt-lost-begin");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(18_000, 40, 1);
    store_all(&svc, &m);
    api.then("begin_retrieve", Step::NoReply, 1);
    worker.pool.fill(0x5A);
    let rows = worker.pool.snapshot();
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "miss");
    assert!(worker.pool.snapshot() == rows);
    assert!(!worker.engine.is_unsafe());
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
    assert_idle(&svc);
}

#[test]
fn an_unavailable_prepare_fails_the_job_and_keeps_the_engine_safe() {
    let (svc, api) = scripted_service("flt-unavailable");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(19_000, 40, 1);
    begin(&svc, &m);
    api.then("prepare_store", Step::Fail(ErrorKind::Unavailable), 1);
    let d = worker.store(&m, 0, 1);
    assert_eq!(d.kind, "failed");
    assert_eq!(d.error, Some(ErrorKind::Unavailable));
    assert!(
        api.store_finishes().is_empty(),
        "no lease, nothing to finish"
    );
    assert!(!worker.engine.is_unsafe());
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    assert_idle(&svc);
}

#[test]
fn an_error_while_polling_cancels_the_lookup() {
    let (svc, api) = scripted_service("flt-poll-error");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(20_000, 40, 1);
    store_all(&svc, &m);
    // The sidecar answers pending (as while pages load from L2): the engine polls.
    api.always("begin_retrieve", Step::AsPending);
    api.then("poll_retrieve", Step::Fail(ErrorKind::Unavailable), 1);
    let d = worker.retrieve(&m, 0, 1);
    assert_eq!(d.kind, "failed");
    assert_eq!(d.error, Some(ErrorKind::Unavailable));
    assert_eq!(api.count("cancel_retrieve"), 1);
    assert_eq!(api.count("finish_retrieve"), 0);
    assert_eq!(stat(&svc, "retrieve_leases"), 0);
    assert!(!worker.engine.is_unsafe());
    assert_idle(&svc);
}

#[test]
fn a_finish_error_fails_the_job_without_a_second_finish() {
    let (svc, api) = scripted_service("flt-finish-error");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(21_000, 40, 1);
    begin(&svc, &m);
    api.then("finish_store", Step::Fail(ErrorKind::Unavailable), 1);
    let d = worker.store(&m, 0, 1);
    assert_eq!(d.kind, "failed", "{d:?}");
    assert_eq!(api.store_finishes(), vec![true], "never a second finish");
    assert!(!worker.engine.is_unsafe());
    // The (scripted) error kept the request from the sidecar: it still holds
    // the lease, which only its owner may finish.
    assert_eq!(stat(&svc, "store_leases"), 1);
}

#[test]
fn a_finish_that_errors_after_timing_out_makes_the_engine_unsafe() {
    let (svc, api) = scripted_service("flt-finish-late-error");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(22_000, 40, 1);
    begin(&svc, &m);
    api.then("finish_store", Step::LateFail(1, ErrorKind::Unavailable), 1);
    worker
        .store(&m, 0, 1)
        .expect("unsafe", "completion ownership");
    assert_eq!(api.store_finishes(), vec![true]);
    assert!(worker.engine.is_unsafe());
}

#[test]
fn lease_calls_follow_the_protocol_order() {
    // One clean store and one clean retrieve, as the sidecar sees them.
    let (svc, api) = scripted_service("flt-order");
    let worker = Worker::scripted(&api, SLOW);
    let m = tgen(23_000, 40, 1);
    begin(&svc, &m);
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
    let names: Vec<&str> = api.calls().iter().map(LeaseCall::name).collect();
    // Every page is in L1: begin_retrieve answers ready at once, no poll.
    assert_eq!(
        names,
        [
            "prepare_store",
            "finish_store",
            "begin_retrieve",
            "finish_retrieve"
        ]
    );
    assert_idle(&svc);
    // A restore the sidecar answers pending is polled until ready.
    api.always("begin_retrieve", Step::AsPending);
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
    let names: Vec<&str> = api.calls().iter().map(LeaseCall::name).collect();
    assert_eq!(names[4], "begin_retrieve");
    assert!(
        names[5..names.len() - 1]
            .iter()
            .all(|n| *n == "poll_retrieve")
    );
    assert!(names.len() > 6, "{names:?}");
    assert_eq!(names.last(), Some(&"finish_retrieve"));
    assert_idle(&svc);
}

#[test]
fn a_late_poll_reply_is_released_exactly_once() {
    let (svc, api) = scripted_service("flt-late-poll-once");
    let worker = Worker::scripted(&api, FAST);
    let m = tgen(24_000, 40, 1);
    store_all(&svc, &m);
    // The sidecar answers pending (as while pages load from L2): the engine polls.
    api.always("begin_retrieve", Step::AsPending);
    api.then("poll_retrieve", Step::Late(1), 1);
    let d = worker.retrieve(&m, 0, 1);
    assert_eq!(d.error, Some(ErrorKind::Timeout), "{d:?}");
    let names: Vec<&str> = api.calls().iter().map(LeaseCall::name).collect();
    assert_eq!(
        names,
        ["begin_retrieve", "poll_retrieve", "finish_retrieve"],
        "one release per lease"
    );
    assert_idle(&svc);
}
