//! Other local processes, as the sidecar sees its clients: who is on the
//! other end of a connection, and whether that process still exists.
//!
//! A [`Peer`] is taken from a connected Unix socket (`SO_PEERCRED`: the pid
//! of the process that connected) and pinned to that very process so that a
//! reused pid never passes for it:
//!
//! - a **pidfd** (`pidfd_open`, Linux 5.3+) refers to the process itself,
//!   never to a later one with the same pid; it becomes readable when the
//!   process exits (also while it is an unreaped zombie);
//! - the process **start time** (field 22 of `/proc/<pid>/stat`, in clock
//!   ticks since boot) tells two processes with the same pid apart; it is the
//!   fallback when pidfds are unavailable (old kernel, seccomp) and, with the
//!   pid, the [`PeerKey`] under which the service groups a process's leases
//!   across its connections.
//!
//! The pid is read when the connection is accepted, while the client waits
//! for the handshake, so it is the live client's pid (reusing it would need
//! the client to exit and the pid space to wrap in between).
//!
//! A peer whose pid is not visible (SO_PEERCRED reports 0 for a client in
//! another pid namespace that this one does not contain) gives no `Peer`:
//! its leases are untracked and end only when finished (or at a restart).
//!
//! This module never signals or otherwise touches the processes it watches.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, pidfd_open};

/// What identifies a process across its connections: its pid and start
/// time (0 when `/proc` could not be read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerKey {
    /// The process id (in the sidecar's pid namespace).
    pub pid: u32,
    /// Start time in clock ticks after boot (0 = unknown).
    pub start_time: u64,
}

impl std::fmt::Display for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {}", self.pid)
    }
}

/// A local process the sidecar watches (see the [module docs](self)).
#[derive(Debug)]
pub struct Peer {
    key: PeerKey,
    /// The process's pidfd, when the kernel gave one.
    pidfd: Option<OwnedFd>,
}

/// Whether a process with that pid and start time is running: `Some(true)`
/// running, `Some(false)` gone (no such pid, another process under it, or a
/// zombie), `None` when `/proc` cannot tell (not mounted, not readable).
fn proc_alive(key: PeerKey) -> Option<bool> {
    match read_stat(key.pid) {
        Ok(Some((state, start))) => Some(
            !matches!(state, 'Z' | 'X' | 'x') && (key.start_time == 0 || start == key.start_time),
        ),
        Ok(None) => Some(false),
        Err(()) => None,
    }
}

/// `(state, start time)` of `/proc/<pid>/stat`; `Ok(None)` when there is no
/// such process, `Err` when `/proc` cannot be read or parsed.
fn read_stat(pid: u32) -> std::result::Result<Option<(char, u64)>, ()> {
    let text = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(Errno::SRCH.raw_os_error()) => return Ok(None),
        Err(_) => return Err(()),
    };
    // `pid (comm) state ppid ...`: comm may hold spaces and parentheses, so
    // the fields start after the last ')'. State is field 3, start time 22.
    let rest = text.rsplit_once(')').map(|(_, r)| r).ok_or(())?;
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next().and_then(|s| s.chars().next()).ok_or(())?;
    let start = fields.nth(18).and_then(|s| s.parse().ok()).ok_or(())?;
    Ok(Some((state, start)))
}

/// The pid `SO_PEERCRED` reports for a connected Unix socket; None when it
/// is 0 (not visible in this pid namespace) or cannot be read. Read with
/// libc rather than rustix: rustix types the pid as non-zero, and a 0 from
/// the kernel must not be turned into one.
fn peer_pid(socket: BorrowedFd<'_>) -> Option<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a valid, writable `ucred` and `len` holds its exact
    // size, which is what SO_PEERCRED writes (at most `len` bytes); the fd
    // is borrowed, so it stays open for the call.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 || len as usize != std::mem::size_of::<libc::ucred>() {
        return None;
    }
    u32::try_from(cred.pid).ok().filter(|pid| *pid != 0)
}

impl Peer {
    /// The process at the other end of a connected Unix socket; None when
    /// its pid is not visible from here (another pid namespace) or the
    /// credentials cannot be read.
    pub fn of_socket(socket: impl AsFd) -> Option<Peer> {
        Peer::of_pid(peer_pid(socket.as_fd())?)
    }

