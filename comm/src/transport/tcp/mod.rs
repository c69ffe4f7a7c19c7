//! TCP backend: works between any two ranks that can reach each other over IP.
//!
//! Each rank listens on one port per communicator (address chosen by [`iface`]); the address is
//! published through the store. For every ordered pair (sender, receiver) the sender opens
//! `OXCCL_NSOCKS` sockets to the receiver's listener and introduces each with a hello
//! (`magic, communicator hash, sender rank, socket index, socket count, slot size`); the receiver
//! sizes its slots from the hello. Sockets are non-blocking, `TCP_NODELAY`, with large kernel
//! buffers (`OXCCL_SOCKET_BUFFER`). Every socket carries data one way only, so the receiving side
//! delays its acknowledgements (`OXCCL_SOCKET_DELAYED_ACK`): an immediate acknowledgement of each
//! small message is a packet of its own, and sending it was 15 % of a 2-rank 8 B all-reduce.

mod conn;
pub mod iface;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockRef, Socket, Type};

#[cfg(test)]
pub(crate) use conn::{padding_candidates, small_sender};
pub use conn::{TcpRecv, TcpSend};

use crate::base::config::Config;
use crate::base::error::{Error, Result};
use crate::transport::{CanConnect, Group, Links, Memory, PeerInfo, Reach, Transport};

const MAGIC: u64 = 0x4f58_4343_4c01_7463; // "OXCCL\x01tc"
const HELLO: usize = 32;

/// The TCP backend of one rank of one communicator.
pub struct TcpTransport {
    rank: usize,
    comm_hash: u64,
    listener: TcpListener,
    addr: SocketAddr,
    cfg: Config,
    /// Accepted sockets not yet claimed: (from rank) -> (socket index -> stream, nsocks, slot size).
    pending: HashMap<usize, (HashMap<usize, TcpStream>, usize, usize)>,
}

fn tune(sock: &SockRef<'_>, cfg: &Config) {
    let _ = sock.set_nodelay(true);
    if cfg.socket_buffer > 0 {
        let _ = sock.set_send_buffer_size(cfg.socket_buffer);
        let _ = sock.set_recv_buffer_size(cfg.socket_buffer);
    }
}

/// Formats a socket address for the store (IPv6 in brackets).
fn fmt_addr(a: &SocketAddr) -> String {
    a.to_string()
}

impl TcpTransport {
    /// Binds this rank's listener.
    ///
    /// # Errors
    /// `Error::Config` when no interface matches, `Error::Transport` when binding fails.
    pub fn bind(
        rank: usize,
        comm_hash: u64,
        cfg: &Config,
        store_host: Option<std::net::IpAddr>,
    ) -> Result<TcpTransport> {
        let ip =
            iface::choose_local_ip(cfg.socket_ifname.as_deref(), cfg.socket_family, store_host)?;
        let terr = |msg: String| Error::Transport {
            rank,
            peer: rank,
            transport: "tcp",
            msg,
        };
        let sock = Socket::new(
            Domain::for_address(SocketAddr::new(ip, 0)),
            Type::STREAM,
            Some(Protocol::TCP),
        )
        .map_err(|e| terr(format!("socket: {e}")))?;
        if cfg.socket_buffer > 0 {
            // Set before listen so accepted sockets inherit a large window.
            let _ = sock.set_recv_buffer_size(cfg.socket_buffer);
        }
        sock.bind(&SocketAddr::new(ip, 0).into())
            .map_err(|e| terr(format!("bind {ip}: {e}")))?;
        sock.listen(1024)
            .map_err(|e| terr(format!("listen: {e}")))?;
        let listener: TcpListener = sock.into();
        listener
            .set_nonblocking(true)
            .map_err(|e| terr(e.to_string()))?;
        let addr = listener.local_addr().map_err(|e| terr(e.to_string()))?;
        Ok(TcpTransport {
            rank,
            comm_hash,
            listener,
            addr,
            cfg: cfg.clone(),
            pending: HashMap::new(),
        })
    }

