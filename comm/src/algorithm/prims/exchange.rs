//! Exchanges: sends and receives streamed slot by slot through the transports, reduced or
//! copied straight out of each slot, several at once so that none blocks another; and the
//! pipelined forward of chains and trees.

use std::sync::atomic::{AtomicU8, Ordering};

use oxccl_kernels::{DType, ReduceOp};

use super::send_thread::RUNNING;
use super::{copy, missing, proto_err, retag, Ctx, RecvMode, RecvPart, SendPart};
use crate::base::error::{Error, Result};
use crate::base::op::OpDesc;
use crate::transport::{RecvConn, Tag};

/// Messages of at least this many bytes are sent straight from the caller's memory where the
/// transport can ([`SendConn::send_direct`]: TCP, RDMA from registered buffers), skipping the
/// copy into a slot; and received straight into it where it can
/// ([`crate::transport::RecvConn::recv_direct`]: RDMA into registered buffers), skipping the
/// copy out of one.
const DIRECT_SEND_MIN: usize = 64 << 10;
/// A message sent straight from the caller's memory goes out in at least this many frames (each
/// at least [`DIRECT_SEND_MIN`] bytes, at most a slot), so the receiver reduces or copies the
/// first while the next is on the wire. Measured over loopback TCP, 2 ranks, 7 interleaved rounds
/// (`OXCCL_SLOT_BYTES` 128 KiB against 512 KiB for every frame): 1 MiB all-reduce (512 KiB
/// messages) 1.07 against 0.80 GB/s busbw, but 64 MiB 1.16 against 1.37; cutting only smaller
/// messages finer keeps both.
const DIRECT_FRAMES: usize = 4;

/// Frame size for a direct send of a `len`-byte message (see [`DIRECT_FRAMES`]).
pub(super) fn direct_frame(len: usize) -> usize {
    (len / DIRECT_FRAMES / 4096 * 4096).max(DIRECT_SEND_MIN)
}

