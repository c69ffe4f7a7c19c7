//! The RDMA protocol, without I/O: a ring of `slots` slots in the receiver's registered memory,
//! one message (a header and up to a slot of payload) per slot, and credits.
//!
//! - The sender writes message k into slot `k % slots` with an RDMA write with immediate whose
//!   immediate is that slot's index, once the receiver has released the slot's previous message
//!   (a credit) and the write that last used its source bytes has completed.
//! - The receiver takes messages in order, each visible once its immediate has been polled, and
//!   gives each slot back with a zero-byte write with immediate carrying how many slots it
//!   releases (1): the sender's credits. A sender can never overwrite a slot the receiver has not
//!   released; a receiver that sees more messages than slots, or a slot out of order, reports the
//!   protocol error instead of reading garbage.
//! - [`GOODBYE`] as an immediate, either way, says the side has closed.
//!
//! Large messages are cut into slot-sized frames by the algorithms above (they reduce one frame
//! while the next is on the wire), so eager slots with credits carry every size.
//!
//! **Rendezvous into registered outputs.** Both sides count the payload bytes that crossed the
//! connection (the *stream*). A receiver about to copy a large message into a registered buffer
//! offers that buffer instead ([`Offer`]: the stream range the message covers, its tag, the
//! buffer's address and key), as a 64-byte record written into the sender's control area with
//! immediate [`OFFER`] plus the record's index; the sender reads it, acknowledges it
//! ([`OFFER_READ`]: the receiver keeps at most [`OFFERS`] unread, so it never overwrites one) and
//! writes the rest of the message straight into the buffer, frame by frame, each with immediate
//! [`LANDED`] plus the slot index it would have used. Such a frame still takes a slot and a
//! credit, so the counters above stay as they are and pipelining is unchanged; only its bytes
//! go elsewhere. The sender takes an offer only for the message it names (the same tag, and the
//! message ends where the offer does) and from the byte it is at, so the bytes a message sent
//! in slots before the offer arrived and those it writes after meet in stream order; an offer
//! that arrives once its range has gone out in slots is stale and dropped. Nothing waits for an
//! offer: a message the receiver does not offer for goes through the slots as before.

use crate::base::op::Tag;

/// Bytes of a slot's header: the tag (sequence, description, count) and the payload length in
/// the first 32, the rest padding, so that payloads start 64-byte aligned and a slot's payload
/// is the configured slot size (a multiple of 64, as the algorithms expect).
pub(crate) const HEADER: usize = 64;

/// The immediate that closes a direction.
pub(crate) const GOODBYE: u32 = u32::MAX;

/// The work request id of a goodbye (its completion is nobody's write).
pub(crate) const GOODBYE_WR: u64 = u64::MAX;

/// Immediate bit on the sender's queue pair: an [`Offer`] record arrived; the low bits are its
/// index in the control area.
pub(crate) const OFFER: u32 = 1 << 30;

/// Immediate bit on the receiver's queue pair: a frame landed in the offered buffer; the low
/// bits are the slot index it took.
pub(crate) const LANDED: u32 = 1 << 30;

/// Immediate on the receiver's queue pair: the sender read one more offer record.
pub(crate) const OFFER_READ: u32 = 1 << 29;

/// Offer records a receiver may have unread: the sender's control area holds this many.
pub(crate) const OFFERS: usize = 4;

/// Bytes of an offer record.
pub(crate) const RECORD: usize = 64;

/// Bytes of each side's control area (offer records; the receiver writes them from the same
/// offsets of its own).
pub(crate) const CONTROL: usize = OFFERS * RECORD;

/// A receiver's offer: the stream bytes `start..end` of the message tagged `tag` go straight to
/// the registered buffer at `addr` (`start`'s byte) under key `rkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Offer {
    pub tag: Tag,
    pub start: u64,
    pub end: u64,
    pub addr: u64,
    pub rkey: u32,
}

impl Offer {
    /// The record as the receiver writes it.
    pub(crate) fn encode(&self) -> [u8; RECORD] {
        let mut b = [0u8; RECORD];
        let words = [
            self.tag.seq,
            self.tag.desc,
            self.tag.count,
            self.start,
            self.end,
            self.addr,
            u64::from(self.rkey),
        ];
        for (i, w) in words.into_iter().enumerate() {
            b[8 * i..8 * i + 8].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    /// The record read back (at least [`RECORD`] bytes).
    pub(crate) fn decode(b: &[u8]) -> Offer {
        let w = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[8 * i..8 * i + 8]);
            u64::from_le_bytes(x)
        };
        Offer {
            tag: Tag {
                seq: w(0),
                desc: w(1),
                count: w(2),
            },
            start: w(3),
            end: w(4),
            addr: w(5),
            rkey: w(6) as u32,
        }
    }

