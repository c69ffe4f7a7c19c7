//! The exported C functions. Each `ncclX` calls `pncclX`, which does the work; every body runs
//! through [`crate::status::run`]. The safety contract of every function is NCCL's own (valid
//! pointers of the sizes its documentation states, communicators this library returned).
#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

use std::ffi::{c_char, c_int, c_void};

use crate::abi::{self, Config, NcclResult, UniqueId};
use crate::coll::{self, Call};
use crate::comm::{self, handle, CommPtr};
use crate::group;
use crate::id;
use crate::status::{bad_arg, bad_use, error_string, last_error, not_implemented, run};

/// An opaque pointer NCCL's API passes around (windows, parameter handles).
type Opaque = *mut c_void;

nccl_fn!("`ncclGetVersion`: the NCCL version implemented (2.30.0 = 23000)."
ncclGetVersion pncclGetVersion(version: *mut c_int) -> NcclResult {
    run("ncclGetVersion", || {
        if version.is_null() {
            return Err(bad_arg("version is NULL"));
        }
        // SAFETY: checked non-null; writable per NCCL's contract.
        unsafe { version.write(abi::VERSION_CODE) };
        Ok(())
    })
});

nccl_fn!("`ncclGetUniqueId`: starts this process's store for a new communicator and names it."
ncclGetUniqueId pncclGetUniqueId(unique_id: *mut UniqueId) -> NcclResult {
    run("ncclGetUniqueId", || {
        if unique_id.is_null() {
            return Err(bad_arg("uniqueId is NULL"));
        }
        let made = id::new_id()?;
        // SAFETY: checked non-null; writable per NCCL's contract.
        unsafe { unique_id.write(made) };
        Ok(())
    })
});

nccl_fn!("`ncclCommInitRank`: rank `rank` of `nranks` (deferred to `ncclGroupEnd` in a group)."
ncclCommInitRank pncclCommInitRank(comm: *mut CommPtr, nranks: c_int, comm_id: UniqueId, rank: c_int) -> NcclResult {
    run("ncclCommInitRank", || {
        let root = id::decode(&comm_id).map_err(bad_arg)?;
        // SAFETY: NCCL's contract: `comm` is writable (checked non-null inside).
        unsafe { comm::init_rank(comm, nranks, root, rank, true) }
    })
});

nccl_fn!("`ncclCommInitRankConfig`: [`ncclCommInitRank`] with a config, read up to its `size`."
ncclCommInitRankConfig pncclCommInitRankConfig(comm: *mut CommPtr, nranks: c_int, comm_id: UniqueId, rank: c_int, config: *mut Config) -> NcclResult {
    run("ncclCommInitRankConfig", || {
        // SAFETY: NCCL's contract: `config` is null or an initialised ncclConfig_t.
        let cfg = unsafe { Config::read(config) }.map_err(bad_arg)?;
        let root = id::decode(&comm_id).map_err(bad_arg)?;
        // SAFETY: as in ncclCommInitRank.
        unsafe { comm::init_rank(comm, nranks, root, rank, cfg.blocking()) }
    })
});

nccl_fn!("`ncclCommInitAll`: `ndev` ranks of one communicator in this process."
ncclCommInitAll pncclCommInitAll(comm: *mut CommPtr, ndev: c_int, devlist: *const c_int) -> NcclResult {
    run("ncclCommInitAll", || {
        // SAFETY: NCCL's contract: `comm` holds `ndev` slots, `devlist` null or `ndev` ints.
        unsafe { comm::init_all(comm, ndev, devlist) }
    })
});

nccl_fn!("`ncclCommFinalize`: every operation is enqueued when its call returns: nothing to flush."
ncclCommFinalize pncclCommFinalize(comm: CommPtr) -> NcclResult {
    run("ncclCommFinalize", || {
        // SAFETY: NCCL's contract: a live communicator.
        unsafe { handle(comm) }?.comm()?;
        Ok(())
    })
});

nccl_fn!("`ncclCommDestroy`: closes the communicator once no call uses it."
ncclCommDestroy pncclCommDestroy(comm: CommPtr) -> NcclResult {
    run("ncclCommDestroy", || {
        if comm.is_null() {
            return Err(bad_arg("the communicator is NULL"));
        }
        // SAFETY: NCCL's contract: a communicator of this library, destroyed once.
        unsafe { comm::release(comm) };
        Ok(())
    })
});

