//! Write once, leak nothing (I6, I7), measured through `status()` counters
//! with an L2 tier: an exact replay writes 0 payload bytes, a continuation
//! writes only its new pages, pages only on disk are reused rather than
//! rewritten, and replaced or evicted generations leave no objects behind in
//! L1 or L2 (the leak of local-inference-lab/vllm#716).
//!
//! `cargo test -p lmcache-rc-core -- --nocapture service_write_once` prints the figures.

use std::collections::BTreeMap;

use lmcache_rc_core::Manifest;
use lmcache_rc_core::cost::Eviction;
use lmcache_rc_core::service::ServiceConfig;
use lmcache_rc_core::store::l2::object_file_bytes;

use crate::service_common::*;

both_ways!(
    replay_writes_nothing_and_continuation_writes_only_new_pages,
    pages_only_on_disk_are_reused_not_rewritten,
);

// The directory's max_entries bound is least recently used under both
// eviction policies; the objects it frees go under both.
every_policy!(generations_evicted_by_max_entries_leave_no_objects);

/// (l2_bytes_written, l2_objects, l2_bytes) from status().
fn l2_figures(svc: &impl AsTarget) -> (u64, u64, u64) {
    let svc = svc.target();
    (
        stat(svc, "l2_bytes_written"),
        stat(svc, "l2_objects"),
        stat(svc, "l2_bytes"),
    )
}

/// Checks that both tiers hold exactly the objects the listed generations
/// reference: the object table, L1, the L2 accounting and the files on disk.
fn assert_tiers_hold_exactly(svc: &impl AsTarget, l2: &std::path::Path, listed: &[&Manifest]) {
    let svc = svc.target();
    for m in listed {
        assert!(is_listed(svc, m), "{} should be listed", m.generation());
    }
    let (files, bytes) = expected_l2(listed.iter().copied());
    assert_eq!(stat(svc, "objects"), files, "object table");
    assert_eq!(stat(svc, "l1_objects"), files, "L1 copies");
    assert_eq!(
        (stat(svc, "l2_objects"), stat(svc, "l2_bytes")),
        charged_l2(listed.iter().copied(), l2),
        "l2_bytes counts what the files take on disk"
    );
    assert_eq!(l2_files(l2), (files, bytes), "files on disk");
    assert_eq!(stat(svc, "generations"), listed.len() as u64);
}

/// The bytes and files a store of `m` must add to L2 given what `before` holds.
fn new_objects(before: &[&Manifest], m: &Manifest) -> (u64, u64) {
    let mut old = BTreeMap::new();
    for b in before {
        old.extend(key_sizes(b));
    }
    let new: Vec<u64> = key_sizes(m)
        .into_iter()
        .filter(|(k, _)| !old.contains_key(k))
        .map(|(_, bytes)| bytes)
        .collect();
    (
        new.len() as u64,
        new.iter().map(|&b| object_file_bytes(b)).sum(),
    )
}

fn groups(kind: &str) -> Vec<GroupSpec> {
    vec![
        GroupSpec::new(
            "engine-kv-group:0",
            4096,
            (0..8).collect(),
            Role::Attention(16),
        ),
        GroupSpec::new(
            "engine-kv-group:1",
            8192,
            vec![0],
            Role::Endpoint("recurrent:1".into()),
        ),
        GroupSpec::new(
            "target-draft-auxiliary",
            2048,
            vec![0],
            Role::Endpoint(format!("auxiliary:0:{kind}")),
        ),
    ]
}

/// A 4-rank generation of the conversation's first `n` tokens (n <= 128).
fn generation(n: u32, kind: &str) -> Manifest {
    let tokens = seq(70_000, n);
    let mut g = groups(kind);
    g[0].positions = (0..u64::from(n).div_ceil(16)).collect();
    build_manifest(NS, &tokens, 4, &g, 2, kind)
}

