//! Primitives every algorithm is written with: stream bytes to a peer and from a peer through the
//! transport's slots, reducing or copying straight out of each slot, with one waiting policy.
//!
//! [`Ctx`] holds the connections of one communicator while one operation runs. Its calls block
//! until done, but inside they never block on one peer alone: while waiting they keep every
//! connection moving (so a rank that waits to receive still drains what it sent), check the
//! abort flag, and give up at the operation's deadline. Waiting spins briefly, then yields, then
//! sleeps in `poll(2)` on the connections' sockets, so oversubscribed ranks do not starve each
//! other.

use std::os::fd::RawFd;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use oxccl_kernels::{DType, ReduceOp};

use crate::base::error::{Error, Result};
use crate::base::op::OpDesc;
use crate::base::stall::Stalls;
use crate::base::tuning::Choice;
pub(crate) use crate::transport::Links;

mod exchange;
mod layout;
mod send_thread;
#[cfg(test)]
mod tests;
mod wait;

use crate::transport::{PollDir, Tag, Window};
pub(crate) use layout::NodeLayout;
pub(crate) use send_thread::SendThread;

/// Largest scratch buffer kept between operations.
const SCRATCH_KEEP: usize = 16 << 20;

/// An element-wise operation's body on one context: `(ctx, choice, src, buf)`, `src` being the
/// out-of-place input indexed like `buf`.
pub(crate) type Whole<'a> =
    dyn Fn(&mut Ctx<'_>, Choice, Option<&[u8]>, &mut [u8]) -> Result<()> + Sync + 'a;

/// Runs element-wise operations cut into parts across parallel channels (the engine does, see
/// `crate::engine::channels`).
pub(crate) trait Split: Sync {
    /// Runs `one` over `buf` (the operation `desc`; `src` its out-of-place input) cut into
    /// parts, part 0 on `ctx` with `choice`, the others on the channels; `None` when `buf` stays
    /// whole (no channels, or too small to cut).
    fn split(
        &self,
        ctx: &mut Ctx<'_>,
        choice: Choice,
        desc: OpDesc,
        src: Option<&[u8]>,
        buf: &mut [u8],
        one: &Whole<'_>,
    ) -> Option<Result<()>>;
}

/// How received bytes land in the destination.
#[derive(Clone, Copy)]
pub(crate) enum RecvMode<'s> {
    /// `dst = slot`.
    Copy,
    /// `dst = dst (op) slot`.
    Reduce(DType, ReduceOp),
    /// `dst = src (op) slot`, `src` as long as the destination (out-of-place input read where
    /// it is, instead of a copy into the destination first).
    ReduceFrom(DType, ReduceOp, &'s [u8]),
    /// `dst = src * factor + slot` (`dst * factor + slot` without `src`): this rank's own input
    /// entering a pre-multiplied sum, scaled piece by piece as the slots arrive (while the piece
    /// is in cache) instead of in a pass of its own over the whole buffer.
    ScaleReduce(DType, f64, Option<&'s [u8]>),
}

/// One send of [`Ctx::exchange_many`]: `data` to `peer`, tagged `tag`.
pub(crate) struct SendPart<'d> {
    peer: usize,
    data: &'d [u8],
    tag: Tag,
    /// Copy of what is sent, made piece by piece as it goes out (see [`Ctx::exchange_mirrored`]).
    mirror: Option<&'d mut [u8]>,
    /// Elements of this type leave multiplied by this factor (see [`Ctx::exchange_scaled`]).
    scale: Option<(DType, f64)>,
    sent: usize,
    /// At least one frame went out (an empty message is one empty frame).
    done: bool,
}

impl<'d> SendPart<'d> {
    pub(crate) fn new(peer: usize, data: &'d [u8], tag: Tag) -> SendPart<'d> {
        SendPart {
            peer,
            data,
            tag,
            mirror: None,
            scale: None,
            sent: 0,
            done: false,
        }
    }

    fn mirrored(mut self, mirror: Option<&'d mut [u8]>) -> SendPart<'d> {
        self.mirror = mirror;
        self
    }
}

/// One receive of [`Ctx::exchange_many`]: into `buf` from `peer`, landing as `mode` says.
pub(crate) struct RecvPart<'d> {
    peer: usize,
    buf: &'d mut [u8],
    mode: RecvMode<'d>,
    tag: Tag,
    got: usize,
    done: bool,
}

impl<'d> RecvPart<'d> {
    pub(crate) fn new(
        peer: usize,
        buf: &'d mut [u8],
        mode: RecvMode<'d>,
        tag: Tag,
    ) -> RecvPart<'d> {
        RecvPart {
            peer,
            buf,
            mode,
            tag,
            got: 0,
            done: false,
        }
    }
}

/// Everything an algorithm needs while one operation runs.
pub(crate) struct Ctx<'a> {
    /// This rank.
    pub rank: usize,
    /// Ranks in the communicator.
    pub size: usize,
    links: &'a mut Links,
    /// Tag of the operation's slots.
    pub tag: Tag,
    /// Name of the operation, for errors.
    pub op: &'static str,
    /// Set when the operation first waits (reading the clock costs; most small operations never
    /// wait long enough to need it).
    deadline: Option<Instant>,
    /// In a sub-context ([`Ctx::sub`]): the communicator context's deadline, shared so the whole
    /// operation (every sub-context and the parent) gives up at one deadline.
    root_deadline: Option<&'a mut Option<Instant>>,
    timeout: Duration,
    abort: &'a AtomicBool,
    /// When this rank started waiting without progress (None while progressing).
    idle_since: Option<Instant>,
    /// Doorbell counter read at the start of the current round of checks.
    bell_seen: u32,
    fds: Vec<(RawFd, PollDir)>,
    /// The operation is a collective (its tag's sequence number is the collective counter), so
    /// waits compare it with what peers publish through the other path (slots vs window).
    pub collective: bool,
    /// The operation runs a direct algorithm over the window.
    direct: bool,
    /// The operation opened a window epoch, then every rank went on through the slots (see
    /// [`Ctx::leave_window`]): peers' window records of its sequence number are expected.
    left_window: bool,
    /// Busy-poll before yielding (false when ranks outnumber cores).
    pub spin: bool,
    /// Large sends to TCP peers go out on this thread ([`Ctx::exchange_split`]).
    pub send_thread: Option<&'a SendThread>,
    /// Cuts large element-wise operations across the communicator's extra channels
    /// (`OXCCL_SOCKET_CHANNELS`, see [`Split`]); `None` in sub-contexts, channels' own
    /// operations and unit tests.
    pub split: Option<&'a dyn Split>,
    /// Copies into the user's buffer use streaming stores (set for buffers beyond the caches,
    /// see `tuning::STREAM_MIN`).
    pub stream: bool,
    /// Where the communicator's ranks sit, when it spans nodes of at least two ranks each.
    pub layout: Option<&'a NodeLayout>,
    /// In a sub-context ([`Ctx::sub`]): the communicator rank of every member; peers are member
    /// indices. `None`: peers are communicator ranks.
    map: Option<&'a [usize]>,
    /// Where a stalled wait is posted and a timed-out one reads the others' posts (see
    /// `crate::base::stall`); `None` in unit tests.
    pub stalls: Option<&'a Stalls>,
    /// The flight recorder, written to `OXCCL_TRACE_DIR` when a wait stalls (see
    /// `crate::base::trace`); `None` in unit tests.
    pub trace: Option<&'a crate::base::trace::Recorder>,
}

