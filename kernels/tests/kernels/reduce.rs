//! Typed kernels against the independent reference.

use half::{bf16, f16};
use oxccl_kernels::{
    finish_avg, reduce, reduce_into, reference_reduce, DType, Element, KernelError, ReduceOp,
};

use crate::common::{assert_same, ref_div, ref_op, same, Rng};

const LENS: [usize; 6] = [0, 1, 7, 31, 1000, 4099];
/// Number of contributors reduced per test (three, so a second step starts from rounded data).
const K: usize = 3;

fn all_ops_all_lengths<T: Element>() {
    let mut rng = Rng::new(0x5EED ^ u64::from(T::DTYPE.to_u8()));
    for op in ReduceOp::ALL {
        for n in LENS {
            let what = format!("{op} n={n}");
            let inputs: Vec<Vec<T>> = (0..K).map(|_| rng.vec::<T>(n, op)).collect();
            let mut want = inputs[0].clone();
            for input in &inputs[1..] {
                for (w, &x) in want.iter_mut().zip(input) {
                    *w = ref_op(*w, x, op);
                }
            }

            // In place, step by step.
            let mut acc = inputs[0].clone();
            for input in &inputs[1..] {
                reduce(&mut acc, input, op).unwrap();
            }
            assert_same(&acc, &want, &format!("reduce {what}"));

            // Out of place for the first step, in place for the rest.
            let mut acc2 = vec![T::zeroed(); n];
            reduce_into(&mut acc2, &inputs[0], &inputs[1], op).unwrap();
            for input in &inputs[2..] {
                reduce(&mut acc2, input, op).unwrap();
            }
            assert_same(&acc2, &want, &format!("reduce_into {what}"));

            if op == ReduceOp::Avg {
                finish_avg(&mut acc, K);
                for w in &mut want {
                    *w = ref_div(*w, K);
                }
                assert_same(&acc, &want, &format!("finish_avg {what}"));
            }

            // The crate's own scalar reference agrees element by element.
            for i in 0..n {
                let column: Vec<T> = inputs.iter().map(|v| v[i]).collect();
                let r = reference_reduce(&column, op);
                assert!(
                    same(r, want[i]),
                    "reference_reduce {what} i={i}: {r:?} vs {:?}",
                    want[i]
                );
            }
        }
    }
}

#[test]
fn every_dtype_op_and_length_matches_reference() {
    each_type!(all_ops_all_lengths());
}

fn finish_avg_matches_reference<T: Element>() {
    let mut rng = Rng::new(7);
    for n in [1, 2, 3, 7, 100, 127, 128, 200, 255, 256, 300, 1 << 20] {
        let data = rng.vec::<T>(1001, ReduceOp::Sum);
        let mut got = data.clone();
        finish_avg(&mut got, n);
        let want: Vec<T> = data.iter().map(|&x| ref_div(x, n)).collect();
        assert_same(&got, &want, &format!("finish_avg n={n}"));
        for (&x, &g) in data.iter().zip(&got).take(20) {
            assert!(same(reference_reduce(&[x], ReduceOp::Avg), ref_div(x, 1)));
            assert!(same(g, ref_div(x, n)));
        }
    }
}

#[test]
fn finish_avg_every_dtype() {
    each_type!(finish_avg_matches_reference());
}

#[test]
fn integer_semantics() {
    let mut a = [i8::MAX, i8::MIN, -7, 7];
    reduce(&mut a, &[1, -1, 0, 0], ReduceOp::Sum).unwrap();
    assert_eq!(a, [i8::MIN, i8::MAX, -7, 7]);
    let mut p = [200u8, 16, 3];
    reduce(&mut p, &[2, 16, 5], ReduceOp::Prod).unwrap();
    assert_eq!(p, [144, 0, 15]);
    let mut m = [-5i64, 5];
    reduce(&mut m, &[3, 3], ReduceOp::Min).unwrap();
    assert_eq!(m, [-5, 3]);
    // Truncating division, towards zero, also for n beyond the type's range.
    let mut v = [-7i32, 7, -1, i32::MIN];
    finish_avg(&mut v, 2);
    assert_eq!(v, [-3, 3, 0, i32::MIN / 2]);
    let mut s = [-128i8, 127, -127];
    finish_avg(&mut s, 128);
    assert_eq!(s, [-1, 0, 0]);
    let mut u = [255u8, 7];
    finish_avg(&mut u, 300);
    assert_eq!(u, [0, 0]);
    assert_eq!(reference_reduce(&[250u8, 10, 3], ReduceOp::Sum), 7);
    assert_eq!(reference_reduce(&[1i32, 2, 4], ReduceOp::Avg), 2);
}

