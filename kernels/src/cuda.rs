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
//! | `oxccl_scale_<dtype>` (floats) | `dst = src * factor` (pre-multiplied sum) |
//! | `oxccl_copy` | byte copy |
//! | `oxccl_ipc_barrier` | the barrier of device collectives over CUDA IPC (flags in device memory, system-scope release/acquire, a deadline) |
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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{
    sys::CUdevice_attribute, CudaContext, CudaFunction, CudaStream, CudaView, CudaViewMut,
    DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use crate::{DType, Element, KernelError, ReduceOp};

/// The generic CUDA C source (templates); [`source`] appends the generated entry points.
pub const BASE_SOURCE: &str = include_str!("../cuda/oxccl_kernels.cu");

/// At most this many inputs per reduce launch (one-shot all-reduce over up to 8 peers' buffers).
pub const MAX_INPUTS: usize = 8;

/// The byte-copy kernel.
pub const COPY_KERNEL: &str = "oxccl_copy";

/// The barrier kernel of collectives over CUDA IPC (see [`CudaKernels::ipc_barrier`]).
pub const BARRIER_KERNEL: &str = "oxccl_ipc_barrier";

/// The kernel a stream of a staged device operation waits in (see [`FlagWait`]).
pub const WAIT_KERNEL: &str = "oxccl_wait_flag";

/// The CUDA C of [`WAIT_KERNEL`], compiled as a program of its own: staged operations need no
/// other kernel, and this one compiles in milliseconds.
pub const WAIT_SOURCE: &str = include_str!("../cuda/oxccl_wait.cu");

/// Most ranks an IPC barrier serves (the flag words each rank owns per barrier parity).
pub const MAX_BARRIER_RANKS: usize = 8;

/// The operations with a reduce kernel of their own ([`ReduceOp::Avg`] runs the sum kernel, then
/// [`CudaKernels::finish_avg_bytes`]).
pub const KERNEL_OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max];

/// Threads per block of every launch.
const THREADS: u32 = 512;

/// Every `(dtype, op)` pair that has a reduce kernel: the one list the generated CUDA source and
/// the Rust dispatch are both built from.
pub fn table() -> impl Iterator<Item = (DType, ReduceOp)> {
    DType::ALL
        .into_iter()
        .flat_map(|d| KERNEL_OPS.into_iter().map(move |o| (d, o)))
}

/// The C type of `dt` in the CUDA source (the source typedefs the short names).
fn ctype(dt: DType) -> &'static str {
    match dt {
        DType::F32 => "float",
        DType::F64 => "double",
        other => other.short_name(),
    }
}

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

/// The kernel an operation runs: `Avg` and `PreMulSum` combine as `Sum`.
fn kernel_op(op: ReduceOp) -> ReduceOp {
    match op {
        ReduceOp::Avg | ReduceOp::PreMulSum(_) => ReduceOp::Sum,
        op => op,
    }
}

fn op_struct(op: ReduceOp) -> &'static str {
    match kernel_op(op) {
        ReduceOp::Prod => "OpProd",
        ReduceOp::Min => "OpMin",
        ReduceOp::Max => "OpMax",
        _ => "OpSum",
    }
}

/// Name of the reduce kernel for `(dt, op)` (`Avg` and `PreMulSum` share the sum kernel).
pub fn reduce_kernel_name(dt: DType, op: ReduceOp) -> String {
    format!("oxccl_reduce_{}_{}", dt.short_name(), kernel_op(op).name())
}

/// Name of the divide kernel for `dt`.
pub fn div_kernel_name(dt: DType) -> String {
    format!("oxccl_div_{}", dt.short_name())
}

/// Name of the scale kernel for a float `dt` (`None` for integers).
pub fn scale_kernel_name(dt: DType) -> Option<String> {
    dt.is_float()
        .then(|| format!("oxccl_scale_{}", dt.short_name()))
}

/// Every kernel name [`source`] defines.
pub fn kernel_names() -> Vec<String> {
    let mut names: Vec<String> = table().map(|(d, o)| reduce_kernel_name(d, o)).collect();
    names.extend(DType::ALL.into_iter().map(div_kernel_name));
    names.extend(DType::ALL.into_iter().filter_map(scale_kernel_name));
    names.push(COPY_KERNEL.to_string());
    names.push(BARRIER_KERNEL.to_string());
    names
}

