//! The launchers of a multi-node job keep in touch through the store node 0 hosts, as
//! torchrun's agents do through their rendezvous: a failure on one node stops (or, with
//! `--max-restarts`, restarts) the ranks of every node, and node 0 keeps the store up until
//! every node is done.
//!
//! Keys, under `<job id base>/launch/`:
//!
//! | key | written | by | read by |
//! |---|---|---|---|
//! | `fail/<a>` | once per attempt `a`, compare-and-set, so the first failure wins: `node`, exit code and text, one per line | the node whose ranks failed, timed out or were interrupted in attempt `a` | every launcher in attempt `a`, every [`POLL`] |
//! | `end/<a>/<k>` | when node `k`'s ranks of attempt `a` are all gone (after its `fail/<a>` if they failed) | node `k` | nodes whose ranks succeeded in attempt `a`: the attempt succeeded once every node's end is there without a failure |
//! | `done/<k>` | when node `k`'s launcher is about to exit | node `k` | node 0, before it stops the store |
//! | `beat/<k>` | a counter, every [`BEAT`] | node `k` | node 0, to stop waiting for a node whose launcher is gone |
//!
//! Every request has a reply time-out of [`REQUEST_TIMEOUT`], so a silent store (a cut link)
//! never holds a launcher for long.

use std::collections::HashMap;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use oxccl_comm::bootstrap::{Store, TcpStore};

use super::proc::SupervisorCtx;
use super::{signal_name, NodeFailure};

/// How often a launcher looks for a failure reported by another node.
pub(super) const POLL: Duration = Duration::from_millis(200);
/// How often a launcher tells node 0 it is alive.
pub(super) const BEAT: Duration = Duration::from_secs(1);
/// Reply time-out of every store request of the launchers.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Node 0's store refusing connections for this long, after it had been reached: nothing listens
/// on its port any more, so node 0's launcher is gone, and the ranks of this node are stopped.
const STORE_REFUSED_AFTER: Duration = Duration::from_secs(3);
/// Node 0's store silent (requests time out) for this long: node 0 is taken for lost too. Longer
/// than a cut link needs to fail the ranks on their own (`OXCCL_TIMEOUT` of the tests), so they
/// report their own errors first.
const STORE_SILENT_AFTER: Duration = Duration::from_secs(60);
/// Node 0 stops waiting for a node whose launcher has not beaten for this long.
const NODE_SILENT_AFTER: Duration = Duration::from_secs(30);
/// How long a launcher that has not reached the store yet tries to, to report its end.
const PUBLISH_CONNECT: Duration = Duration::from_secs(10);
/// How long each connection attempt of the watcher lasts before it checks whether to stop.
const CONNECT_TRY: Duration = Duration::from_secs(1);
/// The attempt number under which the loss of node 0 is recorded: it ends every attempt.
const LOST: u32 = u32::MAX;
/// Node 0 says why it has not exited yet once it has waited this long for the other nodes.
const WAIT_NOTE_AFTER: Duration = Duration::from_secs(2);

/// The store keys of one job.
struct Keys {
    base: String,
}

impl Keys {
    fn fail(&self, attempt: u32) -> String {
        format!("{}/launch/fail/{attempt}", self.base)
    }
    fn end(&self, attempt: u32, node: usize) -> String {
        format!("{}/launch/end/{attempt}/{node}", self.base)
    }
    fn done(&self, node: usize) -> String {
        format!("{}/launch/done/{node}", self.base)
    }
    fn beat(&self, node: usize) -> String {
        format!("{}/launch/beat/{node}", self.base)
    }
}

impl NodeFailure {
    fn encode(&self) -> Vec<u8> {
        format!("{}\n{}\n{}", self.node, self.exit_code, self.what).into_bytes()
    }

