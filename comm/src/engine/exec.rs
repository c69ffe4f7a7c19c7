//! Running one collective on the execution state: its sequence number, the tuner's choice, the
//! algorithm over this rank's connections (or cut across the channels), and the flush. Every
//! collective arrives here as bytes and a data type, whatever its caller: the typed calls, the
//! untyped buffer views, and the parts of staged device operations.

use oxccl_kernels::{finish_avg_bytes, scale_bytes, scale_into_bytes, DType, ReduceOp};

use std::sync::Arc;

use oxccl_kernels::check_factor;

use super::{ExecState, Scratch, Shared, Work};
use crate::algorithm::prims::{copy, Ctx, NodeLayout, Whole};
use crate::algorithm::{
    chain, direct, halving_doubling, hierarchical, mapped, ring, single_copy, tree,
};
use crate::base::error::{Error, Result};
use crate::base::op::{Collective, OpDesc};
use crate::base::trace::What;
use crate::base::tuning::{self, Algorithm, Choice};

fn no_algo(ctx: &Ctx<'_>, algo: Algorithm) -> Error {
    Error::InvalidArgument {
        rank: ctx.rank,
        op: ctx.op.into(),
        msg: format!("algorithm {algo} does not implement {}", ctx.op),
    }
}

impl Shared {
    /// The `InvalidArgument` this rank reports for `op` (with its world ranks noted, for a
    /// communicator made from another).
    pub(crate) fn invalid(&self, op: &str, msg: String) -> Error {
        self.named(Error::InvalidArgument {
            rank: self.rank,
            op: op.into(),
            msg,
        })
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
    pub(crate) fn run<R>(
        &self,
        desc: OpDesc,
        body: impl FnOnce(&mut Ctx<'_>, Choice) -> Result<R>,
    ) -> Result<R> {
        self.check_op(&desc)?;
        let (ticket, ahead) = self.take_ticket();
        self.queue.before_call(ticket, ahead);
        self.run_turn(ticket, ahead, |st| exec(self, st, desc, body))
    }

    /// Queues a collective on the progress thread; the job owns `buf` until `wait()`. The body
    /// gets the communicator's scratch ([`Shared::scratch`]) beside its buffers.
    pub(crate) fn run_async<B: Send + 'static>(
        self: &Arc<Self>,
        desc: OpDesc,
        buf: B,
        body: impl Fn(&mut Ctx<'_>, Choice, &mut B, &Scratch) -> Result<()> + Send + Sync + 'static,
    ) -> Work<B> {
        if let Err(e) = self.check_op(&desc) {
            return self.failed_work(e, desc.coll.name());
        }
        self.submit_work(
            desc.coll.name(),
            buf,
            move |shared, st, buf| {
                exec(shared, st, desc, |ctx, ch| {
                    body(ctx, ch, buf, &shared.scratch)
                })
            },
            |buf| buf,
        )
    }

    /// Fails an async call before anything is queued (`e` noted with the world ranks, once).
    pub(crate) fn failed_work<B: Send + 'static>(&self, e: Error, op: &'static str) -> Work<B> {
        Work::failed(self.named(e), self.rank, op)
    }
}

/// Runs one collective on the execution state: sequence number, tuner, algorithm, flush.
pub(crate) fn exec<R>(
    shared: &Shared,
    st: &mut ExecState,
    desc: OpDesc,
    body: impl FnOnce(&mut Ctx<'_>, Choice) -> Result<R>,
) -> Result<R> {
    let seq = st.coll_seq;
    st.coll_seq += 1;
    st.current = Some(desc.tag(seq));
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
        mapped: window.is_some_and(|w| w.can_map()) && try_mapped(&mut st.mapped_skip, desc, full),
        nodes: shared.layout.as_ref().is_some_and(NodeLayout::balanced),
        even_nodes: shared.layout.as_ref().is_some_and(|l| l.even),
        sockets: shared.sockets,
        hierarchical_block: shared.hierarchical_block,
    };
    let choice = match st.last_choice {
        Some((coll, bytes, c, choice)) if coll == desc.coll && bytes == full && c == caps => choice,
        _ => {
            let choice = tuning::choose(desc.coll, full, n, &shared.algo, caps);
            st.last_choice = Some((desc.coll, full, caps, choice));
            choice
        }
    };
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
        ctx.split = Some(shared);
        ctx.stream = full >= tuning::STREAM_MIN;
        ctx.layout = shared.layout.as_ref();
        ctx.stalls = Some(&shared.stalls);
        ctx.trace = Some(&shared.trace);
        let r = body(&mut ctx, choice)?;
        ctx.flush()?;
        if let Some((i, _, sure)) = mapped_range(desc.coll) {
            if choice.algo == Algorithm::Mapped && full < sure {
                // Every rank saw the same records: all skip the same calls.
                st.mapped_skip[i] = if ctx.left_window() {
                    tuning::MAPPED_RETRY
                } else {
                    0
                };
            }
        }
        Ok(r)
    })
}

