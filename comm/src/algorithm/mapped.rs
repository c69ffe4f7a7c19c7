//! The mapped all-gather and all-reduce, for ranks that share memory and whose buffers are
//! registered ([`crate::Registered`], a shared file each peer maps): every rank reads and writes
//! the peers' buffers with plain loads and stores, nothing staged, nothing copied twice.
//!
//! Both open an epoch of the communicator's [`Window`]: every rank publishes its buffer as a
//! [`SharedBuf`] with step `4e + 1` (none when it is private memory, or where ranks cannot map
//! each other's, [`Window::can_map`]) and waits for every peer's. When some rank published none,
//! every rank sees so in the same records, leaves the window ([`Ctx::leave_window`]) and the
//! caller runs the tuner's other choice. Otherwise each maps every peer's buffer
//! ([`Window::peer_shared`], kept from one call to the next) and:
//!
//! - **all-gather**: copies its block, a piece at a time, into its own output (out of place) and
//!   every peer's: each piece is read once and written to each destination while in cache, all
//!   the memory traffic an all-gather has to make;
//! - **all-reduce**: out of place, first copies its input into its output (all but its own
//!   piece) and publishes `4e + 2`, so that from then on every rank's buffer holds its input.
//!   Each rank then reduces its piece of every peer's buffer into its own, a block at a time
//!   (its own piece read from its input out of place), and writes each reduced block into every
//!   peer's buffer. Only rank `j` touches piece `j` of any buffer after `4e + 2`, so no rank
//!   waits for another in between.
//!
//! Both end by publishing the last step with the same record (a slow peer may still be reading
//! it) and waiting for every peer's: every buffer is whole, and nobody touches it any more.

use oxccl_kernels::{reduce_bytes, reduce_into_bytes, DType, ReduceOp};

use crate::algorithm::blocks;
use crate::algorithm::direct::{kerr, piece};
use crate::algorithm::prims::{copy, Ctx};
use crate::base::error::{Error, Result};
use crate::base::tuning::STREAM_MIN;
use crate::transport::registry::Registry;
use crate::transport::SharedBuf;

/// Bytes of a piece copied into every destination (all-gather) or reduced from every peer
/// (all-reduce) before the next: fits in L2 with room for the destinations' lines.
const PIECE: usize = 256 << 10;

/// An open epoch of a mapped algorithm: every peer's buffer mapped here.
struct Open {
    e: u64,
    h: usize,
    mine: Option<SharedBuf>,
    /// Each rank's buffer here (null at this rank's index).
    peers: Vec<*mut u8>,
}

impl Open {
    /// `len` bytes at `at` of `p`'s buffer.
    ///
    /// # Safety
    /// `at + len` must lie within the buffer length given to [`open`], and the step protocol
    /// must give those bytes to this rank (nobody else reads or writes them meanwhile).
    unsafe fn peer(&mut self, p: usize, at: usize, len: usize) -> &mut [u8] {
        // SAFETY: the mapping holds the whole buffer (checked by `peer_shared`) and lives as
        // long as the window; the caller vouches for the range and its exclusive use.
        unsafe { std::slice::from_raw_parts_mut(self.peers[p].add(at), len) }
    }
}

/// Opens an epoch over `buf` (offered only when `offer`): `None`, having left the window, when
/// some rank's buffer is not registered.
fn open(ctx: &mut Ctx<'_>, buf: &[u8], offer: bool) -> Result<Option<Open>> {
    let (n, me, tag, op) = (ctx.size, ctx.rank, ctx.tag, ctx.op);
    let addr = buf.as_ptr() as usize;
    let (w, _) = ctx.window()?;
    // Where ranks cannot map each other's buffers (the same on every rank), nobody offers one.
    let mine = Registry::global()
        .find(addr, buf.len())
        .filter(|_| offer && w.can_map())
        .and_then(|e| {
            Some(SharedBuf {
                fd: e.fd?,
                id: e.id,
                offset: addr - e.start,
            })
        });
    let e = w.next_epoch();
    let h = (e % 2) as usize;
    w.publish_shared(4 * e + 1, tag, h, mine);
    ctx.wait_step(4 * e + 1, Some(h))?;
    let (w, _) = ctx.window()?;
    if mine.is_none() || (0..n).any(|p| p != me && !w.peer_has_shared(p, h)) {
        tracing::debug!(
            rank = me,
            op,
            "a buffer is not registered: the tuner's other choice runs"
        );
        ctx.leave_window();
        return Ok(None);
    }
    let mut peers = vec![std::ptr::null_mut::<u8>(); n];
    for (p, at) in peers.iter_mut().enumerate() {
        if p != me {
            // Published, checked above: a peer maps only when every rank published.
            *at = w
                .peer_shared(p, h, buf.len())?
                .ok_or_else(|| vanished(me, op, p))?;
        }
    }
    Ok(Some(Open { e, h, mine, peers }))
}

