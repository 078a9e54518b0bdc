//! The RPC client: thread-safe, pipelining, reconnecting.
//!
//! One [`Client`] holds at most one connection. Any number of threads call
//! it at once: each call gets a fresh request id, registers a reply slot,
//! writes its frame under the connection's write lock and waits for its
//! slot. Replies are read by the callers themselves (leader/follower): a
//! waiting caller that finds nobody reading the socket becomes the *leader*
//! and reads replies, handing each to its slot, until its own arrives; then
//! it passes the reading on to a caller still waiting (a *follower*, asleep
//! on its slot) and returns. A lone call thus costs one thread wake-up on
//! each side, as a raw socket ping-pong does, instead of a reader thread's
//! wake-up and then the caller's. A small watcher thread per connection
//! notices a server that hangs up while no call is in flight (without
//! waking for replies) and reads replies nobody waits for (an `*_async`
//! future never waited on), within [`WATCH_BUSY`]; a future's
//! [`PendingReply::is_done`] reads what has arrived itself. Blocking calls
//! wait at most the configured timeout ([`Error::Timeout`]; the server may
//! still carry the call out, and its late reply is dropped); the `*_async`
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
    self, CONNECTION_ERROR_ID, FrameError, LEN_BYTES, Reply, ReplyValue, Request, Value, WireArg,
    WireError,
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
    /// Wakes the slot's waiter when the reply is in, or when it is to read
    /// for the others (the leader left). Waited on, and signalled, with the
    /// connection's `calls` lock held.
    ready: Condvar,
    /// Set (after `result`) once the reply or the failure is in: read
    /// without a lock.
    done: AtomicBool,
}

/// How often the watcher thread looks for replies nobody reads while calls
/// are in flight (an `*_async` future no one waits on); waiting callers
/// read their replies themselves, at once.
pub const WATCH_BUSY: Duration = Duration::from_millis(20);
/// How often it looks while no call is in flight (a hang-up wakes it at once).
const WATCH_IDLE: Duration = Duration::from_millis(500);
/// Bytes the reply buffer grows by (and keeps between replies).
const READ_CHUNK: usize = 64 << 10;
/// The reply buffer is released once empty when it grew beyond this.
const KEEP_READ_BUFFER: usize = 1 << 20;

impl Slot {
    fn new() -> Arc<Slot> {
        Arc::new(Slot {
            result: Mutex::new(None),
            ready: Condvar::new(),
            done: AtomicBool::new(false),
        })
    }
    /// Stores the result (the first one wins) and wakes the waiter. Called
    /// with the connection's `calls` lock held, or before anyone can wait.
    fn complete(&self, result: SlotResult) {
        let mut r = self.result.lock();
        if r.is_none() {
            *r = Some(result);
        }
        self.done.store(true, Ordering::Release);
        self.ready.notify_all();
    }
    fn is_done(&self) -> bool {
        self.done.load(Ordering::Acquire)
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
    /// A thread is reading replies (the leader).
    leader: bool,
    /// Slots whose waiter sleeps until its reply is in (or it is to lead).
    followers: Vec<Arc<Slot>>,
}

/// The bytes read and not yet handed to slots; only the leader touches it.
struct Inbox {
    buf: Vec<u8>,
    /// Where the first unrouted frame starts in `buf`.
    start: usize,
}

/// How long a leader reads.
enum Until<'a> {
    /// Until this slot is done, or the deadline passes.
    Done(&'a Slot, Option<Instant>),
    /// Until nothing more is readable now (never sleeps).
    Drained,
}

/// One connection to the server.
struct Conn {
    writer: Mutex<UnixStream>,
    /// The same socket, read by the leader and watched by the watcher.
    reader: UnixStream,
    inbox: Mutex<Inbox>,
    calls: Mutex<Calls>,
    /// `calls.dead.is_some()`, readable without the lock.
    is_dead: AtomicBool,
    /// The server's pool, received with the welcome.
    pool: OwnedFd,
    /// Its id, named by the welcome.
    pool_id: String,
    max_frame: usize,
    /// The socket path, for messages.
    path: String,
}

impl Conn {
    fn alive(&self) -> bool {
        !self.is_dead.load(Ordering::Acquire)
    }
    /// Marks the connection dead and fails every call in flight.
    fn fail_all(&self, error: WireError) {
        {
            let mut calls = self.calls.lock();
            if calls.dead.is_none() {
                calls.dead = Some(error.clone());
            }
            self.is_dead.store(true, Ordering::Release);
            for (_, slot) in calls.slots.drain() {
                slot.complete(Err(error.clone()));
            }
        }
        // Wakes a leader asleep in poll and the watcher.
        let _ = self.writer.lock().shutdown(std::net::Shutdown::Both);
    }
    fn forget(&self, id: u64) {
        self.calls.lock().slots.remove(&id);
    }

