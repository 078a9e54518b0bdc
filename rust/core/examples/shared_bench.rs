//! Shared tier against the same S3 server's raw PUT/GET of the same bytes,
//! measured in the same run, and the latency of a cross-host longest-prefix
//! lookup.
//!
//! `cargo run --release -p lmcache-rc-core --example shared_bench [-- --quick]`
//!
//! Starts a private s3s-fs through `ci/s3-server.sh` (built once, cached).
//! Uploads: `SharedTier::upload` of one generation (2 ranks, N distinct
//! pages; existence check + conditional put per page, manifest last) vs raw
//! `put` of the same page bytes under fresh keys with the same concurrency.
//! Downloads: `SharedTier::fetch_page` of every page (verified: key, size,
//! xxh3) from 8 threads vs raw `get` of the same objects, 8 in flight.
//! Lookup: host B (its own tier) asks the longest prefix of a conversation
//! host A stored at four turns (chunk 4096 tokens, 8 chunk roots), hit and
//! miss, against one raw GET round trip of a small object.
// A benchmark reports on stdout and stops at the first failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use lmcache_rc_core::manifest::{CheckpointPayload, PageGroup};
use lmcache_rc_core::shared::{SharedConfig, SharedTier};
use lmcache_rc_core::store::ObjectKey;
use lmcache_rc_core::store::object_keys;
use lmcache_rc_core::{Manifest, TokenRoots, checkpoint_generation, json};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

const NS: &str = "recurrent-sha256-v1:bench";
const ACCESS_KEY: &str = "lmcache-rc-test";
const SECRET_KEY: &str = "lmcache-rc-test-secret";
const CONCURRENCY: usize = 8;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn script(args: &[&str]) -> String {
    let out = Command::new("bash")
        .arg(repo_root().join("ci/s3-server.sh"))
        .args(args)
        .env("LMCACHE_RC_S3_OWNER_PID", std::process::id().to_string())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn p90(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[(v.len() * 9 / 10).min(v.len() - 1)]
}

fn mib_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / d.as_secs_f64()
}

/// A one-group schema-2 manifest of `tokens[..n]`: `pages` pages per rank.
fn manifest(tokens: &[u32], n: usize, pages: u64, page_bytes: u64, world: u32) -> Manifest {
    let roots = TokenRoots::build(NS, tokens[..n].to_vec(), 4096).unwrap();
    let n = n as u64;
    let block = n.div_ceil(pages);
    let bounds: Vec<(u64, String)> = (0..pages)
        .map(|p| (((p + 1) * block).min(n), "attention:0".to_string()))
        .collect();
    let keys = roots
        .content_keys(&bounds)
        .unwrap()
        .into_iter()
        .map(|h| hex::decode(h).unwrap().try_into().unwrap())
        .collect();
    let payload = CheckpointPayload {
        worker_layout: json::Value::Object(
            [(
                "page_bytes".to_string(),
                json::Value::Int(page_bytes as i64),
            )]
            .into(),
        ),
        page_groups: vec![PageGroup {
            name: "engine-kv-group:0".into(),
            page_bytes,
            positions: (0..pages).collect(),
            content_keys: keys,
        }],
        draft_prefix_len: None,
        kind: None,
        num_tokens: Some(n),
    }
    .build()
    .unwrap();
    let prefix = roots.prefix(n).unwrap();
    let generation = checkpoint_generation(&prefix, &payload);
    Manifest::new(generation, prefix, world, payload).unwrap()
}

