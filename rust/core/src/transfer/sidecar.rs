//! How the transfer engine talks to the checkpoint service.
//!
//! The engine needs six lease operations and the pool (its capabilities and a
//! descriptor to map, see [`PoolSource`], a protocol trait), and for the RPC-timeout
//! reconciliation (`docs/design/transfers.md#rpc-timeout-reconciliation`) it
//! must be able to wait *again on the same reply* rather than send a second
//! request. [`LeaseApi`] therefore hands out a [`ReplyHandle`] per call. Its
//! calls are the `*_async` operations of the protocol ([`CheckpointsAsync`]),
//! so any implementation of the protocol serves: the RPC client (the normal
//! case: the sidecar in another process) and the in-process service (embedded
//! use and tests); tests also implement [`LeaseApi`] to inject slow, lost or
//! malformed replies.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;
use crate::manifest::Manifest;
use crate::protocol::{Capabilities, CheckpointsAsync, Lease, Pending, PoolSource};

/// One lease operation of a transfer job.
#[derive(Debug, Clone)]
pub enum LeaseCall {
    /// Reserve slots for one rank's pages of a store.
    PrepareStore {
        /// The generation being stored.
        manifest: Manifest,
        /// The rank whose pages these are.
        rank: u32,
    },
    /// End a store lease (`success` = every page was copied).
    FinishStore {
        /// The lease.
        lease_id: String,
        /// Whether the copy completed.
        success: bool,
        /// The rank that took the lease (the service checks it).
        rank: u32,
    },
    /// Start restoring one rank's pages.
    BeginRetrieve {
        /// The generation being restored.
        manifest: Manifest,
        /// The rank whose pages these are.
        rank: u32,
    },
    /// Ask whether a retrieve is ready.
    PollRetrieve {
        /// The lease.
        lease_id: String,
        /// The rank that took the lease (the service checks it).
        rank: u32,
    },
    /// End an exposed retrieve lease after the copy drained.
    FinishRetrieve {
        /// The lease.
        lease_id: String,
        /// The rank that took the lease (the service checks it).
        rank: u32,
    },
    /// Give up a retrieve that exposed nothing.
    CancelRetrieve {
        /// The lease.
        lease_id: String,
        /// The rank that took the lease (the service checks it).
        rank: u32,
    },
}

impl LeaseCall {
    /// The rank the call is made for.
    pub fn rank(&self) -> u32 {
        match self {
            LeaseCall::PrepareStore { rank, .. }
            | LeaseCall::FinishStore { rank, .. }
            | LeaseCall::BeginRetrieve { rank, .. }
            | LeaseCall::PollRetrieve { rank, .. }
            | LeaseCall::FinishRetrieve { rank, .. }
            | LeaseCall::CancelRetrieve { rank, .. } => *rank,
        }
    }

    /// The operation's name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            LeaseCall::PrepareStore { .. } => "prepare_store",
            LeaseCall::FinishStore { .. } => "finish_store",
            LeaseCall::BeginRetrieve { .. } => "begin_retrieve",
            LeaseCall::PollRetrieve { .. } => "poll_retrieve",
            LeaseCall::FinishRetrieve { .. } => "finish_retrieve",
            LeaseCall::CancelRetrieve { .. } => "cancel_retrieve",
        }
    }
}

/// The answer to a [`LeaseCall`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseAnswer {
    /// prepare_store / begin_retrieve / poll_retrieve.
    Lease(Lease),
    /// finish_store (true = this call published the generation).
    Bool(bool),
    /// finish_retrieve / cancel_retrieve.
    Unit,
}

/// A reply that may not have arrived yet.
pub trait ReplyHandle: Send {
    /// Waits up to `timeout`; [`crate::Error::Timeout`] leaves the call
    /// pending so that the caller can wait again on the same reply.
    fn wait(&self, timeout: Duration) -> Result<LeaseAnswer>;
}

