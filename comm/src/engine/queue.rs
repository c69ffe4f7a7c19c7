//! The progress thread and the line of async operations it serves: queued in ticket order, run
//! by it or by a thread that needs them first (a waiter, or a blocking call behind them), and
//! stopped when the communicator goes.
//!
//! Handing an operation to another thread costs a wake-up there and a core taken from a rank
//! (most of a small operation's time on a machine with as many ranks as cores), and buys
//! nothing when the caller waits for it at once. So the line watches its waiters: after
//! [`LAZY_AFTER`] waits in a row that found their operation still queued, queueing stops waking
//! the progress thread, which then naps ([`NAP`], doubled after every nap whose operations
//! waiters all took, up to [`NAP_MAX`]) and runs only what nobody took within a nap; the first
//! such operation, a poll of an unfinished one, or a nap with nothing queued makes every
//! queueing wake it again (a wait that is not early starts the count again).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::work::Cell;
use super::{lock, ExecState, Shared, Work};
use crate::base::error::Result;

/// How long the progress thread naps at first while waiters run their own operations: an
/// operation nobody waits for starts within two naps.
const NAP: Duration = Duration::from_micros(500);

/// The longest nap: each nap whose operations waiters all took doubles the next, up to this.
/// Where ranks fill the cores, every wake-up takes a core from a rank (with 2 ranks on 2 cores,
/// 500 us naps cost an 8 B async all-reduce a tenth to a sixth of its time); an operation nobody
/// waits for, queued after a long run of waited ones, may then start up to two of these late
/// (a poll of it, `is_done` or `wait_timeout`, wakes the thread at once).
const NAP_MAX: Duration = Duration::from_millis(8);

/// Waits in a row that find their operation still queued before queueing stops waking the
/// progress thread.
pub(super) const LAZY_AFTER: u32 = 8;

/// What an operation leaves in the line: a host operation's cell, which any thread may run, or
/// a device operation's part, which only the progress thread runs.
pub(super) trait LineJob: Send + Sync {
    /// Runs the operation unless someone took it (a host operation stores its result in its
    /// cell); whether it ran.
    fn run_queued(&self) -> bool;
    /// Someone took it (its entry is left for the line to drop).
    fn is_taken(&self) -> bool;
    /// Any thread that needs it done may run it (a host operation).
    fn stealable(&self) -> bool {
        true
    }
}

/// A queued operation's work (one pointer: an entry of the line is four words).
pub(super) struct Job(Arc<dyn LineJob>);

/// A device operation's part: the progress thread's alone.
#[cfg(any(test, feature = "cuda-core"))]
struct DeviceJob(Mutex<Option<Box<dyn FnOnce() + Send>>>);

#[cfg(any(test, feature = "cuda-core"))]
impl LineJob for DeviceJob {
    fn run_queued(&self) -> bool {
        let f = lock(&self.0).take();
        f.is_some_and(|f| {
            f();
            true
        })
    }

    fn is_taken(&self) -> bool {
        false
    }

    fn stealable(&self) -> bool {
        false
    }
}

impl Job {
    fn stealable(&self) -> bool {
        self.0.stealable()
    }

    /// A host operation that a waiter took.
    fn is_dead(&self) -> bool {
        self.0.is_taken()
    }

    /// Runs it unless a waiter took it; whether it ran. A panic has broken the communicator
    /// and left its error in the operation's cell, so the thread goes on.
    fn run(self) -> bool {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.0.run_queued()))
            .unwrap_or(true)
    }
}

/// A queued operation.
struct Queued {
    ticket: u64,
    /// Its place among the queued operations (the line's `queued` count when it came).
    seq: u64,
    job: Job,
}

/// Where the progress thread is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Sleep {
    Awake,
    /// Until a queueing wakes it.
    Parked,
    /// For a nap (`Line::nap`); queueing a host operation wakes it only when the line is not
    /// lazy.
    Napping,
}

