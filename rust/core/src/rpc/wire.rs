//! Frames, messages and the version handshake (see the [module docs](super)
//! for the byte layout).
//!
//! Everything here is pure: encoding and decoding never touch a socket
//! except through [`read_frame`], which reads one length-prefixed frame from
//! any [`Read`]. Decoding never panics on input: a malformed frame is a
//! [`FrameError`] or an [`Error::Protocol`], an invalid value (a prefix or
//! manifest the core refuses) an [`Error::InvalidInput`].

use std::io::{self, IoSlice, IoSliceMut, Read};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{Error, ErrorKind, Result};
use crate::identity::Prefix;
use crate::manifest::Manifest;
use crate::protocol::{
    Capabilities, ChangeBatch, Checkpoints, ClearReport, EngineReport, GenerationInfo, Lease,
    Located, ServiceStatus, TierLoad,
};

/// First bytes of both handshake frames.
pub const MAGIC: [u8; 4] = *b"LMRC";
/// The protocol version this build speaks (also announced in capabilities).
pub const PROTOCOL_VERSION: u32 = crate::protocol::PROTOCOL_VERSION;
/// The oldest protocol version this build speaks. Version 2 handed the pool
/// over as a descriptor with the welcome; version 3 adds the server's facts
/// (`info`) to the status reply, which a version-2 peer cannot decode, so
/// versions 1 (a pool opened by name) and 2 are no longer spoken.
pub const MIN_PROTOCOL_VERSION: u32 = 3;
/// Default limit of one frame's payload (requests and replies): 64 MiB.
pub const DEFAULT_MAX_FRAME: usize = 64 << 20;
/// Bytes of the length prefix.
pub const LEN_BYTES: usize = 4;
/// Bytes of the request id at the start of every request and reply payload.
pub const ID_BYTES: usize = 8;
/// The request id of a connection-level error reply (the server closes the
/// connection after sending it). Clients number requests from 1.
pub const CONNECTION_ERROR_ID: u64 = 0;

// ---------------------------------------------------------------------------
// Messages

/// A prefix as carried on the wire (validated into a [`Prefix`] on receipt).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WirePrefix {
    /// See [`Prefix::namespace`].
    pub namespace: String,
    /// See [`Prefix::start_tokens`].
    pub start_tokens: u64,
    /// See [`Prefix::prefix_hash`] (empty or 32 bytes).
    #[serde(with = "serde_bytes")]
    pub prefix_hash: Vec<u8>,
    /// See [`Prefix::tail_tokens`].
    pub tail_tokens: Vec<u32>,
}

impl From<&Prefix> for WirePrefix {
    fn from(p: &Prefix) -> Self {
        WirePrefix {
            namespace: p.namespace().to_string(),
            start_tokens: p.start_tokens(),
            prefix_hash: p.prefix_hash().to_vec(),
            tail_tokens: p.tail_tokens().to_vec(),
        }
    }
}

impl TryFrom<WirePrefix> for Prefix {
    type Error = Error;
    fn try_from(p: WirePrefix) -> Result<Prefix> {
        Prefix::new(p.namespace, p.start_tokens, p.prefix_hash, p.tail_tokens)
    }
}

/// A manifest as carried on the wire (validated into a [`Manifest`] on receipt).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireManifest {
    /// See [`Manifest::generation`].
    pub generation: String,
    /// See [`Manifest::prefix`].
    pub prefix: WirePrefix,
    /// See [`Manifest::world_size`].
    pub world_size: u32,
    /// See [`Manifest::payload`] (the exact JSON bytes).
    #[serde(with = "serde_bytes")]
    pub payload: Vec<u8>,
}

impl From<&Manifest> for WireManifest {
    fn from(m: &Manifest) -> Self {
        WireManifest {
            generation: m.generation().to_string(),
            prefix: m.prefix().into(),
            world_size: m.world_size(),
            payload: m.payload().to_vec(),
        }
    }
}

impl TryFrom<WireManifest> for Manifest {
    type Error = Error;
    fn try_from(m: WireManifest) -> Result<Manifest> {
        Manifest::new(
            m.generation,
            Prefix::try_from(m.prefix)?,
            m.world_size,
            m.payload,
        )
    }
}

