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

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub(crate) mod channels;
pub(crate) mod exec;
mod failure;
pub(crate) mod p2p;
mod queue;
#[cfg(test)]
mod tests;
mod work;

pub use work::Work;

/// A communicator's engine, owned: its shared state (which operations in flight and the
/// progress thread reach through `Arc`s), torn down when the owner goes: the progress thread
/// stopped once queued operations had their turn, the connections closed (peers see a goodbye,
/// not a lost rank), the flight record written where `OXCCL_TRACE_DIR` says.
pub(crate) struct Engine(Arc<Shared>);

impl Engine {
    pub(crate) fn new(shared: Shared) -> Engine {
        Engine(Arc::new(shared))
    }
}

impl std::ops::Deref for Engine {
    type Target = Arc<Shared>;

    fn deref(&self) -> &Arc<Shared> {
        &self.0
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.0.stop_worker();
        let mut st = lock(&self.0.exec);
        st.links.close(Instant::now() + Duration::from_secs(5));
        self.0.trace.dump_if_set("closed", st.broken.as_ref());
    }
}

use crate::algorithm::prims::{Links, NodeLayout};
use crate::base::bootstrap::Store;
use crate::base::config::Config;
use crate::base::error::{Error, Result, WorldNames};
use crate::base::op::Collective;
use crate::base::stall::Stalls;
use crate::base::trace::{Owner, Recorder};
use crate::base::tuning::{self, AlgoOverride};

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
    /// The tag of the last collective this rank started: a mismatch another rank published is
    /// told from this rank's point of view with it.
    pub current: Option<crate::base::op::Tag>,
    /// The tuner's last choice and what it was asked (collective, bytes, capabilities): a
    /// training loop repeats its calls, and the tuner's cost model takes hundreds of
    /// instructions (its overrides and thresholds are the communicator's, fixed).
    pub last_choice: Option<(Collective, usize, tuning::Caps, tuning::Choice)>,
    /// Small all-gathers (`[0]`) and all-reduces (`[1]`) to run without trying the mapped path,
    /// since the last try found a buffer that was not registered (see `tuning::MAPPED_RETRY`);
    /// the same on every rank, which all see the same outcome of every try.
    pub mapped_skip: [u32; 2],
}

