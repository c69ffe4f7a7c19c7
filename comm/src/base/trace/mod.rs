//! Flight recorder: the last operations of a communicator on this rank, kept in memory and
//! written to a file when the communicator fails and when it is dropped, so that after a hang, a
//! crash or a slow run one can see which rank fell behind, which call differed between ranks,
//! and how long every call took. Like torch's NCCL flight recorder; `oxccl trace DIR` reads the
//! files of every rank and says what they show.
//!
//! - `OXCCL_TRACE_BUFFER` ([`crate::Config::trace_buffer`]) operations per communicator are
//!   kept, the oldest dropped first; 0 records nothing.
//! - `OXCCL_TRACE_DIR` ([`crate::Config::trace_dir`]): every communicator writes its record to
//!   `DIR/<communicator id>.r<rank>.json` ([`TraceDump::file_name`]) when it fails (the first
//!   error, after its connections are closed, so peers learn of the failure first), when a wait
//!   of one of its operations stalls (no progress for a quarter of `OXCCL_TIMEOUT`, when the
//!   stall is posted: a hang leaves its records long before it times out) and when it is
//!   dropped. [`crate::Communicator::dump_trace`] writes one at any time and
//!   [`crate::Communicator::trace`] returns the record, the operation running at that moment
//!   included.
//!
//! What is recorded: every host collective (with its sequence number, which is the same on every
//! rank, the algorithm the tuner picked and the bytes), every point-to-point operation (with the
//! per-pair message numbers of a single send or receive, and for every peer how many messages
//! this rank began to send it and to receive from it), each part of a device operation staged
//! through host memory; the wall-clock time it started, how long it took, and whether it
//! completed, failed (with the error) or is still running. Not recorded: operations that fail
//! before they run (bad arguments, a communicator broken already, a turn that never came),
//! batches whose every message goes to this rank itself, and CUDA IPC collectives, which run on
//! the GPU.
//!
//! Cost while on: a clock read and a dozen plain atomic stores at the start of every
//! operation, a clock read and three at its end; no lock, no allocation (the ring is made with
//! the communicator; a failed operation keeps its error's text). Records are atomic words under
//! a sequence lock per slot, so any thread reads them without waiting
//! (`comm/tests/comm/loom_trace_slot.rs` model-checks the protocol). Small operations between ranks that share
//! memory read the coarse clock (3 ns against 20 for the exact one). Off
//! (`OXCCL_TRACE_BUFFER=0`): one branch.
//! Writing a file happens on a helper thread, waited for at most [`WRITE_BUDGET`], so a
//! directory that hangs (a stuck network file system) never holds up a failing or closing
//! communicator for longer.

mod recorder;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::base::error::{Error, Result};

pub use recorder::PRECISE_MIN_BYTES;
pub(crate) use recorder::{Owner, Recorder, What};

/// The `format` of every dump this version writes.
pub const FORMAT: &str = "oxccl-trace/1";

/// Most records `OXCCL_TRACE_BUFFER` may ask for (104 bytes each: about 100 MiB per
/// communicator).
pub const MAX_BUFFER: usize = 1 << 20;

/// Largest communicator a dump may describe ([`TraceDump::read`] refuses larger ones; `grow`
/// and `init` refuse them too).
pub const MAX_RANKS: usize = 1 << 20;

/// Longest a failing or closing communicator waits for its record to be written.
pub const WRITE_BUDGET: Duration = Duration::from_secs(5);

/// Where an operation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TraceState {
    /// Started and not finished when the record was taken: still waiting, still moving data,
    /// or (in a file written at a failure) ended by a panic.
    Running,
    /// Finished without an error.
    Completed,
    /// Finished with an error ([`TraceRecord::error`]).
    Failed,
}

impl TraceState {
    /// `running`, `completed` or `failed`.
    pub fn name(self) -> &'static str {
        match self {
            TraceState::Running => "running",
            TraceState::Completed => "completed",
            TraceState::Failed => "failed",
        }
    }
}

