//! The transport trait: how bytes move between two ranks, whatever the medium.
//!
//! A transport connects a *send half* on one rank to a *receive half* on another, like NCCL's
//! connectors. Each half owns a fixed number of **slots** (NCCL's FIFO steps) of a fixed size:
//!
//! - the sender asks for the next free slot ([`SendConn::try_slot`]), fills it (copy or reduce
//!   straight into it) and posts it with a [`Tag`] ([`SendConn::post`]);
//! - the receiver asks for the next filled slot ([`RecvConn::try_recv`]), consumes it (copy or
//!   reduce straight out of it into the user's buffer) and releases it ([`RecvConn::release`]).
//!
//! Nothing blocks: `try_*` return `None` when no slot is ready and [`SendConn::progress`] /
//! [`RecvConn::progress`] move bytes without waiting. The waiting (spin, yield, poll, deadlines)
//! lives in one place, the primitives in `crate::algorithm::prims`, so every backend gets the same deadlines
//! and abort behaviour. The model fits every medium oxccl targets: TCP (slots are staging
//! buffers, progress is non-blocking socket I/O), shared memory (slots live in a mapped ring, post
//! is a release-store of the head counter), CUDA IPC (slots in device memory) and RDMA (slots are
//! registered memory, post is an RDMA write with immediate).
//!
//! Every slot carries a [`Tag`]: the sequence number and description of the operation it belongs
//! to. The receiver compares it with what it expects, which is how ranks that call different
//! collectives get [`crate::Error::Mismatch`] instead of garbage.

#[cfg(feature = "cuda-core")]
pub(crate) mod cuda_ipc;
mod links;
pub(crate) mod rdma;
pub(crate) mod registry;
pub(crate) mod select;
pub mod shm;
pub mod tcp;

pub(crate) use links::Links;
pub(crate) use select::Selector;

use std::os::fd::RawFd;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::base::bootstrap::{is_wait_timeout, Store};
use crate::base::config::Config;
use crate::base::error::{Error, Result};

pub use crate::base::op::Tag;

pub use crate::base::sys::PollDir;

/// What a rank sleeps on while it waits for peers that write into its memory: they ring it
/// when they post (shared memory's doorbell, a futex in the rank's segment). An eventcount that
/// peers ring only while someone sleeps on it: a waiter first [`Doorbell::announce`]s itself,
/// then reads [`Doorbell::seq`] before a round of checks, and [`Doorbell::sleep_since`] ends at
/// once if a peer rang after that read. A post that lands before the announcement is seen by
/// that round of checks; one after it rings. Ranks that only spin never announce, so their peers'
/// posts touch none of their cache lines.
pub trait Doorbell: Send + Sync {
    /// The counter, read before a round of checks.
    fn seq(&self) -> u32;
    /// Counts (`true`) or uncounts (`false`) one sleeper: while any is counted, posts ring.
    fn announce(&self, sleeping: bool);
    /// Sleeps at most `timeout`, unless the bell rang since the counter read `seen`. Call it
    /// announced, with `seen` read after the announcement.
    fn sleep_since(&self, seen: u32, timeout: std::time::Duration);
}

/// The send half of a connection to one peer.
pub trait SendConn: Send {
    /// The next free slot, or `None` if every slot is still in flight.
    ///
    /// # Errors
    /// The connection failed (peer lost, I/O error).
    fn try_slot(&mut self) -> Result<Option<&mut [u8]>>;
    /// Publishes the slot handed out by the last `try_slot` with its first `len` bytes filled.
    ///
    /// # Errors
    /// The connection failed, or no slot was handed out.
    fn post(&mut self, len: usize, tag: Tag) -> Result<()>;
    /// Moves bytes without blocking; `Ok(true)` if anything moved.
    ///
    /// # Errors
    /// The connection failed.
    fn progress(&mut self) -> Result<bool>;
    /// True when every posted slot has left this side.
    fn flushed(&self) -> bool;
    /// File descriptors to poll while idle (empty for backends without fds).
    fn poll_fds(&self, out: &mut Vec<(RawFd, PollDir)>);
    /// Says goodbye to the peer (all data posted so far is delivered first, within `deadline`),
    /// so that the peer can tell a finished rank from a dead one.
    fn close(&mut self, deadline: std::time::Instant);
    /// Sends the rest of a message straight from the caller's memory, without staging it in a
    /// slot: `data` starts at the first byte not taken yet (the caller advances by what earlier
    /// calls returned, and keeps calling until everything is taken before it posts anything
    /// else). The receiver sees ordinary frames of at most `frame` bytes, and at most a slot, tagged
    /// `tag` (smaller frames let the receiver start on a message before all of it has arrived),
    /// or, where it offered its buffer ([`RecvConn::recv_direct`]), frames that landed there.
    /// `Some(0)` may also mean the backend holds the message back for a short while.
    /// Returns how many bytes were taken now (possibly 0), or `None` when the backend has no such
    /// path (the default) and the caller must use slots.
    ///
    /// # Errors
    /// The connection failed.
    fn send_direct(&mut self, data: &[u8], tag: Tag, frame: usize) -> Result<Option<usize>> {
        let _ = (data, tag, frame);
        Ok(None)
    }

