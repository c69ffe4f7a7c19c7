//! The `cuda_ipc` transport: device collectives among the ranks of one node, read straight out
//! of each other's device memory, ordered on the caller's stream with no host round trip.
//!
//! **Set-up** (the first device collective of a communicator whose ranks all share a node, at most
//! [`MAX_RANKS`](plan::MAX_RANKS) of them): every rank allocates one scratch buffer in device
//! memory (flags and two slots, see [`plan`]), takes its CUDA IPC handle (`cuIpcGetMemHandle`) and
//! publishes a record through the communicator's store: process id, device, address, handle, or why
//! it cannot take part. When every record is usable, each rank maps every peer's scratch: the plain
//! address for ranks in the same process (IPC handles cannot be opened by the process that made
//! them), `cuIpcOpenMemHandle` (peer access enabled lazily, so ranks on different GPUs work too)
//! for the others, through a process-wide cache keyed by context and handle, so an allocation is
//! mapped once however many communicators use it. A second round through the store confirms every
//! rank mapped everything. If any rank cannot, every rank falls back to staging through host memory
//! (`OXCCL_CUDA_IPC=1` makes that an error instead).
//!
//! **An operation** is the steps of its [`IpcPlan`](plan::IpcPlan), enqueued on the caller's
//! stream: copies (`cuMemcpyDtoDAsync`), the reduce kernels of `oxccl-kernels` with one input per
//! rank's slot, and the barrier kernel (`oxccl_ipc_barrier`: device flags, a deadline, mismatch
//! detection). The call returns once enqueued. When every rank is a thread of this process, the
//! barriers are met on the host instead ([`ThreadSync`]: the same flag protocol in host memory,
//! then CUDA events between the streams), and a barrier's failures come back from the call itself.
//! Operations of one communicator on different streams are chained (each waits for the previous
//! one's event), since the barrier protocol needs them in order.
//!
//! **Failures** the barrier detects (a rank that never arrives within `OXCCL_TIMEOUT`, a rank
//! that called something else) land in a device-mapped host word; the next call, and
//! [`Communicator::device_async_error`](crate::Communicator::device_async_error), turn it into an
//! [`Error::Timeout`](crate::base::error::Error::Timeout) or
//! [`Error::Mismatch`](crate::base::error::Error::Mismatch) naming the peer and the operation.
//!
//! **Tear-down**: when the communicator is dropped, each rank waits (bounded) for its last
//! operation, says so through the store and waits (bounded) for every peer to say the same
//! before it unmaps peers and frees its scratch; whatever cannot be confirmed is leaked rather
//! than freed under a kernel that may still read it. Ranks that are all threads of this process
//! (barriers met on the host) skip the rounds, so one thread may drop them one after another:
//! each hands its scratch to the world's shared state, which frees them all when the last rank
//! has left.

mod exec;
mod p2p;
mod p2p_exec;
pub(crate) mod plan;
mod registration;
mod setup;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{result, CudaContext, CudaStream};
use oxccl_kernels::DType;

use crate::base::bootstrap::Store;
use crate::base::call::Kind;
use crate::base::error::Result;
use crate::base::tuning::AlgoOverride;
use crate::device::staging::wait_event;
use crate::transport::{same_node, CanConnect, Group, Links, Memory, Transport};
use exec::ThreadSync;
use p2p::{P2pCursor, P2pLayout};
use plan::Cursor;
use registration::{close_handle, mapped, Local, MapKey};

pub(crate) use exec::IpcCall;
pub(crate) use p2p_exec::P2pMsg;
pub(crate) use setup::setup;

/// Longest wait at tear-down, for the last operation and for the peers.
const TEARDOWN_WAIT: Duration = Duration::from_secs(30);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The CUDA IPC backend's row in the transport table: device memory between ranks of one node.
/// It connects at a communicator's first device collective, because mapping the peers' memory
/// needs the caller's CUDA context ([`setup()`], through the same [`Group`]); at init its set-up
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

/// A communicator's CUDA IPC state, made by [`setup()`].
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
    /// Where the p2p flags and inboxes lie in every rank's scratch.
    p2p: P2pLayout,
    /// Chunks sent to and received from each peer so far.
    p2p_cur: P2pCursor,
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

impl Drop for IpcState {
    fn drop(&mut self) {
        let deadline = Instant::now() + self.timeout.min(TEARDOWN_WAIT);
        // SAFETY: the context handle is live (held by `self.local.ctx`).
        let _ = unsafe { result::ctx::set_current(self.local.ctx.cu_ctx()) };
        let idle =
            self.last_stream.is_none() || wait_event(&self.local.done, deadline).unwrap_or(false);
        if let Some(ts) = self.host_barrier.take().filter(|_| self.opened.is_empty()) {
            // Every rank is a thread of this process, which may drop them one after another
            // (ncclCommDestroy in a loop): no rounds through the store. The world's shared state
            // frees every rank's scratch when the last rank leaves; all of them have waited for
            // their last operation by then.
            ts.bury(self.local.bury(), idle);
            drop(ts);
            self._peer_ctxs.clear();
            // SAFETY: the context handle is live (held by `self.local.ctx`).
            let _ = unsafe { result::ctx::set_current(self.local.ctx.cu_ctx()) };
            return;
        }
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
mod tests;
