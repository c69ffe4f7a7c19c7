//! The launches of the IPC kernels on [`CudaKernels`]: the barrier of device collectives whose
//! ranks share flags in device memory, and the flag waits and stores of point-to-point over IPC.

use std::sync::Arc;

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use super::{
    cuda_err, CudaKernels, BARRIER_KERNEL, MAX_BARRIER_RANKS, P2P_POST_KERNEL, P2P_WAIT_KERNEL,
};
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

impl CudaKernels {
    /// Enqueues a wait of point-to-point over CUDA IPC (the protocol is oxccl-comm's
    /// `cuda_ipc/p2p.rs`; the kernel, with its error codes, is in `kernels/cuda/oxccl_kernels.cu`):
    /// until `word` holds chunk `k` with tag `tag` from `peer` (a `ready` word), or, with `ack`,
    /// until it has reached `k` (an `ack` word), for at most `timeout_ns`. A `ready` wait returns
    /// at once when `dev_error` is set; an `ack` wait only when that peer's acknowledgement timed
    /// out before. The first failure sets both error words as [`CudaKernels::ipc_barrier`]'s do.
    ///
    /// # Safety
    /// `word` must address a u64 of device memory mapped in `stream`'s context, `dev_error` two
    /// u32 words in device memory (the second: the peers whose acknowledgements timed out) and
    /// `host_error` two u32 words of device-mapped host memory, all live until the kernel has
    /// run.
    ///
    /// # Errors
    /// [`KernelError::Cuda`] if the launch fails.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn ipc_p2p_wait(
        &self,
        stream: &Arc<CudaStream>,
        word: u64,
        (k, tag, ack): (u32, u32, bool),
        peer: usize,
        timeout_ns: u64,
        dev_error: u64,
        host_error: u64,
    ) -> Result<(), KernelError> {
        let f = self.func(P2P_WAIT_KERNEL)?;
        let (ack, peer) = (u32::from(ack), peer as u32);
        let mut b = stream.launch_builder(f);
        b.arg(&word)
            .arg(&k)
            .arg(&tag)
            .arg(&ack)
            .arg(&peer)
            .arg(&timeout_ns)
            .arg(&dev_error)
            .arg(&host_error);
        // SAFETY: the kernel is (u64* word, u32 k, u32 tag, u32 ack, u32 peer, u64 timeout,
        // u32* dev_error, u32* host_error); it reads `word` and writes only the error words, all
        // live by the caller's guarantee.
        unsafe { b.launch(one_thread()) }.map_err(|e| cuda_err("p2p wait launch", e))?;
        Ok(())
    }

    /// Enqueues a flag store of point-to-point over CUDA IPC: `value` into `word` after a
    /// system fence. With `poison` (a `ready` word), a set `dev_error` turns the value's high
    /// half into the poison tag, so the peer's wait fails rather than take what follows.
    ///
    /// # Safety
    /// `word` must address a u64 of device memory mapped in `stream`'s context and `dev_error`
    /// a u32 in device memory, both live until the kernel has run.
    ///
    /// # Errors
    /// [`KernelError::Cuda`] if the launch fails.
    pub unsafe fn ipc_p2p_post(
        &self,
        stream: &Arc<CudaStream>,
        word: u64,
        value: u64,
        poison: bool,
        dev_error: u64,
    ) -> Result<(), KernelError> {
        let f = self.func(P2P_POST_KERNEL)?;
        let poison = u32::from(poison);
        let mut b = stream.launch_builder(f);
        b.arg(&word).arg(&value).arg(&poison).arg(&dev_error);
        // SAFETY: the kernel is (u64* word, u64 value, u32 poison, u32* dev_error); it writes
        // only `word` and reads `dev_error`, both live by the caller's guarantee.
        unsafe { b.launch(one_thread()) }.map_err(|e| cuda_err("p2p post launch", e))?;
        Ok(())
    }
}

/// One block of one warp (the p2p kernels use thread 0).
fn one_thread() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    }
}
