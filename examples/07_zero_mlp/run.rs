//! The training of examples/07_zero_mlp.rs (also run by tests/oxccl/zero_mlp.rs): the MLP of
//! `mlp/mod.rs` trained with node-local ZeRO and AdamW, each gradient handed to
//! `Zero::grad_ready` as backward computes it; the one-process reference it must equal; and the
//! timing of ZeRO against DDP followed by AdamW on every rank.

use std::error::Error;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use oxccl::comm::{Communicator, ReduceOp};
use oxccl::ddp::{Ddp, DdpConfig, Param};
use oxccl::zero::{AdamW, Hyper, ShardGroup, ShardOptimizer, Stage, Zero, ZeroConfig};

use super::mlp::{max_rel_diff, samples, GradSink, Handed, Mlp, Shape};

/// What to train.
#[derive(Clone, Debug)]
pub struct Opts {
    pub shape: Shape,
    pub steps: usize,
    /// Micro-batches per step (each `shape.batch` samples per rank).
    pub micro: usize,
    pub cfg: ZeroConfig,
    /// Compare with the one-process reference after every step.
    pub check: bool,
    /// Save the optimizer after the last step.
    pub save: Option<PathBuf>,
    /// Load the optimizer (and the parameters) before the first step.
    pub resume: Option<PathBuf>,
}

/// What a rank trained.
#[derive(Debug)]
pub struct Trained {
    pub model: Mlp,
    /// The loss averaged over every rank, per step.
    pub losses: Vec<f32>,
    /// The largest relative difference from the reference after any step (`--check`).
    pub worst: f32,
    pub state_bytes: usize,
    pub master_bytes: usize,
    pub grad_bytes: usize,
    /// Steps taken, counting those before a resume.
    pub steps: u64,
}

/// AdamW's learning rate, and its weight decay for weights (biases get none).
pub const LR: f32 = 1e-3;
pub const WEIGHT_DECAY: f32 = 0.01;

/// The parameter groups: weights with weight decay, biases without.
pub fn hypers(model: &Mlp) -> Vec<Hyper> {
    (0..model.params.len())
        .map(|p| Hyper {
            lr: LR,
            weight_decay: if p % 2 == 0 { WEIGHT_DECAY } else { 0.0 },
        })
        .collect()
}

/// Rank `rank`'s samples of micro-batch `m` of step `step`: the reference's batch of a step is
/// every rank's micro-batches, i.e. samples `step * micro * world * batch` on.
fn batch_of(o: &Opts, world: usize, rank: usize, step: usize, m: usize) -> (Vec<f32>, Vec<f32>) {
    let b = o.shape.batch;
    samples(&o.shape, ((step * o.micro + m) * world + rank) * b, b)
}

/// Forward and backward of one micro-batch, each gradient handed to `on_grad` as it is done.
fn forward_backward(model: &Mlp, o: &Opts, x: &[f32], t: &[f32], sink: &mut dyn GradSink) -> f32 {
    let b = o.shape.batch;
    let acts = model.forward(x, b);
    model.backward(&acts, t, b, (b * o.micro) as f32, Duration::ZERO, sink)
}

/// Trains `o.steps` steps on this rank (see the module docs); `each(step, loss)` after every
/// step. Collective.
///
/// # Errors
/// ZeRO's and the collectives' errors, and a `--check` that finds a difference.
pub fn train(
    comm: &Communicator,
    o: &Opts,
    mut each: impl FnMut(usize, f32),
) -> Result<Trained, Box<dyn Error>> {
    let (rank, world) = (comm.rank(), comm.size());
    let mut model = Mlp::new(&o.shape, rank as u64);
    let hypers = hypers(&model);
    let mut views: Vec<&mut [f32]> = model.params.iter_mut().map(|p| p.as_mut_slice()).collect();
    let mut zero = Zero::new(
        comm,
        &mut views,
        hypers,
        Box::new(AdamW::default()),
        o.cfg.clone(),
    )?;
    zero.accumulate(o.micro)?;
    if let Some(dir) = &o.resume {
        zero.load(dir, &mut views)?;
    }
    drop(views);
    let first = zero.steps() as usize;
    let reference = if o.check {
        reference(
            &o.shape,
            world,
            o.micro,
            o.cfg.max_grad_norm,
            first + o.steps,
        )
    } else {
        Vec::new()
    };
    let (mut losses, mut worst) = (Vec::new(), 0.0f32);
    for step in first..first + o.steps {
        let mut loss = 0.0;
        for m in 0..o.micro {
            let (x, t) = batch_of(o, world, rank, step, m);
            let mut failed = None;
            let mut sink = Handed::new(|p, g| {
                if failed.is_none() {
                    failed = zero.grad_ready(p, g).err();
                }
            });
            loss += forward_backward(&model, o, &x, &t, &mut sink);
            if let Some(e) = failed {
                return Err(e.into());
            }
            let mut views: Vec<&mut [f32]> =
                model.params.iter_mut().map(|p| p.as_mut_slice()).collect();
            zero.step(&mut views)?;
        }
        let mut l = [loss / world as f32];
        comm.all_reduce(&mut l, ReduceOp::Sum)?;
        losses.push(l[0]);
        if let Some(want) = reference.get(step) {
            let d = max_rel_diff(&model, want);
            worst = worst.max(d);
            if d > CHECK_TOL {
                return Err(format!(
                    "rank {rank} step {step}: {d:e} from the one-process reference"
                )
                .into());
            }
        }
        each(step, l[0]);
    }
    if let Some(dir) = &o.save {
        zero.save(dir)?;
    }
    Ok(Trained {
        losses,
        worst,
        state_bytes: zero.state_bytes(),
        master_bytes: zero.master_bytes(),
        grad_bytes: zero.grad_bytes(),
        steps: zero.steps(),
        model,
    })
}

