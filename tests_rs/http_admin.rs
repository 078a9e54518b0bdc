//! The HTTP admin API: status JSON, Prometheus metrics, clear semantics.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use lmcache_rc_core::http::{HttpAdmin, route};
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::service::{CheckpointService, LeaseStatus};

use crate::service_common::*;

fn request(admin: &HttpAdmin, method: &str, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(admin.local_addr()).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
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
    let admin = HttpAdmin::start("127.0.0.1", 0, svc.clone()).unwrap();
    assert!(admin.local_addr().ip().is_loopback());
    let (code, body) = request(&admin, "GET", "/status");
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["generations"], 1);
    assert_eq!(status["l1_objects"], 5);
    assert!(status["misses"].is_object());
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
        if name == "lmcache_rc_generations" {
            assert_eq!(value, "1");
        }
        seen += 1;
    }
    assert!(seen >= 10, "{body}");
    assert!(body.trim_end().ends_with("# EOF"));
    assert_eq!(request(&admin, "GET", "/nope").0, 404);
    assert_eq!(request(&admin, "GET", "/clear").0, 405);
    assert_eq!(request(&admin, "POST", "/clear?force=maybe").0, 400);
    drop(admin);
    assert_idle(&svc);
}

#[test]
fn forced_clear_is_refused_with_409_while_a_lease_is_live() {
    let svc = Arc::new(CheckpointService::open(config("http-clear", None)).unwrap());
    let m = manifest(&(0..30).collect::<Vec<u32>>(), 1, 4096, 16);
    assert!(svc.begin(&m).unwrap());
    let lease = svc.prepare_store(&m, 0).unwrap();
    assert_eq!(lease.status, LeaseStatus::Ready);
    let (code, _, body) = route("POST", "/clear?force=true", &*svc);
    assert_eq!(code, 409, "{body}");
    let (code, _, body) = route("POST", "/clear?force=false", &*svc);
    assert_eq!(code, 200, "{body}");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
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
    let (code, _, _) = route("POST", "/clear?force=true&all_tiers=true", &*svc);
    assert_eq!(code, 200);
    assert_eq!(svc.status().unwrap().values["l1_objects"], 0);
    assert_idle(&svc);
}
