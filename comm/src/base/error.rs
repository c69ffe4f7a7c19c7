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

/// How a communicator made from another (by `split` or `shrink`, at any depth) names its ranks
/// in the communicator they all come from, its world: added to every error it reports, so a
/// message from a group says which ranks of the job it means.
#[derive(Debug)]
pub(crate) struct WorldNames {
    /// This communicator's id.
    comm: String,
    /// The world's id.
    world: String,
    /// The world rank of each rank of this communicator.
    ranks: Vec<usize>,
}

/// `e` with the note of `names` ([`WorldNames::name`]), or as it is without names.
pub(crate) fn named(names: Option<&WorldNames>, e: Error) -> Error {
    match names {
        Some(n) => n.name(e),
        None => e,
    }
}

/// Most ranks a note lists one by one; a larger communicator's note names only the error's
/// ranks.
const NOTE_LIST_MAX: usize = 16;

impl WorldNames {
    /// The names of communicator `comm`, whose rank `i` is rank `ranks[i]` of `world`; `None`
    /// when its ranks are the world's (nothing to say).
    pub(crate) fn new(comm: &str, world: &str, ranks: &[usize]) -> Option<WorldNames> {
        if ranks.iter().enumerate().all(|(i, &r)| i == r) {
            return None;
        }
        Some(WorldNames {
            comm: comm.to_string(),
            world: world.to_string(),
            ranks: ranks.to_vec(),
        })
    }

    /// The note for an error naming `named` ranks of this communicator.
    fn note(&self, named: &[usize]) -> String {
        let world = |r: usize| self.ranks.get(r).copied();
        if let [only] = self.ranks[..] {
            return format!(
                "(ranks named here are of communicator {}; its rank 0 is rank {only} of {})",
                self.comm, self.world
            );
        }
        if self.ranks.len() <= NOTE_LIST_MAX {
            return format!(
                "(ranks named here are of communicator {}; its ranks 0-{} are ranks {:?} of {})",
                self.comm,
                self.ranks.len() - 1,
                self.ranks,
                self.world
            );
        }
        let mut seen: Vec<usize> = Vec::new();
        let pairs: Vec<String> = named
            .iter()
            .filter(|&&r| {
                let new = !seen.contains(&r);
                seen.push(r);
                new
            })
            .filter_map(|&r| world(r).map(|w| format!("its rank {r} is rank {w}")))
            .collect();
        format!(
            "(ranks named here are of communicator {} of {} ranks; {} of {})",
            self.comm,
            self.ranks.len(),
            pairs.join(", "),
            self.world
        )
    }

    /// `e` with the note appended to its text (once: an error already carrying it is returned
    /// as it is). `Store`, `Config` and `Io` errors name no rank and are left alone.
    pub(crate) fn name(&self, e: Error) -> Error {
        let add = |s: String, named: &[usize]| {
            let note = self.note(named);
            if s.contains(&note) {
                s
            } else {
                format!("{s} {note}")
            }
        };
        match e {
            Error::InvalidArgument { rank, op, msg } => Error::InvalidArgument {
                rank,
                op,
                msg: add(msg, &[rank]),
            },
            Error::Mismatch {
                rank,
                peer,
                seq,
                local,
                remote,
            } => Error::Mismatch {
                rank,
                peer,
                seq,
                local,
                remote: add(remote, &[rank, peer]),
            },
            Error::PeerLost {
                rank,
                peer,
                op,
                detail,
            } => Error::PeerLost {
                rank,
                peer,
                op,
                detail: add(detail, &[rank, peer]),
            },
            Error::Timeout {
                rank,
                op,
                timeout,
                detail,
            } => Error::Timeout {
                rank,
                op,
                timeout,
                detail: add(detail, &[rank]),
            },
            Error::Aborted { rank, reason } => Error::Aborted {
                rank,
                reason: add(reason, &[rank]),
            },
            Error::Transport {
                rank,
                peer,
                transport,
                msg,
            } => Error::Transport {
                rank,
                peer,
                transport,
                msg: add(msg, &[rank, peer]),
            },
            Error::Cuda { rank, op, msg } => Error::Cuda {
                rank,
                op,
                msg: add(msg, &[rank]),
            },
            e @ (Error::Store(_) | Error::Config(_) | Error::Io(_)) => e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_communicator_needs_no_names() {
        assert!(WorldNames::new("job/world0", "job/world0", &[0, 1, 2]).is_none());
        // A split keeping every rank in order names nothing either.
        assert!(WorldNames::new("job/world0/split0/c0", "job/world0", &[0, 1]).is_none());
    }

    #[test]
    fn a_small_group_lists_its_world_ranks_once() {
        let w = WorldNames::new("job/world0/split0/c1", "job/world0", &[5, 3, 1]).unwrap();
        let e = w.name(Error::PeerLost {
            rank: 0,
            peer: 2,
            op: "all_reduce".into(),
            detail: "EOF".into(),
        });
        assert_eq!(
            e.to_string(),
            "rank 0: peer rank 2 lost during all_reduce: EOF (ranks named here are of \
             communicator job/world0/split0/c1; its ranks 0-2 are ranks [5, 3, 1] of job/world0)"
        );
        assert_eq!(e.lost_peer(), Some(2), "the fields keep the group's ranks");
        let again = w.name(e.clone());
        assert_eq!(again.to_string(), e.to_string(), "named once");
        let one = WorldNames::new("job/world0/shrink0", "job/world0", &[2]).unwrap();
        let e = one.name(Error::Aborted {
            rank: 0,
            reason: "abort() was called".into(),
        });
        assert!(
            e.to_string()
                .ends_with("its rank 0 is rank 2 of job/world0)"),
            "{e}"
        );
        let store = w.name(Error::Store("gone".into()));
        assert_eq!(store.to_string(), "store: gone");
    }

    #[test]
    fn a_large_group_names_the_errors_ranks() {
        let ranks: Vec<usize> = (0..20).map(|r| 2 * r + 1).collect();
        let w = WorldNames::new("job/world0/split0/c1", "job/world0", &ranks).unwrap();
        let e = w.name(Error::Mismatch {
            rank: 4,
            peer: 17,
            seq: 9,
            local: "all_reduce".into(),
            remote: "broadcast".into(),
        });
        let msg = e.to_string();
        assert!(
            msg.ends_with(
                "rank 17 called broadcast (ranks named here are of communicator \
                 job/world0/split0/c1 of 20 ranks; its rank 4 is rank 9, its rank 17 is rank \
                 35 of job/world0)"
            ),
            "{msg}"
        );
        let t = w.name(Error::Timeout {
            rank: 4,
            op: "barrier".into(),
            timeout: Duration::from_secs(1),
            detail: "waiting".into(),
        });
        assert!(
            t.to_string()
                .ends_with("its rank 4 is rank 9 of job/world0))"),
            "{t}"
        );
    }
}
