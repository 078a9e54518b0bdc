//! The HTTP admin API of the sidecar: `GET /status` (JSON), `GET /metrics`
//! (the status as Prometheus series, [`crate::metrics`]: OpenMetrics text
//! to clients that accept it, else the Prometheus text format) and
//! `POST /clear?force=true|false&all_tiers=true|false` (409 while a forced
//! clear is refused because leases are live; `force` omitted = forced, see
//! [`crate::protocol::CLEAR_FORCE_DEFAULT`]).
//!
//! What it owns: one listening socket, hyper's HTTP/1 server on a
//! current-thread tokio runtime run by one thread of its own (plus at most
//! [`BLOCKING_THREADS`] threads that make the service calls, which may block
//! on the service's lock or on SQLite), and the admin file beside the RPC
//! socket. It never does anything but answer these three routes: it carries
//! no page bytes and changes nothing but the tiers through `/clear`.
//!
//! Limits, so that no request or client can exhaust the sidecar's memory or
//! threads, and no failing request stops `/status` from answering:
//! - a request head (request line and headers) of at most
//!   [`MAX_HEAD_BYTES`] and [`MAX_HEADERS`] headers, else 431 and the
//!   connection closes: nothing larger is ever buffered;
//! - no route takes a body: a declared body over [`MAX_BODY_BYTES`] (or one
//!   of unknown length) is refused with 413 before any of it is read, and
//!   the connection closes; a malformed or out-of-range `Content-Length`
//!   is refused by hyper's parser (400, or 431 above 2^64 - 3). A body is
//!   never allocated;
//! - at most [`AdminConfig::max_connections`] connections at once: a new one
//!   beyond displaces the oldest connection that is not answering a request
//!   (an idle keep-alive or a client still sending its head); when every one
//!   is answering, the new one gets 503 and is closed;
//! - a connection must deliver a whole request head within
//!   [`AdminConfig::idle_timeout`] of the previous response (or of opening),
//!   and is closed when no byte moves either way for that long while it is
//!   not answering a request (slow-loris and stalled readers);
//! - connections are tasks, never threads; a service call that panics
//!   answers 500 and nothing else notices.
//!
//! Authentication: the read-only routes are open (Prometheus scrapes
//! `/metrics` on loopback). `POST /clear` needs `Authorization: Bearer
//! <token>`: a random token made at start, written with the URL to the admin
//! file `<socket>.admin.json` ([`admin_file_for`], mode 0600, so only the
//! sidecar's user can read it) and removed on a clean stop. A missing or
//! wrong token is 401 and nothing is cleared.

use std::convert::Infallible;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::net::SocketAddr;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body as _, Incoming};
use hyper::header::{
    ACCEPT, AUTHORIZATION, CONNECTION, CONTENT_TYPE, HeaderValue, WWW_AUTHENTICATE,
};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};

use crate::error::{Error, Result};
use crate::metrics;
use crate::protocol::{Checkpoints, EngineReport, ServiceStatus, clear_force};

/// Most bytes of a request head (request line and headers) read before the
/// request is refused with 431.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Most headers in a request head (more: 431).
pub const MAX_HEADERS: usize = 64;
/// Most body bytes a request may declare (no route reads a body; more, or a
/// chunked body of unknown length: 413 without reading any of it).
pub const MAX_BODY_BYTES: u64 = 1024;
/// Threads that make the service calls (status, clear); requests beyond
/// wait for one in order.
pub const BLOCKING_THREADS: usize = 2;
/// The longest idle timeout applied (a larger setting is clamped to it).
const MAX_IDLE_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// hyper's smallest allowed read buffer; the head limit sits below it.
const READ_BUFFER_BYTES: usize = 2 * MAX_HEAD_BYTES;
/// How long the server waits after a failed `accept` (e.g. out of file
/// descriptors) before accepting again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The suffix of the admin file: `<socket path>.admin.json`.
pub const ADMIN_FILE_SUFFIX: &str = ".admin.json";

/// The admin file of a sidecar listening on `socket`: the socket's path with
/// [`ADMIN_FILE_SUFFIX`] appended (`/run/lmcache-rc/sidecar.sock.admin.json`).
/// It holds `{"url": "http://host:port", "token": "<64 hex digits>"}`.
pub fn admin_file_for(socket: &Path) -> PathBuf {
    let mut name = socket.as_os_str().to_owned();
    name.push(ADMIN_FILE_SUFFIX);
    PathBuf::from(name)
}

