//! Collectives on device buffers (feature `cuda`), ordered on CUDA streams like NCCL's.
//!
//! [`Communicator::on_stream`] binds a communicator to a stream the caller owns and offers the
//! same collectives as the host API, by the same names (`x` in place, `x_into` out of place;
//! reduce-scatter and all-gather exist out of place only), on cudarc device buffers
//! ([`CudaSlice`](cudarc::driver::CudaSlice), [`CudaView`](cudarc::driver::CudaView),
//! [`CudaViewMut`](cudarc::driver::CudaViewMut)):
//!
//! ```no_run
//! # #[cfg(feature = "cuda-core")] {
//! use oxccl_comm::cuda::cudarc::driver::CudaContext;
//! use oxccl_comm::{Communicator, ReduceOp};
//!
//! let comm = Communicator::from_env()?;
//! // One GPU per rank where there are enough, else ranks share them round-robin.
//! let gpus = CudaContext::device_count().expect("a CUDA driver").max(1) as usize;
//! let ctx = CudaContext::new(comm.local_rank() % gpus).expect("a GPU");
//! let stream = ctx.default_stream();
//! let mut grads = stream.alloc_zeros::<f32>(1 << 20).expect("device memory");
//! comm.on_stream(&stream).all_reduce(&mut grads, ReduceOp::Avg)?; // returns once enqueued
//! stream.synchronize().expect("stream");                         // the result is there now
//! if let Some(e) = comm.device_async_error() {
//!     panic!("{e}");
//! }
//! # }
//! # Ok::<(), oxccl_comm::Error>(())
//! ```
//!
//! # Two ways a device operation runs
//!
//! **Over CUDA IPC** (`comm/src/transport/cuda_ipc/` says how): collectives of a communicator whose
//! ranks all share one node (2 to 8 of them, on one GPU or several) read each other's device memory
//! directly. Every rank maps every other's scratch slots once (IPC handles exchanged through the
//! store); a call enqueues, on the caller's stream, a copy of its input into its own slot, a
//! barrier kernel (flags in device memory, no host round trip), then reduce kernels or copies that
//! read the peers' slots: one-shot all-reduce up to `OXCCL_CUDA_IPC_ONE_SHOT` (4 MiB), two-shot
//! above, everything in chunks of `OXCCL_CUDA_IPC_SLOT` (32 MiB) with double-buffered slots; with
//! `OXCCL_ALGO=ring`, all-reduce, reduce-scatter and all-gather read only the previous rank's slot
//! instead, in ring steps. This is the default where it applies (`OXCCL_CUDA_IPC=auto`); if any
//! rank cannot map the others, every rank stages instead (`OXCCL_CUDA_IPC=1` makes that an error).
//! Sends and receives (single, or batches of [`crate::Buffers::batch_p2p`] with device views) go
//! over CUDA IPC too once it is set up, device to device through an inbox of two chunks per
//! sender in each rank's scratch (`comm/src/transport/cuda_ipc/p2p.rs`): since a batch involves
//! only some ranks and the set-up needs them all, it is set up by the first device collective or
//! by [`StreamComm::connect`], which every rank calls; before that they stage. Over IPC a device
//! message pairs only with a device message (host ones go over the host transports).
//! Operations of one communicator on different streams are
//! chained in call order. Between processes the barrier is a kernel that spins on the GPU; ranks as
//! processes on one GPU share it by time slices (without MPS), so each barrier may wait for a
//! slice. When every rank is a thread of one process, the ranks meet at each barrier on the host
//! instead (`OXCCL_CUDA_IPC_BARRIER`): a call then returns once every rank has enqueued its part up
//! to that barrier, and the streams wait for each other's CUDA events (see below).
//!
//! **Staged through pinned host memory** (ranks on several nodes, more than 8 ranks, sends and
//! receives before CUDA IPC is set up, or `OXCCL_CUDA_IPC=0`). Each call is checked like its host counterpart, then
//! enqueued:
//!
//! 1. on the stream, a copy of the device input into a pinned host staging buffer, and an event
//!    after it;
//! 2. on the communicator's progress thread, in issue order with every other operation, the host
//!    collective over the staging buffer: it first waits for the event (bounded by
//!    `OXCCL_TIMEOUT`), then runs exactly the host algorithms over whatever transports connect the
//!    ranks (shared memory in a node, TCP between nodes), then stores the part's number into a
//!    pinned flag word;
//! 3. on the stream, a one-thread kernel that waits for that flag (`oxccl_wait_flag`, polling
//!    the word about every microsecond, with a deadline), then the copy of the result back into
//!    the device output. (`cuStreamWaitValue32` did this wait before, with no deadline.)
//!
//! The call returns after step 3 is enqueued; the stream (or an event recorded on it after the
//! call) says when the result is in place. Work the caller enqueues later on the same stream runs
//! after the result has landed; work on other streams needs the usual event or `join`.
//! All-reduce, broadcast and reduce are split into parts of at most `OXCCL_CUDA_STAGE_CHUNK`
//! bytes (4 MiB), one host collective each. All input copies are enqueued first, so the host
//! collective of part k starts as soon as its own copy has landed, while later parts are still
//! being copied out, and part k's copy back runs while later parts are on the network.
//!
//! Where the wait kernel cannot be compiled or loaded (no NVRTC, say: logged at `info`), where
//! another rank of the communicator is a thread of this process, or with
//! `OXCCL_CUDA_STREAM_WAIT=0`, a call waits for its host collectives before it enqueues the copies
//! back, and returns their errors itself.
//!
//! # Ranks that are threads of one process
//!
//! Their streams share one CUDA context per GPU (the device's primary context): its hardware
//! queues (`CUDA_DEVICE_MAX_CONNECTIONS`),
//! and driver calls that may wait for the whole context to go idle (loading a kernel lazily,
//! some allocations). A wait on the GPU for work the host has not enqueued yet (a stream waiting
//! on the flag, a barrier kernel spinning until a peer's kernel arrives) is an ordering CUDA
//! cannot see, and can then wait for ever on the rank it waits for: the waiting stream holds a
//! queue the peer's copy is behind, or the peer's thread sits in a driver call waiting for the
//! waiting stream to drain. So by default (`auto`) such ranks never make the GPU wait for
//! anything not yet enqueued: staged calls wait on the host, IPC barriers are met on the host
//! with CUDA events between the streams, and every kernel is loaded at set-up (`cuFuncLoad`).
//! What remains on the GPU waits only for work already enqueued, which always drains.
//! `OXCCL_CUDA_STREAM_WAIT=1` and `OXCCL_CUDA_IPC_BARRIER=device` bring back the GPU-side waits
//! (rank 0 warns about the latter): then no rank thread may make a driver call that waits for
//! the context (`cuMemFree`, pinned host allocation, module loading) while a peer may be in a
//! collective, and the library's own pinned buffers for staged send/recv, allocated on the
//! caller's thread as needed, can be such a call. A barrier kernel so held up fails at
//! `OXCCL_TIMEOUT` instead of hanging. Everyday calls do it too: on an H100 the GPU test of
//! this mode timed out in 22 runs of 138; in the two traced, one rank was still copying the
//! previous collective's result to pageable host memory, or allocating its next buffers
//! (cudarc's stream-ordered allocator), while its peer's barrier kernel of the next collective
//! spun. Ranks that use it must meet on the host after their other driver calls and before any
//! of them enqueues a collective, and again once all have enqueued it, as that test now does
//! (it passes so on an H100 and an H200).
//!
//! Not covered: a world of several processes each running several ranks as threads. Staged
//! calls there wait on the host (a peer shares the process), but CUDA IPC barriers need every
//! rank in one process to be met on the host, so they run on the device, spinning, with the
//! threads of each process sharing a context as above (untested; `OXCCL_CUDA_IPC=0` keeps such
//! a world on the staged path). "Same process" for the staged choice means the same node id and
//! process id, so ranks in separate PID namespaces that share a host name and a process id
//! count as one process (they then wait on the host: slower, never wrong).
//!
//! # Errors after a call returned
//!
//! Over CUDA IPC, a rank that does not reach a barrier within `OXCCL_TIMEOUT`, or reaches it with
//! a different collective, dtype, root or count, makes the barrier give up and record which rank
//! and which operation; the stream goes on (the outputs of that operation are then undefined),
//! and the failure is reported as below ([`Error::Timeout`], [`Error::Mismatch`]).
//!
//! A failure in a host collective that runs after its call returned (a peer lost, a mismatch, a
//! time-out) cannot be returned by that call. The flag is still set, so the stream never waits
//! forever; the device output then holds whatever the staging buffer held (the unreduced input
//! in place; stale bytes where this rank only receives). The failure is kept: read it with
//! [`Communicator::device_async_error`] after synchronizing (as `ncclCommGetAsyncError`), and
//! every later call on the communicator fails with it.
//!
//! # Status
//!
//! Built and type-checked on every CI run; the staging plans and the IPC plans (on a concurrent
//! host model of the slots and the barrier protocol) are unit-tested without a GPU, and the
//! barrier kernel is compiled to PTX. The GPU paths themselves are exercised only by
//! `comm/tests/comm/cuda.rs`, whose tests are ignored without a GPU (all 15 passed on an H200,
//! 2026-11-29: 2, 3, 4 and 8 rank threads, CUDA IPC and staged, every collective, dtype and
//! pre-multiplied sum, faults and stream order; the worlds again on 2026-11-30 with sends and
//! receives over CUDA IPC), `comm/tests/comm/cuda_p2p.rs` (sends and receives over CUDA IPC:
//! every size, 2 to 4 rank threads, flags on the host and on the device, faults, ranks dropped
//! one after another; passed on an H200, 2026-11-30, before the last-chunk tag and the failure
//! handling that a review added after it), and through nccl-tests on `libnccl.so.2`
//! (`nccl/`): run them with `cargo test -p oxccl-comm --features cuda --test comm -- cuda
//! --ignored` on a machine with one.

