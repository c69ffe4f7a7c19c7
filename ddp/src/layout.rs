//! Bucket layout: which parameters share a flat buffer, at which offsets, and the order in which
//! buckets are launched.
//!
//! Parameters are taken in an order (the reverse of their declaration order at first, the order
//! in which backward produced their gradients after the first step) and packed into buckets of
//! one dtype each. A bucket is closed when the next parameter would push it past its cap; a
//! parameter larger than the cap gets a bucket of its own. The first bucket of each dtype uses a
//! smaller cap so that communication starts early in backward. Buckets are launched in the
//! order in which their last member comes in the parameter order, so the bucket that fills first
//! goes first.

use oxccl_comm::DType;

/// A parameter as DDP knows it.
#[derive(Clone, Debug)]
pub(crate) struct ParamSpec {
    pub(crate) name: String,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
}

impl ParamSpec {
    pub(crate) fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }
}

/// One bucket: its dtype, members and their element offsets in the flat buffer.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct BucketSpec {
    pub(crate) dtype: DType,
    pub(crate) params: Vec<usize>,
    pub(crate) offsets: Vec<usize>,
    pub(crate) len: usize,
}

/// Buckets in launch order and, per parameter, its (bucket, element offset).
#[derive(Clone, Debug)]
pub(crate) struct Layout {
    pub(crate) buckets: Vec<BucketSpec>,
    pub(crate) slot: Vec<(usize, usize)>,
}

