//! PowerSGD: a comm hook that all-reduces a low-rank approximation of each weight matrix
//! (Vogels, Karimireddy and Jaggi, 2019; PyTorch's `powerSGD_hook`).
//!
//! For a gradient viewed as an `n x m` matrix `M` (a parameter of shape `[n, d1, d2, ..]` is
//! viewed as `n x (d1 * d2 * ..)`) and a rank `r`, one step is one round of power iteration:
//!
//! 1. with error feedback, add the part of last step's gradient that the approximation missed;
//! 2. `P = M Q` (`n x r`, `Q` is `m x r`: random at first, last step's with warm start), and
//!    all-reduce the average of `P`;
//! 3. orthonormalise the columns of `P`, `Q = M^T P`, and all-reduce the average of `Q`;
//! 4. the averaged gradient is approximated by `P Q^T`; what it missed of this rank's `M` is the
//!    error fed back next step.
//!
//! `(n + m) r` elements go on the wire instead of `n m`. Vectors and tensors that would not
//! shrink by [`PowerSgdConfig::min_compression_rate`] are all-reduced in full, in the same
//! collective as `P`; a bucket with nothing to compress, or of a dtype other than f32 and f64,
//! goes through the plain average ([`AllReduceAvg`]). Every rank gets the same `P` and `Q`, hence
//! the same result, so replicas stay identical.
//!
//! Each step's `Q` starts from the last step's (warm start) or zeros, orthonormalised; a column
//! that is zero or depends on the others (after a step whose averaged gradient had lower rank
//! than `r`, e.g. all zeros) is redrawn from noise seeded alike on every rank.
//!
//! Error feedback assumes, as training gives, that the gradients' dominant directions change
//! slowly from step to step, so that the warm-started power iteration follows them: with an
//! unrelated random subspace in every step, what it misses grows from step to step
//! (`ddp/tests/ddp/powersgd.rs`).
//!
//! With error feedback, a rank whose gradient is zero still sends its residual (its last input
//! less the averaged approximation): a rank that has joined
//! ([`Ddp::join_step`](crate::Ddp::join_step)) keeps contributing it, as with PyTorch's hook.

use std::collections::HashMap;
use std::ops::{Add, AddAssign, Mul, Sub};
use std::sync::{Arc, Mutex};

use oxccl_comm::{Communicator, DType, Element, ReduceOp};

use crate::error::{DdpError, Result};
use crate::flat::FlatBuffer;
use crate::hooks::{AllReduceAvg, BucketEntry, CommHook, GradBucket, HookWork};

/// Settings of [`PowerSgd`]. `Default` gives PyTorch's defaults.
#[derive(Clone, Debug)]
pub struct PowerSgdConfig {
    /// Rank `r` of each matrix's approximation (PyTorch's `matrix_approximation_rank`; default
    /// 1). Higher ranks send more and approximate better.
    pub rank: usize,
    /// Synchronised steps all-reduced in full before compression starts (PyTorch's
    /// `start_powerSGD_iter`, default 1000): early training is sensitive to compression.
    pub start_step: u64,
    /// A matrix is compressed only when `n m` exceeds `(n + m) r` by more than this factor
    /// (default 2).
    pub min_compression_rate: f64,
    /// Feed back what the approximation missed into the next step's gradient (default on).
    pub error_feedback: bool,
    /// Start each step's power iteration from the last step's `Q` (default on); off, from a fresh
    /// random `Q` every step.
    pub warm_start: bool,
    /// Seed of the random `Q`s, the same on every rank (default 0).
    pub seed: u64,
}

impl Default for PowerSgdConfig {
    fn default() -> PowerSgdConfig {
        PowerSgdConfig {
            rank: 1,
            start_step: 1000,
            min_compression_rate: 2.0,
            error_feedback: true,
            warm_start: true,
            seed: 0,
        }
    }
}

/// The PowerSGD comm hook (see the module docs). Set it with
/// [`Ddp::set_comm_hook`](crate::Ddp::set_comm_hook) on every rank, with the same settings and
/// shapes.
pub struct PowerSgd {
    cfg: PowerSgdConfig,
    shapes: Vec<Vec<usize>>,
    /// Synchronised steps begun (counted at bucket 0), and the current one.
    started: u64,
    step: u64,
    /// Buckets started in the current step: the next step drops the state of buckets this
    /// one did not have (the layout changed).
    used: Vec<usize>,
    /// Per bucket index: the error and `Q` kept between steps. A bucket's state is taken out
    /// while its work is in flight and put back when it completes.
    states: Arc<Mutex<HashMap<usize, State>>>,
}

