//! Point-to-point calls of [`Communicator`]: send, recv, send_recv and batch_p2p, and their
//! async forms (send_async, recv_async, batch_p2p_async).
//!
//! Point-to-point messages do not take a collective sequence number (ranks that are not involved
//! do not see them); each ordered pair of ranks numbers its messages instead, and the tag carries
//! that number, the dtype and the count, so a receive that does not match its send is a
//! `Mismatch`, not garbage.

use oxccl_kernels::{DType, Element};

use crate::base::buffer::{Buf, BufMut};

use crate::api::communicator::Communicator;
use crate::base::call::Kind;
use crate::base::error::{Error, Result};
use crate::engine::p2p::{exec_batch, exec_p2p};
use crate::engine::{ExecState, Shared, Work};

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

/// One operation of [`Buffers::batch_p2p`](crate::Buffers::batch_p2p): an untyped view and a
/// peer.
#[derive(Debug)]
pub enum P2pView<'a> {
    /// Send `buf` to `peer`.
    Send {
        /// The data (host or device memory: every view of a batch in the same).
        buf: Buf<'a>,
        /// A rank of the communicator (this rank too, as in [`P2pOp`]).
        peer: usize,
    },
    /// Receive into `buf` from `peer`.
    Recv {
        /// Where the data goes (host or device memory); its length in bytes must be the
        /// matching send's.
        buf: BufMut<'a>,
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
    /// Blocking: a message larger than what the connection buffers (`OXCCL_NSLOTS` slots of
    /// `OXCCL_SLOT_BYTES`, 2 MiB at the defaults, plus the kernel's socket buffers over TCP)
    /// returns only once `peer` is receiving it. So ranks that all `send` before they `recv`
    /// (a ring shift, a pairwise swap) deadlock, until `OXCCL_TIMEOUT`, as soon as messages
    /// outgrow that; exchange with [`Communicator::send_recv`] or [`Communicator::batch_p2p`]
    /// instead, or let even ranks send first and odd ranks receive first.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad peer; `Mismatch` if the receive does not match.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.call_send(buf.into(), peer)
    }

    /// Receives into `buf` from `peer`.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad peer; `Mismatch` if the send does not match.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.call(Kind::Recv { peer }, None, buf.into())
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
        let parts = ops.into_iter().map(|op| match op {
            P2pOp::Send { buf, peer } => Part::Send(peer, bytes(buf)),
            P2pOp::Recv { buf, peer } => Part::Recv(peer, bytes_mut(buf)),
        });
        self.run_parts(parts, T::DTYPE)
    }

    /// Checks a batch's parts (elements of `dtype`) and runs them in this communicator's line.
    fn run_parts<'a>(&self, parts: impl IntoIterator<Item = Part<'a>>, dtype: DType) -> Result<()> {
        let batch = sort_batch((self.rank, self.size), dtype.size(), parts)
            .map_err(|e| self.shared.named(e))?;
        if batch.sends.is_empty() && batch.recvs.is_empty() {
            batch.copy_to_self();
            return Ok(());
        }
        let (ticket, ahead) = self.shared.take_ticket();
        let shared = &self.shared;
        shared.run_turn(ticket, ahead, |st| run_batch(shared, st, batch, dtype))
    }

    /// [`Communicator::batch_p2p`] on untyped host views whose data types may differ: every
    /// message is matched as bytes (its peer must also send or receive it through this call,
    /// or as `u8`).
    pub(crate) fn batch_p2p_views(&self, ops: Vec<P2pView<'_>>) -> Result<()> {
        let device = |v: &P2pView<'_>| match v {
            P2pView::Send { buf, .. } => buf.is_device(),
            P2pView::Recv { buf, .. } => buf.is_device(),
        };
        if ops.iter().any(device) {
            if !ops.iter().all(device) {
                let msg = "a batch takes host views or device views, not both".to_string();
                return Err(self.shared.named(self.invalid("batch_p2p", msg)));
            }
            return self.device_batch(ops);
        }
        let mut parts = Vec::with_capacity(ops.len());
        for op in ops {
            // Every view is in host memory (checked above).
            parts.extend(match op {
                P2pView::Send { buf, peer } => buf.into_host().map(|b| Part::Send(peer, b)),
                P2pView::Recv { buf, peer } => buf.into_host().map(|b| Part::Recv(peer, b)),
            });
        }
        self.run_parts(parts, DType::U8)
    }

    /// A batch of device views, all on one stream: enqueued there (`crate::api::device`).
    #[cfg(feature = "cuda-core")]
    fn device_batch(&self, ops: Vec<P2pView<'_>>) -> Result<()> {
        let mut dev = Vec::with_capacity(ops.len());
        let mut stream = None;
        for (i, op) in ops.into_iter().enumerate() {
            let (send, peer, data) = match op {
                P2pView::Send { buf, peer } => (true, peer, buf.data_device()),
                P2pView::Recv { buf, peer } => (false, peer, buf.data_device()),
            };
            let Some(buf) = data else {
                unreachable!("every view was checked to be in device memory")
            };
            let s = std::sync::Arc::clone(buf.stream);
            if stream
                .get_or_insert_with(|| std::sync::Arc::clone(&s))
                .cu_stream()
                != s.cu_stream()
            {
                let msg =
                    format!("operation {i}: its view is on another stream than operation 0's");
                return Err(self.shared.named(self.invalid("batch_p2p", msg)));
            }
            dev.push(crate::api::device::DevOp { send, peer, buf });
        }
        match stream {
            Some(s) => self
                .on_stream(&s)
                .launch_batch(dev)
                .map_err(|e| self.shared.named(e)),
            None => Ok(()),
        }
    }

    #[cfg(not(feature = "cuda-core"))]
    fn device_batch(&self, _: Vec<P2pView<'_>>) -> Result<()> {
        unreachable!("device views cannot be made without the cuda feature")
    }

    /// [`Communicator::batch_p2p`] in the background: the operations take their place in this
    /// communicator's line at the call (after every operation issued before it) and run there,
    /// while the caller computes; `wait()` gives the buffers back in the order of `ops`, the
    /// received data in them. Like torch's `batch_isend_irecv` followed by `wait()` on its
    /// requests (the activations and gradients of 1F1B pipeline stages, exchanged while the next
    /// micro-batch is computed).
    ///
    /// ```no_run
    /// # use oxccl_comm::OwnedP2pOp;
    /// # fn f(comm: &oxccl_comm::Communicator) -> oxccl_comm::Result<()> {
    /// let (r, n) = (comm.rank(), comm.size());
    /// let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    /// let work = comm.batch_p2p_async(vec![
    ///     OwnedP2pOp::Send { buf: vec![r as f32; 1024], peer: next },
    ///     OwnedP2pOp::Recv { buf: vec![0f32; 1024], peer: prev },
    /// ]);
    /// // ... compute ...
    /// let bufs = work.wait()?;
    /// assert_eq!(bufs[1][0], prev as f32);
    /// # Ok(()) }
    /// ```
    ///
    /// Errors come through `wait()`: `InvalidArgument` for a bad batch (checked at the call,
    /// before anything is queued); otherwise as [`Communicator::batch_p2p`].
    pub fn batch_p2p_async<T, B>(&self, ops: Vec<OwnedP2pOp<B>>) -> Work<Vec<B>>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.queue_batch("batch-p2p", ops)
    }

    /// Sends `buf` to `peer` in the background; `wait()` gives it back once the data has left
    /// this rank. The send takes its place in this communicator's line at the call, like an
    /// operation on a CUDA stream: it runs after every operation issued before it and before
    /// every later one. So an exchange in which both ranks send before they receive must be
    /// posted together with [`Communicator::batch_p2p_async`]: as two calls each rank's send
    /// would wait for a receive queued behind the peer's own send (messages larger than a
    /// connection buffers).
    ///
    /// Errors come through `wait()`: `InvalidArgument` for a bad peer; otherwise as
    /// [`Communicator::send`].
    pub fn send_async<T, B>(&self, buf: B, peer: usize) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.one_async("send", OwnedP2pOp::Send { buf, peer })
    }

    /// Receives from `peer` into `buf` in the background; `wait()` gives it back filled. Runs in
    /// this communicator's line like [`Communicator::send_async`].
    ///
    /// Errors come through `wait()`: `InvalidArgument` for a bad peer; otherwise as
    /// [`Communicator::recv`].
    pub fn recv_async<T, B>(&self, buf: B, peer: usize) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        self.one_async("recv", OwnedP2pOp::Recv { buf, peer })
    }

    /// One send or receive as a batch of one, after the peer check of the blocking call.
    fn one_async<T, B>(&self, name: &'static str, op: OwnedP2pOp<B>) -> Work<B>
    where
        T: Element,
        B: AsMut<[T]> + Send + 'static,
    {
        let peer = match &op {
            OwnedP2pOp::Send { peer, .. } | OwnedP2pOp::Recv { peer, .. } => *peer,
        };
        if let Err(e) = self.check_peer(name, peer) {
            return self.failed_work(e, name);
        }
        self.queue_batch(name, op)
    }

    /// Checks `ops` and queues them on the progress thread as one batch.
    fn queue_batch<T: Element, O: OwnedOps<T>>(&self, name: &'static str, ops: O) -> Work<O::Out> {
        let (rank, size, es) = (self.rank, self.size, T::DTYPE.size());
        let mut ops = ops;
        if let Err(e) = sort_batch((rank, size), es, ops.parts()) {
            return self.failed_work(e, name);
        }
        let run = move |shared: &Shared, st: &mut ExecState, ops: &mut O| {
            let batch = sort_batch((rank, size), es, ops.parts())?;
            run_batch(shared, st, batch, T::DTYPE)
        };
        self.shared.submit_work(name, ops, run, O::give_back)
    }
}

