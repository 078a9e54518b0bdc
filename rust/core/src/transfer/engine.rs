//! The transfer engine: bounded admission, copy threads, lease protocol.
//!
//! See the [module documentation](super) for the job life cycle and the
//! failure classes.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::backend::{CopyBackend, CopyFailure, Registration};
use super::plan::{self, Direction};
use super::sidecar::{LeaseAnswer, LeaseApi, LeaseCall, ReplyHandle};
use crate::error::{Error, ErrorKind, Result};
use crate::json;
use crate::manifest::{CheckpointPayload, Manifest, PayloadSchema};
use crate::protocol::{Capabilities, Lease, LeaseStatus, MissReason};
use crate::store::shm::ShmPool;

/// Settings of a [`TransferEngine`].
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Copy threads (jobs copied at once), at least 1.
    pub workers: usize,
    /// Jobs admitted at once (queued + copying), at least `workers`.
    pub max_pending: usize,
    /// Bound of every lease RPC and of the busy/pending waits.
    pub rpc_timeout: Duration,
    /// The worker's address-free byte layout (a JSON object of the identity
    /// domain: no floats); when set, every job's payload must be a schema-2
    /// [`CheckpointPayload`] whose `worker_layout` equals it, or the job is
    /// refused before leasing.
    pub layout: Option<serde_json::Value>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            workers: 2,
            max_pending: 16,
            rpc_timeout: Duration::from_secs(30),
            layout: None,
        }
    }
}

impl EngineConfig {
    /// Checks the settings; returns the bound layout, converted once.
    fn check(&self) -> Result<Option<json::Value>> {
        if self.workers == 0 || self.workers > 64 {
            return Err(Error::invalid(format!(
                "workers must be in 1..=64, got {}",
                self.workers
            )));
        }
        if self.max_pending < self.workers {
            return Err(Error::invalid(format!(
                "max_pending ({}) must be at least workers ({})",
                self.max_pending, self.workers
            )));
        }
        if self.rpc_timeout.is_zero() || self.rpc_timeout > Duration::from_secs(86_400) {
            return Err(Error::invalid(
                "rpc_timeout must be positive and at most one day",
            ));
        }
        match &self.layout {
            None => Ok(None),
            Some(l @ serde_json::Value::Object(_)) => json::Value::from_serde(l)
                .map(Some)
                .map_err(|e| Error::invalid(format!("the worker layout: {e}"))),
            Some(_) => Err(Error::invalid(
                "the worker layout must be a JSON object (it is compared with manifests' \
                 worker_layout)",
            )),
        }
    }
}

/// One transfer: one rank's pages of one generation, one direction.
#[derive(Debug, Clone)]
pub struct Job {
    /// The generation.
    pub manifest: Manifest,
    /// This worker's rank.
    pub rank: u32,
    /// Store (pool → SHM) or retrieve (SHM → pool).
    pub direction: Direction,
    /// Blocks per manifest page group (auxiliary group last): rows of a 2-D
    /// page pool, block ids of a region layout.
    pub block_ids: Vec<Vec<u64>>,
    /// A backend event (CUDA: a `CUevent` handle) the copy must wait for.
    /// The caller guarantees it is a live event of the backend's context
    /// until the job ends (the driver cannot validate a raw handle).
    pub producer_event: Option<u64>,
}

/// How a job ended.
#[derive(Debug)]
pub enum Outcome {
    /// Every page was copied and the lease finished.
    Copied,
    /// Nothing was copied: a miss, busy past the bound, a timeout, closing.
    Miss(String),
    /// A recoverable failure: nothing in flight, the lease was finished as failed.
    Failed(Error),
    /// A copy may be in flight or a lease could not be reconciled: the engine
    /// turned unsafe and the lease was left unfinished.
    Unsafe(String),
}

impl Outcome {
    /// The boolean reported for the rank: true only for [`Outcome::Copied`].
    pub fn succeeded(&self) -> bool {
        matches!(self, Outcome::Copied)
    }
    /// `"copied"`, `"miss"`, `"failed"` or `"unsafe"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Outcome::Copied => "copied",
            Outcome::Miss(_) => "miss",
            Outcome::Failed(_) => "failed",
            Outcome::Unsafe(_) => "unsafe",
        }
    }
    /// Why the job did not copy (None for copied).
    pub fn reason(&self) -> Option<String> {
        match self {
            Outcome::Copied => None,
            Outcome::Miss(r) | Outcome::Unsafe(r) => Some(r.clone()),
            Outcome::Failed(e) => Some(e.to_string()),
        }
    }
}

/// Where one job's time went (`lmcache-rc bench --breakdown`, the
/// `transfer_breakdown` example): wall time per phase of the job's life,
/// zero for a phase it did not reach. Recorded with a clock read per phase
/// boundary; nothing else is done for it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobPhases {
    /// Submitted → taken by a lease thread (admission queue).
    pub queued: Duration,
    /// Step 1: payload parse and the block-id checks ([`plan::check_job`]).
    pub check: Duration,
    /// Step 2: the pool mapping (a pool-id comparison when already mapped).
    pub map: Duration,
    /// Step 3: the lease RPCs (prepare_store, or begin_retrieve and polls).
    pub lease: Duration,
    /// Step 4: the lease validated against the pool ([`plan::plan_copy`]).
    pub plan: Duration,
    /// Leased → taken by a copy thread (the copy threads were busy).
    pub handoff: Duration,
    /// Step 5: the copy itself.
    pub copy: Duration,
    /// Step 6: the finish RPC (store: completion and publication).
    pub finish: Duration,
    /// Submitted → ended.
    pub total: Duration,
}

struct HandleState {
    outcome: Mutex<Option<Outcome>>,
    done: Condvar,
    submitted: Instant,
    phases: Mutex<JobPhases>,
}

/// The future of a submitted job; cheap to clone.
#[derive(Clone)]
pub struct JobHandle(Arc<HandleState>);

impl JobHandle {
    /// Whether the job ended.
    pub fn is_done(&self) -> bool {
        self.0.outcome.lock().is_some()
    }

