//! The [`Store`] trait (a small key/value rendezvous store with blocking gets, atomic counters
//! and compare-and-set, modelled on torch's `c10d::Store`), the key-namespacing [`PrefixStore`]
//! and the in-process [`MemStore`].
//!
//! Keys are UTF-8 strings, values are arbitrary bytes. Counters manipulated by [`Store::add`]
//! are stored as decimal ASCII, so `get` on a counter key returns e.g. `b"42"`.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::base::error::{Error, Result};

/// A rendezvous key/value store shared by all ranks of a job.
///
/// Implementations: [`MemStore`] (one process, many threads),
/// [`TcpStore`](super::TcpStore) (a client of a [`TcpStoreServer`](super::TcpStoreServer)),
/// [`FileStore`](super::FileStore) (a directory on a shared filesystem) and [`PrefixStore`]
/// (a namespace inside another store).
///
/// All failures are [`Error::Store`] with a message naming the key and what happened.
pub trait Store: Send + Sync + fmt::Debug {
    /// Stores `value` under `key`, replacing any previous value, and wakes waiters on `key`.
    ///
    /// # Errors
    /// [`Error::Store`] when the backend cannot be reached or written.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// Waits until `key` exists (or the timeout passes -> Error::Store naming the key and timeout).
    ///
    /// # Errors
    /// [`Error::Store`] on time-out (the message names the key and the timeout) or when the
    /// backend fails.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;

    /// Returns the value of `key` if it exists, without waiting.
    ///
    /// # Errors
    /// [`Error::Store`] when the backend fails.
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// Atomically adds `delta` to the integer stored at key (missing = 0; stored as decimal
    /// ASCII); returns the new value.
    ///
    /// # Errors
    /// [`Error::Store`] when the current value is not a decimal integer, the sum overflows, or
    /// the backend fails.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Compare-and-set with torch's `TCPStore::compareSet` semantics.
    ///
    /// * key missing, `expected == None`: stores `desired` and returns it;
    /// * key missing, `expected == Some(e)`: stores nothing and returns `e`;
    /// * key present and equal to `expected`: stores `desired` and returns it;
    /// * otherwise: stores nothing and returns the current value.
    ///
    /// # Errors
    /// [`Error::Store`] when the backend fails.
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>>;

    /// [`Store::compare_set`] that gives up after about `timeout` (a store that cannot be reached
    /// must not hold up a rank that is reporting a failure). The default has no bound of its own
    /// beyond the backend's; network stores override it.
    ///
    /// # Errors
    /// [`Error::Store`] when the backend fails or the time runs out.
    fn compare_set_within(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        let _ = timeout;
        self.compare_set(key, expected, desired)
    }

    /// Removes the key; Ok(true) if it existed.
    ///
    /// # Errors
    /// [`Error::Store`] when the backend fails.
    fn delete(&self, key: &str) -> Result<bool>;

