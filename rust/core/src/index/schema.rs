//! The on-disk format of the directory: SQLite tables, the tail text and tail
//! hash helpers, and the open-time checks, migration and reconciliation.
//!
//! Tables (reference columns unchanged; see `docs/architecture.md` and
//! `docs/design/directory.md`):
//!
//! ```sql
//! CREATE TABLE checkpoints (
//!     namespace TEXT NOT NULL, start_tokens INTEGER NOT NULL,
//!     prefix_hash BLOB NOT NULL, tail BLOB NOT NULL, num_tokens INTEGER NOT NULL,
//!     generation TEXT UNIQUE NOT NULL, world_size INTEGER NOT NULL,
//!     payload BLOB NOT NULL, access_order INTEGER NOT NULL,
//!     PRIMARY KEY (namespace, start_tokens, prefix_hash, tail));
//! CREATE INDEX checkpoints_access_order ON checkpoints (access_order);
//! CREATE TABLE checkpoint_tails (
//!     generation TEXT PRIMARY KEY, namespace TEXT NOT NULL,
//!     start_tokens INTEGER NOT NULL, prefix_hash BLOB NOT NULL,
//!     tail_hash INTEGER NOT NULL,
//!     -- lmcache-rc additions (format 2):
//!     tail_len INTEGER, payload_bytes INTEGER NOT NULL DEFAULT 0,
//!     durable INTEGER NOT NULL DEFAULT 0);
//! CREATE INDEX checkpoint_tails_lookup
//!     ON checkpoint_tails (namespace, start_tokens, prefix_hash, tail_hash);
//! ```
//!
//! lmcache-rc's per-generation metadata (`tail_len`, `payload_bytes`,
//! `durable`) lives in `checkpoint_tails`, whose rows are small: loading it at
//! open never reads the large `tail`/`payload` blobs of `checkpoints`.
//!
//! Versions (`PRAGMA user_version`): 0 (new file, or a reference build that
//! never set it), 1 (reference v5/v6) and 2 (lmcache-rc) are opened and end at
//! 2; anything else is refused with [`Error::UnsupportedFormat`] before a
//! single byte is written. A reference build refuses version 2 in turn
//! ("unsupported checkpoint directory schema 2"), so it never writes rows
//! that lack the lmcache-rc columns.

use std::ffi::c_int;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use rusqlite::types::{Value, ValueRef};
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

use crate::error::{Error, Result};
use crate::manifest::{Manifest, PayloadSchema};

/// The directory format version this build writes (`PRAGMA user_version`).
pub const FORMAT_VERSION: i64 = 2;

/// Base of the polynomial tail hash.
pub const TAIL_HASH_BASE: u64 = 1_000_003;
/// Modulus of the polynomial tail hash (the Mersenne prime 2^61 − 1).
pub const TAIL_HASH_MODULUS: u64 = (1 << 61) - 1;

/// First bytes of every SQLite 3 database file.
const SQLITE_MAGIC: &[u8; 16] = b"SQLite format 3\0";

/// Maps rusqlite failures into [`Error::Database`].
pub(super) trait OrDb<T> {
    /// Converts the error, if any.
    fn db(self) -> Result<T>;
}

impl<T> OrDb<T> for rusqlite::Result<T> {
    fn db(self) -> Result<T> {
        self.map_err(db_error)
    }
}

/// A SQLite error as ours: `SQLITE_FULL` (the disk holding the index is
/// full) is [`Error::OutOfSpace`], so callers see the one typed error every
/// tier raises for a full disk; anything else is [`Error::Database`].
pub(super) fn db_error(e: rusqlite::Error) -> Error {
    if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull) {
        Error::OutOfSpace(format!("checkpoint directory: {e}"))
    } else {
        Error::Database(e.to_string())
    }
}

/// One step of the tail hash: `h · 1000003 + t + 1 (mod 2^61 − 1)`.
#[inline]
pub(super) fn tail_hash_step(h: u64, token: u32) -> u64 {
    let v = u128::from(h) * u128::from(TAIL_HASH_BASE) + u128::from(token) + 1;
    (v % u128::from(TAIL_HASH_MODULUS)) as u64
}

/// The polynomial hash of a whole tail, as stored in `checkpoint_tails.tail_hash`.
pub fn tail_hash(tokens: &[u32]) -> u64 {
    tokens.iter().fold(0, |h, &t| tail_hash_step(h, t))
}

/// Hashes of every prefix of `tokens` (`[h_1, ..., h_len]`).
pub fn tail_prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = 0;
    tokens
        .iter()
        .map(|&t| {
            h = tail_hash_step(h, t);
            h
        })
        .collect()
}

