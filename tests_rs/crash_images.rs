//! Power cuts, simulated: a storing service runs with every write, fsync,
//! rename, unlink and directory fsync of its L2 tier and of SQLite recorded
//! (`crash_record.rs`); from the log, the on-disk images a power cut could
//! leave at sync points (and at points between them) are built, and a
//! service restarted on each must open, keep every generation whose durable
//! flag was synced before the cut, list no generation whose pages are
//! missing or wrong (every listed one restores byte-exact or misses
//! cleanly), and store and restore a new generation. The model and what it
//! leaves out: `docs/design/crash-testing.md`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use lmcache_rc_core::Manifest;
use lmcache_rc_core::cost::Eviction;
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::service::{CheckpointService, ServiceConfig};

use crate::crash_record::{Rec, Session, VFS_NAME, fill_release, mark_release, recording_fs};
use crate::service_common::*;

/// Bytes a torn write is cut at (a multiple of them is kept).
const SECTOR: u64 = 512;

/// xorshift64 (seeded per scenario; `LMRC_CRASH_SEED` overrides).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let x = &mut self.0;
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

// ------------------------------------------------------------- the model

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Node {
    Dir,
    File(usize),
}

#[derive(Clone, Debug)]
enum Pending {
    Write(u64, Vec<u8>),
    Truncate(u64),
}

#[derive(Clone, Default, Debug)]
struct Inode {
    /// The contents as of the file's last fsync.
    synced: Vec<u8>,
    /// Writes and truncations since then, in order.
    pending: Vec<Pending>,
}

#[derive(Clone, Debug)]
enum DirOp {
    Add(PathBuf, Node),
    Remove(PathBuf),
}

/// The disk as the recorded operations left it, split into what is durable
/// and what is not yet.
#[derive(Clone, Default)]
struct Disk {
    inodes: Vec<Inode>,
    /// The names as the running process sees them.
    live: BTreeMap<PathBuf, Node>,
    /// The names a power cut keeps for certain.
    durable: BTreeMap<PathBuf, Node>,
    /// Name changes per directory since its last fsync, in order.
    dir_pending: HashMap<PathBuf, Vec<DirOp>>,
}

fn parent(p: &Path) -> PathBuf {
    p.parent().map(Path::to_path_buf).unwrap_or_default()
}

impl Disk {
    /// The file at `path`. One the recorders did not see created (the index
    /// file is created empty by `private::create_private_file`, not through
    /// SQLite) is taken as created now, its name not yet durable.
    fn file(&mut self, path: &Path) -> usize {
        match self.live.get(path) {
            Some(Node::File(i)) => *i,
            None => {
                self.apply(&Rec::Create(path.to_path_buf()));
                self.file(path)
            }
            Some(Node::Dir) => panic!("file operation on the directory {}", path.display()),
        }
    }

    fn dir_op(&mut self, dir: PathBuf, op: DirOp) {
        self.dir_pending.entry(dir).or_default().push(op);
    }

    fn apply(&mut self, rec: &Rec) {
        match rec {
            Rec::Mkdir(p) => {
                self.live.insert(p.clone(), Node::Dir);
                self.dir_op(parent(p), DirOp::Add(p.clone(), Node::Dir));
            }
            Rec::Create(p) => {
                self.inodes.push(Inode::default());
                let node = Node::File(self.inodes.len() - 1);
                self.live.insert(p.clone(), node);
                self.dir_op(parent(p), DirOp::Add(p.clone(), node));
            }
            Rec::Write(p, off, data) => {
                let i = self.file(p);
                self.inodes[i]
                    .pending
                    .push(Pending::Write(*off, data.clone()));
            }
            Rec::Truncate(p, len) => {
                let i = self.file(p);
                self.inodes[i].pending.push(Pending::Truncate(*len));
            }
            Rec::Sync(p) => {
                let i = self.file(p);
                let inode = &mut self.inodes[i];
                let pending = std::mem::take(&mut inode.pending);
                for op in &pending {
                    apply_pending(&mut inode.synced, op, None);
                }
            }
            Rec::Rename(from, to) => {
                let node = self.live.remove(from).expect("rename of a recorded name");
                self.live.insert(to.clone(), node);
                // The new name and the old one's removal are made durable by
                // fsyncs of their own directories.
                self.dir_op(parent(to), DirOp::Add(to.clone(), node));
                self.dir_op(parent(from), DirOp::Remove(from.clone()));
            }
            Rec::Unlink(p) => {
                self.live.remove(p);
                self.dir_op(parent(p), DirOp::Remove(p.clone()));
            }
            Rec::SyncDir(d) => {
                for op in self.dir_pending.remove(d).unwrap_or_default() {
                    apply_dir_op(&mut self.durable, op);
                }
            }
            Rec::Release(_) => {}
        }
    }
}

