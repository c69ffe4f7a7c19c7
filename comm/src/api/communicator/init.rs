//! Creating a communicator: from launcher variables, from a store, or (for channels and
//! groups) from another one. Every rank publishes its record (node, process, CPUs, what its
//! transports advertise, the settings every rank must share) in the store and reads everyone
//! else's; the transport selector then gives every pair of ranks a backend, each backend sets up
//! and connects its peers, and the waiting policies are decided from what every rank knows
//! alike.

use std::net::{IpAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::Communicator;
use crate::algorithm::prims::NodeLayout;
use crate::base::affinity::NodeShare;
use crate::base::bootstrap::{
    self, hash_id, FileStore, Store, StoreAddr, TcpStore, TcpStoreServer,
};
use crate::base::config::Config;
use crate::base::error::{Error, Result, WorldNames};
use crate::engine::{Engine, Shared};
use crate::transport::{select, Group, Links, PeerInfo, Selector};

static WORLD_COUNTER: AtomicU64 = AtomicU64::new(0);

fn resolve_ip(host: &str) -> Option<IpAddr> {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = h.parse() {
        return Some(ip);
    }
    (h, 0).to_socket_addrs().ok()?.next().map(|a| a.ip())
}

/// Compares the settings every rank must share (`PeerInfo::settings`) of this rank (`me`) with
/// every peer's; the first difference is an `Error::Config` naming both ranks, the variable and
/// both values.
fn check_shared_settings(rank: usize, me: &PeerInfo, peers: &[PeerInfo]) -> Result<()> {
    for p in peers.iter().filter(|p| p.rank != rank) {
        for (name, mine) in &me.settings {
            let theirs = p.settings.iter().find(|(n, _)| n == name).map(|(_, v)| v);
            if theirs != Some(mine) {
                let theirs =
                    theirs.map_or_else(|| "(not reported)".to_owned(), |v| format!("{v:?}"));
                return Err(Error::Config(format!(
                    "rank {rank}: init: rank {} has {name}={theirs} but this rank has \
                     {name}={mine:?}; every rank of a communicator must use the same value",
                    p.rank
                )));
            }
        }
    }
    Ok(())
}

impl Communicator {
    /// Creates the world communicator from launcher variables: `oxccl launch`, torchrun, Slurm or
    /// OpenMPI (see docs/ENV.md for the order and the variables). With `OXCCL_JOIN=1` (set by
    /// `oxccl launch --respawn` for a replacement rank) the process joins a communicator of the
    /// job that is growing instead ([`Communicator::grow`], [`Communicator::join`]); its rank
    /// and size are then the grown communicator's.
    ///
    /// # Errors
    /// `Error::Config` when no launcher variables are found or they are inconsistent; store and
    /// transport errors while connecting.
    pub fn from_env() -> Result<Communicator> {
        Self::from_env_with(crate::config::Settings::new())
    }

    /// [`Communicator::from_env`] with settings given in code: each one set in `settings`
    /// wins over its `OXCCL_*` variable, the environment gives the rest (see
    /// [`crate::config::Settings`]). The launcher's variables (rank, world size, store) still
    /// come from the environment.
    ///
    /// # Errors
    /// As [`Communicator::from_env`]; `Error::Config` for a setting that does not parse.
    pub fn from_env_with(settings: crate::config::Settings) -> Result<Communicator> {
        crate::base::logging::hint_if_unseen();
        let info = bootstrap::detect_from_env()?;
        let cfg = settings.config()?;
        let join = match std::env::var("OXCCL_JOIN") {
            Ok(v) if !v.trim().is_empty() => crate::base::config::parse_bool("OXCCL_JOIN", &v)?,
            _ => false,
        };
        // A joining process never hosts the store: the job's is running already.
        let host = info.host_store && !join;
        let (store, server, store_host): (Arc<dyn Store>, Option<TcpStoreServer>, Option<IpAddr>) =
            match &info.store {
                StoreAddr::Tcp { host: h, port } => {
                    let token = std::env::var("OXCCL_JOB_TOKEN")
                        .ok()
                        .filter(|t| !t.trim().is_empty());
                    let (client, server) =
                        TcpStore::host_or_connect(h, *port, host, cfg.timeout, token.as_deref())?;
                    (Arc::new(client), server, resolve_ip(h))
                }
                StoreAddr::File(path) => (Arc::new(FileStore::new(path.clone())?), None, None),
            };
        if join {
            return Self::join_inner(store, cfg, &info.job_id, store_host, Some(info.rank));
        }
        let n = WORLD_COUNTER.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}/world{n}", info.job_id);
        let made = Self::init_inner(info.rank, info.world_size, store, cfg, id, store_host, None);
        let mut c = match made {
            Ok(c) => c,
            Err(e @ Error::Config(_)) if server.is_some() => {
                // A conflict at the rendezvous: the store this process hosts stays up a moment,
                // so that the other ranks read the decision instead of a vanished store.
                std::thread::sleep(super::rendezvous::LINGER);
                return Err(e);
            }
            Err(e) => return Err(e),
        };
        c._server = server;
        c.join_prefix.clone_from(&info.job_id);
        if c.local_rank != info.local_rank || c.local_size != info.local_world_size {
            tracing::warn!(
                rank = c.rank,
                "launcher says local rank {}/{}, node ids say {}/{} (node id {:?}); using the node ids",
                info.local_rank,
                info.local_world_size,
                c.local_rank,
                c.local_size,
                c.node_id
            );
        }
        Ok(c)
    }

    /// Creates a communicator of `size` ranks with this process as `rank`, meeting the others
    /// through `store`, with configuration from the environment.
    ///
    /// # Errors
    /// `InvalidArgument` for a rank outside `0..size`; store and transport errors.
    pub fn init(rank: usize, size: usize, store: Arc<dyn Store>) -> Result<Communicator> {
        Self::init_with_config(rank, size, store, Config::from_env()?)
    }

    /// [`Communicator::init`] with an explicit configuration.
    ///
    /// # Errors
    /// `InvalidArgument` for a rank outside `0..size`; store and transport errors.
    pub fn init_with_config(
        rank: usize,
        size: usize,
        store: Arc<dyn Store>,
        cfg: Config,
    ) -> Result<Communicator> {
        crate::base::logging::hint_if_unseen();
        // Each rank counts its own inits on this store, so the k-th init of every rank meets the
        // k-th init of the others under a fresh id (no stale peer records).
        let key = format!("oxccl/inits/{rank}");
        let generation = store.add(&key, 1).map_err(|e| match e {
            Error::Store(msg) => Error::Store(format!(
                "rank {rank}: init: counting this rank's inits on key '{key}' failed: {msg}"
            )),
            other => other,
        })?;
        Self::init_inner(
            rank,
            size,
            store,
            cfg,
            format!("oxccl/world{generation}"),
            None,
            None,
        )
    }

    pub(crate) fn init_inner(
        rank: usize,
        size: usize,
        store: Arc<dyn Store>,
        cfg: Config,
        id: String,
        store_host: Option<IpAddr>,
        root: Option<(String, Vec<usize>)>,
    ) -> Result<Communicator> {
        Self::init_full(rank, size, store, cfg, id, store_host, root, None)
    }

    /// [`Communicator::init_inner`], publishing failures where `failures` says when given (a
    /// channel, under its parent's key, sharing its cause: `crate::engine::channels`).
    #[allow(clippy::too_many_arguments)]
    fn init_full(
        rank: usize,
        size: usize,
        store: Arc<dyn Store>,
        cfg: Config,
        id: String,
        store_host: Option<IpAddr>,
        root: Option<(String, Vec<usize>)>,
        failures: Option<crate::engine::Failures>,
    ) -> Result<Communicator> {
        check_args(rank, size, &cfg)?;
        let deadline = Instant::now() + cfg.timeout;
        let node_id = match &cfg.node_id {
            Some(n) => n.clone(),
            None => gethostname::gethostname().to_string_lossy().into_owned(),
        };
        let mut backends = select::backends(rank, hash_id(&id), &cfg, store_host)?;
        let mut me = PeerInfo {
            rank,
            node_id: node_id.clone(),
            pid: std::process::id(),
            tcp_addr: String::new(),
            cpus: crate::base::affinity::usable_cpus(),
            node_ranks: cfg.node_ranks.unwrap_or(0),
            node_cpus: cfg.node_cpus.unwrap_or(0),
            rdma: String::new(),
            settings: cfg.shared_settings(),
        };
        for b in &backends {
            b.advertise(&mut me);
        }
        let peers =
            super::rendezvous::exchange_records(&me, size, &*store, &id, cfg.timeout, deadline)?;
        check_shared_settings(rank, &me, &peers)?;
        let selector = Selector::new(&backends, &cfg);
        let mut links = Links::new(size);
        let group = Group {
            rank,
            size,
            id: &id,
            store: &store,
            cfg: &cfg,
            peers: &peers,
            hosts_store: false,
            selector: &selector,
            deadline,
        };
        let transports = select::connect_all(&mut backends, &group, &mut links)?;
        let direct_bytes = Arc::clone(&links.direct_bytes);
        let landed_bytes = Arc::clone(&links.landed_bytes);
        drop(backends);
        let nodes = Nodes::of(&peers, rank);
        tracing::debug!(rank, size, local_rank = nodes.local_rank, node = %node_id, comm = %id, "communicator ready");
        let sockets = Sockets::of(&group);
        let policy = Policy::new(rank, &cfg, &nodes, &sockets, &peers);
        let mut shared = Shared::new(rank, size, policy.spin, &cfg, links, store.clone(), &id);
        let channel = failures.is_some();
        if let Some(f) = failures {
            shared.share_failures(f);
        }
        let node_ids: Vec<&str> = peers.iter().map(|p| p.node_id.as_str()).collect();
        shared.layout = NodeLayout::new(&node_ids, rank);
        if let Some(l) = &shared.layout {
            tracing::debug!(
                rank,
                nodes = l.ranks.len(),
                local = l.local_group.len(),
                even = l.even,
                "hierarchical layout"
            );
        }
        // From what every rank knows alike (not from this rank's own peers), so all pick the
        // same ring blocks.
        shared.sockets = sockets.any;
        if policy.send_thread && shared.sockets {
            match crate::algorithm::prims::SendThread::new(rank) {
                Ok(t) => shared.send_thread = Some(t),
                Err(e) => {
                    tracing::warn!(rank, error = %e, "no send thread: sends stay on the rank's thread")
                }
            }
        }
        let trace = &mut shared.trace;
        trace.owner.node.clone_from(&node_id);
        trace.sockets = shared.sockets;
        if let Some((root_id, root_ranks)) = root {
            trace.owner.root_comm.clone_from(&root_id);
            trace.owner.root_rank = root_ranks.get(rank).copied().unwrap_or(rank);
            // A channel's errors are its parent's to report (`crate::engine::channels`).
            if !channel {
                shared.world = WorldNames::new(&id, &root_id, &root_ranks).map(Arc::new);
            }
            shared.stalls.set_root(root_id, root_ranks);
        }
        let comm = Communicator {
            shared: Engine::new(shared),
            rank,
            size,
            local_rank: nodes.local_rank,
            local_size: nodes.local_size,
            node_id,
            node_index: nodes.index,
            peers,
            id,
            store,
            store_host,
            cfg,
            selector,
            splits: AtomicU64::new(0),
            shrinks: AtomicU64::new(0),
            grows: AtomicU64::new(0),
            join_prefix: "oxccl".into(),
            joined: false,
            #[cfg(feature = "cuda-core")]
            cuda: std::sync::Mutex::new(None),
            transports,
            channels: policy.channels,
            node: nodes.share,
            cores: policy.cores,
            direct_bytes,
            landed_bytes,
            _server: None,
        };
        comm.open_channels()?;
        Ok(comm)
    }

    /// Makes this communicator's extra channels (`OXCCL_SOCKET_CHANNELS`, `crate::engine::channels`):
    /// communicators `<id>/ch1..` of the same ranks, publishing failures under this one's key
    /// and sharing its cause,
    /// when it has TCP peers and asks for more than one. Their threads start first, so a rank
    /// that cannot start them fails before its peers wait for its channels.
    fn open_channels(&self) -> Result<()> {
        let k = self.channels;
        if k < 2 || !self.shared.sockets {
            return Ok(());
        }
        let pools = crate::engine::channels::pools(self.rank, k - 1)?;
        let mut cfg = self.cfg.clone();
        cfg.socket_channels = Some(1);
        cfg.node_id = Some(self.node_id.clone());
        cfg.node_ranks = Some(self.node.ranks);
        cfg.node_cpus = self.node.cpus;
        let members: Vec<usize> = (0..self.size).collect();
        let lineage = self.shared.stalls.lineage(&members);
        let comms = (1..k)
            .map(|i| {
                Self::init_full(
                    self.rank,
                    self.size,
                    self.store.clone(),
                    cfg.clone(),
                    format!("{}/ch{i}", self.id),
                    self.store_host,
                    Some(lineage.clone()),
                    Some(self.shared.failures()),
                )
            })
            .map(|c| c.map(Communicator::into_engine))
            .collect::<Result<Vec<_>>>()?;
        tracing::debug!(rank = self.rank, channels = k, comm = %self.id, "channels ready");
        // Set once, here, before anyone else can see the communicator.
        let _ = self
            .shared
            .channels
            .set(crate::engine::channels::Channels::new(comms, pools));
        Ok(())
    }
}

