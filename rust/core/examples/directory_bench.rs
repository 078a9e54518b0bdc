//! Checkpoint directory benchmark: publication rate and `find` latency at 10k
//! and 100k published generations, each next to a raw SQLite baseline
//! measured in the same run on a file with the same settings (WAL,
//! synchronous=FULL). DESIGN §9 target: find p99 ≤ 3 × a raw indexed point
//! lookup; publication rate must not fall with the directory's size.
//!
//! `cargo run --release -p lmcache-rc-core --example directory_bench -- [--quick]`
//!
//! The first N − M generations are bulk-loaded into a reference-layout file
//! (`checkpoints` only, as an older build leaves it) so the run fits in a few
//! minutes; opening the directory reconciles them (timed). The last M
//! generations are published through the API, one SQLite commit each.
// A benchmark reports on stdout and stops at the first failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use lmcache_rc_core::index::{Directory, DirectoryConfig, tail_text};
use lmcache_rc_core::{Manifest, Prefix, TokenRoots, checkpoint_generation};
use rusqlite::{Connection, params};

const NS: &str = "recurrent-sha256-v1:benchmark-namespace";

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

fn entry(i: u64) -> (Manifest, TokenRoots) {
    let t = tokens(i);
    let roots = TokenRoots::build(NS, t.clone(), 4096).expect("roots");
    let prefix = roots.prefix(t.len() as u64).expect("prefix");
    let payload = payload(i);
    let generation = checkpoint_generation(&prefix, &payload);
    let m = Manifest::new(generation, prefix, 1, payload).expect("manifest");
    (m, roots)
}

/// Query roots for sequence `i`: its tokens plus 8 more.
fn query(i: u64) -> Vec<Prefix> {
    let mut t = tokens(i);
    t.extend((0..8).map(|j| (mix(i ^ (j << 40)) % (1 << 31)) as u32));
    TokenRoots::build(NS, t, 4096).expect("roots").roots()
}

fn open_raw(path: &Path) -> Connection {
    let conn = Connection::open(path).expect("open raw");
    conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get::<_, String>(0))
        .expect("wal");
    // The directory's own settings: synchronous=FULL, 32 MiB page cache.
    conn.execute_batch("PRAGMA synchronous=FULL; PRAGMA cache_size=-32768")
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
    let mut conn = open_raw(path);
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
            let (m, _) = entry(i);
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

/// A raw key/value table of `n` rows with the same payloads; returns its keys.
fn bulk_raw_table(conn: &mut Connection, n: u64) -> Vec<[u8; 32]> {
    conn.execute_batch("CREATE TABLE t (k BLOB PRIMARY KEY, payload BLOB NOT NULL)")
        .expect("raw schema");
    let keys: Vec<[u8; 32]> = (0..n)
        .map(|i| {
            let mut k = [0u8; 32];
            for (c, chunk) in k.chunks_mut(8).enumerate() {
                chunk.copy_from_slice(&mix(i * 4 + c as u64).to_le_bytes());
            }
            k
        })
        .collect();
    let tx = conn.transaction().expect("tx");
    {
        let mut stmt = tx
            .prepare("INSERT INTO t VALUES (?1, ?2)")
            .expect("prepare");
        for (i, k) in keys.iter().enumerate() {
            stmt.execute(params![&k[..], payload(i as u64)])
                .expect("insert");
        }
    }
    tx.commit().expect("commit");
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
        .expect("checkpoint");
    keys
}

struct Figures {
    publish_rate: f64,
    publish_ratio: f64,
    find_p99: Duration,
    raw_p99: Duration,
}

