//! Helpers for the RPC suites: a server on a private temporary socket, the
//! worker side played through a client and a client-side mapping of the
//! pool, and raw-socket access for malformed-input tests.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lmcache_rc_core::Manifest;
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::rpc::wire::{self, Reply, Request};
use lmcache_rc_core::rpc::{Client, ClientConfig, Server, ServerConfig};
use lmcache_rc_core::service::{Lease, LeaseStatus, ServiceConfig};
use lmcache_rc_core::store::shm::ShmPool;

use crate::service_common::{HANG_GUARD, object_bytes, rank_keys};

/// A running server on a socket in its own temporary directory.
pub struct Rig {
    /// The server (dropped before `dir`).
    pub server: Server,
    /// The socket path.
    pub socket: PathBuf,
    /// Keeps the directory alive.
    pub _dir: tempfile::TempDir,
}

/// A service config for RPC tests: 16 MiB of L1, no L2, short timeouts.
pub fn service_config(tag: &str) -> ServiceConfig {
    ServiceConfig {
        l1_bytes: 16 << 20,
        ..crate::service_common::config(tag, None)
    }
}

/// A server with `service` settings, RPC settings adjusted by `tweak`.
pub fn rig_with(service: ServiceConfig, tweak: impl FnOnce(&mut ServerConfig)) -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("rpc.sock");
    let mut config = ServerConfig::new(&socket);
    tweak(&mut config);
    let server = Server::open(service, config).unwrap();
    Rig {
        server,
        socket,
        _dir: dir,
    }
}

/// A server with default RPC settings.
pub fn rig(tag: &str) -> Rig {
    rig_with(service_config(tag), |_| {})
}

/// A client of the rig with a short call timeout.
pub fn client(socket: &Path) -> Client {
    Client::connect_with(
        socket,
        ClientConfig {
            timeout: Duration::from_secs(30),
            ..ClientConfig::default()
        },
    )
    .unwrap()
}

/// The pool mapped the way a worker maps it: the descriptor the handshake
/// handed over, with the id and size the server announces.
pub fn map_pool(client: &Client) -> ShmPool {
    let (caps, fd) = client.share_pool().unwrap();
    ShmPool::from_fd(fd, &caps.pool_id, caps.pool_size).unwrap()
}

