//! The collectives and point-to-point calls: checked when called (the communicator, the data
//! type, the operation, the root or peer), then run now or at the end of the caller's group
//! (`crate::group`). With the `cuda` feature each one enqueues on the caller's stream through
//! oxccl's device collectives and returns; without it, every one fails saying so.
//!
//! With `OXCCL_NCCL_HOST_MEMORY=1` the buffers are host memory instead (no GPU needed; the
//! stream is ignored and each call is complete when it returns): programs can check their use
//! of NCCL's API on a machine without a GPU, and this crate's tests check every call's
//! arguments that way. Sends and receives then run as one batch per communicator and group,
//! so that none blocks another, as NCCL's grouped point-to-point calls do.

use std::ffi::c_int;
use std::sync::Arc;

use oxccl_comm::{DType, ReduceOp};

use crate::abi;
use crate::comm::{handle, CommPtr, Handle};
use crate::group;
use crate::status::{bad_arg, Failure, Outcome};

/// Device addresses, as integers (they are only handed to CUDA).
pub type Addr = u64;

/// One call's arguments, checked.
#[derive(Clone, Copy, Debug)]
#[allow(missing_docs)] // NCCL's parameters
pub enum Call {
    AllReduce {
        send: Addr,
        recv: Addr,
        count: usize,
        op: ReduceOp,
    },
    Broadcast {
        send: Addr,
        recv: Addr,
        count: usize,
        root: usize,
    },
    Reduce {
        send: Addr,
        recv: Addr,
        count: usize,
        op: ReduceOp,
        root: usize,
    },
    AllGather {
        send: Addr,
        recv: Addr,
        count: usize,
    },
    ReduceScatter {
        send: Addr,
        recv: Addr,
        count: usize,
        op: ReduceOp,
    },
    AllToAll {
        send: Addr,
        recv: Addr,
        count: usize,
    },
    Gather {
        send: Addr,
        recv: Addr,
        count: usize,
        root: usize,
    },
    Scatter {
        send: Addr,
        recv: Addr,
        count: usize,
        root: usize,
    },
    Send {
        buf: Addr,
        count: usize,
        peer: usize,
    },
    Recv {
        buf: Addr,
        count: usize,
        peer: usize,
    },
}

/// What a call needs besides its [`Call`].
pub struct Target {
    comm: Arc<Handle>,
    dtype: DType,
    stream: usize,
}

/// The communicator, data type and stream of a call, checked; `op` resolved (`None`: the call
/// has no operation).
///
/// # Safety
/// `comm` as for [`handle`].
pub unsafe fn target(
    comm: CommPtr,
    dtype: c_int,
    op: Option<c_int>,
    stream: usize,
) -> Result<(Target, Option<ReduceOp>), crate::status::Failure> {
    // SAFETY: per the contract.
    let h = unsafe { handle(comm) }?;
    let dt = abi::dtype(dtype)
        .ok_or_else(|| bad_arg(format!("ncclDataType_t {dtype} is not a data type")))?;
    let op = op.map(|o| h.op(o)).transpose()?;
    // SAFETY: `comm` is a live handle from `Arc::into_raw`: take a count of our own for the
    // call, which may run at the end of a group after the caller destroyed its handle.
    let comm = unsafe {
        Arc::increment_strong_count(comm);
        Arc::from_raw(comm)
    };
    Ok((
        Target {
            comm,
            dtype: dt,
            stream,
        },
        op,
    ))
}

/// A root or peer, checked against the communicator's size.
pub fn rank_arg(t: &Target, what: &str, r: c_int) -> Result<usize, crate::status::Failure> {
    let size = t.comm.comm().map(|c| c.size()).ok();
    match (usize::try_from(r), size) {
        (Ok(r), Some(n)) if r < n => Ok(r),
        (Ok(r), None) => Ok(r), // checked when the deferred communicator exists
        _ => Err(bad_arg(format!(
            "{what} {r} is not a rank of this communicator ({} ranks)",
            size.map_or("?".into(), |n| n.to_string())
        ))),
    }
}

