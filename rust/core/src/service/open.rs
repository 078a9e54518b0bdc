//! Opening the service and reconciling the directory with L2 at start-up.

use std::collections::HashMap;
use std::sync::Arc;

use super::counters::Counter;
use super::keys::object_keys;
use super::state::{Obj, State};
use super::tiers::StateLock;
use super::{CheckpointService, Inner, ServiceConfig};
use crate::error::{Error, Result};
use crate::index::{Directory, DirectoryConfig};
use crate::manifest::Manifest;
use crate::store::ObjectKey;
use crate::store::alloc::SlotAllocator;
use crate::store::l2::{Fs, Inventory, IoPool, L2Tier, RealFs};
use crate::store::shm::ShmPool;

/// A random salt for lease ids, so ids of an earlier run are never ours.
fn lease_salt() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.write_u32(std::process::id());
    h.finish()
}

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
                ..DirectoryConfig::default()
            },
        )?;
        let (l2, inventory) = match &config.l2_path {
            Some(path) => {
                let (tier, inventory) =
                    L2Tier::open_with_progress(path, config.l2_bytes, fs, progress)?;
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
        let pool = ShmPool::create(config.l1_bytes)?;
        let inner = Arc::new(Inner {
            config,
            pool,
            dir,
            l2,
            io: parking_lot::Mutex::new(io),
            state: StateLock::new(State::new(alloc, lease_salt())),
            opened: std::time::Instant::now(),
        });
        reconcile(&inner, inventory)?;
        let reaper = super::reclaim::Reaper::start(&inner)?;
        Ok(CheckpointService {
            inner,
            reaper: parking_lot::Mutex::new(Some(reaper)),
        })
    }
}

/// Start-up reconciliation: every listed generation must have all of its
/// objects verified on disk (I8); others are retired. Objects no listed
/// generation references are deleted; unreadable files are reclaimed. Errors
/// here fail the open (nothing is served from a tier that cannot be fixed).
fn reconcile(inner: &Arc<Inner>, inventory: Option<Inventory>) -> Result<()> {
    let mut on_disk = HashMap::new();
    if let Some(inv) = &inventory {
        for entry in &inv.objects {
            on_disk.insert(entry.key, entry.page_bytes);
        }
        if let Some(l2) = &inner.l2 {
            if !inv.unreadable.is_empty() {
                let n = l2.reclaim_unreadable(&inv.unreadable)?;
                log::warn!("reclaimed {n} unreadable or old-format L2 files");
            }
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
            st.list_generation(
                manifest.generation(),
                keys.into_iter().map(|(k, _)| k).collect(),
            );
        }
        // Files that no listed generation references are garbage (I7).
        let garbage: Vec<ObjectKey> = on_disk
            .keys()
            .filter(|key| !st.objects.contains_key(*key))
            .copied()
            .collect();
        st.count(Counter::RestartRetired, retire.len() as u64);
        // Listed generations were durable when they were listed; the files
        // deleted here fail the open if they cannot be (below), so neither
        // is left for the guard to perform.
        st.newly_durable.clear();
        garbage
    };
    if !retire.is_empty() {
        log::warn!(
            "start-up: retired {} generation(s) whose objects are missing or corrupt",
            retire.len()
        );
        inner.dir.retire(&retire)?;
    }
    if let Some(l2) = &inner.l2 {
        for key in deletes {
            l2.remove(&key)?;
        }
    }
    Ok(())
}

/// All objects of all ranks of a manifest with their page sizes.
fn all_rank_keys(manifest: &Manifest) -> Result<Vec<(ObjectKey, u64)>> {
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
