//! The filesystem operations the L2 tier uses, behind a trait so tests can
//! inject I/O errors, corrupted reads and record the order of operations
//! (see [`super::testing::FaultyFs`]).
//!
//! Files are created with mode 0600 and directories with mode 0700: pages may
//! hold data derived from users' prompts.

use std::ffi::OsString;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::Path;

/// What a directory entry is, as reported by the directory listing
/// (symbolic links are not followed and count as [`EntryKind::Other`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// Anything else (symbolic link, socket, ...).
    Other,
}

/// One entry of a directory listing.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct DirEntryInfo {
    /// The entry's file name (not the full path).
    pub name: OsString,
    /// What the entry is.
    pub kind: EntryKind,
}

/// A file opened for writing by [`Fs::create_new`].
pub trait WriteFile: Send {
    /// Writes all of `buf` at the current end of the file.
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()>;
    /// Flushes the file's data and metadata to stable storage (fsync).
    fn sync_all(&mut self) -> io::Result<()>;
}

/// A file opened for reading by [`Fs::open_read`].
pub trait ReadFile: Send {
    /// The file's current length in bytes (fstat).
    fn len(&self) -> io::Result<u64>;
    /// True when the file is empty.
    fn is_empty(&self) -> io::Result<bool> {
        Ok(self.len()? == 0)
    }
    /// Fills `buf` from `offset`; `UnexpectedEof` when the file ends first.
    fn read_exact_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()>;
}

/// The filesystem operations of the L2 tier. Every path is absolute or
/// relative to the process's working directory; implementations must be
/// usable from several threads at once.
pub trait Fs: Send + Sync {
    /// Creates `path` and any missing parents (like `mkdir -p`).
    fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    /// Creates the single directory `path`; `AlreadyExists` if it exists.
    fn create_dir(&self, path: &Path) -> io::Result<()>;
    /// Creates a new file for writing; `AlreadyExists` if `path` exists.
    fn create_new(&self, path: &Path) -> io::Result<Box<dyn WriteFile>>;
    /// Opens an existing file for reading; `NotFound` if absent.
    fn open_read(&self, path: &Path) -> io::Result<Box<dyn ReadFile>>;
    /// Renames `from` to `to`, atomically replacing `to` if it exists.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Flushes the directory `path` (its entries) to stable storage.
    fn sync_dir(&self, path: &Path) -> io::Result<()>;
    /// Removes the file `path`; `NotFound` if absent.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// The length of the file at `path` (following links); `NotFound` if absent.
    fn file_len(&self, path: &Path) -> io::Result<u64>;
    /// The entries of the directory `path`, in no particular order.
    fn read_dir(&self, path: &Path) -> io::Result<Vec<DirEntryInfo>>;
}

/// The real filesystem: `std::fs`, with `File::sync_all` for fsync and a
/// directory fsync that opens the directory and calls `sync_all` on it.
#[derive(Clone, Copy, Default, Debug)]
pub struct RealFs;

struct RealWriteFile(File);

impl WriteFile for RealWriteFile {
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.0.write_all(buf)
    }

    fn sync_all(&mut self) -> io::Result<()> {
        self.0.sync_all()
    }
}

struct RealReadFile(File);

impl ReadFile for RealReadFile {
    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }

    fn read_exact_at(&mut self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(&self.0, buf, offset)
    }
}

impl Fs for RealFs {
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        DirBuilder::new().recursive(true).mode(0o700).create(path)
    }

    fn create_dir(&self, path: &Path) -> io::Result<()> {
        DirBuilder::new().mode(0o700).create(path)
    }

    fn create_new(&self, path: &Path) -> io::Result<Box<dyn WriteFile>> {
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        Ok(Box::new(RealWriteFile(file)))
    }

    fn open_read(&self, path: &Path) -> io::Result<Box<dyn ReadFile>> {
        Ok(Box::new(RealReadFile(File::open(path)?)))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        File::open(path)?.sync_all()
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }

    fn file_len(&self, path: &Path) -> io::Result<u64> {
        Ok(fs::metadata(path)?.len())
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<DirEntryInfo>> {
        let mut out = Vec::new();
        for entry in fs::read_dir(path)? {
            let entry = entry?;
            let ty = entry.file_type()?;
            let kind = if ty.is_file() {
                EntryKind::File
            } else if ty.is_dir() {
                EntryKind::Dir
            } else {
                EntryKind::Other
            };
            out.push(DirEntryInfo {
                name: entry.file_name(),
                kind,
            });
        }
        Ok(out)
    }
}
