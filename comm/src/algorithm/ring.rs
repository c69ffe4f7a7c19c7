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
//!
//! Every step streams its chunk slot by slot while receiving the other chunk (both directions
//! interleaved), so a step is pipelined at slot granularity. Bytes sent per rank: all-reduce
//! `2 (n-1)/n * B`, reduce-scatter and all-gather `(n-1)/n * B` (B = full buffer): bandwidth
//! optimal, with `2(n-1)` (resp. `n-1`) latency terms: the tuner picks ring for large buffers.

use std::ops::Range;

use oxccl_kernels::{DType, ReduceOp};

use super::{partition, ring_sub, split_pair};
use crate::error::Result;
use crate::prims::{Ctx, RecvMode};

fn rs_steps(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    chunk: &dyn Fn(usize) -> Range<usize>,
    dt: DType,
    op: ReduceOp,
) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    let (next, prev) = ((r + 1) % n, ring_sub(r, 1, n));
    for s in 0..n - 1 {
        let (src, dst) = split_pair(
            buf,
            chunk(ring_sub(r, s + 1, n)),
            chunk(ring_sub(r, s + 2, n)),
        );
        ctx.exchange(
            Some((next, src)),
            Some((prev, dst, RecvMode::Reduce(dt, op))),
        )?;
    }
    Ok(())
}

fn ag_steps(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    chunk: &dyn Fn(usize) -> Range<usize>,
) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    let (next, prev) = ((r + 1) % n, ring_sub(r, 1, n));
    for s in 0..n - 1 {
        let (src, dst) = split_pair(buf, chunk(ring_sub(r, s, n)), chunk(ring_sub(r, s + 1, n)));
        ctx.exchange(Some((next, src)), Some((prev, dst, RecvMode::Copy)))?;
    }
    Ok(())
}

/// In-place ring all-reduce of `buf` (elements of `dt`).
pub(crate) fn all_reduce(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    chunk_bytes: usize,
) -> Result<()> {
    let n = ctx.size;
    let es = dt.size();
    let count = buf.len() / es;
    if n == 1 || count == 0 {
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
        rs_steps(ctx, buf, &chunk, dt, op)?;
        ag_steps(ctx, buf, &chunk)?;
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
    let block = (chunk_bytes / es).max(1);
    let mut start = 0;
    while start < shard {
        let len = block.min(shard - start);
        let chunk = |i: usize| (i * shard + start) * es..(i * shard + start + len) * es;
        f(&chunk)?;
        start += len;
    }
    Ok(())
}

/// In-place ring reduce-scatter: `buf` holds `n` shards; afterwards shard `rank` is reduced.
pub(crate) fn reduce_scatter(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    chunk_bytes: usize,
) -> Result<()> {
    let n = ctx.size;
    let shard = buf.len() / dt.size() / n;
    if n == 1 || shard == 0 {
        return Ok(());
    }
    for_shard_blocks(shard, dt.size(), chunk_bytes, |chunk| {
        rs_steps(ctx, buf, chunk, dt, op)
    })
}

/// In-place ring all-gather: `buf` holds `n` shards of `es`-byte elements, shard `rank` valid.
pub(crate) fn all_gather(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    es: usize,
    chunk_bytes: usize,
) -> Result<()> {
    let n = ctx.size;
    let shard = buf.len() / es / n;
    if n == 1 || shard == 0 {
        return Ok(());
    }
    for_shard_blocks(shard, es, chunk_bytes, |chunk| ag_steps(ctx, buf, chunk))
}
