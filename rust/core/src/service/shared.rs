//! The service's side of the shared tier (`docs/design/shared-tier.md` §10):
//! write-behind uploads, cross-host lookups that import what they find, and
//! read-through fetches of imported pages into L1.
//!
//! - **Uploads.** A generation is queued for upload once it is durable in
//!   L2 (or once published, without L2). One thread of its own takes the
//!   queue in order: it holds every page of the generation (an I/O hold, as
//!   L2 writes do, so no L1 copy is evicted and no L2 file deleted while it
//!   is read), hands [`SharedTier::upload`] a reader (the L1 copy when
//!   resident, else the verified L2 file), then releases the holds and
//!   notes that each page now has a shared copy. The queue holds at most
//!   `upload_queue` generations; beyond, the oldest waiting one is dropped
//!   (counted). A failed upload is retried with backoff (1 s doubling to 60
//!   s, [`MAX_ATTEMPTS`] attempts). At start the thread walks the directory
//!   once and queues every durable generation (a restarted host redoes what
//!   a crash interrupted; one `HEAD` each for those already there).
//! - **Lookups.** `find` asks the shared tier, within `lookup_timeout`, for a
//!   prefix longer than the local hit. A found manifest (verified by the
//!   tier) is imported: staged and published in the directory like a store
//!   whose every rank acknowledged, its pages recorded as objects known
//!   from the shared tier (`Obj::remote`). It is not durable: it becomes so
//!   when all its pages were fetched and written to L2.
//! - **Fetches.** A restore of a page that only the shared tier has takes a
//!   slot (`Loading`, like an L2 load) and fetches the page on the fetch
//!   threads; the tier verifies it against its key, size and checksum before
//!   it is copied into the slot. Any failure fails the waiting leases
//!   (`shared_fetch_error`) and retires the generations naming the page.
//!
//! Nothing here runs under the service lock except bookkeeping, and nothing
//! on the RPC path waits for an upload.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::Inner;
use super::counters::Counter;
use super::state::{Fetch, L1, L2};
use super::types::SharedSettings;
use crate::error::{Error, Result};
use crate::identity::Prefix;
use crate::manifest::Manifest;
use crate::protocol::MissReason;
use crate::shared::{SharedConfig, SharedCounter, SharedTier};
use crate::store::ObjectKey;
use crate::store::l2::IoPool;

/// First delay before a failed upload is retried.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Longest delay between upload attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// Attempts of one upload before it is given up (the next start redoes it).
pub(super) const MAX_ATTEMPTS: u32 = 8;
/// Generations the start-up pass reads from the directory at a time.
const BACKFILL_PAGE: usize = 64;
/// Fetches waiting for a fetch thread at most (beyond, a restore misses).
const FETCH_QUEUE: usize = 4096;
/// How long a generation whose page failed to fetch is not imported again.
pub(super) const REIMPORT_AFTER: Duration = Duration::from_secs(300);
/// Most generations remembered as failed (the oldest are forgotten first).
const MAX_FAILED: usize = 4096;

/// One generation waiting for its upload.
#[derive(Debug)]
struct Job {
    generation: Arc<str>,
    /// Attempts so far.
    attempt: u32,
    /// Not before this.
    due: Instant,
}

#[derive(Debug, Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// The generations in `jobs` (each is queued once).
    names: HashSet<Arc<str>>,
    /// The start-up pass: where it continues (`Some(None)`: from the start),
    /// or `None` once it is done.
    backfill: Option<Option<String>>,
    /// An upload is running.
    busy: bool,
    stopped: bool,
}

/// The upload queue's counters (status `shared_*`).
#[derive(Debug, Default)]
struct QueueCounters {
    queued: AtomicU64,
    dropped: AtomicU64,
    retries: AtomicU64,
    given_up: AtomicU64,
    skipped: AtomicU64,
}

/// The shared tier as the service uses it.
pub(super) struct SharedSide {
    tier: SharedTier,
    settings: SharedSettings,
    queue: Mutex<Queue>,
    wake: Condvar,
    counters: QueueCounters,
    worker: Mutex<Option<JoinHandle<()>>>,
    fetch: Mutex<Option<IoPool>>,
    /// Generations whose page failed to fetch, and when: a lookup that finds
    /// one of them again within [`REIMPORT_AFTER`] does not import it (every
    /// restore of it would fail the same way).
    failed: Mutex<HashMap<Arc<str>, Instant>>,
}

