//! The collective calls of [`Communicator`]: argument checks, the tuner's choice, and dispatch to
//! the algorithms. Out-of-place forms copy into the output (or a scratch buffer) and run the
//! in-place algorithm there; the caller's input is never modified.

use std::ops::Range;
use std::sync::Arc;

use oxccl_kernels::{DType, Element, ReduceOp};

use crate::algorithm::{dissemination, linear, pairwise, ring};
use crate::api::buffers::with_scratch;
use crate::api::communicator::Communicator;
use crate::base::call::{Kind, Lens};
use crate::base::error::{Error, Result};
use crate::base::op::{counts_fingerprint, Collective, OpDesc};
use crate::engine::exec::{finish, reduce_scatter_v_body};
use crate::engine::Work;

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

/// The byte range of every rank's block in an all-to-all-v buffer, in rank order.
type Blocks = Vec<Range<usize>>;

fn bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

impl Communicator {
    /// The `InvalidArgument` this rank reports for `op` (with its world ranks noted, for a
    /// communicator made from another).
    pub(crate) fn invalid(&self, op: &str, msg: String) -> Error {
        self.shared.invalid(op, msg)
    }

    fn check_root(&self, op: &str, root: usize) -> Result<()> {
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

    fn desc<T: Element>(
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
    pub(crate) fn failed_work<B>(&self, e: Error, op: &'static str) -> Work<B> {
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
    pub fn reduce_scatter<T: Element>(
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
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.call(Kind::ReduceScatter(op), None, buf.into())
    }

    /// Asynchronous in-place reduce-scatter (see [`Communicator::reduce_scatter_in_place`]).
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

    /// Asynchronous out-of-place reduce-scatter (see [`Communicator::reduce_scatter`]): the job
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
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.call(Kind::AllGather, Some(input.into()), output.into())
    }

    /// All-gather in place: `buf` holds `size()` shards, this rank's shard at `rank()`.
    ///
    /// # Errors
    /// `InvalidArgument` unless `buf.len()` is a multiple of `size()`.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.call(Kind::AllGather, None, buf.into())
    }

    /// Asynchronous in-place all-gather (see [`Communicator::all_gather_in_place`]).
    pub fn all_gather_async<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
    ) -> Work<B> {
        let n = buf.as_mut().len();
        self.call_async_with(Kind::AllGather, (T::DTYPE, n), buf, typed_mut::<T, B>)
    }

    /// Asynchronous out-of-place all-gather (see [`Communicator::all_gather`]): the job owns
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
    pub fn reduce<T: Element>(
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
    pub fn reduce_in_place<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.call(Kind::Reduce { op, root }, None, buf.into())
    }

    /// Asynchronous [`reduce`](Self::reduce): the job owns `input` and `output` until `wait()`
    /// gives both back, the root's `output` holding the reduction (other ranks' `output` is not
    /// touched and may be empty; their partial results go to the communicator's reusable
    /// scratch buffer).
    pub fn reduce_async<T, I, O>(
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

    /// Asynchronous [`reduce_in_place`](Self::reduce_in_place): `wait()` gives `buf` back, the
    /// root's holding the reduction and every other rank's unchanged.
    pub fn reduce_in_place_async<T: Element, B: AsMut<[T]> + Send + 'static>(
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
    pub fn gather<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<()> {
        self.call(Kind::Gather { root }, Some(input.into()), output.into())
    }

    /// Asynchronous [`gather`](Self::gather): the job owns `input` and `output` until `wait()`
    /// gives both back (the root's `output` holding every rank's input).
    pub fn gather_async<T, I, O>(&self, input: I, output: O, root: usize) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.io_async(Kind::Gather { root }, input, output)
    }

    /// Asynchronous [`scatter`](Self::scatter): the job owns `input` and `output` until `wait()`
    /// gives both back (`output` holding this rank's block of the root's input).
    pub fn scatter_async<T, I, O>(&self, input: I, output: O, root: usize) -> Work<(I, O)>
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
    pub fn scatter<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<()> {
        self.call(Kind::Scatter { root }, Some(input.into()), output.into())
    }

