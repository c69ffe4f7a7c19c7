//! Typed host kernels: element-wise reduce, out-of-place reduce, average finishing, scaling (the
//! first step of a pre-multiplied sum) and the scalar reference.
//!
//! Every kernel dispatches on the [`ReduceOp`] once, then runs a branch-free zip loop over the
//! slices that LLVM auto-vectorizes. `f16` is widened to `f32` in stack blocks of
//! [`HALF_BLOCK`] elements with `half`'s slice converters (F16C where the CPU has it), reduced in
//! `f32`, and rounded back (round to nearest, ties to even); `bf16` the same way element by
//! element, with the branch-free conversions of `half16.rs`. The fp8 types are combined in `f32` and rounded back the same
//! way, saturating; their slice kernels look every result up in a 64 KiB table per (type, op)
//! built from that scalar operation.

use std::sync::OnceLock;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::element::sealed::Sealed;
use crate::fp8::{Fp8, F8E4M3, F8E5M2};
use crate::half16::{bf16_narrow, bf16_widen};
use crate::{DType, Element, Factor, KernelError, ReduceOp};

/// Elements per stack block when widening `f16` to `f32`.
const HALF_BLOCK: usize = 256;

/// Whether this CPU runs AVX2 (x86_64 only; checked once, then a cached load).
#[inline(always)]
fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Runs `$body` (a zip loop over the slices, inlined here) compiled for AVX2 where `$wide` and
/// the CPU has it, else for the baseline target (SSE2 on x86_64). The loops are element-wise, with no
/// reassociation and no fused operations, so both give the same bits; AVX2 doubles the width of
/// what LLVM vectorizes for data in cache (in memory both wait for DRAM alike).
macro_rules! dispatch_avx2 {
    ($wide:expr, $name:ident, <$($t:ident),*>, ($($arg:ident: $ty:ty),*), $body:block) => {{
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2")]
        fn $name<$($t: Copy),*>($($arg: $ty),*) $body
        #[cfg(target_arch = "x86_64")]
        #[allow(unsafe_code)]
        if $wide && avx2() {
            // SAFETY: the CPU supports AVX2 (checked just above at run time), the only
            // requirement of calling a function compiled with it.
            return unsafe { $name($($arg),*) };
        }
        $body
    }};
}

/// Slices shorter than this take the plain loop: the AVX2 build's call and vector set-up cost
/// more than they save on a few elements (a small message's reduction).
const WIDE_MIN: usize = 16;

/// `dst[i] = f(dst[i], src[i])` over the common length (in the AVX2 build where `wide`).
#[inline(always)]
fn binary<T: Copy>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T, wide: bool) {
    let wide = wide && dst.len() >= WIDE_MIN;
    dispatch_avx2!(wide, binary_avx2, <T>, (dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T), {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = f(*d, s);
        }
    })
}

/// `dst[i] = f(a[i], b[i])` over the common length (in the AVX2 build where `wide`).
#[inline(always)]
fn ternary<T: Copy>(dst: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T, wide: bool) {
    let wide = wide && dst.len() >= WIDE_MIN;
    dispatch_avx2!(wide, ternary_avx2, <T>, (dst: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T), {
        for (d, (&x, &y)) in dst.iter_mut().zip(a.iter().zip(b)) {
            *d = f(x, y);
        }
    })
}

/// `dst[i] = f(dst[i])`.
#[inline(always)]
fn unary<T: Copy>(dst: &mut [T], f: impl Fn(T) -> T) {
    dispatch_avx2!(true, unary_avx2, <T>, (dst: &mut [T], f: impl Fn(T) -> T), {
        for d in dst {
            *d = f(*d);
        }
    })
}

/// `dst[i] = f(src[i])` over the common length.
#[inline(always)]
fn map_into<T: Copy>(dst: &mut [T], src: &[T], f: impl Fn(T) -> T) {
    dispatch_avx2!(true, map_into_avx2, <T>, (dst: &mut [T], src: &[T], f: impl Fn(T) -> T), {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = f(s);
        }
    })
}

/// The four binary operations of a "native" arithmetic type (`f32`, `f64`, integers).
trait Arith: Copy {
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn min(self, o: Self) -> Self;
    fn max(self, o: Self) -> Self;
}

