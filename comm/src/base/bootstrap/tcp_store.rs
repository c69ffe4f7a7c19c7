//! [`TcpStore`]: the client of a [`TcpStoreServer`] (protocol in [`super::protocol`]).
//!
//! [`TcpStore::connect`] resolves the host (names, IPv4, IPv6 literals with or without
//! brackets), retries every ~50 ms until its timeout because the server may start later, sets
//! `TCP_NODELAY` and checks that the peer speaks this protocol (`HELLO`).
//! [`TcpStore::host_or_connect`] also hosts the server when asked.

use std::fmt;
use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

use socket2::Socket;

use super::protocol::*;
use super::store::{timeout_error, Deadline, Store};
use super::tcp_server::{bind_listener, TcpStoreServer};
use crate::base::error::{Error, Result};

/// Pause between connection attempts while the server is not up yet.
const CONNECT_BACKOFF: Duration = Duration::from_millis(50);
/// Read timeout for requests that do not wait (everything but `GET`).
const OP_TIMEOUT: Duration = Duration::from_secs(60);
/// Extra read-timeout slack on top of a `GET` deadline (the server answers at the deadline).
const GET_SLACK: Duration = Duration::from_secs(10);
/// How often a client that cannot reach the store says so.
const STORE_NOTE_EVERY: Duration = Duration::from_secs(5);

/// Longest wait for the reply to the `HELLO` handshake.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// A client of a [`TcpStoreServer`].
///
/// `TcpStore` is `Sync`: each request takes exclusive use of one connection from a small
/// mutex-protected pool (one connection per concurrently active thread, opened on demand), so
/// requests on one connection are serialized, and a thread blocked in [`get`](Store::get) does
/// not stop another thread of the same `TcpStore` from `set`ting the key it waits for. After
/// an I/O failure the pooled connections are dropped and the next request reconnects.
pub struct TcpStore {
    host: String,
    port: u16,
    idle: Mutex<Vec<TcpStream>>,
    reconnect_timeout: Duration,
    /// The job token sent with every connection's `HELLO` (`OXCCL_JOB_TOKEN`).
    token: Option<String>,
    /// Reply time-out of requests that do not wait for a key ([`OP_TIMEOUT`] unless set).
    op_timeout: Duration,
}

impl fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr())
            .finish_non_exhaustive()
    }
}

