//! The send and receive halves of an RDMA connection ([`crate::transport::SendConn`],
//! [`crate::transport::RecvConn`]) over any [`QueuePair`]: the slots of the transport model are
//! the ring of [`super::proto`] in registered memory; posting a slot is a write with immediate,
//! releasing one a credit written back. A large message from a registered user buffer
//! ([`crate::Registered`]) goes out by writes straight from the buffer into the peer's slots
//! ([`SendConn::send_direct`]): the slot's header comes from the send region, its payload from
//! the buffer, both in one write.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::proto::{ProtoError, RecvState, SendState, GOODBYE, GOODBYE_WR, HEADER};
use super::verbs::{Completion, QueuePair};
use crate::base::error::{Error, Result};
use crate::base::op::Tag;
use crate::transport::registry::{Entry, Registry};
use crate::transport::{PollDir, RecvConn, SendConn};

/// Work request ids of writes from a user buffer carry this bit and the payload's length (the
/// ids of slot writes never have it; [`GOODBYE_WR`] is filtered out first).
const DIRECT_WR: u64 = 1 << 62;

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
    /// The peer's immediate (not a goodbye).
    Imm(u32),
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
                Completion::Imm { imm, .. } => on(Event::Imm(imm)).map_err(|e| ends.proto(e))?,
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

/// A message going out straight from a registered buffer (addresses of the caller's bytes).
struct Direct {
    entry: Entry,
    tag: Tag,
    /// Payload bytes per write.
    frame: usize,
    /// The next byte to write, the first byte whose write has not completed, the first byte
    /// not reported taken yet (where the caller's next call starts), the end.
    next: usize,
    done: usize,
    told: usize,
    end: usize,
}

/// The send half: writes slots into the peer's ring.
pub(crate) struct RdmaSend<Q: QueuePair> {
    end: End<Q>,
    st: SendState,
    /// Bytes from one slot to the next: the header and the payload.
    stride: usize,
    handed: Option<usize>,
    /// Where registered buffers are found.
    registry: &'static Registry,
    direct: Option<Direct>,
    /// Bytes written straight from registered buffers (the communicator's count).
    direct_bytes: Arc<AtomicU64>,
}

impl<Q: QueuePair> RdmaSend<Q> {
    /// A send half over `qp` to a ring of `slots` slots of `payload` bytes each (the regions
    /// hold `slots * (HEADER + payload)`), counting the bytes it sends straight from registered
    /// buffers in `direct_bytes`.
    pub(crate) fn new(
        qp: Q,
        (slots, payload): (usize, usize),
        ends: Ends,
        direct_bytes: Arc<AtomicU64>,
    ) -> RdmaSend<Q> {
        RdmaSend {
            end: End::new(qp, ends),
            st: SendState::new(slots),
            stride: HEADER + payload,
            handed: None,
            registry: Registry::global(),
            direct: None,
            direct_bytes,
        }
    }

    fn poll(&mut self) -> Result<bool> {
        let (st, direct, counted) = (&mut self.st, &mut self.direct, &self.direct_bytes);
        self.end.drain(|ev| match ev {
            Event::Wrote(wr_id) => {
                st.completed()?;
                if wr_id & DIRECT_WR != 0 {
                    let d = direct.as_mut().ok_or_else(|| {
                        ProtoError("a user buffer's write completed outside its message".into())
                    })?;
                    let len = wr_id & !DIRECT_WR;
                    d.done += len as usize;
                    counted.fetch_add(len, Ordering::Relaxed);
                }
                Ok(())
            }
            Event::Imm(credits) => st.credit(credits),
        })
    }

    /// Posts the frames of the direct message whose unsent part starts at `data` while slots
    /// are free.
    fn post_frames(&mut self, data: &[u8]) -> Result<()> {
        let ends = self.end.ends;
        let s = self.stride;
        let base = data.as_ptr() as usize;
        while let Some(d) = self.direct.as_mut().filter(|d| d.next < d.end) {
            let Some(i) = self.st.free() else { break };
            let len = (d.end - d.next).min(d.frame);
            let off = d.next - base;
            put_header(self.end.qp.send_slot(i * s..i * s + HEADER), d.tag, len);
            let (slot, imm) = self.st.post().map_err(|e| ends.proto(e))?;
            debug_assert_eq!(slot, i);
            let (wr, entry) = (DIRECT_WR | len as u64, d.entry);
            d.next += len;
            self.end
                .qp
                .write_imm_user(wr, i * s, &data[off..off + len], &entry, i * s, imm)
                .map_err(|e| ends.named(e))?;
        }
        Ok(())
    }
}

impl<Q: QueuePair> SendConn for RdmaSend<Q> {
    fn try_slot(&mut self) -> Result<Option<&mut [u8]>> {
        self.poll()?;
        let Some(i) = self.st.free() else {
            return Ok(None);
        };
        self.handed = Some(i);
        let s = self.stride;
        Ok(Some(self.end.qp.send_slot(i * s + HEADER..(i + 1) * s)))
    }

