//! The transfer engine moves pages byte-exact both ways
//! (`docs/design/transfers.md#jobs`, `docs/design/transfers.md#pipeline`):
//! through an in-process service and through a real RPC server, for one and
//! four ranks; every job resolves exactly once; the service is idle afterwards;
//! deduplicated store pages are skipped yet restore; admission is bounded by
//! `max_pending` and stops after close or when unsafe; invalid submissions are
//! errors, not refusals.

use std::sync::Arc;

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::rpc::Client;
use lmcache_rc_core::service::CheckpointService;
use lmcache_rc_core::transfer::{
    CpuBackend, Direction, EngineConfig, Fault, LeaseApi, PoolShape, TransferEngine,
};

use crate::rpc_common;
use crate::service_common::{HANG_GUARD, assert_idle, is_listed, rank_keys, stat};
use crate::transfer_common::*;

/// Stores `gens` generations (world 1) at once, then retrieves them at once
/// into a zeroed pool, checking every byte.
fn many_generations(worker: &Worker, begin_gen: impl Fn(&lmcache_rc_core::Manifest)) {
    let gens: Vec<_> = (0..6).map(|g| tgen(10_000 + 1_000 * g, 40, 1)).collect();
    let rows = |g: usize| 1 + g as u64 * PAGES;
    for m in &gens {
        begin_gen(m);
    }
    let handles: Vec<_> = gens
        .iter()
        .enumerate()
        .map(|(g, m)| {
            let b = blocks(m, rows(g));
            fill_rows(&worker.pool, m, 0, &b);
            worker.submit(job(m, 0, Direction::Store, &b))
        })
        .collect();
    for h in &handles {
        assert_eq!(done(h), copied());
    }
    worker.pool.fill(0);
    let handles: Vec<_> = gens
        .iter()
        .enumerate()
        .map(|(g, m)| worker.submit(job(m, 0, Direction::Retrieve, &blocks(m, rows(g)))))
        .collect();
    for h in &handles {
        assert_eq!(done(h), copied());
    }
    for (g, m) in gens.iter().enumerate() {
        check_rows(&worker.pool, m, 0, &blocks(m, rows(g)));
    }
    // Row 0 (the null page) and the rows after the last generation were
    // never written.
    assert!(worker.pool.row(0).iter().all(|b| *b == 0));
    assert!(worker.pool.row(rows(gens.len())).iter().all(|b| *b == 0));
    assert!(worker.engine.wait_idle(Some(HANG_GUARD)));
    assert_eq!(worker.engine.in_flight(), 0);
}

fn copied() -> Done {
    Done {
        kind: "copied",
        reason: String::new(),
        error: None,
    }
}

#[test]
fn many_generations_roundtrip_byte_exact_in_process() {
    let svc = service("xfer-many");
    let worker = Worker::in_process(&svc);
    many_generations(&worker, |m| begin(&svc, m));
    assert_eq!(stat(&svc, "generations"), 6);
    assert_idle(&svc);
    assert_eq!(worker.engine.stats().mappings, 1);
    assert!(!worker.engine.is_unsafe());
    worker.engine.close(Some(HANG_GUARD)).unwrap();
}

#[test]
fn many_generations_roundtrip_byte_exact_over_rpc() {
    let rig = rpc_common::rig("xfer-many-rpc");
    let ctl = rpc_common::client(&rig.socket);
    let worker = Worker::start(
        Box::new(rpc_common::client(&rig.socket)),
        SHAPE,
        engine_config(SLOW),
    )
    .unwrap();
    assert_eq!(
        worker.engine.capabilities(),
        Some(ctl.capabilities().unwrap())
    );
    many_generations(&worker, |m| assert!(ctl.begin(m).unwrap()));
    rpc_common::assert_idle(&ctl);
    assert_idle(rig.server.service());
    worker.engine.close(Some(HANG_GUARD)).unwrap();
}

