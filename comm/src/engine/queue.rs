//! The progress thread: async operations queued in ticket order, run by it (or by the thread
//! that waits for them first), and stopped when the communicator goes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use super::work::{Body, Cell};
use super::{lock, ExecState, Job, Shared, Work};
use crate::base::error::Result;

impl Shared {
    /// Takes a ticket and queues `job(ticket, ahead)` on the progress thread (see
    /// [`Shared::submit_made`]). Returns the ticket and how many operations were ahead.
    #[cfg(any(test, feature = "cuda-core"))]
    pub(crate) fn submit_ticketed<F>(self: &Arc<Self>, job: F) -> (u64, u64)
    where
        F: FnOnce(u64, u64) + Send + 'static,
    {
        self.submit_made(|ticket, ahead| move || job(ticket, ahead))
    }

    /// Takes a ticket and queues the job that `make(ticket, ahead)` makes, both under the worker
    /// lock, so queued jobs sit in ticket order even when several threads queue at once (a job
    /// queued behind a later ticket would wait for a turn that cannot come). Returns the ticket
    /// and how many operations were ahead.
    pub(crate) fn submit_made<M, J>(self: &Arc<Self>, make: M) -> (u64, u64)
    where
        M: FnOnce(u64, u64) -> J,
        J: FnOnce() + Send + 'static,
    {
        let mut w = lock(&self.worker);
        let (ticket, ahead) = self.take_ticket();
        let job: Job = Box::new(make(ticket, ahead));
        if w.is_none() {
            let (tx, rx): (Sender<Job>, Receiver<Job>) = crossbeam_channel::unbounded();
            let name = format!("oxccl-progress-r{}", self.rank);
            match std::thread::Builder::new().name(name).spawn(move || {
                for job in rx {
                    job();
                }
            }) {
                Ok(h) => *w = Some((tx, h)),
                Err(e) => {
                    tracing::error!(
                        rank = self.rank,
                        "could not start the progress thread: {e}; running inline"
                    );
                    drop(w);
                    job();
                    return (ticket, ahead);
                }
            }
        }
        if let Some((tx, _)) = w.as_ref() {
            if let Err(e) = tx.send(job) {
                (e.into_inner())();
            }
        }
        (ticket, ahead)
    }

    /// Queues `run` on the progress thread as the next operation: it gets the execution state
    /// and `buf` when its turn comes, and the returned [`Work`] (named `op`) gives back what
    /// `finish` makes of `buf`.
    pub(crate) fn submit_work<B, R, F>(
        self: &Arc<Self>,
        op: &'static str,
        buf: B,
        run: F,
        finish: fn(B) -> R,
    ) -> Work<R>
    where
        B: Send + 'static,
        R: Send + 'static,
        F: FnOnce(&Shared, &mut ExecState, &mut B) -> Result<()> + Send + 'static,
    {
        let shared = Arc::clone(self);
        let body: Body<R> = Box::new(move |ticket: u64, ahead: u64| {
            let mut buf = buf;
            shared
                .run_turn(ticket, ahead, |st| run(&shared, st, &mut buf))
                .map(|()| finish(buf))
        });
        // Whoever takes the body first runs it: the progress thread when its turn comes, or the
        // thread that waits on the operation before the progress thread got to it.
        let rank = self.rank;
        let mut cell = None;
        let (_, ahead) = self.submit_made(|ticket, ahead| {
            let c = Arc::new(Cell::queued(body, ticket, ahead));
            cell = Some(Arc::clone(&c));
            move || c.run_queued(op, rank)
        });
        let cell = cell.expect("submit_ticketed makes the job before it returns");
        let mut work = Work::new(cell, self.work_budget(ahead), self.rank, op);
        work.world.clone_from(&self.world);
        work.spin = self.spin;
        work
    }

    /// How long a wait on an async operation queued with `ahead` operations before it may
    /// block: each of them and this one have their own time-out (and may read a stall report).
    pub(crate) fn work_budget(&self, ahead: u64) -> Duration {
        // Slack: a second, and the stall report a timed-out operation reads.
        self.timeout
            .saturating_mul(u32::try_from(ahead + 2).unwrap_or(u32::MAX))
            .saturating_add(Duration::from_secs(1))
            .saturating_add(crate::base::stall::READ_BUDGET_MAX)
    }

    /// Lets queued jobs finish and stops the progress thread, then waits (bounded) until every
    /// operation issued so far has had its turn: one that a waiting thread took over from the
    /// progress thread (see [`Work::wait`]) may still be running there.
    pub(crate) fn stop_worker(&self) {
        let w = lock(&self.worker).take();
        if let Some((tx, h)) = w {
            drop(tx);
            let _ = h.join();
        }
        let mut t = lock(&self.turn);
        let outstanding = u32::try_from(t.next_ticket - t.serving).unwrap_or(u32::MAX);
        // Each of them may take its own time-out (as `run_turn` allows), and a second of slack.
        let budget = self
            .timeout
            .saturating_mul(outstanding.saturating_add(1))
            .saturating_add(Duration::from_secs(1));
        let deadline = Instant::now().checked_add(budget);
        while t.serving < t.next_ticket {
            let left = deadline.map_or(budget, |d| d.saturating_duration_since(Instant::now()));
            if left.is_zero() {
                break;
            }
            t = self.wait_for_turns(t, left);
        }
    }
}
