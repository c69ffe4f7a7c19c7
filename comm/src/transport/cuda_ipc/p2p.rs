//! Point-to-point over CUDA IPC, the protocol: the steps one rank's stream runs for a batch of
//! sends and receives between ranks that map each other's scratch, so that data moves from
//! device to device without host memory. Pure code, tested here without a GPU against a host
//! model of the device (`p2p/tests.rs`); `p2p_exec.rs` enqueues these steps on a stream.
//!
//! # Memory
//!
//! Besides the collectives' flags and slots, every rank's scratch holds a p2p area
//! ([`P2pLayout`]): a block of [`FLAG_WORDS`] flag words, and for each rank `s` of the
//! communicator an **inbox** of two halves of `chunk` bytes:
//!
//! - `ready[s][h]` (word [`ready_word`]`(s, h)` of the receiver's block, written by sender `s`
//!   only): `(tag << 32) | k` once chunk number `k` (`k % 2 == h`) of the pair
//!   `s -> receiver` is in half `h` of the receiver's inbox for `s`, the tag being the chunk's
//!   length with [`LAST_CHUNK`] set on the last chunk of its message;
//! - `ack[r]` (word [`ack_word`]`(r)` of the sender's block, written by receiver `r` only):
//!   `k` once chunk `k` of the pair `sender -> r` has been copied out of the inbox.
//!
//! Chunks are numbered per ordered pair over the communicator's life (from 1), the same on
//! both ends since both count the pair's messages in order. A message of `b` bytes is
//! `max(1, ceil(b / chunk))` chunks (an empty message is one empty chunk, so that it pairs and
//! is checked like the others). A half's `ready` word is written again only for chunk `k + 2`,
//! which waits for the acknowledgement of `k`: so the receiver finds exactly `k` there, with
//! chunk `k`'s length.
//!
//! # A batch
//!
//! The batch's chunks run in **rounds**: round `j` holds the `j`-th chunk of the batch on
//! every ordered pair (a pair's messages' chunks one after another, in message order), first
//! every send, then every receive. A send of pair chunk `k` waits until the receiver
//! acknowledged chunk `k - 2` (its half is free), copies into the receiver's inbox and
//! publishes `ready`; a receive waits for `ready` to say `k` (and checks the tag its own
//! message expects: a chunk of another length, or a message that ends at another chunk, is a
//! mismatch naming the sender), copies out and acknowledges. A send of round `j` waits only for the receive of round `j - 2` on its pair,
//! and a receive of round `j` only for the send of round `j` on its pair, which waits for
//! nothing in round `j`: so every round completes once the rounds before it have, on every
//! rank, whatever the batch's pattern (every rank's batch must pair with its peers' in order, as
//! NCCL's groups and `batch_p2p` require). Sends to this rank itself are copies paired in
//! order with its receives from itself.

use std::ops::Range;

use super::plan::{FLAGS_BYTES, MAX_RANKS};

/// The bit of a `ready` word's tag (its high half) that marks the last chunk of a message, so
/// that messages whose lengths differ by whole chunks are a mismatch too.
pub(crate) const LAST_CHUNK: u32 = 1 << 31;

/// The tag of a chunk of `len` bytes (below [`LAST_CHUNK`]), the last of its message or not.
fn tag(len: usize, last: bool) -> u32 {
    len as u32 | if last { LAST_CHUNK } else { 0 }
}

/// Flag words of a rank's p2p block: two `ready` words per sender, one `ack` word per receiver.
pub(crate) const FLAG_WORDS: usize = 3 * MAX_RANKS;

/// Bytes of the p2p flag block ([`FLAG_WORDS`] words, padded so the inboxes start 256-byte
/// aligned).
const P2P_FLAGS_BYTES: usize = 256;

/// Largest inbox half: with 8 ranks, 64 MiB of inboxes per rank.
const MAX_CHUNK: usize = 4 << 20;

/// Error word values a p2p wait sets (low byte; the next byte is the peer's rank, the host word's
/// successor the chunk number), after the barrier's 1 to 4: the peer did not publish the chunk
/// in time.
pub(crate) const ERR_P2P_TIMEOUT: u32 = 5;
/// The peer published the chunk with another length (its message is longer or shorter).
pub(crate) const ERR_P2P_MISMATCH: u32 = 6;
/// The peer gave up (a wait of its own failed) and published the chunk poisoned.
pub(crate) const ERR_P2P_ABORTED: u32 = 7;
/// The peer did not take an earlier chunk out of its inbox in time.
pub(crate) const ERR_P2P_ACK_TIMEOUT: u32 = 8;

