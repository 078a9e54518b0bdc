//! The durable checkpoint directory: published manifests in SQLite, pending
//! generations in memory (`docs/design/manifests.md#the-directorys-contract`,
//! `docs/design/directory.md`,
//! `docs/design/README.md#where-lmcache-rc-differs-from-the-reference`).
//!
//! # What it owns
//!
//! A [`Directory`] answers "which published generation has the longest exact
//! token prefix of this request?" and runs the generation lifecycle:
//! *unknown* → [`begin`](Directory::begin) → *pending* → (every rank
//! [acknowledged](Directory::acknowledge)) → *published* → (replaced by a new
//! generation for the same exact prefix | [invalidated](Directory::invalidate)
//! | [retired](Directory::retire) | evicted by capacity) → *gone*. Pending
//! generations leave by [`abort`](Directory::abort),
//! [`abort_stale`](Directory::abort_stale), [`close`](Directory::close) or a
//! restart. It never interprets payload pages, never touches payload objects
//! and never decides that a published generation's pages are missing: callers
//! invalidate or retire such generations, and they learn from each
//! [`Publication`] which generations a publication replaced or evicted so they
//! can drop their payload references.
//!
//! # Crash safety (invariant I1)
//!
//! * Pending state (the manifest, the set of acknowledged ranks, the start
//!   time) lives only in memory. Nothing about an unpublished generation is
//!   ever written to the database.
//! * Publication is one SQLite transaction: remove the previous generation of
//!   the same exact prefix, insert the `checkpoints` row and its
//!   `checkpoint_tails` row, write the batched recency stamps, delete the
//!   capacity victims, commit. The file is in WAL mode with
//!   `synchronous=NORMAL`: the commit appends to the write-ahead log and
//!   returns without an fsync. A process crash (`kill -9`) after
//!   `acknowledge` returned `published = true` loses nothing; a power cut may
//!   lose the publication (whole), which restart reconciliation would retire
//!   anyway until its payload objects are durable; a crash at any earlier
//!   moment rolls the whole transaction back.
//! * Therefore after a crash a generation is either listed with its complete
//!   manifest and lookup row, or absent; a partially acknowledged generation
//!   never appears. The in-memory lookup accelerator is rebuilt from the
//!   committed tables at open and is changed only after a commit.
//! * What must survive a power cut is synced: [`mark_durable`] (called once
//!   the payload objects are fsynced) returns only after an fsync of the log
//!   covering its commit — and every earlier commit, publications included.
//!   Concurrent callers share that fsync (group commit, `durability.rs`),
//!   and it runs outside the directory lock. Checkpoints (which sync too) run
//!   on a background connection. The whole argument, step by step, is in
//!   `docs/design/directory.md`.
//!
//! [`mark_durable`]: Directory::mark_durable
//!
//! # Differences from the reference
//!
//! See also `docs/design/README.md#where-lmcache-rc-differs-from-the-reference`.
//!
//! * **Recency is batched.** A successful [`find`](Directory::find) stamps the
//!   winner with a fresh `access_order` in memory only. Dirty stamps are
//!   written in one transaction when [`DirectoryConfig::recency_flush_updates`]
//!   of them accumulated, when the oldest is older than
//!   [`DirectoryConfig::recency_flush_interval`] (checked on every call and by a
//!   background thread in file mode), inside every publication transaction
//!   (so LRU victims are always chosen by the latest recency), by
//!   [`flush_recency`](Directory::flush_recency), and at close/drop. After a
//!   crash recency is at most one batch stale; nothing else is lost.
//! * **No scans after open.** Lookups use an in-memory accelerator (see
//!   `lookup.rs`: per-bucket stored tail lengths plus tail-hash fingerprints,
//!   every candidate confirmed by exact comparison against the stored row read
//!   by rowid). Capacity is enforced from in-memory counts; victims are read
//!   from the `checkpoints_access_order` index, lowest first, only as many as
//!   needed. Invalidate, retire and abort touch only their own rows. The
//!   accelerator costs about 100 bytes per published generation and is
//!   loaded at open from the small `checkpoint_tails` rows (about 0.3 s for
//!   100k generations).
//! * **Open-time checks.** A non-SQLite file or a format newer than this
//!   build is refused with [`Error::UnsupportedFormat`] before anything is
//!   written; reference files (schema 0 and 1) are reconciled and upgraded
//!   (see `schema.rs`).
//! * **Byte capacity.** [`DirectoryConfig::max_bytes`] bounds the sum of the
//!   published generations' payload bytes (all ranks), evicting by LRU like
//!   `max_entries`. The generation being published is never evicted, even
//!   when it alone exceeds the bound.
//! * **Invalid stored rows are skipped, not raised.** The reference raises
//!   from `find`/`get` when a stored row fails manifest validation. Here such
//!   a row (only possible through corruption or a foreign writer) is a clean
//!   miss: `find`, `get`, `ancestors` and `list` skip it, log a warning and
//!   count it in [`DirectoryStatus::invalid_rows`]. The row is not deleted
//!   behind the caller's back; it ages out through LRU eviction (reported in
//!   [`Publication::evicted`]) or an explicit invalidate/retire.
//! * **Durability flag.** [`mark_durable`](Directory::mark_durable) records, in
//!   batches, that every payload object of a generation reached disk (invariant
//!   I8 of `docs/design/README.md#invariants`, `docs/design/directory.md`);
//!   [`list`](Directory::list) reports it.
//! * **Publication never waits for an fsync** (the reference syncs every
//!   commit); durability is batched as above. Concurrent publications share
//!   transactions (see [`acknowledge`](Directory::acknowledge)).
//! * **Lookups take a [`TokenRoots`] directly** ([`find_roots`]) and read its
//!   roots in place; `find` borrows its `Prefix` queries. Nothing is copied.
//!
//! [`find_roots`]: Directory::find_roots
//! * After [`close`](Directory::close) every call fails with
//!   [`Error::Closed`] (close itself is idempotent).
//!
//! The on-disk format and its compatibility rules are in `schema.rs`.
//!
//! # Concurrency
//!
//! One mutex serialises every operation (the pending map, the accelerator and
//! the SQLite connection). Namespace checks and payload parsing happen before
//! it is taken. SQLite calls run under it; nothing else slow does — no fsync:
//! durable marks sync after releasing it, and a file-backed directory's
//! background thread checkpoints the log on its own connection and writes
//! due recency stamps. One `Directory` owns its file: opening the same file
//! twice (in one process or several) is not supported, because each instance
//! trusts its own in-memory accelerator and pending set.

mod durability;
mod lookup;
mod schema;

use std::borrow::Borrow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use crate::error::{Error, ErrorKind, Result};
use crate::identity::{Prefix, TokenRoots};
use crate::manifest::Manifest;

use durability::Syncer;
#[doc(hidden)]
pub use durability::set_fsync_hook;
use lookup::{Entry, Lookup, Map, bucket_fp, entry_fp};
pub use schema::{
    FORMAT_VERSION, TAIL_HASH_BASE, TAIL_HASH_MODULUS, tail_hash, tail_prefix_hashes, tail_text,
};
use schema::{
    OrDb, manifest_payload_bytes, parse_tail_text, tail_hash_step, tail_text_equals, value_bytes,
};

const MSG_CAPACITY: &str = "checkpoint directory capacities must be positive integers";
const MSG_DURING_STORE: &str = "checkpoint generation changed during store";
const MSG_AFTER_PUBLICATION: &str = "checkpoint generation changed after publication";
const MSG_RANK: &str = "checkpoint acknowledgement rank is out of range";
const MSG_MIXED: &str = "checkpoint lookup cannot mix namespaces";
const CLOSED: &str = "checkpoint directory";

/// Hot-path statements (each an index or rowid probe; a unit test checks the
/// query plans).
const SQL_ROW_BY_GENERATION: &str = "SELECT namespace, start_tokens, prefix_hash, tail, \
     generation, world_size, payload FROM checkpoints WHERE generation = ?1";
const SQL_ROW_BY_ROWID: &str = "SELECT namespace, start_tokens, prefix_hash, tail, \
     generation, world_size, payload FROM checkpoints WHERE rowid = ?1";
const SQL_ROWID_BY_GENERATION: &str = "SELECT rowid FROM checkpoints WHERE generation = ?1";
const SQL_ROW_BY_PREFIX: &str = "SELECT rowid, generation FROM checkpoints WHERE namespace = ?1 \
     AND start_tokens = ?2 AND prefix_hash = ?3 AND tail = ?4";
const SQL_GENERATIONS_OF_NAMESPACE: &str =
    "SELECT generation FROM checkpoints WHERE namespace = ?1 ORDER BY generation";
const SQL_DELETE_ROW: &str = "DELETE FROM checkpoints WHERE rowid = ?1";
const SQL_DELETE_TAIL: &str = "DELETE FROM checkpoint_tails WHERE generation = ?1";
const SQL_SET_DURABLE: &str = "UPDATE checkpoint_tails SET durable = ?2 WHERE generation = ?1";
const SQL_STAMP: &str = "UPDATE checkpoints SET access_order = ?2 WHERE rowid = ?1";
const SQL_LRU: &str = "SELECT rowid, generation FROM checkpoints ORDER BY access_order";
const SQL_INSERT_ROW: &str = "INSERT INTO checkpoints (namespace, start_tokens, prefix_hash, \
     tail, num_tokens, generation, world_size, payload, access_order) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)";
