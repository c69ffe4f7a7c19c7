//! [`Zero`]: the sharded optimizer's step over host f32 parameters. Per step: the gradients,
//! flattened and padded, are reduce-scattered (summed) inside the shard group; each rank's shard
//! is all-reduced (summed) across its replica group (the same local rank on every node) and
//! divided by the world size; the optimizer steps the shard's f32 master weights; the updated
//! shards are all-gathered inside the shard group and copied back into the parameters.

use oxccl_comm::{Communicator, ReduceOp};

use crate::error::{Result, ZeroError};
use crate::optim::{Hyper, ShardOptimizer};
use crate::shard::{Piece, ShardLayout};

/// Which ranks share one copy of the optimizer state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardGroup {
    /// The ranks of one node (the communicator's node layout): cross-node traffic stays that
    /// of a hierarchical all-reduce. Every node must hold as many ranks.
    Node,
    /// Every rank (classic ZeRO): no replicas.
    World,
}

/// Settings of [`Zero`].
#[derive(Clone, Debug)]
pub struct ZeroConfig {
    /// The shard group.
    pub group: ShardGroup,
    /// Shards are a multiple of this many elements.
    pub align: usize,
    /// Clip the averaged gradient to this global L2 norm (PyTorch's `clip_grad_norm_`: scaled by
    /// `max / (norm + 1e-6)` where that is below 1), the norm taken over every parameter: each
    /// shard's sum of squares, summed over the shard group.
    pub max_grad_norm: Option<f32>,
}

impl Default for ZeroConfig {
    fn default() -> ZeroConfig {
        ZeroConfig {
            group: ShardGroup::Node,
            align: 16,
            max_grad_norm: None,
        }
    }
}

/// The sharded optimizer (see the module docs).
pub struct Zero {
    rank: usize,
    world: usize,
    shard: Communicator,
    replica: Option<Communicator>,
    layout: ShardLayout,
    /// This rank's pieces of the parameters, in shard order.
    pieces: Vec<Piece>,
    lens: Vec<usize>,
    hypers: Vec<Hyper>,
    opt: Box<dyn ShardOptimizer>,
    master: Vec<f32>,
    state: Vec<f32>,
    t: u64,
    flat: Vec<f32>,
    shard_buf: Vec<f32>,
    /// Micro-batches summed into `flat` since the last step.
    micro: usize,
    max_grad_norm: Option<f32>,
    last_norm: Option<f64>,
}

impl std::fmt::Debug for Zero {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Zero")
            .field("rank", &self.rank)
            .field("group", &self.layout.group())
            .field("shard_len", &self.layout.shard_len())
            .field("optimizer", &self.opt.name())
            .finish()
    }
}

/// `dst` = `src` laid end to end (padding left as it is).
fn flatten(dst: &mut [f32], src: &[&[f32]]) {
    let mut off = 0;
    for s in src {
        dst[off..off + s.len()].copy_from_slice(s);
        off += s.len();
    }
}

impl Zero {
    /// Sets up the shard and replica groups of `comm`, broadcasts rank 0's `params` into every
    /// rank's, and keeps this rank's shard of them as f32 master weights. `hypers` holds each
    /// parameter's learning rate and weight decay (parameter groups). Collective.
    ///
    /// # Errors
    /// `InvalidArgument` for a hyper-parameter list of another length, or nodes of different
    /// sizes with [`ShardGroup::Node`]; the collectives' errors.
    pub fn new(
        comm: &Communicator,
        params: &mut [&mut [f32]],
        hypers: Vec<Hyper>,
        opt: Box<dyn ShardOptimizer>,
        cfg: ZeroConfig,
    ) -> Result<Zero> {
        let rank = comm.rank();
        let invalid = |msg: String| ZeroError::InvalidArgument {
            rank,
            op: "new",
            msg,
        };
        if hypers.len() != params.len() {
            let msg = format!(
                "{} hyper-parameter sets for {} parameters",
                hypers.len(),
                params.len()
            );
            return Err(invalid(msg));
        }
        // The node sizes: every rank must agree that they are equal.
        let mut sizes = [comm.local_size() as u64, !(comm.local_size() as u64)];
        comm.all_reduce(&mut sizes, ReduceOp::Max)?;
        let (shard, replica) = match cfg.group {
            ShardGroup::World => (split(comm, 0, rank)?, None),
            ShardGroup::Node => {
                if sizes[0] != !sizes[1] {
                    let msg = format!(
                        "node-local shard groups need nodes of equal size: from {} to {} ranks",
                        !sizes[1], sizes[0]
                    );
                    return Err(invalid(msg));
                }
                let node = comm.node_index() as u32;
                let local = comm.local_rank();
                let shard = split(comm, node, local)?;
                let replica = split(comm, local as u32, comm.node_index())?;
                (shard, (replica.size() > 1).then_some(replica))
            }
        };
        let lens: Vec<usize> = params.iter().map(|p| p.len()).collect();
        let layout = ShardLayout::new(&lens, shard.size(), cfg.align);
        let mut flat = vec![0.0f32; layout.padded()];
        let views: Vec<&[f32]> = params.iter().map(|p| &**p).collect();
        flatten(&mut flat, &views);
        comm.broadcast(&mut flat, 0)?;
        let mut off = 0;
        for p in params.iter_mut() {
            p.copy_from_slice(&flat[off..off + p.len()]);
            off += p.len();
        }
        let r = layout.range(shard.rank());
        let master = flat[r.clone()].to_vec();
        let state = vec![0.0f32; opt.state_per_elem() * master.len()];
        let pieces = layout.pieces(shard.rank());
        Ok(Zero {
            rank,
            world: comm.size(),
            shard_buf: vec![0.0; layout.shard_len()],
            shard,
            replica,
            pieces,
            layout,
            lens,
            hypers,
            opt,
            master,
            state,
            t: 0,
            flat,
            micro: 0,
            max_grad_norm: cfg.max_grad_norm,
            last_norm: None,
        })
    }

