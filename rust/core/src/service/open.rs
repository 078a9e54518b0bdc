//! Opening the service and reconciling the directory with L2 at start-up.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use super::counters::Counter;
use super::feed::Feed;
use super::state::{Obj, State};
use super::tiers::StateLock;
use super::upkeep::Upkeep;
use super::{CheckpointService, Inner, ServiceConfig};
use crate::error::{Error, Result};
use crate::index::{Directory, DirectoryConfig};
use crate::manifest::Manifest;
use crate::store::ObjectKey;
use crate::store::alloc::SlotAllocator;
use crate::store::l2::{
    Binding, Fs, Inventory, IoPool, L2Tier, RealFs, read_binding, write_binding,
};
use crate::store::object_keys;
use crate::store::shm::ShmPool;

impl CheckpointService {
    /// Opens the service: creates the SHM pool, opens the directory and the L2
    /// tier, and reconciles them.
    ///
    /// Progress of a long start-up scan of L2 is logged every 10,000 files.
    pub fn open(config: ServiceConfig) -> Result<CheckpointService> {
        let mut next_report = 10_000;
        Self::open_with_progress(config, &mut |scanned| {
            if scanned >= next_report {
                log::info!("start-up: scanned {scanned} L2 object files");
                next_report = scanned + 10_000;
            }
        })
    }

    /// [`CheckpointService::open`] with a progress callback (`progress` is
    /// called with the number of L2 files scanned so far).
    pub fn open_with_progress(
        config: ServiceConfig,
        progress: &mut dyn FnMut(usize),
    ) -> Result<CheckpointService> {
        Self::open_with_fs(config, Arc::new(RealFs), progress)
    }

    /// [`CheckpointService::open`] with the filesystem L2 uses (tests inject
    /// faults through `store::l2::testing::FaultyFs`).
    pub fn open_with_fs(
        config: ServiceConfig,
        fs: Arc<dyn Fs>,
        progress: &mut dyn FnMut(usize),
    ) -> Result<CheckpointService> {
        if config.max_leases == 0 {
            return Err(Error::invalid("max_leases must be a positive integer"));
        }
        let alloc = SlotAllocator::new(config.l1_bytes)?;
        let dir = Directory::open(
            config.checkpoint_index_path.as_deref(),
            DirectoryConfig {
                max_entries: config.max_entries,
                max_pending: config.max_pending,
                vfs: config.index_vfs.clone(),
                ..DirectoryConfig::default()
            },
        )?;
        let (l2, inventory) = match &config.l2_path {
            Some(path) => {
                // Refused before the tier opens (which deletes temp files).
                let bound = check_binding(&*fs, path, &config, &dir)?;
                let (tier, inventory) =
                    L2Tier::open_with_progress(path, config.l2_bytes, fs.clone(), progress)?;
                bind(&*fs, path, &config, &dir, bound, &inventory)?;
                (Some(Arc::new(tier)), Some(inventory))
            }
            None => (None, None),
        };
        let io = match &l2 {
            Some(_) => Some(IoPool::new(
                config.l2_io_threads.max(1),
                4096,
                "lmcache-rc-l2",
            )?),
            None => None,
        };
        #[cfg(feature = "shared-tier")]
        let shared = match &config.shared {
            Some(settings) => Some(super::shared::SharedSide::open(settings)?),
            None => None,
        };
        #[cfg(not(feature = "shared-tier"))]
        if config.shared.is_some() {
            return Err(Error::invalid(
                "this build has no shared tier (cargo feature shared-tier)",
            ));
        }
        let pool = ShmPool::create(config.l1_bytes)?;
        let feed_capacity = config.change_feed_capacity;
        let eviction = config.eviction;
        let inner = Arc::new(Inner {
            config,
            pool,
            dir,
            l2,
            io: parking_lot::Mutex::new(io),
            state: StateLock::new(State::new(
                alloc,
                crate::private::random_bytes()?,
                Feed::new(
                    hex::encode(crate::private::random_bytes::<16>()?),
                    feed_capacity,
                ),
                eviction,
            )),
            upkeep: Upkeep::default(),
            deferred_retire: parking_lot::Mutex::new(Vec::new()),
            #[cfg(feature = "shared-tier")]
            shared,
            opened: std::time::Instant::now(),
            read_keys: parking_lot::Mutex::new(Default::default()),
            meters: Default::default(),
            engines: Default::default(),
        });
        reconcile(&inner, inventory)?;
        Upkeep::start(&inner)?;
        #[cfg(feature = "shared-tier")]
        super::shared::start(&inner)?;
        let reaper = super::reclaim::Reaper::start(&inner)?;
        Ok(CheckpointService {
            inner,
            reaper: parking_lot::Mutex::new(Some(reaper)),
        })
    }
}

