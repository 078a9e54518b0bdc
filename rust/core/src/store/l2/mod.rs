//! The filesystem (L2) tier: one file per payload object, written durably,
//! verified on every read, inventoried at open.
//!
//! This module owns the object files under one root directory and the
//! accounting of the bytes they take. It does **not** decide what to keep:
//! eviction (LRU or otherwise), reference counts and the L1 copies belong to
//! the service, which calls [`L2Tier::write`], [`L2Tier::read`] and
//! [`L2Tier::remove`] off its lock, on an [`IoPool`]. It must never return
//! unverified bytes as a successful read, never rewrite an intact object
//! (invariant I6 of `docs/design/README.md#invariants`;
//! `docs/design/l2-format.md#write-order-l2tierwrite`) and never report a write
//! durable before the file and its directory entry are on stable storage
//! (invariant I8).
//!
//! # Directory layout
//!
//! ```text
//! <root>/objects/<aa>/<bb>/<key>.page   one object; <key> = 64 lowercase hex
//!                                       characters, <aa> and <bb> = its first
//!                                       two bytes in lowercase hex
//! <root>/tmp/<key>.<pid>-<seq>.tmp      a write in progress (deleted at open)
//! <root>/binding.json                   the index the objects belong to
//!                                       (see `binding.rs`)
//! ```
//!
//! Files are created with mode 0600, directories with mode 0700. The root,
//! `objects/` and `tmp/` must belong to this user and must not be symbolic
//! links (an existing one with a wider mode is narrowed to 0700).
//!
//! # Object file format, version 1
//!
//! A 64-byte header followed by the page bytes. Integers are little-endian.
//!
//! | Offset | Size | Field        | Value                                                |
//! |-------:|-----:|--------------|------------------------------------------------------|
//! | 0      | 8    | magic        | ASCII `LMRCPAGE` (`4c 4d 52 43 50 41 47 45`)         |
//! | 8      | 4    | version      | u32, `1`                                             |
//! | 12     | 4    | header_len   | u32, `64` (offset of the first page byte)            |
//! | 16     | 8    | page_bytes   | u64, length of the page bytes                        |
//! | 24     | 8    | checksum     | u64, xxh3-64 (seed 0) of the page bytes              |
//! | 32     | 32   | key          | the [`ObjectKey`]; equals the key in the file name   |
//! | 64     | page_bytes | page   | the page bytes                                       |
//!
//! The file is exactly `64 + page_bytes` bytes long. Every header field is
//! covered by a check: magic, version, header length and key are compared,
//! `page_bytes` against the file length (and the length the reader expects),
//! the checksum against the page bytes. A file with any other version (older
//! or newer) is never read as payload: reads fail with
//! [`Error::UnsupportedFormat`], the open scan lists it as unreadable, and it
//! is reclaimable. A future version keeps `magic` and `version` at offsets 0
//! and 8.
//!
//! # Durable write order
//!
//! 1. (first write into a bucket) create `objects/<aa>/<bb>` (all 256
//!    `objects/<aa>` directories are created, and `objects/` fsynced, at open;
//!    so are `objects/` and `tmp/`, with the root fsynced, and the root
//!    itself and any missing parent, each with its parent fsynced);
//! 2. create a unique temp file in `tmp/`, write header and page;
//! 3. fsync the temp file;
//! 4. (bucket created in step 1) fsync `objects/<aa>`;
//! 5. rename the temp file over `objects/<aa>/<bb>/<key>.page`;
//! 6. fsync `objects/<aa>/<bb>`.
//!
//! Only then does [`L2Tier::write`] return. A crash before step 5 leaves a
//! temp file, deleted at the next open; a crash between 5 and 6 leaves either
//! no object or a complete, fsynced one. A failed fsync (step 3, 4 or 6)
//! **poisons** the tier: the kernel may have dropped the dirty pages, so the
//! write cannot be retried safely (the fjall rule). A poisoned tier refuses
//! every later write with an [`Error::Io`] saying so, until it is reopened;
//! reads and removes still work. Other failures (no space, a failed rename)
//! delete the temp file and leave the tier usable.
//!
//! A write whose destination already holds an intact header for the same key,
//! length and checksum writes nothing and returns 0 (write once). Removes are
//! not fsynced: an object that reappears after a crash is an unreferenced
//! object, which the service reclaims.

mod binding;
mod format;
mod fs;
mod pool;
pub mod testing;

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};

use parking_lot::Mutex;

pub use self::binding::{BINDING_FILE, Binding, read_binding, write_binding};
pub use self::format::{
    FORMAT_VERSION, HEADER_BYTES, HeaderDefect, MAGIC, PageHeader, checksum, object_file_bytes,
};
pub use self::fs::{DirEntryInfo, EntryKind, Fs, ReadFile, RealFs, WriteFile};
pub use self::pool::{IoPool, Job};
use crate::error::{Error, Result};
use crate::store::ObjectKey;