    /// Forwards bytes of a message as they become available (a chain's middle rank): `avail` holds the next bytes not sent yet, `rest` how many of the message are
    /// still to send (`avail` is their start). Where the receiver offered its buffer for the
    /// message, writes them there and returns how many were taken (possibly 0: no slot free);
    /// `None` (the default) when no offer takes them: the caller sends them through a slot.
    ///
    /// # Errors
    /// The connection failed.
    fn forward_offered(
        &mut self,
        avail: &[u8],
        rest: usize,
        tag: Tag,
        frame: usize,
    ) -> Result<Option<usize>> {
        let _ = (avail, rest, tag, frame);
        Ok(None)
    }

    /// Whether [`SendConn::send_direct`] sends (rather than returning `None`).
    fn sends_direct(&self) -> bool {
        false
    }
}

/// The receive half of a connection from one peer.
pub trait RecvConn: Send {
    /// The next filled slot in order, with its tag, or `None` if none has arrived yet.
    ///
    /// # Errors
    /// The connection failed, or the peer closed it while this rank expects data.
    fn try_recv(&mut self) -> Result<Option<(Tag, &[u8])>>;
    /// Gives the slot returned by the last `try_recv` back to the sender.
    ///
    /// # Errors
    /// The connection failed, or nothing was received.
    fn release(&mut self) -> Result<()>;
    /// Moves bytes without blocking; `Ok(true)` if anything moved.
    ///
    /// # Errors
    /// The connection failed (including the peer dying: `PeerLost`).
    fn progress(&mut self) -> Result<bool>;
    /// File descriptors to poll while idle (empty for backends without fds).
    fn poll_fds(&self, out: &mut Vec<(RawFd, PollDir)>);
    /// Tells the sender this rank will read no more (it fails at its next post instead of
    /// waiting for a slot that will never be released). Dropping does this for sockets.
    fn close(&mut self) {}
    /// Lets the sender write the rest of a message straight into the caller's memory: `buf`
    /// starts at the first byte not received yet (the caller advances by what earlier calls
    /// returned and by the slots it took meanwhile) and ends with the message, tagged `tag`;
    /// the caller keeps calling, and taking ordinary slots with [`RecvConn::try_recv`], until
    /// all of it arrived. Returns how many bytes landed at the start of `buf` now, in order
    /// (0 when the next frame, if any, is an ordinary slot), or `None` when the backend has no
    /// such path or declined this message (the default): then the slots carry all of it.
    ///
    /// # Errors
    /// The connection failed, or the sender broke the protocol.
    fn recv_direct(&mut self, buf: &mut [u8], tag: Tag) -> Result<Option<usize>> {
        let _ = (buf, tag);
        Ok(None)
    }
}

/// Memory that every rank of a communicator can read directly (ranks that share memory): each
/// rank owns a **staging area** of two halves of [`Window::capacity`] bytes and a **step counter**
/// that it publishes; peers wait for a rank's counter to reach a step, then read its staging (or,
/// with [`Window::single_copy`], the user buffer whose address it published) without any message.
///
/// The direct algorithms (`algorithm/direct.rs`) are written against this trait. Operation `k`
/// of a communicator's window traffic is its *epoch*; epoch `e` uses half `e % 2` and steps
/// `4e + 1` (input ready), `4e + 2` (reduced part ready), `4e + 3` (done reading peers). A rank
/// writes half `e % 2` only after every peer has published step `4(e - 1) + 1`, i.e. finished
/// epoch `e - 2`, so two halves need no barrier at the end of an operation.
/// The most bytes any [`Window`] carries inline (see [`Window::publish_inline`]).
pub const INLINE_MAX: usize = 8 * INLINE_WORDS;
/// [`INLINE_MAX`] in 8-byte words.
pub const INLINE_WORDS: usize = 2;

