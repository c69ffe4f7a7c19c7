//! The communicator: a group of ranks that run collectives together.
//!
//! Created (in `init.rs`) from launcher variables ([`Communicator::from_env`]), explicitly
//! ([`Communicator::init`]), by splitting another one ([`Communicator::split`]), or by changing
//! another one's ranks ([`Communicator::shrink`], [`Communicator::grow`], in `elastic.rs`).
//! Creating one is collective: every rank publishes its address in the store, reads everyone
//! else's, and opens its connections. The calls themselves are in `api/buffers.rs` (the one
//! dispatch) and `api/collectives/`.

mod init;
mod rendezvous;

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::base::affinity::NodeShare;
use crate::base::bootstrap::{Store, TcpStoreServer};
use crate::base::config::Config;
use crate::base::error::{Result, WorldNames};
use crate::base::trace::TraceDump;
use crate::engine::Engine;
use crate::transport::{PeerInfo, Selector};

/// Counters and tuning diagnostics of a communicator ([`Communicator::stats`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// The transport that carries host memory to each rank (`"shm"`, `"tcp"`; `"self"` for this
    /// rank), as the selector chose it at init.
    pub transports: Vec<&'static str>,
    /// Whether this rank's waits busy-poll before they yield the core (`OXCCL_SPIN`,
    /// [`Config::spin`], `auto` resolved at init).
    pub spins: bool,
    /// Channels this communicator runs (`OXCCL_SOCKET_CHANNELS`, [`Config::socket_channels`],
    /// `auto` resolved at init): 1 without TCP peers.
    pub channels: usize,
    /// Operations (all-reduce, broadcast, reduce) cut across the channels so far, or `None`
    /// without channels (one asked for, or no TCP peers).
    pub channel_ops: Option<u64>,
    /// Exchanges whose large messages to TCP peers went out on this rank's send thread so far
    /// (`OXCCL_SOCKET_SEND_THREAD`, [`Config::socket_send_thread`]), or `None` without one.
    pub send_thread_exchanges: Option<u64>,
    /// This rank's node as the `auto` rules (`OXCCL_SPIN`, `OXCCL_SOCKET_SEND_THREAD`,
    /// `OXCCL_SOCKET_CHANNELS`) counted it at init: the CPUs its ranks may use together and the
    /// ranks sharing them, the parent's counts included for a communicator made from another.
    pub node: NodeShare,
    /// This process's CPU count at init (what [`Stats::node_holds`] counts where a rank's CPU
    /// list is unknown).
    pub cores: usize,
    /// Bytes this rank sent straight from [`crate::Registered`] buffers so far (RDMA writes
    /// from the buffer itself, no copy into a slot); 0 without such a transport.
    pub registered_bytes: u64,
    /// Bytes peers wrote straight into this rank's [`crate::Registered`] buffers so far (RDMA's
    /// rendezvous: a message received into a registered buffer is offered to its sender, which
    /// writes it there instead of into a slot it would be copied out of; and the `mapped`
    /// all-gather and all-reduce over shared memory, whose ranks write into each other's
    /// buffers); 0 without such a transport.
    pub registered_recv_bytes: u64,
    /// How device collectives run: `Some("cuda_ipc")`, `Some("staged")` (through pinned host
    /// memory), or `None` before the first one decided it.
    #[cfg(feature = "cuda-core")]
    pub device_path: Option<&'static str>,
}

impl Stats {
    /// Whether this rank's node has `per_rank` CPUs for each of its ranks, as the `auto` rules
    /// counted them at init: 1 is what `OXCCL_SPIN=auto` asks, 2 what
    /// `OXCCL_SOCKET_SEND_THREAD=auto` and DDP's `Overlap::Auto` ask (a CPU to spare beside the
    /// rank's own thread).
    pub fn node_holds(&self, per_rank: usize) -> bool {
        self.node.holds(per_rank, self.cores)
    }
}

