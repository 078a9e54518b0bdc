//! Nothing moves unless the whole transfer is valid
//! (`docs/design/transfers.md#1-check-before-any-lease`,
//! `docs/design/transfers.md#4-validate-the-lease-planplan_copy`).
//!
//! A malformed lease (foreign pool, wrong width, out of bounds, overlapping
//! slots, wrong group or slot counts, a retrieve slot without bytes) is
//! refused before any byte is copied: the page pool and the shared memory
//! are untouched, the job fails, and its lease is finished as failed exactly
//! once. A job that does not fit its manifest or the bound pool (block 0,
//! out-of-range or duplicate block ids, group/position count mismatches, page
//! width, worker layout) is refused before any lease is requested.

use std::sync::Arc;

use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::service::{CheckpointService, Lease, LeaseStatus};
use lmcache_rc_core::store::shm::ShmPool;
use lmcache_rc_core::transfer::{Direction, EngineConfig, PageLayout, plan};
use lmcache_rc_core::{ErrorKind, Manifest};

use crate::service_common::{HANG_GUARD, assert_idle, is_listed, store_all};
use crate::transfer_common::*;

// ---------------------------------------------------------------------------
// Malformed store leases

/// Runs one store whose ready lease is edited by `edit`; asserts that it
/// failed with `needle`, copied nothing, finished the lease as failed once,
/// and left the service idle and the engine usable.
fn refused_store(tag: &str, needle: &str, edit: impl Fn(&mut Lease, u64) + Send + Sync + 'static) {
    let (svc, api) = scripted_service(tag);
    let worker = Worker::scripted(&api, SLOW);
    let pool_size = svc.pool().size();
    let m = tgen(1_000, 40, 1);
    begin(&svc, &m);
    let b = blocks(&m, 1);
    fill_rows(&worker.pool, &m, 0, &b);
    let rows = worker.pool.snapshot();
    let shm = shm_bytes(&svc);
    api.then("prepare_store", Step::edit(move |l| edit(l, pool_size)), 1);
    let d = worker.run(job(&m, 0, Direction::Store, &b));
    d.expect("failed", needle);
    assert_eq!(d.error, Some(ErrorKind::InvalidInput), "{d:?}");
    assert!(worker.pool.snapshot() == rows, "the page pool changed");
    assert!(shm_bytes(&svc) == shm, "the shared memory changed");
    assert_eq!(api.store_finishes(), vec![false], "{:?}", api.calls());
    assert_eq!(api.count("prepare_store"), 1);
    assert!(!is_listed(&svc, &m));
    assert_idle(&svc);
    // The engine stays usable: the generation, staged again, stores.
    assert!(!worker.engine.is_unsafe());
    begin(&svc, &m);
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    assert!(is_listed(&svc, &m));
    assert_idle(&svc);
}

fn first_slot(l: &Lease) -> (u64, u64) {
    l.slots[0][0].expect("a fresh store page has a slot")
}

#[test]
fn a_slot_narrower_than_the_page_is_refused() {
    refused_store("val-narrow", "width or bounds", |l, _| {
        let (o, n) = first_slot(l);
        l.slots[0][0] = Some((o, n / 2));
    });
}

#[test]
fn a_slot_wider_than_the_page_is_refused() {
    refused_store("val-wide", "width or bounds", |l, _| {
        let (o, n) = first_slot(l);
        l.slots[0][0] = Some((o, n * 2));
    });
}

#[test]
fn an_empty_slot_is_refused() {
    refused_store("val-empty", "width or bounds", |l, _| {
        let (o, _) = first_slot(l);
        l.slots[1][0] = Some((o, 0));
    });
}

#[test]
fn a_slot_past_the_pool_end_is_refused() {
    refused_store("val-bounds", "width or bounds", |l, pool| {
        l.slots[2][0] = Some((pool - PAGE / 2, PAGE));
    });
}

#[test]
fn a_slot_whose_end_overflows_is_refused() {
    refused_store("val-overflow", "width or bounds", |l, _| {
        l.slots[0][2] = Some((u64::MAX - 8, PAGE));
    });
}

#[test]
fn partially_overlapping_slots_are_refused() {
    refused_store("val-overlap", "must not overlap", |l, _| {
        let (o, n) = first_slot(l);
        l.slots[0][1] = Some((o + n / 2, n));
    });
}

