//! The model behind examples/02_ddp_mlp.rs (and tests/oxccl/ddp_mlp.rs): a multi-layer perceptron
//! with tanh hidden layers and a mean-squared-error loss, forward and backward written out in
//! plain Rust, trained with SGD on synthetic data that every rank can generate by sample index.
//!
//! Parameters are numbered layer by layer: `2 l` is layer l's weight (out x in, row-major),
//! `2 l + 1` its bias. Backward writes each gradient where a [`GradSink`] says and tells it as
//! soon as it is done, last layer first: that is where DDP's `grad_ready` goes (or, computed in
//! DDP's bucket slot, `grad_ready_in_place`).

use std::time::{Duration, Instant};

use oxccl::comm::{Communicator, ReduceOp};
use oxccl::ddp::{CommHook, Ddp, DdpConfig, DdpError, HierarchicalAverager, ModelAverager, Param};

/// Sizes of the model and of each rank's batch.
#[derive(Clone, Debug)]
pub struct Shape {
    /// Input features.
    pub input: usize,
    /// Width of every hidden layer.
    pub hidden: usize,
    /// Number of hidden layers.
    pub layers: usize,
    /// Outputs.
    pub output: usize,
    /// Samples per rank per step.
    pub batch: usize,
    /// SGD learning rate.
    pub lr: f32,
    /// Time every backward pass also waits with the CPU idle, spread over the layers in
    /// proportion to their work (as a trainer whose backward runs on an accelerator waits for
    /// it): compute an overlapped all-reduce can hide without competing for a CPU. Zero by
    /// default.
    pub idle_backward: Duration,
}

impl Default for Shape {
    fn default() -> Shape {
        Shape {
            input: 32,
            hidden: 64,
            layers: 3,
            output: 4,
            batch: 16,
            lr: 0.2,
            idle_backward: Duration::ZERO,
        }
    }
}