/// The flags that name the index and the L2 directory, for messages.
const INDEX_FLAG: &str = "--checkpoint-index-path";
const L2_FLAG: &str = "--l2-path";

/// Refuses an L2 directory whose objects belong to another index, or to a
/// durable index that was not given (its objects would all be deleted as
/// unreferenced). Returns the binding found.
fn check_binding(
    fs: &dyn Fs,
    root: &Path,
    config: &ServiceConfig,
    dir: &Directory,
) -> Result<Option<Binding>> {
    let found = read_binding(fs, root)?;
    let Some(bound) = &found else {
        return Ok(None);
    };
    if !bound.durable {
        return Ok(found);
    }
    let owner = bound
        .index_path
        .clone()
        .unwrap_or_else(|| "(unknown path)".to_string());
    match (&config.checkpoint_index_path, dir.instance_id()) {
        (None, _) => Err(Error::invalid(format!(
            "L2 directory {} holds the objects of the durable checkpoint index {owner} (id \
             {}), but {INDEX_FLAG} is not given: without it every object would be deleted as \
             unreferenced. Pass {INDEX_FLAG} {owner}, choose another {L2_FLAG}, or delete {} \
             to discard its objects",
            root.display(),
            bound.index_id,
            root.display()
        ))),
        (Some(path), Some(id)) if id != bound.index_id => Err(Error::invalid(format!(
            "L2 directory {} belongs to another checkpoint index ({owner}, id {}); {INDEX_FLAG} \
             {} is index {id}, so the objects would be deleted as unreferenced. Pass \
             {INDEX_FLAG} {owner}, choose another {L2_FLAG}, or delete {} to discard its \
             objects",
            root.display(),
            bound.index_id,
            path.display(),
            root.display()
        ))),
        _ => Ok(found),
    }
}

/// Binds the L2 directory to this service's index once it is accepted: an
/// unbound directory with objects is adopted by a durable index and refused
/// without one (whose objects they are cannot be told).
fn bind(
    fs: &dyn Fs,
    root: &Path,
    config: &ServiceConfig,
    dir: &Directory,
    found: Option<Binding>,
    inventory: &Inventory,
) -> Result<()> {
    let durable = config.checkpoint_index_path.is_some();
    if found.is_none() && !durable && !inventory.objects.is_empty() {
        return Err(Error::invalid(format!(
            "L2 directory {} holds {} objects but no binding to an index (an older \
             lmcache-rc wrote it), and {INDEX_FLAG} is not given: without it every object \
             would be deleted as unreferenced. Pass the {INDEX_FLAG} they belong to, or delete \
             {} to discard them",
            root.display(),
            inventory.objects.len(),
            root.display()
        )));
    }
    if dir.read_only().is_some() {
        return Ok(()); // nothing is written (or deleted) on a full disk
    }
    let wanted = match dir.instance_id() {
        Some(id) => Binding::new(id, true, config.checkpoint_index_path.as_deref()),
        None if durable => return Ok(()),
        None => match &found {
            Some(b) if !b.durable => return Ok(()),
            _ => Binding::new(crate::private::random_id()?, false, None),
        },
    };
    if found.as_ref() != Some(&wanted) {
        // The binding names the directory's id: the id must be on disk
        // before the binding is (a binding naming an id a power cut took
        // away would refuse every restart).
        if wanted.durable {
            dir.sync()?;
        }
        write_binding(fs, root, &wanted)?;
        if let Some(old) = found.filter(|b| b.index_id != wanted.index_id) {
            log::info!(
                "L2 directory {}: bound to checkpoint index {} (it belonged to {}index {})",
                root.display(),
                wanted.index_id,
                if old.durable { "" } else { "the in-memory " },
                old.index_id
            );
        }
    }
    Ok(())
}