/// The stored tail text: a JSON array with Python's default separators,
/// e.g. `[1, 2, 3]` (stored as a BLOB of its UTF-8 bytes).
pub fn tail_text(tokens: &[u32]) -> String {
    let mut out = Vec::with_capacity(2 + tokens.len() * 9);
    out.push(b'[');
    for (i, &t) in tokens.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        push_decimal(&mut out, t);
    }
    out.push(b']');
    // Only ASCII digits, brackets, commas and spaces were written.
    String::from_utf8(out).unwrap_or_default()
}

/// Appends the decimal digits of `n`.
fn push_decimal(out: &mut Vec<u8>, mut n: u32) {
    let mut digits = [0u8; 10];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// True when `stored` is exactly [`tail_text`] of `tokens` (no allocation).
pub(super) fn tail_text_equals(stored: &[u8], tokens: &[u32]) -> bool {
    let mut rest = match stored.strip_prefix(b"[") {
        Some(r) => r,
        None => return false,
    };
    let mut digits = [0u8; 10];
    for (i, &t) in tokens.iter().enumerate() {
        if i > 0 {
            match rest.strip_prefix(b", ") {
                Some(r) => rest = r,
                None => return false,
            }
        }
        let mut n = t;
        let mut k = digits.len();
        loop {
            k -= 1;
            digits[k] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 {
                break;
            }
        }
        match rest.strip_prefix(&digits[k..]) {
            Some(r) => rest = r,
            None => return false,
        }
    }
    rest == b"]"
}

/// Parses a stored tail text (`[1, 2, 3]`; whitespace after commas optional).
/// `None` when the text is not an array of non-negative 32-bit integers.
pub(super) fn parse_tail_text(bytes: &[u8]) -> Option<Vec<u32>> {
    let text = std::str::from_utf8(bytes).ok()?.trim();
    let inner = text.strip_prefix('[')?.strip_suffix(']')?.trim();
    if inner.is_empty() {
        return Some(Vec::new());
    }
    inner
        .split(',')
        .map(|part| {
            let part = part.trim();
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            part.parse::<u32>().ok()
        })
        .collect()
}

/// Bytes of every rank's payload objects: `bytes_per_rank · world_size` when
/// the payload describes page groups, else 0.
pub(super) fn payload_bytes(world_size: u32, payload: &[u8]) -> u64 {
    match PayloadSchema::parse(payload) {
        Ok(schema) => schema
            .bytes_per_rank()
            .saturating_mul(u64::from(world_size)),
        Err(_) => 0,
    }
}

/// Bytes of a manifest's payload objects (see [`payload_bytes`]).
pub(super) fn manifest_payload_bytes(manifest: &Manifest) -> u64 {
    payload_bytes(manifest.world_size(), manifest.payload())
}

/// Reads a TEXT or BLOB column as bytes.
pub(super) fn value_bytes(value: ValueRef<'_>) -> Option<&[u8]> {
    match value {
        ValueRef::Blob(b) | ValueRef::Text(b) => Some(b),
        _ => None,
    }
}

/// Refuses an existing non-SQLite file without touching it.
/// Creates the missing directories above the database file, private (0700),
/// so a default location such as `~/.cache/lmcache-rc/checkpoints.sqlite`
/// works on a fresh machine. Existing directories are left as they are.
fn create_parent(path: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt as _;
    let Some(parent) = path.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return Ok(());
    };
    if parent.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(parent)
        .map_err(|e| {
            Error::io(
                format!(
                    "create the checkpoint directory's folder {}",
                    parent.display()
                ),
                e,
            )
        })
}

fn check_header(path: &Path) -> Result<()> {
    use std::io::Read as _;
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(format!("open {}", path.display()), e)),
    };
    let mut head = Vec::with_capacity(16);
    (&mut file)
        .take(16)
        .read_to_end(&mut head)
        .map_err(|e| Error::io(format!("read {}", path.display()), e))?;
    if head.is_empty() || head.as_slice() == SQLITE_MAGIC {
        return Ok(());
    }
    Err(Error::UnsupportedFormat(format!(
        "checkpoint directory {} is not a SQLite database (it was left untouched)",
        path.display()
    )))
}

/// Describes where the directory lives, for messages.
pub(super) fn describe(path: Option<&Path>) -> String {
    match path {
        Some(p) => p.display().to_string(),
        None => "(in memory)".to_string(),
    }
}

/// The setting that names the index file (messages).
const INDEX_FLAG: &str = "--checkpoint-index-path";