/// The largest relative difference `--check` accepts: the ranks sum gradients in another order
/// than the one process does.
pub const CHECK_TOL: f32 = 1e-4;

/// One process on every rank's samples with AdamW on whole parameters (the gradient clipped to
/// `max_norm`): the model after each of `steps` steps.
pub fn reference(
    shape: &Shape,
    world: usize,
    micro: usize,
    max_norm: Option<f32>,
    steps: usize,
) -> Vec<Mlp> {
    let mut model = Mlp::new(shape, 0);
    let hypers = hypers(&model);
    let mut opt = AdamW::default();
    let mut states: Vec<Vec<f32>> = model
        .params
        .iter()
        .map(|p| vec![0.0; 2 * p.len()])
        .collect();
    let n = micro * world * shape.batch;
    let mut out = Vec::with_capacity(steps);
    for step in 0..steps {
        let (x, t) = samples(shape, step * n, n);
        let acts = model.forward(&x, n);
        let mut grads = vec![Vec::new(); model.params.len()];
        model.backward(&acts, &t, n, n as f32, Duration::ZERO, &mut grads);
        if let Some(max) = max_norm {
            let ss: f64 = grads
                .iter()
                .flatten()
                .map(|&g| f64::from(g) * f64::from(g))
                .sum();
            let coef = f64::from(max) / (ss.sqrt() + 1e-6);
            if coef < 1.0 {
                grads.iter_mut().flatten().for_each(|g| *g *= coef as f32);
            }
        }
        for (p, g) in grads.iter().enumerate() {
            opt.step(
                step as u64 + 1,
                hypers[p],
                &mut model.params[p],
                g,
                &mut states[p],
            );
        }
        out.push(model.clone());
    }
    out
}

/// A trainer timed by [`bench`].
enum Trainer {
    /// DDP (its default overlap: `Auto`), then AdamW on every parameter on every rank.
    Ddp {
        ddp: Box<Ddp<Communicator>>,
        opt: AdamW,
        states: Vec<Vec<f32>>,
        t: u64,
    },
    Zero(Box<Zero>),
}

/// One variant of [`bench`]: a name, its model and trainer, its step times.
struct Variant {
    name: String,
    model: Mlp,
    trainer: Trainer,
    times: Vec<Duration>,
    /// Resident memory added by creating it (its communicators included) and its first step,
    /// less its model's parameters, and the optimizer state it reports (master weights
    /// included for ZeRO).
    rss: u64,
    state: usize,
}

/// This process's resident set, in bytes (0 where /proc is not there).
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn step(
    v: &mut Variant,
    o: &Opts,
    world: usize,
    rank: usize,
    step: usize,
) -> Result<(), Box<dyn Error>> {
    let (x, t) = batch_of(o, world, rank, step, 0);
    let model = &mut v.model;
    match &mut v.trainer {
        Trainer::Ddp {
            ddp,
            opt,
            states,
            t: n,
        } => {
            let mut failed = None;
            let mut sink = Handed::new(|p, g| {
                if failed.is_none() {
                    failed = ddp.grad_ready(p, g).err();
                }
            });
            forward_backward(model, o, &x, &t, &mut sink);
            if let Some(e) = failed {
                return Err(e.into());
            }
            ddp.finish()?;
            *n += 1;
            let h = hypers(model);
            for (p, st) in states.iter_mut().enumerate() {
                opt.step(*n, h[p], &mut model.params[p], ddp.grad::<f32>(p)?, st);
            }
        }
        Trainer::Zero(zero) => {
            let mut failed = None;
            let mut sink = Handed::new(|p, g| {
                if failed.is_none() {
                    failed = zero.grad_ready(p, g).err();
                }
            });
            forward_backward(model, o, &x, &t, &mut sink);
            if let Some(e) = failed {
                return Err(e.into());
            }
            let mut views: Vec<&mut [f32]> =
                model.params.iter_mut().map(|p| p.as_mut_slice()).collect();
            zero.step(&mut views)?;
        }
    }
    Ok(())
}

