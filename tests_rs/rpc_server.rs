//! The RPC server through real sockets: the socket's permissions, typed
//! error replies for malformed input while healthy clients keep being
//! served (I9), leases that outlive their connection, the rank check,
//! pipelining without head-of-line blocking, slow clients, and graceful
//! shutdown.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lmcache_rc_core::protocol::{Checkpoints, CheckpointsAsync, MissReason};
use lmcache_rc_core::rpc::wire::{self, Reply, Request, Value, WireManifest, WirePrefix};
use lmcache_rc_core::rpc::{Client, Server, ServerConfig};
use lmcache_rc_core::service::LeaseStatus;
use lmcache_rc_core::{ErrorKind, Manifest};

use crate::rpc_common::*;
use crate::service_common::{GroupSpec, HANG_GUARD, NS, Role, build_manifest, seq, standard};

fn one_rank(tokens: &[u32], pages: u64) -> Manifest {
    build_manifest(
        NS,
        tokens,
        1,
        &[GroupSpec::new(
            "kv",
            4096,
            (0..pages).collect(),
            Role::Endpoint("page".into()),
        )],
        2,
        "prompt",
    )
}

#[test]
fn socket_is_mode_0600_in_a_new_directory_of_mode_0700() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("run").join("lmcache-rc").join("s.sock");
    let server = Server::open(service_config("mode"), ServerConfig::new(&socket)).unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&socket), 0o600, "socket file");
    assert_eq!(mode(socket.parent().unwrap()), 0o700, "socket directory");
    use std::os::unix::fs::FileTypeExt;
    assert!(
        std::fs::symlink_metadata(&socket)
            .unwrap()
            .file_type()
            .is_socket()
    );
    // No temporary bind name is left behind; the instance lock is 0600.
    let mut entries: Vec<_> = std::fs::read_dir(socket.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    entries.sort();
    assert_eq!(
        entries,
        vec![
            std::ffi::OsString::from("s.sock"),
            std::ffi::OsString::from("s.sock.lock")
        ]
    );
    assert_eq!(
        mode(&socket.with_extension("sock.lock")),
        0o600,
        "lock file"
    );
    let report = server.shutdown().unwrap();
    assert!(report.drained && report.close_error.is_none(), "{report:?}");
    assert!(!socket.exists(), "shutdown removes the socket");
    assert!(
        !socket.with_extension("sock.lock").exists(),
        "and its lock file"
    );
}

#[test]
fn socket_directory_writable_by_others_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let open = dir.path().join("open");
    std::fs::DirBuilder::new()
        .mode(0o777)
        .create(&open)
        .unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = Server::open(
        service_config("open"),
        ServerConfig::new(open.join("s.sock")),
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(
        e.to_string().contains("not writable by group or others"),
        "{e}"
    );
}