    fn decode(v: &[u8]) -> Option<NodeFailure> {
        let s = String::from_utf8_lossy(v);
        let mut parts = s.splitn(3, '\n');
        let node = parts.next()?.parse().ok()?;
        let exit_code = parts.next()?.parse().ok()?;
        let what = parts.next()?.to_owned();
        Some(NodeFailure {
            node,
            exit_code,
            what,
        })
    }
}

/// What the watcher thread and the supervising thread share.
struct Shared {
    stop: AtomicBool,
    store: OnceLock<Arc<TcpStore>>,
    /// The job token the store requires (`OXCCL_JOB_TOKEN`), if any.
    token: Option<String>,
    /// The attempt this node's ranks are in (0, then 1 after the first restart, ...).
    attempt: AtomicU32,
    /// When the watcher last got an answer from the store (node 0's launcher hosts it).
    last_answer: Mutex<Option<Instant>>,
    /// The first failure seen on another node in an attempt, or the loss of node 0 (attempt
    /// [`LOST`]: it ends every attempt from then on).
    failure: Mutex<Option<(u32, NodeFailure)>>,
}

impl Shared {
    fn note_failure(&self, attempt: u32, f: NodeFailure) {
        let mut slot = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if slot.as_ref().is_none_or(|(a, _)| *a < attempt) {
            *slot = Some((attempt, f));
        }
    }
}

/// How a wait for the other nodes ended.
pub(super) enum NodesEnd {
    /// Every other node reported its end.
    AllDone,
    /// Another node recorded a failure in this attempt (or node 0 was lost).
    Failed(NodeFailure),
    /// These nodes' launchers stopped beating before they reported their end.
    Silent(Vec<usize>),
    /// The launcher received this signal meanwhile.
    Interrupted(libc::c_int),
    /// `--timeout` expired meanwhile.
    TimedOut,
}

/// What the waits have heard of the other nodes' launchers, kept from one wait to the next.
#[derive(Default)]
struct Heard {
    /// Per node: the last beat value seen and when it last changed.
    beats: HashMap<usize, (Option<Vec<u8>>, Instant)>,
    /// Nodes whose launchers were silent for [`NODE_SILENT_AFTER`]: no longer waited for.
    gone: Vec<usize>,
}

/// One launcher's link to the others: a watcher thread polling the store, and the requests
/// made when this node's ranks are done.
pub(super) struct NodeLink {
    node: usize,
    nnodes: usize,
    host: String,
    port: u16,
    keys: Arc<Keys>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    heard: Mutex<Heard>,
}

