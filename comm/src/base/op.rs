//! Operation descriptors: what a collective is, and how it is packed into a slot's [`Tag`].

use std::fmt;

use oxccl_kernels::{DType, ReduceOp};

use crate::base::error::{Error, Result};
use bytemuck::{Pod, Zeroable};

/// What each slot carries besides its payload: which operation it belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Pod, Zeroable)]
#[repr(C)]
pub struct Tag {
    /// Sequence number of the operation (collective counter, or per-pair counter for send/recv).
    pub seq: u64,
    /// Packed operation description (collective, dtype, reduce op, root); see `crate::base::op`.
    pub desc: u64,
    /// Element count of the operation as the caller gave it.
    pub count: u64,
}

/// The collectives (and point-to-point) oxccl runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    /// Every rank ends with the reduction of all inputs.
    AllReduce,
    /// Rank r ends with shard r of the reduction.
    ReduceScatter,
    /// Every rank ends with every rank's shard.
    AllGather,
    /// Every rank ends with the root's buffer.
    Broadcast,
    /// The root ends with the reduction of all inputs.
    Reduce,
    /// The root ends with every rank's buffer.
    Gather,
    /// Rank r ends with shard r of the root's buffer.
    Scatter,
    /// Rank r's block j goes to rank j's block r.
    AllToAll,
    /// No rank leaves before every rank has entered.
    Barrier,
    /// Point-to-point send/recv.
    SendRecv,
    /// Like [`Collective::AllToAll`] with a block length per pair (tags carry the pair's count).
    AllToAllV,
    /// Like [`Collective::AllGather`] with a shard length per rank (`MPI_Allgatherv`).
    AllGatherV,
    /// Like [`Collective::ReduceScatter`] with a shard length per rank (`MPI_Reduce_scatter`).
    ReduceScatterV,
    /// Like [`Collective::Gather`] with a block length per rank (`MPI_Gatherv`; tags carry each
    /// block's count).
    GatherV,
    /// Like [`Collective::Scatter`] with a block length per rank (`MPI_Scatterv`; tags carry
    /// each block's count).
    ScatterV,
}

impl Collective {
    /// Every collective, in a fixed order.
    pub const ALL: [Collective; 15] = [
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::AllGather,
        Collective::Broadcast,
        Collective::Reduce,
        Collective::Gather,
        Collective::Scatter,
        Collective::AllToAll,
        Collective::Barrier,
        Collective::SendRecv,
        Collective::AllToAllV,
        Collective::AllGatherV,
        Collective::ReduceScatterV,
        Collective::GatherV,
        Collective::ScatterV,
    ];