/// SplitMix64: the data and the initial weights are functions of an index.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A number in [-1, 1) from a hash.
fn unit(h: u64) -> f32 {
    (h >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Samples `first..first + count`: inputs (count x input) and targets (count x output), where
/// target j = sin(x . c_j) for fixed directions c_j.
pub fn samples(shape: &Shape, first: usize, count: usize) -> (Vec<f32>, Vec<f32>) {
    let mut x = Vec::with_capacity(count * shape.input);
    let mut t = Vec::with_capacity(count * shape.output);
    for s in first..first + count {
        let row: Vec<f32> = (0..shape.input)
            .map(|i| unit(mix((s as u64) << 20 | i as u64)))
            .collect();
        for j in 0..shape.output {
            let dot: f32 = row
                .iter()
                .enumerate()
                .map(|(i, v)| v * unit(mix(0xC0FFEE ^ ((j as u64) << 32 | i as u64))))
                .sum();
            t.push((dot / (shape.input as f32).sqrt()).sin());
        }
        x.extend(row);
    }
    (x, t)
}

/// The model: layer widths and parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Mlp {
    /// Widths: input, hidden..., output.
    pub dims: Vec<usize>,
    /// Weight and bias of each layer, in that order.
    pub params: Vec<Vec<f32>>,
}

impl Mlp {
    /// Weights uniform in +-1/sqrt(fan_in) from `seed`, biases zero.
    pub fn new(shape: &Shape, seed: u64) -> Mlp {
        let mut dims = vec![shape.input];
        dims.extend(std::iter::repeat_n(shape.hidden, shape.layers));
        dims.push(shape.output);
        let mut params = Vec::new();
        for l in 0..dims.len() - 1 {
            let (fan_in, out) = (dims[l], dims[l + 1]);
            let scale = 1.0 / (fan_in as f32).sqrt();
            params.push(
                (0..fan_in * out)
                    .map(|k| scale * unit(mix(seed << 48 ^ (l as u64) << 40 ^ k as u64)))
                    .collect(),
            );
            params.push(vec![0.0; out]);
        }
        Mlp { dims, params }
    }

    /// Parameter names: `layer{l}.weight`, `layer{l}.bias`.
    pub fn names(&self) -> Vec<String> {
        (0..self.params.len())
            .map(|p| format!("layer{}.{}", p / 2, ["weight", "bias"][p % 2]))
            .collect()
    }

    /// Parameter shapes, for `PowerSgd`: `[out, in]` for a weight (stored row by row), `[out]`
    /// for a bias.
    pub fn shapes(&self) -> Vec<Vec<usize>> {
        (0..self.params.len())
            .map(|p| {
                let l = p / 2;
                if p % 2 == 0 {
                    vec![self.dims[l + 1], self.dims[l]]
                } else {
                    vec![self.dims[l + 1]]
                }
            })
            .collect()
    }

    /// Mean loss on 256 samples from sample 2^20 on: no step trains on them while steps x ranks
    /// x batch stays below 2^20 (training takes samples from 0 up).
    pub fn held_out_loss(&self, shape: &Shape) -> f32 {
        let (x, t) = samples(shape, 1 << 20, 256);
        let acts = self.forward(&x, 256);
        let y = &acts[acts.len() - 1];
        y.iter()
            .zip(&t)
            .map(|(y, t)| 0.5 * (y - t).powi(2))
            .sum::<f32>()
            / 256.0
    }

    /// Activations of every layer for a batch: `acts[0]` is the input, `acts[l + 1]` layer l's
    /// output (tanh except the last).
    pub fn forward(&self, x: &[f32], batch: usize) -> Vec<Vec<f32>> {
        let mut acts = vec![x.to_vec()];
        let last = self.dims.len() - 2;
        for l in 0..=last {
            let (n_in, n_out) = (self.dims[l], self.dims[l + 1]);
            let (w, b) = (&self.params[2 * l], &self.params[2 * l + 1]);
            let input = &acts[l];
            let mut out = vec![0.0f32; batch * n_out];
            // Weight rows outside, samples inside: each row is read from memory once.
            for o in 0..n_out {
                let row = &w[o * n_in..(o + 1) * n_in];
                for s in 0..batch {
                    let v = dot(row, &input[s * n_in..(s + 1) * n_in]) + b[o];
                    out[s * n_out + o] = if l == last { v } else { v.tanh() };
                }
            }
            acts.push(out);
        }
        acts
    }

    /// Backward for the loss `sum over samples of 0.5 |y - t|^2 / norm`: computes every
    /// parameter's gradient into `sink.slot(p)`, last layer first, and calls `sink.ready(p)` as
    /// soon as it is done; returns the loss. `idle` is [`Shape::idle_backward`]: each layer's
    /// weight gradient and the gradient passed down through its weights (none below the first
    /// layer) each wait their share of it, in proportion to the weight's size.
    pub fn backward(
        &self,
        acts: &[Vec<f32>],
        targets: &[f32],
        batch: usize,
        norm: f32,
        idle: Duration,
        sink: &mut dyn GradSink,
    ) -> f32 {
        let layers = self.dims.len() - 1;
        let weight = |l: usize| (self.dims[l] * self.dims[l + 1]) as f64;
        let units: f64 = (0..layers)
            .map(|l| weight(l) * if l > 0 { 2.0 } else { 1.0 })
            .sum();
        // Each wait sleeps its share plus what was due before and not slept yet, less what
        // earlier sleeps overshot: the waits add up to `idle`, give or take the last overshoot.
        let (mut due, mut slept) = (0.0f64, Duration::ZERO);
        let mut wait = |l: usize| {
            if !idle.is_zero() && units > 0.0 {
                due += weight(l) / units;
                let t = Instant::now();
                std::thread::sleep(idle.mul_f64(due.min(1.0)).saturating_sub(slept));
                slept += t.elapsed();
            }
        };
        let y = &acts[layers];
        let mut loss = 0.0f32;
        // d loss / d y.
        let mut dy: Vec<f32> = y
            .iter()
            .zip(targets)
            .map(|(&y, &t)| {
                loss += 0.5 * (y - t) * (y - t);
                (y - t) / norm
            })
            .collect();
        for l in (0..layers).rev() {
            let (n_in, n_out) = (self.dims[l], self.dims[l + 1]);
            let x = &acts[l];
            let gw = sink.slot(2 * l, n_in * n_out);
            // Row by row of the weight gradient, summing over samples in order (cache-resident).
            for o in 0..n_out {
                let row = &mut gw[o * n_in..(o + 1) * n_in];
                row.fill(0.0);
                for s in 0..batch {
                    axpy(row, dy[s * n_out + o], &x[s * n_in..(s + 1) * n_in]);
                }
            }
            wait(l);
            sink.ready(2 * l);
            let gb = sink.slot(2 * l + 1, n_out);
            for (o, g) in gb.iter_mut().enumerate() {
                *g = 0.0;
                for s in 0..batch {
                    *g += dy[s * n_out + o];
                }
            }
            sink.ready(2 * l + 1);
            if l > 0 {
                // Through the weights, then through the previous layer's tanh.
                let w = &self.params[2 * l];
                let mut dx = vec![0.0f32; batch * n_in];
                for o in 0..n_out {
                    let wrow = &w[o * n_in..(o + 1) * n_in];
                    for s in 0..batch {
                        axpy(&mut dx[s * n_in..(s + 1) * n_in], dy[s * n_out + o], wrow);
                    }
                }
                for (d, &a) in dx.iter_mut().zip(x.iter()) {
                    *d *= 1.0 - a * a;
                }
                wait(l);
                dy = dx;
            }
        }
        loss / norm
    }

    /// `param -= lr * grad`.
    pub fn sgd(&mut self, p: usize, grad: &[f32], lr: f32) {
        for (w, g) in self.params[p].iter_mut().zip(grad) {
            *w -= lr * g;
        }
    }
}

/// Dot product in eight lanes (vectorisable, and the same order on every rank).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Where [`Mlp::backward`] writes each gradient, and whom it tells.
pub trait GradSink {
    /// Storage of `len` elements for parameter `p`'s gradient; backward overwrites it.
    fn slot(&mut self, p: usize, len: usize) -> &mut [f32];
    /// Parameter `p`'s gradient is in its slot.
    fn ready(&mut self, p: usize);
}

/// Gradients kept in vectors of their own, one per parameter (sized on first use).
impl GradSink for Vec<Vec<f32>> {
    fn slot(&mut self, p: usize, len: usize) -> &mut [f32] {
        let v = &mut self[p];
        v.resize(len, 0.0);
        v
    }

    fn ready(&mut self, _: usize) {}
}

/// Each gradient computed into one reused buffer and handed to a closure when done (for
/// `Ddp::grad_ready`, which copies it).
pub struct Handed<F: FnMut(usize, &[f32])> {
    buf: Vec<f32>,
    on_grad: F,
}

impl<F: FnMut(usize, &[f32])> Handed<F> {
    /// Hands every gradient to `on_grad(p, g)`.
    pub fn new(on_grad: F) -> Handed<F> {
        Handed {
            buf: Vec::new(),
            on_grad,
        }
    }
}

impl<F: FnMut(usize, &[f32])> GradSink for Handed<F> {
    fn slot(&mut self, _: usize, len: usize) -> &mut [f32] {
        self.buf.resize(len, 0.0);
        &mut self.buf
    }

    fn ready(&mut self, p: usize) {
        (self.on_grad)(p, &self.buf);
    }
}

/// Gradients computed in their DDP bucket slots (`Ddp::grad_slot`, then
/// `Ddp::grad_ready_in_place`); after an error, into a scratch buffer, the error kept for the
/// caller.
struct Slots<'a, C: std::borrow::Borrow<Communicator>> {
    ddp: &'a mut Ddp<C>,
    rank: usize,
    scratch: Vec<f32>,
    failed: Option<DdpError>,
}

