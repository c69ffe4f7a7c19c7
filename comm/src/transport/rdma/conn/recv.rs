//! The receive half of an RDMA connection: the ring's slots taken in order, credits written
//! back, and registered buffers offered to the sender.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::super::proto::{
    Offer, ProtoError, RecvState, GOODBYE, GOODBYE_WR, HEADER, LANDED, OFFER, OFFERS, OFFER_READ,
    RECORD,
};
use super::super::verbs::QueuePair;
use super::{get_header, End, Ends, Event, CONTROL_WR};
use crate::base::error::Result;
use crate::base::op::Tag;
use crate::transport::registry::Registry;
use crate::transport::{PollDir, RecvConn};

/// The buffer this side offered: where the message ends, in the stream and in memory.
#[derive(Clone, Copy, Debug)]
struct Offered {
    end: u64,
    end_addr: usize,
}

/// The receive half: takes the ring's slots in order and writes credits back.
pub(crate) struct RdmaRecv<Q: QueuePair> {
    end: End<Q>,
    st: RecvState,
    /// Bytes from one slot to the next: the header and the payload.
    stride: usize,
    taken: Option<usize>,
    /// The taken slot's payload bytes.
    taken_len: usize,
    /// Per slot: the bytes of the frame in it when that frame landed in the offered buffer
    /// instead (its slot holds nothing).
    landed: Vec<Option<usize>>,
    /// Payload bytes taken so far (the stream offsets offers name).
    stream: u64,
    offer: Option<Offered>,
    /// Offer records written, and those the sender has read.
    offers_sent: u64,
    offers_read: u64,
    /// Where registered buffers are found.
    registry: &'static Registry,
    /// Bytes that landed in offered buffers (the communicator's count).
    landed_bytes: Arc<AtomicU64>,
}

impl<Q: QueuePair> RdmaRecv<Q> {
    /// A receive half over `qp` of a ring of `slots` slots of `payload` bytes each, counting
    /// the bytes peers write straight into its offered buffers in `landed_bytes`.
    pub(crate) fn new(
        qp: Q,
        (slots, payload): (usize, usize),
        ends: Ends,
        landed_bytes: Arc<AtomicU64>,
    ) -> RdmaRecv<Q> {
        RdmaRecv {
            end: End::new(qp, ends),
            st: RecvState::new(slots),
            stride: HEADER + payload,
            taken: None,
            taken_len: 0,
            landed: vec![None; slots.max(1)],
            stream: 0,
            offer: None,
            offers_sent: 0,
            offers_read: 0,
            registry: Registry::global(),
            landed_bytes,
        }
    }

    fn poll(&mut self) -> Result<bool> {
        let (st, landed) = (&mut self.st, &mut self.landed);
        let (sent, read) = (self.offers_sent, &mut self.offers_read);
        let payload = self.stride - HEADER;
        self.end.drain(|ev| match ev {
            Event::Wrote(_) => Ok(()), // a credit or an offer reached the sender
            Event::Imm(OFFER_READ, _) if *read < sent => {
                *read += 1;
                Ok(())
            }
            Event::Imm(OFFER_READ, _) => Err(ProtoError(format!(
                "{} offers read, {sent} written",
                *read + 1
            ))),
            Event::Imm(imm, len) if imm & LANDED != 0 => {
                if len == 0 || len > payload {
                    // Both ends count the stream by these lengths: a wrong one desyncs them.
                    return Err(ProtoError(format!(
                        "a frame of {len} bytes landed (frames hold 1 to {payload})"
                    )));
                }
                let slot = imm & !LANDED;
                st.arrived(slot)?;
                landed[slot as usize] = Some(len);
                Ok(())
            }
            Event::Imm(slot, _) => {
                st.arrived(slot)?;
                landed[slot as usize] = None;
                Ok(())
            }
        })
    }

