//! Byte kernels: aligned and unaligned slices give the typed result bit for bit.

use oxccl_kernels::{
    finish_avg, finish_avg_bytes, reduce, reduce_bytes, reduce_into, reduce_into_bytes, DType,
    Element, KernelError, ReduceOp,
};

use crate::common::{assert_same, Aligned, Rng};

/// More than one 256-element block of the unaligned path, plus a tail.
const N: usize = 300;

fn unaligned_matches_typed<T: Element>() {
    let dt = T::DTYPE;
    let len = N * dt.size();
    let mut rng = Rng::new(99 + u64::from(dt.to_u8()));
    for op in ReduceOp::ALL {
        let a = rng.vec::<T>(N, op);
        let b = rng.vec::<T>(N, op);
        let mut want = a.clone();
        reduce(&mut want, &b, op).unwrap();
        let mut want_avg = want.clone();
        finish_avg(&mut want_avg, 3);
        let mut want_into = vec![T::zeroed(); N];
        reduce_into(&mut want_into, &a, &b, op).unwrap();
        assert_same(&want_into, &want, "reduce_into vs reduce");

        let (mut db, mut sb, mut xb) = (Aligned::new(len), Aligned::new(len), Aligned::new(len));
        for doff in 0..8 {
            for soff in 0..8 {
                let what = format!("{op} dst+{doff} src+{soff}");
                let d = db.at(doff, len);
                d.copy_from_slice(bytemuck::cast_slice(&a));
                let s = sb.at(soff, len);
                s.copy_from_slice(bytemuck::cast_slice(&b));
                reduce_bytes(dt, op, d, s).unwrap();
                assert_same(&read::<T>(d), &want, &format!("reduce_bytes {what}"));

                finish_avg_bytes(dt, d, 3).unwrap();
                assert_same(
                    &read::<T>(d),
                    &want_avg,
                    &format!("finish_avg_bytes {what}"),
                );

                // Out of place: a at soff, b at (soff + doff) % 8, dst at doff.
                let x = xb.at((soff + doff) % 8, len);
                x.copy_from_slice(bytemuck::cast_slice(&b));
                s.copy_from_slice(bytemuck::cast_slice(&a));
                let d = db.at(doff, len);
                d.fill(0xA5);
                reduce_into_bytes(dt, op, d, sb.at(soff, len), xb.at((soff + doff) % 8, len))
                    .unwrap();
                assert_same(&read::<T>(d), &want, &format!("reduce_into_bytes {what}"));
            }
        }
    }
}

/// Reads possibly unaligned bytes as `T`s.
fn read<T: Element>(bytes: &[u8]) -> Vec<T> {
    bytes
        .chunks_exact(size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .collect()
}

#[test]
fn unaligned_byte_slices_match_aligned() {
    each_type!(unaligned_matches_typed());
}

#[test]
fn byte_errors() {
    let mut d = [0u8; 8];
    assert_eq!(
        reduce_bytes(DType::F32, ReduceOp::Sum, &mut d, &[0; 4]),
        Err(KernelError::LengthMismatch { dst: 8, src: 4 })
    );
    assert_eq!(
        reduce_bytes(DType::F64, ReduceOp::Sum, &mut d[..6], &[0; 6]),
        Err(KernelError::NotMultiple { bytes: 6, elem: 8 })
    );
    assert_eq!(
        reduce_into_bytes(DType::I32, ReduceOp::Min, &mut d, &[0; 8], &[0; 12]),
        Err(KernelError::LengthMismatch { dst: 8, src: 12 })
    );
    assert_eq!(
        reduce_into_bytes(DType::BF16, ReduceOp::Min, &mut d[..3], &[0; 3], &[0; 3]),
        Err(KernelError::NotMultiple { bytes: 3, elem: 2 })
    );
    assert_eq!(
        finish_avg_bytes(DType::U64, &mut d[..7], 2),
        Err(KernelError::NotMultiple { bytes: 7, elem: 8 })
    );
    assert_eq!(
        finish_avg_bytes(DType::U8, &mut d, 0),
        Err(KernelError::ZeroCount)
    );
    // Empty slices are fine for every dtype, aligned or not.
    for dt in DType::ALL {
        let mut buf = Aligned::new(0);
        reduce_bytes(dt, ReduceOp::Prod, buf.at(3, 0), &[]).unwrap();
        reduce_into_bytes(dt, ReduceOp::Prod, buf.at(1, 0), &[], &[]).unwrap();
        finish_avg_bytes(dt, buf.at(5, 0), 4).unwrap();
    }
    // Single bytes are always aligned.
    let mut one = [250u8];
    reduce_bytes(DType::U8, ReduceOp::Sum, &mut one, &[10]).unwrap();
    assert_eq!(one, [4]);
    let mut neg = [(-3i8) as u8];
    reduce_bytes(DType::I8, ReduceOp::Max, &mut neg, &[(-9i8) as u8]).unwrap();
    assert_eq!(neg[0] as i8, -3);
}
