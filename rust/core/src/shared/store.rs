//! The object store behind the tier: opened from a URL, every request
//! counted, every error mapped onto the crate's [`Error`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    BackoffConfig, ClientConfigKey, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions,
    PutPayload, RetryConfig,
};

use super::SharedConfig;
use super::counters::{Counters, SharedCounter};
use crate::error::{Error, Result};

/// How a conditional write ended.
pub(super) enum Outcome {
    /// Written.
    Done,
    /// An object was already there (`PutMode::Create`).
    Exists,
}

/// One `object_store` client.
pub(super) struct Store {
    inner: Arc<dyn ObjectStore>,
    counters: Arc<Counters>,
}

fn parse_path(key: &str) -> Result<Path> {
    Path::parse(key)
        .map_err(|e| Error::invalid(format!("shared tier: bad object key {key:?}: {e}")))
}

fn duration_text(d: Duration) -> String {
    format!("{}ms", d.as_millis().max(1))
}

impl Store {
    /// Opens the store of `config.url`; returns it and the key prefix
    /// inside it. `fast` stores retry once (lookups).
    pub(super) fn open(config: &SharedConfig, fast: bool) -> Result<(Store, String)> {
        let url = config.url.as_str();
        let (inner, root): (Arc<dyn ObjectStore>, String) = if let Some(path) =
            url.strip_prefix("file://")
        {
            if !path.starts_with('/') {
                return Err(Error::invalid(format!(
                    "shared tier URL {url:?}: a file URL needs an absolute path (file:///dir)"
                )));
            }
            std::fs::create_dir_all(path)
                .map_err(|e| Error::io(format!("create the shared tier directory {path}"), e))?;
            let fs = LocalFileSystem::new_with_prefix(path)
                .map_err(|e| Error::invalid(format!("shared tier URL {url:?}: {e}")))?;
            (Arc::new(fs), String::new())
        } else if let Some(rest) = url
            .strip_prefix("s3://")
            .or_else(|| url.strip_prefix("s3a://"))
        {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(Error::invalid(format!(
                    "shared tier URL {url:?}: no bucket (s3://bucket/prefix)"
                )));
            }
            let retry = RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(100),
                    max_backoff: Duration::from_secs(5),
                    base: 2.0,
                },
                max_retries: if fast { 1 } else { config.max_retries },
                retry_timeout: config.retry_timeout,
            };
            let mut builder = AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .with_retry(retry)
                .with_config(
                    AmazonS3ConfigKey::Client(ClientConfigKey::Timeout),
                    duration_text(config.request_timeout),
                )
                .with_config(
                    AmazonS3ConfigKey::Client(ClientConfigKey::ConnectTimeout),
                    duration_text(config.connect_timeout),
                );
            for (key, value) in &config.options {
                let key: AmazonS3ConfigKey = key
                    .parse()
                    .map_err(|e| Error::invalid(format!("shared tier option {key:?}: {e}")))?;
                builder = builder.with_config(key, value.clone());
            }
            let s3 = builder
                .build()
                .map_err(|e| Error::invalid(format!("shared tier URL {url:?}: {e}")))?;
            (Arc::new(s3), prefix.trim_matches('/').to_string())
        } else {
            return Err(Error::invalid(format!(
                "shared tier URL {url:?}: expected s3://bucket[/prefix] or file:///path"
            )));
        };
        if !root.is_empty() {
            parse_path(&root)?;
        }
        let inner: Arc<dyn ObjectStore> = if config.inject_latency.is_zero() {
            inner
        } else {
            Arc::new(super::latency::Delayed::new(inner, config.inject_latency))
        };
        Ok((
            Store {
                inner,
                counters: Arc::new(Counters::default()),
            },
            root,
        ))
    }

    /// The same store, counting into `counters`.
    pub(super) fn with_counters(self, counters: Arc<Counters>) -> Store {
        Store { counters, ..self }
    }

    fn count(&self) {
        self.counters.add(SharedCounter::Requests, 1);
    }

    fn failed(&self, what: &str, key: &str, e: object_store::Error) -> Error {
        self.counters.add(SharedCounter::Errors, 1);
        Error::Unavailable(format!("shared tier: {what} {key}: {e}"))
    }

    /// Metadata of an object, `None` when absent.
    pub(super) async fn head(&self, key: &str) -> Result<Option<ObjectMeta>> {
        let path = parse_path(key)?;
        self.count();
        match self.inner.head(&path).await {
            Ok(meta) => Ok(Some(meta)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.failed("head", key, e)),
        }
    }

    /// Writes an object (`Create`: only if absent).
    pub(super) async fn put(
        &self,
        key: &str,
        payload: PutPayload,
        mode: PutMode,
    ) -> Result<Outcome> {
        let path = parse_path(key)?;
        self.count();
        match self
            .inner
            .put_opts(&path, payload, PutOptions::from(mode))
            .await
        {
            Ok(_) => Ok(Outcome::Done),
            // Also what a retried put whose first attempt landed reads as.
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. },
            ) => Ok(Outcome::Exists),
            Err(e) => Err(self.failed("put", key, e)),
        }
    }

    /// The whole object, `None` when absent; [`Error::Corrupt`] when it is
    /// longer than `cap` (never read beyond it).
    pub(super) async fn get_capped(&self, key: &str, cap: u64) -> Result<Option<Bytes>> {
        Ok(self.get_capped_timed(key, cap).await?.0)
    }

    /// [`Store::get_capped`], with how long the store took to answer the
    /// GET (before the body was read).
    pub(super) async fn get_capped_timed(
        &self,
        key: &str,
        cap: u64,
    ) -> Result<(Option<Bytes>, Duration)> {
        let path = parse_path(key)?;
        self.count();
        let started = std::time::Instant::now();
        let result = match self.inner.get(&path).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => return Ok((None, started.elapsed())),
            Err(e) => return Err(self.failed("get", key, e)),
        };
        let answered = started.elapsed();
        let too_long = || {
            Error::Corrupt(format!(
                "shared tier: object {key} is longer than the {cap} bytes expected"
            ))
        };
        if result.meta.size > cap {
            return Err(too_long());
        }
        let mut stream = result.into_stream();
        let mut chunks: Vec<Bytes> = Vec::new();
        let mut total: u64 = 0;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.failed("read", key, e))?;
            total = total.saturating_add(chunk.len() as u64);
            if total > cap {
                return Err(too_long());
            }
            chunks.push(chunk);
        }
        let body = match chunks.len() {
            1 => chunks.pop().unwrap_or_default(),
            _ => {
                let mut out = Vec::with_capacity(usize::try_from(total).unwrap_or(0));
                for c in &chunks {
                    out.extend_from_slice(c);
                }
                Bytes::from(out)
            }
        };
        Ok((Some(body), answered))
    }

    /// Up to `limit` object keys under `dir/`, and the listing requests sent
    /// (one per page of 1000).
    pub(super) async fn list_names(&self, dir: &str, limit: usize) -> Result<(Vec<String>, u64)> {
        let path = parse_path(dir)?;
        let mut stream = self.inner.list(Some(&path));
        let mut names = Vec::new();
        self.count();
        let mut requests = 1u64;
        while let Some(meta) = stream.next().await {
            let meta = meta.map_err(|e| self.failed("list", dir, e))?;
            names.push(meta.location.to_string());
            if names.len() % 1000 == 0 {
                // The next item (if any) comes from another page.
                self.count();
                requests += 1;
            }
            if names.len() >= limit {
                break;
            }
        }
        Ok((names, requests))
    }

    /// Every object under `dir/` with its metadata.
    pub(super) async fn list_meta(&self, dir: &str) -> Result<Vec<ObjectMeta>> {
        let path = parse_path(dir)?;
        self.count();
        self.inner
            .list(Some(&path))
            .try_collect()
            .await
            .map_err(|e| self.failed("list", dir, e))
    }

    /// The names of the "directories" directly under `dir/`.
    pub(super) async fn list_dirs(&self, dir: &str) -> Result<Vec<String>> {
        let path = parse_path(dir)?;
        self.count();
        let listing = self
            .inner
            .list_with_delimiter(Some(&path))
            .await
            .map_err(|e| self.failed("list", dir, e))?;
        Ok(listing
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(str::to_string))
            .collect())
    }

    /// Deletes objects (absent ones count as deleted); returns how many.
    pub(super) async fn delete_all(&self, keys: Vec<String>) -> Result<u64> {
        let mut paths = Vec::with_capacity(keys.len());
        for key in &keys {
            paths.push(parse_path(key)?);
        }
        let n = paths.len() as u64;
        if n == 0 {
            return Ok(0);
        }
        self.count();
        let locations = futures_util::stream::iter(paths.into_iter().map(Ok)).boxed();
        let mut results = self.inner.delete_stream(locations);
        let mut deleted = 0;
        while let Some(r) = results.next().await {
            match r {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => deleted += 1,
                Err(e) => return Err(self.failed("delete", "(batch)", e)),
            }
        }
        debug_assert!(deleted <= n);
        Ok(deleted)
    }
}
