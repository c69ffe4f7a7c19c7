//! Ring algorithms: all-reduce, reduce-scatter, all-gather.
//!
//! Ranks form a ring `r -> r+1`. The buffer is cut into blocks of `n * chunk` elements (`chunk`
//! from the tuner) so the data a step forwards is still in cache; each block is cut into `n`
//! chunks (`partition`, sizes differing by at most one element).
//!
//! - **Reduce-scatter**, `n-1` steps: at step `s` rank `r` sends chunk `r-s-1` to `r+1` and
//!   receives chunk `r-s-2` from `r-1`, reducing it straight from the slot into its buffer; the
//!   chunk it receives is the one it sends next. After the last step chunk `r` is fully reduced.
//! - **All-gather**, `n-1` steps: at step `s` rank `r` sends chunk `r-s` and receives chunk
//!   `r-s-1`, copied from the slot into place.
//! - **All-reduce** = reduce-scatter then all-gather on each block.
//! - **All-gather-v / reduce-scatter-v**: the same steps on shards of different lengths; block
//!   `k` takes elements `[k*b, (k+1)*b)` of every shard, clipped to its length (empty once a
//!   shard is used up), so every rank computes the same chunks from the same counts. Every step
//!   lasts as long as the longest chunk in flight, so a call takes about `n-1` times as long as
//!   moving the longest shard once (even shards: `n-1` times one shard).
//!
//! Every step streams its chunk slot by slot while receiving the other chunk (both directions
//! interleaved), so a step is pipelined at slot granularity. Bytes sent per rank: all-reduce
//! `2 (n-1)/n * B`, reduce-scatter and all-gather `(n-1)/n * B` (B = full buffer): bandwidth
//! optimal, with `2(n-1)` (resp. `n-1`) latency terms: the tuner picks ring for large buffers.

use std::ops::Range;

use oxccl_kernels::{finish_avg_bytes, DType, ReduceOp};

use super::{blocks, partition, ring_sub, split_pair, split_pair_mut};
use crate::algorithm::prims::{Ctx, RecvMode};
use crate::base::error::{Error, Result};

/// Reduce-scatter steps of one block. With `src` (the out-of-place input, indexed like `buf`),
/// the first send reads `src` and every received chunk is combined with `src` into `buf`, so the
/// input is never copied into `buf` first.
///
/// A pre-multiplied sum ([`ReduceOp::PreMulSum`]) scales this rank's input on the way: every
/// chunk of the block is this rank's own input exactly once (the first one sent, then each one
/// received into), so the chunk sent first is scaled into the slots as it goes out
/// ([`Ctx::exchange_scaled`]; in place, `buf` keeps it unscaled: the all-gather or the caller
/// overwrites it), and each received chunk is scaled as its slots arrive
/// ([`RecvMode::ScaleReduce`]). No pass over the input of its own.
pub(crate) fn rs_steps(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    src: Option<&[u8]>,
    chunk: &dyn Fn(usize) -> Range<usize>,
    dt: DType,
    op: ReduceOp,
) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    let (next, prev) = ((r + 1) % n, ring_sub(r, 1, n));
    let factor = op.factor();
    for s in 0..n - 1 {
        let (out, inc) = (chunk(ring_sub(r, s + 1, n)), chunk(ring_sub(r, s + 2, n)));
        let mode = match (factor, src) {
            (Some(f), x) => RecvMode::ScaleReduce(dt, f, x.map(|x| &x[inc.clone()])),
            (None, Some(x)) => RecvMode::ReduceFrom(dt, op, &x[inc.clone()]),
            (None, None) => RecvMode::Reduce(dt, op),
        };
        let (from_buf, dst) = split_pair(buf, out.clone(), inc);
        let data = match src {
            Some(x) if s == 0 => &x[out],
            _ => from_buf,
        };
        match factor {
            Some(f) if s == 0 => {
                ctx.exchange_scaled((next, data), (dt, f), Some((prev, dst, mode)))?
            }
            _ => ctx.exchange(Some((next, data)), Some((prev, dst, mode)))?,
        }
    }
    Ok(())
}

