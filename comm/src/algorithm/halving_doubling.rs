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

use oxccl_kernels::{DType, ReduceOp};

use super::split_pair;
use crate::error::Result;
use crate::prims::{Ctx, RecvMode};

/// In-place halving-doubling all-reduce.
pub(crate) fn all_reduce(ctx: &mut Ctx<'_>, buf: &mut [u8], dt: DType, op: ReduceOp) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    let es = dt.size();
    let count = buf.len() / es;
    if n == 1 || count == 0 {
        return Ok(());
    }
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros());
    let rem = n - p;
    // Fold the extra ranks into their partners.
    let nr = if r < 2 * rem {
        if r % 2 == 0 {
            ctx.send(r + 1, buf)?;
            None
        } else {
            ctx.recv(r - 1, buf, RecvMode::Reduce(dt, op))?;
            Some(r / 2)
        }
    } else {
        Some(r - rem)
    };
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
    // Unfold: hand the result back.
    if r < 2 * rem {
        if r % 2 == 0 {
            ctx.recv(r + 1, buf, RecvMode::Copy)?;
        } else {
            ctx.send(r - 1, buf)?;
        }
    }
    Ok(())
}
