//! Direct all-reduce for ranks that share memory: one-shot, two-shot and single-copy.
//!
//! These run over the communicator's [`Window`](crate::transport::Window) (every rank's staging
//! halves and step counter, readable by every rank) instead of slots, so a step costs one
//! release-store and the peers' acquire-loads, not a message. Epoch `e` uses staging half `e % 2`
//! and steps `4e + 1..=4e + 3` (see the trait's documentation for why two halves need no closing
//! barrier).
//!
//! - **One-shot** (small messages): every rank copies its input into its staging half and
//!   publishes step `4e + 1`; once every peer has too, every rank reduces all `n` halves, in rank
//!   order (so every rank computes the same bits), into its output. One step; each rank reads
//!   `n x bytes`. Messages larger than the staging half run in pieces of it.
//! - **Two-shot** (medium): inputs are staged as in one-shot; rank `i` then reduces piece `i` of
//!   every half into piece `i` of its own half (only rank `i` reads that piece in this phase, so
//!   it can be overwritten) and publishes `4e + 2`; every rank then copies piece `j` from rank `j`'s
//!   half into its output. Two steps; each rank reads about `2 x bytes`. A single rank computes each
//!   piece, so every rank gets the same bits.
//! - **Single-copy** (large, when `process_vm_readv` works between every pair of ranks): no
//!   staging at all. Every rank publishes the addresses of its input and output buffers; rank `i`
//!   reads piece `i` of every peer's input straight out of the peer's memory (in blocks of
//!   [`BLOCK`] bytes through a scratch buffer that stays in cache) and reduces it into piece `i` of
//!   its output, publishes `4e + 2`, then reads every other piece from its owner's output straight
//!   into its own, and publishes `4e + 3` so that no rank returns (and lets its caller reuse the
//!   buffer) while a peer still reads it. Out-of-place costs nothing extra.
//!
//! The tuner picks them by size (thresholds measured on the development machine, in
//! `crate::base::tuning`); `OXCCL_ALGO=all-reduce=one-shot|two-shot|single-copy` forces one.

use std::ops::Range;

use oxccl_kernels::{reduce_bytes, reduce_into_bytes, DType, KernelError, ReduceOp};

use crate::algorithm::partition;
use crate::algorithm::prims::{copy, Ctx};
use crate::base::error::{Error, Result};
use crate::transport::INLINE_WORDS;

/// Bytes read from a peer per `process_vm_readv` before they are reduced (fits in L2).
pub(crate) const BLOCK: usize = 256 << 10;

pub(crate) fn kerr(rank: usize, op: &str, e: KernelError) -> Error {
    Error::InvalidArgument {
        rank,
        op: op.into(),
        msg: e.to_string(),
    }
}

/// Largest multiple of the element size that fits in a staging half.
fn piece_bytes(ctx: &mut Ctx<'_>, es: usize) -> Result<usize> {
    let cap = ctx.window()?.0.capacity() / es * es;
    if cap == 0 {
        return Err(Error::InvalidArgument {
            rank: ctx.rank,
            op: ctx.op.into(),
            msg: "the shared-memory staging area is off (OXCCL_SHM_DIRECT_BYTES=0)".into(),
        });
    }
    Ok(cap)
}

/// Byte range of piece `i` of `n` of a buffer of `len` bytes of `es`-byte elements.
pub(crate) fn piece(len: usize, es: usize, n: usize, i: usize) -> Range<usize> {
    let r = partition(len / es, n, i);
    r.start * es..r.end * es
}

/// Starts an epoch: copies `input` into this rank's staging half, publishes step `4e + 1` and
/// waits until every peer has staged the same operation. Returns the epoch and its half.
fn stage(ctx: &mut Ctx<'_>, input: &[u8]) -> Result<(u64, usize)> {
    let tag = ctx.tag;
    let (w, _) = ctx.window()?;
    let e = w.next_epoch();
    let h = (e % 2) as usize;
    w.staging(h).own(0..input.len()).copy_from_slice(input);
    w.publish(4 * e + 1, tag, h, [0, 0]);
    ctx.wait_step(4 * e + 1, Some(h))?;
    Ok((e, h))
}

