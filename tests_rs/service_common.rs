//! Helpers for service tests: manifests with schema-2
//! payloads, and a simulated worker that copies through lease slots.
//!
//! Every helper is generic over [`Target`]: the same scenario runs on the
//! in-process [`CheckpointService`] and on [`Remote`] — a server on a private
//! socket, driven through an RPC client, with the pool mapped the way a
//! worker maps it. A scenario is written once as `fn name<T: Target>()` and
//! [`both_ways!`] runs it both ways (tests `name::in_process` and
//! `name::over_the_socket`).

use std::time::Duration;

use lmcache_rc_core::index::{Directory, DirectoryConfig};
use lmcache_rc_core::protocol::Checkpoints;
use lmcache_rc_core::rpc::{Client, Server, ServerConfig};
use lmcache_rc_core::service::{CheckpointService, Lease, LeaseStatus, ServiceConfig};
use lmcache_rc_core::store::shm::ShmPool;
use lmcache_rc_core::{Manifest, TokenRoots, checkpoint_generation};

/// Runs each scenario `fn name<T: Target>()` of the calling module twice:
/// as `name::in_process` on a [`CheckpointService`] and as
/// `name::over_the_socket` on a [`Remote`].
macro_rules! both_ways {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn in_process() {
                super::$name::<lmcache_rc_core::service::CheckpointService>();
            }
            #[test]
            fn over_the_socket() {
                super::$name::<crate::service_common::Remote>();
            }
        }
    )*};
}
pub(crate) use both_ways;

/// Runs each scenario `fn name<T: Target>(eviction: Eviction)` of the
/// calling module under both eviction policies, both ways: tests
/// `name::lru::in_process`, `name::lru::over_the_socket`,
/// `name::cost::in_process` and `name::cost::over_the_socket`. The
/// scenario opens its service with `eviction` ([`with_eviction`]).
macro_rules! every_policy {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            mod lru {
                #[test]
                fn in_process() {
                    super::super::$name::<lmcache_rc_core::service::CheckpointService>(
                        lmcache_rc_core::cost::Eviction::Lru,
                    );
                }
                #[test]
                fn over_the_socket() {
                    super::super::$name::<crate::service_common::Remote>(
                        lmcache_rc_core::cost::Eviction::Lru,
                    );
                }
            }
            mod cost {
                #[test]
                fn in_process() {
                    super::super::$name::<lmcache_rc_core::service::CheckpointService>(
                        lmcache_rc_core::cost::Eviction::Cost,
                    );
                }
                #[test]
                fn over_the_socket() {
                    super::super::$name::<crate::service_common::Remote>(
                        lmcache_rc_core::cost::Eviction::Cost,
                    );
                }
            }
        }
    )*};
}
pub(crate) use every_policy;

/// `config` with the eviction policy `eviction`.
pub fn with_eviction(
    config: ServiceConfig,
    eviction: lmcache_rc_core::cost::Eviction,
) -> ServiceConfig {
    ServiceConfig { eviction, ..config }
}

/// What a service scenario runs against: the operation set, the pool as
/// the copying side sees it, and the service behind it for the checks no
/// client can make (unreferenced objects, the L2 queue, close).
pub trait Target: Checkpoints + Sized + Sync {
    /// Serves an opened service.
    fn serve(service: CheckpointService) -> lmcache_rc_core::Result<Self>;
    /// Opens a target with these service settings.
    fn open(config: ServiceConfig) -> lmcache_rc_core::Result<Self> {
        Self::serve(CheckpointService::open(config)?)
    }
    /// Opens a target whose L2 tier uses `fs` (fault injection).
    fn open_with_fs(
        config: ServiceConfig,
        fs: std::sync::Arc<dyn lmcache_rc_core::store::l2::Fs>,
        progress: &mut dyn FnMut(usize),
    ) -> lmcache_rc_core::Result<Self> {
        Self::serve(CheckpointService::open_with_fs(config, fs, progress)?)
    }
    /// The SHM pool, mapped the way the copying side maps it.
    fn pool(&self) -> &ShmPool;
    /// The service itself.
    fn service(&self) -> &CheckpointService;
    /// Objects nothing references or holds (0 at idle, I7).
    fn unreferenced_objects(&self) -> usize {
        self.service().unreferenced_objects()
    }
    /// Waits for the L2 queue to drain.
    fn wait_l2_idle(&self, timeout: Duration) -> bool {
        self.service().wait_l2_idle(timeout)
    }
    /// Closes the service (refused while leases are live).
    fn close(&self) -> lmcache_rc_core::Result<()> {
        self.service().close()
    }
}

