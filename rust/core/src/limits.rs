//! Process resource floors of a sidecar: the open-file limit and the file
//! descriptors kept in reserve for the tiers.
//!
//! A sidecar serves every connection with file descriptors (the socket and
//! its clones) and writes L2 objects and the SQLite directory with more. If
//! connections could take every descriptor, a durable write would fail with
//! `EMFILE` and a published generation would never reach disk. So at start
//! the soft `RLIMIT_NOFILE` is raised to the hard limit, and the RPC server
//! admits only as many connections as fit beside [`FD_RESERVE`] descriptors
//! kept for L2 I/O, SQLite, the HTTP admin and the process itself.

/// Descriptors never handed to RPC connections: L2 I/O threads (a temp
/// file, a directory fsync and a header read each), the SQLite directory
/// (database, WAL, shared memory), the HTTP admin's connections, logging,
/// and room for what the process opens later.
pub const FD_RESERVE: u64 = 256;

/// The open-file limit after [`raise_nofile_limit`]: soft and hard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NofileLimit {
    /// The soft limit now in force (None: unlimited).
    pub soft: Option<u64>,
    /// The hard limit (None: unlimited).
    pub hard: Option<u64>,
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (Linux caps it at
/// `fs.nr_open` and refuses "unlimited"; then the old soft limit stays).
/// Returns the limits now in force; never fails (a refusal is logged).
pub fn raise_nofile_limit() -> NofileLimit {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let before = getrlimit(Resource::Nofile);
    if before.current != before.maximum {
        let mut raised = before;
        raised.current = before.maximum;
        if let Err(e) = setrlimit(Resource::Nofile, raised) {
            // "unlimited" or above fs.nr_open: try the kernel's ceiling.
            let nr_open = std::fs::read_to_string("/proc/sys/fs/nr_open")
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok());
            let capped = nr_open.map(|n| {
                let mut l = before;
                l.current = Some(before.maximum.map_or(n, |m| m.min(n)));
                l
            });
            match capped.map(|l| setrlimit(Resource::Nofile, l)) {
                Some(Ok(())) => {}
                _ => log::warn!(
                    "could not raise the open-file limit from {:?} to {:?}: {e}",
                    before.current,
                    before.maximum
                ),
            }
        }
    }
    let now = getrlimit(Resource::Nofile);
    if now.current != before.current {
        log::info!(
            "open-file limit raised from {} to {}",
            describe(before.current),
            describe(now.current)
        );
    }
    NofileLimit {
        soft: now.current,
        hard: now.maximum,
    }
}

fn describe(limit: Option<u64>) -> String {
    limit.map_or_else(|| "unlimited".to_string(), |n| n.to_string())
}

/// Descriptors this process has open now (Linux: entries of
/// `/proc/self/fd`; elsewhere a conservative guess).
pub fn open_fds() -> u64 {
    match std::fs::read_dir("/proc/self/fd") {
        Ok(entries) => entries.count() as u64,
        Err(_) => 64,
    }
}

/// How many connections of `fds_each` descriptors fit under the soft limit
/// beside the descriptors open now and [`FD_RESERVE`]; None = no bound
/// from the limit. At least 1.
pub fn connections_that_fit(limit: NofileLimit, fds_each: u64) -> Option<u64> {
    let soft = limit.soft?;
    let free = soft.saturating_sub(open_fds()).saturating_sub(FD_RESERVE);
    Some((free / fds_each.max(1)).max(1))
}
