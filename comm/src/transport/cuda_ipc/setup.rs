//! Joining CUDA IPC at a communicator's first device collective: the record each rank
//! publishes, the checks every rank makes alike, mapping the peers' scratch, and the agreement
//! (or the refusal, and staging through host memory instead) that ends it.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream};

use super::exec::ThreadSync;
use super::p2p::{P2pCursor, P2pLayout};
use super::plan::{Cursor, MAX_RANKS};
use super::registration::{close_handle, mapped, open_handle, same_process_peer, Local, MapKey};
use super::{IpcState, TEARDOWN_WAIT};
use crate::base::config::{ipc_barrier_from_name, ipc_barrier_name};
use crate::base::error::{Error, Result};
use crate::transport::Group;

/// A number that identifies this process among every process of the node (process ids repeat
/// across PID namespaces): random, drawn once.
pub(super) fn process_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static NONCE: OnceLock<u64> = OnceLock::new();
    *NONCE.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        if let Ok(t) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            h.write_u128(t.as_nanos());
        }
        h.finish()
    })
}

/// What a rank publishes at set-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Record {
    /// Its scratch: process (nonce), device ordinal, address in its process, its slot and
    /// one-shot sizes and barrier setting (every rank must use the same), IPC handle.
    Ready {
        nonce: u64,
        ordinal: usize,
        ptr: u64,
        slot: usize,
        one_shot: usize,
        /// `OXCCL_CUDA_IPC_BARRIER`: `None` auto, `Some(true)` host, `Some(false)` device.
        host_barrier: Option<bool>,
        handle: [u8; 64],
    },
    /// Why it cannot take part.
    No(String),
}

