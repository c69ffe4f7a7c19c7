//! A rank's verbs queue pairs of one communicator. Each direction of each pair of ranks is one
//! queue pair at either end: the sender's (it writes the data; the credits come back to it)
//! and the receiver's (its region is the ring).
//!
//! - `setup` makes both of this rank's queue pairs per peer in the INIT state (receives posted)
//!   and publishes their addresses: `{id}/rdma/{from}/{to}/send` by the sender,
//!   `{id}/rdma/{from}/{to}/recv` by the receiver;
//! - `connect` reads the peer's two, checks them ([`pair_mtu`]), brings both queue pairs to
//!   ready-to-send, publishes `{id}/rdma/{me}/{peer}/up`, and returns once every peer's `up` is
//!   there, so that no write reaches a queue pair that cannot take it yet.

use std::collections::HashMap;
use std::sync::Arc;

use super::super::address::{pair_mtu, QpAddress};
use super::super::conn::{install, Ends};
use super::super::proto::{CONTROL, HEADER, OFFERS};
use super::qp::{UserMr, VerbsQp};
use super::Nic;
use crate::base::config::IbConfig;
use crate::base::error::{Error, Result};
use crate::transport::registry::{RegCache, Registry};
use crate::transport::{Group, Links};

/// This rank's queue pairs (see the module docs).
pub(crate) struct VerbsSide {
    nic: Arc<Nic>,
    slots: usize,
    payload: usize,
    /// The queue pairs' time-out, retries, traffic class and service level.
    ib: IbConfig,
    /// The registrations of user buffers on this port, shared by the rank's queue pairs.
    user: Arc<RegCache<UserMr>>,
    /// (sending, receiving) queue pair per peer, made in `setup`.
    made: HashMap<usize, (VerbsQp, VerbsQp)>,
}

fn key(id: &str, from: usize, to: usize, what: &str) -> String {
    format!("{id}/rdma/{from}/{to}/{what}")
}

impl VerbsSide {
    pub(crate) fn new(nic: Arc<Nic>, (slots, payload): (usize, usize), ib: IbConfig) -> VerbsSide {
        VerbsSide {
            nic,
            slots,
            payload,
            ib,
            user: Arc::new(RegCache::new(Registry::global())),
            made: HashMap::new(),
        }
    }

    /// The port's name (`mlx5_0:1`).
    pub(crate) fn port_name(&self) -> String {
        self.nic.port_name()
    }

    pub(crate) fn setup(&mut self, group: &Group<'_>, peers: &[usize]) -> Result<()> {
        let ring = self.slots * (HEADER + self.payload);
        // Each side has at most `slots` writes in flight (data or credits), `OFFERS` offers or
        // their acknowledgements, and a goodbye.
        let depth = (self.slots + OFFERS) as u32 + 4;
        let me = group.rank;
        for &p in peers {
            let named = |e: Error| name(e, me, p);
            // The sender's queue pair takes offers into its control area; the receiver's
            // writes them from the same offsets of its own.
            let (send, recv) = ((ring, CONTROL), (CONTROL, ring));
            let send = VerbsQp::new(&self.nic, &self.user, send, depth).map_err(named)?;
            let recv = VerbsQp::new(&self.nic, &self.user, recv, depth).map_err(named)?;
            group
                .store
                .set(&key(group.id, me, p, "send"), &send.address().encode())?;
            group
                .store
                .set(&key(group.id, p, me, "recv"), &recv.address().encode())?;
            self.made.insert(p, (send, recv));
        }
        Ok(())
    }

    fn fetch(&self, group: &Group<'_>, k: &str, peer: usize) -> Result<QpAddress> {
        let v = group.wait_get(k)?;
        QpAddress::decode(&v).map_err(|e| transport(group.rank, peer, format!("{k}: {e}")))
    }

    pub(crate) fn connect(
        &mut self,
        group: &Group<'_>,
        peers: &[usize],
        links: &mut Links,
    ) -> Result<()> {
        let me = group.rank;
        for &p in peers {
            let (mut send, mut recv) = self
                .made
                .remove(&p)
                .ok_or_else(|| transport(me, p, "connect without setup".into()))?;
            let theirs_recv = self.fetch(group, &key(group.id, me, p, "recv"), p)?;
            let theirs_send = self.fetch(group, &key(group.id, p, me, "send"), p)?;
            for (mine, theirs, dir) in [
                (&mut send, &theirs_recv, "to"),
                (&mut recv, &theirs_send, "from"),
            ] {
                let mtu = pair_mtu(&mine.address(), theirs, self.nic.link)
                    .map_err(|e| transport(me, p, format!("queue pair {dir} rank {p}: {e}")))?;
                mine.connect(theirs, mtu, &self.ib)
                    .map_err(|e| name(e, me, p))?;
                tracing::info!(
                    rank = me,
                    peer = p,
                    device = %self.nic.port_name(),
                    gid_index = self.nic.gid_index,
                    link = ?self.nic.link,
                    mtu,
                    traffic_class = self.ib.traffic_class,
                    service_level = self.ib.service_level,
                    "rdma queue pair {dir} rank {p} ready"
                );
            }
            group.store.set(&key(group.id, me, p, "up"), b"1")?;
            let ends = Ends { rank: me, peer: p };
            install(links, (send, recv), self.slots, self.payload, ends);
        }
        for &p in peers {
            group.wait_get(&key(group.id, p, me, "up"))?;
        }
        Ok(())
    }
}

fn transport(rank: usize, peer: usize, msg: String) -> Error {
    Error::Transport {
        rank,
        peer,
        transport: "rdma",
        msg,
    }
}

/// A provider error with the ranks filled in.
fn name(e: Error, rank: usize, peer: usize) -> Error {
    match e {
        Error::Transport { msg, .. } => transport(rank, peer, msg),
        other => other,
    }
}
