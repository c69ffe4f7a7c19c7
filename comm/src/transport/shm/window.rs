//! The direct window of a communicator whose ranks all share memory ([`ShmWindow`]), and the
//! probe of the single-copy path (`process_vm_readv`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::liveness::{lost, Liveness};
use super::segment::{Segment, MAGIC};
use crate::base::error::{Error, Result};
use crate::base::sys;
use crate::transport::{Staging, Tag, Window};

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
