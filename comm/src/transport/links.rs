//! The connections of one communicator: a send and a receive half per peer, the doorbell this
//! rank sleeps on, and the direct window when every rank shares memory.

use std::os::fd::RawFd;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;

use crate::base::error::Result;
use crate::transport::{Doorbell, PollDir, RecvConn, SendConn, Window};

/// The connections of one communicator, indexed by peer rank.
#[derive(Default)]
pub(crate) struct Links {
    pub send: Vec<Option<Box<dyn SendConn>>>,
    pub recv: Vec<Option<Box<dyn RecvConn>>>,
    /// This rank's doorbell, which shared-memory peers ring; `None` without such peers.
    pub bell: Option<Arc<dyn Doorbell>>,
    /// The direct window, when every rank of the communicator shares memory with this one.
    pub window: Option<Box<dyn Window>>,
    /// Scratch memory of the direct algorithms (kept between operations).
    pub scratch: Vec<u8>,
    /// Bytes sent straight from registered buffers ([`crate::Registered`]) so far, by every
    /// connection that can (RDMA); the communicator's [`crate::Stats::registered_bytes`].
    pub direct_bytes: Arc<AtomicU64>,
    /// Bytes peers wrote straight into this rank's registered buffers so far (RDMA's
    /// rendezvous, the mapped algorithms); the communicator's [`crate::Stats::registered_recv_bytes`].
    pub landed_bytes: Arc<AtomicU64>,
    /// This rank is counted as a sleeper on `bell` (see [`Links::announce`]).
    announced: bool,
}

impl Links {
    /// No connection yet to any of `size` ranks.
    pub(crate) fn new(size: usize) -> Links {
        let mut links = Links::default();
        links.send.resize_with(size, || None);
        links.recv.resize_with(size, || None);
        links
    }

    /// Progresses every connection; returns whether anything moved.
    pub(crate) fn progress_all(&mut self) -> Result<bool> {
        let mut moved = false;
        for c in self.send.iter_mut().flatten() {
            moved |= c.progress()?;
        }
        for c in self.recv.iter_mut().flatten() {
            moved |= c.progress()?;
        }
        Ok(moved)
    }

    /// Counts this rank as a sleeper on its doorbell, so posts ring it from now on; whether it
    /// was not counted already (then check once more, with the counter read after this, before
    /// sleeping). False without a doorbell.
    pub(crate) fn announce(&mut self) -> bool {
        match &self.bell {
            Some(b) if !self.announced => {
                b.announce(true);
                self.announced = true;
                true
            }
            _ => false,
        }
    }

    /// Stops counting this rank as a sleeper (it made progress: posts need not ring again).
    pub(crate) fn quiet(&mut self) {
        if self.announced {
            self.announced = false;
            if let Some(b) = &self.bell {
                b.announce(false);
            }
        }
    }

    pub(crate) fn all_flushed(&self) -> bool {
        self.send.iter().flatten().all(|c| c.flushed())
    }

    pub(crate) fn poll_fds(&self, out: &mut Vec<(RawFd, PollDir)>) {
        out.clear();
        for c in self.send.iter().flatten() {
            c.poll_fds(out);
        }
        for c in self.recv.iter().flatten() {
            c.poll_fds(out);
        }
    }

    /// Says goodbye on every send half and drops everything.
    pub fn close(&mut self, deadline: Instant) {
        for c in self.send.iter_mut().flatten() {
            c.close(deadline);
        }
        for c in self.recv.iter_mut().flatten() {
            c.close();
        }
        if let Some(w) = self.window.as_mut() {
            w.close();
        }
        self.quiet();
        self.send.clear();
        self.recv.clear();
        self.bell = None;
        self.window = None;
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        self.quiet();
    }
}
