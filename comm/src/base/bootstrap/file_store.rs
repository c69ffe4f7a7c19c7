//! [`FileStore`]: a [`Store`] in a directory on a filesystem shared by all ranks (NFS, Lustre,
//! or a local directory for single-node jobs).
//!
//! Layout: one file per key, named `k_` + the key percent-encoded (every byte outside
//! `[A-Za-z0-9_.-]` becomes `%XX`, so `ranks/3/addr` is `k_ranks%2F3%2Faddr`), plus a `.lock`
//! file. Writes go to a hidden temporary file that is then renamed over the key file, so a
//! reader sees either the old or the new value, never a partial one. Mutations (`set`, `add`,
//! `compare_set`, `delete`) hold an exclusive lock on `.lock` (`File::try_lock`, i.e. `flock`),
//! so read-modify-write operations are atomic across threads and processes. Taking the lock
//! polls (1 ms to 20 ms apart) until the operation's timeout (`compare_set_within`) or
//! [`LOCK_TIMEOUT`], then fails naming the directory and key (a holder that never lets go,
//! e.g. a stale lock on a network filesystem, must not hang every rank). `get` polls for the key
//! file with a backoff from 5 ms to 50 ms.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::store::{
    checked_counter_add, compare_set_decision, parse_counter, timeout_error, Deadline, Store,
};
use crate::base::error::{Error, Result};

const LOCK_FILE: &str = ".lock";
const KEY_PREFIX: &str = "k_";
const POLL_MIN: Duration = Duration::from_millis(5);
const POLL_MAX: Duration = Duration::from_millis(50);
/// Longest wait for the directory lock of an operation without a timeout of its own.
pub(crate) const LOCK_TIMEOUT: Duration = Duration::from_secs(30);
const LOCK_POLL_MIN: Duration = Duration::from_millis(1);
const LOCK_POLL_MAX: Duration = Duration::from_millis(20);
/// Longest file name produced for a key (most filesystems allow 255 bytes).
const MAX_NAME: usize = 250;

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A store backed by one file per key in a (shared) directory; see the module docs.
#[derive(Debug, Clone)]
pub struct FileStore {
    dir: PathBuf,
    /// Distinguishes temp files of different hosts sharing the directory.
    host_tag: String,
}

/// Percent-encodes `key` into a file name (`k_` + encoded key).
fn encode_key(key: &str) -> Result<String> {
    let mut name = String::with_capacity(KEY_PREFIX.len() + key.len());
    name.push_str(KEY_PREFIX);
    for &b in key.as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-') {
            name.push(char::from(b));
        } else {
            name.push_str(&format!("%{b:02X}"));
        }
    }
    if name.len() > MAX_NAME {
        return Err(Error::Store(format!(
            "key '{key}' is too long for a file store (encoded name of {} bytes > {MAX_NAME})",
            name.len()
        )));
    }
    Ok(name)
}

/// Exclusive lock on the directory's `.lock` file, released when dropped (the file is closed).
struct DirLock {
    _file: File,
}