macro_rules! float_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self * o
            }
            /// NaN-propagating minimum written as two selects so that it vectorizes:
            /// `self` NaN -> `self`; `o` NaN -> `self < o` is false -> `o`.
            #[inline(always)]
            fn min(self, o: Self) -> Self {
                let m = if self < o { self } else { o };
                if self.is_nan() { self } else { m }
            }
            /// NaN-propagating maximum, mirror of `min`.
            #[inline(always)]
            fn max(self, o: Self) -> Self {
                let m = if self > o { self } else { o };
                if self.is_nan() { self } else { m }
            }
        }
    )*};
}

float_arith!(f32, f64);

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            #[inline(always)]
            fn min(self, o: Self) -> Self {
                Ord::min(self, o)
            }
            #[inline(always)]
            fn max(self, o: Self) -> Self {
                Ord::max(self, o)
            }
        }
    )*};
}

int_arith!(i8, u8, i32, u32, i64, u64);

/// Dispatch on `op` once: binds `$f` to the op's scalar function on `$t` and `$wide` to whether
/// its loops take the AVX2 build (sums and products; the NaN-propagating selects of `min` and
/// `max` came out 2-4x slower there than in the baseline build, 1 MiB in cache), and evaluates
/// `$body` (which is monomorphised per op, so the inner loop has no branch on the op).
macro_rules! with_op {
    ($t:ty, $op:expr, |$f:ident, $wide:ident| $body:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => {
                let ($f, $wide) = (<$t as Arith>::add, true);
                $body
            }
            ReduceOp::Prod => {
                let ($f, $wide) = (<$t as Arith>::mul, true);
                $body
            }
            ReduceOp::Min => {
                let ($f, $wide) = (<$t as Arith>::min, false);
                $body
            }
            ReduceOp::Max => {
                let ($f, $wide) = (<$t as Arith>::max, false);
                $body
            }
        }
    };
}

macro_rules! native_common {
    ($t:ty) => {
        #[inline]
        fn reduce_slice(dst: &mut [$t], src: &[$t], op: ReduceOp) {
            with_op!($t, op, |f, w| binary(dst, src, f, w))
        }
        #[inline]
        fn reduce_into_slice(dst: &mut [$t], a: &[$t], b: &[$t], op: ReduceOp) {
            with_op!($t, op, |f, w| ternary(dst, a, b, f, w))
        }
        #[inline]
        fn scalar_op(a: $t, b: $t, op: ReduceOp) -> $t {
            with_op!($t, op, |f, _w| f(a, b))
        }
    };
}

macro_rules! float_sealed {
    ($($t:ty),*) => {$(
        impl Sealed for $t {
            native_common!($t);
            #[inline]
            fn div_slice(dst: &mut [$t], n: usize) {
                let d = n as $t;
                unary(dst, |x| x / d);
            }
            #[inline]
            fn scalar_div(a: $t, n: usize) -> $t {
                a / n as $t
            }
            #[inline]
            fn scale_slice(dst: &mut [$t], factor: f64) {
                let k = factor as $t;
                unary(dst, |x| x * k);
            }
            #[inline]
            fn scale_into_slice(dst: &mut [$t], src: &[$t], factor: f64) {
                let k = factor as $t;
                map_into(dst, src, |x| x * k);
            }
            #[inline]
            fn scalar_scale(a: $t, factor: f64) -> $t {
                a * factor as $t
            }
        }
    )*};
}

float_sealed!(f32, f64);

/// A whole `factor` (checked by [`check_factor`]) modulo 2^64; cast to a narrower integer it is
/// the factor modulo 2^bits, so a wrapping multiplication by it equals one by the factor.
#[inline]
pub(crate) fn int_factor(factor: f64) -> u64 {
    if factor >= 0.0 {
        factor as u64
    } else {
        factor as i64 as u64
    }
}

