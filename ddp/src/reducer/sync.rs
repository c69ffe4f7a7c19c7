//! `Ddp::sync`: every gradient at once, for frameworks that hand them all back after backward.
//!
//! With the default hook, gradients of at least `DdpConfig::sync_in_place_bytes` are all-reduced
//! in place in the caller's memory (no copy in, no copy out); smaller ones are packed into their
//! own buckets (the same caps), each launched as soon as it is packed so that packing overlaps
//! the all-reduces in flight, and copied back as each completes. Collectives are issued in the
//! bucket layout's parameter order, the same on every rank. With another hook every gradient goes
//! through the buckets and the hook.

use std::borrow::Borrow;

use oxccl_comm::{BufMut, Communicator, ReduceOp};

use super::{Ddp, Phase};
use crate::config::{Step, UnevenInputs};
use crate::error::{DdpError, Result};
use crate::flat::{FlatBuffer, GradBuf};
use crate::hooks::{AllReduceAvg, CommHook, GradBucket, HookWork};
use crate::layout::{plan, BucketSpec, Layout};

/// The packed layout of the small gradients for `sync`, rebuilt with the main layout.
pub(super) struct SyncPlan {
    /// Parameters in issue order; `true` where the gradient is all-reduced in place.
    pub(super) order: Vec<(usize, bool)>,
    /// Buckets of the small gradients only.
    pub(super) small: Layout,
    /// Their buffers, kept between calls (fresh ones would be faulted in every step).
    pub(super) bufs: Vec<Option<FlatBuffer>>,
}

impl<C: Borrow<Communicator>> Ddp<C> {
    pub(super) fn sync_plan(&self) -> SyncPlan {
        let min = self.cfg.sync_in_place_bytes;
        let order: Vec<(usize, bool)> = self
            .buckets
            .iter()
            .flat_map(|b| b.spec.params.iter())
            .map(|&p| (p, self.specs[p].bytes() >= min && self.specs[p].len > 0))
            .collect();
        let small_order: Vec<usize> = order.iter().filter(|o| !o.1).map(|o| o.0).collect();
        let small = plan(
            &self.specs,
            &small_order,
            self.cfg.first_bucket_bytes,
            self.cfg.bucket_cap_bytes,
        );
        let bufs = small
            .buckets
            .iter()
            .map(|b| Some(FlatBuffer::zeros(b.dtype, b.len)))
            .collect();
        SyncPlan { order, small, bufs }
    }

    /// For frameworks that hand back every gradient after backward (candle, burn): averages
    /// `grads[p]` (parameter `p`'s gradient) across ranks in place (see the module docs for how).
    /// In an accumulating micro-batch `grads` is only read and added into the buckets; the last
    /// micro-batch's call writes the average of the accumulated sums. Collective.
    ///
    /// # Errors
    /// `InvalidArgument` when `grads` does not match the parameters (count, dtype, length) or
    /// `grad_ready` was already used in this backward pass; a collective's error.
    pub fn sync<G: GradBuf>(&mut self, grads: &mut [G]) -> Result<Step> {
        if grads.len() != self.specs.len() {
            return Err(self.invalid(
                "sync",
                format!(
                    "{} gradients given for {} parameters",
                    grads.len(),
                    self.specs.len()
                ),
            ));
        }
        for (p, g) in grads.iter_mut().enumerate() {
            let (n, n_mut) = (g.bytes().len(), g.bytes_mut().len());
            if n != n_mut {
                return Err(self.invalid(
                    "sync",
                    format!("gradient {p}: bytes() has {n} bytes, bytes_mut() {n_mut}"),
                ));
            }
            self.check_param(p, g.dtype(), n, "sync")?;
        }
        if self.phase == Phase::Backward && !self.via_sync {
            return Err(self.invalid(
                "sync",
                "grad_ready or grad_slot was already called in this backward pass; use one or \
                 the other",
            ));
        }
        self.begin(true);
        if !self.syncing() || !self.default_hook {
            return self.sync_through_buckets(grads);
        }
        // Uneven inputs: when some training ranks feed this step through grad_ready, take the
        // bucket path as they (and joined ranks) do; the step then ends in an error everywhere.
        if self.cfg.uneven_inputs != UnevenInputs::Off {
            let t = self.trainers()?;
            if t.syncs != t.active {
                return self.sync_through_buckets(grads);
            }
        }
        if self.sync_plan.is_none() {
            self.sync_plan = Some(self.sync_plan());
        }
        let Some(mut sp) = self.sync_plan.take() else {
            return self.sync_through_buckets(grads);
        };
        let r = self.sync_direct(&mut sp, grads);
        self.sync_plan = Some(sp);
        r
    }

    /// Packs everything into the main buckets, launches them through the hook, copies back.
    fn sync_through_buckets<G: GradBuf>(&mut self, grads: &mut [G]) -> Result<Step> {
        for b in 0..self.buckets.len() {
            for k in 0..self.buckets[b].spec.params.len() {
                let p = self.buckets[b].spec.params[k];
                self.ingest(p, grads[p].bytes(), "sync", true)?;
            }
        }
        let lens: Vec<usize> = self.specs.iter().map(|s| s.len).collect();
        self.finish_with(|spec, buf| {
            let sz = spec.dtype.size();
            for (&p, &off) in spec.params.iter().zip(&spec.offsets) {
                let n = lens[p] * sz;
                grads[p]
                    .bytes_mut()
                    .copy_from_slice(&buf.bytes()[off * sz..off * sz + n]);
            }
        })
    }