/// Runs `call` now, or at the end of the caller's group.
pub fn submit(t: Target, call: Call) -> Outcome {
    if group::active() {
        group::op(t, call);
        Ok(())
    } else {
        run_group(vec![(t, call)])
    }
}

impl Call {
    fn is_p2p(&self) -> bool {
        matches!(self, Call::Send { .. } | Call::Recv { .. })
    }
}

/// Runs a group's operations in call order, except that each communicator's sends and
/// receives run together, as one batch, where the first of them was called. Every operation
/// runs; the first failure is the result.
pub fn run_group(ops: Vec<(Target, Call)>) -> Outcome {
    let mut first: Option<Failure> = None;
    let mut done = vec![false; ops.len()];
    for i in 0..ops.len() {
        if done[i] {
            continue;
        }
        let r = if ops[i].1.is_p2p() {
            let key = Arc::as_ptr(&ops[i].0.comm);
            let batch: Vec<usize> = (i..ops.len())
                .filter(|&j| ops[j].1.is_p2p() && Arc::as_ptr(&ops[j].0.comm) == key)
                .collect();
            for &j in &batch {
                done[j] = true;
            }
            let calls: Vec<Call> = batch.iter().map(|&j| ops[j].1).collect();
            run_p2p(&ops[i].0, &calls)
        } else {
            run(&ops[i].0, ops[i].1)
        };
        if let Err(f) = r {
            first.get_or_insert(f);
        }
    }
    first.map_or(Ok(()), Err)
}

/// Whether buffers are host memory (`OXCCL_NCCL_HOST_MEMORY`, read once).
pub fn host_memory() -> bool {
    static HOST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HOST.get_or_init(|| {
        std::env::var("OXCCL_NCCL_HOST_MEMORY")
            .is_ok_and(|v| matches!(v.trim(), "1" | "on" | "yes" | "true"))
    })
}

/// Whether device sends and receives are enqueued on the caller's stream (`OXCCL_NCCL_P2P`:
/// `stream`, the default, or `sync` for the synchronous batch through host copies; read once).
pub fn p2p_on_stream() -> bool {
    static STREAM: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *STREAM.get_or_init(|| {
        let v = std::env::var("OXCCL_NCCL_P2P").unwrap_or_default();
        !v.trim().eq_ignore_ascii_case("sync")
    })
}

/// One collective (not send or receive).
fn run(t: &Target, call: Call) -> Outcome {
    if host_memory() {
        return host::run(t, call);
    }
    device_run(t, call)
}

/// A communicator's sends and receives of one group.
fn run_p2p(t: &Target, calls: &[Call]) -> Outcome {
    if host_memory() {
        return host::batch(t, calls);
    }
    device_batch(t, calls)
}

