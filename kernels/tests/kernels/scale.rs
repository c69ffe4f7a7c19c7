//! Scaling, the first step of a pre-multiplied sum: every type against an independent reference,
//! in place and out of place, typed and on unaligned bytes; the factors integers refuse; the
//! scalar reference of `PreMulSum`.

use oxccl_kernels::{
    check_factor, reduce, reference_reduce, scale, scale_bytes, scale_into, scale_into_bytes,
    DType, Element, Factor, KernelError, ReduceOp,
};

use crate::common::{assert_same, ref_op, ref_scale, Aligned, Rng};

/// More than one 256-element block of the unaligned path, plus a tail.
const N: usize = 300;

/// Factors every type takes (whole numbers, negative ones, and 2^32 + 3, which is 3 for the
/// 8- and 32-bit integers), and fractions for the floats.
fn factors(dt: DType) -> Vec<f64> {
    let mut f = vec![1.0, 2.0, -3.0, 0.0, 4_294_967_299.0];
    if dt.is_float() {
        f.extend([0.5, 0.125, -1.0 / 3.0, 1e-3, 7.25]);
    }
    f
}

fn scales_like_the_reference<T: Element>() {
    let dt = T::DTYPE;
    let mut rng = Rng::new(7 + u64::from(dt.to_u8()));
    let x = rng.vec::<T>(N, ReduceOp::Sum);
    let len = N * dt.size();
    let (mut db, mut sb) = (Aligned::new(len), Aligned::new(len));
    for f in factors(dt) {
        let want: Vec<T> = x.iter().map(|&v| ref_scale(v, f)).collect();
        let mut got = x.clone();
        scale(&mut got, f).unwrap();
        assert_same(&got, &want, &format!("scale by {f}"));
        let mut got = vec![T::zeroed(); N];
        scale_into(&mut got, &x, f).unwrap();
        assert_same(&got, &want, &format!("scale_into by {f}"));
        for doff in 0..8 {
            let d = db.at(doff, len);
            d.copy_from_slice(bytemuck::cast_slice(&x));
            scale_bytes(dt, d, f).unwrap();
            let got: Vec<T> = bytemuck::pod_collect_to_vec(d);
            assert_same(&got, &want, &format!("scale_bytes by {f} at +{doff}"));
            for soff in [0, 1, 3] {
                let s = sb.at(soff, len);
                s.copy_from_slice(bytemuck::cast_slice(&x));
                let d = db.at(doff, len);
                scale_into_bytes(dt, d, s, f).unwrap();
                let got: Vec<T> = bytemuck::pod_collect_to_vec(d);
                let what = format!("scale_into_bytes by {f} dst+{doff} src+{soff}");
                assert_same(&got, &want, &what);
            }
        }
    }
}

#[test]
fn every_type_scales_like_the_reference() {
    each_type!(scales_like_the_reference());
}

fn premul_reference_scales_then_sums<T: Element>() {
    let mut rng = Rng::new(11 + u64::from(T::DTYPE.to_u8()));
    let vals = rng.vec::<T>(5, ReduceOp::Sum);
    for f in factors(T::DTYPE) {
        let want = vals[1..].iter().fold(ref_scale(vals[0], f), |acc, &v| {
            ref_op(acc, ref_scale(v, f), ReduceOp::Sum)
        });
        let got = reference_reduce(&vals, ReduceOp::premul_sum(f));
        assert_same(&[got], &[want], &format!("premul_sum({f}) reference"));
    }
    // The reduce kernels combine a pre-multiplied sum as a sum.
    let (a, b) = (
        rng.vec::<T>(N, ReduceOp::Sum),
        rng.vec::<T>(N, ReduceOp::Sum),
    );
    let (mut sum, mut pre) = (a.clone(), a.clone());
    reduce(&mut sum, &b, ReduceOp::Sum).unwrap();
    reduce(&mut pre, &b, ReduceOp::premul_sum(3.0)).unwrap();
    assert_same(&pre, &sum, "reduce with premul_sum");
}

#[test]
fn premul_sum_reference_scales_every_value_then_sums() {
    each_type!(premul_reference_scales_then_sums());
}

#[test]
fn integers_refuse_factors_that_are_not_whole() {
    for dt in DType::ALL {
        for f in [
            0.5,
            -1.5,
            f64::NAN,
            f64::INFINITY,
            -1e19,
            18_446_744_073_709_551_616.0,
        ] {
            let r = check_factor(dt, f);
            if dt.is_float() {
                assert_eq!(r, Ok(()), "{dt} takes {f}");
            } else {
                let want = KernelError::BadFactor {
                    dtype: dt,
                    factor: Factor::new(f),
                };
                assert_eq!(r, Err(want), "{dt} refuses {f}");
            }
        }
        for f in [
            -9_223_372_036_854_775_808.0,
            18_446_744_073_709_549_568.0,
            -0.0,
        ] {
            assert_eq!(check_factor(dt, f), Ok(()), "{dt} takes {f}");
        }
    }
    let mut x = [1i32, 2, 3];
    let e = scale(&mut x, 0.5).unwrap_err();
    assert_eq!(x, [1, 2, 3], "a refused factor leaves the buffer alone");
    let msg = e.to_string();
    assert!(msg.contains("0.5") && msg.contains("int32"), "{msg}");
    let mut b = [0u8; 8];
    assert!(matches!(
        scale_bytes(DType::I64, &mut b, 2.5),
        Err(KernelError::BadFactor { .. })
    ));
    assert!(matches!(
        scale_bytes(DType::I64, &mut b[..7], 2.0),
        Err(KernelError::NotMultiple { .. })
    ));
    assert!(matches!(
        scale_into(&mut [0f32; 2], &[1.0; 3], 2.0),
        Err(KernelError::LengthMismatch { dst: 2, src: 3 })
    ));
}

#[test]
fn integer_factors_wrap_modulo_the_width() {
    let mut x = [3u8, 200, 255];
    scale(&mut x, -1.0).unwrap();
    assert_eq!(x, [253, 56, 1]);
    let mut y = [5i8, -7];
    scale(&mut y, 259.0).unwrap(); // 259 = 256 + 3
    assert_eq!(y, [15, -21]);
    let mut z = [3u64];
    scale(&mut z, 18_446_744_073_709_549_568.0).unwrap(); // 2^64 - 2048
    assert_eq!(z, [3u64.wrapping_mul(18_446_744_073_709_549_568)]);
}
