//! The sidecar RPC: wire format, server and client (`docs/design/wire-protocol.md`,
//! `docs/design/README.md#processes`).
//!
//! Only metadata crosses the RPC (I10): manifests, roots, lease ids and slot
//! offsets. Page bytes move through the shared-memory pool, whose descriptor
//! the server hands to the client with its welcome (below).
//!
//! # Transport
//!
//! A Unix stream socket. The server creates the socket's directory with mode
//! 0700 when it is missing (an existing directory must belong to the server's
//! user and not be writable by group or others), binds under a temporary
//! name, sets the socket file's mode to 0600 and renames it into place. A
//! stale socket file (nothing answers on it) is replaced; a live one makes
//! the new server refuse to start. One server per socket: a running server
//! holds an exclusive `flock` on `<socket>.lock`, so even a second server
//! racing the first's start-up refuses.
//!
//! # Frames
//!
//! Every message is one frame:
//!
//! ```text
//! +----------------+----------------------------------------+
//! | len: u32 LE    | payload: len bytes                      |
//! +----------------+----------------------------------------+
//! ```
//!
//! `len` counts the payload only. A frame longer than the limit
//! ([`wire::DEFAULT_MAX_FRAME`] = 64 MiB, configurable on both sides) is never
//! read: the server answers it with a connection-level error (below) and
//! closes the connection.
//!
//! The server bounds what a peer can hold (`ServerConfig`): a frame that
//! started arriving must arrive whole within `frame_timeout` (a connection
//! idle between frames is never timed out); a frame's buffer grows as its
//! bytes arrive, never by what `len` claims; and the bytes of unfinished
//! frames across all connections beyond the first 64 KiB of each are
//! bounded by `max_buffered_bytes`. A frame past either bound gets a
//! connection-level error (`Protocol` for the timeout, `Unavailable` for
//! the budget) and its connection is closed. Connections are capped by
//! `max_connections`, lowered at start to what the open-file limit allows
//! beside the descriptors kept for L2 and SQLite ([`crate::limits`]).
//!
//! # Handshake
//!
//! The first frame each way is fixed binary (never postcard, so every future
//! version can read it):
//!
//! ```text
//! client hello:   "LMRC" | min_version: u32 LE | max_version: u32 LE
//! server welcome: "LMRC" | version: u32 LE     | message: UTF-8 (rest of the frame)
//! ```
//!
//! The server picks the highest version both sides speak
//! ([`wire::PROTOCOL_VERSION`], also announced in `capabilities`); version 0
//! means refused, with the reason in `message` (unsupported versions, too many
//! connections), and the server closes the connection.
//!
//! An accepted welcome (version 2) hands over the shared-memory pool: the
//! frame's bytes carry one file descriptor of the pool (`SCM_RIGHTS`
//! ancillary data, read with `recvmsg`, close-on-exec) and `message` is the
//! pool's id. The id is random and new at every server start; capabilities
//! and every ready lease name it too, so a worker never copies through a
//! mapping of another pool than the lease's. Version 1 (a pool opened by its
//! name in /dev/shm) is no longer spoken.
//!
//! # Requests and replies
//!
//! After the handshake every payload is
//!
//! ```text
//! request: id: u64 LE | postcard(Request)
//! reply:   id: u64 LE | postcard(Reply)
//! ```
//!
//! Ids are chosen by the client (from 1) and echoed by the server, so a
//! connection pipelines: several threads may have calls in flight on one
//! connection and replies may come back in any order. Id 0 is reserved for a
//! connection-level error reply (an oversize or id-less frame, a request
//! using id 0), after which the server closes the connection.
//!
//! [`wire::Request`] has one variant per service operation, generated from
//! the operation table ([`crate::for_each_operation!`]); its postcard
//! variant index is the request type: 0 CAPABILITIES, 1 FIND, 2 BEGIN,
//! 3 ABORT, 4 PREPARE_STORE, 5 FINISH_STORE, 6 BEGIN_RETRIEVE,
//! 7 POLL_RETRIEVE, 8 FINISH_RETRIEVE, 9 CANCEL_RETRIEVE, 10 STATUS,
//! 11 CLEAR{force, all_tiers}, 12 LIST_GENERATIONS, 13 INVALIDATE_NAMESPACE{namespace},
//! 14 FIND_LOCATED (added within version 3: an older server answers it
//! `Err{Protocol}`, and a client then falls back to FIND).
//! Variants and fields are append-only; any other
//! change needs a new protocol version. Manifests and prefixes travel as
//! plain fields ([`wire::WireManifest`], [`wire::WirePrefix`]; payload and
//! prefix hash as byte strings) and are validated by the core constructors on
//! receipt.
//!
//! Every reply is [`wire::Reply`]: `Ok(Value)` (variant 0) with one
//! [`wire::Value`] per result type (the protocol's types, serialized by
//! their serde derives), or `Err{kind, message}` (variant 1) where
//! `kind` is an [`ErrorKind`](crate::ErrorKind) name such as `InvalidInput`,
//! `NotFound`, `LeasesLive` or `Protocol`. A request that does not decode (an
//! unknown request type, a wrong argument encoding, trailing bytes) gets
//! `Err{Protocol}`; a value the core refuses (a bad prefix, manifest or rank)
//! gets the core's error (usually `InvalidInput`); the connection stays open
//! and the server keeps serving (I9). A handler panic is answered with
//! `Err{Internal}`.
//!
//! # Server and client
//!
//! [`Server`] serves one [`CheckpointService`](crate::service::CheckpointService)
//! to any number of connections, decoding each request into one call of the
//! [`Checkpoints`](crate::protocol::Checkpoints) operation set (a thread each; a `prepare_store`
//! that must wait for space on a thread of its own). [`Client`] is
//! thread-safe, pipelines (its callers read their own replies), times out
//! blocking calls, offers `*_async` futures, and
//! reconnects after a server restart (calls in flight then fail with
//! [`Error::Unavailable`](crate::Error::Unavailable)). Leases outlive the
//! connection that obtained them: they belong to the client's process, and
//! are reclaimed once that process is gone (`service::reclaim`).

pub mod client;
pub mod server;
pub mod wire;

pub use crate::protocol::Pending;
pub use client::{Client, ClientConfig, PendingReply};
pub use server::{Server, ServerConfig, ShutdownReport, default_socket_path, temp_socket_path};
pub use wire::{PROTOCOL_VERSION, Reply, Request, Value};

use std::os::fd::OwnedFd;

use crate::error::Result;
use crate::protocol::{Capabilities, PoolSource};

/// The RPC client hands out the pool its connection's handshake handed over.
impl PoolSource for Client {
    fn share_pool(&self) -> Result<(Capabilities, OwnedFd)> {
        Client::share_pool(self)
    }
    fn pool_id(&self) -> Result<String> {
        Client::pool_id(self)
    }
    fn pool_id_if_async(&self) -> Option<String> {
        Client::live_pool_id(self)
    }
}