/// A [`crate::Registered`] buffer as a rank publishes it through [`Window::publish_shared`]:
/// where peers on the node find its memory to map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedBuf {
    /// The descriptor of its shared file in the publishing process.
    pub fd: i32,
    /// Its registry entry's id (never reused in that process): a new id at a known descriptor
    /// is another buffer.
    pub id: u64,
    /// The buffer's first byte in the file.
    pub offset: usize,
}

pub trait Window: Send {
    /// Bytes of one staging half.
    fn capacity(&self) -> usize;
    /// Whether [`Window::read_peer`] works between every pair of ranks (checked at start-up).
    fn single_copy(&self) -> bool;
    /// Starts the next epoch and returns its number (the same on every rank).
    fn next_epoch(&mut self) -> u64;
    /// This rank's and its peers' staging half `half`.
    fn staging(&mut self, half: usize) -> Staging<'_>;
    /// Publishes `step` with the operation's `tag` and the addresses of this rank's input and
    /// output buffers (`[0, 0]` when unused) for epoch half `half`, and wakes sleeping peers.
    fn publish(&mut self, step: u64, tag: Tag, half: usize, region: [usize; 2]);
    /// Bytes that [`Window::publish_inline`] carries in the record itself (0: none).
    fn inline_capacity(&self) -> usize {
        0
    }
    /// [`Window::publish`] of a step whose data (at most [`Window::inline_capacity`] bytes)
    /// travels in the record with the tag: a peer that sees the step has the data in the same
    /// cache line, with no staging half touched.
    fn publish_inline(&mut self, step: u64, tag: Tag, half: usize, data: &[u8]);
    /// The data `peer` published with half `half` through [`Window::publish_inline`], in words
    /// (aligned for every element type): its first bytes are the data.
    fn peer_inline(&self, peer: usize, half: usize) -> [u64; INLINE_WORDS];
    /// The last step `peer` published; with `Some(half)`, the last it published with that half
    /// (read from the record that holds the half's tag, so a wait for a step and its tag reads
    /// one cache line of the peer's).
    fn step(&self, peer: usize, half: Option<usize>) -> u64;
    /// The tag `peer` published with half `half` (`None` before its first publication).
    fn peer_tag(&self, peer: usize, half: usize) -> Option<Tag>;
    /// The buffer addresses `peer` published with half `half`.
    fn peer_region(&self, peer: usize, half: usize) -> [usize; 2];
    /// `PeerLost` when `peer` closed its window (it failed or left) or its process died.
    ///
    /// # Errors
    /// As above.
    fn check(&mut self, peer: usize) -> Result<()>;
    /// Copies `dst.len()` bytes at address `addr` of `peer`'s address space into `dst` (one copy,
    /// `process_vm_readv`); only while `peer` guarantees, by the step protocol, that the bytes do
    /// not change.
    ///
    /// # Errors
    /// `Error::Transport` when the read fails (single copy unsupported, or a bad address).
    fn read_peer(&self, peer: usize, addr: usize, dst: &mut [u8]) -> Result<()>;
    /// Copies `src` to address `addr` of `peer`'s address space (`process_vm_writev`); only
    /// where `peer` published that range for this rank to write, by the step protocol.
    ///
    /// # Errors
    /// `Error::Transport` when the write fails.
    fn write_peer(&self, peer: usize, addr: usize, src: &[u8]) -> Result<()>;
    /// Tells every peer this rank has left (they fail instead of waiting for its steps).
    fn close(&mut self);
    /// Whether every rank can map every other's registered buffers (checked at start-up), so
    /// that [`Window::peer_shared`] works between every pair of ranks.
    fn can_map(&self) -> bool {
        false
    }
    /// [`Window::publish`] of a step that carries one registered buffer of this rank (`None`:
    /// the operation's buffer is not one) for peers to map with [`Window::peer_shared`].
    fn publish_shared(&mut self, step: u64, tag: Tag, half: usize, buf: Option<SharedBuf>) {
        let _ = buf;
        self.publish(step, tag, half, [0, 0]);
    }
    /// Whether `peer` published a buffer with half `half` through [`Window::publish_shared`]
    /// (nothing is mapped).
    fn peer_has_shared(&self, peer: usize, half: usize) -> bool {
        let _ = (peer, half);
        false
    }
    /// The address here of `len` bytes of the buffer `peer` published with half `half` through
    /// [`Window::publish_shared`] (mapped at its first use and kept), or `None` when it
    /// published none. Writes through it land in the peer's buffer; only where the step
    /// protocol gives them to this rank.
    ///
    /// # Errors
    /// `Error::Transport` naming the peer: the buffer could not be mapped, or it is shorter than
    /// `len` bytes.
    fn peer_shared(&mut self, peer: usize, half: usize, len: usize) -> Result<Option<*mut u8>> {
        let _ = (peer, half, len);
        Ok(None)
    }
}