/// The sends and receives of `calls` as one batch over host copies of their buffers: `get`
/// fills a send's copy from its buffer, `put` writes a receive's copy back to its buffer.
fn batch_via_host(
    t: &Target,
    calls: &[Call],
    get: &dyn Fn(Addr, &mut [u8]) -> Outcome,
    put: &dyn Fn(Addr, &[u8]) -> Outcome,
) -> Outcome {
    use oxccl_comm::{Buf, BufMut, DType, P2pView};
    let comm = t.comm.comm()?;
    let es = t.dtype.size();
    let mut copies: Vec<Vec<u8>> = Vec::with_capacity(calls.len());
    for &c in calls {
        copies.push(match c {
            Call::Send { buf, count, .. } => {
                let mut v = vec![0u8; count * es];
                get(buf, &mut v)?;
                v
            }
            Call::Recv { count, .. } => vec![0u8; count * es],
            other => {
                return Err(bad_arg(format!(
                    "{other:?} in a batch of sends and receives"
                )))
            }
        });
    }
    let views = calls.iter().zip(copies.iter_mut()).map(|(c, v)| match *c {
        Call::Send { peer, .. } => Buf::host(v, DType::U8).map(|buf| P2pView::Send { buf, peer }),
        Call::Recv { peer, .. } => {
            BufMut::host(v, DType::U8).map(|buf| P2pView::Recv { buf, peer })
        }
        _ => unreachable!("checked above"),
    });
    let views: Vec<P2pView<'_>> = views
        .collect::<Result<_, _>>()
        .map_err(|e| bad_arg(e.to_string()))?;
    comm.buffers().batch_p2p(views)?;
    for (c, v) in calls.iter().zip(&copies) {
        if let Call::Recv { buf, .. } = *c {
            put(buf, v)?;
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn device_batch(t: &Target, calls: &[Call]) -> Outcome {
    device_run(t, calls[0])
}

#[cfg(feature = "cuda")]
fn device_batch(t: &Target, calls: &[Call]) -> Outcome {
    device::batch(t, calls)
}

/// A collective's buffers as oxccl sees them: `r(addr, count)` a view to read,
/// `w(addr, count)` one to write. The counts follow NCCL's rules; buffers that only the root
/// uses are viewed empty on the other ranks.
fn dispatch<'a>(
    b: oxccl_comm::Buffers<'_>,
    call: Call,
    r: &dyn Fn(Addr, usize) -> Result<oxccl_comm::Buf<'a>, Failure>,
    w: &dyn Fn(Addr, usize) -> Result<oxccl_comm::BufMut<'a>, Failure>,
    (me, n): (usize, usize),
) -> Outcome {
    match call {
        Call::AllReduce {
            send,
            recv,
            count,
            op,
        } if send == recv => b.all_reduce(w(recv, count)?, op)?,
        Call::AllReduce {
            send,
            recv,
            count,
            op,
        } => b.all_reduce_into(r(send, count)?, w(recv, count)?, op)?,
        Call::Broadcast {
            send,
            recv,
            count,
            root,
        } if send == recv => b.broadcast(w(recv, count)?, root)?,
        Call::Broadcast {
            send,
            recv,
            count,
            root,
        } => {
            let k = if me == root { count } else { 0 };
            b.broadcast_into(r(send, k)?, w(recv, count)?, root)?
        }
        Call::Reduce {
            send,
            recv,
            count,
            op,
            root,
        } => {
            let k = if me == root { count } else { 0 };
            if send == recv && me == root {
                b.reduce(w(recv, count)?, op, root)?
            } else {
                b.reduce_into(r(send, count)?, w(recv, k)?, op, root)?
            }
        }
        Call::AllGather { send, recv, count } => {
            b.all_gather_into(r(send, count)?, w(recv, count * n)?)?
        }
        Call::ReduceScatter {
            send,
            recv,
            count,
            op,
        } => b.reduce_scatter_into(r(send, count * n)?, w(recv, count)?, op)?,
        Call::AllToAll { send, recv, count } => {
            b.all_to_all_into(r(send, count * n)?, w(recv, count * n)?)?
        }
        Call::Gather {
            send,
            recv,
            count,
            root,
        } => {
            let k = if me == root { count * n } else { 0 };
            b.gather_into(r(send, count)?, w(recv, k)?, root)?
        }
        Call::Scatter {
            send,
            recv,
            count,
            root,
        } => {
            let k = if me == root { count * n } else { 0 };
            b.scatter_into(r(send, k)?, w(recv, count)?, root)?
        }
        Call::Send { buf, count, peer } => b.send(r(buf, count)?, peer)?,
        Call::Recv { buf, count, peer } => b.recv(w(buf, count)?, peer)?,
    }
    Ok(())
}

mod host {
    //! `OXCCL_NCCL_HOST_MEMORY=1`: the caller's buffers are host memory.
    use oxccl_comm::{Buf, BufMut, DType};

    use super::{dispatch, Addr, Call, Target};
    use crate::status::{bad_arg, Failure, Outcome};

    /// `n` elements of `dt` at `a`, to read.
    ///
    /// # Safety
    /// NCCL's contract, with host memory: `a` points to `n` readable elements (or `n` is 0).
    unsafe fn r<'a>(a: Addr, n: usize, dt: DType) -> Result<Buf<'a>, Failure> {
        let bytes: &[u8] = if n == 0 {
            &[]
        } else if a == 0 {
            return Err(bad_arg(format!("a NULL buffer of {n} elements")));
        } else {
            // SAFETY: per the contract.
            unsafe { std::slice::from_raw_parts(a as *const u8, n * dt.size()) }
        };
        Buf::host(bytes, dt).map_err(|e| bad_arg(e.to_string()))
    }

    /// `n` elements of `dt` at `a`, to write.
    ///
    /// # Safety
    /// As [`r`], writable, and used by nothing else during the call.
    unsafe fn w<'a>(a: Addr, n: usize, dt: DType) -> Result<BufMut<'a>, Failure> {
        let bytes: &mut [u8] = if n == 0 {
            &mut []
        } else if a == 0 {
            return Err(bad_arg(format!("a NULL buffer of {n} elements")));
        } else {
            // SAFETY: per the contract.
            unsafe { std::slice::from_raw_parts_mut(a as *mut u8, n * dt.size()) }
        };
        BufMut::host(bytes, dt).map_err(|e| bad_arg(e.to_string()))
    }

    pub(super) fn run(t: &Target, call: Call) -> Outcome {
        let comm = t.comm.comm()?;
        let dt = t.dtype;
        // SAFETY: the views are the C caller's buffers, valid for the call by NCCL's contract
        // (host memory in this mode); in place, the one view is both input and output.
        let rd = |a, n| unsafe { r(a, n, dt) };
        // SAFETY: as above.
        let wr = |a, n| unsafe { w(a, n, dt) };
        dispatch(comm.buffers(), call, &rd, &wr, (comm.rank(), comm.size()))
    }

    /// Copies `dst.len()` bytes from the caller's buffer at `a`.
    ///
    /// # Safety
    /// NCCL's contract with host memory: `a` holds that many readable bytes.
    unsafe fn get(a: Addr, dst: &mut [u8]) -> Outcome {
        if !dst.is_empty() {
            // SAFETY: per the contract; `dst` is a separate allocation.
            unsafe { std::ptr::copy_nonoverlapping(a as *const u8, dst.as_mut_ptr(), dst.len()) };
        }
        Ok(())
    }

    /// Copies `src` into the caller's buffer at `a`.
    ///
    /// # Safety
    /// NCCL's contract with host memory: `a` holds `src.len()` writable bytes.
    unsafe fn put(a: Addr, src: &[u8]) -> Outcome {
        if !src.is_empty() {
            // SAFETY: per the contract; `src` is a separate allocation.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), a as *mut u8, src.len()) };
        }
        Ok(())
    }

    /// A group's sends and receives through host copies, as on device buffers (the same code
    /// but for the copies, so the tests on host memory check the device path's batching).
    pub(super) fn batch(t: &Target, calls: &[Call]) -> Outcome {
        // SAFETY: the C caller's buffers, valid for the call by NCCL's contract (host memory
        // in this mode), each of the call's count of elements.
        let rd = |a, dst: &mut [u8]| unsafe { get(a, dst) };
        // SAFETY: as above.
        let wr = |a, src: &[u8]| unsafe { put(a, src) };
        super::batch_via_host(t, calls, &rd, &wr)
    }
}

#[cfg(not(feature = "cuda"))]
fn device_run(t: &Target, call: Call) -> Outcome {
    let _ = (t.comm.comm()?, t.stream);
    Err(crate::status::bad_use(format!(
        "{call:?}: this libnccl.so.2 was built without oxccl-nccl's `cuda` feature, so it has \
         no device collectives (build it with --features cuda)"
    )))
}

/// Whether the CUDA driver library can be loaded.
#[cfg(feature = "cuda")]
pub fn driver_present() -> bool {
    // SAFETY: a dlopen/dlclose probe of the driver library, nothing more.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

#[cfg(feature = "cuda")]
fn device_run(t: &Target, call: Call) -> Outcome {
    device::run(t, call)
}

/// Sets up a new communicator's device path on `device` while every rank is still creating it
/// (CUDA IPC where its ranks share a node): sends and receives, whose batches involve only some
/// ranks and so cannot set it up themselves, then go device to device from the first call, as
/// NCCL's do. Only where they are enqueued on the stream (`OXCCL_NCCL_P2P`) on device memory and
/// a driver is present; a failure is kept by the communicator and returned by its first device
/// operation.
pub fn connect_device(comm: &oxccl_comm::Communicator, device: c_int) {
    #[cfg(feature = "cuda")]
    if p2p_on_stream() && !host_memory() && driver_present() {
        device::connect(comm, device);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (comm, device);
}

#[cfg(feature = "cuda")]
mod device {
    //! Device buffers on the caller's stream.
    use std::sync::{Arc, Mutex};

    use cudarc::driver::{sys, CudaContext, CudaStream};
    use oxccl_comm::{Buf, BufMut, DType};

    use super::{Call, Target};
    use crate::status::{fail, Outcome};

    /// [`super::connect_device`] on `device`'s context, through a stream of its own.
    pub(super) fn connect(comm: &oxccl_comm::Communicator, device: i32) {
        let Ok(ctx) = context(device) else {
            return;
        };
        if let Ok(stream) = ctx.new_stream() {
            // Kept by the communicator when it fails (`OXCCL_CUDA_IPC=1`, a rank late): its
            // first device operation returns it.
            let _ = comm.on_stream(&stream).connect();
        }
    }

    /// One context per device (its primary context), made once.
    fn context(device: i32) -> Result<Arc<CudaContext>, crate::status::Failure> {
        static CTXS: Mutex<Vec<(i32, Arc<CudaContext>)>> = Mutex::new(Vec::new());
        let mut ctxs = CTXS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, c)) = ctxs.iter().find(|(d, _)| *d == device) {
            return Ok(c.clone());
        }
        if !super::driver_present() {
            return Err(fail(
                crate::abi::UNHANDLED_CUDA_ERROR,
                "no CUDA driver (libcuda.so) here",
            ));
        }
        let ctx = CudaContext::new(device.max(0) as usize).map_err(|e| {
            fail(
                crate::abi::UNHANDLED_CUDA_ERROR,
                format!("device {device}: {e}"),
            )
        })?;
        ctxs.push((device, ctx.clone()));
        Ok(ctx)
    }

    /// `n` elements at `a`, read.
    ///
    /// # Safety
    /// See [`Buf::device_raw`]: the C caller's promise, as NCCL's API states it.
    unsafe fn r<'a>(a: u64, n: usize, dt: DType, s: &'a Arc<CudaStream>) -> Buf<'a> {
        // SAFETY: per the contract.
        unsafe { Buf::device_raw(if n == 0 { 0 } else { a }, n, dt, s) }
    }

    /// `n` elements at `a`, written.
    ///
    /// # Safety
    /// See [`BufMut::device_raw`].
    unsafe fn w<'a>(a: u64, n: usize, dt: DType, s: &'a Arc<CudaStream>) -> BufMut<'a> {
        // SAFETY: per the contract.
        unsafe { BufMut::device_raw(if n == 0 { 0 } else { a }, n, dt, s) }
    }

    /// A stream being captured into a CUDA graph: oxccl's device collectives keep state on
    /// the host (staging steps, slot parities, barrier counters) that a replay would not
    /// advance, so they refuse to be captured instead of replaying wrong.
    fn refuse_capture(stream: &CudaStream, call: &Call) -> Outcome {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a query of the caller's live stream, writing `status`.
        let r = unsafe { sys::cuStreamIsCapturing(stream.cu_stream(), &mut status) };
        if r != sys::CUresult::CUDA_SUCCESS {
            let msg = format!("cuStreamIsCapturing: {r:?}");
            return Err(fail(crate::abi::UNHANDLED_CUDA_ERROR, msg));
        }
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(crate::status::bad_use(format!(
                "{call:?} on a stream being captured into a CUDA graph: oxccl's device \
                 collectives cannot be captured yet (run them outside the graph)"
            )));
        }
        Ok(())
    }

    /// A communicator's sends and receives of one group, on device buffers: enqueued on the
    /// caller's stream as one of oxccl's device batches ([`stream_batch`]), or with
    /// `OXCCL_NCCL_P2P=sync` synchronously ([`sync_batch`]).
    pub(super) fn batch(t: &Target, calls: &[Call]) -> Outcome {
        if super::p2p_on_stream() {
            stream_batch(t, calls)
        } else {
            sync_batch(t, calls)
        }
    }

    /// The batch as oxccl's `Buffers::batch_p2p` on device views, enqueued on the caller's
    /// stream: over CUDA IPC once the communicator's first device collective has set it up
    /// (device to device), else staged (the bytes to send copied to pinned memory, the batch on
    /// the progress thread, the received bytes copied back behind the stream's wait); the call
    /// returns once that is enqueued.
    fn stream_batch(t: &Target, calls: &[Call]) -> Outcome {
        use oxccl_comm::P2pView;
        let comm = t.comm.comm()?;
        let ctx = context(t.comm.device)?;
        // SAFETY: as in `run`.
        let stream = unsafe { ctx.wrap_borrowed_stream(t.stream as sys::CUstream) };
        if let Some(c) = calls.first() {
            refuse_capture(&stream, c)?;
        }
        let (dt, s) = (t.dtype, &stream);
        let mut views = Vec::with_capacity(calls.len());
        for &c in calls {
            views.push(match c {
                Call::Send { buf, count, peer } => {
                    // SAFETY: the C caller's address and count, under NCCL's contract (device
                    // memory of this context, left alone until the stream has run the call).
                    let buf = unsafe { r(buf, count, dt, s) };
                    P2pView::Send { buf, peer }
                }
                Call::Recv { buf, count, peer } => {
                    // SAFETY: as above, and nothing else touches it until the stream has run.
                    let buf = unsafe { w(buf, count, dt, s) };
                    P2pView::Recv { buf, peer }
                }
                other => {
                    let msg = format!("{other:?} in a batch of sends and receives");
                    return Err(crate::status::bad_arg(msg));
                }
            });
        }
        comm.buffers().batch_p2p(views)?;
        Ok(())
    }

    /// The batch through host copies, synchronously: the caller's stream is synchronized
    /// first (the data to send is written), the batch runs on the host, and the received data
    /// is copied back before the call returns. Correct in any order of the group's calls.
    fn sync_batch(t: &Target, calls: &[Call]) -> Outcome {
        let ctx = context(t.comm.device)?;
        let cuda = |what: &str, e: cudarc::driver::DriverError| {
            fail(crate::abi::UNHANDLED_CUDA_ERROR, format!("{what}: {e}"))
        };
        ctx.bind_to_thread()
            .map_err(|e| cuda("binding the context", e))?;
        // SAFETY: as in `run`.
        let stream = unsafe { ctx.wrap_borrowed_stream(t.stream as sys::CUstream) };
        if let Some(c) = calls.first() {
            refuse_capture(&stream, c)?;
        }
        stream
            .synchronize()
            .map_err(|e| cuda("synchronizing the stream", e))?;
        let get = |a: u64, dst: &mut [u8]| {
            // SAFETY: NCCL's contract: each address holds the call's count of elements in
            // device memory of this context (the copies have exactly those bytes).
            let r = unsafe { cudarc::driver::result::memcpy_dtoh_sync(dst, a) };
            r.map_err(|e| cuda("copying a send buffer to the host", e))
        };
        let put = |a: u64, src: &[u8]| {
            // SAFETY: as above.
            let r = unsafe { cudarc::driver::result::memcpy_htod_sync(a, src) };
            r.map_err(|e| cuda("copying a received buffer to the device", e))
        };
        super::batch_via_host(t, calls, &get, &put)
    }

    pub(super) fn run(t: &Target, call: Call) -> Outcome {
        let comm = t.comm.comm()?;
        let ctx = context(t.comm.device)?;
        // SAFETY: the caller's stream (or the null stream) of this device's context, alive for
        // the call as NCCL requires; the wrapper never destroys it.
        let stream = unsafe { ctx.wrap_borrowed_stream(t.stream as sys::CUstream) };
        refuse_capture(&stream, &call)?;
        let (dt, s) = (t.dtype, &stream);
        // SAFETY: the views are the C caller's addresses and counts, who promises NCCL's
        // contract: device memory of this context, large enough for the call, left alone
        // until the stream has run it.
        let rd = |a, n| Ok(unsafe { r(a, n, dt, s) });
        // SAFETY: as above.
        let wr = |a, n| Ok(unsafe { w(a, n, dt, s) });
        super::dispatch(comm.buffers(), call, &rd, &wr, (comm.rank(), comm.size()))
    }
}
