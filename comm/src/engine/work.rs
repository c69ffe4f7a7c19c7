//! [`Work`]: the handle of an operation running in the background.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;

use super::{lock, JobSlot};
use crate::base::error::{Error, Result, WorldNames};

/// A handle on an operation running in the background; owns the operation's buffers until
/// [`Work::wait`] gives them back.
#[must_use = "an async operation's buffer comes back only through wait()"]
pub struct Work<B> {
    rx: Receiver<Result<B>>,
    deadline: Instant,
    rank: usize,
    op: &'static str,
    /// The operation's body while it may not have started, with its ticket and how many
    /// operations were ahead: `wait` runs it itself if the progress thread has not taken it yet.
    pub(super) pending: Option<(JobSlot, u64, u64)>,
    /// The communicator's world ranks, noted in the errors the handle makes itself.
    pub(super) world: Option<Arc<WorldNames>>,
}

impl<B> Work<B> {
    pub(crate) fn new(
        rx: Receiver<Result<B>>,
        deadline: Instant,
        rank: usize,
        op: &'static str,
    ) -> Work<B> {
        Work {
            rx,
            deadline,
            rank,
            op,
            pending: None,
            world: None,
        }
    }

    /// Waits for the operation and returns its buffers. The wait is bounded: every operation ahead
    /// of this one and this one have their own deadlines (`OXCCL_TIMEOUT`).
    ///
    /// A host operation the progress thread has not started yet runs on this thread instead
    /// (when its turn comes, as it would there): a small operation waited for right away then
    /// costs no thread hand-over. Its waits then follow a blocking call's: the turn's deadline
    /// counts from this call, and a time-out (or a panic) happens on this thread; a time-out
    /// waiting for the turn breaks the communicator, as it would on the progress thread.
    ///
    /// # Errors
    /// The operation's error, or `Timeout` if it did not finish in time.
    pub fn wait(mut self) -> Result<B> {
        if let Some((slot, ticket, ahead)) = self.pending.take() {
            // Not started yet: run it on this thread instead of handing it over and back (two
            // thread wake-ups, most of a small operation's time).
            let body = lock(&slot).take();
            if let Some(body) = body {
                body(ticket, ahead);
            }
        }
        let left = self.deadline.saturating_duration_since(Instant::now());
        self.recv(left)
    }

    /// Waits at most `timeout`; on time-out the handle is given back (`Err(self)`) so the caller
    /// can wait again.
    ///
    /// # Errors
    /// `Ok(Err(self))` when the operation has not finished within `timeout`.
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Result<B>, Work<B>> {
        match self.rx.recv_timeout(timeout) {
            Ok(r) => Ok(r),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Err(self),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Ok(Err(self.lost())),
        }
    }

    /// True once the operation has finished (successfully or not).
    pub fn is_done(&self) -> bool {
        !self.rx.is_empty()
    }

    fn recv(self, left: Duration) -> Result<B> {
        match self.rx.recv_timeout(left) {
            Ok(r) => r,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Err(self.named(Error::Timeout {
                rank: self.rank,
                op: self.op.to_string(),
                timeout: left,
                detail: "async operation did not complete".into(),
            })),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(self.lost()),
        }
    }

    fn lost(&self) -> Error {
        self.named(Error::Aborted {
            rank: self.rank,
            reason: format!("{}: the progress thread dropped the operation", self.op),
        })
    }

    fn named(&self, e: Error) -> Error {
        crate::base::error::named(self.world.as_deref(), e)
    }
}
