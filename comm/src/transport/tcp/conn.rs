//! The two halves of a TCP connection: slots as staging buffers, non-blocking socket I/O.
//!
//! Wire format, per socket: a stream of frames, each a header `[len u32][kind u32][seq u64]
//! [desc u64][count u64]` (32 bytes, little endian) followed by `len` payload bytes, laid out
//! by [`layout`]: every frame is a whole number of 64-byte lines ([`WIRE_ALIGN`]), a payload of
//! more than 32 bytes starts on a line (the header is followed by 32 zeros) and a smaller one
//! shares the header's line. As long as whole frames are written, the kernel's copy of a payload
//! into its socket buffer then lands on a cache-line boundary and its copy out to the receiver
//! reads from one: on loopback the send copy took about 1.6x as long with 32-byte headers and
//! unpadded payloads (docs/PERF.md, "TCP, sixth run").
//!
//! Frame number `k` of a direction travels on socket `k % nsocks` and lands in slot
//! `k % nslots`, so several sockets carry one direction in parallel and the receiver restores the
//! order without sequence numbers on the wire. A `BYE` frame on each socket says the sender
//! closed its communicator on purpose; an end of stream without it means the peer died
//! (`PeerLost`).

use std::collections::VecDeque;
use std::io::{BufReader, ErrorKind, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use socket2::SockRef;

use crate::base::error::{Error, Result};
use crate::transport::{PollDir, RecvConn, SendConn, Tag};

/// Every frame on the wire is a multiple of this (one cache line).
const WIRE_ALIGN: usize = 64;
/// Frames up to this long (on the wire) are handed over as soon as they are complete when nothing
/// more is buffered: latency-bound messages skip a `recv` that would mostly find nothing, while a
/// stream of larger frames keeps reading ahead (as measured, handing those over too cost 2-5 %
/// of a 16-64 MiB all-reduce's busbw, within the noise).
const HANDOFF_MAX: usize = 4096;
/// Bytes of the encoded header.
const HDR: usize = 32;
/// Zeros that pad a frame written from the caller's memory.
static PAD: [u8; WIRE_ALIGN] = [0; WIRE_ALIGN];

/// Where the payload of a frame of `len` bytes starts and how long the frame is, on the wire.
fn layout(len: usize) -> (usize, usize) {
    let start = if len <= WIRE_ALIGN - HDR {
        HDR
    } else {
        WIRE_ALIGN
    };
    (start, (start + len).next_multiple_of(WIRE_ALIGN))
}
const KIND_DATA: u32 = 1;
const KIND_BYE: u32 = 2;

/// The header of a frame, zero-padded to where its payload starts.
fn encode_hdr(len: usize, kind: u32, tag: &Tag) -> [u8; WIRE_ALIGN] {
    let mut h = [0u8; WIRE_ALIGN];
    h[0..4].copy_from_slice(&(len as u32).to_le_bytes());
    h[4..8].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&tag.seq.to_le_bytes());
    h[16..24].copy_from_slice(&tag.desc.to_le_bytes());
    h[24..32].copy_from_slice(&tag.count.to_le_bytes());
    h
}

fn decode_hdr(h: &[u8; WIRE_ALIGN]) -> (usize, u32, Tag) {
    let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().unwrap_or_default());
    let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().unwrap_or_default());
    (
        u32_at(0) as usize,
        u32_at(4),
        Tag {
            seq: u64_at(8),
            desc: u64_at(16),
            count: u64_at(24),
        },
    )
}

/// One cache line of a slot.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Line([u8; WIRE_ALIGN]);

/// A slot buffer aligned to a cache line (so for every element type), with room for a payload
/// of `bytes` and its padding.
struct SlotBuf(Vec<Line>);

impl SlotBuf {
    fn new(bytes: usize) -> SlotBuf {
        SlotBuf(vec![Line([0; WIRE_ALIGN]); bytes.div_ceil(WIRE_ALIGN)])
    }
    fn bytes(&self, len: usize) -> &[u8] {
        &bytemuck::cast_slice(&self.0)[..len]
    }
    fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.0)[..len]
    }
}

fn lost(rank: usize, peer: usize, detail: String) -> Error {
    Error::PeerLost {
        rank,
        peer,
        op: "tcp transfer".into(),
        detail,
    }
}

