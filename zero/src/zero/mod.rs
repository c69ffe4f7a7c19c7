//! [`Zero`]: the sharded optimizer over host parameters. Per step:
//!
//! 1. backward: each gradient, as it arrives ([`Zero::grad_ready`]), is widened to f32 into its
//!    bucket; a full bucket is reduce-scattered (summed) inside the shard group on the shard
//!    group's progress thread while backward goes on (stage 2: in every micro-batch, into the
//!    shard's gradient; stage 1: in the last micro-batch only, the full gradients accumulating
//!    in the buckets until then);
//! 2. [`Zero::step`] at the last micro-batch: the shard's gradient is all-reduced (summed)
//!    across the replica group (the same local rank on every node) and divided by the world
//!    size, clipped by the global norm, and the optimizer steps the shard's f32 master weights;
//!    the updated shards, rounded to the parameters' type, are all-gathered inside the shard
//!    group into every rank's parameters.
//!
//! The submodules: `backward` (buckets filled and launched), `step` (the update), `ckpt`
//! (checkpoints saved and loaded).

use oxccl_comm::{Communicator, ReduceOp, Work};

use crate::agree::agree;
use crate::elem::ParamElement;
use crate::error::{Result, ZeroError};
use crate::optim::{Hyper, ShardOptimizer};
use crate::shard::{Piece, ShardLayout};

mod backward;
mod ckpt;
mod step;

/// Which ranks share one copy of the optimizer state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardGroup {
    /// The ranks of one node (the communicator's node layout): cross-node traffic stays that
    /// of a hierarchical all-reduce. Every node must hold as many ranks.
    Node,
    /// Every rank (classic ZeRO): no replicas.
    World,
}

/// What is sharded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Optimizer state (and master weights) only: each rank keeps the full gradients, summed
    /// over micro-batches, and reduce-scatters them during the last micro-batch's backward.
    One,
    /// Gradients too: buckets are reduce-scattered in every micro-batch's backward and each
    /// rank keeps its shard's sum only (the traffic inside the shard group grows with the
    /// micro-batches; across nodes it does not).
    Two,
}

/// Whether the buckets' collectives run during backward (as DDP's `Overlap`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overlap {
    /// [`Overlap::On`] where every rank's node has 2 CPUs or more for each of its ranks
    /// (`comm.stats().node_holds(2)`, agreed between the ranks), [`Overlap::Off`] otherwise:
    /// host collectives are CPU work, and where every CPU already runs a rank's backward the
    /// two would take turns on the same CPUs.
    #[default]
    Auto,
    /// A full bucket's reduce-scatter (and, at the last micro-batch, its chunk's all-reduce
    /// across the replicas) start at once and run on the communicators' progress threads while
    /// backward goes on.
    On,
    /// A full bucket is reduce-scattered (and its chunk all-reduced across the replicas) on the
    /// caller's thread before `grad_ready` returns: backward pauses, memory stays that of the
    /// buckets in flight.
    Off,
}

/// Settings of [`Zero`].
#[derive(Clone, Debug)]
pub struct ZeroConfig {
    /// The shard group.
    pub group: ShardGroup,
    /// What is sharded.
    pub stage: Stage,
    /// Elements per gradient bucket (parameters in reverse order, a larger one alone; 0: one
    /// bucket, reduced after backward). Default 6.5 M (25 MiB of f32, DDP's default).
    pub bucket_elems: usize,
    /// Buckets reduce-scattered (stage 2) and all-gathered at once; a further one waits for the
    /// oldest. Default 2.
    pub buckets_in_flight: usize,
    /// Whether the collectives overlap backward (default [`Overlap::Auto`]).
    pub overlap: Overlap,
    /// Chunks of a bucket are a multiple of this many elements.
    pub align: usize,
    /// Clip the averaged gradient to this global L2 norm (PyTorch's `clip_grad_norm_`: scaled by
    /// `max / (norm + 1e-6)` where that is below 1), the norm taken over every parameter: each
    /// shard's sum of squares, summed over the shard group (the replicas hold the same shards).
    pub max_grad_norm: Option<f32>,
}

impl Default for ZeroConfig {
    fn default() -> ZeroConfig {
        ZeroConfig {
            group: ShardGroup::Node,
            stage: Stage::Two,
            bucket_elems: 25 << 20 >> 2,
            buckets_in_flight: 2,
            overlap: Overlap::Auto,
            align: 16,
            max_grad_norm: None,
        }
    }
}

/// A reduce-scatter in flight: the bucket, the micro-batch of the step it carries, the work.
struct InFlight {
    bucket: usize,
    micro: usize,
    work: Work<Vec<f32>>,
}

