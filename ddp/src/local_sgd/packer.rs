//! The parameters an averager takes, checked, packed into buckets and averaged over a
//! communicator: what [`ModelAverager`](super::ModelAverager) and
//! [`HierarchicalAverager`](super::HierarchicalAverager) share.

use oxccl_comm::Communicator;

use crate::error::{DdpError, Result};
use crate::flat::{FlatBuffer, GradBuf};
use crate::hooks::{AllReduceAvg, CommHook, GradBucket};
use crate::layout::{plan, ParamSpec};

/// Refuses, on every rank alike (given the same list), parameters an average cannot take:
/// integer ones, and `GradBuf` views that disagree in length.
pub(super) fn check_params<P: GradBuf>(
    rank: usize,
    op: &'static str,
    params: &mut [P],
) -> Result<()> {
    let invalid = |msg: String| DdpError::InvalidArgument { rank, op, msg };
    for (i, p) in params.iter_mut().enumerate() {
        let dtype = p.dtype();
        if !dtype.is_float() {
            return Err(invalid(format!(
                "parameter {i} is {}: only floating-point parameters can be averaged",
                dtype.short_name()
            )));
        }
        let (n, n_mut) = (p.bytes().len(), p.bytes_mut().len());
        if n != n_mut || !n.is_multiple_of(dtype.size()) {
            return Err(invalid(format!(
                "parameter {i} ({}): its views hold {n} and {n_mut} bytes",
                dtype.short_name()
            )));
        }
    }
    Ok(())
}

/// Packs parameters into buckets (DDP's layout) and averages them over a communicator, keeping
/// its buffers between averages.
pub(super) struct Packer {
    pub(super) cap_bytes: usize,
    /// The last average's packing buffers, reused while the layout stays the same.
    pub(super) buffers: Vec<Option<FlatBuffer>>,
}

impl Packer {
    pub(super) fn new() -> Packer {
        Packer {
            cap_bytes: 25 << 20,
            buffers: Vec::new(),
        }
    }

    pub(super) fn kept_bytes(&self) -> usize {
        self.buffers.iter().flatten().map(|b| b.bytes().len()).sum()
    }

    /// Replaces every parameter (checked by [`check_params`]) with its average over `comm`:
    /// every bucket's all-reduce is issued before the first is waited on, each one waited on,
    /// those that completed copied back, and the first error returned.
    pub(super) fn average<P: GradBuf>(
        &mut self,
        comm: &Communicator,
        params: &mut [P],
    ) -> Result<()> {
        // DDP's bucket layout, in parameter order, every bucket capped alike.
        let specs: Vec<ParamSpec> = params
            .iter()
            .map(|p| ParamSpec {
                name: String::new(),
                len: p.bytes().len() / p.dtype().size(),
                dtype: p.dtype(),
            })
            .collect();
        let order: Vec<usize> = (0..specs.len()).collect();
        // Empty buckets (of empty parameters) have nothing to average.
        let mut buckets = plan(&specs, &order, self.cap_bytes, self.cap_bytes).buckets;
        buckets.retain(|b| b.len > 0);
        self.buffers.resize_with(buckets.len(), || None);
        let mut pending = Vec::with_capacity(buckets.len());
        for (index, b) in buckets.iter().enumerate() {
            let mut buffer = match self.buffers[index].take() {
                Some(f) if f.dtype() == b.dtype && f.len() == b.len => f,
                _ => FlatBuffer::zeros(b.dtype, b.len),
            };
            let size = b.dtype.size();
            for (&p, &off) in b.params.iter().zip(&b.offsets) {
                let src = params[p].bytes();
                buffer.bytes_mut()[off * size..][..src.len()].copy_from_slice(src);
            }
            let bucket = GradBucket {
                index,
                buffer,
                params: Vec::new(),
            };
            pending.push(AllReduceAvg.start(comm, bucket));
        }
        let mut first_err = None;
        for (index, (work, b)) in pending.into_iter().zip(&buckets).enumerate() {
            match work.wait(comm) {
                Ok(buffer) => {
                    let size = b.dtype.size();
                    for (&p, &off) in b.params.iter().zip(&b.offsets) {
                        let dst = params[p].bytes_mut();
                        let n = dst.len();
                        dst.copy_from_slice(&buffer.bytes()[off * size..][..n]);
                    }
                    self.buffers[index] = Some(buffer);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}
