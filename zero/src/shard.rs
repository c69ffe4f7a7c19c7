//! The flat parameter space of a shard group cut into one shard per rank, bucket by bucket.
//!
//! Parameters are grouped into buckets (one, or many of at most `bucket_elems` elements each, in
//! reverse order: backward produces the last parameters' gradients first, so the first bucket
//! fills first). Each bucket lays its parameters end to end, is padded to a multiple of
//! `group * align` elements and cut into `group` equal chunks (collectives want equal chunks):
//! a reduce-scatter of a bucket gives each rank its chunk. Rank `r`'s shard is its chunk of
//! every bucket, in bucket order, so every shard has `shard_len` elements, some of them padding
//! (a rank may own padding only, when the space is small). [`Piece`]s say where each parameter's
//! elements lie in a shard; checkpoints are written and read through them, which is what lets a
//! state saved with one layout be loaded into another.

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

/// One bucket: its parameters laid end to end, padded, cut into `group` chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Its parameters, in their order within the bucket.
    pub params: Vec<usize>,
    /// Each parameter's first element within the bucket.
    pub starts: Vec<usize>,
    /// Elements of its parameters.
    pub len: usize,
    /// Elements of each rank's chunk (padding included): the bucket holds `group * chunk`.
    pub chunk: usize,
    /// Where every rank's chunk of this bucket starts in its shard.
    pub shard_offset: usize,
}

impl Bucket {
    /// The padded length: `chunk * group`.
    pub fn padded(&self, group: usize) -> usize {
        self.chunk * group
    }
}

/// One shard group's cut of the parameters (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    lens: Vec<usize>,
    /// Each parameter's bucket and first element within it.
    place: Vec<(usize, usize)>,
    buckets: Vec<Bucket>,
    group: usize,
    shard_len: usize,
}

impl ShardLayout {
    /// The layout of parameters of `lens` elements over `group` ranks in one bucket (in
    /// parameter order), chunks a multiple of `align` elements (`group` and `align` of 0 count
    /// as 1).
    pub fn new(lens: &[usize], group: usize, align: usize) -> ShardLayout {
        let order: Vec<usize> = (0..lens.len()).collect();
        ShardLayout::from_buckets(lens, vec![order], group, align)
    }

    /// The layout with parameters in reverse order, cut into buckets of at most `bucket_elems`
    /// elements each (a larger parameter gets a bucket of its own; 0 puts everything in one
    /// bucket).
    pub fn bucketed(
        lens: &[usize],
        group: usize,
        align: usize,
        bucket_elems: usize,
    ) -> ShardLayout {
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut fill = 0;
        for p in (0..lens.len()).rev() {
            let fits = bucket_elems == 0 || fill + lens[p] <= bucket_elems;
            match buckets.last_mut() {
                Some(b) if fits => b.push(p),
                _ => {
                    buckets.push(vec![p]);
                    fill = 0;
                }
            }
            fill += lens[p];
        }
        ShardLayout::from_buckets(lens, buckets, group, align)
    }

    fn from_buckets(lens: &[usize], order: Vec<Vec<usize>>, group: usize, align: usize) -> Self {
        let (group, align) = (group.max(1), align.max(1));
        let unit = group * align;
        let mut place = vec![(0, 0); lens.len()];
        let mut buckets = Vec::with_capacity(order.len());
        let mut shard_len = 0;
        for (b, params) in order.into_iter().enumerate() {
            let mut starts = Vec::with_capacity(params.len());
            let mut len = 0;
            for &p in &params {
                place[p] = (b, len);
                starts.push(len);
                len += lens[p];
            }
            let chunk = len.div_ceil(unit) * unit / group;
            buckets.push(Bucket {
                params,
                starts,
                len,
                chunk,
                shard_offset: shard_len,
            });
            shard_len += chunk;
        }
        ShardLayout {
            lens: lens.to_vec(),
            place,
            buckets,
            group,
            shard_len,
        }
    }

    /// Elements of all parameters.
    pub fn total(&self) -> usize {
        self.lens.iter().sum()
    }

    /// The parameters' lengths.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Elements of every shard (padding included).
    pub fn shard_len(&self) -> usize {
        self.shard_len
    }

    /// The padded length of all buckets: `shard_len() * group()`.
    pub fn padded(&self) -> usize {
        self.shard_len * self.group
    }

    /// Ranks in the shard group.
    pub fn group(&self) -> usize {
        self.group
    }

