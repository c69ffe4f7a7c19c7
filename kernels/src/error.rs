//! Error type shared by every kernel entry point.

/// Errors reported by the kernels and by dtype / op parsing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// Destination and source lengths differ (elements for the typed kernels, bytes for the
    /// `*_bytes` kernels).
    #[error("length mismatch: destination has length {dst} but source has length {src}")]
    LengthMismatch {
        /// Length of the destination.
        dst: usize,
        /// Length of the offending source.
        src: usize,
    },
    /// A byte buffer's length is not a whole number of elements.
    #[error("byte length {bytes} is not a multiple of the element size {elem}")]
    NotMultiple {
        /// Length of the byte buffer.
        bytes: usize,
        /// Element size in bytes.
        elem: usize,
    },
    /// A string did not name a known data type.
    #[error(
        "unknown data type {0:?} (expected one of float, double, half, bfloat16, int8, uint8, \
         int32, uint32, int64, uint64, f8e4m3, f8e5m2 or f32, f64, f16, bf16, i8, u8, i32, u32, \
         i64, u64)"
    )]
    UnknownDType(String),
    /// A string did not name a known reduction operation.
    #[error("unknown reduction op {0:?} (expected one of sum, prod, min, max, avg, premul_sum)")]
    UnknownOp(String),
    /// `finish_avg_bytes` was asked to divide by zero contributors.
    #[error("cannot average over zero contributors")]
    ZeroCount,
    /// A multi-input kernel got no inputs or more than it takes.
    #[error("{0} inputs: a reduce kernel takes 1 to 8")]
    Inputs(usize),
    /// The operation does not exist for this data type.
    #[error("{what} is not defined for {dtype}")]
    Unsupported {
        /// The data type.
        dtype: crate::DType,
        /// The operation asked for.
        what: &'static str,
    },
    /// A [`ReduceOp::PreMulSum`](crate::ReduceOp::PreMulSum) factor that an integer type cannot
    /// multiply by.
    #[error(
        "premul_sum factor {factor} for {dtype}: integer types take a whole factor from -2^63 \
         up to 2^64"
    )]
    BadFactor {
        /// The data type.
        dtype: crate::DType,
        /// The factor given.
        factor: crate::Factor,
    },
    /// A CUDA library (driver or NVRTC) or device is missing: CUDA paths cannot run here.
    #[error("CUDA unavailable: {0}")]
    CudaUnavailable(String),
    /// A CUDA call failed (compile log or driver error).
    #[error("CUDA error: {0}")]
    Cuda(String),
}
