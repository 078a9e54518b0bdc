//! Where a worker gets the service's shared-memory pool ([`PoolSource`]).
//!
//! Part of the protocol, beside the operation set: every implementation of
//! [`Checkpoints`](super::Checkpoints) that a worker copies through also
//! hands out its pool — the in-process service its own
//! (`service/mod.rs`), the RPC client the descriptor its connection's
//! handshake handed over (`rpc/mod.rs`) — and the transfer engine maps it
//! without naming either.

use std::os::fd::OwnedFd;

use crate::error::Result;

use super::Capabilities;

/// Where a worker gets the service's shared-memory pool.
pub trait PoolSource {
    /// The capabilities (pool id and size, format version) and a new
    /// descriptor of that very pool, to map.
    fn share_pool(&self) -> Result<(Capabilities, OwnedFd)>;
    /// The id of the pool leases come from now, without a round trip when
    /// possible (the RPC client reconnects if it must, but makes no call).
    fn pool_id(&self) -> Result<String>;
    /// The id of the pool leases come from now, when it is known without
    /// blocking *and* this source's `*_async` calls only send (the
    /// operation runs elsewhere and answers later): the RPC client with a
    /// live connection. None otherwise — the default, and the in-process
    /// service's answer (its calls run in the caller). A transfer engine
    /// sends a small job's first lease call from `submit` only when this
    /// names the pool it mapped.
    fn pool_id_if_async(&self) -> Option<String> {
        None
    }
}
