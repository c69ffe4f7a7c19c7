//! The steps of a device collective over CUDA IPC, and the driver that runs them: pure code, the
//! same on every rank, tested here without a GPU against a host model of the device protocol.
//!
//! # Memory
//!
//! Every rank owns one **scratch** allocation in device memory that all ranks of the node map
//! (CUDA IPC between processes, the plain pointer between threads of one process):
//!
//! ```text
//! [ flags: FLAGS_BYTES ][ slot 0: slot_bytes ][ slot 1: slot_bytes ]
//! ```
//!
//! A collective copies (part of) its input into its own slot, waits at a **barrier** until every
//! rank has done the same, then reads the other ranks' slots directly: a reduce kernel with one
//! input per rank, or copies. **Ring** plans (all-reduce, reduce-scatter and all-gather with
//! `OXCCL_ALGO=ring`) read only the previous rank's slot instead, in `n - 1` steps per phase
//! with a barrier before each, alternating between the two halves of the chunk's slot: a link
//! carries each byte once per step rather than every rank reading every peer, which suits GPUs
//! joined in a chain (PCIe) better than ranks sharing one GPU or an NVSwitch. Operations larger
//! than a slot run in **chunks**; chunk number `c` (counted over the communicator's life, the
//! same on every rank) uses slot `c % 2`. Every chunk
//! has at least one barrier, and a rank reaches chunk `c`'s barrier only after finishing every
//! read of chunk `c - 1` (stream order), so once a rank has passed chunk `c + 1`'s barrier nobody
//! still reads the slot chunk `c + 2` writes: double buffering by epoch, one barrier per chunk
//! for everything except two-shot reductions (two). A rank writes only its own slot and its own
//! output.
//!
//! # Barrier protocol
//!
//! The flags of rank `q` are `2 x MAX_RANKS` 64-bit words; word `(e % 2) * MAX_RANKS + r` is
//! written by rank `r` only. At its barrier number `e` (counted like chunks), rank `r` stores
//! `(sig << 32) | e` into word `(e % 2) * MAX_RANKS + r` of every rank's flags (system-scope
//! release), then waits (acquire loads) until its own word from each rank `q` holds epoch `e`,
//! and checks that `q`'s `sig` (a hash of the operation, its dtype, root and count, and the slot
//! and one-shot sizes) equals its
//! own: a different collective or length on another rank is reported as a mismatch naming that
//! rank instead of corrupting memory or hanging. Ranks are never more than one barrier apart, so
//! two words per writer suffice. Every wait has a deadline (`OXCCL_TIMEOUT`); a rank that times
//! out (or sees a mismatch, or a poisoned word) sets its error word, writes [`POISON_SIG`] with
//! epochs `e` and `e + 1` into its words of every rank (so a peer that has not yet passed them
//! fails too rather than read a slot this rank will overwrite), and every later barrier of that
//! rank returns at once, so a failed communicator never hangs a stream.

mod layout;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use oxccl_kernels::{DType, ReduceOp};

use crate::base::call::Kind;
use crate::base::tuning::Algorithm;
use layout::{Layout, Shots};

/// Most ranks an IPC communicator may have: one reduce kernel input per rank (the kernels take
/// at most [`oxccl_kernels::cuda::MAX_INPUTS`]), and the barrier's flag words.
pub(crate) const MAX_RANKS: usize = 8;

/// Bytes of the flags at the start of every scratch allocation (2 x [`MAX_RANKS`] words, padded
/// so the slots start 256-byte aligned).
pub(crate) const FLAGS_BYTES: usize = 256;

/// Error word values set by a barrier (low byte; the next byte is the peer's rank): the peer
/// did not arrive in time.
pub(crate) const ERR_TIMEOUT: u32 = 1;
/// The peer arrived with another operation's signature.
pub(crate) const ERR_MISMATCH: u32 = 2;
/// The peer gave up (its barrier failed) and poisoned its flags.
pub(crate) const ERR_ABORTED: u32 = 3;