impl Record {
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self {
            Record::Ready {
                nonce,
                ordinal,
                ptr,
                slot,
                one_shot,
                host_barrier,
                handle,
            } => {
                let hex: String = handle.iter().map(|b| format!("{b:02x}")).collect();
                let barrier = ipc_barrier_name(*host_barrier);
                format!("ready {nonce:x} {ordinal} {ptr:x} {slot} {one_shot} {barrier} {hex}")
                    .into_bytes()
            }
            Record::No(why) => format!("no {why}").into_bytes(),
        }
    }

    pub(crate) fn decode(b: &[u8]) -> std::result::Result<Record, String> {
        let s = String::from_utf8_lossy(b);
        if let Some(why) = s.strip_prefix("no ") {
            return Ok(Record::No(why.to_string()));
        }
        let bad = || format!("unreadable cuda_ipc record {s:?}");
        let f: Vec<&str> = s.split(' ').collect();
        if f.len() != 8 || f[0] != "ready" || f[7].len() != 128 || !f[7].is_ascii() {
            return Err(bad());
        }
        let mut handle = [0u8; 64];
        for (i, h) in handle.iter_mut().enumerate() {
            *h = u8::from_str_radix(&f[7][2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        let host_barrier = ipc_barrier_from_name(f[6]).ok_or_else(bad)?;
        Ok(Record::Ready {
            nonce: u64::from_str_radix(f[1], 16).map_err(|_| bad())?,
            ordinal: f[2].parse().map_err(|_| bad())?,
            ptr: u64::from_str_radix(f[3], 16).map_err(|_| bad())?,
            slot: f[4].parse().map_err(|_| bad())?,
            one_shot: f[5].parse().map_err(|_| bad())?,
            host_barrier,
            handle,
        })
    }
}

/// Why a communicator of `size` ranks cannot use CUDA IPC at all, from facts every rank knows
/// alike (so no rank waits for records the others will not publish): its collectives need
/// every pair of ranks connected by it (`routed(a, b)`: the selector gave the pair CUDA IPC).
pub(crate) fn shape_reason(size: usize, routed: impl Fn(usize, usize) -> bool) -> Option<String> {
    if size < 2 {
        Some("a single rank".into())
    } else if size > MAX_RANKS {
        Some(format!(
            "{size} ranks (at most {MAX_RANKS} share device memory)"
        ))
    } else if (0..size).any(|a| (a + 1..size).any(|b| !routed(a, b))) {
        Some("ranks on more than one node".into())
    } else {
        None
    }
}

/// Joins (or declines) CUDA IPC for the device collectives of the communicator `comm`
/// describes, on every rank alike.
///
/// `Ok(None)`: stage through host memory instead (the reason is logged).
///
/// # Errors
/// `Cuda` when `OXCCL_CUDA_IPC=1` and some rank cannot take part (naming it and why), when the
/// store fails, or when a rank does not reach a step of the set-up in time (naming it).
pub(crate) fn setup(
    comm: &Group<'_>,
    stream: &Arc<CudaStream>,
    op: &str,
) -> Result<Option<IpcState>> {
    let cfg = &comm.cfg;
    let ctx = stream.context();
    let (rank, size) = (comm.rank, comm.size);
    let routed = |a: usize, b: usize| {
        comm.selector.device(&comm.peers[a], &comm.peers[b]) == Some("cuda_ipc")
    };
    if let Some(why) = shape_reason(size, routed) {
        return declined(comm, op, why);
    }
    let local = if cfg.cuda_ipc == Some(false) {
        Err("OXCCL_CUDA_IPC=0".to_string())
    } else {
        let layout = P2pLayout::new(cfg.cuda_ipc_slot, size);
        Local::new(rank, stream, &layout, cfg.timeout)
    };
    tracing::trace!(rank, "cuda: cuda_ipc set-up: publishing the record");
    let mine = match &local {
        Ok(l) => Record::Ready {
            nonce: process_nonce(),
            ordinal: ctx.ordinal(),
            ptr: l.scratch,
            slot: cfg.cuda_ipc_slot,
            one_shot: cfg.cuda_ipc_one_shot,
            host_barrier: cfg.cuda_ipc_host_barrier,
            handle: l.handle,
        },
        Err(why) => Record::No(why.clone()),
    };
    // The wait for the peers starts now, not before our own set-up: a rank's first device
    // collective compiles and loads the kernels, 15 s on a machine whose caches are empty
    // (measured on an H200), and that must not eat into the time we give the others.
    let rounds = Rounds {
        comm,
        op,
        deadline: Instant::now() + cfg.timeout,
    };
    // Once our record is out, peers may map our scratch and (if they never see a refusal)
    // write into it: from here on a failure leaks it instead of freeing it.
    let records = match rounds.gather("record", &mine.encode()) {
        Ok(r) => r,
        Err(e) => {
            if let Ok(mut l) = local {
                l.leak = true;
            }
            return Err(e);
        }
    };
    let mut local = match local {
        Ok(l) => l,
        Err(_) => {
            // Our own "no" is among the records: every rank declines with the first reason.
            return declined(comm, op, first_refusal(&records).unwrap_or_default());
        }
    };
    if let Some(why) = first_refusal(&records) {
        // Every rank read the same records: nobody maps anything, our scratch can go.
        return declined(comm, op, why);
    }
    local.leak = true;
    let peers: Vec<Record> = records
        .iter()
        .map(|b| Record::decode(b).unwrap_or(Record::No(String::new())))
        .collect();

    // Map every peer's scratch.
    tracing::trace!(rank, "cuda: cuda_ipc set-up: mapping the peers");
    let mut m = map_peers(ctx, rank, local.scratch, &peers);
    // Mapping may have made another context current.
    if let Err(e) = ctx.bind_to_thread() {
        m.failure
            .get_or_insert(format!("binding the context: {e:?}"));
    }
    let events = barrier_events(comm, ctx, &peers, &mut m.failure);
    let verdict = match &m.failure {
        None => b"ok".to_vec(),
        Some(why) => format!("no {why}").into_bytes(),
    };
    tracing::trace!(rank, "cuda: cuda_ipc set-up: publishing the verdict");
    let verdicts = rounds.gather("mapped", &verdict);
    let refused = match &verdicts {
        Ok(v) => v
            .iter()
            .enumerate()
            .find(|(_, b)| b.as_slice() != b"ok")
            .map(|(q, b)| format!("rank {q}: {}", String::from_utf8_lossy(b))),
        Err(e) => Some(e.to_string()),
    };
    if let Some(why) = refused {
        return refuse(&rounds, ctx, local, m, events, verdicts, why);
    }
    local.leak = false;
    let bases = m.bases;
    let host_barrier =
        events.map(|e| ThreadSync::join(format!("{}/{bases:x?}", comm.id), size, rank, e));
    tracing::debug!(
        rank,
        size,
        barrier = if host_barrier.is_some() {
            "host"
        } else {
            "device"
        },
        "device collectives over cuda_ipc"
    );
    Ok(Some(IpcState {
        local,
        bases,
        opened: m.opened,
        _peer_ctxs: m.peer_ctxs,
        host_barrier,
        hosts_store: comm.hosts_store,
        slot_bytes: cfg.cuda_ipc_slot,
        one_shot: cfg.cuda_ipc_one_shot,
        algo: cfg.algo.clone(),
        cur: Cursor::default(),
        p2p: P2pLayout::new(cfg.cuda_ipc_slot, size),
        p2p_cur: P2pCursor::default(),
        ops: 0,
        last_stream: None,
        history: VecDeque::new(),
        store: Arc::clone(comm.store),
        id: comm.id.to_string(),
        rank,
        size,
        timeout: cfg.timeout,
    }))
}

/// Declines CUDA IPC for `why`: device collectives stage through host memory instead (the
/// reason is logged), or, with `OXCCL_CUDA_IPC=1`, set-up fails naming it.
fn declined(comm: &Group<'_>, op: &str, why: String) -> Result<Option<IpcState>> {
    let rank = comm.rank;
    if comm.cfg.cuda_ipc == Some(true) {
        Err(Error::Cuda {
            rank,
            op: op.into(),
            msg: format!("OXCCL_CUDA_IPC=1, but CUDA IPC cannot be used: {why}"),
        })
    } else {
        tracing::info!(rank, "device collectives staged through host memory: {why}");
        Ok(None)
    }
}

/// The store rounds of one set-up: in each, every rank publishes a value under the step's name
/// and reads every rank's, all by one deadline.
struct Rounds<'a> {
    comm: &'a Group<'a>,
    /// The operation whose first call sets up (for errors).
    op: &'a str,
    /// When every rank's values of every round must be there.
    deadline: Instant,
}

impl Rounds<'_> {
    /// The store key of rank `q`'s value in round `what`.
    fn key(&self, what: &str, q: usize) -> String {
        format!("{}/cuda_ipc/{what}/{q}", self.comm.id)
    }

    /// A failure of the store, as an error of this set-up.
    fn store_err(&self, e: Error) -> Error {
        Error::Cuda {
            rank: self.comm.rank,
            op: self.op.into(),
            msg: format!("cuda_ipc set-up (communicator {}): {e}", self.comm.id),
        }
    }

    /// Publishes `value` as this rank's in round `what`, then reads every rank's (this rank's
    /// included), in rank order.
    ///
    /// # Errors
    /// `Cuda` when the store fails, or naming the first rank whose value is not there by the
    /// deadline.
    fn gather(&self, what: &str, value: &[u8]) -> Result<Vec<Vec<u8>>> {
        let (comm, rank, op) = (self.comm, self.comm.rank, self.op);
        let store = &comm.store;
        let deadline = self.deadline;
        store
            .set(&self.key(what, rank), value)
            .map_err(|e| self.store_err(e))?;
        (0..comm.size)
            .map(|q| {
                store
                    .get(
                        &self.key(what, q),
                        deadline.saturating_duration_since(Instant::now()),
                    )
                    .map_err(|e| match e {
                        Error::Store(m) if crate::base::bootstrap::is_wait_timeout(&m) => {
                            Error::Cuda {
                                rank,
                                op: op.into(),
                                msg: format!(
                                    "cuda_ipc set-up (communicator {}): rank {q} did not \
                                 reach the '{what}' step within OXCCL_TIMEOUT ({:?}); a \
                                 rank's first device collective compiles and loads the \
                                 kernels (about 15 s with empty caches, OXCCL_CACHE_DIR \
                                 keeps them): {m}",
                                    comm.id, comm.cfg.timeout
                                ),
                            }
                        }
                        other => self.store_err(other),
                    })
            })
            .collect()
    }
}

