//! The process's registered user buffers: host memory that a transport may read straight from
//! (RDMA writes from it instead of from a slot), and each backend's cache of its own
//! registrations of them.
//!
//! - [`Registry`]: the ranges [`crate::Registered`] buffers hold, one process-wide table (the
//!   ranges outlive no buffer: a `Registered` owns its memory and removes its entry on drop);
//! - [`RegCache`]: what a backend made for an entry (an RDMA memory region), made at the entry's
//!   first use, shared by the backend's connections, and dropped at its first use after the
//!   entry is gone (or with the cache).
//!
//! A backend never registers memory the user did not: a cached registration of freed memory
//! would keep reading the pages the range had when it was made, not what lives there now.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use crate::base::error::Result;

/// One registered range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    /// Never reused: a range registered again after its buffer was freed is a new entry.
    pub id: u64,
    /// The first byte's address.
    pub start: usize,
    /// Bytes.
    pub len: usize,
    /// The descriptor of the shared file the range is mapped from, starting at `start`
    /// ([`crate::Registered`] memory: peers on the node map it and write straight into it),
    /// or `None` for private memory.
    pub fd: Option<i32>,
}

impl Entry {
    /// Whether `len` bytes at `addr` lie inside the range.
    pub(crate) fn holds(&self, addr: usize, len: usize) -> bool {
        addr >= self.start && addr.saturating_add(len) <= self.start + self.len
    }
}

/// Registered ranges by their first byte (they never overlap).
#[derive(Default)]
pub(crate) struct Registry {
    ranges: RwLock<BTreeMap<usize, Entry>>,
    next_id: AtomicU64,
    /// Bumped at every removal: caches prune when it moved.
    removals: AtomicU64,
}

impl Registry {
    /// The process's table.
    pub(crate) fn global() -> &'static Registry {
        static GLOBAL: OnceLock<Registry> = OnceLock::new();
        GLOBAL.get_or_init(Registry::default)
    }

    /// Adds `len` bytes at `start` (mapped from the start of shared file `fd`, if any); its
    /// entry, or `None` for an empty range.
    ///
    /// # Errors
    /// The range overlaps one registered already (the message names both).
    pub(crate) fn add(
        &self,
        start: usize,
        len: usize,
        fd: Option<i32>,
    ) -> std::result::Result<Option<Entry>, String> {
        if len == 0 {
            return Ok(None);
        }
        let mut ranges = self.ranges.write().unwrap_or_else(|p| p.into_inner());
        let end = start.saturating_add(len);
        if let Some(e) = ranges
            .range(..end)
            .next_back()
            .map(|(_, e)| *e)
            .filter(|e| e.start + e.len > start)
        {
            return Err(format!(
                "{len} bytes at {start:#x} overlap the {} bytes at {:#x} registered already",
                e.len, e.start
            ));
        }
        let e = Entry {
            id: self.next_id.fetch_add(1, Ordering::Relaxed) + 1,
            start,
            len,
            fd,
        };
        ranges.insert(start, e);
        Ok(Some(e))
    }

    /// Removes entry `e` (nothing if it is gone already).
    pub(crate) fn remove(&self, e: &Entry) {
        let mut ranges = self.ranges.write().unwrap_or_else(|p| p.into_inner());
        if ranges.get(&e.start).is_some_and(|x| x.id == e.id) {
            ranges.remove(&e.start);
            self.removals.fetch_add(1, Ordering::Release);
        }
    }

    /// The entry holding all `len` bytes at `addr`, if one does.
    pub(crate) fn find(&self, addr: usize, len: usize) -> Option<Entry> {
        let ranges = self.ranges.read().unwrap_or_else(|p| p.into_inner());
        ranges
            .range(..=addr)
            .next_back()
            .map(|(_, e)| *e)
            .filter(|e| e.holds(addr, len))
    }

    /// Runs `f` on the entry holding all `len` bytes at `addr`, if one does, with the table
    /// locked: the entry's buffer cannot go meanwhile (a [`crate::Registered`] removes its entry
    /// before its memory is freed). The in-process RDMA provider writes into offered buffers so.
    pub(crate) fn with_entry<T>(
        &self,
        addr: usize,
        len: usize,
        f: impl FnOnce(&Entry) -> T,
    ) -> Option<T> {
        let ranges = self.ranges.read().unwrap_or_else(|p| p.into_inner());
        let e = ranges
            .range(..=addr)
            .next_back()
            .map(|(_, e)| e)
            .filter(|e| e.holds(addr, len))?;
        Some(f(e))
    }

    fn live(&self, id: u64, start: usize) -> bool {
        let ranges = self.ranges.read().unwrap_or_else(|p| p.into_inner());
        ranges.get(&start).is_some_and(|e| e.id == id)
    }
}

struct Cached<R> {
    map: HashMap<u64, (usize, Arc<R>)>,
    /// The registry's removal count when the map was last pruned.
    seen: u64,
    made: u64,
}