/// How an argument of an operation travels: its wire form, made from the
/// argument, and decoded into a value the argument borrows from. Implemented
/// for the function-pointer type `fn(T)` of each argument type `T` of the
/// [operation table](crate::for_each_operation) (a type without free
/// lifetimes, so a request variant can name `<fn(&[Prefix]) as
/// WireArg>::Wire`).
pub trait WireArg {
    /// The argument as the caller passes it.
    type Arg<'a>;
    /// Its form on the wire (a field of a [`Request`] variant).
    type Wire: Serialize + for<'de> Deserialize<'de> + std::fmt::Debug + Clone + PartialEq + Eq;
    /// What the server decodes the wire form into (validated).
    type Held;
    /// The wire form of an argument.
    fn to_wire(arg: Self::Arg<'_>) -> Self::Wire;
    /// Decodes a received wire form; a value the core refuses is its error
    /// (usually `InvalidInput`).
    fn decode(wire: Self::Wire) -> Result<Self::Held>;
    /// The argument a decoded value stands for.
    fn arg(held: &Self::Held) -> Self::Arg<'_>;
}

/// An argument passed as is.
macro_rules! plain_wire_arg {
    ($($t:ty),*) => {$(
        impl WireArg for fn($t) {
            type Arg<'a> = $t;
            type Wire = $t;
            type Held = $t;
            fn to_wire(arg: $t) -> $t {
                arg
            }
            fn decode(wire: $t) -> Result<$t> {
                Ok(wire)
            }
            fn arg(held: &$t) -> $t {
                *held
            }
        }
    )*};
}
plain_wire_arg!(bool, u32, u64, Option<u32>);

impl WireArg for fn(&[String]) {
    type Arg<'a> = &'a [String];
    type Wire = Vec<String>;
    type Held = Vec<String>;
    fn to_wire(arg: &[String]) -> Vec<String> {
        arg.to_vec()
    }
    fn decode(wire: Vec<String>) -> Result<Vec<String>> {
        Ok(wire)
    }
    fn arg(held: &Vec<String>) -> &[String] {
        held
    }
}

impl WireArg for fn(&[(String, u64)]) {
    type Arg<'a> = &'a [(String, u64)];
    type Wire = Vec<(String, u64)>;
    type Held = Vec<(String, u64)>;
    fn to_wire(arg: &[(String, u64)]) -> Vec<(String, u64)> {
        arg.to_vec()
    }
    fn decode(wire: Vec<(String, u64)>) -> Result<Vec<(String, u64)>> {
        Ok(wire)
    }
    fn arg(held: &Vec<(String, u64)>) -> &[(String, u64)] {
        held
    }
}

impl WireArg for fn(&str) {
    type Arg<'a> = &'a str;
    type Wire = String;
    type Held = String;
    fn to_wire(arg: &str) -> String {
        arg.to_string()
    }
    fn decode(wire: String) -> Result<String> {
        Ok(wire)
    }
    fn arg(held: &String) -> &str {
        held
    }
}

impl WireArg for fn(&Manifest) {
    type Arg<'a> = &'a Manifest;
    type Wire = WireManifest;
    type Held = Manifest;
    fn to_wire(arg: &Manifest) -> WireManifest {
        arg.into()
    }
    fn decode(wire: WireManifest) -> Result<Manifest> {
        wire.try_into()
    }
    fn arg(held: &Manifest) -> &Manifest {
        held
    }
}

impl WireArg for fn(&[Prefix]) {
    type Arg<'a> = &'a [Prefix];
    type Wire = Vec<WirePrefix>;
    type Held = Vec<Prefix>;
    fn to_wire(arg: &[Prefix]) -> Vec<WirePrefix> {
        arg.iter().map(WirePrefix::from).collect()
    }
    fn decode(wire: Vec<WirePrefix>) -> Result<Vec<Prefix>> {
        wire.into_iter().map(Prefix::try_from).collect()
    }
    fn arg(held: &Vec<Prefix>) -> &[Prefix] {
        held
    }
}

/// How the result of an operation travels: the [`Value`] variant that
/// carries it (one per result type; a new result type adds a variant).
pub trait ReplyValue: Sized {
    /// The reply value of a result.
    fn into_value(self) -> Value;
    /// The result a reply value stands for; another variant is a protocol
    /// error.
    fn from_value(value: Value) -> Result<Self>;
}

/// A result type carried by one [`Value`] variant as is.
macro_rules! reply_value {
    ($($t:ty => $variant:ident),* $(,)?) => {$(
        impl ReplyValue for $t {
            fn into_value(self) -> Value {
                Value::$variant(self)
            }
            fn from_value(value: Value) -> Result<Self> {
                match value {
                    Value::$variant(v) => Ok(v),
                    other => Err(other.unexpected(stringify!($variant))),
                }
            }
        }
    )*};
}
reply_value! {
    bool => Bool,
    Capabilities => Capabilities,
    Lease => Lease,
    ServiceStatus => Status,
    ClearReport => Clear,
    Vec<GenerationInfo> => Generations,
    u64 => Count,
    ChangeBatch => Changes,
    Vec<EngineReport> => Engines,
}

impl ReplyValue for () {
    fn into_value(self) -> Value {
        Value::Unit
    }
    fn from_value(value: Value) -> Result<()> {
        match value {
            Value::Unit => Ok(()),
            other => Err(other.unexpected("Unit")),
        }
    }
}

impl ReplyValue for Option<Manifest> {
    fn into_value(self) -> Value {
        Value::Manifest(self.as_ref().map(WireManifest::from))
    }
    fn from_value(value: Value) -> Result<Self> {
        match value {
            Value::Manifest(m) => m
                .map(Manifest::try_from)
                .transpose()
                .map_err(|e| Error::Protocol(format!("the server sent an invalid manifest: {e}"))),
            other => Err(other.unexpected("Manifest")),
        }
    }
}

/// A [`Located`] as carried on the wire (its manifest validated on receipt).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireLocated {
    /// See [`Located::manifest`].
    pub manifest: WireManifest,
    /// See [`Located::tiers`].
    pub tiers: Vec<TierLoad>,
}

