//! A process running the service is killed (SIGKILL) in the middle of
//! storing — while publishing, writing L2 objects or marking generations
//! durable; after a restart only complete, verified generations are listed
//! (I1, I8), every generation whose durable flag reached the directory is
//! among them (its objects were fsynced before the flag was committed), and
//! every listed one restores byte-exact for every rank (`docs/design/leases.md#restart`,
//! `docs/design/l2-format.md#start-up-reconciliation-service`).
//!
//! The child is this test binary re-invoked with `LMRC_CRASH_CHILD` set, so
//! that `child_loop` runs a store loop until it is killed.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use lmcache_rc_core::Manifest;
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::service::{CheckpointService, ServiceConfig};

use crate::service_common::*;

const CHILD_ENV: &str = "LMRC_CRASH_CHILD";
/// Generations one child round may attempt (the parent probes them all).
const PER_ROUND: u32 = 48;

/// Generation `i` of round `round`: continuations of one sequence per round
/// (so later ones reuse earlier pages), world 2, several page sizes.
fn crash_manifest(round: u32, i: u32) -> Manifest {
    let ns = format!("recurrent-sha256-v1:crash-{round}");
    let groups = vec![
        GroupSpec::new("engine-kv-group:0", 1024, Vec::new(), Role::Attention(16)),
        GroupSpec::new(
            "engine-kv-group:1",
            4096,
            vec![0],
            Role::Endpoint("recurrent:1".into()),
        ),
        GroupSpec::new(
            "target-draft-auxiliary",
            300,
            vec![0],
            Role::Endpoint("auxiliary:0:prompt".into()),
        ),
    ];
    let n = 8 + 8 * i;
    let mut g = groups;
    g[0].positions = (0..u64::from(n).div_ceil(16)).collect();
    build_manifest(&ns, &seq(round * 100_000, n), 2, &g, 2, "prompt")
}

fn crash_config(dir: &Path) -> ServiceConfig {
    ServiceConfig {
        l1_bytes: 8 << 20,
        retrieve_timeout: HANG_GUARD,
        ..durable_config("crash", dir)
    }
}

/// The child: stores generations of its round until killed. Runs only when
/// the parent sets `LMRC_CRASH_CHILD`; a no-op in an ordinary test run.
#[test]
fn child_loop() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.splitn(2, '|');
    let round: u32 = parts.next().unwrap().parse().unwrap();
    let dir = PathBuf::from(parts.next().unwrap());
    let svc = CheckpointService::open(crash_config(&dir)).unwrap();
    for i in 0..PER_ROUND {
        let m = crash_manifest(round, i);
        if !svc.begin(&m).unwrap() {
            continue;
        }
        // Interleave ranks of consecutive generations a little: rank 0 of
        // this one before rank 1, so a kill can land between any two steps.
        for rank in 0..2 {
            store_one(&svc, &m, rank);
        }
    }
    // Not killed in time: park so the parent still kills a live process.
    std::thread::sleep(Duration::from_secs(60));
}

/// xorshift64 for the kill delays (the seed is printed).
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

#[test]
fn only_complete_verified_generations_survive_sigkill_mid_store() {
    let exe = std::env::current_exe().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    println!("service_crash seed {seed}");
    let rounds = 24u32;
    let mut total_listed = Vec::new();
    let mut flagged_total = 0;
    for round in 0..rounds {
        let delay = Duration::from_millis(20 + next(&mut seed) % 181);
        let stderr_path = dir.path().join(format!("child-{round}.stderr"));
        let mut child = Command::new(&exe)
            .args(["--exact", "service_crash::child_loop", "--nocapture"])
            .args(["--test-threads", "1"])
            .env(CHILD_ENV, format!("{round}|{}", dir.path().display()))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr_path).unwrap())
            .spawn()
            .unwrap();
        std::thread::sleep(delay);
        child.kill().unwrap();
        let status = child.wait().unwrap();
        assert!(!status.success(), "the child was killed: {status:?}");
        let stderr = std::fs::read_to_string(&stderr_path).unwrap();
        assert!(!stderr.contains("panicked"), "the child failed: {stderr}");
        // The killed child's pool had no name: nothing to clean up.

        // The durable flags the killed child committed, read before the
        // service reconciles anything.
        let flagged = durable_flags(&dir.path().join("index.sqlite"));

        // Restart on the same directory and L2 files.
        let svc = CheckpointService::open(crash_config(dir.path())).unwrap();
        assert_eq!(stat(&svc, "pending"), 0, "pending work never survives");
        let retired = stat(&svc, "restart_retired");
        assert_eq!(stat(&svc, "l1_objects"), 0);
        let mut listed: Vec<Manifest> = Vec::new();
        for r in 0..=round {
            for i in 0..PER_ROUND {
                let m = crash_manifest(r, i);
                if is_listed(&svc, &m) {
                    listed.push(m);
                }
            }
        }
        assert_eq!(
            stat(&svc, "generations"),
            listed.len() as u64,
            "only generations the children stored are listed"
        );
        let kept: std::collections::BTreeSet<&str> =
            listed.iter().map(Manifest::generation).collect();
        for g in &flagged {
            assert!(
                kept.contains(g.as_str()),
                "round {round}: {g} was marked durable but retired at restart"
            );
        }
        // Nothing but the listed generations' objects is on disk, and this
        // round's generations restore exactly (earlier rounds were checked
        // after their own restart, and all are checked again at the end).
        let l2 = dir.path().join("l2");
        assert_eq!(l2_files(&l2), expected_l2(listed.iter()));
        let prefix = format!("recurrent-sha256-v1:crash-{round}");
        for m in listed.iter().filter(|m| m.prefix().namespace() == prefix) {
            restore_all(&svc, m);
        }
        settle(&svc);
        assert_idle(&svc);
        println!(
            "service_crash round {round}: killed after {delay:?}, {} generations listed \
             ({} flagged durable), {retired} incomplete retired at restart",
            listed.len(),
            flagged.len()
        );
        flagged_total += flagged.len();
        total_listed = listed;
        svc.close().unwrap();
    }
    assert!(
        !total_listed.is_empty(),
        "no child stored anything before its kill"
    );
    assert!(flagged_total > 0, "no child marked anything durable");
    let svc = CheckpointService::open(crash_config(dir.path())).unwrap();
    assert_eq!(stat(&svc, "generations"), total_listed.len() as u64);
    for m in &total_listed {
        restore_all(&svc, m);
    }
    settle(&svc);
    assert_idle(&svc);
    svc.close().unwrap();
}
