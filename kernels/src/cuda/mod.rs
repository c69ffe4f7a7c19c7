//! CUDA kernels (feature `cuda`): every reduction, copy and scaling of the host kernels, on
//! device buffers, compiled at run time by NVRTC for the device's architecture.
//!
//! The CUDA C lives in `kernels/cuda/oxccl_kernels.cu` (generic templates, no CUDA headers
//! needed). The `extern "C"` entry points are generated from [`table`] by [`source`], and the
//! Rust dispatch looks kernels up by the same names ([`reduce_kernel_name`], ...), so the two
//! cannot drift apart.
//!
//! | kernel | computes |
//! |---|---|
//! | `oxccl_reduce_<dtype>_<op>` | `dst = in[0] op in[1] op ... op in[k-1]`, `1 <= k <= 8`, left to right |
//! | `oxccl_div_<dtype>` | `dst = src / n` (the last step of `Avg`) |
//! | `oxccl_scale_<dtype>` | `dst = src * factor` (pre-multiplied sum; integers wrap) |
//! | `oxccl_cast_<src>_<dst>` ([`CAST_PAIRS`]) | `dst = (dst type)(src * factor)`, rounded to nearest even (compressed gradients on the wire) |
//! | `oxccl_adamw_f32`, `oxccl_sgd_f32` | one step of AdamW / SGD on f32 master weights, bit for bit the host's ([`AdamWScalars`], [`SgdScalars`]) |
//! | `oxccl_copy` | byte copy |
//! | `oxccl_ipc_barrier` | the barrier of device collectives over CUDA IPC (flags in device memory, system-scope release/acquire, a deadline) |
//! | `oxccl_ipc_p2p_wait`, `oxccl_ipc_p2p_post` | the flag waits and stores of device send/receive over CUDA IPC (one thread, system-scope release/acquire, a deadline) |
//! | `oxccl_wait_flag` | a stream's wait for a staged operation's host collective (a word of host memory, a deadline); a program of its own, [`FlagWait`] |
//!
//! Results are bit-identical to the host kernels for every integer type and for `f32`/`f64`
//! sums, products, minima and maxima of two inputs (the same IEEE operations in the same order);
//! `f16`/`bf16` are widened to `f32` and rounded back to nearest even after every step, as on the
//! host; so are the fp8 types, saturating at their largest finite value (`cvt.rn.satfinite` on
//! sm_89 and later, a software conversion before, checked against the host's on the host by
//! `kernels/tests/kernels/fp8.rs`). Only NaN payloads may differ. Every kernel is a grid-stride loop that moves 16-byte
//! vectors when all its pointers share an offset modulo 16, with the unaligned head and tail done
//! element by element (and every element one by one when the offsets differ).
//!
//! Without a driver, [`CudaKernels::new`] returns [`KernelError::CudaUnavailable`]; without
//! NVRTC, so do [`compile_ptx`] and [`CudaKernels::new`]. Nothing here panics for a missing
//! library (cudarc's dynamic loader would: presence is checked first).

// The files: `source` generates the CUDA C from `table`, `compile` has NVRTC compile it (and
// `cache` keeps its PTX on disk), `load` loads it as `CudaKernels`, whose launches are in
// `reduce` (reductions, averages, scaling), `copy` and `barrier`; `wait` is `FlagWait`. This one
// holds the constants, the availability probes, and the errors and checks the others share.

use std::sync::OnceLock;

use cudarc::driver::CudaContext;

use crate::{DType, KernelError, ReduceOp};

mod barrier;
mod cache;
mod cast;
mod compile;
mod copy;
mod load;
mod optim;
mod reduce;
mod source;
mod wait;

pub use compile::{compile_ptx, compile_ptx_parts, compile_wait_ptx};
pub use load::CudaKernels;
pub use optim::{AdamWScalars, SgdScalars};
pub use source::{
    cast_kernel_name, div_kernel_name, kernel_names, part_sources, reduce_kernel_name,
    scale_kernel_name, source, table, PARTS,
};
pub use wait::FlagWait;

/// The generic CUDA C source (templates); [`source`] appends the generated entry points.
pub const BASE_SOURCE: &str = include_str!("../../cuda/oxccl_kernels.cu");

/// At most this many inputs per reduce launch (one-shot all-reduce over up to 8 peers' buffers).
pub const MAX_INPUTS: usize = 8;

/// The byte-copy kernel.
pub const COPY_KERNEL: &str = "oxccl_copy";

/// The AdamW step on f32 master weights ([`CudaKernels::adamw_f32`]).
pub const ADAMW_KERNEL: &str = "oxccl_adamw_f32";

/// The SGD step on f32 master weights ([`CudaKernels::sgd_f32`]).
pub const SGD_KERNEL: &str = "oxccl_sgd_f32";

/// The barrier kernel of collectives over CUDA IPC (see [`CudaKernels::ipc_barrier`]).
pub const BARRIER_KERNEL: &str = "oxccl_ipc_barrier";

/// The flag wait of point-to-point over CUDA IPC (see [`CudaKernels::ipc_p2p_wait`]).
pub const P2P_WAIT_KERNEL: &str = "oxccl_ipc_p2p_wait";