impl From<&Located> for WireLocated {
    fn from(l: &Located) -> Self {
        WireLocated {
            manifest: WireManifest::from(&l.manifest),
            tiers: l.tiers.clone(),
        }
    }
}

impl ReplyValue for Option<Located> {
    fn into_value(self) -> Value {
        Value::Located(self.as_ref().map(WireLocated::from))
    }
    fn from_value(value: Value) -> Result<Self> {
        match value {
            Value::Located(l) => l
                .map(|l| {
                    Ok(Located {
                        manifest: Manifest::try_from(l.manifest)?,
                        tiers: l.tiers,
                    })
                })
                .transpose()
                .map_err(|e: Error| {
                    Error::Protocol(format!("the server sent an invalid manifest: {e}"))
                }),
            other => Err(other.unexpected("Located")),
        }
    }
}

/// Declares [`Request`] (one variant per operation, fields from
/// [`WireArg`]), its name and its dispatch from the operation table.
macro_rules! declare_requests {
    ([] $({
        $(#[$doc:meta])*
        $tag:literal $variant:ident
        fn $name:ident / $name_async:ident ( $($arg:ident : $ty:ty),* ) -> $out:ty; py $py:tt
    })*) => {
        /// One request per operation of the [table](crate::for_each_operation),
        /// its variant index the request's wire tag: **append only**, never
        /// reorder (a change is a new protocol version). `rank`, where
        /// present, is optional: when given, the server refuses
        /// (InvalidInput) a lease call for a lease another rank obtained.
        #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
        pub enum Request {
            $(
                #[doc = concat!(stringify!($tag), " — ", stringify!($name), ".")]
                $(#[$doc])*
                $variant {
                    $(
                        #[allow(missing_docs)]
                        $arg: <fn($ty) as WireArg>::Wire,
                    )*
                },
            )*
        }

        impl Request {
            /// The operation's name (logs and error messages).
            pub fn name(&self) -> &'static str {
                match self {
                    $(Request::$variant { .. } => stringify!($name),)*
                }
            }

            /// Carries the request out on `target`: decodes its arguments
            /// into core values (a prefix or manifest the core refuses is
            /// its error, usually `InvalidInput`) and makes the one matching
            /// [`Checkpoints`] call. The server's whole dispatch.
            pub fn apply(self, target: &dyn Checkpoints) -> Result<Value> {
                match self {
                    $(
                        Request::$variant { $($arg),* } => {
                            $(let $arg = <fn($ty) as WireArg>::decode($arg)?;)*
                            target
                                .$name($(<fn($ty) as WireArg>::arg(&$arg)),*)
                                .map(ReplyValue::into_value)
                        }
                    )*
                }
            }
        }
    };
}

crate::for_each_operation!(declare_requests);

/// The value of a successful reply: one variant per result type (the
/// protocol's own types, serialized as they are). Append only, like
/// [`Request`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Value {
    /// 0 — no value (abort, finish_retrieve, cancel_retrieve).
    Unit,
    /// 1 — begin, finish_store.
    Bool(bool),
    /// 2 — capabilities.
    Capabilities(Capabilities),
    /// 3 — find (validated into a [`Manifest`] on receipt).
    Manifest(Option<WireManifest>),
    /// 4 — prepare_store, begin_retrieve, poll_retrieve.
    Lease(Lease),
    /// 5 — status.
    Status(ServiceStatus),
    /// 6 — clear.
    Clear(ClearReport),
    /// 7 — list_generations.
    Generations(Vec<GenerationInfo>),
    /// 8 — invalidate_namespace.
    Count(u64),
    /// 9 — changes.
    Changes(ChangeBatch),
    /// 10 — find_located (its manifest validated into a [`Manifest`] on receipt).
    Located(Option<WireLocated>),
    /// 11 — engines.
    Engines(Vec<EngineReport>),
}