/// One staging half of every rank of a [`Window`], borrowed for one step of an algorithm.
pub struct Staging<'a> {
    rank: usize,
    len: usize,
    /// Base address of each rank's half (this rank's included).
    bases: Vec<*mut u8>,
    _window: std::marker::PhantomData<&'a mut ()>,
}

impl<'a> Staging<'a> {
    /// A view of `bases` (one per rank, each `len` bytes long).
    ///
    /// # Safety
    /// Every base must point to `len` bytes that stay mapped for `'a`; `bases[rank]` must be
    /// written by nobody else while the view lives, and the other halves must not be written at
    /// the byte ranges this rank reads until it publishes the step that says it is done.
    pub(crate) unsafe fn new(rank: usize, len: usize, bases: Vec<*mut u8>) -> Staging<'a> {
        Staging {
            rank,
            len,
            bases,
            _window: std::marker::PhantomData,
        }
    }

    fn check(&self, peer: usize, r: &std::ops::Range<usize>) {
        assert!(
            peer < self.bases.len() && r.start <= r.end && r.end <= self.len,
            "staging range {r:?} of rank {peer} out of bounds (capacity {})",
            self.len
        );
    }

    /// Bytes `r` of this rank's half, to write.
    pub fn own(&mut self, r: std::ops::Range<usize>) -> &mut [u8] {
        self.check(self.rank, &r);
        // SAFETY: in bounds (checked); this rank's half is written only through `&mut self`, so
        // no other slice of it from this view is alive (see `Staging::new`).
        unsafe { std::slice::from_raw_parts_mut(self.bases[self.rank].add(r.start), r.len()) }
    }

    /// Bytes `r` of `peer`'s half (this rank's own half when `peer` is this rank).
    pub fn peer(&self, peer: usize, r: std::ops::Range<usize>) -> &[u8] {
        self.check(peer, &r);
        // SAFETY: in bounds (checked); the protocol of `Staging::new` keeps these bytes unchanged
        // while `&self` is borrowed (this rank's own half cannot be written through `&self`).
        unsafe { std::slice::from_raw_parts(self.bases[peer].add(r.start), r.len()) }
    }

    /// Bytes `r` of this rank's half, to write, and the same bytes of another rank's half.
    pub fn own_and_peer(&mut self, r: std::ops::Range<usize>, peer: usize) -> (&mut [u8], &[u8]) {
        assert_ne!(peer, self.rank, "own_and_peer needs another rank");
        self.check(peer, &r);
        self.check(self.rank, &r);
        // SAFETY: both in bounds; the halves belong to different ranks, so the slices do not
        // overlap; exclusivity of the own half as in `own`, stability of the peer's as in `peer`.
        unsafe {
            (
                std::slice::from_raw_parts_mut(self.bases[self.rank].add(r.start), r.len()),
                std::slice::from_raw_parts(self.bases[peer].add(r.start), r.len()),
            )
        }
    }
}

/// Whether a backend can connect a pair of ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reach {
    /// Yes.
    Yes,
    /// Not for this pair (e.g. shared memory across nodes), with the reason.
    No(String),
    /// The backend is compiled out; names the cargo feature that enables it.
    Unsupported(&'static str),
}

