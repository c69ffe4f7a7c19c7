//! [`PostLocalSgd`], the comm hook of post-local SGD: every rank's average during the warm-up,
//! then the group's.

use std::borrow::Borrow;
use std::sync::Arc;

use oxccl_comm::Communicator;

use super::in_comm;
use crate::error::{DdpError, Result};
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
        g.all_gather_into(&[comm.rank() as u64], &mut members)?;
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
