//! The fork guard: native objects are usable only in the process that made
//! them.
//!
//! A client, server, service, transfer engine or directory runs threads
//! (reader, accept, I/O, copy threads) or holds locks those threads take.
//! `fork()` copies the memory but not the threads: in the child, a call would
//! wait for a thread that does not exist or for a lock it held at the fork,
//! and hang. [`Owned`] records the creating process; in any other process
//! every use raises `ForkedProcess` with what to do instead, and dropping
//! the object leaks it rather than joining threads or taking locks that
//! belong to the parent.

use std::mem::ManuallyDrop;

use lmcache_rc_core::Error;
use pyo3::PyResult;

use crate::errors::to_pyerr;

/// A native object owned by the process that created it (see the module docs).
pub(crate) struct Owned<T> {
    pid: u32,
    what: &'static str,
    inner: ManuallyDrop<T>,
}

impl<T> Owned<T> {
    /// Wraps `inner` (a `what`, for messages) for this process.
    pub(crate) fn new(what: &'static str, inner: T) -> Self {
        Owned {
            pid: std::process::id(),
            what,
            inner: ManuallyDrop::new(inner),
        }
    }

    /// Whether this is the process that created the object.
    pub(crate) fn in_owner(&self) -> bool {
        std::process::id() == self.pid
    }

    /// The object, or `ForkedProcess` in a process forked since it was made.
    pub(crate) fn get(&self) -> PyResult<&T> {
        if self.in_owner() {
            Ok(&self.inner)
        } else {
            Err(to_pyerr(Error::Forked(format!(
                "this {} was created in process {} and cannot be used in process {} \
                 (forked from it): its native threads stayed in the parent; create a new \
                 {} in this process, or start child processes with the 'spawn' method",
                self.what,
                self.pid,
                std::process::id(),
                self.what
            ))))
        }
    }

    /// The object in its own process; None in a forked child (for drops and
    /// representations, which must not raise).
    pub(crate) fn local(&self) -> Option<&T> {
        self.in_owner().then_some(&*self.inner)
    }
}

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        if self.in_owner() {
            // SAFETY: this is the one drop of `inner`, and `inner` is not
            // used after it.
            unsafe { ManuallyDrop::drop(&mut self.inner) };
        }
        // In a forked child the object is leaked on purpose: dropping it
        // would join threads that do not exist here or take locks their
        // parent-side owners may have held at the fork.
    }
}