/// One operation of a [`TraceDump`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Running number of the operation among those recorded on this rank of the communicator
    /// (0 for the first).
    pub id: u64,
    /// The collective's sequence number on the communicator: the same call has the same number
    /// on every rank. `None` for point-to-point operations.
    pub seq: Option<u64>,
    /// The collective's name (`all-reduce`, `broadcast`, ...), or `send`, `recv`, `send-recv`
    /// and `batch-p2p`.
    pub coll: String,
    /// The call as errors describe it, e.g. `all-reduce(count=1000, dtype=float, op=sum)` or
    /// `send(to=1 #4, count=256, dtype=float)`.
    pub op: String,
    /// Element type.
    pub dtype: String,
    /// Element count as called (see [`crate::base::op::OpDesc::count`]); for point-to-point, the
    /// elements sent, or received when nothing is sent.
    pub count: u64,
    /// Reduction, for collectives that reduce.
    pub redop: Option<String>,
    /// Root, for rooted collectives.
    pub root: Option<usize>,
    /// The algorithm the tuner picked (collectives).
    pub algo: Option<String>,
    /// Bytes of the whole operation (the full buffer of a collective, as the tuner sees it; the
    /// bytes sent and received by a point-to-point operation).
    pub bytes: u64,
    /// A single send's peer and its message number to that peer (1 for the first).
    pub send_to: Option<(usize, u64)>,
    /// A single receive's peer and its message number from that peer (1 for the first).
    pub recv_from: Option<(usize, u64)>,
    /// Wall-clock start, nanoseconds since the Unix epoch.
    pub start_unix_ns: u64,
    /// How long it took; `None` while running.
    pub duration_ns: Option<u64>,
    /// Resolution of the start and the duration: 1 where the exact clock was read (every
    /// operation of a communicator some of whose ranks talk over TCP, and those of
    /// [`PRECISE_MIN_BYTES`] = 64 KiB or more), the coarse clock's tick (1 to 10 ms, usually 4)
    /// for smaller ones between ranks that share memory, whose 20 ns clock reads would show.
    pub clock_resolution_ns: u64,
    /// Where it stands.
    pub state: TraceState,
    /// The error it failed with (this rank's view, before the communicator's first published
    /// error replaced it).
    pub error: Option<String>,
}

impl TraceRecord {
    /// What must be equal between ranks for the same sequence number: the call as
    /// [`TraceRecord::op`] describes it (collective, count, dtype, reduction, root, the counts'
    /// fingerprint of all-gather-v and reduce-scatter-v), without the count for all-to-all-v,
    /// gather-v and scatter-v, whose counts are per rank.
    pub fn signature(&self) -> String {
        if !["all-to-all-v", "gather-v", "scatter-v"].contains(&&*self.coll) {
            return self.op.clone();
        }
        let drop_count = |part: &str| !part.trim_start().starts_with("count=");
        match self.op.split_once('(') {
            Some((name, args)) => {
                let kept: Vec<&str> = args.split(',').filter(|p| drop_count(p)).collect();
                format!("{name}({}", kept.join(",").trim_start())
            }
            None => self.op.clone(),
        }
    }
}

/// The flight record of one rank of one communicator, as written to
/// `OXCCL_TRACE_DIR/<communicator id>.r<rank>.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceDump {
    /// [`FORMAT`].
    pub format: String,
    /// The communicator's id (`<job>/world1`, `<job>/world1/split0/c1`, ...).
    pub comm: String,
    /// This rank in the communicator.
    pub rank: usize,
    /// Ranks in the communicator.
    pub size: usize,
    /// The communicator every other one was split from (the world).
    pub root_comm: String,
    /// This rank in [`TraceDump::root_comm`].
    pub root_rank: usize,
    /// Node id (hostname or `OXCCL_NODE_ID`).
    pub node: String,
    /// Process id.
    pub pid: u32,
    /// Why it was written: `failed` (the communicator's first error), `stalled` (a wait without
    /// progress for a quarter of `OXCCL_TIMEOUT`), `closed` (dropped), `requested`
    /// ([`crate::Communicator::dump_trace`], [`crate::Communicator::trace`]).
    pub reason: String,
    /// The error that broke the communicator, if it is broken.
    pub error: Option<String>,
    /// Wall-clock time of the dump, nanoseconds since the Unix epoch.
    pub dumped_unix_ns: u64,
    /// Records kept at most (`OXCCL_TRACE_BUFFER`).
    pub capacity: usize,
    /// Operations recorded since the communicator was made (the records are the last
    /// `capacity` of them).
    pub recorded: u64,
    /// For every peer, how many messages this rank began to send it since the communicator was
    /// made (the number of the last one: sends and batches alike); empty when there were none
    /// to any peer.
    #[serde(default)]
    pub p2p_sent: Vec<u64>,
    /// For every peer, how many messages this rank began to receive from it (as
    /// [`TraceDump::p2p_sent`]).
    #[serde(default)]
    pub p2p_recvd: Vec<u64>,
    /// Oldest first.
    pub records: Vec<TraceRecord>,
}

/// Makes temporary file names unique within the process (several threads may write one
/// communicator's record at once: a failure, a drop, a request).
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The `dumped_unix_ns` of the dump last written to each path by this process: a write that
/// comes late (a background one behind a stuck file system) never replaces a newer record.
static WRITTEN: Mutex<BTreeMap<PathBuf, u64>> = Mutex::new(BTreeMap::new());

impl TraceDump {
    /// The file a dump of rank `rank` of communicator `comm` goes to: the id with every
    /// character other than letters, digits, `-` and `.` made `_`, then `.r<rank>.json`.
    pub fn file_name(comm: &str, rank: usize) -> String {
        let safe: String = comm
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        format!("{safe}.r{rank}.json")
    }