impl Value {
    /// The variant's name (error messages).
    pub fn name(&self) -> &'static str {
        match self {
            Value::Unit => "Unit",
            Value::Bool(_) => "Bool",
            Value::Capabilities(_) => "Capabilities",
            Value::Manifest(_) => "Manifest",
            Value::Lease(_) => "Lease",
            Value::Status(_) => "Status",
            Value::Clear(_) => "Clear",
            Value::Generations(_) => "Generations",
            Value::Count(_) => "Count",
            Value::Changes(_) => "Changes",
            Value::Located(_) => "Located",
            Value::Engines(_) => "Engines",
        }
    }

    fn unexpected(&self, wanted: &str) -> Error {
        Error::Protocol(format!(
            "the server answered a {} value where {wanted} was expected",
            self.name()
        ))
    }

    /// The result of type `T` this value carries, else a protocol error.
    pub fn into_result<T: ReplyValue>(self) -> Result<T> {
        T::from_value(self)
    }
}

/// An error reply: the [`ErrorKind`] name and the message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireError {
    /// [`ErrorKind::as_str`] of the error (an unknown name decodes as `Protocol`).
    pub kind: String,
    /// The error's message.
    pub message: String,
}

impl From<&Error> for WireError {
    fn from(e: &Error) -> Self {
        WireError {
            kind: e.kind().as_str().to_string(),
            message: e.to_string(),
        }
    }
}

impl From<WireError> for Error {
    fn from(e: WireError) -> Self {
        match ErrorKind::from_name(&e.kind) {
            Some(kind) => Error::from_kind(kind, e.message),
            None => Error::Protocol(format!(
                "the server replied with an error of unknown kind {:?}: {}",
                e.kind, e.message
            )),
        }
    }
}

/// Every reply: `Ok(value)` or `Err{kind, message}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// 0 — the operation succeeded.
    Ok(Value),
    /// 1 — the operation failed (nothing else is implied).
    Err(WireError),
}

impl Reply {
    /// The reply for a core result.
    pub fn from_result(r: Result<Value>) -> Reply {
        match r {
            Ok(v) => Reply::Ok(v),
            Err(e) => Reply::Err(WireError::from(&e)),
        }
    }
    /// An error reply of `kind`.
    pub fn error(kind: ErrorKind, message: impl Into<String>) -> Reply {
        Reply::Err(WireError {
            kind: kind.as_str().to_string(),
            message: message.into(),
        })
    }
    /// The core result this reply stands for.
    pub fn into_result(self) -> Result<Value> {
        match self {
            Reply::Ok(v) => Ok(v),
            Reply::Err(e) => Err(e.into()),
        }
    }
}

// ---------------------------------------------------------------------------
// Encoding

fn frame_with(capacity: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(LEN_BYTES + capacity);
    out.extend_from_slice(&[0; LEN_BYTES]);
    out
}

/// Writes the length prefix of a frame built by [`frame_with`].
fn seal(mut frame: Vec<u8>, max_frame: usize) -> Result<Vec<u8>> {
    let len = frame.len() - LEN_BYTES;
    if len > max_frame {
        return Err(Error::Protocol(format!(
            "a frame of {len} bytes exceeds the {max_frame}-byte frame limit"
        )));
    }
    let len = u32::try_from(len).map_err(|_| {
        Error::Protocol(format!(
            "a frame of {len} bytes exceeds the 4 GiB wire limit"
        ))
    })?;
    frame[..LEN_BYTES].copy_from_slice(&len.to_le_bytes());
    Ok(frame)
}

fn encode_message<T: Serialize>(id: u64, message: &T, max_frame: usize) -> Result<Vec<u8>> {
    let mut frame = frame_with(ID_BYTES + 64);
    frame.extend_from_slice(&id.to_le_bytes());
    let frame = postcard::to_extend(message, frame)
        .map_err(|e| Error::Protocol(format!("cannot encode a message: {e}")))?;
    seal(frame, max_frame)
}

/// A whole request frame: length, id, postcard(request).
pub fn encode_request(id: u64, request: &Request, max_frame: usize) -> Result<Vec<u8>> {
    encode_message(id, request, max_frame)
}

