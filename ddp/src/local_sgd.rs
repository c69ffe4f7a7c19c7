//! Post-local SGD (PyTorch's `post_localSGD_hook` with `PeriodicModelAverager`): after a warm-up
//! of ordinary data-parallel steps, gradients are averaged only within a group of ranks (usually
//! the ranks of one node, over shared memory), and the parameters across every rank once every
//! `period` steps. Between averagings the groups' replicas drift apart; inside a group they stay
//! bit-identical. On a slow link between nodes this sends one all-reduce of the parameters per
//! `period` steps across it instead of one of the gradients per step.
//!
//! ```no_run
//! use oxccl_comm::Communicator;
//! use oxccl_ddp::{Ddp, DdpConfig, ModelAverager, Param, PostLocalSgd};
//!
//! # fn backward(_w: &[f32]) -> Vec<f32> { vec![0.0; 4] }
//! let comm = Communicator::from_env()?;
//! let mut w = vec![0.5f32; 4];
//! let mut ddp = Ddp::new(&comm, &mut [Param::new("w", &mut w)], DdpConfig::default())?;
//! // The ranks of each node form a group; local SGD from step 100.
//! ddp.set_comm_hook(PostLocalSgd::intra_node(&comm, 100)?)?;
//! let mut averager = ModelAverager::new(4, 100); // every 4 steps from step 100
//! for _step in 0..1000 {
//!     let mut grads = [backward(&w)];
//!     ddp.sync(&mut grads)?; // the node's average after step 100, everyone's before
//!     w.iter_mut().zip(&grads[0]).for_each(|(x, g)| *x -= 0.1 * g);
//!     averager.average(&comm, &mut [&mut w])?; // every rank's parameters, when due
//! }
//! # Ok::<(), oxccl_ddp::DdpError>(())
//! ```

use std::borrow::Borrow;

use oxccl_comm::{Communicator, DType};

use crate::error::{DdpError, Result};
use crate::flat::{FlatBuffer, GradBuf};
use crate::hooks::{AllReduceAvg, CommHook, GradBucket, HookWork};

/// The comm hook of post-local SGD: every bucket is averaged over every rank of DDP's
/// communicator for the first `start_step` synchronised steps, then over the ranks of `group`
/// only (see the module docs). `G` is how the group is held: owned (the default),
/// `Arc<Communicator>` or `&'static Communicator`.
///
/// Steps are counted as the hook sees them (at each step's first bucket), so set it before the
/// first step, or count the steps before it into `start_step`.
/// [`UnevenInputs::DivideByActiveRanks`](crate::UnevenInputs) cannot be combined with it
/// (`Ddp::set_comm_hook` refuses): its rescaling assumes averages over every rank.
pub struct PostLocalSgd<G: Borrow<Communicator> = Communicator> {
    group: G,
    start_step: u64,
    /// Synchronised steps begun (counted at bucket 0).
    started: u64,
    /// The current step averages within the group.
    local: bool,
}

impl<G: Borrow<Communicator>> std::fmt::Debug for PostLocalSgd<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = self.group.borrow();
        f.debug_struct("PostLocalSgd")
            .field("group_rank", &g.rank())
            .field("group_size", &g.size())
            .field("start_step", &self.start_step)
            .field("started", &self.started)
            .finish()
    }
}

impl<G: Borrow<Communicator>> PostLocalSgd<G> {
    /// Local SGD within `group` (a communicator of some of DDP's ranks, e.g. from
    /// `Communicator::split`; every rank of DDP's communicator in exactly one group) from
    /// synchronised step `start_step` (0: from the first step).
    pub fn new(group: G, start_step: u64) -> PostLocalSgd<G> {
        PostLocalSgd {
            group,
            start_step,
            started: 0,
            local: false,
        }
    }

    /// The group gradients are averaged in once local SGD has started.
    pub fn group(&self) -> &Communicator {
        self.group.borrow()
    }

    /// The step local SGD starts at.
    pub fn start_step(&self) -> u64 {
        self.start_step
    }

    /// Synchronised steps the hook has begun.
    pub fn steps(&self) -> u64 {
        self.started
    }
}

impl PostLocalSgd {
    /// Local SGD within each node: splits `comm` into the ranks of each node
    /// (`Communicator::node_index`; PyTorch's default subgroup). Collective over `comm`: every
    /// rank calls it.
    ///
    /// # Errors
    /// The split's errors.
    pub fn intra_node(comm: &Communicator, start_step: u64) -> Result<PostLocalSgd> {
        let color = u32::try_from(comm.node_index()).map_err(|_| DdpError::InvalidArgument {
            rank: comm.rank(),
            op: "post-local SGD",
            msg: format!(
                "node index {} does not fit a split color",
                comm.node_index()
            ),
        })?;
        let group = comm.split(Some(color), comm.rank() as i64)?;
        let group = group.ok_or_else(|| DdpError::InvalidArgument {
            rank: comm.rank(),
            op: "post-local SGD",
            msg: "the split by node gave this rank no group".into(),
        })?;
        Ok(PostLocalSgd::new(group, start_step))
    }
}

