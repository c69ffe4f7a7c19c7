//! The communicator: a group of ranks that run collectives together.
//!
//! Created from launcher variables ([`Communicator::from_env`]), explicitly
//! ([`Communicator::init`]), by splitting another one ([`Communicator::split`]), or by changing
//! another one's ranks ([`Communicator::shrink`], [`Communicator::grow`], in `elastic.rs`).
//! Creating one is collective: every rank publishes its address in the store, reads everyone
//! else's, and opens its connections. The collectives themselves are in `collectives.rs`.

use std::net::{IpAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bootstrap::{self, FileStore, Store, StoreAddr, TcpStore, TcpStoreServer};
use crate::config::{Config, TransportChoice};
use crate::engine::Shared;
use crate::error::{Error, Result, WorldNames};
use crate::prims::{Links, NodeLayout};
use crate::trace::TraceDump;
use crate::transport::shm::{self, Segment, ShmRecv, ShmSend, ShmWindow};
use crate::transport::tcp::TcpTransport;
use crate::transport::{PeerInfo, Reach, Transport, Window};

/// A group of ranks that run collectives together. `Send + Sync`: share it by reference (or in an
/// `Arc`) between threads; operations are run in the order they are issued.
pub struct Communicator {
    pub(crate) shared: Arc<Shared>,
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
    splits: AtomicU64,
    pub(crate) shrinks: AtomicU64,
    pub(crate) grows: AtomicU64,
    /// Store key prefix under which `grow` offers places to joining processes: the job id
    /// (`from_env`) or `oxccl` (`init`); children inherit it.
    pub(crate) join_prefix: String,
    /// Made by joining a growing communicator ([`Communicator::join`]).
    pub(crate) joined: bool,
    /// Reused working copy of out-of-place reduce-scatter inputs (8-byte aligned words), so a
    /// call does not allocate and fault in a fresh buffer every time.
    pub(crate) scratch: Arc<std::sync::Mutex<Vec<u64>>>,
    /// State of device operations (pinned staging, the stream flag), made by the first one.
    #[cfg(feature = "cuda")]
    pub(crate) cuda: std::sync::Mutex<Option<crate::cuda::DeviceState>>,
    /// Transport to every peer (`"self"` for this rank).
    transports: Vec<&'static str>,
    /// Channels this communicator runs with TCP peers (`OXCCL_SOCKET_CHANNELS`, `auto`
    /// resolved at init).
    channels: usize,
    /// This rank's node as the `auto` rules counted it; communicators made from this one
    /// inherit it (`Config::node_ranks`, `Config::node_cpus`).
    node: crate::affinity::NodeShare,
    /// This process's CPU count at init: what the `auto` rules count for a node whose CPU
    /// lists are unknown.
    cores: usize,
    /// The store server, when this rank hosts it (rank 0 without a launcher-hosted store).
    _server: Option<TcpStoreServer>,
}

static WORLD_COUNTER: AtomicU64 = AtomicU64::new(0);

/// FNV-1a (64 bits) of the communicator id: compared between processes (the TCP hello, shared
/// memory names), so it must not depend on the Rust release or the build, as `DefaultHasher`
/// may.
fn hash_id(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// An error of store operation `what` on `key` while creating the communicator, for rank
/// `rank`. For a wait (`waiting_for` is `Some`, saying what for), running out of time (the
/// store's own time-out, or the init deadline passed) becomes `Timeout`; any other failure (store
/// unreachable, shut down) stays a store error, with its cause, the rank, `init` and the key.
fn init_store_error(
    rank: usize,
    e: Error,
    what: &str,
    key: &str,
    waiting_for: Option<&str>,
    timeout: Duration,
    deadline: Instant,
) -> Error {
    match (e, waiting_for) {
        (Error::Store(msg), Some(waiting_for))
            if bootstrap::is_wait_timeout(&msg) || Instant::now() >= deadline =>
        {
            Error::Timeout {
                rank,
                op: "init".into(),
                timeout,
                detail: format!("{waiting_for} ({msg})"),
            }
        }
        (Error::Store(msg), _) => Error::Store(format!(
            "rank {rank}: init: {what} on key '{key}' failed: {msg}"
        )),
        (other, _) => other,
    }
}

fn resolve_ip(host: &str) -> Option<IpAddr> {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = h.parse() {
        return Some(ip);
    }
    (h, 0).to_socket_addrs().ok()?.next().map(|a| a.ip())
}

/// Creates this rank's shared-memory segment, maps every same-node peer's, builds the shm
/// connections, and unlinks the segment once every peer has mapped it. Returns the own segment
/// (whose doorbell this rank sleeps on).
#[allow(clippy::too_many_arguments)]
fn connect_shm(
    rank: usize,
    peers: &[PeerInfo],
    shm_peers: &[usize],
    shm_ok: &dyn Fn(usize, usize) -> bool,
    store: &dyn Store,
    id: &str,
    cfg: &Config,
    deadline: Instant,
    links: &mut Links,
) -> Result<(Arc<Segment>, Option<ShmWindow>)> {
    let job = id.split('/').next().unwrap_or("oxccl");
    // Unique even for ranks that are threads of one process in several tests at once.
    static SEGMENTS: AtomicU64 = AtomicU64::new(0);
    let n = SEGMENTS.fetch_add(1, Ordering::Relaxed);
    let name = format!(
        "{}{:016x}-r{rank}-p{}-{n}",
        shm::job_prefix(job),
        hash_id(id),
        std::process::id()
    );
    // Every rank shares memory with every other: the direct window (staging + step counters).
    let all_shm = shm_peers.len() + 1 == peers.len();
    let direct = if all_shm { cfg.direct_bytes } else { 0 };
    let (seg, path) = Segment::create(
        rank,
        &name,
        shm_peers.len(),
        cfg.slot_bytes,
        cfg.nslots,
        direct,
    )?;
    // The name goes when this function returns (every peer has mapped the segment, or set-up
    // failed), also when it unwinds: the mappings stay.
    let _unlink = shm::UnlinkGuard::new(path.clone());
    let own = Arc::new(seg);
    let mut segs: Vec<Option<Arc<Segment>>> = vec![None; peers.len()];
    segs[rank] = Some(own.clone());
    let mut can_read_all = cfg.single_copy;
    let failed = |e: Error, what: &str, key: &str, waiting_for: Option<&str>| {
        init_store_error(rank, e, what, key, waiting_for, cfg.timeout, deadline)
    };
    let result = (|| {
        let key = format!("{id}/shm/{rank}");
        store
            .set(&key, path.to_string_lossy().as_bytes())
            .map_err(|e| failed(e, "publishing the shared-memory segment", &key, None))?;
        for (ring, &p) in shm_peers.iter().enumerate() {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            let key = format!("{id}/shm/{p}");
            let rec = store.get(&key, left).map_err(|e| {
                let waiting = format!("rank {p} never published its shared-memory segment");
                failed(
                    e,
                    "reading a shared-memory segment name",
                    &key,
                    Some(&waiting),
                )
            })?;
            let peer_path = String::from_utf8_lossy(&rec).into_owned();
            let peer_seg = Arc::new(Segment::open(rank, p, &peer_path)?);
            // Our ring in p's segment: our position among p's shared-memory peers.
            let ring_at_p = (0..peers.len())
                .filter(|&q| q != p && shm_ok(p, q))
                .position(|q| q == rank)
                .unwrap_or(0);
            if ring_at_p >= peer_seg.nrings() {
                return Err(Error::Transport {
                    rank,
                    peer: p,
                    transport: "shm",
                    msg: format!("{peer_path} has no ring for this rank"),
                });
            }
            let pid = peers[p].pid;
            if all_shm && can_read_all && !shm::probe_single_copy(pid, &peer_seg) {
                tracing::info!(
                    rank,
                    peer = p,
                    "process_vm_readv cannot read this peer: no single-copy path"
                );
                can_read_all = false;
            }
            segs[p] = Some(peer_seg.clone());
            links.send[p] = Some(Box::new(ShmSend::new(
                rank,
                p,
                pid,
                peer_seg.clone(),
                ring_at_p,
                own.clone(),
            )));
            links.recv[p] = Some(Box::new(ShmRecv::new(
                rank,
                p,
                pid,
                own.clone(),
                ring,
                peer_seg,
            )));
            let key = format!("{id}/shm_mapped/{p}");
            store
                .add(&key, 1)
                .map_err(|e| failed(e, "counting a mapped segment", &key, None))?;
            tracing::info!(rank, peer = p, transport = "shm", segment = %peer_path, "connected");
        }
        // Unlink once every peer has mapped it: the mappings stay, the name goes.
        let mut backoff = Duration::from_micros(100);
        let key = format!("{id}/shm_mapped/{rank}");
        let mapped = || {
            store
                .add(&key, 0)
                .map_err(|e| failed(e, "reading the mapped-segment count", &key, None))
        };
        while mapped()? < shm_peers.len() as i64 {
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    rank,
                    op: "init".into(),
                    timeout: cfg.timeout,
                    detail: "shared-memory peers did not map this rank's segment".into(),
                });
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(10));
        }
        if !all_shm {
            return Ok(None);
        }
        // Single copy only if every rank can read every other (all ranks decide the same).
        let key = format!("{id}/single_copy/{rank}");
        store
            .set(&key, if can_read_all { b"1" } else { b"0" })
            .map_err(|e| failed(e, "publishing the single-copy capability", &key, None))?;
        let mut single_copy = true;
        for p in 0..peers.len() {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            let key = format!("{id}/single_copy/{p}");
            let v = store.get(&key, left).map_err(|e| {
                let waiting = format!("rank {p} never published its single-copy capability");
                failed(e, "reading a single-copy capability", &key, Some(&waiting))
            })?;
            single_copy &= v == b"1";
        }
        let segs: Vec<Arc<Segment>> =
            segs.iter().cloned().collect::<Option<_>>().ok_or_else(|| {
                Error::Config(format!("rank {rank}: a shared-memory peer has no segment"))
            })?;
        let pids = peers.iter().map(|p| p.pid).collect();
        tracing::info!(rank, staging = direct, single_copy, "shared-memory window");
        Ok(Some(ShmWindow::new(rank, segs, pids, single_copy)))
    })();
    result.map(|w| (own, w))
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
        crate::logging::init();
        let info = bootstrap::detect_from_env()?;
        let cfg = Config::from_env()?;
        let join = match std::env::var("OXCCL_JOIN") {
            Ok(v) if !v.trim().is_empty() => crate::config::parse_bool("OXCCL_JOIN", &v)?,
            _ => false,
        };
        // A joining process never hosts the store: the job's is running already.
        let host = info.host_store && !join;
        let (store, server, store_host): (Arc<dyn Store>, Option<TcpStoreServer>, Option<IpAddr>) =
            match &info.store {
                StoreAddr::Tcp { host: h, port } => {
                    let (client, server) = TcpStore::host_or_connect(h, *port, host, cfg.timeout)?;
                    (Arc::new(client), server, resolve_ip(h))
                }
                StoreAddr::File(path) => (Arc::new(FileStore::new(path.clone())?), None, None),
            };
        if join {
            return Self::join_inner(store, cfg, &info.job_id, store_host, Some(info.rank));
        }
        let n = WORLD_COUNTER.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}/world{n}", info.job_id);
        let mut c = Self::init_inner(info.rank, info.world_size, store, cfg, id, store_host, None)?;
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
        crate::logging::init();
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
    /// channel, under its parent's key, sharing its cause: `crate::channels`).
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
        if size == 0 || rank >= size || size > crate::elastic::MAX_RANKS {
            return Err(Error::InvalidArgument {
                rank,
                op: "init".into(),
                msg: format!(
                    "rank {rank} is not in 0..{size}, or the size is above {}",
                    crate::elastic::MAX_RANKS
                ),
            });
        }
        cfg.check().map_err(|msg| Error::InvalidArgument {
            rank,
            op: "init".into(),
            msg,
        })?;
        let deadline = Instant::now() + cfg.timeout;
        let node_id = match &cfg.node_id {
            Some(n) => n.clone(),
            None => gethostname::gethostname().to_string_lossy().into_owned(),
        };
        let mut tcp = TcpTransport::bind(rank, hash_id(&id), &cfg, store_host)?;
        let me = PeerInfo {
            rank,
            node_id: node_id.clone(),
            pid: std::process::id(),
            tcp_addr: tcp.addr(),
            cpus: crate::affinity::usable_cpus(),
            node_ranks: cfg.node_ranks.unwrap_or(0),
            node_cpus: cfg.node_cpus.unwrap_or(0),
            settings: cfg.shared_settings(),
        };
        let key = format!("{id}/peer/{rank}");
        store.set(&key, &me.encode()).map_err(|e| {
            init_store_error(
                rank,
                e,
                "publishing this rank's address",
                &key,
                None,
                cfg.timeout,
                deadline,
            )
        })?;
        let mut peers = Vec::with_capacity(size);
        for r in 0..size {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            let key = format!("{id}/peer/{r}");
            let rec = store.get(&key, left).map_err(|e| {
                init_store_error(
                    rank,
                    e,
                    &format!("reading rank {r}'s address"),
                    &key,
                    Some(&format!("rank {r} never published its address")),
                    cfg.timeout,
                    deadline,
                )
            })?;
            let p = PeerInfo::decode(&rec).map_err(|e| {
                let why = match e {
                    Error::Store(msg) => msg,
                    other => other.to_string(),
                };
                Error::Store(format!(
                    "rank {rank}: init: the record under key '{key}' (rank {r}'s address): {why}"
                ))
            })?;
            if p.rank != r {
                return Err(Error::Store(format!(
                    "rank {rank}: init: the record under key '{key}' should be rank {r}'s \
                     address but names rank {}",
                    p.rank
                )));
            }
            peers.push(p);
        }
        check_shared_settings(rank, &me, &peers)?;
        let same_node: Vec<usize> = (0..size).filter(|&r| peers[r].node_id == node_id).collect();
        let local_rank = same_node.iter().position(|&r| r == rank).unwrap_or(0);
        let mut nodes: Vec<&str> = Vec::new();
        for p in &peers {
            if !nodes.contains(&p.node_id.as_str()) {
                nodes.push(&p.node_id);
            }
        }
        let node_index = nodes.iter().position(|n| *n == node_id).unwrap_or(0);

        // Same-node peers talk through shared memory (unless OXCCL_TRANSPORT says otherwise),
        // everyone else over TCP.
        let mut links = Links::default();
        links.send.resize_with(size, || None);
        links.recv.resize_with(size, || None);
        let shm_ok = |a: usize, b: usize| match cfg.transport {
            TransportChoice::Tcp => false,
            TransportChoice::Auto => peers[a].node_id == peers[b].node_id,
            TransportChoice::Shm => true,
        };
        // Every node's ranks and CPUs, from the records every rank read alike: the `auto`
        // rules below (the channels from all nodes, so every rank picks the same number).
        let shares: Vec<crate::affinity::NodeShare> = nodes
            .iter()
            .map(|n| {
                let members: Vec<_> = peers
                    .iter()
                    .filter(|p| p.node_id == *n)
                    .map(PeerInfo::node_member)
                    .collect();
                crate::affinity::node_share(&members)
            })
            .collect();
        let share = shares[node_index];
        let channels = cfg.socket_channels.unwrap_or_else(|| {
            // The most peers a rank reaches over TCP (each channel holds sockets to each).
            let tcp_peers = (0..size)
                .map(|a| (0..size).filter(|&b| b != a && !shm_ok(a, b)).count())
                .max()
                .unwrap_or(0);
            crate::affinity::auto_channels(&shares, tcp_peers)
        });
        if cfg.transport == TransportChoice::Shm {
            if let Some(p) = (0..size).find(|&p| peers[p].node_id != node_id) {
                return Err(Error::Config(format!(
                    "rank {rank}: OXCCL_TRANSPORT=shm, but rank {p} is on node {:?} and this rank on {node_id:?}; \
                     shared memory only connects ranks of one node (use auto or tcp)",
                    peers[p].node_id
                )));
            }
        }
        let shm_peers: Vec<usize> = (0..size)
            .filter(|&p| p != rank && shm_ok(rank, p))
            .collect();
        if !shm_peers.is_empty() {
            let (bell, window) = connect_shm(
                rank, &peers, &shm_peers, &shm_ok, &*store, &id, &cfg, deadline, &mut links,
            )?;
            links.bell = Some(bell);
            links.window = window.map(|w| Box::new(w) as Box<dyn Window>);
        }
        // Full mesh over TCP for the rest: every rank opens its send halves first (the
        // listener's backlog completes the handshakes), then accepts its receive halves in any
        // order.
        let others: Vec<usize> = (0..size)
            .filter(|&r| r != rank && !shm_peers.contains(&r))
            .collect();
        for &p in &others {
            match tcp.can_connect(&me, &peers[p]) {
                Reach::Yes => {}
                Reach::No(why) => {
                    return Err(Error::Transport {
                        rank,
                        peer: p,
                        transport: "tcp",
                        msg: why,
                    })
                }
                Reach::Unsupported(feat) => {
                    return Err(Error::Transport {
                        rank,
                        peer: p,
                        transport: "tcp",
                        msg: format!("needs feature {feat}"),
                    })
                }
            }
            links.send[p] = Some(tcp.connect_send(&peers[p], deadline)?);
        }
        for (p, conn) in tcp.accept_recvs(&others, deadline)? {
            links.recv[p] = Some(conn);
            tracing::info!(rank, peer = p, transport = tcp.name(), addr = %peers[p].tcp_addr, nsocks = cfg.nsocks, "connected");
        }
        tracing::debug!(rank, size, local_rank, node = %node_id, comm = %id, "communicator ready");
        // Oversubscribed (more ranks on this node than cores to run them): a spinning waiter
        // only delays the rank it waits for, so waiters yield at once. The cores are those the
        // node's ranks may use together (ranks bound a core each still spin); without their
        // lists, this process's own. The ranks and CPUs are the node's: a group with some of
        // them counts what its parent counted there too (`PeerInfo::node_ranks`, `node_cpus`).
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let spin = cfg.spin.unwrap_or_else(|| share.holds(1, cores));
        tracing::debug!(
            rank,
            local_ranks = same_node.len(),
            node_ranks = share.ranks,
            cpus = %crate::affinity::encode_cpus(&peers[rank].cpus),
            spin,
            channels,
            "waiting policy"
        );
        let transports = (0..size)
            .map(|p| {
                if p == rank {
                    "self"
                } else if shm_peers.contains(&p) {
                    "shm"
                } else {
                    "tcp"
                }
            })
            .collect();
        let node_ids: Vec<&str> = peers.iter().map(|p| p.node_id.as_str()).collect();
        let layout = NodeLayout::new(&node_ids, rank);
        if let Some(l) = &layout {
            tracing::debug!(
                rank,
                nodes = l.ranks.len(),
                local = l.local_group.len(),
                even = l.even,
                "hierarchical layout"
            );
        }
        // Each rank's send thread needs a core of its own beside the rank's.
        let send_thread = cfg
            .socket_send_thread
            .unwrap_or_else(|| share.holds(2, cores));
        let mut shared = Shared::new(rank, size, spin, &cfg, links, store.clone(), &id);
        let channel = failures.is_some();
        if let Some(f) = failures {
            shared.share_failures(f);
        }
        shared.layout = layout;
        // From what every rank knows alike (not from this rank's own peers), so all pick the
        // same ring blocks.
        shared.sockets = (0..size).any(|a| (a + 1..size).any(|b| !shm_ok(a, b)));
        if send_thread && shared.sockets {
            match crate::prims::SendThread::new(rank) {
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
            // A channel's errors are its parent's to report (`crate::channels`).
            if !channel {
                shared.world = WorldNames::new(&id, &root_id, &root_ranks).map(Arc::new);
            }
            shared.stalls.set_root(root_id, root_ranks);
        }
        let shared = Arc::new(shared);
        let comm = Communicator {
            shared,
            rank,
            size,
            local_rank,
            local_size: same_node.len(),
            node_id,
            node_index,
            peers,
            id,
            store,
            store_host,
            cfg,
            splits: AtomicU64::new(0),
            shrinks: AtomicU64::new(0),
            grows: AtomicU64::new(0),
            join_prefix: "oxccl".into(),
            joined: false,
            scratch: Arc::new(std::sync::Mutex::new(Vec::new())),
            #[cfg(feature = "cuda")]
            cuda: std::sync::Mutex::new(None),
            transports,
            channels,
            node: share,
            cores,
            _server: None,
        };
        comm.open_channels()?;
        Ok(comm)
    }

    /// Makes this communicator's extra channels (`OXCCL_SOCKET_CHANNELS`, `crate::channels`):
    /// communicators `<id>/ch1..` of the same ranks, publishing failures under this one's key
    /// and sharing its cause,
    /// when it has TCP peers and asks for more than one. Their threads start first, so a rank
    /// that cannot start them fails before its peers wait for its channels.
    fn open_channels(&self) -> Result<()> {
        let k = self.channels;
        if k < 2 || !self.shared.sockets {
            return Ok(());
        }
        let pools = crate::channels::pools(self.rank, k - 1)?;
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
            .collect::<Result<Vec<_>>>()?;
        tracing::debug!(rank = self.rank, channels = k, comm = %self.id, "channels ready");
        // Set once, here, before anyone else can see the communicator.
        let _ = self
            .shared
            .channels
            .set(crate::channels::Channels::new(comms, pools));
        Ok(())
    }

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

    /// The transport this rank uses to reach `peer`: `"shm"`, `"tcp"`, or `"self"` for this rank;
    /// `None` for a rank outside the communicator.
    pub fn transport_to(&self, peer: usize) -> Option<&'static str> {
        self.transports.get(peer).copied()
    }

    /// Whether the hierarchical all-reduce can run: the communicator spans at least two nodes,
    /// each with at least two of its ranks (the hierarchical reduce-scatter and all-gather also
    /// need the same number of ranks on every node).
    pub fn is_hierarchical(&self) -> bool {
        self.shared.layout.is_some()
    }

    /// This rank's node as the `auto` rules (`OXCCL_SPIN`, `OXCCL_SOCKET_SEND_THREAD`,
    /// `OXCCL_SOCKET_CHANNELS`) counted it at init: the CPUs its ranks may use together and the
    /// ranks sharing them, the parent's counts included for a communicator made from another.
    /// Layers above use it the same way, e.g. DDP's `Overlap::Auto` (a spare CPU per rank).
    pub fn node_share(&self) -> crate::affinity::NodeShare {
        self.node
    }

    /// Whether this rank's node has `per_rank` CPUs for each of its ranks, as the `auto` rules
    /// counted them at init ([`Communicator::node_share`]; this process's CPU count then where a
    /// rank's CPU list is unknown): 1 is what `OXCCL_SPIN=auto` asks, 2 what
    /// `OXCCL_SOCKET_SEND_THREAD=auto` asks (a CPU to spare beside the rank's own thread).
    pub fn node_holds(&self, per_rank: usize) -> bool {
        self.node.holds(per_rank, self.cores)
    }

    /// Whether this rank's waits busy-poll before they yield the core (`OXCCL_SPIN`,
    /// [`Config::spin`], `auto` resolved at init).
    pub fn spins(&self) -> bool {
        self.shared.spin
    }

    /// How many exchanges so far sent their large messages to TCP peers from this rank's send
    /// thread (`OXCCL_SOCKET_SEND_THREAD`; [`Config::socket_send_thread`]), or `None` when this
    /// communicator has no send thread.
    pub fn send_thread_exchanges(&self) -> Option<u64> {
        self.shared
            .send_thread
            .as_ref()
            .map(|t| t.exchanges.load(Ordering::Relaxed))
    }

    /// Channels this communicator runs (`OXCCL_SOCKET_CHANNELS`, [`Config::socket_channels`],
    /// `auto` resolved at init): 1 without TCP peers.
    pub fn channels(&self) -> usize {
        self.shared.channels.get().map_or(1, |c| c.comms.len() + 1)
    }

    /// How many operations (all-reduce, broadcast, reduce) were cut across this communicator's
    /// channels
    /// (`OXCCL_SOCKET_CHANNELS`, [`Config::socket_channels`]), or `None` when it has none (one
    /// channel asked for, or no TCP peers).
    pub fn channel_ops(&self) -> Option<u64> {
        self.shared
            .channels
            .get()
            .map(|c| c.ops.load(std::sync::atomic::Ordering::Relaxed))
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
        self.all_gather(&mine, &mut all)?;
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
            .map_err(|e| crate::error::named(names.as_ref(), e))
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
    /// from a watchdog thread while the job hangs. See [`crate::trace`].
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
    /// Whether this rank hosts the store server (its drop takes the store down for everyone).
    #[cfg(feature = "cuda")]
    pub(crate) fn hosts_store(&self) -> bool {
        self._server.is_some()
    }

    /// Whether another rank of this communicator is a thread of this process (same node, same
    /// process id): their streams then share one CUDA context, and its hardware queues.
    #[cfg(feature = "cuda")]
    pub(crate) fn shares_process(&self) -> bool {
        let me = &self.peers[self.rank];
        self.peers
            .iter()
            .any(|p| p.rank != self.rank && p.pid == me.pid && p.node_id == me.node_id)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.shared.stop_worker();
        let mut st = self.shared.exec.lock().unwrap_or_else(|p| p.into_inner());
        st.links.close(Instant::now() + Duration::from_secs(5));
        self.shared.trace.dump_if_set("closed", st.broken.as_ref());
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
mod tests {
    use super::*;
    use crate::bootstrap::MemStore;
    use crate::harness::spawn_world_with;

    #[test]
    fn hash_id_is_fnv1a_64() {
        assert_eq!(hash_id(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(hash_id("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(hash_id("oxccl/world0"), 0x6216_7b10_47cb_0e55);
    }

    /// Every numeric field of a hand-built `Config` out of its range fails init with the field
    /// and its variable named (zero sockets or slots used to divide by zero later).
    #[test]
    fn hand_built_fields_out_of_range_are_refused_at_init() {
        type Tweak = fn(&mut Config);
        let cases: [(&str, Tweak); 10] = [
            ("nsocks", |c| c.nsocks = 0),
            ("nsocks", |c| c.nsocks = 17),
            ("socket_buffer", |c| c.socket_buffer = 4 << 30),
            ("slot_bytes", |c| c.slot_bytes = 100),
            ("nslots", |c| c.nslots = 0),
            ("direct_bytes", |c| c.direct_bytes = 1000),
            ("cuda_ipc_slot", |c| c.cuda_ipc_slot = 0),
            ("hierarchical_block", |c| c.hierarchical_block = 0),
            ("trace_buffer", |c| c.trace_buffer = usize::MAX),
            ("timeout", |c| c.timeout = Duration::ZERO),
        ];
        for (field, tweak) in cases {
            let mut cfg = Config::default();
            tweak(&mut cfg);
            let store: Arc<dyn Store> = Arc::new(MemStore::new());
            match Communicator::init_with_config(0, 1, store, cfg) {
                Err(e @ Error::InvalidArgument { .. }) => {
                    let msg = e.to_string();
                    assert!(msg.contains("rank 0") && msg.contains("init"), "{msg}");
                    assert!(msg.contains(&format!("Config::{field}")), "{msg}");
                }
                other => panic!("{field}: expected InvalidArgument, got {other:?}"),
            }
        }
        assert!(Config::default().check().is_ok());
    }

    #[test]
    fn hand_built_timeout_out_of_range_is_refused_at_init() {
        for t in [Duration::ZERO, Duration::from_secs(u64::MAX), Duration::MAX] {
            let cfg = Config {
                timeout: t,
                ..Config::default()
            };
            let store: Arc<dyn Store> = Arc::new(MemStore::new());
            match Communicator::init_with_config(0, 1, store, cfg) {
                Err(e @ Error::InvalidArgument { .. }) => {
                    let msg = e.to_string();
                    assert!(msg.contains("rank 0") && msg.contains("init"), "{msg}");
                    assert!(msg.contains("timeout") && msg.contains("31536000"), "{msg}");
                }
                other => panic!("timeout {t:?}: expected InvalidArgument, got {other:?}"),
            }
        }
    }

    /// Ranks with different shared settings fail at init with a `Config` error naming the
    /// variable and both values (not later with a time-out).
    #[test]
    fn ranks_with_different_shared_settings_fail_at_init() {
        type Tweak = fn(&mut Config);
        let cases: [(&str, Tweak, &str, &str); 4] = [
            (
                "OXCCL_TRANSPORT",
                |c| c.transport = TransportChoice::Tcp,
                "\"tcp\"",
                "\"auto\"",
            ),
            (
                "OXCCL_ALGO",
                |c| c.algo = crate::tuning::AlgoOverride::parse("all-reduce=ring").unwrap(),
                "\"all-reduce=ring\"",
                "\"\"",
            ),
            (
                "OXCCL_CUDA_STAGE_CHUNK",
                |c| c.cuda_stage_chunk = 1 << 20,
                "\"1048576\"",
                "\"4194304\"",
            ),
            (
                "OXCCL_HIERARCHICAL_BLOCK",
                |c| c.hierarchical_block = 2 << 20,
                "\"2097152\"",
                "\"524288\"",
            ),
        ];
        for (var, tweak, odd_value, usual_value) in cases {
            let results = spawn_world_with(
                3,
                |rank| {
                    let mut c = Config {
                        timeout: Duration::from_secs(20),
                        ..Config::default()
                    };
                    if rank == 2 {
                        tweak(&mut c);
                    }
                    c
                },
                |_| Ok(()),
            );
            for (rank, r) in results.into_iter().enumerate() {
                let msg = match r {
                    Err(Error::Config(msg)) => msg,
                    other => panic!("{var}: rank {rank}: expected Error::Config, got {other:?}"),
                };
                let (other, theirs, mine) = if rank == 2 {
                    (0, usual_value, odd_value)
                } else {
                    (2, odd_value, usual_value)
                };
                for needle in [
                    format!("rank {rank}: init"),
                    format!("rank {other} has {var}={theirs}"),
                    format!("this rank has {var}={mine}"),
                    "every rank".to_owned(),
                ] {
                    assert!(msg.contains(&needle), "{var}: {msg:?} lacks {needle:?}");
                }
            }
        }
    }

    #[test]
    fn equivalent_algo_overrides_compare_equal() {
        let canon = |s: &str| crate::tuning::AlgoOverride::parse(s).unwrap().canonical();
        assert_eq!(
            canon("all-reduce=tree,all-reduce=ring"),
            canon(" all-reduce=ring ")
        );
        assert_ne!(canon("all-reduce=ring"), canon(""));
        assert!(!canon("ring").contains('\n'));
    }

    /// A store whose waits fail the way a store whose host died does.
    #[derive(Debug)]
    struct DeadGets(MemStore);

    impl Store for DeadGets {
        fn set(&self, key: &str, value: &[u8]) -> Result<()> {
            self.0.set(key, value)
        }
        fn get(&self, key: &str, _timeout: Duration) -> Result<Vec<u8>> {
            Err(Error::Store(format!(
                "get on key '{key}' at store 127.0.0.1:1: Connection refused (os error 111)"
            )))
        }
        fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
            self.0.try_get(key)
        }
        fn add(&self, key: &str, delta: i64) -> Result<i64> {
            self.0.add(key, delta)
        }
        fn compare_set(&self, key: &str, exp: Option<&[u8]>, des: &[u8]) -> Result<Vec<u8>> {
            self.0.compare_set(key, exp, des)
        }
        fn delete(&self, key: &str) -> Result<bool> {
            self.0.delete(key)
        }
    }

    fn short() -> Config {
        Config {
            timeout: Duration::from_secs(20),
            ..Config::default()
        }
    }

    #[test]
    fn store_failure_at_init_keeps_its_cause() {
        let store: Arc<dyn Store> = Arc::new(DeadGets(MemStore::new()));
        match Communicator::init_with_config(1, 2, store, short()) {
            Err(Error::Store(msg)) => {
                for needle in ["rank 1: init", "Connection refused", "peer/0"] {
                    assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
                }
            }
            other => panic!("expected Error::Store, got {other:?}"),
        }
    }

    #[test]
    fn missing_peer_at_init_is_a_timeout() {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let cfg = Config {
            timeout: Duration::from_millis(50),
            ..Config::default()
        };
        match Communicator::init_with_config(0, 2, store, cfg) {
            Err(Error::Timeout {
                rank, op, detail, ..
            }) => {
                assert_eq!((rank, op.as_str()), (0, "init"));
                assert!(detail.contains("rank 1 never published"), "{detail}");
            }
            other => panic!("expected Error::Timeout, got {other:?}"),
        }
    }

    #[test]
    fn bad_peer_records_name_this_rank_and_the_key() {
        for (record, needle) in [
            (&b"garbage"[..], "malformed peer record"),
            (&b"5\nnode\n1\n127.0.0.1:1\n\n0\n0"[..], "names rank 5"),
        ] {
            let store: Arc<dyn Store> = Arc::new(MemStore::new());
            // Rank 0's first init on this store uses id `oxccl/world1`.
            store.set("oxccl/world1/peer/1", record).unwrap();
            match Communicator::init_with_config(0, 2, store, short()) {
                Err(Error::Store(msg)) => {
                    for n in ["rank 0: init", "oxccl/world1/peer/1", needle] {
                        assert!(msg.contains(n), "{msg:?} lacks {n:?}");
                    }
                }
                other => panic!("expected Error::Store, got {other:?}"),
            }
        }
    }
}