/// A whole reply frame: length, id, postcard(reply).
pub fn encode_reply(id: u64, reply: &Reply, max_frame: usize) -> Result<Vec<u8>> {
    encode_message(id, reply, max_frame)
}

/// Splits a frame payload into its request id and the message bytes.
/// Payloads shorter than the id are a protocol error.
pub fn split_id(payload: &[u8]) -> Result<(u64, &[u8])> {
    match payload.split_first_chunk::<ID_BYTES>() {
        Some((id, body)) => Ok((u64::from_le_bytes(*id), body)),
        None => Err(Error::Protocol(format!(
            "a frame of {} bytes is too short to carry a request id",
            payload.len()
        ))),
    }
}

fn decode_message<'a, T: Deserialize<'a>>(body: &'a [u8], what: &str) -> Result<T> {
    let (value, rest) = postcard::take_from_bytes::<T>(body)
        .map_err(|e| Error::Protocol(format!("malformed {what}: {e}")))?;
    if !rest.is_empty() {
        return Err(Error::Protocol(format!(
            "malformed {what}: {} trailing bytes",
            rest.len()
        )));
    }
    Ok(value)
}

/// Decodes the message bytes of a request frame (after [`split_id`]). An
/// unknown request type or a wrong argument encoding is [`Error::Protocol`].
pub fn decode_request(body: &[u8]) -> Result<Request> {
    decode_message(body, "request")
}

/// Decodes the message bytes of a reply frame (after [`split_id`]).
pub fn decode_reply(body: &[u8]) -> Result<Reply> {
    decode_message(body, "reply")
}

// ---------------------------------------------------------------------------
// Handshake

/// The client's first frame: `MAGIC`, then the lowest and highest protocol
/// versions it speaks (u32 little-endian each).
pub fn encode_hello(min_version: u32, max_version: u32) -> Vec<u8> {
    let mut frame = frame_with(12);
    frame.extend_from_slice(&MAGIC);
    frame.extend_from_slice(&min_version.to_le_bytes());
    frame.extend_from_slice(&max_version.to_le_bytes());
    // 12 bytes always fit any limit.
    let len = (frame.len() - LEN_BYTES) as u32;
    frame[..LEN_BYTES].copy_from_slice(&len.to_le_bytes());
    frame
}

/// Parses a hello payload: `(min_version, max_version)`.
pub fn decode_hello(payload: &[u8]) -> Result<(u32, u32)> {
    match payload {
        [m0, m1, m2, m3, a0, a1, a2, a3, b0, b1, b2, b3] if [*m0, *m1, *m2, *m3] == MAGIC => Ok((
            u32::from_le_bytes([*a0, *a1, *a2, *a3]),
            u32::from_le_bytes([*b0, *b1, *b2, *b3]),
        )),
        _ => Err(Error::Protocol(
            "the peer did not start with an lmcache-rc hello (wrong protocol?)".into(),
        )),
    }
}

/// The server's answer to a hello: `MAGIC`, the chosen version (u32 LE; 0 =
/// refused), then a UTF-8 message (why it was refused; may be empty).
pub fn encode_welcome(version: u32, message: &str) -> Vec<u8> {
    let mut frame = frame_with(8 + message.len());
    frame.extend_from_slice(&MAGIC);
    frame.extend_from_slice(&version.to_le_bytes());
    // Refusal messages are short; cut rather than exceed any limit.
    let message = truncate_utf8(message, 4096);
    frame.extend_from_slice(message.as_bytes());
    let len = (frame.len() - LEN_BYTES) as u32;
    frame[..LEN_BYTES].copy_from_slice(&len.to_le_bytes());
    frame
}

/// Parses a welcome payload: `(version, message)`.
pub fn decode_welcome(payload: &[u8]) -> Result<(u32, String)> {
    match payload {
        [m0, m1, m2, m3, v0, v1, v2, v3, rest @ ..] if [*m0, *m1, *m2, *m3] == MAGIC => Ok((
            u32::from_le_bytes([*v0, *v1, *v2, *v3]),
            String::from_utf8_lossy(rest).into_owned(),
        )),
        _ => Err(Error::Protocol(
            "the peer did not answer with an lmcache-rc welcome (not an lmcache-rc server?)".into(),
        )),
    }
}

