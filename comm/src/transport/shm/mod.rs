//! Shared-memory backend: ranks on one node exchange slots through `/dev/shm`.
//!
//! Each rank creates **one segment** per communicator, `/dev/shm/oxccl-<job>-<comm>-r<rank>`,
//! holding its doorbell and one receive ring per same-node peer. A ring is a single-producer,
//! single-consumer queue of `nslots` fixed slots:
//!
//! ```text
//! segment: [header 128 B][bell 128 B][ring 0][ring 1]...[direct area]
//! ring:    [head 128 B][tail 128 B][closed flags 128 B][meta: nslots x 32 B, padded][slot 0][slot 1]...
//! ```
//!
//! `head` (written by the sender only) counts posted slots, `tail` (written by the receiver only)
//! counts released ones; each sits alone in its own 128-byte block so the two sides never share
//! a cache line (nor its adjacent-line prefetch partner). The sender fills slot `head % nslots`
//! and its meta (length and [`Tag`]), then publishes with a release-store of `head + 1`; the
//! receiver acquire-loads `head`, reduces or copies straight out of the slot, then release-stores
//! `tail + 1`. No locks, no copies beyond the one into the slot. `comm/tests/loom_ring.rs`
//! model-checks this protocol (same orderings) with loom.
//!
//! **Direct window.** When every rank of the communicator shares memory, each segment also ends
//! with a direct area: a step counter, the tag and buffer addresses published with each half, and
//! two staging halves of `OXCCL_SHM_DIRECT_BYTES`; [`ShmWindow`] maps every rank's and implements
//! [`Window`] for the one-shot / two-shot / single-copy all-reduce. Ranks may size their halves
//! differently: the window's capacity is the smallest, the same on every rank.
//!
//! **Waiting.** Every rank has one doorbell: a sequence counter and a sleeper count. A post rings
//! the receiver's bell, a release rings the sender's; ringing bumps the counter and calls
//! `futex(FUTEX_WAKE)` only when someone sleeps. A waiting rank spins, yields, then sleeps in
//! `futex(FUTEX_WAIT)` on its own bell (see `crate::algorithm::prims`), so oversubscribed ranks sleep instead
//! of spinning. The waiter reads the counter *before* it checks its rings and sleeps only while
//! the counter still has that value (an eventcount): a post that lands after the check changes
//! the counter, so the wait returns at once; the sleeper count only saves wake-up syscalls.
//!
//! **Liveness.** A dead peer closes no socket, so each connection holds a `pidfd` of its peer
//! and checks it every few milliseconds while waiting: a killed rank is `PeerLost` at once.
//! `closed` flags tell a finished or failed peer from a dead one: the sender sets its bit when it
//! closes (the receiver then fails instead of waiting, once it has read every slot posted before),
//! the receiver sets its bit when it stops reading (the sender then fails instead of waiting for a
//! slot). A closed or dead peer is only an error after `head` is read again and still unmet.
//!
//! **Hygiene.** Segments are unlinked as soon as every peer has mapped them (the mappings stay
//! valid), so a rank killed after start-up leaves nothing in `/dev/shm`; `oxccl launch` also
//! removes `/dev/shm/oxccl-<job>-*` when a job ends. Space is reserved with `posix_fallocate`, so a
//! `/dev/shm` that is too small is a clear error naming the bytes needed, not a `SIGBUS` later.

mod connect;

#[cfg(test)]
pub(crate) use connect::can_connect;
pub(crate) use connect::ShmTransport;

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use crate::base::error::{Error, Result};
use crate::base::sys;
use crate::transport::{Doorbell, PollDir, RecvConn, SendConn, Staging, Tag, Window};

const MAGIC: u64 = 0x4f58_4343_4c01_7368; // "OXCCL\x01sh"
const BLOCK: usize = 128;
const META: usize = 32;
const HEADER: usize = BLOCK;
const BELL: usize = BLOCK;
/// `closed` bits: the sender said goodbye; the receiver will read no more.
const SENDER_CLOSED: u64 = 1;
const RECEIVER_CLOSED: u64 = 2;
/// How often a waiting connection checks that its peer process is alive.
const LIVENESS_EVERY: Duration = Duration::from_millis(5);

/// Directory of the segments (tmpfs).
pub const SHM_DIR: &str = "/dev/shm";

/// Bytes of one ring.
fn ring_bytes(slot_size: usize, nslots: usize) -> usize {
    3 * BLOCK + (nslots * META).next_multiple_of(BLOCK) + nslots * slot_size
}