const SQL_INSERT_TAIL: &str = "INSERT OR REPLACE INTO checkpoint_tails (generation, namespace, \
     start_tokens, prefix_hash, tail_hash, tail_len, payload_bytes, durable) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 0)";
const SQL_LIST: &str = "SELECT c.namespace, c.start_tokens, c.prefix_hash, c.tail, \
     c.generation, c.world_size, c.payload, c.access_order, c.rowid, t.durable, \
     t.payload_bytes FROM checkpoints c LEFT JOIN checkpoint_tails t \
     ON t.generation = c.generation WHERE c.generation > ?1 ORDER BY c.generation LIMIT ?2";

/// Configuration of a [`Directory`].
#[derive(Debug, Clone)]
pub struct DirectoryConfig {
    /// Most published generations kept (LRU beyond). Default 65536.
    pub max_entries: u64,
    /// Most generations pending at once (`begin` returns false beyond). Default 128.
    pub max_pending: u64,
    /// Most payload bytes (all ranks) of published generations, or `None` for
    /// no byte bound. Default `None`.
    pub max_bytes: Option<u64>,
    /// Longest time a recency stamp stays only in memory. Default 1 s.
    pub recency_flush_interval: Duration,
    /// Number of dirty recency stamps that triggers a write. Default 1024.
    pub recency_flush_updates: usize,
    /// Test hook: maps every computed tail hash before it is stored or probed
    /// (e.g. `|_| 0` forces all hashes equal). Never set it on a file that a
    /// build without the same hook will open.
    #[doc(hidden)]
    pub tail_hash_hook: Option<fn(u64) -> u64>,
    /// Test hook: the name of a registered SQLite VFS that every connection
    /// of the directory opens its file through (crash-image tests record the
    /// writes and syncs with it, `tests_rs/crash_images.rs`). `None` = the
    /// default VFS.
    #[doc(hidden)]
    pub vfs: Option<String>,
}

impl Default for DirectoryConfig {
    fn default() -> Self {
        DirectoryConfig {
            max_entries: 65_536,
            max_pending: 128,
            max_bytes: None,
            recency_flush_interval: Duration::from_secs(1),
            recency_flush_updates: 1024,
            tail_hash_hook: None,
            vfs: None,
        }
    }
}

impl DirectoryConfig {
    fn validate(&self) -> Result<()> {
        if self.max_entries == 0 || self.max_pending == 0 || self.max_bytes == Some(0) {
            return Err(Error::invalid(MSG_CAPACITY));
        }
        if self.recency_flush_updates == 0 {
            return Err(Error::invalid(
                "checkpoint directory recency_flush_updates must be a positive integer",
            ));
        }
        Ok(())
    }
}

/// The result of [`Directory::acknowledge`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Publication {
    /// True for exactly the one acknowledgement that published the generation.
    pub published: bool,
    /// The generation that held the same exact prefix and was replaced.
    pub replaced: Option<String>,
    /// Generations removed by capacity (LRU), oldest first.
    pub evicted: Vec<String>,
}

/// Counters of a [`Directory`] (every value an integer).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DirectoryStatus {
    /// Published generations (rows).
    pub published_generations: u64,
    /// Pending generations (memory only).
    pub pending_generations: u64,
    /// Sum of the published generations' payload bytes (all ranks).
    pub published_bytes: u64,
    /// Published generations marked durable.
    pub durable_generations: u64,
    /// Recency stamps not yet written to the database.
    pub dirty_recency: u64,
    /// Generations evicted by capacity since open.
    pub evictions: u64,
    /// Reads of stored rows skipped since open because the row failed
    /// validation (counted per read, not per distinct row).
    pub invalid_rows: u64,
    /// Fsyncs of the write-ahead log run since open to make durable marks
    /// durable (one per group commit; 0 in memory).
    pub durability_fsyncs: u64,
    /// Transactions that published generations since open (fewer than the
    /// publications when concurrent ones shared transactions).
    pub publish_transactions: u64,
}

/// One published generation as listed by [`Directory::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedGeneration {
    /// The validated manifest.
    pub manifest: Manifest,
    /// Whether every payload object of it is known to be on disk.
    pub durable: bool,
    /// Payload bytes of all ranks (0 when the payload has no page groups).
    pub payload_bytes: u64,
    /// Recency stamp (larger = more recently published or found).
    pub access_order: i64,
}

/// One page of [`Directory::list`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListPage {
    /// Published generations ordered by generation id.
    pub generations: Vec<ListedGeneration>,
    /// Pass as `after` for the next page; `None` when this was the last page.
    pub next_after: Option<String>,
}

/// A fixed-size set of acknowledged ranks.
#[derive(Debug)]
struct RankSet {
    bits: Vec<u64>,
    count: u32,
}

impl RankSet {
    fn new(world_size: u32) -> Self {
        RankSet {
            bits: vec![0; (world_size as usize).div_ceil(64)],
            count: 0,
        }
    }
    fn insert(&mut self, rank: u32) {
        let (word, bit) = ((rank / 64) as usize, rank % 64);
        if let Some(w) = self.bits.get_mut(word)
            && *w & (1 << bit) == 0
        {
            *w |= 1 << bit;
            self.count += 1;
        }
    }
}

/// The accelerator as a publication transaction has changed it so far (it
/// changes for real only after the commit).
struct BatchTotals {
    /// Rows this transaction inserted.
    added: Map<i64, Entry>,
    /// Accelerator rows this transaction deleted.
    removed: Vec<i64>,
    count: u64,
    bytes: u64,
}

impl BatchTotals {
    fn new(lookup: &Lookup) -> Self {
        BatchTotals {
            added: Map::default(),
            removed: Vec::new(),
            count: lookup.len(),
            bytes: lookup.bytes(),
        }
    }

    /// The entry of a row that still exists in this transaction.
    fn entry(&self, lookup: &Lookup, rowid: i64) -> Option<Entry> {
        self.added
            .get(&rowid)
            .or_else(|| lookup.get(rowid))
            .copied()
    }

    fn add(&mut self, rowid: i64, entry: Entry) {
        self.count += 1;
        self.bytes = self.bytes.saturating_add(entry.payload_bytes);
        self.added.insert(rowid, entry);
    }

    /// Takes a row this transaction deleted out of the totals.
    fn gone(&mut self, lookup: &Lookup, rowid: i64) {
        let entry = self.added.remove(&rowid).or_else(|| {
            self.removed.push(rowid);
            lookup.get(rowid).copied()
        });
        if let Some(e) = entry {
            self.count -= 1;
            self.bytes = self.bytes.saturating_sub(e.payload_bytes);
        }
    }
}

/// One publication staged inside a batch transaction.
struct Staged<'a> {
    generation: &'a str,
    replaced: Option<(i64, String)>,
    victims: Vec<(i64, String)>,
}

/// A generation between `begin` and publication.
#[derive(Debug)]
struct Pending {
    manifest: Manifest,
    ranks: RankSet,
    seq: u64,
    started: Instant,
    tail_text: String,
    tail_hash: u64,
    payload_bytes: u64,
    /// Every rank acknowledged; waiting in [`Inner::ready`] for a publication
    /// transaction (a failed one clears it, so the next acknowledgement
    /// retries).
    queued: bool,
}

struct Inner {
    conn: Option<Connection>,
    config: DirectoryConfig,
    pending: HashMap<String, Pending>,
    /// Admission order of pending generations.
    admission: BTreeMap<u64, String>,
    next_seq: u64,
    lookup: Lookup,
    /// Last recency stamp handed out.
    counter: i64,
    /// rowid → stamp not yet written.
    dirty: Map<i64, i64>,
    dirty_since: Option<Instant>,
    evictions: u64,
    invalid_rows: u64,
    publish_transactions: u64,
    /// Why the file is open read-only (a full disk), if it is.
    read_only: Option<String>,
    /// The file's directory id (None in memory).
    instance_id: Option<String>,
    /// Numbers write commits and makes them durable (file mode only).
    syncer: Option<Arc<Syncer>>,
    background: Arc<Background>,
    /// Completed generations waiting for a publication transaction, with the
    /// ticket their acknowledgement waits on (see [`Directory::acknowledge`]).
    ready: Vec<(u64, String)>,
    next_ticket: u64,
    /// An acknowledgement is running publication transactions.
    publishing: bool,
    /// Outcomes for waiting acknowledgements, by ticket.
    outcomes: Map<u64, Result<Publication>>,
}

/// Commits between checkpoints asked of the background thread (a publication
/// appends about 8 pages to the write-ahead log, so about 8 MiB).
const CHECKPOINT_COMMITS: u64 = 256;
/// Longest time committed frames wait for a background checkpoint.
const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(250);

/// Log frames past which a commit cuts the write-ahead log back itself
/// (32 MiB at 4 KiB pages; background checkpoints that keep up leave about
/// 2,000).
const WAL_BOUND_FRAMES: i64 = 8_192;