/// Refuses an index file (or its WAL/shared-memory/journal companions)
/// reached through a symbolic link or owned by another user, and creates a
/// missing database file with mode 0600 whatever the umask (SQLite gives its
/// companions the database file's mode). With `narrow`, existing files with
/// a wider mode are narrowed to 0600 (only once the file is known to be a
/// checkpoint directory).
fn private_files(path: &Path, narrow: bool) -> Result<()> {
    use crate::private::{Kind, check_owned, create_private_file};
    for suffix in ["-wal", "-shm", "-journal"] {
        let mut companion = path.as_os_str().to_owned();
        companion.push(suffix);
        check_owned(
            Path::new(&companion),
            Kind::File,
            "checkpoint index file",
            INDEX_FLAG,
            narrow,
        )?;
    }
    if narrow {
        return create_private_file(path, "checkpoint index", INDEX_FLAG);
    }
    if !check_owned(path, Kind::File, "checkpoint index", INDEX_FLAG, false)? {
        create_private_file(path, "checkpoint index", INDEX_FLAG)?;
    }
    Ok(())
}

/// Refuses a SQLite database that is not a checkpoint directory (another
/// application's file): it may be empty, or hold the `checkpoints` table
/// with its columns and no table lmcache-rc does not know. Reads only.
fn check_is_checkpoint_directory(conn: &Connection, name: &str) -> Result<()> {
    let mut tables = Vec::new();
    {
        let mut stmt = conn
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
            .db()?;
        let mut rows = stmt.query([]).db()?;
        while let Some(row) = rows.next().db()? {
            tables.push(row.get::<_, String>(0).db()?);
        }
    }
    let known = |t: &str| {
        matches!(t, "checkpoints" | "checkpoint_tails" | META_TABLE) || t.starts_with("sqlite_")
    };
    let foreign: Vec<&str> = tables
        .iter()
        .map(String::as_str)
        .filter(|t| !known(t))
        .collect();
    let not_ours = |why: String| {
        Error::UnsupportedFormat(format!(
            "{name} is not a checkpoint directory ({why}); it was left untouched: pass the \
             index of a sidecar, or a new file, to {INDEX_FLAG}"
        ))
    };
    if !foreign.is_empty() {
        return Err(not_ours(format!(
            "it holds tables lmcache-rc does not know: {}",
            foreign.join(", ")
        )));
    }
    if tables.iter().any(|t| !t.starts_with("sqlite_"))
        && !tables.iter().any(|t| t == "checkpoints")
    {
        return Err(not_ours("it has no checkpoints table".into()));
    }
    if tables.iter().any(|t| t == "checkpoints") {
        let mut columns = Vec::new();
        let mut stmt = conn.prepare("PRAGMA table_info(checkpoints)").db()?;
        let mut rows = stmt.query([]).db()?;
        while let Some(row) = rows.next().db()? {
            columns.push(row.get::<_, String>(1).db()?.to_ascii_lowercase());
        }
        let missing: Vec<&str> = CHECKPOINT_COLUMNS
            .iter()
            .copied()
            .filter(|c| !columns.iter().any(|have| have == c))
            .collect();
        if !missing.is_empty() {
            return Err(not_ours(format!(
                "its checkpoints table lacks the columns {}",
                missing.join(", ")
            )));
        }
    }
    Ok(())
}

/// Columns every checkpoint directory's `checkpoints` table has.
const CHECKPOINT_COLUMNS: [&str; 9] = [
    "namespace",
    "start_tokens",
    "prefix_hash",
    "tail",
    "num_tokens",
    "generation",
    "world_size",
    "payload",
    "access_order",
];

/// lmcache-rc's own metadata (the directory id L2 directories bind to).
const META_TABLE: &str = "lmcache_rc_meta";

/// Maps an open-time SQLite failure: "not a database" is a format error.
fn open_error(name: &str) -> impl Fn(rusqlite::Error) -> Error + '_ {
    move |e: rusqlite::Error| match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::NotADatabase) => Error::UnsupportedFormat(format!(
            "checkpoint directory {name} is not a SQLite database or is corrupt: {e}"
        )),
        Some(rusqlite::ErrorCode::DiskFull) => Error::OutOfSpace(format!("{name}: {e}")),
        _ => Error::Database(format!("{name}: {e}")),
    }
}