impl<C: std::borrow::Borrow<Communicator>> GradSink for Slots<'_, C> {
    fn slot(&mut self, p: usize, len: usize) -> &mut [f32] {
        if self.failed.is_none() {
            match self.ddp.grad_slot::<f32>(p) {
                Ok((slot, true)) => return slot,
                Ok((_, false)) => {
                    self.failed = Some(DdpError::InvalidArgument {
                        rank: self.rank,
                        op: "grad_slot",
                        msg: "the example overwrites slots; it does not accumulate".into(),
                    })
                }
                Err(e) => self.failed = Some(e),
            }
        }
        self.scratch.resize(len, 0.0);
        &mut self.scratch
    }

    fn ready(&mut self, p: usize) {
        if self.failed.is_none() {
            self.failed = self.ddp.grad_ready_in_place(p).err();
        }
    }
}

/// How a step communicates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// DDP with `grad_ready` during backward: communication overlaps compute.
    Overlap,
    /// DDP with each gradient computed in its bucket slot (`grad_slot`,
    /// `grad_ready_in_place`): as `Overlap` without its copies.
    InPlace,
    /// Backward first, then every gradient through `Ddp::sync`: no overlap.
    After,
    /// Backward only, local gradients (replicas drift apart): the compute time.
    ComputeOnly,
    /// `Ddp::sync` of the model's gradient bytes with no compute: the communication time.
    CommOnly,
}

