//! Helpers for the transfer-engine suites (`docs/design/transfers.md`): a host page
//! pool (the numpy array a cpu worker binds), workers (engine + cpu backend +
//! pool) against an in-process service or a real RPC server, manifests whose
//! page groups all have the pool's row width, and [`Scripted`], a `LeaseApi`
//! that forwards to a real service except where a test scripts a lost, late,
//! failing, busy, pending or edited reply.

use std::alloc::Layout;
use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::service::{Capabilities, CheckpointService, Lease, LeaseStatus};
use lmcache_rc_core::transfer::{
    CpuBackend, Direction, EngineConfig, Job, JobHandle, LeaseAnswer, LeaseApi, LeaseCall, Outcome,
    PoolShape, ReplyHandle, TransferEngine,
};
use lmcache_rc_core::{Error, ErrorKind, Manifest, Result, TokenRoots, checkpoint_generation};

use crate::service_common::{GroupSpec, HANG_GUARD, Role, object_bytes, rank_keys, seq};

/// Row width of the test page pools (and of every page group).
pub const PAGE: u64 = 256;
/// Geometry of the test page pools.
pub const SHAPE: PoolShape = PoolShape {
    num_blocks: 64,
    page_bytes: PAGE,
};
/// Namespace of the transfer suites' manifests.
pub const TNS: &str = "recurrent-sha256-v1:transfer-suite";
/// A short RPC bound for fault tests (misses and unsafe verdicts come after
/// one or two of these).
pub const FAST: Duration = Duration::from_millis(200);
/// The RPC bound of tests where nothing is meant to time out.
pub const SLOW: Duration = Duration::from_secs(30);
/// Pages per rank of [`tgen`] manifests (3 attention + recurrent + auxiliary).
pub const PAGES: u64 = 5;

// ---------------------------------------------------------------------------
// Host page pool

/// A `[num_blocks, page_bytes]` uint8 page pool in ordinary memory (what a
/// numpy array gives the cpu backend): one 4 KiB-aligned owned allocation
/// whose address never changes. Read and write rows only while no job of an
/// engine over it is copying.
pub struct HostPool {
    ptr: NonNull<u8>,
    layout: Layout,
    shape: PoolShape,
    keep: AtomicBool,
}

// SAFETY: the pool is a plain heap allocation; tests touch its rows only
// while no copy runs (after a job ended), and the engine's backend writes
// only rows of its jobs. No references to the bytes are handed out.
unsafe impl Send for HostPool {}
// SAFETY: see `Send`.
unsafe impl Sync for HostPool {}

impl HostPool {
    /// A zeroed pool of `shape`.
    pub fn new(shape: PoolShape) -> HostPool {
        let len = (shape.num_blocks * shape.page_bytes) as usize;
        let layout = Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: `len > 0` (the shapes used here have rows of bytes).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        HostPool {
            ptr: NonNull::new(ptr).expect("allocate the host page pool"),
            layout,
            shape,
            keep: AtomicBool::new(false),
        }
    }