/// File-name suffix of object files.
const OBJECT_SUFFIX: &str = ".page";
/// File-name suffix of temp files.
const TEMP_SUFFIX: &str = ".tmp";
/// At most this many threads read headers during the open scan.
const MAX_SCAN_THREADS: usize = 8;

/// Makes temp-file names unique within the process (the pid makes them
/// unique across processes).
static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// One intact object found by the open scan.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct InventoryEntry {
    /// The object's key.
    pub key: ObjectKey,
    /// Length of its page bytes.
    pub page_bytes: u64,
    /// Length of its file (header + page).
    pub file_bytes: u64,
}

/// What [`L2Tier::open`] found under `objects/`.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct Inventory {
    /// Objects with a valid name, header and length, sorted by key. Their
    /// payload checksums are not verified here (every read verifies).
    pub objects: Vec<InventoryEntry>,
    /// Files that are not readable objects of this format: a wrong name or
    /// place, bad magic, an unknown or older format version, a wrong length,
    /// a header naming another key, or a stray file. Never read as payload;
    /// pass them to [`L2Tier::reclaim_unreadable`] to delete them.
    pub unreadable: Vec<PathBuf>,
}

#[derive(Default)]
struct Accounting {
    /// key -> file bytes of every object this tier knows to be on disk.
    sizes: HashMap<ObjectKey, u64>,
    /// Sum of `sizes`.
    used: u64,
    /// Bytes of writes in flight (counted against the capacity).
    reserved: u64,
}

/// The filesystem tier. All methods take `&self`; writes, reads and removes
/// of different keys may run concurrently from several threads. Writes and
/// removes of the *same* key must be serialised by the caller. One tier per
/// root at a time: opening deletes every temp file under `<root>/tmp/`,
/// including those of a tier still writing there.
pub struct L2Tier {
    root: PathBuf,
    objects: PathBuf,
    tmp: PathBuf,
    capacity: Option<u64>,
    /// The filesystem's allocation unit: an object is charged its file
    /// length rounded up to it (what it takes on disk).
    unit: u64,
    fs: Arc<dyn Fs>,
    accounting: Mutex<Accounting>,
    /// Bucket (first two key bytes) -> state of its directory. A bucket
    /// created by a write is not durable until that write (or a concurrent
    /// one) fsynced its parents.
    buckets: Mutex<HashMap<u16, Bucket>>,
    /// Why the tier is poisoned, if it is.
    poison: Mutex<Option<String>>,
    bytes_written: AtomicU64,
}

impl std::fmt::Debug for L2Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("L2Tier")
            .field("root", &self.root)
            .field("capacity", &self.capacity)
            .field("objects", &self.object_count())
            .field("used_bytes", &self.used_bytes())
            .field("poisoned", &self.is_poisoned())
            .finish()
    }
}

/// The state of a bucket directory `objects/<aa>/<bb>` this tier has seen.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Bucket {
    /// Exists and its entry (and its parent's) are on stable storage.
    Durable,
    /// Created by a write whose parent fsyncs have not run yet;
    /// `aa_created`: `objects/<aa>` was created too.
    Pending { aa_created: bool },
}

/// The outcome of reading an object file's header.
enum HeaderRead {
    Missing,
    Defect(HeaderDefect),
    Valid(Box<dyn ReadFile>, PageHeader),
}

/// How a write failed: the error, and whether the object file was already
/// renamed into place (only a failed directory fsync leaves it there).
struct WriteFailure {
    error: Error,
    in_place: bool,
}

impl From<Error> for WriteFailure {
    fn from(error: Error) -> Self {
        WriteFailure {
            error,
            in_place: false,
        }
    }
}

impl L2Tier {
    /// Opens (creating if needed) the tier at `root`: creates `objects/` and
    /// `tmp/`, deletes leftover temp files and inventories the objects
    /// (headers and lengths only). `capacity_bytes` bounds the bytes of
    /// object files (`None` = unbounded); an inventory larger than the
    /// capacity opens fine and the caller evicts.
    pub fn open(
        root: &Path,
        capacity_bytes: Option<u64>,
        fs: Arc<dyn Fs>,
    ) -> Result<(L2Tier, Inventory)> {
        L2Tier::open_with_progress(root, capacity_bytes, fs, &mut |_| {})
    }

