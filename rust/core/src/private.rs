//! Private paths: the socket's directory, the L2 directory and the SQLite
//! index hold what users' prompts derive from, and a sidecar deletes files
//! in some of them. Each must belong to the sidecar's user and must not be
//! reached through a symbolic link (checked on the last component, with
//! `lstat`), so another local user can neither read them nor redirect a
//! deletion into a directory of their choice. What a sidecar creates is
//! created with mode 0700 (directories) or 0600 (files) whatever the umask;
//! an existing file or directory of its own with a wider mode is narrowed.

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use crate::error::{Error, Result};

/// What a checked path must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A directory.
    Dir,
    /// A regular file.
    File,
}

/// The effective uid of this process.
pub fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Checks `path` if it exists: not a symbolic link, of `kind`, owned by this
/// user. `what` names it in messages ("L2 directory"), `flag` says which
/// setting chose it (`--l2-path`). When `narrow` is set, a group- or
/// other-accessible mode is narrowed to 0700 / 0600. Returns whether it
/// exists.
pub fn check_owned(path: &Path, kind: Kind, what: &str, flag: &str, narrow: bool) -> Result<bool> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(Error::io(format!("stat {what} {}", path.display()), e)),
    };
    if meta.file_type().is_symlink() {
        return Err(Error::invalid(format!(
            "{what} {} is a symbolic link; lmcache-rc does not follow links there (another \
             user could redirect it): pass the real path to {flag}",
            path.display()
        )));
    }
    let right_kind = match kind {
        Kind::Dir => meta.is_dir(),
        Kind::File => meta.is_file(),
    };
    if !right_kind {
        return Err(Error::invalid(format!(
            "{what} {} is not a {}; choose another {flag}",
            path.display(),
            match kind {
                Kind::Dir => "directory",
                Kind::File => "regular file",
            }
        )));
    }
    let me = euid();
    if meta.uid() != me {
        return Err(Error::invalid(format!(
            "{what} {} belongs to uid {}, not to this user (uid {me}); lmcache-rc uses only \
             its own files there: choose another {flag} or change its owner",
            path.display(),
            meta.uid()
        )));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if narrow && mode & 0o077 != 0 {
        let private = match kind {
            Kind::Dir => 0o700,
            Kind::File => 0o600,
        };
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(private)).map_err(|e| {
            Error::io(
                format!(
                    "narrow the mode of {what} {} to {private:o}",
                    path.display()
                ),
                e,
            )
        })?;
        log::info!(
            "{what} {}: mode {mode:o} narrowed to {private:o} (other users must not read it)",
            path.display()
        );
    }
    Ok(true)
}

/// Creates the file `path` with mode 0600 (whatever the umask) if it does
/// not exist; an existing one is checked with [`check_owned`] and narrowed.
pub fn create_private_file(path: &Path, what: &str, flag: &str) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    if check_owned(path, Kind::File, what, flag, true)? {
        return Ok(());
    }
    let created = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path);
    match created {
        // The umask may have narrowed 0600 further; never wider.
        Ok(file) => file
            .set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::io(format!("chmod 0600 {what} {}", path.display()), e)),
        // Created meanwhile by someone else: check it like an existing one.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            check_owned(path, Kind::File, what, flag, true).map(|_| ())
        }
        Err(e) => Err(Error::io(format!("create {what} {}", path.display()), e)),
    }
}

/// `n` random bytes from the kernel.
pub fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut out = [0u8; N];
    let mut filled = 0;
    while filled < N {
        match rustix::rand::getrandom(&mut out[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(Error::io("read random bytes", e.into())),
        }
    }
    Ok(out)
}

/// A fresh random id: 32 lowercase hex characters.
pub fn random_id() -> Result<String> {
    Ok(hex::encode(random_bytes::<16>()?))
}