    /// Checks the per-rank `counts` of a `-v` collective (`name`): one entry per rank, a sum
    /// that fits in bytes of `elem`, this rank's own side (`own_side`, `own` elements) holding
    /// `counts[rank]`, and the full side (`full_side`) holding their sum where its length is
    /// given. Returns every rank's byte range in the full buffer.
    fn v_blocks(
        &self,
        name: &str,
        counts: &[usize],
        elem: usize,
        (own_side, own): (&str, usize),
        (full_side, full): (&str, Option<usize>),
    ) -> Result<Blocks> {
        if counts.len() != self.size {
            return Err(self.invalid(
                name,
                format!(
                    "counts has {} entries; it must have one per rank ({})",
                    counts.len(),
                    self.size
                ),
            ));
        }
        let mut blocks = Vec::with_capacity(counts.len());
        let mut at = 0usize;
        for &c in counts {
            let end = at
                .checked_add(c)
                .filter(|e| e.checked_mul(elem).is_some())
                .ok_or_else(|| {
                    self.invalid(name, "counts add up to more than usize::MAX".into())
                })?;
            blocks.push(at * elem..end * elem);
            at = end;
        }
        let me = self.rank;
        if own != counts[me] {
            return Err(self.invalid(
                name,
                format!(
                    "{own_side} has {own} elements but counts[{me}] = {}",
                    counts[me]
                ),
            ));
        }
        if let Some(full) = full.filter(|&f| f != at) {
            return Err(self.invalid(
                name,
                format!("{full_side} has {full} elements but counts add up to {at}"),
            ));
        }
        Ok(blocks)
    }

    /// Checks a gather-v (`gather`) or scatter-v ([`Communicator::v_blocks`], the full side on
    /// the root only) and its root.
    fn rooted_v_blocks(
        &self,
        gather: bool,
        counts: &[usize],
        (own, full): (usize, usize),
        root: usize,
        elem: usize,
    ) -> Result<Blocks> {
        let (name, own_side, full_side) = if gather {
            ("gather_v", "input", "output")
        } else {
            ("scatter_v", "output", "input")
        };
        self.check_root(name, root)?;
        let full = (self.rank == root).then_some(full);
        self.v_blocks(name, counts, elem, (own_side, own), (full_side, full))
    }

