//! [`TcpStoreServer`]: the server side of the TCP store (protocol in [`super::protocol`]).
//!
//! One accept thread polls a nonblocking listener every 20 ms (so dropping the server is noticed
//! promptly) and starts one thread per client. The key/value state is a [`MemStore`]; a `GET`
//! waits on its condition variable with the client's deadline, so it only holds up its own
//! connection. A client that sends an unknown opcode, a zero or oversized length, a malformed
//! body or a truncated frame is disconnected with a `tracing::warn!`; everyone else keeps being
//! served. Dropping the server fails pending gets, shuts every client socket down and joins all
//! threads.

use std::collections::HashMap;
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};

use super::protocol::*;
use super::store::{MemStore, Store, WaitError};
use crate::base::error::{Error, Result};

/// How often the accept loop checks whether the server is being dropped.
const ACCEPT_POLL: Duration = Duration::from_millis(20);
/// Write timeout on client sockets (a client that stops reading is dropped).
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug)]
struct Shared {
    store: MemStore,
    /// The job token a client's `HELLO` must carry (`OXCCL_JOB_TOKEN`); `None`: any client.
    token: Option<Vec<u8>>,
    stop: AtomicBool,
    /// Clones of the client sockets, so that shutdown can unblock their threads.
    clients: Mutex<HashMap<u64, TcpStream>>,
}