    /// [`L2Tier::open`], calling `progress` with the cumulative number of
    /// object files examined as the scan goes (at least once, at the end).
    pub fn open_with_progress(
        root: &Path,
        capacity_bytes: Option<u64>,
        fs: Arc<dyn Fs>,
        progress: &mut dyn FnMut(usize),
    ) -> Result<(L2Tier, Inventory)> {
        // Never through a link, never another user's: opening deletes files
        // under tmp/ and the service deletes unreferenced objects.
        let private = |path: &Path| {
            crate::private::check_owned(
                path,
                crate::private::Kind::Dir,
                "L2 directory",
                "--l2-path",
                true,
            )
        };
        private(root)?;
        // The directories this open creates (the root and missing parents,
        // outermost last): each one's entry is made durable by an fsync of
        // its parent, else a power cut could take the whole tier away,
        // objects of durable generations included.
        let created: Vec<&Path> = root
            .ancestors()
            .take_while(|p| !p.as_os_str().is_empty() && !p.exists())
            .collect();
        fs.create_dir_all(root)
            .map_err(|e| Error::io(format!("create L2 directory {}", root.display()), e))?;
        for dir in &created {
            let parent = match dir.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            fs.sync_dir(parent)
                .map_err(|e| Error::io(format!("fsync directory {}", parent.display()), e))?;
        }
        private(root)?;
        let objects = root.join("objects");
        let tmp = root.join("tmp");
        if create_dir_if_missing(&*fs, &objects)? {
            fs.sync_dir(root)
                .map_err(|e| Error::io(format!("fsync L2 directory {}", root.display()), e))?;
        }
        create_dir_if_missing(&*fs, &tmp)?;
        private(&objects)?;
        private(&tmp)?;
        remove_temp_files(&*fs, &tmp)?;
        // All 256 first-level directories exist from the first open, so a
        // write creates at most its second-level directory.
        let mut created = false;
        for aa in 0..=255u8 {
            created |= create_dir_if_missing(&*fs, &objects.join(format!("{aa:02x}")))?;
        }
        if created {
            fs.sync_dir(&objects)
                .map_err(|e| Error::io(format!("fsync L2 directory {}", objects.display()), e))?;
        }

        let (inventory, buckets) = scan(&*fs, &objects, progress)?;
        let unit = allocation_unit(root);
        let mut accounting = Accounting::default();
        for entry in &inventory.objects {
            let charged = charge(unit, entry.file_bytes);
            accounting.sizes.insert(entry.key, charged);
            accounting.used = accounting.used.saturating_add(charged);
        }
        if !inventory.unreadable.is_empty() {
            log::warn!(
                "L2 open {}: {} unreadable file(s) under objects/ (first: {}); they are never \
                 read and can be reclaimed",
                root.display(),
                inventory.unreadable.len(),
                inventory.unreadable[0].display()
            );
        }
        log::info!(
            "L2 open {}: {} objects, {}",
            root.display(),
            inventory.objects.len(),
            crate::units::human_size(accounting.used)
        );
        let tier = L2Tier {
            root: root.to_path_buf(),
            objects,
            tmp,
            capacity: capacity_bytes,
            unit,
            fs,
            accounting: Mutex::new(accounting),
            buckets: Mutex::new(buckets.into_iter().map(|b| (b, Bucket::Durable)).collect()),
            poison: Mutex::new(None),
            bytes_written: AtomicU64::new(0),
        };
        Ok((tier, inventory))
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the object `key` lives: `<root>/objects/<aa>/<bb>/<key>.page`.
    pub fn path_of(&self, key: &ObjectKey) -> PathBuf {
        self.bucket_dir(key)
            .join(format!("{}{OBJECT_SUFFIX}", key.hex()))
    }

    fn bucket_dir(&self, key: &ObjectKey) -> PathBuf {
        self.objects
            .join(format!("{:02x}", key.0[0]))
            .join(format!("{:02x}", key.0[1]))
    }

    /// Writes `page` as the object `key`, durably (see the module docs for
    /// the order). Returns the bytes written (header + page), or 0 when an
    /// intact copy with the same length and checksum is already in place.
    /// "Intact" is judged from the header alone (64 bytes read): a payload
    /// that rotted on disk is caught by [`L2Tier::read`], after which the
    /// caller removes the object; a bad header or length is rewritten here.
    ///
    /// Errors: [`Error::OutOfSpace`] when the capacity or the disk is full;
    /// [`Error::Io`] for other failures, and for every write once the tier
    /// is poisoned by a failed fsync.
    pub fn write(&self, key: &ObjectKey, page: &[u8]) -> Result<u64> {
        self.write_inner(key, page, false)
    }

    /// Takes `charged` bytes (see [`L2Tier::charge`]) of the capacity for a
    /// write to come; false (nothing taken) when they do not fit next to
    /// the objects and the other reservations. Pass the reservation on to
    /// [`L2Tier::write_reserved`] or give it back with
    /// [`L2Tier::release_reservation`].
    pub fn try_reserve(&self, charged: u64) -> bool {
        let mut acc = self.accounting.lock();
        let needed = acc
            .used
            .saturating_add(acc.reserved)
            .saturating_add(charged);
        if self.capacity.is_some_and(|cap| needed > cap) {
            return false;
        }
        acc.reserved = acc.reserved.saturating_add(charged);
        true
    }

    /// Gives back a reservation of [`L2Tier::try_reserve`].
    pub fn release_reservation(&self, charged: u64) {
        let mut acc = self.accounting.lock();
        acc.reserved = acc.reserved.saturating_sub(charged);
    }

    /// [`L2Tier::write`] of an object whose space the caller reserved with
    /// [`L2Tier::try_reserve`] (for `self.charge(64 + page.len())` bytes):
    /// the reservation turns into the object's accounted bytes in the same
    /// step, or is given back when the write fails, so the object is never
    /// counted twice or not at all.
    pub fn write_reserved(&self, key: &ObjectKey, page: &[u8]) -> Result<u64> {
        self.write_inner(key, page, true)
    }

    fn write_inner(&self, key: &ObjectKey, page: &[u8], reserved: bool) -> Result<u64> {
        let dest = self.path_of(key);
        let header = PageHeader::for_page(key, page);
        let file_bytes = header.file_bytes();
        let charged = self.charge(file_bytes);
        let unreserve = || {
            if reserved {
                self.release_reservation(charged);
            }
        };
        if let Err(e) = self.check_poison(&dest) {
            unreserve();
            return Err(e);
        }

        // Write once: never rewrite an intact object.
        let existing = match read_header(&*self.fs, &dest, key) {
            Ok(found) => found,
            Err(e) => {
                unreserve();
                return Err(Error::io(format!("check L2 object {}", dest.display()), e));
            }
        };
        match existing {
            HeaderRead::Valid(_, existing) if existing == header => {
                let mut acc = self.accounting.lock();
                if reserved {
                    acc.reserved = acc.reserved.saturating_sub(charged);
                }
                let old = acc.sizes.insert(*key, charged).unwrap_or(0);
                acc.used = acc.used.saturating_sub(old).saturating_add(charged);
                return Ok(0);
            }
            HeaderRead::Valid(_, existing) => log::warn!(
                "L2 object {} holds different bytes (checksum {:016x}, {} page bytes); \
                 replacing it",
                dest.display(),
                existing.checksum,
                existing.page_bytes
            ),
            HeaderRead::Defect(defect) => {
                log::warn!(
                    "L2 object {} is unusable ({defect}); replacing it",
                    dest.display()
                )
            }
            HeaderRead::Missing => {}
        }

        if !reserved {
            self.reserve(&dest, charged)?;
        }
        let result = self.write_new(key, &dest, &header, page);
        let mut acc = self.accounting.lock();
        acc.reserved = acc.reserved.saturating_sub(charged);
        let in_place = match &result {
            Ok(()) => true,
            Err(failure) => failure.in_place,
        };
        if in_place {
            let old = acc.sizes.insert(*key, charged).unwrap_or(0);
            acc.used = acc.used.saturating_sub(old).saturating_add(charged);
        }
        drop(acc);
        result.map(|()| file_bytes).map_err(|f| f.error)
    }

    fn write_new(
        &self,
        key: &ObjectKey,
        dest: &Path,
        header: &PageHeader,
        page: &[u8],
    ) -> std::result::Result<(), WriteFailure> {
        let bucket = self.bucket_dir(key);
        let bucket_id = u16::from_be_bytes([key.0[0], key.0[1]]);
        let aa_created = self.create_bucket(bucket_id, &bucket)?;

        let seq = TEMP_SEQ.fetch_add(1, Ordering::Relaxed);
        let tmp = self.tmp.join(format!(
            "{}.{}-{seq}{TEMP_SUFFIX}",
            key.hex(),
            std::process::id()
        ));
        let mut file = self
            .fs
            .create_new(&tmp)
            .map_err(|e| space_or_io(format!("create L2 temp file {}", tmp.display()), e))?;
        let written = file
            .write_all(&header.encode())
            .and_then(|()| file.write_all(page));
        if let Err(e) = written {
            drop(file);
            self.discard_temp(&tmp);
            return Err(space_or_io(format!("write L2 temp file {}", tmp.display()), e).into());
        }
        self.bytes_written
            .fetch_add(header.file_bytes(), Ordering::Relaxed);
        if let Err(e) = file.sync_all() {
            drop(file);
            self.discard_temp(&tmp);
            return Err(self.poison(&tmp, e).into());
        }
        drop(file);
        if let Err(failure) = self.sync_bucket_parents(bucket_id, &bucket, aa_created) {
            self.discard_temp(&tmp);
            return Err(failure);
        }
        if let Err(e) = self.fs.rename(&tmp, dest) {
            self.discard_temp(&tmp);
            return Err(
                space_or_io(format!("rename {} to {}", tmp.display(), dest.display()), e).into(),
            );
        }
        if let Err(e) = self.fs.sync_dir(&bucket) {
            return Err(WriteFailure {
                error: self.poison(&bucket, e),
                in_place: true,
            });
        }
        Ok(())
    }

    /// Step 1: creates the bucket directory if this tier has not seen it
    /// (not fsynced yet; see [`L2Tier::sync_bucket_parents`]). Returns true
    /// when this call created `objects/<aa>` (normally created at open).
    /// No lock is held across the directory operations.
    fn create_bucket(&self, id: u16, bucket: &Path) -> Result<bool> {
        if self.buckets.lock().contains_key(&id) {
            return Ok(false);
        }
        let aa_created = match bucket.parent() {
            Some(aa) => create_dir_if_missing(&*self.fs, aa)?,
            None => false,
        };
        create_dir_if_missing(&*self.fs, bucket)?;
        let mut buckets = self.buckets.lock();
        let state = buckets.entry(id).or_insert(Bucket::Pending { aa_created });
        if let Bucket::Pending { aa_created: merged } = state {
            *merged |= aa_created;
        }
        Ok(aa_created)
    }

    /// Step 4: makes a bucket created in step 1 durable by fsyncing its
    /// parent (and `objects/` if `<aa>` was created too). Runs after the
    /// temp file's fsync, which on journalling filesystems usually commits
    /// the directory creation already, so this fsync is cheap. Every write
    /// into a bucket that is still pending does the fsyncs itself (no lock is
    /// held across them); the bucket is marked durable only after they
    /// succeeded, so no write returns before its directory is durable.
    fn sync_bucket_parents(
        &self,
        id: u16,
        bucket: &Path,
        aa_created_here: bool,
    ) -> std::result::Result<(), WriteFailure> {
        let aa_created = match self.buckets.lock().get(&id).copied() {
            Some(Bucket::Pending { aa_created }) => aa_created || aa_created_here,
            Some(Bucket::Durable) => return Ok(()),
            None => aa_created_here,
        };
        let mut dirs: Vec<&Path> = bucket.parent().into_iter().collect();
        if aa_created {
            dirs.push(&self.objects);
        }
        for dir in dirs {
            if let Err(e) = self.fs.sync_dir(dir) {
                return Err(self.poison(dir, e).into());
            }
        }
        self.buckets.lock().insert(id, Bucket::Durable);
        Ok(())
    }

    /// Counts the charged bytes of a write in flight against the capacity.
    fn reserve(&self, dest: &Path, file_bytes: u64) -> Result<()> {
        let mut acc = self.accounting.lock();
        if let Some(capacity) = self.capacity {
            let needed = acc
                .used
                .saturating_add(acc.reserved)
                .saturating_add(file_bytes);
            if needed > capacity {
                return Err(Error::OutOfSpace(format!(
                    "L2 write of {} ({file_bytes} bytes) refused: {} of the {capacity}-byte L2 \
                     capacity used and {} reserved; evict first",
                    dest.display(),
                    acc.used,
                    acc.reserved
                )));
            }
        }
        acc.reserved = acc.reserved.saturating_add(file_bytes);
        Ok(())
    }

    fn discard_temp(&self, tmp: &Path) {
        if let Err(e) = self.fs.remove_file(tmp)
            && e.kind() != io::ErrorKind::NotFound
        {
            log::warn!(
                "L2: could not remove temp file {} ({e}); the next open deletes it",
                tmp.display()
            );
        }
    }

    /// Poisons the tier after a failed fsync of `path`; returns the error
    /// for the write that hit it.
    fn poison(&self, path: &Path, e: io::Error) -> Error {
        let why = format!("fsync of {} failed: {e}", path.display());
        log::error!(
            "L2 tier at {} poisoned: {why}; writes are refused until it is reopened",
            self.root.display()
        );
        self.poison.lock().get_or_insert(why);
        Error::io(
            format!(
                "fsync of {} failed; the L2 tier at {} is now poisoned and refuses writes \
                 until it is reopened",
                path.display(),
                self.root.display()
            ),
            e,
        )
    }

    fn check_poison(&self, dest: &Path) -> Result<()> {
        match &*self.poison.lock() {
            None => Ok(()),
            Some(why) => Err(Error::io(
                format!(
                    "L2 write of {} refused: the L2 tier at {} is poisoned ({why}); reopen it \
                     to accept writes",
                    dest.display(),
                    self.root.display()
                ),
                io::Error::other("L2 tier poisoned by a failed fsync"),
            )),
        }
    }

    /// True once a failed fsync poisoned the tier (until it is reopened).
    pub fn is_poisoned(&self) -> bool {
        self.poison.lock().is_some()
    }

    /// Reads the object `key` into `out`, whose length must be the page's
    /// length, verifying magic, version, key, lengths and checksum.
    ///
    /// Errors: [`Error::NotFound`] when the file is absent;
    /// [`Error::UnsupportedFormat`] for another format version;
    /// [`Error::Corrupt`] (naming the file and the failed check) for any
    /// other mismatch; [`Error::Io`] when the filesystem fails. On error the
    /// contents of `out` are unspecified and must not be used.
    pub fn read(&self, key: &ObjectKey, out: &mut [u8]) -> Result<()> {
        self.read_timed(key, out).map(|_| ())
    }

    /// [`L2Tier::read`], answering how long it took until the page's bytes
    /// could be read: the file opened and its header read and checked (the
    /// service's load figures, `service::load_figures`).
    pub fn read_timed(&self, key: &ObjectKey, out: &mut [u8]) -> Result<std::time::Duration> {
        let started = std::time::Instant::now();
        let path = self.path_of(key);
        let ctx = || format!("read L2 object {}", path.display());
        let header = read_header(&*self.fs, &path, key).map_err(|e| Error::io(ctx(), e))?;
        let first_byte = started.elapsed();
        match header {
            HeaderRead::Missing => Err(Error::NotFound(format!(
                "L2 object {} is absent ({})",
                key.hex(),
                path.display()
            ))),
            HeaderRead::Defect(defect) if defect.is_unsupported_version() => {
                Err(Error::UnsupportedFormat(format!(
                    "L2 object {}: {defect}; it is never read and can be reclaimed",
                    path.display()
                )))
            }
            HeaderRead::Defect(defect) => Err(Error::Corrupt(format!(
                "L2 object {}: {defect}",
                path.display()
            ))),
            HeaderRead::Valid(mut file, header) => {
                if header.page_bytes != out.len() as u64 {
                    return Err(Error::Corrupt(format!(
                        "L2 object {}: holds {} page bytes, the caller expects {}",
                        path.display(),
                        header.page_bytes,
                        out.len()
                    )));
                }
                match file.read_exact_at(out, HEADER_BYTES as u64) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                        return Err(Error::Corrupt(format!(
                            "L2 object {}: truncated while it was read",
                            path.display()
                        )));
                    }
                    Err(e) => return Err(Error::io(ctx(), e)),
                }
                let actual = checksum(out);
                if actual != header.checksum {
                    return Err(Error::Corrupt(format!(
                        "L2 object {}: checksum mismatch (header {:016x}, page bytes hash to \
                         {actual:016x})",
                        path.display(),
                        header.checksum
                    )));
                }
                Ok(first_byte)
            }
        }
    }

    /// Deletes the object `key`; false if there was no file. Not fsynced
    /// (see the module docs).
    pub fn remove(&self, key: &ObjectKey) -> Result<bool> {
        let path = self.path_of(key);
        let removed = match self.fs.remove_file(&path) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => {
                return Err(Error::io(format!("remove L2 object {}", path.display()), e));
            }
        };
        let mut acc = self.accounting.lock();
        if let Some(old) = acc.sizes.remove(key) {
            acc.used = acc.used.saturating_sub(old);
        }
        Ok(removed)
    }

    /// True when the object's file exists (its content is not checked).
    pub fn contains(&self, key: &ObjectKey) -> bool {
        self.fs.file_len(&self.path_of(key)).is_ok()
    }

    /// Deletes files the open scan listed in [`Inventory::unreadable`].
    /// Paths outside `<root>/objects/` (or with a `..` component) are refused; a path that is the
    /// current home of an accounted (intact) object is skipped; missing
    /// files are ignored. Returns how many files were deleted.
    pub fn reclaim_unreadable(&self, paths: &[PathBuf]) -> Result<usize> {
        let mut removed = 0;
        for path in paths {
            let escapes = path
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir));
            if escapes || !path.starts_with(&self.objects) || path == &self.objects {
                return Err(Error::invalid(format!(
                    "reclaim_unreadable: {} is not under {}",
                    path.display(),
                    self.objects.display()
                )));
            }
            let accounted = object_key_of_name(path.file_name())
                .filter(|k| self.path_of(k) == *path)
                .is_some_and(|k| self.accounting.lock().sizes.contains_key(&k));
            if accounted {
                log::warn!(
                    "reclaim_unreadable: {} holds an intact object now; kept",
                    path.display()
                );
                continue;
            }
            match self.fs.remove_file(path) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(Error::io(
                        format!("remove unreadable L2 file {}", path.display()),
                        e,
                    ));
                }
            }
        }
        Ok(removed)
    }

    /// Charged bytes reserved for writes in flight.
    pub fn reserved_bytes(&self) -> u64 {
        self.accounting.lock().reserved
    }

    /// Bytes the object files this tier accounts take on disk (headers
    /// included, each rounded up to the allocation unit: see
    /// [`L2Tier::charge`]).
    pub fn used_bytes(&self) -> u64 {
        self.accounting.lock().used
    }

    /// Number of objects this tier accounts.
    pub fn object_count(&self) -> usize {
        self.accounting.lock().sizes.len()
    }

    /// The configured capacity in bytes (`None` = unbounded).
    pub fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    /// The charged bytes (see [`L2Tier::charge`]) accounted for `key`, if it
    /// is accounted.
    pub fn charged_bytes_of(&self, key: &ObjectKey) -> Option<u64> {
        self.accounting.lock().sizes.get(key).copied()
    }

    /// Every accounted object and its charged bytes, in no particular order.
    pub fn objects(&self) -> Vec<(ObjectKey, u64)> {
        let acc = self.accounting.lock();
        acc.sizes.iter().map(|(k, v)| (*k, *v)).collect()
    }

    /// The bytes an object file of `file_bytes` (see [`object_file_bytes`])
    /// takes on disk: its length rounded up to the filesystem's allocation
    /// unit. Capacity, [`L2Tier::used_bytes`] and [`L2Tier::would_fit`]
    /// count these, so `--l2-bytes` bounds what the files take on disk (a
    /// 4,160-byte object of a 4 KiB page takes 8 KiB).
    pub fn charge(&self, file_bytes: u64) -> u64 {
        charge(self.unit, file_bytes)
    }

    /// The filesystem's allocation unit (see [`L2Tier::charge`]).
    pub fn allocation_unit(&self) -> u64 {
        self.unit
    }

    /// True when `file_bytes` more charged bytes (see [`L2Tier::charge`]) fit in
    /// the capacity next to the objects and the writes in flight.
    pub fn would_fit(&self, file_bytes: u64) -> bool {
        match self.capacity {
            None => true,
            Some(capacity) => {
                let acc = self.accounting.lock();
                acc.used
                    .saturating_add(acc.reserved)
                    .saturating_add(file_bytes)
                    <= capacity
            }
        }
    }

    /// Header and page bytes handed to the filesystem by writes since open
    /// (including writes that failed at fsync or later). Writes skipped
    /// because the object was intact add nothing.
    pub fn bytes_written(&self) -> u64 {
        self.bytes_written.load(Ordering::Relaxed)
    }
}