/// Reads the format version and refuses newer ones and foreign files.
fn check_version(conn: &Connection, name: &str) -> Result<i64> {
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(open_error(name))?;
    if !(0..=FORMAT_VERSION).contains(&version) {
        return Err(Error::UnsupportedFormat(format!(
            "unsupported checkpoint directory schema {version} in {name}: this build reads \
             versions 0..={FORMAT_VERSION} (the file was written by a newer lmcache-rc; \
             it was left untouched)"
        )));
    }
    check_is_checkpoint_directory(conn, name)?;
    Ok(version)
}

/// Size the write-ahead log file is cut back to when SQLite restarts it.
const JOURNAL_SIZE_LIMIT: u64 = 64 << 20;

/// Opens a read-write connection to the file `path` (created if absent),
/// through the SQLite VFS `vfs` when one is named (a test hook,
/// [`super::DirectoryConfig::vfs`]).
fn open_file(path: &Path, vfs: Option<&str>) -> rusqlite::Result<Connection> {
    match vfs {
        Some(vfs) => Connection::open_with_flags_and_vfs(path, rusqlite::OpenFlags::default(), vfs),
        None => Connection::open(path),
    }
}

/// Opens the connection, refuses unknown formats and foreign files, and
/// sets the journal.
pub(super) fn open_connection(path: Option<&Path>, vfs: Option<&str>) -> Result<Connection> {
    let name = describe(path);
    let conn = match path {
        Some(p) => {
            create_parent(p)?;
            check_header(p)?;
            private_files(p, false)?;
            open_file(p, vfs).map_err(|e| Error::Database(format!("cannot open {name}: {e}")))?
        }
        None => Connection::open_in_memory().db()?,
    };
    let not_db = open_error(&name);
    check_version(&conn, &name)?;
    if let Some(p) = path {
        private_files(p, true)?;
    }
    if path.is_some() {
        let mode: String = conn
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .map_err(&not_db)?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(Error::Database(format!(
                "{name}: cannot switch to WAL journal (got {mode})"
            )));
        }
    }
    // NORMAL: a commit appends to the write-ahead log without an fsync; the
    // operations that promise durability sync the log themselves, in group
    // commits (`durability.rs`). Checkpoints still sync (log before copying,
    // database after); they run on the background thread's own connection,
    // and this one cuts the log back only past a bound, for a background
    // thread that cannot keep up (`count_log_frames`). The page cache (32 MiB
    // at most) keeps the index pages of a large directory in memory.
    conn.execute_batch(&format!(
        "PRAGMA synchronous=NORMAL; PRAGMA cache_size=-32768; \
         PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}"
    ))
    .map_err(&not_db)?;
    conn.busy_timeout(std::time::Duration::from_secs(10)).db()?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