/// What mapping the peers' scratch gave this rank.
struct Mapped {
    /// Every rank's scratch as this process addresses it (this rank's own included).
    bases: Vec<u64>,
    /// Cache keys of the peers' allocations this rank opened.
    opened: Vec<MapKey>,
    /// Contexts of the other GPUs of peers that are threads of this process.
    peer_ctxs: Vec<Arc<CudaContext>>,
    /// Why some peer could not be mapped (the first such).
    failure: Option<String>,
}

/// Maps every peer's scratch (`scratch`: this rank's own): the plain address of a peer that is
/// a thread of this process (once this context may reach its device), else its IPC handle,
/// opened through the process-wide cache. Stops at the first peer that cannot be mapped.
fn map_peers(ctx: &Arc<CudaContext>, rank: usize, scratch: u64, peers: &[Record]) -> Mapped {
    let mut bases = vec![0u64; peers.len()];
    let mut opened = Vec::new();
    let mut peer_ctxs = Vec::new();
    let mut failure = None;
    for (q, rec) in peers.iter().enumerate() {
        let Record::Ready {
            nonce,
            ordinal,
            ptr,
            handle,
            ..
        } = rec
        else {
            continue;
        };
        if q == rank {
            bases[q] = scratch;
            continue;
        }
        let r = if *nonce == process_nonce() {
            same_process_peer(ctx, *ordinal, &mut peer_ctxs).map(|()| *ptr)
        } else {
            let k = (ctx.cu_ctx() as usize, *handle);
            let r = mapped().acquire(&k, || open_handle(handle));
            if r.is_ok() {
                opened.push(k);
            }
            r
        };
        match r {
            Ok(p) => bases[q] = p,
            Err(e) => {
                failure = Some(format!("mapping rank {q}'s device memory: {e}"));
                break;
            }
        }
    }
    Mapped {
        bases,
        opened,
        peer_ctxs,
        failure,
    }
}

