//! Integration tests of the rendezvous stores: one conformance suite run against every backend,
//! plus TCP-specific tests (concurrency, blocking gets, garbage clients, IPv6, hosting) and
//! cross-instance `FileStore` tests.

use std::io::{Read, Write};
use std::net::{Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use oxccl_comm::bootstrap::{FileStore, MemStore, PrefixStore, Store, TcpStore, TcpStoreServer};
use oxccl_comm::Error;

const T: Duration = Duration::from_secs(20);
/// Generous slack for "returns after its deadline" checks (CI machines can be slow).
const SLACK: Duration = Duration::from_secs(10);

fn expect_store_err<T: std::fmt::Debug>(r: oxccl_comm::Result<T>, needle: &str) -> String {
    match r {
        Err(Error::Store(msg)) => {
            assert!(
                msg.contains(needle),
                "message {msg:?} should mention {needle:?}"
            );
            msg
        }
        other => panic!("expected Error::Store mentioning {needle:?}, got {other:?}"),
    }
}

/// The shared conformance suite. `a` and `b` are two handles on the same store (they may be the
/// same object): writes through one must be visible through the other.
fn conformance(a: Arc<dyn Store>, b: Arc<dyn Store>) {
    // set / get / try_get, visibility across handles, overwrite, binary and empty values.
    assert_eq!(a.try_get("c/missing").unwrap(), None);
    a.set("c/k", b"v1").unwrap();
    assert_eq!(b.get("c/k", T).unwrap(), b"v1");
    assert_eq!(b.try_get("c/k").unwrap().as_deref(), Some(&b"v1"[..]));
    b.set("c/k", b"v2").unwrap();
    assert_eq!(a.get("c/k", T).unwrap(), b"v2");
    let bin: Vec<u8> = (0..=255u8).collect();
    a.set("c/bin", &bin).unwrap();
    assert_eq!(b.get("c/bin", T).unwrap(), bin);
    a.set("c/empty", b"").unwrap();
    assert_eq!(b.try_get("c/empty").unwrap().as_deref(), Some(&b""[..]));
    assert_eq!(b.get("c/empty", T).unwrap(), b"");
    a.set("c/odd key:with spaces/%2F", b"x").unwrap();
    assert_eq!(b.get("c/odd key:with spaces/%2F", T).unwrap(), b"x");
    assert_eq!(
        b.try_get("c/odd key:with spaces/%2F").unwrap().as_deref(),
        Some(&b"x"[..])
    );

    // add: missing = 0, decimal ASCII, negative deltas, shared across handles.
    assert_eq!(a.add("c/n", 5).unwrap(), 5);
    assert_eq!(b.add("c/n", -7).unwrap(), -2);
    assert_eq!(a.add("c/n", 0).unwrap(), -2);
    assert_eq!(a.get("c/n", T).unwrap(), b"-2");
    b.set("c/n2", b"40").unwrap();
    assert_eq!(a.add("c/n2", 2).unwrap(), 42);
    a.set("c/notnum", b"abc").unwrap();
    expect_store_err(b.add("c/notnum", 1), "c/notnum");

    // compare_set, torch semantics.
    assert_eq!(a.compare_set("c/cas", None, b"first").unwrap(), b"first");
    assert_eq!(b.try_get("c/cas").unwrap().as_deref(), Some(&b"first"[..]));
    assert_eq!(b.compare_set("c/cas", None, b"other").unwrap(), b"first");
    assert_eq!(
        b.compare_set("c/cas", Some(b"wrong"), b"other").unwrap(),
        b"first"
    );
    assert_eq!(
        b.compare_set("c/cas", Some(b"first"), b"second").unwrap(),
        b"second"
    );
    assert_eq!(a.get("c/cas", T).unwrap(), b"second");
    assert_eq!(
        a.compare_set("c/cas-missing", Some(b"exp"), b"des")
            .unwrap(),
        b"exp"
    );
    assert_eq!(a.try_get("c/cas-missing").unwrap(), None);

    // delete.
    assert!(a.delete("c/k").unwrap());
    assert!(!b.delete("c/k").unwrap());
    assert_eq!(b.try_get("c/k").unwrap(), None);
    assert_eq!(a.add("c/k", 1).unwrap(), 1, "a deleted key counts as 0");

    // get blocks until another handle sets the key.
    let b2 = Arc::clone(&b);
    let setter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        b2.set("c/late", b"here").unwrap();
    });
    assert_eq!(a.get("c/late", T).unwrap(), b"here");
    setter.join().unwrap();

    // wait: all present, then one missing with a single overall deadline.
    a.set("c/w1", b"1").unwrap();
    b.set("c/w2", b"2").unwrap();
    a.wait(&["c/w1", "c/w2"], T).unwrap();
    let b3 = Arc::clone(&b);
    let setter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        b3.set("c/w3", b"3").unwrap();
    });
    a.wait(&["c/w1", "c/w3"], T).unwrap();
    setter.join().unwrap();
    let timeout = Duration::from_millis(300);
    let t0 = Instant::now();
    let msg = expect_store_err(
        a.wait(&["c/w1", "c/never1", "c/never2"], timeout),
        "c/never1",
    );
    let el = t0.elapsed();
    assert!(
        el >= Duration::from_millis(250),
        "wait returned early: {el:?} ({msg})"
    );
    assert!(el < timeout + SLACK, "wait took {el:?}");

    // get times out with Error::Store naming the key and the timeout.
    let timeout = Duration::from_millis(250);
    let t0 = Instant::now();
    let msg = expect_store_err(a.get("ranks/3/addr", timeout), "ranks/3/addr");
    let el = t0.elapsed();
    assert!(msg.contains("250ms"), "{msg}");
    assert!(msg.contains("timed out"), "{msg}");
    assert!(
        el >= Duration::from_millis(200),
        "get returned early: {el:?}"
    );
    assert!(el < timeout + SLACK, "get took {el:?}");

    // zero timeout on a present key still succeeds.
    assert_eq!(a.get("c/w1", Duration::ZERO).unwrap(), b"1");
}