impl Shared {
    fn clients(&self) -> MutexGuard<'_, HashMap<u64, TcpStream>> {
        self.clients.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The server side of the TCP store: holds the key/value state and serves
/// [`TcpStore`](super::TcpStore) clients from background threads until dropped.
#[derive(Debug)]
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Binds `addr` (port 0 picks a free port; IPv4 or IPv6; an unspecified IPv6 address also
    /// accepts IPv4 clients where the OS allows) and starts serving in background threads.
    ///
    /// # Errors
    /// [`Error::Store`] when the address cannot be bound (the message says when the port is held
    /// by something else) or the accept thread cannot be started.
    pub fn bind(addr: SocketAddr) -> Result<TcpStoreServer> {
        Self::bind_with_token(addr, None)
    }

    /// [`TcpStoreServer::bind`] serving only clients whose `HELLO` carries `token` (a job's
    /// `OXCCL_JOB_TOKEN`, so that a process of another job cannot join by mistake); `None`
    /// serves every client.
    ///
    /// # Errors
    /// As [`TcpStoreServer::bind`].
    pub fn bind_with_token(addr: SocketAddr, token: Option<&str>) -> Result<TcpStoreServer> {
        let listener = bind_listener(addr).map_err(|(_, e)| e)?;
        Self::serve(listener, token)
    }

    pub(crate) fn serve(listener: TcpListener, token: Option<&str>) -> Result<TcpStoreServer> {
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::Store(format!("store server: local_addr: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::Store(format!("store server on {local_addr}: {e}")))?;
        let shared = Arc::new(Shared {
            store: MemStore::new(),
            token: token.map(|t| t.as_bytes().to_vec()),
            stop: AtomicBool::new(false),
            clients: Mutex::new(HashMap::new()),
        });
        let sh = Arc::clone(&shared);
        let accept = thread::Builder::new()
            .name("oxccl-store-accept".into())
            .spawn(move || accept_loop(listener, sh))
            .map_err(|e| Error::Store(format!("store server on {local_addr}: spawn: {e}")))?;
        tracing::debug!(%local_addr, "oxccl TCP store server listening");
        Ok(TcpStoreServer {
            local_addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The address actually bound (with the real port when bound with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Number of clients currently connected.
    pub fn num_clients(&self) -> usize {
        self.shared.clients().len()
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.accept.take() {
            if h.join().is_err() {
                tracing::warn!(addr = %self.local_addr, "store accept thread panicked");
            }
        }
    }
}

/// Binds and listens on `addr` with `SO_REUSEADDR` (and dual stack for `[::]`). The error
/// carries the I/O error kind so callers can tell "port in use" from other failures.
pub(crate) fn bind_listener(
    addr: SocketAddr,
) -> std::result::Result<TcpListener, (io::ErrorKind, Error)> {
    let fail = |what: &str, e: io::Error| {
        let err = if e.kind() == io::ErrorKind::AddrInUse {
            Error::Store(format!(
                "cannot host the store on {addr}: port {} is already in use (something else \
                 holds it: another process, an earlier job, or the launcher's own store)",
                addr.port()
            ))
        } else {
            Error::Store(format!("cannot host the store on {addr}: {what}: {e}"))
        };
        (e.kind(), err)
    };
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
        .map_err(|e| fail("socket", e))?;
    // Lets a restarted job rebind a port whose old connections sit in TIME_WAIT; it does not
    // allow two listeners on one port.
    sock.set_reuse_address(true)
        .map_err(|e| fail("SO_REUSEADDR", e))?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        // Dual stack where possible; failure just means IPv6-only.
        let _ = sock.set_only_v6(false);
    }
    sock.bind(&addr.into()).map_err(|e| fail("bind", e))?;
    sock.listen(1024).map_err(|e| fail("listen", e))?;
    Ok(sock.into())
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut handlers: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id: u64 = 0;
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let id = next_id;
                next_id += 1;
                if let Some(h) = start_client(&shared, stream, peer, id) {
                    handlers.push(h);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => thread::sleep(ACCEPT_POLL),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::warn!(error = %e, "store server: accept failed");
                thread::sleep(ACCEPT_POLL);
            }
        }
        handlers.retain(|h| !h.is_finished());
    }
    // Shutdown: fail pending gets, unblock every client thread, then wait for them.
    shared.store.close();
    for s in shared.clients().values() {
        let _ = s.shutdown(Shutdown::Both);
    }
    for h in handlers {
        let _ = h.join();
    }
}

fn start_client(
    shared: &Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    id: u64,
) -> Option<JoinHandle<()>> {
    let setup = (|| {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
        stream.try_clone()
    })();
    let clone = match setup {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "store server: cannot set up connection");
            return None;
        }
    };
    shared.clients().insert(id, clone);
    let sh = Arc::clone(shared);
    let spawned = thread::Builder::new()
        .name("oxccl-store-conn".into())
        .spawn(move || {
            serve_client(&sh, stream, peer);
            sh.clients().remove(&id);
        });
    match spawned {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::warn!(%peer, error = %e, "store server: cannot spawn a client thread");
            if let Some(s) = shared.clients().remove(&id) {
                let _ = s.shutdown(Shutdown::Both);
            }
            None
        }
    }
}

fn serve_client(shared: &Shared, mut stream: TcpStream, peer: SocketAddr) {
    tracing::debug!(%peer, "store client connected");
    // With a job token, nothing is served before a `HELLO` that carries it.
    let mut admitted = shared.token.is_none();
    loop {
        let body = match read_frame(&mut stream) {
            Ok(Some(b)) => b,
            Ok(None) => {
                tracing::debug!(%peer, "store client disconnected");
                return;
            }
            Err(e) => {
                if !shared.stop.load(Ordering::SeqCst) {
                    tracing::warn!(%peer, error = %e, "store server: dropping client after a bad or broken frame");
                }
                return;
            }
        };
        let reply = match admit(shared, &body, &mut admitted) {
            Some(refused) => {
                tracing::warn!(%peer, "store server: {refused}");
                let _ = finish_frame(status(ST_ERROR, refused.as_bytes()))
                    .and_then(|f| stream.write_all(&f));
                return;
            }
            None => handle_request(&shared.store, &body),
        };
        let reply = match reply {
            Ok(r) => r,
            Err(msg) => {
                tracing::warn!(%peer, error = %msg, "store server: dropping client after a malformed request");
                return;
            }
        };
        let sent = finish_frame(reply).and_then(|f| stream.write_all(&f));
        if let Err(e) = sent {
            if !shared.stop.load(Ordering::SeqCst) {
                tracing::warn!(%peer, error = %e, "store server: cannot send a reply; dropping client");
            }
            return;
        }
    }
}

/// With a job token: why the request in `body` is refused (`None`: serve it). A `HELLO`
/// whose token matches admits the client; any other request before one is refused.
fn admit(shared: &Shared, body: &[u8], admitted: &mut bool) -> Option<String> {
    let Some(token) = &shared.token else {
        return None;
    };
    if body.first() != Some(&OP_HELLO) {
        return (!*admitted).then(|| "refused a request before the job token".to_owned());
    }
    let mut c = Cursor { buf: &body[1..] };
    let theirs = c.take(MAGIC.len()).ok().and_then(|_| match c.u8() {
        Ok(1) => c.bytes().ok(),
        _ => None,
    });
    if theirs == Some(token.as_slice()) {
        *admitted = true;
        return None;
    }
    Some(if theirs.is_some() {
        "refused a client with another job token (OXCCL_JOB_TOKEN differs: a process of another job?)"
            .to_owned()
    } else {
        "refused a client without the job token (this store's job has one: set OXCCL_JOB_TOKEN)"
            .to_owned()
    })
}

/// Decodes and executes one request; `Err` means the request was malformed (drop the client).
fn handle_request(store: &MemStore, body: &[u8]) -> std::result::Result<Vec<u8>, String> {
    let mut c = Cursor { buf: body };
    let op = c.u8()?;
    let reply = match op {
        OP_SET => {
            let (key, value) = (c.str()?, c.bytes()?);
            c.end()?;
            store_reply(store.set(key, value), |_| Vec::new())
        }
        OP_GET => {
            let (key, ms) = (c.str()?, c.u64()?);
            c.end()?;
            let timeout = if ms == u64::MAX {
                Duration::MAX
            } else {
                Duration::from_millis(ms)
            };
            match store.wait_get(key, timeout) {
                Ok(v) => status(ST_OK, &v),
                Err(WaitError::TimedOut) => status(ST_TIMEOUT, &[]),
                Err(WaitError::Closed) => status(ST_ERROR, b"store server shutting down"),
            }
        }
        OP_TRY_GET => {
            let key = c.str()?;
            c.end()?;
            match store.try_get(key) {
                Ok(Some(v)) => status(ST_OK, &v),
                Ok(None) => status(ST_NOT_FOUND, &[]),
                Err(e) => status(ST_ERROR, e.to_string().as_bytes()),
            }
        }
        OP_ADD => {
            let (key, delta) = (c.str()?, c.u64()? as i64);
            c.end()?;
            store_reply(store.add(key, delta), |v| v.to_le_bytes().to_vec())
        }
        OP_COMPARE_SET => {
            let key = c.str()?;
            let expected = match c.u8()? {
                0 => None,
                1 => Some(c.bytes()?),
                f => return Err(format!("bad option flag {f} in COMPARE_SET")),
            };
            let desired = c.bytes()?;
            c.end()?;
            store_reply(store.compare_set(key, expected, desired), |v| v)
        }
        OP_DELETE => {
            let key = c.str()?;
            c.end()?;
            store_reply(store.delete(key), |b| vec![u8::from(b)])
        }
        OP_HELLO => {
            let magic = c.take(MAGIC.len())?;
            // An optional job token follows (checked by `admit`).
            if !c.buf.is_empty() {
                match c.u8()? {
                    0 => {}
                    _ => {
                        c.bytes()?;
                    }
                }
            }
            c.end()?;
            if magic != MAGIC {
                return Err("HELLO with a wrong magic".to_owned());
            }
            status(ST_OK, MAGIC)
        }
        other => return Err(format!("unknown opcode {other}")),
    };
    Ok(reply)
}

fn store_reply<T>(r: Result<T>, ok: impl FnOnce(T) -> Vec<u8>) -> Vec<u8> {
    match r {
        Ok(v) => status(ST_OK, &ok(v)),
        Err(Error::Store(m)) => status(ST_ERROR, m.as_bytes()),
        Err(e) => status(ST_ERROR, e.to_string().as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_requests_are_rejected() {
        let s = MemStore::new();
        assert!(handle_request(&s, &[99]).is_err());
        assert!(handle_request(&s, &[OP_SET, 5, 0, 0, 0, b'a']).is_err());
        assert!(handle_request(&s, &[OP_HELLO, 1, 2, 3, 4, 5, 6, 7, 8]).is_err());
        let mut ok = vec![OP_TRY_GET];
        put_bytes(&mut ok, b"k");
        let r = handle_request(&s, &ok).unwrap();
        assert_eq!(r[4], ST_NOT_FOUND);
        ok.push(0);
        assert!(handle_request(&s, &ok).is_err(), "trailing bytes");
    }
}