#[test]
fn two_slots_at_one_offset_are_refused() {
    refused_store("val-same", "must not overlap", |l, _| {
        let s = l.slots[0][0];
        l.slots[2][0] = s;
    });
}

#[test]
fn a_missing_slot_group_is_refused() {
    refused_store("val-groups-less", "slot groups", |l, _| {
        l.slots.pop();
    });
}

#[test]
fn an_extra_slot_group_is_refused() {
    refused_store("val-groups-more", "slot groups", |l, _| {
        let extra = l.slots[2].clone();
        l.slots.push(extra);
    });
}

#[test]
fn a_missing_slot_is_refused() {
    refused_store("val-slots-less", "slots for page group", |l, _| {
        l.slots[0].pop();
    });
}

#[test]
fn an_extra_slot_is_refused() {
    refused_store("val-slots-more", "slots for page group", |l, pool| {
        l.slots[1].push(Some((pool - PAGE, PAGE)));
    });
}

// ---------------------------------------------------------------------------
// Malformed retrieve leases

/// Runs one retrieve whose ready lease is edited by `edit`; asserts that it
/// failed with `needle`, wrote no row, released the lease exactly once, kept
/// the generation listed and left the service idle.
fn refused_retrieve(
    tag: &str,
    needle: &str,
    edit: impl Fn(&mut Lease, u64) + Send + Sync + 'static,
) {
    let (svc, api) = scripted_service(tag);
    let worker = Worker::scripted(&api, SLOW);
    let pool_size = svc.pool().size();
    let m = tgen(2_000, 40, 1);
    store_all(&svc, &m);
    let b = blocks(&m, 1);
    worker.pool.fill(0x5A);
    let rows = worker.pool.snapshot();
    let shm = shm_bytes(&svc);
    // The ready lease comes from begin_retrieve (every page in L1) or a poll.
    let edit = Arc::new(move |l: &mut Lease| edit(l, pool_size));
    let again = edit.clone();
    api.always("begin_retrieve", Step::edit(move |l| edit(l)));
    api.always("poll_retrieve", Step::edit(move |l| again(l)));
    let d = worker.run(job(&m, 0, Direction::Retrieve, &b));
    d.expect("failed", needle);
    assert_eq!(d.error, Some(ErrorKind::InvalidInput), "{d:?}");
    assert!(worker.pool.snapshot() == rows, "the page pool changed");
    assert!(shm_bytes(&svc) == shm, "the shared memory changed");
    assert_eq!(api.count("finish_retrieve"), 1, "{:?}", api.calls());
    assert_eq!(api.count("cancel_retrieve"), 0, "{:?}", api.calls());
    assert!(api.store_finishes().is_empty());
    assert!(
        is_listed(&svc, &m),
        "a refused lease does not retire the generation"
    );
    assert_idle(&svc);
    // Without the edit the same retrieve copies.
    api.reset();
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
    check_rows(&worker.pool, &m, 0, &b);
    assert_idle(&svc);
}

#[test]
fn a_retrieve_slot_without_bytes_is_refused() {
    refused_retrieve("val-r-none", "without bytes", |l, _| {
        l.slots[1][0] = None;
    });
}

#[test]
fn a_retrieve_slot_of_the_wrong_width_is_refused() {
    refused_retrieve("val-r-width", "width or bounds", |l, _| {
        let (o, n) = l.slots[0][1].unwrap();
        l.slots[0][1] = Some((o, n - 1));
    });
}

#[test]
fn a_retrieve_slot_out_of_bounds_is_refused() {
    refused_retrieve("val-r-bounds", "width or bounds", |l, pool| {
        l.slots[0][0] = Some((pool, PAGE));
    });
}

#[test]
fn overlapping_retrieve_slots_are_refused() {
    refused_retrieve("val-r-overlap", "must not overlap", |l, _| {
        let (o, n) = l.slots[0][0].unwrap();
        l.slots[2][0] = Some((o + 1, n));
    });
}

#[test]
fn a_retrieve_lease_with_a_wrong_group_count_is_refused() {
    refused_retrieve("val-r-groups", "slot groups", |l, _| {
        l.slots.truncate(1);
    });
}

#[test]
fn a_retrieve_lease_with_a_wrong_slot_count_is_refused() {
    refused_retrieve("val-r-slots", "slots for page group", |l, _| {
        l.slots[0].truncate(2);
    });
}