impl NodeLink {
    /// Starts the watcher of node `node` of `nnodes`, for the store at `host:port` (node 0's
    /// own server on node 0). Never blocks: the watcher connects in the background.
    pub(super) fn start(
        node: usize,
        nnodes: usize,
        host: String,
        port: u16,
        job_base: &str,
        token: Option<String>,
    ) -> std::io::Result<NodeLink> {
        let keys = Arc::new(Keys {
            base: job_base.to_owned(),
        });
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            store: OnceLock::new(),
            token,
            attempt: AtomicU32::new(0),
            last_answer: Mutex::new(None),
            failure: Mutex::new(None),
        });
        let thread = {
            let (keys, shared, host) = (Arc::clone(&keys), Arc::clone(&shared), host.clone());
            thread::Builder::new()
                .name("oxccl-launch-nodes".into())
                .spawn(move || watch(&shared, &keys, node, &host, port))?
        };
        Ok(NodeLink {
            node,
            nnodes,
            host,
            port,
            keys,
            shared,
            thread: Some(thread),
            heard: Mutex::new(Heard::default()),
        })
    }

    /// The first failure another node reported in the current attempt (or the loss of node 0),
    /// if any yet.
    pub(super) fn failure(&self) -> Option<NodeFailure> {
        let now = self.shared.attempt.load(Ordering::SeqCst);
        let slot = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        slot.as_ref()
            .filter(|(a, _)| *a == now || *a == LOST)
            .map(|(_, f)| f.clone())
    }

    /// Whether node 0's launcher is gone (its store stopped answering).
    pub(super) fn lost_node_0(&self) -> bool {
        let slot = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        slot.as_ref().is_some_and(|(a, _)| *a == LOST)
    }

    /// This node's ranks start attempt `attempt` (after a restart): from now on the watcher
    /// looks for that attempt's failure.
    pub(super) fn start_attempt(&self, attempt: u32) {
        self.shared.attempt.store(attempt, Ordering::SeqCst);
    }

    /// Records this node's failure in the current attempt (exit code and what happened), unless
    /// another node's came first: the other nodes stop (or restart) their ranks. Bounded by
    /// [`REQUEST_TIMEOUT`].
    pub(super) fn record_failure(&self, exit_code: i32, what: String) {
        if self.lost_node_0() {
            return; // node 0 is gone: nobody to tell
        }
        let Some(store) = self.store() else {
            return;
        };
        let attempt = self.shared.attempt.load(Ordering::SeqCst);
        let f = NodeFailure {
            node: self.node,
            exit_code,
            what,
        };
        if let Err(e) = store.compare_set(&self.keys.fail(attempt), None, &f.encode()) {
            note!("cannot tell the other nodes about this node's failure: {e}");
        }
    }

    fn addr(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The watcher's connection, or a new one made within [`PUBLISH_CONNECT`].
    fn store(&self) -> Option<Arc<TcpStore>> {
        if let Some(s) = self.shared.store.get() {
            return Some(Arc::clone(s));
        }
        match TcpStore::connect_with_token(
            &self.host,
            self.port,
            PUBLISH_CONNECT,
            self.shared.token.as_deref(),
        ) {
            Ok(s) => {
                Some(Arc::clone(self.shared.store.get_or_init(|| {
                    Arc::new(s.with_op_timeout(REQUEST_TIMEOUT))
                })))
            }
            Err(e) => {
                note!(
                    "cannot reach the store of node 0 at {} to tell the other nodes this node's \
                     ranks are done: {e}",
                    self.addr()
                );
                None
            }
        }
    }

    /// Reports that this node's launcher is about to exit. Bounded by [`REQUEST_TIMEOUT`].
    pub(super) fn publish_done(&self) {
        // Node 0 may stop its store as soon as it has every end: the watcher must not take that
        // for a loss.
        self.shared.stop.store(true, Ordering::SeqCst);
        if self.lost_node_0() {
            return;
        }
        let Some(store) = self.store() else {
            return;
        };
        if let Err(e) = store.set(&self.keys.done(self.node), b"1") {
            note!("cannot tell node 0 this node's ranks are done: {e}");
        }
    }

    /// This node's ranks of the current attempt are all gone (after [`record_failure`] if one
    /// of them failed): the nodes waiting for the attempt's outcome see it.
    ///
    /// [`record_failure`]: NodeLink::record_failure
    pub(super) fn end_attempt(&self) {
        let attempt = self.shared.attempt.load(Ordering::SeqCst);
        if self.lost_node_0() {
            return;
        }
        if let Some(store) = self.store() {
            if let Err(e) = store.set(&self.keys.end(attempt, self.node), b"1") {
                note!("cannot tell the other nodes this node's ranks are done: {e}");
            }
        }
    }

    /// Once this node's ranks of the current attempt all succeeded: waits for the attempt's
    /// outcome, that is until every other node's ranks are done too ([`NodesEnd::AllDone`]) or
    /// one node reports a failure in this attempt ([`NodesEnd::Failed`]: the job restarts or
    /// ends with it).
    pub(super) fn wait_attempt(&self, ctx: &SupervisorCtx<'_>) -> NodesEnd {
        let attempt = self.shared.attempt.load(Ordering::SeqCst);
        self.wait_nodes(ctx, |k| self.keys.end(attempt, k), Some(attempt), "finish")
    }

    /// Node 0, before it exits: keeps the store up until every other node's launcher has
    /// published its end (their ranks may still need the store).
    pub(super) fn wait_for_nodes(&self, ctx: &SupervisorCtx<'_>) -> NodesEnd {
        self.wait_nodes(ctx, |k| self.keys.done(k), None, "exit")
    }

    /// Waits until `key(k)` is set for every other node `k`, giving up on a node whose
    /// launcher has been silent for [`NODE_SILENT_AFTER`]; with `attempt`, a failure another
    /// node records in it ends the wait. A signal or `--timeout` ends it too. `what` the other
    /// nodes are waited to do, for the note printed after [`WAIT_NOTE_AFTER`].
    fn wait_nodes(
        &self,
        ctx: &SupervisorCtx<'_>,
        key: impl Fn(usize) -> String,
        attempt: Option<u32>,
        what: &str,
    ) -> NodesEnd {
        let start = Instant::now();
        let mut heard = self.heard.lock().unwrap_or_else(|p| p.into_inner());
        // Nodes found silent in an earlier wait are not waited for again.
        let mut silent = heard.gone.clone();
        let mut pending: Vec<usize> = (0..self.nnodes)
            .filter(|&k| k != self.node && !silent.contains(&k))
            .collect();
        let mut told = false;
        let Some(store) = self.store() else {
            return NodesEnd::AllDone;
        };
        let failed = || {
            let a = attempt?;
            if let Some(f) = self.failure() {
                return Some(f);
            }
            let v = store.try_get(&self.keys.fail(a)).ok()??;
            NodeFailure::decode(&v).filter(|f| f.node != self.node)
        };
        loop {
            if let Some(sig) = ctx.take_signal() {
                note!(
                    "received {}; not waiting for nodes {pending:?} any longer",
                    signal_name(sig).unwrap_or("a signal")
                );
                return NodesEnd::Interrupted(sig);
            }
            if ctx.deadline.is_some_and(|d| Instant::now() >= d) {
                note!("time-out reached while waiting for nodes {pending:?} to {what}");
                return NodesEnd::TimedOut;
            }
            if let Some(f) = failed() {
                return NodesEnd::Failed(f);
            }
            pending.retain(|&k| !matches!(store.try_get(&key(k)), Ok(Some(_))));
            let now = Instant::now();
            // Node 0 hosts the store: it has been heard from when the store last answered.
            let store_answered = *self
                .shared
                .last_answer
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            pending.retain(|&k| {
                let first = match store_answered {
                    Some(t) if k == 0 => t.min(start),
                    _ => start,
                };
                let (last, since) = heard.beats.entry(k).or_insert((None, first));
                if let Ok(Some(v)) = store.try_get(&self.keys.beat(k)) {
                    if last.as_deref() != Some(v.as_slice()) {
                        *last = Some(v);
                        *since = now;
                    }
                }
                if now.saturating_duration_since(*since) < NODE_SILENT_AFTER {
                    return true;
                }
                note!(
                    "the launcher of node {k} has not been heard from for {}s; not waiting for \
                     it any longer",
                    NODE_SILENT_AFTER.as_secs()
                );
                silent.push(k);
                heard.gone.push(k);
                false
            });
            if pending.is_empty() {
                // A failing node records its failure before its end: one more look.
                return match (failed(), silent.is_empty()) {
                    (Some(f), _) => NodesEnd::Failed(f),
                    (None, true) => NodesEnd::AllDone,
                    (None, false) => NodesEnd::Silent(silent),
                };
            }
            if !told && start.elapsed() >= WAIT_NOTE_AFTER {
                if attempt.is_some() {
                    note!("this node's ranks are done; waiting for nodes {pending:?} to finish");
                } else {
                    note!(
                        "keeping the store up until the launchers of nodes {pending:?} exit \
                         too"
                    );
                }
                told = true;
            }
            thread::sleep(POLL);
        }
    }
}