    /// The synchronising call with the default hook: large gradients in place, small ones packed.
    fn sync_direct<G: GradBuf>(&mut self, sp: &mut SyncPlan, grads: &mut [G]) -> Result<Step> {
        let mut first_err = None;
        // Uneven inputs: the flag went first.
        let factor = self.wait_flag().unwrap_or_else(|e| {
            first_err = Some(e);
            1.0
        });
        let comm = self.comm.borrow();
        let small = &sp.small;
        let bufs = &mut sp.bufs;
        for (b, spec) in bufs.iter_mut().zip(&small.buckets) {
            if b.is_none() {
                // Lost with a failed collective: start again.
                *b = Some(FlatBuffer::zeros(spec.dtype, spec.len));
            }
        }
        let mut left: Vec<usize> = small.buckets.iter().map(|b| b.params.len()).collect();
        let mut works: Vec<Option<HookWork>> = (0..small.buckets.len()).map(|_| None).collect();
        for &(p, in_place) in &sp.order {
            let s = &self.specs[p];
            let sz = s.dtype.size();
            // Earlier micro-batches of this step left a sum in the main bucket: add it in.
            let (mb, moff) = self.slot[p];
            let acc = self.seen[p]
                .then(|| self.buckets[mb].buf.as_ref())
                .flatten()
                .map(|b| &b.bytes()[moff * sz..(moff + s.len) * sz]);
            if in_place {
                let g = grads[p].bytes_mut();
                if let Some(Err(e)) = acc.map(|acc| self.add(g, acc, p)) {
                    first_err.get_or_insert(e);
                }
                // Issued whatever happened before, so every rank issues the same sequence.
                let r = all_reduce_avg(comm, g, s.dtype)
                    .and_then(|()| self.rescale(g, s.dtype, factor));
                if let Err(e) = r {
                    first_err.get_or_insert(e);
                }
            } else {
                let (b, off) = small.slot[p];
                let Some(buf) = bufs[b].as_mut() else {
                    continue;
                };
                let dst = &mut buf.bytes_mut()[off * sz..(off + s.len) * sz];
                dst.copy_from_slice(grads[p].bytes());
                if let Some(Err(e)) = acc.map(|acc| self.add(dst, acc, p)) {
                    first_err.get_or_insert(e);
                }
                left[b] -= 1;
                if left[b] == 0 {
                    if let Some(buffer) = bufs[b].take() {
                        works[b] = Some(self.hook_default(comm, b, buffer, &small.buckets[b]));
                    }
                }
            }
        }
        for (b, w) in works.into_iter().enumerate() {
            let Some(w) = w else { continue };
            match w.wait(comm) {
                Ok(mut buf) => {
                    let spec = &small.buckets[b];
                    if let Err(e) = self.rescale(buf.bytes_mut(), spec.dtype, factor) {
                        first_err.get_or_insert(e);
                    }
                    let sz = spec.dtype.size();
                    for (&p, &off) in spec.params.iter().zip(&spec.offsets) {
                        let n = self.specs[p].len * sz;
                        grads[p]
                            .bytes_mut()
                            .copy_from_slice(&buf.bytes()[off * sz..off * sz + n]);
                    }
                    bufs[b] = Some(buf);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        // The step is complete: every parameter counts as ready, in this order.
        self.order.clear();
        self.order.extend(sp.order.iter().map(|o| o.0));
        self.ready.fill(true);
        self.seen.fill(true);
        for b in &mut self.buckets {
            b.pending = 0;
        }
        self.reduced = false;
        self.complete_step(first_err, Vec::new())
    }

    fn add(&self, dst: &mut [u8], src: &[u8], p: usize) -> Result<()> {
        oxccl_kernels::reduce_bytes(self.specs[p].dtype, ReduceOp::Sum, dst, src)
            .map_err(|e| self.invalid("sync", format!("accumulating parameter {p}: {e}")))
    }

    fn hook_default(
        &self,
        comm: &Communicator,
        index: usize,
        buffer: FlatBuffer,
        spec: &BucketSpec,
    ) -> HookWork {
        let params = super::entries(spec);
        CommHook::start(
            &mut AllReduceAvg,
            comm,
            GradBucket {
                index,
                buffer,
                params,
            },
        )
    }
}

/// In-place average of one gradient in the caller's memory, as an untyped view of its dtype
/// (the collectives take bytes at any alignment).
fn all_reduce_avg(comm: &Communicator, bytes: &mut [u8], dtype: oxccl_comm::DType) -> Result<()> {
    let view = BufMut::host(bytes, dtype).map_err(|e| DdpError::InvalidArgument {
        rank: comm.rank(),
        op: "sync",
        msg: e.to_string(),
    })?;
    comm.buffers().all_reduce(view, ReduceOp::Avg)?;
    Ok(())
}
