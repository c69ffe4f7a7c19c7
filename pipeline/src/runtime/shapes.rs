//! Rounds 2 and 3 of an exchange ([`super::wire`]): the new dtypes and shapes of the messages
//! whose shapes changed (or that a link carries for the first time), and the receivers'
//! verdicts on them, sent back so that a refusal is an error on both ends.

use oxccl_comm::P2pOp;

use crate::error::{dir_name, PipelineError};
use crate::schedule::Op;
use crate::tensor::{decode, encode, fingerprint, show, Meta};

use super::wire::{slot, Wire};

/// Words of a verdict: its length in bytes, then the text (cut to fit).
const VERDICT_WORDS: usize = 64;

impl Wire<'_> {
    /// One round of words: each send op sends `out[i]`, each receive fills `inb[i]`, for the
    /// ops `take` selects.
    fn round(
        &self,
        ops: &[Op],
        out: &[Vec<u64>],
        inb: &mut [Vec<u64>],
        name: &str,
        take: impl Fn(usize) -> bool,
    ) -> Result<(), PipelineError> {
        let mut batch = Vec::new();
        for (i, (op, buf)) in ops.iter().zip(inb.iter_mut()).enumerate() {
            if !take(i) {
                continue;
            }
            match *op {
                Op::Send { peer, .. } => batch.push(P2pOp::Send { buf: &out[i], peer }),
                Op::Recv { peer, .. } => batch.push(P2pOp::Recv { buf, peer }),
            }
        }
        if batch.is_empty() {
            return Ok(());
        }
        self.comm
            .batch_p2p(batch)
            .map_err(|e| self.comm_err(ops, name, e))
    }

    /// Rounds 2 and 3 for the ops marked `changed`.
    pub(super) fn new_shapes(
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
                    let (_, to) = self.stages(op);
                    refused[i] = Some(format!(
                        "stage {to} (rank {}) refused the {} of micro-batch {mb} that this stage sent, {}: {why}",
                        op.peer(),
                        dir_name(dir),
                        show(&metas[i])
                    ));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_carry_their_text_cut_to_fit() {
        let mut w = vec![0u64; VERDICT_WORDS];
        assert_eq!(get_text(&w), None);
        put_text(&mut w, "stage 1 takes one tensor");
        assert_eq!(get_text(&w).as_deref(), Some("stage 1 takes one tensor"));
        put_text(&mut w, &"x".repeat(1000));
        assert_eq!(get_text(&w).unwrap().len(), (VERDICT_WORDS - 1) * 8);
    }
}