    /// Waits up to `timeout` (None = forever); false if it did not end in time.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut o = self.0.outcome.lock();
        while o.is_none() {
            match deadline {
                None => self.0.done.wait(&mut o),
                Some(d) => {
                    if self.0.done.wait_until(&mut o, d).timed_out() {
                        return o.is_some();
                    }
                }
            }
        }
        true
    }

    /// Calls `f` with the outcome if the job ended.
    pub fn with_outcome<R>(&self, f: impl FnOnce(&Outcome) -> R) -> Option<R> {
        self.0.outcome.lock().as_ref().map(f)
    }

    /// When the job was submitted (its phases run from here, in order).
    pub fn submitted(&self) -> Instant {
        self.0.submitted
    }

    /// Where the job's time went so far (complete once it ended).
    pub fn phases(&self) -> JobPhases {
        *self.0.phases.lock()
    }

    fn new() -> JobHandle {
        JobHandle(Arc::new(HandleState {
            outcome: Mutex::new(None),
            done: Condvar::new(),
            submitted: Instant::now(),
            phases: Mutex::new(JobPhases::default()),
        }))
    }

    /// Adds the time since `*since` to the phase `pick` selects and restarts
    /// the clock.
    fn lap(&self, since: &mut Instant, pick: fn(&mut JobPhases) -> &mut Duration) {
        let now = Instant::now();
        *pick(&mut self.0.phases.lock()) += now - *since;
        *since = now;
    }

    fn finish(&self, outcome: Outcome) {
        self.0.phases.lock().total = self.0.submitted.elapsed();
        *self.0.outcome.lock() = Some(outcome);
        self.0.done.notify_all();
    }
}

/// A mapped pool with what the sidecar said about it.
///
/// Field order is drop order: the registration (CUDA: page-locking) is
/// released while the pool is still mapped.
struct Mapped {
    _registration: Option<Registration>,
    pool: ShmPool,
    caps: Capabilities,
}

/// A job whose lease is granted and whose plan passed validation.
struct Leased {
    /// The lease to finish after the copy.
    lease_id: String,
    plan: plan::CopyPlan,
    mapped: Arc<Mapped>,
}

/// A job whose first lease call `submit` sent ([`Inner::start_early`]):
/// what its transfer thread continues with.
struct Started {
    schema: Arc<PayloadSchema>,
    groups: Vec<usize>,
    mapped: Arc<Mapped>,
    /// The reply to prepare_store / begin_retrieve.
    first: Box<dyn ReplyHandle>,
    /// When the call was about to go out (the job's phase clock: the
    /// sending, the thread's wake-up and the reply count as the lease).
    clock: Instant,
}

/// Jobs of at most this many pages may send their first lease call from
/// `submit` (which then checks them: about 0.4 µs per page the first time
/// a manifest is seen), so the transfer thread's wake-up overlaps the
/// round trip instead of preceding it.
const EARLY_MAX_PAGES: usize = 16;

/// The jobs and the two limits of the pipeline. Each job is carried out
/// by one transfer thread from its lease to its finish, so a job whose lease
/// is ready copies on the thread that leased it, with no hand-off to
/// another thread. At most `workers` jobs are being leased or wait leased
/// (so no more slots are held than the copies can use, and each copy's
/// successor is leased while it copies) and at most `workers` copy at once
/// (leased jobs take the copy slots in lease order); a job's finish RPC
/// runs after its copy slot is free, overlapping the next copy.
struct Queue {
    jobs: VecDeque<(Job, JobHandle)>,
    /// Jobs whose first lease call is out (counted in `leasing`).
    started: VecDeque<(Job, JobHandle, Started)>,
    /// `submit` calls sending a first lease call now (counted in `leasing`).
    starting: usize,
    /// Transfer threads waiting for a job.
    idle: usize,
    /// Leased jobs waiting for a copy slot, by ticket, oldest first.
    ready: VecDeque<u64>,
    next_ticket: u64,
    /// Jobs a transfer thread is leasing (steps 1-4).
    leasing: usize,
    /// Jobs copying (step 5).
    copying: usize,
    admitted: usize,
    closing: bool,
    /// Blocks admitted jobs write (retrieves) and read (stores), with the
    /// number of jobs doing so: see [`TransferEngine::submit`].
    writing: HashMap<u64, u32>,
    reading: HashMap<u64, u32>,
}

impl Queue {
    /// Whether an idle transfer thread may take the next job.
    fn can_lease(&self, workers: usize) -> bool {
        !self.jobs.is_empty() && self.leasing + self.ready.len() < workers
    }

    /// The blocks a job copies into or out of: a retrieve's [`plan::SKIP`]
    /// entries (pages already in place, never written) name no block.
    fn touched(job: &Job) -> impl Iterator<Item = u64> + '_ {
        let skips = job.direction == Direction::Retrieve;
        job.block_ids
            .iter()
            .flatten()
            .copied()
            .filter(move |&b| !(skips && b == plan::SKIP))
    }

    /// Refuses a job that would write a block another admitted job reads
    /// or writes, or read a block another one writes; else records its
    /// blocks until it ends. Skipped pages claim nothing: concurrent
    /// restores over one shared local prefix all name block 0 there.
    fn claim_blocks(&mut self, job: &Job) -> Result<()> {
        let blocks: Vec<u64> = Self::touched(job).collect();
        let writes = job.direction == Direction::Retrieve;
        let clash = blocks
            .iter()
            .find(|b| self.writing.contains_key(b) || (writes && self.reading.contains_key(b)));
        if let Some(block) = clash {
            return Err(Error::invalid(format!(
                "block {block} is already {} by an unfinished transfer of this engine; a {} \
                 may not {} it until that transfer ends (two copies would race on the same \
                 page-pool memory)",
                if self.writing.contains_key(block) {
                    "being written"
                } else {
                    "being read"
                },
                job.direction.as_str(),
                if writes { "write" } else { "read" },
            )));
        }
        let map = if writes {
            &mut self.writing
        } else {
            &mut self.reading
        };
        for b in blocks {
            *map.entry(b).or_insert(0) += 1;
        }
        Ok(())
    }

    /// Forgets the blocks of a job that ended.
    fn release_blocks(&mut self, job: &Job) {
        let map = if job.direction == Direction::Retrieve {
            &mut self.writing
        } else {
            &mut self.reading
        };
        for b in Self::touched(job) {
            if let Some(n) = map.get_mut(&b) {
                *n -= 1;
                if *n == 0 {
                    map.remove(&b);
                }
            }
        }
    }
}

