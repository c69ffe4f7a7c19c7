//! Hierarchical all-reduce, reduce-scatter and all-gather for communicators spanning nodes.
//!
//! The communicator's ranks sit on `N >= 2` nodes of `L >= 2` ranks each (`NodeLayout`; nodes
//! of different sizes below). Ranks talk through two kinds of sub-rings: the **local ring** of
//! the `L` ranks of a node (shared memory) and the **cross ring** of the `N` ranks with the same
//! local rank (TCP between nodes). Every local rank runs its own cross ring, so the `L` shards
//! cross the network in parallel, on `L` connections.
//!
//! - **All-reduce**, per block of `L * chunk` elements: local ring reduce-scatter (local rank `l`
//!   ends with the node's sum of piece `l`), cross ring all-reduce of piece `l`, local ring
//!   all-gather. Bytes leaving a node: `2 (N-1)/N * B` over `L` connections together, against the
//!   flat ring's `2 (N*L-1)/(N*L) * B` through the one connection each ring direction has
//!   between two nodes. **Nodes of different sizes** (a node that lost a rank and was shrunk,
//!   8 + 7 GPUs): `L` is the smallest node's size, so a block has `L` pieces; on a larger node the
//!   local ranks from `L` on own an empty piece (they pass pieces on in the local rings, and run
//!   no cross ring), and local rank `l < L` of every node still meets its peers in cross ring `l`.
//!   The local rings then carry `B / L` per step instead of `B / L_k` (the tuner picks this only
//!   while no node has more than `L + 1` ranks, `NodeLayout::balanced`).
//! - **Reduce-scatter** (nodes of equal size only: the shards are per rank) (`n = N*L` shards, shard `r` for rank `r`): for each node `k` a local ring
//!   reduce-scatter over the shards of node `k`'s ranks (local rank `l` ends with the node's sum of
//!   the shards of local rank `l` on every node), then a cross ring reduce-scatter of those `N`
//!   shards: `(N-1)/N` of a rank's `N` shards leave the node, against `(n-1)/n * B` in the flat ring.
//! - **All-gather** (nodes of equal size only): the reverse: a cross ring all-gather of the shards of local rank `l` on every
//!   node, then for each node a local ring all-gather of its ranks' shards.
//!
//! The tuner picks these from `tuning::HIERARCHICAL_MIN` bytes on, when the layout allows.

use std::ops::Range;

use oxccl_kernels::{DType, ReduceOp};

use super::{blocks, partition, ring, ring_sub};
use crate::algorithm::prims::{Ctx, NodeLayout, RecvMode, RecvPart, SendPart};
use crate::base::error::{Error, Result};

fn layout<'c>(ctx: &Ctx<'c>) -> Result<&'c NodeLayout> {
    ctx.layout.ok_or_else(|| Error::InvalidArgument {
        rank: ctx.rank,
        op: ctx.op.into(),
        msg: "hierarchical algorithms need at least two nodes with at least two ranks each".into(),
    })
}

/// The layout of the hierarchical reduce-scatter and all-gather: nodes of equal size.
fn even_layout<'c>(ctx: &Ctx<'c>) -> Result<&'c NodeLayout> {
    let lay = layout(ctx)?;
    if lay.even {
        return Ok(lay);
    }
    let sizes: Vec<usize> = lay.ranks.iter().map(Vec::len).collect();
    Err(Error::InvalidArgument {
        rank: ctx.rank,
        op: ctx.op.into(),
        msg: format!(
            "hierarchical {} needs nodes with the same number of ranks, but they have {sizes:?} \
             (only the hierarchical all-reduce takes nodes of different sizes)",
            ctx.op
        ),
    })
}

/// One ring step of a rank: send `send` (bytes of the buffer, or of the input with `from_src`)
/// to `to` while receiving `recv` from `from`, reduced into the buffer or copied.
#[derive(Clone, Debug)]
struct Step {
    to: usize,
    send: Range<usize>,
    from: usize,
    recv: Range<usize>,
    reduce: bool,
    /// Out of place: the send reads the input (first reduce-scatter step of the local ring).
    from_src: bool,
    /// Out of place: the received piece is combined with the input into the buffer (every
    /// reduce-scatter step of the local ring).
    recv_src: bool,
    /// Moves nothing: a cross-ring step of a local rank without a piece (nodes of different
    /// sizes), kept so its local-ring steps come in the same order as its node's other ranks'.
    idle: bool,
}

impl Step {
    fn idle() -> Step {
        Step {
            to: 0,
            send: 0..0,
            from: 0,
            recv: 0..0,
            reduce: false,
            from_src: false,
            recv_src: false,
            idle: true,
        }
    }
}

