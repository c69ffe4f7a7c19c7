//! The RDMA row of the transport table: which pairs it connects, and how their queue pairs meet.
//!
//! With `OXCCL_IB_PROVIDER=sim` (ranks that are threads of one process, on simulated nodes)
//! each rank makes, in `setup`, one in-process queue pair per peer for the data it sends, keeps
//! the sending end, and leaves the receiving end in this process's registry under a number it
//! publishes through the store (`{id}/rdma/{from}/{to}`); `connect` takes the ends its peers
//! left for it. The verbs provider (feature `rdma`) is not built yet: without it this row
//! answers "unsupported", and `auto` goes on to TCP.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::conn::{Ends, RdmaRecv, RdmaSend};
use super::proto::HEADER;
use super::sim::{pair, SimQp};
use crate::base::config::{Config, IbProvider};
use crate::base::error::{Error, Result};
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
        IbProvider::Verbs => Reach::Unsupported("rdma"),
        IbProvider::Sim if a.pid == b.pid => Reach::Yes,
        IbProvider::Sim => Reach::No(format!(
            "OXCCL_IB_PROVIDER=sim connects ranks of one process; ranks {} and {} are processes {} and {}",
            a.rank, b.rank, a.pid, b.pid
        )),
    }
}

/// This rank's RDMA connections of one communicator.
pub(crate) struct RdmaTransport {
    slots: usize,
    payload: usize,
    /// The sending ends made in `setup`, by peer.
    sending: HashMap<usize, SimQp>,
    /// Registry keys of the receiving ends this rank left, to take back if it never connects.
    left: Vec<u64>,
}

impl RdmaTransport {
    /// Slots of `cfg.slot_bytes` per direction, `cfg.nslots` of them (at least 2).
    pub(crate) fn new(cfg: &Config) -> RdmaTransport {
        RdmaTransport {
            slots: cfg.nslots.max(2),
            payload: cfg.slot_bytes,
            sending: HashMap::new(),
            left: Vec::new(),
        }
    }
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

    fn setup(&mut self, group: &Group<'_>, peers: &[usize]) -> Result<()> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        for &p in peers {
            let (send, recv, _) = pair(self.slots * (HEADER + self.payload));
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
        let me = group.rank;
        for &p in peers {
            let k = key(group.id, p, me);
            let left = group.deadline.saturating_duration_since(Instant::now());
            let v = group.store.get(&k, left.max(Duration::from_millis(1)))?;
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
            links.send[p] = Some(Box::new(RdmaSend::new(
                send,
                self.slots,
                self.payload,
                ends,
            )));
            links.recv[p] = Some(Box::new(RdmaRecv::new(
                recv,
                self.slots,
                self.payload,
                ends,
            )));
        }
        // Every peer took its ends (it connected): nothing is left for this rank to free.
        self.left.clear();
        Ok(())
    }
}