/// Removes the brackets around an IPv6 literal (`[::1]` -> `::1`).
fn strip_brackets(host: &str) -> &str {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// `host:port`, with brackets around IPv6 literals.
fn fmt_addr(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

impl TcpStore {
    /// Connects to the store server at `host:port`, retrying every ~50 ms until `timeout`
    /// (the server may start later). `host` may be a name, an IPv4 literal or an IPv6 literal
    /// with or without brackets.
    ///
    /// # Errors
    /// [`Error::Store`] when no connection could be made within `timeout` (the message names
    /// the address and the last failure), or when the peer does not speak this protocol.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<TcpStore> {
        Self::connect_with_token(host, port, timeout, None)
    }

    /// [`TcpStore::connect`] presenting the job token `token` to the server (every connection,
    /// reconnections too): a server of another job, or one that requires a token this client
    /// lacks, refuses it at once with an error that says so.
    ///
    /// # Errors
    /// As [`TcpStore::connect`]; `Error::Store` when the server refuses the token.
    pub fn connect_with_token(
        host: &str,
        port: u16,
        timeout: Duration,
        token: Option<&str>,
    ) -> Result<TcpStore> {
        let host = strip_brackets(host.trim()).to_owned();
        let stream = connect_stream(&host, port, timeout, token)?;
        Ok(TcpStore {
            host,
            port,
            idle: Mutex::new(vec![stream]),
            reconnect_timeout: timeout.min(Duration::from_secs(30)),
            token: token.map(str::to_owned),
            op_timeout: OP_TIMEOUT,
        })
    }

    /// Limits how long a request that does not wait for a key (everything but
    /// [`get`](Store::get) and [`wait`](Store::wait)) waits for its reply, 60 s by default, and
    /// how long reconnecting after a failure may take. A watcher that must notice a silent
    /// server quickly (the launchers of a multi-node job) sets a few seconds. At least 1 ms.
    pub fn with_op_timeout(mut self, timeout: Duration) -> TcpStore {
        let t = timeout.max(Duration::from_millis(1));
        self.op_timeout = t;
        self.reconnect_timeout = self.reconnect_timeout.min(t);
        self
    }

    /// If `is_server`, hosts a [`TcpStoreServer`] on all interfaces (`[::]`, falling back to
    /// `0.0.0.0`) at `port` and connects to it over loopback; otherwise just connects to
    /// `host:port` like [`connect_with_token`](Self::connect_with_token). A server whose port
    /// is held already connects to whatever holds it instead (no server returned): an oxccl
    /// store there makes the rendezvous find the second rank 0; anything else fails the
    /// handshake. Keep the returned server alive as long as the store is needed. `token` is the
    /// job's (`OXCCL_JOB_TOKEN`): the server requires it, the client presents it.
    ///
    /// # Errors
    /// [`Error::Store`] when binding or connecting fails (see [`connect`](Self::connect)).
    pub fn host_or_connect(
        host: &str,
        port: u16,
        is_server: bool,
        timeout: Duration,
        token: Option<&str>,
    ) -> Result<(TcpStore, Option<TcpStoreServer>)> {
        if !is_server {
            return Ok((
                TcpStore::connect_with_token(host, port, timeout, token)?,
                None,
            ));
        }
        let v6 = SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port);
        let (listener, loopback) = match bind_listener(v6) {
            Ok(l) => {
                let sock = Socket::from(l);
                let v6_only = sock.only_v6().unwrap_or(true);
                let lb = if v6_only {
                    IpAddr::V6(Ipv6Addr::LOCALHOST)
                } else {
                    IpAddr::V4(Ipv4Addr::LOCALHOST)
                };
                (TcpListener::from(sock), lb)
            }
            Err((io::ErrorKind::AddrInUse, e)) => {
                // Someone holds the port: if it is an oxccl store (a second process started as
                // rank 0, another job on the same port), join it as a client, so that the
                // rendezvous names the conflict (a rank claimed twice) to every process
                // involved; if it is something else, the handshake says so.
                tracing::info!("cannot host the store ({e}); connecting to the one on the port");
                return Ok((
                    TcpStore::connect_with_token(host, port, timeout, token)?,
                    None,
                ));
            }
            // No IPv6 on this machine: IPv4 only.
            Err(_) => (
                bind_listener(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port))
                    .map_err(|(_, e)| e)?,
                IpAddr::V4(Ipv4Addr::LOCALHOST),
            ),
        };
        let server = TcpStoreServer::serve(listener, token)?;
        let store = TcpStore::connect_with_token(
            &loopback.to_string(),
            server.local_addr().port(),
            timeout,
            token,
        )?;
        tracing::info!(addr = %server.local_addr(), advertised_host = host, "hosting the oxccl TCP store");
        Ok((store, Some(server)))
    }

    /// The server address, `host:port` (IPv6 hosts in brackets).
    pub fn addr(&self) -> String {
        fmt_addr(&self.host, self.port)
    }

    /// [`TcpStore::request`] bounded by `timeout` overall: connecting (when no pooled connection
    /// is left) and waiting for the reply.
    fn request_within(
        &self,
        what: &str,
        key: &str,
        frame: Vec<u8>,
        timeout: Duration,
    ) -> Result<(u8, Vec<u8>)> {
        if self.pool().is_empty() {
            // Open the connection here, within the budget, so `request` finds it pooled.
            let s = connect_stream(
                &self.host,
                self.port,
                timeout.min(self.reconnect_timeout),
                self.token.as_deref(),
            )
            .map_err(|e| {
                Error::Store(format!(
                    "{what} on key '{key}' at store {}: opening a connection: {e}",
                    self.addr()
                ))
            })?;
            self.pool().push(s);
        }
        self.request(what, key, frame, Some(timeout))
    }

    /// Sends one request and returns `(status, payload)`.
    fn request(
        &self,
        what: &str,
        key: &str,
        frame: Vec<u8>,
        read_timeout: Option<Duration>,
    ) -> Result<(u8, Vec<u8>)> {
        let fail = |e: &dyn fmt::Display| {
            Error::Store(format!(
                "{what} on key '{key}' at store {}: {e}",
                self.addr()
            ))
        };
        let frame = finish_frame(frame).map_err(|e| fail(&e))?;
        let pooled = self.pool().pop();
        let mut stream = match pooled {
            Some(s) => s,
            None => connect_stream(
                &self.host,
                self.port,
                self.reconnect_timeout,
                self.token.as_deref(),
            )
            .map_err(|e| fail(&format!("opening a connection: {e}")))?,
        };
        let res = (|| {
            stream.set_read_timeout(read_timeout)?;
            stream.set_write_timeout(Some(self.op_timeout))?;
            stream.write_all(&frame)?;
            match read_frame(&mut stream)? {
                Some(body) => Ok((body[0], body[1..].to_vec())),
                None => Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "server closed the connection",
                )),
            }
        })();
        match res {
            Ok(r) => {
                self.pool().push(stream);
                Ok(r)
            }
            Err(e) => {
                // This stream may be mid-frame, and the pooled ones are probably dead too (server
                // restart): drop them all; the next request reconnects.
                self.pool().clear();
                Err(fail(&e))
            }
        }
    }

    fn pool(&self) -> MutexGuard<'_, Vec<TcpStream>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn unexpected(&self, what: &str, key: &str, st: u8, payload: &[u8]) -> Error {
        if st == ST_ERROR {
            Error::Store(format!(
                "{what} on key '{key}' at store {}: server error: {}",
                self.addr(),
                String::from_utf8_lossy(payload)
            ))
        } else {
            Error::Store(format!(
                "{what} on key '{key}' at store {}: unexpected reply status {st} ({} payload bytes)",
                self.addr(),
                payload.len()
            ))
        }
    }
}