/// Signals to the background thread (file mode), and what it shares with
/// the committing connection.
#[derive(Default)]
struct Background {
    state: Mutex<BackgroundState>,
    wake: Condvar,
    /// Frames in the write-ahead log after the latest commit (SQLite's WAL
    /// hook on the main connection sets it).
    log_frames: Arc<AtomicI64>,
    /// Held while a checkpoint runs: SQLite lets one run at a time and
    /// answers busy at once (no busy handler) to a second.
    checkpoint_turn: Mutex<()>,
}

#[derive(Default)]
struct BackgroundState {
    stop: bool,
    checkpoint: bool,
}

impl Background {
    fn ask_checkpoint(&self) {
        self.state.lock().checkpoint = true;
        self.wake.notify_one();
    }
}

struct Shared {
    inner: Mutex<Inner>,
    background: Arc<Background>,
    /// Signals [`Inner::outcomes`] (and close) to waiting acknowledgements.
    published: Condvar,
}

/// The checkpoint directory. Thread-safe: share it (e.g. in an `Arc`) and call
/// from any thread. See the module docs for semantics.
pub struct Directory {
    shared: Arc<Shared>,
    flusher: Mutex<Option<JoinHandle<()>>>,
    path: Option<PathBuf>,
    syncer: Option<Arc<Syncer>>,
}

impl std::fmt::Debug for Directory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Directory")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// One query root, borrowed from a [`Prefix`] or cut from a [`TokenRoots`]
/// without copying its tokens (lookups never clone a query's tail).
#[derive(Debug, Clone, Copy)]
struct Query<'a> {
    namespace: &'a str,
    start_tokens: u64,
    prefix_hash: &'a [u8],
    tail: &'a [u32],
}

impl<'a> Query<'a> {
    fn of(p: &'a Prefix) -> Query<'a> {
        Query {
            namespace: p.namespace(),
            start_tokens: p.start_tokens(),
            prefix_hash: p.prefix_hash(),
            tail: p.tail_tokens(),
        }
    }

    /// Root `k` of `roots` for every chunk: the same prefixes as
    /// [`TokenRoots::roots`], borrowed.
    fn roots(roots: &'a TokenRoots) -> impl Iterator<Item = Query<'a>> {
        let chunk = roots.chunk_tokens() as usize;
        let tokens = roots.tokens();
        let chains = std::iter::once(roots.initial_chain()).chain(roots.end_hashes());
        chains
            .take(roots.num_roots())
            .enumerate()
            .map(move |(k, chain)| {
                let start = k * chunk;
                Query {
                    namespace: roots.namespace(),
                    start_tokens: start as u64,
                    prefix_hash: chain,
                    tail: &tokens[start..(start + chunk).min(tokens.len())],
                }
            })
    }

    fn namespace(&self) -> &'a str {
        self.namespace
    }
    fn start_tokens(&self) -> u64 {
        self.start_tokens
    }
    fn prefix_hash(&self) -> &'a [u8] {
        self.prefix_hash
    }
    fn tail_tokens(&self) -> &'a [u32] {
        self.tail
    }
    fn num_tokens(&self) -> u64 {
        self.start_tokens + self.tail.len() as u64
    }
}

