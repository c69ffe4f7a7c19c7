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

#[path = "mlp/mod.rs"]
mod mlp;

use std::sync::Arc;
use std::time::{Duration, Instant};

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

fn median_ms(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e3)
}

/// The slowest rank's median of `what` over `steps` steps of `mode` (step 0 left out).
fn timed(
    comm: &Communicator,
    shape: &Shape,
    cfg: &DdpConfig,
    mode: Mode,
    what: fn(&mlp::StepReport) -> Duration,
) -> Result<f64, Box<dyn std::error::Error>> {
    let mut v = Vec::new();
    mlp::train_ddp(comm, shape, 6, mode, cfg.clone(), |step, _, _, r| {
        if step > 0 {
            v.push(what(&r));
        }
        Ok(())
    })?;
    let mut ms = [median_ms(v)];
    comm.all_reduce(&mut ms, ReduceOp::Max)?;
    Ok(ms[0])
}

/// `--balance`: the batch at which backward takes about as long as the all-reduce of the
/// gradients. Backward's time is fitted as a line in the batch (it has a part that does not
/// grow with it: reading every weight) from `--batch` and twice that. Every rank computes it
/// from the same maxima, so every rank gets the same.
fn balance(
    comm: &Communicator,
    shape: &Shape,
    cfg: &DdpConfig,
) -> Result<usize, Box<dyn std::error::Error>> {
    let comm_ms = timed(comm, shape, cfg, Mode::CommOnly, |r| r.time)?;
    let b0 = shape.batch.max(1);
    let at = |batch: usize| {
        let s = Shape {
            batch,
            ..shape.clone()
        };
        timed(comm, &s, cfg, Mode::ComputeOnly, |r| r.backward)
    };
    let (t0, t1) = (at(b0)?, at(2 * b0)?);
    let per_sample = (t1 - t0) / b0 as f64;
    let batch = if per_sample > 0.0 {
        let fixed = t0 - per_sample * b0 as f64;
        // At most 16 times --batch: a slope lost in noise would otherwise ask for thousands.
        let most = (16 * b0).min(4096) as f64;
        ((comm_ms - fixed) / per_sample).round().clamp(1.0, most) as usize
    } else {
        b0
    };
    if comm.rank() == 0 {
        println!(
            "# balance: comm only {comm_ms:.2} ms; backward {t0:.2} ms at batch {b0}, {t1:.2} ms at \
             batch {}: batch {batch}",
            2 * b0
        );
    }
    Ok(batch)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.check
        && !matches!(
            args.mode,
            ModeArg::Overlap | ModeArg::InPlace | ModeArg::After
        )
    {
        return Err(
            "--check compares DDP training: use it with --mode overlap, in-place or after".into(),
        );
    }
    if args.uneven
        && !matches!(
            args.mode,
            ModeArg::Overlap | ModeArg::InPlace | ModeArg::After
        )
    {
        return Err(
            "--uneven trains with DDP: use it with --mode overlap, in-place or after".into(),
        );
    }
    let comm = Communicator::from_env()?;
    let (rank, world) = (comm.rank(), comm.size());
    let mut shape = Shape {
        input: args.input,
        hidden: args.hidden,
        layers: args.layers,
        output: args.output,
        batch: args.batch,
        lr: args.lr,
        idle_backward: Duration::try_from_secs_f64(args.idle_backward_ms / 1e3)
            .map_err(|e| format!("--idle-backward-ms {}: {e}", args.idle_backward_ms))?,
    };
    let cfg = DdpConfig {
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
    };
    // `--powersgd R`, `--compress` or `--local-sgd`: the hook, made afresh for every training
    // run.
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
    if args.local_sgd > 0
        && !matches!(
            args.mode,
            ModeArg::Overlap | ModeArg::InPlace | ModeArg::After
        )
    {
        // Its steps differ (one in P sends the parameters across): `all`'s medians would hide
        // that, and compute only would average the parameters too.
        return Err(
            "--local-sgd trains: use it with --mode overlap, in-place or after (mean step times: \
             scripts/local_sgd_bench.sh)"
                .into(),
        );
    }
    // Post-local SGD's group: `--local-sgd-group` consecutive ranks, or the node's ranks.
    let group = if args.local_sgd > 0 {
        let color = match args.local_sgd_group {
            0 => comm.node_index(),
            k => rank / k,
        };
        let color = u32::try_from(color)
            .map_err(|_| format!("rank {rank}: --local-sgd: group {color} is out of range"))?;
        let group = comm.split(Some(color), rank as i64)?;
        Some(Arc::new(group.ok_or_else(|| {
            format!("rank {rank}: --local-sgd: the split gave this rank no group")
        })?))
    } else {
        None
    };
    // `--local-sgd-levels`: the levels below the average over every rank.
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
    let averager = || -> Result<Option<mlp::Averager>, oxccl::ddp::DdpError> {
        if args.local_sgd == 0 {
            return Ok(None);
        }
        if levels.is_empty() {
            let a = ModelAverager::new(args.local_sgd, args.local_sgd_start);
            return Ok(Some(a.into()));
        }
        // Collective over the communicator (one split per level): every rank makes one per run.
        let a = HierarchicalAverager::by_group_sizes(&comm, &levels, args.local_sgd_start)?;
        Ok(Some(mlp::Averager::Hierarchical(a)))
    };
    // The size of the groups averaged after step `step`'s update, `world` for every rank.
    let averaged_over = |step: usize| -> Option<usize> {
        let (s, start) = (step as u64, args.local_sgd_start);
        if args.local_sgd == 0 || s < start {
            return None;
        }
        if levels.is_empty() {
            return (s - start).is_multiple_of(args.local_sgd).then_some(world);
        }
        levels
            .iter()
            .rev()
            .find(|&&(p, _)| p > 0 && s.is_multiple_of(p))
            .map(|&(_, k)| k)
    };
    let shapes = mlp::Mlp::new(&shape, 0).shapes();
    let hook = || -> Result<Option<Box<dyn CommHook>>, oxccl::ddp::DdpError> {
        if let Some(group) = &group {
            // Collective over the group (it learns its members' ranks): every rank makes one
            // per run, at the same place.
            let h = PostLocalSgd::new(&comm, Arc::clone(group), args.local_sgd_start)?;
            return Ok(Some(Box::new(h)));
        }
        if args.powersgd > 0 {
            let cfg = PowerSgdConfig {
                rank: args.powersgd,
                start_step: args.powersgd_start,
                ..PowerSgdConfig::default()
            };
            return Ok(Some(Box::new(PowerSgd::new(cfg, shapes.clone()))));
        }
        Ok(match args.compress {
            CompressArg::None => None,
            CompressArg::Fp16 => Some(Box::new(CompressHook::fp16())),
            CompressArg::Bf16 => Some(Box::new(CompressHook::bf16())),
        })
    };
    // Steps of data per rank (`--uneven`: rank r runs out r steps early).
    let own_steps = |r: usize| {
        if args.uneven {
            args.steps.saturating_sub(r).max(1)
        } else {
            args.steps
        }
    };
    let params: usize = mlp::Mlp::new(&shape, 0).params.iter().map(Vec::len).sum();
    if args.balance {
        shape.batch = balance(&comm, &shape, &cfg)?;
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
        let modes = [
            ("compute only", Mode::ComputeOnly, Overlap::Auto),
            ("comm only", Mode::CommOnly, Overlap::Auto),
            ("backward then all-reduce", Mode::After, Overlap::Auto),
            ("ddp overlap", Mode::Overlap, Overlap::On),
            ("ddp, overlap off", Mode::Overlap, Overlap::Off),
            ("ddp in place", Mode::InPlace, Overlap::On),
            ("ddp in place, overlap off", Mode::InPlace, Overlap::Off),
        ];
        // What Overlap::Auto picks for these ranks (agreed across ranks, as `Ddp::new` does).
        let mut auto = [u8::from(comm.node_holds(2))];
        comm.all_reduce(&mut auto, ReduceOp::Min)?;
        // Per mode: step times, backward passes, and finish/sync calls.
        let n = modes.len();
        let mut times: Vec<Vec<Duration>> = vec![Vec::new(); 4 * n];
        for _ in 0..args.rounds {
            for (k, &(_, mode, overlap)) in modes.iter().enumerate() {
                let cfg = DdpConfig {
                    overlap,
                    ..cfg.clone()
                };
                let steps = args.steps;
                let run = mlp::Run {
                    steps,
                    join: false,
                    mode,
                    cfg,
                    hook: hook()?,
                    average: averager()?,
                };
                mlp::train_ddp_run(&comm, &shape, run, |step, _, _, r| {
                    if step > 0 {
                        // Step 0 warms up.
                        times[k].push(r.time);
                        times[n + k].push(r.backward);
                        times[2 * n + k].push(r.exposed);
                        times[3 * n + k].push(r.time.saturating_sub(r.backward + r.exposed));
                    }
                    Ok(())
                })?;
            }
        }
        // The slowest rank sets the pace: report the maximum of every rank's median.
        let mut med: Vec<f64> = times.into_iter().map(median_ms).collect();
        comm.all_reduce(&mut med, ReduceOp::Max)?;
        if rank == 0 {
            println!(
                "# median step time over {} rounds x {} steps (max over ranks); of it, backward, \
                 the wait in finish() or sync() (what backward did not hide), and the rest \
                 (forward, update)",
                args.rounds,
                args.steps.saturating_sub(1)
            );
            for (k, (name, mode, _)) in modes.iter().enumerate() {
                print!("{name:>26}: {:8.2} ms", med[k]);
                if *mode != Mode::CommOnly {
                    print!("   backward {:7.2} ms", med[n + k]);
                }
                if *mode != Mode::ComputeOnly {
                    print!("   finish/sync {:7.2} ms", med[2 * n + k]);
                }
                if *mode != Mode::CommOnly {
                    print!("   rest {:7.2} ms", med[3 * n + k]); // forward, update
                }
                println!();
            }
            let (comm_ms, after, overlap, off, bwd) = (med[1], med[2], med[3], med[4], med[n]);
            let (in_place, in_place_off) = (med[5], med[6]);
            // Overlap can hide at most the shorter of backward and the all-reduce.
            let hideable = bwd.min(comm_ms);
            if after > 0.0 && hideable > 0.0 {
                println!(
                    "# overlap / (backward then all-reduce) = {:.3}",
                    overlap / after
                );
                let node = comm.node_share();
                let (pick, picked, picked_in_place) = if auto[0] == 1 {
                    ("on", overlap, in_place)
                } else {
                    ("off", off, in_place_off)
                };
                println!(
                    "# overlap off / (backward then all-reduce) = {:.3}; in place: on {:.3}, off \
                     {:.3}",
                    off / after,
                    in_place / after,
                    in_place_off / after
                );
                println!(
                    "# Overlap::Auto picks {pick} here ({} CPUs for {} ranks on rank 0's node): \
                     {:.3}, in place {:.3}",
                    node.cpus.map_or("unknown".into(), |c| c.to_string()),
                    node.ranks,
                    picked / after,
                    picked_in_place / after
                );
                println!(
                    "# at best (min(backward, comm only) hidden) = {:.3}; hidden: {:.0} % of that",
                    (after - hideable) / after,
                    100.0 * (after - overlap) / hideable
                );
                // What each step still waits for after backward: the whole all-reduce after
                // `sync`, what overlap left of it in `finish()` (the backward column says what
                // overlapping cost backward instead).
                let (sync_ms, fin, fin_in_place) = (med[2 * n + 2], med[2 * n + 3], med[2 * n + 5]);
                if sync_ms > 0.0 {
                    println!(
                        "# left after backward: sync {sync_ms:.2} ms; overlapping, finish() {fin:.2} \
                         ms ({:.0} % of sync), in place {fin_in_place:.2} ms ({:.0} %)",
                        100.0 * fin / sync_ms,
                        100.0 * fin_in_place / sync_ms
                    );
                }
            } else {
                println!("# no ratios: no step was timed (--steps 2 or more, --rounds 1 or more)");
            }
        }
        return Ok(());
    }

    let mode = match args.mode {
        ModeArg::Overlap | ModeArg::All => Mode::Overlap,
        ModeArg::InPlace => Mode::InPlace,
        ModeArg::After => Mode::After,
        ModeArg::Compute => Mode::ComputeOnly,
        ModeArg::Comm => Mode::CommOnly,
    };
    let reference = if args.check && group.is_none() {
        let steps: Vec<usize> = (0..world).map(own_steps).collect();
        mlp::train_reference(&shape, &steps)
    } else {
        Vec::new()
    };
    // With --check, a communicator per level below every rank's (`rank / K`, as the
    // averager's): its replicas must be identical after the level's averages.
    let level_groups = if args.check {
        let mut made = Vec::new();
        for &(_, k) in levels.iter().filter(|&&(_, k)| k < world) {
            let color = u32::try_from(rank / k)
                .map_err(|_| format!("rank {rank}: level group {} out of range", rank / k))?;
            let g = comm.split(Some(color), rank as i64)?;
            made.push(g.ok_or_else(|| format!("rank {rank}: the split gave no level group"))?);
        }
        made
    } else {
        Vec::new()
    };
    // Post-local SGD's reference: one model per group of consecutive ranks.
    let local_reference = match &group {
        Some(g) if args.check => {
            let size = g.size();
            // Every rank learns whether every group qualifies (consecutive ranks, all of one
            // size), so that all stop or none.
            let fits = u64::from(world % size == 0 && g.rank() == rank % size);
            let mut all = [fits, size as u64, u64::MAX - size as u64];
            comm.all_reduce(&mut all, ReduceOp::Min)?;
            if all[0] == 0 || all[1] != u64::MAX - all[2] {
                return Err(format!(
                    "rank {rank}: --check with --local-sgd needs groups of consecutive ranks, \
                     all of one size: some group is not (this rank is rank {} of a group of \
                     {size})",
                    g.rank()
                )
                .into());
            }
            if let Some(&(_, k)) = levels.iter().find(|&&(_, k)| !k.is_multiple_of(size)) {
                return Err(format!(
                    "rank {rank}: --check with --local-sgd-levels needs levels of whole groups: \
                     {k} ranks are not groups of {size}"
                )
                .into());
            }
            let (start, period) = (args.local_sgd_start as usize, args.local_sgd as usize);
            if levels.is_empty() {
                mlp::train_reference_local(&shape, world, size, args.steps, start, period)
            } else {
                mlp::train_reference_groups(&shape, world, size, args.steps, start, averaged_over)
            }
        }
        _ => Vec::new(),
    };
    let mut worst = 0.0f32;
    let mut wall: (Option<Instant>, (usize, Instant)) = (None, (0, Instant::now()));
    let run = mlp::Run {
        steps: own_steps(rank),
        join: args.uneven,
        mode,
        cfg,
        hook: hook()?,
        average: averager()?,
    };
    let model = mlp::train_ddp_run(&comm, &shape, run, |step, model, ddp, r| {
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
        if let (true, Some(g)) = (args.check, &group) {
            // Within 1e-5 of the group's reference model; identical within the group, and
            // across groups before local SGD and after every average over every rank.
            let diff = mlp::max_rel_diff(model, &local_reference[step][rank / g.size()]);
            worst = worst.max(diff);
            let same = mlp::replicas_identical(g, model)?;
            if r.averaged != averaged_over(step).is_some() {
                return Err(format!(
                    "rank {rank}: step {step}: averaged: {}, expected {}",
                    r.averaged,
                    averaged_over(step).is_some()
                )
                .into());
            }
            let global = (step as u64) < args.local_sgd_start || averaged_over(step) == Some(world);
            let all_same = mlp::replicas_identical(ddp.comm(), model)?;
            // After a level's average, its group's replicas too.
            let mut level_same = true;
            for lg in &level_groups {
                let same_here = mlp::replicas_identical(lg, model)?;
                level_same &= same_here || averaged_over(step) != Some(lg.size());
            }
            line += &format!(
                "  max rel diff vs 1 process {diff:.2e}  identical in the group: {same}, \
                 everywhere: {all_same}{}",
                if r.averaged { "  (averaged)" } else { "" }
            );
            if diff > 1e-5 || !same || (global && !all_same) || !level_same {
                return Err(format!("rank {rank}: step {step}: {line}").into());
            }
        } else if args.check {
            let diff = mlp::max_rel_diff(model, &reference[step]);
            worst = worst.max(diff);
            let same = mlp::replicas_identical(ddp.comm(), model)?;
            line += &format!("  max rel diff vs 1 process {diff:.2e}  replicas identical: {same}");
            // PowerSGD leaves the exact model once it compresses, 16-bit floats at once.
            let exact = args.compress == CompressArg::None
                && (args.powersgd == 0 || (step as u64) < args.powersgd_start);
            if (exact && diff > 1e-5) || !same {
                return Err(format!("rank {rank}: step {step}: {line}").into());
            }
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
    if let (0, Some(from)) = (rank, wall.0) {
        let (last, to) = wall.1;
        if last > 0 {
            println!(
                "wall time per step, steps 1-{last}: {:.2} ms (the loss all-reduce included)",
                (to - from).as_secs_f64() * 1e3 / last as f64
            );
        }
    }
    if rank == 0 {
        // Held out while training stays below sample 2^20.
        let held_out = args.steps * world * shape.batch < 1 << 20;
        println!(
            "{} {:.6} (256 samples from 2^20 on{})",
            if held_out { "held-out loss" } else { "loss" },
            model.held_out_loss(&shape),
            if held_out {
                ", which no step trains on"
            } else {
                ", which training reached"
            }
        );
    }
    if args.check && rank == 0 {
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
    Ok(())
}