/// Field order is drop order: the mapping (and its registration) goes
/// before the backend whose context the registration belongs to.
struct Inner {
    mapping: Mutex<Option<Arc<Mapped>>>,
    /// Serialises (re)mapping, so `mapping` is only held to read or swap.
    remapping: Mutex<()>,
    api: Box<dyn LeaseApi>,
    backend: Arc<dyn CopyBackend>,
    config: EngineConfig,
    /// `config.layout`, converted once (compared with parsed payloads).
    bound_layout: Option<json::Value>,
    queue: Mutex<Queue>,
    /// Signals idle transfer threads: a job can be taken, or closing.
    work: Condvar,
    /// Signals leased jobs waiting for a copy slot.
    copy_slot: Condvar,
    /// Signals a job's end (close / wait_idle).
    changed: Condvar,
    unsafe_reason: Mutex<Option<String>>,
    is_unsafe: AtomicBool,
    remaps: Mutex<u64>,
    /// Payloads checked recently ([`Inner::payload_schema`]).
    checked: Mutex<VecDeque<(Manifest, Arc<PayloadSchema>)>>,
}

/// Manifests whose checked payload an engine keeps (oldest dropped first).
const CHECKED_PAYLOADS: usize = 8;
/// Largest payload kept (the entry holds a copy of the manifest).
const CHECKED_MAX_PAYLOAD: usize = 1 << 20;

/// Counters of an engine (for status and tests).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Jobs queued or copying.
    pub in_flight: usize,
    /// Times the shared-memory pool was (re)mapped.
    pub mappings: u64,
    /// Whether the engine is unsafe.
    pub is_unsafe: bool,
    /// Which pages back the mapped shared-memory pool
    /// ([`ShmPool::page_size_status`]); None before the first mapping.
    pub shm_pages: Option<String>,
    /// How the backend moves bytes ([`CopyBackend::copy_kernel`]).
    pub copy_kernel: &'static str,
}

