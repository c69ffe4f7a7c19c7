//! DDP end to end on the MLP of examples/02_ddp_mlp.rs: 4 ranks x 10 steps must match one
//! process trained on the concatenated batch (parameters within 1e-5 relative) and keep every
//! rank's parameters bit-identical after every step. Once with ranks as threads (every way of
//! feeding gradients: `grad_ready`, computed in the bucket slots, each with overlap on and off,
//! and `sync`), once with ranks as processes started by `oxccl launch` (each rank a different one
//! of the four `grad_ready` and slot ways, two of them waiting in backward as
//! `--idle-backward-ms` does: ranks may differ).
//!
//! With uneven data (`UnevenInputs::DivideByActiveRanks`, rank r having `UNEVEN[r]` steps, the
//! ranks out of data standing in with `join_step`), the reference is one process on the
//! concatenated batches of the ranks still training, threads and processes alike.
//!
//! With the PowerSGD hook (rank 2, from step 2), the model must match the reference until
//! compression starts, then leave it, with the held-out loss after the last step at least halfway
//! from the start to the exact model's, the replicas identical
//! throughout: threads (every rank through `sync`, and ranks feeding in different ways) and
//! processes.
//!
//! With post-local SGD (`PostLocalSgd` from step `LOCAL_START`, groups of 2 ranks, a
//! `ModelAverager` every `LOCAL_PERIOD` steps), each rank's model must match one process that
//! trains each group's model on its ranks' batches and averages them alike (within 1e-5), be
//! identical within its group after every step and everywhere after every average, and differ
//! between groups in the steps between: threads on 2 simulated nodes (the groups are the nodes,
//! TCP between them) and processes (groups of consecutive ranks).
//!
//! The process ranks are this test binary: `rank_entry` does nothing in a normal run and trains
//! ([`play_rank`]) when `OXCCL_TEST_DDP` is set.

#[path = "../../examples/mlp/mod.rs"]
#[allow(dead_code)]
pub(crate) mod mlp;

use std::time::Duration;

use mlp::{Mode, Shape};
use oxccl::comm::harness::{spawn_world, spawn_world_on_nodes};
use oxccl::comm::{Communicator, Config};
use oxccl::ddp::{
    CommHook, DdpConfig, HierarchicalAverager, ModelAverager, Overlap, PostLocalSgd, PowerSgd,
    PowerSgdConfig, UnevenInputs,
};

use crate::common;

const STEPS: usize = 10;
const WORLD: usize = 4;
/// Steps of data per rank in the uneven runs: rank 0 is not the last to run out.
const UNEVEN: [usize; WORLD] = [7, 10, 3, 10];

/// Small buckets so that the MLP's gradients span several of them.
fn cfg(overlap: Overlap) -> DdpConfig {
    DdpConfig {
        bucket_cap_bytes: 8 << 10,
        first_bucket_bytes: 1 << 10,
        sync_in_place_bytes: 4 << 10,
        overlap,
        ..DdpConfig::default()
    }
}

/// Steps before PowerSGD starts compressing in the PowerSGD runs.
const PSGD_START: u64 = 2;

/// The PowerSGD hook of those runs: rank 2, compressing the MLP's three weights of 64 rows
/// (64 x 32 and twice 64 x 64; the 4 x 64 output weight would not shrink enough) from
/// step `PSGD_START`.
fn powersgd() -> Box<dyn CommHook> {
    let shapes = mlp::Mlp::new(&Shape::default(), 0).shapes();
    Box::new(PowerSgd::new(
        PowerSgdConfig {
            rank: 2,
            start_step: PSGD_START,
            ..PowerSgdConfig::default()
        },
        shapes,
    ))
}

