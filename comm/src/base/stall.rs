//! Stall reports: what every rank of a hung communicator is waiting for, in the `Timeout` error.
//!
//! A rank whose wait in an operation has made no progress for a quarter of its time-out posts
//! what it waits for in the store, under `<root id>/stall/<root rank>` (the rank in the
//! communicator every other one was split from: one key per rank of the job, holding one record
//! per communicator of it that is stalled, updated with compare-and-set). A rank whose wait times
//! out reads the keys of its communicator's ranks and adds them to its `Timeout`, which every
//! rank then reports (the first published error wins):
//! - the ranks waiting in the same operation;
//! - those waiting somewhere else: an earlier operation, point-to-point, or an operation of
//!   another communicator (two communicators waiting on each other in opposite orders);
//! - those that posted nothing: not stalled in an operation of any communicator, so busy in their
//!   own code, stuck before the call, or waiting where nothing is posted (creating a
//!   communicator, behind operations queued on the same communicator, on the device). Usually
//!   the culprit.
//!
//! Like torch's desync debugging, but always on and free while operations make progress: nothing
//! is written until a wait stalls. Posts are written by a helper thread, so a store that cannot be
//! reached never holds up a wait; reading the report adds at most 3 s to a time-out (none when
//! another rank's error is published already: that error wins anyway).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::Sender;

use crate::base::bootstrap::Store;

/// Most ranks listed one by one in a report (the rest are counted).
const LIST_MAX: usize = 8;

/// How long past its poster's time-out an entry is still believed.
const STALE_SLACK_MS: u64 = 5_000;

/// Longest a timed-out rank waits for the store to hand over the other ranks' entries.
pub(crate) const READ_BUDGET_MAX: Duration = Duration::from_secs(3);

/// Separates the records of one key (one per stalled communicator of a rank).
const RECORD_SEP: char = '\x1e';

/// Most compare-and-set rounds of one post or clear (other communicators of the rank may be
/// updating the key at the same moment).
const CAS_ROUNDS: usize = 16;

/// Where a communicator's ranks post their stalls, and this rank's post.
pub(crate) struct Stalls {
    store: Arc<dyn Store>,
    /// Id of the communicator the others were split from.
    root_id: String,
    comm_id: String,
    rank: usize,
    size: usize,
    /// The root rank of every rank of this communicator.
    root_ranks: Vec<usize>,
    /// How long a wait goes without progress before it is posted.
    pub after: Duration,
    timeout: Duration,
    /// Whether this rank posted during the running operation (checked after every operation).
    posted: AtomicBool,
    /// The posted entry, to take it back.
    entry: Mutex<Option<Entry>>,
    /// Where a communicator's first error is published (see `crate::engine`).
    error_key: String,
    /// The helper thread that writes posts, started by the first one.
    writer: Mutex<Option<Sender<Write>>>,
}

enum Write {
    /// Put this communicator's record into the key (replacing an older one of it).
    Post(String, Entry),
    /// Take this record out of the key (the other communicators' records stay).
    Clear(String, Entry),
}

/// Every record of a key's value (empty or unreadable records are skipped).
fn records(value: Option<&[u8]>) -> Vec<Entry> {
    let Some(v) = value.and_then(|v| std::str::from_utf8(v).ok()) else {
        return Vec::new();
    };
    v.split(RECORD_SEP)
        .filter_map(|r| Entry::decode(r.as_bytes()))
        .collect()
}

/// Rewrites the records under `key` with `change`, by compare-and-set (records of other
/// communicators of this rank may be written meanwhile).
fn update(store: &dyn Store, key: &str, change: impl Fn(&mut Vec<Entry>)) -> crate::Result<()> {
    for _ in 0..CAS_ROUNDS {
        let cur = store.try_get(key)?;
        let mut recs = records(cur.as_deref());
        change(&mut recs);
        let desired: Vec<u8> = recs
            .iter()
            .map(|e| String::from_utf8_lossy(&e.encode()).into_owned())
            .collect::<Vec<_>>()
            .join(&RECORD_SEP.to_string())
            .into_bytes();
        if cur.is_none() && desired.is_empty() {
            return Ok(());
        }
        if store.compare_set(key, cur.as_deref(), &desired)? == desired {
            return Ok(());
        }
    }
    Err(crate::Error::Store(format!(
        "{key}: still changing after {CAS_ROUNDS} compare-and-set rounds"
    )))
}

