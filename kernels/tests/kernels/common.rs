//! Shared helpers: a deterministic RNG, an independent scalar reference and type dispatch.

use bytemuck::cast;
use half::{bf16, f16};
use oxccl_kernels::{DType, Element, ReduceOp};

/// Calls `$f::<T>($args)` for every element type.
macro_rules! each_type {
    ($f:ident($($a:expr),*)) => {{
        $f::<f32>($($a),*);
        $f::<f64>($($a),*);
        $f::<half::f16>($($a),*);
        $f::<half::bf16>($($a),*);
        $f::<i8>($($a),*);
        $f::<u8>($($a),*);
        $f::<i32>($($a),*);
        $f::<u32>($($a),*);
        $f::<i64>($($a),*);
        $f::<u64>($($a),*);
        $f::<oxccl_kernels::F8E4M3>($($a),*);
        $f::<oxccl_kernels::F8E5M2>($($a),*);
    }};
}

/// SplitMix64: small, deterministic, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[-r, r)`.
    pub fn sym(&mut self, r: f64) -> f64 {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * r
    }

    /// Test data for `op`: floats in `[-100, 100)` (`[-4, 4)` for products, to stay finite),
    /// integers over their full range (to exercise wrapping). Never NaN.
    pub fn vec<T: Element>(&mut self, n: usize, op: ReduceOp) -> Vec<T> {
        let range = if op == ReduceOp::Prod { 4.0 } else { 100.0 };
        (0..n)
            .map(|_| {
                if T::DTYPE.is_float() {
                    T::from_f64(self.sym(range))
                } else {
                    let bits = self.next_u64().to_ne_bytes();
                    bytemuck::pod_read_unaligned(&bits[..size_of::<T>()])
                }
            })
            .collect()
    }

    /// Random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

fn f32_op(x: f32, y: f32, op: ReduceOp) -> f32 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => x + y,
        ReduceOp::Prod => x * y,
        _ if x.is_nan() || y.is_nan() => f32::NAN,
        ReduceOp::Min => {
            if x < y {
                x
            } else {
                y
            }
        }
        ReduceOp::Max => {
            if x > y {
                x
            } else {
                y
            }
        }
    }
}

fn f64_op(x: f64, y: f64, op: ReduceOp) -> f64 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => x + y,
        ReduceOp::Prod => x * y,
        _ if x.is_nan() || y.is_nan() => f64::NAN,
        ReduceOp::Min => {
            if x < y {
                x
            } else {
                y
            }
        }
        ReduceOp::Max => {
            if x > y {
                x
            } else {
                y
            }
        }
    }
}

/// Independent scalar reference for one step `a op b` (`Avg` as `Sum`).
pub fn ref_op<T: Element>(a: T, b: T, op: ReduceOp) -> T {
    macro_rules! int {
        ($t:ty) => {{
            let (x, y): ($t, $t) = (cast(a), cast(b));
            cast(match op {
                ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => x.wrapping_add(y),
                ReduceOp::Prod => x.wrapping_mul(y),
                ReduceOp::Min => x.min(y),
                ReduceOp::Max => x.max(y),
            })
        }};
    }
    macro_rules! half {
        ($t:ty) => {{
            let (x, y): ($t, $t) = (cast(a), cast(b));
            cast(<$t>::from_f32(f32_op(x.to_f32(), y.to_f32(), op)))
        }};
    }
    // fp8 through the `float8` crate (CUDA's conversion algorithm), not oxccl's own.
    macro_rules! fp8 {
        ($t:ty) => {{
            let (x, y) = (<$t>::from_bits(cast(a)), <$t>::from_bits(cast(b)));
            cast(<$t>::from_f32(f32_op(x.to_f32(), y.to_f32(), op)).to_bits())
        }};
    }
    match T::DTYPE {
        DType::F32 => cast(f32_op(cast(a), cast(b), op)),
        DType::F8E4M3 => fp8!(float8::F8E4M3),
        DType::F8E5M2 => fp8!(float8::F8E5M2),
        DType::F64 => cast(f64_op(cast(a), cast(b), op)),
        DType::F16 => half!(f16),
        DType::BF16 => half!(bf16),
        DType::I8 => int!(i8),
        DType::U8 => int!(u8),
        DType::I32 => int!(i32),
        DType::U32 => int!(u32),
        DType::I64 => int!(i64),
        DType::U64 => int!(u64),
    }
}

