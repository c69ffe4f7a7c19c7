//! Channels: independent sets of connections, each driven by a thread of its own
//! (`OXCCL_SOCKET_CHANNELS`, [`crate::Config::socket_channels`]).
//!
//! Over TCP a rank's thread does the kernel's copies into and out of its sockets itself, so one
//! thread bounds a rank's rate however many sockets it has. A communicator with TCP peers and
//! `k > 1` channels keeps `k - 1` more communicators of the same ranks (ids `<id>/ch<i>`, made at
//! the end of its init through the store, one after another, each with its own connections: TCP
//! across, shared memory inside a node as for the parent), and one thread per extra channel. An
//! all-reduce, broadcast or reduce of at least two parts of [`CHANNEL_PART_MIN`] bytes is cut into
//! `m = min(k, bytes / CHANNEL_PART_MIN)` contiguous parts (multiples of 64 bytes but the last):
//! part 0 runs on the parent's connections on the thread that runs the operation, with the
//! tuner's choice for the whole call; part `i` runs as an ordinary operation of channel `i`
//! (its own tuner choice for the part, its own sequence numbers) on that channel's thread, all at
//! once. Every rank cuts alike (the same bytes, and the same channels: `OXCCL_SOCKET_CHANNELS` is
//! checked equal at init, and `auto` is resolved from the records every rank exchanged), and only the parent's running operation uses the channels, so each channel sees the
//! same operations in the same order on every rank.
//!
//! Failure: a channel publishes its failures under the parent's key (`<id>/error`), a mismatch
//! told as the caller's call (`as_the_callers`), before it closes its connections, as any
//! communicator does; the parent's part publishes its own failure before it stops anything.
//! The first failure then stops the others (the parent's part through its abort flag, the
//! channels through [`Communicator::abort`]), so a lost peer or a mismatch ends the whole call at
//! once on every rank, and every rank reports the same cause. The parent is then broken like
//! after any failed operation; a failure of the parent outside a cut operation, and
//! [`Communicator::abort`], close the channels too.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::{Engine, Shared};
use crate::algorithm::prims::{Ctx, Split, Whole};
use crate::base::error::{Error, Result};
use crate::base::op::OpDesc;
use crate::base::tuning::Choice;

/// Smallest part of an operation that a channel carries: smaller operations use fewer channels
/// (below two parts, only the parent's connections).
pub const CHANNEL_PART_MIN: usize = 1 << 20;

/// A channel's part of a cut operation, run on that channel's communicator.
type Part<'p> = Box<dyn FnOnce(&Shared) -> Result<()> + Send + 'p>;

/// How a channel runs its part of a cut operation: on its engine, with its part of the input
/// (out of place) and of the buffer.
type RunPart<'a> = dyn Fn(&Shared, Option<&[u8]>, &mut [u8]) -> Result<()> + Sync + 'a;

/// The extra channels of a communicator and the threads that drive them.
pub(crate) struct Channels {
    /// Channels 1..k (channel 0 is the communicator itself).
    pub comms: Vec<Engine>,
    /// One pool of one thread per channel: a thread that waits inside a part (on the send
    /// thread, `OXCCL_SOCKET_SEND_THREAD`) may run other jobs of its own pool meanwhile, and
    /// its pool holds no other part.
    pools: Vec<rayon::ThreadPool>,
    /// Operations cut across the channels.
    pub ops: AtomicU64,
}

/// Starts the threads of `n` channels (`oxccl-ch<i>-r<rank>`).
pub(crate) fn pools(rank: usize, n: usize) -> Result<Vec<rayon::ThreadPool>> {
    (1..=n)
        .map(|i| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .thread_name(move |_| format!("oxccl-ch{i}-r{rank}"))
                .build()
                .map_err(|e| {
                    Error::Config(format!(
                        "rank {rank}: init: could not start the thread of channel {i} \
                         (OXCCL_SOCKET_CHANNELS): {e}"
                    ))
                })
        })
        .collect()
}

