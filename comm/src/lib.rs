//! oxccl-comm: communicators, rendezvous, transports, collective algorithms and the progress engine.
//!
//! Through the `oxccl` crate this crate is `oxccl::comm` (its main types also at `oxccl::`):
//! `oxccl_comm::Communicator` in these pages is `oxccl::comm::Communicator` there, and
//! `oxccl::logging::init()` is [`logging::init`].
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
//! Host buffers go in as typed slices (`&mut [T]`) or as untyped views ([`Buf`], [`BufMut`]:
//! bytes and a [`DType`], through [`Communicator::buffers`]); with the `cuda` feature, device
//! buffers go in through `Communicator::on_stream` (the `cuda` module) with the same
//! names. Every collective follows one naming rule: `x` in place, `x_into` out of place, and
//! `_async` for either form.
//!
//! The source is in layers, each using only those below it (a unit test checks it): `api`
//! (the communicator and its calls), `engine` (ordering, progress thread, failure propagation,
//! channels), `algorithm` (one file per algorithm, and the primitives they share), `transport`
//! (the slot traits, the selector, one folder per backend: shared memory, TCP, CUDA IPC),
//! `device` (pinned staging for device buffers) and `base` (rendezvous, configuration, tuning,
//! trace, errors, the `libc` calls). docs/ARCHITECTURE.md walks through them.

mod algorithm;
mod api;
mod base;
#[cfg(feature = "cuda-core")]
mod device;
mod engine;
#[cfg(test)]
mod layers;
mod transport;

pub use api::{harness, topology};
pub use base::{bootstrap, config, error, logging};

pub use api::buffers::Buffers;
pub use api::communicator::{Communicator, Stats};
#[cfg(feature = "cuda-core")]
pub use api::device as cuda;
pub use api::p2p::{OwnedP2pOp, P2pOp, P2pView};
pub use api::registered::Registered;
pub use base::affinity::NodeShare;
pub use base::buffer::{Buf, BufError, BufMut, BufOwner};
pub use base::config::Config;
pub use base::error::{Error, Result};
pub use base::op::Collective;
pub use base::trace::{TraceDump, TraceRecord, TraceState};
pub use base::tuning::Algorithm;
pub use engine::Work;
pub use oxccl_kernels::{bf16, f16, DType, Element, ReduceOp, F8E4M3, F8E5M2};
pub use topology::Topology;

/// What the `oxccl` command-line tool and the test suites use of this crate's insides: CPU
/// affinity, operation descriptions, the flight recorder's file format, the
/// tuner's override syntax, shared-memory segment names. Not part of the API: it may change in
/// any release.
#[doc(hidden)]
pub mod internal {
    pub use crate::base::{affinity, op, trace, tuning};

    /// Shared-memory segment names (what `oxccl launch` removes after a crashed job).
    pub mod shm {
        pub use crate::transport::shm::{job_prefix, SHM_DIR};
    }

    /// This host's verbs port, as the RDMA transport would open it.
    pub mod rdma {
        pub use crate::transport::rdma::verbs_port;
    }

    /// The address this host listens on for TCP peers (`OXCCL_SOCKET_IFNAME`'s choice).
    pub mod tcp {
        pub use crate::transport::tcp::iface::choose_local_ip;
    }
}