fn tcp_pair(srv: &TcpStoreServer, host: &str) -> (Arc<dyn Store>, Arc<dyn Store>) {
    let port = srv.local_addr().port();
    let a = TcpStore::connect(host, port, T).unwrap();
    let b = TcpStore::connect(host, port, T).unwrap();
    (Arc::new(a), Arc::new(b))
}

fn temp_dir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "oxccl-store-test-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn mem_store_conformance() {
    let s: Arc<dyn Store> = Arc::new(MemStore::new());
    conformance(Arc::clone(&s), s);
}

#[test]
fn tcp_store_conformance() {
    let srv = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let (a, b) = tcp_pair(&srv, "127.0.0.1");
    conformance(a, b);
}

#[test]
fn tcp_store_conformance_shared_client() {
    let srv = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let s: Arc<dyn Store> =
        Arc::new(TcpStore::connect("localhost", srv.local_addr().port(), T).unwrap());
    conformance(Arc::clone(&s), s);
}

#[test]
fn file_store_conformance() {
    let dir = temp_dir("conf");
    let a: Arc<dyn Store> = Arc::new(FileStore::new(&dir).unwrap());
    let b: Arc<dyn Store> = Arc::new(FileStore::new(&dir).unwrap());
    conformance(a, b);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn prefix_store_conformance_and_isolation() {
    let inner: Arc<dyn Store> = Arc::new(MemStore::new());
    let a: Arc<dyn Store> = Arc::new(PrefixStore::new(Arc::clone(&inner), "job"));
    let b: Arc<dyn Store> = Arc::new(PrefixStore::new(Arc::clone(&inner), "job"));
    conformance(a, b);
    let other = PrefixStore::new(Arc::clone(&inner), "other");
    assert_eq!(other.try_get("c/w1").unwrap(), None);
    assert_eq!(
        inner.try_get("job/c/w1").unwrap().as_deref(),
        Some(&b"1"[..])
    );
}

#[test]
fn ipv6_loopback() {
    let addr = SocketAddr::new(Ipv6Addr::LOCALHOST.into(), 0);
    let srv = match TcpStoreServer::bind(addr) {
        Ok(s) => s,
        Err(e) => {
            println!("note: skipping the IPv6 test, cannot bind [::1]: {e}");
            return;
        }
    };
    let port = srv.local_addr().port();
    let a: Arc<dyn Store> = Arc::new(TcpStore::connect("[::1]", port, T).unwrap());
    let b: Arc<dyn Store> = Arc::new(TcpStore::connect("::1", port, T).unwrap());
    assert!(format!("{a:?}").contains("[::1]"));
    conformance(a, b);
}

#[test]
fn tcp_concurrent_adds_from_16_clients() {
    let srv = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = srv.local_addr().port();
    let threads: Vec<_> = (0..16)
        .map(|_| {
            thread::spawn(move || {
                let c = TcpStore::connect("127.0.0.1", port, T).unwrap();
                for _ in 0..100 {
                    c.add("counter", 1).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let c = TcpStore::connect("127.0.0.1", port, T).unwrap();
    assert_eq!(c.add("counter", 0).unwrap(), 1600);
    assert_eq!(c.get("counter", T).unwrap(), b"1600");
}

#[test]
fn tcp_threads_sharing_one_client() {
    let srv = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let c = Arc::new(TcpStore::connect("127.0.0.1", srv.local_addr().port(), T).unwrap());
    let threads: Vec<_> = (0..8)
        .map(|i| {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                for j in 0..50 {
                    c.add("shared", 1).unwrap();
                    c.set(&format!("t{i}/{j}"), format!("{i}-{j}").as_bytes())
                        .unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(c.add("shared", 0).unwrap(), 400);
    assert_eq!(c.get("t7/49", T).unwrap(), b"7-49");
}

#[test]
fn tcp_blocking_get_does_not_block_other_clients() {
    let srv = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = srv.local_addr().port();
    let waiter = thread::spawn(move || {
        let c = TcpStore::connect("127.0.0.1", port, T).unwrap();
        c.get("ranks/0/addr", T).unwrap()
    });
    thread::sleep(Duration::from_millis(150));
    // While the waiter blocks server-side, other clients are served promptly.
    let c = TcpStore::connect("127.0.0.1", port, T).unwrap();
    for i in 0..20 {
        c.add("busy", i).unwrap();
    }
    c.set("ranks/0/addr", b"10.0.0.1:1234").unwrap();
    assert_eq!(waiter.join().unwrap(), b"10.0.0.1:1234");
}

#[test]
fn tcp_get_longer_than_default_slack_window() {
    // A get whose wait exceeds a couple of seconds still succeeds (read timeout follows the
    // request deadline).
    let srv = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = srv.local_addr().port();
    let c = TcpStore::connect("127.0.0.1", port, T).unwrap();
    let setter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(1500));
        TcpStore::connect("127.0.0.1", port, T)
            .unwrap()
            .set("slow", b"ok")
            .unwrap();
    });
    assert_eq!(c.get("slow", Duration::from_secs(30)).unwrap(), b"ok");
    setter.join().unwrap();
}

/// Opens a raw connection, sends `bytes`, half-closes if asked, and returns the stream.
fn raw(port: u16, bytes: &[u8], close_write: bool) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(bytes).unwrap();
    if close_write {
        s.shutdown(std::net::Shutdown::Write).unwrap();
    }
    s
}

/// Asserts that the server closes `s` (EOF or reset) instead of replying.
fn assert_dropped(mut s: TcpStream, what: &str) {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("{what}: expected the server to drop the connection, got {other:?}"),
    }
}

#[test]
fn tcp_server_survives_garbage_clients() {
    // Show the server's warnings with `--nocapture`.
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let srv = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = srv.local_addr().port();
    let good = TcpStore::connect("127.0.0.1", port, T).unwrap();
    good.set("before", b"1").unwrap();

    // Random bytes (the first four read as an absurd length).
    let junk: Vec<u8> = (0..200u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8 | 0x80)
        .collect();
    assert_dropped(raw(port, &junk, false), "random bytes");
    // A huge length prefix (just over the 64 MiB cap), connection kept open.
    assert_dropped(
        raw(port, &((64u32 << 20) + 1).to_le_bytes(), false),
        "huge length",
    );
    assert_dropped(raw(port, &u32::MAX.to_le_bytes(), false), "u32::MAX length");
    // A zero-length frame.
    assert_dropped(raw(port, &0u32.to_le_bytes(), false), "zero length");
    // A well-formed frame with an unknown opcode.
    assert_dropped(raw(port, &[1, 0, 0, 0, 200], false), "bad opcode");
    // A known opcode with a body too short for its fields.
    assert_dropped(raw(port, &[3, 0, 0, 0, 1, 9, 9], false), "short body");
    // A truncated frame, then the client hangs up mid-request.
    let mut trunc = 100u32.to_le_bytes().to_vec();
    trunc.extend_from_slice(&[1; 10]);
    assert_dropped(raw(port, &trunc, true), "truncated frame");
    // A truncated header.
    assert_dropped(raw(port, &[5, 0], true), "truncated header");
    // Immediate disconnects.
    for _ in 0..5 {
        drop(TcpStream::connect(("127.0.0.1", port)).unwrap());
    }
    // An idle client that sends half a frame and stays connected must not block anyone.
    let idle = raw(port, &[50, 0, 0, 0, 1, 2, 3], false);

    // The server still serves a proper client, old and new.
    assert_eq!(good.get("before", T).unwrap(), b"1");
    assert_eq!(good.add("after", 3).unwrap(), 3);
    let fresh = TcpStore::connect("127.0.0.1", port, T).unwrap();
    assert_eq!(fresh.get("after", T).unwrap(), b"3");
    drop(idle);
}

#[test]
fn connect_waits_for_a_late_server() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let starter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(300));
        TcpStoreServer::bind(SocketAddr::from(([127, 0, 0, 1], port))).unwrap()
    });
    let c = TcpStore::connect("127.0.0.1", port, T).unwrap();
    let srv = starter.join().unwrap();
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k", T).unwrap(), b"v");
    drop(srv);
}

