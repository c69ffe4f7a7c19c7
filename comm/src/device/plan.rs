//! How a device operation is staged through pinned host memory: the argument checks, the layout
//! of the staging buffer, and the split into parts that pipeline copies with the network. Pure
//! functions of the call's arguments, so every rank computes the same plan and the whole module is
//! tested without a GPU.
//!
//! A device operation runs as one or more **parts**. Each part is one host collective (its own
//! sequence number on every rank) over a range of the staging buffer, with at most one copy from
//! the device input into that range before it and one copy from the range to the device output
//! after it. All-reduce, broadcast and reduce are element-wise, so they split into parts of at
//! most `chunk_bytes` (same boundaries on every rank): the device-to-host copies of later parts
//! and the host-to-device copies of earlier ones then overlap with the network. The other
//! collectives run as one part.

use std::ops::Range;

pub(crate) use crate::base::call::Kind;
use crate::base::call::{check, Lens};
#[cfg(test)]
use oxccl_kernels::ReduceOp;

/// One copy between a device buffer and the staging buffer (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Copy {
    /// Offset in the device buffer.
    pub dev: usize,
    /// Offset in the staging buffer.
    pub stage: usize,
    /// Bytes.
    pub len: usize,
}

/// One host collective of a staged device operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Part {
    /// Element count in the collective's tag (the same on every rank).
    pub count: usize,
    /// The staging bytes the collective works on.
    pub stage: Range<usize>,
    /// Device input to staging, before the collective (`None`: this rank sends nothing).
    pub d2h: Option<Copy>,
    /// Staging to device output, after it (`None`: this rank receives nothing).
    pub h2d: Option<Copy>,
}

/// A checked device operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Staging bytes the whole operation needs.
    pub stage_bytes: usize,
    /// The host collectives, in order.
    pub parts: Vec<Part>,
}

/// Checks a device operation's arguments as the host calls are checked
/// ([`crate::base::call::check`]) and lays it out.
///
/// `input` and `output` are element counts of the device buffers the call was given (`None`
/// where the call has no such buffer: in-place calls pass the same count for both). `es` is the
/// element size, `chunk_bytes` the largest part of an element-wise operation (0: no split).
///
/// # Errors
/// The message for `InvalidArgument` (the caller adds the rank and the operation).
pub(crate) fn plan(
    kind: Kind,
    rank: usize,
    size: usize,
    es: usize,
    input: Option<usize>,
    output: Option<usize>,
    chunk_bytes: usize,
) -> Result<Plan, String> {
    let lens = Lens {
        input,
        output,
        in_place: false,
    };
    let count = check(kind, rank, size, lens)?;
    let copy = |dev: usize, stage: usize, len: usize| Copy { dev, stage, len };
    let one = |stage_bytes: usize, d2h: Option<Copy>, h2d: Option<Copy>| Plan {
        stage_bytes,
        parts: vec![Part {
            count,
            stage: 0..stage_bytes,
            d2h,
            h2d,
        }],
    };
    let shard = count * es;
    let on_root = |root: usize| rank == root;
    Ok(match kind {
        Kind::AllReduce(_) => chunked(count, es, chunk_bytes, true, true),
        Kind::Broadcast { root } => chunked(count, es, chunk_bytes, on_root(root), true),
        Kind::Reduce { root, .. } => chunked(count, es, chunk_bytes, true, on_root(root)),
        // The whole input is reduced in place; this rank's shard goes back.
        Kind::ReduceScatter(_) => one(
            shard * size,
            Some(copy(0, 0, shard * size)),
            Some(copy(0, rank * shard, shard)),
        ),
        Kind::AllGather => one(
            shard * size,
            Some(copy(0, rank * shard, shard)),
            Some(copy(0, 0, shard * size)),
        ),
        // Staging: [input | output (root only)].
        Kind::Gather { root } => {
            let out = if on_root(root) { shard * size } else { 0 };
            let h2d = on_root(root).then_some(copy(0, shard, out));
            one(shard + out, Some(copy(0, 0, shard)), h2d)
        }
        // Staging: [input (root only) | output].
        Kind::Scatter { root } => {
            let inp = if on_root(root) { shard * size } else { 0 };
            let d2h = on_root(root).then_some(copy(0, 0, inp));
            one(inp + shard, d2h, Some(copy(0, inp, shard)))
        }
        // Staging: [input | output].
        Kind::AllToAll => {
            let len = shard * size;
            one(2 * len, Some(copy(0, 0, len)), Some(copy(0, len, len)))
        }
        Kind::Send { .. } => one(shard, Some(copy(0, 0, shard)), None),
        Kind::Recv { .. } => one(shard, None, Some(copy(0, 0, shard))),
    })
}