/// The allocation unit of the filesystem holding `root` (its fragment
/// size, as `st_blocks` counts on ext4, xfs and tmpfs); 4096 when unknown.
pub fn allocation_unit(root: &Path) -> u64 {
    match rustix::fs::statvfs(root) {
        Ok(v) if v.f_frsize > 0 => v.f_frsize.clamp(512, 1 << 20),
        Ok(v) if v.f_bsize > 0 => v.f_bsize.clamp(512, 1 << 20),
        _ => 4096,
    }
}

/// `file_bytes` rounded up to a multiple of `unit`.
fn charge(unit: u64, file_bytes: u64) -> u64 {
    file_bytes.div_ceil(unit.max(1)).saturating_mul(unit.max(1))
}

/// Maps "disk full" to [`Error::OutOfSpace`], anything else to [`Error::Io`].
fn space_or_io(context: String, e: io::Error) -> Error {
    match e.kind() {
        io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => {
            Error::OutOfSpace(format!("{context}: {e}"))
        }
        _ => Error::io(context, e),
    }
}

/// Creates the directory `path`; true if it was created, false if it existed.
fn create_dir_if_missing(fs: &dyn Fs, path: &Path) -> Result<bool> {
    match fs.create_dir(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(space_or_io(
            format!("create directory {}", path.display()),
            e,
        )),
    }
}