    /// Offers `buf` (the rest of the message tagged `tag`) to the sender when it lies in a
    /// registered buffer the device registered and a record is free; whether it did.
    fn offer(&mut self, buf: &[u8], tag: Tag) -> Result<bool> {
        let (addr, len) = (buf.as_ptr() as usize, buf.len());
        let full = |me: &Self| me.offers_sent - me.offers_read >= OFFERS as u64;
        if full(self) {
            // An acknowledgement may be waiting: declining now would let the sender's hold end
            // with no offer.
            self.poll()?;
        }
        if len == 0 || self.end.peer_closed || full(self) {
            return Ok(false);
        }
        let Some(entry) = self.registry.find(addr, len) else {
            return Ok(false);
        };
        let Some(rkey) = self.end.qp.register_user(&entry) else {
            return Ok(false);
        };
        let offer = Offer {
            tag,
            start: self.stream,
            end: self.stream + len as u64,
            addr: addr as u64,
            rkey,
        };
        let k = (self.offers_sent % OFFERS as u64) as usize;
        let at = k * RECORD;
        // The record's last write completed: the sender read it (counted in `offers_read`).
        (self.end.qp.send_slot(at..at + RECORD)).copy_from_slice(&offer.encode());
        self.end
            .write(CONTROL_WR, at, RECORD, at, OFFER | k as u32)?;
        self.offers_sent += 1;
        self.offer = Some(Offered {
            end: offer.end,
            end_addr: addr + len,
        });
        Ok(true)
    }

    /// Consumes the stream's `len` bytes just taken: the offer ends with its message.
    fn advance(&mut self, len: usize) {
        self.stream += len as u64;
        if self.offer.is_some_and(|o| o.end <= self.stream) {
            self.offer = None;
        }
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
        if self.taken.is_none() && self.landed[i].is_some() {
            // A frame that landed in the offered buffer: `recv_direct` takes it.
            if self.offer.is_none() {
                return Err(self.end.ends.proto(ProtoError(format!(
                    "a frame landed in a buffer never offered (slot {i})"
                ))));
            }
            return Ok(None);
        }
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
        self.taken_len = len;
        Ok(Some((tag, &slot[HEADER..HEADER + len])))
    }

    fn release(&mut self) -> Result<()> {
        let ends = self.end.ends;
        if self.taken.take().is_none() {
            return Err(ends.proto(ProtoError("release without a message taken".into())));
        }
        let credit = self.st.release().map_err(|e| ends.proto(e))?;
        self.advance(self.taken_len);
        self.end.write(0, 0, 0, 0, credit)
    }

    /// Offers `buf` to the sender when it lies in a registered buffer (once per message, a
    /// record of [`super::proto::Offer`]), and takes the frames that landed there, in order,
    /// up to the next frame that came through a slot (for `try_recv`). `None` when nothing was
    /// offered for this message (no registered buffer, the device refused it, or every record
    /// unread): the caller takes its slots.
    fn recv_direct(&mut self, buf: &mut [u8], tag: Tag) -> Result<Option<usize>> {
        let ends = self.end.ends;
        let end_addr = buf.as_ptr() as usize + buf.len();
        if self.taken.is_some() {
            return Err(ends.proto(ProtoError("an offer with a slot taken".into())));
        }
        match self.offer {
            Some(o) if o.end_addr != end_addr || o.end - self.stream != buf.len() as u64 => {
                return Err(ends.proto(ProtoError(format!(
                    "an offer of {} bytes while {} bytes of another are expected",
                    buf.len(),
                    o.end - self.stream
                ))));
            }
            Some(_) => {}
            None => {
                if !self.offer(buf, tag)? {
                    return Ok(None);
                }
            }
        }
        self.poll()?;
        let mut got = 0usize;
        while let Some(i) = self.st.next() {
            let Some(len) = self.landed[i] else { break };
            if got + len > buf.len() {
                return Err(ends.proto(ProtoError(format!(
                    "a frame of {len} bytes landed with {} bytes offered",
                    buf.len() - got
                ))));
            }
            self.landed[i] = None;
            let credit = self.st.release().map_err(|e| ends.proto(e))?;
            self.advance(len);
            got += len;
            self.end.write(0, 0, 0, 0, credit)?;
        }
        self.landed_bytes.fetch_add(got as u64, Ordering::Relaxed);
        Ok(Some(got))
    }

    fn progress(&mut self) -> Result<bool> {
        self.poll()
    }

    fn poll_fds(&self, _: &mut Vec<(RawFd, PollDir)>) {}

    fn close(&mut self) {
        let _ = self.end.write(GOODBYE_WR, 0, 0, 0, GOODBYE);
    }
}