fn replay_writes_nothing_and_continuation_writes_only_new_pages<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let svc = T::open(durable_config("716-a", dir.path())).unwrap();

    // First request: every page is new.
    let first = generation(100, "prompt");
    let copied = store_all(&svc, &first);
    settle(&svc);
    let (w1, f1, b1) = l2_figures(&svc);
    let (_, bytes) = expected_l2([&first]);
    assert_eq!((f1, b1), charged_l2([&first], &l2));
    assert_eq!(w1, bytes, "one durable write per object");
    assert_eq!(copied, key_sizes(&first).values().sum::<u64>());
    println!("write_once: first store:        {w1:>8} bytes written, {f1:>3} files");

    // Exact replay: suppressed at begin, before any reservation or copy.
    let leased_before = stat(&svc, "store_bytes_leased");
    assert!(
        !svc.begin(&first).unwrap(),
        "exact replay must be suppressed"
    );
    settle(&svc);
    let (w2, f2, _) = l2_figures(&svc);
    assert_eq!((w2 - w1, f2 - f1), (0, 0));
    assert_eq!(
        stat(&svc, "store_bytes_leased"),
        leased_before,
        "no slot leased"
    );
    println!(
        "write_once: exact replay:       {:>8} bytes written, {:>3} files",
        w2 - w1,
        f2 - f1
    );

    // Continuation: only pages with new content keys are copied and written.
    let cont = generation(120, "prompt");
    let (new_files, new_bytes) = new_objects(&[&first], &cont);
    // 6 full attention pages shared; the 7th (partial in the first, full now)
    // and 8th attention pages, the recurrent and the auxiliary page are new.
    assert_eq!(new_files, 4 * 4);
    let copied = store_all(&svc, &cont);
    settle(&svc);
    let (w3, f3, _) = l2_figures(&svc);
    assert_eq!(
        w3 - w2,
        new_bytes,
        "continuation writes exactly its new pages"
    );
    assert_eq!(f3 - f2, new_files);
    assert_eq!(
        copied,
        4 * (2 * 4096 + 8192 + 2048),
        "copies only the new pages"
    );
    println!(
        "write_once: continuation:       {:>8} bytes written, {:>3} files ({} pages reused)",
        w3 - w2,
        f3 - f2,
        key_sizes(&cont).len() as u64 - new_files
    );
    assert_tiers_hold_exactly(&svc, &l2, &[&first, &cont]);

    // Replacement: the same exact prefix with another payload. The replaced
    // generation's unique pages go from both tiers at once.
    let replacement = generation(120, "response");
    let (rep_files, rep_bytes) = new_objects(&[&first, &cont], &replacement);
    assert_eq!(rep_files, 4, "only the auxiliary page differs");
    store_all(&svc, &replacement);
    settle(&svc);
    assert!(!is_listed(&svc, &cont), "replaced");
    let (w4, f4, b4) = l2_figures(&svc);
    assert_eq!(w4 - w3, rep_bytes);
    assert_tiers_hold_exactly(&svc, &l2, &[&first, &replacement]);
    println!(
        "write_once: after replacement:  {:>8} bytes written, {f4:>3} files on disk, {b4} bytes on disk",
        w4 - w3
    );
    assert_idle(&svc);
    svc.close().unwrap();
    drop(svc);

    // An exact replay after a directory restart writes nothing either.
    let svc = T::open(durable_config("716-b", dir.path())).unwrap();
    assert!(!svc.begin(&first).unwrap());
    assert!(!svc.begin(&replacement).unwrap());
    settle(&svc);
    assert_eq!(stat(&svc, "l2_bytes_written"), 0);
    assert_eq!(stat(&svc, "l2_bytes"), b4);
    assert_eq!(l2_files(&l2), expected_l2([&first, &replacement]));
    assert_eq!(l2_files(&l2).0, f4);
    println!("write_once: replay after restart: 0 bytes written, {f4} files on disk");
    assert_idle(&svc);
    svc.close().unwrap();
}

fn generations_evicted_by_max_entries_leave_no_objects<T: Target>(eviction: Eviction) {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let cfg = ServiceConfig {
        max_entries: 2,
        ..with_eviction(config("716-evict", Some(&l2)), eviction)
    };
    let svc = T::open(cfg).unwrap();
    let gens: Vec<Manifest> = [40, 64, 90, 128]
        .iter()
        .map(|&n| generation(n, "prompt"))
        .collect();
    let mut written = Vec::new();
    for (i, m) in gens.iter().enumerate() {
        store_all(&svc, m);
        settle(&svc);
        written.push(stat(&svc, "l2_bytes_written"));
        let first_listed = i.saturating_sub(1);
        let listed: Vec<&Manifest> = gens[first_listed..=i].iter().collect();
        for old in &gens[..first_listed] {
            assert!(!is_listed(&svc, old), "evicted by max_entries");
        }
        assert_tiers_hold_exactly(&svc, &l2, &listed);
    }
    let (files, bytes) = l2_files(&l2);
    println!(
        "write_once: max_entries=2 after 4 generations: {files} files, {bytes} bytes on disk, \
         {} bytes written in all",
        written[3]
    );
    for m in &gens[2..] {
        restore_all(&svc, m);
    }
    assert_idle(&svc);
    svc.close().unwrap();
}

fn pages_only_on_disk_are_reused_not_rewritten<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let svc = T::open(config("716-disk", Some(&l2))).unwrap();
    let first = generation(100, "prompt");
    store_all(&svc, &first);
    settle(&svc);
    // RAM is dropped: the first generation's pages exist only on disk.
    svc.clear(false, false).unwrap();
    assert_eq!(stat(&svc, "l1_objects"), 0);
    let written = stat(&svc, "l2_bytes_written");
    let cont = generation(120, "prompt");
    let (new_files, new_bytes) = new_objects(&[&first], &cont);
    let copied = store_all(&svc, &cont);
    settle(&svc);
    assert_eq!(
        copied,
        4 * (2 * 4096 + 8192 + 2048),
        "disk-resident pages are not copied"
    );
    assert_eq!(stat(&svc, "l2_bytes_written") - written, new_bytes);
    assert_eq!(l2_files(&l2), expected_l2([&first, &cont]));
    println!(
        "write_once: continuation over disk-only pages: {new_bytes} bytes written, {new_files} files"
    );
    restore_all(&svc, &cont);
    restore_all(&svc, &first);
    assert_idle(&svc);
    svc.close().unwrap();
}