/// What a rank saw in one step.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// This rank's mean loss over its local batch.
    pub loss: f32,
    /// Wall time of forward, backward, communication and update.
    pub time: Duration,
    /// Wall time of the backward pass alone (with DDP's `grad_ready` calls in overlap mode;
    /// zero with communication only).
    pub backward: Duration,
    /// Wall time of `Ddp::finish` or `Ddp::sync`: the communication backward did not hide
    /// (zero with compute only); of `Ddp::join_step` in a step this rank stood in for.
    pub exposed: Duration,
    /// This rank had run out of data and stood in for the others' step (`Ddp::join_step`):
    /// `loss` is 0.
    pub joined: bool,
    /// The run's averager averaged the parameters after this step's update (its time is in
    /// `exposed`).
    pub averaged: bool,
}

/// Trains with DDP for `steps` steps: rank r starts from seed r (rank 0's weights are broadcast)
/// and takes samples `[(step * world + r) * batch, ...)`. Calls `each(step, model, report)`
/// after every update.
///
/// # Errors
/// Any DDP or communicator error.
pub fn train_ddp<C: std::borrow::Borrow<Communicator>>(
    comm: C,
    shape: &Shape,
    steps: usize,
    mode: Mode,
    cfg: DdpConfig,
    each: impl FnMut(usize, &Mlp, &Ddp<C>, StepReport) -> Result<(), Box<dyn std::error::Error>>,
) -> Result<Mlp, Box<dyn std::error::Error>> {
    let run = Run {
        steps,
        join: false,
        mode,
        cfg,
        hook: None,
        average: None,
    };
    train_ddp_run(comm, shape, run, each)
}

/// How [`train_ddp_run`] trains.
pub struct Run {
    /// Steps of data this rank has.
    pub steps: usize,
    /// After them, stand in for the other ranks' steps (`Ddp::join_step`, `cfg.uneven_inputs`
    /// set alike on every rank) until every rank has joined, applying the averaged gradients as
    /// they do.
    pub join: bool,
    /// How gradients are handed to DDP.
    pub mode: Mode,
    /// DDP's settings.
    pub cfg: DdpConfig,
    /// A comm hook to set (every rank alike), or the default all-reduce.
    pub hook: Option<Box<dyn CommHook>>,
    /// Averages the parameters after the updates it is due at (post-local SGD, with the
    /// `PostLocalSgd` hook).
    pub average: Option<Averager>,
}

/// What averages the parameters in post-local SGD.
pub enum Averager {
    /// Over every rank of DDP's communicator, every few steps.
    Periodic(ModelAverager),
    /// Over nested groups, each at its own period.
    Hierarchical(HierarchicalAverager),
}

impl From<ModelAverager> for Averager {
    fn from(a: ModelAverager) -> Averager {
        Averager::Periodic(a)
    }
}

impl Averager {
    /// Counts a step and averages when due (over `comm` for a periodic averager); returns
    /// whether it averaged.
    ///
    /// # Errors
    /// The averager's.
    pub fn average(
        &mut self,
        comm: &Communicator,
        params: &mut [Vec<f32>],
    ) -> Result<bool, DdpError> {
        match self {
            Averager::Periodic(a) => a.average(comm, params),
            Averager::Hierarchical(a) => Ok(a.average(params)?.is_some()),
        }
    }
}

