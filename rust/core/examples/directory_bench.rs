//! Checkpoint directory benchmark: publication rate (below and at capacity),
//! durable marking rate and `find` latency at 10k and 100k published
//! generations, each next to raw SQLite baselines measured in the same run on
//! a file of the same settings (WAL, 32 MiB page cache):
//!
//! * raw insert+commit of the same rows (a `checkpoints` row and its
//!   `checkpoint_tails` row, same schema and indexes, plain SQL, no directory
//!   logic) with `synchronous=NORMAL` — no fsync at commit, "committed the
//!   same way" as a publication — twice: with SQLite's default auto-checkpoint
//!   (every 1,000 log pages, inline, with its two fsyncs) and with no
//!   checkpoint at all (the bare cost of the inserts and the commit; the
//!   strictest baseline, which the 0.7 target is judged against);
//! * raw insert+commit of one key/payload row into a two-column table (the
//!   cheapest possible insert; the baseline earlier versions printed), with
//!   `synchronous=NORMAL` and with `synchronous=FULL` (one WAL fsync per
//!   commit: what every publication cost when it waited for an fsync);
//! * a raw indexed point lookup next to `find`.
//!
//! Targets (`docs/design/README.md#performance-targets`): publications/s at 100k ≥ 0.7 × raw
//! un-synced insert+commit of the same rows and ≥ 20 × 78/s; the at-capacity
//! rate within 20 % of the below-capacity rate; durable marking ≥ 1,000
//! generations/s; find p99 ≤ 3 × a raw point lookup.
//!
//! ```text
//! cargo run --release -p lmcache-rc-core --example directory_bench -- [--quick] [--keep DIR]
//! directory_bench --find PATH QUERIES   # Rust find p50/p99 over a query file
//! ```
//!
//! `--keep DIR` leaves each size's directory file (`DIR/n<N>.sqlite3`) and a
//! query file (`DIR/n<N>.queries`: per query a u32 token count, then the
//! tokens, little-endian) so `ci/bench_directory.py` can time the Python
//! `find` on the same directory against `--find` (the Rust `find` of the same
//! file and queries, run as a subprocess in the same bench run).
//!
//! The first N − M generations are bulk-loaded into a reference-layout file
//! (`checkpoints` only, as an older build leaves it) so the run fits in a few
//! minutes; opening the directory reconciles them (timed). The last M
//! generations are published through the API, one SQLite commit each.
// A benchmark reports on stdout and stops at the first failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::hint::black_box;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lmcache_rc_core::index::{Directory, DirectoryConfig, tail_text};
use lmcache_rc_core::{Manifest, Prefix, TokenRoots, checkpoint_generation};
use rusqlite::{Connection, params};

const NS: &str = "recurrent-sha256-v1:benchmark-namespace";
/// Hash chunk of the query roots (the identity default).
const CHUNK: u32 = 4096;

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Tokens of sequence `i`: 16..=63 pseudo-random ids.
fn tokens(i: u64) -> Vec<u32> {
    let len = 16 + (mix(i) % 48) as usize;
    (0..len as u64)
        .map(|j| (mix(i * 1000 + j) % (1 << 31)) as u32)
        .collect()
}

/// A schema-2 payload with four content-keyed pages (about 600 bytes).
fn payload(i: u64) -> Vec<u8> {
    let keys: Vec<String> = (0..4u64)
        .map(|p| {
            format!(
                "\"{:016x}{:016x}{:016x}{:016x}\"",
                mix(i ^ p),
                mix(i + p + 1),
                mix(i * 3 + p),
                mix(i * 7 + p)
            )
        })
        .collect();
    format!(
        r#"{{"draft_prefix_len":0,"kind":"prompt","page_groups":[{{"content_keys":[{}],"name":"engine-kv-group:0","page_bytes":65536,"positions":[0,1,2,3]}}],"schema_version":2,"worker_layout":{{"page_bytes":65536}}}}"#,
        keys.join(",")
    )
    .into_bytes()
}

fn entry(i: u64) -> Manifest {
    let t = tokens(i);
    let roots = TokenRoots::build(NS, t.clone(), CHUNK).expect("roots");
    let prefix = roots.prefix(t.len() as u64).expect("prefix");
    let payload = payload(i);
    let generation = checkpoint_generation(&prefix, &payload);
    Manifest::new(generation, prefix, 1, payload).expect("manifest")
}