/// Settings of the HTTP admin API.
#[derive(Debug, Clone, PartialEq)]
pub struct AdminConfig {
    /// Address to bind (loopback by default).
    pub host: String,
    /// Port to bind; 0 picks a free port.
    pub port: u16,
    /// Most connections open at once (at least 1).
    pub max_connections: usize,
    /// How long a connection may take to send a request head, or stay
    /// silent while not answering a request, before it is closed.
    pub idle_timeout: Duration,
    /// Where to write the URL and the bearer token (mode 0600), removed on
    /// stop; None: nowhere (the token is still required, see
    /// [`HttpAdmin::token`]).
    pub admin_file: Option<PathBuf>,
}

impl AdminConfig {
    /// Default of [`AdminConfig::max_connections`].
    pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
    /// Default of [`AdminConfig::idle_timeout`].
    pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

    /// Defaults for `host:port`, without an admin file.
    pub fn new(host: impl Into<String>, port: u16) -> AdminConfig {
        AdminConfig {
            host: host.into(),
            port,
            max_connections: Self::DEFAULT_MAX_CONNECTIONS,
            idle_timeout: Self::DEFAULT_IDLE_TIMEOUT,
            admin_file: None,
        }
    }
}

/// The bearer token that authorizes the mutating routes: 32 random bytes
/// from the kernel, as 64 hex digits. Its `Debug` form hides it.
#[derive(Clone)]
pub struct AdminToken(String);

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

impl AdminToken {
    /// A fresh random token (`getrandom`).
    pub fn generate() -> Result<AdminToken> {
        let mut bytes = [0u8; 32];
        let mut filled = 0;
        while filled < bytes.len() {
            let rest = bytes.get_mut(filled..).unwrap_or_default();
            let n = rustix::rand::getrandom(rest, rustix::rand::GetRandomFlags::empty())
                .map_err(|e| Error::io("read random bytes for the HTTP admin token", e.into()))?;
            filled += n;
        }
        Ok(AdminToken(hex::encode(bytes)))
    }

    /// The token's text (what `Authorization: Bearer` carries).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether an `Authorization` header value carries this token
    /// (`Bearer <token>`, the scheme in any case). Compares in time
    /// independent of where the first difference is.
    pub fn authorizes(&self, authorization: Option<&[u8]>) -> bool {
        let Some(given) = authorization.and_then(bearer) else {
            return false;
        };
        let want = self.0.as_bytes();
        given.len() == want.len()
            && given
                .iter()
                .zip(want)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

/// The credentials of `Authorization: Bearer <credentials>`, if that is the
/// header's scheme.
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    let space = value.iter().position(|&b| b == b' ')?;
    let (scheme, rest) = value.split_at(space);
    scheme
        .eq_ignore_ascii_case(b"bearer")
        .then(|| rest.trim_ascii())
}

/// One answer: status code, content type, body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// The HTTP status code.
    pub code: u16,
    /// The `Content-Type`.
    pub content_type: &'static str,
    /// The body.
    pub body: String,
}

const JSON: &str = "application/json";

impl Reply {
    fn json(code: u16, body: String) -> Reply {
        Reply {
            code,
            content_type: JSON,
            body,
        }
    }

    fn error(code: u16, e: &Error) -> Reply {
        Reply::json(code, error_json(e.kind().as_str(), &e.to_string()))
    }
}

/// The routes, with what they need: the service and the bearer token.
/// Transport-free, so each rule is testable without a socket.
pub struct Routes {
    service: Arc<dyn Checkpoints>,
    token: AdminToken,
    /// Where the token can be read (named in 401 replies).
    admin_file: Option<PathBuf>,
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes")
            .field("admin_file", &self.admin_file)
            .finish_non_exhaustive()
    }
}

impl Routes {
    /// Routes answering from `service`, `POST /clear` authorized by `token`.
    pub fn new(service: Arc<dyn Checkpoints>, token: AdminToken) -> Routes {
        Routes {
            service,
            token,
            admin_file: None,
        }
    }

    /// Answers one request. `url` is the path and query; `authorization`
    /// the `Authorization` header's value, if any. `/metrics` answers in the
    /// Prometheus text format (see [`Routes::answer_accepting`]).
    pub fn answer(&self, method: &str, url: &str, authorization: Option<&[u8]>) -> Reply {
        self.answer_accepting(method, url, authorization, None)
    }

