#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]
use std::sync::Arc;
use std::time::{Duration, Instant};
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::rpc::{Client, Server, ServerConfig};
use lmcache_rc_core::service::{CheckpointService, ServiceConfig};
use lmcache_rc_core::transfer::{CpuBackend, Direction, EngineConfig, Job, PoolShape, TransferEngine};
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
fn median(mut v: Vec<Duration>) -> f64 { v.sort(); v[v.len()/2].as_secs_f64()*1e6 }
fn main() {
    let n: u32 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(5000);
    let gap: u64 = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(0);
    let dir = tempfile::tempdir().unwrap();
    let svc = Arc::new(CheckpointService::open(ServiceConfig { l1_bytes: 256 << 20, ..ServiceConfig::default() }).unwrap());
    let server = Server::start(svc.clone(), ServerConfig::new(dir.path().join("s.sock"))).unwrap();
    let mut pool: Vec<u8> = vec![7u8; 2 * 4096];
    let backend = Arc::new(unsafe { CpuBackend::new(pool.as_mut_ptr(), PoolShape { num_blocks: 2, page_bytes: 4096 }) }.unwrap());
    let engine = TransferEngine::start(Box::new(Client::connect(server.socket_path()).unwrap()), backend, EngineConfig { workers: 1, ..EngineConfig::default() }).unwrap();
    let probe = Client::connect(server.socket_path()).unwrap();
    let ms: Vec<Manifest> = (0..n).map(|i| manifest(i, 1, 4096)).collect();
    let (mut st, mut rt, mut near) = (Vec::new(), Vec::new(), Vec::new());
    for m in &ms {
        assert!(svc.begin(m).unwrap());
        for d in [Direction::Store, Direction::Retrieve] {
            if gap > 0 { std::thread::sleep(Duration::from_micros(gap)); }
            let h = engine.submit(Job { manifest: m.clone(), rank: 0, direction: d, block_ids: vec![vec![1]], producer_event: None }).unwrap().unwrap();
            h.wait(None);
            assert_eq!(h.with_outcome(|o| o.succeeded()), Some(true));
            if d == Direction::Store { st.push(h.phases()) } else { rt.push(h.phases()) }
            if gap > 0 { std::thread::sleep(Duration::from_micros(gap)); }
            let t = Instant::now(); probe.capabilities().unwrap(); near.push(t.elapsed());
        }
        if m.generation().as_bytes()[0] == b'0' && m.generation().as_bytes()[1] == b'0' { svc.clear(false, true).unwrap(); }
    }
    let ph = |v: &Vec<lmcache_rc_core::transfer::JobPhases>, name: &str| {
        let m = |f: fn(&lmcache_rc_core::transfer::JobPhases) -> Duration| median(v.iter().map(f).collect());
        println!("{name}: queued {:.1} check {:.1} map {:.1} lease {:.1} plan {:.1} handoff {:.1} copy {:.1} finish {:.1} total {:.1}", m(|p| p.queued), m(|p| p.check), m(|p| p.map), m(|p| p.lease), m(|p| p.plan), m(|p| p.handoff), m(|p| p.copy), m(|p| p.finish), m(|p| p.total));
    };
    ph(&st, "store"); ph(&rt, "restore");
    let st: Vec<Duration> = st.iter().map(|p| p.total).collect();
    let rt: Vec<Duration> = rt.iter().map(|p| p.total).collect();
    let (s, r, q) = (median(st), median(rt), median(near));
    println!("store {s:.1} us = {:.2} RTT, restore {r:.1} us = {:.2} RTT, RTT {q:.1} us", s/q, r/q);
    drop(engine);
}
