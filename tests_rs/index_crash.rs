//! Crash safety of publication (invariant I1) and of durable marking: a child
//! process publishes, replaces, finds and invalidates (or publishes and marks
//! durable in batches) in a loop and is killed with SIGKILL at random
//! moments; after every kill the directory opens, lists only complete
//! generations (valid, findable, with both lookup rows), has nothing pending,
//! and has lost nothing the child saw committed: a process crash keeps every
//! commit, synced or not (`docs/design/directory.md`).
//!
//! The children are this test binary re-invoked on the ignored helper tests
//! below.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lmcache_rc_core::index::{Directory, DirectoryConfig};

use crate::index_support::*;

const CHILD_PATH: &str = "LMCACHE_RC_CRASH_CHILD";
const CHILD_ROUND: &str = "LMCACHE_RC_CRASH_ROUND";
const READY: &str = "CHILD-READY";
const ROUNDS: u32 = 24;
/// Kills of the durable-marking child.
const MARK_ROUNDS: u32 = 24;

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
        if i.is_multiple_of(7) {
            dir.invalidate(&format!("crash-{round}-{}", i - 3)).unwrap();
        }
        if i.is_multiple_of(5) {
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

/// Helper process of `durable_marks_survive_sigkill_at_random_moments`:
/// publishes generations of distinct prefixes (nothing is ever replaced or
/// evicted) and marks them durable in batches of 1..=8, printing each
/// publication and each mark after the call returned, until killed. Every
/// fifth generation is left half-acknowledged.
#[test]
#[ignore = "helper process of durable_marks_survive_sigkill_at_random_moments"]
fn crash_child_mark_loop() {
    let Ok(path) = std::env::var(CHILD_PATH) else {
        return;
    };
    let round: u32 = std::env::var(CHILD_ROUND).unwrap().parse().unwrap();
    let config = DirectoryConfig {
        max_entries: 1 << 20,
        ..DirectoryConfig::default()
    };
    let dir = Directory::open(Some(Path::new(&path)), config).unwrap();
    println!("{READY}");
    let mut unmarked: Vec<String> = Vec::new();
    for i in 1u32.. {
        let generation = format!("mark-{round}-{i}");
        let m = manifest(
            &generation,
            prefix(&[round + 1, i]),
            WORLD,
            payload(&generation),
        );
        assert!(dir.begin(&m).unwrap());
        for rank in [1, 3, 0, 2] {
            dir.acknowledge(&generation, rank).unwrap();
        }
        println!("PUBLISHED {generation} .");
        unmarked.push(generation);
        if i % 5 == 0 {
            let half = manifest(
                &format!("half-{round}-{i}"),
                prefix(&[999, round, i]),
                WORLD,
                payload("half"),
            );
            assert!(dir.begin(&half).unwrap());
            dir.acknowledge(half.generation(), 2).unwrap();
        }
        if unmarked.len() > (i % 8) as usize {
            assert!(dir.mark_durable(&unmarked).unwrap().iter().all(|&m| m));
            for g in unmarked.drain(..) {
                println!("MARKED {g} .");
            }
        }
    }
}

/// What a child printed before it was killed: (published, marked).
type Printed = (BTreeSet<String>, BTreeSet<String>);

/// Spawns a helper test, waits for it to be ready, kills it after `delay`
/// and returns what it printed (complete lines only).
fn kill_child(exe: &Path, helper: &str, path: &Path, round: u32, delay: Duration) -> Printed {
    let mut child: Child = Command::new(exe)
        .args([
            "--exact",
            helper,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_PATH, path)
        .env(CHILD_ROUND, round.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let (mut published, mut marked) = (BTreeSet::new(), BTreeSet::new());
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let line = line.trim_end();
            if line.ends_with(READY) {
                let _ = ready_tx.send(());
            }
            // A line cut by the kill lacks its trailing " .".
            let words: Vec<&str> = line.split(' ').collect();
            match words.as_slice() {
                ["PUBLISHED", g, "."] => published.insert((*g).to_owned()),
                ["MARKED", g, "."] => marked.insert((*g).to_owned()),
                _ => false,
            };
        }
        (published, marked)
    });
    if ready_rx.recv_timeout(Duration::from_secs(60)).is_err() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("round {round}: child never became ready");
    }
    std::thread::sleep(delay);
    child.kill().unwrap(); // SIGKILL on Unix
    let status = child.wait().unwrap();
    assert!(!status.success(), "child exited on its own: {status}");
    reader.join().unwrap()
}

#[test]
fn durable_marks_survive_sigkill_at_random_moments() {
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
    let (mut published, mut marked) = (BTreeSet::new(), BTreeSet::new());
    for round in 0..MARK_ROUNDS {
        let delay = Duration::from_millis(5 + rng.next() % 76);
        let (p, m) = kill_child(
            &exe,
            "index_crash::crash_child_mark_loop",
            &path,
            round,
            delay,
        );
        published.extend(p);
        marked.extend(m);
        let context = format!("seed {seed:#x} round {round} (killed after {delay:?})");
        let dir = Directory::open(Some(&path), DirectoryConfig::default())
            .unwrap_or_else(|e| panic!("{context}: reopen failed: {e}"));
        let status = dir.status().unwrap();
        assert_eq!(status.pending_generations, 0, "{context}");
        assert_eq!(status.invalid_rows, 0, "{context}");
        let (mut listed, mut durable) = (BTreeSet::new(), BTreeSet::new());
        let mut after: Option<String> = None;
        loop {
            let page = dir.list(after.as_deref(), 256).unwrap();
            for l in page.generations {
                let m = &l.manifest;
                assert!(
                    m.generation().starts_with("mark-"),
                    "{context}: a half-acknowledged generation survived: {}",
                    m.generation()
                );
                assert_eq!(m.payload(), payload(m.generation()).as_slice(), "{context}");
                let hit = dir.find(std::slice::from_ref(m.prefix())).unwrap();
                assert_eq!(hit.as_ref(), Some(m), "{context}: listed but not findable");
                if l.durable {
                    durable.insert(m.generation().to_owned());
                }
                listed.insert(m.generation().to_owned());
            }
            match page.next_after {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        // A process crash loses no commit: every publication and every mark
        // the child saw return is there (the last call may have committed
        // without printing, so the sets may hold more).
        let lost: Vec<_> = published.difference(&listed).collect();
        assert!(lost.is_empty(), "{context}: publications lost: {lost:?}");
        let unmarked: Vec<_> = marked.difference(&durable).collect();
        assert!(unmarked.is_empty(), "{context}: marks lost: {unmarked:?}");
        assert_eq!(
            status.durable_generations,
            durable.len() as u64,
            "{context}"
        );
        dir.close().unwrap();
        assert_eq!(row_generations(&path).len(), listed.len(), "{context}");
        assert_eq!(tail_generations(&path).len(), listed.len(), "{context}");
    }
    assert!(!marked.is_empty(), "seed {seed:#x}: no child ever marked");
    eprintln!(
        "durable-marking crash test: {MARK_ROUNDS} kills, {} publications and {} marks \
         seen returned, none lost",
        published.len(),
        marked.len()
    );
}
