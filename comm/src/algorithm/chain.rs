//! Pipelined chains: broadcast and reduce for large buffers.
//!
//! Ranks are renumbered relative to the root (`v = (r - root) mod n`) and form a chain
//! `0 -> 1 -> ... -> n-1`. Broadcast: the root streams its buffer to `v=1` slot by slot; every
//! middle rank copies each slot into its buffer and forwards it to the next rank at once, so all
//! links carry data at the same time. Out of place, the root sends from its input and copies each
//! piece into its output right after the piece enters a slot. Reduce runs the chain backwards: `v=n-1` streams its buffer
//! to `v=n-2`, every middle rank reduces each arriving slot into its buffer and forwards the
//! result, the root reduces the last hop into its buffer.
//!
//! Each rank sends and receives `B` bytes once: time ~ `B / bandwidth + (n-1)` slot latencies,
//! which the tuner prefers to the tree beyond a few slots.

use oxccl_kernels::{DType, ReduceOp};

use crate::algorithm::prims::{Ctx, RecvMode};
use crate::base::error::Result;

/// Chain broadcast from `root`, in place, or out of place on the root (`src`: the root sends from
/// `src` and mirrors each piece into `buf` as it goes out).
pub(crate) fn broadcast(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    root: usize,
    src: Option<&[u8]>,
) -> Result<()> {
    let n = ctx.size;
    if n == 1 || buf.is_empty() {
        if let Some(s) = src {
            buf.copy_from_slice(s);
        }
        return Ok(());
    }
    let real = |v: usize| (v + root) % n;
    let v = (ctx.rank + n - root) % n;
    if v == 0 {
        match src {
            Some(s) => {
                let tag = ctx.tag;
                ctx.exchange_mirrored(Some((real(1), s, tag)), Some(buf), None)
            }
            None => ctx.send(real(1), buf),
        }
    } else if v == n - 1 {
        ctx.recv(real(v - 1), buf, RecvMode::Copy)
    } else {
        ctx.recv_forward(real(v - 1), real(v + 1), buf, RecvMode::Copy)
    }
}

/// In-place chain reduce to `root`; other ranks' buffers are left holding partial results.
pub(crate) fn reduce(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let n = ctx.size;
    if n == 1 || buf.is_empty() {
        return Ok(());
    }
    let real = |v: usize| (v + root) % n;
    let v = (ctx.rank + n - root) % n;
    if v == n - 1 {
        ctx.send(real(v - 1), buf)
    } else if v == 0 {
        ctx.recv(real(1), buf, RecvMode::Reduce(dt, op))
    } else {
        ctx.recv_forward(real(v + 1), real(v - 1), buf, RecvMode::Reduce(dt, op))
    }
}
