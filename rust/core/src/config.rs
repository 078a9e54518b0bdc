//! The sidecar's settings, declared once.
//!
//! [`SidecarConfig`] is every setting of `lmcache-rc serve` — the service's,
//! the RPC server's and the HTTP admin's — as one flat list. The list below
//! (`sidecar_config!`) is the only place a setting is declared: it gives the
//! struct, the defaults, [`SidecarConfig::FIELDS`] (name, kind, whether it
//! may be absent, its documentation) and by-name access. The Python class
//! `lmcache_rc.ServerConfig` wraps this struct, and the CLI's flags and help
//! are generated from `FIELDS`, so a new setting is one entry here.
//!
//! Values are strict: a value of the wrong kind is `InvalidType`, an unknown
//! name is `InvalidType`, a value out of range is `InvalidInput`.

use std::path::{Path as FsPath, PathBuf};
use std::time::Duration;

use crate::cost::Eviction;
use crate::error::{Error, Result};
use crate::http;
use crate::rpc;
use crate::service::{ServiceConfig, SharedSettings};
use crate::store::shm::default_l1_bytes;
use crate::units::{DURATION_GRAMMAR, SIZE_GRAMMAR, human_size, parse_duration, parse_size};

/// What kind of value a setting holds (also how the CLI parses it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldKind {
    /// A filesystem path.
    Path,
    /// A string.
    Text,
    /// A byte count; as text, a size ([`parse_size`]: `8G`, `512MiB`).
    Bytes,
    /// A non-negative integer.
    Count,
    /// A signed integer.
    Signed,
    /// A non-negative duration; as text, a duration ([`parse_duration`]:
    /// `2.5` seconds, `30s`, `5m`, `36h`), in Python a number of seconds.
    Seconds,
}

impl FieldKind {
    /// The kind's name (`"path"`, `"bytes"`...).
    pub fn as_str(self) -> &'static str {
        match self {
            FieldKind::Path => "path",
            FieldKind::Text => "text",
            FieldKind::Bytes => "bytes",
            FieldKind::Count => "count",
            FieldKind::Signed => "signed",
            FieldKind::Seconds => "seconds",
        }
    }

    /// An accepted example of this kind's text, for error messages.
    pub fn example(self) -> &'static str {
        match self {
            FieldKind::Path => "/var/lib/lmcache-rc/checkpoints.sqlite",
            FieldKind::Text => "127.0.0.1",
            FieldKind::Bytes => "8GiB",
            FieldKind::Count => "64",
            FieldKind::Signed => "-1",
            FieldKind::Seconds => "30s",
        }
    }

    /// Parses a value of this kind from text (a flag or an environment
    /// variable). `""` and `"none"` (any case) are absent for an optional
    /// setting. The error says what was expected and shows an example; the
    /// caller prefixes the flag or variable.
    pub fn parse(self, text: &str, optional: bool) -> Result<Option<FieldValue>> {
        self.parse_as(text, optional, self.example())
    }

    /// [`FieldKind::parse`] with the example its error shows.
    fn parse_as(self, text: &str, optional: bool, example: &str) -> Result<Option<FieldValue>> {
        let t = text.trim();
        if optional && (t.is_empty() || t.eq_ignore_ascii_case("none")) {
            return Ok(None);
        }
        let bad = |what: &str| {
            Error::invalid(format!(
                "expected {what}{}, got {text:?} (e.g. {example})",
                if optional { " or none" } else { "" },
            ))
        };
        let value = match self {
            FieldKind::Path => FieldValue::Path(PathBuf::from(text)),
            FieldKind::Text => FieldValue::Text(text.to_string()),
            FieldKind::Bytes => {
                FieldValue::Unsigned(parse_size(t).ok_or_else(|| bad(SIZE_GRAMMAR))?)
            }
            FieldKind::Count => {
                FieldValue::Unsigned(t.parse().map_err(|_| bad("a non-negative integer"))?)
            }
            FieldKind::Signed => FieldValue::Signed(t.parse().map_err(|_| bad("an integer"))?),
            FieldKind::Seconds => {
                FieldValue::Seconds(parse_duration(t).ok_or_else(|| bad(DURATION_GRAMMAR))?)
            }
        };
        Ok(Some(value))
    }
}

