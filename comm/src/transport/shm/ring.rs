//! The two halves of a shared-memory connection: a sender that fills slots of its ring in the
//! peer's segment, and a receiver that reads them out of this rank's own.

use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::liveness::{lost, Liveness};
use super::segment::Segment;
use crate::base::error::{Error, Result};
use crate::transport::{PollDir, RecvConn, SendConn, Tag};

/// `closed` bits: the sender said goodbye; the receiver will read no more.
const SENDER_CLOSED: u64 = 1;
const RECEIVER_CLOSED: u64 = 2;

/// Send half: writes into ring `ring` of the peer's segment.
pub struct ShmSend {
    rank: usize,
    peer: usize,
    dst: Arc<Segment>,
    ring: usize,
    own: Arc<Segment>,
    head: u64,
    handed_out: bool,
    live: Liveness,
}

impl ShmSend {
    pub(crate) fn new(
        rank: usize,
        peer: usize,
        peer_pid: u32,
        dst: Arc<Segment>,
        ring: usize,
        own: Arc<Segment>,
    ) -> ShmSend {
        let head = dst.head(ring).load(Ordering::Acquire);
        ShmSend {
            rank,
            peer,
            dst,
            ring,
            own,
            head,
            handed_out: false,
            live: Liveness::new(peer_pid),
        }
    }
}

impl SendConn for ShmSend {
    fn try_slot(&mut self) -> Result<Option<&mut [u8]>> {
        if self.dst.closed(self.ring).load(Ordering::Acquire) & RECEIVER_CLOSED != 0 {
            return Err(lost(
                self.rank,
                self.peer,
                "peer closed its communicator (or failed) and reads no more",
            ));
        }
        let tail = self.dst.tail(self.ring).load(Ordering::Acquire);
        if self.head - tail >= self.dst.nslots as u64 {
            self.live.check(self.rank, self.peer)?;
            return Ok(None);
        }
        self.handed_out = true;
        let off = self
            .dst
            .slot_off(self.ring, (self.head % self.dst.nslots as u64) as usize);
        // SAFETY: slot `head % nslots` is owned by this sender until it publishes `head + 1`:
        // the receiver has released it (tail > head - nslots, acquire-loaded above) and reads
        // it again only after the release-store in `post`. The region lies inside the mapping.
        Ok(Some(unsafe {
            std::slice::from_raw_parts_mut(self.dst.base.add(off), self.dst.slot_size)
        }))
    }

    fn post(&mut self, len: usize, tag: Tag) -> Result<()> {
        if !self.handed_out || len > self.dst.slot_size {
            return Err(Error::Transport {
                rank: self.rank,
                peer: self.peer,
                transport: "shm",
                msg: format!("post of {len} bytes without a free slot"),
            });
        }
        self.handed_out = false;
        let slot = (self.head % self.dst.nslots as u64) as usize;
        let m = self.dst.meta_off(self.ring, slot);
        self.dst.atomic_u64(m).store(len as u64, Ordering::Relaxed);
        self.dst.atomic_u64(m + 8).store(tag.seq, Ordering::Relaxed);
        self.dst
            .atomic_u64(m + 16)
            .store(tag.desc, Ordering::Relaxed);
        self.dst
            .atomic_u64(m + 24)
            .store(tag.count, Ordering::Relaxed);
        self.head += 1;
        self.dst.head(self.ring).store(self.head, Ordering::Release);
        self.dst.ring_bell();
        Ok(())
    }

    fn progress(&mut self) -> Result<bool> {
        Ok(false)
    }

    fn flushed(&self) -> bool {
        true
    }

    fn poll_fds(&self, _out: &mut Vec<(RawFd, PollDir)>) {}

    fn close(&mut self, _deadline: Instant) {
        self.dst
            .closed(self.ring)
            .fetch_or(SENDER_CLOSED, Ordering::AcqRel);
        self.dst.ring_bell();
        let _ = &self.own;
    }
}

/// Receive half: reads ring `ring` of this rank's own segment.
pub struct ShmRecv {
    rank: usize,
    peer: usize,
    own: Arc<Segment>,
    ring: usize,
    /// The peer's segment, whose bell a release rings.
    peer_seg: Arc<Segment>,
    tail: u64,
    handed_out: bool,
    live: Liveness,
}

impl ShmRecv {
    pub(crate) fn new(
        rank: usize,
        peer: usize,
        peer_pid: u32,
        own: Arc<Segment>,
        ring: usize,
        peer_seg: Arc<Segment>,
    ) -> ShmRecv {
        let tail = own.tail(ring).load(Ordering::Acquire);
        ShmRecv {
            rank,
            peer,
            own,
            ring,
            peer_seg,
            tail,
            handed_out: false,
            live: Liveness::new(peer_pid),
        }
    }
}

impl RecvConn for ShmRecv {
    fn try_recv(&mut self) -> Result<Option<(Tag, &[u8])>> {
        if self.own.head(self.ring).load(Ordering::Acquire) == self.tail {
            let gone = if self.own.closed(self.ring).load(Ordering::Acquire) & SENDER_CLOSED != 0 {
                "peer closed its communicator while this rank still expects data"
            } else if self.live.dead() {
                "process exited (seen through its pidfd)"
            } else {
                return Ok(None);
            };
            // The peer may have posted its last slot and left between the two loads: its head
            // store comes before its goodbye (or exit), so this load sees every slot it posted.
            if self.own.head(self.ring).load(Ordering::Acquire) == self.tail {
                return Err(lost(self.rank, self.peer, gone));
            }
        }
        let slot = (self.tail % self.own.nslots as u64) as usize;
        let m = self.own.meta_off(self.ring, slot);
        let len = self.own.atomic_u64(m).load(Ordering::Relaxed) as usize;
        let tag = Tag {
            seq: self.own.atomic_u64(m + 8).load(Ordering::Relaxed),
            desc: self.own.atomic_u64(m + 16).load(Ordering::Relaxed),
            count: self.own.atomic_u64(m + 24).load(Ordering::Relaxed),
        };
        if len > self.own.slot_size {
            return Err(Error::Transport {
                rank: self.rank,
                peer: self.peer,
                transport: "shm",
                msg: format!("corrupt slot length {len}"),
            });
        }
        self.handed_out = true;
        let off = self.own.slot_off(self.ring, slot);
        // SAFETY: the sender published this slot with a release-store of head (acquire-loaded
        // above) and does not touch it again until we release it; the region is in the mapping.
        Ok(Some((tag, unsafe {
            std::slice::from_raw_parts(self.own.base.add(off), len)
        })))
    }

    fn release(&mut self) -> Result<()> {
        if !self.handed_out {
            return Err(Error::Transport {
                rank: self.rank,
                peer: self.peer,
                transport: "shm",
                msg: "release without a received slot".into(),
            });
        }
        self.handed_out = false;
        self.tail += 1;
        self.own.tail(self.ring).store(self.tail, Ordering::Release);
        self.peer_seg.ring_bell();
        Ok(())
    }

    fn progress(&mut self) -> Result<bool> {
        Ok(false)
    }

    fn poll_fds(&self, _out: &mut Vec<(RawFd, PollDir)>) {}

    fn close(&mut self) {
        self.own
            .closed(self.ring)
            .fetch_or(RECEIVER_CLOSED, Ordering::AcqRel);
        self.peer_seg.ring_bell();
    }
}