    /// The address peers connect to.
    pub fn addr(&self) -> String {
        fmt_addr(&self.addr)
    }

    /// Opens the send half to `peer`.
    ///
    /// # Errors
    /// `Error::Transport` naming the peer and address when connecting fails before `deadline`.
    pub fn connect_tcp_send(&self, peer: &PeerInfo, deadline: Instant) -> Result<TcpSend> {
        let terr = |msg: String| Error::Transport {
            rank: self.rank,
            peer: peer.rank,
            transport: "tcp",
            msg,
        };
        let addr: SocketAddr = peer
            .tcp_addr
            .parse()
            .map_err(|_| terr(format!("bad peer address {:?}", peer.tcp_addr)))?;
        let nsocks = self.cfg.nsocks;
        let mut streams = Vec::with_capacity(nsocks);
        for i in 0..nsocks {
            let stream = loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(terr(format!(
                        "could not connect to {addr} before the deadline"
                    )));
                }
                match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
                    Ok(s) => break s,
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                        return Err(Error::PeerLost {
                            rank: self.rank,
                            peer: peer.rank,
                            op: "connect".into(),
                            detail: format!("{addr} refused the connection: {e}"),
                        })
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            };
            tune(&SockRef::from(&stream), &self.cfg);
            let mut hello = [0u8; HELLO];
            hello[0..8].copy_from_slice(&MAGIC.to_le_bytes());
            hello[8..16].copy_from_slice(&self.comm_hash.to_le_bytes());
            hello[16..20].copy_from_slice(&(self.rank as u32).to_le_bytes());
            hello[20..24].copy_from_slice(&(i as u32).to_le_bytes());
            hello[24..28].copy_from_slice(&(nsocks as u32).to_le_bytes());
            hello[28..32].copy_from_slice(&(self.cfg.slot_bytes as u32).to_le_bytes());
            let mut s = stream;
            s.set_write_timeout(Some(Duration::from_secs(5)))
                .map_err(|e| terr(e.to_string()))?;
            s.write_all(&hello)
                .map_err(|e| terr(format!("hello to {addr}: {e}")))?;
            s.set_nonblocking(true).map_err(|e| terr(e.to_string()))?;
            streams.push(s);
        }
        Ok(TcpSend::new(
            self.rank,
            peer.rank,
            streams,
            self.cfg.slot_bytes,
            self.cfg.nslots,
        ))
    }

    /// Accepts the receive halves from every rank in `from`, in any arrival order.
    ///
    /// # Errors
    /// `Error::Timeout` naming the ranks still missing at `deadline`.
    pub fn accept_tcp_recvs(
        &mut self,
        from: &[usize],
        deadline: Instant,
    ) -> Result<Vec<(usize, TcpRecv)>> {
        let complete = |p: &HashMap<usize, (HashMap<usize, TcpStream>, usize, usize)>, r: usize| {
            p.get(&r).is_some_and(|(m, n, _)| m.len() == *n)
        };
        let mut backoff = Duration::from_micros(50);
        while !from.iter().all(|r| complete(&self.pending, *r)) {
            match self.listener.accept() {
                Ok((s, _)) => {
                    backoff = Duration::from_micros(50);
                    if let Some((r, i, n, slot)) = self.read_hello(&s) {
                        let e = self
                            .pending
                            .entry(r)
                            .or_insert_with(|| (HashMap::new(), n, slot));
                        e.0.insert(i, s);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = from
                            .iter()
                            .copied()
                            .filter(|r| !complete(&self.pending, *r))
                            .collect();
                        return Err(Error::Timeout {
                            rank: self.rank,
                            op: "tcp connect".into(),
                            timeout: self.cfg.timeout,
                            detail: format!("no connection from ranks {missing:?}"),
                        });
                    }
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(5));
                }
                Err(e) => {
                    return Err(Error::Transport {
                        rank: self.rank,
                        peer: self.rank,
                        transport: "tcp",
                        msg: format!("accept: {e}"),
                    })
                }
            }
        }
        let mut out = Vec::with_capacity(from.len());
        for &r in from {
            let Some((mut m, n, slot)) = self.pending.remove(&r) else {
                continue;
            };
            let streams: Vec<TcpStream> = (0..n).filter_map(|i| m.remove(&i)).collect();
            out.push((
                r,
                TcpRecv::new(
                    self.rank,
                    r,
                    streams,
                    slot,
                    self.cfg.nslots,
                    self.cfg.socket_delayed_ack,
                ),
            ));
        }
        Ok(out)
    }

    /// Reads and checks a hello; strangers and garbage are dropped with a warning.
    fn read_hello(&self, s: &TcpStream) -> Option<(usize, usize, usize, usize)> {
        let mut hello = [0u8; HELLO];
        let ok = s.set_nonblocking(false).is_ok()
            && s.set_read_timeout(Some(Duration::from_secs(2))).is_ok()
            && (&*s).read_exact(&mut hello).is_ok();
        let u64_at = |i: usize| u64::from_le_bytes(hello[i..i + 8].try_into().unwrap_or_default());
        let u32_at =
            |i: usize| u32::from_le_bytes(hello[i..i + 4].try_into().unwrap_or_default()) as usize;
        if !ok || u64_at(0) != MAGIC || u64_at(8) != self.comm_hash {
            tracing::warn!(
                rank = self.rank,
                "tcp: dropped a connection without a valid hello"
            );
            return None;
        }
        let (r, i, n, slot) = (u32_at(16), u32_at(20), u32_at(24), u32_at(28));
        if i >= n || n == 0 || n > 64 || slot == 0 || slot > (64 << 20) {
            tracing::warn!(
                rank = self.rank,
                "tcp: dropped a connection with a malformed hello"
            );
            return None;
        }
        tune(&SockRef::from(s), &self.cfg);
        if s.set_read_timeout(None).is_err() || s.set_nonblocking(true).is_err() {
            return None;
        }
        Some((r, i, n, slot))
    }
}

