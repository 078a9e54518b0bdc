//! Operators' view and controls: capabilities, status, clear, the list of
//! generations, and close.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::Inner;
use super::counters::Counter;
use super::retrieve::release_readers;
use super::state::{L1, L2};
use crate::error::{Error, Result};
use crate::identity::validate_namespace;
use crate::protocol::{
    Capabilities, ChangeBatch, ClearReport, FORMAT_VERSION, GenerationInfo, MAX_WATCH,
    PROTOCOL_VERSION, ServiceStatus,
};
use crate::store::ObjectKey;

/// What a client needs to map the pool.
pub(super) fn capabilities(inner: &Inner) -> Capabilities {
    Capabilities {
        format_version: FORMAT_VERSION,
        protocol_version: PROTOCOL_VERSION,
        pool_id: inner.pool.id().to_string(),
        pool_size: inner.pool.size(),
        durable_index: inner.config.checkpoint_index_path.is_some(),
    }
}

/// Counters and gauges (the keys `lmcache_rc.results.ServiceStatus` names): every counter (zeros included),
/// the uptime, the misses that happened, by reason, and the service's facts
/// (version, paths; `socket` is the RPC server's to fill in).
pub(super) fn status(inner: &Arc<Inner>) -> Result<ServiceStatus> {
    let dir = inner.dir.status()?;
    let io_queue = inner.io.lock().as_ref().map_or(0, |io| io.queued() as u64);
    let (l2_objects, l2_bytes, l2_capacity, written) = match &inner.l2 {
        Some(l2) => (
            l2.object_count() as u64,
            l2.used_bytes(),
            l2.capacity().unwrap_or(0),
            l2.bytes_written(),
        ),
        None => (0, 0, 0, 0),
    };
    let st = inner.lock();
    let queued = st.objects.values().filter(|o| o.l2 == L2::Queued).count() as u64;
    let l1_objects = st.objects.values().filter(|o| o.slot.is_some()).count() as u64;
    let gauges = [
        ("generations", dir.published_generations),
        ("pending", dir.pending_generations),
        ("store_leases", st.store_ranks.len() as u64),
        ("retrieve_leases", st.retrieve_leases.len() as u64),
        ("pins", st.pins_total()),
        ("l1_objects", l1_objects),
        ("l1_bytes", st.alloc.used()),
        ("l1_capacity", st.alloc.capacity()),
        ("objects", st.objects.len() as u64),
        ("l2_objects", l2_objects),
        ("l2_bytes", l2_bytes),
        // 0: no L2 tier, or one without a byte limit.
        ("l2_capacity", l2_capacity),
        ("l2_bytes_written", written),
        ("l2_queue", queued.max(io_queue)),
        ("l2_write_retrying", inner.upkeep.retries_waiting() as u64),
        ("pending_bytes", st.pending_bytes),
        (
            "stores_refused",
            u64::from(inner.dir.read_only().is_some() || inner.upkeep.disk_full().is_some()),
        ),
        ("uptime_seconds", inner.opened.elapsed().as_secs()),
    ];
    let mut values: BTreeMap<String, u64> = gauges
        .into_iter()
        .map(|(name, value)| (name.to_string(), value))
        .collect();
    for (counter, value) in st.counters.events() {
        values.insert(counter.as_str().to_string(), value);
    }
    #[cfg(feature = "shared-tier")]
    values.extend(super::shared::status_values(inner));
    values.extend(inner.meters.status_values());
    let misses = st
        .counters
        .misses()
        .map(|(reason, n)| (reason.as_str().to_string(), n))
        .collect();
    let path = |p: &Option<std::path::PathBuf>| p.as_ref().map(|p| p.display().to_string());
    let info = [
        ("version", Some(env!("CARGO_PKG_VERSION").to_string())),
        ("socket", None),
        (
            "checkpoint_index_path",
            path(&inner.config.checkpoint_index_path),
        ),
        ("l2_path", path(&inner.config.l2_path)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    Ok(ServiceStatus {
        values,
        misses,
        info,
    })
}

/// Drops L1 copies (and with `all_tiers` L2 files too). `force = false`
/// keeps leased and pinned objects; `force = true` is refused while any
/// lease is live and otherwise drops everything (pending generations are
/// aborted). A listed generation whose only copy goes is retired.
pub(super) fn clear(inner: &Arc<Inner>, force: bool, all_tiers: bool) -> Result<ClearReport> {
    if force {
        let pending: Vec<String> = {
            let mut st = inner.lock();
            if st.live_leases() > 0 {
                return Err(Error::LeasesLive(format!(
                    "forced clear refused: {} store and {} retrieve lease(s) are live; \
                     finish them or clear without force",
                    st.store_ranks.len(),
                    st.retrieve_leases.len()
                )));
            }
            let pending: Vec<String> = st.pending.keys().cloned().collect();
            for g in &pending {
                st.release_pending(g);
            }
            pending
        };
        for g in &pending {
            inner.dir.abort(g)?;
        }
    }
    let mut report = ClearReport::default();
    let mut st = inner.lock();
    // Counted by comparing before and after: retiring a generation
    // reclaims its other unreferenced objects in the same step, before
    // the loop reaches them.
    let before: Vec<(ObjectKey, bool, bool, u64)> = st
        .objects
        .iter()
        .map(|(k, o)| (*k, o.slot.is_some(), o.l2 == L2::Durable, o.page_bytes))
        .collect();
    for &(key, _, _, _) in &before {
        let Some(obj) = st.objects.get(&key) else {
            continue;
        };
        let in_l1 = obj.slot.is_some();
        let durable = obj.l2 == L2::Durable;
        // A shared-tier copy is never dropped here (other hosts use it), so
        // a page that has one keeps its generations, as eviction does.
        let in_shared = obj.remote.is_some();
        if !obj.idle() || !matches!(obj.l1, L1::Ready | L1::Absent) {
            report.kept_objects += 1;
            continue;
        }
        let drops_last_copy = !in_shared && ((in_l1 && !durable) || (all_tiers && durable));
        if !in_l1 && !all_tiers {
            continue;
        }
        if drops_last_copy {
            report.retired_generations += st.retire_generations_of(&key) as u64;
        }
        if st.objects.contains_key(&key) {
            st.drop_l1(&key);
            if all_tiers
                && let Some(obj) = st.objects.get_mut(&key)
                && obj.l2 == L2::Durable
            {
                obj.l2 = L2::Absent;
                st.queue_l2_delete(key);
            }
            st.maybe_reclaim(&key);
        }
    }
    for (key, was_in_l1, was_durable, page_bytes) in before {
        let now = st.objects.get(&key);
        if was_in_l1 && now.is_none_or(|o| o.slot.is_none()) {
            report.l1_objects += 1;
            report.l1_bytes += page_bytes;
        }
        if was_durable && now.is_none_or(|o| o.l2 != L2::Durable) {
            report.l2_objects += 1;
        }
    }
    st.count(Counter::Clears, 1);
    Ok(report)
}

/// Retires every listed generation of one namespace and answers how many.
///
/// Scoped: other namespaces are untouched (object keys name their
/// namespace, so no page is shared across namespaces). Each generation is
/// unlisted in the state first and removed from the directory when the
/// guard is released (the eviction path's order); its pages go from L1 and
/// L2 once nothing holds them (a retrieve lease in flight keeps its pages
/// until it is finished). A generation whose publication is still
/// acknowledging, and pending ones, are not touched: they are not listed yet.
pub(super) fn invalidate_namespace(inner: &Arc<Inner>, namespace: &str) -> Result<u64> {
    validate_namespace(namespace)?;
    let generations = inner.dir.generations_of_namespace(namespace)?;
    let mut st = inner.lock();
    let mut retired = 0;
    for generation in generations {
        let name: Arc<str> = Arc::from(generation.as_str());
        if st.unlist_generation(&generation) {
            st.to_retire.push(name);
            retired += 1;
        }
    }
    st.count(Counter::InvalidatedGenerations, retired);
    Ok(retired)
}

/// The change feed since `since`, and the current tier of each watched
/// generation, under one lock (`docs/design/change-feed.md`).
pub(super) fn changes(inner: &Arc<Inner>, since: u64, watch: &[String]) -> Result<ChangeBatch> {
    if watch.len() > MAX_WATCH {
        return Err(Error::invalid(format!(
            "changes: {} watched generations, at most {MAX_WATCH} per call",
            watch.len()
        )));
    }
    let st = inner.lock();
    let mut batch = st.feed.read(since);
    batch.watched = watch
        .iter()
        .map(|g| st.tier_of(g).map(|t| t.as_str().to_string()))
        .collect();
    Ok(batch)
}

/// Every listed generation, ordered by id (pages through the directory).
pub(super) fn list_generations(inner: &Inner) -> Result<Vec<GenerationInfo>> {
    let mut out = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = inner.dir.list(after.as_deref(), 1024)?;
        out.extend(page.generations.into_iter().map(|g| GenerationInfo {
            generation: g.manifest.generation().to_string(),
            num_tokens: g.manifest.prefix().num_tokens(),
            world_size: g.manifest.world_size(),
            payload_bytes: g.payload_bytes,
            durable: g.durable,
            access_order: g.access_order,
        }));
        match page.next_after {
            Some(next) => after = Some(next),
            None => return Ok(out),
        }
    }
}

/// Objects that no listed generation references and nothing holds.
pub(super) fn unreferenced_objects(inner: &Arc<Inner>) -> usize {
    let st = inner.lock();
    st.objects
        .values()
        .filter(|o| o.refs() == 0 && o.idle_holds())
        .count()
}

/// Closes the service: refuses (and stays usable) while store leases or
/// exposed retrieve leases exist; otherwise cancels pending lookups, drains
/// the L2 queue and closes the directory (the pool is unlinked on drop).
pub(super) fn close(inner: &Arc<Inner>) -> Result<()> {
    {
        let mut st = inner.lock();
        let exposed = st.retrieve_leases.values().filter(|l| l.exposed).count();
        if !st.store_ranks.is_empty() || exposed > 0 {
            return Err(Error::LeasesLive(format!(
                "checkpoint worker copy leases must drain before close ({} store, {} retrieve)",
                st.store_ranks.len(),
                exposed
            )));
        }
        st.accepting = false;
        let pending: Vec<u64> = st.retrieve_leases.keys().copied().collect();
        for n in pending {
            if let Some(lease) = st.retrieve_leases.remove(&n) {
                release_readers(&mut st, &lease);
            }
        }
    }
    inner.drain_io();
    inner.dir.close()
}