/// prepare_store over RPC, retrying `busy` (hang guard).
pub fn prepare(client: &Client, m: &Manifest, rank: u32) -> Lease {
    let deadline = Instant::now() + HANG_GUARD;
    loop {
        let lease = client.prepare_store(m, rank).unwrap();
        if lease.status != LeaseStatus::Busy {
            return lease;
        }
        assert!(Instant::now() < deadline, "store stayed busy: {lease:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Writes each exposed slot of a store lease with its page's bytes.
pub fn fill(pool: &ShmPool, m: &Manifest, rank: u32, lease: &Lease) -> u64 {
    let keys = rank_keys(m, rank);
    assert_eq!(lease.slots.len(), keys.len(), "one slot list per group");
    let mut copied = 0;
    for (g, slots) in lease.slots.iter().enumerate() {
        assert_eq!(slots.len(), keys[g].len(), "one slot per page");
        for (i, slot) in slots.iter().enumerate() {
            if let Some((offset, len)) = slot {
                pool.write_at(*offset, &object_bytes(&keys[g][i], *len))
                    .unwrap();
                copied += len;
            }
        }
    }
    copied
}

/// Stores one rank over RPC; returns whether this call published.
pub fn store_rank(client: &Client, pool: &ShmPool, m: &Manifest, rank: u32) -> bool {
    let lease = prepare(client, m, rank);
    assert_eq!(
        lease.status,
        LeaseStatus::Ready,
        "store rank {rank}: {lease:?}"
    );
    fill(pool, m, rank, &lease);
    client
        .finish_store(lease.lease_id.as_deref().unwrap(), true, None)
        .unwrap()
}

/// Begins and stores every rank over RPC; only the last rank publishes.
pub fn store_all(client: &Client, pool: &ShmPool, m: &Manifest) {
    assert!(client.begin(m).unwrap(), "begin {}", m.generation());
    for rank in 0..m.world_size() {
        let published = store_rank(client, pool, m, rank);
        assert_eq!(published, rank + 1 == m.world_size(), "rank {rank}");
    }
}

/// Polls a retrieve over RPC until it is not pending (hang guard).
pub fn poll_done(client: &Client, id: &str) -> Lease {
    let deadline = Instant::now() + HANG_GUARD;
    loop {
        let l = client.poll_retrieve(id, None).unwrap();
        if l.status != LeaseStatus::Pending {
            return l;
        }
        assert!(Instant::now() < deadline, "retrieve stayed pending");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Checks the bytes behind every slot of a ready retrieve lease.
pub fn check_slots(pool: &ShmPool, m: &Manifest, rank: u32, lease: &Lease) {
    let keys = rank_keys(m, rank);
    assert_eq!(lease.slots.len(), keys.len());
    for (g, slots) in lease.slots.iter().enumerate() {
        assert_eq!(slots.len(), keys[g].len());
        for (i, slot) in slots.iter().enumerate() {
            let (offset, len) = slot.expect("retrieve slots are never None");
            let mut got = vec![0u8; len as usize];
            pool.read_at(offset, &mut got).unwrap();
            assert!(
                got == object_bytes(&keys[g][i], len),
                "{} rank {rank} group {g} page {i}: bytes differ",
                m.generation()
            );
        }
    }
}

/// Restores one rank over RPC and checks every byte; `Err(reason)` on a miss.
pub fn restore_rank(
    client: &Client,
    pool: &ShmPool,
    m: &Manifest,
    rank: u32,
) -> Result<(), String> {
    let begun = client.begin_retrieve(m, rank).unwrap();
    if begun.status == LeaseStatus::Miss {
        return Err(begun.reason.map_or("?", |r| r.as_str()).to_string());
    }
    let id = begun.lease_id.clone().unwrap();
    let ready = poll_done(client, &id);
    if ready.status == LeaseStatus::Miss {
        return Err(ready.reason.map_or("?", |r| r.as_str()).to_string());
    }
    check_slots(pool, m, rank, &ready);
    client.finish_retrieve(&id, None).unwrap();
    Ok(())
}

/// The idle invariant over RPC: no leases, no pins.
pub fn assert_idle(client: &Client) {
    let s = client.status().unwrap();
    let v = |k: &str| s.values.get(k).copied().unwrap_or(0);
    assert_eq!(v("store_leases"), 0, "store leases at idle: {s:?}");
    assert_eq!(v("retrieve_leases"), 0, "retrieve leases at idle: {s:?}");
    assert_eq!(v("pins"), 0, "pins at idle: {s:?}");
}

// ---------------------------------------------------------------------------
// Raw sockets

/// A raw connection after a successful handshake.
pub fn raw_connect(socket: &Path) -> UnixStream {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(HANG_GUARD)).unwrap();
    s.write_all(&wire::encode_hello(1, wire::PROTOCOL_VERSION))
        .unwrap();
    let welcome = read_payload(&mut s).expect("a welcome");
    let (version, message) = wire::decode_welcome(&welcome).unwrap();
    assert_eq!(version, wire::PROTOCOL_VERSION, "{message}");
    s
}

/// Reads one frame's payload; None at end of stream (or a reset).
pub fn read_payload(s: &mut UnixStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut buf = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut buf).ok()?;
    Some(buf)
}

/// A frame with the given payload.
pub fn frame(payload: &[u8]) -> Vec<u8> {
    let mut out = (payload.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(payload);
    out
}

/// A request frame whose body is arbitrary bytes.
pub fn raw_request(id: u64, body: &[u8]) -> Vec<u8> {
    let mut payload = id.to_le_bytes().to_vec();
    payload.extend_from_slice(body);
    frame(&payload)
}

/// Sends a request frame and reads the reply (id, reply).
pub fn roundtrip(s: &mut UnixStream, id: u64, body: &[u8]) -> (u64, Reply) {
    s.write_all(&raw_request(id, body)).unwrap();
    read_reply(s).expect("a reply")
}

/// Reads one reply frame.
pub fn read_reply(s: &mut UnixStream) -> Option<(u64, Reply)> {
    let payload = read_payload(s)?;
    let (id, body) = wire::split_id(&payload).unwrap();
    Some((id, wire::decode_reply(body).unwrap()))
}

/// The postcard body of a request.
pub fn body(request: &Request) -> Vec<u8> {
    let framed = wire::encode_request(1, request, usize::MAX >> 1).unwrap();
    framed[4 + 8..].to_vec()
}

/// The error kind of a reply (panics on Ok).
pub fn err_kind(reply: &Reply) -> &str {
    match reply {
        Reply::Err(e) => &e.kind,
        Reply::Ok(v) => panic!("expected an error reply, got {v:?}"),
    }
}

/// Waits until the connection is closed by the peer (hang guard).
pub fn assert_closed(s: &mut UnixStream) {
    s.set_read_timeout(Some(HANG_GUARD)).unwrap();
    let mut buf = [0u8; 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("connection not closed: {e}"),
        }
    }
}

/// A fake server's accepting welcome: a fresh pool's id, with its descriptor.
pub fn send_welcome(stream: &UnixStream) {
    let pool = ShmPool::create(4096).unwrap();
    wire::send_frame_with_fd(
        stream,
        &wire::encode_welcome(wire::PROTOCOL_VERSION, pool.id()),
        pool.as_fd(),
    )
    .unwrap();
}