/// The signature a rank that gave up writes into its flag words for the failed barrier and the
/// next one, so peers that have not passed them fail too instead of reading a slot the failed
/// rank goes on to overwrite. [`ipc_plan`] never produces it.
pub(crate) const POISON_SIG: u32 = u32::MAX;

/// Index of the flag word rank `writer` sets at barrier `epoch` (in the flags of every rank), as
/// `oxccl_ipc_barrier` computes it.
fn flag_index(epoch: u32, writer: usize) -> usize {
    (epoch % 2) as usize * MAX_RANKS + writer
}

/// The value a rank writes at barrier `epoch` of operation `sig`.
fn flag_value(epoch: u32, sig: u32) -> u64 {
    (u64::from(sig) << 32) | u64::from(epoch)
}

/// The barrier protocol above run by a host thread on flags in host memory, for one rank.
///
/// The tests' host model of the GPU uses it in place of the kernel; ranks that are threads of one
/// process use it for real (`OXCCL_CUDA_IPC_BARRIER=host`, see `ipc.rs`): there the flags are
/// host atomics, and stream order across ranks comes from CUDA events, so no kernel spins.
pub(crate) struct HostBarrier<'a> {
    pub rank: usize,
    pub size: usize,
    /// This rank's error word (0 while no barrier failed), as the kernel's.
    pub error: &'a AtomicU32,
    pub deadline: Instant,
    /// Set by `Communicator::abort`: the wait gives up as on a time-out, naming this rank.
    pub abort: Option<&'a AtomicBool>,
}

impl HostBarrier<'_> {
    /// Barrier number `epoch` of operation `sig`: `flag(owner, index)` is word `index` of rank
    /// `owner`'s flags; `pause` runs between polls.
    ///
    /// # Errors
    /// The error word's value (`ERR_* | peer << 8`) if this or an earlier barrier of this rank
    /// failed; on a new failure the word is set and this rank's flags for `epoch` and `epoch + 1`
    /// are poisoned in every rank's flags, as the kernel does.
    pub(crate) fn wait<'f>(
        &self,
        flag: impl Fn(usize, usize) -> &'f AtomicU64,
        epoch: u32,
        sig: u32,
        mut pause: impl FnMut(),
    ) -> Result<(), u32> {
        let err = self.error.load(Ordering::Acquire);
        if err != 0 {
            return Err(err);
        }
        let i = flag_index(epoch, self.rank);
        for q in 0..self.size {
            flag(q, i).store(flag_value(epoch, sig), Ordering::Release);
        }
        let mut code = 0;
        'peers: for q in 0..self.size {
            loop {
                let v = flag(self.rank, flag_index(epoch, q)).load(Ordering::Acquire);
                if v as u32 == epoch {
                    match (v >> 32) as u32 {
                        s if s == sig => break,
                        POISON_SIG => code = ERR_ABORTED | (q as u32) << 8,
                        _ => code = ERR_MISMATCH | (q as u32) << 8,
                    }
                    break 'peers;
                }
                if Instant::now() > self.deadline {
                    code = ERR_TIMEOUT | (q as u32) << 8;
                    break 'peers;
                }
                if self.abort.is_some_and(|a| a.load(Ordering::Relaxed)) {
                    code = ERR_ABORTED | (self.rank as u32) << 8;
                    break 'peers;
                }
                pause();
            }
        }
        if code == 0 {
            return Ok(());
        }
        self.poison(&flag, epoch, code);
        Err(code)
    }

    /// Gives up at barrier `epoch` with error word `code`: this rank's flags for `epoch` and
    /// `epoch + 1` are poisoned in every rank's flags (peers waiting for either fail with
    /// `ERR_ABORTED` naming this rank instead of waiting for their time-out) and later barriers
    /// of this rank fail at once. Also for failures outside the flag protocol (a CUDA call of a
    /// host barrier).
    pub(crate) fn poison<'f>(
        &self,
        flag: &impl Fn(usize, usize) -> &'f AtomicU64,
        epoch: u32,
        code: u32,
    ) {
        for q in 0..self.size {
            for e in [epoch, epoch.wrapping_add(1)] {
                flag(q, flag_index(e, self.rank))
                    .store(flag_value(e, POISON_SIG), Ordering::Release);
            }
        }
        // The first failure's code stays.
        let _ = self
            .error
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// A place in device memory, relative to the buffers of the current chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loc {
    /// The caller's input buffer, at a byte offset.
    In(usize),
    /// The caller's output buffer.
    Out(usize),
    /// Rank `rank`'s slot of the current chunk.
    Slot { rank: usize, off: usize },
}

