//! Post-local SGD (PyTorch's `post_localSGD_hook` with `PeriodicModelAverager`): after a warm-up
//! of ordinary data-parallel steps, gradients are averaged only within a group of ranks (usually
//! the ranks of one node, over shared memory), and the parameters across every rank once every
//! `period` steps. Between averagings the groups' replicas drift apart; inside a group they stay
//! bit-identical. On a slow link between nodes this sends one all-reduce of the parameters per
//! `period` steps across it instead of one of the gradients per step. [`HierarchicalAverager`]
//! averages several tiers of groups, each at its own period.
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
use std::sync::Arc;

use oxccl_comm::{Communicator, Error as CommError};

use crate::agree::{agree, fnv1a, Setting};
use crate::error::{DdpError, Result};
use crate::flat::{FlatBuffer, GradBuf};
use crate::hooks::{AllReduceAvg, CommHook, GradBucket, HookWork};
use crate::layout::{plan, ParamSpec};

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
    /// The rank in DDP's communicator of each of the group's ranks, and that communicator's
    /// size: for errors that name DDP's ranks, and to check the hook runs on it.
    members: Arc<[usize]>,
    world: usize,
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
            .field("local", &self.local)
            .finish()
    }
}

impl<G: Borrow<Communicator>> PostLocalSgd<G> {
    /// Local SGD within `group` (a communicator of some of the ranks of `comm`, DDP's
    /// communicator, e.g. from `comm.split`; every rank of `comm` in exactly one group) from
    /// synchronised step `start_step` (0: from the first step). Collective over `group`: it
    /// gathers each member's rank in `comm`, so that the hook's errors (a `PeerLost` in the
    /// group, ...) name ranks of `comm`, as DDP's other errors do.
    ///
    /// # Errors
    /// `InvalidArgument` for a group that cannot be part of `comm` (larger, or ranks gathered
    /// out of range or twice); the all-gather's errors.
    pub fn new(comm: &Communicator, group: G, start_step: u64) -> Result<PostLocalSgd<G>> {
        let g = group.borrow();
        let invalid = |msg: String| DdpError::InvalidArgument {
            rank: comm.rank(),
            op: "PostLocalSgd::new",
            msg,
        };
        if g.size() > comm.size() {
            return Err(invalid(format!(
                "the group has {} ranks, the communicator {}",
                g.size(),
                comm.size()
            )));
        }
        let mut members = vec![0u64; g.size()];
        g.all_gather(&[comm.rank() as u64], &mut members)?;
        let members: Vec<usize> = members.into_iter().map(|r| r as usize).collect();
        let mut seen = vec![false; comm.size()];
        for &r in &members {
            if r >= comm.size() || std::mem::replace(&mut seen[r], true) {
                return Err(invalid(format!(
                    "the group's ranks {members:?} are not distinct ranks of a communicator of {}",
                    comm.size()
                )));
            }
        }
        Ok(PostLocalSgd {
            group,
            members: members.into(),
            world: comm.size(),
            start_step,
            started: 0,
            local: false,
        })
    }