    /// Waits until every key in `keys` exists, with one overall deadline `timeout`.
    ///
    /// # Errors
    /// [`Error::Store`] naming the first key still missing at the deadline, or a backend failure.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Deadline::after(timeout);
        for key in keys {
            match self.get(key, deadline.remaining()) {
                Ok(_) => {}
                Err(Error::Store(msg)) => {
                    return Err(Error::Store(format!(
                        "wait for {} key(s) with an overall timeout of {timeout:?}: {msg}",
                        keys.len()
                    )))
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// A point in time that may be "never" (timeouts too large to represent).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline(Option<Instant>);

impl Deadline {
    /// The deadline `timeout` from now (`never` if that overflows `Instant`).
    pub(crate) fn after(timeout: Duration) -> Self {
        Deadline(Instant::now().checked_add(timeout))
    }

    /// Time left (zero once passed; `Duration::MAX` for a deadline that never comes).
    pub(crate) fn remaining(&self) -> Duration {
        match self.0 {
            Some(t) => t.saturating_duration_since(Instant::now()),
            None => Duration::MAX,
        }
    }

    /// Whether the deadline has passed.
    pub(crate) fn passed(&self) -> bool {
        matches!(self.0, Some(t) if Instant::now() >= t)
    }
}

/// Parses a counter value (decimal ASCII, surrounding whitespace tolerated) for [`Store::add`].
pub(crate) fn parse_counter(key: &str, value: &[u8]) -> Result<i64> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .ok_or_else(|| {
            let shown = String::from_utf8_lossy(&value[..value.len().min(64)]).into_owned();
            Error::Store(format!(
                "add on key '{key}': current value '{shown}' is not a decimal integer"
            ))
        })
}

/// `current + delta` for [`Store::add`], with an overflow error naming the key.
pub(crate) fn checked_counter_add(key: &str, current: i64, delta: i64) -> Result<i64> {
    current.checked_add(delta).ok_or_else(|| {
        Error::Store(format!(
            "add on key '{key}': {current} + {delta} overflows i64"
        ))
    })
}

/// The compare-and-set decision shared by every backend: returns `(store_desired, reply)`.
pub(crate) fn compare_set_decision(
    current: Option<&[u8]>,
    expected: Option<&[u8]>,
    desired: &[u8],
) -> (bool, Vec<u8>) {
    match (current, expected) {
        (None, None) => (true, desired.to_vec()),
        (None, Some(e)) => (false, e.to_vec()),
        (Some(c), Some(e)) if c == e => (true, desired.to_vec()),
        (Some(c), _) => (false, c.to_vec()),
    }
}

/// The standard time-out message, e.g. `timed out after 30s waiting for key 'ranks/3/addr'`.
pub(crate) fn timeout_error(key: &str, timeout: Duration) -> Error {
    Error::Store(format!(
        "timed out after {timeout:?} waiting for key '{key}'"
    ))
}

/// Whether a store error message is the standard wait time-out of [`timeout_error`] (a `get`
/// whose key did not appear in time), as opposed to a store that failed or cannot be reached.
pub(crate) fn is_wait_timeout(msg: &str) -> bool {
    msg.starts_with("timed out after ") && msg.contains(" waiting for key '")
}

/// A view of another store in which every key `k` becomes `prefix/k`.
///
/// Used to give each communicator (or job) its own namespace in a shared store.
#[derive(Debug, Clone)]
pub struct PrefixStore {
    inner: Arc<dyn Store>,
    prefix: String,
}

impl PrefixStore {
    /// Wraps `inner`; keys become `prefix/key`.
    pub fn new(inner: Arc<dyn Store>, prefix: impl Into<String>) -> Self {
        PrefixStore {
            inner,
            prefix: prefix.into(),
        }
    }

    /// The prefix (without the trailing `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key), timeout)
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.inner.try_get(&self.key(key))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.key(key), expected, desired)
    }

    fn compare_set_within(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        self.inner
            .compare_set_within(&self.key(key), expected, desired, timeout)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.key(key))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&refs, timeout)
    }
}

/// Why [`MemStore::wait_get`] gave up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitError {
    /// The deadline passed.
    TimedOut,
    /// The store was closed (server shutdown).
    Closed,
}

#[derive(Debug, Default)]
struct MemState {
    map: HashMap<String, Vec<u8>>,
    closed: bool,
}

/// An in-process store: a `Mutex<HashMap>` plus a `Condvar` that blocking gets wait on.
///
/// Useful for threaded tests (one thread per rank) and as the state of a
/// [`TcpStoreServer`](super::TcpStoreServer).
#[derive(Debug, Default)]
pub struct MemStore {
    state: Mutex<MemState>,
    cond: Condvar,
}