/// One-shot all-reduce of `buf` (in place when `src` is `None`, else `buf = reduce(src)`).
pub(crate) fn one_shot(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
) -> Result<()> {
    let (n, es) = (ctx.size, dt.size());
    if travels_inline(ctx, buf.len()) {
        return one_shot_inline(ctx, src, buf, dt, op);
    }
    let cap = piece_bytes(ctx, es)?;
    let mut off = 0;
    while off < buf.len() {
        let len = cap.min(buf.len() - off);
        let r = off..off + len;
        let (_, h) = stage(ctx, src.map_or(&buf[r.clone()], |s| &s[r.clone()]))?;
        let (w, _) = ctx.window()?;
        let st = w.staging(h);
        let out = &mut buf[r];
        let res = reduce_into_bytes(dt, op, out, st.peer(0, 0..len), st.peer(1, 0..len))
            .and_then(|()| (2..n).try_for_each(|p| reduce_bytes(dt, op, out, st.peer(p, 0..len))));
        drop(st);
        res.map_err(|e| kerr(ctx.rank, ctx.op, e))?;
        off += len;
    }
    Ok(())
}

/// Whether a one-shot all-reduce of `bytes` travels in the published records themselves
/// ([`Window::inline_capacity`]; never without a window).
///
/// [`Window::inline_capacity`]: crate::transport::Window::inline_capacity
#[inline]
pub(crate) fn travels_inline(ctx: &Ctx<'_>, bytes: usize) -> bool {
    bytes <= ctx.inline_capacity()
}

/// One-shot all-reduce of at most [`Window::inline_capacity`] bytes: the input travels in the
/// published record itself (one cache line per peer to read, no staging half), and is reduced
/// in rank order like [`one_shot`].
///
/// [`Window::inline_capacity`]: crate::transport::Window::inline_capacity
fn one_shot_inline(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
) -> Result<()> {
    let (n, me, tag, len) = (ctx.size, ctx.rank, ctx.tag, buf.len());
    let mut mine = [0u64; INLINE_WORDS];
    bytemuck::cast_slice_mut::<u64, u8>(&mut mine)[..len].copy_from_slice(src.unwrap_or(buf));
    let (w, _) = ctx.window()?;
    let e = w.next_epoch();
    let h = (e % 2) as usize;
    w.publish_inline(4 * e + 1, tag, h, &bytemuck::cast_slice(&mine)[..len]);
    ctx.wait_step(4 * e + 1, Some(h))?;
    let (w, _) = ctx.window()?;
    let data = |p: usize| if p == me { mine } else { w.peer_inline(p, h) };
    let (first, second) = (data(0), data(1));
    reduce_into_bytes(dt, op, buf, head(&first, len), head(&second, len))
        .and_then(|()| (2..n).try_for_each(|p| reduce_bytes(dt, op, buf, head(&data(p), len))))
        .map_err(|e| kerr(me, ctx.op, e))
}

/// The first `len` bytes of inline words.
fn head(words: &[u64; INLINE_WORDS], len: usize) -> &[u8] {
    &bytemuck::cast_slice::<u64, u8>(words)[..len]
}