/// Anything that leads to a [`Target`]: a target, or the `Arc` a test
/// shares a service through (helpers take either).
pub trait AsTarget {
    /// The target.
    type Target: Target;
    /// The target itself.
    fn target(&self) -> &Self::Target;
}

impl<T: Target> AsTarget for T {
    type Target = T;
    fn target(&self) -> &T {
        self
    }
}

impl AsTarget for std::sync::Arc<CheckpointService> {
    type Target = CheckpointService;
    fn target(&self) -> &CheckpointService {
        self
    }
}

impl Target for CheckpointService {
    fn serve(service: CheckpointService) -> lmcache_rc_core::Result<Self> {
        Ok(service)
    }
    fn pool(&self) -> &ShmPool {
        CheckpointService::pool(self)
    }
    fn service(&self) -> &CheckpointService {
        self
    }
}

/// A service behind a server on a private socket, driven through a client;
/// the pool is the client's own mapping of the descriptor it was handed.
pub struct Remote {
    client: Client,
    pool: ShmPool,
    server: Server,
    _dir: tempfile::TempDir,
}

impl Target for Remote {
    fn serve(service: CheckpointService) -> lmcache_rc_core::Result<Self> {
        let dir = tempfile::tempdir().map_err(|e| lmcache_rc_core::Error::io("tempdir", e))?;
        let socket = dir.path().join("svc.sock");
        let server = Server::start(std::sync::Arc::new(service), ServerConfig::new(&socket))?;
        let client = Client::connect(&socket)?;
        let (caps, fd) = client.share_pool()?;
        let pool = ShmPool::from_fd(fd, &caps.pool_id, caps.pool_size)?;
        Ok(Remote {
            client,
            pool,
            server,
            _dir: dir,
        })
    }
    fn pool(&self) -> &ShmPool {
        &self.pool
    }
    fn service(&self) -> &CheckpointService {
        self.server.service()
    }
}

/// Every operation goes over the socket.
impl lmcache_rc_core::protocol::Decorator for Remote {
    type Inner = Client;
    fn inner(&self) -> &Client {
        &self.client
    }
}

/// A small config: 4 MiB of L1, optional L2 directory, short timeouts
/// (`_tag` names the scenario in the caller, for readers).
pub fn config(_tag: &str, l2: Option<&std::path::Path>) -> ServiceConfig {
    ServiceConfig {
        l1_bytes: 4 << 20,
        l2_path: l2.map(|p| p.to_path_buf()),
        store_admission_timeout: Duration::from_millis(300),
        retrieve_timeout: Duration::from_secs(5),
        ..ServiceConfig::default()
    }
}

/// A schema-2 manifest for `tokens` whose attention pages are keyed at their
/// own end (shared by continuations) plus a recurrent page and an auxiliary page.
pub fn manifest(tokens: &[u32], world: u32, page_bytes: u64, block: u64) -> Manifest {
    let ns = "recurrent-sha256-v1:test";
    let roots = TokenRoots::build(ns, tokens.to_vec(), 4096).unwrap();
    let n = tokens.len() as u64;
    let pages = n.div_ceil(block);
    let attn: Vec<(u64, String)> = (0..pages)
        .map(|p| (((p + 1) * block).min(n), "attention:0".to_string()))
        .collect();
    let attn_keys = roots.content_keys(&attn).unwrap();
    let rec_key = roots.content_key(n, "recurrent:1").unwrap();
    let aux_key = roots.content_key(n, "auxiliary:0:prompt").unwrap();
    let payload = serde_json::json!({
        "schema_version": 2,
        "kind": "prompt",
        "draft_prefix_len": 0,
        "worker_layout": {"page_bytes": page_bytes},
        "page_groups": [
            {"name": "engine-kv-group:0", "page_bytes": page_bytes,
             "positions": (0..pages).collect::<Vec<_>>(), "content_keys": attn_keys},
            {"name": "engine-kv-group:1", "page_bytes": page_bytes,
             "positions": [0], "content_keys": [rec_key]},
            {"name": "target-draft-auxiliary", "page_bytes": page_bytes,
             "positions": [0], "content_keys": [aux_key]},
        ],
    });
    let payload = serde_json::to_vec(&payload).unwrap();
    let prefix = roots.prefix(n).unwrap();
    let generation = checkpoint_generation(&prefix, &payload);
    Manifest::new(generation, prefix, world, payload).unwrap()
}