nccl_fn!("`ncclCommAbort`: fails the call in progress on every rank (from any thread), then destroys."
ncclCommAbort pncclCommAbort(comm: CommPtr) -> NcclResult {
    run("ncclCommAbort", || {
        // SAFETY: NCCL's contract: a live communicator.
        let h = unsafe { handle(comm) }?;
        // One still being created is not waited for: its creation ends with its deadlines.
        if let Some(c) = h.created() {
            c.abort();
        }
        // SAFETY: as in ncclCommDestroy.
        unsafe { comm::release(comm) };
        Ok(())
    })
});

nccl_fn!("`ncclCommSplit`: ranks with the same `color` form a new communicator, ordered by `key`."
ncclCommSplit pncclCommSplit(comm: CommPtr, color: c_int, key: c_int, newcomm: *mut CommPtr, config: *mut Config) -> NcclResult {
    run("ncclCommSplit", || {
        // SAFETY: NCCL's contract: `config` is null or an initialised ncclConfig_t.
        let cfg = unsafe { Config::read(config) }.map_err(bad_arg)?;
        // SAFETY: NCCL's contract: a live parent, a writable `newcomm`.
        unsafe { comm::split(comm, color, key, newcomm, cfg.blocking_set()) }
    })
});

nccl_fn!("`ncclCommShrink`: the parent's ranks but the excluded ones (which do not call it)."
ncclCommShrink pncclCommShrink(comm: CommPtr, exclude: *mut c_int, exclude_count: c_int, newcomm: *mut CommPtr, config: *mut Config, flags: c_int) -> NcclResult {
    run("ncclCommShrink", || {
        // SAFETY: NCCL's contract: `config` is null or an initialised ncclConfig_t.
        let cfg = unsafe { Config::read(config) }.map_err(bad_arg)?;
        // SAFETY: NCCL's contract: a live parent, `exclude_count` ranks, a writable `newcomm`.
        unsafe { comm::shrink(comm, exclude, exclude_count, newcomm, (flags, cfg.blocking_set())) }
    })
});

nccl_fn!("`ncclGetErrorString`: a static text for a result code."
ncclGetErrorString pncclGetErrorString(result: NcclResult) -> *const c_char {
    error_string(result).as_ptr()
});

nccl_fn!("`ncclGetLastError`: the text of this process's last failure (any communicator)."
ncclGetLastError pncclGetLastError(comm: CommPtr) -> *const c_char {
    let _ = comm;
    last_error()
});

nccl_fn!("`ncclResetDebugInit`: oxccl reads `OXCCL_DEBUG` when logging starts; nothing to reset."
ncclResetDebugInit pncclResetDebugInit() -> () {});

nccl_fn!("`ncclCommGetAsyncError`: a failed creation or a device operation's late error."
ncclCommGetAsyncError pncclCommGetAsyncError(comm: CommPtr, async_error: *mut NcclResult) -> NcclResult {
    run("ncclCommGetAsyncError", || {
        // SAFETY: NCCL's contract: a live communicator.
        let h = unsafe { handle(comm) }?;
        if async_error.is_null() {
            return Err(bad_arg("asyncError is NULL"));
        }
        // SAFETY: checked non-null; writable per NCCL's contract.
        unsafe { async_error.write(h.async_error()) };
        Ok(())
    })
});

/// Writes `f(communicator)` to `out`.
///
/// # Safety
/// `comm` as for [`handle`]; `out` null or writable.
unsafe fn query(
    name: &str,
    comm: CommPtr,
    out: *mut c_int,
    f: fn(&comm::Handle) -> Result<c_int, crate::status::Failure>,
) -> NcclResult {
    run(name, || {
        // SAFETY: per the contract.
        let h = unsafe { handle(comm) }?;
        if out.is_null() {
            return Err(bad_arg("the output pointer is NULL"));
        }
        let v = f(h)?;
        // SAFETY: checked non-null; writable per the contract.
        unsafe { out.write(v) };
        Ok(())
    })
}

nccl_fn!("`ncclCommCount`: the number of ranks."
ncclCommCount pncclCommCount(comm: CommPtr, count: *mut c_int) -> NcclResult {
    // SAFETY: NCCL's contract.
    unsafe { query("ncclCommCount", comm, count, |h| Ok(h.comm()?.size() as c_int)) }
});

nccl_fn!("`ncclCommCuDevice`: the CUDA device the communicator was created for."
ncclCommCuDevice pncclCommCuDevice(comm: CommPtr, device: *mut c_int) -> NcclResult {
    // SAFETY: NCCL's contract.
    unsafe { query("ncclCommCuDevice", comm, device, |h| Ok(h.device)) }
});

