//! Collective algorithms, one file each, written against the primitives in `crate::algorithm::prims` (and so
//! against the transport trait only: no algorithm knows which backend carries its bytes).
//!
//! | file | algorithms |
//! |---|---|
//! | `ring.rs` | ring all-reduce, ring reduce-scatter, ring all-gather |
//! | `tree.rs` | binomial-tree reduce and broadcast, tree all-reduce |
//! | `halving_doubling.rs` | recursive halving-doubling and recursive doubling all-reduce (any rank count) |
//! | `chain.rs` | pipelined chain broadcast and reduce |
//! | `linear.rs` | gather and scatter (root talks to every rank) |
//! | `pairwise.rs` | all-to-all by pairwise exchange |
//! | `dissemination.rs` | barrier |
//! | `direct.rs` | one-shot, two-shot and single-copy all-reduce over the shared-memory window |
//! | `single_copy.rs` | single-copy broadcast and all-gather (`process_vm_readv`) |
//! | `mapped.rs` | all-gather and all-reduce reading and writing peers' registered buffers |
//! | `hierarchical.rs` | all-reduce, reduce-scatter and all-gather by rings inside and across nodes |
//!
//! All of them work on byte buffers in place; the ring and hierarchical (all-reduce,
//! reduce-scatter, all-gather),
//! the chain broadcast and the direct all-reduces also read an out-of-place input where it is.
//! The communicator turns the other out-of-place calls into in-place ones (one copy) and checks
//! arguments before anything is sent. The direct ones use the shared-memory
//! window through `Ctx::window` / `Ctx::wait_step`, not the slots, but still know no backend.

pub(crate) mod chain;
pub(crate) mod direct;
pub(crate) mod dissemination;
pub(crate) mod halving_doubling;
pub(crate) mod hierarchical;
pub(crate) mod linear;
pub(crate) mod mapped;
pub(crate) mod pairwise;
pub(crate) mod prims;
pub(crate) mod ring;
pub(crate) mod single_copy;
pub(crate) mod tree;

use std::ops::Range;

/// Splits `count` elements into `parts` contiguous ranges whose lengths differ by at most one
/// (the first `count % parts` ranges get the extra element); returns range `i`.
pub fn partition(count: usize, parts: usize, i: usize) -> Range<usize> {
    debug_assert!(parts > 0 && i < parts);
    let base = count / parts;
    let extra = count % parts;
    let start = i * base + i.min(extra);
    let len = base + usize::from(i < extra);
    start..start + len
}

/// The blocks `[start, start + len)` of `len <= block` (at least 1) that cover `0..total`.
pub(crate) fn blocks(total: usize, block: usize) -> impl Iterator<Item = (usize, usize)> {
    let block = block.max(1);
    (0..total)
        .step_by(block)
        .map(move |start| (start, block.min(total - start)))
}

/// Two disjoint byte ranges of one buffer: the first shared, the second mutable.
pub(crate) fn split_pair(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    let (a, b) = split_pair_mut(buf, a, b);
    (a, b)
}

/// Two disjoint byte ranges of one buffer, both mutable.
pub(crate) fn split_pair_mut(
    buf: &mut [u8],
    a: Range<usize>,
    b: Range<usize>,
) -> (&mut [u8], &mut [u8]) {
    assert!(
        a.end <= b.start || b.end <= a.start,
        "ranges overlap: {a:?} {b:?}"
    );
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&mut lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&mut hi[..a.end - a.start], &mut lo[b])
    }
}

/// `(rank - k) mod n` without underflow.
pub(crate) fn ring_sub(rank: usize, k: usize, n: usize) -> usize {
    (rank + n - k % n) % n
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn partition_covers_exactly(count in 0usize..100_000, parts in 1usize..64) {
            let mut next = 0;
            for i in 0..parts {
                let r = partition(count, parts, i);
                prop_assert_eq!(r.start, next);
                prop_assert!(r.len() == count / parts || r.len() == count / parts + 1);
                next = r.end;
            }
            prop_assert_eq!(next, count);
        }

        #[test]
        fn split_pair_is_disjoint(len in 2usize..200, cut in 1usize..199) {
            let cut = cut.min(len - 1);
            let mut buf: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let (a, b) = split_pair(&mut buf, 0..cut, cut..len);
            prop_assert_eq!(a.len() + b.len(), len);
            let (a2, b2) = split_pair(&mut buf, cut..len, 0..cut);
            prop_assert_eq!(a2[0], cut as u8);
            prop_assert_eq!(b2.len(), cut);
        }
    }
}