/// One setting's value.
#[derive(Debug, Clone, PartialEq)]
pub enum FieldValue {
    /// [`FieldKind::Path`].
    Path(PathBuf),
    /// [`FieldKind::Text`].
    Text(String),
    /// [`FieldKind::Bytes`] and [`FieldKind::Count`].
    Unsigned(u64),
    /// [`FieldKind::Signed`].
    Signed(i64),
    /// [`FieldKind::Seconds`].
    Seconds(Duration),
}

/// One setting as [`SidecarConfig::FIELDS`] describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldSpec {
    /// The name (`l1_bytes`); the flag is `--l1-bytes`, the environment
    /// variable `LMCACHE_RC_L1_BYTES`.
    pub name: &'static str,
    /// Its kind.
    pub kind: FieldKind,
    /// Whether it may be absent (None).
    pub optional: bool,
    /// What it sets, and its default.
    pub doc: &'static str,
}

impl FieldSpec {
    /// An accepted value of this setting, for error messages.
    pub fn example(&self) -> &'static str {
        match self.name {
            "socket" => "/run/lmcache-rc/sidecar.sock",
            "l2_path" => "/var/lib/lmcache-rc/l2",
            "l2_bytes" => "2TiB",
            "http_port" => "9090",
            "http_max_connections" => "64",
            "max_entries" => "65536",
            "max_pending" => "128",
            "max_leases" => "1024",
            "l2_io_threads" => "2",
            "max_pending_bytes" => "256MiB",
            "rpc_max_buffered_bytes" => "1GiB",
            "eviction" => "cost",
            _ => self.kind.example(),
        }
    }
}

/// A Rust type that holds one setting.
trait Setting: Sized {
    fn to_value(&self) -> Option<FieldValue>;
    fn from_value(value: Option<FieldValue>) -> Option<Self>;
}

macro_rules! setting {
    ($ty:ty, $variant:ident) => {
        impl Setting for $ty {
            fn to_value(&self) -> Option<FieldValue> {
                Some(FieldValue::$variant(self.clone()))
            }
            fn from_value(value: Option<FieldValue>) -> Option<Self> {
                match value {
                    Some(FieldValue::$variant(v)) => Some(v),
                    _ => None,
                }
            }
        }
    };
}

setting!(PathBuf, Path);
setting!(String, Text);
setting!(u64, Unsigned);
setting!(i64, Signed);
setting!(Duration, Seconds);

impl<T: Setting> Setting for Option<T> {
    fn to_value(&self) -> Option<FieldValue> {
        self.as_ref().and_then(T::to_value)
    }
    fn from_value(value: Option<FieldValue>) -> Option<Self> {
        match value {
            None => Some(None),
            some => T::from_value(some).map(Some),
        }
    }
}

/// The Rust type of a setting of a kind (`optional`: may be absent).
macro_rules! setting_type {
    ($kind:ident optional) => { Option<setting_type!($kind)> };
    (Path) => { PathBuf };
    (Text) => { String };
    (Bytes) => { u64 };
    (Count) => { u64 };
    (Signed) => { i64 };
    (Seconds) => { Duration };
}

macro_rules! is_optional {
    () => {
        false
    };
    (optional) => {
        true
    };
}

