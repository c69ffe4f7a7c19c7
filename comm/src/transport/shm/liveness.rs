//! Watching a peer process through its pidfd, and the `PeerLost` error of a shm connection.

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::base::error::{Error, Result};
use crate::base::sys;

/// How often a waiting connection checks that its peer process is alive.
const LIVENESS_EVERY: Duration = Duration::from_millis(5);

/// Watches a peer process: readable pidfd = the process is gone.
pub(super) struct Liveness {
    pidfd: Option<OwnedFd>,
    last: Instant,
}

impl Liveness {
    pub(super) fn new(pid: u32) -> Liveness {
        // Ranks that are threads of this process share its pid: nothing to watch.
        let pidfd = if pid == std::process::id() {
            None
        } else {
            sys::pidfd_open(pid)
        };
        Liveness {
            pidfd,
            last: Instant::now(),
        }
    }

    /// `PeerLost` once the peer process has exited (checked at most every `LIVENESS_EVERY`).
    pub(super) fn check(&mut self, rank: usize, peer: usize) -> Result<()> {
        if self.dead() {
            return Err(lost(rank, peer, "process exited (seen through its pidfd)"));
        }
        Ok(())
    }

    pub(super) fn dead(&mut self) -> bool {
        let Some(fd) = &self.pidfd else { return false };
        if self.last.elapsed() < LIVENESS_EVERY {
            return false;
        }
        self.last = Instant::now();
        sys::readable(fd.as_raw_fd())
    }
}

pub(super) fn lost(rank: usize, peer: usize, detail: &str) -> Error {
    Error::PeerLost {
        rank,
        peer,
        op: "shm transfer".into(),
        detail: detail.into(),
    }
}
