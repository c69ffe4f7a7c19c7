//! Gather and scatter: the root exchanges one block with every other rank directly.
//!
//! Gather: every non-root rank sends its block to the root, which receives them in rank order
//! straight into their places in its output. Scatter: the root sends block `p` to rank `p`.
//! The root moves `(n-1)/n * B` bytes, every other rank `B/n`: the root's link is the bottleneck
//! by nature of the operation, so no tree would move fewer bytes through it.

use crate::error::Result;
use crate::prims::{Ctx, RecvMode};

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
