//! The RPC server: a Unix-socket listener in front of one [`CheckpointService`].
//!
//! Threads: one accept thread; one thread per connection (bounded by
//! [`ServerConfig::max_connections`]) that reads frames and answers
//! requests inline. A `prepare_store` is answered inline when the pages fit
//! L1 now ([`CheckpointService::try_prepare_store_for`]: no thread hand-off
//! on a store lease); one that must wait for evictions (up to the service's
//! admission timeout) runs on a thread of its own so that a pipelining
//! client's other requests — e.g. the `finish_store` that frees the space —
//! are never queued behind it; so does `find` when a shared tier is
//! configured (it may wait up to the shared lookup timeout). Those threads
//! (`lmcache-rc-offload`) are kept for [`OFFLOAD_IDLE`] after their request
//! and take the next one: starting a thread per store cost a pipelined
//! store lease milliseconds while copies kept the cores busy
//! (`transfer_breakdown` example). Replies go out under a
//! per-connection write lock with a write timeout, so a client that stops
//! reading loses its own connection and never blocks anyone else.
//!
//! Requests are carried out through [`Request::apply`] on [`Served`], the
//! service as the server exposes it: the same operations, except that
//! admission stops at shutdown and status adds the RPC layer's counters
//! (a [`Decorator`] of the service overriding just those four operations).
//!
//! Leases belong to processes, not to connections. Each connection records
//! its peer process ([`Peer`]: `SO_PEERCRED` pid, pinned by a pidfd or its
//! start time) and the leases it obtains are held by that process. A client
//! that disconnects while its process lives leaves its leases live (its
//! worker may still be copying, or reconnect and finish them); when the
//! connection closes because the process is gone, its leases are reclaimed
//! at once (see [`CheckpointService::peer_disconnected`]), and the service's
//! sweep catches processes that vanished without closing. A finish, poll or
//! cancel that names another rank than the lease's is refused by the service.
//!
//! One server per socket: the server holds an exclusive lock (`flock`) on
//! `<socket>.lock` for its lifetime, so a second server on the same socket
//! refuses to start while the first lives, and a crashed server's lock goes
//! with its process (its stale socket file is then replaced).

use std::collections::HashMap;
use std::io::{BufReader, ErrorKind as IoKind};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, ErrorKind, Result};
use crate::manifest::Manifest;
use crate::peer::Peer;
use crate::protocol::{Checkpoints, Decorator, Lease, MissReason, ServiceStatus};
use crate::service::{CheckpointService, Holder, ServiceConfig};

use super::wire::{
    self, CONNECTION_ERROR_ID, FrameError, Reply, ReplyValue, Request, Value, WireArg,
};

/// How long a new connection may take to send its hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the accept loop checks for shutdown.
const ACCEPT_POLL: Duration = Duration::from_millis(100);
/// Most `prepare_store` calls running on threads of their own at once
/// (beyond it they run on the connection's thread).
const MAX_OFFLOADED: usize = 256;
/// How long an offload thread waits for another request before it ends.
const OFFLOAD_IDLE: Duration = Duration::from_secs(5);
/// How often an idle offload thread checks for shutdown.
const OFFLOAD_POLL: Duration = Duration::from_millis(100);
/// A connection's frame buffer is released after a frame larger than this.
const KEEP_BUFFER: usize = 64 << 10;
/// Bytes of a connection's socket read buffer.
const READ_BUFFER: usize = 16 << 10;
/// How long a closed connection's process may take to be reported gone
/// (it closes its sockets just before it exits) for its leases to be
/// reclaimed at once; later, the service's sweep reclaims them.
const EXIT_GRACE: Duration = Duration::from_millis(250);

/// Settings of the RPC layer (the service has its own [`ServiceConfig`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ServerConfig {
    /// The socket path. Its directory is created with mode 0700 when missing;
    /// an existing one must be owned by this user and not writable by others.
    pub socket: PathBuf,
    /// Largest frame payload accepted or sent, in bytes.
    pub max_frame: usize,
    /// Most connections served at once; more are refused at the handshake.
    /// Lowered at start to what the open-file limit allows beside the
    /// descriptors kept for L2 and SQLite (see [`crate::limits`]).
    pub max_connections: usize,
    /// Once a request frame started arriving, the whole frame must arrive
    /// within this time, or the connection is closed. A connection idle
    /// between frames is never timed out.
    pub frame_timeout: Duration,
    /// Bytes of unfinished and undecoded request frames buffered across
    /// all connections; a frame that would exceed it closes its connection
    /// with an `Unavailable` error.
    pub max_buffered_bytes: usize,
    /// A reply that cannot be written within this time closes its connection.
    pub write_timeout: Duration,
    /// How long [`Server::shutdown`] lets live leases drain.
    pub drain_timeout: Duration,
    /// Remove the socket's directory at shutdown (a temporary directory
    /// made for this server, see [`temp_socket_path`]).
    pub remove_dir_on_stop: bool,
}

impl ServerConfig {
    /// Defaults for a server on `socket`.
    pub fn new(socket: impl Into<PathBuf>) -> ServerConfig {
        ServerConfig {
            socket: socket.into(),
            max_frame: wire::DEFAULT_MAX_FRAME,
            max_connections: 1024,
            frame_timeout: Duration::from_secs(10),
            max_buffered_bytes: 256 << 20,
            write_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(30),
            remove_dir_on_stop: false,
        }
    }
}