fn make(
    comm: &Communicator,
    o: &Opts,
    name: &str,
    world_rank: usize,
) -> Result<Variant, Box<dyn Error>> {
    let before = rss();
    let mut model = Mlp::new(&o.shape, world_rank as u64);
    let hyper = hypers(&model);
    let (trainer, state) = if name == "ddp+adamw" {
        let names = model.names();
        let mut params: Vec<Param> = model
            .params
            .iter_mut()
            .zip(&names)
            .map(|(p, n)| Param::new(n.clone(), p.as_mut_slice()))
            .collect();
        let cfg = DdpConfig {
            bucket_cap_bytes: o.cfg.bucket_elems * 4,
            ..DdpConfig::default()
        };
        let ddp = Box::new(Ddp::new(
            comm.split(Some(0), world_rank as i64)?.ok_or("split")?,
            &mut params,
            cfg,
        )?);
        let states: Vec<Vec<f32>> = model
            .params
            .iter()
            .map(|p| vec![0.0; 2 * p.len()])
            .collect();
        let bytes = states.iter().map(|s| 4 * s.len()).sum();
        (
            Trainer::Ddp {
                ddp,
                opt: AdamW::default(),
                states,
                t: 0,
            },
            bytes,
        )
    } else {
        let cfg = ZeroConfig {
            group: if name.contains("world") {
                ShardGroup::World
            } else {
                ShardGroup::Node
            },
            stage: if name.contains("zero-1") {
                Stage::One
            } else {
                Stage::Two
            },
            ..o.cfg.clone()
        };
        let mut views: Vec<&mut [f32]> =
            model.params.iter_mut().map(|p| p.as_mut_slice()).collect();
        let zero = Zero::new(comm, &mut views, hyper, Box::new(AdamW::default()), cfg)?;
        let bytes = zero.state_bytes();
        (Trainer::Zero(Box::new(zero)), bytes)
    };
    let mut v = Variant {
        name: name.to_string(),
        model,
        trainer,
        times: Vec::new(),
        rss: 0,
        state,
    };
    self::step(&mut v, o, comm.size(), world_rank, 0)?;
    let model_bytes: usize = v.model.params.iter().map(|p| 4 * p.len()).sum();
    v.rss = rss().saturating_sub(before + model_bytes as u64);
    Ok(v)
}

/// What [`bench`] measured for one variant: the slowest rank's median step, and memory.
#[derive(Clone, Debug)]
pub struct Timed {
    pub name: String,
    pub median_ms: f64,
    pub rss: u64,
    pub state: usize,
}

/// Times `names` (`ddp+adamw`, `zero-2-node`, `zero-1-node`, `zero-2-world`, ...) `rounds`
/// times `per_round` steps each, interleaved, after one untimed step each. Collective.
///
/// # Errors
/// The trainers' errors.
pub fn bench(
    comm: &Communicator,
    o: &Opts,
    names: &[&str],
    rounds: usize,
    per_round: usize,
) -> Result<Vec<Timed>, Box<dyn Error>> {
    let (rank, world) = (comm.rank(), comm.size());
    let mut vs = Vec::new();
    for name in names {
        vs.push(make(comm, o, name, rank)?);
    }
    for round in 1..=rounds {
        for v in &mut vs {
            for _ in 0..per_round {
                comm.barrier()?;
                let t0 = Instant::now();
                step(v, o, world, rank, round)?;
                v.times.push(t0.elapsed());
            }
        }
    }
    let mut out = Vec::new();
    for v in vs {
        let mut t = v.times.clone();
        t.sort();
        let mut ms = [t.get(t.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e3)];
        comm.all_reduce(&mut ms, ReduceOp::Max)?;
        out.push(Timed {
            name: v.name,
            median_ms: ms[0],
            rss: v.rss,
            state: v.state,
        });
    }
    Ok(out)
}
