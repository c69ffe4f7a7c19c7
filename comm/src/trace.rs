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
//!   error, after its connections are closed, so peers learn of the failure first) and when it
//!   is dropped. [`crate::Communicator::dump_trace`] writes one at any time and
//!   [`crate::Communicator::trace`] returns the record.
//!
//! What is recorded: every host collective (with its sequence number, which is the same on every
//! rank, the algorithm the tuner picked and the bytes), every point-to-point operation (with the
//! per-pair message numbers of a single send or receive), each part of a device operation staged
//! through host memory; the wall-clock time it started, how long it took, and whether it
//! completed, failed (with the error) or is still running. Operations that fail before they run
//! (bad arguments, a communicator broken already) and CUDA IPC collectives, which run on the GPU,
//! are not recorded.
//!
//! Cost while on: two clock reads and two uncontended lock round trips per operation, no
//! allocation (the records are written in place into a ring allocated as it fills). Off
//! (`OXCCL_TRACE_BUFFER=0`): one branch.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use oxccl_kernels::DType;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::op::{Collective, OpDesc};
use crate::tuning::Algorithm;

/// The `format` of every dump this version writes.
pub const FORMAT: &str = "oxccl-trace/1";

/// Most records `OXCCL_TRACE_BUFFER` may ask for (144 bytes each: about 150 MiB per communicator).
pub const MAX_BUFFER: usize = 1 << 20;

/// Where an operation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TraceState {
    /// Started and not finished when the record was taken (still waiting, or the dump was
    /// written while it ran).
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
    /// Element count as called (see [`OpDesc::count`]); for point-to-point, the elements sent
    /// or received (a send-recv: sent).
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
    /// Resolution of the start and the duration: 1 where the precise clock was read (every
    /// operation of a communicator some of whose ranks talk over TCP, and those of
    /// `PRECISE_MIN_BYTES` = 64 KiB or more), the coarse clock's tick (1 to 10 ms, usually 4)
    /// for smaller ones between ranks that share memory, whose 20 ns clock reads would show.
    pub clock_resolution_ns: u64,
    /// Where it stands.
    pub state: TraceState,
    /// The error it failed with (this rank's view, before the communicator's first published
    /// error replaced it).
    pub error: Option<String>,
}

impl TraceRecord {
    /// What must be equal between ranks for the same sequence number: the collective, dtype,
    /// reduction and root, and the count where every rank passes the same one (not for
    /// all-to-all-v, gather-v and scatter-v, whose counts are per rank).
    pub fn signature(&self) -> String {
        let per_rank_counts = ["all-to-all-v", "gather-v", "scatter-v"].contains(&&*self.coll);
        let mut s = format!("{} dtype={}", self.coll, self.dtype);
        if !per_rank_counts {
            s += &format!(" count={}", self.count);
        }
        if let Some(op) = &self.redop {
            s += &format!(" op={op}");
        }
        if let Some(r) = self.root {
            s += &format!(" root={r}");
        }
        s
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
    /// The communicator every other one was split from (the world), and this rank in it.
    pub root_comm: String,
    /// This rank in [`TraceDump::root_comm`].
    pub root_rank: usize,
    /// Node id (hostname or `OXCCL_NODE_ID`).
    pub node: String,
    /// Process id.
    pub pid: u32,
    /// Why it was written: `failed` (the communicator's first error), `closed` (dropped),
    /// `requested` ([`crate::Communicator::dump_trace`], [`crate::Communicator::trace`]).
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
    /// Oldest first.
    pub records: Vec<TraceRecord>,
}

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
    /// `Error::Io` when the file cannot be read, is not JSON of this shape, or has another
    /// `format`.
    pub fn read(path: &Path) -> Result<TraceDump> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
        let dump: TraceDump = serde_json::from_str(&text)
            .map_err(|e| Error::Io(format!("{}: not an oxccl trace: {e}", path.display())))?;
        if dump.format != FORMAT {
            return Err(Error::Io(format!(
                "{}: format {:?}, this version reads {FORMAT:?}",
                path.display(),
                dump.format
            )));
        }
        Ok(dump)
    }

    /// Writes the dump to `dir` (made if missing) under [`TraceDump::file_name`], through a
    /// temporary file renamed into place, so a reader never sees half a file and a later dump
    /// replaces an earlier one whole. Returns the path.
    ///
    /// # Errors
    /// `Error::Io` naming the path.
    pub fn write_to(&self, dir: &Path) -> Result<PathBuf> {
        let io = |what: &str, p: &Path, e: std::io::Error| {
            Error::Io(format!(
                "rank {}: writing the flight record: {what} {}: {e}",
                self.rank,
                p.display()
            ))
        };
        std::fs::create_dir_all(dir).map_err(|e| io("creating", dir, e))?;
        let name = Self::file_name(&self.comm, self.rank);
        let path = dir.join(&name);
        let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
        let text = serde_json::to_vec_pretty(self).map_err(|e| Error::Io(e.to_string()))?;
        std::fs::write(&tmp, text).map_err(|e| io("writing", &tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io("renaming into", &path, e)
        })?;
        Ok(path)
    }
}