impl SharedSide {
    /// Opens the tier (no request is sent yet). The threads start with
    /// [`start`], once the service exists.
    pub(super) fn open(settings: &SharedSettings) -> Result<SharedSide> {
        if settings.upload_queue == 0 || settings.fetch_threads == 0 {
            return Err(Error::invalid(
                "the shared tier's upload queue and fetch threads must be at least 1",
            ));
        }
        let mut config = SharedConfig::new(settings.url.clone());
        config.options = settings.options.clone();
        config.inject_latency = settings.inject_latency;
        let tier = SharedTier::open(config)?;
        Ok(SharedSide {
            tier,
            settings: settings.clone(),
            queue: Mutex::new(Queue::default()),
            wake: Condvar::new(),
            counters: QueueCounters::default(),
            worker: Mutex::new(None),
            fetch: Mutex::new(None),
            failed: Mutex::new(HashMap::new()),
        })
    }

    /// Queues generations for upload (each at most once; the oldest waiting
    /// one is dropped when the queue is full).
    pub(super) fn enqueue<I: IntoIterator<Item = Arc<str>>>(&self, generations: I) {
        let mut q = self.queue.lock();
        if q.stopped {
            return;
        }
        let mut any = false;
        for generation in generations {
            if q.names.contains(&generation) {
                continue;
            }
            self.push(&mut q, generation, 0, Instant::now());
            self.counters.queued.fetch_add(1, Ordering::Relaxed);
            any = true;
        }
        drop(q);
        if any {
            self.wake.notify_all();
        }
    }

    fn push(&self, q: &mut Queue, generation: Arc<str>, attempt: u32, due: Instant) {
        while q.jobs.len() >= self.settings.upload_queue {
            let Some(old) = q.jobs.pop_front() else { break };
            q.names.remove(&old.generation);
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            log::warn!(
                "shared tier: upload queue full ({} generations): dropped the upload of {}",
                self.settings.upload_queue,
                old.generation
            );
        }
        q.names.insert(generation.clone());
        q.jobs.push_back(Job {
            generation,
            attempt,
            due,
        });
    }

    /// Remembers generations whose page failed to fetch.
    fn note_failed(&self, generations: &[Arc<str>]) {
        let mut failed = self.failed.lock();
        let now = Instant::now();
        failed.retain(|_, at| now.duration_since(*at) < REIMPORT_AFTER);
        for g in generations {
            if failed.len() >= MAX_FAILED {
                let oldest = failed
                    .iter()
                    .min_by_key(|(_, at)| **at)
                    .map(|(g, _)| g.clone());
                if let Some(oldest) = oldest {
                    failed.remove(&oldest);
                }
            }
            failed.insert(g.clone(), now);
        }
    }

    /// Whether a generation's page failed to fetch lately.
    fn failed_lately(&self, generation: &str) -> bool {
        self.failed
            .lock()
            .get(generation)
            .is_some_and(|at| at.elapsed() < REIMPORT_AFTER)
    }

    /// Stops the upload thread and the fetch threads; uploads and fetches
    /// in flight are abandoned (the tier answers `Closed`), queued uploads
    /// dropped (a restart redoes them).
    pub(super) fn stop(&self) {
        {
            let mut q = self.queue.lock();
            q.stopped = true;
            q.jobs.clear();
            q.names.clear();
        }
        self.tier.close();
        self.wake.notify_all();
        if let Some(handle) = self.worker.lock().take()
            && handle.thread().id() != std::thread::current().id()
            && handle.join().is_err()
        {
            log::error!("the shared tier's upload thread panicked");
        }
        if let Some(pool) = self.fetch.lock().take() {
            pool.shutdown();
        }
    }

