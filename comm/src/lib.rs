//! oxccl-comm: communicators, rendezvous, transports, collective algorithms and the progress engine.
//!
//! # Quick start
//!
//! Under `oxccl launch -n 4 -- my-trainer` (or torchrun, srun, mpirun) every process does:
//!
//! ```no_run
//! use oxccl_comm::Communicator;
//! use oxccl_kernels::ReduceOp;
//!
//! let comm = Communicator::from_env()?;
//! let mut grads = vec![1.0f32; 1 << 20];
//! comm.all_reduce(&mut grads, ReduceOp::Avg)?;          // blocking, in place
//! let work = comm.all_reduce_async(grads, ReduceOp::Sum); // owns the buffer while in flight
//! let grads = work.wait()?;                              // gives it back
//! let half = comm.split(Some((comm.rank() % 2) as u32), comm.rank() as i64)?;
//! # let _ = (grads, half);
//! # Ok::<(), oxccl_comm::Error>(())
//! ```
//!
//! Every rank must issue the same collectives in the same order (as with NCCL); a rank that does
//! not gets [`Error::Mismatch`] on every rank involved, a rank that dies gets
//! [`Error::PeerLost`] on every survivor, and every wait has a deadline (`OXCCL_TIMEOUT`).
//!
//! Layout: `bootstrap` (stores, launcher variables), `transport` (the slot-based transport trait
//! and its TCP backend), `algorithm` (one file per algorithm, written against the trait only),
//! `tuning` (pure algorithm choice), `engine` (ordering, progress thread, failure propagation),
//! `topology` (data/tensor/pipeline group placement, [`Topology::setup`]), and with the `cuda`
//! feature `cuda` (collectives on device buffers, enqueued on a CUDA stream).

mod algorithm;
mod api;
mod base;
#[cfg(feature = "cuda")]
mod device;
mod engine;
#[cfg(test)]
mod layers;
pub mod transport;

pub use api::{harness, topology};
pub use base::{affinity, bootstrap, config, error, logging, op, trace, tuning};

pub use api::buffers::Buffers;
pub use api::communicator::Communicator;
#[cfg(feature = "cuda")]
pub use api::device as cuda;
pub use api::p2p::{OwnedP2pOp, P2pOp};
pub use base::buffer::{Buf, BufError, BufMut, BufOwner};
pub use base::config::Config;
pub use base::error::{Error, Result};
pub use base::op::Collective;
pub use base::trace::{TraceDump, TraceRecord, TraceState};
pub use base::tuning::Algorithm;
pub use engine::Work;
pub use oxccl_kernels::{DType, Element, ReduceOp};
pub use topology::Topology;