impl Channels {
    pub(crate) fn new(comms: Vec<Engine>, pools: Vec<rayon::ThreadPool>) -> Channels {
        Channels {
            comms,
            pools,
            ops: AtomicU64::new(0),
        }
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
fn parts(bytes: usize, channels: usize) -> Option<Vec<Range<usize>>> {
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

/// Cuts `buf` at `parts`.
fn cut<'b>(mut buf: &'b mut [u8], parts: &[Range<usize>]) -> Vec<&'b mut [u8]> {
    let mut out = Vec::with_capacity(parts.len());
    for p in parts {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(p.len());
        out.push(head);
        buf = tail;
    }
    out
}

/// Runs `first` (the parent's part, on this thread) and `rest[i]` on channel `i + 1` (on its
/// thread) at once, for the communicator `owner` (its abort flag stops the parent's part). The first failure's cause is published (a channel's own `fail` has done so
/// already, under the parent's key, before it closed its connections; the shared record makes
/// this a no-op then), then the other parts are stopped; the call returns the cause that
/// stands. An `InvalidArgument` alone stops nothing: every part of every rank meets it alike,
/// and it breaks no communicator; a real failure after it replaces it.
fn run_parts(
    ch: &Channels,
    owner: &Shared,
    first: impl FnOnce() -> Result<()>,
    rest: Vec<Part<'_>>,
) -> Result<()> {
    ch.ops.fetch_add(1, Ordering::Relaxed);
    let cause: Mutex<Option<Error>> = Mutex::new(None);
    let stop_all = |e: Error| {
        let mut c = cause.lock().unwrap_or_else(|p| p.into_inner());
        let invalid = |e: &Error| matches!(e, Error::InvalidArgument { .. });
        // An `InvalidArgument` stands only until a real failure comes.
        if c.as_ref().is_some_and(|c| !invalid(c)) {
            return;
        }
        if invalid(&e) {
            c.get_or_insert(e);
            return;
        }
        // A channel that failed through its own `fail` published already (the record is
        // shared): this returns that cause without asking the store again.
        *c = Some(owner.publish_error(e));
        drop(c);
        owner.abort.store(true, Ordering::Relaxed);
        ch.abort();
    };
    nest(
        &ch.pools,
        &ch.comms,
        rest.into_iter().collect(),
        &stop_all,
        || {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(first)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => stop_all(e),
                Err(p) => {
                    // Stop the channels (the scopes wait for them) with the cause the turn's end
                    // will report, then unwind on.
                    let e = Error::Aborted {
                        rank: owner.rank,
                        reason: "an operation panicked on this rank".into(),
                    };
                    stop_all(e);
                    std::panic::resume_unwind(p);
                }
            }
        },
    );
    match cause.into_inner().unwrap_or_else(|p| p.into_inner()) {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

/// Spawns `parts[0]` on `pools[0]` (channel `comms[0]`), and so on, each pool's scope inside
/// the one before, and runs `first` innermost; returns once every part has ended.
fn nest<'s>(
    pools: &[rayon::ThreadPool],
    comms: &'s [Engine],
    mut parts: std::collections::VecDeque<Part<'s>>,
    stop_all: &'s (dyn Fn(Error) + Sync),
    first: impl FnOnce(),
) {
    let (Some(job), Some(pool), Some(comm)) = (parts.pop_front(), pools.first(), comms.first())
    else {
        first();
        return;
    };
    pool.in_place_scope(|sc| {
        sc.spawn(move |_| {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(comm)))
                .unwrap_or_else(|_| {
                    Err(Error::Aborted {
                        rank: comm.rank,
                        reason: "a channel's thread panicked".into(),
                    })
                });
            if let Err(e) = r {
                stop_all(e);
            }
        });
        nest(&pools[1..], &comms[1..], parts, stop_all, first);
    });
}

/// A mismatch a channel found, told as the caller's: the parent's operation number `seq` and
/// `call`, with the parts channel `channel` compared. (Every rank cuts a call alike, so parts
/// differ only where the calls do.) Other errors pass through.
pub(crate) fn as_the_callers(e: Error, channel: usize, seq: u64, call: String) -> Error {
    match e {
        Error::Mismatch {
            rank,
            peer,
            local,
            remote,
            ..
        } => Error::Mismatch {
            rank,
            peer,
            seq,
            local: call,
            remote: format!(
                "a different call (channel {channel} of OXCCL_SOCKET_CHANNELS compared this \
                 rank's part, {local}, with rank {peer}'s, {remote})"
            ),
        },
        e => e,
    }
}

/// Element-wise operations cut across the channels: what `Ctx::split` runs.
impl Split for Shared {
    fn split(
        &self,
        ctx: &mut Ctx<'_>,
        choice: Choice,
        desc: OpDesc,
        src: Option<&[u8]>,
        buf: &mut [u8],
        one: &Whole<'_>,
    ) -> Option<Result<()>> {
        let chs = self.channels.get()?;
        let parts = parts(buf.len(), chs.comms.len() + 1)?;
        let es = desc.dtype.size();
        let call = (ctx.tag.seq, desc.to_string());
        let part = |c: &Shared, s: Option<&[u8]>, b: &mut [u8]| {
            let d = OpDesc {
                count: b.len() / es,
                ..desc
            };
            c.run(d, |cx, cch| one(cx, cch, s, b))
        };
        Some(cut_op(
            chs,
            self,
            &parts,
            src,
            buf,
            call,
            |s, b| one(ctx, choice, s, b),
            &part,
        ))
    }
}

/// An element-wise operation on `buf` (`src` the out-of-place input, indexed alike) cut at
/// `parts`: part 0 by `first(src0, buf0)` on this thread, part `i` by `part(channel i, src_i,
/// buf_i)` on channel `i`'s thread. `call` is the parent's operation number and call, for a
/// mismatch a channel finds.
#[allow(clippy::too_many_arguments)]
fn cut_op(
    ch: &Channels,
    owner: &Shared,
    parts: &[Range<usize>],
    src: Option<&[u8]>,
    buf: &mut [u8],
    call: (u64, String),
    first: impl FnOnce(Option<&[u8]>, &mut [u8]) -> Result<()>,
    part: &RunPart<'_>,
) -> Result<()> {
    let mut bufs = cut(buf, parts).into_iter();
    let srcs: Vec<Option<&[u8]>> = parts.iter().map(|p| src.map(|s| &s[p.clone()])).collect();
    let (b0, s0) = (bufs.next().unwrap_or_default(), srcs[0]);
    let rest: Vec<Part<'_>> = bufs
        .zip(srcs[1..].iter().copied())
        .enumerate()
        .map(|(i, (b, s))| {
            let (seq, desc) = call.clone();
            Box::new(move |c: &Shared| {
                let slot = &c.cut_call;
                *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some((i + 1, seq, desc));
                let r = part(c, s, b);
                *slot.lock().unwrap_or_else(|p| p.into_inner()) = None;
                r
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
