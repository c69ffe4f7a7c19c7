//! The verbs a connection uses, as a trait: one reliable-connected queue pair to one peer, its
//! completion queue, and two registered regions (the slots this side writes from, the slots the
//! peer writes into). The in-process provider ([`super::sim`]) and the ibverbs one implement it;
//! the protocol ([`super::proto`]) and the connections ([`super::conn`]) see nothing else.

use crate::base::error::Result;
use crate::transport::registry::Entry;

/// One completion, as `ibv_poll_cq` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Completion {
    /// A write this side posted is done (the peer's NIC has it): its source bytes may be reused.
    WriteDone {
        /// The work request's id.
        wr_id: u64,
    },
    /// A peer's write with immediate arrived: its bytes are visible in the receive region.
    Imm {
        /// The immediate value.
        imm: u32,
        /// Bytes written.
        len: usize,
    },
    /// A work request failed and the queue pair is in the error state.
    Error {
        /// The failed request's id (0 when unknown).
        wr_id: u64,
        /// `ibv_wc_status`'s code (12: retry exceeded, a lost peer).
        status: u32,
        /// What the provider knows.
        what: String,
    },
}

/// A reliable-connected queue pair with its regions (see the module docs). Writes are delivered
/// in order, each visible before its [`Completion::Imm`] is polled on the peer.
pub(crate) trait QueuePair: Send {
    /// RDMA WRITE WITH IMMEDIATE: `len` bytes of the send region at `src` into the peer's receive
    /// region at `dst`, with `imm`; signaled (its [`Completion::WriteDone`] carries `wr_id`).
    ///
    /// # Errors
    /// The queue pair is in error, or the ranges fall outside the regions.
    fn write_imm(&mut self, wr_id: u64, src: usize, len: usize, dst: usize, imm: u32)
        -> Result<()>;
    /// Registers the registered user buffer `entry` with the device (once: cached); false when
    /// the device refuses it (the locked-memory limit, usually), and then for every later ask:
    /// its messages go through the slots instead.
    fn register_user(&mut self, entry: &Entry) -> bool;
    /// RDMA WRITE WITH IMMEDIATE from two places: the [`super::proto::HEADER`] bytes of the send
    /// region at `head`, then `payload`, bytes of the registered user buffer `entry` (registered
    /// with the device at its first use), together into the peer's receive region at `dst`, with
    /// `imm`; signaled. `payload` must stay unchanged until the write's completion.
    ///
    /// # Errors
    /// As [`QueuePair::write_imm`], or registering `entry` failed.
    fn write_imm_user(
        &mut self,
        wr_id: u64,
        head: usize,
        payload: &[u8],
        entry: &Entry,
        dst: usize,
        imm: u32,
    ) -> Result<()>;
    /// Appends the completions that arrived since the last poll to `out`.
    ///
    /// # Errors
    /// The provider failed (not a failed request: that is a [`Completion::Error`]).
    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()>;
    /// Bytes `range` of the region this side writes from (a slot the protocol owns: no write
    /// reads it now).
    fn send_slot(&mut self, range: std::ops::Range<usize>) -> &mut [u8];
    /// Bytes `range` of the region the peer writes into (a slot whose write has arrived and
    /// that the peer cannot write again before it is released).
    fn recv_slot(&self, range: std::ops::Range<usize>) -> &[u8];
}