nccl_fn!("`ncclCommUserRank`: this rank."
ncclCommUserRank pncclCommUserRank(comm: CommPtr, rank: *mut c_int) -> NcclResult {
    // SAFETY: NCCL's contract.
    unsafe { query("ncclCommUserRank", comm, rank, |h| Ok(h.comm()?.rank() as c_int)) }
});

nccl_fn!("`ncclCommRegister`: oxccl needs no registration; the handle is the buffer's address."
ncclCommRegister pncclCommRegister(comm: CommPtr, buff: *mut c_void, size: usize, reg_handle: *mut *mut c_void) -> NcclResult {
    run("ncclCommRegister", || {
        // SAFETY: NCCL's contract: a live communicator.
        unsafe { handle(comm) }?;
        if reg_handle.is_null() {
            return Err(bad_arg("handle is NULL"));
        }
        let _ = size;
        // SAFETY: checked non-null; writable per NCCL's contract.
        unsafe { reg_handle.write(buff) };
        Ok(())
    })
});

nccl_fn!("`ncclCommDeregister`: nothing was registered."
ncclCommDeregister pncclCommDeregister(comm: CommPtr, reg_handle: *mut c_void) -> NcclResult {
    run("ncclCommDeregister", || {
        let _ = reg_handle;
        // SAFETY: NCCL's contract: a live communicator.
        unsafe { handle(comm) }?;
        Ok(())
    })
});

nccl_fn!("`ncclRedOpCreatePreMulSum`: a sum of each rank's input times its own host scalar."
ncclRedOpCreatePreMulSum pncclRedOpCreatePreMulSum(op: *mut c_int, scalar: *mut c_void, datatype: c_int, residence: c_int, comm: CommPtr) -> NcclResult {
    run("ncclRedOpCreatePreMulSum", || {
        // SAFETY: NCCL's contract: a live communicator.
        let h = unsafe { handle(comm) }?;
        if op.is_null() || scalar.is_null() {
            return Err(bad_arg("op or scalar is NULL"));
        }
        if residence != abi::SCALAR_HOST_IMMEDIATE {
            return Err(bad_use(
                "ncclScalarDevice (a scalar in device memory) is not implemented by oxccl: \
                 pass ncclScalarHostImmediate",
            ));
        }
        let dt = abi::dtype(datatype)
            .ok_or_else(|| bad_arg(format!("ncclDataType_t {datatype} is not a data type")))?;
        // SAFETY: NCCL's contract: a host scalar of `datatype`, readable.
        let factor = unsafe { crate::exports::read_scalar(scalar, dt) }?;
        let made = h.add_premul(factor)?;
        // SAFETY: checked non-null; writable per NCCL's contract.
        unsafe { op.write(made) };
        Ok(())
    })
});

/// The host scalar of `dt` at `p`, as f64.
///
/// # Safety
/// `p` points to a readable value of `dt`.
unsafe fn read_scalar(
    p: *const c_void,
    dt: oxccl_comm::DType,
) -> Result<f64, crate::status::Failure> {
    use oxccl_comm::DType as D;
    // SAFETY: per the contract, `p` holds a value of the type each arm reads; read unaligned.
    let v = unsafe {
        match dt {
            D::F32 => f64::from(p.cast::<f32>().read_unaligned()),
            D::F64 => p.cast::<f64>().read_unaligned(),
            D::F16 => p.cast::<oxccl_comm::f16>().read_unaligned().to_f64(),
            D::BF16 => p.cast::<oxccl_comm::bf16>().read_unaligned().to_f64(),
            D::I8 => f64::from(p.cast::<i8>().read_unaligned()),
            D::U8 => f64::from(p.cast::<u8>().read_unaligned()),
            D::I32 => f64::from(p.cast::<i32>().read_unaligned()),
            D::U32 => f64::from(p.cast::<u32>().read_unaligned()),
            D::I64 => p.cast::<i64>().read_unaligned() as f64,
            D::U64 => p.cast::<u64>().read_unaligned() as f64,
            D::F8E4M3 => p.cast::<oxccl_comm::F8E4M3>().read_unaligned().to_f64(),
            D::F8E5M2 => p.cast::<oxccl_comm::F8E5M2>().read_unaligned().to_f64(),
        }
    };
    Ok(v)
}

