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

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use oxccl_kernels::{DType, ReduceOp};

use crate::base::call::Kind;
use crate::base::tuning::Algorithm;

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

/// One-shot or two-shot (reduce-scatter in the slots, then gather) for reductions that read
/// every peer at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shots {
    One,
    Two,
}

/// Half `h % 2` of rank `q`'s slot of the current chunk, for ring steps (`half` bytes each).
fn ring_half(q: usize, h: usize, half: usize) -> Loc {
    Loc::Slot {
        rank: q,
        off: (h % 2) * half,
    }
}

/// The ring steps of one chunk of a reduction: every rank's input holds `n` blocks (`block(q)`
/// gives block q's input offset and byte length, each at most `half` bytes), and rank r ends
/// with the reduction of block r in `last` (its output, or its own slot for an all-reduce that
/// goes on to gather). Step k (0..n-1, after a barrier) reduces the previous rank's partial sum
/// of block `r - 1 - k` (in half `k % 2` of its slot) with this rank's own part of that block
/// into half `(k + 1) % 2` of this rank's slot, so after `n - 1` steps rank r holds block r.
fn ring_reduce_steps(
    r: usize,
    n: usize,
    half: usize,
    block: &dyn Fn(usize) -> (usize, usize),
    last: Loc,
    avg: bool,
) -> Vec<Step> {
    let prev = (r + n - 1) % n;
    let at = |q: usize, h: usize| ring_half(q, h, half);
    let (off0, len0) = block((r + n - 1) % n);
    let mut s = vec![Step::Copy {
        dst: at(r, 0),
        src: Loc::In(off0),
        len: len0,
    }];
    for k in 0..n - 1 {
        s.push(Step::Barrier);
        let (off, len) = block((2 * n + r - 2 - k) % n);
        let dst = if k == n - 2 { last } else { at(r, k + 1) };
        s.push(Step::Reduce {
            dst,
            inputs: vec![at(prev, k), Loc::In(off)],
            len,
        });
        if avg && k == n - 2 {
            s.push(Step::Avg { dst, len });
        }
    }
    s
}

/// The ring steps of one chunk of a gather: rank r's own block is in half `first % 2` of its
/// slot, and `out(q)` is where block q goes (its output offset and byte length); step j
/// (0..n-1, after a barrier) copies block `r - 1 - j` from the previous rank's slot to the
/// output and, but for the last step, on into this rank's slot for the next rank.
fn ring_gather_steps(
    r: usize,
    n: usize,
    half: usize,
    first: usize,
    out: &dyn Fn(usize) -> (usize, usize),
) -> Vec<Step> {
    let prev = (r + n - 1) % n;
    let at = |q: usize, h: usize| ring_half(q, h, half);
    let mut s = Vec::new();
    for j in 0..n - 1 {
        s.push(Step::Barrier);
        let (off, len) = out((2 * n + r - 1 - j) % n);
        s.push(Step::Copy {
            dst: Loc::Out(off),
            src: at(prev, first + j),
            len,
        });
        if j < n - 2 {
            s.push(Step::Copy {
                dst: at(r, first + j + 1),
                src: at(prev, first + j),
                len,
            });
        }
    }
    s
}

