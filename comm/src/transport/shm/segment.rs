//! A shared-memory segment: its layout (header, doorbell, rings, direct area), creating and
//! mapping it, its doorbell, and the guard that unlinks a fresh segment on failure.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use memmap2::MmapMut;

use crate::base::error::{Error, Result};
use crate::base::sys;
use crate::transport::Doorbell;

pub(super) const MAGIC: u64 = 0x4f58_4343_4c01_7368; // "OXCCL\x01sh"
const BLOCK: usize = 128;
const META: usize = 32;
const HEADER: usize = BLOCK;
const BELL: usize = BLOCK;

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

/// Page size the ring budget rounds slots to.
const PAGE: usize = 4096;

/// Slot bytes of the rings of a rank with `peers` shared-memory peers: `slot_bytes`, or less
/// where `peers` rings of `nslots` slots would take more than `ring_budget` bytes together
/// (`OXCCL_SHM_RING_BYTES`; 0 = no limit), then whole pages, at least one.
pub fn ring_slot_bytes(
    slot_bytes: usize,
    nslots: usize,
    peers: usize,
    ring_budget: usize,
) -> usize {
    if ring_budget == 0 || peers == 0 {
        return slot_bytes;
    }
    let fit = ring_budget / (peers * nslots.max(1));
    slot_bytes.min((fit / PAGE * PAGE).max(PAGE))
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
    pub(super) base: *mut u8,
    pub(super) slot_size: usize,
    pub(super) nslots: usize,
    nrings: usize,
    /// Bytes of one staging half of the direct area.
    pub(super) direct: usize,
    /// Where the direct area starts (after the rings) and the bytes of one ring, kept: every
    /// record, step, head and tail access needs them.
    direct_at: usize,
    ring_len: usize,
}

// SAFETY: the mapping is plain shared memory; every access to it goes through atomics (head,
// tail, closed, bell) or through slot regions whose ownership the head/tail protocol hands over
// between exactly one writer and one reader. The raw base pointer stays valid as long as `map`.
unsafe impl Send for Segment {}
// SAFETY: as above; shared references only read the geometry or use atomics.
unsafe impl Sync for Segment {}

impl Segment {
    pub(super) fn atomic_u64(&self, off: usize) -> &AtomicU64 {
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
        HEADER + BELL + ring * self.ring_len
    }

    pub(super) fn head(&self, ring: usize) -> &AtomicU64 {
        self.atomic_u64(self.ring_off(ring))
    }

    pub(super) fn tail(&self, ring: usize) -> &AtomicU64 {
        self.atomic_u64(self.ring_off(ring) + BLOCK)
    }

    pub(super) fn closed(&self, ring: usize) -> &AtomicU64 {
        self.atomic_u64(self.ring_off(ring) + 2 * BLOCK)
    }

    pub(super) fn meta_off(&self, ring: usize, slot: usize) -> usize {
        self.ring_off(ring) + 3 * BLOCK + slot * META
    }

    pub(super) fn slot_off(&self, ring: usize, slot: usize) -> usize {
        self.ring_off(ring)
            + 3 * BLOCK
            + (self.nslots * META).next_multiple_of(BLOCK)
            + slot * self.slot_size
    }

    /// Offset of the direct area: step block, tag block, two staging halves.
    fn direct_off(&self) -> usize {
        self.direct_at
    }

    /// The step counter of the direct area (written by the owner only).
    pub(super) fn step(&self) -> &AtomicU64 {
        self.atomic_u64(self.direct_off())
    }

    /// Set when the owner closed its window.
    pub(super) fn window_closed(&self) -> &AtomicU64 {
        self.atomic_u64(self.direct_off() + 64)
    }

    /// Word `i` of the published record of half `half`:
    /// `[seq + 1, desc, count, in, out, step, inline, inline]`.
    pub(super) fn record(&self, half: usize, i: usize) -> &AtomicU64 {
        debug_assert!(half < 2 && i < 8);
        self.atomic_u64(self.direct_off() + BLOCK + half * 64 + i * 8)
    }