/// A group of ranks that run collectives together. `Send + Sync`: share it by reference (or in an
/// `Arc`) between threads; operations are run in the order they are issued.
pub struct Communicator {
    /// The engine: declared first, so it is torn down (progress thread stopped, connections
    /// closed) before the device state and the store server go.
    pub(crate) shared: Engine,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    local_rank: usize,
    local_size: usize,
    pub(crate) node_id: String,
    node_index: usize,
    pub(crate) peers: Vec<PeerInfo>,
    pub(crate) id: String,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) store_host: Option<IpAddr>,
    pub(crate) cfg: Config,
    /// The transport selector: which backend connects each pair of ranks (device collectives
    /// ask it at their first call).
    #[cfg_attr(not(feature = "cuda-core"), allow(dead_code))]
    pub(crate) selector: Selector,
    splits: AtomicU64,
    pub(crate) shrinks: AtomicU64,
    pub(crate) grows: AtomicU64,
    /// Store key prefix under which `grow` offers places to joining processes: the job id
    /// (`from_env`) or `oxccl` (`init`); children inherit it.
    pub(crate) join_prefix: String,
    /// Made by joining a growing communicator ([`Communicator::join`]).
    pub(crate) joined: bool,
    /// State of device operations (pinned staging, the stream flag), made by the first one.
    #[cfg(feature = "cuda-core")]
    pub(crate) cuda: std::sync::Mutex<Option<crate::api::device::DeviceState>>,
    /// Transport to every peer (`"self"` for this rank).
    transports: Vec<&'static str>,
    /// Channels this communicator runs with TCP peers (`OXCCL_SOCKET_CHANNELS`, `auto`
    /// resolved at init).
    channels: usize,
    /// This rank's node as the `auto` rules counted it; communicators made from this one
    /// inherit it (`Config::node_ranks`, `Config::node_cpus`).
    node: NodeShare,
    /// This process's CPU count at init: what the `auto` rules count for a node whose CPU
    /// lists are unknown.
    cores: usize,
    /// Bytes sent straight from registered buffers (the connections count them).
    direct_bytes: Arc<std::sync::atomic::AtomicU64>,
    landed_bytes: Arc<std::sync::atomic::AtomicU64>,
    /// The store server, when this rank hosts it (rank 0 without a launcher-hosted store).
    _server: Option<TcpStoreServer>,
}

impl Communicator {
    /// This rank, in `0..size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether this process came in by joining a growing communicator ([`Communicator::join`],
    /// or [`Communicator::from_env`] with `OXCCL_JOIN=1`): it has none of the job's state yet,
    /// and takes it from the ranks that grew (e.g. a broadcast from rank 0).
    pub fn joined(&self) -> bool {
        self.joined
    }

    /// Rank among the ranks on this node (same node id), in rank order.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Ranks on this node.
    pub fn local_size(&self) -> usize {
        self.local_size
    }

    /// This node's id: the hostname, or `OXCCL_NODE_ID`.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// Index of this node among the communicator's nodes, in order of first appearance by rank.
    pub fn node_index(&self) -> usize {
        self.node_index
    }

    /// Node id of every rank.
    pub fn node_ids(&self) -> Vec<&str> {
        self.peers.iter().map(|p| p.node_id.as_str()).collect()
    }

    /// Whether the hierarchical all-reduce can run: the communicator spans at least two nodes,
    /// each with at least two of its ranks (the hierarchical reduce-scatter and all-gather also
    /// need the same number of ranks on every node).
    pub fn is_hierarchical(&self) -> bool {
        self.shared.layout.is_some()
    }