    /// Answers one request whose `Accept` header is `accept`: `/metrics`
    /// answers OpenMetrics to a client that accepts it, else the Prometheus
    /// text format ([`metrics::Format::negotiate`]).
    pub fn answer_accepting(
        &self,
        method: &str,
        url: &str,
        authorization: Option<&[u8]>,
        accept: Option<&[u8]>,
    ) -> Reply {
        let (path, query) = url.split_once('?').unwrap_or((url, ""));
        let service = &*self.service;
        match (method, path) {
            ("GET", "/status") => match service.status() {
                // an engine list the service cannot give is empty, never a failed status
                Ok(status) => Reply::json(
                    200,
                    status_json(&status, &service.engines().unwrap_or_default()),
                ),
                Err(e) => Reply::error(500, &e),
            },
            ("GET", "/metrics") => {
                let format = metrics::Format::negotiate(accept);
                match service
                    .status()
                    .and_then(|s| metrics::exposition(&s, format))
                {
                    Ok(text) => Reply {
                        code: 200,
                        content_type: format.content_type(),
                        body: text,
                    },
                    Err(e) => Reply::error(500, &e),
                }
            }
            ("POST", "/clear") => {
                if !self.token.authorizes(authorization) {
                    return self.unauthorized(authorization.is_some());
                }
                let (force, all_tiers) = match clear_flags(query) {
                    Ok(flags) => flags,
                    Err(e) => return Reply::error(400, &e),
                };
                match service.clear(force, all_tiers) {
                    Ok(report) => {
                        let body = serde_json::json!({
                            "status": "ok",
                            "force": force,
                            "all_tiers": all_tiers,
                            "cleared": {
                                "l1_objects": report.l1_objects,
                                "l1_bytes": report.l1_bytes,
                                "l2_objects": report.l2_objects,
                                "retired_generations": report.retired_generations,
                                "kept_objects": report.kept_objects,
                            }
                        });
                        Reply::json(200, body.to_string())
                    }
                    Err(e @ Error::LeasesLive(_)) => Reply::error(409, &e),
                    Err(e) => Reply::error(500, &e),
                }
            }
            (_, "/status" | "/metrics" | "/clear") => Reply::error(
                405,
                &Error::invalid(format!("{method} is not allowed on {path}")),
            ),
            _ => Reply::error(
                404,
                &Error::invalid(format!(
                    "unknown path {path}; try GET /status, GET /metrics, POST /clear"
                )),
            ),
        }
    }

    fn unauthorized(&self, sent: bool) -> Reply {
        let source = match &self.admin_file {
            Some(path) => format!(
                "the token is in {} (readable by the sidecar's user only; \
                 `lmcache-rc clear` sends it)",
                path.display()
            ),
            None => "the token is known only to the process that started this server".to_string(),
        };
        let what = if sent {
            "the `Authorization: Bearer <token>` sent does not carry this sidecar's token \
             (a new one is made at every start)"
        } else {
            "POST /clear needs the header `Authorization: Bearer <token>`"
        };
        Reply::json(
            401,
            error_json("Unauthorized", &format!("{what}; {source}")),
        )
    }
}

/// A running admin server. Stops on [`HttpAdmin::stop`] or drop.
pub struct HttpAdmin {
    addr: SocketAddr,
    token: AdminToken,
    /// The admin file written at start and what it holds (removed on stop
    /// only while it still holds that).
    admin_file: Option<(PathBuf, String)>,
    shutdown: watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for HttpAdmin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpAdmin")
            .field("addr", &self.addr)
            .field("admin_file", &self.admin_file.as_ref().map(|(p, _)| p))
            .finish_non_exhaustive()
    }
}