/// What an operation is, in the compact form kept per record.
#[derive(Clone, Copy, Debug)]
pub(crate) enum What {
    /// A collective: its sequence number, descriptor, algorithm and bytes.
    Coll {
        seq: u64,
        desc: OpDesc,
        algo: Algorithm,
        bytes: usize,
    },
    /// A point-to-point operation: a single send and/or receive (peer, message number), or a
    /// batch of `sends` and `recvs` (no message numbers kept); `count` elements sent (received
    /// when there is no send), `bytes` sent and received in all.
    P2p {
        dtype: DType,
        send_to: Option<(usize, u64)>,
        recv_from: Option<(usize, u64)>,
        sends: usize,
        recvs: usize,
        count: usize,
        bytes: usize,
    },
}

#[derive(Clone, Debug)]
struct Rec {
    id: u64,
    what: What,
    /// `CLOCK_MONOTONIC` nanoseconds (read from the coarse clock unless `precise`).
    start: u64,
    end: Option<u64>,
    precise: bool,
    error: Option<Arc<str>>,
}

/// Who the records belong to (set while the communicator is made).
#[derive(Clone, Debug, Default)]
pub(crate) struct Owner {
    pub comm: String,
    pub rank: usize,
    pub size: usize,
    pub root_comm: String,
    pub root_rank: usize,
    pub node: String,
}

/// Operations of at least this many bytes read the precise clock (they take microseconds at
/// least, so its 20 ns do not show); smaller ones on a communicator whose ranks all share
/// memory read the coarse clock (3 ns, one tick of resolution); over TCP every operation reads
/// the precise clock.
pub const PRECISE_MIN_BYTES: usize = 64 << 10;