    /// Gather with a block length per rank, like `MPI_Gatherv`: rank r's `input` has
    /// `counts[r]` elements, and the root's `output` receives every rank's input in rank order
    /// (`counts` summed; other ranks may pass an empty `output`). Every rank passes the same
    /// `counts`, or at least agrees with the root on its own entry.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad root, a `counts` without one entry per rank, an `input` of
    /// other than `counts[rank]` elements, or a root `output` of other than their sum. A rank
    /// and the root that disagree on the rank's count fail with `Mismatch` naming both.
    pub fn gather_v<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        root: usize,
    ) -> Result<()> {
        let elem = std::mem::size_of::<T>();
        let lens = (input.len(), output.len());
        let blocks = self.rooted_v_blocks(true, counts, lens, root, elem)?;
        if self.rank == root {
            bytes_mut(output)[blocks[root].clone()].copy_from_slice(bytes(input));
        }
        let total = counts.iter().sum();
        let desc = self.desc::<T>(Collective::GatherV, total, ReduceOp::Sum, root);
        self.shared.run(desc, |ctx, _| {
            linear::gather_v(ctx, bytes(input), bytes_mut(output), &blocks, root, elem)
        })
    }

    /// Scatter with a block length per rank, like `MPI_Scatterv`: the root's `input` holds
    /// every rank's block in rank order (`counts` summed; read only on the root), and rank r's
    /// `output` (of `counts[r]` elements) receives block r. Every rank passes the same `counts`,
    /// or at least agrees with the root on its own entry.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad root, a `counts` without one entry per rank, an `output` of
    /// other than `counts[rank]` elements, or a root `input` of other than their sum. A rank
    /// and the root that disagree on the rank's count fail with `Mismatch` naming both.
    pub fn scatter_v<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        root: usize,
    ) -> Result<()> {
        let elem = std::mem::size_of::<T>();
        let lens = (output.len(), input.len());
        let blocks = self.rooted_v_blocks(false, counts, lens, root, elem)?;
        if self.rank == root {
            bytes_mut(output).copy_from_slice(&bytes(input)[blocks[root].clone()]);
        }
        let total = counts.iter().sum();
        let desc = self.desc::<T>(Collective::ScatterV, total, ReduceOp::Sum, root);
        self.shared.run(desc, |ctx, _| {
            linear::scatter_v(ctx, bytes(input), &blocks, bytes_mut(output), root, elem)
        })
    }

    /// Asynchronous [`gather_v`](Self::gather_v): the job owns `input` and `output` until
    /// `wait()` gives both back. The counts are checked here and copied.
    pub fn gather_v_async<T, I, O>(
        &self,
        input: I,
        mut output: O,
        counts: &[usize],
        root: usize,
    ) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        let elem = std::mem::size_of::<T>();
        let lens = (input.as_ref().len(), output.as_mut().len());
        let blocks = match self.rooted_v_blocks(true, counts, lens, root, elem) {
            Ok(b) => b,
            Err(e) => return self.failed_work(e, "gather-v"),
        };
        let total = counts.iter().sum();
        let desc = self.desc::<T>(Collective::GatherV, total, ReduceOp::Sum, root);
        let rank = self.rank;
        self.shared
            .run_async(desc, (input, output), move |ctx, _, (i, o)| {
                let (input, output) = (bytes(i.as_ref()), bytes_mut(o.as_mut()));
                if rank == root {
                    output[blocks[root].clone()].copy_from_slice(input);
                }
                linear::gather_v(ctx, input, output, &blocks, root, elem)
            })
    }

    /// Asynchronous [`scatter_v`](Self::scatter_v): the job owns `input` and `output` until
    /// `wait()` gives both back. The counts are checked here and copied.
    pub fn scatter_v_async<T, I, O>(
        &self,
        input: I,
        mut output: O,
        counts: &[usize],
        root: usize,
    ) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        let elem = std::mem::size_of::<T>();
        let lens = (output.as_mut().len(), input.as_ref().len());
        let blocks = match self.rooted_v_blocks(false, counts, lens, root, elem) {
            Ok(b) => b,
            Err(e) => return self.failed_work(e, "scatter-v"),
        };
        let total = counts.iter().sum();
        let desc = self.desc::<T>(Collective::ScatterV, total, ReduceOp::Sum, root);
        let rank = self.rank;
        self.shared
            .run_async(desc, (input, output), move |ctx, _, (i, o)| {
                let (input, output) = (bytes(i.as_ref()), bytes_mut(o.as_mut()));
                if rank == root {
                    output.copy_from_slice(&input[blocks[root].clone()]);
                }
                linear::scatter_v(ctx, input, &blocks, output, root, elem)
            })
    }

    /// All-to-all: block j of rank r's `input` becomes block r of rank j's `output` (both
    /// `size()` blocks of equal length).
    ///
    /// # Errors
    /// `InvalidArgument` unless both lengths are equal and divisible by `size()`.
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.call(Kind::AllToAll, Some(input.into()), output.into())
    }

    /// Asynchronous [`all_to_all`](Self::all_to_all): the job owns `input` and `output` until
    /// `wait()`, which gives both back.
    pub fn all_to_all_async<T, I, O>(&self, input: I, output: O) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.io_async(Kind::AllToAll, input, output)
    }

    /// The byte ranges of every rank's block in the input and the output of an all-to-all-v
    /// with `ni` input and `no` output elements of `elem` bytes; `InvalidArgument` for count
    /// lists that do not fit (see [`all_to_all_v`](Self::all_to_all_v)).
    fn all_to_all_v_blocks(
        &self,
        send_counts: &[usize],
        recv_counts: &[usize],
        (ni, no): (usize, usize),
        elem: usize,
    ) -> Result<(Blocks, Blocks)> {
        let op = "all_to_all_v";
        let ranges = |counts: &[usize], what: &str, len: usize| -> Result<Blocks> {
            if counts.len() != self.size {
                return Err(self.invalid(
                    op,
                    format!(
                        "{what} has {} entries; it must have one per rank ({})",
                        counts.len(),
                        self.size
                    ),
                ));
            }
            let mut at = 0usize;
            let mut out = Vec::with_capacity(counts.len());
            for &c in counts {
                let end = at.checked_add(c).filter(|&e| e <= len).ok_or_else(|| {
                    self.invalid(
                        op,
                        format!("{what} add up to more than the buffer's {len} elements"),
                    )
                })?;
                out.push(at * elem..end * elem);
                at = end;
            }
            if at != len {
                return Err(self.invalid(
                    op,
                    format!("{what} add up to {at} elements but the buffer has {len}"),
                ));
            }
            Ok(out)
        };
        let sends = ranges(send_counts, "send_counts", ni)?;
        let recvs = ranges(recv_counts, "recv_counts", no)?;
        let me = self.rank;
        if send_counts[me] != recv_counts[me] {
            return Err(self.invalid(
                op,
                format!(
                    "send_counts[{me}] = {} but recv_counts[{me}] = {}: the block a rank sends \
                     itself must fit the block it receives from itself",
                    send_counts[me], recv_counts[me]
                ),
            ));
        }
        Ok((sends, recvs))
    }

    /// All-to-all with a block length per pair, like torch's `all_to_all_single` with split
    /// sizes or `MPI_Alltoallv` with packed blocks (the dispatch and combine of mixture-of-experts
    /// layers): rank r's `input` holds `send_counts[j]` elements for each rank j, in rank order,
    /// and its `output` receives `recv_counts[j]` elements from each rank j, in rank order.
    /// `send_counts[j]` on rank r must equal `recv_counts[r]` on rank j; ranks usually learn
    /// their `recv_counts` first with an [`all_to_all`](Self::all_to_all) of the send counts.
    ///
    /// ```no_run
    /// # fn f(comm: &oxccl_comm::Communicator, tokens: &[f32], send_counts: &[usize])
    /// #     -> oxccl_comm::Result<()> {
    /// let counts: Vec<u64> = send_counts.iter().map(|&c| c as u64).collect();
    /// let mut theirs = vec![0u64; comm.size()];
    /// comm.all_to_all(&counts, &mut theirs)?; // what every rank will send me
    /// let recv_counts: Vec<usize> = theirs.iter().map(|&c| c as usize).collect();
    /// let mut received = vec![0f32; recv_counts.iter().sum()];
    /// comm.all_to_all_v(tokens, send_counts, &mut received, &recv_counts)?;
    /// # Ok(()) }
    /// ```
    ///
    /// Every pair exchanges one message, empty or not, tagged with its count.
    ///
    /// # Errors
    /// `InvalidArgument` unless both count lists have `size()` entries, they sum to the input
    /// and output lengths, and `send_counts[rank] == recv_counts[rank]`. Two ranks that disagree
    /// on the count between them fail with `Mismatch` naming both counts.
    pub fn all_to_all_v<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
        output: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let elem = std::mem::size_of::<T>();
        let lens = (input.len(), output.len());
        let (sends, recvs) = self.all_to_all_v_blocks(send_counts, recv_counts, lens, elem)?;
        let desc = self.desc::<T>(Collective::AllToAllV, input.len(), ReduceOp::Sum, 0);
        self.shared.run(desc, |ctx, _| {
            pairwise::all_to_all_v(ctx, bytes(input), &sends, bytes_mut(output), &recvs, elem)
        })
    }

    /// Asynchronous [`all_to_all_v`](Self::all_to_all_v) (torch's `all_to_all_single` with
    /// `async_op=True`: an MoE layer can compute while its tokens travel): the job owns `input`
    /// and `output` until `wait()`, which gives both back. The counts are checked here and
    /// copied.
    pub fn all_to_all_v_async<T, I, O>(
        &self,
        input: I,
        send_counts: &[usize],
        mut output: O,
        recv_counts: &[usize],
    ) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        let elem = std::mem::size_of::<T>();
        let lens = (input.as_ref().len(), output.as_mut().len());
        let (sends, recvs) = match self.all_to_all_v_blocks(send_counts, recv_counts, lens, elem) {
            Ok(b) => b,
            Err(e) => return self.failed_work(e, "all-to-all-v"),
        };
        let desc = self.desc::<T>(Collective::AllToAllV, lens.0, ReduceOp::Sum, 0);
        self.shared
            .run_async(desc, (input, output), move |ctx, _, (i, o)| {
                let (i, o) = (bytes(i.as_ref()), bytes_mut(o.as_mut()));
                pairwise::all_to_all_v(ctx, i, &sends, o, &recvs, elem)
            })
    }

    /// Checks an all-gather-v or reduce-scatter-v ([`Communicator::v_blocks`]) whose shard side
    /// has `shard` elements and whose full side has `full`; returns the descriptor.
    fn v_desc<T: Element>(
        &self,
        coll: Collective,
        counts: &[usize],
        (shard, full): (usize, usize),
        op: ReduceOp,
    ) -> Result<OpDesc> {
        let (name, shard_side, full_side) = match coll {
            Collective::AllGatherV => ("all_gather_v", "input", "output"),
            _ => ("reduce_scatter_v", "output", "input"),
        };
        let elem = T::DTYPE.size();
        self.v_blocks(
            name,
            counts,
            elem,
            (shard_side, shard),
            (full_side, Some(full)),
        )?;
        let total = counts.iter().sum();
        Ok(self.desc::<T>(coll, total, op, counts_fingerprint(counts)))
    }

    /// All-gather with a shard length per rank, like `MPI_Allgatherv` or torch's `all_gather`
    /// with tensors of different sizes (variable-length sequences, uneven parameter shards):
    /// rank r's `input` has `counts[r]` elements, and every rank's `output` receives every rank's
    /// input in rank order (`counts` summed). Every rank passes the same `counts`.
    ///
    /// ```no_run
    /// # fn f(comm: &oxccl_comm::Communicator, mine: &[f32]) -> oxccl_comm::Result<()> {
    /// let mut counts = vec![0u64; comm.size()];
    /// comm.all_gather(&[mine.len() as u64], &mut counts)?; // every rank's length
    /// let counts: Vec<usize> = counts.iter().map(|&c| c as usize).collect();
    /// let mut all = vec![0f32; counts.iter().sum()];
    /// comm.all_gather_v(mine, &mut all, &counts)?;
    /// # Ok(()) }
    /// ```
    ///
    /// Ring algorithm, pipelined in blocks; shards run out at their own length.
    ///
    /// # Errors
    /// `InvalidArgument` unless `counts` has `size()` entries, `input.len() == counts[rank]` and
    /// `output.len()` is their sum. Ranks that pass different `counts` fail with `Mismatch`.
    pub fn all_gather_v<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
    ) -> Result<()> {
        let desc = self.v_desc::<T>(
            Collective::AllGatherV,
            counts,
            (input.len(), output.len()),
            ReduceOp::Sum,
        )?;
        self.shared.run(desc, |ctx, ch| {
            let (es, out) = (T::DTYPE.size(), bytes_mut(output));
            ring::all_gather_v(ctx, out, es, ch.chunk_bytes, bytes(input), counts)
        })
    }

    /// Asynchronous [`all_gather_v`](Self::all_gather_v): the job owns `input` and `output`
    /// until `wait()`, which gives both back. The counts are checked here and copied.
    pub fn all_gather_v_async<T, I, O>(
        &self,
        input: I,
        mut output: O,
        counts: &[usize],
    ) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        let lens = (input.as_ref().len(), output.as_mut().len());
        let desc = match self.v_desc::<T>(Collective::AllGatherV, counts, lens, ReduceOp::Sum) {
            Ok(d) => d,
            Err(e) => return self.failed_work(e, "all-gather-v"),
        };
        let counts = counts.to_vec();
        self.shared
            .run_async(desc, (input, output), move |ctx, ch, (i, o)| {
                let (es, out) = (T::DTYPE.size(), bytes_mut(o.as_mut()));
                ring::all_gather_v(ctx, out, es, ch.chunk_bytes, bytes(i.as_ref()), &counts)
            })
    }

    /// Reduce-scatter with a shard length per rank, like `MPI_Reduce_scatter` or torch's
    /// `reduce_scatter` with outputs of different sizes (parameters sharded unevenly): `input`
    /// holds every rank's shard in rank order (`counts` summed), and rank r's `output` (of
    /// `counts[r]` elements) receives the reduction of every rank's shard r. Every rank passes
    /// the same `counts`. Partial results go to the communicator's reusable scratch buffer.
    ///
    /// # Errors
    /// `InvalidArgument` unless `counts` has `size()` entries, `output.len() == counts[rank]`
    /// and `input.len()` is their sum. Ranks that pass different `counts` fail with `Mismatch`.
    pub fn reduce_scatter_v<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let desc = self.v_desc::<T>(
            Collective::ReduceScatterV,
            counts,
            (output.len(), input.len()),
            op,
        )?;
        with_scratch(&self.scratch, std::mem::size_of_val(input), |buf| {
            self.shared.run(desc, |ctx, ch| {
                let bufs = (bytes(input), buf, bytes_mut(output));
                reduce_scatter_v_body(ctx, ch, bufs, counts, T::DTYPE, op)
                    .and_then(|mine| finish(ctx, mine, T::DTYPE, op))
            })
        })
    }

    /// Asynchronous [`reduce_scatter_v`](Self::reduce_scatter_v): the job owns `input` and
    /// `output` until `wait()`, which gives both back. The counts are checked here and copied.
    pub fn reduce_scatter_v_async<T, I, O>(
        &self,
        input: I,
        mut output: O,
        counts: &[usize],
        op: ReduceOp,
    ) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        let lens = (output.as_mut().len(), input.as_ref().len());
        let desc = match self.v_desc::<T>(Collective::ReduceScatterV, counts, lens, op) {
            Ok(d) => d,
            Err(e) => return self.failed_work(e, "reduce-scatter-v"),
        };
        let (counts, scratch) = (counts.to_vec(), Arc::clone(&self.scratch));
        self.shared
            .run_async(desc, (input, output), move |ctx, ch, (i, o)| {
                let src = bytes(i.as_ref());
                with_scratch(&scratch, src.len(), |buf| {
                    let bufs = (src, buf, bytes_mut(o.as_mut()));
                    reduce_scatter_v_body(ctx, ch, bufs, &counts, T::DTYPE, op)
                        .and_then(|mine| finish(ctx, mine, T::DTYPE, op))
                })
            })
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
            .run_async(Self::barrier_desc(), (), |ctx, _, ()| {
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