fn apply_dir_op(names: &mut BTreeMap<PathBuf, Node>, op: DirOp) {
    match op {
        DirOp::Add(p, node) => {
            names.insert(p, node);
        }
        DirOp::Remove(p) => {
            names.remove(&p);
        }
    }
}

/// Applies one pending operation; `keep_sectors` cuts a write after that
/// many whole sectors (counted from the sector boundary it starts in).
fn apply_pending(data: &mut Vec<u8>, op: &Pending, keep_sectors: Option<u64>) {
    match op {
        Pending::Write(off, bytes) => {
            let mut len = bytes.len() as u64;
            if let Some(k) = keep_sectors {
                let end = (off / SECTOR + k) * SECTOR;
                len = len.min(end.saturating_sub(*off));
            }
            if len == 0 {
                return;
            }
            let end = (off + len) as usize;
            if data.len() < end {
                data.resize(end, 0);
            }
            data[*off as usize..end].copy_from_slice(&bytes[..len as usize]);
        }
        Pending::Truncate(len) => data.resize(*len as usize, 0),
    }
}

/// How a power-cut image treats what was not synced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Policy {
    /// Every unsynced write and name change is lost.
    DropAll,
    /// Every one reached the disk (as a process crash would leave it).
    KeepAll,
    /// Each write is dropped, kept or torn at a sector boundary, and each
    /// name change kept or lost, at random.
    Random,
}

/// The files and directories a power cut leaves: path → contents (None for
/// a directory), relative to the recorded root.
fn image(
    disk: &Disk,
    root: &Path,
    policy: Policy,
    rng: &mut Rng,
) -> BTreeMap<PathBuf, Option<Vec<u8>>> {
    let mut names = disk.durable.clone();
    let mut dirs: Vec<&PathBuf> = disk.dir_pending.keys().collect();
    dirs.sort();
    for dir in dirs {
        for op in &disk.dir_pending[dir] {
            let keep = match policy {
                Policy::DropAll => false,
                Policy::KeepAll => true,
                Policy::Random => rng.coin(),
            };
            if keep {
                apply_dir_op(&mut names, op.clone());
            }
        }
    }
    let mut out = BTreeMap::new();
    for (path, node) in &names {
        // A name survives only if every directory above it does (the root,
        // which the test created before recording, is durable).
        let reachable = path
            .ancestors()
            .skip(1)
            .take_while(|a| *a != root)
            .all(|a| names.get(a) == Some(&Node::Dir));
        if !reachable {
            continue;
        }
        match node {
            Node::Dir => {
                out.insert(path.clone(), None);
            }
            Node::File(i) => {
                let inode = &disk.inodes[*i];
                let mut data = inode.synced.clone();
                for op in &inode.pending {
                    let choice = match policy {
                        Policy::DropAll => 0,
                        Policy::KeepAll => 1,
                        Policy::Random => rng.below(3),
                    };
                    match (choice, op) {
                        (0, _) => {}
                        (2, Pending::Write(off, bytes)) => {
                            let sectors = (off % SECTOR + bytes.len() as u64).div_ceil(SECTOR);
                            let keep = rng.below(sectors);
                            apply_pending(&mut data, op, Some(keep));
                        }
                        _ => apply_pending(&mut data, op, None),
                    }
                }
                out.insert(path.clone(), Some(data));
            }
        }
    }
    out
}

/// Writes an image under `to` (the recorded root `root` mapped onto it).
fn materialise(img: &BTreeMap<PathBuf, Option<Vec<u8>>>, root: &Path, to: &Path) {
    std::fs::DirBuilder::new().mode(0o700).create(to).unwrap();
    // BTreeMap order puts every directory before what it holds.
    for (path, data) in img {
        let Ok(rel) = path.strip_prefix(root) else {
            continue;
        };
        let dest = to.join(rel);
        match data {
            None => std::fs::DirBuilder::new()
                .mode(0o700)
                .recursive(true)
                .create(&dest)
                .unwrap(),
            Some(bytes) => {
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&dest)
                    .unwrap();
                f.write_all(bytes).unwrap();
            }
        }
    }
}