/// Where the p2p area lies in every rank's scratch allocation: after the collectives' flags and
/// two slots, [`P2P_FLAGS_BYTES`] of flag words, then one inbox of two `chunk`-byte halves per
/// rank of the communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct P2pLayout {
    /// Offset of the flag block from the start of a scratch allocation.
    pub flags: usize,
    /// Bytes of one inbox half: the largest chunk of a message.
    pub chunk: usize,
    pub size: usize,
}

impl P2pLayout {
    /// The layout of scratch allocations with slots of `slot_bytes`, for `size` ranks: inbox
    /// halves of half a slot, at most [`MAX_CHUNK`] (every rank computes the same, since the
    /// set-up checks that all have the same slot size).
    pub(crate) fn new(slot_bytes: usize, size: usize) -> P2pLayout {
        P2pLayout {
            flags: FLAGS_BYTES + 2 * slot_bytes,
            chunk: (slot_bytes / 2).clamp(1, MAX_CHUNK),
            size,
        }
    }

    /// Bytes of a whole scratch allocation.
    pub(crate) fn scratch_bytes(&self) -> usize {
        self.flags + P2P_FLAGS_BYTES + 2 * self.size * self.chunk
    }

    /// Bytes at [`P2pLayout::flags`] that must read zero before a peer may use them.
    pub(crate) fn flag_bytes(&self) -> usize {
        P2P_FLAGS_BYTES
    }

    /// The address of flag word `w` in the scratch that starts at `base`.
    pub(crate) fn word(&self, base: u64, w: usize) -> u64 {
        base + (self.flags + 8 * w) as u64
    }

    /// The address of half `k % 2` of the inbox for sender `s` in the scratch that starts at
    /// `base`.
    pub(crate) fn inbox(&self, base: u64, s: usize, k: u32) -> u64 {
        base + (self.flags + P2P_FLAGS_BYTES + (2 * s + (k % 2) as usize) * self.chunk) as u64
    }
}

/// The word of the receiver's block that sender `s` writes for its chunks of parity `half`.
pub(crate) fn ready_word(s: usize, half: u32) -> usize {
    2 * s + (half % 2) as usize
}

/// The word of the sender's block that receiver `r` writes its acknowledgements into.
pub(crate) fn ack_word(r: usize) -> usize {
    2 * MAX_RANKS + r
}

/// One message of a batch, as the caller gave it: a send to `peer` of the bytes of buffer
/// `buf`, or a receive from `peer` into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Msg {
    pub send: bool,
    pub peer: usize,
    pub bytes: usize,
}

/// One thing the stream does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum P2pStep {
    /// Wait until `peer` acknowledged chunk `k` of this rank's sends to it (`k = 0`: nothing
    /// to wait for).
    WaitAck { peer: usize, k: u32 },
    /// Copy `range` of message `msg`'s buffer into half `k % 2` of `peer`'s inbox for this
    /// rank.
    Put {
        msg: usize,
        peer: usize,
        range: Range<usize>,
        k: u32,
    },
    /// Publish chunk `k` to `peer` (`ready[me][k % 2]` in its block), with `tag`: its length,
    /// and [`LAST_CHUNK`] on its message's last chunk.
    Post { peer: usize, k: u32, tag: u32 },
    /// Wait until `peer` published chunk `k`, and check its tag is `tag`.
    WaitReady { peer: usize, k: u32, tag: u32 },
    /// Copy half `k % 2` of this rank's inbox for `peer` into `range` of message `msg`'s buffer.
    Take {
        msg: usize,
        peer: usize,
        range: Range<usize>,
        k: u32,
    },
    /// Acknowledge chunk `k` to `peer` (`ack[me]` in its block).
    Ack { peer: usize, k: u32 },
    /// Copy message `from`'s bytes (a send to this rank) into message `to`'s buffer.
    Local { from: usize, to: usize, len: usize },
}

/// Chunks sent to and received from each peer so far (the pair counters of the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct P2pCursor {
    pub sent: [u32; MAX_RANKS],
    pub got: [u32; MAX_RANKS],
}