    /// Waits until `slot` is done or `deadline` passes, reading replies
    /// as the leader whenever nobody else does.
    fn wait_for(&self, slot: &Arc<Slot>, deadline: Option<Instant>) {
        let mut calls = self.calls.lock();
        loop {
            if slot.is_done() {
                return;
            }
            if let Some(dead) = &calls.dead {
                // Not in flight any more (every slot in flight was failed).
                slot.complete(Err(dead.clone()));
                return;
            }
            if !calls.leader {
                calls.leader = true;
                drop(calls);
                self.lead(Until::Done(slot, deadline));
                calls = self.calls.lock();
                Self::hand_on(&mut calls);
                if slot.is_done() || deadline.is_some_and(|d| Instant::now() >= d) {
                    return;
                }
                continue;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return;
            }
            calls.followers.push(slot.clone());
            match deadline {
                None => slot.ready.wait(&mut calls),
                Some(d) => {
                    let _ = slot.ready.wait_until(&mut calls, d);
                }
            }
            if let Some(at) = calls.followers.iter().position(|f| Arc::ptr_eq(f, slot)) {
                calls.followers.swap_remove(at);
            }
        }
    }

    /// Reads what has arrived without waiting, unless someone else reads.
    fn drain(&self) {
        {
            let mut calls = self.calls.lock();
            if calls.leader || calls.dead.is_some() {
                return;
            }
            calls.leader = true;
        }
        self.lead(Until::Drained);
        Self::hand_on(&mut self.calls.lock());
    }

    /// The leader stops reading: a follower (if any) takes over.
    fn hand_on(calls: &mut Calls) {
        calls.leader = false;
        if let Some(next) = calls.followers.iter().find(|f| !f.is_done()) {
            next.ready.notify_one();
        }
    }

    /// Reads replies and hands them to their slots, as the one leader.
    fn lead(&self, until: Until<'_>) {
        let mut inbox = self.inbox.lock();
        loop {
            if let Err(e) = self.route_buffered(&mut inbox) {
                drop(inbox);
                self.fail_all(e);
                return;
            }
            if !self.alive() {
                return;
            }
            if let Until::Done(slot, deadline) = until {
                if slot.is_done() {
                    return;
                }
                if !self.readable(deadline) {
                    return; // the deadline passed
                }
            }
            if inbox.buf.capacity() - inbox.buf.len() < READ_CHUNK / 4 {
                inbox.buf.reserve(READ_CHUNK);
            }
            let got = rustix::net::recv(
                &self.reader,
                rustix::buffer::spare_capacity(&mut inbox.buf),
                rustix::net::RecvFlags::DONTWAIT,
            );
            match got {
                Ok((0, _)) => {
                    drop(inbox);
                    self.fail_all(wire_error(
                        ErrorKind::Unavailable,
                        format!(
                            "the lmcache-rc server at {} closed the connection (it stopped or \
                             restarted); the call's outcome is unknown",
                            self.path
                        ),
                    ));
                    return;
                }
                Ok(_) => {}
                Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {
                    if matches!(until, Until::Drained) {
                        return;
                    }
                }
                Err(e) => {
                    drop(inbox);
                    self.fail_all(wire_error(
                        ErrorKind::Unavailable,
                        format!(
                            "the connection to the lmcache-rc server at {} failed: read failed: \
                             {e}",
                            self.path
                        ),
                    ));
                    return;
                }
            }
        }
    }

