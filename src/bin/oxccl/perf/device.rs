//! `oxccl perf --device cuda`: the benchmark's buffers on the GPU (feature `cuda`).
//!
//! Each rank takes GPU `local_rank % device count` (several ranks may share one GPU) and a stream
//! of its own, and mirrors the host arenas of [`super::bench::Bench`] in device memory: input
//! arena `a`, output arena `b`, the same buffer sets at the same offsets. Calls go through
//! [`oxccl_comm::cuda::StreamComm`]; a measurement's clock stops after the stream has
//! synchronised. The checked call uploads the host-prepared set 0, runs, and downloads the
//! output for the host verifier.

use std::sync::Arc;

use oxccl_comm::cuda::cudarc::driver::sys::CUresult;
use oxccl_comm::cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError};
use oxccl_comm::{
    Buf, BufMut, Collective, Communicator, Element, Error, P2pView, ReduceOp, Result,
};

use super::sweep::Geometry;

/// The device copies of a bench's arenas.
pub struct DevArenas {
    stream: Arc<CudaStream>,
    a: CudaSlice<u8>,
    b: CudaSlice<u8>,
}

fn cuda(rank: usize, what: &str, e: DriverError) -> Error {
    Error::Cuda {
        rank,
        op: "perf".into(),
        msg: format!("{what}: {e:?}"),
    }
}

/// A failed context creation, with [`mps_hint`] added where it applies.
fn context_error(rank: usize, e: DriverError) -> Error {
    let connections = std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok();
    let hint = mps_hint(&e, connections.as_deref()).unwrap_or_default();
    Error::Cuda {
        rank,
        op: "perf".into(),
        msg: format!("context: {e:?}{hint}"),
    }
}

/// Why a context may have failed under MPS: the server shares a fixed number of hardware
/// connections among its clients, `CUDA_DEVICE_MAX_CONNECTIONS` to each, and a client past the
/// limit cannot create its context. (On the lent H100, 4 ranks as processes under MPS failed with
/// `CUDA_ERROR_OUT_OF_MEMORY` while that variable was 32; the cause is not yet confirmed there.)
fn mps_hint(e: &DriverError, connections: Option<&str>) -> Option<String> {
    let n = connections?;
    (e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY).then(|| {
        format!(
            " (CUDA_DEVICE_MAX_CONNECTIONS={n}: if the MPS daemon runs, every client takes that \
             many of its connections and clients past its limit cannot create a context; try \
             without it)"
        )
    })
}

/// The GPU rank `comm.rank()` uses: `local_rank % device count`.
///
/// # Errors
/// `Cuda` without a driver or device.
pub fn ordinal_for(comm: &Communicator) -> Result<usize> {
    let rank = comm.rank();
    if !oxccl_kernels::cuda::driver_available() {
        return Err(Error::Cuda {
            rank,
            op: "perf".into(),
            msg: "--device cuda: no CUDA driver (libcuda.so) or no device".into(),
        });
    }
    let count = CudaContext::device_count().map_err(|e| cuda(rank, "device count", e))?;
    Ok(comm.local_rank() % (count.max(1) as usize))
}

impl DevArenas {
    /// Device arenas of `a_bytes` and `b_bytes` on this rank's GPU.
    ///
    /// # Errors
    /// `Cuda` without a driver or device, or when allocation fails.
    pub fn new(comm: &Communicator, a_bytes: usize, b_bytes: usize) -> Result<DevArenas> {
        let rank = comm.rank();
        let ordinal = ordinal_for(comm)?;
        let ctx = CudaContext::new(ordinal).map_err(|e| context_error(rank, e))?;
        let stream = ctx.new_stream().map_err(|e| cuda(rank, "stream", e))?;
        let a = stream
            .alloc_zeros::<u8>(a_bytes.max(1))
            .map_err(|e| cuda(rank, "device memory", e))?;
        let b = stream
            .alloc_zeros::<u8>(b_bytes.max(1))
            .map_err(|e| cuda(rank, "device memory", e))?;
        // The device path now (CUDA IPC where the ranks share a node), so that sends and
        // receives, which cannot set it up themselves, use it from the first call.
        comm.on_stream(&stream).connect()?;
        Ok(DevArenas { stream, a, b })
    }

    /// Copies host bytes to the start of the input (`a`) or output (`b`) arena and waits.
    ///
    /// # Errors
    /// `Cuda` if the copy fails.
    pub fn upload(&mut self, rank: usize, to_b: bool, bytes: &[u8]) -> Result<()> {
        let dst = if to_b { &mut self.b } else { &mut self.a };
        let mut view = dst.slice_mut(..bytes.len());
        self.stream
            .memcpy_htod(bytes, &mut view)
            .and_then(|()| self.stream.synchronize())
            .map_err(|e| cuda(rank, "upload", e))
    }

