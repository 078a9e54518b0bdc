//! The HTTP admin API: status JSON, Prometheus metrics, clear semantics and
//! its bearer token. (The limits against hostile clients are tested on a
//! real `lmcache-rc serve` in tests_py/test_http_admin_limits.py.)

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use lmcache_rc_core::http::{AdminConfig, AdminToken, HttpAdmin, Reply, Routes};
use lmcache_rc_core::protocol::{Checkpoints, ServiceStatus};
use lmcache_rc_core::service::{CheckpointService, LeaseStatus};

use crate::service_common::*;

fn request(admin: &HttpAdmin, method: &str, path: &str) -> (u16, String) {
    request_with(admin, method, path, "")
}

/// Sends one request with `extra` header lines; (status code, body).
fn request_with(admin: &HttpAdmin, method: &str, path: &str, extra: &str) -> (u16, String) {
    http_request(admin.local_addr(), method, path, extra)
}

/// Sends one HTTP/1.1 request to `addr` with `extra` header lines and reads
/// the reply to the end; (status code, body). Shared with the sidecar tests.
pub fn http_request(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    extra: &str,
) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: x\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    let code = text[9..12].parse().unwrap();
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

#[test]
fn status_and_metrics_describe_the_service_over_http() {
    let svc = Arc::new(CheckpointService::open(config("http", None)).unwrap());
    let tokens: Vec<u32> = (0..40).collect();
    let m = manifest(&tokens, 1, 4096, 16);
    assert!(svc.begin(&m).unwrap());
    store_rank(&svc, &m, 0);
    let admin = HttpAdmin::start(AdminConfig::new("127.0.0.1", 0), svc.clone()).unwrap();
    assert!(admin.local_addr().ip().is_loopback());
    let (code, body) = request(&admin, "GET", "/status");
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["generations"], 1);
    assert_eq!(status["l1_objects"], 5);
    assert!(status["misses"].is_object());
    // Without `Accept: application/openmetrics-text`: the Prometheus text format.
    let (code, body) = request(&admin, "GET", "/metrics");
    assert_eq!(code, 200);
    let mut seen = 0;
    for line in body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (name, value) = line.rsplit_once(' ').unwrap();
        assert!(name.starts_with("lmcache_rc_"), "{line}");
        value.parse::<f64>().unwrap();
        seen += 1;
    }
    assert!(seen >= 40, "{body}");
    for line in [
        "lmcache_rc_generations 1",
        "lmcache_rc_tier_objects{tier=\"L1\"} 5",
        "# TYPE lmcache_rc_published_generations_total counter",
        "lmcache_rc_published_generations_total 1",
    ] {
        assert!(
            body.lines().any(|l| l == line),
            "{line} missing from\n{body}"
        );
    }
    assert!(
        !body.contains("# EOF") && !body.contains("# UNIT"),
        "{body}"
    );
    // Prometheus asks for OpenMetrics and gets it.
    let accept = "Accept: application/openmetrics-text;version=1.0.0;q=0.5,text/plain;q=0.4\r\n";
    let (code, open) = request_with(&admin, "GET", "/metrics", accept);
    assert_eq!(code, 200);
    assert!(
        open.lines()
            .any(|l| l == "# TYPE lmcache_rc_published_generations counter"),
        "{open}"
    );
    assert!(open.trim_end().ends_with("# EOF"), "{open}");
    assert_eq!(request(&admin, "GET", "/nope").0, 404);
    assert_eq!(request(&admin, "GET", "/clear").0, 405);
    let auth = format!("Authorization: Bearer {}\r\n", admin.token().as_str());
    assert_eq!(
        request_with(&admin, "POST", "/clear?force=maybe", &auth).0,
        400
    );
    drop(admin);
    assert_idle(&svc);
}

/// Answers a clear through the routes, authorized.
fn clear(routes: &Routes, token: &AdminToken, query: &str) -> Reply {
    let auth = format!("Bearer {}", token.as_str());
    routes.answer("POST", &format!("/clear{query}"), Some(auth.as_bytes()))
}

#[test]
fn forced_clear_is_refused_with_409_while_a_lease_is_live() {
    let svc = Arc::new(CheckpointService::open(config("http-clear", None)).unwrap());
    let token = AdminToken::generate().unwrap();
    let routes = Routes::new(svc.clone(), token.clone());
    let m = manifest(&(0..30).collect::<Vec<u32>>(), 1, 4096, 16);
    assert!(svc.begin(&m).unwrap());
    let lease = svc.prepare_store(&m, 0).unwrap();
    assert_eq!(lease.status, LeaseStatus::Ready);
    let reply = clear(&routes, &token, "?force=true");
    assert_eq!(reply.code, 409, "{}", reply.body);
    let reply = clear(&routes, &token, "");
    assert_eq!(reply.code, 409, "force omitted is forced: {}", reply.body);
    let reply = clear(&routes, &token, "?force=false");
    assert_eq!(reply.code, 200, "{}", reply.body);
    let report: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!(report["force"], false);
    assert!(report["cleared"]["kept_objects"].as_u64().unwrap() >= 3);
    write_slots(&svc, &m, 0, &lease);
    assert!(
        svc.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
            .unwrap()
    );
    assert!(
        retrieve_rank(&svc, &m, 0),
        "non-forced clear kept the leased pages"
    );
    let reply = clear(&routes, &token, "?force=true&all_tiers=true");
    assert_eq!(reply.code, 200);
    assert_eq!(svc.status().unwrap().values["l1_objects"], 0);
    assert_idle(&svc);
}

