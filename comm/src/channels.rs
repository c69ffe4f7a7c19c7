//! Channels: independent sets of connections, each driven by a thread of its own
//! (`OXCCL_SOCKET_CHANNELS`, [`crate::Config::socket_channels`]).
//!
//! Over TCP a rank's thread does the kernel's copies into and out of its sockets itself, so one
//! thread bounds a rank's rate however many sockets it has. A communicator with TCP peers and
//! `k > 1` channels keeps `k - 1` more communicators of the same ranks (ids `<id>/ch<i>`, made at
//! init through the store, each with its own connections: TCP across, shared memory inside a node
//! as for the parent) and a pool of `k - 1` threads. An all-reduce of at least two parts of
//! [`CHANNEL_PART_MIN`] bytes is cut into `m = min(k, bytes / CHANNEL_PART_MIN)` contiguous parts
//! (multiples of 64 bytes but the last): part 0 runs on the parent's connections on the calling
//! thread, part `i` on channel `i`'s on a pool thread, all at once. Every rank cuts alike (the
//! same bytes, and `OXCCL_SOCKET_CHANNELS` is checked equal at init), so each channel sees the
//! same operations in the same order on every rank; each part is an ordinary all-reduce of its
//! communicator (its own tuner choice and sequence numbers).
//!
//! Failure: the first part to fail publishes its error as the parent's failure (a cause another
//! rank published first stands instead), then stops the others (the parent's part through its
//! abort flag, the channels through [`Communicator::abort`]), so a lost peer or a mismatch ends
//! the whole call at once on every rank, and every rank reports the same cause. The parent is
//! then broken like after any failed operation; [`Communicator::abort`] reaches the channels
//! too.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use oxccl_kernels::{DType, ReduceOp};

use crate::communicator::Communicator;
use crate::engine::Shared;
use crate::error::{Error, Result};

/// Smallest part of an all-reduce that a channel carries: smaller all-reduces use fewer channels
/// (below two parts, only the parent's connections).
pub const CHANNEL_PART_MIN: usize = 1 << 20;

/// A channel's part of a cut operation, run on that channel's communicator.
type Part<'p> = Box<dyn FnOnce(&Communicator) -> Result<()> + Send + 'p>;

/// The extra channels of a communicator and the threads that drive them.
pub(crate) struct Channels {
    /// Channels 1..k (channel 0 is the communicator itself).
    pub comms: Vec<Communicator>,
    pool: rayon::ThreadPool,
    /// Operations cut across the channels.
    pub ops: AtomicU64,
}

impl Channels {
    pub(crate) fn new(rank: usize, comms: Vec<Communicator>) -> Result<Channels> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(comms.len().max(1))
            .thread_name(move |i| format!("oxccl-ch{}-r{rank}", i + 1))
            .build()
            .map_err(|e| {
                Error::Config(format!(
                    "rank {rank}: init: could not start the channel threads \
                     (OXCCL_SOCKET_CHANNELS): {e}"
                ))
            })?;
        Ok(Channels {
            comms,
            pool,
            ops: AtomicU64::new(0),
        })
    }

    /// Aborts every channel (their running operations fail at once, and peers learn).
    pub(crate) fn abort(&self) {
        for c in &self.comms {
            c.abort();
        }
    }
}

/// The byte ranges an operation of `bytes` bytes is cut into over `channels` channels
/// (`channels` counts the parent), or `None` when it stays whole: fewer than two parts of
/// [`CHANNEL_PART_MIN`]. Parts are multiples of 64 bytes (so of every element size) but the last,
/// which takes the rest.
pub(crate) fn parts(bytes: usize, channels: usize) -> Option<Vec<Range<usize>>> {
    let m = channels.min(bytes / CHANNEL_PART_MIN);
    if m < 2 {
        return None;
    }
    let each = (bytes / m) / 64 * 64;
    Some(
        (0..m)
            .map(|i| i * each..if i + 1 == m { bytes } else { (i + 1) * each })
            .collect(),
    )
}

/// Cuts `buf` (and `src`, indexed alike) at `parts`.
fn cut<'b>(mut buf: &'b mut [u8], parts: &[Range<usize>]) -> Vec<&'b mut [u8]> {
    let mut out = Vec::with_capacity(parts.len());
    for p in parts {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(p.len());
        out.push(head);
        buf = tail;
    }
    out
}

/// The communicator a cut operation runs on: where its failure is published, and the flag that
/// stops its own part.
pub(crate) struct Owner<'a> {
    pub shared: &'a Shared,
    pub abort: &'a AtomicBool,
}

