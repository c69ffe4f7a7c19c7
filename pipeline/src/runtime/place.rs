//! Where a pipeline's tensors live, and what that changes on the wire: host tensors move in the
//! same batch as their headers; device tensors (feature `cuda`) move in a second batch, one of
//! oxccl's device batches of sends and receives enqueued on the pipeline's exchange stream.

#[cfg(feature = "cuda-core")]
use std::sync::Arc;

#[cfg(feature = "cuda-core")]
use cudarc::driver::CudaStream;
#[cfg(feature = "cuda-core")]
use oxccl_comm::Communicator;

use crate::tensor::{Meta, Tensor};

/// Where every tensor a pipeline exchanges lives.
#[derive(Clone)]
pub(crate) enum Place {
    Host,
    /// Device memory; the stream the exchanges are enqueued on (the pipeline's own, so that
    /// a receive waiting for its peer holds up no computation that does not need it).
    #[cfg(feature = "cuda-core")]
    Device(Arc<CudaStream>),
    /// Host tensors moved as device ones are (the payloads in a batch after the headers'): the
    /// device protocol, tested without a GPU.
    #[cfg(test)]
    Split,
}

impl Place {
    pub(crate) fn is_device(&self) -> bool {
        #[cfg(feature = "cuda-core")]
        if matches!(self, Place::Device(_)) {
            return true;
        }
        false
    }

    /// Whether the payloads go in a batch of their own after the headers' (device batches
    /// cannot hold the host headers).
    pub(crate) fn split(&self) -> bool {
        !matches!(self, Place::Host)
    }

    /// Where, in words.
    pub(crate) fn name(&self) -> &'static str {
        if self.is_device() {
            "device"
        } else {
            "host"
        }
    }

    /// Zeros of `m` here.
    pub(crate) fn zeros(&self, m: &Meta) -> Result<Tensor, String> {
        #[cfg(feature = "cuda-core")]
        if let Place::Device(s) = self {
            return Tensor::device_zeros(m.dtype, &m.shape, s)
                .map_err(|e| format!("allocating {} bytes of device memory: {e}", m.nbytes()));
        }
        Ok(Tensor::zeros(m.dtype, &m.shape))
    }
}

/// The sends and receives of device tensors, as one device batch on `stream`: each non-empty
/// tensor of `sends[i]` to `sends[i].0`, each of `recvs[i]` from its peer, in order.
#[cfg(feature = "cuda-core")]
pub(crate) fn device_batch(
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    sends: &[(usize, &[Tensor])],
    recvs: &mut [(usize, &mut [Tensor])],
) -> Result<(), oxccl_comm::Error> {
    use oxccl_comm::{Buf, BufMut, P2pView};
    let mut views = Vec::new();
    for (peer, ts) in sends {
        for d in ts
            .iter()
            .filter_map(Tensor::device)
            .filter(|d| !d.is_empty())
        {
            let buf = Buf::device::<u8>(d, stream);
            views.push(P2pView::Send { buf, peer: *peer });
        }
    }
    for (peer, ts) in recvs.iter_mut() {
        for d in ts
            .iter_mut()
            .filter_map(Tensor::device_mut)
            .filter(|d| !d.is_empty())
        {
            let buf = BufMut::device::<u8>(d, stream);
            views.push(P2pView::Recv { buf, peer: *peer });
        }
    }
    if views.is_empty() {
        return Ok(());
    }
    comm.buffers().batch_p2p(views)
}
