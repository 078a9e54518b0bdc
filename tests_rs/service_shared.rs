//! The shared tier inside the service (`docs/design/shared-tier.md` §10):
//! two services on separate L1/L2/directories and one bucket of a real
//! s3s-fs server play two hosts. Host A's durable generations are uploaded
//! behind its back; host B's `find` imports them and its restores fetch the
//! pages, verified, into L1. The object store is never mocked: corruption
//! and deletion are done on the server's backing files.

use std::path::Path;
use std::time::{Duration, Instant};

use lmcache_rc_core::Manifest;
use lmcache_rc_core::TokenRoots;
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::service::{CheckpointService, ServiceConfig, SharedSettings};

use crate::s3_server::{ACCESS_KEY, S3Server, SECRET_KEY};
use crate::service_common::*;

both_ways!(
    a_generation_stored_on_one_host_restores_byte_exact_on_another,
    find_located_says_where_the_pages_sit_and_what_loading_them_costs,
    clearing_a_page_whose_other_copy_is_in_the_shared_tier_keeps_its_generation,
);

const NS_OTHER: &str = "recurrent-sha256-v1:service-suite-other";

/// The settings of a host on `bucket` of `server`.
fn shared_settings(server: &S3Server, bucket: &str) -> SharedSettings {
    SharedSettings {
        options: vec![
            ("aws_endpoint".into(), server_endpoint(server)),
            ("aws_access_key_id".into(), ACCESS_KEY.into()),
            ("aws_secret_access_key".into(), SECRET_KEY.into()),
            ("aws_region".into(), "us-east-1".into()),
            ("aws_allow_http".into(), "true".into()),
        ],
        // Generous: a lookup must not time out on a busy test machine (the
        // default 200 ms did, failing a find that was not about timing).
        // Tests of the timeout set their own.
        lookup_timeout: std::time::Duration::from_secs(10),
        ..SharedSettings::new(format!("s3://{bucket}/h"))
    }
}

fn server_endpoint(server: &S3Server) -> String {
    format!("http://127.0.0.1:{}", server.port())
}

/// A host: durable directory and L2 under `dir`, the shared tier on `bucket`.
fn host(dir: &Path, server: &S3Server, bucket: &str) -> ServiceConfig {
    ServiceConfig {
        shared: Some(shared_settings(server, bucket)),
        ..durable_config("shared-host", dir)
    }
}

/// A turn of a conversation: the first `n` tokens of sequence `base`.
pub(crate) fn turn(ns: &str, base: u32, n: u32) -> Manifest {
    standard(ns, &seq(base, n), "prompt", 2)
}

/// The chunk roots of a query (what the connector's `find` sends).
pub(crate) fn query(ns: &str, base: u32, n: u32) -> Vec<lmcache_rc_core::Prefix> {
    TokenRoots::build(ns, seq(base, n), 4096).unwrap().roots()
}

