//! RPC round-trip latency against a raw Unix-socket ping-pong of the same
//! frame sizes, measured in the same run (target: p50 ≤ 3 × raw;
//! `docs/design/README.md#performance-targets`).
//!
//! ```text
//! cargo run --release -p lmcache-rc-core --example rpc_bench [-- ROUNDS GENERATIONS]
//! ```
//!
//! Measures a no-op (`capabilities`), `status`, and `find` on a directory of
//! GENERATIONS (default 10 000) published generations, each against a raw
//! ping-pong whose request and reply frames have exactly the RPC frames'
//! sizes (one thread writes, reads the reply, repeats; the echo side reads a
//! frame and writes a frame). The in-process `find` shows the lookup's own
//! cost. Rounds are interleaved in blocks so drift affects both sides alike.
//! The no-op is measured again with a 200 µs idle pause before each call
//! (how a transfer job's lease calls arrive), where every thread wake-up of
//! a round trip shows.
// A benchmark reports on stdout and stops at the first failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::rpc::wire::{self, Reply, Request, Value, WireManifest, WirePrefix};
use lmcache_rc_core::rpc::{Client, Server, ServerConfig};
use lmcache_rc_core::service::{CheckpointService, LeaseStatus, ServiceConfig};
use lmcache_rc_core::{Manifest, Prefix, TokenRoots, checkpoint_generation};

const NS: &str = "recurrent-sha256-v1:rpc-bench";
const BLOCK: usize = 500;

fn manifest(i: u32) -> Manifest {
    let tokens: Vec<u32> = (0..48).map(|t| i * 1000 + t).collect();
    let roots = TokenRoots::build(NS, tokens.clone(), 4096).expect("roots");
    let n = tokens.len() as u64;
    let key = roots.content_key(n, "state:0").expect("key");
    let payload = serde_json::json!({
        "schema_version": 2,
        "kind": "prompt",
        "draft_prefix_len": 0,
        "page_groups": [{"name": "state", "page_bytes": 4096, "positions": [0],
                         "content_keys": [key]}],
    });
    let payload = serde_json::to_vec(&payload).expect("json");
    let prefix = roots.prefix(n).expect("prefix");
    Manifest::new(checkpoint_generation(&prefix, &payload), prefix, 1, payload).expect("manifest")
}

/// The roots of a longer sequence whose 48-token prefix is generation `i`.
fn query(i: u32) -> Vec<Prefix> {
    let tokens: Vec<u32> = (0..80).map(|t| i * 1000 + t).collect();
    let roots = TokenRoots::build(NS, tokens, 4096).expect("roots");
    roots.roots()
}

fn populate(svc: &CheckpointService, generations: u32) {
    let t = Instant::now();
    for i in 0..generations {
        let m = manifest(i);
        assert!(svc.begin(&m).expect("begin"));
        let lease = svc.prepare_store(&m, 0).expect("prepare");
        assert_eq!(lease.status, LeaseStatus::Ready);
        let id = lease.lease_id.expect("lease id");
        assert!(svc.finish_store(&id, true, None).expect("finish"));
    }
    println!(
        "populated {generations} generations in {:.1} s",
        t.elapsed().as_secs_f64()
    );
}

/// An echo peer: reads a frame, answers with a frame of `reply` bytes.
fn echo_server(listener: UnixListener, reply: Vec<u8>) {
    std::thread::spawn(move || {
        while let Ok((mut s, _)) = listener.accept() {
            let reply = reply.clone();
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                loop {
                    let mut len = [0u8; 4];
                    if s.read_exact(&mut len).is_err() {
                        return;
                    }
                    buf.resize(u32::from_le_bytes(len) as usize, 0);
                    if s.read_exact(&mut buf).is_err() || s.write_all(&reply).is_err() {
                        return;
                    }
                }
            });
        }
    });
}

struct Raw {
    stream: UnixStream,
    request: Vec<u8>,
    reply_len: usize,
    buf: Vec<u8>,
}

