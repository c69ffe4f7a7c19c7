//! Running a batch of device sends and receives over CUDA IPC: the steps of [`p2p_plan`]
//! enqueued on the caller's stream. Data moves by `cuMemcpyDtoDAsync` into the receiver's inbox
//! and out of it again; the flags are met on the GPU ([`DevP2p`]: the one-thread kernels
//! `oxccl_ipc_p2p_wait` and `oxccl_ipc_p2p_post` on the device words of `p2p.rs`), or, where every
//! rank is a thread of this process and collectives meet on the host, on the host ([`HostP2p`]:
//! the same words in host memory, each chunk's copy marked by a CUDA event the other stream waits
//! for), so that no stream ever waits for work its peer's thread has not enqueued yet.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaEvent, CudaStream};
use oxccl_kernels::cuda::CudaKernels;

use super::exec::ThreadSync;
use super::p2p::{
    ack_word, p2p_plan, ready_word, Msg, P2pLayout, P2pStep, ERR_P2P_ABORTED, ERR_P2P_ACK_TIMEOUT,
    ERR_P2P_MISMATCH, ERR_P2P_TIMEOUT, FLAG_WORDS,
};
use super::IpcState;
use crate::base::error::{Error, Result};
use crate::device::staging::Backoff;

/// The name errors give a device batch over CUDA IPC.
const OP: &str = "batch_p2p (cuda_ipc)";

/// The tag a rank that gave up publishes (`OXCCL_P2P_POISON_TAG` of the kernels).
const POISON_TAG: u32 = u32::MAX;

/// One message of a device batch: a send to `peer` of `bytes` bytes at device address `ptr`, or
/// a receive from `peer` into them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct P2pMsg {
    pub send: bool,
    pub peer: usize,
    pub ptr: u64,
    pub bytes: usize,
}

/// A rank's p2p flags and events when collectives meet on the host ([`ThreadSync`]): the words
/// of `p2p.rs` in host memory, and the events of its copies: `events[q][h]` marks its last put of
/// a half-`h` chunk into rank `q`'s inbox, `events[size + q][h]` its last take of a half-`h` chunk
/// out of its inbox for `q`. Made by the rank's thread at its first batch, in its context.
pub(crate) struct HostP2p {
    flags: [AtomicU64; FLAG_WORDS],
    events: OnceLock<Vec<[CudaEvent; 2]>>,
}

impl HostP2p {
    pub(super) fn new() -> HostP2p {
        HostP2p {
            flags: std::array::from_fn(|_| AtomicU64::new(0)),
            events: OnceLock::new(),
        }
    }
}

/// Why a wait of a batch failed: an error word (`ERR_P2P_* | peer << 8`) and the chunk.
type Failed = (u32, u32);

/// What stopped a batch: a CUDA call, a wait met on the host, or `Communicator::abort`.
enum Stop {
    Cuda(String),
    Wait(Failed),
    Aborted,
}

