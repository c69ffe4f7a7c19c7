//! 08_pipeline_mlp: an MLP cut into pipeline stages (oxccl-pipeline), one stage per rank, or a
//! `pipe x data` grid where DDP averages each stage's gradients over its replicas during the
//! last micro-batch's backward. Rank 0 prints the last stage's loss after every step.
//!
//! ```text
//! cargo build --release --example 08_pipeline_mlp
//! # 4 stages, 1F1B, 8 micro-batches, compared with one process after every step:
//! cargo run --release --bin oxccl -- launch -n 4 -- target/release/examples/08_pipeline_mlp --check
//! # 2 stages x 2 data replicas, zero-bubble schedule:
//! cargo run --release --bin oxccl -- launch -n 4 -- target/release/examples/08_pipeline_mlp --pipe 2 --schedule zb-h1 --check
//! # the same replicas with node-local ZeRO-2 instead of DDP:
//! cargo run --release --bin oxccl -- launch -n 4 -- target/release/examples/08_pipeline_mlp --pipe 2 --zero --check
//! ```
//!
//! `--check` compares this rank's gradients and parameters with one process running every
//! layer on the whole batch (every replica's micro-batches) after every step, and fails past a
//! relative difference of 1e-5. `--bench-bubble ROUNDS` runs every schedule with stages that
//! wait `--f-ms`, `--b-ms` and `--w-ms` per forward, input gradient and weight gradient and
//! prints the bubble measured against the theory; `--bench-exchange ROUNDS` (2 ranks) times
//! the pipeline's exchanges of `--act-kib` against plain send/recv (docs/PERF.md, "Pipeline").

#[path = "08_pipeline_mlp/bench.rs"]
mod bench;
#[path = "08_pipeline_mlp/model.rs"]
mod model;
#[path = "08_pipeline_mlp/run.rs"]
#[allow(dead_code)]
mod run;

use clap::Parser;
use oxccl::comm::Communicator;
use oxccl::pipeline::ScheduleKind;

#[derive(Parser, Debug)]
#[command(about = "Train an MLP cut into pipeline stages (run it under `oxccl launch`)")]
struct Args {
    /// gpipe, 1f1b, interleaved or zb-h1.
    #[arg(long, default_value = "1f1b")]
    schedule: ScheduleKind,
    /// Model chunks per rank (interleaved).
    #[arg(long, default_value_t = 1)]
    chunks: usize,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 8)]
    micro: usize,
    /// Stages per pipeline (default: every rank); the rest of the world is data replicas.
    #[arg(long)]
    pipe: Option<usize>,
    /// Training steps.
    #[arg(long, default_value_t = 30)]
    steps: usize,
    /// Samples per micro-batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Width of the hidden layers.
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// Linear layers (cut evenly into the stages).
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Send each stage's output as two tensors (f32 and f64).
    #[arg(long)]
    split: bool,
    /// Compare with one process after every step.
    #[arg(long)]
    check: bool,
    /// With data replicas (`--pipe` below the world size): node-local ZeRO-2 (SGD) over each
    /// stage's replicas instead of DDP.
    #[arg(long)]
    zero: bool,
    /// Exchange device tensors (a build with `--features cuda`; each stage computes on the
    /// host and hands its outputs over in device memory).
    #[arg(long)]
    device: bool,
    /// Benchmark the bubble of every schedule over this many steps.
    #[arg(long)]
    bench_bubble: Option<usize>,
    /// Benchmark the exchanges against send/recv over this many rounds (2 ranks).
    #[arg(long)]
    bench_exchange: Option<usize>,
    /// Forward time of a rank's stage in the bubble benchmark, ms.
    #[arg(long, default_value_t = 20)]
    f_ms: u32,
    /// Input-gradient time, ms.
    #[arg(long, default_value_t = 20)]
    b_ms: u32,
    /// Weight-gradient time, ms.
    #[arg(long, default_value_t = 20)]
    w_ms: u32,
    /// Bytes per message in the benchmarks, KiB.
    #[arg(long, default_value_t = 1024)]
    act_kib: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    oxccl::logging::init(); // OXCCL_DEBUG=info shows transports and algorithms
    let a = Args::parse();
    let comm = Communicator::from_env()?;
    if let Some(rounds) = a.bench_exchange {
        let x = bench::exchange(&comm, a.micro, a.act_kib << 10, rounds)?;
        if comm.rank() == 0 {
            println!(
                "exchange of {} KiB: pipeline {:.1} us per message, send/recv {:.1} us ({:.2}x, {:+.1} us)",
                a.act_kib,
                x.pipeline.as_secs_f64() * 1e6,
                x.plain.as_secs_f64() * 1e6,
                x.pipeline.as_secs_f64() / x.plain.as_secs_f64(),
                (x.pipeline.as_secs_f64() - x.plain.as_secs_f64()) * 1e6
            );
        }
        return Ok(());
    }
    if let Some(rounds) = a.bench_bubble {
        if comm.rank() == 0 {
            println!(
                "p {} m {} F/B/W {}/{}/{} ms, {} KiB per message",
                comm.size(),
                a.micro,
                a.f_ms,
                a.b_ms,
                a.w_ms,
                a.act_kib
            );
            println!(
                "{:<12} {:>2} {:>9} {:>9} {:>7} {:>9}",
                "schedule", "v", "measured", "theory", "ratio", "step ms"
            );
        }
        let fbw = [a.f_ms, a.b_ms, a.w_ms];
        for (kind, v) in [
            (ScheduleKind::GPipe, 1),
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::Interleaved, 2),
            (ScheduleKind::ZeroBubbleH1, 1),
        ] {
            let b = bench::bubble(&comm, kind, v, a.micro, fbw, a.act_kib << 10, rounds)?;
            if comm.rank() == 0 {
                println!(
                    "{:<12} {:>2} {:>9.3} {:>9.3} {:>7.3} {:>9.1}",
                    kind.name(),
                    v,
                    b.measured,
                    b.theory,
                    b.measured / b.theory,
                    b.step.as_secs_f64() * 1e3
                );
            }
        }
        return Ok(());
    }
    let o = run::Opts {
        shape: model::Shape {
            input: 32,
            width: a.width,
            output: 4,
            layers: a.layers,
            batch: a.batch,
            micro: a.micro,
            lr: 0.3,
        },
        kind: a.schedule,
        chunks: a.chunks,
        pipe: a.pipe.unwrap_or(comm.size()),
        steps: a.steps,
        split: a.split,
        check: a.check,
        die: None,
        device: a.device,
        zero: a.zero,
    };
    let t = run::train(&comm, &o)?;
    // The last stage of the first pipeline has the loss: bring it to rank 0.
    for (step, loss) in t.losses.iter().enumerate() {
        let mut v = [*loss];
        comm.all_reduce(&mut v, oxccl::comm::ReduceOp::Max)?;
        if comm.rank() == 0 {
            println!("step {step}: loss {:.5}", v[0]);
        }
    }
    if let (0, Some(path)) = (comm.rank(), t.device_path) {
        println!("device payloads: {path}");
    }
    if a.check {
        let mut w = [t.worst];
        comm.all_reduce(&mut w, oxccl::comm::ReduceOp::Max)?;
        if comm.rank() == 0 {
            println!(
                "check: every rank within {:.1e} of one process over {} steps",
                w[0], a.steps
            );
        }
    }
    Ok(())
}
