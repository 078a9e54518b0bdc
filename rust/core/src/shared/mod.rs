//! The shared tier: published generations on an S3-compatible object store
//! (or a shared filesystem), across hosts (`docs/design/shared-tier.md`).
//!
//! [`SharedTier`] owns one store (through Apache Arrow's `object_store`:
//! `s3://bucket/prefix` with the standard `AWS_*` environment, or
//! `file:///path`), a small tokio runtime, and counters. Its API is
//! blocking, for the thread-based sidecar:
//!
//! - [`SharedTier::upload`]: every page object of a manifest (each once:
//!   an existence check, then a conditional put), the manifest object last;
//! - [`SharedTier::lookup`]: the longest published prefix of a query, in a
//!   bounded number of requests, verified; a clean miss on anything wrong;
//! - [`SharedTier::fetch_page`]: one page, verified against its key, size
//!   and checksum;
//! - [`SharedTier::gc`]: removes old manifests, then old pages no manifest
//!   names.
//!
//! Remote objects are immutable once written (pages may be rewritten with
//! identical bytes to refresh their age, see `refresh_age`). The key layout
//! is in [`layout`], the object formats in [`format`].

pub mod counters;
pub mod format;
mod latency;
pub mod layout;
mod store;

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::StreamExt;
use object_store::{PutMode, PutPayload};

pub use self::counters::{Counters, SharedCounter};
use self::format::{decode_manifest, encode_manifest, page_header, page_object_bytes, verify_page};
pub use self::layout::Layout;
use self::layout::{TailHasher, file_name, parse_manifest_name, parse_page_name};
use self::store::{Outcome, Store};
use crate::error::{Error, Result};
use crate::identity::Prefix;
use crate::manifest::Manifest;
use crate::store::{ObjectKey, object_keys};

/// Settings of a shared tier.
#[derive(Debug, Clone)]
pub struct SharedConfig {
    /// `s3://bucket[/prefix]` (endpoint, region and credentials from the
    /// standard `AWS_*` environment, overridden by `options`) or
    /// `file:///path` (a directory, created if missing).
    pub url: String,
    /// `object_store` S3 settings (e.g. `("aws_endpoint", "http://...")`,
    /// `("aws_allow_http", "true")`), applied over the environment.
    pub options: Vec<(String, String)>,
    /// Requests in flight per operation (uploads, gc, a lookup wave).
    pub concurrency: usize,
    /// Limit of one request (connect, send, receive).
    pub request_timeout: Duration,
    /// Limit of connecting.
    pub connect_timeout: Duration,
    /// Retries of a failed upload, fetch or gc request (backoff 100 ms,
    /// doubling, at most 5 s); lookups retry once.
    pub max_retries: usize,
    /// No retry starts later than this after the first attempt.
    pub retry_timeout: Duration,
    /// An upload that has not reached its manifest within this time gives
    /// up (nothing visible); bounds what gc must allow for (see `gc`).
    pub upload_deadline: Duration,
    /// A page already present but older than this is rewritten (identical
    /// bytes) by an upload that names it, so gc sees it young.
    pub refresh_age: Duration,
    /// Clock difference allowed between hosts and the store (gc margin).
    pub clock_skew: Duration,
    /// Chunk roots listed concurrently per lookup wave.
    pub lookup_wave: usize,
    /// Longest chunk roots a lookup considers (deeper roots are skipped).
    pub max_lookup_roots: usize,
    /// Most manifest names read from one chunk root's listing.
    pub max_bucket_entries: usize,
    /// Most candidate manifests one lookup fetches.
    pub max_candidates: usize,
    /// Testing only: every request to the store waits this long before it
    /// is sent (`object_store`'s `ThrottledStore`), so a local filesystem
    /// behaves like a distant object store. Zero (the default) adds nothing.
    pub inject_latency: Duration,
}