/// Copies `src` into `dst` (a user buffer), with streaming stores when `stream`.
pub(crate) fn copy(stream: bool, dst: &mut [u8], src: &[u8]) {
    if stream {
        oxccl_kernels::copy_streaming(dst, src);
    } else {
        dst.copy_from_slice(src);
    }
}

#[cold]
fn no_window(rank: usize, op: &str) -> Error {
    Error::InvalidArgument {
        rank,
        op: op.into(),
        msg: "direct algorithms need every rank on shared memory".into(),
    }
}

fn proto_err(rank: usize, peer: usize, msg: String) -> Error {
    Error::Transport {
        rank,
        peer,
        transport: "protocol",
        msg,
    }
}

fn missing(rank: usize, op: &str, peer: usize, what: &str) -> Error {
    proto_err(
        rank,
        peer,
        format!("{op}: no {what} connection to rank {peer}"),
    )
}

/// Names the operation in errors coming from the transport.
fn retag(op: &str, e: Error) -> Error {
    match e {
        Error::PeerLost {
            rank, peer, detail, ..
        } => Error::PeerLost {
            rank,
            peer,
            op: op.to_string(),
            detail,
        },
        other => other,
    }
}

impl<'a> Ctx<'a> {
    pub(crate) fn new(
        rank: usize,
        size: usize,
        links: &'a mut Links,
        tag: Tag,
        op: &'static str,
        timeout: Duration,
        abort: &'a AtomicBool,
    ) -> Ctx<'a> {
        Ctx {
            rank,
            size,
            links,
            tag,
            op,
            deadline: None,
            root_deadline: None,
            timeout,
            abort,
            idle_since: None,
            bell_seen: 0,
            fds: Vec::new(),
            collective: false,
            direct: false,
            left_window: false,
            spin: true,
            send_thread: None,
            split: None,
            stream: false,
            layout: None,
            map: None,
            stalls: None,
            trace: None,
        }
    }

    /// A context over a subset of this one's ranks: `members` lists their ranks (this rank
    /// included); inside it ranks and peers are indices into `members`. Same tag, deadline (one
    /// for the whole operation: a deadline set inside is the parent's too) and connections: the
    /// hierarchical algorithms run rings inside a node and across nodes with it. Call it on a
    /// communicator's context (not on a sub-context): `members` are communicator ranks.
    pub(crate) fn sub<'b>(&'b mut self, members: &'b [usize]) -> Ctx<'b> {
        let me = self.me();
        let rank = members.iter().position(|&r| r == me).unwrap_or(0);
        // The deadline lives in the outermost context; a sub-context sets it there (see
        // `Ctx::deadline`), so time spent in one sub-context counts in the next.
        let root = match self.root_deadline.as_deref_mut() {
            Some(r) => r,
            None => &mut self.deadline,
        };
        Ctx {
            rank,
            size: members.len(),
            links: &mut *self.links,
            tag: self.tag,
            op: self.op,
            deadline: *root,
            root_deadline: Some(root),
            timeout: self.timeout,
            abort: self.abort,
            idle_since: None,
            bell_seen: 0,
            fds: Vec::new(),
            collective: self.collective,
            direct: false,
            left_window: false,
            spin: self.spin,
            send_thread: self.send_thread,
            split: None,
            stream: self.stream,
            layout: None,
            map: Some(members),
            stalls: self.stalls,
            trace: self.trace,
        }
    }

    /// The operation's deadline, set `timeout` after `now` by its first wait (in the outermost
    /// context, which sub-contexts share).
    fn deadline(&mut self, now: Instant) -> Instant {
        if let Some(d) = self.deadline {
            return d;
        }
        let d = match self.root_deadline.as_deref_mut() {
            Some(r) => *r.get_or_insert(now + self.timeout),
            None => now + self.timeout,
        };
        self.deadline = Some(d);
        d
    }

    /// The communicator rank of peer `p` of this context (see [`Ctx::sub`]).
    fn real(&self, p: usize) -> usize {
        self.map.map_or(p, |m| m[p])
    }

    /// This rank as a communicator rank (for errors).
    fn me(&self) -> usize {
        self.real(self.rank)
    }

    /// The communicator's scratch buffer, taken out so the caller can use it across exchanges
    /// (give it back with [`Ctx::put_scratch`]; it is kept between operations to save allocations).
    pub(crate) fn take_scratch(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.links.scratch)
    }

    /// Gives the scratch buffer back (dropped instead when larger than [`SCRATCH_KEEP`]).
    pub(crate) fn put_scratch(&mut self, v: Vec<u8>) {
        if v.capacity() <= SCRATCH_KEEP {
            self.links.scratch = v;
        }
    }

    /// The bytes a collective may carry in the window's records themselves (0 without one).
    #[inline]
    pub(crate) fn inline_capacity(&self) -> usize {
        self.links
            .window
            .as_deref()
            .map_or(0, |w| w.inline_capacity())
    }

    /// Says that every rank leaves the window epoch it opened for this operation and goes on
    /// through the slots (an all-gather whose outputs are not all registered): waits stop
    /// treating the window records of this operation as a peer on the other path.
    pub(crate) fn leave_window(&mut self) {
        self.direct = false;
        self.left_window = true;
    }

    /// Whether this operation left the window for the slots ([`Ctx::leave_window`]).
    pub(crate) fn left_window(&self) -> bool {
        self.left_window
    }

    /// Counts `bytes` that peers wrote straight into this rank's registered buffers
    /// ([`crate::Stats::registered_recv_bytes`]).
    pub(crate) fn count_landed(&self, bytes: usize) {
        self.links
            .landed_bytes
            .fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// The direct window and the scratch buffer, or an error if this communicator has no window.
    #[inline]
    pub(crate) fn window(&mut self) -> Result<(&mut dyn Window, &mut Vec<u8>)> {
        self.direct = true;
        let (rank, op) = (self.rank, self.op);
        match self.links.window.as_deref_mut() {
            Some(w) => Ok((w, &mut self.links.scratch)),
            None => Err(no_window(rank, op)),
        }
    }
}