// --------------------------------------------------------- the scenarios

/// The directories under the recorded root made (durably) before recording.
const SUBDIRS: [&str; 2] = ["idx", "disk"];

/// The paths of one run: the recorded root holds the index in `idx/` and the
/// L2 tier at `disk/l2` (created by the service: its creation is recorded).
fn service_config(
    root: &Path,
    l2_bytes: Option<u64>,
    eviction: Eviction,
    vfs: bool,
) -> ServiceConfig {
    ServiceConfig {
        checkpoint_index_path: Some(root.join("idx").join("index.sqlite")),
        l2_bytes,
        eviction,
        retrieve_timeout: HANG_GUARD,
        index_vfs: vfs.then(|| VFS_NAME.to_string()),
        ..config("crash-images", Some(&root.join("disk").join("l2")))
    }
}

fn gen_manifest(scenario: &str, i: u32) -> Manifest {
    standard(&gen_namespace(scenario), &gen_tokens(i), "prompt", 2)
}

fn gen_namespace(scenario: &str) -> String {
    format!("recurrent-sha256-v1:crash-images-{scenario}")
}

fn gen_tokens(i: u32) -> Vec<u32> {
    seq(1000 * (i + 1), 48 + 16 * (i % 3))
}

/// A recorded run: the log, and every generation it tried to store.
struct Run {
    root: PathBuf,
    log: Vec<Rec>,
    stored: Vec<Manifest>,
    l2_bytes: Option<u64>,
    eviction: Eviction,
}

fn record_run(
    scenario: &str,
    base: &Path,
    l2_bytes: Option<u64>,
    eviction: Eviction,
    body: impl FnOnce(&CheckpointService, &mut dyn FnMut(&CheckpointService) -> Manifest),
) -> Run {
    record_run_with(scenario, base, l2_bytes, eviction, |c| c, body)
}

/// [`record_run`] with the recorded service's settings adjusted by `adjust`
/// (the restarts on the images use the plain [`service_config`]).
fn record_run_with(
    scenario: &str,
    base: &Path,
    l2_bytes: Option<u64>,
    eviction: Eviction,
    adjust: impl FnOnce(ServiceConfig) -> ServiceConfig,
    body: impl FnOnce(&CheckpointService, &mut dyn FnMut(&CheckpointService) -> Manifest),
) -> Run {
    let root = base.join("run").canonicalize().unwrap_or_else(|_| {
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(base.join("run"))
            .unwrap();
        base.join("run").canonicalize().unwrap()
    });
    for sub in SUBDIRS {
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(root.join(sub))
            .unwrap();
    }
    let session = Session::start(&root);
    let svc = CheckpointService::open_with_fs(
        adjust(service_config(&root, l2_bytes, eviction, true)),
        recording_fs(),
        &mut |_| {},
    )
    .unwrap();
    let mut stored = Vec::new();
    let mut n = 0;
    let mut store = |svc: &CheckpointService| {
        let m = gen_manifest(scenario, n);
        n += 1;
        store_all(svc, &m);
        stored.push(m.clone());
        m
    };
    body(&svc, &mut store);
    svc.close().unwrap();
    let log = session.finish();
    Run {
        root,
        log,
        stored,
        l2_bytes,
        eviction,
    }
}

/// Generations whose durable flag is in the image (the directory opened on
/// its own).
fn flagged(index: &Path) -> BTreeSet<String> {
    durable_flags(index).into_iter().collect()
}

#[derive(Default)]
struct Tally {
    images: u64,
    cut_points: u64,
    durable_checked: u64,
    listed: u64,
    clean_misses: u64,
}