/// Operations that own their buffers: a batch, or one send or receive.
trait OwnedOps<T>: Send + 'static {
    /// What `wait()` gives back.
    type Out: Send + 'static;
    /// The operations, as bytes, in order.
    fn parts(&mut self) -> Vec<Part<'_>>;
    /// The buffers.
    fn give_back(self) -> Self::Out;
}

impl<T: Element, B: AsMut<[T]> + Send + 'static> OwnedOps<T> for OwnedP2pOp<B> {
    type Out = B;
    fn parts(&mut self) -> Vec<Part<'_>> {
        vec![self.part()]
    }
    fn give_back(self) -> B {
        self.into_buf()
    }
}

impl<T: Element, B: AsMut<[T]> + Send + 'static> OwnedOps<T> for Vec<OwnedP2pOp<B>> {
    type Out = Vec<B>;
    fn parts(&mut self) -> Vec<Part<'_>> {
        self.iter_mut().map(OwnedP2pOp::part).collect()
    }
    fn give_back(self) -> Vec<B> {
        self.into_iter().map(OwnedP2pOp::into_buf).collect()
    }
}

/// One operation of [`Communicator::batch_p2p_async`]: like [`P2pOp`], owning its buffer
/// (e.g. a `Vec<T>`) until `wait()` gives it back.
#[derive(Debug)]
pub enum OwnedP2pOp<B> {
    /// Send `buf` to `peer`.
    Send {
        /// The data.
        buf: B,
        /// A rank of the communicator (this rank too: then a receive from itself in the same
        /// batch takes it).
        peer: usize,
    },
    /// Receive into `buf` from `peer`.
    Recv {
        /// Where the data goes; its length must be the matching send's.
        buf: B,
        /// A rank of the communicator (this rank too).
        peer: usize,
    },
}

