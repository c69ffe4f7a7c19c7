//! Device memory of CUDA IPC: this rank's scratch allocation and its IPC handle, the
//! process-wide cache of peers' allocations opened through their handles, peer access between
//! the GPUs of ranks that are threads of this process, and the kernels loaded per context.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream};
use oxccl_kernels::cuda::CudaKernels;

use super::lock;
use super::p2p::P2pLayout;
use super::plan::FLAGS_BYTES;
use crate::device::staging::{wait_event, Flag};

/// The kernels loaded on `ctx`, shared by every communicator of the process (compiling and
/// loading them is done once per context).
fn kernels_for(ctx: &Arc<CudaContext>) -> std::result::Result<Arc<CudaKernels>, String> {
    static LOADED: OnceLock<Mutex<HashMap<usize, Arc<CudaKernels>>>> = OnceLock::new();
    let mut map = lock(LOADED.get_or_init(|| Mutex::new(HashMap::new())));
    let key = ctx.cu_ctx() as usize;
    if let Some(k) = map.get(&key) {
        return Ok(Arc::clone(k));
    }
    let k = Arc::new(CudaKernels::new(ctx).map_err(|e| e.to_string())?);
    map.insert(key, Arc::clone(&k));
    Ok(k)
}

/// A reference-counted cache of mappings: the first user of a key opens it, the last one to
/// release it closes it.
pub(crate) struct RegCache<K, V> {
    map: Mutex<HashMap<K, (V, usize)>>,
}

impl<K: Eq + Hash + Clone, V: Copy> RegCache<K, V> {
    pub(crate) fn new() -> Self {
        RegCache {
            map: Mutex::new(HashMap::new()),
        }
    }

    /// The mapping of `key`, opened with `open` if nobody holds it.
    pub(crate) fn acquire<E>(
        &self,
        key: &K,
        open: impl FnOnce() -> std::result::Result<V, E>,
    ) -> std::result::Result<V, E> {
        let mut map = lock(&self.map);
        if let Some((v, refs)) = map.get_mut(key) {
            *refs += 1;
            return Ok(*v);
        }
        let v = open()?;
        map.insert(key.clone(), (v, 1));
        Ok(v)
    }

    /// Gives `key` back; `close` runs when it was the last holder.
    pub(crate) fn release(&self, key: &K, close: impl FnOnce(V)) {
        let mut map = lock(&self.map);
        let last = match map.get_mut(key) {
            Some((_, refs)) => {
                *refs -= 1;
                *refs == 0
            }
            None => false,
        };
        if last {
            if let Some((v, _)) = map.remove(key) {
                close(v);
            }
        }
    }

    #[cfg(test)]
    pub(super) fn holders(&self, key: &K) -> usize {
        lock(&self.map).get(key).map_or(0, |e| e.1)
    }
}

/// Peer allocations opened through CUDA IPC, keyed by (context, handle).
pub(super) type MapKey = (usize, [u8; 64]);

pub(super) fn mapped() -> &'static RegCache<MapKey, sys::CUdeviceptr> {
    static MAPPED: OnceLock<RegCache<MapKey, sys::CUdeviceptr>> = OnceLock::new();
    MAPPED.get_or_init(RegCache::new)
}

/// This rank's own part: its scratch allocation, error word and kernels.
pub(super) struct Local {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) kernels: Arc<CudaKernels>,
    pub(super) scratch: sys::CUdeviceptr,
    pub(super) handle: [u8; 64],
    /// Written by barrier kernels: dropped only when `leak` is not set.
    pub(super) error: std::mem::ManuallyDrop<Flag>,
    /// Recorded after every operation (they are chained, so the last one covers all).
    pub(super) done: CudaEvent,
    /// Leave the memory allocated when dropped (a kernel may still use it).
    pub(super) leak: bool,
}

