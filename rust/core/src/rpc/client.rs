//! The RPC client: thread-safe, pipelining, reconnecting.
//!
//! One [`Client`] holds at most one connection. Any number of threads call
//! it at once: each call gets a fresh request id, registers a reply slot,
//! writes its frame under the connection's write lock and waits on its slot
//! (looking at it for a few microseconds before it sleeps, so a prompt reply
//! costs no second thread wake-up); a reader thread per connection routes
//! replies to slots by id. Blocking
//! calls wait at most the configured timeout ([`Error::Timeout`]; the server
//! may still carry the call out, and its late reply is dropped); the `*_async`
//! calls return a [`Pending`] future instead.
//!
//! When the connection is lost (the server stopped or restarted), every call
//! in flight fails with [`Error::Unavailable`] and the next call connects
//! again (with a new handshake), so a restarted server is picked up without
//! a new client. Calls never retry by themselves: whether a lost call took
//! effect is for the caller to reconcile.
//!
//! Each handshake hands the client the server's pool as a descriptor;
//! [`Client::share_pool`] returns it with the capabilities of the same connection
//! (so the id and size describe exactly that pool).

use std::collections::HashMap;
use std::io::BufReader;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, ErrorKind, Result};
use crate::protocol::{Capabilities, Checkpoints, CheckpointsAsync, Pending, Waitable};

use super::wire::{
    self, CONNECTION_ERROR_ID, FrameError, Reply, ReplyValue, Request, Value, WireArg, WireError,
};

/// Settings of a [`Client`].
#[derive(Debug, Clone, PartialEq)]
pub struct ClientConfig {
    /// How long a blocking call waits for its reply.
    pub timeout: Duration,
    /// How long connecting (the handshake) may take.
    pub connect_timeout: Duration,
    /// Largest frame payload sent or accepted, in bytes.
    pub max_frame: usize,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
            max_frame: wire::DEFAULT_MAX_FRAME,
        }
    }
}

type SlotResult = std::result::Result<Value, WireError>;

/// Where one call's reply lands.
struct Slot {
    result: Mutex<Option<SlotResult>>,
    ready: Condvar,
    /// Set (after `result`) once the reply or the failure is in: what a
    /// waiter spinning before it sleeps reads without the lock.
    done: AtomicBool,
}

/// How long a waiter checks its slot before it sleeps on the condition
/// variable. A reply usually arrives within a round trip (microseconds);
/// seeing it while still running saves the waiter a second wake-up (the
/// reader thread's is the first), which on a virtual machine with idle
/// CPUs costs tens of microseconds. The check yields the CPU between looks,
/// so the reader and the server run meanwhile.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(30);

impl Slot {
    fn new() -> Arc<Slot> {
        Arc::new(Slot {
            result: Mutex::new(None),
            ready: Condvar::new(),
            done: AtomicBool::new(false),
        })
    }
    fn complete(&self, result: SlotResult) {
        let mut r = self.result.lock();
        if r.is_none() {
            *r = Some(result);
        }
        self.done.store(true, Ordering::Release);
        self.ready.notify_all();
    }
    /// Waits until the reply is in, at most `SPIN_BEFORE_SLEEP` and never
    /// past `deadline`, without sleeping.
    fn spin(&self, deadline: Option<Instant>) {
        let start = Instant::now();
        let until = deadline.map_or(start + SPIN_BEFORE_SLEEP, |d| {
            d.min(start + SPIN_BEFORE_SLEEP)
        });
        while !self.done.load(Ordering::Acquire) && Instant::now() < until {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
            std::thread::yield_now();
        }
    }
}

fn wire_error(kind: ErrorKind, message: impl Into<String>) -> WireError {
    WireError {
        kind: kind.as_str().to_string(),
        message: message.into(),
    }
}

struct Calls {
    /// Set once the connection is unusable; later calls fail with it.
    dead: Option<WireError>,
    slots: HashMap<u64, Arc<Slot>>,
}

/// One connection to the server.
struct Conn {
    writer: Mutex<UnixStream>,
    calls: Mutex<Calls>,
    /// The server's pool, received with the welcome.
    pool: OwnedFd,
    /// Its id, named by the welcome.
    pool_id: String,
}

