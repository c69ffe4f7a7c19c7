//! Point-to-point calls of [`Communicator`]: send, recv and send_recv.
//!
//! Point-to-point messages do not take a collective sequence number (ranks that are not involved
//! do not see them); each ordered pair of ranks numbers its messages instead, and the tag carries
//! that number, the dtype and the count, so a receive that does not match its send is a
//! `Mismatch`, not garbage.

use oxccl_kernels::{DType, Element, ReduceOp};

use crate::communicator::Communicator;
use crate::engine::{ExecState, Shared};
use crate::error::Result;
use crate::op::{Collective, OpDesc};
use crate::prims::{Ctx, RecvMode};

fn bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

impl Communicator {
    fn check_peer(&self, op: &str, peer: usize) -> Result<()> {
        if peer >= self.size || peer == self.rank {
            return Err(self.invalid(
                op,
                format!(
                    "peer {peer} must be another rank of this communicator (size {})",
                    self.size
                ),
            ));
        }
        Ok(())
    }

    /// Runs a point-to-point operation: per-pair sequence numbers, no collective sequence.
    fn p2p(
        &self,
        send: Option<(usize, &[u8])>,
        recv: Option<(usize, &mut [u8])>,
        dtype: DType,
        es: usize,
    ) -> Result<()> {
        let (ticket, ahead) = self.shared.take_ticket();
        let shared = &self.shared;
        shared.run_turn(ticket, ahead, |st| {
            exec_p2p(shared, st, send, recv, dtype, es)
        })
    }

    /// Sends `buf` to `peer`, which must post a matching [`Communicator::recv`] (same length and
    /// type). Returns once the data has left this rank.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad peer; `Mismatch` if the receive does not match.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.check_peer("send", peer)?;
        self.p2p(Some((peer, bytes(buf))), None, T::DTYPE, T::DTYPE.size())
    }

    /// Receives into `buf` from `peer`.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad peer; `Mismatch` if the send does not match.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.check_peer("recv", peer)?;
        self.p2p(
            None,
            Some((peer, bytes_mut(buf))),
            T::DTYPE,
            T::DTYPE.size(),
        )
    }

    /// Sends `send` to `to` while receiving `recv` from `from`, both at once (no deadlock when two
    /// ranks exchange large buffers with each other).
    ///
    /// # Errors
    /// `InvalidArgument` for bad peers; `Mismatch` if either side does not match.
    pub fn send_recv<T: Element>(
        &self,
        send: &[T],
        to: usize,
        recv: &mut [T],
        from: usize,
    ) -> Result<()> {
        self.check_peer("send_recv", to)?;
        self.check_peer("send_recv", from)?;
        self.p2p(
            Some((to, bytes(send))),
            Some((from, bytes_mut(recv))),
            T::DTYPE,
            T::DTYPE.size(),
        )
    }
}

/// Runs one point-to-point exchange on the execution state (its turn has come).
pub(crate) fn exec_p2p(
    shared: &Shared,
    st: &mut ExecState,
    send: Option<(usize, &[u8])>,
    recv: Option<(usize, &mut [u8])>,
    dtype: DType,
    es: usize,
) -> Result<()> {
    let tag_for = |count: usize, seq: u64| {
        OpDesc {
            coll: Collective::SendRecv,
            dtype,
            op: ReduceOp::Sum,
            root: 0,
            count,
        }
        .tag(seq)
    };
    let send = send.map(|(p, d)| {
        st.p2p_sent[p] += 1;
        (p, d, tag_for(d.len() / es, st.p2p_sent[p]))
    });
    let recv = recv.map(|(p, b)| {
        st.p2p_recvd[p] += 1;
        let tag = tag_for(b.len() / es, st.p2p_recvd[p]);
        (p, b, RecvMode::Copy, tag)
    });
    tracing::debug!(rank = shared.rank, send_to = ?send.as_ref().map(|s| s.0), recv_from = ?recv.as_ref().map(|r| r.0), "send-recv");
    let mut ctx = Ctx::new(
        shared.rank,
        shared.size,
        &mut st.links,
        Default::default(),
        "send-recv",
        shared.timeout,
        &shared.abort,
    );
    ctx.spin = shared.spin;
    ctx.exchange_tagged(send, recv)?;
    ctx.flush()
}
