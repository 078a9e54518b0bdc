//! Where a transfer job's time goes: each phase of a store and a restore job
//! (admission queue, checks, mapping, lease RPCs, lease validation, hand-over
//! to the copy thread, the copy, the finish RPC), per job and per page, for
//! 1, 64 and 1024 pages per job of 4 KiB, 256 KiB and 2 MiB, through a real
//! RPC server in this process, with one copy thread and one job at a time.
//! Next to each: a single-thread memcpy of the job's bytes and one RPC round
//! trip (`capabilities`), measured in the same run. Then the shape of
//! `lmcache-rc bench` (16 jobs of 64 × 256 KiB at once): first each copy
//! kernel alone (no RPC, no other thread), then through the engine.
//!
//! ```text
//! cargo run --release -p lmcache-rc-core --example transfer_breakdown [-- MAX_JOB_MIB]
//! ```
//!
//! With `BREAKDOWN_SERIAL=1` the bench shape submits each job only once the
//! one before it ended, so every copy runs with nothing beside it.
//!
//! MAX_JOB_MIB (default 2048) skips the configurations whose job is larger
//! (1024 × 2 MiB needs about 4 GiB: the page pool and the sidecar's pool).
//! Figures are medians over repeated jobs (more for small jobs); `per page`
//! is the job's time outside the copy divided by its pages. The last line
//! is the fixed per-job overhead: a one-page store and restore in µs and in
//! round trips (target ≤ 3; `docs/design/README.md#performance-targets`).
// A benchmark reports on stdout and stops at the first failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use lmcache_rc_core::protocol::Capabilities;
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::rpc::{Client, Server, ServerConfig};
use lmcache_rc_core::service::{CheckpointService, ServiceConfig};
use lmcache_rc_core::store::shm::ShmPool;
use lmcache_rc_core::transfer::{
    CopyBackend, CopyPlan, CpuBackend, Direction, EngineConfig, Job, JobPhases, LeaseApi,
    LeaseCall, PageCopy, PoolShape, ReplyHandle, StreamKernel, TransferEngine,
};
use lmcache_rc_core::{Manifest, TokenRoots, checkpoint_generation};

/// Lease RPCs sent so far: [lease phase (prepare_store, begin_retrieve,
/// poll_retrieve), finish phase (finish_*, cancel_retrieve)].
#[derive(Default)]
struct RpcCount([AtomicU64; 2]);

impl RpcCount {
    fn get(&self) -> [u64; 2] {
        [0, 1].map(|i| self.0[i].load(Ordering::Relaxed))
    }
}

/// The RPC client, counting the lease calls the engine sends through it.
struct Counting {
    client: Client,
    count: Arc<RpcCount>,
}

impl LeaseApi for Counting {
    fn share_pool(&self) -> lmcache_rc_core::Result<(Capabilities, OwnedFd)> {
        self.client.share_pool()
    }
    fn pool_id(&self) -> lmcache_rc_core::Result<String> {
        self.client.pool_id()
    }
    fn early_pool_id(&self) -> Option<String> {
        self.client.early_pool_id()
    }
    fn call(&self, call: LeaseCall) -> Box<dyn ReplyHandle> {
        let phase = match call {
            LeaseCall::PrepareStore { .. }
            | LeaseCall::BeginRetrieve { .. }
            | LeaseCall::PollRetrieve { .. } => 0,
            _ => 1,
        };
        self.count.0[phase].fetch_add(1, Ordering::Relaxed);
        LeaseApi::call(&self.client, call)
    }
}

const SIZES: [u64; 3] = [4 << 10, 256 << 10, 2 << 20];
const COUNTS: [u64; 3] = [1, 64, 1024];