    /// The name used in logs, `OXCCL_ALGO` and `oxccl perf` (`all-reduce`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all-reduce",
            Collective::ReduceScatter => "reduce-scatter",
            Collective::AllGather => "all-gather",
            Collective::Broadcast => "broadcast",
            Collective::Reduce => "reduce",
            Collective::Gather => "gather",
            Collective::Scatter => "scatter",
            Collective::AllToAll => "all-to-all",
            Collective::Barrier => "barrier",
            Collective::SendRecv => "send-recv",
            Collective::AllToAllV => "all-to-all-v",
            Collective::AllGatherV => "all-gather-v",
            Collective::ReduceScatterV => "reduce-scatter-v",
            Collective::GatherV => "gather-v",
            Collective::ScatterV => "scatter-v",
        }
    }

    /// Whether the collective reduces (takes a [`ReduceOp`]): all-reduce, reduce-scatter,
    /// reduce-scatter-v and reduce.
    pub const fn reduces(self) -> bool {
        matches!(
            self,
            Collective::AllReduce
                | Collective::ReduceScatter
                | Collective::ReduceScatterV
                | Collective::Reduce
        )
    }

    /// Whether the collective has a root: broadcast, reduce, gather, scatter, gather-v and
    /// scatter-v.
    pub const fn has_root(self) -> bool {
        matches!(
            self,
            Collective::Broadcast
                | Collective::Reduce
                | Collective::Gather
                | Collective::Scatter
                | Collective::GatherV
                | Collective::ScatterV
        )
    }

    /// Its place in [`Collective::ALL`] (the declaration order, which `ALL` follows).
    pub(crate) fn to_u8(self) -> u8 {
        self as u8
    }

    pub(crate) fn from_u8(v: u8) -> Option<Collective> {
        Collective::ALL.get(v as usize).copied()
    }

    /// Parses a name; `_` and `-` are interchangeable and may be left out (`allreduce`).
    ///
    /// # Errors
    /// `Error::Config` listing the valid names.
    pub fn parse(s: &str) -> Result<Collective> {
        let norm = |x: &str| x.to_ascii_lowercase().replace(['-', '_'], "");
        Collective::ALL
            .iter()
            .copied()
            .find(|c| norm(c.name()) == norm(s))
            .ok_or_else(|| {
                let names: Vec<&str> = Collective::ALL.iter().map(|c| c.name()).collect();
                Error::Config(format!(
                    "unknown collective {s:?}; expected one of {}",
                    names.join(", ")
                ))
            })
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One operation as the caller issued it; every rank must issue matching descriptors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpDesc {
    /// Which collective.
    pub coll: Collective,
    /// Element type.
    pub dtype: DType,
    /// Reduction (Sum where none applies).
    pub op: ReduceOp,
    /// Root rank (0 where none applies; for all-gather-v and reduce-scatter-v a 32-bit
    /// fingerprint of the per-rank counts, see [`counts_fingerprint`]).
    pub root: usize,
    /// Element count as called (per-rank count for gather/scatter/all-gather/reduce-scatter
    /// output; the total of every rank's shard for all-gather-v and reduce-scatter-v).
    pub count: usize,
}

impl OpDesc {
    /// The tag every slot of this operation carries.
    pub fn tag(&self, seq: u64) -> Tag {
        let desc = self.coll.to_u8() as u64
            | (self.dtype.to_u8() as u64) << 8
            | (self.op.to_u8() as u64) << 16
            | (self.root as u64 & 0xffff_ffff) << 32;
        Tag {
            seq,
            desc,
            count: self.count as u64,
        }
    }

    /// Decodes a tag back into a descriptor (None if the tag is not one oxccl made).
    pub fn from_tag(tag: &Tag) -> Option<OpDesc> {
        Some(OpDesc {
            coll: Collective::from_u8((tag.desc & 0xff) as u8)?,
            dtype: DType::from_u8((tag.desc >> 8 & 0xff) as u8)?,
            op: ReduceOp::from_u8((tag.desc >> 16 & 0xff) as u8)?,
            root: (tag.desc >> 32) as usize,
            count: tag.count as usize,
        })
    }

    /// Human description used in `Mismatch` errors: `all-reduce(count=1000, dtype=float, op=sum) #5`.
    pub fn describe_tag(tag: &Tag) -> String {
        match OpDesc::from_tag(tag) {
            Some(d) => format!("{d} #{}", tag.seq),
            None => format!(
                "unknown op {:#x} count {} #{}",
                tag.desc, tag.count, tag.seq
            ),
        }
    }
}

impl fmt::Display for OpDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}(count={}, dtype={}",
            self.coll, self.count, self.dtype
        )?;
        match self.coll {
            Collective::AllReduce | Collective::ReduceScatter => write!(f, ", op={})", self.op),
            Collective::Reduce => write!(f, ", op={}, root={})", self.op, self.root),
            Collective::Broadcast
            | Collective::Gather
            | Collective::Scatter
            | Collective::GatherV
            | Collective::ScatterV => write!(f, ", root={})", self.root),
            Collective::AllGatherV => write!(f, ", counts-hash={:08x})", self.root),
            Collective::ReduceScatterV => {
                write!(f, ", op={}, counts-hash={:08x})", self.op, self.root)
            }
            _ => write!(f, ")"),
        }
    }
}

/// A 32-bit fingerprint of a list of per-rank counts (FNV-1a over their little-endian bytes):
/// ranks that pass different lists to an all-gather-v or reduce-scatter-v carry different tags,
/// so the call fails with `Mismatch` instead of pairing blocks of different lengths.
pub fn counts_fingerprint(counts: &[usize]) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &c in counts {
        for b in (c as u64).to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    ((h >> 32) ^ (h & 0xffff_ffff)) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_round_trip() {
        for (i, coll) in Collective::ALL.into_iter().enumerate() {
            assert_eq!(
                usize::from(coll.to_u8()),
                i,
                "ALL follows the declaration order"
            );
            let d = OpDesc {
                coll,
                dtype: DType::BF16,
                op: ReduceOp::Max,
                root: 7,
                count: 1 << 40,
            };
            let t = d.tag(99);
            assert_eq!(OpDesc::from_tag(&t), Some(d));
            assert!(OpDesc::describe_tag(&t).ends_with("#99"));
            assert_eq!(Collective::parse(coll.name()).unwrap(), coll);
        }
        assert_eq!(
            Collective::parse("allreduce").unwrap(),
            Collective::AllReduce
        );
        assert!(Collective::parse("all-shuffle").is_err());
    }

    #[test]
    fn counts_fingerprints_tell_lists_apart() {
        let f = counts_fingerprint;
        assert_eq!(f(&[3, 5, 0]), f(&[3, 5, 0]));
        assert_ne!(f(&[3, 5, 0]), f(&[5, 3, 0]));
        assert_ne!(f(&[3, 5, 0]), f(&[3, 5]));
        assert_ne!(f(&[4, 4]), f(&[8, 0]));
        assert!(f(&[1 << 40, 7]) <= 0xffff_ffff);
    }
}
