//! The one error type of the core crate.
//!
//! Every fallible operation in `lmcache-rc-core` returns [`Error`]. The Python
//! binding maps each variant to one exception class of `lmcache_rc.errors` in a
//! single place, so the variants are the vocabulary users see: keep messages
//! actionable (what was wrong, what the limit is).

use std::fmt;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every error the core crate reports.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A value is outside what the format or the API accepts (ValueError in Python).
    #[error("{0}")]
    InvalidInput(String),
    /// A value has a type the format cannot represent (TypeError in Python).
    #[error("{0}")]
    InvalidType(String),
    /// A generation id was reused for different content (during store or after publication).
    #[error("{0}")]
    GenerationConflict(String),
    /// A stored file or database is in a format this build does not read.
    #[error("{0}")]
    UnsupportedFormat(String),
    /// The object was closed; no further calls are accepted.
    #[error("{0} is closed")]
    Closed(&'static str),
    /// The SQLite directory failed.
    #[error("checkpoint directory database error: {0}")]
    Database(String),
    /// Stored bytes failed verification (bad header, size or checksum).
    #[error("{0}")]
    Corrupt(String),
    /// A tier could not reserve the space it was configured with.
    #[error("{0}")]
    OutOfSpace(String),
    /// A lease or object id is unknown.
    #[error("{0}")]
    NotFound(String),
    /// The operation is refused while copies are live (forced clear, close).
    #[error("{0}")]
    LeasesLive(String),
    /// An operating-system I/O call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, e.g. "open /path/to/file".
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The sidecar cannot be reached: no server at the socket, the connection
    /// was lost (e.g. the server restarted during the call) or it is shutting down.
    #[error("{0}")]
    Unavailable(String),
    /// A peer broke the wire protocol: a malformed, oversize or unexpected
    /// frame, or an unsupported protocol version.
    #[error("{0}")]
    Protocol(String),
    /// An RPC got no reply in time (the server may still carry it out).
    #[error("{0}")]
    Timeout(String),
    /// A bug: the server caught a panic while handling a request.
    #[error("{0}")]
    Internal(String),
    /// A worker copy may still be in flight (or a lease's ownership could not
    /// be reconciled): the transfer engine stopped admitting work and its
    /// memory must stay alive until the process ends (invariant I5).
    #[error("{0}")]
    UnsafeCopy(String),
    /// The accelerator or its driver failed or is missing (e.g. no CUDA driver).
    #[error("{0}")]
    Device(String),
    /// An object that owns native threads was used in a process forked from
    /// the one that created it (its threads and locks stayed in the parent).
    #[error("{0}")]
    Forked(String),
    /// An error the server replied with over RPC: its kind and message as sent.
    #[error("{message}")]
    Remote {
        /// The kind the server reported.
        kind: ErrorKind,
        /// The server's message.
        message: String,
    },
}

impl Error {
    /// A short, stable name of the variant (used in wire replies and logs).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::InvalidInput(_) => ErrorKind::InvalidInput,
            Error::InvalidType(_) => ErrorKind::InvalidType,
            Error::GenerationConflict(_) => ErrorKind::GenerationConflict,
            Error::UnsupportedFormat(_) => ErrorKind::UnsupportedFormat,
            Error::Closed(_) => ErrorKind::Closed,
            Error::Database(_) => ErrorKind::Database,
            Error::Corrupt(_) => ErrorKind::Corrupt,
            Error::OutOfSpace(_) => ErrorKind::OutOfSpace,
            Error::NotFound(_) => ErrorKind::NotFound,
            Error::LeasesLive(_) => ErrorKind::LeasesLive,
            Error::Io { .. } => ErrorKind::Io,
            Error::Unavailable(_) => ErrorKind::Unavailable,
            Error::Protocol(_) => ErrorKind::Protocol,
            Error::Timeout(_) => ErrorKind::Timeout,
            Error::Internal(_) => ErrorKind::Internal,
            Error::UnsafeCopy(_) => ErrorKind::UnsafeCopy,
            Error::Device(_) => ErrorKind::Device,
            Error::Forked(_) => ErrorKind::Forked,
            Error::Remote { kind, .. } => *kind,
        }
    }

    /// Shorthand for [`Error::InvalidInput`].
    pub fn invalid(message: impl Into<String>) -> Self {
        Error::InvalidInput(message.into())
    }

    /// The error a peer reports as `kind` with `message`: the transport
    /// kinds (`Unavailable`, `Protocol`, `Timeout`, `Internal`) become their
    /// own variants, every other kind a [`Error::Remote`] carrying it.
    pub fn from_kind(kind: ErrorKind, message: String) -> Self {
        match kind {
            ErrorKind::Unavailable => Error::Unavailable(message),
            ErrorKind::Protocol => Error::Protocol(message),
            ErrorKind::Timeout => Error::Timeout(message),
            ErrorKind::Internal => Error::Internal(message),
            kind => Error::Remote { kind, message },
        }
    }

    /// A copy of this error with the same kind and message (errors are not
    /// `Clone`: an I/O source cannot be). What an RPC reply would carry.
    pub fn replicate(&self) -> Self {
        Error::from_kind(self.kind(), self.to_string())
    }

    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// Declares [`ErrorKind`] from one table and everything derived from it:
/// the stable names, [`ErrorKind::ALL`], and what a binding needs to give
/// each kind an exception class ([`ExceptionInfo`]). Python's
/// `lmcache_rc/errors.py` is generated from this table (`ci/gen_errors.py`,
/// checked by `ci/lint.sh`), so nothing is kept in step by hand.
macro_rules! error_kinds {
    ($(
        $variant:ident {
            exception: $exception:literal,
            bases: [$($base:literal),*],
            doc: $doc:literal $(,)?
        }
    ),* $(,)?) => {
        /// The kind of an [`Error`], without its payload.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum ErrorKind {
            $(
                #[doc = $doc]
                $variant,
            )*
        }

        impl ErrorKind {
            /// Every kind, in declaration order (wire decoding and binding tables).
            pub const ALL: &'static [ErrorKind] = &[$(ErrorKind::$variant),*];

            /// The stable name of this kind (wire replies, logs).
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ErrorKind::$variant => stringify!($variant),)*
                }
            }

            /// How a binding presents this kind as an exception class.
            pub fn exception(self) -> ExceptionInfo {
                match self {
                    $(ErrorKind::$variant => ExceptionInfo {
                        name: $exception,
                        bases: &[$($base),*],
                        doc: $doc,
                    },)*
                }
            }
        }
    };
}

/// The exception class a binding gives an [`ErrorKind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExceptionInfo {
    /// The class name (`lmcache_rc.errors.<name>`).
    pub name: &'static str,
    /// Its bases, in order: [`BASE_EXCEPTION`], another kind's class name,
    /// or a Python built-in exception family (`ValueError`, `OSError`...).
    pub bases: &'static [&'static str],
    /// What the error means and what to do about it.
    pub doc: &'static str,
}

/// The class every error derives from (`lmcache_rc.errors.CheckpointError`).
pub const BASE_EXCEPTION: &str = "CheckpointError";

