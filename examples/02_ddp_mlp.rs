//! 02_ddp_mlp: data-parallel training of a small MLP with oxccl's DDP. Forward and backward are
//! written out layer by layer (examples/mlp/mod.rs); backward hands each gradient to
//! `Ddp::grad_ready` as soon as it is computed, so the all-reduce of the last layers' bucket runs
//! while the earlier layers are still being differentiated (`--mode in-place`: backward computes
//! each gradient in its bucket slot, `Ddp::grad_slot`, and declares it with
//! `Ddp::grad_ready_in_place`, saving the copy). Rank 0 prints the loss (averaged over ranks)
//! after every step.
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
//! larger for that with `--hidden 1024 --layers 4 --batch 32`, and add `--balance` to pick the
//! batch at which backward takes as long as the all-reduce. It also prints the best ratio
//! overlap could reach (the shorter of backward and the all-reduce hidden entirely) and how much
//! of that it reached. It times DDP with overlap on and off (`DdpConfig::overlap`: off
//! all-reduces in `finish()`, what `Overlap::Auto` picks on a node with fewer than 2 CPUs per
//! rank), each with `grad_ready` and with the slots, and prints what `Auto` picks. Each mode's
//! line splits its step into backward, the wait in `finish()` or `sync()` (the communication
//! backward did not hide) and the rest (forward and the update). `--idle-backward-ms T` makes
//! every backward pass also wait T ms with the CPU idle, as a trainer waits for an accelerator:
//! it shows what overlap hides when the all-reduce does not compete with backward for a CPU
//! (not issue 7's target, which is about this model's own compute).
//!
//! `--uneven` gives the ranks uneven data (`DdpConfig::uneven_inputs`, PyTorch's `Join`): rank
//! r runs out r steps early, then stands in for the other ranks' steps with `Ddp::join_step`,
//! applying the same averaged gradients, so the replicas stay bit-identical; each step's
//! gradient is the mean over the ranks still training (`--check` compares with one process on
//! their concatenated batches).
//!
//! `--powersgd R` sets the PowerSGD comm hook of rank R (`oxccl::ddp::PowerSgd`, from step
//! `--powersgd-start`, 1 by default), `--compress fp16|bf16` the 16-bit one
//! (`oxccl::ddp::CompressHook`): to see what compression saves on a slow link (docs/PERF.md,
//! "PowerSGD"). `--local-sgd P` trains with post-local SGD from step `--local-sgd-start` (1 by
//! default): gradients averaged only within groups of ranks (`oxccl::ddp::PostLocalSgd`; the
//! ranks of each node, or `--local-sgd-group K` consecutive ranks), the parameters over every
//! rank after every P-th step (`oxccl::ddp::ModelAverager`); `--local-sgd-levels P:K,...` adds
//! levels below it, the parameters over groups of K consecutive ranks every P steps
//! (`oxccl::ddp::HierarchicalAverager`, periods counted from step 0). `--check` then compares
//! each group with one process that trains the groups' models and averages them alike, and the
//! replicas within each group after every step and across groups after every average over
//! every rank. The example ends
//! with the loss of rank 0's model on 256 samples no step trains on.
//!
//! The timing of `--balance` and `--mode all` is in `02_ddp_mlp/timing.rs`, what `--check`
//! compares with in `02_ddp_mlp/check.rs`.

#[path = "02_ddp_mlp/check.rs"]
mod check;
#[path = "mlp/mod.rs"]
mod mlp;
#[path = "02_ddp_mlp/timing.rs"]
mod timing;

use std::sync::Arc;
use std::time::{Duration, Instant};

