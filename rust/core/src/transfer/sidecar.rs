//! How the transfer engine talks to the checkpoint service.
//!
//! The engine needs six lease operations and the capabilities, and for the
//! RPC-timeout reconciliation of spec §7.3 it must be able to wait *again on
//! the same reply* rather than send a second request. [`LeaseApi`] therefore
//! hands out a [`ReplyHandle`] per call. It is implemented by the RPC
//! [`Client`] (the normal case: the sidecar in another process) and by the
//! in-process [`CheckpointService`] (embedded use and tests); tests also
//! implement it to inject slow, lost or malformed replies.

use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;
use crate::manifest::Manifest;
use crate::rpc::client::{Client, Pending};
use crate::service::{Capabilities, CheckpointService, Lease};

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
    },
    /// End an exposed retrieve lease after the copy drained.
    FinishRetrieve {
        /// The lease.
        lease_id: String,
    },
    /// Give up a retrieve that exposed nothing.
    CancelRetrieve {
        /// The lease.
        lease_id: String,
    },
}

impl LeaseCall {
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
    /// Pool name and size, format version (read when mapping the pool).
    fn capabilities(&self) -> Result<Capabilities>;
    /// Sends one lease operation; the reply arrives through the handle.
    fn call(&self, call: LeaseCall) -> Box<dyn ReplyHandle>;
}

/// An RPC future whose value becomes a [`LeaseAnswer`].
struct RpcReply<T> {
    pending: Pending<T>,
    wrap: fn(T) -> LeaseAnswer,
}

impl<T: Send> ReplyHandle for RpcReply<T> {
    fn wait(&self, timeout: Duration) -> Result<LeaseAnswer> {
        self.pending.wait(Some(timeout)).map(self.wrap)
    }
}

fn boxed<T: Send + 'static>(
    pending: Pending<T>,
    wrap: fn(T) -> LeaseAnswer,
) -> Box<dyn ReplyHandle> {
    Box::new(RpcReply { pending, wrap })
}

impl LeaseApi for Client {
    fn capabilities(&self) -> Result<Capabilities> {
        Client::capabilities(self)
    }

    fn call(&self, call: LeaseCall) -> Box<dyn ReplyHandle> {
        match call {
            LeaseCall::PrepareStore { manifest, rank } => boxed(
                self.prepare_store_async(&manifest, rank),
                LeaseAnswer::Lease,
            ),
            LeaseCall::FinishStore { lease_id, success } => boxed(
                self.finish_store_async(&lease_id, success),
                LeaseAnswer::Bool,
            ),
            LeaseCall::BeginRetrieve { manifest, rank } => boxed(
                self.begin_retrieve_async(&manifest, rank),
                LeaseAnswer::Lease,
            ),
            LeaseCall::PollRetrieve { lease_id } => {
                boxed(self.poll_retrieve_async(&lease_id), LeaseAnswer::Lease)
            }
            LeaseCall::FinishRetrieve { lease_id } => {
                boxed(self.finish_retrieve_async(&lease_id), |()| {
                    LeaseAnswer::Unit
                })
            }
            LeaseCall::CancelRetrieve { lease_id } => {
                boxed(self.cancel_retrieve_async(&lease_id), |()| {
                    LeaseAnswer::Unit
                })
            }
        }
    }
}

/// A reply computed at once (the in-process service answers synchronously).
struct Ready(Result<LeaseAnswer>);

impl ReplyHandle for Ready {
    fn wait(&self, _timeout: Duration) -> Result<LeaseAnswer> {
        match &self.0 {
            Ok(answer) => Ok(answer.clone()),
            Err(e) => Err(crate::Error::Remote {
                kind: e.kind(),
                message: e.to_string(),
            }),
        }
    }
}

impl LeaseApi for CheckpointService {
    fn capabilities(&self) -> Result<Capabilities> {
        Ok(CheckpointService::capabilities(self))
    }

    fn call(&self, call: LeaseCall) -> Box<dyn ReplyHandle> {
        let answer = match call {
            LeaseCall::PrepareStore { manifest, rank } => {
                self.prepare_store(&manifest, rank).map(LeaseAnswer::Lease)
            }
            LeaseCall::FinishStore { lease_id, success } => {
                self.finish_store(&lease_id, success).map(LeaseAnswer::Bool)
            }
            LeaseCall::BeginRetrieve { manifest, rank } => {
                self.begin_retrieve(&manifest, rank).map(LeaseAnswer::Lease)
            }
            LeaseCall::PollRetrieve { lease_id } => {
                self.poll_retrieve(&lease_id).map(LeaseAnswer::Lease)
            }
            LeaseCall::FinishRetrieve { lease_id } => {
                self.finish_retrieve(&lease_id).map(|()| LeaseAnswer::Unit)
            }
            LeaseCall::CancelRetrieve { lease_id } => {
                self.cancel_retrieve(&lease_id).map(|()| LeaseAnswer::Unit)
            }
        };
        Box::new(Ready(answer))
    }
}

impl<T: LeaseApi + ?Sized> LeaseApi for Arc<T> {
    fn capabilities(&self) -> Result<Capabilities> {
        (**self).capabilities()
    }
    fn call(&self, call: LeaseCall) -> Box<dyn ReplyHandle> {
        (**self).call(call)
    }
}
