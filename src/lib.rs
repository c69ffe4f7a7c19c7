//! oxccl: collective communication for Rust trainers.
//!
//! This facade re-exports the workspace crates: [`comm`] (communicators, rendezvous, transports,
//! algorithms), [`kernels`] (element-wise reductions) and [`ddp`] (data-parallel gradient
//! reducer), and hosts the launcher behind `oxccl launch`.

pub use oxccl_comm as comm;
pub use oxccl_ddp as ddp;
pub use oxccl_kernels as kernels;

pub mod launch;
pub mod perf;
pub mod trace;
