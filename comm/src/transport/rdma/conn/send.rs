//! The send half of an RDMA connection: slots written into the peer's ring, messages from
//! registered buffers written straight from them, and offers taken.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::proto::{
    Offer, ProtoError, SendState, GOODBYE, GOODBYE_WR, HEADER, LANDED, OFFER, OFFERS, OFFER_READ,
    RECORD,
};
use super::super::verbs::{QueuePair, Source};
use super::{put_header, End, Ends, Event, CONTROL_WR, DIRECT_WR};
use crate::base::error::Result;
use crate::base::op::Tag;
use crate::transport::registry::{Entry, Registry};
use crate::transport::{PollDir, SendConn};

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

/// What the send half knows of the message `send_direct` is sending, to wait for an offer
/// without ever waiting longer than for a credit.
#[derive(Clone, Copy, Debug, Default)]
struct Message {
    /// Its end in the stream (how the next call tells a new message).
    end: u64,
    /// An offer took some of it.
    offered: bool,
    /// The post count before its first frame that went into a slot, and when it went.
    first: Option<(u64, Instant)>,
    /// The message before it was offered: the receiver offers registered buffers, so this one
    /// may be offered too.
    expect: bool,
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
    /// Payload bytes posted so far (the stream offsets offers name).
    stream: u64,
    /// Offers read and not yet stale, oldest first.
    offers: VecDeque<Offer>,
    /// Indices of offer records whose immediates the last poll found.
    arrived: Vec<u32>,
    msg: Message,
    /// The most a message's frames wait for an offer ([`HOLD`]).
    hold: Duration,
}