    /// The buckets, in the order they are reduced.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// Parameter `param`'s bucket and its first element in it.
    pub fn place(&self, param: usize) -> (usize, usize) {
        self.place[param]
    }

    /// The pieces of parameters in rank `rank`'s shard, in shard order (none for a rank outside
    /// the group).
    pub fn pieces(&self, rank: usize) -> Vec<Piece> {
        let mut out = Vec::new();
        if rank >= self.group {
            return out;
        }
        for b in &self.buckets {
            let (lo, hi) = (rank * b.chunk, (rank + 1) * b.chunk);
            for (&param, &start) in b.params.iter().zip(&b.starts) {
                let (a, z) = (start.max(lo), (start + self.lens[param]).min(hi));
                if a < z {
                    out.push(Piece {
                        param,
                        param_offset: a - start,
                        shard_offset: b.shard_offset + a - lo,
                        len: z - a,
                    });
                }
            }
        }
        out
    }
}

/// What is wrong with a gradient of `len` elements for parameter `param` (`given`: whether it
/// already had one in this micro-batch), if anything: the message every rank hears at the step.
pub(crate) fn grad_fault(lens: &[usize], param: usize, len: usize, given: bool) -> Option<String> {
    if param >= lens.len() {
        Some(format!(
            "gradient of parameter {param}; new had {} parameters",
            lens.len()
        ))
    } else if len != lens[param] {
        Some(format!(
            "gradient of parameter {param} has {len} elements; the parameter has {}",
            lens[param]
        ))
    } else if given {
        Some(format!(
            "gradient of parameter {param} given twice in one micro-batch"
        ))
    } else {
        None
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
        let piece = |param, param_offset, shard_offset, len| Piece {
            param,
            param_offset,
            shard_offset,
            len,
        };
        assert_eq!(l.pieces(0), vec![piece(0, 0, 0, 4)]);
        assert_eq!(l.pieces(1), vec![piece(0, 4, 0, 1), piece(1, 0, 1, 3)]);
        assert!(l.pieces(2).is_empty(), "padding only");
    }

    #[test]
    fn buckets_take_parameters_in_reverse_order() {
        let l = ShardLayout::bucketed(&[4, 4, 10, 2], 2, 1, 6);
        let params: Vec<Vec<usize>> = l.buckets().iter().map(|b| b.params.clone()).collect();
        assert_eq!(params, vec![vec![3], vec![2], vec![1], vec![0]]);
        let l = ShardLayout::bucketed(&[4, 4, 10, 2], 2, 1, 0);
        assert_eq!(l.buckets().len(), 1);
        assert_eq!(l.buckets()[0].params, vec![3, 2, 1, 0]);
        assert_eq!(l.place(1), (0, 12));
    }

    proptest! {
        /// The shards' pieces cover every element of every parameter exactly once, each at its
        /// place in its bucket's chunk, and chunks are equal and aligned.
        #[test]
        fn pieces_partition_the_parameters(
            lens in proptest::collection::vec(0usize..50, 0..8),
            group in 1usize..6,
            align in 1usize..5,
            bucket_elems in 0usize..60,
        ) {
            let layouts = [
                ShardLayout::new(&lens, group, align),
                ShardLayout::bucketed(&lens, group, align, bucket_elems),
            ];
            for l in layouts {
                prop_assert_eq!(l.padded(), l.shard_len() * group);
                let mut seen: Vec<Vec<bool>> = lens.iter().map(|&n| vec![false; n]).collect();
                for b in l.buckets() {
                    prop_assert_eq!(b.chunk % align, 0);
                    prop_assert!(b.padded(group) >= b.len);
                    prop_assert!(b.padded(group) < b.len + group * align);
                }
                for r in 0..group {
                    let mut used = vec![false; l.shard_len()];
                    for p in l.pieces(r) {
                        let (b, start) = l.place(p.param);
                        let bucket = &l.buckets()[b];
                        let at = start + p.param_offset;
                        prop_assert!(r * bucket.chunk <= at);
                        prop_assert!(at + p.len <= (r + 1) * bucket.chunk);
                        prop_assert_eq!(p.shard_offset, bucket.shard_offset + at - r * bucket.chunk);
                        for u in &mut used[p.shard_offset..p.shard_offset + p.len] {
                            prop_assert!(!*u, "two pieces on one shard element");
                            *u = true;
                        }
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
}
