//! The send and receive halves of an RDMA connection ([`crate::transport::SendConn`],
//! [`crate::transport::RecvConn`]) over any [`QueuePair`]: the slots of the transport model are
//! the ring of [`super::proto`] in registered memory; posting a slot is a write with immediate,
//! releasing one a credit written back. A large message from a registered user buffer
//! ([`crate::Registered`]) goes out by writes straight from the buffer into the peer's slots
//! ([`crate::transport::SendConn::send_direct`]): the slot's header comes from the send region, its payload from
//! the buffer, both in one write. A large message copied into a registered buffer is offered to
//! the sender ([`crate::transport::RecvConn::recv_direct`]), which writes the rest of it straight there (the
//! rendezvous of [`super::proto`]), from the sender's registered buffer or from its slots.
//!
//! `send.rs` holds the send half, `recv.rs` the receive half; this file what both use.

mod recv;
mod send;

use std::sync::Arc;

pub(crate) use recv::RdmaRecv;
pub(crate) use send::RdmaSend;

use super::proto::{ProtoError, GOODBYE, GOODBYE_WR};
use super::verbs::{Completion, QueuePair};
use crate::base::error::{Error, Result};
use crate::base::op::Tag;

/// Work request ids of writes from a user buffer carry this bit and the payload's length (the
/// ids of slot writes never have it; [`GOODBYE_WR`] is filtered out first).
const DIRECT_WR: u64 = 1 << 62;

/// Work request ids of control writes (offers and their acknowledgements): their completions
/// free nothing. Slot writes' ids are their tags' sequence numbers below this bit.
const CONTROL_WR: u64 = 1 << 61;

/// Which connection, for errors.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ends {
    /// This rank.
    pub rank: usize,
    /// The peer.
    pub peer: usize,
}

impl Ends {
    fn proto(&self, e: ProtoError) -> Error {
        Error::Transport {
            rank: self.rank,
            peer: self.peer,
            transport: "rdma",
            msg: format!("protocol: {}", e.0),
        }
    }

    fn failed(&self, status: u32, what: &str) -> Error {
        Error::PeerLost {
            rank: self.rank,
            peer: self.peer,
            op: "rdma".into(),
            detail: format!("queue pair in error: completion status {status} ({what})"),
        }
    }

    /// The provider's error with this connection's ranks filled in.
    fn named(&self, e: Error) -> Error {
        match e {
            Error::Transport { msg, .. } => Error::Transport {
                rank: self.rank,
                peer: self.peer,
                transport: "rdma",
                msg,
            },
            other => other,
        }
    }
}

fn put_header(slot: &mut [u8], tag: Tag, len: usize) {
    for (i, w) in [tag.seq, tag.desc, tag.count, len as u64]
        .into_iter()
        .enumerate()
    {
        slot[8 * i..8 * i + 8].copy_from_slice(&w.to_le_bytes());
    }
}

fn get_header(slot: &[u8]) -> (Tag, usize) {
    let w = |i: usize| u64::from_le_bytes(slot[8 * i..8 * i + 8].try_into().expect("8 bytes"));
    (
        Tag {
            seq: w(0),
            desc: w(1),
            count: w(2),
        },
        w(3) as usize,
    )
}

/// What a completion means to the protocol.
enum Event {
    /// One of this side's writes completed (its work request id).
    Wrote(u64),
    /// The peer's immediate (not a goodbye) and the bytes its write carried.
    Imm(u32, usize),
}

/// What both halves hold: the queue pair, whom it connects, whether the peer said goodbye,
/// and the completions buffer.
struct End<Q: QueuePair> {
    qp: Q,
    ends: Ends,
    peer_closed: bool,
    comps: Vec<Completion>,
}

impl<Q: QueuePair> End<Q> {
    fn new(qp: Q, ends: Ends) -> End<Q> {
        End {
            qp,
            ends,
            peer_closed: false,
            comps: Vec::new(),
        }
    }

    /// Polls the queue pair and hands each completion to `on`; a goodbye marks the peer
    /// closed, a completion in error is `PeerLost` naming the peer. True when anything arrived.
    fn drain(
        &mut self,
        mut on: impl FnMut(Event) -> std::result::Result<(), ProtoError>,
    ) -> Result<bool> {
        let ends = self.ends;
        self.comps.clear();
        self.qp.poll(&mut self.comps).map_err(|e| ends.named(e))?;
        let moved = !self.comps.is_empty();
        for c in self.comps.drain(..) {
            match c {
                Completion::WriteDone { wr_id: GOODBYE_WR } => {}
                Completion::WriteDone { wr_id } => {
                    on(Event::Wrote(wr_id)).map_err(|e| ends.proto(e))?;
                }
                Completion::Imm { imm: GOODBYE, .. } => self.peer_closed = true,
                Completion::Imm { imm, len } => {
                    on(Event::Imm(imm, len)).map_err(|e| ends.proto(e))?;
                }
                Completion::Error { status, what, .. } => return Err(ends.failed(status, &what)),
            }
        }
        Ok(moved)
    }

    /// The peer closed its side: `op` can never complete.
    fn closed(&self, op: &str, who: &str) -> Error {
        Error::PeerLost {
            rank: self.ends.rank,
            peer: self.ends.peer,
            op: op.into(),
            detail: format!("the {who} closed the connection"),
        }
    }

    fn write(&mut self, wr_id: u64, src: usize, len: usize, dst: usize, imm: u32) -> Result<()> {
        let ends = self.ends;
        self.qp
            .write_imm(wr_id, src, len, dst, imm)
            .map_err(|e| ends.named(e))
    }
}

/// Puts the two halves of a connection to `ends.peer` into `links`: `send` writes this rank's
/// data into the peer's ring, `recv` holds this rank's ring (rings of `slots` slots of
/// `payload` bytes).
pub(crate) fn install<Q: QueuePair + 'static>(
    links: &mut crate::transport::Links,
    (send, recv): (Q, Q),
    slots: usize,
    payload: usize,
    ends: Ends,
) {
    let counted = Arc::clone(&links.direct_bytes);
    let send = RdmaSend::new(send, (slots, payload), ends, counted);
    links.send[ends.peer] = Some(Box::new(send));
    let landed = Arc::clone(&links.landed_bytes);
    let recv = RdmaRecv::new(recv, (slots, payload), ends, landed);
    links.recv[ends.peer] = Some(Box::new(recv));
}