/// Every generated entry point: its name and its one line of CUDA C (one per [`table`] entry,
/// the divide and scale kernels of every dtype, and the copy kernel). The barrier kernel is
/// written out in [`BASE_SOURCE`].
fn entries() -> Vec<(String, String)> {
    let mut e = Vec::new();
    for (dt, op) in table() {
        let name = reduce_kernel_name(dt, op);
        let line = format!(
            "extern \"C\" __global__ void {name}({t}* dst, Inputs in, int k, usize n) \
             {{ reduce_any<{t}, {o}>(dst, in, k, n); }}",
            t = ctype(dt),
            o = op_struct(op),
        );
        e.push((name, line));
    }
    for dt in DType::ALL {
        let name = div_kernel_name(dt);
        let line = format!(
            "extern \"C\" __global__ void {name}({t}* dst, const {t}* src, u64 d, usize n) \
             {{ div_elems<{t}>(dst, src, d, n); }}",
            t = ctype(dt),
        );
        e.push((name, line));
        if let Some(name) = scale_kernel_name(dt) {
            let line = format!(
                "extern \"C\" __global__ void {name}({t}* dst, const {t}* src, double f, usize n) \
                 {{ scale_elems<{t}>(dst, src, f, n); }}",
                t = ctype(dt),
            );
            e.push((name, line));
        }
    }
    e.push((
        COPY_KERNEL.to_string(),
        format!(
            "extern \"C\" __global__ void {COPY_KERNEL}(u8* dst, const u8* src, usize n) \
             {{ copy_bytes(dst, src, n); }}"
        ),
    ));
    e
}

/// The complete CUDA C source: [`BASE_SOURCE`] plus every generated entry point (for reading;
/// the kernels are compiled from [`part_sources`]).
pub fn source() -> String {
    let mut s = String::from(BASE_SOURCE);
    for (_, line) in entries() {
        s.push_str(&line);
        s.push('\n');
    }
    s
}

/// Into how many sources the entry points are split, compiled by NVRTC at the same time and
/// loaded as as many modules: compiling the whole table as one program keeps NVRTC busy on one
/// core for about 6 s, most of it in the reduce kernels, which the first device collective on a
/// machine with empty caches waited for; in parts it takes about that divided by the cores (up
/// to this many: 3 s on 2 cores). A fixed number, so a part's source, and so its cache key, is
/// the same everywhere.
pub const PARTS: usize = 8;

/// The [`PARTS`] sources: each is [`BASE_SOURCE`] (templates, and the barrier kernel, which part
/// 0 provides) plus every `PARTS`-th generated entry point, with the names it defines.
pub fn part_sources() -> Vec<(Vec<String>, String)> {
    let mut parts: Vec<(Vec<String>, String)> = (0..PARTS)
        .map(|_| (Vec::new(), String::from(BASE_SOURCE)))
        .collect();
    for (i, (name, line)) in entries().into_iter().enumerate() {
        let (names, src) = &mut parts[i % PARTS];
        names.push(name);
        src.push_str(&line);
        src.push('\n');
    }
    parts[0].0.push(BARRIER_KERNEL.to_string());
    parts
}

/// Whether the NVRTC library can be loaded (`libnvrtc.so.13` or another name cudarc tries, on
/// the loader's search path). Checked once per process.
pub fn nvrtc_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries to dlopen (and closes again) the candidate library
    // names; it touches no other state.
    *OK.get_or_init(|| unsafe { cudarc::nvrtc::sys::is_culib_present() })
}

/// Whether the CUDA driver library can be loaded and reports at least one device.
pub fn driver_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // SAFETY: as for `nvrtc_available`: a dlopen/dlclose probe of the driver library.
        let present = unsafe { cudarc::driver::sys::is_culib_present() };
        present && CudaContext::device_count().is_ok_and(|n| n > 0)
    })
}

fn unavailable(what: &str) -> KernelError {
    KernelError::CudaUnavailable(what.to_string())
}

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> KernelError {
    KernelError::Cuda(format!("{what}: {e:?}"))
}

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