    /// Sleeps until the socket has something to read (or hung up); false
    /// once `deadline` passed.
    fn readable(&self, deadline: Option<Instant>) -> bool {
        use rustix::event::{PollFd, PollFlags, Timespec, poll};
        loop {
            let timeout = match deadline {
                None => None,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    Some(Timespec {
                        tv_sec: left.as_secs() as _,
                        tv_nsec: left.subsec_nanos() as _,
                    })
                }
            };
            let mut fds = [PollFd::new(&self.reader, PollFlags::IN)];
            match poll(&mut fds, timeout.as_ref()) {
                Ok(0) => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return false;
                    }
                }
                Err(rustix::io::Errno::INTR) => {}
                // Readable, hung up, or an error the read will report.
                _ => return true,
            }
        }
    }

    /// Hands every complete frame in the buffer to its slot; an error is
    /// the connection's end (an oversize or malformed reply, or the
    /// server's connection-level error).
    fn route_buffered(&self, inbox: &mut Inbox) -> std::result::Result<(), WireError> {
        loop {
            let avail = &inbox.buf[inbox.start..];
            if avail.len() < LEN_BYTES {
                break;
            }
            let mut len = [0u8; LEN_BYTES];
            len.copy_from_slice(&avail[..LEN_BYTES]);
            let len = u32::from_le_bytes(len) as usize;
            if len > self.max_frame {
                let e = FrameError::Oversize {
                    len,
                    max: self.max_frame,
                };
                return Err(wire_error(
                    ErrorKind::Protocol,
                    format!(
                        "the lmcache-rc server at {} sent an oversize reply: {e}",
                        self.path
                    ),
                ));
            }
            if avail.len() < LEN_BYTES + len {
                let missing = LEN_BYTES + len - avail.len();
                inbox.buf.reserve(missing.max(READ_CHUNK));
                break;
            }
            self.route(&avail[LEN_BYTES..LEN_BYTES + len])?;
            inbox.start += LEN_BYTES + len;
        }
        if inbox.start == inbox.buf.len() {
            inbox.start = 0;
            inbox.buf.clear();
            if inbox.buf.capacity() > KEEP_READ_BUFFER {
                inbox.buf = Vec::with_capacity(READ_CHUNK);
            }
        } else if inbox.start > 0 {
            // Part of a frame: move it to the front.
            inbox.buf.drain(..inbox.start);
            inbox.start = 0;
        }
        Ok(())
    }

    /// Hands one reply frame to its slot (a reply to a forgotten call is
    /// dropped).
    fn route(&self, frame: &[u8]) -> std::result::Result<(), WireError> {
        let (id, body) = wire::split_id(frame).map_err(|e| WireError::from(&e))?;
        let reply = wire::decode_reply(body);
        if id == CONNECTION_ERROR_ID {
            return Err(match reply {
                Ok(Reply::Err(e)) => wire_error(
                    ErrorKind::Protocol,
                    format!(
                        "the lmcache-rc server at {} closed the connection: {}",
                        self.path, e.message
                    ),
                ),
                _ => wire_error(
                    ErrorKind::Protocol,
                    format!(
                        "the lmcache-rc server at {} sent a malformed connection error",
                        self.path
                    ),
                ),
            });
        }
        let result = match reply {
            Ok(Reply::Ok(v)) => Ok(v),
            Ok(Reply::Err(e)) => Err(e),
            Err(e) => Err(WireError::from(&e)),
        };
        let calls = &mut *self.calls.lock();
        if let Some(slot) = calls.slots.remove(&id) {
            slot.complete(result);
        }
        Ok(())
    }
}

/// The watcher thread: ends the connection when the server hangs up while
/// nobody reads, and reads replies nobody waits for (see the module docs).
/// It never wakes for a reply: it polls for the hang-up alone.
fn watch(conn: Arc<Conn>) {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    while conn.alive() {
        let every = if conn.calls.lock().slots.is_empty() {
            WATCH_IDLE
        } else {
            WATCH_BUSY
        };
        let timeout = Timespec {
            tv_sec: every.as_secs() as _,
            tv_nsec: every.subsec_nanos() as _,
        };
        let mut fds = [PollFd::new(&conn.reader, PollFlags::RDHUP)];
        let hung = match poll(&mut fds, Some(&timeout)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => false,
            Ok(_) => true,
            Err(_) => true,
        };
        if !conn.alive() {
            return;
        }
        let lead = {
            let mut calls = conn.calls.lock();
            let unread = !calls.slots.is_empty() && calls.followers.is_empty();
            let lead = !calls.leader && (hung || unread);
            if lead {
                calls.leader = true;
            }
            lead
        };
        if lead {
            conn.lead(Until::Drained);
            Conn::hand_on(&mut conn.calls.lock());
        }
        if hung && conn.alive() {
            // Another thread leads and will read the end; let it.
            std::thread::sleep(Duration::from_millis(1));
        }
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

    /// Whether the reply (or the failure) is in; reads what has arrived
    /// when nobody else is reading.
    pub fn is_done(&self) -> bool {
        if !self.slot.is_done()
            && let Some(conn) = &self.conn
        {
            conn.drain();
        }
        self.slot.is_done()
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
        if let Some(conn) = &self.conn {
            conn.wait_for(&self.slot, deadline);
        }
        match self.slot.result.lock().as_ref() {
            Some(result) => result.clone().map_err(Error::from),
            None => Err(Error::Timeout(format!(
                "no reply to {} within {:.3} s",
                self.what,
                timeout.unwrap_or_default().as_secs_f64()
            ))),
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

    /// The id of the pool of the live connection, without connecting
    /// (None when no connection is open now).
    pub fn live_pool_id(&self) -> Option<String> {
        self.live_connection().map(|c| c.pool_id.clone())
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
            if answer.is_ok()
                && let Ok((0, message)) = wire::decode_welcome(&buf)
            {
                return Err(Error::Protocol(format!(
                    "the lmcache-rc server at {} refused the connection: {message}",
                    self.path.display()
                )));
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
            reader,
            inbox: Mutex::new(Inbox {
                buf: Vec::with_capacity(READ_CHUNK),
                start: 0,
            }),
            calls: Mutex::new(Calls {
                dead: None,
                slots: HashMap::new(),
                leader: false,
                followers: Vec::new(),
            }),
            is_dead: AtomicBool::new(false),
            pool,
            pool_id,
            max_frame: self.config.max_frame,
            path: self.path.display().to_string(),
        });
        let for_thread = conn.clone();
        std::thread::Builder::new()
            .name("lmcache-rc-client".into())
            .spawn(move || watch(for_thread))
            .map_err(|e| self.unavailable("cannot start a watcher thread for", e))?;
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