const CREATE_TABLES: &str = "
CREATE TABLE IF NOT EXISTS checkpoints (
    namespace TEXT NOT NULL,
    start_tokens INTEGER NOT NULL,
    prefix_hash BLOB NOT NULL,
    tail BLOB NOT NULL,
    num_tokens INTEGER NOT NULL,
    generation TEXT UNIQUE NOT NULL,
    world_size INTEGER NOT NULL,
    payload BLOB NOT NULL,
    access_order INTEGER NOT NULL,
    PRIMARY KEY (namespace, start_tokens, prefix_hash, tail)
);
CREATE TABLE IF NOT EXISTS checkpoint_tails (
    generation TEXT PRIMARY KEY,
    namespace TEXT NOT NULL,
    start_tokens INTEGER NOT NULL,
    prefix_hash BLOB NOT NULL,
    tail_hash INTEGER NOT NULL,
    tail_len INTEGER,
    payload_bytes INTEGER NOT NULL DEFAULT 0,
    durable INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS lmcache_rc_meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
";

const CREATE_INDEXES: &str = "
CREATE INDEX IF NOT EXISTS checkpoints_access_order ON checkpoints (access_order);
CREATE INDEX IF NOT EXISTS checkpoint_tails_lookup
    ON checkpoint_tails (namespace, start_tokens, prefix_hash, tail_hash);
";

/// Columns lmcache-rc adds to a reference `checkpoint_tails` table.
const ADDED_TAIL_COLUMNS: [(&str, &str); 3] = [
    ("tail_len", "INTEGER"),
    ("payload_bytes", "INTEGER NOT NULL DEFAULT 0"),
    ("durable", "INTEGER NOT NULL DEFAULT 0"),
];

/// What reconciliation changed (logged at open).
#[derive(Debug, Default)]
pub(super) struct Reconciled {
    pub dangling_tails: usize,
    pub backfilled_tails: usize,
    pub migrated_tails: usize,
}

/// The hash stored for a tail, after the (test-only) hook.
pub(super) fn stored_hash(tokens: &[u32], hook: Option<fn(u64) -> u64>) -> u64 {
    let h = tail_hash(tokens);
    hook.map_or(h, |f| f(h))
}

/// Tail length, hash and payload bytes for a stored row; an unparseable tail
/// gets length 0 and hash 0, which no lookup ever probes (the row stays
/// counted and evictable, but is never found).
fn derived(
    tail: &[u8],
    world_size: i64,
    payload: &[u8],
    hook: Option<fn(u64) -> u64>,
) -> (i64, i64, i64) {
    let (len, hash) = match parse_tail_text(tail) {
        Some(tokens) if !tokens.is_empty() => {
            (tokens.len() as i64, stored_hash(&tokens, hook) as i64)
        }
        _ => (0, 0),
    };
    let world = u32::try_from(world_size).unwrap_or(0);
    let bytes = payload_bytes(world, payload).min(i64::MAX as u64) as i64;
    (len, hash, bytes)
}

/// Creates missing tables, columns and indexes, reconciles `checkpoint_tails`
/// with `checkpoints` and sets the format version, in one transaction.
/// `with_id`: a file's directory gets its id (see [`directory_id`]) here.
pub(super) fn reconcile(
    conn: &mut Connection,
    hook: Option<fn(u64) -> u64>,
    with_id: bool,
) -> Result<Reconciled> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .db()?;
    tx.execute_batch(CREATE_TABLES).db()?;
    let mut present = Vec::new();
    {
        let mut stmt = tx.prepare("PRAGMA table_info(checkpoint_tails)").db()?;
        let mut rows = stmt.query([]).db()?;
        while let Some(row) = rows.next().db()? {
            present.push(row.get::<_, String>(1).db()?);
        }
    }
    for (column, decl) in ADDED_TAIL_COLUMNS {
        if !present.iter().any(|c| c.eq_ignore_ascii_case(column)) {
            tx.execute_batch(&format!(
                "ALTER TABLE checkpoint_tails ADD COLUMN {column} {decl}"
            ))
            .db()?;
        }
    }
    let mut report = Reconciled {
        dangling_tails: tx
            .execute(
                "DELETE FROM checkpoint_tails WHERE generation NOT IN \
                 (SELECT generation FROM checkpoints)",
                [],
            )
            .db()?,
        ..Reconciled::default()
    };
    // Rows lacking a tail row (files of builds that knew only `checkpoints`).
    // Found through the covering generation index first, so the large rows
    // are read only when one actually lacks its tail row.
    let missing: Vec<i64> = {
        let mut select = tx
            .prepare(
                "SELECT c.rowid FROM checkpoints c WHERE NOT EXISTS \
                 (SELECT 1 FROM checkpoint_tails t WHERE t.generation = c.generation)",
            )
            .db()?;
        select
            .query_map([], |r| r.get(0))
            .db()?
            .collect::<rusqlite::Result<_>>()
            .db()?
    };
    if !missing.is_empty() {
        let mut select = tx
            .prepare(
                "SELECT generation, namespace, start_tokens, prefix_hash, tail, world_size, \
                 payload FROM checkpoints WHERE rowid = ?1",
            )
            .db()?;
        let mut insert = tx
            .prepare(
                "INSERT INTO checkpoint_tails (generation, namespace, start_tokens, prefix_hash, \
                 tail_hash, tail_len, payload_bytes, durable) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 0)",
            )
            .db()?;
        for rowid in missing {
            let mut rows = select.query(params![rowid]).db()?;
            let Some(row) = rows.next().db()? else {
                continue;
            };
            let tail = value_bytes(row.get_ref(4).db()?).unwrap_or_default();
            let payload = value_bytes(row.get_ref(6).db()?).unwrap_or_default();
            let (len, hash, bytes) = derived(tail, row.get(5).db()?, payload, hook);
            insert
                .execute(params![
                    row.get::<_, Value>(0).db()?,
                    row.get::<_, Value>(1).db()?,
                    row.get::<_, Value>(2).db()?,
                    row.get::<_, Value>(3).db()?,
                    hash,
                    len,
                    bytes
                ])
                .db()?;
            report.backfilled_tails += 1;
        }
    }
    // Tail rows written by the reference (no lmcache-rc columns yet).
    {
        let mut select = tx
            .prepare(
                "SELECT t.generation, c.tail, c.world_size, c.payload FROM checkpoint_tails t \
                 JOIN checkpoints c ON c.generation = t.generation WHERE t.tail_len IS NULL",
            )
            .db()?;
        let mut update = tx
            .prepare(
                "UPDATE checkpoint_tails SET tail_hash = ?2, tail_len = ?3, payload_bytes = ?4 \
                 WHERE generation = ?1",
            )
            .db()?;
        let mut rows = select.query([]).db()?;
        while let Some(row) = rows.next().db()? {
            let tail = value_bytes(row.get_ref(1).db()?).unwrap_or_default();
            let payload = value_bytes(row.get_ref(3).db()?).unwrap_or_default();
            let (len, hash, bytes) = derived(tail, row.get(2).db()?, payload, hook);
            update
                .execute(params![row.get::<_, Value>(0).db()?, hash, len, bytes])
                .db()?;
            report.migrated_tails += 1;
        }
    }
    tx.execute_batch(CREATE_INDEXES).db()?;
    if with_id {
        tx.execute(
            "INSERT OR IGNORE INTO lmcache_rc_meta (key, value) VALUES ('directory_id', ?1)",
            params![crate::private::random_id()?],
        )
        .db()?;
    }
    let version: i64 = tx.query_row("PRAGMA user_version", [], |r| r.get(0)).db()?;
    if version != FORMAT_VERSION {
        tx.execute_batch(&format!("PRAGMA user_version = {FORMAT_VERSION}"))
            .db()?;
    }
    tx.commit().db()?;
    Ok(report)
}

