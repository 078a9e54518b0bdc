#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]
use std::sync::Arc;
use std::time::Instant;
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::service::{CheckpointService, ServiceConfig};
use lmcache_rc_core::{Manifest, TokenRoots, checkpoint_generation};

fn manifest(seq: u32, pages: u64, page: u64) -> Manifest {
    let tokens: Vec<u32> = std::iter::once(seq).chain(0..pages as u32).collect();
    let roots = TokenRoots::build("bench-breakdown", tokens, 4096).expect("roots");
    let keys: Vec<String> = (1..=pages).map(|n| roots.content_key(n, "attention:0").expect("key")).collect();
    let payload = serde_json::json!({"schema_version": 2, "page_groups": [{"name": "engine-kv-group:0", "page_bytes": page, "positions": (0..pages).collect::<Vec<_>>(), "content_keys": keys}]});
    let payload = serde_json::to_vec(&payload).expect("json");
    let prefix = roots.prefix(pages).expect("prefix");
    Manifest::new(checkpoint_generation(&prefix, &payload), prefix, 1, payload).expect("manifest")
}
fn main() {
    let svc = Arc::new(CheckpointService::open(ServiceConfig { l1_bytes: 256 << 20, ..ServiceConfig::default() }).unwrap());
    let n: u32 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(20000);
    let ms: Vec<Manifest> = (0..n).map(|i| manifest(i, 1, 4096)).collect();
    let (mut tp, mut tf, mut tb, mut tr) = (0f64, 0f64, 0f64, 0f64);
    for m in &ms {
        assert!(svc.begin(m).unwrap());
        let t = Instant::now();
        let l = svc.prepare_store(m, 0).unwrap();
        tp += t.elapsed().as_secs_f64();
        let t = Instant::now();
        svc.finish_store(l.lease_id.as_deref().unwrap(), true, Some(0)).unwrap();
        tf += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let l = svc.begin_retrieve(m, 0).unwrap();
        tb += t.elapsed().as_secs_f64();
        let t = Instant::now();
        svc.finish_retrieve(l.lease_id.as_deref().unwrap(), Some(0)).unwrap();
        tr += t.elapsed().as_secs_f64();
        if m.generation().as_bytes()[0] == b'0' { svc.clear(false, true).unwrap(); }
    }
    let k = 1e6 / n as f64;
    println!("prepare {:.2} finish_store {:.2} begin_retrieve {:.2} finish_retrieve {:.2} us", tp*k, tf*k, tb*k, tr*k);
}