// ---------------------------------------------------------------------------
// The pool the capabilities name

#[test]
fn a_lease_is_checked_against_the_pool_the_capabilities_name() {
    let svc = service("val-plan");
    let m = tgen(3_000, 40, 1);
    begin(&svc, &m);
    let lease = svc.prepare_store(&m, 0).unwrap();
    assert_eq!(lease.status, LeaseStatus::Ready);
    let caps = svc.capabilities();
    let pool =
        ShmPool::from_fd(svc.pool().share().unwrap(), &caps.pool_id, caps.pool_size).unwrap();
    let schema = m.payload_schema().unwrap();
    let b = blocks(&m, 1);
    let layout = PageLayout::pool(SHAPE).unwrap();
    let groups = plan::check_job(Direction::Store, &schema, &b, &layout).unwrap();
    let plan_with = |caps: &lmcache_rc_core::service::Capabilities| {
        plan::plan_copy(Direction::Store, &schema, &b, &groups, &lease, caps, &pool)
    };
    let ok = plan_with(&caps).unwrap();
    assert_eq!(ok.pages.len(), PAGES as usize);
    assert_eq!(ok.skipped, 0);
    assert_eq!(ok.bytes(), PAGES * PAGE);
    // A foreign id or size is refused.
    for foreign in [
        lmcache_rc_core::service::Capabilities {
            pool_id: "0".repeat(32),
            ..caps.clone()
        },
        lmcache_rc_core::service::Capabilities {
            pool_size: caps.pool_size + 4096,
            ..caps.clone()
        },
    ] {
        let e = plan_with(&foreign).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
        assert!(
            e.to_string().contains("does not identify this SHM pool"),
            "{e}"
        );
    }
    let v2 = lmcache_rc_core::service::Capabilities {
        format_version: 2,
        ..caps.clone()
    };
    assert_eq!(
        plan_with(&v2).unwrap_err().kind(),
        ErrorKind::UnsupportedFormat
    );
    // A lease whose slots are in another pool (or names none) is refused.
    for pool_id in [Some("f".repeat(32)), None] {
        let other = lmcache_rc_core::service::Lease {
            pool_id,
            ..lease.clone()
        };
        let e = plan::plan_copy(Direction::Store, &schema, &b, &groups, &other, &caps, &pool)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
        assert!(
            e.to_string().contains("does not identify this SHM pool"),
            "{e}"
        );
    }
    svc.finish_store(lease.lease_id.as_deref().unwrap(), false, None)
        .unwrap();
    assert_idle(&svc);
}

#[test]
fn an_engine_refuses_to_start_on_a_pool_the_capabilities_misdescribe() {
    let (svc, api) = scripted_service("val-caps-start");
    let caps = svc.capabilities();
    let cases = [
        (
            lmcache_rc_core::service::Capabilities {
                pool_size: caps.pool_size * 2,
                ..caps.clone()
            },
            ErrorKind::InvalidInput,
        ),
        (
            lmcache_rc_core::service::Capabilities {
                pool_id: String::new(),
                ..caps.clone()
            },
            ErrorKind::InvalidInput,
        ),
        (
            lmcache_rc_core::service::Capabilities {
                format_version: 7,
                ..caps.clone()
            },
            ErrorKind::UnsupportedFormat,
        ),
    ];
    for (bad, kind) in cases {
        api.set_caps(Some(bad.clone()));
        let e = Worker::start(Box::new(api.clone()), SHAPE, engine_config(SLOW))
            .err()
            .unwrap_or_else(|| panic!("started on {bad:?}"));
        assert_eq!(e.kind(), kind, "{bad:?}: {e}");
    }
    assert!(api.calls().is_empty());
    // Described truly, the pool maps.
    api.set_caps(None);
    let worker = Worker::scripted(&api, SLOW);
    let m = tgen(4_000, 40, 1);
    begin(&svc, &m);
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
}

