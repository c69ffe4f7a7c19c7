//! [`Work`]: the handle of an operation running in the background, and the cell it shares with
//! whoever runs it (the progress thread, or the thread that waits first).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::queue::HostJob;
use super::{lock, Shared};
use crate::base::error::{Error, Result, WorldNames};

/// How long a waiter polls for an operation the progress thread runs before it sleeps (small
/// operations end within microseconds; a sleep and its wake-up cost more than that).
const SPIN: Duration = Duration::from_micros(20);

/// A wait that finds its operation started by the progress thread less than this long ago
/// counts as early (see [`super::queue::WorkQueue::note_wait`]): handing it over bought no
/// overlap worth a wake-up.
const JUST_STARTED: Duration = Duration::from_micros(50);

/// Nanoseconds since the first call (0 is never returned: it means "not started").
fn now_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(epoch.elapsed().as_nanos())
        .unwrap_or(u64::MAX)
        .max(1)
}

/// The body of an async operation, given the engine, its ticket and how many operations were
/// ahead.
pub(super) type Body<B> = Box<dyn FnOnce(&Shared, u64, u64) -> Result<B> + Send>;

enum State<B> {
    /// Not started: the progress thread or a waiter takes the body.
    Queued(Body<B>),
    /// The progress thread runs it.
    Running,
    /// Finished; the result waits for [`Work::wait`].
    Done(Result<B>),
    /// The result was handed out.
    Taken,
}

/// What an async operation's [`Work`] shares with the progress thread.
pub(super) struct Cell<B> {
    state: Mutex<State<B>>,
    /// Set (after the result is stored) once the operation finished: polled without the lock.
    finished: AtomicBool,
    /// A waiter sleeps on it (counted in `sleepers`, so a finish notifies only then).
    done: Condvar,
    sleepers: Mutex<usize>,
    /// Set once the body left the cell: the line drops the operation's entry unseen.
    taken: AtomicBool,
    /// When the progress thread took the body ([`now_ns`]; 0 before).
    started: AtomicU64,
    ticket: u64,
    ahead: u64,
    /// The operation's name and rank, for the error left when it panics.
    op: &'static str,
    rank: usize,
    /// The engine that runs it (none for an operation that failed before it was queued).
    shared: Option<Arc<Shared>>,
}

impl<B: Send> HostJob for Cell<B> {
    /// The progress thread's turn at the operation (or a thread's that needs it done): runs it
    /// unless a waiter took it first, and stores the result (an error naming the loss if the
    /// operation panics). Whether it ran.
    fn run_queued(&self) -> bool {
        let (Some(shared), Some(body)) = (self.shared.as_deref(), self.take_body(true)) else {
            return false;
        };
        self.started.store(now_ns(), Ordering::Release);
        let mut guard = Finish {
            cell: self,
            result: Some(Err(lost(self.rank, self.op))),
        };
        guard.result = Some(body(shared, self.ticket, self.ahead));
        true
    }

    fn is_taken(&self) -> bool {
        self.taken.load(Ordering::Acquire)
    }
}

impl<B> Cell<B> {
    pub(super) fn queued(
        body: Body<B>,
        shared: Arc<Shared>,
        (ticket, ahead): (u64, u64),
        op: &'static str,
    ) -> Cell<B> {
        let rank = shared.rank;
        let mut cell = Cell::with(State::Queued(body), (ticket, ahead), op, rank);
        cell.shared = Some(shared);
        cell
    }

    fn with(
        state: State<B>,
        (ticket, ahead): (u64, u64),
        op: &'static str,
        rank: usize,
    ) -> Cell<B> {
        let finished = matches!(state, State::Done(_));
        Cell {
            state: Mutex::new(state),
            finished: AtomicBool::new(finished),
            done: Condvar::new(),
            sleepers: Mutex::new(0),
            taken: AtomicBool::new(false),
            started: AtomicU64::new(0),
            ticket,
            ahead,
            op,
            rank,
            shared: None,
        }
    }

    /// Takes the body if nobody has (`running`: the taker is the progress thread, which stores
    /// the result; else the caller keeps it).
    fn take_body(&self, running: bool) -> Option<Body<B>> {
        let mut s = lock(&self.state);
        if !matches!(*s, State::Queued(_)) {
            return None;
        }
        let next = if running {
            State::Running
        } else {
            State::Taken
        };
        self.taken.store(true, Ordering::Release);
        match std::mem::replace(&mut *s, next) {
            State::Queued(body) => Some(body),
            _ => None,
        }
    }

    fn finish(&self, r: Result<B>) {
        *lock(&self.state) = State::Done(r);
        self.finished.store(true, Ordering::Release);
        if *lock(&self.sleepers) > 0 {
            self.done.notify_all();
        }
    }

    /// The result, if the operation finished and nobody took it yet.
    fn take_result(&self) -> Option<Result<B>> {
        let mut s = lock(&self.state);
        match std::mem::replace(&mut *s, State::Taken) {
            State::Done(r) => Some(r),
            other => {
                *s = other;
                None
            }
        }
    }