/// What a backend knows about a rank when deciding whether it can connect to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo {
    /// Rank in the communicator.
    pub rank: usize,
    /// Node id (hostname or `OXCCL_NODE_ID`).
    pub node_id: String,
    /// Process id.
    pub pid: u32,
    /// Address of the rank's TCP listener (`ip:port`, IPv6 in brackets).
    pub tcp_addr: String,
    /// CPUs the rank may run on (empty: unknown), cut to its CPU quota
    /// ([`crate::base::affinity::usable_cpus`]); see [`crate::base::affinity`].
    pub cpus: Vec<usize>,
    /// Ranks on this rank's node as the communicator it was made from counted them (0: none);
    /// the `auto` rules of `OXCCL_SOCKET_CHANNELS`, `OXCCL_SPIN` and `OXCCL_SOCKET_SEND_THREAD`
    /// share the node's CPUs among at least that many ([`crate::base::affinity::node_share`]).
    pub node_ranks: usize,
    /// CPUs on this rank's node as the communicator it was made from counted them (0: none).
    pub node_cpus: usize,
    /// The verbs port this rank offers to RDMA peers (`mlx5_0:1`), or, after a `!`, why it
    /// offers none (no device, no active port, ...); empty where RDMA was not probed (a build
    /// without the feature `rdma`, `OXCCL_TRANSPORT=tcp` or `shm`, the `sim` provider).
    /// No newline.
    pub rdma: String,
    /// Settings every rank of the communicator must share, as `(variable, canonical value)`
    /// pairs (`OXCCL_TRANSPORT`, `OXCCL_ALGO`, `OXCCL_CUDA_STAGE_CHUNK`,
    /// `OXCCL_HIERARCHICAL_BLOCK`, `OXCCL_SOCKET_CHANNELS`), compared at init.
    /// Neither part may contain a newline, nor a variable name `=`.
    pub settings: Vec<(String, String)>,
}

impl PeerInfo {
    /// Encoding for the store: one field a line (rank, node id, pid, TCP address, CPUs, node
    /// ranks, node CPUs, RDMA port), then one `variable=value` line per setting.
    pub fn encode(&self) -> Vec<u8> {
        let mut s = format!(
            "{}\n{}\n{}\n{}\n{}\n{}\n{}\n{}",
            self.rank,
            self.node_id,
            self.pid,
            self.tcp_addr,
            crate::base::affinity::encode_cpus(&self.cpus),
            self.node_ranks,
            self.node_cpus,
            self.rdma
        );
        for (name, value) in &self.settings {
            s.push_str(&format!("\n{name}={value}"));
        }
        s.into_bytes()
    }

    /// The rank as [`crate::base::affinity::node_share`] counts it.
    pub fn node_member(&self) -> crate::base::affinity::NodeMember<'_> {
        crate::base::affinity::NodeMember {
            cpus: &self.cpus,
            node_ranks: self.node_ranks,
            node_cpus: self.node_cpus,
        }
    }

    /// Inverse of [`PeerInfo::encode`].
    ///
    /// # Errors
    /// `Error::Store` if the bytes are not a peer record: the message names the field that is
    /// missing or invalid, and the rank the record claims to be from when that much is readable.
    pub fn decode(b: &[u8]) -> Result<PeerInfo> {
        let text = String::from_utf8_lossy(b);
        let whose = text
            .split('\n')
            .next()
            .and_then(|v| v.parse::<usize>().ok())
            .map_or_else(String::new, |r| format!(" of rank {r}"));
        let bad = |field: &str| {
            crate::Error::Store(format!(
                "malformed peer record{whose}: {field} missing or invalid in {text:?}"
            ))
        };
        let s = std::str::from_utf8(b).map_err(|_| bad("UTF-8 text"))?;
        let mut it = s.split('\n');
        let rank = it
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad("rank (line 1)"))?;
        let node_id = it
            .next()
            .ok_or_else(|| bad("node id (line 2)"))?
            .to_string();
        let pid = it
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad("process id (line 3)"))?;
        let tcp_addr = it
            .next()
            .ok_or_else(|| bad("TCP address (line 4)"))?
            .to_string();
        let cpus = it
            .next()
            .and_then(crate::base::affinity::decode_cpus)
            .ok_or_else(|| bad("CPU list (line 5)"))?;
        let node_ranks = it
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad("node ranks (line 6)"))?;
        let node_cpus = it
            .next()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad("node CPUs (line 7)"))?;
        let rdma = it
            .next()
            .ok_or_else(|| bad("RDMA port (line 8)"))?
            .to_string();
        let settings = it
            .map(|line| match line.split_once('=') {
                Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
                _ => Err(bad(&format!("setting {line:?} (expected variable=value)"))),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PeerInfo {
            rank,
            node_id,
            pid,
            tcp_addr,
            cpus,
            node_ranks,
            node_cpus,
            rdma,
            settings,
        })
    }
}