/// The mapped algorithm's skip counter of `coll` ([`ExecState::mapped_skip`]), the size it
/// starts at, and the size from which it tries every time; `None` for collectives without one.
fn mapped_range(coll: Collective) -> Option<(usize, usize, usize)> {
    match coll {
        Collective::AllGather => Some((0, tuning::MAPPED_MIN, tuning::MAPPED_SURE)),
        Collective::AllReduce => Some((1, tuning::MAPPED_AR_MIN, tuning::MAPPED_AR_SURE)),
        _ => None,
    }
}

/// Whether a collective of `full` bytes may try the mapped path: always from its sure size on
/// ([`mapped_range`]); below, not while skips remain after a try that fell back (each call the
/// tuner would have tried counts one down).
fn try_mapped(skip: &mut [u32; 2], desc: OpDesc, full: usize) -> bool {
    let Some((i, min, sure)) = mapped_range(desc.coll) else {
        return true;
    };
    if full >= sure || skip[i] == 0 {
        return true;
    }
    if full >= min {
        skip[i] -= 1;
    }
    false
}

/// The first step of a pre-multiplied sum ([`ReduceOp::PreMulSum`]): this rank's input (`src`,
/// or `buf` in place) times its factor, into `buf`; the algorithm then sums `buf` in place.
/// Other operations pass through untouched, and so does a pre-multiplied sum that the ring
/// runs on two ranks or more: it scales each chunk as it first uses it, while the chunk is in
/// cache (`ring::rs_steps`), instead of in a pass of its own here.
#[inline]
fn premultiply<'s>(
    ctx: &Ctx<'_>,
    ch: Choice,
    src: Option<&'s [u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
) -> Result<(Option<&'s [u8]>, ReduceOp)> {
    match op.factor() {
        Some(factor) if ch.algo != Algorithm::Ring || ctx.size == 1 => {
            scale_first(ctx, src, buf, dt, factor)
        }
        _ => Ok((src, op)),
    }
}

