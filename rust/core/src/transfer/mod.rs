//! Worker transfers: background copies between a worker's KV memory and the
//! sidecar's shared memory (`docs/design/transfers.md`).
//!
//! The worker's memory is described by a [`PageLayout`] ([`layout`]): a
//! contiguous `[num_blocks, page_bytes]` pool (the boundary fork), or
//! buffers (per-layer KV-cache tensors, stock vLLM) and per-group region
//! templates, where one page is several byte regions.
//!
//! One [`TransferEngine`] per worker rank owns a bounded admission queue
//! (`max_pending` jobs, queued or in progress) and `2 × workers` transfer
//! threads (`lmcache_rc_xfer<i>`), each carrying one job through all of
//! steps 1–6 below, so a leased job copies on the thread that leased it
//! (no hand-off). At most `workers` jobs are being leased or wait leased
//! (each copy's successor is leased while it copies, and no more slots are
//! held than the copies can use) and at most `workers` copy at once
//! (leased jobs take the copy slots in lease order); a finish overlaps the
//! next copy. Through a lease API that only sends (the RPC client), a job
//! of at most 16 pages that a waiting thread would take at once is checked
//! in `submit`, which sends its first lease call, so the thread's wake-up
//! overlaps the round trip. A [`Job`] is one rank's pages of one generation
//! in one [`Direction`]. Its life:
//!
//! 1. **Check** before any lease: the manifest's payload is parsed once
//!    ([`crate::manifest::CheckpointPayload`] when a layout is bound) and its
//!    `worker_layout` equals the bound layout; page groups match the block
//!    ids and the bound [`PageLayout`] (group names, widths, counts, `0 < id
//!    < num_blocks`, ids distinct, no two pages sharing bytes) —
//!    [`plan::check_job`].
//! 2. **Map**: the sidecar's pool is opened by name (never created or
//!    unlinked), checked against the capabilities, and mapped again when the
//!    sidecar recreated it (restart).
//! 3. **Lease**: STORE calls prepare_store and retries *busy* with a doubling
//!    sleep (1 → 10 ms) until `rpc_timeout`; RETRIEVE calls begin_retrieve,
//!    which answers `ready` at once when every page is in L1, and otherwise
//!    polls (after 50 µs, doubling to 5 ms) until `rpc_timeout`, then
//!    cancels (never fatal: a pending lookup exposed no bytes).
//! 4. **Validate** the lent slots against the mapped pool — [`plan::plan_copy`];
//!    a pool replaced since mapping fails the lease ("replaced").
//! 5. **Copy** through the [`CopyBackend`] (cpu or cuda), which returns only
//!    when nothing is in flight, or says that something may be.
//! 6. **Finish** the lease (store: success flag; retrieve: release).
//!
//! Outcomes ([`Outcome`]): *copied* (true), *miss* and *failed* (false; a
//! failed job finished its lease as failed, nothing is in flight), and
//! *unsafe*: a copy may be in flight or a lease reply could not be
//! reconciled (`docs/design/transfers.md#rpc-timeout-reconciliation`: every
//! RPC is waited for twice on the same reply; a late lease is released
//! unused). An unsafe engine never finishes that
//! lease, refuses every later submit and its `close` fails with
//! [`crate::Error::UnsafeCopy`]; its mapping is leaked so that no in-flight
//! DMA can touch freed memory (invariant I5).

mod backend;
pub mod cuda;
mod engine;
pub mod layout;
pub mod plan;
mod sidecar;

pub use crate::protocol::PoolSource;
pub use backend::{
    CopyBackend, CopyFailure, CopyRun, CpuBackend, Fault, FaultQueue, Registration, StreamKernel,
    copy_runs,
};
pub use engine::{EngineConfig, EngineStats, Job, JobHandle, JobPhases, Outcome, TransferEngine};
pub use layout::{GroupLayout, PageLayout, PoolShape, RegionTemplate};
pub use plan::{CopyPlan, Direction, PageCopy};
pub use sidecar::{LeaseAnswer, LeaseApi, LeaseCall, ReplyHandle};
