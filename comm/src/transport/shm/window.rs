//! The direct window of a communicator whose ranks all share memory ([`ShmWindow`]), and the
//! probe of the single-copy path (`process_vm_readv`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::liveness::{lost, Liveness};
use super::mapped::PeerBufs;
use super::segment::{Segment, MAGIC};
use crate::base::error::{Error, Result};
use crate::base::sys;
use crate::transport::{SharedBuf, Staging, Tag, Window, INLINE_MAX, INLINE_WORDS};

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
    /// Every rank can map every other's registered buffers (see [`super::mapped`]).
    can_map: bool,
    bufs: PeerBufs,
}

/// The word of a half's record that repeats the step published with it (the record's last
/// store, so a peer that sees the step sees the rest of the record and the staged bytes).
const STEP_WORD: usize = 5;
/// The first of the two record words that carry inline data ([`Window::publish_inline`]).
const INLINE_WORD: usize = 6;

impl ShmWindow {
    /// `segs[r]` is rank `r`'s segment, `pids[r]` its process id; `single_copy` says whether
    /// every rank could read every other with `process_vm_readv` (see [`probe_single_copy`]),
    /// `can_map` whether every rank could map every other's probe file (see
    /// [`super::mapped::probe`]).
    pub(crate) fn new(
        rank: usize,
        segs: Vec<Arc<Segment>>,
        pids: Vec<u32>,
        (single_copy, can_map): (bool, bool),
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
            can_map,
            bufs: PeerBufs::default(),
        }
    }
}

impl ShmWindow {
    /// Writes half `half`'s record (tag, the two region words, the inline words if any), then
    /// its step word, then the step counter, and rings the peers that sleep.
    fn publish_words(
        &mut self,
        step: u64,
        tag: Tag,
        half: usize,
        region: [u64; 2],
        inline: Option<[u64; INLINE_WORDS]>,
    ) {
        let own = &self.segs[self.rank];
        let h = half % 2;
        let words = [tag.seq + 1, tag.desc, tag.count, region[0], region[1]];
        for (i, w) in words.into_iter().enumerate() {
            own.record(h, i).store(w, Ordering::Relaxed);
        }
        if let Some(data) = inline {
            for (i, w) in data.into_iter().enumerate() {
                own.record(h, INLINE_WORD + i).store(w, Ordering::Relaxed);
            }
        }
        own.record(h, STEP_WORD).store(step, Ordering::Release);
        own.step().store(step, Ordering::Release);
        for (p, s) in self.segs.iter().enumerate() {
            if p != self.rank {
                s.ring_bell();
            }
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
        self.publish_words(step, tag, half, [region[0] as u64, region[1] as u64], None);
    }

    fn inline_capacity(&self) -> usize {
        INLINE_MAX
    }

    fn publish_inline(&mut self, step: u64, tag: Tag, half: usize, data: &[u8]) {
        let mut words = [0u64; INLINE_WORDS];
        let n = data.len().min(INLINE_MAX);
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..n].copy_from_slice(&data[..n]);
        self.publish_words(step, tag, half, [0, 0], Some(words));
    }

    fn peer_inline(&self, peer: usize, half: usize) -> [u64; INLINE_WORDS] {
        let s = &self.segs[peer];
        std::array::from_fn(|i| s.record(half % 2, INLINE_WORD + i).load(Ordering::Relaxed))
    }

    fn step(&self, peer: usize, half: Option<usize>) -> u64 {
        let s = &self.segs[peer];
        match half {
            Some(h) => s.record(h % 2, STEP_WORD).load(Ordering::Acquire),
            None => s.step().load(Ordering::Acquire),
        }
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

    fn write_peer(&self, peer: usize, addr: usize, src: &[u8]) -> Result<()> {
        sys::write_remote(self.pids[peer], addr, src).map_err(|e| Error::Transport {
            rank: self.rank,
            peer,
            transport: "shm",
            msg: format!("process_vm_writev of {} bytes at {addr:#x}: {e}", src.len()),
        })
    }

    fn can_map(&self) -> bool {
        self.can_map
    }

    fn publish_shared(&mut self, step: u64, tag: Tag, half: usize, buf: Option<SharedBuf>) {
        // Region words: the offset and the descriptor plus one (0: no buffer); the id inline.
        let (region, id) = match buf {
            Some(b) => ([b.offset as u64, b.fd as u64 + 1], b.id),
            None => ([0, 0], 0),
        };
        self.publish_words(step, tag, half, region, Some([id, 0]));
    }

    fn peer_has_shared(&self, peer: usize, half: usize) -> bool {
        self.peer_region(peer, half)[1] != 0
    }

    fn peer_shared(&mut self, peer: usize, half: usize, len: usize) -> Result<Option<*mut u8>> {
        let [offset, fd] = self.peer_region(peer, half);
        if fd == 0 {
            return Ok(None);
        }
        let b = SharedBuf {
            fd: (fd - 1) as i32,
            id: self.peer_inline(peer, half)[0],
            offset,
        };
        let who = (self.rank, peer, self.pids[peer]);
        self.bufs.get(who, b, len).map(Some)
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

/// Whether this process can read and write `peer`'s memory with `process_vm_readv` and
/// `process_vm_writev` (containers without `CAP_SYS_PTRACE`, Yama's ptrace_scope >= 2 or a
/// seccomp filter forbid it): reads the magic word of the peer's own segment at the address
/// where the peer mapped it, and writes the same word back.
pub(crate) fn probe_single_copy(peer_pid: u32, peer_seg: &Segment) -> bool {
    let mut word = [0u8; 8];
    sys::read_remote(peer_pid, peer_seg.owner_base(), &mut word).is_ok()
        && u64::from_ne_bytes(word) == MAGIC
        && sys::write_remote(peer_pid, peer_seg.owner_base(), &word).is_ok()
}
