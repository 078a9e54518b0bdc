//! Eviction policies (`lru`, `cost`; `docs/design/leases.md#eviction`):
//! what each takes first, and that under either a stream of stores,
//! restores and held leases keeps every invariant — no leased or pinned
//! page evicted (I4), no listed generation pointing at nothing, every
//! restore byte-exact, nothing left over at idle (I7), the tiers within
//! their capacity.

use std::time::Duration;

use lmcache_rc_core::Manifest;
use lmcache_rc_core::cost::Eviction;
use lmcache_rc_core::service::ServiceConfig;

use crate::service_common::*;

every_policy!(
    a_long_checkpoint_survives_a_stream_of_short_ones_under_cost_where_lru_evicts_it,
    a_kept_generation_keeps_the_pages_it_shares_with_an_evicted_one_under_cost,
    stores_restores_and_held_leases_keep_every_invariant_under_pressure,
);

const PAGE: u64 = 4096;
/// Tokens per attention page.
const BLOCK: u64 = 64;

/// A hybrid checkpoint of `tokens`: one attention page per 64 tokens (keyed
/// at its own end: continuations share the full ones) and `state` pages of
/// recurrent state (keyed at the end: this checkpoint's own).
fn hybrid(tokens: &[u32], state: u64) -> Manifest {
    let n = tokens.len() as u64;
    let groups = vec![
        GroupSpec::new(
            "attention",
            PAGE,
            (0..n.div_ceil(BLOCK)).collect(),
            Role::Attention(BLOCK),
        ),
        GroupSpec::new(
            "recurrent",
            PAGE,
            (0..state).collect(),
            Role::Endpoint("recurrent".into()),
        ),
    ];
    build_manifest(NS, tokens, 1, &groups, 2, "response")
}

/// One group of `pages` pages of its own.
fn filler(base: u32, pages: u64) -> Manifest {
    let groups = vec![GroupSpec::new(
        "filler",
        PAGE,
        (0..pages).collect(),
        Role::Endpoint("filler".into()),
    )];
    build_manifest(NS, &seq(base, 8), 1, &groups, 2, "prompt")
}

/// L1 of 4 MiB (1024 pages), no L2: an evicted page is the only copy, so
/// eviction retires generations and the policy's choice shows.
fn l1_only(eviction: Eviction) -> ServiceConfig {
    with_eviction(config("evict", None), eviction)
}

fn a_long_checkpoint_survives_a_stream_of_short_ones_under_cost_where_lru_evicts_it<T: Target>(
    eviction: Eviction,
) {
    let svc = T::open(l1_only(eviction)).unwrap();
    // 8192 tokens: 128 attention pages + 26 of state (the state of the
    // default shape, 1/384 scale); each short one 200 tokens: 4 + 26.
    let long = hybrid(&seq(1_000_000, 8192), 26);
    store_all(&svc, &long);
    let shorts: Vec<Manifest> = (0..60)
        .map(|i| hybrid(&seq(2_000_000 + 10_000 * i, 200), 26))
        .collect();
    for m in &shorts {
        store_all(&svc, m);
        assert!(is_listed(&svc, m), "a new checkpoint is stored");
        assert!(stat(&svc, "l1_bytes") <= 4 << 20);
    }
    assert!(stat(&svc, "evictions") > 0, "the stream overflowed L1");
    match eviction {
        Eviction::Lru => assert!(
            !is_listed(&svc, &long),
            "lru: the long checkpoint was the least recently used"
        ),
        Eviction::Cost => {
            assert!(
                is_listed(&svc, &long),
                "cost: the long checkpoint saves the most compute per byte"
            );
            restore_all(&svc, &long);
            // The oldest short ones went instead.
            assert!(!is_listed(&svc, &shorts[0]));
        }
    }
    restore_all(&svc, shorts.last().unwrap());
    assert_idle(&svc);
    svc.close().unwrap();
}

