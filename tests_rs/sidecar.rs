//! Whole sidecars started through the core's `Sidecar` (service, RPC server,
//! HTTP admin API), without Python: they serve, stop in order, stop once,
//! stop when dropped, and a part that fails at start leaves nothing running.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use lmcache_rc_core::ErrorKind;
use lmcache_rc_core::config::SidecarConfig;
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::rpc::Client;
use lmcache_rc_core::sidecar::Sidecar;

use crate::rpc_common::{client, map_pool, store_all};
use crate::service_common::manifest;

/// Settings of a small sidecar on `socket`, HTTP on a free loopback port.
fn settings(socket: &Path) -> SidecarConfig {
    SidecarConfig {
        socket: socket.to_path_buf(),
        l1_bytes: 16 << 20,
        http_port: 0,
        drain_timeout: Duration::from_secs(5),
        ..SidecarConfig::default()
    }
}

fn http_addr(sidecar: &Sidecar) -> SocketAddr {
    let url = sidecar.http_url().expect("HTTP is on");
    url.trim_start_matches("http://").parse().unwrap()
}

/// `GET path` on `addr`; (status code, body).
fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    crate::http_admin::http_request(addr, "GET", path, "")
}

/// Everything a running sidecar leaves on the host is gone: its socket, its
/// admin file, its HTTP listener, and its instance lock (a new sidecar
/// starts on the same socket).
fn assert_nothing_left(socket: &Path, admin_file: Option<PathBuf>, http: Option<SocketAddr>) {
    assert!(!socket.exists(), "socket {} left behind", socket.display());
    if let Some(file) = admin_file {
        assert!(!file.exists(), "admin file {} left behind", file.display());
    }
    if let Some(addr) = http {
        assert!(
            TcpStream::connect(addr).is_err(),
            "HTTP still listening on {addr}"
        );
    }
    let again = Sidecar::start(&settings(socket), Some(false)).unwrap();
    assert_eq!(again.socket_path(), socket);
    again.stop(None).unwrap();
}

#[test]
fn a_sidecar_serves_rpc_and_http_then_stops_every_part() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("side.sock");
    let sidecar = Sidecar::start(&settings(&socket), Some(false)).unwrap();
    assert_eq!(sidecar.socket_path(), socket);
    let admin_file = sidecar.admin_file().map(Path::to_path_buf);
    assert!(admin_file.as_ref().is_some_and(|f| f.exists()));
    let addr = http_addr(&sidecar);

    // A client round trip: a generation stored over RPC is found.
    let rpc = client(&socket);
    let pool = map_pool(&rpc);
    let tokens: Vec<u32> = (0..40).collect();
    let m = manifest(&tokens, 2, 4096, 16);
    store_all(&rpc, &pool, &m);
    let found = rpc.find(std::slice::from_ref(m.prefix())).unwrap();
    assert_eq!(found.as_ref().map(|g| g.generation()), Some(m.generation()));

    // HTTP /status answers the server's status: the service and the RPC layer.
    let (code, body) = get(addr, "/status");
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["generations"], 1, "{body}");
    assert_eq!(status["rpc_connections"], 1, "{body}");
    assert_eq!(sidecar.status().unwrap().values["generations"], 1);

    rpc.close();
    drop(pool);
    let report = sidecar.stop(None).unwrap();
    assert!(report.drained && report.live_leases == 0, "{report:?}");
    assert_eq!(report.close_error, None);
    assert!(sidecar.is_stopped());
    assert_eq!(sidecar.status().unwrap_err().kind(), ErrorKind::Closed);
    assert!(
        Client::connect(&socket).is_err(),
        "the socket stopped serving"
    );
    assert_nothing_left(&socket, admin_file, Some(addr));
}

#[test]
fn stopping_twice_answers_the_first_stop() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("side.sock");
    let sidecar = Sidecar::start(&settings(&socket), Some(false)).unwrap();
    let first = sidecar.stop(Some(Duration::ZERO)).unwrap();
    let second = sidecar.stop(None).unwrap();
    assert_eq!(first, second);
    assert!(sidecar.is_stopped());
    drop(sidecar);
    assert_nothing_left(&socket, None, None);
}

#[test]
fn dropping_a_running_sidecar_stops_every_part() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("side.sock");
    let sidecar = Sidecar::start(&settings(&socket), Some(false)).unwrap();
    let admin_file = sidecar.admin_file().map(Path::to_path_buf);
    let addr = http_addr(&sidecar);
    let rpc = client(&socket);
    assert!(rpc.status().is_ok());
    drop(sidecar);
    assert!(
        rpc.status().is_err(),
        "the server's connections closed with it"
    );
    assert_nothing_left(&socket, admin_file, Some(addr));
}

#[test]
fn a_sidecar_in_a_temporary_directory_removes_it_when_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let sidecar = Sidecar::start(&settings(&dir.path().join("x.sock")), Some(true)).unwrap();
    let socket = sidecar.socket_path().to_path_buf();
    assert!(
        !socket.starts_with(dir.path()),
        "a fresh directory of its own"
    );
    let folder = socket.parent().unwrap().to_path_buf();
    assert!(folder.is_dir());
    sidecar.stop(None).unwrap();
    assert!(!folder.exists(), "{} left behind", folder.display());
}

#[test]
fn a_part_that_fails_to_start_leaves_nothing_running() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("side.sock");
    // The HTTP admin API cannot bind: its port is taken. The RPC server,
    // already listening by then, stops again.
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let config = SidecarConfig {
        http_port: i64::from(port),
        ..settings(&socket)
    };
    let err = Sidecar::start(&config, Some(false)).unwrap_err();
    assert!(err.to_string().contains(&port.to_string()), "{err}");
    assert!(Client::connect(&socket).is_err(), "no RPC server left");
    assert_nothing_left(&socket, Some(dir.path().join("side.sock.admin.json")), None);

    // The service cannot open (its L2 path is a file): nothing listens.
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let config = SidecarConfig {
        l2_path: Some(file),
        ..settings(&socket)
    };
    assert!(Sidecar::start(&config, Some(false)).is_err());
    assert_nothing_left(&socket, None, None);
}