/// What a transport needs to know of the communicator it connects: who is who, where ranks
/// meet (the store, under keys below `id`), the settings, and which backend the selector gave
/// every pair.
pub(crate) struct Group<'a> {
    /// This rank.
    pub rank: usize,
    /// Ranks in the communicator.
    pub size: usize,
    /// The communicator's id (the same on every rank): store keys live below it.
    pub id: &'a str,
    /// Where ranks publish what peers need to connect.
    pub store: &'a Arc<dyn Store>,
    /// The communicator's settings.
    pub cfg: &'a Config,
    /// Every rank's record, this rank's included, indexed by rank.
    pub peers: &'a [PeerInfo],
    /// This rank hosts the store server (its leaving takes the store down for everyone): CUDA
    /// IPC's tear-down waits for the peers before such a rank leaves.
    #[cfg_attr(not(feature = "cuda-core"), allow(dead_code))]
    pub hosts_store: bool,
    /// The selector, which says for any pair of ranks which backend connects them.
    pub selector: &'a Selector,
    /// When connecting must be done.
    pub deadline: Instant,
}

impl Group<'_> {
    /// The backend that carries host memory between ranks `a` and `b` (the same answer on
    /// every rank), `None` for `a == b` or when none can.
    pub fn host_route(&self, a: usize, b: usize) -> Option<&'static str> {
        (a != b)
            .then(|| self.selector.host(&self.peers[a], &self.peers[b]).ok())
            .flatten()
    }

    /// Where the first rank whose connecting fails says why (first writer wins).
    fn failed_key(&self) -> String {
        format!("{}/connect_failed", self.id)
    }

    /// Tells the other ranks that connecting failed on this rank, and why, so that their waits
    /// for it end at once with the cause ([`Group::wait_get`]).
    pub fn publish_failure(&self, why: &Error) {
        let msg = format!("rank {} could not connect: {why}", self.rank);
        let _ = self
            .store
            .compare_set(&self.failed_key(), None, msg.as_bytes());
    }

    /// The failure another rank published, as this rank's `Config` error (`Ok` while none).
    pub fn check_failed(&self) -> Result<()> {
        match self.store.try_get(&self.failed_key()) {
            Ok(Some(why)) => Err(Error::Config(format!(
                "rank {}: init: {}",
                self.rank,
                String::from_utf8_lossy(&why)
            ))),
            _ => Ok(()),
        }
    }

    /// Waits for `key` in the store until the deadline, looking every [`FAILED_POLL`] for a
    /// failure another rank published (which ends the wait with it).
    ///
    /// # Errors
    /// The published failure; else the store's error (a time-out names the key).
    pub fn wait_get(&self, key: &str) -> Result<Vec<u8>> {
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            let slice = left.min(FAILED_POLL).max(Duration::from_millis(1));
            match self.store.get(key, slice) {
                Ok(v) => return Ok(v),
                Err(Error::Store(msg))
                    if is_wait_timeout(&msg) && Instant::now() < self.deadline =>
                {
                    self.check_failed()?;
                }
                Err(e) => {
                    self.check_failed()?;
                    return Err(e);
                }
            }
        }
    }
}

/// How often a rank waiting for a peer's connection details looks for a published failure.
pub(crate) const FAILED_POLL: Duration = Duration::from_millis(200);

/// Which memory a backend carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// Host memory, through slots ([`SendConn`], [`RecvConn`]): every host collective, and
    /// device buffers staged through pinned host memory.
    Host,
    /// Device memory, read in place by kernels on the peers' streams (CUDA IPC).
    Device,
}

/// Whether a backend can connect ranks `a` and `b`: a pure function of their records and the
/// communicator's settings, so both ranks of a pair (and every other rank) answer alike.
pub(crate) type CanConnect = fn(a: &PeerInfo, b: &PeerInfo, cfg: &Config) -> Reach;

/// The rule of backends that connect only ranks of one node (shared memory, CUDA IPC).
pub(crate) fn same_node(a: &PeerInfo, b: &PeerInfo, _: &Config) -> Reach {
    if a.node_id == b.node_id {
        Reach::Yes
    } else {
        Reach::No(format!(
            "rank {} is on node {:?} and rank {} on node {:?}: shared memory only connects \
             ranks of one node",
            a.rank, a.node_id, b.rank, b.node_id
        ))
    }
}

