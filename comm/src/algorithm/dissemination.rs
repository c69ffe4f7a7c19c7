//! Barrier by dissemination.
//!
//! `ceil(log2 n)` rounds: in round `k` rank `r` sends an empty message to `r + 2^k` and waits for
//! one from `r - 2^k`. After the last round every rank has heard, directly or not, from every
//! other, so none leaves before all have entered. Zero payload bytes; one slot per round.

use super::ring_sub;
use crate::algorithm::prims::{Ctx, RecvMode};
use crate::base::error::Result;

/// Dissemination barrier.
pub(crate) fn barrier(ctx: &mut Ctx<'_>) -> Result<()> {
    let (n, r) = (ctx.size, ctx.rank);
    let mut k = 1;
    while k < n {
        ctx.exchange(
            Some(((r + k) % n, &[])),
            Some((ring_sub(r, k, n), &mut [], RecvMode::Copy)),
        )?;
        k <<= 1;
    }
    Ok(())
}
