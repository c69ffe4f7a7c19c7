//! The engine: runs a communicator's operations one at a time, in the order they were issued.
//!
//! Every operation takes a ticket when it is issued. Blocking calls wait for their turn and run on
//! the caller's thread (so they can borrow the caller's slices); `*_async` calls send a job to the
//! communicator's progress thread, which runs it when its turn comes, unless [`Work::wait`] gets
//! to a host operation's job first and runs it on the waiting thread. Async jobs own their
//! buffers (any `AsMut<[T]> + Send + 'static`) and hand them back through [`Work::wait`], so no
//! borrow ever crosses threads.
//!
//! Failure handling lives here too: when an operation fails (other than bad arguments, which are
//! rejected before a ticket is taken), the communicator is marked broken, the error is published
//! in the store under `<comm>/error` (the first one wins) and every connection is dropped. Peers
//! then see their sockets close, read the published error and report the same cause: a mismatch
//! detected by one rank becomes `Mismatch` on every rank, a killed rank becomes `PeerLost` naming
//! it on every survivor.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};

use crate::bootstrap::Store;
use crate::config::Config;
use crate::error::{Error, Result, WorldNames};
use crate::prims::{Links, NodeLayout};
use crate::stall::Stalls;
use crate::trace::{Owner, Recorder};
use crate::tuning::AlgoOverride;

/// State that only the running operation touches.
pub(crate) struct ExecState {
    pub links: Links,
    /// Sequence number of the next collective.
    pub coll_seq: u64,
    /// Per-peer sequence numbers of point-to-point messages sent / received.
    pub p2p_sent: Vec<u64>,
    pub p2p_recvd: Vec<u64>,
    /// Set once an operation failed: every later operation fails with it.
    pub broken: Option<Error>,
}

struct Turn {
    next_ticket: u64,
    serving: u64,
    /// Threads waiting on `turn_cv` (a notification costs a syscall; skip it when nobody waits).
    waiters: usize,
}

type Job = Box<dyn FnOnce() + Send>;
/// The body of an async operation, given its ticket and how many operations were ahead.
type TicketedJob = Box<dyn FnOnce(u64, u64) + Send>;
/// An async operation's body until the progress thread or a waiter takes it.
type JobSlot = Arc<Mutex<Option<TicketedJob>>>;

/// Longest wait for the store while publishing a failure.
const PUBLISH_BUDGET: Duration = Duration::from_secs(3);

/// Where a communicator publishes its failure, and the cause once it has one
/// ([`Shared::failures`]).
pub(crate) type Failures = (String, Arc<Mutex<Option<Error>>>);

