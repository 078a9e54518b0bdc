//! What loading a page from each tier costs, as this service measured it:
//! the figures a scheduler weighs a restore against recomputing its tokens
//! with (`find_located`, `docs/vllm.md` "Restore only when it beats
//! recomputing").
//!
//! Each page load is timed where the service does its I/O — an L2 read on
//! an I/O thread (`tiers::submit_load`), a shared-tier fetch on a fetch
//! thread (`shared::run_fetch`) — in two parts: the time until the page's
//! bytes start to arrive (the file opened and its header read; the GET
//! answered) and the time moving them (read, verified, copied into L1).
//! A [`LoadMeter`] keeps an exponentially weighted moving average of the
//! first part (the *latency*), of the second and of the bytes (their ratio
//! is the *bandwidth*, so one tiny page cannot make it infinite). Only
//! loads that succeeded are measured. L1 has no meter here: restoring from
//! L1 is the worker's memory copy, which the sidecar never sees.
//!
//! Nothing here holds the service lock; each meter has a lock of its own,
//! taken for a few arithmetic operations.

use std::time::Duration;

use parking_lot::Mutex;

/// Weight of a new measurement in the moving averages (the last ~10 loads
/// carry most of the weight, so a tier that slows down shows within a few
/// restores).
const WEIGHT: f64 = 0.2;

/// Moving averages of one tier's page loads.
#[derive(Debug, Default)]
struct Averages {
    samples: u64,
    latency_s: f64,
    transfer_s: f64,
    bytes: f64,
}

/// One tier's measured page loads (see the module docs).
#[derive(Debug, Default)]
pub(super) struct LoadMeter {
    averages: Mutex<Averages>,
}

/// A meter's figures as the protocol reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Figures {
    /// Loads measured (0: the other figures are 0 and mean "unknown").
    pub samples: u64,
    /// Average time until a page's bytes start to arrive, microseconds.
    pub latency_us: u64,
    /// Average rate of moving a page's bytes once they arrive, bytes/s.
    pub bytes_per_s: u64,
}

impl LoadMeter {
    /// One successful load of `bytes`: `first_byte` until its bytes started
    /// to arrive, `total` until it was in L1 (`first_byte` is clamped to it).
    pub(super) fn observe(&self, first_byte: Duration, total: Duration, bytes: u64) {
        let first = first_byte.min(total).as_secs_f64();
        let transfer = total.as_secs_f64() - first;
        let bytes = bytes as f64;
        let mut a = self.averages.lock();
        if a.samples == 0 {
            (a.latency_s, a.transfer_s, a.bytes) = (first, transfer, bytes);
        } else {
            a.latency_s += WEIGHT * (first - a.latency_s);
            a.transfer_s += WEIGHT * (transfer - a.transfer_s);
            a.bytes += WEIGHT * (bytes - a.bytes);
        }
        a.samples += 1;
    }

    /// The current figures.
    pub(super) fn figures(&self) -> Figures {
        let a = self.averages.lock();
        if a.samples == 0 {
            return Figures::default();
        }
        let bytes_per_s = if a.transfer_s > 0.0 {
            a.bytes / a.transfer_s
        } else {
            f64::MAX
        };
        Figures {
            samples: a.samples,
            latency_us: (a.latency_s * 1e6).round() as u64,
            // `as` saturates: an unmeasurably fast transfer is u64::MAX.
            bytes_per_s: bytes_per_s.round() as u64,
        }
    }
}

/// The meters of the tiers a restore loads from.
#[derive(Debug, Default)]
pub(super) struct Meters {
    /// L2 reads into L1.
    pub l2: LoadMeter,
    /// Shared-tier fetches into L1.
    pub shared: LoadMeter,
}

impl Meters {
    /// Status values: `<tier>_load_latency_us`, `<tier>_load_bytes_per_s`
    /// and `<tier>_load_samples` for `l2` and `shared` (zeros until a load
    /// was measured).
    pub(super) fn status_values(&self) -> Vec<(String, u64)> {
        let mut out = Vec::with_capacity(6);
        for (tier, meter) in [("l2", &self.l2), ("shared", &self.shared)] {
            let f = meter.figures();
            out.push((format!("{tier}_load_latency_us"), f.latency_us));
            out.push((format!("{tier}_load_bytes_per_s"), f.bytes_per_s));
            out.push((format!("{tier}_load_samples"), f.samples));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_measurement_is_unknown_not_free() {
        assert_eq!(LoadMeter::default().figures(), Figures::default());
    }

    #[test]
    fn the_first_load_sets_the_figures_and_later_ones_move_them() {
        let m = LoadMeter::default();
        m.observe(
            Duration::from_millis(50),
            Duration::from_millis(51),
            1_000_000,
        );
        let f = m.figures();
        assert_eq!((f.samples, f.latency_us), (1, 50_000));
        assert_eq!(f.bytes_per_s, 1_000_000_000);
        m.observe(
            Duration::from_millis(0),
            Duration::from_millis(1),
            1_000_000,
        );
        let f = m.figures();
        assert_eq!(f.samples, 2);
        assert_eq!(f.latency_us, 40_000, "0.8 x 50 ms + 0.2 x 0 ms");
        assert_eq!(f.bytes_per_s, 1_000_000_000);
    }

    #[test]
    fn a_first_byte_past_the_total_is_clamped() {
        let m = LoadMeter::default();
        m.observe(Duration::from_millis(5), Duration::from_millis(2), 4096);
        let f = m.figures();
        assert_eq!(f.latency_us, 2_000);
        assert_eq!(f.bytes_per_s, u64::MAX, "no transfer time measured");
    }

    #[test]
    fn status_names_every_figure() {
        let names: Vec<String> = Meters::default()
            .status_values()
            .into_iter()
            .map(|(k, v)| {
                assert_eq!(v, 0);
                k
            })
            .collect();
        assert_eq!(
            names,
            [
                "l2_load_latency_us",
                "l2_load_bytes_per_s",
                "l2_load_samples",
                "shared_load_latency_us",
                "shared_load_bytes_per_s",
                "shared_load_samples"
            ]
        );
    }
}
