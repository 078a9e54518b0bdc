//! Many clients at once: 8 clients × ~5000 operations (store, find,
//! retrieve of small overlapping manifests) finish without deadlock, every
//! generation a client published restores byte-exact, and the service is
//! idle at the end (I7). A second run shares one client between threads
//! (pipelined calls on one connection).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lmcache_rc_core::Manifest;
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::rpc::Client;
use lmcache_rc_core::service::LeaseStatus;
use lmcache_rc_core::store::shm::ShmPool;

use crate::rpc_common::*;
use crate::service_common::{GroupSpec, NS, Role, build_manifest, seq};

const THREADS: u32 = 8;
/// Generations per thread: about 12 RPCs each.
const ROUNDS: u32 = 420;

/// Two ranks, attention pages shared by every sequence with the same start
/// (so threads deduplicate against each other), a per-boundary state page.
fn manifest(base: u32, len: u32) -> Manifest {
    build_manifest(
        NS,
        &seq(base, len),
        2,
        &[
            GroupSpec::new(
                "attention",
                1024,
                (0..u64::from(len.div_ceil(16))).collect(),
                Role::Attention(16),
            ),
            GroupSpec::new("state", 512, vec![0], Role::Endpoint("state:1".into())),
        ],
        2,
        "prompt",
    )
}

/// One worker's loop; returns the number of RPCs it made.
fn work(client: &Client, pool: &ShmPool, thread: u32) -> u64 {
    let mut calls = 0u64;
    let mut mine = HashSet::new();
    for i in 0..ROUNDS {
        // Sequences repeat across threads (same base and length), so a
        // thread often finds a generation another thread staged or published.
        let base = 100_000 + (i % 12) * 1_000;
        let len = 16 + (thread * 7 + i * 5) % 48;
        let m = manifest(base, len);
        calls += 1;
        if client.begin(&m).unwrap() {
            for rank in 0..2 {
                let lease = prepare(client, &m, rank);
                calls += 1;
                if lease.status != LeaseStatus::Ready {
                    // Another thread's identical pages were being written
                    // and its attempt failed us: give the generation up.
                    client.abort(m.generation()).unwrap();
                    calls += 1;
                    break;
                }
                fill(pool, &m, rank, &lease);
                let published = client
                    .finish_store(lease.lease_id.as_deref().unwrap(), true, None)
                    .unwrap();
                calls += 1;
                if published {
                    mine.insert(m.generation().to_string());
                }
            }
        }
        let found = client.find(std::slice::from_ref(m.prefix())).unwrap();
        calls += 1;
        if mine.contains(m.generation()) {
            assert_eq!(found.as_ref(), Some(&m), "a published generation is found");
        }
        if found.as_ref() == Some(&m) {
            for rank in 0..2 {
                let result = restore_rank(client, pool, &m, rank);
                calls += 3;
                if mine.contains(m.generation()) {
                    result.unwrap_or_else(|r| panic!("thread {thread} lost its own store: {r}"));
                }
            }
        }
        calls += 1;
        client.status().unwrap();
    }
    calls
}

fn run(shared_client: bool, tag: &str) {
    let rig = rig(tag);
    let shared = Arc::new(client(&rig.socket));
    let pool = Arc::new(map_pool(&shared));
    let started = Instant::now();
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let socket = rig.socket.clone();
            let (shared, pool) = (shared.clone(), pool.clone());
            std::thread::spawn(move || {
                if shared_client {
                    work(&shared, &pool, t)
                } else {
                    work(&client(&socket), &pool, t)
                }
            })
        })
        .collect();
    let mut total = 0;
    for t in threads {
        // A deadlock shows up as a hang of the test binary; bound it here.
        total += t.join().unwrap();
    }
    assert!(
        started.elapsed() < Duration::from_secs(120),
        "took {:?}",
        started.elapsed()
    );
    assert!(total >= u64::from(THREADS) * 900, "only {total} RPCs");
    assert_idle(&shared);
    assert_eq!(rig.server.service().unreferenced_objects(), 0);
    let status = shared.status().unwrap();
    assert!(status.values["generations"] > 0, "{status:?}");
    assert!(status.values["rpc_requests"] >= total, "{status:?}");
}

#[test]
fn eight_clients_store_find_and_retrieve_concurrently_and_end_idle() {
    run(false, "stress8");
}

#[test]
fn eight_threads_pipelining_on_one_client_end_idle() {
    run(true, "stress1");
}
