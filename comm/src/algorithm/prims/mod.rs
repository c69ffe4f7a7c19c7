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
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use oxccl_kernels::{DType, ReduceOp};

use crate::base::error::{Error, Result};
use crate::base::op::OpDesc;
use crate::base::stall::Stalls;
use crate::base::sys;
use crate::base::tuning::Choice;
pub(crate) use crate::transport::Links;
use crate::transport::{PollDir, SendConn, Tag, Window};

/// Messages of at least this many bytes are sent straight from the caller's memory where the
/// transport can ([`SendConn::send_direct`]: TCP), skipping the copy into a slot.
const DIRECT_SEND_MIN: usize = 64 << 10;
/// A message sent straight from the caller's memory goes out in at least this many frames (each
/// at least [`DIRECT_SEND_MIN`] bytes, at most a slot), so the receiver reduces or copies the
/// first while the next is on the wire. Measured over loopback TCP, 2 ranks, 7 interleaved rounds
/// (`OXCCL_SLOT_BYTES` 128 KiB against 512 KiB for every frame): 1 MiB all-reduce (512 KiB
/// messages) 1.07 against 0.80 GB/s busbw, but 64 MiB 1.16 against 1.37; cutting only smaller
/// messages finer keeps both.
const DIRECT_FRAMES: usize = 4;

/// Frame size for a direct send of a `len`-byte message (see [`DIRECT_FRAMES`]).
fn direct_frame(len: usize) -> usize {
    (len / DIRECT_FRAMES / 4096 * 4096).max(DIRECT_SEND_MIN)
}

/// States of an exchange split with the send thread: both threads running, the rank's thread
/// failed first, the send thread failed first.
const RUNNING: u8 = 0;
const STOPPED_HERE: u8 = 1;
const STOPPED_BY_SENDS: u8 = 2;

/// Smallest send that goes out on the send thread ([`Ctx::exchange_split`]).
const SEND_THREAD_MIN: usize = 256 << 10;

/// Largest scratch buffer kept between operations.
const SCRATCH_KEEP: usize = 16 << 20;

/// How long a waiting rank busy-polls before it yields the core.
const SPIN: Duration = Duration::from_micros(20);
/// Polls of the window's step counters before a waiting rank starts reading the clock.
const FAST_SPINS: u32 = 256;
/// How long it then yields between polls before it sleeps in `poll(2)`.
const YIELD: Duration = Duration::from_micros(200);

/// The thread a rank's large sends to TCP peers go out on ([`Ctx::exchange_split`],
/// `OXCCL_SOCKET_SEND_THREAD`): a pool of one, so exchanges do not start a thread each.
pub(crate) struct SendThread {
    pool: rayon::ThreadPool,
    /// Exchanges whose sends went out on it.
    pub exchanges: AtomicU64,
}

impl SendThread {
    /// Starts the thread, named after `rank`.
    pub(crate) fn new(rank: usize) -> std::result::Result<SendThread, rayon::ThreadPoolBuildError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .thread_name(move |_| format!("oxccl-send-r{rank}"))
            .build()?;
        Ok(SendThread {
            pool,
            exchanges: AtomicU64::new(0),
        })
    }
}

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

/// The communicator's ranks by node, when it spans at least two nodes of at least two ranks
/// each: what the hierarchical algorithms need (all three when every node has the same number of
/// ranks, all-reduce alone otherwise).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct NodeLayout {
    /// `ranks[k][l]`: the communicator rank of local rank `l` on node `k` (nodes in order of first
    /// appearance, local ranks in rank order).
    pub ranks: Vec<Vec<usize>>,
    /// This rank's node.
    pub node: usize,
    /// This rank's local rank.
    pub local: usize,
    /// The ranks of this node (`ranks[node]`).
    pub local_group: Vec<usize>,
    /// The number of ranks of the smallest node: the hierarchical all-reduce's pieces per
    /// block (local ranks `0..pieces` of every node carry one each across nodes).
    pub pieces: usize,
    /// Every node has the same number of ranks (hierarchical reduce-scatter and all-gather).
    pub even: bool,
    /// The ranks with this local rank on every node (`ranks[k][local]` for every `k`); empty
    /// when this local rank is `pieces` or more (a larger node's extra ranks carry no piece).
    pub cross_group: Vec<usize>,
}

impl NodeLayout {
    /// Whether the tuner may pick the hierarchical all-reduce by itself: every node's local
    /// ring has at most `pieces` steps per phase (its size at most `pieces + 1`), as on nodes of
    /// equal size. Each local step moves a piece of `B / pieces` bytes, so a node much larger
    /// than the smallest would make the local rings slower than the flat ring.
    pub fn balanced(&self) -> bool {
        self.ranks.iter().all(|g| g.len() <= self.pieces + 1)
    }
}