mod batch;
mod staged;
mod state;

use std::sync::{Arc, Mutex};

pub use cudarc;
use cudarc::driver::{sys, CudaStream, DevicePtr, DevicePtrMut};
use oxccl_kernels::{DType, Element, ReduceOp};

use crate::api::communicator::Communicator;
use crate::base::buffer::{Buf, BufMut, Device};
pub(crate) use crate::base::call::Kind;
use crate::base::error::{Error, Result};
pub(crate) use batch::DevOp;
pub(crate) use state::DeviceState;
use state::IpcMode;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A communicator bound to a CUDA stream: the collectives on device buffers. Made by
/// [`Communicator::on_stream`]; cheap, make one per call site if convenient.
pub struct StreamComm<'c> {
    comm: &'c Communicator,
    stream: Arc<CudaStream>,
}

impl std::fmt::Debug for StreamComm<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamComm")
            .field("rank", &self.comm.rank)
            .field("size", &self.comm.size)
            .field("ordinal", &self.stream.context().ordinal())
            .finish()
    }
}

impl Communicator {
    /// The collectives of this communicator on device buffers, enqueued on `stream` (see
    /// [`crate::api::device`]). Every device operation of one communicator must use streams of one CUDA
    /// context.
    pub fn on_stream(&self, stream: &Arc<CudaStream>) -> StreamComm<'_> {
        StreamComm {
            comm: self,
            stream: Arc::clone(stream),
        }
    }

    /// How this communicator's device collectives run ([`crate::Stats::device_path`]).
    pub(crate) fn device_path(&self) -> Option<&'static str> {
        match lock(&self.cuda).as_ref().map(|s| &s.ipc) {
            Some(IpcMode::On(_)) => Some("cuda_ipc"),
            Some(IpcMode::Off) => Some("staged"),
            _ => None,
        }
    }

    /// The first failure of a device operation that happened after its call returned (as
    /// `ncclCommGetAsyncError`); `None` while every device operation so far succeeded.
    pub fn device_async_error(&self) -> Option<Error> {
        let st = lock(&self.cuda);
        st.as_ref()
            .and_then(DeviceState::async_error)
            .map(|e| self.shared.named(e))
    }
}