#[test]
fn clear_with_force_omitted_is_forced_once_no_lease_is_live() {
    let svc = Arc::new(CheckpointService::open(config("http-clear-default", None)).unwrap());
    let token = AdminToken::generate().unwrap();
    let routes = Routes::new(svc.clone(), token.clone());
    let m = manifest(&(0..30).collect::<Vec<u32>>(), 1, 4096, 16);
    assert!(svc.begin(&m).unwrap());
    store_rank(&svc, &m, 0);
    let reply = clear(&routes, &token, "");
    assert_eq!(reply.code, 200, "{}", reply.body);
    let report: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
    assert_eq!(report["force"], true);
    assert_eq!(report["all_tiers"], false);
    assert_eq!(svc.status().unwrap().values["l1_objects"], 0);
    assert_idle(&svc);
}

#[test]
fn clear_without_the_bearer_token_is_401_and_clears_nothing() {
    let svc = Arc::new(CheckpointService::open(config("http-clear-auth", None)).unwrap());
    let m = manifest(&(0..40).collect::<Vec<u32>>(), 1, 4096, 16);
    assert!(svc.begin(&m).unwrap());
    store_rank(&svc, &m, 0);
    let admin = HttpAdmin::start(AdminConfig::new("127.0.0.1", 0), svc.clone()).unwrap();
    let wrong = "0".repeat(64);
    for extra in [
        String::new(),
        format!("Authorization: Bearer {wrong}\r\n"),
        format!("Authorization: Basic {}\r\n", admin.token().as_str()),
        format!("Authorization: {}\r\n", admin.token().as_str()),
    ] {
        let (code, body) = request_with(&admin, "POST", "/clear?force=true&all_tiers=true", &extra);
        assert_eq!(code, 401, "{extra:?}: {body}");
        let error: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(error["error"], "Unauthorized");
        assert!(
            error["message"].as_str().unwrap().contains("Bearer"),
            "{body}"
        );
    }
    assert_eq!(
        svc.status().unwrap().values["l1_objects"],
        5,
        "nothing cleared"
    );
    let auth = format!("Authorization: Bearer {}\r\n", admin.token().as_str());
    let (code, body) = request_with(&admin, "POST", "/clear", &auth);
    assert_eq!(code, 200, "{body}");
    assert_eq!(svc.status().unwrap().values["l1_objects"], 0);
    drop(admin);
    assert_idle(&svc);
}

#[test]
fn the_admin_file_holds_url_and_token_0600_and_goes_on_stop() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("side.sock");
    let file = lmcache_rc_core::http::admin_file_for(&socket);
    let svc = Arc::new(CheckpointService::open(config("http-admin-file", None)).unwrap());
    let mut cfg = AdminConfig::new("127.0.0.1", 0);
    cfg.admin_file = Some(file.clone());
    let mut admin = HttpAdmin::start(cfg, svc.clone()).unwrap();
    assert_eq!(admin.admin_file(), Some(file.as_path()));
    let meta = std::fs::metadata(&file).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let held: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(held["url"], admin.url());
    assert_eq!(held["token"], admin.token().as_str());
    admin.stop();
    assert!(!file.exists(), "a clean stop removes the admin file");
    drop(admin);
    assert_idle(&svc);
}

/// A service whose `status` panics while `panicking` is set; everything
/// else is the real service.
struct PanickingStatus {
    inner: Arc<CheckpointService>,
    panicking: std::sync::atomic::AtomicBool,
}

impl lmcache_rc_core::protocol::Decorator for PanickingStatus {
    type Inner = CheckpointService;
    fn inner(&self) -> &CheckpointService {
        &self.inner
    }
    fn status(&self) -> lmcache_rc_core::Result<ServiceStatus> {
        if self.panicking.load(std::sync::atomic::Ordering::SeqCst) {
            panic!("injected: status panics");
        }
        self.inner.status()
    }
}

#[test]
fn a_request_that_panics_answers_500_and_the_server_keeps_serving() {
    let inner = Arc::new(CheckpointService::open(config("http-panic", None)).unwrap());
    let svc = Arc::new(PanickingStatus {
        inner: inner.clone(),
        panicking: std::sync::atomic::AtomicBool::new(true),
    });
    let admin = HttpAdmin::start(AdminConfig::new("127.0.0.1", 0), svc.clone()).unwrap();
    for path in ["/status", "/metrics", "/status"] {
        let (code, body) = request(&admin, "GET", path);
        assert_eq!(code, 500, "{body}");
        let error: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(error["error"], "Internal");
    }
    svc.panicking
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let (code, body) = request(&admin, "GET", "/status");
    assert_eq!(code, 200, "{body}");
    drop(admin);
    assert_idle(&inner);
}

#[test]
fn every_status_value_of_a_sidecar_has_a_described_series() {
    use lmcache_rc_core::metrics::{self, FAMILIES, Format};
    // The RPC server's status: the service's values and the RPC layer's.
    let rig = crate::rpc_common::rig("metrics-keys");
    let status = rig.server.status().unwrap();
    for key in status.values.keys() {
        assert!(metrics::series_of(key).is_some(), "{key} has no series");
    }
    let text = metrics::exposition(&status, Format::OpenMetrics).unwrap();
    assert!(!text.contains("has no description"), "{text}");
    for family in FAMILIES {
        let kind = match family.kind {
            metrics::Kind::Counter => "counter",
            metrics::Kind::Gauge => "gauge",
        };
        let line = format!("# TYPE {} {kind}", family.full_name());
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing from\n{text}"
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with(&family.sample_name()) && !l.starts_with('#')),
            "no sample of {}",
            family.full_name()
        );
    }
}