/// The version both sides speak (the highest in both ranges), or the
/// refusal message.
pub fn negotiate(min_version: u32, max_version: u32) -> std::result::Result<u32, String> {
    let high = max_version.min(PROTOCOL_VERSION);
    if min_version > max_version || high < min_version.max(MIN_PROTOCOL_VERSION) {
        return Err(format!(
            "unsupported protocol version: the client speaks {min_version}..={max_version}, \
             this server {MIN_PROTOCOL_VERSION}..={PROTOCOL_VERSION}; upgrade the older side"
        ));
    }
    Ok(high)
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

// ---------------------------------------------------------------------------
// Reading frames

/// Why [`read_frame`] returned no frame.
#[derive(Debug)]
pub enum FrameError {
    /// The peer closed the connection at a frame boundary.
    Eof,
    /// The peer closed the connection inside a frame.
    Truncated {
        /// Bytes of the frame received.
        got: usize,
        /// Bytes the frame announced (length prefix included).
        expected: usize,
    },
    /// The length prefix announced more than the limit (nothing more was read).
    Oversize {
        /// The announced payload length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A frame had started but did not complete within the frame timeout
    /// (see [`FrameBounds::frame_timeout`]).
    TimedOut {
        /// Bytes of the frame received.
        got: usize,
        /// Bytes the frame announced (length prefix included; 0 while the
        /// length prefix itself was incomplete).
        expected: usize,
        /// The bound.
        timeout: Duration,
    },
    /// Buffering the frame would exceed the bytes buffered across all
    /// connections (see [`ByteBudget`]).
    OverBudget {
        /// The budget's limit in bytes.
        limit: usize,
    },
    /// The read failed (includes read timeouts).
    Io(io::Error),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Eof => write!(f, "connection closed"),
            FrameError::Truncated { got, expected } => write!(
                f,
                "connection closed inside a frame ({got} of {expected} bytes received)"
            ),
            FrameError::Oversize { len, max } => write!(
                f,
                "a frame of {len} bytes exceeds the {max}-byte frame limit"
            ),
            FrameError::TimedOut {
                got,
                expected,
                timeout,
            } => write!(
                f,
                "a frame did not complete within {:.1} s ({got} of {} bytes received)",
                timeout.as_secs_f64(),
                if *expected == 0 {
                    "?".to_string()
                } else {
                    expected.to_string()
                }
            ),
            FrameError::OverBudget { limit } => write!(
                f,
                "the server is already buffering {limit} bytes of unfinished frames across \
                 its connections; retry later"
            ),
            FrameError::Io(e) => write!(f, "read failed: {e}"),
        }
    }
}

/// Bytes of frames being received, shared by every connection of a server:
/// a frame is buffered only as far as the budget allows, so stalled or
/// oversized frames on many connections cannot exhaust memory.
#[derive(Debug)]
pub struct ByteBudget {
    limit: usize,
    used: AtomicUsize,
}

impl ByteBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> ByteBudget {
        ByteBudget {
            limit,
            used: AtomicUsize::new(0),
        }
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Takes `n` bytes; false (nothing taken) when they do not fit.
    fn take(&self, n: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&total| total <= self.limit)
            })
            .is_ok()
    }

    /// Returns `n` bytes taken earlier.
    fn give(&self, n: usize) {
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_sub(n))
            });
    }
}

/// Bytes of a connection's frame buffer never charged to the budget: small
/// requests are served even while large unfinished frames hold the budget.
pub const UNCHARGED_BYTES: usize = 64 << 10;

/// One connection's receive buffer, charged to a [`ByteBudget`] for its
/// capacity beyond [`UNCHARGED_BYTES`]; the charge is returned when the
/// buffer shrinks or is dropped.
#[derive(Debug)]
pub struct FrameBuffer<'a> {
    buf: Vec<u8>,
    charged: usize,
    budget: &'a ByteBudget,
}

impl<'a> FrameBuffer<'a> {
    /// An empty buffer charged to `budget`.
    pub fn new(budget: &'a ByteBudget) -> FrameBuffer<'a> {
        FrameBuffer {
            buf: Vec::new(),
            charged: 0,
            budget,
        }
    }

    /// The last frame's payload.
    pub fn payload(&self) -> &[u8] {
        &self.buf
    }

    /// Releases the memory (and its charge) when it exceeds `keep` bytes.
    pub fn shrink(&mut self, keep: usize) {
        if self.buf.capacity() > keep {
            self.buf = Vec::new();
            self.budget.give(self.charged);
            self.charged = 0;
        }
    }

    /// Makes room for `more` bytes beyond the current length, charging the
    /// growth beyond [`UNCHARGED_BYTES`]; false when the budget refuses it.
    fn grow(&mut self, more: usize, cap: usize) -> bool {
        let needed = self.buf.len().saturating_add(more);
        if needed <= self.buf.capacity() {
            return true;
        }
        let target = needed
            .max(self.buf.capacity().saturating_mul(2))
            .min(cap.max(needed));
        let extra = target
            .saturating_sub(UNCHARGED_BYTES)
            .saturating_sub(self.charged);
        if !self.budget.take(extra) {
            return false;
        }
        self.charged += extra;
        self.buf.reserve_exact(target - self.buf.len());
        true
    }
}

impl Drop for FrameBuffer<'_> {
    fn drop(&mut self) {
        self.budget.give(self.charged);
    }
}