/// What a shutdown did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ShutdownReport {
    /// Every lease finished within the drain bound.
    pub drained: bool,
    /// Leases (store + retrieve) still live when the server stopped.
    pub live_leases: u64,
    /// Why closing the service failed (it is then dropped, which still
    /// drains its L2 queue); None when it closed cleanly.
    pub close_error: Option<String>,
}

impl std::fmt::Display for ShutdownReport {
    /// For people and logs: `every lease finished, service closed cleanly`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.drained {
            f.write_str("every lease finished")?;
        } else {
            write!(
                f,
                "{} lease(s) still live after the drain timeout",
                self.live_leases
            )?;
        }
        match &self.close_error {
            None => f.write_str(", service closed cleanly"),
            Some(e) => write!(f, ", closing the service failed: {e}"),
        }
    }
}

/// The socket a sidecar listens on when none is configured:
/// `$XDG_RUNTIME_DIR/lmcache-rc/sidecar.sock` when that directory exists,
/// else `/tmp/lmcache-rc-<uid>/sidecar.sock`.
pub fn default_socket_path() -> PathBuf {
    let runtime = std::env::var_os("XDG_RUNTIME_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .filter(|d| d.is_dir());
    let dir = match runtime {
        Some(d) => d.join("lmcache-rc"),
        None => PathBuf::from(format!(
            "/tmp/lmcache-rc-{}",
            rustix::process::getuid().as_raw()
        )),
    };
    dir.join("sidecar.sock")
}

/// A fresh socket path `<tmp>/lmcache-rc-<pid>-<n>/sidecar.sock` in a new
/// directory of mode 0700 (the embedded server's default).
pub fn temp_socket_path() -> Result<PathBuf> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let base = std::env::temp_dir();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    for _ in 0..64 {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = base.join(format!("lmcache-rc-{}-{nanos:08x}-{n}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir.join("sidecar.sock")),
            Err(e) if e.kind() == IoKind::AlreadyExists => continue,
            Err(e) => return Err(Error::io(format!("create {}", dir.display()), e)),
        }
    }
    Err(Error::invalid(format!(
        "could not create a fresh socket directory under {}",
        base.display()
    )))
}

/// One served connection's write side.
struct Conn {
    id: u64,
    writer: Mutex<UnixStream>,
    dead: AtomicBool,
}

struct Registered {
    stream: UnixStream,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    service: Arc<CheckpointService>,
    config: ServerConfig,
    socket_id: (u64, u64),
    /// The exclusive lock on `<socket>.lock`, held while the server runs.
    lock: Mutex<Option<InstanceLock>>,
    admitting: AtomicBool,
    stopping: AtomicBool,
    conns: Mutex<HashMap<u64, Registered>>,
    next_conn: AtomicU64,
    offloaded: AtomicUsize,
    /// Requests waiting for an offload thread, and the threads.
    offload: Mutex<OffloadQueue>,
    /// Signals a queued request (or shutdown) to idle offload threads.
    offload_ready: Condvar,
    requests: AtomicU64,
    protocol_errors: AtomicU64,
    connections_total: AtomicU64,
    /// Bytes of request frames being received, across connections.
    buffered: wire::ByteBudget,
    frames_timed_out: AtomicU64,
    frames_over_budget: AtomicU64,
}

/// A running RPC server (see the [module docs](self)). Stops at
/// [`Server::shutdown`] or, without draining, when dropped.
pub struct Server {
    shared: Arc<Shared>,
    accept: Mutex<Option<JoinHandle<()>>>,
    report: Mutex<Option<ShutdownReport>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("socket", &self.shared.config.socket)
            .field("service", &self.shared.service)
            .finish()
    }
}

impl Server {
    /// Binds the socket, then opens the service (so a live server on the same
    /// socket is detected before its pool could be replaced), then serves.
    pub fn open(service: ServiceConfig, config: ServerConfig) -> Result<Server> {
        let (listener, socket_id, lock) = bind_socket(&config.socket)?;
        match CheckpointService::open(service) {
            Ok(svc) => Self::serve(Arc::new(svc), config, listener, socket_id, lock),
            Err(e) => {
                remove_socket(&config.socket, socket_id);
                drop(lock);
                if config.remove_dir_on_stop {
                    remove_dir(&config.socket);
                }
                Err(e)
            }
        }
    }

    /// Serves an already opened service.
    pub fn start(service: Arc<CheckpointService>, config: ServerConfig) -> Result<Server> {
        let (listener, socket_id, lock) = bind_socket(&config.socket)?;
        Self::serve(service, config, listener, socket_id, lock)
    }