    /// The rank in DDP's communicator of each of the group's ranks.
    pub fn members(&self) -> &[usize] {
        &self.members
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

    /// Counts `steps` synchronised steps as already begun (resuming from a checkpoint taken
    /// after them), so that local SGD starts at the same step as in the first run.
    #[must_use]
    pub fn with_steps(mut self, steps: u64) -> PostLocalSgd<G> {
        self.started = steps;
        self
    }
}

impl PostLocalSgd {
    /// Local SGD within each node: splits `comm` into the ranks of each node
    /// (`Communicator::node_index`; PyTorch's default subgroup). Collective over `comm`: every
    /// rank calls it.
    ///
    /// # Errors
    /// The split's and [`PostLocalSgd::new`]'s errors.
    pub fn intra_node(comm: &Communicator, start_step: u64) -> Result<PostLocalSgd> {
        let color = u32::try_from(comm.node_index()).map_err(|_| DdpError::InvalidArgument {
            rank: comm.rank(),
            op: "PostLocalSgd::intra_node",
            msg: format!(
                "node index {} does not fit a split color",
                comm.node_index()
            ),
        })?;
        let group = comm.split(Some(color), comm.rank() as i64)?;
        let group = group.ok_or_else(|| DdpError::InvalidArgument {
            rank: comm.rank(),
            op: "PostLocalSgd::intra_node",
            msg: "the split by node gave this rank no group".into(),
        })?;
        PostLocalSgd::new(comm, group, start_step)
    }
}

/// `e`, from the group's collectives, with the group's ranks replaced by those of the
/// communicator the group was made from (`members`; this rank is `rank` there). `who` begins
/// the note and says which communicator that is (DDP's, for the hook).
fn in_comm(e: DdpError, members: &[usize], rank: usize, who: &str) -> DdpError {
    let peer = |p: usize| members.get(p).copied().unwrap_or(p);
    let note = |s: String| {
        format!(
            "{s} ({who}; other ranks named in it are the group's, group rank i being rank \
             members[i] there, members = {members:?})"
        )
    };
    let e = match e {
        DdpError::Comm(e) => e,
        DdpError::InvalidArgument { op, msg, .. } => {
            return DdpError::InvalidArgument {
                rank,
                op,
                msg: note(msg),
            }
        }
        other => return other,
    };
    DdpError::Comm(match e {
        CommError::PeerLost {
            peer: p,
            op,
            detail,
            ..
        } => CommError::PeerLost {
            rank,
            peer: peer(p),
            op,
            detail: note(detail),
        },
        CommError::Mismatch {
            peer: p,
            seq,
            local,
            remote,
            ..
        } => CommError::Mismatch {
            rank,
            peer: peer(p),
            seq,
            local: note(local),
            remote,
        },
        CommError::Timeout {
            op,
            timeout,
            detail,
            ..
        } => CommError::Timeout {
            rank,
            op,
            timeout,
            detail: note(detail),
        },
        CommError::Aborted { reason, .. } => CommError::Aborted {
            rank,
            reason: note(reason),
        },
        CommError::Transport {
            peer: p,
            transport,
            msg,
            ..
        } => CommError::Transport {
            rank,
            peer: peer(p),
            transport,
            msg: note(msg),
        },
        CommError::InvalidArgument { op, msg, .. } => CommError::InvalidArgument {
            rank,
            op,
            msg: note(msg),
        },
        CommError::Cuda { op, msg, .. } => CommError::Cuda {
            rank,
            op,
            msg: note(msg),
        },
        other => other,
    })
}

impl<G: Borrow<Communicator> + Send> CommHook for PostLocalSgd<G> {
    fn name(&self) -> &str {
        "post_local_sgd"
    }

    fn start(&mut self, comm: &Communicator, bucket: GradBucket) -> HookWork {
        if bucket.index == 0 {
            self.local = self.started >= self.start_step;
            self.started = self.started.saturating_add(1);
        }
        let rank = comm.rank();
        if comm.size() != self.world || self.members.get(self.group().rank()) != Some(&rank) {
            let msg =
                format!(
                "the hook was made for rank {} of a communicator of {}, and runs on rank {rank} \
                 of one of {}",
                self.members.get(self.group().rank()).copied().unwrap_or(usize::MAX),
                self.world,
                comm.size()
            );
            return HookWork::new(move || {
                Err(DdpError::InvalidArgument {
                    rank,
                    op: "post_local_sgd hook",
                    msg,
                })
            });
        }
        if !self.local {
            return AllReduceAvg.start(comm, bucket);
        }
        let work = AllReduceAvg.start(self.group.borrow(), bucket);
        let members = Arc::clone(&self.members);
        HookWork::with_comm(move |c| {
            work.wait(c).map_err(|e| {
                let who = "post_local_sgd hook: this error's rank and peer are DDP's";
                in_comm(e, &members, rank, who)
            })
        })
    }

    fn averages_every_rank(&self) -> bool {
        false
    }

    fn settings(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("start_step", self.start_step),
            ("steps begun (with_steps)", self.started),
        ]
    }
}