/// Query tokens for sequence `i`: its tokens plus 8 more (one root).
fn query_tokens(i: u64) -> Vec<u32> {
    let mut t = tokens(i);
    t.extend((0..8).map(|j| (mix(i ^ (j << 40)) % (1 << 31)) as u32));
    t
}

/// Query tokens of a long prompt: sequence `i`'s tokens extended to 2k..20k
/// tokens (one to five roots), as the scheduler asks for real prompts.
fn long_query_tokens(i: u64) -> Vec<u32> {
    let mut t = tokens(i);
    let len = 2_048 + (mix(i ^ 0x5eed) % 18_433) as usize;
    let mut j = 0u64;
    while t.len() < len {
        t.push((mix(i.wrapping_mul(31) ^ (j << 32) ^ 0xface) % (1 << 31)) as u32);
        j += 1;
    }
    t
}

fn open_raw(path: &Path, synchronous: &str) -> Connection {
    let conn = Connection::open(path).expect("open raw");
    conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get::<_, String>(0))
        .expect("wal");
    conn.execute_batch(&format!(
        "PRAGMA synchronous={synchronous}; PRAGMA cache_size=-32768"
    ))
    .expect("sync");
    conn
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Bulk-loads generations `0..n` into a reference-layout file.
fn bulk_reference_file(path: &Path, n: u64) {
    let mut conn = open_raw(path, "FULL");
    conn.execute_batch(
        "CREATE TABLE checkpoints (namespace TEXT NOT NULL, start_tokens INTEGER NOT NULL,
            prefix_hash BLOB NOT NULL, tail BLOB NOT NULL, num_tokens INTEGER NOT NULL,
            generation TEXT UNIQUE NOT NULL, world_size INTEGER NOT NULL,
            payload BLOB NOT NULL, access_order INTEGER NOT NULL,
            PRIMARY KEY (namespace, start_tokens, prefix_hash, tail));
         CREATE INDEX checkpoints_access_order ON checkpoints (access_order);",
    )
    .expect("schema");
    let tx = conn.transaction().expect("tx");
    {
        let mut stmt = tx
            .prepare("INSERT INTO checkpoints VALUES (?1, ?2, ?3, ?4, ?5, ?6, 1, ?7, ?8)")
            .expect("prepare");
        for i in 0..n {
            let m = entry(i);
            let p = m.prefix();
            stmt.execute(params![
                p.namespace(),
                p.start_tokens() as i64,
                p.prefix_hash(),
                tail_text(p.tail_tokens()).into_bytes(),
                p.num_tokens() as i64,
                m.generation(),
                m.payload(),
                i as i64 + 1
            ])
            .expect("insert");
        }
    }
    tx.commit().expect("commit");
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .expect("checkpoint");
}

/// Key of raw row `i`.
fn raw_key(i: u64) -> [u8; 32] {
    let mut k = [0u8; 32];
    for (c, chunk) in k.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&mix(i * 4 + c as u64).to_le_bytes());
    }
    k
}

/// A raw key/value table of `n` rows with the same payloads.
fn bulk_raw_table(conn: &mut Connection, n: u64) {
    conn.execute_batch("CREATE TABLE t (k BLOB PRIMARY KEY, payload BLOB NOT NULL)")
        .expect("raw schema");
    let tx = conn.transaction().expect("tx");
    {
        let mut stmt = tx
            .prepare("INSERT INTO t VALUES (?1, ?2)")
            .expect("prepare");
        for i in 0..n {
            stmt.execute(params![&raw_key(i)[..], payload(i)])
                .expect("insert");
        }
    }
    tx.commit().expect("commit");
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .expect("checkpoint");
}

/// A file in the directory's own format with generations `0..n` (bulk-loaded
/// reference layout, reconciled by one open), for the same-rows baseline.
fn same_rows_file(path: &Path, n: u64) -> Connection {
    bulk_reference_file(path, n);
    Directory::open(Some(path), DirectoryConfig::default())
        .expect("open")
        .close()
        .expect("close");
    open_raw(path, "NORMAL")
}

