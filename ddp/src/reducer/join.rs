//! Uneven inputs (PyTorch's `Join`): the flag each synchronising step all-reduces (who trains,
//! and how), the averages rescaled to the ranks still training, and `join_step`, in which a rank
//! that has run out of data stands in for the others' steps.

use std::borrow::Borrow;

use oxccl_comm::{Communicator, DType, ReduceOp};

use super::{Ddp, Phase};
use crate::config::{Step, UnevenInputs};
use crate::error::{DdpError, Result};
use crate::flat::FlatBuffer;

/// Who trained in a step, read from the uneven-inputs flag (one byte per rank: 0 joined,
/// 1 through `grad_ready`/`finish`, 2 through `sync`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Trainers {
    pub(super) active: usize,
    pub(super) syncs: usize,
    pub(super) lead: usize,
}

impl<C: Borrow<Communicator>> Ddp<C> {
    /// Reads the uneven-inputs flag: one byte per rank.
    fn read_flag(&self, flag: &[u8], op: &'static str) -> Result<Trainers> {
        if let Some(r) = flag.iter().position(|&b| b > 2) {
            return Err(self.invalid(
                op,
                format!("the uneven-inputs flag says {} for rank {r}", flag[r]),
            ));
        }
        Ok(Trainers {
            active: flag.iter().filter(|&&b| b != 0).count(),
            syncs: flag.iter().filter(|&&b| b == 2).count(),
            lead: flag.iter().position(|&b| b != 0).unwrap_or(0),
        })
    }

    /// The error for a step that ranks feed in different ways.
    fn mixed_feeds(&self, t: Trainers, op: &'static str) -> DdpError {
        self.invalid(
            op,
            format!(
                "of the {} ranks training in step {}, {} feed it through sync() and the others \
                 through grad_ready()/finish(); every rank must feed a step the same way",
                t.active, self.step, t.syncs
            ),
        )
    }

    /// Uneven inputs: waits for this step's flag (or, in `join_step`, takes what it read),
    /// records who trained in the step, and returns the factor the averages are scaled by: 1
    /// unless [`UnevenInputs::DivideByActiveRanks`] and some ranks joined. Ranks that fed the
    /// step in different ways are an error here, after which the caller still issues the
    /// step's collectives (every rank sees the same flag).
    pub(super) fn wait_flag(&mut self) -> Result<f64> {
        let world = self.comm().size();
        let op = self.step_op();
        let t = self.trainers()?;
        self.flag_read = None;
        self.active = t.active;
        self.lead = t.lead;
        if t.syncs != 0 && t.syncs != t.active {
            return Err(self.mixed_feeds(t, op));
        }
        Ok(match self.cfg.uneven_inputs {
            UnevenInputs::DivideByActiveRanks if t.active > 0 && t.active < world => {
                world as f64 / t.active as f64
            }
            _ => 1.0,
        })
    }

    /// Who trains in this synchronising step: what `join_step` read, or this step's flag
    /// (waited for once, kept until [`Ddp::wait_flag`]); every rank, without uneven inputs.
    pub(super) fn trainers(&mut self) -> Result<Trainers> {
        if let Some(t) = self.shadow.or(self.flag_read) {
            return Ok(t);
        }
        let op = self.step_op();
        let t = if let Some(work) = self.join_flag.take() {
            let flag = work.wait()?;
            self.read_flag(&flag, op)?
        } else if self.cfg.uneven_inputs != UnevenInputs::Off {
            // Only after a call of this step failed half-way: the ranks are out of step.
            return Err(self.invalid(
                op,
                "this step's uneven-inputs flag was already read by a call that failed; the \
                 ranks are no longer in step",
            ));
        } else {
            Trainers {
                active: self.comm().size(),
                syncs: 0,
                lead: 0,
            }
        };
        self.flag_read = Some(t);
        Ok(t)
    }

    /// Multiplies averaged gradients by `factor` (from [`Ddp::wait_flag`]) unless it is 1.
    pub(super) fn rescale(&self, bytes: &mut [u8], dtype: DType, factor: f64) -> Result<()> {
        if factor == 1.0 {
            return Ok(());
        }
        oxccl_kernels::scale_bytes(dtype, bytes, factor).map_err(|e| {
            self.invalid(
                self.step_op(),
                format!(
                    "dividing the sum by the {} ranks still training: {e}",
                    self.active
                ),
            )
        })
    }

