//! Leases belong to processes (`service::reclaim`): a process that is gone
//! gives back its store leases (aborted: pages dropped, generation not
//! published) and its retrieve leases (readers released); a live process
//! keeps its leases whatever its connections do; untracked holders are
//! never reclaimed; an abandoned pending generation is aborted by a timer.
//!
//! Each "gone" scenario runs in process (the holder is a `sleep` child the
//! test kills; the service's sweep notices) and over the socket (the holder
//! is this test binary re-invoked with `LMRC_RECLAIM_CHILD`, connected
//! through a real client, then SIGKILLed; its connection's close notices).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lmcache_rc_core::Manifest;
use lmcache_rc_core::peer::Peer;
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::rpc::{Client, Server, ServerConfig};
use lmcache_rc_core::service::{CheckpointService, Holder, Lease, LeaseStatus, ServiceConfig};
use lmcache_rc_core::store::shm::ShmPool;

use crate::service_common::*;

const CHILD_ENV: &str = "LMRC_RECLAIM_CHILD";

/// How long the tests allow a reclaim to take (a liveness bound: it takes
/// milliseconds, the bound only guards against a hang).
const RECLAIM_BOUND: Duration = Duration::from_secs(10);

/// The generation a holder is storing (begun, rank 0 leased, not finished).
fn storing() -> Manifest {
    standard(NS, &seq(71_000, 40), "prompt", 2)
}

/// A published generation a holder is restoring (rank 0 exposed).
fn restoring() -> Manifest {
    standard(NS, &seq(72_000, 56), "instruction", 2)
}

fn svc_config() -> ServiceConfig {
    ServiceConfig {
        retrieve_timeout: HANG_GUARD,
        ..config("reclaim", None)
    }
}