impl std::fmt::Debug for PowerSgd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PowerSgd")
            .field("cfg", &self.cfg)
            .field("params", &self.shapes.len())
            .field("step", &self.step)
            .finish()
    }
}

/// What one bucket keeps between steps: valid for its layout and dtype only.
struct State {
    key: Vec<BucketEntry>,
    dtype: DType,
    /// Bucket-long; zero outside the compressed matrices.
    error: Option<FlatBuffer>,
    /// The transposed `Q`s of the compressed matrices, one after another.
    q: Option<FlatBuffer>,
}

/// A compressed matrix of a bucket: `n x m` at element `off`, rank `r`; its `P^T` (`r x n`) at
/// `p` in the first round's buffer, past the uncompressed values, and its `Q^T` (`r x m`) at `q`.
#[derive(Clone, Copy, Debug)]
struct Mat {
    off: usize,
    n: usize,
    m: usize,
    r: usize,
    p: usize,
    q: usize,
}

/// How a bucket is sent.
#[derive(Debug, Default)]
struct Plan {
    mats: Vec<Mat>,
    /// Uncompressed ranges (offset, len), sent first in the first round.
    flat: Vec<(usize, usize)>,
    flat_len: usize,
    p_len: usize,
    q_len: usize,
}

impl PowerSgd {
    /// The hook, with `shapes[p]` the shape of parameter `p` (in the order given to
    /// [`Ddp::new`](crate::Ddp::new)); its product must be the parameter's length. A shape
    /// of one dimension (or none) is sent in full.
    pub fn new(cfg: PowerSgdConfig, shapes: Vec<Vec<usize>>) -> PowerSgd {
        PowerSgd {
            cfg,
            shapes,
            started: 0,
            step: 0,
            used: Vec::new(),
            states: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// The settings.
    pub fn config(&self) -> &PowerSgdConfig {
        &self.cfg
    }

    /// Elements on the wire for one step of a bucket of `dtype` holding `params` (laid out one
    /// after another from element 0), and the bucket's elements: what compression saves, once
    /// `start_step` is reached. Buckets of dtypes other than f32 and f64 are sent in full.
    ///
    /// # Errors
    /// `InvalidArgument`, as the hook's for a bucket of f32 or f64: a parameter without a shape,
    /// or whose shape does not match its length; a rank of 0 or a bad `min_compression_rate`;
    /// lengths whose sum overflows.
    pub fn wire_elements(
        &self,
        rank: usize,
        dtype: DType,
        params: &[BucketEntry],
    ) -> Result<(usize, usize)> {
        let full = params
            .iter()
            .try_fold(0usize, |a, e| a.checked_add(e.len))
            .ok_or_else(|| Self::invalid(rank, "bucket length overflows".into()))?;
        let plan = self.plan(rank, params, full)?;
        if !matches!(dtype, DType::F32 | DType::F64) || plan.mats.is_empty() {
            return Ok((full, full));
        }
        Ok((plan.flat_len + plan.p_len + plan.q_len, full))
    }

    fn invalid(rank: usize, msg: String) -> DdpError {
        DdpError::InvalidArgument {
            rank,
            op: "powersgd hook",
            msg,
        }
    }

    /// Which matrices of the bucket are compressed, and where their factors go.
    fn plan(&self, rank: usize, params: &[BucketEntry], buffer_len: usize) -> Result<Plan> {
        let c = &self.cfg;
        if c.rank == 0 {
            return Err(Self::invalid(
                rank,
                "rank of the approximation must be at least 1".into(),
            ));
        }
        if !(c.min_compression_rate.is_finite() && c.min_compression_rate >= 0.0) {
            return Err(Self::invalid(
                rank,
                format!(
                    "min_compression_rate must be finite and not negative, not {}",
                    c.min_compression_rate
                ),
            ));
        }
        let mut plan = Plan::default();
        for e in params {
            if e.offset
                .checked_add(e.len)
                .is_none_or(|end| end > buffer_len)
            {
                return Err(Self::invalid(
                    rank,
                    format!(
                        "parameter {} at elements {}..+{} lies outside the bucket of {buffer_len}",
                        e.param, e.offset, e.len
                    ),
                ));
            }
            let Some(dims) = self.shapes.get(e.param) else {
                return Err(Self::invalid(
                    rank,
                    format!(
                        "no shape for parameter {} (shapes given for {} parameters)",
                        e.param,
                        self.shapes.len()
                    ),
                ));
            };
            let elems = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            if elems != Some(e.len) {
                return Err(Self::invalid(
                    rank,
                    format!(
                        "parameter {} has shape {dims:?} but {} elements",
                        e.param, e.len
                    ),
                ));
            }
            let (n, m) = match dims.as_slice() {
                [n, rest @ ..] if !rest.is_empty() => (*n, e.len / (*n).max(1)),
                _ => (0, 0),
            };
            let r = c.rank.min(n).min(m);
            let full = (n * m) as f64;
            let sent = (n + m) as f64 * r as f64;
            if r > 0 && sent * c.min_compression_rate < full {
                plan.mats.push(Mat {
                    off: e.offset,
                    n,
                    m,
                    r,
                    p: plan.p_len,
                    q: plan.q_len,
                });
                plan.p_len += n * r;
                plan.q_len += m * r;
            } else if e.len > 0 {
                plan.flat.push((e.offset, e.len));
                plan.flat_len += e.len;
            }
        }
        Ok(plan)
    }

    /// One step of a bucket of `T` elements (see the module docs): the first round (the
    /// uncompressed values and `P = M Q`) is issued here; the hook's work waits for it, computes
    /// and all-reduces `Q = M^T P`, writes the approximation `P Q^T` into the bucket and keeps the
    /// error and `Q` for the next step.
    fn start_typed<T: Real>(&mut self, comm: &Communicator, bucket: GradBucket) -> HookWork {
        let rank = comm.rank();
        let plan = match self.plan(rank, &bucket.params, bucket.buffer.len()) {
            Ok(p) if !p.mats.is_empty() => p,
            Ok(_) => return AllReduceAvg.start(comm, bucket),
            Err(e) => return HookWork::new(move || Err(e)),
        };
        let GradBucket {
            index,
            buffer: mut buf,
            params,
        } = bucket;
        let mut st = self.take_state::<T>(index, params);
        let cfg = self.cfg.clone();
        let Some(g) = buf.as_mut_slice::<T>() else {
            return HookWork::new(move || {
                Err(Self::invalid(
                    rank,
                    "bucket dtype dispatched as another".into(),
                ))
            });
        };
        let mut q = self.start_q::<T>(&mut st, &plan, index);
        let mut first = pack_flat(&plan, g);
        // With error feedback, last step's residual is added to each row of a matrix just
        // before the row's products with Q, while it is in cache (one pass over the matrices,
        // not two).
        let err = cfg
            .error_feedback
            .then(|| st.error.as_ref().and_then(|e| e.as_slice::<T>()))
            .flatten()
            .filter(|e| e.len() == g.len());
        if let Some(qs) = q.as_mut_slice::<T>() {
            compute_p(&plan, g, err, qs, &mut first);
        }
        let work = comm.all_reduce_async(first, ReduceOp::Avg);
        let states = Arc::clone(&self.states);
        HookWork::with_comm(move |comm| {
            let mut first = work.wait()?;
            let Some(g) = buf.as_mut_slice::<T>() else {
                return Err(Self::invalid(rank, "bucket dtype changed".into()));
            };
            unpack_flat(&plan, g, &first);
            let pts = &mut first[plan.flat_len..];
            let mut qn = compute_q(&plan, g, pts);
            comm.all_reduce(&mut qn, ReduceOp::Avg)?;
            let mut err = if cfg.error_feedback {
                Some(
                    st.error
                        .take()
                        .filter(|e| e.len() == g.len())
                        .unwrap_or_else(|| FlatBuffer::zeros(T::DTYPE, g.len())),
                )
            } else {
                None
            };
            let err_rows = err.as_mut().and_then(|e| e.as_mut_slice::<T>());
            approximate(&plan, g, pts, &qn, err_rows);
            if cfg.warm_start {
                if let Some(qs) = q.as_mut_slice::<T>() {
                    qs.copy_from_slice(&qn);
                }
                st.q = Some(q);
            }
            st.error = err;
            lock(&states).insert(index, st);
            Ok(buf)
        })
    }

    /// Bucket `index`'s state, taken out of the map while its work is in flight: the one kept
    /// from the last step if it was for the same members and dtype, else a fresh one.
    fn take_state<T: Real>(&self, index: usize, params: Vec<BucketEntry>) -> State {
        let old = lock(&self.states).remove(&index);
        match old {
            Some(s) if s.key == params && s.dtype == T::DTYPE => s,
            _ => State {
                key: params,
                dtype: T::DTYPE,
                error: None,
                q: None,
            },
        }
    }

    /// The `Q` (transposed) each matrix of bucket `index` starts this step from.
    fn start_q<T: Real>(&self, st: &mut State, plan: &Plan, index: usize) -> FlatBuffer {
        let cfg = &self.cfg;
        // The Q each matrix starts from: last step's (warm start) or zeros, orthonormalised, with
        // noise (seeded alike on every rank) where a column is zero or depends on the others:
        // a zero column would otherwise stay zero in every later step.
        let mut q = match st.q.take() {
            Some(q) if cfg.warm_start && q.len() == plan.q_len => q,
            _ => FlatBuffer::zeros(T::DTYPE, plan.q_len),
        };
        if let Some(qs) = q.as_mut_slice::<T>() {
            let mut noise = cfg.seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            noise ^= self.step.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            for mat in &plan.mats {
                let qt = &mut qs[mat.q..mat.q + mat.r * mat.m];
                orthonormalise_rows(qt, mat.r, mat.m);
                let zero = T::from_f64(0.0);
                let mut redrawn = false;
                for row in qt.chunks_exact_mut(mat.m) {
                    if row.iter().all(|&x| x == zero) {
                        row.iter_mut()
                            .for_each(|x| *x = T::from_f64(uniform(&mut noise)));
                        redrawn = true;
                    }
                }
                if redrawn {
                    orthonormalise_rows(qt, mat.r, mat.m);
                }
            }
        }
        q
    }
}

/// The first round's buffer: the uncompressed values of `g`, one range after another, then room
/// for every matrix's `P^T`.
fn pack_flat<T: Real>(plan: &Plan, g: &[T]) -> Vec<T> {
    let mut first = vec![T::from_f64(0.0); plan.flat_len + plan.p_len];
    let mut at = 0;
    for &(off, len) in &plan.flat {
        first[at..at + len].copy_from_slice(&g[off..off + len]);
        at += len;
    }
    first
}

/// `P = M Q` of every matrix, written transposed into `first` past the uncompressed values, with
/// last step's residual `err` (with error feedback) added to each row of `g` first.
fn compute_p<T: Real>(plan: &Plan, g: &mut [T], err: Option<&[T]>, qs: &[T], first: &mut [T]) {
    for mat in &plan.mats {
        let pt = &mut first[plan.flat_len + mat.p..][..mat.r * mat.n];
        let qt = &qs[mat.q..mat.q + mat.r * mat.m];
        for i in 0..mat.n {
            let at = mat.off + i * mat.m;
            let row = &mut g[at..at + mat.m];
            if let Some(err) = err {
                for (x, &e) in row.iter_mut().zip(&err[at..at + mat.m]) {
                    *x += e;
                }
            }
            for k in 0..mat.r {
                pt[k * mat.n + i] = dot(row, &qt[k * mat.m..][..mat.m]);
            }
        }
    }
}

/// Copies the averaged uncompressed values from the first round's buffer back into `g`.
fn unpack_flat<T: Real>(plan: &Plan, g: &mut [T], first: &[T]) {
    let mut at = 0;
    for &(off, len) in &plan.flat {
        g[off..off + len].copy_from_slice(&first[at..at + len]);
        at += len;
    }
}

/// Orthonormalises the columns of every averaged `P` (the rows of `pts`, its `P^T`s) and returns
/// `Q = M^T P` of every matrix, transposed, one after another.
fn compute_q<T: Real>(plan: &Plan, g: &[T], pts: &mut [T]) -> Vec<T> {
    let mut qn = vec![T::from_f64(0.0); plan.q_len];
    for mat in &plan.mats {
        let pt = &mut pts[mat.p..mat.p + mat.r * mat.n];
        orthonormalise_rows(pt, mat.r, mat.n);
        let qt = &mut qn[mat.q..mat.q + mat.r * mat.m];
        for i in 0..mat.n {
            let row = &g[mat.off + i * mat.m..][..mat.m];
            for k in 0..mat.r {
                axpy(&mut qt[k * mat.m..][..mat.m], pt[k * mat.n + i], row);
            }
        }
    }
    qn
}

/// Replaces every matrix of `g` by its approximation `P Q^T` (from the averaged `pts` and `qn`),
/// writing what it missed of each row into `err` (with error feedback).
fn approximate<T: Real>(plan: &Plan, g: &mut [T], pts: &[T], qn: &[T], mut err: Option<&mut [T]>) {
    let mut approx = Vec::new();
    for mat in &plan.mats {
        let pt = &pts[mat.p..mat.p + mat.r * mat.n];
        let qt = &qn[mat.q..mat.q + mat.r * mat.m];
        approx.clear();
        approx.resize(mat.m, T::from_f64(0.0));
        for i in 0..mat.n {
            approx.fill(T::from_f64(0.0));
            for k in 0..mat.r {
                axpy(&mut approx, pt[k * mat.n + i], &qt[k * mat.m..][..mat.m]);
            }
            let at = mat.off + i * mat.m;
            let row = &mut g[at..at + mat.m];
            if let Some(e) = err.as_deref_mut() {
                for ((e, &x), &a) in e[at..at + mat.m].iter_mut().zip(&*row).zip(&approx) {
                    *e = x - a;
                }
            }
            row.copy_from_slice(&approx);
        }
    }
}

impl CommHook for PowerSgd {
    fn name(&self) -> &str {
        "powersgd"
    }

    fn communicates_in_wait(&self) -> bool {
        true
    }

    fn settings(&self) -> Vec<(&'static str, u64)> {
        let c = &self.cfg;
        let dims = self
            .shapes
            .iter()
            .flat_map(|s| std::iter::once(s.len() as u64).chain(s.iter().map(|&d| d as u64)));
        vec![
            ("rank (of each matrix's approximation)", c.rank as u64),
            ("start_step", c.start_step),
            (
                "min_compression_rate (its bits)",
                c.min_compression_rate.to_bits(),
            ),
            ("error_feedback", u64::from(c.error_feedback)),
            ("warm_start", u64::from(c.warm_start)),
            ("seed", c.seed),
            ("the shape count", self.shapes.len() as u64),
            ("the shapes (fingerprint)", crate::agree::fnv1a(dims)),
        ]
    }

    fn start(&mut self, comm: &Communicator, bucket: GradBucket) -> HookWork {
        if bucket.index == 0 {
            self.step = self.started;
            self.started += 1;
            // Every bucket of the last step is done (DDP waited for them), so its state is in
            // the map: keep what the last step used.
            let keep = std::mem::take(&mut self.used);
            lock(&self.states).retain(|b, _| keep.contains(b));
        }
        self.used.push(bucket.index);
        if self.step < self.cfg.start_step {
            return AllReduceAvg.start(comm, bucket);
        }
        match bucket.buffer.dtype() {
            DType::F32 => self.start_typed::<f32>(comm, bucket),
            DType::F64 => self.start_typed::<f64>(comm, bucket),
            _ => AllReduceAvg.start(comm, bucket),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The float types PowerSGD computes in.
trait Real:
    Element + Copy + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self> + AddAssign
{
    /// A row whose norm falls below this fraction of its own when the rows before it are taken
    /// out counts as dependent on them (about a thousand roundings).
    const DEPENDENT: f64;
    fn sqrt(self) -> Self;
}

impl Real for f32 {
    const DEPENDENT: f64 = 1e-4;
    fn sqrt(self) -> f32 {
        f32::sqrt(self)
    }
}

impl Real for f64 {
    const DEPENDENT: f64 = 1e-12;
    fn sqrt(self) -> f64 {
        f64::sqrt(self)
    }
}

/// A uniform number in [-1, 1) from a splitmix64 stream.
fn uniform(s: &mut u64) -> f64 {
    *s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 * (2.0 / (1u64 << 53) as f64) - 1.0
}

/// `a . b`, in eight independent sums (so that the compiler can use vector registers).
fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let zero = T::from_f64(0.0);
    let mut acc = [zero; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = zero;
    for (&x, &y) in ar.iter().zip(br) {
        s += x * y;
    }
    acc.iter().fold(s, |s, &a| s + a)
}

/// `y += a x`.
fn axpy<T: Real>(y: &mut [T], a: T, x: &[T]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Gram-Schmidt on the `r` rows (of `len` elements each) of `v`: orthonormal afterwards, except
/// rows that depend on earlier ones (what is left after taking those out is below
/// [`Real::DEPENDENT`] of the row's norm), which are set to zero. Each row is orthogonalised
/// twice, as one pass loses orthogonality to rounding when much of the row cancels.
fn orthonormalise_rows<T: Real>(v: &mut [T], r: usize, len: usize) {
    for k in 0..r {
        let (done, rest) = v.split_at_mut(k * len);
        let row = &mut rest[..len];
        let before = dot(row, row).sqrt().to_f64();
        for _pass in 0..2 {
            for l in 0..k {
                let prev = &done[l * len..(l + 1) * len];
                let d = dot(row, prev);
                axpy(row, T::from_f64(0.0) - d, prev);
            }
        }
        let norm = dot(row, row).sqrt().to_f64();
        if norm > before * T::DEPENDENT && norm > 0.0 {
            let inv = T::from_f64(1.0 / norm);
            for x in row.iter_mut() {
                *x = *x * inv;
            }
        } else {
            row.fill(T::from_f64(0.0));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gram_schmidt_gives_orthonormal_rows_and_zero_for_dependent_ones() {
        let mut v: Vec<f64> = vec![3.0, 4.0, 0.0, 1.0, 1.0, 1.0, 6.0, 8.0, 0.0];
        orthonormalise_rows(&mut v, 3, 3);
        let row = |k: usize| &v[k * 3..k * 3 + 3];
        assert!((dot(row(0), row(0)) - 1.0).abs() < 1e-12);
        assert!((dot(row(1), row(1)) - 1.0).abs() < 1e-12);
        assert!(dot(row(0), row(1)).abs() < 1e-12);
        assert!(row(2).iter().all(|x| x.abs() < 1e-12), "{:?}", row(2));
    }

    #[test]
    fn dot_matches_the_plain_sum_for_every_remainder() {
        for n in 0..20 {
            let a: Vec<f64> = (0..n).map(|i| i as f64 * 0.5 - 2.0).collect();
            let b: Vec<f64> = (0..n).map(|i| (i % 3) as f64 + 1.0).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert_eq!(dot(&a, &b), want, "n = {n}");
        }
    }

    #[test]
    fn the_state_of_buckets_a_step_no_longer_has_is_dropped() {
        let out = oxccl_comm::harness::spawn_world(1, oxccl_comm::Config::default(), |comm| {
            let cfg = PowerSgdConfig {
                start_step: 0,
                ..PowerSgdConfig::default()
            };
            let mut h = PowerSgd::new(cfg, vec![vec![8, 8], vec![8, 8]]);
            let bucket = |index: usize| GradBucket {
                index,
                buffer: FlatBuffer::zeros(DType::F32, 64),
                params: vec![BucketEntry {
                    param: index,
                    offset: 0,
                    len: 64,
                }],
            };
            let mut kept = Vec::new();
            // Step 0 has buckets 0 and 1, steps 1 and 2 bucket 0 only.
            for step in [&[0usize, 1][..], &[0], &[0]] {
                for &b in step {
                    h.start(&comm, bucket(b)).wait(&comm).expect("hook");
                }
                kept.push(lock(&h.states).len());
            }
            Ok(kept)
        });
        let kept = out.into_iter().next().map(|r| r.expect("rank 0"));
        // Step 1 cannot know yet that bucket 1 is gone; step 2 drops it.
        assert_eq!(kept, Some(vec![2, 2, 1]));
    }

    #[test]
    fn uniform_stays_in_range_and_varies() {
        let mut s = 7;
        let xs: Vec<f64> = (0..1000).map(|_| uniform(&mut s)).collect();
        assert!(xs.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = xs.iter().sum::<f64>() / 1000.0;
        assert!(mean.abs() < 0.1, "mean {mean}");
        assert!(xs.windows(2).all(|w| w[0] != w[1]));
    }
}