fn remove_temp_files(fs: &dyn Fs, tmp: &Path) -> Result<()> {
    let entries = fs
        .read_dir(tmp)
        .map_err(|e| Error::io(format!("list L2 temp directory {}", tmp.display()), e))?;
    let mut removed = 0usize;
    for entry in entries {
        let path = tmp.join(&entry.name);
        if entry.kind == EntryKind::Dir {
            log::warn!(
                "L2 open: unexpected directory {} left alone",
                path.display()
            );
            continue;
        }
        match fs.remove_file(&path) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(Error::io(
                    format!("remove leftover L2 temp file {}", path.display()),
                    e,
                ));
            }
        }
    }
    if removed > 0 {
        log::info!(
            "L2 open: removed {removed} temp file(s) left by an interrupted write in {}",
            tmp.display()
        );
    }
    Ok(())
}

/// Reads and checks the header of the object file `path`, expected to hold
/// `key`. I/O errors other than a missing file or a short file are returned.
fn read_header(fs: &dyn Fs, path: &Path, key: &ObjectKey) -> io::Result<HeaderRead> {
    let mut file = match fs.open_read(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(HeaderRead::Missing),
        Err(e) => return Err(e),
    };
    let len = file.len()?;
    if len < HEADER_BYTES as u64 {
        return Ok(HeaderRead::Defect(HeaderDefect::Short(len)));
    }
    let mut bytes = [0u8; HEADER_BYTES];
    match file.read_exact_at(&mut bytes, 0) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Ok(HeaderRead::Defect(HeaderDefect::Short(len)));
        }
        Err(e) => return Err(e),
    }
    Ok(match PageHeader::decode(&bytes, key, len) {
        Ok(header) => HeaderRead::Valid(file, header),
        Err(defect) => HeaderRead::Defect(defect),
    })
}