    /// Status values: the queue's and the tier's counters, `shared_*`.
    fn values(&self) -> Vec<(String, u64)> {
        let (len, busy) = {
            let q = self.queue.lock();
            (q.jobs.len() as u64, u64::from(q.busy))
        };
        let c = &self.counters;
        let mut out = vec![
            ("shared_enabled".to_string(), 1),
            ("shared_upload_queue".to_string(), len + busy),
            (
                "shared_uploads_queued".to_string(),
                c.queued.load(Ordering::Relaxed),
            ),
            (
                "shared_uploads_dropped".to_string(),
                c.dropped.load(Ordering::Relaxed),
            ),
            (
                "shared_upload_retries".to_string(),
                c.retries.load(Ordering::Relaxed),
            ),
            (
                "shared_uploads_given_up".to_string(),
                c.given_up.load(Ordering::Relaxed),
            ),
            (
                "shared_uploads_skipped".to_string(),
                c.skipped.load(Ordering::Relaxed),
            ),
        ];
        out.extend(
            self.tier
                .counters()
                .snapshot()
                .into_iter()
                .filter(|(name, _)| in_status(name))
                .map(|(name, value)| (format!("shared_{name}"), value)),
        );
        out
    }
}

/// Whether a tier counter is a status value: gc runs from the command
/// line, never in the sidecar, and `lookups` is the sum of the hits and the
/// misses by reason.
fn in_status(name: &str) -> bool {
    !name.starts_with("gc_") && name != "lookups"
}

/// The shared tier's status values; zeros when the service has none.
pub(super) fn status_values(inner: &Inner) -> Vec<(String, u64)> {
    match &inner.shared {
        Some(side) => side.values(),
        None => {
            let mut out: Vec<(String, u64)> = [
                "shared_enabled",
                "shared_upload_queue",
                "shared_uploads_queued",
                "shared_uploads_dropped",
                "shared_upload_retries",
                "shared_uploads_given_up",
                "shared_uploads_skipped",
            ]
            .iter()
            .map(|name| (name.to_string(), 0))
            .collect();
            out.extend(
                SharedCounter::ALL
                    .iter()
                    .filter(|c| in_status(c.as_str()))
                    .map(|c| (format!("shared_{}", c.as_str()), 0)),
            );
            out
        }
    }
}

/// Starts the upload thread and the fetch threads; with L2, the start-up
/// pass queues every durable generation.
pub(super) fn start(inner: &Arc<Inner>) -> Result<()> {
    let Some(side) = &inner.shared else {
        return Ok(());
    };
    *side.fetch.lock() = Some(IoPool::new(
        side.settings.fetch_threads,
        FETCH_QUEUE,
        "lmcache-rc-fetch",
    )?);
    if inner.l2.is_some() {
        side.queue.lock().backfill = Some(None);
    }
    let weak = Arc::downgrade(inner);
    let handle = std::thread::Builder::new()
        .name("lmcache-rc-shared".into())
        .spawn(move || run(weak))
        .map_err(|e| Error::io("start the shared tier's upload thread", e))?;
    *side.worker.lock() = Some(handle);
    Ok(())
}

/// What the upload thread does next.
enum Work {
    Upload(Job),
    Backfill(Option<String>),
}

/// The upload thread: due uploads in queue order, then the start-up pass.
fn run(weak: Weak<Inner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let Some(side) = &inner.shared else { return };
        let work = {
            let mut q = side.queue.lock();
            loop {
                if q.stopped {
                    return;
                }
                let now = Instant::now();
                if let Some(i) = q.jobs.iter().position(|j| j.due <= now) {
                    let Some(job) = q.jobs.remove(i) else {
                        continue;
                    };
                    q.names.remove(&job.generation);
                    q.busy = true;
                    break Work::Upload(job);
                }
                if let Some(cursor) = q.backfill.clone()
                    && q.jobs.len() + BACKFILL_PAGE <= side.settings.upload_queue
                {
                    break Work::Backfill(cursor);
                }
                let until = q
                    .jobs
                    .iter()
                    .map(|j| j.due)
                    .min()
                    .unwrap_or(now + Duration::from_secs(3600));
                let _ = side.wake.wait_until(&mut q, until);
            }
        };
        match work {
            Work::Upload(job) => {
                upload(&inner, side, job);
                side.queue.lock().busy = false;
            }
            Work::Backfill(cursor) => backfill(&inner, side, cursor),
        }
    }
}