/// The two events of this rank's host barriers, when every rank is a thread of this process and
/// `OXCCL_CUDA_IPC_BARRIER` does not ask for the device; `None`: barriers run on the device. A
/// failure to make the events lands in `failure` (nothing is made once it is set).
fn barrier_events(
    comm: &Group<'_>,
    ctx: &Arc<CudaContext>,
    peers: &[Record],
    failure: &mut Option<String>,
) -> Option<[CudaEvent; 2]> {
    let (cfg, rank) = (&comm.cfg, comm.rank);
    // Every rank a thread of this process: barriers on the host (decided alike on every rank,
    // from the records they all read).
    let all_here = peers
        .iter()
        .all(|r| matches!(r, Record::Ready { nonce, .. } if *nonce == process_nonce()));
    let mut events = None;
    if all_here && cfg.cuda_ipc_host_barrier != Some(false) && failure.is_none() {
        match ctx
            .new_event(None)
            .and_then(|a| Ok([a, ctx.new_event(None)?]))
        {
            Ok(e) => events = Some(e),
            Err(e) => *failure = Some(format!("creating the barrier events: {e:?}")),
        }
    } else if all_here && cfg.cuda_ipc_host_barrier == Some(false) && rank == 0 && failure.is_none()
    {
        tracing::warn!(
            rank,
            "OXCCL_CUDA_IPC_BARRIER=device with every rank a thread of this process: a barrier \
             kernel waits on the GPU for a peer's kernel its thread may not have enqueued yet, \
             and a driver call on that thread that waits for the whole context (cuMemFree, \
             pinned host allocation, module loading; copies to pageable memory and \
             stream-ordered allocation were seen to; also the pinned buffers of staged \
             send/recv) then waits for the barrier kernel: stuck until OXCCL_TIMEOUT. Make the \
             rank threads meet on the host before any enqueues a collective and after all \
             have, or use OXCCL_CUDA_IPC_BARRIER=auto, which meets these barriers on the host"
        );
    } else if !all_here && cfg.cuda_ipc_host_barrier == Some(true) {
        tracing::info!(
            rank,
            "OXCCL_CUDA_IPC_BARRIER=host needs every rank in this process; barriers run on the \
             device"
        );
    }
    events
}

