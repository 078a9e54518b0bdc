//! Lease ownership and reclaim: leases belong to processes, and a process
//! that is gone gives its leases back.
//!
//! Every lease records its [`Holder`]: the local process that obtained it
//! (an RPC client, see [`crate::peer`]), or nobody the service can watch
//! (in-process callers, peers in another pid namespace). Rules:
//!
//! - a live process keeps its leases, whatever its connections do (a
//!   reconnecting worker finishes them on its new connection), and so does
//!   a live process whose copies turned unsafe (they may still run; ending
//!   that process is the operator's call, I4/I5);
//! - once the process is gone, its **store leases abort** exactly as a
//!   failed `finish_store` would (their pages are dropped, the generation is
//!   aborted and unpinned, nothing is published) and its **retrieve leases
//!   release** their readers, exposed or not. Nothing it held can be touched
//!   by a copy any more: a dead process copies nothing;
//! - this happens at once when its connection closes (the process is
//!   watched for a short grace, since it closes its sockets just before it
//!   is reported gone) and by a sweep every [`SWEEP_EVERY`] for processes
//!   that vanished without closing (e.g. a descriptor inherited by a child);
//! - untracked leases end only when finished.
//!
//! The sweep also ends retrieve leases that exposed nothing and were begun
//! more than twice `retrieve_timeout` ago (their holder, alive, stopped
//! polling them: a worker gives up at `retrieve_timeout`), releasing their
//! readers (`retrieves_expired`); exposed leases are left to their holder.
//!
//! The same sweep aborts pending generations older than `abandoned_after`
//! (a begin whose writers never came, or left), so an abandoned generation
//! does not wait for a later `begin` to notice it.
//!
//! Counted in status: `reclaimed_store_leases`, `reclaimed_retrieve_leases`,
//! `abandoned_generations`.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::Inner;
use super::counters::Counter;
use super::retrieve::{expire_unpolled, release_readers};
use super::store::{abort, abort_stale, discard_written};
use crate::error::Result;
use crate::peer::{Peer, PeerKey};

/// How often the sweep looks for holders that are gone.
pub const SWEEP_EVERY: Duration = Duration::from_millis(200);

/// Who holds a lease: a process whose leases are reclaimed once it is gone,
/// or nobody the service can watch.
#[derive(Debug, Clone)]
pub enum Holder {
    /// Nobody the service can watch (in-process callers, a peer whose
    /// process is not visible): the leases end only when finished.
    Untracked,
    /// A local process: its leases are reclaimed once it is gone.
    Process(Arc<Peer>),
}

impl Holder {
    /// The process's key, when it is one.
    pub fn key(&self) -> Option<PeerKey> {
        match self {
            Holder::Untracked => None,
            Holder::Process(p) => Some(p.key()),
        }
    }
}

/// What one reclaim took back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reclaimed {
    /// Store leases aborted.
    pub store_leases: u64,
    /// Retrieve leases released.
    pub retrieve_leases: u64,
}

/// Whether the process `key` holds any lease.
pub(super) fn holds_leases(inner: &Arc<Inner>, key: PeerKey) -> bool {
    let st = inner.lock();
    st.store_leases
        .values()
        .any(|l| l.holder.key() == Some(key))
        || st
            .retrieve_leases
            .values()
            .any(|l| l.holder.key() == Some(key))
}

/// A closed connection's process: if it is gone (or goes within `grace`),
/// its leases are reclaimed now; a live process keeps them.
pub(super) fn peer_disconnected(inner: &Arc<Inner>, peer: &Peer, grace: Duration) -> Reclaimed {
    if !holds_leases(inner, peer.key()) {
        return Reclaimed::default();
    }
    if !peer.exited_within(grace) {
        return Reclaimed::default();
    }
    reclaim_process(inner, peer.key())
}