/// One page of the start-up pass: queues the durable generations.
fn backfill(inner: &Arc<Inner>, side: &SharedSide, cursor: Option<String>) {
    let page = match inner.dir.list(cursor.as_deref(), BACKFILL_PAGE) {
        Ok(page) => page,
        Err(e) => {
            log::warn!("shared tier: listing generations to upload failed: {e}");
            side.queue.lock().backfill = None;
            return;
        }
    };
    side.queue.lock().backfill = page.next_after.map(Some);
    side.enqueue(
        page.generations
            .into_iter()
            .filter(|g| g.durable)
            .map(|g| Arc::from(g.manifest.generation())),
    );
}

/// Every object of every rank of a manifest with its page size.
fn pages_of(manifest: &Manifest) -> Result<Vec<(ObjectKey, u64)>> {
    super::open::all_rank_keys(manifest)
}

/// Uploads one generation (see the module docs); requeues it on failure.
fn upload(inner: &Arc<Inner>, side: &SharedSide, job: Job) {
    let manifest = match inner.dir.get(&job.generation) {
        Ok(Some(m)) => m,
        Ok(None) => {
            // Retired, replaced or evicted meanwhile: nothing to upload.
            side.counters.skipped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        Err(e) => return retry(side, job, &e),
    };
    let keys = match pages_of(&manifest) {
        Ok(keys) => keys,
        Err(e) => {
            log::warn!("shared tier: {} not uploaded: {e}", job.generation);
            side.counters.skipped.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    // Hold every page while the upload reads it.
    {
        let mut st = inner.lock();
        let local = st.listed.contains_key(&*job.generation)
            && keys.iter().all(|(k, _)| {
                st.objects
                    .get(k)
                    .is_some_and(|o| (o.l1 == L1::Ready && o.slot.is_some()) || o.l2 == L2::Durable)
            });
        if !local {
            side.counters.skipped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        for (key, _) in &keys {
            st.start_io(key);
        }
    }
    let result = side.tier.upload(&manifest, |key| read_page(inner, key));
    {
        let mut st = inner.lock();
        let namespace: Arc<str> = Arc::from(manifest.prefix().namespace());
        for (key, _) in &keys {
            if result.is_ok()
                && let Some(obj) = st.objects.get_mut(key)
            {
                obj.remote.get_or_insert_with(|| namespace.clone());
            }
            st.end_io(key);
        }
        for (key, _) in &keys {
            st.maybe_reclaim(key);
        }
        if result.is_ok() {
            st.set_tier(&job.generation, super::feed::Tier::Shared);
        }
    }
    match result {
        Ok(report) => log::debug!(
            "shared tier: {} uploaded ({} of {} pages sent, manifest {})",
            job.generation,
            report.pages_uploaded,
            report.pages,
            if report.manifest_written {
                "written"
            } else {
                "already there"
            }
        ),
        Err(Error::Closed(_)) => {}
        Err(e) => retry(side, job, &e),
    }
}

/// Requeues a failed upload after its backoff, or gives it up.
fn retry(side: &SharedSide, job: Job, error: &Error) {
    let attempt = job.attempt + 1;
    if attempt >= MAX_ATTEMPTS {
        side.counters.given_up.fetch_add(1, Ordering::Relaxed);
        log::warn!(
            "shared tier: upload of {} failed {attempt} times, given up until the next \
             start: {error}",
            job.generation
        );
        return;
    }
    let backoff = FIRST_BACKOFF
        .saturating_mul(1 << (attempt - 1).min(16))
        .min(MAX_BACKOFF);
    log::info!(
        "shared tier: upload of {} failed (attempt {attempt}), retried in {} s: {error}",
        job.generation,
        backoff.as_secs()
    );
    side.counters.retries.fetch_add(1, Ordering::Relaxed);
    let mut q = side.queue.lock();
    if q.stopped || q.names.contains(&job.generation) {
        return;
    }
    side.push(&mut q, job.generation, attempt, Instant::now() + backoff);
}

/// A held page's bytes for an upload: its L1 copy when resident, else its
/// L2 file (verified by the read).
fn read_page(inner: &Arc<Inner>, key: &ObjectKey) -> Result<Vec<u8>> {
    let (slot, page_bytes) = {
        let st = inner.lock();
        let obj = st
            .objects
            .get(key)
            .ok_or_else(|| Error::NotFound(format!("page {} is gone", key.hex())))?;
        let slot = match (obj.l1, obj.slot) {
            (L1::Ready, Some(slot)) => Some(slot.offset),
            _ => None,
        };
        (slot, obj.page_bytes)
    };
    let len = usize::try_from(page_bytes)
        .map_err(|_| Error::invalid("page too large for this platform"))?;
    match slot {
        // SAFETY: the object is Ready (immutable) and the upload's I/O hold
        // keeps its slot from being freed or reused until the upload ends.
        Some(offset) => unsafe { inner.pool.slice(offset, len) }.map(<[u8]>::to_vec),
        None => {
            let l2 = inner
                .l2
                .as_ref()
                .ok_or_else(|| Error::NotFound(format!("page {} has no copy", key.hex())))?;
            let mut buf = vec![0u8; len];
            l2.read(key, &mut buf)?;
            Ok(buf)
        }
    }
}

/// `find` with the shared tier: when it may hold a longer prefix than the
/// local hit, asks it (within the lookup timeout) and imports what it
/// finds. Any failure answers the local hit.
pub(super) fn find(
    inner: &Arc<Inner>,
    roots: &[Prefix],
    local: Option<Manifest>,
) -> Option<Manifest> {
    let Some(side) = &inner.shared else {
        return local;
    };
    let local_len = local.as_ref().map_or(0, |m| m.prefix().num_tokens());
    if !roots.iter().any(|r| r.num_tokens() > local_len) {
        return local;
    }
    let found = match side
        .tier
        .lookup_detailed(roots, local_len, side.settings.lookup_timeout)
    {
        Ok(result) => result.manifest,
        Err(e) => {
            log::debug!("shared tier lookup failed: {e}");
            None
        }
    };
    let Some(manifest) = found else {
        return local;
    };
    if side.failed_lately(manifest.generation()) {
        log::debug!(
            "shared tier: {} is not imported again (a page of it failed to fetch lately)",
            manifest.generation()
        );
        return local;
    }
    match import(inner, &manifest) {
        Ok(true) => Some(manifest),
        Ok(false) => local,
        Err(e) => {
            log::warn!(
                "shared tier: importing {} failed: {e}",
                manifest.generation()
            );
            local
        }
    }
}

/// Publishes a manifest found in the shared tier in the local directory
/// (not durable), its pages known from the shared tier. True when it is
/// listed here afterwards.
fn import(inner: &Arc<Inner>, manifest: &Manifest) -> Result<bool> {
    let generation = manifest.generation();
    let keys = pages_of(manifest)?;
    if inner.dir.get(generation)?.as_ref() == Some(manifest) {
        return Ok(inner.lock().listed.contains_key(generation));
    }
    if !inner.dir.begin(manifest)? {
        inner.lock().count(Counter::SharedImportsRefused, 1);
        return Ok(false);
    }
    let namespace: Arc<str> = Arc::from(manifest.prefix().namespace());
    {
        let mut st = inner.lock();
        for (key, bytes) in &keys {
            st.insert_remote(*key, *bytes, &namespace);
        }
    }
    let mut acked = Ok(Default::default());
    for rank in 0..manifest.world_size() {
        acked = inner.dir.acknowledge(generation, rank);
        if acked.is_err() {
            break;
        }
    }
    let mut st = inner.lock();
    let publication = match acked {
        Ok(p) if p.published => p,
        other => {
            for (key, _) in &keys {
                st.unpin(key);
            }
            for (key, _) in &keys {
                st.maybe_reclaim(key);
            }
            st.count(Counter::SharedImportsRefused, 1);
            drop(st);
            let _ = inner.dir.abort(generation);
            return other.map(|_| false);
        }
    };
    st.list_generation(
        generation,
        keys.iter().map(|(k, _)| *k).collect(),
        manifest.prefix().num_tokens(),
    );
    for (key, _) in &keys {
        st.unpin(key);
    }
    st.unlist_displaced(&publication);
    st.count(Counter::SharedImports, 1);
    log::info!(
        "shared tier: imported {generation} ({} tokens, {} pages)",
        manifest.prefix().num_tokens(),
        keys.len()
    );
    Ok(true)
}

/// Starts fetches on the fetch threads (never on this thread: it may be
/// inside the tier's runtime). A fetch that cannot be queued fails now.
pub(super) fn submit_fetches(inner: &Arc<Inner>, fetches: Vec<Fetch>) {
    for fetch in fetches {
        let weak = Arc::downgrade(inner);
        let job_fetch = fetch.clone();
        let job: Box<dyn FnOnce() + Send> = Box::new(move || {
            if let Some(inner) = weak.upgrade() {
                run_fetch(&inner, job_fetch);
            }
        });
        let refused = match inner.shared.as_ref().map(|s| s.fetch.lock()) {
            Some(pool) => match pool.as_ref() {
                Some(pool) => pool.try_submit(job).is_err(),
                None => true,
            },
            None => true,
        };
        if refused {
            finish_fetch(
                inner,
                &fetch,
                Err(Error::Unavailable(
                    "the shared tier's fetch queue is full or closed".into(),
                )),
            );
        }
    }
}

/// Fetches one page into its slot (on a fetch thread).
fn run_fetch(inner: &Arc<Inner>, fetch: Fetch) {
    let started = Instant::now();
    let result = match &inner.shared {
        Some(side) => side
            .tier
            .fetch_page_timed(&fetch.namespace, &fetch.key, fetch.len)
            .and_then(|(bytes, answered)| {
                let len = usize::try_from(fetch.len)
                    .map_err(|_| Error::invalid("page too large for this platform"))?;
                // SAFETY: the slot belongs to an object in state Loading; no
                // lease exposes it and nothing else writes it until this
                // fetch completes.
                let slot = unsafe { inner.pool.slice_mut(fetch.offset, len) }?;
                if bytes.len() != slot.len() {
                    return Err(Error::Corrupt(format!(
                        "shared page {} has {} bytes, its slot {}",
                        fetch.key.hex(),
                        bytes.len(),
                        slot.len()
                    )));
                }
                slot.copy_from_slice(&bytes);
                inner
                    .meters
                    .shared
                    .observe(answered, started.elapsed(), fetch.len);
                Ok(())
            }),
        None => Err(Error::Closed("the shared tier")),
    };
    finish_fetch(inner, &fetch, result);
}

/// Ends a fetch: the page is Ready for its waiting leases (and queued for
/// its L2 write), or the leases fail and the generations naming it retire.
fn finish_fetch(inner: &Arc<Inner>, fetch: &Fetch, result: Result<()>) {
    let key = fetch.key;
    let mut st = inner.lock();
    let waiters = st.end_load(&key);
    match result {
        Ok(()) => {
            super::tiers::hand_to_waiters(&mut st, &key, &waiters);
            if inner.l2.is_some() {
                st.l2_writes.push(key);
            }
            st.maybe_reclaim(&key);
        }
        Err(e) => {
            let closing = matches!(e, Error::Closed(_));
            if !closing {
                log::warn!("shared tier: fetching page {} failed: {e}", key.hex());
            }
            st.drop_l1(&key);
            for w in &waiters {
                if let Some(lease) = st.retrieve_leases.get_mut(w) {
                    lease.failed = Some(MissReason::SharedFetchError);
                }
            }
            if matches!(
                e,
                Error::NotFound(_) | Error::Corrupt(_) | Error::UnsupportedFormat(_)
            ) {
                // Proof: the shared copy is gone or bad.
                if let Some(obj) = st.objects.get_mut(&key) {
                    obj.remote = None;
                }
            }
            if !closing {
                st.count(Counter::SharedFetchErrors, 1);
                let gens = st
                    .objects
                    .get(&key)
                    .map(|o| o.gens.clone())
                    .unwrap_or_default();
                st.retire_generations_of(&key);
                if let Some(side) = &inner.shared {
                    side.note_failed(&gens);
                }
            }
            st.maybe_reclaim(&key);
        }
    }
}
