//! Overlapping stores that share content-addressed pages never lose a
//! generation (the loss of local-inference-lab/vllm#725). A store that
//! finds a shared page being written by another lease is told `busy`, keeps
//! its generation pending, and after the writer commits reuses the page (no
//! copy) or after it aborts writes the page itself.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use lmcache_rc_core::Manifest;
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::service::{LeaseStatus, ServiceConfig};

use crate::service_common::*;

both_ways!(
    waiter_reuses_pages_the_first_writer_commits,
    waiter_writes_pages_the_first_writer_aborts,
    pages_reused_from_a_writer_that_later_aborts_stay_with_the_waiter,
    concurrent_overlapping_stores_never_lose_a_generation,
);

/// The pages of one boundary checkpoint of a conversation: attention pages
/// (shared by every later boundary), one recurrent page and one auxiliary page.
fn boundary(ns: &str, conversation: &[u32], n: usize, kind: &str) -> Manifest {
    let pages = (n as u64).div_ceil(16);
    let groups = vec![
        GroupSpec::new(
            "engine-kv-group:0",
            512,
            (0..pages).collect(),
            Role::Attention(16),
        ),
        GroupSpec::new(
            "engine-kv-group:1",
            1024,
            vec![0],
            Role::Endpoint("recurrent:1".into()),
        ),
        GroupSpec::new(
            "target-draft-auxiliary",
            256,
            vec![0],
            Role::Endpoint(format!("auxiliary:0:{kind}")),
        ),
    ];
    build_manifest(ns, &conversation[..n], 4, &groups, 2, kind)
}

/// Prepares every rank while another generation holds the shared pages:
/// each answers busy, and nothing is leased or pinned for it.
fn assert_all_ranks_busy(svc: &impl AsTarget, m: &Manifest) {
    let svc = svc.target();
    let (leases, pins) = (stat(svc, "store_leases"), stat(svc, "pins"));
    for rank in 0..4 {
        let lease = svc.prepare_store(m, rank).unwrap();
        assert_eq!(lease.status, LeaseStatus::Busy, "rank {rank}");
    }
    assert_eq!(stat(svc, "store_leases"), leases);
    assert_eq!(stat(svc, "pins"), pins);
}

