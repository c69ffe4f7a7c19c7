//! Element-wise reduction kernels for oxccl, on the host.
//!
//! Every collective in oxccl ends up combining buffers element by element; this crate holds
//! those kernels for every ([`DType`], [`ReduceOp`]) pair, in a typed form ([`reduce`],
//! [`reduce_into`], [`finish_avg`], [`scale`], [`scale_into`]) and in a byte form for transports
//! that move untyped buffers ([`reduce_bytes`], [`reduce_into_bytes`], [`finish_avg_bytes`],
//! [`scale_bytes`], [`scale_into_bytes`]), plus [`copy_streaming`], a copy with non-temporal
//! stores for destinations larger than the caches.
//!
//! # Quick start
//!
//! ```
//! use oxccl_kernels::{finish_avg, reduce, reduce_bytes, DType, ReduceOp};
//!
//! // Typed: dst = dst + src.
//! let mut dst = [1.0f32, 2.0, 3.0];
//! reduce(&mut dst, &[10.0, 20.0, 30.0], ReduceOp::Sum)?;
//! assert_eq!(dst, [11.0, 22.0, 33.0]);
//!
//! // Avg is Sum followed by one division by the number of contributors.
//! let mut acc = [2.0f64, 4.0];
//! reduce(&mut acc, &[4.0, 8.0], ReduceOp::Avg)?;
//! finish_avg(&mut acc, 2);
//! assert_eq!(acc, [3.0, 6.0]);
//!
//! // Bytes: the dtype is chosen at run time; the slices may be unaligned.
//! let dtype: DType = "int32".parse()?;
//! let mut d: Vec<u8> = [5i32, -7].iter().flat_map(|v| v.to_ne_bytes()).collect();
//! let s: Vec<u8> = [3i32, 2].iter().flat_map(|v| v.to_ne_bytes()).collect();
//! reduce_bytes(dtype, "max".parse()?, &mut d, &s)?;
//! assert_eq!(d[..4], 5i32.to_ne_bytes());
//! assert_eq!(d[4..], 2i32.to_ne_bytes());
//! # Ok::<(), oxccl_kernels::KernelError>(())
//! ```
//!
//! # Data types and operations
//!
//! | [`DType`] | host type | name | size |
//! |---|---|---|---|
//! | `F32` | `f32` | `float` | 4 |
//! | `F64` | `f64` | `double` | 8 |
//! | `F16` | [`half::f16`] | `half` | 2 |
//! | `BF16` | [`half::bf16`] | `bfloat16` | 2 |
//! | `I8` / `U8` | `i8` / `u8` | `int8` / `uint8` | 1 |
//! | `I32` / `U32` | `i32` / `u32` | `int32` / `uint32` | 4 |
//! | `I64` / `U64` | `i64` / `u64` | `int64` / `uint64` | 8 |
//! | `F8E4M3` | [`F8E4M3`] | `f8e4m3` | 1 |
//! | `F8E5M2` | [`F8E5M2`] | `f8e5m2` | 1 |
//!
//! Operations: [`ReduceOp::Sum`], [`ReduceOp::Prod`], [`ReduceOp::Min`], [`ReduceOp::Max`],
//! [`ReduceOp::Avg`], [`ReduceOp::PreMulSum`]. Both enums parse from their names
//! (case-insensitive; dtypes also accept `f32`, `bf16`, `i64`, ...) and have stable one-byte wire
//! codes.
//!
//! # Integer semantics
//!
//! Integer `Sum` and `Prod` use wrapping (two's complement, modulo 2^bits) arithmetic, like
//! [`i32::wrapping_add`] and [`i32::wrapping_mul`]: overflow never panics and the result does not
//! depend on the reduction order. `Min`/`Max` are the ordinary integer minimum and maximum.
//!
//! # Floating-point semantics
//!
//! `f32` and `f64` use plain IEEE `+` and `*` in their own precision. `f16` and `bf16` are
//! widened to `f32`, combined in `f32` and rounded back to nearest, ties to even, after each
//! step (each call of [`reduce`] is one step). The fp8 types ([`F8E4M3`], [`F8E5M2`]) are
//! combined in `f32` the same way and rounded back to nearest even, saturating at their largest
//! finite value (448 and 57344) as CUDA's `__NV_SATFINITE` conversions do, so an `F8E5M2`
//! reduction never produces an infinity it was not given (see [`F8E4M3`] for the formats).
//! Floating-point sums and products therefore depend on the reduction order, exactly as in NCCL.
//!
//! ## NaN behaviour of min/max
//!
//! Float `Min` and `Max` propagate NaN: if either input is NaN, the result is NaN (like
//! `torch.minimum` / `torch.maximum`, unlike [`f32::min`] which ignores NaN). A NaN anywhere in
//! the inputs therefore gives NaN whatever the reduction order. For two equal operands (such as
//! `-0.0` and `+0.0`) the second operand is returned.
//!
//! # Average
//!
//! [`ReduceOp::Avg`] is computed as a `Sum` reduction (every kernel treats `Avg` as `Sum`)
//! followed by one [`finish_avg`] call that divides by the number of contributors: in `f64` for
//! `f64`, in `f32` for `f32`/`f16`/`bf16`/fp8, and by truncating division for integers (after a
//! wrapping sum).
//!
//! # Pre-multiplied sum
//!
//! [`ReduceOp::PreMulSum`] carries a factor per rank: each rank multiplies its own input by it
//! ([`scale`]), then the products are summed (every reduce kernel treats it as `Sum`). Floats
//! multiply in `f32` (`f64` for `f64`) and round back like the other operations; integers take a
//! whole factor and wrap ([`check_factor`] says which factors a type takes).
//!
//! ```
//! use oxccl_kernels::{reduce, scale, ReduceOp};
//! // Two ranks pre-divide their gradients by the world size: 0.5 * 2 + 0.5 * 6.
//! let (mut a, mut b) = ([2.0f32], [6.0f32]);
//! scale(&mut a, 0.5)?;
//! scale(&mut b, 0.5)?;
//! reduce(&mut a, &b, ReduceOp::premul_sum(0.5))?;
//! assert_eq!(a, [4.0]);
//! # Ok::<(), oxccl_kernels::KernelError>(())
//! ```
//!
//! # Alignment
//!
//! The byte kernels reinterpret aligned buffers in place (the fast path). Buffers that are not
//! aligned for the element type are processed through aligned stack blocks instead, with
//! bit-identical results.

