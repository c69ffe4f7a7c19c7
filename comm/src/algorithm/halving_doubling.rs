//! Recursive halving-doubling all-reduce (Rabenseifner), for any rank count.
//!
//! With `p` the largest power of two `<= n` and `rem = n - p`: first the `2*rem` lowest ranks
//! pair up and each even rank hands its whole buffer to the odd one (which reduces it), leaving
//! `p` participants. Then `log2 p` halving steps: partners at distance 1, 2, 4, ... exchange half
//! of their current segment and reduce the half they keep (reduce-scatter). Then the same steps in
//! reverse exchange the kept segments (all-gather). Finally the odd ranks hand the result back to
//! their even partners.
//!
//! Bytes sent per participant `2 (p-1)/p * B` (+ `B` twice for the folded ranks when `n` is not a
//! power of two), latency `2 log2 p` (+2) steps: the tuner picks it for medium sizes, between the
//! tree's latency and the ring's bandwidth.
//!
//! **Recursive doubling** ([`all_reduce_doubling`]) folds the same way, then in `log2 p` steps
//! partners at distance 1, 2, 4, ... exchange their whole buffer and both reduce it: half the
//! steps of halving-doubling for `log2 p * B` bytes, so the tuner picks it for small messages (at
//! 2 ranks it is a single exchange, where the others take two rounds). Partners reduce in opposite
//! operand order, which gives the same bits for every oxccl op (IEEE sums and products are
//! commutative) except for `min`/`max` between `-0.0` and `+0.0` or NaN payloads.

use oxccl_kernels::{DType, ReduceOp};

use super::split_pair;
use crate::algorithm::prims::{Ctx, RecvMode};
use crate::base::error::Result;

/// Folds ranks beyond the largest power of two `p <= n` into their partners; returns this rank's
/// index among the `p` participants (`None` for a rank folded away) and `rem = n - p`.
fn fold(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
) -> Result<(Option<usize>, usize)> {
    let (n, r) = (ctx.size, ctx.rank);
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let rem = n - p;
    let nr = if r < 2 * rem {
        if r.is_multiple_of(2) {
            ctx.send(r + 1, buf)?;
            None
        } else {
            ctx.recv(r - 1, buf, RecvMode::Reduce(dt, op))?;
            Some(r / 2)
        }
    } else {
        Some(r - rem)
    };
    Ok((nr, rem))
}

/// Hands the result back to the ranks [`fold`] folded away.
fn unfold(ctx: &mut Ctx<'_>, buf: &mut [u8], rem: usize) -> Result<()> {
    let r = ctx.rank;
    if r < 2 * rem {
        if r.is_multiple_of(2) {
            ctx.recv(r + 1, buf, RecvMode::Copy)?;
        } else {
            ctx.send(r - 1, buf)?;
        }
    }
    Ok(())
}

/// Recursive-doubling all-reduce (whole buffers at every step; for small messages): in place, or
/// `buf = reduce(src)`.
///
/// The first step sends the input and reduces the partner's data with it straight into `buf`;
/// later steps alternate between `buf` and the communicator's scratch buffer (what is sent must not
/// change while the partner's data is reduced), with one copy back at the end when the step count
/// is even. Out of place with a power-of-two rank count the input is read where it is (no copy at
/// 2 ranks); in place, or after folding, the input is a copy in the scratch buffer.
pub(crate) fn all_reduce_doubling(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
) -> Result<()> {
    let n = ctx.size;
    if n == 1 || buf.is_empty() {
        if let Some(s) = src {
            buf.copy_from_slice(s);
        }
        return Ok(());
    }
    let mut tmp = ctx.take_scratch();
    let r = doubling_steps(ctx, src, buf, &mut tmp, dt, op);
    ctx.put_scratch(tmp);
    r
}

fn doubling_steps(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    tmp: &mut Vec<u8>,
    dt: DType,
    op: ReduceOp,
) -> Result<()> {
    // Scratch kept from earlier operations is reused as it is: every byte read from it below is
    // written first (zeroing it again cost a memset of the whole buffer per call).
    if tmp.len() < buf.len() {
        tmp.resize(buf.len(), 0);
    }
    let tmp = &mut tmp[..buf.len()];
    let p = 1usize << (usize::BITS - 1 - ctx.size.leading_zeros());
    let rem = ctx.size - p;
    // The participants' input: `src` where it is (power of two, out of place), else a copy of
    // `buf` (after the fold) in `tmp`.
    let (nr, first) = match src {
        Some(s) if rem == 0 => (Some(ctx.rank), s),
        _ => {
            if let Some(s) = src {
                buf.copy_from_slice(s);
            }
            let nr = if rem == 0 {
                Some(ctx.rank)
            } else {
                fold(ctx, buf, dt, op)?.0
            };
            if nr.is_some() {
                tmp.copy_from_slice(buf);
            }
            (nr, &tmp[..])
        }
    };
    if let Some(nr) = nr {
        let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
        // Step 1: the input goes out unchanged while input (op) partner lands in `buf`. Later
        // steps alternate between `buf` and `tmp`: what is sent must not change while the
        // partner's data is reduced.
        let partner = real(nr ^ 1);
        ctx.exchange(
            Some((partner, first)),
            Some((partner, &mut *buf, RecvMode::ReduceFrom(dt, op, first))),
        )?;
        let (mut mask, mut in_buf) = (2, true);
        while mask < p {
            let partner = real(nr ^ mask);
            let (from, to): (&[u8], &mut [u8]) = if in_buf {
                (&*buf, &mut tmp[..])
            } else {
                (&tmp[..], &mut *buf)
            };
            ctx.exchange(
                Some((partner, from)),
                Some((partner, to, RecvMode::ReduceFrom(dt, op, from))),
            )?;
            in_buf = !in_buf;
            mask <<= 1;
        }
        if !in_buf {
            buf.copy_from_slice(tmp);
        }
    }
    unfold(ctx, buf, rem)
}

/// In-place halving-doubling all-reduce.
pub(crate) fn all_reduce(ctx: &mut Ctx<'_>, buf: &mut [u8], dt: DType, op: ReduceOp) -> Result<()> {
    let n = ctx.size;
    let es = dt.size();
    let count = buf.len() / es;
    if n == 1 || count == 0 {
        return Ok(());
    }
    let (nr, rem) = fold(ctx, buf, dt, op)?;
    let p = n - rem;
    if let Some(nr) = nr {
        let real = |v: usize| if v < rem { 2 * v + 1 } else { v + rem };
        let (mut lo, mut hi) = (0usize, count);
        let mut steps = Vec::new();
        let mut mask = 1;
        while mask < p {
            let partner = real(nr ^ mask);
            let mid = lo + (hi - lo) / 2;
            let (keep, give) = if nr & mask == 0 {
                (lo..mid, mid..hi)
            } else {
                (mid..hi, lo..mid)
            };
            let (src, dst) = split_pair(
                buf,
                give.start * es..give.end * es,
                keep.start * es..keep.end * es,
            );
            ctx.exchange(
                Some((partner, src)),
                Some((partner, dst, RecvMode::Reduce(dt, op))),
            )?;
            steps.push((partner, keep.clone(), give));
            (lo, hi) = (keep.start, keep.end);
            mask <<= 1;
        }
        for (partner, keep, give) in steps.into_iter().rev() {
            let (src, dst) = split_pair(
                buf,
                keep.start * es..keep.end * es,
                give.start * es..give.end * es,
            );
            ctx.exchange(Some((partner, src)), Some((partner, dst, RecvMode::Copy)))?;
        }
    }
    unfold(ctx, buf, rem)
}