/// `CLOCK_MONOTONIC` in nanoseconds; `coarse` reads `CLOCK_MONOTONIC_COARSE` instead, the same
/// clock as of the last tick (about 3 ns to read against 20 on the development machine).
fn mono_ns(coarse: bool) -> u64 {
    let id = if coarse {
        libc::CLOCK_MONOTONIC_COARSE
    } else {
        libc::CLOCK_MONOTONIC
    };
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec that clock_gettime fills; nothing else is
    // touched.
    let rc = unsafe { libc::clock_gettime(id, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

/// The resolution of `CLOCK_MONOTONIC_COARSE` in nanoseconds (a tick: 1 to 10 ms).
fn coarse_resolution_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: as in `mono_ns`: a valid, writable timespec.
    let rc = unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    if rc != 0 {
        return 10_000_000;
    }
    ((ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64).max(1)
}

/// A communicator's flight recorder (one per rank). It lives in the execution state, which the
/// running operation holds: recording takes no lock of its own.
pub(crate) struct Recorder {
    cap: usize,
    /// The last `cap` records; record `id` is at `id % cap`.
    recs: Vec<Rec>,
    /// Records begun so far (the next id).
    next: u64,
    /// The same moment on both clocks: records hold monotonic times, dumps wall-clock times.
    anchor: (u64, SystemTime),
    coarse_ns: u64,
    /// Some ranks talk over TCP: every operation takes microseconds, so every one reads the
    /// precise clock.
    pub sockets: bool,
    pub owner: Owner,
    dir: Option<PathBuf>,
}

fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl What {
    fn bytes(&self) -> usize {
        match *self {
            What::Coll { bytes, .. } | What::P2p { bytes, .. } => bytes,
        }
    }
}

impl Recorder {
    /// A recorder keeping the last `cap` operations (none when 0), dumping to `dir` if set.
    pub(crate) fn new(cap: usize, dir: Option<PathBuf>, owner: Owner) -> Recorder {
        let cap = cap.min(MAX_BUFFER);
        Recorder {
            cap,
            recs: Vec::with_capacity(cap),
            next: 0,
            anchor: (mono_ns(false), SystemTime::now()),
            coarse_ns: coarse_resolution_ns(),
            sockets: false,
            owner,
            dir,
        }
    }

    /// Records the start of an operation; returns its id for [`Recorder::end`] (`None` when
    /// recording is off).
    pub(crate) fn begin(&mut self, what: What) -> Option<u64> {
        if self.cap == 0 {
            return None;
        }
        let precise = self.sockets || what.bytes() >= PRECISE_MIN_BYTES;
        let id = self.next;
        self.next += 1;
        let rec = Rec {
            id,
            what,
            start: mono_ns(!precise),
            end: None,
            precise,
            error: None,
        };
        let slot = (id % self.cap as u64) as usize;
        if slot < self.recs.len() {
            self.recs[slot] = rec;
        } else {
            self.recs.push(rec);
        }
        Some(id)
    }

    /// Records the end of operation `id` (from [`Recorder::begin`]): completed, or failed with
    /// `error`. Nothing when the record was overwritten meanwhile.
    pub(crate) fn end(&mut self, id: Option<u64>, error: Option<&Error>) {
        let Some(id) = id else { return };
        let slot = (id % self.cap as u64) as usize;
        if let Some(rec) = self.recs.get_mut(slot).filter(|r| r.id == id) {
            rec.end = Some(mono_ns(!rec.precise));
            rec.error = error.map(|e| e.to_string().into());
        }
    }

    /// Records `f`, an operation described by `what`.
    pub(crate) fn record<R>(&mut self, what: What, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let id = self.begin(what);
        let r = f();
        self.end(id, r.as_ref().err());
        r
    }

    fn unix_ns_of(&self, t: u64) -> u64 {
        let since = std::time::Duration::from_nanos(t.saturating_sub(self.anchor.0));
        unix_ns(self.anchor.1 + since)
    }

    /// The record as it stands, oldest operation first.
    pub(crate) fn snapshot(&self, reason: &str, error: Option<&Error>) -> TraceDump {
        let mut recs: Vec<&Rec> = self.recs.iter().collect();
        recs.sort_by_key(|r| r.id);
        let o = &self.owner;
        TraceDump {
            format: FORMAT.into(),
            comm: o.comm.clone(),
            rank: o.rank,
            size: o.size,
            root_comm: o.root_comm.clone(),
            root_rank: o.root_rank,
            node: o.node.clone(),
            pid: std::process::id(),
            reason: reason.into(),
            error: error.map(ToString::to_string),
            dumped_unix_ns: unix_ns(SystemTime::now()),
            capacity: self.cap,
            recorded: self.next,
            records: recs.into_iter().map(|r| self.to_record(r)).collect(),
        }
    }

    fn to_record(&self, r: &Rec) -> TraceRecord {
        let state = match (&r.end, &r.error) {
            (None, _) => TraceState::Running,
            (Some(_), None) => TraceState::Completed,
            (Some(_), Some(_)) => TraceState::Failed,
        };
        let mut rec = TraceRecord {
            id: r.id,
            seq: None,
            coll: String::new(),
            op: String::new(),
            dtype: String::new(),
            count: 0,
            redop: None,
            root: None,
            algo: None,
            bytes: 0,
            send_to: None,
            recv_from: None,
            start_unix_ns: self.unix_ns_of(r.start),
            duration_ns: r.end.map(|e| e.saturating_sub(r.start)),
            clock_resolution_ns: if r.precise { 1 } else { self.coarse_ns },
            state,
            error: r.error.as_deref().map(str::to_string),
        };
        match r.what {
            What::Coll {
                seq,
                desc,
                algo,
                bytes,
            } => {
                let c = desc.coll;
                rec.seq = Some(seq);
                rec.coll = c.name().into();
                rec.op = desc.to_string();
                rec.dtype = desc.dtype.to_string();
                rec.count = desc.count as u64;
                let reduces = matches!(
                    c,
                    Collective::AllReduce
                        | Collective::ReduceScatter
                        | Collective::Reduce
                        | Collective::ReduceScatterV
                );
                rec.redop = reduces.then(|| desc.op.to_string());
                let rooted = matches!(
                    c,
                    Collective::Broadcast
                        | Collective::Reduce
                        | Collective::Gather
                        | Collective::Scatter
                        | Collective::GatherV
                        | Collective::ScatterV
                );
                rec.root = rooted.then_some(desc.root);
                rec.algo = Some(algo.name().into());
                rec.bytes = bytes as u64;
            }
            What::P2p {
                dtype,
                send_to,
                recv_from,
                sends,
                recvs,
                count,
                bytes,
            } => {
                let single = sends <= 1 && recvs <= 1 && (send_to.is_some() || recv_from.is_some());
                rec.coll = match (single, send_to, recv_from) {
                    (true, Some(_), None) => "send",
                    (true, None, Some(_)) => "recv",
                    (true, Some(_), Some(_)) => "send-recv",
                    _ => "batch-p2p",
                }
                .into();
                let mut parts = Vec::new();
                if let Some((p, n)) = send_to {
                    parts.push(format!("to={p} #{n}"));
                }
                if let Some((p, n)) = recv_from {
                    parts.push(format!("from={p} #{n}"));
                }
                if !single {
                    parts.push(format!("sends={sends}, recvs={recvs}"));
                }
                rec.op = format!(
                    "{}({}, count={count}, dtype={dtype})",
                    rec.coll,
                    parts.join(", ")
                );
                rec.dtype = dtype.to_string();
                rec.count = count as u64;
                rec.bytes = bytes as u64;
                rec.send_to = send_to;
                rec.recv_from = recv_from;
            }
        }
        rec
    }

    /// Writes the record to `OXCCL_TRACE_DIR` if it is set (a failure to write is logged, never
    /// returned: this runs while a communicator fails or closes).
    pub(crate) fn dump_if_set(&self, reason: &str, error: Option<&Error>) {
        let Some(dir) = &self.dir else { return };
        if self.cap == 0 {
            return;
        }
        match self.snapshot(reason, error).write_to(dir) {
            Ok(path) => {
                tracing::info!(rank = self.owner.rank, path = %path.display(), reason, "flight record written")
            }
            Err(e) => tracing::warn!(
                rank = self.owner.rank,
                "could not write the flight record: {e}"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oxccl_kernels::ReduceOp;

    fn coll(seq: u64) -> What {
        What::Coll {
            seq,
            desc: OpDesc {
                coll: Collective::AllReduce,
                dtype: DType::F32,
                op: ReduceOp::Sum,
                root: 0,
                count: 10,
            },
            algo: Algorithm::Ring,
            bytes: 40,
        }
    }

    fn owner() -> Owner {
        Owner {
            comm: "job/world1/split0/c1".into(),
            rank: 1,
            size: 2,
            root_comm: "job/world1".into(),
            root_rank: 3,
            node: "n0".into(),
        }
    }

    #[test]
    fn keeps_the_last_records_in_order() {
        let mut r = Recorder::new(3, None, owner());
        for s in 0..5 {
            let id = r.begin(coll(s));
            r.end(id, None);
        }
        let d = r.snapshot("requested", None);
        assert_eq!(d.recorded, 5);
        let seqs: Vec<_> = d.records.iter().map(|x| x.seq).collect();
        assert_eq!(seqs, [Some(2), Some(3), Some(4)]);
        assert!(d.records.iter().all(|x| x.state == TraceState::Completed));
        assert!(d
            .records
            .windows(2)
            .all(|w| w[0].start_unix_ns <= w[1].start_unix_ns));
    }

    #[test]
    fn off_records_nothing() {
        let mut r = Recorder::new(0, None, owner());
        assert_eq!(r.begin(coll(0)), None);
        assert!(r.snapshot("requested", None).records.is_empty());
    }

    #[test]
    fn an_overwritten_record_is_not_ended_by_a_later_one() {
        let mut r = Recorder::new(1, None, owner());
        let first = r.begin(coll(0));
        let second = r.begin(coll(1));
        r.end(first, None);
        let d = r.snapshot("requested", None);
        assert_eq!(d.records[0].seq, Some(1));
        assert_eq!(d.records[0].state, TraceState::Running);
        r.end(second, Some(&Error::Io("x".into())));
        let d = r.snapshot("requested", None);
        assert_eq!(d.records[0].state, TraceState::Failed);
        assert_eq!(d.records[0].error.as_deref(), Some("i/o: x"));
    }

    #[test]
    fn records_describe_collectives_and_point_to_point() {
        let mut r = Recorder::new(8, None, owner());
        let id = r.begin(coll(7));
        r.end(id, None);
        let p2p = |send_to, recv_from, sends, recvs| What::P2p {
            dtype: DType::I64,
            send_to,
            recv_from,
            sends,
            recvs,
            count: 4,
            bytes: 32,
        };
        for what in [
            p2p(Some((0, 2)), None, 1, 0),
            p2p(None, Some((0, 5)), 0, 1),
            p2p(Some((0, 3)), Some((0, 6)), 1, 1),
            p2p(None, None, 2, 3),
        ] {
            let id = r.begin(what);
            r.end(id, None);
        }
        let d = r.snapshot("requested", None);
        let ops: Vec<_> = d.records.iter().map(|x| x.op.as_str()).collect();
        assert_eq!(
            ops,
            [
                "all-reduce(count=10, dtype=float, op=sum)",
                "send(to=0 #2, count=4, dtype=int64)",
                "recv(from=0 #5, count=4, dtype=int64)",
                "send-recv(to=0 #3, from=0 #6, count=4, dtype=int64)",
                "batch-p2p(sends=2, recvs=3, count=4, dtype=int64)",
            ]
        );
        assert_eq!(d.records[0].algo.as_deref(), Some("ring"));
        assert_eq!(d.records[0].redop.as_deref(), Some("sum"));
        assert_eq!(
            d.records[0].signature(),
            "all-reduce dtype=float count=10 op=sum"
        );
        assert_eq!(d.records[2].recv_from, Some((0, 5)));
        assert_eq!(d.records[1].seq, None);
    }

    #[test]
    fn dumps_round_trip_through_a_file() {
        let dir = std::env::temp_dir().join(format!("oxccl-trace-unit-{}", std::process::id()));
        let mut r = Recorder::new(4, Some(dir.clone()), owner());
        let id = r.begin(coll(0));
        r.end(id, None);
        r.begin(coll(1));
        let e = Error::Io("boom".into());
        r.dump_if_set("failed", Some(&e));
        let path = dir.join(TraceDump::file_name("job/world1/split0/c1", 1));
        assert!(path.ends_with("job_world1_split0_c1.r1.json"), "{path:?}");
        let d = TraceDump::read(&path).unwrap();
        assert_eq!(d, {
            let mut want = r.snapshot("failed", Some(&e));
            want.dumped_unix_ns = d.dumped_unix_ns;
            want
        });
        assert_eq!(d.root_rank, 3);
        assert_eq!(d.records[1].state, TraceState::Running);
        assert_eq!(d.error.as_deref(), Some("i/o: boom"));
        // Nothing else is left in the directory (the temporary file was renamed).
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        std::fs::write(&path, b"{\"format\": \"other\"}").unwrap();
        assert!(TraceDump::read(&path).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
