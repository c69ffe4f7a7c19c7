//! The recorder itself: a ring of compact records behind a small lock of its own (held only to
//! write or copy a record, never while an operation waits), and the clocks it reads.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oxccl_kernels::DType;

use super::{write_bounded, TraceDump, TraceRecord, TraceState, FORMAT, MAX_BUFFER, WRITE_BUDGET};
use crate::error::Error;
use crate::op::{Collective, OpDesc};
use crate::tuning::Algorithm;

/// Operations of at least this many bytes read the exact clock (they take microseconds at
/// least, so its 20 ns do not show); smaller ones on a communicator whose ranks all share
/// memory read the coarse clock (3 ns, one tick of resolution); over TCP every operation reads
/// the exact clock.
pub const PRECISE_MIN_BYTES: usize = 64 << 10;

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
    /// batch of `sends` and `recvs` (message numbers only in the per-peer counts); `count`
    /// elements sent (received when nothing is sent), `bytes` sent and received in all.
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

impl What {
    fn bytes(&self) -> usize {
        match *self {
            What::Coll { bytes, .. } | What::P2p { bytes, .. } => bytes,
        }
    }
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
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
        .max(1)
}

fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

struct Ring {
    /// The last `cap` records; record `id` is at `id % cap`.
    recs: Vec<Rec>,
    /// Records begun so far (the next id).
    next: u64,
    /// Per peer: messages begun to send to it / to receive from it (their last number).
    sent: Vec<u64>,
    recvd: Vec<u64>,
}

/// A communicator's flight recorder (one per rank).
pub(crate) struct Recorder {
    cap: usize,
    ring: Mutex<Ring>,
    /// The same moment on both clocks: records hold monotonic times, dumps wall-clock times.
    anchor: (u64, SystemTime),
    coarse_ns: u64,
    /// Some ranks talk over TCP: every operation takes microseconds, so every one reads the
    /// exact clock.
    pub sockets: bool,
    pub owner: Owner,
    dir: Option<PathBuf>,
}

impl Recorder {
    /// A recorder keeping the last `cap` operations (none when 0), dumping to `dir` if set.
    pub(crate) fn new(cap: usize, dir: Option<PathBuf>, owner: Owner) -> Recorder {
        let cap = cap.min(MAX_BUFFER);
        Recorder {
            cap,
            ring: Mutex::new(Ring {
                recs: Vec::with_capacity(cap),
                next: 0,
                sent: Vec::new(),
                recvd: Vec::new(),
            }),
            anchor: (mono_ns(false), SystemTime::now()),
            coarse_ns: coarse_resolution_ns(),
            sockets: false,
            owner,
            dir,
        }
    }

    fn ring(&self) -> MutexGuard<'_, Ring> {
        // Plain data: a panic elsewhere while holding it leaves nothing half-done that matters.
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the start of an operation; returns its id for [`Recorder::end`] (`None` when
    /// recording is off).
    pub(crate) fn begin(&self, what: What) -> Option<u64> {
        if self.cap == 0 {
            return None;
        }
        let precise = self.sockets || what.bytes() >= PRECISE_MIN_BYTES;
        let start = mono_ns(!precise);
        let mut ring = self.ring();
        let id = ring.next;
        ring.next += 1;
        let rec = Rec {
            id,
            what,
            start,
            end: None,
            precise,
            error: None,
        };
        let slot = (id % self.cap as u64) as usize;
        if slot < ring.recs.len() {
            ring.recs[slot] = rec;
        } else {
            ring.recs.push(rec);
        }
        Some(id)
    }

    /// Records the end of operation `id` (from [`Recorder::begin`]): completed, or failed with
    /// `error`. Nothing when the record was overwritten meanwhile.
    pub(crate) fn end(&self, id: Option<u64>, error: Option<&Error>) {
        let Some(id) = id else { return };
        let slot = (id % self.cap as u64) as usize;
        let error: Option<Arc<str>> = error.map(|e| e.to_string().into());
        let mut ring = self.ring();
        if let Some(rec) = ring.recs.get_mut(slot).filter(|r| r.id == id) {
            rec.end = Some(mono_ns(!rec.precise));
            rec.error = error;
        }
    }

    /// Records `f`, an operation described by `what`.
    pub(crate) fn record<R>(
        &self,
        what: What,
        f: impl FnOnce() -> crate::Result<R>,
    ) -> crate::Result<R> {
        let id = self.begin(what);
        let r = f();
        self.end(id, r.as_ref().err());
        r
    }

    /// Notes message `number` to (`sent`) or from `peer`, for the per-peer counts of the dump.
    pub(crate) fn note_message(&self, peer: usize, sent: bool, number: u64) {
        if self.cap == 0 {
            return;
        }
        let size = self.owner.size;
        let mut ring = self.ring();
        let counts = if sent {
            &mut ring.sent
        } else {
            &mut ring.recvd
        };
        if counts.len() != size {
            counts.resize(size, 0);
        }
        if let Some(c) = counts.get_mut(peer) {
            *c = (*c).max(number);
        }
    }

    fn unix_ns_of(&self, t: u64) -> u64 {
        let since = Duration::from_nanos(t.saturating_sub(self.anchor.0));
        self.anchor.1.checked_add(since).map_or(u64::MAX, unix_ns)
    }

    /// The record as it stands, oldest operation first.
    pub(crate) fn snapshot(&self, reason: &str, error: Option<&Error>) -> TraceDump {
        let (mut recs, recorded, sent, recvd) = {
            let ring = self.ring();
            (
                ring.recs.clone(),
                ring.next,
                ring.sent.clone(),
                ring.recvd.clone(),
            )
        };
        recs.sort_by_key(|r| r.id);
        let size = self.owner.size;
        // One list sized for every peer as soon as either direction has a message.
        let (p2p_sent, p2p_recvd) = if sent.is_empty() && recvd.is_empty() {
            (Vec::new(), Vec::new())
        } else {
            let full = |mut v: Vec<u64>| {
                v.resize(size, 0);
                v
            };
            (full(sent), full(recvd))
        };
        let o = &self.owner;
        TraceDump {
            format: FORMAT.into(),
            comm: o.comm.clone(),
            rank: o.rank,
            size,
            root_comm: o.root_comm.clone(),
            root_rank: o.root_rank,
            node: o.node.clone(),
            pid: std::process::id(),
            reason: reason.into(),
            error: error.map(ToString::to_string),
            dumped_unix_ns: unix_ns(SystemTime::now()),
            capacity: self.cap,
            recorded,
            p2p_sent,
            p2p_recvd,
            records: recs.iter().map(|r| self.to_record(r)).collect(),
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

    /// Writes the record to `OXCCL_TRACE_DIR` if it is set, waiting at most [`WRITE_BUDGET`]
    /// (a failure to write is logged, never returned: this runs while a communicator fails or
    /// closes).
    pub(crate) fn dump_if_set(&self, reason: &str, error: Option<&Error>) {
        let Some(dir) = &self.dir else { return };
        if self.cap == 0 {
            return;
        }
        write_bounded(self.snapshot(reason, error), dir.clone(), WRITE_BUDGET);
    }
}