/// One raw insert+commit of generation `m`'s two rows (what a publication
/// writes, without the directory's checks, replacement and capacity logic).
fn raw_same_commit(raw: &Connection, m: &Manifest, stamp: i64) {
    let p = m.prefix();
    let tail = tail_text(p.tail_tokens());
    raw.execute("BEGIN IMMEDIATE", []).expect("begin");
    raw.prepare_cached(
        "INSERT INTO checkpoints (namespace, start_tokens, prefix_hash, tail, num_tokens, \
         generation, world_size, payload, access_order) VALUES (?1, ?2, ?3, ?4, ?5, ?6, 1, ?7, ?8)",
    )
    .expect("prepare")
    .execute(params![
        p.namespace(),
        p.start_tokens() as i64,
        p.prefix_hash(),
        tail.as_bytes(),
        p.num_tokens() as i64,
        m.generation(),
        m.payload(),
        stamp
    ])
    .expect("insert");
    raw.prepare_cached(
        "INSERT INTO checkpoint_tails (generation, namespace, start_tokens, prefix_hash, \
         tail_hash, tail_len, payload_bytes, durable) VALUES (?1, ?2, ?3, ?4, ?5, ?6, 0, 0)",
    )
    .expect("prepare")
    .execute(params![
        m.generation(),
        p.namespace(),
        p.start_tokens() as i64,
        p.prefix_hash(),
        lmcache_rc_core::index::tail_hash(p.tail_tokens()) as i64,
        p.tail_tokens().len() as i64
    ])
    .expect("insert");
    raw.execute("COMMIT", []).expect("commit");
}

/// One raw single-row insert+commit of row `i`.
fn raw_commit(raw: &Connection, i: u64) {
    raw.execute("BEGIN IMMEDIATE", []).expect("begin");
    raw.prepare_cached("INSERT INTO t VALUES (?1, ?2)")
        .expect("prepare")
        .execute(params![&raw_key(i)[..], payload(i)])
        .expect("insert");
    raw.execute("COMMIT", []).expect("commit");
}

/// Publishes `m` (world size 1): begin + acknowledge; returns the number of
/// generations the publication evicted.
fn publish(dir: &Directory, m: &Manifest) -> usize {
    assert!(dir.begin(m).expect("begin"));
    let p = dir.acknowledge(m.generation(), 0).expect("ack");
    assert!(p.published);
    p.evicted.len()
}

/// The raw baselines of a publication phase.
struct Raw {
    /// Same rows, same schema, `synchronous=NORMAL`.
    same: Connection,
    /// The same, never checkpointing.
    same_bare: Connection,
    /// Key/payload table, `synchronous=NORMAL`.
    kv: Connection,
    /// Key/payload table, `synchronous=FULL`.
    kv_full: Connection,
}

/// Rates of the publication phase (per second).
struct Rates {
    /// Directory below capacity (no eviction).
    below: f64,
    /// Directory at capacity (each publication evicts one).
    at: f64,
    same: f64,
    same_bare: f64,
    kv: f64,
    kv_full: f64,
}

/// Publication phase, everything interleaved in batches of 100 so that disk
/// and machine noise hits all alike: publications of `below_range` into
/// `below` (never evicts), of `at_range` into `at` (at capacity: each one
/// evicts one), raw same-row and key/payload insert+commits (one each per
/// publication) and fsynced key/payload ones (one per five).
fn publication_phase(
    below: &Directory,
    at: &Directory,
    raw: &Raw,
    below_range: std::ops::Range<u64>,
    at_range: std::ops::Range<u64>,
) -> Rates {
    let mut time = [Duration::ZERO; 6];
    let mut count = [0u64; 6];
    let below_ids: Vec<u64> = below_range.collect();
    let at_ids: Vec<u64> = at_range.collect();
    for (batch, at_batch) in below_ids.chunks(100).zip(at_ids.chunks(100)) {
        let fresh: Vec<Manifest> = batch.iter().map(|&i| entry(i)).collect();
        let at_fresh: Vec<Manifest> = at_batch.iter().map(|&i| entry(i)).collect();
        let started = Instant::now();
        for m in &fresh {
            assert_eq!(publish(below, m), 0);
        }
        time[0] += started.elapsed();
        count[0] += fresh.len() as u64;
        let started = Instant::now();
        for m in &at_fresh {
            assert_eq!(publish(at, m), 1);
        }
        time[1] += started.elapsed();
        count[1] += at_fresh.len() as u64;
        let started = Instant::now();
        for (m, &i) in fresh.iter().zip(batch) {
            raw_same_commit(&raw.same, m, i as i64 + 1);
        }
        time[2] += started.elapsed();
        count[2] += batch.len() as u64;
        let started = Instant::now();
        for &i in batch {
            raw_commit(&raw.kv, i);
        }
        time[3] += started.elapsed();
        count[3] += batch.len() as u64;
        let started = Instant::now();
        for &i in batch.iter().step_by(5) {
            raw_commit(&raw.kv_full, i);
            count[4] += 1;
        }
        time[4] += started.elapsed();
        let started = Instant::now();
        for (m, &i) in fresh.iter().zip(batch) {
            raw_same_commit(&raw.same_bare, m, i as i64 + 1);
        }
        time[5] += started.elapsed();
        count[5] += batch.len() as u64;
    }
    let rate = |k: usize| count[k] as f64 / time[k].as_secs_f64();
    Rates {
        below: rate(0),
        at: rate(1),
        same: rate(2),
        same_bare: rate(5),
        kv: rate(3),
        kv_full: rate(4),
    }
}