/// Waits until the host's upload queue is empty and `n` uploads ended
/// (written or found present), or the hang guard passes.
pub(crate) fn wait_uploads(svc: &impl AsTarget, n: u64) {
    let deadline = Instant::now() + HANG_GUARD;
    loop {
        let done = stat(svc, "shared_manifests_written") + stat(svc, "shared_manifests_present");
        if done >= n && stat(svc, "shared_upload_queue") == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "uploads did not finish: {:?}",
            svc.target().status().unwrap().values
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn a_generation_stored_on_one_host_restores_byte_exact_on_another<T: Target>() {
    let server = S3Server::shared();
    let bucket = server.bucket("two-hosts");
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = T::open(host(dir_a.path(), server, &bucket)).unwrap();
    let b = T::open(host(dir_b.path(), server, &bucket)).unwrap();
    // A multi-turn conversation on A: turn 2 extends turn 1 (shared pages).
    let (t1, t2) = (turn(NS, 100, 48), turn(NS, 100, 96));
    store_all(&a, &t1);
    store_all(&a, &t2);
    settle(&a);
    wait_uploads(&a, 2);
    let pages_a = stat(&a, "shared_pages_uploaded");
    assert_eq!(
        pages_a,
        all_keys(&t1).union(&all_keys(&t2)).count() as u64,
        "each page is uploaded once, shared pages once for both turns"
    );
    assert!(
        stat(&a, "shared_dedup_hits") > 0,
        "turn 2 reused turn 1's pages"
    );

    // B has nothing; its find for turn 3's prompt imports turn 2 from A.
    assert_eq!(stat(&b, "generations"), 0);
    let found = b.find(&query(NS, 100, 120)).unwrap();
    assert_eq!(found.as_ref(), Some(&t2), "B finds A's longest prefix");
    assert_eq!(stat(&b, "shared_imports"), 1);
    restore_all(&b, &t2);
    assert_eq!(
        stat(&b, "shared_fetches"),
        all_keys(&t2).len() as u64,
        "every page came from the shared tier once"
    );
    // Once its pages are in B's L2, the imported generation is durable there,
    // and B uploads nothing: the manifest is found present.
    settle(&b);
    wait_uploads(&b, 1);
    let rows = b.list_generations().unwrap();
    assert_eq!(rows.len(), 1);
    assert!(rows[0].durable, "imported and fetched: durable on B");
    assert_eq!(stat(&b, "shared_pages_uploaded"), 0);
    assert_eq!(stat(&b, "shared_manifests_written"), 0);
    // A second restore is local (L1/L2), no fetch.
    restore_all(&b, &t2);
    assert_eq!(stat(&b, "shared_fetches"), all_keys(&t2).len() as u64);

    // B continues the conversation: only its new pages are uploaded.
    let t3 = turn(NS, 100, 120);
    store_all(&b, &t3);
    settle(&b);
    wait_uploads(&b, 2);
    let new_pages = all_keys(&t3).difference(&all_keys(&t2)).count() as u64;
    assert_eq!(stat(&b, "shared_pages_uploaded"), new_pages);
    assert_idle(&a);
    assert_idle(&b);
}

#[test]
fn a_restarted_host_uploads_what_it_had_not_uploaded() {
    let mut server = S3Server::start();
    let bucket = server.bucket("restart");
    let dir_a = tempfile::tempdir().unwrap();
    let t1 = turn(NS, 200, 48);
    server.stop();
    {
        // The store is down: A stores, its upload fails and waits for a retry.
        let a = CheckpointService::open(host(dir_a.path(), &server, &bucket)).unwrap();
        store_all(&a, &t1);
        settle(&a);
        assert_eq!(stat(&a, "shared_manifests_written"), 0);
        a.close().unwrap();
    }
    server.restart();
    let a = CheckpointService::open(host(dir_a.path(), &server, &bucket)).unwrap();
    wait_uploads(&a, 1);
    assert_eq!(stat(&a, "shared_manifests_written"), 1);
    let dir_b = tempfile::tempdir().unwrap();
    let b = CheckpointService::open(host(dir_b.path(), &server, &bucket)).unwrap();
    assert_eq!(b.find(&query(NS, 200, 60)).unwrap().as_ref(), Some(&t1));
    restore_all(&b, &t1);
}

#[test]
fn a_corrupt_or_deleted_remote_page_is_a_clean_miss_that_retires_the_import() {
    let server = S3Server::shared();
    let bucket = server.bucket("bad-page");
    let dir_a = tempfile::tempdir().unwrap();
    let a = CheckpointService::open(host(dir_a.path(), server, &bucket)).unwrap();
    let (good, corrupt, deleted) = (turn(NS, 300, 48), turn(NS, 400, 48), turn(NS, 500, 48));
    for m in [&good, &corrupt, &deleted] {
        store_all(&a, m);
    }
    settle(&a);
    wait_uploads(&a, 3);
    // Damage one page of each bad generation on the server.
    let page_file = |m: &Manifest| {
        let key = rank_keys(m, 1)[1][0];
        let hex = key.hex();
        let found: Vec<_> = server
            .objects(&bucket, "h/")
            .into_iter()
            .filter(|p| p.to_string_lossy().ends_with(&format!("{hex}.page")))
            .collect();
        assert_eq!(found.len(), 1, "{hex}");
        found[0].clone()
    };
    let f = page_file(&corrupt);
    let mut bytes = std::fs::read(&f).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&f, bytes).unwrap();
    std::fs::remove_file(page_file(&deleted)).unwrap();

    let dir_b = tempfile::tempdir().unwrap();
    let b = CheckpointService::open(host(dir_b.path(), server, &bucket)).unwrap();
    for bad in [&corrupt, &deleted] {
        let base = if bad == &corrupt { 400 } else { 500 };
        assert_eq!(b.find(&query(NS, base, 60)).unwrap().as_ref(), Some(bad));
        // Rank 0 does not need the damaged page; rank 1 does.
        restore(&b, bad, 0).unwrap();
        assert_eq!(restore(&b, bad, 1).unwrap_err(), "shared_fetch_error");
        assert!(
            !b.list_generations()
                .unwrap()
                .iter()
                .any(|g| g.generation == bad.generation()),
            "the import is retired once a page proved bad"
        );
        assert_eq!(
            b.find(&query(NS, base, 60)).unwrap(),
            None,
            "and not imported again"
        );
    }
    assert_eq!(stat(&b, "shared_fetch_errors"), 2);
    assert_eq!(stat(&b, "shared_fetch_corrupt"), 1);
    assert_eq!(stat(&b, "shared_fetch_missing"), 1);
    // The good one is unaffected.
    assert_eq!(b.find(&query(NS, 300, 60)).unwrap().as_ref(), Some(&good));
    restore_all(&b, &good);
    settle(&b);
    assert_idle(&b);
}

#[test]
fn a_corrupt_remote_manifest_is_not_imported() {
    let server = S3Server::shared();
    let bucket = server.bucket("bad-manifest");
    let dir_a = tempfile::tempdir().unwrap();
    let a = CheckpointService::open(host(dir_a.path(), server, &bucket)).unwrap();
    let m = turn(NS, 600, 48);
    store_all(&a, &m);
    settle(&a);
    wait_uploads(&a, 1);
    let manifests: Vec<_> = server
        .objects(&bucket, "h/")
        .into_iter()
        .filter(|p| p.to_string_lossy().ends_with(".manifest"))
        .collect();
    assert_eq!(manifests.len(), 1);
    let mut bytes = std::fs::read(&manifests[0]).unwrap();
    let n = bytes.len();
    bytes[n - 2] ^= 0x20;
    std::fs::write(&manifests[0], bytes).unwrap();
    let dir_b = tempfile::tempdir().unwrap();
    let b = CheckpointService::open(host(dir_b.path(), server, &bucket)).unwrap();
    assert_eq!(b.find(&query(NS, 600, 60)).unwrap(), None);
    assert_eq!(stat(&b, "shared_imports"), 0);
    assert_eq!(stat(&b, "shared_misses_corrupt"), 1);
    assert_eq!(stat(&b, "generations"), 0);
}

#[test]
fn with_the_store_down_a_host_serves_its_own_data_and_finds_answer() {
    let server = S3Server::start();
    let bucket = server.bucket("down");
    let dir_b = tempfile::tempdir().unwrap();
    let b = CheckpointService::open(host(dir_b.path(), &server, &bucket)).unwrap();
    let local = turn(NS, 700, 48);
    store_all(&b, &local);
    settle(&b);
    wait_uploads(&b, 1);
    server.stop();
    // A longer query than the local hit asks the dead store: it answers the
    // local hit, and the lookup counts as a miss by error or timeout.
    let found = b.find(&query(NS, 700, 60)).unwrap();
    assert_eq!(found.as_ref(), Some(&local));
    restore_all(&b, &local);
    // Nothing local: a clean miss.
    assert_eq!(b.find(&query(NS, 800, 60)).unwrap(), None);
    let failed = stat(&b, "shared_misses_error") + stat(&b, "shared_misses_timeout");
    assert_eq!(failed, 2, "{:?}", b.status().unwrap().values);
    // New stores are served and their uploads wait for the store.
    let later = turn(NS, 900, 48);
    store_all(&b, &later);
    restore_all(&b, &later);
}

#[test]
fn namespaces_are_isolated_across_hosts() {
    let server = S3Server::shared();
    let bucket = server.bucket("isolation");
    let dir_a = tempfile::tempdir().unwrap();
    let a = CheckpointService::open(host(dir_a.path(), server, &bucket)).unwrap();
    let m = turn(NS, 1000, 48);
    store_all(&a, &m);
    settle(&a);
    wait_uploads(&a, 1);
    let dir_b = tempfile::tempdir().unwrap();
    let b = CheckpointService::open(host(dir_b.path(), server, &bucket)).unwrap();
    assert_eq!(
        b.find(&query(NS_OTHER, 1000, 60)).unwrap(),
        None,
        "the same tokens in another namespace find nothing"
    );
    assert_eq!(stat(&b, "shared_imports"), 0);
    assert_eq!(b.find(&query(NS, 1000, 60)).unwrap().as_ref(), Some(&m));
}

#[test]
fn a_full_upload_queue_drops_the_oldest_upload() {
    let server = S3Server::start();
    let bucket = server.bucket("queue");
    server.stop();
    let dir = tempfile::tempdir().unwrap();
    let mut config = host(dir.path(), &server, &bucket);
    if let Some(shared) = config.shared.as_mut() {
        shared.upload_queue = 1;
    }
    let a = CheckpointService::open(config).unwrap();
    for base in [1100, 1200, 1300, 1400] {
        store_all(&a, &turn(NS, base, 48));
        settle(&a);
    }
    // At most one upload runs and one waits: of four, two were dropped.
    assert!(stat(&a, "shared_uploads_dropped") >= 2);
    assert!(stat(&a, "shared_upload_queue") <= 2);
    assert_eq!(stat(&a, "shared_uploads_queued"), 4);
}

/// A shared tier on the directory `shared` (`file://`), every request to
/// it held `latency` (the test-only `inject_latency`).
pub(crate) fn file_shared(shared: &Path, latency: Duration) -> SharedSettings {
    SharedSettings {
        lookup_timeout: Duration::from_secs(10),
        inject_latency: latency,
        ..SharedSettings::new(format!("file://{}", shared.display()))
    }
}

/// A host with a durable directory and L2 under `dir` whose shared tier is
/// [`file_shared`].
pub(crate) fn file_host(dir: &Path, shared: &Path, latency: Duration) -> ServiceConfig {
    ServiceConfig {
        shared: Some(file_shared(shared, latency)),
        ..durable_config("shared-file-host", dir)
    }
}

/// `(tier, pages, bytes)` of a `find_located` answer.
fn residency(found: &lmcache_rc_core::protocol::Located) -> Vec<(String, u64, u64)> {
    found
        .tiers
        .iter()
        .map(|t| (t.tier.clone(), t.pages, t.bytes))
        .collect()
}

/// `find_located` answers what `find` answers plus where the pages sit: in
/// the shared tier only on a host that imported the checkpoint, in L1 once
/// restored, in L2 once L1 was cleared. Loads from L2 and the shared tier
/// are measured (status and the answer carry the figures); the injected
/// latency is a floor of what a shared fetch measures.
fn find_located_says_where_the_pages_sit_and_what_loading_them_costs<T: Target>() {
    let (dir_a, dir_b, shared) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let latency = Duration::from_millis(20);
    let a = T::open(file_host(dir_a.path(), shared.path(), Duration::ZERO)).unwrap();
    let b = T::open(file_host(dir_b.path(), shared.path(), latency)).unwrap();
    let m = turn(NS, 300, 64);
    let bytes: u64 = key_sizes(&m).values().sum();
    let pages = all_keys(&m).len() as u64;
    store_all(&a, &m);
    settle(&a);
    wait_uploads(&a, 1);
    let located = a.find_located(&query(NS, 300, 80)).unwrap().unwrap();
    assert_eq!(located.manifest, m);
    assert_eq!(residency(&located), [("l1".to_string(), pages, bytes)]);
    assert_eq!(located.tiers[0].parallelism, 1);

    // B imports it: every page is in the shared tier only, nothing measured yet.
    assert_eq!(stat(&b, "shared_load_samples"), 0);
    let located = b.find_located(&query(NS, 300, 80)).unwrap().unwrap();
    assert_eq!(located.manifest, m);
    assert_eq!(residency(&located), [("shared".to_string(), pages, bytes)]);
    let t = &located.tiers[0];
    assert_eq!((t.samples, t.latency_us, t.bytes_per_s), (0, 0, 0));
    assert_eq!(t.parallelism, 4, "the default fetch threads");
    restore_all(&b, &m);
    assert_eq!(stat(&b, "shared_load_samples"), pages);
    assert!(
        stat(&b, "shared_load_latency_us") >= latency.as_micros() as u64,
        "every fetch waited the injected latency: {}",
        stat(&b, "shared_load_latency_us")
    );
    assert!(stat(&b, "shared_load_bytes_per_s") > 0);

    // Restored: in L1 now.
    let located = b.find_located(&query(NS, 300, 80)).unwrap().unwrap();
    assert_eq!(residency(&located), [("l1".to_string(), pages, bytes)]);
    // Written to L2 and dropped from L1: loads from L2, measured too.
    settle(&b);
    b.clear(false, false).unwrap();
    let located = b.find_located(&query(NS, 300, 80)).unwrap().unwrap();
    assert_eq!(residency(&located), [("l2".to_string(), pages, bytes)]);
    assert_eq!(
        located.tiers[0].parallelism, 2,
        "the default L2 I/O threads"
    );
    assert_eq!(stat(&b, "l2_load_samples"), 0);
    restore_all(&b, &m);
    assert_eq!(stat(&b, "l2_load_samples"), pages);
    let located = b.find_located(&query(NS, 300, 80)).unwrap().unwrap();
    assert_eq!(residency(&located), [("l1".to_string(), pages, bytes)]);
    // The shared figures travel with a shared-tier answer; a miss is None.
    assert_eq!(b.find_located(&query(NS, 999, 80)).unwrap(), None);
    assert_eq!(
        b.find(&query(NS, 300, 80)).unwrap().as_ref(),
        Some(&m),
        "find answers the same candidate"
    );
    assert_idle(&a);
    assert_idle(&b);
}

/// `clear` drops local copies only: a page whose other copy is in the
/// shared tier still has one, so its generation stays listed (as eviction
/// keeps it) and the next restore fetches the page again. Host B, without
/// L2, imports A's checkpoint and restores it into L1; a clear of L1 (and
/// one of every local tier) retires nothing there.
fn clearing_a_page_whose_other_copy_is_in_the_shared_tier_keeps_its_generation<T: Target>() {
    let (dir_a, shared) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = T::open(file_host(dir_a.path(), shared.path(), Duration::ZERO)).unwrap();
    let b = T::open(ServiceConfig {
        shared: Some(file_shared(shared.path(), Duration::ZERO)),
        ..config("shared-clear-b", None)
    })
    .unwrap();
    let m = turn(NS, 500, 48);
    let pages = all_keys(&m).len() as u64;
    store_all(&a, &m);
    settle(&a);
    wait_uploads(&a, 1);
    assert_eq!(b.find(&query(NS, 500, 60)).unwrap().as_ref(), Some(&m));
    restore_all(&b, &m);
    assert_eq!(stat(&b, "shared_fetches"), pages);
    for all_tiers in [false, true] {
        let report = b.clear(true, all_tiers).unwrap();
        assert_eq!(
            (report.l1_objects, report.retired_generations),
            (pages, 0),
            "all_tiers={all_tiers}: every L1 copy dropped, nothing retired"
        );
        assert!(
            is_listed(&b, &m),
            "still listed after clear(all_tiers={all_tiers})"
        );
        restore_all(&b, &m);
    }
    assert_eq!(
        stat(&b, "shared_fetches"),
        3 * pages,
        "each restore after a clear fetched every page again"
    );
    assert_idle(&a);
    assert_idle(&b);
}
