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

/// Bytes of a slot's header: the tag (sequence, description, count) and the payload length in
/// the first 32, the rest padding, so that payloads start 64-byte aligned and a slot's payload
/// is the configured slot size (a multiple of 64, as the algorithms expect).
pub(crate) const HEADER: usize = 64;

/// The immediate that closes a direction.
pub(crate) const GOODBYE: u32 = u32::MAX;

/// The work request id of a goodbye (its completion is nobody's write).
pub(crate) const GOODBYE_WR: u64 = u64::MAX;

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