/// Refuses a rank outside `0..size`, a size above the limit, and settings that do not hold
/// together.
fn check_args(rank: usize, size: usize, cfg: &Config) -> Result<()> {
    let max = crate::api::elastic::MAX_RANKS;
    if size == 0 || rank >= size || size > max {
        return Err(Error::InvalidArgument {
            rank,
            op: "init".into(),
            msg: format!("rank {rank} is not in 0..{size}, or the size is above {max}"),
        });
    }
    cfg.check().map_err(|msg| Error::InvalidArgument {
        rank,
        op: "init".into(),
        msg,
    })
}

/// Where this rank sits among the communicator's nodes (in order of first appearance by rank).
struct Nodes {
    /// Rank among the ranks of this node, and their number.
    local_rank: usize,
    local_size: usize,
    /// This node's index.
    index: usize,
    /// Every node's ranks and CPUs as the `auto` rules count them, by node index.
    shares: Vec<NodeShare>,
    /// This node's.
    share: NodeShare,
}

impl Nodes {
    fn of(peers: &[PeerInfo], rank: usize) -> Nodes {
        let mine = &peers[rank].node_id;
        let same_node: Vec<usize> = (0..peers.len())
            .filter(|&r| peers[r].node_id == *mine)
            .collect();
        let mut nodes: Vec<&str> = Vec::new();
        for p in peers {
            if !nodes.contains(&p.node_id.as_str()) {
                nodes.push(&p.node_id);
            }
        }
        let index = nodes.iter().position(|n| *n == mine).unwrap_or(0);
        // Every node's ranks and CPUs, from the records every rank read alike: the `auto`
        // rules (the channels from all nodes, so every rank picks the same number).
        let shares: Vec<NodeShare> = nodes
            .iter()
            .map(|n| {
                let members: Vec<_> = peers
                    .iter()
                    .filter(|p| p.node_id == *n)
                    .map(PeerInfo::node_member)
                    .collect();
                crate::base::affinity::node_share(&members)
            })
            .collect();
        Nodes {
            local_rank: same_node.iter().position(|&r| r == rank).unwrap_or(0),
            local_size: same_node.len(),
            index,
            share: shares[index],
            shares,
        }
    }
}

