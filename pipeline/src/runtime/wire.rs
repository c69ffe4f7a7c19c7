//! One exchange on the wire, run by the pipeline's exchange thread. Every exchange is the same
//! batch of operations (the schedule's, in its order) in up to four rounds:
//!
//! 1. **header**: per message three words: the fingerprint of its dtypes and shapes, the
//!    length of the shapes that follow (0 when the receiver already has them: the last ones
//!    sent on this link for this direction and chunk) and the payload's bytes;
//! 2. **shapes**, only for the messages whose shapes changed (the first of each link
//!    included): the encoded dtypes and shapes;
//! 3. **verdict**, for the same messages: the receiver's check of the new shapes, sent back,
//!    so that a refusal is an error on both ends;
//! 4. **payload**: each tensor's bytes as one operation, received straight into a tensor of
//!    the announced shape.
//!
//! Rounds 2 and 3 happen only when shapes change, so a steady pipeline pays one small header
//! round per exchange.

use std::collections::HashMap;
use std::sync::Arc;

use oxccl_comm::{Communicator, P2pOp};

use crate::error::{dir_name, PipelineError};
use crate::schedule::{Dir, Op};
use crate::tensor::{decode, encode, fingerprint, show, Meta, Tensor};

/// A receiver's check of new shapes: `(direction, its chunk, shapes)`; `Err(why)` refuses them.
pub type Check = Arc<dyn Fn(Dir, usize, &[Meta]) -> Result<(), String> + Send + Sync>;

/// Words of a verdict: its length in bytes, then the text (cut to fit).
const VERDICT_WORDS: usize = 64;

/// An exchange to run: the schedule's operations and, for each send, its tensors.
pub(crate) struct Job {
    pub ops: Vec<Op>,
    pub sends: Vec<Vec<Tensor>>,
}

/// Tensors received for a consumer: (direction, micro-batch, this rank's chunk).
pub(crate) type Key = (Dir, usize, usize);

/// What an exchange gives back: the tensors it received, by consumer.
pub(crate) type Done = Result<Vec<(Key, Vec<Tensor>)>, PipelineError>;

/// What each link last carried, on both ends: the sender's and the receiver's view agree, so
/// a header says whether shapes follow.
#[derive(Default)]
pub(crate) struct Caches {
    /// (peer, direction, this rank's producing chunk) -> the shapes last sent.
    sent: HashMap<(usize, Dir, usize), Vec<Meta>>,
    /// (peer, direction, this rank's consuming chunk) -> fingerprint and shapes last accepted.
    taken: HashMap<(usize, Dir, usize), (u64, Vec<Meta>)>,
    /// Shapes (re)sent or received, in all.
    pub(crate) meta_rounds: u64,
}

/// The exchange thread's view of the pipeline.
pub(crate) struct Wire<'a> {
    pub comm: &'a Communicator,
    pub caches: &'a mut Caches,
    pub check: Option<Check>,
}