use check::References;
use clap::{Parser, ValueEnum};
use mlp::{Mode, Shape};
use oxccl::comm::{Communicator, ReduceOp};
use oxccl::ddp::{
    CommHook, CompressHook, DdpConfig, HierarchicalAverager, ModelAverager, Overlap, PostLocalSgd,
    PowerSgd, PowerSgdConfig, UnevenInputs,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ModeArg {
    Overlap,
    /// As `overlap`, each gradient computed in its bucket slot (`Ddp::grad_slot`).
    InPlace,
    After,
    Compute,
    Comm,
    All,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum OverlapArg {
    Auto,
    On,
    Off,
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
    /// DdpConfig::overlap for `--mode overlap` and `in-place`: `auto` overlaps where each rank
    /// has a CPU to spare, `off` all-reduces the buckets in `finish()` (`after`, `compute` and
    /// `comm` call `sync`, which it does not change; `--mode all` times `on` and `off`).
    #[arg(long, value_enum, default_value_t = OverlapArg::Auto)]
    overlap: OverlapArg,
    /// Rounds of every mode with `--mode all`.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Compare with one process on the concatenated batch, and replicas with each other.
    #[arg(long)]
    check: bool,
    /// Before training, choose the batch so that backward takes about as long as the
    /// all-reduce of the gradients ("comparable time", where overlap can hide the most): times
    /// communication alone, and backward at `--batch` and twice that, and solves the line
    /// through them for the all-reduce's time (the slowest rank's medians, so every rank
    /// agrees; from 1 to 16 times `--batch`, at most 4096).
    #[arg(long)]
    balance: bool,
    /// Milliseconds every backward pass also waits with the CPU idle, spread over the layers
    /// (as a trainer waits for an accelerator that computes its backward): what an overlapped
    /// all-reduce can hide without competing for a CPU. Not issue 7's target, which is the
    /// model's own compute; 0 by default.
    #[arg(long, default_value_t = 0.0)]
    idle_backward_ms: f64,
    /// Uneven data: rank r has `--steps` minus r steps (at least 1), then stands in for the
    /// others' steps with `Ddp::join_step` (`UnevenInputs::DivideByActiveRanks`).
    #[arg(long)]
    uneven: bool,
    /// Compress gradients with PowerSGD of this rank (`oxccl::ddp::PowerSgd`; 0, the default,
    /// averages them exactly). With `--check`, the model is compared with the uncompressed
    /// one only before compression starts; the replicas must stay identical throughout.
    #[arg(long, default_value_t = 0)]
    powersgd: usize,
    /// Synchronised steps averaged exactly before PowerSGD starts compressing.
    #[arg(long, default_value_t = 1)]
    powersgd_start: u64,
    /// Send every bucket as f16 or bf16 (`oxccl::ddp::CompressHook`); not with `--powersgd`.
    /// With `--check`, only the replicas are compared.
    #[arg(long, value_enum, default_value_t = CompressArg::None)]
    compress: CompressArg,
    /// Post-local SGD: from `--local-sgd-start`, average gradients only within each group of
    /// ranks, and the parameters over every rank after every this many steps (0, the default:
    /// ordinary DDP). Not with another hook or `--uneven`.
    #[arg(long, default_value_t = 0)]
    local_sgd: u64,
    /// The first step of post-local SGD (the steps before it average over every rank).
    #[arg(long, default_value_t = 1)]
    local_sgd_start: u64,
    /// Ranks per group for `--local-sgd`, consecutive ranks (0, the default: the ranks of each
    /// node).
    #[arg(long, default_value_t = 0)]
    local_sgd_group: usize,
    /// Levels below `--local-sgd`'s average over every rank, as `P:K[,P:K...]`: the parameters
    /// averaged over groups of K consecutive ranks every P steps
    /// (`oxccl::ddp::HierarchicalAverager`; periods counted from step 0, as in PyTorch, and
    /// `--local-sgd P` then counts from step 0 too).
    #[arg(long, default_value = "")]
    local_sgd_levels: String,
}

/// `--local-sgd-levels` (`P:K,...`) as (period, group size) pairs.
fn parse_levels(text: &str) -> Result<Vec<(u64, usize)>, String> {
    text.split(',')
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (p, k) = l
                .split_once(':')
                .ok_or_else(|| format!("--local-sgd-levels: {l:?} is not P:K"))?;
            let p = p.trim().parse::<u64>();
            let k = k.trim().parse::<usize>();
            match (p, k) {
                (Ok(p), Ok(k)) => Ok((p, k)),
                _ => Err(format!(
                    "--local-sgd-levels: {l:?} is not P:K (two integers)"
                )),
            }
        })
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CompressArg {
    None,
    Fp16,
    Bf16,
}

/// The modes that train with DDP (what `--check`, `--uneven` and `--local-sgd` need).
fn trains(mode: ModeArg) -> bool {
    matches!(mode, ModeArg::Overlap | ModeArg::InPlace | ModeArg::After)
}

/// The modes `--check` and `--uneven` need (checked before the communicator is made).
fn check_modes(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    if args.check && !trains(args.mode) {
        return Err(
            "--check compares DDP training: use it with --mode overlap, in-place or after".into(),
        );
    }
    if args.uneven && !trains(args.mode) {
        return Err(
            "--uneven trains with DDP: use it with --mode overlap, in-place or after".into(),
        );
    }
    Ok(())
}

/// The model and batch the flags ask for (`--batch`, before `--balance`).
fn shape_of(args: &Args) -> Result<Shape, String> {
    Ok(Shape {
        input: args.input,
        hidden: args.hidden,
        layers: args.layers,
        output: args.output,
        batch: args.batch,
        lr: args.lr,
        idle_backward: Duration::try_from_secs_f64(args.idle_backward_ms / 1e3)
            .map_err(|e| format!("--idle-backward-ms {}: {e}", args.idle_backward_ms))?,
    })
}

/// DDP's settings: `--bucket-mib`, `--overlap`, `--uneven`.
fn ddp_config(args: &Args) -> DdpConfig {
    DdpConfig {
        bucket_cap_bytes: (args.bucket_mib * (1 << 20) as f64) as usize,
        overlap: match args.overlap {
            OverlapArg::Auto => Overlap::Auto,
            OverlapArg::On => Overlap::On,
            OverlapArg::Off => Overlap::Off,
        },
        uneven_inputs: if args.uneven {
            UnevenInputs::DivideByActiveRanks
        } else {
            UnevenInputs::Off
        },
        ..DdpConfig::default()
    }
}

/// `--powersgd R`, `--compress` and `--local-sgd` each set the comm hook: at most one of them,
/// and `--local-sgd` neither with `--uneven` nor outside the modes that train.
fn check_hooks(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let hooks = usize::from(args.powersgd > 0)
        + usize::from(args.compress != CompressArg::None)
        + usize::from(args.local_sgd > 0);
    if hooks > 1 {
        return Err(
            "--powersgd, --compress and --local-sgd each set a comm hook: choose one".into(),
        );
    }
    if args.local_sgd > 0 && args.uneven {
        return Err("--local-sgd averages within groups, which --uneven cannot rescale".into());
    }
    if args.local_sgd > 0 && !trains(args.mode) {
        // Its steps differ (one in P sends the parameters across): `all`'s medians would hide
        // that, and compute only would average the parameters too.
        return Err(
            "--local-sgd trains: use it with --mode overlap, in-place or after (mean step times: \
             scripts/local_sgd_bench.sh)"
                .into(),
        );
    }
    Ok(())
}

/// Post-local SGD's group (with `--local-sgd`): `--local-sgd-group` consecutive ranks, or the
/// node's ranks. Collective: every rank splits.
fn local_sgd_group(
    args: &Args,
    comm: &Communicator,
) -> Result<Option<Arc<Communicator>>, Box<dyn std::error::Error>> {
    if args.local_sgd == 0 {
        return Ok(None);
    }
    let rank = comm.rank();
    let color = match args.local_sgd_group {
        0 => comm.node_index(),
        k => rank / k,
    };
    let color = u32::try_from(color)
        .map_err(|_| format!("rank {rank}: --local-sgd: group {color} is out of range"))?;
    let group = comm.split(Some(color), rank as i64)?;
    Ok(Some(Arc::new(group.ok_or_else(|| {
        format!("rank {rank}: --local-sgd: the split gave this rank no group")
    })?)))
}

/// `--local-sgd-levels`: the levels below the average over every rank, checked against
/// `--local-sgd` and the world, with that average appended as the last level (empty without
/// levels).
fn local_sgd_levels(
    args: &Args,
    rank: usize,
    world: usize,
) -> Result<Vec<(u64, usize)>, Box<dyn std::error::Error>> {
    let mut levels =
        parse_levels(&args.local_sgd_levels).map_err(|e| format!("rank {rank}: {e}"))?;
    if !levels.is_empty() && args.local_sgd == 0 {
        return Err("--local-sgd-levels needs --local-sgd P (the period over every rank)".into());
    }
    // Named by their flags here, before anything is computed (`by_group_sizes` checks them
    // again, with the level over every rank added).
    let mut period = 0;
    for &(p, k) in &levels {
        if p <= period || p >= args.local_sgd {
            return Err(format!(
                "rank {rank}: --local-sgd-levels: period {p} must be larger than the level's \
                 before it and smaller than --local-sgd {}",
                args.local_sgd
            )
            .into());
        }
        period = p;
        let whole = args.local_sgd_group == 0 || k.is_multiple_of(args.local_sgd_group);
        if k == 0 || !world.is_multiple_of(k) || !whole {
            return Err(format!(
                "rank {rank}: --local-sgd-levels: groups of {k} ranks must divide the {world} \
                 ranks and be made of whole --local-sgd-group groups"
            )
            .into());
        }
    }
    if !levels.is_empty() {
        levels.push((args.local_sgd, world));
    }
    Ok(levels)
}

/// What every training run of this process is made of besides the model: the flags, the
/// communicator, and post-local SGD's group and levels. The comm hook and the averager are
/// made afresh for every run.
struct Setup<'a> {
    args: &'a Args,
    comm: &'a Communicator,
    /// Post-local SGD's group ([`local_sgd_group`]).
    group: Option<Arc<Communicator>>,
    /// `--local-sgd-levels` ([`local_sgd_levels`]).
    levels: Vec<(u64, usize)>,
    /// The shapes of the model's parameters (for PowerSGD).
    shapes: Vec<Vec<usize>>,
}

