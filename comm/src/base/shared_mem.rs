//! Memory that the other processes of a node can map: an anonymous shared file
//! (`memfd_create`) mapped here ([`SharedMem`]), which a peer maps in turn by opening
//! `/proc/<pid>/fd/<fd>` ([`map_peer_file`]). Nothing is left behind: the file has no name, and
//! its pages go when the last descriptor and mapping of it go, in whichever process that is.
//!
//! Opening another process's descriptor needs the same permission as reading its `/proc` entry
//! (`PTRACE_MODE_READ`, met between processes of one user), less than `process_vm_readv` needs.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};

use memmap2::{MmapMut, MmapOptions};

use super::sys;

/// Bytes a mapping is rounded up to.
const PAGE: usize = 4096;

/// An anonymous shared file of at least `len` bytes, mapped read-write here.
pub struct SharedMem {
    file: File,
    map: MmapMut,
}

impl SharedMem {
    /// A zeroed file of `bytes` bytes rounded up to whole pages (at least one), its space
    /// reserved now, so that a full memory cgroup or `/dev/shm` limit fails here and not with
    /// `SIGBUS` at a later write.
    ///
    /// # Errors
    /// `memfd_create`, the reservation or the mapping failed.
    pub fn new(name: &str, bytes: usize) -> io::Result<SharedMem> {
        let len = bytes.max(1).next_multiple_of(PAGE);
        let file = sys::memfd(name)?;
        file.set_len(len as u64)?;
        sys::fallocate(file.as_raw_fd(), len)?;
        // SAFETY: the file is ours and sized; peers only write it where the protocol that
        // published it lets them (see `crate::Registered`), and the mapping lives in `self`.
        let map = unsafe { MmapOptions::new().len(len).map_mut(&file)? };
        Ok(SharedMem { file, map })
    }

    /// The descriptor peers open through `/proc`.
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// The mapped bytes (whole pages).
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The mapped bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

/// Maps the whole of the file that process `pid` holds open as descriptor `fd`, read-write
/// and populated (no page faults at the first copies).
///
/// # Errors
/// Opening `/proc/<pid>/fd/<fd>` was refused, the descriptor is gone, or the mapping failed.
pub fn map_peer_file(pid: u32, fd: RawFd) -> io::Result<MmapMut> {
    let path = format!("/proc/{pid}/fd/{fd}");
    let file = OpenOptions::new().read(true).write(true).open(&path)?;
    let len = file.metadata()?.len() as usize;
    if len == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{path} is empty"),
        ));
    }
    // SAFETY: the mapping is of shared memory that its owner and the peers write only where
    // their step protocol says; it stays valid after `file` is closed.
    unsafe { MmapOptions::new().len(len).populate().map_mut(&file) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_mapping_sees_and_changes_the_same_bytes() {
        let mut own = SharedMem::new("oxccl-test", 5000).unwrap();
        assert_eq!(own.bytes().len(), 8192, "whole pages");
        assert!(own.bytes().iter().all(|&b| b == 0), "zeroed");
        own.bytes_mut()[4999] = 7;
        let mut peer = map_peer_file(std::process::id(), own.fd()).unwrap();
        assert_eq!(peer.len(), 8192);
        assert_eq!(peer[4999], 7);
        peer[0] = 9;
        assert_eq!(own.bytes()[0], 9, "one file, two mappings");
        let gone = map_peer_file(std::process::id(), 1 << 20).unwrap_err();
        assert_eq!(gone.kind(), io::ErrorKind::NotFound, "{gone}");
    }
}
