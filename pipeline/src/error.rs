//! The pipeline's errors: each names the rank, the stage and what it was doing.

use crate::schedule::{Dir, ScheduleError};

/// A boxed error from the user's stage code.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What went wrong in a pipeline step.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// The schedule could not be made.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// The pipeline was set up wrong (names what).
    #[error("rank {rank}: pipeline: {what}")]
    Invalid {
        /// This rank of the pipeline's communicator.
        rank: usize,
        /// What is wrong.
        what: String,
    },
    /// The user's forward or backward failed.
    #[error("rank {rank} (stage {stage}): {action} failed: {source}")]
    Stage {
        /// This rank.
        rank: usize,
        /// The stage (chunk `c` of rank `r` is stage `c p + r`).
        stage: usize,
        /// The computation, e.g. `forward of micro-batch 3`.
        action: String,
        /// The stage's error.
        source: BoxError,
    },
    /// A stage received tensors it does not take: raised on the receiver and on the sender.
    #[error("rank {rank} (stage {stage}): {what}")]
    Refused {
        /// This rank.
        rank: usize,
        /// This rank's stage in the exchange.
        stage: usize,
        /// The whole story: who sent what to whom, and why it was refused.
        what: String,
    },
    /// An exchange with a neighbouring stage failed (a lost peer, a time-out, an abort).
    #[error("rank {rank}: pipeline exchange ({what}) failed: {source}")]
    Comm {
        /// This rank.
        rank: usize,
        /// The exchange, e.g. `send Act of micro-batch 2 to rank 1`.
        what: String,
        /// The communicator's error.
        source: oxccl_comm::Error,
    },
    /// A CUDA call of the pipeline failed (feature `cuda`: allocating a received tensor,
    /// making the exchange stream).
    #[error("rank {rank}: pipeline: CUDA: {what}")]
    Device {
        /// This rank.
        rank: usize,
        /// The call and its error.
        what: String,
    },
    /// The two ends of an exchange disagree in a way the protocol does not allow.
    #[error("rank {rank}: pipeline protocol: {what}")]
    Protocol {
        /// This rank.
        rank: usize,
        /// What disagreed.
        what: String,
    },
}

/// The direction's name in messages.
pub(crate) fn dir_name(d: Dir) -> &'static str {
    match d {
        Dir::Act => "activations",
        Dir::Grad => "gradients",
    }
}
