//! [`Work`]: the handle of an operation running in the background, and the cell it shares with
//! whoever runs it (the progress thread, or the thread that waits first).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::queue::LineJob;
use super::{lock, Shared};
use crate::base::error::{Error, Result};

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

/// Where an operation's result is.
enum Outcome<R> {
    /// Not finished, or finished on the thread that waited for it (which returned the result
    /// itself).
    Pending,
    /// Finished on the progress thread; the result waits for [`Work::wait`].
    Done(Result<R>),
    /// The result was handed out.
    Taken,
}

/// What a handle shares with whoever runs its operation, whatever the operation is.
pub(super) struct Core<R> {
    outcome: Mutex<Outcome<R>>,
    /// Set (after the result is stored) once the operation finished: polled without the lock.
    finished: AtomicBool,
    /// A waiter sleeps on it (counted in `sleepers`, so a finish notifies only then).
    done: Condvar,
    sleepers: Mutex<usize>,
    /// Set once someone took the operation: the line drops its entry unseen.
    taken: AtomicBool,
    /// When the progress thread (or a thread running the operations ahead of its own) took
    /// the operation ([`now_ns`]; 0 before, and when its waiter took it).
    started: AtomicU64,
    ticket: u64,
    ahead: u64,
    /// The operation's name and rank, for the error left when it panics.
    op: &'static str,
    rank: usize,
    /// The engine that runs it (none for an operation that failed before it was queued).
    shared: Option<Arc<Shared>>,
}

/// A queued host operation in one allocation: its core, its buffers until someone takes them,
/// and its body, which runs in place (called by reference: only the buffers move).
pub(super) struct Cell<B, R, F> {
    core: Core<R>,
    input: Mutex<Option<B>>,
    body: F,
    finish: fn(B) -> R,
}

/// An operation as its handle sees it.
pub(super) trait Pending<R>: Send + Sync {
    fn core(&self) -> &Core<R>;
    /// [`Work::wait`]: runs the operation here if nobody has taken it, else waits for it. (The
    /// result is made where it is returned: moved through fewer frames, whose loads of freshly
    /// stored words stall.)
    fn wait(&self) -> Result<R>;
}

impl<B, R, F> Cell<B, R, F>
where
    B: Send,
    R: Send,
    F: Fn(&Shared, &mut super::ExecState, &mut B) -> Result<()> + Send + Sync,
{
    pub(super) fn queued(
        shared: Arc<Shared>,
        (ticket, ahead): (u64, u64),
        op: &'static str,
        (buf, body, finish): (B, F, fn(B) -> R),
    ) -> Cell<B, R, F> {
        let rank = shared.rank;
        let mut core = Core::with(Outcome::Pending, (ticket, ahead), op, rank);
        core.shared = Some(shared);
        Cell {
            core,
            input: Mutex::new(Some(buf)),
            body,
            finish,
        }
    }

    /// Takes the operation if nobody has (whoever takes it alone locks `input` from then on).
    fn claim(&self) -> bool {
        !self.core.taken.swap(true, Ordering::AcqRel)
    }

    /// Runs the claimed operation when its turn comes, on the buffers where they lie, and gives
    /// them back through `finish`.
    fn run(&self, shared: &Shared) -> Result<R> {
        let core = &self.core;
        let mut input = lock(&self.input);
        let ran = shared.run_turn(core.ticket, core.ahead, |st| match input.as_mut() {
            Some(buf) => (self.body)(shared, st, buf),
            None => Err(lost(core.rank, core.op)),
        });
        let buf = input.take();
        drop(input);
        match (ran, buf) {
            (Ok(()), Some(buf)) => Ok((self.finish)(buf)),
            (Err(e), _) => Err(e),
            (Ok(()), None) => Err(lost(core.rank, core.op)),
        }
    }
}

impl<B, R, F> Pending<R> for Cell<B, R, F>
where
    B: Send,
    R: Send,
    F: Fn(&Shared, &mut super::ExecState, &mut B) -> Result<()> + Send + Sync,
{
    fn core(&self) -> &Core<R> {
        &self.core
    }

    fn wait(&self) -> Result<R> {
        let core = &self.core;
        if let Some(shared) = core.shared.as_deref() {
            if !core.finished.load(Ordering::Acquire) {
                // Operations queued ahead of this one run here first (its turn follows theirs).
                shared.queue.before_wait(shared, core.ticket);
                // Not started yet: run it here instead of handing it over and back (two thread
                // wake-ups, most of a small operation's time).
                if self.claim() {
                    shared.queue.note_wait(true);
                    return self.run(shared);
                }
            }
        }
        core.wait_finished()
    }
}

impl<B, R, F> LineJob for Cell<B, R, F>
where
    B: Send,
    R: Send,
    F: Fn(&Shared, &mut super::ExecState, &mut B) -> Result<()> + Send + Sync,
{
    /// The progress thread's turn at the operation (or a thread's that needs it done): runs it
    /// unless a waiter took it first, and stores the result (an error naming the loss if the
    /// operation panics). Whether it ran.
    fn run_queued(&self) -> bool {
        let core = &self.core;
        let Some(shared) = core.shared.as_deref() else {
            return false;
        };
        if !self.claim() {
            return false;
        }
        core.started.store(now_ns(), Ordering::Release);
        let mut guard = Finish {
            core,
            result: Some(Err(lost(core.rank, core.op))),
        };
        guard.result = Some(self.run(shared));
        true
    }

    fn is_taken(&self) -> bool {
        self.core.taken.load(Ordering::Acquire)
    }
}

/// An operation that failed before it was queued: only its result.
struct Failed<R>(Core<R>);