/// Declares [`SidecarConfig`] from its list of settings.
macro_rules! sidecar_config {
    ($(
        $(#[doc = $doc:literal])+
        $name:ident : $kind:ident $($optional:ident)? = $default:expr;
    )*) => {
        /// Every setting of a sidecar (see the [module docs](self)).
        #[derive(Debug, Clone, PartialEq)]
        pub struct SidecarConfig {
            $(
                $(#[doc = $doc])+
                pub $name: setting_type!($kind $($optional)?),
            )*
        }

        impl SidecarConfig {
            /// Every setting, in declaration order.
            pub const FIELDS: &'static [FieldSpec] = &[$(
                FieldSpec {
                    name: stringify!($name),
                    kind: FieldKind::$kind,
                    optional: is_optional!($($optional)?),
                    doc: concat!($($doc, "\n"),+),
                },
            )*];

            /// The defaults.
            fn defaults() -> SidecarConfig {
                SidecarConfig {
                    $($name: $default,)*
                }
            }

            /// The value of the setting `name` (None: absent); an unknown
            /// name is `InvalidType`.
            pub fn get(&self, name: &str) -> Result<Option<FieldValue>> {
                match name {
                    $(stringify!($name) => Ok(Setting::to_value(&self.$name)),)*
                    other => Err(unknown_field(other)),
                }
            }

            /// Sets `name` to `value`; a value of another kind (or None
            /// for a setting that must be present) is `InvalidType`.
            pub fn set(&mut self, name: &str, value: Option<FieldValue>) -> Result<()> {
                match name {
                    $(stringify!($name) => {
                        self.$name = Setting::from_value(value).ok_or_else(|| {
                            wrong_kind(stringify!($name), FieldKind::$kind, is_optional!($($optional)?))
                        })?;
                        Ok(())
                    })*
                    other => Err(unknown_field(other)),
                }
            }
        }
    };
}

fn unknown_field(name: &str) -> Error {
    let known: Vec<&str> = SidecarConfig::FIELDS.iter().map(|f| f.name).collect();
    Error::InvalidType(format!(
        "unknown setting {name:?}; the settings are {}",
        known.join(", ")
    ))
}

fn wrong_kind(name: &str, kind: FieldKind, optional: bool) -> Error {
    Error::InvalidType(format!(
        "{name} must be a {}{} value",
        kind.as_str(),
        if optional { " or None" } else { "" }
    ))
}