fn page_of(key: &ObjectKey, len: u64) -> Vec<u8> {
    let mut x = u64::from_le_bytes(key.0[..8].try_into().unwrap()) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (pages, page_bytes, lookups) = if quick {
        (16u64, 256 * 1024u64, 20)
    } else {
        (64u64, 1024 * 1024u64, 100)
    };
    let data = tempfile::tempdir().unwrap();
    let data_dir = data.path().join("s3");
    let endpoint = script(&["start", data_dir.to_str().unwrap(), "bench"]);
    println!(
        "s3s-fs at {endpoint} (loopback; data on {})",
        data.path().display()
    );
    let config = SharedConfig::new("s3://bench/shared")
        .with_option("aws_endpoint", endpoint.clone())
        .with_option("aws_access_key_id", ACCESS_KEY)
        .with_option("aws_secret_access_key", SECRET_KEY)
        .with_option("aws_region", "us-east-1")
        .with_option("aws_allow_http", "true");
    let host_a = SharedTier::open(config.clone()).unwrap();
    let host_b = SharedTier::open(config).unwrap();
    let raw: Arc<dyn ObjectStore> = Arc::new(
        AmazonS3Builder::new()
            .with_bucket_name("bench")
            .with_endpoint(endpoint.clone())
            .with_access_key_id(ACCESS_KEY)
            .with_secret_access_key(SECRET_KEY)
            .with_region("us-east-1")
            .with_allow_http(true)
            .build()
            .unwrap(),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    // One generation: 2 ranks x `pages` pages.
    let conv: Vec<u32> = (0..32768u32).map(|i| (i * 2654435761) % 50_000).collect();
    let big: Vec<u32> = conv.iter().map(|t| t ^ 2).collect();
    let m = manifest(&big, 32768, pages, page_bytes, 2);
    let schema = m.payload_schema().unwrap();
    let keys: Vec<ObjectKey> = (0..2)
        .flat_map(|r| object_keys(&m, &schema, r).unwrap().into_iter().flatten())
        .collect();
    let page_data: std::collections::HashMap<ObjectKey, Vec<u8>> =
        keys.iter().map(|k| (*k, page_of(k, page_bytes))).collect();
    let total = keys.len() as u64 * page_bytes;
    println!(
        "workload: {} pages of {} KiB ({} MiB), {CONCURRENCY} requests in flight",
        keys.len(),
        page_bytes / 1024,
        total >> 20
    );

    // Raw PUT of the same bytes (fresh keys), then the tier's upload.
    let raw_bodies: Vec<(Path, Bytes)> = keys
        .iter()
        .map(|k| {
            (
                Path::from(format!("raw/{}", k.hex())),
                Bytes::from(page_data[k].clone()),
            )
        })
        .collect();
    let t = Instant::now();
    rt.block_on(async {
        futures_util::stream::iter(raw_bodies.iter())
            .map(|(p, b)| {
                let raw = raw.clone();
                async move { raw.put(p, PutPayload::from(b.clone())).await.unwrap() }
            })
            .buffer_unordered(CONCURRENCY)
            .collect::<Vec<_>>()
            .await
    });
    let raw_put = t.elapsed();
    let t = Instant::now();
    let report = host_a.upload(&m, |k| Ok(page_data[k].clone())).unwrap();
    let tier_put = t.elapsed();
    assert!(report.manifest_written && report.pages_uploaded == keys.len() as u64);
    println!(
        "upload:   tier {:7.1} MiB/s   raw PUT {:7.1} MiB/s   ratio {:.2}",
        mib_s(total, tier_put),
        mib_s(total, raw_put),
        raw_put.as_secs_f64() / tier_put.as_secs_f64()
    );
    // Host B re-uploading: existence checks only.
    let t = Instant::now();
    let again = host_b
        .upload(&manifest(&big, 32768, pages, page_bytes, 2), |k| {
            Ok(page_data[k].clone())
        })
        .unwrap();
    assert_eq!(again.pages_uploaded, 0);
    println!(
        "          the same generation from host B: {:.1} ms (manifest present: 1 HEAD)",
        t.elapsed().as_secs_f64() * 1e3
    );

    // Downloads: raw GET vs verified fetch, 8 in flight each.
    let t = Instant::now();
    rt.block_on(async {
        futures_util::stream::iter(raw_bodies.iter())
            .map(|(p, _)| {
                let raw = raw.clone();
                async move { raw.get(p).await.unwrap().bytes().await.unwrap() }
            })
            .buffer_unordered(CONCURRENCY)
            .for_each(|b| {
                assert_eq!(b.len() as u64, page_bytes);
                async {}
            })
            .await
    });
    let raw_get = t.elapsed();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..CONCURRENCY {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(k) = keys.get(i) else { break };
                    let page = host_b.fetch_page(NS, k, page_bytes).unwrap();
                    assert!(page == page_data[k]);
                }
            });
        }
    });
    let tier_get = t.elapsed();
    println!(
        "download: tier {:7.1} MiB/s   raw GET {:7.1} MiB/s   ratio {:.2}  (tier verifies key, size, xxh3)",
        mib_s(total, tier_get),
        mib_s(total, raw_get),
        raw_get.as_secs_f64() / tier_get.as_secs_f64()
    );

    // Cross-host lookup: A stores four turns of one conversation (small
    // payloads), B asks for the whole conversation (8 chunk roots).
    let mut last = None;
    for n in [6000usize, 14000, 22000, 30000] {
        let turn = manifest(&conv, n, 4, 4096, 2);
        host_a.upload(&turn, |k| Ok(page_of(k, 4096))).unwrap();
        last = Some(turn);
    }
    let last = last.unwrap();
    // The raw requests a hit needs at least: one LIST of the chunk root,
    // one GET of the manifest object.
    let manifest_path = Path::from(
        host_b
            .layout()
            .manifest_key(last.prefix(), last.generation()),
    );
    let bucket_dir = Path::from(host_b.layout().bucket_dir(last.prefix()));
    let query = TokenRoots::build(NS, conv.clone(), 4096).unwrap().roots();
    let other: Vec<u32> = conv.iter().map(|t| t ^ 1).collect();
    let miss_query = TokenRoots::build(NS, other, 4096).unwrap().roots();
    let small = Path::from("raw/rtt");
    rt.block_on(raw.put(&small, PutPayload::from_static(b"x")))
        .unwrap();
    let (mut hit, mut miss, mut rtt) = (Vec::new(), Vec::new(), Vec::new());
    let (mut raw_list, mut raw_manifest) = (Vec::new(), Vec::new());
    let (mut lists, mut gets) = (0, 0);
    for _ in 0..lookups {
        let t = Instant::now();
        let r = host_b
            .lookup_detailed(&query, 0, Duration::from_secs(10))
            .unwrap();
        hit.push(t.elapsed());
        assert_eq!(r.manifest.unwrap().prefix().num_tokens(), 30000);
        (lists, gets) = (r.list_requests, r.get_requests);
        let t = Instant::now();
        let r = host_b
            .lookup_detailed(&miss_query, 0, Duration::from_secs(10))
            .unwrap();
        miss.push(t.elapsed());
        assert!(r.manifest.is_none());
        let t = Instant::now();
        rt.block_on(async { raw.get(&small).await.unwrap().bytes().await.unwrap() });
        rtt.push(t.elapsed());
        let t = Instant::now();
        let listed: Vec<_> = rt.block_on(raw.list(Some(&bucket_dir)).collect::<Vec<_>>());
        raw_list.push(t.elapsed());
        assert_eq!(listed.len(), 1);
        let t = Instant::now();
        rt.block_on(async {
            raw.get(&manifest_path)
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap()
        });
        raw_manifest.push(t.elapsed());
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let floor = median(raw_list.clone()) + median(raw_manifest.clone());
    println!(
        "lookup (8 roots, cross-host): hit median {:.2} ms p90 {:.2} ms ({lists} LIST + {gets} GET, \
         one wave of 4 LISTs in parallel); miss median {:.2} ms ({} LIST, 2 waves)",
        ms(median(hit.clone())),
        ms(p90(hit.clone())),
        ms(median(miss)),
        query.len(),
    );
    println!(
        "          raw: LIST of the chunk root {:.2} ms + GET of the manifest object {:.2} ms = {:.2} ms \
         (1-byte GET round trip {:.2} ms); hit / raw ratio {:.2}",
        ms(median(raw_list)),
        ms(median(raw_manifest)),
        ms(floor),
        ms(median(rtt)),
        median(hit).as_secs_f64() / floor.as_secs_f64()
    );
    println!(
        "(s3s-fs walks the whole bucket on every LIST: lookup latency here grows with the bucket)"
    );
    drop((host_a, host_b));
    script(&["stop", data_dir.to_str().unwrap()]);
}