/// Bytes of the direct area (step block, tag block, two staging halves of `direct` bytes).
fn direct_area_bytes(direct: usize) -> usize {
    2 * BLOCK + 2 * direct.next_multiple_of(BLOCK)
}

/// Bytes of a segment with `nrings` rings and staging halves of `direct` bytes.
pub fn segment_bytes(nrings: usize, slot_size: usize, nslots: usize, direct: usize) -> usize {
    HEADER + BELL + nrings * ring_bytes(slot_size, nslots) + direct_area_bytes(direct)
}

/// The `/dev/shm` prefix of every segment of a job (what `oxccl launch` removes at the end).
pub fn job_prefix(job: &str) -> String {
    let clean: String = job
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("oxccl-{clean}-")
}

/// A mapped segment (this rank's own, or a peer's).
pub struct Segment {
    map: MmapMut,
    base: *mut u8,
    slot_size: usize,
    nslots: usize,
    nrings: usize,
    /// Bytes of one staging half of the direct area.
    direct: usize,
}

// SAFETY: the mapping is plain shared memory; every access to it goes through atomics (head,
// tail, closed, bell) or through slot regions whose ownership the head/tail protocol hands over
// between exactly one writer and one reader. The raw base pointer stays valid as long as `map`.
unsafe impl Send for Segment {}
// SAFETY: as above; shared references only read the geometry or use atomics.
unsafe impl Sync for Segment {}

