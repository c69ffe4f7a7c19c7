//! The recorder itself: a ring of records as atomic words under sequence locks (written by the
//! running operation without a lock, read by any thread without waiting), and the clocks it
//! reads.

use std::path::PathBuf;
use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oxccl_kernels::{DType, ReduceOp};

use super::{write_bounded, TraceDump, TraceRecord, TraceState, FORMAT, MAX_BUFFER, WRITE_BUDGET};
use crate::base::error::Error;
use crate::base::op::{Collective, OpDesc};
use crate::base::tuning::Algorithm;

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

fn unix_ns(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Words of a record in its slot: id, start, end, header, then the operation's fields.
const WORDS: usize = 12;
/// `end` of a record still running.
const NONE: u64 = u64::MAX;
/// Header bits: a point-to-point record, the exact clock, a single send, a single receive.
const P2P: u64 = 1;
const PRECISE: u64 = 2;
const HAS_SEND: u64 = 4;
const HAS_RECV: u64 = 8;

/// One record, written by the operation that runs (one at a time per communicator) and read by
/// anyone, as a sequence lock over atomic words: the writer makes `version` odd, writes, and
/// makes it even again; a reader keeps a copy only if `version` was even and unchanged around
/// it. No lock, no `unsafe`.
#[derive(Default)]
struct Slot {
    version: AtomicU64,
    words: [AtomicU64; WORDS],
}

impl Slot {
    /// Stores words with `store` under the version protocol.
    fn write(&self, store: impl FnOnce(&[AtomicU64; WORDS])) {
        let v = self.version.load(Ordering::Relaxed);
        self.version.store(v.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        store(&self.words);
        self.version.store(v.wrapping_add(2), Ordering::Release);
    }

    /// A consistent copy of the words, or `None` if every try met a write (the writer rewrites
    /// a slot once per `OXCCL_TRACE_BUFFER` operations, so this is rare; the record is then
    /// left out of the snapshot).
    fn read(&self) -> Option<[u64; WORDS]> {
        for attempt in 0..200 {
            let v1 = self.version.load(Ordering::Acquire);
            if v1.is_multiple_of(2) {
                let w: [u64; WORDS] =
                    std::array::from_fn(|i| self.words[i].load(Ordering::Relaxed));
                fence(Ordering::Acquire);
                if self.version.load(Ordering::Relaxed) == v1 {
                    return Some(w);
                }
            }
            if attempt < 16 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        None
    }
}

/// `what` as header and field words (see [`WORDS`]: index 3 on).
fn encode(what: &What, precise: bool) -> [u64; 9] {
    let flag = if precise { PRECISE } else { 0 };
    match *what {
        What::Coll {
            seq,
            desc,
            algo,
            bytes,
        } => {
            let algo_i = algo.index() as u64;
            let header = flag
                | u64::from(desc.coll.to_u8()) << 8
                | u64::from(desc.dtype.to_u8()) << 16
                | u64::from(desc.op.to_u8()) << 24
                | algo_i << 32;
            let factor = desc.op.factor().map_or(0, f64::to_bits);
            [
                header,
                seq,
                desc.root as u64,
                desc.count as u64,
                bytes as u64,
                factor,
                0,
                0,
                0,
            ]
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
            let header = P2P
                | flag
                | if send_to.is_some() { HAS_SEND } else { 0 }
                | if recv_from.is_some() { HAS_RECV } else { 0 }
                | u64::from(dtype.to_u8()) << 16;
            let (sp, sn) = send_to.map_or((0, 0), |(p, n)| (p as u64, n));
            let (rp, rn) = recv_from.map_or((0, 0), |(p, n)| (p as u64, n));
            [
                header,
                sp,
                sn,
                rp,
                rn,
                bytes as u64,
                sends as u64,
                recvs as u64,
                count as u64,
            ]
        }
    }
}

/// The inverse of [`encode`] (`None` for words no version wrote).
fn decode(w: &[u64; WORDS]) -> Option<What> {
    let h = w[3];
    let byte = |shift: u32| ((h >> shift) & 0xff) as u8;
    let dtype = DType::from_u8(byte(16))?;
    if h & P2P != 0 {
        return Some(What::P2p {
            dtype,
            send_to: (h & HAS_SEND != 0).then_some((w[4] as usize, w[5])),
            recv_from: (h & HAS_RECV != 0).then_some((w[6] as usize, w[7])),
            sends: w[9] as usize,
            recvs: w[10] as usize,
            count: w[11] as usize,
            bytes: w[8] as usize,
        });
    }
    let op = match ReduceOp::from_u8(byte(24))? {
        ReduceOp::PreMulSum(_) => ReduceOp::premul_sum(f64::from_bits(w[8])),
        op => op,
    };
    Some(What::Coll {
        seq: w[4],
        desc: OpDesc {
            coll: Collective::from_u8(byte(8))?,
            dtype,
            op,
            root: w[5] as usize,
            count: w[6] as usize,
        },
        algo: *Algorithm::ALL.get(((h >> 32) & 0xff) as usize)?,
        bytes: w[7] as usize,
    })
}

/// A record begun: its id, its slot and which clock it reads (see [`Recorder::begin`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Began {
    id: u64,
    slot: usize,
    precise: bool,
}

/// One record as a snapshot sees it.
struct Rec {
    id: u64,
    what: What,
    start: u64,
    end: Option<u64>,
    precise: bool,
    error: Option<Arc<str>>,
}

/// A communicator's flight recorder (one per rank). Writers are the operations of the
/// communicator, which run one at a time (each holds the execution state); readers may be any
/// thread at any moment.
pub(crate) struct Recorder {
    cap: usize,
    /// Record `id` is in `slots[id % cap]`.
    slots: Box<[Slot]>,
    /// Records begun so far (the next id).
    next: AtomicU64,
    /// The slot of the next record (`next % cap`, kept by the writer so that no record divides).
    cursor: AtomicUsize,
    /// The errors of failed records still in the ring, by id.
    errors: Mutex<Vec<(u64, Arc<str>)>>,
    /// Per peer: messages begun to send to it / to receive from it (their last number); made
    /// by the first message.
    sent: OnceLock<Box<[AtomicU64]>>,
    recvd: OnceLock<Box<[AtomicU64]>>,
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
            slots: (0..cap).map(|_| Slot::default()).collect(),
            next: AtomicU64::new(0),
            cursor: AtomicUsize::new(0),
            errors: Mutex::new(Vec::new()),
            sent: OnceLock::new(),
            recvd: OnceLock::new(),
            anchor: (crate::base::sys::mono_ns(false), SystemTime::now()),
            coarse_ns: crate::base::sys::coarse_resolution_ns(),
            sockets: false,
            owner,
            dir,
        }
    }

    fn slot(&self, id: u64) -> &Slot {
        &self.slots[(id % self.cap as u64) as usize]
    }

    /// Records the start of an operation; returns what [`Recorder::end`] needs (`None` when
    /// recording is off).
    pub(crate) fn begin(&self, what: What) -> Option<Began> {
        if self.cap == 0 {
            return None;
        }
        let precise = self.sockets || what.bytes() >= PRECISE_MIN_BYTES;
        let start = crate::base::sys::mono_ns(!precise);
        // One writer at a time (operations hold the execution state): no read-modify-write.
        let id = self.next.load(Ordering::Relaxed);
        let slot = self.cursor.load(Ordering::Relaxed);
        let mut words = [id, start, NONE, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        words[3..].copy_from_slice(&encode(&what, precise));
        self.slots[slot].write(|w| {
            for (w, x) in w.iter().zip(words) {
                w.store(x, Ordering::Relaxed);
            }
        });
        let after = if slot + 1 == self.cap { 0 } else { slot + 1 };
        self.cursor.store(after, Ordering::Relaxed);
        self.next.store(id + 1, Ordering::Release);
        Some(Began { id, slot, precise })
    }

    /// Records the end of the operation `began` (from [`Recorder::begin`]): completed, or
    /// failed with `error`. Nothing when the record was overwritten meanwhile.
    pub(crate) fn end(&self, began: Option<Began>, error: Option<&Error>) {
        let Some(Began { id, slot, precise }) = began else {
            return;
        };
        let slot = &self.slots[slot];
        // The writer's own words: no other thread writes them.
        if slot.words[0].load(Ordering::Relaxed) != id {
            return;
        }
        if let Some(e) = error {
            let mut errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
            let oldest = (id + 1).saturating_sub(self.cap as u64);
            errors.retain(|(i, _)| *i >= oldest);
            errors.push((id, e.to_string().into()));
        }
        let end = crate::base::sys::mono_ns(!precise);
        slot.write(|w| w[2].store(end, Ordering::Relaxed));
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
        let make = || (0..size).map(|_| AtomicU64::new(0)).collect();
        let counts = if sent {
            self.sent.get_or_init(make)
        } else {
            self.recvd.get_or_init(make)
        };
        // One writer at a time, and a peer's numbers only grow: a plain store.
        if let Some(c) = counts.get(peer) {
            c.store(number, Ordering::Relaxed);
        }
    }

    fn unix_ns_of(&self, t: u64) -> u64 {
        let since = Duration::from_nanos(t.saturating_sub(self.anchor.0));
        self.anchor.1.checked_add(since).map_or(u64::MAX, unix_ns)
    }

    /// The record as it stands, oldest operation first (an operation running as `running`).
    pub(crate) fn snapshot(&self, reason: &str, error: Option<&Error>) -> TraceDump {
        let next = self.next.load(Ordering::Acquire);
        let errors = self
            .errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let recs: Vec<Rec> = (next.saturating_sub(self.cap as u64)..next)
            .filter_map(|id| {
                let w = self.slot(id).read()?;
                // Overwritten by a newer record while this one was read: gone.
                if w[0] != id {
                    return None;
                }
                Some(Rec {
                    id,
                    what: decode(&w)?,
                    start: w[1],
                    end: (w[2] != NONE).then_some(w[2]),
                    precise: w[3] & PRECISE != 0,
                    error: errors
                        .iter()
                        .find(|(i, _)| *i == id)
                        .map(|(_, e)| e.clone()),
                })
            })
            .collect();
        let size = self.owner.size;
        let counts = |c: &OnceLock<Box<[AtomicU64]>>| -> Vec<u64> {
            match c.get() {
                Some(v) => v.iter().map(|x| x.load(Ordering::Relaxed)).collect(),
                None => vec![0; size],
            }
        };
        // One list sized for every peer as soon as either direction has a message.
        let (p2p_sent, p2p_recvd) = if self.sent.get().is_none() && self.recvd.get().is_none() {
            (Vec::new(), Vec::new())
        } else {
            (counts(&self.sent), counts(&self.recvd))
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
            recorded: next,
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
                rec.redop = c.reduces().then(|| desc.op.to_string());
                rec.root = c.has_root().then_some(desc.root);
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

    /// Writes the record to `OXCCL_TRACE_DIR`, if it is set, on a helper thread, without waiting
    /// for it (a wait that stalled: the operation goes on waiting meanwhile).
    pub(crate) fn dump_in_background(&self, reason: &str) {
        let Some(dir) = &self.dir else { return };
        if self.cap == 0 {
            return;
        }
        write_bounded(self.snapshot(reason, None), dir.clone(), Duration::ZERO);
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