impl Conn {
    fn alive(&self) -> bool {
        self.calls.lock().dead.is_none()
    }
    /// Marks the connection dead and fails every call in flight.
    fn fail_all(&self, error: WireError) {
        let slots: Vec<Arc<Slot>> = {
            let mut calls = self.calls.lock();
            if calls.dead.is_none() {
                calls.dead = Some(error.clone());
            }
            calls.slots.drain().map(|(_, s)| s).collect()
        };
        for slot in slots {
            slot.complete(Err(error.clone()));
        }
        let _ = self.writer.lock().shutdown(std::net::Shutdown::Both);
    }
    fn forget(&self, id: u64) {
        self.calls.lock().slots.remove(&id);
    }
}

/// A reply that may not have arrived yet (see [`Client::call_async`]).
pub struct PendingReply {
    slot: Arc<Slot>,
    conn: Option<Arc<Conn>>,
    id: u64,
    what: &'static str,
}

impl std::fmt::Debug for PendingReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingReply")
            .field("id", &self.id)
            .field("what", &self.what)
            .field("done", &self.is_done())
            .finish()
    }
}

impl PendingReply {
    fn failed(what: &'static str, error: &Error) -> PendingReply {
        let slot = Slot::new();
        slot.complete(Err(WireError::from(error)));
        PendingReply {
            slot,
            conn: None,
            id: 0,
            what,
        }
    }

    /// Whether the reply (or the failure) is in.
    pub fn is_done(&self) -> bool {
        self.slot.result.lock().is_some()
    }

    /// The operation's name.
    pub fn operation(&self) -> &'static str {
        self.what
    }

    /// Waits up to `timeout` (None = forever) and returns the result; may be
    /// called again (the result is kept). A wait that times out returns
    /// [`Error::Timeout`] and leaves the call pending.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Value> {
        let deadline = timeout.map(|t| Instant::now() + t);
        self.slot.spin(deadline);
        let mut r = self.slot.result.lock();
        loop {
            if let Some(result) = r.as_ref() {
                return result.clone().map_err(Error::from);
            }
            match deadline {
                None => self.slot.ready.wait(&mut r),
                Some(d) => {
                    if self.slot.ready.wait_until(&mut r, d).timed_out() && r.is_none() {
                        return Err(Error::Timeout(format!(
                            "no reply to {} within {:.3} s",
                            self.what,
                            timeout.unwrap_or_default().as_secs_f64()
                        )));
                    }
                }
            }
        }
    }

    /// Gives up on the reply: a late reply is dropped.
    fn abandon(&self) {
        if let Some(conn) = &self.conn {
            conn.forget(self.id);
        }
    }
}

/// A [`PendingReply`] whose value is converted to the operation's type:
/// what the client's `*_async` calls return inside a [`Pending`].
struct Typed<T> {
    raw: PendingReply,
    convert: fn(Value) -> Result<T>,
}

impl<T> Waitable<T> for Typed<T> {
    fn is_done(&self) -> bool {
        self.raw.is_done()
    }
    fn wait(&self, timeout: Option<Duration>) -> Result<T> {
        self.raw.wait(timeout).and_then(self.convert)
    }
    fn abandon(&self) {
        self.raw.abandon();
    }
}

/// A client of one server socket (see the [module docs](self)).
pub struct Client {
    path: PathBuf,
    config: ClientConfig,
    conn: Mutex<Option<Arc<Conn>>>,
    /// Serialises connecting, so that `conn` is only ever held briefly and
    /// `is_connected` never waits for a connect in progress.
    opening: Mutex<()>,
    closed: AtomicBool,
    next_id: AtomicU64,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("socket", &self.path)
            .field("connected", &self.is_connected())
            .finish()
    }
}

impl Client {
    /// Connects to the server at `socket` with default settings. Fails with
    /// [`Error::Unavailable`] when nothing answers there.
    pub fn connect(socket: impl AsRef<Path>) -> Result<Client> {
        Self::connect_with(socket, ClientConfig::default())
    }

    /// [`Client::connect`] with settings. A path longer than a Unix socket
    /// can have is [`Error::InvalidInput`] (no server could listen there).
    pub fn connect_with(socket: impl AsRef<Path>, config: ClientConfig) -> Result<Client> {
        let len = socket.as_ref().as_os_str().len();
        if len > super::server::MAX_SOCKET_PATH_BYTES {
            return Err(Error::invalid(format!(
                "socket path {} is {len} bytes long; a Unix socket path holds at most {} bytes",
                socket.as_ref().display(),
                super::server::MAX_SOCKET_PATH_BYTES
            )));
        }
        let client = Client {
            path: socket.as_ref().to_path_buf(),
            config,
            conn: Mutex::new(None),
            opening: Mutex::new(()),
            closed: AtomicBool::new(false),
            next_id: AtomicU64::new(1),
        };
        client.connection()?;
        Ok(client)
    }