impl SharedConfig {
    /// Defaults for `url`.
    pub fn new(url: impl Into<String>) -> SharedConfig {
        SharedConfig {
            url: url.into(),
            options: Vec::new(),
            concurrency: 8,
            request_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            max_retries: 3,
            retry_timeout: Duration::from_secs(60),
            upload_deadline: Duration::from_secs(600),
            refresh_age: Duration::from_secs(3600),
            clock_skew: Duration::from_secs(60),
            lookup_wave: 4,
            max_lookup_roots: 64,
            max_bucket_entries: 4096,
            max_candidates: 4,
            inject_latency: Duration::ZERO,
        }
    }

    /// Adds an `object_store` setting.
    pub fn with_option(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.options.push((key.into(), value.into()));
        self
    }

    /// The longest an upload can take from its first page check to the end
    /// of its manifest write.
    pub fn upload_bound(&self) -> Duration {
        self.upload_deadline
            .saturating_add(self.retry_timeout)
            .saturating_add(self.request_timeout)
    }

    /// The smallest age `gc` accepts: an upload bound plus the refresh age
    /// plus twice the clock skew.
    pub fn min_gc_age(&self) -> Duration {
        self.upload_bound()
            .saturating_add(self.refresh_age)
            .saturating_add(self.clock_skew.saturating_mul(2))
    }

    fn validate(&self) -> Result<()> {
        if self.concurrency == 0
            || self.lookup_wave == 0
            || self.max_lookup_roots == 0
            || self.max_bucket_entries == 0
            || self.max_candidates == 0
        {
            return Err(Error::invalid(
                "shared tier: concurrency, lookup_wave, max_lookup_roots, max_bucket_entries \
                 and max_candidates must be positive",
            ));
        }
        if self.request_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(Error::invalid("shared tier: timeouts must be positive"));
        }
        Ok(())
    }
}

/// What one upload did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UploadReport {
    /// Distinct pages the manifest names (all ranks).
    pub pages: u64,
    /// Pages this upload wrote (new objects).
    pub pages_uploaded: u64,
    /// Pages found present (written by another host or generation).
    pub dedup_hits: u64,
    /// Present pages rewritten to refresh their age.
    pub pages_refreshed: u64,
    /// Bytes of objects written (pages and manifest).
    pub bytes_uploaded: u64,
    /// True when this upload wrote the manifest; false when it was present.
    pub manifest_written: bool,
}

/// Why a lookup found nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LookupMiss {
    /// No manifest name matched the query.
    NoMatch,
    /// Names matched, but every candidate failed verification or vanished.
    Corrupt,
    /// The lookup ran out of time.
    Timeout,
    /// The store failed (unreachable, refused, errors).
    Error,
}

impl LookupMiss {
    /// A stable name.
    pub fn as_str(self) -> &'static str {
        match self {
            LookupMiss::NoMatch => "none",
            LookupMiss::Corrupt => "corrupt",
            LookupMiss::Timeout => "timeout",
            LookupMiss::Error => "error",
        }
    }
}

/// The answer of [`SharedTier::lookup_detailed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupResult {
    /// The verified manifest, or `None` on a miss.
    pub manifest: Option<Manifest>,
    /// Why there is none.
    pub miss: Option<LookupMiss>,
    /// Listing requests sent.
    pub list_requests: u64,
    /// Manifest fetches sent.
    pub get_requests: u64,
}

/// What one gc run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Namespaces seen.
    pub namespaces: u64,
    /// Manifests removed (older than the age).
    pub manifests_deleted: u64,
    /// Manifests kept (young).
    pub manifests_kept: u64,
    /// Pages removed (old, named by no remaining manifest).
    pub pages_deleted: u64,
    /// Pages kept because a remaining manifest names them.
    pub pages_referenced: u64,
    /// Unreferenced pages kept because they are younger than the age.
    pub pages_young: u64,
    /// Namespaces whose pages were not swept, with why (an unreadable
    /// manifest, or the safe window ran out).
    pub skipped: Vec<(String, String)>,
}