#[test]
fn connect_times_out_naming_the_address() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let t0 = Instant::now();
    let msg = expect_store_err(
        TcpStore::connect("127.0.0.1", port, Duration::from_millis(300)),
        &port.to_string(),
    );
    assert!(msg.contains("127.0.0.1"), "{msg}");
    assert!(t0.elapsed() < Duration::from_millis(300) + SLACK);
}

#[test]
fn connect_rejects_a_foreign_service() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n");
        thread::sleep(Duration::from_millis(200));
    });
    let msg = expect_store_err(
        TcpStore::connect("127.0.0.1", port, T),
        "not an oxccl store",
    );
    assert!(msg.contains(&port.to_string()), "{msg}");
    server.join().unwrap();
}

#[test]
fn host_or_connect_hosts_and_joins_a_busy_port() {
    let (store, server) = TcpStore::host_or_connect("localhost", 0, true, T, None).unwrap();
    let server = server.expect("is_server must return the server");
    let port = server.local_addr().port();
    assert_ne!(port, 0);
    store.set("hello", b"world").unwrap();
    let (client, none) = TcpStore::host_or_connect("127.0.0.1", port, false, T, None).unwrap();
    assert!(none.is_none());
    assert_eq!(client.get("hello", T).unwrap(), b"world");

    // A second host on the same port joins the store there (the rendezvous then finds the
    // second rank 0).
    let (again, none) = TcpStore::host_or_connect("localhost", port, true, T, None).unwrap();
    assert!(none.is_none());
    assert_eq!(again.get("hello", T).unwrap(), b"world");
}

