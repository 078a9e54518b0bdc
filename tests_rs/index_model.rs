//! Model-based test: random sequences of begin / acknowledge / abort /
//! invalidate / find / reopen against a file directory and a plain in-memory
//! model of the reference semantics (small capacities, so replacement,
//! pending-capacity refusals and LRU eviction all happen).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use lmcache_rc_core::index::{Directory, DirectoryConfig, Publication};
use lmcache_rc_core::{ErrorKind, Manifest};
use proptest::prelude::*;

use crate::index_support::*;

const MAX_ENTRIES: u64 = 2;
const MAX_PENDING: u64 = 2;
/// Stored tails of generations g0..g5 (g4 shares g1's exact prefix).
const TAILS: [&[u32]; 6] = [&[1], &[1, 2], &[1, 2, 3], &[2], &[1, 2], &[1, 3]];
const QUERIES: [&[u32]; 6] = [&[1], &[1, 2], &[1, 2, 3, 4], &[2, 5], &[1, 3], &[9]];

fn world(g: usize) -> u32 {
    (g % 2) as u32 + 1
}

fn universe(g: usize, variant: u8) -> Manifest {
    manifest(
        &format!("g{g}"),
        prefix(TAILS[g]),
        world(g),
        payload(&format!("g{g}-v{variant}")),
    )
}

#[derive(Debug, Clone)]
enum Op {
    Begin(usize, u8),
    Ack(usize, u32),
    /// Acknowledges every rank in turn (expanded into `Ack`s).
    AckAll(usize),
    Abort(usize),
    Invalidate(usize),
    Find(usize),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..6usize, 0..2u8).prop_map(|(g, v)| Op::Begin(g, v)),
        2 => (0..6usize, 0..3u32).prop_map(|(g, r)| Op::Ack(g, r)),
        5 => (0..6usize).prop_map(Op::AckAll),
        1 => (0..6usize).prop_map(Op::Abort),
        1 => (0..6usize).prop_map(Op::Invalidate),
        3 => (0..6usize).prop_map(Op::Find),
        1 => Just(Op::Reopen),
    ]
}

#[derive(Default)]
struct Model {
    /// generation index → (variant, acknowledged ranks)
    pending: BTreeMap<usize, (u8, BTreeSet<u32>)>,
    /// generation index → (variant, recency stamp)
    published: BTreeMap<usize, (u8, u64)>,
    counter: u64,
}

/// What one operation returned, comparable between model and directory.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Flag(bool),
    Published(Publication),
    Found(Option<String>),
    Error(ErrorKind),
    Done,
}

impl Model {
    fn apply(&mut self, op: &Op) -> Outcome {
        match *op {
            Op::Begin(g, v) => {
                if let Some((pv, _)) = self.pending.get(&g) {
                    return if *pv == v {
                        Outcome::Flag(false)
                    } else {
                        Outcome::Error(ErrorKind::GenerationConflict)
                    };
                }
                if let Some((pv, _)) = self.published.get(&g) {
                    return if *pv == v {
                        Outcome::Flag(false)
                    } else {
                        Outcome::Error(ErrorKind::GenerationConflict)
                    };
                }
                if self.pending.len() as u64 >= MAX_PENDING {
                    return Outcome::Flag(false);
                }
                self.pending.insert(g, (v, BTreeSet::new()));
                Outcome::Flag(true)
            }
            Op::Ack(g, rank) => {
                let Some((v, ranks)) = self.pending.get_mut(&g) else {
                    return Outcome::Published(Publication::default());
                };
                if rank >= world(g) {
                    return Outcome::Error(ErrorKind::InvalidInput);
                }
                ranks.insert(rank);
                if (ranks.len() as u32) < world(g) {
                    return Outcome::Published(Publication::default());
                }
                let v = *v;
                self.pending.remove(&g);
                let replaced = self
                    .published
                    .keys()
                    .copied()
                    .find(|&o| o != g && TAILS[o] == TAILS[g]);
                if let Some(o) = replaced {
                    self.published.remove(&o);
                }
                self.counter += 1;
                self.published.insert(g, (v, self.counter));
                let mut evicted = Vec::new();
                while self.published.len() as u64 > MAX_ENTRIES {
                    let (&victim, _) = self
                        .published
                        .iter()
                        .filter(|(k, _)| **k != g)
                        .min_by_key(|(_, (_, stamp))| *stamp)
                        .unwrap();
                    self.published.remove(&victim);
                    evicted.push(format!("g{victim}"));
                }
                Outcome::Published(Publication {
                    published: true,
                    replaced: replaced.map(|o| format!("g{o}")),
                    evicted,
                })
            }
            Op::Abort(g) => Outcome::Flag(self.pending.remove(&g).is_some()),
            Op::Invalidate(g) => Outcome::Flag(self.published.remove(&g).is_some()),
            Op::Find(q) => {
                let query = QUERIES[q];
                let best = self
                    .published
                    .keys()
                    .copied()
                    .filter(|&g| query.starts_with(TAILS[g]))
                    .max_by_key(|&g| TAILS[g].len());
                if let Some(g) = best {
                    self.counter += 1;
                    if let Some(entry) = self.published.get_mut(&g) {
                        entry.1 = self.counter;
                    }
                }
                Outcome::Found(best.map(|g| format!("g{g}")))
            }
            Op::Reopen => {
                self.pending.clear();
                Outcome::Done
            }
            Op::AckAll(_) => unreachable!("expanded before use"),
        }
    }
}