/// All-gather steps of one block. With `own` (this rank's input for the block, out of place), the
/// first step sends from `own` and mirrors it into the buffer piece by piece as it goes out.
pub(crate) fn ag_steps(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    chunk: &dyn Fn(usize) -> Range<usize>,
    own: Option<&[u8]>,
) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    let (next, prev) = ((r + 1) % n, ring_sub(r, 1, n));
    for s in 0..n - 1 {
        let (src, dst) =
            split_pair_mut(buf, chunk(ring_sub(r, s, n)), chunk(ring_sub(r, s + 1, n)));
        let tag = ctx.tag;
        match own {
            Some(own) if s == 0 => ctx.exchange_mirrored(
                Some((next, own, tag)),
                Some(src),
                Some((prev, dst, RecvMode::Copy, tag)),
            )?,
            _ => ctx.exchange(Some((next, src)), Some((prev, dst, RecvMode::Copy)))?,
        }
    }
    Ok(())
}

/// Ring all-reduce of `buf` (elements of `dt`): in place, or `buf = reduce(src)` reading `src`
/// where it is. `Avg` is finished here: each rank divides its own reduced chunk of a block
/// before the all-gather sends it on (a `size`-th of the buffer, still in cache), so the caller
/// must not divide again.
pub(crate) fn all_reduce(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    chunk_bytes: usize,
) -> Result<()> {
    let n = ctx.size;
    let es = dt.size();
    let count = buf.len() / es;
    if n == 1 || count == 0 {
        if let Some(s) = src {
            buf.copy_from_slice(s);
        }
        return Ok(());
    }
    let block = (chunk_bytes / es).max(1) * n;
    let mut start = 0;
    while start < count {
        let len = block.min(count - start);
        let chunk = |i: usize| {
            let p = partition(len, n, i);
            (start + p.start) * es..(start + p.end) * es
        };
        rs_steps(ctx, buf, src, &chunk, dt, op)?;
        if op == ReduceOp::Avg {
            finish_avg_bytes(dt, &mut buf[chunk(ctx.rank)], n).map_err(|e| {
                Error::InvalidArgument {
                    rank: ctx.rank,
                    op: ctx.op.into(),
                    msg: e.to_string(),
                }
            })?;
        }
        ag_steps(ctx, buf, &chunk, None)?;
        start += len;
    }
    Ok(())
}

/// Calls `f` with the chunk function of each block of a sharded buffer (`n` shards of `shard`
/// elements; a block takes the same sub-range of every shard).
fn for_shard_blocks(
    shard: usize,
    es: usize,
    chunk_bytes: usize,
    mut f: impl FnMut(&dyn Fn(usize) -> Range<usize>) -> Result<()>,
) -> Result<()> {
    for (start, len) in blocks(shard, chunk_bytes / es) {
        let chunk = |i: usize| (i * shard + start) * es..(i * shard + start + len) * es;
        f(&chunk)?;
    }
    Ok(())
}

/// Ring reduce-scatter: `buf` holds `n` shards; afterwards shard `rank` is reduced. In place
/// `buf` starts as the input; out of place `src` is the input and `buf` is only written (chunks
/// other than shard `rank` end holding partial results).
pub(crate) fn reduce_scatter(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    chunk_bytes: usize,
) -> Result<()> {
    let n = ctx.size;
    let shard = buf.len() / dt.size() / n;
    if n == 1 || shard == 0 {
        if let Some(s) = src {
            buf.copy_from_slice(s);
        }
        return Ok(());
    }
    for_shard_blocks(shard, dt.size(), chunk_bytes, |chunk| {
        rs_steps(ctx, buf, src, chunk, dt, op)
    })
}