impl<G: Borrow<Communicator> + Send> CommHook for PostLocalSgd<G> {
    fn name(&self) -> &str {
        "post_local_sgd"
    }

    fn start(&mut self, comm: &Communicator, bucket: GradBucket) -> HookWork {
        if bucket.index == 0 {
            self.local = self.started >= self.start_step;
            self.started += 1;
        }
        if self.local {
            AllReduceAvg.start(self.group.borrow(), bucket)
        } else {
            AllReduceAvg.start(comm, bucket)
        }
    }

    fn averages_every_rank(&self) -> bool {
        false
    }
}

/// Averages parameters across the ranks of a communicator once every `period` calls, from call
/// `warmup_steps` on (PyTorch's `PeriodicModelAverager`): call [`ModelAverager::average`] once per
/// optimizer step, after the update. With [`PostLocalSgd`], give it the same start as
/// `warmup_steps`, so that the first local step is followed by an average.
#[derive(Clone, Debug)]
pub struct ModelAverager {
    period: u64,
    warmup_steps: u64,
    step: u64,
    cap_bytes: usize,
}

impl ModelAverager {
    /// Averages at calls `warmup_steps`, `warmup_steps + period`, ... (counted from 0). A
    /// `period` of 0 is refused by [`ModelAverager::average`].
    pub fn new(period: u64, warmup_steps: u64) -> ModelAverager {
        ModelAverager {
            period,
            warmup_steps,
            step: 0,
            cap_bytes: 25 << 20,
        }
    }

    /// Packs parameters into all-reduces of at most `bytes` (25 MiB by default; a larger
    /// parameter goes alone).
    #[must_use]
    pub fn with_bucket_cap_bytes(mut self, bytes: usize) -> ModelAverager {
        self.cap_bytes = bytes.max(1);
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
    /// `comm` (`ReduceOp::Avg`, the same bits on every rank), consecutive parameters of one dtype
    /// packed together. Returns whether it averaged. Collective when due: every rank of `comm`
    /// calls it alike, with the same parameter list (count, lengths, dtypes).
    ///
    /// # Errors
    /// `InvalidArgument` for a `period` of 0 (on every rank, before any communication); the
    /// all-reduces' errors.
    pub fn average<P: GradBuf>(&mut self, comm: &Communicator, params: &mut [P]) -> Result<bool> {
        if self.period == 0 {
            return Err(DdpError::InvalidArgument {
                rank: comm.rank(),
                op: "model averager",
                msg: "period must be at least 1".into(),
            });
        }
        let due = self.due();
        self.step += 1;
        if !due {
            return Ok(false);
        }
        // Runs of one dtype, cut at `cap_bytes`: (dtype, first, end) over `params`.
        let mut runs: Vec<(DType, usize, usize)> = Vec::new();
        let mut bytes = 0;
        for (i, p) in params.iter().enumerate() {
            let n = p.bytes().len();
            match runs.last_mut() {
                Some((d, _, end)) if *d == p.dtype() && bytes + n <= self.cap_bytes => {
                    *end = i + 1;
                    bytes += n;
                }
                _ => {
                    runs.push((p.dtype(), i, i + 1));
                    bytes = n;
                }
            }
        }
        // Every run's all-reduce is issued before the first is waited on.
        let mut pending = Vec::with_capacity(runs.len());
        for (index, &(dtype, first, end)) in runs.iter().enumerate() {
            let elems = params[first..end].iter().map(|p| p.elems()).sum();
            let mut buffer = FlatBuffer::zeros(dtype, elems);
            let mut off = 0;
            for p in &params[first..end] {
                let b = p.bytes();
                buffer.bytes_mut()[off..off + b.len()].copy_from_slice(b);
                off += b.len();
            }
            let bucket = GradBucket {
                index,
                buffer,
                params: Vec::new(),
            };
            pending.push(AllReduceAvg.start(comm, bucket));
        }
        for (work, &(_, first, end)) in pending.into_iter().zip(&runs) {
            let buffer = work.wait(comm)?;
            let mut off = 0;
            for p in &mut params[first..end] {
                let b = p.bytes_mut();
                let n = b.len();
                b.copy_from_slice(&buffer.bytes()[off..off + n]);
                off += n;
            }
        }
        Ok(true)
    }
}