/// What the operations of one communicator share.
pub(crate) struct Shared {
    pub rank: usize,
    pub size: usize,
    pub timeout: Duration,
    pub algo: AlgoOverride,
    /// Waiting ranks busy-poll before yielding (off when ranks outnumber cores).
    pub spin: bool,
    /// The thread large sends to TCP peers go out on (`OXCCL_SOCKET_SEND_THREAD`).
    pub send_thread: Option<crate::prims::SendThread>,
    /// The extra channels large all-reduces, broadcasts and reduces are cut across
    /// (`OXCCL_SOCKET_CHANNELS`; set once at init, after the communicator's own connections).
    pub channels: std::sync::OnceLock<crate::channels::Channels>,
    /// The ranks by node, when the communicator spans nodes of at least two ranks each
    /// (hierarchical algorithms).
    pub layout: Option<NodeLayout>,
    /// Some ranks of the communicator reach each other over TCP (the same on every rank; the
    /// tuner's [`crate::tuning::Caps::sockets`]).
    pub sockets: bool,
    /// `OXCCL_HIERARCHICAL_BLOCK` (the same on every rank, checked at init).
    pub hierarchical_block: usize,
    pub abort: AtomicBool,
    pub exec: Mutex<ExecState>,
    /// What this rank posts when a wait stalls, and reads when one times out.
    pub stalls: Stalls,
    /// The flight recorder (`OXCCL_TRACE_BUFFER`, `OXCCL_TRACE_DIR`): written by the running
    /// operation, readable by any thread while it runs.
    pub trace: Recorder,
    /// For a communicator made from another (`split`, `shrink`): its ranks' ranks in the world,
    /// noted in every error its operations report ([`Shared::named`]).
    pub world: Option<Arc<WorldNames>>,
    /// Set when an operation gave up waiting for its turn: it never ran, so this rank's sequence
    /// numbers no longer match its peers'. The communicator breaks with `skipped` as the cause as
    /// soon as the execution state is free (see [`Shared::break_when_free`]).
    skipped_set: AtomicBool,
    skipped: Mutex<Option<Error>>,
    store: Arc<dyn Store>,
    /// Where this communicator's failure is published (`<id>/error`; a channel publishes under
    /// its parent's, `crate::channels`).
    error_key: String,
    /// The cause this rank published or adopted, once it has ([`Shared::publish_error`]);
    /// shared with the communicator's channels, which publish under its key (`crate::channels`),
    /// so every part of a cut operation on this rank reports one cause, with its own type.
    published: Arc<Mutex<Option<Error>>>,
    /// On a channel running its part of a cut operation: the channel's index and the parent's
    /// operation number and call, so a mismatch it finds is published as the caller's
    /// (`crate::channels`).
    pub cut_call: Mutex<Option<(usize, u64, String)>>,
    turn: Mutex<Turn>,
    turn_cv: Condvar,
    worker: Mutex<Option<(Sender<Job>, JoinHandle<()>)>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain data behind; keep going.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    pub(crate) fn new(
        rank: usize,
        size: usize,
        spin: bool,
        cfg: &Config,
        links: Links,
        store: Arc<dyn Store>,
        comm_id: &str,
    ) -> Shared {
        Shared {
            rank,
            size,
            timeout: cfg.timeout,
            algo: cfg.algo.clone(),
            spin,
            send_thread: None,
            channels: std::sync::OnceLock::new(),
            layout: None,
            sockets: false,
            hierarchical_block: cfg.hierarchical_block,
            abort: AtomicBool::new(false),
            exec: Mutex::new(ExecState {
                links,
                coll_seq: 0,
                p2p_sent: vec![0; size],
                p2p_recvd: vec![0; size],
                broken: None,
            }),
            stalls: Stalls::new(Arc::clone(&store), comm_id, rank, size, cfg.timeout),
            trace: Recorder::new(
                cfg.trace_buffer,
                cfg.trace_dir.clone(),
                Owner {
                    comm: comm_id.into(),
                    rank,
                    size,
                    root_comm: comm_id.into(),
                    root_rank: rank,
                    node: String::new(),
                },
            ),
            world: None,
            skipped_set: AtomicBool::new(false),
            skipped: Mutex::new(None),
            store,
            error_key: format!("{comm_id}/error"),
            published: Arc::new(Mutex::new(None)),
            cut_call: Mutex::new(None),
            turn: Mutex::new(Turn {
                next_ticket: 0,
                serving: 0,
                waiters: 0,
            }),
            turn_cv: Condvar::new(),
            worker: Mutex::new(None),
        }
    }

    /// Takes the next place in line; returns it and how many operations are ahead.
    pub(crate) fn take_ticket(&self) -> (u64, u64) {
        let mut t = lock(&self.turn);
        let ticket = t.next_ticket;
        t.next_ticket += 1;
        (ticket, ticket - t.serving)
    }

