//! The rank side of one (dtype, op) sweep: buffers, the call of each collective (blocking or
//! async), timing, and the checked call.

use std::time::Instant;

use oxccl_comm::{Collective, Communicator, Element, Error, ReduceOp, Registered, Result};

use super::data::{fill, mismatches, Pattern};
use super::sweep::{geometry, has_in_place, Geometry};

/// By default (`--rotate`) the buffer sets cycled through per size fill at least this many bytes
/// (input + output)...
pub const ROTATE_BYTES: usize = 64 << 20;
/// ... with at least 2 and at most this many sets.
pub const MAX_SETS: usize = 64;

/// How per-rank times are combined (`-a`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Average {
    /// Rank 0's time (`-a 0`).
    Rank0,
    /// Mean over ranks (`-a 1`).
    Mean,
    /// Minimum (`-a 2`).
    Min,
    /// Maximum (`-a 3`).
    Max,
}

/// What every (dtype, op) sweep shares.
#[derive(Debug, Clone)]
pub struct Spec {
    /// The collective measured.
    pub coll: Collective,
    /// Root rank for rooted collectives.
    pub root: usize,
    /// `-z 1`: blocking calls only.
    pub blocking: bool,
    /// Timed iterations per measurement.
    pub iters: u32,
    /// Untimed iterations before each measurement.
    pub warmup: u32,
    /// Run a checked call per measurement.
    pub check: bool,
    /// How times are combined over ranks.
    pub average: Average,
    /// Bytes of input + output the rotated sets cover (0: one set).
    pub rotate_bytes: usize,
    /// Buffers in GPU memory (`--device cuda`).
    pub cuda: bool,
    /// all-to-all-v: how uneven the blocks are (`--skew`, 0 to 1).
    pub skew: f64,
    /// `-R 1`: the arenas are [`Registered`].
    pub register: bool,
}

/// An arena of buffers: plain memory, or registered (`-R 1`).
enum Arena<T: Element> {
    Plain(Vec<T>),
    /// Boxed: a window moves through every async call, and the plain form stays three words.
    Registered(Box<Registered<T>>),
}

impl<T: Element> Default for Arena<T> {
    fn default() -> Arena<T> {
        Arena::Plain(Vec::new())
    }
}

impl<T: Element> std::ops::Deref for Arena<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Arena::Plain(v) => v,
            Arena::Registered(r) => r,
        }
    }
}

impl<T: Element> std::ops::DerefMut for Arena<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Arena::Plain(v) => v,
            Arena::Registered(r) => r,
        }
    }
}

/// all-to-all-v's block sizes: the block a rank sends the rank `k` places after it (mod `n`)
/// holds `per + delta[k]` elements. `delta` is `per x skew x (1 - 2k/(n-1))` rounded down for
/// `k < (n-1)/2` and the negative of its mirror `delta[n-1-k]` above, so it sums to 0: every
/// rank sends and receives `per x n` elements, in blocks from about `per x (1 - skew)` to
/// `per x (1 + skew)`.
pub fn skewed_counts(per: usize, n: usize, skew: f64) -> Vec<usize> {
    let mut delta = vec![0i64; n];
    if n > 1 {
        let half = (n - 1) as f64 / 2.0;
        for k in 0..n / 2 {
            let d = (per as f64 * skew.clamp(0.0, 1.0) * (half - k as f64) / half).floor() as i64;
            delta[k] = d;
            delta[n - 1 - k] = -d;
        }
    }
    delta
        .iter()
        .map(|&d| usize::try_from(per as i64 + d).unwrap_or(0))
        .collect()
}

/// all-gather-v's and reduce-scatter-v's shard of rank `r` (`skewed_counts(per, n, skew)[r]`
/// elements): where it starts in the full buffer, and its length.
fn v_shard(per: usize, n: usize, skew: f64, r: usize) -> (usize, usize) {
    let counts = skewed_counts(per, n, skew);
    (counts[..r].iter().sum(), counts[r])
}

/// Buffer sets used for a buffer of `full_bytes` (input and output each that large) when the
/// sets are to cover `rotate_bytes` (0: a single set, no rotation).
pub fn sets_for(rotate_bytes: usize, full_bytes: usize) -> usize {
    if rotate_bytes == 0 {
        return 1;
    }
    rotate_bytes
        .div_ceil(full_bytes.saturating_mul(2).max(1))
        .clamp(2, MAX_SETS)
}

