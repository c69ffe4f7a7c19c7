//! [`ModelAverager`]: the parameters averaged over every rank of a communicator once every
//! `period` steps (PyTorch's `PeriodicModelAverager`).

use oxccl_comm::Communicator;

use super::packer::{check_params, Packer};
use crate::agree::{agree, fnv1a, Setting};
use crate::error::{DdpError, Result};
use crate::flat::GradBuf;

/// Averages parameters across the ranks of a communicator once every `period` calls, from call
/// `warmup_steps` on (PyTorch's `PeriodicModelAverager`): call [`ModelAverager::average`] once per
/// synchronised step (not per micro-batch), after the optimizer's update; a rank that has run out
/// of data calls it after each [`Ddp::join_step`](crate::Ddp::join_step) that returns `Some`, as
/// the ranks still training do after their steps. With [`PostLocalSgd`](crate::PostLocalSgd), give
/// it the same start as `warmup_steps`, so that the first local step is followed by an average.
/// Floating-point parameters only (an integer average would wrap and truncate). It keeps its
/// packing buffers between averages: one more copy of the parameters in host memory.
pub struct ModelAverager {
    period: u64,
    warmup_steps: u64,
    step: u64,
    packer: Packer,
    /// The communicator (its id) on which the ranks' settings were found alike.
    agreed_on: Option<String>,
}

impl std::fmt::Debug for ModelAverager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelAverager")
            .field("period", &self.period)
            .field("warmup_steps", &self.warmup_steps)
            .field("step", &self.step)
            .field("cap_bytes", &self.packer.cap_bytes)
            .field("buffer_bytes", &self.packer.kept_bytes())
            .field("agreed_on", &self.agreed_on)
            .finish()
    }
}

impl Clone for ModelAverager {
    /// The settings, the step count and the communicator they were compared on (not the
    /// buffers).
    fn clone(&self) -> ModelAverager {
        ModelAverager {
            period: self.period,
            warmup_steps: self.warmup_steps,
            step: self.step,
            packer: Packer {
                cap_bytes: self.packer.cap_bytes,
                buffers: Vec::new(),
            },
            agreed_on: self.agreed_on.clone(),
        }
    }
}

impl ModelAverager {
    /// Averages at calls `warmup_steps`, `warmup_steps + period`, ... (counted from 0). A
    /// `period` of 0 never averages, and [`ModelAverager::average`] refuses it.
    pub fn new(period: u64, warmup_steps: u64) -> ModelAverager {
        ModelAverager {
            period,
            warmup_steps,
            step: 0,
            packer: Packer::new(),
            agreed_on: None,
        }
    }

    /// Packs parameters into all-reduces of at most `bytes` (25 MiB by default; a larger
    /// parameter goes alone). The next average compares the settings again.
    #[must_use]
    pub fn with_bucket_cap_bytes(mut self, bytes: usize) -> ModelAverager {
        self.packer.cap_bytes = bytes.max(1);
        self.agreed_on = None;
        self
    }

    /// Counts `steps` calls as already made (resuming from a checkpoint taken after them). The
    /// next average compares the settings again.
    #[must_use]
    pub fn with_steps(mut self, steps: u64) -> ModelAverager {
        self.step = steps;
        self.agreed_on = None;
        self
    }

    /// Calls made so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Whether the next call averages.
    pub fn due(&self) -> bool {
        self.period > 0
            && self.step >= self.warmup_steps
            && (self.step - self.warmup_steps).is_multiple_of(self.period)
    }

    /// Counts one step; when due, replaces every parameter with its average over the ranks of
    /// `comm` (`ReduceOp::Avg`, the same bits on every rank), parameters of one dtype packed
    /// together as DDP packs gradients into buckets. Returns whether it averaged. Collective
    /// when due: every rank of `comm` calls it alike, with the same parameter list (count,
    /// lengths, dtypes).
    ///
    /// The first call that averages on a communicator (by its id: again after a call on another
    /// one, or after `with_steps` or `with_bucket_cap_bytes`), and a call with a `period` of 0,
    /// first compares, in one small all-reduce, the period, `warmup_steps`, the call's number,
    /// the bucket cap and the parameter list between its ranks: a rank set up differently
    /// would otherwise average at other calls, with the others' averages of other steps, and
    /// leave them waiting at the end. That needs the ranks' first averages to fall on the same
    /// call (one warm-up that differs can make them miss each other): otherwise the comparison
    /// meets another collective, and the communicator reports a mismatch or a time-out.
    ///
    /// # Errors
    /// `InvalidArgument` naming each setting that differs between the ranks, on every rank
    /// alike, and the call is not counted. Then `InvalidArgument` for a `period` of 0, or when
    /// due for a parameter of an integer dtype or whose `GradBuf` views disagree in length: on
    /// every rank alike, before any averaging, and the call is not counted. The all-reduces'
    /// errors (`PeerLost`, `Timeout`, ...; the call counted): every all-reduce is waited on, those
    /// that completed are copied back and the first error is returned, so this rank's
    /// parameters may then be partly averaged; treat it as the end of the step's replicas (see
    /// the crate docs, "After a lost rank").
    pub fn average<P: GradBuf>(&mut self, comm: &Communicator, params: &mut [P]) -> Result<bool> {
        const OP: &str = "ModelAverager::average";
        if !self.due() && self.period > 0 {
            self.step = self.step.saturating_add(1);
            return Ok(false);
        }
        // Due, or a period of 0 that the others may not share: compare first (once per
        // communicator), so that no rank fails alone and leaves the others waiting.
        if self.agreed_on.as_deref() != Some(comm.id()) {
            let settings = [
                Setting::number("period", self.period),
                Setting::number("warmup_steps", self.warmup_steps),
                Setting::number(
                    "the call's number (0-based, counting with_steps)",
                    self.step,
                ),
                Setting::number("the bucket cap", self.packer.cap_bytes as u64),
                param_list(params),
            ];
            agree(comm, OP, &settings, &mut [])?;
            self.agreed_on = Some(comm.id().to_string());
        }
        if self.period == 0 {
            return Err(DdpError::InvalidArgument {
                rank: comm.rank(),
                op: OP,
                msg: "period must be at least 1".into(),
            });
        }
        check_params(comm.rank(), OP, params)?;
        self.step = self.step.saturating_add(1);
        self.packer.average(comm, params)?;
        Ok(true)
    }
}

/// The parameter count, lengths and dtypes, as one setting to compare.
fn param_list<P: GradBuf>(params: &[P]) -> Setting {
    let bytes: usize = params.iter().map(|p| p.bytes().len()).sum();
    let words = params
        .iter()
        .flat_map(|p| [p.bytes().len() as u64, u64::from(p.dtype().to_u8())]);
    Setting::described(
        "the parameter list (count, lengths, dtypes)",
        fnv1a([params.len() as u64].into_iter().chain(words)),
        format!("{} parameter(s), {bytes} bytes", params.len()),
    )
}