impl NodeLayout {
    /// The layout of ranks whose node ids are `nodes` (indexed by rank), seen from `rank`;
    /// `None` unless there are at least two nodes, each with at least two ranks.
    pub fn new(nodes: &[&str], rank: usize) -> Option<NodeLayout> {
        let mut ids: Vec<&str> = Vec::new();
        let mut ranks: Vec<Vec<usize>> = Vec::new();
        for (r, n) in nodes.iter().enumerate() {
            match ids.iter().position(|i| i == n) {
                Some(k) => ranks[k].push(r),
                None => {
                    ids.push(n);
                    ranks.push(vec![r]);
                }
            }
        }
        let pieces = ranks.iter().map(Vec::len).min()?;
        if ranks.len() < 2 || pieces < 2 {
            return None;
        }
        let even = ranks.iter().all(|g| g.len() == pieces);
        let (node, local) = ranks
            .iter()
            .enumerate()
            .find_map(|(k, g)| g.iter().position(|&r| r == rank).map(|l| (k, l)))?;
        let cross_group = if local < pieces {
            ranks.iter().map(|g| g[local]).collect()
        } else {
            Vec::new()
        };
        Some(NodeLayout {
            local_group: ranks[node].clone(),
            cross_group,
            pieces,
            even,
            ranks,
            node,
            local,
        })
    }
}

