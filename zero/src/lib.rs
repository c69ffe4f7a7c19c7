//! oxccl-zero: node-local ZeRO. The sharded optimizer keeps each rank's optimizer state
//! (stage 1) and gradients (stage 2) for one shard of the parameters of its shard group (by
//! default the ranks of one node, [`ShardGroup::Node`]; [`ShardGroup::World`] for classic ZeRO), with
//! replicas of every shard across the nodes, so the bytes a rank sends between nodes are those
//! of a hierarchical all-reduce while its optimizer memory falls by the shard group's size.
//!
//! ```no_run
//! # fn main() -> oxccl_zero::Result<()> {
//! use oxccl_comm::Communicator;
//! use oxccl_zero::{AdamW, Hyper, Zero, ZeroConfig};
//! let comm = Communicator::from_env()?;
//! let (mut w, mut b) = (vec![0.1f32; 1024], vec![0.0f32; 32]);
//! let hypers = vec![
//!     Hyper { lr: 1e-3, weight_decay: 0.01 }, // w
//!     Hyper { lr: 1e-3, weight_decay: 0.0 },  // b: a parameter group of its own
//! ];
//! let mut zero = Zero::new(&comm, &mut [&mut w, &mut b], hypers, Box::new(AdamW::default()),
//!                          ZeroConfig::default())?;
//! for _step in 0..10 {
//!     let (gw, gb) = (vec![0.01f32; 1024], vec![0.01f32; 32]); // backward, last layer first:
//!     zero.grad_ready(1, &gb)?; // its bucket's reduce-scatter starts once it is full
//!     zero.grad_ready(0, &gw)?;
//!     zero.step(&mut [&mut w, &mut b])?; // every rank's w and b updated
//! }
//! zero.save("ckpt")?; // one file per shard and a manifest; resumes on any group size
//! # Ok(())
//! # }
//! ```
//!
//! - [`Zero`]: the step over host parameters of f32, or of f16 / bf16 with f32 master weights
//!   ([`ParamElement`]): gradients reduce-scattered bucket by bucket during backward
//!   ([`Zero::grad_ready`], or [`Zero::grads_ready`] after it), the shard all-reduced across
//!   the replicas, the optimizer on the shard, the parameters all-gathered ([`Zero::step`]);
//!   accumulation ([`Zero::accumulate`]), clipping by the global gradient norm
//!   ([`ZeroConfig::max_grad_norm`]), parameter groups ([`Hyper`] per parameter);
//! - [`ShardOptimizer`], with [`Sgd`] (momentum, dampening, Nesterov, weight decay) and
//!   [`AdamW`], stepping one shard of f32 master weights with its own state (implement it for
//!   your own optimizer);
//! - [`ShardLayout`]: the buckets, each padded and cut into one equal chunk per rank, and each
//!   shard's [`Piece`]s of the parameters;
//! - checkpoints: [`Zero::save`] (safetensors, one file per shard and a manifest),
//!   [`consolidate`] into a [`FullState`], [`Zero::load`] into any shard group size.
//!
//! - `DeviceZero` (feature `cuda`): the same on CUDA device parameters, every copy, collective
//!   and optimizer kernel (`oxccl_adamw_f32`, `oxccl_sgd_f32`, the host's arithmetic bit for
//!   bit) enqueued on the trainer's stream; built, its kernels' arithmetic tested against the
//!   host's, not yet run on a GPU. No clipping on device yet.

#![forbid(unsafe_code)]

mod agree;
mod checkpoint;
#[cfg(feature = "cuda-core")]
mod device;
mod elem;
mod error;
mod optim;
mod shard;
mod zero;

pub use checkpoint::{consolidate, FullState, ParamState, MANIFEST};
#[cfg(feature = "cuda-core")]
pub use device::{DeviceOptimizer, DeviceParam, DeviceZero};
pub use elem::ParamElement;
pub use error::{Result, ZeroError};
pub use optim::{AdamW, AdamWStep, Hyper, Sgd, SgdStep, ShardOptimizer};
pub use shard::{Bucket, Piece, ShardLayout};
pub use zero::{Overlap, ShardGroup, Stage, Zero, ZeroConfig};
