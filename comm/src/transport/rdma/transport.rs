//! The RDMA row of the transport table: which pairs it connects, and how their queue pairs meet.
//!
//! With `OXCCL_IB_PROVIDER=sim` (ranks that are threads of one process, on simulated nodes)
//! each rank makes, in `setup`, one in-process queue pair per peer for the data it sends, keeps
//! the sending end, and leaves the receiving end in this process's registry under a number it
//! publishes through the store (`{id}/rdma/{from}/{to}`); `connect` takes the ends its peers
//! left for it.
//!
//! With the verbs provider (feature `rdma`, `OXCCL_IB_PROVIDER=verbs`, the default) each rank
//! opens, when its communicator starts, the first active port `OXCCL_IB_HCA` allows and puts
//! its name in its record (or why it has none); the row connects two ranks on different nodes
//! when both have a port, and [`super::ibv::side`] makes and connects their queue pairs.
//! Without the feature this row answers "unsupported", and `auto` goes on to TCP.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::conn::{install, Ends};
use super::proto::HEADER;
use super::sim::{pair, SimQp};
#[cfg(feature = "rdma")]
use crate::base::config::TransportChoice;
use crate::base::config::{Config, IbProvider};
use crate::base::error::{Error, Result};
use crate::transport::registry::{Entry, RegCache, Registry};
use crate::transport::{CanConnect, Group, Links, Memory, PeerInfo, Reach, Transport};

/// The receiving ends of in-process queue pairs, waiting for their rank's `connect`.
fn registry() -> &'static Mutex<HashMap<u64, SimQp>> {
    static REGISTRY: OnceLock<Mutex<HashMap<u64, SimQp>>> = OnceLock::new();
    REGISTRY.get_or_init(Mutex::default)
}

fn take(key: u64) -> Option<SimQp> {
    registry()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .remove(&key)
}

/// Whether RDMA can connect ranks `a` and `b` (see the module docs).
fn rdma_reach(a: &PeerInfo, b: &PeerInfo, cfg: &Config) -> Reach {
    if a.node_id == b.node_id {
        return Reach::No(format!(
            "ranks {} and {} share node {:?}: RDMA connects nodes",
            a.rank, b.rank, a.node_id
        ));
    }
    match cfg.ib_provider {
        IbProvider::Verbs => verbs_reach(a, b),
        IbProvider::Sim if a.pid == b.pid => Reach::Yes,
        IbProvider::Sim => Reach::No(format!(
            "OXCCL_IB_PROVIDER=sim connects ranks of one process; ranks {} and {} are processes {} and {}",
            a.rank, b.rank, a.pid, b.pid
        )),
    }
}

/// A rank's verbs port from its record: its name, or why it has none.
#[cfg_attr(not(any(feature = "rdma", test)), allow(dead_code))]
fn verbs_port(p: &PeerInfo) -> std::result::Result<&str, String> {
    match p.rdma.strip_prefix('!') {
        Some(why) => Err(format!(
            "rank {} (node {:?}) has no verbs port: {why}",
            p.rank, p.node_id
        )),
        None if p.rdma.is_empty() => Err(format!(
            "rank {} (node {:?}) has no verbs provider (a build without the feature `rdma`)",
            p.rank, p.node_id
        )),
        None => Ok(&p.rdma),
    }
}

/// Two ranks' records: both have a verbs port.
#[cfg_attr(not(any(feature = "rdma", test)), allow(dead_code))]
pub(crate) fn ports_reach(a: &PeerInfo, b: &PeerInfo) -> Reach {
    match (verbs_port(a), verbs_port(b)) {
        (Ok(_), Ok(_)) => Reach::Yes,
        (Err(why), _) | (_, Err(why)) => Reach::No(why),
    }
}

#[cfg(feature = "rdma")]
fn verbs_reach(a: &PeerInfo, b: &PeerInfo) -> Reach {
    ports_reach(a, b)
}

#[cfg(not(feature = "rdma"))]
fn verbs_reach(_: &PeerInfo, _: &PeerInfo) -> Reach {
    Reach::Unsupported("rdma")
}

/// This rank's RDMA connections of one communicator.
pub(crate) struct RdmaTransport {
    slots: usize,
    payload: usize,
    /// The sending ends made in `setup`, by peer.
    sending: HashMap<usize, SimQp>,
    /// Registry keys of the receiving ends this rank left, to take back if it never connects.
    left: Vec<u64>,
    /// The in-process queue pairs' registrations of user buffers, shared by this rank's.
    user: Arc<RegCache<Entry>>,
    /// The verbs queue pairs on this rank's port, or why it has none (`None`: not probed).
    #[cfg(feature = "rdma")]
    verbs: Option<std::result::Result<super::ibv::side::VerbsSide, String>>,
}

impl RdmaTransport {
    /// Slots of `cfg.slot_bytes` per direction, `cfg.nslots` of them (at least 2); with the
    /// verbs provider, this rank's port opened (see the module docs).
    pub(crate) fn new(cfg: &Config) -> RdmaTransport {
        let slots = cfg.nslots.max(2);
        RdmaTransport {
            slots,
            payload: cfg.slot_bytes,
            sending: HashMap::new(),
            left: Vec::new(),
            user: Arc::new(RegCache::new(Registry::global())),
            #[cfg(feature = "rdma")]
            verbs: probe(cfg).map(|r| {
                r.map(|nic| {
                    super::ibv::side::VerbsSide::new(nic, (slots, cfg.slot_bytes), cfg.ib.clone())
                })
            }),
        }
    }
}

