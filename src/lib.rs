//! oxccl: collective communication for Rust trainers.
//!
//! This facade re-exports the workspace crates: [`comm`] (communicators, rendezvous, transports,
//! algorithms), [`kernels`] (element-wise reductions), [`ddp`] (data-parallel gradient
//! reducer), [`zero`] (node-local ZeRO, the sharded optimizer) and [`pipeline`] (pipeline
//! parallelism: schedules and their runtime). The command-line tool (`oxccl launch`, `perf`,
//! `topo`, `trace`, `pipeline`) is the `oxccl` binary of this package.
//!
//! The communicator, its configuration and the element types are also here at the top:
//!
//! ```no_run
//! use std::time::Duration;
//! use oxccl::comm::config::Settings;
//! use oxccl::{bf16, Communicator, ReduceOp};
//!
//! oxccl::logging::init(); // oxccl's own log lines, at OXCCL_DEBUG's level (or use yours)
//! // Settings in code win over their OXCCL_* variables; the environment gives the rest.
//! let comm = Communicator::from_env_with(Settings::new().timeout(Duration::from_secs(60)))?;
//! let mut grads = vec![bf16::from_f32(1.0); 1024];
//! comm.all_reduce(&mut grads, ReduceOp::Avg)?;
//! # Ok::<(), oxccl::Error>(())
//! ```

pub use oxccl_comm as comm;
pub use oxccl_ddp as ddp;
pub use oxccl_kernels as kernels;
pub use oxccl_pipeline as pipeline;
pub use oxccl_zero as zero;

pub use oxccl_comm::logging;
pub use oxccl_comm::{Communicator, Config, Error, ReduceOp, Result, Topology};
pub use oxccl_kernels::{bf16, f16, DType, Element, F8E4M3, F8E5M2};

/// The README's API screen, compiled by `cargo test --doc` so that it stays true to the code.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeApiScreen;
