//! One exchange on the wire, run by the pipeline's exchange thread: the schedule's batch of
//! operations, in one round when both ends of every link already know its shapes, in four when
//! some changed.
//!
//! 1. **header and payload**: per message a header of three words (the fingerprint of its
//!    dtypes and shapes, the length of the new shapes that follow or 0, the payload's bytes),
//!    then each tensor's bytes as one operation, received straight into a tensor of the shapes
//!    last accepted on this link (for this direction and chunk). When the shapes changed the
//!    sender sends tensors of the old shapes here instead (zeros, discarded), so that both
//!    ends always post the same operations without asking each other first; a link's first
//!    message has no old shapes and sends its header alone;
//! 2. **shapes**, only for the messages whose shapes changed: the encoded dtypes and shapes;
//! 3. **verdict**, for the same messages: the receiver's check of the new shapes, sent back,
//!    so that a refusal is an error on both ends ([`super::shapes`]);
//! 4. **payload** of those messages, in their new shapes.
//!
//! A steady pipeline pays one round per exchange, as a plain batch of sends and receives.
//! Received tensors reuse the storage of tensors this rank sent before (a pool by size).

use std::collections::HashMap;
use std::sync::Arc;

use oxccl_comm::{Communicator, P2pOp};

use super::place::Place;
use crate::error::{dir_name, PipelineError};
use crate::schedule::{Dir, Op};
use crate::tensor::{encoded_len, fingerprint, Meta, Storage, Tensor};

/// A receiver's check of new shapes: `(direction, its chunk, shapes)`; `Err(why)` refuses them.
pub type Check = Arc<dyn Fn(Dir, usize, &[Meta]) -> Result<(), String> + Send + Sync>;

/// An exchange to run: the schedule's operations and, for each send, its tensors.
pub(crate) struct Job {
    pub ops: Vec<Op>,
    pub sends: Vec<Vec<Tensor>>,
}

/// Tensors received for a consumer: (direction, micro-batch, this rank's chunk).
pub(crate) type Key = (Dir, usize, usize);

/// What an exchange gives back: the tensors it received, by consumer.
pub(crate) type Done = Result<Vec<(Key, Vec<Tensor>)>, PipelineError>;

/// Bytes of sent tensors kept for reuse, at most.
const POOL_BYTES: usize = 1 << 30;

/// What each link last carried, on both ends: the sender's and the receiver's view agree, so
/// both post the same operations.
#[derive(Default)]
pub(crate) struct Caches {
    /// (peer, direction, this rank's producing chunk) -> the shapes last accepted.
    pub(super) sent: HashMap<(usize, Dir, usize), Vec<Meta>>,
    /// (peer, direction, this rank's consuming chunk) -> fingerprint and shapes last accepted.
    pub(super) taken: HashMap<(usize, Dir, usize), (u64, Vec<Meta>)>,
    /// Storage of sent tensors, for the next receives, by place and length (words on the
    /// host, bytes on a device): at most `pool_cap` per size (the messages of a step) and
    /// [`POOL_BYTES`] in all.
    pool: HashMap<(bool, usize), Vec<Storage>>,
    pool_bytes: usize,
    pool_cap: usize,
    /// Shapes sent or accepted, in all.
    pub(crate) meta_rounds: u64,
}

impl Caches {
    /// Empty caches, pooling at most `pool_cap` buffers of a size.
    pub(crate) fn new(pool_cap: usize) -> Caches {
        Caches {
            pool_cap,
            ..Caches::default()
        }
    }

    /// A tensor of `m`'s shape at `place`, on pooled storage when there is some (its contents
    /// are overwritten by the receive).
    fn tensor(&mut self, m: &Meta, place: &Place) -> Result<Tensor, String> {
        let key = if place.is_device() {
            (true, m.nbytes())
        } else {
            (false, m.nbytes().div_ceil(8))
        };
        match self.pool.get_mut(&key).and_then(Vec::pop) {
            Some(Storage::Host(w)) => {
                self.pool_bytes -= 8 * w.len();
                Ok(Tensor::from_words(m.clone(), w))
            }
            #[cfg(feature = "cuda-core")]
            Some(Storage::Device(d)) => {
                self.pool_bytes -= d.len();
                Ok(Tensor::on_device(m.clone(), d))
            }
            None => place.zeros(m),
        }
    }