/// Takes back every lease of the process `key` (which is gone): store
/// leases abort (their generations with them), retrieve leases release.
pub(super) fn reclaim_process(inner: &Arc<Inner>, key: PeerKey) -> Reclaimed {
    let mut reclaimed = Reclaimed::default();
    let generations = {
        let mut st = inner.lock();
        let stores: Vec<u64> = st
            .store_leases
            .iter()
            .filter(|(_, l)| l.holder.key() == Some(key))
            .map(|(n, _)| *n)
            .collect();
        let mut generations = Vec::new();
        for n in stores {
            if let Some(lease) = st.store_leases.remove(&n) {
                st.store_ranks
                    .remove(&(lease.generation.clone(), lease.rank));
                discard_written(&mut st, &lease);
                generations.push(lease.generation);
                reclaimed.store_leases += 1;
            }
        }
        let retrieves: Vec<u64> = st
            .retrieve_leases
            .iter()
            .filter(|(_, l)| l.holder.key() == Some(key))
            .map(|(n, _)| *n)
            .collect();
        for n in retrieves {
            if let Some(lease) = st.retrieve_leases.remove(&n) {
                release_readers(&mut st, &lease);
                reclaimed.retrieve_leases += 1;
            }
        }
        st.count(Counter::ReclaimedStoreLeases, reclaimed.store_leases);
        st.count(Counter::ReclaimedRetrieveLeases, reclaimed.retrieve_leases);
        generations
    };
    for generation in &generations {
        if let Err(e) = abort(inner, generation) {
            log::warn!("aborting {generation} of a dead worker ({key}) failed: {e}");
        }
    }
    if reclaimed != Reclaimed::default() {
        log::warn!(
            "worker process {key} is gone: reclaimed {} store lease(s) (their generations \
             aborted) and {} retrieve lease(s)",
            reclaimed.store_leases,
            reclaimed.retrieve_leases
        );
    }
    reclaimed
}

/// One sweep: reclaims the leases of every holder that is gone. Liveness is
/// checked without the state lock.
pub(super) fn sweep(inner: &Arc<Inner>) -> Reclaimed {
    let holders: HashMap<PeerKey, Arc<Peer>> = {
        let st = inner.lock();
        st.store_leases
            .values()
            .map(|l| &l.holder)
            .chain(st.retrieve_leases.values().map(|l| &l.holder))
            .filter_map(|h| match h {
                Holder::Process(p) => Some((p.key(), p.clone())),
                Holder::Untracked => None,
            })
            .collect()
    };
    let mut total = Reclaimed::default();
    for (key, peer) in holders {
        if !peer.is_alive() {
            let r = reclaim_process(inner, key);
            total.store_leases += r.store_leases;
            total.retrieve_leases += r.retrieve_leases;
        }
    }
    total
}

/// The background sweeper of one service (see the [module docs](self)).
pub(super) struct Reaper {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Reaper {
    /// Starts sweeping `inner` every [`SWEEP_EVERY`] (and aborting abandoned
    /// generations at a pace set by `abandoned_after`). It holds the service
    /// only weakly and only during a sweep.
    pub(super) fn start(inner: &Arc<Inner>) -> Result<Reaper> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let weak: Weak<Inner> = Arc::downgrade(inner);
        let signal = stop.clone();
        let abandoned_every = inner
            .config
            .abandoned_after
            .map(|age| (age / 4).clamp(Duration::from_millis(50), Duration::from_secs(5)));
        let thread = std::thread::Builder::new()
            .name("lmcache-rc-reclaim".into())
            .spawn(move || {
                let mut next_abandoned = abandoned_every.map(|every| Instant::now() + every);
                loop {
                    {
                        let (lock, cv) = &*signal;
                        let mut stopped = lock.lock();
                        if !*stopped {
                            cv.wait_for(&mut stopped, SWEEP_EVERY);
                        }
                        if *stopped {
                            return;
                        }
                    }
                    let Some(inner) = weak.upgrade() else { return };
                    sweep(&inner);
                    let unpolled = inner.config.retrieve_timeout.saturating_mul(2);
                    expire_unpolled(&inner, unpolled);
                    if let (Some(at), Some(every)) = (next_abandoned, abandoned_every)
                        && Instant::now() >= at
                        && inner.lock().accepting
                    {
                        abort_stale(&inner);
                        next_abandoned = Some(Instant::now() + every);
                    }
                }
            })
            .map_err(|e| crate::Error::io("start the lease reclaim thread", e))?;
        Ok(Reaper {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops the sweeper and waits for it (a sweep in progress finishes).
    pub(super) fn stop(&mut self) {
        {
            let (lock, cv) = &*self.stop;
            *lock.lock() = true;
            cv.notify_all();
        }
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            log::error!("the lease reclaim thread panicked");
        }
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        self.stop();
    }
}
