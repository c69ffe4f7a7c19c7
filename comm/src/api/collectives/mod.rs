//! The typed collective calls of [`Communicator`] on host slices: each makes untyped views of its
//! buffers and goes through the one dispatch of every call ([`Communicator::buffers`], in
//! `api/buffers.rs`), which checks the arguments and runs the algorithms the tuner picks. The
//! collectives with a length per rank are in `vector.rs`. The caller's input is never modified.

use oxccl_kernels::{DType, Element, ReduceOp};

use crate::algorithm::dissemination;
use crate::api::communicator::Communicator;
use crate::base::call::{Kind, Lens};
use crate::base::error::{Error, Result};
use crate::base::op::{Collective, OpDesc};
use crate::engine::Work;

mod vector;

/// The bytes of an owned typed buffer.
fn typed_mut<T: Element, B: AsMut<[T]>>(b: &mut B) -> &mut [u8] {
    bytemuck::cast_slice_mut(b.as_mut())
}

/// The bytes of an owned typed input and output.
fn typed_io<T: Element, I: AsRef<[T]>, O: AsMut<[T]>>(s: &mut (I, O)) -> (&[u8], &mut [u8]) {
    (
        bytemuck::cast_slice(s.0.as_ref()),
        bytemuck::cast_slice_mut(s.1.as_mut()),
    )
}

impl Communicator {
    /// The `InvalidArgument` this rank reports for `op` (with its world ranks noted, for a
    /// communicator made from another).
    pub(crate) fn invalid(&self, op: &str, msg: String) -> Error {
        self.shared.invalid(op, msg)
    }

    pub(super) fn check_root(&self, op: &str, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(self.invalid(
                op,
                format!(
                    "root {root} is not a rank of this communicator (size {})",
                    self.size
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn desc<T: Element>(
        &self,
        coll: Collective,
        count: usize,
        op: ReduceOp,
        root: usize,
    ) -> OpDesc {
        OpDesc {
            coll,
            dtype: T::DTYPE,
            op,
            root,
            count,
        }
    }

    /// Queues a call with an input and an output, both owned typed host buffers.
    fn io_async<T, I, O>(&self, kind: Kind, input: I, mut output: O) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        let lens = Lens::io(input.as_ref().len(), output.as_mut().len());
        self.call_async_io(kind, (T::DTYPE, lens), (input, output), typed_io::<T, I, O>)
    }

    /// Fails an async call before anything is queued (`e` noted with the world ranks, once).
    pub(crate) fn failed_work<B: Send + 'static>(&self, e: Error, op: &'static str) -> Work<B> {
        self.shared.failed_work(e, op)
    }

    /// All-reduce in place: every rank ends with the reduction of every rank's `buf`.
    ///
    /// # Errors
    /// `Mismatch`, `PeerLost`, `Timeout`, `Aborted` (see [`Error`]).
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.call(Kind::AllReduce(op), None, buf.into())
    }

    /// All-reduce out of place: `output` = reduction of every rank's `input`.
    ///
    /// # Errors
    /// `InvalidArgument` when the lengths differ; otherwise as [`Communicator::all_reduce`].
    pub fn all_reduce_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.call(Kind::AllReduce(op), Some(input.into()), output.into())
    }