impl IpcState {
    /// Enqueues a batch of device sends and receives on `stream` (the caller checked the
    /// peers; sends to this rank itself pair with its receives from itself). With flags met on
    /// the host, returns once every wait of the batch has been met, as [`IpcState::run`] does.
    ///
    /// # Errors
    /// `InvalidArgument` for a batch the protocol cannot number (nothing enqueued); `Cuda` when
    /// enqueueing fails; with flags on the host, `Timeout`, `Mismatch` or `Aborted` for what a
    /// wait found (on the device, the same come later through [`IpcState::failure`]).
    pub(crate) fn run_p2p(
        &mut self,
        stream: &Arc<CudaStream>,
        msgs: &[P2pMsg],
        abort: &AtomicBool,
    ) -> Result<()> {
        let plan_msgs: Vec<Msg> = msgs
            .iter()
            .map(|m| Msg {
                send: m.send,
                peer: m.peer,
                bytes: m.bytes,
            })
            .collect();
        let mut cur = self.p2p_cur;
        let steps = p2p_plan(self.rank, self.size, &plan_msgs, self.p2p.chunk, &mut cur).map_err(
            |msg| Error::InvalidArgument {
                rank: self.rank,
                op: OP.into(),
                msg,
            },
        )?;
        let cuda = |msg: String| Error::Cuda {
            rank: self.rank,
            op: OP.into(),
            msg: format!("enqueueing over cuda_ipc: {msg}"),
        };
        if self
            .last_stream
            .as_ref()
            .is_some_and(|s| s.cu_stream() != stream.cu_stream())
        {
            // Collectives and batches of one communicator stay in call order on the GPU.
            stream
                .wait(&self.local.done)
                .map_err(|e| cuda(format!("ordering after the previous operation: {e:?}")))?;
        }
        // The pair counters move on whatever happens next: a batch that fails part-way leaves
        // the communicator's device operations unusable anyway (the caller records the error).
        self.p2p_cur = cur;
        self.ops += 1;
        self.last_stream = Some(Arc::clone(stream));
        let copies = Copies {
            stream,
            layout: self.p2p,
            bases: &self.bases,
            rank: self.rank,
        };
        let run = match self.host_barrier.as_deref() {
            Some(ts) => run_steps(&copies, &mut self.host_p2p(ts, stream, abort), &steps, msgs),
            None => run_steps(&copies, &mut self.dev_p2p(stream), &steps, msgs),
        };
        let recorded = self
            .local
            .done
            .record(stream)
            .map_err(|e| cuda(format!("recording the done event: {e:?}")));
        match run {
            Ok(()) => recorded,
            Err(Stop::Cuda(msg)) => Err(cuda(msg)),
            Err(Stop::Wait((code, k))) => Err(self.p2p_error(code, k)),
            Err(Stop::Aborted) => Err(Error::Aborted {
                rank: self.rank,
                reason: "abort() called during a batch of device sends and receives (cuda_ipc); \
                         its received data is undefined"
                    .into(),
            }),
        }
    }

    fn dev_p2p<'a>(&'a self, stream: &'a Arc<CudaStream>) -> DevP2p<'a> {
        DevP2p {
            stream,
            kernels: &self.local.kernels,
            layout: self.p2p,
            bases: &self.bases,
            rank: self.rank,
            dev_error: self.local.scratch + super::exec::DEV_ERROR_OFFSET as u64,
            host_error: self.local.error.device_ptr(),
            timeout_ns: u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX),
        }
    }

    fn host_p2p<'a>(
        &'a self,
        ts: &'a ThreadSync,
        stream: &'a Arc<CudaStream>,
        abort: &'a AtomicBool,
    ) -> HostP2pRun<'a> {
        HostP2pRun {
            stream,
            ts,
            rank: self.rank,
            size: self.size,
            ctx: &self.local.ctx,
            abort,
            timeout: self.timeout,
        }
    }

    /// The error for a p2p wait's error word `code` at chunk `k` of its pair.
    pub(super) fn p2p_error(&self, code: u32, k: u32) -> Error {
        let peer = (code >> 8) as usize;
        let seq = self.ops;
        let at = format!("chunk {k} of the pair's messages");
        match code & 0xff {
            ERR_P2P_MISMATCH => Error::Mismatch {
                rank: self.rank,
                peer,
                seq,
                local: format!(
                    "a receive from rank {peer} whose {at} has another length or ends the \
                     message at another chunk"
                ),
                remote: format!("a send to rank {} of a different length", self.rank),
            },
            ERR_P2P_ABORTED => Error::Aborted {
                rank: self.rank,
                reason: format!(
                    "rank {peer} gave up before publishing {at} (a wait of its own failed; \
                     cuda_ipc send/recv); this batch's received data is undefined"
                ),
            },
            ERR_P2P_ACK_TIMEOUT => Error::Timeout {
                rank: self.rank,
                op: format!("a send to rank {peer} (cuda_ipc)"),
                timeout: self.timeout,
                detail: format!(
                    "rank {peer} did not take {at} out of its inbox: it posted no matching \
                     receive"
                ),
            },
            _ => Error::Timeout {
                rank: self.rank,
                op: format!("a receive from rank {peer} (cuda_ipc)"),
                timeout: self.timeout,
                detail: format!("rank {peer} did not send {at}: it posted no matching send"),
            },
        }
    }
}

