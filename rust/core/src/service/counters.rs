//! The service's event counters and miss counts: closed sets, counted in
//! arrays under the state lock and named only when a status is built.

use crate::protocol::MissReason;

named_enum! {
    /// An event the service counts; each is a status value of its name.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub enum Counter {
        /// `find` answered a manifest.
        FindHits = "find_hits",
        /// `find` answered nothing.
        FindMisses = "find_misses",
        /// `begin` refused a generation an aborted attempt of which still drains.
        BeginDraining = "begin_draining",
        /// `begin` refused a duplicate (identical generation pending or listed) or found no capacity.
        BeginSuppressed = "begin_suppressed",
        /// `begin` refused because pending manifests hold `max_pending_bytes`.
        BeginRefusedPendingBytes = "begin_refused_pending_bytes",
        /// `begin` refused because the disk is full (the directory is read-only
        /// or a write failed for lack of space).
        BeginRefusedNoSpace = "begin_refused_no_space",
        /// Pending generations aborted because they were begun more than
        /// `abandoned_after` ago (checked at every begin and by a timer).
        AbandonedGenerations = "abandoned_generations",
        /// Store pages reused without a copy (already resident).
        StorePagesReused = "store_pages_reused",
        /// Store pages leased for a copy.
        StorePagesNew = "store_pages_new",
        /// Bytes exposed to store copies.
        StoreBytesLeased = "store_bytes_leased",
        /// Bytes committed by successful store finishes.
        StoreBytesCommitted = "store_bytes_committed",
        /// Store admissions that had to wait for space.
        AdmissionWaits = "admission_waits",
        /// Admission attempts repeated after a wait.
        AdmissionRetries = "admission_retries",
        /// Store admissions that succeeded after waiting for evictions.
        AdmissionSuccessAfterEviction = "admission_success_after_eviction",
        /// Store admissions that gave up on space (a `capacity` miss).
        AdmissionTimeouts = "admission_timeouts",
        /// Store admissions answered `busy`.
        AdmissionBusy = "admission_busy",
        /// Generations published (every rank committed).
        Published = "published",
        /// Retrieves whose slots were exposed (restores served).
        Hits = "hits",
        /// Pages exposed to retrieve copies (every rank's pages of the restores served).
        RestoredPages = "restored_pages",
        /// Tokens covered by the restores served, counted once per restore
        /// (when rank 0's slots are exposed).
        RestoredTokens = "restored_tokens",
        /// Listed generations dropped for space (directory capacity, or their only copy evicted).
        Evictions = "evictions",
        /// L1 copies evicted.
        L1Evictions = "l1_evictions",
        /// L2 files evicted for space.
        L2Evictions = "l2_evictions",
        /// Pages loaded from L2 into L1 for a retrieve.
        L2Loads = "l2_loads",
        /// Retrieve loads that waited for L1 space.
        RetrieveCapacityWaits = "retrieve_capacity_waits",
        /// Retrieves cancelled before exposing slots.
        RetrievesCancelled = "retrieves_cancelled",
        /// Retrieve leases whose holder stopped polling them before they
        /// exposed slots, ended by the sweep after twice `retrieve_timeout`.
        RetrievesExpired = "retrieves_expired",
        /// L2 reads that proved a page lost (missing or corrupt file).
        L2CorruptOrMissing = "l2_corrupt_or_missing",
        /// L2 writes that failed (each attempt).
        L2WriteErrors = "l2_write_errors",
        /// Failed L2 writes scheduled for another attempt.
        L2WriteRetries = "l2_write_retries",
        /// L2 writes skipped because the tier was full.
        L2SkippedFull = "l2_skipped_full",
        /// Objects deleted from every tier at zero references.
        ReclaimedObjects = "reclaimed_objects",
        /// Generations retired at start-up (an object missing or corrupt).
        RestartRetired = "restart_retired",
        /// Clears performed.
        Clears = "clears",
        /// Generations retired by `invalidate_namespace`.
        InvalidatedGenerations = "invalidated_generations",
        /// Store leases aborted because their process was gone.
        ReclaimedStoreLeases = "reclaimed_store_leases",
        /// Retrieve leases released because their process was gone.
        ReclaimedRetrieveLeases = "reclaimed_retrieve_leases",
        /// Generations a `find` found in the shared tier and imported into
        /// the directory (published here, durable once their pages are local).
        SharedImports = "shared_imports",
        /// Generations found in the shared tier that could not be imported
        /// (the directory refused them: full of pending ones, read-only...).
        SharedImportsRefused = "shared_imports_refused",
        /// Pages a restore fetched from the shared tier into L1.
        SharedFetches = "shared_fetches",
        /// Shared-tier fetches that failed (their generations are retired).
        SharedFetchErrors = "shared_fetch_errors",
    }
}

/// The counts of every [`Counter`] and every [`MissReason`].
#[derive(Debug, Clone)]
pub struct Counters {
    events: [u64; Counter::ALL.len()],
    misses: [u64; MissReason::ALL.len()],
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            events: [0; Counter::ALL.len()],
            misses: [0; MissReason::ALL.len()],
        }
    }
}

impl Counters {
    /// Adds `by` to `counter`.
    pub fn add(&mut self, counter: Counter, by: u64) {
        let slot = &mut self.events[counter as usize];
        *slot = slot.saturating_add(by);
    }

    /// Counts one miss for `reason`.
    pub fn miss(&mut self, reason: MissReason) {
        let slot = &mut self.misses[reason as usize];
        *slot = slot.saturating_add(1);
    }

    /// The value of `counter`.
    pub fn get(&self, counter: Counter) -> u64 {
        self.events[counter as usize]
    }

    /// Every counter with its value (zeros included, so metrics exist from the start).
    pub fn events(&self) -> impl Iterator<Item = (Counter, u64)> + '_ {
        Counter::ALL.iter().map(|&c| (c, self.get(c)))
    }

    /// Every reason that missed at least once, with its count.
    pub fn misses(&self) -> impl Iterator<Item = (MissReason, u64)> + '_ {
        MissReason::ALL
            .iter()
            .map(|&r| (r, self.misses[r as usize]))
            .filter(|&(_, n)| n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_names_are_unique_and_index_their_slots() {
        let names: std::collections::HashSet<&str> =
            Counter::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(names.len(), Counter::ALL.len());
        let mut c = Counters::default();
        c.add(Counter::Clears, 2);
        c.add(Counter::FindHits, 1);
        c.miss(MissReason::Capacity);
        assert_eq!(c.get(Counter::Clears), 2);
        assert_eq!(c.get(Counter::FindMisses), 0);
        assert_eq!(
            c.misses().collect::<Vec<_>>(),
            vec![(MissReason::Capacity, 1)]
        );
    }
}
