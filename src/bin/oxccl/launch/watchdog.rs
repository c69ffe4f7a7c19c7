//! A forked guard process that SIGKILLs the ranks' process groups if the launcher dies.
//!
//! `PR_SET_PDEATHSIG` only reaches a rank's own process, not what it started (a shell's
//! children, data-loader workers). The watchdog closes that gap: it is forked by the launcher,
//! sits in its own process group, and reads process-group ids over a socket. When the socket
//! reports end-of-file without a "disarm" message first, the launcher is gone (however it died)
//! and the watchdog kills every group it was told about.
//!
//! Protocol: native-endian `i32` records; `g > 0` watches group `g`, `g < 0` forgets group `-g`,
//! `0` disarms (the watchdog exits without killing anything).

use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::thread;
use std::time::{Duration, Instant};

/// Groups one watchdog can track: every rank of the largest job a launcher accepts
/// ([`super::MAX_NPROC_PER_NODE`]); further groups would be covered by `PR_SET_PDEATHSIG` only.
const MAX_WATCHED: usize = super::MAX_NPROC_PER_NODE;

/// How long a disarmed watchdog gets to exit before it is SIGKILLed.
const EXIT_WAIT: Duration = Duration::from_secs(2);
/// How long a SIGKILLed watchdog gets to disappear before the launcher gives up reaping it.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// How often the watchdog's exit is polled.
const POLL: Duration = Duration::from_millis(2);

/// Handle held by the launcher; dropping it disarms the watchdog and reaps it.
pub(super) struct Watchdog {
    pid: libc::pid_t,
    tx: Option<UnixStream>,
}

impl Watchdog {
    /// Forks the watchdog process.
    pub(super) fn start() -> io::Result<Self> {
        let (tx, rx) = UnixStream::pair()?;
        let (rx_fd, tx_fd) = (rx.as_raw_fd(), tx.as_raw_fd());
        // SAFETY: fork() has no memory-safety preconditions for the parent. The child runs only
        // `watchdog_main`, which makes nothing but async-signal-safe system calls on stack data
        // (no allocation, no locks, no panics) and never returns, as required after forking a
        // multi-threaded process.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            watchdog_main(rx_fd, tx_fd);
        }
        drop(rx);
        tracing::debug!(pid, "oxccl launch: watchdog started");
        Ok(Watchdog { pid, tx: Some(tx) })
    }

    /// Kill group `pgid` if the launcher dies.
    pub(super) fn watch(&mut self, pgid: u32) {
        if let Ok(g) = i32::try_from(pgid) {
            self.send(g);
        }
    }

    /// Group `pgid` is gone; stop watching it (its id may be reused).
    pub(super) fn forget(&mut self, pgid: u32) {
        if let Ok(g) = i32::try_from(pgid) {
            self.send(-g);
        }
    }

    fn send(&mut self, v: i32) {
        if let Some(tx) = &mut self.tx {
            if let Err(e) = tx.write_all(&v.to_ne_bytes()) {
                tracing::warn!("oxccl launch: watchdog unreachable: {e}");
                self.tx = None;
            }
        }
    }
}

impl Watchdog {
    /// Polls (never blocks) until the watchdog was reaped or `wait` is over; true once reaped
    /// (or when it is no longer our child to reap).
    fn reap_within(&self, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        loop {
            let mut status = 0;
            // SAFETY: waitpid on our own child with a valid out-pointer.
            let r = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
            if r == self.pid {
                return true;
            }
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::debug!("oxccl launch: waitpid on the watchdog: {e}");
                    return true;
                }
            }
            if Instant::now() >= deadline {
                return false;
            }
            thread::sleep(POLL);
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.send(0);
        self.tx = None;
        if self.reap_within(EXIT_WAIT) {
            return;
        }
        tracing::warn!(
            pid = self.pid,
            "oxccl launch: the watchdog did not exit when disarmed; killing it"
        );
        // SAFETY: kill(2) on our own child, which has not been reaped (so its pid is not reused).
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        if !self.reap_within(KILL_WAIT) {
            tracing::warn!(
                pid = self.pid,
                "oxccl launch: the watchdog did not die after SIGKILL; leaving it"
            );
        }
    }
}

