//! L2 tier throughput against raw file I/O of the same bytes, measured in the
//! same run (targets: write with fsync ≥ 0.7 × raw, cold read ≥ 0.8 × raw;
//! `docs/design/README.md#performance-targets`).
//!
//! `cargo run --release -p lmcache-rc-core --example l2_bench [-- [--quick] [DIR]]`
//!
//! Writes: `L2Tier::write` (temp file, write, fsync, rename, fsync dir) vs raw
//! `File::create` + `write_all` + `sync_all` + `rename` per page, single
//! threaded; the L2 figure is given for a fresh store (every write creates its
//! bucket directory) and for buckets that exist (a store in steady state),
//! then both again with 4 threads (L2 through an `IoPool`, raw through 4
//! plain threads). Cold reads: `L2Tier::read` (header checks + xxh3
//! verification) vs raw `File::open` + `read_exact` into a reused buffer,
//! after `posix_fadvise(DONTNEED)` on every file to drop it from the page
//! cache. DIR defaults to the system temp dir.
// A benchmark reports on stdout and stops at the first failure.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lmcache_rc_core::store::ObjectKey;
use lmcache_rc_core::store::l2::{IoPool, L2Tier, RealFs};

const PAGE: usize = 256 * 1024;
const THREADS: usize = 4;

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn fill(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// Drops `path` from the page cache; false if the kernel refused.
fn drop_cache(path: &Path) -> bool {
    match File::open(path) {
        Ok(f) => rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).is_ok(),
        Err(_) => false,
    }
}

fn raw_write_one(dir: &Path, i: usize, page: &[u8]) -> std::io::Result<PathBuf> {
    let t = dir.join("tmp").join(format!("{i}.tmp"));
    let mut f = File::create(&t)?;
    f.write_all(page)?;
    f.sync_all()?;
    drop(f);
    let p = dir.join("out").join(format!("{i}.page"));
    fs::rename(&t, &p)?;
    Ok(p)
}

fn raw_write(dir: &Path, pages: &[Vec<u8>], threads: usize) -> std::io::Result<Vec<PathBuf>> {
    fs::create_dir_all(dir.join("tmp"))?;
    fs::create_dir_all(dir.join("out"))?;
    if threads <= 1 {
        return pages
            .iter()
            .enumerate()
            .map(|(i, p)| raw_write_one(dir, i, p))
            .collect();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    (t..pages.len())
                        .step_by(threads)
                        .map(|i| raw_write_one(dir, i, &pages[i]))
                        .collect::<std::io::Result<Vec<PathBuf>>>()
                })
            })
            .collect();
        let mut all = Vec::new();
        for h in handles {
            all.extend(
                h.join()
                    .map_err(|_| std::io::Error::other("raw writer panicked"))??,
            );
        }
        Ok(all)
    })
}

