//! The one error type of oxccl-comm.

use std::time::Duration;

/// Result alias used throughout oxccl-comm.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in a communicator, a store or a transport.
///
/// Variants carry the rank that saw the error, the peer involved and the operation, so a log line
/// from any rank says what went wrong where.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A caller passed something that does not fit the operation; nothing was sent.
    #[error("rank {rank}: {op}: invalid argument: {msg}")]
    InvalidArgument {
        /// Rank that rejected the call.
        rank: usize,
        /// Operation (e.g. `reduce_scatter`).
        op: String,
        /// What was wrong.
        msg: String,
    },
    /// Ranks called different collectives (or counts, dtypes, roots) at the same sequence number.
    #[error("rank {rank}: collective mismatch at op #{seq}: this rank called {local}, rank {peer} called {remote}")]
    Mismatch {
        /// Rank that detected the mismatch.
        rank: usize,
        /// The other side.
        peer: usize,
        /// Sequence number of the operation on this communicator.
        seq: u64,
        /// Description of the call on `rank`.
        local: String,
        /// Description of the call on `peer`.
        remote: String,
    },
    /// A peer died or closed its connection.
    #[error("rank {rank}: peer rank {peer} lost during {op}: {detail}")]
    PeerLost {
        /// Rank that noticed the loss.
        rank: usize,
        /// The rank that was lost.
        peer: usize,
        /// Operation in progress.
        op: String,
        /// How it was noticed (EOF, reset, time-out...).
        detail: String,
    },
    /// A wait passed its deadline.
    #[error("rank {rank}: {op}: timed out after {timeout:?} ({detail})")]
    Timeout {
        /// Rank that timed out.
        rank: usize,
        /// What was being waited for.
        op: String,
        /// The deadline that passed.
        timeout: Duration,
        /// What was pending.
        detail: String,
    },
    /// `abort()` was called on this communicator (or a peer aborted it).
    #[error("rank {rank}: communicator aborted: {reason}")]
    Aborted {
        /// Rank that observed the abort.
        rank: usize,
        /// Why.
        reason: String,
    },
    /// A transport-level failure (socket error, mapping failure...).
    #[error("rank {rank}: transport {transport} to peer {peer}: {msg}")]
    Transport {
        /// Local rank.
        rank: usize,
        /// Remote rank.
        peer: usize,
        /// Backend name (`tcp`, `shm`, ...).
        transport: &'static str,
        /// What failed.
        msg: String,
    },
    /// A CUDA driver call failed (feature `cuda`).
    #[error("rank {rank}: {op}: CUDA: {msg}")]
    Cuda {
        /// Rank that made the call.
        rank: usize,
        /// Operation in progress.
        op: String,
        /// The call and the driver's error.
        msg: String,
    },
    /// Rendezvous store failure.
    #[error("store: {0}")]
    Store(String),
    /// Configuration or environment problem (bad variable, missing launcher variables).
    #[error("config: {0}")]
    Config(String),
    /// Underlying I/O error that has no better home.
    #[error("i/o: {0}")]
    Io(String),
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}

impl Error {
    /// The rank of a peer this error blames, if any (`PeerLost`).
    pub fn lost_peer(&self) -> Option<usize> {
        match self {
            Error::PeerLost { peer, .. } => Some(*peer),
            _ => None,
        }
    }

    /// Short, stable code naming the variant (used when an error crosses process boundaries).
    pub fn kind(&self) -> &'static str {
        match self {
            Error::InvalidArgument { .. } => "invalid-argument",
            Error::Mismatch { .. } => "mismatch",
            Error::PeerLost { .. } => "peer-lost",
            Error::Timeout { .. } => "timeout",
            Error::Aborted { .. } => "aborted",
            Error::Transport { .. } => "transport",
            Error::Cuda { .. } => "cuda",
            Error::Store(_) => "store",
            Error::Config(_) => "config",
            Error::Io(_) => "io",
        }
    }
}