/// [`premultiply`]'s scaling: `buf = src * factor` (or `buf *= factor` in place).
fn scale_first<'s>(
    ctx: &Ctx<'_>,
    src: Option<&'s [u8]>,
    buf: &mut [u8],
    dt: DType,
    factor: f64,
) -> Result<(Option<&'s [u8]>, ReduceOp)> {
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

/// Runs `one` on `buf` (the element-wise collective `coll` of `dt`, with `op` and `root` where
/// they apply; `src` its out-of-place input indexed alike): cut across the communicator's
/// channels when it has them and `buf` is large enough (see [`channels`]: channel `i` runs
/// `one` on its part as an operation of its own, with the part's count), else on this context
/// alone.
fn cut_or_whole(
    ctx: &mut Ctx<'_>,
    ch: Choice,
    (coll, dtype, op, root): (Collective, DType, ReduceOp, usize),
    src: Option<&[u8]>,
    buf: &mut [u8],
    one: &Whole<'_>,
) -> Result<()> {
    let desc = OpDesc {
        coll,
        dtype,
        op,
        root,
        count: buf.len() / dtype.size(),
    };
    match ctx.split {
        Some(split) => match split.split(ctx, ch, desc, src, buf, one) {
            Some(r) => r,
            None => one(ctx, ch, src, buf),
        },
        None => one(ctx, ch, src, buf),
    }
}

/// All-reduce of `buf` (in place, or `buf = reduce(src)`), cut across the channels when it has
/// them ([`cut_or_whole`]).
pub(crate) fn all_reduce_body(
    ctx: &mut Ctx<'_>,
    ch: Choice,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
) -> Result<()> {
    // Far below what the channels cut (`channels::parts`: two parts of `CHANNEL_PART_MIN` at
    // least): straight to the algorithm.
    const _: () = assert!(crate::transport::INLINE_MAX < 2 * super::channels::CHANNEL_PART_MIN);
    if ch.algo == Algorithm::OneShot && direct::travels_inline(ctx, buf.len()) {
        return all_reduce_one(ctx, ch, src, buf, dt, op);
    }
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
            Algorithm::Mapped => {
                if !mapped::all_reduce(ctx, src, buf, dt, op)? {
                    // The tuner's other choice, whole: it finishes `Avg` itself.
                    let other = Choice {
                        algo: ch.fallback,
                        ..ch
                    };
                    return all_reduce_one(ctx, other, src, buf, dt, op);
                }
            }
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
pub(crate) fn reduce_scatter_body(
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
pub(crate) fn reduce_scatter_v_body<'o>(
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
    copy(ctx.stream, out, &buf[at..at + out.len()]);
    Ok(out)
}

/// All-gather into `buf` (`size` shards; this rank's shard in place, or `own`).
pub(crate) fn all_gather_body(
    ctx: &mut Ctx<'_>,
    ch: Choice,
    buf: &mut [u8],
    es: usize,
    own: Option<&[u8]>,
) -> Result<()> {
    match ch.algo {
        Algorithm::Ring => ring::all_gather(ctx, buf, es, ch.chunk_bytes, own),
        Algorithm::Hierarchical => hierarchical::all_gather(ctx, buf, es, ch.chunk_bytes, own),
        Algorithm::SingleCopy => single_copy::all_gather(ctx, buf, own),
        Algorithm::Mapped => {
            if mapped::all_gather(ctx, buf, own)? {
                return Ok(());
            }
            let other = Choice {
                algo: ch.fallback,
                ..ch
            };
            all_gather_body(ctx, other, buf, es, own)
        }
        a => Err(no_algo(ctx, a)),
    }
}

#[inline]
pub(crate) fn finish(ctx: &Ctx<'_>, buf: &mut [u8], dt: DType, op: ReduceOp) -> Result<()> {
    if op == ReduceOp::Avg {
        divide(ctx, buf, dt)?;
    }
    Ok(())
}

/// [`finish`]'s division of `buf` by the number of ranks.
fn divide(ctx: &Ctx<'_>, buf: &mut [u8], dt: DType) -> Result<()> {
    finish_avg_bytes(dt, buf, ctx.size).map_err(|e| Error::InvalidArgument {
        rank: ctx.rank,
        op: ctx.op.into(),
        msg: e.to_string(),
    })
}

/// Broadcast of `buf` from `root` (`src`: the root's input out of place), cut across the
/// channels when it has them ([`cut_or_whole`]).
pub(crate) fn broadcast_body(
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
        Algorithm::SingleCopy => single_copy::broadcast(ctx, src, buf, root),
        a => Err(no_algo(ctx, a)),
    }
}

/// Reduce into `buf` at the root; `buf` is a scratch copy on other ranks. Cut across the
/// channels when it has them ([`cut_or_whole`]).
pub(crate) fn reduce_body(
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

/// Runs one part of a staged device operation (`crate::api::device`) on the execution state, whose turn
/// has come: the host collective over the part's staging bytes, laid out as `cuda::plan` says.
#[cfg(feature = "cuda-core")]
pub(crate) fn exec_staged(
    shared: &Shared,
    st: &mut ExecState,
    kind: crate::base::call::Kind,
    dt: DType,
    count: usize,
    stage: &mut [u8],
) -> Result<()> {
    use crate::base::call::Kind;
    let es = dt.size();
    let (rank, shard) = (shared.rank, count * es);
    let coll = match (kind, kind.collective()) {
        (Kind::Send { peer }, _) => {
            return super::p2p::exec_p2p(shared, st, Some((peer, stage)), None, dt, es)
        }
        (Kind::Recv { peer }, _) => {
            return super::p2p::exec_p2p(shared, st, None, Some((peer, stage)), dt, es)
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
            crate::algorithm::linear::gather(ctx, input, output, root)
        }
        Kind::Scatter { .. } => {
            // Staging: [input (root only) | output].
            let (input, output) = stage.split_at_mut(stage.len() - shard);
            if rank == root {
                output.copy_from_slice(&input[root * shard..(root + 1) * shard]);
            }
            crate::algorithm::linear::scatter(ctx, input, output, root)
        }
        Kind::AllToAll => {
            // Staging: [input | output].
            let half = stage.len() / 2;
            let (input, output) = stage.split_at_mut(half);
            crate::algorithm::pairwise::all_to_all(ctx, input, output)
        }
        Kind::Send { .. } | Kind::Recv { .. } => unreachable!("returned above"),
    })
}
