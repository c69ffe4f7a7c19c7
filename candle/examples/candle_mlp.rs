//! candle_mlp: a candle MLP (candle_nn `Linear` layers, `SGD`) trained data-parallel on oxccl
//! with `oxccl_candle::CandleDdp`, on synthetic data (a fixed random regression target). Rank 0
//! prints the loss averaged over the ranks, the step time and the samples per second of the
//! whole job after every step, then the mean step time after the first (warm-up) step.
//!
//! ```text
//! cargo build --release -p oxccl-candle --example candle_mlp
//! cargo run --release --bin oxccl -- launch -n 4 -- target/release/examples/candle_mlp
//! ```
//!
//! `--no-ddp` trains one process alone with the same code and no communicator (what DDP's
//! overhead is measured against). `--check` also trains, on every rank, one model on the
//! concatenated batch of every rank from the same start, and exits non-zero unless the DDP
//! model is within 1e-5 (relative to each tensor's largest value) of it after the last step.
//! `--cuda` puts the model and the batches on GPU `local_rank % --gpus` (build with
//! `--features cuda`: candle's CUDA backend, and the adapter's device path, whose gradients
//! never leave the GPU); otherwise tensors live on the CPU.

use std::process::ExitCode;
use std::time::Instant;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap, SGD};
use clap::Parser;
use oxccl_candle::CandleDdp;
use oxccl_comm::{Communicator, ReduceOp};
use oxccl_ddp::DdpConfig;

#[derive(Parser, Debug)]
#[command(about = "Train a candle MLP data-parallel on oxccl")]
struct Args {
    /// Training steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Samples per rank and step.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Input features.
    #[arg(long, default_value_t = 64)]
    inputs: usize,
    /// Width of the hidden layers.
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// Hidden layers.
    #[arg(long, default_value_t = 3)]
    layers: usize,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.003)]
    lr: f64,
    /// Train one process alone, without oxccl.
    #[arg(long)]
    no_ddp: bool,
    /// Compare with one model trained on the concatenated batch (exit 1 if it differs).
    #[arg(long)]
    check: bool,
    /// Train on a CUDA device (needs the `cuda` feature).
    #[arg(long)]
    cuda: bool,
    /// With `--cuda`: GPUs to spread the ranks over (rank r uses GPU local_rank % gpus).
    #[arg(long, default_value_t = 1)]
    gpus: usize,
}

/// The MLP: `layers` hidden ReLU layers and one output.
struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    fn new(vb: VarBuilder, a: &Args) -> candle_core::Result<Mlp> {
        let mut layers = Vec::new();
        let mut width = a.inputs;
        for l in 0..a.layers {
            layers.push(linear(width, a.hidden, vb.pp(format!("l{l}")))?);
            width = a.hidden;
        }
        layers.push(linear(width, 1, vb.pp("out"))?);
        Ok(Mlp { layers })
    }

    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        let last = self.layers.len() - 1;
        for (i, l) in self.layers.iter().enumerate() {
            h = l.forward(&h)?;
            if i < last {
                h = h.relu()?;
            }
        }
        (h - y)?.sqr()?.mean_all()
    }
}

/// Rank `rank`'s batch of step `step`: inputs from a seeded generator, targets a fixed function.
fn batch(
    a: &Args,
    dev: &Device,
    rank: usize,
    step: usize,
) -> candle_core::Result<(Tensor, Tensor)> {
    let n = a.batch * a.inputs;
    let mut s = (step as u64 * 1_000_003 + rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) + 1;
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect();
    let x = Tensor::from_vec(v, (a.batch, a.inputs), &Device::Cpu)?.to_device(dev)?;
    let y = (x.sin()? * 0.5)?.sum_keepdim(1)?;
    Ok((x, y))
}

/// Every rank's batch of `step`, concatenated.
fn global_batch(
    a: &Args,
    dev: &Device,
    ranks: usize,
    step: usize,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for r in 0..ranks {
        let (x, y) = batch(a, dev, r, step)?;
        xs.push(x);
        ys.push(y);
    }
    Ok((Tensor::cat(&xs, 0)?, Tensor::cat(&ys, 0)?))
}

