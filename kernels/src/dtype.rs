//! Data types ([`DType`]) and reduction operations ([`ReduceOp`]): sizes, names, wire codes and
//! parsing.

use std::fmt;
use std::str::FromStr;

use crate::KernelError;

/// Element types understood by every kernel.
///
/// The wire code of each variant ([`DType::to_u8`]) is its position in [`DType::ALL`] and never
/// changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 binary32 (`f32`), named `float`.
    F32,
    /// IEEE 754 binary64 (`f64`), named `double`.
    F64,
    /// IEEE 754 binary16 ([`half::f16`]), named `half`.
    F16,
    /// bfloat16 ([`half::bf16`]), named `bfloat16`.
    BF16,
    /// Signed 8-bit integer, named `int8`.
    I8,
    /// Unsigned 8-bit integer, named `uint8`.
    U8,
    /// Signed 32-bit integer, named `int32`.
    I32,
    /// Unsigned 32-bit integer, named `uint32`.
    U32,
    /// Signed 64-bit integer, named `int64`.
    I64,
    /// Unsigned 64-bit integer, named `uint64`.
    U64,
    /// 8-bit float, 4 exponent and 3 mantissa bits, no infinities ([`F8E4M3`](crate::F8E4M3),
    /// `torch.float8_e4m3fn`), named `f8e4m3`.
    F8E4M3,
    /// 8-bit float, 5 exponent and 2 mantissa bits ([`F8E5M2`](crate::F8E5M2),
    /// `torch.float8_e5m2`), named `f8e5m2`.
    F8E5M2,
}

impl DType {
    /// Every data type, in wire-code order.
    pub const ALL: [DType; 12] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::U32,
        DType::I64,
        DType::U64,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// The nccl-tests style name: `float`, `double`, `half`, `bfloat16`, `int8`, `uint8`,
    /// `int32`, `uint32`, `int64`, `uint64`, `f8e4m3`, `f8e5m2`.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "float",
            DType::F64 => "double",
            DType::F16 => "half",
            DType::BF16 => "bfloat16",
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::U32 => "uint32",
            DType::I64 => "int64",
            DType::U64 => "uint64",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
        }
    }

    /// The short Rust-style name: `f32`, `f64`, `f16`, `bf16`, `i8`, `u8`, `i32`, `u32`,
    /// `i64`, `u64`, `f8e4m3`, `f8e5m2`.
    pub const fn short_name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U64 => "u64",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
        }
    }

    /// Whether this is a floating-point type (`F32`, `F64`, `F16`, `BF16`, `F8E4M3`, `F8E5M2`).
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F32 | DType::F64 | DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2
        )
    }

    /// Stable wire code, `0..=11` (the position in [`DType::ALL`]).
    pub fn to_u8(self) -> u8 {
        self as u8
    }

    /// Inverse of [`DType::to_u8`]; `None` for codes above 11.
    pub fn from_u8(v: u8) -> Option<DType> {
        DType::ALL.get(usize::from(v)).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = KernelError;

    /// Accepts [`DType::name`], [`DType::short_name`] and the aliases `float16`, `float32`,
    /// `float64`, `fp16`, `fp32`, `fp64`, `float8_e4m3fn`, `fp8_e4m3`, `e4m3`, `float8_e5m2`,
    /// `fp8_e5m2`, `e5m2` (torch's and Transformer Engine's spellings), ignoring ASCII case and
    /// surrounding whitespace.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        let found = DType::ALL
            .into_iter()
            .find(|d| d.name() == lower || d.short_name() == lower);
        found
            .or(match lower.as_str() {
                "float16" | "fp16" => Some(DType::F16),
                "float32" | "fp32" => Some(DType::F32),
                "float64" | "fp64" => Some(DType::F64),
                "float8_e4m3fn" | "float8_e4m3" | "fp8_e4m3" | "e4m3" => Some(DType::F8E4M3),
                "float8_e5m2" | "fp8_e5m2" | "e5m2" => Some(DType::F8E5M2),
                _ => None,
            })
            .ok_or_else(|| KernelError::UnknownDType(s.to_owned()))
    }
}

/// The factor of a [`ReduceOp::PreMulSum`]: an `f64`, kept as its bits so that operations
/// compare and hash exactly (two factors are equal when their bits are).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Factor(u64);

impl Factor {
    /// The factor `v`.
    pub const fn new(v: f64) -> Factor {
        Factor(v.to_bits())
    }

    /// Its value.
    pub const fn get(self) -> f64 {
        f64::from_bits(self.0)
    }
}