/// As [`train_ddp`], as `run` says; with `run.join`, `each` is called for the steps this rank
/// stood in for too (`report.joined`).
///
/// # Errors
/// Any DDP or communicator error.
pub fn train_ddp_run<C: std::borrow::Borrow<Communicator>>(
    comm: C,
    shape: &Shape,
    run: Run,
    mut each: impl FnMut(usize, &Mlp, &Ddp<C>, StepReport) -> Result<(), Box<dyn std::error::Error>>,
) -> Result<Mlp, Box<dyn std::error::Error>> {
    let Run {
        steps,
        join,
        mode,
        cfg,
        hook,
        mut average,
    } = run;
    let (rank, world) = (comm.borrow().rank(), comm.borrow().size());
    let mut model = Mlp::new(shape, rank as u64);
    let names = model.names();
    let mut params: Vec<Param> = model
        .params
        .iter_mut()
        .zip(&names)
        .map(|(p, n)| Param::new(n.clone(), p.as_mut_slice()))
        .collect();
    let mut ddp = Ddp::new(comm, &mut params, cfg)?;
    drop(params);
    if let Some(hook) = hook {
        ddp.set_comm_hook(hook)?;
    }
    let mut grads: Vec<Vec<f32>> = model.params.iter().map(|p| vec![0.0; p.len()]).collect();
    for step in 0..steps {
        let (x, t) = samples(shape, (step * world + rank) * shape.batch, shape.batch);
        let start = Instant::now();
        let mut loss = 0.0;
        let mut backward = Duration::ZERO;
        if mode != Mode::CommOnly {
            let acts = model.forward(&x, shape.batch);
            let norm = shape.batch as f32;
            let backward_into = |sink: &mut dyn GradSink| {
                model.backward(&acts, &t, shape.batch, norm, shape.idle_backward, sink)
            };
            let bwd = Instant::now();
            match mode {
                Mode::Overlap => {
                    let mut failed = None;
                    let mut sink = Handed::new(|p, g| {
                        if failed.is_none() {
                            failed = ddp.grad_ready(p, g).err();
                        }
                    });
                    loss = backward_into(&mut sink);
                    if let Some(e) = failed {
                        return Err(e.into());
                    }
                }
                Mode::InPlace => {
                    let mut sink = Slots {
                        ddp: &mut ddp,
                        rank,
                        scratch: Vec::new(),
                        failed: None,
                    };
                    loss = backward_into(&mut sink);
                    if let Some(e) = sink.failed {
                        return Err(e.into());
                    }
                }
                Mode::After | Mode::ComputeOnly | Mode::CommOnly => {
                    loss = backward_into(&mut grads);
                }
            }
            backward = bwd.elapsed();
        }
        let mut exposed = Duration::ZERO;
        match mode {
            Mode::Overlap | Mode::InPlace => {
                let t = Instant::now();
                ddp.finish()?;
                exposed = t.elapsed();
                for p in 0..model.params.len() {
                    model.sgd(p, ddp.grad::<f32>(p)?, shape.lr);
                }
            }
            Mode::After | Mode::ComputeOnly | Mode::CommOnly => {
                if mode != Mode::ComputeOnly {
                    let t = Instant::now();
                    ddp.sync(&mut grads)?;
                    exposed = t.elapsed();
                }
                if mode != Mode::CommOnly {
                    for (p, g) in grads.iter().enumerate() {
                        model.sgd(p, g, shape.lr);
                    }
                }
            }
        }
        let averaged = average_params(&mut average, ddp.comm(), &mut model, &mut exposed)?;
        let time = start.elapsed();
        let report = StepReport {
            loss,
            time,
            backward,
            exposed,
            joined: false,
            averaged,
        };
        each(step, &model, &ddp, report)?;
    }
    // Out of data: stand in for the other ranks' steps until every rank has joined.
    for step in (steps..).take_while(|_| join) {
        let start = Instant::now();
        if ddp.join_step()?.is_none() {
            break;
        }
        let mut exposed = start.elapsed();
        for p in 0..model.params.len() {
            model.sgd(p, ddp.grad::<f32>(p)?, shape.lr);
        }
        let averaged = average_params(&mut average, ddp.comm(), &mut model, &mut exposed)?;
        let report = StepReport {
            loss: 0.0,
            time: start.elapsed(),
            backward: Duration::ZERO,
            exposed,
            joined: true,
            averaged,
        };
        each(step, &model, &ddp, report)?;
    }
    Ok(model)
}

/// Runs `average` (when there is one) on the model's parameters; adds its time to `exposed`.
fn average_params(
    average: &mut Option<Averager>,
    comm: &Communicator,
    model: &mut Mlp,
    exposed: &mut Duration,
) -> Result<bool, DdpError> {
    let Some(avg) = average else {
        return Ok(false);
    };
    let t = Instant::now();
    let did = avg.average(comm, &mut model.params)?;
    *exposed += t.elapsed();
    Ok(did)
}

/// One process on the concatenated batches of `ranks`' samples of `step` (each rank's batch
/// is `shape.batch` samples of a world of `world` ranks): one SGD step of `model`.
fn reference_step(model: &mut Mlp, shape: &Shape, world: usize, step: usize, ranks: &[usize]) {
    let (mut x, mut t) = (Vec::new(), Vec::new());
    for &r in ranks {
        let (xr, tr) = samples(shape, (step * world + r) * shape.batch, shape.batch);
        x.extend(xr);
        t.extend(tr);
    }
    let global = ranks.len() * shape.batch;
    let acts = model.forward(&x, global);
    let mut grads = vec![Vec::new(); model.params.len()];
    model.backward(&acts, &t, global, global as f32, Duration::ZERO, &mut grads);
    for (p, g) in grads.iter().enumerate() {
        model.sgd(p, g, shape.lr);
    }
}