#[test]
fn a_store_with_a_job_token_refuses_other_clients_at_once() {
    let srv = TcpStoreServer::bind_with_token("127.0.0.1:0".parse().unwrap(), Some("t-1")).unwrap();
    let port = srv.local_addr().port();
    let ok = TcpStore::connect_with_token("127.0.0.1", port, T, Some("t-1")).unwrap();
    ok.set("k", b"v").unwrap();
    assert_eq!(ok.get("k", T).unwrap(), b"v");
    for (token, why) in [
        (Some("t-2"), "another job token"),
        (None, "without the job token"),
    ] {
        let t0 = Instant::now();
        let msg = expect_store_err(
            TcpStore::connect_with_token("127.0.0.1", port, T, token),
            "refused",
        );
        assert!(
            msg.contains(why) && msg.contains(&port.to_string()),
            "{msg}"
        );
        assert!(
            t0.elapsed() < T,
            "refused at once, not after retries: {msg}"
        );
    }
    // A raw request before the handshake is not served either.
    let mut raw = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut f = vec![0u8; 4];
    f.push(3); // TRY_GET
    f.extend_from_slice(&1u32.to_le_bytes());
    f.push(b'k');
    let len = (f.len() - 4) as u32;
    f[..4].copy_from_slice(&len.to_le_bytes());
    raw.write_all(&f).unwrap();
    let mut reply = Vec::new();
    let _ = raw.read_to_end(&mut reply);
    assert!(
        String::from_utf8_lossy(&reply).contains("refused"),
        "{reply:?}"
    );
}