/// Limits on reading one frame ([`read_frame_bounded`]).
#[derive(Debug, Clone, Copy)]
pub struct FrameBounds {
    /// Largest payload accepted.
    pub max_frame: usize,
    /// Once the first byte of a frame arrived, the whole frame must arrive
    /// within this time. The stream's read timeout must be set to it too
    /// (so that a silent peer wakes the reader); a read that times out
    /// before a frame started is not an error (idle connections are fine).
    pub frame_timeout: Duration,
}

/// Bytes read per step: a frame's buffer grows as its bytes arrive, never
/// by what its length prefix claims.
const READ_STEP: usize = 64 << 10;

/// Fills `buf` completely; `Ok(n < buf.len())` only at end of stream.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Reads one frame's payload into `buf` (replacing its contents). The limit
/// is checked before anything beyond the length prefix is read, and the
/// buffer grows as bytes arrive (a length prefix alone allocates nothing).
pub fn read_frame(
    r: &mut impl Read,
    max_frame: usize,
    buf: &mut Vec<u8>,
) -> std::result::Result<(), FrameError> {
    let mut len = [0u8; LEN_BYTES];
    match read_full(r, &mut len).map_err(FrameError::Io)? {
        0 => return Err(FrameError::Eof),
        n if n < LEN_BYTES => {
            return Err(FrameError::Truncated {
                got: n,
                expected: LEN_BYTES,
            });
        }
        _ => {}
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > max_frame {
        return Err(FrameError::Oversize {
            len,
            max: max_frame,
        });
    }
    buf.clear();
    let got = (&mut *r)
        .take(len as u64)
        .read_to_end(buf)
        .map_err(FrameError::Io)?;
    if got < len {
        return Err(FrameError::Truncated {
            got: LEN_BYTES + got,
            expected: LEN_BYTES + len,
        });
    }
    Ok(())
}

/// Whether a read error is the stream's read timeout.
fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// [`read_frame`] for a server: a frame that started must complete within
/// [`FrameBounds::frame_timeout`], and its buffer is charged to the shared
/// budget as it grows (a frame the budget cannot hold is
/// [`FrameError::OverBudget`]). Waiting for the first byte of a frame is
/// unbounded: the stream's read timeout only wakes the loop.
pub fn read_frame_bounded(
    r: &mut impl Read,
    bounds: &FrameBounds,
    buf: &mut FrameBuffer<'_>,
) -> std::result::Result<(), FrameError> {
    let mut len = [0u8; LEN_BYTES];
    let mut got = 0;
    let mut deadline: Option<Instant> = None;
    let timed_out = |got: usize, expected: usize| FrameError::TimedOut {
        got,
        expected,
        timeout: bounds.frame_timeout,
    };
    // The length prefix: idle until its first byte.
    while got < LEN_BYTES {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Eof),
            Ok(0) => {
                return Err(FrameError::Truncated {
                    got,
                    expected: LEN_BYTES,
                });
            }
            Ok(n) => {
                got += n;
                let start = *deadline.get_or_insert_with(|| Instant::now() + bounds.frame_timeout);
                if Instant::now() > start {
                    return Err(timed_out(got, 0));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => match deadline {
                None => {}
                Some(d) if Instant::now() < d => {}
                Some(_) => return Err(timed_out(got, 0)),
            },
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    let deadline = deadline.unwrap_or_else(|| Instant::now() + bounds.frame_timeout);
    let len = u32::from_le_bytes(len) as usize;
    if len > bounds.max_frame {
        return Err(FrameError::Oversize {
            len,
            max: bounds.max_frame,
        });
    }
    let expected = LEN_BYTES + len;
    buf.buf.clear();
    while buf.buf.len() < len {
        let step = (len - buf.buf.len()).min(READ_STEP);
        if !buf.grow(step, len) {
            return Err(FrameError::OverBudget {
                limit: buf.budget.limit(),
            });
        }
        let at = buf.buf.len();
        buf.buf.resize(at + step, 0);
        let result = r.read(&mut buf.buf[at..]);
        let n = match &result {
            Ok(n) => *n,
            Err(_) => 0,
        };
        buf.buf.truncate(at + n);
        match result {
            Ok(0) => {
                return Err(FrameError::Truncated {
                    got: LEN_BYTES + at,
                    expected,
                });
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
        if Instant::now() > deadline && buf.buf.len() < len {
            return Err(timed_out(LEN_BYTES + buf.buf.len(), expected));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Writing frames

/// Writes all of `frame` to a Unix stream (no SIGPIPE; honours the socket's
/// write timeout). On failure, also tells how many bytes left before it: a
/// frame of which nothing left cannot have reached the peer.
pub fn send_frame(
    stream: &std::os::unix::net::UnixStream,
    frame: &[u8],
) -> std::result::Result<(), (usize, io::Error)> {
    use rustix::net::{SendFlags, send};
    let mut sent = 0;
    while sent < frame.len() {
        match send(stream.as_fd(), &frame[sent..], SendFlags::NOSIGNAL) {
            Ok(0) => {
                let e = io::Error::new(io::ErrorKind::WriteZero, "socket closed");
                return Err((sent, e));
            }
            Ok(n) => sent += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err((sent, e.into())),
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Frames that carry a descriptor (the welcome hands over the pool)

/// [`send_frame`], with `fd` attached (`SCM_RIGHTS`) to the frame's first
/// bytes: the receiver gets its own descriptor of the same open file.
pub fn send_frame_with_fd(
    stream: &std::os::unix::net::UnixStream,
    frame: &[u8],
    fd: BorrowedFd<'_>,
) -> std::result::Result<(), (usize, io::Error)> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
    if frame.is_empty() {
        return Err((0, io::Error::other("a descriptor needs at least one byte")));
    }
    let fds = [fd];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err((0, io::Error::other("no room for the descriptor")));
    }
    let sent = loop {
        match sendmsg(
            stream.as_fd(),
            &[IoSlice::new(frame)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Ok(0) => {
                return Err((0, io::Error::new(io::ErrorKind::WriteZero, "socket closed")));
            }
            Ok(n) => break n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err((0, e.into())),
        }
    };
    send_frame(stream, &frame[sent..]).map_err(|(more, e)| (sent + more, e))
}

/// Most descriptors accepted with one frame; more are closed at once.
const MAX_FDS: usize = 4;

/// [`read_frame`] straight from a Unix socket (`recvmsg`), collecting the
/// descriptors that arrive with the frame's bytes (close-on-exec). Reads
/// exactly one frame, never a byte of the next. Descriptors beyond
/// four per read are closed; ancillary data the kernel had to cut
/// (`MSG_CTRUNC`) is an I/O error.
pub fn read_frame_with_fds(
    stream: &std::os::unix::net::UnixStream,
    max_frame: usize,
    buf: &mut Vec<u8>,
) -> std::result::Result<Vec<OwnedFd>, FrameError> {
    let mut fds = Vec::new();
    let mut len = [0u8; LEN_BYTES];
    match recv_full(stream, &mut len, &mut fds).map_err(FrameError::Io)? {
        0 => return Err(FrameError::Eof),
        n if n < LEN_BYTES => {
            return Err(FrameError::Truncated {
                got: n,
                expected: LEN_BYTES,
            });
        }
        _ => {}
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > max_frame {
        return Err(FrameError::Oversize {
            len,
            max: max_frame,
        });
    }
    buf.clear();
    buf.resize(len, 0);
    let got = recv_full(stream, buf, &mut fds).map_err(FrameError::Io)?;
    if got < len {
        return Err(FrameError::Truncated {
            got: LEN_BYTES + got,
            expected: LEN_BYTES + len,
        });
    }
    Ok(fds)
}

/// Fills `buf` with `recvmsg`; `Ok(n < buf.len())` only at end of stream.
fn recv_full(
    stream: &std::os::unix::net::UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<usize> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, recvmsg};
    let mut got = 0;
    while got < buf.len() {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let received = match recvmsg(
            stream.as_fd(),
            &mut [IoSliceMut::new(&mut buf[got..])],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(r) => r,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        };
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received_fds) = message {
                for fd in received_fds {
                    if fds.len() < MAX_FDS {
                        fds.push(fd);
                    }
                }
            }
        }
        if received.flags.contains(ReturnFlags::CTRUNC) {
            return Err(io::Error::other(
                "the peer sent more descriptors than expected (ancillary data truncated)",
            ));
        }
        if received.bytes == 0 {
            break;
        }
        got += received.bytes;
    }
    Ok(got)
}
