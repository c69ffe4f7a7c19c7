//! Errors of the sharded optimizer.

/// What went wrong in a ZeRO call.
#[derive(Debug, thiserror::Error)]
pub enum ZeroError {
    /// A collective underneath failed (peer lost, time-out, mismatch, ...).
    #[error(transparent)]
    Comm(#[from] oxccl_comm::Error),
    /// A call with arguments that cannot be right.
    #[error("rank {rank}: zero {op}: {msg}")]
    InvalidArgument {
        /// This rank (of the world communicator).
        rank: usize,
        /// The call (`new`, `step`).
        op: &'static str,
        /// What was wrong.
        msg: String,
    },
    /// A checkpoint file that cannot be read or written, or is not what it should be.
    #[error("zero checkpoint {}: {msg}", path.display())]
    Checkpoint {
        /// The file (or directory).
        path: std::path::PathBuf,
        /// What is wrong.
        msg: String,
    },
}

/// Results of ZeRO calls.
pub type Result<T> = std::result::Result<T, ZeroError>;