    /// For a rank that has run out of data while others may still train, under
    /// [`DdpConfig::uneven_inputs`](crate::DdpConfig::uneven_inputs) (PyTorch's `Join` context):
    /// stands in for one step of the ranks still training, issuing the collectives their step
    /// issues with zero gradients of its own. Returns `Some` after such a step, with its averaged
    /// gradients readable through [`Ddp::grad`], the same values the training ranks get: apply them
    /// as they do and every replica (optimizer state included) stays identical. Returns `None` once
    /// every rank has joined: every rank's `join_step` returns `None` in the same call, and a next
    /// epoch can start with every rank training. Call it between steps, in a loop, until `None`:
    ///
    /// ```no_run
    /// # fn f(ddp: &mut oxccl_ddp::Ddp, params: &mut [f32]) -> oxccl_ddp::Result<()> {
    /// while ddp.join_step()?.is_some() {
    ///     for (x, g) in params.iter_mut().zip(ddp.grad::<f32>(0)?) {
    ///         *x -= 0.1 * g;
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// Collective with the training ranks' steps: it matches their `grad_ready`/`finish()` or
    /// `sync()`, whichever they use (the flag, one byte per rank, says), with this rank's comm
    /// hook (a hook with state of its own may still send some: with error feedback,
    /// [`PowerSgd`](crate::PowerSgd) sends this rank's residual, its last input less the
    /// averaged approximation). A joined rank learns of a step only from its flag, issued at
    /// the first gradient of the step's synchronising micro-batch: collectives the trainer
    /// issues itself once per step (a loss all-reduce, [`Ddp::broadcast_buffers`]) must come
    /// after the step's synchronising `finish()`/`sync()` (not after an accumulating one) on
    /// training ranks, and after each `Some` on a joined one, or the ranks' sequences part. A joined rank waits in
    /// the flag while the others compute: the communicator's time-out (`OXCCL_TIMEOUT`) must
    /// be longer than a step.
    ///
    /// # Errors
    /// `InvalidArgument` when `uneven_inputs` is `Off`, in the middle of a step (a micro-batch
    /// under way, or one of `accumulate(k)` done), or when the training ranks feed the step in
    /// different ways (reported once the step's collectives are done, as on the training
    /// ranks); a collective's error.
    pub fn join_step(&mut self) -> Result<Option<Step>> {
        if self.cfg.uneven_inputs == UnevenInputs::Off {
            return Err(self.invalid(
                "join_step",
                "DdpConfig::uneven_inputs is Off: set it, alike on every rank, to let ranks \
                 join early",
            ));
        }
        if self.phase == Phase::Backward || self.micro != 0 {
            let doing = if self.phase == Phase::Backward {
                "a micro-batch's gradients are arriving"
            } else {
                "micro-batches of accumulate(k) are done and the step's last is not"
            };
            return Err(self.invalid(
                "join_step",
                format!(
                    "called in the middle of step {} ({doing}); join between steps, when this \
                     rank has no more data",
                    self.step
                ),
            ));
        }
        let mut flag = vec![0u8; self.comm().size()];
        self.comm().all_reduce(&mut flag, ReduceOp::Sum)?;
        let t = self.read_flag(&flag, "join_step")?;
        if t.active == 0 {
            // Every rank has joined; `lead` stays the last step's, a rank that trained to the end.
            self.active = 0;
            return Ok(None);
        }
        // Ranks that feed the step in different ways are reported at the end of the step;
        // the bucket path is what `grad_ready` and a hooked `sync` issue.
        self.shadow = Some(t);
        let r = if t.syncs == t.active {
            self.shadow_sync()
        } else {
            self.finish()
        };
        self.shadow = None;
        r.map(Some)
    }

    /// `join_step` for ranks that use `sync`: zero gradients through the same path, then the
    /// averages copied into the buckets for [`Ddp::grad`].
    fn shadow_sync(&mut self) -> Result<Step> {
        let mut zeros = std::mem::take(&mut self.shadow_grads);
        if zeros.len() == self.specs.len() {
            for z in &mut zeros {
                z.bytes_mut().fill(0);
            }
        } else {
            zeros = self
                .specs
                .iter()
                .map(|s| FlatBuffer::zeros(s.dtype, s.len))
                .collect();
        }
        let r = self.sync(&mut zeros);
        if r.is_ok() && !self.reduced {
            for (p, z) in zeros.iter().enumerate() {
                let (b, off) = self.slot[p];
                let bucket = &mut self.buckets[b];
                let sz = bucket.spec.dtype.size();
                let buf = bucket
                    .buf
                    .get_or_insert_with(|| FlatBuffer::zeros(bucket.spec.dtype, bucket.spec.len));
                buf.bytes_mut()[off * sz..off * sz + z.bytes().len()].copy_from_slice(z.bytes());
            }
            self.reduced = true;
        }
        self.shadow_grads = zeros;
        r
    }
}
