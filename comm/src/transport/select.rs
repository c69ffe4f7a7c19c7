//! The transport table and the selector: which backend connects each pair of ranks.
//!
//! [`backends`] is the table, in priority order, like NCCL's `ncclTransports`: CUDA IPC (device
//! memory; a row that answers "unsupported: feature `cuda`" without that feature), shared
//! memory, RDMA (between nodes, where a provider can connect the pair), TCP. For every pair of
//! ranks the [`Selector`] walks it and takes, for each kind of memory, the first backend that
//! can connect the pair and that `OXCCL_TRANSPORT` allows (`auto`: all; `shm` or `tcp`: only
//! that one carries host memory; `rdma`: shared memory and RDMA). Every rule is a pure function
//! of the two ranks' records and the settings every rank shares (checked equal at init), so
//! every rank computes the same route for every pair without asking anyone. A new backend is
//! one more folder under `transport/` and one more row here.

use std::sync::Arc;

use super::{rdma, shm, tcp, CanConnect, Group, Links, Memory, PeerInfo, Reach, Transport};
use crate::base::config::{Config, TransportChoice};
use crate::base::error::{Error, Result};

/// This rank's backends for one communicator, in priority order (see the module docs). TCP
/// binds its listener here, before the ranks exchange records (its address goes into them).
///
/// # Errors
/// TCP cannot bind (no interface matches `OXCCL_SOCKET_IFNAME`, or binding fails).
pub(crate) fn backends(
    rank: usize,
    comm_hash: u64,
    cfg: &Config,
    store_host: Option<std::net::IpAddr>,
) -> Result<Vec<Box<dyn Transport>>> {
    Ok(vec![
        cuda_ipc(),
        Box::new(shm::ShmTransport::default()),
        Box::new(rdma::RdmaTransport::new(cfg)),
        Box::new(tcp::TcpTransport::bind(rank, comm_hash, cfg, store_host)?),
    ])
}

#[cfg(feature = "cuda-core")]
fn cuda_ipc() -> Box<dyn Transport> {
    Box::new(super::cuda_ipc::CudaIpcTransport)
}

#[cfg(not(feature = "cuda-core"))]
fn cuda_ipc() -> Box<dyn Transport> {
    Box::new(CompiledOut {
        name: "cuda_ipc",
        memory: Memory::Device,
    })
}

/// A row of the table whose backend this build leaves out (CUDA IPC without the `cuda`
/// feature): it answers [`Reach::Unsupported`] with the cargo feature that brings it, so the
/// selector never gives it a peer.
#[cfg_attr(feature = "cuda-core", allow(dead_code))]
struct CompiledOut {
    name: &'static str,
    memory: Memory,
}

#[cfg_attr(feature = "cuda-core", allow(dead_code))]
fn compiled_out(_: &PeerInfo, _: &PeerInfo, _: &Config) -> Reach {
    Reach::Unsupported("cuda")
}

impl Transport for CompiledOut {
    fn name(&self) -> &'static str {
        self.name
    }

    fn memory(&self) -> Memory {
        self.memory
    }

    fn can_connect(&self) -> CanConnect {
        compiled_out
    }

    fn setup(&mut self, _: &Group<'_>, _: &[usize]) -> Result<()> {
        Ok(()) // never given a peer (it can connect none)
    }

    fn connect(&mut self, _: &Group<'_>, _: &[usize], _: &mut Links) -> Result<()> {
        Ok(())
    }
}

/// One row of the table as the selector sees it.
#[derive(Clone, Copy)]
struct Rule {
    name: &'static str,
    memory: Memory,
    can: CanConnect,
}

/// Picks the backend of every pair of ranks from the table (see the module docs).
pub(crate) struct Selector {
    rules: Vec<Rule>,
    cfg: Arc<Config>,
}

impl Selector {
    /// The selector over `backends` (in priority order) with the communicator's settings.
    pub(crate) fn new(backends: &[Box<dyn Transport>], cfg: &Config) -> Selector {
        Selector {
            rules: backends
                .iter()
                .map(|b| Rule {
                    name: b.name(),
                    memory: b.memory(),
                    can: b.can_connect(),
                })
                .collect(),
            cfg: Arc::new(cfg.clone()),
        }
    }