macro_rules! int_sealed {
    ($($t:ty),*) => {$(
        impl Sealed for $t {
            native_common!($t);
            #[inline]
            fn div_slice(dst: &mut [$t], n: usize) {
                match <$t>::try_from(n) {
                    // n >= 1, so neither division by zero nor MIN / -1 can occur.
                    Ok(d) => unary(dst, |x| x / d),
                    Err(_) => unary(dst, |x| Self::scalar_div(x, n)),
                }
            }
            #[inline]
            fn scalar_div(a: $t, n: usize) -> $t {
                // Exact truncating division in i128; |a / n| <= |a| always fits back.
                (a as i128 / n as i128) as $t
            }
            #[inline]
            fn scale_slice(dst: &mut [$t], factor: f64) {
                let k = int_factor(factor) as $t;
                unary(dst, |x| x.wrapping_mul(k));
            }
            #[inline]
            fn scale_into_slice(dst: &mut [$t], src: &[$t], factor: f64) {
                let k = int_factor(factor) as $t;
                map_into(dst, src, |x| x.wrapping_mul(k));
            }
            #[inline]
            fn scalar_scale(a: $t, factor: f64) -> $t {
                a.wrapping_mul(int_factor(factor) as $t)
            }
        }
    )*};
}

int_sealed!(i8, u8, i32, u32, i64, u64);

/// Widen `dst` and `src` block by block to `f32`, apply `f`, and round the result back into
/// `dst`.
#[inline(always)]
fn half_binary<H>(dst: &mut [H], src: &[H], f: impl Fn(&mut [f32], &[f32]))
where
    [H]: HalfFloatSliceExt,
{
    let mut fa = [0f32; HALF_BLOCK];
    let mut fb = [0f32; HALF_BLOCK];
    for (dc, sc) in dst.chunks_mut(HALF_BLOCK).zip(src.chunks(HALF_BLOCK)) {
        let (fa, fb) = (&mut fa[..dc.len()], &mut fb[..dc.len()]);
        dc.convert_to_f32_slice(fa);
        sc.convert_to_f32_slice(fb);
        f(fa, fb);
        dc.convert_from_f32_slice(fa);
    }
}

/// Out-of-place form of [`half_binary`]: `dst = round(f(widen(a), widen(b)))`.
#[inline(always)]
fn half_ternary<H>(dst: &mut [H], a: &[H], b: &[H], f: impl Fn(&mut [f32], &[f32]))
where
    [H]: HalfFloatSliceExt,
{
    let mut fa = [0f32; HALF_BLOCK];
    let mut fb = [0f32; HALF_BLOCK];
    let blocks = dst
        .chunks_mut(HALF_BLOCK)
        .zip(a.chunks(HALF_BLOCK).zip(b.chunks(HALF_BLOCK)));
    for (dc, (ac, bc)) in blocks {
        let (fa, fb) = (&mut fa[..dc.len()], &mut fb[..dc.len()]);
        ac.convert_to_f32_slice(fa);
        bc.convert_to_f32_slice(fb);
        f(fa, fb);
        dc.convert_from_f32_slice(fa);
    }
}

macro_rules! half_sealed {
    ($($t:ty),*) => {$(
        impl Sealed for $t {
            #[inline]
            fn reduce_slice(dst: &mut [$t], src: &[$t], op: ReduceOp) {
                with_op!(f32, op, |f, w| half_binary(dst, src, |x, y| binary(x, y, f, w)))
            }
            #[inline]
            fn reduce_into_slice(dst: &mut [$t], a: &[$t], b: &[$t], op: ReduceOp) {
                with_op!(f32, op, |f, w| half_ternary(dst, a, b, |x, y| binary(x, y, f, w)))
            }
            #[inline]
            fn div_slice(dst: &mut [$t], n: usize) {
                let d = n as f32;
                let mut buf = [0f32; HALF_BLOCK];
                for dc in dst.chunks_mut(HALF_BLOCK) {
                    let buf = &mut buf[..dc.len()];
                    dc.convert_to_f32_slice(buf);
                    unary(buf, |x| x / d);
                    dc.convert_from_f32_slice(buf);
                }
            }
            #[inline]
            fn scalar_op(a: $t, b: $t, op: ReduceOp) -> $t {
                <$t>::from_f32(with_op!(f32, op, |f, _w| f(a.to_f32(), b.to_f32())))
            }
            #[inline]
            fn scalar_div(a: $t, n: usize) -> $t {
                <$t>::from_f32(a.to_f32() / n as f32)
            }
            #[inline]
            fn scale_slice(dst: &mut [$t], factor: f64) {
                let k = factor as f32;
                let mut buf = [0f32; HALF_BLOCK];
                for dc in dst.chunks_mut(HALF_BLOCK) {
                    let buf = &mut buf[..dc.len()];
                    dc.convert_to_f32_slice(buf);
                    unary(buf, |x| x * k);
                    dc.convert_from_f32_slice(buf);
                }
            }
            #[inline]
            fn scale_into_slice(dst: &mut [$t], src: &[$t], factor: f64) {
                let k = factor as f32;
                let mut buf = [0f32; HALF_BLOCK];
                for (dc, sc) in dst.chunks_mut(HALF_BLOCK).zip(src.chunks(HALF_BLOCK)) {
                    let buf = &mut buf[..dc.len()];
                    sc.convert_to_f32_slice(buf);
                    unary(buf, |x| x * k);
                    dc.convert_from_f32_slice(buf);
                }
            }
            #[inline]
            fn scalar_scale(a: $t, factor: f64) -> $t {
                <$t>::from_f32(a.to_f32() * factor as f32)
            }
        }
    )*};
}

