//! A reliable-connected queue pair on a [`Nic`]: its own completion queue, the region it writes
//! from and the region its peer writes into (both registered), receive requests kept posted
//! for the peer's immediates, and [`QueuePair`] over all that.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;
use memmap2::MmapMut;

use super::super::address::{LinkLayer, QpAddress};
use super::super::proto::HEADER;
use super::super::verbs::{Completion, QueuePair, Source};
use super::Nic;
use crate::base::config::IbConfig;
use crate::base::error::{Error, Result};
use crate::transport::registry::{Entry, RegCache};

/// Receiver-not-ready retried without end (the receiver reposts at once). The local ACK time-out
/// and the retries before a lost peer turns the queue pair to error (retry exceeded, status 12)
/// are `OXCCL_IB_TIMEOUT` and `OXCCL_IB_RETRY_CNT` ([`IbConfig`]).
const RNR_FOREVER: u8 = 7;

fn terr(msg: String) -> Error {
    Error::Transport {
        rank: usize::MAX,
        peer: usize::MAX,
        transport: "rdma",
        msg,
    }
}

fn os(what: &str) -> Error {
    terr(format!("{what}: {}", std::io::Error::last_os_error()))
}

/// Page-aligned memory registered on a [`Nic`], deregistered on drop.
pub(crate) struct Region {
    mem: MmapMut,
    /// The mapping's first byte, taken once from `mem` (slots are made from it).
    base: *mut u8,
    mr: *mut ffi::ibv_mr,
    // Keeps the protection domain alive while the registration exists.
    _nic: Arc<Nic>,
}

impl Region {
    /// `bytes` (at least one page) registered for `access`.
    pub(crate) fn new(
        nic: &Arc<Nic>,
        bytes: usize,
        access: ffi::ibv_access_flags,
    ) -> Result<Region> {
        let mut mem = MmapMut::map_anon(bytes.max(4096))
            .map_err(|e| terr(format!("cannot map {bytes} bytes for a region: {e}")))?;
        // SAFETY: the mapping is `mem.len()` writable bytes that live as long as the region (the
        // registration is dropped first, in `drop`); the PD is alive (`_nic`).
        let mr = unsafe {
            ffi::ibv_reg_mr(
                nic.pd(),
                mem.as_mut_ptr().cast(),
                mem.len(),
                access.0 as i32,
            )
        };
        if mr.is_null() {
            let e = std::io::Error::last_os_error();
            let hint = if e.kind() == std::io::ErrorKind::OutOfMemory {
                " (usually the locked-memory limit: see ulimit -l; every peer pins its rings)"
            } else {
                ""
            };
            return Err(terr(format!(
                "ibv_reg_mr of {bytes} bytes on {}: {e}{hint}",
                nic.port_name()
            )));
        }
        Ok(Region {
            base: mem.as_mut_ptr(),
            mem,
            mr,
            _nic: Arc::clone(nic),
        })
    }

    fn addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }

    /// Bytes `range` (clamped to the region) as a slice of their own: no reference ever covers
    /// the bytes the NIC reads or writes meanwhile.
    fn slot(&self, range: std::ops::Range<usize>) -> (*mut u8, usize) {
        let end = range.end.min(self.mem.len());
        let start = range.start.min(end);
        // SAFETY: `start <= len` of the mapping, so the offset stays inside it (or one past).
        (unsafe { self.base.add(start) }, end - start)
    }

    fn lkey(&self) -> u32 {
        // SAFETY: `mr` is a live registration (freed only in `drop`).
        unsafe { (*self.mr).lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: as in `lkey`.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: registered in `new`, deregistered once, before the mapping is unmapped.
        unsafe { ffi::ibv_dereg_mr(self.mr) };
    }
}

/// A registered user buffer's memory region (the source of this rank's writes, and the target
/// of peers' writes into the buffers this rank offers), deregistered on drop.
pub(crate) struct UserMr {
    mr: *mut ffi::ibv_mr,
    _nic: Arc<Nic>,
}

