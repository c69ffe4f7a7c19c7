//! 02_ddp_mlp: data-parallel training of a small MLP with oxccl's DDP. Forward and backward are
//! written out layer by layer (examples/mlp/mod.rs); backward hands each gradient to
//! `Ddp::grad_ready` as soon as it is computed, so the all-reduce of the last layers' bucket runs
//! while the earlier layers are still being differentiated. Rank 0 prints the loss (averaged over
//! ranks) after every step.
//!
//! ```text
//! cargo build --release --example 02_ddp_mlp
//! cargo run --release --bin oxccl -- launch -n 4 -- target/release/examples/02_ddp_mlp
//! ```
//!
//! `--check` also trains one process on the concatenated batch of every rank on each rank and
//! exits non-zero unless the DDP model stays within 1e-5 of it and every rank's parameters are
//! bit-identical after every step. `--mode all --rounds 3` times compute only, communication only,
//! backward-then-all-reduce and overlapped DDP steps, interleaved (docs/PERF.md); make the model
//! larger for that with `--hidden 1024 --layers 4 --batch 32`.

#[path = "mlp/mod.rs"]
mod mlp;

use std::time::Duration;

use clap::{Parser, ValueEnum};
use mlp::{Mode, Shape};
use oxccl::comm::{Communicator, ReduceOp};
use oxccl::ddp::DdpConfig;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ModeArg {
    Overlap,
    After,
    Compute,
    Comm,
    All,
}

#[derive(Parser, Debug)]
#[command(about = "Train a small MLP with oxccl DDP on synthetic data")]
struct Args {
    /// Training steps.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Samples per rank per step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Input features.
    #[arg(long, default_value_t = 32)]
    input: usize,
    /// Width of the hidden layers.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Number of hidden layers.
    #[arg(long, default_value_t = 3)]
    layers: usize,
    /// Outputs.
    #[arg(long, default_value_t = 4)]
    output: usize,
    /// SGD learning rate.
    #[arg(long, default_value_t = 0.2)]
    lr: f32,
    /// Bucket size in MiB (DDP's default; a model whose gradients fit in one bucket cannot
    /// overlap: use a few MiB for the 12 MiB model of docs/PERF.md).
    #[arg(long, default_value_t = 25.0)]
    bucket_mib: f64,
    /// How gradients are communicated (`all` times every mode, interleaved).
    #[arg(long, value_enum, default_value_t = ModeArg::Overlap)]
    mode: ModeArg,
    /// Rounds of every mode with `--mode all`.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Compare with one process on the concatenated batch, and replicas with each other.
    #[arg(long)]
    check: bool,
}

fn median_ms(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.check && !matches!(args.mode, ModeArg::Overlap | ModeArg::After) {
        return Err("--check compares DDP training: use it with --mode overlap or after".into());
    }
    let comm = Communicator::from_env()?;
    let (rank, world) = (comm.rank(), comm.size());
    let shape = Shape {
        input: args.input,
        hidden: args.hidden,
        layers: args.layers,
        output: args.output,
        batch: args.batch,
        lr: args.lr,
    };
    let cfg = DdpConfig {
        bucket_cap_bytes: (args.bucket_mib * (1 << 20) as f64) as usize,
        ..DdpConfig::default()
    };
    let params: usize = mlp::Mlp::new(&shape, 0).params.iter().map(Vec::len).sum();
    if rank == 0 {
        println!(
            "# 02_ddp_mlp: {world} ranks, layers {}x{}, {params} parameters ({:.1} MiB of f32 \
             gradients), batch {} per rank",
            args.layers,
            args.hidden,
            (params * 4) as f64 / (1 << 20) as f64,
            args.batch
        );
    }

    if args.mode == ModeArg::All {
        let modes = [
            ("compute only", Mode::ComputeOnly),
            ("comm only", Mode::CommOnly),
            ("backward then all-reduce", Mode::After),
            ("ddp overlap", Mode::Overlap),
        ];
        let mut times: Vec<Vec<Duration>> = vec![Vec::new(); modes.len()];
        for _ in 0..args.rounds {
            for (k, &(_, mode)) in modes.iter().enumerate() {
                mlp::train_ddp(
                    &comm,
                    &shape,
                    args.steps,
                    mode,
                    cfg.clone(),
                    |step, _, _, r| {
                        if step > 0 {
                            times[k].push(r.time); // step 0 warms up
                        }
                        Ok(())
                    },
                )?;
            }
        }
        // The slowest rank sets the pace: report the maximum of every rank's median.
        let mut med: Vec<f64> = times.into_iter().map(median_ms).collect();
        comm.all_reduce(&mut med, ReduceOp::Max)?;
        if rank == 0 {
            println!(
                "# median step time over {} rounds x {} steps (max over ranks)",
                args.rounds,
                args.steps.saturating_sub(1)
            );
            for ((name, _), ms) in modes.iter().zip(&med) {
                println!("{name:>26}: {ms:8.2} ms");
            }
            println!(
                "# overlap / (backward then all-reduce) = {:.3}",
                med[3] / med[2]
            );
        }
        return Ok(());
    }

    let mode = match args.mode {
        ModeArg::Overlap | ModeArg::All => Mode::Overlap,
        ModeArg::After => Mode::After,
        ModeArg::Compute => Mode::ComputeOnly,
        ModeArg::Comm => Mode::CommOnly,
    };
    let reference = if args.check {
        mlp::train_reference(&shape, world, args.steps)
    } else {
        Vec::new()
    };
    let mut worst = 0.0f32;
    mlp::train_ddp(
        &comm,
        &shape,
        args.steps,
        mode,
        cfg,
        |step, model, ddp, r| {
            let mut loss = [r.loss];
            ddp.comm().all_reduce(&mut loss, ReduceOp::Avg)?;
            let mut line = format!(
                "step {step:>3}  loss {:.6}  {:7.2} ms",
                loss[0],
                r.time.as_secs_f64() * 1e3
            );
            if args.check {
                let diff = mlp::max_rel_diff(model, &reference[step]);
                worst = worst.max(diff);
                let same = mlp::replicas_identical(ddp.comm(), model)?;
                line +=
                    &format!("  max rel diff vs 1 process {diff:.2e}  replicas identical: {same}");
                if diff > 1e-5 || !same {
                    return Err(format!("rank {rank}: step {step}: {line}").into());
                }
            }
            if rank == 0 {
                println!("{line}");
            }
            Ok(())
        },
    )?;
    if args.check && rank == 0 {
        println!("check passed: worst relative difference {worst:.2e}, replicas bit-identical");
    }
    Ok(())
}