/// Ranks with a TCP address (every rank has one): the selector's rule for this backend.
pub(crate) fn can_connect(_: &PeerInfo, b: &PeerInfo, _: &Config) -> Reach {
    if b.tcp_addr.parse::<SocketAddr>().is_ok() {
        Reach::Yes
    } else {
        Reach::No(format!("no TCP address for rank {}", b.rank))
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn memory(&self) -> Memory {
        Memory::Host
    }

    fn can_connect(&self) -> CanConnect {
        can_connect
    }

    fn advertise(&self, me: &mut PeerInfo) {
        me.tcp_addr = self.addr();
    }

    /// Nothing to make: the listener was bound when the backend was made, and its address is
    /// in this rank's record.
    fn setup(&mut self, _: &Group<'_>, _: &[usize]) -> Result<()> {
        Ok(())
    }

    /// A full mesh among `peers`: this rank opens its send halves first (the peers' listen
    /// backlogs complete the handshakes without them), then accepts its receive halves in any
    /// order.
    fn connect(&mut self, group: &Group<'_>, peers: &[usize], links: &mut Links) -> Result<()> {
        for &p in peers {
            let send = self.connect_tcp_send(&group.peers[p], group.deadline)?;
            links.send[p] = Some(Box::new(send));
        }
        for (p, conn) in self.accept_tcp_recvs(peers, group.deadline)? {
            links.recv[p] = Some(Box::new(conn));
            let addr = &group.peers[p].tcp_addr;
            tracing::info!(rank = self.rank, peer = p, transport = "tcp", %addr, nsocks = self.cfg.nsocks, "connected");
        }
        Ok(())
    }
}