    /// Whether `OXCCL_TRANSPORT` lets backend `name` carry host memory.
    fn allowed(&self, name: &str) -> bool {
        match self.cfg.transport {
            TransportChoice::Auto => true,
            TransportChoice::Shm => name == "shm",
            TransportChoice::Tcp => name == "tcp",
            TransportChoice::Rdma => name == "rdma" || name == "shm",
        }
    }

    /// The backend that carries host memory between `a` and `b`: the first of the table that
    /// can connect them and that `OXCCL_TRANSPORT` allows; otherwise why none can.
    ///
    /// # Errors
    /// Each backend's reason, joined.
    pub(crate) fn host(
        &self,
        a: &PeerInfo,
        b: &PeerInfo,
    ) -> std::result::Result<&'static str, String> {
        let mut why = Vec::new();
        for r in self.rules.iter().filter(|r| r.memory == Memory::Host) {
            if !self.allowed(r.name) {
                continue;
            }
            match (r.can)(a, b, &self.cfg) {
                Reach::Yes => return Ok(r.name),
                Reach::No(reason) => why.push(format!("{}: {reason}", r.name)),
                Reach::Unsupported(feature) => {
                    why.push(format!("{}: needs feature `{feature}`", r.name))
                }
            }
        }
        Err(why.join("; "))
    }

    /// The backend that carries device memory between `a` and `b`, if one can (device buffers
    /// between other pairs are staged through pinned host memory over the host backend).
    pub(crate) fn device(&self, a: &PeerInfo, b: &PeerInfo) -> Option<&'static str> {
        self.rules
            .iter()
            .filter(|r| r.memory == Memory::Device)
            .find(|r| (r.can)(a, b, &self.cfg) == Reach::Yes)
            .map(|r| r.name)
    }

    /// The host backend to every rank from `me` (`"self"` for `me`).
    ///
    /// # Errors
    /// `Error::Config` for the first peer no allowed backend can reach, naming both ranks,
    /// their nodes, `OXCCL_TRANSPORT` and each backend's reason.
    pub(crate) fn routes(&self, me: usize, peers: &[PeerInfo]) -> Result<Vec<&'static str>> {
        peers
            .iter()
            .map(|p| {
                if p.rank == me {
                    return Ok("self");
                }
                self.host(&peers[me], p).map_err(|why| {
                    let setting = match self.cfg.transport {
                        TransportChoice::Auto => String::new(),
                        c => format!("OXCCL_TRANSPORT={}, but ", c.name()),
                    };
                    Error::Config(format!(
                        "rank {me}: {setting}no transport connects this rank (node {:?}) to \
                         rank {} (node {:?}): {why}",
                        peers[me].node_id, p.rank, p.node_id
                    ))
                })
            })
            .collect()
    }
}

/// Sets up, then connects, every backend of `backends` with the peers the selector gave it
/// (setting up every backend before connecting any, so that no rank waits in one backend for a
/// peer that waits in another); logs each peer's route. Returns the host backend of every rank
/// (`"self"` for this one).
///
/// # Errors
/// No backend can reach some peer; a backend's set-up or connect fails.
pub(crate) fn connect_all(
    backends: &mut [Box<dyn Transport>],
    group: &Group<'_>,
    links: &mut Links,
) -> Result<Vec<&'static str>> {
    let me = group.rank;
    let routes = group.selector.routes(me, group.peers)?;
    let device: Vec<Option<&'static str>> = group
        .peers
        .iter()
        .map(|p| {
            (p.rank != me)
                .then(|| group.selector.device(&group.peers[me], p))
                .flatten()
        })
        .collect();
    // Device buffers between a pair without a device backend are staged through pinned host
    // memory over the host backend (with the `cuda` feature; there are none without it).
    let staged = if cfg!(feature = "cuda-core") {
        "staged"
    } else {
        "none (feature cuda)"
    };
    for (p, host) in routes.iter().enumerate().filter(|&(p, _)| p != me) {
        let device = device[p].unwrap_or(staged);
        tracing::info!(rank = me, peer = p, host, device, "transport selected");
    }
    let given = |b: &dyn Transport| -> Vec<usize> {
        let name = b.name();
        (0..group.size)
            .filter(|&p| match b.memory() {
                Memory::Host => p != me && routes[p] == name,
                Memory::Device => device[p] == Some(name),
            })
            .collect()
    };
    let peers: Vec<Vec<usize>> = backends.iter().map(|b| given(b.as_ref())).collect();
    if let Err(e) = set_up_and_connect(backends, &peers, group, links) {
        group.publish_failure(&e);
        return Err(e);
    }
    Ok(routes)
}