    /// Base address (row 0).
    pub fn base(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes of the pool.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    fn range(&self, block: u64) -> usize {
        assert!(block < self.shape.num_blocks, "row {block} out of range");
        (block * self.shape.page_bytes) as usize
    }

    /// A copy of one row.
    pub fn row(&self, block: u64) -> Vec<u8> {
        let mut out = vec![0u8; self.shape.page_bytes as usize];
        // SAFETY: the row lies inside the allocation; `out` is separate memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base().add(self.range(block)),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        out
    }

    /// Overwrites one row.
    pub fn write_row(&self, block: u64, bytes: &[u8]) {
        assert_eq!(bytes.len() as u64, self.shape.page_bytes);
        // SAFETY: the row lies inside the allocation; `bytes` is separate memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.base().add(self.range(block)),
                bytes.len(),
            )
        };
    }

    /// A copy of `len` bytes at `offset` (any buffer, not only rows).
    pub fn read_at(&self, offset: u64, len: u64) -> Vec<u8> {
        assert!(offset + len <= self.len() as u64, "read past the buffer");
        let mut out = vec![0u8; len as usize];
        // SAFETY: the range lies inside the allocation; `out` is separate memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base().add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        out
    }

    /// Overwrites `bytes.len()` bytes at `offset`.
    pub fn write_at(&self, offset: u64, bytes: &[u8]) {
        assert!(
            offset + bytes.len() as u64 <= self.len() as u64,
            "write past the buffer"
        );
        // SAFETY: the range lies inside the allocation; `bytes` is separate memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.base().add(offset as usize),
                bytes.len(),
            )
        };
    }

    /// A copy of the whole pool.
    pub fn snapshot(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len()];
        // SAFETY: the whole allocation; `out` is separate memory.
        unsafe { std::ptr::copy_nonoverlapping(self.base(), out.as_mut_ptr(), out.len()) };
        out
    }

    /// Sets every byte to `byte`.
    pub fn fill(&self, byte: u8) {
        // SAFETY: the whole allocation.
        unsafe { std::ptr::write_bytes(self.base(), byte, self.len()) };
    }

    /// Never free the allocation (an unsafe engine may still copy into it).
    pub fn keep_forever(&self) {
        self.keep.store(true, Ordering::SeqCst);
    }
}

impl Drop for HostPool {
    fn drop(&mut self) {
        if !self.keep.load(Ordering::SeqCst) {
            // SAFETY: allocated in `new` with this layout, freed once.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
        }
    }
}

// ---------------------------------------------------------------------------
// Workers

/// One worker rank: an engine over a cpu backend over a host pool. Fields
/// drop in order: the engine (drains its copies) before the pool; the pool is
/// leaked when the engine ended unsafe.
pub struct Worker {
    /// The engine.
    pub engine: TransferEngine,
    /// The backend (its fault queue is the test hook).
    pub backend: Arc<CpuBackend>,
    /// The page pool the backend copies from/to.
    pub pool: HostPool,
}

impl Worker {
    /// A worker over a fresh zeroed pool of `shape`.
    pub fn start(api: Box<dyn LeaseApi>, shape: PoolShape, config: EngineConfig) -> Result<Worker> {
        let pool = HostPool::new(shape);
        // SAFETY: the pool holds `num_blocks * page_bytes` writable bytes and
        // outlives the backend: `Worker` drops the engine (which joins its
        // copy threads, the only other holders of the backend) before the
        // pool, and leaks the pool when the engine is unsafe.
        let backend = Arc::new(unsafe { CpuBackend::new(pool.base(), shape) }?);
        let engine = TransferEngine::start(api, backend.clone(), config)?;
        Ok(Worker {
            engine,
            backend,
            pool,
        })
    }

    /// A worker of the standard shape against an in-process service.
    pub fn in_process(svc: &Arc<CheckpointService>) -> Worker {
        Worker::start(Box::new(svc.clone()), SHAPE, engine_config(SLOW)).unwrap()
    }

    /// A worker of the standard shape behind a scripted API.
    pub fn scripted(api: &Arc<Scripted>, rpc_timeout: Duration) -> Worker {
        Worker::start(Box::new(api.clone()), SHAPE, engine_config(rpc_timeout)).unwrap()
    }

    /// Submits a job that must be admitted.
    pub fn submit(&self, job: Job) -> JobHandle {
        self.engine
            .submit(job)
            .expect("a valid job")
            .expect("the job is admitted")
    }

    /// Submits a job and waits for its outcome.
    pub fn run(&self, job: Job) -> Done {
        done(&self.submit(job))
    }

    /// Stores `m`'s pages of `rank` from rows starting at `first` (filled first).
    pub fn store(&self, m: &Manifest, rank: u32, first: u64) -> Done {
        let b = blocks(m, first);
        fill_rows(&self.pool, m, rank, &b);
        self.run(job(m, rank, Direction::Store, &b))
    }

    /// Retrieves `m`'s pages of `rank` into rows starting at `first`.
    pub fn retrieve(&self, m: &Manifest, rank: u32, first: u64) -> Done {
        self.run(job(m, rank, Direction::Retrieve, &blocks(m, first)))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Drain first, so that an engine turning unsafe while draining is seen.
        let _ = self.engine.close(Some(HANG_GUARD));
        if self.engine.is_unsafe() || self.engine.in_flight() > 0 {
            self.pool.keep_forever();
        }
    }
}