/// The flag steps of a batch (waits, posts and acknowledgements), met on the device or on the
/// host; [`run_steps`] does the copies.
trait Flags {
    fn flag(&mut self, step: &P2pStep) -> std::result::Result<(), Stop>;

    /// After a failure, with the steps not run (the failed one first): whatever keeps the peers
    /// from waiting for this rank until their time-out.
    fn give_up(&mut self, rest: &[P2pStep]);
}

/// What the copies of a batch need: the stream, where the inboxes are, and this rank.
struct Copies<'a> {
    stream: &'a Arc<CudaStream>,
    layout: P2pLayout,
    bases: &'a [u64],
    rank: usize,
}

/// Runs `steps` in order: the copies here (into a peer's inbox, out of this rank's, and to
/// this rank itself), every flag step through `flags` (a wait for chunk 0 is nothing).
fn run_steps(
    c: &Copies<'_>,
    flags: &mut impl Flags,
    steps: &[P2pStep],
    msgs: &[P2pMsg],
) -> std::result::Result<(), Stop> {
    let at = |msg: usize, off: usize| msgs[msg].ptr + off as u64;
    for (i, step) in steps.iter().enumerate() {
        let r = match *step {
            P2pStep::Put {
                msg,
                peer,
                ref range,
                k,
            } => {
                let dst = c.layout.inbox(c.bases[peer], c.rank, k);
                copy(c.stream, dst, at(msg, range.start), range.len())
            }
            P2pStep::Take {
                msg,
                peer,
                ref range,
                k,
            } => {
                let src = c.layout.inbox(c.bases[c.rank], peer, k);
                copy(c.stream, at(msg, range.start), src, range.len())
            }
            P2pStep::Local { from, to, len } => copy(c.stream, at(to, 0), at(from, 0), len),
            P2pStep::WaitAck { k: 0, .. } => Ok(()),
            _ => flags.flag(step),
        };
        if let Err(stop) = r {
            flags.give_up(&steps[i..]);
            return Err(stop);
        }
    }
    Ok(())
}

/// A device-to-device copy on `stream` (nothing for an empty one).
fn copy(stream: &CudaStream, dst: u64, src: u64, len: usize) -> std::result::Result<(), Stop> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: the plan addresses the caller's buffers inside their lengths (ranges of the
    // messages the caller checked) and the mapped scratch inside its p2p area (`P2pLayout`:
    // inbox halves of `chunk` bytes, chunks at most that long); the flag waits enqueued before
    // order every copy after the peer's use of the same half (an acknowledgement wait is kept
    // even after a failure, unless that peer stopped taking chunks).
    unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream.cu_stream()) }
        .result()
        .map_err(|e| Stop::Cuda(format!("copy: {e:?}")))
}

/// The steps on a GPU whose stream meets the flags itself.
struct DevP2p<'a> {
    stream: &'a Arc<CudaStream>,
    kernels: &'a CudaKernels,
    layout: P2pLayout,
    bases: &'a [u64],
    rank: usize,
    dev_error: u64,
    host_error: u64,
    timeout_ns: u64,
}

impl DevP2p<'_> {
    fn wait(
        &self,
        word: usize,
        peer: usize,
        kla: (u32, u32, bool),
    ) -> std::result::Result<(), Stop> {
        let addr = self.layout.word(self.bases[self.rank], word);
        // SAFETY: `addr` is a flag word of this rank's scratch (live while the IPC state is);
        // the error words live as long (tear-down waits for the last operation or leaks them).
        unsafe {
            self.kernels.ipc_p2p_wait(
                self.stream,
                addr,
                kla,
                peer,
                self.timeout_ns,
                self.dev_error,
                self.host_error,
            )
        }
        .map_err(|e| Stop::Cuda(e.to_string()))
    }

    fn post(
        &self,
        peer: usize,
        word: usize,
        value: u64,
        poison: bool,
    ) -> std::result::Result<(), Stop> {
        let addr = self.layout.word(self.bases[peer], word);
        // SAFETY: `addr` is a flag word of `peer`'s scratch, mapped here while the IPC state
        // lives; the device error word lives as long.
        unsafe {
            self.kernels
                .ipc_p2p_post(self.stream, addr, value, poison, self.dev_error)
        }
        .map_err(|e| Stop::Cuda(e.to_string()))
    }
}