nccl_fn!("`ncclRedOpDestroy`: forgets an operation made by [`ncclRedOpCreatePreMulSum`]."
ncclRedOpDestroy pncclRedOpDestroy(op: c_int, comm: CommPtr) -> NcclResult {
    run("ncclRedOpDestroy", || {
        // SAFETY: NCCL's contract: a live communicator.
        unsafe { handle(comm) }?.remove_op(op)
    })
});

nccl_fn!("`ncclGroupStart`: defers creations and operations of this thread to `ncclGroupEnd`."
ncclGroupStart pncclGroupStart() -> NcclResult {
    run("ncclGroupStart", || {
        group::start();
        Ok(())
    })
});

nccl_fn!("`ncclGroupEnd`: runs what the group deferred (creations together, then the operations)."
ncclGroupEnd pncclGroupEnd() -> NcclResult {
    run("ncclGroupEnd", group::end)
});

nccl_fn!("`ncclMemAlloc`: device memory (`cuMemAlloc` in the current context; feature `cuda`)."
ncclMemAlloc pncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> NcclResult {
    run("ncclMemAlloc", || {
        if ptr.is_null() {
            return Err(bad_arg("ptr is NULL"));
        }
        let p = crate::exports::mem::alloc(size)?;
        // SAFETY: checked non-null; writable per NCCL's contract.
        unsafe { ptr.write(p as *mut c_void) };
        Ok(())
    })
});

nccl_fn!("`ncclMemFree`: frees what [`ncclMemAlloc`] gave."
ncclMemFree pncclMemFree(ptr: *mut c_void) -> NcclResult {
    run("ncclMemFree", || crate::exports::mem::free(ptr as u64))
});

mod mem {
    //! `ncclMemAlloc` / `ncclMemFree` through the driver's current context.
    use crate::status::{Failure, Outcome};

    #[cfg(feature = "cuda")]
    pub fn alloc(size: usize) -> Result<u64, Failure> {
        use crate::status::fail;
        if !crate::coll::driver_present() {
            return Err(fail(
                crate::abi::UNHANDLED_CUDA_ERROR,
                "no CUDA driver (libcuda.so) here",
            ));
        }
        // SAFETY: a plain allocation in the calling thread's current context.
        unsafe { cudarc::driver::result::malloc_sync(size.max(1)) }.map_err(|e| {
            fail(
                crate::abi::UNHANDLED_CUDA_ERROR,
                format!("cuMemAlloc({size}): {e}"),
            )
        })
    }

    #[cfg(feature = "cuda")]
    pub fn free(ptr: u64) -> Outcome {
        use crate::status::fail;
        if ptr == 0 {
            return Ok(());
        }
        // SAFETY: NCCL's contract: `ptr` came from ncclMemAlloc and is freed once.
        unsafe { cudarc::driver::result::free_sync(ptr) }
            .map_err(|e| fail(crate::abi::UNHANDLED_CUDA_ERROR, format!("cuMemFree: {e}")))
    }

    #[cfg(not(feature = "cuda"))]
    pub fn alloc(size: usize) -> Result<u64, Failure> {
        Err(crate::status::bad_use(format!(
            "ncclMemAlloc({size}): this libnccl.so.2 was built without the `cuda` feature"
        )))
    }

    #[cfg(not(feature = "cuda"))]
    pub fn free(ptr: u64) -> Outcome {
        let _ = ptr;
        Err(crate::status::bad_use(
            "ncclMemFree: this libnccl.so.2 was built without the `cuda` feature",
        ))
    }
}

/// Checks and submits a call (see [`crate::coll`]).
///
/// # Safety
/// NCCL's contract for the call: a live communicator, device buffers of the sizes it states.
unsafe fn collective(
    name: &str,
    comm: CommPtr,
    dtype: c_int,
    op: Option<c_int>,
    stream: *mut c_void,
    root: Option<(&str, c_int)>,
    make: impl FnOnce(Option<oxccl_comm::ReduceOp>, usize) -> Call,
) -> NcclResult {
    run(name, || {
        // SAFETY: per the contract.
        let (t, op) = unsafe { coll::target(comm, dtype, op, stream as usize) }?;
        let r = match root {
            Some((what, r)) => coll::rank_arg(&t, what, r)?,
            None => 0,
        };
        coll::submit(t, make(op, r))
    })
}

/// The operation of a call made with one (always `Some`).
fn op_of(op: Option<oxccl_comm::ReduceOp>) -> oxccl_comm::ReduceOp {
    op.unwrap_or(oxccl_comm::ReduceOp::Sum)
}

