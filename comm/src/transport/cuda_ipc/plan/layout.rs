//! The steps of each collective family over IPC, chunk by chunk: what
//! [`ipc_plan`](super::ipc_plan) lays out once it has chosen the plan (ring, one-shot or two-shot)
//! and its signature.

use super::{Loc, Step};

/// One-shot or two-shot (reduce-scatter in the slots, then gather) for reductions that read
/// every peer at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shots {
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
pub(super) fn shard(elems: usize, n: usize, q: usize) -> (usize, usize) {
    let (base, extra) = (elems / n, elems % n);
    (q * base + q.min(extra), base + usize::from(q < extra))
}

/// The geometry every chunk of one call shares: element size `es`, `n` ranks, this rank `r`,
/// the common element count and the slot size.
pub(super) struct Layout {
    pub es: usize,
    pub n: usize,
    pub r: usize,
    pub count: usize,
    pub slot_bytes: usize,
}

impl Layout {
    /// Chunks of `per` elements, where a slot holds `pieces` blocks of a chunk: each chunk's
    /// byte offset and byte length.
    fn chunks_of(&self, pieces: usize) -> impl Iterator<Item = (usize, usize)> {
        let (es, count) = (self.es, self.count);
        let per = (self.slot_bytes / (pieces * es)).max(1);
        (0..count)
            .step_by(per)
            .map(move |a| (a * es, (per.min(count - a)) * es))
    }

    /// Offset `off` of every rank's slot, in rank order.
    fn all(&self, off: usize) -> Vec<Loc> {
        (0..self.n).map(|q| Loc::Slot { rank: q, off }).collect()
    }

    /// Offset `off` of this rank's slot.
    fn me(&self, off: usize) -> Loc {
        Loc::Slot { rank: self.r, off }
    }

    /// Bytes `[a, a + len)` of each of the `n` input blocks of `block` bytes, side by side in
    /// this rank's slot.
    fn blocks_in(&self, block: usize, a: usize, len: usize) -> Vec<Step> {
        (0..self.n)
            .map(|q| Step::Copy {
                dst: self.me(q * len),
                src: Loc::In(q * block + a),
                len,
            })
            .collect()
    }

    /// Bytes `[a, a + len)` of the input into this rank's slot, then the barrier.
    fn slot_in(&self, a: usize, len: usize) -> Vec<Step> {
        vec![
            Step::Copy {
                dst: self.me(0),
                src: Loc::In(a),
                len,
            },
            Step::Barrier,
        ]
    }

    /// Elements of one block of a ring chunk: a chunk's blocks fit half a slot each.
    fn half_elems(&self) -> usize {
        self.slot_bytes / (2 * self.es)
    }

    /// Ring all-reduce: chunks of `n` blocks of at most half a slot: reduce-scatter around the
    /// ring, the last step leaving block r in this rank's slot (averaged there), then gather.
    pub(super) fn ring_all_reduce(&self, avg: bool) -> Vec<Vec<Step>> {
        let (es, n, r, count) = (self.es, self.n, self.r, self.count);
        let half_elems = self.half_elems();
        let half = half_elems * es;
        let per = half_elems * n;
        let mut chunks = Vec::new();
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
        chunks
    }

    /// Ring reduce-scatter: every chunk of the output block, reduced around the ring.
    pub(super) fn ring_reduce_scatter(&self, avg: bool) -> Vec<Vec<Step>> {
        let (es, n, r, count) = (self.es, self.n, self.r, self.count);
        let half_elems = self.half_elems();
        let half = half_elems * es;
        let block_bytes = count * es;
        let mut chunks = Vec::new();
        for a in (0..count).step_by(half_elems) {
            let len = half_elems.min(count - a) * es;
            let block = |q: usize| (q * block_bytes + a * es, len);
            chunks.push(ring_reduce_steps(r, n, half, &block, Loc::Out(a * es), avg));
        }
        chunks
    }

