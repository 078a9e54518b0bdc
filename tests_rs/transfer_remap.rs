//! The engine follows the sidecar's pool across restarts
//! (`docs/design/transfers.md#2-map-the-pool`, `is_current`/`remap`), against
//! real RPC servers: a pool recreated between leases is mapped again before the
//! next copy; a pool replaced after the mapping but before the copy fails that
//! lease ("replaced") with nothing written or published; a sidecar that is down
//! fails jobs recoverably until it is back.

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::rpc::{Client, Server, ServerConfig};
use lmcache_rc_core::service::ServiceConfig;
use lmcache_rc_core::store::shm::ShmPool;
use lmcache_rc_core::transfer::Direction;

use crate::rpc_common::{assert_idle, client, service_config};
use crate::transfer_common::*;

/// A socket in a private directory and a service config.
fn setup(tag: &str) -> (tempfile::TempDir, PathBuf, ServiceConfig) {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("sidecar.sock");
    (dir, socket, service_config(tag))
}

fn open(config: &ServiceConfig, socket: &PathBuf) -> Server {
    Server::open(config.clone(), ServerConfig::new(socket)).unwrap()
}

fn stop(server: Server) {
    let report = server.shutdown().unwrap();
    assert!(report.close_error.is_none(), "{report:?}");
    drop(server);
}

#[test]
fn a_sidecar_restart_between_leases_remaps_the_pool() {
    let (_dir, socket, config) = setup("remap-restart");
    let first = open(&config, &socket);
    let ctl = client(&socket);
    let worker = Worker::start(Box::new(client(&socket)), SHAPE, engine_config(SLOW)).unwrap();
    assert_eq!(worker.engine.stats().mappings, 1);
    let before = tgen(1_000, 40, 1);
    assert!(ctl.begin(&before).unwrap());
    assert_eq!(worker.store(&before, 0, 1).kind, "copied");
    assert_eq!(worker.engine.stats().mappings, 1, "same pool, same mapping");
    let old_id = ctl.capabilities().unwrap().pool_id;
    assert_eq!(worker.engine.capabilities().unwrap().pool_id, old_id);
    stop(first);

    // A new sidecar on the same socket creates a new pool, with a new id.
    let second = open(&config, &socket);
    let caps = ctl.capabilities().unwrap();
    assert_ne!(caps.pool_id, old_id, "a new pool");
    let after = tgen(2_000, 40, 1);
    assert!(ctl.begin(&after).unwrap());
    assert_eq!(worker.store(&after, 0, 10).kind, "copied");
    assert_eq!(worker.engine.stats().mappings, 2, "mapped again");
    assert_eq!(worker.engine.capabilities().unwrap().pool_id, caps.pool_id);
    worker.pool.fill(0);
    assert_eq!(worker.retrieve(&after, 0, 10).kind, "copied");
    check_rows(&worker.pool, &after, 0, &blocks(&after, 10));
    // The first sidecar's directory was in memory: its generation is gone.
    assert_eq!(worker.retrieve(&before, 0, 1).kind, "miss");
    assert_eq!(worker.engine.stats().mappings, 2);
    assert!(!worker.engine.is_unsafe());
    assert_idle(&ctl);
    worker
        .engine
        .close(Some(crate::service_common::HANG_GUARD))
        .unwrap();
    drop(worker);
    stop(second);
}

#[test]
fn a_pool_replaced_before_the_copy_fails_the_lease() {
    let (_dir, socket, config) = setup("remap-replaced");
    let server = Arc::new(Mutex::new(Some(open(&config, &socket))));
    let api = Scripted::new(client(&socket));
    let worker = Worker::scripted(&api, SLOW);
    assert_eq!(worker.engine.stats().mappings, 1);
    let m = tgen(3_000, 40, 1);

    // Between the engine's mapping and its prepare_store, the sidecar
    // restarts (same socket, a new pool) and the generation is staged
    // on the new one, so the lease comes from the new pool.
    let (slot, cfg, sock, staged) = (server.clone(), config.clone(), socket.clone(), m.clone());
    api.hook("prepare_store", move || {
        stop(slot.lock().take().unwrap());
        let s = open(&cfg, &sock);
        assert!(Client::connect(&sock).unwrap().begin(&staged).unwrap());
        *slot.lock() = Some(s);
    });
    let b = blocks(&m, 1);
    fill_rows(&worker.pool, &m, 0, &b);
    let d = worker.run(job(&m, 0, Direction::Store, &b));
    d.expect("failed", "replaced");
    assert_eq!(d.error, Some(ErrorKind::InvalidInput));
    assert_eq!(api.store_finishes(), vec![false], "{:?}", api.calls());
    assert!(!worker.engine.is_unsafe());

    // Nothing was published and not a byte reached the new pool.
    let ctl = client(&socket);
    assert_eq!(ctl.find(std::slice::from_ref(m.prefix())).unwrap(), None);
    assert_idle(&ctl);
    let (caps, fd) = ctl.share_pool().unwrap();
    let fresh = ShmPool::from_fd(fd, &caps.pool_id, caps.pool_size).unwrap();
    let mut bytes = vec![0u8; caps.pool_size as usize];
    fresh.read_at(0, &mut bytes).unwrap();
    assert!(bytes.iter().all(|b| *b == 0), "the new pool was written");
    drop(fresh);

    // The next job maps the new pool and copies.
    assert!(ctl.begin(&m).unwrap());
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    assert_eq!(worker.engine.stats().mappings, 2);
    worker.pool.fill(0);
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
    check_rows(&worker.pool, &m, 0, &b);
    assert_idle(&ctl);
    drop(worker);
    stop(server.lock().take().unwrap());
}

#[test]
fn a_sidecar_that_is_down_fails_jobs_until_it_is_back() {
    let (_dir, socket, config) = setup("remap-down");
    let first = open(&config, &socket);
    let worker = Worker::start(Box::new(client(&socket)), SHAPE, engine_config(SLOW)).unwrap();
    stop(first);
    let m = tgen(4_000, 40, 1);
    let b = blocks(&m, 1);
    fill_rows(&worker.pool, &m, 0, &b);
    // The pool is gone and nobody answers: the job fails, recoverably.
    for direction in [Direction::Store, Direction::Retrieve] {
        let d = worker.run(job(&m, 0, direction, &b));
        assert_eq!(d.kind, "failed", "{d:?}");
        assert_eq!(d.error, Some(ErrorKind::Unavailable), "{d:?}");
    }
    assert!(!worker.engine.is_unsafe());
    assert_eq!(worker.engine.stats().mappings, 1);
    // Back again: the next job maps the new pool.
    let second = open(&config, &socket);
    let ctl = client(&socket);
    assert!(ctl.begin(&m).unwrap());
    assert_eq!(worker.store(&m, 0, 1).kind, "copied");
    assert_eq!(worker.engine.stats().mappings, 2);
    worker.pool.fill(0);
    assert_eq!(worker.retrieve(&m, 0, 1).kind, "copied");
    check_rows(&worker.pool, &m, 0, &b);
    assert_idle(&ctl);
    drop(worker);
    stop(second);
}
