//! oxccl: collective communication for Rust trainers.
//!
//! This facade re-exports the workspace crates: [`comm`] (communicators, rendezvous, transports,
//! algorithms) and [`kernels`] (element-wise reductions), and hosts the launcher behind `oxccl launch`.

pub use oxccl_comm as comm;
pub use oxccl_kernels as kernels;

pub mod launch;
pub mod perf;