fn connect_stream(
    host: &str,
    port: u16,
    timeout: Duration,
    token: Option<&str>,
) -> Result<TcpStream> {
    let deadline = Deadline::after(timeout);
    let mut last_err = String::from("no attempt made");
    let start = std::time::Instant::now();
    let mut next_note = start + STORE_NOTE_EVERY;
    let mut backoff = Duration::from_millis(2);
    loop {
        if std::time::Instant::now() >= next_note {
            next_note += STORE_NOTE_EVERY;
            crate::base::logging::notice(&format!(
                "still trying to reach the store at {} after {} s (last error: {last_err})",
                fmt_addr(host, port),
                start.elapsed().as_secs()
            ));
        }
        match (host, port).to_socket_addrs() {
            Ok(addrs) => {
                for addr in addrs {
                    let t = deadline
                        .remaining()
                        .clamp(Duration::from_millis(100), Duration::from_secs(2));
                    match TcpStream::connect_timeout(&addr, t)
                        .and_then(|s| handshake(s, &deadline, token))
                    {
                        Ok(s) => return Ok(s),
                        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                            return Err(Error::Store(format!(
                                "the store at {} refused this process: {e}",
                                fmt_addr(host, port)
                            )))
                        }
                        Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                            return Err(Error::Store(format!(
                                "{addr} (for {}) is not an oxccl store: {e}",
                                fmt_addr(host, port)
                            )))
                        }
                        Err(e) => last_err = format!("{addr}: {e}"),
                    }
                }
            }
            Err(e) => last_err = format!("cannot resolve '{host}': {e}"),
        }
        if deadline.passed() {
            return Err(Error::Store(format!(
                "could not connect to the store at {} within {timeout:?} (last error: {last_err})",
                fmt_addr(host, port)
            )));
        }
        // A server that is starting (rank 0 of the same job) is usually up within a few
        // milliseconds: retry soon at first, then every CONNECT_BACKOFF.
        thread::sleep(deadline.remaining().min(backoff));
        backoff = (backoff * 2).min(CONNECT_BACKOFF);
    }
}