/// The sharded optimizer (see the module docs). `T` is the parameters' element type.
pub struct Zero<T: ParamElement = f32> {
    rank: usize,
    world: usize,
    shard: Communicator,
    replica: Option<Communicator>,
    /// A communicator of every rank (ranks as the world's) for the agreement before a step,
    /// which must not queue behind the reduce-scatters in flight.
    check: Communicator,
    /// This rank writes its shard's checkpoint file (it is in the first replica).
    writer: bool,
    layout: ShardLayout,
    stage: Stage,
    /// This rank's pieces of the parameters, in shard order.
    pieces: Vec<Piece>,
    /// Per bucket: its pieces' indices in `pieces`.
    bucket_pieces: Vec<std::ops::Range<usize>>,
    hypers: Vec<Hyper>,
    opt: Box<dyn ShardOptimizer>,
    /// f32 master weights of the shard (padding included, held at 0).
    master: Vec<f32>,
    state: Vec<f32>,
    /// The shard's gradient sum over the micro-batches reduced so far in this step.
    grad: Vec<f32>,
    t: u64,
    back: backward::Backward,
    max_grad_norm: Option<f32>,
    last_norm: Option<f64>,
    /// Why this optimizer refuses further calls (a step failed part-way).
    poisoned: Option<String>,
    /// Buffers of the parameters' all-gathers (one bucket each).
    gather_pool: Vec<Vec<T>>,
    buckets_in_flight: usize,
}

impl<T: ParamElement> std::fmt::Debug for Zero<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Zero")
            .field("rank", &self.rank)
            .field("group", &self.layout.group())
            .field("stage", &self.stage)
            .field("shard_len", &self.layout.shard_len())
            .field("optimizer", &self.opt.name())
            .field("t", &self.t)
            .finish()
    }
}

impl<T: ParamElement> Zero<T> {
    /// Sets up the shard and replica groups of `comm`, broadcasts rank 0's `params` into every
    /// rank's, and keeps this rank's shard of them as f32 master weights. `hypers` holds each
    /// parameter's learning rate and weight decay (parameter groups). Collective; the ranks'
    /// parameter lengths and settings are compared first.
    ///
    /// # Errors
    /// `InvalidArgument` on every rank for parameter lists, settings or optimizers that differ
    /// between ranks, and on this rank for a hyper-parameter list of another length or nodes of
    /// different sizes with [`ShardGroup::Node`]; the collectives' errors.
    pub fn new(
        comm: &Communicator,
        params: &mut [&mut [T]],
        hypers: Vec<Hyper>,
        opt: Box<dyn ShardOptimizer>,
        cfg: ZeroConfig,
    ) -> Result<Zero<T>> {
        let rank = comm.rank();
        let check = split(comm, 0, rank)?;
        let lens: Vec<usize> = params.iter().map(|p| p.len()).collect();
        let fault = (hypers.len() != params.len()).then(|| {
            format!(
                "{} hyper-parameter sets for {} parameters",
                hypers.len(),
                params.len()
            )
        });
        let call = format!(
            "parameters {lens:?} of {:?}, {:?}, {:?}, stage {:?}, overlap {:?}, buckets of {}, \
             align {}, {} with {} state per element, clip {:?}",
            T::DTYPE,
            hypers,
            cfg.group,
            cfg.stage,
            cfg.overlap,
            cfg.bucket_elems,
            cfg.align,
            opt.name(),
            opt.state_per_elem(),
            cfg.max_grad_norm,
        );
        agree(&check, rank, "new", &call, fault.as_deref())?;
        let (shard, replica) = groups(comm, cfg.group)?;
        let writer = replica.as_ref().is_none_or(|r| r.rank() == 0);
        let layout = ShardLayout::bucketed(&lens, shard.size(), cfg.align, cfg.bucket_elems);
        broadcast_params(comm, &layout, params)?;
        let pieces = layout.pieces(shard.rank());
        let bucket_pieces = bucket_pieces(&layout, &pieces);
        let n = layout.shard_len();
        let mut master = vec![0.0f32; n];
        for pc in &pieces {
            let src = &params[pc.param][pc.param_offset..pc.param_offset + pc.len];
            let dst = &mut master[pc.shard_offset..pc.shard_offset + pc.len];
            dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.to_f32());
        }
        // Overlap::Auto: on where no rank's node is short of CPUs (decided alike everywhere).
        let mut short = [u64::from(!comm.stats().node_holds(2))];
        check.all_reduce(&mut short, ReduceOp::Max)?;
        let overlap = match cfg.overlap {
            Overlap::Auto => short[0] == 0,
            Overlap::On => true,
            Overlap::Off => false,
        };
        let back = backward::Backward::new(&layout, cfg.stage, cfg.buckets_in_flight, overlap);
        Ok(Zero {
            rank,
            world: comm.size(),
            state: vec![0.0f32; opt.state_per_elem() * n],
            grad: vec![0.0f32; n],
            gather_pool: Vec::new(),
            buckets_in_flight: cfg.buckets_in_flight.max(1),
            shard,
            replica,
            check,
            writer,
            stage: cfg.stage,
            pieces,
            bucket_pieces,
            layout,
            hypers,
            opt,
            master,
            t: 0,
            back,
            max_grad_norm: cfg.max_grad_norm,
            last_norm: None,
            poisoned: None,
        })
    }

    /// Makes every step `k` micro-batches: [`Zero::step`] after each of the first `k - 1` only
    /// closes the micro-batch (gradients are summed: scale the loss by `1/k` for a mean); the
    /// k-th steps the optimizer. Nothing crosses nodes before the k-th; stage 1 communicates
    /// nothing before it at all. Collective, between steps: the ranks compare `k`.
    ///
    /// # Errors
    /// `InvalidArgument` on every rank for `k == 0`, a `k` that differs between ranks, or a rank
    /// in the middle of a step; the agreement's errors.
    pub fn accumulate(&mut self, k: usize) -> Result<()> {
        self.check_poisoned("accumulate")?;
        let fault = if k == 0 {
            Some("accumulate(0): a step needs at least one micro-batch".to_string())
        } else if self.back.busy() {
            Some(format!("accumulate({k}) in the middle of a step"))
        } else {
            None
        };
        let call = format!("accumulate({k})");
        agree(
            &self.check,
            self.rank,
            "accumulate",
            &call,
            fault.as_deref(),
        )?;
        self.back.accumulate = k;
        Ok(())
    }

    /// Optimizer-state bytes this rank holds: the f32 state of its shard (AdamW's two moments,
    /// SGD's momentum), padding included.
    pub fn state_bytes(&self) -> usize {
        self.state.len() * 4
    }

    /// Bytes of this rank's f32 master weights (its shard, padding included).
    pub fn master_bytes(&self) -> usize {
        self.master.len() * 4
    }

    /// Gradient bytes this rank holds: stage 1 the full gradients (every bucket) and the
    /// shard's sum; stage 2 the shard's sum and the buckets in flight at most.
    pub fn grad_bytes(&self) -> usize {
        (self.grad.len() + self.back.buffer_elems()) * 4
    }

    /// The shard layout.
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.t
    }

    /// The global norm of the last step's averaged gradient, before clipping (with
    /// `max_grad_norm` set).
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.last_norm
    }

    fn invalid(&self, op: &'static str, msg: String) -> ZeroError {
        ZeroError::InvalidArgument {
            rank: self.rank,
            op,
            msg,
        }
    }

    fn check_poisoned(&self, op: &'static str) -> Result<()> {
        match &self.poisoned {
            None => Ok(()),
            Some(why) => Err(self.invalid(op, format!("unusable after an earlier error: {why}"))),
        }
    }
}