/// The line of turns: tickets are taken and turns passed on without a lock; a thread whose
/// turn has not come sleeps on `cv` (counted in `waiters`, so that passing a turn takes the
/// lock and notifies only when someone sleeps).
struct Turns {
    next_ticket: AtomicU64,
    serving: AtomicU64,
    waiters: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

/// Longest wait for the store while publishing a failure.
const PUBLISH_BUDGET: Duration = Duration::from_secs(3);

/// Where a communicator publishes its failure, and the cause once it has one
/// ([`Shared::failures`]).
pub(crate) type Failures = (String, Arc<Mutex<Option<Error>>>);

/// A communicator's reusable scratch ([`Shared::scratch`]).
pub(crate) type Scratch = Mutex<Vec<u64>>;

/// What the operations of one communicator share.
pub(crate) struct Shared {
    pub rank: usize,
    pub size: usize,
    pub timeout: Duration,
    pub algo: AlgoOverride,
    /// Waiting ranks busy-poll before yielding (off when ranks outnumber cores).
    pub spin: bool,
    /// The thread large sends to TCP peers go out on (`OXCCL_SOCKET_SEND_THREAD`).
    pub send_thread: Option<crate::algorithm::prims::SendThread>,
    /// The extra channels large all-reduces, broadcasts and reduces are cut across
    /// (`OXCCL_SOCKET_CHANNELS`; set once at init, after the communicator's own connections).
    pub channels: std::sync::OnceLock<crate::engine::channels::Channels>,
    /// The ranks by node, when the communicator spans nodes of at least two ranks each
    /// (hierarchical algorithms).
    pub layout: Option<NodeLayout>,
    /// Some ranks of the communicator reach each other over TCP (the same on every rank; the
    /// tuner's [`crate::base::tuning::Caps::sockets`]).
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
    /// its parent's, `crate::engine::channels`).
    error_key: String,
    /// The cause this rank published or adopted, once it has ([`Shared::publish_error`]);
    /// shared with the communicator's channels, which publish under its key (`crate::engine::channels`),
    /// so every part of a cut operation on this rank reports one cause, with its own type.
    published: Arc<Mutex<Option<Error>>>,
    /// On a channel running its part of a cut operation: the channel's index and the parent's
    /// operation number and call, so a mismatch it finds is published as the caller's
    /// (`crate::engine::channels`).
    pub cut_call: Mutex<Option<(usize, u64, String)>>,
    turn: Turns,
    /// The line of async operations and the progress thread.
    queue: Arc<queue::WorkQueue>,
    /// The communicator's reusable scratch (8-byte aligned words) for out-of-place
    /// reduce-scatter inputs and partial results, so a call does not allocate and fault in a
    /// fresh buffer every time; here rather than in each async operation's closure, which
    /// would count a reference to it up and down per operation.
    pub scratch: Scratch,
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
                current: None,
                last_choice: None,
                mapped_skip: [0; 2],
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
            turn: Turns {
                next_ticket: AtomicU64::new(0),
                serving: AtomicU64::new(0),
                waiters: AtomicUsize::new(0),
                lock: Mutex::new(()),
                cv: Condvar::new(),
            },
            queue: Arc::new(queue::WorkQueue::new(rank)),
            scratch: Mutex::new(Vec::new()),
        }
    }

    /// Takes the next place in line; returns it and how many operations are ahead.
    pub(crate) fn take_ticket(&self) -> (u64, u64) {
        let ticket = self.turn.next_ticket.fetch_add(1, Ordering::SeqCst);
        let serving = self.turn.serving.load(Ordering::SeqCst);
        (ticket, ticket.saturating_sub(serving))
    }

    /// Waits for `ticket`'s turn, runs `f` on the execution state, then lets the next one go.
    pub(crate) fn run_turn<R>(
        &self,
        ticket: u64,
        ahead: u64,
        f: impl FnOnce(&mut ExecState) -> Result<R>,
    ) -> Result<R> {
        if self.turn.serving.load(Ordering::SeqCst) != ticket {
            self.wait_turn(ticket, ahead)?;
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

    /// Waits (out of line: an operation's turn has mostly come when it runs) until `ticket` is
    /// served; a time-out, or a later ticket that gave up first, breaks the communicator (the
    /// error is named, as [`Shared::run_turn`] returns it).
    #[cold]
    #[inline(never)]
    fn wait_turn(&self, ticket: u64, ahead: u64) -> Result<()> {
        let deadline = Instant::now() + self.timeout * (ahead as u32 + 1) + Duration::from_secs(1);
        let mut t = self.turns_held();
        loop {
            let serving = self.turn.serving.load(Ordering::SeqCst);
            if serving == ticket {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            // A later ticket that gave up first moved the line past this one: it cannot
            // come, and the communicator is broken already.
            let passed = serving > ticket;
            if left.is_zero() || passed {
                // This operation never runs: peers would pair its sequence number with the
                // next one's data. Like NCCL after a time-out, the communicator is unusable
                // from here on (every later operation fails with this error); give up our
                // place so the line keeps moving.
                drop(t);
                self.turn.waiters.fetch_sub(1, Ordering::SeqCst);
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
        drop(t);
        self.turn.waiters.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }

    /// `e` as this rank reports it: with the world ranks of the ranks it names, for a
    /// communicator made from another (the cause stays as it is where it is published and kept,
    /// so each report is noted once).
    pub(crate) fn named(&self, e: Error) -> Error {
        crate::base::error::named(self.world.as_deref(), e)
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
    #[inline]
    fn try_break_if_skipped(&self) {
        if self.skipped_set.load(Ordering::SeqCst) {
            self.try_break_skipped();
        }
    }

    /// [`Shared::try_break_if_skipped`] once an operation was skipped.
    #[cold]
    fn try_break_skipped(&self) {
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
    #[inline]
    fn break_if_skipped(&self, st: &mut ExecState) {
        if self.skipped_set.load(Ordering::SeqCst) {
            self.break_skipped(st);
        }
    }

    /// [`Shared::break_if_skipped`] once an operation was skipped.
    #[cold]
    fn break_skipped(&self, st: &mut ExecState) {
        if let Some(e) = lock(&self.skipped).take() {
            self.fail(st, e);
        }
    }

    /// The lock of the line of turns, held by a thread counted in `waiters` (it must undo the
    /// count when it is done waiting): whatever it reads of the line under the lock, a turn
    /// passed on after that notifies it.
    fn turns_held(&self) -> MutexGuard<'_, ()> {
        let t = lock(&self.turn.lock);
        self.turn.waiters.fetch_add(1, Ordering::SeqCst);
        t
    }

    /// Waits at most `left` for the line of turns to move (the lock taken with
    /// [`Shared::turns_held`]).
    fn wait_for_turns<'t>(&self, t: MutexGuard<'t, ()>, left: Duration) -> MutexGuard<'t, ()> {
        self.turn
            .cv
            .wait_timeout(t, left)
            .unwrap_or_else(|p| p.into_inner())
            .0
    }

    fn finish_turn(&self, ticket: u64) {
        // Tickets that timed out waiting skip ahead; never move backwards.
        self.turn.serving.fetch_max(ticket + 1, Ordering::SeqCst);
        // SeqCst with the count and the read in `run_turn`: a waiter that read the old value
        // counted itself first, so it is seen here and notified once it sleeps.
        if self.turn.waiters.load(Ordering::SeqCst) > 0 {
            let _t = lock(&self.turn.lock);
            self.turn.cv.notify_all();
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