struct Line {
    jobs: VecDeque<Queued>,
    thread: Option<JoinHandle<()>>,
    sleep: Sleep,
    /// Operations queued so far.
    queued: u64,
    closing: bool,
    /// The progress thread's next nap (see [`NAP_MAX`]).
    nap: Duration,
    /// Device jobs queued: while there is one, the thread runs the host jobs ahead of it
    /// instead of napping (it alone runs the device job, whose turn comes after theirs).
    devices: usize,
}

/// A communicator's line of async operations and its progress thread (started at the first).
pub(crate) struct WorkQueue {
    line: Mutex<Line>,
    wake: Condvar,
    /// Queueing a host operation does not wake the progress thread (a hint, read and written
    /// without the line's lock: a napping thread still finds what nobody took).
    lazy: AtomicBool,
    /// Waits in a row that found their operation still queued (plain loads and stores: a
    /// count lost to a race costs a wait or two more before the line turns lazy).
    early: AtomicU32,
    rank: usize,
}

impl WorkQueue {
    pub(crate) fn new(rank: usize) -> WorkQueue {
        WorkQueue {
            line: Mutex::new(Line {
                jobs: VecDeque::new(),
                thread: None,
                sleep: Sleep::Awake,
                queued: 0,
                closing: false,
                nap: NAP,
                devices: 0,
            }),
            wake: Condvar::new(),
            lazy: AtomicBool::new(false),
            early: AtomicU32::new(0),
            rank,
        }
    }

    /// Queues `job` (the caller holds the line, taken with [`WorkQueue::hold`], since it took
    /// `ticket` under it), starting the progress thread first if there is none; gives the job
    /// back when no thread can run it (the caller runs it).
    fn push(
        self: &Arc<Self>,
        line: &mut Line,
        ticket: u64,
        job: Job,
    ) -> std::result::Result<(), Job> {
        if line.thread.is_none() {
            if line.closing {
                return Err(job);
            }
            let q = Arc::clone(self);
            let name = format!("oxccl-progress-r{}", self.rank);
            match std::thread::Builder::new()
                .name(name)
                .spawn(move || q.serve())
            {
                Ok(h) => line.thread = Some(h),
                Err(e) => {
                    tracing::error!(
                        rank = self.rank,
                        "could not start the progress thread: {e}; running inline"
                    );
                    return Err(job);
                }
            }
        }
        // Entries of operations their waiters took leave here, on the thread that queues.
        while line.jobs.front().is_some_and(|j| j.job.is_dead()) {
            line.jobs.pop_front();
        }
        let stealable = job.stealable();
        if !stealable {
            line.devices += 1;
        }
        line.jobs.push_back(Queued {
            ticket,
            seq: line.queued,
            job,
        });
        line.queued += 1;
        let wake = match line.sleep {
            Sleep::Awake => false,
            Sleep::Parked => true,
            Sleep::Napping => !(stealable && self.lazy.load(Ordering::Relaxed)),
        };
        if wake {
            self.wake.notify_one();
        }
        Ok(())
    }