/// Trains with DDP on `comm`; after every step checks the model against the reference and the
/// replicas against each other. Returns the worst relative difference. `idle` is
/// `Shape::idle_backward`: backward's waits, which change when gradients arrive, not what they
/// are. `steps`: this rank's steps of data, every rank's `STEPS` when `None`; else the rank
/// stands in for the others' steps after its own (`join_step`). With `psgd` (the PowerSGD
/// hook), the model must match the reference only before compression starts, and must then
/// leave it while its loss still falls; the replicas must stay identical throughout.
fn train_and_check(
    comm: &Communicator,
    mode: Mode,
    overlap: Overlap,
    idle: Duration,
    reference: &[mlp::Mlp],
    steps: Option<usize>,
    psgd: bool,
) -> Result<f32, String> {
    let shape = Shape {
        idle_backward: idle,
        ..Shape::default()
    };
    let cfg = DdpConfig {
        uneven_inputs: match steps {
            Some(_) => UnevenInputs::DivideByActiveRanks,
            None => UnevenInputs::Off,
        },
        ..cfg(overlap)
    };
    let mut worst = 0.0f32;
    let mut done = 0;
    let mut last = None;
    let run = mlp::Run {
        steps: steps.unwrap_or(STEPS),
        join: steps.is_some(),
        mode,
        cfg,
        hook: psgd.then(powersgd),
        average: None,
    };
    mlp::train_ddp_run(comm, &shape, run, |step, model, ddp, r| {
        done += 1;
        if r.joined != (step >= steps.unwrap_or(STEPS)) {
            return Err(format!("step {step}: joined is {}", r.joined).into());
        }
        let want = match overlap {
            Overlap::On => Some(true),
            Overlap::Off => Some(false),
            Overlap::Auto => None,
        };
        if want.is_some_and(|w| w != ddp.overlaps()) {
            return Err(format!("asked for {overlap:?}, overlaps() is {}", ddp.overlaps()).into());
        }
        let diff = mlp::max_rel_diff(model, &reference[step]);
        if psgd && step as u64 >= PSGD_START {
            last = Some(model.clone());
            if step == STEPS - 1 && diff < 1e-4 {
                return Err(format!(
                    "step {step}: still {diff:e} from the uncompressed reference: was \
                         anything compressed?"
                )
                .into());
            }
        } else {
            worst = worst.max(diff);
            if diff > 1e-5 {
                return Err(format!("step {step}: max relative difference {diff:e}").into());
            }
        }
        if !mlp::replicas_identical(ddp.comm(), model)? {
            return Err(format!("step {step}: replicas differ").into());
        }
        Ok(())
    })
    .map_err(|e| format!("rank {}: {mode:?}, {overlap:?}: {e}", comm.rank()))?;
    if psgd {
        let shape = Shape::default();
        let (start, exact) = (
            mlp::Mlp::new(&shape, 0).held_out_loss(&shape),
            reference[STEPS - 1].held_out_loss(&shape),
        );
        let got = mlp::Mlp::held_out_loss(&last.ok_or("no step")?, &shape);
        // Compressed, the model must still learn: at least half of what the exact one does
        // (measured: 0.2054 at the start, 0.1577 uncompressed, 0.1600 with PowerSGD).
        if got > start - 0.5 * (start - exact) {
            return Err(format!(
                "rank {}: PowerSGD: held-out loss {got} after {STEPS} steps, from {start}; \
                 uncompressed {exact}",
                comm.rank()
            ));
        }
    }
    if done != reference.len() {
        return Err(format!(
            "rank {}: {done} steps, the reference has {}",
            comm.rank(),
            reference.len()
        ));
    }
    Ok(worst)
}

/// Post-local SGD in the local-SGD runs: from this step, averaged every `LOCAL_PERIOD` steps.
const LOCAL_START: usize = 2;
const LOCAL_PERIOD: usize = 3;