fn sorted(map: &VarMap) -> Vec<(String, Var)> {
    let mut v: Vec<(String, Var)> = map
        .data()
        .lock()
        .expect("VarMap lock")
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Every variable from a fixed generator (uniform within 1/sqrt(fan-in) for weights, 0.05 for
/// biases), the same on the CPU and on CUDA, so runs on either start alike and their losses can
/// be compared (candle's own initializers draw from each device's random generator).
fn seeded_init(map: &VarMap) -> candle_core::Result<()> {
    for (i, (_, var)) in sorted(map).iter().enumerate() {
        let dims = var.as_tensor().dims().to_vec();
        let bound = match dims.as_slice() {
            [_, fan_in] => 1.0 / (*fan_in as f32).sqrt(),
            _ => 0.05,
        };
        let mut s = (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let v: Vec<f32> = (0..var.as_tensor().elem_count())
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * bound
            })
            .collect();
        let t = Tensor::from_vec(v, dims, &Device::Cpu)?.to_device(var.as_tensor().device())?;
        var.set(&t)?;
    }
    Ok(())
}

/// A second model with the same variables' current values (the `--check` reference).
fn copy_of(a: &Args, dev: &Device, vars: &[(String, Var)]) -> candle_core::Result<(Mlp, VarMap)> {
    let map = VarMap::new();
    let mlp = Mlp::new(VarBuilder::from_varmap(&map, DType::F32, dev), a)?;
    for ((_, mine), (_, src)) in sorted(&map).iter().zip(vars) {
        mine.set(src.as_tensor())?;
    }
    Ok((mlp, map))
}

fn main() -> ExitCode {
    oxccl_comm::logging::init(); // OXCCL_DEBUG=info shows transports and algorithms
    let a = Args::parse();
    match run(&a) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("candle_mlp: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(a: &Args) -> Result<bool, Box<dyn std::error::Error>> {
    let comm = if a.no_ddp {
        None
    } else {
        Some(Communicator::from_env()?)
    };
    let dev = if a.cuda {
        let local = comm.as_ref().map_or(0, |c| c.local_rank());
        Device::new_cuda(local % a.gpus.max(1))?
    } else {
        Device::Cpu
    };
    let map = VarMap::new();
    let mlp = Mlp::new(VarBuilder::from_varmap(&map, DType::F32, &dev), a)?;
    seeded_init(&map)?;
    let mut ddp = match comm {
        None => None,
        Some(comm) => Some(CandleDdp::from_varmap(
            comm,
            map.data(),
            DdpConfig::default(),
        )?),
    };
    let (rank, ranks) = ddp
        .as_ref()
        .map_or((0, 1), |d| (d.comm().rank(), d.comm().size()));
    let vars = sorted(&map);
    let mut reference = if a.check {
        let (m, map) = copy_of(a, &dev, &vars)?;
        let opt = SGD::new(map.all_vars(), a.lr)?;
        Some((m, map, opt))
    } else {
        None
    };
    let mut opt = SGD::new(map.all_vars(), a.lr)?;
    if rank == 0 {
        let params: usize = vars.iter().map(|v| v.1.as_tensor().elem_count()).sum();
        println!(
            "candle MLP: {} layers of {}, {params} parameters; {ranks} rank(s) x batch {}{} on \
             {:?}",
            a.layers + 1,
            a.hidden,
            a.batch,
            if a.no_ddp { " (no DDP)" } else { "" },
            dev.location()
        );
    }
    let mut times = Vec::new();
    for step in 0..a.steps {
        let t0 = Instant::now();
        let (x, y) = batch(a, &dev, rank, step)?;
        let loss = mlp.loss(&x, &y)?;
        let t1 = Instant::now();
        let mut grads = loss.backward()?;
        let t2 = Instant::now();
        if let Some(d) = ddp.as_mut() {
            d.sync(&mut grads)?;
        }
        let t3 = Instant::now();
        opt.step(&grads)?;
        let dt = t0.elapsed().as_secs_f64();
        let secs = |from: Instant, to: Instant| (to - from).as_secs_f64();
        times.push([
            dt,
            secs(t0, t1),
            secs(t1, t2),
            secs(t2, t3),
            t3.elapsed().as_secs_f64(),
        ]);
        let mut l = [loss.to_scalar::<f32>()?];
        if let Some(d) = &ddp {
            d.comm().all_reduce(&mut l, ReduceOp::Avg)?;
        }
        if let Some((m, _, o)) = reference.as_mut() {
            let (gx, gy) = global_batch(a, &dev, ranks, step)?;
            o.step(&m.loss(&gx, &gy)?.backward()?)?;
        }
        if rank == 0 {
            let rate = (a.batch * ranks) as f64 / dt;
            println!(
                "step {step:>3}  loss {:.6}  {:.2} ms  {rate:.0} samples/s",
                l[0],
                dt * 1e3
            );
        }
    }
    if rank == 0 && times.len() > 1 {
        let rest = &times[1..];
        let mean = |i: usize| rest.iter().map(|t| t[i]).sum::<f64>() / rest.len() as f64 * 1e3;
        let rate = (a.batch * ranks) as f64 / mean(0) * 1e3;
        println!(
            "mean step after the first: {:.2} ms, {rate:.0} samples/s (forward {:.2}, backward \
             {:.2}, sync {:.2}, update {:.2} ms)",
            mean(0),
            mean(1),
            mean(2),
            mean(3),
            mean(4)
        );
    }
    let Some((_, rmap, _)) = reference else {
        return Ok(true);
    };
    let mut ok = true;
    for ((name, mine), (_, want)) in vars.iter().zip(sorted(&rmap)) {
        let g = mine.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        let w = want.as_tensor().flatten_all()?.to_vec1::<f32>()?;
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = g
            .iter()
            .zip(&w)
            .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        if diff > 1e-5 * scale {
            eprintln!("rank {rank}: {name} differs from one process by {diff} (scale {scale})");
            ok = false;
        }
    }
    if rank == 0 && ok {
        println!("check: within 1e-5 of one process on the concatenated batch");
    }
    Ok(ok)
}
