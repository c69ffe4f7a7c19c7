//! The communicator: a group of ranks that run collectives together.
//!
//! Created from launcher variables ([`Communicator::from_env`]), explicitly
//! ([`Communicator::init`]) or by splitting another one ([`Communicator::split`]). Creating one is
//! collective: every rank publishes its address in the store, reads everyone else's, and opens its
//! connections. The collectives themselves are in `collectives.rs`.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::net::{IpAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bootstrap::{self, FileStore, Store, StoreAddr, TcpStore, TcpStoreServer};
use crate::config::{Config, TransportChoice};
use crate::engine::Shared;
use crate::error::{Error, Result};
use crate::prims::{Links, NodeLayout};
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
    node_id: String,
    node_index: usize,
    pub(crate) peers: Vec<PeerInfo>,
    pub(crate) id: String,
    pub(crate) store: Arc<dyn Store>,
    store_host: Option<IpAddr>,
    pub(crate) cfg: Config,
    splits: AtomicU64,
    /// Reused working copy of out-of-place reduce-scatter inputs (8-byte aligned words), so a
    /// call does not allocate and fault in a fresh buffer every time.
    pub(crate) scratch: std::sync::Mutex<Vec<u64>>,
    /// State of device operations (pinned staging, the stream flag), made by the first one.
    #[cfg(feature = "cuda")]
    pub(crate) cuda: std::sync::Mutex<Option<crate::cuda::DeviceState>>,
    /// Transport to every peer (`"self"` for this rank).
    transports: Vec<&'static str>,
    /// The store server, when this rank hosts it (rank 0 without a launcher-hosted store).
    _server: Option<TcpStoreServer>,
}

static WORLD_COUNTER: AtomicU64 = AtomicU64::new(0);