/// Four ranks, four engines, one thread each: every rank stores then
/// restores `n` generations of world size 4.
fn world_of_four(
    make_api: impl Fn() -> Box<dyn LeaseApi>,
    begin_gen: impl Fn(&lmcache_rc_core::Manifest),
) {
    let gens: Vec<_> = (0..4).map(|g| tgen(50_000 + 1_000 * g, 40, 4)).collect();
    for m in &gens {
        begin_gen(m);
    }
    let workers: Vec<Worker> = (0..4)
        .map(|_| Worker::start(make_api(), SHAPE, engine_config(SLOW)).unwrap())
        .collect();
    let rows = |g: usize| 1 + g as u64 * PAGES;
    std::thread::scope(|s| {
        for (rank, w) in workers.iter().enumerate() {
            let gens = &gens;
            s.spawn(move || {
                for (g, m) in gens.iter().enumerate() {
                    assert_eq!(w.store(m, rank as u32, rows(g)), copied(), "rank {rank}");
                }
            });
        }
    });
    std::thread::scope(|s| {
        for (rank, w) in workers.iter().enumerate() {
            let gens = &gens;
            s.spawn(move || {
                w.pool.fill(0);
                for (g, m) in gens.iter().enumerate() {
                    assert_eq!(w.retrieve(m, rank as u32, rows(g)), copied(), "rank {rank}");
                    check_rows(&w.pool, m, rank as u32, &blocks(m, rows(g)));
                }
            });
        }
    });
    // Ranks hold different pages: rank 0's rows are not rank 1's.
    assert_ne!(
        workers[0].pool.row(rows(0)),
        workers[1].pool.row(rows(0)),
        "each rank restored its own pages"
    );
    for w in &workers {
        assert_eq!(w.engine.in_flight(), 0);
        w.engine.close(Some(HANG_GUARD)).unwrap();
    }
}

#[test]
fn world_size_four_with_four_engines_in_process() {
    let svc = service("xfer-w4");
    let api_svc = svc.clone();
    world_of_four(
        || Box::new(api_svc.clone()) as Box<dyn LeaseApi>,
        |m| begin(&svc, m),
    );
    assert_eq!(stat(&svc, "generations"), 4);
    assert_idle(&svc);
}

#[test]
fn world_size_four_with_four_engines_over_rpc() {
    let rig = rpc_common::rig("xfer-w4-rpc");
    let ctl = rpc_common::client(&rig.socket);
    let socket = rig.socket.clone();
    world_of_four(
        || Box::new(rpc_common::client(&socket)) as Box<dyn LeaseApi>,
        |m| assert!(ctl.begin(m).unwrap()),
    );
    rpc_common::assert_idle(&ctl);
    assert_idle(rig.server.service());
}

#[test]
fn every_job_resolves_exactly_once() {
    let svc = service("xfer-once");
    let worker = Worker::in_process(&svc);
    let gens: Vec<_> = (0..5).map(|g| tgen(70_000 + 1_000 * g, 40, 1)).collect();
    let mut handles = Vec::new();
    for (g, m) in gens.iter().enumerate() {
        begin(&svc, m);
        let b = blocks(m, 1 + g as u64 * PAGES);
        fill_rows(&worker.pool, m, 0, &b);
        handles.push(worker.submit(job(m, 0, Direction::Store, &b)));
    }
    // A job that misses (never begun) resolves once too.
    let unbegun = tgen(79_000, 40, 1);
    let miss = worker.submit(job(&unbegun, 0, Direction::Store, &blocks(&unbegun, 40)));
    let outcomes: Vec<Done> = handles.iter().map(done).collect();
    assert!(outcomes.iter().all(|o| o.kind == "copied"), "{outcomes:?}");
    assert_eq!(done(&miss).kind, "miss");
    assert!(worker.engine.wait_idle(Some(HANG_GUARD)));
    // The outcome is fixed: asking again, or through a clone, gives the same.
    for (h, o) in handles.iter().zip(&outcomes) {
        assert!(h.is_done());
        assert_eq!(&done(h), o);
        assert_eq!(&done(&h.clone()), o);
    }
    // Each generation was published once: one listed generation each, and
    // the service counted one store per job.
    for m in &gens {
        assert!(is_listed(&svc, m));
    }
    assert_eq!(stat(&svc, "generations"), 5);
    assert_eq!(worker.engine.in_flight(), 0);
    assert_idle(&svc);
}

