//! The collective calls of [`Communicator`]: argument checks, the tuner's choice, and dispatch to
//! the algorithms. Out-of-place forms copy into the output (or a scratch buffer) and run the
//! in-place algorithm there; the caller's input is never modified.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use oxccl_kernels::{
    check_factor, finish_avg_bytes, scale_bytes, scale_into_bytes, DType, Element, ReduceOp,
};

use crate::algorithm::{
    chain, direct, dissemination, halving_doubling, hierarchical, linear, pairwise, ring, tree,
};
use crate::channels;
use crate::communicator::Communicator;
use crate::engine::{ExecState, Shared, Work};
use crate::error::{Error, Result};
use crate::op::{counts_fingerprint, Collective, OpDesc};
use crate::prims::{Ctx, NodeLayout};
use crate::trace::What;
use crate::tuning::{self, Algorithm, Choice};

/// Runs `f` on `nbytes` of the communicator's reusable scratch (8-byte aligned words, so a call
/// does not allocate and fault in a fresh buffer every time), or on a fresh zeroed buffer while
/// another call of this rank holds it (it may be queued behind this one: never wait for it).
fn with_scratch<R>(
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

/// The byte range of every rank's block in an all-to-all-v buffer, in rank order.
type Blocks = Vec<Range<usize>>;

fn bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

fn no_algo(ctx: &Ctx<'_>, algo: Algorithm) -> Error {
    Error::InvalidArgument {
        rank: ctx.rank,
        op: ctx.op.into(),
        msg: format!("algorithm {algo} does not implement {}", ctx.op),
    }
}

/// Runs one collective on the execution state: sequence number, tuner, algorithm, flush.
fn exec<R>(
    shared: &Shared,
    st: &mut ExecState,
    desc: OpDesc,
    body: impl FnOnce(&mut Ctx<'_>, Choice) -> Result<R>,
) -> Result<R> {
    let seq = st.coll_seq;
    st.coll_seq += 1;
    let n = shared.size;
    let full = match desc.coll {
        Collective::ReduceScatter
        | Collective::AllGather
        | Collective::Gather
        | Collective::Scatter => desc.count * n,
        _ => desc.count,
    } * desc.dtype.size();
    let window = st.links.window.as_ref();
    let caps = tuning::Caps {
        staging: window.map_or(0, |w| w.capacity()),
        single_copy: window.is_some_and(|w| w.single_copy()),
        nodes: shared.layout.as_ref().is_some_and(NodeLayout::balanced),
        even_nodes: shared.layout.as_ref().is_some_and(|l| l.even),
        sockets: shared.sockets,
        hierarchical_block: shared.hierarchical_block,
    };
    let choice = tuning::choose(desc.coll, full, n, &shared.algo, caps);
    tracing::info!(rank = shared.rank, seq, op = %desc, algo = %choice.algo, bytes = full, block = choice.chunk_bytes, "collective");
    let what = What::Coll {
        seq,
        desc,
        algo: choice.algo,
        bytes: full,
    };
    shared.trace.record(what, || {
        let mut ctx = Ctx::new(
            shared.rank,
            n,
            &mut st.links,
            desc.tag(seq),
            desc.coll.name(),
            shared.timeout,
            &shared.abort,
        );
        ctx.collective = true;
        ctx.spin = shared.spin;
        ctx.send_thread = shared.send_thread.as_ref();
        ctx.shared = Some(shared);
        ctx.stream = full >= tuning::STREAM_MIN;
        ctx.layout = shared.layout.as_ref();
        ctx.stalls = Some(&shared.stalls);
        ctx.trace = Some(&shared.trace);
        let r = body(&mut ctx, choice)?;
        ctx.flush()?;
        Ok(r)
    })
}

/// The first step of a pre-multiplied sum ([`ReduceOp::PreMulSum`]): this rank's input (`src`,
/// or `buf` in place) times its factor, into `buf`; the algorithm then sums `buf` in place.
/// Other operations pass through untouched, and so does a pre-multiplied sum that the ring
/// runs on two ranks or more: it scales each chunk as it first uses it, while the chunk is in
/// cache (`ring::rs_steps`), instead of in a pass of its own here.
fn premultiply<'s>(
    ctx: &Ctx<'_>,
    ch: Choice,
    src: Option<&'s [u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
) -> Result<(Option<&'s [u8]>, ReduceOp)> {
    let Some(factor) = op.factor() else {
        return Ok((src, op));
    };
    if ch.algo == Algorithm::Ring && ctx.size > 1 {
        return Ok((src, op));
    }
    match src {
        Some(s) => scale_into_bytes(dt, buf, s, factor),
        None => scale_bytes(dt, buf, factor),
    }
    .map_err(|e| Error::InvalidArgument {
        rank: ctx.rank,
        op: ctx.op.into(),
        msg: e.to_string(),
    })?;
    Ok((None, ReduceOp::Sum))
}

/// An element-wise operation's body on this context alone: `(ctx, choice, src, buf)`.
type Whole<'a> = dyn Fn(&mut Ctx<'_>, Choice, Option<&[u8]>, &mut [u8]) -> Result<()> + Sync + 'a;