    fn recycle(&mut self, t: Tensor) {
        let store = t.into_store();
        let (key, bytes) = match &store {
            Storage::Host(w) => ((false, w.len()), 8 * w.len()),
            #[cfg(feature = "cuda-core")]
            Storage::Device(d) => ((true, d.len()), d.len()),
        };
        let list = self.pool.entry(key).or_default();
        if list.len() < self.pool_cap && bytes > 0 && self.pool_bytes + bytes <= POOL_BYTES {
            self.pool_bytes += bytes;
            list.push(store);
        }
    }
}

/// The exchange thread's view of the pipeline.
pub(crate) struct Wire<'a> {
    pub comm: &'a Communicator,
    pub caches: &'a mut Caches,
    pub check: Option<Check>,
    pub place: Place,
}

/// A message's key in the caches, from this rank's side: (peer, direction, chunk).
pub(super) fn slot(op: &Op) -> (usize, Dir, usize) {
    match *op {
        Op::Send {
            peer, dir, chunk, ..
        }
        | Op::Recv {
            peer, dir, chunk, ..
        } => (peer, dir, chunk),
    }
}

impl Wire<'_> {
    pub(super) fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// This rank's stage for `op`, and the peer's.
    pub(super) fn stages(&self, op: &Op) -> (usize, usize) {
        let p = self.comm.size();
        let (_, dir, chunk) = slot(op);
        let me = chunk * p + self.rank();
        let other = match (op, dir) {
            (Op::Send { .. }, Dir::Act) | (Op::Recv { .. }, Dir::Grad) => me + 1,
            _ => me - 1,
        };
        (me, other)
    }

    fn describe(&self, ops: &[Op]) -> String {
        let parts: Vec<String> = ops
            .iter()
            .map(|op| match *op {
                Op::Send { peer, dir, mb, .. } => {
                    format!("send {} of micro-batch {mb} to rank {peer}", dir_name(dir))
                }
                Op::Recv { peer, dir, mb, .. } => {
                    format!(
                        "receive {} of micro-batch {mb} from rank {peer}",
                        dir_name(dir)
                    )
                }
            })
            .collect();
        parts.join(", ")
    }

    pub(super) fn comm_err(&self, ops: &[Op], round: &str, e: oxccl_comm::Error) -> PipelineError {
        PipelineError::Comm {
            rank: self.rank(),
            what: format!("{round} of {}", self.describe(ops)),
            source: e,
        }
    }

    /// Runs one exchange; returns what it received, by consumer.
    pub(crate) fn run(&mut self, job: Job) -> Done {
        let Job { ops, sends } = job;
        let n = ops.len();
        let metas: Vec<Vec<Meta>> = sends
            .iter()
            .map(|ts| ts.iter().map(|t| t.meta().clone()).collect())
            .collect();
        let mut out_hdr = vec![[0u64; 3]; n];
        let mut in_hdr = vec![[0u64; 3]; n];
        let mut changed = vec![false; n];
        // What round 1 sends in old shapes, and receives in the cached ones.
        let mut stale: Vec<Vec<Tensor>> = vec![Vec::new(); n];
        let mut got: Vec<Vec<Tensor>> = vec![Vec::new(); n];
        for (i, op) in ops.iter().enumerate() {
            let key = slot(op);
            if matches!(op, Op::Send { .. }) {
                let m = &metas[i];
                let cached = self.caches.sent.get(&key);
                changed[i] = cached != Some(m);
                let meta_len = if changed[i] { encoded_len(m) } else { 0 };
                let payload: usize = m.iter().map(Meta::nbytes).sum();
                out_hdr[i] = [fingerprint(m), meta_len as u64, payload as u64];
                if changed[i] {
                    let old = cached.into_iter().flatten();
                    stale[i] = old
                        .map(|m| self.place.zeros(m))
                        .collect::<Result<_, _>>()
                        .map_err(|what| self.device_err(what))?;
                }
            } else if let Some((_, m)) = self.caches.taken.get(&key).cloned() {
                got[i] = self.tensors(&m)?;
            }
        }
        self.first_round(
            &ops,
            &sends,
            &stale,
            &changed,
            &out_hdr,
            &mut in_hdr,
            &mut got,
        )?;
        let mut shapes: Vec<Option<Vec<Meta>>> = vec![None; n];
        for (i, op) in ops.iter().enumerate() {
            if matches!(op, Op::Recv { .. }) {
                changed[i] = in_hdr[i][1] > 0;
                if changed[i] {
                    for t in std::mem::take(&mut got[i]) {
                        self.caches.recycle(t);
                    }
                } else {
                    self.cached(op, in_hdr[i][0])?;
                }
            }
        }
        if changed.iter().any(|&c| c) {
            self.new_shapes(&ops, &metas, &changed, &in_hdr, &mut shapes)?;
            self.last_round(&ops, &sends, &changed, shapes, &mut got)?;
        }
        for t in sends.into_iter().flatten() {
            self.caches.recycle(t);
        }
        Ok(ops
            .iter()
            .zip(got)
            .filter_map(|(op, ts)| match *op {
                Op::Recv { dir, mb, chunk, .. } => Some(((dir, mb, chunk), ts)),
                Op::Send { .. } => None,
            })
            .collect())
    }

    /// Tensors of `metas` to receive into, at the pipeline's place.
    fn tensors(&mut self, metas: &[Meta]) -> Result<Vec<Tensor>, PipelineError> {
        let mut out = Vec::with_capacity(metas.len());
        for m in metas {
            let t = self.caches.tensor(m, &self.place);
            out.push(t.map_err(|what| self.device_err(what))?);
        }
        Ok(out)
    }

    fn device_err(&self, what: String) -> PipelineError {
        PipelineError::Device {
            rank: self.rank(),
            what,
        }
    }

    /// Round 1: every header, and every payload in the shapes both ends know: in the headers'
    /// batch on the host, in a batch of their own after it on a device ([`Place::split`]).
    #[allow(clippy::too_many_arguments)]
    fn first_round(
        &self,
        ops: &[Op],
        sends: &[Vec<Tensor>],
        stale: &[Vec<Tensor>],
        changed: &[bool],
        out_hdr: &[[u64; 3]],
        in_hdr: &mut [[u64; 3]],
        got: &mut [Vec<Tensor>],
    ) -> Result<(), PipelineError> {
        let pay = |i: usize| -> &[Tensor] {
            if changed[i] {
                &stale[i]
            } else {
                &sends[i]
            }
        };
        let split = self.place.split();
        let mut batch = Vec::new();
        for (i, ((op, hdr), ts)) in ops
            .iter()
            .zip(in_hdr.iter_mut())
            .zip(got.iter_mut())
            .enumerate()
        {
            match *op {
                Op::Send { peer, .. } => {
                    batch.push(P2pOp::Send {
                        buf: bytemuck::bytes_of(&out_hdr[i]),
                        peer,
                    });
                    if !split {
                        batch.extend(sends_of(pay(i), peer));
                    }
                }
                Op::Recv { peer, .. } => {
                    batch.push(P2pOp::Recv {
                        buf: bytemuck::bytes_of_mut(hdr),
                        peer,
                    });
                    if !split {
                        batch.extend(recvs_into(ts, peer));
                    }
                }
            }
        }
        self.run_batch(ops, batch, "exchange")?;
        if split {
            let pay: Vec<&[Tensor]> = (0..ops.len()).map(pay).collect();
            self.payloads(ops, &pay, got, "payload")?;
        }
        Ok(())
    }

    /// One batch of payloads: `sends[i]` for each send of `ops`, into `got[i]` for each
    /// receive (a device batch on a device, a host batch otherwise).
    fn payloads(
        &self,
        ops: &[Op],
        sends: &[&[Tensor]],
        got: &mut [Vec<Tensor>],
        round: &str,
    ) -> Result<(), PipelineError> {
        #[cfg(feature = "cuda-core")]
        if let Place::Device(stream) = &self.place {
            let mut out = Vec::new();
            let mut inc = Vec::new();
            for ((op, ts), g) in ops.iter().zip(sends).zip(got.iter_mut()) {
                match *op {
                    Op::Send { peer, .. } => out.push((peer, *ts)),
                    Op::Recv { peer, .. } => inc.push((peer, &mut g[..])),
                }
            }
            return super::place::device_batch(self.comm, stream, &out, &mut inc)
                .map_err(|e| self.comm_err(ops, round, e));
        }
        let mut batch = Vec::new();
        for ((op, ts), g) in ops.iter().zip(sends).zip(got.iter_mut()) {
            match *op {
                Op::Send { peer, .. } => batch.extend(sends_of(ts, peer)),
                Op::Recv { peer, .. } => batch.extend(recvs_into(g, peer)),
            }
        }
        self.run_batch(ops, batch, round)
    }

    /// Checks a receive whose header says its shapes did not change against the cache.
    fn cached(&self, op: &Op, fp: u64) -> Result<(), PipelineError> {
        match self.caches.taken.get(&slot(op)) {
            Some((f, _)) if *f == fp => Ok(()),
            _ => Err(PipelineError::Protocol {
                rank: self.rank(),
                what: format!(
                    "{}: the header says the shapes did not change, but this rank has none cached with fingerprint {fp:#x}",
                    self.describe(std::slice::from_ref(op))
                ),
            }),
        }
    }

    /// Round 4: the payloads of the messages whose shapes changed, in their new shapes.
    fn last_round(
        &mut self,
        ops: &[Op],
        sends: &[Vec<Tensor>],
        changed: &[bool],
        shapes: Vec<Option<Vec<Meta>>>,
        got: &mut [Vec<Tensor>],
    ) -> Result<(), PipelineError> {
        for (i, m) in shapes.into_iter().enumerate() {
            if let (true, Op::Recv { .. }, Some(m)) = (changed[i], &ops[i], m) {
                got[i] = self.tensors(&m)?;
            }
        }
        // Only the changed messages: the others' tensors went in round 1.
        let pay: Vec<&[Tensor]> = (0..ops.len())
            .map(|i| if changed[i] { &sends[i][..] } else { &[][..] })
            .collect();
        let mut fresh: Vec<Vec<Tensor>> = got
            .iter_mut()
            .zip(changed)
            .map(|(g, &c)| if c { std::mem::take(g) } else { Vec::new() })
            .collect();
        let r = self.payloads(ops, &pay, &mut fresh, "payload");
        for ((g, f), &c) in got.iter_mut().zip(fresh).zip(changed) {
            if c {
                *g = f;
            }
        }
        r
    }

    /// Runs `batch` (nothing when it is empty), naming `round` of `ops` in its error.
    fn run_batch(
        &self,
        ops: &[Op],
        batch: Vec<P2pOp<'_, u8>>,
        round: &str,
    ) -> Result<(), PipelineError> {
        if batch.is_empty() {
            return Ok(());
        }
        self.comm
            .batch_p2p(batch)
            .map_err(|e| self.comm_err(ops, round, e))
    }
}

/// One send of each non-empty host tensor of `ts` to `peer` (device tensors go in a device
/// batch).
fn sends_of(ts: &[Tensor], peer: usize) -> impl Iterator<Item = P2pOp<'_, u8>> {
    ts.iter()
        .filter_map(Tensor::bytes)
        .filter(|b| !b.is_empty())
        .map(move |buf| P2pOp::Send { buf, peer })
}

/// One receive from `peer` into each non-empty host tensor of `ts`.
fn recvs_into(ts: &mut [Tensor], peer: usize) -> impl Iterator<Item = P2pOp<'_, u8>> {
    ts.iter_mut()
        .filter_map(Tensor::bytes_mut)
        .filter(|b| !b.is_empty())
        .map(move |buf| P2pOp::Recv { buf, peer })
}
