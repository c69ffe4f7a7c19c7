//! NVRTC: the kernels' sources compiled to PTX for an architecture, the parts at the same time,
//! kept in this process (and on disk, through `cache`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use super::cache::{disk_cache_path, store_atomically};
use super::source::part_sources;
use super::{cuda_err, nvrtc_available, unavailable, PARTS, WAIT_SOURCE};
use crate::KernelError;

/// The PTX of every part of [`part_sources`] for `arch` (`sm_90`, `compute_80`, ...), in order,
/// each a whole module: from this process's cache, else the disk cache, else NVRTC, the parts
/// compiled at the same time on up to one thread per core. Once per architecture and process.
///
/// # Errors
/// [`KernelError::CudaUnavailable`] without NVRTC; [`KernelError::Cuda`] with NVRTC's log if a
/// part does not compile (or NVRTC panicked).
pub fn compile_ptx_parts(arch: &str) -> Result<Arc<Vec<String>>, KernelError> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<Vec<String>>>>> = OnceLock::new();
    if !nvrtc_available() {
        return Err(unavailable(
            "NVRTC (libnvrtc.so.13) is not on the library search path; install the \
             nvidia-cuda-nvrtc wheel or a CUDA toolkit and add its lib directory to \
             LD_LIBRARY_PATH",
        ));
    }
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(p) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(arch) {
        return Ok(Arc::clone(p));
    }
    let parts = part_sources();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done: Vec<Mutex<Option<Result<String, KernelError>>>> =
        parts.iter().map(|_| Mutex::new(None)).collect();
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, PARTS);
    std::thread::scope(|scope| {
        let work = || loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some((_, src)) = parts.get(i) else { break };
            // A panic inside NVRTC's wrapper becomes this part's error (a scoped thread that
            // panicked would make the whole scope panic).
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                compile_one(src, arch, &format!("oxccl_kernels_{i}.cu"))
            }))
            .unwrap_or_else(|_| {
                Err(KernelError::Cuda(format!(
                    "NVRTC panicked compiling part {i} of the kernels for {arch}"
                )))
            });
            *done[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        };
        // Extra workers are a speed-up only: one that cannot be started leaves its share to
        // the others, and this thread works too.
        for _ in 1..workers {
            let _ = std::thread::Builder::new()
                .name("oxccl-nvrtc".into())
                .spawn_scoped(scope, work);
        }
        work();
    });
    let mut ptx = Vec::with_capacity(PARTS);
    for (i, d) in done.into_iter().enumerate() {
        let r = d.into_inner().unwrap_or_else(|e| e.into_inner());
        ptx.push(r.unwrap_or_else(|| {
            Err(KernelError::Cuda(format!(
                "NVRTC: part {i} of the kernels for {arch} was not compiled"
            )))
        })?);
    }
    let ptx = Arc::new(ptx);
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(arch.to_string(), Arc::clone(&ptx));
    Ok(ptx)
}

/// The PTX of the kernels for `arch`: the modules of [`compile_ptx_parts`] one after another, for
/// reading and searching ([`CudaKernels`](super::CudaKernels) loads each part as a module of its
/// own).
///
/// # Errors
/// As [`compile_ptx_parts`].
pub fn compile_ptx(arch: &str) -> Result<String, KernelError> {
    Ok(compile_ptx_parts(arch)?.concat())
}

/// The PTX of [`WAIT_SOURCE`] for `arch`: from this process's cache, the disk cache, else NVRTC.
///
/// # Errors
/// As [`compile_ptx_parts`].
pub fn compile_wait_ptx(arch: &str) -> Result<String, KernelError> {
    static CACHE: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    if !nvrtc_available() {
        return Err(unavailable(
            "NVRTC (libnvrtc.so.13) is not on the library search path (needed for the \
             stream's wait kernel)",
        ));
    }
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(p) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(arch) {
        return Ok(p.clone());
    }
    let text = std::panic::catch_unwind(|| compile_one(WAIT_SOURCE, arch, "oxccl_wait.cu"))
        .unwrap_or_else(|_| {
            Err(KernelError::Cuda(format!(
                "NVRTC panicked compiling oxccl_wait.cu for {arch}"
            )))
        })?;
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(arch.to_string(), text.clone());
    Ok(text)
}

/// The PTX of `src` (a program named `name`) for `arch`: from the disk cache, else NVRTC (then
/// stored).
fn compile_one(src: &str, arch: &str, name: &str) -> Result<String, KernelError> {
    let disk = disk_cache_path(src, arch);
    if let Some(text) = disk.as_ref().and_then(|p| std::fs::read_to_string(p).ok()) {
        if text.contains(".entry") {
            return Ok(text);
        }
    }
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some(name.to_string()),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(src, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { log, .. } => KernelError::Cuda(format!(
            "NVRTC could not compile {name} for {arch}:\n{}",
            log.to_string_lossy()
        )),
        other => cuda_err("NVRTC", other),
    })?;
    let text = ptx.to_src();
    if let Some(p) = disk {
        store_atomically(&p, &text);
    }
    Ok(text)
}