    /// Waits for `ticket`'s turn, runs `f` on the execution state, then lets the next one go.
    pub(crate) fn run_turn<R>(
        &self,
        ticket: u64,
        ahead: u64,
        f: impl FnOnce(&mut ExecState) -> Result<R>,
    ) -> Result<R> {
        {
            let mut t = lock(&self.turn);
            let deadline = (t.serving != ticket).then(|| {
                Instant::now() + self.timeout * (ahead as u32 + 1) + Duration::from_secs(1)
            });
            while t.serving != ticket {
                let deadline = deadline.unwrap_or_else(Instant::now);
                let left = deadline.saturating_duration_since(Instant::now());
                // A later ticket that gave up first moved the line past this one: it cannot
                // come, and the communicator is broken already.
                let passed = t.serving > ticket;
                if left.is_zero() || passed {
                    // This operation never runs: peers would pair its sequence number with the
                    // next one's data. Like NCCL after a time-out, the communicator is unusable
                    // from here on (every later operation fails with this error); give up our
                    // place so the line keeps moving.
                    drop(t);
                    let why = if passed {
                        "a later operation gave up waiting for its turn first"
                    } else {
                        "this one never ran"
                    };
                    let e = Error::Timeout {
                        rank: self.rank,
                        op: "waiting for earlier operations".into(),
                        timeout: self.timeout,
                        detail: format!(
                            "{ahead} operations were queued ahead; {why}, so the communicator \
                             is broken"
                        ),
                    };
                    self.break_when_free(e.clone());
                    self.finish_turn(ticket);
                    return Err(self.named(e));
                }
                t = self.wait_for_turns(t, left);
            }
        }
        let mut end = TurnEnd {
            shared: self,
            ticket,
            ok: false,
        };
        let result = {
            let mut st = lock(&self.exec);
            self.break_if_skipped(&mut st);
            match st.broken.clone() {
                Some(e) => Err(e),
                None if self.abort.load(Ordering::Relaxed) => {
                    let e = Error::Aborted {
                        rank: self.rank,
                        reason: "abort() was called on this rank".into(),
                    };
                    Err(self.fail(&mut st, e))
                }
                None => f(&mut st).map_err(|e| self.fail(&mut st, e)),
            }
        };
        end.ok = result.is_ok();
        drop(end);
        result.map_err(|e| self.named(e))
    }

    /// `e` as this rank reports it: with the world ranks of the ranks it names, for a
    /// communicator made from another (the cause stays as it is where it is published and kept,
    /// so each report is noted once).
    pub(crate) fn named(&self, e: Error) -> Error {
        crate::error::named(self.world.as_deref(), e)
    }

    /// Records that an operation was skipped (`e`: why) and breaks the communicator with it: at
    /// once when no operation runs, else when the running one ends (see [`Shared::run_turn`]).
    fn break_when_free(&self, e: Error) {
        lock(&self.skipped).get_or_insert(e);
        // SeqCst with the load in `try_break_if_skipped`: either the running operation sees the
        // flag after releasing the state, or the `try_lock` here comes after that release.
        self.skipped_set.store(true, Ordering::SeqCst);
        self.try_break_if_skipped();
    }

    /// [`Shared::break_if_skipped`] unless another thread holds the execution state (it runs an
    /// operation, which checks when it ends, or is breaking the communicator already).
    fn try_break_if_skipped(&self) {
        if !self.skipped_set.load(Ordering::SeqCst) {
            return;
        }
        let st = match self.exec.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        if let Some(mut st) = st {
            self.break_if_skipped(&mut st);
        }
    }

    /// Breaks the communicator if an operation was skipped (one load when none was).
    fn break_if_skipped(&self, st: &mut ExecState) {
        if self.skipped_set.load(Ordering::SeqCst) {
            if let Some(e) = lock(&self.skipped).take() {
                self.fail(st, e);
            }
        }
    }