half_sealed!(f16);

/// `dst[i] = f(a[i], b[i])` over the common length (the out-of-place loop).
#[inline(always)]
fn ternary_map<T: Copy, U: Copy>(
    dst: &mut [T],
    a: &[U],
    b: &[U],
    f: impl Fn(U, U) -> T,
    wide: bool,
) {
    dispatch_avx2!(wide, ternary_map_avx2, <T, U>, (dst: &mut [T], a: &[U], b: &[U], f: impl Fn(U, U) -> T), {
        for (d, (&x, &y)) in dst.iter_mut().zip(a.iter().zip(b)) {
            *d = f(x, y);
        }
    })
}

/// The methods that narrow types computed in `f32` share: `div_slice`, `scalar_op` and
/// `scalar_div` through the type's `$widen: T -> f32` and `$narrow: f32 -> T`.
macro_rules! widened_ops {
    ($t:ty, $widen:expr, $narrow:expr) => {
        #[inline]
        fn div_slice(dst: &mut [$t], n: usize) {
            let d = n as f32;
            unary(dst, |x| $narrow($widen(x) / d));
        }
        #[inline]
        fn scalar_op(a: $t, b: $t, op: ReduceOp) -> $t {
            $narrow(with_op!(f32, op, |f, _w| f($widen(a), $widen(b))))
        }
        #[inline]
        fn scalar_div(a: $t, n: usize) -> $t {
            $narrow($widen(a) / n as f32)
        }
        #[inline]
        fn scale_slice(dst: &mut [$t], factor: f64) {
            let k = factor as f32;
            unary(dst, |x| $narrow($widen(x) * k));
        }
        #[inline]
        fn scale_into_slice(dst: &mut [$t], src: &[$t], factor: f64) {
            let k = factor as f32;
            map_into(dst, src, |x| $narrow($widen(x) * k));
        }
        #[inline]
        fn scalar_scale(a: $t, factor: f64) -> $t {
            $narrow($widen(a) * factor as f32)
        }
    };
}

/// `bf16` runs element by element with the branch-free conversions of `half16.rs` (twice the
/// throughput of `half`'s slice converters for bf16, which have no hardware path on x86).
macro_rules! branch_free_sealed {
    ($($t:ty => $widen:ident, $narrow:ident);*) => {$(
        impl Sealed for $t {
            #[inline]
            fn reduce_slice(dst: &mut [$t], src: &[$t], op: ReduceOp) {
                with_op!(f32, op, |f, w| binary(dst, src, |x, y| $narrow(f($widen(x), $widen(y))), w))
            }
            #[inline]
            fn reduce_into_slice(dst: &mut [$t], a: &[$t], b: &[$t], op: ReduceOp) {
                with_op!(f32, op, |f, w| ternary_map(dst, a, b, |x, y| {
                    $narrow(f($widen(x), $widen(y)))
                }, w))
            }
            widened_ops!($t, $widen, $narrow);
        }
    )*};
}

branch_free_sealed!(bf16 => bf16_widen, bf16_narrow);