#[test]
fn server_drop_wakes_waiters_and_stops_promptly() {
    let srv = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = srv.local_addr().port();
    let waiter = thread::spawn(move || {
        let c = TcpStore::connect("127.0.0.1", port, T).unwrap();
        c.get("never", Duration::from_secs(120))
    });
    let idle = TcpStream::connect(("127.0.0.1", port)).unwrap();
    thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    drop(srv);
    assert!(t0.elapsed() < SLACK, "drop took {:?}", t0.elapsed());
    expect_store_err(waiter.join().unwrap(), "never");
    assert_dropped(idle, "idle client at shutdown");
    // The port is free again.
    let again = TcpStoreServer::bind(SocketAddr::from(([127, 0, 0, 1], port))).unwrap();
    drop(again);
}

#[test]
fn client_reconnects_after_server_restart() {
    let srv = TcpStoreServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = srv.local_addr().port();
    let c = TcpStore::connect("127.0.0.1", port, T).unwrap();
    c.set("a", b"1").unwrap();
    drop(srv);
    assert!(c.try_get("a").is_err(), "the old connection is gone");
    let _srv2 = TcpStoreServer::bind(SocketAddr::from(([127, 0, 0, 1], port))).unwrap();
    c.set("b", b"2").unwrap();
    assert_eq!(c.try_get("b").unwrap().as_deref(), Some(&b"2"[..]));
}

#[test]
fn file_store_concurrent_adds_across_instances() {
    let dir = temp_dir("adds");
    let threads: Vec<_> = (0..6)
        .map(|i| {
            let dir = dir.clone();
            thread::spawn(move || {
                let s = FileStore::new(&dir).unwrap();
                for _ in 0..40 {
                    s.add("counter", 1).unwrap();
                }
                s.set(&format!("rank/{i}"), format!("{i}").as_bytes())
                    .unwrap();
                s.compare_set("leader", None, format!("{i}").as_bytes())
                    .unwrap()
            })
        })
        .collect();
    let leaders: Vec<Vec<u8>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(
        leaders.windows(2).all(|w| w[0] == w[1]),
        "one leader: {leaders:?}"
    );
    let s = FileStore::new(&dir).unwrap();
    assert_eq!(s.add("counter", 0).unwrap(), 240);
    let keys: Vec<String> = (0..6).map(|i| format!("rank/{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    s.wait(&refs, T).unwrap();
    // No temporary files are left behind.
    for e in std::fs::read_dir(&dir).unwrap() {
        let name = e.unwrap().file_name().into_string().unwrap();
        assert!(!name.starts_with(".tmp"), "leftover {name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn file_store_get_waits_for_other_instance() {
    let dir = temp_dir("wait");
    let a = FileStore::new(&dir).unwrap();
    let dir2 = dir.clone();
    let setter = thread::spawn(move || {
        thread::sleep(Duration::from_millis(150));
        FileStore::new(&dir2)
            .unwrap()
            .set("ranks/1/addr", b"x")
            .unwrap();
    });
    assert_eq!(a.get("ranks/1/addr", T).unwrap(), b"x");
    setter.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn file_store_lock_held_elsewhere_gives_up_naming_dir_and_key() {
    let dir = temp_dir("lock");
    let s = FileStore::new(&dir).unwrap();
    // Someone else (here: another open file description) holds the directory lock.
    let holder = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join(".lock"))
        .unwrap();
    holder.lock().unwrap();
    // On a thread, so that a lock wait without a deadline fails the test instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    let s2 = s.clone();
    thread::spawn(move || {
        let r = s2.compare_set_within("ranks/0/lock", None, b"v", Duration::from_millis(100));
        let _ = tx.send(r);
    });
    let r = rx
        .recv_timeout(T)
        .expect("compare_set_within waited past its timeout for the lock");
    let msg = expect_store_err(r, "ranks/0/lock");
    assert!(msg.contains(&dir.display().to_string()), "{msg}");
    // Released: mutations work again.
    drop(holder);
    assert_eq!(
        s.compare_set("ranks/0/lock", None, b"v").unwrap(),
        b"v".to_vec()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