/// The element range `[start, start + len)` of shard `q` when `elems` are split over `n` ranks
/// (the first `elems % n` shards one longer).
fn shard(elems: usize, n: usize, q: usize) -> (usize, usize) {
    let (base, extra) = (elems / n, elems % n);
    (q * base + q.min(extra), base + usize::from(q < extra))
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
    let (es, n, r) = (dt.size(), size, rank);
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
    // Chunks of `per` elements, where a slot holds `pieces` blocks of a chunk.
    let chunks_of = |pieces: usize| {
        let per = (slot_bytes / (pieces * es)).max(1);
        (0..count)
            .step_by(per)
            .map(move |a| (a * es, (per.min(count - a)) * es))
    };
    let all = |off: usize| (0..n).map(move |q| Loc::Slot { rank: q, off });
    let me = |off: usize| Loc::Slot { rank: r, off };
    // Bytes `[a, a + len)` of each of the `n` input blocks of `block` bytes, side by side in
    // this rank's slot.
    let blocks_in = |block: usize, a: usize, len: usize| -> Vec<Step> {
        (0..n)
            .map(|q| Step::Copy {
                dst: me(q * len),
                src: Loc::In(q * block + a),
                len,
            })
            .collect()
    };
    // Bytes `[a, a + len)` of the input into this rank's slot, then the barrier.
    let slot_in = |a: usize, len: usize| {
        vec![
            Step::Copy {
                dst: me(0),
                src: Loc::In(a),
                len,
            },
            Step::Barrier,
        ]
    };
    // Ring plans: a chunk's blocks fit half a slot each.
    let half_elems = slot_bytes / (2 * es);
    let half = half_elems * es;
    let mut chunks = Vec::new();
    match kind {
        Kind::AllReduce(_) if ring => {
            // Chunks of `n` blocks of at most half a slot: reduce-scatter around the ring, the
            // last step leaving block r in this rank's slot (averaged there), then gather.
            let per = half_elems * n;
            for a in (0..count).step_by(per) {
                let elems = per.min(count - a);
                let block = |q: usize| {
                    let (start, len) = shard(elems, n, q);
                    (a * es + start * es, len * es)
                };
                let fin = ring_half(r, n - 1, half);
                let mut s = ring_reduce_steps(r, n, half, &block, fin, avg);
                let (off, len) = block(r);
                s.push(Step::Copy {
                    dst: Loc::Out(off),
                    src: fin,
                    len,
                });
                s.extend(ring_gather_steps(r, n, half, n - 1, &block));
                chunks.push(s);
            }
        }
        Kind::ReduceScatter(_) if ring => {
            let block_bytes = count * es;
            for a in (0..count).step_by(half_elems) {
                let len = half_elems.min(count - a) * es;
                let block = |q: usize| (q * block_bytes + a * es, len);
                chunks.push(ring_reduce_steps(r, n, half, &block, Loc::Out(a * es), avg));
            }
        }
        Kind::AllGather if ring => {
            let block_bytes = count * es;
            for a in (0..count).step_by(half_elems) {
                let len = half_elems.min(count - a) * es;
                let mut s = vec![
                    Step::Copy {
                        dst: me(0),
                        src: Loc::In(a * es),
                        len,
                    },
                    Step::Copy {
                        dst: Loc::Out(r * block_bytes + a * es),
                        src: Loc::In(a * es),
                        len,
                    },
                ];
                let out = |q: usize| (q * block_bytes + a * es, len);
                s.extend(ring_gather_steps(r, n, half, 0, &out));
                chunks.push(s);
            }
        }
        Kind::AllReduce(_) | Kind::Reduce { .. } => {
            let root = match kind {
                Kind::Reduce { root, .. } => Some(root),
                _ => None,
            };
            let gets_result = root.is_none_or(|root| root == r);
            for (a, len) in chunks_of(1) {
                let mut s = slot_in(a, len);
                match shots {
                    Shots::One => {
                        if gets_result {
                            s.push(Step::Reduce {
                                dst: Loc::Out(a),
                                inputs: all(0).collect(),
                                len,
                            });
                            if avg {
                                s.push(Step::Avg {
                                    dst: Loc::Out(a),
                                    len,
                                });
                            }
                        }
                    }
                    Shots::Two => {
                        let elems = len / es;
                        let (start, mine) = shard(elems, n, r);
                        let (off, bytes) = (start * es, mine * es);
                        if bytes > 0 {
                            s.push(Step::Reduce {
                                dst: me(off),
                                inputs: all(off).collect(),
                                len: bytes,
                            });
                            if avg {
                                s.push(Step::Avg {
                                    dst: me(off),
                                    len: bytes,
                                });
                            }
                        }
                        s.push(Step::Barrier);
                        if gets_result {
                            for q in 0..n {
                                let (start, m) = shard(elems, n, q);
                                if m > 0 {
                                    s.push(Step::Copy {
                                        dst: Loc::Out(a + start * es),
                                        src: Loc::Slot {
                                            rank: q,
                                            off: start * es,
                                        },
                                        len: m * es,
                                    });
                                }
                            }
                        }
                    }
                }
                chunks.push(s);
            }
        }
        Kind::ReduceScatter(_) => {
            let block = count * es;
            for (a, len) in chunks_of(n) {
                let mut s = blocks_in(block, a, len);
                s.push(Step::Barrier);
                s.push(Step::Reduce {
                    dst: Loc::Out(a),
                    inputs: all(r * len).collect(),
                    len,
                });
                if avg {
                    s.push(Step::Avg {
                        dst: Loc::Out(a),
                        len,
                    });
                }
                chunks.push(s);
            }
        }
        Kind::AllGather | Kind::Gather { .. } => {
            let block = count * es;
            let takes = match kind {
                Kind::Gather { root } => root == r,
                _ => true,
            };
            for (a, len) in chunks_of(1) {
                let mut s = slot_in(a, len);
                if takes {
                    s.extend((0..n).map(|q| Step::Copy {
                        dst: Loc::Out(q * block + a),
                        src: Loc::Slot { rank: q, off: 0 },
                        len,
                    }));
                }
                chunks.push(s);
            }
        }
        Kind::Broadcast { root } => {
            for (a, len) in chunks_of(1) {
                let mut s = Vec::new();
                if r == root {
                    s.push(Step::Copy {
                        dst: me(0),
                        src: Loc::In(a),
                        len,
                    });
                }
                s.push(Step::Barrier);
                s.push(Step::Copy {
                    dst: Loc::Out(a),
                    src: if r == root {
                        Loc::In(a)
                    } else {
                        Loc::Slot { rank: root, off: 0 }
                    },
                    len,
                });
                chunks.push(s);
            }
        }
        Kind::Scatter { root } => {
            let block = count * es;
            for (a, len) in chunks_of(n) {
                let mut s = Vec::new();
                if r == root {
                    s = blocks_in(block, a, len);
                }
                s.push(Step::Barrier);
                s.push(Step::Copy {
                    dst: Loc::Out(a),
                    src: Loc::Slot {
                        rank: root,
                        off: r * len,
                    },
                    len,
                });
                chunks.push(s);
            }
        }
        Kind::AllToAll => {
            let block = count * es;
            for (a, len) in chunks_of(n) {
                let mut s = blocks_in(block, a, len);
                s.push(Step::Barrier);
                s.extend((0..n).map(|q| Step::Copy {
                    dst: Loc::Out(q * block + a),
                    src: Loc::Slot {
                        rank: q,
                        off: r * len,
                    },
                    len,
                }));
                chunks.push(s);
            }
        }
        Kind::Send { .. } | Kind::Recv { .. } => return None,
    }
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
mod tests {
    //! The plans run on a host model of the GPU: every rank a thread, its scratch a host
    //! allocation the other threads read through raw addresses, as kernels read IPC mappings,
    //! and the barrier the same flag protocol as the CUDA kernel (`oxccl_ipc_barrier`), with
    //! atomics. Ranks run concurrently and unsynchronised except by those barriers, so a plan
    //! that read a slot before its writer passed the barrier, or reused a slot too early, would
    //! give wrong results here.

    use super::*;
    use proptest::prelude::*;
    use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// One rank's view of the model GPU.
    struct Model<'a> {
        rank: usize,
        size: usize,
        dt: DType,
        op: ReduceOp,
        scratch: &'a [u64],
        error: &'a AtomicU32,
        timeout: Duration,
    }

    impl Model<'_> {
        fn flag(&self, owner: usize, index: usize) -> &AtomicU64 {
            let addr = self.scratch[owner] as usize + index * 8;
            // SAFETY: every scratch allocation starts with FLAGS_BYTES of u64-aligned flags that
            // live as long as the test's world; they are accessed only atomically.
            unsafe { AtomicU64::from_ptr(addr as *mut u64) }
        }
    }

    impl Exec for Model<'_> {
        type Error = u32;
        fn copy(&mut self, dst: u64, src: u64, len: usize) -> Result<(), u32> {
            // SAFETY: both are live ranges of this world's buffers; the plan keeps writers and
            // readers apart with barriers (which is what these tests check).
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
            Ok(())
        }
        fn reduce(&mut self, dst: u64, inputs: &[u64], len: usize) -> Result<(), u32> {
            // SAFETY: as for `copy`.
            let read = |a: u64| unsafe { std::slice::from_raw_parts(a as *const u8, len) }.to_vec();
            let mut acc = read(inputs[0]);
            for &i in &inputs[1..] {
                oxccl_kernels::reduce_bytes(self.dt, self.op, &mut acc, &read(i)).unwrap();
            }
            self.copy(dst, acc.as_ptr() as u64, len)
        }
        fn avg(&mut self, dst: u64, len: usize) -> Result<(), u32> {
            // SAFETY: as for `copy`; only this rank touches its averaged range here.
            let d = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
            oxccl_kernels::finish_avg_bytes(self.dt, d, self.size).unwrap();
            Ok(())
        }
        fn barrier(&mut self, epoch: u32, sig: u32) -> Result<(), u32> {
            let this = &*self;
            let at = HostBarrier {
                rank: this.rank,
                size: this.size,
                error: this.error,
                deadline: Instant::now() + this.timeout,
                abort: None,
            };
            at.wait(
                |owner, i| this.flag(owner, i),
                epoch,
                sig,
                std::thread::yield_now,
            )
        }
    }

    /// Flags of `n` ranks in host memory, as `ThreadSync` keeps them.
    fn host_flags(n: usize) -> Vec<Vec<AtomicU64>> {
        (0..n)
            .map(|_| (0..2 * MAX_RANKS).map(|_| AtomicU64::new(0)).collect())
            .collect()
    }

    #[test]
    fn cuda_ipc_host_barrier_gives_up_on_abort_and_its_peers_follow() {
        let flags = host_flags(2);
        let errors = [AtomicU32::new(0), AtomicU32::new(0)];
        let abort = AtomicBool::new(false);
        let flag = |q: usize, i: usize| &flags[q][i];
        let at = |rank: usize, abort: Option<&'static AtomicBool>| HostBarrier {
            rank,
            size: 2,
            error: &errors[rank],
            deadline: Instant::now() + Duration::from_secs(30),
            abort,
        };
        // Rank 0 never comes: rank 1 waits until its abort flag is set, not for 30 s.
        let started = Instant::now();
        let r = std::thread::scope(|sc| {
            let h = sc.spawn(|| {
                let at1 = HostBarrier {
                    abort: Some(&abort),
                    ..at(1, None)
                };
                at1.wait(flag, 1, 7, std::thread::yield_now)
            });
            std::thread::sleep(Duration::from_millis(50));
            abort.store(true, Ordering::Relaxed);
            h.join().unwrap()
        });
        let by_1 = Err(ERR_ABORTED | 1 << 8);
        assert_eq!(r, by_1);
        assert!(started.elapsed() < Duration::from_secs(20));
        // Rank 0, arriving late at the same barrier, finds rank 1's poison and names it.
        assert_eq!(at(0, None).wait(flag, 1, 7, std::thread::yield_now), by_1);
        // Rank 1's later barriers fail at once with its first code.
        assert_eq!(at(1, None).wait(flag, 2, 7, std::thread::yield_now), by_1);
    }

    #[test]
    fn cuda_ipc_host_barrier_poisoned_after_passing_stops_the_peer_at_the_next_one() {
        // A CUDA call failing after rank 1 passed barrier 1 (its stream wait on a peer's event):
        // rank 0 must fail at barrier 2 naming rank 1 instead of waiting for its time-out.
        let flags = host_flags(2);
        let errors = [AtomicU32::new(0), AtomicU32::new(0)];
        let flag = |q: usize, i: usize| &flags[q][i];
        let at = |rank: usize| HostBarrier {
            rank,
            size: 2,
            error: &errors[rank],
            deadline: Instant::now() + Duration::from_secs(30),
            abort: None,
        };
        std::thread::scope(|sc| {
            let h = sc.spawn(|| at(1).wait(flag, 1, 7, std::thread::yield_now));
            assert_eq!(at(0).wait(flag, 1, 7, std::thread::yield_now), Ok(()));
            assert_eq!(h.join().unwrap(), Ok(()));
        });
        let code = ERR_ABORTED | 1 << 8;
        at(1).poison(&flag, 1, code);
        let started = Instant::now();
        assert_eq!(at(0).wait(flag, 2, 7, std::thread::yield_now), Err(code));
        assert!(started.elapsed() < Duration::from_secs(20));
        assert_eq!(errors[1].load(Ordering::Relaxed), code);
    }

    /// A call of one rank: the operation, its input and its output length (elements).
    #[derive(Clone)]
    struct Call {
        kind: Kind,
        count: usize,
        input: Vec<i32>,
        out_len: usize,
        in_place: bool,
        /// Sleep before the call.
        delay: Duration,
    }

    /// Runs every rank's calls in order on the model; returns each rank's output of every call,
    /// or the error word of its failed barrier.
    fn run_world(
        size: usize,
        slot_bytes: usize,
        one_shot: usize,
        algo: Option<Algorithm>,
        calls: impl Fn(usize) -> Vec<Call> + Sync,
        timeout: impl Fn(usize) -> Duration + Sync,
    ) -> Vec<Vec<Result<Vec<i32>, u32>>> {
        let scratch: Vec<Vec<u64>> = (0..size)
            .map(|_| vec![0u64; (FLAGS_BYTES + 2 * slot_bytes).div_ceil(8)])
            .collect();
        let bases: Vec<u64> = scratch.iter().map(|s| s.as_ptr() as u64).collect();
        let errors: Vec<AtomicU32> = (0..size).map(|_| AtomicU32::new(0)).collect();
        let bases = Arc::new(bases);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..size)
                .map(|rank| {
                    let (bases, errors, calls, timeout) =
                        (Arc::clone(&bases), &errors, &calls, &timeout);
                    s.spawn(move || {
                        let mut cur = Cursor::default();
                        let mut outs = Vec::new();
                        for call in calls(rank) {
                            std::thread::sleep(call.delay);
                            let mut input = call.input.clone();
                            let mut out = if call.in_place {
                                Vec::new()
                            } else {
                                vec![-7i32; call.out_len]
                            };
                            let plan = ipc_plan(
                                call.kind,
                                DType::I32,
                                rank,
                                size,
                                call.count,
                                slot_bytes,
                                one_shot,
                                algo,
                            )
                            .expect("a collective");
                            let (input_addr, output_addr) = if call.in_place {
                                let p = input.as_mut_ptr() as u64;
                                (p, p)
                            } else {
                                (input.as_ptr() as u64, out.as_mut_ptr() as u64)
                            };
                            let b = Bases {
                                input: input_addr,
                                output: output_addr,
                                scratch: &bases,
                                slot_bytes,
                            };
                            let mut m = Model {
                                rank,
                                size,
                                dt: DType::I32,
                                op: call.kind.op(),
                                scratch: &bases,
                                error: &errors[rank],
                                timeout: timeout(rank),
                            };
                            let r = execute(&plan, &b, &mut cur, &mut m);
                            outs.push(r.map(|()| if call.in_place { input } else { out }));
                        }
                        outs
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn data(rank: usize, n: usize, salt: usize) -> Vec<i32> {
        (0..n)
            .map(|i| ((rank * 7919 + i * 31 + salt * 131) % 2001) as i32 - 1000)
            .collect()
    }

    /// The serial reference of one call, from every rank's input.
    fn reference(
        kind: Kind,
        rank: usize,
        size: usize,
        count: usize,
        inputs: &[Vec<i32>],
    ) -> Vec<i32> {
        let red = |op: ReduceOp, f: &dyn Fn(usize) -> usize, len: usize| -> Vec<i32> {
            (0..len)
                .map(|i| {
                    let vals: Vec<i32> = (0..size).map(|q| inputs[q][f(i)]).collect();
                    oxccl_kernels::reference_reduce(&vals, op)
                })
                .collect()
        };
        match kind {
            Kind::AllReduce(op) => red(op, &|i| i, count),
            Kind::Reduce { op, .. } => red(op, &|i| i, count),
            Kind::ReduceScatter(op) => red(op, &|i| rank * count + i, count),
            Kind::AllGather | Kind::Gather { .. } => inputs.concat(),
            Kind::Broadcast { root } => inputs[root].clone(),
            Kind::Scatter { root } => inputs[root][rank * count..(rank + 1) * count].to_vec(),
            Kind::AllToAll => (0..size)
                .flat_map(|q| inputs[q][rank * count..(rank + 1) * count].to_vec())
                .collect(),
            Kind::Send { .. } | Kind::Recv { .. } => unreachable!(),
        }
    }

    /// Input and output lengths of `kind` on `rank` (0 where the rank has no such buffer).
    fn lengths(kind: Kind, rank: usize, size: usize, count: usize) -> (usize, usize) {
        match kind {
            Kind::AllReduce(_) | Kind::Broadcast { .. } => (count, count),
            Kind::Reduce { root, .. } => (count, if rank == root { count } else { 0 }),
            Kind::ReduceScatter(_) => (count * size, count),
            Kind::AllGather => (count, count * size),
            Kind::Gather { root } => (count, if rank == root { count * size } else { 0 }),
            Kind::Scatter { root } => (if rank == root { count * size } else { 0 }, count),
            Kind::AllToAll => (count * size, count * size),
            Kind::Send { .. } | Kind::Recv { .. } => unreachable!(),
        }
    }

    fn kinds(size: usize) -> Vec<Kind> {
        let last = size - 1;
        vec![
            Kind::AllReduce(ReduceOp::Sum),
            Kind::AllReduce(ReduceOp::Max),
            Kind::AllReduce(ReduceOp::Avg),
            Kind::ReduceScatter(ReduceOp::Sum),
            Kind::ReduceScatter(ReduceOp::Min),
            Kind::AllGather,
            Kind::Broadcast { root: last },
            Kind::Reduce {
                op: ReduceOp::Sum,
                root: last,
            },
            Kind::Reduce {
                op: ReduceOp::Prod,
                root: 0,
            },
            Kind::Gather { root: last },
            Kind::Scatter { root: 0 },
            Kind::AllToAll,
        ]
    }

    /// Every collective, back to back on one communicator, against the serial reference.
    fn check_world(
        size: usize,
        counts: &[usize],
        slot_bytes: usize,
        one_shot: usize,
        algo: Option<Algorithm>,
    ) {
        let mut script: Vec<(Kind, usize, bool)> = Vec::new();
        for (salt, &count) in counts.iter().enumerate() {
            for kind in kinds(size) {
                let in_place_ok = matches!(kind, Kind::AllReduce(_) | Kind::Broadcast { .. });
                script.push((kind, count, in_place_ok && salt % 2 == 1));
            }
        }
        let input_of = |rank: usize, i: usize| {
            let (kind, count, _) = script[i];
            let (ni, _) = lengths(kind, rank, size, count);
            data(rank, ni, i)
        };
        let results = run_world(
            size,
            slot_bytes,
            one_shot,
            algo,
            |rank| {
                script
                    .iter()
                    .enumerate()
                    .map(|(i, &(kind, count, in_place))| Call {
                        kind,
                        count,
                        input: input_of(rank, i),
                        out_len: lengths(kind, rank, size, count).1,
                        in_place,
                        delay: Duration::ZERO,
                    })
                    .collect()
            },
            |_| Duration::from_secs(20),
        );
        for (rank, outs) in results.into_iter().enumerate() {
            for (i, (&(kind, count, in_place), got)) in script.iter().zip(outs).enumerate() {
                let got = got.unwrap_or_else(|e| panic!("size {size} rank {rank}: error {e:#x}"));
                let (_, no) = lengths(kind, rank, size, count);
                if no == 0 {
                    continue;
                }
                let inputs: Vec<Vec<i32>> = (0..size).map(|q| input_of(q, i)).collect();
                let full: Vec<Vec<i32>> = match kind {
                    // Every rank's full input, for the reference (non-roots pass none).
                    Kind::Broadcast { root } | Kind::Scatter { root } => (0..size)
                        .map(|q| {
                            if q == root {
                                inputs[q].clone()
                            } else {
                                Vec::new()
                            }
                        })
                        .collect(),
                    _ => inputs,
                };
                let want = reference(kind, rank, size, count, &full);
                assert_eq!(
                    got, want,
                    "size {size} rank {rank} call {i} {kind:?} count {count} in_place {in_place} \
                     algo {algo:?}"
                );
            }
        }
    }

    #[test]
    fn cuda_ipc_plans_compute_every_collective() {
        // Slots of 24 bytes: 6 i32, so most calls run in several chunks of both parities;
        // one-shot up to 16 bytes, two-shot above (with empty shards at 5 elements over 4+).
        for size in 2..=5 {
            check_world(size, &[1, 4, 5, 13, 40], 24 * size, 16, None);
        }
        // Larger slots, everything one-shot.
        check_world(3, &[0, 7, 300], 4096, 1 << 20, None);
        check_world(8, &[3, 100], 256, 64, None);
    }

    #[test]
    fn cuda_ipc_ring_and_forced_shots_compute_every_collective() {
        // OXCCL_ALGO=ring: ring steps for all-reduce, reduce-scatter and all-gather (the rest
        // keep their plans, interleaved on the same communicator); slots of 2..=5 ranks' worth,
        // so blocks of one or two elements per half slot and many chunks, and odd slot sizes.
        for size in 2..=5 {
            check_world(
                size,
                &[1, 4, 5, 13, 40],
                8 * size,
                16,
                Some(Algorithm::Ring),
            );
            check_world(size, &[0, 3, 29], 4 * size + 4, 16, Some(Algorithm::Ring));
        }
        check_world(8, &[3, 100, 1000], 256, 64, Some(Algorithm::Ring));
        // Forced one-shot above the one-shot size, two-shot below it.
        check_world(3, &[1, 13, 40], 24, 16, Some(Algorithm::OneShot));
        check_world(4, &[1, 13, 40], 32, 1 << 20, Some(Algorithm::TwoShot));
        // A host-only algorithm leaves the default plans.
        check_world(3, &[1, 13, 40], 24, 16, Some(Algorithm::Tree));
    }

    #[test]
    fn cuda_ipc_ring_plans_read_only_the_previous_rank() {
        for size in 2..=8 {
            for count in [1usize, 5, 9, 50] {
                for kind in [
                    Kind::AllReduce(ReduceOp::Sum),
                    Kind::ReduceScatter(ReduceOp::Sum),
                    Kind::AllGather,
                ] {
                    for rank in 0..size {
                        let p = ipc_plan(
                            kind,
                            DType::I32,
                            rank,
                            size,
                            count,
                            8 * size,
                            32,
                            Some(Algorithm::Ring),
                        )
                        .unwrap();
                        let prev = (rank + size - 1) % size;
                        let reads = p.chunks.iter().flatten().flat_map(|s| match s {
                            Step::Copy { src, .. } => vec![*src],
                            Step::Reduce { inputs, .. } => inputs.clone(),
                            _ => Vec::new(),
                        });
                        for l in reads {
                            if let Loc::Slot { rank: q, .. } = l {
                                assert!(q == prev || q == rank, "{kind:?} rank {rank} reads {q}");
                            }
                        }
                        // n - 1 barriers per phase.
                        let phases = if matches!(kind, Kind::AllReduce(_)) {
                            2
                        } else {
                            1
                        };
                        for c in &p.chunks {
                            let bars = c.iter().filter(|s| **s == Step::Barrier).count();
                            assert_eq!(bars, phases * (size - 1), "{kind:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn cuda_ipc_ranks_with_different_plans_for_one_call_are_a_mismatch() {
        // Rank 1 runs OXCCL_ALGO=ring, the others the default: same call, different layout.
        let sig = |algo| {
            ipc_plan(
                Kind::AllReduce(ReduceOp::Sum),
                DType::I32,
                0,
                3,
                40,
                64,
                16,
                algo,
            )
            .unwrap()
            .sig
        };
        assert_ne!(sig(Some(Algorithm::Ring)), sig(None));
        assert_ne!(sig(Some(Algorithm::OneShot)), sig(None));
        assert_eq!(
            sig(Some(Algorithm::TwoShot)),
            sig(None),
            "40 elements are two-shot anyway"
        );
        assert_eq!(sig(Some(Algorithm::Tree)), sig(None));
    }

    #[test]
    fn cuda_ipc_two_shot_splits_shards_evenly_and_covers_everything() {
        for elems in 0..30 {
            for n in 1..=8 {
                let mut next = 0;
                for q in 0..n {
                    let (s, l) = shard(elems, n, q);
                    assert_eq!(s, next);
                    assert!(l == elems / n || l == elems / n + 1);
                    next += l;
                }
                assert_eq!(next, elems);
            }
        }
    }

    #[test]
    fn cuda_ipc_plans_keep_to_their_slot_and_buffers() {
        // Every slot access of every plan lies inside the slot, and every rank writes only its
        // own slot and output (the invariant double buffering rests on).
        let slot = 96;
        for size in 2..=8 {
            for count in [1usize, 3, 8, 9, 50] {
                for kind in kinds(size) {
                    for rank in 0..size {
                        for algo in [None, Some(Algorithm::Ring)] {
                            let p = ipc_plan(kind, DType::I32, rank, size, count, slot, 32, algo)
                                .unwrap();
                            let ring = algo.is_some()
                                && matches!(
                                    kind,
                                    Kind::AllReduce(_) | Kind::ReduceScatter(_) | Kind::AllGather
                                );
                            let (ni, no) = lengths(kind, rank, size, count);
                            let check = |l: Loc, len: usize, write: bool| match l {
                                Loc::In(o) => assert!(!write && o + len <= ni * 4),
                                Loc::Out(o) => assert!(o + len <= no * 4, "{kind:?} {o}+{len}"),
                                Loc::Slot { rank: q, off } => {
                                    assert!(off + len <= slot, "{kind:?} slot {off}+{len}");
                                    assert!(!write || q == rank, "{kind:?} writes rank {q}'s slot");
                                }
                            };
                            for chunk in &p.chunks {
                                assert!(chunk.contains(&Step::Barrier));
                                for s in chunk {
                                    match s {
                                        Step::Copy { dst, src, len } => {
                                            check(*src, *len, false);
                                            check(*dst, *len, true);
                                        }
                                        Step::Reduce { dst, inputs, len } => {
                                            assert!(inputs.len() == if ring { 2 } else { size });
                                            inputs.iter().for_each(|i| check(*i, *len, false));
                                            check(*dst, *len, true);
                                        }
                                        Step::Avg { dst, len } => check(*dst, *len, true),
                                        Step::Barrier => {}
                                    }
                                }
                            }
                            // Every rank has the same number of barriers in every chunk.
                            let bars = |rank: usize| -> Vec<usize> {
                                ipc_plan(kind, DType::I32, rank, size, count, slot, 32, algo)
                                    .unwrap()
                                    .chunks
                                    .iter()
                                    .map(|c| c.iter().filter(|s| **s == Step::Barrier).count())
                                    .collect()
                            };
                            assert_eq!(bars(rank), bars(0), "{kind:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn cuda_ipc_mismatched_calls_are_reported_with_the_peer() {
        // Rank 1 all-gathers 4 elements where the others all-reduce 4: the first barrier sees
        // a different signature, and every rank stops instead of hanging.
        let results = run_world(
            3,
            64,
            64,
            None,
            |rank| {
                let kind = if rank == 1 {
                    Kind::AllGather
                } else {
                    Kind::AllReduce(ReduceOp::Sum)
                };
                let (ni, no) = lengths(kind, rank, 3, 4);
                vec![Call {
                    kind,
                    count: 4,
                    input: data(rank, ni, 0),
                    out_len: no,
                    in_place: false,
                    delay: Duration::ZERO,
                }]
            },
            |_| Duration::from_secs(20),
        );
        let first = |r: &Vec<Result<Vec<i32>, u32>>| r[0].clone().expect_err("a failure");
        // Whoever saw it first reports the mismatch itself.
        assert!(results.iter().any(|r| first(r) & 0xff == ERR_MISMATCH));
        for (rank, r) in results.into_iter().enumerate() {
            let e = r[0].clone().expect_err("a mismatch");
            // A mismatch names a rank that called something else; otherwise the rank found the
            // poison of one that had already seen the mismatch.
            let peer = (e >> 8) as usize;
            match e & 0xff {
                ERR_MISMATCH if rank == 1 => assert_ne!(peer, 1),
                ERR_MISMATCH => assert_eq!(peer, 1, "rank {rank} names the odd rank"),
                ERR_ABORTED => assert_ne!(peer, rank),
                _ => panic!("rank {rank}: {e:#x}"),
            }
        }
        // Same operation, different lengths: also a mismatch.
        let results = run_world(
            2,
            64,
            64,
            None,
            |rank| {
                let count = 4 + rank;
                vec![Call {
                    kind: Kind::AllReduce(ReduceOp::Sum),
                    count,
                    input: data(rank, count, 0),
                    out_len: count,
                    in_place: false,
                    delay: Duration::ZERO,
                }]
            },
            |_| Duration::from_secs(20),
        );
        assert!(results.iter().any(|r| first(r) & 0xff == ERR_MISMATCH));
        for r in results {
            let e = r[0].clone().expect_err("a mismatch") & 0xff;
            assert!([ERR_MISMATCH, ERR_ABORTED].contains(&e), "{e:#x}");
        }
    }

    #[test]
    fn cuda_ipc_missing_rank_times_out_naming_it() {
        // Rank 2 makes no call: the others time out at their first barrier, naming rank 2, and
        // their second call fails with the same error word.
        let results = run_world(
            3,
            64,
            64,
            None,
            |rank| {
                if rank == 2 {
                    return Vec::new();
                }
                (0..2)
                    .map(|i| Call {
                        kind: Kind::AllReduce(ReduceOp::Sum),
                        count: 4,
                        input: data(rank, 4, i),
                        out_len: 4,
                        in_place: false,
                        delay: Duration::ZERO,
                    })
                    .collect()
            },
            |_| Duration::from_millis(300),
        );
        // Rank 0 and 1 each time out on rank 2, or one of them first and the other then sees its
        // poison.
        for (rank, r) in results[..2].iter().enumerate() {
            assert_eq!(r.len(), 2);
            let first = r[0].clone().expect_err("a failure");
            let other = 1 - rank as u32;
            assert!(
                first == ERR_TIMEOUT | (2 << 8) || first == ERR_ABORTED | (other << 8),
                "rank {rank}: {first:#x}"
            );
            assert_eq!(
                r[1],
                Err(first),
                "rank {rank}: later calls fail with the same word"
            );
        }
        assert!(results[2].is_empty());
    }

    #[test]
    fn cuda_ipc_a_rank_that_gives_up_makes_its_peers_fail_too() {
        // Rank 1 times out at once while rank 2 is late: rank 1 poisons its flags, so rank 0
        // (patient) and rank 2 (late) fail instead of reading its slot.
        let results = run_world(
            3,
            64,
            64,
            None,
            |rank| {
                vec![Call {
                    kind: Kind::AllReduce(ReduceOp::Sum),
                    count: 4,
                    input: data(rank, 4, 0),
                    out_len: 4,
                    in_place: false,
                    delay: Duration::from_millis(if rank == 2 { 300 } else { 0 }),
                }]
            },
            |rank| Duration::from_millis(if rank == 1 { 20 } else { 20_000 }),
        );
        assert_eq!(results[1][0], Err(ERR_TIMEOUT | (2 << 8)));
        // Rank 2 finds rank 1's poison. Rank 0 finds it too, or finds rank 2's; or it read both
        // peers' words before either gave up, and then every slot it reads holds this call's
        // data (a rank that gave up overwrites its slot only in a later chunk, behind a barrier
        // rank 0 has not passed), so its result must be the right one.
        assert_eq!(results[2][0], Err(ERR_ABORTED | (1 << 8)));
        match &results[0][0] {
            Err(e0) => assert!(
                *e0 == ERR_ABORTED | (1 << 8) || *e0 == ERR_ABORTED | (2 << 8),
                "{e0:#x}"
            ),
            Ok(got) => {
                let inputs: Vec<Vec<i32>> = (0..3).map(|q| data(q, 4, 0)).collect();
                let want = reference(Kind::AllReduce(ReduceOp::Sum), 0, 3, 4, &inputs);
                assert_eq!(
                    got, &want,
                    "rank 0 passed its barrier: its result must be right"
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        #[test]
        fn cuda_ipc_plans_match_the_reference_for_any_shape(
            size in 2usize..=6,
            counts in prop::collection::vec(0usize..60, 1..4),
            slot_elems in 1usize..20,
            one_shot in 0usize..200,
        ) {
            // Slots must hold one element per rank (the configuration guarantees it).
            check_world(size, &counts, (slot_elems * 4).max(size * 4), one_shot, None);
        }

        #[test]
        fn cuda_ipc_ring_plans_match_the_reference_for_any_shape(
            size in 2usize..=6,
            counts in prop::collection::vec(0usize..60, 1..4),
            slot_elems in 1usize..20,
        ) {
            check_world(size, &counts, (slot_elems * 4).max(size * 4), 64, Some(Algorithm::Ring));
        }
    }
}