impl Local {
    pub(super) fn new(
        rank: usize,
        stream: &Arc<CudaStream>,
        layout: &P2pLayout,
        timeout: std::time::Duration,
    ) -> std::result::Result<Local, String> {
        let d = |what: &str, e: sys::CUresult| format!("{what}: {e:?}");
        let ctx = stream.context();
        tracing::trace!(rank, "cuda: cuda_ipc set-up: loading the kernels");
        let kernels = kernels_for(ctx)?;
        // The time-out starts after the load, which may take longer (NVRTC and the driver's
        // compiler with empty caches, or another rank thread loading them for this context).
        let deadline = Instant::now() + timeout;
        tracing::trace!(
            rank,
            "cuda: cuda_ipc set-up: allocating scratch (cuMemAlloc)"
        );
        ctx.bind_to_thread()
            .map_err(|e| format!("binding the context: {e:?}"))?;
        let bytes = layout.scratch_bytes();
        let mut scratch: sys::CUdeviceptr = 0;
        // SAFETY: the driver writes the address of a fresh allocation of `bytes` bytes.
        let r = unsafe { sys::cuMemAlloc_v2(&mut scratch, bytes) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(d(&format!("allocating {bytes} bytes of device scratch"), r));
        }
        let free = |scratch| {
            // SAFETY: allocated above and not shared with anyone yet.
            let _ = unsafe { sys::cuMemFree_v2(scratch) };
        };
        // The flags must read zero before any peer can see the handle: cleared on the caller's
        // stream (a new stream could synchronize the whole context) and waited for, bounded.
        let cleared = ctx.new_event(None).and_then(|ev| {
            // SAFETY: the first FLAGS_BYTES of the allocation made above, and the p2p flag
            // block, which the layout places inside it.
            unsafe {
                let s = stream.cu_stream();
                sys::cuMemsetD8Async(scratch, 0, FLAGS_BYTES, s).result()?;
                let p2p = scratch + layout.flags as u64;
                sys::cuMemsetD8Async(p2p, 0, layout.flag_bytes(), s).result()?;
            }
            ev.record(stream)?;
            wait_event(&ev, deadline)
        });
        match cleared {
            Ok(true) => {}
            Ok(false) => {
                // The memset may still run: the memory cannot be freed under it.
                return Err("clearing the flags: the stream did not get there in time".into());
            }
            Err(e) => {
                free(scratch);
                return Err(format!("clearing the flags: {e:?}"));
            }
        }
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: `scratch` is a cuMemAlloc allocation of this context; the driver fills `h`.
        let r = unsafe { sys::cuIpcGetMemHandle(&mut h, scratch) };
        if r != sys::CUresult::CUDA_SUCCESS {
            free(scratch);
            return Err(d("cuIpcGetMemHandle", r));
        }
        let handle = h.reserved.map(|c| c as u8);
        tracing::trace!(
            rank,
            "cuda: cuda_ipc set-up: allocating the error word (cuMemHostAlloc)"
        );
        let error = Flag::new(ctx).map_err(|e| {
            free(scratch);
            format!("allocating the error word: {e:?}")
        })?;
        let done = ctx.new_event(None).map_err(|e| {
            free(scratch);
            format!("creating an event: {e:?}")
        })?;
        Ok(Local {
            ctx: Arc::clone(ctx),
            kernels,
            scratch,
            handle,
            error: std::mem::ManuallyDrop::new(error),
            done,
            leak: false,
        })
    }
}

/// A rank's scratch allocation and error word, taken out of its [`Local`] to be freed by
/// whoever holds this (the last rank of a world of threads to leave): freed when dropped.
pub(super) struct Buried {
    ctx: Arc<CudaContext>,
    scratch: sys::CUdeviceptr,
    _error: Flag,
}

impl Drop for Buried {
    fn drop(&mut self) {
        // SAFETY: the context is live (held by `self.ctx`); the scratch was allocated in it, and
        // the holder drops this only once no kernel of any rank can use it any more.
        unsafe {
            let _ = result::ctx::set_current(self.ctx.cu_ctx());
            let _ = sys::cuMemFree_v2(self.scratch);
        }
    }
}

impl Local {
    /// Takes the scratch allocation and the error word out (this `Local` then frees nothing).
    pub(super) fn bury(&mut self) -> Option<Buried> {
        if self.leak {
            return None;
        }
        self.leak = true;
        // SAFETY: taken once (`leak` is now set, so neither this nor `Drop` takes it again).
        let error = unsafe { std::mem::ManuallyDrop::take(&mut self.error) };
        Some(Buried {
            ctx: Arc::clone(&self.ctx),
            scratch: self.scratch,
            _error: error,
        })
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        if self.leak {
            // The error word may still be written by a barrier kernel: it stays allocated too.
            return;
        }
        // SAFETY: dropped once, here; nothing writes the word any more (see below).
        unsafe { std::mem::ManuallyDrop::drop(&mut self.error) };
        // SAFETY: the context is live (held by `self.ctx`); the scratch was allocated in it and
        // no kernel uses it any more (the owner checked, or set `leak`).
        unsafe {
            let _ = result::ctx::set_current(self.ctx.cu_ctx());
            let _ = sys::cuMemFree_v2(self.scratch);
        }
    }
}

/// A peer rank that is a thread of this process: its address works as it is, once this context
/// may reach its device (the peer device's context is kept in `keep`: dropping it would make it
/// current on this thread).
pub(super) fn same_process_peer(
    ctx: &Arc<CudaContext>,
    ordinal: usize,
    keep: &mut Vec<Arc<CudaContext>>,
) -> std::result::Result<(), String> {
    if ordinal == ctx.ordinal() {
        return Ok(());
    }
    let peer = CudaContext::new(ordinal).map_err(|e| format!("device {ordinal}: {e:?}"))?;
    keep.push(Arc::clone(&peer));
    ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    // SAFETY: both context handles are live (held by `ctx` and `peer`).
    let r = unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) };
    match r {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            Ok(())
        }
        e => Err(format!(
            "peer access from device {} to device {ordinal}: {e:?}",
            ctx.ordinal()
        )),
    }
}

pub(super) fn open_handle(handle: &[u8; 64]) -> std::result::Result<sys::CUdeviceptr, String> {
    let h = sys::CUipcMemHandle_st {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let mut p: sys::CUdeviceptr = 0;
    let lazy = sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    // SAFETY: `h` is a handle another process exported with cuIpcGetMemHandle; the driver maps
    // it into the current context and writes the address.
    let r = unsafe { sys::cuIpcOpenMemHandle_v2(&mut p, h, lazy) };
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(p)
    } else {
        Err(format!("cuIpcOpenMemHandle: {r:?}"))
    }
}

pub(super) fn close_handle(p: sys::CUdeviceptr) {
    // SAFETY: `p` came from cuIpcOpenMemHandle and its last user gave it back.
    let _ = unsafe { sys::cuIpcCloseMemHandle(p) };
}
