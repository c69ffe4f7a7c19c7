//! Single-copy broadcast and all-gather for ranks that share memory and may read each other's
//! (`process_vm_readv`, the same condition as the single-copy all-reduce in
//! [`direct`](super::direct)): no slots, no staging. Every byte crosses once, from the buffer
//! that holds it straight into the buffer that needs it, instead of into a slot and out again.
//!
//! Both run one epoch of the communicator's [`Window`](crate::transport::Window): every rank
//! publishes the addresses of its input and output with step `4e + 1` and waits for every
//! peer's; each then copies what it needs (a broadcast's non-root ranks read the root's input
//! into their output while the root copies its input into its output, out of place; an
//! all-gather's ranks read every peer's input into that peer's block of their output, and copy
//! their own), publishes `4e + 2` and waits for every peer's, so that no rank returns (and lets
//! its caller reuse a buffer) while another still reads it.

use crate::algorithm::prims::{copy, Ctx};
use crate::base::error::{Error, Result};
use crate::base::tuning::STREAM_MIN;
use crate::transport::Window;

/// Fails unless every rank can read every other.
fn require(w: &dyn Window, ctx_rank: usize, op: &str) -> Result<()> {
    if w.single_copy() {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        rank: ctx_rank,
        op: op.into(),
        msg: "single-copy needs process_vm_readv between every pair of ranks (refused here, \
              or OXCCL_SHM_SINGLE_COPY=0)"
            .into(),
    })
}

/// Starts an epoch: publishes `[input, output]` with step `4e + 1` and waits until every peer
/// has published the same operation. Returns the epoch's half.
fn open(ctx: &mut Ctx<'_>, input: usize, output: usize) -> Result<(u64, usize)> {
    let (me, op, tag) = (ctx.rank, ctx.op, ctx.tag);
    let (w, _) = ctx.window()?;
    require(w, me, op)?;
    let e = w.next_epoch();
    let h = (e % 2) as usize;
    w.publish(4 * e + 1, tag, h, [input, output]);
    ctx.wait_step(4 * e + 1, Some(h))?;
    Ok((e, h))
}

/// Ends an epoch: step `4e + 2`, once every peer has read what it needed of this rank.
fn close(ctx: &mut Ctx<'_>, (e, h): (u64, usize), region: [usize; 2]) -> Result<()> {
    let tag = ctx.tag;
    let (w, _) = ctx.window()?;
    w.publish(4 * e + 2, tag, h, region);
    ctx.wait_step(4 * e + 2, None)
}

/// Broadcast of `buf` from `root` (`src`: the root's input, out of place).
pub(crate) fn broadcast(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    root: usize,
) -> Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    let me = ctx.rank;
    let input = src.map_or(buf.as_ptr(), <[u8]>::as_ptr) as usize;
    let region = [input, buf.as_ptr() as usize];
    let epoch = open(ctx, region[0], region[1])?;
    if me == root {
        if let Some(s) = src {
            copy(buf.len() >= STREAM_MIN, buf, s);
        }
    } else {
        let (w, _) = ctx.window()?;
        let theirs = w.peer_region(root, epoch.1)[0];
        w.read_peer(root, theirs, buf)?;
    }
    close(ctx, epoch, region)
}

/// All-gather into `buf` (`n` equal blocks, this rank's block `me`; `own`: this rank's input,
/// out of place, else its block of `buf` holds it).
pub(crate) fn all_gather(ctx: &mut Ctx<'_>, buf: &mut [u8], own: Option<&[u8]>) -> Result<()> {
    let (n, me) = (ctx.size, ctx.rank);
    let block = buf.len() / n;
    if block == 0 {
        return Ok(());
    }
    let mine = me * block..(me + 1) * block;
    let input = own.map_or(buf[mine.clone()].as_ptr(), <[u8]>::as_ptr) as usize;
    let region = [input, buf.as_ptr() as usize];
    let epoch = open(ctx, region[0], region[1])?;
    if let Some(o) = own {
        copy(block >= STREAM_MIN, &mut buf[mine], o);
    }
    let (w, _) = ctx.window()?;
    for k in 1..n {
        // Each rank starts with its next peer, so that no rank is read by everyone at once.
        let p = (me + k) % n;
        let theirs = w.peer_region(p, epoch.1)[0];
        w.read_peer(p, theirs, &mut buf[p * block..(p + 1) * block])?;
    }
    close(ctx, epoch, region)
}