/// Restarts a service on the image at `at` and checks it; `durable` are the
/// generations whose flag was synced before the cut.
fn check_image(run: &Run, at: &Path, durable: &BTreeSet<String>, what: &str, t: &mut Tally) {
    let svc = CheckpointService::open(service_config(at, run.l2_bytes, run.eviction, false))
        .unwrap_or_else(|e| panic!("{what}: the restart failed: {e}"));
    let mut listed = Vec::new();
    for m in &run.stored {
        if is_listed(&svc, m) {
            listed.push(m);
        }
    }
    assert_eq!(
        stat(&svc, "generations"),
        listed.len() as u64,
        "{what}: only generations the run stored are listed"
    );
    let names: BTreeSet<&str> = listed.iter().map(|m| m.generation()).collect();
    if std::env::var_os("LMRC_CRASH_DEBUG").is_some() {
        eprintln!(
            "{what}: {} listed, {} retired at restart",
            listed.len(),
            stat(&svc, "restart_retired")
        );
    }
    for g in durable {
        assert!(
            names.contains(g.as_str()),
            "{what}: {g} was durable (its flag synced) before the cut but is not listed"
        );
    }
    for m in &listed {
        for rank in 0..m.world_size() {
            // `restore` panics on a wrong byte; a miss must be clean, and
            // never of a generation that was durable.
            if let Err(why) = restore(&svc, m, rank) {
                assert!(
                    !durable.contains(m.generation()),
                    "{what}: durable {} rank {rank} missed: {why}",
                    m.generation()
                );
                t.clean_misses += 1;
            }
        }
    }
    // The restarted service stores and restores.
    let fresh = gen_manifest("after-restart", 999);
    store_all(&svc, &fresh);
    settle(&svc);
    restore_all(&svc, &fresh);
    svc.close().unwrap();
    t.images += 1;
    t.durable_checked += durable.len() as u64;
    t.listed += listed.len() as u64;
}

/// Cut points: after every sync (or a sample of them, at most `max_syncs`)
/// and a sample of points between syncs.
fn cut_points(log: &[Rec], max_syncs: usize, between: usize, rng: &mut Rng) -> Vec<usize> {
    let syncs: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, r)| matches!(r, Rec::Sync(_) | Rec::SyncDir(_)))
        .map(|(i, _)| i + 1)
        .collect();
    let mut points: BTreeSet<usize> = BTreeSet::new();
    if syncs.len() <= max_syncs {
        points.extend(&syncs);
    } else {
        // Evenly spread, the last one always in.
        for k in 0..max_syncs {
            points.insert(syncs[(k * syncs.len()) / max_syncs]);
        }
        points.insert(*syncs.last().unwrap());
    }
    for _ in 0..between {
        points.insert(1 + rng.below(log.len() as u64) as usize);
    }
    points.into_iter().collect()
}

fn seed(scenario: &str) -> u64 {
    let base = std::env::var("LMRC_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x9e37_79b9_7f4a_7c15u64);
    scenario.bytes().fold(base, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    }) | 1
}

/// Builds and checks the images of a recorded run; returns the count.
fn check_run(scenario: &str, run: &Run, max_syncs: usize, between: usize, min_images: u64) {
    let mut rng = Rng(seed(scenario));
    let work = tempfile::tempdir().unwrap();
    let points = cut_points(&run.log, max_syncs, between, &mut rng);
    let mut t = Tally::default();
    let mut disk = Disk::default();
    // The directories the test made before recording are durable.
    for sub in SUBDIRS {
        disk.live.insert(run.root.join(sub), Node::Dir);
        disk.durable.insert(run.root.join(sub), Node::Dir);
    }
    let mut applied = 0;
    let mut released = BTreeSet::new();
    for (n, &at) in points.iter().enumerate() {
        while applied < at {
            if let Rec::Release(gens) = &run.log[applied] {
                released.extend(gens.iter().cloned());
            }
            disk.apply(&run.log[applied]);
            applied += 1;
        }
        t.cut_points += 1;
        // What was durable: the image with nothing unsynced in it.
        let minimal = image(&disk, &run.root, Policy::DropAll, &mut rng);
        let dir = work.path().join(format!("{n}-min"));
        materialise(&minimal, &run.root, &dir);
        // Durable: flagged on disk, and not let go (cleared, evicted) by
        // the run before the cut.
        let durable: BTreeSet<String> = flagged(&dir.join("idx").join("index.sqlite"))
            .difference(&released)
            .cloned()
            .collect();
        let what = format!("{scenario} cut {at}/{} (drop all unsynced)", run.log.len());
        check_image(run, &dir, &durable, &what, &mut t);
        std::fs::remove_dir_all(&dir).unwrap();
        let policy = if n % 4 == 3 {
            Policy::KeepAll
        } else {
            Policy::Random
        };
        let img = image(&disk, &run.root, policy, &mut rng);
        if std::env::var_os("LMRC_CRASH_DEBUG").is_some() {
            let files: Vec<String> = img
                .iter()
                .filter(|(p, d)| d.is_some() && !p.to_string_lossy().contains("/objects/"))
                .map(|(p, d)| format!("{} {}", p.display(), d.as_ref().map_or(0, Vec::len)))
                .collect();
            let objects = img
                .keys()
                .filter(|p| p.to_string_lossy().ends_with(".page"))
                .count();
            eprintln!(
                "cut {at} {policy:?}: durable {durable:?}, {objects} objects, files {files:?}"
            );
        }
        let dir = work.path().join(format!("{n}-{policy:?}"));
        materialise(&img, &run.root, &dir);
        let what = format!("{scenario} cut {at}/{} ({policy:?})", run.log.len());
        check_image(run, &dir, &durable, &what, &mut t);
        std::fs::remove_dir_all(&dir).unwrap();
    }
    let syncs = run
        .log
        .iter()
        .filter(|r| matches!(r, Rec::Sync(_) | Rec::SyncDir(_)))
        .count();
    let released = run
        .log
        .iter()
        .map(|r| match r {
            Rec::Release(g) => g.len(),
            _ => 0,
        })
        .sum::<usize>();
    eprintln!(
        "crash_images {scenario}: {} images at {} cut points ({} operations, {syncs} syncs \
         recorded; {} generations stored, {released} let go); {} durable-generation checks, {} listed \
         generations restored, {} clean misses (seed {})",
        t.images,
        t.cut_points,
        run.log.len(),
        run.stored.len(),
        t.durable_checked,
        t.listed,
        t.clean_misses,
        seed(scenario)
    );
    assert!(
        t.images >= min_images,
        "{scenario}: only {} images checked",
        t.images
    );
    assert!(
        t.durable_checked > 0,
        "{scenario}: no image had a durable generation to check"
    );
}