sidecar_config! {
    /// Unix socket the sidecar listens on (created with mode 0600); default:
    /// `$XDG_RUNTIME_DIR/lmcache-rc/sidecar.sock`, else `/tmp/lmcache-rc-<uid>/`.
    socket: Path = rpc::default_socket_path();
    /// Deprecated and ignored: the pool has no name any more (an anonymous
    /// memfd handed to each client over the socket, nothing in /dev/shm).
    shm_name: Text optional = None;
    /// Size of the shared-memory (L1) pool in bytes, a multiple of 4096;
    /// default: a quarter of the available memory, at most 1 GiB.
    l1_bytes: Bytes = default_l1_bytes();
    /// SQLite file of the durable directory; default: none (the directory
    /// lives in memory and is lost at exit).
    checkpoint_index_path: Path optional = None;
    /// Directory of the filesystem (L2) tier; default: none (no L2).
    l2_path: Path optional = None;
    /// Capacity of the L2 tier in bytes; default: unlimited.
    l2_bytes: Bytes optional = None;
    /// Address of the HTTP admin API; default: loopback (127.0.0.1).
    http_host: Text = "127.0.0.1".to_string();
    /// Port of the HTTP admin API: 0 picks a free port (the default), -1
    /// turns the API off.
    http_port: Signed = 0;
    /// Most HTTP admin connections open at once; a new one beyond displaces
    /// the oldest connection that is not answering a request.
    http_max_connections: Count = http::AdminConfig::DEFAULT_MAX_CONNECTIONS as u64;
    /// How long an HTTP admin connection may take to send a request head,
    /// or stay silent between requests, before it is closed.
    http_idle_timeout: Seconds = http::AdminConfig::DEFAULT_IDLE_TIMEOUT;
    /// How the tiers choose what to evict when full: `lru` (least recently
    /// used pages first) or `cost` (the generation that saves the least
    /// prefill compute per byte it alone holds, blended with recency, first;
    /// `docs/design/leases.md#eviction`). The directory's `max_entries` bound
    /// stays least recently used under both.
    eviction: Text = ServiceConfig::default().eviction.as_str().to_string();
    /// Most published generations listed (least recently used beyond).
    max_entries: Count = ServiceConfig::default().max_entries;
    /// Most generations pending publication at once.
    max_pending: Count = ServiceConfig::default().max_pending;
    /// Most bytes the manifests of pending generations hold in memory at
    /// once (a manifest may be 16 MiB); `begin` answers false beyond it.
    max_pending_bytes: Bytes = ServiceConfig::default().max_pending_bytes;
    /// Most live worker leases (store + retrieve).
    max_leases: Count = ServiceConfig::default().max_leases as u64;
    /// How long a store waits for L1 space before missing.
    store_admission_timeout: Seconds = ServiceConfig::default().store_admission_timeout;
    /// How long a retrieve may stay pending before missing.
    retrieve_timeout: Seconds = ServiceConfig::default().retrieve_timeout;
    /// Pending generations without progress for this long are aborted;
    /// None: never.
    abandoned_after: Seconds optional = ServiceConfig::default().abandoned_after;
    /// Threads writing and reading L2 files.
    l2_io_threads: Count = ServiceConfig::default().l2_io_threads as u64;
    /// How long a stopping server lets live leases finish.
    drain_timeout: Seconds = rpc::ServerConfig::new("").drain_timeout;
    /// Most RPC connections served at once (more are refused); lowered at
    /// start to what the open-file limit allows beside 256 descriptors kept
    /// for L2 and the directory.
    max_connections: Count = rpc::ServerConfig::new("").max_connections as u64;
    /// A request frame that started arriving must arrive whole within this
    /// time, or its connection is closed (idle connections are kept).
    rpc_frame_timeout: Seconds = rpc::ServerConfig::new("").frame_timeout;
    /// Bytes of incoming request frames buffered across all RPC connections;
    /// a frame beyond it closes its connection (at least the 64 MiB frame
    /// limit).
    rpc_max_buffered_bytes: Bytes = rpc::ServerConfig::new("").max_buffered_bytes as u64;
    /// The shared tier across hosts: `s3://bucket/prefix` (endpoint, region
    /// and credentials from the standard `AWS_*` environment) or
    /// `file:///path` (a shared filesystem); default: none.
    shared_url: Text optional = None;
    /// How long a lookup waits for the shared tier before answering with
    /// what this host has.
    shared_lookup_timeout: Seconds = SharedSettings::new("").lookup_timeout;
    /// Most generations waiting for their upload to the shared tier; when
    /// full, the oldest waiting upload is dropped (status
    /// `shared_uploads_dropped`).
    shared_upload_queue: Count = SharedSettings::new("").upload_queue as u64;
    /// Testing only: every request to the shared tier waits this long before
    /// it is sent, so a `file://` tier behaves like a distant object store
    /// (restores from it then show what a slow tier costs); 0 (the
    /// default) adds nothing.
    shared_inject_latency: Seconds = SharedSettings::new("").inject_latency;
}

/// The prefix of the environment variables that set a sidecar's settings.
pub const ENV_PREFIX: &str = "LMCACHE_RC_";

impl Default for SidecarConfig {
    fn default() -> Self {
        SidecarConfig::defaults()
    }
}

impl SidecarConfig {
    /// The defaults with `values` set by name (None = absent), validated.
    pub fn from_values(
        values: impl IntoIterator<Item = (String, Option<FieldValue>)>,
    ) -> Result<SidecarConfig> {
        let mut config = SidecarConfig::defaults();
        for (name, value) in values {
            config.set(&name, value)?;
        }
        config.validate()?;
        Ok(config)
    }