    fn post(&mut self, len: usize, tag: Tag) -> Result<()> {
        let ends = self.end.ends;
        if self.end.peer_closed {
            return Err(self.end.closed("rdma send", "receiver"));
        }
        let i = self
            .handed
            .take()
            .ok_or_else(|| ends.proto(ProtoError("post without a slot handed out".into())))?;
        let s = self.stride;
        if len > s - HEADER {
            return Err(ends.proto(ProtoError(format!(
                "{len} bytes do not fit a slot of {}",
                s - HEADER
            ))));
        }
        put_header(self.end.qp.send_slot(i * s..i * s + HEADER), tag, len);
        let (slot, imm) = self.st.post().map_err(|e| ends.proto(e))?;
        debug_assert_eq!(slot, i);
        self.end
            .write(tag.seq & (DIRECT_WR - 1), i * s, HEADER + len, i * s, imm)
    }

    /// From a registered buffer ([`crate::Registered`]) holding all of the message: writes
    /// its frames straight from there into free slots of the peer's ring, and counts bytes
    /// taken only once their writes completed (the caller may change them after that). `None`
    /// for bytes of no registered buffer: the caller stages them in slots.
    fn send_direct(&mut self, data: &[u8], tag: Tag, frame: usize) -> Result<Option<usize>> {
        let ends = self.end.ends;
        let (addr, end) = (data.as_ptr() as usize, data.as_ptr() as usize + data.len());
        match &self.direct {
            Some(d) if d.told != addr || d.end != end => {
                return Err(ends.proto(ProtoError(format!(
                    "a direct send of {} bytes while {} bytes of another are in flight",
                    data.len(),
                    d.end - d.told
                ))));
            }
            Some(_) => {}
            None => {
                let Some(entry) = self.registry.find(addr, data.len()).filter(|_| end > addr)
                else {
                    return Ok(None);
                };
                if !self.end.qp.register_user(&entry) {
                    return Ok(None);
                }
                self.direct = Some(Direct {
                    entry,
                    tag,
                    frame: frame.clamp(1, self.stride - HEADER),
                    next: addr,
                    done: addr,
                    told: addr,
                    end,
                });
            }
        }
        if self.end.peer_closed {
            return Err(self.end.closed("rdma send", "receiver"));
        }
        self.poll()?;
        self.post_frames(data)?;
        let done = match self.direct.as_mut() {
            Some(d) => {
                d.told = d.done;
                d.done
            }
            None => end,
        };
        if done == end {
            self.direct = None;
        }
        Ok(Some(done - addr))
    }

    fn progress(&mut self) -> Result<bool> {
        self.poll()
    }

    fn flushed(&self) -> bool {
        self.st.idle()
    }

    fn poll_fds(&self, _: &mut Vec<(RawFd, PollDir)>) {}

    fn close(&mut self, deadline: Instant) {
        while !self.st.idle() && Instant::now() < deadline {
            if self.poll().is_err() {
                return;
            }
            std::thread::yield_now();
        }
        let _ = self.end.write(GOODBYE_WR, 0, 0, 0, GOODBYE);
    }
}

/// The receive half: takes the ring's slots in order and writes credits back.
pub(crate) struct RdmaRecv<Q: QueuePair> {
    end: End<Q>,
    st: RecvState,
    /// Bytes from one slot to the next: the header and the payload.
    stride: usize,
    taken: Option<usize>,
}

impl<Q: QueuePair> RdmaRecv<Q> {
    /// A receive half over `qp` of a ring of `slots` slots of `payload` bytes each.
    pub(crate) fn new(qp: Q, slots: usize, payload: usize, ends: Ends) -> RdmaRecv<Q> {
        RdmaRecv {
            end: End::new(qp, ends),
            st: RecvState::new(slots),
            stride: HEADER + payload,
            taken: None,
        }
    }

    fn poll(&mut self) -> Result<bool> {
        let st = &mut self.st;
        self.end.drain(|ev| match ev {
            Event::Wrote(_) => Ok(()), // a credit reached the sender
            Event::Imm(slot) => st.arrived(slot),
        })
    }
}

impl<Q: QueuePair> RecvConn for RdmaRecv<Q> {
    fn try_recv(&mut self) -> Result<Option<(Tag, &[u8])>> {
        if self.taken.is_none() {
            self.poll()?;
        }
        let Some(i) = self.taken.or_else(|| self.st.next()) else {
            if self.end.peer_closed {
                return Err(self.end.closed("rdma receive", "sender"));
            }
            return Ok(None);
        };
        self.taken = Some(i);
        let s = self.stride;
        let slot = self.end.qp.recv_slot(i * s..(i + 1) * s);
        let (tag, len) = get_header(slot);
        if len > s - HEADER {
            return Err(self
                .end
                .ends
                .proto(ProtoError(format!("slot {i} claims {len} bytes"))));
        }
        Ok(Some((tag, &slot[HEADER..HEADER + len])))
    }

    fn release(&mut self) -> Result<()> {
        let ends = self.end.ends;
        if self.taken.take().is_none() {
            return Err(ends.proto(ProtoError("release without a message taken".into())));
        }
        let credit = self.st.release().map_err(|e| ends.proto(e))?;
        self.end.write(0, 0, 0, 0, credit)
    }

    fn progress(&mut self) -> Result<bool> {
        self.poll()
    }

    fn poll_fds(&self, _: &mut Vec<(RawFd, PollDir)>) {}

    fn close(&mut self) {
        let _ = self.end.write(GOODBYE_WR, 0, 0, 0, GOODBYE);
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
    links.recv[ends.peer] = Some(Box::new(RdmaRecv::new(recv, slots, payload, ends)));
}