/// Independent scalar reference for the `finish_avg` division.
pub fn ref_div<T: Element>(a: T, n: usize) -> T {
    macro_rules! int {
        ($t:ty) => {{
            let x: $t = cast(a);
            cast((i128::from(x) / n as i128) as $t)
        }};
    }
    match T::DTYPE {
        DType::F32 => cast(cast::<T, f32>(a) / n as f32),
        DType::F64 => cast(cast::<T, f64>(a) / n as f64),
        DType::F16 => cast(f16::from_f32(cast::<T, f16>(a).to_f32() / n as f32)),
        DType::BF16 => cast(bf16::from_f32(cast::<T, bf16>(a).to_f32() / n as f32)),
        DType::F8E4M3 => {
            let x = float8::F8E4M3::from_bits(cast(a)).to_f32() / n as f32;
            cast(float8::F8E4M3::from_f32(x).to_bits())
        }
        DType::F8E5M2 => {
            let x = float8::F8E5M2::from_bits(cast(a)).to_f32() / n as f32;
            cast(float8::F8E5M2::from_f32(x).to_bits())
        }
        DType::I8 => int!(i8),
        DType::U8 => int!(u8),
        DType::I32 => int!(i32),
        DType::U32 => int!(u32),
        DType::I64 => int!(i64),
        DType::U64 => int!(u64),
    }
}

/// Bit-identical, or both NaN (NaN payloads may legitimately differ).
pub fn same<T: Element>(a: T, b: T) -> bool {
    bytemuck::bytes_of(&a) == bytemuck::bytes_of(&b) || (a.to_f64().is_nan() && b.to_f64().is_nan())
}

/// Asserts `got` and `want` are element-wise [`same`].
pub fn assert_same<T: Element>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            same(g, w),
            "{what} ({}): element {i}: got {g:?}, want {w:?}",
            T::DTYPE
        );
    }
}

/// An 8-byte-aligned byte buffer of `len + 8` bytes, so that `&buf[off..off + len]` has a known
/// misalignment `off`.
pub struct Aligned(Vec<u64>);

impl Aligned {
    pub fn new(len: usize) -> Self {
        Aligned(vec![0; len.div_ceil(8) + 1])
    }

    pub fn at(&mut self, off: usize, len: usize) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.0)[off..off + len]
    }
}

/// Independent scalar reference for `scale`: `a * factor`, floats in `f32` (`f64` for `f64`)
/// and rounded back, integers by the whole factor modulo 2^bits (through `i128`).
pub fn ref_scale<T: Element>(a: T, factor: f64) -> T {
    macro_rules! int {
        ($t:ty) => {{
            let x: $t = cast(a);
            let k = (factor as i128).rem_euclid(1i128 << <$t>::BITS) as $t;
            cast(x.wrapping_mul(k))
        }};
    }
    let k = factor as f32;
    match T::DTYPE {
        DType::F32 => cast(cast::<T, f32>(a) * k),
        DType::F64 => cast(cast::<T, f64>(a) * factor),
        DType::F16 => cast(f16::from_f32(cast::<T, f16>(a).to_f32() * k)),
        DType::BF16 => cast(bf16::from_f32(cast::<T, bf16>(a).to_f32() * k)),
        DType::F8E4M3 => {
            let x = float8::F8E4M3::from_bits(cast(a)).to_f32() * k;
            cast(float8::F8E4M3::from_f32(x).to_bits())
        }
        DType::F8E5M2 => {
            let x = float8::F8E5M2::from_bits(cast(a)).to_f32() * k;
            cast(float8::F8E5M2::from_f32(x).to_bits())
        }
        DType::I8 => int!(i8),
        DType::U8 => int!(u8),
        DType::I32 => int!(i32),
        DType::U32 => int!(u32),
        DType::I64 => int!(i64),
        DType::U64 => int!(u64),
    }
}