/// Trains with DDP, the `PostLocalSgd` hook on `group` (consecutive ranks) and a
/// `ModelAverager`; checks every step against `reference` (`mlp::train_reference_local`'s) and
/// the replicas within the group and across groups. Returns the worst relative difference.
fn train_and_check_local(
    comm: &Communicator,
    group: Communicator,
    mode: Mode,
    overlap: Overlap,
    reference: &[Vec<mlp::Mlp>],
) -> Result<f32, String> {
    let rank = comm.rank();
    let g = group.size();
    if g == 0 || group.rank() != rank % g {
        return Err(format!(
            "rank {rank}: not rank {} of a group of {g}",
            rank % g
        ));
    }
    let check = std::sync::Arc::new(group);
    let run = mlp::Run {
        steps: STEPS,
        join: false,
        mode,
        cfg: cfg(overlap),
        hook: Some(Box::new(
            PostLocalSgd::new(comm, std::sync::Arc::clone(&check), LOCAL_START as u64)
                .map_err(|e| e.to_string())?,
        )),
        average: Some(ModelAverager::new(LOCAL_PERIOD as u64, LOCAL_START as u64).into()),
    };
    let mut worst = 0.0f32;
    mlp::train_ddp_run(comm, &Shape::default(), run, |step, model, ddp, r| {
        let diff = mlp::max_rel_diff(model, &reference[step][rank / g]);
        worst = worst.max(diff);
        let due = step >= LOCAL_START && (step - LOCAL_START).is_multiple_of(LOCAL_PERIOD);
        if r.averaged != due {
            return Err(format!("step {step}: averaged {}, due {due}", r.averaged).into());
        }
        let in_group = mlp::replicas_identical(&check, model)?;
        let everywhere = mlp::replicas_identical(ddp.comm(), model)?;
        // Between averages the groups train apart: their models must differ.
        let global = step < LOCAL_START || due;
        if diff > 1e-5 || !in_group || everywhere != global {
            return Err(format!(
                "step {step}: max relative difference {diff:e}, identical in the group \
                 {in_group}, everywhere {everywhere} (expected {global})"
            )
            .into());
        }
        Ok(())
    })
    .map_err(|e| format!("rank {rank}: {mode:?}, {overlap:?}: {e}"))?;
    Ok(worst)
}

/// How rank `r` feeds its gradients in the runs whose ranks differ: every pair of ranks
/// {0, 1} and {2, 3} (the local-SGD groups) mixes both modes and both overlaps.
fn mixed(r: usize) -> (Mode, Overlap) {
    (
        [Mode::Overlap, Mode::InPlace, Mode::InPlace, Mode::Overlap][r % 4],
        [Overlap::On, Overlap::Off, Overlap::On, Overlap::Off][r % 4],
    )
}

#[test]
fn local_sgd_ddp_matches_one_process_per_group_threads() {
    let reference = mlp::train_reference_local(
        &Shape::default(),
        WORLD,
        2,
        STEPS,
        LOCAL_START,
        LOCAL_PERIOD,
    );
    // Two simulated nodes of two ranks; the node's ranks are the group.
    for how in [mixed as fn(usize) -> (Mode, Overlap), |_| {
        (Mode::After, Overlap::Auto)
    }] {
        let out = spawn_world_on_nodes(WORLD, 2, Config::default(), |comm| {
            let color = u32::try_from(comm.node_index()).expect("a node index");
            let group = comm.split(Some(color), comm.rank() as i64)?;
            let (mode, overlap) = how(comm.rank());
            Ok(train_and_check_local(
                &comm,
                group.expect("a group"),
                mode,
                overlap,
                &reference,
            ))
        });
        for r in out {
            r.unwrap().unwrap();
        }
    }
}