/// Ring all-gather: `buf` holds `n` shards of `es`-byte elements. In place (`own` = None) shard
/// `rank` is already valid; out of place `own` is this rank's shard, put in place block by block
/// as it is sent (one pass over it instead of a copy before the first send).
pub(crate) fn all_gather(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    es: usize,
    chunk_bytes: usize,
    own: Option<&[u8]>,
) -> Result<()> {
    let n = ctx.size;
    let shard = buf.len() / es / n;
    if n == 1 || shard == 0 {
        if let Some(own) = own {
            let at = ctx.rank * own.len();
            buf[at..at + own.len()].copy_from_slice(own);
        }
        return Ok(());
    }
    let base = ctx.rank * shard * es;
    for_shard_blocks(shard, es, chunk_bytes, |chunk| {
        let mine = chunk(ctx.rank);
        let own = own.map(|o| &o[mine.start - base..mine.end - base]);
        ag_steps(ctx, buf, chunk, own)
    })
}

/// Byte ranges of the chunks of block `k` of a sharded buffer whose shards have `counts`
/// elements of `es` bytes, starting at element `disp[i]`: `[k*block, (k+1)*block)` of each
/// shard, clipped to its length.
fn v_chunk<'a>(
    counts: &'a [usize],
    disp: &'a [usize],
    es: usize,
    block: usize,
    k: usize,
) -> impl Fn(usize) -> Range<usize> + 'a {
    move |i| {
        let (a, b) = ((k * block).min(counts[i]), ((k + 1) * block).min(counts[i]));
        (disp[i] + a) * es..(disp[i] + b) * es
    }
}

/// Blocks of an all-gather-v or reduce-scatter-v: enough for the longest shard, and at least
/// one, so that even a call whose shards are all empty sends its tag (a rank that passed other
/// counts then gets `Mismatch` at once, not a time-out or a mismatch at its next call).
fn v_blocks(counts: &[usize], block: usize) -> usize {
    counts
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .div_ceil(block)
        .max(1)
}

/// Element offsets of shards of `counts` elements laid one after another.
fn displacements(counts: &[usize]) -> Vec<usize> {
    counts
        .iter()
        .scan(0, |at, &c| {
            let d = *at;
            *at += c;
            Some(d)
        })
        .collect()
}

/// Ring all-gather-v: `buf` receives every rank's shard (`counts[i]` elements of `es` bytes for
/// rank i, in rank order); `own` is this rank's shard, put in place as it is sent.
pub(crate) fn all_gather_v(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    es: usize,
    chunk_bytes: usize,
    own: &[u8],
    counts: &[usize],
) -> Result<()> {
    let disp = displacements(counts);
    let r = ctx.rank;
    let at = disp[r] * es;
    if ctx.size == 1 {
        buf[at..at + own.len()].copy_from_slice(own);
        return Ok(());
    }
    let block = (chunk_bytes / es).max(1);
    for k in 0..v_blocks(counts, block) {
        let chunk = v_chunk(counts, &disp, es, block, k);
        let mine = chunk(r);
        let own = &own[mine.start - at..mine.end - at];
        ag_steps(ctx, buf, &chunk, Some(own))?;
    }
    Ok(())
}

/// Ring reduce-scatter-v: `src` holds every rank's shard (`counts[i]` elements for rank i, in
/// rank order) and `buf` (as long as `src`) receives partial results, or `buf` is the input
/// itself without `src`; afterwards this rank's shard of `buf` holds the reduction.
pub(crate) fn reduce_scatter_v(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    chunk_bytes: usize,
    counts: &[usize],
) -> Result<()> {
    let es = dt.size();
    let disp = displacements(counts);
    if ctx.size == 1 {
        if let Some(s) = src {
            buf.copy_from_slice(s);
        }
        return Ok(());
    }
    let block = (chunk_bytes / es).max(1);
    for k in 0..v_blocks(counts, block) {
        let chunk = v_chunk(counts, &disp, es, block, k);
        rs_steps(ctx, buf, src, &chunk, dt, op)?;
    }
    Ok(())
}