/// Runs `first` (the parent's part, on this thread) and `rest[i]` on channel `i + 1` (on the
/// pool) at once. The first failure is published as the parent's (before anything closes, so
/// that peers who see a channel's connections close read the cause, as after any failure), then
/// stops the other parts; the call returns the cause that stands.
pub(crate) fn run_parts(
    ch: &Channels,
    owner: &Owner<'_>,
    first: impl FnOnce() -> Result<()>,
    rest: Vec<Part<'_>>,
) -> Result<()> {
    ch.ops.fetch_add(1, Ordering::Relaxed);
    let cause: Mutex<Option<Error>> = Mutex::new(None);
    let stop_all = |e: Error| {
        let mut c = cause.lock().unwrap_or_else(|p| p.into_inner());
        if c.is_some() {
            return;
        }
        let e = match e {
            e @ Error::InvalidArgument { .. } => e,
            e => owner.shared.publish_error(e),
        };
        *c = Some(e);
        drop(c);
        owner.abort.store(true, Ordering::Relaxed);
        ch.abort();
    };
    ch.pool.in_place_scope(|sc| {
        for (i, job) in rest.into_iter().enumerate() {
            let comm = &ch.comms[i];
            let stop_all = &stop_all;
            sc.spawn(move |_| {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(comm)))
                    .unwrap_or_else(|_| {
                        Err(Error::Aborted {
                            rank: comm.rank(),
                            reason: format!("channel {}: the channel thread panicked", i + 1),
                        })
                    });
                if let Err(e) = r {
                    stop_all(e);
                }
            });
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(first)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => stop_all(e),
            Err(p) => {
                // Stop the channels before unwinding on (the scope waits for them).
                ch.abort();
                std::panic::resume_unwind(p);
            }
        }
    });
    match cause.into_inner().unwrap_or_else(|p| p.into_inner()) {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

/// A mismatch a channel found, told as the caller's: its operation number and call on the
/// parent (`call`), with the parts the channel compared. (Every rank cuts a call alike, so
/// parts differ only where the calls do.)
fn as_the_callers(e: Error, channel: usize, call: Option<(u64, String)>) -> Error {
    match (e, call) {
        (
            Error::Mismatch {
                rank,
                peer,
                local,
                remote,
                ..
            },
            Some((seq, desc)),
        ) => Error::Mismatch {
            rank,
            peer,
            seq,
            local: desc,
            remote: format!(
                "a different call (channel {channel} of OXCCL_SOCKET_CHANNELS compared this \
                 rank's part, {local}, with rank {peer}'s, {remote})"
            ),
        },
        (e, _) => e,
    }
}

/// An all-reduce of `buf` (`src` the out-of-place input, indexed alike) cut at `parts`: part 0
/// by `first(src0, buf0)` on this thread, the others on the channels. `call` is the parent's
/// operation number and call, for the errors.
#[allow(clippy::too_many_arguments)]
pub(crate) fn all_reduce(
    ch: &Channels,
    owner: &Owner<'_>,
    parts: &[Range<usize>],
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    call: Option<(u64, String)>,
    first: impl FnOnce(Option<&[u8]>, &mut [u8]) -> Result<()>,
) -> Result<()> {
    let mut bufs = cut(buf, parts).into_iter();
    let srcs: Vec<Option<&[u8]>> = parts.iter().map(|p| src.map(|s| &s[p.clone()])).collect();
    let (b0, s0) = (bufs.next().unwrap_or_default(), srcs[0]);
    let rest: Vec<Part<'_>> = bufs
        .zip(srcs[1..].iter().copied())
        .enumerate()
        .map(|(i, (b, s))| {
            let call = call.clone();
            Box::new(move |c: &Communicator| {
                c.all_reduce_raw(s, b, dt, op)
                    .map_err(|e| as_the_callers(e, i + 1, call))
            }) as Part<'_>
        })
        .collect();
    run_parts(ch, owner, move || first(s0, b0), rest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_buffer_in_whole_lines_and_need_two_of_the_minimum() {
        assert_eq!(parts(CHANNEL_PART_MIN * 2 - 1, 4), None);
        assert_eq!(parts(64 << 20, 1), None);
        for (bytes, k) in [
            (CHANNEL_PART_MIN * 2, 4),
            (CHANNEL_PART_MIN * 3 + 12, 4),
            ((64 << 20) + 4, 4),
            ((64 << 20) + 6, 3),
            (5 << 20, 16),
        ] {
            let p = parts(bytes, k).unwrap();
            assert_eq!(p.len(), k.min(bytes / CHANNEL_PART_MIN), "{bytes} {k}");
            assert_eq!(p[0].start, 0);
            assert_eq!(p.last().unwrap().end, bytes);
            for w in p.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert_eq!(w[0].len() % 64, 0, "{bytes} {k}: {p:?}");
                assert!(w[0].len() >= CHANNEL_PART_MIN - 64, "{bytes} {k}: {p:?}");
            }
        }
    }
}