/// One thing the stream does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// `len` bytes from `src` to `dst` (nothing when both are the same address).
    Copy { dst: Loc, src: Loc, len: usize },
    /// `dst = inputs[0] op inputs[1] op ...` over `len` bytes, in this order on every rank.
    Reduce {
        dst: Loc,
        inputs: Vec<Loc>,
        len: usize,
    },
    /// `dst /= size`: the end of an average.
    Avg { dst: Loc, len: usize },
    /// Every rank of the communicator.
    Barrier,
}

/// A device collective over IPC: its chunks, each the steps of one slot generation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IpcPlan {
    pub chunks: Vec<Vec<Step>>,
    /// Hash of the operation every rank must agree on (checked at each barrier).
    pub sig: u32,
}

/// FNV-1a over the words that identify an operation (never [`POISON_SIG`]).
fn signature(words: &[u64]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for w in words {
        for b in w.to_le_bytes() {
            h ^= u32::from(b);
            h = h.wrapping_mul(0x0100_0193);
        }
    }
    h.min(POISON_SIG - 1)
}

/// Lays out a collective over IPC (`None` for point-to-point operations, which are staged).
///
/// `count` is the operation's common element count: the buffer of all-reduce and broadcast, the
/// output of reduce-scatter and scatter, the input of all-gather, reduce and gather, one block of
/// all-to-all. The arguments must already be checked ([`crate::device::plan::plan`]); `slot_bytes` must
/// hold at least `size` elements and `size <= MAX_RANKS`. `algo` is what `OXCCL_ALGO` asks for
/// this collective: `ring` (all-reduce, reduce-scatter, all-gather), `one-shot` or `two-shot`
/// (all-reduce) choose those plans; anything else (host algorithms) leaves the default.
#[allow(clippy::too_many_arguments)]
pub(crate) fn ipc_plan(
    kind: Kind,
    dt: DType,
    rank: usize,
    size: usize,
    count: usize,
    slot_bytes: usize,
    one_shot_bytes: usize,
    algo: Option<Algorithm>,
) -> Option<IpcPlan> {
    let es = dt.size();
    let op = kind.op();
    let code = match kind {
        Kind::AllReduce(_) => 1,
        Kind::ReduceScatter(_) => 2,
        Kind::AllGather => 3,
        Kind::Broadcast { .. } => 4,
        Kind::Reduce { .. } => 5,
        Kind::Gather { .. } => 6,
        Kind::Scatter { .. } => 7,
        Kind::AllToAll => 8,
        Kind::Send { .. } | Kind::Recv { .. } => return None,
    };
    let avg = op == ReduceOp::Avg;
    let ring = algo == Some(Algorithm::Ring)
        && matches!(
            kind,
            Kind::AllReduce(_) | Kind::ReduceScatter(_) | Kind::AllGather
        );
    let all_reduce = matches!(kind, Kind::AllReduce(_));
    let shots = match algo {
        Some(Algorithm::OneShot) if all_reduce => Shots::One,
        Some(Algorithm::TwoShot) if all_reduce => Shots::Two,
        _ if count * es <= one_shot_bytes => Shots::One,
        _ => Shots::Two,
    };
    // Only reductions and the ring collectives have more than one plan.
    let variant = match kind {
        _ if ring => 2,
        Kind::AllReduce(_) | Kind::Reduce { .. } => shots as u64,
        _ => 0,
    };
    // The layout depends on the slot and one-shot sizes and on the plan chosen too: ranks
    // configured differently must not pair up.
    let sig = signature(&[
        code,
        u64::from(op.to_u8()),
        kind.root() as u64,
        dt as u64,
        count as u64,
        slot_bytes as u64,
        one_shot_bytes as u64,
        variant,
    ]);
    let l = Layout {
        es,
        n: size,
        r: rank,
        count,
        slot_bytes,
    };
    let chunks = match kind {
        Kind::AllReduce(_) if ring => l.ring_all_reduce(avg),
        Kind::ReduceScatter(_) if ring => l.ring_reduce_scatter(avg),
        Kind::AllGather if ring => l.ring_all_gather(),
        Kind::AllReduce(_) => l.reduction(None, shots, avg),
        Kind::Reduce { root, .. } => l.reduction(Some(root), shots, avg),
        Kind::ReduceScatter(_) => l.reduce_scatter(avg),
        Kind::AllGather => l.gather(true),
        Kind::Gather { root } => l.gather(root == rank),
        Kind::Broadcast { root } => l.broadcast(root),
        Kind::Scatter { root } => l.scatter(root),
        Kind::AllToAll => l.all_to_all(),
        Kind::Send { .. } | Kind::Recv { .. } => return None,
    };
    Some(IpcPlan { chunks, sig })
}