#[test]
fn deduplicated_store_pages_are_skipped_and_still_restore() {
    let (svc, api) = scripted_service("xfer-dedup");
    let worker = Worker::scripted(&api, SLOW);
    let first = tgen(90_000, 40, 1);
    let longer = tgen(90_000, 48, 1);
    // The first two attention pages end at tokens 16 and 32: the same keys.
    let (k1, k2) = (rank_keys(&first, 0), rank_keys(&longer, 0));
    assert_eq!(k1[0][..2], k2[0][..2]);
    assert_ne!(k1[0][2], k2[0][2]);
    begin(&svc, &first);
    assert_eq!(worker.store(&first, 0, 1), copied());

    // Record how many slots the sidecar left empty for the longer generation.
    let skipped = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen = skipped.clone();
    api.then(
        "prepare_store",
        Step::edit(move |l| {
            seen.lock()
                .push(l.slots.iter().flatten().filter(|s| s.is_none()).count())
        }),
        1,
    );
    begin(&svc, &longer);
    let b = blocks(&longer, 20);
    fill_rows(&worker.pool, &longer, 0, &b);
    // Rows of the deduplicated pages hold garbage: had the engine copied
    // them anywhere, the restore below would not be byte-exact.
    worker.pool.write_row(b[0][0], &[0xEE; PAGE as usize]);
    worker.pool.write_row(b[0][1], &[0xEE; PAGE as usize]);
    assert_eq!(worker.run(job(&longer, 0, Direction::Store, &b)), copied());
    assert_eq!(*skipped.lock(), vec![2]);
    assert_eq!(api.store_finishes(), vec![true, true]);
    assert!(is_listed(&svc, &longer));

    worker.pool.fill(0);
    assert_eq!(worker.retrieve(&longer, 0, 20), copied());
    check_rows(&worker.pool, &longer, 0, &b);
    assert_eq!(worker.retrieve(&first, 0, 1), copied());
    check_rows(&worker.pool, &first, 0, &blocks(&first, 1));
    assert_idle(&svc);
}

#[test]
fn admission_is_bounded_by_max_pending() {
    let svc = service("xfer-admit");
    let config = EngineConfig {
        workers: 1,
        max_pending: 2,
        ..engine_config(SLOW)
    };
    let worker = Worker::start(Box::new(svc.clone()), SHAPE, config).unwrap();
    let gens: Vec<_> = (0..3).map(|g| tgen(110_000 + 1_000 * g, 40, 1)).collect();
    for m in &gens {
        begin(&svc, m);
    }
    // The first copy is held, so two jobs stay admitted.
    worker
        .backend
        .faults()
        .push(Fault::Delay(std::time::Duration::from_millis(500)), 1);
    let a = worker.submit(job(&gens[0], 0, Direction::Store, &blocks(&gens[0], 1)));
    let b = worker.submit(job(&gens[1], 0, Direction::Store, &blocks(&gens[1], 10)));
    let third = job(&gens[2], 0, Direction::Store, &blocks(&gens[2], 20));
    assert!(
        worker.engine.submit(third.clone()).unwrap().is_none(),
        "full"
    );
    assert_eq!(worker.engine.in_flight(), 2);
    assert_eq!(done(&a).kind, "copied");
    assert_eq!(done(&b).kind, "copied");
    assert!(worker.engine.wait_idle(Some(HANG_GUARD)));
    // Room again: the refused job was never started and can be resubmitted.
    assert_eq!(worker.run(third), copied());
    assert_eq!(stat(&svc, "generations"), 3);
    assert_idle(&svc);
}

#[test]
fn submit_after_close_is_refused() {
    let svc = service("xfer-closed");
    let worker = Worker::in_process(&svc);
    let m = tgen(120_000, 40, 1);
    begin(&svc, &m);
    worker.engine.close(Some(HANG_GUARD)).unwrap();
    let refused = worker
        .engine
        .submit(job(&m, 0, Direction::Store, &blocks(&m, 1)))
        .unwrap();
    assert!(refused.is_none());
    assert_eq!(worker.engine.in_flight(), 0);
    // Nothing was started: no lease was taken.
    assert_eq!(stat(&svc, "store_leases"), 0);
    // Closing again is harmless.
    worker.engine.close(Some(HANG_GUARD)).unwrap();
}

#[test]
fn submit_when_unsafe_is_refused() {
    let (svc, api) = scripted_service("xfer-unsafe-admit");
    let worker = Worker::scripted(&api, SLOW);
    let m = tgen(130_000, 40, 1);
    begin(&svc, &m);
    worker.backend.faults().push(Fault::InFlight, 1);
    assert_eq!(worker.store(&m, 0, 1).kind, "unsafe");
    assert!(worker.engine.is_unsafe());
    let calls = api.calls().len();
    let other = tgen(131_000, 40, 1);
    begin(&svc, &other);
    for direction in [Direction::Store, Direction::Retrieve] {
        let refused = worker
            .engine
            .submit(job(&other, 0, direction, &blocks(&other, 10)))
            .unwrap();
        assert!(refused.is_none(), "{direction:?}");
    }
    assert_eq!(api.calls().len(), calls, "no lease call after unsafe");
    assert!(worker.engine.stats().is_unsafe);
}