/// The reduce-scatter steps of a ring over `members` (communicator ranks; this rank is member
/// `me`), as in `ring.rs`: afterwards chunk `me` is reduced.
fn ring_rs(members: &[usize], me: usize, chunk: &dyn Fn(usize) -> Range<usize>) -> Vec<Step> {
    let n = members.len();
    let (to, from) = (members[(me + 1) % n], members[ring_sub(me, 1, n)]);
    (0..n - 1)
        .map(|s| Step {
            to,
            send: chunk(ring_sub(me, s + 1, n)),
            from,
            recv: chunk(ring_sub(me, s + 2, n)),
            reduce: true,
            from_src: s == 0,
            recv_src: true,
            idle: false,
        })
        .collect()
}

/// The all-gather steps of a ring over `members`: chunk `me` is valid before, all chunks after.
fn ring_ag(members: &[usize], me: usize, chunk: &dyn Fn(usize) -> Range<usize>) -> Vec<Step> {
    let n = members.len();
    let (to, from) = (members[(me + 1) % n], members[ring_sub(me, 1, n)]);
    (0..n - 1)
        .map(|s| Step {
            to,
            send: chunk(ring_sub(me, s, n)),
            from,
            recv: chunk(ring_sub(me, s + 1, n)),
            reduce: false,
            from_src: false,
            recv_src: false,
            idle: false,
        })
        .collect()
}

/// Disjoint byte ranges of `buf`, mutably, in the order given.
fn carve<'b>(buf: &'b mut [u8], ranges: &[Range<usize>]) -> Vec<&'b mut [u8]> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| ranges[i].start);
    let mut out: Vec<Option<&'b mut [u8]>> = (0..ranges.len()).map(|_| None).collect();
    let mut rest = buf;
    let mut at = 0;
    for i in order {
        let r = &ranges[i];
        if r.is_empty() {
            // Anywhere, even inside another range: nothing to carve.
            continue;
        }
        debug_assert!(r.start >= at, "overlapping ranges {ranges:?}");
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut(r.start - at);
        let (piece, tail) = tail.split_at_mut(r.len());
        out[i] = Some(piece);
        rest = tail;
        at = r.end;
    }
    out.into_iter().map(Option::unwrap_or_default).collect()
}

/// The steps of one block, in three phases: local reduce-scatter, cross all-reduce of this
/// rank's piece, local all-gather.
struct Block {
    phases: [Vec<Step>; 3],
    /// Steps done in each phase.
    done: [usize; 3],
}

impl Block {
    fn phase_done(&self, p: usize) -> bool {
        self.done[p] == self.phases[p].len()
    }
}

/// Hierarchical all-reduce of `buf`: in place, or `buf = reduce(src)` reading `src` where it is.
///
/// Blocks are pipelined: while the ranks of a node reduce-scatter (or all-gather) one block
/// through shared memory, the cross rings carry the previous block between nodes; every step of
/// both kinds runs in one `exchange_many`, so the network is busy while the node works. The
/// ranks of a node have phases of the same lengths (idle cross steps for ranks without a piece),
/// so they take their local steps in one order; cross steps go in block order on every rank.
/// So messages between any two ranks keep one order.
pub(crate) fn all_reduce(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    chunk_bytes: usize,
) -> Result<()> {
    let lay = layout(ctx)?;
    let es = dt.size();
    let count = buf.len() / es;
    let pieces = lay.pieces;
    let n = lay.cross_group.len();
    if count < pieces {
        // Too few elements to give every piece one: flat ring (summing for `Avg`: the caller
        // divides the whole buffer after a hierarchical all-reduce).
        let op = if op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            op
        };
        return ring::all_reduce(ctx, src, buf, dt, op, chunk_bytes);
    }
    let mut sched: Vec<Block> = Vec::new();
    for (start, len) in blocks(count, (chunk_bytes / es).max(1) * pieces) {
        // Local ranks `pieces` and up (on nodes larger than the smallest) own an empty piece:
        // they only pass pieces on in the local rings.
        let chunk = |i: usize| {
            let p = if i < pieces {
                partition(len, pieces, i)
            } else {
                len..len
            };
            (start + p.start) * es..(start + p.end) * es
        };
        let mine = chunk(lay.local);
        let piece = (mine.end - mine.start) / es;
        let cross_chunk = |k: usize| {
            let p = partition(piece, n, k);
            mine.start + p.start * es..mine.start + p.end * es
        };
        let cross = if n > 0 {
            let mut cross = ring_rs(&lay.cross_group, lay.node, &cross_chunk);
            for s in &mut cross {
                // The piece is in the buffer by then.
                (s.from_src, s.recv_src) = (false, false);
            }
            cross.extend(ring_ag(&lay.cross_group, lay.node, &cross_chunk));
            cross
        } else {
            // No piece, no cross ring; as many idle steps as the others' cross rings take, so
            // the schedule below interleaves this rank's local steps as it does theirs.
            let nodes = lay.ranks.len();
            (0..2 * (nodes - 1)).map(|_| Step::idle()).collect()
        };
        sched.push(Block {
            phases: [
                ring_rs(&lay.local_group, lay.local, &chunk),
                cross,
                ring_ag(&lay.local_group, lay.local, &chunk),
            ],
            done: [0; 3],
        });
    }
    let tag = ctx.tag;
    loop {
        // Local ring: finish a block (all-gather) when its cross phase is over, else start the
        // next one (reduce-scatter). Cross rings: the first block whose local phase is over.
        let local = sched
            .iter()
            .position(|b| b.phase_done(1) && !b.phase_done(2))
            .map(|i| (i, 2))
            .or_else(|| sched.iter().position(|b| !b.phase_done(0)).map(|i| (i, 0)));
        let cross = sched
            .iter()
            .position(|b| b.phase_done(0) && !b.phase_done(1))
            .map(|i| (i, 1));
        let steps: Vec<(usize, usize)> = local.into_iter().chain(cross).collect();
        if steps.is_empty() {
            return Ok(());
        }
        let todo: Vec<Step> = steps
            .iter()
            .map(|&(b, p)| sched[b].phases[p][sched[b].done[p]].clone())
            .filter(|st| !st.idle)
            .collect();
        // Buffer ranges: every receive, and the sends that read the buffer.
        let mut ranges = Vec::new();
        for st in &todo {
            ranges.push(st.recv.clone());
            if !(st.from_src && src.is_some()) {
                ranges.push(st.send.clone());
            }
        }
        let mut parts = carve(buf, &ranges).into_iter();
        let mut sends = Vec::with_capacity(todo.len());
        let mut recvs = Vec::with_capacity(todo.len());
        for st in &todo {
            let dst = parts.next().unwrap_or_default();
            let mode = match (st.reduce, src) {
                (false, _) => RecvMode::Copy,
                // Local reduce-scatter out of place: combine with the input where it is.
                (true, Some(x)) if st.recv_src => RecvMode::ReduceFrom(dt, op, &x[st.recv.clone()]),
                (true, _) => RecvMode::Reduce(dt, op),
            };
            let data: &[u8] = match src {
                Some(x) if st.from_src => &x[st.send.clone()],
                _ => parts.next().unwrap_or_default(),
            };
            sends.push(SendPart::new(st.to, data, tag));
            recvs.push(RecvPart::new(st.from, dst, mode, tag));
        }
        ctx.exchange_many(&mut sends, &mut recvs)?;
        for (b, p) in steps {
            sched[b].done[p] += 1;
        }
    }
}