impl Segment {
    fn atomic_u64(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.map.len());
        // SAFETY: `off` is 8-aligned inside the page-aligned mapping (asserted in debug), the
        // memory lives as long as `self`, and it is only ever accessed atomically.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    fn atomic_u32(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= self.map.len());
        // SAFETY: as for `atomic_u64`.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    fn ring_off(&self, ring: usize) -> usize {
        HEADER + BELL + ring * ring_bytes(self.slot_size, self.nslots)
    }

    fn head(&self, ring: usize) -> &AtomicU64 {
        self.atomic_u64(self.ring_off(ring))
    }

    fn tail(&self, ring: usize) -> &AtomicU64 {
        self.atomic_u64(self.ring_off(ring) + BLOCK)
    }

    fn closed(&self, ring: usize) -> &AtomicU64 {
        self.atomic_u64(self.ring_off(ring) + 2 * BLOCK)
    }

    fn meta_off(&self, ring: usize, slot: usize) -> usize {
        self.ring_off(ring) + 3 * BLOCK + slot * META
    }

    fn slot_off(&self, ring: usize, slot: usize) -> usize {
        self.ring_off(ring)
            + 3 * BLOCK
            + (self.nslots * META).next_multiple_of(BLOCK)
            + slot * self.slot_size
    }

    /// Offset of the direct area: step block, tag block, two staging halves.
    fn direct_off(&self) -> usize {
        HEADER + BELL + self.nrings * ring_bytes(self.slot_size, self.nslots)
    }

    /// The step counter of the direct area (written by the owner only).
    fn step(&self) -> &AtomicU64 {
        self.atomic_u64(self.direct_off())
    }

    /// Set when the owner closed its window.
    fn window_closed(&self) -> &AtomicU64 {
        self.atomic_u64(self.direct_off() + 64)
    }

    /// Word `i` of the published record of half `half`: `[seq + 1, desc, count, in, out]`.
    fn record(&self, half: usize, i: usize) -> &AtomicU64 {
        debug_assert!(half < 2 && i < 8);
        self.atomic_u64(self.direct_off() + BLOCK + half * 64 + i * 8)
    }

    /// Address of staging half `half`.
    fn staging_ptr(&self, half: usize) -> *mut u8 {
        let off = self.direct_off() + 2 * BLOCK + half * self.direct.next_multiple_of(BLOCK);
        debug_assert!(off + self.direct <= self.map.len());
        // SAFETY: the offset lies inside the mapping (the segment size includes the direct area).
        unsafe { self.base.add(off) }
    }

    /// Rings this segment's doorbell (its owner sleeps on it).
    pub fn ring_bell(&self) {
        let seq = self.atomic_u32(HEADER);
        seq.fetch_add(1, Ordering::SeqCst);
        if self.atomic_u32(HEADER + 64).load(Ordering::SeqCst) > 0 {
            sys::futex_wake(seq);
        }
    }

    /// Creates this rank's segment with `nrings` receive rings.
    ///
    /// # Errors
    /// `Error::Config` when `/dev/shm` lacks the space (naming the bytes needed and free);
    /// `Error::Transport` for other failures.
    pub fn create(
        rank: usize,
        name: &str,
        nrings: usize,
        slot_size: usize,
        nslots: usize,
        direct: usize,
    ) -> Result<(Segment, PathBuf)> {
        let path = PathBuf::from(SHM_DIR).join(name);
        let terr = |msg: String| Error::Transport {
            rank,
            peer: rank,
            transport: "shm",
            msg,
        };
        let _ = std::fs::remove_file(&path); // a stale segment of a crashed attempt
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| terr(format!("creating {}: {e}", path.display())))?;
        // From here on, every early return (or panic) removes the file again.
        let unlink = UnlinkGuard(Some(path.clone()));
        let bytes = segment_bytes(nrings, slot_size, nslots, direct);
        if let Err(e) = sys::fallocate(file.as_raw_fd(), bytes) {
            let free = sys::free_bytes(SHM_DIR);
            return Err(if sys::no_room(&e) {
                Error::Config(format!(
                    "rank {rank}: {SHM_DIR} is too small: the shared-memory transport needs {bytes} bytes for this rank \
                     ({nrings} peers x {nslots} slots x {slot_size} B, 2 x {direct} B staging) and {free} bytes are \
                     free; enlarge it (e.g. docker --shm-size), lower OXCCL_SLOT_BYTES/OXCCL_NSLOTS/\
                     OXCCL_SHM_DIRECT_BYTES, or set OXCCL_TRANSPORT=tcp"
                ))
            } else {
                terr(format!(
                    "reserving {bytes} bytes in {}: {e}",
                    path.display()
                ))
            });
        }
        let seg = Self::map(rank, &file, &path)?;
        let seg = Segment {
            slot_size,
            nslots,
            nrings,
            direct,
            ..seg
        };
        seg.atomic_u64(32).store(direct as u64, Ordering::Relaxed);
        seg.atomic_u64(40)
            .store(seg.base as usize as u64, Ordering::Relaxed);
        seg.atomic_u64(8).store(nrings as u64, Ordering::Relaxed);
        seg.atomic_u64(16)
            .store(slot_size as u64, Ordering::Relaxed);
        seg.atomic_u64(24).store(nslots as u64, Ordering::Relaxed);
        seg.atomic_u64(0).store(MAGIC, Ordering::Release);
        unlink.disarm();
        Ok((seg, path))
    }

    /// Maps a peer's segment and reads its geometry.
    ///
    /// # Errors
    /// `Error::Transport` when the file cannot be opened or is not an oxccl segment.
    pub fn open(rank: usize, peer: usize, path: &str) -> Result<Segment> {
        let terr = |msg: String| Error::Transport {
            rank,
            peer,
            transport: "shm",
            msg,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| terr(format!("opening {path}: {e}")))?;
        let seg = Self::map(rank, &file, &PathBuf::from(path))?;
        if seg.map.len() < HEADER + BELL || seg.atomic_u64(0).load(Ordering::Acquire) != MAGIC {
            return Err(terr(format!("{path} is not an oxccl segment")));
        }
        let (nrings, slot_size, nslots, direct) = (
            seg.atomic_u64(8).load(Ordering::Relaxed) as usize,
            seg.atomic_u64(16).load(Ordering::Relaxed) as usize,
            seg.atomic_u64(24).load(Ordering::Relaxed) as usize,
            seg.atomic_u64(32).load(Ordering::Relaxed) as usize,
        );
        if slot_size == 0
            || nslots == 0
            || seg.map.len() < segment_bytes(nrings, slot_size, nslots, direct)
        {
            return Err(terr(format!("{path} has an inconsistent header")));
        }
        Ok(Segment {
            slot_size,
            nslots,
            nrings,
            direct,
            ..seg
        })
    }

    fn map(rank: usize, file: &File, path: &std::path::Path) -> Result<Segment> {
        // SAFETY: the file is a tmpfs segment that only oxccl ranks of this communicator map;
        // its size is fixed (fallocated before publication) so the mapping never outlives the
        // file's extent, and concurrent access follows the ring protocol described above.
        let mut map = unsafe { MmapMut::map_mut(file) }.map_err(|e| Error::Transport {
            rank,
            peer: rank,
            transport: "shm",
            msg: format!("mapping {}: {e}", path.display()),
        })?;
        let base = map.as_mut_ptr();
        Ok(Segment {
            map,
            base,
            slot_size: 0,
            nslots: 0,
            nrings: 0,
            direct: 0,
        })
    }

    /// Number of rings in this segment.
    pub fn nrings(&self) -> usize {
        self.nrings
    }

    /// Where the owner mapped this segment in its own address space (for the single-copy probe).
    pub fn owner_base(&self) -> usize {
        self.atomic_u64(40).load(Ordering::Relaxed) as usize
    }
}