impl MemStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of keys currently stored.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Makes every current and future blocking `get` fail at once (server shutdown).
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.cond.notify_all();
    }

    /// Waits for `key` until `timeout`; the failure says why without formatting a message.
    pub(crate) fn wait_get(
        &self,
        key: &str,
        timeout: Duration,
    ) -> std::result::Result<Vec<u8>, WaitError> {
        let deadline = Deadline::after(timeout);
        let mut st = self.lock();
        loop {
            if let Some(v) = st.map.get(key) {
                return Ok(v.clone());
            }
            if st.closed {
                return Err(WaitError::Closed);
            }
            let left = deadline.remaining();
            if left.is_zero() {
                return Err(WaitError::TimedOut);
            }
            st = if left == Duration::MAX {
                self.cond.wait(st).unwrap_or_else(|p| p.into_inner())
            } else {
                self.cond
                    .wait_timeout(st, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            };
        }
    }

    fn lock(&self) -> MutexGuard<'_, MemState> {
        // A panic while holding the lock cannot leave the map half-updated (every update is a
        // single insert/remove), so a poisoned lock is safe to keep using.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Store for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.lock().map.insert(key.to_owned(), value.to_vec());
        self.cond.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait_get(key, timeout).map_err(|e| match e {
            WaitError::TimedOut => timeout_error(key, timeout),
            WaitError::Closed => {
                Error::Store(format!("store shut down while waiting for key '{key}'"))
            }
        })
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.lock().map.get(key).cloned())
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut st = self.lock();
        let current = match st.map.get(key) {
            Some(v) => parse_counter(key, v)?,
            None => 0,
        };
        let new = checked_counter_add(key, current, delta)?;
        st.map.insert(key.to_owned(), new.to_string().into_bytes());
        drop(st);
        self.cond.notify_all();
        Ok(new)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        let mut st = self.lock();
        let (store, reply) =
            compare_set_decision(st.map.get(key).map(Vec::as_slice), expected, desired);
        if store {
            st.map.insert(key.to_owned(), desired.to_vec());
            drop(st);
            self.cond.notify_all();
        }
        Ok(reply)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.lock().map.remove(key).is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    #[test]
    fn mem_get_waits_for_set_from_other_thread() {
        let s = Arc::new(MemStore::new());
        let s2 = Arc::clone(&s);
        let t = thread::spawn(move || s2.get("k", Duration::from_secs(20)).unwrap());
        thread::sleep(Duration::from_millis(50));
        s.set("k", b"v").unwrap();
        assert_eq!(t.join().unwrap(), b"v");
    }

    #[test]
    fn mem_get_times_out_naming_key() {
        let s = MemStore::new();
        let e = s
            .get("ranks/3/addr", Duration::from_millis(30))
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("ranks/3/addr") && msg.contains("30ms"),
            "{msg}"
        );
    }

    #[test]
    fn wait_timeouts_are_told_from_failures() {
        let Error::Store(msg) = MemStore::new()
            .get("k", Duration::from_millis(1))
            .unwrap_err()
        else {
            panic!("not a store error")
        };
        assert!(is_wait_timeout(&msg), "{msg}");
        let s = MemStore::new();
        s.close();
        let Error::Store(msg) = s.get("k", Duration::from_secs(5)).unwrap_err() else {
            panic!("not a store error")
        };
        assert!(!is_wait_timeout(&msg), "{msg}");
        assert!(!is_wait_timeout(
            "get on key 'k' at store h:1: Connection refused"
        ));
    }

    #[test]
    fn mem_close_wakes_waiters() {
        let s = Arc::new(MemStore::new());
        let s2 = Arc::clone(&s);
        let t = thread::spawn(move || s2.get("k", Duration::from_secs(60)));
        thread::sleep(Duration::from_millis(30));
        s.close();
        assert!(matches!(t.join().unwrap(), Err(Error::Store(_))));
    }

    #[test]
    fn prefix_store_namespaces_keys() {
        let inner: Arc<dyn Store> = Arc::new(MemStore::new());
        let p = PrefixStore::new(Arc::clone(&inner), "job1");
        p.set("a", b"1").unwrap();
        assert_eq!(inner.try_get("job1/a").unwrap().unwrap(), b"1");
        assert_eq!(p.add("c", 2).unwrap(), 2);
        assert_eq!(inner.try_get("job1/c").unwrap().unwrap(), b"2");
        p.wait(&["a", "c"], Duration::from_secs(1)).unwrap();
        let e = p.wait(&["a", "zz"], Duration::from_millis(10)).unwrap_err();
        assert!(e.to_string().contains("job1/zz"), "{e}");
    }

    #[test]
    fn add_rejects_non_integer_and_overflow() {
        let s = MemStore::new();
        s.set("k", b"abc").unwrap();
        assert!(s.add("k", 1).unwrap_err().to_string().contains("'k'"));
        s.set("m", i64::MAX.to_string().as_bytes()).unwrap();
        assert!(s.add("m", 1).is_err());
    }

    #[test]
    fn huge_timeout_does_not_overflow() {
        let s = MemStore::new();
        s.set("k", b"v").unwrap();
        assert_eq!(s.get("k", Duration::MAX).unwrap(), b"v");
    }
}