impl Drop for NodeLink {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            // The watcher sleeps at most POLL between looks, but a request to a silent store can
            // take up to REQUEST_TIMEOUT: wait a little, then leave it to end on its own.
            let deadline = Instant::now() + POLL * 5;
            while !t.is_finished() && Instant::now() < deadline {
                thread::sleep(Duration::from_millis(5));
            }
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

/// The watcher: connects (retrying until stopped), then beats and looks for failures of other
/// nodes; on node `k > 0`, a store that refuses connections for [`STORE_REFUSED_AFTER`] or does
/// not answer for [`STORE_SILENT_AFTER`] is reported as the loss of node 0.
fn watch(shared: &Shared, keys: &Keys, node: usize, host: &str, port: u16) {
    let stopped = || shared.stop.load(Ordering::SeqCst);
    let store = loop {
        if let Some(s) = shared.store.get() {
            break Arc::clone(s);
        }
        if stopped() {
            return;
        }
        match TcpStore::connect_with_token(host, port, CONNECT_TRY, shared.token.as_deref()) {
            Ok(s) => {
                break Arc::clone(
                    shared
                        .store
                        .get_or_init(|| Arc::new(s.with_op_timeout(REQUEST_TIMEOUT))),
                )
            }
            Err(e) => tracing::debug!("oxccl launch: store not reachable yet: {e}"),
        }
    };
    tracing::debug!(
        node,
        "oxccl launch: watching the other nodes through the store"
    );
    // Since when requests have failed, and since when connections have been refused.
    let mut failing_since: Option<Instant> = None;
    let mut refused_since: Option<Instant> = None;
    let mut next_beat = Instant::now();
    while !stopped() {
        let attempt = shared.attempt.load(Ordering::SeqCst);
        let res = (|| {
            if Instant::now() >= next_beat {
                store.add(&keys.beat(node), 1)?;
                next_beat = Instant::now() + BEAT;
            }
            store.try_get(&keys.fail(attempt))
        })();
        match res {
            Ok(v) => {
                failing_since = None;
                refused_since = None;
                *shared.last_answer.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(Instant::now());
                if let Some(f) = v.as_deref().and_then(NodeFailure::decode) {
                    if f.node != node {
                        shared.note_failure(attempt, f);
                    }
                }
            }
            Err(e) => {
                let since = *failing_since.get_or_insert_with(Instant::now);
                tracing::debug!("oxccl launch: store request failed: {e}");
                if refused(host, port) {
                    refused_since.get_or_insert_with(Instant::now);
                } else {
                    refused_since = None;
                }
                let lost = if refused_since.is_some_and(|t| t.elapsed() >= STORE_REFUSED_AFTER) {
                    Some(format!(
                        "nothing listens on its store's port ({host}:{port}) any more"
                    ))
                } else if since.elapsed() >= STORE_SILENT_AFTER {
                    Some(format!(
                        "its store has not answered for {}s ({e})",
                        STORE_SILENT_AFTER.as_secs()
                    ))
                } else {
                    None
                };
                if let (Some(why), true) = (lost, node != 0) {
                    shared.note_failure(
                        LOST,
                        NodeFailure {
                            node: 0,
                            exit_code: 1,
                            what: format!("its launcher is gone: {why}"),
                        },
                    );
                }
            }
        }
        thread::sleep(POLL);
    }
}

/// Whether a new connection to `host:port` is refused: nothing listens there.
fn refused(host: &str, port: u16) -> bool {
    let Ok(mut addrs) = (host, port).to_socket_addrs() else {
        return false;
    };
    addrs.next().is_some_and(|a| {
        matches!(
            TcpStream::connect_timeout(&a, CONNECT_TRY),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_round_trip_through_their_encoding() {
        let f = NodeFailure {
            node: 3,
            exit_code: 137,
            what: "rank 7 (pid 12) failed: killed by signal 9 (SIGKILL)\nsecond line".into(),
        };
        assert_eq!(NodeFailure::decode(&f.encode()), Some(f));
        assert_eq!(NodeFailure::decode(b"x\n1\nwhat"), None);
        assert_eq!(NodeFailure::decode(b"1\n2"), None);
    }
}
