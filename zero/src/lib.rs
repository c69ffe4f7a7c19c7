//! oxccl-zero: node-local ZeRO (work in progress). The sharded optimizer keeps each rank's
//! optimizer state (stage 1) and gradients (stage 2) for one shard of the flat parameter space
//! of its shard group (by default the ranks of one node), with replicas of every shard across
//! the nodes, so the bytes a rank sends between nodes stay those of a hierarchical all-reduce.
//!
//! What is here so far, and tested without communication:
//! - [`ShardLayout`]: the flat parameter space cut into equal, aligned shards, one per rank of
//!   the shard group (the last ones padded where the size does not divide), and each shard's
//!   pieces of each parameter;
//! - [`ShardOptimizer`], with [`Sgd`] (momentum, dampening, Nesterov, weight decay) and
//!   [`AdamW`], stepping one shard of f32 master weights with its own state; a step on every
//!   shard equals the same step on the whole vector, element for element, which is what lets
//!   each rank step its shard alone.
//!
//! - [`Zero`]: the step on host f32 parameters: reduce-scatter of the gradients inside the shard
//!   group ([`ShardGroup::Node`] or [`ShardGroup::World`]), all-reduce of the shard across the
//!   replicas, the optimizer on the shard, all-gather of the parameters; accumulation
//!   ([`Zero::accumulate`]: communication at the last micro-batch only) and clipping by the
//!   global gradient norm ([`ZeroConfig::max_grad_norm`]).
//!
//! Not yet: overlap with backward (`grad_ready`), stage 1 against stage 2 memory, master weights
//! for bf16/f16 parameters, checkpoints, device buffers.

#![forbid(unsafe_code)]

mod error;
mod optim;
mod shard;
mod zero;

pub use error::{Result, ZeroError};
pub use optim::{AdamW, Hyper, Sgd, ShardOptimizer};
pub use shard::{Piece, ShardLayout};
pub use zero::{ShardGroup, Zero, ZeroConfig};