// SAFETY: the registration is only read (its keys) and freed once, in `drop`; verbs objects
// may be used from any thread.
unsafe impl Send for UserMr {}
// SAFETY: as above: shared references only read the keys.
unsafe impl Sync for UserMr {}

impl UserMr {
    /// Registers `e`'s bytes on `nic` for local reads and remote writes.
    pub(crate) fn new(nic: &Arc<Nic>, e: &Entry) -> Result<UserMr> {
        // Local write access also makes the pin break copy-on-write and zero pages first, so
        // later writes to the buffer land in the pages the NIC reads (as NCCL registers);
        // remote write lets a peer write a message this rank offered it straight into it.
        use ffi::ibv_access_flags as A;
        let access = (A::IBV_ACCESS_LOCAL_WRITE | A::IBV_ACCESS_REMOTE_WRITE).0 as i32;
        // SAFETY: the range is a live `Registered` buffer's memory (it removes its entry before
        // freeing the memory, and the registration pins the pages it had meanwhile); the PD is
        // alive (`_nic`).
        let mr = unsafe { ffi::ibv_reg_mr(nic.pd(), e.start as *mut _, e.len, access) };
        if mr.is_null() {
            return Err(os(&format!(
                "ibv_reg_mr of a registered buffer ({} bytes) on {}",
                e.len,
                nic.port_name()
            )));
        }
        Ok(UserMr {
            mr,
            _nic: Arc::clone(nic),
        })
    }