/// Deterministic page bytes for (rank, group, page index, content seed).
pub fn page_bytes(rank: u32, group: usize, index: usize, len: u64, seed: &str) -> Vec<u8> {
    let mut x: u64 = 0xcbf29ce484222325;
    for b in seed
        .bytes()
        .chain(rank.to_le_bytes())
        .chain((group as u32).to_le_bytes())
        .chain((index as u32).to_le_bytes())
    {
        x = (x ^ u64::from(b)).wrapping_mul(0x100000001b3);
    }
    (0..len)
        .map(|i| (x.wrapping_add(i.wrapping_mul(0x9e3779b97f4a7c15)) >> 56) as u8)
        .collect()
}

/// Stores one rank: prepare (retrying busy), write every exposed slot, finish.
/// Returns (published, bytes copied).
pub fn store_rank(svc: &impl AsTarget, m: &Manifest, rank: u32) -> (bool, u64) {
    let svc = svc.target();
    let lease = loop {
        let lease = svc.prepare_store(m, rank).unwrap();
        if lease.status != LeaseStatus::Busy {
            break lease;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(
        lease.status,
        LeaseStatus::Ready,
        "store rank {rank}: {lease:?}"
    );
    let copied = write_slots(svc, m, rank, &lease);
    let published = svc
        .finish_store(lease.lease_id.as_deref().unwrap(), true, None)
        .unwrap();
    (published, copied)
}

/// Writes the expected bytes into a store lease's slots.
pub fn write_slots(svc: &impl AsTarget, m: &Manifest, rank: u32, lease: &Lease) -> u64 {
    let svc = svc.target();
    let schema = m.payload_schema().unwrap();
    let mut copied = 0;
    for (g, slots) in lease.slots.iter().enumerate() {
        for (i, slot) in slots.iter().enumerate() {
            if let Some((offset, len)) = slot {
                let seed = hex::encode(schema.page_groups[g].content_keys[i]);
                svc.pool()
                    .write_at(*offset, &page_bytes(rank, g, i, *len, &seed))
                    .unwrap();
                copied += len;
            }
        }
    }
    copied
}

/// Retrieves one rank and checks every byte; returns false on a miss.
pub fn retrieve_rank(svc: &impl AsTarget, m: &Manifest, rank: u32) -> bool {
    let svc = svc.target();
    let lease = svc.begin_retrieve(m, rank).unwrap();
    if lease.status == LeaseStatus::Miss {
        return false;
    }
    let id = lease.lease_id.clone().unwrap();
    let ready = loop {
        let l = svc.poll_retrieve(&id, None).unwrap();
        match l.status {
            LeaseStatus::Pending => std::thread::sleep(Duration::from_millis(1)),
            LeaseStatus::Ready => break l,
            LeaseStatus::Miss => return false,
            LeaseStatus::Busy => panic!("retrieve never answers busy"),
        }
    };
    let schema = m.payload_schema().unwrap();
    for (g, slots) in ready.slots.iter().enumerate() {
        assert_eq!(slots.len(), schema.page_groups[g].positions.len());
        for (i, slot) in slots.iter().enumerate() {
            let (offset, len) = slot.expect("retrieve slots are never None");
            let mut got = vec![0u8; len as usize];
            svc.pool().read_at(offset, &mut got).unwrap();
            let seed = hex::encode(schema.page_groups[g].content_keys[i]);
            assert_eq!(
                got,
                page_bytes(rank, g, i, len, &seed),
                "rank {rank} group {g} page {i}"
            );
        }
    }
    svc.finish_retrieve(&id, None).unwrap();
    true
}

/// The idle invariant (I7): no leases, no pins, no unreferenced objects.
pub fn assert_idle(svc: &impl AsTarget) {
    let svc = svc.target();
    let s = svc.status().unwrap();
    let v = |k: &str| s.values.get(k).copied().unwrap_or(0);
    assert_eq!(v("store_leases"), 0, "store leases at idle: {s:?}");
    assert_eq!(v("retrieve_leases"), 0, "retrieve leases at idle: {s:?}");
    assert_eq!(v("pins"), 0, "pins at idle: {s:?}");
    assert_eq!(
        svc.unreferenced_objects(),
        0,
        "unreferenced objects at idle: {s:?}"
    );
}

// ---------------------------------------------------------------------------
// Helpers for the suites built on the standard test manifest
// (`docs/design/leases.md#the-standard-test-manifest`): manifests built from page-group specs,
// bytes derived from each page's object key (so deduplicated pages agree
// across generations), and probes of the service's tiers.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use lmcache_rc_core::store::ObjectKey;
use lmcache_rc_core::store::l2::object_file_bytes;
use lmcache_rc_core::store::object_keys;

/// Namespace of the standard-style manifests (tests vary it for isolation).
pub const NS: &str = "recurrent-sha256-v1:service-suite";

/// How a page group's content keys are derived (schema 2).
#[derive(Clone, Debug)]
pub enum Role {
    /// Attention page `p` ends at `min((p + 1) * block, n)`: full pages are
    /// shared by every later checkpoint of the sequence.
    Attention(u64),
    /// A page at the boundary `n` with this discriminator (`:<position>` is
    /// appended): unique per boundary.
    Endpoint(String),
}

/// One page group of a test manifest.
#[derive(Clone, Debug)]
pub struct GroupSpec {
    /// Group name.
    pub name: String,
    /// Bytes per page.
    pub page_bytes: u64,
    /// Logical positions.
    pub positions: Vec<u64>,
    /// Content-key derivation.
    pub role: Role,
}

impl GroupSpec {
    /// A group spec.
    pub fn new(name: &str, page_bytes: u64, positions: Vec<u64>, role: Role) -> GroupSpec {
        GroupSpec {
            name: name.to_string(),
            page_bytes,
            positions,
            role,
        }
    }
}

/// The tokens `0..n` offset by `base` (distinct `base`s give distinct sequences).
pub fn seq(base: u32, n: u32) -> Vec<u32> {
    (0..n).map(|t| base + t).collect()
}

/// A manifest of `tokens` with the given groups. Schema 2 carries content
/// keys (content-addressed objects); schema 1 carries none (objects scoped
/// to the generation). `kind` goes into the payload, so the same tokens with
/// another kind are a different generation of the same exact prefix.
pub fn build_manifest(
    ns: &str,
    tokens: &[u32],
    world: u32,
    groups: &[GroupSpec],
    schema: u8,
    kind: &str,
) -> Manifest {
    let roots = TokenRoots::build(ns, tokens.to_vec(), 4096).unwrap();
    let n = tokens.len() as u64;
    let mut page_groups = Vec::new();
    for (gi, g) in groups.iter().enumerate() {
        let mut group = serde_json::json!({
            "name": g.name,
            "page_bytes": g.page_bytes,
            "positions": g.positions,
        });
        if schema == 2 {
            let boundaries: Vec<(u64, String)> = g
                .positions
                .iter()
                .map(|&p| match &g.role {
                    Role::Attention(block) => (((p + 1) * block).min(n), format!("attention:{gi}")),
                    Role::Endpoint(disc) => (n, format!("{disc}:{p}")),
                })
                .collect();
            group["content_keys"] = serde_json::json!(roots.content_keys(&boundaries).unwrap());
        }
        page_groups.push(group);
    }
    let payload = serde_json::json!({
        "schema_version": schema,
        "kind": kind,
        "draft_prefix_len": 0,
        "page_groups": page_groups,
    });
    let payload = serde_json::to_vec(&payload).unwrap();
    let prefix = roots.prefix(n).unwrap();
    let generation = checkpoint_generation(&prefix, &payload);
    Manifest::new(generation, prefix, world, payload).unwrap()
}

/// The page groups of the standard manifest
/// (`docs/design/leases.md#the-standard-test-manifest`): attention 128 B x
/// positions 0,1,2; recurrent 256 B x [16]; draft context 64 B x [7, 8];
/// auxiliary 96 B x [0].
pub fn standard_groups(kind: &str) -> Vec<GroupSpec> {
    vec![
        GroupSpec::new(
            "target.attention.0",
            128,
            vec![0, 1, 2],
            Role::Attention(16),
        ),
        GroupSpec::new(
            "target.recurrent.0",
            256,
            vec![16],
            Role::Endpoint("recurrent:1".into()),
        ),
        GroupSpec::new(
            "draft.context.0",
            64,
            vec![7, 8],
            Role::Endpoint("draft:2".into()),
        ),
        GroupSpec::new(
            "target-draft-auxiliary",
            96,
            vec![0],
            Role::Endpoint(format!("auxiliary:0:{kind}")),
        ),
    ]
}

/// The standard manifest (`docs/design/leases.md#the-standard-test-manifest`):
/// world 4, [`standard_groups`], over `tokens`.
pub fn standard(ns: &str, tokens: &[u32], kind: &str, schema: u8) -> Manifest {
    build_manifest(ns, tokens, 4, &standard_groups(kind), schema, kind)
}

/// The object keys of one rank, per group.
pub fn rank_keys(m: &Manifest, rank: u32) -> Vec<Vec<ObjectKey>> {
    object_keys(m, &m.payload_schema().unwrap(), rank).unwrap()
}

/// Every object key of every rank with its page bytes.
pub fn key_sizes(m: &Manifest) -> BTreeMap<ObjectKey, u64> {
    let schema = m.payload_schema().unwrap();
    let mut out = BTreeMap::new();
    for rank in 0..m.world_size() {
        for (g, keys) in object_keys(m, &schema, rank)
            .unwrap()
            .into_iter()
            .enumerate()
        {
            for k in keys {
                out.insert(k, schema.page_groups[g].page_bytes);
            }
        }
    }
    out
}

/// Every object key of every rank.
pub fn all_keys(m: &Manifest) -> HashSet<ObjectKey> {
    key_sizes(m).into_keys().collect()
}

/// The bytes a page must hold: a function of its object key only, so a
/// deduplicated page has the same bytes in every generation naming it.
pub fn object_bytes(key: &ObjectKey, len: u64) -> Vec<u8> {
    let mut x = u64::from_le_bytes(key.0[..8].try_into().unwrap()) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Writes every exposed slot of a store lease with its page's bytes; returns
/// the bytes copied (deduplicated `None` slots copy nothing).
pub fn fill(svc: &impl AsTarget, m: &Manifest, rank: u32, lease: &Lease) -> u64 {
    let svc = svc.target();
    let keys = rank_keys(m, rank);
    assert_eq!(lease.slots.len(), keys.len(), "one slot list per group");
    let mut copied = 0;
    for (g, slots) in lease.slots.iter().enumerate() {
        assert_eq!(slots.len(), keys[g].len(), "one slot per page");
        for (i, slot) in slots.iter().enumerate() {
            if let Some((offset, len)) = slot {
                svc.pool()
                    .write_at(*offset, &object_bytes(&keys[g][i], *len))
                    .unwrap();
                copied += len;
            }
        }
    }
    copied
}

/// How long a test waits for something that should happen promptly (a hang
/// guard, never a timing assertion).
pub const HANG_GUARD: Duration = Duration::from_secs(30);

/// prepare_store, retrying `busy` (hang guard); returns the first non-busy answer.
pub fn prepare(svc: &impl AsTarget, m: &Manifest, rank: u32) -> Lease {
    let svc = svc.target();
    let deadline = Instant::now() + HANG_GUARD;
    loop {
        let lease = svc.prepare_store(m, rank).unwrap();
        if lease.status != LeaseStatus::Busy {
            return lease;
        }
        assert!(Instant::now() < deadline, "store stayed busy: {lease:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Stores one rank (prepare, fill, finish true); returns (published, bytes copied).
pub fn store_one(svc: &impl AsTarget, m: &Manifest, rank: u32) -> (bool, u64) {
    let svc = svc.target();
    let lease = prepare(svc, m, rank);
    assert_eq!(
        lease.status,
        LeaseStatus::Ready,
        "store rank {rank}: {lease:?}"
    );
    let copied = fill(svc, m, rank, &lease);
    let published = svc
        .finish_store(lease.lease_id.as_deref().unwrap(), true, None)
        .unwrap();
    (published, copied)
}

/// Begins and stores every rank; asserts that only the last rank publishes.
/// Returns the bytes copied.
pub fn store_all(svc: &impl AsTarget, m: &Manifest) -> u64 {
    let svc = svc.target();
    assert!(svc.begin(m).unwrap(), "begin {}", m.generation());
    let mut copied = 0;
    for rank in 0..m.world_size() {
        let (published, bytes) = store_one(svc, m, rank);
        assert_eq!(published, rank + 1 == m.world_size(), "rank {rank}");
        copied += bytes;
    }
    copied
}

/// Polls a retrieve lease until it is not pending (hang guard).
pub fn poll_done(svc: &impl AsTarget, id: &str) -> Lease {
    let svc = svc.target();
    let deadline = Instant::now() + HANG_GUARD;
    loop {
        let l = svc.poll_retrieve(id, None).unwrap();
        if l.status != LeaseStatus::Pending {
            return l;
        }
        assert!(Instant::now() < deadline, "retrieve stayed pending");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Checks the bytes behind every slot of a ready retrieve lease.
pub fn check_slots(svc: &impl AsTarget, m: &Manifest, rank: u32, lease: &Lease) {
    let svc = svc.target();
    assert_eq!(lease.status, LeaseStatus::Ready);
    let keys = rank_keys(m, rank);
    let schema = m.payload_schema().unwrap();
    assert_eq!(lease.slots.len(), keys.len());
    for (g, slots) in lease.slots.iter().enumerate() {
        assert_eq!(slots.len(), keys[g].len());
        for (i, slot) in slots.iter().enumerate() {
            let (offset, len) = slot.expect("retrieve slots are never None");
            assert_eq!(len, schema.page_groups[g].page_bytes);
            let mut got = vec![0u8; len as usize];
            svc.pool().read_at(offset, &mut got).unwrap();
            assert!(
                got == object_bytes(&keys[g][i], len),
                "{} rank {rank} group {g} page {i}: bytes differ",
                m.generation()
            );
        }
    }
}

/// Opens a retrieve and polls it to ready (panics on a miss); the caller finishes it.
pub fn open_read(svc: &impl AsTarget, m: &Manifest, rank: u32) -> Lease {
    let svc = svc.target();
    let begun = svc.begin_retrieve(m, rank).unwrap();
    assert!(
        matches!(begun.status, LeaseStatus::Pending | LeaseStatus::Ready),
        "begin_retrieve: {begun:?}"
    );
    let ready = poll_done(svc, begun.lease_id.as_deref().unwrap());
    assert_eq!(ready.status, LeaseStatus::Ready, "poll_retrieve: {ready:?}");
    check_slots(svc, m, rank, &ready);
    ready
}

/// Restores one rank and checks every byte; `Err(reason)` on a miss.
pub fn restore(svc: &impl AsTarget, m: &Manifest, rank: u32) -> Result<(), String> {
    let svc = svc.target();
    let begun = svc.begin_retrieve(m, rank).unwrap();
    if begun.status == LeaseStatus::Miss {
        return Err(begun.reason.map_or("?", |r| r.as_str()).to_string());
    }
    let id = begun.lease_id.clone().unwrap();
    let ready = poll_done(svc, &id);
    if ready.status == LeaseStatus::Miss {
        return Err(ready.reason.map_or("?", |r| r.as_str()).to_string());
    }
    check_slots(svc, m, rank, &ready);
    svc.finish_retrieve(&id, None).unwrap();
    Ok(())
}

/// Restores every rank byte-exact (panics on any miss).
pub fn restore_all(svc: &impl AsTarget, m: &Manifest) {
    let svc = svc.target();
    for rank in 0..m.world_size() {
        if let Err(reason) = restore(svc, m, rank) {
            panic!("{} rank {rank} missed: {reason}", m.generation());
        }
    }
}

/// Whether `m` is the listed generation of its exact prefix.
pub fn is_listed(svc: &impl AsTarget, m: &Manifest) -> bool {
    let svc = svc.target();
    svc.find(std::slice::from_ref(m.prefix())).unwrap().as_ref() == Some(m)
}

/// A status value (0 when absent).
pub fn stat(svc: &impl AsTarget, key: &str) -> u64 {
    let svc = svc.target();
    svc.status().unwrap().values.get(key).copied().unwrap_or(0)
}

/// Misses counted for `reason`.
pub fn misses(svc: &impl AsTarget, reason: &str) -> u64 {
    let svc = svc.target();
    svc.status()
        .unwrap()
        .misses
        .get(reason)
        .copied()
        .unwrap_or(0)
}

/// Where the L2 file of `key` lives under the L2 root.
pub fn l2_file(root: &Path, key: &ObjectKey) -> PathBuf {
    let hex = key.hex();
    root.join("objects")
        .join(&hex[0..2])
        .join(&hex[2..4])
        .join(format!("{hex}.page"))
}

/// Every `.page` file under the L2 root: (count, bytes).
pub fn l2_files(root: &Path) -> (u64, u64) {
    let mut count = 0;
    let mut bytes = 0;
    let mut stack = vec![root.join("objects")];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let entry = entry.unwrap();
            let meta = entry.metadata().unwrap();
            if meta.is_dir() {
                stack.push(entry.path());
            } else if entry.path().extension().is_some_and(|e| e == "page") {
                count += 1;
                bytes += meta.len();
            }
        }
    }
    (count, bytes)
}

/// What the L2 of a set of listed manifests takes on disk (count, bytes
/// rounded up to the allocation unit of the filesystem holding `dir`), as
/// `l2_objects` and `l2_bytes` report it.
pub fn charged_l2<'a>(listed: impl IntoIterator<Item = &'a Manifest>, dir: &Path) -> (u64, u64) {
    let unit = lmcache_rc_core::store::l2::allocation_unit(dir);
    let mut union = BTreeMap::new();
    for m in listed {
        union.extend(key_sizes(m));
    }
    let bytes = union
        .values()
        .map(|&b| object_file_bytes(b).div_ceil(unit) * unit)
        .sum();
    (union.len() as u64, bytes)
}

/// The L2 files (count, bytes) a set of listed manifests needs.
pub fn expected_l2<'a>(listed: impl IntoIterator<Item = &'a Manifest>) -> (u64, u64) {
    let mut union = BTreeMap::new();
    for m in listed {
        union.extend(key_sizes(m));
    }
    let bytes = union.values().map(|&b| object_file_bytes(b)).sum();
    (union.len() as u64, bytes)
}

/// Waits for the L2 queue to drain (hang guard).
pub fn settle(svc: &impl AsTarget) {
    let svc = svc.target();
    assert!(svc.wait_l2_idle(HANG_GUARD), "L2 queue did not drain");
}

/// A config with an L2 tier and a durable directory under `dir`.
pub fn durable_config(tag: &str, dir: &Path) -> ServiceConfig {
    ServiceConfig {
        checkpoint_index_path: Some(dir.join("index.sqlite")),
        ..config(tag, Some(&dir.join("l2")))
    }
}

/// Generations whose durable flag is set in the directory file (opened on its
/// own, before the service reconciles it).
pub fn durable_flags(index: &Path) -> Vec<String> {
    if !index.exists() {
        return Vec::new();
    }
    let dir = Directory::open(Some(index), DirectoryConfig::default()).unwrap();
    let mut flagged = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = dir.list(after.as_deref(), 256).unwrap();
        flagged.extend(
            page.generations
                .into_iter()
                .filter(|l| l.durable)
                .map(|l| l.manifest.generation().to_owned()),
        );
        match page.next_after {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    dir.close().unwrap();
    flagged
}
