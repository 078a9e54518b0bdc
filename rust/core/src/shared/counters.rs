//! Counters of the shared tier, for status and metrics: lock-free, one
//! atomic per event, named only when a snapshot is taken.

use std::sync::atomic::{AtomicU64, Ordering};

named_enum! {
    /// An event the shared tier counts; each is a status value of its name.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum SharedCounter {
        /// Uploads that ended with the manifest present (written or found).
        Uploads = "uploads",
        /// Manifests this tier wrote.
        ManifestsWritten = "manifests_written",
        /// Uploads that found their manifest already present (nothing sent).
        ManifestsPresent = "manifests_present",
        /// Uploads that failed (nothing visible; retry later).
        UploadFailures = "upload_failures",
        /// Page objects this tier wrote.
        PagesUploaded = "pages_uploaded",
        /// Bytes of page and manifest objects this tier wrote.
        BytesUploaded = "bytes_uploaded",
        /// Pages already present (another host or generation wrote them).
        DedupHits = "dedup_hits",
        /// Present pages rewritten because they were older than the refresh age.
        PagesRefreshed = "pages_refreshed",
        /// Lookups asked.
        Lookups = "lookups",
        /// Lookups that returned a verified manifest.
        LookupHits = "lookup_hits",
        /// Lookups that found no matching name.
        MissesNone = "misses_none",
        /// Lookups whose candidates were all corrupt, missing or foreign.
        MissesCorrupt = "misses_corrupt",
        /// Lookups that ran out of time.
        MissesTimeout = "misses_timeout",
        /// Lookups that failed on a store error (server down...).
        MissesError = "misses_error",
        /// Candidate manifests rejected by verification.
        ManifestsRejected = "manifests_rejected",
        /// Pages fetched and verified.
        PagesFetched = "pages_fetched",
        /// Page bytes fetched and verified.
        BytesFetched = "bytes_fetched",
        /// Page fetches refused by verification (corrupt, truncated, foreign).
        FetchCorrupt = "fetch_corrupt",
        /// Page fetches that found no object.
        FetchMissing = "fetch_missing",
        /// Requests to the store that failed (transport or server errors).
        Errors = "errors",
        /// Requests sent to the store (every kind).
        Requests = "requests",
        /// Manifests removed by gc.
        GcManifestsDeleted = "gc_manifests_deleted",
        /// Pages removed by gc.
        GcPagesDeleted = "gc_pages_deleted",
    }
}

/// The counters of one tier.
#[derive(Debug)]
pub struct Counters {
    values: [AtomicU64; SharedCounter::ALL.len()],
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            values: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Counters {
    /// Adds `n` to a counter.
    pub fn add(&self, counter: SharedCounter, n: u64) {
        if let Some(v) = self.values.get(counter as usize) {
            v.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// One counter's value.
    pub fn get(&self, counter: SharedCounter) -> u64 {
        self.values
            .get(counter as usize)
            .map_or(0, |v| v.load(Ordering::Relaxed))
    }

    /// Every counter with its name, in declaration order.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        SharedCounter::ALL
            .iter()
            .map(|&c| (c.as_str(), self.get(c)))
            .collect()
    }
}