    /// The socket path.
    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// The settings.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// Whether a live connection is open now.
    pub fn is_connected(&self) -> bool {
        self.live_connection().is_some()
    }

    /// [`Checkpoints::capabilities`], callable without naming the trait
    /// (the transfer engine's lease interface names a method of that name too).
    pub fn capabilities(&self) -> Result<Capabilities> {
        Checkpoints::capabilities(self)
    }

    /// The server's pool: the capabilities (pool id and size) and a new
    /// descriptor of the pool, both from the same connection, so they
    /// describe one pool even when the server restarts meanwhile (then the
    /// call is made again on the new connection, a few times at most).
    pub fn share_pool(&self) -> Result<(Capabilities, OwnedFd)> {
        let mut last = None;
        for _ in 0..3 {
            let conn = self.connection()?;
            let pending = self.call_async(Request::Capabilities {});
            let caps = match pending.wait(Some(self.config.timeout)) {
                Ok(v) => v.into_result::<Capabilities>()?,
                Err(e) => {
                    pending.abandon();
                    return Err(e);
                }
            };
            let same = pending.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn));
            if same && caps.pool_id == conn.pool_id {
                let fd = rustix::io::fcntl_dupfd_cloexec(&conn.pool, 0)
                    .map_err(|e| Error::io("duplicate the pool descriptor", e.into()))?;
                return Ok((caps, fd));
            }
            last = Some(caps);
        }
        Err(Error::Unavailable(format!(
            "the lmcache-rc server at {} kept restarting while its pool was requested \
             (last pool: {:?})",
            self.path.display(),
            last.map(|c| c.pool_id)
        )))
    }

    /// The id of the pool the server behind the live connection announced
    /// in its welcome; connects (again) first when needed, but makes no
    /// call. A worker compares it with the pool it mapped.
    pub fn pool_id(&self) -> Result<String> {
        Ok(self.connection()?.pool_id.clone())
    }

    /// Closes the connection; later calls fail with [`Error::Closed`].
    /// Leases obtained through this client stay live on the server.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        if let Some(conn) = self.conn.lock().take() {
            conn.fail_all(WireError::from(&Error::Closed("lmcache-rc client")));
        }
    }

    /// The current connection if it is alive.
    fn live_connection(&self) -> Option<Arc<Conn>> {
        self.conn.lock().as_ref().filter(|c| c.alive()).cloned()
    }

    /// The live connection, connecting (again) if needed. Only one caller
    /// connects at a time; the others wait for it (not for `conn`).
    fn connection(&self) -> Result<Arc<Conn>> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(Error::Closed("lmcache-rc client"));
        }
        if let Some(c) = self.live_connection() {
            return Ok(c);
        }
        let _opening = self.opening.lock();
        if let Some(c) = self.live_connection() {
            return Ok(c); // another caller connected meanwhile
        }
        let conn = self.open()?;
        let mut guard = self.conn.lock();
        if self.closed.load(Ordering::SeqCst) {
            conn.fail_all(WireError::from(&Error::Closed("lmcache-rc client")));
            return Err(Error::Closed("lmcache-rc client"));
        }
        *guard = Some(conn.clone());
        Ok(conn)
    }

    fn unavailable(&self, what: &str, e: impl std::fmt::Display) -> Error {
        Error::Unavailable(format!(
            "{what} the lmcache-rc server at {}: {e} (is `lmcache-rc serve` running?)",
            self.path.display()
        ))
    }

    /// Connects and performs the version handshake.
    fn open(&self) -> Result<Arc<Conn>> {
        let stream = UnixStream::connect(&self.path)
            .map_err(|e| self.unavailable("cannot connect to", e))?;
        let setup = |s: &UnixStream| -> std::io::Result<()> {
            s.set_read_timeout(Some(
                self.config.connect_timeout.max(Duration::from_millis(1)),
            ))?;
            s.set_write_timeout(Some(self.config.timeout.max(Duration::from_millis(1))))
        };
        setup(&stream).map_err(|e| self.unavailable("cannot configure a socket to", e))?;
        let greeted = wire::send_frame(
            &stream,
            &wire::encode_hello(wire::MIN_PROTOCOL_VERSION, wire::PROTOCOL_VERSION),
        )
        .map_err(|(_, e)| e);
        let mut buf = Vec::new();
        let answer = wire::read_frame_with_fds(&stream, 8 + 4096, &mut buf);
        if let Err(e) = greeted {
            // The server may have refused (and closed) before reading the
            // hello: its reason, if it arrived, says more than the reset.
            if answer.is_ok() {
                if let Ok((0, message)) = wire::decode_welcome(&buf) {
                    return Err(Error::Protocol(format!(
                        "the lmcache-rc server at {} refused the connection: {message}",
                        self.path.display()
                    )));
                }
            }
            return Err(self.unavailable("cannot greet", e));
        }
        let mut fds = match answer {
            Ok(fds) => fds,
            Err(FrameError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(self.unavailable(
                    "no handshake answer within the connect timeout from",
                    format!("{:?}", self.config.connect_timeout),
                ));
            }
            Err(e) => return Err(self.unavailable("handshake failed with", e)),
        };
        let (version, message) = wire::decode_welcome(&buf)?;
        if version == 0 {
            return Err(Error::Protocol(format!(
                "the lmcache-rc server at {} refused the connection: {message}",
                self.path.display()
            )));
        }
        if !(wire::MIN_PROTOCOL_VERSION..=wire::PROTOCOL_VERSION).contains(&version) {
            return Err(Error::Protocol(format!(
                "the lmcache-rc server at {} chose protocol version {version}, which this client \
                 ({}..={}) does not speak",
                self.path.display(),
                wire::MIN_PROTOCOL_VERSION,
                wire::PROTOCOL_VERSION
            )));
        }
        if fds.len() != 1 {
            return Err(Error::Protocol(format!(
                "the lmcache-rc server at {} sent {} descriptors with its welcome; exactly one \
                 (the shared-memory pool) was expected",
                self.path.display(),
                fds.len()
            )));
        }
        let pool = fds.remove(0);
        let pool_id = message;
        if pool_id.is_empty() || !pool_id.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(Error::Protocol(format!(
                "the lmcache-rc server at {} named its pool {pool_id:?} (not a pool id)",
                self.path.display()
            )));
        }
        stream
            .set_read_timeout(None)
            .map_err(|e| self.unavailable("cannot configure a socket to", e))?;
        let reader = stream
            .try_clone()
            .map_err(|e| self.unavailable("cannot clone a socket to", e))?;
        let conn = Arc::new(Conn {
            writer: Mutex::new(stream),
            calls: Mutex::new(Calls {
                dead: None,
                slots: HashMap::new(),
            }),
            pool,
            pool_id,
        });
        let for_thread = conn.clone();
        let max_frame = self.config.max_frame;
        let path = self.path.display().to_string();
        std::thread::Builder::new()
            .name("lmcache-rc-client".into())
            .spawn(move || read_replies(for_thread, reader, max_frame, path))
            .map_err(|e| self.unavailable("cannot start a reader thread for", e))?;
        Ok(conn)
    }

    /// Sends `request`; the reply arrives in the returned [`PendingReply`]
    /// (failures to send, too). A send that fails before its first byte
    /// left (the connection had already died, e.g. the server restarted
    /// since the last call) cannot have reached the server: it is retried
    /// once on a fresh connection.
    pub fn call_async(&self, request: Request) -> PendingReply {
        let what = request.name();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = match wire::encode_request(id, &request, self.config.max_frame) {
            Ok(f) => f,
            Err(e) => return PendingReply::failed(what, &e),
        };
        drop(request);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let conn = match self.connection() {
                Ok(c) => c,
                Err(e) => return PendingReply::failed(what, &e),
            };
            let slot = Slot::new();
            {
                let mut calls = conn.calls.lock();
                if let Some(dead) = &calls.dead {
                    slot.complete(Err(dead.clone()));
                    return PendingReply {
                        slot,
                        conn: None,
                        id,
                        what,
                    };
                }
                calls.slots.insert(id, slot.clone());
            }
            let result = wire::send_frame(&conn.writer.lock(), &frame);
            if let Err((sent, e)) = result {
                conn.fail_all(wire_error(
                    ErrorKind::Unavailable,
                    format!(
                        "sending {what} to the lmcache-rc server at {} failed: {e} \
                         (the server stopped or restarted)",
                        self.path.display()
                    ),
                ));
                if sent == 0 && attempt == 1 && !self.closed.load(Ordering::SeqCst) {
                    continue;
                }
            }
            return PendingReply {
                slot,
                conn: Some(conn),
                id,
                what,
            };
        }
    }

    /// Sends `request` and waits up to the configured timeout for its reply.
    pub fn call(&self, request: Request) -> Result<Value> {
        self.call_with_timeout(request, self.config.timeout)
    }

    /// [`Client::call`] with an explicit timeout.
    pub fn call_with_timeout(&self, request: Request, timeout: Duration) -> Result<Value> {
        let pending = self.call_async(request);
        let result = pending.wait(Some(timeout));
        if matches!(&result, Err(Error::Timeout(_))) {
            pending.abandon();
        }
        result
    }

    fn typed<T>(&self, request: Request, convert: fn(Value) -> Result<T>) -> Result<T> {
        self.call(request).and_then(convert)
    }

    fn typed_async<T: 'static>(
        &self,
        request: Request,
        convert: fn(Value) -> Result<T>,
    ) -> Pending<T> {
        let raw = self.call_async(request);
        Pending::new(raw.operation(), Typed { raw, convert })
    }
}

