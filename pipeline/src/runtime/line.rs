//! The exchanges of a step, in posting order: run by the step's exchange thread, or by the
//! rank's own thread when it needs a result that has not come and the exchange thread is not
//! running one. An exchange the rank waits for at once then costs no hand-over to another
//! thread and back (two wake-ups, most of a small exchange's time where ranks fill the cores);
//! one posted ahead still overlaps with the computations before its result is needed.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, TryLockError};
use std::time::{Duration, Instant};

use super::wire::{Done, Job, Wire};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Exchanges posted and not yet run, results not yet taken.
#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    results: VecDeque<Done>,
    /// The step is over: the exchange thread stops.
    closed: bool,
    /// An exchange failed: nothing more runs (its error is the last result).
    failed: bool,
}

/// A step's line of exchanges (see the module documentation).
pub(super) struct Line<'w> {
    /// Held while an exchange runs: whoever holds it pops the next job, so exchanges run one
    /// at a time, in order, whichever thread runs them.
    wire: Mutex<Wire<'w>>,
    queue: Mutex<Queue>,
    /// A job was posted, or the line closed.
    posted: Condvar,
    /// A result came.
    finished: Condvar,
}

impl<'w> Line<'w> {
    pub(super) fn new(wire: Wire<'w>) -> Line<'w> {
        Line {
            wire: Mutex::new(wire),
            queue: Mutex::new(Queue::default()),
            posted: Condvar::new(),
            finished: Condvar::new(),
        }
    }

    /// Queues `job`; `false` (and the job dropped) after an exchange failed.
    pub(super) fn post(&self, job: Job) -> bool {
        let mut q = lock(&self.queue);
        if q.failed {
            return false;
        }
        q.jobs.push_back(job);
        drop(q);
        self.posted.notify_one();
        true
    }

    /// Ends the step: the exchange thread returns (jobs still queued are dropped).
    pub(super) fn close(&self) {
        lock(&self.queue).closed = true;
        self.posted.notify_all();
    }

    /// The exchange thread: runs jobs as they are posted until the line closes or one fails.
    pub(super) fn serve(&self) {
        loop {
            {
                let mut q = lock(&self.queue);
                while q.jobs.is_empty() && !q.closed && !q.failed {
                    q = self.posted.wait(q).unwrap_or_else(|p| p.into_inner());
                }
                if q.closed || q.failed {
                    return;
                }
            }
            let mut w = lock(&self.wire);
            self.run_next(&mut w);
        }
    }

    /// Runs the first queued job on `wire` (held by the caller) and keeps its result; whether
    /// there was one.
    fn run_next(&self, wire: &mut Wire<'w>) -> bool {
        let job = {
            let mut q = lock(&self.queue);
            if q.failed {
                return false;
            }
            q.jobs.pop_front()
        };
        let Some(job) = job else {
            return false;
        };
        let r = wire.run(job);
        let mut q = lock(&self.queue);
        if r.is_err() {
            q.failed = true;
            q.jobs.clear();
        }
        q.results.push_back(r);
        drop(q);
        self.finished.notify_all();
        true
    }

    /// The next result, in posting order: the queued exchanges run here while the exchange
    /// thread is not running one. `None` when none came within `limit`.
    pub(super) fn next(&self, limit: Duration) -> Option<Done> {
        let end = Instant::now() + limit;
        loop {
            if let Some(r) = lock(&self.queue).results.pop_front() {
                return Some(r);
            }
            let free = match self.wire.try_lock() {
                Ok(w) => Some(w),
                Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(TryLockError::WouldBlock) => None,
            };
            if let Some(mut w) = free {
                if self.run_next(&mut w) {
                    continue;
                }
            }
            // The exchange thread is running one (or nothing is left): its result wakes us.
            let q = lock(&self.queue);
            if !q.results.is_empty() {
                continue;
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            drop(
                self.finished
                    .wait_timeout(q, left.min(Duration::from_millis(50)))
                    .unwrap_or_else(|p| p.into_inner()),
            );
        }
    }
}
