//! Running one collective over CUDA IPC: the stream work of its plan ([`GpuExec`]), the
//! barriers (on the device, or met on the host with [`ThreadSync`] when every rank is a thread
//! of this process), and the errors a barrier reports.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaEvent, CudaStream};
use oxccl_kernels::cuda::CudaKernels;
use oxccl_kernels::{DType, ReduceOp};

use super::p2p_exec::HostP2p;
use super::plan::{
    execute, ipc_plan, Bases, Exec, HostBarrier, ERR_ABORTED, ERR_MISMATCH, ERR_TIMEOUT, MAX_RANKS,
};
use super::registration::Buried;
use super::{lock, IpcState};
use crate::base::call::Kind;
use crate::base::error::{Error, Result};
use crate::device::staging::Backoff;

/// Byte offset, in a scratch allocation, of the device error word (after the flag words).
pub(super) const DEV_ERROR_OFFSET: usize = 2 * MAX_RANKS * 8;

/// Operations remembered to name the one a failed barrier belonged to.
const HISTORY: usize = 64;

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
    /// Every rank's flags and events of point-to-point (`p2p_exec.rs`).
    pub(super) p2p: Vec<HostP2p>,
    /// The scratch of the ranks that left, freed when the last one leaves (this is dropped);
    /// leaked instead if one of them could not confirm that its last operation had finished.
    graves: Mutex<(Vec<Buried>, bool)>,
}

impl ThreadSync {
    /// Takes a leaving rank's scratch (`idle`: its last operation has finished).
    pub(super) fn bury(&self, b: Option<Buried>, idle: bool) {
        let mut g = lock(&self.graves);
        g.0.extend(b);
        g.1 |= !idle;
    }
}

impl Drop for ThreadSync {
    fn drop(&mut self) {
        let (buried, busy) = std::mem::take(&mut *lock(&self.graves));
        if busy {
            tracing::warn!(
                "cuda_ipc tear-down: a rank's last operation did not finish in time; the \
                 device scratch of its world's {} ranks is left allocated",
                buried.len()
            );
            buried.into_iter().for_each(std::mem::forget);
        }
    }
}

impl ThreadSync {
    fn new(size: usize) -> ThreadSync {
        ThreadSync {
            flags: (0..size)
                .map(|_| std::array::from_fn(|_| AtomicU64::new(0)))
                .collect(),
            errors: (0..size).map(|_| AtomicU32::new(0)).collect(),
            events: (0..size).map(|_| OnceLock::new()).collect(),
            p2p: (0..size).map(|_| HostP2p::new()).collect(),
            graves: Mutex::new((Vec::new(), false)),
        }
    }

    /// The barrier state the ranks of communicator `key` share, with `events` as rank `rank`'s.
    /// The key names the ranks' scratch allocations too, which are unique while they live, so a
    /// later communicator with the same id never meets an old one's state.
    pub(super) fn join(
        key: String,
        size: usize,
        rank: usize,
        events: [CudaEvent; 2],
    ) -> Arc<ThreadSync> {
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
pub(super) fn join_in<T>(
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
        if code & 0xff >= super::p2p::ERR_P2P_TIMEOUT {
            // A wait of point-to-point: the second word is the chunk number.
            return self.p2p_error(code, epoch);
        }
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
        let (input, temp) = self.premul_input(stream, kind, dt, count, input, output)?;
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
        let mut r = execute(&plan, &bases, &mut self.cur, &mut exec);
        if let Some(t) = temp {
            // SAFETY: `t` came from cuMemAllocAsync on this stream; every read of it (this
            // rank's own copies and reduces: peers read only the scratch slots) is enqueued
            // before this free on the same stream.
            let freed = unsafe { sys::cuMemFreeAsync(t, cu) }.result();
            r = r.and(freed.map_err(|e| Stop::Cuda(format!("freeing the scaled input: {e:?}"))));
        }
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

impl IpcState {
    /// A pre-multiplied sum's first step: enqueues this rank's input times its factor where the
    /// plan then reads it, and returns that address (the plan itself sums, as the reduce kernels
    /// take `PreMulSum` as `Sum`) and the temporary to free after the operation: all-reduce
    /// scales into its output (in place when it is the input); reduce-scatter and reduce into
    /// a stream-ordered temporary, since their input must stay as it was. Any other operation:
    /// `input` as it is.
    fn premul_input(
        &self,
        stream: &Arc<CudaStream>,
        kind: Kind,
        dt: DType,
        count: usize,
        input: u64,
        output: u64,
    ) -> std::result::Result<(u64, Option<u64>), Stop> {
        let Some(factor) = kind.op().factor() else {
            return Ok((input, None));
        };
        let blocks = if matches!(kind, Kind::ReduceScatter(_)) {
            self.size
        } else {
            1
        };
        let bytes = count * blocks * dt.size();
        if bytes == 0 {
            return Ok((input, None));
        }
        let cu = stream.cu_stream();
        let (dst, temp) = if matches!(kind, Kind::AllReduce(_)) {
            (output, None)
        } else {
            let mut p: sys::CUdeviceptr = 0;
            // SAFETY: `p` is written by the driver; the allocation is ordered on `stream`.
            unsafe { sys::cuMemAllocAsync(&mut p, bytes, cu) }
                .result()
                .map_err(|e| Stop::Cuda(format!("allocating the scaled input: {e:?}")))?;
            (p, Some(p))
        };
        // SAFETY: `input` holds `bytes` bytes of the caller's input (the call was checked);
        // `dst` is the all-reduce's output of the same length (equal to `input` in place) or the
        // temporary just allocated on this stream.
        let scaled = unsafe {
            self.local
                .kernels
                .scale_raw(stream, dt, dst, input, bytes, factor)
        };
        if let Err(e) = scaled {
            if let Some(t) = temp {
                // SAFETY: allocated above on this stream; nothing reads it.
                let _ = unsafe { sys::cuMemFreeAsync(t, cu) };
            }
            return Err(Stop::Cuda(format!("scaling the input (premul_sum): {e}")));
        }
        Ok((dst, temp))
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
