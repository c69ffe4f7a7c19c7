//! The `cuda_ipc` transport: device collectives among the ranks of one node, read straight out
//! of each other's device memory, ordered on the caller's stream with no host round trip.
//!
//! **Set-up** (the first device collective of a communicator whose ranks all share a node, at
//! most [`MAX_RANKS`] of them): every rank allocates one scratch buffer in device memory (flags
//! and two slots, see [`plan`]), takes its CUDA IPC handle (`cuIpcGetMemHandle`) and
//! publishes a record through the communicator's store: process id, device, address, handle, or
//! why it cannot take part. When every record is usable, each rank maps every peer's scratch:
//! the plain address for ranks in the same process (IPC handles cannot be opened by the process
//! that made them), `cuIpcOpenMemHandle` (peer access enabled lazily, so ranks on different GPUs
//! work too) for the others, through a process-wide cache keyed by context and handle, so an
//! allocation is mapped once however many communicators use it. A second round through the store
//! confirms every rank mapped everything. If any rank cannot, every rank falls back to staging
//! through host memory (`OXCCL_CUDA_IPC=1` makes that an error instead).
//!
//! **An operation** is the steps of its [`IpcPlan`], enqueued on the caller's stream: copies
//! (`cuMemcpyDtoDAsync`), the reduce kernels of `oxccl-kernels` with one input per rank's slot,
//! and the barrier kernel (`oxccl_ipc_barrier`: device flags, a deadline, mismatch detection). The
//! call returns once enqueued. When every rank is a thread of this process, the barriers are met
//! on the host instead ([`ThreadSync`]: the same flag protocol in host memory, then CUDA events
//! between the streams), and a barrier's failures come back from the call itself. Operations of
//! one communicator on different streams are chained (each waits for the previous one's event),
//! since the barrier protocol needs them in order.
//!
//! **Failures** the barrier detects (a rank that never arrives within `OXCCL_TIMEOUT`, a rank
//! that called something else) land in a device-mapped host word; the next call, and
//! [`Communicator::device_async_error`](crate::Communicator::device_async_error), turn it into an
//! [`Error::Timeout`] or [`Error::Mismatch`] naming the peer and the operation.
//!
//! **Tear-down**: when the communicator is dropped, each rank waits (bounded) for its last
//! operation, says so through the store and waits (bounded) for every peer to say the same
//! before it unmaps peers and frees its scratch; whatever cannot be confirmed is leaked rather
//! than freed under a kernel that may still read it.

pub(crate) mod plan;

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream};
use oxccl_kernels::cuda::CudaKernels;
use oxccl_kernels::{DType, ReduceOp};

use crate::base::bootstrap::Store;
use crate::base::call::Kind;
use crate::base::config::{ipc_barrier_from_name, ipc_barrier_name};
use crate::base::error::{Error, Result};
use crate::base::tuning::AlgoOverride;
use crate::device::staging::{wait_event, Backoff, Flag};
use crate::transport::{same_node, CanConnect, Group, Links, Memory, Transport};
use plan::{
    execute, ipc_plan, Bases, Cursor, Exec, HostBarrier, ERR_ABORTED, ERR_MISMATCH, ERR_TIMEOUT,
    FLAGS_BYTES, MAX_RANKS,
};

/// Byte offset, in a scratch allocation, of the device error word (after the flag words).
const DEV_ERROR_OFFSET: usize = 2 * MAX_RANKS * 8;

/// Longest wait at tear-down, for the last operation and for the peers.
const TEARDOWN_WAIT: Duration = Duration::from_secs(30);

/// Operations remembered to name the one a failed barrier belonged to.
const HISTORY: usize = 64;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

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
    fn holders(&self, key: &K) -> usize {
        lock(&self.map).get(key).map_or(0, |e| e.1)
    }
}

/// Peer allocations opened through CUDA IPC, keyed by (context, handle).
type MapKey = (usize, [u8; 64]);

fn mapped() -> &'static RegCache<MapKey, sys::CUdeviceptr> {
    static MAPPED: OnceLock<RegCache<MapKey, sys::CUdeviceptr>> = OnceLock::new();
    MAPPED.get_or_init(RegCache::new)
}

/// A number that identifies this process among every process of the node (process ids repeat
/// across PID namespaces): random, drawn once.
fn process_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static NONCE: OnceLock<u64> = OnceLock::new();
    *NONCE.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.write_u128(t.as_nanos());
        }
        h.finish()
    })
}

/// What a rank publishes at set-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Record {
    /// Its scratch: process (nonce), device ordinal, address in its process, its slot and
    /// one-shot sizes and barrier setting (every rank must use the same), IPC handle.
    Ready {
        nonce: u64,
        ordinal: usize,
        ptr: u64,
        slot: usize,
        one_shot: usize,
        /// `OXCCL_CUDA_IPC_BARRIER`: `None` auto, `Some(true)` host, `Some(false)` device.
        host_barrier: Option<bool>,
        handle: [u8; 64],
    },
    /// Why it cannot take part.
    No(String),
}