/// Averages parameters across the ranks of a communicator once every `period` calls, from call
/// `warmup_steps` on (PyTorch's `PeriodicModelAverager`): call [`ModelAverager::average`] once per
/// synchronised step (not per micro-batch), after the optimizer's update; a rank that has run
/// out of data calls it after each [`Ddp::join_step`](crate::Ddp::join_step) that returns
/// `Some`, as the ranks still training do after their steps. With [`PostLocalSgd`], give it the
/// same start as `warmup_steps`, so that the first local step is followed by an average.
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

/// Refuses, on every rank alike (given the same list), parameters an average cannot take:
/// integer ones, and `GradBuf` views that disagree in length.
fn check_params<P: GradBuf>(rank: usize, op: &'static str, params: &mut [P]) -> Result<()> {
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
struct Packer {
    cap_bytes: usize,
    /// The last average's packing buffers, reused while the layout stays the same.
    buffers: Vec<Option<FlatBuffer>>,
}

impl Packer {
    fn new() -> Packer {
        Packer {
            cap_bytes: 25 << 20,
            buffers: Vec::new(),
        }
    }

    fn kept_bytes(&self) -> usize {
        self.buffers.iter().flatten().map(|b| b.bytes().len()).sum()
    }

    /// Replaces every parameter (checked by [`check_params`]) with its average over `comm`:
    /// every bucket's all-reduce is issued before the first is waited on, each one waited on,
    /// those that completed copied back, and the first error returned.
    fn average<P: GradBuf>(&mut self, comm: &Communicator, params: &mut [P]) -> Result<()> {
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

/// Averages parameters over nested groups of ranks, each at its own period (PyTorch's
/// `HierarchicalModelAverager`): e.g. over the ranks of a node every 4 steps, cheaply over
/// shared memory, and over every rank every 16, across the slow links. Each call counts one
/// step, as [`ModelAverager::average`] does; at call `s` (from 0), from `warmup_steps` on, the
/// level with the largest period that divides `s` averages, and none when no period divides
/// it: PyTorch's rule, which counts periods from step 0 (where [`ModelAverager`], like
/// PyTorch's `PeriodicModelAverager`, counts them from the warm-up).
///
/// Levels are added with increasing periods, usually over growing groups, each group inside the
/// next ([`HierarchicalAverager::by_group_sizes`] makes them so). `G` is how the groups are held:
/// owned (the default), `Arc<Communicator>` or `&Communicator`.
///
/// ```no_run
/// use oxccl_comm::Communicator;
/// use oxccl_ddp::HierarchicalAverager;
///
/// let comm = Communicator::from_env()?;
/// // Groups of 8 consecutive ranks every 4 steps, every rank every 16, from step 100.
/// let mut averager = HierarchicalAverager::by_group_sizes(&comm, &[(4, 8), (16, comm.size())], 100)?;
/// let mut w = vec![0.5f32; 4];
/// for _step in 0..1000 {
///     // ... backward, gradients averaged within the node (PostLocalSgd), update ...
///     averager.average(&mut [&mut w])?;
/// }
/// # Ok::<(), oxccl_ddp::DdpError>(())
/// ```
pub struct HierarchicalAverager<G: Borrow<Communicator> = Communicator> {
    levels: Vec<(u64, G)>,
    warmup_steps: u64,
    step: u64,
    packer: Packer,
    /// Made by [`HierarchicalAverager::by_group_sizes`]: each of its levels' groups as ranks of
    /// the communicator it was split from, and this rank there, so that errors name those ranks
    /// (the groups are the averager's own; the caller knows only that communicator). Levels
    /// added after them with [`HierarchicalAverager::then`] have none: their errors name their
    /// groups' ranks.
    members: Option<(Vec<Vec<usize>>, usize)>,
}

impl<G: Borrow<Communicator>> std::fmt::Debug for HierarchicalAverager<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let levels: Vec<(u64, usize)> = self
            .levels
            .iter()
            .map(|(p, g)| (*p, g.borrow().size()))
            .collect();
        f.debug_struct("HierarchicalAverager")
            .field("levels (period, group size)", &levels)
            .field("warmup_steps", &self.warmup_steps)
            .field("step", &self.step)
            .field("cap_bytes", &self.packer.cap_bytes)
            .field("buffer_bytes", &self.packer.kept_bytes())
            .finish()
    }
}

impl<G: Borrow<Communicator>> HierarchicalAverager<G> {
    /// An averager of one level: over `group` at calls `s >= warmup_steps` that `period`
    /// divides (where [`ModelAverager`] counts its period from `warmup_steps`: the same calls
    /// when `period` divides `warmup_steps`). Add levels with [`HierarchicalAverager::then`].
    pub fn new(period: u64, group: G, warmup_steps: u64) -> HierarchicalAverager<G> {
        HierarchicalAverager {
            levels: vec![(period, group)],
            warmup_steps,
            step: 0,
            packer: Packer::new(),
            members: None,
        }
    }

    /// Adds a level: over `group` every `period` calls. Periods must increase from level to
    /// level (checked by [`HierarchicalAverager::average`], which refuses them otherwise).
    #[must_use]
    pub fn then(mut self, period: u64, group: G) -> HierarchicalAverager<G> {
        self.levels.push((period, group));
        self
    }

    /// Packs parameters into all-reduces of at most `bytes` (25 MiB by default; a larger
    /// parameter goes alone).
    #[must_use]
    pub fn with_bucket_cap_bytes(mut self, bytes: usize) -> HierarchicalAverager<G> {
        self.packer.cap_bytes = bytes.max(1);
        self
    }

    /// Counts `steps` calls as already made (resuming from a checkpoint taken after them).
    #[must_use]
    pub fn with_steps(mut self, steps: u64) -> HierarchicalAverager<G> {
        self.step = steps;
        self
    }

    /// Calls made so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The levels, in order: each one's period and group.
    pub fn levels(&self) -> impl Iterator<Item = (u64, &Communicator)> + '_ {
        self.levels.iter().map(|(p, g)| (*p, g.borrow()))
    }

    /// The level the next call averages over (its index in [`HierarchicalAverager::levels`]),
    /// or `None`.
    pub fn due(&self) -> Option<usize> {
        if self.step < self.warmup_steps {
            return None;
        }
        self.levels
            .iter()
            .rposition(|&(p, _)| p > 0 && self.step.is_multiple_of(p))
    }

    /// Counts one step; when a level is due ([`HierarchicalAverager::due`]), replaces every
    /// parameter with its average over that level's group, as [`ModelAverager::average`] does.
    /// Returns the level that averaged, or `None`. Collective over the due level's group: its
    /// ranks call it alike, with the same parameter list.
    ///
    /// # Errors
    /// `InvalidArgument` (naming this rank in the last level's group) for a period of 0 or
    /// periods that do not increase, and when due for an integer parameter or `GradBuf` views
    /// that disagree in length: before any communication, and the call is not counted. The
    /// all-reduces' errors as for [`ModelAverager::average`] (the call counted); with levels
    /// made by [`HierarchicalAverager::by_group_sizes`] their rank and peer are ranks of the
    /// communicator given to it (`lost_peer()` is the rank to shrink away there), otherwise of
    /// the level's group.
    pub fn average<P: GradBuf>(&mut self, params: &mut [P]) -> Result<Option<usize>> {
        const OP: &str = "HierarchicalAverager::average";
        let last = self.levels.last().map(|(_, g)| g.borrow());
        let rank = last.map_or(0, Communicator::rank);
        let periods: Vec<u64> = self.levels.iter().map(|&(p, _)| p).collect();
        if periods.contains(&0) || periods.windows(2).any(|w| w[0] >= w[1]) {
            return Err(DdpError::InvalidArgument {
                rank,
                op: OP,
                msg: format!(
                    "periods {periods:?}: each must be at least 1 and larger than the one before"
                ),
            });
        }
        let Some(level) = self.due() else {
            self.step = self.step.saturating_add(1);
            return Ok(None);
        };
        check_params(rank, OP, params)?;
        let group = self.levels[level].1.borrow();
        self.step = self.step.saturating_add(1);
        let mapped = self
            .members
            .as_ref()
            .and_then(|(m, rank)| Some((m.get(level)?, *rank)));
        self.packer
            .average(group, params)
            .map_err(|e| match mapped {
                Some((members, rank)) => {
                    let who = "HierarchicalAverager: this error's rank and peer are those of the \
                               communicator given to by_group_sizes";
                    in_comm(e, members, rank, who)
                }
                None => e,
            })?;
        Ok(Some(level))
    }
}