error_kinds! {
    InvalidInput {
        exception: "InvalidInput",
        bases: ["CheckpointError", "ValueError"],
        doc: "A value is outside what the format or API accepts; nothing was changed.",
    },
    InvalidType {
        exception: "InvalidType",
        bases: ["InvalidInput", "TypeError"],
        doc: "A value has a type the format cannot carry (e.g. a set inside an identity).",
    },
    GenerationConflict {
        exception: "GenerationConflict",
        bases: ["InvalidInput"],
        doc: "A generation id was reused for different content (during store or after publication).",
    },
    UnsupportedFormat {
        exception: "UnsupportedFormat",
        bases: ["CheckpointError"],
        doc: "A stored file or database is in a format this build does not read.\n\n\
              lmcache-rc never rewrites or empties such a file: move it aside or use a\n\
              matching build.",
    },
    Closed {
        exception: "Closed",
        bases: ["CheckpointError"],
        doc: "The object was closed; no further calls are accepted.",
    },
    Database {
        exception: "DatabaseError",
        bases: ["CheckpointError"],
        doc: "The SQLite checkpoint directory failed (the operation had no effect).",
    },
    Corrupt {
        exception: "CorruptData",
        bases: ["CheckpointError"],
        doc: "Stored bytes failed verification (header, size or checksum); they were not used.",
    },
    OutOfSpace {
        exception: "OutOfSpace",
        bases: ["CheckpointError"],
        doc: "A tier could not reserve its configured space (e.g. /dev/shm or the L2 disk is full).",
    },
    NotFound {
        exception: "NotFound",
        bases: ["CheckpointError", "LookupError"],
        doc: "A lease or object id is unknown (already finished, or never issued).",
    },
    LeasesLive {
        exception: "LeasesLive",
        bases: ["CheckpointError"],
        doc: "Refused while worker copies hold leases (forced clear, close): finish them first.",
    },
    Io {
        exception: "StorageIOError",
        bases: ["CheckpointError", "OSError"],
        doc: "An operating-system I/O call failed.",
    },
    Unavailable {
        exception: "Unavailable",
        bases: ["CheckpointError", "ConnectionError"],
        doc: "The sidecar cannot be reached: no server at the socket, the connection\n\
              was lost (e.g. the server restarted during the call; its outcome is then\n\
              unknown) or the server is shutting down. The next call reconnects.",
    },
    Protocol {
        exception: "ProtocolError",
        bases: ["CheckpointError"],
        doc: "A peer broke the wire protocol: a malformed, oversize or unexpected\n\
              frame, or an unsupported protocol version (upgrade the older side).",
    },
    Timeout {
        exception: "RpcTimeout",
        bases: ["CheckpointError", "TimeoutError"],
        doc: "An RPC got no reply in time. The server may still carry the call out.",
    },
    Internal {
        exception: "InternalError",
        bases: ["CheckpointError"],
        doc: "A bug: the server failed while handling a request (it keeps serving).",
    },
    UnsafeCopy {
        exception: "UnsafeCopy",
        bases: ["CheckpointError"],
        doc: "A worker copy may still be in flight, or a lease's ownership could not be\n\
              reconciled with the sidecar (invariant I5).\n\n\
              The transfer engine refuses all new work and its ``close()`` raises this:\n\
              the page pool and the shared-memory mapping must stay alive until the\n\
              worker process ends, and the engine must terminate that process. It is a\n\
              fatal engine error, never a cache miss.",
    },
    Device {
        exception: "DeviceError",
        bases: ["CheckpointError"],
        doc: "The accelerator or its driver is missing or failed (e.g. no CUDA driver\n\
              library on this host). The CPU backend stays usable.",
    },
    Forked {
        exception: "ForkedProcess",
        bases: ["CheckpointError", "RuntimeError"],
        doc: "An object that runs native threads (a client, server, service, transfer\n\
              engine or directory) was used in a child process after ``fork()``: its\n\
              threads and locks stayed in the parent, so the call would deadlock.\n\
              Create a new object in the child, or start children with the \"spawn\"\n\
              method.",
    },
}

impl ErrorKind {
    /// The kind whose [`as_str`](Self::as_str) is `name` (None if unknown).
    pub fn from_name(name: &str) -> Option<ErrorKind> {
        Self::ALL.iter().copied().find(|k| k.as_str() == name)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Python families a class may also derive from.
    const BUILTIN_FAMILIES: &[&str] = &[
        "ValueError",
        "TypeError",
        "OSError",
        "LookupError",
        "ConnectionError",
        "TimeoutError",
        "RuntimeError",
    ];

    #[test]
    fn the_error_table_defines_each_class_once_after_its_bases() {
        let mut defined = vec![BASE_EXCEPTION];
        for &kind in ErrorKind::ALL {
            let e = kind.exception();
            assert!(!defined.contains(&e.name), "{} defined twice", e.name);
            assert!(!e.bases.is_empty() && !e.doc.is_empty(), "{kind}");
            assert!(
                defined.contains(&e.bases[0]),
                "{kind}: the first base must be an lmcache-rc class defined earlier"
            );
            for base in &e.bases[1..] {
                assert!(
                    defined.contains(base) || BUILTIN_FAMILIES.contains(base),
                    "{kind}: unknown base {base}"
                );
            }
            assert_eq!(ErrorKind::from_name(kind.as_str()), Some(kind));
            defined.push(e.name);
        }
    }
}