impl From<f64> for Factor {
    fn from(v: f64) -> Factor {
        Factor::new(v)
    }
}

impl fmt::Debug for Factor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.get(), f)
    }
}

impl fmt::Display for Factor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.get(), f)
    }
}

/// Reduction operations.
///
/// The wire code of each variant ([`ReduceOp::to_u8`]) is its position in [`ReduceOp::ALL`], and
/// 5 for [`ReduceOp::PreMulSum`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (wrapping for integers).
    Sum,
    /// Product (wrapping for integers).
    Prod,
    /// Minimum (NaN propagates for floats).
    Min,
    /// Maximum (NaN propagates for floats).
    Max,
    /// Average: reduced as [`ReduceOp::Sum`], then divided by the contributor count with
    /// [`finish_avg`](crate::finish_avg).
    Avg,
    /// Pre-multiplied sum (NCCL's `ncclRedOpCreatePreMulSum`, torch's `PREMUL_SUM`): every rank
    /// multiplies its own input by its own factor, then the products are summed, so the result
    /// is `sum over r of factor_r * x_r` (a gradient pre-divided by the world size, or weighted
    /// by each rank's share of the batch). Ranks may pass different factors; they must agree on
    /// the operation only. Make one with [`ReduceOp::premul_sum`].
    ///
    /// The multiplication is [`scale`](crate::scale): floats in `f32` (`f64` for `f64`) and
    /// rounded back, integers by a whole factor, wrapping. A factor the data type refuses
    /// ([`check_factor`](crate::check_factor)) fails the call on its rank before anything is
    /// sent; the other ranks then wait for it as for any call one rank leaves out. The reduce
    /// kernels of this crate treat the operation as [`ReduceOp::Sum`]; scale each input first.
    PreMulSum(Factor),
}

impl ReduceOp {
    /// Every operation without a parameter, in wire-code order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ];

    /// Wire code of [`ReduceOp::PreMulSum`] (the factor is local to each rank, never sent).
    const PREMUL_SUM_CODE: u8 = 5;

    /// A pre-multiplied sum with this rank's `factor` ([`ReduceOp::PreMulSum`]).
    ///
    /// ```
    /// use oxccl_kernels::ReduceOp;
    /// let op = ReduceOp::premul_sum(0.25);
    /// assert_eq!(op.factor(), Some(0.25));
    /// assert_eq!(op.name(), "premul_sum");
    /// ```
    pub const fn premul_sum(factor: f64) -> ReduceOp {
        ReduceOp::PreMulSum(Factor::new(factor))
    }

    /// The factor of a [`ReduceOp::PreMulSum`]; `None` for the other operations.
    pub const fn factor(self) -> Option<f64> {
        match self {
            ReduceOp::PreMulSum(f) => Some(f.get()),
            _ => None,
        }
    }

    /// Lower-case name: `sum`, `prod`, `min`, `max`, `avg`, `premul_sum`.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::PreMulSum(_) => "premul_sum",
        }
    }

    /// Stable wire code, `0..=5`: the position in [`ReduceOp::ALL`], 5 for
    /// [`ReduceOp::PreMulSum`] (without its factor).
    pub fn to_u8(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Prod => 1,
            ReduceOp::Min => 2,
            ReduceOp::Max => 3,
            ReduceOp::Avg => 4,
            ReduceOp::PreMulSum(_) => Self::PREMUL_SUM_CODE,
        }
    }

    /// Inverse of [`ReduceOp::to_u8`]; `None` for codes above 5. Code 5 gives a
    /// [`ReduceOp::PreMulSum`] with factor 1 (the wire does not carry the factor).
    pub fn from_u8(v: u8) -> Option<ReduceOp> {
        if v == Self::PREMUL_SUM_CODE {
            return Some(ReduceOp::premul_sum(1.0));
        }
        ReduceOp::ALL.get(usize::from(v)).copied()
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = KernelError;

    /// Accepts [`ReduceOp::name`], ignoring ASCII case and surrounding whitespace; `premul_sum`
    /// (also `premulsum` and nccl-tests' `mulsum`) gives factor 1: set the factor with
    /// [`ReduceOp::premul_sum`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        if matches!(lower.as_str(), "premul_sum" | "premulsum" | "mulsum") {
            return Ok(ReduceOp::premul_sum(1.0));
        }
        ReduceOp::ALL
            .into_iter()
            .find(|o| o.name() == lower)
            .ok_or_else(|| KernelError::UnknownOp(s.to_owned()))
    }
}