    /// Waits at most `left` for the line of turns to move (counted in `waiters`, so that
    /// `finish_turn` knows to notify).
    fn wait_for_turns<'t>(
        &self,
        mut t: MutexGuard<'t, Turn>,
        left: Duration,
    ) -> MutexGuard<'t, Turn> {
        t.waiters += 1;
        t = self
            .turn_cv
            .wait_timeout(t, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
        t.waiters -= 1;
        t
    }

    fn finish_turn(&self, ticket: u64) {
        let mut t = lock(&self.turn);
        // Tickets that timed out waiting skip ahead; never move backwards.
        if t.serving <= ticket {
            t.serving = ticket + 1;
        }
        if t.waiters > 0 {
            self.turn_cv.notify_all();
        }
    }

    /// Marks the communicator broken after `e`, publishes the first cause, drops every connection,
    /// and returns the error this rank reports.
    pub(crate) fn fail(&self, st: &mut ExecState, e: Error) -> Error {
        if matches!(e, Error::InvalidArgument { .. }) {
            return e;
        }
        if let Some(b) = &st.broken {
            return b.clone();
        }
        let cause = self.publish_error(e);
        tracing::warn!(rank = self.rank, error = %self.named(cause.clone()), "communicator failed; closing its connections");
        // Peers blocked on this rank learn at once: sockets close, shared-memory rings are
        // flagged closed and their doorbells rung.
        st.links.close(Instant::now());
        st.broken = Some(cause.clone());
        // The channels are of no use any more: close theirs too (they publish under this
        // communicator's key, where the cause stands already).
        if let Some(ch) = self.channels.get() {
            ch.abort();
        }
        // After closing: peers learn first, the file can wait.
        self.trace.dump_if_set("failed", Some(&cause));
        cause
    }

    /// Publishes `e` as the communicator's failure unless a rank published one first; returns
    /// the one that stands (every rank then reports the same cause). Peers learn of a failure by
    /// their connections closing, so this comes first.
    pub(crate) fn publish_error(&self, e: Error) -> Error {
        let mut published = lock(&self.published);
        if let Some(cause) = &*published {
            return cause.clone();
        }
        let e = match lock(&self.cut_call).clone() {
            Some((channel, seq, call)) => crate::channels::as_the_callers(e, channel, seq, call),
            None => e,
        };
        let mine = encode_error(&e);
        // A store that cannot be reached (the store host's node cut off) must not delay closing
        // the connections, which is how peers learn: a few seconds at most.
        let budget = self.timeout.min(PUBLISH_BUDGET);
        match self
            .store
            .compare_set_within(&self.error_key, None, &mine, budget)
        {
            Ok(cur) => {
                let cause = if cur == mine {
                    e
                } else {
                    decode_error(&cur, self.rank).unwrap_or(e)
                };
                *published = Some(cause.clone());
                cause
            }
            // Not published: a later caller tries again.
            Err(_) => e,
        }
    }

    /// Where failures are published, and the cause once there is one: a channel takes its
    /// parent's ([`Shared::share_failures`]).
    pub(crate) fn failures(&self) -> Failures {
        (self.error_key.clone(), Arc::clone(&self.published))
    }

    /// Publishes failures where `of` (a parent's [`Shared::failures`]) says, sharing its cause;
    /// its stall reports look there for a published error too.
    pub(crate) fn share_failures(&mut self, of: Failures) {
        (self.error_key, self.published) = of;
        self.stalls.set_error_key(self.error_key.clone());
    }

    /// Takes a ticket and queues the job `make(ticket, ahead)` makes, both under the worker lock,
    /// so queued jobs sit in ticket order even when several threads queue at once (a job queued
    /// behind a later ticket would wait for a turn that cannot come). Returns the ticket and how
    /// many operations were ahead.
    pub(crate) fn submit_ticketed<F>(self: &Arc<Self>, make: F) -> (u64, u64)
    where
        F: FnOnce(u64, u64) + Send + 'static,
    {
        let mut w = lock(&self.worker);
        let (ticket, ahead) = self.take_ticket();
        let job: Job = Box::new(move || make(ticket, ahead));
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
        let (tx, rx) = crossbeam_channel::bounded(1);
        let shared = Arc::clone(self);
        let body: TicketedJob = Box::new(move |ticket: u64, ahead: u64| {
            let mut buf = buf;
            let r = shared.run_turn(ticket, ahead, |st| run(&shared, st, &mut buf));
            let _ = tx.send(r.map(|()| finish(buf)));
        });
        // Whoever takes the body first runs it: the progress thread when its turn comes, or the
        // thread that waits on the operation before the progress thread got to it.
        let slot: JobSlot = Arc::new(Mutex::new(Some(body)));
        let queued = Arc::clone(&slot);
        let (ticket, ahead) = self.submit_ticketed(move |ticket, ahead| {
            let body = lock(&queued).take();
            if let Some(body) = body {
                body(ticket, ahead);
            }
        });
        let mut work = Work::new(rx, self.work_deadline(ahead), self.rank, op);
        work.pending = Some((slot, ticket, ahead));
        work.world.clone_from(&self.world);
        work
    }

    /// The deadline of an async operation queued with `ahead` operations before it: each of them
    /// and this one have their own time-out (and may read a stall report).
    pub(crate) fn work_deadline(&self, ahead: u64) -> Instant {
        // Slack: a second, and the stall report a timed-out operation reads.
        Instant::now()
            + self.timeout * (ahead as u32 + 2)
            + Duration::from_secs(1)
            + crate::stall::READ_BUDGET_MAX
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

    /// `abort()`: fails the running operation (it polls the flag) and every later one.
    pub(crate) fn abort(&self) {
        self.abort.store(true, Ordering::Relaxed);
        if let Some(ch) = self.channels.get() {
            ch.abort();
        }
        if let Ok(mut st) = self.exec.try_lock() {
            let e = Error::Aborted {
                rank: self.rank,
                reason: "abort() was called on this rank".into(),
            };
            self.fail(&mut st, e);
        }
    }
}