fn errno() -> i32 {
    // `last_os_error` only reads errno: no allocation, safe after fork.
    io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Body of the forked watchdog. Only async-signal-safe calls from here on.
fn watchdog_main(rx: libc::c_int, tx: libc::c_int) -> ! {
    // SAFETY: closing our inherited copy of the launcher's end, so that end-of-file shows up
    // when the launcher's copy is closed.
    unsafe { libc::close(tx) };
    // SAFETY: setpgid(0, 0) moves this process into a new group of its own, so a terminal's
    // ^C (sent to the launcher's group) does not kill the watchdog.
    unsafe { libc::setpgid(0, 0) };
    // SAFETY: dup2 of a descriptor we own onto fd 0.
    let fd = if unsafe { libc::dup2(rx, 0) } == 0 {
        0
    } else {
        rx
    };
    close_other_fds(fd);

    let mut groups = [0 as libc::pid_t; MAX_WATCHED];
    let mut n = 0usize;
    let mut buf = [0u8; 4];
    let mut have = 0usize;
    let disarmed = loop {
        let Some(rest) = buf.get_mut(have..) else {
            break false;
        };
        // SAFETY: reading into the unfilled tail of a stack buffer of the given length.
        let r = unsafe { libc::read(fd, rest.as_mut_ptr().cast(), rest.len()) };
        if r < 0 {
            if errno() == libc::EINTR {
                continue;
            }
            break false;
        }
        if r == 0 {
            break false; // the launcher is gone
        }
        have += r as usize;
        if have < buf.len() {
            continue;
        }
        have = 0;
        let v = i32::from_ne_bytes(buf);
        if v == 0 {
            break true;
        } else if v > 0 {
            if let Some(slot) = groups.get_mut(n) {
                *slot = v;
                n += 1;
            }
        } else {
            let g = v.wrapping_neg();
            let mut i = 0;
            while i < n {
                if groups.get(i) == Some(&g) {
                    n -= 1;
                    let last = groups.get(n).copied().unwrap_or(0);
                    if let Some(slot) = groups.get_mut(i) {
                        *slot = last;
                    }
                } else {
                    i += 1;
                }
            }
        }
    };
    if !disarmed {
        for &g in groups.iter().take(n) {
            // SAFETY: kill(2) on a process group id; no memory is involved.
            unsafe { libc::kill(g.wrapping_neg(), libc::SIGKILL) };
        }
    }
    // SAFETY: _exit terminates the forked child without running the parent's atexit handlers
    // or destructors.
    unsafe { libc::_exit(0) }
}

/// Closes every descriptor except `keep`, so the watchdog holds no pipe of anyone else open.
fn close_other_fds(keep: libc::c_int) {
    #[cfg(target_os = "linux")]
    {
        if keep == 0 {
            // SAFETY: close_range(2) takes plain integers; it closes fds 1.. in this process.
            let r = unsafe { libc::syscall(libc::SYS_close_range, 1u32, u32::MAX, 0u32) };
            if r == 0 {
                return;
            }
        }
    }
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the provided struct.
    let max = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        lim.rlim_cur.min(65_536) as libc::c_int
    } else {
        1024
    };
    for fd in 0..max {
        if fd != keep {
            // SAFETY: closing descriptors of this (forked) process; EBADF is harmless.
            unsafe { libc::close(fd) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    /// A watchdog that cannot exit (stopped) must not block the launcher forever: dropping the
    /// handle kills and reaps it.
    #[test]
    fn a_stuck_watchdog_is_killed_and_reaped() {
        let w = Watchdog::start().expect("start the watchdog");
        let pid = w.pid;
        // SAFETY: kill(2) on the child just forked, not yet reaped.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            drop(w);
            let _ = tx.send(());
        });
        let dropped = rx.recv_timeout(Duration::from_secs(30));
        if dropped.is_err() {
            // SAFETY: as above; the handle's thread is stuck in waitpid on it.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        assert!(dropped.is_ok(), "dropping the watchdog handle blocked");
        let mut status = 0;
        // SAFETY: waitpid with a valid out-pointer; the pid must no longer be our child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        assert_eq!(r, -1, "the watchdog was not reaped");
    }
}
