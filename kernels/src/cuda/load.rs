//! [`CudaKernels`]: the compiled kernels loaded on a CUDA context (loaded at once, not at their
//! first launch), and the launch geometry their launches share.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{sys::CUdevice_attribute, CudaContext, CudaFunction, LaunchConfig};
use cudarc::nvrtc::Ptx;

use super::compile::compile_ptx_parts;
use super::source::part_sources;
use super::{cuda_err, driver_available, unavailable};
use crate::KernelError;

/// Threads per block of every launch.
const THREADS: u32 = 512;

/// The kernels loaded on one CUDA context.
pub struct CudaKernels {
    funcs: HashMap<String, CudaFunction>,
    /// Blocks of a full-grid launch (streaming multiprocessors x 4).
    max_blocks: u32,
}

impl std::fmt::Debug for CudaKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKernels")
            .field("kernels", &self.funcs.len())
            .field("max_blocks", &self.max_blocks)
            .finish()
    }
}

/// Loads every function onto the device now, not at its first launch.
///
/// Under lazy loading (`CUDA_MODULE_LOADING=LAZY`, the default since CUDA 12.2) a kernel is
/// loaded at its first launch, and loading may wait for the whole context to go idle (NVIDIA's
/// programming guide, "Lazy Loading", concurrent execution). Ranks that are threads of one
/// process share that context: a rank launching a reduce kernel for the first time would wait
/// for another rank's barrier, which waits for this rank. Loaded here, at set-up, before any
/// kernel of a collective is in flight, no launch ever loads. (A handle from
/// `cuModuleGetFunction` may already be loaded; `cuFuncLoad` then does nothing.) Needs driver 12.4
/// or later; with an older one this does nothing, and only `CUDA_MODULE_LOADING=EAGER` makes sure.
pub(super) fn load_now<'a>(
    funcs: impl Iterator<Item = &'a CudaFunction>,
) -> Result<(), KernelError> {
    let mut version = 0;
    // SAFETY: the driver writes its version into `version`.
    let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS || version < 12040 {
        return Ok(());
    }
    for f in funcs {
        // SAFETY: `f` is a live function handle of a module loaded in this context (which the
        // caller made current); cuFuncLoad only loads it.
        let r = unsafe { cudarc::driver::sys::cuFuncLoad(f.cu_function()) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(cuda_err("loading a kernel (cuFuncLoad)", r));
        }
    }
    Ok(())
}

/// The virtual architecture to compile for `ctx`'s device (`compute_90`, ...).
pub(super) fn device_arch(ctx: &Arc<CudaContext>) -> Result<String, KernelError> {
    if !driver_available() {
        return Err(unavailable("no CUDA driver (libcuda.so) or no CUDA device"));
    }
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| cuda_err("compute capability", e))?;
    Ok(format!("compute_{major}{minor}"))
}

impl CudaKernels {
    /// Compiles (or takes from the per-process cache) the PTX for `ctx`'s device and loads every
    /// kernel.
    ///
    /// # Errors
    /// [`KernelError::CudaUnavailable`] when the driver or NVRTC is missing;
    /// [`KernelError::Cuda`] when compiling or loading fails.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<CudaKernels, KernelError> {
        let ptx = compile_ptx_parts(&device_arch(ctx)?)?;
        let mut funcs = HashMap::new();
        for ((names, _), text) in part_sources().into_iter().zip(ptx.iter()) {
            let module = ctx
                .load_module(Ptx::from_src(text.as_str()))
                .map_err(|e| cuda_err("loading a PTX module", e))?;
            for name in names {
                let f = module
                    .load_function(&name)
                    .map_err(|e| cuda_err(&format!("kernel {name}"), e))?;
                funcs.insert(name, f);
            }
        }
        load_now(funcs.values())?;
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| cuda_err("multiprocessor count", e))?;
        Ok(CudaKernels {
            funcs,
            max_blocks: (sms.max(1) as u32) * 4,
        })
    }

    pub(super) fn func(&self, name: &str) -> Result<&CudaFunction, KernelError> {
        self.funcs
            .get(name)
            .ok_or_else(|| KernelError::Cuda(format!("kernel {name} is not loaded")))
    }

    pub(super) fn config(&self, bytes: usize) -> LaunchConfig {
        let vectors = bytes.div_ceil(16).max(1);
        let blocks = vectors
            .div_ceil(THREADS as usize)
            .min(self.max_blocks as usize) as u32;
        LaunchConfig {
            grid_dim: (blocks.max(1), 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}
