//! Binomial trees: reduce to a root, broadcast from a root, and tree all-reduce (reduce to rank 0
//! then broadcast from it).
//!
//! Ranks are renumbered relative to the root (`v = (r - root) mod n`). Rank `v`'s parent is `v`
//! with its lowest set bit cleared; its children are `v + 2^k` for every `2^k` below that bit.
//! Reduce: receive (and reduce straight from the slot) from each child, smallest subtree first,
//! then send to the parent. Broadcast: receive from the parent, send to the children, largest
//! subtree first. Large buffers are handled in pieces of `chunk` bytes, one piece at a time
//! through the whole tree, so subtrees overlap their work through the slots.
//!
//! Latency `ceil(log2 n)` steps each way; bytes through the root `ceil(log2 n) * B`. The tuner
//! picks tree broadcast and reduce for small messages, where latency dominates; for all-reduce
//! halving-doubling has as few steps and moves fewer bytes, so tree all-reduce runs only when
//! `OXCCL_ALGO` asks for it.

use oxccl_kernels::{DType, ReduceOp};

use crate::algorithm::prims::{Ctx, RecvMode};
use crate::base::error::Result;

/// Parent and children (in receive order for a reduce) of virtual rank `v` among `n`.
pub(crate) fn binomial(v: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    let mut children = Vec::new();
    let mut mask = 1;
    while mask < n {
        if v & mask != 0 {
            return (Some(v - mask), children);
        }
        if v + mask < n {
            children.push(v + mask);
        }
        mask <<= 1;
    }
    (None, children)
}

fn pieces(
    len: usize,
    es: usize,
    chunk_bytes: usize,
) -> impl Iterator<Item = std::ops::Range<usize>> {
    let piece = (chunk_bytes / es).max(1) * es;
    (0..len.div_ceil(piece)).map(move |i| i * piece..((i + 1) * piece).min(len))
}

/// In-place binomial reduce to `root`; other ranks' buffers are left holding partial results.
pub(crate) fn reduce(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    root: usize,
    chunk_bytes: usize,
) -> Result<()> {
    let n = ctx.size;
    let real = |v: usize| (v + root) % n;
    let (parent, children) = binomial((ctx.rank + n - root) % n, n);
    for p in pieces(buf.len(), dt.size(), chunk_bytes) {
        for &c in &children {
            ctx.recv(real(c), &mut buf[p.clone()], RecvMode::Reduce(dt, op))?;
        }
        if let Some(par) = parent {
            ctx.send(real(par), &buf[p])?;
        }
    }
    Ok(())
}

/// In-place binomial broadcast from `root`.
pub(crate) fn broadcast(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    es: usize,
    root: usize,
    chunk_bytes: usize,
) -> Result<()> {
    let n = ctx.size;
    let real = |v: usize| (v + root) % n;
    let (parent, children) = binomial((ctx.rank + n - root) % n, n);
    for p in pieces(buf.len(), es, chunk_bytes) {
        if let Some(par) = parent {
            ctx.recv(real(par), &mut buf[p.clone()], RecvMode::Copy)?;
        }
        for &c in children.iter().rev() {
            ctx.send(real(c), &buf[p.clone()])?;
        }
    }
    Ok(())
}

/// Tree all-reduce: binomial reduce to rank 0, then binomial broadcast from rank 0.
pub(crate) fn all_reduce(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    chunk_bytes: usize,
) -> Result<()> {
    if ctx.size == 1 || buf.is_empty() {
        return Ok(());
    }
    reduce(ctx, buf, dt, op, 0, chunk_bytes)?;
    broadcast(ctx, buf, dt.size(), 0, chunk_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binomial_is_a_spanning_tree() {
        for n in 1..40 {
            let mut seen = vec![0usize; n];
            for v in 0..n {
                let (p, ch) = binomial(v, n);
                assert_eq!(p.is_none(), v == 0);
                for c in ch {
                    assert_eq!(binomial(c, n).0, Some(v));
                    seen[c] += 1;
                }
            }
            assert!(seen.iter().skip(1).all(|&s| s == 1) && seen[0] == 0);
        }
    }
}