#[test]
fn half_types_round_after_each_step() {
    // 2048 + 1 is not representable in f16 (spacing 2): each step rounds to even.
    let mut a = [f16::from_f32(2048.0)];
    reduce(&mut a, &[f16::ONE], ReduceOp::Sum).unwrap();
    assert_eq!(a[0].to_f32(), 2048.0);
    let vals = [f16::from_f32(2048.0), f16::ONE, f16::ONE];
    assert_eq!(reference_reduce(&vals, ReduceOp::Sum).to_f32(), 2048.0);
    let mut b = [bf16::from_f32(256.0)];
    reduce(&mut b, &[bf16::from_f32(1.0)], ReduceOp::Sum).unwrap();
    assert_eq!(b[0].to_f32(), 256.0);
    let mut c = [bf16::from_f32(3.0)];
    finish_avg(&mut c, 2);
    assert_eq!(c[0].to_f32(), 1.5);
}

fn nan_propagates<T: Element>() {
    let nan = T::from_f64(f64::NAN);
    assert!(nan.to_f64().is_nan(), "{}", T::DTYPE);
    let n = 100;
    let one = T::from_f64(1.0);
    for op in [ReduceOp::Min, ReduceOp::Max] {
        for pos in [0, 1, 17, 63, 64, 98, 99] {
            for nan_in_dst in [true, false] {
                let mut dst: Vec<T> = (0..n).map(|i| T::from_f64(i as f64 - 50.0)).collect();
                let mut src: Vec<T> = (0..n).map(|i| T::from_f64(50.0 - i as f64)).collect();
                if nan_in_dst {
                    dst[pos] = nan;
                } else {
                    src[pos] = nan;
                }
                let mut out = vec![one; n];
                reduce_into(&mut out, &dst, &src, op).unwrap();
                let mut out2 = vec![one; n];
                reduce_into(&mut out2, &src, &dst, op).unwrap();
                let mut swapped = src.clone();
                reduce(&mut swapped, &dst, op).unwrap();
                reduce(&mut dst, &src, op).unwrap();
                for (i, r) in [&dst, &out, &out2, &swapped].into_iter().enumerate() {
                    for (j, &x) in r.iter().enumerate() {
                        assert_eq!(
                            x.to_f64().is_nan(),
                            j == pos,
                            "{} {op} case {i} j={j}",
                            T::DTYPE
                        );
                    }
                }
                let mut col = vec![one, T::from_f64(-3.0), T::from_f64(5.0)];
                col.insert(pos % 4, nan);
                assert!(reference_reduce(&col, op).to_f64().is_nan());
            }
        }
        let mut both = vec![nan; 40];
        reduce(&mut both, &[nan; 40], op).unwrap();
        assert!(both.iter().all(|x| x.to_f64().is_nan()));
    }
}

#[test]
fn min_max_propagate_nan() {
    nan_propagates::<f32>();
    nan_propagates::<f64>();
    nan_propagates::<f16>();
    nan_propagates::<bf16>();
}

#[test]
fn typed_length_mismatch() {
    let mut d = [0.0f32; 4];
    assert_eq!(
        reduce(&mut d, &[1.0; 3], ReduceOp::Sum),
        Err(KernelError::LengthMismatch { dst: 4, src: 3 })
    );
    assert_eq!(
        reduce_into(&mut d, &[1.0; 4], &[1.0; 5], ReduceOp::Max),
        Err(KernelError::LengthMismatch { dst: 4, src: 5 })
    );
    assert_eq!(
        reduce_into(&mut d, &[1.0; 2], &[1.0; 4], ReduceOp::Max),
        Err(KernelError::LengthMismatch { dst: 4, src: 2 })
    );
    assert_eq!(d, [0.0; 4], "nothing written on error");
    assert!(KernelError::LengthMismatch { dst: 4, src: 3 }
        .to_string()
        .contains('4'));
}

#[test]
#[should_panic(expected = "zero contributors")]
fn finish_avg_zero_panics() {
    finish_avg(&mut [1u32, 2], 0);
}

#[test]
#[should_panic(expected = "at least one value")]
fn reference_reduce_empty_panics() {
    reference_reduce::<f32>(&[], ReduceOp::Sum);
}

#[test]
fn dtype_matches_host_type() {
    fn check<T: Element>() {
        assert_eq!(T::DTYPE.size(), size_of::<T>());
        assert!(same(
            T::from_f64(T::from_f64(3.0).to_f64()),
            T::from_f64(3.0)
        ));
    }
    each_type!(check());
    assert_eq!(<f16 as Element>::DTYPE, DType::F16);
}