/// Parses a two-character lowercase hex directory name.
fn byte_dir_name(name: &OsStr) -> Option<u8> {
    let name = name.to_str()?;
    let value = u8::from_str_radix(name, 16).ok()?;
    (format!("{value:02x}") == name).then_some(value)
}

/// The key of an object file name `<64 lowercase hex>.page`.
fn object_key_of_name(name: Option<&OsStr>) -> Option<ObjectKey> {
    let stem = name?.to_str()?.strip_suffix(OBJECT_SUFFIX)?;
    ObjectKey::from_hex(stem)
}

/// What one bucket directory (or a stray entry) contributed to the scan.
#[derive(Default)]
struct Batch {
    bucket: Option<u16>,
    objects: Vec<InventoryEntry>,
    unreadable: Vec<PathBuf>,
    files: usize,
}

/// Scans `objects/` two levels deep; returns the inventory and the buckets
/// seen (existing bucket directories are durable: they survived a restart or
/// were fsynced by the write that created them).
fn scan(
    fs: &dyn Fs,
    objects: &Path,
    progress: &mut dyn FnMut(usize),
) -> Result<(Inventory, Vec<u16>)> {
    let list = |dir: &Path| {
        fs.read_dir(dir)
            .map_err(|e| Error::io(format!("list L2 directory {}", dir.display()), e))
    };
    let mut inventory = Inventory::default();
    let mut buckets = Vec::new();
    let mut top = Vec::new();
    for entry in list(objects)? {
        let path = objects.join(&entry.name);
        match (entry.kind, byte_dir_name(&entry.name)) {
            (EntryKind::Dir, Some(aa)) => top.push(aa),
            (EntryKind::Dir, None) => {
                log::warn!(
                    "L2 scan: unexpected directory {} left alone",
                    path.display()
                )
            }
            _ => inventory.unreadable.push(path),
        }
    }

    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, MAX_SCAN_THREADS)
        .min(top.len().max(1));
    let mut scanned = 0usize;
    let mut first_error = None;
    std::thread::scope(|scope| -> Result<()> {
        let (tx, rx) = mpsc::channel::<Result<Batch>>();
        for i in 0..threads {
            let tx = tx.clone();
            let (next, stop, top) = (&next, &stop, &top);
            let work = move || {
                while !stop.load(Ordering::Relaxed) {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&aa) = top.get(k) else { break };
                    if scan_aa(fs, objects, aa, &tx).is_err() {
                        break;
                    }
                }
            };
            std::thread::Builder::new()
                .name(format!("l2-scan-{i}"))
                .spawn_scoped(scope, work)
                .map_err(|e| Error::io("spawn L2 scan thread", e))?;
        }
        drop(tx);
        for batch in rx {
            match batch {
                Ok(batch) => {
                    scanned += batch.files;
                    buckets.extend(batch.bucket);
                    inventory.objects.extend(batch.objects);
                    inventory.unreadable.extend(batch.unreadable);
                    progress(scanned);
                }
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    first_error.get_or_insert(e);
                }
            }
        }
        Ok(())
    })?;
    if let Some(e) = first_error {
        return Err(e);
    }
    progress(scanned);
    inventory.objects.sort_by_key(|a| a.key);
    inventory.unreadable.sort();
    Ok((inventory, buckets))
}

