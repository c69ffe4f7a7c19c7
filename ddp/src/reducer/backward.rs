//! A micro-batch's backward pass: its start (`begin`), gradients handed over (`grad_ready`) or
//! computed in their bucket slots (`grad_slot`, `grad_ready_in_place`), and the buckets launched
//! through the comm hook, in order, as they fill.

use std::borrow::Borrow;

use oxccl_comm::{Communicator, Element, ReduceOp};

use super::{entries, Ddp, Phase};
use crate::config::UnevenInputs;
use crate::error::{DdpError, Result};
use crate::flat::FlatBuffer;
use crate::hooks::{GradBucket, HookWork};

impl<C: Borrow<Communicator>> Ddp<C> {
    /// Whether this micro-batch reduces: decided once when it begins (so a `no_sync` guard taken
    /// in the middle of a backward pass does not change it).
    pub(super) fn syncing(&self) -> bool {
        if self.phase == Phase::Backward {
            self.sync_now
        } else {
            !self.no_sync && self.micro + 1 >= self.accumulate
        }
    }

    /// Starts a micro-batch (and, at its first micro-batch, a step) unless one is under way;
    /// `via_sync` when `sync` starts it. With uneven inputs, a synchronising micro-batch issues
    /// the flag all-reduce first, before any bucket.
    pub(super) fn begin(&mut self, via_sync: bool) {
        if self.phase == Phase::Backward {
            return;
        }
        // `join_step` stands in for the last micro-batch of the others' step: it always reduces.
        self.sync_now = self.shadow.is_some() || self.syncing();
        self.phase = Phase::Backward;
        self.via_sync = via_sync;
        if self.sync_now && self.shadow.is_none() && self.cfg.uneven_inputs != UnevenInputs::Off {
            let c = self.comm.borrow();
            let mut flag = vec![0u8; c.size()];
            flag[c.rank()] = 1 + u8::from(via_sync);
            self.join_flag = Some(c.all_reduce_async(flag, ReduceOp::Sum));
        }
        if self.micro == 0 {
            if let Some(order) = self.pending_order.take() {
                self.relayout(&order);
            }
            self.seen.fill(false);
        }
        for b in &mut self.buckets {
            b.pending = b.spec.params.len();
            if b.buf.is_none() {
                // Lost with a failed collective: start again from zeros.
                b.buf = Some(FlatBuffer::zeros(b.spec.dtype, b.spec.len));
            }
        }
        self.ready.fill(false);
        self.slot_out.fill(false);
        self.order.clear();
        self.next_launch = 0;
        self.reduced = false;
    }