impl Raw {
    fn new(dir: &Path, name: &str, request: Vec<u8>, reply: Vec<u8>) -> Raw {
        let path = dir.join(name);
        let reply_len = reply.len();
        echo_server(UnixListener::bind(&path).expect("bind"), reply);
        Raw {
            stream: UnixStream::connect(&path).expect("connect"),
            request,
            reply_len,
            buf: vec![0; reply_len],
        }
    }
    fn once(&mut self) {
        self.stream.write_all(&self.request).expect("write");
        self.stream
            .read_exact(&mut self.buf[..self.reply_len])
            .expect("read");
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn timed(samples: &mut Vec<Duration>, mut f: impl FnMut()) {
    let t = Instant::now();
    f();
    samples.push(t.elapsed());
}

struct Row {
    name: &'static str,
    req: usize,
    rep: usize,
    rpc: (f64, f64),
    raw: (f64, f64),
}

fn stats(mut v: Vec<Duration>) -> (f64, f64) {
    v.sort();
    (percentile(&v, 0.5), percentile(&v, 0.99))
}

fn measure(
    name: &'static str,
    rounds: usize,
    (req, rep): (usize, usize),
    raw: &mut Raw,
    gap: Duration,
    mut rpc: impl FnMut(usize),
) -> Row {
    let pause = || {
        if !gap.is_zero() {
            std::thread::sleep(gap);
        }
    };
    for i in 0..BLOCK {
        raw.once();
        rpc(i);
    }
    let (mut a, mut b) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    let mut i = 0;
    while a.len() < rounds {
        for _ in 0..BLOCK {
            pause();
            timed(&mut a, || raw.once());
        }
        for _ in 0..BLOCK {
            pause();
            timed(&mut b, || rpc(i));
            i += 1;
        }
    }
    Row {
        name,
        req,
        rep,
        rpc: stats(b),
        raw: stats(a),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let generations: u32 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(10_000);
    let dir = tempfile::tempdir().expect("tempdir");
    let svc = CheckpointService::open(ServiceConfig {
        l1_bytes: (u64::from(generations) * 4096 + (8 << 20)).next_multiple_of(4096),
        max_entries: u64::from(generations) * 2,
        ..ServiceConfig::default()
    })
    .expect("service");
    populate(&svc, generations);
    let svc = Arc::new(svc);
    let server =
        Server::start(svc.clone(), ServerConfig::new(dir.path().join("rpc.sock"))).expect("server");
    let client = Client::connect(server.socket_path()).expect("client");
    let max = wire::DEFAULT_MAX_FRAME;

    let caps_req = wire::encode_request(1, &Request::Capabilities {}, max).expect("encode");
    let caps_rep = wire::encode_reply(1, &Reply::Ok(Value::Capabilities(svc.capabilities())), max)
        .expect("encode");
    let status_req = wire::encode_request(1, &Request::Status {}, max).expect("encode");
    let status_rep = wire::encode_reply(
        1,
        &Reply::Ok(Value::Status(server.status().expect("status"))),
        max,
    )
    .expect("encode");
    let probe = query(generations / 2);
    let find_req = wire::encode_request(
        1,
        &Request::Find {
            roots: probe.iter().map(WirePrefix::from).collect(),
        },
        max,
    )
    .expect("encode");
    let found = svc.find(&probe).expect("find").expect("a hit");
    let find_rep = wire::encode_reply(
        1,
        &Reply::Ok(Value::Manifest(Some(WireManifest::from(&found)))),
        max,
    )
    .expect("encode");

    let queries: Vec<Vec<Prefix>> = (0..997).map(|k| query((k * 7919) % generations)).collect();
    let mut rows = Vec::new();
    let sizes = |a: &Vec<u8>, b: &Vec<u8>| (a.len(), b.len());
    let mut raw = Raw::new(dir.path(), "raw1.sock", caps_req.clone(), caps_rep.clone());
    rows.push(measure(
        "capabilities (no-op)",
        rounds,
        sizes(&caps_req, &caps_rep),
        &mut raw,
        Duration::ZERO,
        |_| {
            client.capabilities().expect("capabilities");
        },
    ));
    // Each call after an idle pause, as a transfer job's lease calls come:
    // the threads involved are asleep (on a virtual machine an idle CPU may
    // halt), so every thread wake-up of a round trip shows.
    rows.push(measure(
        "no-op after 200 µs idle",
        (rounds / 10).max(BLOCK),
        sizes(&caps_req, &caps_rep),
        &mut raw,
        Duration::from_micros(200),
        |_| {
            client.capabilities().expect("capabilities");
        },
    ));
    let mut raw = Raw::new(
        dir.path(),
        "raw2.sock",
        status_req.clone(),
        status_rep.clone(),
    );
    rows.push(measure(
        "status",
        rounds,
        sizes(&status_req, &status_rep),
        &mut raw,
        Duration::ZERO,
        |_| {
            client.status().expect("status");
        },
    ));
    let mut raw = Raw::new(dir.path(), "raw3.sock", find_req.clone(), find_rep.clone());
    rows.push(measure(
        "find (hit, 10k listed)",
        rounds,
        sizes(&find_req, &find_rep),
        &mut raw,
        Duration::ZERO,
        |i| {
            let hit = client.find(&queries[i % queries.len()]).expect("find");
            assert!(hit.is_some());
        },
    ));
    // The lookup's own cost, in process.
    let mut local = Vec::with_capacity(rounds);
    for i in 0..rounds {
        timed(&mut local, || {
            svc.find(&queries[i % queries.len()]).expect("find");
        });
    }
    let local = stats(local);
    let mut local_status = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        timed(&mut local_status, || {
            server.status().expect("status");
        });
    }
    let local_status = stats(local_status);

    println!(
        "rpc_bench: {rounds} round trips each, {generations} listed generations, one client thread"
    );
    println!(
        "{:<24} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9}",
        "operation",
        "req B",
        "reply B",
        "rpc p50",
        "rpc p99",
        "raw p50",
        "raw p99",
        "p50 ×raw",
        "p99 ×raw"
    );
    for r in &rows {
        println!(
            "{:<24} {:>9} {:>9} {:>8.1}µs {:>8.1}µs {:>8.1}µs {:>8.1}µs {:>9.2} {:>9.2}",
            r.name,
            r.req,
            r.rep,
            r.rpc.0,
            r.rpc.1,
            r.raw.0,
            r.raw.1,
            r.rpc.0 / r.raw.0,
            r.rpc.1 / r.raw.1
        );
    }
    println!(
        "{:<24} {:>9} {:>9} {:>8.1}µs {:>8.1}µs   (service.find in process, no RPC)",
        "find in process", "-", "-", local.0, local.1
    );
    println!(
        "{:<24} {:>9} {:>9} {:>8.1}µs {:>8.1}µs   (server.status in process, no RPC)",
        "status in process", "-", "-", local_status.0, local_status.1
    );
    let noop = &rows[0];
    let ratio = noop.rpc.0 / noop.raw.0;
    println!(
        "target: no-op RPC p50 <= 3.0 x raw ping-pong: {ratio:.2} x -> {}",
        if ratio <= 3.0 { "PASS" } else { "FAIL" }
    );
    drop(client);
    server.shutdown().expect("shutdown");
}