/// What a stream can be asked to do, on device addresses (the GPU implementation enqueues; the
/// tests' model does it at once).
pub(crate) trait Exec {
    type Error;
    /// `len` bytes from `src` to `dst` (distinct, non-overlapping ranges).
    fn copy(&mut self, dst: u64, src: u64, len: usize) -> Result<(), Self::Error>;
    /// `dst = inputs[0] op inputs[1] op ...` (`dst` may be one of the inputs).
    fn reduce(&mut self, dst: u64, inputs: &[u64], len: usize) -> Result<(), Self::Error>;
    /// `dst /= size`.
    fn avg(&mut self, dst: u64, len: usize) -> Result<(), Self::Error>;
    /// Barrier number `epoch` of the communicator, for the operation `sig`.
    fn barrier(&mut self, epoch: u32, sig: u32) -> Result<(), Self::Error>;
}

/// The addresses a plan runs on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bases<'a> {
    pub input: u64,
    pub output: u64,
    /// Every rank's scratch allocation, as this rank addresses it.
    pub scratch: &'a [u64],
    pub slot_bytes: usize,
}

/// Where a communicator's IPC operations have got to: barriers and chunks so far (the same on
/// every rank).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Cursor {
    pub epoch: u32,
    pub chunks: u64,
}

/// Runs `plan` through `exec`, advancing `cur`.
///
/// # Errors
/// The first error of `exec`; `cur` then counts what was issued.
pub(crate) fn execute<E: Exec>(
    plan: &IpcPlan,
    b: &Bases<'_>,
    cur: &mut Cursor,
    exec: &mut E,
) -> Result<(), E::Error> {
    for chunk in &plan.chunks {
        let parity = (cur.chunks % 2) as usize;
        cur.chunks += 1;
        let addr = |l: Loc| -> u64 {
            match l {
                Loc::In(o) => b.input + o as u64,
                Loc::Out(o) => b.output + o as u64,
                Loc::Slot { rank, off } => {
                    b.scratch[rank] + (FLAGS_BYTES + parity * b.slot_bytes + off) as u64
                }
            }
        };
        for step in chunk {
            match step {
                Step::Copy { dst, src, len } => {
                    let (d, s) = (addr(*dst), addr(*src));
                    if *len > 0 && d != s {
                        exec.copy(d, s, *len)?;
                    }
                }
                Step::Reduce { dst, inputs, len } => {
                    if *len > 0 {
                        // No allocation per chunk: at most MAX_RANKS inputs.
                        let mut ins = [0u64; MAX_RANKS];
                        for (slot, l) in ins.iter_mut().zip(inputs) {
                            *slot = addr(*l);
                        }
                        exec.reduce(addr(*dst), &ins[..inputs.len()], *len)?;
                    }
                }
                Step::Avg { dst, len } => {
                    if *len > 0 {
                        exec.avg(addr(*dst), *len)?;
                    }
                }
                Step::Barrier => {
                    cur.epoch = cur.epoch.wrapping_add(1);
                    exec.barrier(cur.epoch, plan.sig)?;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