impl Flags for DevP2p<'_> {
    fn flag(&mut self, step: &P2pStep) -> std::result::Result<(), Stop> {
        let me = self.rank;
        match *step {
            P2pStep::WaitAck { peer, k } => self.wait(ack_word(peer), peer, (k, 0, true)),
            P2pStep::Post { peer, k, tag } => {
                let value = u64::from(tag) << 32 | u64::from(k);
                self.post(peer, ready_word(me, k), value, true)
            }
            P2pStep::WaitReady { peer, k, tag } => {
                self.wait(ready_word(peer, k), peer, (k, tag, false))
            }
            P2pStep::Ack { peer, k } => self.post(peer, ack_word(me), u64::from(k), false),
            P2pStep::Put { .. } | P2pStep::Take { .. } | P2pStep::Local { .. } => Ok(()),
        }
    }

    /// Nothing: a failure here is a CUDA call that did not enqueue, and the kernels already
    /// enqueued poison what this rank publishes after a wait of theirs failed.
    fn give_up(&mut self, _: &[P2pStep]) {}
}

/// The steps with the flags met on the host (every rank a thread of this process).
struct HostP2pRun<'a> {
    stream: &'a Arc<CudaStream>,
    ts: &'a ThreadSync,
    rank: usize,
    size: usize,
    ctx: &'a Arc<cudarc::driver::CudaContext>,
    abort: &'a AtomicBool,
    timeout: Duration,
}

impl HostP2pRun<'_> {
    /// This rank's events, made at its first batch.
    fn own_events(&self) -> std::result::Result<&[[CudaEvent; 2]], Stop> {
        let cell = &self.ts.p2p[self.rank].events;
        if cell.get().is_none() {
            let made: std::result::Result<Vec<[CudaEvent; 2]>, _> = (0..2 * self.size)
                .map(|_| Ok([self.ctx.new_event(None)?, self.ctx.new_event(None)?]))
                .collect();
            let made = made.map_err(|e: cudarc::driver::DriverError| {
                Stop::Cuda(format!("creating the p2p events: {e:?}"))
            })?;
            let _ = cell.set(made);
        }
        Ok(cell.get().map_or(&[], Vec::as_slice))
    }

    /// Peer `q`'s event `i` for half `k % 2` (made before `q` published anything this rank
    /// waited for).
    fn peer_event(&self, q: usize, i: usize, k: u32) -> std::result::Result<&CudaEvent, Stop> {
        self.ts.p2p[q]
            .events
            .get()
            .and_then(|e| e.get(i))
            .map(|e| &e[(k % 2) as usize])
            .ok_or_else(|| Stop::Cuda(format!("rank {q}'s p2p events are missing")))
    }

    /// Waits until this rank's word `w` satisfies `done`, for at most the time-out (and no
    /// longer than `Communicator::abort`'s flag stays clear).
    /// `Err(Some(failed))` at the time-out (`failed` built by `on_timeout`), `Err(None)` when
    /// aborted.
    fn wait(
        &self,
        w: usize,
        done: impl Fn(u64) -> bool,
        on_timeout: Failed,
    ) -> std::result::Result<u64, Stop> {
        let word = &self.ts.p2p[self.rank].flags[w];
        let deadline = Instant::now() + self.timeout;
        let mut backoff = Backoff::new();
        loop {
            let v = word.load(Ordering::Acquire);
            if done(v) {
                return Ok(v);
            }
            if self.abort.load(Ordering::Relaxed) {
                return Err(Stop::Aborted);
            }
            if Instant::now() > deadline {
                return Err(Stop::Wait(on_timeout));
            }
            backoff.pause();
        }
    }

    fn stream_wait(&self, ev: &CudaEvent, what: &str) -> std::result::Result<(), Stop> {
        self.stream
            .wait(ev)
            .map_err(|e| Stop::Cuda(format!("waiting for {what}: {e:?}")))
    }

    fn record(&self, i: usize, k: u32) -> std::result::Result<(), Stop> {
        self.own_events()?[i][(k % 2) as usize]
            .record(self.stream)
            .map_err(|e| Stop::Cuda(format!("recording a p2p event: {e:?}")))
    }
}