    /// Where the sender's next bytes go when this offer takes them: it is at stream byte `at`
    /// with `rest` bytes of its message tagged `tag` still to write. The address of byte `at`
    /// when the offer names that message (its tag, a range holding `at`, and the same end).
    pub(crate) fn target(&self, at: u64, rest: u64, tag: Tag) -> Option<u64> {
        (self.tag == tag && self.start <= at && at < self.end && at + rest == self.end)
            .then(|| self.addr + (at - self.start))
    }

    /// Whether its whole range has gone out already (the sender is at stream byte `at`).
    pub(crate) fn stale(&self, at: u64) -> bool {
        self.end <= at
    }
}

/// What a side did wrong, by the protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ProtoError(pub String);

/// The sender's counters.
#[derive(Clone, Debug)]
pub(crate) struct SendState {
    slots: u64,
    /// Messages posted.
    posted: u64,
    /// Writes completed (in order, as RC completes them).
    completed: u64,
    /// Slots the receiver released.
    released: u64,
}

impl SendState {
    pub(crate) fn new(slots: usize) -> SendState {
        SendState {
            slots: slots.max(1) as u64,
            posted: 0,
            completed: 0,
            released: 0,
        }
    }

    /// The slot the next message goes into, when it is free (released and its last write done).
    pub(crate) fn free(&self) -> Option<usize> {
        let ok =
            self.posted < self.released + self.slots && self.posted < self.completed + self.slots;
        ok.then_some((self.posted % self.slots) as usize)
    }

    /// Posts the next message: its slot and immediate.
    pub(crate) fn post(&mut self) -> Result<(usize, u32), ProtoError> {
        let slot = self
            .free()
            .ok_or_else(|| ProtoError(format!("post without a free slot ({self:?})")))?;
        self.posted += 1;
        Ok((slot, slot as u32))
    }

    /// One of this side's writes completed.
    pub(crate) fn completed(&mut self) -> Result<(), ProtoError> {
        if self.completed >= self.posted {
            return Err(ProtoError(format!("a completion for no write ({self:?})")));
        }
        self.completed += 1;
        Ok(())
    }

    /// The receiver released `n` slots.
    pub(crate) fn credit(&mut self, n: u32) -> Result<(), ProtoError> {
        let released = self.released + u64::from(n);
        if released > self.posted {
            return Err(ProtoError(format!(
                "{n} credits for {} messages not yet released ({self:?})",
                self.posted - self.released
            )));
        }
        self.released = released;
        Ok(())
    }

    /// Messages posted so far.
    pub(crate) fn posted(&self) -> u64 {
        self.posted
    }

    /// Slots the receiver released so far.
    pub(crate) fn released(&self) -> u64 {
        self.released
    }

    /// Every posted write has completed.
    pub(crate) fn idle(&self) -> bool {
        self.completed == self.posted
    }
}

/// The receiver's counters.
#[derive(Clone, Debug)]
pub(crate) struct RecvState {
    slots: u64,
    /// Messages whose immediate arrived.
    arrived: u64,
    /// Messages taken and released.
    consumed: u64,
}

impl RecvState {
    pub(crate) fn new(slots: usize) -> RecvState {
        RecvState {
            slots: slots.max(1) as u64,
            arrived: 0,
            consumed: 0,
        }
    }

    /// A message's immediate arrived.
    pub(crate) fn arrived(&mut self, imm: u32) -> Result<(), ProtoError> {
        let want = self.arrived % self.slots;
        if u64::from(imm) != want {
            return Err(ProtoError(format!(
                "message {} arrived in slot {imm}, expected slot {want}",
                self.arrived
            )));
        }
        if self.arrived - self.consumed >= self.slots {
            return Err(ProtoError(format!(
                "message {} arrived with all {} slots unreleased: the sender overran its credits",
                self.arrived, self.slots
            )));
        }
        self.arrived += 1;
        Ok(())
    }

    /// The slot of the next message to take, if it has arrived.
    pub(crate) fn next(&self) -> Option<usize> {
        (self.consumed < self.arrived).then_some((self.consumed % self.slots) as usize)
    }

    /// Releases the message taken; returns the credit immediate to send back.
    pub(crate) fn release(&mut self) -> Result<u32, ProtoError> {
        if self.consumed >= self.arrived {
            return Err(ProtoError(format!("release without a message ({self:?})")));
        }
        self.consumed += 1;
        Ok(1)
    }
}