/// This rank's verbs port, where the settings may use one.
#[cfg(feature = "rdma")]
fn probe(cfg: &Config) -> Option<std::result::Result<std::sync::Arc<super::ibv::Nic>, String>> {
    let wanted = matches!(cfg.transport, TransportChoice::Auto | TransportChoice::Rdma);
    if !wanted || cfg.ib_provider != IbProvider::Verbs {
        return None;
    }
    let r = super::ibv::open(cfg.ib.hca.as_deref(), cfg.ib.gid_index);
    match &r {
        Ok(nic) => tracing::info!(
            device = %nic.port_name(),
            link = ?nic.link,
            lid = nic.lid,
            gid_index = nic.gid_index,
            mtu = nic.mtu,
            "rdma: verbs port"
        ),
        Err(why) => tracing::info!("rdma: no verbs port: {why}"),
    }
    Some(r)
}

impl Drop for RdmaTransport {
    fn drop(&mut self) {
        // Ends no peer took (a failed start): nothing else would free them.
        for key in self.left.drain(..) {
            drop(take(key));
        }
    }
}

fn key(id: &str, from: usize, to: usize) -> String {
    format!("{id}/rdma/{from}/{to}")
}

impl RdmaTransport {
    /// The verbs side, which the selector only gives peers when this rank has a port.
    #[cfg(feature = "rdma")]
    fn verbs(&mut self, rank: usize) -> Result<&mut super::ibv::side::VerbsSide> {
        match &mut self.verbs {
            Some(Ok(side)) => Ok(side),
            Some(Err(why)) => Err(Error::Config(format!("rank {rank}: rdma: {why}"))),
            None => Err(Error::Config(format!(
                "rank {rank}: rdma: the verbs port was not probed (OXCCL_TRANSPORT excludes RDMA)"
            ))),
        }
    }

    #[cfg(not(feature = "rdma"))]
    fn verbs(&mut self, rank: usize) -> Result<&mut Unbuilt> {
        Err(Error::Config(format!(
            "rank {rank}: rdma: the verbs provider needs the feature `rdma`"
        )))
    }
}

/// The verbs side of a build without it (never made).
#[cfg(not(feature = "rdma"))]
pub(crate) enum Unbuilt {}

#[cfg(not(feature = "rdma"))]
impl Unbuilt {
    fn setup(&mut self, _: &Group<'_>, _: &[usize]) -> Result<()> {
        match *self {}
    }

    fn connect(&mut self, _: &Group<'_>, _: &[usize], _: &mut Links) -> Result<()> {
        match *self {}
    }
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn memory(&self) -> Memory {
        Memory::Host
    }

    fn can_connect(&self) -> CanConnect {
        rdma_reach
    }

    fn advertise(&self, me: &mut PeerInfo) {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.verbs {
            me.rdma = match r {
                Ok(side) => side.port_name(),
                Err(why) => format!("!{}", why.replace('\n', " ")),
            };
        }
        let _ = me;
    }

    fn setup(&mut self, group: &Group<'_>, peers: &[usize]) -> Result<()> {
        if group.cfg.ib_provider == IbProvider::Verbs {
            return self.verbs(group.rank)?.setup(group, peers);
        }
        static NEXT: AtomicU64 = AtomicU64::new(1);
        for &p in peers {
            let (send, recv, _) = pair(self.slots * (HEADER + self.payload), &self.user);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            registry()
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(n, recv);
            self.left.push(n);
            self.sending.insert(p, send);
            let k = key(group.id, group.rank, p);
            group.store.set(&k, &n.to_le_bytes())?;
        }
        Ok(())
    }

    fn connect(&mut self, group: &Group<'_>, peers: &[usize], links: &mut Links) -> Result<()> {
        if group.cfg.ib_provider == IbProvider::Verbs {
            return self.verbs(group.rank)?.connect(group, peers, links);
        }
        let me = group.rank;
        for &p in peers {
            let k = key(group.id, p, me);
            let v = group.wait_get(&k)?;
            let n = u64::from_le_bytes(v.as_slice().try_into().map_err(|_| {
                Error::Store(format!("rank {me}: {k}: expected 8 bytes, got {}", v.len()))
            })?);
            let recv = take(n).ok_or_else(|| Error::Transport {
                rank: me,
                peer: p,
                transport: "rdma",
                msg: format!("no in-process queue pair {n} left by rank {p} (another process?)"),
            })?;
            let send = self.sending.remove(&p).ok_or_else(|| Error::Transport {
                rank: me,
                peer: p,
                transport: "rdma",
                msg: "connect without setup".into(),
            })?;
            let ends = Ends { rank: me, peer: p };
            install(links, (send, recv), self.slots, self.payload, ends);
        }
        // Every peer took its ends (it connected): nothing is left for this rank to free.
        self.left.clear();
        Ok(())
    }
}