/// Copies `src` into `dst` (a user buffer), with streaming stores when `stream`.
pub(crate) fn copy(stream: bool, dst: &mut [u8], src: &[u8]) {
    if stream {
        oxccl_kernels::copy_streaming(dst, src);
    } else {
        dst.copy_from_slice(src);
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

    /// The direct window and the scratch buffer, or an error if this communicator has no window.
    pub(crate) fn window(&mut self) -> Result<(&mut dyn Window, &mut Vec<u8>)> {
        self.direct = true;
        let (rank, op) = (self.rank, self.op);
        match self.links.window.as_deref_mut() {
            Some(w) => Ok((w, &mut self.links.scratch)),
            None => Err(Error::InvalidArgument {
                rank,
                op: op.into(),
                msg: "direct algorithms need every rank on shared memory".into(),
            }),
        }
    }

    /// Waits until every other rank has published `step` (or a later one) in the window; with
    /// `half`, also checks that each published this operation's tag (else `Mismatch`).
    pub(crate) fn wait_step(&mut self, step: u64, half: Option<usize>) -> Result<()> {
        self.direct = true;
        let mut next = 0;
        let mut spins = 0u32;
        loop {
            self.arm();
            let before = next;
            let (rank, size, tag) = (self.rank, self.size, self.tag);
            let w = self
                .links
                .window
                .as_deref_mut()
                .ok_or_else(|| missing(rank, self.op, rank, "window"))?;
            while next < size {
                if next == rank {
                    next += 1;
                    continue;
                }
                if w.step(next) < step {
                    break;
                }
                if let Some(h) = half {
                    let theirs = w.peer_tag(next, h);
                    if theirs != Some(tag) {
                        return Err(Error::Mismatch {
                            rank,
                            peer: next,
                            seq: tag.seq,
                            local: OpDesc::describe_tag(&tag),
                            remote: theirs.map_or("nothing".into(), |t| OpDesc::describe_tag(&t)),
                        });
                    }
                }
                next += 1;
            }
            if next == size {
                self.idle_since = None;
                return Ok(());
            }
            if next != before {
                self.idle_since = None;
            }
            let p = next;
            // A peer usually arrives within a microsecond or two: poll its counter without
            // reading the clock first, then fall back to the full wait (liveness, deadline, sleep).
            if self.spin && self.idle_since.is_none() && spins < FAST_SPINS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            if let Err(e) = w.check(p) {
                // The peer may have published its last step and left after the load above: its
                // step store comes before its goodbye (or exit), so an acquire reload sees it.
                if w.step(p) < step {
                    return Err(retag(self.op, e));
                }
                continue;
            }
            self.idle(&|| format!("waiting for rank {p} to reach direct step {step}"))?;
        }
    }

    /// A peer runs this collective (same sequence number) through the other path: through the
    /// window while this rank uses slots, or the reverse. Both would wait forever; say so.
    fn cross_check(&mut self) -> Result<()> {
        if !self.collective {
            return Ok(());
        }
        let (rank, size, tag, direct) = (self.rank, self.size, self.tag, self.direct);
        if self.map.is_some() {
            return Ok(()); // sub-contexts run on communicators spanning nodes: no window
        }
        let Some(w) = self.links.window.as_deref() else {
            return Ok(());
        };
        let is_coll = |t: &Tag| {
            OpDesc::from_tag(t).is_some_and(|d| d.coll != crate::base::op::Collective::SendRecv)
        };
        for p in (0..size).filter(|&p| p != rank) {
            let other = if direct {
                match self.links.recv.get_mut(p).and_then(|c| c.as_mut()) {
                    Some(c) => match c.try_recv() {
                        Ok(Some((t, _))) => Some(t),
                        _ => None,
                    },
                    None => None,
                }
                .filter(|t| t.seq == tag.seq && is_coll(t))
                .map(|t| (t, "runs a slot-based algorithm"))
            } else {
                (0..2)
                    .filter_map(|h| w.peer_tag(p, h))
                    .find(|t| t.seq == tag.seq)
                    .map(|t| (t, "runs a direct shared-memory algorithm"))
            };
            if let Some((t, how)) = other {
                return Err(Error::Mismatch {
                    rank,
                    peer: p,
                    seq: tag.seq,
                    local: OpDesc::describe_tag(&tag),
                    remote: format!("{} (it {how})", OpDesc::describe_tag(&t)),
                });
            }
        }
        Ok(())
    }

    /// Starts a round of checks: remembers the doorbell counter so a post that lands during the
    /// round ends the next sleep at once.
    fn arm(&mut self) {
        if let Some(b) = &self.links.bell {
            self.bell_seen = b.seq();
        }
    }

    /// The operation as stall reports name it, and its collective sequence number.
    fn stall_label(&self) -> (String, Option<u64>) {
        match OpDesc::from_tag(&self.tag).filter(|_| self.collective) {
            Some(d) => (d.to_string(), Some(self.tag.seq)),
            None => (self.op.to_string(), None),
        }
    }

    /// Nothing moved: keep every connection going, then wait a little.
    fn idle(&mut self, waiting: &dyn Fn() -> String) -> Result<()> {
        if self.abort.load(Ordering::Relaxed) {
            return Err(Error::Aborted {
                rank: self.me(),
                reason: format!("abort() called during {}", self.op),
            });
        }
        if self.links.progress_all().map_err(|e| retag(self.op, e))? {
            self.idle_since = None;
            return Ok(());
        }
        let now = Instant::now();
        if now >= self.deadline(now) {
            let mut detail = waiting();
            if let Some(s) = self.stalls {
                let (op, seq) = self.stall_label();
                if let Some(report) = s.report(&op, seq) {
                    detail = format!("{detail}; {report}");
                }
            }
            return Err(Error::Timeout {
                rank: self.me(),
                op: self.op.to_string(),
                timeout: self.timeout,
                detail,
            });
        }
        // Busy-poll briefly (a peer's reply usually lands within microseconds), then yield the
        // core to other ranks, then sleep in poll(2) until a socket is ready.
        let since = *self.idle_since.get_or_insert(now);
        let waited = now - since;
        if let Some(s) = self.stalls.filter(|s| waited >= s.after && !s.posted()) {
            let (op, seq) = self.stall_label();
            s.post(op, seq, waited, waiting());
            // The hang may last until the time-out: its record is on disk from now on.
            if let Some(t) = self.trace {
                t.dump_in_background("stalled");
            }
        }
        let spin = if self.spin { SPIN } else { Duration::ZERO };
        if waited < spin {
            std::hint::spin_loop();
            return Ok(());
        }
        self.cross_check()?;
        if waited < spin + YIELD {
            std::thread::yield_now();
        } else {
            self.links.poll_fds(&mut self.fds);
            match self.links.bell.as_ref() {
                // Shared-memory peers ring our doorbell; sleep on it (briefly, if sockets must be
                // watched too) unless it rang since this round of checks began.
                Some(bell) => {
                    let nap = if self.fds.is_empty() {
                        Duration::from_millis(1)
                    } else {
                        Duration::from_micros(50)
                    };
                    bell.sleep_since(self.bell_seen, nap);
                    if !self.fds.is_empty() {
                        sys::poll(&self.fds, 0);
                    }
                }
                None => sys::poll(&self.fds, 1),
            }
        }
        Ok(())
    }

    /// Sends `send` to one peer while receiving into another buffer from a (possibly different)
    /// peer, slot by slot, both directions interleaved so neither can block the other.
    pub(crate) fn exchange(
        &mut self,
        send: Option<(usize, &[u8])>,
        recv: Option<(usize, &mut [u8], RecvMode<'_>)>,
    ) -> Result<()> {
        let tag = self.tag;
        self.exchange_tagged(
            send.map(|(p, d)| (p, d, tag)),
            recv.map(|(p, b, m)| (p, b, m, tag)),
        )
    }

    /// [`Ctx::exchange`] with explicit tags (point-to-point uses per-pair sequence numbers).
    pub(crate) fn exchange_tagged(
        &mut self,
        send: Option<(usize, &[u8], Tag)>,
        recv: Option<(usize, &mut [u8], RecvMode<'_>, Tag)>,
    ) -> Result<()> {
        self.exchange_mirrored(send, None, recv)
    }

    /// [`Ctx::exchange`] whose sent bytes are also copied into `mirror` (same length as the sent
    /// data) piece by piece, right after each piece goes into a slot while it is still in cache:
    /// out-of-place collectives put their own input in place this way instead of with one big
    /// copy before the first send.
    pub(crate) fn exchange_mirrored(
        &mut self,
        send: Option<(usize, &[u8], Tag)>,
        mirror: Option<&mut [u8]>,
        recv: Option<(usize, &mut [u8], RecvMode<'_>, Tag)>,
    ) -> Result<()> {
        debug_assert!(mirror
            .as_ref()
            .is_none_or(|m| send.as_ref().is_some_and(|s| s.1.len() == m.len())));
        // No allocation on this path: every blocking exchange of every algorithm goes through it.
        let mut send =
            send.map(|(peer, data, tag)| SendPart::new(peer, data, tag).mirrored(mirror));
        let mut recv = recv.map(|(peer, buf, mode, tag)| RecvPart::new(peer, buf, mode, tag));
        self.exchange_many(send.as_mut_slice(), recv.as_mut_slice())
    }

    /// [`Ctx::exchange`] whose sent elements (of `scale.0`) leave multiplied by `scale.1`, scaled
    /// piece by piece into the slots (never straight from `data`): a rank's own input entering a
    /// pre-multiplied sum, without a pass of its own over the input first.
    pub(crate) fn exchange_scaled(
        &mut self,
        send: (usize, &[u8]),
        scale: (DType, f64),
        recv: Option<(usize, &mut [u8], RecvMode<'_>)>,
    ) -> Result<()> {
        let tag = self.tag;
        let mut send = SendPart::new(send.0, send.1, tag);
        send.scale = Some(scale);
        let mut recv = recv.map(|(peer, buf, mode)| RecvPart::new(peer, buf, mode, tag));
        self.exchange_many(std::slice::from_mut(&mut send), recv.as_mut_slice())
    }

    /// Several sends and receives at once (to and from different peers, or the same), all
    /// streamed slot by slot and interleaved so none can block another; returns when every one is
    /// complete. Peers are ranks of this context.
    pub(crate) fn exchange_many(
        &mut self,
        sends: &mut [SendPart<'_>],
        recvs: &mut [RecvPart<'_>],
    ) -> Result<()> {
        for s in sends.iter_mut() {
            s.peer = self.real(s.peer);
        }
        for r in recvs.iter_mut() {
            r.peer = self.real(r.peer);
        }
        if let Some(t) = self.send_thread.filter(|_| !recvs.is_empty()) {
            if sends.iter().any(|s| self.threadable(s, sends)) {
                return self.exchange_split(t, sends, recvs);
            }
        }
        self.exchange_loop(sends, recvs, None)
    }

    /// Whether `s` may go out on the send thread: a large plain send to a peer whose connection
    /// writes straight from the caller's memory (TCP), the only send to that peer here.
    fn threadable(&self, s: &SendPart<'_>, all: &[SendPart<'_>]) -> bool {
        s.data.len() >= SEND_THREAD_MIN
            && s.scale.is_none()
            && all.iter().filter(|o| o.peer == s.peer).count() == 1
            && self
                .links
                .send
                .get(s.peer)
                .and_then(|c| c.as_ref())
                .is_some_and(|c| c.sends_direct())
    }

    /// [`Ctx::exchange_many`] with its large TCP sends ([`Ctx::threadable`]) on a thread of their
    /// own, so the kernel's copies into the sockets run beside this thread's receives and
    /// reductions on another core ([`crate::Config::socket_send_thread`]).
    fn exchange_split(
        &mut self,
        thread: &SendThread,
        sends: &mut [SendPart<'_>],
        recvs: &mut [RecvPart<'_>],
    ) -> Result<()> {
        // The threaded sends go last; their connections leave `links` for the exchange.
        let mut flags: Vec<bool> = sends.iter().map(|s| self.threadable(s, sends)).collect();
        let (mut i, mut k) = (0, sends.len());
        while i < k {
            if flags[i] {
                k -= 1;
                sends.swap(i, k);
                flags.swap(i, k);
            } else {
                i += 1;
            }
        }
        let (mine, theirs) = sends.split_at_mut(k);
        let me = self.me();
        let mut conns = Vec::with_capacity(theirs.len());
        for s in theirs.iter() {
            match self.links.send.get_mut(s.peer).and_then(|c| c.take()) {
                Some(c) => conns.push(c),
                None => {
                    for (s, c) in theirs.iter().zip(conns) {
                        self.links.send[s.peer] = Some(c);
                    }
                    return Err(missing(me, self.op, s.peer, "send"));
                }
            }
        }
        let stop = AtomicU8::new(RUNNING);
        let sent = AtomicBool::new(false);
        let label = self.stall_label();
        let job = SendJob {
            deadline: self.deadline(Instant::now()),
            abort: self.abort,
            stop: &stop,
            op: self.op,
            me,
            stream: self.stream,
            timeout: self.timeout,
            stalls: self.stalls,
            trace: self.trace,
            label: label.clone(),
        };
        let first_peer = theirs.first().map_or(me, |s| s.peer);
        let mut theirs_r: Result<()> = Ok(());
        thread.exchanges.fetch_add(1, Ordering::Relaxed);
        let mine_r = thread.pool.in_place_scope(|sc| {
            let (conns, theirs, job, theirs_r, sent) =
                (&mut conns, &mut *theirs, &job, &mut theirs_r, &sent);
            sc.spawn(move |_| {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    send_loop(conns, theirs, job)
                }))
                .unwrap_or_else(|_| {
                    Err(Error::Transport {
                        rank: me,
                        peer: first_peer,
                        transport: "tcp",
                        msg: format!("{}: the send thread panicked", job.op),
                    })
                });
                if r.is_err() {
                    let _ = job.stop.compare_exchange(
                        RUNNING,
                        STOPPED_BY_SENDS,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                }
                *theirs_r = r;
                sent.store(true, Ordering::Release);
            });
            // A panic here must still stop the send thread (and give the connections back
            // below) before it goes on unwinding.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.exchange_loop(mine, recvs, Some(&stop))?;
                // Keep this thread's own connections going while the sends finish: a peer
                // may need frames still queued here to drain what the send thread writes.
                while !sent.load(Ordering::Acquire) && !self.links.all_flushed() {
                    if stop.load(Ordering::Acquire) != RUNNING {
                        break;
                    }
                    if !self.links.progress_all().map_err(|e| retag(self.op, e))? {
                        self.links.poll_fds(&mut self.fds);
                        sys::poll(&self.fds, 1);
                    }
                }
                Ok(())
            }));
            if !matches!(r, Ok(Ok(()))) {
                let _ = stop.compare_exchange(
                    RUNNING,
                    STOPPED_HERE,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
            }
            r
        });
        for (s, c) in theirs.iter().zip(conns) {
            self.links.send[s.peer] = Some(c);
        }
        let mine_r = match mine_r {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        // Whose failure stopped the exchange decides the error; when both threads reached the
        // deadline, one time-out names both waits.
        let with_report = |mut e: Error| {
            if let Error::Timeout { detail, .. } = &mut e {
                if let Some(r) = self.stalls.and_then(|s| s.report(&label.0, label.1)) {
                    *detail = format!("{detail}; {r}");
                }
            }
            e
        };
        match (mine_r, theirs_r) {
            (Ok(()), Ok(())) => Ok(()),
            (Err(m), Ok(())) => Err(m),
            (Ok(()), Err(t)) => Err(with_report(t)),
            (
                Err(Error::Timeout {
                    rank,
                    op,
                    timeout,
                    detail,
                }),
                Err(Error::Timeout {
                    detail: sending, ..
                }),
            ) => Err(Error::Timeout {
                rank,
                op,
                timeout,
                detail: format!("{sending}, {detail}"),
            }),
            (Err(m), Err(t)) => {
                if stop.load(Ordering::Acquire) == STOPPED_BY_SENDS {
                    Err(with_report(t))
                } else {
                    Err(m)
                }
            }
        }
    }

    /// The loop of [`Ctx::exchange_many`]; `stop` set (by the send thread, after an error)
    /// ends it early.
    fn exchange_loop(
        &mut self,
        sends: &mut [SendPart<'_>],
        recvs: &mut [RecvPart<'_>],
        stop: Option<&AtomicU8>,
    ) -> Result<()> {
        loop {
            if sends.iter().all(|s| s.done) && recvs.iter().all(|r| r.done) {
                return Ok(());
            }
            if stop.is_some_and(|s| s.load(Ordering::Relaxed) != RUNNING) {
                return Err(Error::Aborted {
                    rank: self.me(),
                    reason: format!("{}: the send thread failed", self.op),
                });
            }
            self.arm();
            let mut moved = false;
            for s in sends.iter_mut().filter(|s| !s.done) {
                moved |= self.send_some(s)?;
            }
            for r in recvs.iter_mut().filter(|r| !r.done) {
                if self.recv_one(r.peer, r.buf, &mut r.got, r.mode, &r.tag)? {
                    r.done = r.got == r.buf.len();
                    moved = true;
                }
            }
            if !moved {
                let desc = || {
                    let mut parts = Vec::new();
                    for s in sends.iter().filter(|s| !s.done) {
                        parts.push(format!(
                            "sending to rank {}: {}/{} bytes",
                            s.peer,
                            s.sent,
                            s.data.len()
                        ));
                    }
                    for r in recvs.iter().filter(|r| !r.done) {
                        parts.push(format!(
                            "receiving from rank {}: {}/{} bytes",
                            r.peer,
                            r.got,
                            r.buf.len()
                        ));
                    }
                    parts.join(", ")
                };
                self.idle(&desc)?;
            } else {
                // Progress: the next wait starts with a spin again.
                self.idle_since = None;
            }
        }
    }

    /// Moves the next piece of `s` into its connection; whether anything moved.
    fn send_some(&mut self, s: &mut SendPart<'_>) -> Result<bool> {
        let me = self.me();
        let conn = self
            .links
            .send
            .get_mut(s.peer)
            .and_then(|c| c.as_mut())
            .ok_or_else(|| missing(me, self.op, s.peer, "send"))?;
        let (data, sent) = (s.data, s.sent);
        // Large messages leave straight from the caller's memory where the backend can (TCP);
        // the rest is staged in slots.
        let direct = if data.len() >= DIRECT_SEND_MIN && s.scale.is_none() {
            conn.send_direct(&data[sent..], s.tag, direct_frame(data.len()))
                .map_err(|e| retag(self.op, e))?
        } else {
            None
        };
        let (n, progressed) = match direct {
            Some(n) => (n, n > 0),
            None => match conn.try_slot().map_err(|e| retag(self.op, e))? {
                Some(slot) => {
                    let n = match s.scale {
                        Some((dt, factor)) => {
                            // Whole elements per slot (slots are multiples of 64 bytes).
                            let whole = slot.len() / dt.size() * dt.size();
                            if whole == 0 {
                                return Err(Error::InvalidArgument {
                                    rank: me,
                                    op: self.op.into(),
                                    msg: format!(
                                        "a slot of {} bytes holds no {dt} element",
                                        slot.len()
                                    ),
                                });
                            }
                            let n = whole.min(data.len() - sent);
                            oxccl_kernels::scale_into_bytes(
                                dt,
                                &mut slot[..n],
                                &data[sent..sent + n],
                                factor,
                            )
                            .map_err(|e| Error::InvalidArgument {
                                rank: me,
                                op: self.op.into(),
                                msg: e.to_string(),
                            })?;
                            n
                        }
                        None => {
                            let n = slot.len().min(data.len() - sent);
                            slot[..n].copy_from_slice(&data[sent..sent + n]);
                            n
                        }
                    };
                    conn.post(n, s.tag).map_err(|e| retag(self.op, e))?;
                    (n, true)
                }
                None => (0, false),
            },
        };
        if progressed {
            if let Some(m) = s.mirror.as_mut() {
                copy(self.stream, &mut m[sent..sent + n], &data[sent..sent + n]);
            }
            s.sent += n;
            s.done = s.sent == data.len();
        }
        Ok(progressed)
    }

    /// Consumes one slot from `peer` (a communicator rank) into `buf[*got..]`; false if none has
    /// arrived.
    fn recv_one(
        &mut self,
        peer: usize,
        buf: &mut [u8],
        got: &mut usize,
        mode: RecvMode<'_>,
        want: &Tag,
    ) -> Result<bool> {
        let rank = self.me();
        let op = self.op;
        let conn = self
            .links
            .recv
            .get_mut(peer)
            .and_then(|c| c.as_mut())
            .ok_or_else(|| missing(rank, op, peer, "recv"))?;
        let Some((tag, data)) = conn.try_recv().map_err(|e| retag(op, e))? else {
            return Ok(false);
        };
        if tag != *want {
            let local = OpDesc::describe_tag(want);
            let remote = OpDesc::describe_tag(&tag);
            return Err(Error::Mismatch {
                rank,
                peer,
                seq: want.seq,
                local,
                remote,
            });
        }
        let n = data.len();
        if n > buf.len() - *got {
            return Err(proto_err(
                rank,
                peer,
                format!("{op}: {n} bytes arrived, {} expected", buf.len() - *got),
            ));
        }
        let dst = &mut buf[*got..*got + n];
        let kerr = |e: oxccl_kernels::KernelError| proto_err(rank, peer, format!("{op}: {e}"));
        match mode {
            RecvMode::Copy => copy(self.stream, dst, data),
            RecvMode::Reduce(dt, rop) => {
                oxccl_kernels::reduce_bytes(dt, rop, dst, data).map_err(kerr)?
            }
            RecvMode::ReduceFrom(dt, rop, src) => {
                let own = &src[*got..*got + n];
                oxccl_kernels::reduce_into_bytes(dt, rop, dst, own, data).map_err(kerr)?
            }
            RecvMode::ScaleReduce(dt, factor, src) => {
                match src {
                    Some(src) => {
                        let own = &src[*got..*got + n];
                        oxccl_kernels::scale_into_bytes(dt, dst, own, factor)
                    }
                    None => oxccl_kernels::scale_bytes(dt, dst, factor),
                }
                .map_err(kerr)?;
                oxccl_kernels::reduce_bytes(dt, ReduceOp::Sum, dst, data).map_err(kerr)?
            }
        }
        *got += n;
        conn.release()?;
        Ok(true)
    }

    /// Sends `data` to `peer`.
    pub(crate) fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        self.exchange(Some((peer, data)), None)
    }

    /// Receives into `buf` from `peer`.
    pub(crate) fn recv(&mut self, peer: usize, buf: &mut [u8], mode: RecvMode<'_>) -> Result<()> {
        self.exchange(None, Some((peer, buf, mode)))
    }

    /// Receives `buf` from `from` slot by slot and forwards each received piece (after applying
    /// `mode`, i.e. the reduced value) to `to`: the pipelined step of chains and trees.
    pub(crate) fn recv_forward(
        &mut self,
        from: usize,
        to: usize,
        buf: &mut [u8],
        mode: RecvMode<'_>,
    ) -> Result<()> {
        let tag = self.tag;
        let (from, to) = (self.real(from), self.real(to));
        let (mut got, mut fwd) = (0usize, 0usize);
        let (mut recv_frames, mut send_frames) = (0usize, 0usize);
        loop {
            let recv_done = got == buf.len() && recv_frames > 0;
            let send_done = fwd == buf.len() && send_frames > 0;
            if recv_done && send_done {
                return Ok(());
            }
            self.arm();
            let mut moved = false;
            if !recv_done && self.recv_one(from, buf, &mut got, mode, &tag)? {
                recv_frames += 1;
                moved = true;
            }
            if !send_done && (fwd < got || (recv_frames > 0 && got == buf.len())) {
                let me = self.me();
                let conn = self
                    .links
                    .send
                    .get_mut(to)
                    .and_then(|c| c.as_mut())
                    .ok_or_else(|| missing(me, self.op, to, "send"))?;
                if let Some(slot) = conn.try_slot().map_err(|e| retag(self.op, e))? {
                    let n = slot.len().min(got - fwd);
                    slot[..n].copy_from_slice(&buf[fwd..fwd + n]);
                    conn.post(n, tag).map_err(|e| retag(self.op, e))?;
                    fwd += n;
                    send_frames += 1;
                    moved = true;
                }
            }
            if !moved {
                let total = buf.len();
                self.idle(&|| format!("forwarding from rank {from} to rank {to}: received {got}/{total}, forwarded {fwd}/{total} bytes"))?;
            } else {
                self.idle_since = None;
            }
        }
    }

    /// Waits until everything posted has left this rank, so no data is stranded in a staging slot
    /// when the operation returns.
    pub(crate) fn flush(&mut self) -> Result<()> {
        while !self.links.all_flushed() {
            self.arm();
            self.idle(&|| "flushing sends".to_string())?;
        }
        Ok(())
    }
}

/// What the send thread of [`Ctx::exchange_split`] needs to know of the operation.
struct SendJob<'s> {
    deadline: Instant,
    abort: &'s AtomicBool,
    /// Set by the first thread to fail ([`STOPPED_HERE`], [`STOPPED_BY_SENDS`]): the other stops.
    stop: &'s AtomicU8,
    op: &'static str,
    me: usize,
    stream: bool,
    timeout: Duration,
    stalls: Option<&'s Stalls>,
    trace: Option<&'s crate::base::trace::Recorder>,
    /// The operation as stall reports name it, and its collective sequence number.
    label: (String, Option<u64>),
}

/// The send thread of [`Ctx::exchange_split`]: writes `parts` through their `conns` (in the same
/// order), waiting in `poll(2)` for room in the sockets, until every byte of every frame is
/// written (a frame's padding and frames queued before the exchange included: the receiver
/// needs them, and nobody else writes on these connections until they are back in `Links`),
/// `stop` is set or the operation's deadline passes. A wait that stalls is posted like the rank
/// thread's (see [`Ctx::idle`]), so a hang in a send names this rank's wait; a time-out's detail
/// says what was left to send (the caller adds the stall reports).
fn send_loop(
    conns: &mut [Box<dyn SendConn>],
    parts: &mut [SendPart<'_>],
    job: &SendJob<'_>,
) -> Result<()> {
    let waiting = |parts: &[SendPart<'_>], conns: &[Box<dyn SendConn>]| {
        parts
            .iter()
            .zip(conns)
            .filter(|(p, c)| !p.done || !c.flushed())
            .map(|(p, _)| {
                format!(
                    "sending to rank {}: {}/{} bytes (send thread)",
                    p.peer,
                    p.sent,
                    p.data.len()
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut fds = Vec::new();
    let mut idle_since: Option<Instant> = None;
    loop {
        if parts.iter().all(|p| p.done) && conns.iter().all(|c| c.flushed()) {
            return Ok(());
        }
        if job.stop.load(Ordering::Relaxed) != RUNNING {
            return Ok(()); // the exchange's own thread failed and reports why
        }
        if job.abort.load(Ordering::Relaxed) {
            return Err(Error::Aborted {
                rank: job.me,
                reason: format!("abort() called during {}", job.op),
            });
        }
        let mut moved = false;
        for (c, p) in conns.iter_mut().zip(parts.iter_mut()) {
            if p.done {
                // Only the rest of its last frame (or nothing) is left.
                moved |= c.progress().map_err(|e| retag(job.op, e))?;
                continue;
            }
            let n = c
                .send_direct(&p.data[p.sent..], p.tag, direct_frame(p.data.len()))
                .map_err(|e| retag(job.op, e))?
                .unwrap_or(0);
            if n > 0 {
                if let Some(m) = p.mirror.as_mut() {
                    copy(
                        job.stream,
                        &mut m[p.sent..p.sent + n],
                        &p.data[p.sent..p.sent + n],
                    );
                }
                p.sent += n;
                p.done = p.sent == p.data.len();
                moved = true;
            }
        }
        if moved {
            idle_since = None;
            continue;
        }
        let now = Instant::now();
        let since = *idle_since.get_or_insert(now);
        if now >= job.deadline {
            return Err(Error::Timeout {
                rank: job.me,
                op: job.op.to_string(),
                timeout: job.timeout,
                detail: waiting(parts, conns),
            });
        }
        if let Some(s) = job.stalls.filter(|s| now - since >= s.after && !s.posted()) {
            s.post(
                job.label.0.clone(),
                job.label.1,
                now - since,
                waiting(parts, conns),
            );
            if let Some(t) = job.trace {
                t.dump_in_background("stalled");
            }
        }
        fds.clear();
        for c in conns.iter() {
            c.poll_fds(&mut fds);
        }
        sys::poll(&fds, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_send_thread_writes_a_frames_padding_before_it_returns() {
        use crate::transport::tcp::{padding_candidates, small_sender};
        use std::io::Read;
        let big = vec![7u8; 128 << 10];
        let mut cases = 0;
        for len in padding_candidates() {
            let (mut check, _rx) = small_sender();
            let took = check
                .send_direct(&big[..len], Tag::default(), len)
                .unwrap()
                .unwrap();
            if took != len || check.flushed() {
                continue; // not stopped in the padding: another length
            }
            // Stopped in the padding on a fresh pair: do it again through the send thread's loop,
            // with the receiver reading only after a while.
            let (tx, mut rx) = small_sender();
            let mut conns: Vec<Box<dyn SendConn>> = vec![Box::new(tx)];
            let mut parts = [SendPart::new(1, &big[..len], Tag::default())];
            let (stop, abort) = (AtomicU8::new(RUNNING), AtomicBool::new(false));
            let job = SendJob {
                deadline: Instant::now() + Duration::from_secs(10),
                abort: &abort,
                stop: &stop,
                op: "test",
                me: 0,
                stream: false,
                timeout: Duration::from_secs(10),
                stalls: None,
                trace: None,
                label: ("test".into(), None),
            };
            let got = std::thread::scope(|s| {
                let reader = s.spawn(move || {
                    std::thread::sleep(Duration::from_millis(50));
                    let (mut got, end) = (Vec::new(), Instant::now() + Duration::from_secs(10));
                    let mut buf = vec![0u8; 1 << 16];
                    while got.len() < 64 + len.next_multiple_of(64) && Instant::now() < end {
                        match rx.read(&mut buf) {
                            Ok(0) => break,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                            Err(_) => std::thread::sleep(Duration::from_millis(1)),
                        }
                    }
                    got.len()
                });
                send_loop(&mut conns, &mut parts, &job).unwrap();
                assert!(
                    conns[0].flushed(),
                    "frame of {len} bytes: send_loop returned with its padding unwritten"
                );
                reader.join().unwrap()
            });
            assert_eq!(got, 64 + len.next_multiple_of(64), "frame of {len} bytes");
            cases += 1;
            if cases == 2 {
                break;
            }
        }
        assert!(cases > 0, "no candidate length stopped inside the padding");
    }

    #[test]
    fn node_layouts_of_equal_and_different_sizes() {
        let even = NodeLayout::new(&["a", "b", "a", "b"], 2).unwrap();
        assert_eq!(even.ranks, vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(
            (even.node, even.local, even.pieces, even.even),
            (0, 1, 2, true)
        );
        assert_eq!(even.cross_group, vec![2, 3]);
        assert!(even.balanced());
        // 4 + 3: local rank 3 of node a carries no piece, so it is in no cross ring.
        let nodes = ["a", "a", "a", "a", "b", "b", "b"];
        let extra = NodeLayout::new(&nodes, 3).unwrap();
        assert_eq!((extra.pieces, extra.even, extra.local), (3, false, 3));
        assert!(extra.cross_group.is_empty());
        assert_eq!(NodeLayout::new(&nodes, 5).unwrap().cross_group, vec![1, 5]);
        assert!(extra.balanced());
        // 2 + 5: allowed (OXCCL_ALGO), but the tuner leaves it flat.
        let skewed = ["a", "a", "b", "b", "b", "b", "b"];
        assert!(!NodeLayout::new(&skewed, 0).unwrap().balanced());
        // No layout: one node, or a node with a single rank.
        assert_eq!(NodeLayout::new(&["a", "a", "a"], 0), None);
        assert_eq!(NodeLayout::new(&["a", "a", "b"], 0), None);
    }

    /// A deadline first set inside a sub-context is the whole operation's: the parent and later
    /// sub-contexts (nested ones too) keep it instead of starting a fresh one.
    #[test]
    fn sub_contexts_share_the_operation_deadline() {
        let mut links = Links::default();
        let abort = AtomicBool::new(false);
        let timeout = Duration::from_secs(3600);
        let mut ctx = Ctx::new(0, 1, &mut links, Tag::default(), "t", timeout, &abort);
        let members = [0usize];
        {
            let mut s = ctx.sub(&members);
            s.idle(&String::new).unwrap();
            assert!(s.deadline.is_some());
        }
        let d = ctx.deadline;
        assert!(
            d.is_some(),
            "the parent keeps the deadline its sub-context set"
        );
        {
            let mut s = ctx.sub(&members);
            assert_eq!(s.deadline, d);
            s.idle(&String::new).unwrap();
            assert_eq!(s.deadline, d);
        }
        // Nested, with the deadline first set in the innermost context.
        let mut links = Links::default();
        let mut ctx = Ctx::new(0, 1, &mut links, Tag::default(), "t", timeout, &abort);
        {
            let mut s = ctx.sub(&members);
            {
                let mut s2 = s.sub(&members);
                s2.idle(&String::new).unwrap();
            }
            let inner = s.deadline(Instant::now());
            assert_eq!(s.root_deadline.as_deref().copied().flatten(), Some(inner));
        }
        let d = ctx.deadline.expect("set by the innermost context");
        assert_eq!(ctx.deadline(Instant::now() + timeout), d);
    }
}