/// The steps of one batch on rank `rank` of `size`, with inbox halves of `chunk` bytes,
/// advancing `cur`.
///
/// # Errors
/// A peer outside the communicator, a size above [`MAX_RANKS`], a zero chunk, a message longer
/// than the counters can number, or sends to this rank itself that do not pair up in order and
/// length with its receives from itself (before anything is planned: `cur` is unchanged).
pub(crate) fn p2p_plan(
    rank: usize,
    size: usize,
    msgs: &[Msg],
    chunk: usize,
    cur: &mut P2pCursor,
) -> Result<Vec<P2pStep>, String> {
    if size > MAX_RANKS || rank >= size {
        return Err(format!("rank {rank} of {size}: at most {MAX_RANKS} ranks"));
    }
    if chunk == 0 || chunk >= LAST_CHUNK as usize {
        return Err(format!("an inbox half of {chunk} bytes"));
    }
    if let Some((i, m)) = msgs.iter().enumerate().find(|(_, m)| m.peer >= size) {
        return Err(format!(
            "message {i}: peer {} is not a rank of this communicator (size {size})",
            m.peer
        ));
    }
    let chunks = |m: &Msg| m.bytes.div_ceil(chunk).max(1);
    // Self messages: the n-th send to this rank pairs with its n-th receive from it.
    let own = |send: bool| -> Vec<usize> {
        (0..msgs.len())
            .filter(|&i| msgs[i].peer == rank && msgs[i].send == send)
            .collect()
    };
    let (out, inc) = (own(true), own(false));
    if out.len() != inc.len()
        || out
            .iter()
            .zip(&inc)
            .any(|(&a, &b)| msgs[a].bytes != msgs[b].bytes)
    {
        return Err(format!(
            "{} sends to this rank itself do not pair up in order and length with {} receives \
             from it",
            out.len(),
            inc.len()
        ));
    }
    let mut next = *cur;
    for m in msgs.iter().filter(|m| m.peer != rank) {
        let c = u32::try_from(chunks(m)).map_err(|_| "a message of too many chunks".to_string())?;
        let counter = if m.send {
            &mut next.sent[m.peer]
        } else {
            &mut next.got[m.peer]
        };
        *counter = counter
            .checked_add(c)
            .ok_or_else(|| format!("the chunk counter with rank {} would wrap", m.peer))?;
    }
    let mut steps: Vec<P2pStep> = out
        .iter()
        .zip(&inc)
        .map(|(&from, &to)| P2pStep::Local {
            from,
            to,
            len: msgs[from].bytes,
        })
        .collect();
    // Each ordered pair's chunks in message order: (message, its byte range, its tag).
    let mut sends: Vec<Vec<(usize, Range<usize>, u32)>> = vec![Vec::new(); size];
    let mut recvs: Vec<Vec<(usize, Range<usize>, u32)>> = vec![Vec::new(); size];
    for (i, m) in msgs.iter().enumerate().filter(|(_, m)| m.peer != rank) {
        let list = if m.send {
            &mut sends[m.peer]
        } else {
            &mut recvs[m.peer]
        };
        let n = chunks(m);
        for j in 0..n {
            let range = j * chunk..m.bytes.min((j + 1) * chunk);
            let t = tag(range.len(), j + 1 == n);
            list.push((i, range, t));
        }
    }
    let rounds = sends.iter().chain(&recvs).map(Vec::len).max().unwrap_or(0);
    for j in 0..rounds {
        for (peer, list) in sends.iter().enumerate() {
            let Some((msg, range, tag)) = list.get(j).cloned() else {
                continue;
            };
            cur.sent[peer] += 1;
            let k = cur.sent[peer];
            steps.push(P2pStep::WaitAck {
                peer,
                k: k.saturating_sub(2),
            });
            steps.push(P2pStep::Put {
                msg,
                peer,
                range,
                k,
            });
            steps.push(P2pStep::Post { peer, k, tag });
        }
        for (peer, list) in recvs.iter().enumerate() {
            let Some((msg, range, tag)) = list.get(j).cloned() else {
                continue;
            };
            cur.got[peer] += 1;
            let k = cur.got[peer];
            steps.push(P2pStep::WaitReady { peer, k, tag });
            steps.push(P2pStep::Take {
                msg,
                peer,
                range,
                k,
            });
            steps.push(P2pStep::Ack { peer, k });
        }
    }
    debug_assert_eq!(*cur, next);
    Ok(steps)
}

#[cfg(test)]
mod tests;