    /// The running process `pid` (tests, and in-process holders that name a
    /// process); None when there is no such process or pid is 0.
    pub fn of_pid(pid: u32) -> Option<Peer> {
        let raw = i32::try_from(pid).ok()?;
        let pid_t = Pid::from_raw(raw)?;
        // Open the pidfd first, then read the start time: if the pid was
        // reused in between, the start time is the newer process's and the
        // pidfd says the old one is gone, so the peer reads as gone at once
        // (never as a live stranger).
        let pidfd = match pidfd_open(pid_t, PidfdFlags::empty()) {
            Ok(fd) => Some(fd),
            Err(Errno::SRCH) => return None,
            Err(_) => None, // no pidfds here: /proc start time only
        };
        let start_time = match read_stat(pid) {
            Ok(Some((_, start))) => start,
            Ok(None) => return None,
            Err(()) => 0,
        };
        let peer = Peer {
            key: PeerKey { pid, start_time },
            pidfd,
        };
        if peer.pidfd.is_none() && start_time == 0 {
            log::warn!(
                "cannot watch pid {pid} (no pidfd and no /proc): its leases are reclaimed only \
                 when it finishes them"
            );
        }
        Some(peer)
    }

    /// The process's key (pid and start time).
    pub fn key(&self) -> PeerKey {
        self.key
    }

    /// Whether the process can be watched at all (a pidfd or a start time).
    pub fn is_watchable(&self) -> bool {
        self.pidfd.is_some() || self.key.start_time != 0
    }

    /// Whether the process still runs. A process that cannot be watched
    /// (see [`Peer::is_watchable`]) always counts as running: its leases
    /// are never taken from it on a guess.
    pub fn is_alive(&self) -> bool {
        !self.exited_within(Duration::ZERO)
    }

    /// Waits up to `timeout` for the process to exit; true once it has.
    /// A process that exits while the connection closes is seen closing
    /// its sockets slightly before it is reported gone, so a disconnect
    /// waits briefly with this.
    pub fn exited_within(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match &self.pidfd {
                Some(fd) => {
                    let mut fds = [PollFd::new(fd, PollFlags::IN)];
                    let wait = Timespec {
                        tv_sec: left.as_secs().try_into().unwrap_or(i64::MAX),
                        tv_nsec: left.subsec_nanos().into(),
                    };
                    match poll(&mut fds, Some(&wait)) {
                        Ok(n) if n > 0 => return true,
                        Ok(_) => return false,
                        Err(Errno::INTR) => continue,
                        // An unpollable pidfd: fall back to /proc once.
                        Err(_) => return proc_alive(self.key) == Some(false),
                    }
                }
                None => {
                    match proc_alive(self.key) {
                        Some(false) => return true,
                        None => return false,
                        Some(true) => {}
                    }
                    if left.is_zero() {
                        return false;
                    }
                    std::thread::sleep(left.min(Duration::from_millis(10)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_a_live_watchable_peer() {
        let me = Peer::of_pid(std::process::id()).unwrap();
        assert!(me.is_watchable());
        assert!(me.is_alive());
        assert!(!me.exited_within(Duration::from_millis(20)));
        assert_eq!(me.key().pid, std::process::id());
        assert_ne!(me.key().start_time, 0, "/proc is readable in tests");
        assert!(Peer::of_pid(0).is_none());
    }

    #[test]
    fn a_reaped_child_is_gone_and_its_pid_names_no_peer() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let peer = Peer::of_pid(child.id()).unwrap();
        assert!(peer.is_alive());
        child.kill().unwrap();
        // Unreaped (a zombie) already counts as gone.
        assert!(peer.exited_within(Duration::from_secs(10)));
        child.wait().unwrap();
        assert!(!peer.is_alive());
        let stale = PeerKey {
            pid: peer.key().pid,
            start_time: peer.key().start_time,
        };
        assert_eq!(proc_alive(stale), Some(false));
    }

    #[test]
    fn a_pid_with_another_start_time_is_another_process() {
        let me = Peer::of_pid(std::process::id()).unwrap().key();
        assert_eq!(proc_alive(me), Some(true));
        let reused = PeerKey {
            start_time: me.start_time + 1,
            ..me
        };
        assert_eq!(
            proc_alive(reused),
            Some(false),
            "a reused pid is not the peer"
        );
        let nobody = PeerKey {
            pid: u32::MAX >> 1,
            start_time: 1,
        };
        assert_eq!(proc_alive(nobody), Some(false));
    }

    #[test]
    fn the_peer_of_a_socket_is_the_process_that_connected() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let peer = Peer::of_socket(&a).unwrap();
        assert_eq!(peer.key().pid, std::process::id());
        assert!(peer.is_alive());
        drop(b);
    }

    #[test]
    fn stat_lines_with_odd_command_names_parse() {
        // The parser takes the fields after the last ')'.
        let me = read_stat(std::process::id()).unwrap().unwrap();
        assert!(me.1 > 0);
    }
}