#[test]
fn a_live_socket_is_never_taken_over_and_a_stale_one_is_replaced() {
    let rig = rig("live");
    let c = client(&rig.socket);
    let caps = c.capabilities().unwrap();
    // A second server on the same socket refuses before opening a service.
    let e = Server::open(service_config("live2"), ServerConfig::new(&rig.socket)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    assert!(e.to_string().contains("another lmcache-rc server"), "{e}");
    assert_eq!(
        c.capabilities().unwrap(),
        caps,
        "the live server is untouched"
    );
    let pool = map_pool(&c);
    assert_eq!(pool.id(), caps.pool_id, "its pool was not replaced");

    // A stale socket file (nothing listening) is replaced.
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let server = Server::open(service_config("stale"), ServerConfig::new(&stale)).unwrap();
    client(&stale).status().unwrap();
    drop(server);
}

#[test]
fn a_server_holding_the_socket_lock_keeps_a_second_from_starting_until_it_is_gone() {
    // A server still starting up (no socket yet, the lock taken) is seen by
    // its lock: a racing second start refuses instead of taking the socket.
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("race.sock");
    let lock_path = dir.path().join("race.sock.lock");
    let held = std::fs::File::create(&lock_path).unwrap();
    rustix::fs::flock(&held, rustix::fs::FlockOperation::LockExclusive).unwrap();
    let e = Server::open(service_config("race"), ServerConfig::new(&socket)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    assert!(
        e.to_string()
            .contains("another lmcache-rc server is running"),
        "{e}"
    );
    assert!(!socket.exists(), "the refused server bound nothing");
    // The holder dies (its lock goes with it): the lock file it left is reused.
    drop(held);
    assert!(lock_path.exists());
    let server = Server::open(service_config("race2"), ServerConfig::new(&socket)).unwrap();
    client(&socket).status().unwrap();
    // A lock path that is a symlink is never followed.
    let other = dir.path().join("elsewhere.sock");
    std::os::unix::fs::symlink(
        dir.path().join("target"),
        dir.path().join("elsewhere.sock.lock"),
    )
    .unwrap();
    let e = Server::open(service_config("link"), ServerConfig::new(&other)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
    assert!(!dir.path().join("target").exists());
    server.shutdown().unwrap();
    assert!(
        !lock_path.exists(),
        "a stopped server removes its lock file"
    );
}

/// A client that keeps calling while a test misbehaves; counts successes
/// and records any failure.
struct Healthy {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl Healthy {
    fn start(socket: &std::path::Path, m: Manifest) -> Healthy {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let c = client(socket);
        let (s, o) = (stop.clone(), ok.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                c.capabilities().map_err(|e| e.to_string())?;
                let found = c
                    .find(std::slice::from_ref(m.prefix()))
                    .map_err(|e| e.to_string())?;
                if found.as_ref() != Some(&m) {
                    return Err("the stored generation is no longer found".into());
                }
                o.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        });
        Healthy {
            stop,
            ok,
            thread: Some(thread),
        }
    }

    /// Waits for `n` more successful rounds (proof the server is serving).
    fn wait_more(&self, n: u64) {
        let target = self.ok.load(Ordering::Relaxed) + n;
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.ok.load(Ordering::Relaxed) < target {
            assert!(Instant::now() < deadline, "healthy client starved");
            assert!(
                !self.thread.as_ref().unwrap().is_finished(),
                "healthy client failed"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let result = self.thread.take().unwrap().join().unwrap();
        result.unwrap();
        self.ok.load(Ordering::Relaxed)
    }
}

#[test]
fn malformed_input_gets_typed_errors_while_a_healthy_client_is_served() {
    let rig = rig_with(service_config("malformed"), |c| c.max_frame = 1 << 20);
    let c = client(&rig.socket);
    let pool = map_pool(&c);
    let m = standard(NS, &seq(100, 40), "prompt", 2);
    store_all(&c, &pool, &m);
    let healthy = Healthy::start(&rig.socket, m.clone());
    healthy.wait_more(5);

    // Unknown request type, wrong argument encodings, trailing bytes: a
    // Protocol error reply each, and the connection keeps working.
    let mut s = raw_connect(&rig.socket);
    for (id, bad) in [
        (10u64, vec![13u8]),
        (11, vec![200, 1]),
        (12, vec![3, 2, 0xff, 0xfe]),
        (13, vec![3, 9, b'a']),
        (14, vec![0, 0]),
        (15, vec![]),
    ] {
        let (rid, reply) = roundtrip(&mut s, id, &bad);
        assert_eq!(rid, id);
        assert_eq!(err_kind(&reply), "Protocol", "{bad:?}: {reply:?}");
    }
    let (rid, reply) = roundtrip(&mut s, 16, &body(&Request::Capabilities {}));
    assert_eq!(rid, 16);
    assert!(
        matches!(reply, Reply::Ok(Value::Capabilities(_))),
        "{reply:?}"
    );

    // Decodable but invalid values: the core's typed errors.
    let mut bad_manifest = WireManifest::from(&m);
    bad_manifest.world_size = 0;
    let (_, reply) = roundtrip(
        &mut s,
        17,
        &body(&Request::PrepareStore {
            manifest: bad_manifest,
            rank: 0,
        }),
    );
    assert_eq!(err_kind(&reply), "InvalidInput", "{reply:?}");
    let mut bad_prefix = WirePrefix::from(m.prefix());
    bad_prefix.prefix_hash = vec![1, 2, 3];
    let (_, reply) = roundtrip(
        &mut s,
        18,
        &body(&Request::Find {
            roots: vec![bad_prefix],
        }),
    );
    assert_eq!(err_kind(&reply), "InvalidInput", "{reply:?}");
    let mut bad_payload = WireManifest::from(&m);
    bad_payload.payload = b"not json".to_vec();
    let (_, reply) = roundtrip(
        &mut s,
        19,
        &body(&Request::Begin {
            manifest: bad_payload,
        }),
    );
    assert_eq!(err_kind(&reply), "InvalidInput", "{reply:?}");
    healthy.wait_more(5);

    // An oversize frame: a connection-level error (id 0), then close.
    let mut s2 = raw_connect(&rig.socket);
    s2.write_all(&((1u32 << 20) + 1).to_le_bytes()).unwrap();
    let (id, reply) = read_reply(&mut s2).expect("a connection error");
    assert_eq!(id, 0);
    assert_eq!(err_kind(&reply), "Protocol");
    assert_closed(&mut s2);

    // A frame too short to carry an id, and a request using the reserved id 0.
    let mut s3 = raw_connect(&rig.socket);
    s3.write_all(&frame(&[1, 2, 3])).unwrap();
    let (id, reply) = read_reply(&mut s3).unwrap();
    assert_eq!((id, err_kind(&reply)), (0, "Protocol"));
    assert_closed(&mut s3);
    let mut s4 = raw_connect(&rig.socket);
    s4.write_all(&raw_request(0, &body(&Request::Status {})))
        .unwrap();
    let (id, reply) = read_reply(&mut s4).unwrap();
    assert_eq!((id, err_kind(&reply)), (0, "Protocol"));
    assert_closed(&mut s4);

    // A truncated frame: the peer goes away inside it; the server just
    // drops the connection.
    let mut s5 = raw_connect(&rig.socket);
    s5.write_all(&100u32.to_le_bytes()).unwrap();
    s5.write_all(&[0u8; 10]).unwrap();
    s5.shutdown(std::net::Shutdown::Write).unwrap();
    assert_closed(&mut s5);

    // Garbage instead of a hello, and an unsupported version: refused with
    // a welcome of version 0 and a reason, then closed.
    let mut s6 = UnixStream::connect(&rig.socket).unwrap();
    s6.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert_closed(&mut s6);
    let mut s7 = UnixStream::connect(&rig.socket).unwrap();
    s7.write_all(&wire::encode_hello(90, 99)).unwrap();
    let welcome = read_payload(&mut s7).unwrap();
    let (version, message) = wire::decode_welcome(&welcome).unwrap();
    assert_eq!(version, 0);
    assert!(
        message.contains("unsupported protocol version"),
        "{message}"
    );
    assert_closed(&mut s7);

    healthy.wait_more(5);
    assert!(healthy.finish() >= 15);
    // Nothing stored was lost, the original connection still works, and
    // the errors were counted.
    let (_, reply) = roundtrip(&mut s, 20, &body(&Request::Capabilities {}));
    assert!(matches!(reply, Reply::Ok(_)));
    for rank in 0..4 {
        restore_rank(&c, &pool, &m, rank).unwrap();
    }
    let status = c.status().unwrap();
    assert!(status.values["rpc_protocol_errors"] >= 11, "{status:?}");
    assert_idle(&c);
}

#[test]
fn typed_errors_cross_the_wire() {
    let rig = rig("typed");
    let c = client(&rig.socket);
    let pool = map_pool(&c);
    let m = standard(NS, &seq(200, 40), "prompt", 2);
    assert!(c.begin(&m).unwrap());
    let e = c.prepare_store(&m, 4).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    let e = c.poll_retrieve("no-such-lease", None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let lease = prepare(&c, &m, 0);
    let e = c.clear(true, false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::LeasesLive, "{e}");
    fill(&pool, &m, 0, &lease);
    assert!(
        !c.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
            .unwrap()
    );
    // Unknown leases: finish_store is false, finish/cancel of a retrieve no-ops.
    assert!(!c.finish_store("nope", true, None).unwrap());
    c.finish_retrieve("nope", None).unwrap();
    c.cancel_retrieve("nope", None).unwrap();
    c.abort(m.generation()).unwrap();
    assert_idle(&c);
}

#[test]
fn a_lease_outlives_the_connection_that_obtained_it() {
    let rig = rig("orphan");
    let m = one_rank(&seq(300, 20), 2);
    let (store_id, slots) = {
        let a = client(&rig.socket);
        assert!(a.begin(&m).unwrap());
        let lease = prepare(&a, &m, 0);
        assert_eq!(lease.status, LeaseStatus::Ready);
        (lease.lease_id.clone().unwrap(), lease)
    }; // `a` disconnects here with its store lease live
    let b = client(&rig.socket);
    let pool = map_pool(&b);
    // The worker may still be copying: the lease and its slots stay.
    std::thread::sleep(Duration::from_millis(50));
    let s = b.status().unwrap();
    assert_eq!(s.values["store_leases"], 1, "{s:?}");
    fill(&pool, &m, 0, &slots);
    assert!(b.finish_store(&store_id, true, None).unwrap(), "publishes");
    assert_eq!(
        b.find(std::slice::from_ref(m.prefix())).unwrap(),
        Some(m.clone())
    );

    let retrieve_id = {
        let a = client(&rig.socket);
        let begun = a.begin_retrieve(&m, 0).unwrap();
        let id = begun.lease_id.unwrap();
        let ready = poll_done(&a, &id);
        assert_eq!(ready.status, LeaseStatus::Ready);
        check_slots(&pool, &m, 0, &ready);
        id
    };
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(b.status().unwrap().values["retrieve_leases"], 1);
    b.finish_retrieve(&retrieve_id, None).unwrap();
    assert_idle(&b);
    assert_eq!(rig.server.service().unreferenced_objects(), 0);
}

#[test]
fn a_lease_call_naming_another_rank_is_refused() {
    let rig = rig("rank");
    let c = client(&rig.socket);
    let pool = map_pool(&c);
    let m = standard(NS, &seq(400, 40), "prompt", 2);
    assert!(c.begin(&m).unwrap());
    let lease = prepare(&c, &m, 2);
    let id = lease.lease_id.clone().unwrap();
    let e = c
        .call(Request::FinishStore {
            lease_id: id.clone(),
            success: true,
            rank: Some(1),
        })
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(e.to_string().contains("belongs to rank 2"), "{e}");
    assert_eq!(c.status().unwrap().values["store_leases"], 1, "still live");
    fill(&pool, &m, 2, &lease);
    let done = c
        .call(Request::FinishStore {
            lease_id: id,
            success: true,
            rank: Some(2),
        })
        .unwrap();
    assert_eq!(done, Value::Bool(false), "3 ranks still missing");
    c.abort(m.generation()).unwrap();
    assert_idle(&c);
}

#[test]
fn async_calls_resolve_and_keep_their_result() {
    let rig = rig("async");
    let c = client(&rig.socket);
    let pool = map_pool(&c);
    let m = one_rank(&seq(500, 30), 3);
    let begun = c.begin_async(&m);
    assert!(begun.wait(Some(Duration::from_secs(30))).unwrap());
    assert!(begun.is_done());
    assert!(
        begun.wait(Some(Duration::ZERO)).unwrap(),
        "the result is kept"
    );
    let lease = c.prepare_store_async(&m, 0).wait(None).unwrap();
    fill(&pool, &m, 0, &lease);
    let finishing = c.finish_store_async(lease.lease_id.as_deref().unwrap(), true, None);
    let finding = c.find_async(std::slice::from_ref(m.prefix()));
    assert!(finishing.wait(None).unwrap());
    // Pipelined on one connection: find was sent after finish.
    assert_eq!(finding.wait(None).unwrap(), Some(m.clone()));
    let caps = c.capabilities_async().wait(None).unwrap();
    assert_eq!(caps.protocol_version, wire::PROTOCOL_VERSION);
    let e = c
        .poll_retrieve_async("missing", None)
        .wait(Some(Duration::from_secs(30)))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert_idle(&c);
}

#[test]
fn a_waiting_prepare_store_does_not_block_the_connection() {
    // 64 KiB of L1: one 16-page store lease fills it, so a second store
    // waits for space. On the same connection, status and the finish that
    // frees the space must still be answered at once.
    let mut svc = service_config("hol");
    svc.l1_bytes = 64 << 10;
    svc.store_admission_timeout = Duration::from_secs(20);
    let rig = rig_with(svc, |_| {});
    let c = Arc::new(client(&rig.socket));
    let pool = map_pool(&c);
    let big = one_rank(&seq(600, 20), 16);
    let small = one_rank(&seq(700, 20), 1);
    assert!(c.begin(&big).unwrap());
    assert!(c.begin(&small).unwrap());
    let held = prepare(&c, &big, 0);
    assert_eq!(held.status, LeaseStatus::Ready);
    let waiting = c.prepare_store_async(&small, 0);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!waiting.is_done(), "the second store waits for space");
    let t = Instant::now();
    c.status().unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "status was queued behind prepare_store"
    );
    // Failing the big store frees its slots; the waiter gets them.
    assert!(
        !c.finish_store(held.lease_id.as_deref().unwrap(), false, None)
            .unwrap()
    );
    let lease = waiting.wait(Some(Duration::from_secs(15))).unwrap();
    assert_eq!(lease.status, LeaseStatus::Ready, "{lease:?}");
    fill(&pool, &small, 0, &lease);
    assert!(
        c.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
            .unwrap()
    );
    assert_idle(&c);
}

#[test]
fn a_client_that_stops_reading_loses_only_its_own_connection() {
    let rig = rig_with(service_config("slow"), |c| {
        c.write_timeout = Duration::from_millis(300);
    });
    let c = client(&rig.socket);
    let pool = map_pool(&c);
    let m = one_rank(&seq(800, 20), 1);
    store_all(&c, &pool, &m);
    let healthy = Healthy::start(&rig.socket, m.clone());
    // Flood status requests and never read a reply: the server's writes to
    // this connection block, time out, and close it.
    let mut s = raw_connect(&rig.socket);
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let request = raw_request(1, &body(&Request::Status {}));
    let flood = std::thread::spawn(move || {
        for _ in 0..200_000 {
            if s.write_all(&request).is_err() {
                return true;
            }
        }
        false
    });
    healthy.wait_more(20);
    assert!(
        flood.join().unwrap(),
        "the server closed the flooding connection"
    );
    healthy.wait_more(5);
    healthy.finish();
    assert_idle(&c);
}

#[test]
fn graceful_shutdown_stops_admission_and_drains_leases() {
    let rig = rig("drain");
    let c = client(&rig.socket);
    let pool = map_pool(&c);
    let m = one_rank(&seq(900, 20), 2);
    store_all(&c, &pool, &m);
    let begun = c.begin_retrieve(&m, 0).unwrap();
    let id = begun.lease_id.unwrap();
    let ready = poll_done(&c, &id);
    let server = Arc::new(rig.server);
    let stopping = {
        let server = server.clone();
        std::thread::spawn(move || server.shutdown_with(Duration::from_secs(30)))
    };
    // Draining: no new work is admitted, live leases can still finish.
    let deadline = Instant::now() + Duration::from_secs(10);
    for k in 0u32.. {
        // A fresh generation each time (false then only means "not admitted").
        let other = one_rank(&seq(10_000 + k * 100, 20), 1);
        if !c.begin(&other).unwrap() {
            break;
        }
        // The shutdown thread may not have started yet: undo and retry.
        c.abort(other.generation()).unwrap();
        assert!(Instant::now() < deadline, "admission never stopped");
        std::thread::sleep(Duration::from_millis(5));
    }
    let miss = c.begin_retrieve(&m, 0).unwrap();
    assert_eq!(
        (miss.status, miss.reason),
        (LeaseStatus::Miss, Some(MissReason::Shutdown))
    );
    assert!(!stopping.is_finished(), "waits for the exposed lease");
    check_slots(&pool, &m, 0, &ready);
    c.finish_retrieve(&id, None).unwrap();
    let report = stopping.join().unwrap().unwrap();
    assert!(report.drained, "{report:?}");
    assert_eq!(report.live_leases, 0);
    assert_eq!(report.close_error, None);
    assert!(!rig.socket.exists());
    let e = c.status().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unavailable, "{e}");
    // Idempotent.
    assert_eq!(server.shutdown().unwrap(), report);
}

#[test]
fn connections_beyond_the_limit_are_refused_with_a_reason() {
    let rig = rig_with(service_config("limit"), |c| c.max_connections = 2);
    let a = client(&rig.socket);
    let b = client(&rig.socket);
    let e = Client::connect(&rig.socket).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    assert!(e.to_string().contains("too many connections"), "{e}");
    drop(b);
    let deadline = Instant::now() + Duration::from_secs(10);
    let c = loop {
        match Client::connect(&rig.socket) {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => panic!("a freed connection slot was not reused: {e}"),
        }
    };
    c.status().unwrap();
    a.status().unwrap();
}

/// Issue 12, failure 4: a started frame that stalls is dropped after the
/// frame timeout (its thread ends), and an idle connection between frames
/// is kept.
#[test]
fn a_stalled_frame_closes_its_connection_after_the_frame_timeout() {
    let rig = rig_with(service_config("stall"), |c| {
        c.frame_timeout = Duration::from_millis(300)
    });
    let mut idle = raw_connect(&rig.socket);
    let mut stalled = raw_connect(&rig.socket);
    // The largest allowed length, one byte of it, then silence.
    stalled
        .write_all(&(wire::DEFAULT_MAX_FRAME as u32).to_le_bytes())
        .unwrap();
    stalled.write_all(&[0]).unwrap();
    let (id, reply) = read_reply(&mut stalled).expect("a connection error");
    assert_eq!(id, wire::CONNECTION_ERROR_ID);
    assert_eq!(err_kind(&reply), "Protocol");
    assert_closed(&mut stalled);
    let status = rig.server.status().unwrap();
    assert_eq!(status.values["rpc_frames_timed_out"], 1);
    assert_eq!(status.values["rpc_buffered_bytes"], 0);
    // The idle connection waited longer than the timeout and still works.
    std::thread::sleep(Duration::from_millis(500));
    let (_, reply) = roundtrip(&mut idle, 7, &body(&Request::Status {}));
    assert!(matches!(reply, Reply::Ok(_)), "{reply:?}");
}

/// Issue 12, failure 4: bytes of unfinished frames are bounded across all
/// connections; the connection whose frame would exceed the bound is closed
/// with `Unavailable`; small requests are still served.
#[test]
fn unfinished_frames_are_bounded_in_bytes_across_connections() {
    let rig = rig_with(service_config("budget"), |c| {
        c.max_frame = 1 << 20;
        c.max_buffered_bytes = 2 << 20;
    });
    let chunk = vec![0u8; (1 << 20) - 100];
    let mut held = Vec::new();
    let mut refused = None;
    for _ in 0..4 {
        let mut s = raw_connect(&rig.socket);
        s.write_all(&((1u32 << 20).to_le_bytes())).unwrap();
        // Most of the frame, never its end.
        if s.write_all(&chunk).is_err() {
            refused = Some(s);
            break;
        }
        let deadline = Instant::now() + HANG_GUARD;
        while rig.server.status().unwrap().values["rpc_buffered_bytes"]
            < (held.len() as u64 + 1) * (chunk.len() - wire::UNCHARGED_BYTES) as u64
            && rig.server.status().unwrap().values["rpc_frames_over_budget"] == 0
        {
            assert!(Instant::now() < deadline, "the server never read the frame");
            std::thread::sleep(Duration::from_millis(5));
        }
        if rig.server.status().unwrap().values["rpc_frames_over_budget"] > 0 {
            refused = Some(s);
            break;
        }
        held.push(s);
    }
    let mut refused = refused.expect("a frame beyond the budget is refused");
    assert_eq!(
        held.len(),
        2,
        "two unfinished 1 MiB frames fill the 2 MiB budget"
    );
    let (id, reply) = read_reply(&mut refused).expect("a connection error");
    assert_eq!(id, wire::CONNECTION_ERROR_ID);
    assert_eq!(err_kind(&reply), "Unavailable");
    let status = rig.server.status().unwrap();
    assert!(status.values["rpc_buffered_bytes"] <= 2 << 20);
    // Small requests are still served while the budget is held.
    let c = client(&rig.socket);
    c.status().unwrap();
    drop(held);
    let deadline = Instant::now() + HANG_GUARD;
    while rig.server.status().unwrap().values["rpc_buffered_bytes"] > 0 {
        assert!(Instant::now() < deadline, "closed frames keep their bytes");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Issue 12, failure 4: a length prefix alone allocates nothing; a frame's
/// buffer grows as its bytes arrive.
#[test]
fn a_frame_buffer_grows_only_as_its_bytes_arrive() {
    let budget = wire::ByteBudget::new(64 << 20);
    let mut buf = wire::FrameBuffer::new(&budget);
    let mut bytes = (32u32 << 20).to_le_bytes().to_vec();
    bytes.extend_from_slice(&[7u8; 1000]);
    let bounds = wire::FrameBounds {
        max_frame: 64 << 20,
        frame_timeout: Duration::from_secs(5),
    };
    let e = wire::read_frame_bounded(&mut &bytes[..], &bounds, &mut buf).unwrap_err();
    assert!(
        matches!(e, wire::FrameError::Truncated { got: 1004, .. }),
        "{e:?}"
    );
    assert!(
        budget.used() <= 128 << 10,
        "{} bytes held for 1000 received",
        budget.used()
    );
    drop(buf);
    assert_eq!(budget.used(), 0);
}