fn io_err(rank: usize, peer: usize, e: std::io::Error) -> Error {
    match e.kind() {
        ErrorKind::BrokenPipe
        | ErrorKind::ConnectionReset
        | ErrorKind::ConnectionAborted
        | ErrorKind::UnexpectedEof => lost(rank, peer, format!("connection closed ({e})")),
        _ => Error::Transport {
            rank,
            peer,
            transport: "tcp",
            msg: e.to_string(),
        },
    }
}

struct TxSock {
    stream: TcpStream,
    /// Frame numbers queued on this socket, oldest first.
    queue: VecDeque<u64>,
    /// Bytes of the front frame (header included) already written.
    off: usize,
}

/// A frame written straight from the caller's memory ([`SendConn::send_direct`]).
struct DirectFrame {
    /// Socket it travels on.
    si: usize,
    hdr: [u8; WIRE_ALIGN],
    /// Header bytes (padding included) to write, and those written.
    hdr_len: usize,
    hdr_off: usize,
    /// Payload bytes still to write.
    left: usize,
    /// Padding bytes still to write after the payload.
    pad: usize,
}

/// Send half of a TCP connection.
pub struct TcpSend {
    /// The frame `send_direct` is writing; nothing else goes out on its socket meanwhile.
    direct: Option<DirectFrame>,
    rank: usize,
    peer: usize,
    socks: Vec<TxSock>,
    slots: Vec<SlotBuf>,
    hdrs: Vec<[u8; WIRE_ALIGN]>,
    lens: Vec<usize>,
    busy: Vec<bool>,
    slot_size: usize,
    next: u64,
    handed_out: bool,
    inflight: usize,
}

impl TcpSend {
    pub(crate) fn new(
        rank: usize,
        peer: usize,
        streams: Vec<TcpStream>,
        slot_size: usize,
        nslots: usize,
    ) -> TcpSend {
        TcpSend {
            direct: None,
            rank,
            peer,
            socks: streams
                .into_iter()
                .map(|stream| TxSock {
                    stream,
                    queue: VecDeque::new(),
                    off: 0,
                })
                .collect(),
            slots: (0..nslots).map(|_| SlotBuf::new(slot_size)).collect(),
            hdrs: vec![[0u8; WIRE_ALIGN]; nslots],
            lens: vec![0; nslots],
            busy: vec![false; nslots],
            slot_size,
            next: 0,
            handed_out: false,
            inflight: 0,
        }
    }