/// A blocking handle on the shared tier; see the module docs.
pub struct SharedTier {
    inner: Arc<Inner>,
    runtime: Option<tokio::runtime::Runtime>,
    pid: u32,
    /// Set by [`SharedTier::close`]: every blocking call in progress or to
    /// come answers [`Error::Closed`] at once.
    closed: tokio::sync::watch::Sender<bool>,
}

struct Inner {
    config: SharedConfig,
    layout: Layout,
    /// Uploads, fetches and gc: retried with backoff.
    bulk: Store,
    /// Lookups: one retry, so a lookup fails fast.
    fast: Store,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for SharedTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedTier")
            .field("url", &self.inner.config.url)
            .field("root", &self.inner.layout.root())
            .finish()
    }
}

fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl SharedTier {
    /// Opens the tier at `config.url` (no request is sent: a store that is
    /// down is found out by the first call).
    pub fn open(config: SharedConfig) -> Result<SharedTier> {
        config.validate()?;
        // reqwest's rustls has no provider of its own in this build; the
        // process default may already be set (by us or the host process).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("lmcache-rc-shared")
            .enable_all()
            .build()
            .map_err(|e| Error::io("start the shared tier's runtime", e))?;
        let (bulk, root) = Store::open(&config, false)?;
        let (fast, _) = Store::open(&config, true)?;
        let counters = Arc::new(Counters::default());
        let inner = Inner {
            layout: Layout::new(&root),
            bulk: bulk.with_counters(counters.clone()),
            fast: fast.with_counters(counters.clone()),
            config,
            counters,
        };
        Ok(SharedTier {
            inner: Arc::new(inner),
            runtime: Some(runtime),
            pid: std::process::id(),
            closed: tokio::sync::watch::Sender::new(false),
        })
    }

    /// The key layout (object keys of namespaces, manifests and pages).
    pub fn layout(&self) -> &Layout {
        &self.inner.layout
    }

    /// The settings.
    pub fn config(&self) -> &SharedConfig {
        &self.inner.config
    }

    /// The counters (shared: clone the `Arc` to read them elsewhere).
    pub fn counters(&self) -> &Arc<Counters> {
        &self.inner.counters
    }

    fn block_on<F: Future>(&self, fut: F) -> Result<F::Output> {
        if std::process::id() != self.pid {
            return Err(Error::Forked(
                "a SharedTier was used in a process forked from the one that opened it; \
                 open a new one in the child"
                    .into(),
            ));
        }
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(Error::Internal(
                "SharedTier's blocking calls cannot run inside an async runtime".into(),
            ));
        }
        let runtime = self
            .runtime
            .as_ref()
            .ok_or(Error::Closed("the shared tier"))?;
        let mut closed = self.closed.subscribe();
        if *closed.borrow_and_update() {
            return Err(Error::Closed("the shared tier"));
        }
        runtime.block_on(async move {
            tokio::select! {
                out = fut => Ok(out),
                _ = closed.wait_for(|c| *c) => Err(Error::Closed("the shared tier")),
            }
        })
    }

    /// Closes the tier: every blocking call in progress (an upload waiting
    /// on the store, a fetch, a lookup) and every later one answers
    /// [`Error::Closed`] at once; requests in flight are abandoned. What an
    /// abandoned upload wrote stays invisible (no manifest) and is reused
    /// by the next upload of the same pages.
    pub fn close(&self) {
        self.closed.send_replace(true);
    }

    /// Uploads a published generation: every page the manifest names (all
    /// ranks; `pages` returns a page's bytes by object key), each once, then
    /// the manifest. On any failure nothing is visible to readers (pages
    /// without a manifest are invisible and reused by the retry); call again
    /// later. A manifest already present ends the upload at once.
    pub fn upload<F>(&self, manifest: &Manifest, pages: F) -> Result<UploadReport>
    where
        F: Fn(&ObjectKey) -> Result<Vec<u8>>,
    {
        let inner = self.inner.clone();
        let result = self.block_on(async move { inner.upload(manifest, &pages).await })?;
        let counters = &self.inner.counters;
        match &result {
            Ok(report) => {
                counters.add(SharedCounter::Uploads, 1);
                counters.add(SharedCounter::PagesUploaded, report.pages_uploaded);
                counters.add(SharedCounter::DedupHits, report.dedup_hits);
                counters.add(SharedCounter::PagesRefreshed, report.pages_refreshed);
                counters.add(SharedCounter::BytesUploaded, report.bytes_uploaded);
                if report.manifest_written {
                    counters.add(SharedCounter::ManifestsWritten, 1);
                } else {
                    counters.add(SharedCounter::ManifestsPresent, 1);
                }
            }
            Err(_) => counters.add(SharedCounter::UploadFailures, 1),
        }
        result
    }

    /// The longest published manifest whose prefix is a whole-token prefix
    /// of one of `queries` (the chunk roots of one token sequence, as for
    /// the directory's `find`) and has more than `longer_than` tokens (the
    /// local hit's length, 0 for none). `None` on a miss of any kind
    /// (nothing there, corrupt, store down, out of `timeout`).
    pub fn lookup(
        &self,
        queries: &[Prefix],
        longer_than: u64,
        timeout: Duration,
    ) -> Result<Option<Manifest>> {
        Ok(self
            .lookup_detailed(queries, longer_than, timeout)?
            .manifest)
    }

    /// [`SharedTier::lookup`] with why it missed and the requests it sent.
    /// Errors only on invalid queries (mixed namespaces) or a misused tier.
    pub fn lookup_detailed(
        &self,
        queries: &[Prefix],
        longer_than: u64,
        timeout: Duration,
    ) -> Result<LookupResult> {
        if let Some(first) = queries.first()
            && queries.iter().any(|q| q.namespace() != first.namespace())
        {
            return Err(Error::invalid(
                "shared tier lookup: all queries must share one namespace",
            ));
        }
        let inner = self.inner.clone();
        let counters = &self.inner.counters;
        counters.add(SharedCounter::Lookups, 1);
        let requests = Arc::new(LookupRequests::default());
        let probe = requests.clone();
        let outcome = self.block_on(async move {
            tokio::time::timeout(timeout, inner.lookup(queries, longer_than, &probe)).await
        })?;
        let (manifest, miss) = match outcome {
            Ok(Ok(m)) => (Some(m), None),
            Ok(Err(miss)) => (None, Some(miss)),
            Err(_) => (None, Some(LookupMiss::Timeout)),
        };
        counters.add(
            match miss {
                None => SharedCounter::LookupHits,
                Some(LookupMiss::NoMatch) => SharedCounter::MissesNone,
                Some(LookupMiss::Corrupt) => SharedCounter::MissesCorrupt,
                Some(LookupMiss::Timeout) => SharedCounter::MissesTimeout,
                Some(LookupMiss::Error) => SharedCounter::MissesError,
            },
            1,
        );
        Ok(LookupResult {
            manifest,
            miss,
            list_requests: requests.lists.load(std::sync::atomic::Ordering::Relaxed),
            get_requests: requests.gets.load(std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// One page of `namespace`, verified (claimed key, size, checksum).
    /// [`Error::NotFound`] when absent, [`Error::Corrupt`] when it fails
    /// verification, [`Error::Unavailable`] when the store fails.
    pub fn fetch_page(&self, namespace: &str, key: &ObjectKey, page_bytes: u64) -> Result<Vec<u8>> {
        self.fetch_page_timed(namespace, key, page_bytes)
            .map(|(page, _)| page)
    }

    /// [`SharedTier::fetch_page`], with how long the store took to answer
    /// the page's GET (the rest of the call read and verified its bytes).
    pub fn fetch_page_timed(
        &self,
        namespace: &str,
        key: &ObjectKey,
        page_bytes: u64,
    ) -> Result<(Vec<u8>, Duration)> {
        let inner = self.inner.clone();
        let result =
            self.block_on(async move { inner.fetch_page(namespace, key, page_bytes).await })?;
        let counters = &self.inner.counters;
        match &result {
            Ok((page, _)) => {
                counters.add(SharedCounter::PagesFetched, 1);
                counters.add(SharedCounter::BytesFetched, page.len() as u64);
            }
            Err(Error::NotFound(_)) => counters.add(SharedCounter::FetchMissing, 1),
            Err(Error::Corrupt(_) | Error::UnsupportedFormat(_)) => {
                counters.add(SharedCounter::FetchCorrupt, 1)
            }
            Err(_) => {}
        }
        result
    }

    /// Removes manifests older than `older_than`, then pages older than it
    /// that no remaining manifest names. Refuses an age below
    /// [`SharedConfig::min_gc_age`] (the margin that protects concurrent
    /// uploads, see the design note).
    pub fn gc(&self, older_than: Duration) -> Result<GcReport> {
        let min = self.inner.config.min_gc_age();
        if older_than < min {
            return Err(Error::invalid(format!(
                "shared gc: --older-than must be at least {} s (upload bound + refresh age + \
                 2 x clock skew of this configuration)",
                min.as_secs_f64().ceil()
            )));
        }
        let inner = self.inner.clone();
        let report = self.block_on(async move { inner.gc(older_than).await })??;
        let counters = &self.inner.counters;
        counters.add(SharedCounter::GcManifestsDeleted, report.manifests_deleted);
        counters.add(SharedCounter::GcPagesDeleted, report.pages_deleted);
        Ok(report)
    }
}

impl Drop for SharedTier {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Never blocks, and is allowed inside an async context.
            runtime.shutdown_background();
        }
    }
}

#[derive(Default)]
struct LookupRequests {
    lists: std::sync::atomic::AtomicU64,
    gets: std::sync::atomic::AtomicU64,
}

/// How one page upload ended.
enum PageOutcome {
    Uploaded(u64),
    Present,
    Refreshed(u64),
}

impl Inner {
    /// Every distinct page a manifest names, with its size.
    fn pages_of(manifest: &Manifest) -> Result<Vec<(ObjectKey, u64)>> {
        let schema = manifest.payload_schema()?;
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for rank in 0..manifest.world_size() {
            let groups = object_keys(manifest, &schema, rank)?;
            for (group, keys) in schema.page_groups.iter().zip(groups) {
                for key in keys {
                    if seen.insert(key) {
                        out.push((key, group.page_bytes));
                    }
                }
            }
        }
        Ok(out)
    }

    async fn upload(
        &self,
        manifest: &Manifest,
        pages: &dyn Fn(&ObjectKey) -> Result<Vec<u8>>,
    ) -> Result<UploadReport> {
        let keys = Self::pages_of(manifest)?;
        let object = encode_manifest(manifest)?;
        let manifest_key = self
            .layout
            .manifest_key(manifest.prefix(), manifest.generation());
        let mut report = UploadReport {
            pages: keys.len() as u64,
            ..UploadReport::default()
        };
        if self.bulk.head(&manifest_key).await?.is_some() {
            return Ok(report);
        }
        let ns = layout::namespace_segment(manifest.prefix().namespace());
        let started = Instant::now();
        let deadline = started + self.config.upload_deadline;
        let mut uploads = futures_util::stream::iter(keys)
            .map(|(key, page_bytes)| {
                let path = self.layout.page_key_of_segment(&ns, &key);
                async move {
                    self.upload_page(&path, &key, page_bytes, pages, deadline)
                        .await
                }
            })
            .buffer_unordered(self.config.concurrency);
        while let Some(outcome) = uploads.next().await {
            match outcome? {
                PageOutcome::Uploaded(n) => {
                    report.pages_uploaded += 1;
                    report.bytes_uploaded += n;
                }
                PageOutcome::Present => report.dedup_hits += 1,
                PageOutcome::Refreshed(n) => {
                    report.pages_refreshed += 1;
                    report.bytes_uploaded += n;
                }
            }
        }
        drop(uploads);
        if Instant::now() > deadline {
            return Err(upload_deadline_error(&self.config));
        }
        let len = object.len() as u64;
        match self
            .bulk
            .put(&manifest_key, PutPayload::from(object), PutMode::Create)
            .await?
        {
            Outcome::Done => {
                report.bytes_uploaded += len;
                report.manifest_written = true;
            }
            Outcome::Exists => {}
        }
        Ok(report)
    }

    async fn upload_page(
        &self,
        path: &str,
        key: &ObjectKey,
        page_bytes: u64,
        pages: &dyn Fn(&ObjectKey) -> Result<Vec<u8>>,
        deadline: Instant,
    ) -> Result<PageOutcome> {
        if Instant::now() > deadline {
            return Err(upload_deadline_error(&self.config));
        }
        let present = self.bulk.head(path).await?;
        let refresh = match present {
            Some(meta) => {
                let age = now_millis().saturating_sub(meta.last_modified.timestamp_millis());
                if meta.size == page_object_bytes(page_bytes)
                    && age <= millis(self.config.refresh_age)
                {
                    return Ok(PageOutcome::Present);
                }
                // Old (or of the wrong size: a damaged object is replaced).
                true
            }
            None => false,
        };
        let page = pages(key)?;
        if page.len() as u64 != page_bytes {
            return Err(Error::invalid(format!(
                "shared upload: page {} has {} bytes, the manifest says {page_bytes}",
                key.hex(),
                page.len()
            )));
        }
        let header = Bytes::copy_from_slice(&page_header(key, &page));
        let len = page_object_bytes(page_bytes);
        let payload = PutPayload::from_iter([header, Bytes::from(page)]);
        if refresh {
            self.bulk.put(path, payload, PutMode::Overwrite).await?;
            return Ok(PageOutcome::Refreshed(len));
        }
        Ok(match self.bulk.put(path, payload, PutMode::Create).await? {
            Outcome::Done => PageOutcome::Uploaded(len),
            Outcome::Exists => PageOutcome::Present,
        })
    }

    /// The lookup proper (the caller bounds its time).
    async fn lookup(
        &self,
        queries: &[Prefix],
        longer_than: u64,
        requests: &LookupRequests,
    ) -> std::result::Result<Manifest, LookupMiss> {
        use std::sync::atomic::Ordering::Relaxed;
        let mut order: Vec<&Prefix> = queries
            .iter()
            .filter(|q| q.num_tokens() > longer_than)
            .collect();
        order.sort_by_key(|q| std::cmp::Reverse(q.num_tokens()));
        order.truncate(self.config.max_lookup_roots);
        let mut listed: BTreeMap<String, Vec<(layout::ManifestName, String)>> = BTreeMap::new();
        let mut candidates_left = self.config.max_candidates;
        let mut rejected = false;
        for wave in order.chunks(self.config.lookup_wave) {
            // One listing per distinct chunk root of the wave, concurrently.
            let dirs: Vec<String> = wave
                .iter()
                .map(|q| self.layout.bucket_dir(q))
                .filter(|d| !listed.contains_key(d))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            let listings = futures_util::future::join_all(dirs.iter().map(|dir| async move {
                let (names, pages) = self
                    .fast
                    .list_names(dir, self.config.max_bucket_entries)
                    .await?;
                requests.lists.fetch_add(pages, Relaxed);
                Ok::<_, Error>(names)
            }))
            .await;
            let mut failed = 0;
            for (dir, listing) in dirs.iter().zip(listings) {
                match listing {
                    Ok(names) => {
                        let parsed = names
                            .into_iter()
                            .filter_map(|path| {
                                parse_manifest_name(file_name(&path)).map(|n| (n, path))
                            })
                            .collect();
                        listed.insert(dir.clone(), parsed);
                    }
                    Err(_) => failed += 1,
                }
            }
            if failed > 0 && failed == dirs.len() {
                return Err(LookupMiss::Error);
            }
            // Candidates: names whose length and tail hash fit a query.
            let mut candidates: Vec<(u64, &str, &Prefix)> = Vec::new();
            for q in wave {
                let Some(names) = listed.get(&self.layout.bucket_dir(q)) else {
                    continue;
                };
                let min_len = longer_than
                    .saturating_sub(q.start_tokens())
                    .saturating_add(1);
                let tail = q.tail_tokens();
                let mut fitting: Vec<&(layout::ManifestName, String)> = names
                    .iter()
                    .filter(|(n, _)| n.tail_len as u64 >= min_len && n.tail_len <= tail.len())
                    .collect();
                fitting.sort_by_key(|(n, _)| n.tail_len);
                let mut hasher = TailHasher::new(tail);
                for (name, path) in fitting {
                    if hasher.hash_of(name.tail_len).as_deref() == Some(name.tail_hash.as_str()) {
                        candidates.push((
                            q.start_tokens() + name.tail_len as u64,
                            path.as_str(),
                            q,
                        ));
                    }
                }
            }
            candidates.sort_by_key(|c| std::cmp::Reverse(c.0));
            for (_, path, q) in candidates {
                if candidates_left == 0 {
                    break;
                }
                candidates_left -= 1;
                requests.gets.fetch_add(1, Relaxed);
                match self.fetch_manifest(path, q).await {
                    Ok(Some(m)) => return Ok(m),
                    Ok(None) => rejected = true,
                    Err(_) => return Err(LookupMiss::Error),
                }
            }
            if candidates_left == 0 {
                break;
            }
        }
        Err(if rejected {
            LookupMiss::Corrupt
        } else {
            LookupMiss::NoMatch
        })
    }

    /// Fetches and verifies a candidate manifest for `query`: `None` when
    /// it is missing, corrupt, or not what its key and the query say.
    async fn fetch_manifest(&self, path: &str, query: &Prefix) -> Result<Option<Manifest>> {
        let Some(object) = self
            .fast
            .get_capped(path, format::MAX_MANIFEST_OBJECT_BYTES)
            .await?
        else {
            return Ok(None);
        };
        let verdict = decode_manifest(&object).and_then(|m| {
            let at_its_key = self.layout.manifest_key(m.prefix(), m.generation()) == path;
            if at_its_key && m.prefix().is_prefix_of(query) {
                Ok(m)
            } else {
                Err(Error::Corrupt(format!(
                    "shared tier: manifest {path} is not what its key and the query say"
                )))
            }
        });
        match verdict {
            Ok(m) => Ok(Some(m)),
            Err(e) => {
                self.counters.add(SharedCounter::ManifestsRejected, 1);
                log::warn!("shared tier: rejected manifest {path}: {e}");
                Ok(None)
            }
        }
    }

    async fn fetch_page(
        &self,
        namespace: &str,
        key: &ObjectKey,
        page_bytes: u64,
    ) -> Result<(Vec<u8>, Duration)> {
        let path = self.layout.page_key(namespace, key);
        let cap = page_object_bytes(page_bytes);
        let (object, answered) = self.bulk.get_capped_timed(&path, cap).await?;
        let Some(object) = object else {
            return Err(Error::NotFound(format!(
                "shared tier: no page {} in the store",
                key.hex()
            )));
        };
        let range = verify_page(&object, key, page_bytes)?;
        Ok((object.get(range).unwrap_or_default().to_vec(), answered))
    }

    async fn gc(&self, older_than: Duration) -> Result<GcReport> {
        let mut report = GcReport::default();
        for ns in self.bulk.list_dirs(self.layout.root()).await? {
            if !(ns.len() == layout::NAMESPACE_SEGMENT_CHARS
                && ns.bytes().all(|b| b.is_ascii_hexdigit()))
            {
                continue;
            }
            report.namespaces += 1;
            self.gc_namespace(&ns, older_than, &mut report).await?;
        }
        Ok(report)
    }

    async fn gc_namespace(
        &self,
        ns: &str,
        older_than: Duration,
        report: &mut GcReport,
    ) -> Result<()> {
        let age = millis(older_than);
        let manifests_dir = self.layout.manifests_dir_of_segment(ns);
        // 1. Old manifests go first: nothing can find them afterwards.
        let cutoff = now_millis().saturating_sub(age);
        let old: Vec<String> = self
            .bulk
            .list_meta(&manifests_dir)
            .await?
            .into_iter()
            .filter(|m| {
                parse_manifest_name(file_name(m.location.as_ref())).is_some()
                    && m.last_modified.timestamp_millis() < cutoff
            })
            .map(|m| m.location.to_string())
            .collect();
        report.manifests_deleted += self.bulk.delete_all(old).await?;
        // 2. What the remaining manifests name, read after the deletions;
        // the safe window starts at this listing.
        let listed_at = Instant::now();
        let cutoff = now_millis().saturating_sub(age);
        let window = older_than
            .saturating_sub(self.config.upload_bound())
            .saturating_sub(self.config.refresh_age)
            .saturating_sub(self.config.clock_skew.saturating_mul(2));
        let remaining = self.bulk.list_meta(&manifests_dir).await?;
        let mut referenced: HashSet<ObjectKey> = HashSet::new();
        for meta in remaining {
            let path = meta.location.to_string();
            if parse_manifest_name(file_name(&path)).is_none() {
                continue;
            }
            report.manifests_kept += 1;
            let manifest = match self
                .bulk
                .get_capped(&path, format::MAX_MANIFEST_OBJECT_BYTES)
                .await?
            {
                // Deleted meanwhile (by another gc): it protects nothing.
                None => continue,
                Some(object) => decode_manifest(&object).and_then(|m| Self::pages_of(&m)),
            };
            match manifest {
                Ok(pages) => referenced.extend(pages.into_iter().map(|(k, _)| k)),
                Err(e) => {
                    // Its pages are unknown: sweep nothing in this namespace
                    // (the manifest is deleted once it is old).
                    report
                        .skipped
                        .push((ns.to_string(), format!("unreadable manifest {path}: {e}")));
                    return Ok(());
                }
            }
        }
        // 3. Old pages nobody names, while the window lasts.
        let mut doomed = Vec::new();
        for meta in self
            .bulk
            .list_meta(&self.layout.pages_dir_of_segment(ns))
            .await?
        {
            let Some(key) = parse_page_name(file_name(meta.location.as_ref())) else {
                continue;
            };
            if referenced.contains(&key) {
                report.pages_referenced += 1;
            } else if meta.last_modified.timestamp_millis() >= cutoff {
                report.pages_young += 1;
            } else {
                doomed.push(meta.location.to_string());
            }
        }
        for batch in doomed.chunks(256) {
            if listed_at.elapsed() >= window {
                report.skipped.push((
                    ns.to_string(),
                    "the safe window for page deletion ran out; run gc again".into(),
                ));
                break;
            }
            report.pages_deleted += self.bulk.delete_all(batch.to_vec()).await?;
        }
        Ok(())
    }
}

fn upload_deadline_error(config: &SharedConfig) -> Error {
    Error::Timeout(format!(
        "shared upload: not done within its {} s deadline; the manifest was not written \
         (retry later)",
        config.upload_deadline.as_secs_f64()
    ))
}