/// One rank's post.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    comm: String,
    rank: usize,
    size: usize,
    /// The operation, e.g. `all-reduce(count=4, dtype=f32, op=sum)`.
    op: String,
    /// Collective sequence number (`None`: point-to-point).
    seq: Option<u64>,
    /// When the wait began (ms since the Unix epoch).
    since_ms: u64,
    /// The poster's time-out (ms): no wait lasts longer, so an older entry is stale (left by an
    /// operation that failed).
    timeout_ms: u64,
    waiting: String,
}

impl Entry {
    fn encode(&self) -> Vec<u8> {
        let one_line = |s: &str| s.replace(['\n', RECORD_SEP], " ");
        format!(
            "{}\n{}\n{}\n{}\n{}\n{}\n{}\n{}",
            one_line(&self.comm),
            self.rank,
            self.size,
            one_line(&self.op),
            self.seq.map_or("-".to_string(), |s| s.to_string()),
            self.since_ms,
            self.timeout_ms,
            one_line(&self.waiting)
        )
        .into_bytes()
    }

    fn decode(b: &[u8]) -> Option<Entry> {
        let s = std::str::from_utf8(b).ok()?;
        let f: Vec<&str> = s.splitn(8, '\n').collect();
        if f.len() != 8 {
            return None;
        }
        Some(Entry {
            comm: f[0].to_string(),
            rank: f[1].parse().ok()?,
            size: f[2].parse().ok()?,
            op: f[3].to_string(),
            seq: match f[4] {
                "-" => None,
                s => Some(s.parse().ok()?),
            },
            since_ms: f[5].parse().ok()?,
            timeout_ms: f[6].parse().ok()?,
            waiting: f[7].to_string(),
        })
    }

    /// Whether the wait has ended for sure at `now_ms` (its time-out passed, with slack for
    /// clocks and the report itself).
    fn stale(&self, now_ms: u64) -> bool {
        now_ms
            > self
                .since_ms
                .saturating_add(self.timeout_ms)
                .saturating_add(STALE_SLACK_MS)
    }