fn waiter_reuses_pages_the_first_writer_commits<T: Target>() {
    let svc = T::open(config("725-commit", None)).unwrap();
    let conv = seq(11_000, 200);
    let instruction = boundary(NS, &conv, 64, "instruction");
    let prompt = boundary(NS, &conv, 150, "prompt");
    assert!(svc.begin(&instruction).unwrap());
    assert!(svc.begin(&prompt).unwrap());
    let first: Vec<_> = (0..4).map(|r| prepare(&svc, &instruction, r)).collect();
    assert_all_ranks_busy(&svc, &prompt);
    for (rank, lease) in first.iter().enumerate() {
        fill(&svc, &instruction, rank as u32, lease);
        let published = svc
            .finish_store(lease.lease_id.as_deref().unwrap(), true, None)
            .unwrap();
        assert_eq!(published, rank == 3);
    }
    for rank in 0..4 {
        let lease = prepare(&svc, &prompt, rank);
        assert_eq!(lease.status, LeaseStatus::Ready);
        assert_eq!(
            lease.slots[0][..4],
            [None, None, None, None],
            "shared pages reused"
        );
        assert!(lease.slots[0][4..].iter().all(Option::is_some));
        fill(&svc, &prompt, rank, &lease);
        svc.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
            .unwrap();
    }
    assert!(is_listed(&svc, &instruction) && is_listed(&svc, &prompt));
    restore_all(&svc, &instruction);
    restore_all(&svc, &prompt);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn waiter_writes_pages_the_first_writer_aborts<T: Target>() {
    let svc = T::open(config("725-abort", None)).unwrap();
    let conv = seq(12_000, 200);
    let instruction = boundary(NS, &conv, 64, "instruction");
    let prompt = boundary(NS, &conv, 150, "prompt");
    assert!(svc.begin(&instruction).unwrap());
    assert!(svc.begin(&prompt).unwrap());
    let first: Vec<_> = (0..4).map(|r| prepare(&svc, &instruction, r)).collect();
    assert_all_ranks_busy(&svc, &prompt);
    // Ranks 0 and 1 commit, rank 2 fails: the generation is aborted, and the
    // committed pages of an aborted generation are not kept.
    for (rank, lease) in first.iter().enumerate() {
        fill(&svc, &instruction, rank as u32, lease);
        let ok = rank != 2;
        assert!(
            !svc.finish_store(lease.lease_id.as_deref().unwrap(), ok, None)
                .unwrap()
        );
    }
    assert!(!is_listed(&svc, &instruction));
    assert_eq!(
        stat(&svc, "pending"),
        1,
        "the waiter's generation is still pending"
    );
    for rank in 0..4 {
        let lease = prepare(&svc, &prompt, rank);
        assert_eq!(lease.status, LeaseStatus::Ready);
        assert!(
            lease.slots.iter().flatten().all(Option::is_some),
            "rank {rank}: every page is written again"
        );
        fill(&svc, &prompt, rank, &lease);
        svc.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
            .unwrap();
    }
    assert!(is_listed(&svc, &prompt));
    restore_all(&svc, &prompt);
    assert_idle(&svc);
    svc.close().unwrap();
}

fn pages_reused_from_a_writer_that_later_aborts_stay_with_the_waiter<T: Target>() {
    let svc = T::open(config("725-mixed", None)).unwrap();
    let conv = seq(13_000, 200);
    let instruction = boundary(NS, &conv, 64, "instruction");
    let prompt = boundary(NS, &conv, 150, "prompt");
    assert!(svc.begin(&instruction).unwrap());
    assert!(svc.begin(&prompt).unwrap());
    let first: Vec<_> = (0..4).map(|r| prepare(&svc, &instruction, r)).collect();
    for (rank, lease) in first.iter().enumerate().take(2) {
        fill(&svc, &instruction, rank as u32, lease);
        svc.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
            .unwrap();
    }
    // Ranks 0 and 1 reuse the committed pages; ranks 2 and 3 are busy.
    let mut second = Vec::new();
    for rank in 0..2 {
        let lease = prepare(&svc, &prompt, rank);
        assert_eq!(lease.slots[0][..4], [None, None, None, None]);
        fill(&svc, &prompt, rank, &lease);
        second.push(lease);
    }
    for rank in 2..4 {
        assert_eq!(
            svc.prepare_store(&prompt, rank).unwrap().status,
            LeaseStatus::Busy
        );
    }
    // The writer aborts: its pending generation lets go of the pages, but the
    // waiter pinned them and still publishes them.
    for lease in &first[2..] {
        assert!(
            !svc.finish_store(lease.lease_id.as_deref().unwrap(), false, None)
                .unwrap()
        );
    }
    for lease in &second {
        svc.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
            .unwrap();
    }
    for rank in 2..4 {
        let (_, copied) = store_one(&svc, &prompt, rank);
        assert_eq!(
            copied,
            10 * 512 + 1024 + 256,
            "rank {rank} writes all its pages"
        );
    }
    assert!(!is_listed(&svc, &instruction));
    assert!(is_listed(&svc, &prompt));
    restore_all(&svc, &prompt);
    assert_idle(&svc);
    svc.close().unwrap();
}

/// xorshift64*: a small deterministic generator (the seed is printed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What one attempt to store a generation saw.
#[derive(Debug, Default)]
struct Attempt {
    /// begin answered false: an identical attempt was pending or listed.
    suppressed: bool,
    /// A rank of this attempt failed on purpose.
    injected: bool,
    /// finish_store calls of this attempt that answered "published".
    published: usize,
    /// Stated reasons of ranks that did not store (miss or refusal).
    refused: Vec<String>,
}

/// Stores one generation with one thread per rank, in random order with
/// random copy times; `fail_rank` finishes as failed. Like the scheduler,
/// aborts the generation when any rank did not succeed.
fn store_concurrently(
    svc: &impl AsTarget,
    m: &Manifest,
    seed: u64,
    fail_rank: Option<u32>,
) -> Attempt {
    let svc = svc.target();
    if !svc.begin(m).unwrap() {
        return Attempt {
            suppressed: true,
            ..Attempt::default()
        };
    }
    let results: Vec<(u32, Result<bool, String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..m.world_size())
            .map(|rank| {
                s.spawn(move || {
                    let mut rng = Rng((seed ^ (u64::from(rank) + 1).wrapping_mul(0x9e37_79b9)) | 1);
                    std::thread::sleep(Duration::from_micros(rng.below(2000)));
                    let deadline = Instant::now() + HANG_GUARD;
                    let lease = loop {
                        let lease = match svc.prepare_store(m, rank) {
                            Ok(lease) => lease,
                            Err(e) => return (rank, Err(format!("refused: {e}"))),
                        };
                        if lease.status != LeaseStatus::Busy {
                            break lease;
                        }
                        assert!(Instant::now() < deadline, "busy forever");
                        std::thread::sleep(Duration::from_micros(200 + rng.below(800)));
                    };
                    if lease.status == LeaseStatus::Miss {
                        return (rank, Err(format!("miss {:?}", lease.reason)));
                    }
                    fill(svc, m, rank, &lease);
                    std::thread::sleep(Duration::from_micros(rng.below(3000)));
                    let ok = fail_rank != Some(rank);
                    let published = svc
                        .finish_store(lease.lease_id.as_deref().unwrap(), ok, None)
                        .unwrap();
                    (rank, Ok(published))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let refused: Vec<String> = results
        .iter()
        .filter_map(|(rank, r)| r.as_ref().err().map(|e| format!("rank {rank}: {e}")))
        .collect();
    if fail_rank.is_some() || !refused.is_empty() {
        svc.abort(m.generation()).unwrap();
    }
    Attempt {
        suppressed: false,
        injected: fail_rank.is_some(),
        published: results.iter().filter(|(_, r)| *r == Ok(true)).count(),
        refused,
    }
}

fn concurrent_overlapping_stores_never_lose_a_generation<T: Target>() {
    let seed = std::env::var("LMRC_OVERLAP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    println!("overlapping stores: stress seed {seed} (set LMRC_OVERLAP_SEED to replay)");
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let cfg = ServiceConfig {
        l1_bytes: 16 << 20,
        retrieve_timeout: HANG_GUARD,
        store_admission_timeout: HANG_GUARD,
        ..config("725-stress", Some(&l2))
    };
    let svc = T::open(cfg).unwrap();
    let mut rng = Rng(seed | 1);

    // Two conversations; each turn emits instruction, prompt and response
    // checkpoints of one growing token sequence. Every boundary is submitted
    // twice (a replayed request) and 1 in 8 submissions fails a rank.
    let mut jobs: Vec<(Manifest, Option<u32>, u64)> = Vec::new();
    for c in 0..2u32 {
        let conv = seq(20_000 + c * 5_000, 600);
        let ns = format!("recurrent-sha256-v1:725-{c}");
        let mut boundaries = vec![(40, "instruction")];
        for turn in 0..6 {
            boundaries.push((70 + 80 * turn, "prompt"));
            boundaries.push((101 + 80 * turn, "response"));
        }
        for (n, kind) in boundaries {
            let m = boundary(&ns, &conv, n, kind);
            for _ in 0..2 {
                let fail = (rng.below(8) == 0).then(|| rng.below(4) as u32);
                jobs.push((m.clone(), fail, rng.next() | 1));
            }
        }
    }
    // Shuffle lightly: neighbours stay close so overlapping prefixes race.
    for i in (1..jobs.len()).rev() {
        let j = i.saturating_sub(rng.below(4) as usize);
        jobs.swap(i, j);
    }

    let next = AtomicUsize::new(0);
    let attempts: Mutex<Vec<(Manifest, Attempt)>> = Mutex::new(Vec::new());
    // Meanwhile a reader restores generations already published: each
    // restore is exact (published generations are never evicted here).
    let restorable: Mutex<Vec<Manifest>> = Mutex::new(Vec::new());
    let writers_done = AtomicUsize::new(0);
    let restores = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((m, fail, seed)) = jobs.get(i) else {
                        break;
                    };
                    let attempt = store_concurrently(&svc, m, *seed, *fail);
                    if attempt.published == 1 {
                        restorable.lock().unwrap().push(m.clone());
                    }
                    attempts.lock().unwrap().push((m.clone(), attempt));
                }
                writers_done.fetch_add(1, Ordering::Relaxed);
            });
        }
        s.spawn(|| {
            let mut rng = Rng(seed.rotate_left(17) | 1);
            while writers_done.load(Ordering::Relaxed) < 4 {
                let pick = {
                    let list = restorable.lock().unwrap();
                    (!list.is_empty()).then(|| list[rng.below(list.len() as u64) as usize].clone())
                };
                match pick {
                    Some(m) => {
                        let rank = rng.below(4) as u32;
                        if let Err(reason) = restore(&svc, &m, rank) {
                            panic!("{} rank {rank} missed: {reason}", m.generation());
                        }
                        restores.fetch_add(1, Ordering::Relaxed);
                    }
                    None => std::thread::sleep(Duration::from_millis(1)),
                }
            }
        });
    });
    settle(&svc);

    // Per generation: it publishes exactly once unless one of its attempts
    // failed a rank on purpose; only then may an attempt be refused or miss
    // (a late rank of an aborted attempt is indistinguishable from a rank
    // of the next attempt of the same content), and publication is optional.
    let mut by_gen: HashMap<String, (Manifest, Vec<Attempt>)> = HashMap::new();
    for (m, attempt) in attempts.into_inner().unwrap() {
        by_gen
            .entry(m.generation().to_string())
            .or_insert_with(|| (m, Vec::new()))
            .1
            .push(attempt);
    }
    let (mut published, mut failed) = (Vec::new(), 0);
    for (m, attempts) in by_gen.values() {
        let g = m.generation();
        let publications: usize = attempts.iter().map(|a| a.published).sum();
        assert!(
            publications <= 1,
            "{g} published {publications} times: {attempts:?}"
        );
        assert_eq!(is_listed(&svc, m), publications == 1, "{g}: {attempts:?}");
        if attempts.iter().any(|a| a.injected) {
            if publications == 0 {
                failed += 1;
            }
        } else {
            assert!(
                attempts.iter().all(|a| a.refused.is_empty()),
                "{g}: a rank did not store although nothing failed: {attempts:?}"
            );
            assert_eq!(publications, 1, "{g}: lost generation: {attempts:?}");
        }
        if publications == 1 {
            published.push(m);
        }
    }
    let suppressed = by_gen
        .values()
        .flat_map(|(_, a)| a)
        .filter(|a| a.suppressed)
        .count();
    println!(
        "overlapping stores: {} generations published, {failed} failed closed after an injected \
         rank failure, {suppressed} replays suppressed, {} busy answers, {} concurrent restores",
        published.len(),
        stat(&svc, "admission_busy"),
        restores.load(Ordering::Relaxed)
    );
    assert_eq!(stat(&svc, "pending"), 0);
    assert_eq!(stat(&svc, "generations"), published.len() as u64);
    assert_idle(&svc);
    assert_eq!(l2_files(&l2), expected_l2(published.iter().copied()));
    for m in &published {
        restore_all(&svc, m);
    }
    assert_idle(&svc);
    svc.close().unwrap();
}
