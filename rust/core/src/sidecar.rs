//! A whole sidecar in one value: the checkpoint service, the RPC server that
//! serves it and the HTTP admin API, started, drained and stopped in order.
//!
//! [`Sidecar::start`] takes the settings ([`SidecarConfig`]) and starts the
//! parts bottom up — the service and the RPC server on its socket
//! ([`rpc::Server::open`]), then the admin API over the server's view
//! ([`rpc::Server::admin_view`], so `/status` answers what the RPC `status`
//! does) with its admin file beside the socket. A part that fails to start
//! stops those already started before the error returns: nothing is left
//! running or listening, and no admin file is left behind.
//!
//! [`Sidecar::stop`] stops top down: the admin API first (it removes its
//! admin file before the RPC server may remove the socket's temporary
//! directory), then the RPC server's graceful shutdown — admission stops,
//! live leases get up to the drain bound to finish, connections close, the
//! service closes (L2 queue drained, directory closed) — and the last
//! reference to the service is dropped, which unmaps the pool. It is
//! idempotent: a second call answers the first call's report. Dropping a
//! sidecar never stopped stops it the same way without draining.
//!
//! The Python `lmcache_rc.Server` (and so `lmcache-rc serve`, the demo and
//! the pytest fixtures) is this type; Rust tests and binaries start whole
//! sidecars through it without Python.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::config::SidecarConfig;
use crate::error::{Error, Result};
use crate::http::{self, HttpAdmin};
use crate::protocol::ServiceStatus;
use crate::rpc::{self, ShutdownReport};

/// A running sidecar: service, RPC server and HTTP admin API (see the
/// [module docs](self)). Thread-safe; every method takes `&self`.
pub struct Sidecar {
    socket: PathBuf,
    drain: Duration,
    http_url: Option<String>,
    admin_file: Option<PathBuf>,
    parts: Mutex<Parts>,
}

/// What a running sidecar owns; emptied by [`Sidecar::stop`].
#[derive(Default)]
struct Parts {
    /// The HTTP admin API (None when `http_port` is -1, or once stopped).
    http: Option<HttpAdmin>,
    /// The RPC server and, through it, the service (None once stopped).
    server: Option<Arc<rpc::Server>>,
    /// What the stop that ran reported.
    report: Option<ShutdownReport>,
}

impl std::fmt::Debug for Sidecar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sidecar")
            .field("socket", &self.socket)
            .field("http_url", &self.http_url)
            .field("stopped", &self.is_stopped())
            .finish()
    }
}

impl Sidecar {
    /// Starts a sidecar for `config`. `temp_socket` chooses where it
    /// listens, as [`SidecarConfig::server_configs`] says: None = in a fresh
    /// private temporary directory when the configured socket is the default
    /// one (embedded use), else on the configured socket; false = always on
    /// the configured socket (`lmcache-rc serve`); true = always in a fresh
    /// temporary directory. Deprecated settings are logged as warnings.
    pub fn start(config: &SidecarConfig, temp_socket: Option<bool>) -> Result<Sidecar> {
        for warning in config.deprecations() {
            log::warn!("{warning}");
        }
        let (service, rpc_config) = config.server_configs(temp_socket)?;
        let drain = rpc_config.drain_timeout;
        let server = rpc::Server::open(service, rpc_config)?;
        // The server owns its socket now: the admin file beside it is ours
        // to write, or (HTTP off) to remove when a killed server left one.
        let http = match config.http_config(server.socket_path()) {
            Ok(Some(http_config)) => match HttpAdmin::start(http_config, server.admin_view()) {
                Ok(http) => Some(http),
                Err(e) => return Err(stop_after_failed_start(server, e)),
            },
            Ok(None) => {
                http::remove_stale_admin_file(server.socket_path());
                None
            }
            Err(e) => return Err(stop_after_failed_start(server, e)),
        };
        Ok(Sidecar {
            socket: server.socket_path().to_path_buf(),
            drain,
            http_url: http.as_ref().map(HttpAdmin::url),
            admin_file: http
                .as_ref()
                .and_then(|h| h.admin_file())
                .map(Path::to_path_buf),
            parts: Mutex::new(Parts {
                http,
                server: Some(Arc::new(server)),
                report: None,
            }),
        })
    }

    /// The socket clients connect to.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// The HTTP admin URL (`http://host:port`), or None when the API is off.
    pub fn http_url(&self) -> Option<&str> {
        self.http_url.as_deref()
    }

    /// The HTTP admin file (`<socket>.admin.json`, mode 0600), or None when
    /// the API is off. Removed by [`Sidecar::stop`].
    pub fn admin_file(&self) -> Option<&Path> {
        self.admin_file.as_deref()
    }

    /// How long [`Sidecar::stop`] lets live leases finish when not told
    /// (the `drain_timeout` setting).
    pub fn drain_timeout(&self) -> Duration {
        self.drain
    }

    /// The RPC server, while the sidecar runs (its service for in-process
    /// callers and tests); `Closed` once stopped.
    pub fn server(&self) -> Result<Arc<rpc::Server>> {
        self.parts
            .lock()
            .server
            .clone()
            .ok_or(Error::Closed("lmcache-rc server"))
    }

    /// The service's status plus the RPC counters and the socket (what the
    /// RPC `status` and `GET /status` answer); `Closed` once stopped.
    pub fn status(&self) -> Result<ServiceStatus> {
        self.server()?.status()
    }

    /// Whether [`Sidecar::stop`] ran.
    pub fn is_stopped(&self) -> bool {
        self.parts.lock().server.is_none()
    }

    /// Graceful shutdown, top down (see the [module docs](self)): the admin
    /// API, then the RPC server, letting live leases finish for up to
    /// `drain` (None: the `drain_timeout` setting), then the service. Blocks
    /// until every part stopped. Idempotent: a later call answers the first
    /// call's report.
    pub fn stop(&self, drain: Option<Duration>) -> Result<ShutdownReport> {
        let drain = drain.unwrap_or(self.drain);
        // Take the parts under the lock, stop them without it: a status call
        // of another thread then answers `Closed` instead of waiting.
        let (http, server) = {
            let mut parts = self.parts.lock();
            if let Some(report) = &parts.report {
                return Ok(report.clone());
            }
            (parts.http.take(), parts.server.take())
        };
        if let Some(mut http) = http {
            http.stop();
        }
        let Some(server) = server else {
            // Another thread is stopping it; its report is the answer.
            return Ok(self.parts.lock().report.clone().unwrap_or_default());
        };
        let report = server.shutdown_with(drain);
        // The last reference drops the service: its pool is unmapped.
        drop(server);
        let report = report?;
        self.parts.lock().report = Some(report.clone());
        Ok(report)
    }
}

impl Drop for Sidecar {
    /// A sidecar never stopped stops now, in the same order, without
    /// draining live leases.
    fn drop(&mut self) {
        let parts = std::mem::take(self.parts.get_mut());
        if let Some(mut http) = parts.http {
            http.stop();
        }
        // `rpc::Server`'s own drop shuts it down without draining.
        drop(parts.server);
    }
}

/// Stops the RPC server of a sidecar whose later part failed to start and
/// gives back that failure (a shutdown failure is only logged).
fn stop_after_failed_start(server: rpc::Server, failure: Error) -> Error {
    if let Err(e) = server.shutdown_with(Duration::ZERO) {
        log::warn!("stopping the RPC server of a sidecar that failed to start: {e}");
    }
    drop(server);
    failure
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<Sidecar>();
}