/// A message's key in the caches and its stage numbers, from this rank's side.
fn slot(op: &Op) -> (usize, Dir, usize) {
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
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// This rank's stage for `op`, and the peer's.
    fn stages(&self, op: &Op) -> (usize, usize) {
        let p = self.comm.size();
        let (peer, dir, chunk) = slot(op);
        let me = chunk * p + self.rank();
        let other = match (op, dir) {
            (Op::Send { .. }, Dir::Act) | (Op::Recv { .. }, Dir::Grad) => me + 1,
            _ => me - 1,
        };
        debug_assert_eq!(other % p, peer);
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

    fn comm_err(&self, ops: &[Op], round: &str, e: oxccl_comm::Error) -> PipelineError {
        PipelineError::Comm {
            rank: self.rank(),
            what: format!("{round} of {}", self.describe(ops)),
            source: e,
        }
    }

    /// Runs one exchange; returns what it received, by consumer.
    pub(crate) fn run(&mut self, job: Job) -> Done {
        let Job { ops, sends } = job;
        let metas: Vec<Vec<Meta>> = sends
            .iter()
            .map(|ts| ts.iter().map(|t| t.meta().clone()).collect())
            .collect();
        // Round 1: headers.
        let mut out_headers: Vec<[u64; 3]> = Vec::with_capacity(ops.len());
        let mut changed = vec![false; ops.len()];
        for (i, op) in ops.iter().enumerate() {
            if matches!(op, Op::Send { .. }) {
                let m = &metas[i];
                changed[i] = self.caches.sent.get(&slot(op)) != Some(m);
                let meta_len = if changed[i] { encode(m).len() } else { 0 };
                let payload: usize = m.iter().map(Meta::nbytes).sum();
                out_headers.push([fingerprint(m), meta_len as u64, payload as u64]);
            } else {
                out_headers.push([0; 3]);
            }
        }
        let mut in_headers = out_headers.clone();
        self.round(&ops, &out_headers, &mut in_headers, "header", |_| true)?;
        // Rounds 2 and 3: new shapes and their verdicts.
        let mut shapes: Vec<Option<Vec<Meta>>> = vec![None; ops.len()];
        for (i, op) in ops.iter().enumerate() {
            if matches!(op, Op::Recv { .. }) {
                changed[i] = in_headers[i][1] > 0;
                if !changed[i] {
                    shapes[i] = Some(self.cached(op, in_headers[i][0])?);
                }
            }
        }
        if changed.iter().any(|&c| c) {
            self.new_shapes(&ops, &metas, &changed, &in_headers, &mut shapes)?;
        }
        // Round 4: payloads.
        self.payload(&ops, &sends, &in_headers, shapes)
    }

    /// One round of words: each send op sends `out[i]`, each receive fills `inb[i]`, for the
    /// ops `take` selects.
    fn round(
        &self,
        ops: &[Op],
        out: &[impl AsRef<[u64]>],
        inb: &mut [impl AsMut<[u64]>],
        name: &str,
        take: impl Fn(usize) -> bool,
    ) -> Result<(), PipelineError> {
        let mut batch = Vec::new();
        for (i, (op, buf)) in ops.iter().zip(inb.iter_mut()).enumerate() {
            if !take(i) {
                continue;
            }
            match *op {
                Op::Send { peer, .. } => batch.push(P2pOp::Send {
                    buf: out[i].as_ref(),
                    peer,
                }),
                Op::Recv { peer, .. } => batch.push(P2pOp::Recv {
                    buf: buf.as_mut(),
                    peer,
                }),
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        self.comm
            .batch_p2p(batch)
            .map_err(|e| self.comm_err(ops, name, e))
    }

    /// The shapes cached for a receive whose header says they did not change.
    fn cached(&self, op: &Op, fp: u64) -> Result<Vec<Meta>, PipelineError> {
        match self.caches.taken.get(&slot(op)) {
            Some((f, m)) if *f == fp => Ok(m.clone()),
            _ => Err(PipelineError::Protocol {
                rank: self.rank(),
                what: format!(
                    "{}: the header says the shapes did not change, but this rank has none cached with fingerprint {fp:#x}",
                    self.describe(std::slice::from_ref(op))
                ),
            }),
        }
    }

    /// Rounds 2 and 3 for the ops marked `changed`.
    fn new_shapes(
        &mut self,
        ops: &[Op],
        metas: &[Vec<Meta>],
        changed: &[bool],
        headers: &[[u64; 3]],
        shapes: &mut [Option<Vec<Meta>>],
    ) -> Result<(), PipelineError> {
        let out: Vec<Vec<u64>> = metas.iter().map(|m| encode(m)).collect();
        let mut inb: Vec<Vec<u64>> = ops
            .iter()
            .zip(headers)
            .map(|(op, h)| match op {
                Op::Recv { .. } => vec![0; h[1] as usize],
                Op::Send { .. } => Vec::new(),
            })
            .collect();
        self.round(ops, &out, &mut inb, "shapes", |i| changed[i])?;
        // The receivers' verdicts.
        let mut verdicts: Vec<Vec<u64>> = vec![vec![0; VERDICT_WORDS]; ops.len()];
        let mut refused: Vec<Option<String>> = vec![None; ops.len()];
        for (i, op) in ops.iter().enumerate() {
            let Op::Recv { dir, mb, chunk, .. } = *op else {
                continue;
            };
            if !changed[i] {
                continue;
            }
            let why = match decode(&inb[i]) {
                Err(e) => Err(e),
                Ok(m) => {
                    let bytes: usize = m.iter().map(Meta::nbytes).sum();
                    if bytes as u64 != headers[i][2] || fingerprint(&m) != headers[i][0] {
                        Err(format!(
                            "the header ({} bytes) does not match the shapes {}",
                            headers[i][2],
                            show(&m)
                        ))
                    } else {
                        match &self.check {
                            Some(f) => f(dir, chunk, &m).map(|()| m),
                            None => Ok(m),
                        }
                    }
                }
            };
            match why {
                Ok(m) => {
                    self.caches
                        .taken
                        .insert(slot(op), (headers[i][0], m.clone()));
                    self.caches.meta_rounds += 1;
                    shapes[i] = Some(m);
                }
                Err(why) => {
                    let got = decode(&inb[i]).map(|m| show(&m)).unwrap_or_default();
                    let (me, from) = self.stages(op);
                    refused[i] = Some(format!(
                        "stage {me} refused the {} of micro-batch {mb} that stage {from} (rank {}) sent, {got}: {why}",
                        dir_name(dir),
                        op.peer()
                    ));
                    put_text(&mut verdicts[i], &why);
                }
            }
        }
        let mut back: Vec<Vec<u64>> = vec![vec![0; VERDICT_WORDS]; ops.len()];
        // The verdict goes the other way: receivers send, senders receive.
        let flipped: Vec<Op> = ops.iter().map(flip).collect();
        self.round(&flipped, &verdicts, &mut back, "verdict", |i| changed[i])?;
        for (i, op) in ops.iter().enumerate() {
            let Op::Send { dir, mb, .. } = *op else {
                continue;
            };
            if !changed[i] {
                continue;
            }
            match get_text(&back[i]) {
                None => {
                    self.caches.sent.insert(slot(op), metas[i].clone());
                    self.caches.meta_rounds += 1;
                }
                Some(why) => {
                    let (me, to) = self.stages(op);
                    refused[i] = Some(format!(
                        "stage {to} (rank {}) refused the {} of micro-batch {mb} that this stage sent, {}: {why}",
                        op.peer(),
                        dir_name(dir),
                        show(&metas[i])
                    ));
                    let _ = me;
                }
            }
        }
        if let Some((i, what)) = refused
            .into_iter()
            .enumerate()
            .find_map(|(i, r)| r.map(|w| (i, w)))
        {
            return Err(PipelineError::Refused {
                rank: self.rank(),
                stage: self.stages(&ops[i]).0,
                what,
            });
        }
        Ok(())
    }

    /// Round 4.
    fn payload(
        &self,
        ops: &[Op],
        sends: &[Vec<Tensor>],
        headers: &[[u64; 3]],
        shapes: Vec<Option<Vec<Meta>>>,
    ) -> Result<Vec<(Key, Vec<Tensor>)>, PipelineError> {
        let mut received: Vec<(usize, Vec<Tensor>)> = Vec::new();
        for (i, (op, m)) in ops.iter().zip(shapes).enumerate() {
            if let (Op::Recv { .. }, Some(m)) = (op, m) {
                let _ = headers;
                received.push((
                    i,
                    m.iter().map(|m| Tensor::zeros(m.dtype, &m.shape)).collect(),
                ));
            }
        }
        {
            let mut batch = Vec::new();
            let mut rx = received.iter_mut().peekable();
            for (i, op) in ops.iter().enumerate() {
                match *op {
                    Op::Send { peer, .. } => {
                        batch.extend(sends[i].iter().filter(|t| !t.bytes().is_empty()).map(|t| {
                            P2pOp::Send {
                                buf: t.bytes(),
                                peer,
                            }
                        }))
                    }
                    Op::Recv { peer, .. } => {
                        let Some((_, ts)) = rx.next() else { continue };
                        batch.extend(ts.iter_mut().filter(|t| !t.bytes().is_empty()).map(|t| {
                            P2pOp::Recv {
                                buf: t.bytes_mut(),
                                peer,
                            }
                        }));
                    }
                }
            }
            if !batch.is_empty() {
                self.comm
                    .batch_p2p(batch)
                    .map_err(|e| self.comm_err(ops, "payload", e))?;
            }
        }
        Ok(received
            .into_iter()
            .map(|(i, ts)| {
                let (_, dir, chunk) = slot(&ops[i]);
                let mb = match ops[i] {
                    Op::Recv { mb, .. } | Op::Send { mb, .. } => mb,
                };
                ((dir, mb, chunk), ts)
            })
            .collect())
    }
}

/// The same message seen from the other way (for the verdicts).
fn flip(op: &Op) -> Op {
    match *op {
        Op::Send {
            peer,
            dir,
            mb,
            chunk,
        } => Op::Recv {
            peer,
            dir,
            mb,
            chunk,
        },
        Op::Recv {
            peer,
            dir,
            mb,
            chunk,
        } => Op::Send {
            peer,
            dir,
            mb,
            chunk,
        },
    }
}

fn put_text(words: &mut [u64], text: &str) {
    let room = (words.len() - 1) * 8;
    let b = &text.as_bytes()[..text.len().min(room)];
    words[0] = b.len().max(1) as u64;
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words[1..]);
    bytes[..b.len()].copy_from_slice(b);
}

fn get_text(words: &[u64]) -> Option<String> {
    let n = words[0] as usize;
    if n == 0 {
        return None;
    }
    let bytes: &[u8] = bytemuck::cast_slice(&words[1..]);
    Some(String::from_utf8_lossy(&bytes[..n.min(bytes.len())]).into_owned())
}