fn new_dir(base: &Path, prefix: &str) -> std::io::Result<tempfile::TempDir> {
    tempfile::Builder::new().prefix(prefix).tempdir_in(base)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut quick = false;
    let mut base = std::env::temp_dir();
    for arg in std::env::args().skip(1) {
        if arg == "--quick" {
            quick = true;
        } else {
            base = PathBuf::from(arg);
        }
    }
    let total: usize = if quick { 16 << 20 } else { 64 << 20 };
    let count = total / PAGE;
    let rounds = if quick { 1 } else { 5 };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let pages: Arc<Vec<Vec<u8>>> = Arc::new(
        (0..count)
            .map(|_| {
                let mut p = vec![0u8; PAGE];
                rng.fill(&mut p);
                p
            })
            .collect(),
    );
    let keys: Arc<Vec<ObjectKey>> = Arc::new(
        (0..count)
            .map(|_| {
                let mut k = [0u8; 32];
                rng.fill(&mut k);
                ObjectKey(k)
            })
            .collect(),
    );
    // Same buckets as `keys`, different objects.
    let steady_keys: Arc<Vec<ObjectKey>> = Arc::new(
        keys.iter()
            .map(|k| {
                let mut k = k.0;
                k[31] ^= 0xff;
                ObjectKey(k)
            })
            .collect(),
    );

    let mut raw_w = vec![];
    let mut raw_w2 = vec![];
    let mut l2_w = vec![];
    let mut l2_steady = vec![];
    let mut raw_wt = [vec![], vec![]];
    let mut l2_wt = [vec![], vec![]];
    let mut raw_r = vec![];
    let mut l2_r = vec![];
    let mut fadvised = true;
    let mut buf = vec![0u8; PAGE];
    let pool = IoPool::new(THREADS, count, "l2-bench")?;
    for _ in 0..rounds {
        // Single thread. Raw and L2 writes alternate page by page, so machine
        // noise (this is often a shared disk) hits both alike.
        let raw_dir = new_dir(&base, "l2-bench-raw-")?;
        fs::create_dir_all(raw_dir.path().join("tmp"))?;
        fs::create_dir_all(raw_dir.path().join("out"))?;
        let l2_dir = new_dir(&base, "l2-bench-tier-")?;
        let (tier, _) = L2Tier::open(l2_dir.path(), None, Arc::new(RealFs))?;
        let (mut raw_t, mut l2_t, mut steady_t) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        let mut raw_paths = Vec::with_capacity(count);
        for i in 0..count {
            let start = Instant::now();
            raw_paths.push(raw_write_one(raw_dir.path(), i, &pages[i])?);
            raw_t += start.elapsed();
            let start = Instant::now();
            tier.write(&keys[i], &pages[i])?;
            l2_t += start.elapsed();
        }
        assert_eq!(tier.bytes_written(), (count * (PAGE + 64)) as u64);
        let raw_dir2 = new_dir(&base, "l2-bench-raw-")?;
        fs::create_dir_all(raw_dir2.path().join("tmp"))?;
        fs::create_dir_all(raw_dir2.path().join("out"))?;
        let mut raw2_t = Duration::ZERO;
        for i in 0..count {
            let start = Instant::now();
            raw_write_one(raw_dir2.path(), i, &pages[i])?;
            raw2_t += start.elapsed();
            let start = Instant::now();
            tier.write(&steady_keys[i], &pages[i])?;
            steady_t += start.elapsed();
        }
        raw_w.push(raw_t);
        l2_w.push(l2_t);
        raw_w2.push(raw2_t);
        l2_steady.push(steady_t);
        drop(raw_dir2);

        // Cold reads of what was just written, alternating likewise.
        for p in &raw_paths {
            fadvised &= drop_cache(p);
        }
        for k in keys.iter() {
            fadvised &= drop_cache(&tier.path_of(k));
        }
        let (mut raw_t, mut l2_t) = (Duration::ZERO, Duration::ZERO);
        for i in 0..count {
            let start = Instant::now();
            File::open(&raw_paths[i])?.read_exact(&mut buf)?;
            raw_t += start.elapsed();
            let start = Instant::now();
            tier.read(&keys[i], &mut buf)?;
            l2_t += start.elapsed();
            assert_eq!(buf[..64], pages[i][..64]);
        }
        raw_r.push(raw_t);
        l2_r.push(l2_t);
        drop((raw_dir, tier, l2_dir));

        // THREADS writers each: a fresh store, then new objects into the
        // buckets that now exist; each after a raw pass of the same bytes.
        let l2_dir = new_dir(&base, "l2-bench-tier-")?;
        let tier = Arc::new(L2Tier::open(l2_dir.path(), None, Arc::new(RealFs))?.0);
        for (pass, pass_keys) in [&keys, &steady_keys].into_iter().enumerate() {
            let raw_dir = new_dir(&base, "l2-bench-raw-")?;
            let start = Instant::now();
            raw_write(raw_dir.path(), &pages, THREADS)?;
            raw_wt[pass].push(start.elapsed());

            let start = Instant::now();
            for i in 0..count {
                let (tier, keys, pages) =
                    (Arc::clone(&tier), Arc::clone(pass_keys), Arc::clone(&pages));
                pool.submit_blocking(Box::new(move || {
                    if let Err(e) = tier.write(&keys[i], &pages[i]) {
                        eprintln!("L2 write failed: {e}");
                    }
                }));
            }
            pool.wait_idle(Duration::from_secs(600));
            l2_wt[pass].push(start.elapsed());
            assert_eq!(
                tier.object_count(),
                count * (pass + 1),
                "a pooled write failed"
            );
        }
    }
    pool.shutdown();

    let mb = total as f64 / 1e6;
    let rate = |d: Duration| mb / d.as_secs_f64();
    let ratio = |raw: Duration, ours: Duration| raw.as_secs_f64() / ours.as_secs_f64();
    let (raw_w, l2_w) = (median(raw_w), median(l2_w));
    let (raw_w2, l2_steady) = (median(raw_w2), median(l2_steady));
    let [raw_wt, raw_wt2] = raw_wt.map(median);
    let [l2_wt, l2_wt2] = l2_wt.map(median);
    let (raw_r, l2_r) = (median(raw_r), median(l2_r));
    println!(
        "l2: {count} pages x {} KiB = {} MiB per pass in {}, median of {rounds} round(s)",
        PAGE / 1024,
        total >> 20,
        base.display()
    );
    println!("  write, 1 thread");
    println!(
        "    raw (create+write+fsync+rename)     : {:8.1} MB/s",
        rate(raw_w)
    );
    println!(
        "    L2Tier::write, fresh store          : {:8.1} MB/s  ratio {:.3}  (target >= 0.7)",
        rate(l2_w),
        ratio(raw_w, l2_w)
    );
    println!(
        "    raw, second pass                    : {:8.1} MB/s",
        rate(raw_w2)
    );
    println!(
        "    L2Tier::write, buckets exist        : {:8.1} MB/s  ratio {:.3}  (target >= 0.7)",
        rate(l2_steady),
        ratio(raw_w2, l2_steady)
    );
    println!("  write, {THREADS} threads");
    println!(
        "    raw                                 : {:8.1} MB/s",
        rate(raw_wt)
    );
    println!(
        "    L2Tier::write via IoPool, fresh     : {:8.1} MB/s  ratio {:.3}",
        rate(l2_wt),
        ratio(raw_wt, l2_wt)
    );
    println!(
        "    raw, second pass                    : {:8.1} MB/s",
        rate(raw_wt2)
    );
    println!(
        "    L2Tier::write via IoPool, existing  : {:8.1} MB/s  ratio {:.3}",
        rate(l2_wt2),
        ratio(raw_wt2, l2_wt2)
    );
    println!(
        "  cold read, 1 thread: posix_fadvise(DONTNEED) {}",
        if fadvised {
            "done on every file after its fsync"
        } else {
            "FAILED on some files (reads may be warm)"
        }
    );
    println!(
        "    raw (open+read_exact)               : {:8.1} MB/s",
        rate(raw_r)
    );
    println!(
        "    L2Tier::read (+checks, xxh3)        : {:8.1} MB/s  ratio {:.3}  (target >= 0.8)",
        rate(l2_r),
        ratio(raw_r, l2_r)
    );
    Ok(())
}