    fn write_socket(&mut self, si: usize) -> Result<bool> {
        if self.direct.as_ref().is_some_and(|d| d.si == si) {
            return Ok(false); // a direct frame is half written on this socket
        }
        let nslots = self.slots.len() as u64;
        let mut moved = false;
        loop {
            let sock = &mut self.socks[si];
            let Some(&k) = sock.queue.front() else {
                return Ok(moved);
            };
            let s = (k % nslots) as usize;
            // The padding is whatever the slot holds past the payload: earlier bytes to the
            // same peer, or zeros.
            let (start, total) = layout(self.lens[s]);
            let wire = total - start;
            let r = if sock.off < start {
                let bufs = [
                    IoSlice::new(&self.hdrs[s][sock.off..start]),
                    IoSlice::new(self.slots[s].bytes(wire)),
                ];
                sock.stream.write_vectored(&bufs)
            } else {
                sock.stream
                    .write(&self.slots[s].bytes(wire)[sock.off - start..])
            };
            match r {
                Ok(0) => {
                    return Err(lost(
                        self.rank,
                        self.peer,
                        "socket accepted no bytes".into(),
                    ))
                }
                Ok(n) => {
                    moved = true;
                    sock.off += n;
                    if sock.off == total {
                        sock.off = 0;
                        sock.queue.pop_front();
                        self.busy[s] = false;
                        self.inflight -= 1;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_err(self.rank, self.peer, e)),
            }
        }
    }

    /// Writes the rest of a direct frame whose payload has all been taken: only header and
    /// padding bytes are left, none of the caller's, so it is finished here and not by a later
    /// `send_direct` (the caller counts the message as sent and may never call again). Returns
    /// whether bytes moved.
    fn finish_direct(&mut self) -> Result<bool> {
        let mut moved = false;
        loop {
            let Some(f) = self.direct.as_mut() else {
                return Ok(moved);
            };
            if f.left > 0 {
                return Ok(moved); // the caller's bytes come with its next send_direct
            }
            let r = self.socks[f.si].stream.write_vectored(&[
                IoSlice::new(&f.hdr[f.hdr_off..f.hdr_len]),
                IoSlice::new(&PAD[..f.pad]),
            ]);
            match r {
                Ok(0) => {
                    return Err(lost(
                        self.rank,
                        self.peer,
                        "socket accepted no bytes".into(),
                    ))
                }
                Ok(n) => {
                    moved = true;
                    let h = n.min(f.hdr_len - f.hdr_off);
                    f.hdr_off += h;
                    f.pad -= n - h;
                    if f.hdr_off == f.hdr_len && f.pad == 0 {
                        self.direct = None;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(self.rank, self.peer, e)),
            }
        }
    }
}

impl SendConn for TcpSend {
    fn try_slot(&mut self) -> Result<Option<&mut [u8]>> {
        if self.direct.is_some() {
            self.finish_direct()?;
            if self.direct.is_some() {
                return Ok(None); // the caller finishes its direct message first
            }
        }
        let s = (self.next % self.slots.len() as u64) as usize;
        if self.busy[s] {
            self.progress()?;
            if self.busy[s] {
                return Ok(None);
            }
        }
        self.handed_out = true;
        let size = self.slot_size;
        Ok(Some(self.slots[s].bytes_mut(size)))
    }

    fn post(&mut self, len: usize, tag: Tag) -> Result<()> {
        if !self.handed_out || len > self.slot_size {
            return Err(Error::Transport {
                rank: self.rank,
                peer: self.peer,
                transport: "tcp",
                msg: format!(
                    "post of {len} bytes without a free slot (slot size {})",
                    self.slot_size
                ),
            });
        }
        self.handed_out = false;
        let k = self.next;
        let s = (k % self.slots.len() as u64) as usize;
        self.hdrs[s] = encode_hdr(len, KIND_DATA, &tag);
        self.lens[s] = len;
        self.busy[s] = true;
        self.inflight += 1;
        let si = (k % self.socks.len() as u64) as usize;
        self.socks[si].queue.push_back(k);
        self.next += 1;
        // Write at once: the common small message leaves in this call.
        if self.socks[si].queue.len() == 1 {
            self.write_socket(si)?;
        }
        Ok(())
    }

    fn progress(&mut self) -> Result<bool> {
        let mut moved = self.finish_direct()?;
        for si in 0..self.socks.len() {
            if !self.socks[si].queue.is_empty() {
                moved |= self.write_socket(si)?;
            }
        }
        Ok(moved)
    }

    fn flushed(&self) -> bool {
        self.inflight == 0 && self.direct.is_none()
    }

    fn send_direct(&mut self, data: &[u8], tag: Tag, frame: usize) -> Result<Option<usize>> {
        let mut took = 0;
        loop {
            if self.direct.is_none() {
                if took == data.len() {
                    return Ok(Some(took));
                }
                // Frame k travels on socket k % nsocks, after the frames queued there before it.
                let si = (self.next % self.socks.len() as u64) as usize;
                if !self.socks[si].queue.is_empty() {
                    self.write_socket(si)?;
                    if !self.socks[si].queue.is_empty() {
                        return Ok(Some(took));
                    }
                }
                let len = self.slot_size.min(frame.max(1)).min(data.len() - took);
                let (start, total) = layout(len);
                self.direct = Some(DirectFrame {
                    si,
                    hdr: encode_hdr(len, KIND_DATA, &tag),
                    hdr_len: start,
                    hdr_off: 0,
                    left: len,
                    pad: total - start - len,
                });
                self.next += 1;
            }
            let Some(f) = self.direct.as_mut() else {
                continue;
            };
            let payload = &data[took..took + f.left];
            let pad = &PAD[..f.pad];
            let stream = &mut self.socks[f.si].stream;
            let r = stream.write_vectored(&[
                IoSlice::new(&f.hdr[f.hdr_off..f.hdr_len]),
                IoSlice::new(payload),
                IoSlice::new(pad),
            ]);
            match r {
                Ok(0) => {
                    return Err(lost(
                        self.rank,
                        self.peer,
                        "socket accepted no bytes".into(),
                    ))
                }
                Ok(n) => {
                    let h = n.min(f.hdr_len - f.hdr_off);
                    let p = (n - h).min(f.left);
                    f.hdr_off += h;
                    f.left -= p;
                    f.pad -= n - h - p;
                    took += p;
                    if f.hdr_off == f.hdr_len && f.left == 0 && f.pad == 0 {
                        self.direct = None;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(Some(took)),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(self.rank, self.peer, e)),
            }
        }
    }

    fn sends_direct(&self) -> bool {
        true
    }

    fn poll_fds(&self, out: &mut Vec<(RawFd, PollDir)>) {
        for (si, s) in self.socks.iter().enumerate() {
            // A half-written direct frame waits for room on its socket like queued slots do.
            if !s.queue.is_empty() || self.direct.as_ref().is_some_and(|d| d.si == si) {
                out.push((s.stream.as_raw_fd(), PollDir::Write));
            }
        }
    }

    fn close(&mut self, deadline: Instant) {
        while !self.flushed() && Instant::now() < deadline {
            match self.progress() {
                Ok(true) => {}
                Ok(false) => std::thread::sleep(std::time::Duration::from_micros(200)),
                Err(_) => return,
            }
        }
        if !self.flushed() {
            // The peer sees an end of stream without BYE: data was lost (and a half-written
            // direct frame must not be followed by a BYE header).
            for s in &mut self.socks {
                let _ = s.stream.shutdown(std::net::Shutdown::Write);
            }
            return;
        }
        let bye = encode_hdr(0, KIND_BYE, &Tag::default());
        let bye_len = layout(0).1;
        for s in &mut self.socks {
            let mut off = 0;
            while off < bye_len && Instant::now() < deadline {
                match s.stream.write(&bye[off..bye_len]) {
                    Ok(n) => off += n,
                    Err(e)
                        if e.kind() == ErrorKind::WouldBlock
                            || e.kind() == ErrorKind::Interrupted =>
                    {
                        std::thread::sleep(std::time::Duration::from_micros(200))
                    }
                    Err(_) => break,
                }
            }
            let _ = s.stream.shutdown(std::net::Shutdown::Write);
        }
    }
}

/// Buffer of a receiving socket: a small frame's header and payload (and often the next
/// frame's header) arrive in one `read`; reads of a large payload bypass it (std's `BufReader`
/// reads straight into the caller's buffer when its own is empty and the request is larger).
const RX_BUFFER: usize = 16 << 10;

/// How often a receive socket is put back into delayed-acknowledgement mode while it is used
/// ([`crate::Config::socket_delayed_ack`]). Linux leaves that mode when a delayed
/// acknowledgement's timer fires with the acknowledgement still pending, which takes at least
/// 20 ms after the last data (`TCP_ATO_MIN / 2`); setting it again at most this often, whenever
/// the socket is read, restores it before the next burst at the cost of one `setsockopt` per quiet
/// spell.
const DELAYED_ACK_REARM: Duration = Duration::from_millis(5);

struct RxSock {
    /// Invariant: `read_socket` stops with the buffer empty unless this socket's next slot is
    /// still in use, in which case `poll_fds` does not wait on the socket either.
    stream: BufReader<TcpStream>,
    /// Frame number this socket is reading next.
    frame: u64,
    hdr: [u8; WIRE_ALIGN],
    /// Bytes of the current frame (header included) read so far.
    off: usize,
    len: usize,
    /// [`layout`] of the current frame (`(HDR, 0)` until its header is read).
    start: usize,
    total: usize,
    /// A BYE arrived: the peer closed on purpose.
    bye: bool,
    /// When this socket was last put into delayed-acknowledgement mode (`None`: never, or the
    /// mode is off).
    delayed_ack_set: Option<Instant>,
    /// Calls of `read_socket` since the clock was last checked for [`DELAYED_ACK_REARM`] (reset
    /// when data arrives).
    unclocked_reads: u32,
}

/// Receive half of a TCP connection.
pub struct TcpRecv {
    rank: usize,
    peer: usize,
    socks: Vec<RxSock>,
    slots: Vec<SlotBuf>,
    meta: Vec<Option<(usize, Tag)>>,
    slot_size: usize,
    next: u64,
    handed_out: bool,
    /// Keep the sockets in delayed-acknowledgement mode ([`DELAYED_ACK_REARM`]).
    delayed_ack: bool,
}

impl TcpRecv {
    pub(crate) fn new(
        rank: usize,
        peer: usize,
        streams: Vec<TcpStream>,
        slot_size: usize,
        nslots: usize,
        delayed_ack: bool,
    ) -> TcpRecv {
        TcpRecv {
            delayed_ack,
            rank,
            peer,
            socks: streams
                .into_iter()
                .enumerate()
                .map(|(i, stream)| RxSock {
                    stream: BufReader::with_capacity(RX_BUFFER, stream),
                    frame: i as u64,
                    hdr: [0; WIRE_ALIGN],
                    off: 0,
                    len: 0,
                    start: HDR,
                    total: 0,
                    bye: false,
                    delayed_ack_set: None,
                    unclocked_reads: 0,
                })
                .collect(),
            slots: (0..nslots).map(|_| SlotBuf::new(slot_size)).collect(),
            meta: vec![None; nslots],
            slot_size,
            next: 0,
            handed_out: false,
        }
    }

    fn read_socket(&mut self, si: usize) -> Result<bool> {
        let nslots = self.slots.len() as u64;
        let nsocks = self.socks.len() as u64;
        if self.delayed_ack {
            let sock = &mut self.socks[si];
            // The clock is read on the first call after data and then every 64th call while
            // waiting: enough to notice a quiet spell, cheap next to the `recv` of every call.
            if sock.unclocked_reads.is_multiple_of(64) {
                let now = Instant::now();
                if sock
                    .delayed_ack_set
                    .is_none_or(|t| now.duration_since(t) >= DELAYED_ACK_REARM)
                {
                    // Best effort: a socket that refuses keeps acknowledging at once, which is
                    // slower, never wrong.
                    let _ = SockRef::from(sock.stream.get_ref()).set_quickack(false);
                    sock.delayed_ack_set = Some(now);
                }
            }
            sock.unclocked_reads = sock.unclocked_reads.wrapping_add(1);
        }
        let mut moved = false;
        loop {
            let sock = &mut self.socks[si];
            if sock.bye {
                return Ok(moved);
            }
            // Slot k % nslots is free once frame k - nslots has been consumed.
            if sock.frame >= self.next + nslots {
                return Ok(moved);
            }
            let s = (sock.frame % nslots) as usize;
            let r = if sock.off < sock.start {
                // The header, then (once it says the payload starts on the next line) its padding.
                sock.stream.read(&mut sock.hdr[sock.off..sock.start])
            } else {
                // The payload and its padding, into the slot (sized for both).
                let end = sock.total - sock.start;
                sock.stream
                    .read(&mut self.slots[s].bytes_mut(end)[sock.off - sock.start..])
            };
            match r {
                Ok(0) => {
                    return Err(lost(
                        self.rank,
                        self.peer,
                        "connection closed without goodbye (process died or was killed)".into(),
                    ))
                }
                Ok(n) => {
                    moved = true;
                    sock.unclocked_reads = 0;
                    sock.off += n;
                    if sock.off == HDR && sock.total == 0 {
                        let (len, kind, tag) = decode_hdr(&sock.hdr);
                        if kind == KIND_BYE {
                            sock.bye = true;
                            sock.off = 0;
                            return Ok(moved);
                        }
                        if kind != KIND_DATA || len > self.slot_size {
                            return Err(Error::Transport {
                                rank: self.rank,
                                peer: self.peer,
                                transport: "tcp",
                                msg: format!(
                                    "corrupt frame header (kind {kind}, len {len}, slot {})",
                                    self.slot_size
                                ),
                            });
                        }
                        sock.len = len;
                        (sock.start, sock.total) = layout(len);
                        self.meta[s] = Some((len, tag));
                    }
                    if sock.total != 0 && sock.off == sock.total {
                        // meta[s] was set when the header completed; mark the frame as complete by
                        // advancing this socket to its next frame.
                        let small = sock.total <= HANDOFF_MAX;
                        sock.off = 0;
                        (sock.start, sock.total) = (HDR, 0);
                        sock.frame += nsocks;
                        // A small frame is complete and nothing more is buffered: the caller
                        // takes it now, without first asking the socket for more (a `recv` that
                        // mostly finds nothing, on the critical path of every small message).
                        if small && sock.stream.buffer().is_empty() {
                            return Ok(moved);
                        }
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(moved),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_err(self.rank, self.peer, e)),
            }
        }
    }

    fn frame_complete(&self, k: u64) -> bool {
        let si = (k % self.socks.len() as u64) as usize;
        self.socks[si].frame > k
    }
}

impl RecvConn for TcpRecv {
    fn try_recv(&mut self) -> Result<Option<(Tag, &[u8])>> {
        let k = self.next;
        if !self.frame_complete(k) {
            self.progress()?;
            if !self.frame_complete(k) {
                let si = (k % self.socks.len() as u64) as usize;
                if self.socks[si].bye {
                    return Err(lost(
                        self.rank,
                        self.peer,
                        "peer closed its communicator while this rank still expects data".into(),
                    ));
                }
                return Ok(None);
            }
        }
        let s = (k % self.slots.len() as u64) as usize;
        let Some((len, tag)) = self.meta[s] else {
            return Err(Error::Transport {
                rank: self.rank,
                peer: self.peer,
                transport: "tcp",
                msg: "slot without header".into(),
            });
        };
        self.handed_out = true;
        Ok(Some((tag, self.slots[s].bytes(len))))
    }

    fn release(&mut self) -> Result<()> {
        if !self.handed_out {
            return Err(Error::Transport {
                rank: self.rank,
                peer: self.peer,
                transport: "tcp",
                msg: "release without a received slot".into(),
            });
        }
        self.handed_out = false;
        let s = (self.next % self.slots.len() as u64) as usize;
        self.meta[s] = None;
        self.next += 1;
        Ok(())
    }

    fn progress(&mut self) -> Result<bool> {
        let mut moved = false;
        for si in 0..self.socks.len() {
            moved |= self.read_socket(si)?;
        }
        Ok(moved)
    }

    fn poll_fds(&self, out: &mut Vec<(RawFd, PollDir)>) {
        let nslots = self.slots.len() as u64;
        for s in &self.socks {
            if !s.bye && s.frame < self.next + nslots {
                out.push((s.stream.get_ref().as_raw_fd(), PollDir::Read));
            }
        }
    }
}

/// A connected loopback socket pair, non-blocking with `TCP_NODELAY`, with kernel send and receive
/// buffers of `buffer` bytes where given (tests of this module and of the send thread).
#[cfg(test)]
pub(crate) fn test_socket_pair(buffer: Option<usize>) -> (TcpStream, TcpStream) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (rx, _) = l.accept().unwrap();
    for s in [&tx, &rx] {
        s.set_nodelay(true).unwrap();
        s.set_nonblocking(true).unwrap();
        if let Some(b) = buffer {
            let r = SockRef::from(s);
            r.set_send_buffer_size(b).unwrap();
            r.set_recv_buffer_size(b).unwrap();
        }
    }
    (tx, rx)
}

/// A send half (slots of 128 KiB) over a loopback pair with 4 KiB socket buffers, and the
/// receiving socket (tests).
#[cfg(test)]
pub(crate) fn small_sender() -> (TcpSend, TcpStream) {
    let (tx, rx) = test_socket_pair(Some(4096));
    (TcpSend::new(0, 1, vec![tx], 128 << 10, 2), rx)
}

/// Payload lengths to try for a direct frame that a fresh [`small_sender`] takes whole but whose
/// padding it stops inside: around what one write takes at once, none a multiple of 64 (tests).
#[cfg(test)]
pub(crate) fn padding_candidates() -> impl Iterator<Item = usize> {
    let (mut probe, _rx) = small_sender();
    let big = vec![0u8; 128 << 10];
    let cap = probe
        .send_direct(&big, Tag::default(), big.len())
        .unwrap()
        .unwrap();
    (cap.saturating_sub(256).max(65)..cap + 256).filter(|len| len % 64 != 0)
}

#[cfg(test)]
mod tests;