/// The end of a turn, also when the operation panics (a bug, or a caller's `AsMut` or hook that
/// panics): the communicator is then broken with `Aborted`, so peers learn at once, and the
/// next ticket may go, instead of every later operation waiting out its deadline for a turn
/// that never ends.
struct TurnEnd<'a> {
    shared: &'a Shared,
    ticket: u64,
    ok: bool,
}

impl Drop for TurnEnd<'_> {
    fn drop(&mut self) {
        let sh = self.shared;
        if std::thread::panicking() {
            sh.break_when_free(Error::Aborted {
                rank: sh.rank,
                reason: "an operation panicked on this rank".into(),
            });
        }
        sh.stalls.operation_ended(self.ok);
        // A later operation may have timed out waiting for this one: break now, so peers learn
        // at once rather than at this rank's next call.
        sh.try_break_if_skipped();
        sh.finish_turn(self.ticket);
    }
}

/// Encodes an error for the store: `kind \n rank \n peer \n seq \n local \n remote \n message`.
fn encode_error(e: &Error) -> Vec<u8> {
    let (rank, peer, seq, local, remote) = match e {
        Error::Mismatch {
            rank,
            peer,
            seq,
            local,
            remote,
        } => (*rank, *peer, *seq, local.clone(), remote.clone()),
        Error::PeerLost {
            rank, peer, detail, ..
        } => (*rank, *peer, 0, String::new(), detail.clone()),
        _ => (0, 0, 0, String::new(), String::new()),
    };
    let clean = |s: String| s.replace('\n', " ");
    format!(
        "{}\n{rank}\n{peer}\n{seq}\n{}\n{}\n{}",
        e.kind(),
        clean(local),
        clean(remote),
        clean(e.to_string())
    )
    .into_bytes()
}