/// `MemAvailable` of `/proc/meminfo` in bytes (`None` where it cannot be read).
fn mem_available() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// An owned window into an arena, so an async call can own the arena while it runs.
struct Window<T: Element> {
    v: Arena<T>,
    off: usize,
    len: usize,
}

impl<T: Element> AsRef<[T]> for Window<T> {
    fn as_ref(&self) -> &[T] {
        &self.v[self.off..self.off + self.len]
    }
}

impl<T: Element> AsMut<[T]> for Window<T> {
    fn as_mut(&mut self) -> &mut [T] {
        &mut self.v[self.off..self.off + self.len]
    }
}

/// Whether `oxccl perf -z 0` times an async form of the collective (every one but send-recv,
/// whose `send_recv` has none, and the barrier, which perf does not time).
pub fn has_async(c: Collective) -> bool {
    matches!(
        c,
        Collective::AllReduce
            | Collective::ReduceScatter
            | Collective::AllGather
            | Collective::Broadcast
            | Collective::Reduce
            | Collective::Gather
            | Collective::Scatter
            | Collective::AllToAll
            | Collective::AllToAllV
            | Collective::AllGatherV
            | Collective::ReduceScatterV
            | Collective::GatherV
            | Collective::ScatterV
    )
}

/// The buffers of one dtype: input arena `a`, output (and in-place) arena `b`, both holding
/// `sets` consecutive full-size buffers.
pub struct Bench<'c, T: Element> {
    comm: &'c Communicator,
    spec: Spec,
    a: Arena<T>,
    b: Arena<T>,
    /// all-to-all-v: this rank's send and receive counts for blocks of `.0` elements, made once
    /// per size so the timed calls do not allocate.
    v_counts: (usize, Vec<usize>, Vec<usize>),
    /// The device mirror of `a` and `b` (`--device cuda`).
    #[cfg(feature = "cuda")]
    dev: Option<super::device::DevArenas>,
}

/// One measurement: the combined time per call in seconds and the wrong-element count.
pub type Outcome = (f64, Option<u64>);

impl<'c, T: Element> Bench<'c, T> {
    /// Allocates (and touches) arenas large enough for every size of `sizes`, and their device
    /// copies with `--device cuda`.
    ///
    /// # Errors
    /// `Cuda` when the device arenas cannot be made.
    pub fn new(comm: &'c Communicator, spec: Spec, sizes: &[u64]) -> Result<Bench<'c, T>> {
        let ts = T::DTYPE.size();
        let invalid = |msg: String| Error::InvalidArgument {
            rank: comm.rank(),
            op: format!("perf {}", spec.coll),
            msg,
        };
        let mut arena = 0usize;
        for &s in sizes {
            let g = geometry(spec.coll, s, ts, comm.size());
            let sets = sets_for(spec.rotate_bytes, g.bytes);
            let elems = g
                .full
                .checked_mul(sets)
                .filter(|e| e.checked_mul(2 * ts).is_some())
                .ok_or_else(|| invalid(format!("{sets} buffer sets of {s} bytes overflow")))?;
            arena = arena.max(elems);
        }
        // Input and output arenas, each `arena` elements: refuse what this node cannot hold
        // instead of dying in the allocator or the OOM killer half-way through the fill.
        let need = arena * ts * 2;
        if let Some(avail) = mem_available() {
            let node = need.saturating_mul(comm.local_size());
            if node > avail {
                return Err(invalid(format!(
                    "the buffers need {need} bytes per rank (input and output arenas: the largest \
                     size, -e, times the buffer sets of --rotate), {node} for the {} ranks of \
                     this node, but only {avail} bytes are available",
                    comm.local_size()
                )));
            }
        }
        let zero = T::from_f64(0.0);
        let alloc = |n: usize| -> Result<Vec<T>> {
            let mut v = Vec::new();
            v.try_reserve_exact(n)
                .map_err(|e| invalid(format!("cannot allocate {} bytes: {e}", n * ts)))?;
            v.resize(n, zero);
            Ok(v)
        };
        let mut a = alloc(arena)?;
        let mut b = alloc(arena)?;
        // First touch outside any timing (vec! of zeros may hand out untouched pages).
        a.fill(T::from_f64(1.0));
        b.fill(zero);
        let (a, b) = if spec.register {
            let reg = |v: Vec<T>| Registered::new(v).map(|r| Arena::Registered(Box::new(r)));
            (reg(a)?, reg(b)?)
        } else {
            (Arena::Plain(a), Arena::Plain(b))
        };
        #[cfg(feature = "cuda")]
        let dev = if spec.cuda {
            let bytes = arena * ts;
            Some(super::device::DevArenas::new(comm, bytes, bytes)?)
        } else {
            None
        };
        Ok(Bench {
            comm,
            spec,
            a,
            b,
            v_counts: (usize::MAX, Vec::new(), Vec::new()),
            #[cfg(feature = "cuda")]
            dev,
        })
    }

    /// Whether the in-place form is measured (device buffers: all-reduce and broadcast only).
    pub fn in_place(&self) -> bool {
        has_in_place(self.spec.coll)
            && (!self.spec.cuda
                || matches!(
                    self.spec.coll,
                    Collective::AllReduce | Collective::Broadcast
                ))
    }

    /// Copies the first `elems` of the input arena (and of the output arena with `both`) to the
    /// device (nothing for host buffers).
    fn upload(&mut self, elems: usize, both: bool) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(d) = &mut self.dev {
            let rank = self.comm.rank();
            d.upload(rank, false, bytemuck::cast_slice(&self.a[..elems]))?;
            if both {
                d.upload(rank, true, bytemuck::cast_slice(&self.b[..elems]))?;
            }
        }
        let _ = (elems, both);
        Ok(())
    }