    /// Counters and tuning diagnostics: what the `auto` rules decided at init and what the
    /// channels and the send thread did so far (see [`Stats`]).
    pub fn stats(&self) -> Stats {
        let channels = self.shared.channels.get();
        Stats {
            transports: self.transports.clone(),
            spins: self.shared.spin,
            channels: channels.map_or(1, |c| c.comms.len() + 1),
            channel_ops: channels.map(|c| c.ops.load(Ordering::Relaxed)),
            send_thread_exchanges: self
                .shared
                .send_thread
                .as_ref()
                .map(|t| t.exchanges.load(Ordering::Relaxed)),
            node: self.node,
            cores: self.cores,
            registered_bytes: self.direct_bytes.load(Ordering::Relaxed),
            registered_recv_bytes: self.landed_bytes.load(Ordering::Relaxed),
            #[cfg(feature = "cuda-core")]
            device_path: self.device_path(),
        }
    }

    /// The configuration this communicator runs with.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Splits this communicator like `ncclCommSplit`: ranks passing the same `color` form a new
    /// communicator, ordered by `key` (ties by rank); `None` leaves this rank out (returns
    /// `Ok(None)`). Collective: every rank must call it.
    ///
    /// # Errors
    /// Errors of the all-gather that exchanges colors, and of creating the new communicator.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let mine = [color.map_or(-1, i64::from), key];
        let mut all = vec![0i64; 2 * self.size];
        self.all_gather_into(&mine, &mut all)?;
        let k = self.splits.fetch_add(1, Ordering::Relaxed);
        let Some(c) = color else { return Ok(None) };
        let mut members: Vec<(i64, usize)> = (0..self.size)
            .filter(|&r| all[2 * r] == i64::from(c))
            .map(|r| (all[2 * r + 1], r))
            .collect();
        members.sort();
        let ranks: Vec<usize> = members.iter().map(|&(_, r)| r).collect();
        self.child(&ranks, format!("{}/split{k}/c{c}", self.id))
            .map(Some)
    }

    /// Makes the communicator `id` of `members` (ranks of this one, in their new order; this
    /// rank among them) through the store: this one's configuration, node id and stall lineage.
    /// Errors of creating it name its ranks, noted with their world ranks.
    pub(crate) fn child(&self, members: &[usize], id: String) -> Result<Communicator> {
        let new_rank = members.iter().position(|&r| r == self.rank).unwrap_or(0);
        let lineage = self.shared.stalls.lineage(members);
        let names = WorldNames::new(&id, &lineage.0, &lineage.1);
        self.derive(new_rank, members.len(), id, Some(lineage))
            .map_err(|e| crate::base::error::named(names.as_ref(), e))
    }

    /// Makes the communicator `id` of `size` ranks, this process being `rank`, through the store,
    /// with this one's configuration, node id and join prefix; `lineage` is its stall root and
    /// root ranks (`None`: a root of its own).
    pub(crate) fn derive(
        &self,
        rank: usize,
        size: usize,
        id: String,
        lineage: Option<(String, Vec<usize>)>,
    ) -> Result<Communicator> {
        let mut cfg = self.cfg.clone();
        cfg.node_id = Some(self.node_id.clone());
        cfg.node_ranks = Some(self.node.ranks);
        cfg.node_cpus = self.node.cpus;
        let mut c = Self::init_inner(
            rank,
            size,
            self.store.clone(),
            cfg,
            id,
            self.store_host,
            lineage,
        )?;
        c.join_prefix.clone_from(&self.join_prefix);
        Ok(c)
    }

    /// Fails the operation in progress and every later one with `Aborted`, and tells the peers
    /// (they fail with the same cause). Safe to call from any thread, e.g. a watchdog.
    pub fn abort(&self) {
        self.shared.abort();
    }

    /// The communicator's id: `<job id>/world<n>` for one made by [`Communicator::from_env`],
    /// with `/split<k>/c<color>`, `/shrink<k>` or `/grow<k>` for those made from it. The same
    /// on every rank; it names the communicator's flight-record files ([`TraceDump::file_name`]).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The id of this communicator's world: the communicator it was made from by
    /// [`Communicator::split`] and [`Communicator::shrink`], at any depth, back to one made by
    /// `init`, [`Communicator::from_env`] or [`Communicator::grow`] (whose world is itself).
    pub fn world_id(&self) -> &str {
        self.shared.stalls.root().0
    }

    /// The rank in the world ([`Communicator::world_id`]) of each rank of this communicator,
    /// like `torch.distributed.get_process_group_ranks`: the identity for the world itself, the
    /// members' world ranks in their new order for a split, the survivors' for a shrink.
    /// Errors of a communicator whose ranks are not the world's carry a note of the same
    /// mapping at the end of their text (of a `Timeout`'s detail), e.g. `(ranks named here are
    /// of communicator job/world0/split0/c1; its ranks 0-1 are ranks [5, 3] of job/world0)`,
    /// while their fields (`lost_peer()` included) keep this communicator's ranks, the ones
    /// its `shrink` takes.
    pub fn world_ranks(&self) -> &[usize] {
        self.shared.stalls.root().1
    }

    /// The world rank ([`Communicator::world_ranks`]) of `rank` of this communicator, like
    /// `torch.distributed.get_global_rank`; `None` for a rank outside it.
    pub fn world_rank(&self, rank: usize) -> Option<usize> {
        self.world_ranks().get(rank).copied()
    }

    /// This rank's flight record of the communicator: its last operations (`OXCCL_TRACE_BUFFER`
    /// of them, oldest first) with their sequence numbers, algorithms, start times, durations
    /// and outcomes (an operation running on another thread as `running`), and the error that
    /// broke the communicator if one did. Never waits for a running operation: safe to call
    /// from a watchdog thread while the job hangs. See [`crate::base::trace`].
    pub fn trace(&self) -> TraceDump {
        // An operation running on another thread holds the execution state; the communicator
        // is not broken while one runs (a broken one runs nothing), so none is the answer then.
        let broken = match self.shared.exec.try_lock() {
            Ok(st) => st.broken.clone(),
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner().broken.clone(),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        self.shared.trace.snapshot("requested", broken.as_ref())
    }

    /// Writes [`Communicator::trace`] to `dir` (made if missing) as
    /// `<id>.r<rank>.json` ([`TraceDump::file_name`]), which `oxccl trace DIR` reads with the
    /// other ranks' files; returns the path. `OXCCL_TRACE_DIR` does the same by itself when the
    /// communicator fails, when one of its waits stalls and when it is dropped.
    ///
    /// # Errors
    /// `Error::Io` naming the path when the directory or the file cannot be written.
    pub fn dump_trace(&self, dir: impl AsRef<std::path::Path>) -> Result<std::path::PathBuf> {
        self.trace().write_to(dir.as_ref())
    }
}