    /// Reads a dump written by [`crate::Communicator::dump_trace`] or `OXCCL_TRACE_DIR`.
    ///
    /// # Errors
    /// `Error::Io` naming the file when it cannot be read, is not JSON of this shape, has
    /// another `format`, or does not hold together (a rank outside the communicator, more than
    /// [`MAX_RANKS`] ranks, more records than its capacity or than it recorded, per-peer
    /// message counts for another number of ranks).
    pub fn read(path: &Path) -> Result<TraceDump> {
        let bad = |why: String| Error::Io(format!("{}: {why}", path.display()));
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let d: TraceDump =
            serde_json::from_str(&text).map_err(|e| bad(format!("not an oxccl trace: {e}")))?;
        if d.format != FORMAT {
            return Err(bad(format!(
                "format {:?}, this version reads {FORMAT:?}",
                d.format
            )));
        }
        let p2p_ok = |v: &[u64]| v.is_empty() || v.len() == d.size;
        let problem = if d.size == 0 || d.size > MAX_RANKS || d.rank >= d.size {
            Some(format!(
                "rank {} of {} ranks (at most {MAX_RANKS})",
                d.rank, d.size
            ))
        } else if d.capacity > MAX_BUFFER || d.records.len() > d.capacity {
            Some(format!(
                "{} records, capacity {} (at most {MAX_BUFFER})",
                d.records.len(),
                d.capacity
            ))
        } else if d.recorded < d.records.len() as u64 {
            Some(format!(
                "{} records, {} recorded",
                d.records.len(),
                d.recorded
            ))
        } else if !p2p_ok(&d.p2p_sent) || !p2p_ok(&d.p2p_recvd) {
            Some(format!(
                "message counts for {} and {} peers, {} ranks",
                d.p2p_sent.len(),
                d.p2p_recvd.len(),
                d.size
            ))
        } else {
            None
        };
        match problem {
            Some(why) => Err(bad(format!("not a consistent oxccl trace: {why}"))),
            None => Ok(d),
        }
    }

    /// Writes the dump to `dir` (made if missing) under [`TraceDump::file_name`], through a
    /// temporary file renamed into place, so a reader never sees half a file and a later dump
    /// replaces an earlier one whole. Returns the path. Writes of this process to one path
    /// happen one at a time, and one older than the last written there (by
    /// [`TraceDump::dumped_unix_ns`]) is skipped.
    ///
    /// # Errors
    /// `Error::Io` naming the rank and the path (the temporary file is removed).
    pub fn write_to(&self, dir: &Path) -> Result<PathBuf> {
        let io = |what: &str, p: &Path, e: &dyn std::fmt::Display| {
            Error::Io(format!(
                "rank {}: writing the flight record: {what} {}: {e}",
                self.rank,
                p.display()
            ))
        };
        std::fs::create_dir_all(dir).map_err(|e| io("creating", dir, &e))?;
        let name = Self::file_name(&self.comm, self.rank);
        let path = dir.join(&name);
        let mut written = WRITTEN.lock().unwrap_or_else(|p| p.into_inner());
        if written.get(&path).is_some_and(|&t| t > self.dumped_unix_ns) {
            return Ok(path);
        }
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.{}-{n}.tmp", std::process::id()));
        let done = std::fs::File::create(&tmp)
            .map_err(|e| io("creating", &tmp, &e))
            .and_then(|f| {
                let mut w = std::io::BufWriter::new(f);
                serde_json::to_writer(&mut w, self).map_err(|e| io("writing", &tmp, &e))?;
                w.flush().map_err(|e| io("writing", &tmp, &e))
            })
            .and_then(|()| std::fs::rename(&tmp, &path).map_err(|e| io("renaming", &tmp, &e)));
        match done {
            Ok(()) => {
                written.insert(path.clone(), self.dumped_unix_ns);
                Ok(path)
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }
}

/// Writes `dump` to `dir` on a helper thread and waits at most `budget` for it (a directory on
/// a hung file system must not hold up a failing communicator for longer; zero: not at all);
/// the write goes on in the background after that. Logs the outcome, never fails.
pub(crate) fn write_bounded(dump: TraceDump, dir: PathBuf, budget: Duration) {
    let rank = dump.rank;
    let (tx, rx) = crossbeam_channel::bounded(1);
    let job = move || {
        match dump.write_to(&dir) {
            Ok(path) => tracing::info!(
                rank,
                path = %path.display(),
                reason = dump.reason,
                "flight record written"
            ),
            Err(e) => tracing::warn!(rank, "could not write the flight record: {e}"),
        }
        let _ = tx.send(());
    };
    match std::thread::Builder::new()
        .name(format!("oxccl-trace-r{rank}"))
        .spawn(job)
    {
        Ok(_) if budget.is_zero() => {}
        Ok(_) => {
            if rx.recv_timeout(budget).is_err() {
                tracing::warn!(
                    rank,
                    "the flight record was not written within {budget:?}; leaving it to a \
                     background thread"
                );
            }
        }
        Err(e) => tracing::warn!(
            rank,
            "could not start a thread to write the flight record: {e}"
        ),
    }
}

#[cfg(test)]
mod tests;