/// The directory's id (written when the file was created or first opened
/// by a build that knows ids); None when it has none.
pub(super) fn directory_id(conn: &Connection) -> Result<Option<String>> {
    let has_table: bool = conn
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
            params![META_TABLE],
            |r| r.get::<_, i64>(0),
        )
        .db()?
        > 0;
    if !has_table {
        return Ok(None);
    }
    conn.query_row(
        "SELECT value FROM lmcache_rc_meta WHERE key = 'directory_id'",
        [],
        |r| r.get(0),
    )
    .optional()
    .db()
}

/// Whether the filesystem holding `path` is full (less than 1 MiB free for
/// this user): then a failed open is retried read-only.
pub(super) fn disk_full(path: &Path) -> bool {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    match rustix::fs::statvfs(dir) {
        Ok(v) => v.f_bavail.saturating_mul(v.f_frsize.max(1)) < 1 << 20,
        Err(_) => false,
    }
}

/// A `file:` URI for `path` (query and fragment characters escaped).
fn file_uri(path: &Path, query: &str) -> Result<String> {
    use std::os::unix::ffi::OsStrExt;
    let absolute = std::path::absolute(path)
        .map_err(|e| Error::io(format!("resolve {}", path.display()), e))?;
    let mut uri = String::from("file:");
    for &b in absolute.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || b"/-._~".contains(&b) {
            uri.push(b as char);
        } else {
            uri.push_str(&format!("%{b:02X}"));
        }
    }
    uri.push('?');
    uri.push_str(query);
    Ok(uri)
}

/// Where [`open_read_only`] read the directory from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReadOnlySource {
    /// The database file alone (its write-ahead log was empty).
    File,
    /// A copy of the database file and its write-ahead log in memory
    /// (`/dev/shm`), the log merged there: the commits a killed sidecar left
    /// in the log are served although the full disk has no room to merge
    /// them (or to create the log's index) in place.
    MemoryCopy,
}

/// Opens an existing, current directory file read-only without writing a
/// byte next to it: for a disk too full to open it normally. An empty
/// write-ahead log (a clean stop merged it) is read from the database file
/// alone; a log with commits (a killed sidecar) is merged into a private copy
/// in memory and the copy is served (see [`ReadOnlySource::MemoryCopy`]). A
/// file that needs an upgrade, or a copy that does not fit in memory, is
/// refused with a message saying to free space.
pub(super) fn open_read_only(
    path: &Path,
    vfs: Option<&str>,
) -> Result<(Connection, ReadOnlySource)> {
    let name = describe(Some(path));
    check_header(path)?;
    private_files(path, false)?;
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    let wal = Path::new(&wal);
    let wal_bytes = std::fs::metadata(wal).map_or(0, |m| m.len());
    if wal_bytes == 0 {
        return Ok((open_immutable(path, &name, vfs)?, ReadOnlySource::File));
    }
    let copy = MemoryCopy::take(path, wal, &name, wal_bytes)?;
    {
        // Recovery and the merge run on the copy, in memory.
        let merge = Connection::open(&copy.db).map_err(|e| {
            Error::Database(format!("cannot open the in-memory copy of {name}: {e}"))
        })?;
        checkpoint_wal(&merge)?;
    }
    let conn = open_immutable(&copy.db, &name, None)?;
    // The connection holds the copy's file open: its name can go now, so
    // nothing is left behind in memory once the connection closes, whatever
    // ends the process.
    drop(copy);
    Ok((conn, ReadOnlySource::MemoryCopy))
}