    fn serve(
        service: Arc<CheckpointService>,
        mut config: ServerConfig,
        listener: UnixListener,
        socket_id: (u64, u64),
        lock: InstanceLock,
    ) -> Result<Server> {
        if let Err(e) = listener.set_nonblocking(true) {
            remove_socket(&config.socket, socket_id);
            return Err(Error::io("make the RPC listener non-blocking", e));
        }
        if config.max_buffered_bytes < config.max_frame {
            remove_socket(&config.socket, socket_id);
            return Err(Error::invalid(format!(
                "rpc_max_buffered_bytes ({}) must be at least the frame limit ({} bytes)",
                config.max_buffered_bytes, config.max_frame
            )));
        }
        config.max_connections = connection_budget(config.max_connections);
        let buffered = wire::ByteBudget::new(config.max_buffered_bytes);
        let shared = Arc::new(Shared {
            service,
            config,
            socket_id,
            lock: Mutex::new(Some(lock)),
            admitting: AtomicBool::new(true),
            stopping: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            offloaded: AtomicUsize::new(0),
            offload: Mutex::new(OffloadQueue::default()),
            offload_ready: Condvar::new(),
            requests: AtomicU64::new(0),
            protocol_errors: AtomicU64::new(0),
            connections_total: AtomicU64::new(0),
            buffered,
            frames_timed_out: AtomicU64::new(0),
            frames_over_budget: AtomicU64::new(0),
        });
        let for_thread = shared.clone();
        let accept = std::thread::Builder::new()
            .name("lmcache-rc-accept".into())
            .spawn(move || accept_loop(for_thread, listener))
            .map_err(|e| {
                remove_socket(&shared.config.socket, shared.socket_id);
                Error::io("spawn the RPC accept thread", e)
            })?;
        log::info!("RPC server listening on {}", shared.config.socket.display());
        Ok(Server {
            shared,
            accept: Mutex::new(Some(accept)),
            report: Mutex::new(None),
        })
    }

    /// The socket clients connect to.
    pub fn socket_path(&self) -> &Path {
        &self.shared.config.socket
    }

    /// The service behind the server (in-process callers and tests).
    pub fn service(&self) -> &Arc<CheckpointService> {
        &self.shared.service
    }

    /// The service's status plus the RPC layer's counters
    /// (`rpc_connections`, `rpc_requests`, `rpc_protocol_errors`,
    /// `rpc_connections_total`) and its socket (`info["socket"]`).
    pub fn status(&self) -> Result<ServiceStatus> {
        status_of(&self.shared)
    }

    /// The server as the HTTP admin API serves it: every operation is the
    /// service's, but `status` is the server's (RPC counters and socket
    /// included), so `GET /status` answers what the RPC `status` does.
    pub fn admin_view(&self) -> Arc<dyn Checkpoints> {
        Arc::new(AdminView {
            shared: self.shared.clone(),
        })
    }

    /// Whether [`Server::shutdown`] ran.
    pub fn is_stopped(&self) -> bool {
        self.report.lock().is_some()
    }

    /// Graceful shutdown with the configured drain bound.
    pub fn shutdown(&self) -> Result<ShutdownReport> {
        self.shutdown_with(self.shared.config.drain_timeout)
    }

    /// Graceful shutdown: stop admitting new work (begin answers false,
    /// prepare_store and begin_retrieve miss with reason `shutdown`) while
    /// connections keep being served; wait up to `drain` for live leases to
    /// finish; stop accepting and close every connection; close the service
    /// (drains the L2 queue, closes the directory); remove the socket.
    /// Idempotent: a second call returns the first report.
    pub fn shutdown_with(&self, drain: Duration) -> Result<ShutdownReport> {
        let mut report_slot = self.report.lock();
        if let Some(report) = report_slot.as_ref() {
            return Ok(report.clone());
        }
        let shared = &self.shared;
        shared.admitting.store(false, Ordering::SeqCst);
        let deadline = Instant::now() + drain;
        let mut live = live_leases(shared);
        while (live > 0 || shared.offloaded.load(Ordering::SeqCst) > 0) && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
            live = live_leases(shared);
        }
        let drained = live == 0;
        if !drained {
            log::warn!("shutting down with {live} live lease(s) after a {drain:?} drain");
        }
        shared.stopping.store(true, Ordering::SeqCst);
        shared.offload_ready.notify_all();
        if let Some(accept) = self.accept.lock().take() {
            let _ = accept.join();
        }
        let conns: Vec<Registered> = shared.conns.lock().drain().map(|(_, r)| r).collect();
        for r in &conns {
            let _ = r.stream.shutdown(std::net::Shutdown::Both);
        }
        for r in conns {
            if let Some(t) = r.thread {
                let _ = t.join();
            }
        }
        // prepare_store calls on threads of their own end within the
        // service's admission timeout; wait for them (bounded) so the close
        // below sees their leases.
        let bound = Instant::now() + Duration::from_secs(10);
        while (shared.offloaded.load(Ordering::SeqCst) > 0 || shared.offload.lock().threads > 0)
            && Instant::now() < bound
        {
            shared.offload_ready.notify_all();
            std::thread::sleep(Duration::from_millis(5));
        }
        let live = live_leases(shared);
        let close_error = match shared.service.close() {
            Ok(()) => None,
            Err(e) => {
                log::warn!("closing the checkpoint service at shutdown: {e}");
                Some(e.to_string())
            }
        };
        remove_socket(&shared.config.socket, shared.socket_id);
        // The lock goes last: until the socket is gone, no new server may
        // take this socket path over.
        drop(shared.lock.lock().take());
        if shared.config.remove_dir_on_stop {
            remove_dir(&shared.config.socket);
        }
        let report = ShutdownReport {
            drained,
            live_leases: live,
            close_error,
        };
        log::info!(
            "RPC server on {} stopped: {report}",
            shared.config.socket.display()
        );
        *report_slot = Some(report.clone());
        Ok(report)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown_with(Duration::ZERO) {
            log::warn!("RPC server shutdown failed: {e}");
        }
    }
}

fn live_leases(shared: &Shared) -> u64 {
    match shared.service.status() {
        Ok(s) => {
            let v = |k: &str| s.values.get(k).copied().unwrap_or(0);
            v("store_leases") + v("retrieve_leases")
        }
        Err(_) => 0,
    }
}