/// The flag store of point-to-point over CUDA IPC (see [`CudaKernels::ipc_p2p_post`]).
pub const P2P_POST_KERNEL: &str = "oxccl_ipc_p2p_post";

/// The kernel a stream of a staged device operation waits in (see [`FlagWait`]).
pub const WAIT_KERNEL: &str = "oxccl_wait_flag";

/// The CUDA C of [`WAIT_KERNEL`], compiled as a program of its own: staged operations need no
/// other kernel, and this one compiles in milliseconds.
pub const WAIT_SOURCE: &str = include_str!("../../cuda/oxccl_wait.cu");

/// The dtype pairs with a conversion kernel ([`CudaKernels::cast`]): `f32` to and from `f16` and
/// `bf16`, what DDP's compressed all-reduce sends and reads back.
pub const CAST_PAIRS: [(DType, DType); 4] = [
    (DType::F32, DType::F16),
    (DType::F32, DType::BF16),
    (DType::F16, DType::F32),
    (DType::BF16, DType::F32),
];

/// Most ranks an IPC barrier serves (the flag words each rank owns per barrier parity).
pub const MAX_BARRIER_RANKS: usize = 8;

/// The operations with a reduce kernel of their own ([`ReduceOp::Avg`] runs the sum kernel, then
/// [`CudaKernels::finish_avg_bytes`]).
pub const KERNEL_OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max];

/// `LengthMismatch` unless `src == dst` (lengths).
fn check_same(dst: usize, src: usize) -> Result<(), KernelError> {
    if src == dst {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch { dst, src })
    }
}

/// `NotMultiple` unless `bytes` is a whole number of `dt` elements.
fn check_whole(dt: DType, bytes: usize) -> Result<(), KernelError> {
    if bytes.is_multiple_of(dt.size()) {
        Ok(())
    } else {
        Err(KernelError::NotMultiple {
            bytes,
            elem: dt.size(),
        })
    }
}

/// Whether the NVRTC library can be loaded (`libnvrtc.so.13` or another name cudarc tries, on
/// the loader's search path). Checked once per process. Under `cuda-core` alone the application
/// chose how cudarc links: linked at build time, NVRTC is there if the program started.
pub fn nvrtc_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(nvrtc_present)
}

#[cfg(feature = "cuda")]
fn nvrtc_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen (and closes again) the candidate library
    // names; it touches no other state.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

#[cfg(not(feature = "cuda"))]
fn nvrtc_present() -> bool {
    true
}

/// For GPU test suites: whether a CUDA driver and device are here ([`driver_available`]);
/// without them it prints `SKIPPED: no CUDA driver or device` and returns `false`, so the
/// test returns early.
///
/// # Panics
/// Without a driver or device when `OXCCL_REQUIRE_GPU=1` (the GPU scripts set it, so that a
/// missing GPU fails their tests instead of skipping them).
pub fn gpu_or_skip() -> bool {
    if driver_available() {
        return true;
    }
    assert!(
        std::env::var("OXCCL_REQUIRE_GPU").as_deref() != Ok("1"),
        "OXCCL_REQUIRE_GPU=1 but no CUDA driver or device"
    );
    eprintln!("SKIPPED: no CUDA driver or device");
    false
}

/// Whether the CUDA driver library can be loaded and reports at least one device (loaded: with
/// the `cuda` feature's dynamic loading; under `cuda-core` alone, linked by the application).
pub fn driver_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| driver_present() && CudaContext::device_count().is_ok_and(|n| n > 0))
}

#[cfg(feature = "cuda")]
fn driver_present() -> bool {
    // SAFETY: as for `nvrtc_present`: a dlopen/dlclose probe of the driver library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

#[cfg(not(feature = "cuda"))]
fn driver_present() -> bool {
    true
}

fn unavailable(what: &str) -> KernelError {
    KernelError::CudaUnavailable(what.to_string())
}

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> KernelError {
    KernelError::Cuda(format!("{what}: {e:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_defines_every_kernel_the_dispatch_names() {
        let src = source();
        for name in kernel_names() {
            assert_eq!(
                src.matches(&format!(" {name}(")).count(),
                1,
                "{name} must be defined exactly once"
            );
        }
        // 12 dtypes x 4 ops + 12 div + 12 scale + 4 casts + AdamW + SGD + copy + barrier + the
        // two p2p kernels.
        assert_eq!(kernel_names().len(), 48 + 12 + 12 + 4 + 2 + 1 + 1 + 2);
        assert_eq!(
            reduce_kernel_name(DType::BF16, ReduceOp::Avg),
            "oxccl_reduce_bf16_sum"
        );
    }

    #[test]
    fn missing_libraries_are_errors_not_panics() {
        if !nvrtc_available() {
            assert!(matches!(
                compile_ptx("sm_90"),
                Err(KernelError::CudaUnavailable(_))
            ));
        }
        if !driver_available() {
            // Without a driver there is no context to pass; the check is the same one
            // `CudaKernels::new` makes first.
            assert!(!driver_available());
        }
    }
}
