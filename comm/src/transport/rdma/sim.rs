//! An in-process provider with the semantics of an RC queue pair: writes delivered in order,
//! each one's bytes placed in the peer's receive region before its immediate is polled there,
//! a write's completion reported to its sender once the peer has it, and errors that put both
//! ends in the error state (as a lost peer's retries running out would). Delivery happens when
//! the receiving end polls; tests can hold it back to interleave the two ends any way they like.
//! Registered user buffers are "registered" in a [`RegCache`] of their entries, as a NIC's
//! memory regions would be, and a write from one checks that its bytes lie inside the entry
//! (a NIC fails it with a local protection error otherwise). A write into a peer's offered
//! buffer lands when the peer polls, if the buffer is still registered under the key it was
//! offered with (its entry's id); otherwise both ends fail with a remote access error, as a NIC
//! whose memory region has gone would.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use super::proto::{CONTROL, HEADER};
use super::verbs::{Completion, QueuePair, Source};
use crate::base::error::{Error, Result};
use crate::transport::registry::{Entry, RegCache, Registry};

/// Placed writes' buffers a link keeps for later writes (a ring's worth and more).
const SPARES: usize = 32;

/// Where a write goes.
#[derive(Clone, Copy)]
enum Dst {
    /// An offset in the peer's receive region.
    Region(usize),
    /// A peer's registered user buffer: address and key.
    User(usize, u32),
}

/// A write on its way.
struct Write {
    wr_id: u64,
    dst: Dst,
    data: Vec<u8>,
    imm: u32,
}

/// What travels between the two ends.
#[derive(Default)]
struct Link {
    /// Writes travelling to end 0 and to end 1.
    to: [VecDeque<Write>; 2],
    /// Completions of end 0's and end 1's writes.
    done: [VecDeque<u64>; 2],
    /// Delivery to end 0 / end 1 held back.
    held: [bool; 2],
    /// The error both ends are in.
    error: Option<(u32, String)>,
    /// Registrations of user buffers are refused (as a locked-memory limit would).
    refuse: bool,
    /// Bytes of each end's receive region.
    recv_len: [usize; 2],
    /// Buffers of writes already placed, for the next writes' bytes (fresh memory for every
    /// write would cost a page fault per 4 KiB).
    spare: Vec<Vec<u8>>,
}

/// One end of a simulated queue pair.
pub(crate) struct SimQp {
    end: usize,
    link: Arc<Mutex<Link>>,
    send: Vec<u8>,
    recv: Vec<u8>,
    /// Writes taken off the link to be placed (kept to reuse its memory).
    inbox: VecDeque<Write>,
    /// The "device registrations" of user buffers, shared by a rank's queue pairs.
    user: Arc<RegCache<Entry>>,
}

/// Controls a pair from a test: hold delivery, inject an error.
#[derive(Clone)]
#[cfg_attr(not(test), allow(dead_code))] // the transport drops it; tests drive it
pub(crate) struct SimControl {
    link: Arc<Mutex<Link>>,
}

fn lock(link: &Mutex<Link>) -> MutexGuard<'_, Link> {
    link.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Two connected ends of a connection of `bytes` of slots: end 0 writes from `bytes` of its
/// own into end 1's `bytes` (the data); end 1 writes credits back, and offers into end 0's
/// control area ([`CONTROL`] bytes each way). Both register user buffers in `user`.
pub(crate) fn pair(bytes: usize, user: &Arc<RegCache<Entry>>) -> (SimQp, SimQp, SimControl) {
    let link = Arc::new(Mutex::new(Link {
        recv_len: [CONTROL, bytes],
        ..Link::default()
    }));
    let end = |end, send: usize, recv: usize| SimQp {
        end,
        link: Arc::clone(&link),
        send: vec![0; send],
        recv: vec![0; recv],
        inbox: VecDeque::new(),
        user: Arc::clone(user),
    };
    let (a, b) = (end(0, bytes, CONTROL), end(1, CONTROL, bytes));
    (a, b, SimControl { link })
}

#[cfg(test)]
impl SimControl {
    /// Holds (or lets go) the delivery of writes to end `end`.
    pub(crate) fn hold(&self, end: usize, held: bool) {
        lock(&self.link).held[end] = held;
    }

    /// Refuses (or allows again) registering user buffers.
    pub(crate) fn refuse_registrations(&self, refuse: bool) {
        lock(&self.link).refuse = refuse;
    }

    /// Puts the queue pair in the error state with `status` (12: retry exceeded).
    pub(crate) fn fail(&self, status: u32, what: &str) {
        lock(&self.link).error = Some((status, what.to_string()));
    }
}

impl SimQp {
    /// Queues a write of `parts` (in order) to the peer's receive region at `dst`, as a NIC
    /// would: an error if the pair is in error already; a protection error (status 10, the pair
    /// in error) if the write leaves the regions, which `in_regions` says.
    fn queue(
        &self,
        wr_id: u64,
        (parts, in_regions): (&[&[u8]], bool),
        dst: Dst,
        imm: u32,
    ) -> Result<()> {
        // The bytes are taken now (a NIC reads them before the write completes), outside the
        // lock so both ends copy at once.
        let mut data = lock(&self.link).spare.pop().unwrap_or_default();
        data.clear();
        for p in parts {
            data.extend_from_slice(p);
        }
        let mut l = lock(&self.link);
        let peer = 1 - self.end;
        if let Some((status, what)) = &l.error {
            return Err(Error::Transport {
                rank: usize::MAX,
                peer: usize::MAX,
                transport: "rdma",
                msg: format!("queue pair in error (status {status}): {what}"),
            });
        }
        let len = data.len();
        let outside = match dst {
            Dst::Region(at) => at + len > l.recv_len[peer],
            Dst::User(..) => false, // checked where it lands
        };
        if !in_regions || outside {
            // A real NIC fails the request with a protection error; so does the simulation.
            l.error = Some((10, format!("write of {len} bytes out of the regions")));
            return Ok(());
        }
        l.to[peer].push_back(Write {
            wr_id,
            dst,
            data,
            imm,
        });
        Ok(())
    }
}

