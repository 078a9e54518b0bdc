//! A real S3-compatible server (s3s-fs, built and cached by
//! `ci/s3-server.sh`) for the shared-tier tests: never a mock.
//!
//! [`S3Server::shared`] is one server per test process (each test makes its
//! own bucket); [`S3Server::start`] is a private one that a test may stop
//! and restart (server-down scenarios). Both are stopped by the script's
//! watchdog when the test process ends, whatever way it ends.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use lmcache_rc_core::shared::SharedConfig;

use crate::common::repo_root;

/// The fixed test credentials of `ci/s3-server.sh`.
pub const ACCESS_KEY: &str = "lmcache-rc-test";
/// The fixed test secret.
pub const SECRET_KEY: &str = "lmcache-rc-test-secret";

/// A running s3s-fs on 127.0.0.1.
pub struct S3Server {
    data: PathBuf,
    endpoint: String,
    /// Remove `data` when dropped (private servers).
    owned: bool,
}

static BUCKETS: AtomicU32 = AtomicU32::new(0);

fn script(args: &[&str], port: Option<u16>, cleanup: bool) -> String {
    let mut cmd = Command::new("bash");
    cmd.arg(repo_root().join("ci/s3-server.sh"))
        .args(args)
        .env("LMCACHE_RC_S3_OWNER_PID", std::process::id().to_string())
        .env("LMCACHE_RC_S3_CLEANUP", if cleanup { "1" } else { "0" });
    if let Some(port) = port {
        cmd.env("LMCACHE_RC_S3_PORT", port.to_string());
    }
    let out = cmd.output().expect("run ci/s3-server.sh");
    assert!(
        out.status.success(),
        "ci/s3-server.sh {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .trim()
        .to_string()
}

impl S3Server {
    /// The process-wide server (started on first use, built if needed).
    pub fn shared() -> &'static S3Server {
        static SERVER: OnceLock<S3Server> = OnceLock::new();
        SERVER.get_or_init(|| {
            let data = std::env::temp_dir().join(format!("lmcache-rc-s3-{}", std::process::id()));
            // LMCACHE_RC_S3_KEEP=1 keeps the data (and the server's log) for a post-mortem.
            let keep = std::env::var_os("LMCACHE_RC_S3_KEEP").is_some();
            let endpoint = script(&["start", data.to_str().unwrap()], None, !keep);
            S3Server {
                data,
                endpoint,
                owned: false,
            }
        })
    }

    /// A private server on a fresh data directory.
    pub fn start() -> S3Server {
        let data = tempfile::Builder::new()
            .prefix("lmcache-rc-s3-")
            .tempdir()
            .unwrap()
            .keep();
        let endpoint = script(&["start", data.to_str().unwrap()], None, false);
        S3Server {
            data,
            endpoint,
            owned: true,
        }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.endpoint.rsplit(':').next().unwrap().parse().unwrap()
    }

    /// Stops the server (its data stays).
    pub fn stop(&self) {
        script(&["stop", self.data.to_str().unwrap()], None, false);
    }

    /// Starts it again on the same port and data.
    pub fn restart(&mut self) {
        let port = self.port();
        self.endpoint = script(&["start", self.data.to_str().unwrap()], Some(port), false);
    }

    /// A new, empty bucket of this server.
    pub fn bucket(&self, hint: &str) -> String {
        let n = BUCKETS.fetch_add(1, Ordering::Relaxed);
        let hint: String = hint
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '-'
                }
            })
            // s3s-fs keeps bucket + key in one file name: keep buckets short.
            .take(10)
            .collect();
        let name = format!("t{n}-{hint}");
        std::fs::create_dir_all(self.data.join(&name)).unwrap();
        name
    }

    /// The file holding an object (s3s-fs keeps `<data>/<bucket>/<key>`):
    /// tests corrupt, truncate, delete or age objects through it.
    pub fn object_file(&self, bucket: &str, key: &str) -> PathBuf {
        self.data.join(bucket).join(key)
    }

    /// Every object file of a bucket whose key starts with `prefix`.
    pub fn objects(&self, bucket: &str, prefix: &str) -> Vec<PathBuf> {
        fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return;
            };
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir() {
                    walk(&p, out);
                } else {
                    out.push(p);
                }
            }
        }
        let root = self.data.join(bucket);
        let mut out = Vec::new();
        walk(&root, &mut out);
        out.retain(|p| {
            let key = p.strip_prefix(&root).unwrap().to_string_lossy().to_string();
            key.starts_with(prefix) && !key.contains(".tmp.")
        });
        out.sort();
        out
    }

    /// A tier configuration for `s3://bucket/prefix` on this server.
    pub fn config(&self, bucket: &str, prefix: &str) -> SharedConfig {
        let mut c = SharedConfig::new(format!("s3://{bucket}/{prefix}"))
            .with_option("aws_endpoint", self.endpoint.clone())
            .with_option("aws_access_key_id", ACCESS_KEY)
            .with_option("aws_secret_access_key", SECRET_KEY)
            .with_option("aws_region", "us-east-1")
            .with_option("aws_allow_http", "true");
        // Tests want failures fast.
        c.request_timeout = std::time::Duration::from_secs(10);
        c.connect_timeout = std::time::Duration::from_secs(2);
        c.retry_timeout = std::time::Duration::from_secs(3);
        c.max_retries = 2;
        c
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        if self.owned {
            self.stop();
            let _ = std::fs::remove_dir_all(&self.data);
        }
    }
}