    /// Declares parameter `param`'s gradient for this backward pass: copied (or, in later
    /// micro-batches of a step, added) into its bucket; when that fills a bucket, and every
    /// bucket before it has been launched, its all-reduce starts at once (unless overlap is off,
    /// [`DdpConfig::overlap`](crate::DdpConfig::overlap): then `finish()` starts it).
    ///
    /// # Errors
    /// `InvalidArgument` for an index out of range, a dtype or length that is not the
    /// parameter's, or a second gradient for one parameter in one backward pass.
    pub fn grad_ready<T: Element>(&mut self, param: usize, grad: &[T]) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(grad);
        self.check_param(param, T::DTYPE, bytes.len(), "grad_ready")?;
        self.ingest(param, bytes, "grad_ready", self.overlap)
    }

    /// Parameter `param`'s slot in its bucket, for a backward pass that computes the gradient
    /// there instead of handing a copy to [`Ddp::grad_ready`] (PyTorch's
    /// `gradient_as_bucket_view`): write it, then call [`Ddp::grad_ready_in_place`]. Saves
    /// `grad_ready`'s copy. The flag says what the slot holds: `true` (the parameter's first
    /// micro-batch of the step) stale values to overwrite, `false` (a later micro-batch of
    /// [`Ddp::accumulate`] or [`Ddp::no_sync`]) the sum of the earlier micro-batches'
    /// gradients, to add to. Starts the micro-batch like `grad_ready`. A slot handed out but
    /// never declared ready counts as unused at `finish()` (its contents are then zeros, or the
    /// earlier micro-batches' sum).
    ///
    /// # Errors
    /// `InvalidArgument` for an index out of range, a `T` that is not the parameter's dtype, or a
    /// parameter that already got its gradient in this backward pass.
    pub fn grad_slot<T: Element>(&mut self, param: usize) -> Result<(&mut [T], bool)> {
        let s = self.spec(param, "grad_slot")?;
        if T::DTYPE != s.dtype {
            let msg = format!(
                "parameter {param} ({}) is {}, its slot was asked for as {}",
                s.name,
                s.dtype.short_name(),
                T::DTYPE.short_name()
            );
            return Err(self.invalid("grad_slot", msg));
        }
        self.begin(false);
        self.check_not_ready(param, "grad_slot")?;
        self.slot_out[param] = true;
        let fresh = !self.seen[param];
        let (b, off) = self.slot[param];
        let len = self.specs[param].len;
        let rank = self.comm().rank();
        let bucket = &mut self.buckets[b];
        let buf = bucket
            .buf
            .get_or_insert_with(|| FlatBuffer::zeros(bucket.spec.dtype, bucket.spec.len));
        let all = buf
            .as_mut_slice::<T>()
            .ok_or_else(|| DdpError::InvalidArgument {
                rank,
                op: "grad_slot",
                msg: format!(
                    "parameter {param}'s bucket is not {}",
                    T::DTYPE.short_name()
                ),
            })?;
        Ok((&mut all[off..off + len], fresh))
    }

    /// Declares that parameter `param`'s gradient is in its slot ([`Ddp::grad_slot`]): from
    /// here on as [`Ddp::grad_ready`] after its copy (a full bucket's all-reduce starts).
    ///
    /// # Errors
    /// `InvalidArgument` for an index out of range, a parameter whose slot `grad_slot` did not
    /// hand out in this backward pass, or a second gradient for one parameter in one backward
    /// pass.
    pub fn grad_ready_in_place(&mut self, param: usize) -> Result<()> {
        self.spec(param, "grad_ready_in_place")?;
        // Checked before `begin`: a refused call starts no micro-batch (and sends no flag).
        if self.phase != Phase::Backward || !self.slot_out[param] {
            return Err(self.invalid(
                "grad_ready_in_place",
                format!(
                    "parameter {param} ({}): its slot was not taken with grad_slot in this \
                     backward pass",
                    self.specs[param].name
                ),
            ));
        }
        self.check_not_ready(param, "grad_ready_in_place")?;
        self.mark_ready(param, self.overlap);
        Ok(())
    }

    fn check_not_ready(&self, p: usize, op: &'static str) -> Result<()> {
        if self.ready[p] {
            return Err(self.invalid(
                op,
                format!(
                    "parameter {p} ({}) already got its gradient in this backward pass",
                    self.specs[p].name
                ),
            ));
        }
        Ok(())
    }

    /// Copies or adds a checked gradient into its slot and, with `launch`, launches what became
    /// ready.
    pub(super) fn ingest(
        &mut self,
        p: usize,
        bytes: &[u8],
        op: &'static str,
        launch: bool,
    ) -> Result<()> {
        self.begin(false);
        self.check_not_ready(p, op)?;
        let dtype = self.specs[p].dtype;
        let (b, off) = self.slot[p];
        let sz = dtype.size();
        let seen = self.seen[p];
        let bucket = &mut self.buckets[b];
        let buf = bucket
            .buf
            .get_or_insert_with(|| FlatBuffer::zeros(bucket.spec.dtype, bucket.spec.len));
        let dst = &mut buf.bytes_mut()[off * sz..off * sz + bytes.len()];
        if seen {
            oxccl_kernels::reduce_bytes(dtype, ReduceOp::Sum, dst, bytes).map_err(|e| {
                DdpError::InvalidArgument {
                    rank: self.comm.borrow().rank(),
                    op,
                    msg: format!("accumulating parameter {p}: {e}"),
                }
            })?;
        } else {
            dst.copy_from_slice(bytes);
        }
        self.mark_ready(p, launch);
        Ok(())
    }

    /// Parameter `p`'s gradient is in its slot; with `launch`, launches what became ready.
    fn mark_ready(&mut self, p: usize, launch: bool) {
        let b = self.slot[p].0;
        self.buckets[b].pending -= 1;
        self.ready[p] = true;
        self.seen[p] = true;
        self.order.push(p);
        if launch && self.buckets[b].pending == 0 && self.syncing() {
            self.launch_ready();
        }
    }

    /// Launches, in bucket order, every bucket that is full and not yet launched, stopping at the
    /// first that is not full (so every rank launches in the same order).
    pub(super) fn launch_ready(&mut self) {
        while self.next_launch < self.buckets.len() && self.buckets[self.next_launch].pending == 0 {
            self.launch_next();
        }
    }

    /// Launches bucket `next_launch` through the hook.
    pub(super) fn launch_next(&mut self) {
        let b = self.next_launch;
        if let Err(e) = self.check_hook() {
            // No average: grad() refuses the bucket until a step fills it again.
            self.buckets[b].buf = None;
            self.buckets[b].work = Some(HookWork::new(move || Err(e)));
            self.next_launch += 1;
            return;
        }
        let bucket = &mut self.buckets[b];
        let buffer = bucket
            .buf
            .take()
            .unwrap_or_else(|| FlatBuffer::zeros(bucket.spec.dtype, bucket.spec.len));
        let params = entries(&bucket.spec);
        let work = self.hook.start(
            self.comm.borrow(),
            GradBucket {
                index: b,
                buffer,
                params,
            },
        );
        self.buckets[b].work = Some(work);
        self.next_launch += 1;
    }
}