    /// Address of staging half `half`.
    pub(super) fn staging_ptr(&self, half: usize) -> *mut u8 {
        let off = self.direct_off() + 2 * BLOCK + half * self.direct.next_multiple_of(BLOCK);
        debug_assert!(off + self.direct <= self.map.len());
        // SAFETY: the offset lies inside the mapping (the segment size includes the direct area).
        unsafe { self.base.add(off) }
    }

    /// Rings this segment's doorbell (its owner sleeps on it), if its owner announced a sleep:
    /// called after a post's stores, it orders them before the read of the sleeper count (the
    /// owner orders its announcement before its checks), so either the owner's checks see the
    /// post or this sees the owner announced. A spinning owner costs nothing: the counter's and
    /// the count's cache lines stay where they are.
    pub fn ring_bell(&self) {
        fence(Ordering::SeqCst);
        if self.atomic_u32(HEADER + 64).load(Ordering::Relaxed) > 0 {
            let seq = self.atomic_u32(HEADER);
            seq.fetch_add(1, Ordering::SeqCst);
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
                     free; enlarge it (e.g. docker --shm-size), lower OXCCL_SHM_RING_BYTES/OXCCL_NSLOTS/\
                     OXCCL_SHM_DIRECT_BYTES, or set OXCCL_TRANSPORT=tcp"
                ))
            } else {
                terr(format!(
                    "reserving {bytes} bytes in {}: {e}",
                    path.display()
                ))
            });
        }
        let seg = Self::map(rank, &file, &path)?.laid_out(nrings, slot_size, nslots, direct);
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
        Ok(seg.laid_out(nrings, slot_size, nslots, direct))
    }

    /// This mapping with its geometry: `nrings` rings of `nslots` slots of `slot_size` bytes,
    /// then the direct area with staging halves of `direct` bytes.
    fn laid_out(self, nrings: usize, slot_size: usize, nslots: usize, direct: usize) -> Segment {
        let ring_len = ring_bytes(slot_size, nslots);
        Segment {
            slot_size,
            nslots,
            nrings,
            direct,
            direct_at: HEADER + BELL + nrings * ring_len,
            ring_len,
            ..self
        }
    }

    fn map(rank: usize, file: &File, path: &std::path::Path) -> Result<Segment> {
        // SAFETY: the file is a tmpfs segment that only oxccl ranks of this communicator map;
        // its size is fixed (fallocated before publication) so the mapping never outlives the
        // file's extent, and concurrent access follows the ring protocol (the `shm` module
        // documentation).
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
            direct_at: 0,
            ring_len: 0,
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

#[cfg(test)]
impl Segment {
    /// How many sleepers are announced on this segment's doorbell.
    pub(crate) fn sleepers(&self) -> u32 {
        self.atomic_u32(HEADER + 64).load(Ordering::SeqCst)
    }
}

impl Doorbell for Segment {
    /// The doorbell's counter. A waiter reads it *before* checking its rings, then sleeps with
    /// [`Doorbell::sleep_since`]: any ring after the read ends the sleep at once.
    fn seq(&self) -> u32 {
        self.atomic_u32(HEADER).load(Ordering::SeqCst)
    }

    fn announce(&self, sleeping: bool) {
        let sleepers = self.atomic_u32(HEADER + 64);
        if sleeping {
            sleepers.fetch_add(1, Ordering::SeqCst);
            // The announcement comes before every check that follows (see `ring_bell`).
            fence(Ordering::SeqCst);
        } else {
            sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Sleeps on this segment's doorbell for at most `timeout`, unless it rang since `seen`.
    fn sleep_since(&self, seen: u32, timeout: Duration) {
        sys::futex_wait(self.atomic_u32(HEADER), seen, timeout);
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
    pub(super) fn disarm(mut self) {
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
