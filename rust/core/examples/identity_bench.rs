//! Token-root hashing throughput against raw SHA-256 over the same bytes,
//! measured in the same run (target: ratio ≥ 0.9;
//! `docs/design/README.md#performance-targets`).
//!
//! `cargo run --release -p lmcache-rc-core --example identity_bench [-- TOKENS]`
// A benchmark reports on stdout and stops at the first failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use lmcache_rc_core::TokenRoots;
use sha2::{Digest, Sha256};

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let tokens: Vec<u32> = (0..n as u64)
        .map(|i| ((i * 2654435761 + 12345) % (1 << 31)) as u32)
        .collect();
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let rounds = 21;
    let mut raw = Vec::with_capacity(rounds);
    let mut roots = Vec::with_capacity(rounds);
    // Interleave the two so machine noise hits both alike.
    for _ in 0..rounds {
        let start = Instant::now();
        black_box(Sha256::digest(black_box(&bytes)));
        raw.push(start.elapsed());

        let input = tokens.clone();
        let start = Instant::now();
        let built = TokenRoots::build("bench-namespace", black_box(input), 4096);
        roots.push(start.elapsed());
        assert!(built.is_ok(), "hashing failed");
        black_box(built.ok());
    }
    let (raw, roots) = (median(raw), median(roots));
    let mb = bytes.len() as f64 / 1e6;
    println!("identity: token-root hashing of {n} tokens (chunk 4096)");
    println!(
        "  raw SHA-256 over the same {mb:.1} MB : {:8.3} ms  ({:7.1} MB/s)",
        raw.as_secs_f64() * 1e3,
        mb / raw.as_secs_f64()
    );
    println!(
        "  TokenRoots::build                  : {:8.3} ms  ({:7.1} MB/s)",
        roots.as_secs_f64() * 1e3,
        mb / roots.as_secs_f64()
    );
    println!(
        "  ratio (throughput roots / raw)     : {:.3}  (target >= 0.9)",
        raw.as_secs_f64() / roots.as_secs_f64()
    );
}
