//! All-to-all by pairwise exchange.
//!
//! `n-1` steps: at step `k` rank `r` sends its block `r+k` to rank `r+k` while receiving block
//! `r-k`'s data from rank `r-k`, both streamed through slots at once; the own block is copied
//! locally. Every rank sends and receives `(n-1)/n * B` bytes; each step pairs every rank with a
//! distinct sender and receiver, so no rank is a hot spot.

use std::ops::Range;

use super::ring_sub;
use crate::algorithm::prims::{Ctx, RecvMode};
use crate::base::error::Result;
use crate::transport::Tag;

/// All-to-all: `input` and `output` hold `n` blocks of equal size.
pub(crate) fn all_to_all(ctx: &mut Ctx<'_>, input: &[u8], output: &mut [u8]) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    let bs = output.len() / n;
    output[r * bs..(r + 1) * bs].copy_from_slice(&input[r * bs..(r + 1) * bs]);
    for k in 1..n {
        let to = (r + k) % n;
        let from = ring_sub(r, k, n);
        ctx.exchange(
            Some((to, &input[to * bs..(to + 1) * bs])),
            Some((
                from,
                &mut output[from * bs..(from + 1) * bs],
                RecvMode::Copy,
            )),
        )?;
    }
    Ok(())
}

/// All-to-all with a block length per pair, by the same pairwise schedule: `sends[j]` and
/// `recvs[j]` are the byte ranges of `input` and `output` for rank j, and `elem` the element
/// size. Every pair exchanges one message even when it is empty, tagged with the pair's element
/// count, so two ranks that disagree on a count fail with a `Mismatch` naming both counts as
/// soon as the message arrives instead of waiting for data that never comes.
pub(crate) fn all_to_all_v(
    ctx: &mut Ctx<'_>,
    input: &[u8],
    sends: &[Range<usize>],
    output: &mut [u8],
    recvs: &[Range<usize>],
    elem: usize,
) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    output[recvs[r].clone()].copy_from_slice(&input[sends[r].clone()]);
    let op_tag = ctx.tag;
    let tag = |bytes: &Range<usize>| Tag {
        count: (bytes.len() / elem) as u64,
        ..op_tag
    };
    for k in 1..n {
        let to = (r + k) % n;
        let from = ring_sub(r, k, n);
        let (send_tag, recv_tag) = (tag(&sends[to]), tag(&recvs[from]));
        ctx.exchange_tagged(
            Some((to, &input[sends[to].clone()], send_tag)),
            Some((
                from,
                &mut output[recvs[from].clone()],
                RecvMode::Copy,
                recv_tag,
            )),
        )?;
    }
    Ok(())
}