    /// Optimizer-state bytes this rank holds (f32 state and master weights of its shard).
    pub fn state_bytes(&self) -> usize {
        (self.state.len() + self.master.len()) * 4
    }

    /// The shard layout.
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// One step: `grads` (this rank's, one per parameter) averaged over every rank, the
    /// optimizer applied to this rank's shard, and every rank's `params` set to the updated
    /// values. Collective.
    ///
    /// # Errors
    /// `InvalidArgument` for parameter or gradient lists that are not those given to `new`; the
    /// collectives' errors.
    pub fn step(&mut self, params: &mut [&mut [f32]], grads: &[&[f32]]) -> Result<()> {
        let plens: Vec<usize> = params.iter().map(|p| p.len()).collect();
        self.check("step", Some(plens), grads)?;
        self.add_micro(grads);
        self.micro = 0;
        self.shard
            .reduce_scatter_into(&self.flat, &mut self.shard_buf, ReduceOp::Sum)?;
        if let Some(rep) = &self.replica {
            rep.all_reduce(&mut self.shard_buf, ReduceOp::Sum)?;
        }
        let world = self.world as f32;
        self.shard_buf.iter_mut().for_each(|g| *g /= world);
        if let Some(max) = self.max_grad_norm {
            self.clip(max)?;
        }
        self.t += 1;
        let per = self.opt.state_per_elem();
        for piece in &self.pieces {
            let (a, b) = (piece.shard_offset, piece.shard_offset + piece.len);
            // Each piece steps alone with its parameter's hyper-parameters. The pieces tile the
            // shard in order, so the state is laid out piece by piece: `per` elements for each
            // of the piece's, at `per * a`.
            self.opt.step(
                self.t,
                self.hypers[piece.param],
                &mut self.master[a..b],
                &self.shard_buf[a..b],
                &mut self.state[per * a..per * b],
            );
        }
        self.shard_buf.fill(0.0);
        self.shard_buf[..self.master.len()].copy_from_slice(&self.master);
        self.shard
            .all_gather_into(&self.shard_buf, &mut self.flat)?;
        let mut off = 0;
        for p in params.iter_mut() {
            p.copy_from_slice(&self.flat[off..off + p.len()]);
            off += p.len();
        }
        Ok(())
    }

    /// Adds a micro-batch's gradients into this rank's sum without communicating (gradient
    /// accumulation); the next [`Zero::step`] adds its own and reduces the sum.
    ///
    /// # Errors
    /// `InvalidArgument` for a gradient list that is not that of `new`.
    pub fn accumulate(&mut self, grads: &[&[f32]]) -> Result<()> {
        self.check("accumulate", None, grads)?;
        self.add_micro(grads);
        self.micro += 1;
        Ok(())
    }

    /// The global norm of the last step's averaged gradient, before clipping (with
    /// `max_grad_norm` set).
    pub fn last_grad_norm(&self) -> Option<f64> {
        self.last_norm
    }

    /// `grads` written into the flat sum (the first micro-batch of a step) or added to it.
    fn add_micro(&mut self, grads: &[&[f32]]) {
        if self.micro == 0 {
            flatten(&mut self.flat, grads);
            self.flat[self.layout.total()..].fill(0.0);
            return;
        }
        let mut off = 0;
        for g in grads {
            for (d, s) in self.flat[off..off + g.len()].iter_mut().zip(g.iter()) {
                *d += s;
            }
            off += g.len();
        }
    }

    /// Scales the averaged shard so that the global norm is at most `max`.
    fn clip(&mut self, max: f32) -> Result<()> {
        let own = &self.shard_buf[..self.master.len()];
        let mut ss = [own
            .iter()
            .map(|&g| f64::from(g) * f64::from(g))
            .sum::<f64>()];
        self.shard.all_reduce(&mut ss, ReduceOp::Sum)?;
        let norm = ss[0].sqrt();
        self.last_norm = Some(norm);
        let coef = f64::from(max) / (norm + 1e-6);
        if coef < 1.0 {
            let c = coef as f32;
            self.shard_buf.iter_mut().for_each(|g| *g *= c);
        }
        Ok(())
    }

    fn check(&self, op: &'static str, plens: Option<Vec<usize>>, grads: &[&[f32]]) -> Result<()> {
        let glens: Vec<usize> = grads.iter().map(|g| g.len()).collect();
        if glens == self.lens && plens.as_ref().is_none_or(|p| *p == self.lens) {
            return Ok(());
        }
        Err(ZeroError::InvalidArgument {
            rank: self.rank,
            op,
            msg: format!(
                "parameter lengths {plens:?} and gradient lengths {glens:?} given; new had {:?}",
                self.lens
            ),
        })
    }
}

/// `comm` split by `color`, ordered by `key`.
fn split(comm: &Communicator, color: u32, key: usize) -> Result<Communicator> {
    comm.split(Some(color), key as i64)?
        .ok_or_else(|| ZeroError::InvalidArgument {
            rank: comm.rank(),
            op: "new",
            msg: "split gave no communicator".into(),
        })
}