impl Record {
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self {
            Record::Ready {
                nonce,
                ordinal,
                ptr,
                slot,
                one_shot,
                host_barrier,
                handle,
            } => {
                let hex: String = handle.iter().map(|b| format!("{b:02x}")).collect();
                let barrier = ipc_barrier_name(*host_barrier);
                format!("ready {nonce:x} {ordinal} {ptr:x} {slot} {one_shot} {barrier} {hex}")
                    .into_bytes()
            }
            Record::No(why) => format!("no {why}").into_bytes(),
        }
    }

    pub(crate) fn decode(b: &[u8]) -> std::result::Result<Record, String> {
        let s = String::from_utf8_lossy(b);
        if let Some(why) = s.strip_prefix("no ") {
            return Ok(Record::No(why.to_string()));
        }
        let bad = || format!("unreadable cuda_ipc record {s:?}");
        let f: Vec<&str> = s.split(' ').collect();
        if f.len() != 8 || f[0] != "ready" || f[7].len() != 128 || !f[7].is_ascii() {
            return Err(bad());
        }
        let mut handle = [0u8; 64];
        for (i, h) in handle.iter_mut().enumerate() {
            *h = u8::from_str_radix(&f[7][2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        let host_barrier = ipc_barrier_from_name(f[6]).ok_or_else(bad)?;
        Ok(Record::Ready {
            nonce: u64::from_str_radix(f[1], 16).map_err(|_| bad())?,
            ordinal: f[2].parse().map_err(|_| bad())?,
            ptr: u64::from_str_radix(f[3], 16).map_err(|_| bad())?,
            slot: f[4].parse().map_err(|_| bad())?,
            one_shot: f[5].parse().map_err(|_| bad())?,
            host_barrier,
            handle,
        })
    }
}

/// Why a communicator of `size` ranks cannot use CUDA IPC at all, from facts every rank knows
/// alike (so no rank waits for records the others will not publish): its collectives need
/// every pair of ranks connected by it (`routed(a, b)`: the selector gave the pair CUDA IPC).
pub(crate) fn shape_reason(size: usize, routed: impl Fn(usize, usize) -> bool) -> Option<String> {
    if size < 2 {
        Some("a single rank".into())
    } else if size > MAX_RANKS {
        Some(format!(
            "{size} ranks (at most {MAX_RANKS} share device memory)"
        ))
    } else if (0..size).any(|a| (a + 1..size).any(|b| !routed(a, b))) {
        Some("ranks on more than one node".into())
    } else {
        None
    }
}

/// The CUDA IPC backend's row in the transport table: device memory between ranks of one node.
/// It connects at a communicator's first device collective, because mapping the peers' memory
/// needs the caller's CUDA context ([`setup`], through the same [`Group`]); at init its set-up
/// and connect have nothing to make.
#[derive(Default)]
pub(crate) struct CudaIpcTransport;

impl Transport for CudaIpcTransport {
    fn name(&self) -> &'static str {
        "cuda_ipc"
    }

    fn memory(&self) -> Memory {
        Memory::Device
    }

    fn can_connect(&self) -> CanConnect {
        same_node
    }

    fn setup(&mut self, _: &Group<'_>, _: &[usize]) -> Result<()> {
        Ok(())
    }

    fn connect(&mut self, _: &Group<'_>, _: &[usize], _: &mut Links) -> Result<()> {
        Ok(())
    }
}

/// The host barriers of a communicator whose ranks are all threads of this process
/// (`OXCCL_CUDA_IPC_BARRIER=host`, the default there): every rank's flag words (the protocol of
/// [`HostBarrier`], in host memory instead of device memory), its error word, and its two
/// events, recorded on its stream at even and odd barriers.
///
/// At barrier `e` a rank records its event `e % 2` on its stream, then meets the others on the
/// flags (its thread waits until every rank has recorded its event for `e`), then makes its
/// stream wait for their events `e % 2`. Every wait on the GPU is then on work already enqueued,
/// which CUDA sees and always drains: no kernel spins, and no ordering hides from the driver
/// (a barrier kernel waits for a peer's kernel its thread may not have launched yet, which
/// deadlocks when the two share a hardware queue, or when that launch waits for the context to go
/// idle). An event is recorded again two barriers later, by which time every peer has enqueued
/// its wait for it (ranks are never more than one barrier apart).
pub(crate) struct ThreadSync {
    flags: Vec<[AtomicU64; 2 * MAX_RANKS]>,
    errors: Vec<AtomicU32>,
    events: Vec<OnceLock<[CudaEvent; 2]>>,
}

impl ThreadSync {
    fn new(size: usize) -> ThreadSync {
        ThreadSync {
            flags: (0..size)
                .map(|_| std::array::from_fn(|_| AtomicU64::new(0)))
                .collect(),
            errors: (0..size).map(|_| AtomicU32::new(0)).collect(),
            events: (0..size).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The barrier state the ranks of communicator `key` share, with `events` as rank `rank`'s.
    /// The key names the ranks' scratch allocations too, which are unique while they live, so a
    /// later communicator with the same id never meets an old one's state.
    fn join(key: String, size: usize, rank: usize, events: [CudaEvent; 2]) -> Arc<ThreadSync> {
        static SYNCS: OnceLock<Mutex<HashMap<String, Weak<ThreadSync>>>> = OnceLock::new();
        let mut map = lock(SYNCS.get_or_init(|| Mutex::new(HashMap::new())));
        let ts = join_in(
            &mut map,
            key,
            |t| t.events.len() == size && t.events[rank].get().is_none(),
            || ThreadSync::new(size),
        );
        let _ = ts.events[rank].set(events);
        ts
    }
}

/// The live value under `key` if `usable` says this rank may join it, else a fresh one (which
/// replaces it); dead entries go.
fn join_in<T>(
    map: &mut HashMap<String, Weak<T>>,
    key: String,
    usable: impl Fn(&T) -> bool,
    fresh: impl FnOnce() -> T,
) -> Arc<T> {
    map.retain(|_, w| w.strong_count() > 0);
    if let Some(t) = map.get(&key).and_then(Weak::upgrade).filter(|t| usable(t)) {
        return t;
    }
    let t = Arc::new(fresh());
    map.insert(key, Arc::downgrade(&t));
    t
}

/// This rank's own part: its scratch allocation, error word and kernels.
struct Local {
    ctx: Arc<CudaContext>,
    kernels: Arc<CudaKernels>,
    scratch: sys::CUdeviceptr,
    handle: [u8; 64],
    /// Written by barrier kernels: dropped only when `leak` is not set.
    error: std::mem::ManuallyDrop<Flag>,
    /// Recorded after every operation (they are chained, so the last one covers all).
    done: CudaEvent,
    /// Leave the memory allocated when dropped (a kernel may still use it).
    leak: bool,
}

impl Local {
    fn new(
        rank: usize,
        stream: &Arc<CudaStream>,
        slot_bytes: usize,
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
        let bytes = FLAGS_BYTES + 2 * slot_bytes;
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
            // SAFETY: the first FLAGS_BYTES of the allocation made above.
            unsafe { sys::cuMemsetD8Async(scratch, 0, FLAGS_BYTES, stream.cu_stream()) }
                .result()?;
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

/// A communicator's CUDA IPC state, made by [`setup`].
pub(crate) struct IpcState {
    local: Local,
    /// Every rank's scratch as this process addresses it (this rank's own included).
    bases: Vec<u64>,
    /// Cache keys of the peers' allocations this rank opened, to give back.
    opened: Vec<MapKey>,
    /// Contexts of other GPUs this rank's peers (threads of this process) use.
    _peer_ctxs: Vec<Arc<CudaContext>>,
    /// Barriers on the host (every rank a thread of this process), else the barrier kernel.
    host_barrier: Option<Arc<ThreadSync>>,
    /// This rank hosts the store server: it leaves tear-down last.
    hosts_store: bool,
    slot_bytes: usize,
    one_shot: usize,
    /// `OXCCL_ALGO`: ring steps, or one-shot / two-shot all-reduce, where it asks for them.
    algo: AlgoOverride,
    cur: Cursor,
    /// Operations so far (the sequence number in errors).
    ops: u64,
    /// The stream of the last operation (held, so its handle cannot be reused meanwhile).
    last_stream: Option<Arc<CudaStream>>,
    /// (first barrier epoch, sequence number, description) of recent operations.
    history: VecDeque<(u32, u64, Kind, DType, usize)>,
    store: Arc<dyn Store>,
    id: String,
    rank: usize,
    size: usize,
    timeout: Duration,
}

// SAFETY: the device addresses are plain numbers; everything else is Send (the raw pointer in
// `Flag` is covered by its own Send impl).
unsafe impl Send for IpcState {}

/// Joins (or declines) CUDA IPC for the device collectives of the communicator `comm`
/// describes, on every rank alike.
///
/// `Ok(None)`: stage through host memory instead (the reason is logged).
///
/// # Errors
/// `Cuda` when `OXCCL_CUDA_IPC=1` and some rank cannot take part (naming it and why), when the
/// store fails, or when a rank does not reach a step of the set-up in time (naming it).
pub(crate) fn setup(
    comm: &Group<'_>,
    stream: &Arc<CudaStream>,
    op: &str,
) -> Result<Option<IpcState>> {
    let cfg = &comm.cfg;
    let ctx = stream.context();
    let (rank, size) = (comm.rank, comm.size);
    let store_err = |e: Error| Error::Cuda {
        rank,
        op: op.into(),
        msg: format!("cuda_ipc set-up (communicator {}): {e}", comm.id),
    };
    let declined = |why: String| -> Result<Option<IpcState>> {
        if cfg.cuda_ipc == Some(true) {
            Err(Error::Cuda {
                rank,
                op: op.into(),
                msg: format!("OXCCL_CUDA_IPC=1, but CUDA IPC cannot be used: {why}"),
            })
        } else {
            tracing::info!(rank, "device collectives staged through host memory: {why}");
            Ok(None)
        }
    };
    let routed = |a: usize, b: usize| {
        comm.selector.device(&comm.peers[a], &comm.peers[b]) == Some("cuda_ipc")
    };
    if let Some(why) = shape_reason(size, routed) {
        return declined(why);
    }
    let local = if cfg.cuda_ipc == Some(false) {
        Err("OXCCL_CUDA_IPC=0".to_string())
    } else {
        Local::new(rank, stream, cfg.cuda_ipc_slot, cfg.timeout)
    };
    tracing::trace!(rank, "cuda: cuda_ipc set-up: publishing the record");
    let mine = match &local {
        Ok(l) => Record::Ready {
            nonce: process_nonce(),
            ordinal: ctx.ordinal(),
            ptr: l.scratch,
            slot: cfg.cuda_ipc_slot,
            one_shot: cfg.cuda_ipc_one_shot,
            host_barrier: cfg.cuda_ipc_host_barrier,
            handle: l.handle,
        },
        Err(why) => Record::No(why.clone()),
    };
    // The wait for the peers starts now, not before our own set-up: a rank's first device
    // collective compiles and loads the kernels, 15 s on a machine whose caches are empty
    // (measured on an H200), and that must not eat into the time we give the others.
    let deadline = Instant::now() + cfg.timeout;
    let key = |what: &str, q: usize| format!("{}/cuda_ipc/{what}/{q}", comm.id);
    let store = &comm.store;
    let gather = |what: &str, value: &[u8]| -> Result<Vec<Vec<u8>>> {
        store.set(&key(what, rank), value).map_err(store_err)?;
        (0..size)
            .map(|q| {
                store
                    .get(
                        &key(what, q),
                        deadline.saturating_duration_since(Instant::now()),
                    )
                    .map_err(|e| match e {
                        Error::Store(m) if crate::base::bootstrap::is_wait_timeout(&m) => {
                            Error::Cuda {
                                rank,
                                op: op.into(),
                                msg: format!(
                                    "cuda_ipc set-up (communicator {}): rank {q} did not \
                                 reach the '{what}' step within OXCCL_TIMEOUT ({:?}); a \
                                 rank's first device collective compiles and loads the \
                                 kernels (about 15 s with empty caches, OXCCL_CACHE_DIR \
                                 keeps them): {m}",
                                    comm.id, cfg.timeout
                                ),
                            }
                        }
                        other => store_err(other),
                    })
            })
            .collect()
    };
    // Once our record is out, peers may map our scratch and (if they never see a refusal)
    // write into it: from here on a failure leaks it instead of freeing it.
    let records = match gather("record", &mine.encode()) {
        Ok(r) => r,
        Err(e) => {
            if let Ok(mut l) = local {
                l.leak = true;
            }
            return Err(e);
        }
    };
    let mut local = match local {
        Ok(l) => l,
        Err(_) => {
            // Our own "no" is among the records: every rank declines with the first reason.
            return declined(first_refusal(&records).unwrap_or_default());
        }
    };
    if let Some(why) = first_refusal(&records) {
        // Every rank read the same records: nobody maps anything, our scratch can go.
        return declined(why);
    }
    local.leak = true;
    let peers: Vec<Record> = records
        .iter()
        .map(|b| Record::decode(b).unwrap_or(Record::No(String::new())))
        .collect();

    // Map every peer's scratch.
    tracing::trace!(rank, "cuda: cuda_ipc set-up: mapping the peers");
    let mut bases = vec![0u64; size];
    let mut opened = Vec::new();
    let mut peer_ctxs = Vec::new();
    let mut failure = None;
    for (q, rec) in peers.iter().enumerate() {
        let Record::Ready {
            nonce,
            ordinal,
            ptr,
            handle,
            ..
        } = rec
        else {
            continue;
        };
        if q == rank {
            bases[q] = local.scratch;
            continue;
        }
        let r = if *nonce == process_nonce() {
            same_process_peer(ctx, *ordinal, &mut peer_ctxs).map(|()| *ptr)
        } else {
            let k = (ctx.cu_ctx() as usize, *handle);
            let r = mapped().acquire(&k, || open_handle(handle));
            if r.is_ok() {
                opened.push(k);
            }
            r
        };
        match r {
            Ok(p) => bases[q] = p,
            Err(e) => {
                failure = Some(format!("mapping rank {q}'s device memory: {e}"));
                break;
            }
        }
    }
    // Mapping may have made another context current.
    if let Err(e) = ctx.bind_to_thread() {
        failure.get_or_insert(format!("binding the context: {e:?}"));
    }
    // Every rank a thread of this process: barriers on the host (decided alike on every rank,
    // from the records they all read).
    let all_here = peers
        .iter()
        .all(|r| matches!(r, Record::Ready { nonce, .. } if *nonce == process_nonce()));
    let mut events = None;
    if all_here && cfg.cuda_ipc_host_barrier != Some(false) && failure.is_none() {
        match ctx
            .new_event(None)
            .and_then(|a| Ok([a, ctx.new_event(None)?]))
        {
            Ok(e) => events = Some(e),
            Err(e) => failure = Some(format!("creating the barrier events: {e:?}")),
        }
    } else if all_here && cfg.cuda_ipc_host_barrier == Some(false) && rank == 0 && failure.is_none()
    {
        tracing::warn!(
            rank,
            "OXCCL_CUDA_IPC_BARRIER=device with every rank a thread of this process: a barrier \
             kernel waits on the GPU for a peer's kernel its thread may not have enqueued yet, \
             and a driver call on that thread that waits for the whole context (cuMemFree, \
             pinned host allocation, module loading; copies to pageable memory and \
             stream-ordered allocation were seen to; also the pinned buffers of staged \
             send/recv) then waits for the barrier kernel: stuck until OXCCL_TIMEOUT. Make the \
             rank threads meet on the host before any enqueues a collective and after all \
             have, or use OXCCL_CUDA_IPC_BARRIER=auto, which meets these barriers on the host"
        );
    } else if !all_here && cfg.cuda_ipc_host_barrier == Some(true) {
        tracing::info!(
            rank,
            "OXCCL_CUDA_IPC_BARRIER=host needs every rank in this process; barriers run on the \
             device"
        );
    }
    let verdict = match &failure {
        None => b"ok".to_vec(),
        Some(why) => format!("no {why}").into_bytes(),
    };
    tracing::trace!(rank, "cuda: cuda_ipc set-up: publishing the verdict");
    let verdicts = gather("mapped", &verdict);
    let refused = match &verdicts {
        Ok(v) => v
            .iter()
            .enumerate()
            .find(|(_, b)| b.as_slice() != b"ok")
            .map(|(q, b)| format!("rank {q}: {}", String::from_utf8_lossy(b))),
        Err(e) => Some(e.to_string()),
    };
    if let Some(why) = refused {
        // Our mappings of the peers go (no kernel of ours used them).
        for k in &opened {
            mapped().release(k, close_handle);
        }
        // Every rank read the same verdicts and declines, so no kernel runs on anyone's
        // scratch: once every rank has let go of its mappings ("declined"), ours can be freed.
        // That round gets a bound of its own (a slow "mapped" round may have spent the set-up's).
        // If the verdicts or that round failed, a peer may still map (or, having seen every
        // verdict as "ok", use) it: it stays allocated.
        let freed = match &verdicts {
            Ok(_) => {
                let bound = Instant::now() + cfg.timeout.min(TEARDOWN_WAIT);
                store.set(&key("declined", rank), b"1").is_ok()
                    && (0..size).all(|q| {
                        let left = deadline
                            .max(bound)
                            .saturating_duration_since(Instant::now());
                        store.get(&key("declined", q), left).is_ok()
                    })
            }
            Err(_) => {
                // Peers whose verdicts came through wait for our word: our mappings are gone.
                let _ = store.set(&key("declined", rank), b"1");
                false
            }
        };
        local.leak = !freed;
        if !freed {
            tracing::warn!(
                rank,
                "cuda_ipc set-up refused without every rank confirming in time that it \
                 unmapped this rank's device scratch: {} bytes left allocated",
                FLAGS_BYTES + 2 * cfg.cuda_ipc_slot
            );
        }
        drop(local);
        drop(events);
        // Dropping another GPU's context leaves it current on this thread: give the caller's
        // thread this rank's context back (not `bind_to_thread`, which skips the binding when
        // the context has a recorded error).
        drop(peer_ctxs);
        // SAFETY: the context handle is live (held by `ctx`).
        let _ = unsafe { result::ctx::set_current(ctx.cu_ctx()) };
        verdicts?;
        if cfg.cuda_ipc == Some(true) {
            return declined(why);
        }
        // Unlike the other refusals (several nodes, OXCCL_CUDA_IPC=0, no driver), this one
        // comes from the GPUs (no peer access between two of them, say): worth a warning, the
        // staged path being many times slower. Rank 0's says it for all.
        if rank == 0 {
            tracing::warn!(
                rank,
                "device collectives staged through host memory: CUDA IPC set-up failed: {why}"
            );
        } else {
            tracing::info!(rank, "device collectives staged through host memory: {why}");
        }
        return Ok(None);
    }
    local.leak = false;
    let host_barrier =
        events.map(|e| ThreadSync::join(format!("{}/{bases:x?}", comm.id), size, rank, e));
    tracing::debug!(
        rank,
        size,
        barrier = if host_barrier.is_some() {
            "host"
        } else {
            "device"
        },
        "device collectives over cuda_ipc"
    );
    Ok(Some(IpcState {
        local,
        bases,
        opened,
        _peer_ctxs: peer_ctxs,
        host_barrier,
        hosts_store: comm.hosts_store,
        slot_bytes: cfg.cuda_ipc_slot,
        one_shot: cfg.cuda_ipc_one_shot,
        algo: cfg.algo.clone(),
        cur: Cursor::default(),
        ops: 0,
        last_stream: None,
        history: VecDeque::new(),
        store: Arc::clone(comm.store),
        id: comm.id.to_string(),
        rank,
        size,
        timeout: cfg.timeout,
    }))
}

/// The first rank that refused, and why (also for records that cannot be read, or that disagree
/// on the slot or one-shot size).
fn first_refusal(records: &[Vec<u8>]) -> Option<String> {
    let mut sizes = None;
    for (q, b) in records.iter().enumerate() {
        match Record::decode(b) {
            Ok(Record::No(why)) => return Some(format!("rank {q}: {why}")),
            Err(e) => return Some(format!("rank {q}: {e}")),
            Ok(Record::Ready {
                slot,
                one_shot,
                host_barrier,
                ..
            }) => match sizes {
                None => sizes = Some((slot, one_shot, host_barrier)),
                Some(s) if s != (slot, one_shot, host_barrier) => {
                    return Some(format!(
                        "rank {q} has OXCCL_CUDA_IPC_SLOT={slot}, OXCCL_CUDA_IPC_ONE_SHOT=\
                         {one_shot} and OXCCL_CUDA_IPC_BARRIER={}, rank 0 {}, {} and {} (every \
                         rank must use the same)",
                        ipc_barrier_name(host_barrier),
                        s.0,
                        s.1,
                        ipc_barrier_name(s.2)
                    ))
                }
                Some(_) => {}
            },
        }
    }
    None
}

/// A peer rank that is a thread of this process: its address works as it is, once this context
/// may reach its device (the peer device's context is kept in `keep`: dropping it would make it
/// current on this thread).
fn same_process_peer(
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

fn open_handle(handle: &[u8; 64]) -> std::result::Result<sys::CUdeviceptr, String> {
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

fn close_handle(p: sys::CUdeviceptr) {
    // SAFETY: `p` came from cuIpcOpenMemHandle and its last user gave it back.
    let _ = unsafe { sys::cuIpcCloseMemHandle(p) };
}

/// Why enqueueing an IPC operation stopped.
enum Stop {
    /// A CUDA call failed.
    Cuda(String),
    /// A host barrier failed: its error word (`ERR_* | peer << 8`) and epoch.
    Barrier(u32, u32),
}

/// The stream work of an IPC plan on a GPU.
struct GpuExec<'a> {
    stream: &'a Arc<CudaStream>,
    kernels: &'a CudaKernels,
    dt: DType,
    op: ReduceOp,
    rank: usize,
    size: usize,
    flags: &'a [u64],
    dev_error: u64,
    host_error: u64,
    /// Barriers on the host, with these events and flags.
    host: Option<&'a ThreadSync>,
    /// `Communicator::abort`'s flag, which a host barrier's wait watches.
    abort: &'a AtomicBool,
    timeout: Duration,
}

impl GpuExec<'_> {
    /// A barrier met on the host (see [`ThreadSync`]).
    ///
    /// A CUDA call that fails here poisons this rank's flags as a failed wait does, so that the
    /// peers stop at this barrier or the next instead of waiting for their time-out.
    fn host_barrier(&self, ts: &ThreadSync, epoch: u32, sig: u32) -> std::result::Result<(), Stop> {
        let at = HostBarrier {
            rank: self.rank,
            size: self.size,
            error: &ts.errors[self.rank],
            deadline: Instant::now() + self.timeout,
            abort: Some(self.abort),
        };
        let flag = |q: usize, i: usize| &ts.flags[q][i];
        let fail = |msg: String| {
            at.poison(&flag, epoch, ERR_ABORTED | (self.rank as u32) << 8);
            Stop::Cuda(msg)
        };
        let k = (epoch % 2) as usize;
        let events = |q: usize| {
            ts.events[q]
                .get()
                .ok_or_else(|| fail(format!("rank {q}'s barrier events are missing")))
        };
        events(self.rank)?[k]
            .record(self.stream)
            .map_err(|e| fail(format!("recording the barrier event: {e:?}")))?;
        let mut backoff = Backoff::new();
        at.wait(flag, epoch, sig, || backoff.pause())
            .map_err(|code| Stop::Barrier(code, epoch))?;
        for q in (0..self.size).filter(|&q| q != self.rank) {
            self.stream
                .wait(&events(q)?[k])
                .map_err(|e| fail(format!("waiting for rank {q}'s barrier event: {e:?}")))?;
        }
        Ok(())
    }
}

impl Exec for GpuExec<'_> {
    type Error = Stop;

    fn copy(&mut self, dst: u64, src: u64, len: usize) -> std::result::Result<(), Stop> {
        // SAFETY: the plan addresses only the caller's buffers (lengths checked) and the mapped
        // scratch allocations, inside their bounds (`ipc_plan` keeps to the slots); the
        // barriers order every read of a peer's slot after its writes.
        unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, self.stream.cu_stream()) }
            .result()
            .map_err(|e| Stop::Cuda(format!("copy: {e:?}")))
    }

    fn reduce(&mut self, dst: u64, inputs: &[u64], len: usize) -> std::result::Result<(), Stop> {
        // SAFETY: as for `copy`; `dst` is the output or this rank's slot, and equals an input
        // at most (two-shot reduces its own shard in place).
        unsafe {
            self.kernels
                .reduce_raw(self.stream, self.dt, self.op, dst, inputs, len)
        }
        .map_err(|e| Stop::Cuda(e.to_string()))
    }

    fn avg(&mut self, dst: u64, len: usize) -> std::result::Result<(), Stop> {
        // SAFETY: as for `copy`.
        unsafe {
            self.kernels
                .finish_avg_raw(self.stream, self.dt, dst, len, self.size)
        }
        .map_err(|e| Stop::Cuda(e.to_string()))
    }

    fn barrier(&mut self, epoch: u32, sig: u32) -> std::result::Result<(), Stop> {
        if let Some(ts) = self.host {
            return self.host_barrier(ts, epoch, sig);
        }
        // SAFETY: every flag array is the start of a live scratch allocation mapped here; the
        // error words live as long as the communicator's IPC state, which outlives the kernel
        // (tear-down waits for the last operation's event, or leaks them).
        unsafe {
            self.kernels.ipc_barrier(
                self.stream,
                self.flags,
                self.rank,
                epoch,
                sig,
                u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX),
                self.dev_error,
                self.host_error,
            )
        }
        .map_err(|e| Stop::Cuda(e.to_string()))
    }
}

impl IpcState {
    /// The failure a barrier reported, as an error naming the peer and the operation.
    pub(crate) fn failure(&self) -> Option<Error> {
        let code = self.local.error.word(0);
        if code == 0 {
            return None;
        }
        Some(self.barrier_error(code, self.local.error.word(1)))
    }

    /// The error for a barrier's error word `code` at barrier `epoch`.
    fn barrier_error(&self, code: u32, epoch: u32) -> Error {
        let peer = (code >> 8) as usize;
        let where_ = if self.host_barrier.is_some() {
            "host"
        } else {
            "device"
        };
        // The operation whose barriers include `epoch`: the last one that started at or before.
        let (seq, what) = self
            .history
            .iter()
            .rev()
            .find(|(first, ..)| epoch.wrapping_sub(*first) < (1 << 31))
            .map_or(
                (self.ops, "a device collective".to_string()),
                |&(_, s, kind, dt, count)| (s, describe(kind, dt, count)),
            );
        match code & 0xff {
            ERR_MISMATCH => Error::Mismatch {
                rank: self.rank,
                peer,
                seq,
                local: format!("{what} (cuda_ipc)"),
                remote: "a different device collective, dtype, root or count".into(),
            },
            ERR_ABORTED => Error::Aborted {
                rank: self.rank,
                reason: format!(
                    "rank {peer} gave up at {where_} barrier {epoch} of {what} (cuda_ipc, device \
                     op #{seq}); this operation's results are undefined"
                ),
            },
            ERR_TIMEOUT => Error::Timeout {
                rank: self.rank,
                op: format!("{what} (cuda_ipc, device op #{seq})"),
                timeout: self.timeout,
                detail: format!("rank {peer} did not reach {where_} barrier {epoch}"),
            },
            other => Error::Cuda {
                rank: self.rank,
                op: what,
                msg: format!(
                    "the cuda_ipc barrier refused to run (error word {other:#x}: bad arguments, \
                     or a device older than sm_70)"
                ),
            },
        }
    }

    /// Enqueues one collective on `stream`.
    ///
    /// # Errors
    /// `Cuda` when enqueueing fails (the communicator's device collectives are unusable after
    /// that: ranks would disagree on the barrier count); with barriers on the host, also what a
    /// barrier found (`Timeout`, `Mismatch`, `Aborted`), as the barrier kernel reports it later.
    /// `abort` is `Communicator::abort`'s flag: a barrier met on the host gives up when it is set.
    pub(crate) fn run(
        &mut self,
        stream: &Arc<CudaStream>,
        call: &IpcCall,
        abort: &AtomicBool,
    ) -> Result<()> {
        self.enqueue(stream, call, abort)
            .map_err(|stop| match stop {
                Stop::Cuda(msg) => Error::Cuda {
                    rank: self.rank,
                    op: call.kind.name().into(),
                    msg: format!("enqueueing over cuda_ipc: {msg}"),
                },
                Stop::Barrier(code, epoch) => self.barrier_error(code, epoch),
            })
    }

    fn enqueue(
        &mut self,
        stream: &Arc<CudaStream>,
        &IpcCall {
            kind,
            dt,
            count,
            input,
            output,
        }: &IpcCall,
        abort: &AtomicBool,
    ) -> std::result::Result<(), Stop> {
        let Some(plan) = ipc_plan(
            kind,
            dt,
            self.rank,
            self.size,
            count,
            self.slot_bytes,
            self.one_shot,
            kind.collective().and_then(|c| self.algo.get(c)),
        ) else {
            return Err(Stop::Cuda(format!(
                "{} does not run over cuda_ipc",
                kind.name()
            )));
        };
        let cu = stream.cu_stream();
        if self
            .last_stream
            .as_ref()
            .is_some_and(|s| s.cu_stream() != cu)
        {
            // The barrier protocol needs this communicator's operations in order on the GPU.
            stream
                .wait(&self.local.done)
                .map_err(|e| Stop::Cuda(format!("ordering after the previous operation: {e:?}")))?;
        }
        self.history
            .push_back((self.cur.epoch.wrapping_add(1), self.ops, kind, dt, count));
        if self.history.len() > HISTORY {
            self.history.pop_front();
        }
        let bases = Bases {
            input,
            output,
            scratch: &self.bases,
            slot_bytes: self.slot_bytes,
        };
        let mut exec = GpuExec {
            stream,
            kernels: &self.local.kernels,
            dt,
            op: kind.op(),
            rank: self.rank,
            size: self.size,
            flags: &self.bases,
            dev_error: self.local.scratch + DEV_ERROR_OFFSET as u64,
            host_error: self.local.error.device_ptr(),
            host: self.host_barrier.as_deref(),
            abort,
            timeout: self.timeout,
        };
        let r = execute(&plan, &bases, &mut self.cur, &mut exec);
        self.ops += 1;
        self.last_stream = Some(Arc::clone(stream));
        let recorded = self
            .local
            .done
            .record(stream)
            .map_err(|e| Stop::Cuda(format!("recording the done event: {e:?}")));
        r.and(recorded)
    }
}

/// One collective as [`IpcState::run`] takes it: `count` as [`ipc_plan`] takes it, `input` and
/// `output` the device addresses (0 where this rank has no such buffer).
pub(crate) struct IpcCall {
    pub kind: Kind,
    pub dt: DType,
    pub count: usize,
    pub input: u64,
    pub output: u64,
}

/// An operation as errors name it.
fn describe(kind: Kind, dt: DType, count: usize) -> String {
    let root = match kind {
        Kind::Broadcast { root }
        | Kind::Reduce { root, .. }
        | Kind::Gather { root }
        | Kind::Scatter { root } => format!(", root {root}"),
        _ => String::new(),
    };
    let op = match kind {
        Kind::AllReduce(op) | Kind::ReduceScatter(op) | Kind::Reduce { op, .. } => {
            format!(" {}", op.name())
        }
        _ => String::new(),
    };
    format!("{}{op} of {count} x {}{root}", kind.name(), dt.short_name())
}

impl Drop for IpcState {
    fn drop(&mut self) {
        let deadline = Instant::now() + self.timeout.min(TEARDOWN_WAIT);
        // SAFETY: the context handle is live (held by `self.local.ctx`).
        let _ = unsafe { result::ctx::set_current(self.local.ctx.cu_ctx()) };
        let idle =
            self.last_stream.is_none() || wait_event(&self.local.done, deadline).unwrap_or(false);
        let key = |what: &str, q: usize| format!("{}/cuda_ipc/{what}/{q}", self.id);
        let round = |what: &str| {
            self.store.set(&key(what, self.rank), b"1").is_ok()
                && (0..self.size).all(|q| {
                    let left = deadline.saturating_duration_since(Instant::now());
                    self.store.get(&key(what, q), left).is_ok()
                })
        };
        // 1. Nobody's kernels use anyone's scratch any more; 2. everybody unmapped the others'
        // (freeing memory another process still maps is undefined); 3. free our own.
        let done = idle && round("bye");
        if done {
            for k in &self.opened {
                mapped().release(k, close_handle);
            }
        }
        let closed = done && round("closed");
        if closed {
            self.local.leak = false;
        } else {
            self.local.leak = true;
            tracing::warn!(
                rank = self.rank,
                comm = %self.id,
                "cuda_ipc tear-down: the last operation or a peer did not finish in time; \
                 device scratch{} left allocated",
                if done { "" } else { " and peer mappings" }
            );
        }
        // Another GPU's context or event dropped on this thread leaves that context current:
        // drop those now and give the thread this rank's context back (the fields dropped
        // after this body only bind this rank's context).
        self._peer_ctxs.clear();
        self.host_barrier = None;
        // SAFETY: the context handle is live (held by `self.local.ctx`).
        let _ = unsafe { result::ctx::set_current(self.local.ctx.cu_ctx()) };
        // The rank that hosts the store leaves last, so every peer can finish its rounds.
        let gone = format!("{}/cuda_ipc/gone", self.id);
        if self.store.add(&gone, 1).is_ok() && self.hosts_store {
            let mut backoff = Duration::from_micros(100);
            while Instant::now() < deadline
                && self.store.add(&gone, 0).is_ok_and(|n| n < self.size as i64)
            {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(20));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_ipc_records_round_trip_and_bad_ones_are_errors() {
        let mut handle = [0u8; 64];
        for (i, h) in handle.iter_mut().enumerate() {
            *h = (i * 37) as u8;
        }
        let with_barrier = |host_barrier| Record::Ready {
            nonce: 0xfeed_f00d_1234_5678,
            ordinal: 3,
            ptr: 0x7f00_dead_beef,
            slot: 4 << 20,
            one_shot: 256 << 10,
            host_barrier,
            handle,
        };
        let r = with_barrier(None);
        for b in [None, Some(true), Some(false)] {
            let r = with_barrier(b);
            assert_eq!(Record::decode(&r.encode()), Ok(r));
        }
        let no = Record::No("no CUDA driver (libcuda.so)".into());
        assert_eq!(Record::decode(&no.encode()), Ok(no.clone()));
        for bad in ["", "ready 1 2 3", "ready x 0 0 00", "maybe"] {
            assert!(Record::decode(bad.as_bytes()).is_err(), "{bad:?}");
        }
        // Refusals and disagreements are found, naming the rank.
        let other = Record::Ready {
            nonce: 1,
            ordinal: 0,
            ptr: 0x1000,
            slot: 1 << 20,
            one_shot: 256 << 10,
            host_barrier: None,
            handle,
        };
        let recs = |v: &[&Record]| v.iter().map(|r| r.encode()).collect::<Vec<_>>();
        assert_eq!(first_refusal(&recs(&[&r, &r])), None);
        let why = first_refusal(&recs(&[&r, &no])).unwrap();
        assert!(why.starts_with("rank 1: no CUDA driver"), "{why}");
        let why = first_refusal(&recs(&[&r, &r, &other])).unwrap();
        assert!(
            why.contains("rank 2") && why.contains("OXCCL_CUDA_IPC_SLOT=1048576"),
            "{why}"
        );
        let device = with_barrier(Some(false));
        let why = first_refusal(&recs(&[&r, &device])).unwrap();
        assert!(
            why.contains("rank 1") && why.contains("OXCCL_CUDA_IPC_BARRIER=device"),
            "{why}"
        );
    }

    #[test]
    fn cuda_ipc_host_barrier_state_is_shared_by_one_world_only() {
        // Each rank of a world takes its slot; the ranks of a world meet in one state, and a
        // world whose key is still held by a full old one gets its own.
        type Slots = Vec<OnceLock<()>>;
        let mut map: HashMap<String, Weak<Slots>> = HashMap::new();
        let take = |map: &mut HashMap<String, Weak<Slots>>, key: &str, rank: usize| {
            let t = join_in(
                map,
                key.into(),
                |t: &Slots| t.len() == 2 && t[rank].get().is_none(),
                || vec![OnceLock::new(), OnceLock::new()],
            );
            t[rank].set(()).unwrap();
            t
        };
        let a0 = take(&mut map, "w", 0);
        let a1 = take(&mut map, "w", 1);
        assert!(Arc::ptr_eq(&a0, &a1));
        let b0 = take(&mut map, "w", 0);
        assert!(!Arc::ptr_eq(&a0, &b0));
        assert!(Arc::ptr_eq(&b0, &take(&mut map, "w", 1)));
        assert!(!Arc::ptr_eq(&a0, &take(&mut map, "v", 0)));
        drop((a0, a1, b0));
        let _ = take(&mut map, "u", 0);
        assert_eq!(map.len(), 1, "entries of dropped worlds go");
    }

    #[test]
    fn cuda_ipc_process_nonce_is_stable_within_a_process() {
        assert_eq!(process_nonce(), process_nonce());
    }

    #[test]
    fn cuda_ipc_shape_is_decided_from_facts_every_rank_shares() {
        let nodes = |ids: &'static [&'static str]| move |a: usize, b: usize| ids[a] == ids[b];
        assert!(shape_reason(1, nodes(&["a"])).is_some());
        assert!(shape_reason(3, nodes(&["a", "a", "b"]))
            .unwrap()
            .contains("more than one node"));
        assert!(shape_reason(9, nodes(&["a"; 9]))
            .unwrap()
            .contains("at most 8"));
        assert_eq!(shape_reason(8, nodes(&["a"; 8])), None);
    }

    #[test]
    fn cuda_ipc_registration_cache_maps_once_and_unmaps_after_the_last_user() {
        let cache: RegCache<u32, u64> = RegCache::new();
        let opens = std::cell::Cell::new(0);
        let open = || -> std::result::Result<u64, ()> {
            opens.set(opens.get() + 1);
            Ok(0x1000)
        };
        assert_eq!(cache.acquire(&7, open), Ok(0x1000));
        assert_eq!(cache.acquire(&7, open), Ok(0x1000));
        assert_eq!((opens.get(), cache.holders(&7)), (1, 2));
        let closed = std::cell::Cell::new(0);
        cache.release(&7, |_| closed.set(closed.get() + 1));
        assert_eq!((closed.get(), cache.holders(&7)), (0, 1));
        cache.release(&7, |v| {
            assert_eq!(v, 0x1000);
            closed.set(closed.get() + 1);
        });
        assert_eq!((closed.get(), cache.holders(&7)), (1, 0));
        // A failed open is not cached; releasing an unknown key does nothing.
        assert_eq!(cache.acquire(&8, || Err::<u64, ()>(())), Err(()));
        cache.release(&8, |_| panic!("nothing to close"));
        assert_eq!(cache.acquire(&7, open), Ok(0x1000));
        assert_eq!(opens.get(), 2);
    }
}