#[test]
fn a_rank_outside_the_world_is_invalid_input() {
    let svc = service("xfer-rank");
    let worker = Worker::in_process(&svc);
    let m = tgen(140_000, 40, 4);
    begin(&svc, &m);
    for rank in [4, 5, u32::MAX] {
        for direction in [Direction::Store, Direction::Retrieve] {
            let e = worker
                .engine
                .submit(job(&m, rank, direction, &blocks(&m, 1)))
                .err()
                .expect("an invalid rank is an error");
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
            assert!(e.to_string().contains("rank"), "{e}");
        }
    }
    assert_eq!(worker.engine.in_flight(), 0);
    // Rank 3 is valid.
    assert_eq!(worker.store(&m, 3, 1).kind, "copied");
}

#[test]
fn a_producer_event_on_the_cpu_backend_is_invalid_input() {
    let svc = service("xfer-event");
    let worker = Worker::in_process(&svc);
    assert_eq!(worker.engine.backend_name(), "cpu");
    let m = tgen(150_000, 40, 1);
    begin(&svc, &m);
    let mut j = job(&m, 0, Direction::Store, &blocks(&m, 1));
    j.producer_event = Some(0xdead_beef);
    let e = worker.engine.submit(j).err().expect("an error");
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(e.to_string().contains("cpu"), "{e}");
    assert_eq!(worker.engine.in_flight(), 0);
    assert_eq!(stat(&svc, "store_leases"), 0);
}

/// Every job records its phases (no timing thresholds: only their structure).
#[test]
fn jobs_record_their_phases() {
    let svc = service("xfer-phases");
    let worker = Worker::in_process(&svc);
    let m = tgen(170_000, 40, 1);
    begin(&svc, &m);
    let b = blocks(&m, 1);
    fill_rows(&worker.pool, &m, 0, &b);
    let store = worker.submit(job(&m, 0, Direction::Store, &b));
    assert_eq!(done(&store), copied());
    let restore = worker.submit(job(&m, 0, Direction::Retrieve, &b));
    assert_eq!(done(&restore), copied());
    for h in [&store, &restore] {
        let p = h.phases();
        let parts = [
            p.queued, p.check, p.map, p.lease, p.plan, p.handoff, p.copy, p.finish,
        ];
        // The phases are consecutive laps of one clock that started at
        // submit; the total is read when the job ends, after all of them.
        assert!(
            parts.iter().sum::<std::time::Duration>() <= p.total,
            "{p:?}"
        );
        assert!(!p.total.is_zero(), "{p:?}");
    }
    // A job refused before its lease reaches no copy.
    let never = tgen(171_000, 40, 1);
    let h = worker.submit(job(&never, 0, Direction::Store, &blocks(&never, 1)));
    assert_eq!(done(&h).kind, "miss");
    let p = h.phases();
    assert!(
        p.copy.is_zero() && p.finish.is_zero() && p.handoff.is_zero(),
        "{p:?}"
    );
    worker.engine.close(Some(HANG_GUARD)).unwrap();
    assert_idle(&svc);
}

#[test]
fn a_miss_copies_nothing() {
    let svc = service("xfer-miss");
    let worker = Worker::in_process(&svc);
    let m = tgen(160_000, 40, 1);
    // Never begun: prepare_store misses; never listed: begin_retrieve misses.
    let b = blocks(&m, 1);
    fill_rows(&worker.pool, &m, 0, &b);
    let before = shm_bytes(&svc);
    assert_eq!(worker.run(job(&m, 0, Direction::Store, &b)).kind, "miss");
    assert_eq!(shm_bytes(&svc), before);
    worker.pool.fill(0x5A);
    let snapshot = worker.pool.snapshot();
    let r = worker.run(job(&m, 0, Direction::Retrieve, &b));
    assert_eq!(r.kind, "miss");
    assert!(r.reason.contains("not_listed"), "{r:?}");
    assert!(worker.pool.snapshot() == snapshot, "a miss wrote rows");
    assert!(!worker.engine.is_unsafe());
    assert_idle(&svc);
}

#[test]
fn engine_and_backend_settings_are_checked() {
    let svc: Arc<CheckpointService> = service("xfer-config");
    let pool = HostPool::new(SHAPE);
    // SAFETY: `pool` outlives every backend and engine of this test (all are
    // dropped, and every engine start fails, before the pool).
    let backend = Arc::new(unsafe { CpuBackend::new(pool.base(), SHAPE) }.unwrap());
    for (config, needle) in [
        (
            EngineConfig {
                workers: 0,
                ..engine_config(SLOW)
            },
            "workers",
        ),
        (
            EngineConfig {
                workers: 4,
                max_pending: 3,
                ..engine_config(SLOW)
            },
            "max_pending",
        ),
        (engine_config(std::time::Duration::ZERO), "rpc_timeout"),
    ] {
        let e = TransferEngine::start(Box::new(svc.clone()), backend.clone(), config)
            .err()
            .expect("refused");
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
        assert!(e.to_string().contains(needle), "{e}");
    }
    // SAFETY: null is refused before it is stored.
    let e = unsafe { CpuBackend::new(std::ptr::null_mut(), SHAPE) }
        .err()
        .expect("null refused");
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    for shape in [
        PoolShape {
            num_blocks: 1,
            page_bytes: PAGE,
        },
        PoolShape {
            num_blocks: 8,
            page_bytes: 0,
        },
        PoolShape {
            num_blocks: u64::MAX,
            page_bytes: 2,
        },
    ] {
        // SAFETY: an invalid shape is refused before the address is used.
        let e = unsafe { CpuBackend::new(pool.base(), shape) }
            .err()
            .expect("shape refused");
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{shape:?}: {e}");
    }
    drop(backend);
}