fn open(path: &Path) -> Directory {
    file(
        path,
        DirectoryConfig {
            max_entries: MAX_ENTRIES,
            max_pending: MAX_PENDING,
            recency_flush_updates: 2,
            ..DirectoryConfig::default()
        },
    )
}

fn run(dir: &mut Directory, path: &Path, op: &Op) -> Outcome {
    let flag = |r: lmcache_rc_core::Result<bool>| match r {
        Ok(b) => Outcome::Flag(b),
        Err(e) => Outcome::Error(e.kind()),
    };
    match *op {
        Op::Begin(g, v) => flag(dir.begin(&universe(g, v))),
        Op::Ack(g, rank) => match dir.acknowledge(&format!("g{g}"), rank) {
            Ok(p) => Outcome::Published(p),
            Err(e) => Outcome::Error(e.kind()),
        },
        Op::Abort(g) => flag(dir.abort(&format!("g{g}"))),
        Op::Invalidate(g) => flag(dir.invalidate(&format!("g{g}"))),
        Op::Find(q) => match dir.find(&[prefix(QUERIES[q])]) {
            Ok(m) => Outcome::Found(m.map(|m| m.generation().to_owned())),
            Err(e) => Outcome::Error(e.kind()),
        },
        Op::Reopen => {
            dir.close().unwrap();
            *dir = open(path);
            Outcome::Done
        }
        Op::AckAll(_) => unreachable!("expanded before use"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn directory_agrees_with_a_model_of_the_reference_semantics(
        ops in proptest::collection::vec(op(), 1..80)
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("directory.sqlite3");
        let mut dir = open(&path);
        let mut model = Model::default();
        let ops: Vec<Op> = ops
            .into_iter()
            .flat_map(|op| match op {
                Op::AckAll(g) => (0..world(g)).map(|r| Op::Ack(g, r)).collect(),
                op => vec![op],
            })
            .collect();
        let mut evictions = 0;
        for (step, op) in ops.iter().enumerate() {
            let expected = model.apply(op);
            let actual = run(&mut dir, &path, op);
            prop_assert_eq!(&actual, &expected, "step {} {:?}", step, op);
            if let Outcome::Published(p) = &actual {
                evictions += p.evicted.len();
            }
            let status = dir.status().unwrap();
            prop_assert_eq!(status.published_generations, model.published.len() as u64);
            prop_assert_eq!(status.pending_generations, model.pending.len() as u64);
        }
        // Every modelled generation is exactly what the directory holds.
        for (g, (v, _)) in &model.published {
            let got = dir.get(&format!("g{g}")).unwrap();
            prop_assert_eq!(got, Some(universe(*g, *v)));
        }
        dir.close().unwrap();
        prop_assert_eq!(row_generations(&path), tail_generations(&path));
        if std::env::var_os("LMCACHE_RC_MODEL_STATS").is_some() {
            eprintln!("model case: {} ops, {evictions} evictions", ops.len());
        }
    }
}