/// An engine config: 2 copy threads, 16 admitted jobs, the standard layout bound.
pub fn engine_config(rpc_timeout: Duration) -> EngineConfig {
    EngineConfig {
        workers: 2,
        max_pending: 16,
        rpc_timeout,
        layout: Some(layout(PAGE)),
    }
}

/// How a job ended, in plain values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Done {
    /// `copied`, `miss`, `failed` or `unsafe`.
    pub kind: &'static str,
    /// The reason (empty for copied).
    pub reason: String,
    /// The error's kind for a failed job.
    pub error: Option<ErrorKind>,
}

impl Done {
    /// Asserts the outcome kind and that the reason mentions `needle`.
    pub fn expect(&self, kind: &str, needle: &str) {
        assert_eq!(self.kind, kind, "{self:?}");
        assert!(
            self.reason.contains(needle),
            "reason should mention {needle:?}: {self:?}"
        );
    }
}

/// Waits (hang guard) for a job and returns its outcome.
pub fn done(h: &JobHandle) -> Done {
    assert!(h.wait(Some(HANG_GUARD)), "the job did not end");
    h.with_outcome(|o| Done {
        kind: o.kind(),
        reason: o.reason().unwrap_or_default(),
        error: match o {
            Outcome::Failed(e) => Some(e.kind()),
            _ => None,
        },
    })
    .expect("an ended job has an outcome")
}

// ---------------------------------------------------------------------------
// Manifests, rows, jobs

/// The worker layout descriptor for `page_bytes`.
pub fn layout(page_bytes: u64) -> serde_json::Value {
    serde_json::json!({"schema_version": 1, "page_bytes": page_bytes})
}

/// Attention x [0, 1, 2] (16-token blocks, shared by continuations),
/// recurrent x [16] and auxiliary x [0], all of `page` bytes.
pub fn uniform_groups(kind: &str, page: u64) -> Vec<GroupSpec> {
    vec![
        GroupSpec::new(
            "engine-kv-group:0",
            page,
            vec![0, 1, 2],
            Role::Attention(16),
        ),
        GroupSpec::new(
            "engine-kv-group:1",
            page,
            vec![16],
            Role::Endpoint("recurrent:1".into()),
        ),
        GroupSpec::new(
            "target-draft-auxiliary",
            page,
            vec![0],
            Role::Endpoint(format!("auxiliary:0:{kind}")),
        ),
    ]
}

/// A schema-2 manifest with the given groups and (optional) worker layout.
pub fn manifest_with(
    tokens: &[u32],
    world: u32,
    groups: &[GroupSpec],
    worker_layout: Option<serde_json::Value>,
    kind: &str,
) -> Manifest {
    let roots = TokenRoots::build(TNS, tokens.to_vec(), 4096).unwrap();
    let n = tokens.len() as u64;
    let mut page_groups = Vec::new();
    for (gi, g) in groups.iter().enumerate() {
        let boundaries: Vec<(u64, String)> = g
            .positions
            .iter()
            .map(|&p| match &g.role {
                Role::Attention(block) => (((p + 1) * block).min(n), format!("attention:{gi}")),
                Role::Endpoint(disc) => (n, format!("{disc}:{p}")),
            })
            .collect();
        page_groups.push(serde_json::json!({
            "name": g.name,
            "page_bytes": g.page_bytes,
            "positions": g.positions,
            "content_keys": roots.content_keys(&boundaries).unwrap(),
        }));
    }
    let mut payload = serde_json::json!({
        "schema_version": 2,
        "kind": kind,
        "draft_prefix_len": 0,
        "page_groups": page_groups,
    });
    if let Some(l) = worker_layout {
        payload["worker_layout"] = l;
    }
    let payload = serde_json::to_vec(&payload).unwrap();
    let prefix = roots.prefix(n).unwrap();
    let generation = checkpoint_generation(&prefix, &payload);
    Manifest::new(generation, prefix, world, payload).unwrap()
}

