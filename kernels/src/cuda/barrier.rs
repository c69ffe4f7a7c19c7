//! The IPC barrier kernel's launch on [`CudaKernels`]: the barrier of device collectives whose
//! ranks share flags in device memory.

use std::sync::Arc;

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use super::{cuda_err, CudaKernels, BARRIER_KERNEL, MAX_BARRIER_RANKS};
use crate::KernelError;

impl CudaKernels {
    /// Enqueues barrier number `epoch` of a node-local communicator whose ranks share flags in
    /// device memory (the protocol is described in `kernels/cuda/oxccl_kernels.cu`, where the
    /// kernel is). `flags[q]` is rank `q`'s flag array as this process addresses it; `sig`
    /// identifies the operation (ranks that disagree report a mismatch); the wait for each
    /// peer ends after `timeout_ns`. A failure writes `code | peer << 8` (1 = time-out,
    /// 2 = mismatch) to both error words, and every later barrier that sees `dev_error` set
    /// returns at once.
    ///
    /// # Safety
    /// Every `flags[q]` must address `2 * MAX_BARRIER_RANKS` u64 words of device memory
    /// mapped in `stream`'s context that stay allocated until the kernel has run;
    /// `dev_error` a u32 in device memory and `host_error` two u32 words of device-mapped
    /// host memory (the second receives the failed barrier's epoch), all equally long-lived.
    ///
    /// # Errors
    /// [`KernelError::Inputs`] for no flags, more than [`MAX_BARRIER_RANKS`] or a rank outside
    /// them; [`KernelError::Cuda`] if the launch fails.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn ipc_barrier(
        &self,
        stream: &Arc<CudaStream>,
        flags: &[u64],
        rank: usize,
        epoch: u32,
        sig: u32,
        timeout_ns: u64,
        dev_error: u64,
        host_error: u64,
    ) -> Result<(), KernelError> {
        if flags.is_empty() || flags.len() > MAX_BARRIER_RANKS || rank >= flags.len() {
            return Err(KernelError::Inputs(flags.len()));
        }
        let f = self.func(BARRIER_KERNEL)?;
        let mut ptrs = [0u64; MAX_BARRIER_RANKS];
        ptrs[..flags.len()].copy_from_slice(flags);
        let (r, n) = (rank as u32, flags.len() as u32);
        let mut b = stream.launch_builder(f);
        b.arg(&ptrs)
            .arg(&r)
            .arg(&n)
            .arg(&epoch)
            .arg(&sig)
            .arg(&timeout_ns)
            .arg(&dev_error)
            .arg(&host_error);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel is (Flags f, u32 rank, u32 n, u32 epoch, u32 sig, u64 timeout,
        // u32* dev_error, u32* host_error) with Flags 8 pointers (like `[u64; 8]`); it touches
        // only the first `n` flag arrays (words below 2 x 8) and the two error words, all live
        // by the caller's guarantee.
        unsafe { b.launch(cfg) }.map_err(|e| cuda_err("barrier launch", e))?;
        Ok(())
    }
}