fn run(n: u64, measured: u64, lookups: usize) -> Figures {
    let tmp = tempfile::tempdir().expect("tempdir");
    println!(
        "-- N = {n} published generations (payload ~{} B, tails 16..63 tokens, one root per query)",
        payload(0).len()
    );

    // Raw baseline table and the directory file, both with n − measured rows.
    let raw_path = tmp.path().join("raw.sqlite3");
    let mut raw = open_raw(&raw_path);
    let mut keys = bulk_raw_table(&mut raw, n - measured);
    let path = tmp.path().join("directory.sqlite3");
    bulk_reference_file(&path, n - measured);
    let config = DirectoryConfig {
        max_entries: n,
        ..DirectoryConfig::default()
    };
    let started = Instant::now();
    let dir = Directory::open(Some(&path), config).expect("open directory");
    let open_time = started.elapsed();

    // The last `measured` rows: directory publications interleaved in
    // batches of 100 with raw single-row insert+commit transactions, so
    // disk noise hits both alike.
    let mut raw_time = Duration::ZERO;
    let mut publish_time = Duration::ZERO;
    let raw_commit = |raw: &mut Connection, keys: &mut Vec<[u8; 32]>, i: u64| {
        let mut k = [0u8; 32];
        k[..8].copy_from_slice(&mix(i ^ 0xabcdef).to_le_bytes());
        k[8..16].copy_from_slice(&i.to_le_bytes());
        let tx = raw.transaction().expect("tx");
        tx.prepare_cached("INSERT INTO t VALUES (?1, ?2)")
            .expect("prepare")
            .execute(params![&k[..], payload(i)])
            .expect("insert");
        tx.commit().expect("commit");
        keys.push(k);
    };
    for batch in ((n - measured)..n).collect::<Vec<_>>().chunks(100) {
        let started = Instant::now();
        for &i in batch {
            raw_commit(&mut raw, &mut keys, i);
        }
        raw_time += started.elapsed();
        let fresh: Vec<Manifest> = batch.iter().map(|&i| entry(i).0).collect();
        let started = Instant::now();
        for m in &fresh {
            assert!(dir.begin(m).expect("begin"));
            assert!(dir.acknowledge(m.generation(), 0).expect("ack").published);
        }
        publish_time += started.elapsed();
    }
    let raw_insert_rate = measured as f64 / raw_time.as_secs_f64();
    let publish_rate = measured as f64 / publish_time.as_secs_f64();
    assert_eq!(dir.status().expect("status").published_generations, n);

    // Lookups of existing entries, raw and directory interleaved in rounds.
    let mut rng = 0x1234_5678u64;
    let picks: Vec<u64> = (0..lookups)
        .map(|_| {
            rng = mix(rng);
            rng % n
        })
        .collect();
    let queries: Vec<Vec<Prefix>> = picks.iter().map(|&i| query(i)).collect();
    let expected: Vec<String> = picks
        .iter()
        .map(|&i| entry(i).0.generation().to_owned())
        .collect();
    let mut raw_stmt = raw
        .prepare_cached("SELECT payload FROM t WHERE k = ?1")
        .expect("prepare");
    // Warm both (page cache, statement caches).
    for (q, &i) in queries.iter().zip(&picks).take(1000) {
        black_box(dir.find(q).expect("find"));
        let _: Vec<u8> = raw_stmt
            .query_row(params![&keys[i as usize][..]], |r| r.get(0))
            .expect("raw");
    }
    // Latencies: one raw lookup, one find, alternately, so machine noise
    // (other processes, page-cache pressure) hits both distributions alike.
    let mut find_lat = Vec::with_capacity(lookups);
    let mut raw_lat = Vec::with_capacity(lookups);
    for ((q, &i), w) in queries.iter().zip(&picks).zip(&expected) {
        let t = Instant::now();
        let v: Vec<u8> = raw_stmt
            .query_row(params![&keys[i as usize][..]], |r| r.get(0))
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
    find_lat.sort();
    raw_lat.sort();
    let (find_p50, find_p99) = (percentile(&find_lat, 0.5), percentile(&find_lat, 0.99));
    let (raw_p50, raw_p99) = (percentile(&raw_lat, 0.5), percentile(&raw_lat, 0.99));

    // Steady state at capacity: every publication evicts one generation.
    let extra = (measured / 2).max(1);
    let mut steady_time = Duration::ZERO;
    let mut steady_raw_time = Duration::ZERO;
    let mut evicted = 0;
    for batch in (n..n + extra).collect::<Vec<_>>().chunks(100) {
        let started = Instant::now();
        for &i in batch {
            raw_commit(&mut raw, &mut keys, i);
        }
        steady_raw_time += started.elapsed();
        let fresh: Vec<Manifest> = batch.iter().map(|&i| entry(i).0).collect();
        let started = Instant::now();
        for m in &fresh {
            assert!(dir.begin(m).expect("begin"));
            evicted += dir
                .acknowledge(m.generation(), 0)
                .expect("ack")
                .evicted
                .len();
        }
        steady_time += started.elapsed();
    }
    let steady_rate = extra as f64 / steady_time.as_secs_f64();
    let steady_raw_rate = extra as f64 / steady_raw_time.as_secs_f64();
    dir.close().expect("close");
    let started = Instant::now();
    let reopened = Directory::open(Some(&path), DirectoryConfig::default()).expect("reopen");
    let reopen_time = started.elapsed();
    reopened.close().expect("close");

    println!(
        "  open: reconcile {} reference rows + load      : {:9.1} ms",
        n - measured,
        open_time.as_secs_f64() * 1e3
    );
    println!(
        "  reopen of {n} generations (no migration)    : {:9.1} ms",
        reopen_time.as_secs_f64() * 1e3
    );
    println!("  raw SQLite insert+commit (synchronous=FULL)   : {raw_insert_rate:9.0} /s");
    println!(
        "  directory publication (last {measured} up to N)     : {publish_rate:9.0} /s  (ratio to raw insert+commit: {:.2})",
        publish_rate / raw_insert_rate
    );
    println!(
        "  directory publication at capacity (evicting) : {steady_rate:9.0} /s  ({evicted} evicted in {extra}; ratio to raw insert+commit: {:.2})",
        steady_rate / steady_raw_rate
    );
    println!(
        "  raw indexed point lookup                      : p50 {:7.2} us  p99 {:7.2} us",
        us(raw_p50),
        us(raw_p99)
    );
    println!(
        "  directory find (recency batched)              : p50 {:7.2} us  p99 {:7.2} us",
        us(find_p50),
        us(find_p99)
    );
    println!(
        "  directory lookups/s                           : {:9.0} /s",
        lookups as f64 / find_total.as_secs_f64()
    );
    println!(
        "  ratio find p99 / raw p99                      : {:9.2}  (target <= 3)",
        us(find_p99) / us(raw_p99)
    );
    Figures {
        publish_rate,
        publish_ratio: publish_rate / raw_insert_rate,
        find_p99,
        raw_p99,
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (sizes, measured, lookups): (&[u64], u64, usize) = if quick {
        (&[2_000, 10_000], 500, 2_000)
    } else {
        (&[10_000, 100_000], 2_000, 5_000)
    };
    println!("directory bench{}", if quick { " (--quick)" } else { "" });
    let figures: Vec<Figures> = sizes.iter().map(|&n| run(n, measured, lookups)).collect();
    if let [small, large] = figures.as_slice() {
        println!(
            "summary: publication rate at N={} / at N={}: {:.2} (should stay near 1; \
             normalised by the raw insert+commit rate of each run: {:.2})",
            sizes[1],
            sizes[0],
            large.publish_rate / small.publish_rate,
            large.publish_ratio / small.publish_ratio
        );
        println!(
            "summary: find p99 / raw p99 at N={}: {:.2} (target <= 3)",
            sizes[1],
            us(large.find_p99) / us(large.raw_p99)
        );
    }
}