/// Every result of one fp8 binary operation, indexed by `a << 8 | b`: 64 KiB, built on first use
/// from the scalar operation (widen exactly, one `f32` operation, one rounding), so the slice
/// kernels are bit-identical to [`Sealed::scalar_op`] by construction. One lookup per element is
/// about three times faster on x86-64's baseline than the vectorized arithmetic (the widening,
/// rounding and saturation take some 30 instructions per element there).
type OpTable = [u8; 1 << 16];

fn fp8_op_table<H: Fp8 + Sealed>(op: ReduceOp) -> &'static OpTable {
    static TABLES: [[OnceLock<Box<OpTable>>; 4]; 2] = [const { [const { OnceLock::new() }; 4] }; 2];
    let k = match op {
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Min => 2,
        ReduceOp::Max => 3,
    };
    TABLES[H::KIND][k].get_or_init(|| {
        let mut t: Box<OpTable> = vec![0u8; 1 << 16]
            .into_boxed_slice()
            .try_into()
            .expect("the table has 2^16 entries");
        for (i, r) in t.iter_mut().enumerate() {
            let (a, b) = (H::from_bits((i >> 8) as u8), H::from_bits(i as u8));
            *r = H::scalar_op(a, b, op).to_bits();
        }
        t
    })
}

/// `dst[i] = table[a[i] << 8 | b[i]]`.
#[inline(always)]
fn table_ternary(t: &OpTable, dst: &mut [u8], a: &[u8], b: &[u8]) {
    for (d, (&x, &y)) in dst.iter_mut().zip(a.iter().zip(b)) {
        *d = t[usize::from(u16::from(x) << 8 | u16::from(y))];
    }
}

macro_rules! fp8_sealed {
    ($($t:ty),*) => {$(
        impl Sealed for $t {
            #[inline]
            fn reduce_slice(dst: &mut [$t], src: &[$t], op: ReduceOp) {
                let t = fp8_op_table::<$t>(op);
                let src: &[u8] = bytemuck::cast_slice(src);
                for (d, &y) in bytemuck::cast_slice_mut::<$t, u8>(dst).iter_mut().zip(src) {
                    *d = t[usize::from(u16::from(*d) << 8 | u16::from(y))];
                }
            }
            #[inline]
            fn reduce_into_slice(dst: &mut [$t], a: &[$t], b: &[$t], op: ReduceOp) {
                let t = fp8_op_table::<$t>(op);
                let (a, b) = (bytemuck::cast_slice(a), bytemuck::cast_slice(b));
                table_ternary(t, bytemuck::cast_slice_mut(dst), a, b);
            }
            widened_ops!($t, <$t as Fp8>::widen, <$t as Fp8>::narrow);
        }
    )*};
}

fp8_sealed!(F8E4M3, F8E5M2);

/// In place: `dst[i] = dst[i] (op) src[i]`.
///
/// [`ReduceOp::Avg`] behaves as [`ReduceOp::Sum`] here; divide afterwards with [`finish_avg`].
/// Integer `Sum`/`Prod` wrap on overflow; float `Min`/`Max` propagate NaN.
///
/// # Errors
///
/// [`KernelError::LengthMismatch`] (in elements) if `dst.len() != src.len()`.
pub fn reduce<T: Element>(dst: &mut [T], src: &[T], op: ReduceOp) -> Result<(), KernelError> {
    check_len(dst.len(), src.len())?;
    T::reduce_slice(dst, src, op);
    Ok(())
}

/// Out of place: `dst[i] = a[i] (op) b[i]`, so an algorithm can combine two inputs without
/// copying one of them into `dst` first. `Avg` behaves as `Sum`, as in [`reduce`].
///
/// # Errors
///
/// [`KernelError::LengthMismatch`] (in elements) if `a` or `b` is not as long as `dst`.
pub fn reduce_into<T: Element>(
    dst: &mut [T],
    a: &[T],
    b: &[T],
    op: ReduceOp,
) -> Result<(), KernelError> {
    check_len(dst.len(), a.len())?;
    check_len(dst.len(), b.len())?;
    T::reduce_into_slice(dst, a, b, op);
    Ok(())
}