/// The PTX of the kernels for `arch`: the modules of [`compile_ptx_parts`] one after another,
/// for reading and searching ([`CudaKernels`] loads each part as a module of its own).
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

/// FNV-1a, 64 bits: a hash that is the same in every build (std's hasher is not), for cache keys.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Where the PTX of `src` (one part) for `arch` is kept between processes (compiling the whole
/// table takes NVRTC about 10 s of CPU): `$OXCCL_CACHE_DIR`, else `$XDG_CACHE_HOME/oxccl`, else
/// `$HOME/.cache/oxccl`; `OXCCL_CACHE_DIR=off` (or no usable directory) disables it. The key is
/// the source, the architecture and NVRTC's version.
fn disk_cache_path(src: &str, arch: &str) -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let dir = match std::env::var_os("OXCCL_CACHE_DIR") {
        Some(d) if d == "off" => return None,
        Some(d) => PathBuf::from(d),
        None => match std::env::var_os("XDG_CACHE_HOME") {
            Some(x) => PathBuf::from(x).join("oxccl"),
            None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/oxccl"),
        },
    };
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: nvrtcVersion writes two ints through valid pointers; NVRTC is loaded (checked by
    // the caller through `nvrtc_available`).
    let _ = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    let version = format!("{major}.{minor}");
    let key = fnv1a(&[src.as_bytes(), arch.as_bytes(), version.as_bytes()]);
    Some(dir.join(format!("kernels-{arch}-{key:016x}.ptx")))
}