    /// Ring all-gather: every chunk of the input into this rank's slot and its own output
    /// block, then passed around the ring.
    pub(super) fn ring_all_gather(&self) -> Vec<Vec<Step>> {
        let (es, n, r, count) = (self.es, self.n, self.r, self.count);
        let half_elems = self.half_elems();
        let half = half_elems * es;
        let block_bytes = count * es;
        let mut chunks = Vec::new();
        for a in (0..count).step_by(half_elems) {
            let len = half_elems.min(count - a) * es;
            let mut s = vec![
                Step::Copy {
                    dst: self.me(0),
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
        chunks
    }

    /// All-reduce (`root` `None`) and reduce: every chunk of the input into this rank's slot,
    /// then one shot (the ranks that get the result reduce every slot into their output) or two
    /// (each rank reduces its shard of every slot in place, then they gather the shards).
    pub(super) fn reduction(&self, root: Option<usize>, shots: Shots, avg: bool) -> Vec<Vec<Step>> {
        let (es, n, r) = (self.es, self.n, self.r);
        let gets_result = root.is_none_or(|root| root == r);
        let mut chunks = Vec::new();
        for (a, len) in self.chunks_of(1) {
            let mut s = self.slot_in(a, len);
            match shots {
                Shots::One => {
                    if gets_result {
                        s.push(Step::Reduce {
                            dst: Loc::Out(a),
                            inputs: self.all(0),
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
                            dst: self.me(off),
                            inputs: self.all(off),
                            len: bytes,
                        });
                        if avg {
                            s.push(Step::Avg {
                                dst: self.me(off),
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
        chunks
    }

    /// Reduce-scatter: every chunk of the `n` input blocks side by side in this rank's slot,
    /// then this rank's block of every slot reduced into its output.
    pub(super) fn reduce_scatter(&self, avg: bool) -> Vec<Vec<Step>> {
        let block = self.count * self.es;
        let mut chunks = Vec::new();
        for (a, len) in self.chunks_of(self.n) {
            let mut s = self.blocks_in(block, a, len);
            s.push(Step::Barrier);
            s.push(Step::Reduce {
                dst: Loc::Out(a),
                inputs: self.all(self.r * len),
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
        chunks
    }

    /// All-gather, and gather (`takes`: this rank is the root): every chunk of the input into
    /// this rank's slot, then copied out of every slot by the ranks that take the result.
    pub(super) fn gather(&self, takes: bool) -> Vec<Vec<Step>> {
        let block = self.count * self.es;
        let mut chunks = Vec::new();
        for (a, len) in self.chunks_of(1) {
            let mut s = self.slot_in(a, len);
            if takes {
                s.extend((0..self.n).map(|q| Step::Copy {
                    dst: Loc::Out(q * block + a),
                    src: Loc::Slot { rank: q, off: 0 },
                    len,
                }));
            }
            chunks.push(s);
        }
        chunks
    }

    /// Broadcast: every chunk of the root's input into its slot, then copied out of it.
    pub(super) fn broadcast(&self, root: usize) -> Vec<Vec<Step>> {
        let r = self.r;
        let mut chunks = Vec::new();
        for (a, len) in self.chunks_of(1) {
            let mut s = Vec::new();
            if r == root {
                s.push(Step::Copy {
                    dst: self.me(0),
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
        chunks
    }

    /// Scatter: every chunk of the root's `n` input blocks side by side in its slot, then each
    /// rank copies its own block out.
    pub(super) fn scatter(&self, root: usize) -> Vec<Vec<Step>> {
        let (n, r) = (self.n, self.r);
        let block = self.count * self.es;
        let mut chunks = Vec::new();
        for (a, len) in self.chunks_of(n) {
            let mut s = Vec::new();
            if r == root {
                s = self.blocks_in(block, a, len);
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
        chunks
    }

    /// All-to-all: every chunk of the `n` input blocks side by side in this rank's slot, then
    /// this rank's block of every slot copied to its place in the output.
    pub(super) fn all_to_all(&self) -> Vec<Vec<Step>> {
        let (n, r) = (self.n, self.r);
        let block = self.count * self.es;
        let mut chunks = Vec::new();
        for (a, len) in self.chunks_of(n) {
            let mut s = self.blocks_in(block, a, len);
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
        chunks
    }
}