/// The standard transfer manifest: tokens `base..base + n`, [`uniform_groups`]
/// of [`PAGE`] bytes, the standard layout, `world` ranks.
pub fn tgen(base: u32, n: u32, world: u32) -> Manifest {
    manifest_with(
        &seq(base, n),
        world,
        &uniform_groups("prompt", PAGE),
        Some(layout(PAGE)),
        "prompt",
    )
}

/// Consecutive page-pool rows from `first`, one per page, in group order.
pub fn blocks(m: &Manifest, first: u64) -> Vec<Vec<u64>> {
    let mut next = first;
    m.payload_schema()
        .unwrap()
        .page_groups
        .iter()
        .map(|g| {
            let ids: Vec<u64> = (next..next + g.positions.len() as u64).collect();
            next += g.positions.len() as u64;
            ids
        })
        .collect()
}

/// A job without a producer event.
pub fn job(m: &Manifest, rank: u32, direction: Direction, block_ids: &[Vec<u64>]) -> Job {
    Job {
        manifest: m.clone(),
        rank,
        direction,
        block_ids: block_ids.to_vec(),
        producer_event: None,
    }
}

/// Writes every page's expected bytes (a function of its object key) into its row.
pub fn fill_rows(pool: &HostPool, m: &Manifest, rank: u32, block_ids: &[Vec<u64>]) {
    for (keys, ids) in rank_keys(m, rank).iter().zip(block_ids) {
        for (key, &id) in keys.iter().zip(ids) {
            pool.write_row(id, &object_bytes(key, PAGE));
        }
    }
}

/// Asserts every page's row holds its expected bytes.
pub fn check_rows(pool: &HostPool, m: &Manifest, rank: u32, block_ids: &[Vec<u64>]) {
    for (g, (keys, ids)) in rank_keys(m, rank).iter().zip(block_ids).enumerate() {
        assert_eq!(keys.len(), ids.len());
        for (i, (key, &id)) in keys.iter().zip(ids).enumerate() {
            assert!(
                pool.row(id) == object_bytes(key, PAGE),
                "{} rank {rank} group {g} page {i} (row {id}): bytes differ",
                m.generation()
            );
        }
    }
}

/// An in-process service with 4 MiB of L1 and no L2.
pub fn service(tag: &str) -> Arc<CheckpointService> {
    Arc::new(CheckpointService::open(crate::service_common::config(tag, None)).unwrap())
}

/// After a `prepare_store` whose reply never came: it was sent once, no
/// store lease was finished, the sidecar's pool holds `shm` as before, and
/// the engine is unsafe (closing it says so).
pub fn assert_unsafe_after_a_lost_prepare(
    svc: &CheckpointService,
    api: &Scripted,
    worker: &Worker,
    shm: &[u8],
) {
    assert_eq!(api.count("prepare_store"), 1, "never a second prepare");
    assert!(api.store_finishes().is_empty());
    assert!(shm_bytes(svc) == shm);
    assert!(worker.engine.is_unsafe());
    assert_eq!(
        worker.engine.close(Some(HANG_GUARD)).unwrap_err().kind(),
        ErrorKind::UnsafeCopy
    );
}

/// Every byte of the service's shared-memory pool.
pub fn shm_bytes(svc: &CheckpointService) -> Vec<u8> {
    let mut out = vec![0u8; svc.pool().size() as usize];
    svc.pool().read_at(0, &mut out).unwrap();
    out
}