/// A private directory under `/dev/shm` holding copies of an index file and
/// its write-ahead log (never the log's index); removed on drop.
struct MemoryCopy {
    dir: std::path::PathBuf,
    db: std::path::PathBuf,
}

impl MemoryCopy {
    fn take(path: &Path, wal: &Path, name: &str, wal_bytes: u64) -> Result<MemoryCopy> {
        use std::os::unix::fs::DirBuilderExt as _;
        let refuse = |why: String| {
            Error::OutOfSpace(format!(
                "the disk holding {name} is full and its write-ahead log holds {wal_bytes} bytes \
                 of commits not yet merged, which cannot be merged in memory either ({why}); \
                 free some space to start"
            ))
        };
        let shm = Path::new("/dev/shm");
        let db_bytes = std::fs::metadata(path).map_or(0, |m| m.len());
        // The copy, and room for the merge to grow the database by the log.
        let need = db_bytes
            .saturating_add(wal_bytes.saturating_mul(2))
            .saturating_add(1 << 20);
        let free = rustix::fs::statvfs(shm)
            .map(|v| v.f_bavail.saturating_mul(v.f_frsize.max(1)))
            .map_err(|e| refuse(format!("/dev/shm: {e}")))?;
        if free < need {
            return Err(refuse(format!(
                "/dev/shm has {free} bytes free, the copy needs {need}"
            )));
        }
        let mut salt = [0u8; 8];
        rustix::rand::getrandom(&mut salt, rustix::rand::GetRandomFlags::empty())
            .map_err(|e| refuse(format!("getrandom: {e}")))?;
        let dir = shm.join(format!(
            "lmcache-rc-index-{}-{}",
            std::process::id(),
            hex::encode(salt)
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| refuse(format!("create {}: {e}", dir.display())))?;
        let copy = MemoryCopy {
            db: dir.join("index.sqlite"),
            dir,
        };
        let mut wal_copy = copy.db.as_os_str().to_owned();
        wal_copy.push("-wal");
        std::fs::copy(path, &copy.db)
            .and_then(|_| std::fs::copy(wal, Path::new(&wal_copy)))
            .map_err(|e| refuse(format!("copy into {}: {e}", copy.dir.display())))?;
        Ok(copy)
    }
}

impl Drop for MemoryCopy {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            log::warn!(
                "checkpoint directory: removing the in-memory copy {} failed: {e}",
                self.dir.display()
            );
        }
    }
}

/// The read-only, immutable open of a current directory file (no lock, no
/// log, no byte written).
fn open_immutable(path: &Path, name: &str, vfs: Option<&str>) -> Result<Connection> {
    use rusqlite::OpenFlags;
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
        | OpenFlags::SQLITE_OPEN_URI
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let uri = file_uri(path, "mode=ro&immutable=1")?;
    let conn = match vfs {
        Some(vfs) => Connection::open_with_flags_and_vfs(uri, flags, vfs),
        None => Connection::open_with_flags(uri, flags),
    }
    .map_err(|e| Error::Database(format!("cannot open {name} read-only: {e}")))?;
    let version = check_version(&conn, name)?;
    let current: bool = conn
        .query_row(
            "SELECT count(*) FROM pragma_table_info('checkpoint_tails') WHERE name = 'durable'",
            [],
            |r| r.get::<_, i64>(0),
        )
        .db()?
        > 0;
    if version != FORMAT_VERSION || !current {
        return Err(Error::OutOfSpace(format!(
            "the disk holding {name} is full and the directory (schema {version}) needs an \
             upgrade before it can be served; free some space to start"
        )));
    }
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}

/// Opens the background thread's connection to a file already opened (and
/// so in WAL mode) by [`open_connection`]; it runs passive checkpoints only.
pub(super) fn open_checkpointer(path: &Path, vfs: Option<&str>) -> Result<Connection> {
    let name = describe(Some(path));
    let conn =
        open_file(path, vfs).map_err(|e| Error::Database(format!("cannot open {name}: {e}")))?;
    // Checkpoints sync the log before copying and the database after.
    conn.execute_batch("PRAGMA synchronous=NORMAL").db()?;
    conn.busy_timeout(std::time::Duration::from_secs(1)).db()?;
    Ok(conn)
}