/// The most a message's frames wait for an offer after its first one went through a slot:
/// a few round trips of a NIC, so a receiver in step with the sender offers in time, and one
/// that is not costs the sender little.
const HOLD: Duration = Duration::from_micros(50);

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
            stream: 0,
            offers: VecDeque::new(),
            arrived: Vec::new(),
            msg: Message::default(),
            hold: HOLD,
        }
    }

    fn poll(&mut self) -> Result<bool> {
        let (st, direct, counted) = (&mut self.st, &mut self.direct, &self.direct_bytes);
        let arrived = &mut self.arrived;
        let moved = self.end.drain(|ev| match ev {
            Event::Wrote(wr_id) if wr_id & CONTROL_WR != 0 => Ok(()),
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
            Event::Imm(imm, _) if imm & OFFER != 0 => {
                arrived.push(imm & !OFFER);
                Ok(())
            }
            Event::Imm(credits, _) => st.credit(credits),
        })?;
        self.read_offers()?;
        Ok(moved)
    }

    /// Reads the offer records whose immediates arrived, acknowledges each (its record may be
    /// written again), and keeps those whose range has not gone out yet.
    fn read_offers(&mut self) -> Result<()> {
        let ends = self.end.ends;
        if self.arrived.is_empty() {
            return Ok(());
        }
        // Offers whose range went out (taken, or sent through slots) go here, the one place
        // the list grows: it holds a few at most.
        let at = self.stream;
        self.offers.retain(|o| !o.stale(at));
        for i in 0..self.arrived.len() {
            let k = self.arrived[i] as usize;
            if k >= OFFERS {
                return Err(ends.proto(ProtoError(format!("offer record {k} of {OFFERS}"))));
            }
            let o = Offer::decode(self.end.qp.recv_slot(k * RECORD..(k + 1) * RECORD));
            if o.start > self.stream || o.end < o.start {
                return Err(ends.proto(ProtoError(format!(
                    "an offer of stream bytes {}..{} with {} sent",
                    o.start, o.end, self.stream
                ))));
            }
            if !self.end.peer_closed {
                self.end.write(CONTROL_WR, 0, 0, 0, OFFER_READ)?;
            }
            if !o.stale(self.stream) {
                self.offers.push_back(o);
            }
        }
        self.arrived.clear();
        Ok(())
    }

    /// Where the next bytes go when an offer takes them (`rest` bytes of the message tagged
    /// `tag` still to write): the peer's address and key.
    fn offered(&mut self, tag: Tag, rest: usize) -> Option<(u64, u32)> {
        let at = self.stream;
        let to = self
            .offers
            .iter()
            .find_map(|o| Some((o.target(at, rest as u64, tag)?, o.rkey)));
        self.msg.offered |= to.is_some();
        to
    }

    /// `send_direct` is at the message with `rest` bytes left to post: a new one when its end
    /// differs from the last call's.
    fn note_message(&mut self, rest: usize) {
        let end = self.stream + rest as u64;
        if end != self.msg.end {
            self.msg = Message {
                end,
                offered: false,
                first: None,
                expect: self.msg.offered,
            };
        }
    }

    /// Notes a frame of the current message going into a slot (the first one counts).
    fn slot_frame(&mut self) {
        if self.stream < self.msg.end && self.msg.first.is_none() {
            self.msg.first = Some((self.st.posted(), Instant::now()));
        }
    }

    /// Whether to hold the current message's next frame back for an offer: the receiver
    /// offered the message before it, and has not yet taken this one's first frame (it offers
    /// before it takes one, on the queue pair that brings the credit, so once that credit is
    /// here an offer would be too), for at most `self.hold` since that frame went. At most one
    /// frame waits in a slot meanwhile. The limit keeps a send from depending on its receiver
    /// (two ranks that send each other a message before they receive still pass, as the ring's
    /// slots let them without offers).
    fn holding(&self) -> bool {
        let m = &self.msg;
        m.expect
            && !m.offered
            && m.first
                .is_some_and(|(f, at)| self.st.released() <= f && at.elapsed() < self.hold)
    }

    /// Sets how long a message's frames wait for an offer (tests hold longer, to count what
    /// lands without depending on timing).
    #[cfg(test)]
    pub(crate) fn hold_for(&mut self, hold: Duration) {
        self.hold = hold;
    }

    /// Posts the frames of the direct message whose unsent part starts at `data` while slots
    /// are free: into the peer's slots, or into its offered buffer once an offer takes them.
    fn post_frames(&mut self, data: &[u8]) -> Result<()> {
        let ends = self.end.ends;
        let s = self.stride;
        let base = data.as_ptr() as usize;
        while let Some(d) = self.direct.as_ref().filter(|d| d.next < d.end) {
            let Some(i) = self.st.free() else { break };
            let (tag, entry, next, rest) = (d.tag, d.entry, d.next, d.end - d.next);
            let len = rest.min(d.frame);
            let payload = &data[next - base..next - base + len];
            let to = self.offered(tag, rest);
            if to.is_none() {
                if self.holding() {
                    break;
                }
                self.slot_frame();
            }
            let (slot, imm) = self.st.post().map_err(|e| ends.proto(e))?;
            debug_assert_eq!(slot, i);
            let wr = DIRECT_WR | len as u64;
            match to {
                Some(to) => {
                    let src = Source::User(payload, &entry);
                    self.end.qp.write_imm_remote(wr, src, to, LANDED | imm)
                }
                None => {
                    put_header(self.end.qp.send_slot(i * s..i * s + HEADER), tag, len);
                    (self.end.qp).write_imm_user(wr, i * s, payload, &entry, i * s, imm)
                }
            }
            .map_err(|e| ends.named(e))?;
            if let Some(d) = self.direct.as_mut() {
                d.next += len;
            }
            self.stream += len as u64;
        }
        Ok(())
    }

    /// [`SendConn::send_direct`] for bytes of no registered buffer: written into the peer's
    /// offered buffer when an offer takes them, else `None`.
    fn send_offered(&mut self, data: &[u8], tag: Tag, frame: usize) -> Result<Option<usize>> {
        if data.is_empty() {
            return Ok(None);
        }
        if self.end.peer_closed {
            return Err(self.end.closed("rdma send", "receiver"));
        }
        self.poll()?;
        if self.offered(tag, data.len()).is_none() {
            // The caller stages the next frame in a slot, unless it waits for an offer.
            return Ok(self.holding().then_some(0));
        }
        self.stage_offered(data, data.len(), tag, frame).map(Some)
    }

    /// Writes bytes of `data` (the first bytes of the `rest` still unsent of the message tagged
    /// `tag`, in no registered buffer) into the peer's offered buffer while an offer takes them
    /// and slots are free, each frame copied into a slot of the send region first; how many
    /// went.
    fn stage_offered(&mut self, data: &[u8], rest: usize, tag: Tag, frame: usize) -> Result<usize> {
        let ends = self.end.ends;
        let s = self.stride;
        let mut taken = 0;
        while taken < data.len() {
            let Some(to) = self.offered(tag, rest - taken) else {
                break;
            };
            let Some(i) = self.st.free() else { break };
            let len = (data.len() - taken).min(frame.clamp(1, s - HEADER));
            let at = i * s + HEADER..i * s + HEADER + len;
            (self.end.qp.send_slot(at.clone())).copy_from_slice(&data[taken..taken + len]);
            let (_, imm) = self.st.post().map_err(|e| ends.proto(e))?;
            let wr = tag.seq & (CONTROL_WR - 1);
            (self.end.qp)
                .write_imm_remote(wr, Source::Region(at), to, LANDED | imm)
                .map_err(|e| ends.named(e))?;
            self.stream += len as u64;
            taken += len;
        }
        Ok(taken)
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
        self.slot_frame();
        let (slot, imm) = self.st.post().map_err(|e| ends.proto(e))?;
        debug_assert_eq!(slot, i);
        self.stream += len as u64;
        self.end
            .write(tag.seq & (CONTROL_WR - 1), i * s, HEADER + len, i * s, imm)
    }

    /// From a registered buffer ([`crate::Registered`]) holding all of the message: writes
    /// its frames straight from there into free slots of the peer's ring (or its offered
    /// buffer), and counts bytes taken only once their writes completed (the caller may change
    /// them after that). Bytes of no registered buffer that the peer offered a buffer for are
    /// copied into free slots of the send region and written there (taken at once). `None`
    /// otherwise: the caller stages them in slots.
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
            Some(d) => self.note_message(d.end - d.next),
            None => {
                self.note_message(data.len());
                let entry = self.registry.find(addr, data.len()).filter(|_| end > addr);
                let Some(entry) = entry.filter(|e| self.end.qp.register_user(e).is_some()) else {
                    return self.send_offered(data, tag, frame);
                };
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

    /// Writes what `avail` holds of the message into the peer's offered buffer when an offer
    /// takes it (through slots of the send region, taken at once); `None` otherwise. A
    /// forwarded message never holds for an offer (its pieces come when they come).
    fn forward_offered(
        &mut self,
        avail: &[u8],
        rest: usize,
        tag: Tag,
        frame: usize,
    ) -> Result<Option<usize>> {
        if let Some(d) = &self.direct {
            return Err(self.end.ends.proto(ProtoError(format!(
                "a forward while {} bytes of a direct send are in flight",
                d.end - d.told
            ))));
        }
        if avail.is_empty() || rest < avail.len() {
            return Ok(None);
        }
        if self.end.peer_closed {
            return Err(self.end.closed("rdma send", "receiver"));
        }
        // Its own state, so that the next message expects an offer exactly when this one had.
        self.note_message(rest);
        self.poll()?;
        if self.offered(tag, rest).is_none() {
            return Ok(None);
        }
        self.stage_offered(avail, rest, tag, frame).map(Some)
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