fn a_kept_generation_keeps_the_pages_it_shares_with_an_evicted_one_under_cost<T: Target>(
    eviction: Eviction,
) {
    let svc = T::open(l1_only(eviction)).unwrap();
    let tokens = seq(3_000_000, 8192);
    // a: the first 64 tokens (1 attention page + 8 of state); b continues
    // it to 8192 tokens, sharing a's attention page (127 new + 8 of state).
    let a = hybrid(&tokens[..64], 8);
    let b = hybrid(&tokens, 8);
    store_all(&svc, &a);
    store_all(&svc, &b);
    assert_eq!(stat(&svc, "store_pages_reused"), 1, "b reused a's page");
    assert_eq!(stat(&svc, "l1_objects"), 9 + 135);
    // A store that needs all but 8 free pages more than the pool has.
    let free = 1024 - (9 + 135);
    let f = filler(4_000_000, free + 8);
    store_all(&svc, &f);
    assert!(
        !is_listed(&svc, &a),
        "a went (the oldest, and least useful)"
    );
    match eviction {
        Eviction::Lru => {
            // Its oldest page was the one b shares: b went with it.
            assert!(!is_listed(&svc, &b));
        }
        Eviction::Cost => {
            // Only a's own pages went: b, which names the shared page,
            // is intact.
            assert!(is_listed(&svc, &b));
            assert_eq!(stat(&svc, "evictions"), 1);
            restore_all(&svc, &b);
        }
    }
    restore_all(&svc, &f);
    assert_idle(&svc);
    svc.close().unwrap();
}

/// A small xorshift: the scenario is the same at every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn stores_restores_and_held_leases_keep_every_invariant_under_pressure<T: Target>(
    eviction: Eviction,
) {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    // 4 MiB of L1 and 6 MiB of L2 for about 60 MiB of checkpoints.
    let cfg = ServiceConfig {
        l2_bytes: Some(6 << 20),
        retrieve_timeout: Duration::from_secs(10),
        ..with_eviction(config("evict-pressure", Some(&l2)), eviction)
    };
    let svc = T::open(cfg).unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Sixteen conversations; each turn continues its conversation's tokens,
    // so turns share attention pages and differ in their state.
    let mut convs: Vec<Vec<u32>> = (0..16u32)
        .map(|c| seq(10_000_000 * (c + 1), 64 * (1 + c % 4)))
        .collect();
    let mut stored: Vec<Manifest> = Vec::new();
    let mut held: Vec<(Manifest, lmcache_rc_core::service::Lease)> = Vec::new();
    for step in 0..240u32 {
        match rng.below(10) {
            // Store the next turn of a conversation.
            0..=5 => {
                let c = rng.below(16) as usize;
                let grow = 32 + rng.below(600) as u32;
                let base = convs[c].last().copied().unwrap_or(0) + 1;
                convs[c].extend(seq(base, grow));
                let m = hybrid(&convs[c], 1 + rng.below(12));
                if svc.begin(&m).unwrap() {
                    let (published, _) = store_one(&svc, &m, 0);
                    assert!(
                        published,
                        "step {step}: a store that was admitted publishes"
                    );
                    stored.push(m);
                }
            }
            // Restore something stored earlier, if it is still listed:
            // every byte is checked.
            6..=7 if !stored.is_empty() => {
                let m = &stored[rng.below(stored.len() as u64) as usize];
                if is_listed(&svc, m) {
                    restore(&svc, m, 0).unwrap_or_else(|why| {
                        panic!("step {step}: a listed generation missed: {why}")
                    });
                }
            }
            // Hold a read lease across later stores (at most two at once).
            8 if !stored.is_empty() && held.len() < 2 => {
                let m = stored[rng.below(stored.len() as u64) as usize].clone();
                if is_listed(&svc, &m) {
                    let lease = open_read(&svc, &m, 0);
                    held.push((m, lease));
                }
            }
            // Release the oldest held lease, checking its pages first: no
            // store evicted or overwrote them meanwhile (I4).
            _ if !held.is_empty() => {
                let (m, lease) = held.remove(0);
                check_slots(&svc, &m, 0, &lease);
                svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
                    .unwrap();
            }
            _ => {}
        }
        assert!(stat(&svc, "l1_bytes") <= 4 << 20, "step {step}");
        assert!(stat(&svc, "l2_bytes") <= 6 << 20, "step {step}");
        if step % 16 == 0 {
            settle(&svc);
        }
    }
    for (m, lease) in held.drain(..) {
        check_slots(&svc, &m, 0, &lease);
        svc.finish_retrieve(lease.lease_id.as_deref().unwrap(), None)
            .unwrap();
    }
    settle(&svc);
    assert!(stat(&svc, "evictions") > 0, "the run overflowed the tiers");
    // Every generation still listed restores byte for byte.
    let mut listed = 0;
    for m in &stored {
        if is_listed(&svc, m) {
            listed += 1;
            restore_all(&svc, m);
        }
    }
    assert!(listed > 0);
    assert_idle(&svc);
    svc.close().unwrap();
}