/// A backend's registrations of [`Registry`] entries (see the module docs).
pub(crate) struct RegCache<R> {
    registry: &'static Registry,
    inner: Mutex<Cached<R>>,
}

impl<R> RegCache<R> {
    /// An empty cache of `registry`'s entries.
    pub(crate) fn new(registry: &'static Registry) -> RegCache<R> {
        RegCache {
            registry,
            inner: Mutex::new(Cached {
                map: HashMap::new(),
                seen: 0,
                made: 0,
            }),
        }
    }

    /// The registration of `e`, made by `make` at its first use. Registrations of entries
    /// removed since the last call are dropped first (in-flight requests hold their own `Arc`).
    ///
    /// # Errors
    /// `make`'s.
    pub(crate) fn get(&self, e: &Entry, make: impl FnOnce(&Entry) -> Result<R>) -> Result<Arc<R>> {
        let mut c = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let removals = self.registry.removals.load(Ordering::Acquire);
        if removals != c.seen {
            c.seen = removals;
            let reg = self.registry;
            c.map.retain(|&id, (start, _)| reg.live(id, *start));
        }
        if let Some((_, r)) = c.map.get(&e.id) {
            return Ok(Arc::clone(r));
        }
        let r = Arc::new(make(e)?);
        c.made += 1;
        c.map.insert(e.id, (e.start, Arc::clone(&r)));
        Ok(r)
    }

    /// Registrations made so far, and how many are held now.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn counts(&self) -> (u64, usize) {
        let c = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        (c.made, c.map.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaked() -> &'static Registry {
        Box::leak(Box::default())
    }

    #[test]
    fn ranges_are_found_by_containment_and_never_overlap() {
        let r = leaked();
        let a = r.add(0x1000, 0x100, None).unwrap().unwrap();
        let b = r.add(0x2000, 0x1000, None).unwrap().unwrap();
        assert_ne!(a.id, b.id);
        assert_eq!(r.add(0x5000, 0, None).unwrap(), None);
        assert_eq!(r.find(0x1000, 0x100), Some(a));
        assert_eq!(r.find(0x1080, 0x80), Some(a));
        assert_eq!(r.find(0x1080, 0x81), None, "runs past the end");
        assert_eq!(r.find(0xfff, 2), None, "starts before");
        assert_eq!(r.find(0x2800, 0x10), Some(b));
        assert_eq!(r.find(0x1800, 0x10), None, "between ranges");
        for (s, l) in [(0x10ff, 1), (0xf00, 0x101), (0x1f00, 0x2000), (0x2fff, 5)] {
            let e = r.add(s, l, None).unwrap_err();
            assert!(e.contains("overlap"), "{e}");
        }
        r.add(0x1100, 0xf00, None).unwrap().unwrap(); // touching both neighbours is fine
        r.remove(&a);
        assert_eq!(r.find(0x1000, 1), None);
        let a2 = r.add(0x1000, 0x100, None).unwrap().unwrap();
        assert!(a2.id > b.id, "ids are never reused");
        r.remove(&a); // gone already: the new entry stays
        assert_eq!(r.find(0x1000, 1), Some(a2));
    }

    #[test]
    fn a_cache_registers_each_entry_once_and_forgets_removed_ones() {
        let r = leaked();
        let cache: RegCache<(usize, usize)> = RegCache::new(r);
        let make = |e: &Entry| Ok((e.start, e.len));
        let a = r.add(0x1000, 0x100, None).unwrap().unwrap();
        let b = r.add(0x4000, 0x100, None).unwrap().unwrap();
        let ra = cache.get(&a, make).unwrap();
        assert_eq!(*ra, (0x1000, 0x100));
        assert!(Arc::ptr_eq(&ra, &cache.get(&a, make).unwrap()));
        cache.get(&b, make).unwrap();
        assert_eq!(cache.counts(), (2, 2));
        // The buffer goes and another takes its address: a new registration, not the old one.
        r.remove(&a);
        let a2 = r.add(0x1000, 0x80, None).unwrap().unwrap();
        let ra2 = cache.get(&a2, make).unwrap();
        assert_eq!(*ra2, (0x1000, 0x80));
        assert_eq!(cache.counts(), (3, 2), "a's registration was dropped");
        assert_eq!(Arc::strong_count(&ra), 1, "only the caller holds a's now");
        let failed = cache.get(&b, |_| unreachable!("cached")).unwrap();
        assert_eq!(*failed, (0x4000, 0x100));
        let c = r.add(0x9000, 8, None).unwrap().unwrap();
        let e = cache
            .get(&c, |_| Err(crate::Error::Config("no".into())))
            .unwrap_err();
        assert!(e.to_string().contains("no"));
        assert_eq!(
            cache.counts(),
            (3, 2),
            "a failed registration is not cached"
        );
    }
}