impl<R: Send> Pending<R> for Failed<R> {
    fn core(&self) -> &Core<R> {
        &self.0
    }

    fn wait(&self) -> Result<R> {
        self.0.wait_finished()
    }
}

impl<R> Core<R> {
    fn with(
        outcome: Outcome<R>,
        (ticket, ahead): (u64, u64),
        op: &'static str,
        rank: usize,
    ) -> Core<R> {
        let finished = matches!(outcome, Outcome::Done(_));
        Core {
            outcome: Mutex::new(outcome),
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

    /// The rest of [`Work::wait`] once the operation is someone else's: waits (bounded) for
    /// its result.
    fn wait_finished(&self) -> Result<R> {
        if let Some(shared) = self.shared.as_deref() {
            // The progress thread ran it, or runs it: early if it started just now (with
            // ranks crowding the cores, the thread queueing may lose its core to the progress
            // thread it woke until the operation is over).
            let started = self.started.load(Ordering::Acquire);
            let just =
                started == 0 || now_ns().saturating_sub(started) < JUST_STARTED.as_nanos() as u64;
            shared.queue.note_wait(just);
        }
        let budget = self.budget();
        let deadline = Instant::now() + budget;
        match self.wait_until(deadline, self.spin()) {
            Some(r) => r,
            None => Err(self.named(Error::Timeout {
                rank: self.rank,
                op: self.op.to_string(),
                timeout: budget,
                detail: "async operation did not complete".into(),
            })),
        }
    }

    /// Poll briefly before sleeping (off when ranks outnumber cores).
    fn spin(&self) -> bool {
        self.shared.as_deref().is_none_or(|s| s.spin)
    }

    /// How long [`Work::wait`] may block once it has to: every operation ahead of this one and
    /// this one have their own time-out (nothing for an operation that failed before it was
    /// queued).
    fn budget(&self) -> Duration {
        self.shared
            .as_deref()
            .map_or(Duration::ZERO, |s| s.work_budget(self.ahead))
    }

    /// `e` with the communicator's world ranks (those of an operation that failed before it
    /// was queued were noted when it failed).
    fn named(&self, e: Error) -> Error {
        let world = self.shared.as_deref().and_then(|s| s.world.as_deref());
        crate::base::error::named(world, e)
    }

    fn finish(&self, r: Result<R>) {
        *lock(&self.outcome) = Outcome::Done(r);
        self.finished.store(true, Ordering::Release);
        if *lock(&self.sleepers) > 0 {
            self.done.notify_all();
        }
    }

    /// The result, if the operation finished and nobody took it yet.
    fn take_result(&self) -> Option<Result<R>> {
        let mut s = lock(&self.outcome);
        match std::mem::replace(&mut *s, Outcome::Taken) {
            Outcome::Done(r) => Some(r),
            other => {
                *s = other;
                None
            }
        }
    }

    /// Waits until `deadline` for the operation to finish (polling first for [`SPIN`] when
    /// `spin`); its result, or `None` at the deadline.
    fn wait_until(&self, deadline: Instant, spin: bool) -> Option<Result<R>> {
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
struct Finish<'a, R> {
    core: &'a Core<R>,
    result: Option<Result<R>>,
}

impl<R> Drop for Finish<'_, R> {
    fn drop(&mut self) {
        if let Some(r) = self.result.take() {
            self.core.finish(r);
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
    cell: Arc<dyn Pending<B>>,
}

impl<B: Send + 'static> Work<B> {
    pub(super) fn new(cell: Arc<dyn Pending<B>>) -> Self {
        Work { cell }
    }

    /// A handle on an operation that failed before it was queued.
    pub(crate) fn failed(e: Error, rank: usize, op: &'static str) -> Work<B> {
        let core = Core::with(Outcome::Done(Err(e)), (0, 0), op, rank);
        Work::new(Arc::new(Failed(core)))
    }
}

impl<B> Work<B> {
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
    /// for within a nap, of half a millisecond at first and up to 8 ms while every wait comes
    /// first, and wakes for every operation again once it has; `is_done` and `wait_timeout`
    /// wake it at once).
    ///
    /// # Errors
    /// The operation's error, or `Timeout` if it did not finish in time.
    pub fn wait(self) -> Result<B> {
        self.cell.wait()
    }

    /// Waits at most `timeout` (without running the operation here); on time-out the handle is
    /// given back (`Err(self)`) so the caller can wait again.
    ///
    /// # Errors
    /// `Ok(Err(self))` when the operation has not finished within `timeout`.
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Result<B>, Work<B>> {
        self.hurry();
        let deadline = Instant::now() + timeout;
        let core = self.cell.core();
        match core.wait_until(deadline, core.spin()) {
            Some(r) => Ok(r),
            // It finished right after the deadline's check: its result is there to take.
            None if core.finished.load(Ordering::Acquire) => {
                Ok(core.take_result().unwrap_or_else(|| Err(self.lost())))
            }
            None => Err(self),
        }
    }

    /// True once the operation has finished (successfully or not).
    /// While it has not, the progress thread is told to run it.
    pub fn is_done(&self) -> bool {
        self.hurry();
        self.cell.core().finished.load(Ordering::Acquire)
    }

    /// Makes sure the progress thread runs the operation without a waiter (see
    /// [`Work::wait`]: after waits that came early, it may nap first).
    fn hurry(&self) {
        let core = self.cell.core();
        if let Some(shared) = core.shared.as_deref() {
            if !core.finished.load(Ordering::Acquire) {
                shared.queue.hurry();
            }
        }
    }

    fn lost(&self) -> Error {
        let core = self.cell.core();
        core.named(lost(core.rank, core.op))
    }
}