/// Scans `objects/<aa>/`, sending one batch per bucket directory; Err when
/// the receiver is gone.
fn scan_aa(
    fs: &dyn Fs,
    objects: &Path,
    aa: u8,
    tx: &mpsc::Sender<Result<Batch>>,
) -> std::result::Result<(), ()> {
    let send = |batch: Result<Batch>| tx.send(batch).map_err(|_| ());
    let aa_dir = objects.join(format!("{aa:02x}"));
    let entries = match fs.read_dir(&aa_dir) {
        Ok(entries) => entries,
        Err(e) => {
            return send(Err(Error::io(
                format!("list L2 directory {}", aa_dir.display()),
                e,
            )));
        }
    };
    let mut strays = Batch::default();
    for entry in entries {
        let path = aa_dir.join(&entry.name);
        match (entry.kind, byte_dir_name(&entry.name)) {
            (EntryKind::Dir, Some(bb)) => send(scan_bucket(fs, &path, aa, bb))?,
            (EntryKind::Dir, None) => {
                log::warn!(
                    "L2 scan: unexpected directory {} left alone",
                    path.display()
                )
            }
            _ => strays.unreadable.push(path),
        }
    }
    if strays.unreadable.is_empty() {
        Ok(())
    } else {
        send(Ok(strays))
    }
}