/// Runs `one` on `buf` (the element-wise collective `coll` of `dt`, with `op` and `root` where
/// they apply; `src` its out-of-place input indexed alike): cut across the communicator's
/// channels when it has them and `buf` is large enough (`crate::channels`; channel `i` runs
/// `one` on its part as an operation of its own, with the part's count), else on this context
/// alone. The parent's part stops through the communicator's abort flag, which is the context's.
#[allow(clippy::too_many_arguments)]
fn cut_or_whole(
    ctx: &mut Ctx<'_>,
    ch: Choice,
    (coll, dt, op, root): (Collective, DType, ReduceOp, usize),
    src: Option<&[u8]>,
    buf: &mut [u8],
    one: &Whole<'_>,
) -> Result<()> {
    let cut = ctx.shared.and_then(|shared| {
        let chs = shared.channels.get()?;
        Some((
            shared,
            chs,
            channels::parts(buf.len(), chs.comms.len() + 1)?,
        ))
    });
    let Some((shared, chs, parts)) = cut else {
        return one(ctx, ch, src, buf);
    };
    let es = dt.size();
    let desc = |bytes: usize| OpDesc {
        coll,
        dtype: dt,
        op,
        root,
        count: bytes / es,
    };
    let call = (ctx.tag.seq, desc(buf.len()).to_string());
    let part = |c: &Communicator, s: Option<&[u8]>, b: &mut [u8]| {
        c.run(desc(b.len()), |cx, cch| one(cx, cch, s, b))
    };
    channels::cut_op(
        chs,
        shared,
        &parts,
        src,
        buf,
        call,
        |s, b| one(ctx, ch, s, b),
        &part,
    )
}

/// All-reduce of `buf` (in place, or `buf = reduce(src)`), cut across the channels when it has
/// them ([`cut_or_whole`]).
fn all_reduce_body(
    ctx: &mut Ctx<'_>,
    ch: Choice,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
) -> Result<()> {
    let what = (Collective::AllReduce, dt, op, 0);
    cut_or_whole(ctx, ch, what, src, buf, &|cx, cch, s, b| {
        all_reduce_one(cx, cch, s, b, dt, op)
    })
}

/// All-reduce of `buf` on this communicator's own connections (in place, or `buf =
/// reduce(src)`: the ring and the direct algorithms read `src` where it is, the others start
/// from a copy).
fn all_reduce_one(
    ctx: &mut Ctx<'_>,
    ch: Choice,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
) -> Result<()> {
    let (src, op) = premultiply(ctx, ch, src, buf, dt, op)?;
    if let (Some(s), false) = (src, ch.algo.reads_input()) {
        buf.copy_from_slice(s);
    }
    if ctx.size > 1 {
        match ch.algo {
            Algorithm::Ring => ring::all_reduce(ctx, src, buf, dt, op, ch.chunk_bytes)?,
            Algorithm::Tree => tree::all_reduce(ctx, buf, dt, op, ch.chunk_bytes)?,
            Algorithm::HalvingDoubling => halving_doubling::all_reduce(ctx, buf, dt, op)?,
            Algorithm::RecursiveDoubling => {
                halving_doubling::all_reduce_doubling(ctx, src, buf, dt, op)?
            }
            Algorithm::Hierarchical => {
                hierarchical::all_reduce(ctx, src, buf, dt, op, ch.chunk_bytes)?
            }
            Algorithm::OneShot => direct::one_shot(ctx, src, buf, dt, op)?,
            Algorithm::TwoShot => direct::two_shot(ctx, src, buf, dt, op)?,
            Algorithm::SingleCopy => direct::single_copy(ctx, src, buf, dt, op)?,
            a => return Err(no_algo(ctx, a)),
        }
    } else if let Some(s) = src {
        buf.copy_from_slice(s);
    }
    if ch.algo == Algorithm::Ring && ctx.size > 1 {
        // The ring divided each rank's chunk for `Avg` before its all-gather.
        return Ok(());
    }
    finish(ctx, buf, dt, op)
}

/// Reduce-scatter of `buf` (`size` shards; in place, or reading the input `src` where it is).
fn reduce_scatter_body(
    ctx: &mut Ctx<'_>,
    ch: Choice,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
) -> Result<()> {
    let (src, op) = premultiply(ctx, ch, src, buf, dt, op)?;
    match ch.algo {
        Algorithm::Ring => ring::reduce_scatter(ctx, src, buf, dt, op, ch.chunk_bytes),
        Algorithm::Hierarchical => {
            hierarchical::reduce_scatter(ctx, src, buf, dt, op, ch.chunk_bytes)
        }
        a => Err(no_algo(ctx, a)),
    }
}

/// Reduce-scatter-v of `src` (elements of `dt`) through `buf` (scratch as long as `src`);
/// copies this rank's reduced shard into `out` and returns it (`Avg` is finished by the caller).
fn reduce_scatter_v_body<'o>(
    ctx: &mut Ctx<'_>,
    ch: Choice,
    (src, buf, out): (&[u8], &mut [u8], &'o mut [u8]),
    counts: &[usize],
    dt: DType,
    op: ReduceOp,
) -> Result<&'o mut [u8]> {
    let (src, op) = premultiply(ctx, ch, Some(src), buf, dt, op)?;
    match ch.algo {
        Algorithm::Ring => ring::reduce_scatter_v(ctx, src, buf, dt, op, ch.chunk_bytes, counts)?,
        a => return Err(no_algo(ctx, a)),
    }
    let at = counts[..ctx.rank].iter().sum::<usize>() * dt.size();
    crate::prims::copy(ctx.stream, out, &buf[at..at + out.len()]);
    Ok(out)
}

