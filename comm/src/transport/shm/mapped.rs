//! Peers' registered buffers mapped here ([`PeerBufs`]): the window's way to write straight into
//! another rank's [`crate::Registered`] output, and the start-up probe that says whether every
//! rank can map every other's ([`Probe`]).
//!
//! A rank publishes a registered buffer as its shared file's descriptor, its registry entry's id
//! (never reused in that process) and the buffer's offset in the file. Each peer opens
//! `/proc/<pid>/fd/<fd>` at the first sight of a `(fd, id)` pair and keeps the mapping: later
//! operations on the same buffer cost no system call. A new id at a known descriptor (the buffer
//! was dropped and another registered in its place) replaces the old mapping; at most
//! [`KEPT`] buffers of each peer stay mapped, the oldest going first.

use std::os::fd::RawFd;

use memmap2::MmapMut;

use crate::base::error::{Error, Result};
use crate::base::shared_mem::{map_peer_file, SharedMem};
use crate::transport::SharedBuf;

/// Mappings kept per peer.
pub(super) const KEPT: usize = 4;

/// The word at the start of a probe file.
const PROBE_MAGIC: u64 = 0x4f58_4343_4c01_6d70; // "OXCCL\x01mp"

/// One peer buffer mapped here.
struct PeerBuf {
    fd: RawFd,
    id: u64,
    map: MmapMut,
}

/// Registered buffers of every peer mapped here, indexed by rank.
#[derive(Default)]
pub(super) struct PeerBufs {
    by_rank: Vec<Vec<PeerBuf>>,
}

impl PeerBufs {
    /// The address here of `len` bytes of the buffer rank `peer` (process `pid`) published,
    /// mapped at the first use of its `(fd, id)`.
    ///
    /// # Errors
    /// `Error::Transport` naming the peer: the file could not be mapped, or it is shorter than
    /// `offset + len` bytes.
    pub(super) fn get(
        &mut self,
        (rank, peer, pid): (usize, usize, u32),
        b: SharedBuf,
        len: usize,
    ) -> Result<*mut u8> {
        if self.by_rank.len() <= peer {
            self.by_rank.resize_with(peer + 1, Vec::new);
        }
        let kept = &mut self.by_rank[peer];
        let at = kept.iter().position(|m| m.fd == b.fd);
        let i = match at {
            Some(i) if kept[i].id == b.id => i,
            _ => {
                let map = map_peer_file(pid, b.fd).map_err(|e| {
                    let msg = format!(
                        "mapping its registered buffer (/proc/{pid}/fd/{}): {e}",
                        b.fd
                    );
                    shm_error(rank, peer, msg)
                })?;
                let fresh = PeerBuf {
                    fd: b.fd,
                    id: b.id,
                    map,
                };
                match at {
                    Some(i) => {
                        kept[i] = fresh;
                        i
                    }
                    None => {
                        if kept.len() >= KEPT {
                            kept.remove(0);
                        }
                        kept.push(fresh);
                        kept.len() - 1
                    }
                }
            }
        };
        let map = &mut kept[i].map;
        if b.offset.checked_add(len).is_none_or(|end| end > map.len()) {
            let msg = format!(
                "its registered buffer has {} bytes; this operation needs {len} at offset {}",
                map.len(),
                b.offset
            );
            return Err(shm_error(rank, peer, msg));
        }
        // SAFETY: `offset + len` lies inside the mapping (checked above), which `self` keeps.
        Ok(unsafe { map.as_mut_ptr().add(b.offset) })
    }

    /// Buffers of `peer` mapped now.
    #[cfg(test)]
    pub(super) fn kept(&self, peer: usize) -> usize {
        self.by_rank.get(peer).map_or(0, Vec::len)
    }
}

fn shm_error(rank: usize, peer: usize, msg: String) -> Error {
    Error::Transport {
        rank,
        peer,
        transport: "shm",
        msg,
    }
}

/// A one-page shared file with a known first word, which peers map at start-up to learn whether
/// they can map this rank's registered buffers.
pub(crate) struct Probe(SharedMem);

impl Probe {
    /// A fresh probe file (`None` if none can be made: nobody will map this rank's buffers).
    pub(super) fn new() -> Option<Probe> {
        let mut m = SharedMem::new("oxccl-probe", 8).ok()?;
        m.bytes_mut()[..8].copy_from_slice(&PROBE_MAGIC.to_ne_bytes());
        Some(Probe(m))
    }

    /// Its descriptor.
    pub(super) fn fd(&self) -> RawFd {
        self.0.fd()
    }
}

/// Whether this process can map, read and write the probe file that process `pid` holds as
/// descriptor `fd`.
pub(super) fn probe(pid: u32, fd: RawFd) -> bool {
    let Ok(mut map) = map_peer_file(pid, fd) else {
        return false;
    };
    let word = PROBE_MAGIC.to_ne_bytes();
    if map.len() < 8 || map[..8] != word {
        return false;
    }
    map[..8].copy_from_slice(&word);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_mapped_once_replaced_by_new_ids_and_bounded() {
        let me = std::process::id();
        let files: Vec<SharedMem> = (0..KEPT + 1)
            .map(|_| SharedMem::new("oxccl-test", 4096).unwrap())
            .collect();
        let mut bufs = PeerBufs::default();
        let at = |f: &SharedMem, id, offset| SharedBuf {
            fd: f.fd(),
            id,
            offset,
        };
        let p = bufs.get((0, 1, me), at(&files[0], 1, 96), 4000).unwrap();
        // SAFETY: 4000 bytes at offset 96 lie in the one-page mapping `bufs` keeps.
        unsafe { p.write(5) };
        assert_eq!(files[0].bytes()[96], 5, "writes land in the owner's file");
        let again = bufs.get((0, 1, me), at(&files[0], 1, 0), 8).unwrap();
        assert_eq!(
            again as usize + 96,
            p as usize,
            "the same mapping, not a new one"
        );
        assert_eq!(bufs.kept(1), 1);
        let long = bufs
            .get((0, 1, me), at(&files[0], 1, 100), 4000)
            .unwrap_err();
        assert!(
            long.to_string().contains("needs 4000 at offset 100"),
            "{long}"
        );
        for (i, f) in files.iter().enumerate() {
            bufs.get((0, 1, me), at(f, 10 + i as u64, 0), 8).unwrap();
        }
        assert_eq!(bufs.kept(1), KEPT, "the oldest went");
        let fake = SharedBuf {
            fd: 1 << 20,
            id: 99,
            offset: 0,
        };
        let gone = bufs.get((0, 1, me), fake, 8).unwrap_err();
        assert!(gone.to_string().contains("/proc/"), "{gone}");
    }

    #[test]
    fn a_probe_is_mapped_by_its_own_process_and_a_closed_one_is_not() {
        let p = Probe::new().unwrap();
        assert!(probe(std::process::id(), p.fd()));
        let fd = p.fd();
        drop(p);
        assert!(!probe(std::process::id(), fd) || fd_reused(fd));
    }

    /// Whether another test opened a file at `fd` meanwhile (then the probe may find it).
    fn fd_reused(fd: RawFd) -> bool {
        std::fs::read_link(format!("/proc/self/fd/{fd}")).is_ok()
    }
}
