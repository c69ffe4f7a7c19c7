//! Point-to-point calls of [`Communicator`]: send, recv, send_recv and batch_p2p.
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
use crate::prims::{Ctx, Links, RecvMode, RecvPart, SendPart};

/// One operation of a [`Communicator::batch_p2p`] batch.
#[derive(Debug)]
pub enum P2pOp<'a, T> {
    /// Send `buf` to `peer`.
    Send {
        /// The data.
        buf: &'a [T],
        /// A rank of the communicator (this rank too: then a receive from itself in the same
        /// batch takes it).
        peer: usize,
    },
    /// Receive into `buf` from `peer`.
    Recv {
        /// Where the data goes; its length must be the matching send's.
        buf: &'a mut [T],
        /// A rank of the communicator (this rank too).
        peer: usize,
    },
}

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

impl Communicator {
    /// Runs several sends and receives together and returns once all are done, like torch's
    /// `batch_isend_irecv` or NCCL's send/recv between `ncclGroupStart` and `ncclGroupEnd`:
    /// no order of the operations in the batch can deadlock, e.g. every rank sending to its
    /// next and previous neighbour while receiving from both (halo exchange, ring attention,
    /// the activations and gradients of two pipeline stages).
    ///
    /// Messages between two ranks are matched in order, in each direction: the k-th send to
    /// `p` (counting this batch's operations in order after earlier `send`s and batches) is
    /// taken by `p`'s k-th receive from this rank, whatever calls they come from. Operations to
    /// different peers run at once; several to the same peer in the same direction run one
    /// after another. A send to this rank itself is taken by a receive from itself in the same
    /// batch (a copy).
    ///
    /// ```no_run
    /// # use oxccl_comm::P2pOp;
    /// # fn f(comm: &oxccl_comm::Communicator) -> oxccl_comm::Result<()> {
    /// let (r, n) = (comm.rank(), comm.size());
    /// let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    /// let (left, right) = (vec![r as f32; 1024], vec![r as f32; 1024]);
    /// let (mut from_prev, mut from_next) = (vec![0f32; 1024], vec![0f32; 1024]);
    /// comm.batch_p2p(vec![
    ///     P2pOp::Send { buf: &right, peer: next },
    ///     P2pOp::Send { buf: &left, peer: prev },
    ///     P2pOp::Recv { buf: &mut from_prev, peer: prev },
    ///     P2pOp::Recv { buf: &mut from_next, peer: next },
    /// ])?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// `InvalidArgument` (naming the operation's index) for a peer outside the communicator,
    /// or sends and receives to this rank itself that do not pair up with equal lengths;
    /// `Mismatch` when a peer's matching operation has another length or type; `PeerLost`,
    /// `Timeout`, `Aborted`.
    pub fn batch_p2p<T: Element>(&self, ops: Vec<P2pOp<'_, T>>) -> Result<()> {
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        let (mut self_sends, mut self_recvs) = (Vec::new(), Vec::new());
        for (i, op) in ops.into_iter().enumerate() {
            let peer = match &op {
                P2pOp::Send { peer, .. } | P2pOp::Recv { peer, .. } => *peer,
            };
            if peer >= self.size {
                return Err(self.invalid(
                    "batch_p2p",
                    format!(
                        "operation {i}: peer {peer} is not a rank of this communicator (size {})",
                        self.size
                    ),
                ));
            }
            match op {
                P2pOp::Send { buf, peer } if peer == self.rank => self_sends.push((i, buf)),
                P2pOp::Recv { buf, peer } if peer == self.rank => self_recvs.push((i, buf)),
                P2pOp::Send { buf, peer } => sends.push((peer, bytes(buf))),
                P2pOp::Recv { buf, peer } => recvs.push((peer, bytes_mut(buf))),
            }
        }
        if self_sends.len() != self_recvs.len() {
            return Err(self.invalid(
                "batch_p2p",
                format!(
                    "{} sends to this rank itself but {} receives from it",
                    self_sends.len(),
                    self_recvs.len()
                ),
            ));
        }
        for ((i, s), (j, r)) in self_sends.iter().zip(&self_recvs) {
            if s.len() != r.len() {
                return Err(self.invalid(
                    "batch_p2p",
                    format!(
                        "operation {i} sends {} elements to this rank, but operation {j} \
                         receives {}",
                        s.len(),
                        r.len()
                    ),
                ));
            }
        }
        for ((_, s), (_, r)) in self_sends.into_iter().zip(self_recvs) {
            r.copy_from_slice(s);
        }
        if sends.is_empty() && recvs.is_empty() {
            return Ok(());
        }
        let (ticket, ahead) = self.shared.take_ticket();
        let shared = &self.shared;
        let es = T::DTYPE.size();
        shared.run_turn(ticket, ahead, |st| {
            exec_batch(shared, st, sends, recvs, T::DTYPE, es)
        })
    }
}

