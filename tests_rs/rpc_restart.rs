//! The client across server restarts: a call in flight when the server goes
//! away fails with `Unavailable`; the next call reconnects to the new server
//! (a new pool, found through capabilities); a server that never answers
//! gives `Timeout`; a missing server gives `Unavailable` at once.

use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::protocol::{Checkpoints, CheckpointsAsync};
use lmcache_rc_core::rpc::wire::{self, Request};
use lmcache_rc_core::rpc::{Client, ClientConfig, Server, ServerConfig};
use lmcache_rc_core::service::LeaseStatus;

use crate::rpc_common::*;
use crate::service_common::{GroupSpec, NS, Role, build_manifest, seq, standard};

/// A fake server: accepts one connection, answers the hello, reads one
/// request frame, then vanishes (connection and socket) as a crash would.
fn crash_after_one_request(listener: UnixListener) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let hello = read_payload(&mut s).unwrap();
        wire::decode_hello(&hello).unwrap();
        send_welcome(&s);
        let request = read_payload(&mut s).unwrap();
        let (id, body) = wire::split_id(&request).unwrap();
        assert_eq!(id, 1);
        assert_eq!(wire::decode_request(body).unwrap(), Request::Status {});
        drop(s);
        drop(listener);
    })
}

#[test]
fn a_call_in_flight_fails_unavailable_and_the_next_reaches_the_new_server() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let fake = crash_after_one_request(UnixListener::bind(&socket).unwrap());
    let client = Client::connect(&socket).unwrap();
    let e = client.status().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(e.to_string().contains("closed the connection"), "{e}");
    fake.join().unwrap();
    std::fs::remove_file(&socket).unwrap();
    // No server at all: Unavailable at once, not a hang.
    let t = Instant::now();
    let e = client.capabilities().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
    // The restarted server is picked up by the same client.
    let server = Server::open(service_config("restart-a"), ServerConfig::new(&socket)).unwrap();
    let caps = client.capabilities().unwrap();
    assert_eq!(caps.pool_id, server.service().capabilities().pool_id);
    drop(server);
}

#[test]
fn the_client_follows_a_real_server_restart_to_its_new_pool() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let index = dir.path().join("index.sqlite");
    let l2 = dir.path().join("l2");
    let config = |tag: &str| {
        let mut c = crate::service_common::durable_config(tag, dir.path());
        c.checkpoint_index_path = Some(index.clone());
        c.l2_path = Some(l2.clone());
        c
    };
    let first = Server::open(config("restart-1"), ServerConfig::new(&socket)).unwrap();
    let c = client(&socket);
    let pool = map_pool(&c);
    let m = standard(NS, &seq(1_000, 40), "prompt", 2);
    store_all(&c, &pool, &m);
    assert!(first.service().wait_l2_idle(Duration::from_secs(30)));
    let old_caps = c.capabilities().unwrap();
    assert!(old_caps.durable_index);
    let report = first.shutdown().unwrap();
    assert!(report.drained && report.close_error.is_none(), "{report:?}");
    drop(first);

    let second = Server::open(config("restart-2"), ServerConfig::new(&socket)).unwrap();
    // The old connection is dead; the very next call reconnects.
    let caps = c.capabilities().unwrap();
    assert_ne!(caps.pool_id, old_caps.pool_id, "a new pool");
    let old_pool = pool;
    let pool = map_pool(&c);
    assert_eq!(pool.id(), caps.pool_id);
    assert_ne!(old_pool.id(), pool.id());
    assert_eq!(
        c.find(std::slice::from_ref(m.prefix())).unwrap(),
        Some(m.clone())
    );
    for rank in 0..4 {
        restore_rank(&c, &pool, &m, rank).unwrap();
    }
    assert_idle(&c);
    drop(second);
}

#[test]
fn a_blocked_call_fails_unavailable_when_the_server_shuts_down() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let mut svc = service_config("inflight");
    svc.l1_bytes = 64 << 10;
    svc.store_admission_timeout = Duration::from_millis(1500);
    let server = Arc::new(Server::open(svc, ServerConfig::new(&socket)).unwrap());
    let c = client(&socket);
    let one_rank = |base: u32, pages: u64| {
        build_manifest(
            NS,
            &seq(base, 20),
            1,
            &[GroupSpec::new(
                "kv",
                4096,
                (0..pages).collect(),
                Role::Endpoint("p".into()),
            )],
            2,
            "prompt",
        )
    };
    let big = one_rank(2_000, 16);
    let small = one_rank(3_000, 1);
    assert!(c.begin(&big).unwrap() && c.begin(&small).unwrap());
    let held = prepare(&c, &big, 0);
    assert_eq!(held.status, LeaseStatus::Ready);
    // This store waits for space that never frees.
    let blocked = c.prepare_store_async(&small, 0);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!blocked.is_done());
    let report = server.shutdown_with(Duration::from_millis(100)).unwrap();
    let e = blocked.wait(Some(Duration::from_secs(30))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    // The live lease kept the service from closing cleanly, and was reported.
    assert!(!report.drained, "{report:?}");
    assert!(report.live_leases >= 1);
    assert!(report.close_error.is_some());
    // The next call finds no server.
    assert_eq!(c.status().unwrap_err().kind(), ErrorKind::Unavailable);
}

#[test]
fn a_server_that_never_answers_gives_a_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let silent = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        read_payload(&mut s).unwrap();
        send_welcome(&s);
        // Read requests, answer nothing, until the client goes away.
        while read_payload(&mut s).is_some() {}
    });
    let c = Client::connect_with(
        &socket,
        ClientConfig {
            timeout: Duration::from_millis(200),
            ..ClientConfig::default()
        },
    )
    .unwrap();
    let t = Instant::now();
    let e = c.status().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(t.elapsed() >= Duration::from_millis(200));
    let pending = c.capabilities_async();
    let e = pending.wait(Some(Duration::from_millis(50))).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(
        !pending.is_done(),
        "a timed-out wait leaves the future pending"
    );
    c.close();
    assert_eq!(c.status().unwrap_err().kind(), ErrorKind::Closed);
    // Closing the client failed the pending call and ended the connection.
    assert!(pending.is_done());
    silent.join().unwrap();
}

#[test]
fn a_handshake_refusal_is_a_protocol_error() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let refusing = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        read_payload(&mut s).unwrap();
        std::io::Write::write_all(&mut s, &wire::encode_welcome(0, "go away")).unwrap();
    });
    let e = Client::connect(&socket).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    assert!(e.to_string().contains("go away"), "{e}");
    refusing.join().unwrap();
}