impl HierarchicalAverager {
    /// An averager over groups of consecutive ranks of `comm`, one level per `(period, size)`
    /// (PyTorch's `period_group_size_dict`): level `i` averages over groups of `size` ranks
    /// (`comm`'s ranks `j * size ..`, like `torch.distributed.new_subgroups`) every `period`
    /// calls, from call `warmup_steps`. Collective over `comm`: every rank calls it alike (one
    /// small all-reduce compares the levels and `warmup_steps` between ranks first). A level
    /// over every rank is a communicator of its own (a split of `comm` into one group).
    ///
    /// # Errors
    /// `InvalidArgument`, on every rank alike and before any split, when the levels or
    /// `warmup_steps` differ between ranks, `levels` is empty,
    /// a period is 0 or not larger than the one before, a size is 0, does not divide
    /// `comm.size()`, or does not divide the next level's size (so that each group lies inside
    /// the next), or the last size is not `comm.size()` (as PyTorch asks: the last level
    /// averages every rank); the splits' errors.
    pub fn by_group_sizes(
        comm: &Communicator,
        levels: &[(u64, usize)],
        warmup_steps: u64,
    ) -> Result<HierarchicalAverager> {
        let invalid = |msg: String| DdpError::InvalidArgument {
            rank: comm.rank(),
            op: "HierarchicalAverager::by_group_sizes",
            msg,
        };
        // Every rank must give the same levels: a rank whose levels differ would average at
        // other calls, or fail the checks below alone and leave the others waiting in a split.
        let words = levels.iter().flat_map(|&(p, k)| [p, k as u64]);
        let h = fnv1a([levels.len() as u64].into_iter().chain(words));
        let settings = [
            Setting::described(
                "the list of levels (period, group size)",
                h,
                format!("{levels:?}"),
            ),
            Setting::number("warmup_steps", warmup_steps),
        ];
        agree(
            comm,
            "HierarchicalAverager::by_group_sizes",
            &settings,
            &mut [],
        )?;
        let Some(&(_, last)) = levels.last() else {
            return Err(invalid("no levels given".into()));
        };
        if last != comm.size() {
            return Err(invalid(format!(
                "the last level's group size {last} is not the communicator's {} ranks: the \
                 last level averages every rank",
                comm.size()
            )));
        }
        for (i, &(period, size)) in levels.iter().enumerate() {
            if period == 0 || (i > 0 && period <= levels[i - 1].0) {
                return Err(invalid(format!(
                    "level {i}: period {period} must be at least 1 and larger than the one before"
                )));
            }
            if size == 0 || !comm.size().is_multiple_of(size) {
                return Err(invalid(format!(
                    "level {i}: group size {size} does not divide the communicator's {} ranks",
                    comm.size()
                )));
            }
            if let Some(&(_, next)) = levels.get(i + 1) {
                if !next.is_multiple_of(size) {
                    return Err(invalid(format!(
                        "level {i}: group size {size} does not divide the next level's {next}, \
                         so its groups would not lie inside the next level's"
                    )));
                }
            }
        }
        let rank = comm.rank();
        let mut made = Vec::with_capacity(levels.len());
        let mut members = Vec::with_capacity(levels.len());
        for &(period, size) in levels {
            let color = u32::try_from(rank / size)
                .map_err(|_| invalid(format!("group index {} too large", rank / size)))?;
            let group = comm.split(Some(color), rank as i64)?;
            let group = group.ok_or_else(|| invalid("a split gave this rank no group".into()))?;
            made.push((period, group));
            // Split with this rank as the key: the group's rank j is comm's rank base + j.
            let base = rank / size * size;
            members.push((base..base + size).collect());
        }
        Ok(HierarchicalAverager {
            levels: made,
            warmup_steps,
            step: 0,
            packer: Packer::new(),
            members: Some((members, rank)),
        })
    }
}