/// Waits (bounded) until nothing is leased, pinned or pending; returns how
/// long that took.
fn wait_reclaimed(svc: &impl Checkpoints) -> Duration {
    let t = Instant::now();
    loop {
        let s = svc.status().unwrap();
        let v = |k: &str| s.values.get(k).copied().unwrap_or(0);
        if v("store_leases") == 0
            && v("retrieve_leases") == 0
            && v("pins") == 0
            && v("pending") == 0
        {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < RECLAIM_BOUND,
            "the dead holder's leases were not reclaimed: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The holder's status before it dies: one store lease (and its pending
/// generation, its pins), one exposed retrieve lease.
fn assert_held(svc: &impl Checkpoints) {
    let s = svc.status().unwrap();
    let v = |k: &str| s.values.get(k).copied().unwrap_or(0);
    assert_eq!(v("store_leases"), 1, "{s:?}");
    assert_eq!(v("retrieve_leases"), 1, "{s:?}");
    assert_eq!(v("pending"), 1, "{s:?}");
    assert!(v("pins") > 0, "{s:?}");
}

/// What must hold once the dead holder's leases are back: the counters
/// say so, the same content stores again (fresh slots for the aborted
/// pages: they were never committed), both generations restore, a forced
/// clear is not refused, and the service is idle.
fn after_reclaim<T: Target>(svc: &T) {
    assert_eq!(stat(svc, "reclaimed_store_leases"), 1);
    assert_eq!(stat(svc, "reclaimed_retrieve_leases"), 1);
    let m = storing();
    assert!(!is_listed(svc, &m), "a dead holder's store never publishes");
    store_all(svc, &m);
    restore_all(svc, &m);
    restore_all(svc, &restoring());
    assert_idle(svc);
    svc.clear(true, false).unwrap();
    assert_idle(svc);
}

/// Takes the two leases for `holder` through `lease_store` / `lease_read`
/// and writes the store lease's slots through `pool`.
fn take_leases(
    pool: &ShmPool,
    lease_store: impl Fn(&Manifest) -> Lease,
    lease_read: impl Fn(&Manifest) -> Lease,
    poll: impl Fn(&str) -> Lease,
) -> (String, String) {
    let m = storing();
    let lease = lease_store(&m);
    assert_eq!(lease.status, LeaseStatus::Ready, "{lease:?}");
    let keys = rank_keys(&m, 0);
    for (g, slots) in lease.slots.iter().enumerate() {
        for (i, slot) in slots.iter().enumerate() {
            if let Some((offset, len)) = slot {
                pool.write_at(*offset, &object_bytes(&keys[g][i], *len))
                    .unwrap();
            }
        }
    }
    let r = restoring();
    let begun = lease_read(&r);
    let id = begun.lease_id.clone().unwrap();
    let deadline = Instant::now() + HANG_GUARD;
    let ready = loop {
        let l = poll(&id);
        if l.status != LeaseStatus::Pending {
            break l;
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(ready.status, LeaseStatus::Ready, "{ready:?}");
    (lease.lease_id.unwrap(), id)
}

/// Begins `storing` and publishes `restoring` (the parent's part).
fn stage(svc: &CheckpointService) {
    assert!(svc.begin(&storing()).unwrap());
    store_all(svc, &restoring());
}

// ---------------------------------------------------------------------------
// A process that is gone

#[test]
fn a_gone_process_store_lease_aborts_and_its_retrieve_lease_releases_in_process() {
    let svc = CheckpointService::open(svc_config()).unwrap();
    stage(&svc);
    let mut child = Command::new("sleep").arg("60").spawn().unwrap();
    let holder = Holder::Process(Arc::new(Peer::of_pid(child.id()).unwrap()));
    take_leases(
        svc.pool(),
        |m| svc.prepare_store_for(&holder, m, 0).unwrap(),
        |m| svc.begin_retrieve_for(&holder, m, 0).unwrap(),
        |id| svc.poll_retrieve(id, None).unwrap(),
    );
    assert_held(&svc);
    // Alive: the sweep leaves its leases alone.
    assert_eq!(svc.reclaim_gone(), Default::default());
    assert_held(&svc);
    child.kill().unwrap();
    // Not reaped (a zombie): already gone. Nobody calls the service: its
    // own sweep notices.
    let took = wait_reclaimed(&svc);
    println!("in process: reclaimed {took:?} after the kill");
    child.wait().unwrap();
    after_reclaim(&svc);
    svc.close().unwrap();
}

/// The re-invoked child: connects, takes the two leases, says so, waits to
/// be killed. A no-op in an ordinary test run.
#[test]
fn reclaim_child() {
    let Ok(socket) = std::env::var(CHILD_ENV) else {
        return;
    };
    let client = Client::connect(&socket).unwrap();
    let (caps, fd) = client.share_pool().unwrap();
    let pool = ShmPool::from_fd(fd, &caps.pool_id, caps.pool_size).unwrap();
    let (store, read) = take_leases(
        &pool,
        |m| client.prepare_store(m, 0).unwrap(),
        |m| client.begin_retrieve(m, 0).unwrap(),
        |id| client.poll_retrieve(id, None).unwrap(),
    );
    println!("HELD {store} {read}");
    std::thread::sleep(Duration::from_secs(120));
}

/// Starts the child on `socket` and waits until it holds its leases.
fn spawn_holder(socket: &Path) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "service_reclaim::reclaim_child", "--nocapture"])
        .args(["--test-threads", "1"])
        .env(CHILD_ENV, socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    loop {
        let line = lines.next().expect("the child ended early").unwrap();
        if line.contains("HELD ") {
            break;
        }
    }
    child
}

#[test]
fn a_gone_process_store_lease_aborts_and_its_retrieve_lease_releases_over_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("reclaim.sock");
    let server = Server::open(svc_config(), ServerConfig::new(&socket)).unwrap();
    let svc = server.service().clone();
    stage(&svc);
    let mut child = spawn_holder(&socket);
    assert_held(&*svc);
    child.kill().unwrap();
    let took = wait_reclaimed(&*svc);
    println!("over the socket: reclaimed {took:?} after the kill");
    child.wait().unwrap();
    after_reclaim(&*svc);
    drop(svc);
    let report = server.shutdown().unwrap();
    assert!(report.drained && report.close_error.is_none(), "{report:?}");
}

// ---------------------------------------------------------------------------
// A process that lives

#[test]
fn a_live_process_keeps_its_leases_across_disconnects_and_sweeps() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("live.sock");
    let server = Server::open(svc_config(), ServerConfig::new(&socket)).unwrap();
    let svc = server.service().clone();
    stage(&svc);
    let first = Client::connect(&socket).unwrap();
    let (caps, fd) = first.share_pool().unwrap();
    let pool = ShmPool::from_fd(fd, &caps.pool_id, caps.pool_size).unwrap();
    let (store, read) = take_leases(
        &pool,
        |m| first.prepare_store(m, 0).unwrap(),
        |m| first.begin_retrieve(m, 0).unwrap(),
        |id| first.poll_retrieve(id, None).unwrap(),
    );
    // The connection goes; the process (this one) lives on.
    first.close();
    drop(first);
    std::thread::sleep(lmcache_rc_core::service::SWEEP_EVERY * 3);
    assert_eq!(svc.reclaim_gone(), Default::default());
    assert_held(&*svc);
    assert_eq!(stat(&*svc, "reclaimed_store_leases"), 0);
    // Reconnected, it finishes its own leases.
    let again = Client::connect(&socket).unwrap();
    again.finish_retrieve(&read, Some(0)).unwrap();
    assert!(!again.finish_store(&store, true, Some(0)).unwrap());
    let m = storing();
    for rank in 1..4 {
        store_one(&*svc, &m, rank);
    }
    assert!(is_listed(&*svc, &m));
    restore_all(&*svc, &m);
    assert_idle(&*svc);
    drop(svc);
    drop(again);
    server.shutdown().unwrap();
}

#[test]
fn untracked_leases_are_never_reclaimed() {
    let svc = CheckpointService::open(svc_config()).unwrap();
    stage(&svc);
    let m = storing();
    let lease = prepare(&svc, &m, 0);
    std::thread::sleep(lmcache_rc_core::service::SWEEP_EVERY * 3);
    assert_eq!(svc.reclaim_gone(), Default::default());
    assert_eq!(stat(&svc, "store_leases"), 1);
    fill(&svc, &m, 0, &lease);
    svc.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
        .unwrap();
    for rank in 1..4 {
        store_one(&svc, &m, rank);
    }
    restore_all(&svc, &m);
    assert_idle(&svc);
}

// ---------------------------------------------------------------------------
// Abandoned pending generations

#[test]
fn an_abandoned_pending_generation_is_aborted_by_the_timer() {
    let svc = CheckpointService::open(ServiceConfig {
        abandoned_after: Some(Duration::from_secs(1)),
        ..svc_config()
    })
    .unwrap();
    let m = storing();
    assert!(svc.begin(&m).unwrap());
    // A rank committed, the others never come; nobody calls begin again.
    store_one(&svc, &m, 0);
    assert!(stat(&svc, "pins") > 0);
    let t = Instant::now();
    while stat(&svc, "pending") > 0 {
        assert!(t.elapsed() < RECLAIM_BOUND, "never aborted");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(stat(&svc, "abandoned_generations"), 1);
    assert!(!is_listed(&svc, &m));
    assert_idle(&svc);
    // Staged again, it publishes normally.
    let t = Instant::now();
    while !svc.begin(&m).unwrap() {
        assert!(t.elapsed() < RECLAIM_BOUND);
        std::thread::sleep(Duration::from_millis(5));
    }
    for rank in 0..4 {
        store_one(&svc, &m, rank);
    }
    restore_all(&svc, &m);
    assert_idle(&svc);
}

// ---------------------------------------------------------------------------
// Retrieve leases nobody polls

#[test]
fn an_unpolled_retrieve_lease_is_expired_and_its_readers_released_but_an_exposed_one_is_kept() {
    let timeout = Duration::from_millis(100);
    let l2 = tempfile::tempdir().unwrap();
    let svc = CheckpointService::open(ServiceConfig {
        retrieve_timeout: timeout,
        ..config("reclaim", Some(l2.path()))
    })
    .unwrap();
    let m = restoring();
    store_all(&svc, &m);
    settle(&svc);
    // Rank 1 restores from L1 (exposed at once) and keeps its slots; then
    // the rest leaves L1, and rank 0 begins a restore that must load from
    // L2 (pending) and never polls it (a live holder that lost track of it).
    let kept = svc.begin_retrieve(&m, 1).unwrap();
    assert_eq!(
        kept.status,
        LeaseStatus::Ready,
        "resident in L1: ready at once"
    );
    let kept_id = kept.lease_id.clone().unwrap();
    svc.clear(false, false).unwrap();
    let forgotten = svc.begin_retrieve(&m, 0).unwrap();
    assert_eq!(forgotten.status, LeaseStatus::Pending);
    let forgotten_id = forgotten.lease_id.clone().unwrap();
    let t = Instant::now();
    while svc.poll_retrieve(&kept_id, Some(1)).unwrap().status != LeaseStatus::Ready {
        assert!(t.elapsed() < HANG_GUARD);
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(stat(&svc, "retrieve_leases"), 2);
    let t = Instant::now();
    while stat(&svc, "retrieve_leases") > 1 {
        assert!(
            t.elapsed() < RECLAIM_BOUND,
            "the unpolled lease was never expired"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(stat(&svc, "retrieves_expired"), 1);
    // The forgotten lease is gone: polling it is an error the worker treats
    // as a failed restore, never a stale slot.
    assert!(svc.poll_retrieve(&forgotten_id, Some(0)).is_err());
    // The exposed lease is untouched by the sweep (its copy may still read
    // the slots) and finishes normally; then nothing is held.
    std::thread::sleep(timeout * 4);
    assert_eq!(stat(&svc, "retrieve_leases"), 1);
    svc.finish_retrieve(&kept_id, Some(1)).unwrap();
    assert_eq!(stat(&svc, "retrieves_expired"), 1);
    restore_all(&svc, &m);
    assert_idle(&svc);
}