fn handshake(mut s: TcpStream, deadline: &Deadline, token: Option<&str>) -> io::Result<TcpStream> {
    s.set_nodelay(true)?;
    s.set_write_timeout(Some(OP_TIMEOUT))?;
    s.set_read_timeout(Some(
        deadline
            .remaining()
            .clamp(Duration::from_millis(500), HELLO_TIMEOUT),
    ))?;
    let mut f = start_frame(OP_HELLO);
    f.extend_from_slice(MAGIC);
    if let Some(t) = token {
        f.push(1);
        put_bytes(&mut f, t.as_bytes());
    }
    s.write_all(&finish_frame(f)?)?;
    let reply = match read_frame(&mut s) {
        Ok(Some(b)) => b,
        Ok(None) => {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "closed during the handshake",
            ))
        }
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            return Err(io::Error::new(
                e.kind(),
                "no reply to the oxccl store handshake (is another service, e.g. torch's \
                 TCPStore, listening on this port?)",
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::InvalidData => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("bad handshake reply: {e}"),
            ))
        }
        Err(e) => return Err(e),
    };
    if reply.first() == Some(&ST_ERROR) && reply[1..].starts_with(b"refused") {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            String::from_utf8_lossy(&reply[1..]).into_owned(),
        ));
    }
    if reply.first() != Some(&ST_OK) || &reply[1..] != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "unexpected handshake reply",
        ));
    }
    Ok(s)
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut f = start_frame(OP_SET);
        put_bytes(&mut f, key.as_bytes());
        put_bytes(&mut f, value);
        match self.request("set", key, f, Some(self.op_timeout))? {
            (ST_OK, _) => Ok(()),
            (st, p) => Err(self.unexpected("set", key, st, &p)),
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let ms = if timeout >= Duration::from_millis(u64::MAX - 1) {
            u64::MAX
        } else {
            // Round up so that a sub-millisecond timeout does not become "no wait at all".
            let m = timeout.as_millis() as u64;
            if Duration::from_millis(m) < timeout {
                m + 1
            } else {
                m
            }
        };
        let mut f = start_frame(OP_GET);
        put_bytes(&mut f, key.as_bytes());
        f.extend_from_slice(&ms.to_le_bytes());
        let read_timeout = if ms == u64::MAX {
            None
        } else {
            Some(timeout.saturating_add(GET_SLACK))
        };
        match self.request("get", key, f, read_timeout)? {
            (ST_OK, v) => Ok(v),
            (ST_TIMEOUT, _) => Err(timeout_error(key, timeout)),
            (st, p) => Err(self.unexpected("get", key, st, &p)),
        }
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let mut f = start_frame(OP_TRY_GET);
        put_bytes(&mut f, key.as_bytes());
        match self.request("try_get", key, f, Some(self.op_timeout))? {
            (ST_OK, v) => Ok(Some(v)),
            (ST_NOT_FOUND, _) => Ok(None),
            (st, p) => Err(self.unexpected("try_get", key, st, &p)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut f = start_frame(OP_ADD);
        put_bytes(&mut f, key.as_bytes());
        f.extend_from_slice(&delta.to_le_bytes());
        match self.request("add", key, f, Some(self.op_timeout))? {
            (ST_OK, v) if v.len() == 8 => {
                let mut a = [0u8; 8];
                a.copy_from_slice(&v);
                Ok(i64::from_le_bytes(a))
            }
            (st, p) => Err(self.unexpected("add", key, st, &p)),
        }
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        self.compare_set_within(key, expected, desired, self.op_timeout)
    }

    fn compare_set_within(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        let mut f = start_frame(OP_COMPARE_SET);
        put_bytes(&mut f, key.as_bytes());
        match expected {
            None => f.push(0),
            Some(e) => {
                f.push(1);
                put_bytes(&mut f, e);
            }
        }
        put_bytes(&mut f, desired);
        let timeout = timeout.clamp(Duration::from_millis(1), self.op_timeout);
        match self.request_within("compare_set", key, f, timeout)? {
            (ST_OK, v) => Ok(v),
            (st, p) => Err(self.unexpected("compare_set", key, st, &p)),
        }
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let mut f = start_frame(OP_DELETE);
        put_bytes(&mut f, key.as_bytes());
        match self.request("delete", key, f, Some(self.op_timeout))? {
            (ST_OK, v) if v.len() == 1 => Ok(v[0] != 0),
            (st, p) => Err(self.unexpected("delete", key, st, &p)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brackets_and_addr_format() {
        assert_eq!(strip_brackets("[::1]"), "::1");
        assert_eq!(strip_brackets("::1"), "::1");
        assert_eq!(strip_brackets("host"), "host");
        assert_eq!(fmt_addr("::1", 5), "[::1]:5");
        assert_eq!(fmt_addr("h", 5), "h:5");
    }

    #[test]
    fn server_roundtrip_over_loopback() {
        let srv = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let c = TcpStore::connect(
            "127.0.0.1",
            srv.local_addr().port(),
            Duration::from_secs(10),
        )
        .unwrap();
        c.set("a", b"1").unwrap();
        assert_eq!(c.get("a", Duration::from_secs(1)).unwrap(), b"1");
        assert_eq!(c.add("n", 5).unwrap(), 5);
        let e = c.get("missing", Duration::from_millis(20)).unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
    }

    /// A server that answers the handshake and then never replies: requests end with an error
    /// after the op time-out set, not after the default minute.
    #[test]
    fn op_timeout_bounds_requests_to_a_silent_server() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = thread::spawn(move || {
            let mut held = Vec::new();
            for _ in 0..2 {
                let (mut s, _) = listener.accept().unwrap();
                read_frame(&mut s).unwrap();
                s.write_all(&finish_frame(status(ST_OK, MAGIC)).unwrap())
                    .unwrap();
                held.push(s); // open, silent
            }
            thread::sleep(Duration::from_secs(3));
        });
        let c = TcpStore::connect("127.0.0.1", port, Duration::from_secs(10))
            .unwrap()
            .with_op_timeout(Duration::from_millis(300));
        for what in ["try_get", "set"] {
            let t = std::time::Instant::now();
            let e = if what == "set" {
                c.set("k", b"v").unwrap_err()
            } else {
                c.try_get("k").unwrap_err()
            };
            let took = t.elapsed();
            assert!(took < Duration::from_secs(2), "{what} took {took:?}");
            assert!(e.to_string().contains(what), "{e}");
        }
        server.join().unwrap();
    }
}
