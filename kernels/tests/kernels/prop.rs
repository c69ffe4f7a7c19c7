//! Property test: `reduce_bytes` / `reduce_into_bytes` against `reference_reduce` for random
//! dtype, op, length, contents (any bit pattern, NaN included) and misalignment.

use oxccl_kernels::{reduce_bytes, reduce_into_bytes, reference_reduce, DType, Element, ReduceOp};
use proptest::prelude::*;

use crate::common::{same, Aligned, Rng};

fn check<T: Element>(op: ReduceOp, n: usize, seed: u64, doff: usize, soff: usize) {
    let len = n * size_of::<T>();
    let mut rng = Rng::new(seed);
    let (a, b) = (rng.bytes(len), rng.bytes(len));
    let (mut db, mut sb, mut ob) = (Aligned::new(len), Aligned::new(len), Aligned::new(len));
    let d = db.at(doff, len);
    d.copy_from_slice(&a);
    let s = sb.at(soff, len);
    s.copy_from_slice(&b);
    let o = ob.at((doff + soff) % 8, len);
    reduce_into_bytes(T::DTYPE, op, o, d, s).unwrap();
    reduce_bytes(T::DTYPE, op, d, s).unwrap();
    let elems = |x: &[u8]| -> Vec<T> {
        x.chunks_exact(size_of::<T>())
            .map(bytemuck::pod_read_unaligned)
            .collect()
    };
    let (ea, eb, got, got_into) = (elems(&a), elems(&b), elems(d), elems(o));
    for i in 0..n {
        // The kernels treat Avg as Sum; reference_reduce's Avg also divides.
        let rop = if op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            op
        };
        let want = reference_reduce(&[ea[i], eb[i]], rop);
        assert!(
            same(got[i], want),
            "{} {op} i={i}: {:?} vs {want:?}",
            T::DTYPE,
            got[i]
        );
        assert!(same(got_into[i], want), "{} {op} into i={i}", T::DTYPE);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    #[test]
    fn bytes_match_reference(
        d in 0u8..12,
        o in 0u8..5,
        n in 0usize..700,
        seed in any::<u64>(),
        doff in 0usize..8,
        soff in 0usize..8,
    ) {
        let op = ReduceOp::from_u8(o).unwrap();
        oxccl_kernels::with_dtype!(DType::from_u8(d).unwrap(), check(op, n, seed, doff, soff));
    }
}