nccl_fn!("`ncclAllReduce`, enqueued on `stream`."
ncclAllReduce pncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, comm: CommPtr, stream: *mut c_void) -> NcclResult {
    // SAFETY: NCCL's contract.
    unsafe { collective("ncclAllReduce", comm, datatype, Some(op), stream, None, |o, _| Call::AllReduce { send: sendbuff as u64, recv: recvbuff as u64, count, op: op_of(o) }) }
});

nccl_fn!("`ncclBroadcast`, enqueued on `stream`."
ncclBroadcast pncclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: CommPtr, stream: *mut c_void) -> NcclResult {
    // SAFETY: NCCL's contract.
    unsafe { collective("ncclBroadcast", comm, datatype, None, stream, Some(("root", root)), |_, root| Call::Broadcast { send: sendbuff as u64, recv: recvbuff as u64, count, root }) }
});

nccl_fn!("`ncclBcast`: in-place [`ncclBroadcast`]."
ncclBcast pncclBcast(buff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: CommPtr, stream: *mut c_void) -> NcclResult {
    // SAFETY: NCCL's contract.
    unsafe { collective("ncclBcast", comm, datatype, None, stream, Some(("root", root)), |_, root| Call::Broadcast { send: buff as u64, recv: buff as u64, count, root }) }
});

nccl_fn!("`ncclReduce`, enqueued on `stream`."
ncclReduce pncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, op: c_int, root: c_int, comm: CommPtr, stream: *mut c_void) -> NcclResult {
    // SAFETY: NCCL's contract.
    unsafe { collective("ncclReduce", comm, datatype, Some(op), stream, Some(("root", root)), |o, root| Call::Reduce { send: sendbuff as u64, recv: recvbuff as u64, count, op: op_of(o), root }) }
});

nccl_fn!("`ncclAllGather`, enqueued on `stream`."
ncclAllGather pncclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: c_int, comm: CommPtr, stream: *mut c_void) -> NcclResult {
    // SAFETY: NCCL's contract.
    unsafe { collective("ncclAllGather", comm, datatype, None, stream, None, |_, _| Call::AllGather { send: sendbuff as u64, recv: recvbuff as u64, count: sendcount }) }
});

nccl_fn!("`ncclReduceScatter`, enqueued on `stream`."
ncclReduceScatter pncclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: c_int, op: c_int, comm: CommPtr, stream: *mut c_void) -> NcclResult {
    // SAFETY: NCCL's contract.
    unsafe { collective("ncclReduceScatter", comm, datatype, Some(op), stream, None, |o, _| Call::ReduceScatter { send: sendbuff as u64, recv: recvbuff as u64, count: recvcount, op: op_of(o) }) }
});

nccl_fn!("`ncclAlltoAll`: `count` elements to and from every rank, enqueued on `stream`."
ncclAlltoAll pncclAlltoAll(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, comm: CommPtr, stream: *mut c_void) -> NcclResult {
    // SAFETY: NCCL's contract.
    unsafe { collective("ncclAlltoAll", comm, datatype, None, stream, None, |_, _| Call::AllToAll { send: sendbuff as u64, recv: recvbuff as u64, count }) }
});

nccl_fn!("`ncclGather`, enqueued on `stream`."
ncclGather pncclGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: CommPtr, stream: *mut c_void) -> NcclResult {
    // SAFETY: NCCL's contract.
    unsafe { collective("ncclGather", comm, datatype, None, stream, Some(("root", root)), |_, root| Call::Gather { send: sendbuff as u64, recv: recvbuff as u64, count, root }) }
});

nccl_fn!("`ncclScatter`, enqueued on `stream`."
ncclScatter pncclScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: c_int, root: c_int, comm: CommPtr, stream: *mut c_void) -> NcclResult {
    // SAFETY: NCCL's contract.
    unsafe { collective("ncclScatter", comm, datatype, None, stream, Some(("root", root)), |_, root| Call::Scatter { send: sendbuff as u64, recv: recvbuff as u64, count, root }) }
});

nccl_fn!("`ncclSend`, enqueued on `stream`."
ncclSend pncclSend(sendbuff: *const c_void, count: usize, datatype: c_int, peer: c_int, comm: CommPtr, stream: *mut c_void) -> NcclResult {
    // SAFETY: NCCL's contract.
    unsafe { collective("ncclSend", comm, datatype, None, stream, Some(("peer", peer)), |_, peer| Call::Send { buf: sendbuff as u64, count, peer }) }
});

