//! The collectives on untyped buffer views ([`Buf`], [`BufMut`]): one dispatch for every call
//! of this crate. A call is a [`Kind`] and its views; its arguments are checked once
//! ([`crate::base::call::check`], the same checks for host and device memory), then host
//! buffers run on this rank's engine and device buffers are enqueued on their stream
//! (`crate::api::device`). The typed calls ([`Communicator::all_reduce`] on `&mut [T]`,
//! [`crate::cuda::StreamComm`] on cudarc buffers) are thin wrappers that make the views.

use oxccl_kernels::{DType, ReduceOp};

use crate::algorithm::prims::{copy, Ctx};
use crate::algorithm::{linear, pairwise};
use crate::api::communicator::Communicator;
use crate::base::buffer::{Buf, BufMut, BufOwner, Data};
use crate::base::call::{check, Kind, Lens};
use crate::base::error::Result;
use crate::base::op::OpDesc;
use crate::base::tuning::Choice;
use crate::engine::exec::{
    all_gather_body, all_reduce_body, broadcast_body, finish, reduce_body, reduce_scatter_body,
};
use crate::engine::p2p::exec_p2p;
use crate::engine::Work;

/// Runs `f` on `nbytes` of the communicator's reusable scratch (8-byte aligned words, so a call
/// does not allocate and fault in a fresh buffer every time), or on a fresh zeroed buffer while
/// another call of this rank holds it (it may be queued behind this one: never wait for it).
pub(crate) fn with_scratch<R>(
    scratch: &std::sync::Mutex<Vec<u64>>,
    nbytes: usize,
    f: impl FnOnce(&mut [u8]) -> R,
) -> R {
    let mut fresh = Vec::new();
    let mut guard = scratch.try_lock().ok();
    let words: &mut Vec<u64> = guard.as_deref_mut().unwrap_or(&mut fresh);
    if words.len() < nbytes.div_ceil(8) {
        words.resize(nbytes.div_ceil(8), 0);
    }
    let raw: &mut [u8] = bytemuck::cast_slice_mut(&mut words[..]);
    f(&mut raw[..nbytes])
}

/// The collectives of a communicator on untyped buffer views, host or device memory alike
/// (device views are enqueued on the stream they were made for). Made by
/// [`Communicator::buffers`]; every call has the semantics, the checks and the errors of the
/// typed call of the same name.
///
/// ```no_run
/// # fn f(comm: &oxccl_comm::Communicator) -> Result<(), Box<dyn std::error::Error>> {
/// use oxccl_comm::{Buf, BufMut, DType, ReduceOp};
///
/// let mut bucket = vec![0u8; 2 * 4096]; // 4096 bf16 gradients, packed by the caller
/// comm.buffers()
///     .all_reduce(BufMut::host(&mut bucket, DType::BF16)?, ReduceOp::Avg)?;
/// let mut shard = vec![0u8; bucket.len() / comm.size()];
/// let (input, output) = (Buf::host(&bucket, DType::BF16)?, BufMut::host(&mut shard, DType::BF16)?);
/// comm.buffers().reduce_scatter_into(input, output, ReduceOp::Sum)?;
/// # Ok(()) }
/// ```
#[derive(Clone, Copy)]
pub struct Buffers<'c> {
    comm: &'c Communicator,
}

impl std::fmt::Debug for Buffers<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffers")
            .field("rank", &self.comm.rank)
            .field("size", &self.comm.size)
            .finish()
    }
}

impl Communicator {
    /// The collectives on untyped buffer views ([`Buf`], [`BufMut`]): flat buffers whose data
    /// type is known at run time, in host or device memory (see [`Buffers`]).
    pub fn buffers(&self) -> Buffers<'_> {
        Buffers { comm: self }
    }
}