impl Communicator {
    /// Enqueues a call already checked by [`Communicator::call`] on device views, on the
    /// output's stream (`src`: the input where it is not the output).
    pub(crate) fn launch_device(
        &self,
        kind: Kind,
        dt: DType,
        src: Option<Device<'_>>,
        out: &mut Device<'_>,
    ) -> Result<()> {
        let es = dt.size();
        let output = Some((out.ptr, out.bytes / es));
        let input = match (&src, kind) {
            (Some(d), _) if !Arc::ptr_eq(d.stream, out.stream) => {
                let msg = "the input and the output were viewed for different streams".into();
                return Err(self.invalid(kind.name(), msg));
            }
            (Some(d), _) => Some((d.ptr, d.bytes / es)),
            (None, Kind::ReduceScatter(_) | Kind::AllGather) => {
                let op = kind.name();
                let msg =
                    format!("{op} in place is not available on device buffers: use {op}_into");
                return Err(self.invalid(op, msg));
            }
            (None, Kind::Recv { .. }) => None,
            (None, _) => output,
        };
        self.on_stream(out.stream).launch(kind, dt, input, output)
    }

    /// Enqueues a send of device view `d` to `peer`, already checked.
    pub(crate) fn launch_device_send(&self, peer: usize, dt: DType, d: Device<'_>) -> Result<()> {
        let input = Some((d.ptr, d.bytes / dt.size()));
        self.on_stream(d.stream)
            .launch(Kind::Send { peer }, dt, input, None)
    }
}

