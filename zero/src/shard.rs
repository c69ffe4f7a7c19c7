//! The flat parameter space of a shard group cut into one shard per rank.
//!
//! Parameters are laid end to end (in the order given) into one flat space of `total` elements.
//! With `group` ranks and an alignment of `align` elements, the space is padded to a multiple of
//! `group * align` and cut into `group` equal shards, so that a reduce-scatter of the padded
//! gradient gives each rank its shard (collectives want equal shards); rank `r` owns elements
//! `[r * shard_len, (r + 1) * shard_len)`, of which those past `total` are padding (a rank may
//! own padding only, when the space is small).

/// Where a piece of one parameter lies in a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The parameter's index.
    pub param: usize,
    /// The piece's first element within the parameter.
    pub param_offset: usize,
    /// The piece's first element within the shard.
    pub shard_offset: usize,
    /// Elements.
    pub len: usize,
}

/// One shard group's cut of the flat parameter space (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    lens: Vec<usize>,
    starts: Vec<usize>,
    total: usize,
    group: usize,
    shard_len: usize,
}

impl ShardLayout {
    /// The layout of parameters of `lens` elements over `group` ranks, shards a multiple of
    /// `align` elements (`group` and `align` of 0 count as 1).
    pub fn new(lens: &[usize], group: usize, align: usize) -> ShardLayout {
        let (group, align) = (group.max(1), align.max(1));
        let mut starts = Vec::with_capacity(lens.len());
        let mut total = 0;
        for &l in lens {
            starts.push(total);
            total += l;
        }
        let unit = group * align;
        let padded = total.div_ceil(unit) * unit;
        ShardLayout {
            lens: lens.to_vec(),
            starts,
            total,
            group,
            shard_len: padded / group,
        }
    }

    /// Elements of all parameters.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Elements of every shard (padding included).
    pub fn shard_len(&self) -> usize {
        self.shard_len
    }

    /// The padded flat length: `shard_len() * group()`.
    pub fn padded(&self) -> usize {
        self.shard_len * self.group
    }

    /// Ranks in the shard group.
    pub fn group(&self) -> usize {
        self.group
    }

    /// Rank `rank`'s shard in the flat space: `[start, end)`, padding excluded (empty for a rank
    /// that owns padding only, or one outside the group).
    pub fn range(&self, rank: usize) -> std::ops::Range<usize> {
        if rank >= self.group {
            return self.total..self.total;
        }
        let start = (rank * self.shard_len).min(self.total);
        let end = ((rank + 1) * self.shard_len).min(self.total);
        start..end
    }

    /// The pieces of parameters in rank `rank`'s shard, in flat order.
    pub fn pieces(&self, rank: usize) -> Vec<Piece> {
        let r = self.range(rank);
        let shard_start = rank.min(self.group) * self.shard_len;
        let mut out = Vec::new();
        for (param, (&start, &len)) in self.starts.iter().zip(&self.lens).enumerate() {
            let (a, b) = (start.max(r.start), (start + len).min(r.end));
            if a < b {
                out.push(Piece {
                    param,
                    param_offset: a - start,
                    shard_offset: a - shard_start,
                    len: b - a,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn uneven_sizes_pad_the_last_shards() {
        let l = ShardLayout::new(&[5, 3], 3, 2);
        assert_eq!((l.total(), l.shard_len(), l.padded()), (8, 4, 12));
        assert_eq!(l.range(0), 0..4);
        assert_eq!(l.range(1), 4..8);
        assert_eq!(l.range(2), 8..8, "padding only");
        assert_eq!(
            l.pieces(1),
            vec![
                Piece {
                    param: 0,
                    param_offset: 4,
                    shard_offset: 0,
                    len: 1
                },
                Piece {
                    param: 1,
                    param_offset: 0,
                    shard_offset: 1,
                    len: 3
                },
            ]
        );
        assert!(l.pieces(2).is_empty());
    }

    proptest! {
        /// The shards' pieces cover every element of every parameter exactly once, each at
        /// its place in the flat space, and shards are equal and aligned.
        #[test]
        fn pieces_partition_the_parameters(
            lens in proptest::collection::vec(0usize..50, 0..8),
            group in 1usize..6,
            align in 1usize..5,
        ) {
            let l = ShardLayout::new(&lens, group, align);
            prop_assert_eq!(l.shard_len() % align, 0);
            prop_assert!(l.padded() >= l.total() && l.padded() < l.total() + group * align);
            let mut seen: Vec<Vec<bool>> = lens.iter().map(|&n| vec![false; n]).collect();
            for r in 0..group {
                let range = l.range(r);
                for p in l.pieces(r) {
                    prop_assert!(p.shard_offset + p.len <= l.shard_len());
                    let flat: usize = lens[..p.param].iter().sum::<usize>() + p.param_offset;
                    prop_assert_eq!(r * l.shard_len() + p.shard_offset, flat);
                    prop_assert!(range.start <= flat && flat + p.len <= range.end);
                    for s in &mut seen[p.param][p.param_offset..p.param_offset + p.len] {
                        prop_assert!(!*s, "an element in two pieces");
                        *s = true;
                    }
                }
            }
            prop_assert!(seen.iter().flatten().all(|&s| s), "an element in no piece");
        }
    }
}