/// The tag of a point-to-point message: per-pair sequence number, dtype and element count.
fn p2p_tag(dtype: DType, count: usize, seq: u64) -> crate::transport::Tag {
    OpDesc {
        coll: Collective::SendRecv,
        dtype,
        op: ReduceOp::Sum,
        root: 0,
        count,
    }
    .tag(seq)
}

/// Runs a batch (its turn has come) in waves: wave k holds the k-th send to each peer and the
/// k-th receive from each peer, so no two parts of one wave share a connection and direction;
/// each wave's parts progress together. The peer's matching operation is in its wave k too (or
/// in a plain call of its own), so waves cannot wait on each other in a cycle.
fn exec_batch(
    shared: &Shared,
    st: &mut ExecState,
    sends: Vec<(usize, &[u8])>,
    recvs: Vec<(usize, &mut [u8])>,
    dtype: DType,
    es: usize,
) -> Result<()> {
    // Tags in batch order, then the wave of each part: its index among the parts to its peer.
    let n = shared.size;
    let mut waves: Vec<(Vec<SendPart<'_>>, Vec<RecvPart<'_>>)> = Vec::new();
    let mut wave_of = vec![0usize; n];
    for (p, d) in sends {
        st.p2p_sent[p] += 1;
        let tag = p2p_tag(dtype, d.len() / es, st.p2p_sent[p]);
        let w = wave_of[p];
        wave_of[p] += 1;
        if waves.len() <= w {
            waves.resize_with(w + 1, Default::default);
        }
        waves[w].0.push(SendPart::new(p, d, tag));
    }
    wave_of.iter_mut().for_each(|w| *w = 0);
    for (p, b) in recvs {
        st.p2p_recvd[p] += 1;
        let tag = p2p_tag(dtype, b.len() / es, st.p2p_recvd[p]);
        let w = wave_of[p];
        wave_of[p] += 1;
        if waves.len() <= w {
            waves.resize_with(w + 1, Default::default);
        }
        waves[w].1.push(RecvPart::new(p, b, RecvMode::Copy, tag));
    }
    tracing::debug!(rank = shared.rank, waves = waves.len(), "batch-p2p");
    let mut ctx = p2p_ctx(shared, &mut st.links, "batch-p2p");
    for (mut s, mut r) in waves {
        ctx.exchange_many(&mut s, &mut r)?;
    }
    ctx.flush()
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
    let tag_for = |count: usize, seq: u64| p2p_tag(dtype, count, seq);
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
    let mut ctx = p2p_ctx(shared, &mut st.links, "send-recv");
    ctx.exchange_tagged(send, recv)?;
    ctx.flush()
}

/// The context of a point-to-point operation: no collective tag (every message carries its
/// own), the communicator's time-out, abort flag and spinning policy.
fn p2p_ctx<'a>(shared: &'a Shared, links: &'a mut Links, name: &'static str) -> Ctx<'a> {
    let mut ctx = Ctx::new(
        shared.rank,
        shared.size,
        links,
        Default::default(),
        name,
        shared.timeout,
        &shared.abort,
    );
    ctx.spin = shared.spin;
    ctx
}