/// Two-shot all-reduce of `buf` (in place when `src` is `None`, else `buf = reduce(src)`).
pub(crate) fn two_shot(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
) -> Result<()> {
    let (n, me, tag, es, stream) = (ctx.size, ctx.rank, ctx.tag, dt.size(), ctx.stream);
    let cap = piece_bytes(ctx, es)?;
    let mut off = 0;
    while off < buf.len() {
        let len = cap.min(buf.len() - off);
        let r = off..off + len;
        let (e, h) = stage(ctx, src.map_or(&buf[r.clone()], |s| &s[r.clone()]))?;
        // Reduce piece `me` of every rank's half into this rank's half.
        let mine = piece(len, es, n, me);
        let (w, _) = ctx.window()?;
        let mut st = w.staging(h);
        let res = (0..n).filter(|&p| p != me).try_for_each(|p| {
            let (acc, theirs) = st.own_and_peer(mine.clone(), p);
            reduce_bytes(dt, op, acc, theirs)
        });
        drop(st);
        res.map_err(|e| kerr(ctx.rank, ctx.op, e))?;
        let (w, _) = ctx.window()?;
        w.publish(4 * e + 2, tag, h, [0, 0]);
        ctx.wait_step(4 * e + 2, None)?;
        // Every piece from the rank that reduced it.
        let (w, _) = ctx.window()?;
        let st = w.staging(h);
        for j in 0..n {
            let pj = piece(len, es, n, j);
            copy(
                stream,
                &mut buf[off + pj.start..off + pj.end],
                st.peer(j, pj),
            );
        }
        off += len;
    }
    Ok(())
}

/// Single-copy all-reduce of `buf` (in place when `src` is `None`, else `buf = reduce(src)`):
/// each rank reduces its piece of every peer's input, read with `process_vm_readv`, a block at
/// a time, and writes each reduced block into every peer's output with `process_vm_writev`;
/// nothing is staged and nothing is read back.
pub(crate) fn single_copy(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
) -> Result<()> {
    let (n, me, tag, es, name) = (ctx.size, ctx.rank, ctx.tag, dt.size(), ctx.op);
    if buf.is_empty() {
        return Ok(());
    }
    let (w, _) = ctx.window()?;
    if !w.single_copy() {
        return Err(Error::InvalidArgument {
            rank: me,
            op: name.into(),
            msg: "single-copy needs process_vm_readv between every pair of ranks \
                  (refused here, or OXCCL_SHM_SINGLE_COPY=0)"
                .into(),
        });
    }
    let e = w.next_epoch();
    let h = (e % 2) as usize;
    let mine = piece(buf.len(), es, n, me);
    if let (Some(s), 1) = (src, n) {
        buf[mine.clone()].copy_from_slice(&s[mine.clone()]);
    }
    let input = src.map_or(buf.as_ptr(), <[u8]>::as_ptr) as usize;
    let output = buf.as_ptr() as usize;
    w.publish(4 * e + 1, tag, h, [input, output]);
    ctx.wait_step(4 * e + 1, Some(h))?;
    // Piece `me` of every peer's input, reduced a block at a time into this rank's output (out
    // of place, the first peer's block with this rank's input: no copy of the input first),
    // then written into every peer's output. Only this rank writes piece `me` anywhere, and
    // only it reads piece `me` of the inputs (in place, a block is read before it is written).
    let (w, scratch) = ctx.window()?;
    scratch.resize(BLOCK.min(mine.len()), 0);
    let peers: Vec<usize> = (0..n).filter(|&p| p != me).collect();
    let mut at = mine.start;
    while at < mine.end {
        let len = BLOCK.min(mine.end - at);
        let tmp = &mut scratch[..len];
        for (i, &p) in peers.iter().enumerate() {
            w.read_peer(p, w.peer_region(p, h)[0] + at, tmp)?;
            let out = &mut buf[at..at + len];
            let reduced = match src {
                Some(s) if i == 0 => reduce_into_bytes(dt, op, out, &s[at..at + len], tmp),
                _ => reduce_bytes(dt, op, out, tmp),
            };
            reduced.map_err(|e| kerr(me, name, e))?;
        }
        for &p in &peers {
            w.write_peer(p, w.peer_region(p, h)[1] + at, &buf[at..at + len])?;
        }
        at += len;
    }
    // Once every peer is here, none reads this rank's input or writes its output any more.
    let (w, _) = ctx.window()?;
    w.publish(4 * e + 2, tag, h, [input, output]);
    ctx.wait_step(4 * e + 2, None)
}