/// A connection backend, as in NCCL's transport table: whether it can connect a pair of ranks,
/// then a connect in two steps, [`Transport::setup`] (this rank's side, published for the
/// peers; never waits) and [`Transport::connect`] (the peers' sides met, the send and receive
/// halves made). Every rank sets up every backend it was given peers for before any rank
/// connects one, so no rank waits for a peer that is waiting for it. One instance per
/// communicator and rank, made before the ranks exchange their records ([`Transport::advertise`]
/// adds what peers need to the record).
///
/// Adding a backend: a folder under `transport/`, an implementation of this trait, and its row
/// in [`select::backends`] (in priority order).
pub(crate) trait Transport: Send {
    /// Short name used in logs and by `OXCCL_TRANSPORT` (`shm`, `tcp`, `cuda_ipc`).
    fn name(&self) -> &'static str;
    /// The memory this backend carries.
    fn memory(&self) -> Memory;
    /// The rule that says whether this backend can connect a pair.
    fn can_connect(&self) -> CanConnect;
    /// Adds what peers need to connect to this rank (an address) to this rank's record.
    fn advertise(&self, me: &mut PeerInfo) {
        let _ = me;
    }
    /// Makes this rank's side of the connections to `peers` (the ranks the selector gave this
    /// backend) and publishes what they need through the store; never waits for a peer.
    ///
    /// # Errors
    /// A local resource cannot be made (a full `/dev/shm`), or the store fails.
    fn setup(&mut self, group: &Group<'_>, peers: &[usize]) -> Result<()>;
    /// Meets each of `peers`' sides (waiting at most until `group.deadline`) and puts the send
    /// and receive halves to them into `links`.
    ///
    /// # Errors
    /// A peer does not connect in time, or connecting fails (naming the peer).
    fn connect(&mut self, group: &Group<'_>, peers: &[usize], links: &mut Links) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_info_round_trip() {
        let p = PeerInfo {
            rank: 3,
            node_id: "node-7".into(),
            pid: 42,
            tcp_addr: "[::1]:5000".into(),
            cpus: vec![0, 1, 3],
            node_ranks: 8,
            node_cpus: 16,
            rdma: "!no verbs device".into(),
            settings: vec![
                ("OXCCL_TRANSPORT".into(), "tcp".into()),
                ("OXCCL_ALGO".into(), "all-reduce=ring,broadcast=tree".into()),
                ("OXCCL_CUDA_STAGE_CHUNK".into(), "".into()),
            ],
        };
        assert_eq!(PeerInfo::decode(&p.encode()).unwrap(), p);
        let none = PeerInfo {
            settings: Vec::new(),
            ..p.clone()
        };
        assert_eq!(PeerInfo::decode(&none.encode()).unwrap(), none);
        assert!(PeerInfo::decode(b"garbage").is_err());
    }

    #[test]
    fn malformed_peer_record_says_whose_and_what() {
        let e = PeerInfo::decode(b"7\nnode\nnotapid\n1.2.3.4:5\n0-3").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("rank 7") && msg.contains("process id"),
            "{msg}"
        );
        let e =
            PeerInfo::decode(b"7\nnode\n1\n1.2.3.4:5\n0-3\n2\n4\n\nno-equals-sign").unwrap_err();
        assert!(e.to_string().contains("no-equals-sign"), "{e}");
        let e = PeerInfo::decode(b"7\nnode\n1\n1.2.3.4:5\n0-3\nA=b").unwrap_err();
        assert!(e.to_string().contains("node ranks (line 6)"), "{e}");
        let e = PeerInfo::decode(b"7\nnode\n1\n1.2.3.4:5\n0-3\n2\nA=b").unwrap_err();
        assert!(e.to_string().contains("node CPUs (line 7)"), "{e}");
        let e = PeerInfo::decode(b"7\nnode\n1\n1.2.3.4:5\n0-3\n2\n4").unwrap_err();
        assert!(e.to_string().contains("RDMA port (line 8)"), "{e}");
        let e = PeerInfo::decode(b"x").unwrap_err();
        assert!(e.to_string().contains("rank (line 1)"), "{e}");
    }
}
