//! Retrieve jobs that skip pages the worker already holds (block id 0): the
//! pages are leased with the rest but never written, so a worker's local
//! prefix-cache pages — which other requests may be reading — stay untouched.

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::transfer::{Direction, PageLayout, plan};

use crate::service_common::assert_idle;
use crate::transfer_common::*;

#[test]
fn a_retrieve_skips_the_pages_named_block_zero_and_fills_the_rest() {
    let svc = service("skip-retrieve");
    let worker = Worker::in_process(&svc);
    let m = tgen(12_000, 40, 1);
    begin(&svc, &m);
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    let sentinel = vec![0xA5u8; PAGE as usize];
    for row in 1..SHAPE.num_blocks {
        worker.pool.write_row(row, &sentinel);
    }
    let full = blocks(&m, 1);
    let mut partial = full.clone();
    let skipped = partial[0][0];
    partial[0][0] = plan::SKIP;
    let done = worker.run(job(&m, 0, Direction::Retrieve, &partial));
    assert_eq!(done.kind, "copied");
    assert!(
        worker.pool.row(skipped) == sentinel,
        "a skipped page was written"
    );
    for (g, ids) in full.iter().enumerate() {
        for (i, &id) in ids.iter().enumerate() {
            if g == 0 && i == 0 {
                continue;
            }
            assert!(
                worker.pool.row(id) != sentinel,
                "group {g} page {i} was not restored"
            );
        }
    }
    drop(worker);
    assert_idle(&svc);
}

#[test]
fn a_store_may_not_skip_a_page() {
    let m = tgen(12_100, 40, 1);
    let schema = m.payload_schema().unwrap();
    let layout = PageLayout::pool(SHAPE).unwrap();
    let mut b = blocks(&m, 1);
    b[0][0] = plan::SKIP;
    let e = plan::check_job(Direction::Store, &schema, &b, &layout).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(e.to_string().contains("outside 1.."), "{e}");
    plan::check_job(Direction::Retrieve, &schema, &b, &layout).unwrap();
}

#[test]
fn a_retrieve_that_skips_every_page_is_refused() {
    let m = tgen(12_200, 40, 1);
    let schema = m.payload_schema().unwrap();
    let layout = PageLayout::pool(SHAPE).unwrap();
    let b: Vec<Vec<u64>> = blocks(&m, 1)
        .into_iter()
        .map(|ids| vec![plan::SKIP; ids.len()])
        .collect();
    let e = plan::check_job(Direction::Retrieve, &schema, &b, &layout).unwrap_err();
    assert!(e.to_string().contains("copies no page"), "{e}");
}