impl Doorbell for Segment {
    /// The doorbell's counter. A waiter reads it *before* checking its rings, then sleeps with
    /// [`Doorbell::sleep_since`]: any ring after the read ends the sleep at once.
    fn seq(&self) -> u32 {
        self.atomic_u32(HEADER).load(Ordering::SeqCst)
    }

    /// Sleeps on this segment's doorbell for at most `timeout`, unless it rang since `seen`.
    fn sleep_since(&self, seen: u32, timeout: Duration) {
        let seq = self.atomic_u32(HEADER);
        let sleepers = self.atomic_u32(HEADER + 64);
        sleepers.fetch_add(1, Ordering::SeqCst);
        sys::futex_wait(seq, seen, timeout);
        sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Removes a freshly created segment file when dropped, unless disarmed: an error (or a panic)
/// between creating and handing out the segment leaves nothing in `/dev/shm`.
pub(crate) struct UnlinkGuard(Option<PathBuf>);

impl UnlinkGuard {
    /// Removes `path` when dropped, unless disarmed.
    pub(crate) fn new(path: PathBuf) -> Self {
        UnlinkGuard(Some(path))
    }

    /// Keeps the file (removing it is now the caller's job).
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for UnlinkGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Watches a peer process: readable pidfd = the process is gone.
struct Liveness {
    pidfd: Option<OwnedFd>,
    last: Instant,
}

impl Liveness {
    fn new(pid: u32) -> Liveness {
        // Ranks that are threads of this process share its pid: nothing to watch.
        let pidfd = if pid == std::process::id() {
            None
        } else {
            sys::pidfd_open(pid)
        };
        Liveness {
            pidfd,
            last: Instant::now(),
        }
    }

    /// `PeerLost` once the peer process has exited (checked at most every `LIVENESS_EVERY`).
    fn check(&mut self, rank: usize, peer: usize) -> Result<()> {
        if self.dead() {
            return Err(lost(rank, peer, "process exited (seen through its pidfd)"));
        }
        Ok(())
    }

    fn dead(&mut self) -> bool {
        let Some(fd) = &self.pidfd else { return false };
        if self.last.elapsed() < LIVENESS_EVERY {
            return false;
        }
        self.last = Instant::now();
        sys::readable(fd.as_raw_fd())
    }
}

fn lost(rank: usize, peer: usize, detail: &str) -> Error {
    Error::PeerLost {
        rank,
        peer,
        op: "shm transfer".into(),
        detail: detail.into(),
    }
}

/// Send half: writes into ring `ring` of the peer's segment.
pub struct ShmSend {
    rank: usize,
    peer: usize,
    dst: Arc<Segment>,
    ring: usize,
    own: Arc<Segment>,
    head: u64,
    handed_out: bool,
    live: Liveness,
}

impl ShmSend {
    pub(crate) fn new(
        rank: usize,
        peer: usize,
        peer_pid: u32,
        dst: Arc<Segment>,
        ring: usize,
        own: Arc<Segment>,
    ) -> ShmSend {
        let head = dst.head(ring).load(Ordering::Acquire);
        ShmSend {
            rank,
            peer,
            dst,
            ring,
            own,
            head,
            handed_out: false,
            live: Liveness::new(peer_pid),
        }
    }
}

impl SendConn for ShmSend {
    fn try_slot(&mut self) -> Result<Option<&mut [u8]>> {
        if self.dst.closed(self.ring).load(Ordering::Acquire) & RECEIVER_CLOSED != 0 {
            return Err(lost(
                self.rank,
                self.peer,
                "peer closed its communicator (or failed) and reads no more",
            ));
        }
        let tail = self.dst.tail(self.ring).load(Ordering::Acquire);
        if self.head - tail >= self.dst.nslots as u64 {
            self.live.check(self.rank, self.peer)?;
            return Ok(None);
        }
        self.handed_out = true;
        let off = self
            .dst
            .slot_off(self.ring, (self.head % self.dst.nslots as u64) as usize);
        // SAFETY: slot `head % nslots` is owned by this sender until it publishes `head + 1`:
        // the receiver has released it (tail > head - nslots, acquire-loaded above) and reads
        // it again only after the release-store in `post`. The region lies inside the mapping.
        Ok(Some(unsafe {
            std::slice::from_raw_parts_mut(self.dst.base.add(off), self.dst.slot_size)
        }))
    }

    fn post(&mut self, len: usize, tag: Tag) -> Result<()> {
        if !self.handed_out || len > self.dst.slot_size {
            return Err(Error::Transport {
                rank: self.rank,
                peer: self.peer,
                transport: "shm",
                msg: format!("post of {len} bytes without a free slot"),
            });
        }
        self.handed_out = false;
        let slot = (self.head % self.dst.nslots as u64) as usize;
        let m = self.dst.meta_off(self.ring, slot);
        self.dst.atomic_u64(m).store(len as u64, Ordering::Relaxed);
        self.dst.atomic_u64(m + 8).store(tag.seq, Ordering::Relaxed);
        self.dst
            .atomic_u64(m + 16)
            .store(tag.desc, Ordering::Relaxed);
        self.dst
            .atomic_u64(m + 24)
            .store(tag.count, Ordering::Relaxed);
        self.head += 1;
        self.dst.head(self.ring).store(self.head, Ordering::Release);
        self.dst.ring_bell();
        Ok(())
    }

    fn progress(&mut self) -> Result<bool> {
        Ok(false)
    }

    fn flushed(&self) -> bool {
        true
    }

    fn poll_fds(&self, _out: &mut Vec<(RawFd, PollDir)>) {}

    fn close(&mut self, _deadline: Instant) {
        self.dst
            .closed(self.ring)
            .fetch_or(SENDER_CLOSED, Ordering::AcqRel);
        self.dst.ring_bell();
        let _ = &self.own;
    }
}

/// Receive half: reads ring `ring` of this rank's own segment.
pub struct ShmRecv {
    rank: usize,
    peer: usize,
    own: Arc<Segment>,
    ring: usize,
    /// The peer's segment, whose bell a release rings.
    peer_seg: Arc<Segment>,
    tail: u64,
    handed_out: bool,
    live: Liveness,
}

impl ShmRecv {
    pub(crate) fn new(
        rank: usize,
        peer: usize,
        peer_pid: u32,
        own: Arc<Segment>,
        ring: usize,
        peer_seg: Arc<Segment>,
    ) -> ShmRecv {
        let tail = own.tail(ring).load(Ordering::Acquire);
        ShmRecv {
            rank,
            peer,
            own,
            ring,
            peer_seg,
            tail,
            handed_out: false,
            live: Liveness::new(peer_pid),
        }
    }
}

impl RecvConn for ShmRecv {
    fn try_recv(&mut self) -> Result<Option<(Tag, &[u8])>> {
        if self.own.head(self.ring).load(Ordering::Acquire) == self.tail {
            let gone = if self.own.closed(self.ring).load(Ordering::Acquire) & SENDER_CLOSED != 0 {
                "peer closed its communicator while this rank still expects data"
            } else if self.live.dead() {
                "process exited (seen through its pidfd)"
            } else {
                return Ok(None);
            };
            // The peer may have posted its last slot and left between the two loads: its head
            // store comes before its goodbye (or exit), so this load sees every slot it posted.
            if self.own.head(self.ring).load(Ordering::Acquire) == self.tail {
                return Err(lost(self.rank, self.peer, gone));
            }
        }
        let slot = (self.tail % self.own.nslots as u64) as usize;
        let m = self.own.meta_off(self.ring, slot);
        let len = self.own.atomic_u64(m).load(Ordering::Relaxed) as usize;
        let tag = Tag {
            seq: self.own.atomic_u64(m + 8).load(Ordering::Relaxed),
            desc: self.own.atomic_u64(m + 16).load(Ordering::Relaxed),
            count: self.own.atomic_u64(m + 24).load(Ordering::Relaxed),
        };
        if len > self.own.slot_size {
            return Err(Error::Transport {
                rank: self.rank,
                peer: self.peer,
                transport: "shm",
                msg: format!("corrupt slot length {len}"),
            });
        }
        self.handed_out = true;
        let off = self.own.slot_off(self.ring, slot);
        // SAFETY: the sender published this slot with a release-store of head (acquire-loaded
        // above) and does not touch it again until we release it; the region is in the mapping.
        Ok(Some((tag, unsafe {
            std::slice::from_raw_parts(self.own.base.add(off), len)
        })))
    }

    fn release(&mut self) -> Result<()> {
        if !self.handed_out {
            return Err(Error::Transport {
                rank: self.rank,
                peer: self.peer,
                transport: "shm",
                msg: "release without a received slot".into(),
            });
        }
        self.handed_out = false;
        self.tail += 1;
        self.own.tail(self.ring).store(self.tail, Ordering::Release);
        self.peer_seg.ring_bell();
        Ok(())
    }

    fn progress(&mut self) -> Result<bool> {
        Ok(false)
    }

    fn poll_fds(&self, _out: &mut Vec<(RawFd, PollDir)>) {}

    fn close(&mut self) {
        self.own
            .closed(self.ring)
            .fetch_or(RECEIVER_CLOSED, Ordering::AcqRel);
        self.peer_seg.ring_bell();
    }
}

/// The direct [`Window`] of a communicator whose ranks all share memory: every rank's segment
/// (this rank's included) mapped here, indexed by rank.
pub struct ShmWindow {
    rank: usize,
    segs: Vec<Arc<Segment>>,
    /// Bytes of one staging half on every rank: the smallest of the segments' `direct` (each
    /// rank sized its own from its `OXCCL_SHM_DIRECT_BYTES`; every rank maps every segment, so
    /// all compute the same value and the tuner decides the same everywhere).
    capacity: usize,
    pids: Vec<u32>,
    live: Vec<Liveness>,
    epoch: u64,
    single_copy: bool,
}

impl ShmWindow {
    /// `segs[r]` is rank `r`'s segment, `pids[r]` its process id; `single_copy` says whether
    /// every rank could read every other with `process_vm_readv` (see [`probe_single_copy`]).
    pub(crate) fn new(
        rank: usize,
        segs: Vec<Arc<Segment>>,
        pids: Vec<u32>,
        single_copy: bool,
    ) -> ShmWindow {
        let live = pids.iter().map(|&p| Liveness::new(p)).collect();
        let capacity = segs.iter().map(|s| s.direct).min().unwrap_or(0);
        ShmWindow {
            rank,
            segs,
            capacity,
            pids,
            live,
            epoch: 0,
            single_copy,
        }
    }
}

impl Window for ShmWindow {
    fn capacity(&self) -> usize {
        self.capacity
    }

    fn single_copy(&self) -> bool {
        self.single_copy
    }

    fn next_epoch(&mut self) -> u64 {
        self.epoch += 1;
        self.epoch - 1
    }

    fn staging(&mut self, half: usize) -> Staging<'_> {
        let bases = self.segs.iter().map(|s| s.staging_ptr(half % 2)).collect();
        // SAFETY: `capacity` is the smallest `direct` of all segments, so every rank's half holds
        // at least `capacity` bytes, inside a mapping (`create`/`open` checked the mapping covers
        // the direct area) that `self.segs` keeps alive for the borrow; the step protocol of
        // `Window` (followed by `algorithm::direct`) keeps other ranks off this rank's half and
        // this rank off the bytes of peers' halves it reads.
        unsafe { Staging::new(self.rank, self.capacity, bases) }
    }

    fn publish(&mut self, step: u64, tag: Tag, half: usize, region: [usize; 2]) {
        let own = &self.segs[self.rank];
        let words = [
            tag.seq + 1,
            tag.desc,
            tag.count,
            region[0] as u64,
            region[1] as u64,
        ];
        for (i, w) in words.into_iter().enumerate() {
            own.record(half % 2, i).store(w, Ordering::Relaxed);
        }
        own.step().store(step, Ordering::Release);
        for (p, s) in self.segs.iter().enumerate() {
            if p != self.rank {
                s.ring_bell();
            }
        }
    }

    fn step(&self, peer: usize) -> u64 {
        self.segs[peer].step().load(Ordering::Acquire)
    }

    fn peer_tag(&self, peer: usize, half: usize) -> Option<Tag> {
        let s = &self.segs[peer];
        let seq = s.record(half % 2, 0).load(Ordering::Relaxed);
        (seq > 0).then(|| Tag {
            seq: seq - 1,
            desc: s.record(half % 2, 1).load(Ordering::Relaxed),
            count: s.record(half % 2, 2).load(Ordering::Relaxed),
        })
    }

    fn peer_region(&self, peer: usize, half: usize) -> [usize; 2] {
        let s = &self.segs[peer];
        [
            s.record(half % 2, 3).load(Ordering::Relaxed) as usize,
            s.record(half % 2, 4).load(Ordering::Relaxed) as usize,
        ]
    }

    fn check(&mut self, peer: usize) -> Result<()> {
        if self.segs[peer].window_closed().load(Ordering::Acquire) != 0 {
            return Err(lost(
                self.rank,
                peer,
                "peer closed its communicator (or failed) during a direct operation",
            ));
        }
        self.live[peer].check(self.rank, peer)
    }

    fn read_peer(&self, peer: usize, addr: usize, dst: &mut [u8]) -> Result<()> {
        sys::read_remote(self.pids[peer], addr, dst).map_err(|e| Error::Transport {
            rank: self.rank,
            peer,
            transport: "shm",
            msg: format!("process_vm_readv of {} bytes at {addr:#x}: {e}", dst.len()),
        })
    }

    fn close(&mut self) {
        let own = &self.segs[self.rank];
        own.window_closed().store(1, Ordering::Release);
        for (p, s) in self.segs.iter().enumerate() {
            if p != self.rank {
                s.ring_bell();
            }
        }
    }
}

/// Whether this process can read `peer`'s memory with `process_vm_readv` (containers without
/// `CAP_SYS_PTRACE`, Yama's ptrace_scope >= 2 or a seccomp filter forbid it): reads the magic
/// word of the peer's own segment at the address where the peer mapped it.
pub(crate) fn probe_single_copy(peer_pid: u32, peer_seg: &Segment) -> bool {
    let mut word = [0u8; 8];
    sys::read_remote(peer_pid, peer_seg.owner_base(), &mut word).is_ok()
        && u64::from_ne_bytes(word) == MAGIC
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_round_trip_in_one_process() {
        let name = format!("oxccl-unittest-{}-r0", std::process::id());
        let (seg, path) = Segment::create(0, &name, 1, 64, 2, 256).unwrap();
        let own = Arc::new(seg);
        let peer = Arc::new(Segment::open(1, 0, path.to_str().unwrap()).unwrap());
        std::fs::remove_file(&path).unwrap();
        let mut tx = ShmSend::new(1, 0, std::process::id(), own.clone(), 0, peer.clone());
        let mut rx = ShmRecv::new(0, 1, std::process::id(), own.clone(), 0, peer);
        for round in 0..5u8 {
            for k in 0..2u8 {
                let s = tx.try_slot().unwrap().expect("free slot");
                s[..3].copy_from_slice(&[round, k, 7]);
                tx.post(
                    3,
                    Tag {
                        seq: round as u64,
                        desc: k as u64,
                        count: 3,
                    },
                )
                .unwrap();
            }
            assert!(tx.try_slot().unwrap().is_none(), "both slots in flight");
            for k in 0..2u8 {
                let (tag, data) = rx.try_recv().unwrap().expect("posted");
                assert_eq!(
                    (tag.seq, tag.desc, data),
                    (round as u64, k as u64, &[round, k, 7][..])
                );
                rx.release().unwrap();
            }
            assert!(rx.try_recv().unwrap().is_none());
        }
        tx.close(Instant::now());
        assert!(matches!(rx.try_recv(), Err(Error::PeerLost { .. })));
    }

    /// A peer that posts its last slot and closes before the receiver looks: the data is there,
    /// so the receiver gets it (and only then `PeerLost`).
    #[test]
    fn a_slot_posted_before_the_goodbye_is_delivered() {
        let name = format!("oxccl-unittest-{}-bye", std::process::id());
        let (seg, path) = Segment::create(0, &name, 1, 64, 2, 0).unwrap();
        let own = Arc::new(seg);
        let peer = Arc::new(Segment::open(1, 0, path.to_str().unwrap()).unwrap());
        std::fs::remove_file(&path).unwrap();
        let mut tx = ShmSend::new(1, 0, std::process::id(), own.clone(), 0, peer.clone());
        let mut rx = ShmRecv::new(0, 1, std::process::id(), own.clone(), 0, peer);
        tx.try_slot().unwrap().expect("free slot")[0] = 42;
        let tag = Tag {
            seq: 1,
            desc: 2,
            count: 1,
        };
        tx.post(1, tag).unwrap();
        tx.close(Instant::now());
        let (got, data) = rx.try_recv().unwrap().expect("the posted slot");
        assert_eq!((got, data), (tag, &[42u8][..]));
        rx.release().unwrap();
        assert!(matches!(rx.try_recv(), Err(Error::PeerLost { .. })));
    }

    /// The same with the sender on another thread, racing the receiver's checks: posting then
    /// closing must never look like a goodbye with the data missing. (The window between the
    /// receiver's two loads is short; 20 000 rounds hit it on every run measured, not surely.)
    #[test]
    fn a_goodbye_racing_the_last_post_is_not_a_loss() {
        let name = format!("oxccl-unittest-{}-race", std::process::id());
        let (seg, path) = Segment::create(0, &name, 1, 64, 2, 0).unwrap();
        let own = Arc::new(seg);
        let peer = Arc::new(Segment::open(1, 0, path.to_str().unwrap()).unwrap());
        std::fs::remove_file(&path).unwrap();
        let mut tx = ShmSend::new(1, 0, std::process::id(), own.clone(), 0, peer.clone());
        let mut rx = ShmRecv::new(0, 1, std::process::id(), own.clone(), 0, peer);
        let (go_tx, go_rx) = std::sync::mpsc::channel::<bool>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let sender = std::thread::spawn(move || {
            while go_rx.recv().unwrap_or(false) {
                let slot = loop {
                    if let Some(s) = tx.try_slot().unwrap() {
                        break s;
                    }
                };
                slot[0] = 7;
                tx.post(1, Tag::default()).unwrap();
                tx.close(Instant::now());
                let _ = done_tx.send(());
            }
        });
        let deadline = Instant::now() + Duration::from_secs(60);
        for round in 0..20_000 {
            go_tx.send(true).unwrap();
            let got = loop {
                match rx.try_recv() {
                    Ok(Some((_, d))) => break d[0],
                    Ok(None) => assert!(Instant::now() < deadline, "round {round}: no data"),
                    Err(e) => panic!("round {round}: {e}"),
                }
            };
            assert_eq!(got, 7);
            rx.release().unwrap();
            done_rx.recv_timeout(Duration::from_secs(60)).unwrap();
            // Reopen the ring for the next round.
            own.closed(0).store(0, Ordering::Release);
        }
        go_tx.send(false).unwrap();
        sender.join().unwrap();
    }

    /// Segments sized from different `OXCCL_SHM_DIRECT_BYTES`: every rank's window has the
    /// smallest staging half, so staging reads stay inside every segment and every rank's tuner
    /// sees the same capacity.
    #[test]
    fn window_capacity_is_the_smallest_staging_half() {
        let pid = std::process::id();
        let sizes = [8192usize, 4096, 16384];
        let mut own = Vec::new();
        let mut paths = Vec::new();
        for (r, &d) in sizes.iter().enumerate() {
            let name = format!("oxccl-unittest-{pid}-cap-r{r}");
            let (seg, path) = Segment::create(r, &name, 2, 64, 2, d).unwrap();
            own.push(Arc::new(seg));
            paths.push(path);
        }
        let windows: Vec<ShmWindow> = (0..sizes.len())
            .map(|rank| {
                let segs = (0..sizes.len())
                    .map(|r| {
                        if r == rank {
                            own[r].clone()
                        } else {
                            Arc::new(Segment::open(rank, r, paths[r].to_str().unwrap()).unwrap())
                        }
                    })
                    .collect();
                ShmWindow::new(rank, segs, vec![pid; sizes.len()], false)
            })
            .collect();
        for p in paths {
            std::fs::remove_file(p).unwrap();
        }
        for (rank, mut w) in windows.into_iter().enumerate() {
            assert_eq!(w.capacity(), 4096, "rank {rank}");
            let mut st = w.staging(1);
            st.own(0..4096).fill(rank as u8 + 1);
            for p in 0..sizes.len() {
                assert_eq!(st.peer(p, 0..4096).len(), 4096);
            }
        }
    }

    /// The guard removes a file unless disarmed.
    #[test]
    fn unlink_guard_removes_unless_disarmed() {
        let pid = std::process::id();
        let a = PathBuf::from(SHM_DIR).join(format!("oxccl-unittest-{pid}-guard-a"));
        let b = PathBuf::from(SHM_DIR).join(format!("oxccl-unittest-{pid}-guard-b"));
        std::fs::write(&a, b"x").unwrap();
        std::fs::write(&b, b"x").unwrap();
        drop(UnlinkGuard(Some(a.clone())));
        UnlinkGuard(Some(b.clone())).disarm();
        let (a_left, b_left) = (a.exists(), b.exists());
        let _ = std::fs::remove_file(a);
        let _ = std::fs::remove_file(b);
        assert!(!a_left && b_left, "{a_left} {b_left}");
    }

    #[test]
    fn too_small_is_named() {
        // 64 GiB: more than any test machine's /dev/shm.
        let name = format!("oxccl-unittest-{}-huge", std::process::id());
        let e = Segment::create(3, &name, 1, 1 << 30, 64, 0);
        assert!(!PathBuf::from(SHM_DIR).join(&name).exists(), "left behind");
        match e {
            Err(Error::Config(msg)) => {
                assert!(msg.contains("too small") && msg.contains("bytes"), "{msg}")
            }
            Err(other) => panic!("{other}"),
            Ok(_) => panic!("2^46 bytes fit in /dev/shm?"),
        }
    }
}
