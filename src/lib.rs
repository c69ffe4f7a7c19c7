//! oxccl: collective communication for Rust trainers.
//!
//! This facade re-exports the workspace crates: [`comm`] (communicators, rendezvous, transports,
//! algorithms), [`kernels`] (element-wise reductions), [`ddp`] (data-parallel gradient
//! reducer), [`zero`] (node-local ZeRO, the sharded optimizer) and [`pipeline`] (pipeline
//! parallelism: schedules and their runtime). The command-line tool (`oxccl launch`, `perf`,
//! `topo`, `trace`, `pipeline`) is the `oxccl` binary of this package.

pub use oxccl_comm as comm;
pub use oxccl_ddp as ddp;
pub use oxccl_kernels as kernels;
pub use oxccl_pipeline as pipeline;
pub use oxccl_zero as zero;

/// The README's API screen, compiled by `cargo test --doc` so that it stays true to the code.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeApiScreen;
