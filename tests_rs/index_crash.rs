//! Crash safety of publication (invariant I1): a child process publishes,
//! replaces, finds and invalidates in a loop and is killed with SIGKILL at
//! random moments; after every kill the directory opens, lists only complete
//! generations (valid, findable, with both lookup rows) and has nothing pending.
//!
//! The child is this test binary re-invoked on the ignored helper test below.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lmcache_rc_core::index::{Directory, DirectoryConfig};

use crate::index_support::*;

const CHILD_PATH: &str = "LMCACHE_RC_CRASH_CHILD";
const CHILD_ROUND: &str = "LMCACHE_RC_CRASH_ROUND";
const READY: &str = "CHILD-READY";
const ROUNDS: u32 = 24;

fn child_config() -> DirectoryConfig {
    DirectoryConfig {
        max_entries: 64,
        recency_flush_updates: 4,
        recency_flush_interval: Duration::from_millis(20),
        ..DirectoryConfig::default()
    }
}

/// Helper process (see the module docs): publishes forever until killed.
#[test]
#[ignore = "helper process of publication_survives_sigkill_at_random_moments"]
fn crash_child_publish_loop() {
    let Ok(path) = std::env::var(CHILD_PATH) else {
        return;
    };
    let round: u64 = std::env::var(CHILD_ROUND).unwrap().parse().unwrap();
    let dir = Directory::open(Some(Path::new(&path)), child_config()).unwrap();
    println!("{READY}");
    let mut i = 0u64;
    loop {
        i += 1;
        let generation = format!("crash-{round}-{i}");
        // 31 token values × 4 lengths: replacements and LRU evictions happen.
        let tail = vec![(i % 31) as u32 + 1; (i % 4) as usize + 1];
        let m = manifest(&generation, prefix(&tail), WORLD, payload(&generation));
        if dir.begin(&m).unwrap() {
            for rank in [2, 0, 3, 1] {
                dir.acknowledge(&generation, rank).unwrap();
            }
        }
        let probe = vec![(i % 31) as u32 + 1; 4];
        dir.find(&[prefix(&probe)]).unwrap();
        if i % 7 == 0 {
            dir.invalidate(&format!("crash-{round}-{}", i - 3)).unwrap();
        }
        if i % 5 == 0 {
            // Leave a generation half-acknowledged: it must never survive.
            let half = manifest(
                &format!("half-{round}-{i}"),
                prefix(&[999, i as u32]),
                WORLD,
                payload("half"),
            );
            if dir.begin(&half).unwrap() {
                dir.acknowledge(half.generation(), 0).unwrap();
            }
        }
    }
}

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Opens the directory left by a killed child and checks every invariant.
fn check_after_crash(path: &Path, context: &str) -> usize {
    let dir = Directory::open(Some(path), child_config())
        .unwrap_or_else(|e| panic!("{context}: reopen failed: {e}"));
    let status = dir.status().unwrap();
    assert_eq!(status.pending_generations, 0, "{context}");
    assert!(status.published_generations <= 64, "{context}");
    let mut listed = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = dir.list(after.as_deref(), 16).unwrap();
        listed.extend(page.generations);
        match page.next_after {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    assert_eq!(
        listed.len() as u64,
        status.published_generations,
        "{context}"
    );
    assert_eq!(status.invalid_rows, 0, "{context}");
    for l in &listed {
        let m = &l.manifest;
        assert!(
            m.generation().starts_with("crash-"),
            "{context}: a half-acknowledged generation survived: {}",
            m.generation()
        );
        assert_eq!(m.payload(), payload(m.generation()).as_slice(), "{context}");
        assert_eq!(m.world_size(), WORLD, "{context}");
        let hit = dir.find(std::slice::from_ref(m.prefix())).unwrap();
        assert_eq!(hit.as_ref(), Some(m), "{context}: listed but not findable");
    }
    let names = sorted(
        listed
            .iter()
            .map(|l| l.manifest.generation().to_owned())
            .collect(),
    );
    dir.close().unwrap();
    assert_eq!(row_generations(path), names, "{context}");
    assert_eq!(tail_generations(path), names, "{context}");
    names.len()
}

#[test]
fn publication_survives_sigkill_at_random_moments() {
    if std::env::var(CHILD_PATH).is_ok() {
        return; // never recurse from inside a child
    }
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0x9e37_79b9, |d| d.as_nanos() as u64)
        | 1;
    let mut rng = XorShift(seed);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("directory.sqlite3");
    let exe = std::env::current_exe().unwrap();
    let mut max_seen = 0;
    for round in 0..ROUNDS {
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "index_crash::crash_child_publish_loop",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_PATH, &path)
            .env(CHILD_ROUND, round.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // libtest prints "test <name> ... " on the same line first.
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.trim_end().ends_with(READY) {
                    let _ = ready_tx.send(());
                }
            }
        });
        if ready_rx.recv_timeout(Duration::from_secs(60)).is_err() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("seed {seed:#x} round {round}: child never became ready");
        }
        let delay = 5 + rng.next() % 76;
        std::thread::sleep(Duration::from_millis(delay));
        child.kill().unwrap(); // SIGKILL on Unix
        let status = child.wait().unwrap();
        assert!(!status.success(), "child exited on its own: {status}");
        let context = format!("seed {seed:#x} round {round} (killed after {delay} ms)");
        max_seen = max_seen.max(check_after_crash(&path, &context));
    }
    assert!(max_seen > 0, "seed {seed:#x}: no child ever published");
    eprintln!("crash test: {ROUNDS} kills, up to {max_seen} generations listed after a kill");
}