/// Start-up reconciliation: every listed generation must have all of its
/// objects verified on disk (I8); others are retired. Objects no listed
/// generation references are deleted; unreadable files are reclaimed. Errors
/// here fail the open (nothing is served from a tier that cannot be fixed).
fn reconcile(inner: &Arc<Inner>, inventory: Option<Inventory>) -> Result<()> {
    let mut on_disk = HashMap::new();
    // On a full disk (read-only directory) nothing is deleted: start-up
    // only decides what is served.
    let read_only = inner.dir.read_only().is_some();
    if let Some(inv) = &inventory {
        for entry in &inv.objects {
            on_disk.insert(entry.key, entry.page_bytes);
        }
        if let Some(l2) = inner.l2.as_ref().filter(|_| !read_only)
            && !inv.unreadable.is_empty()
        {
            let n = l2.reclaim_unreadable(&inv.unreadable)?;
            log::warn!("reclaimed {n} unreadable or old-format L2 files");
        }
    }
    let mut listed = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = inner.dir.list(after.as_deref(), 1024)?;
        listed.extend(page.generations);
        match page.next_after {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    let mut retire = Vec::new();
    let deletes = {
        let mut st = inner.lock();
        for entry in listed {
            let manifest = entry.manifest;
            let keys = match all_rank_keys(&manifest) {
                Ok(k) => k,
                Err(e) => {
                    log::warn!("retiring {}: payload invalid: {e}", manifest.generation());
                    retire.push(manifest.generation().to_string());
                    continue;
                }
            };
            let complete = keys
                .iter()
                .all(|(key, bytes)| on_disk.get(key).is_some_and(|b| b == bytes));
            if !complete {
                retire.push(manifest.generation().to_string());
                continue;
            }
            for (key, bytes) in &keys {
                st.objects
                    .entry(*key)
                    .or_insert_with(|| Obj::on_disk(*bytes));
            }
            let queued = st.newly_durable.len();
            st.list_generation(
                manifest.generation(),
                keys.into_iter().map(|(k, _)| k).collect(),
                manifest.prefix().num_tokens(),
            );
            // Every object of a listed generation is on disk now; one whose
            // flag was never committed (a crash between the last object's
            // fsync and the flag) is marked durable by the guard below.
            // Those already flagged need nothing.
            if entry.durable {
                st.newly_durable.truncate(queued);
            }
        }
        // Files that no listed generation references are garbage (I7).
        let garbage: Vec<ObjectKey> = on_disk
            .keys()
            .filter(|key| !st.objects.contains_key(*key))
            .copied()
            .collect();
        st.count(Counter::RestartRetired, retire.len() as u64);
        if inner.dir.read_only().is_some() {
            // The flags wait until the directory is writable again.
            st.newly_durable.clear();
        }
        garbage
    };
    if !retire.is_empty() {
        if let Some(why) = inner.dir.read_only() {
            log::warn!(
                "start-up: {} generation(s) whose objects are missing or corrupt are not \
                 served; they are retired once the directory is writable ({why})",
                retire.len()
            );
            inner.deferred_retire.lock().extend(retire);
        } else {
            match inner.dir.retire(&retire) {
                Ok(_) => log::warn!(
                    "start-up: retired {} generation(s) whose objects are missing or corrupt",
                    retire.len()
                ),
                // A full disk never fails the start: they are not served
                // (never listed in memory) and retired once space returns.
                Err(e @ Error::OutOfSpace(_)) => {
                    log::warn!(
                        "start-up: {} generation(s) whose objects are missing or corrupt are \
                         not served; they are retired once space returns ({e})",
                        retire.len()
                    );
                    inner.deferred_retire.lock().extend(retire);
                    inner
                        .upkeep
                        .note_disk_full(format!("retiring incomplete generations failed: {e}"));
                }
                Err(e) => return Err(e),
            }
        }
    }
    if let Some(l2) = inner.l2.as_ref().filter(|_| !read_only) {
        for key in deletes {
            l2.remove(&key)?;
        }
    }
    Ok(())
}

/// Retires what start-up found incomplete while the directory was
/// read-only (called once it is writable again).
pub(super) fn retire_deferred(inner: &std::sync::Arc<Inner>) {
    let retire = std::mem::take(&mut *inner.deferred_retire.lock());
    if retire.is_empty() {
        return;
    }
    match inner.dir.retire(&retire) {
        Ok(_) => log::warn!(
            "retired {} generation(s) whose objects were missing or corrupt at start-up",
            retire.len()
        ),
        Err(e) => {
            log::warn!("retiring generations found incomplete at start-up failed: {e}");
            inner.deferred_retire.lock().extend(retire);
            if matches!(e, Error::OutOfSpace(_)) {
                inner.upkeep.note_disk_full(format!(
                    "retiring generations found incomplete at start-up failed: {e}"
                ));
            }
        }
    }
}

/// All objects of all ranks of a manifest with their page sizes.
pub(super) fn all_rank_keys(manifest: &Manifest) -> Result<Vec<(ObjectKey, u64)>> {
    let schema = manifest.payload_schema()?;
    let mut out = Vec::new();
    for rank in 0..manifest.world_size() {
        for (group, keys) in schema
            .page_groups
            .iter()
            .zip(object_keys(manifest, &schema, rank)?)
        {
            out.extend(keys.into_iter().map(|k| (k, group.page_bytes)));
        }
    }
    Ok(out)
}