    /// Waits until `deadline` for the operation to finish (polling first for [`SPIN`] when
    /// `spin`); its result, or `None` at the deadline.
    fn wait_until(&self, deadline: Instant, spin: bool) -> Option<Result<B>> {
        let spin_until = Instant::now() + if spin { SPIN } else { Duration::ZERO };
        while !self.finished.load(Ordering::Acquire) {
            let now = Instant::now();
            if now >= spin_until {
                break;
            }
            std::hint::spin_loop();
        }
        loop {
            if self.finished.load(Ordering::Acquire) {
                return self.take_result();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            let mut n = lock(&self.sleepers);
            *n += 1;
            // `finish` sets the flag before it reads the count under this lock: either it sees
            // this sleeper and notifies, or the flag is set by now.
            if !self.finished.load(Ordering::Acquire) {
                n = self
                    .done
                    .wait_timeout(n, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            *n -= 1;
        }
    }
}

/// Stores the operation's result when it ends, also when it panics (then the error it was
/// armed with), so no waiter waits out its deadline for an operation that is gone.
struct Finish<'a, B> {
    cell: &'a Cell<B>,
    result: Option<Result<B>>,
}

impl<B> Drop for Finish<'_, B> {
    fn drop(&mut self) {
        if let Some(r) = self.result.take() {
            self.cell.finish(r);
        }
    }
}

fn lost(rank: usize, op: &str) -> Error {
    Error::Aborted {
        rank,
        reason: format!("{op}: the progress thread dropped the operation"),
    }
}

/// A handle on an operation running in the background; owns the operation's buffers until
/// [`Work::wait`] gives them back.
#[must_use = "an async operation's buffer comes back only through wait()"]
pub struct Work<B> {
    cell: Arc<Cell<B>>,
    /// Poll briefly before sleeping (off when ranks outnumber cores).
    pub(super) spin: bool,
    /// The communicator's world ranks, noted in the errors the handle makes itself.
    pub(super) world: Option<Arc<WorldNames>>,
}

impl<B> Work<B> {
    pub(super) fn new(cell: Arc<Cell<B>>) -> Self {
        Work {
            cell,
            spin: true,
            world: None,
        }
    }

    /// A handle on an operation that failed before it was queued.
    pub(crate) fn failed(e: Error, rank: usize, op: &'static str) -> Work<B> {
        let cell = Arc::new(Cell::with(State::Done(Err(e)), (0, 0), op, rank));
        Work::new(cell)
    }

    /// Waits for the operation and returns its buffers. The wait is bounded: every operation ahead
    /// of this one and this one have their own deadlines (`OXCCL_TIMEOUT`), counted from this
    /// call.
    ///
    /// A host operation the progress thread has not started yet runs on this thread instead
    /// (when its turn comes, as it would there), and so do the ones queued ahead of it: a small
    /// operation waited for right away then costs no thread hand-over. Its waits then follow a
    /// blocking call's: the turn's deadline counts from this call, and a time-out (or a panic)
    /// happens on this thread; a time-out waiting for the turn breaks the communicator, as it
    /// would on the progress thread. After a few waits in a row that found their operation not
    /// started, queueing stops waking the progress thread (it then runs only what nobody waited
    /// for within half a millisecond, and wakes for every operation again once it has).
    ///
    /// # Errors
    /// The operation's error, or `Timeout` if it did not finish in time.
    pub fn wait(self) -> Result<B> {
        let cell = &*self.cell;
        if let Some(shared) = cell.shared.as_deref() {
            if !cell.finished.load(Ordering::Acquire) {
                // Operations queued ahead of this one run here first (its turn follows theirs).
                shared.queue.before_wait(shared, cell.ticket);
                // Not started yet: run it here instead of handing it over and back (two thread
                // wake-ups, most of a small operation's time).
                if let Some(body) = cell.take_body(false) {
                    shared.queue.note_wait(true);
                    return body(shared, cell.ticket, cell.ahead);
                }
            }
            // The progress thread ran it, or runs it: early if it started just now (with
            // ranks crowding the cores, the thread queueing may lose its core to the progress
            // thread it woke until the operation is over).
            let started = cell.started.load(Ordering::Acquire);
            let just =
                started == 0 || now_ns().saturating_sub(started) < JUST_STARTED.as_nanos() as u64;
            shared.queue.note_wait(just);
        }
        let budget = self.budget();
        let deadline = Instant::now() + budget;
        match self.cell.wait_until(deadline, self.spin) {
            Some(r) => r,
            None => Err(self.named(Error::Timeout {
                rank: self.cell.rank,
                op: self.cell.op.to_string(),
                timeout: budget,
                detail: "async operation did not complete".into(),
            })),
        }
    }

    /// Waits at most `timeout` (without running the operation here); on time-out the handle is
    /// given back (`Err(self)`) so the caller can wait again.
    ///
    /// # Errors
    /// `Ok(Err(self))` when the operation has not finished within `timeout`.
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Result<B>, Work<B>> {
        self.hurry();
        let deadline = Instant::now() + timeout;
        match self.cell.wait_until(deadline, self.spin) {
            Some(r) => Ok(r),
            None if self.cell.finished.load(Ordering::Acquire) => Ok(Err(self.lost())),
            None => Err(self),
        }
    }

    /// True once the operation has finished (successfully or not).
    /// While it has not, the progress thread is told to run it.
    pub fn is_done(&self) -> bool {
        self.hurry();
        self.cell.finished.load(Ordering::Acquire)
    }

    /// Makes sure the progress thread runs the operation without a waiter (see
    /// [`Work::wait`]: after waits that came early, it may nap first).
    fn hurry(&self) {
        if let Some(shared) = self.cell.shared.as_deref() {
            if !self.cell.finished.load(Ordering::Acquire) {
                shared.queue.hurry();
            }
        }
    }

    /// How long [`Work::wait`] may block once it has to: every operation ahead of this one and
    /// this one have their own time-out (nothing for an operation that failed before it was
    /// queued).
    fn budget(&self) -> Duration {
        let cell = &*self.cell;
        cell.shared
            .as_deref()
            .map_or(Duration::ZERO, |s| s.work_budget(cell.ahead))
    }

    fn lost(&self) -> Error {
        self.named(lost(self.cell.rank, self.cell.op))
    }

    fn named(&self, e: Error) -> Error {
        crate::base::error::named(self.world.as_deref(), e)
    }
}