/// Which ranks reach each other over TCP, from the selector's routes for every pair (the same
/// on every rank).
struct Sockets {
    /// Some pair does (the tuner's [`crate::base::tuning::Caps::sockets`]).
    any: bool,
    /// The most peers a rank reaches over TCP (each channel holds sockets to each).
    most_peers: usize,
}

impl Sockets {
    fn of(group: &Group<'_>) -> Sockets {
        let n = group.size;
        let mut per_rank = vec![0usize; n];
        for a in 0..n {
            for b in a + 1..n {
                if group.host_route(a, b) == Some("tcp") {
                    per_rank[a] += 1;
                    per_rank[b] += 1;
                }
            }
        }
        Sockets {
            any: per_rank.iter().any(|&c| c > 0),
            most_peers: per_rank.into_iter().max().unwrap_or(0),
        }
    }
}

/// The waiting and threading policies of a communicator: settings, or the `auto` rules.
struct Policy {
    spin: bool,
    send_thread: bool,
    channels: usize,
    /// This process's CPU count at init.
    cores: usize,
}

impl Policy {
    fn new(
        rank: usize,
        cfg: &Config,
        nodes: &Nodes,
        sockets: &Sockets,
        peers: &[PeerInfo],
    ) -> Policy {
        let share = nodes.share;
        let channels = cfg.socket_channels.unwrap_or_else(|| {
            crate::base::affinity::auto_channels(&nodes.shares, sockets.most_peers)
        });
        // Oversubscribed (more ranks on this node than cores to run them): a spinning waiter
        // only delays the rank it waits for, so waiters yield at once. The cores are those the
        // node's ranks may use together (ranks bound a core each still spin); without their
        // lists, this process's own. The ranks and CPUs are the node's: a group with some of
        // them counts what its parent counted there too (`PeerInfo::node_ranks`, `node_cpus`).
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let spin = cfg.spin.unwrap_or_else(|| share.holds(1, cores));
        tracing::debug!(
            rank,
            local_ranks = nodes.local_size,
            node_ranks = share.ranks,
            cpus = %crate::base::affinity::encode_cpus(&peers[rank].cpus),
            spin,
            channels,
            "waiting policy"
        );
        // Each rank's send thread needs a core of its own beside the rank's.
        let send_thread = cfg
            .socket_send_thread
            .unwrap_or_else(|| share.holds(2, cores));
        Policy {
            spin,
            send_thread,
            channels,
            cores,
        }
    }
}
