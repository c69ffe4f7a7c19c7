//! Calls as data: what a collective or point-to-point call is ([`Kind`]), and the checks of its
//! arguments that every path shares (host buffers, staged device buffers, CUDA IPC), so a bad
//! call gets the same error whatever memory its buffers are in.

use oxccl_kernels::ReduceOp;

use crate::base::op::Collective;

/// A collective or point-to-point call, with what it needs besides its buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
    Broadcast { root: usize },
    Reduce { op: ReduceOp, root: usize },
    Gather { root: usize },
    Scatter { root: usize },
    AllToAll,
    Send { peer: usize },
    Recv { peer: usize },
}

impl Kind {
    /// The API name used in error messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::AllReduce(_) => "all_reduce",
            Kind::ReduceScatter(_) => "reduce_scatter",
            Kind::AllGather => "all_gather",
            Kind::Broadcast { .. } => "broadcast",
            Kind::Reduce { .. } => "reduce",
            Kind::Gather { .. } => "gather",
            Kind::Scatter { .. } => "scatter",
            Kind::AllToAll => "all_to_all",
            Kind::Send { .. } => "send",
            Kind::Recv { .. } => "recv",
        }
    }

    /// The operation's name as its tag describes it (`all-reduce`, `send-recv`).
    pub(crate) fn tag_name(self) -> &'static str {
        self.collective().map_or("send-recv", Collective::name)
    }

    /// The collective in the operation's tag (`None` for point-to-point).
    pub(crate) fn collective(self) -> Option<Collective> {
        Some(match self {
            Kind::AllReduce(_) => Collective::AllReduce,
            Kind::ReduceScatter(_) => Collective::ReduceScatter,
            Kind::AllGather => Collective::AllGather,
            Kind::Broadcast { .. } => Collective::Broadcast,
            Kind::Reduce { .. } => Collective::Reduce,
            Kind::Gather { .. } => Collective::Gather,
            Kind::Scatter { .. } => Collective::Scatter,
            Kind::AllToAll => Collective::AllToAll,
            Kind::Send { .. } | Kind::Recv { .. } => return None,
        })
    }

    /// The reduction (`Sum` for operations without one, as the host tags them).
    pub(crate) fn op(self) -> ReduceOp {
        match self {
            Kind::AllReduce(op) | Kind::ReduceScatter(op) | Kind::Reduce { op, .. } => op,
            _ => ReduceOp::Sum,
        }
    }

    /// The root (0 for operations without one).
    pub(crate) fn root(self) -> usize {
        match self {
            Kind::Broadcast { root }
            | Kind::Reduce { root, .. }
            | Kind::Gather { root }
            | Kind::Scatter { root } => root,
            _ => 0,
        }
    }
}

/// The element counts of a call's buffers on this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lens {
    /// The input's (`None`: the call has none here, e.g. a broadcast's input off the root).
    pub input: Option<usize>,
    /// The output's (`None`: the call has none here, e.g. a reduce's output off the root).
    pub output: Option<usize>,
    /// Input and output are one buffer (reduce-scatter and all-gather in place: `size` shards).
    pub in_place: bool,
}

impl Lens {
    /// One buffer of `len` elements, input and output.
    pub(crate) fn in_place(len: usize) -> Lens {
        Lens {
            input: Some(len),
            output: Some(len),
            in_place: true,
        }
    }

    /// An input of `input` and an output of `output` elements.
    pub(crate) fn io(input: usize, output: usize) -> Lens {
        Lens {
            input: Some(input),
            output: Some(output),
            in_place: false,
        }
    }
}