#[test]
fn an_rpc_worker_restores_what_an_in_process_store_wrote() {
    // The same server seen two ways: a store through its in-process service,
    // a restore through the socket.
    let rig = rpc_common::rig("xfer-mixed");
    let svc = rig.server.service().clone();
    let storer = Worker::in_process(&svc);
    let m = tgen(170_000, 40, 1);
    begin(&svc, &m);
    assert_eq!(storer.store(&m, 0, 1), copied());
    let client: Client = rpc_common::client(&rig.socket);
    let reader = Worker::start(Box::new(client), SHAPE, engine_config(SLOW)).unwrap();
    assert_eq!(reader.retrieve(&m, 0, 30), copied());
    check_rows(&reader.pool, &m, 0, &blocks(&m, 30));
    assert_idle(&svc);
}

#[test]
fn a_finished_job_frees_its_admission_slot_before_it_resolves() {
    let svc = service("xfer-slot");
    let config = EngineConfig {
        workers: 1,
        max_pending: 1,
        ..engine_config(SLOW)
    };
    let worker = Worker::start(Box::new(svc.clone()), SHAPE, config).unwrap();
    let m = tgen(180_000, 40, 1);
    begin(&svc, &m);
    assert_eq!(worker.store(&m, 0, 1), copied());
    let mut refused = 0;
    for _ in 0..100 {
        let h = worker.submit(job(&m, 0, Direction::Retrieve, &blocks(&m, 1)));
        assert_eq!(done(&h), copied());
        // The only admitted job has ended: the next one must be admitted.
        match worker
            .engine
            .submit(job(&m, 0, Direction::Retrieve, &blocks(&m, 1)))
            .unwrap()
        {
            Some(next) => assert_eq!(done(&next), copied()),
            None => refused += 1,
        }
        assert!(worker.engine.wait_idle(Some(HANG_GUARD)));
    }
    assert_eq!(
        refused, 0,
        "submits refused right after the previous job ended"
    );
    assert_idle(&svc);
}

#[test]
fn a_fully_deduplicated_store_copies_nothing_and_commits() {
    // Two generations of the same tokens that differ only in `kind`: every
    // page key is shared, so the second store's lease lends no slot at all.
    let (svc, api) = scripted_service("xfer-dedup-all");
    let worker = Worker::scripted(&api, SLOW);
    let groups = [crate::service_common::GroupSpec::new(
        "engine-kv-group:0",
        PAGE,
        vec![0, 1, 2],
        crate::service_common::Role::Attention(16),
    )];
    let tokens = crate::service_common::seq(190_000, 40);
    let a = manifest_with(&tokens, 1, &groups, Some(layout(PAGE)), "prompt");
    let b = manifest_with(&tokens, 1, &groups, Some(layout(PAGE)), "decode");
    assert_ne!(a.generation(), b.generation());
    assert_eq!(rank_keys(&a, 0), rank_keys(&b, 0));
    begin(&svc, &a);
    assert_eq!(worker.store(&a, 0, 1), copied());
    let lent = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen = lent.clone();
    api.then(
        "prepare_store",
        Step::edit(move |l| seen.lock().push(l.slots.clone())),
        1,
    );
    begin(&svc, &b);
    // Garbage rows: nothing may be copied from them.
    worker.pool.fill(0xEE);
    let rows = blocks(&b, 10);
    assert_eq!(worker.run(job(&b, 0, Direction::Store, &rows)), copied());
    assert_eq!(*lent.lock(), vec![vec![vec![None, None, None]]]);
    assert!(is_listed(&svc, &b));
    worker.pool.fill(0);
    assert_eq!(worker.retrieve(&b, 0, 10), copied());
    check_rows(&worker.pool, &b, 0, &rows);
    assert_idle(&svc);
}
