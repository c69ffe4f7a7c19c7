//! Agreement between ranks before a collective step: each rank's description of its call is
//! compared in one small all-reduce, so that a rank called with another parameter list (or one
//! whose gradients were refused) gets the same error, naming every rank's call, on every rank,
//! instead of the others waiting out a deadline.

use std::collections::BTreeMap;

use oxccl_comm::{Communicator, ReduceOp};

use crate::error::{Result, ZeroError};

/// FNV-1a over `s`'s bytes: a fingerprint ranks can compare.
pub(crate) fn fingerprint(s: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in s.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Compares `call` (this rank's description of its call) across `comm`, a communicator whose
/// ranks are the world's, and `fault` (what this rank refused in the call, if anything).
/// Collective.
///
/// # Errors
/// `InvalidArgument` (rank `rank`, `op`) on every rank alike when the descriptions differ or a
/// rank has a fault, listing each rank's (grouped); the collectives' errors.
pub(crate) fn agree(
    comm: &Communicator,
    rank: usize,
    op: &'static str,
    call: &str,
    fault: Option<&str>,
) -> Result<()> {
    let word = fingerprint(call);
    let mut v = [word, !word, u64::from(fault.is_some())];
    comm.all_reduce(&mut v, ReduceOp::Max)?;
    if v[0] == !v[1] && v[2] == 0 {
        return Ok(());
    }
    let mine = fault.unwrap_or(call);
    let all = comm.all_gather_bytes(mine.as_bytes())?;
    let mut by_text: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (r, bytes) in all.iter().enumerate() {
        let text = String::from_utf8_lossy(bytes).into_owned();
        by_text.entry(text).or_default().push(r);
    }
    let mut groups: Vec<(Vec<usize>, String)> = by_text.into_iter().map(|(t, r)| (r, t)).collect();
    groups.sort();
    let lines: Vec<String> = groups
        .iter()
        .map(|(ranks, text)| format!("{}: {text}", ranks_text(ranks)))
        .collect();
    Err(ZeroError::InvalidArgument {
        rank,
        op,
        msg: format!("the ranks' calls differ; {}", lines.join("; ")),
    })
}

/// "rank 3" or "ranks 0, 2, 5".
fn ranks_text(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    if list.len() == 1 {
        format!("rank {}", list[0])
    } else {
        format!("ranks {}", list.join(", "))
    }
}