fn hash_id(id: &str) -> u64 {
    let mut h = DefaultHasher::new();
    id.hash(&mut h);
    h.finish()
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
    let own = Arc::new(seg);
    let mut segs: Vec<Option<Arc<Segment>>> = vec![None; peers.len()];
    segs[rank] = Some(own.clone());
    let mut can_read_all = cfg.single_copy;
    let result = (|| {
        store.set(
            &format!("{id}/shm/{rank}"),
            path.to_string_lossy().as_bytes(),
        )?;
        for (ring, &p) in shm_peers.iter().enumerate() {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            let peer_path =
                String::from_utf8_lossy(&store.get(&format!("{id}/shm/{p}"), left)?).into_owned();
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
            store.add(&format!("{id}/shm_mapped/{p}"), 1)?;
            tracing::info!(rank, peer = p, transport = "shm", segment = %peer_path, "connected");
        }
        // Unlink once every peer has mapped it: the mappings stay, the name goes.
        let mut backoff = Duration::from_micros(100);
        while store.add(&format!("{id}/shm_mapped/{rank}"), 0)? < shm_peers.len() as i64 {
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
        store.set(
            &format!("{id}/single_copy/{rank}"),
            if can_read_all { b"1" } else { b"0" },
        )?;
        let mut single_copy = true;
        for p in 0..peers.len() {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            single_copy &= store.get(&format!("{id}/single_copy/{p}"), left)? == b"1";
        }
        let segs: Vec<Arc<Segment>> =
            segs.iter().cloned().collect::<Option<_>>().ok_or_else(|| {
                Error::Config(format!("rank {rank}: a shared-memory peer has no segment"))
            })?;
        let pids = peers.iter().map(|p| p.pid).collect();
        tracing::info!(rank, staging = direct, single_copy, "shared-memory window");
        Ok(Some(ShmWindow::new(rank, segs, pids, single_copy)))
    })();
    let _ = std::fs::remove_file(&path);
    result.map(|w| (own, w))
}

impl Communicator {
    /// Creates the world communicator from launcher variables: `oxccl launch`, torchrun, Slurm or
    /// OpenMPI (see docs/ENV.md for the order and the variables).
    ///
    /// # Errors
    /// `Error::Config` when no launcher variables are found or they are inconsistent; store and
    /// transport errors while connecting.
    pub fn from_env() -> Result<Communicator> {
        crate::logging::init();
        let info = bootstrap::detect_from_env()?;
        let cfg = Config::from_env()?;
        let (store, server, store_host): (Arc<dyn Store>, Option<TcpStoreServer>, Option<IpAddr>) =
            match &info.store {
                StoreAddr::Tcp { host, port } => {
                    let (client, server) =
                        TcpStore::host_or_connect(host, *port, info.host_store, cfg.timeout)?;
                    (Arc::new(client), server, resolve_ip(host))
                }
                StoreAddr::File(path) => (Arc::new(FileStore::new(path.clone())?), None, None),
            };
        let n = WORLD_COUNTER.fetch_add(1, Ordering::Relaxed);
        let id = format!("{}/world{n}", info.job_id);
        let mut c = Self::init_inner(info.rank, info.world_size, store, cfg, id, store_host)?;
        c._server = server;
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
        let generation = store.add(&format!("oxccl/inits/{rank}"), 1)?;
        Self::init_inner(
            rank,
            size,
            store,
            cfg,
            format!("oxccl/world{generation}"),
            None,
        )
    }

    fn init_inner(
        rank: usize,
        size: usize,
        store: Arc<dyn Store>,
        cfg: Config,
        id: String,
        store_host: Option<IpAddr>,
    ) -> Result<Communicator> {
        if size == 0 || rank >= size {
            return Err(Error::InvalidArgument {
                rank,
                op: "init".into(),
                msg: format!("rank {rank} is not in 0..{size}"),
            });
        }
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
            cpus: crate::affinity::allowed_cpus(),
        };
        store.set(&format!("{id}/peer/{rank}"), &me.encode())?;
        let mut peers = Vec::with_capacity(size);
        for r in 0..size {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            let rec = store
                .get(&format!("{id}/peer/{r}"), left)
                .map_err(|e| match e {
                    Error::Store(msg) => Error::Timeout {
                        rank,
                        op: "init".into(),
                        timeout: cfg.timeout,
                        detail: format!("rank {r} never published its address ({msg})"),
                    },
                    other => other,
                })?;
            let p = PeerInfo::decode(&rec)?;
            if p.rank != r {
                return Err(Error::Store(format!(
                    "peer record {r} names rank {}",
                    p.rank
                )));
            }
            peers.push(p);
        }
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
        // lists, this process's own.
        let lists: Vec<&[usize]> = same_node.iter().map(|&r| &peers[r].cpus[..]).collect();
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let spin = cfg.spin.unwrap_or_else(|| {
            crate::affinity::enough_cpus(&lists).unwrap_or(same_node.len() <= cores)
        });
        tracing::debug!(
            rank,
            local_ranks = same_node.len(),
            cpus = %crate::affinity::encode_cpus(&peers[rank].cpus),
            spin,
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
                "hierarchical layout"
            );
        }
        let mut shared = Shared::new(rank, size, spin, &cfg, links, store.clone(), &id);
        shared.layout = layout;
        // From what every rank knows alike (not from this rank's own peers), so all pick the
        // same ring blocks.
        shared.sockets = (0..size).any(|a| (a + 1..size).any(|b| !shm_ok(a, b)));
        let shared = Arc::new(shared);
        Ok(Communicator {
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
            scratch: std::sync::Mutex::new(Vec::new()),
            #[cfg(feature = "cuda")]
            cuda: std::sync::Mutex::new(None),
            transports,
            _server: None,
        })
    }

    /// This rank, in `0..size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
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

    /// Whether the hierarchical algorithms can run: the communicator spans at least two nodes,
    /// each with the same number (at least two) of its ranks.
    pub fn is_hierarchical(&self) -> bool {
        self.shared.layout.is_some()
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
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .unwrap_or(0);
        let id = format!("{}/split{k}/c{c}", self.id);
        let mut cfg = self.cfg.clone();
        cfg.node_id = Some(self.node_id.clone());
        Self::init_inner(
            new_rank,
            members.len(),
            self.store.clone(),
            cfg,
            id,
            self.store_host,
        )
        .map(Some)
    }

    /// Fails the operation in progress and every later one with `Aborted`, and tells the peers
    /// (they fail with the same cause). Safe to call from any thread, e.g. a watchdog.
    pub fn abort(&self) {
        self.shared.abort();
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