    /// The operation and where it runs, from the point of view of communicator `comm`.
    fn place(&self, comm: &str) -> String {
        let seq = self.seq.map_or(String::new(), |s| format!(" #{s}"));
        if self.comm == comm {
            format!("{}{seq}", self.op)
        } else {
            format!(
                "{}{seq} of communicator {} (as its rank {} of {})",
                self.op, self.comm, self.rank, self.size
            )
        }
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `1-3, 5, 7-8`: the cpulist format of [`crate::base::affinity::encode_cpus`], spaced for a message.
fn ranges(ranks: &[usize]) -> String {
    crate::base::affinity::encode_cpus(ranks).replace(',', ", ")
}

fn plural(n: usize, one: &str, many: &str) -> String {
    if n == 1 {
        one.to_string()
    } else {
        many.to_string()
    }
}

impl Stalls {
    /// The stalls of a communicator that is its own root (made by `init`); see
    /// [`Stalls::set_root`] for one split from another.
    pub(crate) fn new(
        store: Arc<dyn Store>,
        comm_id: &str,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Stalls {
        Stalls {
            store,
            root_id: comm_id.to_string(),
            comm_id: comm_id.to_string(),
            rank,
            size,
            root_ranks: (0..size).collect(),
            after: timeout / 4,
            timeout,
            posted: AtomicBool::new(false),
            entry: Mutex::new(None),
            error_key: format!("{comm_id}/error"),
            writer: Mutex::new(None),
        }
    }

    /// For a communicator split from another: the root's id and the root rank of each of its
    /// ranks (from the parent's [`Stalls::lineage`]).
    pub(crate) fn set_root(&mut self, root_id: String, root_ranks: Vec<usize>) {
        self.root_id = root_id;
        self.root_ranks = root_ranks;
    }

    /// The root's id and the root rank of every rank of this communicator.
    pub(crate) fn root(&self) -> (&str, &[usize]) {
        (&self.root_id, &self.root_ranks)
    }

    /// Looks for the communicator's first error under `key` (a channel: its parent's, where it
    /// publishes, `crate::engine::channels`).
    pub(crate) fn set_error_key(&mut self, key: String) {
        self.error_key = key;
    }

    /// The root id and root ranks of a communicator split from this one with `members` (ranks
    /// of this one).
    pub(crate) fn lineage(&self, members: &[usize]) -> (String, Vec<usize>) {
        let ranks = members
            .iter()
            .map(|&m| self.root_ranks.get(m).copied().unwrap_or(m))
            .collect();
        (self.root_id.clone(), ranks)
    }

    fn key(&self, rank: usize) -> String {
        let root = self.root_ranks.get(rank).copied().unwrap_or(rank);
        format!("{}/stall/{root}", self.root_id)
    }

    fn send(&self, w: Write) {
        let mut writer = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        if writer.is_none() {
            let (tx, rx) = crossbeam_channel::unbounded::<Write>();
            let store = Arc::clone(&self.store);
            let spawned = std::thread::Builder::new()
                .name(format!("oxccl-stall-r{}", self.rank))
                .spawn(move || {
                    for w in rx {
                        let r = match &w {
                            Write::Post(k, e) => update(&*store, k, |recs| {
                                recs.retain(|r| r.comm != e.comm);
                                recs.push(e.clone());
                            }),
                            Write::Clear(k, e) => {
                                update(&*store, k, |recs| recs.retain(|r| r != e))
                            }
                        };
                        if let Err(e) = r {
                            tracing::debug!("stall report not written: {e}");
                        }
                    }
                });
            match spawned {
                Ok(_) => *writer = Some(tx),
                Err(e) => {
                    tracing::debug!("no stall-report thread: {e}");
                    return;
                }
            }
        }
        if let Some(tx) = writer.as_ref() {
            let _ = tx.send(w);
        }
    }

    /// Whether this rank posted during the running operation.
    pub(crate) fn posted(&self) -> bool {
        self.posted.load(Ordering::Relaxed)
    }

    /// Posts that this rank has waited in `op` (collective number `seq`) for `waited`, on
    /// `waiting`. Once per operation.
    pub(crate) fn post(&self, op: String, seq: Option<u64>, waited: Duration, waiting: String) {
        if self.posted.swap(true, Ordering::Relaxed) {
            return;
        }
        let e = Entry {
            comm: self.comm_id.clone(),
            rank: self.rank,
            size: self.size,
            op,
            seq,
            since_ms: unix_ms(SystemTime::now() - waited),
            timeout_ms: u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX),
            waiting,
        };
        tracing::info!(rank = self.rank, after = ?waited, "wait stalled; posting a stall report");
        *self.entry.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
        self.send(Write::Post(self.key(self.rank), e));
    }

    /// Takes this rank's post back once its operation succeeded (one atomic load when it
    /// posted nothing). A failed operation leaves it: ranks timing out at about the same moment
    /// still read where this one was stuck, and it goes stale once its time-out has passed.
    #[inline]
    pub(crate) fn operation_ended(&self, ok: bool) {
        if self.posted.load(Ordering::Relaxed) {
            self.clear_posted(ok);
        }
    }

    /// [`Stalls::operation_ended`] after a stall was posted.
    #[cold]
    fn clear_posted(&self, ok: bool) {
        self.posted.store(false, Ordering::Relaxed);
        let e = self.entry.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let (Some(e), true) = (e, ok) {
            self.send(Write::Clear(self.key(self.rank), e));
        }
    }

    /// The report a timed-out rank adds to its error: what every other rank of the communicator
    /// posted, read within a few seconds. `op` and `seq`: this rank's operation. `None` when
    /// another rank's error is published already (it is the one every rank reports).
    pub(crate) fn report(&self, op: &str, seq: Option<u64>) -> Option<String> {
        let keys: Vec<String> = (0..self.size)
            .filter(|&r| r != self.rank)
            .map(|r| self.key(r))
            .collect();
        let budget = self
            .after
            .clamp(Duration::from_millis(200), READ_BUDGET_MAX);
        let (tx, rx) = crossbeam_channel::bounded(1);
        let store = Arc::clone(&self.store);
        let error_key = self.error_key.clone();
        let read = std::thread::Builder::new()
            .name(format!("oxccl-stall-read-r{}", self.rank))
            .spawn(move || {
                let deadline = Instant::now() + budget;
                if let Ok(Some(_)) = store.try_get(&error_key) {
                    let _ = tx.send(None);
                    return;
                }
                let mut got = Vec::with_capacity(keys.len());
                for k in &keys {
                    if Instant::now() >= deadline {
                        break;
                    }
                    got.push(store.try_get(k).ok().flatten());
                }
                let _ = tx.send(Some(got));
            });
        let got = match read.ok().and(rx.recv_timeout(budget).ok()) {
            Some(Some(g)) => g,
            Some(None) => return None,
            None => {
                return Some(format!(
                    "stall reports: the store did not answer within {budget:?}, so what the \
                     other ranks wait for is unknown"
                ))
            }
        };
        let others: Vec<usize> = (0..self.size).filter(|&r| r != self.rank).collect();
        let entries: Vec<(usize, Vec<Entry>)> = others
            .iter()
            .enumerate()
            .map(|(i, &r)| (r, records(got.get(i).and_then(|v| v.as_deref()))))
            .collect();
        Some(self.summarize(
            op,
            seq,
            &entries,
            got.len() < others.len(),
            unix_ms(SystemTime::now()),
        ))
    }

    /// The report from the records read for each other rank (none: nothing posted); `cut`: the
    /// read stopped early.
    fn summarize(
        &self,
        op: &str,
        seq: Option<u64>,
        entries: &[(usize, Vec<Entry>)],
        cut: bool,
        now_ms: u64,
    ) -> String {
        let (mut same, mut silent, mut elsewhere) = (Vec::new(), Vec::new(), Vec::new());
        for (r, recs) in entries {
            let live: Vec<&Entry> = recs.iter().filter(|e| !e.stale(now_ms)).collect();
            if live
                .iter()
                .any(|e| e.comm == self.comm_id && e.seq == seq && e.op == op)
            {
                same.push(*r);
            } else if live.is_empty() {
                silent.push(*r);
            } else {
                elsewhere.extend(live.into_iter().map(|e| (*r, e)));
            }
        }
        let mut parts = Vec::new();
        if !same.is_empty() {
            parts.push(format!(
                "{} {} {} in this {op} too",
                plural(same.len(), "rank", "ranks"),
                ranges(&same),
                plural(same.len(), "waits", "wait")
            ));
        }
        for (r, e) in elsewhere.iter().take(LIST_MAX) {
            let secs = now_ms.saturating_sub(e.since_ms) as f64 / 1000.0;
            parts.push(format!(
                "rank {r} waits in {} ({}) for {secs:.1} s",
                e.place(&self.comm_id),
                e.waiting
            ));
        }
        if elsewhere.len() > LIST_MAX {
            parts.push(format!(
                "{} more ranks wait elsewhere",
                elsewhere.len() - LIST_MAX
            ));
        }
        if !silent.is_empty() {
            parts.push(format!(
                "{} {} posted no stall (not stalled in an operation of any communicator for \
                 {:.1} s or more: busy outside oxccl, not yet at this call, or waiting where \
                 nothing is posted)",
                plural(silent.len(), "rank", "ranks"),
                ranges(&silent),
                self.after.as_secs_f64()
            ));
        }
        if cut {
            parts.push("the store stopped answering before every rank was read".into());
        }
        format!("stall reports: {}", parts.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::bootstrap::MemStore;

    fn entry(comm: &str, op: &str, seq: Option<u64>, since_ms: u64) -> Entry {
        Entry {
            comm: comm.into(),
            rank: 1,
            size: 2,
            op: op.into(),
            seq,
            since_ms,
            timeout_ms: 8000,
            waiting: "receiving from rank 0: 0/64 bytes".into(),
        }
    }

    #[test]
    fn entries_survive_the_store() {
        for e in [
            entry("job/split0/c1", "barrier()", Some(7), 123),
            entry("job", "send-recv", None, 0),
        ] {
            assert_eq!(Entry::decode(&e.encode()), Some(e));
        }
        assert_eq!(Entry::decode(b"garbage"), None);
        assert_eq!(Entry::decode(b""), None);
    }

    #[test]
    fn rank_lists_are_ranges() {
        assert_eq!(ranges(&[1, 2, 3, 5, 7, 8]), "1-3, 5, 7-8");
        assert_eq!(ranges(&[4]), "4");
        assert_eq!(ranges(&[]), "");
    }

    #[test]
    fn a_report_sorts_ranks_by_where_they_wait() {
        let s = Stalls::new(
            Arc::new(MemStore::new()),
            "job",
            0,
            6,
            Duration::from_secs(8),
        );
        let op = "all-reduce(count=4, dtype=f32, op=sum)";
        let stale = 20_000 - 8000 - STALE_SLACK_MS - 1;
        let entries = vec![
            (1, vec![entry("job", op, Some(3), 17_000)]),
            // Stalled in this operation and in another communicator (another thread).
            (
                2,
                vec![
                    entry("job/split0/c1", "barrier()", Some(0), 18_500),
                    entry("job", op, Some(3), 17_000),
                ],
            ),
            (3, vec![]),
            (
                4,
                vec![entry("job/split0/c1", "barrier()", Some(0), 18_500)],
            ),
            (5, vec![entry("job", op, Some(1), stale)]),
        ];
        let text = s.summarize(op, Some(3), &entries, false, 20_000);
        assert_eq!(
            text,
            "stall reports: ranks 1-2 wait in this all-reduce(count=4, dtype=f32, op=sum) too; \
             rank 4 waits in barrier() #0 of communicator job/split0/c1 (as its rank 1 of 2) \
             (receiving from rank 0: 0/64 bytes) for 1.5 s; ranks 3, 5 posted no stall (not \
             stalled in an operation of any communicator for 2.0 s or more: busy outside oxccl, \
             not yet at this call, or waiting where nothing is posted)"
        );
    }

    /// Waits until `key` holds exactly the records of the given communicators.
    fn wait_for_records(store: &MemStore, key: &str, comms: &[&str]) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let got: Vec<String> = records(store.try_get(key).unwrap().as_deref())
                .into_iter()
                .map(|e| e.comm)
                .collect();
            if got == comms {
                return;
            }
            assert!(Instant::now() < deadline, "{key}: {got:?}, want {comms:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn posts_are_written_and_taken_back() {
        let store = Arc::new(MemStore::new());
        let mut s = Stalls::new(store.clone(), "job/split0/c0", 1, 2, Duration::from_secs(4));
        s.set_root("job".into(), vec![3, 5]);
        s.post(
            "barrier()".into(),
            Some(2),
            Duration::from_secs(1),
            "x".into(),
        );
        assert!(s.posted());
        wait_for_records(&store, "job/stall/5", &["job/split0/c0"]);
        let e = records(store.try_get("job/stall/5").unwrap().as_deref()).remove(0);
        assert_eq!((e.rank, e.seq, e.waiting.as_str()), (1, Some(2), "x"));
        s.operation_ended(true);
        assert!(!s.posted());
        wait_for_records(&store, "job/stall/5", &[]);
        assert_eq!(s.lineage(&[1]), ("job".to_string(), vec![5]));
    }

    /// Two communicators of one rank stalled at once keep a record each, whatever order their
    /// writes land in; each takes back only its own.
    #[test]
    fn communicators_of_one_rank_keep_their_own_records() {
        let store = Arc::new(MemStore::new());
        let a = Stalls::new(store.clone(), "job", 0, 2, Duration::from_secs(4));
        let mut b = Stalls::new(store.clone(), "job/split0/c0", 0, 2, Duration::from_secs(4));
        b.set_root("job".into(), vec![0, 1]);
        a.post(
            "barrier()".into(),
            Some(0),
            Duration::from_secs(1),
            "a".into(),
        );
        b.post(
            "barrier()".into(),
            Some(0),
            Duration::from_secs(1),
            "b".into(),
        );
        let key = "job/stall/0";
        let deadline = Instant::now() + Duration::from_secs(5);
        while records(store.try_get(key).unwrap().as_deref()).len() < 2 {
            assert!(Instant::now() < deadline, "both records must land");
            std::thread::sleep(Duration::from_millis(5));
        }
        a.operation_ended(true);
        wait_for_records(&store, key, &["job/split0/c0"]);
        b.operation_ended(false);
        // A failed operation leaves its record (stale once its time-out has passed).
        std::thread::sleep(Duration::from_millis(50));
        wait_for_records(&store, key, &["job/split0/c0"]);
    }
}