    fn hold(&self) -> MutexGuard<'_, Line> {
        lock(&self.line)
    }

    /// The progress thread: runs what the line gives it until the communicator closes and the
    /// line is empty. A panicking operation has left its error in its cell (and broken the
    /// communicator); the thread goes on with the next.
    fn serve(self: Arc<Self>) {
        let mut line = self.hold();
        // Operations queued before the current nap began (`seq < mark`) went untaken for one.
        let mut mark = 0;
        loop {
            let lazy = self.lazy.load(Ordering::Relaxed);
            let take = line.jobs.front().is_some_and(|j| {
                line.closing || !lazy || line.devices > 0 || j.seq < mark || j.job.is_dead()
            });
            if take {
                if let Some(j) = line.jobs.pop_front() {
                    let host = j.job.stealable();
                    if !host {
                        line.devices -= 1;
                    }
                    drop(line);
                    let ran = j.job.run();
                    if ran && host && lazy {
                        // Nobody took it within a nap: the caller overlaps; wake on queueing.
                        self.eager();
                    }
                    line = self.hold();
                    if ran {
                        line.nap = NAP;
                    }
                }
                continue;
            }
            if line.closing {
                return;
            }
            if lazy && line.queued != mark {
                mark = line.queued;
                line.sleep = Sleep::Napping;
                let nap = line.nap;
                line = self
                    .wake
                    .wait_timeout(line, nap)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                // What was queued before it and is still there runs next (and shortens the
                // naps again); if waiters took it all, the next nap is longer.
                line.nap = line.nap.saturating_mul(2).min(NAP_MAX);
            } else {
                // Not lazy, or idle for a whole nap: sleep until something is queued, and after
                // a nap wake for everything queued from here on (not lazy, leave the count of
                // early waits alone: a waiter may be making the line lazy right now).
                if lazy {
                    self.eager();
                }
                line.sleep = Sleep::Parked;
                line = self.wake.wait(line).unwrap_or_else(|p| p.into_inner());
                mark = 0;
                line.nap = NAP;
            }
            line.sleep = Sleep::Awake;
        }
    }

    /// Runs here, in order, the host operations queued ahead of `ticket` (whoever waits for
    /// them finds them done).
    fn run_ahead(&self, ticket: u64) {
        let mut line = self.hold();
        while let Some(i) = line
            .jobs
            .iter()
            .take_while(|j| j.ticket < ticket)
            .position(|j| j.job.stealable())
        {
            let Some(j) = line.jobs.remove(i) else { break };
            drop(line);
            // A panic there leaves the caller's own operation to report the broken
            // communicator.
            j.job.run();
            line = self.hold();
        }
    }

    /// Before a blocking call with `ahead` operations before it runs: the queued ones run here.
    pub(super) fn before_call(&self, ticket: u64, ahead: u64) {
        if ahead > 0 {
            self.run_ahead(ticket);
        }
    }

    /// Before a wait for the unfinished operation of `ticket`: the host operations queued
    /// ahead of it run here (none when its turn has come).
    pub(super) fn before_wait(&self, shared: &Shared, ticket: u64) {
        if shared.turn.serving.load(Ordering::SeqCst) != ticket {
            self.run_ahead(ticket);
        }
    }

    /// Counts a wait: `early` when it found its operation still queued, or started just now
    /// by the progress thread; after [`LAZY_AFTER`] of those in a row, queueing stops waking
    /// the progress thread.
    pub(super) fn note_wait(&self, early: bool) {
        if !early {
            if self.early.load(Ordering::Relaxed) != 0 {
                self.early.store(0, Ordering::Relaxed);
            }
            return;
        }
        let n = self.early.load(Ordering::Relaxed).saturating_add(1);
        self.early.store(n, Ordering::Relaxed);
        if n >= LAZY_AFTER && !self.lazy.load(Ordering::Relaxed) {
            self.lazy.store(true, Ordering::Relaxed);
        }
    }

    /// Queueing wakes the progress thread again.
    fn eager(&self) {
        self.lazy.store(false, Ordering::Relaxed);
        self.early.store(0, Ordering::Relaxed);
    }

    /// Makes queueing wake the progress thread again, and wakes it now if it naps (a poll or a
    /// bounded wait for an operation it should run).
    pub(super) fn hurry(&self) {
        if self.lazy.load(Ordering::Relaxed) {
            self.eager();
            if self.hold().sleep == Sleep::Napping {
                self.wake.notify_one();
            }
        }
    }

    /// Waits in a row counted early.
    #[cfg(test)]
    pub(super) fn early_waits(&self) -> u32 {
        self.early.load(Ordering::Relaxed)
    }

    /// Whether queueing a host operation wakes the progress thread now.
    #[cfg(test)]
    pub(super) fn is_lazy(&self) -> bool {
        self.lazy.load(Ordering::Relaxed)
    }

    /// The progress thread's next nap, and the first and longest.
    #[cfg(test)]
    pub(super) fn naps(&self) -> (Duration, Duration, Duration) {
        (self.hold().nap, NAP, NAP_MAX)
    }

    /// Closes the line: the progress thread runs what is queued, then ends; waits for it.
    fn close(&self) {
        let thread = {
            let mut line = self.hold();
            line.closing = true;
            if line.sleep != Sleep::Awake {
                self.wake.notify_one();
            }
            line.thread.take()
        };
        if let Some(h) = thread {
            let _ = h.join();
        }
    }
}