impl SimQp {
    /// Whether `payload` lies inside the registration of `entry` (made at its first use); if
    /// not, the pair is put in error as a NIC's local protection error would.
    fn user_holds(&self, payload: &[u8], entry: &Entry) -> Result<bool> {
        let reg = self.user.get(entry, |e| Ok(*e))?;
        if reg.holds(payload.as_ptr() as usize, payload.len()) {
            return Ok(true);
        }
        // IBV_WC_LOC_PROT_ERR: the bytes are not all inside the registration.
        let what = format!("{} payload bytes outside {reg:?}", payload.len());
        lock(&self.link).error = Some((4, what));
        Ok(false)
    }
}

/// Writes `data` into the registered buffer holding `data.len()` bytes at `addr`, if it is
/// still registered under `rkey`; why not otherwise.
fn land(addr: usize, rkey: u32, data: &[u8]) -> std::result::Result<(), String> {
    let wrote = Registry::global().with_entry(addr, data.len(), |e| {
        if e.id as u32 != rkey {
            return false;
        }
        // SAFETY: the bytes lie inside a live registered buffer (the table stays locked while
        // they are copied, and a `Registered` removes its entry before freeing its memory); its
        // owner offered exactly this range for this write (the key names this registration)
        // and reads none of it until the write's immediate has been polled, after this copy,
        // as a NIC's write into the buffer would be.
        let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, data.len()) };
        // Past the caches, as the algorithms copy into large buffers (and as a NIC's DMA does
        // not go through this core's).
        oxccl_kernels::copy_streaming(dst, data);
        true
    });
    match wrote {
        Some(true) => Ok(()),
        _ => Err(format!(
            "write of {} bytes to {addr:#x}: no buffer registered there under key {rkey}",
            data.len()
        )),
    }
}

impl QueuePair for SimQp {
    fn write_imm(
        &mut self,
        wr_id: u64,
        src: usize,
        len: usize,
        dst: usize,
        imm: u32,
    ) -> Result<()> {
        let part = self.send.get(src..src + len);
        self.queue(
            wr_id,
            (&[part.unwrap_or_default()], part.is_some()),
            Dst::Region(dst),
            imm,
        )
    }

    fn register_user(&mut self, entry: &Entry) -> Option<u32> {
        let ok = !lock(&self.link).refuse && self.user.get(entry, |e| Ok(*e)).is_ok();
        // The key is the entry's id: a buffer registered again is a new entry, so a key handed
        // out for the old one no longer matches.
        ok.then_some(entry.id as u32)
    }

    fn write_imm_remote(
        &mut self,
        wr_id: u64,
        src: Source<'_>,
        to: (u64, u32),
        imm: u32,
    ) -> Result<()> {
        let part = match src {
            Source::Region(r) => self.send.get(r),
            Source::User(payload, entry) => {
                if !self.user_holds(payload, entry)? {
                    return Ok(());
                }
                Some(payload)
            }
        };
        let dst = Dst::User(to.0 as usize, to.1);
        let in_region = part.is_some();
        self.queue(wr_id, (&[part.unwrap_or_default()], in_region), dst, imm)
    }

    fn write_imm_user(
        &mut self,
        wr_id: u64,
        head: usize,
        payload: &[u8],
        entry: &Entry,
        dst: usize,
        imm: u32,
    ) -> Result<()> {
        if !self.user_holds(payload, entry)? {
            return Ok(());
        }
        let header = self.send.get(head..head + HEADER);
        let parts = [header.unwrap_or_default(), payload];
        self.queue(wr_id, (&parts, header.is_some()), Dst::Region(dst), imm)
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        let peer = 1 - self.end;
        {
            let mut l = lock(&self.link);
            if let Some((status, what)) = l.error.clone() {
                out.push(Completion::Error {
                    wr_id: 0,
                    status,
                    what,
                });
                return Ok(());
            }
            if !l.held[self.end] {
                std::mem::swap(&mut self.inbox, &mut l.to[self.end]);
            }
        }
        // The writes that arrived are placed outside the lock (the peer keeps posting), in
        // order, each before its immediate; their completions go back once all are placed.
        for w in &self.inbox {
            match w.dst {
                Dst::Region(at) => {
                    self.recv[at..at + w.data.len()].copy_from_slice(&w.data);
                }
                Dst::User(addr, rkey) => {
                    if let Err(what) = land(addr, rkey, &w.data) {
                        // IBV_WC_REM_ACCESS_ERR, on both ends.
                        lock(&self.link).error = Some((10, what.clone()));
                        self.inbox.clear();
                        out.push(Completion::Error {
                            wr_id: 0,
                            status: 10,
                            what,
                        });
                        return Ok(());
                    }
                }
            }
            out.push(Completion::Imm {
                imm: w.imm,
                len: w.data.len(),
            });
        }
        let mut l = lock(&self.link);
        for w in self.inbox.drain(..) {
            l.done[peer].push_back(w.wr_id);
            if l.spare.len() < SPARES {
                l.spare.push(w.data);
            }
        }
        while let Some(wr_id) = l.done[self.end].pop_front() {
            out.push(Completion::WriteDone { wr_id });
        }
        Ok(())
    }

    fn send_slot(&mut self, range: std::ops::Range<usize>) -> &mut [u8] {
        &mut self.send[range]
    }

    fn recv_slot(&self, range: std::ops::Range<usize>) -> &[u8] {
        &self.recv[range]
    }
}
