//! 07_zero_mlp: the MLP of 02_ddp_mlp trained with node-local ZeRO (oxccl-zero) and AdamW:
//! gradients reduce-scattered inside each node bucket by bucket during backward
//! (`Zero::grad_ready`), each shard all-reduced across the nodes, AdamW on the shard, the
//! parameters all-gathered inside the node (`Zero::step`). Rank 0 prints the loss (averaged over
//! ranks) after every step.
//!
//! ```text
//! cargo build --release --example 07_zero_mlp
//! cargo run --release --bin oxccl -- launch -n 4 -- target/release/examples/07_zero_mlp --check
//! ```
//!
//! `--check` compares every rank's model after every step with one process that trains on the
//! concatenated batch of every rank with AdamW on whole parameters, and fails past a relative
//! difference of 1e-4. `--save DIR` writes the optimizer's checkpoint after the last step,
//! `--resume DIR` loads one (from any shard group size) before the first. `--bench ROUNDS`
//! times DDP followed by AdamW on every rank against node-local ZeRO-2, ZeRO-1 and world-wide
//! ZeRO-2, interleaved, and prints each one's median step (the slowest rank's), the optimizer
//! state it keeps and the memory its creation and first step added (docs/PERF.md, "ZeRO").

#[path = "mlp/mod.rs"]
#[allow(dead_code)]
mod mlp;
#[path = "07_zero_mlp/run.rs"]
mod run;

use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use oxccl::comm::Communicator;
use oxccl::zero::{ShardGroup, Stage, ZeroConfig};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum GroupArg {
    /// The ranks of one node (node-local ZeRO).
    Node,
    /// Every rank (classic ZeRO).
    World,
}

#[derive(Parser, Debug)]
#[command(about = "Train an MLP with node-local ZeRO and AdamW (run it under `oxccl launch`)")]
struct Args {
    /// Training steps.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Samples per rank per micro-batch.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Micro-batches per step (gradient accumulation).
    #[arg(long, default_value_t = 1)]
    micro: usize,
    /// Width of the hidden layers.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Number of hidden layers.
    #[arg(long, default_value_t = 3)]
    layers: usize,
    /// ZeRO stage: 1 shards the optimizer state, 2 the gradients too.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=2))]
    stage: u8,
    /// The ranks that share one copy of the optimizer state.
    #[arg(long, value_enum, default_value_t = GroupArg::Node)]
    group: GroupArg,
    /// Bucket size in MiB of f32 gradients.
    #[arg(long, default_value_t = 25.0)]
    bucket_mib: f64,
    /// Buckets reduce-scattered and all-gathered at once (ZeroConfig::buckets_in_flight).
    #[arg(long, default_value_t = 2)]
    in_flight: usize,
    /// Clip the gradient's global norm to this.
    #[arg(long)]
    max_grad_norm: Option<f32>,
    /// Compare with one process on the concatenated batch after every step.
    #[arg(long)]
    check: bool,
    /// Save the optimizer's checkpoint here after the last step.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Load a checkpoint from here before the first step.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Time DDP + AdamW against ZeRO instead of training: this many interleaved rounds.
    #[arg(long)]
    bench: Option<usize>,
    /// Steps of each trainer per round with --bench.
    #[arg(long, default_value_t = 3)]
    per_round: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    oxccl::logging::init(); // OXCCL_DEBUG=info shows transports and algorithms
    let args = Args::parse();
    let comm = Communicator::from_env()?;
    let shape = mlp::Shape {
        batch: args.batch,
        hidden: args.hidden,
        layers: args.layers,
        ..mlp::Shape::default()
    };
    let cfg = ZeroConfig {
        group: match args.group {
            GroupArg::Node => ShardGroup::Node,
            GroupArg::World => ShardGroup::World,
        },
        stage: if args.stage == 1 {
            Stage::One
        } else {
            Stage::Two
        },
        bucket_elems: (args.bucket_mib * f64::from(1 << 20) / 4.0) as usize,
        max_grad_norm: args.max_grad_norm,
        buckets_in_flight: args.in_flight,
        ..ZeroConfig::default()
    };
    let opts = run::Opts {
        shape,
        steps: args.steps,
        micro: args.micro,
        cfg,
        check: args.check,
        save: args.save.clone(),
        resume: args.resume.clone(),
    };
    let lead = comm.rank() == 0;
    if let Some(rounds) = args.bench {
        let names = ["ddp+adamw", "zero-2-node", "zero-1-node", "zero-2-world"];
        let timed = run::bench(&comm, &opts, &names, rounds, args.per_round)?;
        let base = timed[0].median_ms;
        for t in timed.iter().filter(|_| lead) {
            println!(
                "{:<13} {:>9.2} ms/step  {:>5.3}x ddp+adamw  optimizer state {:>7.2} MiB  \
                 rss added {:>8.2} MiB",
                t.name,
                t.median_ms,
                t.median_ms / base,
                t.state as f64 / f64::from(1 << 20),
                t.rss as f64 / f64::from(1 << 20),
            );
        }
        return Ok(());
    }
    let trained = run::train(&comm, &opts, |step, loss| {
        if lead {
            println!("step {step:>4}  loss {loss:.6}");
        }
    })?;
    if args.check && !mlp::replicas_identical(&comm, &trained.model)? {
        return Err(format!("rank {}: the replicas differ", comm.rank()).into());
    }
    if lead {
        println!(
            "{} steps, last loss {:.6}; optimizer state {} bytes, master weights {} bytes and \
             gradients {} bytes on rank 0{}",
            trained.steps,
            trained.losses.last().copied().unwrap_or(f32::NAN),
            trained.state_bytes,
            trained.master_bytes,
            trained.grad_bytes,
            if args.check {
                format!(
                    "; --check: replicas identical, within {:e} of one process",
                    trained.worst
                )
            } else {
                String::new()
            }
        );
    }
    Ok(())
}