/// The byte range of rank `r`'s shard (`shard` bytes each) within `[lo, lo + len)` of it.
fn shard_part(r: usize, shard: usize, lo: usize, len: usize) -> Range<usize> {
    r * shard + lo..r * shard + lo + len
}

/// Hierarchical reduce-scatter: `buf` holds `n` shards; afterwards this rank's shard is reduced.
/// Out of place `src` is the input and `buf` is only written.
pub(crate) fn reduce_scatter(
    ctx: &mut Ctx<'_>,
    src: Option<&[u8]>,
    buf: &mut [u8],
    dt: DType,
    op: ReduceOp,
    chunk_bytes: usize,
) -> Result<()> {
    let lay = even_layout(ctx)?;
    let es = dt.size();
    let shard = buf.len() / ctx.size;
    if shard == 0 {
        return Ok(());
    }
    for (lo, len) in blocks(shard / es, chunk_bytes / es) {
        let (lo, len) = (lo * es, len * es);
        for node in &lay.ranks {
            let chunk = |i: usize| shard_part(node[i], shard, lo, len);
            ring::rs_steps(&mut ctx.sub(&lay.local_group), buf, src, &chunk, dt, op)?;
        }
        let chunk = |k: usize| shard_part(lay.ranks[k][lay.local], shard, lo, len);
        ring::rs_steps(&mut ctx.sub(&lay.cross_group), buf, None, &chunk, dt, op)?;
    }
    Ok(())
}

/// Hierarchical all-gather: `buf` holds `n` shards. In place this rank's shard is already
/// valid; out of place `own` is this rank's shard.
pub(crate) fn all_gather(
    ctx: &mut Ctx<'_>,
    buf: &mut [u8],
    es: usize,
    chunk_bytes: usize,
    own: Option<&[u8]>,
) -> Result<()> {
    let lay = even_layout(ctx)?;
    let shard = buf.len() / ctx.size;
    if shard == 0 {
        return Ok(());
    }
    for (lo, len) in blocks(shard / es, chunk_bytes / es) {
        let (lo, len) = (lo * es, len * es);
        let chunk = |k: usize| shard_part(lay.ranks[k][lay.local], shard, lo, len);
        let own = own.map(|o| &o[lo..lo + len]);
        ring::ag_steps(&mut ctx.sub(&lay.cross_group), buf, &chunk, own)?;
        for node in &lay.ranks {
            let chunk = |i: usize| shard_part(node[i], shard, lo, len);
            ring::ag_steps(&mut ctx.sub(&lay.local_group), buf, &chunk, None)?;
        }
    }
    Ok(())
}
