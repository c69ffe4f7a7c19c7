//! Hierarchical all-reduce, reduce-scatter and all-gather for communicators spanning nodes.
//!
//! The communicator's ranks sit on `N` nodes of `L` ranks each (`NodeLayout`; the tuner only
//! offers these algorithms when every node has the same number of ranks, `N >= 2`, `L >= 2`).
//! Ranks talk through two kinds of sub-rings: the **local ring** of the `L` ranks of a node
//! (shared memory) and the **cross ring** of the `N` ranks with the same local rank (TCP between
//! nodes). Every local rank runs its own cross ring, so the `L` shards cross the network in
//! parallel, on `L` connections.
//!
//! - **All-reduce**, per block of `L * chunk` elements: local ring reduce-scatter (local rank `l`
//!   ends with the node's sum of piece `l`), cross ring all-reduce of piece `l`, local ring
//!   all-gather. Bytes leaving a node: `2 (N-1)/N * B` over `L` connections together, against the
//!   flat ring's `2 (N*L-1)/(N*L) * B` through the one connection each ring direction has
//!   between two nodes.
//! - **Reduce-scatter** (`n = N*L` shards, shard `r` for rank `r`): for each node `k` a local ring
//!   reduce-scatter over the shards of node `k`'s ranks (local rank `l` ends with the node's sum of
//!   the shards of local rank `l` on every node), then a cross ring reduce-scatter of those `N`
//!   shards: `(N-1)/N` of a rank's `N` shards leave the node, against `(n-1)/n * B` in the flat ring.
//! - **All-gather**: the reverse: a cross ring all-gather of the shards of local rank `l` on every
//!   node, then for each node a local ring all-gather of its ranks' shards.
//!
//! The tuner picks these from `tuning::HIERARCHICAL_MIN` bytes on, when the layout allows.

use std::ops::Range;

use oxccl_kernels::{DType, ReduceOp};

use super::{partition, ring};
use crate::error::{Error, Result};
use crate::prims::{Ctx, NodeLayout};

fn layout<'c>(ctx: &Ctx<'c>) -> Result<&'c NodeLayout> {
    ctx.layout.ok_or_else(|| Error::InvalidArgument {
        rank: ctx.rank,
        op: ctx.op.into(),
        msg: "hierarchical algorithms need at least two nodes with the same number (at least two) \
              of ranks each"
            .into(),
    })
}

/// Hierarchical all-reduce of `buf`: in place, or `buf = reduce(src)` reading `src` where it is.
pub(crate) fn all_reduce(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    chunk_bytes: usize,
) -> Result<()> {
    let lay = layout(ctx)?;
    let es = dt.size();
    let count = buf.len() / es;
    let l = lay.local_group.len();
    let block = (chunk_bytes / es).max(1) * l;
    if count < l {
        // Too few elements to give every local rank a piece: flat ring.
        return ring::all_reduce(ctx, src, buf, dt, op, chunk_bytes);
    }
    let mut start = 0;
    while start < count {
        let len = block.min(count - start);
        let chunk = |i: usize| {
            let p = partition(len, l, i);
            (start + p.start) * es..(start + p.end) * es
        };
        let mine = chunk(lay.local);
        ring::rs_steps(&mut ctx.sub(&lay.local_group), buf, src, &chunk, dt, op)?;
        if !mine.is_empty() {
            ring::all_reduce(
                &mut ctx.sub(&lay.cross_group),
                None,
                &mut buf[mine],
                dt,
                op,
                chunk_bytes,
            )?;
        }
        ring::ag_steps(&mut ctx.sub(&lay.local_group), buf, &chunk, None)?;
        start += len;
    }
    Ok(())
}

/// The byte range of rank `r`'s shard (`shard` bytes each) within `[lo, lo + len)` of it.
fn shard_part(r: usize, shard: usize, lo: usize, len: usize) -> Range<usize> {
    r * shard + lo..r * shard + lo + len
}

/// Calls `f(lo, len)` for the blocks of `chunk_bytes` (whole elements) a shard is cut into.
fn for_blocks(
    shard: usize,
    es: usize,
    chunk_bytes: usize,
    mut f: impl FnMut(usize, usize) -> Result<()>,
) -> Result<()> {
    let block = (chunk_bytes / es).max(1) * es;
    let mut lo = 0;
    while lo < shard {
        let len = block.min(shard - lo);
        f(lo, len)?;
        lo += len;
    }
    Ok(())
}

/// Hierarchical reduce-scatter: `buf` holds `n` shards; afterwards this rank's shard is reduced.
/// Out of place `src` is the input and `buf` is only written.
pub(crate) fn reduce_scatter(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    chunk_bytes: usize,
) -> Result<()> {
    let lay = layout(ctx)?;
    let es = dt.size();
    let shard = buf.len() / ctx.size;
    if shard == 0 {
        return Ok(());
    }
    for_blocks(shard, es, chunk_bytes, |lo, len| {
        for node in &lay.ranks {
            let chunk = |i: usize| shard_part(node[i], shard, lo, len);
            ring::rs_steps(&mut ctx.sub(&lay.local_group), buf, src, &chunk, dt, op)?;
        }
        let chunk = |k: usize| shard_part(lay.ranks[k][lay.local], shard, lo, len);
        ring::rs_steps(&mut ctx.sub(&lay.cross_group), buf, None, &chunk, dt, op)
    })
}

/// Hierarchical all-gather: `buf` holds `n` shards. In place this rank's shard is already
/// valid; out of place `own` is this rank's shard.
pub(crate) fn all_gather(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    es: usize,
    chunk_bytes: usize,
    own: Option<&[u8]>,
) -> Result<()> {
    let lay = layout(ctx)?;
    let shard = buf.len() / ctx.size;
    if shard == 0 {
        return Ok(());
    }
    for_blocks(shard, es, chunk_bytes, |lo, len| {
        let chunk = |k: usize| shard_part(lay.ranks[k][lay.local], shard, lo, len);
        let own = own.map(|o| &o[lo..lo + len]);
        ring::ag_steps(&mut ctx.sub(&lay.cross_group), buf, &chunk, own)?;
        for node in &lay.ranks {
            let chunk = |i: usize| shard_part(node[i], shard, lo, len);
            ring::ag_steps(&mut ctx.sub(&lay.local_group), buf, &chunk, None)?;
        }
        Ok(())
    })
}