impl<B> OwnedP2pOp<B> {
    fn part<T: Element>(&mut self) -> Part<'_>
    where
        B: AsMut<[T]>,
    {
        match self {
            OwnedP2pOp::Send { buf, peer } => Part::Send(*peer, bytes(buf.as_mut())),
            OwnedP2pOp::Recv { buf, peer } => Part::Recv(*peer, bytes_mut(buf.as_mut())),
        }
    }

    fn into_buf(self) -> B {
        match self {
            OwnedP2pOp::Send { buf, .. } | OwnedP2pOp::Recv { buf, .. } => buf,
        }
    }
}

/// One operation of a batch, as bytes.
pub(crate) enum Part<'a> {
    Send(usize, &'a [u8]),
    Recv(usize, &'a mut [u8]),
}

/// A checked batch: the sends and receives to other ranks in batch order, and the copies from
/// sends to this rank itself into receives from it (paired in order).
pub(crate) struct Batch<'a> {
    sends: Vec<(usize, &'a [u8])>,
    recvs: Vec<(usize, &'a mut [u8])>,
    copies: Vec<(&'a [u8], &'a mut [u8])>,
}

/// The sends and receives to other ranks of a batch.
type Remote<'a> = (Vec<(usize, &'a [u8])>, Vec<(usize, &'a mut [u8])>);

impl<'a> Batch<'a> {
    /// Does the copies to this rank; returns the rest.
    fn copy_to_self(self) -> Remote<'a> {
        for (s, r) in self.copies {
            r.copy_from_slice(s);
        }
        (self.sends, self.recvs)
    }
}

/// Sorts a batch's operations, checking every peer and that sends to this rank pair up with
/// receives from it, with equal lengths (`es`: the element size, for the message).
pub(crate) fn sort_batch<'a>(
    (rank, size): (usize, usize),
    es: usize,
    parts: impl IntoIterator<Item = Part<'a>>,
) -> Result<Batch<'a>> {
    let invalid = |msg: String| Error::InvalidArgument {
        rank,
        op: "batch_p2p".into(),
        msg,
    };
    let (mut sends, mut recvs) = (Vec::new(), Vec::new());
    let (mut self_sends, mut self_recvs) = (Vec::new(), Vec::new());
    for (i, part) in parts.into_iter().enumerate() {
        let peer = match &part {
            Part::Send(peer, _) | Part::Recv(peer, _) => *peer,
        };
        if peer >= size {
            return Err(invalid(format!(
                "operation {i}: peer {peer} is not a rank of this communicator (size {size})"
            )));
        }
        match part {
            Part::Send(p, d) if p == rank => self_sends.push((i, d)),
            Part::Recv(p, b) if p == rank => self_recvs.push((i, b)),
            Part::Send(p, d) => sends.push((p, d)),
            Part::Recv(p, b) => recvs.push((p, b)),
        }
    }
    if self_sends.len() != self_recvs.len() {
        return Err(invalid(format!(
            "{} sends to this rank itself but {} receives from it",
            self_sends.len(),
            self_recvs.len()
        )));
    }
    let mut copies = Vec::with_capacity(self_sends.len());
    for ((i, s), (j, r)) in self_sends.into_iter().zip(self_recvs) {
        if s.len() != r.len() {
            return Err(invalid(format!(
                "operation {i} sends {} elements to this rank, but operation {j} receives {}",
                s.len() / es,
                r.len() / es
            )));
        }
        copies.push((s, r));
    }
    Ok(Batch {
        sends,
        recvs,
        copies,
    })
}

/// Runs a checked batch (its turn has come): the copies to this rank, then the rest in waves.
pub(crate) fn run_batch(
    shared: &Shared,
    st: &mut ExecState,
    batch: Batch<'_>,
    dtype: DType,
) -> Result<()> {
    let (sends, recvs) = batch.copy_to_self();
    if sends.is_empty() && recvs.is_empty() {
        return Ok(());
    }
    exec_batch(shared, st, sends, recvs, dtype, dtype.size())
}