nccl_fn!("`ncclRecv`, enqueued on `stream`."
ncclRecv pncclRecv(recvbuff: *mut c_void, count: usize, datatype: c_int, peer: c_int, comm: CommPtr, stream: *mut c_void) -> NcclResult {
    // SAFETY: NCCL's contract.
    unsafe { collective("ncclRecv", comm, datatype, None, stream, Some(("peer", peer)), |_, peer| Call::Recv { buf: recvbuff as u64, count, peer }) }
});

not_implemented!(ncclCommRevoke pncclCommRevoke(comm: CommPtr, revoke_flags: c_int));
not_implemented!(ncclCommGetUniqueId pncclCommGetUniqueId(comm: CommPtr, unique_id: *mut UniqueId));
not_implemented!(ncclCommGrow pncclCommGrow(comm: CommPtr, nranks: c_int, unique_id: *const UniqueId, rank: c_int, newcomm: *mut CommPtr, config: *mut Config));
not_implemented!(ncclCommInitRankScalable pncclCommInitRankScalable(newcomm: *mut CommPtr, nranks: c_int, myrank: c_int, nid: c_int, ids: *mut UniqueId, config: *mut Config));
not_implemented!(ncclCommSuspend pncclCommSuspend(comm: CommPtr, flags: c_int));
not_implemented!(ncclCommResume pncclCommResume(comm: CommPtr));
not_implemented!(ncclCommMemStats pncclCommMemStats(comm: CommPtr, stat: c_int, value: *mut u64));
not_implemented!(ncclCommWindowRegister pncclCommWindowRegister(comm: CommPtr, buff: *mut c_void, size: usize, win: *mut Opaque, flags: c_int));
not_implemented!(ncclCommWindowDeregister pncclCommWindowDeregister(comm: CommPtr, win: Opaque));
not_implemented!(ncclWinGetUserPtr pncclWinGetUserPtr(comm: CommPtr, win: Opaque, out: *mut *mut c_void));
not_implemented!(ncclPutSignal pncclPutSignal(localbuff: *const c_void, count: usize, datatype: c_int, peer: c_int, peer_win: Opaque, offset: usize, sig_idx: c_int, ctx: c_int, flags: u32, comm: CommPtr, stream: *mut c_void));
not_implemented!(ncclSignal pncclSignal(peer: c_int, sig_idx: c_int, ctx: c_int, flags: u32, comm: CommPtr, stream: *mut c_void));
not_implemented!(ncclWaitSignal pncclWaitSignal(ndesc: c_int, descs: *mut c_void, comm: CommPtr, stream: *mut c_void));
not_implemented!(ncclGroupSimulateEnd pncclGroupSimulateEnd(sim_info: *mut c_void));
not_implemented!(ncclParamBind pncclParamBind(out: *mut Opaque, key: *const c_char));
not_implemented!(ncclParamGetI8 pncclParamGetI8(h: Opaque, out: *mut i8));
not_implemented!(ncclParamGetI16 pncclParamGetI16(h: Opaque, out: *mut i16));
not_implemented!(ncclParamGetI32 pncclParamGetI32(h: Opaque, out: *mut i32));
not_implemented!(ncclParamGetI64 pncclParamGetI64(h: Opaque, out: *mut i64));
not_implemented!(ncclParamGetU8 pncclParamGetU8(h: Opaque, out: *mut u8));
not_implemented!(ncclParamGetU16 pncclParamGetU16(h: Opaque, out: *mut u16));
not_implemented!(ncclParamGetU32 pncclParamGetU32(h: Opaque, out: *mut u32));
not_implemented!(ncclParamGetU64 pncclParamGetU64(h: Opaque, out: *mut u64));
not_implemented!(ncclParamGetStr pncclParamGetStr(h: Opaque, out: *mut *const c_char));
not_implemented!(ncclParamGet pncclParamGet(h: Opaque, out: *mut c_void, max_len: c_int, len: *mut c_int));
not_implemented!(ncclParamGetParameter pncclParamGetParameter(key: *const c_char, value: *mut *const c_char, value_len: *mut c_int));
not_implemented!(ncclParamGetAllParameterKeys pncclParamGetAllParameterKeys(table: *mut *mut *const c_char, table_len: *mut c_int));

nccl_fn!("`ncclParamDumpAll`: not implemented by oxccl (it has no NCCL parameters): records that."
ncclParamDumpAll pncclParamDumpAll() -> () {
    let _ = run("ncclParamDumpAll", || Err(not_implemented("ncclParamDumpAll")));
});