    fn lkey(&self) -> u32 {
        // SAFETY: `mr` is a live registration (freed only in `drop`).
        unsafe { (*self.mr).lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: as in `lkey`.
        unsafe { (*self.mr).rkey }
    }
}

impl Drop for UserMr {
    fn drop(&mut self) {
        // SAFETY: registered in `new`, deregistered once; the cache drops it only when no
        // request holds it (in-flight writes keep their own reference).
        unsafe { ffi::ibv_dereg_mr(self.mr) };
    }
}

/// One reliable-connected queue pair (see the module docs).
pub(crate) struct VerbsQp {
    nic: Arc<Nic>,
    /// The registrations of user buffers on this port, shared by the rank's queue pairs.
    user: Arc<RegCache<UserMr>>,
    /// Those that writes in flight read, oldest first, each with the count of posted requests
    /// that ends its write (dropped as completions come).
    reading: std::collections::VecDeque<(u64, Arc<UserMr>)>,
    /// Send requests posted so far.
    posted: u64,
    /// User buffers the device refused to register (their messages go through the slots).
    refused: std::collections::HashSet<u64>,
    cq: *mut ffi::ibv_cq,
    qp: *mut ffi::ibv_qp,
    send: Region,
    recv: Region,
    psn: u32,
    /// The peer's receive region (address, key, bytes), once connected.
    remote: (u64, u32, u64),
    /// Send requests posted and not yet completed, and the most the send queue holds.
    inflight: u32,
    sq_depth: u32,
    /// Completions reaped while waiting for room in the send queue, for the next `poll`.
    early: Vec<Completion>,
    /// A completion in error was seen: the queue pair is in the error state and takes no more
    /// requests (the error itself reaches the protocol through `poll`).
    failed: bool,
    wcs: Vec<ffi::ibv_wc>,
}

// SAFETY: the queue pair and its completion queue are used by one owner at a time (`&mut self`
// for everything that posts or polls); verbs objects may move between threads.
unsafe impl Send for VerbsQp {}

fn post_recvs(qp: *mut ffi::ibv_qp, n: u32) -> Result<()> {
    for _ in 0..n {
        let mut wr = ffi::ibv_recv_wr::default(); // no scatter list: immediates only
        let mut bad = std::ptr::null_mut();
        // SAFETY: `qp` is a live queue pair; its context's ops table is the provider's, whose
        // post_recv reads `wr` (no scatter entries) during the call only.
        let rc = unsafe {
            let post = (*(*qp).context)
                .ops
                .post_recv
                .ok_or_else(|| terr("no post_recv".into()))?;
            post(qp, &mut wr, &mut bad)
        };
        if rc != 0 {
            return Err(terr(format!("ibv_post_recv: error {rc}")));
        }
    }
    Ok(())
}

impl VerbsQp {
    /// A queue pair in the INIT state with `send_bytes` to write from, `recv_bytes` for the
    /// peer to write into, room for `depth` outstanding writes each way, and `depth` receive
    /// requests posted.
    pub(crate) fn new(
        nic: &Arc<Nic>,
        user: &Arc<RegCache<UserMr>>,
        (send_bytes, recv_bytes): (usize, usize),
        depth: u32,
    ) -> Result<VerbsQp> {
        use ffi::ibv_access_flags as A;
        let send = Region::new(nic, send_bytes, A::IBV_ACCESS_LOCAL_WRITE)?;
        let recv = Region::new(
            nic,
            recv_bytes,
            A::IBV_ACCESS_LOCAL_WRITE | A::IBV_ACCESS_REMOTE_WRITE,
        )?;
        let cqe = 2 * depth + 8;
        // SAFETY: an open context; no completion channel, no vector.
        let cq = unsafe {
            ffi::ibv_create_cq(
                nic.ctx(),
                cqe as i32,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(os(&format!("ibv_create_cq({cqe}) on {}", nic.port_name())));
        }
        let mut init = ffi::ibv_qp_init_attr {
            send_cq: cq,
            recv_cq: cq,
            cap: ffi::ibv_qp_cap {
                max_send_wr: depth,
                max_recv_wr: depth,
                max_send_sge: 2, // a slot's header and a user buffer's payload
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            ..Default::default()
        };
        // SAFETY: a live PD and CQ; `init` is read during the call (and `cap` written back).
        let qp = unsafe { ffi::ibv_create_qp(nic.pd(), &mut init) };
        if qp.is_null() {
            let e = os(&format!("ibv_create_qp on {}", nic.port_name()));
            // SAFETY: the CQ made above, unused by any queue pair.
            unsafe { ffi::ibv_destroy_cq(cq) };
            return Err(e);
        }
        let psn = {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .subsec_nanos();
            (t ^ std::process::id().rotate_left(8) ^ qp as usize as u32) & 0xff_ffff
        };
        let me = VerbsQp {
            nic: Arc::clone(nic),
            user: Arc::clone(user),
            reading: std::collections::VecDeque::new(),
            posted: 0,
            refused: std::collections::HashSet::new(),
            cq,
            qp,
            send,
            recv,
            psn,
            remote: (0, 0, 0),
            inflight: 0,
            sq_depth: init.cap.max_send_wr.min(depth),
            early: Vec::new(),
            failed: false,
            wcs: vec![ffi::ibv_wc::default(); 32],
        };
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: nic.port,
            qp_access_flags: (A::IBV_ACCESS_LOCAL_WRITE | A::IBV_ACCESS_REMOTE_WRITE).0,
            ..Default::default()
        };
        use ffi::ibv_qp_attr_mask as M;
        me.modify(
            &mut attr,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "INIT",
        )?;
        post_recvs(qp, depth)?;
        Ok(me)
    }

    fn modify(
        &self,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        to: &str,
    ) -> Result<()> {
        // SAFETY: a live queue pair; `attr` is read during the call.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        if rc != 0 {
            return Err(terr(format!(
                "ibv_modify_qp to {to} on {}: {}",
                self.nic.port_name(),
                std::io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }

    /// What the peer needs to connect to this queue pair and write into its receive region.
    pub(crate) fn address(&self) -> QpAddress {
        QpAddress {
            // SAFETY: a live queue pair; `qp_num` is set at creation.
            qpn: unsafe { (*self.qp).qp_num },
            psn: self.psn,
            lid: self.nic.lid,
            gid: self.nic.gid,
            mtu: self.nic.mtu,
            ring_addr: self.recv.addr(),
            ring_rkey: self.recv.rkey(),
            ring_len: self.recv.mem.len() as u64,
        }
    }

    /// Brings the queue pair to ready-to-send against the peer's `remote` address, at `mtu`,
    /// with `ib`'s time-out, retries, traffic class and service level.
    pub(crate) fn connect(&mut self, remote: &QpAddress, mtu: u32, ib: &IbConfig) -> Result<()> {
        use ffi::ibv_qp_attr_mask as M;
        // RoCE always routes by GID; InfiniBand by LID, with a global route header only to
        // another subnet (a different GID prefix).
        let global = self.nic.link == LinkLayer::Ethernet
            || self.nic.grh_required
            || remote.gid[..8] != self.nic.gid[..8];
        let mut ah = ffi::ibv_ah_attr {
            dlid: remote.lid,
            sl: ib.service_level,
            src_path_bits: 0,
            is_global: u8::from(global),
            port_num: self.nic.port,
            ..Default::default()
        };
        if global {
            ah.grh.dgid.raw = remote.gid;
            ah.grh.sgid_index = self.nic.gid_index as u8;
            ah.grh.hop_limit = 255;
            ah.grh.traffic_class = ib.traffic_class;
        }
        let mut rtr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: mtu.trailing_zeros().saturating_sub(7),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ah_attr: ah,
            ..Default::default()
        };
        self.modify(
            &mut rtr,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;
        let mut rts = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            timeout: ib.timeout,
            retry_cnt: ib.retry_cnt,
            rnr_retry: RNR_FOREVER,
            sq_psn: self.psn,
            max_rd_atomic: 1,
            ..Default::default()
        };
        self.modify(
            &mut rts,
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )?;
        self.remote = (remote.ring_addr, remote.ring_rkey, remote.ring_len);
        Ok(())
    }

    /// Polls the completion queue once into `out`; reposts a receive for each immediate.
    fn reap(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        // SAFETY: a live CQ and its context's ops table; `wcs` has room for `len` entries.
        let n = unsafe {
            let poll = (*(*self.cq).context)
                .ops
                .poll_cq
                .ok_or_else(|| terr("no poll_cq".into()))?;
            poll(self.cq, self.wcs.len() as i32, self.wcs.as_mut_ptr())
        };
        if n < 0 {
            return Err(terr(format!(
                "ibv_poll_cq on {}: {n}",
                self.nic.port_name()
            )));
        }
        let mut reposts = 0;
        for wc in &self.wcs[..n as usize] {
            if let Some((status, vendor)) = wc.error() {
                self.failed = true;
                // SAFETY: ibv_wc_status_str returns a static string for any status.
                let what = unsafe { std::ffi::CStr::from_ptr(ffi::ibv_wc_status_str(status)) };
                out.push(Completion::Error {
                    wr_id: wc.wr_id(),
                    status,
                    what: format!("{} (vendor error {vendor:#x})", what.to_string_lossy()),
                });
                continue;
            }
            match wc.opcode() {
                ffi::ibv_wc_opcode::IBV_WC_RDMA_WRITE => {
                    self.inflight = self.inflight.saturating_sub(1);
                    out.push(Completion::WriteDone { wr_id: wc.wr_id() });
                }
                ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => {
                    reposts += 1;
                    out.push(Completion::Imm {
                        imm: u32::from_be(wc.imm_data),
                        len: wc.len(),
                    });
                }
                other => out.push(Completion::Error {
                    wr_id: wc.wr_id(),
                    status: 0,
                    what: format!("unexpected completion opcode {other}"),
                }),
            }
        }
        // Writes complete in order: the registrations the completed ones read may go.
        let completed = self.posted - u64::from(self.inflight);
        while self.reading.front().is_some_and(|(n, _)| *n <= completed) {
            self.reading.pop_front();
        }
        post_recvs(self.qp, reposts)
    }
}

impl Drop for VerbsQp {
    fn drop(&mut self) {
        // A request destroyed with its queue pair is never carried out: let the last ones (a
        // goodbye, a credit) reach the peer first, for at most a second.
        let deadline = Instant::now() + Duration::from_secs(1);
        let mut sink = Vec::new();
        while self.inflight > 0 && !self.failed && Instant::now() < deadline {
            sink.clear();
            if self.reap(&mut sink).is_err() {
                break;
            }
            std::thread::yield_now();
        }
        // SAFETY: made in `new`, destroyed once, the queue pair before the CQ it uses; the
        // regions (fields) are deregistered after this.
        unsafe {
            ffi::ibv_destroy_qp(self.qp);
            ffi::ibv_destroy_cq(self.cq);
        }
    }
}

impl VerbsQp {
    /// The peer's receive region at `dst` for `len` bytes: its address and key.
    fn ring_at(&self, dst: usize, len: usize) -> Result<(u64, u32)> {
        let (raddr, rkey, rlen) = self.remote;
        if (dst + len) as u64 > rlen {
            return Err(terr(format!(
                "write of {len} bytes to {dst}: outside the peer's region of {rlen} bytes"
            )));
        }
        Ok((raddr + dst as u64, rkey))
    }

    /// Posts a signaled RDMA WRITE WITH IMMEDIATE of `sges` to the peer's memory at `to`
    /// (address and key), once the send queue has room.
    fn post_write(
        &mut self,
        wr_id: u64,
        sges: &mut [ffi::ibv_sge],
        (raddr, rkey): (u64, u32),
        imm: u32,
    ) -> Result<()> {
        // The send queue is full only if completions lag far behind: reap them (kept for the
        // next `poll`) until there is room, for at most 10 s.
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.inflight >= self.sq_depth && !self.failed {
            let mut got = std::mem::take(&mut self.early);
            let r = self.reap(&mut got);
            self.early = got;
            r?;
            if Instant::now() > deadline {
                return Err(terr(format!(
                    "send queue of {} full for 10 s on {}",
                    self.sq_depth,
                    self.nic.port_name()
                )));
            }
        }
        if self.failed {
            // The queue pair is in error; the next `poll` reports why (a lost peer).
            return Ok(());
        }
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            sg_list: sges.as_mut_ptr(),
            num_sge: sges.len() as i32,
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.__bindgen_anon_1.imm_data = imm.to_be();
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: raddr,
            rkey,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: a live queue pair in RTS; the provider's post_send reads `wr` and `sges`
        // during the call, and the bytes the entries name stay registered and untouched until
        // the write's completion (the protocol hands a slot out again only then, a user
        // buffer's bytes count as sent only then, and `reading` holds its registration).
        let rc = unsafe {
            let post = (*(*self.qp).context)
                .ops
                .post_send
                .ok_or_else(|| terr("no post_send".into()))?;
            post(self.qp, &mut wr, &mut bad)
        };
        if rc != 0 {
            return Err(terr(format!(
                "ibv_post_send on {}: {}",
                self.nic.port_name(),
                std::io::Error::from_raw_os_error(rc)
            )));
        }
        self.inflight += 1;
        self.posted += 1;
        Ok(())
    }
}

impl VerbsQp {
    /// The registration of `entry` (made at its first use), which must hold all of `payload`.
    fn user_source(&mut self, payload: &[u8], entry: &Entry) -> Result<Arc<UserMr>> {
        if !entry.holds(payload.as_ptr() as usize, payload.len()) {
            return Err(terr(format!(
                "write of {} bytes outside {entry:?}",
                payload.len()
            )));
        }
        let nic = Arc::clone(&self.nic);
        self.user.get(entry, |e| UserMr::new(&nic, e))
    }
}

impl QueuePair for VerbsQp {
    fn write_imm(
        &mut self,
        wr_id: u64,
        src: usize,
        len: usize,
        dst: usize,
        imm: u32,
    ) -> Result<()> {
        if src + len > self.send.mem.len() {
            return Err(terr(format!(
                "write of {len} bytes from {src}: outside the send region of {} bytes",
                self.send.mem.len()
            )));
        }
        let mut sge = [ffi::ibv_sge {
            addr: self.send.addr() + src as u64,
            length: len as u32,
            lkey: self.send.lkey(),
        }];
        let n = usize::from(len > 0);
        let to = self.ring_at(dst, len)?;
        self.post_write(wr_id, &mut sge[..n], to, imm)
    }

    fn register_user(&mut self, entry: &Entry) -> Option<u32> {
        if self.refused.contains(&entry.id) {
            return None;
        }
        let nic = Arc::clone(&self.nic);
        match self.user.get(entry, |e| UserMr::new(&nic, e)) {
            Ok(mr) => Some(mr.rkey()),
            Err(e) => {
                tracing::warn!(
                    bytes = entry.len,
                    "rdma: a registered buffer's messages go through the slots: {e}"
                );
                self.refused.insert(entry.id);
                None
            }
        }
    }

    fn write_imm_remote(
        &mut self,
        wr_id: u64,
        src: Source<'_>,
        to: (u64, u32),
        imm: u32,
    ) -> Result<()> {
        match src {
            Source::Region(r) => {
                if r.end > self.send.mem.len() {
                    return Err(terr(format!(
                        "write from {r:?}: outside the send region of {} bytes",
                        self.send.mem.len()
                    )));
                }
                let mut sge = [ffi::ibv_sge {
                    addr: self.send.addr() + r.start as u64,
                    length: r.len() as u32,
                    lkey: self.send.lkey(),
                }];
                self.post_write(wr_id, &mut sge, to, imm)
            }
            Source::User(payload, entry) => {
                let mr = self.user_source(payload, entry)?;
                let mut sge = [ffi::ibv_sge {
                    addr: payload.as_ptr() as u64,
                    length: payload.len() as u32,
                    lkey: mr.lkey(),
                }];
                self.post_write(wr_id, &mut sge, to, imm)?;
                self.reading.push_back((self.posted, mr));
                Ok(())
            }
        }
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
        if head + HEADER > self.send.mem.len() {
            return Err(terr(format!(
                "write of a header at {head}: outside the send region"
            )));
        }
        let mr = self.user_source(payload, entry)?;
        let to = self.ring_at(dst, HEADER + payload.len())?;
        let mut sges = [
            ffi::ibv_sge {
                addr: self.send.addr() + head as u64,
                length: HEADER as u32,
                lkey: self.send.lkey(),
            },
            ffi::ibv_sge {
                addr: payload.as_ptr() as u64,
                length: payload.len() as u32,
                lkey: mr.lkey(),
            },
        ];
        self.post_write(wr_id, &mut sges, to, imm)?;
        self.reading.push_back((self.posted, mr));
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<()> {
        out.append(&mut self.early);
        self.reap(out)
    }

    fn send_slot(&mut self, range: std::ops::Range<usize>) -> &mut [u8] {
        let (p, n) = self.send.slot(range);
        // SAFETY: `n` bytes at `p` lie inside the mapping, which lives as long as `self`; the
        // protocol hands out a send slot only once its last write has completed, so the NIC
        // does not read these bytes while the slice lives (`&mut self` keeps it unique).
        unsafe { std::slice::from_raw_parts_mut(p, n) }
    }

    fn recv_slot(&self, range: std::ops::Range<usize>) -> &[u8] {
        let (p, n) = self.recv.slot(range);
        // SAFETY: inside the mapping as above; the peer writes a slot again only after it is
        // released, and the protocol reads only slots whose write has arrived.
        unsafe { std::slice::from_raw_parts(p, n) }
    }
}
