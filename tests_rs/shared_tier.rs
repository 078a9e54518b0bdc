//! The shared tier against a real S3-compatible server (s3s-fs, started by
//! `ci/s3-server.sh` through `s3_server`): two `SharedTier`s on one bucket
//! play two hosts. Corruption, truncation, deletion and ageing are done on
//! the server's backing files; the object store itself is never mocked.

use std::collections::HashSet;
use std::io::Write;
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use lmcache_rc_core::manifest::{CheckpointPayload, PageGroup};
use lmcache_rc_core::shared::{LookupMiss, SharedConfig, SharedCounter, SharedTier};
use lmcache_rc_core::store::ObjectKey;
use lmcache_rc_core::store::object_keys;
use lmcache_rc_core::{Error, Manifest, Prefix, TokenRoots, checkpoint_generation, json};

use crate::s3_server::S3Server;

const NS_A: &str = "recurrent-sha256-v1:tenant-a";
const NS_B: &str = "recurrent-sha256-v1:tenant-b";
/// Small chunks, so short sequences have several roots.
const CHUNK: u32 = 16;
/// Tokens per attention page.
const BLOCK: u64 = 8;
const PAGE: u64 = 256;
const LONG: Duration = Duration::from_secs(30);

/// A deterministic token sequence.
fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed.wrapping_mul(7919) ^ i.wrapping_mul(2654435761)) % 50_000)
        .collect()
}

/// A schema-2 manifest of the first `n` tokens: attention pages keyed at
/// their own end (shared by continuations) and one recurrent page.
fn manifest(ns: &str, tokens: &[u32], n: usize, world: u32) -> Manifest {
    manifest_with(ns, tokens, n, world, "prompt")
}

fn manifest_with(ns: &str, tokens: &[u32], n: usize, world: u32, kind: &str) -> Manifest {
    let roots = TokenRoots::build(ns, tokens[..n].to_vec(), CHUNK).unwrap();
    let n = n as u64;
    let pages = n.div_ceil(BLOCK);
    let attn: Vec<(u64, String)> = (0..pages)
        .map(|p| (((p + 1) * BLOCK).min(n), "attention:0".to_string()))
        .collect();
    let key = |hex: String| -> [u8; 32] { hex::decode(hex).unwrap().try_into().unwrap() };
    let attn_keys = roots
        .content_keys(&attn)
        .unwrap()
        .into_iter()
        .map(key)
        .collect();
    let rec_key = key(roots.content_key(n, "recurrent:1").unwrap());
    let payload = CheckpointPayload {
        worker_layout: json::Value::Object(
            [("page_bytes".to_string(), json::Value::Int(PAGE as i64))].into(),
        ),
        page_groups: vec![
            PageGroup {
                name: "engine-kv-group:0".into(),
                page_bytes: PAGE,
                positions: (0..pages).collect(),
                content_keys: attn_keys,
            },
            PageGroup {
                name: "engine-kv-group:1".into(),
                page_bytes: PAGE,
                positions: vec![0],
                content_keys: vec![rec_key],
            },
        ],
        draft_prefix_len: Some(0),
        kind: Some(kind.into()),
        num_tokens: Some(n),
    }
    .build()
    .unwrap();
    let prefix = roots.prefix(n).unwrap();
    let generation = checkpoint_generation(&prefix, &payload);
    Manifest::new(generation, prefix, world, payload).unwrap()
}

/// The chunk roots of a query (what a sidecar's `find` receives).
fn roots(ns: &str, tokens: &[u32]) -> Vec<Prefix> {
    TokenRoots::build(ns, tokens.to_vec(), CHUNK)
        .unwrap()
        .roots()
}

/// Deterministic bytes of a page (what L2 would hold).
fn page_of(key: &ObjectKey) -> Vec<u8> {
    (0..PAGE)
        .map(|i| key.0[(i % 32) as usize] ^ (i as u8).wrapping_mul(31))
        .collect()
}

fn source(key: &ObjectKey) -> lmcache_rc_core::Result<Vec<u8>> {
    Ok(page_of(key))
}

/// Every distinct page object of a manifest (all ranks).
fn pages(m: &Manifest) -> HashSet<ObjectKey> {
    let schema = m.payload_schema().unwrap();
    (0..m.world_size())
        .flat_map(|r| object_keys(m, &schema, r).unwrap().into_iter().flatten())
        .collect()
}