fn check_one_namespace(queries: &[Query<'_>]) -> Result<()> {
    if let Some(first) = queries.first()
        && queries.iter().any(|q| q.namespace() != first.namespace())
    {
        return Err(Error::invalid(MSG_MIXED));
    }
    Ok(())
}

/// Opens the file for writing and reconciles its tables (the normal open).
fn open_writable(
    path: Option<&Path>,
    config: &DirectoryConfig,
) -> Result<(Connection, schema::Reconciled)> {
    let mut conn = schema::open_connection(path, config.vfs.as_deref())?;
    let report = schema::reconcile(&mut conn, config.tail_hash_hook, path.is_some())?;
    Ok((conn, report))
}

fn to_u32_len(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl Directory {
    /// Opens (or creates) a directory. `path = None` gives a private
    /// in-memory database, lost on close. A file is opened in WAL mode with
    /// `synchronous=NORMAL` (see the module docs for what is synced, and
    /// when); files of reference builds (schema 0 and 1) are
    /// reconciled and upgraded; newer or non-SQLite files are refused with
    /// [`Error::UnsupportedFormat`] and left untouched.
    pub fn open(path: Option<&Path>, config: DirectoryConfig) -> Result<Directory> {
        config.validate()?;
        let (mut conn, report, read_only) = match open_writable(path, &config) {
            Ok((conn, report)) => (conn, report, None),
            // A full disk: serve what is durable, read-only (writes wait
            // for `reopen_writable`).
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::Database | ErrorKind::Io | ErrorKind::OutOfSpace
                ) && path.is_some_and(schema::disk_full) =>
            {
                let p = path.unwrap_or(Path::new(""));
                let (conn, source) = schema::open_read_only(p, config.vfs.as_deref())?;
                let why = format!(
                    "the disk holding the checkpoint index {} is full ({e})",
                    p.display()
                );
                let from = match source {
                    schema::ReadOnlySource::File => "",
                    schema::ReadOnlySource::MemoryCopy => {
                        " (the commits its write-ahead log held are read from a merged copy \
                         in memory)"
                    }
                };
                log::warn!("{why}: the directory is open read-only until space returns{from}");
                (conn, schema::Reconciled::default(), Some(why))
            }
            Err(e) => return Err(e),
        };
        let instance_id = match path {
            Some(_) => schema::directory_id(&conn)?,
            None => None,
        };
        if report.dangling_tails + report.backfilled_tails + report.migrated_tails > 0 {
            // A migration can leave a large write-ahead log behind; fold it
            // into the database now rather than during the first publications.
            if path.is_some() {
                schema::checkpoint_wal(&conn)?;
            }
            log::info!(
                "checkpoint directory {}: reconciled lookup rows ({} dangling removed, \
                 {} back-filled, {} migrated)",
                schema::describe(path),
                report.dangling_tails,
                report.backfilled_tails,
                report.migrated_tails
            );
        }
        let mut lookup = Lookup::default();
        let counter = schema::load(&conn, |row| {
            let start = u64::try_from(row.start_tokens).unwrap_or(u64::MAX);
            let bucket = bucket_fp(&row.namespace, start, &row.prefix_hash);
            let tail_len = u32::try_from(row.tail_len).unwrap_or(0);
            lookup.insert(
                row.rowid,
                Entry {
                    bucket,
                    fp: entry_fp(bucket, tail_len, row.tail_hash as u64),
                    tail_len,
                    payload_bytes: u64::try_from(row.payload_bytes).unwrap_or(0),
                    durable: row.durable,
                },
            );
        })?;
        let interval = config.recency_flush_interval;
        let syncer = path.map(|p| Arc::new(Syncer::new(p)));
        // A read-only directory (full disk) starts its background thread
        // once it is writable again (`reopen_writable`).
        let checkpointer = match path {
            Some(p) if read_only.is_none() => {
                Some(schema::open_checkpointer(p, config.vfs.as_deref())?)
            }
            _ => None,
        };
        let background = Arc::new(Background::default());
        if path.is_some() {
            schema::count_log_frames(&mut conn, background.log_frames.clone())?;
        }
        let inner = Inner {
            conn: Some(conn),
            config,
            pending: HashMap::new(),
            admission: BTreeMap::new(),
            next_seq: 0,
            lookup,
            counter,
            dirty: Map::default(),
            dirty_since: None,
            evictions: 0,
            invalid_rows: 0,
            publish_transactions: 0,
            syncer: syncer.clone(),
            background: background.clone(),
            ready: Vec::new(),
            next_ticket: 0,
            publishing: false,
            outcomes: Map::default(),
            read_only,
            instance_id,
        };
        let shared = Arc::new(Shared {
            inner: Mutex::new(inner),
            background,
            published: Condvar::new(),
        });
        let flusher = match (checkpointer, &syncer) {
            (Some(checkpointer), Some(syncer)) => Some(start_background(
                &shared,
                interval,
                checkpointer,
                syncer.clone(),
            )?),
            _ => None,
        };
        Ok(Directory {
            shared,
            flusher: Mutex::new(flusher),
            path: path.map(Path::to_path_buf),
            syncer,
        })
    }

    /// The id of a durable directory (written at its creation, the same
    /// for its whole life; L2 directories are bound to it); None for an
    /// in-memory directory.
    pub fn instance_id(&self) -> Option<String> {
        self.shared.inner.lock().instance_id.clone()
    }

    /// Why the directory is read-only (it was opened on a full disk), or
    /// None when it is writable.
    pub fn read_only(&self) -> Option<String> {
        self.shared.inner.lock().read_only.clone()
    }

    /// Tries to reopen a read-only directory for writing (space returned);
    /// true when it is writable now and was not before. Recency stamps
    /// gathered meanwhile are written then.
    pub fn reopen_writable(&self) -> Result<bool> {
        let mut inner = self.shared.inner.lock();
        if inner.read_only.is_none() || inner.conn.is_none() {
            return Ok(false);
        }
        let Some(path) = self.path.as_deref() else {
            return Ok(false);
        };
        let (mut conn, _) = open_writable(Some(path), &inner.config)?;
        schema::count_log_frames(&mut conn, inner.background.log_frames.clone())?;
        let id = schema::directory_id(&conn)?;
        if let Some(old) = inner.conn.replace(conn) {
            let _ = old.close();
        }
        inner.read_only = None;
        inner.instance_id = id;
        if let Err(e) = inner.flush_recency() {
            log::warn!("checkpoint directory: recency flush failed (will retry): {e}");
        }
        let interval = inner.config.recency_flush_interval;
        let vfs = inner.config.vfs.clone();
        drop(inner);
        let mut flusher = self.flusher.lock();
        if flusher.is_none()
            && let Some(syncer) = &self.syncer
        {
            let checkpointer = schema::open_checkpointer(path, vfs.as_deref())?;
            *flusher = Some(start_background(
                &self.shared,
                interval,
                checkpointer,
                syncer.clone(),
            )?);
        }
        Ok(true)
    }

    /// The database file, or `None` for an in-memory directory.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Locks the state, refusing a closed directory; writes due recency stamps.
    fn lock(&self) -> Result<MutexGuard<'_, Inner>> {
        let mut inner = self.shared.inner.lock();
        if inner.conn.is_none() {
            return Err(Error::Closed(CLOSED));
        }
        inner.maybe_flush();
        Ok(inner)
    }

    /// Stages a generation. Returns true when the caller should store it;
    /// false when it is already pending or published with identical content,
    /// or when `max_pending` generations are pending. A different manifest
    /// under a pending or published generation id is a
    /// [`Error::GenerationConflict`].
    pub fn begin(&self, manifest: &Manifest) -> Result<bool> {
        // Everything derived from the manifest is computed before locking.
        let tail = tail_text(manifest.prefix().tail_tokens());
        let hash = tail_hash(manifest.prefix().tail_tokens());
        let payload_bytes = manifest_payload_bytes(manifest);
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        if let Some(why) = &inner.read_only {
            return Err(Error::OutOfSpace(format!(
                "{why}: the directory is read-only, so nothing can be published until space \
                 returns"
            )));
        }
        if let Some(p) = inner.pending.get(manifest.generation()) {
            return if p.manifest == *manifest {
                Ok(false)
            } else {
                Err(Error::GenerationConflict(MSG_DURING_STORE.into()))
            };
        }
        match inner.published_equals(manifest, &tail)? {
            Some(true) => return Ok(false),
            Some(false) => return Err(Error::GenerationConflict(MSG_AFTER_PUBLICATION.into())),
            None => {}
        }
        if inner.pending.len() as u64 >= inner.config.max_pending {
            return Ok(false);
        }
        let seq = inner.next_seq;
        inner.next_seq += 1;
        inner
            .admission
            .insert(seq, manifest.generation().to_owned());
        let tail_hash = inner.config.tail_hash_hook.map_or(hash, |f| f(hash));
        inner.pending.insert(
            manifest.generation().to_owned(),
            Pending {
                manifest: manifest.clone(),
                ranks: RankSet::new(manifest.world_size()),
                seq,
                started: Instant::now(),
                tail_text: tail,
                tail_hash,
                payload_bytes,
                queued: false,
            },
        );
        Ok(true)
    }

    /// Records that `rank` committed all its pages of a pending generation.
    /// When the distinct acknowledged ranks reach the world size, publishes
    /// atomically (see the module docs) and returns `published = true` with
    /// the replaced and evicted generations. Unknown, aborted, already
    /// published or being-published generations give `published = false`
    /// without checking the rank; a rank outside `0..world_size` of a pending
    /// generation is [`Error::InvalidInput`]. If the database fails, nothing
    /// is published and the generation stays pending with its ranks.
    ///
    /// Concurrent publications share transactions: the acknowledgement that
    /// completes a generation while another one is publishing queues it and
    /// waits; the publishing one then publishes everything queued in one
    /// transaction, in queue order, each exactly as if it had its own (a later
    /// one may replace or evict an earlier one), and hands out the results.
    /// If such a shared transaction fails, its generations are retried one
    /// transaction each, so a failure is charged only to its own generation.
    pub fn acknowledge(&self, generation: &str, rank: u32) -> Result<Publication> {
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        let Some(p) = inner.pending.get_mut(generation) else {
            return Ok(Publication::default());
        };
        if p.queued {
            return Ok(Publication::default());
        }
        if rank >= p.manifest.world_size() {
            return Err(Error::invalid(MSG_RANK));
        }
        p.ranks.insert(rank);
        if p.ranks.count < p.manifest.world_size() {
            return Ok(Publication::default());
        }
        p.queued = true;
        let ticket = inner.next_ticket;
        inner.next_ticket += 1;
        inner.ready.push((ticket, generation.to_owned()));
        // Wait while another acknowledgement publishes; it takes ours too.
        while guard.publishing {
            self.shared.published.wait(&mut guard);
            if let Some(outcome) = guard.outcomes.remove(&ticket) {
                return outcome;
            }
            if guard.conn.is_none() {
                return Err(Error::Closed(CLOSED));
            }
        }
        if let Some(outcome) = guard.outcomes.remove(&ticket) {
            return outcome;
        }
        // Publish everything queued, in rounds, until nothing is left.
        guard.publishing = true;
        let mut mine = None;
        loop {
            let batch = std::mem::take(&mut guard.ready);
            if batch.is_empty() {
                break;
            }
            let names: Vec<&str> = batch.iter().map(|(_, g)| g.as_str()).collect();
            let outcomes = guard.publish_all(&names);
            for ((t, _), outcome) in batch.iter().zip(outcomes) {
                if *t == ticket {
                    mine = Some(outcome);
                } else {
                    guard.outcomes.insert(*t, outcome);
                }
            }
            self.shared.published.notify_all();
            // Let the acknowledgements that queued up behind this transaction
            // in, so the next round takes them all at once.
            MutexGuard::bump(&mut guard);
        }
        guard.publishing = false;
        // Woken waiters find their outcome or, if the leader role is free,
        // lead the next round themselves.
        self.shared.published.notify_all();
        mine.unwrap_or_else(|| Ok(Publication::default()))
    }

    /// True iff this exact manifest is pending; a different manifest pending
    /// under the same generation id is a [`Error::GenerationConflict`].
    pub fn is_pending(&self, manifest: &Manifest) -> Result<bool> {
        let inner = self.lock()?;
        match inner.pending.get(manifest.generation()) {
            None => Ok(false),
            Some(p) if p.manifest == *manifest => Ok(true),
            Some(_) => Err(Error::GenerationConflict(MSG_DURING_STORE.into())),
        }
    }

    /// Number of pending generations.
    pub fn pending_count(&self) -> Result<u64> {
        Ok(self.lock()?.pending.len() as u64)
    }

    /// Drops a pending generation; true if it was pending. Published rows are
    /// never touched.
    pub fn abort(&self, generation: &str) -> Result<bool> {
        let mut inner = self.lock()?;
        Ok(inner.drop_pending(generation))
    }

    /// Drops every pending generation that began strictly more than
    /// `older_than` ago (monotonic clock) and returns them in admission order.
    pub fn abort_stale(&self, older_than: Duration) -> Result<Vec<String>> {
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        let Some(cutoff) = Instant::now().checked_sub(older_than) else {
            return Ok(Vec::new());
        };
        let mut stale = Vec::new();
        // Admission order is start order, so the stale ones form a prefix.
        for generation in inner.admission.values() {
            match inner.pending.get(generation) {
                Some(p) if p.started < cutoff => stale.push(generation.clone()),
                Some(_) => break,
                None => {}
            }
        }
        for generation in &stale {
            inner.drop_pending(generation);
        }
        Ok(stale)
    }

    /// Removes one published generation (both tables, one transaction). Scoped
    /// to that generation: its replacement for the same prefix is untouched.
    /// False when it is not published. A pending entry with the same id stays.
    pub fn invalidate(&self, generation: &str) -> Result<bool> {
        let removed = self.retire(&[generation.to_owned()])?;
        Ok(!removed.is_empty())
    }

    /// Removes several published generations in one transaction; returns the
    /// ones that were published (each once, in input order).
    pub fn retire(&self, generations: &[String]) -> Result<Vec<String>> {
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        // Look the rows up first: nothing to remove needs no write transaction.
        let mut seen = std::collections::HashSet::new();
        let mut removed: Vec<(i64, &String)> = Vec::new();
        {
            let conn = inner.conn()?;
            for generation in generations {
                if seen.insert(generation.as_str())
                    && let Some(rowid) = rowid_of(conn, generation)?
                {
                    removed.push((rowid, generation));
                }
            }
        }
        if removed.is_empty() {
            return Ok(Vec::new());
        }
        let conn = inner.conn_mut()?;
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .db()?;
        for (rowid, generation) in &removed {
            delete_row(&tx, *rowid, generation)?;
        }
        tx.commit().db()?;
        inner.committed();
        Ok(removed
            .into_iter()
            .map(|(rowid, generation)| {
                inner.forget(rowid);
                generation.clone()
            })
            .collect())
    }

    /// The published generations of one namespace, ordered by id (the
    /// primary key's leading column: an index range, never a scan).
    /// Recency is not touched.
    pub fn generations_of_namespace(&self, namespace: &str) -> Result<Vec<String>> {
        let guard = self.lock()?;
        let conn = guard.conn()?;
        let mut stmt = conn.prepare_cached(SQL_GENERATIONS_OF_NAMESPACE).db()?;
        let rows = stmt
            .query_map(params![namespace], |row| row.get::<_, String>(0))
            .db()?;
        rows.map(|r| r.db()).collect()
    }

    /// The published manifest of a generation, without touching recency.
    pub fn get(&self, generation: &str) -> Result<Option<Manifest>> {
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        let row = {
            let conn = inner.conn()?;
            let mut stmt = conn.prepare_cached(SQL_ROW_BY_GENERATION).db()?;
            stmt.query_row(params![generation], StoredRow::read)
                .optional()
                .db()?
        };
        Ok(row.and_then(|r| inner.validated(r)))
    }

    /// The published manifest with the longest exact token prefix of any of
    /// `queries` (never longer than the query it matched), or `None`. All
    /// queries must share one namespace ([`Error::InvalidInput`] otherwise).
    /// Refreshes the winner's recency (batched, see the module docs). The
    /// answer is a candidate: the caller must still retrieve every page.
    /// Takes `&[Prefix]` or `&[&Prefix]`; nothing is copied.
    pub fn find<P: Borrow<Prefix>>(&self, queries: &[P]) -> Result<Option<Manifest>> {
        let queries: Vec<Query<'_>> = queries.iter().map(|p| Query::of(p.borrow())).collect();
        check_one_namespace(&queries)?;
        self.find_queries(queries)
    }

    /// [`find`](Directory::find) over every root of a token sequence
    /// (`roots.roots()`), reading the roots in place: no prefix is built.
    pub fn find_roots(&self, roots: &TokenRoots) -> Result<Option<Manifest>> {
        self.find_queries(Query::roots(roots).collect())
    }

    fn find_queries(&self, mut order: Vec<Query<'_>>) -> Result<Option<Manifest>> {
        // Longest first (stable: equal lengths keep their order).
        order.sort_by_key(|q| std::cmp::Reverse(q.num_tokens()));
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        let mut best: Option<(u64, Manifest, i64)> = None;
        let mut found = Vec::with_capacity(1);
        for q in &order {
            let best_tokens = best.as_ref().map_or(0, |b| b.0);
            if q.num_tokens() <= best_tokens {
                break;
            }
            // Only stored tails that would beat the best match so far.
            let min_len = best_tokens
                .saturating_sub(q.start_tokens())
                .saturating_add(1);
            let min_len = u32::try_from(min_len).unwrap_or(u32::MAX);
            found.clear();
            inner.probe(q, min_len, true, &mut found)?;
            if let Some((m, rowid)) = found.pop() {
                best = Some((m.prefix().num_tokens(), m, rowid));
            }
        }
        let Some((_, manifest, rowid)) = best else {
            return Ok(None);
        };
        inner.touch(rowid);
        inner.maybe_flush();
        Ok(Some(manifest))
    }

    /// Every published manifest that is a whole-token prefix of one of
    /// `queries` and has fewer than `below_tokens` tokens, sorted by token
    /// count (stable: query order, then length). Recency is not touched.
    pub fn ancestors<P: Borrow<Prefix>>(
        &self,
        queries: &[P],
        below_tokens: u64,
    ) -> Result<Vec<Manifest>> {
        let queries: Vec<Query<'_>> = queries.iter().map(|p| Query::of(p.borrow())).collect();
        check_one_namespace(&queries)?;
        self.ancestors_of(&queries, below_tokens)
    }

    /// [`ancestors`](Directory::ancestors) over every root of a token
    /// sequence, reading the roots in place.
    pub fn ancestors_roots(&self, roots: &TokenRoots, below_tokens: u64) -> Result<Vec<Manifest>> {
        let queries: Vec<Query<'_>> = Query::roots(roots).collect();
        self.ancestors_of(&queries, below_tokens)
    }

    fn ancestors_of(&self, queries: &[Query<'_>], below_tokens: u64) -> Result<Vec<Manifest>> {
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        let mut all = Vec::new();
        let mut found = Vec::new();
        for q in queries {
            if q.start_tokens() >= below_tokens {
                continue;
            }
            found.clear();
            inner.probe_bounded(q, 1, below_tokens - q.start_tokens() - 1, false, &mut found)?;
            found.reverse(); // probe yields longest first
            all.extend(found.drain(..).map(|(m, _)| m));
        }
        all.sort_by_key(|m| m.prefix().num_tokens());
        Ok(all)
    }

    /// Marks published generations durable: every payload object of each is on
    /// disk (invariant I8 of `docs/design/README.md#invariants`,
    /// `docs/design/directory.md`). One transaction for the whole batch;
    /// returns, per input, whether that generation is published (and so now
    /// marked).
    ///
    /// On return the marks are on disk (file mode): the transaction commits
    /// without an fsync under the directory lock, then one fsync of the
    /// write-ahead log, shared with every concurrent caller, runs outside it
    /// (group commit, see `durability.rs`); that fsync also makes every
    /// earlier publication durable. Callers mark what became durable since
    /// their last call in one call (the L2 pump does, once per round).
    pub fn mark_durable<S: AsRef<str>>(&self, generations: &[S]) -> Result<Vec<bool>> {
        let (seq, published) = {
            let mut guard = self.lock()?;
            let inner = &mut *guard;
            let mut published = vec![false; generations.len()];
            let mut changes: Vec<(i64, &str)> = Vec::new();
            {
                let conn = inner.conn()?;
                for (i, generation) in generations.iter().enumerate() {
                    let generation = generation.as_ref();
                    let Some(rowid) = rowid_of(conn, generation)? else {
                        continue;
                    };
                    published[i] = true;
                    let marked = inner.lookup.get(rowid).is_none_or(|e| e.durable);
                    if !marked && !changes.iter().any(|&(r, _)| r == rowid) {
                        changes.push((rowid, generation));
                    }
                }
            }
            if !changes.is_empty() {
                inner.write_durable(&changes, true)?;
            }
            // Wait for every commit so far: a generation already marked may
            // have been marked by a commit whose fsync is still running.
            let seq = inner.syncer.as_ref().map_or(0, |s| s.latest());
            (seq, published)
        };
        if let Some(syncer) = &self.syncer {
            syncer.sync_through(seq)?;
        }
        Ok(published)
    }

    /// Makes every commit so far durable (one fsync of the write-ahead log,
    /// shared as in [`Directory::mark_durable`]; the first also syncs the
    /// directory holding the file). Nothing to do for an in-memory
    /// directory. The service calls it before it writes the directory's id
    /// into an L2 binding: the id is committed at the first open without an
    /// fsync, and a binding that outlived the id it names (a power cut in
    /// between) would refuse the restart.
    pub fn sync(&self) -> Result<()> {
        if let Some(syncer) = &self.syncer {
            // Commits made while opening were not numbered: number one now
            // so the fsync below covers them.
            let seq = syncer.committed();
            syncer.sync_through(seq)?;
        }
        Ok(())
    }

    /// Marks one published generation durable ([`mark_durable`] of one,
    /// synced) or not durable (committed without an fsync: a lost clearing
    /// only leaves the flag set on an object set that restart reconciliation
    /// verifies anyway). False when the generation is not published.
    ///
    /// [`mark_durable`]: Directory::mark_durable
    pub fn set_durable(&self, generation: &str, durable: bool) -> Result<bool> {
        if durable {
            return Ok(self.mark_durable(&[generation])?[0]);
        }
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        let Some(rowid) = rowid_of(inner.conn()?, generation)? else {
            return Ok(false);
        };
        inner.write_durable(&[(rowid, generation)], false)?;
        Ok(true)
    }

    /// Lists published generations ordered by generation id, at most `limit`
    /// per page, starting after `after` (exclusive). Rows that fail
    /// validation are skipped. Recency is not touched.
    pub fn list(&self, after: Option<&str>, limit: usize) -> Result<ListPage> {
        if limit == 0 {
            return Err(Error::invalid(
                "checkpoint directory list limit must be a positive integer",
            ));
        }
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        let mut rows = Vec::new();
        {
            let conn = inner.conn()?;
            let mut stmt = conn.prepare_cached(SQL_LIST).db()?;
            let limit_sql = i64::try_from(limit).unwrap_or(i64::MAX);
            let mut q = stmt.query(params![after.unwrap_or(""), limit_sql]).db()?;
            while let Some(row) = q.next().db()? {
                let stored = StoredRow::read(row).db()?;
                let access_order: i64 = row.get(7).db()?;
                let rowid: i64 = row.get(8).db()?;
                let durable = row.get::<_, Option<i64>>(9).db()?.unwrap_or(0) != 0;
                let bytes = row.get::<_, Option<i64>>(10).db()?.unwrap_or(0);
                rows.push((stored, access_order, rowid, durable, bytes));
            }
        }
        let next_after = if rows.len() == limit {
            rows.last().map(|r| r.0.generation.clone())
        } else {
            None
        };
        let mut generations = Vec::with_capacity(rows.len());
        for (stored, access_order, rowid, durable, bytes) in rows {
            let access_order = inner.dirty.get(&rowid).copied().unwrap_or(access_order);
            if let Some(manifest) = inner.validated(stored) {
                generations.push(ListedGeneration {
                    manifest,
                    durable,
                    payload_bytes: u64::try_from(bytes).unwrap_or(0),
                    access_order,
                });
            }
        }
        Ok(ListPage {
            generations,
            next_after,
        })
    }

    /// Counters (see [`DirectoryStatus`]).
    pub fn status(&self) -> Result<DirectoryStatus> {
        let inner = self.lock()?;
        Ok(DirectoryStatus {
            published_generations: inner.lookup.len(),
            pending_generations: inner.pending.len() as u64,
            published_bytes: inner.lookup.bytes(),
            durable_generations: inner.lookup.durable(),
            dirty_recency: inner.dirty.len() as u64,
            evictions: inner.evictions,
            invalid_rows: inner.invalid_rows,
            durability_fsyncs: self.syncer.as_ref().map_or(0, |s| s.fsyncs()),
            publish_transactions: inner.publish_transactions,
        })
    }

    /// Writes every dirty recency stamp now; returns how many were written.
    pub fn flush_recency(&self) -> Result<usize> {
        self.lock()?.flush_recency()
    }

    /// Writes dirty recency stamps, drops pending generations and closes the
    /// database. Later calls fail with [`Error::Closed`]; closing twice is a
    /// no-op. The connection is closed even when the final flush fails (that
    /// error is returned).
    pub fn close(&self) -> Result<()> {
        let result = self.shared.inner.lock().shutdown();
        self.shared.published.notify_all();
        self.stop_flusher();
        result
    }

    fn stop_flusher(&self) {
        self.shared.background.state.lock().stop = true;
        self.shared.background.wake.notify_all();
        if let Some(handle) = self.flusher.lock().take() {
            let _ = handle.join();
        }
    }
}

impl Drop for Directory {
    fn drop(&mut self) {
        if let Err(e) = self.shared.inner.lock().shutdown() {
            log::warn!("checkpoint directory: closing on drop failed: {e}");
        }
        self.shared.published.notify_all();
        self.stop_flusher();
    }
}

/// The background thread of a file-backed directory, until it closes:
///
/// * checkpoints the write-ahead log on its own connection, so that neither
///   the copy into the database file nor its two fsyncs ever run under the
///   directory lock (publications never wait for them): when asked (every
///   [`CHECKPOINT_COMMITS`] commits) and every [`CHECKPOINT_INTERVAL`] while
///   commits arrive. A passive checkpoint waits for nobody; frames it cannot
///   copy yet wait for the next one (a commit cuts the log back itself past
///   [`WAL_BOUND_FRAMES`], see [`Inner::bound_log`]);
/// * writes due recency stamps every `interval`.
///
/// Its connection closes last, so SQLite folds the log into the database and
/// removes it at close.
/// Starts the background thread of a file directory (recency flushes,
/// passive checkpoints, durable-flag syncs).
fn start_background(
    shared: &Arc<Shared>,
    interval: Duration,
    checkpointer: Connection,
    syncer: Arc<Syncer>,
) -> Result<JoinHandle<()>> {
    let weak = Arc::downgrade(shared);
    std::thread::Builder::new()
        .name("lmcache-rc-directory".into())
        .spawn(move || run_background(weak, interval, checkpointer, syncer))
        .map_err(|e| Error::io("start the directory's background thread", e))
}

fn run_background(
    shared: Weak<Shared>,
    interval: Duration,
    checkpointer: Connection,
    syncer: Arc<Syncer>,
) {
    let interval = interval.max(Duration::from_millis(10));
    let tick = interval.min(CHECKPOINT_INTERVAL);
    let mut checkpointed = syncer.latest();
    let mut last_flush = Instant::now();
    loop {
        let Some(s) = shared.upgrade() else { return };
        {
            let mut state = s.background.state.lock();
            if state.stop {
                return;
            }
            if !state.checkpoint {
                s.background.wake.wait_for(&mut state, tick);
            }
            if state.stop {
                return;
            }
            state.checkpoint = false;
        }
        let latest = syncer.latest();
        if latest != checkpointed {
            let turn = s.background.checkpoint_turn.lock();
            let done = schema::checkpoint_passive(&checkpointer);
            drop(turn);
            if let Err(e) = done {
                log::warn!("checkpoint directory: background checkpoint failed (will retry): {e}");
            }
            checkpointed = latest;
        }
        if last_flush.elapsed() >= interval {
            last_flush = Instant::now();
            let mut inner = s.inner.lock();
            if inner.conn.is_none() {
                return;
            }
            if !inner.dirty.is_empty()
                && let Err(e) = inner.flush_recency()
            {
                log::warn!("checkpoint directory: recency flush failed (will retry): {e}");
            }
        }
    }
}

/// A `checkpoints` row as read back.
struct StoredRow {
    namespace: Vec<u8>,
    start_tokens: i64,
    prefix_hash: Vec<u8>,
    tail: Vec<u8>,
    generation: String,
    world_size: i64,
    payload: Vec<u8>,
}

impl StoredRow {
    /// Reads columns 0..=6 in the order namespace, start_tokens, prefix_hash,
    /// tail, generation, world_size, payload.
    fn read(row: &rusqlite::Row<'_>) -> rusqlite::Result<StoredRow> {
        let bytes = |i: usize| -> rusqlite::Result<Vec<u8>> {
            Ok(value_bytes(row.get_ref(i)?).unwrap_or_default().to_vec())
        };
        Ok(StoredRow {
            namespace: bytes(0)?,
            start_tokens: row.get(1)?,
            prefix_hash: bytes(2)?,
            tail: bytes(3)?,
            generation: String::from_utf8_lossy(&bytes(4)?).into_owned(),
            world_size: row.get(5)?,
            payload: bytes(6)?,
        })
    }

    /// Rebuilds and re-validates the manifest.
    fn manifest(self) -> Result<Manifest> {
        let bad = |what: &str| Error::invalid(format!("stored checkpoint row has {what}"));
        let namespace =
            String::from_utf8(self.namespace).map_err(|_| bad("a non-UTF-8 namespace"))?;
        let start = u64::try_from(self.start_tokens).map_err(|_| bad("a negative start"))?;
        let tail = parse_tail_text(&self.tail).ok_or_else(|| bad("an unreadable tail"))?;
        let world = u32::try_from(self.world_size).map_err(|_| bad("an invalid world size"))?;
        let prefix = Prefix::new(namespace, start, self.prefix_hash, tail)?;
        Manifest::new(self.generation, prefix, world, self.payload)
    }
}

fn rowid_of(conn: &Connection, generation: &str) -> Result<Option<i64>> {
    conn.prepare_cached(SQL_ROWID_BY_GENERATION)
        .db()?
        .query_row(params![generation], |r| r.get(0))
        .optional()
        .db()
}

fn delete_row(conn: &Connection, rowid: i64, generation: &str) -> Result<()> {
    conn.prepare_cached(SQL_DELETE_ROW)
        .db()?
        .execute(params![rowid])
        .db()?;
    conn.prepare_cached(SQL_DELETE_TAIL)
        .db()?
        .execute(params![generation])
        .db()?;
    Ok(())
}

fn write_stamps(conn: &Connection, dirty: &Map<i64, i64>) -> Result<()> {
    let mut stmt = conn.prepare_cached(SQL_STAMP).db()?;
    for (rowid, stamp) in dirty {
        stmt.execute(params![rowid, stamp]).db()?;
    }
    Ok(())
}

/// Reads a candidate row and checks that it is exactly `candidate` (a prefix
/// of `q`'s tail) in `q`'s bucket; returns its generation, world size and
/// payload.
fn confirm(
    conn: &Connection,
    rowid: i64,
    q: &Query<'_>,
    candidate: &[u32],
) -> Result<Option<(String, i64, Vec<u8>)>> {
    let mut stmt = conn.prepare_cached(SQL_ROW_BY_ROWID).db()?;
    stmt.query_row(params![rowid], |row| {
        let same = |i: usize, want: &[u8]| -> rusqlite::Result<bool> {
            Ok(value_bytes(row.get_ref(i)?) == Some(want))
        };
        let exact = same(0, q.namespace().as_bytes())?
            && row.get::<_, i64>(1)? as u64 == q.start_tokens()
            && same(2, q.prefix_hash())?
            && value_bytes(row.get_ref(3)?).is_some_and(|t| tail_text_equals(t, candidate));
        if !exact {
            return Ok(None);
        }
        Ok(Some((
            String::from_utf8_lossy(value_bytes(row.get_ref(4)?).unwrap_or_default()).into_owned(),
            row.get::<_, i64>(5)?,
            value_bytes(row.get_ref(6)?).unwrap_or_default().to_vec(),
        )))
    })
    .optional()
    .db()
    .map(Option::flatten)
}

/// Builds and re-validates the manifest of a confirmed row; on failure
/// returns the generation with the reason.
fn row_manifest(
    q: &Query<'_>,
    candidate: &[u32],
    generation: String,
    world_size: i64,
    payload: Vec<u8>,
) -> std::result::Result<Manifest, (String, Error)> {
    let world = match u32::try_from(world_size) {
        Ok(w) => w,
        Err(_) => {
            let e = Error::invalid("stored checkpoint row has an invalid world size");
            return Err((generation, e));
        }
    };
    let prefix = Prefix::new(
        q.namespace(),
        q.start_tokens(),
        q.prefix_hash().to_vec(),
        candidate.to_vec(),
    )
    .map_err(|e| (generation.clone(), e))?;
    Manifest::new(generation.clone(), prefix, world, payload).map_err(|e| (generation, e))
}

impl Inner {
    /// Numbers a write transaction that just committed (see `durability.rs`)
    /// and asks for a background checkpoint every [`CHECKPOINT_COMMITS`].
    fn committed(&self) -> u64 {
        let Some(syncer) = &self.syncer else { return 0 };
        let seq = syncer.committed();
        if seq % CHECKPOINT_COMMITS == 0 {
            self.background.ask_checkpoint();
        }
        self.bound_log();
        seq
    }

    /// Cuts the write-ahead log back (copies it all into the database and
    /// truncates it) once it holds more than [`WAL_BOUND_FRAMES`].
    ///
    /// Background checkpoints are passive: they never wait for writers, so
    /// while commits arrive faster than a checkpoint copies and syncs (a slow
    /// disk) each one ends behind the log's end, SQLite never restarts the
    /// log, and it would grow without limit. The caller holds the directory
    /// lock, so no write or read of this process runs meanwhile; the turn
    /// waits for a background checkpoint in progress. Publications wait for
    /// this one copy instead; nothing is lost (SQLite syncs the database
    /// before it cuts the log).
    fn bound_log(&self) {
        let frames = self.background.log_frames.load(Ordering::Relaxed);
        if frames <= WAL_BOUND_FRAMES {
            return;
        }
        let Some(conn) = &self.conn else { return };
        let _turn = self.background.checkpoint_turn.lock();
        match schema::checkpoint_wal(conn) {
            Ok(false) => {
                log::warn!("checkpoint directory: a log of {frames} frames could not be cut back");
            }
            Ok(true) => {
                self.background.log_frames.store(0, Ordering::Relaxed);
                log::debug!("checkpoint directory: cut a log of {frames} frames back");
            }
            Err(e) => log::warn!(
                "checkpoint directory: cutting a log of {frames} frames back failed \
                 (will retry): {e}"
            ),
        }
    }

    fn conn(&self) -> Result<&Connection> {
        self.conn.as_ref().ok_or(Error::Closed(CLOSED))
    }

    fn conn_mut(&mut self) -> Result<&mut Connection> {
        self.conn.as_mut().ok_or(Error::Closed(CLOSED))
    }

    /// Validates a stored row; a failing row is logged, counted and skipped.
    fn validated(&mut self, row: StoredRow) -> Option<Manifest> {
        let generation = row.generation.clone();
        match row.manifest() {
            Ok(m) => Some(m),
            Err(e) => {
                self.invalid_rows += 1;
                log::warn!("checkpoint directory: skipping stored generation {generation:?}: {e}");
                None
            }
        }
    }

    /// Whether `manifest`'s generation is published: `Some(true)` with
    /// identical content, `Some(false)` with different content.
    fn published_equals(&self, manifest: &Manifest, tail: &str) -> Result<Option<bool>> {
        let conn = self.conn()?;
        let mut stmt = conn.prepare_cached(SQL_ROW_BY_GENERATION).db()?;
        let p = manifest.prefix();
        stmt.query_row(params![manifest.generation()], |row| {
            let same_bytes = |i: usize, expected: &[u8]| -> rusqlite::Result<bool> {
                Ok(value_bytes(row.get_ref(i)?) == Some(expected))
            };
            Ok(same_bytes(0, p.namespace().as_bytes())?
                && row.get::<_, i64>(1)? as u64 == p.start_tokens()
                && same_bytes(2, p.prefix_hash())?
                && same_bytes(3, tail.as_bytes())?
                && row.get::<_, i64>(5)? == i64::from(manifest.world_size())
                && same_bytes(6, manifest.payload())?)
        })
        .optional()
        .db()
    }

    fn drop_pending(&mut self, generation: &str) -> bool {
        match self.pending.remove(generation) {
            Some(p) => {
                self.admission.remove(&p.seq);
                true
            }
            None => false,
        }
    }

    /// Removes a deleted row from memory.
    fn forget(&mut self, rowid: i64) -> Option<Entry> {
        self.dirty.remove(&rowid);
        if self.dirty.is_empty() {
            self.dirty_since = None;
        }
        self.lookup.remove(rowid)
    }

    /// Probes stored tails of `q`'s bucket with lengths in
    /// `min_len..=len(q.tail)`, longest first.
    fn probe(
        &mut self,
        q: &Query<'_>,
        min_len: u32,
        first_only: bool,
        out: &mut Vec<(Manifest, i64)>,
    ) -> Result<()> {
        let max_len = to_u32_len(q.tail_tokens().len()) as u64;
        self.probe_bounded(q, min_len, max_len, first_only, out)
    }

    /// Like [`Inner::probe`] with an explicit upper length bound.
    fn probe_bounded(
        &mut self,
        q: &Query<'_>,
        min_len: u32,
        max_len: u64,
        first_only: bool,
        out: &mut Vec<(Manifest, i64)>,
    ) -> Result<()> {
        let tail = q.tail_tokens();
        let max_len = to_u32_len(tail.len()).min(u32::try_from(max_len).unwrap_or(u32::MAX));
        let bucket = bucket_fp(q.namespace().as_bytes(), q.start_tokens(), q.prefix_hash());
        let lengths: Vec<u32> = self
            .lookup
            .lengths(bucket, min_len.max(1), max_len)
            .iter()
            .map(|&(l, _)| l)
            .collect();
        if lengths.is_empty() {
            return Ok(());
        }
        // Tail hashes at exactly the stored lengths, computed in one pass.
        let hook = self.config.tail_hash_hook;
        let mut hashes = Vec::with_capacity(lengths.len());
        let (mut h, mut pos) = (0u64, 0usize);
        for &len in &lengths {
            let len = len as usize;
            h = tail[pos..len].iter().fold(h, |h, &t| tail_hash_step(h, t));
            pos = len;
            hashes.push(hook.map_or(h, |f| f(h)));
        }
        let conn = self.conn.as_ref().ok_or(Error::Closed(CLOSED))?;
        for (&len, &hash) in lengths.iter().zip(&hashes).rev() {
            let candidate = &tail[..len as usize];
            for &rowid in self.lookup.rows(entry_fp(bucket, len, hash)) {
                let Some((generation, world_size, payload)) = confirm(conn, rowid, q, candidate)?
                else {
                    continue;
                };
                match row_manifest(q, candidate, generation, world_size, payload) {
                    Ok(m) => out.push((m, rowid)),
                    Err((generation, e)) => {
                        self.invalid_rows += 1;
                        log::warn!(
                            "checkpoint directory: skipping stored generation {generation:?}: {e}"
                        );
                        continue;
                    }
                }
                if first_only {
                    return Ok(());
                }
                break; // one row per exact prefix
            }
        }
        Ok(())
    }

    /// Publishes queued generations: all in one transaction, or, if that
    /// fails, one transaction each (so a failure is charged only to its own
    /// generation). One outcome per input, in order.
    fn publish_all(&mut self, batch: &[&str]) -> Vec<Result<Publication>> {
        match self.publish_batch(batch) {
            Ok(done) => done.into_iter().map(Ok).collect(),
            Err(e) if batch.len() == 1 => {
                self.unqueue(batch[0]);
                vec![Err(e)]
            }
            Err(_) => batch
                .iter()
                .map(|&g| {
                    self.publish_batch(&[g])
                        .map(|mut one| one.pop().unwrap_or_default())
                        .inspect_err(|_| self.unqueue(g))
                })
                .collect(),
        }
    }

    /// A failed publication leaves its generation pending with its ranks.
    fn unqueue(&mut self, generation: &str) {
        if let Some(p) = self.pending.get_mut(generation) {
            p.queued = false;
        }
    }

    /// Publishes queued generations, in order, in one transaction, each as
    /// if it had its own: remove the previous generation of the same exact
    /// prefix, insert the `checkpoints` and `checkpoint_tails` rows, delete
    /// capacity victims (a later generation of the batch may replace or evict
    /// an earlier one); recency stamps are written first. Memory changes only
    /// after the commit. A generation no longer queued (aborted meanwhile)
    /// gets `published = false`. On error nothing is published.
    fn publish_batch(&mut self, batch: &[&str]) -> Result<Vec<Publication>> {
        let max_entries = self.config.max_entries;
        let max_bytes = self.config.max_bytes;
        let over = |count: u64, bytes: u64| {
            count > max_entries || max_bytes.is_some_and(|limit| bytes > limit)
        };
        let conn = self.conn.as_mut().ok_or(Error::Closed(CLOSED))?;
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .db()?;
        write_stamps(&tx, &self.dirty)?;
        let mut totals = BatchTotals::new(&self.lookup);
        let mut stamp = self.counter;
        let mut staged: Vec<Option<Staged>> = Vec::with_capacity(batch.len());
        for &generation in batch {
            let Some(p) = self.pending.get(generation).filter(|p| p.queued) else {
                staged.push(None);
                continue;
            };
            let m = &p.manifest;
            let prefix = m.prefix();
            let bucket = bucket_fp(
                prefix.namespace().as_bytes(),
                prefix.start_tokens(),
                prefix.prefix_hash(),
            );
            let tail_len = to_u32_len(prefix.tail_tokens().len());
            let entry = Entry {
                bucket,
                fp: entry_fp(bucket, tail_len, p.tail_hash),
                tail_len,
                payload_bytes: p.payload_bytes,
                durable: false,
            };
            stamp += 1;
            // Every stored row with this exact prefix has this fingerprint
            // (same bucket, length and tail hash), so without a candidate
            // there is nothing to replace and no need to probe.
            let may_replace = !self.lookup.rows(entry.fp).is_empty()
                || totals.added.values().any(|e| e.fp == entry.fp);
            let tail_blob = p.tail_text.as_bytes();
            let start = i64::try_from(prefix.start_tokens()).map_err(|_| {
                Error::invalid("checkpoint prefix start_tokens exceeds the wire limits")
            })?;
            let replaced: Option<(i64, String)> = if may_replace {
                tx.prepare_cached(SQL_ROW_BY_PREFIX)
                    .db()?
                    .query_row(
                        params![prefix.namespace(), start, prefix.prefix_hash(), tail_blob],
                        |r| Ok((r.get(0)?, r.get(1)?)),
                    )
                    .optional()
                    .db()?
            } else {
                None
            };
            if let Some((rowid, old)) = &replaced {
                delete_row(&tx, *rowid, old)?;
                totals.gone(&self.lookup, *rowid);
            }
            let num_tokens = i64::try_from(prefix.num_tokens())
                .map_err(|_| Error::invalid("checkpoint prefix exceeds the wire limits"))?;
            tx.prepare_cached(SQL_INSERT_ROW)
                .db()?
                .execute(params![
                    prefix.namespace(),
                    start,
                    prefix.prefix_hash(),
                    tail_blob,
                    num_tokens,
                    generation,
                    m.world_size(),
                    m.payload(),
                    stamp
                ])
                .db()?;
            let rowid = tx.last_insert_rowid();
            tx.prepare_cached(SQL_INSERT_TAIL)
                .db()?
                .execute(params![
                    generation,
                    prefix.namespace(),
                    start,
                    prefix.prefix_hash(),
                    p.tail_hash as i64,
                    tail_len,
                    i64::try_from(p.payload_bytes).unwrap_or(i64::MAX)
                ])
                .db()?;
            // Capacity, from the running totals (with the row just inserted);
            // victims lowest access_order first, never that row.
            let (mut left, mut left_bytes) = (
                totals.count + 1,
                totals.bytes.saturating_add(p.payload_bytes),
            );
            let mut victims: Vec<(i64, String)> = Vec::new();
            if over(left, left_bytes) {
                let mut stmt = tx.prepare_cached(SQL_LRU).db()?;
                let mut rows = stmt.query([]).db()?;
                while over(left, left_bytes) {
                    let Some(row) = rows.next().db()? else { break };
                    let victim: i64 = row.get(0).db()?;
                    if victim == rowid {
                        continue;
                    }
                    if let Some(e) = totals.entry(&self.lookup, victim) {
                        left -= 1;
                        left_bytes = left_bytes.saturating_sub(e.payload_bytes);
                    }
                    victims.push((victim, row.get(1).db()?));
                }
            }
            for (victim, old) in &victims {
                delete_row(&tx, *victim, old)?;
                totals.gone(&self.lookup, *victim);
            }
            totals.add(rowid, entry);
            staged.push(Some(Staged {
                generation,
                replaced,
                victims,
            }));
        }
        tx.commit().db()?;
        self.committed();
        self.publish_transactions += 1;

        // Committed: now change memory (deletions first: a rowid freed by a
        // deletion may have been reused by an insertion).
        self.counter = stamp;
        self.dirty.clear();
        self.dirty_since = None;
        for rowid in totals.removed {
            self.forget(rowid);
        }
        for (rowid, entry) in totals.added {
            self.lookup.insert(rowid, entry);
        }
        Ok(staged
            .into_iter()
            .map(|s| match s {
                None => Publication::default(),
                Some(s) => {
                    self.evictions += s.victims.len() as u64;
                    self.drop_pending(s.generation);
                    Publication {
                        published: true,
                        replaced: s.replaced.map(|(_, g)| g),
                        evicted: s.victims.into_iter().map(|(_, g)| g).collect(),
                    }
                }
            })
            .collect())
    }

    /// Hands out a fresh recency stamp to a found row (memory only).
    fn touch(&mut self, rowid: i64) {
        self.counter += 1;
        self.dirty.insert(rowid, self.counter);
        self.dirty_since.get_or_insert_with(Instant::now);
    }

    /// Writes dirty stamps when a batch is full or the oldest is due.
    fn maybe_flush(&mut self) {
        if self.read_only.is_some() {
            return; // kept until the directory is writable again
        }
        let due = match self.dirty_since {
            None => false,
            Some(since) => {
                self.dirty.len() >= self.config.recency_flush_updates
                    || since.elapsed() >= self.config.recency_flush_interval
            }
        };
        if due && let Err(e) = self.flush_recency() {
            log::warn!("checkpoint directory: recency flush failed (will retry): {e}");
        }
    }

    /// Sets the durable flag of rows in one transaction, then in memory.
    fn write_durable(&mut self, rows: &[(i64, &str)], durable: bool) -> Result<()> {
        let conn = self.conn.as_mut().ok_or(Error::Closed(CLOSED))?;
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .db()?;
        {
            let mut stmt = tx.prepare_cached(SQL_SET_DURABLE).db()?;
            for (_, generation) in rows {
                stmt.execute(params![generation, i64::from(durable)]).db()?;
            }
        }
        tx.commit().db()?;
        self.committed();
        for (rowid, _) in rows {
            self.lookup.set_durable(*rowid, durable);
        }
        Ok(())
    }

    /// Writes every dirty stamp in one transaction.
    fn flush_recency(&mut self) -> Result<usize> {
        if self.dirty.is_empty() || self.read_only.is_some() {
            self.dirty_since = None;
            return Ok(0);
        }
        let conn = self.conn.as_mut().ok_or(Error::Closed(CLOSED))?;
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .db()?;
        write_stamps(&tx, &self.dirty)?;
        tx.commit().db()?;
        self.committed();
        let n = self.dirty.len();
        self.dirty.clear();
        self.dirty_since = None;
        Ok(n)
    }

    /// Flushes recency, drops pending state and closes the connection.
    fn shutdown(&mut self) -> Result<()> {
        if self.conn.is_none() {
            return Ok(());
        }
        let flushed = self.flush_recency();
        self.pending.clear();
        self.admission.clear();
        self.dirty.clear();
        self.dirty_since = None;
        let closed = match self.conn.take() {
            Some(conn) => conn.close().map_err(|(_, e)| schema::db_error(e)),
            None => Ok(()),
        };
        flushed.map(|_| ())?;
        closed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn directory_is_send_and_sync() {
        assert_send_sync::<Directory>();
    }

    /// Every hot-path statement is an index or rowid probe: no full scan.
    #[test]
    fn hot_path_statements_never_scan_a_table() {
        let dir = Directory::open(None, DirectoryConfig::default()).unwrap();
        let inner = dir.shared.inner.lock();
        let conn = inner.conn().unwrap();
        for (sql, allowed_scan) in [
            (SQL_ROW_BY_GENERATION, None),
            (SQL_ROW_BY_ROWID, None),
            (SQL_ROWID_BY_GENERATION, None),
            (SQL_ROW_BY_PREFIX, None),
            (SQL_DELETE_ROW, None),
            (SQL_DELETE_TAIL, None),
            (SQL_SET_DURABLE, None),
            (SQL_STAMP, None),
            (SQL_INSERT_ROW, None),
            (SQL_INSERT_TAIL, None),
            // Walked lowest-first through the recency index, stopped early.
            (SQL_LRU, Some("checkpoints_access_order")),
            // Paged through the generation index (a range search).
            (SQL_LIST, None),
        ] {
            let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
            let mut details: Vec<String> = Vec::new();
            let mut rows = stmt.raw_query(); // parameters unbound: NULL
            while let Some(r) = rows.next().unwrap() {
                details.push(r.get(3).unwrap());
            }
            for d in &details {
                if d.starts_with("SCAN") {
                    let ok = allowed_scan.is_some_and(|index| d.contains(index));
                    assert!(ok, "{sql}: plan step {d:?} scans ({details:?})");
                }
                assert!(!d.contains("TEMP B-TREE"), "{sql}: sorts ({details:?})");
            }
        }
    }

    #[test]
    fn rank_set_counts_distinct_ranks() {
        let mut s = RankSet::new(130);
        for r in [0, 0, 129, 64, 129] {
            s.insert(r);
        }
        assert_eq!(s.count, 3);
    }
}