/// All-gather into `buf` (`size` shards; this rank's shard in place, or `own`).
fn all_gather_body(
    ctx: &mut Ctx<'_>,
    ch: Choice,
    buf: &mut [u8],
    es: usize,
    own: Option<&[u8]>,
) -> Result<()> {
    match ch.algo {
        Algorithm::Ring => ring::all_gather(ctx, buf, es, ch.chunk_bytes, own),
        Algorithm::Hierarchical => hierarchical::all_gather(ctx, buf, es, ch.chunk_bytes, own),
        a => Err(no_algo(ctx, a)),
    }
}

fn finish(ctx: &Ctx<'_>, buf: &mut [u8], dt: DType, op: ReduceOp) -> Result<()> {
    if op == ReduceOp::Avg {
        finish_avg_bytes(dt, buf, ctx.size).map_err(|e| Error::InvalidArgument {
            rank: ctx.rank,
            op: ctx.op.into(),
            msg: e.to_string(),
        })?;
    }
    Ok(())
}

/// Broadcast of `buf` from `root` (`src`: the root's input out of place), cut across the
/// channels when it has them ([`cut_or_whole`]).
fn broadcast_body(
    ctx: &mut Ctx<'_>,
    ch: Choice,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    root: usize,
) -> Result<()> {
    let es = dt.size();
    let what = (Collective::Broadcast, dt, ReduceOp::Sum, root);
    cut_or_whole(ctx, ch, what, src, buf, &|cx, cch, s, b| {
        broadcast_one(cx, cch, s, b, es, root)
    })
}

fn broadcast_one(
    ctx: &mut Ctx<'_>,
    ch: Choice,
    src: Option<&[u8]>,
    buf: &mut [u8],
    es: usize,
    root: usize,
) -> Result<()> {
    match ch.algo {
        Algorithm::Tree => {
            if let Some(s) = src {
                buf.copy_from_slice(s);
            }
            tree::broadcast(ctx, buf, es, root, ch.chunk_bytes)
        }
        Algorithm::Chain => chain::broadcast(ctx, buf, root, src),
        a => Err(no_algo(ctx, a)),
    }
}

/// Reduce into `buf` at the root; `buf` is a scratch copy on other ranks. Cut across the
/// channels when it has them ([`cut_or_whole`]).
fn reduce_body(
    ctx: &mut Ctx<'_>,
    ch: Choice,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let what = (Collective::Reduce, dt, op, root);
    cut_or_whole(ctx, ch, what, None, buf, &|cx, cch, _, b| {
        reduce_one(cx, cch, b, dt, op, root)
    })
}

fn reduce_one(
    ctx: &mut Ctx<'_>,
    ch: Choice,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (_, op) = premultiply(ctx, ch, None, buf, dt, op)?;
    if ctx.size > 1 && !buf.is_empty() {
        match ch.algo {
            Algorithm::Tree => tree::reduce(ctx, buf, dt, op, root, ch.chunk_bytes)?,
            Algorithm::Chain => chain::reduce(ctx, buf, dt, op, root)?,
            a => return Err(no_algo(ctx, a)),
        }
    }
    if ctx.rank == root {
        finish(ctx, buf, dt, op)?;
    }
    Ok(())
}

impl Communicator {
    /// The `InvalidArgument` this rank reports for `op` (with its world ranks noted, for a
    /// communicator made from another).
    pub(crate) fn invalid(&self, op: &str, msg: String) -> Error {
        self.shared.named(Error::InvalidArgument {
            rank: self.rank,
            op: op.into(),
            msg,
        })
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

    /// Checks what the operation of `desc` needs of its data type (a pre-multiplied sum's factor)
    /// before the call takes its turn: a bad factor fails on its rank at once, before anything
    /// is sent (ranks whose factors pass go on into the collective and wait for this one, as for
    /// any call one rank leaves out, until `Timeout` or a failure reaches them).
    pub(crate) fn check_op(&self, desc: &OpDesc) -> Result<()> {
        match desc.op.factor() {
            Some(f) => check_factor(desc.dtype, f)
                .map_err(|e| self.invalid(desc.coll.name(), format!("op={}: {e}", desc.op))),
            None => Ok(()),
        }
    }

    /// Runs a blocking collective on the caller's thread when its turn comes.
    fn run<R>(
        &self,
        desc: OpDesc,
        body: impl FnOnce(&mut Ctx<'_>, Choice) -> Result<R>,
    ) -> Result<R> {
        self.check_op(&desc)?;
        let (ticket, ahead) = self.shared.take_ticket();
        let shared = &self.shared;
        shared.run_turn(ticket, ahead, |st| exec(shared, st, desc, body))
    }

    /// Queues a collective on the progress thread; the job owns `buf` until `wait()`.
    fn run_async<B: Send + 'static>(
        &self,
        desc: OpDesc,
        buf: B,
        body: impl FnOnce(&mut Ctx<'_>, Choice, &mut B) -> Result<()> + Send + 'static,
    ) -> Work<B> {
        if let Err(e) = self.check_op(&desc) {
            return self.failed_work(e, desc.coll.name());
        }
        self.shared.submit_work(
            desc.coll.name(),
            buf,
            move |shared, st, buf| exec(shared, st, desc, |ctx, ch| body(ctx, ch, buf)),
            |buf| buf,
        )
    }

    /// Fails an async call before anything is queued (`e` noted with the world ranks, once).
    pub(crate) fn failed_work<B>(&self, e: Error, op: &'static str) -> Work<B> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let _ = tx.send(Err(self.shared.named(e)));
        Work::new(rx, Instant::now(), self.rank, op)
    }

    /// All-reduce in place: every rank ends with the reduction of every rank's `buf`.
    ///
    /// # Errors
    /// `Mismatch`, `PeerLost`, `Timeout`, `Aborted` (see [`Error`]).
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let desc = self.desc::<T>(Collective::AllReduce, buf.len(), op, 0);
        self.run(desc, |ctx, ch| {
            all_reduce_body(ctx, ch, None, bytes_mut(buf), T::DTYPE, op)
        })
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
        if input.len() != output.len() {
            return Err(self.invalid(
                "all_reduce",
                format!(
                    "input has {} elements, output {}",
                    input.len(),
                    output.len()
                ),
            ));
        }
        let desc = self.desc::<T>(Collective::AllReduce, output.len(), op, 0);
        self.run(desc, |ctx, ch| {
            all_reduce_body(ctx, ch, Some(bytes(input)), bytes_mut(output), T::DTYPE, op)
        })
    }

    /// Asynchronous in-place all-reduce; `wait()` gives the buffer back reduced.
    pub fn all_reduce_async<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
        op: ReduceOp,
    ) -> Work<B> {
        let desc = self.desc::<T>(Collective::AllReduce, buf.as_mut().len(), op, 0);
        self.run_async(desc, buf, move |ctx, ch, b| {
            all_reduce_body(ctx, ch, None, bytes_mut(b.as_mut()), T::DTYPE, op)
        })
    }