/// Every backend's set-up, then every backend's connect, each with its `peers`.
fn set_up_and_connect(
    backends: &mut [Box<dyn Transport>],
    peers: &[Vec<usize>],
    group: &Group<'_>,
    links: &mut Links,
) -> Result<()> {
    for (b, ps) in backends.iter_mut().zip(peers) {
        if !ps.is_empty() {
            b.setup(group, ps)?;
        }
    }
    for (b, ps) in backends.iter_mut().zip(peers) {
        if !ps.is_empty() {
            b.connect(group, ps, links)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(rank: usize, node: &str) -> PeerInfo {
        PeerInfo {
            rank,
            node_id: node.into(),
            pid: 1,
            tcp_addr: "127.0.0.1:1".into(),
            cpus: Vec::new(),
            node_ranks: 0,
            node_cpus: 0,
            rdma: String::new(),
            settings: Vec::new(),
        }
    }

    fn selector(transport: TransportChoice) -> Selector {
        let cfg = Config {
            transport,
            ..Config::default()
        };
        let rule = |name, memory, can| Rule { name, memory, can };
        Selector {
            rules: vec![
                rule("cuda_ipc", Memory::Device, super::super::same_node),
                rule("shm", Memory::Host, shm::can_connect),
                rule("tcp", Memory::Host, tcp::can_connect),
            ],
            cfg: Arc::new(cfg),
        }
    }

    #[test]
    fn the_first_backend_that_can_connect_a_pair_carries_it() {
        let peers = [rec(0, "a"), rec(1, "a"), rec(2, "b")];
        let s = selector(TransportChoice::Auto);
        assert_eq!(s.routes(0, &peers).unwrap(), ["self", "shm", "tcp"]);
        assert_eq!(s.routes(2, &peers).unwrap(), ["tcp", "tcp", "self"]);
        assert_eq!(s.device(&peers[0], &peers[1]), Some("cuda_ipc"));
        assert_eq!(s.device(&peers[0], &peers[2]), None);
        // Every rank sees the same route for a pair, whichever end asks.
        for a in &peers {
            for b in &peers {
                if a.rank != b.rank {
                    assert_eq!(s.host(a, b), s.host(b, a));
                }
            }
        }
    }

    #[test]
    fn oxccl_transport_overrides_the_table() {
        let peers = [rec(0, "a"), rec(1, "a"), rec(2, "b")];
        let tcp = selector(TransportChoice::Tcp);
        assert_eq!(tcp.routes(0, &peers).unwrap(), ["self", "tcp", "tcp"]);
        let shm = selector(TransportChoice::Shm);
        assert_eq!(shm.routes(1, &peers[..2]).unwrap(), ["shm", "self"]);
        let e = shm.routes(0, &peers).unwrap_err().to_string();
        assert!(
            e.contains("OXCCL_TRANSPORT=shm")
                && e.contains("rank 2 (node \"b\")")
                && e.contains("shared memory only connects ranks of one node"),
            "{e}"
        );
    }

    #[test]
    fn a_compiled_out_backend_says_which_feature_brings_it() {
        let out = CompiledOut {
            name: "cuda_ipc",
            memory: Memory::Device,
        };
        let (a, b) = (rec(0, "a"), rec(1, "a"));
        assert_eq!(
            (out.can_connect())(&a, &b, &Config::default()),
            Reach::Unsupported("cuda")
        );
        let s = Selector::new(&[Box::new(out) as Box<dyn Transport>], &Config::default());
        assert_eq!(s.device(&a, &b), None);
        assert!(s.host(&a, &b).is_err());
    }
}