/// Divide every element by `n`: the last step of [`ReduceOp::Avg`].
///
/// Floats compute `x / n` in `f64` for `f64` and in `f32` for `f32`, `f16`, `bf16` and the fp8
/// types (the narrow types are rounded back to nearest even). Integers use truncating division
/// (towards zero).
///
/// # Panics
///
/// If `n == 0`.
pub fn finish_avg<T: Element>(dst: &mut [T], n: usize) {
    assert!(n > 0, "finish_avg: cannot average over zero contributors");
    T::div_slice(dst, n);
}

/// Checks that `T` can multiply by `factor` ([`ReduceOp::PreMulSum`]): any factor for the float
/// types, a whole number from -2^63 up to 2^64 for the integers.
///
/// # Errors
///
/// [`KernelError::BadFactor`] otherwise.
pub fn check_factor(dtype: DType, factor: f64) -> Result<(), KernelError> {
    // 2^63 and 2^64 are exact in f64.
    const LOW: f64 = -9_223_372_036_854_775_808.0;
    const HIGH: f64 = 18_446_744_073_709_551_616.0;
    let whole = factor.fract() == 0.0 && (LOW..HIGH).contains(&factor);
    if dtype.is_float() || whole {
        Ok(())
    } else {
        Err(KernelError::BadFactor {
            dtype,
            factor: Factor::new(factor),
        })
    }
}

/// In place: `dst[i] = dst[i] * factor`, the step a rank applies to its own input before the
/// sum of a [`ReduceOp::PreMulSum`].
///
/// Floats multiply in `f64` for `f64` and in `f32` for the other float types (the factor
/// rounded to `f32`; the narrow types are widened and rounded back to nearest even, fp8
/// saturating), as the CUDA scale kernel does. Integers multiply by a whole factor, wrapping
/// (the factor taken modulo 2^bits, so `-1` negates and `2^bits + 3` multiplies by 3).
///
/// # Errors
///
/// [`KernelError::BadFactor`] for an integer type and a factor that is not a whole number from
/// -2^63 up to 2^64.
pub fn scale<T: Element>(dst: &mut [T], factor: f64) -> Result<(), KernelError> {
    check_factor(T::DTYPE, factor)?;
    T::scale_slice(dst, factor);
    Ok(())
}

/// Out of place: `dst[i] = src[i] * factor`, rounded as in [`scale`].
///
/// # Errors
///
/// [`KernelError::LengthMismatch`] (in elements) if `src` is not as long as `dst`;
/// [`KernelError::BadFactor`] as in [`scale`].
pub fn scale_into<T: Element>(dst: &mut [T], src: &[T], factor: f64) -> Result<(), KernelError> {
    check_len(dst.len(), src.len())?;
    check_factor(T::DTYPE, factor)?;
    T::scale_into_slice(dst, src, factor);
    Ok(())
}

/// Scalar reference: the reduction of `vals`, left to right, under `op`, rounded exactly as the
/// kernels round (`f16`/`bf16`/fp8 go through `f32` and are rounded after every step; integers
/// wrap).
///
/// For [`ReduceOp::Avg`] this is the full average: the sum of `vals` followed by the
/// [`finish_avg`] division by `vals.len()`. For [`ReduceOp::PreMulSum`] every value is first
/// multiplied by the one factor, as [`scale`] does (ranks with factors of their own: scale each
/// value, then reduce with [`ReduceOp::Sum`]).
///
/// # Panics
///
/// If `vals` is empty, or for a factor that [`scale`] refuses for `T`.
pub fn reference_reduce<T: Element>(vals: &[T], op: ReduceOp) -> T {
    let (&first, rest) = vals
        .split_first()
        .expect("reference_reduce: at least one value is required");
    let pre = |v: T| match op.factor() {
        Some(f) => {
            assert!(
                check_factor(T::DTYPE, f).is_ok(),
                "reference_reduce: {dt} values cannot be multiplied by {f}",
                dt = T::DTYPE
            );
            T::scalar_scale(v, f)
        }
        None => v,
    };
    let acc = rest
        .iter()
        .fold(pre(first), |acc, &v| T::scalar_op(acc, pre(v), op));
    match op {
        ReduceOp::Avg => T::scalar_div(acc, vals.len()),
        _ => acc,
    }
}

#[inline]
pub(crate) fn check_len(dst: usize, src: usize) -> Result<(), KernelError> {
    if dst == src {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch { dst, src })
    }
}