fn open(config: SharedConfig) -> SharedTier {
    SharedTier::open(config).unwrap()
}

fn lookup(tier: &SharedTier, ns: &str, query: &[u32], longer_than: u64) -> Option<Manifest> {
    tier.lookup(&roots(ns, query), longer_than, LONG).unwrap()
}

fn set_age(path: &std::path::Path, age: Duration) {
    let file = std::fs::File::options().write(true).open(path).unwrap();
    file.set_modified(SystemTime::now() - age).unwrap();
}

#[test]
fn two_hosts_share_generations_and_each_page_is_uploaded_once() {
    let server = S3Server::shared();
    let bucket = server.bucket("two-hosts");
    let host_a = open(server.config(&bucket, "cache"));
    let host_b = open(server.config(&bucket, "cache"));
    let conv = tokens(1, 80);
    let (m1, m2, m3) = (
        manifest(NS_A, &conv, 20, 2),
        manifest(NS_A, &conv, 45, 2),
        manifest(NS_A, &conv, 70, 2),
    );
    let (p1, p2, p3) = (pages(&m1), pages(&m2), pages(&m3));

    let r1 = host_a.upload(&m1, source).unwrap();
    assert!(r1.manifest_written, "{r1:?}");
    assert_eq!((r1.pages_uploaded, r1.dedup_hits), (p1.len() as u64, 0));
    let r2 = host_a.upload(&m2, source).unwrap();
    let shared_12 = p1.intersection(&p2).count() as u64;
    assert!(shared_12 > 0, "turns share their attention pages");
    assert_eq!(r2.dedup_hits, shared_12);
    assert_eq!(r2.pages_uploaded, p2.len() as u64 - shared_12);

    // Host B: the generation A wrote is present (nothing sent); its own
    // continuation reuses every page A already uploaded.
    let requests = host_b.counters().get(SharedCounter::Requests);
    let again = host_b.upload(&m2, source).unwrap();
    assert!(!again.manifest_written);
    assert_eq!((again.pages_uploaded, again.bytes_uploaded), (0, 0));
    assert_eq!(host_b.counters().get(SharedCounter::Requests), requests + 1);
    let known: HashSet<ObjectKey> = p1.union(&p2).copied().collect();
    let r3 = host_b.upload(&m3, source).unwrap();
    assert_eq!(r3.dedup_hits, p3.intersection(&known).count() as u64);
    assert_eq!(r3.pages_uploaded, p3.difference(&known).count() as u64);

    // Counters are per host.
    let a = host_a.counters();
    let b = host_b.counters();
    assert_eq!(a.get(SharedCounter::PagesUploaded), known.len() as u64);
    assert_eq!(a.get(SharedCounter::ManifestsWritten), 2);
    assert_eq!(b.get(SharedCounter::ManifestsPresent), 1);
    assert_eq!(b.get(SharedCounter::ManifestsWritten), 1);
    assert_eq!(b.get(SharedCounter::DedupHits), r3.dedup_hits);
    assert_eq!(b.get(SharedCounter::Uploads), 2);

    // The bucket holds every page exactly once, and three manifests.
    let all: HashSet<ObjectKey> = known.union(&p3).copied().collect();
    let stored_pages = server
        .objects(&bucket, "cache/v1/")
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "page"));
    assert_eq!(stored_pages.count(), all.len());
    let manifests = server
        .objects(&bucket, "cache/v1/")
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "manifest"));
    assert_eq!(manifests.count(), 3);

    // Cross-host restores: each finds the longest generation, byte-exact.
    assert_eq!(lookup(&host_a, NS_A, &conv, 0), Some(m3.clone()));
    assert_eq!(lookup(&host_b, NS_A, &conv[..50], 0), Some(m2.clone()));
    assert_eq!(lookup(&host_b, NS_A, &conv[..44], 0), Some(m1.clone()));
    assert_eq!(lookup(&host_b, NS_A, &conv[..19], 0), None);
    for key in &p3 {
        assert_eq!(host_a.fetch_page(NS_A, key, PAGE).unwrap(), page_of(key));
    }
    assert_eq!(
        a.get(SharedCounter::BytesFetched),
        p3.len() as u64 * PAGE,
        "verified page bytes are counted"
    );
}