/// Background copies between a worker's page pool and the sidecar's shared
/// memory; one engine per worker rank.
pub struct TransferEngine {
    inner: Arc<Inner>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl TransferEngine {
    /// Starts an engine: maps the sidecar's pool now (so a wrong socket, pool
    /// or size fails here with a clear error) and starts the copy threads.
    pub fn start(
        api: Box<dyn LeaseApi>,
        backend: Arc<dyn CopyBackend>,
        config: EngineConfig,
    ) -> Result<TransferEngine> {
        let bound_layout = config.check()?;
        let inner = Arc::new(Inner {
            api,
            backend,
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                started: VecDeque::new(),
                starting: 0,
                idle: 0,
                ready: VecDeque::new(),
                next_ticket: 0,
                leasing: 0,
                copying: 0,
                admitted: 0,
                closing: false,
                writing: HashMap::new(),
                reading: HashMap::new(),
            }),
            work: Condvar::new(),
            copy_slot: Condvar::new(),
            changed: Condvar::new(),
            unsafe_reason: Mutex::new(None),
            is_unsafe: AtomicBool::new(false),
            mapping: Mutex::new(None),
            remapping: Mutex::new(()),
            remaps: Mutex::new(0),
            checked: Mutex::new(VecDeque::new()),
            config,
            bound_layout,
        });
        inner.mapped()?;
        let mut threads = Vec::new();
        // Two per copy slot: while one copies, the other leases the next job
        // or finishes the previous one.
        for i in 0..2 * inner.config.workers {
            let thread_inner = inner.clone();
            let started = std::thread::Builder::new()
                .name(format!("lmcache_rc_xfer{i}"))
                .spawn(move || thread_inner.job_loop());
            match started {
                Ok(t) => threads.push(t),
                Err(e) => {
                    let engine = TransferEngine {
                        inner,
                        threads: Mutex::new(threads),
                    };
                    drop(engine);
                    return Err(Error::io("start a transfer thread", e));
                }
            }
        }
        Ok(TransferEngine {
            inner,
            threads: Mutex::new(threads),
        })
    }

    /// Admits a job. `Ok(None)` = refused, nothing started (closing, unsafe or
    /// `max_pending` jobs in flight); an invalid rank or direction/event
    /// combination is an error, and so is a job whose blocks clash with an
    /// unfinished job of this engine: a retrieve may not write a block
    /// another job reads or writes, a store may not read a block a retrieve
    /// writes (blocks are compared by id across page groups).
    pub fn submit(&self, job: Job) -> Result<Option<JobHandle>> {
        if job.rank >= job.manifest.world_size() {
            return Err(Error::invalid(format!(
                "rank {} is outside 0..{} (the manifest's world size)",
                job.rank,
                job.manifest.world_size()
            )));
        }
        if job.producer_event.is_some() && !self.inner.backend.accepts_events() {
            return Err(Error::invalid(format!(
                "the {} backend takes no producer event",
                self.inner.backend.name()
            )));
        }
        if self.inner.is_unsafe.load(Ordering::SeqCst) {
            return Ok(None);
        }
        let mut q = self.inner.queue.lock();
        if q.closing || q.admitted >= self.inner.config.max_pending {
            return Ok(None);
        }
        q.claim_blocks(&job)?;
        let handle = JobHandle::new();
        q.admitted += 1;
        let workers = self.inner.config.workers;
        // A small job that a waiting thread would lease at once sends its
        // first lease call from here.
        let early = q.jobs.is_empty()
            && q.leasing + q.ready.len() < workers
            && q.idle > q.started.len() + q.starting
            && job.block_ids.iter().map(Vec::len).sum::<usize>() <= EARLY_MAX_PAGES;
        if early {
            q.leasing += 1;
            q.starting += 1;
            drop(q);
            let started = self.inner.start_early(&job, &handle);
            q = self.inner.queue.lock();
            q.starting -= 1;
            match started {
                Some(started) => q.started.push_back((job, handle.clone(), started)),
                None => {
                    q.leasing -= 1;
                    q.jobs.push_back((job, handle.clone()));
                }
            }
        } else {
            q.jobs.push_back((job, handle.clone()));
        }
        let wake = !q.started.is_empty() || q.can_lease(workers) || q.closing;
        drop(q);
        if wake {
            self.inner.work.notify_one();
        }
        Ok(Some(handle))
    }

    /// Jobs admitted and not yet ended.
    pub fn in_flight(&self) -> usize {
        self.inner.queue.lock().admitted
    }

    /// Whether a copy may be in flight (admission stopped for good).
    pub fn is_unsafe(&self) -> bool {
        self.inner.is_unsafe.load(Ordering::SeqCst)
    }

    /// Why the engine turned unsafe.
    pub fn unsafe_reason(&self) -> Option<String> {
        self.inner.unsafe_reason.lock().clone()
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &'static str {
        self.inner.backend.name()
    }

    /// How the backend moves bytes ([`CopyBackend::copy_kernel`]).
    pub fn copy_kernel(&self) -> &'static str {
        self.inner.backend.copy_kernel()
    }

    /// Counters.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            in_flight: self.in_flight(),
            mappings: *self.inner.remaps.lock(),
            is_unsafe: self.is_unsafe(),
            // Read outside the lock (it parses /proc/self/smaps).
            shm_pages: self
                .inner
                .mapping
                .lock()
                .clone()
                .map(|m| m.pool.page_size_status()),
            copy_kernel: self.copy_kernel(),
        }
    }

    /// The capabilities of the currently mapped pool.
    pub fn capabilities(&self) -> Option<Capabilities> {
        self.inner.mapping.lock().as_ref().map(|m| m.caps.clone())
    }

    /// Waits until no job is in flight (None = forever); false on timeout.
    pub fn wait_idle(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut q = self.inner.queue.lock();
        while q.admitted > 0 {
            match deadline {
                None => self.inner.changed.wait(&mut q),
                Some(d) => {
                    if self.inner.changed.wait_until(&mut q, d).timed_out() {
                        return q.admitted == 0;
                    }
                }
            }
        }
        true
    }

    /// Stops admission and waits for every admitted job (queued copies are
    /// not cancelled). Raises [`Error::UnsafeCopy`] when the engine is unsafe
    /// or the copies did not drain within `timeout`: then the page pool and the
    /// mapping must stay alive until the process ends.
    pub fn close(&self, timeout: Option<Duration>) -> Result<()> {
        {
            let mut q = self.inner.queue.lock();
            q.closing = true;
        }
        self.inner.work.notify_all();
        self.inner.changed.notify_all();
        if !self.wait_idle(timeout) {
            return Err(Error::UnsafeCopy(format!(
                "{} transfer(s) did not drain within {:.1} s; the worker must exit before its \
                 memory is released",
                self.in_flight(),
                timeout.unwrap_or_default().as_secs_f64()
            )));
        }
        {
            // Every thread may end now (no job is admitted, none can be). One
            // that went to sleep after the wake-up above, while jobs were still
            // queued, was woken only if it was the one to take the next job:
            // wake them all again, under the lock, so none sleeps through it.
            let _q = self.inner.queue.lock();
            self.inner.work.notify_all();
        }
        let threads = std::mem::take(&mut *self.threads.lock());
        for t in threads {
            if t.join().is_err() {
                log::error!("a copy thread panicked");
            }
        }
        if let Some(reason) = self.unsafe_reason() {
            return Err(Error::UnsafeCopy(format!(
                "the transfer engine is unsafe: {reason}; the worker process must exit before \
                 its page pool and shared memory are released"
            )));
        }
        Ok(())
    }

    /// Test hook: forget the current mapping so the next job maps again.
    pub fn drop_mapping(&self) {
        *self.inner.mapping.lock() = None;
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        if let Err(e) = self.close(None) {
            log::error!("closing the transfer engine: {e}");
        }
        if self.is_unsafe() {
            // A copy may still touch the mapping: keep it alive for good.
            if let Some(m) = self.inner.mapping.lock().take() {
                std::mem::forget(m);
            }
        }
    }
}

/// A job's copy slot ([`Inner::copy_slot`]); freed when dropped (after the
/// copy, or when a copy panics).
struct CopySlot<'a>(&'a Inner);

impl Drop for CopySlot<'_> {
    fn drop(&mut self) {
        let mut q = self.0.queue.lock();
        q.copying -= 1;
        let waiting = !q.ready.is_empty();
        drop(q);
        if waiting {
            self.0.copy_slot.notify_all();
        }
    }
}

/// Sleep between busy retries / polls: doubling, capped, never past the deadline.
fn backoff_sleep(step: &mut Duration, cap: Duration, deadline: Instant) {
    let left = deadline.saturating_duration_since(Instant::now());
    std::thread::sleep((*step).min(left));
    *step = (*step * 2).min(cap);
}

/// Whether a call ends a lease (its outcome decides whether slots are free).
fn is_finish(call: &LeaseCall) -> bool {
    matches!(
        call,
        LeaseCall::FinishStore { .. } | LeaseCall::FinishRetrieve { .. }
    )
}

/// What a lease RPC produced.
enum Rpc<T> {
    Ok(T),
    /// The server refused or the connection failed: nothing to reconcile.
    Err(Error),
    /// No reply even after waiting twice: ownership unknown.
    Unresolved(String),
    /// The reply came late and was discarded (lease released): a drained timeout.
    Drained(String),
}

