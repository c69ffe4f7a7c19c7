//! DDP on device gradients (feature `cuda`, or `cuda-core` where the application picks cudarc's
//! link mode): [`DeviceDdp`], the same reducer as [`Ddp`](crate::Ddp) with its buckets in device
//! memory and every step ordered on CUDA streams, with no host synchronisation.
//!
//! The two halves:
//! - `plan`: what each call enqueues, on which stream, after which event, as a list of ops: the
//!   whole state machine (micro-batches, buckets launched in order as they fill, unused
//!   parameters, the rebuilt order), with no device memory, so it is tested without a GPU;
//! - `cuda`: `DeviceDdp`, which runs those ops with cudarc (copies, events, the device
//!   collectives of oxccl-comm, the conversion kernels of oxccl-kernels).
//!
//! `sim` (tests only) runs the same plan on host buffers through the host hooks and checks every
//! buffer access against the order the two streams give it; `tests` compares it, bit for bit,
//! with the host `Ddp` on threaded ranks.

#[cfg(feature = "cuda-core")]
/// Runs `$body` with `$x` bound to the payload of whichever variant `$e` is (of `$enum`).
macro_rules! each {
    ($enum:ident, $e:expr, $x:ident => $body:expr) => {
        match $e {
            $enum::F32($x) => $body,
            $enum::F64($x) => $body,
            $enum::F16($x) => $body,
            $enum::BF16($x) => $body,
        }
    };
}

#[cfg(feature = "cuda-core")]
mod cuda;
pub(crate) mod plan;
#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;
#[cfg(feature = "cuda-core")]
mod types;

#[cfg(feature = "cuda-core")]
pub use cuda::{DeviceDdp, DeviceNoSync};
#[cfg(feature = "cuda-core")]
pub use types::{DevGrad, DevGradMut, DeviceElement, DeviceParam};

use crate::error::{DdpError, Result};
use crate::hooks::{CommHook, DeviceHook};

/// What `hook` does on device buckets, or an error (rank `rank`, `set_comm_hook`) naming a hook
/// that runs on host memory only.
pub(crate) fn device_hook(hook: &dyn CommHook, rank: usize) -> Result<DeviceHook> {
    hook.on_device().ok_or_else(|| DdpError::InvalidArgument {
        rank,
        op: "set_comm_hook",
        msg: format!(
            "comm hook {} runs on host buffers only; on device gradients use AllReduceAvg or \
             CompressHook (fp16/bf16)",
            hook.name()
        ),
    })
}