/// Packs `order` (a permutation of the parameter indices) into buckets.
pub(crate) fn plan(specs: &[ParamSpec], order: &[usize], first_cap: usize, cap: usize) -> Layout {
    struct Open {
        spec: BucketSpec,
        bytes: usize,
        cap: usize,
    }
    impl Open {
        fn new(dtype: DType, cap: usize) -> Open {
            Open {
                spec: BucketSpec {
                    dtype,
                    params: Vec::new(),
                    offsets: Vec::new(),
                    len: 0,
                },
                bytes: 0,
                cap,
            }
        }
    }
    let mut closed: Vec<BucketSpec> = Vec::new();
    let mut open: Vec<Open> = Vec::new(); // at most one per dtype
    for &p in order {
        let s = &specs[p];
        let i = match open.iter().position(|o| o.spec.dtype == s.dtype) {
            Some(i) => i,
            None => {
                let first = !closed.iter().any(|b| b.dtype == s.dtype);
                open.push(Open::new(s.dtype, if first { first_cap } else { cap }));
                open.len() - 1
            }
        };
        if open[i].bytes > 0 && open[i].bytes + s.bytes() > open[i].cap {
            let o = open.swap_remove(i);
            closed.push(o.spec);
            open.push(Open::new(s.dtype, cap));
        }
        let i = open
            .iter()
            .position(|o| o.spec.dtype == s.dtype)
            .unwrap_or(0);
        let o = &mut open[i];
        o.spec.params.push(p);
        o.spec.offsets.push(o.spec.len);
        o.spec.len += s.len;
        o.bytes += s.bytes();
        if o.bytes >= o.cap {
            let o = open.swap_remove(i);
            closed.push(o.spec);
        }
    }
    closed.extend(open.into_iter().map(|o| o.spec));
    // Launch order: by the position of each bucket's last member in `order`.
    let mut pos = vec![0usize; specs.len()];
    for (k, &p) in order.iter().enumerate() {
        pos[p] = k;
    }
    closed.sort_by_key(|b| b.params.last().map_or(0, |&p| pos[p]));
    let mut slot = vec![(0, 0); specs.len()];
    for (b, spec) in closed.iter().enumerate() {
        for (&p, &off) in spec.params.iter().zip(&spec.offsets) {
            slot[p] = (b, off);
        }
    }
    Layout {
        buckets: closed,
        slot,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(len: usize, dtype: DType) -> ParamSpec {
        ParamSpec {
            name: format!("p{len}"),
            len,
            dtype,
        }
    }

    #[test]
    fn reverse_order_small_first_bucket_and_oversized_alone() {
        // f32 params of 1, 1, 4, 2 and 2 KiB (256 elements = 1 KiB); first cap 1 KiB, cap 4 KiB.
        let specs: Vec<_> = [256, 256, 1024, 512, 512]
            .iter()
            .map(|&n| spec(n, DType::F32))
            .collect();
        let order: Vec<usize> = (0..specs.len()).rev().collect();
        let l = plan(&specs, &order, 1024, 4096);
        let members: Vec<Vec<usize>> = l.buckets.iter().map(|b| b.params.clone()).collect();
        // Param 4 (2 KiB) alone exceeds the first cap; 3 (2 KiB) fills the next to 2 KiB, 2
        // (4 KiB) would overflow it so it goes alone; 1 and 0 share the last.
        assert_eq!(members, vec![vec![4], vec![3], vec![2], vec![1, 0]]);
        assert_eq!(l.slot[0], (3, 256));
        assert_eq!(l.buckets[3].len, 512);
    }

    #[test]
    fn an_empty_parameter_does_not_use_up_the_first_bucket() {
        let specs = vec![
            spec(0, DType::F32),
            spec(300, DType::F32),
            spec(10, DType::F32),
        ];
        let l = plan(&specs, &[0, 1, 2], 1024, 1 << 20);
        let members: Vec<Vec<usize>> = l.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(members, vec![vec![0, 1], vec![2]]);
    }

    #[test]
    fn dtypes_get_separate_buckets_launched_by_last_member() {
        let specs = vec![
            spec(10, DType::F32),
            spec(10, DType::BF16),
            spec(10, DType::F32),
        ];
        let l = plan(&specs, &[0, 1, 2], 1 << 20, 1 << 20);
        let members: Vec<Vec<usize>> = l.buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(members, vec![vec![1], vec![0, 2]]);
        assert_eq!(l.buckets[0].dtype, DType::BF16);
    }

    proptest! {
        /// Every parameter lands in exactly one bucket of its dtype, at non-overlapping offsets,
        /// and no bucket with two or more non-empty members exceeds its own cap (`first_cap` for
        /// the first bucket of each dtype, `cap` for the others).
        #[test]
        fn layout_is_a_partition(
            lens in prop::collection::vec((0usize..5000, 0usize..3), 1..40),
            first_cap in 1usize..20_000,
            cap in 1usize..40_000,
            seed in any::<u64>(),
        ) {
            let dts = [DType::F32, DType::BF16, DType::F64];
            let specs: Vec<_> = lens.iter().map(|&(n, d)| spec(n, dts[d])).collect();
            let mut order: Vec<usize> = (0..specs.len()).collect();
            let mut s = seed;
            for i in (1..order.len()).rev() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                order.swap(i, (s >> 33) as usize % (i + 1));
            }
            let l = plan(&specs, &order, first_cap, cap);
            let mut count = vec![0; specs.len()];
            for b in &l.buckets {
                let mut end = 0;
                for (&p, &off) in b.params.iter().zip(&b.offsets) {
                    count[p] += 1;
                    prop_assert_eq!(specs[p].dtype, b.dtype);
                    prop_assert_eq!(off, end);
                    end += specs[p].len;
                }
                prop_assert_eq!(end, b.len);
                // The first bucket of a dtype (the one holding its first parameter in `order`)
                // has `first_cap`, the others `cap`. Empty parameters may share any bucket (they
                // add no bytes), so the cap binds buckets with two or more non-empty members.
                let first_of_dtype = order.iter().find(|&&q| specs[q].dtype == b.dtype);
                let own_cap = if first_of_dtype.is_some_and(|q| b.params.contains(q)) {
                    first_cap
                } else {
                    cap
                };
                if b.params.iter().filter(|&&p| specs[p].len > 0).count() > 1 {
                    prop_assert!(b.len * b.dtype.size() <= own_cap, "{:?} over {}", b, own_cap);
                }
            }
            prop_assert!(count.iter().all(|&c| c == 1));
            for (p, &(b, off)) in l.slot.iter().enumerate() {
                let k = l.buckets[b].params.iter().position(|&q| q == p).unwrap();
                prop_assert_eq!(l.buckets[b].offsets[k], off);
            }
        }
    }
}
