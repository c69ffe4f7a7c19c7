//! The collectives with a length per rank (`-v`, like MPI's `Gatherv` and torch's uneven
//! tensors): gather-v, scatter-v, all-gather-v, reduce-scatter-v and all-to-all-v, checked
//! against their count lists and run straight on the algorithms' byte forms.

use std::ops::Range;

use oxccl_kernels::{Element, ReduceOp};

use crate::algorithm::{linear, pairwise, ring};
use crate::api::buffers::with_scratch;
use crate::api::communicator::Communicator;
use crate::base::error::Result;
use crate::base::op::{counts_fingerprint, Collective, OpDesc};
use crate::engine::exec::{finish, reduce_scatter_v_body};
use crate::engine::Work;

/// The byte range of every rank's block in an all-to-all-v buffer, in rank order.
type Blocks = Vec<Range<usize>>;

fn bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

impl Communicator {
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
    pub fn gather_v_into<T: Element>(
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
    pub fn scatter_v_into<T: Element>(
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

    /// Asynchronous [`gather_v_into`](Self::gather_v_into): the job owns `input` and `output` until
    /// `wait()` gives both back. The counts are checked here and copied.
    pub fn gather_v_into_async<T, I, O>(
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
            .run_async(desc, (input, output), move |ctx, _, (i, o), _| {
                let (input, output) = (bytes(i.as_ref()), bytes_mut(o.as_mut()));
                if rank == root {
                    output[blocks[root].clone()].copy_from_slice(input);
                }
                linear::gather_v(ctx, input, output, &blocks, root, elem)
            })
    }

    /// Asynchronous [`scatter_v_into`](Self::scatter_v_into): the job owns `input` and `output` until
    /// `wait()` gives both back. The counts are checked here and copied.
    pub fn scatter_v_into_async<T, I, O>(
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
            .run_async(desc, (input, output), move |ctx, _, (i, o), _| {
                let (input, output) = (bytes(i.as_ref()), bytes_mut(o.as_mut()));
                if rank == root {
                    output.copy_from_slice(&input[blocks[root].clone()]);
                }
                linear::scatter_v(ctx, input, &blocks, output, root, elem)
            })
    }

    /// The byte ranges of every rank's block in the input and the output of an all-to-all-v
    /// with `ni` input and `no` output elements of `elem` bytes; `InvalidArgument` for count
    /// lists that do not fit (see [`all_to_all_v_into`](Self::all_to_all_v_into)).
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
    /// their `recv_counts` first with an [`all_to_all_into`](Self::all_to_all_into) of the send counts.
    ///
    /// ```no_run
    /// # fn f(comm: &oxccl_comm::Communicator, tokens: &[f32], send_counts: &[usize])
    /// #     -> oxccl_comm::Result<()> {
    /// let counts: Vec<u64> = send_counts.iter().map(|&c| c as u64).collect();
    /// let mut theirs = vec![0u64; comm.size()];
    /// comm.all_to_all_into(&counts, &mut theirs)?; // what every rank will send me
    /// let recv_counts: Vec<usize> = theirs.iter().map(|&c| c as usize).collect();
    /// let mut received = vec![0f32; recv_counts.iter().sum()];
    /// comm.all_to_all_v_into(tokens, send_counts, &mut received, &recv_counts)?;
    /// # Ok(()) }
    /// ```
    ///
    /// Every pair exchanges one message, empty or not, tagged with its count.
    ///
    /// # Errors
    /// `InvalidArgument` unless both count lists have `size()` entries, they sum to the input
    /// and output lengths, and `send_counts[rank] == recv_counts[rank]`. Two ranks that disagree
    /// on the count between them fail with `Mismatch` naming both counts.
    pub fn all_to_all_v_into<T: Element>(
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

    /// Asynchronous [`all_to_all_v_into`](Self::all_to_all_v_into) (torch's `all_to_all_single` with
    /// `async_op=True`: an MoE layer can compute while its tokens travel): the job owns `input`
    /// and `output` until `wait()`, which gives both back. The counts are checked here and
    /// copied.
    pub fn all_to_all_v_into_async<T, I, O>(
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
            .run_async(desc, (input, output), move |ctx, _, (i, o), _| {
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
    /// comm.all_gather_into(&[mine.len() as u64], &mut counts)?; // every rank's length
    /// let counts: Vec<usize> = counts.iter().map(|&c| c as usize).collect();
    /// let mut all = vec![0f32; counts.iter().sum()];
    /// comm.all_gather_v_into(mine, &mut all, &counts)?;
    /// # Ok(()) }
    /// ```
    ///
    /// Ring algorithm, pipelined in blocks; shards run out at their own length.
    ///
    /// # Errors
    /// `InvalidArgument` unless `counts` has `size()` entries, `input.len() == counts[rank]` and
    /// `output.len()` is their sum. Ranks that pass different `counts` fail with `Mismatch`.
    pub fn all_gather_v_into<T: Element>(
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

    /// Asynchronous [`all_gather_v_into`](Self::all_gather_v_into): the job owns `input` and `output`
    /// until `wait()`, which gives both back. The counts are checked here and copied.
    pub fn all_gather_v_into_async<T, I, O>(
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
            .run_async(desc, (input, output), move |ctx, ch, (i, o), _| {
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
    pub fn reduce_scatter_v_into<T: Element>(
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
        with_scratch(&self.shared.scratch, std::mem::size_of_val(input), |buf| {
            self.shared.run(desc, |ctx, ch| {
                let bufs = (bytes(input), buf, bytes_mut(output));
                reduce_scatter_v_body(ctx, ch, bufs, counts, T::DTYPE, op)
                    .and_then(|mine| finish(ctx, mine, T::DTYPE, op))
            })
        })
    }

    /// Asynchronous [`reduce_scatter_v_into`](Self::reduce_scatter_v_into): the job owns `input` and
    /// `output` until `wait()`, which gives both back. The counts are checked here and copied.
    pub fn reduce_scatter_v_into_async<T, I, O>(
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
        let counts = counts.to_vec();
        self.shared
            .run_async(desc, (input, output), move |ctx, ch, (i, o), scratch| {
                let src = bytes(i.as_ref());
                with_scratch(scratch, src.len(), |buf| {
                    let bufs = (src, buf, bytes_mut(o.as_mut()));
                    reduce_scatter_v_body(ctx, ch, bufs, &counts, T::DTYPE, op)
                        .and_then(|mine| finish(ctx, mine, T::DTYPE, op))
                })
            })
    }
}
