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

/// Where a write's bytes come from.
#[derive(Clone, Debug)]
pub(crate) enum Source<'a> {
    /// A range of this side's send region.
    Region(std::ops::Range<usize>),
    /// Bytes of the registered user buffer `.1`.
    User(&'a [u8], &'a Entry),
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
    /// Registers the registered user buffer `entry` with the device (once: cached), for local
    /// reads and remote writes, and returns the key a peer writes into it with; `None` when the
    /// device refuses it (the locked-memory limit, usually), and then for every later ask: its
    /// messages go through the slots instead.
    fn register_user(&mut self, entry: &Entry) -> Option<u32>;
    /// RDMA WRITE WITH IMMEDIATE of `src` into a peer's registered user buffer, at address
    /// `to.0` under key `to.1` (what the peer offered), with `imm`; signaled. A user buffer's
    /// bytes must stay unchanged until the write's completion.
    ///
    /// # Errors
    /// As [`QueuePair::write_imm`], or registering the source failed.
    fn write_imm_remote(
        &mut self,
        wr_id: u64,
        src: Source<'_>,
        to: (u64, u32),
        imm: u32,
    ) -> Result<()>;
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
