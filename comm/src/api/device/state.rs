//! The per-communicator state of device operations: the pinned flag and staging pool, the
//! choice between CUDA IPC and staging, failures after a call returned, and whether streams
//! wait on the flag.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaEvent, DriverError};

use super::lock;
use crate::base::config::Config;
use crate::base::error::Error;
use crate::device::staging::{Flag, Pool};
use crate::transport::cuda_ipc as ipc;

/// Per-communicator state of device operations, made on the first one.
pub(crate) struct DeviceState {
    /// The context of every stream this communicator's device operations use.
    pub(super) ctx: Arc<CudaContext>,
    pub(super) pool: Arc<Pool>,
    pub(super) flag: Arc<Flag>,
    /// Number of the last part enqueued (the flag reaches it when that part is done).
    pub(super) next: u32,
    /// Streams wait on the flag (`false`: calls wait for their host collectives instead).
    pub(super) stream_wait: bool,
    /// This rank, and the communicator's `OXCCL_TIMEOUT` (for a stream wait's error).
    rank: usize,
    timeout: Duration,
    /// The kernel streams wait on the flag in, loaded at the first staged call that needs it.
    pub(super) waiter: Option<Arc<oxccl_kernels::cuda::FlagWait>>,
    /// The first failure of a host collective that ran after its call returned.
    pub(super) error: Arc<Mutex<Option<Error>>>,
    /// Events that mark input copies, reused: a part's job hands its event back once it has
    /// waited for it, so no event is created or destroyed per part (nor on the progress thread).
    pub(super) events: Arc<Mutex<Vec<CudaEvent>>>,
    /// Collectives over CUDA IPC, decided at the first device collective.
    pub(super) ipc: IpcMode,
}

/// Whether a communicator's device collectives run over CUDA IPC.
pub(super) enum IpcMode {
    /// No device collective yet.
    Untried,
    /// Staged through host memory (the ranks cannot all map each other's memory).
    Off,
    On(Box<ipc::IpcState>),
    /// `OXCCL_CUDA_IPC=1` and set-up failed: every device collective fails with this.
    Failed(Error),
}

impl DeviceState {
    /// A failure of a device collective after its call returned: a staged host collective's,
    /// a stream's wait for one that gave up at its deadline, or one a CUDA IPC barrier reported.
    pub(super) fn async_error(&self) -> Option<Error> {
        lock(&self.error)
            .clone()
            .or_else(|| {
                let part = self.flag.wait_gave_up()?;
                Some(Error::Timeout {
                    rank: self.rank,
                    op: "a staged device operation".into(),
                    timeout: self.timeout,
                    detail: format!(
                        "the stream's wait for its part {part} gave up at the part's deadline \
                         (OXCCL_TIMEOUT for each operation queued ahead of it, plus three and a \
                         second): its host collective never finished, and the operation's \
                         device result is wrong"
                    ),
                })
            })
            .or_else(|| match &self.ipc {
                IpcMode::On(s) => s.failure(),
                _ => None,
            })
    }
}

impl DeviceState {
    /// `shares_process`: another rank of the communicator is a thread of this process. Whether
    /// streams wait on the GPU is decided here, once, from the calling thread's CPU affinity.
    pub(super) fn new(
        ctx: &Arc<CudaContext>,
        rank: usize,
        cfg: &Config,
        shares_process: bool,
    ) -> std::result::Result<DeviceState, DriverError> {
        Ok(DeviceState {
            ctx: Arc::clone(ctx),
            pool: Arc::new(Pool::default()),
            flag: Arc::new(Flag::new(ctx)?),
            next: 0,
            stream_wait: stream_wait(
                cfg,
                shares_process,
                crate::base::affinity::allowed_cpus().len(),
            ),
            waiter: None,
            rank,
            timeout: cfg.timeout,
            error: Arc::new(Mutex::new(None)),
            events: Arc::new(Mutex::new(Vec::new())),
            ipc: IpcMode::Untried,
        })
    }
}

impl Drop for DeviceState {
    fn drop(&mut self) {
        // CUDA IPC tear-down first (it waits for this rank's last operation, then meets the
        // peers): freeing pinned memory waits for the whole context, and with ranks as threads
        // sharing it a peer's barrier kernel could still be waiting for this rank's.
        self.ipc = IpcMode::Untried;
        // Staging buffers next: each waits for its `done` event, recorded after every stream
        // wait on the flag, so the flag is freed only once no stream can still read it. If one
        // could not be waited for, a stream may still poll the flag: leak it too, and the wait
        // kernel's module, which a queued wait may still run.
        if !self.pool.clear() {
            std::mem::forget(Arc::clone(&self.flag));
            std::mem::forget(self.waiter.clone());
        }
    }
}

/// Whether staged calls return once enqueued, their streams waiting on the flag
/// (`OXCCL_CUDA_STREAM_WAIT`). `auto` says no when another rank is a thread of this process: a
/// stream wait is an ordering on work the host has not enqueued yet, which CUDA cannot see, and
/// streams of one context share its hardware queues, so a waiting stream could hold up the copy
/// of the very rank it waits for. Calls that wait on the host leave on the GPU only work that
/// depends on work already enqueued, which always drains.
///
/// `auto` says no, too, when the calling thread may run on one CPU only (`cpus`, the size of its
/// affinity mask at the communicator's first device call; 0 when unknown): bound to a core
/// (`oxccl launch --bind core`, `oxccl perf --np` where there is one CPU per rank, mpirun's
/// default), the progress thread that runs the host collectives shares that CPU with the caller,
/// whose thread spins in the driver while it waits for the stream (`cuStreamSynchronize`), and
/// runs only at the scheduler's next tick. On the
/// H100 (2026-11-26, 2 processes under MPS, 8 B over shared memory) a call cost 0.6-0.8 ms so,
/// against 24 us with a block of CPUs per rank, and 22-26 us bound with the call waiting on the
/// host. (Not detected: a mask of two hyperthreads of one core, or a CPU quota.)
pub(super) fn stream_wait(cfg: &Config, shares_process: bool, cpus: usize) -> bool {
    cfg.cuda_stream_wait.unwrap_or(!shares_process && cpus != 1)
}
