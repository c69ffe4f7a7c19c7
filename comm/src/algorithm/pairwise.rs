//! All-to-all by pairwise exchange.
//!
//! `n-1` steps: at step `k` rank `r` sends its block `r+k` to rank `r+k` while receiving block
//! `r-k`'s data from rank `r-k`, both streamed through slots at once; the own block is copied
//! locally. Every rank sends and receives `(n-1)/n * B` bytes; each step pairs every rank with a
//! distinct sender and receiver, so no rank is a hot spot.

use super::ring_sub;
use crate::error::Result;
use crate::prims::{Ctx, RecvMode};

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
