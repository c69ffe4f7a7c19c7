//! Post-local SGD (PyTorch's `post_localSGD_hook` with `PeriodicModelAverager`): after a warm-up
//! of ordinary data-parallel steps, gradients are averaged only within a group of ranks (usually
//! the ranks of one node, over shared memory), and the parameters across every rank once every
//! `period` steps. Between averagings the groups' replicas drift apart; inside a group they stay
//! bit-identical. On a slow link between nodes this sends one all-reduce of the parameters per
//! `period` steps across it instead of one of the gradients per step. [`HierarchicalAverager`]
//! averages several tiers of groups, each at its own period.
//!
//! ```no_run
//! use oxccl_comm::Communicator;
//! use oxccl_ddp::{Ddp, DdpConfig, ModelAverager, Param, PostLocalSgd};
//!
//! # fn backward(_w: &[f32]) -> Vec<f32> { vec![0.0; 4] }
//! let comm = Communicator::from_env()?;
//! let mut w = vec![0.5f32; 4];
//! let mut ddp = Ddp::new(&comm, &mut [Param::new("w", &mut w)], DdpConfig::default())?;
//! // The ranks of each node form a group; local SGD from step 100.
//! ddp.set_comm_hook(PostLocalSgd::intra_node(&comm, 100)?)?;
//! let mut averager = ModelAverager::new(4, 100); // every 4 steps from step 100
//! for _step in 0..1000 {
//!     let mut grads = [backward(&w)];
//!     ddp.sync(&mut grads)?; // the node's average after step 100, everyone's before
//!     w.iter_mut().zip(&grads[0]).for_each(|(x, g)| *x -= 0.1 * g);
//!     averager.average(&comm, &mut [&mut w])?; // every rank's parameters, when due
//! }
//! # Ok::<(), oxccl_ddp::DdpError>(())
//! ```
//!
//! The hook is in `post_local`, the averagers in `averager` and `hierarchical`, and the packing
//! of parameters into all-reduces that both averagers use in `packer`; this file maps the
//! errors of a group's collectives to the ranks of the communicator it was split from.

use oxccl_comm::Error as CommError;

use crate::error::DdpError;

mod averager;
mod hierarchical;
mod packer;
mod post_local;

pub use averager::ModelAverager;
pub use hierarchical::HierarchicalAverager;
pub use post_local::PostLocalSgd;

/// `e`, from the group's collectives, with the group's ranks replaced by those of the
/// communicator the group was made from (`members`; this rank is `rank` there). `who` begins
/// the note and says which communicator that is (DDP's, for the hook).
fn in_comm(e: DdpError, members: &[usize], rank: usize, who: &str) -> DdpError {
    let peer = |p: usize| members.get(p).copied().unwrap_or(p);
    let note = |s: String| {
        format!(
            "{s} ({who}; other ranks named in it are the group's, group rank i being rank \
             members[i] there, members = {members:?})"
        )
    };
    let e = match e {
        DdpError::Comm(e) => e,
        DdpError::InvalidArgument { op, msg, .. } => {
            return DdpError::InvalidArgument {
                rank,
                op,
                msg: note(msg),
            }
        }
        other => return other,
    };
    DdpError::Comm(match e {
        CommError::PeerLost {
            peer: p,
            op,
            detail,
            ..
        } => CommError::PeerLost {
            rank,
            peer: peer(p),
            op,
            detail: note(detail),
        },
        CommError::Mismatch {
            peer: p,
            seq,
            local,
            remote,
            ..
        } => CommError::Mismatch {
            rank,
            peer: peer(p),
            seq,
            local: note(local),
            remote,
        },
        CommError::Timeout {
            op,
            timeout,
            detail,
            ..
        } => CommError::Timeout {
            rank,
            op,
            timeout,
            detail: note(detail),
        },
        CommError::Aborted { reason, .. } => CommError::Aborted {
            rank,
            reason: note(reason),
        },
        CommError::Transport {
            peer: p,
            transport,
            msg,
            ..
        } => CommError::Transport {
            rank,
            peer: peer(p),
            transport,
            msg: note(msg),
        },
        CommError::InvalidArgument { op, msg, .. } => CommError::InvalidArgument {
            rank,
            op,
            msg: note(msg),
        },
        CommError::Cuda { op, msg, .. } => CommError::Cuda {
            rank,
            op,
            msg: note(msg),
        },
        other => other,
    })
}