/// Checks the arguments of `kind` on rank `rank` of `size` with buffers of `lens`, and returns
/// the element count its tag carries (every rank must agree on it: the reduced or sent length,
/// a shard's length for reduce-scatter, all-gather, gather and scatter, a block's for
/// all-to-all).
///
/// # Errors
/// The message of the `InvalidArgument` (the caller adds the rank and the operation).
pub(crate) fn check(kind: Kind, rank: usize, size: usize, lens: Lens) -> Result<usize, String> {
    let need = |what: &str, v: Option<usize>| {
        v.ok_or_else(|| format!("{} needs an {what} buffer", kind.name()))
    };
    let root_ok = |root: usize| {
        if root < size {
            Ok(())
        } else {
            Err(format!(
                "root {root} is not a rank of this communicator (size {size})"
            ))
        }
    };
    let same = |i: usize, o: usize| {
        if i == o {
            Ok(o)
        } else {
            Err(format!("input has {i} elements, output {o}"))
        }
    };
    let shards = |len: usize| {
        if len.is_multiple_of(size) {
            Ok(len / size)
        } else {
            Err(format!(
                "buffer of {len} elements is not divisible by the world size {size}"
            ))
        }
    };
    let times = |full_side: &str, full: usize, part_side: &str, part: usize| {
        if Some(full) == part.checked_mul(size) {
            Ok(part)
        } else {
            Err(format!(
                "{full_side} has {full} elements; it must be {part_side} length {part} x \
                 world size {size}"
            ))
        }
    };
    match kind {
        Kind::AllReduce(_) => same(need("input", lens.input)?, need("output", lens.output)?),
        Kind::ReduceScatter(_) if lens.in_place => shards(need("output", lens.output)?),
        Kind::ReduceScatter(_) => {
            let (i, o) = (need("input", lens.input)?, need("output", lens.output)?);
            times("input", i, "output", o)
        }
        Kind::AllGather if lens.in_place => shards(need("output", lens.output)?),
        Kind::AllGather => {
            let (i, o) = (need("input", lens.input)?, need("output", lens.output)?);
            times("output", o, "input", i)
        }
        Kind::Broadcast { root } => {
            root_ok(root)?;
            let o = need("output", lens.output)?;
            match rank == root {
                true => same(need("input", lens.input)?, o),
                false => Ok(o),
            }
        }
        Kind::Reduce { root, .. } => {
            root_ok(root)?;
            let i = need("input", lens.input)?;
            match rank == root {
                true => same(i, need("output", lens.output)?),
                false => Ok(i),
            }
        }
        Kind::Gather { root } => {
            root_ok(root)?;
            let i = need("input", lens.input)?;
            match rank == root {
                true => times("output", need("output", lens.output)?, "input", i),
                false => Ok(i),
            }
        }
        Kind::Scatter { root } => {
            root_ok(root)?;
            let o = need("output", lens.output)?;
            match rank == root {
                true => times("input", need("input", lens.input)?, "output", o),
                false => Ok(o),
            }
        }
        Kind::AllToAll => {
            let (i, o) = (need("input", lens.input)?, need("output", lens.output)?);
            if i != o || !i.is_multiple_of(size) {
                return Err(format!(
                    "input ({i}) and output ({o}) must have the same length, divisible by the \
                     world size {size}"
                ));
            }
            Ok(i / size)
        }
        Kind::Send { peer } | Kind::Recv { peer } => {
            if peer >= size || peer == rank {
                return Err(format!(
                    "peer {peer} must be another rank of this communicator (size {size})"
                ));
            }
            match kind {
                Kind::Send { .. } => need("input", lens.input),
                _ => need("output", lens.output),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_checked_alike_and_give_their_tag_count() {
        let sum = ReduceOp::Sum;
        assert_eq!(check(Kind::AllReduce(sum), 0, 4, Lens::io(10, 10)), Ok(10));
        assert!(check(Kind::AllReduce(sum), 0, 4, Lens::io(10, 9))
            .unwrap_err()
            .contains("input has 10 elements, output 9"));
        assert_eq!(
            check(Kind::ReduceScatter(sum), 0, 4, Lens::io(12, 3)),
            Ok(3)
        );
        assert_eq!(
            check(Kind::ReduceScatter(sum), 0, 4, Lens::in_place(12)),
            Ok(3)
        );
        assert!(check(Kind::ReduceScatter(sum), 0, 4, Lens::in_place(10))
            .unwrap_err()
            .contains("not divisible by the world size 4"));
        assert!(check(Kind::ReduceScatter(sum), 0, 4, Lens::io(12, 4))
            .unwrap_err()
            .contains("input has 12 elements; it must be output length 4 x world size 4"));
        assert_eq!(check(Kind::AllGather, 1, 4, Lens::io(3, 12)), Ok(3));
        assert_eq!(check(Kind::AllGather, 1, 4, Lens::in_place(12)), Ok(3));
        // Rooted calls look at the root's side only on the root.
        let off_root = Lens {
            input: Some(5),
            output: None,
            in_place: false,
        };
        assert_eq!(
            check(Kind::Reduce { op: sum, root: 0 }, 1, 2, off_root),
            Ok(5)
        );
        assert!(check(Kind::Reduce { op: sum, root: 1 }, 1, 2, off_root)
            .unwrap_err()
            .contains("reduce needs an output buffer"));
        assert!(check(Kind::Broadcast { root: 2 }, 0, 2, Lens::io(1, 1))
            .unwrap_err()
            .contains("root 2 is not a rank of this communicator (size 2)"));
        assert_eq!(check(Kind::Gather { root: 0 }, 0, 3, Lens::io(2, 6)), Ok(2));
        assert_eq!(check(Kind::Gather { root: 0 }, 1, 3, Lens::io(2, 0)), Ok(2));
        assert_eq!(
            check(Kind::Scatter { root: 0 }, 0, 3, Lens::io(6, 2)),
            Ok(2)
        );
        assert!(check(Kind::Scatter { root: 0 }, 0, 3, Lens::io(5, 2)).is_err());
        assert_eq!(check(Kind::AllToAll, 0, 3, Lens::io(6, 6)), Ok(2));
        assert!(check(Kind::AllToAll, 0, 3, Lens::io(6, 3)).is_err());
        assert!(check(Kind::Send { peer: 0 }, 0, 3, Lens::io(1, 1))
            .unwrap_err()
            .contains("peer 0 must be another rank"));
    }
}