/// Rank 0's parameters into every rank's, a bucket at a time (laid end to end).
fn broadcast_params<T: ParamElement>(
    comm: &Communicator,
    layout: &ShardLayout,
    params: &mut [&mut [T]],
) -> Result<()> {
    let mut flat: Vec<T> = Vec::new();
    for b in layout.buckets() {
        flat.clear();
        for &p in &b.params {
            flat.extend_from_slice(params[p]);
        }
        comm.broadcast(&mut flat, 0)?;
        for (&p, &start) in b.params.iter().zip(&b.starts) {
            let n = params[p].len();
            params[p].copy_from_slice(&flat[start..start + n]);
        }
    }
    Ok(())
}

/// Per bucket, the indices in `pieces` (this rank's, in shard order) of its pieces.
pub(crate) fn bucket_pieces(layout: &ShardLayout, pieces: &[Piece]) -> Vec<std::ops::Range<usize>> {
    layout
        .buckets()
        .iter()
        .map(|b| {
            let inside = |pc: &Piece| pc.shard_offset < b.shard_offset + b.chunk;
            let first = pieces.partition_point(|pc| pc.shard_offset < b.shard_offset);
            first..first + pieces[first..].iter().take_while(|pc| inside(pc)).count()
        })
        .collect()
}

/// The shard group and replica group of `comm`.
pub(crate) fn groups(
    comm: &Communicator,
    group: ShardGroup,
) -> Result<(Communicator, Option<Communicator>)> {
    let rank = comm.rank();
    if group == ShardGroup::World {
        return Ok((split(comm, 0, rank)?, None));
    }
    // The node sizes: every rank must agree that they are equal.
    let mut sizes = [comm.local_size() as u64, !(comm.local_size() as u64)];
    comm.all_reduce(&mut sizes, ReduceOp::Max)?;
    if sizes[0] != !sizes[1] {
        return Err(ZeroError::InvalidArgument {
            rank,
            op: "new",
            msg: format!(
                "node-local shard groups need nodes of equal size: from {} to {} ranks",
                !sizes[1], sizes[0]
            ),
        });
    }
    let (node, local) = (comm.node_index(), comm.local_rank());
    let shard = split(comm, node as u32, local)?;
    let replica = split(comm, local as u32, node)?;
    Ok((shard, (replica.size() > 1).then_some(replica)))
}

/// `comm` split by `color`, ordered by `key`.
pub(crate) fn split(comm: &Communicator, color: u32, key: usize) -> Result<Communicator> {
    comm.split(Some(color), key as i64)?
        .ok_or_else(|| ZeroError::InvalidArgument {
            rank: comm.rank(),
            op: "new",
            msg: "split gave no communicator".into(),
        })
}