impl FileStore {
    /// Opens (creating it if needed) a file store in `dir`.
    ///
    /// # Errors
    /// [`Error::Store`] when the directory or its lock file cannot be created.
    pub fn new(dir: impl Into<PathBuf>) -> Result<FileStore> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|e| {
            Error::Store(format!(
                "file store: cannot create directory {}: {e}",
                dir.display()
            ))
        })?;
        let host = gethostname::gethostname().to_string_lossy().into_owned();
        let host_tag: String = host
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .take(64)
            .collect();
        let store = FileStore { dir, host_tag };
        drop(store.open_lock_file()?);
        Ok(store)
    }

    /// The directory holding the key files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &str) -> Result<PathBuf> {
        Ok(self.dir.join(encode_key(key)?))
    }

    fn open_lock_file(&self) -> Result<File> {
        let p = self.dir.join(LOCK_FILE);
        OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&p)
            .map_err(|e| Error::Store(format!("file store: cannot open {}: {e}", p.display())))
    }

    /// The directory lock, waiting at most [`LOCK_TIMEOUT`].
    fn lock(&self, key: &str) -> Result<DirLock> {
        self.lock_within(key, LOCK_TIMEOUT)
    }

    /// The directory lock, polling until `timeout` passes.
    fn lock_within(&self, key: &str, timeout: Duration) -> Result<DirLock> {
        let f = self.open_lock_file()?;
        let deadline = Deadline::after(timeout);
        let mut pause = LOCK_POLL_MIN;
        loop {
            match f.try_lock() {
                Ok(()) => return Ok(DirLock { _file: f }),
                Err(std::fs::TryLockError::WouldBlock) => {}
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(Error::Store(format!(
                        "file store {}: cannot lock {LOCK_FILE} for key '{key}': {e}",
                        self.dir.display()
                    )))
                }
            }
            let left = deadline.remaining();
            if left.is_zero() {
                return Err(Error::Store(format!(
                    "file store {}: could not lock {LOCK_FILE} for key '{key}' within \
                     {timeout:?}: another process holds it (a crashed holder on a network \
                     filesystem can leave a stale lock)",
                    self.dir.display()
                )));
            }
            thread::sleep(pause.min(left));
            pause = (pause * 2).min(LOCK_POLL_MAX);
        }
    }

    fn read(&self, key: &str, path: &Path) -> Result<Option<Vec<u8>>> {
        match fs::read(path) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::Store(format!(
                "file store: cannot read key '{key}' ({}): {e}",
                path.display()
            ))),
        }
    }

    /// Writes `value` to a temporary file and renames it over `path`.
    fn write_atomic(&self, key: &str, path: &Path, value: &[u8]) -> Result<()> {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let tmp = self.dir.join(format!(
            ".tmp.{}.{}.{}.{nanos}",
            self.host_tag,
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let res = (|| {
            let mut f = File::create(&tmp)?;
            f.write_all(value)?;
            drop(f);
            fs::rename(&tmp, path)
        })();
        res.map_err(|e| {
            let _ = fs::remove_file(&tmp);
            Error::Store(format!(
                "file store: cannot write key '{key}' ({}): {e}",
                path.display()
            ))
        })
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let path = self.path(key)?;
        let _l = self.lock(key)?;
        self.write_atomic(key, &path, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let path = self.path(key)?;
        let deadline = Deadline::after(timeout);
        let mut pause = POLL_MIN;
        loop {
            if let Some(v) = self.read(key, &path)? {
                return Ok(v);
            }
            let left = deadline.remaining();
            if left.is_zero() {
                return Err(timeout_error(key, timeout));
            }
            thread::sleep(pause.min(left));
            pause = (pause * 2).min(POLL_MAX);
        }
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let path = self.path(key)?;
        self.read(key, &path)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let path = self.path(key)?;
        let _l = self.lock(key)?;
        let current = match self.read(key, &path)? {
            Some(v) => parse_counter(key, &v)?,
            None => 0,
        };
        let new = checked_counter_add(key, current, delta)?;
        self.write_atomic(key, &path, new.to_string().as_bytes())?;
        Ok(new)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        self.compare_set_within(key, expected, desired, LOCK_TIMEOUT)
    }

    fn compare_set_within(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        let path = self.path(key)?;
        let _l = self.lock_within(key, timeout)?;
        let current = self.read(key, &path)?;
        let (store, reply) = compare_set_decision(current.as_deref(), expected, desired);
        if store {
            self.write_atomic(key, &path, desired)?;
        }
        Ok(reply)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let path = self.path(key)?;
        let _l = self.lock(key)?;
        match fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::Store(format!(
                "file store: cannot delete key '{key}' ({}): {e}",
                path.display()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_encoding_is_safe_and_injective() {
        assert_eq!(encode_key("ranks/3/addr").unwrap(), "k_ranks%2F3%2Faddr");
        assert_eq!(encode_key("..").unwrap(), "k_..");
        assert_eq!(encode_key("").unwrap(), "k_");
        assert_eq!(encode_key("a%b").unwrap(), "k_a%25b");
        assert_ne!(encode_key("a/b").unwrap(), encode_key("a%2Fb").unwrap());
        assert_eq!(encode_key("é").unwrap(), "k_%C3%A9");
        assert!(encode_key(&"x".repeat(300)).is_err());
    }

    #[test]
    fn basic_ops_in_temp_dir() {
        let dir = std::env::temp_dir().join(format!("oxccl-fs-unit-{}", std::process::id()));
        let s = FileStore::new(&dir).unwrap();
        s.set("a/b", b"v").unwrap();
        assert_eq!(s.get("a/b", Duration::from_secs(1)).unwrap(), b"v");
        assert_eq!(s.add("n", 3).unwrap(), 3);
        assert!(s.delete("a/b").unwrap());
        assert!(!s.delete("a/b").unwrap());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn held_lock_gives_an_error_naming_dir_and_key() {
        let dir = std::env::temp_dir().join(format!("oxccl-fs-lock-{}", std::process::id()));
        let s = FileStore::new(&dir).unwrap();
        // Another open file description of `.lock` holds it (flock locks conflict between
        // descriptions even within one process).
        let holder = s.open_lock_file().unwrap();
        holder.lock().unwrap();
        // On a thread, so that a lock that blocks for ever fails the test instead of hanging it.
        let (tx, rx) = std::sync::mpsc::channel();
        let s2 = s.clone();
        thread::spawn(move || {
            let _ = tx.send(
                s2.lock_within("some/key", Duration::from_millis(50))
                    .map(|_| ()),
            );
            let _ = tx.send(
                s2.compare_set_within("other/key", None, b"v", Duration::from_millis(50))
                    .map(|_| ()),
            );
        });
        for key in ["some/key", "other/key"] {
            let e = rx
                .recv_timeout(Duration::from_secs(20))
                .expect("taking a held lock did not give up")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(&dir.display().to_string()) && e.contains(key),
                "{e}"
            );
        }
        drop(holder);
        s.set("k", b"v").unwrap();
        let _ = fs::remove_dir_all(&dir);
    }
}
