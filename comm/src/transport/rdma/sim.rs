//! An in-process provider with the semantics of an RC queue pair: writes delivered in order,
//! each one's bytes placed in the peer's receive region before its immediate is polled there,
//! a write's completion reported to its sender once the peer has it, and errors that put both
//! ends in the error state (as a lost peer's retries running out would). Delivery happens when
//! the receiving end polls; tests can hold it back to interleave the two ends any way they like.
//! Registered user buffers are "registered" in a [`RegCache`] of their entries, as a NIC's
//! memory regions would be, and a write from one checks that its bytes lie inside the entry
//! (a NIC fails it with a local protection error otherwise).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use super::proto::HEADER;
use super::verbs::{Completion, QueuePair};
use crate::base::error::{Error, Result};
use crate::transport::registry::{Entry, RegCache};

/// A write on its way.
struct Write {
    wr_id: u64,
    dst: usize,
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
}

/// One end of a simulated queue pair.
pub(crate) struct SimQp {
    end: usize,
    link: Arc<Mutex<Link>>,
    send: Vec<u8>,
    recv: Vec<u8>,
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
/// own into end 1's `bytes` (the data); end 1 writes only immediates back (the credits). End 0
/// registers user buffers in `user`.
pub(crate) fn pair(bytes: usize, user: &Arc<RegCache<Entry>>) -> (SimQp, SimQp, SimControl) {
    let link = Arc::new(Mutex::new(Link {
        recv_len: [0, bytes],
        ..Link::default()
    }));
    let end = |end, send: usize, recv: usize| SimQp {
        end,
        link: Arc::clone(&link),
        send: vec![0; send],
        recv: vec![0; recv],
        user: Arc::clone(user),
    };
    let (a, b) = (end(0, bytes, 0), end(1, 0, bytes));
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
        dst: usize,
        imm: u32,
    ) -> Result<()> {
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
        let len = parts.iter().map(|p| p.len()).sum::<usize>();
        if !in_regions || dst + len > l.recv_len[peer] {
            // A real NIC fails the request with a protection error; so does the simulation.
            l.error = Some((
                10,
                format!("write of {len} bytes to {dst} out of the regions"),
            ));
            return Ok(());
        }
        l.to[peer].push_back(Write {
            wr_id,
            dst,
            data: parts.concat(),
            imm,
        });
        Ok(())
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
            dst,
            imm,
        )
    }

    fn register_user(&mut self, entry: &Entry) -> bool {
        !lock(&self.link).refuse && self.user.get(entry, |e| Ok(*e)).is_ok()
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
        let reg = self.user.get(entry, |e| Ok(*e))?;
        if !reg.holds(payload.as_ptr() as usize, payload.len()) {
            // IBV_WC_LOC_PROT_ERR: the bytes are not all inside the registration.
            let what = format!("{} payload bytes outside {reg:?}", payload.len());
            lock(&self.link).error = Some((4, what));
            return Ok(());
        }
        let header = self.send.get(head..head + HEADER);
        let parts = [header.unwrap_or_default(), payload];
        self.queue(wr_id, (&parts, header.is_some()), dst, imm)
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        let mut l = lock(&self.link);
        if let Some((status, what)) = l.error.clone() {
            out.push(Completion::Error {
                wr_id: 0,
                status,
                what,
            });
            return Ok(());
        }
        let peer = 1 - self.end;
        if !l.held[self.end] {
            while let Some(w) = l.to[self.end].pop_front() {
                self.recv[w.dst..w.dst + w.data.len()].copy_from_slice(&w.data);
                out.push(Completion::Imm {
                    imm: w.imm,
                    len: w.data.len(),
                });
                l.done[peer].push_back(w.wr_id);
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