#[test]
fn concurrent_uploads_of_one_generation_write_each_page_once() {
    let server = S3Server::shared();
    let bucket = server.bucket("concurrent");
    let hosts = [
        open(server.config(&bucket, "")),
        open(server.config(&bucket, "")),
    ];
    let conv = tokens(2, 64);
    let m = manifest(NS_A, &conv, 64, 2);
    let total = pages(&m).len() as u64;
    let reports: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = hosts
            .iter()
            .map(|h| s.spawn(|| h.upload(&m, source).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Every host either wrote or found each page; the manifest is there.
    for r in &reports {
        // A host that skipped the whole upload saw the manifest present.
        if r.pages_uploaded + r.dedup_hits > 0 {
            assert_eq!(r.pages_uploaded + r.dedup_hits, total);
        }
    }
    let uploaded: u64 = reports.iter().map(|r| r.pages_uploaded).sum();
    let written = reports.iter().filter(|r| r.manifest_written).count();
    assert!(uploaded >= total && written >= 1, "{reports:?}");
    // On S3 (and MinIO, R2...) `If-None-Match: *` is atomic, so `uploaded`
    // is exactly `total` and `written` 1. s3s-fs checks, then writes: two
    // puts racing past the check both land (identical bytes), which is
    // why this test cannot insist; the sequential exactly-once case is
    // `two_hosts_share_generations_and_each_page_is_uploaded_once`.
    let stored = server.objects(&bucket, "v1/");
    assert_eq!(
        stored.len() as u64,
        total + 1,
        "one object per page, one manifest"
    );
    assert_eq!(lookup(&hosts[0], NS_A, &conv, 0), Some(m));
}

#[test]
fn lookup_returns_the_longest_exact_prefix_and_sends_bounded_requests() {
    let server = S3Server::shared();
    let bucket = server.bucket("longest");
    let tier = open(server.config(&bucket, "p"));
    let conv = tokens(3, 64);
    for n in [10, 16, 30, 33] {
        tier.upload(&manifest(NS_A, &conv, n, 1), source).unwrap();
    }
    // Same first 32 tokens (same chunk root as 33), diverging at token 34.
    let mut fork = conv.clone();
    fork[33] ^= 1;
    tier.upload(&manifest(NS_A, &fork, 36, 1), source).unwrap();
    // Same first 20 tokens only.
    let mut other = conv.clone();
    other[20] ^= 1;
    tier.upload(&manifest(NS_A, &other, 40, 1), source).unwrap();

    let query = roots(NS_A, &conv[..40]);
    let found = tier.lookup_detailed(&query, 0, LONG).unwrap();
    assert_eq!(found.manifest.as_ref().unwrap().prefix().num_tokens(), 33);
    // The tail hash in names selects the one candidate: one fetch; one
    // listing per chunk root at most (here the first root listed hits).
    assert_eq!(found.get_requests, 1);
    assert!(found.list_requests <= query.len() as u64, "{found:?}");

    let len_of = |q: &[u32], longer_than: u64| {
        lookup(&tier, NS_A, q, longer_than).map(|m| m.prefix().num_tokens())
    };
    assert_eq!(
        len_of(&conv[..33], 0),
        Some(33),
        "an exact boundary matches"
    );
    assert_eq!(len_of(&conv[..32], 0), Some(30));
    assert_eq!(len_of(&conv[..15], 0), Some(10));
    assert_eq!(len_of(&conv[..9], 0), None);
    assert_eq!(len_of(&conv[..40], 20), Some(33));
    assert_eq!(
        len_of(&conv[..40], 33),
        None,
        "nothing longer than the local hit"
    );
    // A query whose token 33 differs matches only up to 32 tokens.
    let mut tweak = conv[..40].to_vec();
    tweak[32] ^= 7;
    assert_eq!(len_of(&tweak, 0), Some(30));
    assert_eq!(len_of(&fork[..40], 0), Some(36));
    assert_eq!(len_of(&other[..50], 0), Some(40));

    // A long miss: one listing per chunk root, capped by max_lookup_roots.
    let miss = roots(NS_A, &tokens(99, 16 * 12));
    let r = tier.lookup_detailed(&miss, 0, LONG).unwrap();
    assert_eq!((r.miss, r.get_requests), (Some(LookupMiss::NoMatch), 0));
    assert_eq!(r.list_requests, 12);
    let mut capped = server.config(&bucket, "p");
    capped.max_lookup_roots = 4;
    let r = open(capped).lookup_detailed(&miss, 0, LONG).unwrap();
    assert_eq!(r.list_requests, 4);
}

#[test]
fn namespaces_and_tenants_never_cross() {
    let server = S3Server::shared();
    let bucket = server.bucket("isolation");
    let tenant1 = open(server.config(&bucket, "tenant1"));
    let tenant2 = open(server.config(&bucket, "tenant2"));
    let conv = tokens(4, 40);
    let in_a = manifest(NS_A, &conv, 40, 1);
    tenant1.upload(&in_a, source).unwrap();
    assert_eq!(lookup(&tenant1, NS_B, &conv, 0), None, "other namespace");
    assert_eq!(
        lookup(&tenant2, NS_A, &conv, 0),
        None,
        "other tenant prefix"
    );
    let in_b = manifest_with(NS_B, &conv, 40, 1, "other");
    tenant1.upload(&in_b, source).unwrap();
    assert_eq!(lookup(&tenant1, NS_A, &conv, 0), Some(in_a.clone()));
    assert_eq!(lookup(&tenant1, NS_B, &conv, 0), Some(in_b.clone()));
    // Pages live under their namespace: A's keys are not B's.
    let key = pages(&in_a).into_iter().next().unwrap();
    assert!(matches!(
        tenant1.fetch_page(NS_B, &key, PAGE),
        Err(Error::NotFound(_))
    ));
    // Every key under the tenant carries a namespace segment.
    let layout = tenant1.layout();
    for path in server.objects(&bucket, "tenant1/") {
        let key = path
            .strip_prefix(server.object_file(&bucket, ""))
            .unwrap()
            .to_string_lossy()
            .to_string();
        let under_a = key.starts_with(&layout.namespace_dir(NS_A));
        let under_b = key.starts_with(&layout.namespace_dir(NS_B));
        assert!(under_a ^ under_b, "{key}");
    }
    // A manifest copied into another namespace's place is refused.
    let a_key = layout.manifest_key(in_a.prefix(), in_a.generation());
    let b_key = layout.manifest_key(in_b.prefix(), in_b.generation());
    std::fs::copy(
        server.object_file(&bucket, &a_key),
        server.object_file(&bucket, &b_key),
    )
    .unwrap();
    let r = tenant1
        .lookup_detailed(&roots(NS_B, &conv), 0, LONG)
        .unwrap();
    assert_eq!((r.manifest, r.miss), (None, Some(LookupMiss::Corrupt)));
}

#[test]
fn corrupt_truncated_and_deleted_objects_are_clean_misses() {
    let server = S3Server::shared();
    let bucket = server.bucket("corrupt");
    let tier = open(server.config(&bucket, ""));
    let conv = tokens(5, 48);
    let m = manifest(NS_A, &conv, 48, 2);
    tier.upload(&m, source).unwrap();
    let query = roots(NS_A, &conv);
    let file = server.object_file(
        &bucket,
        &tier.layout().manifest_key(m.prefix(), m.generation()),
    );
    let good = std::fs::read(&file).unwrap();
    let miss = |expect: LookupMiss| {
        let r = tier.lookup_detailed(&query, 0, LONG).unwrap();
        assert_eq!((r.manifest, r.miss), (None, Some(expect)));
    };

    let mut flipped = good.clone();
    let at = good.len() - 10;
    flipped[at] ^= 0x20;
    std::fs::write(&file, &flipped).unwrap();
    miss(LookupMiss::Corrupt);
    std::fs::write(&file, &good[..good.len() / 2]).unwrap();
    miss(LookupMiss::Corrupt);
    std::fs::write(&file, b"").unwrap();
    miss(LookupMiss::Corrupt);
    let mut longer = good.clone();
    longer.extend_from_slice(b"tail");
    std::fs::write(&file, &longer).unwrap();
    miss(LookupMiss::Corrupt);
    std::fs::remove_file(&file).unwrap();
    miss(LookupMiss::NoMatch);
    std::fs::write(&file, &good).unwrap();
    assert_eq!(tier.lookup(&query, 0, LONG).unwrap(), Some(m.clone()));
    assert!(tier.counters().get(SharedCounter::ManifestsRejected) >= 4);

    // Pages: every defect is refused, never returned.
    let mut keys = pages(&m).into_iter();
    let (k1, k2) = (keys.next().unwrap(), keys.next().unwrap());
    let page_file = |k: &ObjectKey| server.object_file(&bucket, &tier.layout().page_key(NS_A, k));
    let good_page = std::fs::read(page_file(&k1)).unwrap();
    let corrupt = |bytes: &[u8]| {
        std::fs::write(page_file(&k1), bytes).unwrap();
        let r = tier.fetch_page(NS_A, &k1, PAGE);
        assert!(matches!(r, Err(Error::Corrupt(_))), "{r:?}");
    };
    let mut flipped = good_page.clone();
    flipped[100] ^= 1;
    corrupt(&flipped);
    corrupt(&good_page[..good_page.len() - 1]);
    corrupt(&good_page[..10]);
    corrupt(&std::fs::read(page_file(&k2)).unwrap()); // another key's object
    let mut longer = good_page.clone();
    longer.push(0);
    corrupt(&longer);
    std::fs::remove_file(page_file(&k1)).unwrap();
    assert!(matches!(
        tier.fetch_page(NS_A, &k1, PAGE),
        Err(Error::NotFound(_))
    ));
    assert!(matches!(
        tier.fetch_page(NS_A, &k2, PAGE + 1),
        Err(Error::Corrupt(_))
    ));
    assert_eq!(tier.fetch_page(NS_A, &k2, PAGE).unwrap(), page_of(&k2));
    assert_eq!(tier.counters().get(SharedCounter::FetchCorrupt), 6);
    assert_eq!(tier.counters().get(SharedCounter::FetchMissing), 1);

    // Garbage under a well-formed manifest name in the query's chunk root.
    let junk = tier.layout().manifest_key(
        &Prefix::new(
            NS_A,
            32,
            query[2].prefix_hash().to_vec(),
            conv[32..40].to_vec(),
        )
        .unwrap(),
        "junk",
    );
    std::fs::create_dir_all(server.object_file(&bucket, &junk).parent().unwrap()).unwrap();
    std::fs::write(
        server.object_file(&bucket, &junk),
        b"LMRCSHMF\x01\0\0\0 garbage",
    )
    .unwrap();
    assert_eq!(
        tier.lookup(&roots(NS_A, &conv[..40]), 0, LONG).unwrap(),
        None,
        "a garbage candidate is a miss"
    );
}

#[test]
fn a_crash_between_pages_and_manifest_leaves_no_visible_manifest() {
    let server = S3Server::shared();
    let bucket = server.bucket("crash");
    let conv = tokens(6, 64);
    let m = manifest(NS_A, &conv, 64, 2);
    let total = pages(&m).len();
    for crash_after in [0, 1, total / 2, total - 1] {
        // The "host" dies while reading its L2 after `crash_after` pages
        // (one request at a time, so exactly those pages reached the bucket).
        let prefix = format!("r{crash_after}");
        let mut config = server.config(&bucket, &prefix);
        config.concurrency = 1;
        let host = open(config);
        let served = AtomicUsize::new(0);
        let r = host.upload(&m, |k| {
            if served.fetch_add(1, Ordering::SeqCst) >= crash_after {
                return Err(Error::io("read L2", std::io::Error::other("host died")));
            }
            source(k)
        });
        assert!(r.is_err());
        assert_eq!(host.counters().get(SharedCounter::UploadFailures), 1);
        drop(host);
        let reader = open(server.config(&bucket, &prefix));
        assert_eq!(lookup(&reader, NS_A, &conv, 0), None);
        let objects = server.objects(&bucket, &format!("{prefix}/"));
        assert_eq!(objects.len(), crash_after, "only pages reached the bucket");
        assert!(
            objects
                .iter()
                .all(|p| p.extension().is_some_and(|e| e == "page")),
            "no manifest is visible after a crash at page {crash_after}"
        );
        // The restarted host redoes the upload: what reached the bucket is reused.
        let restarted = open(server.config(&bucket, &prefix));
        let report = restarted.upload(&m, source).unwrap();
        assert!(report.manifest_written);
        assert_eq!(report.dedup_hits, crash_after as u64);
        assert_eq!(report.pages_uploaded, (total - crash_after) as u64);
        assert_eq!(lookup(&reader, NS_A, &conv, 0), Some(m.clone()));
    }
}

#[test]
fn with_the_server_down_lookups_miss_and_uploads_resume_after() {
    let mut server = S3Server::start();
    let bucket = server.bucket("down");
    let mut config = server.config(&bucket, "");
    config.retry_timeout = Duration::from_millis(500);
    let tier = open(config);
    let conv = tokens(7, 48);
    let (m1, m2) = (manifest(NS_A, &conv, 20, 1), manifest(NS_A, &conv, 48, 1));
    tier.upload(&m1, source).unwrap();

    server.stop();
    let r = tier
        .lookup_detailed(&roots(NS_A, &conv), 0, Duration::from_secs(5))
        .unwrap();
    assert_eq!(r.manifest, None);
    assert!(
        matches!(r.miss, Some(LookupMiss::Error | LookupMiss::Timeout)),
        "{r:?}"
    );
    assert!(tier.upload(&m2, source).is_err(), "uploads fail while down");
    assert!(matches!(
        tier.fetch_page(NS_A, pages(&m1).iter().next().unwrap(), PAGE),
        Err(Error::Unavailable(_))
    ));
    let c = tier.counters();
    assert_eq!(c.get(SharedCounter::UploadFailures), 1);
    assert_eq!(
        c.get(SharedCounter::MissesError) + c.get(SharedCounter::MissesTimeout),
        1
    );

    server.restart();
    let report = tier.upload(&m2, source).unwrap();
    assert!(report.manifest_written);
    assert_eq!(lookup(&tier, NS_A, &conv, 0), Some(m2));
}

#[test]
fn a_server_that_never_answers_ends_the_lookup_at_its_timeout() {
    // Accepts connections and never replies: only the lookup's own timeout
    // can end the call (requests alone would wait 10 s each, and retry).
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = done.clone();
    let hold = std::thread::spawn(move || {
        let mut held = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((s, _)) => held.push(s),
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        held.len()
    });
    let config = SharedConfig::new("s3://blackhole/x")
        .with_option("aws_endpoint", endpoint)
        .with_option("aws_access_key_id", "k")
        .with_option("aws_secret_access_key", "s")
        .with_option("aws_region", "us-east-1")
        .with_option("aws_allow_http", "true");
    let tier = open(config);
    let conv = tokens(8, 40);
    let r = tier
        .lookup_detailed(&roots(NS_A, &conv), 0, Duration::from_millis(300))
        .unwrap();
    assert_eq!((r.manifest, r.miss), (None, Some(LookupMiss::Timeout)));
    assert_eq!(tier.counters().get(SharedCounter::MissesTimeout), 1);
    drop(tier);
    done.store(true, Ordering::SeqCst);
    assert!(hold.join().unwrap() > 0, "the lookup did reach the server");
}

#[test]
fn gc_removes_old_manifests_then_unreferenced_old_pages_only() {
    let server = S3Server::shared();
    let bucket = server.bucket("gc");
    let mut config = server.config(&bucket, "");
    config.refresh_age = Duration::from_secs(1800);
    let tier = open(config.clone());
    let conv = tokens(9, 64);
    let (old, live) = (manifest(NS_A, &conv, 24, 2), manifest(NS_A, &conv, 64, 2));
    let other_ns = manifest(NS_B, &conv, 64, 1);
    for m in [&old, &live, &other_ns] {
        tier.upload(m, source).unwrap();
    }
    // A crashed upload left orphan pages.
    let orphan = manifest(NS_A, &tokens(10, 32), 32, 1);
    let mut one_at_a_time = config.clone();
    one_at_a_time.concurrency = 1;
    let served = AtomicUsize::new(0);
    let _ = open(one_at_a_time).upload(&orphan, |k| {
        if served.fetch_add(1, Ordering::SeqCst) >= 2 {
            return Err(Error::invalid("crash"));
        }
        source(k)
    });
    let orphan_pages: Vec<ObjectKey> = pages(&orphan)
        .into_iter()
        .filter(|k| {
            server
                .object_file(&bucket, &tier.layout().page_key(NS_A, k))
                .exists()
        })
        .collect();
    assert_eq!(orphan_pages.len(), 2);

    // Age everything by two hours except the live manifests (their pages
    // age too: shared pages must survive through the reference alone) and
    // one orphan page (young: a concurrent upload may be about to name it).
    let two_hours = Duration::from_secs(7200);
    for path in server.objects(&bucket, "v1/") {
        set_age(&path, two_hours);
    }
    let layout = tier.layout();
    for m in [&live, &other_ns] {
        set_age(
            &server.object_file(&bucket, &layout.manifest_key(m.prefix(), m.generation())),
            Duration::ZERO,
        );
    }
    set_age(
        &server.object_file(&bucket, &layout.page_key(NS_A, &orphan_pages[1])),
        Duration::ZERO,
    );

    assert!(matches!(
        tier.gc(Duration::from_secs(60)),
        Err(Error::InvalidInput(_))
    ));
    let report = tier.gc(Duration::from_secs(3600)).unwrap();
    let (p_old, p_live) = (pages(&old), pages(&live));
    let only_old = p_old.difference(&p_live).count() as u64;
    assert_eq!(report.namespaces, 2);
    assert_eq!(report.manifests_deleted, 1);
    assert_eq!(report.manifests_kept, 2);
    assert_eq!(report.pages_deleted, only_old + 1, "{report:?}");
    assert_eq!(report.pages_young, 1);
    assert!(report.skipped.is_empty(), "{report:?}");
    assert_eq!(
        tier.counters().get(SharedCounter::GcPagesDeleted),
        only_old + 1
    );

    // Every page a remaining manifest names is intact.
    for (m, ns) in [(&live, NS_A), (&other_ns, NS_B)] {
        assert_eq!(lookup(&tier, ns, &conv, 0).as_ref(), Some(m));
        for key in pages(m) {
            assert_eq!(tier.fetch_page(ns, &key, PAGE).unwrap(), page_of(&key));
        }
    }
    assert_eq!(
        lookup(&tier, NS_A, &conv[..30], 0),
        None,
        "the old one is gone"
    );
    // An upload naming an old page refreshes it (gc sees it young again).
    let aged = layout.page_key(NS_A, p_live.iter().next().unwrap());
    let refreshed = manifest_with(NS_A, &conv, 64, 2, "again");
    let r = tier.upload(&refreshed, source).unwrap();
    assert!(r.pages_refreshed > 0, "{r:?}");
    let modified = std::fs::metadata(server.object_file(&bucket, &aged))
        .unwrap()
        .modified()
        .unwrap();
    assert!(modified > SystemTime::now() - Duration::from_secs(1800));
}

#[test]
fn gc_skips_a_namespace_with_an_unreadable_young_manifest() {
    let server = S3Server::shared();
    let bucket = server.bucket("gc-skip");
    let tier = open(server.config(&bucket, ""));
    let conv = tokens(11, 32);
    let m = manifest(NS_A, &conv, 32, 1);
    tier.upload(&m, source).unwrap();
    for path in server.objects(&bucket, "v1/") {
        set_age(&path, Duration::from_secs(7200));
    }
    let file = server.object_file(
        &bucket,
        &tier.layout().manifest_key(m.prefix(), m.generation()),
    );
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&file)
        .unwrap();
    f.write_all(b"x").unwrap();
    drop(f);
    set_age(&file, Duration::ZERO);
    let report = tier.gc(Duration::from_secs(7000)).unwrap();
    assert_eq!(report.pages_deleted, 0);
    assert_eq!(report.skipped.len(), 1, "{report:?}");
}

#[test]
fn file_urls_work_through_the_same_code() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().join("shared").display());
    let host_a = open(SharedConfig::new(url.clone()));
    let host_b = open(SharedConfig::new(url));
    let conv = tokens(12, 40);
    let m = manifest(NS_A, &conv, 40, 2);
    let r = host_a.upload(&m, source).unwrap();
    assert!(r.manifest_written);
    let again = host_b
        .upload(&manifest_with(NS_A, &conv, 40, 2, "b"), source)
        .unwrap();
    assert_eq!(again.pages_uploaded, 0, "{again:?}");
    assert_eq!(again.dedup_hits, pages(&m).len() as u64);
    let found = lookup(&host_b, NS_A, &conv, 0).unwrap();
    assert_eq!(found.prefix(), m.prefix());
    for key in pages(&m) {
        assert_eq!(host_b.fetch_page(NS_A, &key, PAGE).unwrap(), page_of(&key));
    }
    assert!(SharedTier::open(SharedConfig::new("file://relative")).is_err());
    assert!(SharedTier::open(SharedConfig::new("ftp://x")).is_err());
}
