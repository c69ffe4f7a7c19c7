//! Errors of the DDP layer: the communicator's own, and misuse of the reducer named by rank,
//! operation and parameter.

/// What went wrong in a DDP call.
#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    /// A collective underneath failed (peer lost, time-out, mismatch, ...).
    #[error(transparent)]
    Comm(#[from] oxccl_comm::Error),
    /// A call with arguments that cannot be right.
    #[error("rank {rank}: ddp {op}: {msg}")]
    InvalidArgument {
        /// This rank.
        rank: usize,
        /// The DDP call (`new`, `grad_ready`, `sync`, ...).
        op: &'static str,
        /// What was wrong.
        msg: String,
    },
    /// A CUDA call of the device reducer failed (an allocation, a copy, an event, a kernel).
    #[error("rank {rank}: ddp {op}: {msg}")]
    Device {
        /// This rank.
        rank: usize,
        /// The DDP call.
        op: &'static str,
        /// The failed call and the driver's error.
        msg: String,
    },
    /// Parameters that received no gradient in a step (see `DdpConfig::find_unused_parameters`).
    #[error(
        "rank {rank}: ddp finish: {} parameter(s) received no gradient in step {step}: {}; \
         every parameter must get a gradient each step, or set find_unused_parameters to reduce \
         missing ones as zeros",
        names.len(),
        names.join(", ")
    )]
    UnusedParameters {
        /// This rank.
        rank: usize,
        /// The step (0-based count of synchronised steps).
        step: u64,
        /// The parameters, by name.
        names: Vec<String>,
    },
}

/// Result of DDP calls.
pub type Result<T> = std::result::Result<T, DdpError>;
