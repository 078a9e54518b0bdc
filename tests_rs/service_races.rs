//! Races between background L2 work and new stores, made deterministic with
//! a filesystem whose deletes can be held at a gate.

use std::io;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};

use lmcache_rc_core::Manifest;
use lmcache_rc_core::service::LeaseStatus;
use lmcache_rc_core::store::l2::{DirEntryInfo, Fs, ReadFile, RealFs, WriteFile};

use crate::service_common::*;

both_ways!(a_page_stored_again_while_its_l2_delete_runs_stays_durable,);

#[derive(Default)]
struct Gate {
    /// File-name fragment whose removal is held.
    target: Option<String>,
    /// A removal of the target is waiting at the gate.
    entered: bool,
    released: bool,
}

/// `RealFs` whose `remove_file` of one armed target waits until released.
#[derive(Clone, Default)]
struct GatedFs {
    gate: Arc<(Mutex<Gate>, Condvar)>,
}

impl GatedFs {
    fn arm(&self, fragment: String) {
        *self.gate.0.lock().unwrap() = Gate {
            target: Some(fragment),
            ..Gate::default()
        };
    }
    fn wait_entered(&self) {
        let (lock, cv) = &*self.gate;
        let g = lock.lock().unwrap();
        let (g, timeout) = cv
            .wait_timeout_while(g, HANG_GUARD, |g| !g.entered)
            .unwrap();
        assert!(
            !timeout.timed_out() && g.entered,
            "the delete never reached the gate"
        );
    }
    fn release(&self) {
        let (lock, cv) = &*self.gate;
        lock.lock().unwrap().released = true;
        cv.notify_all();
    }
}

impl Fs for GatedFs {
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        RealFs.create_dir_all(path)
    }
    fn create_dir(&self, path: &Path) -> io::Result<()> {
        RealFs.create_dir(path)
    }
    fn create_new(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        RealFs.create_new(path)
    }
    fn open_read(&self, path: &Path) -> io::Result<Box<dyn ReadFile>> {
        RealFs.open_read(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        RealFs.rename(from, to)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        RealFs.sync_dir(path)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let (lock, cv) = &*self.gate;
        let mut g = lock.lock().unwrap();
        let held = g
            .target
            .as_deref()
            .is_some_and(|t| path.to_string_lossy().contains(t));
        if held {
            g.entered = true;
            cv.notify_all();
            let (g2, _) = cv
                .wait_timeout_while(g, HANG_GUARD, |g| !g.released)
                .unwrap();
            g = g2;
            g.target = None;
        }
        drop(g);
        RealFs.remove_file(path)
    }
    fn file_len(&self, path: &Path) -> io::Result<u64> {
        RealFs.file_len(path)
    }
    fn read_dir(&self, path: &Path) -> io::Result<Vec<DirEntryInfo>> {
        RealFs.read_dir(path)
    }
}

fn two_rank_generation() -> Manifest {
    let groups = vec![GroupSpec::new(
        "engine-kv-group:0",
        4096,
        vec![0],
        Role::Endpoint("recurrent:0".into()),
    )];
    build_manifest(NS, &seq(90_000, 20), 2, &groups, 2, "prompt")
}

/// An object whose L2 delete is still running must not be recreated as if
/// the old file were its durable copy: the delete would remove the new
/// generation's only disk copy while the service believes it durable.
fn a_page_stored_again_while_its_l2_delete_runs_stays_durable<T: Target>() {
    let dir = tempfile::tempdir().unwrap();
    let l2 = dir.path().join("l2");
    let fs = GatedFs::default();
    let svc = T::open_with_fs(
        config("race-del", Some(&l2)),
        Arc::new(fs.clone()),
        &mut |_| {},
    )
    .unwrap();
    let m = two_rank_generation();
    let key = rank_keys(&m, 0)[0][0];
    assert!(svc.begin(&m).unwrap());
    store_one(&svc, &m, 0);
    settle(&svc);
    assert_eq!(l2_files(&l2).0, 1);

    // Aborting the generation reclaims rank 0's committed page: its L2
    // delete is held at the gate.
    fs.arm(key.hex());
    std::thread::scope(|s| {
        let aborter = s.spawn(|| svc.abort(m.generation()).unwrap());
        fs.wait_entered();
        // The same generation is staged and rank 0 stored again meanwhile.
        assert!(svc.begin(&m).unwrap());
        let mut lease = svc.prepare_store(&m, 0).unwrap();
        let mut released = false;
        if lease.status == LeaseStatus::Busy {
            fs.release();
            released = true;
            lease = prepare(&svc, &m, 0);
        }
        assert_eq!(lease.status, LeaseStatus::Ready);
        assert!(
            lease.slots[0][0].is_some(),
            "the page was reclaimed: copy it again"
        );
        fill(&svc, &m, 0, &lease);
        svc.finish_store(lease.lease_id.as_deref().unwrap(), true, None)
            .unwrap();
        settle(&svc);
        if !released {
            fs.release();
        }
        aborter.join().unwrap();
    });
    store_one(&svc, &m, 1);
    settle(&svc);
    assert_eq!(l2_files(&l2), expected_l2([&m]), "both pages on disk");
    // Only the disk copies remain: the restore must read them back.
    svc.clear(false, false).unwrap();
    assert!(is_listed(&svc, &m));
    restore_all(&svc, &m);
    assert_idle(&svc);
    svc.close().unwrap();
}