/// Rates of the concurrent phase.
struct Concurrent {
    single: f64,
    threads: f64,
    per_transaction: f64,
}

/// Publications of `range`: each batch of 200 is 100 published by this
/// thread, then 100 by 4 threads at once (25 each).
fn concurrent_phase(dir: &Directory, range: std::ops::Range<u64>) -> Concurrent {
    let (mut single_time, mut threads_time) = (Duration::ZERO, Duration::ZERO);
    let (mut single_n, mut threads_n, mut threads_tx) = (0u64, 0u64, 0u64);
    let ids: Vec<u64> = range.collect();
    for batch in ids.chunks(200) {
        let fresh: Vec<Manifest> = batch.iter().map(|&i| entry(i)).collect();
        let (one, many) = fresh.split_at(fresh.len() / 2);
        let started = Instant::now();
        for m in one {
            publish(dir, m);
        }
        single_time += started.elapsed();
        single_n += one.len() as u64;
        let before = dir.status().expect("status").publish_transactions;
        let started = Instant::now();
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for m in many.iter().skip(t).step_by(4) {
                        publish(dir, m);
                    }
                });
            }
        });
        threads_time += started.elapsed();
        threads_n += many.len() as u64;
        threads_tx += dir.status().expect("status").publish_transactions - before;
    }
    Concurrent {
        single: single_n as f64 / single_time.as_secs_f64(),
        threads: threads_n as f64 / threads_time.as_secs_f64(),
        per_transaction: threads_n as f64 / threads_tx.max(1) as f64,
    }
}

/// Marks `generations` durable as one caller would: one batch, one call.
fn mark_batch(dir: &Directory, generations: &[String]) {
    let marked = dir.mark_durable(generations).expect("durable");
    assert!(marked.iter().all(|&m| m));
}

/// Durable marking rates (generations/s): one generation per call, batches
/// of 64 per call, and 4 threads each marking one generation per call
/// (concurrent callers, as the L2 pump's I/O threads are).
fn durable_phase(dir: &Directory, generations: &[String]) -> (f64, f64, f64) {
    let third = generations.len() / 3;
    let (single, rest) = generations.split_at(third.min(300));
    let (batched, threaded) = rest.split_at(rest.len() / 2);
    let started = Instant::now();
    for g in single {
        mark_batch(dir, std::slice::from_ref(g));
    }
    let single_rate = single.len() as f64 / started.elapsed().as_secs_f64();
    let started = Instant::now();
    for chunk in batched.chunks(64) {
        mark_batch(dir, chunk);
    }
    let batched_rate = batched.len() as f64 / started.elapsed().as_secs_f64();
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..4 {
            s.spawn(move || {
                for g in threaded.iter().skip(t).step_by(4) {
                    mark_batch(dir, std::slice::from_ref(g));
                }
            });
        }
    });
    let threaded_rate = threaded.len() as f64 / started.elapsed().as_secs_f64();
    (single_rate, batched_rate, threaded_rate)
}

