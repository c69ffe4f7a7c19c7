//! Settings that must be alike on every rank, compared in one small all-reduce, so that a rank
//! set up differently gets an error naming the setting instead of a hang or silently wrong
//! averages.

use oxccl_comm::{Communicator, ReduceOp};

use crate::error::{DdpError, Result};

/// A setting to compare: its name and value, and, for a value that is a fingerprint (of a list,
/// a name), what to show for this rank instead of the number.
pub(crate) struct Setting {
    name: &'static str,
    word: u64,
    shown: Option<String>,
}

impl Setting {
    /// A number, shown as itself with the range across ranks.
    pub(crate) fn number(name: &'static str, word: u64) -> Setting {
        Setting {
            name,
            word,
            shown: None,
        }
    }

    /// A fingerprint of `shown`'s meaning (e.g. a parameter list): the error shows `shown`.
    pub(crate) fn described(name: &'static str, word: u64, shown: String) -> Setting {
        Setting {
            name,
            word,
            shown: Some(shown),
        }
    }
}

/// FNV-1a over the little-endian bytes of `words`: a fingerprint ranks can compare.
pub(crate) fn fnv1a(words: impl IntoIterator<Item = u64>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in words {
        for b in v.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// A fingerprint of `s`'s bytes.
pub(crate) fn fnv1a_str(s: &str) -> u64 {
    fnv1a(s.bytes().map(u64::from).chain([s.len() as u64]))
}

/// Compares `settings` across the ranks of `comm` in one all-reduce (`Max` of every value and
/// of its complement: the largest and the smallest value), which also takes the maximum of
/// `extra` in place. Collective: every rank calls it at the same point with as many settings.
///
/// # Errors
/// `InvalidArgument` (this rank, `op`) naming every setting that differs, on every rank alike;
/// the all-reduce's errors.
pub(crate) fn agree(
    comm: &Communicator,
    op: &'static str,
    settings: &[Setting],
    extra: &mut [u64],
) -> Result<()> {
    let differing = differing(comm, settings, extra)?;
    if differing.is_empty() {
        return Ok(());
    }
    let msg: Vec<String> = differing.into_iter().map(|(_, m)| m).collect();
    Err(DdpError::InvalidArgument {
        rank: comm.rank(),
        op,
        msg: msg.join("; "),
    })
}

/// [`agree`]'s comparison: each setting that differs between the ranks (its index, and what
/// to say about it), the same on every rank.
pub(crate) fn differing(
    comm: &Communicator,
    settings: &[Setting],
    extra: &mut [u64],
) -> Result<Vec<(usize, String)>> {
    let n = settings.len();
    let mut words: Vec<u64> = settings.iter().map(|s| s.word).collect();
    words.extend(settings.iter().map(|s| !s.word));
    words.extend_from_slice(extra);
    comm.all_reduce(&mut words, ReduceOp::Max)?;
    extra.copy_from_slice(&words[2 * n..]);
    Ok(settings
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let (max, min) = (words[i], !words[n + i]);
            let msg = match &s.shown {
                None => format!(
                    "{} differs between ranks: {} here, from {min} to {max} across the ranks",
                    s.name, s.word
                ),
                Some(shown) => format!("{} differs between ranks: this rank has {shown}", s.name),
            };
            (max != min).then_some((i, msg))
        })
        .collect())
}