// Only `copy.rs` (streaming-store intrinsics) and the AVX2 dispatch of `host.rs` opt in (and
// `cuda`), with a SAFETY comment per block.
#![deny(unsafe_code)]

mod bytes;
mod copy;
#[cfg(feature = "cuda-core")]
#[allow(unsafe_code)]
pub mod cuda;
mod dtype;
mod element;
mod error;
mod fp8;
mod half16;
mod host;

pub use bytes::{finish_avg_bytes, reduce_bytes, reduce_into_bytes, scale_bytes, scale_into_bytes};
pub use copy::copy_streaming;
/// The 8-bit float types of [`DType::F8E4M3`] and [`DType::F8E5M2`].
pub use fp8::{F8E4M3, F8E5M2};
/// The 16-bit float types of [`DType::F16`] and [`DType::BF16`] (from the `half` crate).
pub use half::{bf16, f16};

/// Calls `$f::<T>(args)` with `T` the host type of a run-time [`DType`]: the one place that maps
/// dtypes to Rust types, for byte-level dispatch here and in callers (`oxccl perf`, tests).
///
/// ```
/// use oxccl_kernels::{with_dtype, DType, Element};
/// fn size_of<T: Element>() -> usize { std::mem::size_of::<T>() }
/// assert_eq!(with_dtype!(DType::BF16, size_of()), 2);
/// ```
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            $crate::DType::F32 => $f::<f32>($($arg),*),
            $crate::DType::F64 => $f::<f64>($($arg),*),
            $crate::DType::F16 => $f::<$crate::f16>($($arg),*),
            $crate::DType::BF16 => $f::<$crate::bf16>($($arg),*),
            $crate::DType::I8 => $f::<i8>($($arg),*),
            $crate::DType::U8 => $f::<u8>($($arg),*),
            $crate::DType::I32 => $f::<i32>($($arg),*),
            $crate::DType::U32 => $f::<u32>($($arg),*),
            $crate::DType::I64 => $f::<i64>($($arg),*),
            $crate::DType::U64 => $f::<u64>($($arg),*),
            $crate::DType::F8E4M3 => $f::<$crate::F8E4M3>($($arg),*),
            $crate::DType::F8E5M2 => $f::<$crate::F8E5M2>($($arg),*),
        }
    };
}
pub use dtype::{DType, Factor, ReduceOp};
pub use element::Element;
pub use error::KernelError;
pub use host::{
    check_factor, finish_avg, reduce, reduce_into, reference_reduce, scale, scale_into,
};