    /// The defaults, then every `LMCACHE_RC_<NAME>` environment variable,
    /// then `overrides`; validated like [`Self::from_values`].
    pub fn from_env(
        overrides: impl IntoIterator<Item = (String, Option<FieldValue>)>,
    ) -> Result<SidecarConfig> {
        let mut values = Vec::new();
        for field in Self::FIELDS {
            let var = format!("{ENV_PREFIX}{}", field.name.to_ascii_uppercase());
            if let Some(raw) = std::env::var_os(&var) {
                let raw = raw
                    .into_string()
                    .map_err(|_| Error::invalid(format!("{var} is not valid UTF-8")))?;
                let value =
                    parse_field(field, &raw).map_err(|e| Error::invalid(format!("{var}: {e}")))?;
                values.push((field.name.to_string(), value));
            }
        }
        values.extend(overrides);
        Self::from_values(values)
    }

    /// Refuses settings no server could start with; the error names the
    /// setting (`max_entries: must be at least 1, got 0 (e.g. 65536)`).
    fn validate(&self) -> Result<()> {
        for field in Self::FIELDS {
            let value = self.get(field.name)?;
            check_value(field, value.as_ref())
                .map_err(|e| Error::invalid(format!("{}: {e}", field.name)))?;
        }
        if self.shared_upload_queue == 0 {
            return Err(Error::invalid("shared_upload_queue must be at least 1"));
        }
        if let Some(url) = &self.shared_url {
            let known = ["s3://", "s3a://", "file://"];
            if !known.iter().any(|p| url.starts_with(p)) {
                return Err(Error::invalid(format!(
                    "shared_url must be s3://bucket[/prefix] or file:///path, got {url:?}"
                )));
            }
        }
        Ok(())
    }

    /// Why settings given are obsolete (each is ignored), for the caller
    /// to warn about.
    pub fn deprecations(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(name) = &self.shm_name {
            out.push(format!(
                "--shm-name / shm_name ({name:?}) is deprecated and ignored: the shared-memory \
                 pool is an anonymous memfd handed to clients over the socket, so nothing is \
                 named in /dev/shm"
            ));
        }
        out
    }

    /// The service's part of the settings.
    pub fn service_config(&self) -> Result<ServiceConfig> {
        Ok(ServiceConfig {
            l1_bytes: self.l1_bytes,
            l2_path: self.l2_path.clone(),
            l2_bytes: self.l2_bytes,
            checkpoint_index_path: self.checkpoint_index_path.clone(),
            max_entries: self.max_entries,
            max_pending: self.max_pending,
            max_pending_bytes: self.max_pending_bytes,
            max_leases: usize_of("max_leases", self.max_leases)?,
            store_admission_timeout: self.store_admission_timeout,
            retrieve_timeout: self.retrieve_timeout,
            abandoned_after: self.abandoned_after,
            l2_io_threads: usize_of("l2_io_threads", self.l2_io_threads)?,
            shared: match &self.shared_url {
                Some(url) => Some(SharedSettings {
                    lookup_timeout: self.shared_lookup_timeout,
                    upload_queue: usize_of("shared_upload_queue", self.shared_upload_queue)?,
                    inject_latency: self.shared_inject_latency,
                    ..SharedSettings::new(url.clone())
                }),
                None => None,
            },
            change_feed_capacity: ServiceConfig::default().change_feed_capacity,
            eviction: Eviction::parse(&self.eviction)?,
            index_vfs: None,
        })
    }