impl Inner {
    /// A transfer thread: takes a job, leases it (steps 1-4), copies it
    /// once a copy slot is free (step 5) and finishes it (step 6).
    fn job_loop(self: Arc<Self>) {
        let workers = self.config.workers;
        loop {
            let next = {
                let mut q = self.queue.lock();
                loop {
                    if let Some((job, handle, started)) = q.started.pop_front() {
                        break Some((job, handle, Some(started)));
                    }
                    if q.can_lease(workers)
                        && let Some((job, handle)) = q.jobs.pop_front()
                    {
                        q.leasing += 1;
                        break Some((job, handle, None));
                    }
                    if q.closing && q.jobs.is_empty() && q.starting == 0 {
                        break None;
                    }
                    q.idle += 1;
                    self.work.wait(&mut q);
                    q.idle -= 1;
                }
            };
            let Some((job, handle, started)) = next else {
                return;
            };
            let mut clock = match &started {
                Some(s) => s.clock,
                None => {
                    let mut clock = handle.0.submitted;
                    handle.lap(&mut clock, |p| &mut p.queued);
                    clock
                }
            };
            let staged = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.acquire(&job, &handle, &mut clock, started)
            }))
            .unwrap_or_else(|_| Err(self.turn_unsafe("a transfer thread panicked".into())));
            let leased = match staged {
                Ok(leased) => leased,
                Err(outcome) => {
                    let mut q = self.queue.lock();
                    q.leasing -= 1;
                    let wake = q.can_lease(workers);
                    drop(q);
                    if wake {
                        self.work.notify_one();
                    }
                    self.complete(&job, &handle, outcome);
                    continue;
                }
            };
            let slot = self.copy_slot();
            handle.lap(&mut clock, |p| &mut p.handoff);
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.transfer(&job, &handle, leased, &mut clock, slot)
            }))
            .unwrap_or_else(|_| {
                self.turn_unsafe("a transfer thread panicked during a copy".into())
            });
            self.complete(&job, &handle, outcome);
        }
    }

    /// Moves the calling thread's job from leasing to copying: at once when
    /// a copy slot is free and no leased job waits, else after the leased
    /// jobs before it.
    fn copy_slot(&self) -> CopySlot<'_> {
        let workers = self.config.workers;
        let mut q = self.queue.lock();
        q.leasing -= 1;
        if q.copying >= workers || !q.ready.is_empty() {
            let ticket = q.next_ticket;
            q.next_ticket += 1;
            q.ready.push_back(ticket);
            while q.ready.front() != Some(&ticket) || q.copying >= workers {
                self.copy_slot.wait(&mut q);
            }
            q.ready.pop_front();
            if !q.ready.is_empty() && q.copying + 1 < workers {
                // The next leased job may take another free slot.
                self.copy_slot.notify_all();
            }
        }
        q.copying += 1;
        let wake = q.can_lease(workers);
        drop(q);
        if wake {
            self.work.notify_one();
        }
        CopySlot(self)
    }

    /// Logs an outcome, resolves the job's future and releases its admission.
    fn complete(&self, job: &Job, handle: &JobHandle, outcome: Outcome) {
        match &outcome {
            Outcome::Copied => {}
            Outcome::Miss(r) => {
                log::debug!("{} rank {}: miss ({r})", job.direction.as_str(), job.rank)
            }
            Outcome::Failed(e) => log::warn!(
                "{} of generation {} rank {} failed: {e}",
                job.direction.as_str(),
                job.manifest.generation(),
                job.rank
            ),
            Outcome::Unsafe(r) => log::error!(
                "{} of generation {} rank {}: {r}",
                job.direction.as_str(),
                job.manifest.generation(),
                job.rank
            ),
        }
        // Free the admission slot before anyone can see the result, so a
        // caller that submits as soon as a job ends is never refused for it.
        let mut q = self.queue.lock();
        q.admitted -= 1;
        // A copy that may still run keeps its blocks claimed for good.
        if !matches!(outcome, Outcome::Unsafe(_)) {
            q.release_blocks(job);
        }
        handle.finish(outcome);
        drop(q);
        self.changed.notify_all();
    }

    fn turn_unsafe(&self, reason: String) -> Outcome {
        self.is_unsafe.store(true, Ordering::SeqCst);
        let mut r = self.unsafe_reason.lock();
        if r.is_none() {
            *r = Some(reason.clone());
        }
        Outcome::Unsafe(reason)
    }

    fn closing(&self) -> bool {
        self.queue.lock().closing
    }

    /// The current mapping; maps (again) when there is none or the sidecar
    /// now serves another pool (it restarted).
    fn mapped(&self) -> Result<Arc<Mapped>> {
        let current = self.api.pool_id()?;
        if let Some(m) = self.current_mapping(&current) {
            return Ok(m);
        }
        let _remapping = self.remapping.lock();
        if let Some(m) = self.current_mapping(&current) {
            return Ok(m); // another thread mapped it meanwhile
        }
        if let Some(stale) = self.mapping.lock().take() {
            log::info!(
                "the sidecar's shared-memory pool {} was replaced by {current} (sidecar \
                 restarted): mapping the new one",
                stale.pool.id()
            );
        }
        // The RPC, the populated mapping and the registration run without
        // the `mapping` lock, so `capabilities()` never waits for them.
        let (caps, fd) = self.api.share_pool()?;
        let pool = ShmPool::from_fd_populated(fd, &caps.pool_id, caps.pool_size)?;
        plan::check_pool(&caps, &pool)?;
        let registration = self.backend.register(&pool)?;
        let m = Arc::new(Mapped {
            _registration: registration,
            pool,
            caps,
        });
        *self.mapping.lock() = Some(m.clone());
        *self.remaps.lock() += 1;
        Ok(m)
    }

    /// The mapping if it is of the pool `current`.
    fn current_mapping(&self, current: &str) -> Option<Arc<Mapped>> {
        let m = self.mapping.lock().clone()?;
        (m.pool.id() == current).then_some(m)
    }

    fn forget_mapping(&self, stale: &Arc<Mapped>) {
        let mut slot = self.mapping.lock();
        if slot.as_ref().is_some_and(|m| Arc::ptr_eq(m, stale)) {
            *slot = None;
        }
    }

    /// Sends `call` and waits for its reply, twice at most
    /// (`docs/design/transfers.md#rpc-timeout-reconciliation`).
    fn rpc(&self, call: LeaseCall) -> Rpc<LeaseAnswer> {
        let handle = self.api.call(call.clone());
        self.rpc_reply(call, handle)
    }

    /// Waits for the reply of `call` sent earlier, as [`Inner::rpc`] does.
    fn rpc_reply(&self, call: LeaseCall, handle: Box<dyn ReplyHandle>) -> Rpc<LeaseAnswer> {
        let name = call.name();
        let timeout = self.config.rpc_timeout;
        let first = handle.wait(timeout);
        let answer = match first {
            Err(e) if e.kind() == ErrorKind::Timeout => match handle.wait(timeout) {
                Err(e) if e.kind() == ErrorKind::Timeout => {
                    return Rpc::Unresolved(format!(
                        "{name} got no reply within 2 x {:.1} s",
                        timeout.as_secs_f64()
                    ));
                }
                // A finish that timed out and then failed: whether the lease
                // ended is unknown (docs/design/transfers.md#rpc-timeout-reconciliation:
                // "still nothing (or an error after a timeout)").
                Err(e) if is_finish(&call) => {
                    return Rpc::Unresolved(format!("{name} timed out, then failed: {e}"));
                }
                Err(e) => return Rpc::Err(e),
                Ok(late) => return self.discard_late(&call, late),
            },
            Err(e) => return Rpc::Err(e),
            Ok(a) => a,
        };
        Rpc::Ok(answer)
    }

    /// A lease reply that arrived after the first deadline: release whatever
    /// it granted without copying.
    fn discard_late(&self, call: &LeaseCall, late: LeaseAnswer) -> Rpc<LeaseAnswer> {
        let name = call.name();
        let LeaseAnswer::Lease(lease) = &late else {
            // A late finish/cancel reply: the operation completed.
            return Rpc::Ok(late);
        };
        let rank = call.rank();
        if let (LeaseStatus::Pending, Some(id)) = (lease.status, &lease.lease_id) {
            // A pending lookup exposed no bytes: cancelling it is never fatal.
            self.cancel(rank, id);
            return Rpc::Drained(format!(
                "{name} answered only after {:.1} s; its pending lookup was cancelled",
                self.config.rpc_timeout.as_secs_f64()
            ));
        }
        let discard = match (call, lease.status, &lease.lease_id) {
            (LeaseCall::PrepareStore { .. }, LeaseStatus::Ready, Some(id)) => {
                Some(LeaseCall::FinishStore {
                    lease_id: id.clone(),
                    success: false,
                    rank,
                })
            }
            (_, LeaseStatus::Ready, Some(id)) => Some(LeaseCall::FinishRetrieve {
                lease_id: id.clone(),
                rank,
            }),
            _ => None,
        };
        if let Some(d) = discard {
            match self.api.call(d).wait(self.config.rpc_timeout) {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => {
                    return Rpc::Unresolved(format!(
                        "{name} answered late and its lease could not be released: {e}"
                    ));
                }
            }
        }
        Rpc::Drained(format!(
            "{name} answered only after {:.1} s; its lease was released unused",
            self.config.rpc_timeout.as_secs_f64()
        ))
    }

    /// A lease call whose unresolved reply makes the engine unsafe; `sent`
    /// is its reply when the call already went out.
    fn lease_rpc(
        &self,
        call: LeaseCall,
        exposes: bool,
        sent: Option<Box<dyn ReplyHandle>>,
    ) -> std::result::Result<Lease, Outcome> {
        let reply = match sent {
            Some(handle) => self.rpc_reply(call, handle),
            None => self.rpc(call),
        };
        match reply {
            Rpc::Ok(LeaseAnswer::Lease(l)) => Ok(l),
            Rpc::Ok(other) => Err(Outcome::Failed(Error::Protocol(format!(
                "expected a lease, the sidecar answered {other:?}"
            )))),
            Rpc::Err(e) => Err(Outcome::Failed(e)),
            Rpc::Drained(r) => Err(Outcome::Failed(Error::Timeout(r))),
            Rpc::Unresolved(r) if exposes => {
                Err(self.turn_unsafe(format!("lease ownership could not drain: {r}")))
            }
            Rpc::Unresolved(r) => Err(Outcome::Miss(r)),
        }
    }

    /// Ends a lease; an unresolvable finish makes the engine unsafe.
    fn finish(&self, call: LeaseCall) -> std::result::Result<(), Outcome> {
        match self.rpc(call) {
            Rpc::Ok(_) | Rpc::Drained(_) => Ok(()),
            // The copy has drained, so nothing is in flight; a finish that
            // failed (e.g. the connection was lost) is never sent twice
            // (docs/design/transfers.md#rpc-timeout-reconciliation). If the
            // sidecar lives on, the lease stays with it until it restarts.
            Rpc::Err(e) => Err(Outcome::Failed(e)),
            Rpc::Unresolved(r) => {
                Err(self.turn_unsafe(format!("completion ownership could not drain: {r}")))
            }
        }
    }

    /// Checks, maps, leases and validates: a lease ready to copy, or how the
    /// job ended without copying. A job `submit` started was checked and
    /// mapped there; its first lease reply is waited for here.
    fn acquire(
        &self,
        job: &Job,
        handle: &JobHandle,
        clock: &mut Instant,
        started: Option<Started>,
    ) -> std::result::Result<Leased, Outcome> {
        let (schema, groups, mapped, first) = match started {
            Some(s) => (s.schema, s.groups, s.mapped, Some(s.first)),
            None => {
                if let Some(reason) = self.unsafe_reason.lock().clone() {
                    // Admitted before the engine turned unsafe: start nothing new.
                    return Err(Outcome::Failed(Error::UnsafeCopy(format!(
                        "not started: the transfer engine is unsafe ({reason})"
                    ))));
                }
                let (schema, groups) = self.check(job).map_err(Outcome::Failed)?;
                handle.lap(clock, |p| &mut p.check);
                let mapped = self.mapped().map_err(Outcome::Failed)?;
                handle.lap(clock, |p| &mut p.map);
                (schema, groups, mapped, None)
            }
        };
        let (lease, lease_id) = match job.direction {
            Direction::Store => self.lease_store(job, first)?,
            Direction::Retrieve => self.lease_retrieve(job, first)?,
        };
        handle.lap(clock, |p| &mut p.lease);
        if let Some(reason) = self.unsafe_reason.lock().clone() {
            // Turned unsafe while this job's first call was out: give the
            // lease back unused.
            let cause = Error::UnsafeCopy(format!(
                "not started: the transfer engine is unsafe ({reason})"
            ));
            return Err(self.release(job, &lease_id, cause));
        }
        let planned = self.checked_plan(job, &schema, &groups, &lease, &mapped);
        handle.lap(clock, |p| &mut p.plan);
        match planned {
            Ok(plan) => Ok(Leased {
                lease_id,
                plan,
                mapped,
            }),
            Err(e) => Err(self.release(job, &lease_id, e)),
        }
    }

    /// Checks a job and sends its first lease call (prepare_store or
    /// begin_retrieve) from `submit`, when the lease API only sends and the
    /// pool it names is the one mapped; None (nothing sent) otherwise, or
    /// when the check fails (the transfer thread then checks it again and
    /// fails the job as usual).
    fn start_early(&self, job: &Job, handle: &JobHandle) -> Option<Started> {
        let mut clock = handle.0.submitted;
        let pool_id = self.api.early_pool_id()?;
        let mapped = self.current_mapping(&pool_id)?;
        let (schema, groups) = self.check(job).ok()?;
        handle.lap(&mut clock, |p| &mut p.check);
        let (manifest, rank) = (job.manifest.clone(), job.rank);
        let call = match job.direction {
            Direction::Store => LeaseCall::PrepareStore { manifest, rank },
            Direction::Retrieve => LeaseCall::BeginRetrieve { manifest, rank },
        };
        // Sending and the transfer thread's wake-up count as the lease.
        let first = self.api.call(call);
        Some(Started {
            schema,
            groups,
            mapped,
            first,
            clock,
        })
    }

    /// Finishes a lease as failed (nothing was copied into it or out of it).
    fn release(&self, job: &Job, lease_id: &str, cause: Error) -> Outcome {
        let lease_id = lease_id.to_string();
        let rank = job.rank;
        let call = match job.direction {
            Direction::Store => LeaseCall::FinishStore {
                lease_id,
                success: false,
                rank,
            },
            Direction::Retrieve => LeaseCall::FinishRetrieve { lease_id, rank },
        };
        match self.finish(call) {
            Ok(()) => Outcome::Failed(cause),
            Err(o) => o,
        }
    }

    /// Copies a leased job in its copy slot, frees the slot and finishes
    /// the lease.
    fn transfer(
        &self,
        job: &Job,
        handle: &JobHandle,
        leased: Leased,
        clock: &mut Instant,
        slot: CopySlot<'_>,
    ) -> Outcome {
        let Leased {
            lease_id,
            plan,
            mapped,
        } = leased;
        let copied = self.backend.copy(&plan, &mapped.pool, job.producer_event);
        drop(slot);
        handle.lap(clock, |p| &mut p.copy);
        match copied {
            Ok(()) => {}
            Err(CopyFailure::Recoverable(e)) => return self.release(job, &lease_id, e),
            Err(CopyFailure::InFlight(r)) => {
                // A DMA may still touch the mapping: it must never be unmapped.
                std::mem::forget(mapped);
                return self.turn_unsafe(format!("DMA could not drain: {r}"));
            }
        }
        let rank = job.rank;
        let call = match job.direction {
            Direction::Store => LeaseCall::FinishStore {
                lease_id,
                success: true,
                rank,
            },
            Direction::Retrieve => LeaseCall::FinishRetrieve { lease_id, rank },
        };
        let finished = self.finish(call);
        handle.lap(clock, |p| &mut p.finish);
        match finished {
            Ok(()) => Outcome::Copied,
            Err(o) => o,
        }
    }

    /// prepare_store, retrying *busy* with capped backoff until `rpc_timeout`.
    /// `first`: the reply of a prepare_store already sent.
    fn lease_store(
        &self,
        job: &Job,
        mut first: Option<Box<dyn ReplyHandle>>,
    ) -> std::result::Result<(Lease, String), Outcome> {
        let deadline = Instant::now() + self.config.rpc_timeout;
        let mut step = Duration::from_millis(1);
        loop {
            let lease = self.lease_rpc(
                LeaseCall::PrepareStore {
                    manifest: job.manifest.clone(),
                    rank: job.rank,
                },
                true,
                first.take(),
            )?;
            match lease.status {
                LeaseStatus::Ready => {
                    let Some(id) = lease.lease_id.clone() else {
                        return Err(Outcome::Failed(Error::Protocol(
                            "a ready store lease has no id".into(),
                        )));
                    };
                    return Ok((lease, id));
                }
                LeaseStatus::Busy => {
                    if self.closing() || Instant::now() >= deadline {
                        return Err(Outcome::Miss(format!(
                            "store stayed busy for {:.1} s (another lease writes its pages)",
                            self.config.rpc_timeout.as_secs_f64()
                        )));
                    }
                    backoff_sleep(&mut step, Duration::from_millis(10), deadline);
                }
                LeaseStatus::Miss => {
                    return Err(Outcome::Miss(
                        lease.reason.map_or("miss", MissReason::as_str).to_string(),
                    ));
                }
                LeaseStatus::Pending => {
                    return Err(Outcome::Failed(Error::Protocol(
                        "prepare_store answered \"pending\"".into(),
                    )));
                }
            }
        }
    }

    /// begin_retrieve (ready at once when every page is in L1), else poll
    /// until ready; cancels at `rpc_timeout`.
    /// `first`: the reply of a begin_retrieve already sent.
    fn lease_retrieve(
        &self,
        job: &Job,
        first: Option<Box<dyn ReplyHandle>>,
    ) -> std::result::Result<(Lease, String), Outcome> {
        let mut lease = self.lease_rpc(
            LeaseCall::BeginRetrieve {
                manifest: job.manifest.clone(),
                rank: job.rank,
            },
            false,
            first,
        )?;
        let deadline = Instant::now() + self.config.rpc_timeout;
        // An L1-resident restore was ready at begin_retrieve; a pending one
        // waits for an L2 read (milliseconds): poll after 50 µs, doubling up
        // to 5 ms.
        let mut step = Duration::from_micros(50);
        while lease.status == LeaseStatus::Pending {
            let Some(id) = lease.lease_id.clone() else {
                return Err(Outcome::Failed(Error::Protocol(
                    "a pending retrieve has no lease id".into(),
                )));
            };
            if self.closing() || Instant::now() >= deadline {
                self.cancel(job.rank, &id);
                return Err(Outcome::Miss(format!(
                    "the restore was not ready within {:.1} s; the request recomputes",
                    self.config.rpc_timeout.as_secs_f64()
                )));
            }
            backoff_sleep(&mut step, Duration::from_millis(5), deadline);
            lease = match self.lease_rpc(
                LeaseCall::PollRetrieve {
                    lease_id: id.clone(),
                    rank: job.rank,
                },
                true,
                None,
            ) {
                Ok(l) => l,
                Err(o @ Outcome::Unsafe(_)) => return Err(o),
                // A drained timeout: the late reply's lease was already released.
                Err(o @ Outcome::Failed(Error::Timeout(_))) => return Err(o),
                Err(o) => {
                    self.cancel(job.rank, &id);
                    return Err(o);
                }
            };
        }
        match (lease.status, lease.lease_id.clone()) {
            (LeaseStatus::Ready, Some(id)) => Ok((lease, id)),
            (LeaseStatus::Ready, None) => Err(Outcome::Failed(Error::Protocol(
                "a ready retrieve lease has no id".into(),
            ))),
            (LeaseStatus::Miss, _) => Err(Outcome::Miss(
                lease.reason.map_or("miss", MissReason::as_str).to_string(),
            )),
            (other, _) => Err(Outcome::Failed(Error::Protocol(format!(
                "begin_retrieve answered {:?}",
                other.as_str()
            )))),
        }
    }

    /// Everything that can be checked before a lease exists: the payload
    /// (parsed once per manifest, see [`Inner::payload_schema`]), its worker
    /// layout against the bound one, and the block ids against the bound
    /// page layout. Returns the page groups and each one's layout group.
    fn check(&self, job: &Job) -> Result<(Arc<PayloadSchema>, Vec<usize>)> {
        let schema = self.payload_schema(&job.manifest)?;
        let groups = plan::check_job(
            job.direction,
            &schema,
            &job.block_ids,
            self.backend.layout(),
        )?;
        Ok((schema, groups))
    }

    /// The manifest's payload, parsed and checked against the bound worker
    /// layout. The result depends on the manifest alone, so a manifest
    /// equal in full to one checked recently (a restore after its store, a
    /// hot prefix restored again) reuses it instead of parsing its payload
    /// again (about 0.4 µs per page).
    fn payload_schema(&self, manifest: &Manifest) -> Result<Arc<PayloadSchema>> {
        if let Some((_, schema)) = self.checked.lock().iter().find(|(m, _)| m == manifest) {
            return Ok(schema.clone());
        }
        let schema = Arc::new(self.parse_payload(manifest)?);
        if manifest.payload().len() <= CHECKED_MAX_PAYLOAD {
            let mut checked = self.checked.lock();
            if checked.len() >= CHECKED_PAYLOADS {
                checked.pop_front();
            }
            checked.push_back((manifest.clone(), schema.clone()));
        }
        Ok(schema)
    }

    /// Parses the payload; with a bound layout, as a checkpoint payload whose
    /// worker layout must equal it.
    fn parse_payload(&self, manifest: &Manifest) -> Result<PayloadSchema> {
        match &self.bound_layout {
            Some(bound) => {
                let payload = CheckpointPayload::parse(manifest.payload()).map_err(|e| {
                    Error::invalid(format!(
                        "target/draft byte layout does not match: the manifest's payload is not \
                         a checkpoint payload this worker can check ({e}); this worker is bound \
                         to {}",
                        bound.to_canonical_utf8()
                    ))
                })?;
                if &payload.worker_layout != bound {
                    return Err(Error::invalid(format!(
                        "target/draft byte layout does not match: the manifest has {}, this \
                         worker is bound to {}",
                        payload.worker_layout.to_canonical_utf8(),
                        bound.to_canonical_utf8()
                    )));
                }
                Ok(payload.into_schema())
            }
            None => manifest.payload_schema(),
        }
    }

    /// The pool-replacement check (`docs/design/transfers.md#2-map-the-pool`) and the lease
    /// validation.
    fn checked_plan(
        &self,
        job: &Job,
        schema: &PayloadSchema,
        groups: &[usize],
        lease: &Lease,
        mapped: &Arc<Mapped>,
    ) -> Result<plan::CopyPlan> {
        if let Some(other) = lease
            .pool_id
            .as_deref()
            .filter(|id| *id != mapped.pool.id())
        {
            self.forget_mapping(mapped);
            return Err(Error::invalid(format!(
                "the sidecar's shared-memory pool {} was replaced by {other} (restarted); the \
                 lease was refused and the pool will be mapped again",
                mapped.pool.id()
            )));
        }
        plan::plan_copy(
            job.direction,
            schema,
            &job.block_ids,
            groups,
            lease,
            &mapped.caps,
            &mapped.pool,
        )
    }

    /// Cancels a pending retrieve; never fatal (it exposed no bytes).
    fn cancel(&self, rank: u32, lease_id: &str) {
        let call = LeaseCall::CancelRetrieve {
            lease_id: lease_id.to_string(),
            rank,
        };
        let wait = self.config.rpc_timeout.min(Duration::from_secs(1));
        if let Err(e) = self.api.call(call).wait(wait)
            && e.kind() != ErrorKind::NotFound
        {
            log::warn!(
                "cancelling retrieve lease {lease_id} failed ({e}); the sidecar releases it"
            );
        }
    }
}