impl Buffers<'_> {
    /// All-reduce in place (see [`Communicator::all_reduce`]).
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    pub fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.comm.call(Kind::AllReduce(op), None, buf)
    }

    /// All-reduce out of place (see [`Communicator::all_reduce_into`]).
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_into`].
    pub fn all_reduce_into(&self, input: Buf<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.comm.call(Kind::AllReduce(op), Some(input), output)
    }

    /// Reduce-scatter in place (see [`Communicator::reduce_scatter`]).
    ///
    /// # Errors
    /// As [`Communicator::reduce_scatter`].
    pub fn reduce_scatter(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.comm.call(Kind::ReduceScatter(op), None, buf)
    }

    /// Reduce-scatter out of place (see [`Communicator::reduce_scatter_into`]).
    ///
    /// # Errors
    /// As [`Communicator::reduce_scatter_into`].
    pub fn reduce_scatter_into(
        &self,
        input: Buf<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        self.comm.call(Kind::ReduceScatter(op), Some(input), output)
    }

    /// All-gather in place (see [`Communicator::all_gather`]).
    ///
    /// # Errors
    /// As [`Communicator::all_gather`].
    pub fn all_gather(&self, buf: BufMut<'_>) -> Result<()> {
        self.comm.call(Kind::AllGather, None, buf)
    }

    /// All-gather out of place (see [`Communicator::all_gather_into`]).
    ///
    /// # Errors
    /// As [`Communicator::all_gather_into`].
    pub fn all_gather_into(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<()> {
        self.comm.call(Kind::AllGather, Some(input), output)
    }

    /// Broadcast in place (see [`Communicator::broadcast`]).
    ///
    /// # Errors
    /// As [`Communicator::broadcast`].
    pub fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.comm.call(Kind::Broadcast { root }, None, buf)
    }

    /// Broadcast out of place (see [`Communicator::broadcast_into`]).
    ///
    /// # Errors
    /// As [`Communicator::broadcast_into`].
    pub fn broadcast_into(&self, input: Buf<'_>, output: BufMut<'_>, root: usize) -> Result<()> {
        self.comm
            .call(Kind::Broadcast { root }, Some(input), output)
    }

    /// Reduce in place (see [`Communicator::reduce`]).
    ///
    /// # Errors
    /// As [`Communicator::reduce`].
    pub fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()> {
        self.comm.call(Kind::Reduce { op, root }, None, buf)
    }

    /// Reduce out of place (see [`Communicator::reduce_into`]).
    ///
    /// # Errors
    /// As [`Communicator::reduce_into`].
    pub fn reduce_into(
        &self,
        input: Buf<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.comm
            .call(Kind::Reduce { op, root }, Some(input), output)
    }

    /// Gather (see [`Communicator::gather_into`]).
    ///
    /// # Errors
    /// As [`Communicator::gather_into`].
    pub fn gather_into(&self, input: Buf<'_>, output: BufMut<'_>, root: usize) -> Result<()> {
        self.comm.call(Kind::Gather { root }, Some(input), output)
    }

    /// Scatter (see [`Communicator::scatter_into`]).
    ///
    /// # Errors
    /// As [`Communicator::scatter_into`].
    pub fn scatter_into(&self, input: Buf<'_>, output: BufMut<'_>, root: usize) -> Result<()> {
        self.comm.call(Kind::Scatter { root }, Some(input), output)
    }

    /// All-to-all (see [`Communicator::all_to_all_into`]).
    ///
    /// # Errors
    /// As [`Communicator::all_to_all_into`].
    pub fn all_to_all_into(&self, input: Buf<'_>, output: BufMut<'_>) -> Result<()> {
        self.comm.call(Kind::AllToAll, Some(input), output)
    }

    /// Sends `buf` to `peer` (see [`Communicator::send`]).
    ///
    /// # Errors
    /// As [`Communicator::send`].
    pub fn send(&self, buf: Buf<'_>, peer: usize) -> Result<()> {
        self.comm.call_send(buf, peer)
    }

    /// Sends and receives together, none blocking another (see [`Communicator::batch_p2p`]),
    /// on views of any data types: each message is matched by its bytes, so its peer sends or
    /// receives it through this call too (or as `u8`). Device views (all on one stream) are
    /// staged through pinned host memory and enqueued on their stream: the call returns once
    /// the batch is enqueued, and later work on the stream sees the received data (with ranks
    /// that are threads of one process it waits for the host batch first). Not over CUDA IPC;
    /// not yet run on a GPU.
    ///
    /// # Errors
    /// As [`Communicator::batch_p2p`]; `InvalidArgument` for host and device views in one
    /// batch, or device views on different streams; for device views, a failure after the call
    /// returned comes from `Communicator::device_async_error` and every later device
    /// operation.
    pub fn batch_p2p(&self, ops: Vec<crate::api::p2p::P2pView<'_>>) -> Result<()> {
        self.comm.batch_p2p_views(ops)
    }

    /// Receives into `buf` from `peer` (see [`Communicator::recv`]).
    ///
    /// # Errors
    /// As [`Communicator::recv`].
    pub fn recv(&self, buf: BufMut<'_>, peer: usize) -> Result<()> {
        self.comm.call(Kind::Recv { peer }, None, buf)
    }

    /// Asynchronous in-place all-reduce of an owned host buffer; `wait()` gives it back.
    pub fn all_reduce_async<B: BufOwner>(&self, buf: B, op: ReduceOp) -> Work<B> {
        self.comm.call_async(Kind::AllReduce(op), buf)
    }

    /// Asynchronous in-place reduce-scatter of an owned host buffer.
    pub fn reduce_scatter_async<B: BufOwner>(&self, buf: B, op: ReduceOp) -> Work<B> {
        self.comm.call_async(Kind::ReduceScatter(op), buf)
    }

    /// Asynchronous in-place all-gather of an owned host buffer.
    pub fn all_gather_async<B: BufOwner>(&self, buf: B) -> Work<B> {
        self.comm.call_async(Kind::AllGather, buf)
    }

    /// Asynchronous in-place broadcast of an owned host buffer.
    pub fn broadcast_async<B: BufOwner>(&self, buf: B, root: usize) -> Work<B> {
        self.comm.call_async(Kind::Broadcast { root }, buf)
    }

    /// Asynchronous in-place reduce of an owned host buffer.
    pub fn reduce_async<B: BufOwner>(&self, buf: B, op: ReduceOp, root: usize) -> Work<B> {
        self.comm.call_async(Kind::Reduce { op, root }, buf)
    }
}

/// The bytes of an owned host buffer (empty for device memory, which the caller refused).
fn owned_bytes<B: BufOwner>(b: &mut B) -> &mut [u8] {
    b.view().into_host().unwrap_or_default()
}

/// The host bytes of one call: its input where it has one apart from the output (`None`: in
/// place), and its output (or in-place buffer).
struct Host<'b> {
    src: Option<&'b [u8]>,
    out: &'b mut [u8],
}

impl Communicator {
    /// One call on views: checked alike for host and device memory, then run on this rank's
    /// engine (host) or enqueued on the views' stream (device). `input` is `None` for calls in
    /// place (the output is then both).
    pub(crate) fn call(
        &self,
        kind: Kind,
        input: Option<Buf<'_>>,
        mut output: BufMut<'_>,
    ) -> Result<()> {
        let op = kind.name();
        let dtype = output.dtype();
        if let Some(i) = input.as_ref().filter(|i| i.dtype() != dtype) {
            let msg = format!("input is {} but output is {dtype}", i.dtype());
            return Err(self.invalid(op, msg));
        }
        let lens = match &input {
            Some(i) => Lens::io(i.count(), output.count()),
            None => Lens::in_place(output.count()),
        };
        let count = check(kind, self.rank, self.size, lens).map_err(|m| self.invalid(op, m))?;
        let desc = self.desc_of(kind, dtype, count);
        match (input.map(|i| i.data), &mut output.data) {
            (None, Data::Host(out)) => self.run_host(kind, desc, None, out),
            (Some(Data::Host(src)), Data::Host(out)) => self.run_host(kind, desc, Some(src), out),
            #[cfg(feature = "cuda-core")]
            (input, Data::Device(out)) => {
                let src = match input {
                    None => None,
                    Some(Data::Device(d)) => Some(d),
                    Some(Data::Host(_)) => return Err(self.mixed(op)),
                };
                self.launch_device(kind, dtype, src, out)
            }
            #[cfg(feature = "cuda-core")]
            (Some(Data::Device(_)), Data::Host(_)) => Err(self.mixed(op)),
            #[cfg(not(feature = "cuda-core"))]
            (_, Data::Device(never)) => match *never {},
            #[cfg(not(feature = "cuda-core"))]
            (Some(Data::Device(never)), _) => match never {},
        }
    }

    /// A send of `buf` to `peer` (a call whose only buffer is an input).
    pub(crate) fn call_send(&self, buf: Buf<'_>, peer: usize) -> Result<()> {
        let kind = Kind::Send { peer };
        let lens = Lens {
            input: Some(buf.count()),
            output: None,
            in_place: false,
        };
        let count = check(kind, self.rank, self.size, lens).map_err(|m| self.invalid("send", m))?;
        let dtype = buf.dtype();
        match buf.data {
            Data::Host(src) => {
                let desc = self.desc_of(kind, dtype, count);
                self.run_host(kind, desc, Some(src), &mut [])
            }
            #[cfg(feature = "cuda-core")]
            Data::Device(d) => self.launch_device_send(peer, dtype, d),
            #[cfg(not(feature = "cuda-core"))]
            Data::Device(never) => match never {},
        }
    }

    #[cfg(feature = "cuda-core")]
    fn mixed(&self, op: &str) -> crate::Error {
        self.invalid(
            op,
            "the input and the output must both be host or both be device buffers".into(),
        )
    }

    /// The description of a call: what its tag carries.
    pub(crate) fn desc_of(&self, kind: Kind, dtype: DType, count: usize) -> OpDesc {
        OpDesc {
            coll: kind
                .collective()
                .unwrap_or(crate::base::op::Collective::SendRecv),
            dtype,
            op: kind.op(),
            root: kind.root(),
            count,
        }
    }

    /// Runs a checked call on host memory, on the caller's thread when its turn comes.
    fn run_host(&self, kind: Kind, desc: OpDesc, src: Option<&[u8]>, out: &mut [u8]) -> Result<()> {
        if let Kind::Send { peer } | Kind::Recv { peer } = kind {
            let (dt, es) = (desc.dtype, desc.dtype.size());
            let (ticket, ahead) = self.shared.take_ticket();
            let shared = &self.shared;
            return shared.run_turn(ticket, ahead, |st| match kind {
                Kind::Send { .. } => exec_p2p(shared, st, src.map(|s| (peer, s)), None, dt, es),
                _ => exec_p2p(shared, st, None, Some((peer, out)), dt, es),
            });
        }
        let (rank, scratch) = (self.rank, &self.shared.scratch);
        self.shared.run(desc, |ctx, ch| {
            run_on(ctx, ch, kind, desc.dtype, rank, scratch, Host { src, out })
        })
    }

    /// Queues a call in place on an owned host buffer (a [`BufOwner`]) on the progress thread.
    pub(crate) fn call_async<B: BufOwner>(&self, kind: Kind, mut buf: B) -> Work<B> {
        let (dtype, count, device) = {
            let v = buf.view();
            (v.dtype(), v.count(), v.is_device())
        };
        if device {
            let msg = "async calls take host buffers (device calls are asynchronous on their \
                       stream already)";
            return self.failed_work(self.invalid(kind.name(), msg.into()), kind.tag_name());
        }
        self.call_async_with(kind, (dtype, count), buf, owned_bytes::<B>)
    }

    /// Queues a checked call in place on an owned host buffer (`view` gives its bytes: `count`
    /// elements of `dtype`) on the progress thread.
    pub(crate) fn call_async_with<S: Send + 'static>(
        &self,
        kind: Kind,
        (dtype, count): (DType, usize),
        state: S,
        view: for<'s> fn(&'s mut S) -> &'s mut [u8],
    ) -> Work<S> {
        let count = match check(kind, self.rank, self.size, Lens::in_place(count)) {
            Ok(c) => c,
            Err(m) => return self.failed_work(self.invalid(kind.name(), m), kind.tag_name()),
        };
        let desc = self.desc_of(kind, dtype, count);
        let rank = self.rank;
        self.shared
            .run_async(desc, state, move |ctx, ch, s, scratch| {
                let out = view(s);
                run_on(ctx, ch, kind, dtype, rank, scratch, Host { src: None, out })
            })
    }

    /// Queues a checked call with an input and an output, both owned host buffers (`views`
    /// gives their bytes), on the progress thread.
    pub(crate) fn call_async_io<S: Send + 'static>(
        &self,
        kind: Kind,
        (dtype, lens): (DType, Lens),
        state: S,
        views: for<'s> fn(&'s mut S) -> (&'s [u8], &'s mut [u8]),
    ) -> Work<S> {
        let count = match check(kind, self.rank, self.size, lens) {
            Ok(c) => c,
            Err(m) => return self.failed_work(self.invalid(kind.name(), m), kind.tag_name()),
        };
        let desc = self.desc_of(kind, dtype, count);
        let rank = self.rank;
        self.shared
            .run_async(desc, state, move |ctx, ch, s, scratch| {
                let (src, out) = views(s);
                let host = Host {
                    src: Some(src),
                    out,
                };
                run_on(ctx, ch, kind, dtype, rank, scratch, host)
            })
    }
}

/// The body of a checked host call on its context (the operation's turn has come): the
/// algorithms the tuner chose, over `bufs` (`rank`: this rank; `scratch`: the communicator's
/// reusable scratch, for the partial results of out-of-place reduce-scatters and of reduces off
/// the root).
fn run_on(
    ctx: &mut Ctx<'_>,
    ch: Choice,
    kind: Kind,
    dt: DType,
    rank: usize,
    scratch: &std::sync::Mutex<Vec<u64>>,
    bufs: Host<'_>,
) -> Result<()> {
    let Host { src, out } = bufs;
    let es = dt.size();
    match kind {
        Kind::AllReduce(op) => all_reduce_body(ctx, ch, src, out, dt, op),
        Kind::ReduceScatter(op) => match src {
            None => {
                reduce_scatter_body(ctx, ch, None, out, dt, op)?;
                let sb = out.len() / ctx.size;
                finish(ctx, &mut out[rank * sb..(rank + 1) * sb], dt, op)
            }
            Some(src) => with_scratch(scratch, src.len(), |buf| {
                reduce_scatter_body(ctx, ch, Some(src), buf, dt, op)?;
                let sb = buf.len() / ctx.size;
                let mine = &mut buf[rank * sb..(rank + 1) * sb];
                finish(ctx, mine, dt, op)?;
                copy(ctx.stream, out, mine);
                Ok(())
            }),
        },
        Kind::AllGather => all_gather_body(ctx, ch, out, es, src),
        Kind::Broadcast { root } => {
            let src = src.filter(|_| rank == root);
            broadcast_body(ctx, ch, src, out, dt, root)
        }
        Kind::Reduce { op, root } => {
            if rank == root {
                if let Some(s) = src {
                    out.copy_from_slice(s);
                }
                return reduce_body(ctx, ch, out, dt, op, root);
            }
            // Off the root the input is only read: partial results go to scratch.
            let input: &[u8] = match src {
                Some(s) => s,
                None => out,
            };
            with_scratch(scratch, input.len(), |buf| {
                buf.copy_from_slice(input);
                reduce_body(ctx, ch, buf, dt, op, root)
            })
        }
        Kind::Gather { root } => {
            let input = src.unwrap_or_default();
            if rank == root {
                let n = input.len();
                out[root * n..(root + 1) * n].copy_from_slice(input);
            }
            linear::gather(ctx, input, out, root)
        }
        Kind::Scatter { root } => {
            let input = src.unwrap_or_default();
            if rank == root {
                let n = out.len();
                out.copy_from_slice(&input[root * n..(root + 1) * n]);
            }
            linear::scatter(ctx, input, out, root)
        }
        Kind::AllToAll => pairwise::all_to_all(ctx, src.unwrap_or_default(), out),
        Kind::Send { .. } | Kind::Recv { .. } => Err(crate::Error::InvalidArgument {
            rank,
            op: kind.name().into(),
            msg: "point-to-point calls do not run as collectives".into(),
        }),
    }
}
