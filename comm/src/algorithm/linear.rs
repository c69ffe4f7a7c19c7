//! Gather and scatter: the root exchanges one block with every other rank directly.
//!
//! Gather: every non-root rank sends its block to the root, which receives them in rank order
//! straight into their places in its output. Scatter: the root sends block `p` to rank `p`.
//! The root moves `(n-1)/n * B` bytes, every other rank `B/n`: the root's link is the bottleneck
//! by nature of the operation, so no tree would move fewer bytes through it.
//!
//! Gather-v and scatter-v: the same with a block length per rank; every block travels as one
//! message (empty or not) whose tag carries its element count, so a rank and the root that
//! disagree on it get `Mismatch` naming both counts.

use std::ops::Range;

use crate::algorithm::prims::{Ctx, RecvMode};
use crate::base::error::Result;
use crate::transport::Tag;

/// Gather to `root`: `block` is this rank's data; at the root `out` has `n` blocks and block
/// `root` is already in place.
pub(crate) fn gather(ctx: &mut Ctx<'_>, block: &[u8], out: &mut [u8], root: usize) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    if r != root {
        return ctx.send(root, block);
    }
    let bs = block.len();
    for p in (0..n).filter(|&p| p != root) {
        ctx.recv(p, &mut out[p * bs..(p + 1) * bs], RecvMode::Copy)?;
    }
    Ok(())
}

/// Scatter from `root`: at the root `input` has `n` blocks of `out.len()` bytes; every rank
/// receives its block into `out` (the root copies its own before this is called).
pub(crate) fn scatter(ctx: &mut Ctx<'_>, input: &[u8], out: &mut [u8], root: usize) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    if r != root {
        return ctx.recv(root, out, RecvMode::Copy);
    }
    let bs = out.len();
    for p in (0..n).filter(|&p| p != root) {
        ctx.send(p, &input[p * bs..(p + 1) * bs])?;
    }
    Ok(())
}

/// The tag of a gather-v or scatter-v message of `bytes` bytes of `elem`-byte elements: the
/// operation's, with the block's element count.
fn v_tag(ctx: &Ctx<'_>, bytes: usize, elem: usize) -> Tag {
    Tag {
        count: (bytes / elem) as u64,
        ..ctx.tag
    }
}

/// Gather-v to `root`: `block` is this rank's data; at the root `blocks[p]` is rank p's byte
/// range in `out`, and block `root` is already in place.
pub(crate) fn gather_v(
    ctx: &mut Ctx<'_>,
    block: &[u8],
    out: &mut [u8],
    blocks: &[Range<usize>],
    root: usize,
    elem: usize,
) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    if r != root {
        let tag = v_tag(ctx, block.len(), elem);
        return ctx.exchange_tagged(Some((root, block, tag)), None);
    }
    for p in (0..n).filter(|&p| p != root) {
        let tag = v_tag(ctx, blocks[p].len(), elem);
        let dst = &mut out[blocks[p].clone()];
        ctx.exchange_tagged(None, Some((p, dst, RecvMode::Copy, tag)))?;
    }
    Ok(())
}

/// Scatter-v from `root`: at the root `blocks[p]` is rank p's byte range in `input`; every rank
/// receives its block into `out` (the root copies its own before this is called).
pub(crate) fn scatter_v(
    ctx: &mut Ctx<'_>,
    input: &[u8],
    blocks: &[Range<usize>],
    out: &mut [u8],
    root: usize,
    elem: usize,
) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    if r != root {
        let tag = v_tag(ctx, out.len(), elem);
        return ctx.exchange_tagged(None, Some((root, out, RecvMode::Copy, tag)));
    }
    for p in (0..n).filter(|&p| p != root) {
        let tag = v_tag(ctx, blocks[p].len(), elem);
        ctx.exchange_tagged(Some((p, &input[blocks[p].clone()], tag)), None)?;
    }
    Ok(())
}
