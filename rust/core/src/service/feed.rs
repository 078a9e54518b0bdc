//! The change feed: a bounded ring of what became restorable, reached a
//! more durable tier, or stopped being restorable, in the order it happened
//! (`docs/design/change-feed.md`).
//!
//! It lives in the service state (`state::State::feed`) and is written only
//! where a generation is listed ([`State::list_generation`]), reaches a
//! tier ([`State::set_tier`]) or is unlisted
//! ([`State::unlist_generation`]), all under the service mutex, so the order
//! of the ring is the order of the state's changes and a reader sees the
//! ring and the listed generations at one instant. Recording is O(1); the
//! ring holds at most its capacity (the oldest entries go first).
//!
//! [`State::list_generation`]: super::state::State::list_generation
//! [`State::set_tier`]: super::state::State::set_tier
//! [`State::unlist_generation`]: super::state::State::unlist_generation

use std::collections::VecDeque;
use std::sync::Arc;

use crate::protocol::{Change, ChangeBatch, MAX_CHANGES};

/// The most durable tier a listed generation's complete copy reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Tier {
    /// Only in the RAM pool (lost with the sidecar).
    L1,
    /// Every page durable in this host's L2.
    L2,
    /// Every page in the shared tier.
    Shared,
}

impl Tier {
    /// Its name in a [`Change`] (`protocol::TIERS`).
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::L1 => "l1",
            Tier::L2 => "l2",
            Tier::Shared => "shared",
        }
    }
}

/// What happened to a generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// It became restorable here.
    Listed(Tier),
    /// Its complete copy reached a more durable tier.
    Tier(Tier),
    /// It stopped being restorable here.
    Unlisted,
}

#[derive(Debug, Clone)]
struct Entry {
    seq: u64,
    generation: Arc<str>,
    kind: Kind,
}

/// The ring (see the module docs).
#[derive(Debug)]
pub struct Feed {
    epoch: String,
    ring: VecDeque<Entry>,
    next_seq: u64,
    capacity: usize,
}

impl Feed {
    /// An empty feed of `capacity` entries (at least 1) under `epoch`.
    pub fn new(epoch: String, capacity: usize) -> Feed {
        let capacity = capacity.max(1);
        Feed {
            epoch,
            ring: VecDeque::with_capacity(capacity.min(4096)),
            next_seq: 0,
            capacity,
        }
    }

    /// Appends one change; the oldest goes when the ring is full.
    pub fn record(&mut self, generation: &Arc<str>, kind: Kind) {
        if self.ring.len() == self.capacity {
            self.ring.pop_front();
        }
        self.ring.push_back(Entry {
            seq: self.next_seq,
            generation: generation.clone(),
            kind,
        });
        self.next_seq += 1;
    }

    /// The changes from `since` on, at most [`MAX_CHANGES`]; `watched` is
    /// left empty for the caller. `since` past the end (`u64::MAX` included)
    /// or before the oldest kept entry answers `truncated`; past the end it
    /// starts at the end, before the oldest at the oldest.
    pub fn read(&self, since: u64) -> ChangeBatch {
        let oldest = self.next_seq - self.ring.len() as u64;
        let (start, truncated) = if since > self.next_seq {
            (self.next_seq, true)
        } else if since < oldest {
            (oldest, true)
        } else {
            (since, false)
        };
        let skip = usize::try_from(start - oldest).unwrap_or(usize::MAX);
        let changes: Vec<Change> = self
            .ring
            .iter()
            .skip(skip)
            .take(MAX_CHANGES)
            .map(|e| {
                let (kind, tier) = match e.kind {
                    Kind::Listed(t) => ("listed", Some(t.as_str().to_string())),
                    Kind::Tier(t) => ("tier", Some(t.as_str().to_string())),
                    Kind::Unlisted => ("unlisted", None),
                };
                Change {
                    seq: e.seq,
                    generation: e.generation.to_string(),
                    kind: kind.to_string(),
                    tier,
                }
            })
            .collect();
        let next_seq = start + changes.len() as u64;
        ChangeBatch {
            epoch: self.epoch.clone(),
            next_seq,
            truncated,
            more: next_seq < self.next_seq,
            changes,
            watched: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(name: &str) -> Arc<str> {
        Arc::from(name)
    }

    #[test]
    fn a_full_ring_drops_its_oldest_entries_and_says_so() {
        let mut feed = Feed::new("e".into(), 3);
        for i in 0..5 {
            feed.record(&g(&format!("g{i}")), Kind::Unlisted);
        }
        let all = feed.read(0);
        assert!(all.truncated);
        assert_eq!(
            all.changes.iter().map(|c| c.seq).collect::<Vec<_>>(),
            vec![2, 3, 4]
        );
        let tail = feed.read(3);
        assert!(!tail.truncated);
        assert_eq!(tail.changes.len(), 2);
        assert_eq!(tail.next_seq, 5);
        let end = feed.read(u64::MAX);
        assert!(end.truncated && end.changes.is_empty() && end.next_seq == 5);
    }
}