/// A device buffer as the staging code sees it: its address and element count.
type Dev = Option<(sys::CUdeviceptr, usize)>;

impl StreamComm<'_> {
    /// The stream operations are enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub(super) fn cuda_err(&self, op: &str, what: &str, e: impl std::fmt::Debug) -> Error {
        Error::Cuda {
            rank: self.comm.rank,
            op: op.into(),
            msg: format!("{what}: {e:?}"),
        }
    }

    /// In-place all-reduce of a device buffer.
    ///
    /// # Errors
    /// `Cuda` if enqueueing fails; the errors of [`Communicator::all_reduce`] (directly, or later
    /// through [`Communicator::device_async_error`]).
    pub fn all_reduce<T: Element>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.launch_in_place(Kind::AllReduce(op), buf)
    }

    /// Out-of-place all-reduce: `output` = reduction of every rank's `input`.
    ///
    /// # Errors
    /// `InvalidArgument` when the lengths differ; otherwise as [`StreamComm::all_reduce`].
    pub fn all_reduce_into<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.launch_io(Kind::AllReduce(op), input, output)
    }

    /// Reduce-scatter: `input` holds `size()` shards of `output.len()` elements; rank r's
    /// `output` = reduction of every rank's shard r.
    ///
    /// # Errors
    /// `InvalidArgument` unless `input.len() == output.len() * size()`.
    pub fn reduce_scatter_into<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.launch_io(Kind::ReduceScatter(op), input, output)
    }

    /// All-gather: `output` = every rank's `input`, in rank order.
    ///
    /// # Errors
    /// `InvalidArgument` unless `output.len() == input.len() * size()`.
    pub fn all_gather_into<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.launch_io(Kind::AllGather, input, output)
    }

    /// In-place broadcast: every rank's `buf` ends equal to the root's.
    ///
    /// # Errors
    /// `InvalidArgument` for a root outside the communicator.
    pub fn broadcast<T: Element>(&self, buf: &mut impl DevicePtrMut<T>, root: usize) -> Result<()> {
        self.launch_in_place(Kind::Broadcast { root }, buf)
    }

    /// Out-of-place broadcast: `output` = the root's `input` (read only on the root).
    ///
    /// # Errors
    /// `InvalidArgument` for a bad root, or on the root when the lengths differ.
    pub fn broadcast_into<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        root: usize,
    ) -> Result<()> {
        self.launch_io(Kind::Broadcast { root }, input, output)
    }

    /// In-place reduce: the root's `buf` ends with the reduction; other ranks' `buf` is read
    /// only. (The same staging and CUDA IPC plans as [`StreamComm::reduce_into`] with one buffer
    /// as input and output; nccl-tests' in-place `reduce_perf` passes on it with 2 and 4
    /// processes.)
    ///
    /// # Errors
    /// `InvalidArgument` for a root outside the communicator.
    pub fn reduce<T: Element>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.launch_in_place(Kind::Reduce { op, root }, buf)
    }

    /// Reduce: the root's `output` = reduction of every rank's `input`; `output` is not touched
    /// on other ranks (it may be empty there).
    ///
    /// # Errors
    /// `InvalidArgument` for a bad root, or on the root when the lengths differ.
    pub fn reduce_into<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.launch_io(Kind::Reduce { op, root }, input, output)
    }

    /// Gather: the root's `output` = every rank's `input` in rank order; `output` is not touched
    /// on other ranks (it may be empty there).
    ///
    /// # Errors
    /// `InvalidArgument` for a bad root or, on the root, a wrong output length.
    pub fn gather_into<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        root: usize,
    ) -> Result<()> {
        self.launch_io(Kind::Gather { root }, input, output)
    }

    /// Scatter: rank r's `output` = block r of the root's `input` (read only on the root).
    ///
    /// # Errors
    /// `InvalidArgument` for a bad root or, on the root, a wrong input length.
    pub fn scatter_into<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
        root: usize,
    ) -> Result<()> {
        self.launch_io(Kind::Scatter { root }, input, output)
    }

    /// All-to-all: block j of rank r's `input` becomes block r of rank j's `output`.
    ///
    /// # Errors
    /// `InvalidArgument` unless both lengths are equal and divisible by `size()`.
    pub fn all_to_all_into<T: Element>(
        &self,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.launch_io(Kind::AllToAll, input, output)
    }

    /// Sends `buf` to `peer`, which posts a matching [`StreamComm::recv`] (or a host
    /// [`Communicator::recv`]: the message is the same). The stream does not wait for delivery:
    /// `buf` is copied out first and may be reused by later stream work at once.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad peer; `Mismatch` (possibly later) if the receive differs.
    pub fn send<T: Element>(&self, buf: &impl DevicePtr<T>, peer: usize) -> Result<()> {
        self.comm.call_send(Buf::device(buf, &self.stream), peer)
    }

    /// Receives into `buf` from `peer`; later work on the stream sees the data.
    ///
    /// # Errors
    /// `InvalidArgument` for a bad peer; `Mismatch` (possibly later) if the send differs.
    pub fn recv<T: Element>(&self, buf: &mut impl DevicePtrMut<T>, peer: usize) -> Result<()> {
        let out = BufMut::device(buf, &self.stream);
        self.comm.call(Kind::Recv { peer }, None, out)
    }

    /// A call with an input and an output buffer, through the one dispatch of every call
    /// ([`Communicator::buffers`]).
    fn launch_io<T: Element>(
        &self,
        kind: Kind,
        input: &impl DevicePtr<T>,
        output: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        // The views' guards keep the buffers' stream order until everything is enqueued.
        let input = Buf::device(input, &self.stream);
        self.comm
            .call(kind, Some(input), BufMut::device(output, &self.stream))
    }

    /// An in-place call (the buffer is input and output), through the one dispatch.
    fn launch_in_place<T: Element>(
        &self,
        kind: Kind,
        buf: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.comm
            .call(kind, None, BufMut::device(buf, &self.stream))
    }

    /// Checks and enqueues one device operation (see the module documentation); its errors
    /// noted with the communicator's world ranks (once: those of its host parts are already).
    fn launch(&self, kind: Kind, dt: DType, input: Dev, output: Dev) -> Result<()> {
        self.launch_unnamed(kind, dt, input, output)
            .map_err(|e| self.comm.shared.named(e))
    }
}

#[cfg(test)]
mod tests;