impl Shared {
    /// Takes a ticket and queues `job(ticket, ahead)` for the progress thread alone (a device
    /// operation: see [`Shared::submit_job`]). Returns the ticket and how many operations
    /// were ahead.
    #[cfg(any(test, feature = "cuda-core"))]
    pub(crate) fn submit_ticketed<F>(self: &Arc<Self>, job: F) -> (u64, u64)
    where
        F: FnOnce(u64, u64) + Send + 'static,
    {
        self.submit_job(|ticket, ahead| {
            let part: Box<dyn FnOnce() + Send> = Box::new(move || job(ticket, ahead));
            let job = Job(Arc::new(DeviceJob(Mutex::new(Some(part)))));
            (job, (ticket, ahead))
        })
    }

    /// Takes a ticket and queues the job that `make(ticket, ahead)` makes, both under the
    /// line's lock, so queued jobs sit in ticket order even when several threads queue at once
    /// (a job queued behind a later ticket would wait for a turn that cannot come). Returns
    /// what `make` returned beside the job.
    #[inline]
    fn submit_job<T>(self: &Arc<Self>, make: impl FnOnce(u64, u64) -> (Job, T)) -> T {
        let mut line = self.queue.hold();
        let (ticket, ahead) = self.take_ticket();
        let (job, made) = make(ticket, ahead);
        if let Err(job) = self.queue.push(&mut line, ticket, job) {
            drop(line);
            job.run();
        }
        made
    }

    /// Queues `run` as the next operation: it gets the execution state and `buf` when its turn
    /// comes, and the returned [`Work`] (named `op`) gives back what `finish` makes of `buf`.
    /// The operation is one allocation (its cell), which the line and the handle share; `run`
    /// stays in it and is called by reference, so only `buf` moves.
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
        F: Fn(&Shared, &mut ExecState, &mut B) -> Result<()> + Send + Sync + 'static,
    {
        // Whoever takes the operation first runs it: the progress thread, a thread that needs
        // it done first, or the one that waits for it.
        self.submit_job(move |ticket, ahead| {
            let parts = (buf, run, finish);
            let cell = Arc::new(Cell::queued(Arc::clone(self), (ticket, ahead), op, parts));
            (Job(cell.clone()), Work::new(cell))
        })
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
        self.queue.close();
        let next = self.turn.next_ticket.load(Ordering::SeqCst);
        let serving = self.turn.serving.load(Ordering::SeqCst);
        let outstanding = u32::try_from(next.saturating_sub(serving)).unwrap_or(u32::MAX);
        // Each of them may take its own time-out (as `run_turn` allows), and a second of slack.
        let budget = self
            .timeout
            .saturating_mul(outstanding.saturating_add(1))
            .saturating_add(Duration::from_secs(1));
        let deadline = Instant::now().checked_add(budget);
        let mut t = self.turns_held();
        while self.turn.serving.load(Ordering::SeqCst) < next {
            let left = deadline.map_or(budget, |d| d.saturating_duration_since(Instant::now()));
            if left.is_zero() {
                break;
            }
            t = self.wait_for_turns(t, left);
        }
        drop(t);
        self.turn.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}