impl Ctx<'_> {
    /// Sends `send` to one peer while receiving into another buffer from a (possibly different)
    /// peer, slot by slot, both directions interleaved so neither can block the other.
    pub(crate) fn exchange(
        &mut self,
        send: Option<(usize, &[u8])>,
        recv: Option<(usize, &mut [u8], RecvMode<'_>)>,
    ) -> Result<()> {
        let tag = self.tag;
        self.exchange_tagged(
            send.map(|(p, d)| (p, d, tag)),
            recv.map(|(p, b, m)| (p, b, m, tag)),
        )
    }

    /// [`Ctx::exchange`] with explicit tags (point-to-point uses per-pair sequence numbers).
    pub(crate) fn exchange_tagged(
        &mut self,
        send: Option<(usize, &[u8], Tag)>,
        recv: Option<(usize, &mut [u8], RecvMode<'_>, Tag)>,
    ) -> Result<()> {
        self.exchange_mirrored(send, None, recv)
    }

    /// [`Ctx::exchange`] whose sent bytes are also copied into `mirror` (same length as the sent
    /// data) piece by piece, right after each piece goes into a slot while it is still in cache:
    /// out-of-place collectives put their own input in place this way instead of with one big
    /// copy before the first send.
    pub(crate) fn exchange_mirrored(
        &mut self,
        send: Option<(usize, &[u8], Tag)>,
        mirror: Option<&mut [u8]>,
        recv: Option<(usize, &mut [u8], RecvMode<'_>, Tag)>,
    ) -> Result<()> {
        debug_assert!(mirror
            .as_ref()
            .is_none_or(|m| send.as_ref().is_some_and(|s| s.1.len() == m.len())));
        // No allocation on this path: every blocking exchange of every algorithm goes through it.
        let mut send =
            send.map(|(peer, data, tag)| SendPart::new(peer, data, tag).mirrored(mirror));
        let mut recv = recv.map(|(peer, buf, mode, tag)| RecvPart::new(peer, buf, mode, tag));
        self.exchange_many(send.as_mut_slice(), recv.as_mut_slice())
    }

    /// [`Ctx::exchange`] whose sent elements (of `scale.0`) leave multiplied by `scale.1`, scaled
    /// piece by piece into the slots (never straight from `data`): a rank's own input entering a
    /// pre-multiplied sum, without a pass of its own over the input first.
    pub(crate) fn exchange_scaled(
        &mut self,
        send: (usize, &[u8]),
        scale: (DType, f64),
        recv: Option<(usize, &mut [u8], RecvMode<'_>)>,
    ) -> Result<()> {
        let tag = self.tag;
        let mut send = SendPart::new(send.0, send.1, tag);
        send.scale = Some(scale);
        let mut recv = recv.map(|(peer, buf, mode)| RecvPart::new(peer, buf, mode, tag));
        self.exchange_many(std::slice::from_mut(&mut send), recv.as_mut_slice())
    }

    /// Several sends and receives at once (to and from different peers, or the same), all
    /// streamed slot by slot and interleaved so none can block another; returns when every one is
    /// complete. Peers are ranks of this context.
    pub(crate) fn exchange_many(
        &mut self,
        sends: &mut [SendPart<'_>],
        recvs: &mut [RecvPart<'_>],
    ) -> Result<()> {
        for s in sends.iter_mut() {
            s.peer = self.real(s.peer);
        }
        for r in recvs.iter_mut() {
            r.peer = self.real(r.peer);
        }
        if let Some(t) = self.send_thread.filter(|_| !recvs.is_empty()) {
            if sends.iter().any(|s| self.threadable(s, sends)) {
                return self.exchange_split(t, sends, recvs);
            }
        }
        self.exchange_loop(sends, recvs, None)
    }

    /// The loop of [`Ctx::exchange_many`]; `stop` set (by the send thread, after an error)
    /// ends it early.
    pub(super) fn exchange_loop(
        &mut self,
        sends: &mut [SendPart<'_>],
        recvs: &mut [RecvPart<'_>],
        stop: Option<&AtomicU8>,
    ) -> Result<()> {
        loop {
            if sends.iter().all(|s| s.done) && recvs.iter().all(|r| r.done) {
                return Ok(());
            }
            if stop.is_some_and(|s| s.load(Ordering::Relaxed) != RUNNING) {
                return Err(Error::Aborted {
                    rank: self.me(),
                    reason: format!("{}: the send thread failed", self.op),
                });
            }
            self.arm();
            let mut moved = false;
            for s in sends.iter_mut().filter(|s| !s.done) {
                moved |= self.send_some(s)?;
            }
            for r in recvs.iter_mut().filter(|r| !r.done) {
                if self.recv_one(r.peer, r.buf, &mut r.got, r.mode, &r.tag)? {
                    r.done = r.got == r.buf.len();
                    moved = true;
                }
            }
            if !moved {
                let desc = || {
                    let mut parts = Vec::new();
                    for s in sends.iter().filter(|s| !s.done) {
                        parts.push(format!(
                            "sending to rank {}: {}/{} bytes",
                            s.peer,
                            s.sent,
                            s.data.len()
                        ));
                    }
                    for r in recvs.iter().filter(|r| !r.done) {
                        parts.push(format!(
                            "receiving from rank {}: {}/{} bytes",
                            r.peer,
                            r.got,
                            r.buf.len()
                        ));
                    }
                    parts.join(", ")
                };
                self.idle(&desc)?;
            } else {
                // Progress: the next wait starts with a spin again.
                self.moved();
            }
        }
    }

    /// Moves the next piece of `s` into its connection; whether anything moved.
    pub(super) fn send_some(&mut self, s: &mut SendPart<'_>) -> Result<bool> {
        let me = self.me();
        let conn = self
            .links
            .send
            .get_mut(s.peer)
            .and_then(|c| c.as_mut())
            .ok_or_else(|| missing(me, self.op, s.peer, "send"))?;
        let (data, sent) = (s.data, s.sent);
        // Large messages leave straight from the caller's memory where the backend can (TCP;
        // RDMA from registered buffers, or into the receiver's offered buffer); the rest is
        // staged in slots.
        let direct = if data.len() >= DIRECT_SEND_MIN && s.scale.is_none() {
            conn.send_direct(&data[sent..], s.tag, direct_frame(data.len()))
                .map_err(|e| retag(self.op, e))?
        } else {
            None
        };
        let (n, progressed) = match direct {
            Some(n) => (n, n > 0),
            None => match conn.try_slot().map_err(|e| retag(self.op, e))? {
                Some(slot) => {
                    let n = match s.scale {
                        Some((dt, factor)) => {
                            // Whole elements per slot (slots are multiples of 64 bytes).
                            let whole = slot.len() / dt.size() * dt.size();
                            if whole == 0 {
                                return Err(Error::InvalidArgument {
                                    rank: me,
                                    op: self.op.into(),
                                    msg: format!(
                                        "a slot of {} bytes holds no {dt} element",
                                        slot.len()
                                    ),
                                });
                            }
                            let n = whole.min(data.len() - sent);
                            oxccl_kernels::scale_into_bytes(
                                dt,
                                &mut slot[..n],
                                &data[sent..sent + n],
                                factor,
                            )
                            .map_err(|e| Error::InvalidArgument {
                                rank: me,
                                op: self.op.into(),
                                msg: e.to_string(),
                            })?;
                            n
                        }
                        None => {
                            let n = slot.len().min(data.len() - sent);
                            slot[..n].copy_from_slice(&data[sent..sent + n]);
                            n
                        }
                    };
                    conn.post(n, s.tag).map_err(|e| retag(self.op, e))?;
                    (n, true)
                }
                None => (0, false),
            },
        };
        if progressed {
            if let Some(m) = s.mirror.as_mut() {
                copy(self.stream, &mut m[sent..sent + n], &data[sent..sent + n]);
            }
            s.sent += n;
            s.done = s.sent == data.len();
        }
        Ok(progressed)
    }

    /// Consumes one slot from `peer` (a communicator rank) into `buf[*got..]`; false if none has
    /// arrived.
    pub(super) fn recv_one(
        &mut self,
        peer: usize,
        buf: &mut [u8],
        got: &mut usize,
        mode: RecvMode<'_>,
        want: &Tag,
    ) -> Result<bool> {
        let rank = self.me();
        let op = self.op;
        let conn = self
            .links
            .recv
            .get_mut(peer)
            .and_then(|c| c.as_mut())
            .ok_or_else(|| missing(rank, op, peer, "recv"))?;
        // A large message copied out as it is lands straight in the caller's memory where the
        // backend can (RDMA into a registered buffer); the frames it still sends through slots
        // follow below. Decided on the whole message, so every frame of it comes this way.
        let direct = buf.len() >= DIRECT_SEND_MIN && matches!(mode, RecvMode::Copy);
        // The bytes that landed (added to `got`), or `None` when the backend took no offer.
        let mut landed = |conn: &mut dyn RecvConn| -> Result<Option<usize>> {
            let landed = conn.recv_direct(&mut buf[*got..], *want);
            let landed = landed.map_err(|e| retag(op, e))?;
            *got += landed.unwrap_or(0);
            Ok(landed)
        };
        let offered = match direct.then(|| landed(&mut **conn)).transpose()?.flatten() {
            Some(1..) => return Ok(true),
            Some(0) => true,
            None => false,
        };
        let Some((tag, data)) = conn.try_recv().map_err(|e| retag(op, e))? else {
            // A frame may have landed since `recv_direct` looked (`try_recv` leaves it): take
            // it now rather than after the wait it would otherwise cost.
            return Ok(offered && landed(&mut **conn)?.is_some_and(|n| n > 0));
        };
        if tag != *want {
            let local = OpDesc::describe_tag(want);
            let remote = OpDesc::describe_tag(&tag);
            return Err(Error::Mismatch {
                rank,
                peer,
                seq: want.seq,
                local,
                remote,
            });
        }
        let n = data.len();
        if n > buf.len() - *got {
            return Err(proto_err(
                rank,
                peer,
                format!("{op}: {n} bytes arrived, {} expected", buf.len() - *got),
            ));
        }
        let dst = &mut buf[*got..*got + n];
        let kerr = |e: oxccl_kernels::KernelError| proto_err(rank, peer, format!("{op}: {e}"));
        match mode {
            RecvMode::Copy => copy(self.stream, dst, data),
            RecvMode::Reduce(dt, rop) => {
                oxccl_kernels::reduce_bytes(dt, rop, dst, data).map_err(kerr)?
            }
            RecvMode::ReduceFrom(dt, rop, src) => {
                let own = &src[*got..*got + n];
                oxccl_kernels::reduce_into_bytes(dt, rop, dst, own, data).map_err(kerr)?
            }
            RecvMode::ScaleReduce(dt, factor, src) => {
                match src {
                    Some(src) => {
                        let own = &src[*got..*got + n];
                        oxccl_kernels::scale_into_bytes(dt, dst, own, factor)
                    }
                    None => oxccl_kernels::scale_bytes(dt, dst, factor),
                }
                .map_err(kerr)?;
                oxccl_kernels::reduce_bytes(dt, ReduceOp::Sum, dst, data).map_err(kerr)?
            }
        }
        *got += n;
        conn.release()?;
        Ok(true)
    }

    /// Sends `data` to `peer`.
    pub(crate) fn send(&mut self, peer: usize, data: &[u8]) -> Result<()> {
        self.exchange(Some((peer, data)), None)
    }

    /// Receives into `buf` from `peer`.
    pub(crate) fn recv(&mut self, peer: usize, buf: &mut [u8], mode: RecvMode<'_>) -> Result<()> {
        self.exchange(None, Some((peer, buf, mode)))
    }

    /// Receives `buf` from `from` slot by slot and forwards each received piece (after applying
    /// `mode`, i.e. the reduced value) to `to`: the pipelined step of chains and trees.
    pub(crate) fn recv_forward(
        &mut self,
        from: usize,
        to: usize,
        buf: &mut [u8],
        mode: RecvMode<'_>,
    ) -> Result<()> {
        let tag = self.tag;
        let (from, to) = (self.real(from), self.real(to));
        let (mut got, mut fwd) = (0usize, 0usize);
        let (mut recv_frames, mut send_frames) = (0usize, 0usize);
        loop {
            let recv_done = got == buf.len() && recv_frames > 0;
            let send_done = fwd == buf.len() && send_frames > 0;
            if recv_done && send_done {
                return Ok(());
            }
            self.arm();
            let mut moved = false;
            if !recv_done && self.recv_one(from, buf, &mut got, mode, &tag)? {
                recv_frames += 1;
                moved = true;
            }
            if !send_done && (fwd < got || (recv_frames > 0 && got == buf.len())) {
                let me = self.me();
                let conn = self
                    .links
                    .send
                    .get_mut(to)
                    .and_then(|c| c.as_mut())
                    .ok_or_else(|| missing(me, self.op, to, "send"))?;
                // Into the next rank's buffer where it offered one (RDMA), else via a slot.
                let offered = if buf.len() >= DIRECT_SEND_MIN && fwd < got {
                    let frame = direct_frame(buf.len());
                    let (avail, rest) = (&buf[fwd..got], buf.len() - fwd);
                    conn.forward_offered(avail, rest, tag, frame)
                        .map_err(|e| retag(self.op, e))?
                } else {
                    None
                };
                if let Some(n) = offered {
                    if n > 0 {
                        fwd += n;
                        send_frames += 1;
                        moved = true;
                    }
                } else if let Some(slot) = conn.try_slot().map_err(|e| retag(self.op, e))? {
                    let n = slot.len().min(got - fwd);
                    slot[..n].copy_from_slice(&buf[fwd..fwd + n]);
                    conn.post(n, tag).map_err(|e| retag(self.op, e))?;
                    fwd += n;
                    send_frames += 1;
                    moved = true;
                }
            }
            if !moved {
                let total = buf.len();
                self.idle(&|| format!("forwarding from rank {from} to rank {to}: received {got}/{total}, forwarded {fwd}/{total} bytes"))?;
            } else {
                self.moved();
            }
        }
    }
}