    /// The settings of a server embedded in this process, and of its RPC
    /// layer. `temp_socket` chooses where it listens: None = in a fresh
    /// private temporary directory when the socket is the default one, else
    /// on the configured socket; false = always on the configured socket;
    /// true = always in a fresh temporary directory, so embedded servers
    /// never collide with a sidecar or with each other.
    pub fn server_configs(
        &self,
        temp_socket: Option<bool>,
    ) -> Result<(ServiceConfig, rpc::ServerConfig)> {
        let service = self.service_config()?;
        let temp = temp_socket.unwrap_or_else(|| self.socket == rpc::default_socket_path());
        let mut server = if temp {
            let path = rpc::temp_socket_path()?;
            let mut c = rpc::ServerConfig::new(path);
            c.remove_dir_on_stop = true;
            c
        } else {
            rpc::ServerConfig::new(self.socket.clone())
        };
        server.drain_timeout = self.drain_timeout;
        server.max_connections = usize_of("max_connections", self.max_connections)?;
        server.frame_timeout = self.rpc_frame_timeout;
        server.max_buffered_bytes =
            usize_of("rpc_max_buffered_bytes", self.rpc_max_buffered_bytes)?;
        Ok((service, server))
    }

    /// The HTTP admin API's settings for a server listening on `socket`
    /// (its admin file goes beside it: [`http::admin_file_for`]); None when
    /// the API is turned off (`http_port` -1).
    pub fn http_config(&self, socket: &FsPath) -> Result<Option<http::AdminConfig>> {
        if self.http_port < 0 {
            return Ok(None);
        }
        let port = u16::try_from(self.http_port).map_err(|_| {
            Error::invalid(format!(
                "http_port must be in 0..65535 (or -1: off), got {}",
                self.http_port
            ))
        })?;
        let mut config = http::AdminConfig::new(self.http_host.clone(), port);
        config.max_connections = usize_of("http_max_connections", self.http_max_connections)?;
        config.idle_timeout = self.http_idle_timeout;
        config.admin_file = Some(http::admin_file_for(socket));
        Ok(Some(config))
    }

    /// The socket path (for messages).
    pub fn socket(&self) -> &FsPath {
        &self.socket
    }
}

/// Parses the text of setting `field` (a flag or an environment variable)
/// and checks its range: [`FieldKind::parse`] then [`check_value`]. The
/// error does not name the setting; the caller prefixes the flag or variable.
pub fn parse_field(field: &FieldSpec, text: &str) -> Result<Option<FieldValue>> {
    let value = field.kind.parse_as(text, field.optional, field.example())?;
    check_value(field, value.as_ref())?;
    Ok(value)
}

/// The range of each setting: what no server could start with. The error
/// says what is allowed and shows an accepted value, without the setting's
/// name (each front end names its flag, variable or keyword).
pub fn check_value(field: &FieldSpec, value: Option<&FieldValue>) -> Result<()> {
    let example = field.example();
    let bad = |rule: &str, got: String| {
        Err(Error::invalid(format!(
            "{rule}, got {got} (e.g. {example})"
        )))
    };
    match (field.name, value) {
        ("l1_bytes", Some(FieldValue::Unsigned(n))) if *n == 0 || n % 4096 != 0 => {
            bad("must be a positive multiple of 4096 bytes", n.to_string())
        }
        ("l2_bytes", Some(FieldValue::Unsigned(0))) => {
            bad("must be positive (or none: unlimited)", "0".into())
        }
        (
            "max_entries"
            | "max_pending"
            | "max_leases"
            | "l2_io_threads"
            | "max_connections"
            | "http_max_connections",
            Some(FieldValue::Unsigned(0)),
        ) => bad("must be at least 1", "0".into()),
        ("http_idle_timeout" | "rpc_frame_timeout", Some(FieldValue::Seconds(d)))
            if d.is_zero() =>
        {
            bad("must be a positive number of seconds", "0".into())
        }
        ("max_pending_bytes", Some(FieldValue::Unsigned(0))) => bad("must be positive", "0".into()),
        ("eviction", Some(FieldValue::Text(name))) if Eviction::parse(name).is_err() => {
            bad("must be lru or cost", format!("{name:?}"))
        }
        ("rpc_max_buffered_bytes", Some(FieldValue::Unsigned(n)))
            if *n < rpc::wire::DEFAULT_MAX_FRAME as u64 =>
        {
            bad(
                &format!(
                    "must be at least the {} frame limit",
                    human_size(rpc::wire::DEFAULT_MAX_FRAME as u64)
                ),
                human_size(*n),
            )
        }
        ("http_port", Some(FieldValue::Signed(p))) if !(-1..=65535).contains(p) => bad(
            "must be a port in 0..=65535 (0: a free port) or -1 (off)",
            p.to_string(),
        ),
        _ => Ok(()),
    }
}

