//! The base layer: rendezvous, configuration, tuning, tracing, errors and the operation
//! descriptions every other layer shares.

pub mod affinity;
pub mod bootstrap;
pub mod buffer;
pub(crate) mod call;
pub mod config;
pub mod error;
pub mod logging;
pub mod op;
pub(crate) mod settings;
pub(crate) mod shared_mem;
pub(crate) mod stall;
pub mod sys;
pub mod trace;
pub mod tuning;