/// Rebuilds a published error as seen from `me`.
fn decode_error(b: &[u8], me: usize) -> Option<Error> {
    let s = std::str::from_utf8(b).ok()?;
    let f: Vec<&str> = s.splitn(7, '\n').collect();
    if f.len() != 7 {
        return None;
    }
    let (rank, peer, seq) = (f[1].parse().ok()?, f[2].parse().ok()?, f[3].parse().ok()?);
    Some(match f[0] {
        "mismatch" => Error::Mismatch {
            rank,
            peer,
            seq,
            local: f[4].into(),
            remote: f[5].into(),
        },
        "peer-lost" => Error::PeerLost {
            rank: me,
            peer,
            op: "collective".into(),
            detail: format!("reported by rank {rank}: {}", f[5]),
        },
        _ => Error::Aborted {
            rank: me,
            reason: format!("another rank failed first: {}", f[6]),
        },
    })
}

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
    pending: Option<(JobSlot, u64, u64)>,
    /// The communicator's world ranks, noted in the errors the handle makes itself.
    world: Option<Arc<WorldNames>>,
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
        crate::error::named(self.world.as_deref(), e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::MemStore;

    fn shared(timeout: Duration) -> (Arc<Shared>, Arc<MemStore>) {
        let store = Arc::new(MemStore::new());
        let cfg = Config {
            timeout,
            ..Config::default()
        };
        let sh = Shared::new(0, 2, false, &cfg, Links::default(), store.clone(), "t");
        (Arc::new(sh), store)
    }

    fn is_turn_timeout(r: &Result<u64>) -> bool {
        matches!(r, Err(Error::Timeout { op, .. }) if op == "waiting for earlier operations")
    }

    /// Runs the first ticket's operation on another thread and holds it there (bounded) until
    /// the returned sender is used; returns once it runs.
    fn hold_first_turn(sh: &Arc<Shared>) -> (Sender<()>, std::thread::JoinHandle<Result<()>>) {
        let (go_tx, go_rx) = crossbeam_channel::bounded::<()>(1);
        let (ran_tx, ran_rx) = crossbeam_channel::bounded::<()>(1);
        let (t0, _) = sh.take_ticket();
        let first = std::thread::spawn({
            let sh = Arc::clone(sh);
            move || {
                sh.run_turn(t0, 0, |st| {
                    let _ = ran_tx.send(());
                    let _ = go_rx.recv_timeout(Duration::from_secs(60));
                    st.coll_seq += 1;
                    Ok(())
                })
            }
        });
        ran_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("first operation runs");
        (go_tx, first)
    }

    /// An operation that times out waiting for its turn never runs: the next one must not take
    /// its sequence number (peers would pair different data), so the communicator breaks and
    /// every later operation reports the time-out.
    #[test]
    fn a_turn_time_out_breaks_the_communicator() {
        let (sh, store) = shared(Duration::from_millis(5));
        let (go_tx, first) = hold_first_turn(&sh);
        let (t1, ahead) = sh.take_ticket();
        let skipped = sh.run_turn(t1, ahead, |st| {
            st.coll_seq += 1;
            Ok(st.coll_seq)
        });
        assert!(is_turn_timeout(&skipped), "{skipped:?}");
        go_tx.send(()).unwrap();
        first
            .join()
            .unwrap()
            .expect("the operation ahead completes");
        // The running operation broke the communicator as it ended: the cause is published.
        assert!(store.try_get("t/error").unwrap().is_some());
        let (t2, ahead) = sh.take_ticket();
        let next = sh.run_turn(t2, ahead, |st| Ok(st.coll_seq));
        assert!(is_turn_timeout(&next), "{next:?}");
    }

    /// A ticket that a later one passed over (it gave up waiting first) fails as soon as it
    /// sees the line has moved past it, instead of waiting out its own deadline.
    #[test]
    fn a_passed_over_ticket_fails_at_once() {
        let (sh, _store) = shared(Duration::from_millis(50));
        let (go_tx, first) = hold_first_turn(&sh);
        let (t1, a1) = sh.take_ticket();
        let (t2, a2) = sh.take_ticket();
        // Ticket 2 starts waiting now (deadline 3 x 50 ms + 1 s); ticket 1 half a second later
        // (deadline 2 x 50 ms + 1 s from then), so ticket 2 gives up first.
        let third = std::thread::spawn({
            let sh = Arc::clone(&sh);
            move || sh.run_turn(t2, a2, |_| Ok(2))
        });
        std::thread::sleep(Duration::from_millis(500));
        let second = sh.run_turn(t1, a1, |_| Ok(1));
        let third = third.join().unwrap();
        assert!(is_turn_timeout(&third), "{third:?}");
        match &second {
            Err(Error::Timeout { detail, .. }) => {
                assert!(detail.contains("a later operation gave up"), "{detail}")
            }
            other => panic!("{other:?}"),
        }
        go_tx.send(()).unwrap();
        first
            .join()
            .unwrap()
            .expect("the running operation completes");
    }

    /// With no operation running when the wait ends, the communicator breaks at once.
    #[test]
    fn a_turn_time_out_with_nothing_running_breaks_at_once() {
        let (sh, store) = shared(Duration::from_millis(5));
        let _never_runs = sh.take_ticket();
        let (t1, ahead) = sh.take_ticket();
        let r = sh.run_turn(t1, ahead, |st| Ok(st.coll_seq));
        assert!(is_turn_timeout(&r), "{r:?}");
        assert!(store.try_get("t/error").unwrap().is_some());
        assert!(lock(&sh.exec).broken.is_some());
    }

    /// Holds the progress thread (after serving its own turn, so later turns are free) until
    /// the returned sender is used or dropped.
    fn hold_progress_thread(sh: &Arc<Shared>) -> Sender<()> {
        let (gate_tx, gate_rx) = crossbeam_channel::bounded::<()>(1);
        let (held_tx, held_rx) = crossbeam_channel::bounded::<()>(1);
        let s = Arc::clone(sh);
        sh.submit_ticketed(move |ticket, ahead| {
            let _ = s.run_turn(ticket, ahead, |_| Ok(()));
            let _ = held_tx.send(());
            let _ = gate_rx.recv_timeout(Duration::from_secs(60));
        });
        held_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the progress thread runs the holding job");
        gate_tx
    }

    /// Queues an operation that appends `tag` and the thread it ran on to `log`.
    fn logged(
        sh: &Arc<Shared>,
        log: &Arc<Mutex<Vec<(u32, std::thread::ThreadId)>>>,
        tag: u32,
    ) -> Work<u32> {
        let log = Arc::clone(log);
        sh.submit_work(
            "logged",
            tag,
            move |_, st, tag| {
                st.coll_seq += 1;
                lock(&log).push((*tag, std::thread::current().id()));
                Ok(())
            },
            |tag| tag,
        )
    }

    /// `wait()` on an operation the progress thread has not taken runs it on the waiting
    /// thread; one the progress thread has finished is only collected.
    #[test]
    fn wait_runs_an_operation_the_progress_thread_has_not_taken() {
        let (sh, _store) = shared(Duration::from_millis(200));
        let log = Arc::new(Mutex::new(Vec::new()));
        let gate = hold_progress_thread(&sh);
        let w = logged(&sh, &log, 1);
        // The progress thread is held: without the waiter running it, this times out.
        assert_eq!(w.wait().expect("runs on the waiting thread"), 1);
        assert_eq!(lock(&log)[0], (1, std::thread::current().id()));
        drop(gate);
        let w = logged(&sh, &log, 2);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !w.is_done() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(w.wait().expect("done on the progress thread"), 2);
        let (tag, thread) = lock(&log)[1];
        assert_eq!(tag, 2);
        assert_ne!(thread, std::thread::current().id());
        sh.stop_worker();
    }

    /// A waiter that takes a later operation still runs it after the earlier ones, which the
    /// progress thread runs once it is free: the order on the wire is the issue order.
    #[test]
    fn a_waiter_keeps_the_turn_order() {
        let (sh, _store) = shared(Duration::from_secs(30));
        let log = Arc::new(Mutex::new(Vec::new()));
        let gate = hold_progress_thread(&sh);
        let first = logged(&sh, &log, 1);
        let second = logged(&sh, &log, 2);
        let parked = Arc::clone(&sh);
        let release = std::thread::spawn(move || {
            // Open the gate once this thread waits for its turn in `second` (it took the job).
            let deadline = Instant::now() + Duration::from_secs(60);
            while lock(&parked.turn).waiters == 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            drop(gate);
        });
        // Taken by this thread, it waits for its turn until the progress thread ran `first`.
        assert_eq!(second.wait().unwrap(), 2);
        assert_eq!(first.wait().unwrap(), 1);
        release.join().unwrap();
        let log = lock(&log).clone();
        assert_eq!(log.iter().map(|e| e.0).collect::<Vec<_>>(), [1, 2]);
        assert_ne!(log[0].1, std::thread::current().id());
        assert_eq!(log[1].1, std::thread::current().id());
        assert_eq!(lock(&sh.exec).coll_seq, 2);
        sh.stop_worker();
    }

    /// Dropping a communicator stops its progress thread; an operation a waiting thread took
    /// over is still running then, and must end before the connections close.
    #[test]
    fn stopping_waits_for_an_operation_a_waiter_runs() {
        let (sh, _store) = shared(Duration::from_secs(30));
        let gate = hold_progress_thread(&sh);
        let (started_tx, started_rx) = crossbeam_channel::bounded::<()>(1);
        let done = Arc::new(AtomicBool::new(false));
        let finished = Arc::clone(&done);
        let w = sh.submit_work(
            "slow",
            (),
            move |_, _, _| {
                let _ = started_tx.send(());
                std::thread::sleep(Duration::from_millis(100));
                finished.store(true, Ordering::SeqCst);
                Ok(())
            },
            |b| b,
        );
        let waiter = std::thread::spawn(move || w.wait());
        // The progress thread is held, so the waiter is the one running it.
        started_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the waiter runs the operation");
        drop(gate);
        sh.stop_worker();
        assert!(
            done.load(Ordering::SeqCst),
            "stop_worker returned while the operation was running"
        );
        waiter.join().unwrap().unwrap();
    }

    /// An operation that panics (here on the thread that waits for it) still ends its turn:
    /// the next operation fails at once with the cause instead of waiting out its deadline.
    #[test]
    fn a_panicking_operation_breaks_the_communicator_and_ends_its_turn() {
        let (sh, store) = shared(Duration::from_secs(2));
        let w = sh.submit_work(
            "boom",
            (),
            |_, _, _| -> Result<()> { panic!("a bug in an operation") },
            |b| b,
        );
        let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.wait()));
        // Run on this thread (the panic reaches the caller) or on the progress thread (its
        // result channel is dropped): either way an error, never a result.
        assert!(!matches!(waited, Ok(Ok(()))), "{waited:?}");
        let (t, ahead) = sh.take_ticket();
        let next = sh.run_turn(t, ahead, |_| Ok(()));
        match &next {
            Err(Error::Aborted { reason, .. }) => assert!(reason.contains("panicked"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert!(store.try_get("t/error").unwrap().is_some());
        sh.stop_worker();
    }

    #[test]
    fn errors_survive_the_store() {
        let e = Error::Mismatch {
            rank: 1,
            peer: 2,
            seq: 9,
            local: "a\nb".into(),
            remote: "c".into(),
        };
        match decode_error(&encode_error(&e), 5).unwrap() {
            Error::Mismatch {
                rank,
                peer,
                seq,
                local,
                remote,
            } => {
                assert_eq!(
                    (rank, peer, seq, local.as_str(), remote.as_str()),
                    (1, 2, 9, "a b", "c")
                )
            }
            other => panic!("{other:?}"),
        }
        let e = Error::PeerLost {
            rank: 3,
            peer: 2,
            op: "x".into(),
            detail: "eof".into(),
        };
        assert_eq!(
            decode_error(&encode_error(&e), 0).unwrap().lost_peer(),
            Some(2)
        );
        let e = Error::Timeout {
            rank: 3,
            op: "x".into(),
            timeout: Duration::from_secs(1),
            detail: "d".into(),
        };
        assert!(matches!(
            decode_error(&encode_error(&e), 0).unwrap(),
            Error::Aborted { rank: 0, .. }
        ));
        assert!(decode_error(b"junk", 0).is_none());
    }

    #[test]
    fn a_groups_reports_carry_the_note_once_and_its_stored_cause_none() {
        let store = Arc::new(MemStore::new());
        let cfg = Config {
            timeout: Duration::from_secs(5),
            ..Config::default()
        };
        let mut sh = Shared::new(0, 2, false, &cfg, Links::default(), store.clone(), "t");
        sh.world = WorldNames::new("t", "w", &[3, 1]).map(Arc::new);
        let sh = Arc::new(sh);
        let note = "(ranks named here are of communicator t; its ranks 0-1 are ranks [3, 1] of w)";
        let run = |f: fn() -> Error| {
            let (t, ahead) = sh.take_ticket();
            sh.run_turn(t, ahead, |_| -> Result<()> { Err(f()) })
                .unwrap_err()
                .to_string()
        };
        let first = run(|| Error::PeerLost {
            rank: 0,
            peer: 1,
            op: "all-reduce".into(),
            detail: "EOF".into(),
        });
        assert!(first.ends_with(note), "{first}");
        // The broken state answers every later call, noted once.
        let later = run(|| unreachable!("a broken communicator runs nothing"));
        assert_eq!(later, first);
        // What peers read, and the state kept, have no note: each reader notes it itself.
        let stored = String::from_utf8(store.try_get("t/error").unwrap().unwrap()).unwrap();
        assert!(!stored.contains("ranks named here"), "{stored}");
        let kept = lock(&sh.exec).broken.clone().unwrap().to_string();
        assert!(!kept.contains("ranks named here"), "{kept}");
    }
}