    /// Asynchronous out-of-place all-reduce: the job owns `input` and `output` until `wait()`,
    /// which gives both back with `output` = reduction of every rank's `input`. The input is
    /// read where it is (no copy into the output first), as in [`Communicator::all_reduce_into`].
    pub fn all_reduce_into_async<T, I, O>(
        &self,
        input: I,
        mut output: O,
        op: ReduceOp,
    ) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        let (ni, no) = (input.as_ref().len(), output.as_mut().len());
        if ni != no {
            let e = self.invalid(
                "all_reduce",
                format!("input has {ni} elements, output {no}"),
            );
            return self.failed_work(e, "all-reduce");
        }
        let desc = self.desc::<T>(Collective::AllReduce, no, op, 0);
        self.run_async(desc, (input, output), move |ctx, ch, (i, o)| {
            let src = bytes(i.as_ref());
            all_reduce_body(ctx, ch, Some(src), bytes_mut(o.as_mut()), T::DTYPE, op)
        })
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
        if input.len() != output.len() * self.size {
            return Err(self.invalid(
                "reduce_scatter",
                format!(
                    "input has {} elements; it must be output length {} x world size {}",
                    input.len(),
                    output.len(),
                    self.size
                ),
            ));
        }
        with_scratch(&self.scratch, std::mem::size_of_val(input), |buf| {
            self.reduce_scatter_run::<T>(Some(bytes(input)), buf, Some(bytes_mut(output)), op)
        })
    }

    /// Reduce-scatter in place: `buf` holds `size()` shards; shard `rank()` ends reduced (the
    /// other shards hold partial results).
    ///
    /// # Errors
    /// `InvalidArgument` unless `buf.len()` is a multiple of `size()`.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        if !buf.len().is_multiple_of(self.size) {
            return Err(self.invalid(
                "reduce_scatter",
                format!(
                    "buffer of {} elements is not divisible by the world size {}",
                    buf.len(),
                    self.size
                ),
            ));
        }
        self.reduce_scatter_run::<T>(None, bytes_mut(buf), None, op)
    }

    /// Runs a reduce-scatter of `T` elements over `buf` (`size()` shards): the input is `src`
    /// (out of place) or `buf` itself; shard `rank()` of `buf` ends reduced and is copied to
    /// `out` when given.
    fn reduce_scatter_run<T: Element>(
        &self,
        src: Option<&[u8]>,
        buf: &mut [u8],
        out: Option<&mut [u8]>,
        op: ReduceOp,
    ) -> Result<()> {
        let count = buf.len() / T::DTYPE.size() / self.size;
        let desc = self.desc::<T>(Collective::ReduceScatter, count, op, 0);
        let rank = self.rank;
        self.run(desc, |ctx, ch| {
            reduce_scatter_body(ctx, ch, src, buf, T::DTYPE, op)?;
            let sb = buf.len() / ctx.size;
            let mine = &mut buf[rank * sb..(rank + 1) * sb];
            finish(ctx, mine, T::DTYPE, op)?;
            if let Some(o) = out {
                crate::prims::copy(ctx.stream, o, mine);
            }
            Ok(())
        })
    }

    /// Asynchronous in-place reduce-scatter (see [`Communicator::reduce_scatter_in_place`]).
    pub fn reduce_scatter_async<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
        op: ReduceOp,
    ) -> Work<B> {
        let len = buf.as_mut().len();
        if len % self.size != 0 {
            let e = self.invalid(
                "reduce_scatter",
                format!(
                    "buffer of {len} elements is not divisible by the world size {}",
                    self.size
                ),
            );
            return self.failed_work(e, "reduce-scatter");
        }
        let desc = self.desc::<T>(Collective::ReduceScatter, len / self.size, op, 0);
        let rank = self.rank;
        self.run_async(desc, buf, move |ctx, ch, b| {
            let b = bytes_mut(b.as_mut());
            reduce_scatter_body(ctx, ch, None, b, T::DTYPE, op)?;
            let sb = b.len() / ctx.size;
            finish(ctx, &mut b[rank * sb..(rank + 1) * sb], T::DTYPE, op)
        })
    }

    /// Asynchronous out-of-place reduce-scatter (see [`Communicator::reduce_scatter`]): the job
    /// owns `input` and `output` until `wait()` gives both back. Partial results go to the
    /// communicator's reusable scratch buffer (a fresh one while another call holds it).
    pub fn reduce_scatter_into_async<T, I, O>(
        &self,
        input: I,
        mut output: O,
        op: ReduceOp,
    ) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        let (ni, no) = (input.as_ref().len(), output.as_mut().len());
        if ni != no * self.size {
            let e = self.invalid(
                "reduce_scatter",
                format!(
                    "input has {ni} elements; it must be output length {no} x world size {}",
                    self.size
                ),
            );
            return self.failed_work(e, "reduce-scatter");
        }
        let desc = self.desc::<T>(Collective::ReduceScatter, no, op, 0);
        let (rank, scratch) = (self.rank, Arc::clone(&self.scratch));
        self.run_async(desc, (input, output), move |ctx, ch, (i, o)| {
            let src = bytes(i.as_ref());
            with_scratch(&scratch, src.len(), |buf| {
                reduce_scatter_body(ctx, ch, Some(src), buf, T::DTYPE, op)?;
                let sb = buf.len() / ctx.size;
                let mine = &mut buf[rank * sb..(rank + 1) * sb];
                finish(ctx, mine, T::DTYPE, op)?;
                crate::prims::copy(ctx.stream, bytes_mut(o.as_mut()), mine);
                Ok(())
            })
        })
    }

    /// All-gather out of place: `output` = every rank's `input`, in rank order.
    ///
    /// # Errors
    /// `InvalidArgument` unless `output.len() == input.len() * size()`.
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        if output.len() != input.len() * self.size {
            return Err(self.invalid(
                "all_gather",
                format!(
                    "output has {} elements; it must be input length {} x world size {}",
                    output.len(),
                    input.len(),
                    self.size
                ),
            ));
        }
        let desc = self.desc::<T>(Collective::AllGather, input.len(), ReduceOp::Sum, 0);
        self.run(desc, |ctx, ch| {
            let es = T::DTYPE.size();
            all_gather_body(ctx, ch, bytes_mut(output), es, Some(bytes(input)))
        })
    }

    /// All-gather in place: `buf` holds `size()` shards, this rank's shard at `rank()`.
    ///
    /// # Errors
    /// `InvalidArgument` unless `buf.len()` is a multiple of `size()`.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        if !buf.len().is_multiple_of(self.size) {
            return Err(self.invalid(
                "all_gather",
                format!(
                    "buffer of {} elements is not divisible by the world size {}",
                    buf.len(),
                    self.size
                ),
            ));
        }
        let desc = self.desc::<T>(
            Collective::AllGather,
            buf.len() / self.size,
            ReduceOp::Sum,
            0,
        );
        self.run(desc, |ctx, ch| {
            all_gather_body(ctx, ch, bytes_mut(buf), T::DTYPE.size(), None)
        })
    }

    /// Asynchronous in-place all-gather (see [`Communicator::all_gather_in_place`]).
    pub fn all_gather_async<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
    ) -> Work<B> {
        let len = buf.as_mut().len();
        if len % self.size != 0 {
            let e = self.invalid(
                "all_gather",
                format!(
                    "buffer of {len} elements is not divisible by the world size {}",
                    self.size
                ),
            );
            return self.failed_work(e, "all-gather");
        }
        let desc = self.desc::<T>(Collective::AllGather, len / self.size, ReduceOp::Sum, 0);
        self.run_async(desc, buf, move |ctx, ch, b| {
            all_gather_body(ctx, ch, bytes_mut(b.as_mut()), T::DTYPE.size(), None)
        })
    }

    /// Asynchronous out-of-place all-gather (see [`Communicator::all_gather`]): the job owns
    /// `input` and `output` until `wait()` gives both back.
    pub fn all_gather_into_async<T, I, O>(&self, input: I, mut output: O) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        let (ni, no) = (input.as_ref().len(), output.as_mut().len());
        if no != ni * self.size {
            let e = self.invalid(
                "all_gather",
                format!(
                    "output has {no} elements; it must be input length {ni} x world size {}",
                    self.size
                ),
            );
            return self.failed_work(e, "all-gather");
        }
        let desc = self.desc::<T>(Collective::AllGather, ni, ReduceOp::Sum, 0);
        self.run_async(desc, (input, output), move |ctx, ch, (i, o)| {
            let es = T::DTYPE.size();
            all_gather_body(ctx, ch, bytes_mut(o.as_mut()), es, Some(bytes(i.as_ref())))
        })
    }

    /// Broadcast in place: every rank's `buf` ends equal to the root's.
    ///
    /// # Errors
    /// `InvalidArgument` for a root outside the communicator.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root("broadcast", root)?;
        let desc = self.desc::<T>(Collective::Broadcast, buf.len(), ReduceOp::Sum, root);
        self.run(desc, |ctx, ch| {
            broadcast_body(ctx, ch, None, bytes_mut(buf), T::DTYPE, root)
        })
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
        self.check_root("broadcast", root)?;
        if self.rank == root && input.len() != output.len() {
            return Err(self.invalid(
                "broadcast",
                format!(
                    "input has {} elements, output {}",
                    input.len(),
                    output.len()
                ),
            ));
        }
        let desc = self.desc::<T>(Collective::Broadcast, output.len(), ReduceOp::Sum, root);
        let src = (self.rank == root).then(|| bytes(input));
        self.run(desc, |ctx, ch| {
            broadcast_body(ctx, ch, src, bytes_mut(output), T::DTYPE, root)
        })
    }

    /// Asynchronous in-place broadcast.
    pub fn broadcast_async<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
        root: usize,
    ) -> Work<B> {
        if let Err(e) = self.check_root("broadcast", root) {
            return self.failed_work(e, "broadcast");
        }
        let desc = self.desc::<T>(
            Collective::Broadcast,
            buf.as_mut().len(),
            ReduceOp::Sum,
            root,
        );
        self.run_async(desc, buf, move |ctx, ch, b| {
            broadcast_body(ctx, ch, None, bytes_mut(b.as_mut()), T::DTYPE, root)
        })
    }

    /// Asynchronous out-of-place broadcast (see [`Communicator::broadcast_into`]): the job owns
    /// `input` (read only on the root) and `output` until `wait()` gives both back.
    pub fn broadcast_into_async<T, I, O>(
        &self,
        input: I,
        mut output: O,
        root: usize,
    ) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        if let Err(e) = self.check_root("broadcast", root) {
            return self.failed_work(e, "broadcast");
        }
        let (ni, no) = (input.as_ref().len(), output.as_mut().len());
        if self.rank == root && ni != no {
            let e = self.invalid("broadcast", format!("input has {ni} elements, output {no}"));
            return self.failed_work(e, "broadcast");
        }
        let desc = self.desc::<T>(Collective::Broadcast, no, ReduceOp::Sum, root);
        let at_root = self.rank == root;
        self.run_async(desc, (input, output), move |ctx, ch, (i, o)| {
            let src = at_root.then(|| bytes(i.as_ref()));
            broadcast_body(ctx, ch, src, bytes_mut(o.as_mut()), T::DTYPE, root)
        })
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
        self.check_root("reduce", root)?;
        let desc = self.desc::<T>(Collective::Reduce, input.len(), op, root);
        if self.rank == root {
            if input.len() != output.len() {
                return Err(self.invalid(
                    "reduce",
                    format!(
                        "input has {} elements, output {}",
                        input.len(),
                        output.len()
                    ),
                ));
            }
            output.copy_from_slice(input);
            self.run(desc, |ctx, ch| {
                reduce_body(ctx, ch, bytes_mut(output), T::DTYPE, op, root)
            })
        } else {
            let mut scratch = input.to_vec();
            self.run(desc, |ctx, ch| {
                reduce_body(ctx, ch, bytes_mut(&mut scratch), T::DTYPE, op, root)
            })
        }
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
        if self.rank == root {
            self.check_root("reduce", root)?;
            let desc = self.desc::<T>(Collective::Reduce, buf.len(), op, root);
            self.run(desc, |ctx, ch| {
                reduce_body(ctx, ch, bytes_mut(buf), T::DTYPE, op, root)
            })
        } else {
            self.reduce(buf, &mut [], op, root)
        }
    }

    /// Asynchronous [`reduce`](Self::reduce): the job owns `input` and `output` until `wait()`
    /// gives both back, the root's `output` holding the reduction (other ranks' `output` is not
    /// touched and may be empty; their partial results go to the communicator's reusable
    /// scratch buffer).
    pub fn reduce_async<T, I, O>(
        &self,
        input: I,
        mut output: O,
        op: ReduceOp,
        root: usize,
    ) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        if let Err(e) = self.check_root("reduce", root) {
            return self.failed_work(e, "reduce");
        }
        let (ni, no) = (input.as_ref().len(), output.as_mut().len());
        if self.rank == root && ni != no {
            let e = self.invalid("reduce", format!("input has {ni} elements, output {no}"));
            return self.failed_work(e, "reduce");
        }
        let desc = self.desc::<T>(Collective::Reduce, ni, op, root);
        let (rank, scratch) = (self.rank, Arc::clone(&self.scratch));
        self.run_async(desc, (input, output), move |ctx, ch, (i, o)| {
            let src = bytes(i.as_ref());
            if rank == root {
                let out = bytes_mut(o.as_mut());
                out.copy_from_slice(src);
                return reduce_body(ctx, ch, out, T::DTYPE, op, root);
            }
            with_scratch(&scratch, src.len(), |buf| {
                buf.copy_from_slice(src);
                reduce_body(ctx, ch, buf, T::DTYPE, op, root)
            })
        })
    }

    /// Asynchronous [`reduce_in_place`](Self::reduce_in_place): `wait()` gives `buf` back, the
    /// root's holding the reduction and every other rank's unchanged.
    pub fn reduce_in_place_async<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
        op: ReduceOp,
        root: usize,
    ) -> Work<B> {
        if let Err(e) = self.check_root("reduce", root) {
            return self.failed_work(e, "reduce");
        }
        let desc = self.desc::<T>(Collective::Reduce, buf.as_mut().len(), op, root);
        let (rank, scratch) = (self.rank, Arc::clone(&self.scratch));
        self.run_async(desc, buf, move |ctx, ch, b| {
            let b = bytes_mut(b.as_mut());
            if rank == root {
                return reduce_body(ctx, ch, b, T::DTYPE, op, root);
            }
            with_scratch(&scratch, b.len(), |buf| {
                buf.copy_from_slice(b);
                reduce_body(ctx, ch, buf, T::DTYPE, op, root)
            })
        })
    }

    /// Gather: the root's `output` = every rank's `input` in rank order (`size() * input.len()`
    /// elements); `output` is not touched on other ranks (it may be empty there).
    ///
    /// # Errors
    /// `InvalidArgument` for a bad root or, on the root, a wrong output length.
    pub fn gather<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<()> {
        let desc = self.rooted_desc::<T>(Collective::Gather, input.len(), output.len(), root)?;
        if self.rank == root {
            let n = input.len();
            output[root * n..(root + 1) * n].copy_from_slice(input);
        }
        self.run(desc, |ctx, _| {
            linear::gather(ctx, bytes(input), bytes_mut(output), root)
        })
    }

    /// Checks a gather (`block` = input length, `full` = output length) or a scatter (`block` =
    /// output length, `full` = input length) and its root; returns the descriptor.
    fn rooted_desc<T: Element>(
        &self,
        coll: Collective,
        block: usize,
        full: usize,
        root: usize,
    ) -> Result<OpDesc> {
        let (name, block_side, full_side) = match coll {
            Collective::Gather => ("gather", "input", "output"),
            _ => ("scatter", "output", "input"),
        };
        self.check_root(name, root)?;
        if self.rank == root && Some(full) != block.checked_mul(self.size) {
            return Err(self.invalid(
                name,
                format!(
                    "{full_side} has {full} elements; it must be {block_side} length {block} x \
                     world size {}",
                    self.size
                ),
            ));
        }
        Ok(self.desc::<T>(coll, block, ReduceOp::Sum, root))
    }

    /// Asynchronous [`gather`](Self::gather): the job owns `input` and `output` until `wait()`
    /// gives both back (the root's `output` holding every rank's input).
    pub fn gather_async<T, I, O>(&self, input: I, mut output: O, root: usize) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        let (ni, no) = (input.as_ref().len(), output.as_mut().len());
        let desc = match self.rooted_desc::<T>(Collective::Gather, ni, no, root) {
            Ok(d) => d,
            Err(e) => return self.failed_work(e, "gather"),
        };
        let rank = self.rank;
        self.run_async(desc, (input, output), move |ctx, _, (i, o)| {
            let (input, output) = (bytes(i.as_ref()), bytes_mut(o.as_mut()));
            if rank == root {
                let n = input.len();
                output[root * n..(root + 1) * n].copy_from_slice(input);
            }
            linear::gather(ctx, input, output, root)
        })
    }

    /// Asynchronous [`scatter`](Self::scatter): the job owns `input` and `output` until `wait()`
    /// gives both back (`output` holding this rank's block of the root's input).
    pub fn scatter_async<T, I, O>(&self, input: I, mut output: O, root: usize) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        let (ni, no) = (input.as_ref().len(), output.as_mut().len());
        let desc = match self.rooted_desc::<T>(Collective::Scatter, no, ni, root) {
            Ok(d) => d,
            Err(e) => return self.failed_work(e, "scatter"),
        };
        let rank = self.rank;
        self.run_async(desc, (input, output), move |ctx, _, (i, o)| {
            let (input, output) = (bytes(i.as_ref()), bytes_mut(o.as_mut()));
            if rank == root {
                let n = output.len();
                output.copy_from_slice(&input[root * n..(root + 1) * n]);
            }
            linear::scatter(ctx, input, output, root)
        })
    }

    /// Scatter: rank r's `output` = block r of the root's `input` (`size() * output.len()`
    /// elements, read only on the root).
    ///
    /// # Errors
    /// `InvalidArgument` for a bad root or, on the root, a wrong input length.
    pub fn scatter<T: Element>(&self, input: &[T], output: &mut [T], root: usize) -> Result<()> {
        let desc = self.rooted_desc::<T>(Collective::Scatter, output.len(), input.len(), root)?;
        if self.rank == root {
            let n = output.len();
            output.copy_from_slice(&input[root * n..(root + 1) * n]);
        }
        self.run(desc, |ctx, _| {
            linear::scatter(ctx, bytes(input), bytes_mut(output), root)
        })
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
        self.run(desc, |ctx, _| {
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
        self.run(desc, |ctx, _| {
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
        self.run_async(desc, (input, output), move |ctx, _, (i, o)| {
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
        self.run_async(desc, (input, output), move |ctx, _, (i, o)| {
            let (input, output) = (bytes(i.as_ref()), bytes_mut(o.as_mut()));
            if rank == root {
                output.copy_from_slice(&input[blocks[root].clone()]);
            }
            linear::scatter_v(ctx, input, &blocks, output, root, elem)
        })
    }

    /// Checks the lengths of an all-to-all: equal, and divisible by the world size.
    fn check_all_to_all(&self, ni: usize, no: usize) -> Result<()> {
        if ni != no || !ni.is_multiple_of(self.size) {
            return Err(self.invalid(
                "all_to_all",
                format!(
                    "input ({ni}) and output ({no}) must have the same length, divisible by the \
                     world size {}",
                    self.size
                ),
            ));
        }
        Ok(())
    }

    /// All-to-all: block j of rank r's `input` becomes block r of rank j's `output` (both
    /// `size()` blocks of equal length).
    ///
    /// # Errors
    /// `InvalidArgument` unless both lengths are equal and divisible by `size()`.
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.check_all_to_all(input.len(), output.len())?;
        let desc = self.desc::<T>(
            Collective::AllToAll,
            input.len() / self.size,
            ReduceOp::Sum,
            0,
        );
        self.run(desc, |ctx, _| {
            pairwise::all_to_all(ctx, bytes(input), bytes_mut(output))
        })
    }

    /// Asynchronous [`all_to_all`](Self::all_to_all): the job owns `input` and `output` until
    /// `wait()`, which gives both back.
    pub fn all_to_all_async<T, I, O>(&self, input: I, mut output: O) -> Work<(I, O)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        let (ni, no) = (input.as_ref().len(), output.as_mut().len());
        if let Err(e) = self.check_all_to_all(ni, no) {
            return self.failed_work(e, "all-to-all");
        }
        let desc = self.desc::<T>(Collective::AllToAll, ni / self.size, ReduceOp::Sum, 0);
        self.run_async(desc, (input, output), |ctx, _, (i, o)| {
            pairwise::all_to_all(ctx, bytes(i.as_ref()), bytes_mut(o.as_mut()))
        })
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
        self.run(desc, |ctx, _| {
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
        self.run_async(desc, (input, output), move |ctx, _, (i, o)| {
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
        self.run(desc, |ctx, ch| {
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
        self.run_async(desc, (input, output), move |ctx, ch, (i, o)| {
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
            self.run(desc, |ctx, ch| {
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
        self.run_async(desc, (input, output), move |ctx, ch, (i, o)| {
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
        self.run(Self::barrier_desc(), |ctx, _| dissemination::barrier(ctx))
    }

    /// Asynchronous [`barrier`](Self::barrier): `wait()` returns once every rank has entered
    /// it (torch's `barrier(async_op=True)`, or `MPI_Ibarrier`).
    pub fn barrier_async(&self) -> Work<()> {
        self.run_async(Self::barrier_desc(), (), |ctx, _, ()| {
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

/// Runs one part of a staged device operation (`crate::cuda`) on the execution state, whose turn
/// has come: the host collective over the part's staging bytes, laid out as `cuda::plan` says.
#[cfg(feature = "cuda")]
pub(crate) fn exec_staged(
    shared: &Shared,
    st: &mut ExecState,
    kind: crate::cuda::Kind,
    dt: DType,
    count: usize,
    stage: &mut [u8],
) -> Result<()> {
    use crate::cuda::Kind;
    let es = dt.size();
    let (rank, shard) = (shared.rank, count * es);
    let coll = match (kind, kind.collective()) {
        (Kind::Send { peer }, _) => {
            return crate::p2p::exec_p2p(shared, st, Some((peer, stage)), None, dt, es)
        }
        (Kind::Recv { peer }, _) => {
            return crate::p2p::exec_p2p(shared, st, None, Some((peer, stage)), dt, es)
        }
        (_, Some(coll)) => coll,
        (_, None) => unreachable!("every kind but send and recv is a collective"),
    };
    let (op, root) = (kind.op(), kind.root());
    let desc = OpDesc {
        coll,
        dtype: dt,
        op,
        root,
        count,
    };
    exec(shared, st, desc, |ctx, ch| match kind {
        Kind::AllReduce(_) => all_reduce_body(ctx, ch, None, stage, dt, op),
        Kind::ReduceScatter(_) => {
            reduce_scatter_body(ctx, ch, None, stage, dt, op)?;
            finish(ctx, &mut stage[rank * shard..(rank + 1) * shard], dt, op)
        }
        Kind::AllGather => all_gather_body(ctx, ch, stage, es, None),
        Kind::Broadcast { .. } => broadcast_body(ctx, ch, None, stage, dt, root),
        Kind::Reduce { .. } => reduce_body(ctx, ch, stage, dt, op, root),
        Kind::Gather { .. } => {
            // Staging: [input | output (root only)].
            let (input, output) = stage.split_at_mut(shard);
            if rank == root {
                output[root * shard..(root + 1) * shard].copy_from_slice(input);
            }
            linear::gather(ctx, input, output, root)
        }
        Kind::Scatter { .. } => {
            // Staging: [input (root only) | output].
            let (input, output) = stage.split_at_mut(stage.len() - shard);
            if rank == root {
                output.copy_from_slice(&input[root * shard..(root + 1) * shard]);
            }
            linear::scatter(ctx, input, output, root)
        }
        Kind::AllToAll => {
            // Staging: [input | output].
            let half = stage.len() / 2;
            let (input, output) = stage.split_at_mut(half);
            pairwise::all_to_all(ctx, input, output)
        }
        Kind::Send { .. } | Kind::Recv { .. } => unreachable!("returned above"),
    })
}