/// Publishes `step` of `o`'s epoch with the same record and waits for every peer's.
fn step(ctx: &mut Ctx<'_>, o: &Open, step: u64) -> Result<()> {
    let tag = ctx.tag;
    let (w, _) = ctx.window()?;
    w.publish_shared(4 * o.e + step, tag, o.h, o.mine);
    ctx.wait_step(4 * o.e + step, None)
}

/// `peer` published a registered buffer, then none.
#[cold]
fn vanished(rank: usize, op: &str, peer: usize) -> Error {
    Error::Transport {
        rank,
        peer,
        transport: "shm",
        msg: format!("{op}: the peer's registered buffer vanished from its window record"),
    }
}

/// All-gather into `buf` (`n` equal blocks, this rank's block `me`; `own`: this rank's input,
/// out of place, else its block of `buf` holds it), writing this rank's block straight into
/// every peer's output. Returns `false`, with nothing written, when some rank's output is not
/// registered (every rank returns the same): the caller runs the tuner's other choice.
pub(crate) fn all_gather(ctx: &mut Ctx<'_>, buf: &mut [u8], own: Option<&[u8]>) -> Result<bool> {
    let (n, me) = (ctx.size, ctx.rank);
    let block = buf.len() / n;
    if block == 0 {
        return Ok(true);
    }
    let Some(mut o) = open(ctx, buf, true)? else {
        return Ok(false);
    };
    let stream = block >= STREAM_MIN;
    for (start, len) in blocks(block, PIECE) {
        let at = me * block + start;
        if let Some(src) = own {
            copy(stream, &mut buf[at..at + len], &src[start..start + len]);
        }
        let part: &[u8] = match own {
            Some(src) => &src[start..start + len],
            None => &buf[at..at + len],
        };
        for k in 1..n {
            // Each rank starts with its next peer, so that no output is written by everyone
            // at once.
            let p = (me + k) % n;
            // SAFETY: `at..at + len` lies in `p`'s block `me` of its output, which only this
            // rank writes during the epoch and `p` neither reads nor writes until it has seen
            // this rank's last step.
            copy(stream, unsafe { o.peer(p, at, len) }, part);
        }
    }
    step(ctx, &o, 2)?;
    ctx.count_landed(buf.len() - block);
    Ok(true)
}

/// All-reduce of `buf` (in place when `src` is `None`, else `buf = reduce(src)`) reading and
/// writing the peers' registered buffers (see the module documentation). Returns `false`, with
/// nothing written, when some rank's buffer is not registered (every rank returns the same).
pub(crate) fn all_reduce(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
) -> Result<bool> {
    let (n, me, es, name) = (ctx.size, ctx.rank, dt.size(), ctx.op);
    if buf.is_empty() {
        return Ok(true);
    }
    let Some(mut o) = open(ctx, buf, true)? else {
        return Ok(false);
    };
    let mine = piece(buf.len(), es, n, me);
    let stream = buf.len() >= STREAM_MIN;
    if let Some(s) = src {
        // Every piece but this rank's, which it reads from `src` as it reduces.
        copy(stream, &mut buf[..mine.start], &s[..mine.start]);
        copy(stream, &mut buf[mine.end..], &s[mine.end..]);
    }
    step(ctx, &o, 2)?;
    for (start, len) in blocks(mine.len(), PIECE) {
        let at = mine.start + start;
        for k in 1..n {
            let p = (me + k) % n;
            // SAFETY: piece `me` of every buffer belongs to this rank from step `4e + 2` on
            // (only it reads or writes it) until its last step.
            let theirs = unsafe { o.peer(p, at, len) };
            let out = &mut buf[at..at + len];
            match src {
                Some(s) if k == 1 => reduce_into_bytes(dt, op, out, &s[at..at + len], theirs),
                _ => reduce_bytes(dt, op, out, theirs),
            }
            .map_err(|e| kerr(me, name, e))?;
        }
        for k in 1..n {
            let p = (me + k) % n;
            // SAFETY: as above.
            copy(stream, unsafe { o.peer(p, at, len) }, &buf[at..at + len]);
        }
    }
    step(ctx, &o, 3)?;
    ctx.count_landed(buf.len() - mine.len());
    Ok(true)
}