/// Post-local SGD with three tiers: every rank alone (its gradients averaged over itself), its
/// pair {0, 1} or {2, 3} averaged every 2 steps and every rank every 4 (a
/// `HierarchicalAverager`, from step `LOCAL_START`), against one process per rank that averages
/// the models alike.
#[test]
fn hierarchical_local_sgd_matches_one_process_per_rank_threads() {
    let averaged = |s: usize| match s {
        s if s < LOCAL_START => None,
        s if s.is_multiple_of(4) => Some(WORLD),
        s if s.is_multiple_of(2) => Some(2),
        _ => None,
    };
    let shape = Shape::default();
    let reference = mlp::train_reference_groups(&shape, WORLD, 1, STEPS, LOCAL_START, averaged);
    let out = spawn_world(WORLD, Config::default(), |comm| {
        let rank = comm.rank();
        let alone = comm.split(Some(rank as u32), 0)?.expect("a group");
        let pair = comm
            .split(Some((rank / 2) as u32), rank as i64)?
            .expect("a pair");
        let levels = [(2, 2), (4, WORLD)];
        let averager = HierarchicalAverager::by_group_sizes(&comm, &levels, LOCAL_START as u64)
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        let (mode, overlap) = mixed(rank);
        let run = mlp::Run {
            steps: STEPS,
            join: false,
            mode,
            cfg: cfg(overlap),
            hook: Some(Box::new(
                PostLocalSgd::new(&comm, alone, LOCAL_START as u64).expect("hook"),
            )),
            average: Some(mlp::Averager::Hierarchical(averager)),
        };
        let mut worst = 0.0f32;
        let r = mlp::train_ddp_run(&comm, &shape, run, |step, model, ddp, r| {
            let diff = mlp::max_rel_diff(model, &reference[step][rank]);
            worst = worst.max(diff);
            let over = averaged(step);
            let in_pair = mlp::replicas_identical(&pair, model)?;
            let everywhere = mlp::replicas_identical(ddp.comm(), model)?;
            let (want_pair, want_all) = match over {
                _ if step < LOCAL_START => (true, true),
                Some(WORLD) => (true, true),
                Some(_) => (true, false),
                None => (false, false),
            };
            if diff > 1e-5
                || r.averaged != over.is_some()
                || in_pair != want_pair
                || everywhere != want_all
            {
                return Err(format!(
                    "rank {rank} step {step}: diff {diff:e}, averaged {} (over {over:?}), \
                     identical in the pair {in_pair}, everywhere {everywhere}",
                    r.averaged
                )
                .into());
            }
            Ok(())
        });
        Ok(r.map(|_| worst).map_err(|e| e.to_string()))
    });
    for r in out {
        let worst = r.unwrap().unwrap();
        assert!(worst <= 1e-5, "{worst}");
    }
}

#[test]
fn local_sgd_ddp_matches_one_process_per_group_processes() {
    let out = common::launch_self(WORLD, &[("OXCCL_TEST_DDP", "localsgd")]);
    common::assert_all_ok(&out, WORLD);
}

/// `train_and_check` on `WORLD` threaded ranks for each (mode, overlap); `steps`: every rank's
/// steps of data when uneven.
fn threads(runs: &[(Mode, Overlap)], reference: &[mlp::Mlp], steps: Option<&[usize; WORLD]>) {
    for &(mode, overlap) in runs {
        let out = spawn_world(WORLD, Config::default(), |comm| {
            let own = steps.map(|s| s[comm.rank()]);
            Ok(train_and_check(
                &comm,
                mode,
                overlap,
                Duration::ZERO,
                reference,
                own,
                false,
            ))
        });
        for r in out {
            let worst = r.unwrap().unwrap();
            assert!(worst <= 1e-5);
        }
    }
}

#[test]
fn uneven_ddp_matches_one_process_on_the_batches_of_the_ranks_training_threads() {
    let reference = mlp::train_reference(&Shape::default(), &UNEVEN);
    // Once ranks run out, the reference's steps are smaller than the full one's.
    let full = mlp::train_reference(&Shape::default(), &[STEPS; WORLD]);
    assert!(mlp::max_rel_diff(&reference[STEPS - 1], &full[STEPS - 1]) > 1e-4);
    threads(
        &[
            (Mode::Overlap, Overlap::On),
            (Mode::InPlace, Overlap::Off),
            (Mode::After, Overlap::Auto),
        ],
        &reference,
        Some(&UNEVEN),
    );
}

#[test]
fn ddp_matches_one_process_on_the_concatenated_batch_threads() {
    let reference = mlp::train_reference(&Shape::default(), &[STEPS; WORLD]);
    // The reference moves: a test that compares against the initial model would pass trivially.
    assert!(mlp::max_rel_diff(&reference[STEPS - 1], &mlp::Mlp::new(&Shape::default(), 0)) > 1e-3);
    threads(
        &[
            (Mode::Overlap, Overlap::On),
            (Mode::Overlap, Overlap::Off),
            (Mode::InPlace, Overlap::On),
            (Mode::InPlace, Overlap::Off),
            (Mode::After, Overlap::Auto),
        ],
        &reference,
        None,
    );
}