/// Writes `text` to `path` through a temporary file and a rename, so a concurrent reader sees
/// the whole file or none; failures only cost the cache.
fn store_atomically(path: &std::path::Path, text: &str) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    // Unique per process and write: two threads may store the same part at once.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
    if std::fs::write(&tmp, text).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

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
fn load_now<'a>(funcs: impl Iterator<Item = &'a CudaFunction>) -> Result<(), KernelError> {
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
fn device_arch(ctx: &Arc<CudaContext>) -> Result<String, KernelError> {
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

    fn func(&self, name: &str) -> Result<&CudaFunction, KernelError> {
        self.funcs
            .get(name)
            .ok_or_else(|| KernelError::Cuda(format!("kernel {name} is not loaded")))
    }

    fn config(&self, bytes: usize) -> LaunchConfig {
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

    /// `dst = inputs[0] op inputs[1] op ... op inputs[k-1]` on byte buffers of `dt` elements,
    /// launched on `stream` (`Avg` sums; finish with [`CudaKernels::finish_avg_bytes`]).
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`] / [`KernelError::NotMultiple`] for bad lengths,
    /// [`KernelError::Inputs`] for no inputs or more than [`MAX_INPUTS`], [`KernelError::Cuda`]
    /// if the launch fails.
    pub fn reduce_bytes(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        op: ReduceOp,
        dst: &mut CudaViewMut<'_, u8>,
        inputs: &[&CudaView<'_, u8>],
    ) -> Result<(), KernelError> {
        if inputs.is_empty() || inputs.len() > MAX_INPUTS {
            return Err(KernelError::Inputs(inputs.len()));
        }
        let len = dst.len();
        for i in inputs {
            check_same(len, i.len())?;
        }
        check_whole(dt, len)?;
        if len == 0 {
            return Ok(());
        }
        let mut ptrs = [0u64; MAX_INPUTS];
        let mut guards = Vec::with_capacity(inputs.len());
        for (slot, i) in ptrs.iter_mut().zip(inputs) {
            let (p, g) = i.device_ptr(stream);
            *slot = p;
            guards.push(g);
        }
        let (d, dg) = dst.device_ptr_mut(stream);
        // SAFETY: `dst` and the inputs are live device buffers of `len` bytes each (checked
        // above); cudarc's guards keep their use ordered on `stream` until they drop after the
        // launch.
        unsafe { self.reduce_raw(stream, dt, op, d, &ptrs[..inputs.len()], len) }?;
        drop((guards, dg));
        Ok(())
    }

    /// [`CudaKernels::reduce_bytes`] on raw device addresses (peers' memory mapped through CUDA
    /// IPC, for instance): `dst = inputs[0] op ... op inputs[k-1]`, `bytes` bytes each. `dst`
    /// may be one of the inputs (each element is read before it is written, by one thread).
    ///
    /// # Safety
    /// `dst` and every input must be device addresses usable from `stream`'s context, each the
    /// start of `bytes` bytes that stay allocated (and, for `dst`, are not otherwise written)
    /// until the kernel has run; the ranges must not overlap except where `dst` equals an input.
    ///
    /// # Errors
    /// As [`CudaKernels::reduce_bytes`].
    pub unsafe fn reduce_raw(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        op: ReduceOp,
        dst: u64,
        inputs: &[u64],
        bytes: usize,
    ) -> Result<(), KernelError> {
        if inputs.is_empty() || inputs.len() > MAX_INPUTS {
            return Err(KernelError::Inputs(inputs.len()));
        }
        check_whole(dt, bytes)?;
        if bytes == 0 {
            return Ok(());
        }
        let f = self.func(&reduce_kernel_name(dt, op))?;
        let mut ptrs = [0u64; MAX_INPUTS];
        ptrs[..inputs.len()].copy_from_slice(inputs);
        let (k, n) = (inputs.len() as i32, (bytes / dt.size()) as u64);
        let mut b = stream.launch_builder(f);
        b.arg(&dst).arg(&ptrs).arg(&k).arg(&n);
        // SAFETY: the kernel's parameters are (T* dst, Inputs in, int k, usize n) with Inputs a
        // struct of 8 pointers (64 bytes, like `[u64; 8]`); the caller guarantees `dst` and the
        // first `k` inputs are `n` elements of `dt` each, so the kernel stays inside them.
        unsafe { b.launch(self.config(bytes)) }.map_err(|e| cuda_err("reduce launch", e))?;
        Ok(())
    }

    /// Typed form of [`CudaKernels::reduce_bytes`].
    ///
    /// # Errors
    /// As [`CudaKernels::reduce_bytes`].
    pub fn reduce<T: Element>(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<'_, T>,
        inputs: &[&CudaView<'_, T>],
        op: ReduceOp,
    ) -> Result<(), KernelError> {
        // SAFETY: `T: Element` is a plain-old-data type (bytemuck::Pod), so viewing its buffer
        // as bytes of the same total length is valid.
        let mut d = unsafe { dst.transmute_mut::<u8>(dst.len() * T::DTYPE.size()) }
            .ok_or_else(|| KernelError::Cuda("cannot view the destination as bytes".into()))?;
        let views: Vec<CudaView<'_, u8>> = inputs
            .iter()
            // SAFETY: as above, for each input.
            .map(|i| unsafe { i.transmute::<u8>(i.len() * T::DTYPE.size()) })
            .collect::<Option<_>>()
            .ok_or_else(|| KernelError::Cuda("cannot view an input as bytes".into()))?;
        let refs: Vec<&CudaView<'_, u8>> = views.iter().collect();
        self.reduce_bytes(stream, T::DTYPE, op, &mut d, &refs)
    }

    /// `dst = src` (bytes), 16-byte vectors where the offsets allow.
    ///
    /// # Errors
    /// [`KernelError::LengthMismatch`], or [`KernelError::Cuda`] if the launch fails.
    pub fn copy_bytes(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<'_, u8>,
        src: &CudaView<'_, u8>,
    ) -> Result<(), KernelError> {
        let len = dst.len();
        check_same(len, src.len())?;
        if len == 0 {
            return Ok(());
        }
        let f = self.func(COPY_KERNEL)?;
        let (s, sg) = src.device_ptr(stream);
        let (d, dg) = dst.device_ptr_mut(stream);
        let n = len as u64;
        let mut b = stream.launch_builder(f);
        b.arg(&d).arg(&s).arg(&n);
        // SAFETY: the kernel is (u8* dst, const u8* src, usize n); both buffers are live and
        // `n` bytes long (checked above).
        unsafe { b.launch(self.config(len)) }.map_err(|e| cuda_err("copy launch", e))?;
        drop((sg, dg));
        Ok(())
    }

    /// `buf = buf / n` for `dt` elements: the last step of [`ReduceOp::Avg`] (truncating for
    /// integers, in `f32` for `f16`/`bf16`, as the host's `finish_avg`).
    ///
    /// # Errors
    /// [`KernelError::ZeroCount`] for `n == 0`, [`KernelError::NotMultiple`],
    /// [`KernelError::Cuda`] if the launch fails.
    pub fn finish_avg_bytes(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        buf: &mut CudaViewMut<'_, u8>,
        n: usize,
    ) -> Result<(), KernelError> {
        if n == 0 {
            return Err(KernelError::ZeroCount);
        }
        self.unary(
            stream,
            dt,
            &div_kernel_name(dt),
            buf,
            UnaryArg::Div(n as u64),
        )
    }

    /// `buf = buf * factor` for a float `dt` (pre-multiplied sum; `f32` arithmetic for
    /// `f16`/`bf16`, `f64` for `f64`).
    ///
    /// # Errors
    /// [`KernelError::Unsupported`] for integer types, [`KernelError::NotMultiple`],
    /// [`KernelError::Cuda`] if the launch fails.
    pub fn scale_bytes(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        buf: &mut CudaViewMut<'_, u8>,
        factor: f64,
    ) -> Result<(), KernelError> {
        let name = scale_kernel_name(dt).ok_or(KernelError::Unsupported {
            dtype: dt,
            what: "scaling (pre-multiplied sum)",
        })?;
        self.unary(stream, dt, &name, buf, UnaryArg::Scale(factor))
    }

    fn unary(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        name: &str,
        buf: &mut CudaViewMut<'_, u8>,
        arg: UnaryArg,
    ) -> Result<(), KernelError> {
        let len = buf.len();
        let (d, dg) = buf.device_ptr_mut(stream);
        // SAFETY: `buf` is a live device buffer of `len` bytes, ordered on `stream` by its guard
        // until after the launch.
        unsafe { self.unary_raw(stream, dt, name, d, len, arg) }?;
        drop(dg);
        Ok(())
    }

    /// # Safety
    /// `d` is the device address of `len` bytes usable from `stream`'s context, allocated until
    /// the kernel has run.
    unsafe fn unary_raw(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        name: &str,
        d: u64,
        len: usize,
        arg: UnaryArg,
    ) -> Result<(), KernelError> {
        check_whole(dt, len)?;
        if len == 0 {
            return Ok(());
        }
        let f = self.func(name)?;
        let n = (len / dt.size()) as u64;
        let mut b = stream.launch_builder(f);
        b.arg(&d).arg(&d);
        match &arg {
            UnaryArg::Div(v) => b.arg(v),
            UnaryArg::Scale(v) => b.arg(v),
        };
        b.arg(&n);
        // SAFETY: the kernel is (T* dst, const T* src, u64 d | double f, usize n) with dst ==
        // src == `d`, `n` elements of `dt` (the caller's guarantee); every thread reads and
        // writes only its own elements, so the aliasing is fine.
        unsafe { b.launch(self.config(len)) }.map_err(|e| cuda_err("launch", e))?;
        Ok(())
    }

    /// [`CudaKernels::finish_avg_bytes`] on a raw device address.
    ///
    /// # Safety
    /// `buf` must be the device address of `bytes` bytes usable from `stream`'s context, not
    /// otherwise written and allocated until the kernel has run.
    ///
    /// # Errors
    /// As [`CudaKernels::finish_avg_bytes`].
    pub unsafe fn finish_avg_raw(
        &self,
        stream: &Arc<CudaStream>,
        dt: DType,
        buf: u64,
        bytes: usize,
        n: usize,
    ) -> Result<(), KernelError> {
        if n == 0 {
            return Err(KernelError::ZeroCount);
        }
        // SAFETY: the caller's guarantee.
        unsafe {
            self.unary_raw(
                stream,
                dt,
                &div_kernel_name(dt),
                buf,
                bytes,
                UnaryArg::Div(n as u64),
            )
        }
    }

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

enum UnaryArg {
    Div(u64),
    Scale(f64),
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
        // 12 dtypes x 4 ops + 12 div + 6 scale (floats) + copy + barrier.
        assert_eq!(kernel_names().len(), 48 + 12 + 6 + 1 + 1);
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
