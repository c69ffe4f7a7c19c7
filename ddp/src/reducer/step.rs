//! The end of a step: `finish` waits for every bucket, and the step's completion (the rebuilt
//! order, unused parameters, the first error) that `finish`, `sync` and `join_step` share.

use std::borrow::Borrow;

use oxccl_comm::{Communicator, ReduceOp};

use super::{Ddp, Phase};
use crate::config::Step;
use crate::error::{DdpError, Result};
use crate::flat::FlatBuffer;
use crate::layout::BucketSpec;

impl<C: Borrow<Communicator>> Ddp<C> {
    /// Ends a backward pass. In an accumulating micro-batch it only records it. Otherwise it
    /// launches what is left, waits for every bucket (with overlap off, launching each only
    /// when the one before it is done), and leaves the averaged gradients readable
    /// through [`Ddp::grad`] until the next backward pass; after the first step it also agrees
    /// on the rebuilt bucket order. Collective.
    ///
    /// # Errors
    /// A collective's error (`PeerLost`, `Timeout`, ...); [`DdpError::UnusedParameters`] naming
    /// every parameter that got no gradient in the step, unless `find_unused_parameters` is set
    /// (they are reduced as zeros either way, so the other ranks are not left waiting).
    pub fn finish(&mut self) -> Result<Step> {
        self.finish_with(|_, _| {})
    }

    pub(super) fn finish_with(
        &mut self,
        mut done: impl FnMut(&BucketSpec, &FlatBuffer),
    ) -> Result<Step> {
        self.begin(false);
        if !self.syncing() {
            self.micro += 1;
            self.phase = Phase::Idle;
            return Ok(Step::Accumulated {
                micro_batch: self.micro - 1,
            });
        }
        let mut unused = Vec::new();
        for p in 0..self.specs.len() {
            if self.ready[p] {
                continue;
            }
            let (b, off) = self.slot[p];
            if !self.seen[p] {
                unused.push(p);
                let sz = self.specs[p].dtype.size();
                if let Some(buf) = self.buckets[b].buf.as_mut() {
                    buf.bytes_mut()[off * sz..(off + self.specs[p].len) * sz].fill(0);
                }
            }
            self.ready[p] = true;
            self.buckets[b].pending -= 1;
        }
        if self.overlap || self.hook.communicates_in_wait() {
            self.launch_ready();
        }
        let mut first_err: Option<DdpError> = None;
        // Uneven inputs: the flag went first, so it is done before any bucket is.
        let factor = self.wait_flag().unwrap_or_else(|e| {
            first_err = Some(e);
            1.0
        });
        for b in 0..self.buckets.len() {
            if self.next_launch == b {
                // Overlap off: one bucket at a time, so the waiter usually runs each all-reduce
                // on this thread (unless the progress thread takes it first).
                self.launch_next();
            }
            let Some(work) = self.buckets[b].work.take() else {
                continue;
            };
            match work.wait(self.comm.borrow()) {
                Ok(mut buf)
                    if buf.dtype() == self.buckets[b].spec.dtype
                        && buf.len() == self.buckets[b].spec.len =>
                {
                    let dtype = buf.dtype();
                    if let Err(e) = self.rescale(buf.bytes_mut(), dtype, factor) {
                        first_err.get_or_insert(e);
                    }
                    done(&self.buckets[b].spec, &buf);
                    self.buckets[b].buf = Some(buf);
                }
                Ok(buf) => {
                    let msg = format!(
                        "comm hook {} returned {} elements of {} for bucket {b} of {} elements \
                         of {}",
                        self.hook.name(),
                        buf.len(),
                        buf.dtype().short_name(),
                        self.buckets[b].spec.len,
                        self.buckets[b].spec.dtype.short_name()
                    );
                    first_err.get_or_insert(self.invalid("finish", msg));
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.reduced = true;
        self.complete_step(first_err, unused)
    }

    /// Ends a synchronising micro-batch: agrees on the rebuilt order after the first step and
    /// reports the first error, then unused parameters.
    pub(super) fn complete_step(
        &mut self,
        first_err: Option<DdpError>,
        unused: Vec<usize>,
    ) -> Result<Step> {
        self.phase = Phase::Idle;
        self.micro = 0;
        if let Some(e @ DdpError::Comm(_)) = first_err {
            // The communicator is broken: issuing more collectives would only fail again.
            return Err(e);
        }
        // A local error (e.g. a user hook's) leaves the communicator working: keep issuing the
        // same collectives as the other ranks before reporting it.
        if self.cfg.rebuild_buckets && !self.rebuilt {
            self.rebuilt = true;
            self.agree_order()?;
        }
        if self.cfg.find_unused_parameters && !self.specs.is_empty() {
            // PyTorch's local_used_map: a byte per parameter, set where this rank gave a
            // gradient; every rank issues it in every synchronising step (the setting is the
            // same everywhere, `new` checks).
            let mut used = vec![u8::from(self.shadow.is_none()); self.specs.len()];
            if self.shadow.is_none() {
                for &p in &unused {
                    used[p] = 0;
                }
            }
            if let Err(e) = self.comm().all_reduce(&mut used, ReduceOp::Max) {
                if let Some(local) = &first_err {
                    // Only one error is returned: the communicator's; say what came before it.
                    tracing::warn!(error = %local, "ddp: step failed locally before the communicator failed");
                }
                return Err(e.into());
            }
            self.unused_everywhere = (0..used.len()).filter(|&p| used[p] == 0).collect();
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let step = self.step;
        self.step += 1;
        if !unused.is_empty() && !self.cfg.find_unused_parameters && self.shadow.is_none() {
            return Err(DdpError::UnusedParameters {
                rank: self.comm().rank(),
                step,
                names: unused.iter().map(|&p| self.specs[p].name.clone()).collect(),
            });
        }
        Ok(Step::Synced { step })
    }

    /// The call a step's errors are reported under: `join_step`, `sync` or `finish`.
    pub(super) fn step_op(&self) -> &'static str {
        if self.shadow.is_some() {
            "join_step"
        } else if self.via_sync {
            "sync"
        } else {
            "finish"
        }
    }
}