    /// Copies the start of the output arena to `out` (waits).
    ///
    /// # Errors
    /// `Cuda` if the copy fails.
    pub fn download(&self, rank: usize, out: &mut [u8]) -> Result<()> {
        let view = self.b.slice(..out.len());
        self.stream
            .memcpy_dtoh(&view, out)
            .and_then(|()| self.stream.synchronize())
            .map_err(|e| cuda(rank, "download", e))
    }

    /// Waits for everything enqueued so far.
    ///
    /// # Errors
    /// `Cuda` if the stream failed.
    pub fn sync(&self, rank: usize) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| cuda(rank, "stream synchronize", e))
    }

    /// Enqueues one call of the collective on buffer set `set` (element offsets as the host
    /// bench's).
    ///
    /// # Errors
    /// Any error of the device call.
    #[allow(clippy::too_many_arguments)]
    pub fn call<T: Element>(
        &mut self,
        comm: &Communicator,
        coll: Collective,
        g: &Geometry,
        set: usize,
        in_place: bool,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        let ts = std::mem::size_of::<T>();
        let base = set * g.full * ts;
        let (rank, n) = (comm.rank(), comm.size());
        let dev = comm.on_stream(&self.stream);
        let view_err = || Error::InvalidArgument {
            rank,
            op: "perf".into(),
            msg: "device arena too small for the buffer set".into(),
        };
        if in_place {
            let mut b = self
                .b
                .try_slice_mut(base..base + g.full * ts)
                .ok_or_else(view_err)?;
            // SAFETY: `g.full` whole elements of `T` (bounds checked above); plain old data.
            let mut buf = unsafe { b.transmute_mut::<T>(g.full) }.ok_or_else(view_err)?;
            return match coll {
                Collective::AllReduce => dev.all_reduce(&mut buf, op),
                Collective::Broadcast => dev.broadcast(&mut buf, root),
                _ => Err(Error::InvalidArgument {
                    rank,
                    op: "perf".into(),
                    msg: format!("{coll} has no in-place form on device buffers"),
                }),
            };
        }
        let a = self
            .a
            .try_slice(base..base + g.input * ts)
            .ok_or_else(view_err)?;
        // SAFETY: `g.input` whole elements of `T` (bounds checked above); plain old data.
        let inp = unsafe { a.transmute::<T>(g.input) }.ok_or_else(view_err)?;
        let mut b = self
            .b
            .try_slice_mut(base..base + g.output * ts)
            .ok_or_else(view_err)?;
        // SAFETY: `g.output` whole elements of `T` (bounds checked above); plain old data.
        let mut out = unsafe { b.transmute_mut::<T>(g.output) }.ok_or_else(view_err)?;
        let at_root = rank == root;
        match coll {
            Collective::AllReduce => dev.all_reduce_into(&inp, &mut out, op),
            Collective::ReduceScatter => dev.reduce_scatter_into(&inp, &mut out, op),
            Collective::AllGather => dev.all_gather_into(&inp, &mut out),
            Collective::Broadcast => dev.broadcast_into(&inp, &mut out, root),
            Collective::Reduce if at_root => dev.reduce_into(&inp, &mut out, op, root),
            Collective::Reduce => dev.reduce_into(&inp, &mut out.slice_mut(..0), op, root),
            Collective::Gather if at_root => dev.gather_into(&inp, &mut out, root),
            Collective::Gather => dev.gather_into(&inp, &mut out.slice_mut(..0), root),
            Collective::Scatter if at_root => dev.scatter_into(&inp, &mut out, root),
            Collective::Scatter => dev.scatter_into(&inp.slice(..0), &mut out, root),
            Collective::AllToAll => dev.all_to_all_into(&inp, &mut out),
            Collective::SendRecv => {
                // One batch, as nccl-tests' sendrecv groups its send and receive.
                let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
                comm.buffers().batch_p2p(vec![
                    P2pView::Send {
                        buf: Buf::device(&inp, &self.stream),
                        peer: next,
                    },
                    P2pView::Recv {
                        buf: BufMut::device(&mut out, &self.stream),
                        peer: prev,
                    },
                ])
            }
            Collective::Barrier => comm.barrier(),
            // Refused with --device cuda (`Plan::from_args`).
            Collective::AllToAllV
            | Collective::AllGatherV
            | Collective::ReduceScatterV
            | Collective::GatherV
            | Collective::ScatterV => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{mps_hint, CUresult, DriverError};

    #[test]
    fn mps_hint_only_for_out_of_memory_with_connections_set() {
        let oom = DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        let hint = mps_hint(&oom, Some("32")).expect("a hint");
        assert!(hint.contains("CUDA_DEVICE_MAX_CONNECTIONS=32"), "{hint}");
        assert!(hint.contains("MPS"), "{hint}");
        assert_eq!(mps_hint(&oom, None), None);
        let other = DriverError(CUresult::CUDA_ERROR_NO_DEVICE);
        assert_eq!(mps_hint(&other, Some("32")), None);
    }
}