    /// Copies the first `elems` of the device output arena back (nothing for host buffers).
    fn download(&mut self, elems: usize) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(d) = &self.dev {
            d.download(
                self.comm.rank(),
                bytemuck::cast_slice_mut(&mut self.b[..elems]),
            )?;
        }
        let _ = elems;
        Ok(())
    }

    /// Waits for the device stream (nothing for host buffers).
    fn sync(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(d) = &self.dev {
            d.sync(self.comm.rank())?;
            if let Some(e) = self.comm.device_async_error() {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Fills every input buffer with this rank's pattern (realistic data for the timed calls).
    ///
    /// # Errors
    /// `Cuda` if the copy to the device fails.
    pub fn fill_inputs(&mut self, pat: &Pattern<T>) -> Result<()> {
        fill(&mut self.a, pat.rank(self.comm.rank()), 0);
        let n = self.a.len();
        self.upload(n, false)
    }

    /// Times and (with `-c`) checks one placement of one size.
    ///
    /// # Errors
    /// Any error of the collective calls.
    pub fn measure(
        &mut self,
        g: &Geometry,
        in_place: bool,
        op: ReduceOp,
        pat: &Pattern<T>,
    ) -> Result<Outcome> {
        let sets = sets_for(self.spec.rotate_bytes, g.bytes);
        let (warmup, iters) = (self.spec.warmup as usize, self.spec.iters.max(1) as usize);
        for it in 0..warmup {
            self.call(g, it % sets, in_place, op)?;
        }
        self.sync()?;
        self.comm.barrier()?;
        let t0 = Instant::now();
        for it in 0..iters {
            self.call(g, (warmup + it) % sets, in_place, op)?;
        }
        self.sync()?;
        let local = t0.elapsed().as_secs_f64() / iters as f64;
        let time = self.combine(local)?;
        let wrong = if self.spec.check {
            self.prepare(g, in_place, pat);
            self.upload(g.full, true)?;
            self.call(g, 0, in_place, op)?;
            self.sync()?;
            self.download(g.full)?;
            let mut w = [self.verify(g, in_place, pat)];
            self.comm.all_reduce(&mut w, ReduceOp::Sum)?;
            Some(w[0])
        } else {
            None
        };
        Ok((time, wrong))
    }

    fn combine(&self, local: f64) -> Result<f64> {
        let mut t = [local];
        match self.spec.average {
            Average::Rank0 => self.comm.broadcast(&mut t, 0)?,
            Average::Mean => {
                self.comm.all_reduce(&mut t, ReduceOp::Sum)?;
                t[0] /= self.comm.size() as f64;
            }
            Average::Min => self.comm.all_reduce(&mut t, ReduceOp::Min)?,
            Average::Max => self.comm.all_reduce(&mut t, ReduceOp::Max)?,
        }
        Ok(t[0])
    }

    /// One call of the collective on buffer set `set`.
    fn call(&mut self, g: &Geometry, set: usize, in_place: bool, op: ReduceOp) -> Result<()> {
        let coll = self.spec.coll;
        #[cfg(feature = "cuda")]
        if let Some(d) = &mut self.dev {
            return d.call::<T>(self.comm, coll, g, set, in_place, op, self.spec.root);
        }
        let comm = self.comm;
        let (rank, n, root) = (comm.rank(), comm.size(), self.spec.root);
        if matches!(
            coll,
            Collective::AllGatherV
                | Collective::ReduceScatterV
                | Collective::GatherV
                | Collective::ScatterV
        ) && self.v_counts.0 != g.count
        {
            self.v_counts = (
                g.count,
                skewed_counts(g.count, n, self.spec.skew),
                Vec::new(),
            );
        }
        if coll == Collective::AllToAllV && self.v_counts.0 != g.count {
            let block = skewed_counts(g.count, n, self.spec.skew);
            let send = (0..n).map(|d| block[(d + n - rank) % n]).collect();
            let recv = (0..n).map(|s| block[(rank + n - s) % n]).collect();
            self.v_counts = (g.count, send, recv);
        }
        if !self.spec.blocking && has_async(coll) {
            return self.call_async(g, set, in_place, op);
        }
        let base = set * g.full;
        if in_place {
            debug_assert!(has_in_place(coll));
            let buf = &mut self.b[base..base + g.full];
            return match coll {
                Collective::AllReduce => comm.all_reduce(buf, op),
                Collective::ReduceScatter => comm.reduce_scatter(buf, op),
                Collective::AllGather => comm.all_gather(buf),
                Collective::Broadcast => comm.broadcast(buf, root),
                Collective::Reduce => comm.reduce(buf, op, root),
                _ => Ok(()),
            };
        }
        let mine = self.v_counts.1.get(rank).copied().unwrap_or(0);
        let inp = &self.a[base..base + g.input];
        let out = &mut self.b[base..base + g.output];
        let at_root = rank == root;
        match coll {
            Collective::AllReduce => comm.all_reduce_into(inp, out, op),
            Collective::ReduceScatter => comm.reduce_scatter_into(inp, out, op),
            Collective::AllGather => comm.all_gather_into(inp, out),
            Collective::Broadcast => comm.broadcast_into(inp, out, root),
            Collective::Reduce => {
                comm.reduce_into(inp, if at_root { out } else { &mut [] }, op, root)
            }
            Collective::Gather => comm.gather_into(inp, if at_root { out } else { &mut [] }, root),
            Collective::Scatter => comm.scatter_into(if at_root { inp } else { &[] }, out, root),
            Collective::AllToAll => comm.all_to_all_into(inp, out),
            Collective::SendRecv => comm.send_recv(inp, (rank + 1) % n, out, (rank + n - 1) % n),
            Collective::Barrier => comm.barrier(),
            Collective::AllToAllV => {
                comm.all_to_all_v_into(inp, &self.v_counts.1, out, &self.v_counts.2)
            }
            Collective::AllGatherV => comm.all_gather_v_into(&inp[..mine], out, &self.v_counts.1),
            Collective::GatherV => {
                let out = if at_root { out } else { &mut [] };
                comm.gather_v_into(&inp[..mine], out, &self.v_counts.1, root)
            }
            Collective::ScatterV => {
                let inp = if at_root { inp } else { &[] };
                comm.scatter_v_into(inp, &mut out[..mine], &self.v_counts.1, root)
            }
            Collective::ReduceScatterV => {
                comm.reduce_scatter_v_into(inp, &mut out[..mine], &self.v_counts.1, op)
            }
        }
    }

    /// The async form: issue, then wait. The arenas travel into the call and back (as windows
    /// on them), so nothing is copied around the call: out of place, the input is read where it
    /// is, as the blocking forms do.
    fn call_async(&mut self, g: &Geometry, set: usize, in_place: bool, op: ReduceOp) -> Result<()> {
        let (comm, coll, root) = (self.comm, self.spec.coll, self.spec.root);
        let base = set * g.full;
        let window = |v: &mut Arena<T>, len: usize| Window {
            v: std::mem::take(v),
            off: base,
            len,
        };
        if in_place {
            let w = window(&mut self.b, g.full);
            let w = match coll {
                Collective::AllReduce => comm.all_reduce_async::<T, _>(w, op).wait()?,
                Collective::ReduceScatter => comm.reduce_scatter_async::<T, _>(w, op).wait()?,
                Collective::AllGather => comm.all_gather_async::<T, _>(w).wait()?,
                Collective::Reduce => comm.reduce_async::<T, _>(w, op, root).wait()?,
                _ => comm.broadcast_async::<T, _>(w, root).wait()?,
            };
            self.b = w.v;
            return Ok(());
        }
        // all-gather-v's and gather-v's input, reduce-scatter-v's and scatter-v's output: this
        // rank's shard; the root's side of a rooted collective is empty on other ranks.
        let mine = self.v_counts.1.get(comm.rank()).copied().unwrap_or(0);
        let at_root = comm.rank() == root;
        let root_only = |len: usize| if at_root { len } else { 0 };
        let (ni, no) = match coll {
            Collective::AllGatherV => (mine, g.output),
            Collective::ReduceScatterV => (g.input, mine),
            Collective::GatherV => (mine, root_only(g.output)),
            Collective::ScatterV => (root_only(g.input), mine),
            Collective::Reduce | Collective::Gather => (g.input, root_only(g.output)),
            Collective::Scatter => (root_only(g.input), g.output),
            _ => (g.input, g.output),
        };
        let (inp, out) = (window(&mut self.a, ni), window(&mut self.b, no));
        let counts = &self.v_counts.1;
        let (inp, out) = match coll {
            Collective::AllReduce => comm.all_reduce_into_async::<T, _, _>(inp, out, op).wait()?,
            Collective::ReduceScatter => comm
                .reduce_scatter_into_async::<T, _, _>(inp, out, op)
                .wait()?,
            Collective::AllGather => comm.all_gather_into_async::<T, _, _>(inp, out).wait()?,
            Collective::AllGatherV => comm
                .all_gather_v_into_async::<T, _, _>(inp, out, counts)
                .wait()?,
            Collective::ReduceScatterV => comm
                .reduce_scatter_v_into_async::<T, _, _>(inp, out, counts, op)
                .wait()?,
            Collective::Reduce => comm
                .reduce_into_async::<T, _, _>(inp, out, op, root)
                .wait()?,
            Collective::Gather => comm.gather_into_async::<T, _, _>(inp, out, root).wait()?,
            Collective::Scatter => comm.scatter_into_async::<T, _, _>(inp, out, root).wait()?,
            Collective::AllToAll => comm.all_to_all_into_async::<T, _, _>(inp, out).wait()?,
            Collective::AllToAllV => {
                let (sc, rc) = (&self.v_counts.1, &self.v_counts.2);
                comm.all_to_all_v_into_async::<T, _, _>(inp, sc, out, rc)
                    .wait()?
            }
            Collective::GatherV => comm
                .gather_v_into_async::<T, _, _>(inp, out, counts, root)
                .wait()?,
            Collective::ScatterV => comm
                .scatter_v_into_async::<T, _, _>(inp, out, counts, root)
                .wait()?,
            _ => comm
                .broadcast_into_async::<T, _, _>(inp, out, root)
                .wait()?,
        };
        (self.a, self.b) = (inp.v, out.v);
        Ok(())
    }

    /// Sets up buffer set 0 for the checked call: inputs from the pattern, outputs zeroed
    /// (every pattern value is at least 1, so an untouched output is always wrong).
    fn prepare(&mut self, g: &Geometry, in_place: bool, pat: &Pattern<T>) {
        let (rank, root, coll) = (self.comm.rank(), self.spec.root, self.spec.coll);
        let per = g.count;
        let zero = T::from_f64(0.0);
        let mine = pat.rank(rank);
        if in_place {
            let buf = &mut self.b[..g.full];
            match coll {
                Collective::AllGather => {
                    buf.fill(zero);
                    fill(&mut buf[rank * per..(rank + 1) * per], mine, rank * per);
                }
                Collective::Broadcast if rank != root => buf.fill(zero),
                _ => fill(buf, mine, 0),
            }
            return;
        }
        match coll {
            Collective::AllGather | Collective::Gather => {
                fill(&mut self.a[..g.input], mine, rank * per)
            }
            Collective::AllGatherV | Collective::GatherV => {
                let (at, len) = v_shard(per, self.comm.size(), self.spec.skew, rank);
                fill(&mut self.a[..len], mine, at)
            }
            _ => fill(&mut self.a[..g.input], mine, 0),
        }
        self.b[..g.output].fill(zero);
    }

    /// Wrong elements of set 0 on this rank after the checked call.
    fn verify(&self, g: &Geometry, in_place: bool, pat: &Pattern<T>) -> u64 {
        let comm = self.comm;
        let (rank, n, root, coll) = (comm.rank(), comm.size(), self.spec.root, self.spec.coll);
        let per = g.count;
        let b = &self.b;
        // Block r of a gathered buffer holds rank r's values at global indices r*per...
        let gathered = || -> u64 {
            (0..n)
                .map(|r| mismatches(&b[r * per..(r + 1) * per], pat.rank(r), r * per))
                .sum()
        };
        // The same with shards of `skewed_counts` elements (all-gather-v, gather-v).
        let gathered_v = || -> u64 {
            (0..n)
                .map(|r| {
                    let (at, len) = v_shard(per, n, self.spec.skew, r);
                    mismatches(&b[at..at + len], pat.rank(r), at)
                })
                .sum()
        };
        match coll {
            Collective::AllReduce => mismatches(&b[..g.count], pat.reduced(), 0),
            Collective::ReduceScatter => {
                let at = if in_place { rank * per } else { 0 };
                mismatches(&b[at..at + per], pat.reduced(), rank * per)
            }
            Collective::AllGather => gathered(),
            Collective::Gather if rank == root => gathered(),
            Collective::Broadcast => mismatches(&b[..g.count], pat.rank(root), 0),
            Collective::Reduce if rank == root => mismatches(&b[..g.count], pat.reduced(), 0),
            Collective::Scatter => mismatches(&b[..per], pat.rank(root), rank * per),
            Collective::AllToAll => (0..n)
                .map(|r| mismatches(&b[r * per..(r + 1) * per], pat.rank(r), rank * per))
                .sum(),
            Collective::AllGatherV => gathered_v(),
            Collective::GatherV if rank == root => gathered_v(),
            Collective::ReduceScatterV => {
                let (at, len) = v_shard(per, n, self.spec.skew, rank);
                mismatches(&b[..len], pat.reduced(), at)
            }
            Collective::ScatterV => {
                let (at, len) = v_shard(per, n, self.spec.skew, rank);
                mismatches(&b[..len], pat.rank(root), at)
            }
            Collective::AllToAllV => {
                // Rank s's block for this rank starts, in s's input, after its blocks for the
                // ranks before this one; here, after the blocks of the ranks before s.
                let block = skewed_counts(per, n, self.spec.skew);
                let mut at = 0;
                let mut wrong = 0;
                for s in 0..n {
                    let len = block[(rank + n - s) % n];
                    let from: usize = (0..rank).map(|d| block[(d + n - s) % n]).sum();
                    wrong += mismatches(&b[at..at + len], pat.rank(s), from);
                    at += len;
                }
                wrong
            }
            Collective::SendRecv => mismatches(&b[..g.count], pat.rank((rank + n - 1) % n), 0),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skewed_blocks_keep_every_rank_s_total() {
        for (per, n, skew) in [
            (1000, 4, 0.5),
            (7, 3, 1.0),
            (0, 5, 0.5),
            (341, 1, 0.5),
            (10, 8, 0.0),
        ] {
            let b = skewed_counts(per, n, skew);
            assert_eq!(b.len(), n);
            assert_eq!(b.iter().sum::<usize>(), per * n, "{per} {n} {skew}: {b:?}");
            let (lo, hi) = (per as f64 * (1.0 - skew), per as f64 * (1.0 + skew));
            assert!(
                b.iter()
                    .all(|&c| (lo - 1.0..=hi + 1.0).contains(&(c as f64))),
                "{per} {n} {skew}: {b:?}"
            );
        }
        assert_eq!(skewed_counts(1000, 4, 0.5), vec![1500, 1166, 834, 500]);
        assert_eq!(skewed_counts(10, 3, 0.0), vec![10, 10, 10]);
    }

    #[test]
    fn rotation_covers_64_mib_with_2_to_64_sets() {
        let r = ROTATE_BYTES;
        assert_eq!(sets_for(r, 8), MAX_SETS);
        assert_eq!(sets_for(r, 0), MAX_SETS);
        assert_eq!(sets_for(r, 1 << 20), 32);
        assert_eq!(sets_for(r, 32 << 20), 2);
        assert_eq!(sets_for(r, 64 << 20), 2);
        assert_eq!(sets_for(r, 3 << 20), 11);
        assert_eq!(sets_for(8 << 20, 1 << 20), 4);
        assert_eq!(sets_for(0, 1 << 20), 1, "--rotate 0 reuses one set");
        assert_eq!(sets_for(0, 8), 1);
    }
}