/// The lease operations a transfer engine needs from the checkpoint service.
pub trait LeaseApi: Send + Sync {
    /// The pool to map: its capabilities and a descriptor (see [`PoolSource`]).
    fn share_pool(&self) -> Result<(Capabilities, OwnedFd)>;
    /// The id of the pool leases come from now (see [`PoolSource::pool_id`]).
    fn pool_id(&self) -> Result<String>;
    /// Sends one lease operation; the reply arrives through the handle.
    fn call(&self, call: LeaseCall) -> Box<dyn ReplyHandle>;
    /// The id of the pool leases come from now, when known without
    /// blocking and when [`LeaseApi::call`] only sends (see
    /// [`PoolSource::pool_id_if_async`]): then the engine sends a small
    /// job's first lease call from `submit`, while a transfer thread wakes
    /// up to wait for its reply. None (the default): every call is made on
    /// a transfer thread.
    fn early_pool_id(&self) -> Option<String> {
        None
    }
}

/// A protocol future whose value becomes a [`LeaseAnswer`].
struct Answer<T> {
    pending: Pending<T>,
    wrap: fn(T) -> LeaseAnswer,
}

impl<T: Send + 'static> ReplyHandle for Answer<T> {
    fn wait(&self, timeout: Duration) -> Result<LeaseAnswer> {
        self.pending.wait(Some(timeout)).map(self.wrap)
    }
}

fn answer<T: Send + 'static>(
    pending: Pending<T>,
    wrap: fn(T) -> LeaseAnswer,
) -> Box<dyn ReplyHandle> {
    Box::new(Answer { pending, wrap })
}

/// Sends one lease call through the `*_async` operations of `api`.
fn call_async(api: &(impl CheckpointsAsync + ?Sized), call: LeaseCall) -> Box<dyn ReplyHandle> {
    match call {
        LeaseCall::PrepareStore { manifest, rank } => {
            answer(api.prepare_store_async(&manifest, rank), LeaseAnswer::Lease)
        }
        LeaseCall::FinishStore {
            lease_id,
            success,
            rank,
        } => answer(
            api.finish_store_async(&lease_id, success, Some(rank)),
            LeaseAnswer::Bool,
        ),
        LeaseCall::BeginRetrieve { manifest, rank } => answer(
            api.begin_retrieve_async(&manifest, rank),
            LeaseAnswer::Lease,
        ),
        LeaseCall::PollRetrieve { lease_id, rank } => answer(
            api.poll_retrieve_async(&lease_id, Some(rank)),
            LeaseAnswer::Lease,
        ),
        LeaseCall::FinishRetrieve { lease_id, rank } => {
            answer(api.finish_retrieve_async(&lease_id, Some(rank)), |()| {
                LeaseAnswer::Unit
            })
        }
        LeaseCall::CancelRetrieve { lease_id, rank } => {
            answer(api.cancel_retrieve_async(&lease_id, Some(rank)), |()| {
                LeaseAnswer::Unit
            })
        }
    }
}

/// Every implementation of the protocol that hands out its pool is a
/// [`LeaseApi`]: the RPC client (the sidecar in another process) and the
/// in-process service alike.
impl<T: CheckpointsAsync + PoolSource> LeaseApi for T {
    fn share_pool(&self) -> Result<(Capabilities, OwnedFd)> {
        PoolSource::share_pool(self)
    }
    fn pool_id(&self) -> Result<String> {
        PoolSource::pool_id(self)
    }
    fn call(&self, call: LeaseCall) -> Box<dyn ReplyHandle> {
        call_async(self, call)
    }
    fn early_pool_id(&self) -> Option<String> {
        PoolSource::pool_id_if_async(self)
    }
}

impl<T: LeaseApi + ?Sized> LeaseApi for Arc<T> {
    fn share_pool(&self) -> Result<(Capabilities, OwnedFd)> {
        (**self).share_pool()
    }
    fn pool_id(&self) -> Result<String> {
        (**self).pool_id()
    }
    fn call(&self, call: LeaseCall) -> Box<dyn ReplyHandle> {
        (**self).call(call)
    }
    fn early_pool_id(&self) -> Option<String> {
        (**self).early_pool_id()
    }
}
