//! [`FlagWait`]: a stream's wait, on the GPU and with a deadline, for a word of host memory that
//! a staged operation's host collective sets.

use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use super::compile::compile_wait_ptx;
use super::load::{device_arch, load_now};
use super::{cuda_err, WAIT_KERNEL};
use crate::KernelError;

/// The stream's wait for a staged device operation's host collective: [`WAIT_KERNEL`], loaded
/// on one context.
///
/// The progress thread publishes the number of each finished part in a word of device-mapped
/// host memory; [`FlagWait::enqueue`] makes a stream wait, on the GPU, until that word reaches a
/// part's number, polling it about every microsecond. `cuStreamWaitValue32` does the same in the
/// driver but waits for ever; this wait ends at a deadline.
pub struct FlagWait {
    func: CudaFunction,
}

impl std::fmt::Debug for FlagWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlagWait").finish_non_exhaustive()
    }
}

impl FlagWait {
    /// Compiles (or takes from a cache) and loads the wait kernel on `ctx`, which the caller
    /// has made current.
    ///
    /// # Errors
    /// [`KernelError::CudaUnavailable`] without a driver or NVRTC; [`KernelError::Cuda`] when
    /// compiling or loading fails.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<FlagWait, KernelError> {
        let ptx = compile_wait_ptx(&device_arch(ctx)?)?;
        let module = ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(|e| cuda_err("loading the wait kernel's module", e))?;
        let func = module
            .load_function(WAIT_KERNEL)
            .map_err(|e| cuda_err(&format!("kernel {WAIT_KERNEL}"), e))?;
        load_now(std::iter::once(&func))?;
        Ok(FlagWait { func })
    }

    /// The wait kernel of `ctx`: the one loaded there already, while anything holds it, else
    /// one loaded now. Ranks that are threads of one process share a context, and loading a
    /// module may wait for the context to go idle, which a peer's waiting kernel can keep from
    /// happening until this rank's own part arrives: so the first rank loads it, and later ones
    /// take that.
    ///
    /// # Errors
    /// As [`FlagWait::new`].
    pub fn shared(ctx: &Arc<CudaContext>) -> Result<Arc<FlagWait>, KernelError> {
        /// (context handle, its wait kernel while anything holds it)
        type Loaded = Vec<(usize, std::sync::Weak<FlagWait>)>;
        static LOADED: OnceLock<Mutex<Loaded>> = OnceLock::new();
        let mut loaded = LOADED
            .get_or_init(|| Mutex::new(Vec::new()))
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        loaded.retain(|(_, w)| w.strong_count() > 0);
        let key = ctx.cu_ctx() as usize;
        if let Some(w) = loaded
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, w)| w.upgrade())
        {
            return Ok(w);
        }
        let w = Arc::new(FlagWait::new(ctx)?);
        loaded.push((key, Arc::downgrade(&w)));
        Ok(w)
    }

    /// Makes `stream` wait until the u32 at `flag` is at least `value` (cyclically: `flag -
    /// value`, as an i32, is not negative), for at most `timeout_ns` from when the wait starts
    /// on the GPU; past it the kernel stores `value` into `status + 4` and then 1 into
    /// `status`, and the stream goes on.
    ///
    /// # Safety
    /// `flag` and `status` (two u32 words) must be device addresses, in `stream`'s context, of
    /// memory (device-mapped host memory, say) that stays allocated until the kernel has run.
    ///
    /// # Errors
    /// [`KernelError::Cuda`] if the launch fails.
    pub unsafe fn enqueue(
        &self,
        stream: &Arc<CudaStream>,
        flag: u64,
        value: u32,
        timeout_ns: u64,
        status: u64,
    ) -> Result<(), KernelError> {
        let mut b = stream.launch_builder(&self.func);
        b.arg(&flag).arg(&value).arg(&timeout_ns).arg(&status);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel is (const u32* flag, u32 value, u64 timeout_ns, u32* status); it
        // reads the flag word and may write the two status words, live by the caller's
        // guarantee.
        unsafe { b.launch(cfg) }.map_err(|e| cuda_err("wait kernel launch", e))?;
        Ok(())
    }
}