#[test]
fn a_job_is_refused_before_leasing_when_the_pool_no_longer_matches() {
    let (svc, api) = scripted_service("val-caps-later");
    let worker = Worker::scripted(&api, SLOW);
    let m = tgen(5_000, 40, 1);
    begin(&svc, &m);
    let caps = svc.capabilities();
    // The sidecar now describes a pool of another size; the engine maps again.
    api.set_caps(Some(lmcache_rc_core::service::Capabilities {
        pool_size: caps.pool_size + 4096,
        ..caps.clone()
    }));
    worker.engine.drop_mapping();
    let b = blocks(&m, 1);
    fill_rows(&worker.pool, &m, 0, &b);
    let rows = worker.pool.snapshot();
    let shm = shm_bytes(&svc);
    let d = worker.run(job(&m, 0, Direction::Store, &b));
    assert_eq!(d.kind, "failed", "{d:?}");
    assert_eq!(d.error, Some(ErrorKind::InvalidInput), "{d:?}");
    assert!(api.calls().is_empty(), "no lease call: {:?}", api.calls());
    assert!(worker.pool.snapshot() == rows);
    assert!(shm_bytes(&svc) == shm);
    assert!(!worker.engine.is_unsafe());
    // The sidecar describes its pool again: the next job maps and copies.
    api.set_caps(None);
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    assert_eq!(worker.engine.stats().mappings, 2);
    assert_idle(&svc);
}

// ---------------------------------------------------------------------------
// Jobs refused before any lease call

/// Submits a job with `block_ids` against `m` on an engine bound with
/// `config`; asserts it failed with `needle` before any lease call and
/// touched nothing.
fn refused_job(
    tag: &str,
    m: &Manifest,
    block_ids: Vec<Vec<u64>>,
    config: EngineConfig,
    needle: &str,
) {
    refused_in(
        tag,
        m,
        block_ids,
        config,
        needle,
        &[Direction::Store, Direction::Retrieve],
    );
}

fn refused_in(
    tag: &str,
    m: &Manifest,
    block_ids: Vec<Vec<u64>>,
    config: EngineConfig,
    needle: &str,
    directions: &[Direction],
) {
    let svc: Arc<CheckpointService> = service(tag);
    let api = Scripted::new(svc.clone());
    let worker = Worker::start(Box::new(api.clone()), SHAPE, config).unwrap();
    begin(&svc, m);
    worker.pool.fill(0x33);
    let rows = worker.pool.snapshot();
    let shm = shm_bytes(&svc);
    for &direction in directions {
        let d = worker.run(job(m, 0, direction, &block_ids));
        d.expect("failed", needle);
        assert_eq!(d.error, Some(ErrorKind::InvalidInput), "{d:?}");
    }
    assert!(api.calls().is_empty(), "lease calls: {:?}", api.calls());
    assert!(worker.pool.snapshot() == rows);
    assert!(shm_bytes(&svc) == shm);
    assert!(!worker.engine.is_unsafe());
    assert_idle(&svc);
}

fn standard_job_refused(tag: &str, needle: &str, edit: impl FnOnce(&mut Vec<Vec<u64>>)) {
    let m = tgen(6_000, 40, 1);
    let mut b = blocks(&m, 1);
    edit(&mut b);
    refused_job(tag, &m, b, engine_config(SLOW), needle);
}

#[test]
fn block_zero_is_refused_in_a_store() {
    // In a retrieve, block 0 skips a page the worker holds (tests_rs/transfer_skip.rs).
    let m = tgen(6_000, 40, 1);
    let mut b = blocks(&m, 1);
    b[1][0] = 0;
    refused_in(
        "val-b0",
        &m,
        b,
        engine_config(SLOW),
        "null page",
        &[Direction::Store],
    );
}

#[test]
fn a_block_past_the_pool_is_refused() {
    standard_job_refused("val-bmax", "outside 1..64", |b| b[2][0] = SHAPE.num_blocks);
}

#[test]
fn a_huge_block_id_is_refused() {
    standard_job_refused("val-bhuge", "outside", |b| b[0][2] = u64::MAX);
}

#[test]
fn a_block_shared_by_two_groups_is_refused() {
    standard_job_refused("val-bdup", "distinct physical pages", |b| b[2][0] = b[0][1]);
}

#[test]
fn a_block_repeated_in_one_group_is_refused() {
    standard_job_refused("val-bdup1", "appears twice", |b| b[0][2] = b[0][0]);
}

#[test]
fn too_few_block_groups_are_refused() {
    standard_job_refused("val-g-less", "page groups", |b| {
        b.pop();
    });
}

#[test]
fn too_many_block_groups_are_refused() {
    standard_job_refused("val-g-more", "page groups", |b| b.push(vec![40]));
}

