//! What attached engines report of themselves (`report_engine`, `engines`):
//! each engine's last counters, so an operator reading the sidecar's status
//! sees every engine's lookups, restores, stores and failures beside the
//! sidecar's own figures.
//!
//! A small book behind its own lock, never the state lock: at most
//! [`MAX_ENGINES`] engines (a new one replaces the one that reported least
//! recently), each kept [`ENGINE_REPORT_TTL`] after its last report.
//!
//! Never: trust a report's sizes (every bound is checked before anything is
//! kept) or let a report touch checkpoints.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::protocol::{
    ENGINE_REPORT_TTL, EngineReport, MAX_ENGINE_COUNTERS, MAX_ENGINE_NAME, MAX_ENGINES,
};

/// One engine's last report: when it came, and its counters.
type Kept = (Instant, BTreeMap<String, u64>);

/// The engines' last reports.
#[derive(Default)]
pub(super) struct EngineBook {
    reports: Mutex<HashMap<String, Kept>>,
}

fn check_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_ENGINE_NAME {
        return Err(Error::invalid(format!(
            "an engine report's {what} must be 1..={MAX_ENGINE_NAME} bytes, got {}",
            name.len()
        )));
    }
    Ok(())
}

impl EngineBook {
    /// Keeps `engine`'s counters (replacing its previous report).
    pub(super) fn report(&self, engine: &str, counters: &[(String, u64)]) -> Result<()> {
        check_name("engine id", engine)?;
        if counters.len() > MAX_ENGINE_COUNTERS {
            return Err(Error::invalid(format!(
                "an engine report carries at most {MAX_ENGINE_COUNTERS} counters, got {}",
                counters.len()
            )));
        }
        for (name, _) in counters {
            check_name("counter name", name)?;
        }
        let now = Instant::now();
        let mut reports = self.reports.lock();
        reports.retain(|_, (at, _)| now.duration_since(*at) < ENGINE_REPORT_TTL);
        if !reports.contains_key(engine) && reports.len() >= MAX_ENGINES {
            let oldest = reports
                .iter()
                .min_by_key(|(_, (at, _))| *at)
                .map(|(id, _)| id.clone());
            if let Some(id) = oldest {
                reports.remove(&id);
            }
        }
        reports.insert(
            engine.to_string(),
            (now, counters.iter().cloned().collect()),
        );
        Ok(())
    }

    /// Every kept report, most recent first.
    pub(super) fn list(&self) -> Vec<EngineReport> {
        let now = Instant::now();
        let mut reports = self.reports.lock();
        reports.retain(|_, (at, _)| now.duration_since(*at) < ENGINE_REPORT_TTL);
        let mut out: Vec<(Duration, EngineReport)> = reports
            .iter()
            .map(|(engine, (at, counters))| {
                let age = now.duration_since(*at);
                let report = EngineReport {
                    engine: engine.clone(),
                    age_ms: u64::try_from(age.as_millis()).unwrap_or(u64::MAX),
                    counters: counters.clone(),
                };
                (age, report)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.engine.cmp(&b.1.engine)));
        out.into_iter().map(|(_, r)| r).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(n: u64) -> Vec<(String, u64)> {
        vec![("lookups".into(), n), ("restores_done".into(), n / 2)]
    }

    #[test]
    fn the_last_report_of_each_engine_is_kept_most_recent_first() {
        let book = EngineBook::default();
        book.report("a", &counters(4)).unwrap();
        book.report("b", &counters(2)).unwrap();
        book.report("a", &counters(10)).unwrap();
        let list = book.list();
        assert_eq!(list.len(), 2);
        assert_eq!(list[0].engine, "a");
        assert_eq!(list[0].counters["lookups"], 10);
        assert_eq!(list[1].counters["restores_done"], 1);
    }

    #[test]
    fn a_new_engine_beyond_the_bound_replaces_the_least_recent_one() {
        let book = EngineBook::default();
        for i in 0..MAX_ENGINES {
            book.report(&format!("e{i}"), &counters(1)).unwrap();
        }
        book.report("new", &counters(1)).unwrap();
        let ids: Vec<String> = book.list().into_iter().map(|r| r.engine).collect();
        assert_eq!(ids.len(), MAX_ENGINES);
        assert!(ids.contains(&"new".to_string()));
        assert!(
            !ids.contains(&"e0".to_string()),
            "the least recent was kept"
        );
    }

    #[test]
    fn reports_past_their_bounds_are_refused_and_keep_nothing() {
        let book = EngineBook::default();
        let long = "x".repeat(MAX_ENGINE_NAME + 1);
        for (engine, c) in [
            ("", counters(1)),
            (long.as_str(), counters(1)),
            ("a", vec![(String::new(), 1)]),
            ("a", vec![(long.clone(), 1)]),
            (
                "a",
                (0..=MAX_ENGINE_COUNTERS)
                    .map(|i| (format!("c{i}"), 1))
                    .collect(),
            ),
        ] {
            let e = book.report(engine, &c).unwrap_err();
            assert_eq!(e.kind(), crate::error::ErrorKind::InvalidInput, "{e}");
        }
        assert!(book.list().is_empty());
    }
}