/// Writes a query file: per query a u32 token count, then the tokens (LE).
fn write_queries(path: &Path, queries: &[Vec<u32>]) {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).expect("queries"));
    for q in queries {
        out.write_all(&(q.len() as u32).to_le_bytes())
            .expect("write");
        for t in q {
            out.write_all(&t.to_le_bytes()).expect("write");
        }
    }
    out.flush().expect("flush");
}

fn read_queries(path: &Path) -> Vec<Vec<u32>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .expect("queries")
        .read_to_end(&mut bytes)
        .expect("read");
    let words: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut out = Vec::new();
    let mut rest = &words[..];
    while let Some((&n, tail)) = rest.split_first() {
        out.push(tail[..n as usize].to_vec());
        rest = &tail[n as usize..];
    }
    out
}

/// `--find PATH QUERIES`: Rust `find` p50/p99 (µs) of each query's roots
/// (built before timing), after one warm-up pass; prints `p50 p99`.
fn find_only(path: &Path, queries: &Path) {
    let queries: Vec<Vec<Prefix>> = read_queries(queries)
        .into_iter()
        .map(|t| TokenRoots::build(NS, t, CHUNK).expect("roots").roots())
        .collect();
    let dir = Directory::open(Some(path), DirectoryConfig::default()).expect("open");
    for q in &queries {
        black_box(dir.find(q).expect("find"));
    }
    let mut lat = Vec::with_capacity(queries.len());
    for q in &queries {
        let t = Instant::now();
        let m = dir.find(q).expect("find");
        lat.push(t.elapsed());
        assert!(m.is_some(), "every query hits");
    }
    lat.sort();
    println!(
        "{:.3} {:.3}",
        us(percentile(&lat, 0.5)),
        us(percentile(&lat, 0.99))
    );
    dir.close().expect("close");
}

struct Figures {
    publish_rate: f64,
    publish_vs_same: f64,
    publish_vs_kv: f64,
    steady_vs_publish: f64,
    durable_batched: f64,
    find_p99: Duration,
    raw_p99: Duration,
}