fn count(log: &[Rec], f: impl Fn(&Rec) -> bool) -> usize {
    log.iter().filter(|r| f(r)).count()
}

fn is_index(p: &Path) -> bool {
    p.to_string_lossy().ends_with("index.sqlite")
}

#[test]
fn power_cuts_during_publication_and_durable_marking_lose_no_durable_generation() {
    let base = tempfile::tempdir().unwrap();
    let run = record_run("publish", base.path(), None, Eviction::Lru, |svc, store| {
        for _ in 0..6 {
            store(svc);
            settle(svc);
        }
    });
    check_run("publish", &run, 24, 8, 40);
}

#[test]
fn power_cuts_during_wal_checkpoints_lose_no_durable_generation() {
    let base = tempfile::tempdir().unwrap();
    let run = record_run(
        "checkpoint",
        base.path(),
        None,
        Eviction::Lru,
        |svc, store| {
            for _ in 0..4 {
                store(svc);
                settle(svc);
                // The background thread checkpoints every 250 ms while commits
                // arrive.
                std::thread::sleep(Duration::from_millis(300));
            }
        },
    );
    let db_writes = count(
        &run.log,
        |r| matches!(r, Rec::Write(p, _, _) if is_index(p)),
    );
    assert!(db_writes > 0, "no checkpoint wrote the database file");
    check_run("checkpoint", &run, 24, 8, 40);
}

#[test]
fn power_cuts_during_l2_eviction_lose_no_durable_generation() {
    power_cuts_during_l2_eviction(Eviction::Lru);
}

/// The same under `--eviction cost`: another order of victims, the same
/// durability.
#[test]
fn power_cuts_during_cost_aware_l2_eviction_lose_no_durable_generation() {
    power_cuts_during_l2_eviction(Eviction::Cost);
}

fn power_cuts_during_l2_eviction(eviction: Eviction) {
    let base = tempfile::tempdir().unwrap();
    // Room for about three generations' objects: later stores evict.
    let one = charged_l2([&gen_manifest("evict", 0)], base.path()).1;
    let run = record_run(
        "evict",
        base.path(),
        Some(one * 3),
        eviction,
        |svc, store| {
            let mut before: Vec<Manifest> = Vec::new();
            for _ in 0..7 {
                let marker = mark_release();
                let m = store(svc);
                settle(svc);
                let gone: Vec<String> = before
                    .iter()
                    .filter(|old| !is_listed(svc, old))
                    .map(|old| old.generation().to_owned())
                    .collect();
                before.retain(|old| !gone.iter().any(|g| g == old.generation()));
                fill_release(marker, gone);
                before.push(m);
            }
        },
    );
    let unlinks = count(
        &run.log,
        |r| matches!(r, Rec::Unlink(p) if p.to_string_lossy().ends_with(".page")),
    );
    assert!(unlinks > 0, "nothing was evicted from L2");
    check_run("evict", &run, 24, 8, 40);
}