fn manifest(seq: u32, pages: u64, page: u64) -> Manifest {
    let tokens: Vec<u32> = std::iter::once(seq).chain(0..pages as u32).collect();
    let roots = TokenRoots::build("bench-breakdown", tokens, 4096).expect("roots");
    let keys: Vec<String> = (1..=pages)
        .map(|n| roots.content_key(n, "attention:0").expect("key"))
        .collect();
    let payload = serde_json::json!({
        "schema_version": 2,
        "page_groups": [{"name": "engine-kv-group:0", "page_bytes": page,
                         "positions": (0..pages).collect::<Vec<_>>(), "content_keys": keys}],
    });
    let payload = serde_json::to_vec(&payload).expect("json");
    let prefix = roots.prefix(pages).expect("prefix");
    Manifest::new(checkpoint_generation(&prefix, &payload), prefix, 1, payload).expect("manifest")
}

fn pattern(i: usize) -> u8 {
    (i as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_shr(56) as u8
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Per-phase medians of a run of jobs.
fn medians(runs: &[JobPhases]) -> JobPhases {
    let m = |f: fn(&JobPhases) -> Duration| median(runs.iter().map(f).collect());
    JobPhases {
        queued: m(|p| p.queued),
        check: m(|p| p.check),
        map: m(|p| p.map),
        lease: m(|p| p.lease),
        plan: m(|p| p.plan),
        handoff: m(|p| p.handoff),
        copy: m(|p| p.copy),
        finish: m(|p| p.finish),
        total: m(|p| p.total),
    }
}

fn one_job(
    engine: &TransferEngine,
    rpcs: &RpcCount,
    m: &Manifest,
    direction: Direction,
    pages: u64,
) -> (JobPhases, [u64; 2]) {
    let job = Job {
        manifest: m.clone(),
        rank: 0,
        direction,
        block_ids: vec![(1..=pages).collect()],
        producer_event: None,
    };
    let before = rpcs.get();
    let h = engine.submit(job).expect("submit").expect("admitted");
    h.wait(None);
    assert_eq!(
        h.with_outcome(|o| o.succeeded()),
        Some(true),
        "a job failed"
    );
    let after = rpcs.get();
    (h.phases(), [after[0] - before[0], after[1] - before[1]])
}

/// The service's own share of a one-page job: each lease call made in
/// process (no RPC, no engine), median µs.
fn service_calls(svc: &Arc<CheckpointService>, seq: &mut u32, pages: u64) {
    let mut t = [(); 6].map(|_| Vec::new());
    for _ in 0..(3000 / pages).clamp(20, 300) {
        *seq += 1;
        let m = manifest(*seq, pages, 4 << 10);
        assert!(svc.begin(&m).expect("begin"));
        let mut lap = {
            let mut clock = Instant::now();
            move |v: &mut Vec<Duration>| {
                let now = Instant::now();
                v.push(now - clock);
                clock = now;
            }
        };
        let lease = svc.prepare_store(&m, 0).expect("prepare");
        lap(&mut t[0]);
        let id = lease.lease_id.expect("store lease id");
        assert!(svc.finish_store(&id, true, Some(0)).expect("finish"));
        lap(&mut t[1]);
        let mut lease = svc.begin_retrieve(&m, 0).expect("begin_retrieve");
        lap(&mut t[2]);
        let id = lease.lease_id.clone().expect("retrieve lease id");
        if lease.status == lmcache_rc_core::protocol::LeaseStatus::Pending {
            lease = svc.poll_retrieve(&id, Some(0)).expect("poll");
        }
        assert_eq!(lease.status, lmcache_rc_core::protocol::LeaseStatus::Ready);
        lap(&mut t[3]);
        svc.finish_retrieve(&id, Some(0)).expect("finish_retrieve");
        lap(&mut t[4]);
        // The same rank restores the same generation again (a hot prefix).
        let again = svc.begin_retrieve(&m, 0).expect("begin_retrieve again");
        lap(&mut t[5]);
        assert_eq!(again.status, lmcache_rc_core::protocol::LeaseStatus::Ready);
        svc.finish_retrieve(&again.lease_id.expect("lease id"), Some(0))
            .expect("finish_retrieve");
        svc.clear(false, true).expect("clear");
    }
    let [a, b, c, d, e, f] = t.map(median);
    println!(
        "service calls in process ({pages} x 4 KiB, median µs): prepare_store {:.1}, finish_store \
         {:.1} (publication), begin_retrieve {:.1}, poll until ready {:.1}, finish_retrieve {:.1}; \
         begin_retrieve of the same generation again {:.1}",
        us(a),
        us(b),
        us(c),
        us(d),
        us(e),
        us(f)
    );
}

/// A pool of `len` bytes on transparent huge pages where the kernel gives
/// them (as numpy's large arrays are, so the memcpy reference matches
/// `lmcache-rc bench`), filled with [`pattern`].
fn huge_pool(len: usize) -> Vec<u8> {
    let mut v: Vec<u8> = Vec::with_capacity(len);
    // SAFETY: advice only, on the vector's own (not yet touched) allocation.
    unsafe {
        libc::madvise(v.as_mut_ptr().cast(), len, libc::MADV_HUGEPAGE);
    }
    v.extend((0..len).map(pattern));
    v
}

/// The copy kernels alone, in the shape of [`pipelined`]: `CpuBackend::copy`
/// of 16 plans of 64 × 256 KiB each, one after another on this thread, no
/// RPC and no other thread, into and out of a pool of its own, with every
/// [`StreamKernel`] in turn (rounds alternate between them, so a busy moment
/// of the machine falls on all alike). Set beside the pipelined figures, the
/// detected kernel's line tells the copy's own speed from what running
/// inside the engine costs it (hand-over gaps, other threads on the cores);
/// the others tell whether the detection picked the fastest on this CPU.
fn kernel_alone(src: &mut [u8], dst: &mut [u8], per_job: u64, jobs: u64, page: u64) {
    let rows = jobs * per_job + 1;
    let pool = ShmPool::create(rows * page).expect("pool");
    let shape = PoolShape {
        num_blocks: rows,
        page_bytes: page,
    };
    let plans = |direction: Direction| -> Vec<CopyPlan> {
        (0..jobs)
            .map(|job| CopyPlan {
                direction,
                pages: (0..per_job)
                    .map(|p| PageCopy {
                        group: 0,
                        block: 1 + job * per_job + p,
                        shm_offset: (job * per_job + p) * page,
                        page_bytes: page,
                    })
                    .collect(),
                skipped: 0,
            })
            .collect()
    };
    let directions = [
        ("store  ", plans(Direction::Store)),
        ("restore", plans(Direction::Retrieve)),
    ];
    let kernels = StreamKernel::available();
    // Per kernel and direction: each copy's time, each round's wall time.
    let mut times = vec![[(Vec::new(), Vec::new()), (Vec::new(), Vec::new())]; kernels.len()];
    for round in 0..8 {
        for (k, kernel) in kernels.iter().copied().enumerate() {
            for (d, (_, plans)) in directions.iter().enumerate() {
                let buf: &mut [u8] = if d == 0 { &mut *src } else { &mut *dst };
                // SAFETY: `buf` outlives the backend (dropped at the end of
                // this iteration).
                let backend = unsafe { CpuBackend::new(buf.as_mut_ptr(), shape) }
                    .expect("backend")
                    .with_kernel(kernel);
                let t = Instant::now();
                for plan in plans {
                    let c = Instant::now();
                    assert!(backend.copy(plan, &pool, None).is_ok(), "copy failed");
                    if round > 0 {
                        times[k][d].0.push(c.elapsed());
                    }
                }
                if round > 0 {
                    times[k][d].1.push(t.elapsed());
                }
            }
        }
    }
    let mut memcpy = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(src);
        memcpy.push(t.elapsed());
    }
    dst.fill(0);
    println!(
        "copy kernels alone (CpuBackend::copy, {jobs} x {per_job} x 256 KiB, no RPC): memcpy of \
         the whole buffer {:.2} GB/s",
        (src.len() as f64) / median(memcpy).as_secs_f64() / 1e9
    );
    let job_bytes = (per_job * page) as f64;
    let all = (jobs * per_job * page) as f64;
    for (k, kernel) in kernels.iter().copied().enumerate() {
        let mark = if kernel == StreamKernel::detected() {
            " (this CPU's)"
        } else {
            ""
        };
        println!("  {}{mark}:", kernel.describe());
        for (d, (name, _)) in directions.iter().enumerate() {
            let (per_copy, walls) = std::mem::take(&mut times[k][d]);
            println!(
                "    {name}: {:6.2} GB/s (per copy p50 {:.2} GB/s)",
                all / median(walls).as_secs_f64() / 1e9,
                job_bytes / median(per_copy).as_secs_f64() / 1e9,
            );
        }
    }
}

/// When the first copy of `handles` began (after `t`), and for how long
/// at least one of them was copying: the rest of the wall time after the
/// first copy is time the copy slots stood idle (hand-overs between jobs,
/// the last finish).
fn copying(handles: &[lmcache_rc_core::transfer::JobHandle], t: Instant) -> (Duration, Duration) {
    let mut spans: Vec<(Instant, Instant)> = handles
        .iter()
        .map(|h| {
            let p = h.phases();
            let start = h.submitted() + p.queued + p.check + p.map + p.lease + p.plan + p.handoff;
            (start, start + p.copy)
        })
        .collect();
    spans.sort();
    let first = spans
        .first()
        .map_or(Duration::ZERO, |s| s.0.saturating_duration_since(t));
    let (mut busy, mut end) = (Duration::ZERO, None::<Instant>);
    for (s, e) in spans {
        let from = end.map_or(s, |end| s.max(end));
        busy += e.saturating_duration_since(from);
        end = Some(end.map_or(e, |end| end.max(e)));
    }
    (first, busy)
}

/// The shape of `lmcache-rc bench`: 16 jobs of 64 × 256 KiB submitted at
/// once, 1 and 2 copy threads; where the copy threads' time went.
fn pipelined(svc: &Arc<CheckpointService>, socket: &std::path::Path, seq: &mut u32) {
    const PAGE: u64 = 256 << 10;
    const PER_JOB: u64 = 64;
    const JOBS: u64 = 16;
    let rows = JOBS * PER_JOB + 1;
    let len = (rows * PAGE) as usize;
    let mut src = huge_pool(len);
    let mut dst = huge_pool(len);
    kernel_alone(&mut src, &mut dst, PER_JOB, JOBS, PAGE);
    for workers in [1usize, 2] {
        let shape = PoolShape {
            num_blocks: rows,
            page_bytes: PAGE,
        };
        let start = |pool: &mut Vec<u8>| {
            // SAFETY: the pools outlive the engines (dropped below, first).
            let backend =
                Arc::new(unsafe { CpuBackend::new(pool.as_mut_ptr(), shape) }.expect("backend"));
            let api: Box<dyn lmcache_rc_core::transfer::LeaseApi> =
                if std::env::var_os("BREAKDOWN_INPROC").is_some() {
                    Box::new(svc.clone())
                } else {
                    Box::new(Client::connect(socket).expect("connect"))
                };
            TransferEngine::start(
                api,
                backend,
                EngineConfig {
                    workers,
                    max_pending: 64,
                    ..EngineConfig::default()
                },
            )
            .expect("engine")
        };
        let (store, restore) = (start(&mut src), start(&mut dst));
        if workers == 1 {
            let stats = store.stats();
            println!(
                "shared-memory pool pages: {}; copy kernel: {}",
                stats.shm_pages.unwrap_or_default(),
                stats.copy_kernel
            );
        }
        let mut lines = Vec::new();
        let mut memcpy = Vec::new();
        for round in 0..4 {
            let manifests: Vec<Manifest> = (0..JOBS)
                .map(|_| {
                    *seq += 1;
                    let m = manifest(*seq, PER_JOB, PAGE);
                    assert!(svc.begin(&m).expect("begin"));
                    m
                })
                .collect();
            for (name, engine, direction) in [
                ("store  ", &store, Direction::Store),
                ("restore", &restore, Direction::Retrieve),
            ] {
                let t = Instant::now();
                let handles: Vec<_> = manifests
                    .iter()
                    .enumerate()
                    .map(|(k, m)| {
                        let first = 1 + k as u64 * PER_JOB;
                        let job = Job {
                            manifest: m.clone(),
                            rank: 0,
                            direction,
                            block_ids: vec![(first..first + PER_JOB).collect()],
                            producer_event: None,
                        };
                        let h = engine.submit(job).expect("submit").expect("admitted");
                        if std::env::var_os("BREAKDOWN_SERIAL").is_some() {
                            h.wait(None);
                        }
                        h
                    })
                    .collect();
                for h in &handles {
                    h.wait(None);
                    assert_eq!(h.with_outcome(|o| o.succeeded()), Some(true));
                }
                let wall = t.elapsed();
                if round > 0 {
                    let sum = |f: fn(&JobPhases) -> Duration| -> Duration {
                        handles.iter().map(|h| f(&h.phases())).sum()
                    };
                    lines.push((
                        name,
                        wall,
                        sum(|p| p.lease),
                        sum(|p| p.copy),
                        sum(|p| p.finish),
                        sum(|p| p.handoff),
                        copying(&handles, t),
                    ));
                }
            }
            svc.clear(false, true).expect("clear");
            let t = Instant::now();
            dst.copy_from_slice(&src);
            if round > 0 {
                memcpy.push(t.elapsed());
            }
            dst.fill(0);
        }
        drop(store);
        drop(restore);
        let memcpy = median(memcpy);
        let bytes = (JOBS * PER_JOB * PAGE) as f64;
        println!(
            "{JOBS} jobs x {PER_JOB} x 256 KiB at once, {workers} copy thread(s): memcpy of the \
             whole buffer {:.2} GB/s",
            (len as f64) / memcpy.as_secs_f64() / 1e9
        );
        for (name, wall, lease, copy, finish, handoff, (first, busy)) in lines {
            println!(
                "  {name}: {:6.2} GB/s ratio {:.3} | wall {:7.0} µs; summed over jobs: lease {:6.0} \
                 copy {:7.0} finish {:6.0} handoff {:7.0} µs | first copy at {:5.0} µs, no copy \
                 running for {:5.0} µs after it",
                bytes / wall.as_secs_f64() / 1e9,
                memcpy.as_secs_f64() * bytes / len as f64 / wall.as_secs_f64(),
                us(wall),
                us(lease),
                us(copy),
                us(finish),
                us(handoff),
                us(first),
                us(wall.saturating_sub(first + busy)),
            );
        }
    }
}

fn main() {
    let max_mib: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2048);
    let largest = SIZES
        .iter()
        .flat_map(|s| COUNTS.iter().map(move |c| s * c))
        .filter(|b| *b <= max_mib << 20)
        .max()
        .unwrap_or(0);
    let dir = tempfile::tempdir().expect("tempdir");
    let svc = Arc::new(
        CheckpointService::open(ServiceConfig {
            l1_bytes: largest.max(256 << 20) + (16 << 20),
            ..ServiceConfig::default()
        })
        .expect("service"),
    );
    let server =
        Server::start(svc.clone(), ServerConfig::new(dir.path().join("s.sock"))).expect("server");
    let socket = server.socket_path().to_path_buf();
    let probe = Client::connect(&socket).expect("connect");
    let mut rtt = Vec::new();
    for _ in 0..2000 {
        let t = Instant::now();
        probe.capabilities().expect("capabilities");
        rtt.push(t.elapsed());
    }
    let rtt = median(rtt);
    println!(
        "transfer breakdown: 1 copy thread, one job at a time, real RPC server in process; \
         RPC round trip (capabilities) p50 {:.1} µs",
        us(rtt)
    );
    let mut seq = 0u32;
    for pages in [1, 1024] {
        service_calls(&svc, &mut seq, pages);
    }
    if std::env::var_os("BREAKDOWN_SERVICE_ONLY").is_some() {
        return;
    }
    println!(
        "µs per job (median):   queued  check    map  lease   plan handoff     copy finish    total | \
         copy GB/s memcpy GB/s | per page µs | RPCs lease+finish"
    );
    // (store, restore) totals of the one-page 4 KiB job.
    let mut one_page = None;
    for page in SIZES {
        for pages in COUNTS {
            let bytes = page * pages;
            if bytes > max_mib << 20 {
                println!(
                    "{pages:>5} x {:>4} KiB: skipped (> {max_mib} MiB)",
                    page >> 10
                );
                continue;
            }
            let rows = pages + 1;
            let len = (rows * page) as usize;
            let mut pool: Vec<u8> = (0..len).map(pattern).collect();
            let mut scratch = vec![0u8; bytes as usize];
            let reps = ((512u64 << 20) / bytes).clamp(5, 300) as usize;
            let shape = PoolShape {
                num_blocks: rows,
                page_bytes: page,
            };
            // SAFETY: `pool` outlives the engine (dropped at the end of this
            // iteration, before the pool).
            let backend =
                Arc::new(unsafe { CpuBackend::new(pool.as_mut_ptr(), shape) }.expect("backend"));
            let rpcs = Arc::new(RpcCount::default());
            let engine = TransferEngine::start(
                Box::new(Counting {
                    client: Client::connect(&socket).expect("connect"),
                    count: rpcs.clone(),
                }),
                backend,
                EngineConfig {
                    workers: 1,
                    ..EngineConfig::default()
                },
            )
            .expect("engine");
            let (mut st, mut rt, mut mc) = (Vec::new(), Vec::new(), Vec::new());
            // Lease RPCs per job: [store, restore] x [lease phase, finish phase].
            let mut counts = [[0u64; 2]; 2];
            // Round trips interleaved with the jobs, for the per-job figure.
            let mut near = Vec::new();
            for rep in 0..=reps {
                seq += 1;
                let m = manifest(seq, pages, page);
                assert!(svc.begin(&m).expect("begin"));
                let (s, sc) = one_job(&engine, &rpcs, &m, Direction::Store, pages);
                let t = Instant::now();
                probe.capabilities().expect("capabilities");
                near.push(t.elapsed());
                let (r, rc) = one_job(&engine, &rpcs, &m, Direction::Retrieve, pages);
                counts = [sc, rc];
                svc.clear(false, true).expect("clear");
                let t = Instant::now();
                scratch.copy_from_slice(&pool[page as usize..]);
                let c = t.elapsed();
                if rep > 0 {
                    st.push(s);
                    rt.push(r);
                    mc.push(c);
                }
            }
            drop(engine);
            assert!(
                pool.iter().enumerate().all(|(i, &b)| b == pattern(i)),
                "restored bytes differ"
            );
            let memcpy = median(mc);
            if pages == 1 && page == SIZES[0] {
                one_page = Some((medians(&st).total, medians(&rt).total, median(near), counts));
            }
            for (name, runs, [lease_rpcs, finish_rpcs]) in
                [("store  ", st, counts[0]), ("restore", rt, counts[1])]
            {
                let p = medians(&runs);
                let gbs = |d: Duration| bytes as f64 / d.as_secs_f64() / 1e9;
                println!(
                    "{pages:>5} x {:>4} KiB {name}: {:6.1} {:6.1} {:6.1} {:6.1} {:6.1} {:7.1} {:8.1} {:6.1} {:8.1} | {:9.2} {:11.2} | {:8.3} | {lease_rpcs}+{finish_rpcs}",
                    page >> 10,
                    us(p.queued),
                    us(p.check),
                    us(p.map),
                    us(p.lease),
                    us(p.plan),
                    us(p.handoff),
                    us(p.copy),
                    us(p.finish),
                    us(p.total),
                    gbs(p.copy),
                    gbs(memcpy),
                    us(p.total.saturating_sub(p.copy)) / pages as f64,
                );
            }
        }
    }
    pipelined(&svc, &socket, &mut seq);
    println!("RPC round trip p50: {:.1} µs", us(rtt));
    if let Some((store, restore, near, [sc, rc])) = one_page {
        println!(
            "one-page job (4 KiB, submit to end): store {:.1} µs = {:.1} round trips ({} RPCs), \
             restore {:.1} µs = {:.1} round trips ({} RPCs) (target <= 3; round trip p50 {:.1} µs \
             measured between those jobs)",
            us(store),
            us(store) / us(near),
            sc[0] + sc[1],
            us(restore),
            us(restore) / us(near),
            rc[0] + rc[1],
            us(near)
        );
    }
    server.shutdown().expect("shutdown");
}
