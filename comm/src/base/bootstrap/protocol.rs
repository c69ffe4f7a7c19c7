//! The wire protocol shared by [`TcpStoreServer`](super::TcpStoreServer) and
//! [`TcpStore`](super::TcpStore), and its framing helpers.
//!
//! # Wire protocol
//!
//! Every message, both ways, is a frame: a little-endian `u32` body length followed by the body.
//! A body is at most [`MAX_FRAME`] (64 MiB) and never empty. Inside bodies, `str`/`bytes` are a
//! little-endian `u32` length followed by that many bytes (`str` is UTF-8), integers are
//! little-endian, and `opt<bytes>` is a `u8` flag (0 = none, 1 = some) followed, when 1, by
//! `bytes`.
//!
//! Request body: an opcode byte, then its fields:
//!
//! | opcode | name          | fields                                              | OK reply payload        |
//! |--------|---------------|-----------------------------------------------------|-------------------------|
//! | 1      | `SET`         | key: str, value: bytes                              | empty                   |
//! | 2      | `GET`         | key: str, timeout_ms: u64 (`u64::MAX` = no limit)   | the value (raw)         |
//! | 3      | `TRY_GET`     | key: str                                            | the value (raw)         |
//! | 4      | `ADD`         | key: str, delta: i64                                | new value: i64          |
//! | 5      | `COMPARE_SET` | key: str, expected: `opt<bytes>`, desired: bytes    | the value (raw)         |
//! | 6      | `DELETE`      | key: str                                            | existed: u8 (0/1)       |
//! | 7      | `HELLO`       | magic: the 8 bytes `OXCCLST1`, then optionally `opt<bytes>`: the job token | the same 8 bytes |
//!
//! Reply body: a status byte then a payload: `0` OK (payload above), `1` NOT_FOUND (`TRY_GET` of
//! a missing key, empty payload), `2` TIMEOUT (`GET` deadline passed, empty payload), `3` ERROR
//! (payload: a UTF-8 message, e.g. `ADD` on a non-integer value).
//!
//! The client sends `HELLO` right after connecting, so that pointing it at something else
//! (e.g. torch's own `TCPStore`) fails with a clear message instead of hanging. A server started
//! with a job token (`OXCCL_JOB_TOKEN`) answers a `HELLO` without it, or with another, and any
//! request before a good `HELLO`, with `ERROR` (a message starting `refused`) and drops the
//! client.
//!
//! The server runs one thread per client; a `GET` waits on a server-side condition variable with
//! the client's deadline, so it only holds up its own connection. A client that sends an unknown
//! opcode, a zero or oversized length, a malformed body or a truncated frame is disconnected
//! with a `tracing::warn!`; everyone else keeps being served.

use std::io::{self, Read};

/// Largest frame body accepted either way (64 MiB).
pub const MAX_FRAME: usize = 64 << 20;

pub(crate) const OP_SET: u8 = 1;
pub(crate) const OP_GET: u8 = 2;
pub(crate) const OP_TRY_GET: u8 = 3;
pub(crate) const OP_ADD: u8 = 4;
pub(crate) const OP_COMPARE_SET: u8 = 5;
pub(crate) const OP_DELETE: u8 = 6;
pub(crate) const OP_HELLO: u8 = 7;

pub(crate) const ST_OK: u8 = 0;
pub(crate) const ST_NOT_FOUND: u8 = 1;
pub(crate) const ST_TIMEOUT: u8 = 2;
pub(crate) const ST_ERROR: u8 = 3;

pub(crate) const MAGIC: &[u8; 8] = b"OXCCLST1";

pub(crate) fn put_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    // Frames are capped at 64 MiB, so every field length fits in a u32; larger values are
    // rejected by `frame` before anything is sent.
    buf.extend_from_slice(&(b.len().min(u32::MAX as usize) as u32).to_le_bytes());
    buf.extend_from_slice(b);
}

/// Starts a frame: 4 placeholder length bytes then the first body byte.
pub(crate) fn start_frame(first: u8) -> Vec<u8> {
    let mut v = Vec::with_capacity(64);
    v.extend_from_slice(&[0; 4]);
    v.push(first);
    v
}

/// Fills in the length prefix of a frame started with [`start_frame`].
pub(crate) fn finish_frame(mut v: Vec<u8>) -> io::Result<Vec<u8>> {
    let body = v.len() - 4;
    if body > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("message of {body} bytes exceeds the {MAX_FRAME}-byte frame limit"),
        ));
    }
    v[..4].copy_from_slice(&(body as u32).to_le_bytes());
    Ok(v)
}

/// Reads one frame body. `Ok(None)` on a clean end of stream before the first byte.
pub(crate) fn read_frame(r: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut hdr = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut hdr[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("connection closed inside a frame header ({got} of 4 bytes)"),
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(hdr) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame length {len} outside 1..={MAX_FRAME}"),
        ));
    }
    // Grow the buffer as bytes arrive instead of trusting the announced length up front.
    let mut body = Vec::with_capacity(len.min(1 << 16));
    r.take(len as u64).read_to_end(&mut body)?;
    if body.len() != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("truncated frame: got {} of {len} bytes", body.len()),
        ));
    }
    Ok(Some(body))
}

/// Cursor over a frame body.
pub(crate) struct Cursor<'a> {
    pub(crate) buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub(crate) fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        if self.buf.len() < n {
            return Err(format!(
                "body too short: wanted {n} more bytes, {} left",
                self.buf.len()
            ));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    pub(crate) fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u64(&mut self) -> std::result::Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    pub(crate) fn bytes(&mut self) -> std::result::Result<&'a [u8], String> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        self.take(u32::from_le_bytes(a) as usize)
    }
    pub(crate) fn str(&mut self) -> std::result::Result<&'a str, String> {
        std::str::from_utf8(self.bytes()?).map_err(|_| "key is not UTF-8".to_owned())
    }
    pub(crate) fn end(&self) -> std::result::Result<(), String> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{} trailing bytes after the request",
                self.buf.len()
            ))
        }
    }
}

/// A reply frame (not yet length-prefixed) with status `st` and `payload`.
pub(crate) fn status(st: u8, payload: &[u8]) -> Vec<u8> {
    let mut v = start_frame(st);
    v.extend_from_slice(payload);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_roundtrip_and_limits() {
        let f = finish_frame(status(ST_OK, b"abc")).unwrap();
        let body = read_frame(&mut &f[..]).unwrap().unwrap();
        assert_eq!(body, b"\0abc");
        assert!(read_frame(&mut &[][..]).unwrap().is_none());
        let huge = ((MAX_FRAME + 1) as u32).to_le_bytes();
        assert_eq!(
            read_frame(&mut &huge[..]).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        let zero = 0u32.to_le_bytes();
        assert!(read_frame(&mut &zero[..]).is_err());
        let trunc = [10, 0, 0, 0, 1, 2];
        assert_eq!(
            read_frame(&mut &trunc[..]).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
        assert!(read_frame(&mut &[1, 0][..]).is_err());
    }
}