impl Communicator {
    /// This communicator's engine alone (a channel's: `crate::engine::channels`), the rest
    /// dropped.
    fn into_engine(self) -> Engine {
        self.shared
    }

    /// The communicator as a transport set up on it sees it.
    #[cfg(feature = "cuda-core")]
    pub(crate) fn group(&self) -> crate::transport::Group<'_> {
        crate::transport::Group {
            rank: self.rank,
            size: self.size,
            id: &self.id,
            store: &self.store,
            cfg: &self.cfg,
            peers: &self.peers,
            hosts_store: self._server.is_some(),
            selector: &self.selector,
            deadline: std::time::Instant::now() + self.cfg.timeout,
        }
    }

    /// Whether another rank of this communicator is a thread of this process (same node, same
    /// process id): their streams then share one CUDA context, and its hardware queues.
    #[cfg(feature = "cuda-core")]
    pub(crate) fn shares_process(&self) -> bool {
        let me = &self.peers[self.rank];
        self.peers
            .iter()
            .any(|p| p.rank != self.rank && p.pid == me.pid && p.node_id == me.node_id)
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("id", &self.id)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("local_rank", &self.local_rank)
            .field("local_size", &self.local_size)
            .field("node_id", &self.node_id)
            .finish()
    }
}

#[cfg(test)]
mod tests;