impl Flags for HostP2pRun<'_> {
    fn flag(&mut self, step: &P2pStep) -> std::result::Result<(), Stop> {
        let (me, n) = (self.rank, self.size);
        let peer_of = |code: u32, q: usize| code | (q as u32) << 8;
        match *step {
            P2pStep::WaitAck { peer, k } => {
                let acked = |v: u64| (v as u32).wrapping_sub(k) < 1 << 31;
                self.wait(
                    ack_word(peer),
                    acked,
                    (peer_of(ERR_P2P_ACK_TIMEOUT, peer), k),
                )?;
                // Its take of chunk k (the event is recorded again only for chunk k + 2, after
                // this rank publishes it).
                let ev = self.peer_event(peer, n + me, k)?;
                self.stream_wait(ev, &format!("rank {peer}'s take of chunk {k}"))
            }
            P2pStep::Post { peer, k, tag } => {
                self.record(peer, k)?;
                let value = u64::from(tag) << 32 | u64::from(k);
                self.ts.p2p[peer].flags[ready_word(me, k)].store(value, Ordering::Release);
                Ok(())
            }
            P2pStep::WaitReady { peer, k, tag } => {
                let at = (peer_of(ERR_P2P_TIMEOUT, peer), k);
                let v = self.wait(ready_word(peer, k), |v| v as u32 == k, at)?;
                match (v >> 32) as u32 {
                    POISON_TAG => return Err(Stop::Wait((peer_of(ERR_P2P_ABORTED, peer), k))),
                    got if got != tag => {
                        return Err(Stop::Wait((peer_of(ERR_P2P_MISMATCH, peer), k)))
                    }
                    _ => {}
                }
                let ev = self.peer_event(peer, me, k)?;
                self.stream_wait(ev, &format!("rank {peer}'s put of chunk {k}"))
            }
            P2pStep::Ack { peer, k } => {
                self.record(n + peer, k)?;
                self.ts.p2p[peer].flags[ack_word(me)].store(u64::from(k), Ordering::Release);
                Ok(())
            }
            P2pStep::Put { .. } | P2pStep::Take { .. } | P2pStep::Local { .. } => Ok(()),
        }
    }

    /// Tells the peers this rank stopped, so they fail at once rather than at their time-out:
    /// the next chunk it owed each of them, in each half whose previous chunk they already
    /// took, is published with the poison tag (they report that this rank gave up); and every
    /// chunk it was to take from them is acknowledged (their sends then finish into an inbox
    /// nobody reads), its take events recorded first so that their streams have something to
    /// wait for.
    fn give_up(&mut self, rest: &[P2pStep]) {
        let (me, n) = (self.rank, self.size);
        let mut poisoned = vec![[false; 2]; n];
        let mut acks = vec![0u32; n];
        for step in rest {
            match *step {
                P2pStep::Post { peer, k, .. } => {
                    let h = (k % 2) as usize;
                    if poisoned[peer][h] {
                        continue;
                    }
                    poisoned[peer][h] = true;
                    let acked = self.ts.p2p[me].flags[ack_word(peer)].load(Ordering::Acquire);
                    if k <= 2 || (acked as u32).wrapping_sub(k - 2) < 1 << 31 {
                        let value = u64::from(POISON_TAG) << 32 | u64::from(k);
                        self.ts.p2p[peer].flags[ready_word(me, k)].store(value, Ordering::Release);
                    }
                }
                P2pStep::WaitReady { peer, k, .. } | P2pStep::Ack { peer, k } => {
                    acks[peer] = acks[peer].max(k);
                }
                _ => {}
            }
        }
        for (peer, &k) in acks.iter().enumerate().filter(|(_, &k)| k > 0) {
            let recorded = self
                .record(n + peer, 0)
                .and_then(|()| self.record(n + peer, 1));
            if recorded.is_ok() {
                self.ts.p2p[peer].flags[ack_word(me)].store(u64::from(k), Ordering::Release);
            }
        }
    }
}