#[test]
fn power_cuts_around_clear_lose_no_durable_generation() {
    let base = tempfile::tempdir().unwrap();
    let run = record_run("clear", base.path(), None, Eviction::Lru, |svc, store| {
        for _ in 0..3 {
            store(svc);
            settle(svc);
        }
        let marker = mark_release();
        let report = svc.clear(true, true).unwrap();
        assert!(report.retired_generations > 0, "{report:?}");
        let all = (0..3).map(|i| gen_manifest("clear", i).generation().to_owned());
        fill_release(marker, all.collect());
        for _ in 0..2 {
            store(svc);
            settle(svc);
        }
    });
    check_run("clear", &run, 24, 8, 40);
}

/// Generations imported from the shared tier (`service/shared.rs`): another
/// host stores and uploads them to a shared filesystem (`file://`); the
/// recorded host finds them there (the import publishes each in its
/// directory, not durable, its pages known only remotely), restores them
/// (each page fetched into L1, then written to its L2, which makes the
/// import durable here) and stores one of its own between imports. A power
/// cut anywhere keeps every import whose durable flag was synced, with its
/// pages; an import cut before that is retired at the restart or misses
/// cleanly (the restart has no shared tier: nothing can be fetched again).
#[cfg(feature = "shared-tier")]
#[test]
fn power_cuts_during_shared_tier_imports_lose_no_durable_generation() {
    use lmcache_rc_core::TokenRoots;
    use lmcache_rc_core::service::SharedSettings;

    let base = tempfile::tempdir().unwrap();
    let shared_dir = base.path().join("shared");
    std::fs::create_dir(&shared_dir).unwrap();
    let shared = || SharedSettings {
        // Generous: a lookup must not time out on a busy machine.
        lookup_timeout: Duration::from_secs(10),
        ..SharedSettings::new(format!("file://{}", shared_dir.display()))
    };
    // The other host: its own directory and L2, the same shared tier.
    let scenario = "shared-import";
    let remote: Vec<Manifest> = (100..103).map(|i| gen_manifest(scenario, i)).collect();
    {
        let other = tempfile::tempdir().unwrap();
        let host = CheckpointService::open(ServiceConfig {
            shared: Some(shared()),
            ..durable_config("crash-images-other-host", other.path())
        })
        .unwrap();
        for m in &remote {
            store_all(&host, m);
        }
        settle(&host);
        let deadline = std::time::Instant::now() + HANG_GUARD;
        while stat(&host, "shared_manifests_written") < remote.len() as u64
            || stat(&host, "shared_upload_queue") > 0
        {
            assert!(
                std::time::Instant::now() < deadline,
                "uploads did not finish"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        host.close().unwrap();
    }
    let ns = gen_namespace(scenario);
    let mut imported = Vec::new();
    let mut run = record_run_with(
        scenario,
        base.path(),
        None,
        Eviction::Lru,
        |c| ServiceConfig {
            shared: Some(shared()),
            ..c
        },
        |svc, store| {
            for (i, m) in (100..103).zip(&remote) {
                let roots = TokenRoots::build(&ns, gen_tokens(i), 4096).unwrap().roots();
                let found = svc.find(&roots).unwrap();
                assert_eq!(found.as_ref(), Some(m), "the import of {}", m.generation());
                imported.push(m.clone());
                restore_all(svc, m);
                settle(svc);
                store(svc);
                settle(svc);
            }
            assert_eq!(stat(svc, "shared_imports"), remote.len() as u64);
        },
    );
    let flags = flagged(&run.root.join("idx").join("index.sqlite"));
    for m in &imported {
        assert!(
            flags.contains(m.generation()),
            "the import of {} became durable by the end of the run",
            m.generation()
        );
    }
    run.stored.extend(imported);
    // Fewer cut points than the other scenarios (CI time): the log is as
    // long, and the import's own steps are a small part of it.
    check_run(scenario, &run, 16, 6, 30);
}