fn status_of(shared: &Shared) -> Result<ServiceStatus> {
    let mut s = shared.service.status()?;
    let rpc = [
        ("rpc_connections", shared.conns.lock().len() as u64),
        (
            "rpc_connections_total",
            shared.connections_total.load(Ordering::Relaxed),
        ),
        ("rpc_requests", shared.requests.load(Ordering::Relaxed)),
        (
            "rpc_protocol_errors",
            shared.protocol_errors.load(Ordering::Relaxed),
        ),
        ("rpc_max_connections", shared.config.max_connections as u64),
        ("rpc_buffered_bytes", shared.buffered.used() as u64),
        (
            "rpc_frames_timed_out",
            shared.frames_timed_out.load(Ordering::Relaxed),
        ),
        (
            "rpc_frames_over_budget",
            shared.frames_over_budget.load(Ordering::Relaxed),
        ),
    ];
    s.values
        .extend(rpc.into_iter().map(|(k, v)| (k.to_string(), v)));
    s.info.insert(
        "socket".into(),
        Some(shared.config.socket.display().to_string()),
    );
    Ok(s)
}

/// Descriptors one served connection holds (the stream and its clones for
/// the registry and the writer).
const FDS_PER_CONNECTION: u64 = 3;

/// Raises the open-file limit and lowers `configured` connections to what
/// fits beside the descriptors kept for the tiers.
fn connection_budget(configured: usize) -> usize {
    let limit = crate::limits::raise_nofile_limit();
    let Some(fit) = crate::limits::connections_that_fit(limit, FDS_PER_CONNECTION) else {
        return configured;
    };
    let fit = usize::try_from(fit).unwrap_or(usize::MAX);
    if fit < configured {
        log::warn!(
            "serving at most {fit} RPC connections (max_connections is {configured}): the \
             open-file limit is {} and {} descriptors stay reserved for L2 and the directory; \
             raise the hard limit (ulimit -Hn, systemd LimitNOFILE=) to serve more",
            limit.soft.unwrap_or(0),
            crate::limits::FD_RESERVE
        );
        return fit;
    }
    configured
}

// ---------------------------------------------------------------------------
// The socket

fn stat_id(meta: &std::fs::Metadata) -> (u64, u64) {
    (meta.dev(), meta.ino())
}

/// The exclusive lock a running server holds on `<socket>.lock` (see the
/// [module docs](self)). Dropping it removes the lock file (while still
/// holding the lock, and only if the path still is this lock's file) and
/// releases the lock.
struct InstanceLock {
    path: PathBuf,
    file: std::fs::File,
}

impl Drop for InstanceLock {
    fn drop(&mut self) {
        if let (Ok(ours), Ok(now)) = (self.file.metadata(), std::fs::symlink_metadata(&self.path))
            && stat_id(&ours) == stat_id(&now)
            && let Err(e) = std::fs::remove_file(&self.path)
        {
            log::debug!("lock file {} not removed: {e}", self.path.display());
        }
        // Closing the file releases the flock.
    }
}

/// `<socket>.lock`: the path of a socket's instance lock.
fn lock_path(socket: &Path) -> PathBuf {
    let mut name = socket.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// Takes the instance lock of `socket` without waiting: a live server on
/// that socket holds it, so the caller learns that instead of replacing its
/// socket. The lock file is opened without following symlinks and created
/// with mode 0600. A file unlinked (by a stopping server) between our open
/// and our lock is not the lock any more: open and lock again.
fn take_instance_lock(socket: &Path) -> Result<InstanceLock> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = lock_path(socket);
    for _ in 0..16 {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| Error::io(format!("open lock file {}", path.display()), e))?;
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                return Err(Error::io(
                    format!("bind {}", socket.display()),
                    std::io::Error::new(
                        IoKind::AddrInUse,
                        format!(
                            "another lmcache-rc server is running on this socket (it holds {}); \
                             stop it first or choose another --socket",
                            path.display()
                        ),
                    ),
                ));
            }
            Err(e) => {
                return Err(Error::io(format!("lock {}", path.display()), e.into()));
            }
        }
        let ours = file
            .metadata()
            .map_err(|e| Error::io(format!("stat lock file {}", path.display()), e))?;
        match std::fs::symlink_metadata(&path) {
            Ok(now) if stat_id(&now) == stat_id(&ours) => {
                return Ok(InstanceLock { path, file });
            }
            _ => continue, // replaced or removed meanwhile: try again
        }
    }
    Err(Error::io(
        format!("lock {}", path.display()),
        std::io::Error::other("the lock file keeps being replaced"),
    ))
}

/// The longest path a Unix socket can be bound or reached at: `sun_path`
/// holds 108 bytes on Linux, the last one the terminating NUL.
pub const MAX_SOCKET_PATH_BYTES: usize = 107;

/// Refuses a socket path the kernel cannot bind, naming the path, its
/// length and the limit (before anything is created). The server binds a
/// temporary name in the same directory first (`tmp`), so the limit is
/// lower when the file name is shorter than that one.
fn check_socket_path_len(path: &Path, tmp: &Path) -> Result<()> {
    let len = path.as_os_str().len();
    let extra = tmp.as_os_str().len().saturating_sub(len);
    let limit = MAX_SOCKET_PATH_BYTES - extra.min(MAX_SOCKET_PATH_BYTES);
    if len <= limit {
        return Ok(());
    }
    let why = if extra > 0 {
        format!(
            "the limit is {limit} bytes here ({MAX_SOCKET_PATH_BYTES} bytes for a Unix \
             socket path, less {extra} because the server first binds a longer temporary \
             name beside it)"
        )
    } else {
        format!("a Unix socket path holds at most {MAX_SOCKET_PATH_BYTES} bytes")
    };
    Err(Error::invalid(format!(
        "socket path {} is {len} bytes long; {why}: choose a shorter path",
        path.display()
    )))
}

