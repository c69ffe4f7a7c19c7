//! The collectives and point-to-point calls: checked when called (the communicator, the data
//! type, the operation, the root or peer), then run now or at the end of the caller's group
//! (`crate::group`). With the `cuda` feature each one enqueues on the caller's stream through
//! oxccl's device collectives and returns; without it, every one fails saying so.

use std::ffi::c_int;
use std::sync::Arc;

use oxccl_comm::{DType, ReduceOp};

use crate::abi;
use crate::comm::{handle, CommPtr, Handle};
use crate::group;
use crate::status::{bad_arg, Outcome};

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
    group::op(Box::new(move || run(&t, call)))
}

#[cfg(not(feature = "cuda"))]
fn run(t: &Target, call: Call) -> Outcome {
    let _ = (t.comm.comm()?, t.dtype, t.stream);
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
fn run(t: &Target, call: Call) -> Outcome {
    device::run(t, call)
}

#[cfg(feature = "cuda")]
mod device {
    use std::sync::{Arc, Mutex};

    use cudarc::driver::{sys, CudaContext, CudaStream};
    use oxccl_comm::{Buf, BufMut, DType};

    use super::{Call, Target};
    use crate::status::{fail, Outcome};

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

    pub(super) fn run(t: &Target, call: Call) -> Outcome {
        let comm = t.comm.comm()?;
        let ctx = context(t.comm.device)?;
        // SAFETY: the caller's stream (or the null stream) of this device's context, alive for
        // the call as NCCL requires; the wrapper never destroys it.
        let stream = unsafe { ctx.wrap_borrowed_stream(t.stream as sys::CUstream) };
        refuse_capture(&stream, &call)?;
        let (b, dt, s, n, me) = (comm.buffers(), t.dtype, &stream, comm.size(), comm.rank());
        // SAFETY: every view below has the C caller's addresses and counts, who promises
        // NCCL's contract: device memory of this context, large enough for the call, left
        // alone until the stream has run it. Non-roots' root-only buffers are viewed empty.
        unsafe {
            match call {
                Call::AllReduce {
                    send,
                    recv,
                    count,
                    op,
                } if send == recv => b.all_reduce(w(recv, count, dt, s), op)?,
                Call::AllReduce {
                    send,
                    recv,
                    count,
                    op,
                } => b.all_reduce_into(r(send, count, dt, s), w(recv, count, dt, s), op)?,
                Call::Broadcast {
                    send,
                    recv,
                    count,
                    root,
                } if send == recv => b.broadcast(w(recv, count, dt, s), root)?,
                Call::Broadcast {
                    send,
                    recv,
                    count,
                    root,
                } => {
                    let k = if me == root { count } else { 0 };
                    b.broadcast_into(r(send, k, dt, s), w(recv, count, dt, s), root)?
                }
                Call::Reduce {
                    send,
                    recv,
                    count,
                    op,
                    root,
                } => {
                    let k = if me == root { count } else { 0 };
                    b.reduce_into(r(send, count, dt, s), w(recv, k, dt, s), op, root)?
                }
                Call::AllGather { send, recv, count } => {
                    b.all_gather_into(r(send, count, dt, s), w(recv, count * n, dt, s))?
                }
                Call::ReduceScatter {
                    send,
                    recv,
                    count,
                    op,
                } => b.reduce_scatter_into(r(send, count * n, dt, s), w(recv, count, dt, s), op)?,
                Call::AllToAll { send, recv, count } => {
                    b.all_to_all_into(r(send, count * n, dt, s), w(recv, count * n, dt, s))?
                }
                Call::Gather {
                    send,
                    recv,
                    count,
                    root,
                } => {
                    let k = if me == root { count * n } else { 0 };
                    b.gather_into(r(send, count, dt, s), w(recv, k, dt, s), root)?
                }
                Call::Scatter {
                    send,
                    recv,
                    count,
                    root,
                } => {
                    let k = if me == root { count * n } else { 0 };
                    b.scatter_into(r(send, k, dt, s), w(recv, count, dt, s), root)?
                }
                Call::Send { buf, count, peer } => b.send(r(buf, count, dt, s), peer)?,
                Call::Recv { buf, count, peer } => b.recv(w(buf, count, dt, s), peer)?,
            }
        }
        Ok(())
    }
}