fn usize_of(name: &str, value: u64) -> Result<usize> {
    usize::try_from(value).map_err(|_| Error::invalid(format!("{name} is too large: {value}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_is_listed_once_and_readable_by_name() {
        let config = SidecarConfig::default();
        let mut names = std::collections::HashSet::new();
        for field in SidecarConfig::FIELDS {
            assert!(names.insert(field.name), "{} twice", field.name);
            assert!(!field.doc.trim().is_empty(), "{} has no doc", field.name);
            let value = config.get(field.name).unwrap();
            assert!(value.is_some() || field.optional, "{}", field.name);
        }
        assert!(config.get("no_such").is_err());
    }

    #[test]
    fn values_are_strict_about_kind_and_range() {
        let set =
            |name: &str, v: Option<FieldValue>| SidecarConfig::from_values([(name.to_string(), v)]);
        let e = set("l1_bytes", Some(FieldValue::Text("1".into()))).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidType);
        let e = set("l1_bytes", None).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidType);
        let e = set("bogus", None).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidType);
        let e = set("l1_bytes", Some(FieldValue::Unsigned(1000))).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidInput);
        let c = set("abandoned_after", None).unwrap();
        assert_eq!(c.abandoned_after, None);
        let c = set("socket", Some(FieldValue::Path("/tmp/x.sock".into()))).unwrap();
        assert!(c.deprecations().is_empty());
        let c = set("shm_name", Some(FieldValue::Text("old".into()))).unwrap();
        assert_eq!(
            c.deprecations().len(),
            1,
            "an old pool name is accepted and ignored"
        );
    }

    #[test]
    fn text_parses_by_kind() {
        let p = |k: FieldKind, t: &str, o: bool| k.parse(t, o);
        assert_eq!(
            p(FieldKind::Bytes, "4G", false).unwrap(),
            Some(FieldValue::Unsigned(4 << 30))
        );
        assert_eq!(
            p(FieldKind::Bytes, "1.5KiB", false).unwrap(),
            Some(FieldValue::Unsigned(1536))
        );
        assert_eq!(
            p(FieldKind::Bytes, "8388608", false).unwrap(),
            Some(FieldValue::Unsigned(8 << 20))
        );
        assert_eq!(p(FieldKind::Seconds, "none", true).unwrap(), None);
        assert_eq!(
            p(FieldKind::Seconds, "1.5", true).unwrap(),
            Some(FieldValue::Seconds(Duration::from_millis(1500)))
        );
        let e = p(FieldKind::Bytes, "banana", false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"banana\"") && e.contains("e.g. 8GiB"), "{e}");
        assert!(p(FieldKind::Count, "-1", false).is_err());
        assert!(p(FieldKind::Seconds, "nan", false).is_err());
        assert_eq!(
            p(FieldKind::Seconds, "5m", false).unwrap(),
            Some(FieldValue::Seconds(Duration::from_secs(300))),
            "a duration setting takes the duration grammar"
        );
        let e = p(FieldKind::Seconds, "5 minutes", false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("ms, s, m, h, d or w") && e.contains("e.g. 30s"),
            "{e}"
        );
        assert_eq!(
            p(FieldKind::Signed, "-1", false).unwrap(),
            Some(FieldValue::Signed(-1))
        );
        assert_eq!(
            p(FieldKind::Path, "", true).unwrap(),
            None,
            "an empty optional path is absent"
        );
    }
}