#[test]
fn a_position_count_mismatch_is_refused() {
    standard_job_refused("val-pos", "positions", |b| {
        b[0].pop();
    });
}

#[test]
fn a_page_width_other_than_the_pool_row_is_refused() {
    let m = manifest_with(
        &crate::service_common::seq(7_000, 40),
        1,
        &uniform_groups("prompt", PAGE * 2),
        Some(layout(PAGE)),
        "prompt",
    );
    let b = blocks(&m, 1);
    refused_job("val-width", &m, b, engine_config(SLOW), "bytes wide");
}

#[test]
fn a_mixed_width_manifest_is_refused() {
    let mut groups = uniform_groups("prompt", PAGE);
    groups[1].page_bytes = PAGE / 2;
    let m = manifest_with(
        &crate::service_common::seq(7_500, 40),
        1,
        &groups,
        Some(layout(PAGE)),
        "prompt",
    );
    let b = blocks(&m, 1);
    refused_job("val-mixed", &m, b, engine_config(SLOW), "bytes wide");
}

#[test]
fn a_worker_layout_mismatch_is_refused() {
    let m = manifest_with(
        &crate::service_common::seq(8_000, 40),
        1,
        &uniform_groups("prompt", PAGE),
        Some(serde_json::json!({"schema_version": 1, "page_bytes": 128})),
        "prompt",
    );
    let b = blocks(&m, 1);
    refused_job(
        "val-layout",
        &m,
        b,
        engine_config(SLOW),
        "target/draft byte layout does not match",
    );
}

#[test]
fn a_manifest_without_a_worker_layout_is_refused_by_a_bound_engine() {
    let m = manifest_with(
        &crate::service_common::seq(8_500, 40),
        1,
        &uniform_groups("prompt", PAGE),
        None,
        "prompt",
    );
    let b = blocks(&m, 1);
    refused_job(
        "val-nolayout",
        &m,
        b,
        engine_config(SLOW),
        "no worker_layout",
    );
}

#[test]
fn an_unbound_engine_accepts_any_worker_layout() {
    let svc = service("val-unbound");
    let config = EngineConfig {
        layout: None,
        ..engine_config(SLOW)
    };
    let worker = Worker::start(Box::new(svc.clone()), SHAPE, config).unwrap();
    for (i, l) in [None, Some(serde_json::json!({"page_bytes": 1}))]
        .into_iter()
        .enumerate()
    {
        let m = manifest_with(
            &crate::service_common::seq(9_000 + 100 * i as u32, 40),
            1,
            &uniform_groups("prompt", PAGE),
            l,
            "prompt",
        );
        begin(&svc, &m);
        assert_eq!(worker.store(&m, 0, 1).kind, "copied");
        worker.pool.fill(0);
        assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
        check_rows(&worker.pool, &m, 0, &blocks(&m, 1));
    }
    assert_idle(&svc);
}

#[test]
fn check_job_accepts_exactly_the_valid_jobs() {
    // The pure check, straight: valid ids pass; the last valid row passes.
    let m = tgen(9_500, 40, 1);
    let schema = m.payload_schema().unwrap();
    let layout = PageLayout::pool(SHAPE).unwrap();
    let mut b = blocks(&m, 1);
    plan::check_job(Direction::Store, &schema, &b, &layout).unwrap();
    b[2][0] = SHAPE.num_blocks - 1;
    plan::check_job(Direction::Store, &schema, &b, &layout).unwrap();
    b[2][0] = SHAPE.num_blocks;
    assert_eq!(
        plan::check_job(Direction::Store, &schema, &b, &layout)
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidInput
    );
}

#[test]
fn an_engine_over_a_refused_job_keeps_serving() {
    // A refused job does not disturb later ones on the same engine.
    let svc = service("val-after");
    let worker = Worker::start(Box::new(svc.clone()), SHAPE, engine_config(SLOW)).unwrap();
    let m = tgen(9_800, 40, 1);
    begin(&svc, &m);
    let mut bad = blocks(&m, 1);
    bad[0][0] = 0;
    assert_eq!(
        worker.run(job(&m, 0, Direction::Store, &bad)).kind,
        "failed"
    );
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    assert!(is_listed(&svc, &m));
    assert!(worker.engine.wait_idle(Some(HANG_GUARD)));
    assert_idle(&svc);
}