/// Declines after the "mapped" round (`verdicts`) found a rank that could not map everything,
/// or failed (`why` says which): this rank's mappings of the peers go, and its scratch is freed
/// once every rank has confirmed it let go of it, else left allocated.
///
/// # Errors
/// The round's failure; `Cuda` naming `why` when `OXCCL_CUDA_IPC=1`.
fn refuse(
    rounds: &Rounds<'_>,
    ctx: &Arc<CudaContext>,
    mut local: Local,
    m: Mapped,
    events: Option<[CudaEvent; 2]>,
    verdicts: Result<Vec<Vec<u8>>>,
    why: String,
) -> Result<Option<IpcState>> {
    let comm = rounds.comm;
    let (cfg, rank, size, store) = (&comm.cfg, comm.rank, comm.size, &comm.store);
    let deadline = rounds.deadline;
    // Our mappings of the peers go (no kernel of ours used them).
    for k in &m.opened {
        mapped().release(k, close_handle);
    }
    // Every rank read the same verdicts and declines, so no kernel runs on anyone's
    // scratch: once every rank has let go of its mappings ("declined"), ours can be freed.
    // That round gets a bound of its own (a slow "mapped" round may have spent the set-up's).
    // If the verdicts or that round failed, a peer may still map (or, having seen every
    // verdict as "ok", use) it: it stays allocated.
    let freed = match &verdicts {
        Ok(_) => {
            let bound = Instant::now() + cfg.timeout.min(TEARDOWN_WAIT);
            store.set(&rounds.key("declined", rank), b"1").is_ok()
                && (0..size).all(|q| {
                    let left = deadline
                        .max(bound)
                        .saturating_duration_since(Instant::now());
                    store.get(&rounds.key("declined", q), left).is_ok()
                })
        }
        Err(_) => {
            // Peers whose verdicts came through wait for our word: our mappings are gone.
            let _ = store.set(&rounds.key("declined", rank), b"1");
            false
        }
    };
    local.leak = !freed;
    if !freed {
        tracing::warn!(
            rank,
            "cuda_ipc set-up refused without every rank confirming in time that it \
             unmapped this rank's device scratch: {} bytes left allocated",
            P2pLayout::new(cfg.cuda_ipc_slot, size).scratch_bytes()
        );
    }
    drop(local);
    drop(events);
    // Dropping another GPU's context leaves it current on this thread: give the caller's
    // thread this rank's context back (not `bind_to_thread`, which skips the binding when
    // the context has a recorded error).
    drop(m.peer_ctxs);
    // SAFETY: the context handle is live (held by `ctx`).
    let _ = unsafe { result::ctx::set_current(ctx.cu_ctx()) };
    verdicts?;
    if cfg.cuda_ipc == Some(true) {
        return declined(comm, rounds.op, why);
    }
    // Unlike the other refusals (several nodes, OXCCL_CUDA_IPC=0, no driver), this one
    // comes from the GPUs (no peer access between two of them, say): worth a warning, the
    // staged path being many times slower. Rank 0's says it for all.
    if rank == 0 {
        tracing::warn!(
            rank,
            "device collectives staged through host memory: CUDA IPC set-up failed: {why}"
        );
    } else {
        tracing::info!(rank, "device collectives staged through host memory: {why}");
    }
    Ok(None)
}

/// The first rank that refused, and why (also for records that cannot be read, or that disagree
/// on the slot or one-shot size).
pub(super) fn first_refusal(records: &[Vec<u8>]) -> Option<String> {
    let mut sizes = None;
    for (q, b) in records.iter().enumerate() {
        match Record::decode(b) {
            Ok(Record::No(why)) => return Some(format!("rank {q}: {why}")),
            Err(e) => return Some(format!("rank {q}: {e}")),
            Ok(Record::Ready {
                slot,
                one_shot,
                host_barrier,
                ..
            }) => match sizes {
                None => sizes = Some((slot, one_shot, host_barrier)),
                Some(s) if s != (slot, one_shot, host_barrier) => {
                    return Some(format!(
                        "rank {q} has OXCCL_CUDA_IPC_SLOT={slot}, OXCCL_CUDA_IPC_ONE_SHOT=\
                         {one_shot} and OXCCL_CUDA_IPC_BARRIER={}, rank 0 {}, {} and {} (every \
                         rank must use the same)",
                        ipc_barrier_name(host_barrier),
                        s.0,
                        s.1,
                        ipc_barrier_name(s.2)
                    ))
                }
                Some(_) => {}
            },
        }
    }
    None
}