fn run(n: u64, measured: u64, lookups: usize, keep: Option<&Path>) -> Figures {
    let tmp = tempfile::tempdir().expect("tempdir");
    println!(
        "-- N = {n} published generations (payload ~{} B, tails 16..63 tokens, one root per query)",
        payload(0).len()
    );

    // Raw baseline files and the directory file, each with n − measured rows.
    let mut kv = open_raw(&tmp.path().join("raw-kv.sqlite3"), "NORMAL");
    bulk_raw_table(&mut kv, n - measured);
    let mut kv_full = open_raw(&tmp.path().join("raw-kv-full.sqlite3"), "FULL");
    bulk_raw_table(&mut kv_full, n - measured);
    let same = same_rows_file(&tmp.path().join("raw-same.sqlite3"), n - measured);
    let same_bare = same_rows_file(&tmp.path().join("raw-same-bare.sqlite3"), n - measured);
    same_bare
        .execute_batch("PRAGMA wal_autocheckpoint=0")
        .expect("no checkpoints");
    let raw = Raw {
        same,
        same_bare,
        kv,
        kv_full,
    };
    let path = match keep {
        Some(dir) => dir.join(format!("n{n}.sqlite3")),
        None => tmp.path().join("directory.sqlite3"),
    };
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    bulk_reference_file(&path, n - measured);
    // Room for the concurrent phase too: this directory never evicts.
    let config = DirectoryConfig {
        max_entries: n + measured,
        ..DirectoryConfig::default()
    };
    let started = Instant::now();
    let dir = Directory::open(Some(&path), config).expect("open directory");
    let open_time = started.elapsed();
    // The at-capacity directory: N generations, capacity N.
    let at_path = tmp.path().join("at-capacity.sqlite3");
    bulk_reference_file(&at_path, n);
    let at_config = DirectoryConfig {
        max_entries: n,
        ..DirectoryConfig::default()
    };
    let at_dir = Directory::open(Some(&at_path), at_config).expect("open directory");

    // The last `measured` publications up to N, and as many at capacity.
    let rates = publication_phase(&dir, &at_dir, &raw, (n - measured)..n, n..n + measured);
    assert_eq!(dir.status().expect("status").published_generations, n);
    assert_eq!(at_dir.status().expect("status").evictions, measured);
    at_dir.close().expect("close");

    // Durable marking of the generations just published.
    let fresh: Vec<String> = ((n - measured)..n)
        .map(|i| entry(i).generation().to_owned())
        .collect();
    let (durable_single, durable_batched, durable_threads) = durable_phase(&dir, &fresh);

    // Lookups of existing entries, raw and directory interleaved in rounds.
    let mut rng = 0x1234_5678u64;
    let picks: Vec<u64> = (0..lookups)
        .map(|_| {
            rng = mix(rng);
            rng % n
        })
        .collect();
    let queries: Vec<Vec<Prefix>> = picks
        .iter()
        .map(|&i| {
            TokenRoots::build(NS, query_tokens(i), CHUNK)
                .expect("roots")
                .roots()
        })
        .collect();
    let expected: Vec<String> = picks
        .iter()
        .map(|&i| entry(i).generation().to_owned())
        .collect();
    let raw_keys: Vec<[u8; 32]> = picks.iter().map(|&i| raw_key(i)).collect();
    let mut raw_stmt = raw
        .kv
        .prepare_cached("SELECT payload FROM t WHERE k = ?1")
        .expect("prepare");
    // Warm both (page cache, statement caches).
    for (q, k) in queries.iter().zip(&raw_keys).take(1000) {
        black_box(dir.find(q).expect("find"));
        let _: Vec<u8> = raw_stmt
            .query_row(params![&k[..]], |r| r.get(0))
            .expect("raw");
    }
    // Latencies: one raw lookup, one find, alternately, so machine noise
    // (other processes, page-cache pressure) hits both distributions alike.
    let mut find_lat = Vec::with_capacity(lookups);
    let mut raw_lat = Vec::with_capacity(lookups);
    for ((q, k), w) in queries.iter().zip(&raw_keys).zip(&expected) {
        let t = Instant::now();
        let v: Vec<u8> = raw_stmt
            .query_row(params![&k[..]], |r| r.get(0))
            .expect("raw");
        raw_lat.push(t.elapsed());
        black_box(v);
        let t = Instant::now();
        let m = dir.find(q).expect("find");
        find_lat.push(t.elapsed());
        assert_eq!(m.as_ref().map(Manifest::generation), Some(w.as_str()));
    }
    // Throughput: the same lookups back to back.
    let started = Instant::now();
    for q in &queries {
        black_box(dir.find(q).expect("find"));
    }
    let find_total = started.elapsed();
    drop(raw_stmt);

    // Concurrent publishers (several engines): batches of 100 published by
    // one thread alternate with batches of 100 published by 4 threads.
    let conc = concurrent_phase(&dir, 3 * n..3 * n + measured);

    find_lat.sort();
    raw_lat.sort();
    let (find_p50, find_p99) = (percentile(&find_lat, 0.5), percentile(&find_lat, 0.99));
    let (raw_p50, raw_p99) = (percentile(&raw_lat, 0.5), percentile(&raw_lat, 0.99));

    dir.close().expect("close");
    let started = Instant::now();
    let reopened = Directory::open(Some(&path), DirectoryConfig::default()).expect("reopen");
    let reopen_time = started.elapsed();
    reopened.close().expect("close");
    if let Some(dir) = keep {
        // Queries of long prompts extending listed generations.
        let mut rng = 0xfeed_beefu64;
        let long: Vec<Vec<u32>> = (0..lookups.min(1000))
            .map(|_| {
                rng = mix(rng);
                long_query_tokens(rng % n)
            })
            .collect();
        write_queries(&dir.join(format!("n{n}.queries")), &long);
    }

    println!(
        "  open: reconcile {} reference rows + load        : {:9.1} ms",
        n - measured,
        open_time.as_secs_f64() * 1e3
    );
    println!(
        "  reopen of {n} generations (no migration)      : {:9.1} ms",
        reopen_time.as_secs_f64() * 1e3
    );
    println!(
        "  raw insert+commit, key/payload, FULL (fsync)    : {:9.0} /s",
        rates.kv_full
    );
    println!(
        "  raw insert+commit, key/payload, NORMAL          : {:9.0} /s",
        rates.kv
    );
    println!(
        "  raw insert+commit, same rows, NORMAL            : {:9.0} /s  (inline auto-checkpoint)",
        rates.same
    );
    println!(
        "  raw insert+commit, same rows, NORMAL, bare      : {:9.0} /s  (never checkpoints)",
        rates.same_bare
    );
    println!(
        "  directory publication below capacity            : {:9.0} /s  \
         (x raw same rows bare {:.2}, target >= 0.7; x with auto-checkpoint {:.2}; \
         x raw key/payload {:.2}; x raw fsync {:.1})",
        rates.below,
        rates.below / rates.same_bare,
        rates.below / rates.same,
        rates.below / rates.kv,
        rates.below / rates.kv_full
    );
    println!(
        "  directory publication at capacity (evicts one)  : {:9.0} /s  \
         (x below capacity {:.2}, target >= 0.8; x raw same rows bare {:.2})",
        rates.at,
        rates.at / rates.below,
        rates.at / rates.same_bare
    );
    println!(
        "  directory publication, 4 threads at once        : {:9.0} /s  \
         (x one thread {:.2}; {:.1} publications per transaction)",
        conc.threads,
        conc.threads / conc.single,
        conc.per_transaction
    );
    println!("  durable marking, 1 generation per call          : {durable_single:9.0} gen/s");
    println!(
        "  durable marking, 64 generations per call        : {durable_batched:9.0} gen/s  \
         (target >= 1000)"
    );
    println!("  durable marking, 4 threads x 1 per call         : {durable_threads:9.0} gen/s");
    println!(
        "  raw indexed point lookup                        : p50 {:7.2} us  p99 {:7.2} us",
        us(raw_p50),
        us(raw_p99)
    );
    println!(
        "  directory find (recency batched)                : p50 {:7.2} us  p99 {:7.2} us",
        us(find_p50),
        us(find_p99)
    );
    println!(
        "  directory lookups/s                             : {:9.0} /s",
        lookups as f64 / find_total.as_secs_f64()
    );
    println!(
        "  ratio find p99 / raw p99                        : {:9.2}  (target <= 3)",
        us(find_p99) / us(raw_p99)
    );
    Figures {
        publish_rate: rates.below,
        publish_vs_same: rates.below / rates.same_bare,
        publish_vs_kv: rates.below / rates.kv,
        steady_vs_publish: rates.at / rates.below,
        durable_batched,
        find_p99,
        raw_p99,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(pos) = args.iter().position(|a| a == "--find") {
        let path = PathBuf::from(args.get(pos + 1).expect("--find PATH QUERIES"));
        let queries = PathBuf::from(args.get(pos + 2).expect("--find PATH QUERIES"));
        find_only(&path, &queries);
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let keep = args
        .iter()
        .position(|a| a == "--keep")
        .and_then(|i| args.get(i + 1))
        .map(PathBuf::from);
    let (sizes, measured, lookups): (&[u64], u64, usize) = if quick {
        (&[2_000, 10_000], 500, 2_000)
    } else {
        (&[10_000, 100_000], 2_000, 5_000)
    };
    println!("directory bench{}", if quick { " (--quick)" } else { "" });
    let figures: Vec<Figures> = sizes
        .iter()
        .map(|&n| run(n, measured, lookups, keep.as_deref()))
        .collect();
    if let [small, large] = figures.as_slice() {
        println!(
            "summary: N={}: publications/s {:.0} = {:.2} x raw un-synced insert+commit of \
             the same rows, never checkpointed (target >= 0.7; {:.2} x a key/payload row) = {:.1} x the \
             reference's 78/s (target >= 20); at capacity {:.2} x below capacity \
             (target >= 0.8); durable marking {:.0} gen/s (target >= 1000)",
            sizes[1],
            large.publish_rate,
            large.publish_vs_same,
            large.publish_vs_kv,
            large.publish_rate / 78.0,
            large.steady_vs_publish,
            large.durable_batched
        );
        println!(
            "summary: publication rate at N={} / at N={}: {:.2} (should stay near 1)",
            sizes[1],
            sizes[0],
            large.publish_rate / small.publish_rate
        );
        println!(
            "summary: find p99 / raw p99 at N={}: {:.2} (target <= 3)",
            sizes[1],
            us(large.find_p99) / us(large.raw_p99)
        );
    }
}