impl HttpAdmin {
    /// Binds `config.host:config.port` (port 0 picks a free port), writes
    /// the admin file if one is configured, and serves `service` on a
    /// thread of its own.
    pub fn start(config: AdminConfig, service: Arc<dyn Checkpoints>) -> Result<HttpAdmin> {
        if config.max_connections == 0 {
            return Err(Error::invalid(
                "the HTTP admin API needs max_connections >= 1",
            ));
        }
        if config.idle_timeout.is_zero() {
            return Err(Error::invalid(
                "the HTTP admin API needs a positive idle timeout",
            ));
        }
        let (host, port) = (config.host.as_str(), config.port);
        let listener = std::net::TcpListener::bind((host, port))
            .map_err(|e| Error::io(format!("bind the HTTP admin API on {host}:{port}"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("read the HTTP admin API's address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("make the HTTP admin socket non-blocking", e))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .max_blocking_threads(BLOCKING_THREADS)
            .thread_name("lmcache-rc-http-call")
            .build()
            .map_err(|e| Error::io("start the HTTP admin runtime", e))?;
        let listener = {
            let _context = runtime.enter();
            TcpListener::from_std(listener)
                .map_err(|e| Error::io("register the HTTP admin socket", e))?
        };
        let token = AdminToken::generate()?;
        let url = format!("http://{addr}");
        let admin_file = match &config.admin_file {
            Some(path) => {
                let contents = serde_json::json!({"url": url, "token": token.as_str()}).to_string();
                write_admin_file(path, &contents)?;
                Some((path.clone(), contents))
            }
            None => None,
        };
        let routes = Arc::new(Routes {
            service,
            token: token.clone(),
            admin_file: config.admin_file.clone(),
        });
        let limits = Limits {
            max_connections: config.max_connections,
            idle_timeout: config.idle_timeout.min(MAX_IDLE_TIMEOUT),
        };
        let (shutdown, stopping) = watch::channel(false);
        let thread = std::thread::Builder::new()
            .name("lmcache-rc-http".into())
            .spawn(move || {
                runtime.block_on(serve(listener, routes, limits, stopping));
                // Drops every connection task; a service call still running
                // finishes on its own thread.
                runtime.shutdown_timeout(Duration::from_secs(1));
            });
        let thread = match thread {
            Ok(thread) => thread,
            Err(e) => {
                if let Some((path, contents)) = &admin_file {
                    remove_admin_file(path, contents);
                }
                return Err(Error::io("spawn the HTTP admin thread", e));
            }
        };
        Ok(HttpAdmin {
            addr,
            token,
            admin_file,
            shutdown,
            thread: Some(thread),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://host:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bearer token `POST /clear` needs (for embedding processes and
    /// tests; operators read it from the admin file).
    pub fn token(&self) -> &AdminToken {
        &self.token
    }

    /// Where the URL and token were written, if anywhere.
    pub fn admin_file(&self) -> Option<&Path> {
        self.admin_file.as_ref().map(|(p, _)| p.as_path())
    }

    /// Stops serving, joins the thread and removes the admin file.
    /// Idempotent.
    pub fn stop(&mut self) {
        self.shutdown.send_replace(true);
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            log::error!("HTTP admin: the server thread panicked");
        }
        if let Some((path, contents)) = self.admin_file.take() {
            remove_admin_file(&path, &contents);
        }
    }
}

impl Drop for HttpAdmin {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Writes the admin file: a fresh file (mode 0600 whatever the umask, not
/// following a symlink) renamed over `path`, so a reader sees the old file
/// or the whole new one.
fn write_admin_file(path: &Path, contents: &str) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let context = |what: &str| format!("{what} the HTTP admin file {}", tmp.display());
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(context("remove a stale"), e)),
    }
    let written = (|| -> std::io::Result<()> {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(&tmp)?;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        file.write_all(contents.as_bytes())?;
        file.write_all(b"\n")?;
        file.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(context("write"), e));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(format!("install the HTTP admin file {}", path.display()), e)
    })
}

/// Removes the admin file if it still holds what this server wrote (a
/// newer server's file is left alone).
fn remove_admin_file(path: &Path, contents: &str) {
    match std::fs::read_to_string(path) {
        Ok(text) if text.trim_end() == contents => {
            if let Err(e) = std::fs::remove_file(path) {
                log::warn!("HTTP admin: remove {}: {e}", path.display());
            }
        }
        Ok(_) => log::debug!("HTTP admin: {} belongs to another server", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => log::warn!("HTTP admin: read {}: {e}", path.display()),
    }
}

/// Removes the admin file beside `socket` left by a server that did not stop
/// cleanly — for a server that now owns `socket` and runs without the HTTP
/// API, so that no client reads a dead server's URL.
pub fn remove_stale_admin_file(socket: &Path) {
    let path = admin_file_for(socket);
    match std::fs::remove_file(&path) {
        Ok(()) => log::info!("removed a stale HTTP admin file {}", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => log::warn!("HTTP admin: remove stale {}: {e}", path.display()),
    }
}

/// The connection limits the server enforces.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_connections: usize,
    idle_timeout: Duration,
}

/// One open connection, as the admission step sees it.
#[derive(Debug)]
struct Slot {
    /// Admission order (lower = older).
    id: u64,
    /// Whether a request is being answered (such a connection is never
    /// displaced).
    busy: AtomicBool,
    /// Signalled to close the connection (displaced by a newer one).
    evict: Notify,
    /// Milliseconds since `epoch` of the last byte moved either way.
    last_activity: AtomicU64,
    epoch: Instant,
}

impl Slot {
    fn touch(&self) {
        let ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_activity.store(ms, Ordering::Relaxed);
    }

    fn last_activity(&self) -> Instant {
        self.epoch + Duration::from_millis(self.last_activity.load(Ordering::Relaxed))
    }
}

/// The open connections, by admission order.
#[derive(Debug, Default)]
struct Connections {
    open: Mutex<std::collections::BTreeMap<u64, Arc<Slot>>>,
    next_id: AtomicU64,
}

impl Connections {
    /// Admits a new connection, displacing the oldest one not answering a
    /// request when `max` are open; None when all `max` are answering.
    fn admit(&self, max: usize) -> Option<Arc<Slot>> {
        let mut open = self.open.lock();
        if open.len() >= max {
            let victim = open
                .iter()
                .find(|(_, s)| !s.busy.load(Ordering::SeqCst))
                .map(|(id, _)| *id)?;
            if let Some(slot) = open.remove(&victim) {
                slot.evict.notify_one();
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot {
            id,
            busy: AtomicBool::new(false),
            evict: Notify::new(),
            last_activity: AtomicU64::new(0),
            epoch: Instant::now(),
        });
        open.insert(id, slot.clone());
        Some(slot)
    }

    fn release(&self, id: u64) {
        self.open.lock().remove(&id);
    }
}

/// Releases a connection's slot when its task ends, however it ends.
struct SlotGuard<'a> {
    connections: &'a Connections,
    id: u64,
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        self.connections.release(self.id);
    }
}

/// Marks a connection busy while a request is answered.
struct BusyGuard<'a>(&'a Slot);

impl<'a> BusyGuard<'a> {
    fn new(slot: &'a Slot) -> Self {
        slot.busy.store(true, Ordering::SeqCst);
        BusyGuard(slot)
    }
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::SeqCst);
        self.0.touch();
    }
}

/// The accept loop: admits connections within the limits and serves each
/// as a task until `stopping` turns true.
async fn serve(
    listener: TcpListener,
    routes: Arc<Routes>,
    limits: Limits,
    mut stopping: watch::Receiver<bool>,
) {
    let connections = Arc::new(Connections::default());
    loop {
        let accepted = tokio::select! {
            _ = stopping.wait_for(|s| *s) => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => stream,
            Err(e) => {
                // Out of descriptors or a connection reset before accept:
                // back off briefly rather than spin.
                log::warn!("HTTP admin: accept failed: {e}");
                tokio::select! {
                    _ = stopping.wait_for(|s| *s) => return,
                    () = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                }
            }
        };
        let Some(slot) = connections.admit(limits.max_connections) else {
            refuse_busy(&stream);
            continue;
        };
        tokio::spawn(connection(
            stream,
            slot,
            connections.clone(),
            routes.clone(),
            limits,
        ));
    }
}

/// Tells a connection that could not be admitted why, without waiting for
/// it (best effort), and closes it.
fn refuse_busy(stream: &TcpStream) {
    let body = error_json(
        "Unavailable",
        "every HTTP admin connection is answering a request; retry",
    );
    let reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: {JSON}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.try_write(reply.as_bytes());
}

/// Serves one connection until the client closes it, a limit closes it, or
/// a newer connection displaces it.
async fn connection(
    stream: TcpStream,
    slot: Arc<Slot>,
    connections: Arc<Connections>,
    routes: Arc<Routes>,
    limits: Limits,
) {
    let _release = SlotGuard {
        connections: &connections,
        id: slot.id,
    };
    let io = TokioIo::new(Tracked {
        inner: stream,
        slot: slot.clone(),
    });
    let service = {
        let slot = slot.clone();
        hyper::service::service_fn(move |request| {
            let (routes, slot) = (routes.clone(), slot.clone());
            async move { Ok::<_, Infallible>(handle(request, &routes, &slot).await) }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.idle_timeout)
        .max_buf_size(READ_BUFFER_BYTES)
        .max_header_size(MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS)
        .keep_alive(true);
    let served = builder.serve_connection(io, service);
    tokio::select! {
        result = served => {
            if let Err(e) = result {
                log::debug!("HTTP admin: connection ended: {e}");
            }
        }
        () = slot.evict.notified() => {
            log::debug!("HTTP admin: connection displaced by a newer one (at the cap)");
        }
        () = idle_watchdog(&slot, limits.idle_timeout) => {
            log::debug!("HTTP admin: connection idle for {:?}, closed", limits.idle_timeout);
        }
    }
}

/// Returns once the connection moved no byte for `idle` while not
/// answering a request.
async fn idle_watchdog(slot: &Slot, idle: Duration) {
    loop {
        let deadline = slot.last_activity() + idle;
        if Instant::now() >= deadline && !slot.busy.load(Ordering::SeqCst) {
            return;
        }
        let wake = if Instant::now() >= deadline {
            Instant::now() + idle
        } else {
            deadline
        };
        tokio::time::sleep_until(wake.into()).await;
    }
}

/// Answers one request within the body limit; the service call runs on a
/// blocking thread, and a panic in it is a 500.
async fn handle(
    request: Request<Incoming>,
    routes: &Arc<Routes>,
    slot: &Slot,
) -> Response<Full<Bytes>> {
    let declared = request.body().size_hint().upper();
    if declared.is_none_or(|n| n > MAX_BODY_BYTES) {
        let what = declared.map_or_else(
            || "a body of unknown length".to_string(),
            |n| format!("a body of {n} bytes"),
        );
        let body = error_json(
            "InvalidInput",
            &format!(
                "the admin routes take no body; this request declared {what} \
                 (at most {MAX_BODY_BYTES} bytes are accepted and ignored)"
            ),
        );
        return response(413, JSON, body, true);
    }
    let method = request.method().as_str().to_owned();
    let url = request.uri().path_and_query().map_or_else(
        || request.uri().path().to_owned(),
        |pq| pq.as_str().to_owned(),
    );
    let header = |name| request.headers().get(name).map(|v| v.as_bytes().to_vec());
    let (authorization, accept) = (header(AUTHORIZATION), header(ACCEPT));
    // The body (at most MAX_BODY_BYTES, never read) goes with the request.
    drop(request);
    let _busy = BusyGuard::new(slot);
    let routes = routes.clone();
    let answered = tokio::task::spawn_blocking(move || {
        routes.answer_accepting(&method, &url, authorization.as_deref(), accept.as_deref())
    })
    .await;
    let reply = match answered {
        Ok(reply) => reply,
        Err(e) => {
            log::error!("HTTP admin: a request failed: {e}");
            Reply::json(
                500,
                error_json(
                    "Internal",
                    "the request failed inside the sidecar (see its log)",
                ),
            )
        }
    };
    response(reply.code, reply.content_type, reply.body, false)
}

/// Builds a response; `close` asks hyper to close the connection after it.
fn response(
    code: u16,
    content_type: &'static str,
    body: String,
    close: bool,
) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() =
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    if code == 401 {
        headers.insert(
            WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer realm=\"lmcache-rc\""),
        );
    }
    if close {
        headers.insert(CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// A connection's socket that records when bytes last moved (for the idle
/// watchdog).
struct Tracked {
    inner: TcpStream,
    slot: Arc<Slot>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.slot.touch();
        }
        polled
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.slot.touch();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.slot.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

fn parse_bool(name: &str, value: &str) -> Result<bool> {
    match value {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        other => Err(Error::invalid(format!(
            "{name} must be true or false, got {other:?}"
        ))),
    }
}

/// `force` and `all_tiers` of a clear's query; `force` omitted is
/// [`crate::protocol::CLEAR_FORCE_DEFAULT`], `all_tiers` omitted is false.
fn clear_flags(query: &str) -> Result<(bool, bool)> {
    let (mut force, mut all_tiers) = (None, false);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, "true"));
        match key {
            "force" => force = Some(parse_bool(key, value)?),
            "all_tiers" => all_tiers = parse_bool(key, value)?,
            other => {
                return Err(Error::invalid(format!(
                    "unknown clear parameter {other:?} (use force, all_tiers)"
                )));
            }
        }
    }
    Ok((clear_force(force), all_tiers))
}

/// The status as one JSON object: integers, the facts (strings or null),
/// a `misses` map and the attached engines' last reports (`engines`, a
/// list, most recent first); the keys of the RPC status as Python sees it,
/// plus `engines`.
pub fn status_json(status: &ServiceStatus, engines: &[EngineReport]) -> String {
    let mut map = serde_json::Map::new();
    for (k, v) in &status.values {
        map.insert(k.clone(), serde_json::Value::from(*v));
    }
    for (k, v) in &status.info {
        map.insert(k.clone(), serde_json::Value::from(v.clone()));
    }
    let misses: serde_json::Map<String, serde_json::Value> = status
        .misses
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::Value::from(*v)))
        .collect();
    map.insert("misses".into(), serde_json::Value::Object(misses));
    map.insert(
        "engines".into(),
        serde_json::to_value(engines).unwrap_or(serde_json::Value::Array(Vec::new())),
    );
    serde_json::Value::Object(map).to_string()
}

