//! The [`Element`] trait: host element types and their per-type kernels.

use half::{bf16, f16};

use crate::fp8::{F8E4M3, F8E5M2};
use crate::DType;

pub(crate) mod sealed {
    use crate::ReduceOp;

    /// Per-type kernels behind [`Element`](super::Element). Not nameable outside the crate, so
    /// `Element` cannot be implemented elsewhere.
    pub trait Sealed: Copy + Sized {
        /// `dst[i] = dst[i] op src[i]`; lengths already checked equal. `Avg` acts as `Sum`.
        fn reduce_slice(dst: &mut [Self], src: &[Self], op: ReduceOp);
        /// `dst[i] = a[i] op b[i]`; lengths already checked equal. `Avg` acts as `Sum`.
        fn reduce_into_slice(dst: &mut [Self], a: &[Self], b: &[Self], op: ReduceOp);
        /// `dst[i] /= n`; `n > 0` already checked.
        fn div_slice(dst: &mut [Self], n: usize);
        /// Scalar `a op b`, rounded exactly as the slice kernels round. `Avg` acts as `Sum`.
        fn scalar_op(a: Self, b: Self, op: ReduceOp) -> Self;
        /// Scalar `a / n`, rounded exactly as [`Sealed::div_slice`] rounds.
        fn scalar_div(a: Self, n: usize) -> Self;
        /// `dst[i] *= factor`; the factor is already checked for the type.
        fn scale_slice(dst: &mut [Self], factor: f64);
        /// `dst[i] = src[i] * factor`; lengths already checked equal, the factor for the type.
        fn scale_into_slice(dst: &mut [Self], src: &[Self], factor: f64);
        /// Scalar `a * factor`, rounded exactly as [`Sealed::scale_slice`] rounds.
        fn scalar_scale(a: Self, factor: f64) -> Self;
    }
}

/// Host element types: `f32`, `f64`, [`half::f16`], [`half::bf16`], `i8`, `u8`, `i32`, `u32`,
/// `i64`, `u64`, [`F8E4M3`], [`F8E5M2`].
///
/// The trait is sealed: the kernels are specialised per type, so it cannot be implemented outside
/// this crate.
pub trait Element:
    sealed::Sealed + bytemuck::Pod + Send + Sync + std::fmt::Debug + PartialEq + 'static
{
    /// The [`DType`] this type stands for.
    const DTYPE: DType;
    /// Lossy conversion used by tests and benchmarks to fill and check buffers (`as` semantics:
    /// integers saturate, NaN becomes 0, floats round to nearest; fp8 saturates to its largest
    /// finite value).
    fn from_f64(v: f64) -> Self;
    /// Conversion to `f64` (exact for every type except 64-bit integers above 2^53).
    fn to_f64(self) -> f64;
}

macro_rules! prim_element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    )*};
}

prim_element!(
    f32 => F32, f64 => F64, i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64,
);

/// The 16- and 8-bit floats convert through their own `from_f64` / `to_f64`.
macro_rules! float_element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            #[inline]
            fn from_f64(v: f64) -> Self {
                <$t>::from_f64(v)
            }
            #[inline]
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
        }
    )*};
}

float_element!(f16 => F16, bf16 => BF16, F8E4M3 => F8E4M3, F8E5M2 => F8E5M2);