/// Post-local SGD in one process: `world` ranks in groups of `group` consecutive ranks (`group`
/// dividing `world`); before step `start` one model trains on every rank's batches, from it each
/// group's model on its ranks' batches, and after the updates of steps `start`, `start +
/// period`, ... the groups' models are replaced by their mean. Returns the groups' models after
/// every step: what DDP with `PostLocalSgd` and a `ModelAverager` must reproduce on the ranks of
/// each group.
pub fn train_reference_local(
    shape: &Shape,
    world: usize,
    group: usize,
    steps: usize,
    start: usize,
    period: usize,
) -> Vec<Vec<Mlp>> {
    let every = |step: usize| {
        (step >= start && (step - start).is_multiple_of(period.max(1))).then_some(world)
    };
    train_reference_groups(shape, world, group, steps, start, every)
}

/// As [`train_reference_local`], with the models averaged after step `s`'s update over groups
/// of `averaged(s)` consecutive ranks (a multiple of `group` dividing `world`), or not at all
/// for `None`: a `HierarchicalAverager`'s levels.
pub fn train_reference_groups(
    shape: &Shape,
    world: usize,
    group: usize,
    steps: usize,
    start: usize,
    averaged: impl Fn(usize) -> Option<usize>,
) -> Vec<Vec<Mlp>> {
    let group = group.max(1);
    let groups = world / group;
    let mut models = vec![Mlp::new(shape, 0); groups];
    let mut out = Vec::with_capacity(steps);
    for step in 0..steps {
        for (g, model) in models.iter_mut().enumerate() {
            let ranks: Vec<usize> = if step < start {
                (0..world).collect()
            } else {
                (g * group..(g + 1) * group).collect()
            };
            reference_step(model, shape, world, step, &ranks);
        }
        if let Some(size) = averaged(step) {
            // Each averaging group holds size / group of the groups' models, weighted alike.
            for chunk in models.chunks_mut((size / group).max(1)) {
                let mut mean = chunk[0].clone();
                for (p, m) in mean.params.iter_mut().enumerate() {
                    for (i, x) in m.iter_mut().enumerate() {
                        let sum: f32 = chunk.iter().map(|g| g.params[p][i]).sum();
                        *x = sum / chunk.len() as f32;
                    }
                }
                chunk.fill(mean);
            }
        }
        out.push(models.clone());
    }
    out
}

/// One process on the concatenated batches of the ranks that have data in each step (rank r
/// has `steps[r]` steps; equal counts for the usual run): the model DDP must reproduce, with
/// `UnevenInputs::DivideByActiveRanks` where the counts differ. Returns the model after every
/// step, up to the longest rank's last.
pub fn train_reference(shape: &Shape, steps: &[usize]) -> Vec<Mlp> {
    let mut model = Mlp::new(shape, 0);
    let world = steps.len();
    let last = steps.iter().copied().max().unwrap_or(0);
    let mut out = Vec::with_capacity(last);
    for step in 0..last {
        let active: Vec<usize> = (0..world).filter(|&r| steps[r] > step).collect();
        reference_step(&mut model, shape, world, step, &active);
        out.push(model.clone());
    }
    out
}

/// Largest |a - b| / max(|b|, 1e-3) over every parameter.
pub fn max_rel_diff(a: &Mlp, b: &Mlp) -> f32 {
    a.params
        .iter()
        .flatten()
        .zip(b.params.iter().flatten())
        .map(|(x, y)| (x - y).abs() / y.abs().max(1e-3))
        .fold(0.0, f32::max)
}

/// A hash of every parameter's bits, for comparing replicas across ranks.
pub fn param_hash(m: &Mlp) -> u64 {
    m.params
        .iter()
        .flatten()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
            (h ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3)
        })
}

/// True when every rank's model has the same bits (one all-reduce of the hash).
///
/// # Errors
/// The all-reduce's errors.
pub fn replicas_identical(comm: &Communicator, m: &Mlp) -> Result<bool, oxccl::comm::Error> {
    let h = param_hash(m);
    let mut v = [h, !h];
    comm.all_reduce(&mut v, ReduceOp::Max)?;
    Ok(v == [h, !h])
}