/// An element-wise operation over `count` elements in parts of at most `chunk_bytes` (whole
/// elements, at least one), laid out identically on the device and in staging.
fn chunked(count: usize, es: usize, chunk_bytes: usize, dev_in: bool, dev_out: bool) -> Plan {
    let per = if chunk_bytes == 0 {
        count.max(1)
    } else {
        (chunk_bytes / es).max(1)
    };
    let mut parts = Vec::new();
    let mut start = 0;
    loop {
        let n = per.min(count - start);
        let copy = Copy {
            dev: start * es,
            stage: start * es,
            len: n * es,
        };
        parts.push(Part {
            count: n,
            stage: start * es..(start + n) * es,
            d2h: dev_in.then_some(copy),
            h2d: dev_out.then_some(copy),
        });
        start += n;
        if start >= count {
            break;
        }
    }
    Plan {
        stage_bytes: count * es,
        parts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_wise_operations_split_at_the_same_boundaries_on_every_rank() {
        let p = plan(
            Kind::AllReduce(ReduceOp::Sum),
            0,
            4,
            4,
            Some(10),
            Some(10),
            16,
        )
        .unwrap();
        assert_eq!(p.stage_bytes, 40);
        let counts: Vec<usize> = p.parts.iter().map(|q| q.count).collect();
        assert_eq!(counts, [4, 4, 2]);
        assert_eq!(p.parts[2].stage, 32..40);
        assert_eq!(p.parts[2].d2h, p.parts[2].h2d);
        assert_eq!(p.parts[2].d2h.unwrap().dev, 32);
        // Ranks other than the root of a broadcast copy nothing in, but split the same way.
        let b0 = plan(Kind::Broadcast { root: 0 }, 0, 2, 4, Some(10), Some(10), 16).unwrap();
        let b1 = plan(Kind::Broadcast { root: 0 }, 1, 2, 4, None, Some(10), 16).unwrap();
        assert!(b0.parts.iter().all(|q| q.d2h.is_some()));
        assert!(b1.parts.iter().all(|q| q.d2h.is_none() && q.h2d.is_some()));
        let c0: Vec<usize> = b0.parts.iter().map(|q| q.count).collect();
        let c1: Vec<usize> = b1.parts.iter().map(|q| q.count).collect();
        assert_eq!(c0, c1);
        // Reduce: only the root copies back.
        let r1 = plan(
            Kind::Reduce {
                op: ReduceOp::Max,
                root: 0,
            },
            1,
            2,
            2,
            Some(3),
            None,
            0,
        )
        .unwrap();
        assert_eq!(r1.parts.len(), 1);
        assert!(r1.parts[0].h2d.is_none());
    }

    #[test]
    fn a_chunk_smaller_than_an_element_still_moves_whole_elements() {
        let p = plan(Kind::AllReduce(ReduceOp::Sum), 0, 2, 8, Some(3), Some(3), 5).unwrap();
        assert_eq!(p.parts.len(), 3);
        assert!(p.parts.iter().all(|q| q.count == 1 && q.stage.len() == 8));
        // Zero elements: one empty collective, so every rank still takes a sequence number.
        let z = plan(
            Kind::AllReduce(ReduceOp::Sum),
            0,
            2,
            4,
            Some(0),
            Some(0),
            16,
        )
        .unwrap();
        assert_eq!(z.parts.len(), 1);
        assert_eq!(z.parts[0].count, 0);
    }

    #[test]
    fn shard_layouts_put_each_rank_at_its_offset() {
        let rs = plan(
            Kind::ReduceScatter(ReduceOp::Sum),
            2,
            4,
            4,
            Some(12),
            Some(3),
            0,
        )
        .unwrap();
        assert_eq!(rs.stage_bytes, 48);
        assert_eq!(rs.parts[0].count, 3);
        assert_eq!(rs.parts[0].h2d.unwrap().stage, 24);
        let ag = plan(Kind::AllGather, 3, 4, 2, Some(5), Some(20), 0).unwrap();
        assert_eq!(ag.parts[0].d2h.unwrap().stage, 30);
        assert_eq!(ag.parts[0].h2d.unwrap().len, 40);
        let g_root = plan(Kind::Gather { root: 1 }, 1, 3, 4, Some(2), Some(6), 0).unwrap();
        assert_eq!(g_root.stage_bytes, 8 + 24);
        assert_eq!(g_root.parts[0].h2d.unwrap().stage, 8);
        let g_leaf = plan(Kind::Gather { root: 1 }, 0, 3, 4, Some(2), None, 0).unwrap();
        assert_eq!(g_leaf.stage_bytes, 8);
        assert!(g_leaf.parts[0].h2d.is_none());
        let s_leaf = plan(Kind::Scatter { root: 0 }, 2, 3, 4, None, Some(2), 0).unwrap();
        assert!(s_leaf.parts[0].d2h.is_none());
        assert_eq!(s_leaf.parts[0].h2d.unwrap().stage, 0);
        let a2a = plan(Kind::AllToAll, 0, 2, 4, Some(4), Some(4), 0).unwrap();
        assert_eq!(a2a.parts[0].count, 2);
        assert_eq!(a2a.parts[0].h2d.unwrap().stage, 16);
    }

    #[test]
    fn bad_arguments_are_named() {
        let e = plan(Kind::AllReduce(ReduceOp::Sum), 0, 2, 4, Some(3), Some(4), 0).unwrap_err();
        assert!(e.contains("input has 3 elements, output 4"), "{e}");
        let e = plan(Kind::Broadcast { root: 5 }, 0, 2, 4, None, Some(4), 0).unwrap_err();
        assert!(e.contains("root 5"), "{e}");
        let e = plan(
            Kind::ReduceScatter(ReduceOp::Sum),
            0,
            3,
            4,
            Some(10),
            Some(3),
            0,
        )
        .unwrap_err();
        assert!(e.contains("world size 3"), "{e}");
        let e = plan(Kind::AllToAll, 0, 3, 4, Some(4), Some(4), 0).unwrap_err();
        assert!(e.contains("divisible"), "{e}");
        let e = plan(Kind::Send { peer: 0 }, 0, 2, 4, Some(4), None, 0).unwrap_err();
        assert!(e.contains("another rank"), "{e}");
        let e = plan(Kind::Gather { root: 0 }, 0, 2, 4, Some(4), None, 0).unwrap_err();
        assert!(e.contains("needs an output"), "{e}");
    }
}