    /// Asynchronous in-place all-reduce; `wait()` gives the buffer back reduced.
    pub fn all_reduce_async<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
        op: ReduceOp,
    ) -> Work<B> {
        let n = buf.as_mut().len();
        self.call_async_with(Kind::AllReduce(op), (T::DTYPE, n), buf, typed_mut::<T, B>)
    }

    /// Asynchronous out-of-place all-reduce: the job owns `input` and `output` until `wait()`,
    /// which gives both back with `output` = reduction of every rank's `input`. The input is
    /// read where it is (no copy into the output first), as in [`Communicator::all_reduce_into`].
    pub fn all_reduce_into_async<T, I, O>(&self, input: I, output: O, op: ReduceOp) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.io_async(Kind::AllReduce(op), input, output)
    }

    /// Reduce-scatter out of place: `input` holds `size()` shards of `output.len()` elements;
    /// rank r's `output` = reduction of every rank's shard r.
    ///
    /// # Errors
    /// `InvalidArgument` unless `input.len() == output.len() * size()`.
    pub fn reduce_scatter_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.call(Kind::ReduceScatter(op), Some(input.into()), output.into())
    }

    /// Reduce-scatter in place: `buf` holds `size()` shards; shard `rank()` ends reduced (the
    /// other shards hold partial results).
    ///
    /// # Errors
    /// `InvalidArgument` unless `buf.len()` is a multiple of `size()`.
    pub fn reduce_scatter<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.call(Kind::ReduceScatter(op), None, buf.into())
    }

    /// Asynchronous in-place reduce-scatter (see [`Communicator::reduce_scatter`]).
    pub fn reduce_scatter_async<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
        op: ReduceOp,
    ) -> Work<B> {
        let n = buf.as_mut().len();
        self.call_async_with(
            Kind::ReduceScatter(op),
            (T::DTYPE, n),
            buf,
            typed_mut::<T, B>,
        )
    }

    /// Asynchronous out-of-place reduce-scatter (see [`Communicator::reduce_scatter_into`]): the job
    /// owns `input` and `output` until `wait()` gives both back. Partial results go to the
    /// communicator's reusable scratch buffer (a fresh one while another call holds it).
    pub fn reduce_scatter_into_async<T, I, O>(
        &self,
        input: I,
        output: O,
        op: ReduceOp,
    ) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.io_async(Kind::ReduceScatter(op), input, output)
    }

    /// All-gather out of place: `output` = every rank's `input`, in rank order.
    ///
    /// # Errors
    /// `InvalidArgument` unless `output.len() == input.len() * size()`.
    pub fn all_gather_into<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.call(Kind::AllGather, Some(input.into()), output.into())
    }

    /// All-gather in place: `buf` holds `size()` shards, this rank's shard at `rank()`.
    ///
    /// # Errors
    /// `InvalidArgument` unless `buf.len()` is a multiple of `size()`.
    pub fn all_gather<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.call(Kind::AllGather, None, buf.into())
    }

    /// Asynchronous in-place all-gather (see [`Communicator::all_gather`]).
    pub fn all_gather_async<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
    ) -> Work<B> {
        let n = buf.as_mut().len();
        self.call_async_with(Kind::AllGather, (T::DTYPE, n), buf, typed_mut::<T, B>)
    }

    /// Asynchronous out-of-place all-gather (see [`Communicator::all_gather_into`]): the job owns
    /// `input` and `output` until `wait()` gives both back.
    pub fn all_gather_into_async<T, I, O>(&self, input: I, output: O) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.io_async(Kind::AllGather, input, output)
    }

    /// Broadcast in place: every rank's `buf` ends equal to the root's.
    ///
    /// # Errors
    /// `InvalidArgument` for a root outside the communicator.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.call(Kind::Broadcast { root }, None, buf.into())
    }

    /// Broadcast out of place: `output` = the root's `input` (`input` is read only on the root).
    ///
    /// # Errors
    /// `InvalidArgument` for a bad root, or on the root when the lengths differ.
    pub fn broadcast_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.call(Kind::Broadcast { root }, Some(input.into()), output.into())
    }

    /// Asynchronous in-place broadcast.
    pub fn broadcast_async<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
        root: usize,
    ) -> Work<B> {
        let n = buf.as_mut().len();
        self.call_async_with(
            Kind::Broadcast { root },
            (T::DTYPE, n),
            buf,
            typed_mut::<T, B>,
        )
    }

    /// Asynchronous out-of-place broadcast (see [`Communicator::broadcast_into`]): the job owns
    /// `input` (read only on the root) and `output` until `wait()` gives both back.
    pub fn broadcast_into_async<T, I, O>(&self, input: I, output: O, root: usize) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.io_async(Kind::Broadcast { root }, input, output)
    }

    /// Reduce out of place: the root's `output` = reduction of every rank's `input`; `output` is
    /// not touched on other ranks (it may be empty there).
    ///
    /// # Errors
    /// `InvalidArgument` for a bad root, or on the root when the lengths differ.
    pub fn reduce_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.call(Kind::Reduce { op, root }, Some(input.into()), output.into())
    }

    /// Reduce in place: the root's `buf` ends with the reduction; other ranks' `buf` is unchanged.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad root.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.call(Kind::Reduce { op, root }, None, buf.into())
    }

    /// Asynchronous [`reduce_into`](Self::reduce_into): the job owns `input` and `output` until `wait()`
    /// gives both back, the root's `output` holding the reduction (other ranks' `output` is not
    /// touched and may be empty; their partial results go to the communicator's reusable
    /// scratch buffer).
    pub fn reduce_into_async<T, I, O>(
        &self,
        input: I,
        output: O,
        op: ReduceOp,
        root: usize,
    ) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.io_async(Kind::Reduce { op, root }, input, output)
    }

    /// Asynchronous [`reduce`](Self::reduce): `wait()` gives `buf` back, the
    /// root's holding the reduction and every other rank's unchanged.
    pub fn reduce_async<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
        op: ReduceOp,
        root: usize,
    ) -> Work<B> {
        let n = buf.as_mut().len();
        self.call_async_with(
            Kind::Reduce { op, root },
            (T::DTYPE, n),
            buf,
            typed_mut::<T, B>,
        )
    }

    /// Gather: the root's `output` = every rank's `input` in rank order (`size() * input.len()`
    /// elements); `output` is not touched on other ranks (it may be empty there).
    ///
    /// # Errors
    /// `InvalidArgument` for a bad root or, on the root, a wrong output length.
    pub fn gather_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.call(Kind::Gather { root }, Some(input.into()), output.into())
    }

    /// Asynchronous [`gather_into`](Self::gather_into): the job owns `input` and `output` until `wait()`
    /// gives both back (the root's `output` holding every rank's input).
    pub fn gather_into_async<T, I, O>(&self, input: I, output: O, root: usize) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.io_async(Kind::Gather { root }, input, output)
    }

    /// Asynchronous [`scatter_into`](Self::scatter_into): the job owns `input` and `output` until `wait()`
    /// gives both back (`output` holding this rank's block of the root's input).
    pub fn scatter_into_async<T, I, O>(&self, input: I, output: O, root: usize) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.io_async(Kind::Scatter { root }, input, output)
    }

    /// Scatter: rank r's `output` = block r of the root's `input` (`size() * output.len()`
    /// elements, read only on the root).
    ///
    /// # Errors
    /// `InvalidArgument` for a bad root or, on the root, a wrong input length.
    pub fn scatter_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.call(Kind::Scatter { root }, Some(input.into()), output.into())
    }

    /// All-to-all: block j of rank r's `input` becomes block r of rank j's `output` (both
    /// `size()` blocks of equal length).
    ///
    /// # Errors
    /// `InvalidArgument` unless both lengths are equal and divisible by `size()`.
    pub fn all_to_all_into<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.call(Kind::AllToAll, Some(input.into()), output.into())
    }

    /// Asynchronous [`all_to_all_into`](Self::all_to_all_into): the job owns `input` and `output` until
    /// `wait()`, which gives both back.
    pub fn all_to_all_into_async<T, I, O>(&self, input: I, output: O) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.io_async(Kind::AllToAll, input, output)
    }

    /// Barrier: returns once every rank has entered it.
    ///
    /// # Errors
    /// `PeerLost`, `Timeout`, `Aborted`.
    pub fn barrier(&self) -> Result<()> {
        self.shared
            .run(Self::barrier_desc(), |ctx, _| dissemination::barrier(ctx))
    }

    /// Asynchronous [`barrier`](Self::barrier): `wait()` returns once every rank has entered
    /// it (torch's `barrier(async_op=True)`, or `MPI_Ibarrier`).
    pub fn barrier_async(&self) -> Work<()> {
        self.shared
            .run_async(Self::barrier_desc(), (), |ctx, _, (), _| {
                dissemination::barrier(ctx)
            })
    }

    fn barrier_desc() -> OpDesc {
        OpDesc {
            coll: Collective::Barrier,
            dtype: DType::U8,
            op: ReduceOp::Sum,
            root: 0,
            count: 0,
        }
    }
}