/// Creates the directory (0700) if needed and checks an existing one;
/// takes the socket's instance lock (a live server holds it: refused);
/// replaces a stale socket file; binds under a temporary name, sets mode
/// 0600, and renames it into place (so the socket is never reachable with a
/// wider mode under its final name).
fn bind_socket(path: &Path) -> Result<(UnixListener, (u64, u64), InstanceLock)> {
    let name = path.file_name().ok_or_else(|| {
        Error::invalid(format!("socket path {} has no file name", path.display()))
    })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".lmrc{}.{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    check_socket_path_len(path, &tmp)?;
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| Error::io(format!("create socket directory {}", dir.display()), e))?;
    }
    // lstat: a socket directory reached through a link is refused (another
    // user could point it at a directory of theirs).
    let meta = std::fs::symlink_metadata(&dir)
        .map_err(|e| Error::io(format!("stat socket directory {}", dir.display()), e))?;
    if meta.file_type().is_symlink() {
        return Err(Error::invalid(format!(
            "socket directory {} is a symbolic link; lmcache-rc does not follow links there: \
             pass a socket in a real directory to --socket",
            dir.display()
        )));
    }
    let uid = rustix::process::geteuid().as_raw();
    if !meta.is_dir() {
        return Err(Error::invalid(format!(
            "socket directory {} is not a directory",
            dir.display()
        )));
    }
    if meta.uid() != uid || meta.permissions().mode() & 0o022 != 0 {
        return Err(Error::invalid(format!(
            "socket directory {} must be owned by this user (uid {uid}) and not writable by \
             group or others (it is uid {}, mode {:o}); choose a private directory",
            dir.display(),
            meta.uid(),
            meta.permissions().mode() & 0o7777
        )));
    }
    let lock = take_instance_lock(path)?;
    match std::fs::symlink_metadata(path) {
        Ok(existing) if existing.file_type().is_socket() => {
            // We hold the lock, so no lmcache-rc server of this build runs
            // here; something that still answers is an older server or a
            // stranger: refuse rather than steal its socket.
            if UnixStream::connect(path).is_ok() {
                return Err(Error::io(
                    format!("bind {}", path.display()),
                    std::io::Error::new(
                        IoKind::AddrInUse,
                        "another server is listening on this socket",
                    ),
                ));
            }
            log::info!("replacing stale socket {}", path.display());
        }
        Ok(_) => {
            return Err(Error::invalid(format!(
                "{} exists and is not a socket; choose another socket path",
                path.display()
            )));
        }
        Err(_) => {}
    }
    let _ = std::fs::remove_file(&tmp);
    let listener =
        UnixListener::bind(&tmp).map_err(|e| Error::io(format!("bind {}", tmp.display()), e))?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| Error::io(format!("chmod 0600 {}", tmp.display()), e))
        .and_then(|()| {
            std::fs::rename(&tmp, path).map_err(|e| {
                Error::io(
                    format!("rename {} to {}", tmp.display(), name.to_string_lossy()),
                    e,
                )
            })
        })
        .and_then(|()| {
            std::fs::symlink_metadata(path)
                .map(|m| stat_id(&m))
                .map_err(|e| Error::io(format!("stat {}", path.display()), e))
        });
    match placed {
        Ok(id) => Ok((listener, id, lock)),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Removes the socket file if it still is ours (a newer server's is kept).
fn remove_socket(path: &Path, id: (u64, u64)) {
    if let Ok(meta) = std::fs::symlink_metadata(path)
        && stat_id(&meta) == id
        && let Err(e) = std::fs::remove_file(path)
    {
        log::warn!("could not remove socket {}: {e}", path.display());
    }
}

fn remove_dir(socket: &Path) {
    if let Some(dir) = socket.parent()
        && let Err(e) = std::fs::remove_dir(dir)
    {
        log::debug!("socket directory {} not removed: {e}", dir.display());
    }
}

// ---------------------------------------------------------------------------
// Accepting and serving connections

fn accept_loop(shared: Arc<Shared>, listener: UnixListener) {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let timeout = Timespec {
        tv_sec: 0,
        tv_nsec: ACCEPT_POLL.as_nanos() as _,
    };
    while !shared.stopping.load(Ordering::SeqCst) {
        let mut fds = [PollFd::new(&listener, PollFlags::IN)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                log::warn!("polling the RPC listener failed: {e}");
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
        }
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == IoKind::WouldBlock || e.kind() == IoKind::Interrupted => {
                continue;
            }
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                log::warn!("accepting an RPC connection failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        admit(&shared, stream);
    }
}

fn admit(shared: &Arc<Shared>, stream: UnixStream) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_write_timeout(Some(shared.config.write_timeout));
    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let clone = match stream.try_clone() {
        Ok(c) => c,
        Err(e) => {
            log::warn!("cannot serve an RPC connection: {e}");
            return;
        }
    };
    {
        let mut conns = shared.conns.lock();
        if conns.len() >= shared.config.max_connections {
            drop(conns);
            refuse(
                stream,
                &format!(
                    "too many connections (the limit is {}); retry later",
                    shared.config.max_connections
                ),
            );
            return;
        }
        conns.insert(
            id,
            Registered {
                stream: clone,
                thread: None,
            },
        );
    }
    shared.connections_total.fetch_add(1, Ordering::Relaxed);
    let for_thread = shared.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("lmcache-rc-conn-{id}"))
        .spawn(move || serve_connection(for_thread, id, stream));
    match spawned {
        Ok(handle) => {
            if let Some(r) = shared.conns.lock().get_mut(&id) {
                r.thread = Some(handle);
            }
        }
        Err(e) => {
            log::warn!("cannot spawn a thread for an RPC connection: {e}");
            if let Some(r) = shared.conns.lock().remove(&id) {
                let _ = r.stream.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

/// Answers with a refusal (best effort, before even reading the hello: a
/// Unix socket keeps the welcome readable after close) and closes.
fn refuse(stream: UnixStream, message: &str) {
    let _ = stream.set_write_timeout(Some(Duration::from_millis(200)));
    let _ = send_all(&stream, &wire::encode_welcome(0, message));
    // Read the client's hello before closing: closing a Unix socket with
    // unread data resets the connection, and the client could then see a
    // reset instead of the reason.
    let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
    let mut buf = Vec::new();
    let mut reader = &stream;
    let _ = wire::read_frame(&mut reader, 4096, &mut buf);
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

/// Writes all of `frame` (see [`wire::send_frame`]).
fn send_all(stream: &UnixStream, frame: &[u8]) -> std::io::Result<()> {
    wire::send_frame(stream, frame).map_err(|(_, e)| e)
}

impl Conn {
    fn send(&self, shared: &Shared, id: u64, reply: &Reply) {
        if self.dead.load(Ordering::Relaxed) {
            return;
        }
        let frame = match wire::encode_reply(id, reply, shared.config.max_frame) {
            Ok(f) => f,
            Err(e) => {
                match wire::encode_reply(id, &Reply::from_result(Err(e)), shared.config.max_frame) {
                    Ok(f) => f,
                    Err(_) => return,
                }
            }
        };
        let writer = self.writer.lock();
        if let Err(e) = send_all(&writer, &frame) {
            log::info!(
                "RPC connection {}: reply not delivered ({e}); closing it",
                self.id
            );
            self.dead.store(true, Ordering::SeqCst);
            let _ = writer.shutdown(std::net::Shutdown::Both);
        }
    }
}

fn serve_connection(shared: Arc<Shared>, id: u64, stream: UnixStream) {
    let writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            log::warn!("RPC connection {id}: {e}");
            shared.conns.lock().remove(&id);
            return;
        }
    };
    // Who is on the other end, read while it waits for the welcome.
    let peer = Peer::of_socket(&stream).map(Arc::new);
    let holder = match &peer {
        Some(p) => Holder::Process(p.clone()),
        None => {
            log::info!(
                "RPC connection {id}: the peer's process is not visible from here (another pid \
                 namespace?); its leases end only when it finishes them"
            );
            Holder::Untracked
        }
    };
    let conn = Arc::new(Conn {
        id,
        writer: Mutex::new(writer),
        dead: AtomicBool::new(false),
    });
    if handshake(&shared, &conn, &stream) {
        read_requests(&shared, &conn, &holder, stream);
    }
    // Close now, even while a prepare_store of this connection still runs
    // on its own thread (its reply then goes nowhere; the lease stays live).
    let _ = conn.writer.lock().shutdown(std::net::Shutdown::Both);
    shared.conns.lock().remove(&id);
    match &peer {
        Some(p) if !shared.stopping.load(Ordering::SeqCst) => {
            let reclaimed = shared.service.peer_disconnected(p, EXIT_GRACE);
            log::debug!(
                "RPC connection {id} of {} closed; leases reclaimed: {} store, {} retrieve",
                p.key(),
                reclaimed.store_leases,
                reclaimed.retrieve_leases
            );
        }
        _ => log::debug!("RPC connection {id} closed"),
    }
}

/// Reads the hello and answers it; false = the connection is done. An
/// accepted welcome carries the pool's descriptor.
fn handshake(shared: &Shared, conn: &Conn, stream: &UnixStream) -> bool {
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let mut buf = Vec::new();
    let mut reader = stream;
    let hello = match wire::read_frame(&mut reader, 64, &mut buf) {
        Ok(()) => wire::decode_hello(&buf),
        Err(FrameError::Eof) => return false,
        Err(e) => Err(Error::Protocol(format!("no valid hello: {e}"))),
    };
    let answer = hello.and_then(|(min, max)| negotiate_err(min, max));
    let (version, message) = match &answer {
        Ok(v) => (*v, String::new()),
        Err(e) => (0, e.to_string()),
    };
    if let Err(e) = &answer {
        let _ = send_all(
            &conn.writer.lock(),
            &wire::encode_welcome(version, &message),
        );
        shared.protocol_errors.fetch_add(1, Ordering::Relaxed);
        log::info!("RPC connection {}: handshake refused: {e}", conn.id);
        return false;
    }
    // Accepted: the welcome names the pool and carries its descriptor.
    let pool = shared.service.pool();
    let welcome = wire::encode_welcome(version, pool.id());
    let sent = wire::send_frame_with_fd(&conn.writer.lock(), &welcome, pool.as_fd());
    let _ = stream.set_read_timeout(None);
    sent.is_ok()
}

fn negotiate_err(min: u32, max: u32) -> Result<u32> {
    wire::negotiate(min, max).map_err(Error::Protocol)
}

fn read_requests(shared: &Arc<Shared>, conn: &Arc<Conn>, holder: &Holder, stream: UnixStream) {
    // The socket's read timeout wakes the reader of a stalled frame; a
    // frame that started must complete within the frame timeout.
    let _ = stream.set_read_timeout(Some(shared.config.frame_timeout));
    let bounds = wire::FrameBounds {
        max_frame: shared.config.max_frame,
        frame_timeout: shared.config.frame_timeout,
    };
    let mut reader = BufReader::with_capacity(READ_BUFFER, stream);
    let mut buf = wire::FrameBuffer::new(&shared.buffered);
    loop {
        if conn.dead.load(Ordering::Relaxed) {
            break;
        }
        match wire::read_frame_bounded(&mut reader, &bounds, &mut buf) {
            Ok(()) => {}
            Err(FrameError::Eof) => break,
            Err(
                e @ (FrameError::Oversize { .. }
                | FrameError::OverBudget { .. }
                | FrameError::TimedOut { .. }),
            ) => {
                let kind = match e {
                    FrameError::Oversize { .. } => {
                        shared.protocol_errors.fetch_add(1, Ordering::Relaxed);
                        ErrorKind::Protocol
                    }
                    FrameError::OverBudget { .. } => {
                        shared.frames_over_budget.fetch_add(1, Ordering::Relaxed);
                        ErrorKind::Unavailable
                    }
                    _ => {
                        shared.frames_timed_out.fetch_add(1, Ordering::Relaxed);
                        ErrorKind::Protocol
                    }
                };
                log::info!("RPC connection {}: {e}; closing it", conn.id);
                buf.shrink(0);
                let msg = format!("{e}; closing the connection");
                conn.send(shared, CONNECTION_ERROR_ID, &Reply::error(kind, msg));
                break;
            }
            Err(e) => {
                if !matches!(e, FrameError::Io(_)) {
                    shared.protocol_errors.fetch_add(1, Ordering::Relaxed);
                }
                log::debug!("RPC connection {}: {e}", conn.id);
                break;
            }
        }
        let (rid, body) = match wire::split_id(buf.payload()) {
            Ok((rid, _)) if rid == CONNECTION_ERROR_ID => {
                shared.protocol_errors.fetch_add(1, Ordering::Relaxed);
                conn.send(
                    shared,
                    CONNECTION_ERROR_ID,
                    &Reply::error(
                        ErrorKind::Protocol,
                        "request id 0 is reserved; closing the connection",
                    ),
                );
                break;
            }
            Ok(x) => x,
            Err(e) => {
                shared.protocol_errors.fetch_add(1, Ordering::Relaxed);
                conn.send(shared, CONNECTION_ERROR_ID, &Reply::from_result(Err(e)));
                break;
            }
        };
        shared.requests.fetch_add(1, Ordering::Relaxed);
        let decoded = wire::decode_request(body);
        // The request owns its values now: the frame's memory goes back to
        // the shared budget before the (possibly long) call runs.
        buf.shrink(KEEP_BUFFER);
        match decoded {
            Ok(request) => dispatch(shared, conn, holder, rid, request),
            Err(e) => {
                shared.protocol_errors.fetch_add(1, Ordering::Relaxed);
                conn.send(shared, rid, &Reply::from_result(Err(e)));
            }
        }
    }
}

/// Runs a request inline, or on a thread of its own when it may wait long.
fn dispatch(shared: &Arc<Shared>, conn: &Arc<Conn>, holder: &Holder, rid: u64, request: Request) {
    let call: Call = match request {
        // A store admission is answered here when the pages fit L1 now
        // (most do: one thread hand-off less per store lease); one that
        // must wait for evictions goes to a thread of its own.
        Request::PrepareStore { manifest, rank } => {
            let manifest = match <fn(&Manifest) as WireArg>::decode(manifest) {
                Ok(m) => m,
                Err(e) => return conn.send(shared, rid, &Reply::from_result(Err(e))),
            };
            let served = Served { shared, holder };
            let mut waits = false;
            let reply = guarded("prepare_store", || {
                let lease = served.try_prepare_store(&manifest, rank)?;
                waits = lease.is_none();
                Ok(lease.map(ReplyValue::into_value).unwrap_or(Value::Unit))
            });
            if !waits {
                return conn.send(shared, rid, &reply);
            }
            Box::new(move |s: &Shared, h: &Holder| {
                guarded("prepare_store", || {
                    let served = Served {
                        shared: s,
                        holder: h,
                    };
                    Decorator::prepare_store(&served, &manifest, rank).map(ReplyValue::into_value)
                })
            })
        }
        // A find with a shared tier may wait for it (up to its lookup timeout).
        request @ (Request::Find { .. } | Request::FindLocated { .. })
            if shared.service.has_shared_tier() =>
        {
            Box::new(move |s: &Shared, h: &Holder| run(s, h, request))
        }
        request => return conn.send(shared, rid, &run(shared, holder, request)),
    };
    offload(shared, conn, holder, rid, call);
}

/// A request to carry out on an offload thread: the reply to send.
type Call = Box<dyn FnOnce(&Shared, &Holder) -> Reply + Send>;

/// Runs `call` on an offload thread (a kept one when idle), or on this
/// thread past [`MAX_OFFLOADED`].
fn offload(shared: &Arc<Shared>, conn: &Arc<Conn>, holder: &Holder, rid: u64, call: Call) {
    if shared.offloaded.fetch_add(1, Ordering::SeqCst) >= MAX_OFFLOADED {
        shared.offloaded.fetch_sub(1, Ordering::SeqCst);
        return conn.send(shared, rid, &call(shared, holder));
    }
    let (s, c, h) = (shared.clone(), conn.clone(), holder.clone());
    let job: OffloadJob = Box::new(move || {
        let reply = call(&s, &h);
        c.send(&s, rid, &reply);
        s.offloaded.fetch_sub(1, Ordering::SeqCst);
    });
    let mut q = shared.offload.lock();
    q.jobs.push_back(job);
    if q.idle >= q.jobs.len() {
        // An idle thread takes it (each idle thread takes one job).
        drop(q);
        shared.offload_ready.notify_one();
        return;
    }
    q.threads += 1;
    drop(q);
    let s = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("lmcache-rc-offload".into())
        .spawn(move || offload_loop(&s));
    if let Err(e) = spawned {
        shared.offload.lock().threads -= 1;
        // No thread for the queued job: run one queued job here, so
        // that every queued job has a runner.
        log::warn!("the server cannot start an offload thread: {e}; running a request inline");
        let job = shared.offload.lock().jobs.pop_front();
        if let Some(job) = job {
            job();
        }
    }
}

/// A request handed to an offload thread (it sends its own reply).
type OffloadJob = Box<dyn FnOnce() + Send>;

/// Requests waiting for an offload thread.
#[derive(Default)]
struct OffloadQueue {
    jobs: std::collections::VecDeque<OffloadJob>,
    /// Threads waiting for a job.
    idle: usize,
    /// Offload threads alive.
    threads: usize,
}

/// An offload thread: runs queued requests; ends after [`OFFLOAD_IDLE`]
/// without one, or at shutdown once the queue is empty.
fn offload_loop(shared: &Arc<Shared>) {
    let mut q = shared.offload.lock();
    let mut idle_since = Instant::now();
    loop {
        if let Some(job) = q.jobs.pop_front() {
            drop(q);
            // `run` turns a panic of the request into an error reply.
            job();
            q = shared.offload.lock();
            idle_since = Instant::now();
            continue;
        }
        if shared.stopping.load(Ordering::SeqCst) || idle_since.elapsed() >= OFFLOAD_IDLE {
            q.threads -= 1;
            return;
        }
        q.idle += 1;
        shared.offload_ready.wait_for(&mut q, OFFLOAD_POLL);
        q.idle -= 1;
    }
}

/// Executes one request; a panic becomes an `Internal` error reply (I9).
fn run(shared: &Shared, holder: &Holder, request: Request) -> Reply {
    let name = request.name();
    guarded(name, || request.apply(&Served { shared, holder }))
}

/// The reply of one call of operation `name`; a panic becomes an
/// `Internal` error reply (I9).
fn guarded(name: &str, call: impl FnOnce() -> Result<Value>) -> Reply {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(call));
    match outcome {
        Ok(result) => Reply::from_result(result),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            log::error!("RPC {name} panicked: {what}");
            Reply::error(
                ErrorKind::Internal,
                format!("the server failed while handling {name}: {what}"),
            )
        }
    }
}

/// [`Server::admin_view`]: the service's operations, the server's status.
struct AdminView {
    shared: Arc<Shared>,
}

impl Decorator for AdminView {
    type Inner = CheckpointService;
    fn inner(&self) -> &CheckpointService {
        &self.shared.service
    }
    fn status(&self) -> Result<ServiceStatus> {
        status_of(&self.shared)
    }
}

/// The service as the server exposes it to one connection: admission stops
/// at shutdown (`begin` answers false, `prepare_store` and `begin_retrieve`
/// miss with reason `shutdown`), the leases it grants are held by the
/// connection's process, and `status` adds the RPC layer's counters; every
/// other operation is the service's own.
struct Served<'a> {
    shared: &'a Shared,
    holder: &'a Holder,
}

impl Served<'_> {
    fn admitting(&self) -> bool {
        self.shared.admitting.load(Ordering::SeqCst)
    }
    /// [`Decorator::prepare_store`] that never waits for L1 space (`None`:
    /// the pages do not fit now; see
    /// [`CheckpointService::try_prepare_store_for`]).
    fn try_prepare_store(&self, manifest: &Manifest, rank: u32) -> Result<Option<Lease>> {
        if !self.admitting() {
            return Ok(Some(Lease::miss(MissReason::Shutdown)));
        }
        self.inner()
            .try_prepare_store_for(self.holder, manifest, rank)
    }
}

impl Decorator for Served<'_> {
    type Inner = CheckpointService;
    fn inner(&self) -> &CheckpointService {
        &self.shared.service
    }
    fn begin(&self, manifest: &Manifest) -> Result<bool> {
        if !self.admitting() {
            return Ok(false);
        }
        self.inner().begin(manifest)
    }
    fn prepare_store(&self, manifest: &Manifest, rank: u32) -> Result<Lease> {
        if !self.admitting() {
            return Ok(Lease::miss(MissReason::Shutdown));
        }
        self.inner().prepare_store_for(self.holder, manifest, rank)
    }
    fn begin_retrieve(&self, manifest: &Manifest, rank: u32) -> Result<Lease> {
        if !self.admitting() {
            return Ok(Lease::miss(MissReason::Shutdown));
        }
        self.inner().begin_retrieve_for(self.holder, manifest, rank)
    }
    fn status(&self) -> Result<ServiceStatus> {
        status_of(self.shared)
    }
}
