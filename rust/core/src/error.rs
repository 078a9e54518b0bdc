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

/// The kind of an [`Error`], without its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// See [`Error::InvalidInput`].
    InvalidInput,
    /// See [`Error::InvalidType`].
    InvalidType,
    /// See [`Error::GenerationConflict`].
    GenerationConflict,
    /// See [`Error::UnsupportedFormat`].
    UnsupportedFormat,
    /// See [`Error::Closed`].
    Closed,
    /// See [`Error::Database`].
    Database,
    /// See [`Error::Corrupt`].
    Corrupt,
    /// See [`Error::OutOfSpace`].
    OutOfSpace,
    /// See [`Error::NotFound`].
    NotFound,
    /// See [`Error::LeasesLive`].
    LeasesLive,
    /// See [`Error::Io`].
    Io,
    /// See [`Error::Unavailable`].
    Unavailable,
    /// See [`Error::Protocol`].
    Protocol,
    /// See [`Error::Timeout`].
    Timeout,
    /// See [`Error::Internal`].
    Internal,
    /// See [`Error::UnsafeCopy`].
    UnsafeCopy,
    /// See [`Error::Device`].
    Device,
}

impl ErrorKind {
    /// The stable name of this kind.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidInput => "InvalidInput",
            ErrorKind::InvalidType => "InvalidType",
            ErrorKind::GenerationConflict => "GenerationConflict",
            ErrorKind::UnsupportedFormat => "UnsupportedFormat",
            ErrorKind::Closed => "Closed",
            ErrorKind::Database => "Database",
            ErrorKind::Corrupt => "Corrupt",
            ErrorKind::OutOfSpace => "OutOfSpace",
            ErrorKind::NotFound => "NotFound",
            ErrorKind::LeasesLive => "LeasesLive",
            ErrorKind::Io => "Io",
            ErrorKind::Unavailable => "Unavailable",
            ErrorKind::Protocol => "Protocol",
            ErrorKind::Timeout => "Timeout",
            ErrorKind::Internal => "Internal",
            ErrorKind::UnsafeCopy => "UnsafeCopy",
            ErrorKind::Device => "Device",
        }
    }
}

impl ErrorKind {
    /// Every kind, in declaration order (wire decoding and binding tables).
    pub const ALL: [ErrorKind; 17] = [
        ErrorKind::InvalidInput,
        ErrorKind::InvalidType,
        ErrorKind::GenerationConflict,
        ErrorKind::UnsupportedFormat,
        ErrorKind::Closed,
        ErrorKind::Database,
        ErrorKind::Corrupt,
        ErrorKind::OutOfSpace,
        ErrorKind::NotFound,
        ErrorKind::LeasesLive,
        ErrorKind::Io,
        ErrorKind::Unavailable,
        ErrorKind::Protocol,
        ErrorKind::Timeout,
        ErrorKind::Internal,
        ErrorKind::UnsafeCopy,
        ErrorKind::Device,
    ];

    /// The kind whose [`as_str`](Self::as_str) is `name` (None if unknown).
    pub fn from_name(name: &str) -> Option<ErrorKind> {
        Self::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
