//! Pipelined chains: broadcast and reduce for large buffers.
//!
//! Ranks are renumbered relative to the root (`v = (r - root) mod n`) and form a chain
//! `0 -> 1 -> ... -> n-1`. Broadcast: the root streams its buffer to `v=1` slot by slot; every
//! middle rank copies each slot into its buffer and forwards it to the next rank at once, so all
//! links carry data at the same time. Reduce runs the chain backwards: `v=n-1` streams its buffer
//! to `v=n-2`, every middle rank reduces each arriving slot into its buffer and forwards the
//! result, the root reduces the last hop into its buffer.
//!
//! Each rank sends and receives `B` bytes once: time ~ `B / bandwidth + (n-1)` slot latencies,
//! which the tuner prefers to the tree beyond a few slots.

use oxccl_kernels::{DType, ReduceOp};

use crate::error::Result;
use crate::prims::{Ctx, RecvMode};

/// In-place chain broadcast from `root`.
pub(crate) fn broadcast(ctx: &mut Ctx<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    let n = ctx.size;
    if n == 1 || buf.is_empty() {
        return Ok(());
    }
    let real = |v: usize| (v + root) % n;
    let v = (ctx.rank + n - root) % n;
    if v == 0 {
        ctx.send(real(1), buf)
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