fn scan_bucket(fs: &dyn Fs, dir: &Path, aa: u8, bb: u8) -> Result<Batch> {
    let entries = fs
        .read_dir(dir)
        .map_err(|e| Error::io(format!("list L2 directory {}", dir.display()), e))?;
    let mut batch = Batch {
        bucket: Some(u16::from_be_bytes([aa, bb])),
        ..Batch::default()
    };
    for entry in entries {
        let path = dir.join(&entry.name);
        if entry.kind == EntryKind::Dir {
            log::warn!(
                "L2 scan: unexpected directory {} left alone",
                path.display()
            );
            continue;
        }
        batch.files += 1;
        let key = object_key_of_name(Some(&entry.name))
            .filter(|k| entry.kind == EntryKind::File && k.0[0] == aa && k.0[1] == bb);
        let Some(key) = key else {
            log::debug!("L2 scan: {} is not an object file name", path.display());
            batch.unreadable.push(path);
            continue;
        };
        match read_header(fs, &path, &key)
            .map_err(|e| Error::io(format!("read L2 object header {}", path.display()), e))?
        {
            HeaderRead::Missing => {}
            HeaderRead::Defect(defect) => {
                log::debug!("L2 scan: {} is unreadable: {defect}", path.display());
                batch.unreadable.push(path);
            }
            HeaderRead::Valid(_, header) => batch.objects.push(InventoryEntry {
                key,
                page_bytes: header.page_bytes,
                file_bytes: header.file_bytes(),
            }),
        }
    }
    Ok(batch)
}