/// `begin`, retrying while an aborted attempt drains (hang guard).
pub fn begin(svc: &CheckpointService, m: &Manifest) {
    let deadline = Instant::now() + HANG_GUARD;
    while !svc.begin(m).unwrap() {
        assert!(
            Instant::now() < deadline,
            "begin {} refused",
            m.generation()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Waits (hang guard) until `cond` holds.
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + HANG_GUARD;
    while !cond() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

// ---------------------------------------------------------------------------
// Scripted lease API

/// What [`Scripted`] does with one call.
#[derive(Clone)]
pub enum Step {
    /// Forward to the real service and return its reply.
    Pass,
    /// The request is lost: not forwarded, every wait times out.
    NoReply,
    /// Forwarded now; the reply shows up only after this many timed-out waits.
    Late(u32),
    /// Not forwarded; this many waits time out, then the error arrives.
    LateFail(u32, ErrorKind),
    /// Not forwarded; the reply is an error of this kind.
    Fail(ErrorKind),
    /// Not forwarded; the reply is `busy`.
    Busy,
    /// Not forwarded; the reply is `pending` (poll_retrieve: the polled id).
    Pending,
    /// Forwarded; a `ready` lease in the reply is edited before the engine sees it.
    Edit(Arc<dyn Fn(&mut Lease) + Send + Sync>),
    /// Forwarded now; the reply is shown only this long after the engine
    /// starts waiting for it (keep it below the RPC bound).
    Slow(Duration),
    /// begin_retrieve: forwarded; a `ready` reply (every page was in L1) is
    /// shown as `pending` with its id, as a sidecar still loading pages
    /// would answer, so the engine polls. A cancel of such a lease (the
    /// engine gave up on it: it never copied from its slots) is forwarded as
    /// the finish the real sidecar needs for an exposed lease.
    AsPending,
}

impl Step {
    /// An [`Step::Edit`] from a closure.
    pub fn edit(f: impl Fn(&mut Lease) + Send + Sync + 'static) -> Step {
        Step::Edit(Arc::new(f))
    }
}

type Hook = Box<dyn FnOnce() + Send>;

/// A `LeaseApi` in front of a real one: records every call and answers it
/// per script (queued one-shot steps first, then the op's standing step,
/// else [`Step::Pass`]).
pub struct Scripted {
    inner: Box<dyn LeaseApi>,
    caps: Mutex<Option<Capabilities>>,
    queued: Mutex<HashMap<&'static str, VecDeque<Step>>>,
    standing: Mutex<HashMap<&'static str, Step>>,
    hooks: Mutex<HashMap<&'static str, Hook>>,
    log: Mutex<Vec<LeaseCall>>,
    /// The name of the thread that made each call of `log`.
    senders: Mutex<Vec<String>>,
    /// Ready retrieve leases shown as pending ([`Step::AsPending`]).
    hidden: Arc<Mutex<std::collections::HashSet<String>>>,
    /// Whether the engine may send a job's first lease call from `submit`
    /// ([`LeaseApi::early_pool_id`]), as it does through the RPC client.
    early: AtomicBool,
}

impl Scripted {
    /// A scripted API over `inner` (e.g. an `Arc<CheckpointService>` or a `Client`).
    pub fn new(inner: impl LeaseApi + 'static) -> Arc<Scripted> {
        Arc::new(Scripted {
            inner: Box::new(inner),
            caps: Mutex::new(None),
            queued: Mutex::new(HashMap::new()),
            standing: Mutex::new(HashMap::new()),
            hooks: Mutex::new(HashMap::new()),
            log: Mutex::new(Vec::new()),
            senders: Mutex::new(Vec::new()),
            hidden: Arc::default(),
            early: AtomicBool::new(false),
        })
    }

    /// Lets the engine send small jobs' first lease calls from `submit`
    /// (what it does through the RPC client), or not (the default).
    pub fn send_early(&self, on: bool) {
        self.early.store(on, Ordering::SeqCst);
    }

    /// Queues `step` for the next `times` calls of `op` (e.g. "prepare_store").
    pub fn then(&self, op: &'static str, step: Step, times: usize) {
        let mut q = self.queued.lock();
        let e = q.entry(op).or_default();
        for _ in 0..times {
            e.push_back(step.clone());
        }
    }

    /// Answers every later call of `op` (after the queued ones) with `step`.
    pub fn always(&self, op: &'static str, step: Step) {
        self.standing.lock().insert(op, step);
    }

    /// Drops every queued and standing step.
    pub fn reset(&self) {
        self.queued.lock().clear();
        self.standing.lock().clear();
    }

    /// Capabilities to report instead of the real ones (None = real).
    pub fn set_caps(&self, caps: Option<Capabilities>) {
        *self.caps.lock() = caps;
    }

    /// Runs `f` once, just before the next call of `op` is handled.
    pub fn hook(&self, op: &'static str, f: impl FnOnce() + Send + 'static) {
        self.hooks.lock().insert(op, Box::new(f));
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<LeaseCall> {
        self.log.lock().clone()
    }

    /// Calls of `op` so far made on a thread that is not one of an
    /// engine's transfer threads (`lmcache_rc_xfer<i>`): sent from `submit`.
    pub fn sent_by_submit(&self, op: &str) -> usize {
        let log = self.log.lock();
        let senders = self.senders.lock();
        log.iter()
            .zip(senders.iter())
            .filter(|(c, t)| c.name() == op && !t.starts_with("lmcache_rc_xfer"))
            .count()
    }

    /// Calls of `op` so far.
    pub fn count(&self, op: &str) -> usize {
        self.log.lock().iter().filter(|c| c.name() == op).count()
    }

    /// The success flags of every finish_store so far.
    pub fn store_finishes(&self) -> Vec<bool> {
        self.log
            .lock()
            .iter()
            .filter_map(|c| match c {
                LeaseCall::FinishStore { success, .. } => Some(*success),
                _ => None,
            })
            .collect()
    }

    fn step(&self, op: &'static str) -> Step {
        if let Some(s) = self.queued.lock().get_mut(op).and_then(VecDeque::pop_front) {
            return s;
        }
        self.standing.lock().get(op).cloned().unwrap_or(Step::Pass)
    }
}

/// An error of `kind` as the transport or the server would report it.
pub fn error_of(kind: ErrorKind, message: &str) -> Error {
    let message = message.to_string();
    match kind {
        ErrorKind::Unavailable => Error::Unavailable(message),
        ErrorKind::Timeout => Error::Timeout(message),
        ErrorKind::NotFound => Error::NotFound(message),
        ErrorKind::InvalidInput => Error::InvalidInput(message),
        ErrorKind::Protocol => Error::Protocol(message),
        kind => Error::Remote { kind, message },
    }
}

fn timeout_error(after: Duration) -> Error {
    Error::Timeout(format!(
        "scripted: no reply within {:.3} s",
        after.as_secs_f64()
    ))
}

/// A reply decided by the script (answer or error), after `delays` timeouts.
struct Given {
    answer: std::result::Result<LeaseAnswer, (ErrorKind, String)>,
    delays: AtomicU32,
}

impl ReplyHandle for Given {
    fn wait(&self, timeout: Duration) -> Result<LeaseAnswer> {
        if self
            .delays
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| d.checked_sub(1))
            .is_ok()
        {
            std::thread::sleep(timeout);
            return Err(timeout_error(timeout));
        }
        self.answer
            .clone()
            .map_err(|(kind, message)| error_of(kind, &message))
    }
}

/// A reply that never arrives.
struct Lost;

impl ReplyHandle for Lost {
    fn wait(&self, timeout: Duration) -> Result<LeaseAnswer> {
        std::thread::sleep(timeout);
        Err(timeout_error(timeout))
    }
}

/// The real reply, shown only after `delays` timed-out waits.
struct Delayed {
    inner: Box<dyn ReplyHandle>,
    delays: AtomicU32,
}

impl ReplyHandle for Delayed {
    fn wait(&self, timeout: Duration) -> Result<LeaseAnswer> {
        if self
            .delays
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| d.checked_sub(1))
            .is_ok()
        {
            std::thread::sleep(timeout);
            return Err(timeout_error(timeout));
        }
        self.inner.wait(timeout)
    }
}

/// The real reply, shown `after` the wait for it started.
struct Slowed {
    inner: Box<dyn ReplyHandle>,
    after: Duration,
}

impl ReplyHandle for Slowed {
    fn wait(&self, timeout: Duration) -> Result<LeaseAnswer> {
        std::thread::sleep(self.after.min(timeout));
        self.inner.wait(timeout)
    }
}

/// The real reply with a ready lease edited.
struct Edited {
    inner: Box<dyn ReplyHandle>,
    edit: Arc<dyn Fn(&mut Lease) + Send + Sync>,
}

impl ReplyHandle for Edited {
    fn wait(&self, timeout: Duration) -> Result<LeaseAnswer> {
        let mut answer = self.inner.wait(timeout)?;
        if let LeaseAnswer::Lease(lease) = &mut answer
            && lease.status == LeaseStatus::Ready
        {
            (self.edit)(lease);
        }
        Ok(answer)
    }
}

/// The real reply with a ready lease shown as pending ([`Step::AsPending`]).
struct AsPending {
    inner: Box<dyn ReplyHandle>,
    hidden: Arc<Mutex<std::collections::HashSet<String>>>,
}

impl ReplyHandle for AsPending {
    fn wait(&self, timeout: Duration) -> Result<LeaseAnswer> {
        let mut answer = self.inner.wait(timeout)?;
        if let LeaseAnswer::Lease(lease) = &mut answer
            && let (LeaseStatus::Ready, Some(id)) = (lease.status, lease.lease_id.clone())
        {
            self.hidden.lock().insert(id.clone());
            *lease = Lease::pending(id);
        }
        Ok(answer)
    }
}

impl LeaseApi for Scripted {
    fn share_pool(&self) -> Result<(Capabilities, OwnedFd)> {
        let (caps, fd) = self.inner.share_pool()?;
        Ok((self.caps.lock().clone().unwrap_or(caps), fd))
    }
    fn pool_id(&self) -> Result<String> {
        self.inner.pool_id()
    }
    fn early_pool_id(&self) -> Option<String> {
        if self.early.load(Ordering::SeqCst) {
            self.inner.pool_id().ok()
        } else {
            None
        }
    }

    fn call(&self, call: LeaseCall) -> Box<dyn ReplyHandle> {
        let op = call.name();
        {
            let mut log = self.log.lock();
            log.push(call.clone());
            let thread = std::thread::current();
            self.senders
                .lock()
                .push(thread.name().unwrap_or_default().to_string());
        }
        let hook = self.hooks.lock().remove(op);
        if let Some(h) = hook {
            h();
        }
        let given = |answer, delays| -> Box<dyn ReplyHandle> {
            Box::new(Given {
                answer,
                delays: AtomicU32::new(delays),
            })
        };
        let call = match call {
            LeaseCall::CancelRetrieve { lease_id, rank }
                if self.hidden.lock().remove(&lease_id) =>
            {
                LeaseCall::FinishRetrieve { lease_id, rank }
            }
            LeaseCall::FinishRetrieve { ref lease_id, .. } => {
                self.hidden.lock().remove(lease_id);
                call
            }
            call => call,
        };
        match self.step(op) {
            Step::Pass => self.inner.call(call),
            Step::AsPending => Box::new(AsPending {
                inner: self.inner.call(call),
                hidden: self.hidden.clone(),
            }),
            Step::NoReply => Box::new(Lost),
            Step::Late(n) => Box::new(Delayed {
                inner: self.inner.call(call),
                delays: AtomicU32::new(n),
            }),
            Step::Slow(after) => Box::new(Slowed {
                inner: self.inner.call(call),
                after,
            }),
            Step::LateFail(n, kind) => given(Err((kind, format!("scripted {op} failure"))), n),
            Step::Fail(kind) => given(Err((kind, format!("scripted {op} failure"))), 0),
            Step::Busy => given(Ok(LeaseAnswer::Lease(Lease::busy())), 0),
            Step::Pending => {
                let id = match &call {
                    LeaseCall::PollRetrieve { lease_id, .. } => lease_id.clone(),
                    _ => "scripted-pending".to_string(),
                };
                given(Ok(LeaseAnswer::Lease(Lease::pending(id))), 0)
            }
            Step::Edit(edit) => Box::new(Edited {
                inner: self.inner.call(call),
                edit,
            }),
        }
    }
}

/// A scripted API over a fresh in-process service.
pub fn scripted_service(tag: &str) -> (Arc<CheckpointService>, Arc<Scripted>) {
    let svc = service(tag);
    let api = Scripted::new(svc.clone());
    (svc, api)
}