/// Implements [`Checkpoints`] and [`CheckpointsAsync`] over the wire from
/// the [operation table](crate::for_each_operation): each call builds its
/// request from its arguments ([`WireArg`]) and converts its reply value
/// ([`ReplyValue`]). The blocking call waits up to the configured timeout;
/// the `*_async` call pipelines and returns a [`Pending`] future.
macro_rules! client_operations {
    ([] $({
        $(#[$doc:meta])*
        $tag:literal $variant:ident
        fn $name:ident / $name_async:ident ( $($arg:ident : $ty:ty),* ) -> $out:ty; py $py:tt
    })*) => {
        impl Checkpoints for Client {
            $(
                fn $name(&self, $($arg: $ty),*) -> Result<$out> {
                    self.typed(
                        Request::$variant { $($arg: <fn($ty) as WireArg>::to_wire($arg)),* },
                        <$out as ReplyValue>::from_value,
                    )
                }
            )*
        }

        impl CheckpointsAsync for Client {
            $(
                fn $name_async(&self, $($arg: $ty),*) -> Pending<$out> {
                    self.typed_async(
                        Request::$variant { $($arg: <fn($ty) as WireArg>::to_wire($arg)),* },
                        <$out as ReplyValue>::from_value,
                    )
                }
            )*
        }
    };
}

crate::for_each_operation!(client_operations);

impl Drop for Client {
    fn drop(&mut self) {
        self.close();
    }
}

/// The reader thread: routes replies to their slots until the connection
/// ends, then fails whatever is still in flight.
fn read_replies(conn: Arc<Conn>, stream: UnixStream, max_frame: usize, path: String) {
    let mut reader = BufReader::with_capacity(64 << 10, stream);
    let mut buf = Vec::new();
    let error = loop {
        match wire::read_frame(&mut reader, max_frame, &mut buf) {
            Ok(()) => {}
            Err(FrameError::Eof) => {
                break wire_error(
                    ErrorKind::Unavailable,
                    format!(
                        "the lmcache-rc server at {path} closed the connection (it stopped or \
                         restarted); the call's outcome is unknown"
                    ),
                );
            }
            Err(e @ FrameError::Oversize { .. }) => {
                break wire_error(
                    ErrorKind::Protocol,
                    format!("the lmcache-rc server at {path} sent an oversize reply: {e}"),
                );
            }
            Err(e) => {
                break wire_error(
                    ErrorKind::Unavailable,
                    format!("the connection to the lmcache-rc server at {path} failed: {e}"),
                );
            }
        }
        let (id, body) = match wire::split_id(&buf) {
            Ok(x) => x,
            Err(e) => break WireError::from(&e),
        };
        let reply = wire::decode_reply(body);
        if id == CONNECTION_ERROR_ID {
            break match reply {
                Ok(Reply::Err(e)) => wire_error(
                    ErrorKind::Protocol,
                    format!(
                        "the lmcache-rc server at {path} closed the connection: {}",
                        e.message
                    ),
                ),
                _ => wire_error(
                    ErrorKind::Protocol,
                    format!("the lmcache-rc server at {path} sent a malformed connection error"),
                ),
            };
        }
        let slot = conn.calls.lock().slots.remove(&id);
        if let Some(slot) = slot {
            slot.complete(match reply {
                Ok(Reply::Ok(v)) => Ok(v),
                Ok(Reply::Err(e)) => Err(e),
                Err(e) => Err(WireError::from(&e)),
            });
        }
        if buf.capacity() > 1 << 20 {
            buf = Vec::new();
        }
    };
    conn.fail_all(error);
}
