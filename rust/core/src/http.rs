//! The HTTP admin API of the sidecar (DESIGN §6): `GET /status` (JSON),
//! `GET /metrics` (Prometheus text exposition) and
//! `POST /clear?force=true|false&all_tiers=true|false` (409 while a forced
//! clear is refused because leases are live).
//!
//! Loopback by default; it carries no page bytes and changes nothing but the
//! tiers through `/clear`. One background thread serves requests one at a time
//! (admin traffic is tiny); a failing request never stops the server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::error::{Error, Result};
use crate::protocol::{Checkpoints, ServiceStatus};

/// A running admin server. Stops on [`HttpAdmin::stop`] or drop.
pub struct HttpAdmin {
    addr: SocketAddr,
    server: Arc<tiny_http::Server>,
    stopping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for HttpAdmin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpAdmin")
            .field("addr", &self.addr)
            .finish()
    }
}

impl HttpAdmin {
    /// Binds `host:port` (port 0 picks a free port) and serves `service`.
    pub fn start(host: &str, port: u16, service: Arc<dyn Checkpoints>) -> Result<HttpAdmin> {
        let server = tiny_http::Server::http((host, port)).map_err(|e| {
            Error::io(
                format!("bind the HTTP admin API on {host}:{port}"),
                std::io::Error::other(e.to_string()),
            )
        })?;
        let addr = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| Error::invalid("the HTTP admin API must listen on an IP address"))?;
        let server = Arc::new(server);
        let stopping = Arc::new(AtomicBool::new(false));
        let thread = {
            let server = server.clone();
            let stopping = stopping.clone();
            std::thread::Builder::new()
                .name("lmcache-rc-http".into())
                .spawn(move || serve(&server, &*service, &stopping))
                .map_err(|e| Error::io("spawn the HTTP admin thread", e))?
        };
        Ok(HttpAdmin {
            addr,
            server,
            stopping,
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

    /// Stops serving and joins the thread.
    pub fn stop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for HttpAdmin {
    fn drop(&mut self) {
        self.stop();
    }
}

fn serve(server: &tiny_http::Server, service: &dyn Checkpoints, stopping: &AtomicBool) {
    while !stopping.load(Ordering::SeqCst) {
        let request = match server.recv_timeout(Duration::from_millis(200)) {
            Ok(Some(request)) => request,
            Ok(None) => continue,
            Err(e) => {
                log::warn!("HTTP admin: accept failed: {e}");
                continue;
            }
        };
        let (code, content_type, body) = route(request.method().as_str(), request.url(), service);
        let header = tiny_http::Header::from_bytes(&b"Content-Type"[..], content_type.as_bytes());
        let mut response = tiny_http::Response::from_string(body).with_status_code(code);
        if let Ok(header) = header {
            response = response.with_header(header);
        }
        if let Err(e) = request.respond(response) {
            log::debug!("HTTP admin: reply failed: {e}");
        }
    }
}

/// Answers one request: (status code, content type, body).
pub fn route(method: &str, url: &str, service: &dyn Checkpoints) -> (u16, &'static str, String) {
    const JSON: &str = "application/json";
    let (path, query) = url.split_once('?').unwrap_or((url, ""));
    match (method, path) {
        ("GET", "/status") => match service.status() {
            Ok(status) => (200, JSON, status_json(&status)),
            Err(e) => (500, JSON, error_json(&e)),
        },
        ("GET", "/metrics") => match service.status() {
            Ok(status) => match metrics_text(&status) {
                Ok(text) => (200, "text/plain; version=0.0.4; charset=utf-8", text),
                Err(e) => (500, JSON, error_json(&e)),
            },
            Err(e) => (500, JSON, error_json(&e)),
        },
        ("POST", "/clear") => {
            let (force, all_tiers) = match clear_flags(query) {
                Ok(flags) => flags,
                Err(e) => return (400, JSON, error_json(&e)),
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
                    (200, JSON, body.to_string())
                }
                Err(e @ Error::LeasesLive(_)) => (409, JSON, error_json(&e)),
                Err(e) => (500, JSON, error_json(&e)),
            }
        }
        (_, "/status" | "/metrics" | "/clear") => (
            405,
            JSON,
            error_json(&Error::invalid(format!(
                "{method} is not allowed on {path}"
            ))),
        ),
        _ => (
            404,
            JSON,
            error_json(&Error::invalid(format!(
                "unknown path {path}; try GET /status, GET /metrics, POST /clear"
            ))),
        ),
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

fn clear_flags(query: &str) -> Result<(bool, bool)> {
    let (mut force, mut all_tiers) = (false, false);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, "true"));
        match key {
            "force" => force = parse_bool(key, value)?,
            "all_tiers" => all_tiers = parse_bool(key, value)?,
            other => {
                return Err(Error::invalid(format!(
                    "unknown clear parameter {other:?} (use force, all_tiers)"
                )));
            }
        }
    }
    Ok((force, all_tiers))
}

/// The status as one JSON object (integers and a `misses` map).
pub fn status_json(status: &ServiceStatus) -> String {
    let mut map = serde_json::Map::new();
    for (k, v) in &status.values {
        map.insert(k.clone(), serde_json::Value::from(*v));
    }
    let misses: serde_json::Map<String, serde_json::Value> = status
        .misses
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::Value::from(*v)))
        .collect();
    map.insert("misses".into(), serde_json::Value::Object(misses));
    serde_json::Value::Object(map).to_string()
}

fn error_json(e: &Error) -> String {
    serde_json::json!({"error": e.kind().as_str(), "message": e.to_string()}).to_string()
}

/// Prometheus text exposition of the status: one gauge per value
/// (`lmcache_rc_<name>`) and `lmcache_rc_misses{reason="..."}`.
pub fn metrics_text(status: &ServiceStatus) -> Result<String> {
    let mut registry = Registry::with_prefix("lmcache_rc");
    for (name, value) in &status.values {
        let gauge: Gauge<i64, AtomicI64> = Gauge::default();
        gauge.set(i64::try_from(*value).unwrap_or(i64::MAX));
        registry.register(
            name,
            format!("lmcache-rc {}", name.replace('_', " ")),
            gauge,
        );
    }
    let misses = Family::<Vec<(String, String)>, Gauge<i64, AtomicI64>>::default();
    for (reason, count) in &status.misses {
        misses
            .get_or_create(&vec![("reason".to_string(), reason.clone())])
            .set(i64::try_from(*count).unwrap_or(i64::MAX));
    }
    registry.register("misses", "lmcache-rc misses by reason", misses);
    let mut out = String::new();
    encode(&mut out, &registry)
        .map_err(|_| Error::invalid("encoding the metrics exposition failed"))?;
    Ok(out)
}