/// `{"error": kind, "message": message}`.
fn error_json(kind: &str, message: &str) -> String {
    serde_json::json!({"error": kind, "message": message}).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bearer_header_authorizes_only_with_the_exact_token() {
        let token = AdminToken::generate().unwrap();
        assert_eq!(token.as_str().len(), 64);
        assert_ne!(token.as_str(), AdminToken::generate().unwrap().as_str());
        let good = format!("Bearer {}", token.as_str());
        assert!(token.authorizes(Some(good.as_bytes())));
        assert!(token.authorizes(Some(format!("bearer  {} ", token.as_str()).as_bytes())));
        assert!(!token.authorizes(None));
        assert!(!token.authorizes(Some(b"Bearer")));
        assert!(!token.authorizes(Some(b"Bearer ")));
        assert!(
            !token.authorizes(Some(token.as_str().as_bytes())),
            "no scheme"
        );
        assert!(!token.authorizes(Some(format!("Basic {}", token.as_str()).as_bytes())));
        let mut wrong = good.clone().into_bytes();
        if let Some(last) = wrong.last_mut() {
            *last = if *last == b'0' { b'1' } else { b'0' };
        }
        assert!(!token.authorizes(Some(&wrong)));
        assert!(!token.authorizes(Some(&good.as_bytes()[..good.len() - 1])));
        assert!(
            !format!("{token:?}").contains(token.as_str()),
            "Debug hides it"
        );
    }

    #[test]
    fn clear_flags_default_to_forced_and_reject_unknown_keys() {
        assert_eq!(clear_flags("").unwrap(), (true, false));
        assert_eq!(clear_flags("all_tiers=true").unwrap(), (true, true));
        assert_eq!(clear_flags("force=false").unwrap(), (false, false));
        assert_eq!(clear_flags("force=0&all_tiers=1").unwrap(), (false, true));
        assert_eq!(clear_flags("force").unwrap(), (true, false));
        assert!(clear_flags("force=maybe").is_err());
        assert!(clear_flags("wipe=true").is_err());
    }

    #[test]
    fn the_admin_file_sits_beside_the_socket() {
        assert_eq!(
            admin_file_for(Path::new("/run/lmcache-rc/sidecar.sock")),
            PathBuf::from("/run/lmcache-rc/sidecar.sock.admin.json")
        );
    }

    #[test]
    fn the_admin_file_is_0600_and_replaced_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock.admin.json");
        // A symlink planted at the path is replaced, not followed.
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, "keep").unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        write_admin_file(&path, "{\"token\":\"a\"}").unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(meta.is_file());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
        remove_admin_file(&path, "{\"token\":\"other\"}");
        assert!(path.exists(), "another server's file stays");
        remove_admin_file(&path, "{\"token\":\"a\"}");
        assert!(!path.exists());
    }

    #[test]
    fn at_the_cap_the_oldest_idle_connection_is_displaced_never_a_busy_one() {
        let c = Connections::default();
        let a = c.admit(2).unwrap();
        let b = c.admit(2).unwrap();
        a.busy.store(true, Ordering::SeqCst);
        let third = c.admit(2).unwrap();
        assert!(c.open.lock().contains_key(&a.id), "busy a kept");
        assert!(!c.open.lock().contains_key(&b.id), "idle b displaced");
        third.busy.store(true, Ordering::SeqCst);
        assert!(c.admit(2).is_none(), "every one busy: refused");
        c.release(a.id);
        assert!(c.admit(2).is_some());
    }
}