impl Setup<'_> {
    /// The model averager of `--local-sgd`, if any.
    fn averager(&self) -> Result<Option<mlp::Averager>, oxccl::ddp::DdpError> {
        let args = self.args;
        if args.local_sgd == 0 {
            return Ok(None);
        }
        if self.levels.is_empty() {
            let a = ModelAverager::new(args.local_sgd, args.local_sgd_start);
            return Ok(Some(a.into()));
        }
        // Collective over the communicator (one split per level): every rank makes one per run.
        let a =
            HierarchicalAverager::by_group_sizes(self.comm, &self.levels, args.local_sgd_start)?;
        Ok(Some(mlp::Averager::Hierarchical(a)))
    }

    /// The size of the groups averaged after step `step`'s update, the world for every rank.
    fn averaged_over(&self, step: usize) -> Option<usize> {
        let args = self.args;
        let (s, start) = (step as u64, args.local_sgd_start);
        if args.local_sgd == 0 || s < start {
            return None;
        }
        if self.levels.is_empty() {
            return (s - start)
                .is_multiple_of(args.local_sgd)
                .then_some(self.comm.size());
        }
        self.levels
            .iter()
            .rev()
            .find(|&&(p, _)| p > 0 && s.is_multiple_of(p))
            .map(|&(_, k)| k)
    }

    /// The comm hook of `--local-sgd`, `--powersgd` or `--compress`, if any.
    fn hook(&self) -> Result<Option<Box<dyn CommHook>>, oxccl::ddp::DdpError> {
        let args = self.args;
        if let Some(group) = &self.group {
            // Collective over the group (it learns its members' ranks): every rank makes one
            // per run, at the same place.
            let h = PostLocalSgd::new(self.comm, Arc::clone(group), args.local_sgd_start)?;
            return Ok(Some(Box::new(h)));
        }
        if args.powersgd > 0 {
            let cfg = PowerSgdConfig {
                rank: args.powersgd,
                start_step: args.powersgd_start,
                ..PowerSgdConfig::default()
            };
            return Ok(Some(Box::new(PowerSgd::new(cfg, self.shapes.clone()))));
        }
        Ok(match args.compress {
            CompressArg::None => None,
            CompressArg::Fp16 => Some(Box::new(CompressHook::fp16())),
            CompressArg::Bf16 => Some(Box::new(CompressHook::bf16())),
        })
    }

    /// Steps of data of rank `r` (`--uneven`: rank r runs out r steps early).
    fn own_steps(&self, r: usize) -> usize {
        if self.args.uneven {
            self.args.steps.saturating_sub(r).max(1)
        } else {
            self.args.steps
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    oxccl::logging::init(); // OXCCL_DEBUG=info shows transports and algorithms
    let args = Args::parse();
    check_modes(&args)?;
    let comm = Communicator::from_env()?;
    let (rank, world) = (comm.rank(), comm.size());
    let mut shape = shape_of(&args)?;
    let cfg = ddp_config(&args);
    check_hooks(&args)?;
    let group = local_sgd_group(&args, &comm)?;
    let levels = local_sgd_levels(&args, rank, world)?;
    let setup = Setup {
        args: &args,
        comm: &comm,
        group,
        levels,
        shapes: mlp::Mlp::new(&shape, 0).shapes(),
    };
    let params: usize = mlp::Mlp::new(&shape, 0).params.iter().map(Vec::len).sum();
    if args.balance {
        shape.batch = timing::balance(&comm, &shape, &cfg)?;
    }
    if rank == 0 {
        println!(
            "# 02_ddp_mlp: {world} ranks, layers {}x{}, {params} parameters ({:.1} MiB of f32 \
             gradients), batch {} per rank{}",
            args.layers,
            args.hidden,
            (params * 4) as f64 / (1 << 20) as f64,
            shape.batch,
            if shape.idle_backward.is_zero() {
                String::new()
            } else {
                format!(
                    ", backward idle {:.2} ms",
                    shape.idle_backward.as_secs_f64() * 1e3
                )
            }
        );
    }
    if args.mode == ModeArg::All {
        return timing::run_every_mode(&setup, &shape, &cfg);
    }
    train(&setup, &shape, cfg)
}

/// Trains once with the flags' mode; rank 0 prints every step's loss (the mean over the ranks
/// that trained in it), with `--check` what the step's check found (any rank stops at the
/// first step that fails it), then the wall time per step, the held-out loss and the check's
/// verdict.
fn train(
    setup: &Setup<'_>,
    shape: &Shape,
    cfg: DdpConfig,
) -> Result<(), Box<dyn std::error::Error>> {
    let (args, comm) = (setup.args, setup.comm);
    let rank = comm.rank();
    let mode = match args.mode {
        ModeArg::Overlap | ModeArg::All => Mode::Overlap,
        ModeArg::InPlace => Mode::InPlace,
        ModeArg::After => Mode::After,
        ModeArg::Compute => Mode::ComputeOnly,
        ModeArg::Comm => Mode::CommOnly,
    };
    let references = References::new(setup, shape)?;
    let mut worst = 0.0f32;
    let mut wall: (Option<Instant>, (usize, Instant)) = (None, (0, Instant::now()));
    let run = mlp::Run {
        steps: setup.own_steps(rank),
        join: args.uneven,
        mode,
        cfg,
        hook: setup.hook()?,
        average: setup.averager()?,
    };
    let model = mlp::train_ddp_run(comm, shape, run, |step, model, ddp, r| {
        // The mean loss over the ranks that trained in this step.
        let mut loss = [r.loss, if r.joined { 0.0 } else { 1.0 }];
        ddp.comm().all_reduce(&mut loss, ReduceOp::Sum)?;
        let mut line = format!(
            "step {step:>3}  loss {:.6}  {:7.2} ms",
            loss[0] / loss[1].max(1.0),
            r.time.as_secs_f64() * 1e3
        );
        if args.uneven {
            line += &format!("  ranks training {}", loss[1]);
        }
        if let (true, Some(g)) = (args.check, &setup.group) {
            let diff = references.check_local_step(setup, g, step, model, &r, &mut line)?;
            worst = worst.max(diff);
        } else if args.check {
            let diff = references.check_step(setup, step, model, &mut line)?;
            worst = worst.max(diff);
        }
        if rank == 0 {
            println!("{line}");
        }
        // Wall time from the end of step 0 to the end of the last step, everything included
        // (this loss all-reduce too, where local SGD's steps wait for the other groups).
        wall.0.get_or_insert_with(Instant::now);
        wall.1 = (step, Instant::now());
        Ok(())
    })?;
    if rank == 0 {
        print_end(args, shape, comm.size(), &model, wall, worst);
    }
    Ok(())
}

/// Rank 0's last lines: the wall time per step (`wall`: the end of step 0, and the last step
/// and its end), the held-out loss of `model`, and with `--check` the verdict (`worst`: the
/// largest difference from the reference).
fn print_end(
    args: &Args,
    shape: &Shape,
    world: usize,
    model: &mlp::Mlp,
    wall: (Option<Instant>, (usize, Instant)),
    worst: f32,
) {
    if let Some(from) = wall.0 {
        let (last, to) = wall.1;
        if last > 0 {
            println!(
                "wall time per step, steps 1-{last}: {:.2} ms (the loss all-reduce included)",
                (to - from).as_secs_f64() * 1e3 / last as f64
            );
        }
    }
    // Held out while training stays below sample 2^20.
    let held_out = args.steps * world * shape.batch < 1 << 20;
    println!(
        "{} {:.6} (256 samples from 2^20 on{})",
        if held_out { "held-out loss" } else { "loss" },
        model.held_out_loss(shape),
        if held_out {
            ", which no step trains on"
        } else {
            ", which training reached"
        }
    );
    if !args.check {
        return;
    }
    if args.local_sgd > 0 {
        println!(
            "check passed: worst relative difference {worst:.2e} from one process that \
             trains each group's model, replicas identical within groups and everywhere \
             after every average over every rank"
        );
    } else if args.powersgd > 0 {
        println!(
            "check passed: replicas bit-identical; PowerSGD from step {}, where the model \
             leaves the uncompressed one ({worst:.2e} at most)",
            args.powersgd_start
        );
    } else if args.compress != CompressArg::None {
        println!(
            "check passed: replicas bit-identical; {:?} on the wire, where the model leaves \
             the uncompressed one ({worst:.2e} at most)",
            args.compress
        );
    } else {
        println!("check passed: worst relative difference {worst:.2e}, replicas bit-identical");
    }
}