/// Plays one rank when started by `oxccl launch` from the tests below (`OXCCL_TEST_DDP` set;
/// does nothing otherwise).
pub(crate) fn play_rank() {
    if std::env::var("OXCCL_TEST_DDP").is_err() {
        return;
    }
    let comm = Communicator::from_env().expect("communicator from the environment");
    if std::env::var("OXCCL_TEST_DDP").is_ok_and(|v| v == "localsgd") {
        // Groups of two consecutive ranks on the one node `oxccl launch` starts.
        let reference = mlp::train_reference_local(
            &Shape::default(),
            comm.size(),
            2,
            STEPS,
            LOCAL_START,
            LOCAL_PERIOD,
        );
        let group = comm
            .split(Some((comm.rank() / 2) as u32), comm.rank() as i64)
            .expect("split")
            .expect("a group");
        let (mode, overlap) = mixed(comm.rank());
        match train_and_check_local(&comm, group, mode, overlap, &reference) {
            Ok(worst) => println!("RESULT rank={} ok worst={worst:e}", comm.rank()),
            Err(e) => {
                println!("RESULT rank={} FAILED {e}", comm.rank());
                std::process::exit(1);
            }
        }
        return;
    }
    // OXCCL_TEST_DDP=uneven: rank r has UNEVEN[r] steps of data; =powersgd: the PowerSGD hook.
    let uneven = std::env::var("OXCCL_TEST_DDP").is_ok_and(|v| v == "uneven");
    let psgd = std::env::var("OXCCL_TEST_DDP").is_ok_and(|v| v == "powersgd");
    let steps = uneven.then(|| UNEVEN[comm.rank() % WORLD]);
    let reference = if uneven {
        mlp::train_reference(&Shape::default(), &UNEVEN[..comm.size()])
    } else {
        mlp::train_reference(&Shape::default(), &vec![STEPS; comm.size()])
    };
    // Even ranks overlap, odd ones all-reduce in finish(); ranks 0 and 1 hand their gradients to
    // grad_ready, 2 and 3 compute them in the bucket slots: the collectives are the same.
    let overlap = if comm.rank().is_multiple_of(2) {
        Overlap::On
    } else {
        Overlap::Off
    };
    let mode = if comm.rank() % 4 < 2 {
        Mode::Overlap
    } else {
        Mode::InPlace
    };
    // Ranks 2 and 3 also wait 2 ms in every backward pass (`--idle-backward-ms`), so their
    // gradients come late.
    let idle = Duration::from_millis(if comm.rank() % 4 < 2 { 0 } else { 2 });
    match train_and_check(&comm, mode, overlap, idle, &reference, steps, psgd) {
        Ok(worst) => println!("RESULT rank={} ok worst={worst:e}", comm.rank()),
        Err(e) => {
            println!("RESULT rank={} FAILED {e}", comm.rank());
            std::process::exit(1);
        }
    }
}

#[test]
fn ddp_matches_one_process_on_the_concatenated_batch_processes() {
    let out = common::launch_self(WORLD, &[("OXCCL_TEST_DDP", "1")]);
    common::assert_all_ok(&out, WORLD);
}

#[test]
fn uneven_ddp_matches_one_process_on_the_batches_of_the_ranks_training_processes() {
    let out = common::launch_self(WORLD, &[("OXCCL_TEST_DDP", "uneven")]);
    common::assert_all_ok(&out, WORLD);
}

#[test]
fn powersgd_ddp_keeps_replicas_identical_and_learns_threads() {
    let reference = mlp::train_reference(&Shape::default(), &[STEPS; WORLD]);
    // Ranks feed gradients in different ways, as in the process test: the hook's two rounds
    // must line up whatever each rank's mode and overlap. Then every rank through `sync`.
    let by_sync = |_: usize| (Mode::After, Overlap::Auto);
    for how in [
        &mixed as &(dyn Fn(usize) -> (Mode, Overlap) + Sync),
        &by_sync,
    ] {
        let out = spawn_world(WORLD, Config::default(), |comm| {
            let (mode, overlap) = how(comm.rank());
            let none = Duration::ZERO;
            Ok(train_and_check(
                &comm, mode, overlap, none, &reference, None, true,
            ))
        });
        for r in out {
            r.unwrap().unwrap();
        }
    }
}

#[test]
fn powersgd_ddp_keeps_replicas_identical_and_learns_processes() {
    let out = common::launch_self(WORLD, &[("OXCCL_TEST_DDP", "powersgd")]);
    common::assert_all_ok(&out, WORLD);
}