/// Keeps `frames` equal to the frames in the write-ahead log after each
/// commit of `conn`. The hook replaces SQLite's automatic checkpoint: the
/// directory checkpoints on its background connection and cuts the log back
/// itself past a bound (`Inner::bound_log` in `mod.rs`).
pub(super) fn count_log_frames(conn: &mut Connection, frames: Arc<AtomicI64>) -> Result<()> {
    conn.wal_hook(Some(move |_: &mut rusqlite::hooks::Wal, pages: c_int| {
        frames.store(i64::from(pages), Ordering::Relaxed);
        Ok(())
    }))
    .db()
}

fn checkpoint(conn: &Connection, mode: &str) -> Result<bool> {
    conn.query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |r| {
        r.get::<_, i64>(0).map(|busy| busy == 0)
    })
    .db()
}

/// Copies as much of the write-ahead log into the database as it can
/// without waiting for readers or writers; true when it copied it all.
pub(super) fn checkpoint_passive(conn: &Connection) -> Result<bool> {
    checkpoint(conn, "PASSIVE")
}

/// Copies the write-ahead log into the database and truncates it (SQLite
/// syncs the database before it cuts the log, so no commit is lost); false
/// when something (another checkpoint, a writer or a reader of another
/// connection) kept it from finishing.
pub(super) fn checkpoint_wal(conn: &Connection) -> Result<bool> {
    checkpoint(conn, "TRUNCATE")
}

/// One row of the open-time load: everything the in-memory lookup needs.
pub(super) struct LoadedRow {
    pub rowid: i64,
    pub namespace: Vec<u8>,
    pub start_tokens: i64,
    pub prefix_hash: Vec<u8>,
    pub tail_hash: i64,
    pub tail_len: i64,
    pub payload_bytes: i64,
    pub durable: bool,
}

/// Reads every published generation's lookup metadata (small rows only:
/// `checkpoint_tails` joined to `checkpoints` through its generation index).
pub(super) fn load(conn: &Connection, mut each: impl FnMut(LoadedRow)) -> Result<i64> {
    let mut stmt = conn
        .prepare(
            "SELECT c.rowid, t.namespace, t.start_tokens, t.prefix_hash, t.tail_hash, \
             t.tail_len, t.payload_bytes, t.durable FROM checkpoint_tails t \
             JOIN checkpoints c ON c.generation = t.generation",
        )
        .db()?;
    let mut rows = stmt.query([]).db()?;
    while let Some(row) = rows.next().db()? {
        each(LoadedRow {
            rowid: row.get(0).db()?,
            namespace: value_bytes(row.get_ref(1).db()?)
                .unwrap_or_default()
                .to_vec(),
            start_tokens: row.get(2).db()?,
            prefix_hash: value_bytes(row.get_ref(3).db()?)
                .unwrap_or_default()
                .to_vec(),
            tail_hash: row.get(4).db()?,
            tail_len: row.get::<_, Option<i64>>(5).db()?.unwrap_or(0),
            payload_bytes: row.get(6).db()?,
            durable: row.get::<_, i64>(7).db()? != 0,
        });
    }
    let counter: Option<i64> = conn
        .query_row("SELECT max(access_order) FROM checkpoints", [], |r| {
            r.get(0)
        })
        .optional()
        .db()?
        .flatten();
    Ok(counter.unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_text_round_trips_and_compares_without_allocating() {
        for tokens in [
            &[7u32][..],
            &[1, 2, 3],
            &[0, 10, 2_147_483_647],
            &[4_294_967_295, 0],
        ] {
            let text = tail_text(tokens);
            assert_eq!(parse_tail_text(text.as_bytes()).as_deref(), Some(tokens));
            assert!(tail_text_equals(text.as_bytes(), tokens));
            assert!(!tail_text_equals(
                text.as_bytes(),
                &tokens[..tokens.len() - 1]
            ));
        }
        assert_eq!(tail_text(&[1, 2, 3]), "[1, 2, 3]");
        assert!(!tail_text_equals(b"[1, 2]", &[1, 20]));
        assert!(!tail_text_equals(b"[12]", &[1]));
        assert!(!tail_text_equals(b"[1,2]", &[1, 2]));
        assert!(!tail_text_equals(b"[1, 2] ", &[1, 2]));
        assert_eq!(parse_tail_text(b"[1,2]"), Some(vec![1, 2]));
        assert_eq!(parse_tail_text(b"[1, -2]"), None);
        assert_eq!(parse_tail_text(b"[1.5]"), None);
        assert_eq!(parse_tail_text(b"1, 2"), None);
    }
}
